"""One save for the crash-point tests (test_checkpoint_crash_points.py), alone or as a torchrun rank.

``ckpt_crash.py URI MARKERS STEP [--keep N] [--async]``: builds the state of ``STEP``, writes a
copy of it to ``MARKERS/state.<rank>.pt`` (what a restore must give back: another process's
thread count may round the training steps differently), then ``MARKERS/ready.<rank>`` holding
its pid, and waits for ``MARKERS/go``. The test attaches strace
to that pid in between, so strace counts only the calls of the Checkpointer (its restore, the
save of ``STEP``, its retention pass, its close), not the interpreter's start. Under torchrun
(``RANK`` set) it joins a gloo group first. Exits 0 when the save committed, 3 when it raised
(the error on stderr). ``--first N``: commits step N before all that (its state to
``MARKERS/first.<rank>.pt``), for a traced save over a checkpoint of the same ranks.

``ckpt_crash.py --serve FOLDER``: the same save, for one process at a time, in a child forked from
this one (which imported torch and spotjob once, about 3 CPU-s a Python saved per save): it waits
for ``FOLDER/request-<n>.json`` (n = 0, 1, ...: ``{"argv": [...], "log": PATH}``, or
``{"stop": true}``), forks a child that runs the above with that argv, its output to PATH (and
exits as the script does, its exception or ``sys.exit`` leaving this loop), and
writes the child's exit status to ``FOLDER/exit-<n>`` as ``Popen.returncode`` gives it (``-9``
for a SIGKILL). strace then attaches to the child's pid from its ``ready`` marker, as to a
process of its own: the fork is done before the child's Checkpointer makes a call.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from ckpt_harness import next_request
from ckpt_state import make_state, snapshot, train

from agent.checkpoint import Checkpointer


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("uri")
    p.add_argument("markers")
    p.add_argument("step", type=int)
    p.add_argument("--keep", type=int, default=2)
    p.add_argument("--async", dest="async_save", action="store_true")
    p.add_argument("--first", type=int)
    args = p.parse_args(argv)
    if "RANK" in os.environ:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    if args.first is not None:
        first = make_state(0)
        train(first, args.first)
        with Checkpointer(args.uri, keep=args.keep, async_save=False) as ckpt:
            ckpt.restore(make_state(1))
            ckpt.save(args.first, first)
        torch.save(snapshot(first), os.path.join(args.markers, f"first.{rank}.pt"))
    state = make_state(0)
    train(state, args.step)
    torch.save(snapshot(state), os.path.join(args.markers, f"state.{rank}.pt"))
    ready = os.path.join(args.markers, f"ready.{rank}")
    with open(ready + ".tmp", "w") as f:
        f.write(str(os.getpid()))
    os.rename(ready + ".tmp", ready)
    while not os.path.exists(os.path.join(args.markers, "go")):
        time.sleep(0.05)
    try:
        with Checkpointer(args.uri, keep=args.keep, async_save=args.async_save) as ckpt:
            ckpt.restore(make_state(1))
            ckpt.save(args.step, state)
    except Exception:
        traceback.print_exc()
        return 3
    return 0


def serve(folder: Path) -> None:
    n = 0
    while True:
        options = next_request(folder, n)
        if options.get("stop"):
            return
        pid = os.fork()
        if pid == 0:  # the child: its own output, the save, then out as a script of its own exits
            fd = os.open(options["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            os.close(fd)
            sys.exit(main(options["argv"]))
        _, status = os.waitpid(pid, 0)
        code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        (folder / f".exit-{n}").write_text(str(code))
        os.replace(folder / f".exit-{n}", folder / f"exit-{n}")
        n += 1


if __name__ == "__main__":
    if sys.argv[1:2] == ["--serve"]:
        serve(Path(sys.argv[2]))
    else:
        sys.exit(main())
