"""Fakes for the reconciler's tests: a clock that never sleeps, a backend that trains by the clock,
a storage that can go down, and a way to commit real manifests that ``latest_valid`` accepts.

The fake backend's workers evolve lazily from the fake clock whenever the backend is called:
a started worker runs ``start_seconds`` after it was created, trains ``steps_per_second`` from the
step it resumed from (the newest valid checkpoint, read from storage as a real agent would), and a
flush request freezes its step; ``flush_seconds`` later rank 0 commits a manifest at that step and
every flushed agent exits 75 (or 76, or never, as ``flush_outcome`` says; ``reused``: exits 75
having committed nothing more, as an agent whose flush step the script's own save committed). ``flush_answers``
scripts what ``request_flush`` answers per worker (pending, then accepted or failed), as the
Kubernetes backend's background requests would; an unscripted request is accepted at once. A save
request (``request_save``) is served ``flush_seconds`` later by an early commit of the worker's
step, and the worker trains on. Nodes have a capacity type; a template's ``nodeSelector``
``capacity-type`` keeps workers to nodes of that type, and a worker no node takes stays Pending,
unschedulable.
"""

from __future__ import annotations

import builtins
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Literal

from agent.catalog import folder_name, latest_valid
from agent.control_channel import EXIT_FLUSH_FAILED, EXIT_PREEMPTED
from agent.crc32c import crc32c_bytes, to_hex
from agent.manifest import MANIFEST_NAME, FileEntry, Manifest, rank_file_name
from agent.storage import AlreadyExistsError, ObjectInfo, Storage, TransientStorageError
from agent.storage.file import FileStorage
from orchestrator.backends.base import (
    BackendError,
    FlushRequestOutcome,
    FlushRequestState,
    HeldNoticeReport,
    Placement,
    WorkerObservation,
    worker_name,
)
from orchestrator.events import EventType
from orchestrator.model import JobKey, JobSpec, JobStatus, WorkerPhase
from orchestrator.signals import Signal, SignalKind

EPOCH = datetime(2025, 1, 1, tzinfo=UTC)
KEY = JobKey("team-a", "train")
"""The job the tests run; its identity in storage is ``team-a/train``."""


class FakeClock:
    """Time that moves only when told; ``sleep`` moves it and remembers how long was "slept"."""

    def __init__(self, start: datetime = EPOCH) -> None:
        self._now = start
        self._monotonic = 1000.0
        self.slept = 0.0

    def now(self) -> datetime:
        return self._now

    def monotonic(self) -> float:
        return self._monotonic

    def sleep(self, seconds: float) -> None:
        self.slept += seconds
        self.advance(seconds)

    def advance(self, seconds: float) -> None:
        self._now += timedelta(seconds=seconds)
        self._monotonic += seconds

    def step_wall(self, seconds: float) -> None:
        """An NTP step, or a VM resumed: the wall clock jumps, the monotonic one does not."""
        self._now += timedelta(seconds=seconds)

    def at(self) -> float:
        """Seconds since EPOCH: what the tests' timelines are written in."""
        return (self._now - EPOCH).total_seconds()


class FlakyStorage(FileStorage):
    """A real folder store whose listings fail while ``down`` (throttling, a network partition)."""

    def __init__(self, root: str) -> None:
        super().__init__(root)
        self.down = False
        self.failed_lists = 0

    def _check(self) -> None:
        if self.down:
            self.failed_lists += 1
            raise TransientStorageError(f"{self.uri}: connection reset (still failing after retries)")

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        self._check()
        return super().list(prefix)

    def list_dirs(self, prefix: str = "") -> builtins.list[str]:
        self._check()
        return super().list_dirs(prefix)


def commit_checkpoint(
    storage: Storage,
    step: int,
    created_at: datetime,
    *,
    job: str | None = str(KEY),
    trigger: str | None = None,
    attempt: int | None = None,
) -> None:
    """Commit a small valid checkpoint at ``step`` the way rank 0 does: files first, manifest last.

    ``attempt`` is the writer's attempt number (``SPOTJOB_ATTEMPT``), which fencing judges.
    """
    folder = folder_name(step)
    shard = f"step {step}".encode()
    storage.put_bytes(f"{folder}/{rank_file_name(0)}", shard)
    manifest = Manifest(
        step=step,
        world_size=1,
        created_at=created_at,
        torch_version="fake",
        job=job,
        state_keys=["model"],
        files=[FileEntry(path=rank_file_name(0), size=len(shard), crc32c=to_hex(crc32c_bytes(shard)))],
        trigger=trigger,
        attempt=attempt,
    )
    storage.put_bytes_if_absent(f"{folder}/{MANIFEST_NAME}", manifest.to_json())


@dataclass(frozen=True)
class FakeNode:
    name: str
    zone: str
    instance_type: str
    capacity: str = "spot"


CAPACITY_SELECTOR = "capacity-type"
"""The nodeSelector key the fake scheduler honours (its value: a ``FakeNode.capacity``)."""


FlushOutcome = Literal["commit", "fail", "hang", "reused"]


@dataclass
class FakeWorker:
    name: str
    attempt: int
    index: int
    node: FakeNode | None
    created_at: datetime
    resumed_from: int
    job: JobKey = KEY
    running_at: datetime | None = None
    exit_code: int | None = None
    exited_at: datetime | None = None
    flush_requested_at: datetime | None = None
    frozen_step: int | None = None
    stopping_at: datetime | None = None
    save_requested_at: datetime | None = None
    saves_served: set[str] = field(default_factory=set)

    @property
    def phase(self) -> WorkerPhase:
        if self.exit_code is not None:
            return WorkerPhase.SUCCEEDED if self.exit_code == 0 else WorkerPhase.FAILED
        return WorkerPhase.RUNNING if self.running_at is not None else WorkerPhase.PENDING


@dataclass
class FakeBackend:
    """Workers that train by the fake clock. Records every call the reconciler makes."""

    clock: FakeClock
    storage: Storage
    nodes: list[FakeNode]
    start_seconds: float = 5.0
    steps_per_second: float = 1.0
    flush_seconds: float = 3.0
    flush_outcome: FlushOutcome = "commit"
    total_steps: int | None = None
    stop_seconds: float = 0.0
    sidecars: bool = False
    """Every worker has a sidecar that runs on after it exited: an exited worker holds its node
    until it is stopped (``WorkerObservation.holds_node``)."""
    reports_steps: bool = True
    """False: the workers' scripts report no step (no Checkpointer), as observed."""
    workers: dict[str, FakeWorker] = field(default_factory=dict)
    notices: list[Signal] = field(default_factory=list)
    start_calls: list[tuple[int, Placement]] = field(default_factory=list)
    created: list[str] = field(default_factory=list)
    stop_calls: list[int | None] = field(default_factory=list)
    """``keep_attempt`` of each ``stop_workers`` call."""
    stop_flushes: list[bool] = field(default_factory=list)
    """``flush`` of each ``stop_workers`` call."""
    stopped_without_flush: list[str] = field(default_factory=list)
    """Workers alive when a ``flush=False`` stop reached them (their agents got POST /stop)."""
    flush_calls: list[tuple[str, str, datetime | None]] = field(default_factory=list)
    flush_answers: dict[str, list[FlushRequestState]] = field(default_factory=dict)
    commits: list[int] = field(default_factory=list)
    unreachable_agents: set[str] = field(default_factory=set)
    problems: list[str] = field(default_factory=list)
    """What ``spec_problems`` answers."""
    hidden_once: set[str] = field(default_factory=set)
    fail_calls: int = 0
    list_calls: int = 0
    save_calls: list[tuple[str, str]] = field(default_factory=list)
    """(worker, request id) of each ``request_save`` call."""
    start_specs: list[JobSpec] = field(default_factory=list)
    """The spec of each ``start_workers`` call (the fallback's template merged in or not)."""
    not_starting: dict[str, tuple[str, str]] = field(default_factory=dict)
    """Workers (by name) placed but not starting, with the kubelet's (reason, message): an image
    that cannot be pulled. They stay Pending while they are named here."""
    details: dict[str, str] = field(default_factory=dict)
    """Workers (by name) whose pods tell why they ended (``WorkerObservation.detail``)."""
    answered: dict[str, str] = field(default_factory=dict)
    """Workers (by name) whose agent's exit 75 says what its flush answered
    (``WorkerObservation.flush_answered``)."""
    ranks_states: dict[str, str | None] = field(default_factory=dict)
    """Workers (by name) whose agents report this state of their ranks (None: no report); others
    say ``flushing`` once asked to flush, else ``training``, while they run."""
    restores: dict[str, tuple[int, str | None]] = field(default_factory=dict)
    """Workers (by name) whose agents report what their ranks restored (``WorkerObservation.restored``):
    the step, and why they passed over a newer checkpoint."""
    held: dict[str, HeldNoticeReport] = field(default_factory=dict)
    """Workers (by name) whose agents hold a cloud notice (``WorkerObservation.held_notice``), as
    their ``GET /status`` would report it; the agent's own holding and flushing is not modelled."""

    # -- the Backend protocol ----------------------------------------------------------------
    def spec_problems(self, key: JobKey, spec: JobSpec) -> list[str]:
        return list(self.problems)

    def start_workers(self, key: JobKey, spec: JobSpec, attempt: int, placement: Placement) -> None:
        self._maybe_fail()
        self.start_calls.append((attempt, placement))
        self.start_specs.append(spec)
        self._evolve()
        resumed = latest_valid(self.storage)
        # One worker of an attempt per node (the pod anti-affinity), counting those placed earlier.
        taken = {w.node.name for w in self.workers.values() if (w.job, w.attempt) == (key, attempt) and w.node}
        wanted = ((spec.template or {}).get("spec") or {}).get("nodeSelector", {}).get(CAPACITY_SELECTOR)
        for index in range(spec.replicas):
            name = worker_name(key, attempt, index)
            if name in self.workers:
                w = self.workers[name]
                if w.node is None:  # the scheduler tries again: capacity may have appeared
                    w.node = self._place(placement, taken, wanted)
                    if w.node is not None:
                        taken.add(w.node.name)
                        w.created_at = self.clock.now()
                continue  # idempotent: this attempt's worker exists
            node = self._place(placement, taken, wanted)
            if node is not None:
                taken.add(node.name)
            self.workers[name] = FakeWorker(
                name=name,
                attempt=attempt,
                index=index,
                node=node,
                created_at=self.clock.now(),
                resumed_from=resumed.ref.step if resumed else 0,
                job=key,
            )
            self.created.append(name)

    def stop_workers(
        self,
        key: JobKey,
        spec: JobSpec,
        *,
        keep_attempt: int | None = None,
        flush: bool = True,
        keep_exited: bool = False,
    ) -> None:
        self._maybe_fail()
        self.stop_calls.append(keep_attempt)
        self.stop_flushes.append(flush)
        for w in list(self.workers.values()):
            if w.attempt == keep_attempt or w.job != key:
                continue
            if keep_exited and w.exit_code is not None and not self.sidecars:
                continue  # exited and holding no node: kept, as a finished job's pod stays
            if not flush and w.exit_code is None and w.stopping_at is None:
                self.stopped_without_flush.append(w.name)
            if self.stop_seconds <= 0:
                del self.workers[w.name]
            elif w.stopping_at is None:
                w.stopping_at = self.clock.now()

    def list_workers(self, key: JobKey, spec: JobSpec) -> list[WorkerObservation]:
        self._maybe_fail()
        self.list_calls += 1
        self._evolve()
        out = []
        for w in self.workers.values():
            if w.job != key:
                continue
            if w.name in self.hidden_once:
                self.hidden_once.discard(w.name)
                continue
            out.append(
                WorkerObservation(
                    name=w.name,
                    attempt=w.attempt,
                    index=w.index,
                    phase=w.phase,
                    node=w.node.name if w.node else None,
                    zone=w.node.zone if w.node else None,
                    instance_type=w.node.instance_type if w.node else None,
                    exit_code=w.exit_code,
                    step=self.step_of(w) if self.reports_steps else None,
                    unschedulable=None if w.node else f"0/{len(self.nodes)} nodes are available",
                    not_starting=self.not_starting.get(w.name) if w.phase is WorkerPhase.PENDING else None,
                    detail=self.details.get(w.name),
                    flush_answered=self.answered.get(w.name),
                    held_notice=self.held.get(w.name),
                    ranks_state=self._ranks_state(w),
                    restored=self.restores.get(w.name),
                    holds_node=self.sidecars and w.exit_code is not None and w.stopping_at is None,
                )
            )
        return out

    def _ranks_state(self, w: FakeWorker) -> str | None:
        if w.phase is not WorkerPhase.RUNNING:
            return None
        if w.name in self.ranks_states:
            return self.ranks_states[w.name]
        return "flushing" if w.flush_requested_at is not None else "training"

    def signals(self, key: JobKey, spec: JobSpec) -> list[Signal]:
        self._maybe_fail()
        return list(self.notices)

    def request_flush(
        self, key: JobKey, spec: JobSpec, worker: WorkerObservation, reason: str, deadline: datetime | None
    ) -> FlushRequestState:
        self.flush_calls.append((worker.name, reason, deadline))
        if worker.name in self.unreachable_agents:
            raise BackendError(f"agent of {worker.name} did not answer POST /flush")
        scripted = self.flush_answers.get(worker.name)
        answer = scripted.pop(0) if scripted else FlushRequestState.accepted()
        if answer.outcome is not FlushRequestOutcome.ACCEPTED:
            return answer
        self._evolve()
        w = self.workers[worker.name]
        if w.flush_requested_at is None:  # an agent keeps its first request
            w.flush_requested_at = self.clock.now()
            w.frozen_step = self.step_of(w)
        return answer

    def request_save(
        self, key: JobKey, spec: JobSpec, worker: WorkerObservation, request_id: str, reason: str
    ) -> FlushRequestState:
        self.save_calls.append((worker.name, request_id))
        self._evolve()
        w = self.workers[worker.name]
        if request_id not in w.saves_served and w.save_requested_at is None:  # once per request id
            w.saves_served.add(request_id)
            w.save_requested_at = self.clock.now()
        return FlushRequestState.accepted()

    # -- what the tests do to the world ------------------------------------------------------
    def notice(
        self, node: str, kind: SignalKind = SignalKind.SPOT_INTERRUPTION, *, seconds: float | None = 120.0
    ) -> Signal:
        deadline = self.clock.now() + timedelta(seconds=seconds) if seconds is not None else None
        signal = Signal(kind=kind, source="fake", node=node, deadline=deadline, detail="test notice")
        self.notices.append(signal)
        return signal

    def worker(self, attempt: int, index: int, *, job: JobKey = KEY) -> FakeWorker:
        return next(w for w in self.workers.values() if (w.attempt, w.index, w.job) == (attempt, index, job))

    def exit(self, attempt: int, index: int, code: int) -> None:
        w = self.worker(attempt, index)
        w.frozen_step = self.step_of(w)
        w.exit_code, w.exited_at = code, self.clock.now()

    def agent_hears_notice(self, attempt: int, index: int, *, commit: bool = True) -> None:
        """The agent heard the notice itself: the gang saves its current step, the agent exits 75."""
        w = self.worker(attempt, index)
        step = self.step_of(w)
        assert step is not None, "only a running agent hears a notice"
        if commit:
            self._commit(step, attempt=w.attempt, job=w.job)
        self.exit(attempt, index, EXIT_PREEMPTED if commit else EXIT_FLUSH_FAILED)

    def vanish(self, attempt: int, index: int) -> None:
        del self.workers[self.worker(attempt, index).name]

    def nodes_of(self, attempt: int) -> list[str]:
        return sorted(w.node.name for w in self.workers.values() if w.attempt == attempt and w.node is not None)

    def flushes_asked(self) -> list[str]:
        return [name for name, _, _ in self.flush_calls]

    # -- the fake world ------------------------------------------------------------------------
    def step_of(self, w: FakeWorker) -> int | None:
        if w.frozen_step is not None:
            return w.frozen_step
        if w.running_at is None:
            return None
        trained = math.floor((self.clock.now() - w.running_at).total_seconds() * self.steps_per_second)
        return w.resumed_from + trained

    def _evolve(self) -> None:
        now = self.clock.now()
        for w in list(self.workers.values()):
            if w.stopping_at is not None and now >= w.stopping_at + timedelta(seconds=self.stop_seconds):
                del self.workers[w.name]
                continue
            if w.exit_code is not None or w.node is None:
                continue
            if w.name in self.not_starting:
                continue
            if w.running_at is None and now >= w.created_at + timedelta(seconds=self.start_seconds):
                w.running_at = w.created_at + timedelta(seconds=self.start_seconds)
            if w.running_at is None:
                continue
            if (
                w.save_requested_at is not None
                and self.flush_outcome != "hang"
                and now >= w.save_requested_at + timedelta(seconds=self.flush_seconds)
            ):
                saved_at = w.save_requested_at + timedelta(seconds=self.flush_seconds)
                w.save_requested_at = None
                step = self.step_of(w)
                assert step is not None
                self._commit(step, at=saved_at, attempt=w.attempt, job=w.job, trigger="early")
            if w.flush_requested_at is not None:
                done_at = w.flush_requested_at + timedelta(seconds=self.flush_seconds)
                if self.flush_outcome != "hang" and now >= done_at:
                    if self.flush_outcome == "commit":
                        assert w.frozen_step is not None
                        self._commit(w.frozen_step, at=done_at, attempt=w.attempt, job=w.job)
                    w.exit_code = EXIT_PREEMPTED if self.flush_outcome in ("commit", "reused") else EXIT_FLUSH_FAILED
                    w.exited_at = done_at
                continue
            if self.total_steps is not None:
                step = self.step_of(w)
                assert step is not None
                if step >= self.total_steps:
                    w.frozen_step = self.total_steps
                    w.exit_code, w.exited_at = 0, now

    def _commit(
        self,
        step: int,
        *,
        at: datetime | None = None,
        attempt: int | None = None,
        job: JobKey = KEY,
        trigger: str = "flush",
    ) -> None:
        try:
            commit_checkpoint(
                self.storage, step, at or self.clock.now(), job=str(job), trigger=trigger, attempt=attempt
            )
        except AlreadyExistsError:
            return  # another agent of the gang committed this step already
        self.commits.append(step)

    def _place(self, placement: Placement, taken: set[str], capacity: str | None = None) -> FakeNode | None:
        free = [
            n
            for n in self.nodes
            if n.name not in placement.avoid_nodes and n.name not in taken and capacity in (None, n.capacity)
        ]
        preferred = [
            n
            for n in free
            if n.zone not in placement.avoid_zones and n.instance_type not in placement.avoid_instance_types
        ]
        choices = preferred or free
        return choices[0] if choices else None  # no capacity: the worker stays Pending

    def _maybe_fail(self) -> None:
        if self.fail_calls > 0:
            self.fail_calls -= 1
            raise BackendError("the API server answered 503")


@dataclass(frozen=True)
class EmittedEvent:
    key: JobKey
    type: EventType
    reason: str
    message: str
    node: str | None


@dataclass
class RecordingEventSink:
    """An ``EventSink`` that keeps every Event in order."""

    emitted: list[EmittedEvent] = field(default_factory=list)

    def emit(self, key: JobKey, type: EventType, reason: str, message: str, *, node: str | None = None) -> None:
        self.emitted.append(EmittedEvent(key, type, reason, message, node))

    def reasons(self, key: JobKey | None = None) -> list[str]:
        return [e.reason for e in self.emitted if key is None or e.key == key]


@dataclass
class RecordingMetrics:
    """A ``JobMetrics`` that keeps every call as ``(method, args)``."""

    calls: list[tuple[str, tuple[object, ...]]] = field(default_factory=list)

    def _record(self, name: str, *args: object) -> None:
        self.calls.append((name, args))

    def signal(self, kind: str, source: str) -> None:
        self._record("signal", kind, source)

    def flush_request(self, outcome: str) -> None:
        self._record("flush_request", outcome)

    def notice_to_commit(self, seconds: float) -> None:
        self._record("notice_to_commit", seconds)

    def preemption(self) -> None:
        self._record("preemption")

    def restart(self, cause: str) -> None:
        self._record("restart", cause)

    def lost_steps(self, steps: int) -> None:
        self._record("lost_steps", steps)

    def goodput(self, namespace: str, name: str, ratio: float) -> None:
        self._record("goodput", namespace, name, ratio)

    def job_state(self, namespace: str, name: str, status: JobStatus, max_restarts: int | None) -> None:
        self._record("job_state", namespace, name, status, max_restarts)

    def flush_ended(self, namespace: str, name: str, outcome: str, agents_failed: int) -> None:
        self._record("flush_ended", namespace, name, outcome, agents_failed)

    def job_deleted(self, namespace: str, name: str) -> None:
        self._record("job_deleted", namespace, name)

    def named(self, name: str) -> list[tuple[object, ...]]:
        return [args for n, args in self.calls if n == name]
