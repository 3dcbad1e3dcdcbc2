"""Where workers run: ``local`` (processes) and ``k8s`` (pods), behind ``base.Backend``."""

from orchestrator.backends.base import (
    Backend,
    BackendError,
    FlushRequestOutcome,
    FlushRequestState,
    Placement,
    WorkerObservation,
    worker_name,
)

__all__ = [
    "Backend",
    "BackendError",
    "FlushRequestOutcome",
    "FlushRequestState",
    "Placement",
    "WorkerObservation",
    "worker_name",
]
