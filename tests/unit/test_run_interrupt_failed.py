"""``failed_by_itself``: which exits ``spotjob run`` saw while it waited for an interrupt's flush are
a failure of the user's code (counted as one by ``Reconciler.driver_stopped``), and which are the
flush's. An agent whose command fails during a flush exits 76, as one whose flush failed does: its
own words (``decide_exit_code``'s, as the local backend reads them from its log) tell them apart.

``at_failure`` and ``at_failure_line``: what ``spotjob run`` says (its Event
``InterruptedAtFailure``, its line on stderr) when such a failure, with no restart left, ended the
run: Failed, not resumed, so no ``--resume`` (the interrupt's own Event and line say one carries
on), but where the newest checkpoint is and how a new run carries on from it, as after any run
whose script used up its restarts."""

from __future__ import annotations

import pytest

from agent.control_channel import FlushResult
from agent.exit_codes import decide_exit_code
from orchestrator.backends.base import WorkerObservation
from orchestrator.model import JobStatus, Phase, WorkerPhase
from orchestrator.run_interrupt import InterruptOutcome, at_failure, at_failure_line, failed_by_itself


def exited(code: int | None, detail: str | None = None) -> WorkerObservation:
    return WorkerObservation(name="w-0-0", attempt=0, index=0, phase=WorkerPhase.FAILED, exit_code=code, detail=detail)


def agent_said(*, killed: bool = False, result: FlushResult | None = None, returncode: int = 1) -> WorkerObservation:
    code, why = decide_exit_code(
        returncode, flush_requested=True, result=result, closed_ranks=set(), expected_ranks=1, killed=killed
    )
    assert code == 76
    return exited(code, f"exiting {code}: {why} (log: /runs/x/logs/w-0-0.log)")


def test_a_command_that_ended_failing_while_its_flush_was_asked_is_a_failure_of_the_script() -> None:
    assert failed_by_itself(agent_said())
    assert failed_by_itself(agent_said(returncode=-9))  # a rank killed (the OOM killer): as without the flush


@pytest.mark.parametrize(
    "worker",
    [
        agent_said(killed=True),  # the agent stopped the command at the flush's deadline
        agent_said(result=FlushResult(step=None, uri=None, request_id="r", notice_to_commit_seconds=None, error="x")),
        exited(76),  # an agent that said nothing: not taken for the script's failure
    ],
    ids=["deadline", "flush-failed", "unsaid"],
)
def test_a_flush_that_failed_is_the_flushs(worker: WorkerObservation) -> None:
    assert not failed_by_itself(worker)


@pytest.mark.parametrize(
    ("code", "failed"), [(0, False), (75, False), (74, False), (79, False), (None, False), (1, True), (137, True)]
)
def test_the_other_exits(code: int | None, failed: bool) -> None:
    assert failed_by_itself(exited(code)) is failed


SPENT = JobStatus(phase=Phase.FAILED, reason="RestartBudgetExhausted", message="worker w-0-0 exited with code 76")
FAILED_FLUSH = InterruptOutcome(
    "SIGINT", tried=True, asked=("w-0-0",), why="the script of w-0-0 failed during the flush", resume_from=8
)


def test_a_run_failed_during_the_flush_says_how_a_new_run_carries_on_not_resume() -> None:
    said = at_failure(FAILED_FLUSH, 42, ["w-0-0"], SPENT, "s3://b/ckpt", "/runs")
    assert said.startswith(
        "SIGINT interrupted spotjob run (pid 42) as the script of w-0-0 failed by itself; the flush committed "
        "nothing. With no restart of --max-restarts left, that failure ended the run: Failed "
        "(RestartBudgetExhausted), and a failed run is not resumed; its newest checkpoint, step 8, stays in "
        "s3://b/ckpt: to carry on from it once the script is fixed, hand it to a new run"
    ), said
    assert said.endswith(
        "`spotjob ckpt adopt s3://b/ckpt --job local/NEW`, then "
        "`spotjob run --runs-dir /runs --name NEW --checkpoint-uri s3://b/ckpt SCRIPT ...`"
    ), said
    assert "--resume" not in said and "carries on from" not in said
    # What the interrupt's own Event says, which holds for a run that goes on only.
    assert "--resume carries on from step 8" in FAILED_FLUSH.event(42)[2]
    assert at_failure_line(FAILED_FLUSH, "job", ["w-0-0"]) == (
        "the interrupt (SIGINT) came as the script of w-0-0 failed by itself; the flush committed nothing; that "
        "failure ended job: it failed, and a failed run is not resumed"
    )


def test_with_no_checkpoint_there_is_nothing_to_hand_over() -> None:
    outcome = InterruptOutcome("SIGTERM", cut_short=True, why="a second SIGTERM stopped the run at once")
    said = at_failure(outcome, 42, ["w-0-0", "w-1-0"], SPENT, "s3://b/ckpt")
    assert "as the script of w-0-0, w-1-0 failed by itself; the flush committed nothing (a second SIGTERM" in said
    assert said.endswith("and a failed run is not resumed; it committed no checkpoint to carry on from"), said
    assert "ckpt adopt" not in said and "--resume" not in said


def test_a_flush_that_committed_and_a_failure_that_used_no_restart_budget() -> None:
    outcome = InterruptOutcome("SIGINT", tried=True, step=10, uri="s3://b/ckpt/step-10", resume_from=10)
    other = JobStatus(phase=Phase.FAILED, reason="InvalidCheckpointUri", message="no such bucket")
    said = at_failure(outcome, 42, [], other, "s3://b/ckpt")
    assert said == (
        "SIGINT interrupted spotjob run (pid 42) as the run failed; the flush it asked for committed step 10 at "
        "s3://b/ckpt/step-10. That failure ended the run: Failed (InvalidCheckpointUri), and a failed run is "
        "not resumed"
    )
