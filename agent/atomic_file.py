"""Writing a small file so that a reader sees the old one or the new one, never a part of either.

The one way spotjob does it (the storage's objects, the agent's control files, the controller's
job records, the run token): the bytes go to a temporary file in the destination's own folder
(created exclusively, with the file's final mode from the start), are fsynced when the write must
survive a crash, and are renamed over the destination; a durable write then syncs the folder, so
the rename itself survives. A failure removes the temporary file. No torch, no cloud SDK: both
halves of spotjob use it.

Every fsync of spotjob's commit path goes through ``sync_fd``: on macOS ``fsync(2)`` only hands
the bytes to the drive, whose cache may still lose them at a power cut; ``fcntl(F_FULLFSYNC)``
also flushes that cache, and is what SQLite and PostgreSQL use there for durability.

Logs of JSON lines (a local run's Events and timeline) are appended instead (``append_line``).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import uuid

_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


def sync_fd(fd: int) -> None:
    """Make the file (or folder) open at ``fd`` durable: ``fcntl(F_FULLFSYNC)`` where the platform
    has it (macOS, whose ``fsync`` leaves the bytes in the drive's cache), else ``os.fsync``.

    A filesystem that does not support ``F_FULLFSYNC`` (SMB and some network and FUSE mounts on
    macOS say ``ENOTSUP`` or ``EINVAL``) gets a plain ``fsync`` instead, as in SQLite: the most
    that filesystem offers. Any other error of it (``EIO``, ``ENOSPC``) is raised, not retried
    with ``fsync``, which could then report success for bytes that were lost. ``OSError``.
    """
    full = getattr(fcntl, "F_FULLFSYNC", None)  # looked up per call: a test simulates macOS
    if full is not None:
        try:
            fcntl.fcntl(fd, full)
            return
        except OSError as e:
            if e.errno not in _FULLFSYNC_UNSUPPORTED:
                raise
    os.fsync(fd)


_FULLFSYNC_UNSUPPORTED = frozenset({errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOTTY, errno.ENOSYS})
"""What ``fcntl(F_FULLFSYNC)`` says on a filesystem that cannot do it: then ``fsync`` is the most there is."""


def temp_name(path: str, mark: str = "") -> str:
    """A fresh hidden name beside ``path`` for its temporary file: ``<mark><name>.<random>.tmp``
    (``mark`` defaults to ``.``; a store that lists its folder skips names that start with it)."""
    folder, name = os.path.split(path)
    return os.path.join(folder, f"{mark or '.'}{name}.{uuid.uuid4().hex[:8]}.tmp")


def write_temp(path: str, data: bytes, *, durable: bool = True, mode: int = 0o644, mark: str = "") -> str:
    """Write ``data`` to a new temporary file beside ``path`` and return its name; the caller renames
    (``os.replace``) or links it into place. Created exclusively with ``mode`` (never a file that
    was there, never readable more widely than ``mode`` at any moment); fsynced when ``durable``."""
    tmp = temp_name(path, mark)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_CLOEXEC, mode)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        if durable:
            sync_fd(fd)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    os.close(fd)
    return tmp


def sync_folder(path: str) -> None:
    """fsync a folder (``sync_fd``), so that names created, renamed or removed in it survive a crash.

    A filesystem that cannot sync a folder says so with ``EINVAL`` (some FUSE and network
    filesystems: their names are made durable by the operation itself, on the server, or not at
    all); that is no failure of the write, as for PostgreSQL's ``fsync_fname``. Any other error is
    raised.
    """
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | _O_CLOEXEC)
    try:
        sync_fd(fd)
    except OSError as e:
        if e.errno != errno.EINVAL:
            raise
    finally:
        os.close(fd)


def write_atomic(path: str, data: bytes, *, durable: bool = True, mode: int = 0o644, mark: str = "") -> None:
    """Replace ``path`` with ``data`` in one rename (see the module docstring).

    ``durable=False`` keeps the all-or-nothing rename but skips both fsyncs: for files rewritten
    every second whose loss in a crash costs nothing (status files). Raises ``OSError``.
    """
    tmp = write_temp(path, data, durable=durable, mode=mode, mark=mark)
    try:
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    if durable:
        sync_folder(os.path.dirname(os.path.abspath(path)))


def append_line(path: str, line: str) -> None:
    """Append ``line`` and a newline to the JSON-lines file at ``path``, as one ``write``.

    A line an earlier writer left cut short (a full disk, a file-size limit, a process killed in
    the middle of a long write) has no newline: it is ended first, so this line is not glued to it
    and lost with it (readers skip a line that does not parse). Not atomic against a crash, which
    may still cut this line; its reader skips what is cut. ``OSError``.
    """
    with open(path, "ab+") as f:
        end = f.seek(0, os.SEEK_END)
        torn = False
        if end:
            f.seek(end - 1)
            torn = f.read(1) != b"\n"
        f.write((("\n" if torn else "") + line + "\n").encode())
