"""Preemptions and failures: Flushing, Rescheduling, and the end of a recovery.

Entering Rescheduling emits ``Rescheduled`` and appends the restart to ``status.restartHistory``
(time, stopped attempt, cause, reason, message; the newest 20). It stops the whole gang — with a
flush after a preemption, without one (``flush=False``: the agents' ``POST /stop``) after a failure
of the user's code or an infrastructure error, because the healthy ranks would wait for their dead
peers — waits until none of it is alive and the backoff has passed (none after a preemption whose
attempt committed progress), then starts the next attempt away from the preempted nodes (and zones /
instance types, if the spec says so, for ``cooldown.seconds``). While the attempt starts, every pass
calls ``start_workers`` again (it is idempotent: a backend may create its workers over several
passes).

Failure classes (docs/architecture.md, "Failure classes"): a *preemption* (any of the Flushing
reasons) never consumes ``maxRestarts``; a *failure of the user's code* (any other non-zero exit)
does; an *infrastructure error* (storage or backend unreachable) changes no phase and no budget: it
is retried with exponential backoff and shown in the Degraded condition. A *permanent* storage
refusal (``PermanentStorageError``: the bucket does not exist, access is denied) that keeps an
attempt from starting fails the job at once (``StorageRefused``, with the remedy): retrying cannot
help, and nothing runs that a failure would stop; while an attempt runs it is Degraded. A worker
whose agent exits 74 met one inside the job (storage unreachable during restore, its rendezvous port
taken): the gang is stopped and restarted as a new attempt after the infrastructure backoff, with
Degraded True (``WorkerInfraError``) until that attempt runs — no budget, no preemption count. An
agent exiting 79 was stopped through its API by someone else than this pass: like a vanished worker.
A worker that vanishes without a signal is a preemption: something outside the user's code took it
(a node reclaimed without notice, a deleted pod), as SkyPilot counts a lost cluster. When one
observation holds both, the preemption wins: a crash on a node that is going away is the notice's
doing. Exits while Flushing belong to the preemption too (peers of a stopped rank fail their
collectives). No attempt starts while storage is unreachable: its workers could not restore, and
their crash would look like the user's.

Guarding against false alarms (SkyPilot): a signal is acted on only if it names a node or worker of
the current attempt in this pass's fresh listing — a stale queue message, a notice for a node the
job has left, or for another job's node changes nothing; advisory signals (Rebalance) stop nothing;
a worker missing from the listing is declared lost only if a second listing agrees; exits 75 whose
agents all say they only flushed with another's (``PEER_FLUSH``) wait for the agent that asked, still
alive, to exit or be lost (at most ``flushTimeoutSeconds``): it names the node going away.

The flush is done when storage — the source of truth, never an agent's word — holds a valid manifest
written by the flush (``trigger: flush``; a periodic save that commits while the ranks are still
agreeing on the flush step does not count, unless every worker exited 75 after it: their flush found
its step committed by the script's own save and wrote nothing more) newer than the *baseline*: the
newest committed step read in the pass that heard a controller signal, or, when an agent acted on
its own (exit 75/76, lost), the step the status held before that pass (the agent may have committed
between two passes). Flush requests never block a pass: ``Backend.request_flush`` answers pending
until the agent answered; each pass asks again the running workers whose agent has not accepted, and
never asks an agent that accepted. The pass that sees the flush committed first takes the answers of
the requests still in flight (and sends none anew), so a quick flush's requests are told
(``FlushRequested``) all the same.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timedelta
from operator import methodcaller

from agent.catalog import MisplacedUriError
from agent.control_channel import EXIT_FLUSH_FAILED, EXIT_INFRA_ERROR, EXIT_PREEMPTED, EXIT_STOPPED
from agent.ownership import OwnershipError, claim
from agent.storage import StorageError
from orchestrator.backends.base import BackendError, FlushRequestOutcome, FlushRequestState, WorkerObservation
from orchestrator.events import FLUSH_OUTCOMES
from orchestrator.model import (
    MAX_RESTART_HISTORY,
    AttemptStatus,
    Avoidance,
    AvoidKind,
    CapacityType,
    Cause,
    HeldNotice,
    JobStatus,
    NodeRef,
    Phase,
    RecoveryStatus,
    RestartRecord,
    WorkerPhase,
    WorkerStatus,
)
from orchestrator.reconciler._pass import (
    BeforeStop,
    _detail,
    _fallback_served,
    _is_failure,
    _nodes,
    _Pass,
    _Placed,
    _Preemption,
    _stop_with_flush,
    job_identity,
)
from orchestrator.reconciler._reasons import (
    AGENT_FLUSH_FAILED,
    AGENT_PREEMPTED,
    CAPACITY,
    CAPACITY_FOUND,
    CHECKPOINT_URI_OWNED,
    COMPLETED,
    FLUSH_AFTER_NOTICE,
    FLUSH_AFTER_REQUEST,
    FLUSH_COMMITTED,
    FLUSH_FAILED,
    FLUSH_REQUEST_FAILED,
    FLUSH_REQUESTED,
    FLUSH_TIMED_OUT,
    FLUSH_UNWATCHED,
    FLUSHING,
    GANG_INCOMPLETE,
    NODE_LOST,
    READY,
    RESCHEDULED,
    RESCHEDULED_WHEN_DRIVEN,
    RESTART_BUDGET_EXHAUSTED,
    SPOT_INTERRUPTED,
    WORKER_FAILED,
    WORKER_INFRA_ERROR,
    WORKER_LOST,
    WORKERS_EXITED,
    WORKERS_RUNNING,
    Reason,
)
from orchestrator.reconciler._requests import _FlushRequests
from orchestrator.signals import Signal, SignalKind

_FLUSH_OUTCOME = dict(
    zip((FLUSH_COMMITTED.name, WORKERS_EXITED.name, FLUSH_TIMED_OUT.name), FLUSH_OUTCOMES, strict=True)
)
"""The reason that ends a flush, as ``JobMetrics.flush_ended`` names it."""


class _Recovery(_FlushRequests):
    """React to what the attempt's workers and the signals say; flush, stop and restart the gang."""

    def _watch(self, p: _Pass) -> bool:
        """React to what the current attempt's workers did; True if the phase changed."""
        current = p.current()
        preemption = self._preemption(p, current)
        if preemption is not None:
            p.asker_awaited = False  # other evidence decided (a 76, a worker lost)
            self._enter_flushing(p, preemption)
            return True
        if p.asker_awaited:
            # Its exit comes in a moment; a crash beside the peers' 75s is the preemption's doing
            # once it is seen, as on any pass.
            return False
        # Before failures: the peers of a worker that stopped for an infrastructure error fail too.
        infra = [w for w in current if w.exit_code == EXIT_INFRA_ERROR]
        if infra:
            self._on_infra_error(p, infra[0])
            return True
        failed = [w for w in current if _is_failure(w)]
        if failed:
            self._on_failure(p, failed[0])
            return True
        if p.gang_succeeded():
            self._finish(p, Phase.SUCCEEDED, COMPLETED, seen=_seen(p.status.attempt.observed_step))
            return True
        return False

    def _preemption(self, p: _Pass, current: list[WorkerObservation]) -> _Preemption | None:
        """The evidence that the attempt's capacity is going away, strongest first, or None."""
        by_name = {w.name: w for w in current}
        notice = self._noticed(p, current, p.signals)
        if notice is not None:
            return notice

        for code, reason in ((EXIT_PREEMPTED, AGENT_PREEMPTED), (EXIT_FLUSH_FAILED, AGENT_FLUSH_FAILED)):
            exited = [w for w in current if w.exit_code == code]
            if exited and code == EXIT_PREEMPTED and self._requested_restart_flushed(p):
                continue  # the agents flushed because a leader asked them to: the request takes it
            if exited and code == EXIT_PREEMPTED and self._awaits_asker(p, current, exited):
                p.asker_awaited = True
                continue
            if exited:
                first = _asker(exited)
                message = reason.message(worker=first.name, node=first.node, detail=_flush_detail(first))
                message += _answered(first) if code == EXIT_PREEMPTED else ""
                going = _noticed_by_own_agent(exited, p.status.held_notices)
                return _Preemption(reason, message, _nodes_named_first(first, going), None, False)

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
            message = WORKER_LOST.message(worker=first_lost.name, where=_where(first_lost))
            if isinstance(first_lost, WorkerObservation):
                message += _detail(first_lost)  # what the backend knows of why (a node lost, ...)
            return _Preemption(WORKER_LOST, message, _nodes(lost), None, heard_by_controller=False)
        return None

    def _awaits_asker(self, p: _Pass, current: list[WorkerObservation], exited: list[WorkerObservation]) -> bool:
        """Every agent that exited 75 says its ranks only flushed the step another node's agent asked
        for (``PEER_FLUSH``), while another worker of the attempt has not exited: the agent that
        asked is among those, on its way out (the flush committed), or lost (the loss, judged next,
        is then the preemption). Its exit line or its loss names the node going away; taken now,
        the peers' 75s would name a peer and leave that node out of the cool-down (a peer that held
        a notice of its own keeps its node avoided all the same: ``_record_held_notices`` keeps its
        notice meanwhile). Waited for up to ``flushTimeoutSeconds`` on this process's clock (an
        agent that hangs), then the peers' exits are taken as they are."""
        if not all(w.flushed_for_peer for w in exited):
            return False
        if any(w.exit_code is None and not w.phase.alive for w in current) or p.seen - {w.name for w in current}:
            return True  # a worker lost meanwhile, or missing from the listing: the loss decides
        if not any(w.phase.alive and w.exit_code is None for w in current):
            return False
        attempt, now = p.status.attempt.number, self._clock.monotonic()
        with self._lock:
            seen = self._asker_wait.get(p.key)
            if seen is None or seen[0] != attempt:
                seen = self._asker_wait[p.key] = (attempt, now)
        if now - seen[1] >= p.spec.flush_timeout_seconds:
            return False
        self._debug(p, "%s exited 75 flushing with another's: waiting for the agent that asked", exited[0].name)
        return True

    def _noticed(self, p: _Pass, current: list[WorkerObservation], signals: Sequence[Signal]) -> _Preemption | None:
        """The preemption ``signals`` announce for nodes (or workers) of ``current``, or None."""
        by_name = {w.name: w for w in current}
        by_node = {w.node: w for w in current if w.node is not None}
        heard: list[tuple[Signal, WorkerObservation]] = []
        for s in signals:
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
        return None

    def _requested_restart_flushed(self, p: _Pass) -> bool:
        """A restart request no status has taken up yet, and the gang's flush committed: a leader
        took the request and asked the agents, and its status write was lost. Their exit 75 is
        that request's doing, not a preemption (no node to avoid, nothing to count)."""
        request, last = p.flush_request, p.status.last_flush_request
        pending = request is not None and request.mode == "restart" and (last is None or not last.handled(request.id))
        return pending and p.status.phase is Phase.RUNNING and p.flushed_unrecorded

    def _enter_flushing(self, p: _Pass, preemption: _Preemption) -> None:
        status = p.status
        self._close_recovery(p)
        baseline = p.flush_baseline(heard_by_controller=preemption.heard_by_controller)
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
        self._flush_now(p, p.now)  # its timeout counts from now on this process's monotonic clock
        status.preemptions += 1
        if status.capacity is CapacityType.FALLBACK and not _fallback_served(p):
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
                self._event(p, FLUSH_FAILED, worker=w.name, detail=_flush_detail(w))

        if p.gang_succeeded():
            # The notice came as the training ended: every rank finished before it served the
            # flush, and every worker exited 0. The job is done; a new attempt would train its
            # last steps (or, with no checkpoint, all of them) again.
            with self._lock:
                self._flush_in_flight.pop(p.key, None)
                self._flush_clock.pop(p.key, None)
            if p.status.start_time is not None:
                p.status.flushing_seconds += (p.now - recovery.detected_at).total_seconds()
            self._finish(p, Phase.SUCCEEDED, COMPLETED, seen=_seen(p.status.attempt.observed_step))
            return None
        running = [w for w in current if w.phase is WorkerPhase.RUNNING]
        step = p.checkpoint_step
        # Every worker of the gang exited 75 (flushed) and no flush manifest followed: the agents
        # found their flush step committed already (the script's own save of it) and wrote nothing
        # more. That save is the flush's checkpoint; no later flush is coming to wait for.
        reused = bool(current) and all(w.exit_code == EXIT_PREEMPTED for w in current)
        # An agent that heard (or held) the notice itself flushed before it exited 75, and a pass may
        # have recorded that flush, taken for the baseline, while the ranks stopped: it is this flush
        # all the same (a flush ends its attempt, so the attempt's flush is this one).
        own_flush = reused and p.checkpoint_is_own_flush
        if step is not None and (
            own_flush
            or ((recovery.baseline_step is None or step > recovery.baseline_step) and (p.checkpoint_is_flush or reused))
        ):
            assert p.status.last_checkpoint is not None
            # A quick flush commits before the pass after the request: take the answers of the
            # requests still in flight first (none is sent anew), so that none goes untold.
            self._ask_to_flush(p, recovery, running, in_flight_only=True)
            seconds = (p.now - recovery.detected_at).total_seconds()
            # Counted from the request even when a notice overtook it (a preemption after all).
            since = FLUSH_AFTER_REQUEST if _started_by_request(p.status) else FLUSH_AFTER_NOTICE
            after = since.format(seconds=seconds) if _watched(p, recovery) else FLUSH_UNWATCHED
            self._enter_rescheduling(p, FLUSH_COMMITTED, step=step, uri=p.status.last_checkpoint.uri, after=after)
            return None
        committed = _committed_instead(recovery.baseline_step, step)
        if not running:
            self._enter_rescheduling(p, WORKERS_EXITED, **committed, resume=p.resume_point())
            return None
        assert recovery.flush_timeout_at is not None
        now = self._flush_now(p, recovery.detected_at)
        if now >= recovery.flush_timeout_at:
            self._enter_rescheduling(
                p,
                FLUSH_TIMED_OUT,
                **committed,
                timeout=p.spec.flush_timeout_seconds,
                resume=p.resume_point(),
                workers=_flush_progress(running),
            )
            return None
        self._ask_to_flush(p, recovery, running)
        until_timeout = (recovery.flush_timeout_at - now).total_seconds()
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
                # Retried next pass (the Kubernetes backend has deleted the pod meanwhile: its SIGTERM
                # is a notice too); the timeout bounds how long an unreachable agent holds us.
                self._event(p, FLUSH_REQUEST_FAILED, worker=w.name, error=answer.error, node=w.node)
                continue
            recovery.flush_requested.append(w.name)
            asked.append(w.name)
        if asked:
            bound = recovery.flush_deadline or recovery.flush_timeout_at
            deadline = "no deadline" if bound is None else bound.isoformat()
            if recovery.flush_deadline is None and bound is not None:
                deadline += " (flushTimeoutSeconds: the signal gave no deadline)"
            self._event(p, FLUSH_REQUESTED, count=len(asked), deadline=deadline, workers=", ".join(asked))

    def _note_more_preempted(self, p: _Pass, recovery: RecoveryStatus) -> None:
        """Notices for other nodes of the gang while it flushes: avoid those nodes too, and tell
        each as the first was (on the job and on its node): the flush under way serves them."""
        known = {n.node for n in recovery.preempted}
        by_node = {w.node: w for w in p.current() if w.node is not None}
        for s in p.signals:
            w = by_node.get(s.node or "")
            if s.kind.is_preemption and w is not None and w.node not in known:
                recovery.preempted += _nodes([w])
                known.add(w.node)
                p.metrics.append(methodcaller("signal", str(s.kind), s.source))
                why = NODE_LOST if s.kind is SignalKind.NODE_LOST else SPOT_INTERRUPTED
                message = why.message(signal=s.describe())
                if recovery.cause is Cause.REQUESTED:
                    # A requested flush overtaken by the capacity going away: a preemption after all,
                    # and the restart and the node's cool-down are the notice's doing. Its clock
                    # still runs from the request (``_started_by_request``).
                    request = p.status.last_flush_request
                    message += f" (during flush request {request.id})" if request is not None else ""
                    recovery.cause, recovery.reason, recovery.message = Cause.PREEMPTION, why.name, message
                    p.status.preemptions += 1
                    p.metrics.append(methodcaller("preemption"))
                self._event(p, why, message=message, node=w.node)

    def _after_driver_stop(
        self, p: _Pass, reason: str, message: str, since: datetime | None, before: BeforeStop
    ) -> None:
        """(``Reconciler.driver_stopped``) The process that drives the job stopped every worker of it
        on purpose (``reason``, ``message``; it asked them to flush at ``since``; ``before``: what it
        saw before it stopped anything). Their exits (75, 76, none) are that stop's doing, not a
        preemption: a gang that finished first is done; a flush under way ends as the stop left it;
        a notice the driver heard first is the preemption it was; a worker whose own code failed
        first is that failure; otherwise an attempt that was started ends as a requested restart
        (no preemption, no restart counted, no node avoided). The next attempt starts from the
        newest valid checkpoint once the job is driven again."""
        status = p.status
        if status.phase is Phase.FLUSHING:
            # A preemption's (or a requested) flush: every worker is stopped now, so it ends here,
            # committed or not, and still counts as what began it.
            self._flushing(p)
            return
        if p.gang_succeeded():
            # The training ended before the stop could take anything from it.
            self._finish(p, Phase.SUCCEEDED, COMPLETED, seen=_seen(status.attempt.observed_step))
            return
        if status.attempt.started_at is None:
            return  # nothing of the attempt was started: it starts once the job is driven again
        detected = min(since, p.now) if since is not None else p.now
        current = p.current()
        # A notice the driver heard before it asked anything (its agents were flushing for it, or
        # would have been, and the node goes away), or a worker whose node was reclaimed before the
        # stop. As on any pass, the preemption wins over a crash beside it (a crash on a node going
        # away is the notice's doing).
        preemption = self._noticed(p, current, before.signals)
        lost = [w for w in current if w.name in before.lost and w.exit_code is None]
        if preemption is None and lost:
            message = WORKER_LOST.message(worker=lost[0].name, where=_where(lost[0])) + _detail(lost[0])
            preemption = _Preemption(WORKER_LOST, message, _nodes(lost), None, heard_by_controller=False)
        # An agent that flushed for a notice only it heard (a GCE host maintenance), not for the
        # driver's request, and exited 75: the preemption it is on any pass.
        flushed = [w for w in current if w.name in before.preempted and w.exit_code == EXIT_PREEMPTED]
        if preemption is None and flushed:
            first = _asker(flushed)
            message = AGENT_PREEMPTED.message(worker=first.name, node=first.node) + _answered(first)
            going = _nodes_named_first(first, _noticed_by_own_agent(flushed, p.status.held_notices))
            preemption = _Preemption(AGENT_PREEMPTED, message, going, None, heard_by_controller=False)
        if preemption is not None:
            self._enter_flushing(p, preemption)
            recovery = status.recovery
            assert recovery is not None
            noticed = [s.observed_at for s in preemption.signals if s.observed_at is not None]
            recovery.detected_at = min([*noticed, detected])
            self._flushing(p)  # every worker is stopped: it ends now, committed or not
            return
        failed = [w for w in current if w.name in before.failed]
        if failed:
            # The user's code failed before the driver stopped anything: a crash, as without the stop.
            self._on_failure(p, failed[0])
            return
        self._close_recovery(p)
        status.recovery = RecoveryStatus(cause=Cause.REQUESTED, reason=reason, message=message, detected_at=detected)
        if status.start_time is not None:
            status.flushing_seconds += (p.now - detected).total_seconds()
        self._enter_rescheduling(p, None)

    def _on_failure(self, p: _Pass, worker: WorkerObservation) -> None:
        """The user's code failed: restart within the budget, or fail the job."""
        spec, status = p.spec, p.status
        self._close_recovery(p)
        taken = self._taken_over(p)
        if taken is not None:
            self._finish(p, Phase.FAILED, CHECKPOINT_URI_OWNED, error=taken)
            return
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

    def _taken_over(self, p: _Pass) -> str | None:
        """Why the URI is another job's now, or None: read again, not from the pass's first look
        (cached per URI). A job whose URI another one adopted while it ran (``spotjob ckpt adopt``)
        has its workers' saves fenced (FencedSaveError) and then every restart refused
        (CheckpointOwnershipError): each counted as a failure of the user's code, it spent every
        restart and told the user to fix a script that was not broken. One GET per failure."""
        if p.storage is None:
            return None
        try:
            claim(p.storage, job_identity(p.key))  # no write: the URI has an owner record by now
        except OwnershipError as e:
            return str(e)
        except (StorageError, MisplacedUriError):
            return None  # judged as before: storage trouble is the pass's own to tell
        return None

    def _on_infra_error(self, p: _Pass, worker: WorkerObservation) -> None:
        """An agent exited 74: restart the gang after the infrastructure backoff, budget untouched."""
        status = p.status
        self._close_recovery(p)
        # The agent's own words when its pod has them (which port, which store), else what it can be.
        why = worker.detail or "storage unreachable, rendezvous port taken"
        message = WORKER_INFRA_ERROR.message(worker=worker.name, node=worker.node, code=worker.exit_code, why=why)
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
            if (
                why is FLUSH_COMMITTED
                and recovery.cause is Cause.PREEMPTION
                and not _started_by_request(status)
                and _watched(p, recovery)
            ):
                seconds = (p.now - recovery.detected_at).total_seconds()
                p.metrics.append(methodcaller("notice_to_commit", seconds))
            outcome = _FLUSH_OUTCOME[why.name]
            p.metrics.append(
                methodcaller("flush_ended", p.key.namespace, p.key.name, outcome, len(recovery.flush_failed))
            )

        stopped = status.attempt
        with self._lock:
            self._flush_in_flight.pop(p.key, None)
            self._flush_clock.pop(p.key, None)
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
        if recovery.cause is Cause.CAPACITY and recovery.reason == GANG_INCOMPLETE:
            delay = backoff.initial_seconds  # the same capacity: give it time to come
        elif recovery.cause is Cause.CAPACITY:
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

        rescheduled = RESCHEDULED_WHEN_DRIVEN if p.driver_stopped else RESCHEDULED
        message = rescheduled.message(
            attempt=stopped.number,
            cause=recovery.reason,
            next=status.attempt.number,
            delay=delay,
            avoid=self._placement(status, p.spec.cooldown.seconds).describe(),
        )
        self._set_phase(p, Phase.RESCHEDULING, rescheduled.name, message)
        self._condition(p, READY, False, rescheduled.name, message)
        self._event(p, rescheduled, message=message)

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
        status.attempt.not_starting = None
        if status.start_time is None:
            status.start_time = p.now
        if status.capacity is CapacityType.FALLBACK and status.fallback_since is None:
            status.fallback_since = p.now
        stuck = status.condition(CAPACITY)
        if stuck is not None and stuck.status == "True":
            found = CAPACITY_FOUND.message(attempt=status.attempt.number, capacity=status.capacity)
            self._condition(p, CAPACITY, False, CAPACITY_FOUND.name, found)
            self._event(p, CAPACITY_FOUND, message=found)  # README's Events table lists it
        message = WORKERS_RUNNING.message(attempt=status.attempt.number)
        self._set_phase(p, Phase.RUNNING, WORKERS_RUNNING.name, message)
        self._condition(p, READY, True, WORKERS_RUNNING.name, message)
        self._event(p, WORKERS_RUNNING, message=message)

    def _finish(self, p: _Pass, phase: Phase, why: Reason, **fields: object) -> None:
        status = p.status
        message = why.message(**fields)
        if phase is Phase.FAILED:
            # Without a flush: the job failed (its code, or its checkpoint URI); nothing to save.
            # The stop frees what still runs (a healthy peer of the failed worker); the exited
            # workers are kept (``keep_exited``: their pods stay for kubectl logs).
            p.stop_flush = False
        elif any(w.holds_node for w in p.workers):
            # Done, but a worker's sidecar runs on and holds its node for good: stop what is left.
            p.stop_flush = False
        if status.recovery is not None and status.recovery.stopped_at is None:
            self._condition(p, FLUSHING, False, why.name, message)
        self._close_recovery(p)
        status.completion_time = p.now
        self._set_phase(p, phase, why.name, message)
        self._condition(p, READY, False, why.name, message)
        self._event(p, why, message=message)
        # No pass follows an ended job's: a request still in progress gets its outcome now, or
        # status.lastFlushRequest would say InProgress for as long as the job is kept.
        self._end_request_with_job(p)


def _where(w: WorkerObservation | WorkerStatus) -> str:
    """Where a lost worker was, for its WorkerLost message ("on node None" said nothing)."""
    return f"on node {w.node}" if w.node else "(not yet placed on a node)"


def _seen(step: int | None) -> str:
    """The end of a Completed message: the last step the workers reported, or that they reported
    none (a script without a Checkpointer; it read "last step seen None")."""
    return f"last step seen {step}" if step is not None else "no step reported: the script has no Checkpointer"


def _answered(w: WorkerObservation) -> str:
    """`` (its flush answered <notice>)`` for an agent that exited 75, when the backend read what
    its flush answered (``WorkerObservation.flush_answered``), else nothing."""
    if not w.flush_answered:
        return ""
    said = w.flush_answered if len(w.flush_answered) <= 300 else f"{w.flush_answered[:300]} …"
    return f" (its flush answered {said})"


def _asker(exited: list[WorkerObservation]) -> WorkerObservation:
    """Of workers whose agents exited together, the one an Event names as the agent that heard the
    notice: one whose exit line says so; else one whose line does not say; a peer whose line says
    its ranks only flushed with another's (``PEER_FLUSH``) only when every line says that."""
    return next(
        (w for w in exited if w.flushed_for_own_notice), next((w for w in exited if not w.flushed_for_peer), exited[0])
    )


def _nodes_named_first(first: WorkerObservation, going: list[WorkerObservation]) -> list[NodeRef]:
    """The nodes of ``going``, the named worker's first where it is one of them: the Event that names
    it is told on ``nodes[0]``."""
    return _nodes([first, *going] if first in going else going)


def _noticed_by_own_agent(
    exited: list[WorkerObservation], held: list[HeldNotice] | None = None
) -> list[WorkerObservation]:
    """Of workers whose agents exited 75 together, those whose nodes may be going away, to avoid:
    all but a peer whose exit line says its ranks only flushed the same step with the others
    (``PEER_FLUSH``), which ran on a node nothing was said of, unless its agent held a notice of
    its own (``held``: ``status.heldNotices``, a maintenance further off than the flush lead, whose
    node goes all the same). A line that does not say (cut from a termination message, an agent
    older than those words) may be an agent that heard a notice of its own, whatever another
    agent's line says; all of them when every line says ``PEER_FLUSH``."""
    holding = {h.worker for h in held or ()}
    return [w for w in exited if not w.flushed_for_peer or w.name in holding] or exited


_RANKS_SAID = {
    "flushing": "its ranks took the flush and wait for it to commit",
    "flush-failed": "its ranks' flush failed",
}


def _committed_instead(baseline_step: int | None, step: int | None) -> dict[str, str]:
    """What WorkersExited and FlushTimedOut say was committed in place of the flush: nothing newer
    than the checkpoint before the notice, nothing at all, or a save's newer step, which is not the
    flush but is what the job resumes from (it said "nothing newer than step 58 was committed;
    resuming from step 60")."""
    if step is not None and (baseline_step is None or step > baseline_step):
        return {"nothing": "no flush", "meanwhile": f" (a save committed step {step} meanwhile)"}
    if baseline_step is None:
        return {"nothing": "nothing", "meanwhile": ""}
    return {"nothing": f"nothing newer than step {baseline_step}", "meanwhile": ""}


def _flush_progress(running: list[WorkerObservation]) -> str:
    """The end of a FlushTimedOut message: which running workers' ranks had not committed their part
    of the flush, each with what its agent last said of them (the one that never took the flush, or
    whose agent says nothing, is where to look first: a hung node, a wedged rank), and which had,
    as far as their agents said."""
    done = [w.name for w in running if w.ranks_state == "flushed"]
    pending = [w for w in running if w.ranks_state != "flushed"]
    # Those that never took the flush first: they hold the others in its collectives.
    pending.sort(key=lambda w: (w.ranks_state in _RANKS_SAID, w.index))
    parts = []
    if pending:
        said = [f"{w.name} on {w.node or 'no node'} ({_ranks_said(w.ranks_state)})" for w in pending]
        parts.append(f"; not committed by {', '.join(said)}")
    if done:
        parts.append(f"; committed by {', '.join(done)}")
    return "".join(parts)


def _ranks_said(state: str | None) -> str:
    """What the agent's last report said of its ranks (a hung node's agent no longer answers: its
    last word stands)."""
    if state is None:  # no answer yet, or an older agent that does not say
        return "its agent said nothing of its ranks"
    return _RANKS_SAID.get(state, f"its agent last said its ranks were {state}: they had not taken the flush")


def _started_by_request(status: JobStatus) -> bool:
    """Whether a person's flush request started the recovery (its clock runs from the request), a
    notice that overtook it included: its flush time is not a notice's, in words nor in the
    notice-to-commit histogram. The restart request stays in progress until its recovery's flush
    ends (``_end_requested_flush``); a notice that overtakes it gives the recovery its own reason."""
    request = status.last_flush_request
    return request is not None and request.mode == "restart" and request.outcome == "InProgress"


def _watched(p: _Pass, recovery: RecoveryStatus) -> bool:
    """Whether the flush that ended in this pass was watched from its notice on: the recovery was
    detected before this pass. One detected in the very pass that sees its flush committed (an
    agent that heard a notice itself and flushed between two passes, a gang found lost by a
    ``--resume`` after its driver was killed, whose agents flushed for the driver's death) was
    committed before anything here knew of it: the 0 s from its detection say nothing of the flush."""
    return recovery.detected_at < p.now


def _flush_detail(w: WorkerObservation) -> str:
    """``; its log says: <the agent's exit line>`` for an agent that exited 76, when the backend read
    why its flush committed nothing (the flush's error, the command ending first), else nothing."""
    return f"; its log says: {w.detail}" if w.detail else ""
