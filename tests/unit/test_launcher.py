"""spotjob-agent's decisions without running a job: exit codes, the flush window, options, process trees."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from agent.control_channel import EXIT_FLUSH_FAILED, EXIT_PREEMPTED, ControlDir, FlushResult
from agent.launcher import Agent, AgentConfig, decide_exit_code, flush_window, parse_args, torchrun_nproc
from agent.notices import Cloud, NoticeCallback, NoticeSource
from agent.process_tree import ENV_AGENT_ID, ProcessTree, read_proc

COMMITTED = FlushResult(step=7, uri="file:///c/step-000000007", request_id="r", notice_to_commit_seconds=1.0)
FAILED = FlushResult(step=None, uri=None, request_id="r", notice_to_commit_seconds=None, error="bucket gone")


def exit_code(returncode: int, **kw: object) -> int:
    args: dict[str, object] = {
        "flush_requested": False,
        "result": None,
        "closed_ranks": set(),
        "expected_ranks": 2,
        "killed": False,
    }
    args.update(kw)
    return decide_exit_code(returncode, **args)[0]  # type: ignore[arg-type]


class TestExitCode:
    def test_a_job_that_ends_by_itself_exits_with_its_own_code(self) -> None:
        assert exit_code(0) == 0
        assert exit_code(3) == 3
        assert exit_code(-9) == 137  # killed by a signal, as a shell reports it

    def test_a_committed_flush_is_75_whatever_the_command_said(self) -> None:
        for rc in (0, 1, -6, -9):
            assert exit_code(rc, flush_requested=True, result=COMMITTED, killed=rc == -9) == EXIT_PREEMPTED

    def test_a_flush_that_committed_nothing_is_76(self) -> None:
        assert exit_code(1, flush_requested=True, result=FAILED) == EXIT_FLUSH_FAILED
        assert exit_code(-15, flush_requested=True, killed=True) == EXIT_FLUSH_FAILED
        # A script that closes its ranks in a `finally` after a failed flush did not finish.
        assert exit_code(1, flush_requested=True, result=FAILED, closed_ranks={0, 1}) == EXIT_FLUSH_FAILED

    def test_an_abort_at_exit_after_every_rank_closed_is_success(self) -> None:
        assert exit_code(1, closed_ranks={0, 1}) == 0
        assert exit_code(-6, closed_ranks={0, 1}) == 0
        assert exit_code(1, closed_ranks={0}) == 1  # one rank did not finish
        assert exit_code(1, closed_ranks={0, 1}, expected_ranks=None) == 1  # world size unknown

    def test_a_job_that_finished_while_a_flush_was_asked_for_is_done(self) -> None:
        assert exit_code(0, flush_requested=True) == 0
        assert exit_code(0, flush_requested=True, killed=True) == EXIT_FLUSH_FAILED


class TestFlushWindow:
    def test_no_deadline_always_fits(self) -> None:
        assert flush_window(None, 100.0, 1.5, now=0).ok

    def test_fits_when_the_time_left_holds_the_last_save_with_margin(self) -> None:
        assert flush_window(100.0, 10.0, 1.5, now=80.0).ok  # 20 s left, 15 s needed
        w = flush_window(100.0, 10.0, 1.5, now=90.0)  # 10 s left, 15 s needed
        assert not w.ok and "10.0 s left" in w.message and "15.0 s" in w.message

    def test_without_a_timed_save_it_cannot_tell_and_says_so(self) -> None:
        w = flush_window(100.0, None, 1.5, now=90.0)
        assert w.ok and "no save timed yet" in w.message

    def test_a_passed_deadline_does_not_fit(self) -> None:
        assert not flush_window(100.0, 1.0, 1.5, now=101.0).ok


class TestOptions:
    def test_defaults(self) -> None:
        config, level = parse_args(["--checkpoint-uri", "s3://b/p", "--", "torchrun", "train.py"], {})
        assert config.command == ["torchrun", "train.py"] and level == "INFO"
        assert (config.control_host, config.control_port, config.poll_interval) == ("127.0.0.1", 0, 2.0)
        assert (config.rebalance, config.sigterm_grace, config.notices, config.cloud) == (
            "save-early",
            30.0,
            None,
            None,
        )

    def test_the_checkpoint_uri_may_come_from_the_environment_only(self) -> None:
        with pytest.raises(SystemExit):
            parse_args(["--", "python", "x.py"], {})
        assert parse_args(["--", "python", "x.py"], {"SPOTJOB_CHECKPOINT_URI": "file:///c"})[0].checkpoint_uri is None

    def test_the_command_must_follow_a_double_dash(self) -> None:
        with pytest.raises(SystemExit):
            parse_args(["--checkpoint-uri", "s3://b", "torchrun", "train.py"], {})
        with pytest.raises(SystemExit):
            parse_args(["--checkpoint-uri", "s3://b", "--"], {})

    def test_sources_metadata_urls_and_poll_interval(self) -> None:
        env = {"SPOTJOB_CLOUD": "aws", "SPOTJOB_GCP_METADATA_URL": "http://127.0.0.1:9"}
        argv = ["--checkpoint-uri", "s3://b", "--notices", "aws,sigterm", "--no-sigterm", "--poll-interval", "1"]
        config, _ = parse_args([*argv, "--", "x"], env)
        assert config.notices == ("aws", "sigterm") and config.disabled == {"sigterm"}
        assert config.cloud is Cloud.AWS and config.gcp_metadata_url == "http://127.0.0.1:9"
        for bad in (["--poll-interval", "0.5"], ["--notices", "oracle"], ["--control-port", "70000"]):
            with pytest.raises(SystemExit):
                parse_args(["--checkpoint-uri", "s3://b", *bad, "--", "x"], {})

    def test_ranks_per_node_from_a_torchrun_command(self) -> None:
        assert torchrun_nproc(["torchrun", "--nproc-per-node", "4", "train.py"]) == 4
        assert torchrun_nproc(["torchrun", "--nproc_per_node=8", "train.py", "--nproc-per-node", "2"]) == 8
        assert torchrun_nproc(["torchrun", "--nproc-per-node=gpu", "train.py"]) is None
        assert torchrun_nproc(["python", "train.py", "--nproc-per-node", "2"]) is None


# Above Linux's largest pid_max (2**22): a root with no descendants, for trees found by marker only.
NO_SUCH_PID = 2**22 + 1


def alive(pid: int) -> bool:
    info = read_proc(pid)
    return info is not None and info.state != "Z"


class TestProcessTree:
    def test_finds_and_kills_a_descendant_in_its_own_session_that_ignores_sigterm_and_escaped_to_init(self) -> None:
        agent_id = uuid.uuid4().hex
        # The child starts a grandchild in a session of its own and exits at once: the grandchild
        # is re-parented to init before anyone saw it. Only the environment marker finds it.
        code = (
            "import subprocess, sys\n"
            "p = subprocess.Popen([sys.executable, '-c', "
            "'import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print(flush=True); time.sleep(60)'],"
            " start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)\n"
            "p.stdout.readline()\n"
            "print(p.pid)\n"
        )
        env = {**os.environ, ENV_AGENT_ID: agent_id}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        grandchild = int(out.stdout.strip())
        try:
            # Never rooted at pytest: stop_all must not reach the servers this session started.
            tree = ProcessTree(agent_id, root_pid=NO_SUCH_PID)
            # (Whether parent links alone find it depends on whether an earlier test in this
            # process made pytest a subreaper; the environment marker must find it either way.)
            assert grandchild in {p.pid for p in tree.refresh(scan_environ=True)}
            assert tree.stop_all(grace=0.2, reason="test") == 1
            assert not alive(grandchild)
        finally:
            if alive(grandchild):
                os.kill(grandchild, 9)

    def test_finds_descendants_through_parent_links(self) -> None:
        # A stand-in agent as the root (never pytest itself, whose other children are the
        # session's servers): it starts the "command", which starts a grandchild.
        root = subprocess.Popen(
            [
                sys.executable,
                "-c",
                "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', "
                "\"import subprocess, time; subprocess.Popen(['sleep', '60']); time.sleep(60)\"]); time.sleep(60)",
            ]
        )
        tree = ProcessTree(uuid.uuid4().hex, root_pid=root.pid)
        try:
            deadline = time.monotonic() + 10
            while len(tree.refresh()) < 2 and time.monotonic() < deadline:
                time.sleep(0.02)
            members = tree.refresh()
            assert len(members) == 2 and "sleep" in {p.comm for p in members}
            tree.stop_all(grace=1.0, reason="test")
            assert not tree.refresh()
            assert all(not alive(p.pid) for p in members)
        finally:
            root.kill()
            root.wait()


class RecordingSource(NoticeSource):
    name = "recording"

    def __init__(self) -> None:
        self.calls: list[str] = []

    def start(self, callback: NoticeCallback) -> None:
        self.calls.append("start")

    def stop(self) -> None:
        self.calls.append("stop")


class TestAgentRun:
    def test_a_run_stops_its_sources_server_and_threads_and_removes_agent_json(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.setattr("agent.launcher.become_subreaper", lambda: True)  # leave pytest's process alone
        source = RecordingSource()
        config = AgentConfig(command=[sys.executable, "-c", "raise SystemExit(4)"], checkpoint_uri="file:///c")
        agent = Agent(config, ControlDir(str(tmp_path)), [source], env={})
        assert agent.run() == 4
        assert source.calls == ["start", "stop"]
        assert agent.status().state == "exited" and agent.status().command_exit_code == 4
        assert not [t.name for t in threading.enumerate() if t.name.startswith("spotjob")]
        assert not (tmp_path / "agent.json").exists()

    def test_the_ranks_get_the_checkpoint_settings_and_never_the_api_token(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.setattr("agent.launcher.become_subreaper", lambda: True)
        dump = tmp_path / "env.json"
        code = f"import json, os; json.dump(dict(os.environ), open({str(dump)!r}, 'w'))"
        config, _ = parse_args(
            ["--checkpoint-uri", "s3://b/p", "--job-name", "j", "--every-steps", "50", "--every-seconds", "600",
             "--keep", "3", "--async", "off", "--staging-dir", "/stage", "--", sys.executable, "-c", code],
            {},
        )  # fmt: skip
        agent = Agent(config, ControlDir(str(tmp_path / "ctl")), env={"SPOTJOB_AGENT_TOKEN": "t", "KEEP_ME": "1"})
        assert agent.run() == 0
        env = json.loads(dump.read_text())
        assert {k: v for k, v in env.items() if k.startswith("SPOTJOB_") and k != "SPOTJOB_AGENT_ID"} == {
            "SPOTJOB_CHECKPOINT_URI": "s3://b/p",
            "SPOTJOB_JOB_NAME": "j",
            "SPOTJOB_EVERY_STEPS": "50",
            "SPOTJOB_EVERY_SECONDS": "600.0",
            "SPOTJOB_KEEP": "3",
            "SPOTJOB_ASYNC": "0",
            "SPOTJOB_STAGING_DIR": "/stage",
            "SPOTJOB_CONTROL_DIR": str(tmp_path / "ctl"),
        }
        assert env["KEEP_ME"] == "1" and env["SPOTJOB_AGENT_ID"] == agent.agent_id


def test_the_agent_imports_no_torch_and_no_cloud_sdk() -> None:
    code = (
        "import sys, agent.launcher, agent.notices.emulators\n"
        "print(sorted(m for m in ('torch', 'boto3', 'google.cloud.storage') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
