"""``spotjob run --interrupt-deadline``: the deadline a Ctrl-C or SIGTERM gives the training
workers' flush, from the command line (a new run's and a resumed run's: it is the driver's, not the
spec's) to the agents' ``POST /flush``. Without it, the 30 s it always was."""

from __future__ import annotations

from datetime import datetime
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest

from orchestrator.backends.base import FlushRequestState, WorkerObservation
from orchestrator.cli import build_parser
from orchestrator.cli_run import prepare
from orchestrator.model import CheckpointSpec, JobKey, JobSpec, WorkerPhase
from orchestrator.run_interrupt import INTERRUPT_FLUSH_SECONDS, InterruptState, flush_before_stop


def _deadline_the_driver_gives(monkeypatch: pytest.MonkeyPatch, argv: list[str]) -> float:
    """What an interrupt of the run ``argv`` makes would hand ``flush_before_stop``."""
    import orchestrator.run_driver as run_driver

    given: dict[str, Any] = {}

    def flush(*args: Any, **kwargs: Any) -> Any:
        given.update(kwargs)
        raise KeyboardInterrupt  # as a second signal would: nothing more is asked of it

    monkeypatch.setattr(run_driver, "flush_before_stop", flush)
    run = prepare(build_parser().parse_args(argv))
    try:
        run.interrupt.signal = "SIGTERM"
        run._flush_for_interrupt()
    finally:
        run.close()
    return float(given["deadline_seconds"])


def test_the_deadline_given_on_the_command_line_is_the_interrupts_and_a_resume_may_give_another(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    runs = str(tmp_path / "runs")
    new = ["run", "--runs-dir", runs, "--name", "big", "--nproc", "1", "--interrupt-deadline", "90", str(script)]
    assert _deadline_the_driver_gives(monkeypatch, new) == 90.0
    resumed = ["run", "--runs-dir", runs, "--resume", "big", "--interrupt-deadline", "7.5"]
    assert _deadline_the_driver_gives(monkeypatch, resumed) == 7.5
    assert _deadline_the_driver_gives(monkeypatch, ["run", "--runs-dir", runs, "--resume", "big"]) == 30.0
    assert INTERRUPT_FLUSH_SECONDS == 30.0


def test_the_agents_are_asked_to_flush_by_that_deadline(tmp_path: Path) -> None:
    asked: list[datetime | None] = []
    training = WorkerObservation(name="x-0-0", attempt=0, index=0, phase=WorkerPhase.RUNNING)
    exited = WorkerObservation(name="x-0-0", attempt=0, index=0, phase=WorkerPhase.FAILED, exit_code=75)
    backend = SimpleNamespace(
        hold_notices=lambda: None,
        signals=lambda *_: [],
        list_workers=lambda *_: [exited],
        training_workers=lambda *_: [training],
        request_flush=lambda key, spec, w, reason, deadline: asked.append(deadline) or FlushRequestState.accepted(),
    )
    spec = JobSpec(command=["train.py"], checkpoint=CheckpointSpec(uri=str(tmp_path / "ckpt")))
    state = InterruptState(signal="SIGTERM")
    flush_before_stop(
        cast(Any, backend),
        JobKey.local("x"),
        spec,
        state,
        name="x",
        phase="Running",
        last_known=None,
        idle=lambda _: None,
        deadline_seconds=240.0,
    )
    assert state.asked_at is not None and asked
    assert [(d - state.asked_at).total_seconds() if d else None for d in asked] == [240.0]


@pytest.mark.parametrize(("deadline", "margin"), [(30.0, 15.0), (600.0, 15.0), (12.0, 6.0), (2.0, 5.0)])
def test_the_wait_past_the_deadline_for_the_agents_to_exit_shrinks_with_a_short_deadline(
    deadline: float, margin: float
) -> None:
    from orchestrator.run_interrupt import exit_margin

    assert exit_margin(deadline) == margin
