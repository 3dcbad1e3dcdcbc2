"""``SPOTJOB_LOG_FORMAT=json`` (``--log-format json``): each log line of spotjob's commands one JSON
object, for log pipelines that index fields; the real commands are run where they log."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

import pytest

from agent.streams import JsonFormatter, UtcFormatter, log_format, redact

REPO = Path(__file__).resolve().parents[2]


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPOTJOB_")}
    return {**env, "HOME": str(tmp_path), "PYTHONPATH": str(REPO), **extra}


def _record_with_traceback(logger: str, level: int, message: str, arg: str, error: Exception) -> logging.LogRecord:
    """A record of ``message % arg`` carrying the traceback of ``error``, raised and caught."""
    try:
        raise error
    except Exception:
        exc_info = sys.exc_info()
    return logging.LogRecord(logger, level, __file__, 1, message, (arg,), exc_info)


def test_a_record_is_one_json_object_with_the_commands_fields_its_traceback_and_no_credential() -> None:
    formatter = JsonFormatter({"command": "spotjob-agent", "pid": 7, "job": "ns/train"})
    record = _record_with_traceback(
        "agent.launcher", logging.ERROR, "saving to %s — headers {'Authorization': 'Bearer s3cr3t'}", "s3://b/x",
        RuntimeError("boom"),
    )  # fmt: skip
    record.created = datetime(2030, 1, 1, 23, 59, 58, 250000, tzinfo=UTC).timestamp()
    record.msecs = 250.0

    line = formatter.format(record)

    assert "\n" not in line and line.isascii()
    doc = json.loads(line)
    assert doc["time"] == "2030-01-01T23:59:58.250Z"
    assert (doc["level"], doc["logger"], doc["command"], doc["pid"], doc["job"]) == (
        "ERROR", "agent.launcher", "spotjob-agent", 7, "ns/train",
    )  # fmt: skip
    assert doc["message"].startswith("saving to s3://b/x — headers")
    assert "s3cr3t" not in line and "<redacted>" in doc["message"]
    assert doc["exception"].startswith("Traceback") and "RuntimeError: boom" in doc["exception"]


def test_the_password_of_an_endpoint_url_is_blanked_in_the_message_and_the_traceback() -> None:
    """botocore's debug lines and its EndpointConnectionError repeat the endpoint URL whole: one
    behind basic auth (``AWS_ENDPOINT_URL=http://user:password@host``) carried its password into
    every debug log of ``spotjob ckpt -v``, ``spotjob run -v`` or a debug agent."""
    record = _record_with_traceback(
        "botocore.regions", logging.DEBUG, "Endpoint provider result: %s", "https://u:hunter2@s3.example.com:9000/bkt",
        ConnectionError('Could not connect to the endpoint URL: "http://u:hunter2@10.0.0.1:9000/bkt"'),
    )  # fmt: skip
    for formatter in (JsonFormatter(), UtcFormatter("%(message)s")):
        line = formatter.format(record)
        assert "hunter2" not in line, line
        assert "https://<redacted>@s3.example.com:9000/bkt" in line and "http://<redacted>@10.0.0.1:9000" in line
    # What has no user information is left whole: a bucket URI, a path or query holding an @.
    for text in ("s3://bucket/x@y", "gs://b/runs/a@b", "http://host/a@b", "http://host?to=a@b", "file:///x"):
        assert redact(text) == text


# What a URL's userinfo may hold (RFC 3986: sub-delims, ':' and %-escapes; a raw '@' a careless
# password has), each between two parts of the password that must both be blanked.
_USERINFO_CHARACTERS = ["'", '"', "(", ")", "!", "$", "&", "*", "+", ",", ";", "=", ":", "%27", "@"]


@pytest.mark.parametrize("character", _USERINFO_CHARACTERS)
def test_a_password_holding_any_character_a_userinfo_may_hold_is_blanked_whole(character: str) -> None:
    """A password with a ``'`` (legal in a userinfo) was printed whole: the pattern stopped at a
    quote, so it never reached the ``@``. What surrounds the URL is left: the quotes around it, the
    host and path after it, a second URL's own userinfo, an ``@`` in text after it."""
    from agent.storage._s3_errors import _without_userinfo

    url = f"http://alice:Zq7{character}Secret99@127.0.0.1:1"
    lines = [
        f'Could not connect to the endpoint URL: "{url}/b?list-type=2"',  # botocore's error
        f"Endpoint provider result: {url}/b",
        f"url={url}/b?x=1, headers={{'Host': 'h'}}",
        f"{{'Endpoint': {url!r}, 'Bucket': 'b@c'}}",  # repr: "..." or '...' around it, \' inside
        f"'{url}' then http://bob:Other1@host/ and x@y",
    ]
    for line in lines:
        for masked, blank in ((redact(line), "<redacted>@"), (_without_userinfo(line), "***@")):
            assert "Zq7" not in masked and "Secret99" not in masked and "alice" not in masked, masked
            assert f"http://{blank}127.0.0.1:1" in masked, masked
    assert redact(lines[0]).endswith('@127.0.0.1:1/b?list-type=2"')
    assert redact(lines[3]).endswith(", 'Bucket': 'b@c'}")
    assert redact(lines[4]).endswith("127.0.0.1:1' then http://<redacted>@host/ and x@y")


@pytest.mark.parametrize(("value", "kind"), [(None, "text"), ("", "text"), ("JSON", "json"), (" text ", "text")])
def test_the_format_setting_takes_text_or_json_in_any_case(value: str | None, kind: str) -> None:
    assert log_format(value) == kind


def test_the_format_setting_refuses_anything_else_naming_what_it_takes() -> None:
    with pytest.raises(ValueError, match="'xml': expected text or json"):
        log_format("xml")


def test_spotjob_agent_logs_json_lines_with_its_pid_and_job(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "agent.launcher", "--checkpoint-uri", f"file://{tmp_path}/ck", "--job-name", "ns/train",
         "--cloud", "none", "--", sys.executable, "-c", "print('the script')"],
        env=_env(tmp_path, SPOTJOB_LOG_FORMAT="json"), cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert lines, "the agent logged nothing"
    docs = [json.loads(line) for line in lines]  # every line of the agent's is JSON
    assert all(d["command"] == "spotjob-agent" and d["job"] == "ns/train" for d in docs), docs
    assert {d["pid"] for d in docs} == {docs[0]["pid"]} and docs[0]["pid"] != os.getpid()
    assert any(d["message"].startswith("exiting 0") for d in docs), [d["message"] for d in docs]
    assert "the script" in done.stdout


@pytest.mark.parametrize(
    ("args", "env", "named"),
    [
        (["--log-format", "xml"], {}, "--log-format 'xml'"),
        ([], {"SPOTJOB_LOG_FORMAT": "xml"}, "SPOTJOB_LOG_FORMAT 'xml'"),
    ],
)
def test_spotjob_agent_refuses_another_format_naming_where_it_came_from(
    tmp_path: Path, args: list[str], env: dict[str, str], named: str
) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "agent.launcher", "--checkpoint-uri", f"file://{tmp_path}/ck", *args, "--", "true"],
        env=_env(tmp_path, **env), cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2
    assert named in done.stderr and "expected text or json" in done.stderr, done.stderr


def test_the_controller_logs_json_lines_its_refusal_to_start_too(tmp_path: Path) -> None:
    """Its first log line (a misspelled variable, before it reaches for the cluster) as JSON, and
    why it cannot start (here: no kubeconfig) as one ERROR object: it was a line of text, the one
    line a log pipeline most needs from a controller in a crash loop."""
    done = subprocess.run(
        [sys.executable, "-m", "orchestrator.k8s.main", "--no-leader-elect", f"--kubeconfig={tmp_path / 'none'}",
         "--log-format", "json"],
        env=_env(tmp_path, SPOTJOB_NAMESPACE="ml"), capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2  # no cluster here
    warning, refusal = [json.loads(line) for line in done.stderr.splitlines()]  # every line is JSON
    assert warning["level"] == "WARNING" and "SPOTJOB_NAMESPACE is set" in warning["message"], warning
    assert refusal["level"] == "ERROR", refusal
    assert refusal["message"].startswith(f"cannot load the cluster configuration from {tmp_path / 'none'}"), refusal


def test_json_logs_carry_uncaught_exceptions_of_every_thread_and_warnings_as_objects(tmp_path: Path) -> None:
    """Python writes a warning, and the traceback of an exception nothing caught, to stderr itself:
    lines of text among the JSON objects, a traceback split over many. Under JSON logs each is one
    object (loggers ``py.warnings``, ``py.exceptions``) with the command's fields."""
    script = (
        "import threading, warnings\n"
        "from agent.streams import log_to_stderr\n"
        "log_to_stderr('INFO', '%(message)s', kind='json', fields={'command': 'spotjob-agent'})\n"
        "warnings.warn('an old option', DeprecationWarning)\n"
        "t = threading.Thread(target=lambda: 1 / 0, name='notices-aws')\n"
        "t.start(); t.join()\n"
        "raise RuntimeError('the watch loop broke')\n"
    )
    done = subprocess.run(
        [sys.executable, "-W", "always", "-c", script], env=_env(tmp_path), cwd=tmp_path,
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 1
    docs = [json.loads(line) for line in done.stderr.splitlines()]  # every line is JSON
    assert [(d["logger"], d["level"], d["command"]) for d in docs] == [
        ("py.warnings", "WARNING", "spotjob-agent"),
        ("py.exceptions", "CRITICAL", "spotjob-agent"),
        ("py.exceptions", "CRITICAL", "spotjob-agent"),
    ], docs
    assert "DeprecationWarning: an old option" in docs[0]["message"] and not docs[0]["message"].endswith("\n")
    assert docs[1]["message"] == "uncaught ZeroDivisionError in thread notices-aws: division by zero"
    assert docs[1]["exception"].startswith("Traceback") and "in <lambda>" in docs[1]["exception"]
    assert docs[2]["message"] == "uncaught RuntimeError: the watch loop broke"
    assert docs[2]["exception"].endswith("RuntimeError: the watch loop broke")


@pytest.mark.parametrize(
    "command", [["-m", "orchestrator.k8s.main", "--no-leader-elect"], ["-m", "orchestrator.cli", "status"]]
)
def test_the_controller_and_spotjob_refuse_another_format_naming_the_variable(
    tmp_path: Path, command: list[str]
) -> None:
    done = subprocess.run(
        [sys.executable, *command], env=_env(tmp_path, SPOTJOB_LOG_FORMAT="xml"), cwd=tmp_path,
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2
    assert "SPOTJOB_LOG_FORMAT='xml': expected text or json" in done.stderr, done.stderr
