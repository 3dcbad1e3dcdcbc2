"""The default staging folder of an object-store job lies under the node's shared temp folder
(``/tmp``), at a name anyone on the node can predict. It holds the rank's staged saves and the
restore cache, whose files a restore trusts once their ``.verified`` marker vouches for them.

So spotjob makes that folder itself, closed to other users, and refuses one that is not: a
symlink someone planted (the saves and the cache would land where it points, and the cache's
lock files would be opened through it), a folder of another user, or one others can write.
"""

from __future__ import annotations

import os
import shutil
import stat
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from agent.checkpoint import Checkpointer, StorageRefusedError
from agent.restore_cache import prefetch, staging_root
from agent.storage import Storage

sys.path.insert(0, str(Path(__file__).resolve().parent / "scripts"))
from ckpt_compare import assert_same
from ckpt_state import make_state, snapshot, train

JOB = "team/a"


@pytest.fixture
def node_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The node's shared temp folder (``tempfile.gettempdir()``), here a fresh one per test."""
    tmp = tmp_path / "node-tmp"
    tmp.mkdir()
    tmp.chmod(0o1777)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    return tmp


@pytest.fixture
def bucket(
    fresh_uri: Callable[[str], str], make_storage: Callable[[str], Storage]
) -> Iterator[tuple[str, Storage, dict[str, Any]]]:
    """An S3 URI holding a committed step 3 of ``JOB``, its storage, and the state saved."""
    uri = fresh_uri("s3")
    state = make_state(0)
    train(state, 3)
    with Checkpointer(uri, keep=None, job=JOB) as ckpt:
        ckpt.save(3, state)
    yield uri, make_storage(uri), snapshot(state)


def staging_parent(node_tmp: Path, storage: Storage) -> Path:
    """The folder directly under the node's temp folder that holds the job's staging folder."""
    parent = Path(staging_root(storage, JOB))
    while parent.parent != node_tmp:
        parent = parent.parent
    return parent


def test_the_default_staging_folder_is_closed_to_other_users_and_a_restore_works_through_it(
    node_tmp: Path, bucket: tuple[str, Storage, dict[str, Any]]
) -> None:
    uri, storage, saved = bucket
    parent = staging_parent(node_tmp, storage)
    mode = stat.S_IMODE(parent.lstat().st_mode)
    assert mode & 0o077 == 0, f"{parent} is mode {mode:o}: other users can read the staged checkpoints"
    assert parent.lstat().st_uid == os.getuid()

    assert prefetch(storage, staging_root(storage, JOB)) == "step-000000003"
    state = make_state(0, seed=9)
    with Checkpointer(uri, job=JOB) as ckpt:
        assert ckpt.restore(state) == 3
    assert_same(snapshot(state), saved, "restored state")


@pytest.mark.parametrize("planted", ["symlink", "folder others can write", "another user's folder"])
def test_a_folder_someone_else_made_at_the_default_staging_name_is_refused_and_nothing_goes_in(
    tmp_path: Path, node_tmp: Path, bucket: tuple[str, Storage, dict[str, Any]], planted: str
) -> None:
    uri, storage, _ = bucket
    parent = staging_parent(node_tmp, storage)  # the name spotjob uses; then someone got there first
    shutil.rmtree(parent)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    if planted == "symlink":
        parent.symlink_to(elsewhere, target_is_directory=True)
    elif planted == "folder others can write":
        parent.mkdir()
        parent.chmod(0o777)
    else:
        if os.getuid() != 0:
            pytest.skip("making a folder owned by another user needs root")
        parent.mkdir(mode=0o700)
        os.chown(parent, 65534, 65534)

    with pytest.raises(OSError, match="staging folder") as refused:
        prefetch(storage, staging_root(storage, JOB))
    assert str(parent) in str(refused.value)
    with pytest.raises(OSError, match="staging folder"):
        Checkpointer(uri, job=JOB)
    assert list(elsewhere.rglob("*")) == [], "the checkpoint went where the planted symlink leads"
    if not parent.is_symlink():
        assert list(parent.rglob("*")) == [], "the checkpoint went into a folder others can reach"


# -- a file where a folder is expected ------------------------------------------------------------


@pytest.mark.parametrize("under", [False, True])
def test_a_staging_dir_that_is_or_lies_under_a_regular_file_is_refused_at_construction_naming_it(
    tmp_path: Path, under: bool
) -> None:
    a_file = tmp_path / "a-file"
    a_file.write_text("not a folder")
    given = a_file / "staging" if under else a_file
    with pytest.raises(ValueError, match="staging_dir") as refused:
        Checkpointer(str(tmp_path / "ckpt"), staging_dir=str(given))
    assert str(given) in str(refused.value) and "a regular file, not a folder" in str(refused.value)
    assert a_file.read_text() == "not a folder"


@pytest.mark.parametrize("under", [False, True])
def test_a_folder_uri_that_is_or_lies_under_a_regular_file_is_refused_naming_the_uri_with_the_default_staging(
    tmp_path: Path, under: bool
) -> None:
    """The default staging folder of a filesystem store lies inside the URI's folder: the URI's
    own refusal is what the user sees, not a bare NotADirectoryError from the staging folder."""
    a_file = tmp_path / "a-file"
    a_file.write_text("not a folder")
    uri = a_file / "ckpt" if under else a_file
    with pytest.raises(StorageRefusedError) as refused:
        Checkpointer(str(uri))
    assert str(uri) in str(refused.value) and "Retrying cannot help" in str(refused.value)
    assert a_file.read_text() == "not a folder"
