"""``Reconciler.driver_stopped``: the pass after the process that drives a job stopped every worker
of it on purpose (an interrupted ``spotjob run``), on the fake backend and clock of
``test_reconciler``.

What the stop leaves (agents that flushed and exited 75, workers killed without an exit code, and,
for the next driver, no worker at all) reads as a preemption to any other pass: ``AgentPreempted``
now, ``WorkerLost`` once a new driver finds the gang gone. Each counted one more preemption for an
interrupt. The pass ends the attempt as a restart asked for instead, or, when every worker exited 0
first, finishes the job as any pass would.
"""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta
from typing import Any

import pytest
from fakes import KEY
from test_reconciler import World, make_world, phase_is, preempt_running_job, running_attempt

from agent.catalog import latest_valid
from agent.control_channel import EXIT_FLUSH_FAILED, EXIT_PREEMPTED
from agent.exit_codes import PEER_FLUSH
from orchestrator.backends.base import WorkerObservation, worker_name
from orchestrator.model import Cause, Phase, WorkerPhase
from orchestrator.reconciler import BeforeStop
from orchestrator.signals import Signal, SignalKind

W0, W1 = worker_name(KEY, 0, 0), worker_name(KEY, 0, 1)
MESSAGE = "SIGINT interrupted spotjob run (pid 1): the flush it asked for committed step 20"


def stopped_by_its_driver(world: World, reason: str = "InterruptFlushCommitted", **kwargs: Any) -> Any:
    return world.reconciler.driver_stopped(KEY, reason=reason, message=MESSAGE, **kwargs)


def driven_again(world: World) -> None:
    """A new driver (``spotjob run --resume``): its backend knows none of the old workers."""
    world.backend.workers.clear()
    world.new_reconciler()
    world.next_at = world.clock.at()


def test_an_attempt_its_driver_flushed_and_stopped_restarts_from_the_flush_with_no_preemption(tmp_path: Any) -> None:
    world = make_world(tmp_path)
    world.run_to(25)
    asked = world.clock.now()
    for index in (0, 1):  # the driver had every agent flush: they committed and exited 75
        world.backend.agent_hears_notice(0, index)
    step = world.backend.commits[-1]
    world.clock.advance(3)

    status = stopped_by_its_driver(world, since=asked)

    assert status is not None and status == world.status
    assert (status.phase, status.reason, status.message) == (Phase.RESCHEDULING, "InterruptFlushCommitted", MESSAGE)
    assert (status.preemptions, status.restarts, status.attempt.number) == (0, 0, 1)
    assert status.last_checkpoint is not None and status.last_checkpoint.step == step
    assert status.recovery is not None and status.recovery.cause is Cause.REQUESTED
    assert [(h.attempt, h.cause, h.reason, h.message) for h in status.restart_history] == [
        (0, Cause.REQUESTED, "InterruptFlushCommitted", MESSAGE)
    ]
    assert status.workers == [] and status.avoid == []
    assert status.flushing_seconds == 3.0
    assert world.event_reasons()[-2:] == ["InterruptFlushCommitted", "Rescheduled"]
    assert "attempt 1 starts once the job is driven again" in world.events.emitted[-1].message
    assert world.backend.stop_calls == [], "every process was stopped already"

    driven_again(world)
    status = world.run_until(running_attempt(1))
    assert (status.preemptions, status.restarts, status.attempt.resumed_from_step) == (0, 0, step)
    assert "WorkerLost" not in world.event_reasons() and "AgentPreempted" not in world.event_reasons()
    assert world.metrics.named("preemption") == []


def test_an_attempt_stopped_while_it_started_is_started_again_with_no_preemption(tmp_path: Any) -> None:
    world = make_world(tmp_path)
    world.reconcile()  # attempt 0's workers are created; they would run from 5
    world.clock.advance(1)
    world.backend.workers.clear()  # killed by the driver before they ran

    status = stopped_by_its_driver(world, reason="Interrupted")

    assert status is not None and (status.phase, status.reason) == (Phase.RESCHEDULING, "Interrupted")
    assert (status.preemptions, status.attempt.number) == (0, 1)
    driven_again(world)
    status = world.run_until(running_attempt(1))
    assert status.preemptions == 0 and "WorkerLost" not in world.event_reasons()


def test_a_gang_that_finished_before_the_stop_succeeds_and_the_stop_is_not_told(tmp_path: Any) -> None:
    world = make_world(tmp_path, backend_options={"total_steps": 20})
    world.run_to(24)
    world.clock.advance(3)  # the workers ran from 5 and finished step 20 at 25; no pass saw it
    assert world.status.phase is Phase.RUNNING

    status = stopped_by_its_driver(world, reason="InterruptFlushNotCommitted", warning=True)

    assert status is not None and (status.phase, status.reason) == (Phase.SUCCEEDED, "Completed")
    assert status.completion_time is not None and status.restart_history == []
    assert world.event_reasons()[-1] == "Completed"
    assert "InterruptFlushNotCommitted" not in world.event_reasons()


def test_a_preemptions_flush_that_the_stop_ended_counts_once_as_that_preemption(tmp_path: Any) -> None:
    world = make_world(tmp_path)
    preempt_running_job(world, at=30)
    world.reconcile()  # Flushing: every agent is asked
    assert world.status.phase is Phase.FLUSHING
    world.clock.advance(1)
    for index in (0, 1):
        world.backend.exit(0, index, EXIT_PREEMPTED)  # stopped by the driver meanwhile

    status = stopped_by_its_driver(world, reason="Interrupted")

    assert status is not None and status.phase is Phase.RESCHEDULING and status.reason == "Interrupted"
    assert (status.preemptions, status.attempt.number) == (1, 1)
    assert [(h.cause, h.reason) for h in status.restart_history] == [(Cause.PREEMPTION, "SpotInterrupted")]


def test_a_job_between_two_attempts_waits_for_the_next_driver_with_its_attempt_unchanged(tmp_path: Any) -> None:
    world = make_world(tmp_path)
    preempt_running_job(world, at=30)
    world.run_until(phase_is(Phase.RESCHEDULING))
    before = world.status

    status = stopped_by_its_driver(world, reason="Interrupted")

    assert status is not None and (status.phase, status.reason) == (Phase.RESCHEDULING, "Interrupted")
    assert status.attempt == before.attempt and status.restart_history == before.restart_history
    assert status.preemptions == before.preemptions == 1
    world.clock.advance(timedelta(minutes=5).total_seconds())
    driven_again(world)
    assert world.run_until(running_attempt(1)).preemptions == 1


def test_an_ended_job_is_left_as_it_is(tmp_path: Any) -> None:
    world = make_world(tmp_path, backend_options={"total_steps": 10})
    world.run_until(phase_is(Phase.SUCCEEDED))
    told = list(world.event_reasons())

    status = stopped_by_its_driver(world, reason="Interrupted")

    assert status is not None and status.phase is Phase.SUCCEEDED
    assert world.event_reasons() == told


def test_a_worker_whose_code_failed_before_the_stop_is_that_failure_not_the_interrupts_restart(
    tmp_path: Any,
) -> None:
    world = make_world(tmp_path)
    world.run_to(25)
    asked = world.clock.now()
    world.backend.exit(0, 0, 1)  # its script raised while the driver waited for the flush
    world.backend.exit(0, 1, EXIT_FLUSH_FAILED)  # its peer's flush could not commit without it
    world.clock.advance(3)

    status = stopped_by_its_driver(
        world, reason="InterruptFlushNotCommitted", warning=True, since=asked, before_stop=BeforeStop(failed=(W0,))
    )

    assert status is not None
    assert (status.phase, status.reason) == (Phase.RESCHEDULING, "InterruptFlushNotCommitted")
    # Counted as the crash it was: a restart of maxRestarts, the backoff of a failure; no preemption.
    assert (status.preemptions, status.restarts, status.attempt.number) == (0, 1, 1)
    assert status.recovery is not None and status.recovery.cause is Cause.FAILURE
    assert [(h.cause, h.reason) for h in status.restart_history] == [(Cause.FAILURE, "WorkerFailed")]
    assert status.recovery.restart_at == world.clock.now() + timedelta(seconds=10)
    reasons = world.event_reasons()
    assert reasons[-3:] == ["InterruptFlushNotCommitted", "WorkerFailed", "Rescheduled"], reasons
    assert f"worker {W0} exited with code 1; restart 1 of" in world.events.emitted[-2].message


def test_a_failure_before_the_stop_with_no_restart_left_fails_the_job(tmp_path: Any) -> None:
    world = make_world(tmp_path, maxRestarts=0)
    world.run_to(25)
    world.backend.exit(0, 1, 3)
    world.clock.advance(1)

    status = stopped_by_its_driver(world, reason="InterruptFlushNotCommitted", before_stop=BeforeStop(failed=(W1,)))

    assert status is not None and (status.phase, status.reason) == (Phase.FAILED, "RestartBudgetExhausted")
    assert "InterruptFlushNotCommitted" not in world.event_reasons()


def test_exits_the_stop_caused_are_no_failure(tmp_path: Any) -> None:
    world = make_world(tmp_path)
    world.run_to(25)
    for index in (0, 1):
        world.backend.exit(0, index, 143)  # killed by the driver's stop: not in before_stop.failed
    status = stopped_by_its_driver(world, reason="Interrupted", before_stop=BeforeStop())
    assert status is not None and status.restarts == 0
    assert [(h.cause, h.reason) for h in status.restart_history] == [(Cause.REQUESTED, "Interrupted")]


def test_a_notice_heard_before_the_interrupt_is_the_preemption_it_was(tmp_path: Any) -> None:
    world = make_world(tmp_path)
    world.run_to(25)
    notice = world.backend.notice("n0")  # no pass saw it: the driver was interrupted first
    # As the local backend reports it: with when the notice came.
    heard = tuple(replace(s, observed_at=world.clock.now()) for s in world.backend.signals(KEY, world.spec))
    world.clock.advance(1)
    asked = world.clock.now()
    for index in (0, 1):  # the agents flushed (for the notice, and for the driver) and exited 75
        world.backend.agent_hears_notice(0, index)
    step = world.backend.commits[-1]
    world.clock.advance(2)

    status = stopped_by_its_driver(
        world, reason="InterruptFlushCommitted", since=asked, before_stop=BeforeStop(signals=heard)
    )

    assert status is not None
    assert (status.phase, status.reason) == (Phase.RESCHEDULING, "InterruptFlushCommitted")
    assert (status.preemptions, status.restarts) == (1, 0)
    assert [(h.cause, h.reason) for h in status.restart_history] == [(Cause.PREEMPTION, "SpotInterrupted")]
    assert [a.value for a in status.avoid if a.kind == "node"] == [notice.node]
    assert status.last_checkpoint is not None and status.last_checkpoint.step == step
    reasons = world.event_reasons()
    assert reasons[-4:] == ["InterruptFlushCommitted", "SpotInterrupted", "FlushCommitted", "Rescheduled"], reasons
    assert status.flushing_seconds == 3.0  # from the notice, not from the interrupt
    assert world.metrics.named("preemption") == [()]


def test_an_agent_that_flushed_for_a_notice_only_it_heard_before_the_interrupt_is_the_preemption_it_was(
    tmp_path: Any,
) -> None:
    """No backend signal (a GCE host maintenance is the agent's alone), but the driver saw W0's
    agent exit 75 for a flush of its own, not the interrupt's: counted as the preemption it was
    (``AgentPreempted``), as on any pass. It used to end as a restart asked for, no preemption."""
    world = make_world(tmp_path)
    world.run_to(25)
    asked = world.clock.now()
    world.backend.agent_hears_notice(0, 0)  # its own notice's flush, which the interrupt's request met
    world.backend.answered[W0] = "gcp maintenance: TERMINATE_ON_HOST_MAINTENANCE"
    world.backend.exit(0, 1, EXIT_PREEMPTED)  # the peer: its ranks flushed at the same step
    step = world.backend.commits[-1]
    world.clock.advance(2)

    status = stopped_by_its_driver(world, since=asked, before_stop=BeforeStop(preempted=(W0,)))

    assert status is not None
    assert (status.phase, status.reason) == (Phase.RESCHEDULING, "InterruptFlushCommitted")
    assert (status.preemptions, status.restarts) == (1, 0)
    assert [(h.cause, h.reason) for h in status.restart_history] == [(Cause.PREEMPTION, "AgentPreempted")]
    assert status.last_checkpoint is not None and status.last_checkpoint.step == step
    reasons = world.event_reasons()
    assert reasons[-4:] == ["InterruptFlushCommitted", "AgentPreempted", "FlushCommitted", "Rescheduled"], reasons
    assert world.metrics.named("preemption") == [()]
    [told] = [e for e in world.events.emitted if e.reason == "AgentPreempted"]
    assert told.message.endswith("exited 75 (its flush answered gcp maintenance: TERMINATE_ON_HOST_MAINTENANCE)")

    # Its exit after the interrupt asked (the stop's doing, or the interrupt's own flush): not one.
    world = make_world(tmp_path / "own")
    world.run_to(25)
    for index in (0, 1):
        world.backend.agent_hears_notice(0, index)
    status = stopped_by_its_driver(world, since=world.clock.now(), before_stop=BeforeStop())
    assert status is not None and (status.preemptions, status.restarts) == (0, 0)


def test_the_agentpreempted_of_an_interrupt_names_the_agent_that_heard_the_notice_not_its_peer(
    tmp_path: Any,
) -> None:
    """Both agents exited 75 before the interrupt asked for a flush (both count as the preemption
    that came first), W0's for the flush W1's agent began for a host maintenance. The Event named W0,
    whose flush answered no notice of its own, as the agent that heard one; it names W1."""
    world = make_world(tmp_path)
    world.run_to(25)
    asked = world.clock.now()
    world.backend.agent_hears_notice(0, 1)
    world.backend.answered[W1] = "gcp maintenance: TERMINATE_ON_HOST_MAINTENANCE"
    world.backend.exit(0, 0, EXIT_PREEMPTED)
    world.backend.answered[W0] = PEER_FLUSH
    world.clock.advance(2)

    status = stopped_by_its_driver(world, since=asked, before_stop=BeforeStop(preempted=(W0, W1)))

    assert status is not None and (status.preemptions, status.restarts) == (1, 0)
    [told] = [e for e in world.events.emitted if e.reason == "AgentPreempted"]
    assert told.message.startswith(f"the agent of {W1} on node "), told.message
    assert told.message.endswith("(its flush answered gcp maintenance: TERMINATE_ON_HOST_MAINTENANCE)"), told.message


def test_a_notice_for_a_node_the_attempt_does_not_use_changes_nothing(tmp_path: Any) -> None:
    world = make_world(tmp_path)
    world.run_to(25)
    stray = Signal(kind=SignalKind.SPOT_INTERRUPTION, source="fake", node="elsewhere", detail="test notice")
    status = stopped_by_its_driver(world, reason="Interrupted", before_stop=BeforeStop(signals=(stray,)))
    assert status is not None and status.preemptions == 0
    assert [h.cause for h in status.restart_history] == [Cause.REQUESTED]


def test_a_checkpoint_the_driver_read_once_nothing_could_commit_is_not_read_again(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    world = make_world(tmp_path)
    world.run_to(25)
    for index in (0, 1):
        world.backend.agent_hears_notice(0, index)
    newest = latest_valid(world.storage)
    assert newest is not None
    listed: list[str] = []
    real = world.storage.list_dirs

    def counted(prefix: str = "") -> list[str]:
        listed.append(prefix)
        return real(prefix)

    monkeypatch.setattr(world.storage, "list_dirs", counted)
    assert latest_valid(world.storage) == newest and listed, "the seam is where a read of the newest lists"
    listed.clear()

    status = stopped_by_its_driver(world, before_stop=BeforeStop(newest=(newest,)))

    assert status is not None and status.last_checkpoint is not None
    assert status.last_checkpoint.step == newest.ref.step
    assert listed == [], "storage was listed again"


def test_a_worker_lost_before_the_stop_is_the_preemption_it_was(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    world = make_world(tmp_path)
    world.run_to(25)
    world.backend.agent_hears_notice(0, 1)
    real = world.backend.list_workers

    def reclaimed(key: Any, spec: Any) -> list[WorkerObservation]:
        # Its node was reclaimed under it: no exit code, as the local backend reports a lost worker.
        return [replace(w, phase=WorkerPhase.FAILED, exit_code=None) if w.name == W0 else w for w in real(key, spec)]

    monkeypatch.setattr(world.backend, "list_workers", reclaimed)
    lost = BeforeStop(lost=(W0,))

    status = stopped_by_its_driver(world, reason="InterruptFlushCommitted", before_stop=lost)

    assert status is not None and (status.preemptions, status.restarts) == (1, 0)
    assert [(h.cause, h.reason) for h in status.restart_history] == [(Cause.PREEMPTION, "WorkerLost")]
