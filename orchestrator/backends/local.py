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

Beside this module, which keeps the reconciler's calls, the notices and the monitor thread:
``local_cloud`` (the nodes, and finding and killing a node's processes), ``local_plan`` (when to
preempt), ``local_timeline`` (what happened when), ``local_failure`` (why a worker failed, from its
log), ``local_launch`` (``LocalOptions``, a worker's command line and environment, the run's token),
``local_worker`` (one worker: what it is now, and the calls to its agent) and ``local_processes``
(the workers' processes: start, stop, a node's termination, their ``status.json`` read into the
timeline). Import each name from its own module.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import subprocess
import threading
import time
import uuid
from datetime import UTC, datetime
from types import TracebackType
from typing import Self

from agent.notices.emulators import ImdsEmulator
from agent.ranks import free_port
from orchestrator.backends.base import (
    BackendError,
    FlushRequestState,
    Placement,
    WorkerObservation,
    agent_refusal,
    worker_name,
)
from orchestrator.backends.local_cloud import (
    AZURE_MAINTENANCE_EVENT,
    ENV_NODE,
    ENV_WORKER,
    LocalNode,
    SimulatedCloud,
    kill_marked,
    marked_pids,
    notice_name,
)
from orchestrator.backends.local_launch import LocalOptions, agent_settings_problem, token_file, write_token
from orchestrator.backends.local_plan import PreemptionPlan
from orchestrator.backends.local_processes import WorkerProcesses
from orchestrator.backends.local_timeline import EventKind, Timeline
from orchestrator.backends.local_worker import LocalWorker, observe_worker, post_to_agent
from orchestrator.model import JobKey, JobSpec, WorkerPhase
from orchestrator.signals import Signal, SignalKind

log = logging.getLogger(__name__)

MONITOR_TICK = 0.1
"""A tick reads one small JSON file per live worker (about 0.2 ms of CPU); a commit or an exit is
seen within it, which is part of every restart's handover."""


# -- the backend --------------------------------------------------------------------------------


class LocalBackend(WorkerProcesses):
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
        self._workers: dict[str, LocalWorker] = {}
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
            # One kept but never started: an interrupt (spotjob run's Ctrl-C, raised wherever the
            # main thread was) came between stop_workers keeping it and starting it. Its worker's
            # node was killed above; joining it would raise and cut the rest of the run's stop short.
            if t.ident is not None:
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

    def stop_workers(
        self,
        key: JobKey,
        spec: JobSpec,
        *,
        keep_attempt: int | None = None,
        flush: bool = True,
        keep_exited: bool = False,
    ) -> None:
        with self._lock:
            for w in list(self._workers.values()):
                if w.job != key or w.attempt == keep_attempt or w.stopping:
                    continue
                if not w.alive and not marked_pids(ENV_WORKER, w.marker):
                    # Exited, and nothing of it is left (no stray rank). Its log stays either way;
                    # a job that ended keeps the worker listed, as a pod stays on Kubernetes.
                    if not keep_exited:
                        w.stopping = True
                        self._remove(w)
                    continue
                w.stopping, w.stop_flush = True, flush
                t = threading.Thread(target=self._stop, args=(w,), name=f"stop-{w.name}", daemon=True)
                # Only the stops still running are close()'s to wait for: one more per preemption
                # otherwise, for as long as the run lasts.
                self._threads = [*(other for other in self._threads if other.is_alive()), t]
                t.start()

    def list_workers(self, key: JobKey, spec: JobSpec) -> list[WorkerObservation]:
        with self._lock:
            workers = [w for w in self._workers.values() if w.job == key]
        return [observe_worker(w) for w in workers]

    def training_workers(self, key: JobKey) -> list[WorkerObservation]:
        """The workers of ``key``'s newest attempt whose ranks train (Running) and that nothing is
        stopping: those an interrupted ``spotjob run`` asks to flush. Empty while that attempt starts
        (its workers Pending) or between attempts (the old one stopping, the next not started)."""
        with self._lock:
            workers = [w for w in self._workers.values() if w.job == key]
            newest = max((w.attempt for w in workers), default=None)
            current = [w for w in workers if w.attempt == newest and w.alive and not w.stopping]
        observed = [observe_worker(w) for w in current]
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
            answer = post_to_agent(
                w, self._token, "/flush", {"reason": reason, "deadline": deadline.timestamp() if deadline else None}
            )
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
            post_to_agent(w, self._token, "/save", {"id": request_id, "reason": reason})
        except BackendError as e:
            return FlushRequestState.failed(str(e))
        return FlushRequestState.accepted()

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
        with self._lock:
            # What --preempt-every's clock counts: an attempt that a notice could hit trains.
            training = any(w.alive and not w.stopping and not w.node.noticed and w.training_seen for w in workers)
        self._pending += [(False, why) for why in self.plan.due(time.monotonic() - self._started, step, training)]
        if self.options.maintenance_seconds is not None:
            self._pending += [(True, why) for why in self.plan.maintenance_due(step)]
        while self._pending and not self._closing.is_set() and not self._notices_held:
            maintenance, why = self._pending[0]
            if (self.maintain if maintenance else self.preempt)(why=why) is None:
                break  # no live worker to hit: the notice waits for the next one to start
            self._pending.pop(0)
