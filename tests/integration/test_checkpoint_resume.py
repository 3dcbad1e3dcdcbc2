"""Bit-exact resume on every store: a 2-rank DDP job stopped and restored ends identical to one
never stopped — on a filesystem, S3 (moto) and GCS (fake-gcs-server), with sync and async saves.

examples/train.py draws from every RNG stream each step (dropout from torch's default generator,
Python's ``random``, NumPy's global generator), keeps a data loader position and an LR schedule;
``--dump`` writes each rank's final state. The stopped run saves every 8 steps and stops at step
13 without saving, so the resumed run restores step 8, recomputes steps 9-13 on its own and saves
twice more on the way. Anything spotjob did on a rank that drew from or reseeded a global stream
(a storage client choosing a multipart boundary in the save thread, say) would show here.

The runs share two torchruns (``scripts/train_cases.py``: train.py once per case, in one process
group): the uninterrupted run and the six stopped ones in the first, the six resumed ones in the
second; each case keeps its own URI, its own SPOTJOB_ASYNC, its own log lines and its own dump.
train.py seeds every stream at its start, so a case inherits nothing compared from the one
before it; a draw spotjob made only once per process (building the first S3 or GCS client, say)
still shows in the first case of that store, the sync one.
"""

from __future__ import annotations

import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent / "scripts"))
import ckpt_harness as harness
from ckpt_compare import assert_same
from train_cases import case_logs

pytestmark = pytest.mark.slow

TRAIN = harness.SCRIPTS / "train_cases.py"  # examples/train.py once per case, without the teardown after it
STEPS = 24
COMMON = ["--steps", str(STEPS), "--every-steps", "8", "--dim", "8", "--hidden", "16"]
CASES = [(scheme, mode) for scheme in ("file", "s3", "gs") for mode in ("sync", "async")]


def joined(cases: list[list[str]]) -> list[str]:
    """The cases' arguments, one after the other, cut by ``--then``."""
    argv: list[str] = []
    for case in cases:
        argv += [*(["--then"] if argv else []), *case]
    return argv


@pytest.fixture(scope="module")
def runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], Any]:
    """Every case's resumed log lines and dump prefix, and under ``"whole"`` the dump prefix of
    the run never stopped (filesystem store, synchronous saves). A fresh bucket (or folder) per case."""
    tmp = tmp_path_factory.mktemp("resume")
    uris: dict[tuple[str, str], str] = {}  # the servers' addresses reach the ranks through the environment
    for scheme, mode in CASES:
        if scheme == "file":
            uris[scheme, mode] = str(tmp / f"ckpt-{mode}")
            continue
        bucket = f"spotjob-{uuid.uuid4().hex[:12]}"
        if scheme == "s3":
            request.getfixturevalue("s3_client").create_bucket(Bucket=bucket)
        else:
            request.getfixturevalue("gcs_client").create_bucket(bucket)
        uris[scheme, mode] = f"{scheme}://{bucket}/jobs/run1"

    def args(case: tuple[str, str], *more: str) -> list[str]:
        return ["--async", "1" if case[1] == "async" else "0", *COMMON, "--uri", uris[case], *more]

    env = harness.job_env()
    whole = ["--async", "0", *COMMON, "--uri", str(tmp / "ckpt-whole"), "--dump", str(tmp / "whole")]
    stopped = [args(case, "--stop-after", "13") for case in CASES]
    harness.torchrun(2, TRAIN, *joined([whole, *stopped]), env=env)
    resumed = [args(case, "--dump", str(tmp / f"resumed-{case[0]}-{case[1]}")) for case in CASES]
    logs = case_logs(harness.torchrun(2, TRAIN, *joined(resumed), env=env).stderr)
    out: dict[Any, Any] = {"whole": tmp / "whole"}
    for number, case in enumerate(CASES):
        out[case] = (logs.get(number, ""), tmp / f"resumed-{case[0]}-{case[1]}")
    return out


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("scheme", ["file", "s3", "gs"])
def test_stopped_and_resumed_run_ends_bit_identical_to_an_uninterrupted_one(
    scheme: str, mode: str, runs: dict[Any, Any]
) -> None:
    log, resumed = runs[scheme, mode]
    assert "restored step 8 " in log, log
    assert f"starting at step 8 of {STEPS}" in log, log

    uninterrupted = runs["whole"]
    for rank in range(2):
        whole = torch.load(f"{uninterrupted}.rank{rank}.pt", weights_only=False)
        again = torch.load(f"{resumed}.rank{rank}.pt", weights_only=False)
        assert set(whole) == {"model", "optim", "sched", "loader", "rng"}
        assert whole["loader"]["position"] == STEPS
        assert_same(again, whole, f"rank {rank}'s final state")
