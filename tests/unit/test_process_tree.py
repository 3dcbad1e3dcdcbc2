"""``marked()``: the processes found by the marker in their environment, and a process whose
environment reads empty for a moment (caught inside its exec: the kernel sets the new program's
environment after ``Popen`` returned in its parent). The empty read is made by hand at psutil's
``Process.environ`` for one real process; everything else is read from the real processes."""

from __future__ import annotations

import builtins
import dataclasses
import errno
import os
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import psutil
import pytest

from agent import process_tree
from agent.process_tree import ENVIRON_REREAD_PAUSES, ProcInfo, marked, read_proc
from orchestrator.backends.local_cloud import kill_marked

VARIABLE = "SPOTJOB_TEST_MARKED"


def wait_until(check: Callable[[], bool], what: str) -> None:
    """Wait (bounded, generously: a loaded machine) for ``check``; the test is about whether, not when."""
    deadline = time.monotonic() + 60
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def real_environ(pid: int) -> dict[str, str]:
    try:
        return dict(psutil.Process(pid).environ())
    except psutil.Error:
        return {}


@pytest.fixture
def processes() -> Iterator[Callable[[dict[str, str]], subprocess.Popen[bytes]]]:
    """Starts ``sleep`` with the environment given, once its exec is over (its environment reads as
    given, or, given none, its program is ``sleep``); kills them all at the end."""
    started: list[subprocess.Popen[bytes]] = []

    def start(env: dict[str, str]) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(["sleep", "61"], env=env)
        started.append(proc)
        if env:
            wait_until(lambda: real_environ(proc.pid) == env, "the child's environment to be set")
        else:
            wait_until(lambda: psutil.Process(proc.pid).name() == "sleep", "the child to exec sleep")
        return proc

    yield start
    for proc in started:
        proc.kill()
        proc.wait()


class EnvironReads:
    """psutil's ``Process.environ`` counting its reads of each pid since ``empty_next``."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.reads: list[int] = []
        self.empty: set[int] = set()
        real = psutil.Process.environ

        def environ(proc: psutil.Process) -> dict[str, str]:
            self.reads.append(proc.pid)
            if proc.pid in self.empty:
                self.empty.discard(proc.pid)
                return {}
            return real(proc)

        monkeypatch.setattr(psutil.Process, "environ", environ)

    def empty_next(self, pid: int) -> None:
        """The next read of ``pid`` is empty, as a process caught inside its exec reads; counts
        start again from here."""
        self.empty.add(pid)
        self.reads.clear()

    def of(self, pid: int) -> int:
        return self.reads.count(pid)


@pytest.fixture
def environ_reads(monkeypatch: pytest.MonkeyPatch) -> EnvironReads:
    return EnvironReads(monkeypatch)


def info(pid: int) -> ProcInfo:
    found = read_proc(pid)
    assert found is not None, f"process {pid} is gone"
    return found


def test_marked_finds_a_process_whose_environment_read_empty_at_first(
    processes: Callable[[dict[str, str]], subprocess.Popen[bytes]], environ_reads: EnvironReads
) -> None:
    """A marked process caught inside its exec reads an empty environment: ``marked()`` read each
    environment once and left it out, though it carries the marker a moment later."""
    value = uuid.uuid4().hex
    child = processes({**os.environ, VARIABLE: value})
    environ_reads.empty_next(child.pid)
    assert [p.pid for p in marked(VARIABLE, value)] == [child.pid]
    assert environ_reads.of(child.pid) == 2  # read again once, once it read empty


def test_kill_marked_stops_a_process_whose_environment_read_empty_at_first(
    processes: Callable[[dict[str, str]], subprocess.Popen[bytes]], environ_reads: EnvironReads
) -> None:
    """``kill_marked`` (local mode's end of a node or worker, ``--resume``'s takeover) scans until a
    scan finds nothing: when the only marked process read empty at the first scan, the stop ended
    at once, found nothing, and the process lived on after its node was terminated."""
    value = uuid.uuid4().hex
    child = processes({**os.environ, VARIABLE: value})
    environ_reads.empty_next(child.pid)
    assert kill_marked(VARIABLE, value, grace=5.0, reason="test") == 1
    assert child.wait(timeout=60) == -15  # SIGTERM


def test_a_kernel_thread_is_not_read_again(
    processes: Callable[[dict[str, str]], subprocess.Popen[bytes]], environ_reads: EnvironReads
) -> None:
    """A kernel thread's environment reads empty for good: it is read once, never again, so a scan
    among them pauses only for the marked process that read empty. The kernel threads this machine
    shows (none in a container's own pid namespace) and a process flagged as one by hand (its
    environment really empty) are among those scanned."""
    value = uuid.uuid4().hex
    child = processes({**os.environ, VARIABLE: value})
    flagged = dataclasses.replace(info(processes({}).pid), kernel=True)
    kernel_threads = [p for p in process_tree.all_processes() if p.kernel]
    environ_reads.empty_next(child.pid)
    found = marked(VARIABLE, value, among=[info(child.pid), flagged, *kernel_threads])
    assert [p.pid for p in found] == [child.pid]
    assert environ_reads.of(child.pid) == 2
    assert {p.pid: environ_reads.of(p.pid) for p in [flagged, *kernel_threads]} == {
        p.pid: 1 for p in [flagged, *kernel_threads]
    }


def test_a_process_started_with_an_empty_environment_is_read_again_a_bounded_number_of_times(
    processes: Callable[[dict[str, str]], subprocess.Popen[bytes]], environ_reads: EnvironReads
) -> None:
    """``env -i``: its environment reads empty for good, and it is not a kernel thread. It is read
    again a few times (as long as the marked process caught inside its exec could have needed),
    then taken as unmarked, not waited on until it gains an environment it never will."""
    value = uuid.uuid4().hex
    child = processes({**os.environ, VARIABLE: value})
    bare = processes({})
    assert not info(bare.pid).kernel
    environ_reads.empty_next(child.pid)
    found = marked(VARIABLE, value, among=[info(bare.pid), info(child.pid)])
    assert [p.pid for p in found] == [child.pid]
    assert environ_reads.of(bare.pid) == 1 + len(ENVIRON_REREAD_PAUSES)


@pytest.fixture(params=["proc", "psutil"])
def walk(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Processes read from ``/proc/<pid>/stat``, or through psutil as where there is no ``/proc``
    (``/proc`` unopenable for this module, as in tests/unit/test_portability.py)."""
    if request.param == "psutil":
        real_open = builtins.open

        def open_without_proc(file: Any, *args: Any, **kwargs: Any) -> Any:
            if str(file).startswith("/proc/"):
                raise FileNotFoundError(errno.ENOENT, "No such file or directory (simulated macOS)", str(file))
            return real_open(file, *args, **kwargs)

        monkeypatch.setattr(process_tree, "open", open_without_proc, raising=False)
    monkeypatch.setattr(process_tree, "_procfs", None, raising=False)
    return str(request.param)


def test_kernel_threads_are_told_from_processes(walk: str) -> None:
    """Kernel threads (``PF_KTHREAD`` in ``/proc/<pid>/stat``; without ``/proc``, kthreadd and its
    children) are flagged, this process is not. Where kthreadd cannot be seen (a container's own
    pid namespace) only this process is looked at."""
    assert read_proc(os.getpid()) is not None
    assert not info(os.getpid()).kernel
    try:
        kthreadd = psutil.Process(2)
        shown = kthreadd.name() == "kthreadd" and kthreadd.ppid() == 0
    except psutil.Error:
        shown = False
    if shown:
        threads = [2, *(p.pid for p in psutil.process_iter() if p.ppid() == 2)]
        infos = [p for p in map(read_proc, threads) if p is not None]  # one may have ended meanwhile
        assert len(infos) > 1
        assert [p.pid for p in infos if not p.kernel] == []
