"""The agent's prefetch fills the node's restore cache while the ranks start; their restore then
reads what it fetched, verified, without fetching it again.

An object store is modelled at the one seam the restore path branches on: a ``FileStorage``
whose ``local_path`` is None, so every file goes through ``get_file`` and the node's cache (what
S3 and GCS do; their own transfers are covered by test_storage_backends.py). Not modelled: the
network, and the agent process itself (``Agent._prefetch`` only starts ``prefetch`` in a thread).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest

from agent.checkpoint import Checkpointer
from agent.restore_cache import RESTORE_FOLDER, VERIFIED_SUFFIX, prefetch
from agent.storage import CorruptObjectError
from agent.storage.file import FileStorage

sys.path.insert(0, str(Path(__file__).resolve().parent / "scripts"))
from ckpt_compare import assert_same
from ckpt_state import make_state, snapshot, train


class ObjectStoreLike(FileStorage):
    """A folder that the restore must treat like a bucket: nothing can be read in place."""

    fetched: list[str]

    def __init__(self, root: str) -> None:
        super().__init__(root)
        self.fetched = []

    def local_path(self, key: str) -> str | None:
        return None

    def get_file(self, key: str, local_path: str, **kw: Any) -> None:
        self.fetched.append(key)
        super().get_file(key, local_path, **kw)


def committed(tmp_path: Path) -> tuple[str, dict[str, Any]]:
    state = make_state(0)
    train(state, 3)
    root = str(tmp_path / "ckpt")
    with Checkpointer(root, keep=None) as ckpt:
        ckpt.save(3, state)
    return root, snapshot(state)


def test_the_restore_reads_the_prefetched_files_without_fetching_them_again(tmp_path: Path) -> None:
    root, saved = committed(tmp_path)
    staging = str(tmp_path / "staging")
    store = ObjectStoreLike(root)
    assert prefetch(store, staging) == "step-000000003"
    cache = Path(staging, RESTORE_FOLDER, "step-000000003")
    names = sorted(p.name for p in cache.iterdir() if not p.name.endswith((".lock", VERIFIED_SUFFIX)))
    assert names == sorted({f.split("/", 1)[1] for f in store.fetched})
    assert all((cache / (n + VERIFIED_SUFFIX)).exists() for n in names)

    fresh = make_state(0, seed=9)
    with Checkpointer(root, staging_dir=staging) as again:
        again.storage = ObjectStoreLike(root)
        assert again.restore(fresh) == 3
        assert again.storage.fetched == [], "the restore fetched a file the prefetch had verified"  # type: ignore[attr-defined]
    assert_same(snapshot(fresh), saved, "the state restored from the prefetched cache")
    assert not Path(staging, RESTORE_FOLDER).exists(), "the restore cache outlived the restore"


def test_a_prefetch_of_a_filesystem_store_checks_every_file_and_refuses_a_flipped_byte(tmp_path: Path) -> None:
    root, _ = committed(tmp_path)
    assert prefetch(FileStorage(root), str(tmp_path / "staging")) == "step-000000003"
    shard = next(Path(root, "step-000000003").glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    os.chmod(shard, 0o644)
    shard.write_bytes(bytes(data))
    with pytest.raises(CorruptObjectError):
        prefetch(FileStorage(root), str(tmp_path / "staging"))


def test_nothing_to_prefetch_under_a_new_uri(tmp_path: Path) -> None:
    assert prefetch(ObjectStoreLike(str(tmp_path / "empty")), str(tmp_path / "staging")) is None
