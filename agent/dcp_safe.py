"""torch.distributed.checkpoint, made safe to load from storage we do not control.

DCP's ``.metadata`` file is a pickle and DCP's default planner unpickles non-tensor values with
``weights_only=False``; either would execute code from a crafted checkpoint. Here:

- ``.metadata`` is checked against the manifest's CRC32C, then loaded with an allow-list
  unpickler that accepts DCP's metadata classes (and the few torch/builtin types they hold) only,
  and checked to describe no tensor bigger than the bytes the manifest vouches for.
- Non-tensor values load with ``torch.load(weights_only=True)``; tensors already do in DCP.
- Every shard file is CRC32C-checked against the manifest as it is fetched (object stores) or
  before it is read (filesystem), so a flipped byte fails the load instead of corrupting state.

``dcp_load`` is DCP's load without the warning its public wrapper emits on every single-process
call (silencing it would take the process's warning filters, which belong to the user). The
Checkpointer's restore, the safetensors export and ``spotjob ckpt verify --deep`` all read through
this module; writing is ``agent._dcp_write``'s.
"""

from __future__ import annotations

import builtins
import collections
import contextlib
import ctypes
import dataclasses
import errno
import io
import itertools
import math
import mmap
import os
import pathlib
import pickle
import re
import sys
import threading
from collections.abc import Iterator
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import (
    DefaultLoadPlanner,
    _EmptyStateDictLoadPlanner,
    create_default_local_load_plan,
)
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
)
from torch.futures import Future

from agent.crc32c import crc32c_file_parallel, from_hex, to_hex
from agent.manifest import DCP_METADATA_NAME, Manifest, TensorEntry
from agent.rank_state import refusal_reason
from agent.restore_cache import fetch_verified
from agent.storage.base import CorruptObjectError, Storage, parallel_map


class UnsafeCheckpointError(Exception):
    """Storage handed us something that would execute code or escape the checkpoint folder."""


# -- the allow-list unpickler -------------------------------------------------------------------

_ALLOWED_GLOBALS: dict[tuple[str, str], Any] = {}


def _allow(obj: Any, module: str | None = None, name: str | None = None) -> None:
    _ALLOWED_GLOBALS[(module or obj.__module__, name or obj.__qualname__)] = obj


def _build_allow_list() -> None:
    from torch.distributed.checkpoint import filesystem, metadata

    for cls in (
        metadata.Metadata,
        metadata.TensorStorageMetadata,
        metadata.BytesStorageMetadata,
        metadata.ChunkStorageMetadata,
        metadata.TensorProperties,
        metadata.MetadataIndex,
        metadata.StorageMeta,
        metadata._MEM_FORMAT_ENCODING,
        filesystem._StorageInfo,
    ):
        _allow(cls)
    _allow(torch.Size, "torch", "Size")
    # Layouts pickle through this helper (it maps a name to a torch.layout; torch's own
    # weights_only allow-list trusts it too). Paths are inert values (StorageMeta.checkpoint_id).
    _allow(torch.serialization._get_layout, "torch.serialization", "_get_layout")
    # Python 3.13 moved the path classes into pathlib._local and pickles them under that name; a
    # .metadata written there names pathlib._local.PosixPath. Both names map to this Python's class,
    # so each Python reads what the other wrote.
    for path_cls in (pathlib.PosixPath, pathlib.PurePosixPath, pathlib.WindowsPath, pathlib.PureWindowsPath):
        _allow(path_cls, "pathlib", path_cls.__name__)
        _allow(path_cls, "pathlib._local", path_cls.__name__)
    _allow(collections.OrderedDict, "collections", "OrderedDict")
    for name in ("set", "frozenset", "slice", "complex"):
        _allow(getattr(builtins, name), "builtins", name)
    # dtypes, layouts and memory formats pickle as module attributes of torch.
    for name in dir(torch):
        value = getattr(torch, name, None)
        if isinstance(value, torch.dtype | torch.layout | torch.memory_format):
            _allow(value, "torch", name)
    try:
        from torch.distributed.checkpoint import _extension

        for n in ("StreamTransformExtension",):
            if hasattr(_extension, n):
                _allow(getattr(_extension, n))
    except ImportError:  # pragma: no cover
        pass


class _NotInThisTorch(UnsafeCheckpointError):
    """``.metadata`` names something of torch's own modules this torch does not have (a dtype, a
    class): a crafted file, or one a newer torch wrote (``VerifiedReader.read_metadata`` tells)."""

    def __init__(self, message: str, name: str) -> None:
        super().__init__(message)
        self.name = name


class NewerTorchError(Exception):
    """DCP's ``.metadata`` of a checkpoint a newer torch wrote (its manifest says so) names what this
    torch does not have. Not proven bad: the restore stops there, never going back to an older one,
    and so does ``spotjob ckpt export``; ``verify --deep`` cannot judge it (UNDECIDED). The message
    is the restore's; ``written_under`` (the manifest's torch) and ``name`` (what this torch lacks)
    let a command say it in its own words."""

    def __init__(self, message: str, *, written_under: str, name: str) -> None:
        super().__init__(message)
        self.written_under = written_under
        self.name = name


class _AllowListUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if not _ALLOWED_GLOBALS:
            _build_allow_list()
        try:
            return _ALLOWED_GLOBALS[(module, name)]
        except KeyError:
            message = (
                f"DCP .metadata references {module}.{name}, which is not a DCP metadata class; "
                "refusing to load it (a crafted or foreign checkpoint)"
            )
            loaded = sys.modules.get(module) if module == "torch" or module.startswith("torch.") else None
            if loaded is not None and not hasattr(loaded, name):
                raise _NotInThisTorch(message, f"{module}.{name}") from None
            raise UnsafeCheckpointError(message) from None


def _torch_release(version: str) -> tuple[int, ...] | None:
    """``2.13.0+cpu`` → (2, 13, 0); None for what does not start with a release number."""
    parts = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", version)
    return tuple(int(p or 0) for p in parts.groups()) if parts else None


def load_dcp_metadata(data: bytes) -> Metadata:
    """Unpickle DCP's ``.metadata`` accepting only DCP's own classes."""
    try:
        obj = _AllowListUnpickler(io.BytesIO(data)).load()
    except UnsafeCheckpointError:
        raise
    except Exception as e:
        raise UnsafeCheckpointError(f"DCP .metadata cannot be read: {e}") from None
    if not isinstance(obj, Metadata):
        raise UnsafeCheckpointError(f"DCP .metadata holds a {type(obj).__name__}, not DCP Metadata")
    return obj


def check_metadata_fits(metadata: Metadata, manifest: Manifest) -> None:
    """Raise ``UnsafeCheckpointError`` unless every tensor ``metadata`` describes fits in the bytes
    the manifest vouches for.

    A load allocates each tensor at the size ``.metadata`` gives it before reading a byte (an
    optimizer's state, an export's tensors) and maps its pages ahead of the copy: a crafted size
    would take the node's memory (or get the rank OOM-killed on every restart) instead of failing.
    Spotjob's writer stores each chunk once, in its own region of a shard file, as a whole
    ``torch.save`` record: so a chunk's elements fit in its region, the regions lie inside files
    the manifest lists and never overlap, and the chunks of a tensor cover at least its size.
    Nothing allocated then exceeds what the checkpoint's files hold.
    """
    where = f"DCP {DCP_METADATA_NAME}"
    state = getattr(metadata, "state_dict_metadata", None)
    storage = getattr(metadata, "storage_data", None)
    if not isinstance(state, dict) or not isinstance(storage, dict):
        raise UnsafeCheckpointError(f"{where} lacks the state or storage index of DCP Metadata")

    def ints(value: Any, what: str) -> list[int]:
        if not isinstance(value, tuple | list) or not all(type(n) is int and n >= 0 for n in value):
            raise UnsafeCheckpointError(f"{where} gives {what} as {_short(value)}, not a list of non-negative integers")
        return list(value)

    listed = {f.path: f for f in manifest.files}  # one lookup per region: a big model has 100 000s
    regions: dict[str, list[tuple[int, int, str]]] = {}
    for index, info in storage.items():
        path = getattr(info, "relative_path", None)
        offset, length = getattr(info, "offset", None), getattr(info, "length", None)
        entry = listed.get(path) if isinstance(path, str) else None
        if entry is None:
            raise UnsafeCheckpointError(f"{where} points at {_short(path)}, which MANIFEST.json does not list")
        if type(offset) is not int or type(length) is not int or offset < 0 or length < 0:
            raise UnsafeCheckpointError(f"{where} gives {path} a region at {_short(offset)} of {_short(length)} bytes")
        if offset + length > entry.size:
            raise UnsafeCheckpointError(
                f"{where} places {_short(getattr(index, 'fqn', index))} at bytes "
                f"{_short(offset)}..{_short(offset + length)} of {path}, which holds {entry.size}"
            )
        regions.setdefault(entry.path, []).append((offset, length, str(getattr(index, "fqn", index))))
    for path, spans in regions.items():
        spans.sort()
        for (offset, length, fqn), (next_offset, _, next_fqn) in itertools.pairwise(spans):
            if offset + length > next_offset:
                raise UnsafeCheckpointError(
                    f"{where} places {_short(fqn)} and {_short(next_fqn)} over the same bytes of {path}"
                )
    for fqn, md in state.items():
        if not isinstance(md, TensorStorageMetadata):
            continue
        dtype = getattr(getattr(md, "properties", None), "dtype", None)
        if not isinstance(dtype, torch.dtype):
            raise UnsafeCheckpointError(f"{where} gives tensor {_short(fqn)} the dtype {_short(dtype)}")
        size = ints(md.size, f"the size of tensor {_short(fqn)}")
        covered = 0
        for chunk in md.chunks if isinstance(md.chunks, list) else ():
            sizes = ints(chunk.sizes, f"a chunk size of tensor {_short(fqn)}")
            offsets = ints(chunk.offsets, f"a chunk offset of tensor {_short(fqn)}")
            info = storage.get(MetadataIndex(fqn, offsets))
            if info is None:
                raise UnsafeCheckpointError(f"{where} stores no bytes for a chunk of tensor {_short(fqn)}")
            elements = _prod_capped(sizes, info.length // dtype.itemsize)
            if elements * dtype.itemsize > info.length:
                raise UnsafeCheckpointError(
                    f"{where} gives tensor {_short(fqn)} a chunk of {_short(sizes)} {dtype} elements, more than the "
                    f"{info.length} bytes that hold it in {info.relative_path}"
                )
            covered += elements
        if _prod_capped(size, covered) > covered:
            raise UnsafeCheckpointError(
                f"{where} gives tensor {_short(fqn)} the size {_short(size)}, more than the chunks stored for it hold"
            )


def _prod_capped(values: list[int], cap: int) -> int:
    """The product of ``values``, or some number above ``cap`` once it exceeds it. ``math.prod``
    of a crafted shape of a million dimensions multiplies ever longer integers: minutes of CPU
    (quadratic in the dimensions) before the check it serves could refuse the shape."""
    if 0 in values:
        return 0
    product = 1
    for n in values:
        product *= n
        if product > cap:
            return product
    return product


def _short(value: Any, limit: int = 200) -> str:
    """``repr(value)`` cut to ``limit`` characters: a crafted shape or name echoed whole would
    put megabytes into every rank's error and log line."""
    try:
        text = repr(value)
    except ValueError:  # an integer of more digits than Python converts to text
        return "an integer too long to print"
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} characters)"


# -- planner and reader ------------------------------------------------------------------------


class SafeLoadPlanner(DefaultLoadPlanner):
    """DefaultLoadPlanner whose non-tensor values load with ``weights_only=True``, and which takes
    every checkpoint as one written by torch 2.4 or later (as every spotjob checkpoint is: its
    torch floor is 2.9).

    DCP's planner guesses a checkpoint is older when the checkpoint holds a name the target lacks,
    and then flattens the target the old way (a list such as an optimizer's ``param_groups`` one
    value, not one per entry). A rank of an FSDP1 model (``FullyShardedDataParallel``) that holds
    no shard of a parameter lacks that name (DCP drops a ``ShardedTensor`` with no local shard), so
    it guessed so, and every restore of an FSDP1 optimizer failed: "Missing key in checkpoint
    state_dict: optim.param_groups". The guess also sets a module global of torch's for a while.
    """

    def create_local_plan(self) -> LoadPlan:
        if self.metadata is None:
            raise AssertionError("set_up_planner() gives the metadata first")
        return create_default_local_load_plan(self.state_dict, self.metadata, not self.allow_partial_load)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:
            raise UnsafeCheckpointError(
                f"value {read_item.dest_index.fqn!r} in the checkpoint is not plain data, refused "
                f"without running it: {refusal_reason(e)}"
            ) from None
        if self.flatten_state_dict:
            from torch.distributed.checkpoint._traverse import set_element

            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


class SafeEmptyLoadPlanner(SafeLoadPlanner, _EmptyStateDictLoadPlanner):
    """Rebuilds the chosen top-level keys from the checkpoint's metadata, values loaded safely."""


IN_PLACE_MIN_BYTES = 256 * 1024
"""The smallest tensor ``VerifiedReader`` reads straight into its target. Below it, inspecting the
record costs more than DCP's own path (load into fresh memory, then copy): 1.2-1.3x slower for
200 tensors of 16-192 KiB on the test machine, 2-3x quicker from 256 KiB; a model with
thousands of tiny parameters restored 1.9x slower than plain ``dcp.load`` with every tensor read
in place."""


IN_PLACE_READS = hasattr(torch._C.PyTorchFileReader, "get_record_size")
"""Whether this torch can read a tensor straight into its target (``VerifiedReader._read_in_place``):
its reader must say how big a record is, and torch 2.9.1's has no ``get_record_size``. Without it,
DCP's own path reads every tensor (load into fresh memory, then copy), as it does in any torch for
the tensors the in-place read leaves alone."""

_MAX_ITEMSIZE = max(t.itemsize for t in vars(torch).values() if isinstance(t, torch.dtype))
"""The widest element of any dtype (complex128: 16 bytes)."""


HOLD_ALL_MAX_FILES = 64
"""Up to how many files a filesystem checkpoint's are all opened when its read starts
(``VerifiedReader.hold_all``): two per saving rank, so a job of up to 32 ranks."""


class VerifiedReader(FileSystemReader):
    """Reads a committed checkpoint, verifying every file it touches against the manifest.

    ``local_dir`` is where the files are read from. For a filesystem store it is the checkpoint
    folder itself (files are CRC-checked in place); for an object store it is a node-local cache
    that files are downloaded into, verified, on first use. Ranks on one node share the cache
    and take a file lock per file, so each file crosses the network once per node.
    """

    def __init__(
        self,
        storage: Storage,
        folder: str,
        manifest: Manifest,
        local_dir: str,
        parallelism: int = 8,
        *,
        metadata: Metadata | None = None,
    ) -> None:
        """``metadata``: the checkpoint's ``.metadata`` already read, checked against ``manifest``'s
        CRC32C and ``check_metadata_fits`` (a restore's look at the manifest): not read again."""
        super().__init__(local_dir)
        self._held: dict[str, int] = {}
        """(filesystem store) Each file checked, kept open until ``close()``: a checkpoint that the
        job's retention deletes after the check (it unlinks the names) is still read whole, never
        half into the model. Files this process cannot keep open (too many open files) are read by
        name, as before."""
        self._files = _HeldFiles(self._held, local_dir)
        self.fs = self._files
        self.parallelism = parallelism
        self.storage = storage
        self.folder = folder
        self.manifest = manifest
        self.local_dir = local_dir
        self.in_place = storage.local_path(folder) == local_dir
        self._verified: set[str] = set()
        self._metadata: Metadata | None = metadata
        self.data_read_started = False
        """True once DCP began copying verified bytes into live tensors (``into_live`` loads)."""
        self.into_live = True
        """Whether the next load's targets are the caller's live tensors (False: fresh ones)."""
        self.prefault: list[torch.Tensor] = []
        """Tensors a later load will copy into: their pages are mapped along with this load's."""
        self.read_in_place = 0
        """Tensors read straight into their targets (``_read_in_place``)."""

    def ensure_local(self, relative_path: str) -> str:
        """Make ``relative_path`` available under ``local_dir``, verified; return its path."""
        entry = self.manifest.file(relative_path)
        if entry is None:
            raise UnsafeCheckpointError(f"DCP metadata points at {relative_path!r}, which MANIFEST.json does not list")
        path = os.path.join(self.local_dir, relative_path)
        if relative_path in self._verified:
            return path
        if self.in_place:
            fd = self._hold(relative_path, path)
            crc, size = crc32c_file_parallel(path, self.parallelism, fd=fd)
            if size != entry.size or crc != from_hex(entry.crc32c):
                raise CorruptObjectError(
                    f"{self.storage.url(self.folder + '/' + relative_path)} has size {size} and CRC32C "
                    f"{to_hex(crc)}; the manifest says {entry.size} and {entry.crc32c}",
                    relative_path,
                )
        else:
            fetch_verified(self.storage, self.folder, entry, self.local_dir)
        self._verified.add(relative_path)
        return path

    def _hold(self, relative_path: str, path: str) -> int | None:
        """Open ``path`` and keep it open (``_held``), unless it is already; None when the process
        has no descriptor to spare. A missing file raises, as reading it would."""
        held = self._held.get(relative_path)
        if held is not None:
            return held
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except OSError as e:
            if e.errno in (errno.EMFILE, errno.ENFILE):
                return None
            raise
        self._held[relative_path] = fd
        return fd

    def hold_all(self) -> None:
        """(filesystem store) Open every file of the checkpoint now, before any is checked, when it
        has at most ``HOLD_ALL_MAX_FILES``: from here on the job's retention cannot take it away
        from this read. A bigger checkpoint's files are held as each is checked. A missing file
        raises ``FileNotFoundError``."""
        if not self.in_place or len(self.manifest.files) > HOLD_ALL_MAX_FILES:
            return
        for entry in self.manifest.files:
            self._hold(entry.path, os.path.join(self.local_dir, entry.path))

    def open_verified(self, path: str) -> io.BufferedReader:
        """``path`` (a file ``ensure_local`` returned) for reading, from the descriptor held since
        its check where there is one."""
        return self._files.open(path)

    def close(self) -> None:
        """Let go of the files held open since their check (idempotent)."""
        while self._held:
            os.close(self._held.popitem()[1])

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self._metadata is None:
            with self.open_verified(self.ensure_local(DCP_METADATA_NAME)) as f:
                data = f.read()
            try:
                metadata = load_dcp_metadata(data)
            except _NotInThisTorch as e:
                writer, this = _torch_release(self.manifest.torch_version), _torch_release(torch.__version__)
                if writer is None or this is None or writer <= this:
                    raise
                raise NewerTorchError(
                    f"it was written under torch {self.manifest.torch_version}, and its DCP .metadata names "
                    f"{e.name}, which this older torch ({torch.__version__}) does not have: restore it with the "
                    "torch that wrote it or a newer one (the training image's torch went back)",
                    written_under=self.manifest.torch_version,
                    name=e.name,
                ) from None
            check_metadata_fits(metadata, self.manifest)
            self._metadata = metadata
        metadata = self._metadata
        from torch.distributed.checkpoint.metadata import StorageMeta

        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id  # type: ignore[union-attr]
        return metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        needed = {self.storage_data[item.storage_index].relative_path for item in plan.items}
        # Fetch (object stores) or CRC-check (filesystem) every file this rank needs, in
        # parallel, before DCP copies a single byte into the live state.
        # Meanwhile, have the kernel map the CPU targets' pages (a fresh model's memory is not
        # there yet until first touched), so the copies below only copy. Nothing is written.
        targets = [planner.resolve_tensor(i) for i in plan.items if i.type == LoadItemType.TENSOR]
        targets += self.prefault
        self.prefault = []
        mapping = threading.Thread(target=map_for_writing, args=(targets,), name="spotjob-map", daemon=True)
        mapping.start()
        try:
            parallel_map(self.ensure_local, [(p,) for p in sorted(needed)], self.parallelism)
        finally:
            mapping.join()
        if self.into_live:
            self.data_read_started = True  # from here on, live tensors may change
        rest = [item for item in plan.items if not self._read_in_place(item, planner)]
        return super().read_data(dataclasses.replace(plan, items=rest), planner)

    def _read_in_place(self, item: ReadItem, planner: LoadPlanner) -> bool:
        """Read one saved tensor's bytes straight into its target, when nothing needs converting.

        DCP's own path ``torch.load``s each tensor into fresh memory and then copies it into the
        target: two passes over the bytes and a state-sized allocation. When the record holds one
        whole contiguous tensor of the target's dtype and shape and the target is a contiguous CPU
        tensor, its bytes are read from the (already verified) file into the target instead. The
        record is inspected without reading its data (``torch.serialization.skip_data``, a
        thread-local switch; ``weights_only`` as everywhere). False: DCP's path reads the item;
        so it does for a tensor under ``IN_PLACE_MIN_BYTES``, whose copy costs less than the
        inspection.
        """
        if item.type != LoadItemType.TENSOR or not IN_PLACE_READS:
            return False
        if math.prod(item.lengths) * _MAX_ITEMSIZE < IN_PLACE_MIN_BYTES:
            return False  # under IN_PLACE_MIN_BYTES whatever the target's dtype: said before resolving it
        info = self.storage_data[item.storage_index]
        if info.transform_descriptors or any(item.storage_offsets):
            return False
        target = planner.resolve_tensor(item).detach()
        if target.device.type != "cpu" or not target.is_contiguous() or list(item.lengths) != list(target.shape):
            return False
        if target.nbytes < IN_PLACE_MIN_BYTES:
            return False
        path = os.path.join(self.local_dir, info.relative_path)
        try:
            with self.open_verified(path) as stream:
                with torch.serialization.skip_data():
                    saved = torch.load(self._slice_file(stream, info), map_location="meta", weights_only=True)
                if not (
                    isinstance(saved, torch.Tensor)
                    and saved.dtype == target.dtype
                    and saved.shape == target.shape
                    and saved.is_contiguous()
                    and saved.storage_offset() == 0
                    and saved.untyped_storage().nbytes() == target.nbytes
                ):
                    return False
                records = torch._C.PyTorchFileReader(self._slice_file(stream, info))
                data = [name for name in records.get_all_records() if name.startswith("data/")]
                if len(data) != 1 or records.get_record_size(data[0]) != target.nbytes:
                    return False
                offset = int(records.get_record_offset(data[0]))  # type: ignore[attr-defined]
                if offset + target.nbytes > info.length:
                    return False
        except Exception:  # DCP's path reads it, and reports what is wrong with it as it always did
            return False
        _read_exactly(path, info.offset + offset, target, fd=self._held.get(info.relative_path))
        planner.commit_tensor(item, target)
        self.read_in_place += 1
        return True


class _HeldFiles(FileSystem):
    """DCP's file access for a ``VerifiedReader``: a file held open since its check is read from
    a duplicate of that descriptor (rewound), never opened again by name."""

    def __init__(self, held: dict[str, int], local_dir: str) -> None:
        super().__init__()
        self._held = held
        self._local_dir = local_dir

    def open(self, path: str | os.PathLike[str]) -> io.BufferedReader:
        fd = self._held.get(os.path.relpath(os.fspath(path), self._local_dir))
        if fd is None:
            return open(path, "rb")
        stream = os.fdopen(os.dup(fd), "rb")
        stream.seek(0)
        return stream

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Iterator[io.IOBase]:
        if mode != "rb":
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with self.open(path) as stream:
            yield stream


_MADV_POPULATE_WRITE = 23  # Linux 5.14+
_madvise: Any = None


def map_for_writing(tensors: list[torch.Tensor]) -> None:
    """Fault in the pages of these CPU tensors' memory, writable, without changing a byte
    (``madvise(MADV_POPULATE_WRITE)``); a no-op where the kernel lacks it. Memory the process has
    not touched yet (a model built for the restore) is otherwise mapped page by page during the
    copy into it, which on a VM can cost more than the copy itself. Never called off Linux: 23 is
    Linux's number for it, and another kernel's ``madvise`` (macOS has one) gives its own numbers
    their own meanings, some of which discard the pages' contents."""
    global _madvise
    if _madvise is None:
        if not sys.platform.startswith("linux"):
            _madvise = False
            return
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            _madvise = libc.madvise
        except (OSError, AttributeError):
            _madvise = False
    if not _madvise:
        return
    page = mmap.PAGESIZE
    for tensor in tensors:
        if tensor.device.type != "cpu" or tensor.nbytes < page:
            continue
        storage = tensor.untyped_storage()
        start = -(-storage.data_ptr() // page) * page
        end = (storage.data_ptr() + storage.nbytes()) // page * page
        if end > start and _madvise(start, end - start, _MADV_POPULATE_WRITE) != 0:
            return  # EINVAL: an older kernel; nothing else to try


def _read_exactly(path: str, offset: int, target: torch.Tensor, *, fd: int | None = None) -> None:
    """``target.nbytes`` bytes of ``path`` from ``offset`` into ``target``'s memory (from ``fd``,
    left open, when given: positional reads, whatever its offset)."""
    if not target.nbytes:
        return
    view = target.reshape(-1).view(torch.uint8).numpy().data.cast("B")
    owned = fd is None
    if fd is None:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        while view:
            n = os.preadv(fd, [view], offset)
            if n <= 0:
                raise CorruptObjectError(f"{path} ended before the tensor it records", os.path.basename(path))
            view = view[n:]
            offset += n
    finally:
        if owned:
            os.close(fd)


# -- DCP's load, minus its single-process warning; the tensor index ----------------------------


def dcp_load(
    state: dict[str, Any], reader: FileSystemReader, planner: LoadPlanner, *, process_group: Any, no_dist: bool
) -> None:
    """What ``dcp.load`` does for plain (non-``Stateful``) values, in place, without its warning."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    ordered = {key: state[key] for key in sorted(state)}  # every rank loads the keys in one order
    _load_state_dict(
        state_dict=ordered, storage_reader=reader, process_group=process_group, no_dist=no_dist, planner=planner
    )
    state.update(ordered)


_tensor_entry = TensorEntry.__pydantic_validator__.validate_python
"""``TensorEntry(**fields)`` without its Python ``__init__`` frame: the same validation, a seventh
less time per tensor. (Validating the whole index in one call was slower: the 8000 dicts it holds at
once, with their copies, set off a full garbage collection most saves, a tenth of a second.)"""


def tensor_index(metadata: Metadata) -> dict[str, TensorEntry]:
    """Fully-qualified tensor name → shape, dtype and the shard files that hold it."""
    return _tensor_index(metadata, _tensor_files(metadata))


def _tensor_files(metadata: Metadata) -> dict[str, str | set[str]]:
    """The shard file of each tensor by name; a set of them only for a tensor spread over several.

    One file's name (a string) for nearly every tensor, rather than a set each: a dict of strings
    is no object the garbage collector tracks, where 8000 sets were 8000 objects held through the
    index's building, enough of them to count toward the next full collection (bench/README.md)."""
    files: dict[str, str | set[str]] = {}
    for index, info in (metadata.storage_data or {}).items():
        path = info.relative_path
        held = files.setdefault(index.fqn, path)
        if held != path:
            if isinstance(held, str):
                files[index.fqn] = {held, path}
            else:
                held.add(path)
    return files


def _tensor_index(metadata: Metadata, files: dict[str, str | set[str]]) -> dict[str, TensorEntry]:
    out: dict[str, TensorEntry] = {}
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            held = files.get(fqn, ())
            # Tuples in, lists out: pydantic builds the entry's lists either way, and a tuple (of
            # one name, or torch's Size) is not a second list made only to be thrown away.
            out[fqn] = _tensor_entry(
                {
                    "shape": md.size,
                    "dtype": str(md.properties.dtype).removeprefix("torch."),
                    "files": (held,) if isinstance(held, str) else sorted(held),
                }
            )
    return out


def manifest_disagreements(manifest: Manifest, metadata: Metadata) -> list[str]:
    """Where MANIFEST.json and DCP's ``.metadata`` (CRC-checked against the manifest) describe the
    checkpoint otherwise, one line each: a damaged manifest (a flipped bit in a shape, a dtype, a
    state key), which a restore would otherwise take at its word (refusing the model as changed,
    or missing a state key, instead of passing over the damaged checkpoint).

    ``.metadata`` must name only files the manifest lists; the tensor index must be the one the
    writer derived from ``.metadata`` (``tensor_index``), entry for entry, where the manifest has
    one; each name ``.metadata`` holds must lie under one of the manifest's state keys."""
    problems = []
    listed = {f.path for f in manifest.files}
    for path in sorted({info.relative_path for info in (metadata.storage_data or {}).values()} - listed):
        problems.append(f"file {DCP_METADATA_NAME} points at {path!r}, which MANIFEST.json does not list")
    if manifest.tensors:
        differ = _index_differences(metadata, manifest.tensors)
        if differ:
            problems.append(
                f"MANIFEST.json's tensor index disagrees with {DCP_METADATA_NAME} for {len(differ)} tensor(s), "
                f"e.g. {differ[0]!r}"
            )
    keys = manifest.state_keys
    outside = sorted(n for n in metadata.state_dict_metadata if not any(n == k or n.startswith(f"{k}.") for k in keys))
    if outside:
        problems.append(
            f"{DCP_METADATA_NAME} holds {outside[0]!r}, under none of MANIFEST.json's state keys {list(keys)}"
        )
    return problems


def _index_differences(metadata: Metadata, tensors: dict[str, TensorEntry]) -> list[str]:
    """The names whose entry in ``tensors`` is not what ``tensor_index(metadata)`` would give,
    sorted: compared field by field, without building the index (a restore of 16 000 tensors
    spent a tenth of a second more building it)."""
    files = _tensor_files(metadata)
    differ, found = [], 0
    for fqn, md in metadata.state_dict_metadata.items():
        if not isinstance(md, TensorStorageMetadata):
            continue
        entry = tensors.get(fqn)
        if entry is None:
            differ.append(fqn)
            continue
        found += 1
        held = files.get(fqn, ())
        if (
            entry.shape != list(md.size)
            or entry.dtype != str(md.properties.dtype).removeprefix("torch.")
            or entry.files != ([held] if isinstance(held, str) else sorted(held))
        ):
            differ.append(fqn)
    if found != len(tensors):  # names only the manifest holds
        state = metadata.state_dict_metadata
        differ += [fqn for fqn in tensors if not isinstance(state.get(fqn), TensorStorageMetadata)]
    return sorted(differ)


class TensorIndexCache:
    """The manifest's tensor index of a Checkpointer's last save, handed out again while its saves
    write the same tensors into the same files.

    A save whose state keeps its structure reuses DCP's metadata (``agent._dcp_plan.SavePlanCache``:
    the same ``state_dict_metadata`` object, every tensor's shape and dtype), and its tensors land
    in the same shard files; its index is then the last one, entry for entry. Building it afresh
    made five objects per tensor the garbage collector tracks (the entry, its ``__dict__``, its
    set of fields, its two lists), 40,000 for 8000 tensors, held past the save: about a third of
    what a save of many small tensors hands to the oldest generation, where enough of it sets off a
    full collection (bench/README.md, "Full garbage collections"). The entries are frozen, so two
    manifests may share them; each manifest gets a dict of its own. Any other metadata (a state
    planned afresh, another file layout, a metadata file read back) builds the index as before.
    """

    def __init__(self) -> None:
        self._key: tuple[object, dict[str, str | set[str]]] | None = None
        self._index: dict[str, TensorEntry] = {}

    def index(self, metadata: Metadata) -> dict[str, TensorEntry]:
        """``tensor_index(metadata)``: the last one's entries when ``metadata`` describes the same
        tensors (the same ``state_dict_metadata``, held here so that it stays that object) in the
        same files."""
        files = _tensor_files(metadata)
        key = self._key
        if key is not None and key[0] is metadata.state_dict_metadata and key[1] == files:
            return dict(self._index)
        index = _tensor_index(metadata, files)
        self._key, self._index = (metadata.state_dict_metadata, files), index
        return dict(index)
