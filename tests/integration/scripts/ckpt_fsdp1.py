"""Rank side of the FSDP1 (``FullyShardedDataParallel``) checkpoint tests (CPU, gloo); run under torchrun.

    ckpt_fsdp1.py --dump D --uri U [--flat] [--sync] [--stop S] [--tagged] [--then --dump D2 ...]

Wraps a small model with dropout in FSDP1 (``use_orig_params=True``; ``--flat``: False, the
flat parameters' own names), with AdamW, an ExponentialLR schedule (each step multiplies the lr
the optimizer's param_groups hold, so a restore that loses them trains differently) and a
``ResumableLoader`` over a shuffled dataset. It restores from ``U``, then trains to STEPS steps
with ``step()`` saving every EVERY (async unless ``--sync``); ``--stop S`` leaves after step S's
``step()``. ``--tagged`` adds a module whose extra state holds a dtype, so that an async save
stages the state through DCP's stager rather than spotjob's plain path. Each rank dumps to
``D.rank<r>.pt`` where it started, what it trained on (batches and losses) and its own shard of the
parameters and optimizer state at the end (``Optimizer.state_dict()``, param_groups included), or
the traceback of a case that raised. ``--then`` runs another case in the same process group,
seeded afresh.
"""

from __future__ import annotations

import argparse
import sys
import traceback

import torch
import torch.distributed as dist
from ckpt_state import exit_without_teardown, split_cases
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from agent import Checkpointer, ResumableLoader

STEPS, EVERY = 8, 3


class Tag(nn.Module):
    """State that spotjob's plain staging path does not take (a dtype): DCP's stager stages it all."""

    def get_extra_state(self) -> dict[str, object]:
        return {"dtype": torch.float32}

    def set_extra_state(self, state: dict[str, object]) -> None:
        assert state == {"dtype": torch.float32}, state


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--dump", required=True)
    p.add_argument("--uri", required=True)
    p.add_argument("--flat", action="store_true")
    p.add_argument("--sync", action="store_true")
    p.add_argument("--stop", type=int, default=0)
    p.add_argument("--tagged", action="store_true")
    return p.parse_args(argv)


def run_case(args: argparse.Namespace) -> None:
    rank = dist.get_rank()
    torch.manual_seed(0)
    body = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 1))
    model = FullyShardedDataParallel(body, use_orig_params=not args.flat, device_id=torch.device("cpu"))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    schedule = torch.optim.lr_scheduler.ExponentialLR(optim, gamma=0.8)
    data = TensorDataset(torch.arange(40.0).reshape(10, 4).repeat(4, 1) / 40, torch.arange(40.0).reshape(40, 1))
    loader = ResumableLoader(
        DataLoader(data, batch_size=4, sampler=DistributedSampler(data), generator=torch.Generator().manual_seed(rank))
    )
    state: dict[str, object] = {"model": model, "optim": optim, "schedule": schedule, "loader": loader}
    if args.tagged:
        state["tag"] = Tag()
    log = []
    with Checkpointer(args.uri, every_steps=EVERY, keep=2, async_save=not args.sync) as ckpt:
        start = ckpt.restore(state)
        for step in range(start, STEPS):
            x, y = loader.next_batch()
            loss = (model(x) - y).pow(2).mean()
            loss.backward()
            optim.step()
            optim.zero_grad()
            schedule.step()
            log.append((step, y.flatten().tolist(), loss.item()))
            ckpt.step(step + 1, state)
            if step + 1 == args.stop:
                break
    params = [p.detach().clone() for p in model.parameters()]
    torch.save(
        {"start": start, "log": log, "params": params, "optim": optim.state_dict()}, f"{args.dump}.rank{rank}.pt"
    )


def main() -> None:
    parsed = [parse(case) for case in split_cases(sys.argv[1:])]
    dist.init_process_group("gloo")
    for args in parsed:
        try:
            run_case(args)
        except Exception:  # one case's failure is its own test's, not the others'
            # The Checkpointer's failures are decided together (every rank raises), so the group
            # stays in step for the next case; the case's test fails with this text.
            torch.save({"error": traceback.format_exc()}, f"{args.dump}.rank{dist.get_rank()}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_without_teardown()
