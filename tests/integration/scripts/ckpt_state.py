"""The training state the checkpoint integration tests save and restore (imported by ranks and tests).

A small model with a BatchNorm (float and int64 buffers), Adam, a StepLR schedule and ``Counter``,
a per-rank object (neither module nor optimizer) whose saved state differs on every rank, so the
per-rank policy of ``agent.rank_state`` is visible in what each rank gets back.
"""

from __future__ import annotations

import copy
import os
import random
import sys
from typing import Any

import numpy as np
import torch
from torch import nn

SAVE_STEP = 7


class Counter:
    """Per-rank training progress: which rank wrote it, how many steps it has seen."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.ticks = 0
        self.trace = torch.zeros(3, dtype=torch.int64)

    def state_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "ticks": self.ticks, "tag": f"rank-{self.rank}", "trace": self.trace.clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.rank = int(state["rank"])
        self.ticks = int(state["ticks"])
        self.trace = state["trace"].clone()


def make_state(rank: int, *, seed: int = 0) -> dict[str, Any]:
    """Fresh state; ``seed`` picks the initial weights (same seed, same weights on every rank)."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(optim, step_size=2, gamma=0.5)
    return {"model": model, "optim": optim, "sched": sched, "counter": Counter(rank)}


def train(state: dict[str, Any], steps: int, *, start: int = 0) -> None:
    """Deterministic steps on data that depends on the step only, so every rank stays identical."""
    model, optim, sched, counter = state["model"], state["optim"], state["sched"], state["counter"]
    for step in range(start, start + steps):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)
        loss = ((model(x) - y) ** 2).mean()
        optim.zero_grad()
        loss.backward()
        optim.step()
        sched.step()
        counter.ticks += 1
        counter.trace[step % 3] += counter.rank + 1


def seed_rngs(base: int, rank: int) -> None:
    """Per-rank RNG streams, advanced a little so they are not at a seed boundary."""
    torch.manual_seed(base + rank)
    random.seed(base + rank)
    np.random.seed(base + rank)
    torch.rand(5), random.random(), np.random.rand(3)


def rng_snapshot() -> dict[str, Any]:
    np_state = np.random.get_state(legacy=True)
    assert isinstance(np_state, tuple)
    kind, keys, pos, has_gauss, cached = np_state
    return {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": (kind, torch.from_numpy(np.asarray(keys, dtype=np.int64)), int(pos), int(has_gauss), float(cached)),
    }


def snapshot(state: dict[str, Any]) -> dict[str, Any]:
    """Deep copies of everything restore must bring back."""
    return {
        "model": {k: v.detach().clone() for k, v in state["model"].state_dict().items()},
        "optim": copy.deepcopy(state["optim"].state_dict()),
        "sched": copy.deepcopy(state["sched"].state_dict()),
        "counter": state["counter"].state_dict(),
    }


def split_cases(argv: list[str]) -> list[list[str]]:
    """A rank script's arguments cut at each ``--then``: one list per case the script runs in turn
    in one process group (``ckpt_parallel.py``, ``ckpt_fsdp.py``), so that cases whose setups are
    the same share one torchrun instead of paying for a launcher and its ranks each."""
    cases: list[list[str]] = [[]]
    for arg in argv:
        if arg == "--then":
            cases.append([])
        else:
            cases[-1].append(arg)
    return cases


def exit_without_teardown() -> None:
    """Leave a rank whose work is done and written without the interpreter's teardown, where a
    finished gloo worker sometimes aborts ("terminate called without an active exception", SIGABRT)
    and torchrun then reports the run as failed; the teardown of torch and DCP's modules also takes
    2-3 s of every torchrun run on a loaded 2-core machine. An exception before it still fails the
    rank. Only for scripts that close every Checkpointer themselves: atexit handlers do not run."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
