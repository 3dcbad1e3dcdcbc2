"""What ``pip install spotjob`` puts on a machine: the console scripts and their ``--version``, and
the wheel's files. The wheel is built from the sources Dockerfile.controller copies (pyproject.toml,
README.md, agent/, orchestrator/), so a file the package needs at run time but that the image
leaves out fails here too."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
import zipfile
from importlib.metadata import version
from pathlib import Path

import pytest
from infra_support import REPO

PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
SCRIPTS: dict[str, str] = PROJECT["scripts"]
# What each script calls itself in its usage line (kubectl runs kubectl-spotjob as `kubectl spotjob`).
PROGS = {"kubectl-spotjob": "kubectl spotjob"}


def _run_script(name: str, *args: str) -> subprocess.CompletedProcess[str]:
    """The console script's entry point, as the installed wrapper calls it, on this checkout."""
    module, _, func = SCRIPTS[name].partition(":")
    code = f"import sys; from {module} import {func} as f; sys.argv = [{name!r}, *sys.argv[1:]]; sys.exit(f())"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env, timeout=60)


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_every_console_script_prints_the_package_version(name: str) -> None:
    done = _run_script(name, "--version")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"{PROGS.get(name, name)} {PROJECT['version']}"
    assert version("spotjob") == PROJECT["version"], "the installed metadata is stale: reinstall (make venv)"
