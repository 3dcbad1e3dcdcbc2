"""Every notice is heard, whatever constructor the script uses.

A script that builds ``Checkpointer(uri, every_steps=...)`` (the README's first example, no
``from_env()``) under ``spotjob-agent`` joins the agent's control channel: a ``POST /flush``
commits a flush checkpoint and the agent exits 75. A script writing to another URI than the
agent's is called out (the controller would never see its flushes), and says which URI it uses.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import urllib.request
from pathlib import Path

import pytest

from agent.catalog import list_checkpoints
from agent.checkpoint import Checkpointer
from agent.control_channel import EXIT_PREEMPTED, ControlDir, FlushRequest
from agent.storage import open_storage

sys.path.insert(0, str(Path(__file__).resolve().parent / "scripts"))
import ckpt_harness as harness
from ckpt_state import make_state

BIN = Path(sys.executable).parent
TOKEN = "channel-test-token"


def kill_leftover_ranks(pids: Path) -> None:
    """Ranks the agent could not take down (a failed run); only those still running this script."""
    for pid in harness.read_pids(pids):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"readme_train.py" in cmdline:
            harness.kill9([pid])


@pytest.mark.slow
def test_the_readme_constructor_under_spotjob_agent_hears_a_flush(tmp_path: Path) -> None:
    uri, control = str(tmp_path / "ckpt"), tmp_path / "control"
    (tmp_path / "token").write_text(TOKEN)
    argv = [
        str(BIN / "spotjob-agent"),
        "--checkpoint-uri",
        uri,
        "--job-name",
        "readme",
        "--control-dir",
        str(control),
        "--control-port",
        "0",
        "--token-file",
        str(tmp_path / "token"),
        "--cloud",
        "none",
        "--",
        *harness.torchrun_argv(2, harness.SCRIPTS / "readme_train.py", [uri, "100000", str(tmp_path)]),
    ]
    log_path = tmp_path / "agent.log"
    agent = harness.start(argv, log_path, env=harness.job_env(SPOTJOB_AGENT_POLL_INTERVAL="0.2"))
    try:
        channel = ControlDir(str(control))

        def training() -> bool:
            status = channel.status()
            return status is not None and (status.step or 0) >= 5

        harness.wait_for(
            training,
            "the ranks to report training through the agent's channel",
            alive=agent,
            log_path=log_path,
        )
        url = json.loads((control / "agent.json").read_text())["url"]
        request = urllib.request.Request(
            url + "/flush",
            data=json.dumps({"reason": "test"}).encode(),
            method="POST",
            headers={"Content-Type": "application/json", "Authorization": f"Bearer {TOKEN}"},
        )
        with urllib.request.urlopen(request, timeout=10) as resp:
            assert resp.status in (200, 202)
        assert harness.reap(agent, timeout=harness.RUN_TIMEOUT_S) == EXIT_PREEMPTED, harness._tail(log_path)
    finally:
        harness.stop(agent)
        kill_leftover_ranks(tmp_path)
    result = channel.flush_result()
    assert result is not None and result.error is None and result.step is not None
    (flushed,) = [s for s in list_checkpoints(open_storage(uri)) if s.valid]
    assert flushed.manifest is not None and flushed.manifest.trigger == "flush"
    assert flushed.ref.step == result.step and flushed.manifest.job == "readme"
    status = channel.status()
    assert status is not None and status.checkpoint_uri == open_storage(uri).uri


def test_under_an_agent_a_checkpointer_joins_its_channel_and_takes_the_jobs_identity(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    control = tmp_path / "control"
    uri = str(tmp_path / "ckpt")
    monkeypatch.setenv("SPOTJOB_CONTROL_DIR", str(control))
    monkeypatch.setenv("SPOTJOB_CHECKPOINT_URI", f"file://{uri}/")  # another spelling, same place
    monkeypatch.setenv("SPOTJOB_JOB_NAME", "env-job")
    monkeypatch.setenv("SPOTJOB_ATTEMPT", "2")
    with Checkpointer(uri) as ckpt:
        assert (ckpt.config.control_dir, ckpt.config.job, ckpt.config.attempt) == (str(control), "env-job", 2)
        ControlDir(str(control)).request_flush(FlushRequest(reason="agent notice"))
        assert ckpt.step(1, make_state(0)) is True
    status = ControlDir(str(control)).status()
    assert status is not None and status.state == "flushed"


@pytest.mark.parametrize(("local_world_size", "reported"), [(None, 1), ("2", 2), ("²", 1)])
def test_the_ranks_tell_the_agent_how_many_of_them_run_on_its_node(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, local_world_size: str | None, reported: int
) -> None:
    """What the agent counts ``closed-rank-<r>`` marks against: torchrun's LOCAL_WORLD_SIZE, or
    1 for a script run on its own, or with a value no launcher writes (``²`` is a digit to
    ``str.isdigit`` but not to ``int``: the Checkpointer failed to start)."""
    control = tmp_path / "control"
    monkeypatch.setenv("SPOTJOB_CONTROL_DIR", str(control))
    if local_world_size is None:
        monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", local_world_size)
    with Checkpointer(str(tmp_path / "ckpt")):
        status = ControlDir(str(control)).status()
        assert status is not None and status.local_world_size == reported


def test_a_script_writing_elsewhere_than_the_agent_watches_is_called_out(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    control = tmp_path / "control"
    agents, scripts = str(tmp_path / "agents"), str(tmp_path / "scripts")
    monkeypatch.setenv("SPOTJOB_CONTROL_DIR", str(control))
    monkeypatch.setenv("SPOTJOB_CHECKPOINT_URI", agents)
    caplog.set_level(logging.INFO, logger="agent")
    with Checkpointer(scripts):
        pass
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert any(scripts in m and agents in m and "spotjob-agent watches" in m for m in errors), errors
    status = ControlDir(str(control)).status()
    assert status is not None and status.checkpoint_uri == open_storage(scripts).uri


def test_the_same_uri_spelled_differently_is_not_called_out(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    uri = tmp_path / "ckpt"
    monkeypatch.setenv("SPOTJOB_CONTROL_DIR", str(tmp_path / "control"))
    monkeypatch.setenv("SPOTJOB_CHECKPOINT_URI", f"file://{uri}//")
    monkeypatch.chdir(tmp_path)
    caplog.set_level(logging.INFO, logger="agent")
    with Checkpointer("./ckpt"):
        pass
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_a_checkpointer_that_saves_otherwise_than_the_job_asks_is_called_out(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """spec.checkpoint.keep / --keep and --every-steps reach the ranks as variables only
    ``from_env()`` reads: ``Checkpointer(uri, every_steps=100)`` kept 3 checkpoints and saved every
    100 steps without a word while the job asked for 10 and 50. Rank 0 now says so; from_env()
    (and a constructor given the same values) says nothing."""
    uri = str(tmp_path / "ckpt")
    monkeypatch.setenv("SPOTJOB_CONTROL_DIR", str(tmp_path / "control"))
    monkeypatch.setenv("SPOTJOB_CHECKPOINT_URI", uri)
    monkeypatch.setenv("SPOTJOB_KEEP", "10")
    monkeypatch.setenv("SPOTJOB_EVERY_STEPS", "50")
    caplog.set_level(logging.INFO, logger="agent")
    with Checkpointer(uri, every_steps=100):
        pass
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("SPOTJOB_KEEP=10 but keep=3" in m and "SPOTJOB_EVERY_STEPS=50 but every_steps=100" in m for m in warned)
    caplog.clear()
    with Checkpointer.from_env():
        pass
    with Checkpointer(uri, every_steps=50, keep=10):
        pass
    assert not [r for r in caplog.records if "does not save as the job asks" in r.getMessage()]


def test_without_an_agent_nothing_is_joined(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # In this process: the Checkpointer reads the environment when it is built, so an environment
    # without SPOTJOB_* is all "no agent" takes; a fresh Python cost a torch import for it.
    for name in [k for k in os.environ if k.startswith("SPOTJOB_")]:
        monkeypatch.delenv(name)
    ckpt = Checkpointer(str(tmp_path / "ckpt"))
    try:
        assert ckpt.config.control_dir is None
    finally:
        ckpt.close()
