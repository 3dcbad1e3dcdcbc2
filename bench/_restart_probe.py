"""The restart benchmark's training script: examples/train.py's job, with a clock at every phase.

Each rank appends JSON lines ``{"t": <unix time>, "event": ..., "rank": r, "pid": p}`` to
``<timings>/rank<r>.jsonl``: ``start`` (the interpreter reached this file, before torch is
imported), ``torch`` (imported), ``rendezvous`` (``init_process_group`` returned),
``checkpointer`` (constructed), ``restored`` (with the step), ``step`` (every completed step, with
its number) and ``stop`` (a flush stopped the loop). With ``--restore-only`` it stops after the
restore: that run is the restart's floor (a fresh process importing torch, the rendezvous, the
restore of the same bytes), timed alone.

Run it like examples/train.py, under ``spotjob run`` or ``torchrun``; it takes examples/train.py's
options plus ``--timings DIR`` and ``--restore-only``.
"""

from __future__ import annotations

import json
import os
import sys
import time

_T0 = time.time()


def _record(timings: str | None, rank: int, event: str, t: float | None = None, **data: object) -> None:
    if not timings:
        return
    os.makedirs(timings, exist_ok=True)
    line = json.dumps(
        {"t": t if t is not None else time.time(), "event": event, "rank": rank, "pid": os.getpid(), **data}
    )
    with open(os.path.join(timings, f"rank{rank}.jsonl"), "a") as f:
        f.write(line + "\n")


def main() -> int:
    argv = sys.argv[1:]
    timings = None
    restore_only = "--restore-only" in argv
    if restore_only:
        argv.remove("--restore-only")
    if "--timings" in argv:
        i = argv.index("--timings")
        timings = argv[i + 1]
        del argv[i : i + 2]
    rank = int(os.environ.get("RANK", "0"))
    _record(timings, rank, "start", _T0)

    import torch
    import torch.distributed as dist

    _record(timings, rank, "torch")
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
    import train  # examples/train.py: its model, loader and options

    if "WORLD_SIZE" in os.environ:
        dist.init_process_group("gloo")
    _record(timings, rank, "rendezvous")
    # examples/train.py's main, with the clock wrapped around the Checkpointer's calls.
    from agent import Checkpointer

    original_from_env = Checkpointer.from_env
    original_restore = Checkpointer.restore
    original_step = Checkpointer.step

    def from_env(**kw: object) -> Checkpointer:
        ck = original_from_env(**kw)  # type: ignore[arg-type]
        _record(timings, rank, "checkpointer")
        return ck

    def restore(self: Checkpointer, state: object) -> int:
        step = original_restore(self, state)  # type: ignore[arg-type]
        _record(timings, rank, "restored", step=step)
        if restore_only:
            self.close()
            if dist.is_initialized():
                dist.destroy_process_group()
            raise SystemExit(0)
        return step

    def step(self: Checkpointer, n: int, state: object, **kw: object) -> bool:
        stop = original_step(self, n, state, **kw)  # type: ignore[arg-type]
        _record(timings, rank, "stop" if stop else "step", step=n)
        return stop

    Checkpointer.from_env = staticmethod(from_env)  # type: ignore[method-assign, assignment]
    Checkpointer.restore = restore  # type: ignore[method-assign]
    Checkpointer.step = step  # type: ignore[method-assign]
    train.dist.init_process_group = lambda *a, **k: None  # already joined above
    sys.argv = [sys.argv[0], *argv]
    del torch
    return int(train.main())


if __name__ == "__main__":
    raise SystemExit(main())
