"""A person's flush request (``spotjob.dev/flush-request`` on Kubernetes; ``StoredJob.flush_request``
here), on the fake clock: ``restart`` flushes the gang and restarts it without counting a
preemption or a restart; ``checkpoint`` gets a checkpoint and training goes on; each id is handled
once, by this reconciler and by a new one (a new leader) alike.

Timeline: attempt 0 runs from 6 (two workers, one step per second from 0); a request comes at 100.
"""

from __future__ import annotations

import dataclasses
import os
import re
from datetime import timedelta
from typing import Any

import pytest
from fakes import EPOCH, commit_checkpoint
from test_reconciler import World, make_world, phase_is, running_attempt

from orchestrator.model import Cause, FlushRequest, JobKey, Phase
from orchestrator.store import JsonFileJobStore, StoredJob


class RequestStore(JsonFileJobStore):
    """The local store plus the annotation a person wrote (what ``KubeJobStore`` reads)."""

    request: FlushRequest | None = None
    problem: str | None = None

    def get(self, key: JobKey) -> StoredJob | None:
        stored = super().get(key)
        if stored is None or (self.request is None and self.problem is None):
            return stored
        rid = self.request.id if self.request is not None else "invalid-0123456789abcdef"
        return dataclasses.replace(
            stored, flush_request=self.request, flush_request_id=rid, flush_request_problem=self.problem
        )


def request_world(tmp_path: Any, **options: Any) -> tuple[World, RequestStore]:
    w = make_world(tmp_path, **options)
    store = RequestStore(os.path.join(w.tmp, "jobs"), fsync=False)
    w.new_reconciler(store)
    return w, store


def ask(store: RequestStore, rid: str, mode: str, reason: str = "") -> None:
    store.request = FlushRequest.model_validate(
        {"id": rid, "mode": mode, "reason": reason, "requestedAt": (EPOCH + timedelta(seconds=99)).isoformat()}
    )


def test_a_restart_request_flushes_every_agent_and_restarts_from_the_commit_counting_nothing(tmp_path: Any) -> None:
    w, store = request_world(tmp_path)
    w.run_to(100)
    ask(store, "r-1", "restart", "new learning rate schedule")

    status = w.run_until(phase_is(Phase.FLUSHING))
    assert status.reason == "FlushRequestedByUser" and "new learning rate schedule" in status.message
    assert sorted(w.backend.flushes_asked()) == ["train-0-0", "train-0-1"]
    assert all(deadline is None for _, _, deadline in w.backend.flush_calls), "no capacity is going away"
    assert status.last_flush_request is not None and status.last_flush_request.outcome == "InProgress"
    assert status.recovery is not None and status.recovery.cause is Cause.REQUESTED

    status = w.run_until(running_attempt(1))

    request = status.last_flush_request
    assert request is not None and (request.id, request.mode, request.outcome) == ("r-1", "restart", "Committed")
    assert request.step == w.backend.commits[0] and status.attempt.resumed_from_step == request.step
    assert (status.preemptions, status.restarts, status.consecutive_restarts) == (0, 0, 0)
    assert status.avoid == [], "the nodes are fine: no cool-down"
    assert [(r.cause, r.reason) for r in status.restart_history] == [(Cause.REQUESTED, "FlushRequestedByUser")]
    reasons = w.event_reasons()
    for reason in ("FlushRequestedByUser", "FlushCommitted", "Rescheduled", "FlushRequestCommitted"):
        assert reason in reasons, reasons
    assert w.metrics.named("preemption") == [] and w.metrics.named("notice_to_commit") == []


def test_the_flush_of_a_restart_request_is_told_committed_after_the_request_not_after_a_notice(
    tmp_path: Any,
) -> None:
    """FlushCommitted said "step N committed at ... 1.0s after the notice" for the flush a person
    asked for, which had no notice. Found walking the metrics and Events as a user."""
    w, store = request_world(tmp_path, backend_options={"flush_seconds": 3.0})
    w.run_to(100)
    ask(store, "r-1", "restart")

    w.run_until(running_attempt(1))

    [told] = [e for e in w.events.emitted if e.reason == "FlushCommitted"]
    assert re.fullmatch(r"step \d+ committed at file://\S+ \d+\.\ds after the request", told.message), told.message
    assert "notice" not in told.message


def test_a_restart_whose_flush_reused_the_scripts_own_save_is_committed(tmp_path: Any) -> None:
    """The script's ``save()`` of the step the agents flush at committed (``trigger: save``) after
    the request was taken up; the agents, finding it committed, wrote nothing more and exited 75.
    The request is that checkpoint's: Committed, not "nothing newer committed"."""
    w, store = request_world(tmp_path, backend_options={"flush_outcome": "reused"})
    w.run_to(60)
    commit_checkpoint(w.storage, 50, w.clock.now())
    w.run_to(100)
    ask(store, "r-1", "restart")
    w.run_until(phase_is(Phase.FLUSHING))
    commit_checkpoint(w.storage, 94, w.clock.now(), trigger="save")

    status = w.run_until(running_attempt(1))

    request = status.last_flush_request
    assert request is not None and (request.outcome, request.step) == ("Committed", 94)
    assert status.attempt.resumed_from_step == 94


def test_a_handled_request_is_never_handled_again_not_even_by_a_new_reconciler(tmp_path: Any) -> None:
    w, store = request_world(tmp_path)
    w.run_to(100)
    ask(store, "r-1", "restart")
    w.run_until(running_attempt(1))
    flushes = len(w.backend.flush_calls)

    w.run_to(300)
    w.new_reconciler(RequestStore(os.path.join(w.tmp, "jobs"), fsync=False))  # a new leader, same annotation
    w.reconciler.store.request = store.request  # type: ignore[attr-defined]
    status = w.run_to(500)

    assert (status.phase, status.attempt.number) == (Phase.RUNNING, 1)
    assert len(w.backend.flush_calls) == flushes
    assert status.last_flush_request is not None and status.last_flush_request.outcome == "Committed"


def test_a_checkpoint_request_saves_on_every_agent_once_and_training_goes_on(tmp_path: Any) -> None:
    w, store = request_world(tmp_path)
    w.run_to(100)
    ask(store, "c-1", "checkpoint")

    status = w.run_until(lambda s: s.last_flush_request is not None and s.last_flush_request.outcome != "InProgress")

    request = status.last_flush_request
    assert request is not None and (request.mode, request.outcome) == ("checkpoint", "Committed")
    assert request.step is not None and request.step >= 94
    assert status.last_checkpoint is not None and status.last_checkpoint.step == request.step
    assert (status.phase, status.attempt.number) == (Phase.RUNNING, 0), "no stop, no restart"
    assert sorted(w.backend.save_calls) == [("train-0-0", "c-1"), ("train-0-1", "c-1")]
    assert w.backend.flush_calls == [] and w.backend.stop_calls == []
    assert [r for r in w.event_reasons() if r in ("CheckpointRequestedByUser", "FlushRequestCommitted")] == [
        "CheckpointRequestedByUser",
        "FlushRequestCommitted",
    ]

    w.run_to(200)  # the same annotation stays: nothing more
    assert len(w.backend.save_calls) == 2
    ask(store, "c-2", "checkpoint")
    status = w.run_until(lambda s: s.last_flush_request is not None and s.last_flush_request.id == "c-2")
    w.run_until(lambda s: s.last_flush_request is not None and s.last_flush_request.outcome == "Committed")
    assert [rid for _, rid in w.backend.save_calls].count("c-2") == 2


def test_a_checkpoint_that_does_not_come_within_the_flush_timeout_is_not_committed(tmp_path: Any) -> None:
    w, store = request_world(tmp_path, backend_options={"flush_outcome": "hang"})
    w.run_to(100)
    ask(store, "c-1", "checkpoint")

    status = w.run_until(lambda s: s.last_flush_request is not None and s.last_flush_request.outcome != "InProgress")

    request = status.last_flush_request
    assert request is not None and request.outcome == "NotCommitted" and "within 30s" in request.message
    assert w.clock.at() >= 130 and status.phase is Phase.RUNNING
    assert "FlushRequestNotCommitted" in w.event_reasons()
    # No checkpoint before the request: it said "nothing newer than nothing committed".
    assert w.status.last_checkpoint is None and "newer than nothing" not in request.message, request.message


def test_a_periodic_commit_made_before_the_request_does_not_end_it(tmp_path: Any) -> None:
    w, store = request_world(tmp_path, backend_options={"flush_outcome": "hang"})
    w.run_to(100)
    commit_checkpoint(w.storage, 90, EPOCH + timedelta(seconds=95), trigger="policy")
    ask(store, "c-1", "checkpoint")
    w.reconcile()  # takes it up, with step 90 as its baseline
    commit_checkpoint(w.storage, 80, EPOCH + timedelta(seconds=101), trigger="policy")  # older step: no

    status = w.run_to(120)

    assert status.last_flush_request is not None and status.last_flush_request.outcome == "InProgress"
    assert status.last_flush_request.baseline_step == 90


@pytest.mark.parametrize("mode", ["restart", "checkpoint"])
def test_a_request_while_the_job_cannot_take_it_is_skipped_and_says_why(tmp_path: Any, mode: str) -> None:
    w, store = request_world(tmp_path)
    ask(store, "early", mode)

    w.reconcile()  # attempt 0 just started: nothing runs yet

    request = w.status.last_flush_request
    assert request is not None and request.outcome == "Skipped" and "the job is Pending" in request.message
    status = w.run_until(running_attempt(0))
    assert status.last_flush_request == request and w.backend.flush_calls == [] and w.backend.save_calls == []
    assert "FlushRequestSkipped" in w.event_reasons()


def test_a_request_that_cannot_be_read_is_invalid_once(tmp_path: Any) -> None:
    w, store = request_world(tmp_path)
    w.run_to(100)
    store.problem = "spotjob.dev/flush-request.mode: Input should be 'restart' or 'checkpoint'"

    status = w.run_to(150)

    request = status.last_flush_request
    assert request is not None and request.outcome == "Invalid" and "mode" in request.message
    assert w.event_reasons().count("FlushRequestInvalid") == 1
    assert status.phase is Phase.RUNNING and w.backend.flush_calls == []


def test_a_notice_during_a_requested_restart_makes_it_a_preemption(tmp_path: Any) -> None:
    w, store = request_world(tmp_path, backend_options={"flush_seconds": 25.0})
    w.run_to(100)
    ask(store, "r-1", "restart")
    flushing = w.run_until(phase_is(Phase.FLUSHING))
    assert flushing.recovery is not None
    asked = flushing.recovery.detected_at
    w.clock.sleep(20)
    w.backend.notice("n0")

    status = w.run_until(phase_is(Phase.RESCHEDULING))

    assert status.preemptions == 1 and status.restart_history[-1].cause is Cause.PREEMPTION
    assert [a.value for a in status.avoid] == ["n0"], "the node going away is avoided"
    # Told as a notice is (on the job and its Node), and named for it: not FlushRequestedByUser.
    [interrupted] = [e for e in w.events.emitted if e.reason == "SpotInterrupted"]
    assert interrupted.node == "n0" and "during flush request r-1" in interrupted.message
    restart = status.restart_history[-1]
    assert restart.reason == "SpotInterrupted" and "during flush request r-1" in restart.message
    assert [a.reason for a in status.avoid] == ["SpotInterrupted"]
    assert status.last_flush_request is not None and status.last_flush_request.outcome == "Committed"
    [told] = [e for e in w.events.emitted if e.reason == "FlushCommitted"]
    # The time runs from the request: said "25.0s after the notice" of a notice 5 s before the
    # commit, and the notice-to-commit histogram took the 25 s.
    seconds = (w.clock.now() - asked).total_seconds()
    assert f"{seconds:.1f}s after the request" in told.message, told.message
    assert w.metrics.named("notice_to_commit") == [], "not a notice's time"


def test_a_request_written_while_another_is_in_progress_waits_for_it_and_loses_nothing(tmp_path: Any) -> None:
    """A second request (another person, a retried kubectl with a new id) while a restart is in
    progress: the first still gets its outcome in the status, the second is handled after it."""
    w, store = request_world(tmp_path)
    w.run_to(100)
    ask(store, "r-1", "restart")
    w.run_until(phase_is(Phase.FLUSHING))
    ask(store, "c-2", "checkpoint")

    status = w.run_until(lambda s: s.last_flush_request is not None and s.last_flush_request.id == "c-2")

    notes = [e.message for e in w.events.emitted if e.reason == "FlushRequestCommitted"]
    assert any("r-1" in n for n in notes), w.event_reasons()
    assert status.attempt.number == 1 and status.restart_history[-1].reason == "FlushRequestedByUser"
    status = w.run_until(lambda s: s.last_flush_request is not None and s.last_flush_request.outcome != "InProgress")
    assert status.last_flush_request is not None and status.last_flush_request.id == "c-2"


def test_a_forward_step_of_the_wall_clock_does_not_end_a_checkpoint_request_at_once(tmp_path: Any) -> None:
    """``kubectl spotjob flush --keep-running``: the leader's wall clock jumps an hour ahead while the
    agents save (NTP, a VM resumed); the next pass said NotCommitted at once, though the save had all
    of ``flushTimeoutSeconds`` to commit. The fake clock moves the wall clock alone (the fake
    backend's save hangs: its own timing reads the wall clock, not modelled here)."""
    w, store = request_world(tmp_path, backend_options={"flush_outcome": "hang"})
    w.run_to(100)
    ask(store, "c-1", "checkpoint")
    w.reconcile()  # takes it up
    started = w.clock.monotonic()

    w.clock.step_wall(3600)
    w.reconcile()
    assert w.status.last_flush_request is not None and w.status.last_flush_request.outcome == "InProgress"
    status = w.run_until(lambda s: s.last_flush_request is not None and s.last_flush_request.outcome != "InProgress")

    assert status.last_flush_request is not None and status.last_flush_request.outcome == "NotCommitted"
    assert w.clock.monotonic() >= started + 30


def test_a_checkpoint_request_in_progress_when_the_job_fails_ends_with_it(tmp_path: Any) -> None:
    """No pass follows a Failed job's: a request it left InProgress said so for as long as the job
    was kept, and ``kubectl spotjob flush`` had no answer to read."""
    w, store = request_world(tmp_path, backend_options={"flush_outcome": "hang"}, maxRestarts=0)
    w.run_to(100)
    ask(store, "c-1", "checkpoint")
    w.reconcile()  # takes it up; the agents' saves hang
    assert w.status.last_flush_request is not None and w.status.last_flush_request.outcome == "InProgress"
    w.backend.exit(0, 0, 1)

    status = w.run_until(lambda s: s.phase.terminal)

    assert (status.phase, status.reason) == (Phase.FAILED, "RestartBudgetExhausted")
    request = status.last_flush_request
    assert request is not None and (request.id, request.outcome) == ("c-1", "NotCommitted")
    assert "RestartBudgetExhausted" in request.message and request.step is None
    assert w.event_reasons()[-2:] == ["RestartBudgetExhausted", "FlushRequestNotCommitted"]


def test_a_restart_request_whose_gang_completes_while_it_flushes_ends_with_the_job(tmp_path: Any) -> None:
    """The training ends while the requested flush runs (every worker exits 0 first): the job
    Succeeded, and the request says it was not committed rather than InProgress for good."""
    w, store = request_world(tmp_path, backend_options={"flush_outcome": "hang"})
    w.run_to(100)
    ask(store, "r-1", "restart")
    w.run_until(phase_is(Phase.FLUSHING))
    w.backend.exit(0, 0, 0)  # the ranks finished before they served the flush
    w.backend.exit(0, 1, 0)

    status = w.run_until(lambda s: s.phase.terminal)

    assert (status.phase, status.reason) == (Phase.SUCCEEDED, "Completed")
    request = status.last_flush_request
    assert request is not None and (request.id, request.outcome) == ("r-1", "NotCommitted")
    assert "the job ended (Completed)" in request.message
    assert "FlushRequestNotCommitted" in w.event_reasons()


def test_an_earlier_id_written_again_is_not_handled_again(tmp_path: Any) -> None:
    """Requests c-1, then c-2, then c-1 again (a GitOps sync putting back an older manifest's
    annotation): only the last id was remembered, so c-1 was taken again, its saves (idempotent per
    id on the agents) never came, and it ended NotCommitted at the flush timeout."""
    w, store = request_world(tmp_path)
    w.run_to(100)
    for rid in ("c-1", "c-2"):
        ask(store, rid, "checkpoint")
        w.run_until(lambda s, rid=rid: s.last_flush_request is not None and s.last_flush_request.id == rid)
        w.run_until(lambda s: s.last_flush_request is not None and s.last_flush_request.outcome == "Committed")
    saves = len(w.backend.save_calls)

    ask(store, "c-1", "checkpoint")
    status = w.run_to(w.clock.at() + 60)
    w.new_reconciler(RequestStore(os.path.join(w.tmp, "jobs"), fsync=False))  # a new leader reads the status
    w.reconciler.store.request = store.request  # type: ignore[attr-defined]
    status = w.run_to(w.clock.at() + 60)

    request = status.last_flush_request
    assert request is not None and (request.id, request.outcome) == ("c-2", "Committed")
    assert request.earlier_ids == ["c-1"]
    assert len(w.backend.save_calls) == saves and w.event_reasons().count("CheckpointRequestedByUser") == 2


def test_earlier_ids_keep_the_newest_32() -> None:
    from orchestrator.model import MAX_EARLIER_FLUSH_REQUEST_IDS, FlushRequestStatus

    last = FlushRequestStatus(id="r-40", outcome="Committed", time=EPOCH, earlier_ids=[f"r-{i}" for i in range(8, 40)])
    assert last.handled("r-8") and last.handled("r-40") and not last.handled("r-7")
    after = last.ids_so_far()
    assert len(after) == MAX_EARLIER_FLUSH_REQUEST_IDS and after[0] == "r-9" and after[-1] == "r-40"


def test_a_checkpoint_request_in_progress_when_a_preemption_flushes_the_gang_ends_with_that_commit(
    tmp_path: Any,
) -> None:
    """``kubectl spotjob flush --keep-running`` and, before its save commits, a spot notice: the gang
    flushes (Flushing) and commits a checkpoint newer than the request. The request ended at the
    first Flushing pass, "the gang stopped before a checkpoint for it committed", while the flush's
    commit then came: the first valid checkpoint committed after the request ends it."""
    w, store = request_world(tmp_path, backend_options={"flush_seconds": 10.0})
    w.run_to(100)
    ask(store, "c-1", "checkpoint")
    w.reconcile()  # taken up: the saves are asked for, and commit 10 s later
    w.backend.notice("n0")
    w.run_until(phase_is(Phase.FLUSHING))

    status = w.run_until(lambda s: s.last_flush_request is not None and s.last_flush_request.outcome != "InProgress")

    request = status.last_flush_request
    assert request is not None and (request.id, request.outcome) == ("c-1", "Committed"), request
    assert request.step is not None and status.last_checkpoint is not None
    assert request.step <= status.last_checkpoint.step
    assert "FlushRequestNotCommitted" not in w.event_reasons()


@pytest.mark.parametrize("ending", ["Succeeded", "Failed"])
def test_a_request_on_an_ended_job_is_skipped_once_and_says_why(tmp_path: Any, ending: str) -> None:
    """``spotjob.dev/flush-request`` written on a Succeeded or Failed job got no answer at all: the
    pass of an ended job returned before any request was looked at, so ``lastFlushRequest`` stayed
    empty and a tool waiting on it waited for good. Found walking the test cluster."""
    w, store = request_world(tmp_path, maxRestarts=0)
    w.run_to(100)
    w.backend.exit(0, 0, 0 if ending == "Succeeded" else 1)
    w.backend.exit(0, 1, 0)
    ended = w.run_until(lambda s: s.phase.terminal)
    assert ended.phase.value == ending
    ask(store, "late-1", "restart")

    for _ in range(3):  # the annotation's change, then any later pass (a resync, a new leader)
        w.reconcile()
        w.clock.sleep(30)
    status = w.status

    request = status.last_flush_request
    assert request is not None and (request.id, request.outcome) == ("late-1", "Skipped")
    assert f"the job is {ending}: no running gang to flush" in request.message
    assert w.event_reasons().count("FlushRequestSkipped") == 1, "once, not every pass"
    assert (status.phase, status.reason) == (ended.phase, ended.reason)
    assert w.backend.flush_calls == []
