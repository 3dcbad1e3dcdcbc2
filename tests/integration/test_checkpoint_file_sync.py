"""How a checkpoint on a filesystem becomes durable: each rank's files are fsynced in the staging
folder, then hard-linked into the checkpoint's folder without a second sync of their own (a link
changes the inode, so that sync would wait for a journal commit per file), and the folder is
synced once after the last link, before the manifest is written.

Real files, the real Checkpointer and ``FileStorage``. The sync calls and links are recorded by
wrapping the functions that make them (they still run); nothing here pulls the power, so what a
crash would leave is not observed, only the order of the calls that durability rests on.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest

from agent import _dcp_write
from agent.checkpoint import Checkpointer
from agent.checkpoint._claim import CLAIM_NAME
from agent.storage import file as file_backend
from agent.storage import put_files
from agent.storage.file import FileStorage

sys.path.insert(0, str(Path(__file__).resolve().parent / "scripts"))
from ckpt_compare import assert_same
from ckpt_state import make_state, snapshot, train


def _path_of(fd: int) -> str:
    return os.readlink(f"/proc/self/fd/{fd}")


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str]]:
    """``("sync", path)`` for the staging fsyncs, ``("resync", path)`` for a file sync by the store,
    ``("link", source, dest)`` and ``("dir", folder)``, in the order they happened."""
    if not os.path.isdir("/proc/self/fd"):
        pytest.skip("needs /proc to name the synced files")
    events: list[Any] = []
    staging_sync, store_sync, link, dir_sync = (
        _dcp_write.sync_fd,
        file_backend.sync_fd,
        os.link,
        file_backend._fsync_dir,
    )

    def sync(fd: int) -> None:
        events.append(("sync", _path_of(fd)))
        staging_sync(fd)

    def resync(fd: int) -> None:
        events.append(("resync", _path_of(fd)))
        store_sync(fd)

    def linked(src: Any, dst: Any, *a: Any, **k: Any) -> None:
        link(src, dst, *a, **k)
        events.append(("link", os.path.realpath(src), os.path.realpath(dst)))

    def folder(path: str) -> None:
        events.append(("dir", os.path.realpath(path)))
        dir_sync(path)

    monkeypatch.setattr(_dcp_write, "sync_fd", sync)
    monkeypatch.setattr(file_backend, "sync_fd", resync)
    monkeypatch.setattr(os, "link", linked)
    monkeypatch.setattr(file_backend, "_fsync_dir", folder)
    return events


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_each_file_is_synced_in_staging_before_its_link_and_not_again(
    tmp_path: Path, calls: list[Any], async_save: bool
) -> None:
    """Fails without the fix: every linked file was fsynced a second time after its link."""
    uri = str(tmp_path / "ckpt")
    state = make_state(0)
    with Checkpointer(uri, keep=2, async_save=async_save) as ckpt:
        train(state, 1)
        ckpt.save(1, state)
        ckpt.wait()
        saved = snapshot(state)
    step_folder = os.path.realpath(tmp_path / "ckpt" / "step-000000001")
    # The manifest and the folder's claim (WRITER.json) are written in place, not staged and linked.
    committed = sorted(n for n in os.listdir(step_folder) if n not in ("MANIFEST.json", CLAIM_NAME))
    assert committed, "nothing was committed"
    links = [i for i, e in enumerate(calls) if e[0] == "link" and e[2].startswith(step_folder + os.sep)]
    staged_links = [i for i in links if os.path.basename(calls[i][2]) not in ("MANIFEST.json", CLAIM_NAME)]
    assert len(staged_links) == len(committed)
    for name in committed:
        # The link went to a temp name first, then was renamed: find the link by its source file.
        link_at = next(i for i, e in enumerate(calls) if e[0] == "link" and os.path.basename(e[1]) == name)
        source = calls[link_at][1]
        synced_at = [i for i, e in enumerate(calls) if e[0] == "sync" and e[1] == source]
        assert synced_at and synced_at[0] < link_at, f"{name} was linked into place before its bytes were synced"
    assert [e for e in calls if e[0] == "resync"] == [], "linked files whose bytes were synced got synced again"
    folder_synced = [i for i, e in enumerate(calls) if e[0] == "dir" and e[1] == step_folder]
    # (The claim's write syncs the folder once before any link; the one that counts comes after them.)
    assert any(i > max(staged_links) for i in folder_synced), "the folder was not synced after the links"
    restored = make_state(0, seed=5)
    with Checkpointer(uri, keep=2) as ckpt:
        assert ckpt.restore(restored) == 1
    assert_same(snapshot(restored), saved)


def test_a_file_not_synced_by_the_caller_is_synced_after_its_link(tmp_path: Path, calls: list[Any]) -> None:
    """Pins what already worked: ``put_files`` without ``synced`` syncs each linked file."""
    src = tmp_path / "local"
    src.write_bytes(b"x" * 4096)
    put_files(FileStorage(str(tmp_path / "store")), [(str(src), "a/b", None)])
    assert [e[0] for e in calls if e[0] in ("link", "resync")] == ["link", "resync"]
    assert (tmp_path / "store" / "a" / "b").read_bytes() == b"x" * 4096
