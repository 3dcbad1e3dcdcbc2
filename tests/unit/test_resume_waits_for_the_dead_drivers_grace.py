"""``spotjob run --resume`` waits for what a killed driver left flushing as long as that driver's
agents flush: their ``--parent-grace``, which is its ``--interrupt-deadline`` and which its
``run.json`` records, and the margin the wait always had past it."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from orchestrator.backends.local_cloud import ENV_RUN
from orchestrator.run_config import RunConfig
from orchestrator.run_driver import LocalRun
from orchestrator.run_folder import RUN_FILE
from orchestrator.run_setup import LEFTOVER_MARGIN_SECONDS, LEFTOVER_WAIT_SECONDS, leftover_wait_seconds


def _driven_and_gone(tmp_path: Path, **config: Any) -> Path:
    """A run whose driver (``RunConfig(**config)``) recorded its start, as every driver does, and
    went away: its folder."""
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    run = LocalRun(
        RunConfig(script=str(script), args=[], name="gone", runs_dir=str(tmp_path / "runs"), nproc=1, **config)
    )
    run.interrupt.signal = "SIGINT"  # as the handler keeps one that comes while it starts: run() records, then stops
    with pytest.raises(KeyboardInterrupt):
        run.run()
    return Path(run.path)


@pytest.mark.parametrize(("deadline", "wait"), [(None, 45.0), (120.0, 135.0), (5.0, 20.0)])
def test_the_wait_is_the_dead_drivers_interrupt_deadline_and_the_margin(
    tmp_path: Path, deadline: float | None, wait: float
) -> None:
    given = {} if deadline is None else {"interrupt_deadline": deadline}
    assert leftover_wait_seconds(str(_driven_and_gone(tmp_path, **given))) == wait


@pytest.mark.parametrize(
    "record",
    [
        {"pid": 1, "workdir": "/project"},  # a driver from before the grace was recorded
        {"pid": 1, "parent_grace": "120"},
        {"pid": 1, "parent_grace": True},
        {"pid": 1, "parent_grace": 0},
        {"pid": 1, "parent_grace": 86400.5},
    ],
)
def test_a_run_file_without_a_grace_an_agent_takes_waits_as_long_as_before(
    tmp_path: Path, record: dict[str, object]
) -> None:
    (tmp_path / RUN_FILE).write_text(json.dumps(record))
    assert leftover_wait_seconds(str(tmp_path)) == LEFTOVER_WAIT_SECONDS == 30.0 + LEFTOVER_MARGIN_SECONDS


def test_a_resume_waits_for_the_processes_of_a_killed_driver_as_long_as_their_flush_may_take(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Fails without the fix: a driver started with ``--interrupt-deadline 120`` (a flush that
    needs two minutes) gave its agents that grace when it was killed, but ``--resume`` waited 45 s
    for them and then stopped them mid-flush. It now waits the grace its ``run.json`` records and
    the margin."""
    path = _driven_and_gone(tmp_path, interrupt_deadline=120.0)
    # A process the dead driver left, flushing until the resume has said how long it waits for it.
    leftover = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()"],
        stdin=subprocess.PIPE,
        env={**os.environ, ENV_RUN: str(path)},
    )
    assert leftover.stdin is not None
    said: list[str] = []

    class _EndTheFlush(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "previous driver still run" in record.getMessage():
                said.append(record.getMessage())
                assert leftover.stdin is not None
                leftover.stdin.close()

    handler = _EndTheFlush()
    logger = logging.getLogger("orchestrator.cli_run")
    logger.addHandler(handler)
    try:
        with caplog.at_level(logging.WARNING, logger="orchestrator.cli_run"):
            resumed = LocalRun.resume(str(tmp_path / "runs"), "gone")
        resumed.close()
    finally:
        logger.removeHandler(handler)
        if leftover.poll() is None:
            leftover.kill()
        leftover.wait()
    assert said == [
        "run local/gone: 1 process(es) of the previous driver still run; waiting up to 135 s for their flush"
    ]
    assert resumed.takeover is not None and resumed.takeover.leftovers == 1
