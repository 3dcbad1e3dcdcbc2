"""Rank-side half of ``test_checkpoint_upload_budget.py``; run under torchrun (2 ranks, gloo).

    ckpt_budget.py save --uri U --dump D --async {0,1}   save steps 1 and 2 of a state whose files
                                                        go up in several parts each, then close
    ckpt_budget.py restore --uri U --dump D              restore into fresh objects (a new process)
    ckpt_budget.py open --uri U                          build a Checkpointer, and nothing else

The upload settings (``SPOTJOB_STORAGE_*``) come from the environment torchrun hands on, as a
user's do. Each rank dumps what it saved or restored to ``D.rank<r>.pt``.
"""

from __future__ import annotations

import argparse
import copy
import logging
from typing import Any

import torch
import torch.distributed as dist
from ckpt_state import exit_without_teardown
from torch import nn

from agent.checkpoint import Checkpointer

WIDTH = 1024
"""Two WIDTH x WIDTH weights (4 MiB each) and Adam's two moments of each: 24 MiB of state, about
12 MiB written by each of the 2 ranks (DCP gives each replicated tensor to one rank)."""


def make_state(seed: int) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH))
    return {"model": model, "optim": torch.optim.Adam(model.parameters(), lr=1e-3)}


def train(state: dict[str, Any], step: int) -> None:
    """One step on data that depends on the step alone: every rank holds the same state."""
    model, optim = state["model"], state["optim"]
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(4, WIDTH, generator=g), torch.randn(4, WIDTH, generator=g)
    loss = ((model(x) - y) ** 2).mean()
    optim.zero_grad()
    loss.backward()
    optim.step()


def snapshot(state: dict[str, Any]) -> dict[str, Any]:
    return {
        "model": {k: v.detach().clone() for k, v in state["model"].state_dict().items()},
        "optim": copy.deepcopy(state["optim"].state_dict()),
    }


def save(args: argparse.Namespace, rank: int) -> None:
    state = make_state(seed=0)
    with Checkpointer(args.uri, keep=None, async_save=bool(args.async_save)) as ckpt:
        train(state, 1)
        ckpt.save(1, state)
        # An async save's upload of step 1 runs while the next step trains and step 2 is staged.
        train(state, 2)
        ckpt.save(2, state)
        saved = snapshot(state)
        settings = ckpt.storage.settings  # type: ignore[attr-defined]  # an object store's
    budget = {"max_buffer_bytes": settings.max_buffer_bytes, "concurrency": settings.concurrency}
    torch.save({"saved": saved, "budget": budget}, f"{args.dump}.rank{rank}.pt")


def restore(args: argparse.Namespace, rank: int) -> None:
    state = make_state(seed=1)
    with Checkpointer(args.uri, keep=None) as ckpt:
        step = ckpt.restore(state)
    torch.save({"step": step, "restored": snapshot(state)}, f"{args.dump}.rank{rank}.pt")


def open_only(args: argparse.Namespace, rank: int) -> None:
    Checkpointer(args.uri, keep=None).close()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("command", choices=["save", "restore", "open"])
    p.add_argument("--uri", required=True)
    p.add_argument("--dump")
    p.add_argument("--async", dest="async_save", type=int, choices=[0, 1], default=1)
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank{rank} %(name)s %(levelname)s: %(message)s")
    {"save": save, "restore": restore, "open": open_only}[args.command](args, rank)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_without_teardown()
