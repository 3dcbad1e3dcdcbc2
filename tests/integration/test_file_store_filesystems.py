"""A filesystem store on filesystems other than a local ext4 disk: tmpfs, a staging folder on
another filesystem than the checkpoints, and filesystems that refuse a call ext4 allows.

Real where the machine has the filesystem: ``/dev/shm`` is a real tmpfs, and a staging folder
there with the checkpoints under the test's temp folder makes every link cross filesystems
(``EXDEV``). Filesystems the machine has no mount of (FUSE mounts of buckets, FAT, NFS without
lockd, NFS's lost replies) are simulated at the one OS call that behaves differently there, for
paths under the test's own folder only; each such test says so. A full disk is real: a small
tmpfs mounted in a user namespace. Everything else is real: real files, the real Checkpointer,
in one process or two torchrun ranks.
"""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
import stat
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from agent.catalog import list_checkpoints
from agent.checkpoint import Checkpointer, StorageRefusedError
from agent.mounts import mount_of
from agent.storage import AlreadyExistsError, PermanentStorageError, open_storage, put_files
from agent.storage import file as file_backend
from agent.storage.file import FileStorage

sys.path.insert(0, str(Path(__file__).resolve().parent / "scripts"))
import ckpt_harness as harness
from ckpt_compare import assert_same
from ckpt_state import make_state, snapshot, train


def _on_tmpfs(path: str) -> bool:
    mount = mount_of(path)
    return mount is not None and mount.fstype == "tmpfs"


@pytest.fixture
def shm() -> Iterator[Path]:
    """A fresh folder on the real tmpfs at /dev/shm (removed afterwards)."""
    if not os.path.isdir("/dev/shm") or not _on_tmpfs("/dev/shm"):
        pytest.skip("no tmpfs at /dev/shm")
    folder = Path("/dev/shm") / f"spotjob-test-{uuid.uuid4().hex[:8]}"
    folder.mkdir()
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _fd_under(fd: int, folder: Path) -> bool:
    return os.readlink(f"/proc/self/fd/{fd}").startswith(str(folder) + "/")


def save_then_restore(uri: str, **options: Any) -> None:
    """Save step 1 and restore it in a fresh Checkpointer: every byte of the state comes back."""
    state = make_state(0)
    with Checkpointer(uri, keep=2, async_save=False, **options) as ckpt:
        assert ckpt.restore(state) == 0
        train(state, 1)
        ckpt.save(1, state)
        saved = snapshot(state)
    restored = make_state(0, seed=5)
    with Checkpointer(uri, keep=2, async_save=False, **options) as ckpt:
        assert ckpt.restore(restored) == 1
    assert_same(snapshot(restored), saved)
    assert [(s.ref.step, s.valid) for s in list_checkpoints(open_storage(uri))] == [(1, True)]


# -- real tmpfs --------------------------------------------------------------------------------
def test_checkpoints_on_tmpfs_written_with_o_direct_restore_bit_exactly(shm: Path) -> None:
    """``direct_io=True`` on tmpfs: a kernel before 6.6 refuses ``O_DIRECT`` at open (``EINVAL``) and
    the shard is written buffered; a later one takes it. Either way the checkpoint is whole."""
    save_then_restore(str(shm / "ckpt"), direct_io=True)


def test_staging_on_tmpfs_and_checkpoints_on_another_filesystem_copy_the_shards_across(
    shm: Path, tmp_path: Path
) -> None:
    """The staged shards cannot be linked into place across filesystems (``EXDEV``): they are
    copied, and the committed files are their own, not links to the staging folder's."""
    if _on_tmpfs(str(tmp_path)):
        pytest.skip("the test's temp folder is on tmpfs too: no second filesystem")
    uri = str(tmp_path / "ckpt")
    save_then_restore(uri, staging_dir=str(shm / "staging"))
    committed = [p for p in (tmp_path / "ckpt" / "step-000000001").iterdir() if p.is_file()]
    assert committed and all(p.stat().st_nlink == 1 for p in committed)


def test_two_torchrun_ranks_staging_on_tmpfs_commit_to_another_filesystem_and_restore(
    shm: Path, tmp_path: Path
) -> None:
    """Each rank copies its own shards across filesystems (``SPOTJOB_STAGING_DIR`` on tmpfs)."""
    uri = str(tmp_path / "ckpt")
    harness.torchrun(
        2,
        harness.SCRIPTS / "ckpt_job.py",
        "save-restore",
        "--uri",
        uri,
        "--dump",
        str(tmp_path / "d"),
        env=harness.job_env(SPOTJOB_STAGING_DIR=str(shm / "staging")),
    )
    for rank in range(2):
        d = torch.load(tmp_path / f"d.rank{rank}.pt", weights_only=False)
        assert_same(d["restored"], d["saved"], f"rank {rank}'s restored state")
    assert [(s.ref.step, s.valid) for s in list_checkpoints(open_storage(uri))] == [(7, True)]


def test_checkpoints_on_tmpfs_with_staging_on_another_filesystem(shm: Path, tmp_path: Path) -> None:
    save_then_restore(str(shm / "ckpt"), staging_dir=str(tmp_path / "staging"))


def test_a_synced_file_copied_across_filesystems_is_synced_after_the_copy(
    shm: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Pins what already worked: a file the caller fsynced (``put_files(synced=True)``, as the
    Checkpointer does), copied because it cannot be linked across filesystems (``EXDEV``), has new
    bytes, and they are synced; only a link of it goes without (tests/integration/test_checkpoint_file_sync.py)."""
    if _on_tmpfs(str(tmp_path)):
        pytest.skip("the test's temp folder is on tmpfs too: no second filesystem")
    synced: list[str] = []
    real_sync = file_backend.sync_fd

    def sync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_sync(fd)

    monkeypatch.setattr(file_backend, "sync_fd", sync)
    src = shm / "local"
    src.write_bytes(b"y" * 4096)
    put_files(FileStorage(str(tmp_path / "store")), [(str(src), "a/b", None)], synced=True)
    assert len(synced) == 1 and os.path.dirname(synced[0]) == os.path.realpath(tmp_path / "store" / "a")
    assert (tmp_path / "store" / "a" / "b").read_bytes() == b"y" * 4096


# -- a filesystem that cannot sync a folder ----------------------------------------------------
_fsync = os.fsync


def folders_cannot_sync(m: pytest.MonkeyPatch, folder: Path) -> None:
    """Simulated (no such mount here): fsync of a folder under ``folder`` fails with ``EINVAL``,
    as on some FUSE and network filesystems; fsync of a file works."""

    def fsync(fd: int) -> None:
        if stat.S_ISDIR(os.fstat(fd).st_mode) and _fd_under(fd, folder):
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
        _fsync(fd)

    m.setattr(os, "fsync", fsync)


def test_a_filesystem_that_cannot_sync_folders_still_commits_and_restores(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Such a filesystem makes names durable by the operation itself (or not at all): ``EINVAL``
    from a folder's fsync is no failure of the save, as in PostgreSQL. Before, claiming the URI
    already failed ("cannot write .../owner.json: Invalid argument") and no save could start."""
    folders_cannot_sync(monkeypatch, tmp_path)
    save_then_restore(str(tmp_path / "ckpt"))


def test_another_error_syncing_a_folder_still_fails_the_write(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def fsync(fd: int) -> None:
        if stat.S_ISDIR(os.fstat(fd).st_mode) and _fd_under(fd, tmp_path):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        _fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    storage = open_storage(str(tmp_path / "ckpt"))
    with pytest.raises(PermanentStorageError, match=r"no space left"):
        storage.put_bytes("a/b.json", b"{}")


# -- a filesystem without hard links -----------------------------------------------------------
_link = os.link


def no_hard_links(m: pytest.MonkeyPatch, folder: Path, code: int) -> None:
    """Simulated (no such mount here): ``link(2)`` under ``folder`` fails with ``code``, as on FAT
    (``EPERM``) and FUSE mounts of buckets (``ENOTSUP``, ``ENOSYS``)."""

    def link(src: Any, dst: Any, *args: Any, **kwargs: Any) -> None:
        if str(dst).startswith(str(folder) + "/"):
            raise OSError(code, os.strerror(code), src, None, dst)
        _link(src, dst, *args, **kwargs)

    m.setattr(os, "link", link)


@pytest.mark.parametrize("code", [errno.EPERM, errno.ENOTSUP, errno.ENOSYS], ids=errno.errorcode.get)
def test_without_hard_links_the_create_only_commit_says_so_and_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int
) -> None:
    """No other call creates a name only if absent and whole at once, so the store refuses, naming
    the filesystem and what to use instead. Before, ``EPERM`` read "permission denied ... give uid
    N access there" (access was never the problem) and ``ENOSYS`` a bare "Function not implemented"."""
    no_hard_links(monkeypatch, tmp_path, code)
    storage = open_storage(str(tmp_path / "ckpt"))
    with pytest.raises(PermanentStorageError, match=r"without hard links") as raised:
        storage.put_bytes_if_absent("step-000000001/MANIFEST.json", b"{}")
    message = str(raised.value)
    assert "permission denied" not in message
    assert "s3://" in message and "gs://" in message
    assert os.listdir(tmp_path / "ckpt" / "step-000000001") == []  # no temp file left behind


def test_without_hard_links_a_checkpointer_refuses_the_uri_at_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    no_hard_links(monkeypatch, tmp_path, errno.EPERM)
    with pytest.raises(StorageRefusedError, match=r"without hard links.*use the bucket's s3:// or gs:// URI"):
        Checkpointer(str(tmp_path / "ckpt"), async_save=False)


def test_a_shard_the_filesystem_cannot_link_into_place_is_copied(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``put_file`` (a staged shard into the checkpoint folder) copies where a FUSE server answers
    the link with ``ENOSYS``, as it did for ``EPERM`` and ``ENOTSUP``; before, the save failed."""
    staged = tmp_path / "staged.bin"
    staged.write_bytes(b"shard" * 1000)
    no_hard_links(monkeypatch, tmp_path / "ckpt", errno.ENOSYS)
    storage = open_storage(str(tmp_path / "ckpt"))
    storage.put_file(str(staged), "step-000000001/shard.bin")
    assert storage.get_bytes("step-000000001/shard.bin") == staged.read_bytes()
    assert staged.stat().st_nlink == 1


# -- NFS: a link made, its reply lost ----------------------------------------------------------
def link_reply_lost(m: pytest.MonkeyPatch, folder: Path) -> None:
    """Simulated (no NFS server here): ``link(2)`` to a name under ``folder`` makes the link, then
    answers ``EEXIST``, as an NFS client whose reply was lost and whose retransmission found the
    name taken (a server without, or past, its duplicate-request cache)."""

    def link(src: Any, dst: Any, *args: Any, **kwargs: Any) -> None:
        _link(src, dst, *args, **kwargs)
        if str(dst).startswith(str(folder) + "/"):
            raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), src, None, dst)

    m.setattr(os, "link", link)


def test_a_commit_whose_link_reply_was_lost_is_committed_not_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every link into the step's folder (each shard's, then the manifest's) is answered
    ``EEXIST`` after it was made. The temp file and the name are one inode: the link is this
    call's own (open(2)'s advice for NFS). Before, a shard's link failed the save ("a file or
    folder is in the way"), and the manifest's was read as another writer's ("committed by
    someone else meanwhile") though it had committed."""
    uri = str(tmp_path / "ckpt")
    state = make_state(0)
    with Checkpointer(uri, keep=2, async_save=False) as ckpt:
        assert ckpt.restore(state) == 0
        train(state, 1)
        with monkeypatch.context() as m:
            link_reply_lost(m, tmp_path / "ckpt" / "step-000000001")
            ckpt.save(1, state)
        assert ckpt.last_committed_step == 1
    assert [(s.ref.step, s.valid) for s in list_checkpoints(open_storage(uri))] == [(1, True)]
    assert os.listdir(tmp_path / "ckpt" / "step-000000001").count("MANIFEST.json") == 1


def test_a_create_only_write_whose_link_reply_was_lost_succeeds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    link_reply_lost(monkeypatch, tmp_path / "ckpt")
    storage = open_storage(str(tmp_path / "ckpt"))
    storage.put_bytes_if_absent("step-000000001/MANIFEST.json", b"ours")
    assert storage.get_bytes("step-000000001/MANIFEST.json") == b"ours"
    assert os.listdir(tmp_path / "ckpt" / "step-000000001") == ["MANIFEST.json"]  # no temp file left


def test_a_name_another_writer_made_is_still_refused(tmp_path: Path) -> None:
    storage = open_storage(str(tmp_path / "ckpt"))
    storage.put_bytes_if_absent("step-000000001/MANIFEST.json", b"theirs")
    with pytest.raises(AlreadyExistsError):
        storage.put_bytes_if_absent("step-000000001/MANIFEST.json", b"ours")
    assert storage.get_bytes("step-000000001/MANIFEST.json") == b"theirs"


# -- a filesystem without locks ----------------------------------------------------------------
_flock = fcntl.flock


def no_locks(m: pytest.MonkeyPatch, folder: Path) -> None:
    """Simulated (no such mount here): ``flock`` on a file or folder under ``folder`` fails with
    ``ENOLCK``, as on NFS mounted without lockd."""

    def flock(fd: Any, operation: int) -> None:
        if _fd_under(fd if isinstance(fd, int) else fd.fileno(), folder):
            raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))
        _flock(fd, operation)

    m.setattr(fcntl, "flock", flock)


def test_a_staging_folder_without_locks_still_saves_and_restores(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The staging folder's lock only keeps another process's stale-staging cleanup off a save in
    flight (README "Known limits"): without it, saves go on unlocked."""
    no_locks(monkeypatch, tmp_path)
    save_then_restore(str(tmp_path / "ckpt"))


def folder_locks_only_on_this_client(m: pytest.MonkeyPatch, folder: Path) -> None:
    """Simulated (no NFS here): a ``flock`` on a folder under ``folder`` is granted without locking
    anything another process sees, as on NFS, whose client keeps a folder's ``flock`` to itself
    (only a regular file's lock goes to the server, where every node sees it). Both Checkpointers
    of the test share one kernel, so "another node" is modelled as "never sees the folder's lock"."""

    def flock(fd: Any, operation: int) -> None:
        raw = fd if isinstance(fd, int) else fd.fileno()
        if stat.S_ISDIR(os.fstat(raw).st_mode) and _fd_under(raw, folder):
            return
        _flock(fd, operation)

    m.setattr(fcntl, "flock", flock)


def test_a_checkpointer_on_another_nfs_client_does_not_remove_a_save_in_flight(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The staging lock (a save in flight is no stale folder for another process's Checkpointer,
    test_checkpoint_concurrent_readers.py) was a ``flock`` on the folder itself: on NFS only the
    node holding it saw it, so an eval job starting on another node removed the staged files of
    the save the training job was committing, and that save failed."""
    from test_checkpoint_concurrent_readers import a_checkpointer_arrives_mid_save

    folder_locks_only_on_this_client(monkeypatch, tmp_path)
    root = tmp_path / "ckpt"
    state = make_state(0)
    train(state, 1)
    others = a_checkpointer_arrives_mid_save(monkeypatch, root)
    with Checkpointer(str(root), keep=1, job="train", async_save=False) as ckpt:
        ckpt.save(1, state)
    assert others, "the hook did not run"
    others[0].close()
    assert [(s.ref.step, s.valid) for s in list_checkpoints(open_storage(str(root)))] == [(1, True)]
    assert list((root / ".spotjob-staging").iterdir()) == []  # nothing of the save left staged


class ObjectStoreLike(FileStorage):
    """A folder the restore must treat like a bucket: every file goes through the node's restore
    cache in the staging folder (as in test_shared_staging.py)."""

    def local_path(self, key: str) -> str | None:
        return None


def test_a_restore_from_an_object_store_with_its_staging_folder_without_locks_still_loads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The restore cache's per-file lock (``agent.restore_cache.fetch_verified``) only spares a
    node's ranks a second download: each download lands whole under its final name by rename. A
    staging folder on NFS without lockd used to fail every restore with "[Errno 37] No locks
    available", taken for an unavailable store, so the job was restarted into the same failure."""
    uri = str(tmp_path / "bucket")
    state = make_state(0)
    train(state, 3)
    with Checkpointer(uri, keep=None, async_save=False) as ckpt:
        ckpt.save(3, state)
    staging = tmp_path / "nfs-staging"
    no_locks(monkeypatch, staging)
    restored = make_state(0, seed=9)
    with Checkpointer(uri, keep=None, staging_dir=str(staging)) as ckpt:
        ckpt.storage = ObjectStoreLike(uri)
        assert ckpt.restore(restored) == 3
    assert_same(snapshot(restored), snapshot(state))


def test_spotjob_run_on_a_runs_folder_without_locks_says_so_and_leaves_no_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Simulated (NFS without lockd): ``flock`` under the runs folder fails with ``ENOLCK``. The
    driver lock alone tells a live driver from a dead one, so ``spotjob run`` refuses, naming the
    filesystem problem and the remedy; before, it said "[Errno 37] No locks available"."""
    from orchestrator.cli import main

    no_locks(monkeypatch, tmp_path)
    script = tmp_path / "train.py"
    script.write_text("print('never run')\n")
    runs = tmp_path / "runs"
    assert main(["run", "--runs-dir", str(runs), "--name", "demo", str(script)]) == 2
    err = capsys.readouterr().err
    assert "without file locks" in err and "--runs-dir" in err and "No locks available" in err
    assert "[Errno" not in err
    assert not (runs / "demo" / "local").exists()  # no job file: the name is not taken for a later run


# -- a full checkpoint disk behind a staging folder on another ---------------------------------
_SAVE_ONTO = """
import sys
sys.path.insert(0, sys.argv[3])
from ckpt_state import make_state, train
from agent.checkpoint import Checkpointer, SaveFailedError
state = make_state(0)
with Checkpointer(sys.argv[1], async_save=False, staging_dir=sys.argv[2]) as ckpt:
    train(state, 1)
    try:
        ckpt.save(1, state)
    except SaveFailedError as e:
        print(e)
        sys.exit(3)
"""


def test_a_full_checkpoint_disk_is_named_when_the_shards_are_copied_from_another(tmp_path: Path) -> None:
    """A real ``ENOSPC``: the checkpoints on a 64 KiB tmpfs mounted in a user namespace, the
    staging folder on the test's temp folder, so every shard is copied across (``EXDEV``). shutil
    names the file it read in a copy's error, so the message sent the operator to free space on the
    staging disk; it names the checkpoint's file, on the disk that is full."""
    unshare = shutil.which("unshare")
    probe = unshare and subprocess.run([unshare, "--user", "--map-root-user", "--mount", "true"], capture_output=True)
    if not probe or probe.returncode != 0:
        pytest.skip("no user namespaces here (unshare --user --mount): no small tmpfs to fill")
    disk, staging = tmp_path / "disk", tmp_path / "staging"
    disk.mkdir()
    script = f'mount -t tmpfs -o size=64k tmpfs "{disk}" && exec "$0" -c "$1" "$2" "$3" "$4"'
    scripts = str(Path(__file__).resolve().parent / "scripts")
    argv = [sys.executable, _SAVE_ONTO, str(disk / "ckpt"), str(staging), scripts]
    done = subprocess.run(
        [unshare, "--user", "--map-root-user", "--mount", "sh", "-c", script, *argv],
        text=True,
        capture_output=True,
        timeout=300,
    )
    assert done.returncode == 3, done.stderr[-3000:]
    message = done.stdout
    assert "no space left (or quota exceeded)" in message, message
    assert f"({disk}/ckpt/step-000000001/" in message, message
    assert str(staging) not in message, message
