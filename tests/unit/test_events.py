"""Local mode's Events: a JSON line per Event beside the job, read back with repeats counted on one Event."""

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


def _s3_error(request_id: str, extended_id: str) -> str:
    """An S3-compatible store's SlowDown as botocore words it, the store's message carrying ids."""
    from botocore.exceptions import ClientError

    error = ClientError(
        {
            "Error": {
                "Code": "SlowDown",
                "Message": f"Please reduce your request rate. (Request ID: {request_id}; "
                f"S3 Extended Request ID: {extended_id})",
            },
            "ResponseMetadata": {"RequestId": request_id, "HostId": extended_id, "HTTPStatusCode": 503},
        },
        "ListObjectsV2",
    )
    return str(error)


def _gcs_error(upload_id: str, at: str) -> str:
    """Cloud Storage's 503 as google-api-core words it, with its upload id and the time of the answer."""
    from google.api_core.exceptions import ServiceUnavailable

    return str(
        ServiceUnavailable(
            f"GET https://storage.example/storage/v1/b/ckpt/o?prefix=train%2F: We encountered an internal "
            f"error. Please try again. (X-GUploader-UploadID: {upload_id}; date: {at})"
        )
    )


def test_one_fault_whose_error_carries_another_request_id_each_pass_is_one_event_counted_up(tmp_path: Path) -> None:
    from orchestrator.reconciler._reasons import FLUSH_REQUEST_FAILED, STORAGE_UNREACHABLE

    sink = JsonlEventSink(str(tmp_path))
    uri = "s3://bucket/train"
    s3 = [
        _s3_error("4442587FB7D0A2F9", "Uuag1LuByRx9e6j5Onimru9pO4ZVKnJ2Qz7/C1NPcfTWAtRPfTaOFg=="),
        _s3_error("9B2C6A0F1E3D4C58", "yVzOw3ilHVzTRwM1pVlXX3kZC4zCvqFiFRsYrQ5cVLwYJbYhw7xyEw=="),
        _s3_error("07D1E5A3C9B2F6E4", "hT0hA1nnG9Lw4B2e1bUl0Xl3zjkcW2yq8PkqAFnN4tQZ0k8H9mTqVg=="),
    ]
    gcs = [
        _gcs_error("ADPycdtZ1m9sYqJ0Xb3kQe", "2026-01-01T12:00:00.123Z"),
        _gcs_error("ABPtcPp4x2nT8Lw7hGcVr1", "2026-01-01T12:00:10.456Z"),
    ]
    agent = [
        "POST /flush to the agent at 10.0.3.7:8080 failed: [Errno 111] Connection refused",
        "POST /flush to the agent at 10.0.3.9:8080 failed: [Errno 111] Connection refused",
    ]
    for error in s3:
        sink.emit(KEY, EventType.WARNING, STORAGE_UNREACHABLE.name, STORAGE_UNREACHABLE.message(uri=uri, error=error))
    for error in gcs:
        sink.emit(KEY, EventType.WARNING, STORAGE_UNREACHABLE.name, STORAGE_UNREACHABLE.message(uri=uri, error=error))
    for error in agent:
        message = FLUSH_REQUEST_FAILED.message(worker="train-0-1", error=error)
        sink.emit(KEY, EventType.WARNING, FLUSH_REQUEST_FAILED.name, message, node="n1")
    # Another fault, or another worker's, is another Event.
    other = FLUSH_REQUEST_FAILED.message(worker="train-0-2", error=agent[0])
    sink.emit(KEY, EventType.WARNING, FLUSH_REQUEST_FAILED.name, other, node="n2")

    events = read_events(events_path(str(tmp_path), KEY))

    assert [(e.reason, e.count) for e in events] == [
        ("StorageUnreachable", 3),
        ("StorageUnreachable", 2),
        ("FlushRequestFailed", 2),
        ("FlushRequestFailed", 1),
    ]
    # Each keeps the latest words in full, its ids included.
    assert "07D1E5A3C9B2F6E4" in events[0].message and "SlowDown" in events[0].message
    assert "ABPtcPp4x2nT8Lw7hGcVr1" in events[1].message
    assert "10.0.3.9:8080" in events[2].message and events[3].message == other


@pytest.mark.parametrize(
    ("reason", "one", "another"),
    [
        ("StorageUnreachable", "listing s3://b/x: SlowDown (HTTP 503)", "listing s3://b/x: AccessDenied (HTTP 403)"),
        ("StorageUnreachable", "crc32c 1a2b3c4d expected", "crc32c 5e6f7a8b expected"),
        ("FlushRequestFailed", "the agent of train-0-1: refused", "the agent of train-0-2: refused"),
        ("FlushTimedOut", "nothing newer than step 100 committed", "nothing newer than step 200 committed"),
        # spotjob's own words are never masked: a held notice moved to another due time is told
        # again, and the same words of another worker's address are another Event.
        (
            "NoticeHeld",
            "llama-0-0 on node n1 holds azure's maintenance notice (Reboot e-1), due at 2026-12-07T02:15:00Z",
            "llama-0-0 on node n1 holds azure's maintenance notice (Reboot e-1), due at 2026-12-07T02:17:00Z",
        ),
        ("WorkerLost", "the pod at 10.0.3.7 is gone", "the pod at 10.0.3.9 is gone"),
    ],
)
def test_messages_that_differ_in_more_than_ids_times_and_addresses_stay_apart(
    reason: str, one: str, another: str
) -> None:
    from orchestrator.events import event_identity

    assert event_identity(reason, one) != event_identity(reason, another)


def test_the_masked_reasons_are_those_whose_message_carries_another_components_error() -> None:
    """A name there that no Reason has would mask nothing (a typo); each masked reason's message
    carries an ``{error}``, another component's words."""
    from orchestrator.events import VOLATILE_ERROR_REASONS
    from orchestrator.reconciler import _reasons

    reasons = [r for r in vars(_reasons).values() if isinstance(r, _reasons.Reason)]
    for name in VOLATILE_ERROR_REASONS:
        templates = [r.template for r in reasons if r.name == name]
        assert templates, f"{name} is no Reason's name"
        assert all("{error}" in t for t in templates), (name, templates)


def test_two_flush_requests_of_a_user_are_two_events_each_naming_its_own_id(tmp_path: Path) -> None:
    """``kubectl spotjob flush`` gives each request a UUID, which Events name: the user finds theirs."""
    from orchestrator.kubectl_commands import flush_request
    from orchestrator.reconciler._reasons import CHECKPOINT_REQUESTED_BY_USER, FLUSH_REQUEST_SKIPPED

    sink = JsonlEventSink(str(tmp_path))
    ids = [flush_request("checkpoint", "")["id"] for _ in range(2)]
    for request in ids:
        message = CHECKPOINT_REQUESTED_BY_USER.message(id=request, reason="", count=2)
        sink.emit(KEY, EventType.NORMAL, CHECKPOINT_REQUESTED_BY_USER.name, message)
    hand_made = ["nightly-0123456789abcdef0123", "nightly-fedcba98765432100123"]
    for request in hand_made:
        message = FLUSH_REQUEST_SKIPPED.message(id=request, mode="checkpoint", why="the job is not running")
        sink.emit(KEY, EventType.NORMAL, FLUSH_REQUEST_SKIPPED.name, message)

    events = read_events(events_path(str(tmp_path), KEY))

    assert [e.count for e in events] == [1, 1, 1, 1]
    for event, request in zip(events, [*ids, *hand_made], strict=True):
        assert f"flush request {request} " in event.message


def test_repeats_of_two_events_interleaved_are_two_events_counted_up_in_the_order_of_their_latest(
    tmp_path: Path,
) -> None:
    """Two workers' FlushRequestFailed alternating on each pass (A, B, A, B, A, B) were six Events
    of count 1: only a repeat of the Event just before was counted on it. On Kubernetes the
    recorder counts a repeat by its object, type, reason and masked message whatever came between,
    and ``kubectl spotjob events`` lists them oldest first by their latest occurrence; local mode
    now does the same. Found walking local mode's Events."""
    from orchestrator.events import EventLog

    start = datetime(2026, 1, 1, tzinfo=UTC)
    times = iter(start + timedelta(seconds=s) for s in range(100))
    sink = JsonlEventSink(str(tmp_path), now=lambda: next(times))
    path = events_path(str(tmp_path), KEY)
    log = EventLog(path)

    def failed(worker: str, port: int) -> None:
        message = f"could not ask the agent of {worker} to flush: connection refused (127.0.0.1:{port})"
        sink.emit(KEY, EventType.WARNING, "FlushRequestFailed", message, node=f"node-{worker}")

    sink.emit(KEY, EventType.NORMAL, "WorkersRunning", "every worker of attempt 0 is running")  # t0
    for attempt in range(3):  # t1..t6
        failed("train-0-0", 40000 + attempt)
        failed("train-0-1", 40000 + attempt)
        if attempt == 0:
            assert [(e.reason, e.count) for e in log.read()] == [
                ("WorkersRunning", 1), ("FlushRequestFailed", 1), ("FlushRequestFailed", 1)
            ]  # fmt: skip
    failed("train-0-0", 40003)  # t7: A's latest is now after B's

    events = read_events(path)

    assert [(e.reason, e.node, e.count) for e in events] == [
        ("WorkersRunning", None, 1),
        ("FlushRequestFailed", "node-train-0-1", 3),
        ("FlushRequestFailed", "node-train-0-0", 4),
    ]
    b, a = events[1:]
    assert (b.first_time, b.time) == (start + timedelta(seconds=2), start + timedelta(seconds=6))
    assert (a.first_time, a.time) == (start + timedelta(seconds=1), start + timedelta(seconds=7))
    assert "127.0.0.1:40003" in a.message and "127.0.0.1:40002" in b.message  # the latest words
    assert log.read() == events  # read a little at a time, the same


def test_a_repeat_later_than_the_series_window_after_the_last_is_a_new_event(tmp_path: Path) -> None:
    """As on Kubernetes, whose recorder starts a new Event for a repeat more than its series
    window (an hour) after the last one."""
    from orchestrator.events import SERIES_WINDOW_SECONDS

    start = datetime(2026, 1, 1, tzinfo=UTC)
    seconds = iter([0, SERIES_WINDOW_SECONDS, 2 * SERIES_WINDOW_SECONDS + 1, 2 * SERIES_WINDOW_SECONDS + 2])
    sink = JsonlEventSink(str(tmp_path), now=lambda: start + timedelta(seconds=next(seconds)))
    for _ in range(4):
        sink.emit(KEY, EventType.WARNING, "StorageUnreachable", "503")

    events = read_events(events_path(str(tmp_path), KEY))

    assert [e.count for e in events] == [2, 2]
    assert events[1].first_time == start + timedelta(seconds=2 * SERIES_WINDOW_SECONDS + 1)


def test_a_repeat_dated_before_the_last_is_a_new_event(tmp_path: Path) -> None:
    """A clock set back (a --resume on a machine behind): merged, the Event's time came before its
    firstTime and it moved to the end of the oldest-first list."""
    start = datetime(2026, 1, 1, 2, tzinfo=UTC)
    times = iter([start, start - timedelta(days=7)])
    sink = JsonlEventSink(str(tmp_path), now=lambda: next(times))
    for _ in range(2):
        sink.emit(KEY, EventType.WARNING, "StorageUnreachable", "503")

    events = read_events(events_path(str(tmp_path), KEY))

    assert [e.count for e in events] == [1, 1]
    assert all(e.first_time <= e.time for e in events)
