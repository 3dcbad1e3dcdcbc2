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
from local_run_support import NPROC, REPO, STEPS, TRAIN, clean_env, run, tool

from agent.ranks import free_port


@pytest.fixture(scope="session")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The dump prefix of the job run start to finish with plain torchrun (no spotjob, no notices)."""
    tmp = tmp_path_factory.mktemp("uninterrupted")
    argv = [
        tool("torchrun"), f"--nproc-per-node={NPROC}", "--nnodes=1", "--master-addr=127.0.0.1",
        f"--master-port={free_port()}", "--max-restarts=0",
        str(TRAIN), "--steps", str(STEPS), "--uri", str(tmp / "ckpt"), "--dump", str(tmp / "final"),
    ]  # fmt: skip
    proc = run(argv, cwd=REPO, env=clean_env())
    assert proc.returncode == 0, f"the uninterrupted run failed:\n{proc.stderr[-8000:]}"
    return tmp / "final"


@pytest.fixture
def spotjob() -> Callable[..., subprocess.CompletedProcess[str]]:
    """``spotjob(*args, cwd, env=None)``: the ``spotjob`` command line, run to its end."""

    def spotjob_cli(*args: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        return run([tool("spotjob"), *args], cwd=cwd, env=env or clean_env())

    return spotjob_cli
