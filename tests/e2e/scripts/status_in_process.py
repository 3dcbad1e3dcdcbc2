"""``spotjob status`` run by the command line's own parser and command in the test's process.

For tests that read what ``spotjob status`` prints about a run, not how its process ends: a fresh
Python for each call cost about 0.6 CPU-s. The paths resolve against the test's working folder, as
the command's would against the shell's: chdir to the folder the run was started from first.
"""

from __future__ import annotations

import subprocess

import pytest

from orchestrator.cli import build_parser


def spotjob_status(capsys: pytest.CaptureFixture[str], *args: str) -> subprocess.CompletedProcess[str]:
    """``spotjob status ARGS``: its exit status, what it printed and what it wrote to stderr."""
    capsys.readouterr()  # only what this command prints
    parsed = build_parser().parse_args(["status", *args])
    code = parsed.func(parsed)
    out = capsys.readouterr()
    return subprocess.CompletedProcess(["spotjob", "status", *args], code, out.out, out.err)
