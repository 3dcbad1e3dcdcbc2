"""How the Checkpointer writes a DCP checkpoint's files into a rank's staging folder.

DCP's filesystem writer, except that tensors are serialized without torch.save's zip CRC-32 (the
manifest's CRC32C covers the files, computed as the bytes go out: ``ChecksummedFile``), by
building the zip writer per file instead of switching torch's process-wide option; writeback
starts as blocks are written and the files are fsynced together (``sync_files``). What is written
from which rank is planned in ``agent._dcp_plan``; an async save's host buffers are
``agent._staging``'s. Reading a checkpoint back, safely, is ``agent.dcp_safe``'s.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import dataclasses
import io
import os
import pickle
import queue
import threading
from typing import IO, Any

import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import (
    SavePlanner,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from agent import _direct_io
from agent._direct_io import open_direct
from agent.atomic_file import sync_fd
from agent.crc32c import crc32c_bytes, crc32c_file
from agent.manifest import DCP_METADATA_NAME
from agent.storage.base import parallel_map

# -- writing without the zip CRC-32, for spotjob's own files only ------------------------------


def _zip_writer_without_crc(stream: IO[bytes]) -> Any:
    """torch.save's zip writer with its CRC-32 switched off for this one file, or None.

    torch.save computes a CRC-32 per zip record when the process-wide option says so
    (``torch.serialization.set_crc32_options``); it costs about two thirds of a DCP write here
    (bench/README.md). spotjob's files are covered by the manifest's CRC32C, so their CRC-32 is
    skipped — by building the writer ourselves rather than flipping the option, which would
    switch it off for the user's own ``torch.save`` calls and threads too. None when this torch's
    writer does not take the argument (then torch.save is used as is).
    """
    try:
        return torch._C.PyTorchFileWriter(stream, False, torch.serialization._get_storage_alignment())
    except (TypeError, AttributeError):
        return None


def save_without_crc(obj: Any, stream: IO[bytes]) -> None:
    """``torch.save(obj, stream)`` minus the zip records' CRC-32; ``torch.load`` reads either."""
    writer = _zip_writer_without_crc(stream)
    if writer is None:
        torch.save(obj, stream)
        return
    torch.serialization._save(obj, writer, pickle, torch.serialization.DEFAULT_PROTOCOL, False)
    writer.write_end_of_file()
    stream.flush()


def save_tensor_without_crc(tensor: torch.Tensor, stream: IO[bytes]) -> None:
    """``torch.save(tensor, stream)`` minus the zip records' CRC-32; ``torch.load`` reads either."""
    save_without_crc(tensor, stream)


SERIALIZE_IN_MEMORY_BELOW = 64 * 1024
"""Tensors of fewer bytes are serialized into memory first, then written in one call (``_Writer``)."""


class SaveCancelledError(Exception):
    """The save was given up while it was writing (a flush superseded it); nothing was committed."""


class _Writer(FileSystemWriter):
    """DCP's filesystem writer, single-threaded, in one pass over the bytes.

    The same file layout and records as DCP's (bytes values first, then tensors, one file per
    rank), so plain ``dcp.load`` reads the result; what differs is how the bytes go out:

    - tensors are serialized without torch.save's zip CRC-32 (``save_tensor_without_crc``);
    - every byte goes through a ``ChecksummedFile``: its CRC32C is computed as it is written, so
      the manifest's CRC needs no read-back pass. For a durable save the blocks go to the disk
      with ``O_DIRECT`` when ``direct`` is set (``agent._direct_io``: no page cache, the disk
      writing one block while the next is serialized); otherwise the kernel is told to start
      writing each block back as soon as it is written, so the disk works while the next block
      is serialized instead of all at the final fsync;
    - nothing is fsynced here: the Checkpointer fsyncs every file of a save together
      (``sync_files``), after the last one is written.

    A file with fewer than ``direct_min_bytes`` bytes of tensors is written without ``O_DIRECT``
    even when ``direct`` is set (``agent._direct_io.DIRECT_MIN_BYTES``).

    ``written`` maps each file's name to its (CRC32C, size); ``metadata`` is DCP's metadata as the
    coordinator wrote it. ``cancel``, when set, makes the write stop at the next block with
    ``SaveCancelledError``.
    """

    def __init__(
        self,
        path: str,
        *,
        durable: bool,
        direct: bool = False,
        direct_min_bytes: int = 0,
        cancel: threading.Event | None = None,
    ) -> None:
        super().__init__(path, single_file_per_rank=True, sync_files=False, thread_count=1)
        self.durable = durable
        self.direct = direct
        self.direct_min_bytes = direct_min_bytes
        self.cancel = cancel
        self.written: dict[str, tuple[int, int]] = {}
        self.metadata: Metadata | None = None

    def _write_data(self, planner: SavePlanner, file_queue: queue.Queue) -> Future[list[WriteResult]]:
        results: list[WriteResult] = []
        while True:
            try:
                path, storage_key, items = file_queue.get_nowait()
            except queue.Empty:
                break
            results += self._write_file(planner, str(path), storage_key, items)
        future: Future[list[WriteResult]] = Future()
        future.set_result(results)
        return future

    def _write_file(
        self, planner: SavePlanner, path: str, storage_key: str, items: list[WriteItem]
    ) -> list[WriteResult]:
        results = []
        tensor_bytes = sum(item.tensor_storage_size() or 0 for item in items)  # bytes values: None
        direct = self.direct and tensor_bytes >= self.direct_min_bytes
        with ChecksummedFile(path, writeback=self.durable, direct=direct, cancel=self.cancel) as stream:
            for item in items:
                if item.type == WriteItemType.BYTE_IO:
                    results.append(self._write_item(stream, planner.resolve_data(item), item, storage_key))
            for item in items:
                if item.type != WriteItemType.BYTE_IO:
                    data = planner.resolve_data(item)
                    assert isinstance(data, torch.Tensor)
                    tensor = data.detach().cpu()
                    if tensor.untyped_storage().size() != tensor.nbytes:
                        tensor = tensor.clone()  # a view: save only its own elements, as DCP does
                    results.append(self._write_item(stream, tensor, item, storage_key))
        self.written[os.path.basename(path)] = (stream.crc, stream.size)
        return results

    def _write_item(self, stream: Any, data: Any, item: WriteItem, storage_key: str) -> WriteResult:
        offset = stream.tell()
        target, descriptors = self.transforms.transform_save_stream(item, stream)
        if self.cancel is not None and self.cancel.is_set():
            raise SaveCancelledError(f"writing {stream.path} was given up: a newer save superseded it")
        if item.type == WriteItemType.BYTE_IO:
            target.write(data.getbuffer())
        elif data.nbytes < SERIALIZE_IN_MEMORY_BELOW:
            # torch's zip writer hands a record over in dozens of small writes (headers, names,
            # padding), each a Python call through ``target`` and ``ChecksummedFile.write``: for a
            # small tensor they cost more than its bytes. Gathered in memory, they go out in one.
            # The same bytes: the writer lays a record out from its own start, wherever it lands.
            buffer = io.BytesIO()
            save_tensor_without_crc(data, buffer)
            target.write(buffer.getbuffer())
        else:
            save_tensor_without_crc(data, target)
        target.close()
        stream.check()  # a failure inside torch's writer is raised here, once the writer is done
        length = stream.tell() - offset
        return WriteResult(
            index=item.index,
            size_in_bytes=length,
            storage_data=_StorageInfo(storage_key, offset, length, transform_descriptors=descriptors or None),
        )

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """(coordinator) DCP's own ``finish`` writes ``.metadata`` (a few KB); its CRC32C is taken from
        the file just written, while it is still in the page cache."""
        super().finish(metadata, results)
        # The shard files of each tensor, as DCP's finish just wrote them into .metadata. torch 2.13
        # fills them into ``metadata`` itself; torch 2.9.1 writes a copy (``dataclasses.replace``) and
        # leaves ``metadata`` without them, which gave every tensor of MANIFEST.json's index no files.
        # Built only where torch left them out: no per-save walk of every result under 2.13.
        self.metadata = (
            metadata
            if metadata.storage_data
            else dataclasses.replace(
                metadata, storage_data={wr.index: wr.storage_data for wr_list in results for wr in wr_list}
            )
        )
        path = os.path.join(str(self.path), DCP_METADATA_NAME)
        self.written[DCP_METADATA_NAME] = crc32c_file(path)


class ChecksummedFile:
    """A new file written through its descriptor, its CRC32C computed from the bytes as they go out.

    Small writes (torch.save's headers and pickles) are gathered into blocks; big ones (tensor
    storage, handed over as a memoryview of the tensor's own memory) go straight to ``os.write``
    in blocks of ``BLOCK`` bytes. With ``writeback``, each block is handed to the kernel's
    writeback at once (``sync_file_range(SYNC_FILE_RANGE_WRITE)``, Linux), so by the time the
    file is fsynced most of it is on disk already; and once ``WRITEBACK_LAG`` blocks are on their
    way, the oldest is waited for and dropped from the page cache (``finish_writeback``), so a
    save holds at most that much of the page cache however big it is: the kernel hands the same
    pages back for the next blocks instead of allocating (and, on a VM, first-touching) fresh
    ones, which is what made long buffered writes slow. With ``direct``, the blocks go to the disk
    with ``O_DIRECT`` instead, through ``agent._direct_io.DirectWriter`` (where the filesystem
    refuses ``O_DIRECT``, the file is written as without it). ``cancel`` is checked before every
    block. Closing does not fsync (see ``sync_files``); a failure removes the file.
    """

    BLOCK = 16 * 1024 * 1024
    _SMALL = 1024 * 1024
    WRITEBACK_LAG = 4
    """Blocks in writeback at once before the oldest is waited for and dropped from the page cache."""

    def __init__(
        self,
        path: str,
        *,
        writeback: bool = False,
        direct: bool = False,
        cancel: threading.Event | None = None,
    ) -> None:
        self.path = path
        self.crc = 0
        self.size = 0
        self._direct = open_direct(path) if direct else None
        self._fd = (
            self._direct.fd
            if self._direct is not None
            else os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0), 0o644)
        )
        self._pending = bytearray()
        self._writeback = writeback
        self._written_back = 0
        self._in_writeback: collections.deque[tuple[int, int]] = collections.deque()
        self._cancel = cancel
        self.error: BaseException | None = None

    def __enter__(self) -> ChecksummedFile:
        return self

    def __exit__(self, kind: object, value: object, tb: object) -> None:
        if kind is None:
            self.close()
        else:
            self.abort()

    def tell(self) -> int:
        return self.size + len(self._pending)

    def write(self, data: Any) -> int:
        """Never raises: torch.save's zip writer calls it, and an exception thrown into that writer
        leaves it inconsistent, so that finishing it later aborts the whole process. A failure (an
        ``OSError``, or ``SaveCancelledError``) is kept, the rest of the bytes are dropped, and
        ``check()`` (called after each record) or ``close()`` raises it."""
        view = memoryview(data).cast("B")
        n = view.nbytes
        if self.error is not None:
            return n
        try:
            if n < self._SMALL:
                self._pending += view
                if len(self._pending) >= self._SMALL:
                    self.flush()
                return n
            self.flush()
            for start in range(0, n, self.BLOCK):
                self._out(view[start : start + self.BLOCK])
        except BaseException as e:
            self.error = e
        return n

    def check(self) -> None:
        """Raise the failure a ``write`` kept, if any."""
        if self.error is not None:
            raise self.error

    def flush(self) -> None:
        if self._pending:
            block, self._pending = self._pending, bytearray()
            self._out(memoryview(block))

    def _out(self, view: memoryview) -> None:
        if self._cancel is not None and self._cancel.is_set():
            raise SaveCancelledError(f"writing {self.path} was given up: a newer save superseded it")
        self.crc = crc32c_bytes(view, self.crc)
        if self._direct is not None:
            self._direct.write(view)
            self.size += view.nbytes
            return
        while view:
            try:
                written = os.write(self._fd, view)
            except OSError as e:  # write(2) names no file: the error says which one failed
                raise OSError(e.errno, e.strerror, self.path) from e
            view = view[written:]
            self.size += written
        if self._writeback and self.size - self._written_back >= self.BLOCK:
            start_writeback(self._fd, self._written_back, self.size - self._written_back)
            self._in_writeback.append((self._written_back, self.size - self._written_back))
            self._written_back = self.size
            while len(self._in_writeback) > self.WRITEBACK_LAG:
                finish_writeback(self._fd, *self._in_writeback.popleft())

    @property
    def direct(self) -> bool:
        """Whether the bytes went to the disk with ``O_DIRECT`` (all of them, or up to where the
        filesystem refused it)."""
        return self._direct is not None

    def fileno(self) -> int:
        return self._direct.fd if self._direct is not None else self._fd

    def close(self) -> None:
        if self._fd < 0:
            return
        try:
            self.check()
            self.flush()
            if self._direct is not None:
                self._direct.finish(self.size)
        except BaseException:
            self.abort()
            raise
        self._close_fd()

    def _close_fd(self) -> None:
        if self._direct is not None:
            self._direct.close()
        elif self._fd >= 0:
            os.close(self._fd)
        self._fd = -1

    def abort(self) -> None:
        if self._fd >= 0:
            if self._direct is not None:
                self._direct.abort()
            self._close_fd()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


_SYNC_FILE_RANGE_WRITE = 2
_SYNC_FILE_RANGE_WAIT = 1 | 2 | 4  # WAIT_BEFORE | WRITE | WAIT_AFTER: written, and waited for
_libc: Any = None


def _sync_file_range(fd: int, offset: int, length: int, flags: int) -> bool:
    """Linux's ``sync_file_range``; False where it does not exist."""
    global _libc
    if _libc is None:
        try:
            _libc = ctypes.CDLL(None, use_errno=True)
            _libc.sync_file_range.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
        except (OSError, AttributeError):
            _libc = False
    if not _libc:
        return False
    _libc.sync_file_range(fd, offset, length, flags)
    return True


def start_writeback(fd: int, offset: int, length: int) -> None:
    """Ask the kernel to start writing these bytes of ``fd`` to disk now, without waiting (Linux's
    ``sync_file_range(SYNC_FILE_RANGE_WRITE)``); a no-op where it does not exist. It makes no
    promise of durability: the fsync that follows does."""
    _sync_file_range(fd, offset, length, _SYNC_FILE_RANGE_WRITE)


def finish_writeback(fd: int, offset: int, length: int) -> None:
    """Wait until these bytes of ``fd`` are written out, then drop them from the page cache
    (``POSIX_FADV_DONTNEED``: clean pages only, so nothing unwritten is lost); a no-op where either
    call does not exist. It makes no promise of durability either: the fsync that follows does."""
    if _sync_file_range(fd, offset, length, _SYNC_FILE_RANGE_WAIT) and hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)


def sync_files(paths: list[str], parallelism: int = 4) -> None:
    """fsync these files together, after the last one is written (their writeback started as they
    were written): one wait for the disk per save, not one per file; then drop what is left of them
    in the page cache (clean by then). Their folder is not synced:
    the store links them into the checkpoint folder and syncs that one (``FileStorage.put_files``).
    """

    def fsync(path: str) -> None:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        try:
            try:
                sync_fd(fd)
            except OSError as e:  # fsync(2) names no file: the error says which one failed
                raise OSError(e.errno, e.strerror, path) from e
            if hasattr(os, "posix_fadvise"):  # the last blocks, written back by now (see ChecksummedFile)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)

    parallel_map(fsync, [(p,) for p in paths], parallelism)


def make_writer(
    path: str,
    *,
    durable: bool,
    direct: bool = False,
    any_size: bool = False,
    cancel: threading.Event | None = None,
) -> _Writer:
    """DCP's writer into a rank's staging folder (one file per rank, no zip CRC-32: see ``_Writer``).

    ``durable``: the staged files become the checkpoint (a filesystem store links them into
    place), so their writeback starts as they are written and the Checkpointer fsyncs them. For
    an object store they are only an upload buffer: a crash loses them along with the upload, and
    no manifest is ever written for them. ``direct``: the shards go to the disk with ``O_DIRECT``
    (``agent._direct_io``), for a durable save only; those under ``DIRECT_MIN_BYTES`` of tensors
    go through the page cache unless ``any_size`` (the user asked for ``O_DIRECT`` outright).
    """
    return _Writer(
        path,
        durable=durable,
        direct=direct and durable,
        direct_min_bytes=0 if any_size else _direct_io.DIRECT_MIN_BYTES,
        cancel=cancel,
    )
