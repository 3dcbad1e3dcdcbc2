"""The interface between the reconciler and where workers run (local processes, Kubernetes pods).

A worker is one spotjob-agent wrapping torchrun on one node; a job's workers form a gang that is
started and stopped together. Each start of the gang is an *attempt*, numbered from 0, and the
workers of attempt ``a`` are named ``worker_name(key, a, index)`` — deterministic names are what
make every call below idempotent. Every call names the job by its ``JobKey`` and passes its spec;
the backend gives the agents ``str(key)`` (``namespace/name``) as their job name
(``--job-name`` / ``SPOTJOB_JOB_NAME``): the identity that owns the checkpoint URI.

Call order (the reconciler, one job at a time, never concurrently for one job):

1. every pass: ``spec_problems`` (a spec this backend cannot run makes the job Invalid), then
   ``list_workers`` and ``signals`` (observations; no side effects);
2. a preemption: ``request_flush`` for every running worker whose agent has not accepted one yet,
   every pass until it answers ``accepted`` (never again after that); a person's request for a
   checkpoint without a stop: ``request_save`` the same way;
3. a restart: ``stop_workers`` (the whole gang) until ``list_workers`` shows none alive, then
   ``start_workers`` for the next attempt, away from the placements to avoid;
4. a job that ended (Failed, or Succeeded with a worker a sidecar keeps running): ``stop_workers``
   with ``keep_exited=True``, until ``list_workers`` shows none alive and none holding its node.

Contract of every backend:

- ``start_workers`` is idempotent per attempt: starting an attempt whose workers exist (in any
  phase) starts nothing and is not an error.
- ``stop_workers`` is idempotent: a worker already gone is done ("404 on delete is done"), and a
  worker already being stopped is left to the first stop. Stopping may complete asynchronously;
  ``list_workers`` shows a worker until it is gone. ``flush=True`` stops the way the capacity
  going away would (SIGTERM: the agent flushes within its grace); ``flush=False`` first tells
  each agent to stop without a flush (its control API's ``POST /stop``, exit 79), because after a
  failure of the user's code or an infrastructure error the healthy ranks would wait forever for
  their dead peers in the flush's collective. ``keep_exited=True`` (a job that ended) leaves every
  worker whose agent exited and that holds no node (``WorkerObservation.holds_node``) as it is:
  what it left (a pod for ``kubectl logs``, a log file) stays; workers still alive, and exited
  ones a sidecar keeps on their node, are stopped as above.
- ``list_workers`` reports every worker of the job it still knows, of any attempt, including those
  that exited (phase Succeeded/Failed with their exit code) until ``stop_workers`` removes them.
  A worker of the current attempt missing from the list has vanished (its node went away).
- ``request_save`` is ``request_flush``'s sibling (same answers, never blocking): a checkpoint now,
  training goes on; idempotent per ``request_id`` at the agent.
- ``request_flush`` never blocks a pass: a backend that must reach the agent over a network sends
  the request in the background (bounded, concurrent, timed out) and answers ``PENDING`` until it
  knows, then ``ACCEPTED`` or ``FAILED`` with the error (a later call after ``FAILED`` sends
  again). A backend may answer synchronously (local mode).
- Failures raise ``BackendError``; the reconciler retries the pass with backoff and surfaces it
  in the job's Degraded condition. Nothing else may escape.
- No call blocks for long: waits are the reconciler's, expressed as requeue delays.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any, Protocol, runtime_checkable

from agent.control_channel import EXIT_PREEMPTED
from agent.exit_codes import PEER_FLUSH, answered_source
from orchestrator.model import JobKey, JobSpec, WorkerPhase
from orchestrator.signals import Signal


class BackendError(Exception):
    """The backend could not observe or do what was asked (API down, a process that would not start).

    Not the user's failure and not a preemption: the reconciler retries with backoff.
    """


def worker_name(key: JobKey, attempt: int, index: int) -> str:
    """The deterministic name of worker ``index`` of ``attempt``: ``<name>-<attempt>-<index>``.

    A valid Kubernetes pod name (and label value) for every job name ``job_name_problem`` accepts
    (a DNS label of at most 40 characters); unique within the job's namespace.
    """
    return f"{key.name}-{attempt}-{index}"


def agent_refusal(problem: str, where: str, *, fix: str = "fix or remove it") -> str:
    """A ``spec_problems`` line for what every worker's spotjob-agent would refuse at its start
    (``agent.launcher_cli.usage_problem``'s words), and ``where`` the user sets it."""
    return (
        f"every worker's spotjob-agent would refuse its settings and exit 2 (usage) before training: {problem}; "
        f"{fix} in {where}"
    )


class FlushRequestOutcome(StrEnum):
    """Where a flush request to one agent stands."""

    PENDING = "pending"
    """Sent (or about to be) and not answered yet: ask again next pass."""
    ACCEPTED = "accepted"
    """The agent accepted it (or is flushing already): never ask it again."""
    FAILED = "failed"
    """The agent could not be reached or refused: ``error`` says why; asking again retries."""


@dataclass(frozen=True)
class FlushRequestState:
    """A backend's answer to ``request_flush``."""

    outcome: FlushRequestOutcome
    error: str = ""

    @classmethod
    def pending(cls) -> FlushRequestState:
        return cls(FlushRequestOutcome.PENDING)

    @classmethod
    def accepted(cls) -> FlushRequestState:
        return cls(FlushRequestOutcome.ACCEPTED)

    @classmethod
    def failed(cls, error: str) -> FlushRequestState:
        return cls(FlushRequestOutcome.FAILED, error)


@dataclass(frozen=True)
class HeldNoticeReport:
    """A cloud notice a worker's agent holds (its deadline is further away than the agent's
    ``--flush-lead``): training goes on, and the agent starts the flush itself at ``flush_at``."""

    source: str
    """The cloud that sent it (gcp, azure, aws)."""
    kind: str
    """maintenance, terminate, ... (the agent's notice kind)."""
    detail: str
    """What the cloud said, for people."""
    deadline: datetime | None
    flush_at: datetime | None
    heard_at: datetime | None
    """When the agent heard it."""


RANKS_NOT_MEETING = "RanksNotMeeting"
"""``WorkerObservation.not_starting``'s reason for a worker whose agent runs and says that no rank
has connected to it past its ``--rank-connect-timeout`` (``ranks_not_meeting`` in its ``/status``
and ``agent.json``): the ranks wait in init_process_group for peers, or build no Checkpointer."""


def ranks_not_meeting(said: object) -> str | None:
    """An agent's ``ranks_not_meeting`` (its ``/status``, its ``agent.json``) as a job may show it:
    a string of at most 900 characters (it goes into an Event and the job's status); None for
    anything else (none said, or an agent older than the field)."""
    return said[:900] if isinstance(said, str) and said else None


def ranks_state(said: object) -> str | None:
    """The state of a node's ranks as its agent says it (``rank_state`` of its ``/status``, the
    ``state`` of the ranks' ``status.json`` local mode reads): a short word (training, saving,
    flushing, flushed, flush-failed, ...); None for anything else (none said yet, an older agent)."""
    return said[:32] if isinstance(said, str) and said else None


def restored(step: object, passed_over: object) -> tuple[int, str | None] | None:
    """What a node's ranks restored as its agent says it (``restored_step`` and
    ``restore_passed_over`` of its ``/status``; of the ranks' ``status.json`` local mode reads):
    the step, and why they passed over a newer committed checkpoint (at most 900 characters: it goes
    into an Event), None where they passed over none; None for anything else (no restore returned
    yet, an older agent)."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        return None
    return step, passed_over[:900] if isinstance(passed_over, str) and passed_over else None


def held_notice(said: dict[str, Any]) -> HeldNoticeReport | None:
    """``held_notice`` and ``flush_at`` of what an agent says (its ``/status`` answer, which the
    Kubernetes controller asks for; its ``agent.json``, which local mode reads); None where it holds
    none, or says none (an agent older than them), or says something else than its own shape."""
    held = said.get("held_notice")
    if not isinstance(held, dict) or not isinstance(held.get("source"), str):
        return None
    return HeldNoticeReport(
        source=held["source"][:64],
        kind=str(held.get("kind") or "")[:64],
        detail=str(held.get("detail") or "")[:300],
        deadline=_agent_time(held.get("deadline")),
        flush_at=_agent_time(said.get("flush_at")),
        heard_at=_agent_time(held.get("received_at")),
    )


def _agent_time(value: object) -> datetime | None:
    """A unix time of the agent's as a UTC time to the second (a flush time the agent computes anew
    at each answer must not change the job's status by its fractions); None if it is not one."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    try:
        return datetime.fromtimestamp(round(value), UTC)
    except (OverflowError, OSError, ValueError):
        return None


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
    unschedulable: str | None = None
    """Why a Pending worker cannot be placed (no node has room, none matches its selector), in the
    scheduler's words; None while it is placed or placing. The start timeout counts on it."""
    not_starting: tuple[str, str] | None = None
    """Why a Pending worker's containers cannot start, as (reason, message) in the kubelet's words
    (ErrImagePull, ImagePullBackOff, CreateContainerConfigError, ...), or ``RANKS_NOT_MEETING`` and
    its agent's words when it runs but its ranks have not connected; None while it starts normally
    or is not placed yet (``unschedulable`` says that)."""
    detail: str | None = None
    """Why an exited worker failed, for people, when the backend can tell: the telling line of its
    output and where to read the rest (a log's path, a pod's name). The reconciler puts it in the
    failure's message."""
    flush_answered: str | None = None
    """For a worker whose agent exited 75: what its flush answered, in its agent's words
    (``agent.exit_codes.flush_answered``: ``gcp maintenance: ...``, ``api preemption: <reason>``);
    None when the backend cannot tell (no such line, an agent older than those words)."""
    held_notice: HeldNoticeReport | None = None
    """The cloud notice the worker's agent holds, as its last report said (Kubernetes: its GET
    /status, with the step; local mode: its ``agent.json``); None when it holds none, or its agent
    does not say (an older agent)."""
    ranks_state: str | None = None
    """The state of the worker's ranks as its agent last reported it (``ranks_state``; Kubernetes:
    its GET /status; local mode: the ranks' ``status.json``). During a flush: ``flushed``, its ranks
    committed their part; ``flushing``, they took the flush and wait for it to commit; anything
    else (``training``), they never took it. None when the backend has no report of its agent: a
    FlushTimedOut names the workers by it, the one that hangs the gang among them."""
    restored: tuple[int, str | None] | None = None
    """The step the worker's ranks restored, and why they passed over a newer committed checkpoint
    (``restored``; Kubernetes: its agent's GET /status; local mode: the ranks' ``status.json``);
    None before they said. A step below the one the attempt was started from is a checkpoint that
    looked valid to the controller (it judges sizes, never bytes) and did not load."""
    holds_node: bool = False
    """The worker exited, yet what runs it still holds its node: on Kubernetes, a pod whose agent
    exited while another container of it (a sidecar) runs on. Only ``stop_workers`` frees it."""

    @property
    def flushed_for_own_notice(self) -> bool:
        """Its agent exited 75 saying its flush answered a notice the agent heard itself (not
        ``PEER_FLUSH``, a flush another node's agent asked for, nor a line that does not say)."""
        return (
            self.exit_code == EXIT_PREEMPTED
            and self.flush_answered is not None
            and answered_source(self.flush_answered) is not None
        )

    @property
    def flushed_for_peer(self) -> bool:
        """Its agent exited 75 saying its flush answered no notice of its own (``PEER_FLUSH``): its
        ranks flushed the step another node's agent asked for. A line that does not say (cut from
        the termination message, an agent older than those words) proves nothing of the kind."""
        return self.exit_code == EXIT_PREEMPTED and self.flush_answered == PEER_FLUSH


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
    nodes_avoided_since: tuple[tuple[str, datetime], ...] = ()
    """When each avoided node's cool-down began, where known. A backend whose node names are
    reused (a cloud that registers a new machine under the preempted one's name) may place a worker
    on an avoided name that now names a machine registered after that: it is not the preempted one."""
    fallback: bool = False
    """The attempt runs on the fallback capacity: the spec given has ``spec.fallback.template``
    merged into its template, and what a backend says about a worker it cannot create names
    ``spec.fallback.template`` (where the merged template differs from the job's own)."""

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

    def spec_problems(self, key: JobKey, spec: JobSpec) -> list[str]:
        """Why this backend cannot run ``spec`` (each naming the field: ``spec.image: ...``); [] if it can.

        Called every pass before anything else, so it must be cheap and pure. A non-empty answer
        makes the job Invalid (a condition and a Warning Event) until the spec changes.
        """
        ...

    def start_workers(self, key: JobKey, spec: JobSpec, attempt: int, placement: Placement) -> None:
        """Start ``spec.replicas`` workers for ``attempt`` (named ``worker_name``), away from ``placement``.

        The workers' agents get ``str(key)`` as their job name and ``attempt`` as their attempt,
        and resume from the newest valid checkpoint under ``spec.checkpoint.uri``. Idempotent:
        workers of this attempt that exist already are left as they are.
        """
        ...

    def stop_workers(
        self,
        key: JobKey,
        spec: JobSpec,
        *,
        keep_attempt: int | None = None,
        flush: bool = True,
        keep_exited: bool = False,
    ) -> None:
        """Stop every worker of the job, except those of ``keep_attempt`` when given. Idempotent.

        ``flush=False``: tell each agent to stop without flushing first (``POST /stop``), then
        stop what is left; ``keep_exited=True``: leave the workers whose agent exited and that hold
        no node (a job that ended keeps them, for their logs); see the module docstring.
        """
        ...

    def list_workers(self, key: JobKey, spec: JobSpec) -> list[WorkerObservation]:
        """Every worker of the job the backend still knows (any attempt, alive or exited)."""
        ...

    def signals(self, key: JobKey, spec: JobSpec) -> list[Signal]:
        """Current notices about the job's nodes or workers (level-triggered: repeated while true)."""
        ...

    def request_flush(
        self, key: JobKey, spec: JobSpec, worker: WorkerObservation, reason: str, deadline: datetime | None
    ) -> FlushRequestState:
        """Ask ``worker``'s agent to commit a checkpoint now and stop (POST /flush with the job's token).

        ``deadline`` is when the capacity goes away. Never blocks: answers ``PENDING`` while the
        request is in flight, then ``ACCEPTED`` or ``FAILED`` (see the module docstring). The
        agent keeps the first request it accepted, so a repeat is harmless. A backend whose
        workers can be stopped gracefully may do so when the request ``FAILED`` (the Kubernetes
        one deletes the pod: its SIGTERM is a notice the agent flushes on).
        """
        ...

    def request_save(
        self, key: JobKey, spec: JobSpec, worker: WorkerObservation, request_id: str, reason: str
    ) -> FlushRequestState:
        """Ask ``worker``'s agent to commit a checkpoint now and train on (POST /save with the job's
        token): the early save of a rebalance recommendation. Never blocks, answers like
        ``request_flush``. The agent serves each ``request_id`` once, so a repeat is harmless.
        """
        ...
