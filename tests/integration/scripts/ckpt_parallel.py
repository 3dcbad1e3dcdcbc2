"""Rank side of the checkpoint tests of parallel layouts (CPU, gloo); run under torchrun.

    ckpt_parallel.py LAYOUT --uri U --dump D [--restore] [--split a|b|c|d] [--tp N] [--sync] [--optim dcp|rank]
                     [--then LAYOUT --uri U2 --dump D2 ...]

LAYOUT is ``tp`` (parallelize_module, Colwise/Rowwise over every rank), ``dp_tp`` (FSDP2 over "dp"
and tensor parallel over "tp", ``--tp`` wide), ``pp`` (each rank keeps only its stage's layers,
as ``--split`` says) or ``shards`` (tensor-parallel shards as plain tensors: every rank's weights
differ under the same names). Trains 2 steps (the loader position and a draw of the torch RNG
differ per rank), saves step 2 and dumps ``D.r<rank>.json``: the loader position, the next RNG
draw and a digest (sum) of every model and optimizer tensor by name (DTensors whole). With
``--restore`` it builds the model with other weights, restores and dumps the same; an error
of save() or restore() is dumped as ``{"error": ...}``. ``--optim rank`` keeps the optimizer as
a per-rank object (``StageOptimizer``, README's recipe for pipeline stages), ``--optim none``
leaves it out of the state.

``--then`` starts another case in the same process group (its own URI, dump, model and
Checkpointer), run after the one before it has dumped and closed: the tests run their independent
cases of one world size in one torchrun, since starting the ranks (importing torch) is most of
each case's cost.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import torch
import torch.distributed as dist
from ckpt_state import exit_without_teardown, split_cases
from torch import nn

from agent.checkpoint import Checkpointer

SPLITS = {
    "a": [["l0", "l1"], ["l2", "l3"]],
    "b": [["l0"], ["l1", "l2", "l3"]],
    "c": [["l0"], ["l2", "l3"]],
    "d": [["l0", "l1", "l2", "l3"], []],  # rank 1's stage holds no parameters
}


class Loader:
    """A per-rank data position: every rank's differs."""

    def __init__(self) -> None:
        self.pos = 0

    def state_dict(self) -> dict[str, Any]:
        return {"pos": self.pos}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.pos = state["pos"]


class StageOptimizer:
    """An optimizer kept per rank, checked against the parameter names it was saved with."""

    def __init__(self, optim: torch.optim.Optimizer, names: list[str]) -> None:
        self.optim, self.names = optim, names

    def state_dict(self) -> dict[str, Any]:
        return {"names": self.names, "optim": self.optim.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["names"] != self.names:
            raise ValueError(f"saved for parameters {state['names']}, this stage has {self.names}")
        self.optim.load_state_dict(state["optim"])


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l0, self.l1, self.l2, self.l3 = nn.Linear(4, 8), nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for name in ("l0", "l1", "l2", "l3"):
            if hasattr(self, name):
                x = getattr(self, name)(x)
        return x


def build(args: argparse.Namespace, rank: int, world: int) -> nn.Module:
    torch.manual_seed(50 if args.restore else 0)
    model = Model()
    if args.layout in ("tp", "dp_tp"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        plan = {"l0": ColwiseParallel(), "l1": RowwiseParallel(), "l2": ColwiseParallel(), "l3": RowwiseParallel()}
        if args.layout == "tp":
            return parallelize_module(model, init_device_mesh("cpu", (world,)), plan)
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world // args.tp, args.tp), mesh_dim_names=("dp", "tp"))
        parallelize_module(model, mesh["tp"], plan)
        fully_shard(model, mesh=mesh["dp"])
        return model
    if args.layout == "pp":
        for name in ("l0", "l1", "l2", "l3"):
            if name not in SPLITS[args.split][rank]:
                delattr(model, name)
        return model
    torch.manual_seed(rank + (50 if args.restore else 0))  # shards: every rank's weights its own
    return Model()


def digest(model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, float]:
    """(collective for DTensors) The sum of every tensor, by name; a DTensor's over all of it."""
    from torch.distributed.tensor import DTensor

    def total(t: torch.Tensor) -> float:
        return float((t.full_tensor() if isinstance(t, DTensor) else t).double().sum())

    out = {f"model.{k}": total(v) for k, v in model.state_dict().items()}
    names = {id(p): n for n, p in model.named_parameters()}
    for param, state in optim.state.items():
        for k, v in state.items():
            out[f"optim.{names[id(param)]}.{k}"] = total(v)
    return out


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("layout", choices=["tp", "dp_tp", "pp", "shards"])
    p.add_argument("--uri", required=True)
    p.add_argument("--dump", required=True)
    p.add_argument("--restore", action="store_true")
    p.add_argument("--split", default="a")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--sync", action="store_true")
    p.add_argument("--optim", choices=["dcp", "rank", "none"], default="dcp")
    p.add_argument("--replicas", choices=["identical", "rank0"], default="identical")
    p.add_argument("--frozen", action="store_true", help="l0 frozen, left out of the optimizer")
    return p.parse_args(argv)


def main() -> None:
    parsed = [parse(case) for case in split_cases(sys.argv[1:])]  # every case's arguments checked before any runs
    dist.init_process_group("gloo")
    for args in parsed:
        run_case(args)
    exit_without_teardown()


def run_case(args: argparse.Namespace) -> None:
    """One case: build, train and save (or restore), dump, close."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build(args, rank, world)
    if args.frozen:
        model.l0.requires_grad_(False)
    trained = [p for p in model.parameters() if p.requires_grad]
    optim = torch.optim.Adam(trained or [torch.zeros(1, requires_grad=True)], lr=0.1)  # none: a stand-in
    loader = Loader()
    names = [n for n, _ in model.named_parameters()]
    state: dict[str, Any] = {"model": model, "loader": loader}
    if args.optim != "none":
        state["optim"] = optim if args.optim == "dcp" else StageOptimizer(optim, names)
    ckpt = Checkpointer(args.uri, keep=None, async_save=not args.sync, replicas=args.replicas)
    result: dict[str, Any] = {}
    try:
        if args.restore:
            result["start"] = ckpt.restore(state)
        else:
            for step in range(2):
                x = torch.randn(2, 4, generator=torch.Generator().manual_seed(step))
                if args.layout == "pp":  # no real pipeline schedule: a gradient per stage
                    for param in model.parameters():
                        param.grad = torch.full_like(param, rank + 1.0)
                else:
                    model(x).sum().backward()
                optim.step()
                optim.zero_grad()
                loader.pos = 100 * rank + step + 1
            torch.manual_seed(1000 + rank)
            ckpt.save(2, state)
            ckpt.wait()
    except Exception as e:
        result["error"] = f"{type(e).__name__}: {e}"
    if "error" not in result:
        result.update(pos=loader.pos, rng=torch.rand(1).item(), tensors=digest(model, optim))
    with open(f"{args.dump}.r{rank}.json", "w") as f:
        json.dump(result, f)
    ckpt.close()


if __name__ == "__main__":
    main()
