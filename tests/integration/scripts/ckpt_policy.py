"""Rank-side half of the save-policy and fencing tests; run under torchrun.

    ckpt_policy.py early --uri U --control C      two save-early requests (steps 5 and 14)
    ckpt_policy.py deadline --uri U               every_seconds=5 on a clock the script moves:
                                                  10 s pass before steps 6 and 11, none otherwise
    ckpt_policy.py mismatch --uri U --out O       rank 1 counts one step ahead (step() or save())
    ckpt_policy.py zombie --uri U --markers M     attempt 0: commits steps 1-3, says so, waits for
                                                  ``go``, then keeps saving steps 4-6 (keep=1)
    ckpt_policy.py attempt1 --uri U --markers M   attempt 1: restores, commits the next two steps
    ckpt_policy.py claim --uri U --out O --job J  constructs a Checkpointer for job J

``--then`` starts another case (any mode but ``zombie``, each with its own URI and outcome paths)
in the same process group once the one before it has closed its Checkpointer: independent cases
that end cleanly share one torchrun, since starting the ranks (importing torch) is most of each
case's cost.

Every mode trains the same tiny model for real. Outcomes each rank must report go to
``O.rank<r>`` (the error class and message), so the test sees what every rank raised.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist
from ckpt_state import exit_without_teardown, make_state, split_cases, train

import agent.checkpoint._vote
from agent.checkpoint import Checkpointer
from agent.control_channel import ControlDir

log = logging.getLogger("ckpt_policy")


class MovedClock:
    """Stands in for the ``time`` module of ``agent.checkpoint._vote`` (where the every_seconds deadline
    is kept): its monotonic clock moves only when the script says so, so "a deadline passed" happens
    at a chosen step and nowhere else."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)


def write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def early(args: argparse.Namespace, rank: int) -> None:
    state = make_state(rank)
    with Checkpointer(args.uri, keep=None, control_dir=args.control) as ckpt:
        for step in range(1, 21):
            train(state, 1, start=step - 1)
            if step in (5, 14):
                # Both ranks have launched the previous step's vote before the request lands (a
                # slow rank 1 would otherwise vote for it a step early), and both look for it at
                # the end of this step.
                dist.barrier()
                if rank == 0:
                    ControlDir(args.control).request_save(f"request at step {step}")
            dist.barrier()
            ckpt.step(step, state)


def deadline(args: argparse.Namespace, rank: int) -> None:
    clock = MovedClock()
    agent.checkpoint._vote.time = clock  # type: ignore[assignment]
    try:
        state = make_state(rank)
        with Checkpointer(args.uri, keep=None, every_seconds=5.0) as ckpt:
            for step in range(1, 16):
                train(state, 1, start=step - 1)
                if step in (6, 11):
                    clock.now += 10.0
                ckpt.step(step, state)
    finally:  # a case run after this one in the same process keeps the real clock
        agent.checkpoint._vote.time = time  # type: ignore[assignment]


def mismatch(args: argparse.Namespace, rank: int) -> None:
    state = make_state(rank)
    out = Path(f"{args.out}.rank{rank}")
    try:
        with Checkpointer(args.uri, keep=None, every_steps=2) as ckpt:
            if args.call == "save":
                ckpt.save(4 + rank, state)
            else:
                for step in range(1, 6):
                    ckpt.step(step + rank, state)
        write(out, "no error")
    except Exception as e:
        write(out, f"{type(e).__name__}: {e}")


def zombie(args: argparse.Namespace, rank: int) -> None:
    markers = Path(args.markers)
    state = make_state(rank)
    ckpt = Checkpointer(args.uri, every_steps=1, keep=1, attempt=0, job="fenced-job")
    for step in range(1, 4):
        train(state, 1, start=step - 1)
        ckpt.step(step, state)
    ckpt.wait()
    write(markers / f"committed.rank{rank}", "3")
    while not (markers / "go").exists():  # the test records attempt 1 and runs it meanwhile
        time.sleep(0.05)
    outcome = "trained on"
    for step in range(4, 10):  # a partitioned worker training on, saving every step
        train(state, 1, start=step - 1)
        try:
            ckpt.step(step, state)
        except Exception as e:
            outcome = f"{type(e).__name__} at step {step}: {e}"
            break
    try:  # a zombie that ignores the error is refused again, not let through
        ckpt.step(10, state)
        outcome += " | then step() passed"
    except Exception as again:
        outcome += f" | then {type(again).__name__}"
    write(markers / f"outcome.rank{rank}", outcome)
    try:
        ckpt.close()
    except Exception as e:
        log.info("close after the fence: %s", e)


def attempt1(args: argparse.Namespace, rank: int) -> None:
    """The replacement gang: resumes from the fence and commits steps 4 and 5."""
    state = make_state(rank, seed=5)
    with Checkpointer(args.uri, keep=None, attempt=1, job="fenced-job", async_save=False) as ckpt:
        start = ckpt.restore(state)
        for step in range(start + 1, start + 3):
            train(state, 1, start=step - 1)
            ckpt.save(step, state)
    write(Path(args.markers) / f"attempt1.rank{rank}", str(start))


def claim(args: argparse.Namespace, rank: int) -> None:
    out = Path(f"{args.out}.rank{rank}")
    try:
        Checkpointer(args.uri, job=args.job).close()
        write(out, "no error")
    except Exception as e:
        write(out, f"{type(e).__name__}: {e}")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("command", choices=["early", "deadline", "mismatch", "zombie", "attempt1", "claim"])
    p.add_argument("--uri", required=True)
    p.add_argument("--control")
    p.add_argument("--out")
    p.add_argument("--markers")
    p.add_argument("--job")
    p.add_argument("--call", choices=["step", "save"], default="step")
    cases = [p.parse_args(case) for case in split_cases(sys.argv[1:])]  # all checked before any runs
    if len(cases) > 1 and any(args.command == "zombie" for args in cases):
        p.error("zombie waits for the test and is left mid-save: it runs alone, not with --then")
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank{rank} %(name)s %(levelname)s: %(message)s")
    modes = {"early": early, "deadline": deadline, "mismatch": mismatch, "zombie": zombie, "claim": claim}
    modes["attempt1"] = attempt1
    for number, args in enumerate(cases):
        if len(cases) > 1:
            log.info("=== case %d: %s", number, args.command)
        modes[args.command](args, rank)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_without_teardown()
