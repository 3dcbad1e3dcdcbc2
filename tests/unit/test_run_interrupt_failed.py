"""``failed_by_itself``: which exits ``spotjob run`` saw while it waited for an interrupt's flush are
a failure of the user's code (counted as one by ``Reconciler.driver_stopped``), and which are the
flush's. An agent whose command fails during a flush exits 76, as one whose flush failed does: its
own words (``decide_exit_code``'s, as the local backend reads them from its log) tell them apart."""

from __future__ import annotations

import pytest

from agent.control_channel import FlushResult
from agent.exit_codes import decide_exit_code
from orchestrator.backends.base import WorkerObservation
from orchestrator.model import WorkerPhase
from orchestrator.run_interrupt import failed_by_itself


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
