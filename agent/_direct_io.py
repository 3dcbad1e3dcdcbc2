"""Writing a shard with ``O_DIRECT``: from memory to the disk without going through the page cache.

A buffered write copies every byte into freshly allocated page-cache pages, which the kernel then
has to write back and, under memory pressure, reclaim; the fsync at the end waits for all of it.
On the node-local disks a flush lands on, that allocation and writeback, not the disk, is often
what limits a save (bench/README.md measures both). ``DirectWriter`` instead copies the bytes
into a few page-aligned buffers kept between saves and has a thread of its own write each full
buffer to the disk with ``O_DIRECT`` while the next one is filled. Nothing of the checkpoint stays
in the page cache (the node restoring it is another one anyway), and the fsync that follows only
has metadata and the disk's own cache left to flush.

``O_DIRECT`` needs aligned memory, offsets and lengths: every buffer is page-aligned and a multiple
of ``ALIGN`` long, full buffers go out back to back, and the last one is padded with zeros to
``ALIGN`` and the file cut back to its real size afterwards. A filesystem that refuses ``O_DIRECT``
(``EINVAL``) at open gets a buffered file instead (``open_direct`` returns None); one that
refuses it later, at a write, gets the rest of the file through a plain descriptor.

``suits_direct_io`` is the default: local block filesystems (ext4, XFS, btrfs, f2fs) yes; network,
FUSE, overlay and memory filesystems no, their ``O_DIRECT`` being missing, slow or emulated.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import queue
import threading

from agent.mounts import mount_of

ALIGN = 4096
"""Offsets and lengths of direct writes are multiples of this (the largest common logical block)."""
BLOCK = 16 * 1024 * 1024
"""Bytes per direct write: each buffer's size."""
DEPTH = 3
"""Buffers per file: one being filled, up to two being written."""
DIRECT_MIN_BYTES = 256 * 1024 * 1024
"""Below this many tensor bytes a file is written through the page cache even where ``O_DIRECT``
is the default. Each direct write waits for the disk, and the file's first block is filled before
the disk gets any work; a small file's buffered writes land in the page cache at memory speed
(a buffered save holds at most ``ChecksummedFile.WRITEBACK_LAG`` blocks of it and drops them once
written back) and the disk writes it while the save goes on, as the raw write it is measured
against does. At 0.1 and 0.2 GB, the buffered save committed 10-30 ms sooner in every paired run
on the project's test VM; bench/README.md. ``direct_io=True`` writes every file directly."""

LOCAL_BLOCK_FILESYSTEMS = frozenset({"ext2", "ext3", "ext4", "xfs", "btrfs", "f2fs"})

_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


def filesystem_type(path: str, mounts: str | None = None) -> str | None:
    """The type of the filesystem holding ``path`` (``agent.mounts.mount_of``); None where it cannot be told."""
    mount = mount_of(path, mounts)
    return mount.fstype if mount else None


def suits_direct_io(path: str, mounts: str | None = None) -> bool:
    """Whether saves into ``path`` should use ``O_DIRECT`` by default: Linux, on a local block filesystem."""
    if not hasattr(os, "O_DIRECT"):
        return False
    return filesystem_type(path, mounts) in LOCAL_BLOCK_FILESYSTEMS


class _BufferPool:
    """Page-aligned ``BLOCK``-sized buffers kept between saves, so a save does not allocate (and,
    on a VM, first-touch) them again. At most ``keep`` are kept; ``release()`` frees them."""

    def __init__(self, keep: int) -> None:
        self._keep = keep
        self._free: list[mmap.mmap] = []
        self._lock = threading.Lock()

    def take(self, n: int) -> list[mmap.mmap]:
        with self._lock:
            taken = [self._free.pop() for _ in range(min(n, len(self._free)))]
        return taken + [mmap.mmap(-1, BLOCK) for _ in range(n - len(taken))]

    def give(self, buffers: list[mmap.mmap]) -> None:
        with self._lock:
            while buffers and len(self._free) < self._keep:
                self._free.append(buffers.pop())
        for extra in buffers:
            _close(extra)

    def release(self) -> None:
        with self._lock:
            free, self._free = self._free, []
        for buffer in free:
            _close(buffer)


def _close(buffer: mmap.mmap) -> None:
    """Unmap now, or, while a view of it is still alive (an error's traceback can hold one), when
    the last reference goes."""
    with contextlib.suppress(BufferError):
        buffer.close()


_POOL = _BufferPool(keep=2 * DEPTH)


def release_buffers() -> None:
    """Free the direct-write buffers kept between saves (``release_staging``)."""
    _POOL.release()


def open_direct(path: str) -> DirectWriter | None:
    """A new file at ``path`` written through ``DirectWriter``, or None where the filesystem
    refuses ``O_DIRECT`` (the caller then writes it buffered)."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return None
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | _O_CLOEXEC | flag, 0o644)
    except OSError as e:
        if e.errno == errno.EINVAL:
            return None
        raise
    return DirectWriter(fd, path)


class DirectWriter:
    """Writes a new file's bytes, in order, through ``DEPTH`` aligned buffers and a writer thread.

    ``write`` copies into the buffer being filled and hands each full one to the thread, waiting
    only when every buffer is still being written (so the disk sets the pace, and memory stays at
    ``DEPTH * BLOCK``). A write error is kept and raised by the next ``write`` and by ``finish``.
    ``finish(size)`` writes the rest and cuts the file to ``size``; it does not fsync (the
    Checkpointer fsyncs every file of a save together). ``abort`` stops without finishing.
    Owns the descriptor: ``close`` closes it.
    """

    def __init__(self, fd: int, path: str) -> None:
        self.fd = fd
        self.path = path
        self.direct = True
        """False once the filesystem refused a direct write and the rest went through a plain descriptor."""
        self.error: BaseException | None = None
        self._buffers = _POOL.take(DEPTH)
        self._views = [memoryview(b) for b in self._buffers]
        self._free: queue.SimpleQueue[int] = queue.SimpleQueue()
        for i in range(DEPTH):
            self._free.put(i)
        self._full: queue.SimpleQueue[tuple[int, int, int] | None] = queue.SimpleQueue()
        self._current: int | None = None
        self._fill = 0
        self._offset = 0
        self._thread: threading.Thread | None = threading.Thread(
            target=self._run, name="spotjob-direct-write", daemon=True
        )
        self._thread.start()

    def write(self, data: memoryview) -> None:
        view = data.cast("B") if data.format != "B" or data.ndim != 1 else data
        while view:
            self.check()
            if self._current is None:
                self._current = self._free.get()
                self._fill = 0
            n = min(BLOCK - self._fill, view.nbytes)
            self._views[self._current][self._fill : self._fill + n] = view[:n]
            self._fill += n
            view = view[n:]
            if self._fill == BLOCK:
                self._submit(BLOCK)

    def check(self) -> None:
        if self.error is not None:
            raise self.error

    def _submit(self, length: int) -> None:
        assert self._current is not None
        self._full.put((self._current, self._offset, length))
        self._offset += length
        self._current = None
        self._fill = 0

    def _run(self) -> None:
        while True:
            item = self._full.get()
            if item is None:
                return
            index, offset, length = item
            if self.error is None:
                try:
                    self._pwrite(self._views[index][:length], offset)
                except BaseException as e:
                    self.error = e
            self._free.put(index)

    def _pwrite(self, view: memoryview, offset: int) -> None:
        while view:
            try:
                n = os.pwrite(self.fd, view, offset)
            except OSError as e:
                if e.errno != errno.EINVAL or not self.direct:
                    raise
                self._without_direct()
                continue
            view = view[n:]
            offset += n

    def _without_direct(self) -> None:
        """The filesystem took the open but refuses the write: the rest goes through the page cache."""
        plain = os.open(self.path, os.O_WRONLY | _O_CLOEXEC)
        os.close(self.fd)
        self.fd = plain
        self.direct = False

    def _stop(self) -> None:
        thread, self._thread = self._thread, None
        if thread is not None:
            self._full.put(None)
            thread.join()
            buffers, self._buffers = self._buffers, []
            self._views = []
            _POOL.give(buffers)

    def finish(self, size: int) -> None:
        """Write what is left and cut the file to ``size`` bytes (everything ``write`` was given)."""
        try:
            if self._current is not None and self._fill and self.error is None:
                length = -(-self._fill // ALIGN) * ALIGN
                self._views[self._current][self._fill : length] = bytes(length - self._fill)
                self._submit(length)
        finally:
            self._stop()
        self.check()
        if self._offset != size:
            os.ftruncate(self.fd, size)

    def abort(self) -> None:
        self._stop()

    def close(self) -> None:
        self._stop()
        if self.fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self.fd)
            self.fd = -1
