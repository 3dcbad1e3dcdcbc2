"""Rank script: a Checkpointer used in a process setup it was not built for.

    ckpt_api_setup.py built-before-init URI   builds the Checkpointer, then init_process_group()
    ckpt_api_setup.py destroyed-first URI     destroy_process_group() with a save in flight, then close()
    ckpt_api_setup.py built-before-init URI1 destroyed-first URI2   both, in that order, in one process

Each rank prints ``<scenario> rank<r> <call> <ErrorType>: <message>`` for every call that raised.
Run together, the two scenarios share one torchrun (starting the ranks is most of their cost):
built-before-init must come first, as it builds its Checkpointer before any group exists, and
leaves its group for destroyed-first, which then destroys it (a gloo group made again on the
same torchrun store would meet the first one's keys).
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch.distributed as dist
from ckpt_state import make_state, train

from agent.checkpoint import Checkpointer

SCENARIOS = ("built-before-init", "destroyed-first")


def attempt(scenario: str, rank: int, call: str, fn: Callable[[], object]) -> None:
    try:
        fn()
    except Exception as e:
        print(f"{scenario} rank{rank} {call} {type(e).__name__}: {e}", flush=True)


def main() -> int:
    args = sys.argv[1:]
    scenarios = list(zip(args[::2], args[1::2], strict=False))
    if len(args) % 2 or [s for s, _ in scenarios] not in ([SCENARIOS[0]], [SCENARIOS[1]], list(SCENARIOS)):
        raise SystemExit(f"usage: ckpt_api_setup.py {{{'|'.join(SCENARIOS)}}} URI, or both in that order")
    for scenario, uri in scenarios:
        run(scenario, uri, last=scenario == scenarios[-1][0])
    return 0


def run(scenario: str, uri: str, last: bool) -> None:
    if scenario == "built-before-init":
        ckpt = Checkpointer(uri, every_steps=1)
        dist.init_process_group("gloo")
        rank = dist.get_rank()
        state = make_state(rank)
        attempt(scenario, rank, "restore", lambda: ckpt.restore(state))
        train(state, 1)
        attempt(scenario, rank, "step", lambda: ckpt.step(1, state))
        attempt(scenario, rank, "save", lambda: ckpt.save(1, state))
        ckpt.close()
        if last:
            dist.destroy_process_group()
    elif scenario == "destroyed-first":
        if not dist.is_initialized():
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
        attempt(scenario, rank, "step", lambda: ckpt.step(3, state))
        attempt(scenario, rank, "close", ckpt.close)


if __name__ == "__main__":
    sys.exit(main())
