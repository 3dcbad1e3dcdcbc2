"""Why a local worker failed, read from its log: the line that says it, and the log's path.

The logs below are shaped like real ones (spotjob-agent's lines, a rank's output with torchrun's
``[rankN]:`` prefix, torchrun's own report of the failure after it), with the OS's own wording of
each error (``os.strerror``).
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from orchestrator.backends.local import failure_cause, failure_detail, log_excerpt

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
