"""``spotjob status`` of runs whose times are far back or ahead: ages a person reads at a glance.

A run folder written through the store as ``spotjob run`` leaves it (no training), its times set
back three days (a run from last week is "3 d ago", not "4320 min ago"), or its checkpoint's
time ahead of this clock (a manifest written on another machine: not "-600 s ago").
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
from datetime import UTC, datetime, timedelta
from pathlib import Path

from local_run_support import TRAIN, clean_env, tool

from orchestrator.events import EventType, JsonlEventSink
from orchestrator.model import (
    CheckpointInfo,
    CheckpointSpec,
    Condition,
    JobKey,
    JobSpec,
    JobStatus,
    Phase,
    RestartRecord,
)
from orchestrator.store import JsonFileJobStore


def make_run(
    runs: Path, name: str, *, created: datetime, checkpoint_at: datetime, phase: Phase = Phase.SUCCEEDED
) -> None:
    folder = runs / name
    store = JsonFileJobStore(str(folder), fsync=False)
    key = JobKey.local(name)
    stored = store.create(key, JobSpec(command=[str(TRAIN)], checkpoint=CheckpointSpec(uri=str(folder / "ckpt"))))
    status = JobStatus(
        phase=phase,
        reason="Completed",
        message="every worker exited 0",
        created_at=created,
        last_checkpoint=CheckpointInfo(step=400, uri=f"file://{folder}/ckpt/step-000000400", time=checkpoint_at),
    )
    store.update_status(key, status, version=stored.version)


def test_ages_of_old_runs_are_in_days_and_a_time_ahead_of_this_clock_is_said_so(tmp_path: Path) -> None:
    runs = tmp_path / "spotjob-runs"
    now = datetime.now(UTC)
    make_run(runs, "old", created=now - timedelta(days=3), checkpoint_at=now - timedelta(days=3))
    make_run(runs, "skewed", created=now, checkpoint_at=now + timedelta(minutes=10))

    proc = subprocess.run(
        [tool("spotjob"), "status", "--runs-dir", str(runs)],
        cwd=tmp_path, env=clean_env(), capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip

    rows = {line.split()[0]: line for line in proc.stdout.splitlines()[1:]}
    assert "step 400 (3 d ago)" in rows["old"] and rows["old"].rstrip().endswith("3 d ago"), proc.stdout
    assert "step 400 (10 min ahead of this clock)" in rows["skewed"], proc.stdout


def _documented_keys() -> tuple[list[str], list[str], list[str]]:
    """The README's keys of ``spotjob status --json``: a run's, an Event's, and those of ``now``."""
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    start = readme.index("`spotjob status --json` prints")
    text = " ".join(readme[start : readme.index("\n\n", start)].split())
    events = text[text.index("`events` (") : text.index("`error`")]
    now = text[text.index("`now` when") :]
    run = text[: text.index("`events` (")] + "`events` " + text[text.index("`error`") : text.index("`now` when")]
    keys = lambda part: re.findall(r"`(\w+)`", part)  # noqa: E731
    return keys(run), keys(events)[1:], keys(now)[1:]  # [0]: "events" and "now" themselves


def test_status_as_json_has_the_keys_the_readme_lists(tmp_path: Path) -> None:
    runs = tmp_path / "spotjob-runs"
    now = datetime.now(UTC)
    make_run(runs, "done", created=now, checkpoint_at=now)
    (runs / "done" / "local" / "done.events.jsonl").write_text(
        json.dumps({"time": now.isoformat(), "type": "Normal", "reason": "Completed", "message": "done"})
        + "\n"
        + json.dumps({"time": now.isoformat(), "type": "Normal", "reason": "NodeLost", "message": "x", "node": "n"})
        + "\n"
    )
    run_keys, event_keys, now_keys = _documented_keys()

    proc = subprocess.run(
        [tool("spotjob"), "status", "done", "--json", "--runs-dir", str(runs)],
        cwd=tmp_path, env=clean_env(), capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip

    doc = json.loads(proc.stdout)
    assert list(doc) == run_keys
    assert [list(e) for e in doc["events"]] == [event_keys[:-1], event_keys]  # `node` only when named

    make_run(runs, "gone", created=now, checkpoint_at=now, phase=Phase.RUNNING)  # its driver is gone
    proc = subprocess.run(
        [tool("spotjob"), "status", "--json", "--runs-dir", str(runs)],
        cwd=tmp_path, env=clean_env(), capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    gone = {r["name"]: r for r in json.loads(proc.stdout)}["gone"]
    assert list(gone) == [*run_keys, "now"]
    assert list(gone["now"]) == now_keys


def test_the_commands_a_run_suggests_name_its_runs_dir_when_it_is_not_the_default(tmp_path: Path) -> None:
    """A run under ``--runs-dir elsewhere`` is found only with that option: the commands that
    ``spotjob run`` and ``spotjob status`` print for it (resume it, watch it) carry it, so running
    one as printed reaches the run instead of "no run named ..." in ./spotjob-runs."""
    runs = tmp_path / "elsewhere"
    now = datetime.now(UTC)
    make_run(runs, "done", created=now, checkpoint_at=now)
    make_run(runs, "gone", created=now, checkpoint_at=now, phase=Phase.RUNNING)  # its driver is gone

    def spotjob(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [tool("spotjob"), *args], cwd=tmp_path, env=clean_env(), capture_output=True, text=True, timeout=120
        )

    again = spotjob("run", "--runs-dir", str(runs), "--name", "gone", str(TRAIN))
    assert again.returncode == 2, again.stderr
    suggested = re.search(r"resume it with `(spotjob run [^`]+)`", again.stderr)
    assert suggested is not None, again.stderr
    assert shlex.split(suggested.group(1)) == ["spotjob", "run", "--runs-dir", str(runs), "--resume", "gone"]
    # A run that ended is not to be resumed: its name's refusal says so, and suggests no command.
    ended = spotjob("run", "--runs-dir", str(runs), "--name", "done", str(TRAIN))
    assert ended.returncode == 2 and "succeeded already" in ended.stderr and "`" not in ended.stderr, ended.stderr

    shown = spotjob("status", "--runs-dir", str(runs), "gone")
    assert shown.returncode == 0, shown.stderr
    assert f"spotjob run --runs-dir {runs} --resume gone" in shown.stdout, shown.stdout


def test_text_from_a_runs_records_is_shown_as_written_never_as_markup_or_terminal_control(tmp_path: Path) -> None:
    """A run's records quote what others wrote: a rank's last words, a store's error, a manifest's
    fields. In ``spotjob status`` such text is shown literally: a ``[/model]`` in a message used to
    stop the command with rich's MarkupError (a traceback, exit 1), ``[link=...]`` became a
    hyperlink, and an ANSI escape reached the terminal raw (retitling or clearing it)."""
    runs = tmp_path / "spotjob-runs"
    now = datetime.now(UTC)
    make_run(runs, "crafted", created=now, checkpoint_at=now)
    store = JsonFileJobStore(str(runs / "crafted"), fsync=False)
    key = JobKey.local("crafted")
    stored = store.get(key)
    assert stored is not None and stored.status is not None
    said = "KeyError: '[/model]' [link=http://x.invalid]here[/link] \x1b]0;pwned\x07\x1b[2J"
    status = stored.status.model_copy(
        update={
            "message": said,
            "conditions": [
                Condition(type="Ready", status="False", reason="Failed", message=said, last_transition_time=now)
            ],
            "restart_history": [
                RestartRecord(time=now, attempt=0, cause="Failure", reason="WorkerFailed", message=said)
            ],
        }
    )
    store.update_status(key, status, version=stored.version)
    JsonlEventSink(str(runs / "crafted")).emit(key, EventType.WARNING, "WorkerFailed", said)

    for args in ([], ["crafted"]):
        proc = subprocess.run(
            [tool("spotjob"), "status", "--runs-dir", str(runs), *args],
            cwd=tmp_path, env=clean_env(), capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        assert "\x1b" not in proc.stdout and "\x07" not in proc.stdout, repr(proc.stdout)
    text = " ".join(proc.stdout.split())
    assert text.count("[/model]") == 4 and text.count("[link=http://x.invalid]here[/link]") == 4, proc.stdout
    assert "\\x1b]0;pwned\\x07\\x1b[2J" in text, proc.stdout
