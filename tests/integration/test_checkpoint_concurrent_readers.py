"""Readers of a checkpoint URI (an eval job's Checkpointer, ``spotjob ckpt ...``) while the job that
owns it keeps saving and retention removes old checkpoints: the reader never breaks the writer,
and never passes off a checkpoint deleted under it as broken, nor fails on it with a bare error.

Each race is made to happen at a chosen point by a hook; nothing waits on time.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

import agent.checkpoint._save as save_module
from agent.catalog import list_checkpoints
from agent.checkpoint import Checkpointer
from agent.storage import open_storage

sys.path.insert(0, str(Path(__file__).resolve().parent / "scripts"))
from ckpt_state import make_state, train


@pytest.mark.parametrize("async_save", [False, True])
def test_a_second_checkpointer_on_the_uri_does_not_remove_a_save_in_flight(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, async_save: bool
) -> None:
    """A second Checkpointer of the job (an eval script reading its checkpoints, a new attempt) made
    while the job writes a save: on a filesystem URI both stage in ``<uri>/.spotjob-staging``, and cleaning stale staged saves at construction
    removed the one in flight, failing it."""
    root = tmp_path / "ckpt"
    state = make_state(0)
    train(state, 1)
    others: list[Checkpointer] = []
    real_sync_files = save_module.sync_files

    def sync_files_with_a_reader_arriving(*args: Any, **kwargs: Any) -> Any:
        if not others:  # the save's files are written in its staging folder, not yet committed
            others.append(Checkpointer(str(root), keep=None, job="train", async_save=False))
        return real_sync_files(*args, **kwargs)

    monkeypatch.setattr(save_module, "sync_files", sync_files_with_a_reader_arriving)
    with Checkpointer(str(root), every_steps=1, keep=1, job="train", async_save=async_save) as ckpt:
        ckpt.save(1, state)
        ckpt.wait()
    assert others, "the hook did not run"
    others[0].close()
    found = list_checkpoints(open_storage(str(root)))
    assert [(s.ref.folder, s.valid) for s in found] == [("step-000000001", True)]


def test_a_stale_staging_folder_is_still_removed(tmp_path: Path) -> None:
    """What the lock must not stop: a folder left by a save that was killed goes at construction."""
    root = tmp_path / "ckpt"
    stale = root / ".spotjob-staging" / "step-000000003-deadbeef" / "rank-0"
    stale.mkdir(parents=True)
    (stale / "__0_0.distcp").write_bytes(b"partial")
    Checkpointer(str(root), keep=None, job="eval", async_save=False).close()
    assert not stale.parent.exists()
