"""The controller's lifecycle on the fake clock: a spec edited while an attempt runs, and status
timestamps written by a controller whose wall clock ran ahead (a leader on a skewed node).

Timeline of the default world (``test_reconciler``): attempt 0 starts at 0, its two workers run
from 5 and the reconciler sees them at 6; each trains one step per second.
"""

from __future__ import annotations

import logging
import os
from datetime import datetime, timedelta
from typing import Any

import pytest
from fakes import KEY
from test_reconciler import (
    LosesOneWrite,
    World,
    changes,
    edit_document,
    make_world,
    phase_is,
    preempt_running_job,
    running_attempt,
)
from test_reconciler_flush_request import RequestStore, ask, request_world

from agent.storage import parse_uri
from agent.storage.file import FileStorage
from orchestrator.backends.base import HeldNoticeReport
from orchestrator.model import Cause, CheckpointSpec, JobKey, Phase
from orchestrator.reconciler import Reconciler
from orchestrator.store import JsonFileJobStore, StoredJob, StoreError

# -- a spec edited while an attempt runs -------------------------------------------------------


def set_replicas(world: World, replicas: int) -> None:
    edit_document(world.store, KEY, lambda doc: doc["spec"].update(replicas=replicas))  # type: ignore[arg-type]


def test_a_job_whose_replicas_were_raised_while_it_ran_succeeds_when_its_gang_finishes(tmp_path: Any) -> None:
    world = make_world(tmp_path, backend_options={"total_steps": 40})
    world.run_until(running_attempt(0))

    set_replicas(world, 3)
    status = world.run_until(lambda s: s.phase.terminal or world.clock.at() > 600)

    assert status.phase is Phase.SUCCEEDED, (status.phase, status.reason)
    assert status.attempt.replicas == 2
    assert world.backend.created == ["train-0-0", "train-0-1"]


def test_replicas_raised_while_an_attempt_starts_add_no_worker_to_its_gang_and_count_from_the_next_attempt(
    tmp_path: Any,
) -> None:
    world = make_world(tmp_path)
    world.reconcile()  # attempt 0 is started with 2 workers; they run from 5
    set_replicas(world, 3)

    world.run_until(running_attempt(0))
    assert world.backend.created == ["train-0-0", "train-0-1"]  # no worker expecting a gang of 3
    assert all(spec.replicas == 2 for spec in world.backend.start_specs)

    preempt_running_job(world, at=60, node="n0")
    status = world.run_until(running_attempt(1))
    assert status.attempt.replicas == 3
    assert [name for name in world.backend.created if name.startswith("train-1-")] == [
        "train-1-0",
        "train-1-1",
        "train-1-2",
    ]


def test_replicas_lowered_while_an_attempt_runs_keep_its_gang_whole_and_the_next_attempt_is_smaller(
    tmp_path: Any,
) -> None:
    """Pins behaviour that already worked: a scale-down is neither refused nor applied in place. The
    running attempt keeps its two workers (none is stopped, the gang is judged by its own size),
    and the next attempt, after a preemption, starts one."""
    world = make_world(tmp_path)
    world.run_until(running_attempt(0))
    set_replicas(world, 1)

    status = world.run_to(60)
    assert (status.phase, status.attempt.replicas) == (Phase.RUNNING, 2)
    assert world.backend.stop_calls == [] and world.backend.nodes_of(0) == ["n0", "n1"]

    preempt_running_job(world, at=90, node="n0")
    status = world.run_until(running_attempt(1))
    assert status.attempt.replicas == 1
    assert [name for name in world.backend.created if name.startswith("train-1-")] == ["train-1-0"]


# -- a status written by a controller whose clock ran ahead ----------------------------------------


class ClockAhead:
    """The world's clock as seen by a controller on a node whose wall clock runs ``seconds`` ahead."""

    def __init__(self, world: World, seconds: float) -> None:
        self._clock, self._ahead = world.clock, timedelta(seconds=seconds)

    def now(self) -> datetime:
        return self._clock.now() + self._ahead

    def monotonic(self) -> float:
        return self._clock.monotonic()

    def sleep(self, seconds: float) -> None:
        self._clock.sleep(seconds)


def one_pass_by_a_leader_an_hour_ahead(world: World) -> None:
    """One pass of a leader whose clock is an hour ahead; then it dies and a leader with the right
    time takes over (a fresh ``Reconciler`` on the same store)."""
    skewed = Reconciler(world.store, world.backend, ClockAhead(world, HOUR), storage_factory=lambda _: world.storage)
    skewed.reconcile(world.key)
    world.new_reconciler()


HOUR = 3600.0


def test_a_flush_timeout_written_by_a_leader_whose_clock_ran_ahead_ends_the_flush_after_flush_timeout_seconds(
    tmp_path: Any,
) -> None:
    world = make_world(tmp_path, backend_options={"flush_outcome": "hang"})
    preempt_running_job(world, at=100)
    one_pass_by_a_leader_an_hour_ahead(world)  # it heard the notice at 100 and entered Flushing
    assert world.status.phase is Phase.FLUSHING
    taken_over_at = world.next_at  # the new leader's first pass

    status = world.run_until(phase_is(Phase.RESCHEDULING))

    assert status.condition("Flushing").reason == "FlushTimedOut"  # type: ignore[union-attr]
    assert world.clock.at() <= taken_over_at + 30  # flushTimeoutSeconds, not an hour more
    assert status.flushing_seconds >= 0


def test_a_forward_step_of_the_controllers_wall_clock_does_not_time_out_a_flush_in_progress(tmp_path: Any) -> None:
    """The leader's wall clock jumps an hour ahead while the gang flushes (NTP correcting a clock
    that ran behind, a VM resumed): the flush had all of ``flushTimeoutSeconds`` to commit, and the
    next pass timed it out at once, stopping the gang before its checkpoint could commit. The fake
    clock moves the wall clock alone; not modelled: the fake backend's own timing reads the wall
    clock, so its flush hangs here rather than committing later."""
    world = make_world(tmp_path, backend_options={"flush_outcome": "hang"})
    preempt_running_job(world)
    world.run_until(phase_is(Phase.FLUSHING))
    entered = world.clock.monotonic()

    world.clock.step_wall(HOUR)
    world.reconcile()
    assert world.status.phase is Phase.FLUSHING, world.status.reason
    status = world.run_until(phase_is(Phase.RESCHEDULING))

    assert status.condition("Flushing").reason == "FlushTimedOut"  # type: ignore[union-attr]
    assert world.clock.monotonic() >= entered + 30


def test_a_backward_step_of_the_controllers_wall_clock_does_not_hold_a_flush_past_its_timeout(tmp_path: Any) -> None:
    """The other way: an hour back, and the flush still times out ``flushTimeoutSeconds`` after it began
    (pins behaviour that already held within a few seconds, through the status's distrust of the future)."""
    world = make_world(tmp_path, backend_options={"flush_outcome": "hang"})
    preempt_running_job(world)
    world.run_until(phase_is(Phase.FLUSHING))
    entered = world.clock.monotonic()

    world.clock.step_wall(-HOUR)
    world.reconcile()  # (the world schedules passes by the wall clock: one now, then the requeue's)
    status = world.run_until(phase_is(Phase.RESCHEDULING))

    assert status.condition("Flushing").reason == "FlushTimedOut"  # type: ignore[union-attr]
    assert world.clock.monotonic() <= entered + 30 + 2  # one flushing poll of slack


def test_a_restart_backoff_written_by_a_leader_whose_clock_ran_ahead_holds_the_restart_at_most_its_max(
    tmp_path: Any,
) -> None:
    world = make_world(tmp_path)
    world.run_until(running_attempt(0))
    world.clock.advance(1)
    world.backend.exit(0, 1, 1)  # the user's code fails: a restart with the backoff (10 s, at most 80)
    one_pass_by_a_leader_an_hour_ahead(world)
    status = world.status
    assert status.phase is Phase.RESCHEDULING and status.restarts == 1
    taken_over_at = world.next_at  # the new leader's first pass

    status = world.run_until(running_attempt(1))

    # At most restartBackoff.maxSeconds from then, not an hour more; then 5 s to run, seen within 2 s.
    assert world.clock.at() <= taken_over_at + 80 + 5 + 2
    assert status.restarts == 1


def test_a_status_whose_times_were_written_without_a_zone_is_read_as_utc_and_the_job_goes_on(tmp_path: Any) -> None:
    # Written by hand (kubectl edit --subresource=status) or by another tool: each pass compared
    # them with its clock and failed (TypeError: naive and aware datetimes), so the job never moved.
    world = make_world(tmp_path)
    started = world.run_until(running_attempt(0)).start_time

    def without_zone(doc: dict[str, Any]) -> None:
        for times, name in ((doc["status"], "startTime"), (doc["status"]["attempt"], "runningAt")):
            times[name] = times[name].removesuffix("Z").split("+")[0]

    edit_document(world.store, KEY, without_zone)  # type: ignore[arg-type]
    world.clock.advance(1)
    world.reconcile()

    assert world.status.phase is Phase.RUNNING
    assert world.status.start_time == started


def test_a_checkpoint_request_taken_by_a_leader_whose_clock_ran_ahead_ends_within_the_flush_timeout(
    tmp_path: Any,
) -> None:
    world, store = request_world(tmp_path, backend_options={"flush_outcome": "hang"})  # no save ever commits
    world.run_to(100)
    ask(store, "c-1", "checkpoint")
    one_pass_by_a_leader_an_hour_ahead(world)  # it took the request up, an hour "later"
    assert world.status.last_flush_request is not None and world.status.last_flush_request.outcome == "InProgress"
    taken_over_at = world.next_at

    status = world.run_until(lambda s: s.last_flush_request is None or s.last_flush_request.outcome != "InProgress")

    assert status.last_flush_request is not None and status.last_flush_request.outcome == "NotCommitted"
    assert world.clock.at() <= taken_over_at + 30 + 10  # flushTimeoutSeconds, seen within a running poll


# -- many jobs over a controller's life --------------------------------------------------------------


class ClosingStorage(FileStorage):
    """A folder store that says whether it was closed (an S3 or GCS store holds a client until then)."""

    closed = False

    def close(self) -> None:
        self.closed = True


def test_a_deleted_jobs_storage_client_is_closed_and_let_go_and_another_jobs_is_kept(tmp_path: Any) -> None:
    world = make_world(tmp_path)
    opened: dict[str, list[ClosingStorage]] = {}

    def open_storage(uri: str) -> ClosingStorage:
        storage = ClosingStorage(parse_uri(uri)[2])
        opened.setdefault(uri, []).append(storage)
        return storage

    other = JobKey("team-a", "finetune")
    other_uri = str(tmp_path / "ckpt-finetune")
    world.store.create(other, world.spec.model_copy(update={"checkpoint": CheckpointSpec(uri=other_uri)}))
    reconciler = Reconciler(world.store, world.backend, world.clock, storage_factory=open_storage)
    reconciler.reconcile(KEY)
    reconciler.reconcile(other)

    world.store.delete(KEY)
    assert reconciler.reconcile(KEY).phase is None  # the pass that finds it gone forgets it

    (train,) = opened[world.spec.checkpoint.uri]
    assert train.closed
    (finetune,) = opened[other_uri]
    assert not finetune.closed
    reconciler.reconcile(other)
    assert len(opened[other_uri]) == 1  # still the one it had


# -- a leader that asked for the flush and died before it wrote Flushing ------------------------------


class LossyRequestStore(RequestStore, LosesOneWrite):
    """A person's flush request on the job, and the first status write matching ``lose`` lost."""


def leader_dies_after_asking(world: World, store: LosesOneWrite) -> None:
    """Passes until the one whose write is lost (it asked the agents to flush), then no leader for
    15 s (the Lease expiring: the flush commits meanwhile) and a new one."""
    with pytest.raises(StoreError):
        for _ in range(100):
            world.run_to(world.next_at)
    assert store.lost == 1 and world.backend.flushes_asked()
    world.clock.sleep(15)
    world.restart_orchestrator()
    world.new_reconciler(store)
    world.next_at = world.clock.at()


def test_a_flush_committed_while_no_leader_ran_is_told_as_committed_by_the_next_leader(tmp_path: Any) -> None:
    world = make_world(tmp_path)
    store = LosesOneWrite(os.path.join(world.tmp, "jobs"), changes(Phase.RUNNING, Phase.FLUSHING))
    world.new_reconciler(store)
    world.run_to(100)
    world.backend.notice("n0")
    leader_dies_after_asking(world, store)  # the flush it asked for commits step 101 meanwhile

    status = world.run_until(phase_is(Phase.RESCHEDULING))

    assert status.condition("Flushing").reason == "FlushCommitted", status.condition("Flushing")  # type: ignore[union-attr]
    assert "FlushCommitted" in world.event_reasons() and "WorkersExited" not in world.event_reasons()
    assert (status.preemptions, status.restarts) == (1, 0)
    assert world.backend.commits == [101]
    assert world.run_until(running_attempt(1)).attempt.resumed_from_step == 101


def test_a_requested_restart_whose_flush_committed_while_no_leader_ran_is_answered_committed(tmp_path: Any) -> None:
    world = make_world(tmp_path)
    store = LossyRequestStore(os.path.join(world.tmp, "jobs"), changes(Phase.RUNNING, Phase.FLUSHING))
    world.new_reconciler(store)
    world.run_to(100)
    ask(store, "r-1", "restart")
    leader_dies_after_asking(world, store)

    status = world.run_until(running_attempt(1))

    request = status.last_flush_request
    assert request is not None and (request.id, request.outcome) == ("r-1", "Committed"), request
    assert request.step == world.backend.commits[0] == status.attempt.resumed_from_step
    # The agents exited 75 because the dead leader asked them to: no preemption, no node avoided.
    assert (status.preemptions, status.restarts) == (0, 0) and status.avoid == []
    assert [r.cause for r in status.restart_history] == [Cause.REQUESTED]


# -- a job an older controller stored ------------------------------------------------------------


def as_an_older_controller_stored_it(doc: dict[str, Any]) -> None:
    """The status as the controller of 2026-12-01 wrote it: no ``attempt.replicas`` (2026-12-03),
    ``attempt.notStarting`` or ``checkpointUri`` (2026-12-02)."""
    doc["status"].pop("checkpointUri", None)
    doc["status"]["attempt"].pop("replicas", None)
    doc["status"]["attempt"].pop("notStarting", None)


def test_a_running_job_an_older_controller_stored_runs_to_its_end_under_this_one(tmp_path: Any) -> None:
    world = make_world(tmp_path, backend_options={"total_steps": 40})
    world.run_until(running_attempt(0))
    edit_document(world.store, KEY, as_an_older_controller_stored_it)

    status = world.run_until(lambda s: s.phase.terminal or world.clock.at() > 600)

    assert status.phase is Phase.SUCCEEDED, (status.phase, status.reason)
    assert status.attempt.number == 0 and status.restarts == 0  # taken over, not restarted
    assert status.checkpoint_uri == world.store.get(KEY).spec.checkpoint.uri  # type: ignore[union-attr]
    assert world.backend.created == ["train-0-0", "train-0-1"]


# -- a finished job's spec edited --------------------------------------------------------------


def test_a_finished_job_whose_spec_is_edited_says_it_saw_the_generation_and_runs_nothing(tmp_path: Any) -> None:
    """Editing a Succeeded job left ``observedGeneration`` behind ``metadata.generation`` for good:
    tools that judge a resource by it (kstatus, in Argo CD and Flux) showed the job as still in
    progress. The status takes the generation once, an Event says the change runs nothing, and no
    worker starts."""
    world = make_world(tmp_path, backend_options={"total_steps": 10})
    status = world.run_until(lambda s: s.phase.terminal or world.clock.at() > 600)
    assert status.phase is Phase.SUCCEEDED, (status.phase, status.reason)
    created, told = list(world.backend.created), len(world.events.emitted)

    def new_generation(doc: dict[str, Any]) -> None:
        doc["spec"]["maxRestarts"] = 5
        doc["metadata"]["generation"] = 2

    edit_document(world.store, KEY, new_generation)  # type: ignore[arg-type]
    for _ in range(3):
        world.clock.sleep(2)
        world.reconcile()

    assert world.status.phase is Phase.SUCCEEDED and world.status.observed_generation == 2
    assert world.backend.created == created, "a finished job started again"
    reasons = [e.reason for e in world.events.emitted[told:]]
    assert reasons == ["SpecChangeIgnored"], reasons


# -- held notices ----------------------------------------------------------------------------------


def test_the_held_notices_are_listed_earliest_flush_first_so_the_printer_column_shows_the_next(
    tmp_path: Any,
) -> None:
    """Two workers' agents hold a GCE maintenance notice each (one per VM, at different times): the
    second worker's flushes first. Before, ``status.heldNotices`` followed the workers' order, so
    ``kubectl get sj``'s HELD-NOTICE column (``heldNotices[0].flushAt``) showed the later flush.
    The fake backend reports what each agent's ``GET /status`` says; it does not model the agents."""
    world = make_world(tmp_path)
    world.run_until(running_attempt(0))
    now = world.clock.now()

    def held(flush_in: float) -> HeldNoticeReport:
        at = now + timedelta(seconds=flush_in)
        return HeldNoticeReport("gcp", "maintenance", "MIGRATE_ON_HOST_MAINTENANCE", at + timedelta(minutes=5), at, now)

    world.backend.held = {"train-0-0": held(3000), "train-0-1": held(600)}
    status = world.run_to(world.clock.at() + 30)

    assert [h.worker for h in status.held_notices or []] == ["train-0-1", "train-0-0"]
    world.backend.held = {"train-0-0": held(3000)}
    assert [h.worker for h in world.run_to(world.clock.at() + 30).held_notices or []] == ["train-0-0"]


def test_a_job_that_fails_while_an_agent_holds_a_notice_keeps_no_held_notice(tmp_path: Any) -> None:
    """Worker 1's agent holds a GCE maintenance notice when worker 0's code fails with no restart
    left. Before, the pass that failed the job recorded worker 1 (still running then) with its
    notice, and a finished job is never observed again: the Failed job showed a held notice, "the
    flush starts ...", in kubectl get sj and kubectl spotjob for good. The fake backend reports
    what each agent's ``GET /status`` says; it does not model the agents."""
    world = make_world(tmp_path, maxRestarts=0)
    world.run_until(running_attempt(0))
    now = world.clock.now()
    soon = now + timedelta(minutes=55)
    world.backend.held = {
        "train-0-1": HeldNoticeReport("gcp", "maintenance", "x", soon + timedelta(minutes=5), soon, now)
    }
    assert world.run_to(world.clock.at() + 30).held_notices

    world.backend.exit(0, 0, 1)
    status = world.run_until(phase_is(Phase.FAILED))

    assert status.held_notices is None


class DeletedAfterRead(JsonFileJobStore):
    """A job deleted (``kubectl delete sj``) between the pass's read of it and its status write,
    its workers going with it: what the API server does with a background deletion."""

    armed = False
    world: World | None = None

    def get(self, key: JobKey) -> StoredJob | None:
        stored = super().get(key)
        if self.armed and stored is not None:
            self.armed = False
            super().delete(key)
            assert self.world is not None
            for index in (0, 1):
                self.world.backend.vanish(0, index)  # the garbage collector takes the pods
        return stored


def test_a_job_deleted_during_its_pass_is_forgotten_not_a_reconcile_error_nor_a_lost_gang(
    tmp_path: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """The pass took the pods' going for lost workers ("worker train-0-0 on node None is gone"),
    decided a restart, and its status write met NotFound: ``JobNotFoundError`` out of the pass, a
    reconcile error logged with a traceback and counted (the SpotJobReconcileErrors alert)."""
    world = make_world(tmp_path)
    store = DeletedAfterRead(os.path.join(world.tmp, "jobs"), fsync=False)
    world.new_reconciler(store)
    world.run_until(running_attempt(0))
    store.world, store.armed = world, True
    events = len(world.events.emitted)

    with caplog.at_level(logging.INFO, logger="orchestrator"):
        result = world.reconcile()

    assert (result.phase, result.requeue_after) == (None, None)
    assert "was deleted during this pass" in caplog.text
    assert world.events.emitted[events:] == [], "nothing told of a pass whose job is gone"
    assert world.backend.stop_calls == [] and store.get(KEY) is None


def test_a_worker_lost_before_it_was_placed_says_so_not_node_none(tmp_path: Any) -> None:
    trainer = {"name": "trainer", "image": "train:1"}
    template = {"spec": {"containers": [trainer], "nodeSelector": {"capacity-type": "none"}}}
    world = make_world(tmp_path, template=template)  # no node takes it: Pending, unschedulable
    world.run_to(3)
    world.backend.vanish(0, 0)

    world.run_until(lambda s: "WorkerLost" in world.event_reasons())

    [said] = [e.message for e in world.events.emitted if e.reason == "WorkerLost"]
    assert "worker train-0-0 (not yet placed on a node) is gone" in said, said


def test_a_rescheduled_attempt_once_started_says_so_while_its_workers_wait(tmp_path: Any) -> None:
    """The phase stays Rescheduling until every worker of the new attempt runs; its message said
    "attempt 1 starts in 1s" for as long as the new workers waited for a node (minutes, on a
    cluster out of capacity)."""
    world = make_world(tmp_path)
    preempt_running_job(world)
    world.run_until(phase_is(Phase.RESCHEDULING))
    world.backend.start_seconds = 600.0  # the next attempt's workers wait for a node

    status = world.run_until(lambda s: s.attempt.number == 1 and s.attempt.started_at is not None)

    assert (status.phase, status.reason) == (Phase.RESCHEDULING, "Rescheduled")
    assert status.message.startswith("started 2 worker(s) of attempt 1 from"), status.message
