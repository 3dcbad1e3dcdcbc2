"""Rank-side half of ``test_checkpoint_upload_budget.py``; run under torchrun (2 ranks, gloo).

    ckpt_budget.py save --uri U --dump D --async {0,1}   save steps 1 and 2 of a state whose files
                   [--watch]                            go up in several parts each, then close;
                                                        --watch (S3) also dumps the most bytes the
                                                        rank's uploads held at once
    ckpt_budget.py restore --uri U --dump D              restore into fresh objects (a new process)
    ckpt_budget.py open --uri U                          build a Checkpointer, and nothing else

The upload settings (``SPOTJOB_STORAGE_*``) come from the environment torchrun hands on, as a
user's do. Each rank dumps what it saved or restored to ``D.rank<r>.pt``.
"""

from __future__ import annotations

import argparse
import copy
import logging
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from ckpt_state import exit_without_teardown
from torch import nn

from agent.checkpoint import Checkpointer
from agent.storage import _transfer as transfer
from agent.storage import s3 as s3_backend

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


class HeldBytes:
    """The bytes an S3 store's uploads hold, counted apart from its budget: a buffer read from a
    local file (``read_at``, of a part or of a file sent whole) counts until the request that sends
    it (``upload_part``, ``put_object``, given that very buffer) has been answered. ``peak`` is the
    most held at once. Bytes the Checkpointer puts from memory (its manifest) are no upload buffer
    and are not counted."""

    def __init__(self, store: Any) -> None:
        self._lock = threading.Lock()
        self._held: dict[int, bytes] = {}  # by id: the buffer itself is kept, so no id is reused
        self._now = 0
        self.peak = 0
        s3_backend.read_at = self._reading(s3_backend.read_at)  # type: ignore[assignment]  # parts
        transfer.read_at = self._reading(transfer.read_at)  # type: ignore[assignment]  # files sent whole
        for method in ("upload_part", "put_object"):
            setattr(store._client, method, self._sending(getattr(store._client, method)))

    def _reading(self, real: Callable[[int, int, int], bytes]) -> Callable[[int, int, int], bytes]:
        def read_at(fd: int, length: int, offset: int) -> bytes:
            data = real(fd, length, offset)
            with self._lock:
                self._held[id(data)] = data
                self._now += len(data)
                self.peak = max(self.peak, self._now)
            return data

        return read_at

    def _sending(self, real: Callable[..., Any]) -> Callable[..., Any]:
        def send(**kwargs: Any) -> Any:
            answer = real(**kwargs)
            with self._lock:
                if self._held.pop(id(kwargs["Body"]), None) is not None:
                    self._now -= len(kwargs["Body"])
            return answer

        return send


def save(args: argparse.Namespace, rank: int) -> None:
    state = make_state(seed=0)
    with Checkpointer(args.uri, keep=None, async_save=bool(args.async_save)) as ckpt:
        held = HeldBytes(ckpt.storage) if args.watch else None
        train(state, 1)
        ckpt.save(1, state)
        # An async save's upload of step 1 runs while the next step trains and step 2 is staged.
        train(state, 2)
        ckpt.save(2, state)
        saved = snapshot(state)
        settings = ckpt.storage.settings  # type: ignore[attr-defined]  # an object store's
    budget = {"max_buffer_bytes": settings.max_buffer_bytes, "concurrency": settings.concurrency}
    peak = None if held is None else held.peak
    torch.save({"saved": saved, "budget": budget, "peak": peak}, f"{args.dump}.rank{rank}.pt")


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
    p.add_argument("--watch", action="store_true")
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank{rank} %(name)s %(levelname)s: %(message)s")
    {"save": save, "restore": restore, "open": open_only}[args.command](args, rank)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_without_teardown()
