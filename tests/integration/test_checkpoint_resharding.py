"""A checkpoint saved by 2 torchrun ranks restores on 2, 1 and 3 ranks.

Modules and optimizers come back bit-exact whatever the world size (DCP reshards them); per-rank
state follows the policy in ``agent.rank_state``: rank r < W gets rank r's objects and RNG
streams, a new rank gets rank 0's objects but keeps its own RNG, and the state of ranks that are
gone is dropped with a log line. A corrupt newer checkpoint found mid-load on some ranks is skipped
by all of them together.
"""

from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from agent.manifest import MANIFEST_NAME

sys.path.insert(0, str(Path(__file__).resolve().parent / "scripts"))
import ckpt_harness as harness
from ckpt_compare import assert_same
from ckpt_state import SAVE_STEP

pytestmark = pytest.mark.slow

JOB = harness.SCRIPTS / "ckpt_job.py"


def load_dumps(prefix: Path, world: int) -> list[dict[str, Any]]:
    return [torch.load(f"{prefix}.rank{r}.pt", weights_only=False) for r in range(world)]


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[dict[str, Any]]]:
    """(uri, per-rank dumps) of a 2-rank job that saved step 7 and restored it on the same ranks."""
    tmp = tmp_path_factory.mktemp("reshard")
    uri = str(tmp / "ckpt")
    harness.torchrun(2, JOB, "save-restore", "--uri", uri, "--dump", str(tmp / "save"))
    return uri, load_dumps(tmp / "save", 2)


def test_two_ranks_save_and_restore_their_own_state(saved: tuple[str, list[dict[str, Any]]]) -> None:
    _, dumps = saved
    # The job keeps its replicas identical, so the model and optimizer saved on each rank agree.
    assert_same(dumps[0]["saved"]["model"], dumps[1]["saved"]["model"], "the ranks' saved models")
    for rank, d in enumerate(dumps):
        assert d["step"] == SAVE_STEP
        assert_same(d["restored"], d["saved"], f"rank {rank}'s restored state")
        assert d["restored"]["counter"]["tag"] == f"rank-{rank}"
        assert_same(d["rng_after"], d["saved_rng"], f"rank {rank}'s RNG streams")


def with_a_corrupt_newer_checkpoint(uri: str, tmp_path: Path) -> str:
    """A copy of the store plus step 8: step 7's files with one byte of rank 1's shard flipped."""
    root = tmp_path / "ckpt"
    shutil.copytree(uri, root)
    newer = root / "step-000000008"
    shutil.copytree(root / f"step-{SAVE_STEP:09d}", newer)
    doc = json.loads((newer / MANIFEST_NAME).read_text())
    doc["step"] = 8
    (newer / MANIFEST_NAME).write_text(json.dumps(doc))
    harness.flip_byte(newer / "__1_0.distcp")
    return str(root)


@pytest.mark.parametrize("world", [1, 3])
def test_restores_on_a_different_world_size(
    saved: tuple[str, list[dict[str, Any]]], world: int, tmp_path: Path
) -> None:
    """...and skips a newer checkpoint that turns out corrupt while the ranks load it."""
    _, before = saved
    uri = with_a_corrupt_newer_checkpoint(saved[0], tmp_path)
    proc = harness.torchrun(world, JOB, "restore", "--uri", uri, "--dump", str(tmp_path / "restore"))
    assert re.search(r"skipping \S+/step-000000008: it is corrupt on rank \d: \S+/__1_0\.distcp", proc.stderr)
    dumps = load_dumps(tmp_path / "restore", world)
    for rank, d in enumerate(dumps):
        assert d["step"] == SAVE_STEP
        assert_same(d["restored"]["model"], before[0]["saved"]["model"], f"rank {rank}'s model")
        assert_same(d["restored"]["optim"], before[0]["saved"]["optim"], f"rank {rank}'s optimizer")
        source = rank if rank < 2 else 0
        assert_same(d["restored"]["counter"], before[source]["saved"]["counter"], f"rank {rank}'s counter")
        assert_same(d["restored"]["sched"], before[source]["saved"]["sched"], f"rank {rank}'s scheduler")
        if rank < 2:
            assert_same(d["rng_after"], before[rank]["saved_rng"], f"rank {rank}'s RNG streams")
        else:
            # A rank that did not exist keeps its own streams: copying rank 0's would duplicate them.
            assert_same(d["rng_after"], d["rng_before"], f"new rank {rank}'s RNG streams")
            assert "did not exist in the saved world of 2 ranks" in proc.stderr
    if world == 1:
        assert "per-rank state of 1 ranks that no longer exist was dropped" in proc.stderr
    else:
        assert "no longer exist" not in proc.stderr


def test_a_new_rank_takes_rank_0s_loader_place_but_keeps_its_own_generator(tmp_path: Path) -> None:
    """Saved on 1 rank, restored on 2: rank 1 did not exist, so its ResumableLoader takes rank 0's
    place (epoch, batches drawn) but not rank 0's generator state. Taken with it, both ranks' loaders
    drew the same shuffle (and the same worker seeds: the same augmentations) every epoch on."""
    script = harness.SCRIPTS / "loader_world.py"
    uri = str(tmp_path / "ckpt")
    harness.torchrun(1, script, "save", "--uri", uri)
    proc = harness.torchrun(2, script, "restore", "--uri", uri, "--dump", str(tmp_path / "restore"))
    zero, one = load_dumps(tmp_path / "restore", 2)
    assert zero["step"] == one["step"] == 3
    for d in (zero, one):
        assert (d["state"]["epoch"], d["state"]["seen"]) == (0, 4), "rank 0's place, and the batch after it"
    assert torch.equal(one["state"]["generator"], one["built"]), "rank 1 keeps the generator it was built with"
    assert not torch.equal(zero["state"]["generator"], one["state"]["generator"])
    assert not torch.equal(zero["first"], one["first"]), "the two ranks draw other batches"
    assert "ResumableLoaders' generators" in proc.stderr
