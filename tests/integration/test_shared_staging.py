"""Two jobs on one node given the same staging folder (``staging_dir``, ``SPOTJOB_STAGING_DIR``,
``spotjob-agent --staging-dir``: one local NVMe for every job of the node) keep out of each other's
files: each stages its saves and caches its restores in a folder of its own inside it.

What a job clears of its own when it starts (its stale saves) or once its restore has loaded (its
restore cache) would otherwise be the other job's save in flight and the files its agent
prefetched. An object store is modelled as in test_restore_prefetch.py: a ``FileStorage`` whose
``local_path`` is None, so every file of a restore goes through the node's cache.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from agent.checkpoint import Checkpointer
from agent.restore_cache import prefetch, staging_root
from agent.storage.file import FileStorage

sys.path.insert(0, str(Path(__file__).resolve().parent / "scripts"))
from ckpt_compare import assert_same
from ckpt_state import make_state, snapshot, train

# A guard against a hung test only; nothing here asserts how long anything takes.
HANG_S = 120.0


class ObjectStoreLike(FileStorage):
    """A folder that the restore must treat like a bucket: nothing can be read in place."""

    def __init__(self, root: str) -> None:
        super().__init__(root)
        self.fetched: list[str] = []

    def local_path(self, key: str) -> str | None:
        return None

    def get_file(self, key: str, local_path: str, **kw: Any) -> None:
        self.fetched.append(key)
        super().get_file(key, local_path, **kw)


def committed(root: Path, job: str, seed: int) -> dict[str, Any]:
    """``job``'s step 3 under ``root``; returns the state saved."""
    state = make_state(0, seed=seed)
    train(state, 3)
    with Checkpointer(str(root), keep=None, job=job) as ckpt:
        ckpt.save(3, state)
    return snapshot(state)


def test_a_job_restoring_leaves_the_restore_cache_another_job_prefetched_into_the_same_staging_dir(
    tmp_path: Path,
) -> None:
    shared = str(tmp_path / "nvme")
    saved_a = committed(tmp_path / "a", "team/a", seed=1)
    saved_b = committed(tmp_path / "b", "team/b", seed=2)
    store_a = ObjectStoreLike(str(tmp_path / "a"))
    assert prefetch(store_a, staging_root(store_a, "team/a", shared)) == "step-000000003"

    # Job b restores (and clears its own restore cache once loaded) on the same node, same folder.
    state_b = make_state(0, seed=9)
    with Checkpointer(str(tmp_path / "b"), staging_dir=shared, job="team/b") as b:
        b.storage = ObjectStoreLike(str(tmp_path / "b"))
        assert b.restore(state_b) == 3
    assert_same(snapshot(state_b), saved_b, "job b's restored state")

    state_a = make_state(0, seed=9)
    with Checkpointer(str(tmp_path / "a"), staging_dir=shared, job="team/a") as a:
        a.storage = store_a
        store_a.fetched.clear()
        assert a.restore(state_a) == 3
        assert store_a.fetched == [], "job b's restore removed the files job a's agent had prefetched"
    assert_same(snapshot(state_a), saved_a, "job a's restored state")


def test_a_job_starting_leaves_the_save_another_job_is_uploading_from_the_same_staging_dir(tmp_path: Path) -> None:
    shared = str(tmp_path / "nvme")
    state = make_state(0, seed=1)
    train(state, 1)
    uploading, release = threading.Event(), threading.Event()
    with Checkpointer(str(tmp_path / "a"), keep=None, staging_dir=shared, job="team/a", async_save=True) as a:
        put_files = a.storage.put_files

        def held(files: Sequence[tuple[str, str, int | None]], **kw: Any) -> None:
            uploading.set()
            assert release.wait(HANG_S), "the test never released the upload"
            put_files(files, **kw)

        a.storage.put_files = held  # type: ignore[method-assign]
        a.save(1, state)  # staged; the upload waits in the background
        assert uploading.wait(HANG_S), "job a's save never reached its upload"
        # Job b starts on the node: it clears what killed saves left in its staging folder.
        Checkpointer(str(tmp_path / "b"), keep=None, staging_dir=shared, job="team/b").close()
        release.set()
        a.wait()  # raises SaveFailedError if job b removed the files being uploaded
        assert a.last_committed_step == 1

    fresh = make_state(0, seed=9)
    with Checkpointer(str(tmp_path / "a"), keep=None, job="team/a") as again:
        assert again.restore(fresh) == 1
    assert_same(snapshot(fresh), snapshot(state), "job a's checkpoint saved while job b started")


def test_each_job_stages_in_a_folder_of_its_own_inside_the_staging_dir(tmp_path: Path) -> None:
    shared = tmp_path / "nvme"
    store = FileStorage(str(tmp_path / "a"))
    mine = Path(staging_root(store, "team/a", str(shared)))
    assert mine.parent == shared
    assert mine != Path(staging_root(FileStorage(str(tmp_path / "b")), "team/b", str(shared)))
    assert mine != Path(staging_root(FileStorage(str(tmp_path / "b")), "team/a", str(shared)))
    assert "/" not in mine.name and mine.name.startswith("team_a-")


def test_a_checkpoint_folder_whose_name_is_not_utf8_saves_and_restores_with_a_staging_dir(tmp_path: Path) -> None:
    """Linux folder names are bytes; Python hands undecodable ones over as lone surrogates. Naming
    the job's staging folder after the URI encoded it as strict UTF-8, so such a folder failed
    ``Checkpointer(...)`` with a bare UnicodeEncodeError whenever a staging folder was given."""
    root = str(tmp_path / os.fsdecode(b"caf\xe9-run"))
    state = make_state(0, seed=1)
    train(state, 3)
    with Checkpointer(root, keep=None, staging_dir=str(tmp_path / "nvme"), async_save=False) as ckpt:
        ckpt.save(3, state)
    fresh = make_state(0, seed=2)
    with Checkpointer(root, keep=None, staging_dir=str(tmp_path / "nvme"), async_save=False) as ckpt:
        assert ckpt.restore(fresh) == 3
    assert_same(snapshot(fresh), snapshot(state))
    assert b"caf\xe9-run" in os.listdir(os.fsencode(tmp_path))  # under its own name, bytes and all


def test_a_checkpointer_built_directly_stages_where_the_agent_prefetched_from_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under ``spotjob-agent --staging-dir`` (a Kubernetes worker: its staging volume) the ranks get
    ``SPOTJOB_STAGING_DIR``, and the agent prefetches into the job's folder there. A script that
    builds ``Checkpointer(uri, every_steps=...)``, the README's first example, rather than
    ``from_env()`` must stage and restore there too: not on the container's own disk, fetching
    every file again beside the prefetched copy."""
    shared = str(tmp_path / "nvme")
    saved = committed(tmp_path / "a", "team/a", seed=1)
    store = ObjectStoreLike(str(tmp_path / "a"))
    assert prefetch(store, staging_root(store, "team/a", shared)) == "step-000000003"
    monkeypatch.setenv("SPOTJOB_STAGING_DIR", shared)

    state = make_state(0, seed=9)
    with Checkpointer(str(tmp_path / "a"), every_steps=100, job="team/a") as ckpt:
        ckpt.storage = store
        store.fetched.clear()
        assert ckpt.restore(state) == 3
        assert store.fetched == [], "the restore fetched again what the agent had prefetched"
    assert_same(snapshot(state), saved, "the state restored from the prefetched files")
