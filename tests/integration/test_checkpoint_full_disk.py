"""A full disk (or quota) during a save on a filesystem store: the save fails saying so, leaves
nothing of itself on the disk, the previous checkpoint stays, and training saves again.

The disk fills at the OS call a real full disk fails (``os.write``/``os.pwrite`` return
``ENOSPC``); everything else is real: one process, real files, the real Checkpointer. A staging
folder that cannot be made (read-only, another user's) fails the same way, named.
"""

from __future__ import annotations

import errno
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agent.catalog import list_checkpoints
from agent.checkpoint import Checkpointer, SaveFailedError
from agent.checkpoint._save import _writing_failure
from agent.storage import open_storage

sys.path.insert(0, str(Path(__file__).resolve().parent / "scripts"))
from ckpt_compare import assert_same
from ckpt_state import make_state, snapshot, train

_write, _pwrite = os.write, os.pwrite


def no_space_for(m: pytest.MonkeyPatch, name: str) -> None:
    """From now on, the disk has no room for a file whose name contains ``name``: its
    ``os.write`` and ``os.pwrite`` (the O_DIRECT writer's) fail with ``ENOSPC``."""

    def full(fd: int) -> None:
        if name in os.readlink(f"/proc/self/fd/{fd}"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def write(fd: int, data: Any) -> int:
        full(fd)
        return _write(fd, data)

    def pwrite(fd: int, data: Any, offset: int) -> int:
        full(fd)
        return _pwrite(fd, data, offset)

    m.setattr(os, "write", write)
    m.setattr(os, "pwrite", pwrite)


def files_under(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())


@pytest.fixture
def committed_step_1(tmp_path: Path) -> Iterator[tuple[str, Checkpointer, dict[str, Any], dict[str, Any]]]:
    uri = str(tmp_path / "ckpt")
    state = make_state(0)
    with Checkpointer(uri, keep=2, async_save=False) as ckpt:
        assert ckpt.restore(state) == 0
        train(state, 1)
        ckpt.save(1, state)
        yield uri, ckpt, state, snapshot(state)


def test_a_full_disk_at_the_manifest_fails_the_save_and_leaves_none_of_its_shards_on_the_disk(
    committed_step_1: tuple[str, Checkpointer, dict[str, Any], dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    uri, ckpt, state, step_1 = committed_step_1
    train(state, 1, start=1)
    with monkeypatch.context() as m:
        no_space_for(m, "MANIFEST.json")
        with pytest.raises(SaveFailedError, match=r"step-000000002.*no space left \(or quota exceeded\)"):
            ckpt.save(2, state)
    # The shards were linked into step-000000002 before the manifest failed: left there, they hold
    # a whole checkpoint's blocks on the full disk, so every later save would fail for want of space.
    assert not (Path(uri) / "step-000000002").exists(), files_under(Path(uri) / "step-000000002")
    assert files_under(Path(uri) / ".spotjob-staging") == []
    assert [(s.ref.step, s.valid) for s in list_checkpoints(open_storage(uri))] == [(1, True)]
    restored = make_state(0, seed=5)
    with Checkpointer(uri) as fresh:
        assert fresh.restore(restored) == 1
    assert_same(snapshot(restored), step_1, "the state restored from step 1")

    train(state, 1, start=2)
    ckpt.save(3, state)  # training goes on, and so do its saves
    assert [(s.ref.step, s.valid) for s in list_checkpoints(open_storage(uri))] == [(3, True), (1, True)]
    restored = make_state(0, seed=5)
    with Checkpointer(uri) as fresh:
        assert fresh.restore(restored) == 3
    assert_same(snapshot(restored), snapshot(state), "the state restored from step 3")


@pytest.mark.parametrize("file", [".distcp", "rank-00000.pt"], ids=["a-shard", "the-per-rank-state"])
def test_a_full_disk_while_staging_fails_the_save_saying_so_and_removes_what_was_staged(
    committed_step_1: tuple[str, Checkpointer, dict[str, Any], dict[str, Any]],
    monkeypatch: pytest.MonkeyPatch,
    file: str,
) -> None:
    uri, ckpt, state, _ = committed_step_1
    train(state, 1, start=1)
    with monkeypatch.context() as m:
        no_space_for(m, file)
        with pytest.raises(SaveFailedError) as failed:
            ckpt.save(2, state)
    said = str(failed.value)
    # What the disk said, where, and what to do; not DCP's wrapper with a page of stack frames.
    assert "No space left on device" in said and "full or over its quota" in said, said
    # Staged inside the URI: the checkpoints' own disk is full, and staging elsewhere cannot help.
    assert f"the filesystem of the checkpoint URI {uri} is full" in said, said
    assert str(Path(uri) / ".spotjob-staging") in said and "SPOTJOB_STAGING_DIR" not in said, said
    assert "keep fewer" not in said, said  # one checkpoint there: fewer is none
    assert "FrameSummary" not in said and "CheckpointException" not in said, said
    assert files_under(Path(uri) / ".spotjob-staging") == []
    assert not (Path(uri) / "step-000000002").exists()

    train(state, 1, start=2)
    ckpt.save(3, state)
    assert [(s.ref.step, s.valid) for s in list_checkpoints(open_storage(uri))] == [(3, True), (1, True)]


@pytest.mark.parametrize(("code", "says"), [(errno.EROFS, "read-only filesystem"), (errno.EACCES, "not writable")])
def test_a_staging_folder_that_cannot_be_written_fails_the_save_naming_it_and_what_to_do(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int, says: str
) -> None:
    """The rank's staging folder cannot be made (a read-only mount, a folder of another user): the
    save says where and what to set, not a bare ``OSError(30, ...)`` repr."""
    staging = tmp_path / "staging"
    makedirs = os.makedirs

    def refused(path: Any, *args: Any, **kwargs: Any) -> None:
        if str(path).startswith(str(staging)):
            raise OSError(code, os.strerror(code), str(path))
        makedirs(path, *args, **kwargs)

    with Checkpointer(str(tmp_path / "ckpt"), staging_dir=str(staging), async_save=False) as ckpt:
        monkeypatch.setattr(os, "makedirs", refused)
        with pytest.raises(SaveFailedError) as failed:
            ckpt.save(1, make_state(0))
        monkeypatch.undo()
    message = str(failed.value)
    assert f"the staging folder {staging}" in message and says in message
    assert "SPOTJOB_STAGING_DIR" in message and "OSError(" not in message
    assert list_checkpoints(open_storage(str(tmp_path / "ckpt"))) == []


def committed_steps(uri: Path, steps: list[int]) -> None:
    for step in steps:
        (uri / f"step-{step:09d}").mkdir(parents=True)
        (uri / f"step-{step:09d}" / "MANIFEST.json").write_text("{}")


def test_a_full_uri_disk_with_the_default_staging_says_the_uri_is_full_not_to_stage_elsewhere(tmp_path: Path) -> None:
    """Staged in ``<uri>/.spotjob-staging``, the disk that is full is the checkpoints' own: another
    staging folder only moves the failure to the upload, and with one checkpoint there (keep=1)
    keeping fewer frees nothing."""
    uri = tmp_path / "ckpt"
    committed_steps(uri, [1])
    (uri / "step-000000002").mkdir()  # linked in, never committed: not one to keep fewer of
    staging = uri / ".spotjob-staging" / "step-000000002-0a1b2c3d" / "rank-0"
    said = _writing_failure(
        OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(staging / "__0_0.distcp")), str(staging), str(uri)
    )
    assert f"the filesystem of the checkpoint URI {uri} is full or over its quota" in said, said
    assert f"{staging}/__0_0.distcp" in said and "Staging elsewhere cannot help" in said, said
    assert "keep fewer" not in said and "SPOTJOB_STAGING_DIR" not in said, said

    committed_steps(uri, [3])  # keep=2: two checkpoints there, one of them can go
    said = _writing_failure(OSError(errno.EDQUOT, os.strerror(errno.EDQUOT)), str(staging), str(uri))
    assert "keep fewer checkpoints (keep=...; 2 are there)" in said, said


@pytest.mark.parametrize(("code", "fix"), [(errno.EROFS, "mount it read-write"), (errno.EACCES, "write access")])
def test_a_read_only_uri_with_the_default_staging_names_the_uri_not_another_staging_folder(
    tmp_path: Path, code: int, fix: str
) -> None:
    staging = tmp_path / "ckpt" / ".spotjob-staging"
    said = _writing_failure(OSError(code, os.strerror(code), str(staging)), str(staging), str(tmp_path / "ckpt"))
    assert f"the checkpoint URI's folder {tmp_path / 'ckpt'}" in said and fix in said, said
    assert "save to a URI this process can write" in said and "SPOTJOB_STAGING_DIR" not in said, said


def test_saves_stage_in_the_uri_only_with_a_filesystem_uris_default_staging(tmp_path: Path, fresh_uri: Any) -> None:
    """Told by the store and its default staging folder, not by a folder's name: an S3 job staging
    in ``/scratch/.spotjob-staging`` was told its URI's disk was full and that staging elsewhere
    could not help."""
    uri = tmp_path / "ckpt"
    with Checkpointer(str(uri), async_save=False) as ckpt:
        assert ckpt._staged_in_uri() == str(uri)
    with Checkpointer(str(uri), async_save=False, staging_dir=str(tmp_path / "nvme")) as ckpt:
        assert ckpt._staged_in_uri() is None
    named = tmp_path / "scratch" / ".spotjob-staging"
    with Checkpointer(fresh_uri("s3"), async_save=False, staging_dir=str(named)) as ckpt:
        assert ckpt._staged_in_uri() is None


def test_an_io_error_of_the_default_staging_in_a_uri_does_not_advise_staging_elsewhere(tmp_path: Path) -> None:
    """The disk that failed holds the checkpoints too: another staging folder would leave the upload
    (a link into place) on it. A staging folder of its own still gets that advice."""
    uri, staging = tmp_path / "ckpt", tmp_path / "ckpt" / ".spotjob-staging" / "step-000000002-0a1b2c3d"
    said = _writing_failure(OSError(errno.EIO, os.strerror(errno.EIO)), str(staging), str(uri))
    assert f"save to a URI on another disk: the checkpoints of {uri} are on this one too" in said, said
    assert "SPOTJOB_STAGING_DIR" not in said, said
    said = _writing_failure(OSError(errno.EIO, os.strerror(errno.EIO)), str(tmp_path / "nvme"))
    assert "stage on another one" in said and "SPOTJOB_STAGING_DIR" in said, said


def test_a_full_staging_folder_of_its_own_says_to_stage_elsewhere_not_to_keep_fewer(tmp_path: Path) -> None:
    """A staging folder of its own (``staging_dir``) holds only the save in flight: retention
    frees nothing on its disk, another disk does."""
    staging = tmp_path / "nvme" / "train-0a1b2c3d"
    said = _writing_failure(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)), str(staging))
    assert f"the disk of the staging folder {staging} is full or over its quota" in said, said
    assert "stage on another disk" in said and "SPOTJOB_STAGING_DIR" in said and "keep fewer" not in said, said
