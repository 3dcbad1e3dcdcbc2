"""Local mode's Events: a JSON line per Event beside the job, read back with repeats coalesced."""

from __future__ import annotations

import logging
import os
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from orchestrator.events import (
    NULL_METRICS,
    EventSink,
    EventType,
    JobMetrics,
    JsonlEventSink,
    events_path,
    read_events,
)
from orchestrator.model import JobKey

KEY = JobKey.local("train")


def test_events_are_appended_beside_the_job_and_read_back_with_repeats_coalesced(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    times = iter(datetime(2026, 1, 1, tzinfo=UTC) + timedelta(seconds=s) for s in range(10))
    sink = JsonlEventSink(str(tmp_path), now=lambda: next(times))
    assert isinstance(sink, EventSink)

    with caplog.at_level(logging.INFO, logger="orchestrator.events"):
        sink.emit(KEY, EventType.NORMAL, "SpotInterrupted", "notice for n0", node="n0")
        sink.emit(KEY, EventType.WARNING, "StorageUnreachable", "503")
        sink.emit(KEY, EventType.WARNING, "StorageUnreachable", "503")
        sink.emit(KEY, EventType.NORMAL, "Healthy", "ok")
        sink.emit(JobKey.local("other"), EventType.NORMAL, "WorkersStarted", "elsewhere")

    path = events_path(str(tmp_path), KEY)
    assert path == os.path.join(tmp_path, "local", "train.events.jsonl")
    with open(path, "a") as f:
        f.write('{"time": "torn')  # a line cut short by a crash
    events = read_events(path)
    assert [(e.reason, e.type, e.count, e.node) for e in events] == [
        ("SpotInterrupted", EventType.NORMAL, 1, "n0"),
        ("StorageUnreachable", EventType.WARNING, 2, None),
        ("Healthy", EventType.NORMAL, 1, None),
    ]
    unreachable = events[1]
    assert (unreachable.time - unreachable.first_time).total_seconds() == 1
    assert [e.reason for e in read_events(events_path(str(tmp_path), JobKey.local("other")))] == ["WorkersStarted"]
    assert read_events(str(tmp_path / "missing.jsonl")) == []
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2 and "job local/train StorageUnreachable: 503" in warnings[0].getMessage()


def test_an_event_that_cannot_be_written_is_logged_not_raised(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "local").write_text("a file where the folder should be")

    JsonlEventSink(str(tmp_path)).emit(KEY, EventType.NORMAL, "WorkersStarted", "x")

    assert any("could not record event WorkersStarted of job local/train" in r.getMessage() for r in caplog.records)


def test_the_null_metrics_have_the_job_metrics_shape() -> None:
    assert isinstance(NULL_METRICS, JobMetrics)
    from orchestrator.k8s.metrics import ControllerMetrics

    assert isinstance(ControllerMetrics(), JobMetrics), "the Prometheus metrics take the reconciler's calls"


def test_an_events_text_is_logged_on_one_line_with_its_control_characters_escaped(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An Event's message quotes others (a worker's last words, a store's error): logged raw, a
    newline in it forged a second log line and an ANSI escape reached the operator's terminal.
    The record on disk keeps the text as it was."""
    said = "rank 0 failed\n2026-12-04T03:25:00.000Z INFO forged: all good\x1b[2J"
    with caplog.at_level(logging.INFO, logger="orchestrator.events"):
        JsonlEventSink(str(tmp_path)).emit(KEY, EventType.WARNING, "WorkerFailed", said, node="n\r1")

    (line,) = [r.getMessage() for r in caplog.records]
    assert "\n" not in line and "\x1b" not in line and "\r" not in line, repr(line)
    assert "failed\\n2026-12-04T03:25:00.000Z INFO forged: all good\\x1b[2J" in line and "n\\r1" in line
    assert read_events(events_path(str(tmp_path), KEY))[0].message == said
