"""A small, deterministic training job that uses spotjob's Checkpointer — the one `make demo` runs.

    torchrun --nproc-per-node 2 examples/train.py --steps 200 --uri /tmp/ckpt --every-steps 50
    spotjob-agent --checkpoint-uri /tmp/ckpt -- torchrun --nproc-per-node 2 examples/train.py

Without ``--every-steps`` (or ``SPOTJOB_EVERY_STEPS``, ``spotjob run --every-steps``) it saves only
when a flush asks for it: run alone under torchrun, it then commits nothing. Run again, it resumes
from the newest checkpoint under the URI.

A two-layer MLP with dropout (so the RNG streams matter), Adam and a step LR schedule, trained
with DDP over gloo on synthetic data from a loader whose position is part of the checkpoint.
Everything is seeded, so an interrupted-and-resumed run ends bit-identical to an uninterrupted one;
``--dump`` writes the final state for that comparison.
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import time
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from agent import Checkpointer

log = logging.getLogger("train")


class SyntheticLoader:
    """Deterministic batches; each batch depends only on (seed, rank, position)."""

    def __init__(self, seed: int, rank: int, batch_size: int, dim: int) -> None:
        self.seed, self.rank, self.batch_size, self.dim = seed, rank, batch_size, dim
        self.position = 0

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.rank * 10_007 + self.position)
        self.position += 1
        x = torch.randn(self.batch_size, self.dim, generator=g)
        y = x[:, :1] * 0.5 - x[:, 1:2] + 0.1 * torch.randn(self.batch_size, 1, generator=g)
        return x, y

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position, "seed": self.seed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.position = int(state["position"])


def build(dim: int, hidden: int) -> nn.Module:
    return nn.Sequential(nn.Linear(dim, hidden), nn.ReLU(), nn.Dropout(0.1), nn.Linear(hidden, 1))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--step-sleep", type=float, default=0.0, help="seconds per step, to pace a demo")
    p.add_argument("--stop-after", type=int, default=None, help="stop (without saving) after this step")
    p.add_argument("--dump", default=None, help="write the final state of each rank to DUMP.rank<r>.pt")
    p.add_argument("--uri", default=None, help="checkpoint URI (default: $SPOTJOB_CHECKPOINT_URI)")
    p.add_argument("--every-steps", type=int, default=None)
    p.add_argument("--crash-at-step", type=int, default=None, help="raise at this step (tests)")
    args = p.parse_args()

    logging.basicConfig(level=logging.INFO, format="%(asctime)s rank%(rank)s %(name)s: %(message)s")
    distributed = "WORLD_SIZE" in os.environ
    if distributed:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if distributed else 0
    old_factory = logging.getLogRecordFactory()

    def factory(*a: Any, **kw: Any) -> logging.LogRecord:
        record = old_factory(*a, **kw)
        record.rank = rank
        return record

    logging.setLogRecordFactory(factory)

    # Same initial weights everywhere; per-rank streams for dropout.
    torch.manual_seed(args.seed)
    model = build(args.dim, args.hidden)
    torch.manual_seed(args.seed + 1 + rank)
    random.seed(args.seed + rank)
    np.random.seed(args.seed + rank)
    ddp: nn.Module = nn.parallel.DistributedDataParallel(model) if distributed else model
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(optim, step_size=50, gamma=0.5)
    loader = SyntheticLoader(args.seed, rank, args.batch_size, args.dim)
    state = {"model": model, "optim": optim, "sched": sched, "loader": loader}

    overrides: dict[str, Any] = {}
    if args.uri:
        overrides["uri"] = args.uri
    if args.every_steps:
        overrides["every_steps"] = args.every_steps
    ckpt = Checkpointer.from_env(**overrides)
    start = ckpt.restore(state)
    log.info("starting at step %d of %d", start, args.steps)

    loss = torch.tensor(0.0)
    for step in range(start, args.steps):
        if args.crash_at_step is not None and step + 1 == args.crash_at_step:
            raise RuntimeError(f"injected crash at step {step + 1}")
        x, y = loader.next_batch()
        # Draws from every RNG stream the checkpoint must carry.
        noise = 1.0 + 1e-3 * (random.random() + float(np.random.rand()))
        loss = ((ddp(x) - y) ** 2).mean() * noise
        optim.zero_grad()
        loss.backward()
        optim.step()
        sched.step()
        if args.step_sleep:
            time.sleep(args.step_sleep)
        if (step + 1) % 50 == 0:
            log.info("step %d loss %.4f", step + 1, loss.item())
        if ckpt.step(step + 1, state, metadata={"loss": float(loss.item())}):
            log.info("stopping at step %d for a preemption; the checkpoint is committed", step + 1)
            break
        if args.stop_after is not None and step + 1 >= args.stop_after:
            break
    ckpt.close()

    if args.dump:
        torch.save(
            {
                "model": {k: v.clone() for k, v in model.state_dict().items()},
                "optim": optim.state_dict(),
                "sched": sched.state_dict(),
                "loader": loader.state_dict(),
                "rng": {
                    "torch": torch.get_rng_state(),
                    "python": random.random(),
                    "numpy": float(np.random.rand()),
                },
            },
            f"{args.dump}.rank{rank}.pt",
        )
    if distributed:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
