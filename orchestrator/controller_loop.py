"""The local controller's loop: reconcile one job, wait the requeue delay, again, until it ends.

``spotjob run`` drives it with ``SystemClock``; ``spotjob-controller`` on Kubernetes runs the same
``Reconciler`` from its work queue instead (``orchestrator.k8s.controller``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from orchestrator.model import JobKey, JobStatus
from orchestrator.store import JobNotFoundError

if TYPE_CHECKING:
    from orchestrator.reconciler import Clock, Reconciler


class Controller:
    """Runs a job to Succeeded or Failed: reconcile, wait the requeue delay, again.

    The local CLI runs it with ``SystemClock``; tests with a fake clock whose ``sleep`` only moves
    time. ``wait`` replaces ``clock.sleep`` when the caller can wake early (a worker exited).
    ``max_wait_seconds`` bounds each wait so that level-triggered checks keep happening.
    """

    def __init__(
        self,
        reconciler: Reconciler,
        clock: Clock,
        *,
        wait: Callable[[float], None] | None = None,
        max_wait_seconds: float = 30.0,
    ) -> None:
        self._reconciler = reconciler
        self._wait = wait or clock.sleep
        self._max_wait = max_wait_seconds

    def run(self, key: JobKey, *, max_passes: int | None = None) -> JobStatus:
        """Reconcile ``key`` until it needs no more passes — Succeeded, Failed, or Invalid (its spec
        cannot change in local mode) — or ``max_passes`` passes; return its status.

        ``JobNotFoundError`` if the job is not in the store (or has no readable status).
        """
        passes = 0
        while True:
            result = self._reconciler.reconcile(key)
            passes += 1
            if result.phase is None:
                break
            if result.requeue_after is None or (max_passes is not None and passes >= max_passes):
                break
            self._wait(min(result.requeue_after, self._max_wait))
        stored = self._reconciler.store.get(key)
        if stored is None or stored.status is None:
            raise JobNotFoundError(str(key))
        return stored.status
