"""``Reconciler``: one pass for one job, and what only the pass as a whole does.

Each pass observes (the backend's workers and signals, the newest valid checkpoint in storage),
runs the phase handlers until one waits, writes the status once, then emits Events and metrics
(see the package docstring). The concerns it joins are the layers below it (``_requests``,
``_recovery``, ``_capacity``); what is left here: validity, ownership and fencing, starting an
attempt, infrastructure health and goodput.

Ownership and fencing (``agent.ownership``): the first pass that reaches the job's storage claims
the URI for the job (``job_identity``: ``namespace/name``, the same string the agents get as their
job name); a URI another job owns fails the job at once, naming the owner and the remedy (a
transient storage error does not: it is retried like any other). Before an attempt's workers start,
the attempt is recorded in storage with its fence (the newest valid checkpoint, what it resumes
from), create-only and replay-safe; an attempt that cannot be recorded does not start. A job whose
storage holds records of a newer attempt, or of its own attempt's number written before the job was
created (a job deleted and created again under its name), numbers its next attempt past them.
``latest_valid`` never counts a foreign or fenced checkpoint, so a stale
worker's commit can neither end a flush nor be resumed.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from datetime import datetime, timedelta
from operator import methodcaller

from agent.catalog import CheckpointStatus, MisplacedUriError, latest_valid
from agent.ownership import FencedError, OwnershipError, claim, newest_attempt, read_attempt, record_attempt
from agent.settings import unknown_variables
from agent.storage import (
    NotFoundError,
    PermanentStorageError,
    Storage,
    StorageError,
    TransientStorageError,
    open_storage,
)
from orchestrator.backends.base import Backend, BackendError, WorkerObservation
from orchestrator.events import NULL_METRICS, EventSink, EventType, JobMetrics, LoggingEventSink
from orchestrator.model import (
    Cause,
    CheckpointInfo,
    HeldNotice,
    JobKey,
    JobSpec,
    JobStatus,
    NotStarting,
    Phase,
    UnusableCheckpoint,
    WorkerPhase,
    WorkerStatus,
    job_name_problem,
)
from orchestrator.reconciler._base import log
from orchestrator.reconciler._capacity import _Capacity
from orchestrator.reconciler._pass import (
    _PLACEHOLDER_SPEC,
    BeforeStop,
    Clock,
    ReconcileResult,
    ReconcilerOptions,
    SystemClock,
    _Event,
    _Pass,
    _significant,
    _status_unreadable,
    _stop_with_flush,
    job_identity,
)
from orchestrator.reconciler._reasons import (
    ATTEMPT_RENUMBERED,
    BACKEND_UNAVAILABLE,
    CHECKPOINT_UNUSABLE,
    CHECKPOINT_URI_OWNED,
    DEGRADED,
    FALLBACK_NULLS_DROPPED,
    HEALTHY,
    INVALID,
    INVALID_CHECKPOINT_URI,
    INVALID_SPEC,
    INVALID_STATUS,
    NAME_REMEDY,
    NOTICE_HELD,
    READY,
    SPEC_CHANGE_IGNORED,
    SPEC_REMEDY,
    SPEC_VALID,
    STORAGE_REFUSED,
    STORAGE_REFUSED_FAILED,
    STORAGE_UNREACHABLE,
    UNKNOWN_VARIABLES,
    WORKER_INFRA_ERROR,
    WORKER_NOT_STARTING,
    WORKERS_STARTED,
    Reason,
)
from orchestrator.store import ConflictError, JobNotFoundError, JobStore, StoredJob

UNSCHEDULABLE_WARNING_AFTER = 600.0
"""Seconds a worker waits for a node before ``WorkerNotStarting`` warns about it (without
``startTimeoutSeconds``): longer than an autoscaler takes to bring up a node, spot GPUs included."""


class Reconciler(_Capacity):
    """Drives jobs, one pass for one job at a time, through the state machine of the package docstring.

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
        self._uris: dict[JobKey, str] = {}
        """The checkpoint URI each job's passes opened: its store is closed once no job uses it."""
        self._claimed: set[tuple[str, str]] = set()
        """(URI, job identity) pairs this reconciler has claimed: once per process is enough."""
        self._written_at: dict[JobKey, float] = {}
        """When this reconciler last wrote each job's status (monotonic): the refresh of volatile numbers."""
        self._held_written: dict[JobKey, tuple[str, list[HeldNotice] | None]] = {}
        """The ``heldNotices`` this reconciler last wrote for each job, and the version its write
        made. An API server serving a CRD older than the field drops it, so the stored status never
        has it: compared with the stored one alone, every pass would write the status again and
        tell the Event again. Trusted only while the job is still at that version."""
        self._skipped: dict[JobKey, set[tuple[str, str]]] = {}
        """(folder, why) of the checkpoints each job's passes skipped and said so: once each, not
        every pass (a fenced or retired folder stays newest for as long as the job runs)."""
        self._flush_in_flight: dict[JobKey, set[str]] = {}
        """Workers whose flush request was sent and not answered yet (their answer is told even if
        the commit shows first); per job, this process only."""
        self._flush_clock: dict[JobKey, tuple[datetime, datetime, float]] = {}
        """(the recovery's detectedAt, this process's wall and monotonic clocks when it first saw it)
        per job: what a flush timeout is measured with (``_flush_now``)."""
        self._asker_wait: dict[JobKey, tuple[int, float]] = {}
        """(attempt, this process's monotonic clock) when a pass first saw only peers' exit 75 of
        that attempt (``_Recovery._awaits_asker``): how long the agent that asked is waited for."""
        self._handlers: dict[Phase, Callable[[_Pass], float | None]] = {
            Phase.PENDING: self._bring_up,
            Phase.RUNNING: self._running,
            Phase.FLUSHING: self._flushing,
            Phase.RESCHEDULING: self._bring_up,
        }

    def reconcile(self, key: JobKey) -> ReconcileResult:
        """One pass for job ``key``: observe, decide, act, write the status if it changed, then tell.

        A job gone from the store is forgotten (``JobMetrics.job_deleted``) and answers
        ``ReconcileResult(None, None)``; one being deleted (``StoredJob.deleting``) is left alone:
        no attempt, no stop, no status write. A status write that conflicts (the job changed since it
        was read) answers a requeue of 0 and tells nothing. Raises ``StoreError`` if the store
        fails; backend and storage errors are retried (``_recovery``, failure classes).
        """
        started = self._clock.monotonic()
        stored = self.store.get(key)
        if stored is None:
            self._forget(key)
            return ReconcileResult(None, None)
        if stored.deleting:
            # Its pods go with it (the garbage collector's work, or kept: --cascade=orphan). A pass
            # that took their deletion for a lost worker would start the next attempt, whose pods a
            # foreground deletion then waits for in turn.
            log.info("job %s is being deleted: no pass, its workers are left to the garbage collector", key)
            return ReconcileResult(stored.status.phase if stored.status else None, None)
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
            answered = self._answer_ended_request(key, stored, before, now, started)
            if answered is not None:
                return answered
            if before.observed_generation is not None and stored.generation != before.observed_generation:
                return self._note_ended_spec_change(key, stored, before)
            self._tell_state(key, stored, before)  # a new leader exports ended jobs too
            return self._stop_leftovers(key, stored, before)

        problems = self._problems(key, stored, before)
        if problems is not None or stored.spec is None:
            p = _Pass(key, stored.spec or _PLACEHOLDER_SPEC, before.model_copy(deep=True), now, None, set())
            self._invalid(p, problems or stored.invalid or "the spec is invalid", stored.generation)
            return self._commit(p, stored, before, fresh, None, started)

        p = self._new_pass(key, stored.spec, before, now)
        if p.status.checkpoint_uri is None:
            p.status.checkpoint_uri = stored.spec.checkpoint.uri  # from now on, the job's store for good
        p.flush_request, p.flush_request_id = stored.flush_request, stored.flush_request_id
        p.version, p.job_created = stored.version, stored.created_at
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
        if before.observed_generation != stored.generation:
            self._warn_unknown_variables(p)
            if stored.lost_nulls:
                self._event(p, FALLBACK_NULLS_DROPPED, paths=", ".join(stored.lost_nulls))
        p.status.observed_generation = stored.generation
        self._account(p)
        return self._commit(p, stored, before, fresh, requeue, started)

    def _answer_ended_request(
        self, key: JobKey, stored: StoredJob, before: JobStatus, now: datetime, started: float
    ) -> ReconcileResult | None:
        """A flush request written on a finished job is answered (``Skipped``: no running gang to
        flush, or ``Invalid``) and told once, like one a Pending job gets: a tool waiting on
        ``lastFlushRequest`` would otherwise wait for good. None when there is nothing to answer;
        else the next pass (requeued at once) does the rest of an ended job's pass."""
        last, rid = before.last_flush_request, stored.flush_request_id
        if rid is None or (last is not None and last.handled(rid)):
            return None
        p = _Pass(key, stored.spec or _PLACEHOLDER_SPEC, before.model_copy(deep=True), now, None, set())
        p.flush_request, p.flush_request_id = stored.flush_request, rid
        p.flush_request_problem = stored.flush_request_problem
        self._note_flush_request(p)
        if p.status == before:
            return None  # waits for a request still in progress (ended with the job, on its next pass)
        result = self._commit(p, stored, before, False, None, started)
        return ReconcileResult(result.phase, 0.0)

    def _note_ended_spec_change(self, key: JobKey, stored: StoredJob, before: JobStatus) -> ReconcileResult:
        """A finished job's spec was edited: nothing runs again, but the status says the new
        generation was seen. Tools that wait on ``observedGeneration`` (kstatus: Argo CD, Flux,
        ``kubectl wait``) would otherwise show the job as in progress for as long as it is kept."""
        status = before.model_copy(update={"observed_generation": stored.generation})
        try:
            self.store.update_status(key, status, version=stored.version)
        except ConflictError as e:
            log.info("job %s [%s]: status changed under this pass (%s); re-reading", key, before.phase, e)
            return ReconcileResult(before.phase, 0.0)
        self._tell_state(key, stored, status)
        self._events.emit(
            key,
            EventType.NORMAL,
            SPEC_CHANGE_IGNORED.name,
            SPEC_CHANGE_IGNORED.message(generation=stored.generation, phase=before.phase.value),
        )
        return ReconcileResult(before.phase, 0.0)

    def _stop_leftovers(self, key: JobKey, stored: StoredJob, status: JobStatus) -> ReconcileResult:
        """A Failed job's workers are stopped (without a flush) until none is alive, and a finished
        job's exited workers that still hold their node (a sidecar) until none does: the pass that
        decided the end stops them after its write, and this finishes a stop that failed. Workers
        that exited and hold no node are kept (their pods stay for ``kubectl logs``)."""
        if status.phase not in (Phase.FAILED, Phase.SUCCEEDED) or stored.spec is None:
            return ReconcileResult(status.phase, None)
        try:
            alive = [w for w in self._backend.list_workers(key, stored.spec) if w.phase.alive or w.holds_node]
            if alive:
                self._backend.stop_workers(key, stored.spec, flush=False, keep_exited=True)
        except BackendError as e:
            log.warning("job %s [%s]: cannot stop its workers yet (%s)", key, status.phase, e)
            return ReconcileResult(status.phase, self._options.infra_delay(1))
        return ReconcileResult(status.phase, self._options.stopping_poll_seconds if alive else None)

    def driver_stopped(
        self,
        key: JobKey,
        *,
        reason: str,
        message: str,
        warning: bool = False,
        since: datetime | None = None,
        before_stop: BeforeStop | None = None,
    ) -> JobStatus | None:
        """One pass after the process that drives ``key`` stopped every worker of it on purpose (an
        interrupted ``spotjob run``: it had their agents flush, then stopped them all): ``reason``
        and ``message`` say how, an Event (a Warning if ``warning``); ``since``: when it asked them
        to flush; ``before_stop``: what it saw before it stopped anything. The exits the stop caused
        (75, 76, none) are no preemption: they would read as one on any other pass, and a later
        pass, finding the workers gone, as a lost gang.

        Every worker of the attempt exited 0 first: the job Succeeded (``Completed``), as any pass
        decides. Otherwise a flush under way ends (FlushCommitted or WorkersExited, counted as what
        began it); a notice for a node of the attempt that the driver heard before it stopped
        anything (``before_stop.signals``) is the preemption it was, its flush ended as the stop
        left it; a worker whose own code failed before the stop (``before_stop.failed``) is that
        failure (a restart of ``maxRestarts``, or the job Failed once they are used); else a
        started attempt ends as a requested restart (cause ``Requested``, the restart's reason
        ``reason``: no preemption or restart counted, no node avoided). The job is then
        Rescheduling, with ``reason`` and ``message`` for its own, and the next attempt starts from
        the newest valid checkpoint once the job is driven again. The pass tells ``reason`` first,
        unless the job ended. Storage is not read again when ``before_stop`` holds a read made once
        nothing was left to commit (``newest``).

        Returns the status after the pass (the one stored when the job had ended already); None
        when there is none to take (the job gone, its spec or status unreadable), the backend
        failed, or the write conflicted three times: then nothing was told."""
        for _ in range(3):
            started = self._clock.monotonic()
            stored = self.store.get(key)
            if stored is None or stored.spec is None or stored.status is None or stored.deleting:
                return None
            before = stored.status
            if before.phase.terminal:
                return before
            p = self._new_pass(key, stored.spec, before, self._clock.now())
            p.version, p.driver_stopped = stored.version, True
            seen = before_stop or BeforeStop()
            try:
                self._observe(p, known=seen.newest)
            except BackendError as e:
                log.warning("job %s: cannot look at its workers after its driver stopped them: %s", key, e)
                return None
            self._after_driver_stop(p, reason, message, since, seen)
            if not p.status.phase.terminal:
                self._set_phase(p, p.status.phase, reason, message)
                kind = EventType.WARNING if warning else EventType.NORMAL
                p.events.insert(0, _Event(kind, reason, message, None))
            self._record_workers(p)
            self._account(p)
            p.stop_flush = None  # every process of the job is stopped already
            if self._commit(p, stored, before, False, None, started).requeue_after is None:
                return p.status
            # requeue 0: the status changed under this pass; decide again from the new one
        return None

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
        written_held = self._held_notices_written(key, stored.version)
        if written_held is not None and status.held_notices == written_held:
            before = before.model_copy(update={"held_notices": status.held_notices})  # dropped by an older CRD
        changed = fresh or _significant(status) != _significant(before)
        due = status != before and (
            self._clock.monotonic() - self._written_at.get(key, -math.inf) >= self._options.status_refresh_seconds
        )
        if changed or due:
            try:
                written = self.store.update_status(key, status, version=stored.version)
            except ConflictError as e:
                log.info("job %s [%s]: status changed under this pass (%s); re-reading", key, before.phase, e)
                return ReconcileResult(before.phase, 0.0)
            except JobNotFoundError:
                # Deleted after this pass read it: its pods going (the garbage collector's work) looked
                # like lost workers. Not a reconcile error (counted, alerted on): nothing to do.
                log.info(
                    "job %s was deleted during this pass: what it decided is dropped "
                    "(nothing written, stopped or told)",
                    key,
                )
                self._forget(key)
                return ReconcileResult(None, None)
            with self._lock:
                self._written_at[key] = self._clock.monotonic()
                self._held_written[key] = (written.version, status.held_notices)
            if status.goodput is not None:
                p.metrics.append(methodcaller("goodput", key.namespace, key.name, status.goodput))
        # The status as stored: this pass's when written, else the one read (the numbers a pass
        # does not write are not claimed).
        max_restarts = stored.spec.max_restarts if stored.spec is not None else None
        told = status if changed or due else before
        p.metrics.append(methodcaller("job_state", key.namespace, key.name, told, max_restarts))
        # Act on a decision only once it is written: a pass whose write is lost stopped nothing, so
        # the next pass sees what this one saw (a failed worker's exit code, not a vanished gang).
        if p.stop_flush is not None:
            try:
                # A job that ended keeps its exited workers (their pods, for kubectl logs).
                self._backend.stop_workers(key, p.spec, flush=p.stop_flush, keep_exited=status.phase.terminal)
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

    def _tell_state(self, key: JobKey, stored: StoredJob, status: JobStatus) -> None:
        """``JobMetrics.job_state`` of a pass that writes nothing more (an ended job)."""
        try:
            self._metrics.job_state(
                key.namespace, key.name, status, stored.spec.max_restarts if stored.spec is not None else None
            )
        except Exception:  # a metric is a courtesy
            log.exception("job %s: recording a metric failed", key)

    def _forget(self, key: JobKey) -> None:
        identity = job_identity(key)
        unused: Storage | None = None
        with self._lock:
            self._written_at.pop(key, None)
            self._held_written.pop(key, None)
            self._flush_in_flight.pop(key, None)
            self._flush_clock.pop(key, None)
            self._asker_wait.pop(key, None)
            self._skipped.pop(key, None)
            self._claimed = {c for c in self._claimed if c[1] != identity}
            uri = self._uris.pop(key, None)
            if uri is not None and uri not in self._uris.values():
                unused = self._storages.pop(uri, None)
        if unused is not None:
            # An S3 or GCS store holds a client and its connections: one per job ever served, else.
            try:
                unused.close()
            except Exception:
                log.exception("job %s: closing its checkpoint store failed", key)
        try:
            self._metrics.job_deleted(key.namespace, key.name)
        except Exception:
            log.exception("job %s: forgetting its metrics failed", key)

    # -- validity ----------------------------------------------------------------------------
    def _problems(self, key: JobKey, stored: StoredJob, status: JobStatus) -> str | None:
        """Why the job cannot run as stored (naming the fields), or None."""
        problems: list[str] = []
        name = job_name_problem(key.name)
        if name is not None:
            problems.append(f"metadata.name: {name}")
        if stored.spec is None:
            problems.append(stored.invalid or "spec: does not validate")
        else:
            recorded = status.checkpoint_uri
            if recorded is not None and stored.spec.checkpoint.uri != recorded:
                # The CRD's CEL rule refuses this change; an API server without CEL lets it through.
                # Resuming from another store, or starting fresh there, would lose what was committed.
                problems.append(
                    f"spec.checkpoint.uri: changed from {recorded!r} to {stored.spec.checkpoint.uri!r}, but the "
                    f"job's checkpoints are in {recorded!r} (status.checkpointUri) and the URI is immutable: set it "
                    "back, or create a new SpotJob for the new location"
                )
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
        # A name the controller refuses stays refused: only a job created under another name runs.
        remedy = NAME_REMEDY if job_name_problem(p.key.name) is not None else SPEC_REMEDY
        message = INVALID_SPEC.message(problems=problems, remedy=remedy)
        self._condition(p, INVALID, True, INVALID_SPEC.name, message)
        if p.status.phase is Phase.PENDING:
            # No worker runs: the phase's reason is why (`kubectl get sj -o wide`, `kubectl spotjob
            # status`), not "Created: waiting for the first pass" of a job never looked at.
            self._set_phase(p, Phase.PENDING, INVALID_SPEC.name, message)
        p.status.observed_generation = generation
        self._event(p, INVALID_SPEC, message=message)

    def _warn_unknown_variables(self, p: _Pass) -> None:
        """An ``UnknownVariables`` warning for each ``SPOTJOB_*`` name of ``spec.env`` no part of
        spotjob reads (``SPOTJOB_AGENT_PREFTECH``): the agent would log it in each worker and run on
        without it, which nobody reads. A warning, not ``Invalid``: the job runs as the variable were
        not there, and a variable a newer image's agent reads stays usable under an older controller."""
        unknown = unknown_variables(p.spec.env)
        if unknown:
            self._event(p, UNKNOWN_VARIABLES, variables="; ".join(unknown))

    def _valid(self, p: _Pass) -> None:
        """Clear a past Invalid condition (the spec was fixed); no condition at all for a job never invalid."""
        c = p.status.condition(INVALID)
        if c is not None and c.status == "True":
            self._condition(p, INVALID, False, SPEC_VALID.name, SPEC_VALID.message())
            if p.status.reason == INVALID_SPEC.name:  # this pass set no reason of its own
                self._set_phase(p, p.status.phase, SPEC_VALID.name, SPEC_VALID.message())
            self._event(p, SPEC_VALID)

    # -- observe ---------------------------------------------------------------------------
    def _new_pass(self, key: JobKey, spec: JobSpec, before: JobStatus, now: datetime) -> _Pass:
        status = before.model_copy(deep=True)
        self._distrust_the_future(key, spec, status, now)
        return _Pass(
            key=key,
            spec=spec,
            status=status,
            now=now,
            previous_checkpoint_step=status.last_checkpoint.step if status.last_checkpoint else None,
            seen={w.name for w in status.workers},
        )

    def _distrust_the_future(self, key: JobKey, spec: JobSpec, status: JobStatus, now: datetime) -> None:
        """Bring the status's times back within what this pass's clock allows.

        A status written by a controller whose wall clock ran ahead (an old leader on a skewed
        node) holds times in the future: a backoff that would hold the restart for hours, a flush
        timeout that would never come, negative flushing seconds. What was noticed happened by now
        at the latest; a deadline is at most the spec's own duration away (so that lowering the
        duration in the spec also takes effect on the wait in progress)."""
        moved: list[str] = []

        def at_most(name: str, when: datetime | None, limit: datetime) -> datetime | None:
            if when is None or when <= limit:
                return when
            moved.append(f"{name} {when.isoformat()}")
            return limit

        attempt, recovery = status.attempt, status.recovery
        status.start_time = at_most("startTime", status.start_time, now)
        status.fallback_since = at_most("fallbackSince", status.fallback_since, now)
        attempt.started_at = at_most("attempt.startedAt", attempt.started_at, now)
        attempt.running_at = at_most("attempt.runningAt", attempt.running_at, now)
        if attempt.not_starting is not None:
            attempt.not_starting.since = at_most("attempt.notStarting.since", attempt.not_starting.since, now) or now
        if recovery is not None:
            recovery.detected_at = at_most("recovery.detectedAt", recovery.detected_at, now) or now
            recovery.stopped_at = at_most("recovery.stoppedAt", recovery.stopped_at, now)
            flush_timeout = now + timedelta(seconds=spec.flush_timeout_seconds)
            recovery.flush_timeout_at = at_most("recovery.flushTimeoutAt", recovery.flush_timeout_at, flush_timeout)
            longest = max(spec.restart_backoff.max_seconds, self._options.infra_backoff_max_seconds)
            recovery.restart_at = at_most("recovery.restartAt", recovery.restart_at, now + timedelta(seconds=longest))
        request = status.last_flush_request
        if request is not None and request.outcome == "InProgress":
            request.started_at = at_most("lastFlushRequest.startedAt", request.started_at, now)
        cooldown_end = now + timedelta(seconds=spec.cooldown.seconds)
        for avoided in status.avoid:
            avoided.until = at_most(f"avoid[{avoided.value}].until", avoided.until, cooldown_end) or cooldown_end
        if moved:
            log.warning(
                "job %s [%s]: the status holds times past what this controller's clock (%s) and the spec allow, "
                "written by a controller whose clock ran ahead or under an older spec: %s; brought back",
                key,
                status.phase,
                now.isoformat(),
                ", ".join(moved),
            )

    def _observe(self, p: _Pass, known: tuple[CheckpointStatus | None] | None = None) -> None:
        """Look at the workers, the signals and storage. ``known``: the newest valid checkpoint,
        read already by the caller once nothing was left to commit one (storage is not listed)."""
        spec, status = p.spec, p.status
        p.workers = self._backend.list_workers(p.key, spec)
        try:
            p.signals = self._backend.signals(p.key, spec)
        except BackendError as e:
            # Exits and lost workers still reveal preemptions; carry on without notices.
            p.signals_error = e
        try:
            storage = self._storage(p.key, spec.checkpoint.uri)
        except ValueError as e:
            p.invalid_uri = str(e)
            return
        except StorageError as e:
            # The store could not even be opened (no Google credentials, an AWS profile that does
            # not exist): judged as any refusal or outage of storage, not a crash of the pass.
            p.storage_error = e
        else:
            p.checkpoint_uri = storage.url()
            p.storage = storage
            try:
                self._claim(p, storage)
                if p.owned_by_another is None and known is not None:
                    p.checkpoint = known[0]
                elif p.owned_by_another is None and p.invalid_uri is None:
                    p.checkpoint = latest_valid(
                        storage, on_skip=lambda skipped: self._note_skipped(p, storage, skipped)
                    )
                if p.owned_by_another is None and p.invalid_uri is None:
                    self._pass_over_unusable(p, storage)
            except StorageError as e:
                p.storage_error = e
        if p.storage is not None and p.checkpoint is not None and p.checkpoint.manifest is not None:
            status.last_checkpoint = CheckpointInfo(
                step=p.checkpoint.ref.step,
                uri=p.storage.url(p.checkpoint.ref.folder),
                time=p.checkpoint.manifest.created_at,
            )
        elif p.storage_error is None and p.owned_by_another is None:
            # Storage answered and holds none (a fresh start retired them, the URI was emptied):
            # the status must not name one the next attempt cannot resume from.
            status.last_checkpoint = None
        self._tell_a_lost_newest(p)
        if p.storage_error is not None or p.signals_error is not None:
            status.infra_errors += 1
        status.avoid = [a for a in status.avoid if a.until > p.now]
        self._track_steps(p)

    def _pass_over_unusable(self, p: _Pass, storage: Storage) -> None:
        """The checkpoint the attempt was started from looked valid here (sizes only: no byte of it is
        read) and the ranks passed over it as they restored (a damaged byte, found by its CRC32C):
        their agents say so (``WorkerObservation.restored``). Remembered in
        ``status.unusableCheckpoint``, it is passed over here too while it is storage's newest, so
        that ``lastCheckpoint`` and the next attempts name what the ranks restore; told once, with the
        steps it lost."""
        status, attempt = p.status, p.status.attempt
        said = [w.restored for w in p.current() if w.restored is not None]
        if said and attempt.restored_step is None and attempt.started_at is not None:
            step, why = min(said, key=lambda r: r[0])
            attempt.restored_step = step
            recorded = attempt.resumed_from_step
            newest = p.checkpoint
            if recorded is not None and step < recorded:
                if newest is not None and newest.ref.step == recorded and newest.manifest is not None:
                    status.unusable_checkpoint = UnusableCheckpoint(
                        step=recorded,
                        uri=storage.url(newest.ref.folder),
                        time=newest.manifest.created_at,
                        reason=why or "the ranks did not say why",
                        restored_step=step,
                    )
                self._tell_passed_over(p, recorded, step, why)
        unusable = status.unusable_checkpoint
        if unusable is None:
            return
        if not (
            p.checkpoint is not None
            and p.checkpoint.manifest is not None
            and storage.url(p.checkpoint.ref.folder) == unusable.uri
            and p.checkpoint.manifest.created_at == unusable.time
        ):
            status.unusable_checkpoint = None  # a newer one committed, or it is gone: nothing to pass over
            return
        # Older ones the ranks passed over too (each damaged alike) down to the one they restored; not
        # one committed after the damaged one was (the attempt trains on from the step restored and
        # saves below it: those are its progress, which a flush's commit and the next attempt need).
        while (
            p.checkpoint is not None
            and p.checkpoint.ref.step > unusable.restored_step
            and (p.checkpoint.manifest is None or p.checkpoint.manifest.created_at <= unusable.time)
        ):
            p.checkpoint = latest_valid(
                storage, before=p.checkpoint.ref, on_skip=lambda skipped: self._note_skipped(p, storage, skipped)
            )

    def _tell_passed_over(self, p: _Pass, recorded: int, step: int, why: str | None) -> None:
        """The CheckpointUnusable Warning for a checkpoint the ranks passed over, and the steps it lost:
        trained again from ``step``, as after a preemption."""
        p.passed_over_told = True
        lost = recorded - step
        p.status.lost_steps += lost
        p.metrics.append(methodcaller("lost_steps", lost))
        problem = f"did not load as the ranks restored ({why})" if why else "did not load as the ranks restored"
        self._event(
            p,
            CHECKPOINT_UNUSABLE,
            recorded=recorded,
            problem=f"{problem}; the {lost} step(s) after step {step} are trained again",
            resume=f"step {step}" if step else "scratch",
        )

    def _tell_a_lost_newest(self, p: _Pass) -> None:
        """A Warning when storage's newest usable checkpoint is older than the one the status had
        recorded (a file of it damaged, the folder deleted, retired by a fresh start): the status
        goes back with it, and the Events said the job would resume from the recorded step, where
        its next attempt then started from an older one, or from scratch, without a word."""
        before = p.previous_checkpoint_step
        if before is None or p.storage is None or p.storage_error is not None or p.owned_by_another is not None:
            return
        if p.passed_over_told:  # told already, with the ranks' reason
            return
        if p.checkpoint_step is not None and p.checkpoint_step >= before:
            return
        reason = next((s.reason for s in p.skipped if s.ref.step == before and s.reason), None)
        why = f"does not load ({reason})" if reason else "is no longer in storage as one the job can resume from"
        uri = p.storage.url()
        self._event(
            p,
            CHECKPOINT_UNUSABLE,
            recorded=before,
            problem=f"{why}; `spotjob ckpt list {uri}` says why of each",
            resume=p.resume_point(),
        )

    def _note_skipped(self, p: _Pass, storage: Storage, skipped: CheckpointStatus) -> None:
        """Say once per job why a checkpoint is not the one it resumes from (a folder without a
        manifest, as likely a save in progress, only at debug level)."""
        if skipped.committed:
            p.skipped.append(skipped)
        if skipped.newer_format and p.newer_format is None:  # newest first: the first is the newest
            p.newer_format = skipped.ref
        said = (skipped.ref.folder, skipped.reason)
        with self._lock:
            known = self._skipped.setdefault(p.key, set())
            first = said not in known
            known.add(said)
        if first and skipped.committed:
            log.warning("job %s: skipping checkpoint %s: %s", p.key, storage.url(skipped.ref.folder), skipped.reason)
        else:
            log.debug("job %s: skipping checkpoint %s: %s", p.key, storage.url(skipped.ref.folder), skipped.reason)

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
        except MisplacedUriError as e:
            # A checkpoint's own folder, or the folder above other jobs' URIs: the workers'
            # Checkpointers would refuse it (CheckpointUriError) on every attempt.
            p.invalid_uri = f"spec.checkpoint.uri: {e}"
            return
        with self._lock:
            self._claimed.add(claimed)

    def _storage(self, key: JobKey, uri: str) -> Storage:
        """The store of ``uri``, opened once and shared by the jobs that use it (``key`` among them)."""
        with self._lock:
            storage = self._storages.get(uri)
            if storage is not None:
                self._uris[key] = uri
                return storage
        opened = self._storage_factory(uri)
        with self._lock:
            storage = self._storages.setdefault(uri, opened)
            self._uris[key] = uri
        if storage is not opened:
            opened.close()  # another pass opened it meanwhile
        return storage

    def _track_steps(self, p: _Pass) -> None:
        """Follow the attempt's step hints: the highest one, and the first one for the step rate.

        The attempt trained at least to the newest step it committed. The hints are sampled (and
        reach a SpotJob's status once a minute), so without that floor the status could say the
        job trains at step 16 next to a checkpoint of step 50, and a job that ended name its first
        hint as the last step seen."""
        attempt, last = p.status.attempt, p.status.last_checkpoint
        steps = [w.step for w in p.current() if w.step is not None]
        if (
            last is not None
            and attempt.started_at is not None
            and (attempt.resumed_from_step is None or last.step > attempt.resumed_from_step)
        ):
            steps.append(last.step)  # committed by this attempt
        if not steps:
            return
        step = max(steps)
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
            if p.asker_awaited:
                return self._options.flushing_poll_seconds
            current = p.current()
            if len(current) >= p.replicas and all(w.phase is WorkerPhase.RUNNING for w in current):
                self._enter_running(p)
                return None
            self._note_not_starting(p, current)
            capacity_wait = self._check_capacity(p)
            if capacity_wait is None:
                return None
            # Idempotent: a backend may create the attempt's workers over several passes (a
            # rendezvous address known only once the first one runs).
            placement = self._placement(status, p.spec.cooldown.seconds)
            self._backend.start_workers(p.key, self._effective_spec(p), attempt.number, placement)
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
        placement = self._placement(status, p.spec.cooldown.seconds)
        self._backend.start_workers(p.key, self._effective_spec(p), attempt.number, placement)
        attempt.started_at = p.now
        attempt.replicas = spec.replicas
        attempt.resumed_from_step = p.checkpoint_step
        if recovery is not None:
            self._count_lost_steps(p, recovery)
        message = WORKERS_STARTED.message(
            replicas=spec.replicas, attempt=attempt.number, resume=p.resume_point(), avoid=placement.describe()
        )
        if status.phase is Phase.PENDING:
            self._set_phase(p, Phase.PENDING, WORKERS_STARTED.name, message)
        elif status.phase is Phase.RESCHEDULING:
            # Still Rescheduling (with its reason) until every worker runs; its message said
            # "attempt N starts in 1s" for as long as the new workers waited for a node.
            status.message = message
        self._condition(p, READY, False, WORKERS_STARTED.name, message)
        self._event(p, WORKERS_STARTED, message=message)
        return self._options.starting_poll_seconds

    def _note_not_starting(self, p: _Pass, current: list[WorkerObservation]) -> None:
        """A worker of the started attempt that cannot start (an image it cannot pull, no node for it)
        goes into ``status.attempt.notStarting``; the Warning Event is told once per attempt.

        Waiting for a node is what an autoscaling cluster does on every restart, so an Unschedulable
        worker is warned about only once it waited ``UNSCHEDULABLE_WARNING_AFTER`` (and never with
        ``startTimeoutSeconds``: ``CapacityUnavailable`` tells it then); a reason that follows it
        (the node came, the image cannot be pulled) is warned about at once."""
        attempt = p.status.attempt
        for w in current:
            if w.phase is not WorkerPhase.PENDING:
                continue
            why = w.not_starting or (("Unschedulable", w.unschedulable) if w.unschedulable else None)
            if why is None:
                continue
            reason, message = why
            before = attempt.not_starting
            if before is None or (before.worker, before.reason) != (w.name, reason):
                attempt.not_starting = NotStarting(
                    worker=w.name,
                    reason=reason,
                    message=message,
                    since=before.since if before else p.now,
                    warned=before.warned if before else False,
                )
            stuck = attempt.not_starting
            assert stuck is not None
            if stuck.warned:
                return
            if reason == "Unschedulable":
                waited = (p.now - stuck.since).total_seconds()
                if p.spec.start_timeout_seconds is not None or waited < UNSCHEDULABLE_WARNING_AFTER:
                    return
                message = f"{message} (for {waited / 60:.0f} min)" if message else f"for {waited / 60:.0f} min"
            stuck.warned = True
            self._event(
                p,
                WORKER_NOT_STARTING,
                node=w.node,
                worker=w.name,
                attempt=attempt.number,
                reason=reason,
                detail=f": {message}" if message else "",
            )
            return

    def _record_attempt(self, p: _Pass) -> bool:
        """Record the attempt about to start, fenced at the newest valid checkpoint, or at a newer
        spotjob's checkpoint above it (see the module docstring); False (and Degraded) when storage
        cannot take the record."""
        attempt, storage, job = p.status.attempt, p.storage, job_identity(p.key)
        assert storage is not None, "starting an attempt without storage"
        fence = p.checkpoint.ref if p.checkpoint is not None else None
        if p.newer_format is not None and (fence is None or fence < p.newer_format):
            # A newer spotjob's checkpoint (the workers' image is newer than this controller): fenced
            # below it, the upgraded workers would judge it a stale attempt's and go back past it.
            fence = p.newer_format
        try:
            recorded = newest_attempt(storage, job)
            if recorded is not None and (
                recorded > attempt.number
                or (recorded == attempt.number and self._recorded_by_an_earlier_job(p, storage, recorded))
            ):
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

    def _recorded_by_an_earlier_job(self, p: _Pass, storage: Storage, attempt: int) -> bool:
        """Whether the record of ``attempt``, this job's attempt about to start, is an earlier job's
        of this name (one deleted and created again: its workers may live on, unfenced, if the new
        one took its number) rather than this job's own (a pass whose status write was lost, a
        controller restarted, recording it again): it was written before this job was created. A
        record that cannot be read cannot say whose it is: numbered past, a restart at worst."""
        if p.job_created is None:
            return False  # a store that does not say when the job was created
        try:
            record = read_attempt(storage, job_identity(p.key), attempt)
        except NotFoundError:
            return False
        except ValueError as e:
            self._debug(p, "attempt %d's record cannot say whose it is (%s): numbering past it", attempt, e)
            return True
        return record.recorded_at < p.job_created

    def _renumber(self, p: _Pass, recorded: int) -> None:
        p.status.attempt.number = recorded + 1
        self._event(p, ATTEMPT_RENUMBERED, recorded=recorded, attempt=p.status.attempt.number)

    def _running(self, p: _Pass) -> float | None:
        if self._watch(p):
            return None
        if p.asker_awaited:
            # No flush request is taken meanwhile: it would make the preemption a restart asked for.
            return self._options.flushing_poll_seconds
        if self._take_flush_request(p):
            return None
        if self._checkpoint_request_in_progress(p):
            return self._options.flushing_poll_seconds
        return self._options.running_poll_seconds

    # -- infrastructure health ---------------------------------------------------------------
    def _note_health(self, p: _Pass) -> None:
        status = p.status
        if p.storage_error is not None:
            reason = STORAGE_UNREACHABLE if isinstance(p.storage_error, TransientStorageError) else STORAGE_REFUSED
            uri = p.checkpoint_uri or p.spec.checkpoint.uri
            if status.phase.terminal:
                # The job ended in this pass (a refusal before anything started fails it): nothing is
                # retried now, so the condition says what storage answered, not what waits on a fix.
                said = f"storage at {uri} answered: {p.storage_error}; the job has ended, nothing is retried"
                self._condition(p, DEGRADED, True, reason.name, said)
            else:
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
        self._record_held_notices(p)

    def _held_notices_written(self, key: JobKey, version: str) -> list[HeldNotice] | None:
        """The held notices this reconciler's last write of the job had, while the job is still at
        the version that write made (nobody wrote since: what is stored is that status, less what
        an older CRD dropped); else None."""
        with self._lock:
            at, held = self._held_written.get(key, ("", None))
        return held if at == version else None

    def _record_held_notices(self, p: _Pass) -> None:
        """The notices the current attempt's agents hold, from their last reports; an Event for each
        one not held before (or held to another deadline: the cloud moved it). Written with the
        status's other changes only when the set changes, never for a poll that says the same."""
        written = self._held_notices_written(p.key, p.version) or []
        before = {(h.worker, h.source, h.kind, h.deadline) for h in [*(p.status.held_notices or []), *written]}
        # A finished job is never observed again: the workers this pass stopped hold nothing.
        ended = p.status.phase.terminal
        held = [
            HeldNotice(
                worker=w.name,
                node=w.node,
                source=n.source,
                kind=n.kind,
                detail=n.detail,
                deadline=n.deadline,
                flush_at=n.flush_at,
                heard_at=n.heard_at,
            )
            for w in sorted(p.current(), key=lambda w: w.index)
            if not ended and (n := w.held_notice) is not None and w.phase is WorkerPhase.RUNNING
        ]
        if p.asker_awaited:
            # A peer that held a notice of its own exited with the others' flush: its node goes at
            # the notice's deadline all the same. Kept until the exit of the agent that asked for
            # the flush decides what is avoided (``_noticed_by_own_agent`` reads it then).
            peers = {w.name for w in p.current() if w.flushed_for_peer}
            held += [h for h in p.status.held_notices or () if h.worker in peers]
        # The next flush first: `kubectl get sj` shows heldNotices[0].flushAt (a printer column is
        # JSONPath only). Ties, and notices with no time (last), keep the workers' order.
        held.sort(key=_next_flush_first)
        p.status.held_notices = held or None
        for h in held:
            if (h.worker, h.source, h.kind, h.deadline) not in before:
                self._event(
                    p,
                    NOTICE_HELD,
                    node=h.node,
                    worker=h.worker,
                    where=h.node or "-",
                    source=h.source,
                    kind=h.kind,
                    detail=h.detail or "-",
                    deadline=_stamp(h.deadline),
                    flush_at=_stamp(h.flush_at),
                )

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


def _next_flush_first(held: HeldNotice) -> tuple[bool, float]:
    """Sorts held notices by when their flush starts (else their deadline); those with neither last."""
    when = held.flush_at or held.deadline
    return (when is None, when.timestamp() if when is not None else 0.0)


def _stamp(when: datetime | None) -> str:
    """A time in an Event's message: RFC 3339, UTC; "an unknown time" when the agent gave none."""
    return when.isoformat().replace("+00:00", "Z") if when is not None else "an unknown time"
