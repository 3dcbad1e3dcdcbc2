"""One controller replica for the leader-election tests: the real ``spotjob-controller`` entry point
with a test-only reconcile that records, as an Event on the SpotJob, which replica reconciled it."""

from __future__ import annotations

import sys

from orchestrator.k8s.controller import ControllerContext
from orchestrator.k8s.events import ObjectRef
from orchestrator.k8s.main import main
from orchestrator.k8s.workqueue import ObjectKey, Reconcile


def recording_reconcile(context: ControllerContext) -> Reconcile:
    def reconcile(key: ObjectKey) -> float | None:
        job = context.jobs.cache.get(key.namespace, key.name)
        if job is not None:
            context.events.normal(ObjectRef.of(job), "TestReconciled", f"reconciled by {context.options.identity}")
        return None

    return reconcile


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], reconcile_factory=recording_reconcile))
