"""The recovery state machine every backend shares. It knows nothing of Kubernetes or processes.

One ``reconcile(key)`` is one pass for one job (``JobKey``): observe (the backend's workers and
signals, the newest valid checkpoint in storage), decide from the job's spec, those observations
and the persisted status, act through the backend, write the status once — only if it changed —
then emit the pass's Events (``orchestrator.events.EventSink``) and metrics (``JobMetrics``). It
never sleeps; it returns when to look again. Everything it decided lives in the status, so a new
``Reconciler`` reading it carries on, and a pass whose status write is lost is replayed safely:
every action is idempotent (deterministic worker names per attempt, agents keep their first flush
request) and every counter moves in the same write as the phase that counted it. Stopping the
gang, the one action that destroys evidence (a failed worker and its exit code), happens only
after the write that records why: a pass whose write is lost stopped nothing, and the next one
decides the same failure again rather than finding the gang vanished (a preemption). A Failed
job's workers are stopped until none is alive. Events and metrics follow the write (Karpenter): a
pass whose write failed tells nothing.

No status churn: a pass whose decisions change nothing writes nothing. The numbers that move
without a decision — goodput, the workers' step hints, the attempt's highest observed step — are
written with the next change, or on their own at most every ``status_refresh_seconds`` (60 s), so
``kubectl get sj`` stays current without a write per pass. ``observedGeneration`` is the spec
generation the pass acted on.

An invalid job — a stored spec that does not validate, a name too long for its pods' names, or a
spec the backend says it cannot run (``Backend.spec_problems``) — gets ``Invalid=True`` naming
the field and a Warning Event (``InvalidSpec``); nothing else happens to it (its workers, if any,
are left as they are) until its spec changes, and every other job is served as usual.

Transitions (``*`` once the next attempt's workers were started)::

    from                        to            when                                            reason
    (new)                       Pending       storage answers; attempt 0 started              WorkersStarted
    Pending, Rescheduling*      Running       every worker of the attempt runs                WorkersRunning
    Running                     Succeeded     every worker exited 0                           Completed
    Pending, Running, Resch.*   Flushing      a preemption signal names a node of the attempt SpotInterrupted
                                              a signal says a node of the attempt is gone     NodeLost
                                              a worker's agent exited 75                      AgentPreempted
                                              a worker's agent exited 76                      AgentFlushFailed
                                              a worker vanished or died without exit code     WorkerLost
    Flushing                    Rescheduling  storage holds a manifest newer than before      FlushCommitted
                                              no worker is left running to flush              WorkersExited
                                              flushTimeoutSeconds passed                      FlushTimedOut
    Running                     Flushing      a person asked for a restart (flush request)    FlushRequestedByUser
    Pending, Rescheduling*      Rescheduling  the attempt's workers stayed unschedulable      CapacityUnavailable
                                              past startTimeoutSeconds; spec.fallback is next
    Pending, Running, Resch.*   Rescheduling  a worker's agent exited 74                      WorkerInfraError
                                Rescheduling  a worker exited non-zero (not 74/75/76/79)      WorkerFailed
                                Failed        … and maxRestarts restarts are used             RestartBudgetExhausted
    any                         Failed        the checkpoint URI names no store               InvalidCheckpointURI
    any                         Failed        another job owns the checkpoint URI             CheckpointURIOwned
    Pending, Rescheduling       Failed        storage refuses for good before the attempt     StorageRefused
                                              starts (no such bucket, access denied)

Entering Rescheduling emits ``Rescheduled`` and appends the restart to ``status.restartHistory``
(time, stopped attempt, cause, reason, message; the newest 20). It stops the whole gang — with a
flush after a preemption, without one (``flush=False``: the agents' ``POST /stop``) after a failure
of the user's code or an infrastructure error, because the healthy ranks would wait for their dead
peers — waits until none of it is alive and the backoff has passed (none after a preemption whose
attempt committed progress), then starts the next attempt
away from the preempted nodes (and zones / instance types, if the spec says so, for
``cooldown.seconds``). While the attempt starts, every pass calls ``start_workers`` again (it is
idempotent: a backend may create its workers over several passes).

Failure classes (DESIGN.md): a *preemption* (any of the Flushing reasons) never consumes
``maxRestarts``; a *failure of the user's code* (any other non-zero exit) does; an *infrastructure
error* (storage or backend unreachable) changes no phase and no budget: it is retried with
exponential backoff and shown in the Degraded condition. A *permanent* storage refusal
(``PermanentStorageError``: the bucket does not exist, access is denied) that keeps an attempt from
starting fails the job at once (``StorageRefused``, with the remedy): retrying cannot help, and
nothing runs that a failure would stop; while an attempt runs it is Degraded. A worker whose agent
exits 74 met one inside the job (storage unreachable during restore, its rendezvous port taken):
the gang is stopped and restarted as a new attempt after the infrastructure backoff, with Degraded
True (``WorkerInfraError``) until that attempt runs — no budget, no preemption count. An agent
exiting 79 was stopped through its API by someone else than this pass: like a vanished worker. A
worker that vanishes without a signal is a preemption: something outside the user's code took it (a
node reclaimed without notice, a deleted pod), as SkyPilot counts a lost cluster. When one
observation holds both, the preemption wins: a crash on a node that is going away is the notice's
doing. Exits while Flushing belong to the preemption too (peers of a stopped rank fail their
collectives). No attempt starts while storage is unreachable: its workers could not restore, and
their crash would look like the user's.

Capacity (``spec.startTimeoutSeconds``, ``spec.fallback``): an attempt whose workers the backend
reports unschedulable past the timeout gets ``CapacityUnavailable=True`` and a Warning Event; with
a fallback not in use, it is stopped at once (cause ``Capacity``: no budget, no preemption, no
backoff) and the next attempts are built from the template merged with ``spec.fallback``
(``status.capacity: fallback``). Once the job has run ``fallback.returnAfterSeconds`` on the
fallback without a preemption, the next attempt it starts (whatever restarts it) goes back to its
own template (``ReturningToSpot``). Without a fallback, or already on it, the job keeps waiting.

Flush requests (``StoredJob.flush_request``: on Kubernetes the ``spotjob.dev/flush-request``
annotation a person writes): each id is handled once, recorded in ``status.lastFlushRequest``
(``InProgress``, then ``Committed`` with the step, ``NotCommitted``, ``Skipped`` or ``Invalid``)
in the pass that takes it, so neither a replayed pass nor a new leader handles it twice. Only a
Running job takes one; one written while another is in progress is handled once that one ends.
``restart`` enters Flushing like a preemption (cause ``Requested``): every agent flushes at one
step, storage shows the commit, the gang restarts from it after the initial backoff — no
preemption or restart counted, no node avoided (a real notice arriving meanwhile turns it into a
preemption). ``checkpoint`` asks every agent for an early save
(``Backend.request_save``) and training goes on; the first valid checkpoint committed after the
request ends it, the flush timeout or a stopped gang ends it NotCommitted.

Guarding against false alarms (SkyPilot): a signal is acted on only if it names a node or worker
of the current attempt in this pass's fresh listing — a stale queue message, a notice for a node
the job has left, or for another job's node changes nothing; advisory signals (Rebalance) stop
nothing; a worker missing from the listing is declared lost only if a second listing agrees.

Ownership and fencing (``agent.ownership``): the first pass that reaches the job's storage claims
the URI for the job (``job_identity``: ``namespace/name``, the same string the agents get as their
job name); a URI another job owns fails the job at once, naming the
owner and the remedy (a transient storage error does not: it is retried like any other). Before
an attempt's workers start, the attempt is recorded in storage with its fence (the newest valid
checkpoint, what it resumes from), create-only and replay-safe; an attempt that cannot be
recorded does not start. A job whose storage holds records of a newer attempt (a job deleted and
created again under its name) numbers its next attempt past them. ``latest_valid`` never counts a
foreign or fenced checkpoint, so a stale worker's commit can neither end a flush nor be resumed.

The flush is done when storage — the source of truth, never an agent's word — holds a valid
manifest written by the flush (``trigger: flush``; a periodic save that commits while the ranks
are still agreeing on the flush step does not count) newer than the *baseline*: the newest
committed step read in the pass that heard a controller signal, or, when an agent acted on its
own (exit 75/76, lost), the step the status held before that pass (the agent may have committed
between two passes). Flush requests never block a pass: ``Backend.request_flush`` answers pending
until the agent answered; each pass asks again the running workers whose agent has not accepted,
and never asks an agent that accepted. The pass that sees the flush committed first takes the
answers of the requests still in flight (and sends none anew), so a quick flush's requests are
told (``FlushRequested``) all the same.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from operator import methodcaller
from typing import Protocol

from agent.catalog import CheckpointStatus, latest_valid
from agent.control_channel import EXIT_FLUSH_FAILED, EXIT_INFRA_ERROR, EXIT_PREEMPTED, EXIT_STOPPED
from agent.ownership import FencedError, OwnershipError, claim, newest_attempt, record_attempt
from agent.storage import PermanentStorageError, Storage, StorageError, TransientStorageError, open_storage
from orchestrator.backends.base import (
    Backend,
    BackendError,
    FlushRequestOutcome,
    FlushRequestState,
    Placement,
    WorkerObservation,
)
from orchestrator.controller_loop import Controller as Controller  # its home before it had its own module
from orchestrator.events import NULL_METRICS, EventSink, EventType, JobMetrics, LoggingEventSink
from orchestrator.model import (
    MAX_RESTART_HISTORY,
    AttemptStatus,
    Avoidance,
    AvoidKind,
    CapacityType,
    Cause,
    CheckpointInfo,
    CheckpointSpec,
    Condition,
    ConditionStatus,
    FlushRequest,
    FlushRequestOutcomeName,
    FlushRequestStatus,
    JobKey,
    JobSpec,
    JobStatus,
    NodeRef,
    Phase,
    RecoveryStatus,
    RestartRecord,
    WorkerPhase,
    WorkerStatus,
    job_name_problem,
)
from orchestrator.signals import Signal, SignalKind
from orchestrator.store import ConflictError, JobStore, StoredJob

log = logging.getLogger(__name__)


# -- time -------------------------------------------------------------------------------------


class Clock(Protocol):
    """Where the reconciler and the controller loop get time; tests pass a fake one."""

    def now(self) -> datetime:
        """Wall time, timezone-aware (UTC): what status records."""
        ...

    def monotonic(self) -> float:
        """Seconds for measuring durations within this process."""
        ...

    def sleep(self, seconds: float) -> None:
        """Wait (only ``Controller`` waits; the reconciler never does)."""
        ...


class SystemClock:
    """The real clock."""

    def now(self) -> datetime:
        return datetime.now(UTC)

    def monotonic(self) -> float:
        return time.monotonic()

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)


# -- reasons ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Reason:
    """A CamelCase reason and the message that goes with it (``str.format`` fields)."""

    name: str
    template: str
    warning: bool = False

    def message(self, **fields: object) -> str:
        return self.template.format(**fields)


WORKERS_STARTED = Reason(
    "WorkersStarted", "started {replicas} worker(s) of attempt {attempt} from {resume}, avoiding {avoid}"
)
WORKERS_RUNNING = Reason("WorkersRunning", "every worker of attempt {attempt} is running")
COMPLETED = Reason("Completed", "every worker exited 0 (last step seen {step})")
SPOT_INTERRUPTED = Reason("SpotInterrupted", "{signal}: flushing the gang and moving it")
NODE_LOST = Reason("NodeLost", "{signal}: flushing what is left of the gang and moving it")
AGENT_PREEMPTED = Reason("AgentPreempted", "the agent of {worker} on node {node} heard a notice itself and exited 75")
AGENT_FLUSH_FAILED = Reason(
    "AgentFlushFailed", "the agent of {worker} on node {node} exited 76: its flush committed nothing", warning=True
)
WORKER_LOST = Reason("WorkerLost", "worker {worker} on node {node} is gone without an exit code or a notice")
FLUSH_REQUESTED = Reason("FlushRequested", "{count} agent(s) accepted the request to flush by {deadline}: {workers}")
FLUSH_REQUEST_FAILED = Reason(
    "FlushRequestFailed", "could not ask the agent of {worker} to flush: {error}", warning=True
)
FLUSH_FAILED = Reason("FlushFailed", "the agent of {worker} exited 76: its flush committed nothing", warning=True)
FLUSH_COMMITTED = Reason("FlushCommitted", "step {step} committed at {uri} {seconds:.1f}s after the notice")
WORKERS_EXITED = Reason(
    "WorkersExited",
    "no worker is left to flush and nothing newer than {baseline} was committed; resuming from {resume}",
)
FLUSH_TIMED_OUT = Reason(
    "FlushTimedOut",
    "nothing newer than {baseline} committed within {timeout:.0f}s; resuming from {resume}",
    warning=True,
)
RESCHEDULED = Reason(
    "Rescheduled", "stopped attempt {attempt} ({cause}); attempt {next} starts in {delay:.0f}s, avoiding {avoid}"
)
WORKER_FAILED = Reason(
    "WorkerFailed",
    "worker {worker} exited with code {code}; restart {restarts} of {max_restarts}{detail}",
    warning=True,
)
RESTART_BUDGET_EXHAUSTED = Reason(
    "RestartBudgetExhausted",
    "worker {worker} exited with code {code} and all {max_restarts} restart(s) are used{detail}",
    warning=True,
)
WORKER_INFRA_ERROR = Reason(
    "WorkerInfraError",
    "the agent of {worker} on node {node} exited {code}: an infrastructure error, not the user's code "
    "(storage unreachable, rendezvous port taken); restarting after the infrastructure backoff, no restart counted",
    warning=True,
)
INVALID_CHECKPOINT_URI = Reason("InvalidCheckpointURI", "{error}", warning=True)
CHECKPOINT_URI_OWNED = Reason("CheckpointURIOwned", "{error}", warning=True)
ATTEMPT_RENUMBERED = Reason(
    "AttemptRenumbered",
    "storage records attempt {recorded} of this job already (an earlier job of this name): the next attempt is "
    "{attempt}",
)
STORAGE_UNREACHABLE = Reason("StorageUnreachable", "cannot read checkpoints at {uri}: {error}", warning=True)
STORAGE_REFUSED = Reason(
    "StorageRefused",
    "storage refuses to list checkpoints at {uri}: {error}; the running workers are left alone, but no attempt "
    "can start until the bucket or the credentials are fixed",
    warning=True,
)
STORAGE_REFUSED_FAILED = Reason(
    "StorageRefused",
    "storage refuses the checkpoint URI {uri}: {error}. Nothing was started: fix the URI, the bucket or the "
    "credentials, then submit the job again",
    warning=True,
)
BACKEND_UNAVAILABLE = Reason("BackendUnavailable", "the backend failed: {error}", warning=True)
HEALTHY = Reason("Healthy", "storage and the backend answer")
INVALID_SPEC = Reason("InvalidSpec", "{problems}; nothing is done for this job until its spec is fixed", warning=True)
SPEC_VALID = Reason("SpecValid", "the spec is valid")
INVALID_STATUS = Reason(
    "InvalidStatus",
    "the stored status cannot be read ({problems}); the job is left alone rather than restarted from nothing",
    warning=True,
)

CAPACITY_UNAVAILABLE = Reason(
    "CapacityUnavailable",
    "{workers} found no capacity within startTimeoutSeconds ({timeout:.0f}s): {why}; {then}",
    warning=True,
)
CAPACITY_FOUND = Reason("CapacityFound", "every worker of attempt {attempt} runs on {capacity} capacity")
RETURNING_TO_SPOT = Reason(
    "ReturningToSpot",
    "{seconds:.0f}s on the fallback capacity without a preemption (fallback.returnAfterSeconds {period:.0f}s): "
    "attempt {attempt} uses the job's own template again",
)
FLUSH_REQUESTED_BY_USER = Reason(
    "FlushRequestedByUser", "flush request {id} (restart{reason}): flushing the gang and restarting it"
)
CHECKPOINT_REQUESTED_BY_USER = Reason(
    "CheckpointRequestedByUser", "flush request {id} (checkpoint{reason}): {count} agent(s) asked for a checkpoint"
)
FLUSH_REQUEST_COMMITTED = Reason("FlushRequestCommitted", "flush request {id} ({mode}): step {step} committed")
FLUSH_REQUEST_NOT_COMMITTED = Reason("FlushRequestNotCommitted", "flush request {id} ({mode}): {why}", warning=True)
FLUSH_REQUEST_SKIPPED = Reason("FlushRequestSkipped", "flush request {id} ({mode}): {why}")
SAVE_REQUEST_FAILED = Reason(
    "SaveRequestFailed", "could not ask the agent of {worker} for a checkpoint: {error}", warning=True
)
FLUSH_REQUEST_INVALID = Reason(
    "FlushRequestInvalid", "{problem}; the request is ignored (write a new one with a new id)", warning=True
)

READY = "Ready"
FLUSHING = "Flushing"
DEGRADED = "Degraded"
INVALID = "Invalid"
CAPACITY = "CapacityUnavailable"


# -- the reconciler ---------------------------------------------------------------------------


@dataclass(frozen=True)
class ReconcilerOptions:
    """How often to look again; internal tunables, not part of the job's spec."""

    running_poll_seconds: float = 10.0
    starting_poll_seconds: float = 2.0
    flushing_poll_seconds: float = 1.0
    stopping_poll_seconds: float = 2.0
    infra_backoff_initial_seconds: float = 1.0
    infra_backoff_max_seconds: float = 60.0
    status_refresh_seconds: float = 60.0
    """At most this long between writes of goodput and step hints when nothing else changes."""

    def infra_delay(self, tries: int) -> float:
        """Exponential backoff for infrastructure errors: 1, 2, 4 … seconds, capped."""
        return min(self.infra_backoff_max_seconds, self.infra_backoff_initial_seconds * 2 ** max(0, tries - 1))


@dataclass(frozen=True)
class ReconcileResult:
    phase: Phase | None
    """The job's phase after the pass; None when the job is gone or its status unreadable."""
    requeue_after: float | None
    """Seconds until the next pass; None: only when something changes (the job is Succeeded,
    Failed, Invalid or gone)."""


_Placed = WorkerObservation | WorkerStatus
"""A worker as observed now or as the status last saw it: either tells where it ran."""


@dataclass(frozen=True)
class _Preemption:
    """Evidence that the capacity is going away, as one pass found it."""

    reason: Reason
    message: str
    nodes: list[NodeRef]
    deadline: datetime | None
    heard_by_controller: bool
    signals: tuple[Signal, ...] = ()
    """The signals acted on (counted in metrics)."""


@dataclass(frozen=True)
class _Event:
    type: EventType
    reason: str
    message: str
    node: str | None


@dataclass
class _Pass:
    """One reconcile's working state: the observations and the status being decided."""

    key: JobKey
    spec: JobSpec
    status: JobStatus
    now: datetime
    previous_checkpoint_step: int | None
    seen: set[str]
    """Workers of the current attempt the status had seen before this pass."""
    workers: list[WorkerObservation] = field(default_factory=list)
    signals: list[Signal] = field(default_factory=list)
    checkpoint: CheckpointStatus | None = None
    checkpoint_uri: str = ""
    storage_error: StorageError | None = None
    invalid_uri: str | None = None
    storage: Storage | None = None
    owned_by_another: str | None = None
    signals_error: BackendError | None = None
    events: list[_Event] = field(default_factory=list)
    """Told once the status is written."""
    metrics: list[methodcaller] = field(default_factory=list)
    """``JobMetrics`` calls, made once the status is written."""
    stop_flush: bool | None = None
    """The gang is to be stopped once this pass's status is written (with a flush or not); None: no."""
    flush_request: FlushRequest | None = None
    """A person's request to flush (``StoredJob.flush_request``), if the job carries one."""
    flush_request_id: str | None = None
    flush_request_problem: str | None = None

    @property
    def stopped(self) -> bool:
        """This pass decided to stop the gang (``_commit`` acts on it after the write)."""
        return self.stop_flush is not None

    def current(self) -> list[WorkerObservation]:
        return [w for w in self.workers if w.attempt == self.status.attempt.number]

    @property
    def checkpoint_step(self) -> int | None:
        return self.checkpoint.ref.step if self.checkpoint is not None else None

    @property
    def checkpoint_is_flush(self) -> bool:
        """The newest checkpoint was a flush, not a periodic save that happened to commit meanwhile.

        Manifests that do not say (written before spotjob recorded the trigger) count as a flush.
        """
        manifest = self.checkpoint.manifest if self.checkpoint is not None else None
        return manifest is None or manifest.trigger in (None, "flush")

    def resume_point(self) -> str:
        step = self.checkpoint_step
        return f"step {step}" if step is not None else "scratch"


class Reconciler:
    """Drives jobs, one pass for one job at a time, through the state machine of the module docstring.

    One instance serves every job of its store: per-job memory (the URIs it claimed, when it last
    wrote each status) is keyed by ``JobKey`` and dropped when a job is gone. ``reconcile`` is not
    reentrant for one key (the work queue guarantees one pass per key at a time); passes for
    different keys may run on different threads.
    """

    def __init__(
        self,
        store: JobStore,
        backend: Backend,
        clock: Clock | None = None,
        *,
        events: EventSink | None = None,
        metrics: JobMetrics | None = None,
        storage_factory: Callable[[str], Storage] = open_storage,
        options: ReconcilerOptions | None = None,
    ) -> None:
        self.store = store
        self._backend = backend
        self._clock: Clock = clock or SystemClock()
        self._events: EventSink = events or LoggingEventSink()
        self._metrics: JobMetrics = metrics or NULL_METRICS
        self._storage_factory = storage_factory
        self._options = options or ReconcilerOptions()
        self._lock = threading.Lock()
        self._storages: dict[str, Storage] = {}
        self._claimed: set[tuple[str, str]] = set()
        """(URI, job identity) pairs this reconciler has claimed: once per process is enough."""
        self._written_at: dict[JobKey, float] = {}
        """When this reconciler last wrote each job's status (monotonic): the refresh of volatile numbers."""
        self._flush_in_flight: dict[JobKey, set[str]] = {}
        """Workers whose flush request was sent and not answered yet (their answer is told even if
        the commit shows first); per job, this process only."""
        self._handlers: dict[Phase, Callable[[_Pass], float | None]] = {
            Phase.PENDING: self._bring_up,
            Phase.RUNNING: self._running,
            Phase.FLUSHING: self._flushing,
            Phase.RESCHEDULING: self._bring_up,
        }

    def reconcile(self, key: JobKey) -> ReconcileResult:
        """One pass for job ``key``: observe, decide, act, write the status if it changed, then tell.

        A job gone from the store is forgotten (``JobMetrics.job_deleted``) and answers
        ``ReconcileResult(None, None)``. A status write that conflicts (the job changed since it
        was read) answers a requeue of 0 and tells nothing. Raises ``StoreError`` if the store
        fails; backend and storage errors are retried (see the module docstring).
        """
        started = self._clock.monotonic()
        stored = self.store.get(key)
        if stored is None:
            self._forget(key)
            return ReconcileResult(None, None)
        now = self._clock.now()
        if stored.status is None and _status_unreadable(stored):
            # The status cannot be read: writing one would restart the job from nothing.
            self._events.emit(
                key, EventType.WARNING, INVALID_STATUS.name, INVALID_STATUS.message(problems=stored.invalid)
            )
            return ReconcileResult(None, None)
        fresh = stored.status is None
        before = stored.status or JobStatus(created_at=now, reason="Created", message="waiting for the first pass")
        if before.phase.terminal:
            return self._stop_leftovers(key, stored, before)

        problems = self._problems(key, stored)
        if problems is not None or stored.spec is None:
            p = _Pass(key, stored.spec or _PLACEHOLDER_SPEC, before.model_copy(deep=True), now, None, set())
            self._invalid(p, problems or stored.invalid or "the spec is invalid", stored.generation)
            return self._commit(p, stored, before, fresh, None, started)

        p = self._new_pass(key, stored.spec, before, now)
        p.flush_request, p.flush_request_id = stored.flush_request, stored.flush_request_id
        p.flush_request_problem = stored.flush_request_problem
        try:
            self._observe(p)
            requeue = self._decide(p)
        except BackendError as e:
            # Forget this pass's decisions: their actions are idempotent and replayed next time.
            p = self._new_pass(key, stored.spec, before, now)
            p.status.infra_errors += 1
            self._degraded(p, BACKEND_UNAVAILABLE, error=e)
            requeue = self._options.infra_delay(p.status.infra_errors)
        else:
            self._note_health(p)
            self._record_workers(p)
        self._valid(p)
        p.status.observed_generation = stored.generation
        self._account(p)
        return self._commit(p, stored, before, fresh, requeue, started)

    def _stop_leftovers(self, key: JobKey, stored: StoredJob, status: JobStatus) -> ReconcileResult:
        """A Failed job's workers are stopped (without a flush) until none is alive: the pass that
        decided the failure stops them after its write, and this finishes a stop that failed."""
        if status.phase is not Phase.FAILED or stored.spec is None:
            return ReconcileResult(status.phase, None)
        try:
            alive = [w for w in self._backend.list_workers(key, stored.spec) if w.phase.alive]
            if alive:
                self._backend.stop_workers(key, stored.spec, flush=False)
        except BackendError as e:
            log.warning("job %s [%s]: cannot stop its workers yet (%s)", key, status.phase, e)
            return ReconcileResult(status.phase, self._options.infra_delay(1))
        return ReconcileResult(status.phase, self._options.stopping_poll_seconds if alive else None)

    def forget(self, key: JobKey) -> None:
        """Drop what this reconciler remembers of ``key`` (the job was deleted)."""
        self._forget(key)

    # -- write, then tell ---------------------------------------------------------------------
    def _commit(
        self,
        p: _Pass,
        stored: StoredJob,
        before: JobStatus,
        fresh: bool,
        requeue: float | None,
        started: float,
    ) -> ReconcileResult:
        """Write the status if it changed (or its volatile numbers are due), then emit and count."""
        key, status = p.key, p.status
        stop_failed = False
        changed = fresh or _significant(status) != _significant(before)
        due = status != before and (
            self._clock.monotonic() - self._written_at.get(key, -math.inf) >= self._options.status_refresh_seconds
        )
        if changed or due:
            try:
                self.store.update_status(key, status, version=stored.version)
            except ConflictError as e:
                log.info("job %s [%s]: status changed under this pass (%s); re-reading", key, before.phase, e)
                return ReconcileResult(before.phase, 0.0)
            with self._lock:
                self._written_at[key] = self._clock.monotonic()
            if status.goodput is not None:
                p.metrics.append(methodcaller("goodput", key.namespace, key.name, status.goodput))
        # Act on a decision only once it is written: a pass whose write is lost stopped nothing, so
        # the next pass sees what this one saw (a failed worker's exit code, not a vanished gang).
        if p.stop_flush is not None:
            try:
                self._backend.stop_workers(key, p.spec, flush=p.stop_flush)
            except BackendError as e:
                log.warning("job %s [%s]: stopping the gang failed (%s); trying again", key, status.phase, e)
                requeue = self._options.infra_delay(1)
                stop_failed = True
        for event in p.events:
            self._events.emit(key, event.type, event.reason, event.message, node=event.node)
        for count in p.metrics:
            try:
                count(self._metrics)
            except Exception:  # a metric is a courtesy; the pass is done
                log.exception("job %s: recording a metric failed", key)
        if stop_failed:
            requeue_after: float | None = requeue
        else:
            requeue_after = None if status.phase.terminal or requeue is None else max(0.0, requeue)
        log.debug(
            "job %s [%s]: pass took %.3fs (%s); next in %s",
            key,
            status.phase,
            self._clock.monotonic() - started,
            "written" if changed or due else "nothing to write",
            "never" if requeue_after is None else f"{requeue_after:.1f}s",
        )
        return ReconcileResult(status.phase, requeue_after)

    def _forget(self, key: JobKey) -> None:
        identity = job_identity(key)
        with self._lock:
            self._written_at.pop(key, None)
            self._flush_in_flight.pop(key, None)
            self._claimed = {c for c in self._claimed if c[1] != identity}
        try:
            self._metrics.job_deleted(key.namespace, key.name)
        except Exception:
            log.exception("job %s: forgetting its metrics failed", key)

    # -- validity ----------------------------------------------------------------------------
    def _problems(self, key: JobKey, stored: StoredJob) -> str | None:
        """Why the job cannot run as stored (naming the fields), or None."""
        problems: list[str] = []
        name = job_name_problem(key.name)
        if name is not None:
            problems.append(f"metadata.name: {name}")
        if stored.spec is None:
            problems.append(stored.invalid or "spec: does not validate")
        else:
            try:
                problems += self._backend.spec_problems(key, stored.spec)
                if stored.spec.fallback is not None:
                    problems += [
                        f"with spec.fallback.template merged in, {problem}"
                        for problem in self._backend.spec_problems(key, stored.spec.on_fallback())
                    ]
            except BackendError as e:
                log.warning("job %s: the backend could not check the spec: %s", key, e)
        return "; ".join(problems) or None

    def _invalid(self, p: _Pass, problems: str, generation: int) -> None:
        message = INVALID_SPEC.message(problems=problems)
        self._condition(p, INVALID, True, INVALID_SPEC.name, message)
        p.status.observed_generation = generation
        self._event(p, INVALID_SPEC, message=message)

    def _valid(self, p: _Pass) -> None:
        """Clear a past Invalid condition (the spec was fixed); no condition at all for a job never invalid."""
        c = p.status.condition(INVALID)
        if c is not None and c.status == "True":
            self._condition(p, INVALID, False, SPEC_VALID.name, SPEC_VALID.message())
            self._event(p, SPEC_VALID)

    # -- observe ---------------------------------------------------------------------------
    def _new_pass(self, key: JobKey, spec: JobSpec, before: JobStatus, now: datetime) -> _Pass:
        status = before.model_copy(deep=True)
        return _Pass(
            key=key,
            spec=spec,
            status=status,
            now=now,
            previous_checkpoint_step=status.last_checkpoint.step if status.last_checkpoint else None,
            seen={w.name for w in status.workers},
        )

    def _observe(self, p: _Pass) -> None:
        spec, status = p.spec, p.status
        p.workers = self._backend.list_workers(p.key, spec)
        try:
            p.signals = self._backend.signals(p.key, spec)
        except BackendError as e:
            # Exits and lost workers still reveal preemptions; carry on without notices.
            p.signals_error = e
        try:
            storage = self._storage(spec.checkpoint.uri)
        except ValueError as e:
            p.invalid_uri = str(e)
            return
        p.checkpoint_uri = storage.url()
        p.storage = storage
        try:
            self._claim(p, storage)
            if p.owned_by_another is None:
                p.checkpoint = latest_valid(storage)
        except StorageError as e:
            p.storage_error = e
        if p.checkpoint is not None and p.checkpoint.manifest is not None:
            status.last_checkpoint = CheckpointInfo(
                step=p.checkpoint.ref.step,
                uri=storage.url(p.checkpoint.ref.folder),
                time=p.checkpoint.manifest.created_at,
            )
        if p.storage_error is not None or p.signals_error is not None:
            status.infra_errors += 1
        status.avoid = [a for a in status.avoid if a.until > p.now]
        self._track_steps(p)

    def _claim(self, p: _Pass, storage: Storage) -> None:
        """Make the URI the job's (create-only, first look only); note another owner."""
        claimed = (storage.uri, job_identity(p.key))
        with self._lock:
            if claimed in self._claimed:
                return
        try:
            claim(storage, claimed[1])
        except OwnershipError as e:
            p.owned_by_another = str(e)
            return
        with self._lock:
            self._claimed.add(claimed)

    def _storage(self, uri: str) -> Storage:
        with self._lock:
            storage = self._storages.get(uri)
        if storage is None:
            storage = self._storage_factory(uri)
            with self._lock:
                storage = self._storages.setdefault(uri, storage)
        return storage

    def _track_steps(self, p: _Pass) -> None:
        """Follow the attempt's step hints: the highest one, and the first one for the step rate."""
        steps = [w.step for w in p.current() if w.step is not None]
        if not steps:
            return
        attempt, step = p.status.attempt, max(steps)
        if attempt.first_step is None:
            attempt.first_step, attempt.first_step_at = step, p.now
        if attempt.observed_step is None or step > attempt.observed_step:
            attempt.observed_step, attempt.observed_step_at = step, p.now

    # -- decide and act --------------------------------------------------------------------
    def _decide(self, p: _Pass) -> float | None:
        """Run phase handlers until one waits; a handler returns None when it changed the phase."""
        if p.invalid_uri is not None:
            self._finish(p, Phase.FAILED, INVALID_CHECKPOINT_URI, error=p.invalid_uri)
            return None
        if p.owned_by_another is not None:
            self._finish(p, Phase.FAILED, CHECKPOINT_URI_OWNED, error=p.owned_by_another)
            return None
        if isinstance(p.storage_error, PermanentStorageError) and p.status.attempt.started_at is None:
            # Retrying cannot help (no such bucket, access denied, a file where a folder belongs) and
            # no attempt can start without storage: say so now rather than wait forever. While
            # workers run, the same refusal is only Degraded: they train on with their own access.
            uri = p.checkpoint_uri or p.spec.checkpoint.uri
            self._finish(p, Phase.FAILED, STORAGE_REFUSED_FAILED, uri=uri, error=p.storage_error)
            return None
        self._note_flush_request(p)
        for _ in range(len(Phase) + 2):
            if p.status.phase.terminal:
                return None
            wait = self._handlers[p.status.phase](p)
            if wait is not None:
                return wait
        raise RuntimeError(f"job {p.key}: no stable decision after {len(Phase) + 2} transitions")

    def _bring_up(self, p: _Pass) -> float | None:
        """Pending and Rescheduling: start the attempt once nothing holds it back; wait until it runs."""
        spec, status, attempt = p.spec, p.status, p.status.attempt
        if attempt.started_at is not None:
            if self._watch(p):
                return None
            current = p.current()
            if len(current) >= spec.replicas and all(w.phase is WorkerPhase.RUNNING for w in current):
                self._enter_running(p)
                return None
            capacity_wait = self._check_capacity(p)
            if capacity_wait is None:
                return None
            # Idempotent: a backend may create the attempt's workers over several passes (a
            # rendezvous address known only once the first one runs).
            self._backend.start_workers(p.key, self._effective_spec(p), attempt.number, self._placement(status))
            return min(self._options.starting_poll_seconds, capacity_wait)

        leftovers = [w.name for w in p.workers if w.attempt != attempt.number and w.phase.alive]
        if leftovers:
            # Never two attempts at once: their ranks would meet in one rendezvous.
            self._debug(p, "waiting for %s to stop before attempt %d", ", ".join(leftovers), attempt.number)
            if not p.stopped:
                self._backend.stop_workers(p.key, spec, keep_attempt=attempt.number, flush=_stop_with_flush(status))
            return self._options.stopping_poll_seconds
        if p.storage_error is not None:
            self._debug(p, "not starting attempt %d while storage is unreachable", attempt.number)
            return self._options.infra_delay(status.infra_errors)
        recovery = status.recovery
        if recovery is not None and recovery.restart_at is not None and p.now < recovery.restart_at:
            return (recovery.restart_at - p.now).total_seconds()

        if p.stopped:
            # This pass stopped the gang; the stop goes out once the status is written, and would
            # take down an attempt started in the same pass. Start it on the next one.
            return 0.0
        if not self._record_attempt(p):
            return self._options.infra_delay(status.infra_errors)
        self._maybe_return_to_spot(p)
        placement = self._placement(status)
        self._backend.start_workers(p.key, self._effective_spec(p), attempt.number, placement)
        attempt.started_at = p.now
        attempt.resumed_from_step = p.checkpoint_step
        if recovery is not None:
            self._count_lost_steps(p, recovery)
        message = WORKERS_STARTED.message(
            replicas=spec.replicas, attempt=attempt.number, resume=p.resume_point(), avoid=placement.describe()
        )
        self._condition(p, READY, False, WORKERS_STARTED.name, message)
        self._event(p, WORKERS_STARTED, message=message)
        return self._options.starting_poll_seconds

    def _record_attempt(self, p: _Pass) -> bool:
        """Record the attempt about to start, fenced at the newest valid checkpoint (see the module
        docstring); False (and Degraded) when storage cannot take the record."""
        attempt, storage, job = p.status.attempt, p.storage, job_identity(p.key)
        assert storage is not None, "starting an attempt without storage"
        fence = p.checkpoint.ref if p.checkpoint is not None else None
        try:
            recorded = newest_attempt(storage, job)
            if recorded is not None and recorded > attempt.number:
                self._renumber(p, recorded)
            record_attempt(storage, job, attempt.number, fence)
        except FencedError:
            # Another controller recorded a newer attempt since we looked: number past it next pass.
            self._debug(p, "attempt %d was overtaken in storage; renumbering next pass", attempt.number)
            return False
        except StorageError as e:
            p.storage_error = e
            p.status.infra_errors += 1
            self._debug(p, "not starting attempt %d: it could not be recorded (%s)", attempt.number, e)
            return False
        return True

    def _renumber(self, p: _Pass, recorded: int) -> None:
        p.status.attempt.number = recorded + 1
        self._event(p, ATTEMPT_RENUMBERED, recorded=recorded, attempt=p.status.attempt.number)

    def _running(self, p: _Pass) -> float | None:
        if self._watch(p):
            return None
        if self._take_flush_request(p):
            return None
        if self._checkpoint_request_in_progress(p):
            return self._options.flushing_poll_seconds
        return self._options.running_poll_seconds

    def _watch(self, p: _Pass) -> bool:
        """React to what the current attempt's workers did; True if the phase changed."""
        current = p.current()
        preemption = self._preemption(p, current)
        if preemption is not None:
            self._enter_flushing(p, preemption)
            return True
        # Before failures: the peers of a worker that stopped for an infrastructure error fail too.
        infra = [w for w in current if w.exit_code == EXIT_INFRA_ERROR]
        if infra:
            self._on_infra_error(p, infra[0])
            return True
        failed = [w for w in current if _is_failure(w)]
        if failed:
            self._on_failure(p, failed[0])
            return True
        if len(current) >= p.spec.replicas and all(w.phase is WorkerPhase.SUCCEEDED for w in current):
            self._finish(p, Phase.SUCCEEDED, COMPLETED, step=p.status.attempt.observed_step)
            return True
        return False

    def _preemption(self, p: _Pass, current: list[WorkerObservation]) -> _Preemption | None:
        """The evidence that the attempt's capacity is going away, strongest first, or None."""
        by_name = {w.name: w for w in current}
        by_node = {w.node: w for w in current if w.node is not None}
        heard: list[tuple[Signal, WorkerObservation]] = []
        for s in p.signals:
            w = by_name.get(s.worker) if s.worker is not None else by_node.get(s.node or "")
            if not s.kind.is_preemption or w is None:
                # Advisory, or for a node this attempt does not use (stale, or another job's).
                self._debug(p, "ignoring %s: %s", s.describe(), "advisory" if w else "not a node of this attempt")
                continue
            heard.append((s, w))
        if heard:
            deadlines = [s.deadline for s, _ in heard if s.deadline is not None]
            if deadlines:
                deadline: datetime | None = min(deadlines)
            elif p.spec.notice_seconds is not None:
                deadline = p.now + timedelta(seconds=p.spec.notice_seconds)
            else:
                deadline = None
            # A notice (taint, queue message, DisruptionTarget, ...) is a spot interruption: the
            # capacity goes away and a flush can still run. A node already gone is said as such.
            why = NODE_LOST if all(s.kind is SignalKind.NODE_LOST for s, _ in heard) else SPOT_INTERRUPTED
            return _Preemption(
                why,
                why.message(signal="; ".join(s.describe() for s, _ in heard)),
                _nodes(w for _, w in heard),
                deadline,
                heard_by_controller=True,
                signals=tuple(s for s, _ in heard),
            )

        for code, reason in ((EXIT_PREEMPTED, AGENT_PREEMPTED), (EXIT_FLUSH_FAILED, AGENT_FLUSH_FAILED)):
            exited = [w for w in current if w.exit_code == code]
            if exited:
                first = exited[0]
                return _Preemption(
                    reason, reason.message(worker=first.name, node=first.node), _nodes(exited), None, False
                )

        # No exit code, or stopped through its API by someone else. A stop beside a peer whose code
        # failed (or whose agent met an infrastructure error) is this controller's own stop of the
        # healthy workers, seen again after its status write was lost: that failure decides.
        broken = any(_is_failure(w) or w.exit_code == EXIT_INFRA_ERROR for w in current)
        gone = (None,) if broken else (None, EXIT_STOPPED)
        lost: list[_Placed] = [w for w in current if w.phase is WorkerPhase.FAILED and w.exit_code in gone]
        missing = p.seen - set(by_name)
        if missing:
            # A listing can miss a worker for a moment (a cache resync): ask again before believing it.
            again = self._backend.list_workers(p.key, p.spec)
            missing -= {w.name for w in again}
            if not missing:
                p.workers = again
            lost += [w for w in p.status.workers if w.name in missing]
        if lost:
            first_lost = lost[0]
            message = WORKER_LOST.message(worker=first_lost.name, node=first_lost.node)
            return _Preemption(WORKER_LOST, message, _nodes(lost), None, heard_by_controller=False)
        return None

    def _enter_flushing(self, p: _Pass, preemption: _Preemption) -> None:
        status = p.status
        self._close_recovery(p)
        baseline = (
            p.checkpoint_step
            if preemption.heard_by_controller and p.storage_error is None
            else p.previous_checkpoint_step
        )
        status.recovery = RecoveryStatus(
            cause=Cause.PREEMPTION,
            reason=preemption.reason.name,
            message=preemption.message,
            detected_at=p.now,
            preempted=preemption.nodes,
            flush_deadline=preemption.deadline,
            flush_timeout_at=p.now + timedelta(seconds=p.spec.flush_timeout_seconds),
            baseline_step=baseline,
            flush_failed=[w.name for w in p.current() if w.exit_code == EXIT_FLUSH_FAILED],
        )
        status.preemptions += 1
        if status.capacity is CapacityType.FALLBACK and not self._fallback_served(p):
            status.fallback_since = None  # the preemption-free period starts again
        self._set_phase(p, Phase.FLUSHING, preemption.reason.name, preemption.message)
        self._condition(p, READY, False, preemption.reason.name, preemption.message)
        self._condition(p, FLUSHING, True, preemption.reason.name, preemption.message)
        self._event(p, preemption.reason, message=preemption.message, node=preemption.nodes[0].node)
        p.metrics.append(methodcaller("preemption"))
        for s in preemption.signals:
            p.metrics.append(methodcaller("signal", str(s.kind), s.source))

    def _flushing(self, p: _Pass) -> float | None:
        recovery = p.status.recovery
        assert recovery is not None, "Flushing without a recovery"
        self._note_more_preempted(p, recovery)
        current = p.current()
        for w in current:
            if w.exit_code == EXIT_FLUSH_FAILED and w.name not in recovery.flush_failed:
                recovery.flush_failed.append(w.name)
                self._event(p, FLUSH_FAILED, worker=w.name)

        running = [w for w in current if w.phase is WorkerPhase.RUNNING]
        baseline = f"step {recovery.baseline_step}" if recovery.baseline_step is not None else "nothing"
        step = p.checkpoint_step
        if (
            step is not None
            and (recovery.baseline_step is None or step > recovery.baseline_step)
            and p.checkpoint_is_flush
        ):
            assert p.status.last_checkpoint is not None
            # A quick flush commits before the pass after the request: take the answers of the
            # requests still in flight first (none is sent anew), so that none goes untold.
            self._ask_to_flush(p, recovery, running, in_flight_only=True)
            self._enter_rescheduling(
                p,
                FLUSH_COMMITTED,
                step=step,
                uri=p.status.last_checkpoint.uri,
                seconds=(p.now - recovery.detected_at).total_seconds(),
            )
            return None
        if not running:
            self._enter_rescheduling(p, WORKERS_EXITED, baseline=baseline, resume=p.resume_point())
            return None
        assert recovery.flush_timeout_at is not None
        if p.now >= recovery.flush_timeout_at:
            self._enter_rescheduling(
                p, FLUSH_TIMED_OUT, baseline=baseline, timeout=p.spec.flush_timeout_seconds, resume=p.resume_point()
            )
            return None
        self._ask_to_flush(p, recovery, running)
        until_timeout = (recovery.flush_timeout_at - p.now).total_seconds()
        return min(self._options.flushing_poll_seconds, until_timeout)

    def _ask_to_flush(
        self, p: _Pass, recovery: RecoveryStatus, running: list[WorkerObservation], *, in_flight_only: bool = False
    ) -> None:
        """Ask every running worker's agent that has not accepted yet (``in_flight_only``: only
        those whose request is in flight, to take their answers); tell the answers that came."""
        asked = []
        with self._lock:
            in_flight = self._flush_in_flight.setdefault(p.key, set())
        for w in running:
            if w.name in recovery.flush_requested:
                continue  # accepted: an agent is never asked twice
            if in_flight_only and w.name not in in_flight:
                continue
            try:
                answer = self._backend.request_flush(p.key, p.spec, w, recovery.message, recovery.flush_deadline)
            except BackendError as e:
                answer = FlushRequestState.failed(str(e))
            if answer.outcome is FlushRequestOutcome.PENDING:
                in_flight.add(w.name)
                continue  # in flight: asked again next pass
            in_flight.discard(w.name)
            p.metrics.append(methodcaller("flush_request", str(answer.outcome)))
            if answer.outcome is FlushRequestOutcome.FAILED:
                # Retried next pass; the timeout bounds how long an unreachable agent holds us.
                self._event(p, FLUSH_REQUEST_FAILED, worker=w.name, error=answer.error, node=w.node)
                continue
            recovery.flush_requested.append(w.name)
            asked.append(w.name)
        if asked:
            deadline = recovery.flush_deadline.isoformat() if recovery.flush_deadline else "no deadline"
            self._event(p, FLUSH_REQUESTED, count=len(asked), deadline=deadline, workers=", ".join(asked))

    def _note_more_preempted(self, p: _Pass, recovery: RecoveryStatus) -> None:
        """Notices for other nodes of the gang while it flushes: avoid those nodes too."""
        known = {n.node for n in recovery.preempted}
        by_node = {w.node: w for w in p.current() if w.node is not None}
        for s in p.signals:
            w = by_node.get(s.node or "")
            if s.kind.is_preemption and w is not None and w.node not in known:
                recovery.preempted += _nodes([w])
                known.add(w.node)
                p.metrics.append(methodcaller("signal", str(s.kind), s.source))
                if recovery.cause is Cause.REQUESTED:
                    # A requested flush overtaken by the capacity going away: a preemption after all.
                    recovery.cause = Cause.PREEMPTION
                    p.status.preemptions += 1
                    p.metrics.append(methodcaller("preemption"))

    def _on_failure(self, p: _Pass, worker: WorkerObservation) -> None:
        """The user's code failed: restart within the budget, or fail the job."""
        spec, status = p.spec, p.status
        self._close_recovery(p)
        if status.restarts >= spec.max_restarts:
            self._finish(
                p,
                Phase.FAILED,
                RESTART_BUDGET_EXHAUSTED,
                worker=worker.name,
                code=worker.exit_code,
                max_restarts=spec.max_restarts,
                detail=_detail(worker),
            )
            return
        status.restarts += 1
        message = WORKER_FAILED.message(
            worker=worker.name,
            code=worker.exit_code,
            restarts=status.restarts,
            max_restarts=spec.max_restarts,
            detail=_detail(worker),
        )
        status.recovery = RecoveryStatus(
            cause=Cause.FAILURE, reason=WORKER_FAILED.name, message=message, detected_at=p.now
        )
        self._event(p, WORKER_FAILED, message=message)
        self._enter_rescheduling(p, None)

    def _on_infra_error(self, p: _Pass, worker: WorkerObservation) -> None:
        """An agent exited 74: restart the gang after the infrastructure backoff, budget untouched."""
        status = p.status
        self._close_recovery(p)
        message = WORKER_INFRA_ERROR.message(worker=worker.name, node=worker.node, code=worker.exit_code)
        status.recovery = RecoveryStatus(
            cause=Cause.INFRASTRUCTURE, reason=WORKER_INFRA_ERROR.name, message=message, detected_at=p.now
        )
        self._event(p, WORKER_INFRA_ERROR, message=message)
        self._enter_rescheduling(p, None)

    def _enter_rescheduling(self, p: _Pass, why: Reason | None, **fields: object) -> None:
        """Stop the gang, remember where not to go, and set the next attempt's backoff.

        ``why`` ends the flush (FlushCommitted, WorkersExited, FlushTimedOut); None after a failure.
        """
        spec, status = p.spec, p.status
        recovery = status.recovery
        assert recovery is not None, "Rescheduling without a recovery"
        if why is not None:
            message = why.message(**fields)
            self._condition(p, FLUSHING, False, why.name, message)
            self._event(p, why, message=message)
            if status.start_time is not None:
                status.flushing_seconds += (p.now - recovery.detected_at).total_seconds()
            if why is FLUSH_COMMITTED and recovery.cause is Cause.PREEMPTION:
                seconds = (p.now - recovery.detected_at).total_seconds()
                p.metrics.append(methodcaller("notice_to_commit", seconds))

        stopped = status.attempt
        with self._lock:
            self._flush_in_flight.pop(p.key, None)
        recovery.last_step = stopped.observed_step
        recovery.step_rate = stopped.step_rate()
        recovery.stopped_at = p.now
        p.stop_flush = _stop_with_flush(status)
        status.restart_history.append(
            RestartRecord(
                time=p.now,
                attempt=stopped.number,
                cause=recovery.cause,
                reason=recovery.reason,
                message=recovery.message,
            )
        )
        del status.restart_history[:-MAX_RESTART_HISTORY]
        p.metrics.append(methodcaller("restart", recovery.cause.value.lower()))

        if recovery.cause is Cause.PREEMPTION:
            self._avoid(p, recovery)
        backoff = spec.restart_backoff
        if recovery.cause is Cause.CAPACITY:
            delay = 0.0  # other capacity: nothing to wait for, and no restart in a row is counted
        elif recovery.cause is Cause.REQUESTED:
            delay = backoff.initial_seconds  # asked for: not a restart in a row either
        else:
            ran = (p.now - stopped.running_at).total_seconds() if stopped.running_at is not None else 0.0
            status.consecutive_restarts = 1 if ran >= backoff.reset_after_seconds else status.consecutive_restarts + 1
            step, resumed = p.checkpoint_step, stopped.resumed_from_step
            # A preempted attempt that committed progress is no loop, and the next one goes to
            # other capacity: waiting would only lose time. One that committed nothing past its
            # start (nodes taken away as fast as they come) backs off.
            progressed = recovery.cause is Cause.PREEMPTION and step is not None and (resumed is None or step > resumed)
            delay = (
                0.0
                if progressed
                else min(backoff.max_seconds, backoff.initial_seconds * 2 ** (status.consecutive_restarts - 1))
            )
        if recovery.cause is Cause.INFRASTRUCTURE:
            delay = self._options.infra_delay(status.consecutive_restarts)
        self._end_requested_flush(p, why)
        recovery.restart_at = p.now + timedelta(seconds=delay)
        status.attempt = AttemptStatus(number=stopped.number + 1)

        message = RESCHEDULED.message(
            attempt=stopped.number,
            cause=recovery.reason,
            next=status.attempt.number,
            delay=delay,
            avoid=self._placement(status).describe(),
        )
        self._set_phase(p, Phase.RESCHEDULING, RESCHEDULED.name, message)
        self._condition(p, READY, False, RESCHEDULED.name, message)
        self._event(p, RESCHEDULED, message=message)

    def _avoid(self, p: _Pass, recovery: RecoveryStatus) -> None:
        cooldown = p.spec.cooldown
        until = p.now + timedelta(seconds=cooldown.seconds)
        wanted: list[tuple[AvoidKind, str | None, bool]] = []
        for n in recovery.preempted:
            wanted += [
                ("node", n.node, cooldown.avoid_node),
                ("zone", n.zone, cooldown.avoid_zone),
                ("instanceType", n.instance_type, cooldown.avoid_instance_type),
            ]
        for kind, value, enabled in wanted:
            if not enabled or value is None or cooldown.seconds <= 0:
                continue
            p.status.avoid = [a for a in p.status.avoid if (a.kind, a.value) != (kind, value)]
            p.status.avoid.append(Avoidance(kind=kind, value=value, until=until, reason=recovery.reason))

    def _count_lost_steps(self, p: _Pass, recovery: RecoveryStatus) -> None:
        """Steps the stopped attempt trained that no committed checkpoint holds, at this restart."""
        if recovery.last_step is None:
            return
        lost = max(0, recovery.last_step - (p.checkpoint_step or 0))
        if recovery.cause is Cause.PREEMPTION:
            p.status.lost_steps += lost
        if lost:
            p.metrics.append(methodcaller("lost_steps", lost))
        if lost and recovery.step_rate and p.status.start_time is not None:
            p.status.retraining_seconds += lost / recovery.step_rate

    def _enter_running(self, p: _Pass) -> None:
        status = p.status
        self._close_recovery(p)
        status.attempt.running_at = p.now
        if status.start_time is None:
            status.start_time = p.now
        if status.capacity is CapacityType.FALLBACK and status.fallback_since is None:
            status.fallback_since = p.now
        stuck = status.condition(CAPACITY)
        if stuck is not None and stuck.status == "True":
            self._condition(
                p,
                CAPACITY,
                False,
                CAPACITY_FOUND.name,
                CAPACITY_FOUND.message(attempt=status.attempt.number, capacity=status.capacity),
            )
        message = WORKERS_RUNNING.message(attempt=status.attempt.number)
        self._set_phase(p, Phase.RUNNING, WORKERS_RUNNING.name, message)
        self._condition(p, READY, True, WORKERS_RUNNING.name, message)
        self._event(p, WORKERS_RUNNING, message=message)

    def _close_recovery(self, p: _Pass) -> None:
        """The recovery in progress ends (the attempt runs, or fails or is preempted while starting)."""
        recovery = p.status.recovery
        if recovery is None:
            return
        if recovery.stopped_at is not None and p.status.start_time is not None:
            p.status.restarting_seconds += (p.now - recovery.stopped_at).total_seconds()
        p.status.recovery = None

    def _finish(self, p: _Pass, phase: Phase, why: Reason, **fields: object) -> None:
        status = p.status
        message = why.message(**fields)
        if phase is Phase.FAILED:
            # Without a flush: the job failed (its code, or its checkpoint URI); nothing to save.
            p.stop_flush = False
        if status.recovery is not None and status.recovery.stopped_at is None:
            self._condition(p, FLUSHING, False, why.name, message)
        self._close_recovery(p)
        status.completion_time = p.now
        self._set_phase(p, phase, why.name, message)
        self._condition(p, READY, False, why.name, message)
        self._event(p, why, message=message)

    # -- capacity ----------------------------------------------------------------------------
    def _effective_spec(self, p: _Pass) -> JobSpec:
        """The spec the attempt's workers are built from: with ``spec.fallback`` merged in on the
        fallback capacity."""
        return p.spec.on_fallback() if p.status.capacity is CapacityType.FALLBACK else p.spec

    def _check_capacity(self, p: _Pass) -> float | None:
        """An attempt whose workers stay unschedulable past ``startTimeoutSeconds``: say so
        (``CapacityUnavailable``) and, with a fallback not in use yet, stop it and start the next
        attempt there. None when the phase changed; else how long until the timeout matters."""
        spec, status = p.spec, p.status
        timeout = spec.start_timeout_seconds
        started = status.attempt.started_at
        if timeout is None or started is None:
            return math.inf
        left = (started + timedelta(seconds=timeout) - p.now).total_seconds()
        if left > 0:
            return left
        stuck = [w for w in p.current() if w.phase is WorkerPhase.PENDING and w.unschedulable]
        if not stuck:
            return math.inf  # placed and starting (an image pull, a restore): not a matter of capacity
        on_fallback = status.capacity is CapacityType.FALLBACK
        falls_back = spec.fallback is not None and not on_fallback
        if falls_back:
            then = "the next attempt uses spec.fallback"
        elif on_fallback:
            then = "already on the fallback capacity: waiting for it"
        else:
            then = "waiting for capacity (the spec has no fallback)"
        message = CAPACITY_UNAVAILABLE.message(
            workers=", ".join(w.name for w in stuck), timeout=timeout, why=stuck[0].unschedulable, then=then
        )
        before = status.condition(CAPACITY)
        if before is None or before.status != "True":
            self._event(p, CAPACITY_UNAVAILABLE, message=message)
        self._condition(p, CAPACITY, True, CAPACITY_UNAVAILABLE.name, message)
        if not falls_back:
            return self._options.starting_poll_seconds
        self._close_recovery(p)
        status.capacity, status.fallback_since = CapacityType.FALLBACK, None
        status.recovery = RecoveryStatus(
            cause=Cause.CAPACITY, reason=CAPACITY_UNAVAILABLE.name, message=message, detected_at=p.now
        )
        self._enter_rescheduling(p, None)
        return None

    def _fallback_served(self, p: _Pass) -> bool:
        """The job has run ``fallback.returnAfterSeconds`` on the fallback without a preemption."""
        since, fallback = p.status.fallback_since, p.spec.fallback
        return (
            since is not None
            and fallback is not None
            and (p.now - since).total_seconds() >= fallback.return_after_seconds
        )

    def _maybe_return_to_spot(self, p: _Pass) -> None:
        """(before an attempt starts) After ``fallback.returnAfterSeconds`` on the fallback without a
        preemption, the job's own capacity gets the next attempt, whatever restarted it."""
        spec, status = p.spec, p.status
        if status.capacity is not CapacityType.FALLBACK:
            return
        since = status.fallback_since
        if spec.fallback is not None:
            if since is None or not self._fallback_served(p):
                return
            ran = (p.now - since).total_seconds()
            self._event(
                p,
                RETURNING_TO_SPOT,
                seconds=ran,
                period=spec.fallback.return_after_seconds,
                attempt=status.attempt.number,
            )
        status.capacity, status.fallback_since = CapacityType.SPOT, None

    # -- flush requests (spotjob.dev/flush-request) ---------------------------------------------
    def _note_flush_request(self, p: _Pass) -> None:
        """Every pass: a checkpoint request in progress ends when storage shows its commit, when
        the gang stops, or at the flush timeout; a new request that cannot be read, or that comes
        while the job cannot take it, is answered at once. Each id is handled once: the status
        records the last one; a request written while another is in progress waits for it to end."""
        status = p.status
        last = status.last_flush_request
        if last is not None and last.outcome == "InProgress" and last.mode == "checkpoint":
            self._progress_checkpoint_request(p, last)
        rid = p.flush_request_id
        if rid is None or (last is not None and last.id == rid):
            return
        if last is not None and last.outcome == "InProgress":
            # Answered once that one ends: recording it now would write over the request in
            # progress, whose outcome would then never be told.
            return
        if p.flush_request_problem is not None:
            message = FLUSH_REQUEST_INVALID.message(problem=p.flush_request_problem)
            status.last_flush_request = FlushRequestStatus(id=rid, outcome="Invalid", message=message, time=p.now)
            self._event(p, FLUSH_REQUEST_INVALID, message=message)
            return
        request = p.flush_request
        assert request is not None, "a request id without a request"
        if status.phase is Phase.RUNNING:
            return  # taken by _running, after the pass has looked at the workers
        if status.phase is Phase.FLUSHING and status.recovery is not None:
            why = f"the job is flushing already ({status.recovery.reason}): that flush commits a checkpoint"
        else:
            why = f"the job is {status.phase}: no running gang to flush"
        message = FLUSH_REQUEST_SKIPPED.message(id=request.id, mode=request.mode, why=why)
        status.last_flush_request = self._request_status(p, request, "Skipped", message)
        self._event(p, FLUSH_REQUEST_SKIPPED, message=message)

    def _take_flush_request(self, p: _Pass) -> bool:
        """(Running) Take a new request: ``restart`` flushes the gang and restarts it (True: the
        phase changed); ``checkpoint`` asks every agent for a save and training goes on."""
        request, status = p.flush_request, p.status
        last = status.last_flush_request
        if request is None or (last is not None and (last.id == request.id or last.outcome == "InProgress")):
            return False
        because = f": {request.reason}" if request.reason else ""
        baseline = p.checkpoint_step if p.storage_error is None else p.previous_checkpoint_step
        if request.mode == "checkpoint":
            message = CHECKPOINT_REQUESTED_BY_USER.message(
                id=request.id, reason=because, count=len([w for w in p.current() if w.phase is WorkerPhase.RUNNING])
            )
            status.last_flush_request = self._request_status(p, request, "InProgress", message, baseline=baseline)
            self._event(p, CHECKPOINT_REQUESTED_BY_USER, message=message)
            self._ask_for_saves(p, status.last_flush_request)
            return False
        message = FLUSH_REQUESTED_BY_USER.message(id=request.id, reason=because)
        status.last_flush_request = self._request_status(p, request, "InProgress", message, baseline=baseline)
        self._close_recovery(p)
        # Like a preemption's flush (every agent flushes at one step, the gang restarts from the
        # commit), but nothing is counted as a preemption or a restart, and no node is avoided.
        status.recovery = RecoveryStatus(
            cause=Cause.REQUESTED,
            reason=FLUSH_REQUESTED_BY_USER.name,
            message=message,
            detected_at=p.now,
            flush_timeout_at=p.now + timedelta(seconds=p.spec.flush_timeout_seconds),
            baseline_step=baseline,
        )
        self._set_phase(p, Phase.FLUSHING, FLUSH_REQUESTED_BY_USER.name, message)
        self._condition(p, READY, False, FLUSH_REQUESTED_BY_USER.name, message)
        self._condition(p, FLUSHING, True, FLUSH_REQUESTED_BY_USER.name, message)
        self._event(p, FLUSH_REQUESTED_BY_USER, message=message)
        return True

    def _checkpoint_request_in_progress(self, p: _Pass) -> bool:
        """(Running) Ask the agents not yet asked for the request's save; True while it is in progress."""
        last = p.status.last_flush_request
        if last is None or last.outcome != "InProgress" or last.mode != "checkpoint":
            return False
        self._ask_for_saves(p, last)
        return True

    def _ask_for_saves(self, p: _Pass, request: FlushRequestStatus) -> None:
        reason = f"flush request {request.id} (checkpoint)"
        for w in p.current():
            if w.phase is not WorkerPhase.RUNNING or w.name in request.save_requested:
                continue
            try:
                answer = self._backend.request_save(p.key, p.spec, w, request.id, reason)
            except BackendError as e:
                answer = FlushRequestState.failed(str(e))
            if answer.outcome is FlushRequestOutcome.PENDING:
                continue  # in flight: asked again next pass
            if answer.outcome is FlushRequestOutcome.FAILED:
                self._event(p, SAVE_REQUEST_FAILED, worker=w.name, error=answer.error, node=w.node)
                continue
            request.save_requested.append(w.name)

    def _progress_checkpoint_request(self, p: _Pass, request: FlushRequestStatus) -> None:
        """The first valid checkpoint committed after the request was taken up ends it (its own
        early save, or any save that committed since: a checkpoint no older than the request)."""
        step = p.checkpoint_step
        manifest = p.checkpoint.manifest if p.checkpoint is not None else None
        newer = step is not None and (request.baseline_step is None or step > request.baseline_step)
        after = (
            manifest is None
            or manifest.trigger == "early"
            or (request.started_at is not None and manifest.created_at >= request.started_at)
        )
        mode = request.mode or "checkpoint"
        if newer and after:
            message = FLUSH_REQUEST_COMMITTED.message(id=request.id, mode=mode, step=step)
            self._end_request(p, request, "Committed", message, FLUSH_REQUEST_COMMITTED, step=step)
            return
        timeout_at = (request.started_at or p.now) + timedelta(seconds=p.spec.flush_timeout_seconds)
        if p.status.phase is not Phase.RUNNING:
            why = f"the gang stopped ({p.status.reason}) before a checkpoint for it committed"
        elif p.now >= timeout_at:
            since = f"step {request.baseline_step}" if request.baseline_step is not None else "nothing"
            why = f"nothing newer than {since} committed within {p.spec.flush_timeout_seconds:.0f}s"
        else:
            return
        message = FLUSH_REQUEST_NOT_COMMITTED.message(id=request.id, mode=mode, why=why)
        self._end_request(p, request, "NotCommitted", message, FLUSH_REQUEST_NOT_COMMITTED)

    def _end_requested_flush(self, p: _Pass, why: Reason | None) -> None:
        """(entering Rescheduling after a requested restart) How the request's flush ended."""
        request = p.status.last_flush_request
        if request is None or request.outcome != "InProgress" or request.mode != "restart":
            return
        mode = request.mode
        if why is FLUSH_COMMITTED:
            step = p.checkpoint_step
            message = FLUSH_REQUEST_COMMITTED.message(id=request.id, mode=mode, step=step)
            self._end_request(p, request, "Committed", message, FLUSH_REQUEST_COMMITTED, step=step)
            return
        reason = why.name if why is not None else "stopped"
        message = FLUSH_REQUEST_NOT_COMMITTED.message(
            id=request.id, mode=mode, why=f"{reason}: the gang restarts from {p.resume_point()}"
        )
        self._end_request(p, request, "NotCommitted", message, FLUSH_REQUEST_NOT_COMMITTED)

    def _end_request(
        self,
        p: _Pass,
        request: FlushRequestStatus,
        outcome: FlushRequestOutcomeName,
        message: str,
        why: Reason,
        *,
        step: int | None = None,
    ) -> None:
        request.outcome, request.message, request.step, request.time = outcome, message, step, p.now
        self._event(p, why, message=message)

    def _request_status(
        self,
        p: _Pass,
        request: FlushRequest,
        outcome: FlushRequestOutcomeName,
        message: str,
        *,
        baseline: int | None = None,
    ) -> FlushRequestStatus:
        return FlushRequestStatus(
            id=request.id,
            mode=request.mode,
            outcome=outcome,
            message=message,
            time=p.now,
            requested_at=request.requested_at,
            started_at=p.now,
            baseline_step=baseline,
        )

    # -- infrastructure health ---------------------------------------------------------------
    def _note_health(self, p: _Pass) -> None:
        status = p.status
        if p.storage_error is not None:
            reason = STORAGE_UNREACHABLE if isinstance(p.storage_error, TransientStorageError) else STORAGE_REFUSED
            uri = p.checkpoint_uri or p.spec.checkpoint.uri
            self._degraded(p, reason, uri=uri, error=p.storage_error)
        elif p.signals_error is not None:
            self._degraded(p, BACKEND_UNAVAILABLE, error=p.signals_error)
        elif status.recovery is not None and status.recovery.cause is Cause.INFRASTRUCTURE:
            # Degraded until the next attempt runs (its event was logged when the worker exited).
            status.infra_errors = 0
            self._condition(p, DEGRADED, True, WORKER_INFRA_ERROR.name, status.recovery.message)
        else:
            status.infra_errors = 0
            before = status.condition(DEGRADED)
            message = HEALTHY.message()
            if before is not None and before.status == "True":
                self._event(p, HEALTHY, message=message)
            self._condition(p, DEGRADED, False, HEALTHY.name, message)

    def _degraded(self, p: _Pass, why: Reason, **fields: object) -> None:
        """An infrastructure error: shown, retried with backoff, never a phase change or a budget."""
        message = why.message(**fields)
        tries = p.status.infra_errors
        self._condition(p, DEGRADED, True, why.name, f"{message} ({tries} pass(es) in a row)")
        # The count stays out of the event, so that repeats coalesce into one event's count.
        self._event(p, why, message=message)

    # -- status helpers ------------------------------------------------------------------------
    def _placement(self, status: JobStatus) -> Placement:
        def values(kind: str) -> frozenset[str]:
            return frozenset(a.value for a in status.avoid if a.kind == kind)

        return Placement(values("node"), values("zone"), values("instanceType"))

    def _record_workers(self, p: _Pass) -> None:
        p.status.workers = [
            WorkerStatus(
                name=w.name,
                node=w.node,
                zone=w.zone,
                instance_type=w.instance_type,
                phase=w.phase,
                exit_code=w.exit_code,
                step=w.step,
            )
            for w in sorted(p.current(), key=lambda w: w.index)
        ]

    def _account(self, p: _Pass) -> None:
        """Recompute goodput (defined on ``JobStatus``), counting a recovery in progress up to now."""
        status = p.status
        if status.start_time is None:
            status.goodput = None
            return
        end = status.completion_time or p.now
        wall = (end - status.start_time).total_seconds()
        lost = status.flushing_seconds + status.restarting_seconds + status.retraining_seconds
        recovery = status.recovery
        if recovery is not None:
            # Flushing counts from the notice; once stopped, the flush is in flushing_seconds already.
            lost += (p.now - (recovery.stopped_at or recovery.detected_at)).total_seconds()
        status.goodput = round(min(1.0, max(0.0, (wall - lost) / wall)), 4) if wall > 0 else None

    def _set_phase(self, p: _Pass, phase: Phase, reason: str, message: str) -> None:
        if phase is not p.status.phase:
            log.info("job %s [%s] -> %s (%s): %s", p.key, p.status.phase, phase, reason, message)
        p.status.phase, p.status.reason, p.status.message = phase, reason, message

    def _condition(self, p: _Pass, type_: str, value: bool, reason: str, message: str) -> None:
        text: ConditionStatus = "True" if value else "False"
        existing = p.status.condition(type_)
        if existing is None:
            p.status.conditions.append(
                Condition(type=type_, status=text, reason=reason, message=message, last_transition_time=p.now)
            )
            return
        if existing.status != text:
            existing.status, existing.last_transition_time = text, p.now
        existing.reason, existing.message = reason, message

    def _event(
        self, p: _Pass, why: Reason, *, message: str | None = None, node: str | None = None, **fields: object
    ) -> None:
        """Queue an Event of this pass; ``_commit`` emits it once the status is written."""
        text = message if message is not None else why.message(**fields)
        kind = EventType.WARNING if why.warning else EventType.NORMAL
        p.events.append(_Event(kind, why.name, text, node))

    def _debug(self, p: _Pass, message: str, *args: object) -> None:
        log.debug("job %s [%s]: " + message, p.key, p.status.phase, *args)


def job_identity(key: JobKey) -> str:
    """Who owns a job's checkpoint URI and numbers its attempts in storage (``agent.ownership``):
    ``namespace/name``.

    The name the backends give the agents as ``--job-name`` (``SPOTJOB_JOB_NAME``), so that the
    workers' Checkpointer and the controller are one owner.
    """
    return str(key)


def _stop_with_flush(status: JobStatus) -> bool:
    """Whether stopping the gang now may flush: not after a failure of the user's code or an
    infrastructure error, when the healthy ranks would wait for their dead peers."""
    recovery = status.recovery
    return recovery is None or recovery.cause in (Cause.PREEMPTION, Cause.REQUESTED)


def _status_unreadable(stored: StoredJob) -> bool:
    """The stored status exists but does not validate (``StoredJob.invalid`` names ``status.``)."""
    return stored.invalid is not None and any(part.startswith("status") for part in stored.invalid.split("; "))


_VOLATILE_ATTEMPT = {"observed_step", "observed_step_at"}


def _significant(status: JobStatus) -> dict[str, object]:
    """The status without the numbers that move without a decision (goodput, step hints): what a
    status write is needed for."""
    return status.model_dump(
        exclude={"goodput": True, "attempt": _VOLATILE_ATTEMPT, "workers": {"__all__": {"step"}}},
    )


_PLACEHOLDER_SPEC = JobSpec(command=["-"], checkpoint=CheckpointSpec(uri="-"))
"""Stands for the spec of a job whose stored spec does not validate: only ``_invalid`` sees it."""


def _is_failure(w: WorkerObservation) -> bool:
    """A non-zero exit of the user's code: anything but 0 and the agent's own codes."""
    return w.exit_code is not None and w.exit_code not in (
        0,
        EXIT_PREEMPTED,
        EXIT_FLUSH_FAILED,
        EXIT_INFRA_ERROR,
        EXIT_STOPPED,
    )


def _detail(w: WorkerObservation) -> str:
    """``: <why>`` when the backend could tell why the worker failed, else nothing."""
    return f": {w.detail}" if w.detail else ""


def _nodes(workers: Iterable[_Placed]) -> list[NodeRef]:
    """Where these workers ran, each place once."""
    out: list[NodeRef] = []
    for w in workers:
        ref = NodeRef(node=w.node, zone=w.zone, instance_type=w.instance_type)
        if ref not in out:
            out.append(ref)
    return out
