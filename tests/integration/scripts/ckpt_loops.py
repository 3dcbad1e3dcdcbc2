"""Rank side of test_checkpoint_training_loops: training loops built of more than a model and an optimizer.

    ckpt_loops.py zero-refused --uri U --dump D   a ZeroRedundancyOptimizer handed to save() and restore()
    ckpt_loops.py zero {full,resume} --uri U --dump D
        DDP with a ZeroRedundancyOptimizer kept through the README's ``ZeroShard``; ``full`` trains
        STEPS steps and saves at SAVE_STEP on the way, ``resume`` restores it and trains to STEPS
    ckpt_loops.py accumulate {full,resume} --uri U --dump D
        DDP with gradient accumulation (ACCUM micro-batches per optimizer step, ``no_sync`` between),
        ``step()`` once per optimizer step; ``full --flush`` has rank 0 request a flush through the
        agent's channel in the middle of an accumulation cycle

    ckpt_loops.py cases --root R [--control C] CASE...
        several of the above one after the other in one process group (one torchrun instead of
        one each): CASE is zero-refused, zero:full, zero:resume, accumulate:full (never stopped),
        accumulate:flush (``full --flush``, with SPOTJOB_CONTROL_DIR=C for that case only) or
        accumulate:resume (restores what accumulate:flush committed). Each case seeds and builds
        its own model, optimizer and Checkpointer, as its own run would; folders are in CASES.

Each rank dumps what the test compares to ``D.<command>.rank<r>.pt``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import traceback
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


JOBS = {"zero-refused": zero_refused, "zero": zero, "accumulate": accumulate}
# case: (command, phase, flush, URI under R, dump under R)
CASES = {
    "zero-refused": ("zero-refused", "full", False, "zero-refused/ckpt", "zero-refused/dump"),
    "zero:full": ("zero", "full", False, "zero/ckpt", "zero/dump"),
    "zero:resume": ("zero", "resume", False, "zero/ckpt", "zero/dump"),
    "accumulate:full": ("accumulate", "full", False, "accumulate/whole", "accumulate/dump"),
    "accumulate:flush": ("accumulate", "full", True, "accumulate/ckpt", "accumulate/dump-flushed"),
    "accumulate:resume": ("accumulate", "resume", False, "accumulate/ckpt", "accumulate/dump"),
}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("command", choices=[*JOBS, "cases"])
    p.add_argument("phase", nargs="*", help="full or resume; with cases: the cases")
    p.add_argument("--uri")
    p.add_argument("--dump")
    p.add_argument("--root")
    p.add_argument("--control")
    p.add_argument("--flush", action="store_true")
    args = p.parse_intermixed_args()
    if args.command != "cases":
        if not args.uri or not args.dump or len(args.phase) > 1 or not set(args.phase) <= {"full", "resume"}:
            p.error(f"{args.command} takes [full|resume] --uri U --dump D")
        args.phase = args.phase[0] if args.phase else "full"
        dist.init_process_group("gloo")
        JOBS[args.command](args, dist.get_rank())
        dist.destroy_process_group()
        return
    unknown = [c for c in args.phase if c not in CASES]
    if not args.root or not args.phase or unknown:
        p.error(f"cases needs --root and cases among {sorted(CASES)} (unknown: {unknown})")
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    for case in args.phase:
        command, phase, flush, uri, dump = CASES[case]
        one = argparse.Namespace(phase=phase, flush=flush, uri=f"{args.root}/{uri}", dump=f"{args.root}/{dump}")
        os.makedirs(os.path.dirname(one.dump), exist_ok=True)
        if flush:
            os.environ["SPOTJOB_CONTROL_DIR"] = args.control
        try:
            JOBS[command](one, rank)
        except Exception:  # one case's failure is its own test's, not the others'
            # The checkpointer's refusals and failures are decided together (every rank raises),
            # so the group stays in step for the next case; the case's test fails with this text.
            name = command if command.endswith("-refused") else f"{command}-{phase}"
            torch.save({"error": traceback.format_exc()}, f"{one.dump}.{name}.rank{rank}.pt")
        finally:
            os.environ.pop("SPOTJOB_CONTROL_DIR", None)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_without_teardown()
