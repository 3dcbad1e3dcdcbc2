"""Rank side of test_checkpoint_training_loops: training loops built of more than a model and an optimizer.

    ckpt_loops.py zero-refused --uri U --dump D   a ZeroRedundancyOptimizer handed to save() and restore()
    ckpt_loops.py zero {full,resume} --uri U --dump D
        DDP with a ZeroRedundancyOptimizer kept through the README's ``ZeroShard``; ``full`` trains
        STEPS steps and saves at SAVE_STEP on the way, ``resume`` restores it and trains to STEPS
    ckpt_loops.py accumulate {full,resume} --uri U --dump D
        DDP with gradient accumulation (ACCUM micro-batches per optimizer step, ``no_sync`` between),
        ``step()`` once per optimizer step; ``full --flush`` has rank 0 request a flush through the
        agent's channel in the middle of an accumulation cycle

Each rank dumps what the test compares to ``D.<command>.rank<r>.pt``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
from typing import Any

import torch
import torch.distributed as dist
from ckpt_state import exit_without_teardown
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel

from agent.checkpoint import Checkpointer
from agent.control_channel import ControlDir, FlushRequest

SAVE_STEP, STEPS, ACCUM, FLUSH_AT = 3, 6, 4, (4, 2)  # FLUSH_AT: (optimizer step, micro-batch) of the notice


class ZeroShard:
    """README's wrapper: this rank's shard of a ZeroRedundancyOptimizer, as a per-rank object."""

    def __init__(self, zero: ZeroRedundancyOptimizer) -> None:
        self.zero = zero

    def state_dict(self) -> dict[str, Any]:
        return {
            "world_size": dist.get_world_size(),
            "shard": self.zero.optim.state_dict(),
            "groups": [{k: v for k, v in g.items() if k != "params"} for g in self.zero.param_groups],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["world_size"] != dist.get_world_size():
            raise ValueError(f"saved by {state['world_size']} ranks: ZeRO shards do not reshard")
        self.zero.optim.load_state_dict(state["shard"])
        for group, saved in zip(self.zero.param_groups, state["groups"], strict=True):
            group.update(saved)


def build(seed: int) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(seed)
    bare = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    return bare, DistributedDataParallel(bare)


def batch(step: int, micro: int, rank: int) -> torch.Tensor:
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(10_000 * step + 100 * micro + rank))


def zero_refused(args: argparse.Namespace, rank: int) -> None:
    _, model = build(0)
    zero = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, lr=1e-2)
    model(batch(0, 0, rank)).pow(2).mean().backward()
    zero.step()
    errors = {}
    with Checkpointer(args.uri, async_save=False) as ckpt:
        for call in ("restore", "save"):
            try:
                state = {"model": model, "optim": zero}
                ckpt.restore(state) if call == "restore" else ckpt.save(1, state)
            except Exception as e:
                errors[call] = (type(e).__name__, str(e))
    torch.save(errors, f"{args.dump}.zero-refused.rank{rank}.pt")


def zero(args: argparse.Namespace, rank: int) -> None:
    bare, model = build(0 if args.phase == "full" else 5)
    optim = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(optim, step_size=2, gamma=0.5)
    state = {"model": model, "optim": ZeroShard(optim), "sched": sched}
    with Checkpointer(args.uri) as ckpt:
        start = ckpt.restore(state) if args.phase == "resume" else 0
        for step in range(start, STEPS):
            optim.zero_grad()
            model(batch(step, 0, rank)).pow(2).mean().backward()
            optim.step()
            sched.step()
            if args.phase == "full" and step + 1 == SAVE_STEP:
                ckpt.save(SAVE_STEP, state)
    final = {k: v.clone() for k, v in bare.state_dict().items()}
    lr = optim.param_groups[0]["lr"]
    torch.save({"start": start, "model": final, "lr": lr}, f"{args.dump}.zero-{args.phase}.rank{rank}.pt")


def accumulate(args: argparse.Namespace, rank: int) -> None:
    bare, model = build(0 if args.phase == "full" else 5)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state = {"model": model, "optim": optim}
    stopped = None
    with Checkpointer(args.uri) as ckpt:
        start = ckpt.restore(state) if args.phase == "resume" else 0
        for step in range(start, STEPS):
            for micro in range(ACCUM):
                if args.flush and rank == 0 and (step, micro) == FLUSH_AT:
                    ControlDir(os.environ["SPOTJOB_CONTROL_DIR"]).request_flush(FlushRequest(reason="test notice"))
                sync = contextlib.nullcontext() if micro == ACCUM - 1 else model.no_sync()
                with sync:
                    (model(batch(step, micro, rank)).pow(2).mean() / ACCUM).backward()
            optim.step()
            optim.zero_grad()
            if ckpt.step(step + 1, state):
                stopped = step + 1
                break
    final = {k: v.clone() for k, v in bare.state_dict().items()}
    dump = f"{args.dump}.accumulate-{args.phase}.rank{rank}.pt"
    torch.save({"start": start, "stopped": stopped, "model": final}, dump)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("command", choices=["zero-refused", "zero", "accumulate"])
    p.add_argument("phase", nargs="?", choices=["full", "resume"], default="full")
    p.add_argument("--uri", required=True)
    p.add_argument("--dump", required=True)
    p.add_argument("--flush", action="store_true")
    args = p.parse_args()
    dist.init_process_group("gloo")
    {"zero-refused": zero_refused, "zero": zero, "accumulate": accumulate}[args.command](args, dist.get_rank())
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_without_teardown()
