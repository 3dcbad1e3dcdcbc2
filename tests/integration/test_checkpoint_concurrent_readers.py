"""Readers of a checkpoint URI (an eval job's Checkpointer, ``spotjob ckpt ...``) while the job that
owns it keeps saving and retention removes old checkpoints: the reader never breaks the writer,
and never passes off a checkpoint deleted under it as broken, nor fails on it with a bare error.

Each race is made to happen at a chosen point by a hook; nothing waits on time.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Any

from collections.abc import Callable

import pytest

import agent.checkpoint._restore as restore_module
import agent.checkpoint._save as save_module
from agent._dcp import VerifiedReader
from agent.catalog import list_checkpoints
from agent.checkpoint import Checkpointer, RestoreRefusedError
from agent.storage import open_storage

sys.path.insert(0, str(Path(__file__).resolve().parent / "scripts"))
from ckpt_compare import assert_same
from ckpt_state import make_state, snapshot, train


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


@pytest.mark.parametrize("scheme", ["file", "s3"])
def test_a_restore_whose_checkpoint_retention_deletes_under_it_restores_the_newer_one(
    fresh_uri: Callable[[str], str], monkeypatch: pytest.MonkeyPatch, scheme: str
) -> None:
    """An eval script (or a new attempt) restores while the job saves on with keep=1: the checkpoint
    it picked is deleted as it reads it. It restores the newer one, never calls the store
    unavailable (file store: a bare FileNotFoundError) nor the checkpoint missing a file."""
    uri = fresh_uri(scheme)
    state = make_state(0)
    train(state, 1)
    writer = Checkpointer(uri, every_steps=1, keep=1, job="train", async_save=False)
    writer.save(1, state)
    saved: dict[int, Any] = {}
    real_ensure_local = VerifiedReader.ensure_local

    def ensure_local_as_the_writer_saves_on(self: VerifiedReader, path: str) -> str:
        if not saved:  # the reader picked step 1 and is about to read its first file
            train(state, 1, start=1)
            writer.save(2, state)  # keep=1: retention removes step 1
            saved[2] = snapshot(state)
        return real_ensure_local(self, path)

    monkeypatch.setattr(restore_module.VerifiedReader, "ensure_local", ensure_local_as_the_writer_saves_on)
    reader_state = make_state(0, seed=7)
    with Checkpointer(uri, keep=None, job="train", async_save=False) as reader:
        assert reader.restore(reader_state) == 2
    writer.close()
    assert_same(snapshot(reader_state), saved[2])


def test_a_restore_whose_only_checkpoint_vanishes_refuses_and_never_starts_from_step_0(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The checkpoint the restore picked is gone when it reads it, and nothing newer came (deleted by
    hand, say): it refuses, naming what happened, rather than start from step 0."""
    root = tmp_path / "ckpt"
    state = make_state(0)
    train(state, 1)
    with Checkpointer(str(root), every_steps=1, keep=None, job="train", async_save=False) as writer:
        writer.save(1, state)
    real_ensure_local = VerifiedReader.ensure_local

    def ensure_local_of_a_deleted_checkpoint(self: VerifiedReader, path: str) -> str:
        folder = root / self.folder
        (folder / "MANIFEST.json").unlink()  # as retention deletes: the manifest first, then the rest
        shutil.rmtree(folder)
        return real_ensure_local(self, path)

    monkeypatch.setattr(restore_module.VerifiedReader, "ensure_local", ensure_local_of_a_deleted_checkpoint)
    with Checkpointer(str(root), keep=None, job="train", async_save=False) as reader:
        with pytest.raises(RestoreRefusedError, match="deleted while it was read"):
            reader.restore(make_state(0, seed=7))
