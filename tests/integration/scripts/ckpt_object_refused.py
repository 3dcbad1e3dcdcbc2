"""Rank-side half of test_restore_state_keys' torchrun case: a per-rank object whose load_state_dict()
raises on one rank only.

    ckpt_object_refused.py --uri U --dump D

Every rank trains ``ckpt_state``'s state 3 steps and saves it at step 3 with a ``Position`` object
(an object from a release that saved ``{"version": 1}``), then restores into a fresh state (another
seed) whose ``Position`` on rank 1 only reads a ``position`` the checkpoint lacks (its format
changed), so that rank's load_state_dict() raises KeyError. Each rank dumps ``D.rank<r>.pt``: the
refusal's text (or the step restored), its state before the restore and after it (``snapshot``,
and the objects' own state).
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
import torch.distributed as dist
from ckpt_state import exit_without_teardown, make_state, snapshot, train

from agent.checkpoint import Checkpointer, RestoreRefusedError


class Position:
    """A per-rank object; ``strict`` (the newer format) reads a ``position`` key."""

    def __init__(self, strict: bool) -> None:
        self.strict = strict
        self.position = 0

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position} if self.strict else {"version": 1}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.strict:
            self.position = int(state["position"])


def everything(state: dict[str, Any]) -> dict[str, Any]:
    return {**snapshot(state), "position": state["position"].state_dict()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--uri", required=True)
    parser.add_argument("--dump", required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    state = make_state(rank)
    train(state, 3)
    with Checkpointer(args.uri, async_save=False) as ckpt:
        ckpt.save(3, {**state, "position": Position(strict=False)})
    fresh = {**make_state(rank, seed=5), "position": Position(strict=rank == 1)}
    fresh["counter"].ticks = 11  # loaded (rank 0's) before rank 1's refusal: must be put back
    before = everything(fresh)
    with Checkpointer(args.uri, async_save=False) as ckpt:
        try:
            outcome: int | str = ckpt.restore(fresh)
        except RestoreRefusedError as e:
            outcome = str(e)
    torch.save({"outcome": outcome, "before": before, "after": everything(fresh)}, f"{args.dump}.rank{rank}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_without_teardown()
