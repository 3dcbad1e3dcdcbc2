"""What a job's log says about its checkpoints: each commit once, with its step, duration and size
(the size its manifest records); each restore once per node, with its step, duration and size; a
first start says that there was nothing to restore. A 2-rank job on one node, filesystem store.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "scripts"))
import ckpt_harness as harness

from agent.catalog import CheckpointRef, find_checkpoints
from agent.checkpoint._core import size_text
from agent.manifest import MANIFEST_NAME, Manifest
from agent.storage import open_storage

TRAIN = harness.SCRIPTS / "train_no_teardown.py"  # examples/train.py, without the teardown after it
COMMON = ["--steps", "12", "--every-steps", "4", "--dim", "8", "--hidden", "16"]
COMMIT = re.compile(r"committed step (\d+) at (\S+) in [\d.]+s \(([^)]*) in (\d+) files\)")
RESTORE = re.compile(r"restored step (\d+) from (\S+) in [\d.]+s \(([^;]*) in (\d+) files; saved by 2 ranks")


def _manifest(uri: str, step: int) -> Manifest:
    storage = open_storage(uri)
    [ref] = [r for r in find_checkpoints(storage) if r.step == step]
    assert isinstance(ref, CheckpointRef)
    return Manifest.parse(storage.get_bytes(ref.key(MANIFEST_NAME)))


def test_each_commit_and_restore_is_logged_once_with_its_step_duration_and_size(tmp_path: Path) -> None:
    uri = str(tmp_path / "ckpt")
    env = harness.job_env(SPOTJOB_ASYNC="0")

    first = harness.torchrun(2, TRAIN, *COMMON, "--uri", uri, "--stop-after", "9", env=env)
    commits = COMMIT.findall(first.stderr)
    assert [int(step) for step, *_ in commits] == [4, 8], first.stderr
    for step, _, size, files in commits:
        manifest = _manifest(uri, int(step))
        assert (size, int(files)) == (size_text(manifest.total_bytes), len(manifest.files))
    assert re.search(r"restore: no checkpoint yet under \S+; starting from step 0", first.stderr), first.stderr
    assert "restored step" not in first.stderr

    resumed = harness.torchrun(2, TRAIN, *COMMON, "--uri", uri, env=env)
    restores = RESTORE.findall(resumed.stderr)
    assert len(restores) == 1, resumed.stderr  # one node: one line, not one per rank
    step, _, size, files = restores[0]
    manifest = _manifest(uri, 8)
    assert (int(step), size, int(files)) == (8, size_text(manifest.total_bytes), len(manifest.files))
