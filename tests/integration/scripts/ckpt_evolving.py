"""Rank side of the changing-state test (CPU, gloo); run under torchrun.

    ckpt_evolving.py URI [--sync | --release-staging]

Saves steps 0-7 to ``URI`` (back to back, nothing waited for in between) while the state changes:
a replicated module's buffer grown in place, its weight replaced by one of another shape, a layer
added, a cast to bfloat16; an FSDP2 model rebuilt wider (resharded), then in bfloat16 with a layer
added, then without it; an EMA coming and going; a per-rank object changing type. Each rank keeps
a copy of what it handed to every save; then every step is restored on its own (rank 0 copies its
folder to ``URI-alone-<step>``) into a state of the same layout and compared bit for bit, and rank
0 compares the step's MANIFEST.json tensor index with its ``.metadata``. Prints ``step S: OK`` or
the differences; exits 1 on any.

    ckpt_evolving.py URI --modes async,sync

Both runs one after the other in one process group (one torchrun instead of two), each with its
own URI (``URI-<mode>``), model, optimizer and Checkpointer, as its own run would. Each line is
prefixed ``[<mode>] ``; a run that raises prints its traceback under that prefix and the next
run goes on; exits 0 unless something outside the runs fails, so the test reads each run's lines.
"""

from __future__ import annotations

import argparse
import copy
import glob
import os
import shutil
import sys
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from ckpt_state import exit_without_teardown
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from ckpt_compare import differences

from agent.checkpoint import Checkpointer
from agent.dcp_safe import load_dcp_metadata, tensor_index
from agent.manifest import DCP_METADATA_NAME, MANIFEST_NAME, Manifest


class Box:
    """A per-rank object whose value changes type between saves."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = state["value"]


def sharded(mesh: Any, step: int, seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The FSDP2-sharded model in the layout it has at ``step``: wider from step 4 (resharded), in
    bfloat16 with a third layer at step 6 (a dtype changed, keys added), without it at step 7."""
    torch.manual_seed(seed)
    width = 10 if step < 4 else 16
    layers = [nn.Linear(6, width), nn.Linear(width, 3)] + ([nn.Linear(3, 3)] if step == 6 else [])
    model = nn.Sequential(*layers).to(torch.bfloat16 if step >= 6 else torch.float32)
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def train(model: nn.Module, optim: torch.optim.Optimizer, step: int) -> None:
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(step)).to(next(model.parameters()).dtype)
    model(x).float().pow(2).mean().backward()
    optim.step()
    optim.zero_grad()


def whole(model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
    """(collective) A copy of the sharded model's and optimizer's whole state."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return copy.deepcopy(
        {
            "model": get_model_state_dict(model, options=options),
            "optim": get_optimizer_state_dict(model, optim, options=options),
        }
    )


def replicated(step: int) -> nn.Linear:
    """The replicated module in the layout it has at ``step`` (zeros)."""
    module = nn.Linear(4, 4)
    module.register_buffer("seen", torch.zeros(4 if step < 2 else 9))
    if step >= 3:
        module.weight = nn.Parameter(torch.zeros(6, 4))
        module.add_module("extra", nn.Linear(2, 2))
    if step >= 5:
        module.to(torch.bfloat16)
    return module


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("uri")
    p.add_argument("--sync", action="store_true")
    p.add_argument("--release-staging", action="store_true")
    p.add_argument("--modes", help="comma-separated: async, sync")
    args = p.parse_args()
    dist.init_process_group("gloo")
    if not args.modes:
        failed = run(args.uri, sync=args.sync, release_staging=args.release_staging, prefix="")
        dist.destroy_process_group()
        if failed:
            sys.exit(1)
        return
    for mode in args.modes.split(","):
        try:
            run(f"{args.uri}-{mode}", sync=mode == "sync", release_staging=False, prefix=f"[{mode}] ")
        except Exception:  # this mode's test fails on it, the other's goes on
            lines = traceback.format_exc().splitlines()
            print("\n".join(f"[{mode}] rank {dist.get_rank()} raised: {line}" for line in lines), flush=True)
    dist.destroy_process_group()


def run(uri: str, *, sync: bool, release_staging: bool, prefix: str) -> bool:
    """One run: save steps 0-7 to ``uri``, restore each on its own; True if any differed."""
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    rep = replicated(0)
    model, optim = sharded(mesh, 0, 0)
    saved: dict[int, tuple[dict[str, Any], dict[str, Any], bool]] = {}
    kw = {"async_save": not sync, "release_staging": release_staging}
    with Checkpointer(uri, keep=None, **kw) as ckpt:
        for step in range(8):
            if step == 2:
                rep.seen.resize_(9)
                rep.seen.copy_(torch.arange(9.0))
            if step == 3:
                rep.weight = nn.Parameter(torch.randn(6, 4))
                rep.add_module("extra", nn.Linear(2, 2))
            if step in (4, 6, 7):
                model, optim = sharded(mesh, step, step)
            if step == 5:
                rep.to(torch.bfloat16)
            train(model, optim, step)
            value = [rank] * step if step % 2 else {"t": torch.full((step + 1,), rank)}
            state = {"rep": rep, "model": model, "optim": optim, "per_rank": Box(value)}
            if step in (2, 3, 6):
                state["ema"] = copy.deepcopy(rep)
            ckpt.save(step, state)
            plain = {k: copy.deepcopy(v.state_dict()) for k, v in state.items() if k not in ("model", "optim")}
            saved[step] = (plain, whole(model, optim), "ema" in state)
            with torch.no_grad():  # changed in place while the save is written
                for param in rep.parameters():
                    param.add_(1.0)
    failed = False
    for step, (plain, sharded_state, ema) in saved.items():
        alone = f"{uri}-alone-{step}"
        if rank == 0:
            for folder in glob.glob(f"{uri}/step-{step:09d}*"):
                shutil.copytree(folder, os.path.join(alone, os.path.basename(folder)))
        dist.barrier()
        model, optim = sharded(mesh, step, 99)
        train(model, optim, 99)  # Adam's state exists to load into
        state = {"rep": replicated(step), "model": model, "optim": optim, "per_rank": Box(None)}
        if ema:
            state["ema"] = replicated(step)
        with Checkpointer(alone, read_only=True) as ckpt:
            restored = ckpt.restore(state)
        got = {k: v.state_dict() for k, v in state.items() if k not in ("model", "optim")}
        diffs = [f"restored step {restored}"] if restored != step else []
        diffs += differences(got, plain) + differences(whole(model, optim), sharded_state)
        if rank == 0:
            diffs += index_differences(uri, step)
        print(f"{prefix}rank {rank} step {step}: {diffs[:5] if diffs else 'OK'}", flush=True)
        failed = failed or bool(diffs)
    return failed


def index_differences(uri: str, step: int) -> list[str]:
    """Where the tensor index of step ``step``'s MANIFEST.json differs from its ``.metadata``: a
    save whose structure is unchanged reuses the last one's index (``TensorIndexCache``), and one
    after a change must not."""
    [folder] = glob.glob(f"{uri}/step-{step:09d}*")
    with open(os.path.join(folder, MANIFEST_NAME), "rb") as f:
        listed = Manifest.parse(f.read()).tensors
    with open(os.path.join(folder, DCP_METADATA_NAME), "rb") as f:
        written = tensor_index(load_dcp_metadata(f.read()))
    if listed == written:
        return []
    names = sorted(n for n in listed.keys() | written.keys() if listed.get(n) != written.get(n))
    return [f"MANIFEST.json's tensor index differs from .metadata at {names[:5]}"]


if __name__ == "__main__":
    main()
    exit_without_teardown()
