"""Rank script: a Checkpointer used in a process setup it was not built for.

    ckpt_api_setup.py built-before-init URI   builds the Checkpointer, then init_process_group()
    ckpt_api_setup.py destroyed-first URI     destroy_process_group() with a save in flight, then close()

Each rank prints ``rank<r> <call> <ErrorType>: <message>`` for every call that raised.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch.distributed as dist
from ckpt_state import make_state, train

from agent.checkpoint import Checkpointer


def attempt(rank: int, call: str, fn: Callable[[], object]) -> None:
    try:
        fn()
    except Exception as e:
        print(f"rank{rank} {call} {type(e).__name__}: {e}", flush=True)


def main() -> int:
    scenario, uri = sys.argv[1], sys.argv[2]
    if scenario == "built-before-init":
        ckpt = Checkpointer(uri, every_steps=1)
        dist.init_process_group("gloo")
        rank = dist.get_rank()
        state = make_state(rank)
        attempt(rank, "restore", lambda: ckpt.restore(state))
        train(state, 1)
        attempt(rank, "step", lambda: ckpt.step(1, state))
        attempt(rank, "save", lambda: ckpt.save(1, state))
        ckpt.close()
        dist.destroy_process_group()
    elif scenario == "destroyed-first":
        dist.init_process_group("gloo")
        rank = dist.get_rank()
        state = make_state(rank)
        ckpt = Checkpointer(uri, every_steps=1)
        train(state, 1)
        ckpt.step(1, state)
        ckpt.wait()
        train(state, 1, start=1)
        ckpt.step(2, state)  # its save is in flight when the group goes
        dist.destroy_process_group()
        attempt(rank, "step", lambda: ckpt.step(3, state))
        attempt(rank, "close", ckpt.close)
    return 0


if __name__ == "__main__":
    sys.exit(main())
