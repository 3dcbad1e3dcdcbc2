"""Bit-exact resume on every store: a 2-rank DDP job stopped and restored ends identical to one
never stopped — on a filesystem, S3 (moto) and GCS (fake-gcs-server), with sync and async saves.

examples/train.py draws from every RNG stream each step (dropout from torch's default generator,
Python's ``random``, NumPy's global generator), keeps a data loader position and an LR schedule;
``--dump`` writes each rank's final state. The stopped run saves every 8 steps and stops at step
13 without saving, so the resumed run restores step 8, recomputes steps 9-13 on its own and saves
twice more on the way. Anything spotjob did on a rank that drew from or reseeded a global stream
(a storage client choosing a multipart boundary in the save thread, say) would show here.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent / "scripts"))
import ckpt_harness as harness
from ckpt_compare import assert_same

pytestmark = pytest.mark.slow

TRAIN = harness.SCRIPTS / "train_no_teardown.py"  # examples/train.py, without the teardown after it
STEPS = 24
COMMON = ["--steps", str(STEPS), "--every-steps", "8", "--dim", "8", "--hidden", "16"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The run never stopped (filesystem store, synchronous saves), dumped for comparison."""
    tmp = tmp_path_factory.mktemp("uninterrupted")
    env = harness.job_env(SPOTJOB_ASYNC="0")
    harness.torchrun(2, TRAIN, *COMMON, "--uri", str(tmp / "ckpt"), "--dump", str(tmp / "whole"), env=env)
    return tmp / "whole"


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("scheme", ["file", "s3", "gs"])
def test_stopped_and_resumed_run_ends_bit_identical_to_an_uninterrupted_one(
    scheme: str, mode: str, uninterrupted: Path, fresh_uri: Callable[[str], str], tmp_path: Path
) -> None:
    uri = fresh_uri(scheme)  # the servers' addresses reach the ranks through the environment
    env = harness.job_env(SPOTJOB_ASYNC="1" if mode == "async" else "0")
    harness.torchrun(2, TRAIN, *COMMON, "--uri", uri, "--stop-after", "13", env=env)
    resumed = harness.torchrun(2, TRAIN, *COMMON, "--uri", uri, "--dump", str(tmp_path / "resumed"), env=env)
    assert "restored step 8 " in resumed.stderr
    assert f"starting at step 8 of {STEPS}" in resumed.stderr

    for rank in range(2):
        whole = torch.load(f"{uninterrupted}.rank{rank}.pt", weights_only=False)
        again = torch.load(tmp_path / f"resumed.rank{rank}.pt", weights_only=False)
        assert set(whole) == {"model", "optim", "sched", "loader", "rng"}
        assert whole["loader"]["position"] == STEPS
        assert_same(again, whole, f"rank {rank}'s final state")
