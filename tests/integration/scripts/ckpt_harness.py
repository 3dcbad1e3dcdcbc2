"""Test-side helpers: launch real torchrun jobs on loopback, wait for markers, kill -9 ranks.

torchrun starts each worker in a session of its own, so killing torchrun's process group does not
reach the ranks: the rank scripts write their pids, and the tests kill those pids.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from agent.ranks import free_port

REPO = Path(__file__).resolve().parents[3]
SCRIPTS = Path(__file__).resolve().parent
PYTHON = sys.executable
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))

# Generous bounds for a loaded 2-core machine; they only stop a hung test, nothing asserts speed.
RUN_TIMEOUT_S = 180.0
MARKER_TIMEOUT_S = 120.0


def job_env(**extra: str) -> dict[str, str]:
    """The environment of a rank: one thread per process, no stray spotjob settings, loopback."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SPOTJOB_", "TORCHELASTIC_"))}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    # The checkout under test comes first: an editable install elsewhere must not stand in for it.
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONPATH=os.pathsep.join((str(REPO), str(SCRIPTS))))
    env.update(extra)
    return env


def torchrun_argv(nproc: int, script: str | Path, args: Sequence[str]) -> list[str]:
    return [
        TORCHRUN,
        f"--nproc-per-node={nproc}",
        "--nnodes=1",
        "--master-addr=127.0.0.1",
        f"--master-port={free_port()}",
        "--max-restarts=0",
        str(script),
        *args,
    ]


def run(
    argv: Sequence[str], *, env: dict[str, str] | None = None, timeout: float = RUN_TIMEOUT_S, check: bool = True
) -> subprocess.CompletedProcess[str]:
    """Run to completion; on failure the assertion carries the job's output."""
    try:
        proc = subprocess.run(
            list(argv),
            cwd=REPO,
            env=env or job_env(),
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"{' '.join(argv)} did not finish:\n{_text(e.stdout)}\n{_text(e.stderr)}") from None
    if check and proc.returncode != 0:
        raise _failed(proc)
    return proc


def _failed(proc: subprocess.CompletedProcess[str]) -> AssertionError:
    """The assertion for a job that exited non-zero, carrying its command and the end of its output."""
    return AssertionError(
        f"{' '.join(map(str, proc.args))} exited {proc.returncode}\n--- stdout\n{proc.stdout[-6000:]}\n"
        f"--- stderr\n{proc.stderr[-10000:]}"
    )


def _port_taken_before_start(proc: subprocess.CompletedProcess[str]) -> bool:
    """torchrun itself could not listen on its rendezvous port (another process bound it between
    ``free_port`` choosing it and torchrun's start): no rank ran, so the job may simply start again."""
    return proc.returncode != 0 and "next_rendezvous" in proc.stderr and "EADDRINUSE" in proc.stderr


def torchrun(
    nproc: int, script: str | Path, *args: str, check: bool = True, **kw: object
) -> subprocess.CompletedProcess[str]:
    """``torchrun`` of ``script`` on ``nproc`` ranks, started again on another port (up to twice)
    when the port chosen was taken before any rank ran (seen once in a clean-clone run)."""
    for _ in range(3):
        proc = run(torchrun_argv(nproc, script, args), check=False, **kw)  # type: ignore[arg-type]
        if not _port_taken_before_start(proc):
            break
    if check and proc.returncode != 0:
        raise _failed(proc)
    return proc


def start(argv: Sequence[str], log_path: Path, *, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    """Start in the background (its own session, output to ``log_path``)."""
    out = open(log_path, "wb")  # noqa: SIM115 - handed to the child, closed with it
    try:
        return subprocess.Popen(
            list(argv),
            cwd=REPO,
            env=env or job_env(),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    finally:
        out.close()


def wait_for(
    predicate: Callable[[], bool],
    what: str,
    *,
    timeout: float = MARKER_TIMEOUT_S,
    alive: subprocess.Popen[bytes] | None = None,
    log_path: Path | None = None,
) -> None:
    """Poll until ``predicate()``; fail early (with the log) if ``alive`` exits first."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if alive is not None and alive.poll() is not None:
            raise AssertionError(f"the job exited ({alive.returncode}) before {what}:\n{_tail(log_path)}")
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up waiting for {what}:\n{_tail(log_path)}")
        time.sleep(0.05)


def kill9(pids: Sequence[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def reap(proc: subprocess.Popen[bytes], timeout: float = 60.0) -> int:
    """Wait for ``proc``; if it outlives ``timeout``, stop it."""
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        return stop(proc)


def stop(proc: subprocess.Popen[bytes], grace: float = 30.0) -> int:
    """Stop a torchrun we started: SIGTERM first (torchrun takes its workers down with it), then
    SIGKILL to its session. Workers that torchrun could not reach are killed by pid (``kill9``)."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
    return proc.wait()


def read_pids(folder: Path, pattern: str = "pid.rank*") -> list[int]:
    """The pids the ranks wrote (``pid.rank<r>`` files holding a pid)."""
    return [int(p.read_text()) for p in sorted(folder.glob(pattern)) if p.read_text().strip()]


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A killed child of torchrun is a zombie until reaped; count it as gone.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def flip_byte(path: Path, offset: int | None = None) -> None:
    """Flip one bit of one byte in place (the middle byte unless ``offset`` is given)."""
    data = bytearray(path.read_bytes())
    i = len(data) // 2 if offset is None else offset
    data[i] ^= 0x01
    path.write_bytes(bytes(data))


def _text(b: bytes | str | None) -> str:
    if b is None:
        return ""
    return b if isinstance(b, str) else b.decode(errors="replace")


def _tail(path: Path | None, n: int = 8000) -> str:
    if path is None or not path.exists():
        return ""
    return path.read_text(errors="replace")[-n:]


class Requests:
    """Numbered requests to a process that serves them one after another (a module's shared job):
    ``FOLDER/request-<n>.json`` for n = 0, 1, ..., each written whole (a rename), read by the
    process with ``next_request``. What the process answers, and where, is each protocol's own."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.sent = 0

    def send(self, options: dict[str, Any]) -> int:
        """Write the next request; its number."""
        n, self.sent = self.sent, self.sent + 1
        tmp = self.folder / f".request-{n}.json"
        tmp.write_text(json.dumps(options))
        os.replace(tmp, self.folder / f"request-{n}.json")
        return n


def next_request(folder: Path, n: int) -> dict[str, Any]:
    """(In the serving process) wait for request ``n`` of ``Requests(folder)``; its options."""
    request = folder / f"request-{n}.json"
    while not request.exists():
        time.sleep(0.02)
    options: dict[str, Any] = json.loads(request.read_text())
    return options
