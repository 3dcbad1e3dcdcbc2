"""Helpers of the local-mode end-to-end tests (imported by tests/e2e/conftest.py and the tests).

- ``TRAIN`` / ``STEPS`` / ``NPROC``: examples/train.py (2 DDP ranks over gloo, every RNG stream
  drawn each step), short enough for a loaded 2-core machine; step pacing (``--step-sleep``)
  changes only how long a step takes, never the numbers.
- ``clean_env``: this environment without spotjob's or torchrun's own variables.
- ``run``: a subprocess to its end, its output captured; the timeout only stops a hung run.
- ``assert_same_final_state(prefix_a, prefix_b)``: every rank's dump equal, tensors with
  ``torch.equal`` (dtype, shape, every bit), everything else with ``==``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch
from ckpt_compare import differences  # tests/ckpt_compare.py, shared by every suite

REPO = Path(__file__).resolve().parents[3]
TRAIN = REPO / "examples" / "train.py"
STEPS = 60
NPROC = 2
BIN = Path(sys.executable).parent
HANG_GUARD_S = 420.0
"""Only stops a hung subprocess; nothing asserts how long anything took."""


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without spotjob's or torchrun's own variables, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SPOTJOB_", "TORCHELASTIC_"))}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.update(extra)
    return env


def tool(name: str) -> str:
    found = shutil.which(name, path=str(BIN))
    assert found, f"{name} is not installed next to {sys.executable}"
    return found


def run(argv: list[str], *, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=HANG_GUARD_S)
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
        raise AssertionError(f"{' '.join(argv)} hung:\n{out[-4000:]}\n{err[-8000:]}") from None


def assert_same_final_state(actual: Path, expected: Path) -> None:
    """Every rank's final model, optimizer, schedule, loader position and RNG draws are identical."""
    for rank in range(NPROC):
        got = torch.load(f"{actual}.rank{rank}.pt", weights_only=False)
        want = torch.load(f"{expected}.rank{rank}.pt", weights_only=False)
        assert set(want) == {"model", "optim", "sched", "loader", "rng"}
        assert want["loader"]["position"] == STEPS
        diffs = differences(got, want)
        assert not diffs, f"rank {rank}'s final state differs in {len(diffs)} place(s): {diffs[:10]}"
