"""A filesystem folder as a checkpoint store (local disk, NFS, a mounted volume).

Atomicity comes from the filesystem: every object is written to a temp name in the same folder,
fsynced and renamed into place; the create-only commit links the temp file to its final name,
which fails if the name exists. ``put_file`` hard-links the staged file when staging and
destination share a filesystem, so committing a checkpoint costs no second copy of its bytes.
"""

from __future__ import annotations

import builtins
import errno
import functools
import logging
import os
import shutil
import stat
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TypeVar

from agent.atomic_file import sync_fd, sync_folder, temp_name, write_atomic, write_temp
from agent.crc32c import CHUNK, crc32c_bytes, to_hex
from agent.mounts import mount_of
from agent.settings import StorageEnv, load
from agent.storage._errors import local_file, translate_os_error
from agent.storage._retry import retry_transient
from agent.storage.base import (
    DEFAULT_PARALLELISM,
    AlreadyExistsError,
    CorruptObjectError,
    NotFoundError,
    ObjectInfo,
    PermanentStorageError,
    ProgressFn,
    Storage,
    StorageError,
    StrList,
    TooLargeError,
)

T = TypeVar("T")

log = logging.getLogger(__name__)

_TMP_MARK = ".spotjob-tmp-"
_ABSENT = (errno.ENOENT, errno.ENOTDIR)
"""A missing name, or a file where a folder of the path should be: the key does not exist."""
_NO_HARD_LINKS = frozenset({errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS})
"""What ``link(2)`` says on a filesystem without hard links (FAT, FUSE mounts of buckets): ``EPERM``
("does not support the creation of hard links"), or ``ENOTSUP`` / ``ENOSYS`` from a FUSE server.
A permission problem would have failed the temp file's creation in the same folder first."""


_fsync_dir = sync_folder


class FileStorage(Storage):
    """A folder as a checkpoint store. Every ``OSError`` leaves it as a ``StorageError``
    (``agent.storage._errors``): a root that is a regular file, permission denied, a full disk."""

    def __init__(self, root: str) -> None:
        # The retry policy is read at the first transient fault, mid-save: refuse a malformed
        # SPOTJOB_STORAGE_* now, by name, as the object stores do when they read their settings.
        load(StorageEnv)
        self.root = os.path.abspath(root)
        self.uri = "file://" + self.root

    def _path(self, key: str) -> str:
        if key.startswith("/") or ".." in key.split("/"):
            raise PermanentStorageError(f"key {key!r} escapes the storage root", key)
        return os.path.join(self.root, key) if key else self.root

    def _tmp_for(self, path: str) -> str:
        return temp_name(path, _TMP_MARK)

    def local_path(self, key: str) -> str | None:
        return self._path(key)

    # -- errors ------------------------------------------------------------------------------
    def _root_is_a_file(self) -> bool:
        return os.path.lexists(self.root) and not os.path.isdir(self.root)

    def _error(self, e: OSError, what: str, key: str | None) -> StorageError:
        if e.errno in (errno.ENOTDIR, errno.EEXIST) and self._root_is_a_file():
            return PermanentStorageError(
                f"{self.uri} is a regular file, not a folder: a checkpoint URI names a folder "
                "(a new or an existing one); choose another path",
                key,
            )
        if e.errno in (errno.ENOTDIR, errno.EEXIST, errno.EISDIR):
            return PermanentStorageError(f"{what}: a file or folder is in the way ({e.filename})", key)
        return translate_os_error(e, what, key)

    def _run(self, what: str, key: str | None, fn: Callable[[], T]) -> T:
        """``fn`` with its ``OSError`` translated, transient ones retried (NFS, a flaky mount)."""

        def attempt() -> T:
            try:
                return fn()
            except OSError as e:
                raise self._error(e, what, key) from e

        return retry_transient(what, attempt)

    def _check_root(self) -> None:
        if self._root_is_a_file():
            raise self._error(OSError(errno.ENOTDIR, "Not a directory", self.root), f"cannot use {self.uri}", None)

    # -- writes ------------------------------------------------------------------------------
    def put_file(
        self,
        local_path: str,
        key: str,
        *,
        crc32c: int | None = None,
        progress: ProgressFn | None = None,
        sync: bool = True,
        synced: bool = False,
    ) -> None:
        """``sync=False`` (``put_files``) leaves the folder's sync to the caller; ``synced``: the
        caller made ``local_path``'s bytes durable already (see ``_place``)."""
        dest = self._path(key)
        with local_file(f"cannot read the local file {local_path}", key):
            os.stat(local_path)

        def put() -> None:
            created = self._makedirs(os.path.dirname(dest))
            self._place(local_path, dest, synced=synced)
            if sync:
                _fsync_dir(os.path.dirname(dest))
                if created:
                    _fsync_dir(os.path.dirname(os.path.dirname(dest)))

        self._run(f"cannot write {self.url(key)}", key, put)
        if progress:
            progress(os.path.getsize(local_path))

    def put_files(
        self,
        files: Sequence[tuple[str, str, int | None]],
        *,
        progress: ProgressFn | None = None,
        parallelism: int = DEFAULT_PARALLELISM,
        synced: bool = False,
    ) -> None:
        """Link (or copy) every file into place, then sync each folder touched once: one journal
        commit for the batch instead of one per file (a checkpoint's files share a folder).
        ``synced`` files (fsynced by the caller) get no sync of their own (see ``_place``)."""
        folders = {os.path.dirname(self._path(key)) for _, key, _ in files}
        new = {f for f in folders if not os.path.isdir(f)}
        for local_path, key, crc in files:
            self.put_file(local_path, key, crc32c=crc, progress=progress, sync=False, synced=synced)

        def sync() -> None:
            for folder in sorted(folders):
                _fsync_dir(folder)
            for parent in sorted({os.path.dirname(f) for f in new}):
                _fsync_dir(parent)

        self._run(f"cannot write {self.uri}", None, sync)

    def _place(self, local_path: str, dest: str, *, synced: bool = False) -> None:
        """Put ``local_path``'s bytes at ``dest`` (a hard link, else a copy), durable, renamed into place.
        The folder's own sync is the caller's.

        A link of a ``synced`` file (its bytes fsynced by the caller) is not synced again: the
        link changed the inode (its link count), so that sync would wait for a journal commit of
        its own, one per file, while the folder's sync the caller does next commits the link
        (the folder entry and the inode's count change in one operation) along with the others.
        A copy is always synced: its bytes are new."""
        tmp = self._tmp_for(dest)
        linked = False
        try:
            try:
                os.link(local_path, tmp)
                linked = True
            except FileExistsError:
                # The temp name is fresh: taken, it is this link, made by an NFS server whose reply
                # was lost (the retransmission found the name).
                if not _same_file(local_path, tmp):
                    raise
                linked = True
            except OSError as e:
                if e.errno not in (errno.EXDEV, errno.EMLINK, *_NO_HARD_LINKS):
                    raise
                try:
                    shutil.copyfile(local_path, tmp)
                except OSError as copy_error:
                    if copy_error.errno not in (errno.ENOSPC, errno.EDQUOT):
                        raise
                    # shutil names the file it read (the staged shard, on another disk) in the
                    # error; the disk that is full is the one written to.
                    raise OSError(copy_error.errno, copy_error.strerror, dest) from copy_error
            if not (linked and synced):
                with open(tmp, "rb") as f:
                    sync_fd(f.fileno())
            os.replace(tmp, dest)
        except BaseException:
            _unlink_quiet(tmp)
            raise

    def put_bytes(self, key: str, data: bytes) -> None:
        dest = self._path(key)

        def put() -> None:
            self._makedirs(os.path.dirname(dest))
            write_atomic(dest, data, mark=_TMP_MARK)

        self._run(f"cannot write {self.url(key)}", key, put)

    def put_bytes_if_absent(self, key: str, data: bytes) -> None:
        """Create-only: link a temp file to the final name, which fails if the name exists.

        A link answered ``EEXIST`` whose name is the temp file's own inode was made by this very
        call (NFS: the reply was lost and the retransmitted request found the name taken).
        An attempt that fails once it has tried the link (the folder's sync failing, an NFS
        reply lost) may have created the file. If a later attempt's link then finds the name
        taken, the file is read back: holding exactly ``data``, it is our own earlier write and
        the call succeeds, as in ``S3Storage``; anything else is ``AlreadyExistsError``.
        """
        dest = self._path(key)
        linked = False  # some attempt got as far as the link, so the file may be ours

        def put() -> None:
            nonlocal linked
            ours_maybe = linked
            self._makedirs(os.path.dirname(dest))
            tmp = self._write_tmp(dest, data)
            try:
                linked = True
                os.link(tmp, dest)  # fails with EEXIST if the name exists: the create-only commit
            except OSError as e:
                if e.errno in _NO_HARD_LINKS:
                    raise self._no_hard_links(key, e) from e
                if not isinstance(e, FileExistsError):
                    raise
                if _same_file(tmp, dest):
                    # NFS: the server made the link, its reply was lost, and the client's retry was
                    # answered EEXIST. The temp file's inode is the name's: the link is ours (the
                    # check open(2) gives for NFS).
                    log.info("create-only write of %s: the link was made, its reply lost; done", self.url(key))
                elif not (ours_maybe and _holds(dest, data)):
                    raise AlreadyExistsError(f"{self.url(key)} already exists; refusing to overwrite it", key) from None
                else:
                    log.info("create-only write of %s: an earlier attempt had already created it; done", self.url(key))
            finally:
                os.unlink(tmp)
            _fsync_dir(os.path.dirname(dest))  # also when an earlier attempt linked it: its sync failed

        self._run(f"cannot write {self.url(key)}", key, put)

    def _no_hard_links(self, key: str, e: OSError) -> PermanentStorageError:
        """The create-only write needs ``link(2)``: no other call creates a name atomically and
        only if absent on every filesystem (``O_EXCL`` shows a reader the file before its bytes,
        and a crash then leaves a half-written manifest that blocks every restore)."""
        mount = mount_of(self.root)
        fs = f"a {mount.fstype} filesystem mounted at {mount.mount_point}" if mount else "a filesystem"
        return PermanentStorageError(
            f"cannot write {self.url(key)}: {self.root} is on {fs} without hard links "
            f"({e.strerror or errno.errorcode.get(e.errno or 0, e.errno)}), which spotjob's create-only "
            "writes (the URI's claim, each checkpoint's commit) need. FUSE mounts of buckets (gcsfuse, "
            "s3fs, mountpoint-s3) and FAT/exFAT have none: use the bucket's s3:// or gs:// URI instead, "
            "or a folder on a filesystem with hard links (a local disk, NFS, Lustre, tmpfs)",
            key,
        )

    def _makedirs(self, folder: str) -> bool:
        """Create ``folder`` (and its parents); True when it did not exist (its parent then needs a sync)."""
        self._check_root()
        if os.path.isdir(folder):
            return False
        os.makedirs(folder, exist_ok=True)
        return True

    def _write_tmp(self, dest: str, data: bytes) -> str:
        return write_temp(dest, data, mark=_TMP_MARK)

    # -- reads -------------------------------------------------------------------------------
    def _open_to_read(self, key: str) -> int:
        """The descriptor of ``key``'s regular file, opened to read; ``NotFoundError`` if missing."""
        self._check_root()
        try:
            return self._open_regular(self._path(key), key)
        except OSError as e:
            if e.errno in _ABSENT:
                raise NotFoundError(f"{self.url(key)} does not exist", key) from None
            raise

    def get_bytes(self, key: str) -> bytes:
        def read() -> bytes:
            with open(self._open_to_read(key), "rb") as f:
                return f.read()

        return self._run(f"cannot read {self.url(key)}", key, read)

    def get_small(self, key: str, max_bytes: int) -> tuple[bytes, ObjectInfo]:
        """One open: its size and time from the open file, refused unread when too big, and never
        more than ``max_bytes + 1`` bytes read (the file may grow while read)."""

        def read() -> tuple[bytes, ObjectInfo]:
            with open(self._open_to_read(key), "rb") as f:
                st = os.fstat(f.fileno())
                if st.st_size > max_bytes:
                    raise TooLargeError(
                        f"{self.url(key)} is {st.st_size} bytes, more than {max_bytes}", key, st.st_size
                    )
                data = f.read(max_bytes + 1)
            if len(data) > max_bytes:
                raise TooLargeError(f"{self.url(key)} is more than {max_bytes} bytes", key)
            return data, ObjectInfo(key, len(data), st.st_mtime)

        return self._run(f"cannot read {self.url(key)}", key, read)

    def get_file(
        self,
        key: str,
        local_path: str,
        *,
        size: int | None = None,
        crc32c: int | None = None,
        progress: ProgressFn | None = None,
    ) -> None:
        src = self._path(key)
        what = f"cannot read {self.url(key)}"

        def open_src() -> int:
            self._check_root()
            try:
                return self._open_regular(src, key)
            except OSError as e:
                if e.errno in _ABSENT:
                    raise NotFoundError(f"{self.url(key)} does not exist", key) from None
                raise

        fd = self._run(what, key, open_src)
        tmp = local_path + f".{uuid.uuid4().hex[:8]}.part"
        crc = 0
        got = 0
        try:
            with open(fd, "rb") as fin:
                with local_file(f"cannot write the local file {tmp}", key):
                    fout = open(tmp, "wb")  # noqa: SIM115 - closed below, errors translated apart
                with fout:
                    while True:
                        with local_file(what, key):
                            chunk = fin.read(CHUNK)
                        if not chunk:
                            break
                        crc = crc32c_bytes(chunk, crc)
                        got += len(chunk)
                        with local_file(f"cannot write the local file {tmp}", key):
                            fout.write(chunk)
                        if progress:
                            progress(len(chunk))
        except BaseException:
            _unlink_quiet(tmp)
            raise
        if size is not None and got != size:
            _unlink_quiet(tmp)
            raise CorruptObjectError(f"{self.url(key)} is {got} bytes, the manifest says {size}", key)
        if crc32c is not None and crc != crc32c:
            _unlink_quiet(tmp)
            raise CorruptObjectError(
                f"{self.url(key)} has CRC32C {to_hex(crc)}, the manifest says {to_hex(crc32c)}", key
            )
        with local_file(f"cannot write the local file {local_path}", key):
            os.replace(tmp, local_path)

    def _open_regular(self, path: str, key: str) -> int:
        """Open ``path`` for reading, refusing anything but a regular file. Whoever can write in
        the folder could plant a FIFO (a plain ``open`` waits for a writer for ever) or a link to a
        device where a checkpoint file belongs: opened without blocking, checked, then read."""
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            mode = os.fstat(fd).st_mode
            if not stat.S_ISREG(mode):
                raise CorruptObjectError(
                    f"{self.url(key)} is {_kind(mode)}, not a regular file: spotjob writes no such thing, so "
                    "someone else put it there; remove it",
                    key,
                )
            os.set_blocking(fd, True)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def stat(self, key: str) -> ObjectInfo | None:
        path = self._path(key)

        def stat_key() -> ObjectInfo | None:
            self._check_root()
            try:
                st = os.stat(path)
            except OSError as e:
                if e.errno in _ABSENT:
                    return None
                raise
            return ObjectInfo(key, st.st_size, st.st_mtime)

        return self._run(f"cannot read {self.url(key)}", key, stat_key)

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        base = self._path(prefix.rsplit("/", 1)[0] if "/" in prefix else "")
        what = f"cannot list {self.url(prefix)}"

        def is_folder() -> bool:
            self._check_root()
            try:
                return stat.S_ISDIR(os.stat(base).st_mode)
            except OSError as e:
                if e.errno in _ABSENT:
                    return False
                raise  # permission denied on the way there is not "nothing there"

        if not self._run(what, None, is_folder):
            return

        def walk_error(e: OSError) -> None:
            if e.errno not in _ABSENT:  # a folder removed while we walk is simply gone
                raise e

        try:
            for folder, _dirs, files in os.walk(base, onerror=walk_error):
                for name in files:
                    if name.startswith(_TMP_MARK):
                        continue
                    full = os.path.join(folder, name)
                    key = os.path.relpath(full, self.root).replace(os.sep, "/")
                    if key.startswith(prefix):
                        try:
                            info = os.stat(full)
                        except OSError as e:
                            if e.errno not in _ABSENT:
                                raise
                            continue
                        # A FIFO, socket or device (or a link to one) is no object: reading it
                        # could wait for ever, so no reader is ever pointed at it.
                        if stat.S_ISREG(info.st_mode):
                            yield ObjectInfo(key, info.st_size, info.st_mtime)
        except OSError as e:
            raise self._error(e, what, None) from e

    def list_dirs(self, prefix: str = "") -> StrList:
        base = self._path(prefix.rstrip("/"))

        def scan() -> builtins.list[str]:
            self._check_root()
            try:
                with os.scandir(base) as entries:
                    return sorted(e.name for e in entries if e.is_dir())
            except OSError as e:
                if e.errno in _ABSENT:
                    return []
                raise

        return self._run(f"cannot list {self.url(prefix)}", None, scan)

    # -- deletes -----------------------------------------------------------------------------
    # Deleting never follows a symlink: whoever can write in a shared checkpoint folder could
    # plant ``step-…`` links into folders only the job's user may change. A key behind a symlinked
    # folder is no object of this store; a symlinked folder itself is removed as the link it is.
    def delete(self, keys: Iterable[str]) -> None:
        for key in keys:
            self._path(key)  # refuses a key that escapes the root
            self._run(
                f"cannot delete {self.url(key)}", key, functools.partial(_unlink_not_through_links, self.root, key)
            )

    def delete_prefix(self, prefix: str) -> None:
        folder = self._path(prefix.rstrip("/"))
        if os.path.islink(folder):
            self._run(f"cannot delete {self.url(prefix)}", None, functools.partial(_unlink_absent_ok, folder))
            return
        super().delete_prefix(prefix)
        # Remove the emptied folders too (and any temp files a killed writer left behind). rmtree
        # removes a symlink inside as a link, never what it points at.
        shutil.rmtree(folder, ignore_errors=True)


def _same_file(a: str, b: str) -> bool:
    """Whether ``a`` and ``b`` are names of one file (False when either is gone)."""
    try:
        return os.path.samestat(os.stat(a), os.stat(b))
    except OSError as e:
        if e.errno in _ABSENT:
            return False
        raise


def _holds(path: str, data: bytes) -> bool:
    """After an ambiguous create-only failure: is the file there with exactly our bytes?"""
    try:
        with open(path, "rb") as f:
            return f.read() == data
    except OSError as e:
        if e.errno in (*_ABSENT, errno.EISDIR):
            return False
        raise


def _kind(mode: int) -> str:
    """What a non-regular file is, in words."""
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISDIR(mode):
        return "a folder"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    return "something other than a file"


def _unlink_absent_ok(path: str) -> None:
    try:
        os.unlink(path)
    except OSError as e:
        if e.errno not in _ABSENT:
            raise


def _unlink_not_through_links(root: str, key: str) -> None:
    """Unlink ``root/key``, opening each folder of ``key`` with ``O_NOFOLLOW``: a folder on the way
    that is a symlink (or gone) means the key is not there, and nothing behind it is touched."""
    *folders, name = key.split("/")
    try:
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as e:
        if e.errno in _ABSENT:
            return
        raise
    try:
        for folder in folders:
            try:
                inner = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            except OSError as e:
                if e.errno in (*_ABSENT, errno.ELOOP):
                    return
                raise
            os.close(fd)
            fd = inner
        try:
            os.unlink(name, dir_fd=fd)
        except OSError as e:
            if e.errno not in _ABSENT:
                raise
    finally:
        os.close(fd)


def _unlink_quiet(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
