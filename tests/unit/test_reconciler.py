"""The recovery state machine, driven by a fake backend, a fake clock and a real folder store.

Timeline of the default world (seconds since EPOCH; polls: 2s starting, 10s running, 1s
flushing): attempt 0 starts at 0, its two workers run from 5 and the reconciler sees them at 6;
they train one step per second, so the step hint at time t is t - 5.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import Any

import pytest
from fakes import (
    EPOCH,
    KEY,
    FakeBackend,
    FakeClock,
    FakeNode,
    FlakyStorage,
    RecordingEventSink,
    RecordingMetrics,
    commit_checkpoint,
)
from pydantic import ValidationError

from agent.catalog import CheckpointRef, latest_valid
from agent.control_channel import EXIT_FLUSH_FAILED, EXIT_PREEMPTED
from agent.exit_codes import PEER_FLUSH
from agent.manifest import FORMAT_VERSION, MANIFEST_NAME
from agent.ownership import (
    ATTEMPTS_PREFIX,
    AttemptRecord,
    attempt_key,
    attempt_records,
    read_owner,
    record_attempt,
)
from agent.storage import MissingBucketError, PermanentStorageError, Storage, TransientStorageError, open_storage
from orchestrator.backends.base import BackendError, FlushRequestState, HeldNoticeReport
from orchestrator.cli import main as cli_main
from orchestrator.events import EventType
from orchestrator.model import (
    MAX_RESTART_HISTORY,
    Cause,
    CheckpointSpec,
    JobKey,
    JobSpec,
    JobStatus,
    Phase,
    describe_validation_error,
    job_name_problem,
)
from orchestrator.reconciler import Controller, Reconciler, ReconcileResult, ReconcilerOptions, job_identity
from orchestrator.signals import Signal, SignalKind
from orchestrator.store import ConflictError, JobExistsError, JobStore, JsonFileJobStore, StoredJob, StoreError

NODES = [
    FakeNode("n0", "zone-a", "g5.xlarge"),
    FakeNode("n1", "zone-a", "g5.xlarge"),
    FakeNode("n2", "zone-a", "g6.xlarge"),
    FakeNode("n3", "zone-b", "g5.xlarge"),
    FakeNode("n4", "zone-b", "g6.xlarge"),
]


@dataclass
class World:
    """One job (``KEY``: team-a/train), its store, its storage and its backend, all on one fake
    clock; the Events and metrics every reconciler of the world emitted."""

    tmp: str
    spec: JobSpec
    clock: FakeClock
    storage: FlakyStorage
    backend: FakeBackend
    store: JobStore
    key: JobKey = KEY
    events: RecordingEventSink = field(default_factory=RecordingEventSink)
    metrics: RecordingMetrics = field(default_factory=RecordingMetrics)
    options: ReconcilerOptions = field(default_factory=ReconcilerOptions)
    reconciler: Reconciler = field(init=False)
    results: list[ReconcileResult] = field(default_factory=list)
    next_at: float = 0.0
    """When the controller loop would run the next pass (seconds since EPOCH)."""
    last_pass_at: float = 0.0

    def __post_init__(self) -> None:
        self.restart_orchestrator()

    def restart_orchestrator(self) -> None:
        """A new controller process: fresh store object, fresh storage client, fresh reconciler."""
        self.store = JsonFileJobStore(os.path.join(self.tmp, "jobs"), fsync=False)
        self.new_reconciler()

    def new_reconciler(self, store: JobStore | None = None) -> None:
        self.store = store or self.store
        self.reconciler = Reconciler(
            self.store,
            self.backend,
            self.clock,
            events=self.events,
            metrics=self.metrics,
            storage_factory=self._open,
            options=self.options,
        )

    def _open(self, uri: str) -> Storage:
        # The world's job gets the flaky storage; another job of the same store a real folder.
        return self.storage if uri == self.spec.checkpoint.uri else open_storage(uri)

    def reconcile(self) -> ReconcileResult:
        result = self.reconciler.reconcile(self.key)
        self.results.append(result)
        self.last_pass_at = self.clock.at()
        self.next_at = self.last_pass_at + (result.requeue_after if result.requeue_after is not None else math.inf)
        return result

    def _next_pass(self) -> ReconcileResult:
        if self.next_at == math.inf:
            raise AssertionError(f"the job ended in {self.status.phase} before the test's goal")
        self.clock.sleep(max(0.0, self.next_at - self.clock.at()))
        return self.reconcile()

    @property
    def status(self) -> JobStatus:
        stored = self.store.get(self.key)
        assert stored is not None and stored.status is not None
        return stored.status

    def run_until(self, done: Callable[[JobStatus], bool], *, max_passes: int = 500) -> JobStatus:
        """Run passes on the controller loop's schedule until ``done(status)`` after one."""
        for _ in range(max_passes):
            self._next_pass()
            if done(self.status):
                return self.status
        raise AssertionError(f"not done after {max_passes} passes; phase {self.status.phase}")

    def run_to(self, at: float) -> JobStatus:
        """Run every pass due until ``at`` seconds, then let the clock reach ``at``."""
        while self.next_at <= at:
            self._next_pass()
        self.clock.advance(max(0.0, at - self.clock.at()))
        return self.status

    def event_reasons(self) -> list[str]:
        return self.events.reasons(self.key)


def make_world(tmp_path: Any, backend_options: dict[str, Any] | None = None, **spec: Any) -> World:
    clock = FakeClock()
    storage = FlakyStorage(str(tmp_path / "ckpt"))
    fields: dict[str, Any] = {
        "command": ["python", "train.py"],
        "replicas": 2,
        "checkpoint": {"uri": storage.uri},
        "flushTimeoutSeconds": 30,
        "restartBackoff": {"initialSeconds": 10, "maxSeconds": 80, "resetAfterSeconds": 600},
    }
    fields.update(spec)
    job = JobSpec.model_validate(fields)
    backend = FakeBackend(clock, storage, list(NODES), **(backend_options or {}))
    store = JsonFileJobStore(str(tmp_path / "jobs"), fsync=False)
    store.create(KEY, job)
    return World(str(tmp_path), job, clock, storage, backend, store)


@pytest.fixture
def world(tmp_path: Any) -> World:
    return make_world(tmp_path)


def phase_is(phase: Phase) -> Callable[[JobStatus], bool]:
    return lambda s: s.phase is phase


def running_attempt(n: int) -> Callable[[JobStatus], bool]:
    return lambda s: s.phase is Phase.RUNNING and s.attempt.number == n


def preempt_running_job(w: World, *, at: float = 100.0, node: str = "n0") -> Signal:
    """Run attempt 0 until ``at``, then a spot interruption notice for ``node``."""
    w.run_to(at)
    return w.backend.notice(node)


# -- every transition ---------------------------------------------------------------------------


def test_starts_the_first_attempt_and_stays_pending_until_every_worker_runs(world: World) -> None:
    first = world.reconcile()

    assert first.phase is Phase.PENDING
    assert first.requeue_after == 2.0
    assert world.backend.created == ["train-0-0", "train-0-1"]
    assert world.status.condition("Ready") is not None
    assert world.status.condition("Ready").status == "False"  # type: ignore[union-attr]

    status = world.run_until(phase_is(Phase.RUNNING))

    assert world.clock.at() == 6.0
    assert status.reason == "WorkersRunning"
    assert status.condition("Ready").status == "True"  # type: ignore[union-attr]
    assert status.start_time == EPOCH + timedelta(seconds=6)
    assert [w.node for w in status.workers] == ["n0", "n1"]
    # Asked again on every pass while starting (idempotent), the same placement each time.
    assert {call for call in world.backend.start_calls} == {(0, world.backend.start_calls[0][1])}
    assert world.backend.created == ["train-0-0", "train-0-1"], "each worker created once"


def test_succeeds_when_every_worker_exits_zero(tmp_path: Any) -> None:
    w = make_world(tmp_path, backend_options={"total_steps": 50})

    status = w.run_until(lambda s: s.phase.terminal)

    assert status.phase is Phase.SUCCEEDED
    assert status.reason == "Completed"
    assert status.completion_time is not None
    assert (status.restarts, status.preemptions) == (0, 0)
    assert w.results[-1].requeue_after is None
    assert w.reconcile().requeue_after is None, "a finished job needs no more passes"


def test_a_job_whose_script_reports_no_step_completes_saying_so_not_last_step_seen_none(tmp_path: Any) -> None:
    w = make_world(tmp_path, backend_options={"total_steps": 50, "reports_steps": False})

    status = w.run_until(lambda s: s.phase.terminal)

    assert (status.phase, status.reason) == (Phase.SUCCEEDED, "Completed")
    assert status.message == "every worker exited 0 (no step reported: the script has no Checkpointer)"
    counted = make_world(tmp_path / "counted", backend_options={"total_steps": 50})
    assert counted.run_until(lambda s: s.phase.terminal).message.startswith("every worker exited 0 (last step seen ")


def test_a_finished_job_stops_the_workers_whose_sidecars_would_hold_their_nodes_for_good(tmp_path: Any) -> None:
    plain = make_world(tmp_path / "plain", backend_options={"total_steps": 50})
    assert plain.run_until(lambda s: s.phase.terminal).phase is Phase.SUCCEEDED
    assert plain.backend.stop_calls == [], "nothing holds a node: the exited workers are left as they are"

    w = make_world(tmp_path / "sidecars", backend_options={"total_steps": 50, "sidecars": True})
    status = w.run_until(lambda s: s.phase.terminal)
    assert status.phase is Phase.SUCCEEDED and status.reason == "Completed"
    assert (w.backend.stop_calls, w.backend.stop_flushes) == ([None], [False])
    assert w.backend.workers == {}
    assert w.reconcile().requeue_after is None, "nothing left to stop"


def test_flushes_every_agent_when_a_spot_interruption_names_a_node_of_the_job(world: World) -> None:
    notice = preempt_running_job(world)

    status = world.run_until(phase_is(Phase.FLUSHING))

    assert status.reason == "SpotInterrupted"
    assert status.preemptions == 1 and status.restarts == 0
    assert status.condition("Flushing").status == "True"  # type: ignore[union-attr]
    assert sorted(world.backend.flushes_asked()) == ["train-0-0", "train-0-1"]
    _, reason, deadline = world.backend.flush_calls[0]
    assert "SpotInterruption for node n0" in reason
    assert deadline == notice.deadline
    assert status.recovery is not None and status.recovery.preempted[0].node == "n0"


def test_a_notice_for_another_node_during_the_flush_is_told_on_that_node_too(tmp_path: Any) -> None:
    """Notices for two nodes of the gang, one pass apart: only the first was told (SpotInterrupted);
    the second node showed only as an avoided node, on neither the job's Events nor its Node's.
    Found walking the test cluster."""
    w = make_world(tmp_path, backend_options={"flush_seconds": 25.0})
    preempt_running_job(w, node="n0")
    w.run_until(phase_is(Phase.FLUSHING))
    w.clock.sleep(5)
    w.backend.notice("n1")

    status = w.run_until(phase_is(Phase.RESCHEDULING))

    told = [e for e in w.events.emitted if e.reason == "SpotInterrupted"]
    assert [e.node for e in told] == ["n0", "n1"], "each node's Event names it (and is told on it)"
    assert "node n1" in told[1].message and "n0" not in told[1].message
    assert status.preemptions == 1, "one preemption of the gang"
    assert sorted(a.value for a in status.avoid if a.kind == "node") == ["n0", "n1"]


def test_reschedules_once_storage_holds_a_manifest_newer_than_before_the_flush(world: World) -> None:
    world.run_to(60)
    commit_checkpoint(world.storage, 50, world.clock.now())
    preempt_running_job(world)

    status = world.run_until(phase_is(Phase.RESCHEDULING))

    # Notice seen at 106 (step 101), flushed 3s later: the newer manifest ends the flush at once.
    assert world.clock.at() == 109.0
    assert world.backend.commits == [101]
    assert status.condition("Flushing").reason == "FlushCommitted"  # type: ignore[union-attr]
    assert status.last_checkpoint is not None and status.last_checkpoint.step == 101
    assert status.flushing_seconds == 3.0
    assert world.backend.stop_calls[0] is None, "the whole gang stops, not just the preempted worker"
    assert world.backend.workers == {}


def test_a_periodic_save_committed_during_the_flush_is_not_taken_for_the_flush(tmp_path: Any) -> None:
    w = make_world(tmp_path, backend_options={"flush_outcome": "hang"})
    w.run_to(60)
    preempt_running_job(w)
    w.run_until(phase_is(Phase.FLUSHING))
    # A save the ranks started before they agreed on the flush step commits now.
    commit_checkpoint(w.storage, 200, w.clock.now(), trigger="policy")

    status = w.run_until(phase_is(Phase.RESCHEDULING))

    assert status.condition("Flushing").reason == "FlushTimedOut"  # type: ignore[union-attr]
    assert status.last_checkpoint is not None and status.last_checkpoint.step == 200


@pytest.mark.parametrize(
    ("baseline", "save", "ends", "said"),
    [
        (50, 200, "exit", "no worker is left to flush and no flush was committed (a save committed step 200 "
         "meanwhile); resuming from step 200"),
        (None, None, "exit", "no worker is left to flush and nothing was committed; resuming from scratch"),
        (50, None, "exit", "no worker is left to flush and nothing newer than step 50 was committed; resuming "
         "from step 50"),
        (50, 200, "timeout", "no flush committed within 30s (a save committed step 200 meanwhile); resuming from "
         "step 200"),
        (None, None, "timeout", "nothing committed within 30s; resuming from scratch"),
        (50, None, "timeout", "nothing newer than step 50 committed within 30s; resuming from step 50"),
    ],
)  # fmt: skip
def test_a_flush_that_committed_nothing_says_what_was_committed_and_where_the_job_resumes(
    tmp_path: Any, baseline: int | None, save: int | None, ends: str, said: str
) -> None:
    """WorkersExited said "nothing newer than step 58 was committed; resuming from step 60" when a
    periodic save committed step 60 during the flush, and "nothing newer than nothing" with no
    checkpoint; FlushTimedOut shared the words."""
    w = make_world(tmp_path, backend_options={"flush_outcome": "hang"})
    w.run_to(60)
    if baseline is not None:
        commit_checkpoint(w.storage, baseline, w.clock.now())
    preempt_running_job(w)
    w.run_until(phase_is(Phase.FLUSHING))
    if save is not None:
        commit_checkpoint(w.storage, save, w.clock.now(), trigger="policy")
    if ends == "exit":  # the nodes died before the flush: no agent is left to commit it
        w.backend.exit(0, 0, 137)
        w.backend.exit(0, 1, 137)

    status = w.run_until(phase_is(Phase.RESCHEDULING))

    flushing = status.condition("Flushing")
    assert flushing is not None
    assert (flushing.reason, flushing.message.split("; not committed by")[0]) == (
        "WorkersExited" if ends == "exit" else "FlushTimedOut",
        said,
    )


def test_a_flush_that_reused_the_scripts_own_save_of_its_step_is_the_flush(tmp_path: Any) -> None:
    """The script's ``save()`` of the flush step committed (``trigger: save``) after the notice, and
    the agents' flush, finding that step committed, wrote nothing more and exited 75: that save is
    the flush's checkpoint, not "nothing newer committed"."""
    w = make_world(tmp_path, backend_options={"flush_outcome": "reused"})
    w.run_to(60)
    commit_checkpoint(w.storage, 50, w.clock.now())
    preempt_running_job(w)
    w.run_until(phase_is(Phase.FLUSHING))
    commit_checkpoint(w.storage, 101, w.clock.now(), trigger="save")

    status = w.run_until(phase_is(Phase.RESCHEDULING))

    assert status.condition("Flushing").reason == "FlushCommitted"  # type: ignore[union-attr]
    assert status.last_checkpoint is not None and status.last_checkpoint.step == 101


def test_reschedules_from_the_previous_checkpoint_when_the_flush_times_out(tmp_path: Any) -> None:
    w = make_world(tmp_path, backend_options={"flush_outcome": "hang"})
    w.run_to(60)
    commit_checkpoint(w.storage, 50, w.clock.now())
    preempt_running_job(w)

    status = w.run_until(phase_is(Phase.RESCHEDULING))

    assert w.clock.at() == 106.0 + 30.0
    assert status.condition("Flushing").reason == "FlushTimedOut"  # type: ignore[union-attr]
    assert status.last_checkpoint is not None and status.last_checkpoint.step == 50

    status = w.run_until(running_attempt(1))
    assert w.backend.worker(1, 0).resumed_from == 50


@pytest.mark.parametrize(
    ("hung", "said"),
    [
        ("training", "its agent last said its ranks were training: they had not taken the flush"),
        (None, "its agent said nothing of its ranks"),
    ],
)
def test_a_flush_a_hung_peer_held_past_its_timeout_names_the_workers_that_had_not_committed_their_part(
    tmp_path: Any, hung: str | None, said: str
) -> None:
    """Three workers; the ranks of train-0-2 never take the flush (a wedged rank, a hung node), and
    the others wait for them in its collectives. FlushTimedOut said only that nothing committed:
    which pod and node to look at was nobody's to tell. The Event and the Flushing condition now
    name the workers whose ranks had not committed their part, the one that never took the flush
    first, with what its agent said, and those whose ranks had."""
    w = make_world(tmp_path, backend_options={"flush_outcome": "hang"}, replicas=3)
    w.backend.ranks_states = {"train-0-2": hung, "train-0-1": "flushed"}
    w.run_to(60)
    preempt_running_job(w)

    status = w.run_until(phase_is(Phase.RESCHEDULING))

    flushing = status.condition("Flushing")
    assert flushing is not None and flushing.reason == "FlushTimedOut"
    expected = (
        f"; not committed by train-0-2 on n2 ({said}), "
        "train-0-0 on n0 (its ranks took the flush and wait for it to commit); committed by train-0-1"
    )
    assert flushing.message.endswith(expected), flushing.message
    (event,) = [e for e in w.events.emitted if e.reason == "FlushTimedOut"]
    assert event.message == flushing.message
    assert [args[2] for name, args in w.metrics.calls if name == "flush_ended"] == ["timed_out"]


def test_restarts_the_gang_away_from_the_preempted_node(world: World) -> None:
    preempt_running_job(world, node="n0")

    status = world.run_until(running_attempt(1))

    assert world.backend.nodes_of(1) == ["n1", "n2"]
    assert [(a.kind, a.value) for a in status.avoid] == [("node", "n0")]
    placement = world.backend.start_calls[-1][1]
    assert placement.avoid_nodes == {"n0"} and not placement.avoid_zones
    # When the cool-down began, for a backend whose node names name new machines later.
    ((name, began),) = placement.nodes_avoided_since
    assert name == "n0" and began == status.avoid[0].until - timedelta(seconds=1800)  # the default length
    assert status.reason == "WorkersRunning" and status.recovery is None
    assert status.condition("Ready").status == "True"  # type: ignore[union-attr]


def test_restarts_away_from_the_preempted_zone_and_instance_type_when_the_cooldown_says_so(tmp_path: Any) -> None:
    w = make_world(tmp_path, replicas=1, cooldown={"avoidZone": True, "avoidInstanceType": True, "seconds": 600})
    preempt_running_job(w, node="n0")

    status = w.run_until(running_attempt(1))

    assert w.backend.nodes_of(1) == ["n4"], "zone-b and not g5: the only node that avoids both"
    assert {(a.kind, a.value) for a in status.avoid} == {
        ("node", "n0"),
        ("zone", "zone-a"),
        ("instanceType", "g5.xlarge"),
    }


def test_forgets_an_avoided_node_once_its_cooldown_ends(tmp_path: Any) -> None:
    w = make_world(tmp_path, replicas=1, cooldown={"seconds": 60})
    preempt_running_job(w, node="n0")
    w.run_until(running_attempt(1))
    assert w.backend.nodes_of(1) == ["n1"]

    w.run_to(400)
    w.backend.notices.clear()  # n0 was replaced; its notice went with it
    w.backend.notice("n1")
    status = w.run_until(running_attempt(2))

    assert [(a.kind, a.value) for a in status.avoid] == [("node", "n1")]
    assert w.backend.nodes_of(2) == ["n0"]


def test_treats_an_agent_that_exits_75_on_its_own_as_a_preemption(world: World) -> None:
    world.run_to(100)
    world.backend.agent_hears_notice(0, 1)  # commits step 95, exits 75; no controller signal

    status = world.run_until(phase_is(Phase.RESCHEDULING))

    assert world.event_reasons()[-3:] == ["AgentPreempted", "FlushCommitted", "Rescheduled"]
    assert (status.preemptions, status.restarts) == (1, 0)
    assert status.recovery is not None and status.recovery.cause is Cause.PREEMPTION
    assert status.last_checkpoint is not None and status.last_checkpoint.step == 95
    assert [(a.kind, a.value) for a in status.avoid] == [("node", "n1")]


def test_a_flush_committed_before_the_controller_knew_of_it_claims_no_time_after_the_notice(world: World) -> None:
    """An agent that heard its notice itself flushed and exited 75 between two passes (as a gang
    whose driver was SIGKILLed flushes for the driver's death, found lost by ``--resume``): the pass
    that saw the recovery saw its flush committed. FlushCommitted said "0.0s after the notice"
    (from the recovery's detection, that same pass) and ``notice_to_commit`` counted 0 s, for a
    flush that took seconds nobody watched. Now the Event says so and the histogram counts none; a
    flush watched from its notice on keeps its seconds."""
    world.run_to(100)
    world.backend.agent_hears_notice(0, 1)  # commits step 95, exits 75; no controller signal

    world.run_until(phase_is(Phase.RESCHEDULING))

    [told] = [e for e in world.events.emitted if e.reason == "FlushCommitted"]
    assert "after the notice" not in told.message, told.message
    assert told.message.startswith("step 95 committed at file://") and "while nothing watched" in told.message
    assert world.metrics.named("notice_to_commit") == []

    world.run_until(running_attempt(1))
    world.backend.notice(world.backend.nodes_of(1)[0])  # heard by the controller, flushed 3 s later
    world.run_until(phase_is(Phase.RESCHEDULING))
    told = [e for e in world.events.emitted if e.reason == "FlushCommitted"][-1]
    assert told.message.endswith("3.0s after the notice"), told.message
    assert world.metrics.named("notice_to_commit") == [(3.0,)]


def test_agent_preempted_names_the_agent_that_heard_the_notice_not_a_peer_that_flushed_with_it(
    world: World,
) -> None:
    """Worker 1's agent heard a GCE host maintenance; worker 0's ranks flushed the same step with
    them, and both agents exited 75 before a pass looked. The Event named the first 75 in the list,
    worker 0, as the agent that "heard a notice itself", then quoted its exit line: its flush
    answered no notice of its own. It names worker 1 and the notice its flush answered."""
    world.run_to(100)
    heard, peer = world.backend.worker(0, 1).name, world.backend.worker(0, 0).name
    heard_node, peer_node = world.backend.worker(0, 1).node.name, world.backend.worker(0, 0).node.name
    world.backend.answered[heard] = "gcp maintenance: TERMINATE_ON_HOST_MAINTENANCE"
    world.backend.answered[peer] = PEER_FLUSH
    world.backend.agent_hears_notice(0, 1)
    world.backend.exit(0, 0, EXIT_PREEMPTED)

    status = world.run_until(phase_is(Phase.RESCHEDULING))

    [told] = [e for e in world.events.emitted if e.reason == "AgentPreempted"]
    assert told.message.startswith(f"the agent of {heard} on node "), told.message
    assert told.message.endswith("(its flush answered gcp maintenance: TERMINATE_ON_HOST_MAINTENANCE)"), told.message
    # Only the node of the agent that heard it is going away: the peer's is not avoided.
    assert heard_node != peer_node
    assert [(a.kind, a.value) for a in status.avoid] == [("node", heard_node)], status.avoid


def test_an_agent_whose_exit_line_does_not_say_what_its_flush_answered_has_its_node_avoided(
    tmp_path: Any,
) -> None:
    """Three agents exited 75 together: worker 1's line says it heard a notice, worker 0's that its
    ranks only flushed with it (``PEER_FLUSH``), and worker 2's says nothing (a termination message
    cut before its exit line, an agent older than those words). Worker 2's agent may well have heard
    a notice of its own: its node was left out of the cool-down, because another agent's line said
    it heard one. Only a line that says the agent heard none keeps its node from being avoided."""
    world = make_world(tmp_path, replicas=3)
    world.run_to(100)
    peer, heard, unsaid = (world.backend.worker(0, i) for i in range(3))
    world.backend.answered[heard.name] = "aws preemption: instance-action terminate"
    world.backend.answered[peer.name] = PEER_FLUSH
    world.backend.agent_hears_notice(0, 1)
    world.backend.exit(0, 0, EXIT_PREEMPTED)
    world.backend.exit(0, 2, EXIT_PREEMPTED)

    status = world.run_until(phase_is(Phase.RESCHEDULING))

    assert len({peer.node.name, heard.node.name, unsaid.node.name}) == 3
    avoided = sorted(a.value for a in status.avoid if a.kind == "node")
    assert avoided == sorted([heard.node.name, unsaid.node.name]), status.avoid


def test_agent_preempted_names_no_peer_whose_line_says_it_heard_none_when_another_line_does_not_say(
    world: World,
) -> None:
    """Both agents exited 75 together: worker 0's line says its ranks only flushed with another's
    (``PEER_FLUSH``), worker 1's says nothing (cut from its termination message, an older agent).
    The Event named worker 0 as the agent that "heard a notice itself", quoting its line that it
    heard none, and was told on worker 1's node, the one avoided."""
    world.run_to(100)
    peer, unsaid = world.backend.worker(0, 0), world.backend.worker(0, 1)
    world.backend.answered[peer.name] = PEER_FLUSH
    world.backend.agent_hears_notice(0, 1)
    world.backend.exit(0, 0, EXIT_PREEMPTED)

    status = world.run_until(phase_is(Phase.RESCHEDULING))

    [told] = [e for e in world.events.emitted if e.reason == "AgentPreempted"]
    assert told.message == f"the agent of {unsaid.name} on node {unsaid.node.name} heard a notice itself and exited 75"
    assert told.node == unsaid.node.name
    assert [(a.kind, a.value) for a in status.avoid] == [("node", unsaid.node.name)], status.avoid


def test_agent_preempted_is_told_on_the_node_of_the_agent_it_names(world: World) -> None:
    """Worker 1's line says it heard a notice, worker 0's says nothing: both nodes are avoided, and
    the Event that names worker 1 was told on worker 0's node (the first of them)."""
    world.run_to(100)
    unsaid, heard = world.backend.worker(0, 0), world.backend.worker(0, 1)
    world.backend.answered[heard.name] = "aws preemption: instance-action terminate"
    world.backend.agent_hears_notice(0, 1)
    world.backend.exit(0, 0, EXIT_PREEMPTED)

    status = world.run_until(phase_is(Phase.RESCHEDULING))

    [told] = [e for e in world.events.emitted if e.reason == "AgentPreempted"]
    assert told.message.startswith(f"the agent of {heard.name} on node {heard.node.name} "), told.message
    assert told.node == heard.node.name
    assert sorted(a.value for a in status.avoid) == sorted([unsaid.node.name, heard.node.name])


def test_a_peer_that_held_a_notice_of_its_own_when_it_flushed_with_another_has_its_node_avoided(
    tmp_path: Any,
) -> None:
    """Worker 0's agent held a GCE maintenance an hour off (``status.heldNotices``) when worker 1's
    agent heard a preemption: worker 0's ranks flushed with worker 1's, and its line says so
    (``PEER_FLUSH``). Its node goes at the maintenance all the same: it is avoided too. The fake
    backend reports what each agent's ``GET /status`` says; it does not model the agents."""
    world = make_world(tmp_path)
    world.run_to(100)
    peer, heard = world.backend.worker(0, 0), world.backend.worker(0, 1)
    now = world.clock.now()
    later = now + timedelta(minutes=55)
    world.backend.held = {
        peer.name: HeldNoticeReport("gcp", "maintenance", "MIGRATE_ON_HOST_MAINTENANCE", later, later, now)
    }
    assert [h.worker for h in world.run_to(world.clock.at() + 30).held_notices or []] == [peer.name]
    world.backend.answered[heard.name] = "aws preemption: instance-action terminate"
    world.backend.answered[peer.name] = PEER_FLUSH
    world.backend.agent_hears_notice(0, 1)
    world.backend.exit(0, 0, EXIT_PREEMPTED)

    status = world.run_until(phase_is(Phase.RESCHEDULING))

    avoided = sorted(a.value for a in status.avoid if a.kind == "node")
    assert avoided == sorted([heard.node.name, peer.node.name]), status.avoid


def test_a_peer_whose_exit_75_is_seen_before_the_agent_that_asked_is_not_taken_for_it(world: World) -> None:
    """Worker 1's agent heard a spot notice and its ranks flushed with worker 0's; worker 0's agent,
    whose line says it heard none (``PEER_FLUSH``), exited first, and a pass saw its 75 while
    worker 1's agent was still on its way out. That pass took the peer for the preemption: the
    Event said worker 0 "heard a notice itself", its node was avoided, and the node going away was
    not. The pass that sees only peers' 75s waits for the agent that asked."""
    world.run_to(100)
    peer, heard = world.backend.worker(0, 0), world.backend.worker(0, 1)
    world.backend.answered[heard.name] = "aws preemption: instance-action terminate"
    world.backend.answered[peer.name] = PEER_FLUSH
    step = world.backend.step_of(heard)
    assert step is not None
    world.backend._commit(step, attempt=0)  # the gang's flush, asked for by worker 1's agent
    world.backend.exit(0, 0, EXIT_PREEMPTED)  # the peer's exit comes first

    world.reconcile()  # sees the peer's 75 alone
    world.clock.advance(1)
    if heard.name in world.backend.workers:  # not stopped by that pass
        world.backend.exit(0, 1, EXIT_PREEMPTED)
    status = world.run_until(phase_is(Phase.RESCHEDULING))

    [told] = [e for e in world.events.emitted if e.reason == "AgentPreempted"]
    assert told.message.startswith(f"the agent of {heard.name} on node {heard.node.name} "), told.message
    assert [(a.kind, a.value) for a in status.avoid] == [("node", heard.node.name)], status.avoid
    assert world.event_reasons()[-2:] == ["FlushCommitted", "Rescheduled"]
    assert (status.preemptions, status.restarts) == (1, 0)


def test_a_peer_that_held_a_notice_and_exited_first_keeps_its_node_avoided_with_the_asker_s(
    tmp_path: Any,
) -> None:
    """Worker 0's agent held a GCE maintenance (``status.heldNotices``) when worker 1's heard a
    preemption; worker 0's ranks flushed with worker 1's and its 75 (``PEER_FLUSH``) was seen
    first. Taken at once, only worker 0's node was avoided, not the one of the agent that asked;
    waited for, the held notice must not be lost meanwhile (its worker no longer runs)."""
    world = make_world(tmp_path)
    world.run_to(100)
    peer, heard = world.backend.worker(0, 0), world.backend.worker(0, 1)
    now = world.clock.now()
    later = now + timedelta(minutes=55)
    world.backend.held = {
        peer.name: HeldNoticeReport("gcp", "maintenance", "MIGRATE_ON_HOST_MAINTENANCE", later, later, now)
    }
    world.run_to(world.clock.at() + 30)
    world.backend.answered[heard.name] = "aws preemption: instance-action terminate"
    world.backend.answered[peer.name] = PEER_FLUSH
    step = world.backend.step_of(heard)
    assert step is not None
    world.backend._commit(step, attempt=0)
    world.backend.exit(0, 0, EXIT_PREEMPTED)  # the peer's exit comes first

    world.reconcile()
    world.clock.advance(1)
    world.reconcile()
    world.clock.advance(1)
    if heard.name in world.backend.workers:
        world.backend.exit(0, 1, EXIT_PREEMPTED)
    status = world.run_until(phase_is(Phase.RESCHEDULING))

    avoided = sorted(a.value for a in status.avoid if a.kind == "node")
    assert avoided == sorted([heard.node.name, peer.node.name]), status.avoid
    [told] = [e for e in world.events.emitted if e.reason == "AgentPreempted"]
    assert told.message.startswith(f"the agent of {heard.name} on node "), told.message


def test_a_peer_exit_75_seen_first_and_the_agent_that_asked_lost_avoids_the_lost_one_s_node(world: World) -> None:
    """While a peer's 75 waits for the agent that asked, that agent's worker vanishes with its node:
    the loss names the node going away (the peer's was avoided, the lost one's was not)."""
    world.run_to(100)
    peer, heard = world.backend.worker(0, 0), world.backend.worker(0, 1)
    heard_node = heard.node.name
    world.backend.answered[peer.name] = PEER_FLUSH
    step = world.backend.step_of(heard)
    assert step is not None
    world.backend._commit(step, attempt=0)
    world.backend.exit(0, 0, EXIT_PREEMPTED)

    world.reconcile()
    world.clock.advance(1)
    if heard.name in world.backend.workers:
        world.backend.vanish(0, 1)
    status = world.run_until(phase_is(Phase.RESCHEDULING))

    assert [(a.kind, a.value) for a in status.avoid] == [("node", heard_node)], status.avoid
    assert status.preemptions == 1


def test_a_peer_exit_75_waits_for_the_agent_that_asked_no_longer_than_the_flush_timeout(world: World) -> None:
    """The agent that asked never exits (it hangs): the peer's 75 is taken as it is once
    flushTimeoutSeconds (30 s here) have passed, so the preemption is never left unhandled."""
    world.run_to(100)
    peer = world.backend.worker(0, 0)
    world.backend.answered[peer.name] = PEER_FLUSH
    step = world.backend.step_of(peer)
    assert step is not None
    world.backend._commit(step, attempt=0)
    world.backend.exit(0, 0, EXIT_PREEMPTED)
    seen = world.clock.at()

    status = world.run_until(phase_is(Phase.RESCHEDULING))

    assert world.clock.at() - seen >= 30
    assert "AgentPreempted" in world.event_reasons()
    assert status.preemptions == 1


def test_an_agent_flush_recorded_before_its_exit_75_is_seen_is_still_that_flush_committed(tmp_path: Any) -> None:
    """Fails without the fix: an agent that held a notice (a GCE maintenance) flushed on its own; a
    pass recorded that checkpoint while the ranks were still stopping, and the next saw the exit 75.
    The flush was judged against its own step: "WorkersExited: ... nothing newer than step 95 was
    committed", and the flush-outcome metric counted a flush that committed nothing."""
    world = make_world(tmp_path, replicas=1)
    world.run_to(100)
    w = world.backend.worker(0, 0)
    step = world.backend.step_of(w)
    assert step is not None
    world.backend._commit(step, attempt=0)  # the agent's own flush (trigger "flush", this attempt)
    world.reconcile()
    assert world.status.phase is Phase.RUNNING
    assert world.status.last_checkpoint is not None and world.status.last_checkpoint.step == step
    world.backend.exit(0, 0, EXIT_PREEMPTED)

    status = world.run_until(phase_is(Phase.RESCHEDULING))

    assert world.event_reasons()[-3:] == ["AgentPreempted", "FlushCommitted", "Rescheduled"]
    assert status.recovery is not None and status.recovery.reason == "AgentPreempted"
    assert (status.preemptions, status.restarts) == (1, 0)
    assert status.last_checkpoint is not None and status.last_checkpoint.step == step


def test_treats_an_agent_that_exits_76_as_a_preemption_resuming_from_the_previous_checkpoint(
    world: World,
) -> None:
    world.run_to(60)
    commit_checkpoint(world.storage, 50, world.clock.now())
    world.run_to(100)
    world.backend.agent_hears_notice(0, 0, commit=False)  # exit 76: nothing committed

    status = world.run_until(phase_is(Phase.FLUSHING))
    assert status.reason == "AgentFlushFailed"
    assert world.backend.flushes_asked() == ["train-0-1"], "the survivor is asked; the exited agent is not"

    status = world.run_until(running_attempt(1))
    assert (status.preemptions, status.restarts) == (1, 0)
    assert world.backend.worker(1, 0).resumed_from == 101, "the survivor's flush committed step 101"


def test_an_agent_exiting_76_is_told_with_what_its_log_says_of_why_its_flush_committed_nothing(world: World) -> None:
    """AgentFlushFailed (its Event and the recovery's message) and FlushFailed said only "its flush
    committed nothing"; they now carry the agent's own exit line when the backend read it (the
    pod's termination message, a local worker's log), as WorkerInfraError does for 74."""
    world.run_to(100)
    said = "exiting 76: the flush failed: storage refused the upload (AccessDenied); kubectl logs train-0-0"
    world.backend.details["train-0-0"] = said
    world.backend.agent_hears_notice(0, 0, commit=False)  # exit 76: nothing committed

    status = world.run_until(phase_is(Phase.FLUSHING))

    assert status.recovery is not None and status.recovery.reason == "AgentFlushFailed"
    assert f"its flush committed nothing; its log says: {said}" in status.recovery.message, status.recovery.message
    assert any(said in e.message for e in world.events.emitted if e.reason == "AgentFlushFailed")
    survivor = "exiting 76: the flush committed no checkpoint: the command ended before its ranks reported one"
    world.backend.details["train-0-1"] = survivor
    world.backend.exit(0, 1, EXIT_FLUSH_FAILED)  # the survivor's flush fails too

    world.run_until(phase_is(Phase.RESCHEDULING))

    (failed,) = [e.message for e in world.events.emitted if e.reason == "FlushFailed"]
    assert failed == f"the agent of train-0-1 exited 76: its flush committed nothing; its log says: {survivor}"


def test_treats_a_worker_that_vanishes_without_a_notice_as_a_lost_node_not_a_failure(world: World) -> None:
    world.run_to(100)
    world.backend.vanish(0, 1)

    status = world.run_until(phase_is(Phase.FLUSHING))

    assert status.reason == "WorkerLost"
    assert (status.preemptions, status.restarts) == (1, 0)
    assert world.backend.flushes_asked() == ["train-0-0"]
    status = world.run_until(running_attempt(1))
    assert "n1" not in world.backend.nodes_of(1)


def test_does_not_declare_a_worker_lost_when_it_blinks_out_of_one_listing(world: World) -> None:
    world.run_to(100)
    world.backend.hidden_once.add("train-0-1")

    status = world.run_to(200)

    assert status.phase is Phase.RUNNING and status.preemptions == 0
    assert world.backend.flush_calls == []


def test_ignores_notices_for_nodes_the_job_does_not_use_and_advisory_rebalances(world: World) -> None:
    world.run_to(50)
    world.backend.notice("n3")  # another job's node, or a stale message
    world.backend.notice("n0", SignalKind.REBALANCE)

    status = world.run_to(200)

    assert status.phase is Phase.RUNNING and status.preemptions == 0
    assert world.backend.flush_calls == [] and world.backend.stop_calls == []


def test_attributes_a_crash_on_a_node_with_a_notice_to_the_preemption(world: World) -> None:
    world.run_to(100)
    world.backend.notice("n0")
    world.backend.exit(0, 0, 143)  # SIGTERM from the node's shutdown

    status = world.run_until(phase_is(Phase.RESCHEDULING))

    assert (status.preemptions, status.restarts) == (1, 0)


def test_waits_for_the_old_gang_to_be_gone_before_starting_the_next_attempt(tmp_path: Any) -> None:
    w = make_world(tmp_path, backend_options={"stop_seconds": 25, "flush_outcome": "hang"})
    preempt_running_job(w)

    w.run_until(running_attempt(1))

    # The flush timed out at 136 with the workers still running; the backoff would allow 146,
    # but the old workers took until 161 to go.
    assert w.backend.worker(1, 0).created_at == EPOCH + timedelta(seconds=162)
    assert w.backend.stop_calls.count(1) >= 2, "keeps stopping the leftovers, sparing attempt 1"


def test_asks_an_unreachable_agent_again_but_never_asks_an_agent_twice(world: World) -> None:
    preempt_running_job(world)
    world.backend.unreachable_agents.add("train-0-1")
    world.run_until(phase_is(Phase.FLUSHING))
    world.clock.sleep(1)
    world.reconcile()
    world.backend.unreachable_agents.clear()
    world.clock.sleep(1)
    world.reconcile()

    asked = world.backend.flushes_asked()
    assert asked.count("train-0-0") == 1
    assert asked.count("train-0-1") == 3
    assert "FlushRequestFailed" in world.event_reasons()
    recovery = world.status.recovery
    assert recovery is not None and sorted(recovery.flush_requested) == ["train-0-0", "train-0-1"]


# -- budgets ------------------------------------------------------------------------------------


def preempt_five_times(w: World, *, commit: bool) -> list[float]:
    """Five preemptions in a row, each heard by the running attempt's agent; the delay from each
    Rescheduling to the next attempt's workers."""
    stops: list[float] = []
    starts: list[float] = []
    w.run_until(phase_is(Phase.RUNNING))
    for n in range(1, 6):
        w.backend.agent_hears_notice(n - 1, 0, commit=commit)
        w.run_until(phase_is(Phase.RESCHEDULING))
        stops.append(w.clock.at())
        w.run_until(running_attempt(n))
        starts.append((w.backend.worker(n, 0).created_at - EPOCH).total_seconds())
    return [s - t for s, t in zip(starts, stops, strict=True)]


def test_preemptions_never_consume_max_restarts_and_restart_at_once_when_they_committed_progress(
    tmp_path: Any,
) -> None:
    w = make_world(tmp_path, replicas=1, maxRestarts=0, cooldown={"seconds": 0})

    delays = preempt_five_times(w, commit=True)

    status = w.status
    assert (status.preemptions, status.restarts, status.consecutive_restarts) == (5, 0, 5)
    assert status.phase is Phase.RUNNING
    # Each flush committed a step past the attempt's start: no loop, the pass after the stop starts it.
    assert delays == [0, 0, 0, 0, 0]


def test_preemptions_that_committed_nothing_back_off_exponentially_up_to_the_cap(tmp_path: Any) -> None:
    w = make_world(tmp_path, replicas=1, maxRestarts=0, cooldown={"seconds": 0})

    delays = preempt_five_times(w, commit=False)

    assert (w.status.preemptions, w.status.restarts) == (5, 0)
    assert delays == [10, 20, 40, 80, 80]


def test_an_attempt_that_ran_long_enough_resets_the_backoff(tmp_path: Any) -> None:
    w = make_world(tmp_path, replicas=1, cooldown={"seconds": 0})
    w.run_until(phase_is(Phase.RUNNING))
    w.backend.agent_hears_notice(0, 0, commit=False)
    w.run_until(running_attempt(1))
    w.backend.agent_hears_notice(1, 0, commit=False)
    w.run_until(running_attempt(2))
    assert w.status.consecutive_restarts == 2

    w.run_to(w.clock.at() + 700)
    w.backend.agent_hears_notice(2, 0, commit=False)
    status = w.run_until(phase_is(Phase.RESCHEDULING))

    assert status.consecutive_restarts == 1
    assert status.recovery is not None and status.recovery.restart_at == w.clock.now() + timedelta(seconds=10)


def test_crashes_of_the_users_code_consume_max_restarts_and_back_off_too(tmp_path: Any) -> None:
    w = make_world(tmp_path, maxRestarts=2)
    w.run_to(100)
    w.backend.exit(0, 1, 1)

    status = w.run_until(phase_is(Phase.RESCHEDULING))

    assert (status.restarts, status.preemptions) == (1, 0)
    assert status.recovery is not None and status.recovery.cause is Cause.FAILURE
    assert w.backend.flush_calls == [], "a crash is not flushed: the gang is broken"
    assert status.avoid == [], "a crash says nothing about the node"
    assert "WorkerFailed" in w.event_reasons()
    status = w.run_until(running_attempt(1))
    assert status.restarts == 1


def test_fails_the_job_with_a_clear_reason_when_the_restart_budget_is_exhausted(tmp_path: Any) -> None:
    w = make_world(tmp_path, maxRestarts=2)
    for attempt in range(3):
        w.run_until(running_attempt(attempt))
        w.run_to(w.clock.at() + 30)
        w.backend.exit(attempt, 0, 3)

    status = w.run_until(lambda s: s.phase.terminal)

    assert status.phase is Phase.FAILED
    assert status.reason == "RestartBudgetExhausted"
    assert status.message == "worker train-2-0 exited with code 3 and all 2 restart(s) are used"
    assert status.restarts == 2
    assert w.backend.stop_calls[-1] is None, "the survivors of the last attempt are stopped"
    assert w.results[-1].requeue_after is None


def test_a_failed_job_stops_its_live_workers_and_keeps_the_exited_ones_for_their_logs(tmp_path: Any) -> None:
    """A user walk: a job out of restarts had every pod deleted right after it Failed, the crashed
    worker's with it, so the ``kubectl logs`` that README and ``Next:`` point to found nothing. A
    Succeeded job's pods stayed. Now the stop frees what still runs (the healthy peer, without a
    flush) and leaves the workers that exited, on this pass and every later one."""
    w = make_world(tmp_path, maxRestarts=0)
    w.run_to(100)
    w.backend.exit(0, 1, 1)  # the user's code failed on worker 1; worker 0 still trains

    status = w.run_until(lambda s: s.phase.terminal)

    assert (status.phase, status.reason) == (Phase.FAILED, "RestartBudgetExhausted")
    assert w.backend.stopped_without_flush == ["train-0-0"], "the live peer is stopped, without a flush"
    assert list(w.backend.workers) == ["train-0-1"], "the failed worker stays"
    assert w.backend.worker(0, 1).exit_code == 1
    for _ in range(3):
        w.clock.advance(60)
        w.reconcile()
    assert list(w.backend.workers) == ["train-0-1"], "later passes leave it too"


# -- infrastructure errors ----------------------------------------------------------------------


def test_unreachable_storage_shows_in_degraded_and_holds_the_restart_with_backoff_not_a_failure(
    world: World,
) -> None:
    preempt_running_job(world)
    world.run_until(phase_is(Phase.FLUSHING))
    world.storage.down = True

    status = world.run_until(phase_is(Phase.RESCHEDULING))
    degraded = status.condition("Degraded")
    assert degraded is not None and degraded.status == "True" and degraded.reason == "StorageUnreachable"
    # Storage could not confirm the commit; every agent exited after its flush, so nothing more can come.
    assert status.condition("Flushing").reason == "WorkersExited"  # type: ignore[union-attr]

    delays = [world.results[-1].requeue_after]
    for _ in range(4):
        delays.append(world._next_pass().requeue_after)
    assert world.status.phase is Phase.RESCHEDULING and world.status.attempt.started_at is None
    assert delays == [4.0, 8.0, 16.0, 32.0, 60.0]
    assert {a for a, _ in world.backend.start_calls} == {0}, "no attempt starts blind"

    world.storage.down = False
    status = world.run_until(running_attempt(1))
    assert (status.restarts, status.preemptions, status.infra_errors) == (0, 1, 0)
    assert status.condition("Degraded").status == "False"  # type: ignore[union-attr]
    assert world.backend.worker(1, 0).resumed_from == 101
    assert "StorageUnreachable" in world.event_reasons() and "Healthy" in world.event_reasons()


class RefusingStorage(FlakyStorage):
    """A real folder store whose listings are refused for good while ``refusal`` is set."""

    def __init__(self, root: str) -> None:
        super().__init__(root)
        self.refusal: PermanentStorageError | None = None

    def _check(self) -> None:
        if self.refusal is not None:
            raise self.refusal
        super()._check()


def refusing_world(tmp_path: Any, refusal: PermanentStorageError | None) -> tuple[World, RefusingStorage]:
    w = make_world(tmp_path)
    storage = RefusingStorage(str(tmp_path / "ckpt"))
    storage.refusal = refusal
    w.storage = storage
    w.backend.storage = storage
    w.new_reconciler()
    return w, storage


@pytest.mark.parametrize(
    "refusal",
    [
        MissingBucketError("the bucket 'team-a-ckpt' does not exist (spotjob never creates buckets)"),
        PermanentStorageError("permission denied: s3://team-a-ckpt/train (AccessDenied)"),
    ],
    ids=["missing bucket", "access denied"],
)
def test_storage_that_refuses_for_good_fails_the_job_at_once_with_the_remedy_before_anything_starts(
    tmp_path: Any, refusal: PermanentStorageError
) -> None:
    w, _ = refusing_world(tmp_path, refusal)

    result = w.reconcile()

    status = w.status
    assert (status.phase, status.reason) == (Phase.FAILED, "StorageRefused")
    assert str(refusal) in status.message and "fix the URI, the bucket or the credentials" in status.message
    assert result.requeue_after is None
    assert w.backend.start_calls == [], "nothing was started"
    assert w.event_reasons()[-1] == "StorageRefused"
    # The ended job's Degraded condition promised a wait ("no attempt can start until the bucket or
    # the credentials are fixed"), and its event came twice, as if a running job were retrying.
    degraded = status.condition("Degraded")
    assert degraded is not None and (degraded.status, degraded.reason) == ("True", "StorageRefused")
    assert str(refusal) in degraded.message and "the job has ended" in degraded.message
    assert "no attempt can start" not in degraded.message
    assert w.event_reasons().count("StorageRefused") == 1


def test_a_store_that_cannot_even_be_opened_fails_the_job_with_its_reason_instead_of_the_pass(tmp_path: Any) -> None:
    """``open_storage`` itself refuses for good when the client has no credentials to start with
    (no Google credentials, an AWS profile that does not exist). The pass used to crash on it:
    ``spotjob run`` ended in a traceback, the controller counted a reconcile error each pass."""
    w = make_world(tmp_path)
    refusal = PermanentStorageError("no Google credentials for gs://team-a-ckpt/train: (use workload identity, ...)")

    def refuse(uri: str) -> Storage:
        raise refusal

    w.reconciler = Reconciler(w.store, w.backend, w.clock, events=w.events, storage_factory=refuse, options=w.options)

    result = w.reconcile()

    status = w.status
    assert (status.phase, status.reason) == (Phase.FAILED, "StorageRefused")
    assert str(refusal) in status.message and "fix the URI, the bucket or the credentials" in status.message
    assert result.requeue_after is None and w.backend.start_calls == []


def test_storage_refusing_while_the_workers_run_is_degraded_not_a_failure_and_heals(tmp_path: Any) -> None:
    w, storage = refusing_world(tmp_path, None)
    w.run_to(50)
    storage.refusal = PermanentStorageError("permission denied: the controller's token expired")

    status = w.run_to(80)

    assert status.phase is Phase.RUNNING
    degraded = status.condition("Degraded")
    assert degraded is not None and (degraded.status, degraded.reason) == ("True", "StorageRefused")
    assert "no attempt can start" in degraded.message
    storage.refusal = None
    assert w.run_to(120).condition("Degraded").status == "False"  # type: ignore[union-attr]


def test_an_agent_exiting_74_restarts_the_gang_after_the_infra_backoff_without_spending_the_budget(
    tmp_path: Any,
) -> None:
    w = make_world(tmp_path, maxRestarts=0)  # a failure of the user's code would end the job
    w.run_to(100)
    w.backend.exit(0, 1, 74)

    status = w.run_until(phase_is(Phase.RESCHEDULING))

    assert (status.restarts, status.preemptions) == (0, 0)
    assert status.recovery is not None and status.recovery.cause is Cause.INFRASTRUCTURE
    assert status.recovery.reason == "WorkerInfraError" and "train-0-1" in status.recovery.message
    degraded = status.condition("Degraded")
    assert degraded is not None and degraded.status == "True" and degraded.reason == "WorkerInfraError"
    assert "WorkerInfraError" in w.event_reasons()
    assert w.backend.stop_calls[-1] is None, "the whole gang is stopped"
    assert w.backend.flush_calls == [] and status.avoid == [], "nothing to flush, nothing wrong with the node"
    # The infrastructure backoff (1 s first), not the restart backoff (10 s first).
    assert status.recovery.restart_at == w.clock.now() + timedelta(seconds=1)
    w._next_pass()
    degraded = w.status.condition("Degraded")
    assert degraded is not None and degraded.status == "True", "Degraded until the next attempt runs"

    status = w.run_until(running_attempt(1))
    assert (status.restarts, status.preemptions) == (0, 0)
    assert status.condition("Degraded").status == "False"  # type: ignore[union-attr]
    assert w.backend.created[-2:] == ["train-1-0", "train-1-1"]


def test_an_agent_exiting_74_is_told_with_what_its_pod_says_of_the_cause(tmp_path: Any) -> None:
    """The WorkerInfraError message (Event, Degraded, recovery) used to list the possible causes
    only; it now says the agent's own words when the backend has them (its "exiting 74" line)."""
    w = make_world(tmp_path)
    w.run_to(100)
    said = "exiting 74: torchrun's rendezvous port 29500 (--master-port 29500 on node rank 0) is taken"
    w.backend.details["train-0-0"] = said
    w.backend.exit(0, 0, 74)

    status = w.run_until(phase_is(Phase.RESCHEDULING))

    assert status.recovery is not None and said in status.recovery.message, status.recovery.message
    assert "the agent of train-0-0 on node" in status.recovery.message
    assert said in status.condition("Degraded").message  # type: ignore[union-attr]
    assert any(said in e.message for e in w.events.emitted if e.reason == "WorkerInfraError")


def test_an_agent_exiting_74_wins_over_its_peers_failing_in_the_same_pass(tmp_path: Any) -> None:
    w = make_world(tmp_path, maxRestarts=0)
    w.run_to(100)
    w.backend.exit(0, 0, 1)  # its peer lost the rendezvous and failed
    w.backend.exit(0, 1, 74)

    status = w.run_until(phase_is(Phase.RESCHEDULING))

    assert status.recovery is not None and status.recovery.cause is Cause.INFRASTRUCTURE
    assert status.restarts == 0


def test_infrastructure_errors_in_a_row_back_off_exponentially(tmp_path: Any) -> None:
    w = make_world(tmp_path, maxRestarts=0)
    delays = []
    for attempt in range(4):
        w.run_until(running_attempt(attempt))
        w.backend.exit(attempt, 0, 74)
        status = w.run_until(phase_is(Phase.RESCHEDULING))
        assert status.recovery is not None and status.recovery.restart_at is not None
        delays.append((status.recovery.restart_at - w.clock.now()).total_seconds())
    assert delays == [1.0, 2.0, 4.0, 8.0]
    assert (w.status.restarts, w.status.preemptions, w.status.phase) == (0, 0, Phase.RESCHEDULING)


def test_an_agent_stopped_through_its_api_is_neither_a_failure_nor_the_users_fault(tmp_path: Any) -> None:
    w = make_world(tmp_path, maxRestarts=0)
    w.run_to(100)
    w.backend.exit(0, 1, 79)

    status = w.run_until(lambda s: s.phase is not Phase.RUNNING)

    assert status.phase is Phase.FLUSHING and status.reason == "WorkerLost"
    assert status.restarts == 0


def test_a_worker_stopped_through_its_api_beside_a_failed_peer_is_that_failures_not_a_preemption(
    tmp_path: Any,
) -> None:
    w = make_world(tmp_path, maxRestarts=2)
    w.run_to(100)
    w.backend.exit(0, 0, 1)  # the user's code failed ...
    w.backend.exit(0, 1, 79)  # ... and this controller stopped the survivor (a pass whose write was lost)

    status = w.run_until(lambda s: s.phase is not Phase.RUNNING)

    assert status.phase is Phase.RESCHEDULING and status.reason == "Rescheduled"
    assert (status.restarts, status.preemptions) == (1, 0)
    assert status.restart_history[-1].reason == "WorkerFailed"


def test_a_failing_backend_is_retried_with_backoff_without_changing_the_phase(world: World) -> None:
    world.run_to(50)
    world.backend.fail_calls = 3
    workers_before = world.status.workers

    delays = [world.reconcile().requeue_after for _ in range(3)]

    assert delays == [1.0, 2.0, 4.0]
    status = world.status
    assert status.phase is Phase.RUNNING and status.workers == workers_before
    assert status.condition("Degraded").reason == "BackendUnavailable"  # type: ignore[union-attr]
    assert world.reconcile().requeue_after == 10.0
    assert world.status.condition("Degraded").status == "False"  # type: ignore[union-attr]


def test_an_invalid_checkpoint_uri_fails_the_job_at_once(tmp_path: Any) -> None:
    w = make_world(tmp_path)
    w.reconciler = Reconciler(w.store, w.backend, w.clock)  # the real open_storage
    store_path = os.path.join(w.tmp, "jobs", "team-a", "train.json")
    with open(store_path) as f:
        doc = json.load(f)
    doc["spec"]["checkpoint"]["uri"] = "ftp://example/ckpt"
    with open(store_path, "w") as f:
        json.dump(doc, f)

    status = w.run_until(lambda s: s.phase.terminal)

    assert status.phase is Phase.FAILED and status.reason == "InvalidCheckpointURI"
    assert "unsupported checkpoint URI scheme 'ftp'" in status.message
    assert w.backend.start_calls == []


# -- orchestrator restarts ----------------------------------------------------------------------


@dataclass(frozen=True)
class Outcome:
    phase: Phase
    restarts: int
    preemptions: int
    steps_lost: int
    last_step: int | None
    attempts: list[str]
    flushes: list[str]
    commits: list[int]


def preemption_to_success(w: World, *, interrupt: Callable[[World], bool] | None = None) -> Outcome:
    """A notice at 100 for n0, a committed flush, attempt 1 trains to step 300.

    ``interrupt(world)`` runs after every pass; it may restart the orchestrator and return True
    once it did, after which it is not called again.
    """
    for _ in range(500):
        if w.clock.at() >= 100 and not w.backend.notices:
            w.backend.notice("n0")
        try:
            result = w.reconcile()
        except StoreError:
            w.restart_orchestrator()
            w.clock.sleep(1)
            continue
        if interrupt is not None and interrupt(w):
            interrupt = None
        if result.requeue_after is None:
            break
        w.clock.sleep(result.requeue_after)
    s = w.status
    return Outcome(
        phase=s.phase,
        restarts=s.restarts,
        preemptions=s.preemptions,
        steps_lost=s.lost_steps,
        last_step=s.last_checkpoint.step if s.last_checkpoint else None,
        attempts=sorted(w.backend.created),
        flushes=sorted(set(w.backend.flushes_asked())),
        commits=w.backend.commits,
    )


MOMENTS: dict[str, Callable[[JobStatus], bool]] = {
    "Pending": phase_is(Phase.PENDING),
    "Running": phase_is(Phase.RUNNING),
    "Flushing": phase_is(Phase.FLUSHING),
    "Rescheduling, backing off": lambda s: s.phase is Phase.RESCHEDULING and s.attempt.started_at is None,
    "Rescheduling, next attempt started": lambda s: s.phase is Phase.RESCHEDULING and s.attempt.started_at is not None,
    "Running again": running_attempt(1),
}


@pytest.mark.parametrize("moment", list(MOMENTS))
def test_a_new_reconciler_carries_on_from_the_persisted_status_in_every_phase(tmp_path: Any, moment: str) -> None:
    expected = preemption_to_success(make_world(tmp_path / "uninterrupted", backend_options={"total_steps": 300}))
    w = make_world(tmp_path / "restarted", backend_options={"total_steps": 300})

    def restart(world: World) -> bool:
        if MOMENTS[moment](world.status):
            world.restart_orchestrator()
            return True
        return False

    outcome = preemption_to_success(w, interrupt=restart)

    assert outcome == expected
    assert outcome.phase is Phase.SUCCEEDED and (outcome.preemptions, outcome.restarts) == (1, 0)
    assert outcome.attempts == ["train-0-0", "train-0-1", "train-1-0", "train-1-1"]
    assert sorted(w.backend.flushes_asked()) == ["train-0-0", "train-0-1"], "no agent is asked twice"
    assert sorted(w.backend.created) == outcome.attempts, "each worker is created exactly once"


class LosesOneWrite(JsonFileJobStore):
    """A store that fails the first status write matching ``lose``: the controller died after acting."""

    def __init__(self, root: str, lose: Callable[[JobStatus, JobStatus], bool]) -> None:
        super().__init__(root, fsync=False)
        self.lose: Callable[[JobStatus, JobStatus], bool] | None = lose
        self.lost = 0

    def update_status(self, key: JobKey, status: JobStatus, *, version: str) -> StoredJob:
        stored = self.get(key)
        old = stored.status if stored is not None and stored.status is not None else JobStatus()
        if self.lose is not None and self.lose(old, status):
            self.lose, self.lost = None, 1
            raise StoreError("the controller was killed before its status write")
        return super().update_status(key, status, version=version)


def changes(before: Phase, after: Phase) -> Callable[[JobStatus, JobStatus], bool]:
    return lambda old, new: old.phase is before and new.phase is after


LOST_WRITES: dict[str, Callable[[JobStatus, JobStatus], bool]] = {
    "Pending to Running": changes(Phase.PENDING, Phase.RUNNING),
    "Running to Flushing (agents asked)": changes(Phase.RUNNING, Phase.FLUSHING),
    "Flushing to Rescheduling (gang stopped)": changes(Phase.FLUSHING, Phase.RESCHEDULING),
    "starting attempt 1": lambda old, new: (
        old.attempt.started_at is None and new.attempt.started_at is not None and new.attempt.number == 1
    ),
    "Rescheduling to Running": changes(Phase.RESCHEDULING, Phase.RUNNING),
    "Running to Succeeded": changes(Phase.RUNNING, Phase.SUCCEEDED),
}


@pytest.mark.parametrize("moment", list(LOST_WRITES))
def test_a_pass_whose_status_write_is_lost_is_replayed_without_counting_anything_twice(
    tmp_path: Any, moment: str
) -> None:
    expected = preemption_to_success(make_world(tmp_path / "clean", backend_options={"total_steps": 300}))
    w = make_world(tmp_path / "lossy", backend_options={"total_steps": 300})
    lossy = LosesOneWrite(os.path.join(w.tmp, "jobs"), LOST_WRITES[moment])
    w.new_reconciler(lossy)

    outcome = preemption_to_success(w)

    assert lossy.lost == 1
    # The replay runs a second later, so the flush may catch a later step; nothing else may differ.
    assert replace(outcome, last_step=None, commits=[]) == replace(expected, last_step=None, commits=[])
    assert len(outcome.commits) == 1


# -- status fields ------------------------------------------------------------------------------


def test_counts_the_steps_lost_when_the_flush_times_out_and_the_time_to_train_them_again(tmp_path: Any) -> None:
    w = make_world(tmp_path, backend_options={"flush_outcome": "hang"})
    w.run_to(60)
    commit_checkpoint(w.storage, 50, w.clock.now())
    preempt_running_job(w)

    status = w.run_until(running_attempt(1))

    # Last step seen 101 (the flush froze it at 106), committed 50: 51 steps at 1 step/s.
    assert status.lost_steps == 51
    assert status.retraining_seconds == pytest.approx(51.0)


def test_counts_no_steps_lost_when_the_flush_commits_the_last_step_seen(world: World) -> None:
    preempt_running_job(world)

    status = world.run_until(running_attempt(1))

    assert status.lost_steps == 0 and status.retraining_seconds == 0
    assert world.backend.worker(1, 0).resumed_from == 101


def every_pass_writes(w: World) -> World:
    """Goodput written on every pass, not only with a change or every minute (what the goodput
    tests read back from the stored status)."""
    w.options = ReconcilerOptions(status_refresh_seconds=0)
    w.new_reconciler()
    return w


def test_goodput_subtracts_flushing_restarting_and_retraining_time_from_wall_time(tmp_path: Any) -> None:
    w = every_pass_writes(make_world(tmp_path, backend_options={"flush_outcome": "hang"}))
    w.run_to(60)
    commit_checkpoint(w.storage, 50, w.clock.now())
    preempt_running_job(w)
    w.run_until(running_attempt(1))

    status = w.run_to(500)

    # Started at 6. Flush 106→136 (timeout); the first preemption waits for no backoff, so attempt
    # 1 starts as soon as the old gang is gone and runs at 144: restarting 8s.
    assert status.start_time == EPOCH + timedelta(seconds=6)
    assert status.flushing_seconds == 30.0
    assert status.restarting_seconds == 8.0
    assert status.retraining_seconds == pytest.approx(51.0)
    wall = w.last_pass_at - 6
    assert status.goodput == pytest.approx((wall - 30 - 8 - 51) / wall, abs=1e-4)


def test_goodput_counts_a_recovery_in_progress_up_to_now(world: World) -> None:
    every_pass_writes(world)
    preempt_running_job(world)
    world.run_until(phase_is(Phase.FLUSHING))  # at 106
    world.run_to(107)
    status = world.status

    assert status.goodput == pytest.approx((107 - 6 - 1) / (107 - 6), abs=1e-4)


def test_last_checkpoint_names_the_newest_valid_manifest_its_uri_and_time(world: World) -> None:
    world.run_to(30)
    commit_checkpoint(world.storage, 20, EPOCH + timedelta(seconds=25))
    world.storage.put_bytes("step-000000040/shard-0.bin", b"torn")  # a save that never committed

    status = world.run_to(50)

    assert status.last_checkpoint is not None
    assert status.last_checkpoint.step == 20
    assert status.last_checkpoint.uri == world.storage.url("step-000000020")
    assert status.last_checkpoint.time == EPOCH + timedelta(seconds=25)


def test_last_checkpoint_is_cleared_once_storage_holds_no_valid_one(world: World) -> None:
    """A fresh start retired every checkpoint (or someone emptied the URI): the status, and the
    STEP and CHECKPOINT columns of ``kubectl get sj``, must not go on naming one the job cannot
    resume from."""
    from agent._fresh_start import retire

    world.run_to(30)
    commit_checkpoint(world.storage, 20, EPOCH + timedelta(seconds=25))
    assert world.run_to(50).last_checkpoint is not None

    retire(world.storage, [(CheckpointRef(20), "the model changed shape")], job=str(KEY), attempt=0)
    status = world.run_to(70)

    assert status.last_checkpoint is None


def test_a_checkpoint_it_cannot_resume_from_is_warned_about_once_not_every_pass(
    world: World, caplog: pytest.LogCaptureFixture
) -> None:
    """A retired (or fenced, or foreign) folder stays the newest in storage for as long as the job
    trains below its step: a warning every pass would bury the controller's log."""
    from agent._fresh_start import retire

    world.run_to(30)
    commit_checkpoint(world.storage, 900, EPOCH + timedelta(seconds=25))
    retire(world.storage, [(CheckpointRef(900), "the model changed shape")], job=str(KEY), attempt=0)

    with caplog.at_level(logging.WARNING):
        world.run_to(200)

    skipped = [r.getMessage() for r in caplog.records if "skipping checkpoint" in r.getMessage()]
    assert len(world.results) > 5  # passes ran meanwhile
    assert len(skipped) == 1, skipped
    assert str(KEY) in skipped[0] and "step-000000900" in skipped[0] and "fresh start" in skipped[0]


def test_remembers_why_each_restart_happened_the_newest_twenty(tmp_path: Any) -> None:
    w = make_world(tmp_path, replicas=1, maxRestarts=30, cooldown={"seconds": 0})
    stopped_at = []
    w.run_until(running_attempt(0))
    for attempt, hit in enumerate(
        (
            lambda: w.backend.agent_hears_notice(0, 0),
            lambda: w.backend.exit(1, 0, 3),
            lambda: w.backend.exit(2, 0, 74),
        )
    ):
        hit()
        w.run_until(phase_is(Phase.RESCHEDULING))
        stopped_at.append(w.clock.now())
        w.run_until(running_attempt(attempt + 1))

    status = w.status
    assert [(h.attempt, h.cause, h.reason) for h in status.restart_history] == [
        (0, Cause.PREEMPTION, "AgentPreempted"),
        (1, Cause.FAILURE, "WorkerFailed"),
        (2, Cause.INFRASTRUCTURE, "WorkerInfraError"),
    ]
    assert [h.time for h in status.restart_history] == stopped_at
    assert status.restart_history[1].message == "worker train-1-0 exited with code 3; restart 1 of 30"

    for attempt in range(3, 3 + MAX_RESTART_HISTORY):
        w.backend.exit(attempt, 0, 1)
        w.run_until(running_attempt(attempt + 1))
    history = w.status.restart_history
    assert len(history) == MAX_RESTART_HISTORY
    assert [h.attempt for h in history] == list(range(3, 3 + MAX_RESTART_HISTORY)), "the newest, oldest first"


# -- the loop, the model, the store -------------------------------------------------------------


def test_the_controller_runs_a_job_through_preemptions_to_success_without_really_sleeping(tmp_path: Any) -> None:
    w = make_world(tmp_path, backend_options={"total_steps": 1000})
    w.backend.notice("n1", seconds=None)
    controller = Controller(w.reconciler, w.clock)

    began = time.monotonic()
    status = controller.run(KEY)

    assert status.phase is Phase.SUCCEEDED and status.preemptions == 1
    assert w.clock.slept > 1000, "a quarter of an hour of fake time"
    assert time.monotonic() - began < 10, "and no real sleeping"


def test_the_job_is_stored_as_the_resource_with_the_crds_camel_case_field_names(world: World) -> None:
    preempt_running_job(world)
    world.run_until(phase_is(Phase.RESCHEDULING))

    with open(os.path.join(world.tmp, "jobs", "team-a", "train.json")) as f:
        doc = json.load(f)

    assert (doc["apiVersion"], doc["kind"]) == ("spotjob.dev/v1alpha1", "SpotJob")
    meta = doc["metadata"]
    assert (meta["namespace"], meta["name"], meta["generation"]) == ("team-a", "train", 1)
    assert meta["resourceVersion"].isdigit() and meta["uid"]
    assert doc["spec"]["flushTimeoutSeconds"] == 30
    assert doc["spec"]["restartBackoff"] == {"initialSeconds": 10, "maxSeconds": 80, "resetAfterSeconds": 600}
    status = doc["status"]
    assert {"phase", "conditions", "restarts", "preemptions", "lastCheckpoint", "lostSteps"} <= set(status)
    assert {"flushingSeconds", "restartingSeconds", "goodput", "avoid", "recovery", "restartHistory"} <= set(status)
    assert status["observedGeneration"] == 1
    assert "events" not in status, "Events go to the event sink, not into the status"
    assert set(status["conditions"][0]) == {"type", "status", "reason", "message", "lastTransitionTime"}
    assert status["recovery"]["restartAt"].endswith("Z")
    assert JobStatus.model_validate(status) == world.status


def test_a_spec_with_a_bad_backoff_or_pod_template_is_refused_naming_the_field() -> None:
    base: dict[str, Any] = {"command": ["x"], "checkpoint": {"uri": "/tmp/c"}}

    def problem(**fields: Any) -> str:
        with pytest.raises(ValueError) as e:
            JobSpec.model_validate({**base, **fields})
        assert isinstance(e.value, ValidationError)
        return describe_validation_error(e.value, "spec")

    assert "maxSeconds" in problem(restartBackoff={"initialSeconds": 60, "maxSeconds": 10})
    assert problem(maxRestart=3).startswith("spec.maxRestart: Extra inputs are not permitted")
    assert problem(name="train").startswith("spec.name: Extra inputs"), "the name is metadata.name"
    assert problem(template={"spec": {"containers": []}}).startswith(
        "spec.template: spec.containers must list at least one container"
    )
    assert "spec.containers[1].name is required" in problem(
        template={"spec": {"containers": [{"name": "a", "image": "i"}, {"image": "i"}]}}
    )
    assert "has no image: set spec.image or template.spec.containers[0].image" in problem(
        template={"spec": {"containers": [{"name": "trainer"}]}}
    )
    assert "containerName 'main' names no container" in problem(
        template={"spec": {"containers": [{"name": "trainer", "image": "i"}]}}, containerName="main"
    )
    assert job_name_problem("Train_1") is not None and job_name_problem("x" * 41) is not None
    assert job_name_problem("x" * 40) is None

    spec = JobSpec.model_validate(
        {
            **base,
            "image": "registry/train:1",
            "containerName": "trainer",
            "template": {"spec": {"containers": [{"name": "sidecar", "image": "s"}, {"name": "trainer"}]}},
        }
    )
    assert spec.training_container() == (1, {"name": "trainer"})


def test_the_store_refuses_a_status_write_from_a_stale_read(tmp_path: Any) -> None:
    store = JsonFileJobStore(str(tmp_path))
    key = JobKey("team-a", "t")
    created = store.create(key, JobSpec(command=["x"], checkpoint=CheckpointSpec(uri="/tmp/c")))
    store.update_status(key, JobStatus(restarts=1), version=created.version)

    with pytest.raises(ConflictError):
        store.update_status(key, JobStatus(restarts=2), version=created.version)
    stored = store.get(key)
    assert stored is not None and stored.status is not None and stored.status.restarts == 1
    assert (stored.key, stored.generation, stored.uid, stored.invalid) == (key, 1, created.uid, None)
    assert store.keys() == [key]
    assert sorted(os.listdir(tmp_path / "team-a")) == [".t.lock", "t.json"], "no temp files left behind"
    with pytest.raises(JobExistsError):
        store.create(key, JobSpec(command=["x"], checkpoint=CheckpointSpec(uri="/tmp/c")))
    with pytest.raises(StoreError, match="DNS labels"):
        store.get(JobKey("..", "t"))


def test_the_store_hands_back_a_job_whose_spec_or_status_does_not_validate_naming_the_field(tmp_path: Any) -> None:
    store = JsonFileJobStore(str(tmp_path))
    good, bad_spec, bad_status = JobKey("a", "good"), JobKey("a", "bad-spec"), JobKey("a", "bad-status")
    spec = JobSpec(command=["x"], checkpoint=CheckpointSpec(uri="/tmp/c"))
    for key in (good, bad_spec, bad_status):
        store.create(key, spec)
    edit_document(store, bad_spec, lambda doc: doc["spec"].update(replicas=0))
    edit_document(store, bad_status, lambda doc: doc.update(status={"phase": "Sleeping"}))

    assert store.keys() == [bad_spec, bad_status, good]
    broken = store.get(bad_spec)
    assert broken is not None and broken.spec is None
    assert broken.invalid == "spec.replicas: Input should be greater than or equal to 1"
    unreadable = store.get(bad_status)
    assert unreadable is not None and unreadable.spec == spec and unreadable.status is None
    assert unreadable.invalid is not None and unreadable.invalid.startswith("status.phase: Input should be")
    fine = store.get(good)
    assert fine is not None and fine.invalid is None and fine.spec == spec


def edit_document(store: JsonFileJobStore, key: JobKey, change: Callable[[dict[str, Any]], None]) -> None:
    """Change a stored job's document behind the store's back (a user's edit, a bad write)."""
    with open(store.path(key)) as f:
        doc = json.load(f)
    change(doc)
    with open(store.path(key), "w") as f:
        json.dump(doc, f)


# -- ownership and fencing ----------------------------------------------------------------------


def test_claims_the_uri_for_the_job_and_records_each_attempt_with_what_it_resumes_from(world: World) -> None:
    world.reconcile()
    owner = read_owner(world.storage)
    assert job_identity(KEY) == "team-a/train"
    assert owner is not None and owner.job == "team-a/train", "the job's identity is namespace/name"
    [first] = attempt_records(world.storage, "team-a/train")
    assert (first.attempt, first.fence) == (0, None)

    preempt_running_job(world)
    world.run_until(running_attempt(1))

    records = attempt_records(world.storage, "team-a/train")
    assert [(r.attempt, r.fence) for r in records] == [(0, None), (1, CheckpointRef(101))]
    assert world.backend.worker(1, 0).resumed_from == 101


def test_a_second_job_on_the_uri_fails_naming_the_owner_until_the_uri_is_adopted(world: World) -> None:
    world.run_to(60)
    commit_checkpoint(world.storage, 50, world.clock.now())
    finetune = JobKey("team-a", "finetune")
    world.store.create(finetune, world.spec)

    world.reconciler.reconcile(finetune)

    stored = world.store.get(finetune)
    assert stored is not None and stored.status is not None
    status = stored.status
    assert status.phase is Phase.FAILED and status.reason == "CheckpointURIOwned"
    assert "belongs to job 'team-a/train'" in status.message
    assert f"spotjob ckpt adopt {world.storage.uri} --job team-a/finetune" in status.message
    assert "fresh checkpoint URI" in status.message
    assert not any(name.startswith("finetune") for name in world.backend.created), "finetune started nothing"
    assert world.status.phase is Phase.RUNNING, "the owner runs on"

    world.backend.stop_workers(KEY, world.spec)  # the operator stops train, then takes its URI over
    assert cli_main(["ckpt", "adopt", world.storage.uri, "--job", "team-a/finetune"]) == 0
    world.store.delete(finetune)
    world.store.create(finetune, world.spec)
    world.reconciler.reconcile(finetune)

    stored = world.store.get(finetune)
    assert stored is not None and stored.status is not None
    assert stored.status.phase is Phase.PENDING
    assert world.backend.worker(0, 0, job=finetune).resumed_from == 50


def test_a_transient_storage_error_while_claiming_is_retried_not_a_failure(world: World) -> None:
    world.storage.down = True

    world.reconcile()
    world.reconcile()

    status = world.status
    assert status.phase is Phase.PENDING and status.attempt.started_at is None
    assert status.condition("Degraded").reason == "StorageUnreachable"  # type: ignore[union-attr]
    assert read_owner(world.storage) is None and world.backend.start_calls == []

    world.storage.down = False
    world.run_until(running_attempt(0))
    assert read_owner(world.storage) is not None


def test_an_attempt_whose_record_cannot_be_written_does_not_start(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    original = world.storage.put_bytes_if_absent

    def refuse_records(key: str, data: bytes) -> None:
        if key.startswith(ATTEMPTS_PREFIX):
            raise TransientStorageError(f"{world.storage.url(key)}: 503 SlowDown (still failing after retries)", key)
        original(key, data)

    monkeypatch.setattr(world.storage, "put_bytes_if_absent", refuse_records)
    first = world.reconcile()
    second = world.reconcile()

    assert world.backend.start_calls == []
    status = world.status
    assert status.phase is Phase.PENDING and status.infra_errors == 2
    assert status.condition("Degraded").status == "True"  # type: ignore[union-attr]
    assert (first.requeue_after, second.requeue_after) == (1.0, 2.0)

    monkeypatch.setattr(world.storage, "put_bytes_if_absent", original)
    world.run_until(running_attempt(0))
    assert [r.attempt for r in attempt_records(world.storage, "team-a/train")] == [0]


def test_a_zombie_of_the_previous_attempt_can_neither_end_the_flush_nor_be_resumed(tmp_path: Any) -> None:
    w = make_world(tmp_path, backend_options={"flush_outcome": "hang"})
    w.run_to(60)
    commit_checkpoint(w.storage, 50, w.clock.now(), attempt=0)
    preempt_running_job(w)
    status = w.run_until(running_attempt(1))  # attempt 0's flush hung; attempt 1 resumes from 50
    preempt_running_job(w, at=w.clock.at() + 40, node=status.workers[0].node or "")
    w.run_until(phase_is(Phase.FLUSHING))

    # A worker of attempt 0, cut off on its node, commits a "flush" long after attempt 1 started.
    commit_checkpoint(w.storage, 300, w.clock.now(), trigger="flush", attempt=0)
    w.reconcile()

    status = w.status
    assert status.phase is Phase.FLUSHING, "a stale attempt's commit is not this flush"
    assert status.last_checkpoint is not None and status.last_checkpoint.step == 50
    status = w.run_until(running_attempt(2))
    assert w.backend.worker(2, 0).resumed_from == 50
    assert [r.fence for r in attempt_records(w.storage, "team-a/train")][1:] == [CheckpointRef(50), CheckpointRef(50)]


def test_an_attempt_is_fenced_at_a_newer_spotjobs_checkpoint_not_below_it(tmp_path: Any) -> None:
    """Workers on a newer spotjob image than the controller commit step 80 in a manifest format
    this controller cannot read. Fenced at step 50 (the newest it can), attempt 1's upgraded workers
    would judge step 80 a stale attempt's and go back to 50; fenced at 80, they resume from it."""
    w = make_world(tmp_path, backend_options={"flush_outcome": "hang"})
    w.run_to(60)
    commit_checkpoint(w.storage, 50, w.clock.now(), attempt=0)
    commit_checkpoint(w.storage, 80, w.clock.now(), attempt=0)
    key = CheckpointRef(80).key(MANIFEST_NAME)
    readable = w.storage.get_bytes(key)
    newer = json.loads(readable)
    newer["format_version"] = FORMAT_VERSION + 1
    w.storage.delete([key])
    w.storage.put_bytes(key, json.dumps(newer).encode())
    preempt_running_job(w)
    w.run_until(running_attempt(1))  # the flush hung; nothing newer this controller reads
    assert [r.fence for r in attempt_records(w.storage, "team-a/train")] == [None, CheckpointRef(80)]

    # What the upgraded workers of attempt 1 see (they read the format): step 80, not fenced.
    w.storage.delete([key])
    w.storage.put_bytes(key, readable)
    newest = latest_valid(w.storage)
    assert newest is not None and newest.ref == CheckpointRef(80)


def test_a_job_created_again_under_its_name_numbers_attempts_past_the_ones_in_storage(world: World) -> None:
    for n in range(3):  # the records of an earlier job of this name on this URI
        record_attempt(world.storage, "team-a/train", n, None)

    world.reconcile()

    assert world.status.attempt.number == 3
    assert world.backend.created == ["train-3-0", "train-3-1"]
    assert "AttemptRenumbered" in world.event_reasons()
    assert [r.attempt for r in attempt_records(world.storage, "team-a/train")] == [0, 1, 2, 3]


def test_a_job_created_again_under_its_name_after_an_earlier_one_recorded_only_attempt_0_renumbers(
    world: World,
) -> None:
    """A user walk: a job failed in attempt 0, was deleted and applied again, and its new attempt
    took number 0 again ("started 1 worker(s) of attempt 0", no AttemptRenumbered), the earlier
    job's record standing for it: a zombie worker of the earlier attempt 0 was not fenced. Only a
    recorded attempt above this one renumbered. A record of this job's attempt written before the
    job was created is an earlier job's: numbering goes on past it."""
    created = world.store.get(KEY)
    assert created is not None and created.created_at is not None
    earlier = AttemptRecord(0, "team-a/train", None, created.created_at - timedelta(minutes=5))
    world.storage.put_bytes(attempt_key("team-a/train", 0), earlier.to_json())

    world.reconcile()

    assert world.status.attempt.number == 1
    assert world.backend.created == ["train-1-0", "train-1-1"]
    assert "AttemptRenumbered" in world.event_reasons()
    records = attempt_records(world.storage, "team-a/train")
    assert [r.attempt for r in records] == [0, 1] and records[0] == earlier, "the earlier record stands"


def test_replaying_a_pass_whose_status_write_was_lost_keeps_the_attempts_record(world: World) -> None:
    world.reconcile()
    [record] = attempt_records(world.storage, "team-a/train")
    world.restart_orchestrator()
    # The first status write never happened: the same job (same uid, same creation), no status.
    path = world.store.path(KEY)
    with open(path) as f:
        document = json.load(f)
    del document["status"]
    with open(path, "w") as f:
        json.dump(document, f)

    world.reconcile()

    assert world.status.attempt.number == 0
    assert attempt_records(world.storage, "team-a/train") == [record]
    assert "AttemptRenumbered" not in world.event_reasons()


# -- status writes, Events and metrics -----------------------------------------------------------


class CountingStore(JsonFileJobStore):
    """Counts status writes; ``conflict_next`` makes the next one fail as a stale read would."""

    def __init__(self, root: str) -> None:
        super().__init__(root, fsync=False)
        self.writes = 0
        self.conflict_next = False

    def update_status(self, key: JobKey, status: JobStatus, *, version: str) -> StoredJob:
        if self.conflict_next:
            self.conflict_next = False
            raise ConflictError(f"job {key} changed since it was read")
        self.writes += 1
        return super().update_status(key, status, version=version)


def counting(w: World) -> CountingStore:
    store = CountingStore(os.path.join(w.tmp, "jobs"))
    w.new_reconciler(store)
    return store


def test_writes_no_status_while_a_running_job_changes_nothing_but_refreshes_goodput_every_minute(world: World) -> None:
    store = counting(world)
    world.run_to(30)
    writes, passes = store.writes, len(world.results)
    written = world.status

    world.run_to(55)  # passes at 36, 46 (every 10 s): the step hints move, nothing else does

    assert len(world.results) - passes == 2
    assert store.writes == writes, "no write per pass"
    assert world.status == written

    world.run_to(95)  # a minute after the last write: the step hints and goodput are refreshed
    assert store.writes == writes + 1
    assert world.status.attempt.observed_step is not None
    assert world.status.attempt.observed_step > (written.attempt.observed_step or 0)

    world.backend.notice("n0")
    world._next_pass()
    assert world.status.phase is Phase.FLUSHING, "a decision is written at once"
    assert store.writes == writes + 2


def test_observed_generation_is_the_spec_generation_the_pass_acted_on(world: World) -> None:
    world.reconcile()
    assert world.status.observed_generation == 1
    assert isinstance(world.store, JsonFileJobStore)

    def new_generation(doc: dict[str, Any]) -> None:
        doc["spec"]["maxRestarts"] = 5
        doc["metadata"]["generation"] = 2

    edit_document(world.store, KEY, new_generation)
    world.clock.sleep(2)
    world.reconcile()

    assert world.status.observed_generation == 2


def test_an_invalid_job_gets_a_condition_and_a_warning_naming_the_field_while_another_job_runs_on(
    world: World, tmp_path: Any
) -> None:
    assert isinstance(world.store, JsonFileJobStore)
    broken = JobKey("team-b", "broken")
    world.store.create(broken, world.spec)
    uri = str(tmp_path / "broken-ckpt")
    edit_document(world.store, broken, lambda doc: doc["spec"]["checkpoint"].update(uri=uri, everySteps=0))

    result = world.reconciler.reconcile(broken)
    world.run_until(running_attempt(0))

    assert result.requeue_after is None, "nothing to do until the spec changes"
    stored = world.store.get(broken)
    assert stored is not None and stored.status is not None
    invalid = stored.status.condition("Invalid")
    assert invalid is not None and invalid.status == "True" and invalid.reason == "InvalidSpec"
    assert invalid.message.startswith("spec.checkpoint.everySteps: Input should be greater than or equal to 1")
    [warning] = [e for e in world.events.emitted if e.key == broken]
    assert (warning.type, warning.reason) == (EventType.WARNING, "InvalidSpec")
    assert "spec.checkpoint.everySteps" in warning.message
    assert not any(n.startswith("broken") for n in world.backend.created), "an invalid job starts nothing"
    assert world.status.phase is Phase.RUNNING, "the other job is served as usual"

    # Fixed: the condition clears and the job starts.
    edit_document(world.store, broken, lambda doc: doc["spec"]["checkpoint"].update(everySteps=10))
    world.reconciler.reconcile(broken)
    stored = world.store.get(broken)
    assert stored is not None and stored.status is not None
    assert stored.status.condition("Invalid").status == "False"  # type: ignore[union-attr]
    assert "broken-0-0" in world.backend.created


def test_a_job_invalid_from_its_first_pass_says_so_in_its_reason_not_waiting_for_the_first_pass(world: World) -> None:
    """Found walking the README on the test cluster: a SpotJob refused on its first pass kept the
    reason and message of a job never looked at, so `kubectl get sj -o wide` showed REASON
    `Created` and `kubectl spotjob status` "Pending (Created: waiting for the first pass)"; only
    the Invalid condition said what to fix. Fixed, the reason follows the spec again."""
    broken = JobKey("team-b", "broken")
    world.store.create(broken, world.spec)
    world.backend.problems = ["spec.template.spec.containers[0].command must be empty"]
    world.reconciler.reconcile(broken)
    stored = world.store.get(broken)
    assert stored is not None and stored.status is not None
    assert stored.status.phase is Phase.PENDING
    assert stored.status.reason == "InvalidSpec"
    assert stored.status.message.startswith("spec.template.spec.containers[0].command must be empty")

    world.backend.problems = []
    world.reconciler.reconcile(broken)
    stored = world.store.get(broken)
    assert stored is not None and stored.status is not None
    assert stored.status.condition("Invalid").status == "False"  # type: ignore[union-attr]
    assert stored.status.reason != "InvalidSpec", stored.status.message
    assert "broken-0-0" in world.backend.created


def test_a_name_too_long_for_pod_names_or_a_spec_the_backend_cannot_run_is_invalid(world: World) -> None:
    long_name = JobKey("team-a", "x" * 41)
    world.store.create(long_name, world.spec)
    world.reconciler.reconcile(long_name)
    stored = world.store.get(long_name)
    assert stored is not None and stored.status is not None
    assert stored.status.condition("Invalid").message.startswith("metadata.name: job name")  # type: ignore[union-attr]

    world.backend.problems = ["spec.image: no image for the training container 'trainer'"]
    world.reconcile()
    status = world.status
    assert status.condition("Invalid").message.startswith("spec.image: no image")  # type: ignore[union-attr]
    assert world.backend.created == [], "nothing started"
    assert world.event_reasons() == ["InvalidSpec"]


def test_an_unreadable_status_is_left_alone_with_a_warning_not_overwritten(world: World) -> None:
    world.run_to(30)
    assert isinstance(world.store, JsonFileJobStore)
    edit_document(world.store, KEY, lambda doc: doc["status"].update(phase="Sleeping"))
    store = counting(world)

    result = world.reconcile()

    assert result == ReconcileResult(None, None)
    assert store.writes == 0
    assert world.events.emitted[-1].reason == "InvalidStatus"
    assert "status.phase" in world.events.emitted[-1].message


def test_events_and_metrics_follow_only_a_status_write_that_succeeded(world: World) -> None:
    store = counting(world)
    world.run_to(50)
    world.backend.notice("n0")
    told = len(world.events.emitted), len(world.metrics.calls)

    store.conflict_next = True
    result = world.reconcile()  # decides Flushing, asks the agents, but cannot write it

    assert result.requeue_after == 0.0, "re-read at once"
    assert (len(world.events.emitted), len(world.metrics.calls)) == told, "nothing told of a pass not written"
    assert world.status.phase is Phase.RUNNING

    world.reconcile()
    assert world.status.phase is Phase.FLUSHING
    [interrupted] = [e for e in world.events.emitted if e.reason == "SpotInterrupted"]
    assert interrupted.node == "n0", "the Event names the node (a Kubernetes sink records it there too)"
    assert world.metrics.named("preemption") == [()]
    assert world.metrics.named("signal") == [("SpotInterruption", "fake")]


def test_counts_preemptions_restarts_flush_requests_lost_steps_and_notice_to_commit(tmp_path: Any) -> None:
    w = make_world(tmp_path, backend_options={"flush_outcome": "hang"})
    w.run_to(60)
    commit_checkpoint(w.storage, 50, w.clock.now())
    preempt_running_job(w)

    w.run_until(running_attempt(1))

    assert w.metrics.named("flush_request") == [("accepted",), ("accepted",)]
    assert w.metrics.named("restart") == [("preemption",)]
    assert w.metrics.named("lost_steps") == [(51,)]
    assert w.metrics.named("notice_to_commit") == [], "the flush timed out: nothing committed"
    goodputs = w.metrics.named("goodput")
    assert goodputs and all(args[:2] == ("team-a", "train") for args in goodputs)

    w.backend.flush_outcome = "commit"
    preempt_running_job(w, at=w.clock.at() + 30, node=w.status.workers[0].node or "")
    w.run_until(phase_is(Phase.RESCHEDULING))
    assert w.metrics.named("notice_to_commit") == [(3.0,)]


def test_a_deleted_job_is_forgotten(world: World) -> None:
    world.run_to(10)
    world.store.delete(KEY)

    assert world.reconcile() == ReconcileResult(None, None)
    assert world.metrics.named("job_deleted") == [("team-a", "train")]


# -- flush requests that do not block a pass ----------------------------------------------------


def test_a_pending_flush_request_is_asked_again_until_accepted_and_never_after(world: World) -> None:
    pending, accepted = FlushRequestState.pending(), FlushRequestState.accepted()
    world.backend.flush_answers = {
        "train-0-0": [pending, pending, accepted],
        "train-0-1": [FlushRequestState.failed("connection refused"), accepted],
    }
    preempt_running_job(world)
    world.run_until(phase_is(Phase.FLUSHING))  # pass 1: pending and failed
    recovery = world.status.recovery
    assert recovery is not None and recovery.flush_requested == []
    assert world.event_reasons()[-1] == "FlushRequestFailed"
    failed = world.events.emitted[-1]
    assert failed.type is EventType.WARNING and "connection refused" in failed.message

    world._next_pass()  # pass 2: pending and accepted
    recovery = world.status.recovery
    assert recovery is not None and recovery.flush_requested == ["train-0-1"]
    world._next_pass()  # pass 3: accepted
    world._next_pass()
    world._next_pass()

    asked = world.backend.flushes_asked()
    assert asked.count("train-0-0") == 3 and asked.count("train-0-1") == 2, "never asked again once accepted"
    assert world.event_reasons().count("FlushRequested") == 2
    assert world.metrics.named("flush_request") == [("failed",), ("accepted",), ("accepted",)]


def test_an_answer_in_flight_when_the_flush_commits_is_still_told(world: World) -> None:
    """A quick flush commits before the pass after the request: the answers then in flight are
    taken before the flush ends (FlushRequested, the metric), and no agent is asked anew."""
    pending, accepted = FlushRequestState.pending(), FlushRequestState.accepted()
    world.backend.flush_answers = {"train-0-0": [pending, accepted], "train-0-1": [pending, accepted]}
    preempt_running_job(world)
    world.run_until(phase_is(Phase.FLUSHING))  # the requests are in flight
    commit_checkpoint(world.storage, 200, world.clock.now(), trigger="flush")  # the ranks were quick

    status = world.run_until(phase_is(Phase.RESCHEDULING))

    assert status.condition("Flushing").reason == "FlushCommitted"  # type: ignore[union-attr]
    assert world.event_reasons()[-3:] == ["FlushRequested", "FlushCommitted", "Rescheduled"]
    assert world.metrics.named("flush_request") == [("accepted",), ("accepted",)]
    assert sorted(world.backend.flushes_asked()) == ["train-0-0", "train-0-0", "train-0-1", "train-0-1"]


# -- how the gang is stopped --------------------------------------------------------------------


def test_after_a_failure_of_the_users_code_the_healthy_workers_are_stopped_without_a_flush(world: World) -> None:
    world.run_to(100)
    world.backend.exit(0, 1, 1)

    world.run_until(phase_is(Phase.RESCHEDULING))

    assert world.backend.stop_flushes == [False]
    assert world.backend.stopped_without_flush == ["train-0-0"], "the survivor is told POST /stop"
    assert world.backend.flush_calls == []


def test_after_a_preemption_the_gang_is_stopped_the_way_the_capacity_going_away_would(world: World) -> None:
    preempt_running_job(world)

    world.run_until(phase_is(Phase.RESCHEDULING))

    assert world.backend.stop_flushes == [True]
    assert world.backend.stopped_without_flush == []


# -- a failure decided in a pass whose status write is lost ---------------------------------------


def failure_decided(old: JobStatus, new: JobStatus) -> bool:
    return new.restarts > old.restarts or (new.phase is Phase.FAILED and old.phase is not Phase.FAILED)


@pytest.mark.parametrize("budget", [2, 0], ids=["restart within the budget", "budget exhausted"])
def test_a_failure_of_the_users_code_stays_that_failure_when_the_status_write_deciding_it_is_lost(
    tmp_path: Any, budget: int
) -> None:
    w = make_world(tmp_path, maxRestarts=budget)
    lossy = LosesOneWrite(os.path.join(w.tmp, "jobs"), failure_decided)
    w.new_reconciler(lossy)
    w.run_to(100)
    w.backend.exit(0, 1, 1)  # the user's code failed on one worker; its peer still trains

    with pytest.raises(StoreError):
        w.reconcile()  # decides the failure, but the controller dies before its status write
    assert lossy.lost == 1
    assert w.backend.worker(0, 1).exit_code == 1, "nothing was stopped on a decision that was never written"
    w.restart_orchestrator()
    status = w.run_until(lambda s: s.phase is not Phase.RUNNING)

    assert status.preemptions == 0, "a lost write must not turn the failure into a preemption"
    assert w.event_reasons().count("WorkerLost") == 0
    if budget:
        assert (status.phase, status.restarts) == (Phase.RESCHEDULING, 1)
        assert [h.reason for h in status.restart_history] == ["WorkerFailed"]
    else:
        assert (status.phase, status.reason) == (Phase.FAILED, "RestartBudgetExhausted")
    assert w.backend.stop_flushes and not any(w.backend.stop_flushes), "stopped without a flush"
    left = [x.name for x in w.backend.workers.values() if x.attempt == 0]
    if budget:
        assert not left, "attempt 0 is gone after the write"
    else:
        assert left == ["train-0-1"], "the live worker is stopped after the write; the failed one stays (its logs)"


def test_a_failed_jobs_workers_are_stopped_on_a_later_pass_when_the_stop_after_the_write_fails(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    w = make_world(tmp_path, maxRestarts=0)
    w.run_to(100)
    w.backend.exit(0, 1, 1)
    real_stop = w.backend.stop_workers
    failures = iter([BackendError("the API server answered 503")])

    def stop_once_failing(*args: Any, **kwargs: Any) -> None:
        error = next(failures, None)
        if error is not None:
            raise error
        real_stop(*args, **kwargs)

    monkeypatch.setattr(w.backend, "stop_workers", stop_once_failing)

    result = w.reconcile()

    assert (w.status.phase, w.status.reason) == (Phase.FAILED, "RestartBudgetExhausted")
    assert result.requeue_after == 1.0, "the stop is tried again"
    assert w.backend.worker(0, 0).exit_code is None, "the healthy worker still runs"
    assert w.reconcile().requeue_after == 2.0, "stopping: look again"
    assert w.backend.stopped_without_flush == ["train-0-0"]
    assert list(w.backend.workers) == ["train-0-1"], "the failed worker stays (its pod, for kubectl logs)"
    assert w.reconcile().requeue_after is None, "nothing left to stop"


def test_a_failed_workers_reason_carries_what_the_backend_could_tell_of_its_cause(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    w = make_world(tmp_path, maxRestarts=1)
    why = "OSError: [Errno 28] No space left on device (log: /runs/train/logs/train-0-1.log)"
    listing = w.backend.list_workers

    def with_detail(key: JobKey, spec: JobSpec) -> list[Any]:
        return [replace(o, detail=why) if o.exit_code == 1 else o for o in listing(key, spec)]

    monkeypatch.setattr(w.backend, "list_workers", with_detail)
    w.run_to(100)
    w.backend.exit(0, 1, 1)
    status = w.run_until(phase_is(Phase.RESCHEDULING))
    assert status.restart_history[-1].message.endswith(f"restart 1 of 1: {why}")

    w.run_until(running_attempt(1))
    w.backend.exit(1, 0, 1)
    status = w.run_until(phase_is(Phase.FAILED))
    assert status.message == f"worker train-1-0 exited with code 1 and all 1 restart(s) are used: {why}"


def test_a_gang_that_finishes_its_training_while_asked_to_flush_succeeds_and_is_not_started_again(
    world: World,
) -> None:
    """The notice came as the training ended: every rank closed before it saw ``flush.json``, and
    every worker exited 0. That job is done; a new attempt would run its last steps again from the
    last checkpoint (or the whole training, with none)."""
    world.backend.flush_answers = {
        "train-0-0": [FlushRequestState.pending()],
        "train-0-1": [FlushRequestState.pending()],
    }
    preempt_running_job(world)
    world.run_until(phase_is(Phase.FLUSHING))
    world.backend.exit(0, 0, 0)
    world.backend.exit(0, 1, 0)

    status = world.run_until(lambda s: s.phase is not Phase.FLUSHING)

    assert status.phase is Phase.SUCCEEDED and status.reason == "Completed", (status.phase, status.reason)
    assert world.backend.created == ["train-0-0", "train-0-1"], "no second attempt"


def test_tells_the_stored_state_after_each_pass_how_each_flush_ended_and_an_ended_job_to_a_new_reconciler(
    tmp_path: Any,
) -> None:
    """What the per-job alerting metrics are fed (``spotjob_job_phase``, the newest checkpoint, the
    restarts, ``spotjob_job_flushes_total``): the status as stored after every pass, written or not;
    each flush's end once, with the agents that exited 76 in it; and a job that ended before this
    reconciler started (a new leader) is told on its first pass too, or it would never be."""
    w = make_world(tmp_path, backend_options={"flush_outcome": "fail"}, maxRestarts=0)
    w.run_to(60)
    commit_checkpoint(w.storage, 50, w.clock.now())
    preempt_running_job(w)
    w.run_until(running_attempt(1))

    assert w.metrics.named("flush_ended") == [("team-a", "train", "workers_exited", 2)]
    *_, (namespace, name, told, max_restarts) = w.metrics.named("job_state")
    assert (namespace, name, max_restarts) == ("team-a", "train", 0)
    assert told == w.status and told.last_checkpoint is not None and told.last_checkpoint.step == 50  # type: ignore[attr-defined]
    passes = len(w.results)
    assert len(w.metrics.named("job_state")) == passes, "one per pass"

    w.backend.flush_outcome = "commit"
    preempt_running_job(w, at=w.clock.at() + 30, node=w.status.workers[0].node or "")
    w.run_until(phase_is(Phase.RESCHEDULING))
    assert w.metrics.named("flush_ended")[1:] == [("team-a", "train", "committed", 0)]

    w.run_until(running_attempt(2))
    w.backend.exit(2, 0, 1)
    w.run_until(phase_is(Phase.FAILED))

    w.metrics = RecordingMetrics()
    w.restart_orchestrator()
    w.reconcile()
    [(_, _, ended, _)] = w.metrics.named("job_state")
    assert ended == w.status and ended.phase is Phase.FAILED  # type: ignore[attr-defined]
