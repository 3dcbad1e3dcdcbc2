"""spotjob-agent's decisions without running a job: exit codes, the flush window, options, process trees."""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psutil
import pytest

from agent import launcher, process_tree
from agent.control_api import ControlApi
from agent.control_channel import (
    AGENT_FILE,
    EXIT_FLUSH_FAILED,
    EXIT_INFRA_ERROR,
    EXIT_PREEMPTED,
    EXIT_STOPPED,
    ControlDir,
    FlushResult,
    RankStatus,
    read_json,
)
from agent.exit_codes import PEER_FLUSH, answered_source, exit_words, flush_answered
from agent.launcher import (
    Agent,
    AgentConfig,
    canonical_uri,
    decide_exit_code,
    flush_window,
    parse_args,
    torchrun_nproc,
)
from agent.launcher_sources import build_sources
from agent.notices import Cloud, NoticeCallback, NoticeSource
from agent.notices.base import Notice, NoticeKind, PollingNoticeSource, utc_stamp
from agent.process_tree import ENV_AGENT_ID, ProcessTree, read_proc
from agent.torchrun import local_rendezvous, meeting_point, standalone_command

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

    @pytest.mark.parametrize(
        "answered",
        [
            "gcp maintenance: TERMINATE_ON_HOST_MAINTENANCE",
            "api preemption: spotjob run was interrupted (SIGINT): flushing before every process of the run stops",
            "signal terminate: SIGTERM received (grace 20 s)",
            PEER_FLUSH,
        ],
    )
    def test_a_committed_flushs_words_name_what_it_answered_and_read_back_from_its_line(self, answered: str) -> None:
        """The exit-75 line said only "the flush committed step N at URI": whoever asked for a flush
        (spotjob run's interrupt) could not tell its own from one the agent began for a notice it
        alone heard (a GCE host maintenance). The words a reader parses come first, unchanged."""
        code, why = decide_exit_code(
            0,
            flush_requested=True,
            result=COMMITTED,
            closed_ranks=set(),
            expected_ranks=2,
            killed=False,
            answered=answered,
        )
        assert code == EXIT_PREEMPTED
        assert why == f"the flush committed step 7 at file:///c/step-000000007; the flush answered {answered}"
        text = f"2026-12-06T10:00:00.000Z INFO spotjob-agent[9] job=it agent.launcher: exiting 75: {why}"
        as_json = json.dumps({"level": "INFO", "message": f"exiting 75: {why}", "command": "spotjob-agent"})
        for line in (text, as_json):
            words = exit_words(line, EXIT_PREEMPTED)
            assert words == f"exiting 75: {why}"
            assert flush_answered(words) == answered
        assert answered_source(answered) == {PEER_FLUSH: None}.get(answered, answered.split()[0])
        assert flush_answered("exiting 75: the flush committed step 7 at file:///c/step-000000007") is None

    def test_a_flush_that_committed_nothing_is_76(self) -> None:
        assert exit_code(1, flush_requested=True, result=FAILED) == EXIT_FLUSH_FAILED
        assert exit_code(-15, flush_requested=True, killed=True) == EXIT_FLUSH_FAILED
        # A script that closes its ranks in a `finally` after a failed flush did not finish.
        assert exit_code(1, flush_requested=True, result=FAILED, closed_ranks={0, 1}) == EXIT_FLUSH_FAILED

    def test_a_flush_a_failed_rank_cut_short_says_the_flush_committed_nothing_not_that_nothing_was(self) -> None:
        """The chaos soak SIGTERMed an agent and SIGKILLed a rank before the flush's save: the agent
        said "exiting 76: no checkpoint was committed (command exit code 1)" while the periodic
        checkpoint of the step before was there, and is what the restart resumed from."""
        code, why = decide_exit_code(
            1, flush_requested=True, result=None, closed_ranks=set(), expected_ranks=2, killed=False
        )
        assert code == EXIT_FLUSH_FAILED
        assert why == (
            "the flush committed no checkpoint: the command ended before its ranks reported one (a rank that "
            "failed or was killed is named in its output above) (command exit code 1); a restart (if one is left) "
            "resumes from the newest checkpoint committed before the flush"
        )
        code, why = decide_exit_code(
            -9, flush_requested=True, result=None, closed_ranks=set(), expected_ranks=2, killed=True
        )
        assert code == EXIT_FLUSH_FAILED
        assert why.startswith("the flush committed no checkpoint: spotjob-agent stopped the command before")

    def test_an_abort_at_exit_after_every_rank_closed_is_success(self) -> None:
        assert exit_code(1, closed_ranks={0, 1}) == 0
        assert exit_code(-6, closed_ranks={0, 1}) == 0
        assert exit_code(1, closed_ranks={0}) == 1  # one rank did not finish
        assert exit_code(1, closed_ranks={0, 1}, expected_ranks=None) == 1  # world size unknown

    def test_a_command_the_agent_killed_after_every_rank_closed_did_not_finish(self) -> None:
        # Still at work after close() when the deadline came: the agent's kill, not an abort at exit.
        assert exit_code(-15, flush_requested=True, closed_ranks={0, 1}, killed=True) == EXIT_FLUSH_FAILED
        assert exit_code(-15, closed_ranks={0, 1}, killed=True) == 143  # SIGQUIT, or signals not notices

    def test_a_job_that_finished_while_a_flush_was_asked_for_is_done(self) -> None:
        assert exit_code(0, flush_requested=True) == 0
        assert exit_code(0, flush_requested=True, killed=True) == EXIT_FLUSH_FAILED

    @pytest.mark.parametrize("own", [EXIT_INFRA_ERROR, EXIT_PREEMPTED, EXIT_FLUSH_FAILED, EXIT_STOPPED])
    def test_a_command_that_exits_with_an_agent_code_by_itself_is_a_plain_failure(self, own: int) -> None:
        code, why = decide_exit_code(
            own, flush_requested=False, result=None, closed_ranks=set(), expected_ranks=2, killed=False
        )
        assert code == 1 and f"exited {own} by itself" in why

    def test_a_reported_infrastructure_error_is_74_unless_a_flush_committed(self) -> None:
        assert exit_code(1, infra_error="rank 0: storage unreachable") == EXIT_INFRA_ERROR
        assert exit_code(1, infra_error="x", flush_requested=True, result=FAILED) == EXIT_INFRA_ERROR
        assert exit_code(1, infra_error="x", flush_requested=True, result=COMMITTED) == EXIT_PREEMPTED

    def test_an_infrastructure_error_the_command_rode_out_is_no_failure(self) -> None:
        """A save failed on the store, the script caught it, carried on and finished: exit 0."""
        assert exit_code(0, infra_error="the checkpoint of step 5 failed on s3://b/p") == 0
        assert exit_code(0, infra_error="x", killed=True) == EXIT_INFRA_ERROR

    def test_an_infrastructure_error_then_every_rank_closed_and_an_abort_at_exit_is_success(self) -> None:
        """A save failed on the store, the script caught it and finished (every rank closed), then a
        worker aborted at interpreter exit: the job is done, not an infrastructure error to run again."""
        assert exit_code(-6, infra_error="the checkpoint of step 5 failed on s3://b/p", closed_ranks={0, 1}) == 0
        assert exit_code(1, infra_error="x", closed_ranks={0, 1}) == 0
        assert exit_code(1, infra_error="x", closed_ranks={0}) == EXIT_INFRA_ERROR  # one rank did not finish
        assert exit_code(-15, infra_error="x", closed_ranks={0, 1}, killed=True) == EXIT_INFRA_ERROR

    def test_a_stop_on_request_is_79_whatever_the_command_said(self) -> None:
        for rc in (0, 1, -15, -9):
            assert exit_code(rc, stopped="peer failed", killed=True) == EXIT_STOPPED
        assert exit_code(-9, stopped="x", flush_requested=True, result=COMMITTED) == EXIT_PREEMPTED


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

    def test_a_slack_takes_a_time_left_that_short_as_fitting(self) -> None:
        """A held notice's flush started when scheduled, the moment the loop took to see it aside."""
        assert not flush_window(100.0, 10.0, 1.5, now=85.5).ok
        w = flush_window(100.0, 10.0, 1.5, now=85.5, slack=1.0)
        assert w.ok and "may not" not in w.message
        assert not flush_window(100.0, 10.0, 1.5, now=86.5, slack=1.0).ok


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

    @pytest.mark.parametrize("given", ["debug", "Debug", "DEBUG"])
    def test_the_log_level_is_taken_in_any_case(self, given: str) -> None:
        """As spotjob's SPOTJOB_LOG_LEVEL and spotjob-controller's --log-level take it (`info`, as the
        chart writes the controller's): the agent refused `--log-level info` (exit 2), upper case only."""
        level = parse_args(["--checkpoint-uri", "s3://b/p", "--log-level", given, "--", "x"], {})[1]
        assert level == "DEBUG"

    def test_an_unknown_log_level_is_refused_naming_the_levels(self, capsys: pytest.CaptureFixture[str]) -> None:
        with pytest.raises(SystemExit) as e:
            parse_args(["--checkpoint-uri", "s3://b/p", "--log-level", "verbose", "--", "x"], {})
        assert e.value.code == 2 and "--log-level" in capsys.readouterr().err

    def test_the_checkpoint_uri_may_come_from_the_environment_only(self) -> None:
        with pytest.raises(SystemExit):
            parse_args(["--", "python", "x.py"], {})
        assert parse_args(["--", "python", "x.py"], {"SPOTJOB_CHECKPOINT_URI": "file:///c"})[0].checkpoint_uri is None

    def test_the_command_must_follow_a_double_dash(self) -> None:
        with pytest.raises(SystemExit):
            parse_args(["--checkpoint-uri", "s3://b", "torchrun", "train.py"], {})
        with pytest.raises(SystemExit):
            parse_args(["--checkpoint-uri", "s3://b", "--"], {})

    @pytest.mark.parametrize("program", ["", " "])
    def test_an_empty_program_after_the_double_dash_exits_2_naming_it(
        self, program: str, capsys: pytest.CaptureFixture[str]
    ) -> None:
        """``-- "$CMD"`` with CMD unset started nothing and exited 126, "cannot start :  is not
        executable", as if a program had been found and refused."""
        with pytest.raises(SystemExit) as e:
            parse_args(["--checkpoint-uri", "s3://b", "--", program, "train.py"], {})
        err = capsys.readouterr().err
        assert e.value.code == 2 and "the program after '--' is empty" in err, err

    @pytest.mark.parametrize(("name", "why"), [("a\nb", "holds control characters"), ("caf\udce9", "not valid UTF-8")])
    def test_a_job_name_with_a_newline_or_undecodable_bytes_is_refused_naming_why(
        self, name: str, why: str, capsys: pytest.CaptureFixture[str]
    ) -> None:
        """It goes into every log line (a newline forges one) and into the URI's owner record."""
        with pytest.raises(SystemExit):
            parse_args(["--checkpoint-uri", "s3://b", "--job-name", name, "--", "x"], {})
        err = capsys.readouterr().err
        assert f"--job-name: the job name {name!r}" in err and why in err
        assert parse_args(["--checkpoint-uri", "s3://b", "--job-name", "ns/train ü", "--", "x"], {})[0].job_name

    def test_sources_metadata_urls_and_poll_interval(self) -> None:
        env = {"SPOTJOB_CLOUD": "aws", "SPOTJOB_GCP_METADATA_URL": "http://127.0.0.1:9"}
        argv = ["--checkpoint-uri", "s3://b", "--notices", "aws,sigterm", "--no-gcp", "--poll-interval", "1"]
        config, _ = parse_args([*argv, "--", "x"], env)
        assert config.notices == ("aws", "sigterm") and config.disabled == {"gcp"}
        assert config.cloud is Cloud.AWS and config.gcp_metadata_url == "http://127.0.0.1:9"
        for bad in (["--poll-interval", "0.5"], ["--notices", "oracle"], ["--control-port", "70000"]):
            with pytest.raises(SystemExit):
                parse_args(["--checkpoint-uri", "s3://b", *bad, "--", "x"], {})

    @pytest.mark.parametrize(
        ("notices", "refused", "instead"),
        [
            ("aws", ["--no-aws"], "pass --notices none for the control API alone"),
            ("aws,sigterm", ["--no-sigterm"], "pass --notices aws,"),
            ("gcp,azure,sigterm", ["--no-gcp", "--no-sigterm"], "pass --notices azure,"),
        ],
    )
    def test_notices_a_no_option_refuses_exit_2_naming_both_and_what_to_pass(
        self, notices: str, refused: list[str], instead: str, capsys: pytest.CaptureFixture[str]
    ) -> None:
        """``--notices aws --no-aws`` was taken as "aws minus aws": an agent with no notice source at
        all, SIGTERM included (a SIGTERM stopped the command without a flush), said at INFO only."""
        with pytest.raises(SystemExit) as e:
            parse_args(["--checkpoint-uri", "s3://b", "--notices", notices, *refused, "--", "x"], {})
        err = capsys.readouterr().err
        assert e.value.code == 2
        assert f"--notices {notices} and {' '.join(refused)} contradict each other" in err
        assert instead in err and f"or leave out {' '.join(refused)}" in err

    @pytest.mark.parametrize(
        ("notices", "said"),
        [
            ("azure,azure,sigterm", "azure is listed twice: list each source once"),
            ("aws, sigterm ,aws", "aws is listed twice"),
            ("none,aws", "'none' is no source to list with others"),
            ("sigterm,none", "'none' is no source to list with others"),
        ],
    )
    def test_notices_listing_a_source_twice_or_none_with_others_exits_2_naming_it(
        self, notices: str, said: str, capsys: pytest.CaptureFixture[str]
    ) -> None:
        """``azure,azure,sigterm`` ran the Azure source twice (two pollers, each event acknowledged
        twice, every line logged twice); ``none,aws`` dropped the ``none`` without a word."""
        with pytest.raises(SystemExit) as e:
            parse_args(["--checkpoint-uri", "s3://b", "--notices", notices, "--", "x"], {})
        err = capsys.readouterr().err
        assert e.value.code == 2 and "--notices" in err and said in err, err

    @pytest.mark.parametrize(
        ("argv", "env", "named"),
        [
            (["--aws-metadata-url", "ftp://169.254.169.254"], {}, "--aws-metadata-url"),
            (["--gcp-metadata-url", "http://metadata:99999"], {}, "--gcp-metadata-url"),
            ([], {"SPOTJOB_AZURE_METADATA_URL": "http://127.0.0.1:port"}, "SPOTJOB_AZURE_METADATA_URL"),
            ([], {"SPOTJOB_AWS_METADATA_URL": "169.254.169.254"}, "SPOTJOB_AWS_METADATA_URL"),
            ([], {"SPOTJOB_GCP_METADATA_URL": "http://127.0.0.1:0"}, "SPOTJOB_GCP_METADATA_URL"),
            # taken before: a traceback at every poll (http.client refuses them), the notices never seen
            (["--aws-metadata-url", "http://exa mple"], {}, "--aws-metadata-url"),
            ([], {"SPOTJOB_GCP_METADATA_URL": "http://bad host:80"}, "SPOTJOB_GCP_METADATA_URL"),
            (["--azure-metadata-url", "http://169.254.169.254/met\tadata"], {}, "--azure-metadata-url"),
            (["--aws-metadata-url", "http://a\tb"], {}, "--aws-metadata-url"),
            (["--aws-metadata-url", "http://métadata"], {}, "--aws-metadata-url"),
        ],
    )
    def test_a_metadata_url_that_cannot_be_polled_exits_2_naming_where_it_came_from(
        self, argv: list[str], env: dict[str, str], named: str, capsys: pytest.CaptureFixture[str]
    ) -> None:
        with pytest.raises(SystemExit) as e:
            parse_args(["--checkpoint-uri", "s3://b", *argv, "--", "x"], env)
        err = capsys.readouterr().err
        assert e.value.code == 2
        assert named in err and "http(s)://host[:port]" in err and "Traceback" not in err

    @pytest.mark.parametrize("value", ["fast", "0", "-1", "inf", "nan", "1e308", "3600"])
    def test_a_poll_interval_override_that_is_no_usable_number_of_seconds_exits_2_naming_it(
        self, value: str, capsys: pytest.CaptureFixture[str]
    ) -> None:
        with pytest.raises(SystemExit) as e:
            parse_args(["--checkpoint-uri", "s3://b", "--", "x"], {"SPOTJOB_AGENT_POLL_INTERVAL": value})
        err = capsys.readouterr().err
        assert e.value.code == 2
        assert f"SPOTJOB_AGENT_POLL_INTERVAL={value!r}" in err and "unset it" in err

    def test_a_poll_interval_option_that_is_no_number_says_what_it_takes(
        self, capsys: pytest.CaptureFixture[str]
    ) -> None:
        """argparse named the function that converts it: "invalid _interval value: 'fast'"."""
        with pytest.raises(SystemExit) as e:
            parse_args(["--checkpoint-uri", "s3://b", "--poll-interval", "fast", "--", "x"], {})
        err = capsys.readouterr().err
        assert e.value.code == 2 and "_interval" not in err
        assert "--poll-interval: 'fast' is not a number of seconds; give one from 1 to 5" in err

    @pytest.mark.parametrize(
        ("option", "value", "said"),
        [
            ("--control-host", "", "--control-host is empty"),
            # taken as text, over SPOTJOB_LOG_FORMAT=json, though the README says an empty option exits 2
            ("--log-format", "", "--log-format is empty"),
            ("--notices", "", "names no source"),
            ("--notices", " , ", "names no source"),
        ],
    )
    def test_an_empty_control_host_or_notices_exits_2_instead_of_taking_a_default_nobody_chose(
        self, option: str, value: str, said: str, capsys: pytest.CaptureFixture[str]
    ) -> None:
        """``--control-host "$POD_IP"`` with POD_IP unset bound the API to every interface and wrote
        ``http://:PORT`` into agent.json; ``--notices "$SOURCES"`` with SOURCES unset silently turned
        every notice source off, SIGTERM included, as ``none`` does."""
        with pytest.raises(SystemExit) as e:
            parse_args(["--checkpoint-uri", "s3://b", option, value, "--", "x"], {})
        err = capsys.readouterr().err
        assert e.value.code == 2 and said in err and "leave" in err
        assert parse_args(["--checkpoint-uri", "s3://b", "--notices", "none", "--", "x"], {})[0].notices == ()

    @pytest.mark.parametrize("variable", ["oracle", "gcp"])
    def test_cloud_auto_given_wins_over_the_variable(self, variable: str) -> None:
        """``--cloud auto`` wins over SPOTJOB_CLOUD as every option wins over its variable. The
        sources read the variable again: SPOTJOB_CLOUD=gcp forced GCP over ``--cloud auto``, and
        SPOTJOB_CLOUD=oracle, which parse_args had let the option override, ended the agent in a
        ValueError traceback (exit 1) instead of detecting the cloud."""
        env = {"SPOTJOB_CLOUD": variable}
        nothing = "http://127.0.0.1:9"  # no metadata server answers: detection finds no cloud
        urls = ["--aws-metadata-url", nothing, "--gcp-metadata-url", nothing, "--azure-metadata-url", nothing]
        config, _ = parse_args(["--checkpoint-uri", "s3://b", "--cloud", "auto", *urls, "--", "x"], env)
        assert config.cloud is None
        sources = build_sources(config, env)
        assert [s.name for s in sources] == ["signal"]  # SIGTERM, and no cloud

    def test_the_poll_interval_override_reaches_the_sources(self) -> None:
        env = {"SPOTJOB_AGENT_POLL_INTERVAL": "0.05"}
        config, _ = parse_args(["--checkpoint-uri", "s3://b", "--notices", "aws", "--", "x"], env)
        assert config.poll_interval == 0.05
        (source,) = build_sources(config, env)
        assert isinstance(source, PollingNoticeSource) and source.interval == 0.05

    def test_the_poll_interval_variable_overrides_the_option_as_the_readme_says(self) -> None:
        # The README said every option wins over its variable; this one is the exception by design
        # (spotjob run always passes --poll-interval 1, and tests need less than a second).
        env = {"SPOTJOB_AGENT_POLL_INTERVAL": "0.05"}
        config, _ = parse_args(["--checkpoint-uri", "s3://b", "--poll-interval", "3", "--", "x"], env)
        assert config.poll_interval == 0.05
        readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
        (row,) = [line for line in readme.splitlines() if line.startswith("| `SPOTJOB_AGENT_POLL_INTERVAL`")]
        assert "**overrides** its option" in row
        assert "an option of the same name wins, except over\n`SPOTJOB_AGENT_POLL_INTERVAL`" in readme

    @pytest.mark.parametrize("port", ["-1", "65536", "http", "8470.5"])
    def test_a_control_port_that_is_no_port_exits_2_naming_it(
        self, port: str, capsys: pytest.CaptureFixture[str]
    ) -> None:
        with pytest.raises(SystemExit) as e:
            parse_args(["--checkpoint-uri", "s3://b", "--control-port", port, "--", "x"], {})
        assert e.value.code == 2 and "--control-port" in capsys.readouterr().err

    @pytest.mark.parametrize(
        ("argv", "env"),
        [
            (["--checkpoint-uri", "ftp://x"], {}),
            (["--checkpoint-uri", "s3://"], {}),
            (["--checkpoint-uri", "gs:///prefix"], {}),
            (["--checkpoint-uri", "file://relative/path"], {}),
            (["--checkpoint-uri", "file:relative/path"], {}),
            ([], {"SPOTJOB_CHECKPOINT_URI": "ftp://x"}),
        ],
    )
    def test_a_checkpoint_uri_no_store_can_open_exits_2_naming_it(
        self, argv: list[str], env: dict[str, str], capsys: pytest.CaptureFixture[str]
    ) -> None:
        with pytest.raises(SystemExit) as e:
            parse_args([*argv, "--", "python", "x.py"], env)
        err = capsys.readouterr().err
        assert e.value.code == 2
        assert ("--checkpoint-uri" if argv else "SPOTJOB_CHECKPOINT_URI") in err
        assert "s3://bucket/prefix" in err or "BUCKET" in err or "absolute path" in err

    @pytest.mark.parametrize("under", [False, True])
    @pytest.mark.parametrize("where", ["--staging-dir", "SPOTJOB_STAGING_DIR"])
    def test_a_staging_dir_that_is_or_lies_under_a_file_exits_2_naming_it(
        self, tmp_path: Path, under: bool, where: str, capsys: pytest.CaptureFixture[str]
    ) -> None:
        a_file = tmp_path / "a-file"
        a_file.write_text("x")
        given = str(a_file / "staging" if under else a_file)
        options = ["--staging-dir", given] if where.startswith("--") else []
        env = {} if options else {"SPOTJOB_STAGING_DIR": given}
        with pytest.raises(SystemExit) as e:
            parse_args(["--checkpoint-uri", "s3://b/p", *options, "--", "python", "x.py"], env)
        err = capsys.readouterr().err
        assert e.value.code == 2
        assert f"{where} {given!r}" in err and "a regular file, not a folder" in err

    def test_the_staging_dir_option_wins_over_a_bad_variable(self, tmp_path: Path) -> None:
        a_file = tmp_path / "a-file"
        a_file.write_text("x")
        env = {"SPOTJOB_STAGING_DIR": str(a_file)}
        config, _ = parse_args(["--checkpoint-uri", "s3://b/p", "--staging-dir", str(tmp_path / "s"), "--", "x"], env)
        assert config.staging_dir == str(tmp_path / "s")

    def test_a_relative_control_or_staging_folder_reaches_the_ranks_resolved(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """As a relative checkpoint path is: a command that changes folder reported in another one."""
        monkeypatch.chdir(tmp_path)
        argv = ["--checkpoint-uri", "s3://b/p", "--control-dir", "cd", "--staging-dir", "st", "--", "x"]
        config, _ = parse_args(argv, {})
        assert (config.control_dir, config.staging_dir) == (str(tmp_path / "cd"), str(tmp_path / "st"))
        config, _ = parse_args(["--checkpoint-uri", "s3://b/p", "--", "x"], {"SPOTJOB_STAGING_DIR": "st"})
        env = Agent(config, ControlDir(str(tmp_path)), env={}).rank_env()
        assert env["SPOTJOB_STAGING_DIR"] == str(tmp_path / "st")

    def test_attempt_and_start_fresh_reach_the_ranks(self, tmp_path: Path) -> None:
        config, _ = parse_args(["--checkpoint-uri", "s3://b/p", "--attempt", "3", "--start-fresh", "--", "x"], {})
        env = Agent(config, ControlDir(str(tmp_path)), env={}).rank_env()
        assert env["SPOTJOB_ATTEMPT"] == "3" and env["SPOTJOB_START_FRESH"] == "1"
        config, _ = parse_args(["--checkpoint-uri", "s3://b/p", "--", "x"], {})
        env = Agent(config, ControlDir(str(tmp_path)), env={}).rank_env()
        assert "SPOTJOB_ATTEMPT" not in env and "SPOTJOB_START_FRESH" not in env

    def test_bad_numbers_are_named_in_plain_words(self, capsys: pytest.CaptureFixture[str]) -> None:
        with pytest.raises(SystemExit):
            parse_args(["--checkpoint-uri", "s3://b", "--attempt", "-1", "--", "x"], {})
        err = capsys.readouterr().err
        assert "--attempt: must be at least 0" in err and "Input should" not in err and "http" not in err

    @pytest.mark.parametrize("seconds", ["inf", "nan"])
    def test_an_every_seconds_that_never_comes_due_is_refused(
        self, capsys: pytest.CaptureFixture[str], seconds: str
    ) -> None:
        # The ranks' Checkpointer refuses it too: passed on, every rank would fail at start-up.
        with pytest.raises(SystemExit) as exc:
            parse_args(["--checkpoint-uri", "s3://b", "--every-seconds", seconds, "--", "x"], {})
        assert exc.value.code == 2
        assert "--every-seconds: must be a finite number" in capsys.readouterr().err

    @pytest.mark.parametrize(
        "option",
        [
            "--sigterm-grace",
            "--gcp-notice-seconds",
            "--exit-timeout",
            "--flush-timeout",
            "--kill-grace",
            "--parent-grace",
            "--rank-connect-timeout",
        ],
    )
    @pytest.mark.parametrize("seconds", ["inf", "nan", "1e300"])
    def test_a_grace_or_timeout_that_is_endless_or_huge_exits_2_naming_it(
        self, capsys: pytest.CaptureFixture[str], option: str, seconds: str
    ) -> None:
        # `--sigterm-grace inf` used to start: the SIGTERM's deadline then overflowed the clock in
        # the notice thread (a traceback), and the SIGTERM was lost while the command ran on.
        with pytest.raises(SystemExit) as exc:
            parse_args(["--checkpoint-uri", "s3://b", option, seconds, "--", "x"], {})
        err = capsys.readouterr().err
        assert exc.value.code == 2
        assert f"{option}: must be" in err and "Traceback" not in err

    @pytest.mark.parametrize("option", ["--sigterm-grace", "--parent-grace"])
    def test_a_notice_grace_of_0_exits_2_naming_it(self, capsys: pytest.CaptureFixture[str], option: str) -> None:
        """A deadline of 0 s has passed when the notice arrives, and a passed deadline means "flush
        now, bounded by --flush-timeout" (600 s): `--sigterm-grace 0` made a SIGTERM wait the
        longest, the opposite of what it says. --no-sigterm is the way to a SIGTERM without a flush."""
        with pytest.raises(SystemExit) as exc:
            parse_args(["--checkpoint-uri", "s3://b", option, "0", "--", "x"], {})
        assert exc.value.code == 2 and f"{option}: must be more than 0" in capsys.readouterr().err

    def test_a_grace_of_a_day_is_accepted(self) -> None:
        config, _ = parse_args(["--checkpoint-uri", "s3://b", "--sigterm-grace", "86400", "--", "x"], {})
        assert config.sigterm_grace == 86400.0

    def test_ranks_per_node_from_a_torchrun_command(self) -> None:
        assert torchrun_nproc(["torchrun", "--nproc-per-node", "4", "train.py"]) == 4
        assert torchrun_nproc(["torchrun", "--nproc_per_node=8", "train.py", "--nproc-per-node", "2"]) == 8
        assert torchrun_nproc(["torchrun", "--nproc-per-node=gpu", "train.py"]) is None
        assert torchrun_nproc(["python", "train.py", "--nproc-per-node", "2"]) is None
        assert torchrun_nproc(["python3", "-m", "torch.distributed.run", "--nproc-per-node", "3", "t.py"]) == 3
        assert torchrun_nproc(["torchrun", "t.py"], {"PET_NPROC_PER_NODE": "5"}) == 5
        # A short option's attached value is no reason to take the script for it, nor to stop reading.
        assert torchrun_nproc(["torchrun", "-r3", "--nproc-per-node", "2", "t.py"]) == 2
        assert torchrun_nproc(["torchrun", "-t", "3", "--nproc-per-node=6", "t.py"]) == 6


class TestRendezvous:
    @pytest.mark.parametrize(
        ("command", "port"),
        [
            (["torchrun", "--nproc-per-node", "2", "--nnodes", "2", "train.py"], 29500),
            (["torchrun", "--master-port", "1234", "train.py", "--master-port", "9"], 1234),
            (["torchrun", "--master_port=1235", "--node_rank=0", "--nnodes", "2", "train.py"], 1235),
            (["torchrun", "--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:1236", "train.py"], 1236),
            (["torchrun", "--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1", "train.py"], 29400),
            (["python", "-m", "torch.distributed.run", "--master-port", "1237", "t.py"], 1237),
        ],
    )
    def test_the_port_this_host_binds(self, command: list[str], port: int) -> None:
        rdzv = local_rendezvous(command, {})
        assert rdzv is not None and rdzv.port == port

    @pytest.mark.parametrize(
        "command",
        [
            ["torchrun", "--standalone", "--nproc-per-node", "2", "train.py"],
            # One node, no port given: torchrun picks a free one, as for --standalone.
            ["torchrun", "--nproc-per-node", "2", "train.py"],
            ["torchrun", "--nnodes", "1:1", "--master-addr", "127.0.0.1", "train.py"],
            ["torchrun", "--node-rank", "1", "--master-addr", "10.0.0.1", "--master-port", "1234", "train.py"],
            ["torchrun", "--rdzv-backend", "c10d", "--rdzv-endpoint", "192.0.2.1:1236", "train.py"],
            ["python", "train.py", "--master-port", "1234"],
        ],
    )
    def test_no_port_when_another_host_or_torchrun_itself_chooses(self, command: list[str]) -> None:
        assert local_rendezvous(command, {}) is None

    def test_torchrun_environment_defaults_count(self) -> None:
        rdzv = local_rendezvous(["torchrun", "train.py"], {"PET_MASTER_PORT": "4321"})
        assert rdzv is not None and rdzv.port == 4321

    @pytest.mark.parametrize(
        ("command", "env", "run"),
        [
            (
                ["torchrun", "--nproc-per-node", "2", "train.py", "--lr", "1"],
                {},
                ["torchrun", "--standalone", "--nproc-per-node", "2", "train.py", "--lr", "1"],
            ),
            (
                ["/v/bin/python3", "-m", "torch.distributed.run", "--nnodes=1:1", "-m", "pkg.train"],
                {},
                ["/v/bin/python3", "-m", "torch.distributed.run", "--standalone", "--nnodes=1:1", "-m", "pkg.train"],
            ),
            # A port given, in the environment too, another backend, more nodes, or --standalone already.
            (["torchrun", "--master_port=1234", "train.py"], {}, None),
            (["torchrun", "train.py"], {"PET_MASTER_PORT": "1234"}, None),
            (["torchrun", "--rdzv-endpoint", "localhost:1234", "train.py"], {}, None),
            (["torchrun", "--rdzv-backend", "c10d", "train.py"], {}, None),
            (["torchrun", "--nnodes", "2", "train.py"], {}, None),
            (["torchrun", "train.py"], {"PET_NNODES": "1:2"}, None),
            (["torchrun", "--standalone", "train.py"], {}, None),
            (["torchrun", "train.py"], {"PET_STANDALONE": "1"}, None),
            (["python", "train.py"], {}, None),
        ],
    )
    def test_one_node_without_a_port_is_run_standalone_as_torchrun_2_12_runs_it(
        self, command: list[str], env: dict[str, str], run: list[str] | None
    ) -> None:
        """torchrun 2.9 to 2.11 bind 29500 for one node given no port, where 2.12 and later pick a
        free one (as --standalone does); the agent adds --standalone so that every torch does."""
        assert standalone_command(command, env) == run


class TestCheckpointUri:
    def test_two_spellings_of_one_location_are_one(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.chdir(tmp_path)
        assert canonical_uri("s3://b/p/") == canonical_uri("S3://b//p") == "s3://b/p"
        assert canonical_uri("ckpt") == canonical_uri(f"file://{tmp_path}/ckpt/") == canonical_uri(f"{tmp_path}/ckpt")
        assert canonical_uri("s3://b/p") != canonical_uri("s3://b/q")

    def test_a_rank_writing_elsewhere_is_an_error_in_the_log_and_in_status(
        self, tmp_path: Path, caplog: pytest.LogCaptureFixture
    ) -> None:
        config = AgentConfig(command=["x"], checkpoint_uri="s3://bucket/jobs/a")
        agent = Agent(config, ControlDir(str(tmp_path)), env={})
        agent.control.write_status(RankStatus(state="training", checkpoint_uri="s3://bucket/jobs/a/"))
        agent._check_ranks(0.0)
        assert agent.status().problems == []
        agent.control.write_status(RankStatus(state="training", checkpoint_uri="s3://bucket/jobs/b"))
        with caplog.at_level("ERROR"):
            agent._check_ranks(0.0)
            agent._check_ranks(0.0)
        errors = [r for r in caplog.records if r.levelname == "ERROR"]
        assert len(errors) == 1 and "s3://bucket/jobs/b" in errors[0].getMessage()
        status = agent.status()
        assert status.rank_checkpoint_uri == "s3://bucket/jobs/b" and status.checkpoint_uri == "s3://bucket/jobs/a"
        assert len(status.problems) == 1 and "controller" in status.problems[0]


def notice(deadline: float | None, source: str = "aws") -> Notice:
    return Notice(source=source, kind=NoticeKind.PREEMPTION, deadline=deadline, detail="test")


class TestKillTime:
    """A later notice may only bring the kill time forward: the earliest one wins."""

    def agent(self, tmp_path: Path) -> Agent:
        config = AgentConfig(command=["x"], checkpoint_uri="file:///c", flush_timeout=600)
        return Agent(config, ControlDir(str(tmp_path)), env={})

    def test_a_sooner_deadline_brings_the_kill_time_forward_and_a_later_one_does_not(self, tmp_path: Path) -> None:
        agent = self.agent(tmp_path)
        now = time.time()
        agent.on_notice(notice(now + 100))
        agent.on_notice(notice(now + 20, "gcp"))
        agent.on_notice(notice(now + 50, "azure"))
        assert agent._flush is not None
        assert agent.status().deadline == now + 20
        assert agent._flush.kill_at < time.monotonic() + 21

    def test_a_notice_with_a_deadline_ends_the_wait_of_one_whose_deadline_had_passed(self, tmp_path: Path) -> None:
        """The first notice came too late (flush now, bounded by --flush-timeout 600 s); a second
        one with a deadline 20 s away sets the kill time: the node goes then, not in 600 s."""
        agent = self.agent(tmp_path)
        now = time.time()
        agent.on_notice(notice(now - 5))
        assert agent._flush is not None and agent._flush.kill_at > time.monotonic() + 500
        agent.on_notice(notice(now + 20, "gcp"))
        assert agent._flush.kill_at < time.monotonic() + 21
        assert agent.status().deadline == now + 20
        assert agent._flush.kill_reason == "the deadline passed"

    def test_a_deadline_already_past_names_the_likely_cause_and_the_bound(
        self, tmp_path: Path, caplog: pytest.LogCaptureFixture
    ) -> None:
        """A notice whose deadline has passed by this node's clock when it comes (an AWS
        instance-action's ``time``, a controller's deadline) most often means this node's clock runs
        ahead of the clock that set it; the warning said only "passed 90.0 s ago" and not what bounds
        the flush now, nor what to look at."""
        agent = self.agent(tmp_path)
        with caplog.at_level("WARNING"):
            agent.on_notice(notice(time.time() - 90))
        assert "--flush-timeout 600 s" in caplog.text
        assert "clock" in caplog.text and "time sync" in caplog.text

    def test_the_same_deadline_again_brings_nothing_forward(
        self, tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """The controller retries ``POST /flush`` with the deadline it sent before (idempotent: 200).
        That deadline, converted to the monotonic clock again, came out a few microseconds sooner
        than the first time, and each retry logged a WARNING that it brought the deadline forward."""
        agent = self.agent(tmp_path)
        wall = time.time()
        clock = iter(range(1000))
        # The wall clock a millisecond further at every reading, the monotonic one still: the drift
        # between two readings of both that made the same deadline look sooner.
        monkeypatch.setattr(time, "time", lambda: wall + next(clock) / 1000)
        monkeypatch.setattr(time, "monotonic", lambda: 100.0)
        deadline = wall + 20
        agent.on_notice(notice(deadline, "api"))
        assert agent._flush is not None
        kill_at = agent._flush.kill_at
        with caplog.at_level("INFO"):
            agent.on_notice(notice(deadline, "api"))
        assert "brings the deadline forward" not in caplog.text and "no second flush" in caplog.text
        assert agent._flush.kill_at == kill_at and agent._flush.deadline == deadline

    def test_a_deadline_later_than_the_flush_timeout_leaves_the_kill_time(self, tmp_path: Path) -> None:
        agent = self.agent(tmp_path)
        agent.on_notice(notice(None, "api"))
        assert agent._flush is not None
        kill_at, reason = agent._flush.kill_at, agent._flush.kill_reason
        agent.on_notice(notice(time.time() + 3600))
        assert (agent._flush.kill_at, agent._flush.kill_reason) == (kill_at, reason)


class TestHeldNotices:
    """A cloud notice whose deadline is further away than ``--flush-lead`` (GCE's hour before a GPU
    VM's host maintenance, Azure's 10-15 minutes before a Reboot) is held: training goes on and the
    flush starts ``--flush-lead`` before the deadline. Before, every notice flushed at once: the job
    stood still for the rest of the hour, and one restarted on that VM flushed again."""

    def agent(self, tmp_path: Path, **options: Any) -> Agent:
        config = AgentConfig(command=["x"], checkpoint_uri="file:///c", **options)
        return Agent(config, ControlDir(str(tmp_path)), env={})

    def test_a_notice_an_hour_ahead_is_held_and_shown_in_status(self, tmp_path: Path) -> None:
        agent = self.agent(tmp_path)
        deadline = time.time() + 3600
        agent.on_notice(Notice(source="gcp", kind=NoticeKind.MAINTENANCE, deadline=deadline, detail="test"))
        agent.release_held()
        status = agent.status()
        assert agent._flush is None and agent.control.flush_request() is None and status.state != "flushing"
        assert status.held_notice is not None and status.held_notice.deadline == deadline
        assert status.flush_at == deadline - 300

    def test_the_status_window_names_the_held_notice(self, tmp_path: Path) -> None:
        """Before, ``/status`` said ``window_message: "no notice"`` beside its ``held_notice``."""
        agent = self.agent(tmp_path)
        deadline = time.time() + 3600
        agent.on_notice(Notice(source="azure", kind=NoticeKind.MAINTENANCE, deadline=deadline, detail="Reboot"))
        status = agent.status()
        assert status.window_ok and status.window_message == (
            f"azure notice held: its flush starts at {utc_stamp(deadline - 300)}"
        )

    def test_the_flush_starts_when_the_lead_is_reached_bounded_by_the_held_deadline(self, tmp_path: Path) -> None:
        agent = self.agent(tmp_path, flush_lead=300)
        deadline = time.time() + 300.5  # flush_at half a second from now
        agent.on_notice(Notice(source="azure", kind=NoticeKind.MAINTENANCE, deadline=deadline, detail="Reboot"))
        assert agent._flush is None
        give_up = time.monotonic() + 30
        while agent._flush is None:
            assert time.monotonic() < give_up, "the held notice was never released"
            agent.release_held()
            time.sleep(0.05)
        flush = agent.control.flush_request()
        assert flush is not None and "Reboot" in flush.reason and flush.deadline == deadline
        assert agent.status().held_notice is None and agent.status().deadline == deadline

    @pytest.mark.parametrize("source", ["signal", "api", "aws"])
    def test_a_nearer_notice_flushes_at_once_and_the_held_deadline_is_kept(self, tmp_path: Path, source: str) -> None:
        agent = self.agent(tmp_path)
        far = time.time() + 3600
        agent.on_notice(Notice(source="gcp", kind=NoticeKind.MAINTENANCE, deadline=far, detail="maintenance"))
        agent.on_notice(Notice(source=source, kind=NoticeKind.PREEMPTION, deadline=time.time() + 100, detail="now"))
        assert agent._flush is not None and agent._flush.notice.source == source
        assert agent.status().held_notice is None

    def test_agent_json_says_the_held_notice_as_status_does_for_local_modes_controller(self, tmp_path: Path) -> None:
        """Local mode's controller reads each agent's ``agent.json``, not its ``/status``. Before,
        ``agent.json`` had no held notice, so ``spotjob status`` never showed one. Now the watch
        loop's ``_check_held`` writes it there when it comes, moves or goes, and the controller's
        one reading of both (``held_notice``) takes the same notice from either."""
        from orchestrator.backends.base import held_notice

        agent = self.agent(tmp_path)
        api = ControlApi(agent, token="t")
        api.start()
        agent.api = api
        try:
            agent._write_agent_file()
            said = read_json(str(tmp_path / AGENT_FILE))
            assert said is not None and said["held_notice"] is None and held_notice(said) is None
            deadline = time.time() + 3600
            agent.on_notice(Notice(source="gcp", kind=NoticeKind.MAINTENANCE, deadline=deadline, detail="TERMINATE"))
            agent._check_held()
            said = read_json(str(tmp_path / AGENT_FILE))
            assert said is not None and said["url"] == api.url, said
            from_file = held_notice(said)
            assert from_file is not None and from_file == held_notice(agent.status().model_dump(mode="json"))
            assert (from_file.source, from_file.kind, from_file.detail) == ("gcp", "maintenance", "TERMINATE")
            assert from_file.flush_at == datetime.fromtimestamp(round(deadline - 300), UTC)
            agent.on_notice(
                Notice(source="gcp", kind=NoticeKind.MAINTENANCE, deadline=None, detail="NONE", withdrawn=True)
            )
            agent._check_held()
            said = read_json(str(tmp_path / AGENT_FILE))
            assert said is not None and held_notice(said) is None, said
        finally:
            api.stop()

    def test_a_withdrawn_notice_drops_the_held_flush_but_not_one_under_way(
        self, tmp_path: Path, caplog: pytest.LogCaptureFixture
    ) -> None:
        agent = self.agent(tmp_path)
        far = time.time() + 3600
        agent.on_notice(Notice(source="gcp", kind=NoticeKind.MAINTENANCE, deadline=far, detail="TERMINATE"))
        with caplog.at_level("WARNING"):
            agent.on_notice(
                Notice(source="gcp", kind=NoticeKind.MAINTENANCE, deadline=None, detail="NONE", withdrawn=True)
            )
        assert agent.status().held_notice is None and agent._flush is None
        assert "withdrew" in caplog.text and "dropped" in caplog.text
        agent.on_notice(Notice(source="gcp", kind=NoticeKind.MAINTENANCE, deadline=time.time() + 30, detail="soon"))
        assert agent._flush is not None
        agent.on_notice(Notice(source="gcp", kind=NoticeKind.MAINTENANCE, deadline=None, detail="NONE", withdrawn=True))
        assert agent._flush is not None and agent.control.flush_request() is not None

    def test_a_held_event_the_cloud_moves_takes_its_new_time_later_or_sooner(self, tmp_path: Path) -> None:
        """Azure moved a held Reboot (same EventId, new ``NotBefore``). Before, a later time was
        dropped as "one is held for an earlier deadline" and the flush came at the old time."""
        agent = self.agent(tmp_path)
        first, later = time.time() + 900, time.time() + 1800
        agent.on_notice(Notice(source="azure", kind=NoticeKind.MAINTENANCE, deadline=first, detail="x", event_id="E"))
        agent.on_notice(Notice(source="azure", kind=NoticeKind.MAINTENANCE, deadline=later, detail="y", event_id="E"))
        status = agent.status()
        assert status.held_notice is not None and status.held_notice.deadline == later and agent._flush is None
        agent.on_notice(Notice(source="azure", kind=NoticeKind.MAINTENANCE, deadline=first + 3600, detail="z"))
        assert agent.status().held_notice is not None and agent.status().held_notice.deadline == later  # other event
        soon = time.time() + 30
        agent.on_notice(Notice(source="azure", kind=NoticeKind.MAINTENANCE, deadline=soon, detail="s", event_id="E"))
        assert agent._flush is not None and agent._flush.deadline is not None and agent._flush.deadline < first

    def test_every_held_event_is_kept_and_the_earliest_decides(self, tmp_path: Path) -> None:
        """Azure Reboot A in 30 minutes, Redeploy B in 15, then B moved to 45 (or withdrawn): A's
        time decides again. Before, B had replaced A and the flush came after A's reboot."""
        agent = self.agent(tmp_path)
        a, b = time.time() + 1800, time.time() + 900
        agent.on_notice(Notice(source="azure", kind=NoticeKind.MAINTENANCE, deadline=a, detail="A", event_id="A"))
        agent.on_notice(Notice(source="azure", kind=NoticeKind.MAINTENANCE, deadline=b, detail="B", event_id="B"))
        held = agent.status().held_notice
        assert held is not None and held.deadline == b
        moved = b + 1800
        agent.on_notice(Notice(source="azure", kind=NoticeKind.MAINTENANCE, deadline=moved, detail="B", event_id="B"))
        held = agent.status().held_notice
        assert held is not None and held.deadline == a and agent.status().flush_at == a - 300

    def test_a_clock_stepped_back_since_the_notice_does_not_delay_its_flush(self, tmp_path: Path) -> None:
        """The notice came when this node's clock read 600 s more than it does now (NTP stepped it
        back since): GCE's hour counts from then. Before, the held flush waited for the time of
        day, 600 s after the VM was gone; now the time since the notice (monotonic) counts too."""
        agent = self.agent(tmp_path)
        heard = time.time() + 600  # the clock's reading when the notice came, before the step
        notice = Notice(source="gcp", kind=NoticeKind.MAINTENANCE, deadline=heard + 301, detail="x", received_at=heard)
        agent.on_notice(notice)
        assert agent._flush is None and agent.status().flush_at is not None
        assert agent.status().flush_at < time.time() + 5
        give_up = time.monotonic() + 30
        while agent._flush is None:
            assert time.monotonic() < give_up, "the held notice was never released"
            agent.release_held()
            time.sleep(0.05)

    def test_a_flush_another_node_asked_for_starts_no_second_flush_but_the_notice_stays_reported(
        self, tmp_path: Path, caplog: pytest.LogCaptureFixture
    ) -> None:
        """A node of a multi-node job holds a maintenance notice; another node's preemption makes
        every rank commit. At the held notice's time no second flush.json goes to ranks already on
        their way out. Its node goes at the deadline all the same, so /status and agent.json still
        name the notice until the agent exits: the controller keeps the node of an agent that only
        flushed with a peer out of the cool-down unless ``status.heldNotices`` names it. Before, the
        agent dropped the notice on seeing the commit, and a controller pass before its exit lost it."""
        from orchestrator.backends.base import held_notice

        agent = self.agent(tmp_path)
        api = ControlApi(agent, token="t")
        api.start()
        agent.api = api
        try:
            deadline = time.time() + 300.2
            agent.on_notice(Notice(source="gcp", kind=NoticeKind.MAINTENANCE, deadline=deadline, detail="x"))
            agent._check_held()
            result = FlushResult(step=5, uri="file:///c/step-5", request_id=None, notice_to_commit_seconds=None)
            agent.control.write_flush_result(result)
            with caplog.at_level("INFO"):
                agent._check_flush_result()
            # Not "(no notice here)" right after the line naming the notice held here.
            assert "the gcp notice held for" in caplog.text and "needs no flush of its own" in caplog.text
            assert "no notice here" not in caplog.text
            assert "for a flush another node's agent asked for (no flush of its own)" in caplog.text
            status = agent.status()
            assert status.state == "flushed" and status.held_notice is not None, status
            assert status.held_notice.deadline == deadline and status.flush is None
            assert "no flush of its own" in status.window_message
            reported = held_notice(status.model_dump(mode="json"))
            assert reported is not None and reported.source == "gcp"
            agent._check_held()
            said = read_json(str(tmp_path / AGENT_FILE))
            assert said is not None and held_notice(said) == reported, said
            time.sleep(0.3)  # past the held notice's flush time
            agent.release_held()
            assert agent.control.flush_request() is None and agent._flush is None
            assert agent.status().held_notice is not None
            # A maintenance heard only now is reported as well, and flushes nothing either.
            later = time.time() + 3600
            agent.on_notice(
                Notice(source="azure", kind=NoticeKind.MAINTENANCE, deadline=later, detail="Reboot", event_id="E")
            )
            agent.release_held()
            assert agent.control.flush_request() is None and agent._flush is None
            # A withdrawal still drops it: that node is not going.
            agent.on_notice(
                Notice(source="gcp", kind=NoticeKind.MAINTENANCE, deadline=None, detail="NONE", withdrawn=True)
            )
            held = agent.status().held_notice
            assert held is not None and held.deadline == later, held
        finally:
            api.stop()

    def test_a_preemption_is_never_held_whatever_its_deadline(self, tmp_path: Path) -> None:
        """Spot preemption gives 30 s to 2 minutes: an AWS instance-action whose ``time`` is 10
        minutes away says this node's clock runs behind, and holding it would flush too late."""
        agent = self.agent(tmp_path)
        agent.on_notice(Notice(source="aws", kind=NoticeKind.PREEMPTION, deadline=time.time() + 600, detail="x"))
        assert agent._flush is not None

    def test_a_signal_or_the_api_is_never_held(self, tmp_path: Path) -> None:
        agent = self.agent(tmp_path)
        agent.on_notice(Notice(source="signal", kind=NoticeKind.TERMINATE, deadline=time.time() + 3600, detail="x"))
        assert agent._flush is not None

    @pytest.mark.parametrize("source", ["gcp", "azure"])
    def test_an_assumed_deadline_is_never_held_whatever_the_lead(
        self, tmp_path: Path, source: str, caplog: pytest.LogCaptureFixture
    ) -> None:
        """A deadline the cloud did not tell (an Azure event already Started, a GCE maintenance
        found set) is a guess: the node may go sooner. Before, one further away than --flush-lead
        was held like a told one; the log now says why it flushes at once."""
        agent = self.agent(tmp_path, flush_lead=10)
        deadline = time.time() + 3600
        with caplog.at_level("WARNING"):
            agent.on_notice(
                Notice(source=source, kind=NoticeKind.MAINTENANCE, deadline=deadline, detail="x", deadline_assumed=True)
            )
        assert agent._flush is not None and agent._flush.deadline == deadline
        assert agent.status().held_notice is None and agent.status().flush_at is None
        assert "deadline" in caplog.text and "assumed" in caplog.text and "the flush starts now" in caplog.text

    def test_flush_lead_0_flushes_every_notice_at_once(self, tmp_path: Path) -> None:
        agent = self.agent(tmp_path, flush_lead=0)
        agent.on_notice(Notice(source="gcp", kind=NoticeKind.MAINTENANCE, deadline=time.time() + 3600, detail="x"))
        assert agent._flush is not None

    def test_a_save_longer_than_the_lead_starts_the_flush_earlier(self, tmp_path: Path) -> None:
        """The last save took 1000 s (x the safety margin 1.5): a deadline 20 minutes away leaves no
        time to hold."""
        agent = self.agent(tmp_path)
        agent.control.write_status(RankStatus(state="training", last_save_seconds=1000.0))
        agent.on_notice(Notice(source="gcp", kind=NoticeKind.MAINTENANCE, deadline=time.time() + 1200, detail="x"))
        assert agent._flush is not None

    def test_a_flush_the_last_save_times_the_margin_scheduled_starts_without_a_false_warning(
        self, tmp_path: Path, caplog: pytest.LogCaptureFixture
    ) -> None:
        """The last save x --safety-margin (2 s) sets the lead over --flush-lead (1 s). The flush
        started then, as scheduled, always found a hair less than 2 s left and warned that it "may
        not commit in time"; and the notice's line credited --flush-lead with the lead."""
        agent = self.agent(tmp_path, flush_lead=1, safety_margin=4)
        agent.control.write_status(RankStatus(state="training", last_save_seconds=0.5))
        deadline = time.time() + 2.5  # the flush half a second from now
        with caplog.at_level("INFO"):
            agent.on_notice(Notice(source="gcp", kind=NoticeKind.MAINTENANCE, deadline=deadline, detail="x"))
            assert agent._flush is None
            assert "the last save took 0.5 s x --safety-margin 4, more than --flush-lead 1 s" in caplog.text
            assert "(--flush-lead" not in caplog.text
            give_up = time.monotonic() + 30
            while agent._flush is None:
                assert time.monotonic() < give_up, "the held notice was never released"
                agent.release_held()
                time.sleep(0.02)
        assert "may not" not in caplog.text, caplog.text
        assert not [r for r in caplog.records if r.levelname == "WARNING" and "flush starts at" not in r.message]

    def test_the_held_flush_time_the_last_save_moves_is_logged_again(
        self, tmp_path: Path, caplog: pytest.LogCaptureFixture
    ) -> None:
        agent = self.agent(tmp_path, flush_lead=1, safety_margin=4)
        agent.control.write_status(RankStatus(state="training", last_save_seconds=5.0))
        deadline = time.time() + 3600
        agent.on_notice(Notice(source="gcp", kind=NoticeKind.MAINTENANCE, deadline=deadline, detail="x"))
        assert agent.status().flush_at == pytest.approx(deadline - 20)
        with caplog.at_level("INFO"):
            agent.control.write_status(RankStatus(state="training", last_save_seconds=5.1))
            agent.release_held()  # 0.4 s sooner: not worth a line
            assert "now starts at" not in caplog.text
            agent.control.write_status(RankStatus(state="training", last_save_seconds=3.0))
            agent.release_held()
            agent.release_held()
        moved = [r for r in caplog.records if "now starts at" in r.message]
        assert len(moved) == 1 and moved[0].levelname == "INFO", caplog.text
        assert f"now starts at {utc_stamp(deadline - 12)}, 12 s before the deadline" in moved[0].message
        assert "the last save took 3.0 s x --safety-margin 4" in moved[0].message

    def test_the_option_is_checked(self, capsys: pytest.CaptureFixture[str]) -> None:
        with pytest.raises(SystemExit) as e:
            parse_args(["--checkpoint-uri", "file:///c", "--flush-lead", "-1", "--", "x"], {})
        assert e.value.code == 2 and "--flush-lead" in capsys.readouterr().err
        config, _ = parse_args(["--checkpoint-uri", "file:///c", "--flush-lead", "600", "--", "x"], {})
        assert config.flush_lead == 600

    def test_the_notice_options_are_also_variables_and_the_option_wins(self) -> None:
        """On Kubernetes the controller writes the agent's command line: a SpotJob's ``env`` is the
        only way to give ``--flush-lead``, ``--gcp-maintenance-seconds`` or ``--rebalance``. Before,
        the variables were read by nothing (the agent warned of unknown variables)."""
        argv = ["--checkpoint-uri", "file:///c", "--", "x"]
        env = {
            "SPOTJOB_AGENT_FLUSH_LEAD": "0",
            "SPOTJOB_AGENT_GCP_MAINTENANCE_SECONDS": "1800",
            "SPOTJOB_AGENT_REBALANCE": "flush",
        }
        config, _ = parse_args(argv, env)
        assert (config.flush_lead, config.gcp_maintenance_seconds, config.rebalance) == (0, 1800, "flush")
        options = ["--flush-lead", "120", "--gcp-maintenance-seconds", "60", "--rebalance", "ignore"]
        config, _ = parse_args([*options, *argv], env)
        assert (config.flush_lead, config.gcp_maintenance_seconds, config.rebalance) == (120, 60, "ignore")
        config, _ = parse_args(argv, {"SPOTJOB_AGENT_FLUSH_LEAD": " "})  # empty counts as unset
        assert (config.flush_lead, config.gcp_maintenance_seconds, config.rebalance) == (300, None, "save-early")

    @pytest.mark.parametrize(
        ("variable", "value", "said"),
        [
            ("SPOTJOB_AGENT_FLUSH_LEAD", "5m", "SPOTJOB_AGENT_FLUSH_LEAD='5m' is not a number of seconds"),
            ("SPOTJOB_AGENT_FLUSH_LEAD", "-1", "SPOTJOB_AGENT_FLUSH_LEAD='-1': must be at least 0"),
            (
                "SPOTJOB_AGENT_GCP_MAINTENANCE_SECONDS",
                "0",
                "SPOTJOB_AGENT_GCP_MAINTENANCE_SECONDS='0': must be more than 0",
            ),
            (
                "SPOTJOB_AGENT_REBALANCE",
                "save_early",
                "SPOTJOB_AGENT_REBALANCE='save_early': expected one of ignore, save-early",
            ),
        ],
    )
    def test_a_malformed_variable_exits_2_naming_it(
        self, capsys: pytest.CaptureFixture[str], variable: str, value: str, said: str
    ) -> None:
        with pytest.raises(SystemExit) as e:
            parse_args(["--checkpoint-uri", "file:///c", "--", "x"], {variable: value})
        assert e.value.code == 2 and said in capsys.readouterr().err


class TestRanksConnect:
    def test_no_rank_after_the_timeout_is_a_warning_and_a_status_field(
        self, tmp_path: Path, caplog: pytest.LogCaptureFixture
    ) -> None:
        config = AgentConfig(command=["x"], checkpoint_uri="file:///c", rank_connect_timeout=120)
        agent = Agent(config, ControlDir(str(tmp_path)), env={})
        start = agent._started_monotonic
        with caplog.at_level("WARNING"):
            agent._check_ranks(start + 60)
            assert not caplog.records and agent.status().problems == []
            agent._check_ranks(start + 121)
            agent._check_ranks(start + 122)
        assert len(caplog.records) == 1 and "no rank has connected" in caplog.text
        status = agent.status()
        assert status.ranks_connected is False and "Checkpointer" in status.problems[0]
        assert status.ranks_not_meeting == status.problems[0]
        agent.control.write_status(RankStatus(state="training"))
        agent._check_ranks(start + 123)
        assert agent.status().problems == [] and agent.status().ranks_connected is True
        assert agent.status().ranks_not_meeting is None

    def test_the_warning_is_said_again_only_when_what_it_found_changed(
        self, tmp_path: Path, caplog: pytest.LogCaptureFixture
    ) -> None:
        """(Pins the repeat rule; the first warning's words are in the integration tests.)"""
        config = AgentConfig(command=["x"], checkpoint_uri="file:///c", rank_connect_timeout=10)
        agent = Agent(config, ControlDir(str(tmp_path)), env={})
        start = agent._started_monotonic
        with caplog.at_level("WARNING"):
            for waited in (10, 15, 20, 31):
                agent._check_ranks(start + waited)
        assert len(caplog.records) == 1
        assert "31 s after the start" in (agent.status().ranks_not_meeting or ""), "the status follows each check"

    def test_the_threshold_is_also_a_variable_for_a_spotjobs_env(self) -> None:
        config, _ = parse_args(
            ["--checkpoint-uri", "file:///c", "--", "x"], {"SPOTJOB_AGENT_RANK_CONNECT_TIMEOUT": "7"}
        )
        assert config.rank_connect_timeout == 7
        config, _ = parse_args(["--checkpoint-uri", "file:///c", "--", "x"], {})
        assert config.rank_connect_timeout == 120

    def test_a_threshold_of_0_exits_2_as_the_readme_says(self, capsys: pytest.CaptureFixture[str]) -> None:
        """The README listed it among the timeouts that take 0 to a day, but the agent refuses 0."""
        with pytest.raises(SystemExit) as e:
            parse_args(["--checkpoint-uri", "file:///c", "--rank-connect-timeout", "0", "--", "x"], {})
        assert e.value.code == 2 and "--rank-connect-timeout: must be more than 0" in capsys.readouterr().err
        readme = " ".join((Path(__file__).resolve().parents[2] / "README.md").read_text().split())
        assert "`--rank-connect-timeout` must be more than 0 too" in readme


class TestMeetingPoint:
    @pytest.mark.parametrize(
        ("args", "env", "point"),
        [
            (
                ["--nnodes", "2", "--node-rank", "1", "--master-addr", "10.0.0.5", "--master-port", "29600"],
                {},
                ("10.0.0.5", 29600),
            ),
            (["--nnodes", "2"], {}, ("127.0.0.1", 29500)),
            (["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "head:29401"], {}, ("head", 29401)),
            (["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "[fd00::1]"], {}, ("fd00::1", 29400)),
            ([], {"PET_NNODES": "2", "PET_MASTER_ADDR": "h", "PET_MASTER_PORT": "1234"}, ("h", 1234)),
            (["--standalone"], {}, None),
            (["--nproc-per-node", "2"], {}, None),  # one node, no port: torchrun picks one
        ],
    )
    def test_where_the_ranks_of_a_torchrun_command_meet(
        self, args: list[str], env: dict[str, str], point: tuple[str, int] | None
    ) -> None:
        assert meeting_point(["torchrun", *args, "train.py"], env) == point

    def test_a_command_that_is_not_torchrun_names_no_meeting_point(self) -> None:
        assert meeting_point(["python", "train.py"], {}) is None


# Above Linux's largest pid_max (2**22): a root with no descendants, for trees found by marker only.
NO_SUCH_PID = 2**22 + 1


def alive(pid: int) -> bool:
    info = read_proc(pid)
    return info is not None and info.state != "Z"


def wait_for_zombies(*pids: int, bound: float = 60.0) -> None:
    """Until every one of ``pids`` has exited and waits, unreaped, for its parent."""
    give_up = time.monotonic() + bound
    while any((info := read_proc(pid)) is not None and info.state != "Z" for pid in pids):
        assert time.monotonic() < give_up, "a child did not exit"
        time.sleep(0.01)


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
        # session's servers): it starts the "command" (known to the tree by its marker, as the pid
        # is not), which starts a grandchild, found through its parent link.
        agent_id = uuid.uuid4().hex
        root = subprocess.Popen(
            [
                sys.executable,
                "-c",
                "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', "
                "\"import subprocess, time; subprocess.Popen(['sleep', '60']); time.sleep(60)\"]); time.sleep(60)",
            ],
            env={**os.environ, ENV_AGENT_ID: agent_id},
        )
        tree = ProcessTree(agent_id, root_pid=root.pid)
        try:
            # Until the grandchild has exec'd sleep: forked, it is still named python for a moment.
            def found() -> bool:
                members = tree.refresh()
                return len(members) == 2 and "sleep" in {p.comm for p in members}

            deadline = time.monotonic() + 60
            while not found() and time.monotonic() < deadline:
                time.sleep(0.02)
            members = tree.refresh()
            assert len(members) == 2 and "sleep" in {p.comm for p in members}, members
            tree.stop_all(grace=1.0, reason="test")
            assert not tree.refresh()
            assert all(not alive(p.pid) for p in members)
        finally:
            root.kill()
            root.wait()

    def test_another_child_of_the_agents_process_is_left_alone(self) -> None:
        # The agent embedded in a process with children of its own (here: pytest, whose children
        # are this session's servers, such as fake-gcs-server): only the command's tree is stopped.
        # Rooted at the agent's process, the walk used to take every child of it, and an in-process
        # Agent.run() in a test killed the session's fake-gcs-server.
        bystander = subprocess.Popen(["sleep", "60"])
        command = subprocess.Popen(
            [sys.executable, "-c", "import subprocess, time; subprocess.Popen(['sleep', '61']); time.sleep(60)"]
        )
        tree = ProcessTree(uuid.uuid4().hex)  # rooted at this process, as Agent.run() roots it
        tree.command_pid = command.pid
        try:
            deadline = time.monotonic() + 10
            while len(tree.refresh()) < 2 and time.monotonic() < deadline:
                time.sleep(0.02)
            members = {p.pid for p in tree.refresh(scan_environ=True)}
            assert command.pid in members and bystander.pid not in members and len(members) == 2
            tree.stop_all(grace=1.0, reason="test")
            assert command.wait(10) is not None
            assert bystander.poll() is None, "a child that is not the command's was stopped"
        finally:
            for p in (bystander, command):
                p.kill()
                p.wait()

    def test_reap_leaves_the_exit_status_of_the_command_and_of_another_child_to_their_owners(self) -> None:
        """Only inherited orphans of the command are reaped: a waitpid(-1) would take the status of
        the command (Popen's) and of any other child of the agent's process (here: pytest's)."""
        bystander = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
        command = subprocess.Popen([sys.executable, "-c", "raise SystemExit(5)"])
        tree = ProcessTree(uuid.uuid4().hex)
        tree.command_pid = command.pid
        try:
            tree.refresh()
            wait_for_zombies(bystander.pid, command.pid)
            tree.refresh()
            tree.reap()
            assert (bystander.wait(10), command.wait(10)) == (3, 5)
        finally:
            for p in (bystander, command):
                p.kill()
                p.wait()

    def test_known_alive_looks_at_the_members_seen_and_counts_no_zombie(self) -> None:
        # What the agent checks 50 times a second after a committed flush, before walking every
        # process: whether a member it saw (a rank) still runs.
        agent_id = uuid.uuid4().hex
        command = subprocess.Popen(["sleep", "60"])
        rank = subprocess.Popen(["sleep", "61"], env={**os.environ, ENV_AGENT_ID: agent_id})
        tree = ProcessTree(agent_id)  # rooted at this process; the rank is found by its marker
        tree.command_pid = command.pid
        try:
            assert not tree.known_alive()  # nothing seen yet
            # Popen returns once the rank's exec has begun, but the kernel sets the new program's
            # environment (where the marker is read from) a moment later: a walk in between does
            # not see the marker yet (once in CI). The agent walks again; so does this test (and
            # such a walk no longer takes the rank for a foreign process for good: below).
            deadline = time.monotonic() + 10
            while (seen := {p.pid for p in tree.refresh()}) != {command.pid, rank.pid} and time.monotonic() < deadline:
                time.sleep(0.01)
            assert seen == {command.pid, rank.pid}
            assert tree.known_alive(besides=command.pid)
            rank.kill()
            deadline = time.monotonic() + 10
            while (info := read_proc(rank.pid)) is not None and info.state != "Z" and time.monotonic() < deadline:
                time.sleep(0.01)
            assert not tree.known_alive(besides=command.pid), "a zombie is no running member"
            assert tree.known_alive()  # the command itself still runs
        finally:
            for p in (command, rank):
                p.kill()
                p.wait()

    def test_a_child_caught_between_fork_and_exec_is_looked_at_again_not_taken_as_foreign(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """A walk that reads a marked child's environment while the kernel has not set it yet (it
        reads empty between the exec's closing of close-on-exec files, when ``Popen`` returns, and
        the new program's stack) took the child for a foreign process and never read it again:
        the CI run of 2026-12-06 saw a rank stay unseen for 10 s of walks. The empty read is
        made here by hand; the child's real environment holds the marker."""
        agent_id = uuid.uuid4().hex
        rank = subprocess.Popen(["sleep", "61"], env={**os.environ, ENV_AGENT_ID: agent_id})
        real = psutil.Process.environ
        reads: list[int] = []

        def mid_exec_once(proc: psutil.Process) -> dict[str, str]:
            reads.append(proc.pid)
            return {} if proc.pid == rank.pid and reads.count(proc.pid) == 1 else real(proc)

        monkeypatch.setattr(psutil.Process, "environ", mid_exec_once)
        tree = ProcessTree(agent_id)  # rooted at this process; the rank is found by its marker
        try:
            assert rank.pid not in {p.pid for p in tree.refresh()}  # its environment read empty
            assert rank.pid in {p.pid for p in tree.refresh()}  # read again: the marker is there
            assert reads.count(rank.pid) == 2
        finally:
            rank.kill()
            rank.wait()


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
        # The restore-cache prefetch is a daemon of its own: it ends when its fetch does (here there
        # is nothing to fetch), not with run(), and on a loaded machine it may still be finishing.
        for thread in threading.enumerate():
            if thread.name == "spotjob-prefetch":
                thread.join(timeout=60)
        assert not [t.name for t in threading.enumerate() if t.name.startswith("spotjob")]
        assert not (tmp_path / "agent.json").exists()

    def test_an_agent_that_fails_after_the_command_exited_stops_the_processes_it_left(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """torchrun gone, a rank in a session of its own still at work (as while ranks flush on after
        torchrun died), and the agent itself fails: the rank is stopped, not left training with
        nobody to hear a notice."""
        monkeypatch.setattr("agent.launcher.become_subreaper", lambda: True)  # leave pytest's process alone
        pid_file = tmp_path / "rank.pid"
        rank = "import time; time.sleep(600)"
        code = (
            "import subprocess, sys\n"
            f"p = subprocess.Popen([sys.executable, '-c', {rank!r}], start_new_session=True)\n"
            f"open({str(pid_file)!r}, 'w').write(str(p.pid))\n"
        )
        real_check = Agent._check_flush_result

        def failing_check(self: Agent) -> None:
            if self._child is not None and self._child.poll() is not None:
                raise RuntimeError("a bug in the agent")
            real_check(self)

        monkeypatch.setattr(Agent, "_check_flush_result", failing_check)
        config = AgentConfig(command=[sys.executable, "-c", code], checkpoint_uri="file:///c")
        agent = Agent(config, ControlDir(str(tmp_path / "ctl")), env={})
        try:
            with pytest.raises(RuntimeError, match="a bug in the agent"):
                agent.run()
            pid = int(pid_file.read_text())
            assert not alive(pid), "the command's process was left running"
        finally:
            if pid_file.exists():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid_file.read_text()), signal.SIGKILL)

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

    def test_each_scan_of_the_watch_loop_walks_every_process_once(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """While nothing happens the agent's cost is its scans: one walk of /proc each, the reaping
        of inherited orphans taken from the same walk (it used to walk again: 2x the idle cost)."""
        monkeypatch.setattr("agent.launcher.become_subreaper", lambda: True)
        go = tmp_path / "go"
        walks: list[int] = []
        scans: list[float] = []
        real_walk = process_tree.all_processes

        def counted_walk() -> list[process_tree.ProcInfo]:
            walks.append(1)
            return real_walk()

        real_check = Agent._check_ranks

        def counted_check(self: Agent, now: float) -> None:
            scans.append(now)
            if len(scans) == 6:
                go.touch()  # the command ends after six scans, however long they take
            real_check(self, now)

        monkeypatch.setattr(process_tree, "all_processes", counted_walk)
        monkeypatch.setattr(Agent, "_check_ranks", counted_check)
        code = f"import os, time\nwhile not os.path.exists({str(go)!r}): time.sleep(0.05)"
        config = AgentConfig(command=[sys.executable, "-c", code], checkpoint_uri="file:///c")
        agent = Agent(config, ControlDir(str(tmp_path / "ctl")), env={})
        assert agent.run() == 0
        assert len(scans) >= 6
        # One walk a scan, plus the few of the start and the end (the last look for strays).
        assert len(walks) <= len(scans) + 3, (len(walks), len(scans))

    def test_a_control_port_in_use_exits_74_naming_the_port_and_the_option_before_the_command_starts(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
    ) -> None:
        monkeypatch.setattr("agent.launcher.become_subreaper", lambda: True)
        started = tmp_path / "started"
        with socket.socket() as holder:
            holder.bind(("127.0.0.1", 0))
            holder.listen()
            port = holder.getsockname()[1]
            config = AgentConfig(
                command=[sys.executable, "-c", f"open({str(started)!r}, 'w')"],
                checkpoint_uri="file:///c",
                control_port=port,
            )
            agent = Agent(config, ControlDir(str(tmp_path / "ctl")), env={})
            with caplog.at_level("ERROR"):
                assert agent.run() == EXIT_INFRA_ERROR
        assert not started.exists()
        assert f"port {port}" in caplog.text and "in use" in caplog.text and "--control-port" in caplog.text
        assert agent.status().state == "exited"

    @pytest.mark.parametrize("host", ["203.0.113.7", "2001:db8::7"])
    def test_a_control_host_that_is_no_address_of_this_machine_is_a_usage_error(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, host: str
    ) -> None:
        monkeypatch.setattr("agent.launcher.become_subreaper", lambda: True)
        started = tmp_path / "started"
        config = AgentConfig(
            command=[sys.executable, "-c", f"open({str(started)!r}, 'w')"],
            checkpoint_uri="file:///c",
            control_host=host,
        )
        agent = Agent(config, ControlDir(str(tmp_path / "ctl")), token="t", env={})
        with caplog.at_level("ERROR"):
            assert agent.run() == 2
        assert not started.exists()
        assert host in caplog.text and "--control-host" in caplog.text

    @pytest.mark.parametrize(("closed", "code"), [((2, 3), 0), ((2,), 134)])
    def test_every_rank_closed_counts_the_ranks_of_this_node_the_ranks_report(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, closed: tuple[int, ...], code: int
    ) -> None:
        """Node 1 of two, two ranks each, started by a wrapper script the agent cannot read: its
        ranks 2 and 3 close and the interpreter aborts at exit. The global world size (4) would
        wait for ranks that run on the other node; the local one the ranks report (2) is this node's."""
        monkeypatch.setattr("agent.launcher.become_subreaper", lambda: True)
        ctl = tmp_path / "ctl"
        code_text = (
            "import json, os, resource\n"
            "folder = os.environ['SPOTJOB_CONTROL_DIR']\n"
            "status = {'state': 'closed', 'world_size': 4, 'local_world_size': 2}\n"
            "json.dump(status, open(os.path.join(folder, 'status.json'), 'w'))\n"
            f"for rank in {closed!r}:\n"
            "    open(os.path.join(folder, f'closed-rank-{rank}'), 'w').close()\n"
            "resource.setrlimit(resource.RLIMIT_CORE, (0, 0))\n"
            "os.abort()\n"
        )
        config = AgentConfig(command=[sys.executable, "-c", code_text], checkpoint_uri=f"file://{tmp_path}/c")
        agent = Agent(config, ControlDir(str(ctl)), env={})
        assert agent.run() == code

    def test_the_command_exits_with_mains_code_after_flushing_what_was_written(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        # spotjob-agent skips the interpreter's teardown (os._exit): what sat in a buffer must be
        # written first, and the code must be main()'s.
        out = io.BytesIO()
        monkeypatch.setattr(sys, "stdout", io.TextIOWrapper(out, write_through=False))

        def main() -> int:
            print("the last words")
            return EXIT_PREEMPTED

        class Exited(Exception):
            pass

        def exit_now(code: int) -> None:
            raise Exited(code)

        monkeypatch.setattr(launcher, "main", main)
        monkeypatch.setattr(launcher.os, "_exit", exit_now)
        with pytest.raises(Exited) as exited:
            launcher.cli()
        assert exited.value.args == (EXIT_PREEMPTED,)
        assert out.getvalue() == b"the last words\n"


def test_the_agent_imports_no_torch_and_no_cloud_sdk() -> None:
    code = (
        "import sys, agent.launcher, agent.notices.emulators\n"
        "print(sorted(m for m in ('torch', 'boto3', 'google.cloud.storage') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_the_prefetch_is_an_option_and_a_variable_and_the_option_wins(capsys: pytest.CaptureFixture[str]) -> None:
    """``--prefetch`` / ``SPOTJOB_AGENT_PREFETCH`` (the way in on Kubernetes, where the controller
    writes the command line). Before the fix neither existed: the prefetch could not be turned off."""
    argv = ["--checkpoint-uri", "file:///c", "--", "x"]
    assert parse_args(argv, {})[0].prefetch == "node"
    assert parse_args(argv, {"SPOTJOB_AGENT_PREFETCH": "off"})[0].prefetch == "off"
    assert parse_args(argv, {"SPOTJOB_AGENT_PREFETCH": " "})[0].prefetch == "node"  # empty counts as unset
    assert parse_args(["--prefetch", "all", *argv], {"SPOTJOB_AGENT_PREFETCH": "off"})[0].prefetch == "all"
    for args, env, said in (
        (["--prefetch", "no"], {}, "--prefetch 'no': expected one of node, all, off"),
        ([], {"SPOTJOB_AGENT_PREFETCH": "false"}, "SPOTJOB_AGENT_PREFETCH 'false': expected one of node, all, off"),
    ):
        with pytest.raises(SystemExit) as e:
            parse_args([*args, *argv], env)
        assert e.value.code == 2 and said in capsys.readouterr().err


@pytest.mark.parametrize(
    ("option", "variable"),
    [
        ("--prefetch", "SPOTJOB_AGENT_PREFETCH"),
        ("--launcher", "SPOTJOB_AGENT_LAUNCHER"),
        ("--log-format", "SPOTJOB_LOG_FORMAT"),
    ],
)
def test_a_bad_value_given_through_an_abbreviated_option_is_blamed_on_the_option(
    option: str, variable: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """argparse takes ``--pref bogus`` for ``--prefetch bogus``. Before the fix the message named the
    variable (unset, or set to a good value) because the command line did not spell the option out
    in full; the user was sent to fix what they never set."""
    argv = ["--checkpoint-uri", "file:///c", "--", "x"]
    for env in ({}, {variable: "node" if option == "--prefetch" else "direct" if option == "--launcher" else "json"}):
        with pytest.raises(SystemExit) as e:
            parse_args([option[:7] if option == "--log-format" else option[:6], "bogus", *argv], env)
        said = capsys.readouterr().err
        assert e.value.code == 2 and f"{option} 'bogus'" in said and variable not in said, (env, said)
    with pytest.raises(SystemExit):
        parse_args(argv, {variable: "bogus"})
    assert f"{variable} 'bogus'" in capsys.readouterr().err
