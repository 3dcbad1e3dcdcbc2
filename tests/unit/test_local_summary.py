"""The summary of a local run in numbers, and what a save in progress is called.

The timeline below is what the local backend writes: a commit event per look at a worker's
``status.json`` that found new commits, with how many (several commit between two looks when a
save runs every step).
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime
from pathlib import Path

import pytest

from agent.catalog import CheckpointRef, folder_name, inspect, latest_valid
from agent.storage.file import FileStorage
from orchestrator.backends.local_timeline import EventKind, TimelineEvent
from orchestrator.live import summarize, timeline_commits
from orchestrator.model import CheckpointInfo, CheckpointSpec, JobSpec, JobStatus, Phase

SPEC = JobSpec(command=["train.py"], checkpoint=CheckpointSpec(uri="/ckpt"))


def event(t: float, kind: str, **data: object) -> TimelineEvent:
    return TimelineEvent(t, kind, dict(data))


TIMELINE = [
    event(100.0, EventKind.RUN_STARTED),
    event(101.0, EventKind.COMMIT, worker="w-0-0", step=3, count=3),
    event(102.0, EventKind.COMMIT, worker="w-0-0", step=4),  # a timeline written before the counter
    event(110.0, EventKind.RUN_FINISHED),
]


def test_commits_are_counted_as_each_look_found_them_not_one_per_look() -> None:
    assert timeline_commits(TIMELINE) == 4


def test_the_summary_keeps_the_larger_count_of_the_timeline_and_of_storage() -> None:
    status = JobStatus(phase=Phase.SUCCEEDED, reason="Completed")

    assert summarize("r", SPEC, status, TIMELINE, committed=(2, 4)).commits == 4
    assert summarize("r", SPEC, status, TIMELINE, committed=(6, 4)).commits == 6
    assert summarize("r", SPEC, status, TIMELINE).wall_seconds == 10.0, "from the first start to the last finish"


def test_the_last_checkpoint_is_storages_newest_valid_and_none_is_said_in_words() -> None:
    status = JobStatus(
        phase=Phase.FAILED,
        reason="StorageRefused",
        last_checkpoint=CheckpointInfo(step=2, uri="file:///ckpt/step-000000002", time=datetime.now(UTC)),
    )

    assert summarize("r", SPEC, status, TIMELINE, committed=(4, 4)).last_checkpoint == 4
    assert summarize("r", SPEC, status, TIMELINE).last_checkpoint == 2, "storage unread: the status's"
    text = summarize("r", SPEC, JobStatus(), TIMELINE, committed=(0, None)).text()
    assert "last: none" in text and "None" not in text


def test_an_outcome_with_no_reason_shows_no_empty_parentheses() -> None:
    """A run stopped while Pending has no reason yet: ``outcome  Pending``, not ``Pending ()``."""
    text = summarize("r", SPEC, JobStatus(), TIMELINE).text()
    assert "outcome" in text and "()" not in text, text
    assert "Pending" in text


def test_a_save_in_progress_is_not_called_one_that_never_finished_nor_warned_about(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    storage = FileStorage(str(tmp_path))
    storage.put_bytes(f"{folder_name(20)}/__0_0.distcp", b"shard being written")

    with caplog.at_level(logging.INFO):
        assert latest_valid(storage) is None

    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    reason = inspect(storage, CheckpointRef(20)).reason
    assert "in progress" in reason and reason.startswith("uncommitted")


def test_attempts_counts_those_that_started_not_the_next_one_waiting_to() -> None:
    """Stopped (Ctrl-C) while Rescheduling: attempt 2 is numbered but never started; two ran."""
    started = datetime(2026, 1, 1, tzinfo=UTC)
    waiting = JobStatus.model_validate(
        {"phase": "Rescheduling", "reason": "Rescheduled", "attempt": {"number": 2}, "preemptions": 2}
    )
    running = JobStatus.model_validate(
        {"phase": "Succeeded", "reason": "Completed", "attempt": {"number": 2, "startedAt": started.isoformat()}}
    )

    assert summarize("r", SPEC, waiting, TIMELINE).attempts == 2
    assert summarize("r", SPEC, running, TIMELINE).attempts == 3
