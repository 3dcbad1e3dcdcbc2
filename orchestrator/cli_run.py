"""``spotjob run`` and ``spotjob status``: a job on this machine, driven by the real reconciler.

``spotjob run [OPTIONS] SCRIPT [ARGS...]`` runs ``spotjob-agent -- torchrun --nproc-per-node N
SCRIPT ARGS`` on a simulated spot node (``orchestrator.backends.local``), injects the preemptions
it is asked for, and lets ``Reconciler`` + ``Controller`` (the same state machine the Kubernetes
controller runs, on the real clock) flush, restart and resume it until it succeeds or fails.
``spotjob run --resume NAME`` drives an existing run again (its driver was killed, say).

In order, on the main thread: check every argument (a bad one exits 2 before anything exists:
the URI, the name, the trace, where the plot goes); create ``./spotjob-runs/<name>/`` and take
its driver lock (``DriverLock``: one process drives a run at a time, and the lock dies with it);
store the job as ``local/<name>`` (create-only: of two runs of one name started at once, one
wins and the other is refused), or, when resuming, take the stored job over (waiting for what
the dead driver's workers still flush); run the controller loop. Between two passes the loop
waits in ``LocalRun._wait``, which wakes early when the backend reports a change (a notice, an
exit, a commit) and refreshes the view meanwhile. At the end: stop everything, print the summary
(and write ``summary.json``), draw ``--plot``.

When the driver dies without stopping its workers (SIGKILL), each agent notices that its parent is
gone (``spotjob-agent --exit-with-parent``), flushes a checkpoint and stops; ``--resume`` then
carries on from it with the same job identity, so the URI's ownership and the attempts' fencing
accept it.

Exit status: 0 the job Succeeded; 1 it Failed (the reason is printed, with the end of the failed
worker's log); 2 bad arguments, a run that exists (or is driven by another process), nothing to
resume; 130 interrupted (Ctrl-C or SIGTERM: every process of the run is stopped first).

``spotjob status`` lists the runs under ``./spotjob-runs``; ``spotjob status NAME`` shows one. A
run whose driver is gone is shown as storage and the processes say it is now, not as its status
last said.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import logging
import math
import os
import re
import signal
import sys
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from types import FrameType
from typing import Any

from pydantic import ValidationError
from rich.console import Console

from agent.catalog import latest_valid, list_checkpoints
from agent.control_channel import STATUS_FILE, read_json
from agent.storage import StorageError, open_storage, parse_uri
from agent.torchrun import LAUNCHERS, Launcher
from orchestrator.backends.local import (
    ENV_RUN,
    EventKind,
    LocalBackend,
    LocalOptions,
    PreemptionPlan,
    Timeline,
    TimelineEvent,
    kill_marked,
    load_trace,
    log_excerpt,
    run_pids,
)
from orchestrator.controller_loop import Controller
from orchestrator.events import EventType, JsonlEventSink, RecordedEvent, events_path, read_events
from orchestrator.live import (
    LiveView,
    LogView,
    NoticeView,
    RunRecord,
    RunView,
    Snapshot,
    Summary,
    plot_timeline,
    render_run_detail,
    render_run_list,
    summarize,
    timeline_commits,
)
from orchestrator.model import (
    MAX_NAME_LENGTH,
    BackoffSpec,
    CheckpointInfo,
    CheckpointSpec,
    JobKey,
    JobSpec,
    JobStatus,
    Phase,
    job_name_problem,
)
from orchestrator.reconciler import Reconciler, ReconcilerOptions, SystemClock
from orchestrator.store import JobExistsError, JsonFileJobStore, StoreError

log = logging.getLogger(__name__)

RUNS_DIR = "spotjob-runs"
RUN_FILE = "run.json"
SUMMARY_FILE = "summary.json"
TIMELINE_FILE = "timeline.jsonl"

EXIT_SUCCEEDED = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130

VIEW_TICK = 0.25
RATE_WINDOW_SECONDS = 15.0
STATUS_REFRESH_SECONDS = 5.0
"""How stale the stored goodput and step hints of a local run may get between decisions."""
LEFTOVER_WAIT_SECONDS = 45.0
"""How long ``--resume`` waits for a killed driver's workers to finish their flush and stop (their
agents' ``--parent-grace`` is 30 s) before it stops what is left."""
LOG_EXCERPT_LINES = 12
"""How much of a failed worker's log ``spotjob run`` and ``spotjob status NAME`` show."""

PLOT_FORMATS = frozenset({"png", "pdf", "svg", "svgz", "jpg", "jpeg", "eps", "ps", "tif", "tiff", "webp"})
"""The file types ``--plot`` writes (matplotlib's Agg, PDF, SVG and PS backends)."""


class RunError(Exception):
    """A run cannot be created or resumed as asked: a message for people, exit status 2."""


class RunExistsError(RunError):
    """A run of that name is in the runs folder already."""


class RunDrivenError(RunError):
    """Another process drives that run right now."""


# -- one driver per run ---------------------------------------------------------------------------


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
            return None
        finally:
            os.close(fd)  # and with it the shared lock, if taken


# -- what spotjob run is told ---------------------------------------------------------------------


@dataclass(frozen=True)
class RunConfig:
    """Everything ``spotjob run`` was told; checked up front (``JobSpec`` checks the rest)."""

    script: str
    """The training script, as torchrun takes it (made absolute)."""
    args: list[str]
    """The script's own arguments."""
    name: str
    runs_dir: str = RUNS_DIR
    """Where run folders go (``./spotjob-runs``)."""
    nproc: int = 2
    """Ranks per node (torchrun --nproc-per-node)."""
    checkpoint_uri: str | None = None
    """None: ``<runs_dir>/<name>/checkpoints``."""
    every_steps: int | None = None
    every_seconds: float | None = None
    keep: int = 3
    max_restarts: int = 3
    """Restarts after failures of the user's code (preemptions never consume it)."""
    flush_timeout: float = 120.0
    """How long the reconciler waits for a flush to commit before restarting from what is there."""
    notice: float = 30.0
    """The window of each injected notice, from the notice to the node's termination."""
    restart_backoff: float = 1.0
    """The first restart's delay (doubling, capped at max(this, 60 s)); a local node is there at once."""
    preempt_every: float | None = None
    preempt_jitter: float = 0.25
    preempt_at_steps: list[int] = field(default_factory=list)
    trace: list[float] = field(default_factory=list)
    seed: int | None = None
    ignore_notices: bool = False
    """A baseline: nobody listens for notices; a noticed node just dies when its window ends."""
    launcher: Launcher = "direct"
    """How each agent starts the ranks (spotjob-agent --launcher): direct, or torchrun itself."""
    plot: str | None = None
    env: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        problem = next((p for p in self.problems()), None)
        if problem is not None:
            raise ValueError(problem)

    def problems(self) -> list[str]:
        """What is wrong with the numbers and the name, each naming its option."""
        out = [
            _at_least("--nproc", self.nproc, 1),
            _at_least("--every-steps", self.every_steps, 1),
            _positive("--every-seconds", self.every_seconds),
            _at_least("--keep", self.keep, 1),
            _at_least("--max-restarts", self.max_restarts, 0),
            _positive("--flush-timeout", self.flush_timeout),
            _positive("--notice", self.notice),
            _not_negative("--restart-backoff", self.restart_backoff),
            _positive("--preempt-every", self.preempt_every),
            None
            if math.isfinite(self.preempt_jitter) and 0 <= self.preempt_jitter < 1
            else f"--preempt-jitter must be at least 0 and below 1, got {self.preempt_jitter:g}",
            None if all(s >= 0 for s in self.preempt_at_steps) else "--preempt-at-step takes steps >= 0",
            None if all(math.isfinite(t) and t >= 0 for t in self.trace) else "--trace times must be >= 0 seconds",
            _name_problem(self.name),
        ]
        return [p for p in out if p is not None]

    @property
    def path(self) -> str:
        return os.path.abspath(os.path.join(self.runs_dir, self.name))

    @property
    def key(self) -> JobKey:
        """The job's key: ``local/<name>`` (``orchestrator.model.LOCAL_NAMESPACE``)."""
        return JobKey.local(self.name)

    def job_spec(self) -> JobSpec:
        """The job's spec; ``ValueError`` naming the option when one does not fit it."""
        uri = self.checkpoint_uri or os.path.join(self.path, "checkpoints")
        if "://" not in uri:
            uri = os.path.abspath(uri)
        try:
            return JobSpec(
                command=[self.script, *self.args],
                env=self.env,
                replicas=1,
                nproc_per_node=self.nproc,
                checkpoint=CheckpointSpec(
                    uri=uri, every_steps=self.every_steps, every_seconds=self.every_seconds, keep=self.keep
                ),
                max_restarts=self.max_restarts,
                flush_timeout_seconds=self.flush_timeout,
                notice_seconds=self.notice,
                restart_backoff=BackoffSpec(
                    initial_seconds=self.restart_backoff, max_seconds=max(self.restart_backoff, 60.0)
                ),
            )
        except ValidationError as e:
            raise ValueError(describe_option_error(e)) from None

    def plan(self) -> PreemptionPlan:
        return PreemptionPlan(
            every=self.preempt_every,
            jitter=self.preempt_jitter,
            at_steps=list(self.preempt_at_steps),
            trace=list(self.trace),
            seed=self.seed,
        )


def _at_least(option: str, value: int | None, low: int) -> str | None:
    return None if value is None or value >= low else f"{option} must be at least {low}, got {value}"


def _positive(option: str, value: float | None) -> str | None:
    if value is None or (math.isfinite(value) and value > 0):
        return None
    return f"{option} must be a positive number of seconds, got {value:g}"


def _not_negative(option: str, value: float) -> str | None:
    if math.isfinite(value) and value >= 0:
        return None
    return f"{option} must be a number of seconds >= 0, got {value:g}"


def _name_problem(name: str) -> str | None:
    if job_name_problem(name) is None:
        return None
    return (
        f"--name {name!r}: a run's name is a DNS label: lowercase letters, digits and '-', starting and ending "
        f"with a letter or digit, at most {MAX_NAME_LENGTH} characters"
    )


_OPTION_OF_FIELD = {
    ("nprocPerNode",): "--nproc",
    ("checkpoint", "uri"): "--checkpoint-uri",
    ("checkpoint", "everySteps"): "--every-steps",
    ("checkpoint", "everySeconds"): "--every-seconds",
    ("checkpoint", "keep"): "--keep",
    ("maxRestarts",): "--max-restarts",
    ("flushTimeoutSeconds",): "--flush-timeout",
    ("noticeSeconds",): "--notice",
    ("restartBackoff", "initialSeconds"): "--restart-backoff",
    ("restartBackoff", "maxSeconds"): "--restart-backoff",
    ("restartBackoff",): "--restart-backoff",
    ("command",): "SCRIPT",
    ("env",): "the environment",
}


def describe_option_error(error: ValidationError) -> str:
    """pydantic's complaint about the spec, said of the option it came from, in plain words."""
    parts = []
    for item in error.errors():
        loc = tuple(str(x) for x in item["loc"])
        option = next(
            (o for fields, o in _OPTION_OF_FIELD.items() if loc[: len(fields)] == fields), ".".join(loc) or "the spec"
        )
        message = str(item["msg"]).removeprefix("Value error, ")
        message = message.replace("Input should be", "must be").replace("Input", "the value")
        parts.append(f"{option} {message}" if message.startswith("must") else f"{option}: {message}")
    return "; ".join(parts)


def checkpoint_uri_problem(uri: str) -> str | None:
    """Why ``--checkpoint-uri`` cannot work, said before anything is created; None if it may.

    Object stores are not contacted here (the reconciler fails the job at once with
    ``StorageRefused`` when the bucket does not exist or access is denied); a path is checked
    on this machine: it must be a folder, or creatable where a folder can be created.
    """
    try:
        scheme, _, path = parse_uri(uri)
    except ValueError as e:
        return f"--checkpoint-uri: {e}"
    if scheme != "file":
        return None
    folder = os.path.abspath(path)
    if os.path.exists(folder) and not os.path.isdir(folder):
        return (
            f"--checkpoint-uri {uri}: {folder} is a regular file, not a folder; a checkpoint URI names a folder "
            "(a new or an existing one)"
        )
    problem = _folder_problem(folder)
    return f"--checkpoint-uri {uri}: {problem}" if problem else None


def plot_problem(path: str) -> str | None:
    """Why ``--plot`` could not be written at the end of the run; None if it can."""
    target = os.path.abspath(path)
    if os.path.isdir(target):
        return f"--plot {path}: that is a folder; name the image file (e.g. {os.path.join(path, 'run.png')})"
    kind = os.path.splitext(target)[1].lower().lstrip(".")
    if kind not in PLOT_FORMATS:
        what = f"'.{kind}' file" if kind else "file without an extension"
        return f"--plot {path}: cannot draw a {what}; use .png, .svg or .pdf"
    try:
        import matplotlib  # noqa: F401  (lazily: the controller's image carries no matplotlib)
    except ImportError:
        return "--plot needs matplotlib: pip install 'spotjob[plot]'"
    if os.path.exists(target) and not os.access(target, os.W_OK):
        return f"--plot {path}: permission denied (the file exists and this user may not write it)"
    problem = _folder_problem(os.path.dirname(target))
    return f"--plot {path}: {problem}" if problem else None


def _folder_problem(folder: str) -> str | None:
    """Why ``folder`` could not be created or written by this process; None if it can. Creates
    nothing that stays: the nearest existing ancestor is probed with a file made and removed."""
    existing = folder
    while not os.path.exists(existing):
        parent = os.path.dirname(existing)
        if parent == existing:
            break
        existing = parent
    if not os.path.isdir(existing):
        if existing == folder:
            return f"{folder} is a file, not a folder"
        return f"{existing} is a file, so no folder can be made under it"
    probe = os.path.join(existing, f".spotjob-probe-{uuid.uuid4().hex[:8]}")
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    except OSError as e:
        why = "permission denied" if isinstance(e, PermissionError) else (e.strerror or str(e)).lower()
        return f"cannot write in {existing}: {why}"
    with contextlib.suppress(OSError):
        os.unlink(probe)
    return None


# -- one run ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Takeover:
    """What ``--resume`` found of the previous driver."""

    previous_pid: int | None
    leftovers: int
    """Processes of the run still alive when the resume began."""
    stopped: int
    """Of those, how many had to be stopped (the rest finished their flush on their own)."""
    gap_seconds: float | None
    """How long nobody drove the run (counted as restart time), when the run had trained."""
    late_commits: int = 0
    """Checkpoints its workers committed while nobody watched (their flush when the driver died)."""


class LocalRun:
    """One ``spotjob run``: its folder, store, backend and controller loop. Usable in-process (tests).

    ``LocalRun(config)`` creates a new run (``RunExistsError`` if the name is taken);
    ``LocalRun.resume(runs_dir, name)`` takes an existing one over. Either holds the run's driver
    lock until ``close()`` (``run()`` closes).
    """

    def __init__(self, config: RunConfig, *, resume: bool = False) -> None:
        self.config = config
        self.key = config.key
        self.name = config.name
        self.path = config.path
        self.plan = config.plan()
        self.resumed = resume
        self.takeover: Takeover | None = None
        if not resume:
            spec = config.job_spec()  # before anything exists: a bad option creates nothing
        self.store = JsonFileJobStore(self.path, create=False)
        if not resume:
            self._refuse_existing()
            os.makedirs(self.path, exist_ok=True)
        self.lock = DriverLock(self.path)
        if not self.lock.acquire():
            pid = DriverLock.holder(self.path)
            by = f"pid {pid}" if pid else "another process"
            raise RunDrivenError(
                f"run {self.name!r} is being driven by another spotjob run ({by}); watch it with "
                f"`spotjob status {self.name}`, or stop that process first"
            )
        try:
            if resume:
                self.spec, status, version = self._read_for_resume()
            else:
                try:
                    self.store.create(self.key, spec)
                except JobExistsError:
                    raise RunExistsError(self._exists_message()) from None
                self.spec, status, version = spec, JobStatus(), ""
            self.events_path = events_path(self.path, self.key)
            self.timeline = Timeline(os.path.join(self.path, TIMELINE_FILE))
            self.sink = JsonlEventSink(self.path)
            if resume:
                self.takeover = self._take_over(status, version)
            self.backend = LocalBackend(
                LocalOptions(
                    root=self.path,
                    notice_seconds=config.notice,
                    hear_notices=not config.ignore_notices,
                    launcher=config.launcher,
                ),
                plan=self.plan,
                timeline=self.timeline,
            )
        except BaseException:
            self.lock.release()
            raise
        # A local status write is a small file: the live view and `spotjob status` get goodput and
        # the step seen every few seconds, not every minute as a Kubernetes status would.
        self.reconciler = Reconciler(
            self.store,
            self.backend,
            SystemClock(),
            events=self.sink,
            options=ReconcilerOptions(status_refresh_seconds=STATUS_REFRESH_SECONDS),
        )
        self.status = status or JobStatus()
        self.events: list[RecordedEvent] = []
        self._view: RunView | None = None
        self._started = time.monotonic()
        self._ended: float | None = None
        self._rate: deque[tuple[float, int]] = deque()
        self._rate_attempt = -1
        self._commit_count = 0
        self._commits_read_at = 0.0

    @classmethod
    def resume(cls, runs_dir: str, name: str, **plan: Any) -> LocalRun:
        """Take over the run ``name`` under ``runs_dir`` with its stored spec (``plan``: the
        injected preemptions of this driver, ``RunConfig``'s fields of that group)."""
        problem = _name_problem(name)
        if problem is not None:
            raise RunError(problem.replace("--name", "--resume", 1))
        path = os.path.abspath(os.path.join(runs_dir, name))
        store = JsonFileJobStore(path, create=False)
        key = JobKey.local(name)
        if not os.path.exists(store.path(key)):
            raise RunError(f"no run named {name!r} under {os.path.abspath(runs_dir)} to resume")
        try:
            stored = store.get(key)
        except StoreError as e:
            raise RunError(f"run {name!r} cannot be resumed: {e}") from None
        if stored is None or stored.spec is None:
            why = stored.invalid if stored is not None else "it is gone"
            raise RunError(f"run {name!r} cannot be resumed: its stored spec does not validate ({why})")
        spec = stored.spec
        config = RunConfig(
            script=spec.command[0],
            args=list(spec.command[1:]),
            name=name,
            runs_dir=runs_dir,
            nproc=spec.nproc_per_node,
            checkpoint_uri=spec.checkpoint.uri,
            every_steps=spec.checkpoint.every_steps,
            every_seconds=spec.checkpoint.every_seconds,
            keep=spec.checkpoint.keep,
            max_restarts=spec.max_restarts,
            flush_timeout=spec.flush_timeout_seconds,
            notice=spec.notice_seconds or 30.0,
            restart_backoff=spec.restart_backoff.initial_seconds,
            env=dict(spec.env),
            **plan,
        )
        return cls(config, resume=True)

    def close(self) -> None:
        """Give up the driver lock (idempotent)."""
        self.lock.release()

    # -- creating and taking over -------------------------------------------------------------------
    def _exists_message(self) -> str:
        return (
            f"a run named {self.name!r} exists in {self.path}: resume it with `spotjob run --resume {self.name}`, "
            "or pick another --name"
        )

    def _refuse_existing(self) -> None:
        if os.path.exists(self.store.path(self.key)):
            raise RunExistsError(self._exists_message())

    def _read_for_resume(self) -> tuple[JobSpec, JobStatus | None, str]:
        try:
            stored = self.store.get(self.key)
        except StoreError as e:
            raise RunError(f"run {self.name!r} cannot be resumed: {e}") from None
        if stored is None or stored.spec is None:
            raise RunError(f"run {self.name!r} cannot be resumed: its job file is gone or its spec does not validate")
        if stored.status is None and stored.invalid is not None:
            raise RunError(
                f"run {self.name!r} cannot be resumed: its stored status does not validate ({stored.invalid})"
            )
        status = stored.status
        if status is not None and status.phase.terminal:
            raise RunError(
                f"run {self.name!r} {status.phase.value.lower()} already ({status.reason}: {status.message}); "
                "there is nothing to resume. Start a new run (its checkpoints belong to local/"
                f"{self.name}; `spotjob ckpt adopt URI --job local/NEW` hands them over)"
            )
        return stored.spec, status, stored.version

    def _take_over(self, status: JobStatus | None, version: str) -> Takeover:
        """Wait for what the dead driver left running (its agents flush, then stop), stop the rest,
        count the time nobody drove the run, and say so in an Event."""
        previous = _run_file_pid(self.path)
        pids = run_pids(self.path)
        stopped = 0
        if pids:
            log.warning(
                "run %s: %d process(es) of the previous driver still run; waiting up to %.0f s for their flush",
                self.key,
                len(pids),
                LEFTOVER_WAIT_SECONDS,
            )
            give_up = time.monotonic() + LEFTOVER_WAIT_SECONDS
            while run_pids(self.path) and time.monotonic() < give_up:
                time.sleep(0.25)
            stopped = kill_marked(ENV_RUN, self.path, grace=3.0, reason=f"resuming {self.key}")
        # The old driver's last record in the timeline: about when it died.
        last = max((e.t for e in Timeline.read(self.timeline.path)), default=None)
        late = self._commits_seen_late()
        gap = None
        # Nobody drove the run between the old driver's last record and now: not training time.
        # (A recovery in progress counts that time itself when the next attempt runs.)
        if status is not None and status.recovery is None and status.start_time is not None and last is not None:
            gap = max(0.0, time.time() - last)
            status.restarting_seconds += gap
            try:
                self.store.update_status(self.key, status, version=version)
            except StoreError as e:
                raise RunError(f"run {self.name!r} cannot be resumed: {e}") from None
        takeover = Takeover(previous, len(pids), stopped, gap, late)
        message = (
            f"spotjob run --resume (pid {os.getpid()}) drives the run again; the previous driver"
            f"{f' (pid {previous})' if previous else ''} is gone"
            + (f"; {len(pids)} of its processes still ran ({stopped} had to be stopped)" if pids else "")
            + (f"; {late} checkpoint(s) committed after it was gone" if late else "")
            + (f"; nothing drove the run for {gap:.0f} s (counted as restart time)" if gap is not None else "")
        )
        self.sink.emit(self.key, EventType.NORMAL, "Resumed", message)
        return takeover

    def _commits_seen_late(self) -> int:
        """Record in the timeline the commits the dead driver's workers made after it stopped
        watching (their flush, at least): each rank 0 left its count in its control folder."""
        events = Timeline.read(self.timeline.path)
        counted: dict[str, int] = {}
        attempts: dict[str, int] = {}
        for e in events:
            worker = str(e.data.get("worker", ""))
            if e.kind == EventKind.WORKER_STARTED:
                attempts[worker] = int(e.data.get("attempt", 0))
            elif e.kind == EventKind.COMMIT:
                count = e.data.get("count", 1)
                counted[worker] = counted.get(worker, 0) + (count if isinstance(count, int) and count > 0 else 1)
        late = 0
        for worker, attempt in attempts.items():
            folders = [os.path.join(self.path, "nodes", n, worker) for n in _listdir(os.path.join(self.path, "nodes"))]
            for folder in folders:
                data = read_json(os.path.join(folder, STATUS_FILE))
                commits = data.get("commits") if data else None
                step = data.get("last_committed_step") if data else None
                if not isinstance(commits, int) or not isinstance(step, int) or commits <= counted.get(worker, 0):
                    continue
                missed = commits - counted.get(worker, 0)
                self.timeline.record(
                    EventKind.COMMIT, worker=worker, attempt=attempt, step=step, count=missed, unwatched=True
                )
                late += missed
        return late

    # -- running ----------------------------------------------------------------------------------
    def run(self, view: RunView | None = None) -> JobStatus:
        """Run the job to Succeeded or Failed; always stops every process of the run before returning."""
        self._view = view
        try:
            with open(os.path.join(self.path, RUN_FILE), "w") as f:
                json.dump({"pid": os.getpid(), "argv": sys.argv, "started_at": time.time()}, f)
            self.timeline.record(
                EventKind.RUN_STARTED,
                job=str(self.key),
                command=self.spec.command,
                nproc=self.spec.nproc_per_node,
                resumed=self.resumed,
            )
            log.info(
                "run %s%s: %s on %d rank(s); checkpoints at %s; state in %s",
                self.key,
                " (resumed)" if self.resumed else "",
                " ".join(self.spec.command),
                self.spec.nproc_per_node,
                self.spec.checkpoint.uri,
                self.path,
            )
            controller = Controller(self.reconciler, SystemClock(), wait=self._wait)
            self.status = controller.run(self.key)
            self._note_status(self.status)
        finally:
            self._ended = time.monotonic()
            self.backend.close()
            self.events = _events(self.events_path)
            self.timeline.record(EventKind.RUN_FINISHED, phase=str(self.status.phase))
            self._refresh()
            self.close()
        return self.status

    def _wait(self, seconds: float) -> None:
        """Between passes: refresh the view; return early when the backend saw something happen."""
        self._after_pass()
        end = time.monotonic() + seconds
        while True:
            self._refresh()
            left = end - time.monotonic()
            if left <= 0:
                return
            if self.backend.changed.wait(min(left, VIEW_TICK)):
                self.backend.changed.clear()
                return

    def _after_pass(self) -> None:
        try:
            stored = self.store.get(self.key)
        except StoreError as e:
            log.warning("cannot read the job's status: %s", e)
            return
        if stored is not None and stored.status is not None:
            self._note_status(stored.status)
        self.events = _events(self.events_path)

    def _note_status(self, status: JobStatus) -> None:
        if status.phase is not self.status.phase or status.reason != self.status.reason:
            self.timeline.record(EventKind.PHASE, phase=str(status.phase), reason=status.reason)
        self.status = status

    def _refresh(self) -> None:
        if self._view is not None:
            self._view.update(self.snapshot())

    # -- what the views read ----------------------------------------------------------------------
    def snapshot(self) -> Snapshot:
        step = self.backend.observed_step(self.key)
        now = time.monotonic()
        attempt = self.status.attempt.number
        if attempt != self._rate_attempt:
            self._rate.clear()
            self._rate_attempt = attempt
        if step is not None and (not self._rate or self._rate[-1][1] != step):
            self._rate.append((now, step))
        while self._rate and now - self._rate[0][0] > RATE_WINDOW_SECONDS:
            self._rate.popleft()
        rate = None
        if len(self._rate) >= 2 and self._rate[-1][0] > self._rate[0][0]:
            rate = (self._rate[-1][1] - self._rate[0][1]) / (self._rate[-1][0] - self._rate[0][0])
        if step is None:
            step = self.status.attempt.observed_step
        wall = time.time()
        notices = [
            NoticeView(n.name, n.deadline - wall)
            for n in self.backend.nodes()
            if n.deadline is not None and not n.terminated
        ]
        return Snapshot(
            name=self.name,
            elapsed=(self._ended or now) - self._started,
            status=self.status,
            max_restarts=self.spec.max_restarts,
            step=step,
            steps_per_second=rate if rate and rate > 0 else None,
            commits=self._commits(),
            notices_sent=self.backend.notices_sent,
            notices=notices,
            events=self.events,
        )

    def _commits(self) -> int:
        """Commits in the timeline, re-counted at most once a second (the file only grows)."""
        now = time.monotonic()
        if self._ended is not None or now - self._commits_read_at >= 1.0:
            self._commits_read_at = now
            self._commit_count = timeline_commits(Timeline.read(self.timeline.path))
        return self._commit_count

    def summary(self) -> Summary:
        """The run in numbers: the status, the whole timeline (every driver's) and storage."""
        events = Timeline.read(self.timeline.path)
        return summarize(self.name, self.spec, self.status, events, committed=committed_in_storage(self, events))

    def plot(self, path: str) -> None:
        s = self.summary()
        title = (
            f"{s.name}: {s.phase}, {s.steps if s.steps is not None else '-'} steps, {s.preemptions} preemption(s), "
            f"goodput {'-' if s.goodput is None else f'{s.goodput:.0%}'}"
        )
        plot_timeline(Timeline.read(self.timeline.path), path, title=title)

    def failed_worker_logs(self) -> list[str]:
        """The logs of the workers whose failure ended the run (their exit was the script's)."""
        agent_codes = {0, 74, 75, 76, 79, None}
        names = [w.name for w in self.status.workers if w.exit_code not in agent_codes]
        return [p for p in (os.path.join(self.path, "logs", f"{n}.log") for n in names) if os.path.isfile(p)]


def committed_in_storage(run: LocalRun, events: list[TimelineEvent]) -> tuple[int, int | None] | None:
    """(checkpoints this job committed during the run that storage still holds, the newest valid
    step), or None when storage cannot be read. Retention deletes old ones, so this is a floor."""
    started = next((e.t for e in events if e.kind == EventKind.RUN_STARTED), None)
    try:
        storage = open_storage(run.spec.checkpoint.uri)
        found = list_checkpoints(storage)
    except (StorageError, ValueError) as e:
        log.warning("cannot count the checkpoints in storage: %s", e)
        return None
    identity = str(run.key)
    since = datetime.fromtimestamp(started, UTC) if started is not None else None
    ours = [
        c
        for c in found
        if c.manifest is not None
        and c.manifest.job == identity
        and (since is None or c.manifest.created_at.astimezone(UTC) >= since)
    ]
    newest = next((c.ref.step for c in found if c.valid), None)
    return len(ours), newest


def _listdir(path: str) -> list[str]:
    try:
        return sorted(os.listdir(path))
    except OSError:
        return []


def _events(path: str) -> list[RecordedEvent]:
    try:
        return read_events(path)
    except (OSError, ValueError) as e:
        log.warning("cannot read the run's events %s: %s", path, e)
        return []


def _run_file_pid(path: str) -> int | None:
    try:
        with open(os.path.join(path, RUN_FILE)) as f:
            pid = json.load(f)["pid"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return pid if isinstance(pid, int) and not isinstance(pid, bool) else None


# -- spotjob run ----------------------------------------------------------------------------------


def default_name(script: str) -> str:
    """``<script stem>-<yyyymmdd-hhmmss>``, made a DNS label."""
    stem = re.sub(r"[^a-z0-9-]+", "-", os.path.splitext(os.path.basename(script))[0].lower()).strip("-") or "job"
    suffix = time.strftime("%Y%m%d-%H%M%S")
    return f"{stem[: MAX_NAME_LENGTH - len(suffix) - 1].rstrip('-')}-{suffix}"


_SPEC_OPTIONS = {
    "name": "--name",
    "nproc": "--nproc",
    "checkpoint_uri": "--checkpoint-uri",
    "every_steps": "--every-steps",
    "every_seconds": "--every-seconds",
    "keep": "--keep",
    "max_restarts": "--max-restarts",
    "flush_timeout": "--flush-timeout",
    "restart_backoff": "--restart-backoff",
    "notice": "--notice",
}
"""Options that shape the job's spec: a resumed run keeps its own."""


def plan_options(args: argparse.Namespace) -> dict[str, Any]:
    """The injected preemptions of this driver, checked (``--trace`` read and parsed)."""
    trace: list[float] = []
    if args.trace is not None:
        try:
            trace = load_trace(args.trace)
        except ValueError as e:
            raise ValueError(f"--trace {e}") from None
    return {
        "preempt_every": args.preempt_every,
        "preempt_jitter": 0.25 if args.preempt_jitter is None else args.preempt_jitter,
        "preempt_at_steps": list(args.preempt_at_step or []),
        "trace": trace,
        "seed": args.seed,
        "ignore_notices": args.ignore_notices,
        "launcher": args.launcher,
        "plot": args.plot,
    }


def config_from_args(args: argparse.Namespace) -> RunConfig:
    """A new run's ``RunConfig``; ``ValueError`` naming the option at the first bad argument."""
    script = args.script
    if script is None:
        raise ValueError("a SCRIPT to run is required (or --resume NAME to carry on with a run)")
    if not os.path.isfile(script):
        raise ValueError(f"no such training script: {script}")
    if args.checkpoint_uri is not None:
        problem = checkpoint_uri_problem(args.checkpoint_uri)
        if problem is not None:
            raise ValueError(problem)
    problem = _folder_problem(os.path.abspath(args.runs_dir))
    if problem is not None:
        raise ValueError(f"--runs-dir {args.runs_dir}: {problem}")
    if args.plot is not None and (problem := plot_problem(args.plot)) is not None:
        raise ValueError(problem)
    given = {k: getattr(args, k) for k in _SPEC_OPTIONS if getattr(args, k) is not None}
    name = given.pop("name", None)
    return RunConfig(
        script=os.path.abspath(script),
        args=list(args.args),
        name=name if name is not None else default_name(script),
        runs_dir=args.runs_dir,
        **given,
        **plan_options(args),
    )


def prepare(args: argparse.Namespace) -> LocalRun:
    """The ``LocalRun`` the arguments ask for, new or resumed; ``ValueError``/``RunError`` say why not."""
    if args.resume is None:
        return LocalRun(config_from_args(args))
    if args.script is not None:
        raise RunError(
            f"--resume {args.resume} takes no SCRIPT ({args.script}): the run carries on with the command it was "
            "started with"
        )
    fixed = [option for attr, option in _SPEC_OPTIONS.items() if getattr(args, attr) is not None]
    if fixed:
        raise RunError(
            f"--resume carries on with the run's own spec: drop {', '.join(fixed)} (start a new run to change them)"
        )
    if args.plot is not None and (problem := plot_problem(args.plot)) is not None:
        raise ValueError(problem)
    return LocalRun.resume(args.runs_dir, args.resume, **plan_options(args))


def _interrupt_on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def run_command(args: argparse.Namespace) -> int:
    try:
        run = prepare(args)
    except (ValueError, RunError) as e:
        print(f"spotjob run: {e}", file=sys.stderr)
        return EXIT_USAGE
    except (OSError, StoreError) as e:
        print(f"spotjob run: cannot create the run: {e}", file=sys.stderr)
        return EXIT_USAGE

    live = sys.stderr.isatty() and not args.no_live
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _interrupt_on_sigterm)
    interrupted = False
    try:
        if live:
            view = LiveView()
            with view.showing():
                status = run.run(view)
        else:
            status = run.run(LogView())
    except KeyboardInterrupt:
        interrupted = True
        status = run.status
    finally:
        run.close()

    summary = run.summary()
    try:
        with open(os.path.join(run.path, SUMMARY_FILE), "w") as f:
            json.dump(summary.to_json(), f, indent=2)
    except OSError as e:
        log.warning("could not write %s: %s", SUMMARY_FILE, e)
    print(summary.text(), flush=True)
    plot = run.config.plot
    if plot:
        try:
            run.plot(plot)
            print(f"  {'plot':<15}  {os.path.abspath(plot)}")
        except Exception as e:  # a missing plot must not turn a finished job into a failure
            log.warning("could not draw the plot %s: %s", plot, e)
    print(f"  {'run folder':<15}  {run.path}  (spotjob status {run.name})")
    if interrupted:
        print(
            f"spotjob run: interrupted; every process of {run.name} was stopped "
            f"(carry on with `spotjob run --resume {run.name}`)",
            file=sys.stderr,
        )
        return EXIT_INTERRUPTED
    if status.phase is Phase.SUCCEEDED:
        return EXIT_SUCCEEDED
    print(f"spotjob run: {run.name} failed: {status.reason}: {status.message}", file=sys.stderr)
    for path in run.failed_worker_logs():
        print(f"the end of {path}:", file=sys.stderr)
        for line in log_excerpt(path, LOG_EXCERPT_LINES):
            print(f"  {line[:300]}", file=sys.stderr)
    return EXIT_FAILED


# -- spotjob status -------------------------------------------------------------------------------


def _driver_pid(path: str) -> int | None:
    """The pid of the live process driving the run in ``path`` (0: alive, pid unknown), or None."""
    if os.path.exists(os.path.join(path, DriverLock.FILE)):
        return DriverLock.holder(path)
    # A run folder from before the driver lock: the pid in run.json, if it is still a spotjob.
    pid = _run_file_pid(path)
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return pid if b"spotjob" in f.read() or pid == os.getpid() else None
    except OSError:
        return None


def _reported_step(path: str, status: JobStatus) -> int | None:
    """The highest step the current attempt's ranks last wrote in their control folders."""
    steps = []
    for w in status.workers:
        if w.node is None:
            continue
        data = read_json(os.path.join(path, "nodes", w.node, w.name, STATUS_FILE))
        step = data.get("step") if data else None
        if isinstance(step, int) and not isinstance(step, bool):
            steps.append(step)
    return max(steps, default=None)


def _storage_now(spec: JobSpec) -> tuple[CheckpointInfo | None, str | None]:
    """The newest valid checkpoint in storage now, or why it cannot be read."""
    try:
        storage = open_storage(spec.checkpoint.uri)
        found = latest_valid(storage)
    except (StorageError, ValueError) as e:
        return None, str(e)
    if found is None or found.manifest is None:
        return None, None
    return CheckpointInfo(step=found.ref.step, uri=storage.url(found.ref.folder), time=found.manifest.created_at), None


def read_run(runs_dir: str, name: str) -> RunRecord | None:
    """The run folder ``<runs_dir>/<name>`` as ``spotjob status`` shows it; None if it holds no run.

    Never raises for what a folder holds: a run that cannot be read comes back with ``error``
    saying why. A run whose driver is gone is read from storage and the processes as they are now.
    """
    path = os.path.abspath(os.path.join(runs_dir, name))
    if job_name_problem(name) is not None:
        return None
    key = JobKey.local(name)
    store = JsonFileJobStore(path, fsync=False, create=False)
    if not os.path.lexists(store.path(key)):
        if os.path.isfile(os.path.join(path, f"{name}.json")):  # the layout before jobs had namespaces
            return RunRecord(name, path, None, None, False, error="a run folder of an older spotjob (not read)")
        return None
    try:
        return _read_run(path, key, store)
    except Exception as e:  # one folder never takes the whole listing down
        log.debug("reading the run folder %s failed", path, exc_info=True)
        return RunRecord(name, path, None, None, False, error=f"cannot read this run folder: {type(e).__name__}: {e}")


def _read_run(path: str, key: JobKey, store: JsonFileJobStore) -> RunRecord:
    notes: list[str] = []
    try:
        events = read_events(events_path(path, key))
    except (OSError, ValueError) as e:
        events = []
        notes.append(f"its events cannot be read: {e}")
    events = [e if e.time.tzinfo else _aware(e) for e in events]
    driver = _driver_pid(path)
    try:
        stored = store.get(key)
    except StoreError as e:
        return RunRecord(key.name, path, None, None, driver is not None, error=str(e), events=events, notes=notes)
    if stored is None:
        return RunRecord(key.name, path, None, None, driver is not None, error="its job file is gone", events=events)
    record = RunRecord(
        key.name,
        path,
        stored.spec,
        stored.status,
        driver is not None,
        error=_plain(stored.invalid) if stored.invalid else None,
        events=events,
        driver_pid=driver or None,
        notes=notes,
    )
    status = stored.status
    if driver is None and status is not None and not status.phase.terminal and stored.spec is not None:
        checkpoint, problem = _storage_now(stored.spec)
        record = record.with_truth(
            processes=len(run_pids(path)),
            checkpoint=checkpoint,
            storage_problem=problem,
            reported_step=_reported_step(path, status),
        )
    return record


def _plain(problems: str) -> str:
    """A stored part that does not validate, said without pydantic's turns of phrase."""
    return problems.replace("Input should be", "must be").replace("Value error, ", "")


def _aware(e: RecordedEvent) -> RecordedEvent:
    """An Event whose time was written without a zone: UTC, as spotjob writes them."""
    return RecordedEvent(
        e.time.replace(tzinfo=UTC),
        e.first_time.replace(tzinfo=UTC) if e.first_time.tzinfo is None else e.first_time,
        e.type,
        e.reason,
        e.message,
        e.node,
        e.count,
    )


def list_runs(runs_dir: str) -> list[RunRecord]:
    try:
        names = sorted(e.name for e in os.scandir(runs_dir) if e.is_dir())
    except FileNotFoundError:
        return []
    return [r for r in (read_run(runs_dir, n) for n in names) if r is not None]


def status_command(args: argparse.Namespace) -> int:
    # Piped or captured: wide lines rather than rich's 80 columns of ellipses.
    console = Console() if sys.stdout.isatty() else Console(width=200)
    if args.name is None:
        if os.path.exists(args.runs_dir) and not os.path.isdir(args.runs_dir):
            print(f"spotjob status: --runs-dir {args.runs_dir} is a file, not a folder", file=sys.stderr)
            return EXIT_USAGE
        try:
            runs = list_runs(args.runs_dir)
        except OSError as e:
            print(f"spotjob status: cannot list {os.path.abspath(args.runs_dir)}: {e}", file=sys.stderr)
            return EXIT_USAGE
        if args.json:
            print(json.dumps([_record_json(r) for r in runs], indent=2))
        elif not runs:
            console.print(f"no runs under {os.path.abspath(args.runs_dir)}")
        else:
            console.print(render_run_list(runs))
        return 0
    record = read_run(args.runs_dir, args.name)
    if record is None:
        print(f"spotjob status: no run named {args.name!r} under {os.path.abspath(args.runs_dir)}", file=sys.stderr)
        return EXIT_USAGE
    if args.json:
        print(json.dumps(_record_json(record), indent=2))
    else:
        console.print(render_run_detail(record, failed_logs=_failed_logs(record)))
    return 0


def _failed_logs(r: RunRecord) -> list[tuple[str, list[str]]]:
    """The end of each log of a worker whose own exit failed the current attempt."""
    if r.status is None:
        return []
    agent_codes = {0, 74, 75, 76, 79, None}
    out = []
    for w in r.status.workers:
        path = os.path.join(r.path, "logs", f"{w.name}.log")
        if w.exit_code not in agent_codes and os.path.isfile(path):
            out.append((path, [line[:300] for line in log_excerpt(path, LOG_EXCERPT_LINES)]))
    return out


def _record_json(r: RunRecord) -> dict[str, object]:
    doc: dict[str, object] = {
        "name": r.name,
        "path": r.path,
        "controllerAlive": r.controller_alive,
        "driverPid": r.driver_pid,
        "spec": r.spec.model_dump(mode="json") if r.spec else None,
        "status": r.status.model_dump(mode="json", exclude_none=True) if r.status else None,
        "events": [
            {
                "time": e.time.isoformat(),
                "firstTime": e.first_time.isoformat(),
                "type": str(e.type),
                "reason": e.reason,
                "message": e.message,
                "count": e.count,
                **({"node": e.node} if e.node else {}),
            }
            for e in r.events
        ],
        "error": r.error,
        "notes": list(r.notes),
    }
    if r.truth is not None:
        t = r.truth
        doc["now"] = {
            "processesAlive": t.processes,
            "reportedStep": t.reported_step,
            "lastCheckpoint": t.checkpoint.model_dump(mode="json") if t.checkpoint else None,
            "storageProblem": t.storage_problem,
        }
    return doc


# -- registration ---------------------------------------------------------------------------------


def _step(value: str) -> int:
    try:
        step = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a step (a whole number >= 0), got {value!r}") from None
    if step < 0:
        raise argparse.ArgumentTypeError(f"must be a step >= 0, got {step}")
    return step


def _number(kind: Callable[[str], Any], what: str) -> Callable[[str], Any]:
    def parse(value: str) -> Any:
        try:
            return kind(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {what}, got {value!r}") from None

    return parse


_INT = _number(int, "a whole number")
_SECONDS = _number(float, "a number of seconds")


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    run = sub.add_parser(
        "run",
        help="run a training script under spotjob on this machine, with injected preemptions",
        usage="spotjob run [OPTIONS] SCRIPT [ARGS...]\n       spotjob run --resume NAME [OPTIONS]",
        description="Run SCRIPT under spotjob-agent -- torchrun --nproc-per-node N on a simulated spot node of "
        "this machine; preemptions injected by the options below travel the real path (an IMDSv2 spot "
        "instance-action the agent hears, a signal the reconciler acts on). Options go before SCRIPT; "
        "everything after it is the script's. --resume NAME drives an existing run again (its spotjob run was "
        "killed, say) with its own spec, status and checkpoints. Exit status: 0 the job succeeded, 1 it failed, "
        "2 bad arguments (nothing is created), a run that exists or is driven elsewhere, 130 interrupted.",
    )
    run.add_argument("script", metavar="SCRIPT", nargs="?", help="the training script (it uses agent.Checkpointer)")
    run.add_argument("args", metavar="ARGS", nargs=argparse.REMAINDER, help="the script's own arguments")
    run.add_argument(
        "--resume", metavar="NAME", help="carry on with run NAME (its spec, status and checkpoints); no SCRIPT"
    )
    job = run.add_argument_group("the job (fixed once the run exists)")
    job.add_argument("--name", help="the run's name, a DNS label (default: <script>-<date>-<time>)")
    job.add_argument("--nproc", type=_INT, help="ranks (torchrun --nproc-per-node; default 2)")
    job.add_argument(
        "--checkpoint-uri",
        help=f"where checkpoints go: a path, s3://, gs:// (default: ./{RUNS_DIR}/<name>/checkpoints)",
    )
    job.add_argument("--every-steps", type=_INT, help="save a checkpoint every N steps")
    job.add_argument("--every-seconds", type=_SECONDS, help="save a checkpoint at least this often")
    job.add_argument("--keep", type=_INT, help="committed checkpoints to keep (default 3)")
    job.add_argument(
        "--max-restarts", type=_INT, help="restarts after crashes of the script (default 3); preemptions never use it"
    )
    job.add_argument("--flush-timeout", type=_SECONDS, help="seconds to wait for a flush to commit (default 120)")
    job.add_argument("--restart-backoff", type=_SECONDS, help="seconds before the first restart (default 1; doubles)")
    job.add_argument("--notice", type=_SECONDS, metavar="SECONDS", help="each notice's window (default 30)")
    inj = run.add_argument_group("injected preemptions")
    inj.add_argument("--preempt-every", type=_SECONDS, metavar="SECONDS", help="a notice about every N seconds")
    inj.add_argument(
        "--preempt-jitter", type=_number(float, "a fraction"), help="the gaps vary by this fraction (default 0.25)"
    )
    inj.add_argument(
        "--preempt-at-step", type=_step, action="append", metavar="N",
        help="a notice once the training reaches step N (repeatable)",
    )  # fmt: skip
    inj.add_argument(
        "--trace", metavar="FILE", help="notice times in seconds since the start: one a line, or a JSON list"
    )
    inj.add_argument("--seed", type=_INT, help="seeds the jitter and which node a notice hits")
    inj.add_argument(
        "--ignore-notices", action="store_true",
        help="a baseline: nobody listens for notices (no flush); a noticed node just dies at the window's end",
    )  # fmt: skip
    run.add_argument(
        "--launcher", choices=LAUNCHERS, default="direct",
        help="direct (default): each agent starts the ranks itself, as torchrun would, without torchrun's own "
        "start (a second or more of every restart); torchrun: run torchrun (spotjob-agent --launcher)",
    )  # fmt: skip
    out = run.add_argument_group("output")
    out.add_argument("--plot", metavar="FILE", help="draw a PNG timeline: steps, notices, commits, restarts")
    out.add_argument("--runs-dir", default=RUNS_DIR, help=f"where run folders go (default ./{RUNS_DIR})")
    out.add_argument("--no-live", action="store_true", help="log lines even on a terminal")
    run.set_defaults(func=run_command)

    status = sub.add_parser(
        "status",
        help="list local runs, or show one",
        description=f"Without NAME: every run under ./{RUNS_DIR}. With NAME: its phase, conditions and events. "
        "A run whose spotjob run process is gone is shown as storage and its processes are now.",
    )
    status.add_argument("name", metavar="NAME", nargs="?", help="a run's name")
    status.add_argument("--runs-dir", default=RUNS_DIR, help=f"default ./{RUNS_DIR}")
    status.add_argument("--json", action="store_true", help="the stored spec and status as JSON")
    status.set_defaults(func=status_command)


__all__ = [
    "DriverLock",
    "LocalRun",
    "RunConfig",
    "RunDrivenError",
    "RunError",
    "RunExistsError",
    "checkpoint_uri_problem",
    "plot_problem",
    "register",
]
