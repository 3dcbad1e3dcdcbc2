"""The times spotjob's own commands show: UTC, saying so, whatever the machine's ``TZ``.

The seam is the ``TZ`` variable (of a child process, or of this one with ``time.tzset()``): what
a machine in another zone does. Not modelled: a zone database missing on the machine (Python then
falls back to UTC by itself).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest

ZONE = "Asia/Kolkata"
"""UTC+05:30: no clock reading there looks like UTC's, not even its minutes."""

LOG_TIME = re.compile(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z) ", re.M)


@pytest.fixture
def far_zone(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("TZ", ZONE)
    time.tzset()
    yield
    monkeypatch.delenv("TZ")
    time.tzset()


def utc_log_times(text: str) -> list[datetime]:
    return [datetime.strptime(t, "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=UTC) for t in LOG_TIME.findall(text)]


def run_command(args: list[str], tmp_path: Path) -> tuple[datetime, str, datetime]:
    env = {**os.environ, "TZ": ZONE, "KUBECONFIG": str(tmp_path / "none"), "HOME": str(tmp_path)}
    before = datetime.now(UTC).replace(microsecond=0)
    done = subprocess.run(
        [sys.executable, *args], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False
    )
    return before, done.stderr, datetime.now(UTC)


@pytest.mark.parametrize(
    "args",
    [
        ["-m", "agent.launcher", "--checkpoint-uri", "file://{tmp}/ck", "--", sys.executable, "-c", "pass"],
        ["-m", "orchestrator.kubectl_plugin", "-v", "status"],
    ],
    ids=["spotjob-agent", "kubectl-spotjob"],
)
def test_a_commands_log_lines_carry_utc_times_in_another_zone(args: list[str], tmp_path: Path) -> None:
    """The agent's log says a notice's deadline in UTC (``2026-12-04T03:25:00Z``); its line's own
    time was the node's local time without a zone, so the two could not be compared."""
    before, stderr, after = run_command([a.replace("{tmp}", str(tmp_path)) for a in args], tmp_path)
    times = utc_log_times(stderr)
    assert times, f"no log line with a UTC time:\n{stderr}"
    assert all(before <= t <= after for t in times), (before, times, after)


def test_the_formatter_every_command_logs_with_says_utc(far_zone: None) -> None:
    """spotjob, spotjob-controller, spotjob-agent and kubectl-spotjob all format with it."""
    import logging

    from agent.streams import UtcFormatter

    record = logging.LogRecord("x", logging.INFO, __file__, 1, "hello", None, None)
    record.created = datetime(2030, 1, 1, 23, 59, 58, 250000, tzinfo=UTC).timestamp()
    record.msecs = 250.0
    assert UtcFormatter("%(asctime)s %(message)s").format(record) == "2030-01-01T23:59:58.250Z hello"


AT = datetime(2030, 1, 1, 23, 59, 58, tzinfo=UTC)
"""23:59:58 UTC: 05:29:58 the next day in Kolkata."""


def test_spotjob_status_shows_its_times_in_utc_with_the_date(far_zone: None) -> None:
    """``spotjob status NAME`` showed conditions, restarts, Events and cool-downs as the local time
    of day alone (``05:29:58``): another day's Event, or the same run folder looked at from a
    machine in another zone, read as a different time, while ``spotjob ckpt list`` says UTC."""
    from rich.console import Console

    from orchestrator.events import EventType, RecordedEvent
    from orchestrator.live import RunRecord, render_run_detail
    from orchestrator.model import Avoidance, Cause, Condition, JobStatus, RestartRecord

    status = JobStatus(
        conditions=[Condition(type="Ready", status="True", reason="Running", last_transition_time=AT)],
        restart_history=[RestartRecord(time=AT, attempt=1, cause=Cause.PREEMPTION, reason="SpotInterrupted")],
        avoid=[Avoidance(kind="node", value="local-node-1", until=AT, reason="SpotInterrupted")],
    )
    event = RecordedEvent(time=AT, first_time=AT, type=EventType.NORMAL, reason="Rescheduled", message="attempt 2")
    record = RunRecord(name="r", path="/runs/r", spec=None, status=status, controller_alive=True, events=[event])
    console = Console(record=True, width=200)
    console.print(render_run_detail(record))
    text = console.export_text()
    assert "05:29:58" not in text, text
    assert text.count("2030-01-01 23:59:58") == 4, text
    assert "UTC" in text


def test_a_runs_default_name_is_stamped_in_utc(far_zone: None) -> None:
    """``spotjob run train.py`` names the run ``train-<yyyymmdd-hhmmss>``; in local time, the hour
    a zone's clocks go back named a second run like the first (refused: the name exists), and the
    name's time disagreed with every time stored in the run, which are UTC."""
    from orchestrator.cli_run import default_name

    before = datetime.now(UTC).replace(microsecond=0)
    name = default_name("/jobs/train.py")
    after = datetime.now(UTC)
    stamp = datetime.strptime(name.removeprefix("train-"), "%Y%m%d-%H%M%S").replace(tzinfo=UTC)
    assert before <= stamp <= after, (before, name, after)


@pytest.mark.parametrize(
    ("seconds", "said"),
    [
        (30, "30 s ago"),
        (90 * 60, "90 min ago"),
        (5 * 3600, "5 h ago"),
        (3 * 86400, "3 d ago"),
        (-30, "0 s ago"),  # within a minute: the clocks of two machines, not a time ahead
        (-90, "90 s ahead of this clock"),
        (-10 * 60, "10 min ahead of this clock"),
        (-5 * 3600, "5 h ahead of this clock"),
        (-3 * 86400, "3 d ahead of this clock"),
    ],
)
def test_a_time_ahead_of_this_clock_is_said_in_the_units_of_an_age(seconds: float, said: str) -> None:
    """Ages are in s, min, h or d (README); a time ahead was always in minutes ("4320 min ahead of
    this clock" for three days)."""
    from datetime import timedelta

    from orchestrator.live import _ago

    now = datetime(2030, 1, 1, tzinfo=UTC)
    assert _ago(now - timedelta(seconds=seconds), now) == said
