"""A training process that gets a signal while the Checkpointer works (run by test_checkpoint_signals).

    ckpt_signals.py sync --uri U --signal {INT,TERM} --at {write,upload,commit} [--carry-on]
        commits step 1 synchronously, then the process signals itself while the save of step 2
        writes its shards (DCP's write, at its storage writer), uploads a file or writes
        MANIFEST.json. SIGTERM goes to the script's own handler, which
        exits 143 (``sys.exit``). Uncaught, the signal ends the process as it would without
        spotjob; ``--carry-on`` catches the ``KeyboardInterrupt`` and commits step 3 instead.
    ckpt_signals.py close --uri U
        an asynchronous save of step 1 is uploading when ``close()`` is interrupted (SIGINT); the
        script then closes again, as a ``finally`` would, and prints the step committed by then.
    torchrun --nproc-per-node=2 ckpt_signals.py ranks --uri U
        rank 0 gets Ctrl-C (SIGINT) while the synchronous save of step 2 uploads, rank 1 does not;
        each prints what the save raised on it, then both save step 3 and close.
        ``--at staging``: rank 0 gets it while it prepares the save (its state's ``state_dict()``).
    torchrun --nproc-per-node=2 ckpt_signals.py ranks --uri U --at upload --uri U2 --at staging
        the cases above one after the other in one job, each with its URI and Checkpointer; each
        line then starts with its ``--at`` (``upload rank0 KeyboardInterrupt``)
    ckpt_signals.py cases --run MODE U OUT [--run MODE U OUT ...]
        the cases that catch their signal and go on (MODE: ``close``, ``close-other-thread``, or
        ``carry-on`` for ``sync --signal INT --at upload --carry-on``) one after the other in this
        one process, each with its URI and Checkpointer, its printed lines to the file OUT (and
        what a case raised, which then ends the case, not the process)
    ckpt_signals.py with-body --uri U
        Ctrl-C (SIGINT) in the body of ``with Checkpointer(...)`` while its asynchronous save of
        step 1 fails (the store refuses the upload).

The signal comes from a seam outside spotjob's code (the store's ``put_file`` /
``put_bytes_if_absent``, DCP's ``FileSystemWriter.write_data``), at the moment the save reaches it.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import threading
import traceback
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
from ckpt_state import exit_without_teardown, make_state, train
from torch.distributed.checkpoint import FileSystemWriter

from agent.checkpoint import Checkpointer, SaveFailedError
from agent.storage import StorageError


def sync(args: argparse.Namespace) -> None:
    sig = signal.SIGINT if args.signal == "INT" else signal.SIGTERM
    if sig == signal.SIGTERM:
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the script's own handler
    state = make_state(0)
    ckpt = Checkpointer(args.uri, keep=None, async_save=False)
    train(state, 1)
    ckpt.save(1, state)
    sent = threading.Event()
    if args.at == "write":
        # While DCP writes the shards: DCP hands what stops a rank there to every rank, wrapped.
        real_write = FileSystemWriter.write_data

        def signal_then_write(*a: Any, **kw: Any) -> Any:
            if not sent.is_set():
                sent.set()
                os.kill(os.getpid(), sig)
            return real_write(*a, **kw)

        FileSystemWriter.write_data = signal_then_write  # type: ignore[method-assign]
        train(state, 1, start=1)
        ckpt.save(2, state)
        raise AssertionError("the signal did not stop the save of step 2")
    name = "put_file" if args.at == "upload" else "put_bytes_if_absent"
    real = getattr(ckpt.storage, name)

    def signal_then_go_on(*a: Any, **kw: Any) -> Any:
        # At the commit, the manifest's write: the folder's claim (WRITER.json) goes through it too,
        # from another thread while the shards are written.
        at_the_point = args.at == "upload" or str(a[0]).endswith("/MANIFEST.json")
        if at_the_point and not sent.is_set():
            sent.set()
            os.kill(os.getpid(), sig)  # the handler runs at the main thread's next bytecode
        return real(*a, **kw)

    setattr(ckpt.storage, name, signal_then_go_on)
    train(state, 1, start=1)
    try:
        ckpt.save(2, state)
    except KeyboardInterrupt:
        if not args.carry_on:
            raise
        print("interrupted", flush=True)
        setattr(ckpt.storage, name, real)
        ckpt.save(3, state)
        ckpt.close()
        print("saved 3", flush=True)
        return
    raise AssertionError("the signal did not stop the save of step 2")


def main_thread_in(*functions: str) -> bool:
    """Whether the main thread is, right now, inside calls of every one of these function names."""
    frame = sys._current_frames().get(threading.main_thread().ident or 0)
    names = set()
    while frame is not None:
        names.add(frame.f_code.co_name)
        frame = frame.f_back
    return set(functions) <= names


def close(args: argparse.Namespace) -> None:
    state = make_state(0)
    ckpt = Checkpointer(args.uri, keep=None, async_save=True)
    real = ckpt.storage.put_file
    uploading, first_close_over, second_close_over = threading.Event(), threading.Event(), threading.Event()

    def closing() -> bool:
        """The main thread waits in ``close()`` for the save."""
        return main_thread_in("close", "wait")

    def interrupt_close_then_go_on(*a: Any, **kw: Any) -> Any:
        if not uploading.is_set():
            uploading.set()
            while not closing():
                first_close_over.wait(0.01)
            os.kill(os.getpid(), signal.SIGINT)
            first_close_over.wait()
            # The upload goes on once the second close() waits for it (or has returned without).
            while not (closing() or second_close_over.is_set()):
                second_close_over.wait(0.01)
        return real(*a, **kw)

    ckpt.storage.put_file = interrupt_close_then_go_on  # type: ignore[method-assign]
    train(state, 1)
    ckpt.save(1, state)
    try:
        ckpt.close()
    except KeyboardInterrupt:
        print("close interrupted", flush=True)
    finally:
        first_close_over.set()
        try:
            ckpt.close()
        finally:
            second_close_over.set()
    print(f"closed after committing {ckpt.last_committed_step}", flush=True)


def close_other_thread(args: argparse.Namespace) -> None:
    """Ctrl-C handed by the kernel to a thread other than the main one (a process-directed signal
    may land on any thread) while ``close()`` waits: it must still reach ``close()`` while the
    save is held, not only once the save is over."""
    state = make_state(0)
    ckpt = Checkpointer(args.uri, keep=None, async_save=True)
    real = ckpt.storage.put_file
    uploading, close_over = threading.Event(), threading.Event()
    held: list[bool] = []

    def in_close() -> bool:
        return main_thread_in("close", "wait")

    def interrupt_from_this_thread(*a: Any, **kw: Any) -> Any:
        if not uploading.is_set():
            uploading.set()
            while not in_close():
                close_over.wait(0.01)
            signal.pthread_kill(threading.get_ident(), signal.SIGINT)  # this thread, not the main one
            held.append(close_over.wait(60))  # the bound keeps a failing run from hanging
        return real(*a, **kw)

    ckpt.storage.put_file = interrupt_from_this_thread  # type: ignore[method-assign]
    train(state, 1)
    ckpt.save(1, state)
    try:
        ckpt.close()
    except KeyboardInterrupt:
        print("close interrupted", flush=True)
    finally:
        close_over.set()
        ckpt.close()
    print(f"while the save was held: {held == [True]}", flush=True)


class _Probe:
    """Per-rank state whose ``state_dict()`` (run while the rank prepares a save) calls ``hook``."""

    def __init__(self, hook: Callable[[], None]) -> None:
        self.hook = hook

    def state_dict(self) -> dict[str, Any]:
        self.hook()
        return {"n": 1}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


def ranks(args: argparse.Namespace) -> None:
    if len(args.uri) != len(args.at):
        raise SystemExit(f"ranks: one --at per --uri; got {args.uri} and {args.at}")
    dist.init_process_group("gloo")
    for uri, at in zip(args.uri, args.at, strict=True):
        said = ranks_case(argparse.Namespace(uri=uri, at=at), dist.get_rank())
        # One write per line: two ranks share the pipe, and print()'s text and newline can go out apart.
        os.write(1, f"{at} {said}\n".encode() if len(args.uri) > 1 else f"{said}\n".encode())
    exit_without_teardown()


def ranks_case(args: argparse.Namespace, rank: int) -> str:
    """One case of ``ranks``: what this rank says."""
    state = make_state(rank)
    sent, arm = threading.Event(), threading.Event()

    def interrupt_rank0() -> None:
        if rank == 0 and arm.is_set() and not sent.is_set():
            sent.set()
            os.kill(os.getpid(), signal.SIGINT)  # the handler runs at the main thread's next bytecode

    state["probe"] = _Probe(interrupt_rank0 if args.at == "staging" else lambda: None)
    ckpt = Checkpointer(args.uri, keep=None, async_save=args.at == "staging")
    train(state, 1)
    ckpt.save(1, state)
    ckpt.wait()
    real = ckpt.storage.put_file

    def signal_then_go_on(*a: Any, **kw: Any) -> Any:
        if args.at == "upload":
            interrupt_rank0()
        return real(*a, **kw)

    ckpt.storage.put_file = signal_then_go_on  # type: ignore[method-assign]
    arm.set()
    train(state, 1, start=1)
    try:
        ckpt.save(2, state)
        ckpt.wait()
        raised = "nothing"
    except (KeyboardInterrupt, SaveFailedError) as e:
        raised = type(e).__name__
    arm.clear()
    train(state, 1, start=2)
    ckpt.save(3, state)
    ckpt.close()
    return f"rank{rank} {raised}"


def with_body(args: argparse.Namespace) -> None:
    state = make_state(0)
    with Checkpointer(args.uri, keep=None, async_save=True) as ckpt:

        def refuse(*a: Any, **kw: Any) -> None:
            raise StorageError("the store refuses the upload")

        ckpt.storage.put_file = refuse  # type: ignore[method-assign]
        train(state, 1)
        ckpt.save(1, state)
        os.kill(os.getpid(), signal.SIGINT)
        train(state, 1, start=1)
    raise AssertionError("the body went on after Ctrl-C")


CAUGHT = {
    "close": lambda uri: close(argparse.Namespace(uri=uri)),
    "close-other-thread": lambda uri: close_other_thread(argparse.Namespace(uri=uri)),
    "carry-on": lambda uri: sync(argparse.Namespace(uri=uri, signal="INT", at="upload", carry_on=True)),
}
"""The cases of ``cases``: each catches its signal and ends cleanly, so several share one process
(a Python that imports torch costs about 3 CPU-s) and the next starts where the last returned."""


def cases(runs: list[list[str]]) -> None:
    for mode, uri, out in runs:
        with open(out, "w") as f, contextlib.redirect_stdout(f):
            try:
                CAUGHT[mode](uri)
            except BaseException:  # what its own process would have died of: its test fails on it
                traceback.print_exc(file=f)
                traceback.print_exc()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["sync", "close", "close-other-thread", "ranks", "with-body", "cases"])
    p.add_argument("--uri", action="append", help="ranks: once per case; cases: none; the others: once")
    p.add_argument("--run", nargs=3, action="append", metavar=("MODE", "URI", "OUT"), help="cases: once per case")
    p.add_argument("--signal", choices=["INT", "TERM"], default="INT")
    p.add_argument("--at", choices=["staging", "write", "upload", "commit"], action="append", help="default: upload")
    p.add_argument("--carry-on", action="store_true")
    args = p.parse_args()
    args.at = args.at or ["upload"]
    if args.mode == "cases":
        if args.uri or not args.run or any(mode not in CAUGHT for mode, _, _ in args.run):
            p.error(f"cases: one or more --run MODE URI OUT, MODE one of {', '.join(CAUGHT)}")
    elif not args.uri:
        p.error(f"{args.mode}: --uri is required")
    if args.mode not in ("ranks", "cases"):
        if len(args.uri) > 1 or len(args.at) > 1:
            p.error(f"{args.mode}: one --uri and at most one --at")
        args.uri, args.at = args.uri[0], args.at[0]
    # Ctrl-C as a terminal gives it to a foreground script: Python raises KeyboardInterrupt only if
    # SIGINT was not ignored when it started, and a process started in the background by a
    # non-interactive shell (a CI runner's `cmd &`) inherits it ignored.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    modes = {
        "sync": sync,
        "close": close,
        "close-other-thread": close_other_thread,
        "ranks": ranks,
        "with-body": with_body,
        "cases": lambda args: cases(args.run),
    }
    modes[args.mode](args)


if __name__ == "__main__":
    main()
