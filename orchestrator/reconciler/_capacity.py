"""Capacity (``spec.startTimeoutSeconds``, ``spec.fallback``): an attempt whose workers the backend
reports unschedulable past the timeout gets ``CapacityUnavailable=True`` and a Warning Event; with
a fallback not in use, it is stopped at once (cause ``Capacity``: no budget, no preemption, no
backoff) and the next attempts are built from the template merged with ``spec.fallback``
(``status.capacity: fallback``). Once the job has run ``fallback.returnAfterSeconds`` on the
fallback without a preemption, the next attempt it starts (whatever restarts it) goes back to its
own template (``ReturningToSpot``). Without a fallback, or already on it, the job keeps waiting;
but workers of a gang only partly placed are stopped (``GangIncomplete``: they would hold their
nodes in the rendezvous for nothing) and the next attempt comes after ``restartBackoff.initialSeconds``.
"""

from __future__ import annotations

import math
from datetime import timedelta

from orchestrator.model import CapacityType, Cause, JobSpec, RecoveryStatus, WorkerPhase
from orchestrator.reconciler._pass import _fallback_served, _Pass
from orchestrator.reconciler._reasons import CAPACITY, CAPACITY_UNAVAILABLE, GANG_INCOMPLETE, RETURNING_TO_SPOT
from orchestrator.reconciler._recovery import _Recovery


class _Capacity(_Recovery):
    """(while an attempt starts) Unschedulable workers, the fallback capacity, and the way back."""

    def _effective_spec(self, p: _Pass) -> JobSpec:
        """The spec the attempt's workers are built from: with ``spec.fallback`` merged in on the
        fallback capacity, and the attempt's own gang size (an edit of ``spec.replicas`` while its
        workers are being created must not add a worker that expects another gang)."""
        spec = p.spec.on_fallback() if p.status.capacity is CapacityType.FALLBACK else p.spec
        if spec.replicas != p.replicas:
            spec = spec.model_copy(update={"replicas": p.replicas})
        return spec

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
        current = p.current()
        stuck = [w for w in current if w.phase is WorkerPhase.PENDING and w.unschedulable]
        if not stuck:
            return math.inf  # placed and starting (an image pull, a restore): not a matter of capacity
        # Workers placed while their peers are not wait in the rendezvous holding their nodes
        # (GPUs) for nothing: a gang starts whole or holds no node.
        holding = [w for w in current if w.node is not None and (w.phase.alive or w.holds_node)]
        on_fallback = status.capacity is CapacityType.FALLBACK
        falls_back = spec.fallback is not None and not on_fallback
        if falls_back:
            then = "the next attempt uses spec.fallback"
        elif holding:
            then = (
                f"stopping {', '.join(w.name for w in holding)} so that they do not hold their nodes; the next "
                f"attempt tries again after restartBackoff.initialSeconds ({spec.restart_backoff.initial_seconds:.0f}s)"
            )
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
        if not falls_back and not holding:
            return self._options.starting_poll_seconds
        self._close_recovery(p)
        reason = CAPACITY_UNAVAILABLE.name
        if falls_back:
            status.capacity, status.fallback_since = CapacityType.FALLBACK, None
        else:
            reason = GANG_INCOMPLETE
        status.recovery = RecoveryStatus(cause=Cause.CAPACITY, reason=reason, message=message, detected_at=p.now)
        self._enter_rescheduling(p, None)
        return None

    def _maybe_return_to_spot(self, p: _Pass) -> None:
        """(before an attempt starts) After ``fallback.returnAfterSeconds`` on the fallback without a
        preemption, the job's own capacity gets the next attempt, whatever restarted it."""
        spec, status = p.spec, p.status
        if status.capacity is not CapacityType.FALLBACK:
            return
        since = status.fallback_since
        if spec.fallback is not None:
            if since is None or not _fallback_served(p):
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
