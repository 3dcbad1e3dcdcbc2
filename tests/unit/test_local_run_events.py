"""What ``spotjob run`` costs after each reconcile pass, however long the run has been going."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, cast

import pytest

from agent.control_channel import ControlDir, RankStatus
from orchestrator import events
from orchestrator.backends import local_processes, local_timeline
from orchestrator.backends.local import LocalBackend
from orchestrator.backends.local_launch import LocalOptions
from orchestrator.backends.local_timeline import EventKind, Timeline
from orchestrator.backends.local_worker import LocalWorker
from orchestrator.events import EventType, read_events
from orchestrator.model import JobKey
from orchestrator.run_config import RunConfig
from orchestrator.run_driver import LocalRun


def count_constructions(monkeypatch: pytest.MonkeyPatch, module: Any, name: str) -> dict[str, int]:
    """Replace ``module.name`` (a class the reader builds per parsed line) by a counting wrapper;
    ``["n"]`` of the answer is how many were built since."""
    parsed = {"n": 0}
    real = getattr(module, name)

    def counting(*args: Any, **kwargs: Any) -> Any:
        parsed["n"] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, counting)
    return parsed


def test_a_look_at_the_runs_events_after_a_pass_parses_only_the_new_ones(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run preempted for days has thousands of Events: each pass re-read them all."""
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    run = LocalRun(RunConfig(script=str(script), args=[], name="long", runs_dir=str(tmp_path / "runs")))
    try:
        for n in range(200):
            run.sink.emit(run.key, EventType.NORMAL, "Rescheduled", f"attempt {n} on local-node-{n}")
        run._after_pass()
        real = events.RecordedEvent
        parsed = count_constructions(monkeypatch, events, "RecordedEvent")
        run.sink.emit(run.key, EventType.WARNING, "SpotInterrupted", "local-node-199 goes away", node="local-node-199")
        run.sink.emit(run.key, EventType.WARNING, "SpotInterrupted", "local-node-199 goes away", node="local-node-199")
        run._after_pass()
        assert parsed["n"] <= 3, f"{parsed['n']} Events parsed for 2 new ones"
        monkeypatch.setattr(events, "RecordedEvent", real)
        assert run.events == read_events(run.events_path)
        assert len(run.events) == 201 and run.events[-1].count == 2
    finally:
        run.close()


def test_a_line_still_being_written_is_read_once_whole_and_a_replaced_file_from_its_start(tmp_path: Path) -> None:
    path = tmp_path / "job.events.jsonl"
    line = '{"time": "2026-01-01T00:00:00+00:00", "type": "Normal", "reason": "%s", "message": "m"}\n'
    log = events.EventLog(str(path))
    assert log.read() == []
    path.write_text(line % "Started" + (line % "Running")[:20])
    assert [e.reason for e in log.read()] == ["Started"]
    with path.open("a") as f:
        f.write((line % "Running")[20:])
    assert [e.reason for e in log.read()] == ["Started", "Running"] == [e.reason for e in read_events(str(path))]
    path.write_text(line % "Again")
    assert [e.reason for e in log.read()] == ["Again"]


def test_the_commit_count_shown_every_second_parses_only_the_timelines_new_lines(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The timeline grows by about two lines a second per training worker: re-reading it all
    every second made the driver's cost grow with the run's age until it filled a core."""
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    run = LocalRun(RunConfig(script=str(script), args=[], name="aged", runs_dir=str(tmp_path / "runs")))
    try:
        for step in range(300):
            run.timeline.record(EventKind.STEP, worker="w-1-0", attempt=1, step=step, state="training")
        run.timeline.record(EventKind.COMMIT, worker="w-1-0", attempt=1, step=299, count=2)
        run._commits_read_at = float("-inf")  # the once-a-second look is due
        assert run._commits() == 2
        parsed = count_constructions(monkeypatch, local_timeline, "TimelineEvent")
        run.timeline.record(EventKind.STEP, worker="w-1-0", attempt=1, step=300, state="training")
        run.timeline.record(EventKind.COMMIT, worker="w-1-0", attempt=1, step=300)
        run._commits_read_at = float("-inf")
        assert run._commits() == 3
        assert parsed["n"] <= 2, f"{parsed['n']} timeline lines parsed for 2 new ones"
    finally:
        run.close()


class _Clock:
    """``time`` as ``orchestrator.backends.local_processes`` sees it, with a monotonic clock the test moves."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)


def test_a_worker_that_trains_for_days_adds_a_bounded_number_of_step_samples_to_the_timeline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The monitor sampled each worker's step every half second for as long as it trained: 170,000
    timeline lines a day a worker, all read back by ``spotjob status``, the summary, the plot and a
    resume. The samples now thin out as the attempt ages (half a second at first, as the plot of a
    short run needs). Three days of a worker at a step every 10 s are walked through with the
    monitor's own ``_sample`` on a real status.json; only the monitor's monotonic clock is the
    test's (three days cannot pass here), so what this does not model is the real pace of reads."""
    clock = _Clock()
    monkeypatch.setattr(local_processes, "time", clock)
    control = ControlDir(str(tmp_path / "control"))
    with LocalBackend(LocalOptions(root=str(tmp_path / "run"))) as backend:
        proc = subprocess.Popen([sys.executable, "-c", "pass"])
        proc.wait()
        worker = LocalWorker("w-0-0", JobKey("default", "long"), 0, 0, cast(Any, None), proc, control.path, "", "")
        step, end = 0, clock.now + 3 * 86400.0
        while clock.now < end:
            step += 1
            control.write_status(RankStatus(state="training", step=step))
            backend._sample(worker)
            clock.now += 10.0
        samples = [e for e in Timeline.read(backend.timeline.path) if e.kind == EventKind.STEP]
    assert [e.data["step"] for e in samples[:10]] == list(range(1, 11)), "a young attempt is sampled at every look"
    assert len(samples) < 5000, f"{len(samples)} step samples for 3 days of one worker ({step} looks)"


_CUT_SHORT = """
import sys
from orchestrator.backends.local_timeline import Timeline
from orchestrator.events import EventType, JsonlEventSink
from orchestrator.model import JobKey
if sys.argv[1] == "events":
    JsonlEventSink(sys.argv[2]).emit(JobKey.local("train"), EventType.WARNING, "Cut", "x" * 500)
else:
    Timeline(sys.argv[2]).record("commit", step=1, note="x" * 500)
"""


@pytest.mark.parametrize("which", ["events", "timeline"])
def test_a_line_cut_short_by_a_full_disk_loses_only_itself_not_the_next_one(tmp_path: Path, which: str) -> None:
    """Fails without the fix: the next line was appended to the cut one, and the reader skipped
    both, so the first Event (or timeline event) after a full disk or a kill mid-write was lost.

    A real cut: a child process writes under a file-size limit (``RLIMIT_FSIZE``) that the kernel
    enforces with a short write, as a full disk does; Python ignores the SIGXFSZ that comes with it.
    """
    import resource

    key = JobKey.local("train")
    sink = events.JsonlEventSink(str(tmp_path))
    path = events.events_path(str(tmp_path), key) if which == "events" else str(tmp_path / "timeline.jsonl")
    timeline = Timeline(path)
    if which == "events":
        sink.emit(key, EventType.NORMAL, "Before", "first")
    else:
        timeline.record(EventKind.COMMIT, step=0)
    limit = os.path.getsize(path) + 40

    def cap() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    # The sink and the timeline log the failed write.
    subprocess.run(
        [sys.executable, "-c", _CUT_SHORT, which, str(tmp_path) if which == "events" else path],
        preexec_fn=cap,
        capture_output=True,
    )
    assert os.path.getsize(path) == limit, "the child's line was not cut short"
    if which == "events":
        sink.emit(key, EventType.NORMAL, "After", "the disk has room again")
        assert [e.reason for e in read_events(path)] == ["Before", "After"]
    else:
        timeline.record(EventKind.COMMIT, step=2)
        assert [e.data["step"] for e in Timeline.read(path)] == [0, 2]


def test_a_timeline_that_cannot_be_written_warns_once_and_raises_nothing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Fails without the fix: the OSError of a full run-folder disk was raised into the thread that
    records (the driver's watch over its workers). A folder where the file should be fails each
    write as a full disk would."""
    path = tmp_path / "timeline.jsonl"
    path.mkdir()
    timeline = Timeline(str(path))
    with caplog.at_level(logging.WARNING, logger="orchestrator.backends.local_timeline"):
        for step in range(3):
            timeline.record(EventKind.STEP, step=step)
        path.rmdir()
        timeline.record(EventKind.COMMIT, step=3)
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 2 and "could not record step" in said[0] and "written again" in said[1], said
    assert [e.data["step"] for e in Timeline.read(str(path))] == [3]
