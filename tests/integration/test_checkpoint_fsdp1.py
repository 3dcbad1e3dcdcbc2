"""FSDP1 (``FullyShardedDataParallel``) modules on two torchrun ranks over gloo: a run stopped
between saves and restored ends identical to one never stopped (each rank's shard of the
parameters and of the optimizer state, the lr its param_groups hold, the batches it trained on),
with ``use_orig_params`` True and False, async and sync saves, on a filesystem and S3 (moto).

Before, both failed: an async save (the default) failed in DCP's stager ("'data_ptr' ... not
supported for ShardedTensor!"), and a sync save committed checkpoints that no restore could load
("Missing key in checkpoint state_dict: optim.param_groups": a rank holding no shard of a
parameter lacks its name, and DCP's planner then took the checkpoint for one of torch 2.3's).
``tagged`` stages its async saves through DCP's stager, the others through spotjob's plain path.

A checkpoint of 2 ranks restored on 1 and on 3 (``ckpt_fsdp1_reshard.py``) comes back exact and
goes on as the uninterrupted run does, parameters and AdamW state resharded.
"""

from __future__ import annotations

import shutil
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent / "scripts"))
import ckpt_harness as harness
from ckpt_compare import assert_same

pytestmark = pytest.mark.slow

SCRIPT = harness.SCRIPTS / "ckpt_fsdp1.py"
RESHARD = harness.SCRIPTS / "ckpt_fsdp1_reshard.py"
# case: (whole run it must end like, arguments besides --uri and --dump)
CASES = {
    "orig-async": ("orig", []),
    "orig-sync": ("orig", ["--sync"]),
    "flat-async": ("flat", ["--flat"]),
    "flat-sync": ("flat", ["--flat", "--sync"]),
    "tagged-async": ("orig", ["--tagged"]),
    "s3-async": ("orig", []),
}


def joined(cases: list[list[str]]) -> list[str]:
    argv: list[str] = []
    for case in cases:
        argv += [*(["--then"] if argv else []), *case]
    return argv


def dumped(prefix: Path) -> list[dict[str, Any]]:
    """Each rank's dump of one run; a run that raised left its traceback instead."""
    ranks = [torch.load(f"{prefix}.rank{r}.pt", weights_only=False) for r in range(2)]
    for rank, out in enumerate(ranks):
        assert "error" not in out, f"rank {rank} failed:\n{out['error']}"
    return ranks


@pytest.fixture(scope="module")
def runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two torchruns: the whole runs (never stopped, saving as they go) and every case's run
    stopped after step 7 (its last checkpoint is step 6's) in the first; the resumed runs in the
    second. Each case has its own URI; the S3 one a fresh bucket on moto."""
    tmp = tmp_path_factory.mktemp("fsdp1")
    uris = {case: str(tmp / f"ckpt-{case}") for case in CASES}
    request.getfixturevalue("moto_server")
    bucket = f"spotjob-{uuid.uuid4().hex[:12]}"
    request.getfixturevalue("s3_client").create_bucket(Bucket=bucket)
    uris["s3-async"] = f"s3://{bucket}/jobs/run1"
    whole = [
        ["--uri", str(tmp / "ckpt-whole-orig"), "--dump", str(tmp / "whole-orig")],
        ["--flat", "--uri", str(tmp / "ckpt-whole-flat"), "--dump", str(tmp / "whole-flat")],
    ]
    stopped = [
        [*more, "--uri", uris[c], "--dump", str(tmp / f"stopped-{c}"), "--stop", "7"] for c, (_, more) in CASES.items()
    ]
    resumed = [[*more, "--uri", uris[c], "--dump", str(tmp / f"resumed-{c}")] for c, (_, more) in CASES.items()]
    harness.torchrun(2, SCRIPT, *joined([*whole, *stopped]), env=harness.job_env())
    harness.torchrun(2, SCRIPT, *joined(resumed), env=harness.job_env())
    return tmp


@pytest.mark.parametrize("case", list(CASES))
def test_a_run_stopped_and_restored_ends_as_one_never_stopped(runs: Path, case: str) -> None:
    whole = dumped(runs / f"whole-{CASES[case][0]}")
    stopped = dumped(runs / f"stopped-{case}")
    for rank, (never, resumed) in enumerate(zip(whole, dumped(runs / f"resumed-{case}"), strict=True)):
        assert never["start"] == 0 and stopped[rank]["start"] == 0
        assert resumed["start"] == 6, f"rank {rank} did not restore step 6's checkpoint"
        assert stopped[rank]["log"] == never["log"][:7]
        assert resumed["log"] == never["log"][6:], f"rank {rank} trained on other batches or losses"
        assert resumed["optim"]["state"], "no optimizer state"
        assert_same(resumed["params"], never["params"], f"rank {rank}'s parameters")
        assert_same(resumed["optim"], never["optim"], f"rank {rank}'s optimizer state and param_groups")


@pytest.fixture(scope="module")
def resharded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two ranks: each layout's whole run to step 9 and its run stopped at step 6 (its last
    checkpoint, written asynchronously); then copies of the stopped runs' checkpoints restored
    and trained on to step 9 on 1 rank and on 3."""
    tmp = tmp_path_factory.mktemp("fsdp1-reshard")
    layouts = {"orig": [], "flat": ["--flat"]}
    first = [
        [*more, "--uri", str(tmp / f"ckpt-{run}-{layout}"), "--dump", str(tmp / f"{run}-{layout}"), "--until", until]
        for layout, more in layouts.items()
        for run, until in (("whole", "9"), ("stopped", "6"))
    ]
    harness.torchrun(2, RESHARD, *joined(first), env=harness.job_env())
    for ranks in (1, 3):
        for layout in layouts:
            shutil.copytree(tmp / f"ckpt-stopped-{layout}", tmp / f"ckpt-{ranks}-{layout}")
        cases = [
            [
                *more,
                "--uri",
                str(tmp / f"ckpt-{ranks}-{layout}"),
                "--dump",
                str(tmp / f"on{ranks}-{layout}"),
                "--until",
                "9",
            ]
            for layout, more in layouts.items()
        ]
        harness.torchrun(ranks, RESHARD, *joined(cases), env=harness.job_env())
    return tmp


@pytest.mark.parametrize("ranks", [1, 3])
@pytest.mark.parametrize("layout", ["orig", "flat"])
def test_a_checkpoint_of_two_ranks_restores_on_another_number_and_goes_on_as_the_whole_run(
    resharded: Path, layout: str, ranks: int
) -> None:
    """Every rank trains on the same batches, so the run is the same on any number of ranks; a
    restore that lost or misplaced the AdamW state goes on differently from the whole run."""
    runs = {}
    for run in ("whole", "stopped", f"on{ranks}"):
        runs[run] = torch.load(resharded / f"{run}-{layout}.pt", weights_only=False)
        assert "error" not in runs[run], f"{run} failed:\n{runs[run]['error']}"
    whole, stopped, resumed = runs["whole"], runs["stopped"], runs[f"on{ranks}"]
    assert resumed["start"] == 6, "did not restore step 6's checkpoint"
    assert_same(resumed["restored"], stopped["end"], f"the parameters restored on {ranks} rank(s)")
    assert resumed["losses"] == pytest.approx(whole["losses"][6:], rel=1e-5)
    for got, want in zip(resumed["end"], whole["end"], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
