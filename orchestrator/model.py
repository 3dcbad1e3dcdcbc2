"""A job's spec and status: the same fields as the SpotJob custom resource. No torch import.

Python names are snake_case; the JSON (the CRD, the local status file) is camelCase through an
alias generator, so ``JobSpec.model_validate(crd["spec"])`` and
``status.model_dump(mode="json")`` read and write the resource as Kubernetes shows it.

The spec is what the user asks for and never changes under the reconciler. The status is
everything the reconciler knows and has decided, so that a new reconciler reading it carries on
where the last one stopped: the phase, the attempt in flight, the recovery in progress, the
placements to avoid, the budgets spent, and the accounting behind ``goodput``.
"""

from __future__ import annotations

import re
from datetime import datetime
from enum import StrEnum
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic.alias_generators import to_camel

MAX_NAME_LENGTH = 40
"""Leaves room in a 63-character Kubernetes name for ``-<attempt>-<index>``."""

_NAME_RE = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


class _Resource(BaseModel):
    """camelCase in JSON, snake_case in Python; unknown fields are an error, not a silent typo."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        validate_by_name=True,
        validate_by_alias=True,
        serialize_by_alias=True,
        extra="forbid",
    )


# -- spec ---------------------------------------------------------------------------------------


class CheckpointSpec(_Resource):
    """Where and how often the job's agents commit checkpoints."""

    uri: str = Field(
        min_length=1,
        description="s3://bucket/prefix, gs://bucket/prefix, file:///path or a path: the source of truth "
        "for what is committed",
    )
    every_steps: int | None = Field(default=None, ge=1, description="save every N training steps")
    every_seconds: float | None = Field(default=None, gt=0, description="save at least this often (wall time)")
    keep: int = Field(
        default=3, ge=1, description="committed checkpoints to keep; the newest valid one is never deleted"
    )


class BackoffSpec(_Resource):
    """How long to wait before starting the workers again: ``initial * 2**(n-1)`` capped at ``max``.

    ``n`` counts consecutive restarts (preemptions and failures alike); an attempt that ran for
    ``resetAfterSeconds`` resets it, so a job preempted once a day always restarts quickly.
    """

    initial_seconds: float = Field(default=10.0, ge=0, description="wait before the first restart")
    max_seconds: float = Field(default=300.0, ge=0, description="the cap on the wait")
    reset_after_seconds: float = Field(
        default=600.0, ge=0, description="an attempt running this long resets the backoff to initialSeconds"
    )

    @model_validator(mode="after")
    def _cap_not_below_start(self) -> BackoffSpec:
        if self.max_seconds < self.initial_seconds:
            raise ValueError(
                f"restartBackoff.maxSeconds ({self.max_seconds}) is below initialSeconds ({self.initial_seconds})"
            )
        return self


class CooldownSpec(_Resource):
    """Where not to start the workers again after a preemption, and for how long."""

    avoid_node: bool = Field(default=True, description="never restart on the preempted node during the cool-down")
    avoid_zone: bool = Field(default=False, description="prefer other zones than the preempted node's")
    avoid_instance_type: bool = Field(
        default=False, description="prefer other instance types than the preempted node's"
    )
    seconds: float = Field(default=1800.0, ge=0, description="how long an avoidance lasts")


class JobSpec(_Resource):
    """What the user asks for: a gang of ``replicas`` workers, each one spotjob-agent wrapping torchrun."""

    name: str = Field(description="the job's name: a DNS label of at most 40 characters")
    image: str | None = Field(default=None, description="container image (Kubernetes); unused by local processes")
    command: list[str] = Field(min_length=1, description="the training command each agent launches")
    env: dict[str, str] = Field(default_factory=dict, description="extra environment for the command")
    replicas: int = Field(default=1, ge=1, description="workers (nodes) in the gang; all run or none do")
    nproc_per_node: int = Field(default=1, ge=1, description="training ranks per worker (torchrun --nproc-per-node)")
    checkpoint: CheckpointSpec
    max_restarts: int = Field(
        default=3, ge=0, description="restarts after failures of the user's code; preemptions never consume it"
    )
    flush_timeout_seconds: float = Field(
        default=120.0, gt=0, description="how long to wait for a flush to commit before restarting from what is there"
    )
    notice_seconds: float | None = Field(
        default=None,
        gt=0,
        description="the notice the capacity gives (AWS: 120); the flush deadline when a signal carries none",
    )
    restart_backoff: BackoffSpec = Field(default_factory=BackoffSpec)
    cooldown: CooldownSpec = Field(default_factory=CooldownSpec)

    @field_validator("name")
    @classmethod
    def _dns_label(cls, v: str) -> str:
        if len(v) > MAX_NAME_LENGTH or not _NAME_RE.match(v):
            raise ValueError(
                f"job name {v!r} must be lowercase letters, digits and '-', start and end with a letter "
                f"or digit, and be at most {MAX_NAME_LENGTH} characters"
            )
        return v


# -- status -------------------------------------------------------------------------------------


class Phase(StrEnum):
    """Where the job is in its life; see ``orchestrator.reconciler`` for the transitions."""

    PENDING = "Pending"
    """The first attempt's workers are being started."""
    RUNNING = "Running"
    """Every worker of the current attempt runs."""
    FLUSHING = "Flushing"
    """A preemption: the agents were asked to commit a checkpoint; waiting for storage to show it."""
    RESCHEDULING = "Rescheduling"
    """The gang is stopped; the next attempt is backing off, starting, or waiting to run."""
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"

    @property
    def terminal(self) -> bool:
        return self in (Phase.SUCCEEDED, Phase.FAILED)


class WorkerPhase(StrEnum):
    """One worker's state as a backend observes it (a pod's phase, a process alive or exited)."""

    PENDING = "Pending"
    RUNNING = "Running"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"

    @property
    def alive(self) -> bool:
        return self in (WorkerPhase.PENDING, WorkerPhase.RUNNING)


class Cause(StrEnum):
    """Why a recovery runs. The failure classes of DESIGN.md, as status shows them."""

    PREEMPTION = "Preemption"
    """The capacity went away (notice, agent exit 75/76, worker lost): unlimited, backs off."""
    FAILURE = "Failure"
    """The user's code failed (another non-zero exit): consumes maxRestarts."""
    INFRASTRUCTURE = "Infrastructure"
    """Not the user's fault (an agent exited 74: storage unreachable, rendezvous port taken):
    restarted after the infrastructure backoff; consumes no budget, is no preemption."""


ConditionStatus = Literal["True", "False", "Unknown"]


class Condition(_Resource):
    """One aspect of the job (Kubernetes condition conventions)."""

    type: str = Field(description="Ready | Flushing | Degraded")
    status: ConditionStatus
    reason: str = Field(description="CamelCase, machine-readable")
    message: str = ""
    last_transition_time: datetime = Field(description="when status last changed (not reason or message)")


class EventType(StrEnum):
    NORMAL = "Normal"
    WARNING = "Warning"


class Event(_Resource):
    """A decision the reconciler made, newest last; repeats of the last one bump ``count``."""

    time: datetime = Field(description="the latest occurrence")
    type: EventType
    reason: str
    message: str
    count: int = 1


class CheckpointInfo(_Resource):
    """The newest valid checkpoint in storage, as the reconciler last read it."""

    step: int
    uri: str = Field(description="the checkpoint folder's URI")
    time: datetime = Field(description="when its manifest was created")


class WorkerStatus(_Resource):
    """A worker of the current attempt as last observed."""

    name: str
    node: str | None = None
    zone: str | None = None
    instance_type: str | None = None
    phase: WorkerPhase
    exit_code: int | None = None
    step: int | None = Field(default=None, description="the agent's training step (a hint)")


class AttemptStatus(_Resource):
    """One start of the gang. Workers are named after it, so starting it twice starts nothing new."""

    number: int = Field(default=0, ge=0)
    started_at: datetime | None = Field(default=None, description="when start_workers was called; None: not yet")
    running_at: datetime | None = Field(default=None, description="when every worker was first seen running")
    resumed_from_step: int | None = Field(default=None, description="the committed step the attempt resumes from")
    first_step: int | None = Field(default=None, description="first step observed while running (for the step rate)")
    first_step_at: datetime | None = None
    observed_step: int | None = Field(default=None, description="highest step observed in this attempt")
    observed_step_at: datetime | None = None

    def step_rate(self) -> float | None:
        """Observed training steps per second of this attempt, or None until there are two observations."""
        if (
            self.first_step is None
            or self.observed_step is None
            or self.first_step_at is None
            or self.observed_step_at is None
        ):
            return None
        seconds = (self.observed_step_at - self.first_step_at).total_seconds()
        steps = self.observed_step - self.first_step
        return steps / seconds if seconds > 0 and steps > 0 else None


class NodeRef(_Resource):
    """Where a preempted worker ran."""

    node: str | None = None
    zone: str | None = None
    instance_type: str | None = None


class RecoveryStatus(_Resource):
    """The recovery in progress (Flushing, then Rescheduling until the next attempt runs)."""

    cause: Cause
    reason: str = Field(description="the CamelCase reason that started it")
    message: str
    detected_at: datetime
    preempted: list[NodeRef] = Field(default_factory=list, description="nodes noticed as going away")
    flush_deadline: datetime | None = Field(default=None, description="when the capacity goes away (given to agents)")
    flush_timeout_at: datetime | None = Field(default=None, description="when to stop waiting for the flush")
    baseline_step: int | None = Field(
        default=None, description="the newest committed step before the flush; the flush is done once a newer one is"
    )
    flush_requested: list[str] = Field(
        default_factory=list, description="workers whose agent accepted the flush (never asked twice)"
    )
    flush_failed: list[str] = Field(default_factory=list, description="workers whose agent exited 76")
    stopped_at: datetime | None = Field(default=None, description="when the gang was stopped (Rescheduling began)")
    restart_at: datetime | None = Field(default=None, description="not before: the backoff")
    last_step: int | None = Field(default=None, description="the stopped attempt's highest observed step")
    step_rate: float | None = Field(default=None, description="the stopped attempt's steps per second")


AvoidKind = Literal["node", "zone", "instanceType"]


class Avoidance(_Resource):
    """A place not to start workers until ``until`` (the cool-down after a preemption)."""

    kind: AvoidKind
    value: str
    until: datetime
    reason: str


class JobStatus(_Resource):
    """What the reconciler knows and has decided. A new reconciler carries on from this alone.

    Time accounting (all seconds, wall clock):

    - ``flushing_seconds``: from each preemption's detection to the gang being stopped.
    - ``restarting_seconds``: from each stop to every worker of the next attempt running
      (backoff, scheduling, start-up); failures' restarts included.
    - ``retraining_seconds``: estimated time to train again the steps each restart lost:
      ``lost steps / the stopped attempt's observed step rate`` (0 when no rate was observed).
    - ``goodput``: ``(wall - flushing - restarting - retraining) / wall`` where ``wall`` runs from
      ``start_time`` (the first time every worker ran; queueing for the first start is not the
      job's loss) to ``completion_time`` or now, and a flush or restart in progress counts up to
      now. None before the job first ran. Checkpoint saves' own pauses are not seen and not
      subtracted.
    """

    phase: Phase = Phase.PENDING
    reason: str = Field(default="", description="CamelCase reason of the last phase change")
    message: str = ""
    conditions: list[Condition] = Field(default_factory=list)
    attempt: AttemptStatus = Field(default_factory=AttemptStatus)
    workers: list[WorkerStatus] = Field(default_factory=list)
    restarts: int = Field(
        default=0, description="restarts after failures of the user's code (counts toward maxRestarts)"
    )
    preemptions: int = Field(default=0, description="preemptions recovered from (never count toward maxRestarts)")
    consecutive_restarts: int = Field(default=0, description="restarts since an attempt last ran resetAfterSeconds")
    recovery: RecoveryStatus | None = None
    avoid: list[Avoidance] = Field(default_factory=list)
    last_checkpoint: CheckpointInfo | None = None
    steps_lost_to_preemptions: int = Field(
        default=0, description="sum over preemptions of (last observed step - committed step resumed from)"
    )
    flushing_seconds: float = 0.0
    restarting_seconds: float = 0.0
    retraining_seconds: float = 0.0
    goodput: float | None = Field(default=None, description="productive time over wall time; see the class docstring")
    created_at: datetime | None = None
    start_time: datetime | None = None
    completion_time: datetime | None = None
    infra_errors: int = Field(default=0, description="consecutive passes that storage or the backend failed")
    events: list[Event] = Field(default_factory=list)

    def condition(self, type_: str) -> Condition | None:
        for c in self.conditions:
            if c.type == type_:
                return c
        return None


class SpotJob(_Resource):
    """One job as stored: the resource's spec and status."""

    spec: JobSpec
    status: JobStatus | None = None
