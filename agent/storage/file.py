"""A filesystem folder as a checkpoint store (local disk, NFS, a mounted volume).

Atomicity comes from the filesystem: every object is written to a temp name in the same folder,
fsynced and renamed into place; the create-only commit links the temp file to its final name,
which fails if the name exists. ``put_file`` hard-links the staged file when staging and
destination share a filesystem, so committing a checkpoint costs no second copy of its bytes.
"""

from __future__ import annotations

import errno
import os
import shutil
import uuid
from collections.abc import Iterable, Iterator

from agent.crc32c import CHUNK, crc32c_bytes, to_hex
from agent.storage.base import (
    AlreadyExistsError,
    CorruptObjectError,
    NotFoundError,
    ObjectInfo,
    PermanentStorageError,
    ProgressFn,
    Storage,
    StrList,
)

_TMP_MARK = ".spotjob-tmp-"


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class FileStorage(Storage):
    def __init__(self, root: str) -> None:
        self.root = os.path.abspath(root)
        self.uri = "file://" + self.root

    def _path(self, key: str) -> str:
        if key.startswith("/") or ".." in key.split("/"):
            raise PermanentStorageError(f"key {key!r} escapes the storage root", key)
        return os.path.join(self.root, key) if key else self.root

    def _tmp_for(self, path: str) -> str:
        folder, name = os.path.split(path)
        return os.path.join(folder, f"{_TMP_MARK}{name}.{uuid.uuid4().hex[:8]}")

    def local_path(self, key: str) -> str | None:
        return self._path(key)

    # -- writes ------------------------------------------------------------------------------
    def put_file(
        self,
        local_path: str,
        key: str,
        *,
        crc32c: int | None = None,
        progress: ProgressFn | None = None,
    ) -> None:
        dest = self._path(key)
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        tmp = self._tmp_for(dest)
        try:
            os.link(local_path, tmp)
        except OSError as e:
            if e.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP):
                raise
            shutil.copyfile(local_path, tmp)
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
        else:
            # The link shares the staged file's inode: make sure its bytes are on disk.
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
        os.replace(tmp, dest)
        _fsync_dir(os.path.dirname(dest))
        if progress:
            progress(os.path.getsize(dest))

    def put_bytes(self, key: str, data: bytes) -> None:
        dest = self._path(key)
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        tmp = self._write_tmp(dest, data)
        os.replace(tmp, dest)
        _fsync_dir(os.path.dirname(dest))

    def put_bytes_if_absent(self, key: str, data: bytes) -> None:
        dest = self._path(key)
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        tmp = self._write_tmp(dest, data)
        try:
            os.link(tmp, dest)  # fails with EEXIST if the name exists: the create-only commit
        except FileExistsError:
            raise AlreadyExistsError(f"{self.url(key)} already exists; refusing to overwrite it", key) from None
        finally:
            os.unlink(tmp)
        _fsync_dir(os.path.dirname(dest))

    def _write_tmp(self, dest: str, data: bytes) -> str:
        tmp = self._tmp_for(dest)
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        return tmp

    # -- reads -------------------------------------------------------------------------------
    def get_bytes(self, key: str) -> bytes:
        try:
            with open(self._path(key), "rb") as f:
                return f.read()
        except FileNotFoundError:
            raise NotFoundError(f"{self.url(key)} does not exist", key) from None

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
        tmp = local_path + f".{uuid.uuid4().hex[:8]}.part"
        crc = 0
        got = 0
        try:
            with open(src, "rb") as fin, open(tmp, "wb") as fout:
                while chunk := fin.read(CHUNK):
                    crc = crc32c_bytes(chunk, crc)
                    got += len(chunk)
                    fout.write(chunk)
                    if progress:
                        progress(len(chunk))
        except FileNotFoundError:
            _unlink_quiet(tmp)
            raise NotFoundError(f"{self.url(key)} does not exist", key) from None
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
        os.replace(tmp, local_path)

    def stat(self, key: str) -> ObjectInfo | None:
        try:
            st = os.stat(self._path(key))
        except FileNotFoundError:
            return None
        return ObjectInfo(key, st.st_size)

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        base = self._path(prefix.rsplit("/", 1)[0] if "/" in prefix else "")
        if not os.path.isdir(base):
            return
        for folder, _dirs, files in os.walk(base):
            for name in files:
                if name.startswith(_TMP_MARK):
                    continue
                full = os.path.join(folder, name)
                key = os.path.relpath(full, self.root).replace(os.sep, "/")
                if key.startswith(prefix):
                    try:
                        yield ObjectInfo(key, os.path.getsize(full))
                    except FileNotFoundError:
                        continue

    def list_dirs(self, prefix: str = "") -> StrList:
        base = self._path(prefix.rstrip("/"))
        try:
            return sorted(e.name for e in os.scandir(base) if e.is_dir())
        except FileNotFoundError:
            return []

    # -- deletes -----------------------------------------------------------------------------
    def delete(self, keys: Iterable[str]) -> None:
        for key in keys:
            _unlink_quiet(self._path(key))

    def delete_prefix(self, prefix: str) -> None:
        super().delete_prefix(prefix)
        # Remove the emptied folders too (and any temp files a killed writer left behind).
        folder = self._path(prefix.rstrip("/"))
        shutil.rmtree(folder, ignore_errors=True)


def _unlink_quiet(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
