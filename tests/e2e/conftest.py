"""Fixtures of the local-mode end-to-end tests (helpers: scripts/local_run_support.py).

- ``uninterrupted`` (session): the job run once with plain torchrun, no checkpoints, no notices;
  its ``--dump`` prefix is what every preempted run must end bit-identical to.
- ``spotjob``: ``spotjob(*args, cwd=..., env=...)`` runs the real ``spotjob`` command line and
  returns its completed process (output captured).
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "scripts"))
from local_run_support import clean_env, run, tool, uninterrupted_dump


@pytest.fixture(scope="session")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The dump prefix of the job run start to finish with plain torchrun (no spotjob, no notices),
    shared with the other suite and the other workers of this session."""
    return uninterrupted_dump(tmp_path_factory)


@pytest.fixture
def spotjob() -> Callable[..., subprocess.CompletedProcess[str]]:
    """``spotjob(*args, cwd, env=None)``: the ``spotjob`` command line, run to its end."""

    def spotjob_cli(*args: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        return run([tool("spotjob"), *args], cwd=cwd, env=env or clean_env())

    return spotjob_cli
