"""Bit-exact resume: a 2-rank DDP job stopped and restored ends identical to one never stopped.

examples/train.py draws from every RNG stream each step (dropout, Python, NumPy), keeps a data
loader position and an LR schedule; ``--dump`` writes each rank's final state. The stopped run
saves every 10 steps and stops at step 37 without saving, so the resumed run restores step 30 and
recomputes steps 31-37 on its own.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent / "scripts"))
import ckpt_harness as harness
from ckpt_compare import assert_same

pytestmark = pytest.mark.slow

TRAIN = harness.REPO / "examples" / "train.py"
STEPS = 60  # crosses the StepLR boundary at 50


def test_stopped_and_resumed_run_ends_bit_identical_to_an_uninterrupted_one(tmp_path: Path) -> None:
    common = ["--steps", str(STEPS), "--every-steps", "10"]
    harness.torchrun(2, TRAIN, *common, "--uri", str(tmp_path / "whole"), "--dump", str(tmp_path / "whole"))
    stopped = str(tmp_path / "stopped")
    harness.torchrun(2, TRAIN, *common, "--uri", stopped, "--stop-after", "37")
    resumed = harness.torchrun(2, TRAIN, *common, "--uri", stopped, "--dump", str(tmp_path / "resumed"))
    assert "restored step 30 " in resumed.stderr
    assert "starting at step 30 of 60" in resumed.stderr

    for rank in range(2):
        whole = torch.load(tmp_path / f"whole.rank{rank}.pt", weights_only=False)
        again = torch.load(tmp_path / f"resumed.rank{rank}.pt", weights_only=False)
        assert set(whole) == {"model", "optim", "sched", "loader", "rng"}
        assert whole["loader"]["position"] == STEPS
        assert whole["sched"]["last_epoch"] == STEPS
        assert_same(again, whole, f"rank {rank}'s final state")
