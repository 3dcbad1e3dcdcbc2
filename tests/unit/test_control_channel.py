"""What the agent and the ranks read from the control folder: crafted files there (nested deep,
huge, a FIFO, a folder) read as no file, never as a crash or a hang."""

from __future__ import annotations

import json
import os
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from agent.control_api import ControlApi
from agent.control_channel import FLUSH_FILE, SAVE_FILE, STATUS_FILE, ControlDir, RankStatus, read_json
from agent.launcher import Agent, AgentConfig
from agent.launcher_requests import infra_error_text

WAIT = 30.0


def test_a_status_json_nested_100000_deep_is_no_status_and_the_agent_goes_on(tmp_path: Path) -> None:
    """Before, ``json.load`` raised RecursionError out of the agent's loop: the agent stopped the
    command and exited (and GET /status answered 500)."""
    control = ControlDir(str(tmp_path))
    (tmp_path / STATUS_FILE).write_text("[" * 100_000 + "]" * 100_000)
    assert control.status() is None
    agent = Agent(AgentConfig(command=["true"], checkpoint_uri="file:///ckpt"), control, env={})
    assert agent.status().rank_state is None and agent.ready().ready is False


def test_a_file_over_a_mebibyte_is_not_read(tmp_path: Path) -> None:
    path = tmp_path / STATUS_FILE
    path.write_text(json.dumps({"state": "training", "pad": "x" * (1 << 20)}))
    assert read_json(str(path)) is None
    path.write_text(json.dumps({"state": "training", "step": 7}))
    status = ControlDir(str(tmp_path)).status()
    assert status == RankStatus(state="training", step=7, updated_at=status.updated_at if status else 0)


def test_a_folder_in_place_of_a_file_is_no_file(tmp_path: Path) -> None:
    """Before, reading it raised IsADirectoryError."""
    (tmp_path / STATUS_FILE).mkdir()
    assert ControlDir(str(tmp_path)).status() is None


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
def test_a_fifo_named_flush_json_does_not_hang_the_reader(tmp_path: Path) -> None:
    """Before, opening it waited for a writer that never comes: a rank reading the flush request
    (or the agent, for its own) hung there."""
    os.mkfifo(tmp_path / FLUSH_FILE)
    control = ControlDir(str(tmp_path))
    result: list[object] = []
    reader = threading.Thread(target=lambda: result.append(control.flush_request()), daemon=True)
    reader.start()
    reader.join(WAIT)
    if reader.is_alive():  # unblock it before failing
        with open(tmp_path / FLUSH_FILE, "w"):
            pass
        reader.join(WAIT)
        pytest.fail("reading a FIFO named flush.json waited for a writer")
    assert result == [None]


def test_a_symlink_planted_as_a_ranks_closed_mark_is_replaced_not_written_through(tmp_path: Path) -> None:
    """Before, ``mark_closed`` opened ``closed-rank-<r>`` for writing and followed a symlink there:
    whoever could write in a shared control folder could make a rank truncate a file of its
    user's (the link's target). Now the mark replaces the link."""
    victim = tmp_path / "victim"
    victim.write_text("the user's own file")
    folder = tmp_path / "control"
    control = ControlDir(str(folder))
    (folder / "closed-rank-0").symlink_to(victim)
    control.mark_closed(0)
    assert victim.read_text() == "the user's own file"
    assert not (folder / "closed-rank-0").is_symlink() and control.closed_ranks() == {0}


def test_fields_of_the_wrong_type_read_as_absent_and_a_flush_is_still_answered(tmp_path: Path) -> None:
    """Before, ``"last_save_seconds": "x"`` in status.json made POST /flush with a deadline answer
    500 (a TypeError computing the window), and a list as the step made GET /status 500."""
    control = ControlDir(str(tmp_path))
    crafted = {"state": "training", "step": [1], "last_save_seconds": "x", "world_size": True, "commits": "many"}
    (tmp_path / STATUS_FILE).write_text(json.dumps(crafted))
    status = control.status()
    assert status is not None and status.state == "training"
    assert (status.step, status.last_save_seconds, status.world_size, status.commits) == (None, None, None, 0)
    (tmp_path / "flushed.json").write_text(json.dumps({"step": "7", "uri": 3, "request_id": "r1"}))
    result = control.flush_result()
    assert result is not None and (result.step, result.uri, result.request_id) == (None, None, "r1")
    agent = Agent(AgentConfig(command=["true"], checkpoint_uri="file:///ckpt"), control, env={})
    api = ControlApi(agent, token="t")
    api.start()
    try:
        for path, body in (("/status", None), ("/flush", {"deadline": time.time() + 60})):
            data = json.dumps(body).encode() if body is not None else None
            request = urllib.request.Request(api.url + path, data=data, headers={"Authorization": "Bearer t"})
            with urllib.request.urlopen(request, timeout=WAIT) as response:
                assert response.status in (200, 202)
    finally:
        api.stop()


def test_a_request_file_without_a_reason_string_is_still_a_request_and_never_raises(tmp_path: Path) -> None:
    """A ``flush.json`` or ``save.json`` with no ``reason`` string (none that spotjob writes) raised
    TypeError out of ``flush_request()`` on every rank that read it (a number as the reason did too
    once the fields were type-checked); the file's presence asks for a flush, so it reads as one."""
    control = ControlDir(str(tmp_path))
    for crafted in ({}, {"reason": 5, "deadline": "soon"}):
        for name in (FLUSH_FILE, SAVE_FILE):
            (tmp_path / name).write_text(json.dumps(crafted))
        for read in (control.flush_request, control.save_request):
            request = read()
            assert request is not None and request.reason == "a request file without a reason"
            assert request.deadline is None


def test_a_ranks_infrastructure_report_is_told_escaped_its_rank_too() -> None:
    """``infra-error.json``'s ``error`` was escaped for the log and ``/status``, its ``rank`` was not:
    a crafted rank put terminal escapes into the agent's exit line (found by the security walk)."""
    line = infra_error_text({"rank": "0\x1b[2J\x1b[31m", "error": "store unreachable\x1b[0m"})
    assert line is not None and "\x1b" not in line
    assert line.startswith("rank 0\\x1b[2J") and "store unreachable\\x1b[0m" in line, line


def test_the_control_folder_is_written_and_polled_without_importing_pydantic(tmp_path: Path) -> None:
    """Pins an import cost, not a behaviour: writing status and looking for requests, as every rank
    does each step, brings neither agent.manifest nor pydantic into the process (a tenth of a
    CPU-second each, paid by every fake rank and launcher the agent tests start); reading a file
    that is there does."""
    import subprocess
    import sys

    code = f"""
import sys
from agent.control_channel import ControlDir, RankStatus
control = ControlDir({str(tmp_path)!r})
control.write_status(RankStatus(state="training", step=1))
assert control.flush_request() is None and control.save_request() is None
print("before a read", sorted(m for m in ("agent.manifest", "pydantic") if m in sys.modules))
assert control.status() is not None
print("after a read", sorted(m for m in ("agent.manifest", "pydantic") if m in sys.modules))
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "before a read []" in done.stdout, done.stdout
    assert "after a read ['agent.manifest', 'pydantic']" in done.stdout, done.stdout
