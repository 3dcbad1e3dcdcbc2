"""How the Checkpointer writes a DCP checkpoint into a rank's staging folder.

DCP's filesystem writer, except that tensors are serialized without torch.save's zip CRC-32 (the
manifest's CRC32C covers the files, computed as the bytes go out: ``ChecksummedFile``), by
building the zip writer per file instead of switching torch's process-wide option; writeback
starts as blocks are written and the files are fsynced together (``sync_files``). ``dcp_save`` is
DCP's save without the warning its public wrapper emits on every single-process call, with a
planner that writes named values from the lowest rank. ``make_stager`` holds an async save's host
buffers between saves. Reading a checkpoint back, safely, is ``agent.dcp_safe``'s.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import dataclasses
import functools
import io
import os
import pickle
import queue
import threading
import weakref
import zlib
from typing import IO, Any

import numpy as np
import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint._dedup_save_plans import dedup_save_plans
from torch.distributed.checkpoint.default_planner import (
    DefaultSavePlanner,
)
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import (
    SavePlan,
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


# -- DCP's save and load, minus their single-process warning ------------------------------------


class RankZeroSavePlanner(DefaultSavePlanner):
    """DCP's save planner, except that the values under ``from_rank0`` are written from the lowest
    rank that holds them.

    DCP keeps one copy of a value every rank holds under the same name, and by default takes it
    from whichever rank has the least to write so far: fine for what the ranks keep identical
    (DDP's parameters and optimizer state), wrong for what only looks replicated. A module's
    buffers under DDP are the case: each rank's forward updates its BatchNorm running statistics
    from its own batch, and DDP's next forward overwrites them all with rank 0's. A checkpoint
    holding rank 1's copy resumes on other statistics than the uninterrupted run goes on with.
    ``from_rank0`` names such values by their flattened name, or a prefix of it (``model.bn``
    covers ``model.bn.running_mean``). Scalars and non-tensor values are written from the lowest
    rank too (``_small_whole_value``); everything else is spread over the ranks as DCP does.
    """

    def __init__(
        self, from_rank0: frozenset[str], *, check_replicas: bool = True, cache: SavePlanCache | None = None
    ) -> None:
        super().__init__()
        self._from_rank0 = from_rank0
        self._check_replicas = check_replicas
        self._cache = cache
        self._local: SavePlan | None = None  # this save's local plan as DCP made it, for the cache

    def create_local_plan(self) -> SavePlan:
        """DCP's local plan, with a fingerprint of each value the coordinator may keep one copy of
        (``_fingerprints``) riding beside DCP's own planner data. With a ``cache`` holding the same
        local plan from an earlier save, only the fingerprints travel (``_Unchanged``)."""
        plan = super().create_local_plan()
        fingerprints = self._fingerprints(plan) if self._check_replicas else None
        cache = self._cache
        if cache is not None:
            self._local = plan
            if cache.generation and cache.local is not None and _same_local_plan(plan, cache.local):
                self.plan = plan = SavePlan([], planner_data=_Unchanged(cache.generation, fingerprints))
                return plan
        if fingerprints is not None:
            self.plan = plan = dataclasses.replace(plan, planner_data=(plan.planner_data, fingerprints))
        return plan

    def _fingerprints(self, plan: SavePlan) -> dict[str, int]:
        """A CRC of a sample of each whole (unsharded) value of ``plan`` by name: the bytes of up to
        256 elements spread over a tensor (``_tensor_fingerprints``), a pickle of a non-tensor
        value. Values written from rank 0 (buffers, which may differ between ranks on purpose) are
        left out."""
        out: dict[str, int] = {}
        tensors: dict[str, torch.Tensor] = {}
        for item in plan.items:
            fqn = item.index.fqn
            if item.type == WriteItemType.SHARD or self._takes_rank0(fqn):
                continue
            value = self.state_dict.get(fqn)
            if isinstance(value, torch.Tensor):
                tensors[fqn] = value
            elif item.type == WriteItemType.BYTE_IO:
                if isinstance(value, list) and _is_group_params(fqn):
                    # An optimizer group's parameter names: which, not in what order. Groups built
                    # from a set list them in another order in each process, and train alike.
                    value = sorted(value, key=str)
                try:
                    out[fqn] = zlib.crc32(pickle.dumps(value, protocol=4))
                except Exception:  # not this check's to judge: DCP writes it as it does
                    continue
        out.update(zip(tensors, _tensor_fingerprints(list(tensors.values())), strict=True))
        return out

    def _check_replicas_agree(self, all_plans: list[SavePlan]) -> None:
        """(coordinator) Refuse values that several ranks hold under one name with other contents:
        DCP would keep one rank's copy, and every rank would restore it."""
        seen: dict[str, tuple[int, int]] = {}
        differ: dict[str, tuple[str, int, int]] = {}  # by name: the first two ranks that differ
        for rank, plan in enumerate(all_plans):
            data = plan.planner_data
            fingerprints = data.fingerprints if isinstance(data, _Unchanged) else data[1]
            for fqn, fingerprint in (fingerprints or {}).items():
                first = seen.setdefault(fqn, (rank, fingerprint))
                if first[1] != fingerprint:
                    differ.setdefault(fqn, (fqn, first[0], rank))
        if differ:
            raise DivergentReplicasError.of(list(differ.values()))

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        """(coordinator) The replica check on every rank's fingerprints, then DCP's global plan; with
        a ``cache``, the last save's when no rank's local plan changed and ``from_rank0`` is the
        same, else DCP's from the changed plans and the cached ones of the ranks that sent none."""
        if self._check_replicas:
            self._check_replicas_agree(all_plans)
        cache = self._cache
        unchanged = [isinstance(p.planner_data, _Unchanged) for p in all_plans]
        if any(unchanged):
            generations = {p.planner_data.generation for p, u in zip(all_plans, unchanged, strict=True) if u}
            if (
                cache is None
                or cache.all_plans is None
                or len(cache.all_plans) != len(all_plans)
                or generations != {cache.planned}
            ):
                held = None if cache is None or cache.all_plans is None else (cache.planned, len(cache.all_plans))
                raise RuntimeError(
                    f"the ranks reuse the save plans of save(s) {sorted(generations)} of {len(all_plans)} rank(s); "
                    f"the coordinator holds {held} (plan, ranks): an earlier save failed on some ranks only. This "
                    "save is given up and every rank plans the next one afresh"
                )
        cached = cache is not None and cache.all_plans is not None
        if cache is not None and cached and all(unchanged) and cache.from_rank0 == self._from_rank0:
            assert cache.global_plan is not None and cache.metadata is not None
            self.global_plan, self.metadata = cache.global_plan, dataclasses.replace(cache.metadata)
            reply = SavePlan([], planner_data=_Unchanged(cache.planned, None))
            return [reply] * len(all_plans), self.metadata
        if self._check_replicas:  # DCP's own planner data, without the fingerprints
            all_plans = [
                p if u else dataclasses.replace(p, planner_data=p.planner_data[0])
                for p, u in zip(all_plans, unchanged, strict=True)
            ]
        if cache is not None and cache.all_plans is not None:  # a rank that sent none: its cached plan
            all_plans = [c if u else p for c, p, u in zip(cache.all_plans, all_plans, unchanged, strict=True)]
        global_plan, metadata = super().create_global_plan(all_plans)
        if cache is None:
            return global_plan, metadata
        cache.planned += 1
        cache.all_plans = all_plans
        cache.global_plan, cache.metadata, cache.from_rank0 = global_plan, metadata, self._from_rank0
        self.metadata = dataclasses.replace(metadata)  # DCP's writer sets its storage_data per save
        return [dataclasses.replace(p, planner_data=_Planned(cache.planned, p.planner_data)) for p in global_plan], (
            self.metadata
        )

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        """This rank's part of the global plan: the cached one when the coordinator says it is
        unchanged (``_Unchanged``), else the one it sent, kept in the cache with the local plan."""
        data = new_plan.planner_data
        cache = self._cache
        if isinstance(data, _Unchanged):
            if cache is None or cache.final is None or cache.generation != data.generation:
                raise RuntimeError(
                    f"the coordinator reused the save plan of save {data.generation}, which this rank does not "
                    f"hold ({cache.generation if cache is not None else None}): a save failed on some ranks only. "
                    "This save is given up and every rank plans the next one afresh"
                )
            return super().finish_plan(cache.final)
        if isinstance(data, _Planned):
            new_plan = dataclasses.replace(new_plan, planner_data=data.planner_data)
            if cache is not None and self._local is not None:
                cache.local, cache.final, cache.generation = self._local, new_plan, data.generation
        return super().finish_plan(new_plan)

    def _takes_rank0(self, fqn: str) -> bool:
        if not self._from_rank0:
            return False
        if fqn in self._from_rank0:
            return True
        parts = fqn.split(".")
        return any(".".join(parts[:n]) in self._from_rank0 for n in range(1, len(parts)))

    def _dedup_save_plans(self, all_plans: list[SavePlan]) -> list[SavePlan]:
        # Once per name. Scalars and non-tensor values every rank holds (an optimizer's ``step``
        # counters and ``param_groups``) go to the lowest rank too: spread, they put a value every rank reads
        # into nearly every rank's file, and a restore of a sharded state then reads every file on
        # every node instead of its own shards and rank 0's (``agent.restore_cache.node_files``).
        takes = {
            i.index.fqn: self._takes_rank0(i.index.fqn) or _small_whole_value(i) for p in all_plans for i in p.items
        }

        def part(rank0: bool) -> list[SavePlan]:
            return [
                dataclasses.replace(p, items=[i for i in p.items if takes[i.index.fqn] == rank0]) for p in all_plans
            ]

        lowest = dedup_save_plans(part(True), save_to_lowest_rank=True)
        spread = dedup_save_plans(part(False), save_to_lowest_rank=False)
        return [
            dataclasses.replace(p, items=a.items + b.items) for p, a, b in zip(all_plans, lowest, spread, strict=True)
        ]


@dataclasses.dataclass(frozen=True)
class _Unchanged:
    """The planner data of a plan that stands for the one of save ``generation``: from a rank, its
    local plan is the same as then (only this save's replica ``fingerprints`` travel, when the
    replicas are checked); from the coordinator, so is the rank's part of the global plan."""

    generation: int
    fingerprints: dict[str, int] | None


@dataclasses.dataclass(frozen=True)
class _Planned:
    """The planner data of a rank's part of a new global plan (DCP's own ``planner_data``), the
    coordinator's number for it: the rank caches both."""

    generation: int
    planner_data: Any


def _same_local_plan(plan: SavePlan, cached: SavePlan) -> bool:
    """Whether DCP would plan ``plan`` as it planned ``cached``: the same items (name, offset, kind,
    and a tensor's size, chunk, dtype, layout and other properties), DCP's own planner data (the
    names' places in the nested state) and storage data. A stricter test than torch's own
    ``_compare_save_plans``, which leaves dtypes out."""
    return (
        plan.planner_data == cached.planner_data
        and plan.storage_data == cached.storage_data
        and plan.items == cached.items
    )


class SavePlanCache:
    """The save plans of a Checkpointer's last save, reused while the state keeps its structure.

    DCP plans every save afresh: each rank lists its items (``create_local_plan``), the lists are
    gathered to the coordinator, which decides who writes what and builds the metadata
    (``create_global_plan``), and scatters a plan back to each rank. With many small tensors that
    is a large part of a save, and with several ranks most of it is pickling the lists to and fro,
    though the state's structure rarely changes between saves. With this cache a rank whose local
    plan is the same as at the last save sends only a marker (and this save's replica
    fingerprints, so the check stays what it was); when every rank's is, and ``from_rank0`` is the
    same, the coordinator answers each with a marker too and every rank writes its cached plan.
    Any change (a tensor added, removed, resized, of another dtype or sharding; a new param group;
    another ``from_rank0``) has that rank send its full plan and the coordinator plan the save
    afresh, with the cached plans of the others. The data is taken from the state at write time,
    never from the plans (``resolve_data``), and the plans hold no tensors.

    One per Checkpointer (its own save group, so one world size); not shared between
    Checkpointers, unlike torch's own plan caching (``enable_plan_caching``: one cache per planner
    class, for the whole process). ``clear`` after a failed save.
    """

    def __init__(self) -> None:
        self.planned = 0
        """(coordinator) The number of the last global plan it made (counting up, never reused)."""
        self.world_size = 0
        self.clear()

    def bind(self, world_size: int) -> None:
        """Forget the plans if they were made for another number of ranks."""
        if world_size != self.world_size:
            self.clear()
            self.world_size = world_size

    def clear(self) -> None:
        # This rank's: its last local plan, its part of the global plan, and that plan's number.
        self.local: SavePlan | None = None
        self.final: SavePlan | None = None
        self.generation = 0
        # The coordinator's: every rank's local plan, the global plan and metadata, for from_rank0.
        self.all_plans: list[SavePlan] | None = None
        self.global_plan: list[SavePlan] | None = None
        self.metadata: Metadata | None = None
        self.from_rank0: frozenset[str] | None = None


SCALAR_BYTES = 16
"""The most bytes a one-element tensor takes (complex128)."""


def _small_whole_value(item: WriteItem) -> bool:
    """Whether ``item`` is a non-tensor value or a whole one-element tensor (an optimizer's ``step``):
    written from the lowest rank that holds it (``RankZeroSavePlanner._dedup_save_plans``). Bigger
    replicated tensors (DDP's parameters) stay spread over the ranks, each writing its part."""
    if item.type == WriteItemType.BYTE_IO:
        return True
    return item.type == WriteItemType.TENSOR and (item.tensor_storage_size() or SCALAR_BYTES + 1) <= SCALAR_BYTES


def _is_group_params(fqn: str) -> bool:
    """Whether ``fqn`` names an optimizer group's list of parameter names
    (``optim.param_groups.0.params``)."""
    parts = fqn.rsplit(".", 3)
    return len(parts) == 4 and parts[1] == "param_groups" and parts[2].isdigit() and parts[3] == "params"


_SAMPLE = 256
"""Elements of a tensor in its fingerprint, spread over it, the first and the last among them."""


_AS_INTEGERS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
"""An integer dtype of each element size: elements are sampled as the bytes they are, whatever
their dtype (float4_e2m1fn_x2 has no indexing kernel, on the CPU or an accelerator)."""


@functools.lru_cache(maxsize=1024)
def _sample_positions(n: int) -> np.ndarray:
    """The flat positions of the elements sampled from a tensor of ``n`` elements (integers: exact
    at any size), read-only: models repeat a few sizes, and each is computed once."""
    k = min(n, _SAMPLE)
    positions = np.arange(k, dtype=np.int64) * (n - 1) // max(k - 1, 1)
    positions.flags.writeable = False
    return positions


def _tensor_fingerprints(tensors: list[torch.Tensor]) -> list[int]:
    """A CRC of the shape, dtype and the bytes of up to 256 elements spread over each tensor: equal
    for equal tensors, and in practice different for tensors that were initialised or trained
    apart (shards of one layer, different experts). Cheap at any size: the sample only is read.

    On the CPU the sample is indexed through NumPy (a third of what torch's indexing costs a small
    tensor), without copying a tensor that is not contiguous. On an accelerator each tensor's
    sample is gathered there and all of a device's samples come to the host in one copy (one
    synchronisation per device, not one per tensor). Either way the bytes are those of the sampled
    elements in order, one element after the other: the same fingerprint wherever a tensor is.
    """
    out: list[int] = []
    on_device: dict[torch.device, list[tuple[int, torch.Tensor]]] = {}
    for i, tensor in enumerate(tensors):
        head = zlib.crc32(f"{tuple(tensor.shape)}:{tensor.dtype}".encode())
        out.append(head)
        n = tensor.numel()
        if n == 0:
            continue
        t = tensor.detach()
        as_integers = _AS_INTEGERS.get(t.element_size())
        if as_integers is not None and t.dtype != as_integers:
            t = t.view(as_integers)  # the same bytes, whatever the strides
        if t.device.type == "cpu" and type(t) is torch.Tensor:
            positions = _sample_positions(n)
            if t.is_contiguous():
                # Indexed as whole elements of their size in bytes: any dtype (float8, complex, bool) alike.
                elements = t.view(-1).view(torch.uint8).numpy().view(f"V{t.element_size()}")
                out[i] = zlib.crc32(elements[positions].tobytes(), head)
            else:
                index = tuple(torch.from_numpy(d) for d in np.unravel_index(positions, t.shape))
                out[i] = zlib.crc32(t[index].view(torch.uint8).numpy().tobytes(), head)
            continue
        positions_here = torch.from_numpy(_sample_positions(n).copy()).to(t.device)
        on_device.setdefault(t.device, []).append((i, t.reshape(-1)[positions_here].view(torch.uint8)))
    for samples in on_device.values():
        host = torch.cat([sample for _, sample in samples]).cpu().numpy()
        start = 0
        for i, sample in samples:
            out[i] = zlib.crc32(host[start : start + sample.numel()].tobytes(), out[i])
            start += sample.numel()
    return out


def _tensor_fingerprint(tensor: torch.Tensor) -> int:
    """``_tensor_fingerprints`` of one tensor."""
    return _tensor_fingerprints([tensor])[0]


class DivergentReplicasError(ValueError):
    """Ranks hold different values under one name (``RankZeroSavePlanner``); nothing is written."""

    @classmethod
    def of(cls, differ: list[tuple[str, int, int]]) -> DivergentReplicasError:
        """The error for ``differ``: (name, a rank, another rank holding other contents). The name
        that tells the cause comes first: an optimizer's parameter list, then its hyperparameters
        (a per-rank learning rate makes the parameters it updated differ too), then the rest."""

        def order(d: tuple[str, int, int]) -> int:
            return 0 if _is_group_params(d[0]) else 1 if ".param_groups." in d[0] else 2

        differ = sorted(differ, key=order)
        fqn, a, b = differ[0]
        more = f" (and {len(differ) - 1} more: {', '.join(d[0] for d in differ[1:4])})" if len(differ) > 1 else ""
        if order(differ[0]) == 0:
            how = (
                "The optimizers of the ranks hold different parameters (pipeline stages): keep each stage's "
                "optimizer in a per-rank object instead (see 'Pipeline stages' in spotjob's README)"
            )
        elif order(differ[0]) == 1:
            how = (
                "The ranks' optimizers use different hyperparameters, and the parameters they update drift apart "
                "with them: an LR scheduler stepped on each rank's own value (ReduceLROnPlateau given a loss or "
                "metric that was not averaged over the ranks), or a setting changed on some ranks only. Give "
                "every rank the same value (all-reduce the metric before scheduler.step(metric))"
            )
        else:
            how = (
                "Under DDP, replicas drift apart when weights are set after DistributedDataParallel wrapped the "
                "model (initialised or loaded on a seed per rank; DDP broadcasts rank 0's only when it wraps) or "
                "changed outside the optimizer on some ranks: set them before wrapping. Keep tensor- or "
                "expert-parallel shards as DTensors (parallelize_module, distribute_tensor), which are saved "
                "shard by shard, or keep each rank's own values in a per-rank object; where replicas differ on "
                'purpose (local SGD, DiLoCo), Checkpointer(..., replicas="rank0") saves rank 0\'s copy'
            )
        return cls(
            f"ranks {a} and {b} hold different values under the name {fqn}{more}. A checkpoint keeps one copy "
            "of a name that several ranks hold (data-parallel replicas are identical), so every rank would "
            f"restore the same rank's values. {how}. Nothing was saved"
        )


def dcp_save(
    state: dict[str, Any],
    writer: FileSystemWriter,
    *,
    process_group: Any,
    no_dist: bool,
    from_rank0: frozenset[str] = frozenset(),
    plan_cache: SavePlanCache | None = None,
) -> None:
    """What ``dcp.save`` does with a storage writer given, without its warning; the values named
    in ``from_rank0`` are written from the lowest rank (``RankZeroSavePlanner``). ``plan_cache``:
    the plans of the last save through it are reused while the state keeps its structure
    (``SavePlanCache``); it is cleared when the save fails.

    ``dcp.save`` warns on every single-process call; silencing that would mean editing the
    process's warning filters, which belong to the user. The function below it does the work.
    """
    from torch.distributed.checkpoint.state_dict_saver import _save_state_dict

    if plan_cache is not None:
        plan_cache.bind(1 if no_dist else torch.distributed.get_world_size(process_group))
    try:
        _save_state_dict(
            state_dict=state,
            storage_writer=writer,
            process_group=process_group,
            no_dist=no_dist,
            planner=RankZeroSavePlanner(from_rank0, check_replicas=not no_dist, cache=plan_cache),
        )
    except BaseException:
        # DCP raises a failure on every rank (planning and writing end in collectives): every
        # rank forgets its plans, and the next save is planned afresh everywhere.
        if plan_cache is not None:
            plan_cache.clear()
        raise


def staging_options(cuda: bool) -> Any:
    """How a save stages its tensors in host memory, torchtitan's way on GPUs.

    With CUDA: host buffers pinned (page-locked, so device-to-host copies run as DMA at full link
    speed) and kept between saves, the copies enqueued without blocking and waited for once at
    the end. Without it: plain host buffers, kept between saves, filled by a memcpy.
    """
    from torch.distributed.checkpoint.staging import StagingOptions

    return StagingOptions(
        use_pinned_memory=cuda, use_shared_memory=False, use_async_staging=False, use_non_blocking_copy=cuda
    )


def make_stager(cuda: bool | None = None) -> Any:
    """One stager for the Checkpointer's lifetime: it keeps its host buffers between saves (DCP's
    ``StateDictStager`` caches one per source storage), so a save copies into memory that is
    already there instead of allocating (and first-touching, or pinning) a state-sized buffer
    every time. Safe because a save is staged only after the previous one is done with its
    buffers. ``close()`` frees them. Stage through ``stage_state`` (see ``_KeptBuffers``)."""
    stager = _stager_class()(staging_options(torch.cuda.is_available() if cuda is None else cuda))
    inner = getattr(stager, "_state_dict_stager", None)
    if inner is not None and hasattr(inner, "_stage_untyped_storage"):
        inner._stage_untyped_storage = _KeptBuffers(inner)
    if inner is not None and callable(getattr(inner, "close", None)):
        # torch 2.11 and 2.12's DefaultStager closes its StateDictStager after every stage, which
        # empties its deep-copy table (the next stage then fails: KeyError: <class 'type'>) and its
        # kept buffers. The stager is kept for the Checkpointer's life: only Stager.close closes it.
        inner.close = _no_close
    return stager


def _no_close() -> None:
    """What DCP's stager calls on its StateDictStager after a stage, under torch 2.11 and 2.12."""


@functools.cache
def _stager_class() -> type:
    """DCP's ``DefaultStager``, whose ``close()`` also frees the buffers of ``stage_state``'s plain
    path (``_KeptBuffers.plain``). Made on first use: torch's staging module is imported then."""
    from torch.distributed.checkpoint.staging import DefaultStager

    class Stager(DefaultStager):
        def close(self) -> None:
            inner = getattr(self, "_state_dict_stager", None)
            kept = getattr(inner, "_stage_untyped_storage", None)
            super().close()
            if inner is not None and inner.__dict__.get("close") is _no_close:
                type(inner).close(inner)
            if isinstance(kept, _KeptBuffers):
                kept.clear()

    return Stager


def stage_state(stager: Any, state: dict[str, Any]) -> Any:
    """``state`` staged into ``stager``'s buffers; afterwards it keeps the buffers of this save only.

    A state of plain tensors (on the CPU or CUDA) and plain values in dicts, lists and tuples, which
    is what a module's and an optimizer's state are, is staged by ``_KeptBuffers.stage_plain``: the
    same staged state as DCP's deep copy makes, in about a third of its time for many small tensors.
    Anything else (DTensors, tensor subclasses, other objects) goes through DCP's stager."""
    kept = getattr(getattr(stager, "_state_dict_stager", None), "_stage_untyped_storage", None)
    if isinstance(kept, _KeptBuffers):
        config = getattr(stager, "_config", None)
        staged = kept.stage_plain(state, non_blocking=bool(getattr(config, "use_non_blocking_copy", False)))
        if staged is not None:
            return staged
        kept.used.clear()
    staged = stager.stage(state)
    staged = staged.result() if hasattr(staged, "result") else staged
    if getattr(stager, "should_synchronize_after_execute", False):
        stager.synchronize_staging()
    if isinstance(kept, _KeptBuffers):
        kept.forget_unused()
    return staged


_ATOMIC = frozenset({type(None), bool, int, float, complex, str, bytes})
"""Values a deep copy returns as they are (DCP's stager does too)."""


class _NotPlain(Exception):
    """The state holds something ``_KeptBuffers.stage_plain`` leaves to DCP's stager."""


class _KeptBuffers:
    """DCP's staging of one storage (``StateDictStager._stage_untyped_storage``), with the cache of
    host buffers it keeps between saves held to what the state holds now.

    - A storage resized in place since the last save (``buffer.resize_(n)``, a cache or vocabulary
      grown where it lies) keeps its cache key at a new size, and DCP asserted "Cached storage size
      does not match": every async save from then on failed, while a synchronous one worked. Its
      stale buffer is dropped and one of the new size allocated, as for a new tensor.
    - DCP drops a buffer only when its source tensor is freed: a value that left the state but
      lives on in the script (an EMA saved now and then, an old layer the script still holds)
      kept its copy in host memory for the Checkpointer's life, beyond the one copy of the state
      that staging is documented to take. ``forget_unused`` drops every buffer the last save did
      not use.

    ``stage_plain`` stages a state of plain tensors without DCP's generic deep copy, into buffers
    of its own (``plain``: by the source storage's id, a weak reference to it and its buffer), by
    the same rules: one buffer per source storage (tensors that share a storage stay views of one
    buffer), reused while the storage keeps its size, dropped when a save does not use it or the
    storage is freed.
    """

    def __init__(self, inner: Any) -> None:
        self.stage_storage = inner._stage_untyped_storage
        self.cache = getattr(inner, "_cached_storage_mapping", None)
        self.used: set[int] = set()
        self.plain: dict[int, tuple[Any, Any, dict[Any, torch.Tensor]]] = {}
        self.plain_state = True
        """False once a state was not plain: the states of a Checkpointer keep their kind, and each
        of its later saves then goes to DCP's stager at once instead of after a partial walk."""

    def __call__(self, storage: Any, *args: Any, **kwargs: Any) -> Any:
        if self.cache is not None:
            cached = self.cache.get(storage)
            if cached is not None and cached.size() != storage.size():
                del self.cache[storage]
        self.used.add(id(storage))
        return self.stage_storage(storage, *args, **kwargs)

    def forget_unused(self) -> None:
        if self.cache is not None:
            for source in list(self.cache.keys()):
                if id(source) not in self.used:
                    del self.cache[source]
        self.used.clear()
        self.plain.clear()  # staged through DCP: none of them was used

    def clear(self) -> None:
        """Let every buffer go (the stager is closed)."""
        self.plain.clear()
        self.used.clear()
        if self.cache is not None:
            self.cache.clear()

    def stage_plain(self, state: dict[str, Any], *, non_blocking: bool) -> dict[str, Any] | None:
        """``state`` staged as DCP's stager stages it, or None when it holds something other than
        plain tensors and plain values in dicts, lists and tuples: DCP's stager then stages it, into
        the buffers of the storages this walk reached before it met that value."""
        if self.cache is None or not self.plain_state:
            return None
        walk = _PlainWalk(self, non_blocking)
        try:
            staged = walk.stage(state)
        except _NotPlain:
            self.plain_state = False
            # The buffers of the storages walked so far go to DCP's cache: its stager, which stages
            # this save, uses them instead of allocating their like again.
            for storage in walk.storages:
                self.cache[storage] = walk.kept[id(storage)][1]
            self.plain.clear()
            return None
        if walk.copied and non_blocking:
            torch.accelerator.synchronize()  # the device-to-host copies were only enqueued
        self.plain = walk.kept
        self.used.clear()
        if len(self.cache):
            self.cache.clear()  # buffers of an earlier save staged through DCP: none used now
        return staged

    def _forget(self, key: int, ref: Any) -> None:
        """(weakref callback) The source storage was freed: its buffer goes too."""
        entry = self.plain.get(key)
        if entry is not None and entry[0] is ref:
            del self.plain[key]


class _PlainWalk:
    """One save's ``_KeptBuffers.stage_plain``: what was staged (``memo``, by the source object's
    id, as a deep copy's memo) and the buffers this save used (``kept``)."""

    def __init__(self, buffers: _KeptBuffers, non_blocking: bool) -> None:
        self.buffers = buffers
        self.non_blocking = non_blocking
        self.memo: dict[int, Any] = {}
        self.kept: dict[int, tuple[Any, Any, dict[Any, torch.Tensor]]] = {}
        self.alive: list[Any] = []  # the sources staged, held until the walk is done: their ids stay theirs
        self.storages: list[Any] = []  # the source storages staged, in order
        self.copied = False

    def stage(self, x: Any) -> Any:
        kind = type(x)
        if kind in _ATOMIC:
            return x
        done = self.memo.get(id(x))
        if done is not None:
            return done
        y: Any
        if kind is torch.Tensor:
            y = self.tensor(x)
        elif kind is dict:
            y = {}
            self.memo[id(x)] = y
            for k, v in x.items():
                y[self.stage(k)] = self.stage(v)
        elif kind is list:
            y = []
            self.memo[id(x)] = y
            y.extend([self.stage(v) for v in x])
        elif kind is tuple:
            items = [self.stage(v) for v in x]
            y = tuple(items) if any(a is not b for a, b in zip(items, x, strict=True)) else x
        else:
            raise _NotPlain
        self.memo[id(x)] = y
        self.alive.append(x)
        return y

    def tensor(self, x: torch.Tensor) -> torch.Tensor:
        if x.layout is not torch.strided or x.is_quantized or x.is_nested or x.is_conj() or x.is_neg() or x.__dict__:
            raise _NotPlain
        device = x.device.type
        if device != "cpu" and device != "cuda":
            raise _NotPlain
        storage = x.untyped_storage()
        key = id(storage)
        entry = self.kept.get(key)
        if entry is None:
            entry = self.buffers.plain.get(key)
            if entry is None or entry[0]() is not storage or entry[1].size() != storage.size():
                # New, or resized in place since the last save: a buffer of its size, DCP's way
                # (pinned with CUDA), which is then this path's, not DCP's cache's.
                buffer = self.buffers(storage, non_blocking=self.non_blocking)
                if self.buffers.cache is not None:
                    self.buffers.cache.pop(storage, None)
                ref = weakref.ref(storage, functools.partial(_forget_plain, weakref.ref(self.buffers), key))
                entry = (ref, buffer, {})
            else:
                entry[1].copy_(storage, non_blocking=self.non_blocking)
            self.kept[key] = entry
            self.storages.append(storage)
            self.copied = self.copied or device != "cpu"
        # The staged tensor: a view of the buffer where the source is a view of its storage. The
        # one made for the same view at an earlier save is handed out again (making one, set_,
        # costs more than copying a small tensor's bytes); it holds no memory of its own.
        views = entry[2]
        shape = (x.dtype, x.storage_offset(), x.size(), x.stride())
        y = views.get(shape)
        if y is None:
            if len(views) >= _VIEWS_KEPT:
                views.clear()
            y = torch.empty(0, dtype=x.dtype, device="cpu")  # not the user's default device
            y.set_(entry[1], shape[1], shape[2], shape[3])
            views[shape] = y
        return y


_VIEWS_KEPT = 16
"""Staged views kept per buffer between saves (``_PlainWalk.tensor``); more are made afresh."""


def _forget_plain(buffers: Any, key: int, ref: Any) -> None:
    kept = buffers()
    if kept is not None:
        kept._forget(key, ref)
