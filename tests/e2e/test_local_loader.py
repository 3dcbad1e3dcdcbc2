"""A job whose data comes from a plain ``DataLoader`` through ``agent.ResumableLoader``, run by
``spotjob run`` as a user runs it: 2 DDP ranks, a shuffling ``DistributedSampler``, one worker a
rank whose random masks come from the seed each epoch's iterator draws, async saves every 5 steps.
Preempted mid-run, it resumes handing out the very batches a run never stopped hands out, masks
included, and ends bit-identical to it (tests/unit/test_resumable_loader.py breaks the wrapper one
way at a time; this is the whole path: the agents' flush, the Checkpointer's per-rank state, the
DataLoader's worker forked beside an async save, the restart)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent / "scripts"))
from ckpt_compare import differences

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

SCRIPT = Path(__file__).resolve().parent / "scripts" / "train_loader.py"
STEPS = 30  # 5 epochs of 6 batches a rank


def test_a_job_on_a_plain_dataloader_preempted_mid_run_hands_out_the_same_batches_and_ends_bit_identical(
    tmp_path: Path, spotjob: Callable[..., subprocess.CompletedProcess[str]]
) -> None:
    def run(name: str, *options: str) -> dict[str, object]:
        proc = spotjob(
            "run", "--name", name, "--nproc", "2", "--every-steps", "5", *options,
            str(SCRIPT), "--steps", str(STEPS), "--step-sleep", "0.1", "--dump", str(tmp_path / name),
            cwd=tmp_path,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-6000:]
        job = tmp_path / "spotjob-runs" / name / "local" / f"{name}.json"
        return dict(json.loads(job.read_text())["status"])

    whole = run("whole")
    assert (whole["phase"], whole["preemptions"]) == ("Succeeded", 0)
    preempted = run("preempted", "--preempt-at-step", "9")
    assert (preempted["phase"], preempted["preemptions"], preempted["restarts"]) == ("Succeeded", 1, 0)
    for rank in range(2):
        expected = torch.load(tmp_path / f"whole.rank{rank}.pt", weights_only=False)
        resumed = torch.load(tmp_path / f"preempted.rank{rank}.pt", weights_only=False)
        start = resumed["drawn_from"]
        assert expected["drawn_from"] == 0 and 9 <= start < STEPS, start
        assert resumed["loader"]["epoch"] == STEPS // 6 and resumed["loader"]["seen"] == 0
        # After the restart, the batches the whole run drew from that step on, bit for bit.
        assert len(resumed["drawn"]) == STEPS - start
        same = [torch.equal(a, b) for a, b in zip(expected["drawn"][start:], resumed["drawn"], strict=True)]
        assert all(same), f"rank {rank}: batches after step {start} differ at {same.index(False) + start}"
        diffs = differences(
            {k: resumed[k] for k in ("model", "optim", "loader")},
            {k: expected[k] for k in ("model", "optim", "loader")},
        )
        assert not diffs, f"rank {rank}: {diffs[:10]}"
