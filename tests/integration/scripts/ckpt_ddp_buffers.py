"""Rank side of test_checkpoint_ddp_buffers: a DDP model with a BatchNorm, each rank on its own batches.

    ckpt_ddp_buffers.py full --uri U --dump D     train 6 steps, save step 3 on the way (sync and async)
    ckpt_ddp_buffers.py resume --uri U --dump D   restore step 3 into a fresh model, train to step 6
    ckpt_ddp_buffers.py bare --uri U --dump D     restore step 3 into the bare module (no DDP), no training

Each rank dumps its module's final state to ``D.<command>.rank<r>.pt`` (``full`` also the state
it saved). The ranks' BatchNorm running statistics differ after every step (each forward updates
them from the rank's own batch) until DDP's next forward broadcasts rank 0's.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from ckpt_state import exit_without_teardown
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from agent.checkpoint import Checkpointer

SAVE_STEP, STEPS = 3, 6


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("command", choices=["full", "resume", "bare"])
    p.add_argument("--uri", required=True)
    p.add_argument("--dump", required=True)
    p.add_argument("--sync", action="store_true")
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(rank + 1 if args.command == "bare" else 0)  # bare: the restore must set every tensor
    bare = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
    if args.command == "bare":
        optim = torch.optim.SGD(bare.parameters(), lr=0.1)
        with Checkpointer(args.uri, async_save=not args.sync) as ckpt:
            start = ckpt.restore({"model": bare, "optim": optim})
        restored = {k: v.clone() for k, v in bare.state_dict().items()}
        torch.save({"start": start, "final": restored}, f"{args.dump}.bare.rank{rank}.pt")
        dist.destroy_process_group()
        return
    model = DistributedDataParallel(bare)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    state = {"model": model, "optim": optim}
    saved = None
    with Checkpointer(args.uri, async_save=not args.sync) as ckpt:
        start = ckpt.restore(state) if args.command == "resume" else 0
        for step in range(start, STEPS):
            x = torch.randn(16, 4, generator=torch.Generator().manual_seed(1000 * step + rank))
            optim.zero_grad()
            model(x).pow(2).mean().backward()
            optim.step()
            if step + 1 == SAVE_STEP and args.command == "full":
                saved = {k: v.clone() for k, v in model.module.state_dict().items()}
                ckpt.save(SAVE_STEP, state)
    final = {k: v.clone() for k, v in model.module.state_dict().items()}
    torch.save({"start": start, "saved": saved, "final": final}, f"{args.dump}.{args.command}.rank{rank}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_without_teardown()
