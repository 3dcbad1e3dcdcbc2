"""spotjob off Linux (a user's macOS laptop): every Linux-only call has a guard, and the path
taken without it still works. This machine is Linux, so each test simulates the other platform at
the one seam the code looks at (an attribute that is or is not there, ``/proc`` that cannot be
opened, ``sys.platform``, ``platform.system()``, the answers of ``select.poll``) and runs the real
code, files and processes behind it; each test's docstring says what it simulates and what it does
not model. Nothing here has run on macOS itself.
"""

from __future__ import annotations

import builtins
import ctypes
import errno
import fcntl
import importlib.util
import io
import json
import os
import pickle
import select
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch
from torch import nn

from agent import _dcp_write, _direct_io, dcp_safe, process_tree
from agent.atomic_file import write_atomic
from agent.checkpoint import Checkpointer
from agent.process_tree import ProcessTree, marked
from agent.storage.file import FileStorage
from orchestrator import cli_status
from orchestrator.backends.local_cloud import kill_marked
from orchestrator.cli_pipe import stdout_reader_left
from tests.ckpt_compare import assert_same_training_state

REPO = Path(__file__).resolve().parents[2]
MACOS_F_FULLFSYNC = 51
"""``F_FULLFSYNC`` in macOS's <fcntl.h>; on Linux ``fcntl`` refuses this command with ``EINVAL``."""


# -- durability: F_FULLFSYNC where the platform has it --------------------------------------------


class FullFsyncs:
    """Records ``fcntl(fd, F_FULLFSYNC)`` and ``os.fsync(fd)`` by the inode they reached."""

    def __init__(self) -> None:
        self.full: set[int] = set()
        self.plain: set[int] = set()


@pytest.fixture
def macos_fullfsync(monkeypatch: pytest.MonkeyPatch) -> Iterator[FullFsyncs]:
    """``fcntl.F_FULLFSYNC`` exists and works, as on macOS; ``os.fsync`` still works but is recorded."""
    seen = FullFsyncs()
    real_fcntl, real_fsync = fcntl.fcntl, os.fsync

    def fake_fcntl(fd: Any, cmd: int, arg: Any = 0) -> Any:
        if cmd == MACOS_F_FULLFSYNC:
            os.fdatasync(fd)  # Linux's nearest: the bytes do get synced, so the save is real
            seen.full.add(os.fstat(fd).st_ino)
            return 0
        return real_fcntl(fd, cmd, arg)

    def recorded_fsync(fd: int) -> None:
        seen.plain.add(os.fstat(fd).st_ino)
        real_fsync(fd)

    monkeypatch.setattr(fcntl, "F_FULLFSYNC", MACOS_F_FULLFSYNC, raising=False)
    monkeypatch.setattr(fcntl, "fcntl", fake_fcntl)
    monkeypatch.setattr(os, "fsync", recorded_fsync)
    yield seen


class Small(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 8)
        self.b = nn.Parameter(torch.randn(300, 300))  # 360 KB: a tensor restored in place


def trained(seed: int) -> tuple[Small, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = Small()
    optim = torch.optim.AdamW(model.parameters())
    (model.a(torch.randn(4, 16)).sum() + model.b.sum()).backward()
    optim.step()
    return model, optim


def test_every_fsync_of_a_checkpoints_commit_is_a_full_fsync_where_the_platform_has_one(
    tmp_path: Path, macos_fullfsync: FullFsyncs
) -> None:
    """On macOS, fsync(2) leaves the bytes in the drive's cache, which a power cut loses:
    a checkpoint whose MANIFEST.json (or shard) was only fsynced can be gone after the crash it
    was written for. Every sync of the commit (each shard, the manifest, the folders their names
    are in) must be ``fcntl(F_FULLFSYNC)`` where it exists.

    Simulates macOS by giving ``fcntl`` an ``F_FULLFSYNC`` (recorded, then synced with Linux's
    fdatasync); a real Checkpointer saves and restores on a real folder. Does not model a drive
    cache or a power cut, nor APFS."""
    model, optim = trained(0)
    root = tmp_path / "ckpt"
    with Checkpointer(str(root), async_save=False) as ckpt:
        ckpt.save(5, {"model": model, "optim": optim})
    step_folder = next(p for p in root.iterdir() if p.is_dir() and (p / "MANIFEST.json").exists())
    committed = {p.name: p.stat().st_ino for p in step_folder.iterdir()}
    assert "MANIFEST.json" in committed and len(committed) > 1, committed
    not_full = sorted(name for name, ino in committed.items() if ino not in macos_fullfsync.full)
    assert not not_full, f"committed without F_FULLFSYNC: {not_full}"
    assert step_folder.stat().st_ino in macos_fullfsync.full, "the checkpoint's folder was not full-synced"
    assert not macos_fullfsync.plain, "a plain fsync where F_FULLFSYNC exists"
    fresh, fresh_optim = trained(1)
    with Checkpointer(str(root)) as ckpt:
        assert ckpt.restore({"model": fresh, "optim": fresh_optim}) == 5
    assert_same_training_state(model, fresh, optim, fresh_optim)


def test_a_filesystem_without_full_fsync_gets_a_plain_fsync(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """SMB and some network mounts on macOS refuse F_FULLFSYNC (ENOTSUP/EINVAL): the write still
    happens, with fsync, the most that filesystem offers (SQLite does the same).

    Simulates macOS's constant only: the real Linux ``fcntl`` refuses command 51 with EINVAL, as
    such a filesystem would. Does not model a real SMB mount."""
    synced: list[int] = []
    real_fsync = os.fsync

    def recorded_fsync(fd: int) -> None:
        synced.append(fd)
        real_fsync(fd)

    monkeypatch.setattr(fcntl, "F_FULLFSYNC", MACOS_F_FULLFSYNC, raising=False)
    monkeypatch.setattr(os, "fsync", recorded_fsync)
    storage = FileStorage(str(tmp_path))
    storage.put_bytes_if_absent("step-1/MANIFEST.json", b"{}")
    write_atomic(str(tmp_path / "status.json"), b"{}")
    assert (tmp_path / "step-1" / "MANIFEST.json").read_bytes() == b"{}"
    assert (tmp_path / "status.json").read_bytes() == b"{}"
    assert len(synced) >= 4  # two files and their folders


def test_a_full_fsync_that_fails_with_an_io_error_fails_the_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An EIO from F_FULLFSYNC means bytes may be lost: it is raised, not papered over by a
    plain fsync that could then report success, and no temp file is left.

    Simulates macOS's ``F_FULLFSYNC`` failing with EIO; does not model a failing disk."""

    def failing(fd: Any, cmd: int, arg: Any = 0) -> Any:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(fcntl, "F_FULLFSYNC", MACOS_F_FULLFSYNC, raising=False)
    monkeypatch.setattr(fcntl, "fcntl", failing)
    with pytest.raises(OSError) as raised:
        write_atomic(str(tmp_path / "MANIFEST.json"), b"{}")
    assert raised.value.errno == errno.EIO
    assert os.listdir(tmp_path) == []


# -- the rest of the save path without Linux's extras ------------------------------------------------


class MacLibc:
    """macOS's libc as ctypes shows it, as far as these calls go: a ``madvise``, no ``prctl`` and no
    ``sync_file_range``. Its functions are plain functions, so ``argtypes`` can be set on them
    as on a ctypes function; each records its calls."""

    def __init__(self) -> None:
        self.madvise_calls: list[tuple[int, int, int]] = []
        outer = self

        def madvise(addr: int, length: int, advice: int) -> int:
            outer.madvise_calls.append((addr, length, advice))
            return 0

        self.madvise: Any = madvise


def test_a_save_and_restore_work_without_o_direct_fadvise_sync_file_range_or_madvise(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Checkpointer asked for O_DIRECT on a platform without it, nor posix_fadvise, nor libc's
    sync_file_range and madvise: the shards are written through the page cache and restore
    exactly.

    Simulates macOS by removing ``os.O_DIRECT``, ``os.posix_fadvise`` and the two libc symbols (a
    ``ctypes.CDLL`` without them, as macOS's libc has no ``sync_file_range``) and setting
    ``sys.platform``. Does not model macOS's page cache or its libc otherwise."""

    libc = MacLibc()
    for name in ("O_DIRECT", "posix_fadvise"):
        monkeypatch.delattr(os, name, raising=False)
    monkeypatch.setattr(sys, "platform", "darwin")
    monkeypatch.setattr(ctypes, "CDLL", lambda *a, **k: libc)
    monkeypatch.setattr(_dcp_write, "_libc", None)
    monkeypatch.setattr(dcp_safe, "_madvise", None)
    assert not _direct_io.suits_direct_io(str(tmp_path))
    model, optim = trained(0)
    with Checkpointer(str(tmp_path), async_save=False, direct_io=True) as ckpt:
        ckpt.save(2, {"model": model, "optim": optim})
    fresh, fresh_optim = trained(1)
    with Checkpointer(str(tmp_path)) as ckpt:
        assert ckpt.restore({"model": fresh, "optim": fresh_optim}) == 2
    assert_same_training_state(model, fresh, optim, fresh_optim)
    assert libc.madvise_calls == [], "Linux's MADV_POPULATE_WRITE (23) handed to another kernel's madvise"


def test_no_linux_madvise_number_reaches_another_kernels_madvise(monkeypatch: pytest.MonkeyPatch) -> None:
    """``map_for_writing`` passes 23, Linux's MADV_POPULATE_WRITE, to libc's madvise. macOS has a
    madvise whose numbers mean other things (some discard pages): off Linux it must not be called.

    Simulates macOS with ``sys.platform = "darwin"`` and a libc whose madvise records its calls;
    does not model what macOS's madvise would do with 23. (Linux's own madvise is not simulated
    away here: ``test_a_save_and_restore_work_without_...`` runs a whole save this way.)"""
    libc = MacLibc()
    monkeypatch.setattr(sys, "platform", "darwin")
    monkeypatch.setattr(ctypes, "CDLL", lambda *a, **k: libc)
    monkeypatch.setattr(dcp_safe, "_madvise", None)
    dcp_safe.map_for_writing([torch.empty(1 << 20, dtype=torch.uint8)])
    assert libc.madvise_calls == []


def test_no_linux_prctl_number_reaches_another_kernels_prctl(monkeypatch: pytest.MonkeyPatch) -> None:
    """``become_subreaper`` is Linux's ``prctl(PR_SET_CHILD_SUBREAPER=36)``: off Linux it says False
    without calling a ``prctl`` of another kernel with Linux's option number.

    Simulates another platform with ``sys.platform = "darwin"`` and a libc that has a ``prctl``
    (recording its calls); does not model any real kernel's prctl."""
    calls: list[int] = []

    class Libc:
        def prctl(self, option: int, *args: int) -> int:
            calls.append(option)
            return 0

    monkeypatch.setattr(sys, "platform", "darwin")
    monkeypatch.setattr(ctypes, "CDLL", lambda *a, **k: Libc())
    assert process_tree.become_subreaper() is False
    assert calls == []


# -- processes without /proc ---------------------------------------------------------------------------


@pytest.fixture
def no_procfs(monkeypatch: pytest.MonkeyPatch) -> None:
    """``/proc`` cannot be opened by spotjob's own code, as on macOS."""
    real_open = builtins.open

    def open_without_proc(file: Any, *args: Any, **kwargs: Any) -> Any:
        if str(file).startswith("/proc/"):
            raise FileNotFoundError(errno.ENOENT, "No such file or directory (simulated macOS)", str(file))
        return real_open(file, *args, **kwargs)

    for module in (process_tree, cli_status):
        monkeypatch.setattr(module, "open", open_without_proc, raising=False)
    monkeypatch.setattr(process_tree, "_procfs", None, raising=False)


CHILD_AND_GRANDCHILD = (
    "import subprocess, sys, time\n"
    "g = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'], start_new_session=True)\n"
    "print(g.pid, flush=True)\n"
    "time.sleep(600)\n"
)


def start_marked_pair(variable: str, value: str) -> tuple[subprocess.Popen[str], int]:
    """A child, and a grandchild of it in a session of its own (as torchrun starts ranks), both
    carrying ``variable=value`` in their environment; the child's Popen and the grandchild's pid."""
    env = {**os.environ, variable: value}
    child = subprocess.Popen([sys.executable, "-c", CHILD_AND_GRANDCHILD], env=env, stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None
    return child, int(child.stdout.readline())


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def wait_until(check: Callable[[], bool], what: str) -> None:
    """Wait (bounded, generously: a loaded machine) for ``check``; the test is about whether, not when."""
    deadline = time.monotonic() + 60
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def stop(child: subprocess.Popen[str], grandchild: int) -> None:
    for pid in (child.pid, grandchild):
        try:
            psutil.Process(pid).kill()
        except psutil.NoSuchProcess:
            pass
    child.wait()


def test_local_mode_finds_and_stops_a_nodes_processes_without_proc(no_procfs: None) -> None:
    """Local mode ends a preempted node by killing every process carrying its marker
    (``kill_marked``). Without /proc that walk found no process at all: on a Mac the node's
    ranks outlived its termination, and ``spotjob status`` saw no worker.

    Simulates macOS by making ``/proc`` unopenable for spotjob's code; psutil still reads Linux's
    /proc underneath, so macOS's psutil backend (sysctl, libproc) is not modelled."""
    child, grandchild = start_marked_pair("SPOTJOB_TEST_PORTABILITY", f"node-{os.getpid()}")
    try:
        # The grandchild's pid is printed once it is spawned, a moment before the kernel sets its
        # new program's environment (read empty until then: once in CI); look again until then.
        wanted = {child.pid, grandchild}
        wait_until(
            lambda: {p.pid for p in marked("SPOTJOB_TEST_PORTABILITY", f"node-{os.getpid()}")} == wanted,
            "marked() to find the child and the grandchild",
        )
        assert kill_marked("SPOTJOB_TEST_PORTABILITY", f"node-{os.getpid()}", grace=5.0, reason="test") == 2
        child.wait()
        wait_until(lambda: gone(grandchild), "the grandchild outlived kill_marked")
    finally:
        stop(child, grandchild)


def test_the_agent_sees_and_stops_its_commands_processes_without_proc(no_procfs: None) -> None:
    """The agent's ``ProcessTree`` walks parent links down from the command: without /proc it saw
    nothing below the command, so ``stop_all`` at the end of a run left the ranks running.

    Simulates macOS by making ``/proc`` unopenable for spotjob's code (psutil still reads Linux's
    /proc underneath); no subreaper, as on macOS. Does not model macOS's process table itself."""
    agent_id = f"portability-{os.getpid()}"
    child, grandchild = start_marked_pair(process_tree.ENV_AGENT_ID, agent_id)
    try:
        tree = ProcessTree(agent_id)
        tree.command_pid = child.pid
        assert {p.pid for p in tree.refresh()} == {child.pid, grandchild}
        assert tree.stop_all(grace=5.0, reason="test") == 2
        child.wait()
        wait_until(lambda: gone(grandchild), "the grandchild outlived stop_all")
    finally:
        stop(child, grandchild)


def test_spotjob_status_tells_a_live_driver_of_an_older_run_folder_without_proc(
    tmp_path: Path, no_procfs: None
) -> None:
    """An older run folder names its driver's pid in run.json; ``spotjob status`` checks that the
    pid is still a spotjob. That read /proc/<pid>/cmdline: on macOS every such driver looked gone.

    Simulates macOS by making ``/proc`` unopenable for spotjob's code (psutil still reads Linux's
    /proc underneath). Does not model macOS's sysctl(KERN_PROCARGS2).

    Waits for the driver's first line: Popen returns while the kernel is still inside the child's
    exec, before it has set where the new argv lies, and /proc/<pid>/cmdline reads empty until then
    (on every Python; the test failed under load, more often on 3.13). A real driver writes run.json
    itself, long after its exec."""
    driver = subprocess.Popen(
        [sys.executable, "-c", "print('up', flush=True); import time; time.sleep(600)", "spotjob-run-driver"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert driver.stdout is not None and driver.stdout.readline() == "up\n"
        (tmp_path / "run.json").write_text(json.dumps({"pid": driver.pid}))
        assert cli_status._driver_pid(str(tmp_path)) == driver.pid
    finally:
        driver.kill()
        driver.communicate()  # waits, and closes its stdout


# -- make test on a Mac: helm ------------------------------------------------------------------------


def test_get_helm_uses_the_users_helm_where_the_pinned_one_cannot_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``make test`` runs scripts/get-helm.py, whose pinned helm is linux/amd64: on a Mac it
    stopped ``make test`` even with helm installed, as it asked. A helm in $SPOTJOB_HELM (or on
    PATH) is now what it reports, and the tests use it.

    Simulates macOS with ``platform.system() == "Darwin"`` and ``machine() == "arm64"``; the helm
    named is a stand-in path (nothing runs it). Does not model Homebrew."""
    spec = importlib.util.spec_from_file_location("get_helm", REPO / "scripts" / "get-helm.py")
    assert spec and spec.loader
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    theirs = tmp_path / "opt" / "homebrew" / "bin" / "helm"
    monkeypatch.setattr(script.platform, "system", lambda: "Darwin")
    monkeypatch.setattr(script.platform, "machine", lambda: "arm64")
    monkeypatch.setenv("SPOTJOB_HELM", str(theirs))
    assert script.install(tmp_path / "tools") == theirs
    assert not (tmp_path / "tools" / "bin" / "helm").exists()
    monkeypatch.delenv("SPOTJOB_HELM")
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(SystemExit, match="brew install helm"):
        script.install(tmp_path / "tools")


# -- `spotjob status | head` on a Mac -----------------------------------------------------------------


LINUX_POLL = select.poll


class XnuPoll:
    """``select.poll`` as macOS's kernel answers it (xnu bsd/kern/sys_generic.c: poll_nocancel
    registers a kqueue filter only for the events asked; poll_callback turns EV_EOF into POLLHUP,
    never POLLERR, and a write filter with EV_EOF adds no POLLOUT). Whether the pipe's reader left is
    read from the real pipe, through Linux's poll (POLLERR there)."""

    def __init__(self) -> None:
        self._fds: dict[int, int] = {}

    def register(self, fd: int, events: int = select.POLLIN | select.POLLPRI | select.POLLOUT) -> None:
        self._fds[fd] = events

    def poll(self, timeout: float | None = None) -> list[tuple[int, int]]:
        out = []
        for fd, events in self._fds.items():
            real = LINUX_POLL()
            real.register(fd, select.POLLOUT)
            reader_left = any(e & select.POLLERR for _, e in real.poll(0))
            if events & select.POLLOUT:  # an EVFILT_WRITE filter
                out.append((fd, select.POLLHUP if reader_left else select.POLLOUT))
        return [(fd, e) for fd, e in out if e]


def test_a_pipe_whose_reader_left_is_told_as_macos_reports_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """``spotjob status | head -1``: the BrokenPipeError is taken for the reader leaving only when
    poll says so. It registered stdout for no events and looked for POLLERR, which is Linux's
    answer; macOS's poll reports nothing for no events, and POLLHUP for a write end whose reader
    left: every such pipeline ended in an error there.

    Simulates macOS's poll (``XnuPoll``, from xnu's source) over a real pipe; does not run xnu."""
    read_end, write_end = os.pipe()
    try:
        monkeypatch.setattr(select, "poll", XnuPoll)
        monkeypatch.setattr(sys, "stdout", io.TextIOWrapper(io.FileIO(write_end, "w", closefd=False)))
        assert not stdout_reader_left(), "the reader is still there"
        os.close(read_end)
        read_end = -1
        assert stdout_reader_left()
    finally:
        for fd in (read_end, write_end):
            if fd >= 0:
                os.close(fd)


@pytest.mark.parametrize("module", ["pathlib", "pathlib._local"])
def test_dcp_metadata_naming_its_path_under_either_pythons_pathlib_module_loads(module: str) -> None:
    """DCP's ``.metadata`` holds ``StorageMeta.checkpoint_id``, a path. Python 3.13 pickles it as
    ``pathlib._local.PosixPath``, 3.11 and 3.12 as ``pathlib.PosixPath``: a checkpoint saved on one
    must restore on the other. (The ``pathlib`` case pins behaviour that already worked.)"""
    from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

    written = Metadata(state_dict_metadata={}, storage_meta=StorageMeta(checkpoint_id=Path("/ckpt/step-1")))
    data = pickle.dumps(written, protocol=2)  # names its classes as "c<module>\n<name>\n"
    for name in (b"pathlib", b"pathlib._local"):  # the name this Python wrote, whichever it is
        data = data.replace(b"c" + name + b"\nPosixPath\n", b"c" + module.encode() + b"\nPosixPath\n")
    assert f"c{module}\nPosixPath\n".encode() in data
    loaded = dcp_safe.load_dcp_metadata(data)
    assert loaded.storage_meta is not None and loaded.storage_meta.checkpoint_id == Path("/ckpt/step-1")


def test_parallel_transfers_run_in_the_calling_thread_where_no_thread_can_start(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Python 3.12.0 and 3.12.1 refuse to start a thread once the main thread has ended: a save
    still in flight when the script ended then failed at its first thread pool and was lost. Here
    every new I/O thread is refused as 3.12.1 refuses it; the calls run all the same, each once."""
    import threading

    from agent.storage.base import parallel_map

    real_start = threading.Thread.start

    def start_refused_at_shutdown(self: threading.Thread) -> None:
        if self.name.startswith("spotjob-io"):
            raise RuntimeError("can't create new thread at interpreter shutdown")
        real_start(self)

    monkeypatch.setattr(threading.Thread, "start", start_refused_at_shutdown)
    done: list[int] = []
    parallel_map(done.append, [(i,) for i in range(5)], parallelism=4)
    assert sorted(done) == [0, 1, 2, 3, 4]


RANK_FILE_VIEW_IN_A_CYCLE = """
import gc
from agent import rank_state
view = rank_state.encode({"step": 1, "weights": [1.0] * 1000})
cycle = [view]
cycle.append(cycle)
del view, cycle
gc.collect()
print("collected")
"""


def test_the_rank_files_bytes_are_freed_in_a_reference_cycle_without_crashing() -> None:
    """A failed save's traceback holds the rank file's bytes in a reference cycle. On Python 3.12.0
    and 3.12.1 a ``BytesIO.getbuffer()`` view freed by the garbage collector crashed the process
    (segmentation fault, or "deallocated BytesIO object has exported buffers"). Only those Pythons
    ever failed this; elsewhere it pins behaviour that already worked."""
    out = subprocess.run([sys.executable, "-c", RANK_FILE_VIEW_IN_A_CYCLE], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "collected", out.stderr[-2000:]
    assert "exported buffers" not in out.stderr
