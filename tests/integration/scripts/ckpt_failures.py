"""Rank-side half of the save-failure tests; run under torchrun (2 ranks, gloo).

    ckpt_failures.py commit-error --uri U --out O --where {naming,commit} --error {runtime,oserror}
        rank 0's store raises an unexpected error (not a StorageError) while rank 0 names the
        checkpoint folder or commits its manifest; every rank saves step 1, then closes
    ckpt_failures.py async-one-rank --uri U --out O
        every_steps=3; rank 1's upload of step 3 fails (its folder refuses the files); rank 0
        trains slowly, so the ranks reach their next step() at different times
    ckpt_failures.py unrestorable --uri U --out O --from-save N
        rank 1's per-rank object holds something weights_only loading refuses from its N-th save on
    ckpt_failures.py prepare-one-rank --uri U --out O
        saves steps 1, 2 and 3 (each waited for); rank 1's per-rank object raises from its
        state_dict() at the second save, before any of that save's collectives; every rank records
        each save's outcome
    ckpt_failures.py flush-over-save --uri U --out O --variant {failed,cancelled}
        the save of step 2 is in flight when the vote of step 2 asks for a flush; rank 0's save
        thread finishes before rank 0 reaches the flush's step (3), rank 1's only after rank 1
        reached it and gave the save up. failed: rank 1's upload of step 2 fails, after the
        shards are written (its thread is held in its last report); cancelled: rank 1 starts
        writing only once it gave the save up, so the save fails as given up for the flush.
        Each rank records whether step(3) said stop.
    ckpt_failures.py flush-with-failed-save --uri U --out O [--same-step]
        rank 1's upload of step 2 fails; both ranks' save threads are done before step(2) votes,
        with a flush requested: step(3) reads one vote carrying both. --same-step: the flush is
        read by step(2) itself, and rank 1's store takes step 2's files once it is flushing
    ckpt_failures.py failure-raised-before-its-vote --uri U --out O
        rank 1's upload of step 2 fails; the vote of step(2) carries the failure (rank 0 waited for
        it); save(3) raises it first, and is retried; step(3) then reads that vote; every rank
        records each call's outcome
    ckpt_failures.py after-close --uri U --out O
        step(), save() and restore() after close(), each on every rank
    ckpt_failures.py keys-differ --uri U --out O
        save(1) of the same keys on every rank; then save(2) and restore() of a state whose rank 1
        holds one key more ("extra"); then restore() of the same keys again; then save(3) of a state
        whose rank 1 holds no module ("counter" only, so it has nothing for DCP to write); every
        rank records each call's outcome
    ckpt_failures.py no-save-thread --uri U --out O --thread {spotjob-save,spotjob-name}
        async saves of steps 1, 2 and 3 (every_steps=1); the thread of step 2 named --thread cannot
        start (RuntimeError "can't start new thread", as under a pids or ulimit -u limit): the save
        thread on rank 1, the thread naming the folder on rank 0 (only rank 0 starts one); every
        rank records each step()'s outcome, closes, and restores

    ckpt_failures.py --cases JSON
        runs several of the above one after another in this one job, each with its own URI and
        Checkpointer: JSON is a list of their options (``{"command": "commit-error", "uri": U,
        "out": O, "where": "naming"}``, unnamed options at their defaults); the tests share one
        torchrun this way between cases that need nothing but a fresh folder, instead of paying
        for a launcher and two ranks each

Each rank writes what happened to ``O.rank<r>`` (``<ErrorClass> at step <s>: <message>``, or
``no error``), and its log lines of that run to ``O.log.rank<r>``, then meets the others in a
barrier on the default group (``BARRIER_TIMEOUT``), so the test sees what every rank raised, and a
rank left behind fails the job instead of hanging it. ``async-one-rank`` then re-raises, so the job
exits non-zero, as a script that lets the error end it does.

Faults are injected by replacing methods on the Checkpointer's own Storage object (the seam every
backend shares), on one rank only.
"""

from __future__ import annotations

import argparse
import errno
import json
import logging
import os
import threading
import time
from collections import OrderedDict
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist
from ckpt_state import Counter, make_state, train

from agent.checkpoint import Checkpointer

log = logging.getLogger("ckpt_failures")

BARRIER_TIMEOUT = timedelta(seconds=90)
"""The default group's timeout: bounds the final barrier, where a rank left behind shows."""


def write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def outcome(e: BaseException | None, step: int | None) -> str:
    if e is None:
        return "no error"
    return f"{type(e).__name__} at step {step}: {e}"


def commit_error(args: argparse.Namespace, rank: int) -> None:
    state = make_state(rank)
    ckpt = Checkpointer(args.uri, keep=None)
    if rank == 0:
        unexpected: Exception = (
            RuntimeError("the storage client blew up")
            if args.error == "runtime"
            else OSError(errno.EIO, "Input/output error (injected)")
        )

        def broken(*a: Any, **kw: Any) -> Any:
            raise unexpected

        if args.where == "naming":
            ckpt.storage.list_dirs = broken  # type: ignore[method-assign]
        else:
            put_bytes_if_absent = ckpt.storage.put_bytes_if_absent

            def broken_commit(key: str, data: bytes) -> None:
                if key.endswith("/MANIFEST.json"):
                    broken()
                put_bytes_if_absent(key, data)  # the folder's claim (WRITER.json) goes through

            ckpt.storage.put_bytes_if_absent = broken_commit  # type: ignore[method-assign]
    error: BaseException | None = None
    try:
        train(state, 1)
        ckpt.save(1, state)  # returns once staged; the failure comes from the background
        ckpt.close()
    except Exception as e:
        error = e
    write(Path(f"{args.out}.rank{rank}"), outcome(error, 1))
    # Both ranks must get here: a rank left hanging in the save's collectives never would.
    dist.barrier()


def refuse_uploads(ckpt: Checkpointer, step: int, *, until_flush: bool = False) -> None:
    """This rank's store refuses every file of ``step``'s folder (as a folder without write access
    does); ``until_flush``: only until this rank is flushing."""
    put_file = ckpt.storage.put_file
    folder = f"step-{step:09d}/"

    def refusing_put_file(local_path: str, key: str, **kw: Any) -> None:
        if key.startswith(folder) and not (until_flush and ckpt._status.state == "flushing"):
            raise PermissionError(errno.EACCES, "Permission denied (injected)", key)
        put_file(local_path, key, **kw)

    ckpt.storage.put_file = refusing_put_file  # type: ignore[method-assign]


def flush_at_vote(ckpt: Checkpointer, step: int) -> None:
    """The vote this rank launches at ``step`` asks for a flush (as the agent's notice would)."""
    flags = ckpt._local_flags

    def flagged() -> list[int]:
        local = flags()
        if ckpt._last_step == step:
            local[0] = 1
        return local

    ckpt._local_flags = flagged  # type: ignore[method-assign]


def write_stop_outcome(args: argparse.Namespace, rank: int, error: BaseException | None, step: int, stop: bool) -> None:
    """What happened, and whether the last ``step()`` said stop; then meet the other ranks."""
    text = outcome(error, step)
    write(Path(f"{args.out}.rank{rank}"), text if error else f"{text}, {'stop' if stop else 'go on'} at step {step}")
    dist.barrier()


def async_one_rank(args: argparse.Namespace, rank: int) -> None:
    state = make_state(rank)
    out = Path(f"{args.out}.rank{rank}")
    ckpt = Checkpointer(args.uri, keep=None, every_steps=3)
    if rank == 1:
        refuse_uploads(ckpt, 3)
    step = 0
    try:
        with ckpt:
            for step in range(1, 31):
                train(state, 1, start=step - 1)
                if rank == 0:
                    time.sleep(0.1)  # the ranks call step() at different moments
                ckpt.step(step, state)
    except Exception as e:
        write(out, outcome(e, step))
        # Both ranks report before either exits (torchrun stops the others when one does); a rank
        # still training on or waiting in the next vote never gets here, and the barrier times out.
        dist.barrier()
        raise
    write(out, outcome(None, step))


class Opaque:
    """Not plain data: weights_only loading refuses to build it."""

    def __init__(self, n: int) -> None:
        self.n = n


class Progress:
    """A per-rank object; on rank 1, from its ``bad_from``-th save on, its state holds an ``Opaque``."""

    def __init__(self, rank: int, bad_from: int) -> None:
        self.rank = rank
        self.bad_from = bad_from
        self.saves = 0

    def state_dict(self) -> dict[str, Any]:
        self.saves += 1
        state: dict[str, Any] = OrderedDict(saves=self.saves)
        if self.rank == 1 and self.saves >= self.bad_from:
            state["extra"] = Opaque(self.saves)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.saves = int(state["saves"])


def unrestorable(args: argparse.Namespace, rank: int) -> None:
    state = make_state(rank)
    state["progress"] = Progress(rank, args.from_save)
    error: BaseException | None = None
    step = 0
    try:
        with Checkpointer(args.uri, keep=None) as ckpt:
            for step in (1, 2):
                train(state, 1, start=step - 1)
                ckpt.save(step, state)
                ckpt.wait()
    except Exception as e:
        error = e
    write(Path(f"{args.out}.rank{rank}"), outcome(error, step))
    dist.barrier()


class FailsOnce:
    """A per-rank object whose ``state_dict()`` raises at its second save, on rank 1 only."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.saves = 0

    def state_dict(self) -> dict[str, Any]:
        self.saves += 1
        if self.rank == 1 and self.saves == 2:
            raise RuntimeError("state_dict blew up (injected)")
        return {"saves": self.saves}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.saves = int(state["saves"])


def prepare_one_rank(args: argparse.Namespace, rank: int) -> None:
    state = make_state(rank)
    state["progress"] = FailsOnce(rank)
    lines = []
    with Checkpointer(args.uri, keep=None) as ckpt:
        for step in (1, 2, 3):
            train(state, 1, start=step - 1)
            try:
                ckpt.save(step, state)
                ckpt.wait()
                lines.append(f"step {step}: no error")
            except Exception as e:
                lines.append(f"step {step}: {type(e).__name__}: {e}")
    write(Path(f"{args.out}.rank{rank}"), "\n".join(lines))
    dist.barrier()


def flush_over_save(args: argparse.Namespace, rank: int) -> None:
    state = make_state(rank)
    ckpt = Checkpointer(args.uri, keep=None)
    gate = Path(f"{args.out}.gate")
    if rank == 1 and args.variant == "failed":
        put_file = ckpt.storage.put_file

        def refusing_put_file(local_path: str, key: str, **kw: Any) -> None:
            if key.startswith("step-000000002/"):
                while not gate.exists():  # until the vote of step 2 is launched, on every rank
                    time.sleep(0.01)
                raise PermissionError(errno.EACCES, "Permission denied (injected)", key)
            put_file(local_path, key, **kw)

        ckpt.storage.put_file = refusing_put_file  # type: ignore[method-assign]
        report = ckpt._report

        def held_report(force: bool = False) -> None:
            save = ckpt._inflight
            if threading.current_thread().name == "spotjob-save" and save is not None and save.step == 2:
                save.cancel.wait(60)  # this rank's thread finishes only once the flush gives it up
            report(force=force)

        ckpt._report = held_report  # type: ignore[method-assign]
    if rank == 1 and args.variant == "cancelled":
        finish = ckpt._finish_save

        def held_finish(save: Any) -> None:
            if save.step == 2:  # not the flush's own save, which nothing gives up
                save.cancel.wait(60)  # this rank writes only once the flush gives the save up
            finish(save)

        ckpt._finish_save = held_finish  # type: ignore[method-assign]
    flush_at_vote(ckpt, 2)
    error: BaseException | None = None
    stop = False
    step = 0
    try:
        for step in (1, 2):
            train(state, 1, start=step - 1)
            if step == 2:
                ckpt.save(2, state)
            ckpt.step(step, state)
        if args.variant == "failed":
            dist.barrier()  # both votes of step 2 launched: the save may now fail
            gate.touch()
        if rank == 0:
            assert ckpt._inflight is not None
            ckpt._inflight.done.wait()  # this rank's save thread is done before the flush's step
        if args.variant == "failed":
            dist.barrier()  # and rank 1's has gathered the failure, but not finished
        step = 3
        train(state, 1, start=2)
        stop = ckpt.step(3, state)
        ckpt.close()
    except Exception as e:
        error = e
    write_stop_outcome(args, rank, error, step, stop)


def flush_with_failed_save(args: argparse.Namespace, rank: int) -> None:
    """Without ``--same-step``: the vote of step(2) carries both the flush and the failed save of
    step 2, read by step(3). With it: the vote of step(1) carries the flush, read by step(2) after
    save(2) failed, so the flush meets the failed save of its own step and writes it again."""
    state = make_state(rank)
    ckpt = Checkpointer(args.uri, keep=None)
    if rank == 1:
        refuse_uploads(ckpt, 2, until_flush=args.same_step)
    flush_at_vote(ckpt, 1 if args.same_step else 2)
    error: BaseException | None = None
    stop = False
    step = 0
    try:
        for step in (1, 2, 3):
            train(state, 1, start=step - 1)
            if step == 2:
                ckpt.save(2, state)
                assert ckpt._inflight is not None
                ckpt._inflight.done.wait()  # failed on every rank before step(2) votes
            stop = ckpt.step(step, state)
            if stop:
                break
        ckpt.close()
    except Exception as e:
        error = e
    write_stop_outcome(args, rank, error, step, stop)


def failure_raised_before_its_vote(args: argparse.Namespace, rank: int) -> None:
    state = make_state(rank)
    ckpt = Checkpointer(args.uri, keep=None)
    if rank == 1:
        refuse_uploads(ckpt, 2)
    lines = []
    calls: list[tuple[str, Any]] = [
        ("save(2)", lambda: ckpt.save(2, state)),
        ("step(2)", lambda: ckpt.step(2, state)),  # its vote carries rank 0's failed save
        ("save(3)", lambda: ckpt.save(3, state)),  # raises that failure, on every rank
        ("save(3) again", lambda: ckpt.save(3, state)),
        ("step(3)", lambda: ckpt.step(3, state)),  # reads the vote of step(2)
        ("close()", ckpt.close),
    ]
    for name, call in calls:
        try:
            call()
            lines.append(f"{name}: no error")
        except Exception as e:
            lines.append(f"{name}: {type(e).__name__}: {e}")
        if name == "save(2)" and rank == 0:
            assert ckpt._inflight is not None
            ckpt._inflight.done.wait()  # failed before step(2) votes
    write(Path(f"{args.out}.rank{rank}"), "\n".join(lines))
    dist.barrier()


def after_close(args: argparse.Namespace, rank: int) -> None:
    state = make_state(rank)
    ckpt = Checkpointer(args.uri, keep=None, every_steps=1)
    ckpt.step(1, state)
    ckpt.close()
    lines = []
    for call in ("step", "save", "restore"):
        try:
            if call == "step":
                ckpt.step(2, state)
            elif call == "save":
                ckpt.save(2, state)
            else:
                ckpt.restore(state)
            lines.append(f"{call}: no error")
        except Exception as e:
            lines.append(f"{call}: {type(e).__name__}: {e}")
    write(Path(f"{args.out}.rank{rank}"), "\n".join(lines))
    dist.barrier()


def keys_differ(args: argparse.Namespace, rank: int) -> None:
    state = make_state(rank)
    uneven = {**state, "extra": Counter(rank)} if rank == 1 else state
    bare = {"counter": state["counter"]} if rank == 1 else state
    lines = []
    with Checkpointer(args.uri, keep=None) as ckpt:
        for name, call in (
            ("save(1)", lambda: ckpt.save(1, state)),
            ("save(2)", lambda: ckpt.save(2, uneven)),
            ("restore(uneven)", lambda: ckpt.restore(uneven)),
            ("restore(same)", lambda: ckpt.restore(state)),
            ("save(3)", lambda: ckpt.save(3, bare)),
        ):
            try:
                result = call()
                ckpt.wait()
                lines.append(f"{name}: {result}")
            except Exception as e:
                lines.append(f"{name}: {type(e).__name__}: {e}")
    write(Path(f"{args.out}.rank{rank}"), "\n".join(lines))
    dist.barrier()


def no_save_thread(args: argparse.Namespace, rank: int) -> None:
    state = make_state(rank)
    start = threading.Thread.start
    calls = [0]

    def start_or_refuse(thread: threading.Thread) -> None:
        # The one seam: one thread of the second save, on one rank (torch's and gloo's threads,
        # and the pools inside a save, still start).
        if thread.name == args.thread and rank == (1 if args.thread == "spotjob-save" else 0):
            calls[0] += 1
            if calls[0] == 2:
                raise RuntimeError("can't start new thread")
        start(thread)

    threading.Thread.start = start_or_refuse  # type: ignore[method-assign]
    lines = []
    with Checkpointer(args.uri, keep=None, every_steps=1) as ckpt:
        for step in (1, 2, 3):
            train(state, 1, start=step - 1)
            try:
                ckpt.step(step, state)
                lines.append(f"step {step}: no error")
            except Exception as e:
                lines.append(f"step {step}: {type(e).__name__}: {e}")
    threading.Thread.start = start  # type: ignore[method-assign]
    restored = make_state(rank, seed=7)
    with Checkpointer(args.uri, keep=None) as ckpt:
        lines.append(f"restored: {ckpt.restore(restored)}")
    write(Path(f"{args.out}.rank{rank}"), "\n".join(lines))
    dist.barrier()


def main() -> None:
    p = argparse.ArgumentParser()
    commands = {
        "commit-error": commit_error,
        "async-one-rank": async_one_rank,
        "unrestorable": unrestorable,
        "prepare-one-rank": prepare_one_rank,
        "after-close": after_close,
        "flush-over-save": flush_over_save,
        "failure-raised-before-its-vote": failure_raised_before_its_vote,
        "flush-with-failed-save": flush_with_failed_save,
        "no-save-thread": no_save_thread,
        "keys-differ": keys_differ,
    }
    p.add_argument("command", nargs="?", choices=list(commands))
    p.add_argument("--cases", help="a JSON list of option sets, each run in turn (see the module's docstring)")
    p.add_argument("--uri")
    p.add_argument("--out")
    p.add_argument("--where", choices=["naming", "commit"], default="commit")
    p.add_argument("--error", choices=["runtime", "oserror"], default="runtime")
    p.add_argument("--from-save", type=int, default=1)
    p.add_argument("--variant", choices=["failed", "cancelled"], default="failed")
    p.add_argument("--same-step", action="store_true")
    p.add_argument("--thread", choices=["spotjob-save", "spotjob-name"], default="spotjob-save")
    args = p.parse_args()
    runs = [args]
    if args.cases is not None:
        runs = [argparse.Namespace(**{**vars(args), **case}) for case in json.loads(args.cases)]
    for run in runs:
        if run.command not in commands or not run.uri or not run.out:
            p.error(f"each run needs a command ({', '.join(commands)}), --uri and --out; got {vars(run)}")
    dist.init_process_group("gloo", timeout=BARRIER_TIMEOUT)
    rank = dist.get_rank()
    form = f"%(asctime)s rank{rank} %(name)s %(levelname)s: %(message)s"
    logging.basicConfig(level=logging.INFO, format=form)
    for run in runs:
        # Each run's log lines also go to O.log.rank<r>: a test of one of several runs reads its own.
        handler = logging.FileHandler(f"{run.out}.log.rank{rank}")
        handler.setFormatter(logging.Formatter(form))
        logging.getLogger().addHandler(handler)
        try:
            commands[run.command](run, rank)
        finally:
            logging.getLogger().removeHandler(handler)
            handler.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
