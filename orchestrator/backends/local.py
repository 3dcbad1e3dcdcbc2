"""The local backend: workers are processes on simulated spot nodes of this machine.

A *node* is what a cloud would rent: a name, a zone and an instance type, its own AWS IMDSv2
emulator (``agent.notices.emulators.ImdsEmulator``) and a folder. A *worker* is one
``spotjob-agent --notices aws --aws-metadata-url <the node's emulator> -- torchrun ...`` started
in a session of its own, with ``SPOTJOB_LOCAL_NODE`` and ``SPOTJOB_LOCAL_WORKER`` in its
environment: every process of the worker inherits them (torchrun's ranks too, though they sit in
sessions of their own), which is how a node's processes are all found and killed.

A preemption travels the real path. ``preempt()`` turns on a spot instance-action on the node's
emulator; the agent on the node hears it there and flushes, while ``signals()`` reports the same
notice to the reconciler, which asks every agent to flush (``POST /flush`` with the run's bearer
token, answered at once: ``request_flush`` is synchronous here) and restarts the gang elsewhere.
When the notice's window ends, whatever still runs on the node is SIGKILLed, as a reclaimed
instance would be, and the node is gone for good: a later attempt gets a new one (distinct
names, zones and instance types, so a cool-down is real). Stopping a gang without a flush (after
a failure of the user's code) first tells each agent ``POST /stop`` (it exits 79 without
flushing), then stops what is left as a stop with a flush would.

In parallel with the reconciler's calls, one monitor thread, every ``MONITOR_TICK`` seconds:
terminates nodes whose window ended; reads each live worker's ``status.json`` (the step, the last
commit) into the ``Timeline``; fires the notices the ``PreemptionPlan`` says are due; and sets
``changed`` whenever something happened that the controller should look at before its next
scheduled pass (a worker exited or started training, a notice, a commit, a node gone).

Worker phases: Pending while the agent and torchrun start and the ranks restore; Running from
rank 0's first training step (``status.json`` past "starting"), so that start-up counts as
restart time in goodput, not as training; Succeeded/Failed with the agent's exit code; Failed
without one when its node was terminated under it (the reconciler's "lost"). A command that
never reports a step (no ``Checkpointer``) stays Pending until it exits, which still ends the job.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import random
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime
from types import TracebackType
from typing import Any, Self

from agent.atomic_file import write_atomic
from agent.control_api import ENV_AGENT_TOKEN
from agent.control_channel import (
    AGENT_FILE,
    ENV_ASYNC,
    ENV_ATTEMPT,
    ENV_CHECKPOINT_URI,
    ENV_CONTROL_DIR,
    ENV_EVERY_SECONDS,
    ENV_EVERY_STEPS,
    ENV_JOB_NAME,
    ENV_KEEP,
    ENV_STAGING_DIR,
    ENV_START_FRESH,
    EXIT_FLUSH_FAILED,
    EXIT_INFRA_ERROR,
    EXIT_PREEMPTED,
    EXIT_STOPPED,
    STATUS_FILE,
    read_json,
)
from agent.notices.emulators import ImdsEmulator
from agent.process_tree import ENV_AGENT_ID, marked, signal_process
from orchestrator.backends.base import BackendError, FlushRequestState, Placement, WorkerObservation, worker_name
from orchestrator.model import JobKey, JobSpec, WorkerPhase
from orchestrator.signals import Signal, SignalKind

log = logging.getLogger(__name__)

ENV_NODE = "SPOTJOB_LOCAL_NODE"
"""``<run id>/<node name>`` on every process of a node: what a node's termination kills."""
ENV_WORKER = "SPOTJOB_LOCAL_WORKER"
"""``<run id>/<worker name>`` on every process of a worker: what ``stop_workers`` stops."""
ENV_RUN = "SPOTJOB_LOCAL_RUN"
"""The run folder (absolute) on every process of the run's workers, whichever process drives it:
how ``spotjob status`` counts what still runs and ``spotjob run --resume`` finds what a killed
driver left behind (``run_pids``)."""

# The agent reads these from its own flags; the user's shell must not override them underneath.
_AGENT_OWNED_ENV = (
    ENV_CHECKPOINT_URI,
    ENV_JOB_NAME,
    ENV_EVERY_STEPS,
    ENV_EVERY_SECONDS,
    ENV_KEEP,
    ENV_ASYNC,
    ENV_STAGING_DIR,
    ENV_START_FRESH,
    ENV_ATTEMPT,
    ENV_CONTROL_DIR,
    ENV_AGENT_ID,
    ENV_AGENT_TOKEN,
    "SPOTJOB_AWS_METADATA_URL",
    "SPOTJOB_GCP_METADATA_URL",
    "SPOTJOB_AZURE_METADATA_URL",
    "SPOTJOB_CLOUD",
    ENV_NODE,
    ENV_WORKER,
    ENV_RUN,
)

_AGENT_EXIT_CODES = (0, EXIT_PREEMPTED, EXIT_FLUSH_FAILED, EXIT_INFRA_ERROR, EXIT_STOPPED)
"""Exits that are not a failure of the script (its log has no cause to tell)."""

ZONES = ("local-a", "local-b", "local-c")
INSTANCE_TYPES = ("local.cpu-small", "local.cpu-large")

MONITOR_TICK = 0.25
STEP_SAMPLE_SECONDS = 0.5
"""At most one step sample per worker this often in the timeline (the plot's resolution)."""
FLUSH_REQUEST_TIMEOUT = 5.0
STOP_REQUEST_TIMEOUT = 5.0


# -- the timeline -------------------------------------------------------------------------------


class EventKind:
    """What the timeline records (``Timeline``); plain strings in the JSON lines."""

    RUN_STARTED = "run-started"
    WORKER_STARTED = "worker-started"
    STEP = "step"
    COMMIT = "commit"
    NOTICE = "notice"
    NODE_TERMINATED = "node-terminated"
    WORKER_EXITED = "worker-exited"
    PHASE = "phase"
    RUN_FINISHED = "run-finished"


@dataclass(frozen=True)
class TimelineEvent:
    t: float
    """Unix time."""
    kind: str
    data: dict[str, Any]


class Timeline:
    """An append-only JSON-lines record of what happened in the local world, for the plot and summary.

    One line per event: ``{"t": <unix time>, "kind": "...", ...}``. Written from several threads;
    each line is appended whole under a lock. Readers skip a torn last line.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self._lock = threading.Lock()

    def record(self, kind: str, **data: Any) -> None:
        line = json.dumps({"t": round(time.time(), 3), "kind": kind, **data}, default=str)
        with self._lock, open(self.path, "a") as f:
            f.write(line + "\n")

    @staticmethod
    def read(path: str) -> list[TimelineEvent]:
        events: list[TimelineEvent] = []
        try:
            with open(path) as f:
                lines = f.read().splitlines()
        except FileNotFoundError:
            return events
        for line in lines:
            try:
                raw = json.loads(line)
                events.append(TimelineEvent(float(raw.pop("t")), str(raw.pop("kind")), raw))
            except (ValueError, KeyError, TypeError):
                continue
        return events


# -- when to preempt ----------------------------------------------------------------------------


@dataclass
class PreemptionPlan:
    """When the simulated cloud sends notices: every N seconds (jittered), at steps, at trace times.

    Example: ``every=60, jitter=0.25`` sends one 45-75 s after the start, the next 45-75 s after
    that one was due, and so on (seeded, so a rerun sees the same gaps). ``at_steps=[100, 200]``
    sends one when a live worker first reports step 100 or more, and one at 200. ``trace=[30.0,
    95.5]`` sends them that many seconds after the start. A notice due while no worker runs waits
    for the next one to start (``LocalBackend`` keeps it pending), so every notice lands.
    """

    every: float | None = None
    jitter: float = 0.25
    at_steps: list[int] = field(default_factory=list)
    trace: list[float] = field(default_factory=list)
    seed: int | None = None
    _rng: random.Random = field(init=False, repr=False)
    _next_every: float | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        if self.every is not None and self.every <= 0:
            raise ValueError(f"--preempt-every must be positive, got {self.every}")
        if not 0 <= self.jitter < 1:
            raise ValueError(f"the jitter must be in [0, 1), got {self.jitter}")
        self._rng = random.Random(self.seed)
        self.at_steps = sorted(self.at_steps)
        self.trace = sorted(self.trace)
        if self.every is not None:
            self._next_every = self._gap()

    @property
    def empty(self) -> bool:
        return self.every is None and not self.at_steps and not self.trace

    def _gap(self) -> float:
        assert self.every is not None
        return self.every * self._rng.uniform(1 - self.jitter, 1 + self.jitter)

    def due(self, elapsed: float, step: int | None) -> list[str]:
        """The notices due at ``elapsed`` seconds since the start with ``step`` observed; each once."""
        out: list[str] = []
        while self.trace and self.trace[0] <= elapsed:
            out.append(f"trace time {self.trace.pop(0):g} s")
        while self._next_every is not None and self._next_every <= elapsed:
            out.append(f"every {self.every:g} s (due at {self._next_every:.1f} s)")
            self._next_every += self._gap()
        while step is not None and self.at_steps and self.at_steps[0] <= step:
            out.append(f"step {self.at_steps.pop(0)} reached (at {step})")
        return out

    def random(self) -> random.Random:
        """The plan's seeded generator (which node a notice hits)."""
        return self._rng


def load_trace(path: str) -> list[float]:
    """Notice times in seconds since the start: a JSON list, or one number per line (``#`` comments).

    Every time must be a finite number of seconds >= 0. ``ValueError`` names the file and the line
    of the first one that is not (``trace.txt:3: 'abc' is not a number of seconds``), or says why
    the file cannot be read.
    """
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_TRACE_BYTES + 1)
    except OSError as e:
        raise ValueError(f"{path}: cannot read it: {e.strerror or e}") from None
    if len(raw) > MAX_TRACE_BYTES:
        raise ValueError(f"{path}: larger than {MAX_TRACE_BYTES // 1024} KiB; a trace is a list of notice times")
    try:
        text = raw.decode()
    except UnicodeDecodeError:
        raise ValueError(f"{path}: not a text file (expected seconds, one a line, or a JSON list)") from None
    if text.lstrip().startswith("["):
        return [_trace_time(path, line, value, shown) for line, value, shown in _json_list(path, text)]
    out = []
    for number, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if line:
            out.append(_trace_time(path, number, line))
    return out


MAX_TRACE_BYTES = 1024 * 1024


def _trace_time(path: str, line: int, value: object, shown: str | None = None) -> float:
    shown = shown if shown is not None else str(value)
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise ValueError(f"{path}:{line}: {shown} is not a number of seconds")
    try:
        seconds = float(value)
    except ValueError:
        raise ValueError(f"{path}:{line}: {shown!r} is not a number of seconds") from None
    if value is not shown and isinstance(value, str):
        raise ValueError(f"{path}:{line}: {shown} is not a number of seconds")
    if not math.isfinite(seconds):
        raise ValueError(f"{path}:{line}: {shown} is not a finite number of seconds")
    if seconds < 0:
        raise ValueError(f"{path}:{line}: {shown} is before the start; times are seconds >= 0")
    return seconds


def _json_list(path: str, text: str) -> list[tuple[int, object, str]]:
    """The items of the JSON list ``text``, each with the line it starts on and its text."""
    decoder = json.JSONDecoder(parse_constant=lambda name: name)  # NaN, Infinity: refused by _trace_time

    def line_of(index: int) -> int:
        return text.count("\n", 0, index) + 1

    def fail(index: int, what: str) -> ValueError:
        return ValueError(f"{path}:{line_of(index)}: {what} (a trace is a JSON list of seconds, or one a line)")

    i = text.index("[") + 1
    items: list[tuple[int, object, str]] = []
    while True:
        while i < len(text) and text[i].isspace():
            i += 1
        if i >= len(text):
            raise fail(i, "the list is not closed with ']'")
        if text[i] == "]" and not items:
            i += 1
            break
        try:
            value, end = decoder.raw_decode(text, i)
        except json.JSONDecodeError as e:
            raise fail(e.pos, f"not JSON: {e.msg}") from None
        items.append((line_of(i), value, text[i:end]))
        i = end
        while i < len(text) and text[i].isspace():
            i += 1
        if i >= len(text):
            raise fail(i, "the list is not closed with ']'")
        if text[i] == ",":
            i += 1
        elif text[i] == "]":
            i += 1
            break
        else:
            raise fail(i, "expected ',' or ']' after an item")
    if text[i:].strip():
        raise fail(i + len(text[i:]) - len(text[i:].lstrip()), "text after the list")
    return items


# -- why a worker failed ------------------------------------------------------------------------

LOG_TAIL_BYTES = 256 * 1024
"""How much of the end of a worker's log is read to tell why it failed."""
_RANK_PREFIX = re.compile(r"^\[(?:default)?rank\d+\]:\s?")
_OS_CAUSE = re.compile(
    r"No space left on device|Disk quota exceeded|Read-only file system|Permission denied|"
    r"Cannot allocate memory|Out of memory|no space left|the filesystem is read-only|permission denied",
)
"""What an operator fixes outside the script, wherever a line says it: it outranks the exception
it caused (``No space left on device`` rather than ``unexpected pos 704 vs 598``)."""
_EXCEPTION = re.compile(r"^(?:[A-Za-z_][\w]*\.)*[A-Za-z_]\w*(?:Error|Exception|Exit|Interrupt)\b(?::.*)?$")
_USAGE = re.compile(r"^\S+: error: .+")
_TORCHRUN_FAILURE = "ChildFailedError"
_TORCHRUN_LOG = re.compile(r"^[IWE]\d{4} [\d:.]+ +\d+ torch/distributed/")
"""torchrun's own log lines (glog style): how it noticed, not why."""
MAX_CAUSE_CHARS = 240


def _log_lines(path: str) -> list[str]:
    """The end of a worker's log as lines, without torchrun's ``[rankN]:`` prefixes, the agent's own
    lines, or torchrun's report of the failure (its traceback and the table after it)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - LOG_TAIL_BYTES))
            text = f.read().decode(errors="replace")
    except OSError:
        return []
    lines = [_RANK_PREFIX.sub("", line.rstrip()) for line in text.splitlines()]
    for i in range(len(lines) - 1, -1, -1):
        if _TORCHRUN_FAILURE in lines[i]:
            start = max((j for j in range(i) if lines[j].startswith("Traceback (most recent call last)")), default=i)
            lines = lines[:start]
            break
    return [
        line
        for line in lines
        if line.strip() and "spotjob-agent[" not in line and not line.startswith("#") and not _TORCHRUN_LOG.match(line)
    ]


def _shorten(line: str, match: re.Match[str] | None = None) -> str:
    line = line.strip()
    if len(line) <= MAX_CAUSE_CHARS:
        return line
    if match is None or match.end() <= MAX_CAUSE_CHARS - 20:
        end = match.end() if match is not None else MAX_CAUSE_CHARS - 20
        return line[: max(end, MAX_CAUSE_CHARS - 40)].rstrip() + " …"
    return f"{line[:140].rstrip()} … {line[max(0, match.start() - 40) : match.end() + 10].strip()} …"


def failure_cause(log_path: str) -> str | None:
    """The line of a failed worker's log that says why, or None when none does.

    In order: a cause outside the script (a full disk, a read-only filesystem, permission denied,
    memory), the last exception a rank raised or the last usage error (``train.py: error: ...``),
    whichever came later; torchrun's own report of the failure is not the cause.
    """
    lines = _log_lines(log_path)
    for line in reversed(lines):
        m = _OS_CAUSE.search(line)
        if m is not None:
            return _shorten(line, m)
    for line in reversed(lines):
        if _EXCEPTION.match(line.strip()) or _USAGE.match(line.strip()):
            return _shorten(line)
    return None


def log_excerpt(log_path: str, lines: int = 12) -> list[str]:
    """The last ``lines`` lines of a worker's log that the script wrote (see ``_log_lines``)."""
    return _log_lines(log_path)[-lines:]


def failure_detail(log_path: str) -> str:
    """What a failed worker's reason carries: the telling line of its log, and the log's path."""
    cause = failure_cause(log_path)
    lines = log_excerpt(log_path, 1)
    said = cause or (f"its log ends: {_shorten(lines[-1])}" if lines else "its log says nothing")
    return f"{said} (log: {log_path})"


# -- nodes and workers --------------------------------------------------------------------------


@dataclass
class LocalNode:
    """A simulated spot instance."""

    name: str
    zone: str
    instance_type: str
    path: str
    imds: ImdsEmulator
    marker: str
    worker: str | None = None
    """The worker placed here, until ``stop_workers`` removes it."""
    noticed_at: float | None = None
    deadline: float | None = None
    """Unix time the node goes away (a notice is on); None: no notice."""
    terminated: bool = False

    @property
    def noticed(self) -> bool:
        return self.deadline is not None


@dataclass
class _Worker:
    name: str
    job: JobKey
    attempt: int
    index: int
    node: LocalNode
    proc: subprocess.Popen[bytes]
    control_dir: str
    log_path: str
    marker: str
    lost: bool = False
    """Its node was terminated while it ran: no exit code, as a pod on a vanished node."""
    stopping: bool = False
    stop_flush: bool = True
    """How the stop under way began: SIGTERM (the agent flushes), or POST /stop first (no flush)."""
    exit_seen: bool = False
    training_seen: bool = False
    last_step: int | None = None
    last_step_sample: float = 0.0
    last_commit: int | None = None
    commits: int = 0
    """Commits its rank 0 reported so far (``status.json``'s counter)."""
    detail: str | None = None
    """Why it failed (``failure_detail``), read once after it exited with a failure."""

    def exit_code(self) -> int | None:
        code = self.proc.poll()
        if code is None:
            return None
        return 128 - code if code < 0 else code

    @property
    def alive(self) -> bool:
        return not self.lost and self.proc.poll() is None

    def rank_status(self) -> dict[str, Any] | None:
        return read_json(os.path.join(self.control_dir, STATUS_FILE))


@dataclass(frozen=True)
class LocalOptions:
    """How the local backend runs workers. One instance per run folder."""

    root: str
    """The run's folder: ``nodes/``, ``logs/``, the token, the timeline."""
    notice_seconds: float = 30.0
    """The window of an injected notice: from the notice to the node's termination."""
    hear_notices: bool = True
    """False (a baseline): agents run with ``--notices none`` and ``signals()`` reports nothing;
    a noticed node just dies when its window ends."""
    poll_interval: float = 1.0
    """How often each agent polls its node's IMDS (spotjob-agent allows 1-5 s)."""
    kill_grace: float = 3.0
    """SIGTERM to SIGKILL when stopping a worker (a pod's termination grace period)."""
    workdir: str | None = None
    """The workers' working directory (default: this process's)."""


def _tool(name: str, module: str) -> list[str]:
    """A console script next to this interpreter, else ``python -m module``."""
    found = shutil.which(name, path=os.path.dirname(sys.executable))
    return [found] if found else [sys.executable, "-m", module]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def write_token(path: str) -> str:
    """A fresh random bearer token in a file readable by its owner only; returns the token.

    The token goes into a new file created 0600 (``O_EXCL``, so never one that already exists
    with a wider mode), which then replaces ``path`` in one rename: at no moment can anyone but
    the owner read it, whether ``path`` existed before or not.
    """
    token = secrets.token_urlsafe(32)
    write_atomic(path, (token + "\n").encode(), mode=0o600)
    return token


def _next_node_index(nodes_dir: str) -> int:
    taken = [-1]
    with contextlib.suppress(OSError):
        for entry in os.listdir(nodes_dir):
            prefix, _, index = entry.rpartition("-")
            if prefix == "local-node" and index.isdigit():
                taken.append(int(index))
    return max(taken) + 1


def run_pids(run_folder: str) -> list[int]:
    """Live processes of any worker of the run in ``run_folder``, whichever driver started them."""
    return marked_pids(ENV_RUN, os.path.abspath(run_folder))


def marked_pids(variable: str, value: str) -> list[int]:
    """Live processes whose environment holds ``variable=value`` (wherever they were re-parented)."""
    return [p.pid for p in marked(variable, value)]


def kill_marked(variable: str, value: str, *, grace: float, reason: str, give_up: float = 10.0) -> int:
    """SIGTERM every marked process (none if ``grace`` is 0), SIGKILL what is left; how many were found.

    Re-scans every round: a dying torchrun may still start or re-parent a rank. A process is
    signalled only while it is still the one found (``signal_process`` checks its creation time).
    """
    seen: set[int] = set()
    termed: set[int] = set()
    killed: set[int] = set()
    kill_at = time.monotonic() + grace
    stop_at = kill_at + give_up
    while True:
        procs = marked(variable, value)
        if not procs:
            break
        seen.update(p.pid for p in procs)
        now = time.monotonic()
        if now >= stop_at:
            log.error("%s: processes %s still alive after SIGKILL", reason, [p.pid for p in procs])
            break
        escalate = grace <= 0 or now >= kill_at
        done = killed if escalate else termed
        sig = signal.SIGKILL if escalate else signal.SIGTERM
        for p in procs:
            if p.pid in done:
                continue
            with contextlib.suppress(PermissionError):
                signal_process(p, sig)
            done.add(p.pid)
        time.sleep(0.05)
    return len(seen)


# -- the backend --------------------------------------------------------------------------------


class LocalBackend:
    """Workers as local processes on simulated spot nodes; see the module docstring.

    Use as a context manager (or call ``close()``): it owns emulator and monitor threads and the
    workers' processes, and leaves none of them behind.
    """

    def __init__(
        self,
        options: LocalOptions,
        *,
        plan: PreemptionPlan | None = None,
        timeline: Timeline | None = None,
    ) -> None:
        self.options = options
        self.plan = plan or PreemptionPlan()
        self.root = os.path.abspath(options.root)
        os.makedirs(os.path.join(self.root, "nodes"), exist_ok=True)
        os.makedirs(os.path.join(self.root, "logs"), exist_ok=True)
        self.timeline = timeline or Timeline(os.path.join(self.root, "timeline.jsonl"))
        self.token_file = os.path.join(self.root, "token")
        self._token = write_token(self.token_file)
        self.run_id = uuid.uuid4().hex[:12]
        self.changed = threading.Event()
        """Set when something happened the controller should look at now."""
        self.notices_sent = 0
        self._pending: list[str] = []
        """Notices the plan said were due that found no live worker yet (their reasons)."""
        self._lock = threading.RLock()
        self._nodes: dict[str, LocalNode] = {}
        # A run driven again (spotjob run --resume) names its nodes past the ones its folder holds.
        self._node_count = _next_node_index(os.path.join(self.root, "nodes"))
        self._workers: dict[str, _Worker] = {}
        self._ports: dict[tuple[str, int], int] = {}
        self._started = time.monotonic()
        self._closing = threading.Event()
        self._threads: list[threading.Thread] = []
        self._monitor = threading.Thread(target=self._monitor_loop, name="spotjob-local-monitor", daemon=True)
        self._monitor.start()

    # -- lifecycle ------------------------------------------------------------------------------
    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def close(self, grace: float = 2.0) -> None:
        """Stop every worker, terminate every node, stop the threads. Idempotent."""
        if self._closing.is_set():
            return
        self._closing.set()
        self._monitor.join(timeout=10)
        with self._lock:
            nodes = list(self._nodes.values())
            workers = list(self._workers.values())
        for node in nodes:
            if not node.terminated:
                kill_marked(ENV_NODE, node.marker, grace=grace, reason=f"closing node {node.name}")
            node.imds.stop()
        for w in workers:
            with contextlib.suppress(subprocess.TimeoutExpired):
                w.proc.wait(timeout=5)
        for t in self._threads:
            t.join(timeout=grace + 15)

    # -- the Backend protocol ---------------------------------------------------------------------
    def spec_problems(self, key: JobKey, spec: JobSpec) -> list[str]:
        """Nothing: local processes run any valid spec (``template`` and ``image`` are not used)."""
        return []

    def start_workers(self, key: JobKey, spec: JobSpec, attempt: int, placement: Placement) -> None:
        with self._lock:
            port = self._ports.setdefault((str(key), attempt), free_port())
            taken: set[str] = set()
            for index in range(spec.replicas):
                name = worker_name(key, attempt, index)
                existing = self._workers.get(name)
                if existing is not None and existing.job == key:
                    taken.add(existing.node.name)
                    continue  # idempotent: this attempt's worker exists
                node = self._place(placement, taken)
                taken.add(node.name)
                self._workers[name] = self._spawn(key, spec, attempt, index, node, port)
        self.changed.set()

    def stop_workers(self, key: JobKey, spec: JobSpec, *, keep_attempt: int | None = None, flush: bool = True) -> None:
        with self._lock:
            for w in list(self._workers.values()):
                if w.job != key or w.attempt == keep_attempt or w.stopping:
                    continue
                w.stopping, w.stop_flush = True, flush
                if not w.alive and not marked_pids(ENV_WORKER, w.marker):
                    self._remove(w)  # exited, and nothing of it is left (no stray rank)
                    continue
                t = threading.Thread(target=self._stop, args=(w,), name=f"stop-{w.name}", daemon=True)
                self._threads.append(t)
                t.start()

    def list_workers(self, key: JobKey, spec: JobSpec) -> list[WorkerObservation]:
        with self._lock:
            workers = [w for w in self._workers.values() if w.job == key]
        return [self._observe(w) for w in workers]

    def signals(self, key: JobKey, spec: JobSpec) -> list[Signal]:
        if not self.options.hear_notices:
            return []
        with self._lock:
            noticed = [n for n in self._nodes.values() if n.noticed and not n.terminated]
        out = []
        for n in noticed:
            assert n.deadline is not None
            deadline = datetime.fromtimestamp(n.deadline, UTC)
            out.append(
                Signal(
                    kind=SignalKind.SPOT_INTERRUPTION,
                    source="local",
                    node=n.name,
                    deadline=deadline,
                    detail=f"spot instance-action terminate at {ImdsEmulator.format_time(n.deadline)}",
                    observed_at=datetime.fromtimestamp(n.noticed_at or n.deadline, UTC),
                )
            )
        return out

    def request_flush(
        self, key: JobKey, spec: JobSpec, worker: WorkerObservation, reason: str, deadline: datetime | None
    ) -> FlushRequestState:
        """POST /flush to the worker's agent on loopback, answered at once (a local call is quick)."""
        with self._lock:
            w = self._workers.get(worker.name)
        if w is None or w.job != key:
            return FlushRequestState.failed(f"no worker {worker.name} to flush")
        try:
            answer = self._post(w, "/flush", {"reason": reason, "deadline": deadline.timestamp() if deadline else None})
        except BackendError as e:
            return FlushRequestState.failed(str(e))
        if answer is None:  # 409: the command has ended already; its exit code will tell
            return FlushRequestState.accepted()
        log.info(
            "asked the agent of %s to flush (%s)", w.name, "accepted" if answer.get("created") else "already flushing"
        )
        return FlushRequestState.accepted()

    def request_save(
        self, key: JobKey, spec: JobSpec, worker: WorkerObservation, request_id: str, reason: str
    ) -> FlushRequestState:
        """POST /save to the worker's agent on loopback: a checkpoint now, training goes on."""
        with self._lock:
            w = self._workers.get(worker.name)
        if w is None or w.job != key:
            return FlushRequestState.failed(f"no worker {worker.name} to ask for a checkpoint")
        try:
            self._post(w, "/save", {"id": request_id, "reason": reason})
        except BackendError as e:
            return FlushRequestState.failed(str(e))
        return FlushRequestState.accepted()

    def _post(
        self, w: _Worker, path: str, body: dict[str, Any], timeout: float = FLUSH_REQUEST_TIMEOUT
    ) -> dict[str, Any] | None:
        """POST ``body`` to the worker's agent with the run's token; its JSON answer, or None for 409
        (the command has ended). ``BackendError`` when the agent cannot be reached or refuses."""
        info = read_json(os.path.join(w.control_dir, AGENT_FILE))
        if info is None or "url" not in info:
            raise BackendError(f"the agent of {w.name} has not started its control API yet")
        request = urllib.request.Request(
            f"{info['url']}{path}",
            data=json.dumps(body).encode(),
            method="POST",
            headers={"Content-Type": "application/json", "Authorization": f"Bearer {self._token}"},
        )
        try:
            with urllib.request.urlopen(request, timeout=timeout) as resp:
                answer = json.loads(resp.read() or b"{}")
        except urllib.error.HTTPError as e:
            if e.code == 409:
                detail = e.read()[:200].decode(errors="replace")
                log.info("the agent of %s has nothing left to %s: %s", w.name, path.strip("/"), detail)
                return None
            raise BackendError(f"POST {path} to the agent of {w.name} answered {e.code}") from e
        except (urllib.error.URLError, OSError, ValueError) as e:
            raise BackendError(f"POST {path} to the agent of {w.name} failed: {e}") from e
        return answer if isinstance(answer, dict) else {}

    # -- the simulated cloud ----------------------------------------------------------------------
    def preempt(self, node: str | None = None, *, why: str = "injected") -> str | None:
        """Send a spot interruption notice to ``node`` (default: one hosting a live worker of the newest
        attempt, picked by the plan's seeded generator). Returns the node's name, or None if there is
        no live worker to preempt (or ``node`` is unknown, gone or noticed already)."""
        with self._lock:
            if node is not None:
                target = self._nodes.get(node)
                if target is None or target.noticed or target.terminated:
                    return None
            else:
                live = [w for w in self._workers.values() if w.alive and not w.stopping and not w.node.noticed]
                if not live:
                    return None
                newest = max(w.attempt for w in live)
                candidates = sorted((w.node for w in live if w.attempt == newest), key=lambda n: n.name)
                target = self.plan.random().choice(candidates)
            now = time.time()
            # Whole seconds: the IMDS document carries no fraction, and the node must not outlive it.
            deadline = float(math.ceil(now + self.options.notice_seconds))
            target.imds.set_spot_action("terminate", deadline)
            target.noticed_at, target.deadline = now, deadline
            self.notices_sent += 1
        self.timeline.record(EventKind.NOTICE, node=target.name, deadline=deadline, why=why)
        log.warning("spot interruption notice for %s (%s): it goes away in %.0f s", target.name, why, deadline - now)
        self.changed.set()
        return target.name

    @property
    def notices_pending(self) -> int:
        return len(self._pending)

    def nodes(self) -> list[LocalNode]:
        with self._lock:
            return list(self._nodes.values())

    def observed_step(self, job: JobKey | None = None) -> int | None:
        """The newest live attempt's highest reported step (what step triggers and the live view use)."""
        with self._lock:
            live = [w for w in self._workers.values() if w.alive and (job is None or w.job == job)]
        if not live:
            return None
        newest = max(w.attempt for w in live)
        steps = [w.last_step for w in live if w.attempt == newest and w.last_step is not None]
        return max(steps) if steps else None

    # -- inside -----------------------------------------------------------------------------------
    def _place(self, placement: Placement, taken: set[str]) -> LocalNode:
        """A free node that is not avoided (preferring unavoided zones and types), else a new one."""
        free = [
            n
            for n in self._nodes.values()
            if n.worker is None
            and not n.noticed
            and not n.terminated
            and n.name not in placement.avoid_nodes
            and n.name not in taken
        ]
        preferred = [
            n
            for n in free
            if n.zone not in placement.avoid_zones and n.instance_type not in placement.avoid_instance_types
        ]
        if preferred:
            return preferred[0]
        combos = [(z, t) for t in INSTANCE_TYPES for z in ZONES]
        start = self._node_count % len(combos)
        ordered = combos[start:] + combos[:start]
        good = [
            (z, t) for z, t in ordered if z not in placement.avoid_zones and t not in placement.avoid_instance_types
        ]
        if free and not good:
            return free[0]  # avoided zones and types are preferences, never a reason to strand the job
        zone, instance_type = (good or ordered)[0]
        return self._provision(zone, instance_type)

    def _provision(self, zone: str, instance_type: str) -> LocalNode:
        name = f"local-node-{self._node_count}"
        self._node_count += 1
        path = os.path.join(self.root, "nodes", name)
        os.makedirs(path, exist_ok=True)
        imds = ImdsEmulator(instance_id=f"i-{self.run_id}{self._node_count:04x}").start()
        node = LocalNode(name, zone, instance_type, path, imds, marker=f"{self.run_id}/{name}")
        self._nodes[name] = node
        log.info("provisioned %s (%s, %s); its IMDS is %s", name, zone, instance_type, imds.url)
        return node

    def _command(
        self, key: JobKey, job: JobSpec, attempt: int, index: int, node: LocalNode, control_dir: str, port: int
    ) -> list[str]:
        ck = job.checkpoint
        agent = [
            *_tool("spotjob-agent", "agent.launcher"),
            "--notices", "aws" if self.options.hear_notices else "none",
            "--aws-metadata-url", node.imds.url,
            "--poll-interval", f"{self.options.poll_interval:g}",
            "--token-file", self.token_file,
            "--checkpoint-uri", ck.uri,
            # The job's identity in storage (owner.json, attempt records): namespace/name.
            "--job-name", str(key),
            "--keep", str(ck.keep),
            "--control-dir", control_dir,
            "--kill-grace", f"{self.options.kill_grace:g}",
            "--attempt", str(attempt),
            # A killed driver leaves nobody to stop the workers: they flush and stop by themselves.
            "--exit-with-parent",
        ]  # fmt: skip
        if ck.every_steps is not None:
            agent += ["--every-steps", str(ck.every_steps)]
        if ck.every_seconds is not None:
            agent += ["--every-seconds", f"{ck.every_seconds:g}"]
        torchrun = [
            *_tool("torchrun", "torch.distributed.run"),
            "--nproc-per-node", str(job.nproc_per_node),
            "--nnodes", str(job.replicas),
            "--node-rank", str(index),
            "--master-addr", "127.0.0.1",
            "--master-port", str(port),
            "--max-restarts", "0",
        ]  # fmt: skip
        return [*agent, "--", *torchrun, *job.command]

    def _spawn(self, key: JobKey, job: JobSpec, attempt: int, index: int, node: LocalNode, port: int) -> _Worker:
        name = worker_name(key, attempt, index)
        control_dir = os.path.join(node.path, name)
        os.makedirs(control_dir, exist_ok=True)
        log_path = os.path.join(self.root, "logs", f"{name}.log")
        env = {k: v for k, v in os.environ.items() if k not in _AGENT_OWNED_ENV}
        env.setdefault("OMP_NUM_THREADS", "1")
        env["PYTHONUNBUFFERED"] = "1"
        env.update(job.env)
        marker = f"{self.run_id}/{name}"
        env[ENV_NODE], env[ENV_WORKER], env[ENV_RUN] = node.marker, marker, self.root
        command = self._command(key, job, attempt, index, node, control_dir, port)
        try:
            with open(log_path, "ab") as out:
                out.write(f"# {' '.join(command)}\n".encode())
                out.flush()
                proc = subprocess.Popen(
                    command,
                    cwd=self.options.workdir,
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
        except OSError as e:
            raise BackendError(f"cannot start worker {name} on {node.name}: {e}") from e
        node.worker = name
        log.info("started %s on %s (pid %d, output in %s)", name, node.name, proc.pid, log_path)
        self.timeline.record(EventKind.WORKER_STARTED, worker=name, attempt=attempt, node=node.name)
        return _Worker(name, key, attempt, index, node, proc, control_dir, log_path, marker)

    def _observe(self, w: _Worker) -> WorkerObservation:
        status = w.rank_status()
        step = status.get("step") if status else None
        code = w.exit_code()
        if w.lost:
            phase, code = WorkerPhase.FAILED, None
        elif code is not None:
            phase = WorkerPhase.SUCCEEDED if code == 0 else WorkerPhase.FAILED
        elif status is not None and status.get("state", "starting") != "starting":
            phase = WorkerPhase.RUNNING
        else:
            phase = WorkerPhase.PENDING
        if code is not None and code not in _AGENT_EXIT_CODES and w.detail is None:
            w.detail = failure_detail(w.log_path)
        return WorkerObservation(
            name=w.name,
            attempt=w.attempt,
            index=w.index,
            phase=phase,
            node=w.node.name,
            zone=w.node.zone,
            instance_type=w.node.instance_type,
            exit_code=code,
            step=step if isinstance(step, int) else None,
            detail=w.detail,
        )

    def _stop(self, w: _Worker) -> None:
        """(a thread per worker) What deleting a pod does: SIGTERM, the grace period, SIGKILL;
        without a flush, ``POST /stop`` to the agent first (it stops its command and exits 79)."""
        if not w.stop_flush and w.alive:
            try:
                self._post(w, "/stop", {"reason": "the gang is stopped without a flush"}, STOP_REQUEST_TIMEOUT)
                w.proc.wait(timeout=self.options.kill_grace + 10)
            except (BackendError, subprocess.TimeoutExpired) as e:
                log.warning("%s did not stop through its API (%s); terminating it", w.name, e)
        n = kill_marked(ENV_WORKER, w.marker, grace=self.options.kill_grace, reason=f"stopping {w.name}")
        with contextlib.suppress(subprocess.TimeoutExpired):
            w.proc.wait(timeout=10)
        log.info("stopped %s (%d process(es))", w.name, n)
        with self._lock:
            self._note_exit(w)
            self._remove(w)
        self.changed.set()

    def _remove(self, w: _Worker) -> None:
        self._workers.pop(w.name, None)
        if w.node.worker == w.name:
            w.node.worker = None

    def _terminate(self, node: LocalNode) -> None:
        """The window ended: the instance is reclaimed with everything on it."""
        with self._lock:
            victims = [w for w in self._workers.values() if w.node is node and w.alive]
            for w in victims:
                w.lost = True
            node.terminated = True
        n = kill_marked(ENV_NODE, node.marker, grace=0, reason=f"terminating {node.name}")
        node.imds.stop()
        for w in victims:
            with contextlib.suppress(subprocess.TimeoutExpired):
                w.proc.wait(timeout=5)
        lost = ", ".join(w.name for w in victims) or "nothing"
        log.warning("%s is gone (its notice window ended): killed %d process(es); lost %s", node.name, n, lost)
        self.timeline.record(EventKind.NODE_TERMINATED, node=node.name, killed=n, lost=[w.name for w in victims])
        self.changed.set()

    def _note_exit(self, w: _Worker) -> None:
        if w.exit_seen or w.alive:
            return
        self._sample(w)  # what it reported last (a flush's commit) before it went
        w.exit_seen = True
        code = None if w.lost else w.exit_code()
        self.timeline.record(EventKind.WORKER_EXITED, worker=w.name, attempt=w.attempt, code=code, lost=w.lost)
        self.changed.set()

    # -- the monitor thread -----------------------------------------------------------------------
    def _monitor_loop(self) -> None:
        while not self._closing.wait(MONITOR_TICK):
            try:
                self._tick()
            except Exception:  # the monitor must outlive one bad observation
                log.exception("the local backend's monitor failed; carrying on")

    def _tick(self) -> None:
        now = time.time()
        with self._lock:
            ending = [n for n in self._nodes.values() if n.deadline is not None and not n.terminated]
            workers = list(self._workers.values())
        for node in ending:
            assert node.deadline is not None
            if now >= node.deadline:
                self._terminate(node)
        for w in workers:
            self._watch(w)
        self._pending += self.plan.due(time.monotonic() - self._started, self.observed_step())
        while self._pending and not self._closing.is_set():
            if self.preempt(why=self._pending[0]) is None:
                break  # no live worker to hit: the notice waits for the next one to start
            self._pending.pop(0)

    def _watch(self, w: _Worker) -> None:
        """Timeline samples from one worker's status.json: steps, commits, the first training step, exit."""
        self._sample(w)
        if not w.alive:
            with self._lock:
                self._note_exit(w)

    def _sample(self, w: _Worker) -> None:
        """One look at a worker's status.json (under the lock: the monitor and a stop both look)."""
        status = w.rank_status()
        if status is None:
            return
        with self._lock:
            state = status.get("state")
            step = status.get("step")
            committed = status.get("last_committed_step")
            now = time.monotonic()
            if isinstance(step, int) and step != w.last_step:
                w.last_step = step
                if now - w.last_step_sample >= STEP_SAMPLE_SECONDS or state == "starting":
                    w.last_step_sample = now
                    self.timeline.record(EventKind.STEP, worker=w.name, attempt=w.attempt, step=step, state=state)
            if state != "starting" and not w.training_seen:
                w.training_seen = True
                self.changed.set()
            # The counter says how many committed since the last look (several may have). From an
            # agent without it: a restore reports the step it loaded as committed too, but only a
            # save times itself.
            count = status.get("commits")
            if isinstance(count, int) and not isinstance(count, bool):
                new = count - w.commits
            else:
                new = int(committed != w.last_commit and status.get("last_save_seconds") is not None)
            if isinstance(committed, int):
                w.last_commit = committed
            if new > 0 and isinstance(committed, int):
                w.commits += new
                self.timeline.record(EventKind.COMMIT, worker=w.name, attempt=w.attempt, step=committed, count=new)
                self.changed.set()


__all__ = [
    "ENV_NODE",
    "ENV_RUN",
    "ENV_WORKER",
    "EventKind",
    "LocalBackend",
    "LocalNode",
    "LocalOptions",
    "PreemptionPlan",
    "Timeline",
    "TimelineEvent",
    "failure_cause",
    "failure_detail",
    "load_trace",
    "log_excerpt",
    "run_pids",
]
