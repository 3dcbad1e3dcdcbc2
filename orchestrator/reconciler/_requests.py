"""A person's flush requests (``StoredJob.flush_request``: on Kubernetes the ``spotjob.dev/flush-request``
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
"""

from __future__ import annotations

from datetime import timedelta

from orchestrator.backends.base import BackendError, FlushRequestOutcome, FlushRequestState
from orchestrator.model import (
    Cause,
    FlushRequest,
    FlushRequestOutcomeName,
    FlushRequestStatus,
    Phase,
    RecoveryStatus,
    WorkerPhase,
)
from orchestrator.reconciler._base import _Base
from orchestrator.reconciler._pass import _Pass
from orchestrator.reconciler._reasons import (
    CHECKPOINT_REQUESTED_BY_USER,
    FLUSH_COMMITTED,
    FLUSH_REQUEST_COMMITTED,
    FLUSH_REQUEST_INVALID,
    FLUSH_REQUEST_NOT_COMMITTED,
    FLUSH_REQUEST_SKIPPED,
    FLUSH_REQUESTED_BY_USER,
    FLUSHING,
    READY,
    SAVE_REQUEST_FAILED,
    Reason,
)


class _FlushRequests(_Base):
    """(every pass, and Running) Take up, follow and answer a person's flush request."""

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
        if rid is None or (last is not None and last.handled(rid)):
            return
        if last is not None and last.outcome == "InProgress":
            # Answered once that one ends: recording it now would write over the request in
            # progress, whose outcome would then never be told.
            return
        if p.flush_request_problem is not None:
            message = FLUSH_REQUEST_INVALID.message(problem=p.flush_request_problem)
            status.last_flush_request = FlushRequestStatus(
                id=rid, outcome="Invalid", message=message, time=p.now, earlier_ids=last.ids_so_far() if last else []
            )
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
        if request is None or (last is not None and (last.handled(request.id) or last.outcome == "InProgress")):
            return False
        because = f": {request.reason}" if request.reason else ""
        baseline = p.flush_baseline(heard_by_controller=True)
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
        started = request.started_at or p.now
        timeout_at = started + timedelta(seconds=p.spec.flush_timeout_seconds)
        if p.status.phase is Phase.FLUSHING:
            # A preemption's flush under way commits a checkpoint newer than the request (its own
            # timeout ends it): that commit answers the request too, on a pass to come.
            return
        if p.status.phase is not Phase.RUNNING:
            why = f"the gang stopped ({p.status.reason}) before a checkpoint for it committed"
        elif self._flush_now(p, started) >= timeout_at:
            than = f" newer than step {request.baseline_step}" if request.baseline_step is not None else ""
            why = f"nothing{than} committed within {p.spec.flush_timeout_seconds:.0f}s"
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

    def _end_request_with_job(self, p: _Pass) -> None:
        """(the job ends: Succeeded or Failed) A request still in progress ends with it: Committed
        when a checkpoint for it committed (a checkpoint request's save, a restart's flush of this
        attempt), else NotCommitted, saying the job ended. No later pass would answer it."""
        request = p.status.last_flush_request
        if request is None or request.outcome != "InProgress":
            return
        if request.mode != "restart":
            self._progress_checkpoint_request(p, request)  # the phase is no longer Running: it ends
            return
        step = p.checkpoint_step
        if (
            step is not None
            and (request.baseline_step is None or step > request.baseline_step)
            and p.checkpoint_is_own_flush
        ):
            message = FLUSH_REQUEST_COMMITTED.message(id=request.id, mode=request.mode, step=step)
            self._end_request(p, request, "Committed", message, FLUSH_REQUEST_COMMITTED, step=step)
            return
        why = f"the job ended ({p.status.reason}) before the flush committed: nothing restarts"
        message = FLUSH_REQUEST_NOT_COMMITTED.message(id=request.id, mode=request.mode, why=why)
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
        self._flush_now(p, p.now)  # its timeout counts from now on this process's monotonic clock
        last = p.status.last_flush_request
        return FlushRequestStatus(
            id=request.id,
            mode=request.mode,
            outcome=outcome,
            message=message,
            time=p.now,
            requested_at=request.requested_at,
            started_at=p.now,
            baseline_step=baseline,
            earlier_ids=last.ids_so_far() if last is not None else [],
        )
