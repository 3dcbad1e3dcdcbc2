"""Rank side of the FSDP2 checkpoint tests (CPU, gloo); run under torchrun.

    ckpt_fsdp.py --dump D [--uri U] [--restore] [--save-at S ...] [--steps N] [--hsdp] [--then --dump D2 ...]

Builds a small FSDP2-sharded model and Adam on a mesh of every rank (``--hsdp``: sharded within
pairs of ranks, replicated across the pairs, as HSDP shards within a node), restores from ``U`` if asked,
then trains up to ``N`` steps on data that depends on the step only, saving the steps listed. Rank
0 dumps the full (unsharded) model and optimizer state to ``D.<label>.pt``: ``restored`` after
the restore, ``step<S>`` at each save, ``end`` at the end. ``--then`` runs another case after it
in the same process group (its own model, optimizer and Checkpointer; the seed is set per case),
so that independent cases of one world size share the cost of starting the ranks.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.distributed as dist
from ckpt_state import exit_without_teardown, split_cases
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from agent.checkpoint import Checkpointer


def build(world: int, seed: int, hsdp: bool = False) -> tuple[nn.Module, torch.optim.Optimizer]:
    # HSDP: FSDP2 on a 2-D mesh shards over its last dimension and replicates over the first.
    mesh = (
        init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("replicate", "shard"))
        if hsdp
        else init_device_mesh("cpu", (world,))
    )
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 10), nn.ReLU(), nn.Linear(10, 3))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def full_state(model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, object]:
    """(collective) The whole state, gathered from the shards."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return {
        "model": get_model_state_dict(model, options=options),
        "optim": get_optimizer_state_dict(model, optim, options=options) if optim.state else {},
    }


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--dump", required=True)
    p.add_argument("--uri")
    p.add_argument("--restore", action="store_true")
    p.add_argument("--save-at", type=int, nargs="*", default=[])
    p.add_argument("--steps", type=int, default=0)
    p.add_argument("--hsdp", action="store_true")
    return p.parse_args(argv)


def main() -> None:
    parsed = [parse(case) for case in split_cases(sys.argv[1:])]  # every case's arguments checked before any runs
    dist.init_process_group("gloo")
    for args in parsed:
        run_case(args)
    dist.destroy_process_group()


def run_case(args: argparse.Namespace) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    model, optim = build(world, seed=1 if args.restore else 0, hsdp=args.hsdp)
    state = {"model": model, "optim": optim}

    def dump(label: str) -> None:
        full = full_state(model, optim)
        if rank == 0:
            torch.save(full, f"{args.dump}.{label}.pt")

    ckpt = Checkpointer(args.uri, keep=None) if args.uri else None
    start = 0
    if ckpt is not None and args.restore:
        start = ckpt.restore(state)
        dump("restored")
    for step in range(start, args.steps + 1):
        if ckpt is not None and step in args.save_at:
            ckpt.save(step, state)
            ckpt.wait()
            dump(f"step{step}")
        if step == args.steps:
            break
        g = torch.Generator().manual_seed(step)
        loss = model(torch.randn(4, 6, generator=g)).pow(2).mean()
        optim.zero_grad()
        loss.backward()
        optim.step()
    if ckpt is not None:
        ckpt.close()
    dump("end")


if __name__ == "__main__":
    main()
    exit_without_teardown()
