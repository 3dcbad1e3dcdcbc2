"""A local run's folder, ``./spotjob-runs/<name>/``: what it holds, and the one process driving it.

``spotjob run`` creates and drives it (``LocalRun``: ``orchestrator.run_driver``,
``orchestrator.run_setup``); ``spotjob status`` reads it (``orchestrator.cli_status``), telling a
live driver from a dead one by the driver lock.
"""

from __future__ import annotations

import errno
import fcntl
import json
import math
import os
import shlex
import time
from collections.abc import Iterable

from agent.atomic_file import write_atomic
from agent.control_channel import (
    EXIT_FLUSH_FAILED,
    EXIT_INFRA_ERROR,
    EXIT_PREEMPTED,
    EXIT_STOPPED,
    MAX_FILE_BYTES,
    STATUS_FILE,
    read_json,
)
from agent.exit_codes import COMMAND_ENDED_DURING_FLUSH
from orchestrator.backends.local_cloud import CLOUDS
from orchestrator.backends.local_failure import agent_exit_line
from orchestrator.model import MAX_FLUSH_SECONDS, JobStatus, Phase, WorkerStatus

RUNS_DIR = "spotjob-runs"
RUN_FILE = "run.json"
SUMMARY_FILE = "summary.json"
TIMELINE_FILE = "timeline.jsonl"
CLOUD_FILE = "cloud.json"
"""``{"cloud": "gcp"}``: the cloud a run simulates (``spotjob run --cloud``); a run folder without
it (made before the option) simulates AWS."""

LOG_EXCERPT_LINES = 12
"""How much of a failed worker's log ``spotjob run`` and ``spotjob status NAME`` show."""

AGENT_EXITS = frozenset({0, EXIT_PREEMPTED, EXIT_FLUSH_FAILED, EXIT_INFRA_ERROR, EXIT_STOPPED, None})
"""A worker's exit that is not its script's failure: success, the agent's own codes, or none yet."""


def failed_worker_logs(run_folder: str, workers: Iterable[WorkerStatus]) -> list[str]:
    """The logs (in ``run_folder``'s ``logs/``) of the workers whose script failed: an exit that is
    not one of the agent's own (``AGENT_EXITS``), or a 76 whose agent says in the log that the
    command ended by itself, failing, during a flush (``COMMAND_ENDED_DURING_FLUSH``: the script
    raised while its ranks were asked to flush, so the log's end is what tells why)."""
    out = []
    for w in workers:
        path = os.path.join(run_folder, "logs", f"{w.name}.log")
        if not os.path.isfile(path):
            continue
        if w.exit_code not in AGENT_EXITS or (
            w.exit_code == EXIT_FLUSH_FAILED
            and COMMAND_ENDED_DURING_FLUSH in (agent_exit_line(path, EXIT_FLUSH_FAILED) or "")
        ):
            out.append(path)
    return out


def runs_dir_option(runs_dir: str) -> str:
    """`` --runs-dir DIR`` for the commands a run's messages suggest, or nothing for the default
    ``./spotjob-runs``: without it, ``spotjob status NAME`` or ``spotjob run --resume NAME`` would
    look in the default folder and say there is no such run."""
    if os.path.abspath(runs_dir) == os.path.abspath(RUNS_DIR):
        return ""
    return f" --runs-dir {shlex.quote(runs_dir)}"


def empty_runs_dir_problem(runs_dir: str) -> str | None:
    """Why an empty ``--runs-dir`` is refused (``os.path.abspath("")`` is the working directory: a
    run there would be made, resumed or listed without anyone asking), or None."""
    if runs_dir.strip():
        return None
    return f"--runs-dir is empty: name a folder, or leave the option out for ./{RUNS_DIR}"


RESTART_BUDGET_EXHAUSTED = "RestartBudgetExhausted"
"""The reconciler's reason for a job whose script used up its restarts (its
``RESTART_BUDGET_EXHAUSTED.name``; tests/unit/test_cli_run_options.py holds them equal), spelled
here so that ``spotjob status`` need not import the reconciler."""


def used_up_restarts(status: JobStatus) -> bool:
    """The run failed because its script used up its restarts: its checkpoints are handed over to
    a new run to carry on (``hand_over_commands``), a failed run is not resumed."""
    return status.phase is Phase.FAILED and status.reason == RESTART_BUDGET_EXHAUSTED


def hand_over_commands(uri: str, runs_dir: str = RUNS_DIR) -> str:
    """The two commands that give the checkpoints in ``uri`` to a new run and start it, quoted for
    a shell (a run that ended is not resumed; a new run is refused a URI another job owns until it
    is handed over)."""
    arg = shlex.quote(uri)
    return (
        f"`spotjob ckpt adopt {arg} --job local/NEW`, then "
        f"`spotjob run{runs_dir_option(runs_dir)} --name NEW --checkpoint-uri {arg} SCRIPT ...`"
    )


def older_layout_problem(path: str, name: str) -> str | None:
    """Why the run folder ``path`` of run ``name`` is not this spotjob's, or None.

    Before 2026-12-01 jobs had no namespace and the job file was ``<run>/<name>.json``; this
    spotjob keeps it under ``<run>/local/`` and does not read the older layout. Its checkpoints
    are read as they are (README "Upgrading")."""
    if not os.path.isfile(os.path.join(path, f"{name}.json")):
        return None
    return (
        f"run {name!r} in {path} was written by a spotjob from before 2026-12-01, "
        "whose run folders this one does not read"
    )


LEFT_BY_A_RUN = (RUN_FILE, TIMELINE_FILE, SUMMARY_FILE, "checkpoints", "nodes", "logs")
"""What a run that was driven leaves in its folder beside its job file (``checkpoints/``: the default
checkpoint URI). Not ``cloud.json``, which a new run writes as it is made and removes with the rest
when it cannot be made whole."""


def job_file_gone_problem(path: str, name: str) -> str | None:
    """Why the run folder ``path`` of run ``name`` holds no run that can go on, when it holds what
    a run left (``LEFT_BY_A_RUN``) but not its job file ``local/<name>.json`` (removed by hand, or
    while the run went on: ``RunJobGone``); None otherwise."""
    if os.path.lexists(os.path.join(path, "local", f"{name}.json")):
        return None
    left = [os.path.join(path, m) for m in LEFT_BY_A_RUN]
    found = [f"{os.path.basename(p)}{'/' if os.path.isdir(p) else ''}" for p in left if os.path.lexists(p)]
    if not found:
        return None
    return (
        f"its job file local/{name}.json is gone, so the run can neither go on nor be resumed (its folder holds "
        f"what it left: {', '.join(found)})"
    )


def job_file_gone_advice(path: str, runs_dir: str) -> str:
    """How to go on from the checkpoints of a run whose job file is gone (``job_file_gone_problem``)."""
    uri = os.path.join(path, "checkpoints")
    if not os.path.isdir(uri):
        return "its checkpoints, if any, stay where its --checkpoint-uri named"
    return (
        f"to go on from its checkpoints in {uri}, hand them to a new run and start that with the same script "
        f"and options: {hand_over_commands(uri, runs_dir)}"
    )


class NoFileLocksError(OSError):
    """The run folder's filesystem refuses ``flock`` (NFS mounted without lockd, some FUSE mounts):
    the driver lock, which alone tells a live driver from a dead one, cannot be taken there."""

    def __init__(self, path: str, cause: OSError) -> None:
        why = cause.strerror or errno.errorcode.get(cause.errno or 0, str(cause))
        super().__init__(
            f"the run folder {os.path.dirname(path)} is on a filesystem without file locks (flock on "
            f"{os.path.basename(path)}: {why}; an NFS mount without lockd, or a FUSE mount?). spotjob run "
            "locks its run folder so that only one process drives a run: put the runs on a local disk "
            "(--runs-dir), or mount the filesystem with locking"
        )


class DriverLock:
    """``<run>/driver.lock``: an exclusive ``flock`` held by the process that drives the run.

    The kernel drops it when that process dies, however it dies (SIGKILL included), so a lock held
    means a live driver, with no pid to misread. The file holds the holder's pid for messages.
    """

    FILE = "driver.lock"

    def __init__(self, folder: str) -> None:
        self.path = os.path.join(folder, self.FILE)
        self._fd: int | None = None

    def acquire(self, *, tries: int = 5) -> bool:
        """Take the lock (a few tries: ``spotjob status`` may hold a shared one for an instant)."""
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        for attempt in range(tries):
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                if attempt + 1 < tries:
                    time.sleep(0.1)
                continue
            except OSError as e:
                os.close(fd)
                raise NoFileLocksError(self.path, e) from e
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
            self._fd = fd
            return True
        os.close(fd)
        return False

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing releases the lock
            self._fd = None

    @classmethod
    def holder(cls, folder: str) -> int | None:
        """The pid of the process driving the run in ``folder`` (0 if it did not say), or None."""
        path = os.path.join(folder, cls.FILE)
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            return None
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                text = os.pread(fd, 32, 0).decode(errors="replace").strip()
                return int(text) if text.isdigit() else 0
            except OSError:  # no locks there (NoFileLocksError): no spotjob run can drive it
                return None
            return None
        finally:
            os.close(fd)  # and with it the shared lock, if taken


def _read_run_json(path: str) -> dict[str, object] | None:
    """``run.json`` of the run folder ``path``, read within bounds (``read_json``: never more than
    a control file, never a FIFO's wait), or None when there is none or it is not one spotjob wrote."""
    try:
        return read_json(os.path.join(path, RUN_FILE))
    except OSError:
        return None


def run_file_pid(path: str) -> int | None:
    """The pid ``run.json`` names (run folders from before the driver lock), or None."""
    pid = (_read_run_json(path) or {}).get("pid")
    return pid if isinstance(pid, int) and not isinstance(pid, bool) else None


def write_run_file(path: str, workdir: str, argv: list[str], *, parent_grace: float) -> None:
    """Record in ``run.json`` the process that drives the run in folder ``path``, the working
    directory its workers run in (``run_file_workdir``) and the ``--parent-grace`` its agents get
    (``run_file_parent_grace``). In one rename: a driver killed, or a disk full, in the middle of
    the write leaves the previous driver's record (the folder the run's workers ran in, which every
    ``--resume`` keeps), not an empty or cut one."""
    record = {
        "pid": os.getpid(),
        "argv": argv,
        "started_at": time.time(),
        "workdir": workdir,
        "parent_grace": parent_grace,
    }
    write_atomic(os.path.join(path, RUN_FILE), json.dumps(record).encode())


def run_file_parent_grace(path: str) -> float | None:
    """The ``--parent-grace`` the agents of the driver that ``run.json`` of the run folder ``path``
    names were started with: how long they flush once that driver is gone. None for a folder whose
    driver did not record it (its agents had the agent's default, 30 s) or a value no agent takes
    (not a positive number of seconds up to a day)."""
    grace = (_read_run_json(path) or {}).get("parent_grace")
    if not isinstance(grace, int | float) or isinstance(grace, bool):
        return None
    return float(grace) if math.isfinite(grace) and 0 < grace <= MAX_FLUSH_SECONDS else None


def run_file_workdir(path: str) -> str | None:
    """The working directory the workers of the run in folder ``path`` ran in (``run.json``), or None
    (a folder from before it was recorded, or one whose driver never started the run)."""
    workdir = (_read_run_json(path) or {}).get("workdir")
    return workdir if isinstance(workdir, str) and os.path.isabs(workdir) else None


def reported_step(path: str, status: JobStatus) -> int | None:
    """The highest step the current attempt's ranks last wrote in their control folders under the
    run folder ``path`` (newer than the status's own step when its driver died between refreshes)."""
    steps = []
    for w in status.workers:
        if w.node is None:
            continue
        data = read_json(os.path.join(path, "nodes", w.node, w.name, STATUS_FILE))
        step = data.get("step") if data else None
        if isinstance(step, int) and not isinstance(step, bool):
            steps.append(step)
    return max(steps, default=None)


def write_cloud(path: str, cloud: str) -> None:
    """Record the cloud the run in folder ``path`` simulates (``read_cloud``), in one rename."""
    write_atomic(os.path.join(path, CLOUD_FILE), json.dumps({"cloud": cloud}).encode())


def read_cloud(path: str) -> str:
    """The cloud the run in folder ``path`` simulates: what ``write_cloud`` recorded, ``aws`` for a
    folder without the record (made before ``--cloud``). ``ValueError`` naming the file and what to
    write in it when it cannot be read (within bounds: ``read_json``) or names no cloud spotjob
    simulates."""
    file = os.path.join(path, CLOUD_FILE)
    remedy = (
        'it records the run\'s --cloud: write {"cloud": "aws"} in it (or "gcp" or "azure", the --cloud the '
        "run was started with)"
    )
    if not os.path.lexists(file):
        return "aws"
    try:
        data = read_json(file)
    except OSError as e:
        raise ValueError(f"{file} cannot be read ({e.strerror or e}); {remedy}") from None
    if data is None:
        raise ValueError(f"{file} is not a JSON object of at most {MAX_FILE_BYTES} bytes; {remedy}")
    cloud = data.get("cloud")
    if cloud not in CLOUDS:
        raise ValueError(f"{file} names the cloud {cloud!r}, not one of {', '.join(CLOUDS)}; {remedy}")
    return str(cloud)
