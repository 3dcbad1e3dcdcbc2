"""A job's identity, spec and status: the same fields as the SpotJob custom resource. No torch import.

Python names are snake_case; the JSON (the CRD, the local status file) is camelCase through an
alias generator, so ``JobSpec.model_validate(resource["spec"])`` and
``status.model_dump(mode="json", exclude_none=True)`` read and write the resource as Kubernetes
shows it. ``orchestrator.crd`` generates the CRD's schema from these models, field docs included.

A job is known by its ``JobKey`` (namespace and name, the resource's ``metadata``): the spec does
not carry its name. The spec is what the user asks for and never changes under the reconciler.
The status is everything the reconciler knows and has decided, so that a new reconciler reading it
carries on where the last one stopped: the phase, the attempt in flight, the recovery in
progress, the placements to avoid, the budgets spent, the accounting behind ``goodput`` and why
each restart happened. Events are not status: they go to an ``orchestrator.events.EventSink``.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic.alias_generators import to_camel

MAX_NAME_LENGTH = 40
"""A job's name leaves room in a 63-character Kubernetes name (and label value) for
``-<attempt>-<index>``."""

LOCAL_NAMESPACE = "local"
"""The namespace of every job in local mode (``spotjob run``): its identity is ``local/<name>``."""

NAME_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
"""What a job's name matches besides ``MAX_NAME_LENGTH`` (a DNS label); the CRD's rule on
``metadata.name`` carries it."""
_NAME_RE = re.compile(NAME_PATTERN)

MAX_DURATION_SECONDS = 365 * 24 * 3600
"""The longest duration a spec field takes (one year, in seconds). Longer is a typo or a unit
mix-up, and a deadline that far off (or infinite) overflows the datetimes it is added to."""

Duration = Annotated[float, Field(le=MAX_DURATION_SECONDS, allow_inf_nan=False)]
"""Seconds, finite and at most ``MAX_DURATION_SECONDS``: the type of every duration of the spec
(grace periods, timeouts, backoffs, intervals); each field adds its own lower bound. The CRD
carries the same ``maximum``."""

MAX_FLUSH_SECONDS = 24 * 3600
"""The longest ``flushTimeoutSeconds`` and ``noticeSeconds`` (a day, in seconds): a worker's
``spotjob-agent`` is given the flush timeout as ``--sigterm-grace`` and ``--flush-timeout``, and a
flush deadline ``noticeSeconds`` away in ``POST /flush``, and it refuses any of these past a day
(``agent.launcher_cli.MAX_WAIT_SECONDS``, ``agent.control_api.MAX_DEADLINE_DISTANCE``)."""

FlushDuration = Annotated[float, Field(le=MAX_FLUSH_SECONDS, allow_inf_nan=False)]
"""Seconds, finite and at most ``MAX_FLUSH_SECONDS``: the durations the workers' agents are given."""

MAX_REPLICAS = 1000
"""The most workers a job's gang may have. The SpotJob's status grows with it: a record per worker
(``workers``) and, at worst, per node in cool-down (``avoid``), per node preempted
(``recovery.preempted``) and per notice held (``heldNotices``), up to about 900 bytes a worker
with all four full (tests/unit/test_crd.py builds it). A Kubernetes object is at most 1.5 MiB
(etcd's request limit): past about 1,700 workers the controller could no longer write such a
status, and the job would stand still mid-recovery. 1000 keeps that status under 1 MiB, the rest
for the spec (its pod template, kubectl's last-applied copy of it) and the metadata.
``nprocPerNode`` has no such bound: nothing the controller keeps grows with it."""


def parse_timestamp(value: Any) -> datetime | None:
    """A Kubernetes or cloud timestamp (RFC 3339, ``Z`` or an offset) as an aware datetime; None for
    anything else. A time without a zone is taken as UTC."""
    if not isinstance(value, str) or not value:
        return None
    try:
        parsed = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None
    return parsed if parsed.tzinfo is not None else parsed.replace(tzinfo=UTC)


def job_name_problem(name: str) -> str | None:
    """Why ``name`` cannot name a job (a DNS label of at most ``MAX_NAME_LENGTH``), or None."""
    if len(name) > MAX_NAME_LENGTH or not _NAME_RE.match(name):
        return (
            f"job name {name!r} must be lowercase letters, digits and '-', start and end with a letter "
            f"or digit, and be at most {MAX_NAME_LENGTH} characters"
        )
    return None


@dataclass(frozen=True, order=True)
class JobKey:
    """A job's identity: its namespace and name. ``str(key)`` is ``namespace/name``.

    Everything is keyed by it: the store, the reconciler, the backends, Events and metrics. The
    same string is the job's identity in storage (``agent.ownership``: who owns the checkpoint
    URI, whose attempts are recorded) and reaches the agents as ``--job-name`` /
    ``SPOTJOB_JOB_NAME``. Constructing a key checks nothing (keys come from the API server and
    from files); ``job_name_problem`` says whether the name can run.
    """

    namespace: str
    name: str

    def __str__(self) -> str:
        return f"{self.namespace}/{self.name}"

    @classmethod
    def parse(cls, text: str) -> JobKey:
        """``namespace/name`` back into a key; ValueError when either part is missing."""
        namespace, sep, name = text.partition("/")
        if not sep or not namespace or not name or "/" in name:
            raise ValueError(f"{text!r} is not a job key: expected namespace/name")
        return cls(namespace, name)

    @classmethod
    def local(cls, name: str) -> JobKey:
        """A job of local mode (``LOCAL_NAMESPACE``)."""
        return cls(LOCAL_NAMESPACE, name)


class _Resource(BaseModel):
    """camelCase in JSON, snake_case in Python; unknown fields are an error, not a silent typo."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        validate_by_name=True,
        validate_by_alias=True,
        serialize_by_alias=True,
        extra="forbid",
    )

    @field_validator("*", mode="after")
    @classmethod
    def _utc_if_zoneless(cls, value: Any) -> Any:
        """A time written without a zone (by hand, or by another tool) is UTC, as spotjob writes
        them: left zone-less, each comparison with the controller's clock failed (TypeError)."""
        return value.replace(tzinfo=UTC) if isinstance(value, datetime) and value.tzinfo is None else value


# -- spec ---------------------------------------------------------------------------------------


class CheckpointSpec(_Resource):
    """Where and how often the job's agents commit checkpoints."""

    uri: str = Field(
        min_length=1,
        description="s3://bucket/prefix, gs://bucket/prefix, file:///path or a path: the source of truth "
        "for what is committed",
    )
    every_steps: int | None = Field(default=None, ge=1, description="save every N training steps")
    every_seconds: Duration | None = Field(default=None, gt=0, description="save at least this often (wall time)")
    keep: int = Field(
        default=3, ge=1, description="committed checkpoints to keep; the newest valid one is never deleted"
    )


class BackoffSpec(_Resource):
    """How long to wait before starting the workers again: ``initial * 2**(n-1)`` capped at ``max``.

    ``n`` counts consecutive restarts (preemptions and failures alike); an attempt that ran for
    ``resetAfterSeconds`` resets it, so a job preempted once a day always restarts quickly. A
    preempted attempt that committed progress (a checkpoint past the one it resumed from) waits
    for nothing: it is no loop, and the next attempt goes to other capacity.
    """

    initial_seconds: Duration = Field(
        default=10.0,
        ge=0,
        description="wait before the first restart (none after a preemption that committed progress)",
    )
    max_seconds: Duration = Field(default=300.0, ge=0, description="the cap on the wait")
    reset_after_seconds: Duration = Field(
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
    seconds: Duration = Field(default=1800.0, ge=0, description="how long an avoidance lasts")


class FallbackSpec(_Resource):
    """Where the job runs when its own capacity (spot) cannot be had within ``startTimeoutSeconds``.

    ``template`` is merged into ``spec.template`` for the fallback's attempts (``merge_template``):
    objects merge key by key and a ``null`` removes a key (JSON merge patch, RFC 7386); lists are
    replaced whole, except ``containers``, ``initContainers`` and ``volumes``, whose items are
    matched by ``name`` (an item of a known name is merged into it by these same rules, a new one is
    appended). So ``{spec: {nodeSelector: {karpenter.sh/capacity-type: on-demand}}}`` moves the job
    to on-demand nodes, and ``tolerations: [...]`` replaces the template's tolerations.
    """

    template: dict[str, Any] = Field(
        description="merged into spec.template for the fallback's attempts: objects key by key (null removes a "
        "key), containers, initContainers and volumes by name, other lists replaced whole"
    )
    return_after_seconds: Duration = Field(
        default=3600.0,
        gt=0,
        description="after running this long on the fallback without a preemption, the job's next attempt goes "
        "back to its own capacity",
    )


_MERGED_BY_NAME = ("containers", "initContainers", "volumes")


def merge_template(base: Any, patch: Any, key: str | None = None) -> Any:
    """``patch`` merged into ``base`` by the rules of ``FallbackSpec`` (neither is modified)."""
    if isinstance(patch, dict):
        out = dict(base) if isinstance(base, dict) else {}
        for k, v in patch.items():
            if v is None:
                out.pop(k, None)
            else:
                out[k] = merge_template(out.get(k), v, k)
        return out
    if isinstance(patch, list) and key in _MERGED_BY_NAME and isinstance(base, list):
        merged = [dict(item) if isinstance(item, dict) else item for item in base]
        index = {item.get("name"): i for i, item in enumerate(merged) if isinstance(item, dict)}
        for item in patch:
            name = item.get("name") if isinstance(item, dict) else None
            if name is not None and name in index:
                merged[index[name]] = merge_template(merged[index[name]], item)
            else:
                merged.append(item)
        return merged
    return patch


def dropped_template_nulls(template: Any, fallback: Any, applied: Any) -> list[str]:
    """The ``null`` values of ``applied`` (``spec.fallback.template`` as ``kubectl apply`` last
    applied it) that ``fallback`` (the same, as stored) lacks, and without which the fallback's
    merged template keeps a key of ``template`` (``spec.template``): each as a path under
    ``spec.fallback.template``.

    Client-side ``kubectl apply`` keeps a manifest's nulls in its last-applied annotation and
    sends none of them, so a ``null`` meant to remove a key on the fallback removed nothing, in
    silence. A null under a key the template does not have, or one stored as sent, is no loss."""
    lost: list[str] = []

    def walk(here: Any, stored: Any, path: list[str | int]) -> None:
        if isinstance(here, dict) and isinstance(stored, dict):
            for k, v in here.items():
                if v is None and k not in stored and _removes_something(template, fallback, [*path, k]):
                    lost.append(_template_path([*path, k]))
                elif k in stored or isinstance(v, dict):  # an object of nulls only may be gone whole
                    walk(v, stored.get(k, {}), [*path, k])
        elif isinstance(here, list) and isinstance(stored, list) and len(here) == len(stored):
            for i, (v, w) in enumerate(zip(here, stored, strict=True)):
                walk(v, w, [*path, i])

    walk(applied, fallback, [])
    return lost


def _removes_something(template: Any, fallback: Any, path: list[str | int]) -> bool:
    """Whether a null put back at ``path`` of ``fallback`` changes the merged template."""
    with_null = json.loads(json.dumps(fallback))
    parent = with_null
    for step in path[:-1]:
        parent = parent.setdefault(step, {}) if isinstance(step, str) else parent[step]
    without = json.loads(json.dumps(with_null))
    parent[path[-1]] = None
    return bool(merge_template(template, with_null) != merge_template(template, without))


def _template_path(path: list[str | int]) -> str:
    out = "spec.fallback.template"
    for step in path:
        if isinstance(step, int):
            out += f"[{step}]"
        elif re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", step):
            out += f".{step}"
        else:
            out += f"[{json.dumps(step)}]"
    return out


DEFAULT_CONTAINER_NAME = "trainer"
"""The training container's name in the pods built when the spec has no ``template``."""


class JobSpec(_Resource):
    """What the user asks for: a gang of ``replicas`` workers, each one spotjob-agent wrapping torchrun.

    The job's name is the resource's ``metadata.name`` (``JobKey``), not a spec field.
    """

    template: dict[str, Any] | None = Field(
        default=None,
        description="the workers' pod template (a PodTemplateSpec: metadata labels and annotations; spec with "
        "containers' image, resources, env and volumeMounts, tolerations, nodeSelector, affinity, volumes, "
        "serviceAccountName, ...). The controller adds the agent, the rendezvous, the token and the placement "
        "to it. Unused in local mode",
    )
    container_name: str | None = Field(
        default=None,
        min_length=1,
        description="the template's container the agent and the training ranks run in (default: the first); "
        "without a template, the name of the one container built (default: trainer)",
    )
    image: str | None = Field(
        default=None,
        min_length=1,
        description="the training container's image when the template's container has none",
    )
    command: list[str] = Field(
        min_length=1, description="the training command each agent launches under torchrun (script and arguments)"
    )
    env: dict[str, str] = Field(default_factory=dict, description="extra environment for the training command")
    replicas: int = Field(
        default=1,
        ge=1,
        le=MAX_REPLICAS,
        description=f"workers (pods, one per node) in the gang, at most {MAX_REPLICAS} (the job's status holds a "
        "record of each); all run or none do",
    )
    nproc_per_node: int = Field(default=1, ge=1, description="training ranks per worker (torchrun --nproc-per-node)")
    checkpoint: CheckpointSpec
    max_restarts: int = Field(
        default=3, ge=0, description="restarts after failures of the user's code; preemptions never consume it"
    )
    flush_timeout_seconds: FlushDuration = Field(
        default=120.0,
        gt=0,
        description="how long to wait for a flush to commit before restarting from what is there (at most a day)",
    )
    notice_seconds: FlushDuration | None = Field(
        default=None,
        gt=0,
        description="the notice the capacity gives (AWS: 120); the flush deadline when a signal carries none (at most "
        "a day)",
    )
    restart_backoff: BackoffSpec = Field(default_factory=BackoffSpec)
    cooldown: CooldownSpec = Field(default_factory=CooldownSpec)
    start_timeout_seconds: Duration | None = Field(
        default=None,
        gt=0,
        description="how long an attempt's pods may stay unschedulable (no capacity) before the job says "
        "CapacityUnavailable and, with spec.fallback, starts its next attempt there; unset: wait for ever",
    )
    fallback: FallbackSpec | None = Field(
        default=None,
        description="the capacity to use when the job's own cannot be had within startTimeoutSeconds (e.g. an "
        "on-demand node selector): a patch of spec.template",
    )

    @field_validator("template")
    @classmethod
    def _pod_template(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        if v is None:
            return v
        problem = _template_problem(v)
        if problem is not None:
            raise ValueError(problem)
        return v

    @model_validator(mode="after")
    def _fallback_needs_a_timeout(self) -> JobSpec:
        if self.fallback is None:
            return self
        if self.start_timeout_seconds is None:
            raise ValueError(
                "spec.fallback needs spec.startTimeoutSeconds: how long to wait for the job's own capacity first"
            )
        if self.template is None:
            raise ValueError("spec.fallback patches spec.template: the job has none")
        merged = merge_template(self.template, self.fallback.template)
        problem = _template_problem(merged) or self._image_problem(merged)
        if problem is not None:
            raise ValueError(f"spec.template merged with spec.fallback.template: {problem}")
        return self

    def on_fallback(self) -> JobSpec:
        """This spec with ``fallback.template`` merged into its template (itself without a fallback)."""
        if self.fallback is None or self.template is None:
            return self
        return self.model_copy(update={"template": merge_template(self.template, self.fallback.template)})

    @model_validator(mode="after")
    def _training_container(self) -> JobSpec:
        if self.template is None:
            return self
        names = [c["name"] for c in self.template["spec"]["containers"]]
        if self.container_name is not None and self.container_name not in names:
            raise ValueError(
                f"containerName {self.container_name!r} names no container of the template "
                f"(it has {', '.join(repr(n) for n in names)})"
            )
        problem = self._image_problem(self.template)
        if problem is not None:
            raise ValueError(problem)
        return self

    def _image_problem(self, template: dict[str, Any]) -> str | None:
        """Why the training container of ``template`` (the job's, or the one the fallback attempts
        run: a fallback that sets its image to null or "" removes it) would have no image."""
        containers: list[dict[str, Any]] = template["spec"]["containers"]
        for index, container in enumerate(containers):
            if self.container_name is None or container.get("name") == self.container_name:
                if container.get("image") or self.image is not None:
                    return None
                return (
                    f"the training container {container.get('name')!r} has no image: set spec.image or "
                    f"template.spec.containers[{index}].image"
                )
        return None  # containerName names no container: told on its own

    def training_container(self) -> tuple[int, dict[str, Any]] | None:
        """The template's container the agent runs in, with its index; None without a template."""
        if self.template is None:
            return None
        containers: list[dict[str, Any]] = self.template["spec"]["containers"]
        for i, c in enumerate(containers):
            if self.container_name is None or c.get("name") == self.container_name:
                return i, c
        raise AssertionError("validated: containerName names a container")  # pragma: no cover


def _template_problem(t: Any) -> str | None:
    """Light checks of a pod template (the controller validates every pod it builds in full)."""
    if not isinstance(t, dict):
        return "must be a pod template (an object with metadata and spec)"
    unknown = sorted(set(t) - {"metadata", "spec"})
    if unknown:
        return f"a pod template has only metadata and spec, not {', '.join(unknown)}"
    if "metadata" in t and not isinstance(t["metadata"], dict):
        return "metadata must be an object"
    spec = t.get("spec")
    if not isinstance(spec, dict):
        return "spec must be an object holding the pod's containers"
    containers = spec.get("containers")
    if not isinstance(containers, list) or not containers:
        return "spec.containers must list at least one container (the training container)"
    seen: set[str] = set()
    for i, c in enumerate(containers):
        if not isinstance(c, dict):
            return f"spec.containers[{i}] must be an object"
        name = c.get("name")
        if not isinstance(name, str) or not name:
            return f"spec.containers[{i}].name is required"
        if name in seen:
            return f"spec.containers[{i}].name {name!r} is used twice"
        seen.add(name)
    return None


def spec_problem(raw: Any) -> str | None:
    """Why a stored spec (the resource's ``spec``, camelCase) is not a valid ``JobSpec``, naming
    the first bad field as ``spec.<path>``; None when it is valid."""
    try:
        JobSpec.model_validate(raw)
    except ValidationError as e:
        return describe_validation_error(e, "spec")
    return None


def describe_validation_error(error: ValidationError, prefix: str) -> str:
    """pydantic's errors as ``prefix.a.b[0]: message`` lines joined by "; " (field paths as in JSON)."""
    parts = []
    for item in error.errors():
        path = prefix
        for loc in item["loc"]:
            path += f"[{loc}]" if isinstance(loc, int) else f".{loc}"
        message = str(item["msg"]).removeprefix("Value error, ")
        parts.append(f"{path}: {message}")
    return "; ".join(parts)


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
    CAPACITY = "Capacity"
    """The attempt's pods found no capacity within startTimeoutSeconds: restarted at once on the
    fallback capacity; no budget, no preemption."""
    REQUESTED = "Requested"
    """Someone asked for it (the ``spotjob.dev/flush-request`` annotation, mode restart): the gang
    flushes and restarts; no budget, no preemption, no cool-down. Also an interrupted ``spotjob
    run``'s stop of the gang (``Reconciler.driver_stopped``), restarted once it is resumed."""


ConditionStatus = Literal["True", "False", "Unknown"]


class Condition(_Resource):
    """One aspect of the job (Kubernetes condition conventions)."""

    type: str = Field(description="Ready | Flushing | Degraded | Invalid | CapacityUnavailable")
    status: ConditionStatus = Field(description="True | False | Unknown")
    reason: str = Field(description="CamelCase, machine-readable")
    message: str = Field(default="", description="what it means, for people")
    last_transition_time: datetime = Field(description="when status last changed (not reason or message)")


class CheckpointInfo(_Resource):
    """The newest valid checkpoint in storage, as the reconciler last read it."""

    step: int = Field(description="the training step it holds")
    uri: str = Field(description="the checkpoint folder's URI")
    time: datetime = Field(description="when its manifest was created")


class UnusableCheckpoint(CheckpointInfo):
    """A checkpoint that looks valid to the reconciler (it judges the files' sizes, never their
    bytes) and that the ranks passed over as they restored: a byte of it damaged."""

    reason: str = Field(description="why the ranks passed over it, in their words (a CRC32C mismatch in a file)")
    restored_step: int = Field(ge=0, description="the step the ranks restored instead (0: from scratch)")


class WorkerStatus(_Resource):
    """A worker of the current attempt as last observed."""

    name: str = Field(description="the worker's name (its pod's, on Kubernetes): <job>-<attempt>-<index>")
    node: str | None = Field(default=None, description="the node it runs on")
    zone: str | None = Field(default=None, description="the node's zone")
    instance_type: str | None = Field(default=None, description="the node's instance type")
    phase: WorkerPhase = Field(description="Pending | Running (its ranks train) | Succeeded | Failed")
    exit_code: int | None = Field(
        default=None, description="the agent's exit code: 75 flushed, 76 flush failed, 74 infrastructure, 79 stopped"
    )
    step: int | None = Field(default=None, description="the agent's training step (a hint)")


class NotStarting(_Resource):
    """A worker of the attempt that was placed or tried to be, and is not starting: the first one seen."""

    worker: str = Field(description="the worker's name")
    reason: str = Field(
        description="the kubelet's or the scheduler's reason: ErrImagePull, ImagePullBackOff, "
        "CreateContainerConfigError, Unschedulable, ...; RanksNotMeeting: the worker's agent runs, and no rank "
        "has connected to it past its --rank-connect-timeout (they wait in init_process_group)"
    )
    message: str = Field(default="", description="what it says, for people")
    since: datetime = Field(description="when the reconciler first saw the attempt not starting")
    warned: bool = Field(
        default=False,
        description="whether the WorkerNotStarting Warning was told (for an Unschedulable worker only once it "
        "waited 10 minutes for a node, and never with startTimeoutSeconds, whose CapacityUnavailable tells it)",
    )


class AttemptStatus(_Resource):
    """One start of the gang. Workers are named after it, so starting it twice starts nothing new."""

    number: int = Field(default=0, ge=0, description="attempts are numbered from 0; each restart starts the next")
    started_at: datetime | None = Field(default=None, description="when start_workers was called; None: not yet")
    replicas: int | None = Field(
        default=None,
        ge=1,
        description="the gang size the attempt was started with: an edit of spec.replicas takes effect at the "
        "next attempt (a gang cannot change its size while it runs); None: spec.replicas",
    )
    running_at: datetime | None = Field(default=None, description="when every worker was first seen running")
    resumed_from_step: int | None = Field(default=None, description="the committed step the attempt resumes from")
    restored_step: int | None = Field(
        default=None,
        description="the step the attempt's ranks restored, as their agents said; below resumedFromStep when "
        "the checkpoint the attempt was started from did not load (a CheckpointUnusable Warning says so); "
        "None until they said",
    )
    first_step: int | None = Field(default=None, description="first step observed while running (for the step rate)")
    first_step_at: datetime | None = Field(default=None, description="when firstStep was observed")
    observed_step: int | None = Field(default=None, description="highest step observed in this attempt")
    observed_step_at: datetime | None = Field(default=None, description="when observedStep was observed")
    not_starting: NotStarting | None = Field(
        default=None,
        description="why a worker of the attempt is not starting (an image it cannot pull, no node for it), as "
        "last seen; cleared once every worker runs. The WorkerNotStarting Event is emitted once per attempt",
    )

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

    node: str | None = Field(default=None, description="the node")
    zone: str | None = Field(default=None, description="its zone")
    instance_type: str | None = Field(default=None, description="its instance type")


class HeldNotice(_Resource):
    """A cloud notice a worker's agent holds: its deadline is further away than the agent's
    --flush-lead (GCE host maintenance of a GPU VM, an Azure Reboot or Redeploy), so training goes
    on and the agent starts the flush itself at flushAt. Gone once the cloud withdraws it, the
    flush starts or the job ends."""

    worker: str = Field(description="the worker (its pod's name) whose agent holds it")
    node: str | None = Field(default=None, description="the node it runs on")
    source: str = Field(description="the cloud that sent it: gcp | azure | aws")
    kind: str = Field(description="maintenance | terminate | ... (the agent's notice kind)")
    detail: str = Field(default="", description="what the cloud said, for people")
    deadline: datetime | None = Field(default=None, description="when the node goes, as the notice says")
    flush_at: datetime | None = Field(default=None, description="when the agent starts the flush (training until then)")
    heard_at: datetime | None = Field(default=None, description="when the agent heard it")


class RecoveryStatus(_Resource):
    """The recovery in progress (Flushing, then Rescheduling until the next attempt runs)."""

    cause: Cause = Field(description="Preemption | Failure | Infrastructure | Capacity | Requested")
    reason: str = Field(description="the CamelCase reason that started it")
    message: str = Field(description="what started it, for people")
    detected_at: datetime = Field(description="when the reconciler noticed")
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

    kind: AvoidKind = Field(description="node | zone | instanceType")
    value: str = Field(description="the node's name, the zone or the instance type")
    until: datetime = Field(description="when the cool-down ends")
    reason: str = Field(description="the preemption's reason")


MAX_RESTART_HISTORY = 20
"""How many restarts ``JobStatus.restart_history`` remembers (the newest)."""


class RestartRecord(_Resource):
    """Why the gang was stopped and started again: one entry per restart, newest last."""

    time: datetime = Field(description="when the gang was stopped")
    attempt: int = Field(description="the attempt that was stopped")
    cause: Cause = Field(description="Preemption | Failure | Infrastructure | Capacity | Requested")
    reason: str = Field(description="the CamelCase reason (SpotInterrupted, WorkerFailed, ...)")
    message: str = Field(default="", description="what happened, for people")


class CapacityType(StrEnum):
    """Which capacity the job's attempts use."""

    SPOT = "spot"
    """The job's own template (typically spot nodes)."""
    FALLBACK = "fallback"
    """The template merged with spec.fallback (typically on-demand nodes)."""


FLUSH_REQUEST_ANNOTATION = "spotjob.dev/flush-request"
"""On a SpotJob: a person's (``kubectl spotjob flush``) request to flush, JSON ``FlushRequest``."""

FlushMode = Literal["restart", "checkpoint"]
_REQUEST_ID_RE = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
FLUSH_REASON_MAX_LENGTH = 1000
"""The longest ``reason`` of a flush request: a longer one makes the whole request Invalid."""


class FlushRequest(_Resource):
    """The ``spotjob.dev/flush-request`` annotation's value: ``{"id", "mode", "reason", "requestedAt"}``.

    ``restart``: every agent flushes at one step and the gang restarts from that checkpoint, as
    after a preemption, but nothing counts as a preemption or a restart and no node is avoided.
    ``checkpoint``: a checkpoint now, training goes on. Each ``id`` is handled once.
    """

    model_config = ConfigDict(extra="ignore")

    id: str = Field(pattern=_REQUEST_ID_RE.pattern, description="unique per request: letters, digits, ._:-")
    mode: FlushMode = Field(description="restart | checkpoint")
    reason: str = Field(default="", max_length=FLUSH_REASON_MAX_LENGTH, description="why, for people")
    requested_at: datetime | None = Field(default=None, description="when it was asked for (RFC 3339)")


def parse_flush_request(raw: str) -> FlushRequest:
    """The annotation's value as a ``FlushRequest``; ValueError naming what is wrong."""
    try:
        data = json.loads(raw)
    except ValueError as e:
        raise ValueError(f"{FLUSH_REQUEST_ANNOTATION} is not JSON: {e}") from None
    try:
        return FlushRequest.model_validate(data)
    except ValidationError as e:
        raise ValueError(describe_validation_error(e, FLUSH_REQUEST_ANNOTATION)) from None


def invalid_flush_request_id(raw: str) -> str:
    """The id the controller gives an annotation that does not parse (``invalid-<digest>`` of what
    was written): each text is handled, and answered ``Invalid``, once."""
    return f"invalid-{hashlib.sha256(raw.encode()).hexdigest()[:16]}"


def flush_request_id(raw: str) -> str:
    """The id under which the controller handles (and ``status.lastFlushRequest`` answers) the
    annotation's value ``raw``: its own id, or ``invalid_flush_request_id`` when it does not parse."""
    try:
        return parse_flush_request(raw).id
    except ValueError:
        return invalid_flush_request_id(raw)


MAX_EARLIER_FLUSH_REQUEST_IDS = 32
"""How many handled flush-request ids ``status.lastFlushRequest`` remembers besides its own."""

FlushRequestOutcomeName = Literal["InProgress", "Committed", "NotCommitted", "Skipped", "Invalid"]


class FlushRequestStatus(_Resource):
    """The last ``spotjob.dev/flush-request`` the controller handled (each id is handled once)."""

    id: str = Field(description="the request's id (for an annotation that does not parse: invalid-<hash>)")
    mode: FlushMode | None = Field(default=None, description="restart | checkpoint")
    outcome: FlushRequestOutcomeName = Field(
        description="InProgress | Committed (step holds the checkpoint) | NotCommitted | Skipped | Invalid"
    )
    message: str = Field(default="", description="what happened, for people")
    step: int | None = Field(default=None, description="the checkpoint committed for it")
    time: datetime = Field(description="when the outcome was last set")
    requested_at: datetime | None = Field(default=None, description="when it was asked for (from the annotation)")
    started_at: datetime | None = Field(default=None, description="when the controller took it up")
    baseline_step: int | None = Field(default=None, description="the newest committed step when it was taken up")
    save_requested: list[str] = Field(
        default_factory=list, description="checkpoint mode: workers whose agent accepted the save"
    )
    earlier_ids: list[str] = Field(
        default_factory=list,
        max_length=MAX_EARLIER_FLUSH_REQUEST_IDS,
        description=f"the ids handled before this one, oldest first (the newest {MAX_EARLIER_FLUSH_REQUEST_IDS}): "
        "an annotation put back to one of them (a GitOps sync of an older manifest) is not handled again",
    )

    def handled(self, request_id: str) -> bool:
        """Whether the request ``request_id`` was handled already: this one, or one before it."""
        return request_id == self.id or request_id in self.earlier_ids

    def ids_so_far(self) -> list[str]:
        """``earlier_ids`` for the request handled after this one."""
        return [*self.earlier_ids, self.id][-MAX_EARLIER_FLUSH_REQUEST_IDS:]


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
      subtracted. Refreshed with every status write, and at least every minute or so while the
      job runs (no write per pass just for it).
    """

    phase: Phase = Field(
        default=Phase.PENDING, description="Pending | Running | Flushing | Rescheduling | Succeeded | Failed"
    )
    reason: str = Field(default="", description="CamelCase reason of the last phase change")
    message: str = Field(default="", description="what happened, for people")
    observed_generation: int | None = Field(
        default=None, description="the spec's metadata.generation this status was decided from"
    )
    conditions: list[Condition] = Field(
        default_factory=list, description="Ready, Flushing, Degraded, Invalid, CapacityUnavailable"
    )
    attempt: AttemptStatus = Field(default_factory=AttemptStatus, description="the current attempt")
    workers: list[WorkerStatus] = Field(default_factory=list, description="the current attempt's workers")
    held_notices: list[HeldNotice] | None = Field(
        default=None,
        description="cloud notices the current attempt's agents hold (deadline further away than their "
        "--flush-lead): training goes on until each flushAt; absent when none is held",
    )
    restarts: int = Field(
        default=0, description="restarts after failures of the user's code (counts toward maxRestarts)"
    )
    preemptions: int = Field(default=0, description="preemptions recovered from (never count toward maxRestarts)")
    consecutive_restarts: int = Field(default=0, description="restarts since an attempt last ran resetAfterSeconds")
    restart_history: list[RestartRecord] = Field(
        default_factory=list, description=f"why each restart happened, the newest {MAX_RESTART_HISTORY}"
    )
    recovery: RecoveryStatus | None = Field(default=None, description="the recovery in progress, if any")
    avoid: list[Avoidance] = Field(default_factory=list, description="placements in cool-down")
    checkpoint_uri: str | None = Field(
        default=None,
        description="the spec.checkpoint.uri the job's checkpoints live in, recorded on its first pass: the URI is "
        "immutable, and a spec that names another makes the job Invalid",
    )
    last_checkpoint: CheckpointInfo | None = Field(default=None, description="the newest valid checkpoint")
    unusable_checkpoint: UnusableCheckpoint | None = Field(
        default=None,
        description="the newest checkpoint in storage when its ranks passed over it as they restored (a damaged "
        "byte, which the controller does not read): lastCheckpoint and the next attempts pass over it too, until "
        "a newer one is committed",
    )
    lost_steps: int = Field(
        default=0,
        description="steps lost to preemptions: the sum of (last observed step - committed step resumed from); "
        "and to checkpoints the ranks passed over as they restored: (the step recorded - the step restored)",
    )
    flushing_seconds: float = Field(default=0.0, description="time spent flushing (see goodput)")
    restarting_seconds: float = Field(default=0.0, description="time spent restarting (see goodput)")
    retraining_seconds: float = Field(default=0.0, description="time spent training lost steps again (estimated)")
    goodput: float | None = Field(default=None, description="productive time over wall time, 0 to 1")
    created_at: datetime | None = Field(default=None, description="when the reconciler first saw the job")
    start_time: datetime | None = Field(default=None, description="when every worker first ran")
    completion_time: datetime | None = Field(default=None, description="when the job Succeeded or Failed")
    infra_errors: int = Field(default=0, description="consecutive passes that storage or the backend failed")
    capacity: CapacityType = Field(
        default=CapacityType.SPOT, description="spot (the job's own template) | fallback (with spec.fallback)"
    )
    fallback_since: datetime | None = Field(
        default=None, description="since when the job has run on the fallback without a preemption"
    )
    last_flush_request: FlushRequestStatus | None = Field(
        default=None, description="the last spotjob.dev/flush-request handled, and how it went"
    )

    def condition(self, type_: str) -> Condition | None:
        for c in self.conditions:
            if c.type == type_:
                return c
        return None


class SpotJob(_Resource):
    """A PyTorch training job on spot capacity: a gang of pods, each spotjob-agent wrapping torchrun,
    that flushes a checkpoint on every preemption notice and resumes on other capacity.

    One job as stored: the resource's spec and status (its metadata is Kubernetes').
    """

    spec: JobSpec
    status: JobStatus | None = None
