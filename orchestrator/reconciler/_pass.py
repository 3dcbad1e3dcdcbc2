"""One pass's working state and the plain verdicts every concern of the reconciler shares.

``_Pass`` is what one ``reconcile(key)`` observed and is deciding: the status it will write, the
Events and metrics it will emit once that write succeeds, and whether it stops the gang after it.
Nothing here acts: the functions below only judge a worker or a status.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from operator import methodcaller
from typing import Protocol

from agent.catalog import CheckpointRef, CheckpointStatus
from agent.control_channel import EXIT_FLUSH_FAILED, EXIT_INFRA_ERROR, EXIT_PREEMPTED, EXIT_STOPPED
from agent.storage import Storage, StorageError
from orchestrator.backends.base import BackendError, WorkerObservation
from orchestrator.events import EventType
from orchestrator.model import (
    Cause,
    CheckpointSpec,
    FlushRequest,
    JobKey,
    JobSpec,
    JobStatus,
    NodeRef,
    Phase,
    WorkerPhase,
    WorkerStatus,
)
from orchestrator.reconciler._reasons import Reason
from orchestrator.signals import Signal
from orchestrator.store import StoredJob

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


# -- one pass ----------------------------------------------------------------------------------


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
class BeforeStop:
    """What the process that drives a job saw before it stopped every worker of it on purpose
    (``Reconciler.driver_stopped``): evidence that the stop cannot have made, since it came first."""

    failed: tuple[str, ...] = ()
    """Workers whose own code failed (an exit seen while nothing was stopped yet): a failure of
    the user's code, as it would be without the stop."""
    signals: tuple[Signal, ...] = ()
    """The backend's signals as the driver was interrupted: a preemption already under way."""
    lost: tuple[str, ...] = ()
    """Workers gone without an exit code while nothing was stopped yet (their node was reclaimed):
    a preemption already under way, as on any pass."""
    preempted: tuple[str, ...] = ()
    """Workers whose agent exited 75 for a flush of its own, not the one the driver asked for (a
    notice only it heard, such as a GCE host maintenance), while nothing was stopped yet: the
    preemption it was, as on any pass (``AgentPreempted``)."""
    newest: tuple[CheckpointStatus | None] | None = None
    """``(the newest valid checkpoint or None)`` as read from storage once no process of the job was
    left to commit one, which the pass takes rather than read storage again (nothing could commit
    between the read and the stop); None when no such read was made."""


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
    skipped: list[CheckpointStatus] = field(default_factory=list)
    """Committed checkpoints newer than ``checkpoint`` that this pass's look at storage passed over."""
    passed_over_told: bool = False
    """This pass told a CheckpointUnusable for the checkpoint the ranks passed over as they restored."""
    newer_format: CheckpointRef | None = None
    """The newest checkpoint above ``checkpoint`` that a newer spotjob wrote (unreadable here): an
    attempt's fence must not fall below it, or an upgraded worker would take it for a stale one's."""
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
    version: str = ""
    """The stored job's version this pass read."""
    job_created: datetime | None = None
    """When the stored job was created (``StoredJob.created_at``): an attempt record older than
    that is an earlier job's of the same name (``Reconciler._record_attempt``)."""
    asker_awaited: bool = False
    """Every agent that exited 75 so far says its ranks only flushed with another's (``PEER_FLUSH``),
    and the agent that asked for that flush has not exited yet: nothing is decided on those exits
    until its own (or its loss) names the node going away (``_Recovery._awaits_asker``)."""
    driver_stopped: bool = False
    """The pass follows a stop of every worker by the process that drives the job
    (``Reconciler.driver_stopped``): nothing drives the job on until it is driven again."""

    @property
    def stopped(self) -> bool:
        """This pass decided to stop the gang (``_commit`` acts on it after the write)."""
        return self.stop_flush is not None

    @property
    def replicas(self) -> int:
        """The attempt's gang size: what it was started with, else the spec's (not started yet)."""
        return self.status.attempt.replicas or self.spec.replicas

    def current(self) -> list[WorkerObservation]:
        return [w for w in self.workers if w.attempt == self.status.attempt.number]

    def gang_succeeded(self) -> bool:
        """Every worker of the attempt's gang exited 0: the job is done."""
        current = self.current()
        return len(current) >= self.replicas and all(w.phase is WorkerPhase.SUCCEEDED for w in current)

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

    @property
    def checkpoint_is_own_flush(self) -> bool:
        """The newest checkpoint is an explicit flush (``trigger: flush``) of the current attempt."""
        manifest = self.checkpoint.manifest if self.checkpoint is not None else None
        return manifest is not None and manifest.trigger == "flush" and manifest.attempt == self.status.attempt.number

    @property
    def flushed_unrecorded(self) -> bool:
        """The newest checkpoint is a flush the current attempt's gang committed since the status last
        recorded one: the gang flushed, and no status says why yet — a flush this controller asked
        for in a pass whose status write was lost (the leader died while its write hung), seen by
        the next leader once it committed. It is that flush, not the baseline of a new one.

        Only an explicit ``trigger: flush`` of this attempt counts (a periodic or early save never
        does, nor a manifest from before spotjob recorded the trigger or the writer's attempt)."""
        manifest = self.checkpoint.manifest if self.checkpoint is not None else None
        step, before = self.checkpoint_step, self.previous_checkpoint_step
        return (
            manifest is not None
            and manifest.trigger == "flush"
            and manifest.attempt == self.status.attempt.number
            and step is not None
            and (before is None or step > before)
        )

    def flush_baseline(self, *, heard_by_controller: bool) -> int | None:
        """What a flush that starts in this pass must commit past (see ``_recovery``): the step
        read now when the controller heard the signal itself, else the one the status held."""
        if heard_by_controller and self.storage_error is None and not self.flushed_unrecorded:
            return self.checkpoint_step
        return self.previous_checkpoint_step

    def resume_point(self) -> str:
        step = self.checkpoint_step
        return f"step {step}" if step is not None else "scratch"


# -- verdicts ----------------------------------------------------------------------------------


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


def _fallback_served(p: _Pass) -> bool:
    """The job has run ``fallback.returnAfterSeconds`` on the fallback without a preemption."""
    since, fallback = p.status.fallback_since, p.spec.fallback
    return (
        since is not None and fallback is not None and (p.now - since).total_seconds() >= fallback.return_after_seconds
    )
