"""Why a local worker failed, read from its log: the line that says it, and the log's path.

The logs below are shaped like real ones (spotjob-agent's lines, a rank's output with torchrun's
``[rankN]:`` prefix, torchrun's own report of the failure after it), with the OS's own wording of
each error (``os.strerror``).
"""

from __future__ import annotations

import errno
import http.server
import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest

from agent.control_channel import AGENT_FILE
from orchestrator.backends.base import BackendError
from orchestrator.backends.local import LocalBackend
from orchestrator.backends.local_failure import failure_cause, failure_detail, log_excerpt
from orchestrator.backends.local_launch import LocalOptions
from orchestrator.backends.local_worker import LocalWorker, observe_worker, post_to_agent
from orchestrator.model import JobKey

AGENT = "2026-12-01T16:34:06.223Z INFO spotjob-agent[14303] job=local/x agent.launcher: started torchrun ..."
AGENT_EXIT = "2026-12-01T16:34:12.838Z WARNING spotjob-agent[14303] job=local/x agent.launcher: exiting 1: ..."
TORCHRUN_REPORT = """\
E1201 16:34:12.462000 14306 torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: 1) local_rank: 0
Traceback (most recent call last):
  File "/venv/bin/torchrun", line 6, in <module>
    sys.exit(main())
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
train.py FAILED
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  exitcode  : 1 (pid: 14324)
  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html
============================================================"""


def write_log(tmp_path: Path, rank_output: str) -> str:
    path = tmp_path / "x-0-0.log"
    path.write_text("\n".join(["# spotjob-agent ... -- torchrun ...", AGENT, rank_output, TORCHRUN_REPORT, AGENT_EXIT]))
    return str(path)


CASES = {
    "a usage error of the script": (
        "usage: train.py [-h] [--steps STEPS]\ntrain.py: error: unrecognized arguments: --bogus",
        "train.py: error: unrecognized arguments: --bogus",
    ),
    "a full disk, not the exception it caused": (
        f"[rank0]: OSError: [Errno {errno.ENOSPC}] {os.strerror(errno.ENOSPC)}: "
        "'/ckpt/.spotjob-staging/rank-00000.pt'\n"
        "[rank0]: During handling of the above exception, another exception occurred:\n"
        "[rank0]: RuntimeError: [enforce fail at inline_container.cc:664] . unexpected pos 704 vs 598",
        f"OSError: [Errno {errno.ENOSPC}] No space left on device: '/ckpt/.spotjob-staging/rank-00000.pt'",
    ),
    "a read-only filesystem": (
        f"[rank1]: OSError: [Errno {errno.EROFS}] {os.strerror(errno.EROFS)}: '/data/out.bin'",
        f"OSError: [Errno {errno.EROFS}] Read-only file system: '/data/out.bin'",
    ),
    "an exception of the script": (
        '[rank0]:   File "train.py", line 110, in main\n[rank0]: RuntimeError: injected crash at step 12',
        "RuntimeError: injected crash at step 12",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_cause_is_the_line_that_says_why_the_script_failed(tmp_path: Path, case: str) -> None:
    output, cause = CASES[case]
    log = write_log(tmp_path, output)

    assert failure_cause(log) == cause
    assert failure_detail(log) == f"{cause} (log: {log})"


def test_a_long_line_is_cut_but_keeps_what_it_says_about_the_disk(tmp_path: Path) -> None:
    frames = ", ".join(f"<FrameSummary file /venv/torch/x{i}.py, line {i}>" for i in range(40))
    line = (
        "agent.checkpoint.SaveFailedError: checkpoint of step 2 failed: rank 0: writing the shards failed: "
        f"CheckpointException('write', {{0: ({frames}, OSError(28, 'No space left on device'))}})"
    )

    cause = failure_cause(write_log(tmp_path, line))

    assert cause is not None and len(cause) < 320
    assert cause.startswith("agent.checkpoint.SaveFailedError: checkpoint of step 2 failed")
    assert "No space left on device" in cause


def test_without_a_telling_line_the_detail_quotes_the_last_line_the_script_wrote(tmp_path: Path) -> None:
    log = write_log(tmp_path, "step 10 loss 0.1\nstep 20 loss 0.05")

    assert failure_cause(log) is None
    assert failure_detail(log) == f"its log ends: step 20 loss 0.05 (log: {log})"
    excerpt = log_excerpt(log)
    assert excerpt == ["step 10 loss 0.1", "step 20 loss 0.05"], "the agent's and torchrun's lines are not the script's"


def test_a_missing_log_is_said_so(tmp_path: Path) -> None:
    log = str(tmp_path / "gone.log")
    assert failure_detail(log) == f"its log says nothing (log: {log})"


def test_the_agents_json_log_lines_are_not_taken_for_the_scripts(tmp_path: Path) -> None:
    """With ``SPOTJOB_LOG_FORMAT=json`` the agent's lines are JSON objects: its last line was taken
    for the last thing the script wrote."""
    agent = '{"time": "2026-12-04T16:34:12.838Z", "level": "WARNING", "logger": "agent.launcher", '
    path = tmp_path / "x-0-0.log"
    path.write_text(
        "\n".join(
            [
                agent + '"message": "started torchrun", "command": "spotjob-agent", "pid": 14303}',
                "step 10 loss 0.1",
                agent + '"message": "exiting 1: the command failed", "command": "spotjob-agent", "pid": 14303}',
            ]
        )
    )
    assert log_excerpt(str(path)) == ["step 10 loss 0.1"]


def test_a_rank_killed_by_sigkill_is_named_once_with_what_may_have_sent_it(tmp_path: Path) -> None:
    """The reason said "rank 1 (pid 28670) was killed by SIGKILL: SIGKILL: out of memory? ...": the
    hint repeated the signal the line before it had just named (found by the chaos soak)."""
    line = (
        "spotjob-agent launcher: rank 1 (pid 28670) was killed by SIGKILL (exit 137: SIGKILL is what the "
        "kernel's OOM killer sends ...): stopping the other 1 rank(s)"
    )

    cause = failure_cause(write_log(tmp_path, line))

    assert cause == (
        "rank 1 (pid 28670) was killed by SIGKILL: out of memory? "
        "(the kernel's OOM killer sends SIGKILL; see README 'Staging memory')"
    )


def test_a_worker_whose_agent_itself_was_killed_says_so_before_the_scripts_last_line(tmp_path: Path) -> None:
    """A worker whose spotjob-agent was SIGKILLed (by hand, or by the OOM killer) failed with "its log
    ends: <the script's last retention line>", as if that line said why (found by the chaos soak,
    which SIGKILLed the agent of a `spotjob run` worker). Its own exit is a signal, which nothing in
    the log can tell: the reason now names it first. The backend's own observation of a real
    process ended by SIGKILL."""
    log = tmp_path / "x-0-0.log"
    log.write_text(f"{AGENT}\nrank0 agent.checkpoint: committed step 8 at file:///ckpt/step-000000008\n")
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    proc.kill()
    proc.wait()
    node = SimpleNamespace(name="local-node-0", zone="local-a", instance_type="local.cpu-small")
    worker = LocalWorker(
        "x-0-0", JobKey.local("x"), 0, 0, cast(Any, node), proc, str(tmp_path / "control"), str(log), ""
    )
    seen = observe_worker(worker)

    assert seen.exit_code == 137
    assert seen.detail == (
        "spotjob-agent itself was killed by SIGKILL (by hand, or by the kernel's OOM killer when the machine "
        "ran out of memory); its log ends: rank0 agent.checkpoint: committed step 8 at "
        f"file:///ckpt/step-000000008 (log: {log})"
    )


def test_a_worker_whose_agent_exited_by_itself_is_not_said_to_be_killed(tmp_path: Path) -> None:
    """The other side of the test above: an agent that exited with a code of its own (here 1, its
    command's failure) keeps the reason its log gives. Pins behaviour that already worked."""
    log = write_log(tmp_path, '[rank0]:   File "train.py", line 110, in main\n[rank0]: RuntimeError: boom')
    proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(1)"])
    proc.wait()
    node = SimpleNamespace(name="local-node-0", zone="local-a", instance_type="local.cpu-small")
    worker = LocalWorker("x-0-0", JobKey.local("x"), 0, 0, cast(Any, node), proc, str(tmp_path / "c"), log, "")
    seen = observe_worker(worker)

    assert seen.exit_code == 1
    assert seen.detail == f"RuntimeError: boom (log: {log})"


def test_a_command_its_agent_stopped_on_a_signal_it_does_not_take_as_a_notice_says_so(tmp_path: Path) -> None:
    """The chaos soak SIGTERMed a `spotjob run` worker's agent (which hears only its cloud's notices):
    the failure read "exited with code 143; ... its log ends: <the script's last retention line>"."""
    log = tmp_path / "x-0-0.log"
    log.write_text(
        "\n".join(
            [
                AGENT,
                "2026-12-05 19:38:41,767 rank0 agent.checkpoint: retention: removed file:///c/step-000000056",
                "2026-12-05T19:38:42.255Z WARNING spotjob-agent[9622] job=local/x agent.launcher: exiting 143: the "
                "command exited 143; spotjob-agent stopped the command without a flush on SIGTERM, which it does "
                "not take as a notice (its --notices leave out sigterm, or --no-sigterm)",
            ]
        )
    )

    assert failure_cause(str(log)) == (
        "spotjob-agent stopped the command without a flush on SIGTERM, which it does not take as a notice "
        "(its --notices leave out sigterm, or --no-sigterm)"
    )


@pytest.mark.parametrize("kind", ["text", "json"])
def test_an_agent_that_exited_76_or_74_says_why_in_its_own_exit_line(tmp_path: Path, kind: str) -> None:
    """A local worker whose agent exited 76 (its flush committed nothing) or 74 had no detail: the
    AgentFlushFailed and FlushFailed messages said only "committed nothing", and WorkerInfraError a
    list of what it could be. The detail is now the agent's own exit line from its log, text or
    JSON; a line of the script's that happens to say "exiting 76:" is not the agent's."""
    why = "exiting 76: the flush committed no checkpoint: the command ended before its ranks reported one"
    if kind == "json":
        exit_line = json.dumps({"level": "WARNING", "message": why, "command": "spotjob-agent", "pid": 9622})
    else:
        exit_line = f"2026-12-05T19:38:42.255Z WARNING spotjob-agent[9622] job=local/x agent.launcher: {why}"
    log = tmp_path / "x-0-0.log"
    log.write_text("\n".join([AGENT, "[rank0]: my script: exiting 76: not the agent", exit_line]) + "\n")
    node = cast(Any, SimpleNamespace(name="local-node-0", zone="local-a", instance_type="local.cpu-small"))

    def exited(index: int, code: int) -> LocalWorker:
        proc = subprocess.Popen([sys.executable, "-c", f"raise SystemExit({code})"])
        proc.wait()
        return LocalWorker(f"x-0-{index}", JobKey.local("x"), 0, index, node, proc, str(tmp_path / "c"), str(log), "")

    seen = observe_worker(exited(0, 76))
    assert seen.exit_code == 76
    assert seen.detail == f"{why} (log: {log})"
    log.write_text(f"{AGENT}\n[rank0]: exiting 74: the script's own words\n")  # no agent exit line
    assert observe_worker(exited(1, 74)).detail is None


def test_the_runs_token_goes_only_to_an_agent_on_loopback(tmp_path: Path) -> None:
    """``spotjob run`` posted its token to whatever ``url`` a worker's ``agent.json`` named (found
    by the security walk): a file in the run folder could send it to another address. Here a server
    listening on every address stands for one that is not the agent's loopback API; before the
    fix it received the token."""
    heard: list[str | None] = []

    class Listen(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            heard.append(self.headers.get("Authorization"))
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"{}")

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("0.0.0.0", 0), Listen)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    control = tmp_path / "c"
    control.mkdir()
    node = cast(Any, SimpleNamespace(name="local-node-0", zone="local-a", instance_type="local.cpu-small"))
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    try:
        with LocalBackend(LocalOptions(root=str(tmp_path / "run"))) as backend:
            worker = LocalWorker("x-0-0", JobKey.local("x"), 0, 0, node, proc, str(control), str(tmp_path / "l"), "")
            for url in (f"http://0.0.0.0:{server.server_port}", "file:///etc/hostname", 7):
                (control / AGENT_FILE).write_text(json.dumps({"url": url}))
                with pytest.raises(BackendError, match="names no loopback control API"):
                    post_to_agent(worker, backend._token, "/save", {"id": "r1", "reason": "test"})
    finally:
        server.shutdown()
        server.server_close()
    assert heard == []
