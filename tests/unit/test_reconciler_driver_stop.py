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

from datetime import timedelta
from typing import Any

from fakes import KEY
from test_reconciler import World, make_world, phase_is, preempt_running_job, running_attempt

from agent.control_channel import EXIT_PREEMPTED
from orchestrator.model import Cause, Phase

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
