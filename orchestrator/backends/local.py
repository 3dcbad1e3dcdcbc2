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

A host maintenance (``maintain()``, in a run whose ``LocalOptions.maintenance_seconds`` is set)
is a notice far ahead: each node then also serves GCE's metadata, its agent also listens there
(``--notices aws,gcp``, ``--gcp-maintenance-seconds`` that notice, ``--flush-lead``), and
``maintain()`` sets the node's ``maintenance-event`` to TERMINATE_ON_HOST_MAINTENANCE. The agent
holds it (training goes on; ``agent.json`` says it, and the reconciler records it) and flushes
``--flush-lead`` before the deadline, then exits 75; the reconciler restarts the gang elsewhere
from that exit, as on GCE, where no controller hears the maintenance. ``signals()`` does not
report it (the reconciler would ask for a flush at once). The node stops at the deadline.

That is the AWS-shaped cloud, the default. ``LocalOptions.cloud`` picks another (``CLOUDS``):
``gcp``: each node serves GCE's metadata alone, its agent runs ``--notices gcp`` with
``--gcp-notice-seconds`` the notice's window, ``preempt()`` sets ``instance/preempted`` TRUE and a
host maintenance is the same ``maintenance-event`` as above. ``azure``: each node serves Azure's
Scheduled Events alone, its agent runs ``--notices azure``; ``preempt()`` publishes a ``Preempt``
event whose ``NotBefore`` is the node's stop, ``maintain()`` a ``Redeploy`` event (its agent holds
it). Azure may act as soon as an event is acknowledged: the node stops once its agent acknowledged
the event (after its flush: ``StartRequests``) and exited, or at ``NotBefore``, whichever comes
first, and the timeline's ``node-terminated`` says which (``stopped``).

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

A worker's ``agent.json`` (its agent writes it in its control folder) says, besides the control
API's address, whether its ranks have not met (``not_starting`` while Pending) and the cloud notice
it holds, far from its deadline (``held_notice`` while Running: the reconciler records it in the
job's ``heldNotices`` and a ``NoticeHeld`` Event, as it does on Kubernetes from ``GET /status``).

Beside this module: ``local_cloud`` (the nodes, and finding and killing a node's processes),
``local_plan`` (when to preempt), ``local_timeline`` (what happened when), ``local_failure`` (why a
worker failed, from its log). Their public names stay importable from here.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import secrets
import shutil
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from types import TracebackType
from typing import Any, Self

from agent.atomic_file import write_atomic
from agent.control_api import ENV_AGENT_TOKEN, is_loopback
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
from agent.launcher_cli import usage_problem
from agent.notices.emulators import ImdsEmulator
from agent.process_tree import ENV_AGENT_ID, read_proc
from agent.ranks import free_port
from agent.torchrun import Launcher
from orchestrator.backends.base import (
    RANKS_NOT_MEETING,
    BackendError,
    FlushRequestState,
    Placement,
    WorkerObservation,
    agent_refusal,
    held_notice,
    ranks_not_meeting,
    worker_name,
)
from orchestrator.backends.local_cloud import (
    AZURE_MAINTENANCE_EVENT,
    CLOUDS,
    ENV_NODE,
    ENV_RUN,
    ENV_WORKER,
    INSTANCE_TYPES,
    ZONES,
    LocalNode,
    SimulatedCloud,
    kill_marked,
    marked_pids,
    notice_name,
    run_pids,
)
from orchestrator.backends.local_failure import agent_exit_line, failure_cause, failure_detail, log_excerpt
from orchestrator.backends.local_plan import PreemptionPlan, load_trace
from orchestrator.backends.local_timeline import EventKind, Timeline, TimelineEvent
from orchestrator.model import JobKey, JobSpec, WorkerPhase
from orchestrator.signals import Signal, SignalKind

log = logging.getLogger(__name__)

_CHECK_IMDS_URL = "http://127.0.0.1:1"
"""The metadata URL ``spec_problems`` gives the agent's parser in place of a node's emulator's."""

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

MONITOR_TICK = 0.1
"""A tick reads one small JSON file per live worker (about 0.2 ms of CPU); a commit or an exit is
seen within it, which is part of every restart's handover."""
STEP_SAMPLE_SECONDS = 0.5
"""At most one step sample per worker this often in the timeline (the plot's resolution)."""
STEP_SAMPLE_FRACTION = 0.001
"""Past its first few minutes, a worker's step samples are at least this fraction of its age apart:
a worker that trains for days adds some thousands of lines (a thousand per e-fold of its age), not
two a second, to the timeline ``spotjob status``, the summary, the plot and a resume read whole."""


def step_sample_interval(age: float) -> float:
    """The least time between two step samples of a worker that has been training ``age`` seconds."""
    return max(STEP_SAMPLE_SECONDS, age * STEP_SAMPLE_FRACTION)


FLUSH_REQUEST_TIMEOUT = 5.0
STOP_REQUEST_TIMEOUT = 5.0


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
    first_step_sample: float | None = None
    """When its first step was sampled: the age its sampling interval grows with."""
    last_commit: int | None = None
    commits: int = 0
    """Commits its rank 0 reported so far (``status.json``'s counter)."""
    detail: str | None = None
    """Why it failed (``failure_detail``), read once after it exited with a failure; or, for an agent
    that exited 74 or 76, its own line saying why (``agent_exit_line``; "" when it said none)."""

    def exit_code(self) -> int | None:
        code = self.proc.poll()
        if code is None:
            return None
        return 128 - code if code < 0 else code

    def killed_by(self) -> int | None:
        """The signal that ended its agent itself (a SIGKILL by hand or by the OOM killer), if one did."""
        code = self.proc.poll()
        return -code if code is not None and code < 0 else None

    @property
    def alive(self) -> bool:
        return not self.lost and self.proc.poll() is None

    def rank_status(self) -> dict[str, Any] | None:
        return read_json(os.path.join(self.control_dir, STATUS_FILE))

    def agent_says(self) -> dict[str, Any]:
        """Its agent's ``agent.json`` (the control API's address, ``ranks_not_meeting``, the notice
        it holds); empty before the agent wrote it and after it exited."""
        return read_json(os.path.join(self.control_dir, AGENT_FILE)) or {}


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
    launcher: Launcher = "direct"
    """``spotjob-agent --launcher``: direct (the agent starts the ranks as torchrun would, without
    torchrun's own start) or torchrun."""
    maintenance_seconds: float | None = None
    """The notice of a host maintenance (``maintain()``), from it to the node's stop: every node
    also serves GCE's metadata and every agent listens there with ``--gcp-maintenance-seconds`` this.
    None: a run that plans none (the nodes serve AWS's metadata alone)."""
    flush_lead: float = 10.0
    """The agents' ``--flush-lead`` where ``maintenance_seconds`` is set: a maintenance is held
    until this long before its deadline."""
    cloud: str = "aws"
    """The cloud the nodes simulate (``CLOUDS``): which metadata each serves, which source its agent
    hears, and how a notice is announced there."""

    def __post_init__(self) -> None:
        if self.cloud not in CLOUDS:
            raise ValueError(f"cloud {self.cloud!r}: expected one of {', '.join(CLOUDS)}")


def _tool(name: str, module: str) -> list[str]:
    """A console script next to this interpreter, else ``python -m module``."""
    found = shutil.which(name, path=os.path.dirname(sys.executable))
    return [found] if found else [sys.executable, "-m", module]


def _worker_command(
    options: LocalOptions,
    key: JobKey,
    job: JobSpec,
    attempt: int,
    index: int,
    imds_url: str | None,
    control_dir: str,
    port: int,
    gce_url: str | None = None,
    azure_url: str | None = None,
) -> list[str]:
    """A worker's command line: spotjob-agent (the tool prefix, then its options), ``--``, torchrun.
    ``imds_url``, ``gce_url``, ``azure_url``: the node's metadata servers (those it has): on AWS the
    IMDS, and GCE's where a host maintenance is announced; on GCP GCE's; on Azure Azure's."""
    ck = job.checkpoint
    cloud = options.cloud
    url = {"aws": imds_url, "gcp": gce_url, "azure": azure_url}[cloud]
    if url is None:
        raise ValueError(f"a worker on a simulated {cloud} node needs its {cloud} metadata server's URL")
    agent = [
        *_tool("spotjob-agent", "agent.launcher"),
        "--notices", cloud if options.hear_notices else "none",
        f"--{cloud}-metadata-url", url,
        "--poll-interval", f"{options.poll_interval:g}",
        "--token-file", token_file(options.root),
        "--checkpoint-uri", ck.uri,
        # The job's identity in storage (owner.json, attempt records): namespace/name.
        "--job-name", str(key),
        "--keep", str(ck.keep),
        "--control-dir", control_dir,
        "--kill-grace", f"{options.kill_grace:g}",
        "--launcher", options.launcher,
        "--attempt", str(attempt),
        # A killed driver leaves nobody to stop the workers: they flush and stop by themselves.
        "--exit-with-parent",
    ]  # fmt: skip
    if cloud == "gcp" and options.hear_notices:
        # GCE's ~30 s from preempted=TRUE to the stop, scaled to this run's window.
        agent += ["--gcp-notice-seconds", repr(float(options.notice_seconds))]
    if options.hear_notices and options.maintenance_seconds is not None and (cloud != "aws" or gce_url is not None):
        if cloud == "aws":
            # AWS's IMDS announces no host maintenance: its nodes announce it GCE's way too.
            assert gce_url is not None
            agent[agent.index("--notices") + 1] = "aws,gcp"
            agent += ["--gcp-metadata-url", gce_url]
        if cloud != "azure":  # Azure's Redeploy carries its own NotBefore
            # Exact (not :g): a lead just under the notice must stay under it.
            agent += ["--gcp-maintenance-seconds", repr(float(options.maintenance_seconds))]
        agent += ["--flush-lead", repr(float(options.flush_lead))]
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


def _worker_env(job: JobSpec) -> dict[str, str]:
    """A worker's environment, less its marks: this process's (less what the agent's options set),
    then ``spec.env``."""
    env = {k: v for k, v in os.environ.items() if k not in _AGENT_OWNED_ENV}
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    env.update(job.env)
    return env


def agent_settings_problem(key: JobKey, spec: JobSpec, options: LocalOptions) -> str | None:
    """What every worker's spotjob-agent would refuse at its start (a usage error: it exits 2 before
    it starts anything) in the command line and the environment a worker gets (this process's
    environment, then ``spec.env``), in the agent's own words (``agent.launcher_cli.usage_problem``);
    None when it would start. ``spotjob run`` checks it before it creates a run, the reconciler on
    every pass (``spec_problems``)."""
    command = _worker_command(
        options, key, spec, 0, 0, _CHECK_IMDS_URL, os.path.join(options.root, "check"), 1, _CHECK_IMDS_URL,
        _CHECK_IMDS_URL,
    )  # fmt: skip
    return usage_problem(command[len(_tool("spotjob-agent", "agent.launcher")) :], _worker_env(spec))


def token_file(root: str) -> str:
    """The run's bearer token file (``write_token``)."""
    return os.path.join(root, "token")


def write_token(path: str) -> str:
    """A fresh random bearer token in a file readable by its owner only; returns the token.

    The token goes into a new file created 0600 (``O_EXCL``, so never one that already exists
    with a wider mode), which then replaces ``path`` in one rename: at no moment can anyone but
    the owner read it, whether ``path`` existed before or not.
    """
    token = secrets.token_urlsafe(32)
    write_atomic(path, (token + "\n").encode(), mode=0o600)
    return token


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
        if self.plan.maintenance_at_steps and options.maintenance_seconds is None:
            raise ValueError("the plan has host maintenances, but LocalOptions.maintenance_seconds is None")
        self.root = os.path.abspath(options.root)
        os.makedirs(os.path.join(self.root, "nodes"), exist_ok=True)
        os.makedirs(os.path.join(self.root, "logs"), exist_ok=True)
        self.timeline = timeline or Timeline(os.path.join(self.root, "timeline.jsonl"))
        self.token_file = token_file(self.root)
        self._token = write_token(self.token_file)
        self.run_id = uuid.uuid4().hex[:12]
        self.changed = threading.Event()
        """Set when something happened the controller should look at now."""
        self.notices_sent = 0
        self._pending: list[tuple[bool, str]] = []
        """Notices the plan said were due that found no live worker yet (a maintenance?, the reason)."""
        self._notices_held = False
        """``hold_notices()`` was called: the plan fires nothing more."""
        self._lock = threading.RLock()
        self._cloud = SimulatedCloud(
            self.root, self.run_id, maintenance=options.maintenance_seconds is not None, cloud=options.cloud
        )
        self._nodes = self._cloud.nodes
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
            node.stop_emulators()
        for w in workers:
            with contextlib.suppress(subprocess.TimeoutExpired):
                w.proc.wait(timeout=5)
        for t in self._threads:
            t.join(timeout=grace + 15)

    # -- the Backend protocol ---------------------------------------------------------------------
    def spec_problems(self, key: JobKey, spec: JobSpec) -> list[str]:
        """Only what every worker's spotjob-agent would refuse at its start (``agent_settings_problem``);
        local processes run any other valid spec (``template`` and ``image`` are not used)."""
        refused = agent_settings_problem(key, spec, self.options)
        return [] if refused is None else [agent_refusal(refused, "spec.env or the environment of spotjob run")]

    def start_workers(self, key: JobKey, spec: JobSpec, attempt: int, placement: Placement) -> None:
        with self._lock:
            taken: set[str] = set()
            placed: list[tuple[int, LocalNode]] = []
            for index in range(spec.replicas):
                existing = self._workers.get(worker_name(key, attempt, index))
                if existing is not None and existing.job == key:
                    taken.add(existing.node.name)
                    continue  # idempotent: this attempt's worker exists
                node = self._cloud.place(placement, taken)
                taken.add(node.name)
                placed.append((index, node))
            if not placed:
                # Only news wakes the controller: the reconciler calls this on every pass while
                # an attempt starts, and waking it each time spun the driver at a full core.
                return
            # Chosen once the nodes exist (a new node's IMDS server binds a port too), and under the
            # ephemeral range, where no bind(0) or outgoing connection can be handed it meanwhile.
            port = self._ports.get((str(key), attempt))
            if port is None:
                port = self._ports[(str(key), attempt)] = free_port("127.0.0.1")
            for index, node in placed:
                self._workers[worker_name(key, attempt, index)] = self._spawn(key, spec, attempt, index, node, port)
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
                # Only the stops still running are close()'s to wait for: one more per preemption
                # otherwise, for as long as the run lasts.
                self._threads = [*(other for other in self._threads if other.is_alive()), t]
                t.start()

    def list_workers(self, key: JobKey, spec: JobSpec) -> list[WorkerObservation]:
        with self._lock:
            workers = [w for w in self._workers.values() if w.job == key]
        return [self._observe(w) for w in workers]

    def training_workers(self, key: JobKey) -> list[WorkerObservation]:
        """The workers of ``key``'s newest attempt whose ranks train (Running) and that nothing is
        stopping: those an interrupted ``spotjob run`` asks to flush. Empty while that attempt starts
        (its workers Pending) or between attempts (the old one stopping, the next not started)."""
        with self._lock:
            workers = [w for w in self._workers.values() if w.job == key]
            newest = max((w.attempt for w in workers), default=None)
            current = [w for w in workers if w.attempt == newest and w.alive and not w.stopping]
        observed = [self._observe(w) for w in current]
        return [o for o in observed if o.phase is WorkerPhase.RUNNING]

    def hold_notices(self) -> None:
        """Fire no more planned notices (an interrupted ``spotjob run`` flushes and stops its workers:
        a notice now would only race that flush); the nodes already noticed still go at their time."""
        self._notices_held = True

    def signals(self, key: JobKey, spec: JobSpec) -> list[Signal]:
        if not self.options.hear_notices:
            return []
        with self._lock:
            # A host maintenance is its agent's to hold and flush; asked now, it would flush at once.
            noticed = [n for n in self._nodes.values() if n.noticed and not n.terminated and not n.maintenance]
        out = []
        cloud = self.options.cloud
        for n in noticed:
            assert n.deadline is not None
            deadline = datetime.fromtimestamp(n.deadline, UTC)
            at = ImdsEmulator.format_time(n.deadline)
            detail = {
                "aws": f"spot instance-action terminate at {at}",
                "gcp": f"GCE instance/preempted TRUE, the VM stops at {at}",
                "azure": f"Azure Scheduled Event Preempt {n.event_id}, NotBefore {at}",
            }[cloud]
            out.append(
                Signal(
                    kind=SignalKind.SPOT_INTERRUPTION,
                    # AWS's as it always was; the others name the notice ("from local GCE preempted").
                    source="local" if cloud == "aws" else f"local {notice_name(cloud)}",
                    node=n.name,
                    deadline=deadline,
                    detail=detail,
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
        url = info["url"]
        # The run's token goes only to an agent on this machine's loopback, as spotjob's agents
        # listen: not to whatever a file in the run folder names (another host, a file:// URL).
        parts = urllib.parse.urlsplit(url) if isinstance(url, str) else None
        if parts is None or parts.scheme != "http" or not is_loopback(parts.hostname or ""):
            raise BackendError(f"the agent of {w.name} names no loopback control API in its {AGENT_FILE}")
        request = urllib.request.Request(
            f"{url}{path}",
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
            target = self._target(node)
            if target is None:
                return None
            now = time.time()
            # Whole seconds: the IMDS document (and Azure's NotBefore) carries no fraction, and the
            # node must not outlive it; GCE's agent counts its window from when it hears the flip.
            deadline = float(math.ceil(now + self.options.notice_seconds))
            if target.imds is not None:
                target.imds.set_spot_action("terminate", deadline)
            elif target.gce is not None:
                target.gce.set_preempted(True)
            else:
                assert target.azure is not None
                target.event_id = target.azure.add_event("Preempt", deadline)
            target.noticed_at, target.deadline = now, deadline
            self.notices_sent += 1
        self.timeline.record(EventKind.NOTICE, node=target.name, deadline=deadline, why=why, **self._named())
        # The normal path of spot capacity (an Event of type Normal), as the agent's own flush lines are.
        log.info(
            "%s notice for %s (%s): it goes away in %.0f s%s",
            notice_name(self.options.cloud),
            target.name,
            why,
            deadline - now,
            " (or once its agent acknowledges the event)" if target.azure is not None else "",
        )
        self.changed.set()
        return target.name

    def maintain(self, node: str | None = None, *, why: str = "injected") -> str | None:
        """Announce a host maintenance of ``node`` (picked as ``preempt`` picks) on its GCE metadata
        server: ``maintenance-event`` TERMINATE_ON_HOST_MAINTENANCE, the node stopping
        ``maintenance_seconds`` later. Its agent holds the notice and flushes ``flush_lead`` before
        that. Returns the node's name, or None as ``preempt`` does; ``BackendError`` in a run that
        plans none (``LocalOptions.maintenance_seconds`` is None). In a run that simulates Azure it is
        a ``Redeploy`` Scheduled Event whose ``NotBefore`` is the node's stop."""
        seconds = self.options.maintenance_seconds
        if seconds is None:
            raise BackendError("this run plans no host maintenance: LocalOptions.maintenance_seconds is None")
        with self._lock:
            target = self._target(node)
            if target is None:
                return None
            now = time.time()
            # The agent counts its deadline from when it hears the value; the node stops no sooner.
            deadline = float(math.ceil(now + seconds))
            if target.azure is not None:
                target.event_id = target.azure.add_event(AZURE_MAINTENANCE_EVENT, deadline)
            else:
                assert target.gce is not None
                target.gce.set_maintenance_event("TERMINATE_ON_HOST_MAINTENANCE")
            target.noticed_at, target.deadline, target.maintenance = now, deadline, True
            self.notices_sent += 1
        flush_at = deadline - self.options.flush_lead
        self.timeline.record(
            EventKind.NOTICE,
            node=target.name,
            deadline=deadline,
            why=why,
            maintenance=True,
            flush_at=flush_at,
            **self._named(maintenance=True),
        )
        log.info(
            "%s notice for %s (%s): it stops in %.0f s; its agent holds it and flushes %g s before",
            notice_name(self.options.cloud, maintenance=True),
            target.name,
            why,
            deadline - now,
            self.options.flush_lead,
        )
        self.changed.set()
        return target.name

    def _named(self, *, maintenance: bool = False) -> dict[str, str]:
        """The cloud and the notice's name for a timeline event: none on AWS (its lines stay as they were)."""
        if self.options.cloud == "aws":
            return {}
        return {"cloud": self.options.cloud, "notice": notice_name(self.options.cloud, maintenance=maintenance)}

    def _target(self, node: str | None) -> LocalNode | None:
        """(under the lock) The node a notice hits: ``node`` if it is there and not noticed yet, else
        one hosting a live worker of the newest attempt (the plan's seeded choice); None if none."""
        if node is not None:
            target = self._nodes.get(node)
            return None if target is None or target.noticed or target.terminated else target
        live = [w for w in self._workers.values() if w.alive and not w.stopping and not w.node.noticed]
        if not live:
            return None
        newest = max(w.attempt for w in live)
        candidates = sorted((w.node for w in live if w.attempt == newest), key=lambda n: n.name)
        return self.plan.random().choice(candidates)

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
    def signal_workers(self, sig: int, *, until_stopped: float = 0.0) -> int:
        """``sig`` to the agent of every worker still running (SIGTSTP, SIGCONT: ``spotjob run``
        paused with Ctrl-Z and resumed); how many got it. ``until_stopped``: then wait up to that
        many seconds for each agent to have stopped (it pauses its command first), so that a
        SIGCONT sent soon after cannot come before its pause and leave it paused."""
        with self._lock:
            workers = [w for w in self._workers.values() if w.alive]
        for w in workers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(w.proc.pid, sig)
        give_up = time.monotonic() + until_stopped
        for w in workers:
            while time.monotonic() < give_up and w.proc.poll() is None:
                info = read_proc(w.proc.pid)
                if info is None or info.state in ("T", "t"):
                    break
                time.sleep(0.02)
        return len(workers)

    def _command(
        self,
        key: JobKey,
        job: JobSpec,
        attempt: int,
        index: int,
        imds_url: str | None,
        control_dir: str,
        port: int,
        gce_url: str | None = None,
        azure_url: str | None = None,
    ) -> list[str]:
        return _worker_command(self.options, key, job, attempt, index, imds_url, control_dir, port, gce_url, azure_url)

    def _spawn(self, key: JobKey, job: JobSpec, attempt: int, index: int, node: LocalNode, port: int) -> _Worker:
        name = worker_name(key, attempt, index)
        control_dir = os.path.join(node.path, name)
        os.makedirs(control_dir, exist_ok=True)
        log_path = os.path.join(self.root, "logs", f"{name}.log")
        env = _worker_env(job)
        marker = f"{self.run_id}/{name}"
        env[ENV_NODE], env[ENV_WORKER], env[ENV_RUN] = node.marker, marker, self.root
        urls = [e.url if e is not None else None for e in (node.imds, node.gce, node.azure)]
        command = self._command(key, job, attempt, index, urls[0], control_dir, port, urls[1], urls[2])
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
            w.detail = failure_detail(w.log_path, w.killed_by())
        elif code in (EXIT_INFRA_ERROR, EXIT_FLUSH_FAILED) and w.detail is None:
            w.detail = agent_exit_line(w.log_path, code) or ""  # why, in the agent's words ("": it said none)
        agent = w.agent_says() if phase in (WorkerPhase.PENDING, WorkerPhase.RUNNING) else {}
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
            detail=w.detail or None,
            not_starting=_not_meeting(agent) if phase is WorkerPhase.PENDING else None,
            # The reconciler records it (status.heldNotices, a NoticeHeld Event) for a running worker.
            held_notice=held_notice(agent) if phase is WorkerPhase.RUNNING else None,
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

    def _terminate(self, node: LocalNode, *, acknowledged: bool = False) -> None:
        """The window ended (or, on Azure, its agent acknowledged the event): the instance is
        reclaimed with everything on it."""
        with self._lock:
            victims = [w for w in self._workers.values() if w.node is node and w.alive]
            for w in victims:
                w.lost = True
            node.terminated = True
        n = kill_marked(ENV_NODE, node.marker, grace=0, reason=f"terminating {node.name}")
        node.stop_emulators()
        for w in victims:
            with contextlib.suppress(subprocess.TimeoutExpired):
                w.proc.wait(timeout=5)
        lost = ", ".join(w.name for w in victims) or "nothing"
        # A warning only where the window's end took something with it; a node left empty by a flush is normal.
        ended = "its agent acknowledged the event, so Azure acted early" if acknowledged else "its notice window ended"
        log.log(
            logging.WARNING if n or victims else logging.INFO,
            "%s is gone (%s): killed %d process(es); lost %s",
            node.name,
            ended,
            n,
            lost,
        )
        # Azure's node says why it stopped when it did: at NotBefore, or early, once acknowledged.
        stopped = {"stopped": "acknowledged" if acknowledged else "NotBefore"} if node.azure is not None else {}
        self.timeline.record(
            EventKind.NODE_TERMINATED, node=node.name, killed=n, lost=[w.name for w in victims], **stopped
        )
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
            elif node.acknowledged and not any(w.node is node and w.alive for w in workers):
                # Azure acts within seconds of the acknowledgement, which the agent sends after its
                # flush, as it exits: the node goes once that exit is seen, not at NotBefore.
                self._terminate(node, acknowledged=True)
        for w in workers:
            self._watch(w)
        if self._notices_held:
            return
        step = self.observed_step()
        self._pending += [(False, why) for why in self.plan.due(time.monotonic() - self._started, step)]
        if self.options.maintenance_seconds is not None:
            self._pending += [(True, why) for why in self.plan.maintenance_due(step)]
        while self._pending and not self._closing.is_set() and not self._notices_held:
            maintenance, why = self._pending[0]
            if (self.maintain if maintenance else self.preempt)(why=why) is None:
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
                first = w.first_step_sample if w.first_step_sample is not None else now
                if now - w.last_step_sample >= step_sample_interval(now - first) or state == "starting":
                    w.last_step_sample = now
                    w.first_step_sample = first
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


# What moved to the sibling modules stays importable from here.
__all__ = [
    "CLOUDS",
    "ENV_NODE",
    "ENV_RUN",
    "ENV_WORKER",
    "INSTANCE_TYPES",
    "ZONES",
    "EventKind",
    "LocalBackend",
    "LocalNode",
    "LocalOptions",
    "PreemptionPlan",
    "Timeline",
    "TimelineEvent",
    "failure_cause",
    "failure_detail",
    "kill_marked",
    "load_trace",
    "log_excerpt",
    "marked_pids",
    "run_pids",
]


def _not_meeting(agent: dict[str, Any]) -> tuple[str, str] | None:
    """``RanksNotMeeting`` and the agent's words (its ``agent.json``), while its ranks have not
    connected past its ``--rank-connect-timeout``: they wait in init_process_group, or build no
    Checkpointer."""
    said = ranks_not_meeting(agent.get("ranks_not_meeting"))
    return (RANKS_NOT_MEETING, f"its agent: {said}") if said is not None else None
