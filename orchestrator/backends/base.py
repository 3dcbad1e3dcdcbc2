"""The interface between the reconciler and where workers run (local processes, Kubernetes pods).

A worker is one spotjob-agent wrapping torchrun on one node; a job's workers form a gang that is
started and stopped together. Each start of the gang is an *attempt*, numbered from 0, and the
workers of attempt ``a`` are named ``worker_name(job, a, index)`` — deterministic names are what
make every call below idempotent.

Call order (the reconciler, one job at a time, never concurrently for one job):

1. every pass: ``list_workers`` then ``signals`` (observations; no side effects);
2. a preemption: ``request_flush`` once per running worker whose agent has not accepted one yet;
3. a restart: ``stop_workers`` (the whole gang) until ``list_workers`` shows none alive, then
   ``start_workers`` for the next attempt, away from the placements to avoid;
4. a failed job: ``stop_workers``.

Contract of every backend:

- ``start_workers`` is idempotent per attempt: starting an attempt whose workers exist (in any
  phase) starts nothing and is not an error.
- ``stop_workers`` is idempotent: a worker already gone is done ("404 on delete is done").
  Stopping may complete asynchronously; ``list_workers`` shows a worker until it is gone.
- ``list_workers`` reports every worker of the job it still knows, of any attempt, including those
  that exited (phase Succeeded/Failed with their exit code) until ``stop_workers`` removes them.
  A worker of the current attempt missing from the list has vanished (its node went away).
- Failures raise ``BackendError``; the reconciler retries the pass with backoff and surfaces it
  in the job's Degraded condition. Nothing else may escape.
- No call blocks for long: waits are the reconciler's, expressed as requeue delays.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Protocol, runtime_checkable

from orchestrator.model import JobSpec, WorkerPhase
from orchestrator.signals import Signal


class BackendError(Exception):
    """The backend could not observe or do what was asked (API down, a process that would not start).

    Not the user's failure and not a preemption: the reconciler retries with backoff.
    """


def worker_name(job: str, attempt: int, index: int) -> str:
    """The deterministic name of worker ``index`` of ``attempt`` (a valid Kubernetes pod name)."""
    return f"{job}-{attempt}-{index}"


@dataclass(frozen=True)
class WorkerObservation:
    """One worker as the backend sees it now."""

    name: str
    attempt: int
    index: int
    phase: WorkerPhase
    node: str | None = None
    zone: str | None = None
    instance_type: str | None = None
    exit_code: int | None = None
    """The agent's exit status once the worker exited; None while alive, or if it never reported
    one (a pod deleted with its node)."""
    step: int | None = None
    """The training step the agent last reported (GET /status): a hint for steps lost and the step
    rate, never for what is committed (storage decides that)."""


@dataclass(frozen=True)
class Placement:
    """Where not to start the workers of an attempt (the cool-downs after preemptions).

    A backend must not place a worker on an avoided node. Zones and instance types it avoids while
    other capacity exists (Kubernetes: preferred anti-affinity), so that a cool-down never strands
    the job with no capacity at all.
    """

    avoid_nodes: frozenset[str] = frozenset()
    avoid_zones: frozenset[str] = frozenset()
    avoid_instance_types: frozenset[str] = frozenset()

    def describe(self) -> str:
        parts = [
            f"{label} {', '.join(sorted(values))}"
            for label, values in (
                ("nodes", self.avoid_nodes),
                ("zones", self.avoid_zones),
                ("instance types", self.avoid_instance_types),
            )
            if values
        ]
        return "; ".join(parts) or "nothing"


@runtime_checkable
class Backend(Protocol):
    """Starts, stops and observes a job's workers. See the module docstring for the contract."""

    def start_workers(self, job: JobSpec, attempt: int, placement: Placement) -> None:
        """Start ``job.replicas`` workers for ``attempt`` (named ``worker_name``), away from ``placement``.

        The workers' agents resume from the newest valid checkpoint under ``job.checkpoint.uri``.
        Idempotent: workers of this attempt that exist already are left as they are.
        """
        ...

    def stop_workers(self, job: JobSpec, *, keep_attempt: int | None = None) -> None:
        """Stop every worker of the job, except those of ``keep_attempt`` when given. Idempotent."""
        ...

    def list_workers(self, job: JobSpec) -> list[WorkerObservation]:
        """Every worker of the job the backend still knows (any attempt, alive or exited)."""
        ...

    def signals(self, job: JobSpec) -> list[Signal]:
        """Current notices about the job's nodes or workers (level-triggered: repeated while true)."""
        ...

    def request_flush(self, job: JobSpec, worker: WorkerObservation, reason: str, deadline: datetime | None) -> None:
        """Ask ``worker``'s agent to commit a checkpoint now and stop (POST /flush with the job's token).

        ``deadline`` is when the capacity goes away. The agent keeps the first request it accepted,
        so a repeat is harmless. Raises ``BackendError`` if the agent cannot be reached.
        """
        ...
