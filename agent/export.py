"""Export one state key of a checkpoint as Hugging Face safetensors files, and the verified reader
that ``spotjob ckpt verify --deep`` and ``export`` read a checkpoint through.

The engine behind ``spotjob ckpt export`` (``orchestrator.ckpt_export`` is the command): it
lives beside the Checkpointer because it needs torch, DCP and safetensors, which it imports only
when it runs, so importing this module costs nothing. Its refusals are ``ExportError``s, one line
each, ``invalid`` when the checkpoint itself is at fault, ``proven_bad`` when it is so in a way a
restore would skip it for an older one (a corrupt, missing or unsafe file). A store that fails
(unreachable, throttled past the retries, permission denied) proves nothing about the checkpoint.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import re
import shutil
import tempfile
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from agent.catalog import CheckpointStatus
from agent.manifest import Manifest
from agent.restore_cache import NO_LOCKS
from agent.storage import CorruptObjectError, NotFoundError, StorageError
from agent.storage.base import ObjectInfo, ProgressFn, Storage

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

    from agent.dcp_safe import VerifiedReader

log = logging.getLogger(__name__)

INDEX_NAME = "model.safetensors.index.json"
SINGLE_FILE_NAME = "model.safetensors"
_SHARD_NAME_RE = re.compile(r"^model(-\d{5}-of-\d{5})?\.safetensors$")
WORK_PREFIX = ".spotjob-export-"
"""The hidden folder in OUT (``WORK_PREFIX`` + a random suffix, mode 0700) an export writes its
files in before renaming them into OUT; removed when the export ends, left by one killed."""

ProgressBar = Callable[[str, int], AbstractContextManager[ProgressFn | None]]
"""``progress_bar(description, total bytes)``: a context that yields a callback for bytes done, or None."""

RemovedFn = Callable[[list[str]], None]
"""``removed(names)``: with ``force``, the files of an earlier export removed from OUT (their names
in it), called once they are gone, before the new export's files are renamed into place."""


@contextlib.contextmanager
def no_progress(description: str, total: int) -> Iterator[ProgressFn | None]:
    """The default ``ProgressBar``: shows nothing."""
    yield None


class ExportError(Exception):
    """Why an export stopped, in one line; ``invalid``: the checkpoint is at fault (not the arguments,
    the store or the target folder); ``proven_bad``: at fault the way a restore skips a checkpoint
    for an older one (implies ``invalid``). Nothing of the export is left behind."""

    def __init__(self, message: str, *, invalid: bool = False, proven_bad: bool = False) -> None:
        super().__init__(message)
        self.invalid = invalid or proven_bad
        self.proven_bad = proven_bad


def _read_failure(folder: str, e: Exception, what: str) -> ExportError:
    """A failure to read ``folder``'s files: proven bad (restore would skip the checkpoint) or the store's."""
    if isinstance(e, CorruptObjectError | NotFoundError) or not isinstance(e, StorageError):
        return ExportError(f"{folder}: {what}{e}", proven_bad=True)  # not a StorageError: the unsafe pickle
    return ExportError(f"cannot read {folder}: {e}")


@contextlib.contextmanager
def checkpoint_reader(storage: Storage, status: CheckpointStatus) -> Iterator[VerifiedReader]:
    """A VerifiedReader for ``status``: in place on a filesystem, else via a temporary cache."""
    from agent.dcp_safe import VerifiedReader

    assert status.manifest is not None
    folder = status.ref.folder
    local = storage.local_path(folder)
    with contextlib.ExitStack() as stack:
        if local is None:
            local = stack.enter_context(tempfile.TemporaryDirectory(prefix="spotjob-ckpt-"))
        reader = VerifiedReader(storage, folder, status.manifest, local)
        stack.callback(reader.close)  # a filesystem checkpoint's files, held open since their check
        yield reader


@dataclass
class ExportTotals:
    """What an export wrote."""

    tensors: int = 0
    bytes: int = 0
    left_out: list[str] = field(default_factory=list)
    """Entries under the key that are not tensors (a module's ``_extra_state``, an optimizer's
    ``param_groups``): safetensors holds tensors only, so they are not in the export."""


def export_safetensors(
    storage: Storage,
    status: CheckpointStatus,
    manifest: Manifest,
    key: str,
    out: str,
    max_shard_size: int,
    force: bool,
    progress_bar: ProgressBar = no_progress,
    removed: RemovedFn | None = None,
) -> tuple[list[str], ExportTotals]:
    """Load the tensors under ``key`` shard by shard through DCP and write them as safetensors.

    Nothing is read that the manifest does not vouch for: the metadata and every shard file go
    through ``VerifiedReader`` (fetched and CRC-checked once each, before DCP reads them), and
    the target state dict is built from DCP's metadata, so no model is needed. The index is
    written last: an export that died part-way has no index and the files it wrote are removed.
    ``progress_bar(description, total bytes)`` shows the transfers and the writing; ``removed``
    hears which files of an earlier export ``force`` removed (the engine prints nothing itself).
    """
    from agent.dcp_safe import NewerTorchError, UnsafeCheckpointError, manifest_disagreements

    prefix = key + "."
    folder = status.ref.folder
    # Fetches from an object store report progress through the wrapper; DCP never sees it.
    fetching = _ProgressStorage(storage)
    with checkpoint_reader(fetching, status) as reader:
        try:
            reader.hold_all()  # a filesystem checkpoint's files, open from here on: retention cannot take them
            metadata = reader.read_metadata()
        except NewerTorchError as e:
            # Not proven bad: as a restore under this torch, stop there rather than go back to an older one.
            import torch

            raise ExportError(
                f"{folder}: refusing to export: it was written under torch {e.written_under}, and its DCP "
                f".metadata names {e.name}, which this older torch ({torch.__version__}) does not have. Export "
                "it with the torch that wrote it or a newer one, or name an older checkpoint with --step"
            ) from None
        except (UnsafeCheckpointError, StorageError) as e:
            raise _read_failure(folder, e, "refusing to export: ") from None
        damaged = manifest_disagreements(manifest, metadata)
        if damaged:  # as a restore passes it over: a flipped bit in the manifest's own fields
            raise ExportError(f"{folder}: refusing to export: damaged: {'; '.join(damaged)}", proven_bad=True)
        tensors = _tensors_under(metadata, prefix)
        if not tensors:
            raise ExportError(
                f"state key {key!r} holds no tensors in the DCP shards of {folder} (only modules and "
                "optimizers are saved through DCP; other state is per-rank and not exported)"
            )
        _check_dtypes(tensors, folder)
        needed = sorted(
            {info.relative_path for idx, info in (metadata.storage_data or {}).items() if idx.fqn in tensors}
        )
        _fetch(reader, fetching, needed, progress_bar)
        shards = plan_shards(tensors, max_shard_size)
        names, totals = _write_shards(reader, tensors, shards, prefix, out, force, progress_bar, removed)
        totals.left_out = _left_out(metadata, prefix)
        return names, totals


def _left_out(metadata: Metadata, prefix: str) -> list[str]:
    """The state dict's own names under ``prefix`` that hold something other than a tensor, without
    the prefix: DCP flattens a value (``0._extra_state.scale``, ``param_groups.0.lr``), and its
    ``planner_data`` keeps the path to it, whose first name under the key is the one a user knows."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    paths = metadata.planner_data if isinstance(metadata.planner_data, dict) else {}
    names: dict[str, None] = {}
    for fqn, md in metadata.state_dict_metadata.items():
        if not fqn.startswith(prefix) or isinstance(md, TensorStorageMetadata):
            continue
        path = paths.get(fqn)
        if isinstance(path, tuple) and path and isinstance(path[0], str) and path[0].startswith(prefix):
            names[path[0][len(prefix) :]] = None  # a module's: the key and the name are one string
        elif isinstance(path, tuple) and len(path) > 1 and path[0] == prefix[:-1]:
            names[str(path[1])] = None  # an optimizer's: ("optim", "param_groups", 0, "lr")
        else:
            names[fqn[len(prefix) :]] = None
    return list(names)


def _tensors_under(metadata: Metadata, prefix: str) -> dict[str, TensorStorageMetadata]:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    return {
        fqn: md
        for fqn, md in metadata.state_dict_metadata.items()
        if fqn.startswith(prefix) and len(fqn) > len(prefix) and isinstance(md, TensorStorageMetadata)
    }


def _check_dtypes(tensors: dict[str, TensorStorageMetadata], folder: str) -> None:
    """Refuse, before anything is fetched or written, a tensor whose dtype safetensors cannot store
    (complex128, complex32, ...): each dtype is tried once on an empty tensor."""
    import torch
    from safetensors.torch import save

    refused: dict[torch.dtype, str] = {}
    tried: set[torch.dtype] = set()
    for fqn, md in tensors.items():
        dtype = md.properties.dtype
        if dtype not in tried:
            tried.add(dtype)
            try:
                save({"t": torch.empty(0, dtype=dtype)})
            except Exception:
                refused[dtype] = fqn
    if refused:
        dtype, fqn = next(iter(refused.items()))
        name = str(dtype).removeprefix("torch.")
        how = "a dtype safetensors has"
        if dtype.is_complex:
            real = str(dtype.to_real()).removeprefix("torch.")
            how += f" (a {name} tensor as torch.view_as_real(), {real})"
        raise ExportError(
            f"{folder}: tensor {fqn!r} is {name}, which safetensors cannot store; nothing was exported. "
            f"Export another state key, or save such tensors in {how}"
        )


def _nbytes(md: TensorStorageMetadata) -> int:
    numel = 1
    for n in md.size:
        numel *= n
    return numel * md.properties.dtype.itemsize


def plan_shards(tensors: dict[str, TensorStorageMetadata], max_shard_size: int) -> list[list[str]]:
    """Split names, in checkpoint order, into shards of at most ``max_shard_size`` tensor bytes.

    Greedy in order, as Hugging Face does; a tensor larger than the limit gets a shard to itself.
    """
    shards: list[list[str]] = []
    current: list[str] = []
    size = 0
    for fqn, md in tensors.items():
        n = _nbytes(md)
        if current and size + n > max_shard_size:
            shards.append(current)
            current, size = [], 0
        current.append(fqn)
        size += n
    if current:
        shards.append(current)
    return shards


def shard_file_names(count: int) -> list[str]:
    """Hugging Face's names: ``model.safetensors`` alone, else ``model-00001-of-00003.safetensors``."""
    if count == 1:
        return [SINGLE_FILE_NAME]
    return [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


def _fetch(reader: VerifiedReader, fetching: _ProgressStorage, paths: Sequence[str], progress_bar: ProgressBar) -> None:
    """Make every shard file local and verified before DCP opens any of them.

    Verifying up front turns a corrupt or missing file into one clear error naming it, instead of
    a failure deep inside DCP's read plan.
    """
    total = sum(e.size for e in (reader.manifest.file(p) for p in paths) if e is not None)
    # In place (a filesystem store) the reader CRCs files without reporting bytes: no bar then.
    with progress_bar(f"fetching {len(paths)} shard file(s)", 0 if reader.in_place else total) as progress:
        fetching.progress = progress
        try:
            for path in paths:
                reader.ensure_local(path)
        except StorageError as e:
            raise _read_failure(reader.folder, e, "") from None
        finally:
            fetching.progress = None


def _write_shards(
    reader: VerifiedReader,
    tensors: dict[str, TensorStorageMetadata],
    shards: list[list[str]],
    prefix: str,
    out: str,
    force: bool,
    progress_bar: ProgressBar,
    removed: RemovedFn | None,
) -> tuple[list[str], ExportTotals]:
    import torch
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.api import CheckpointException

    from agent.dcp_safe import SafeLoadPlanner

    created: list[str] = []
    umask = os.umask(0)
    os.umask(umask)
    mode = 0o666 & ~umask
    names = shard_file_names(len(shards))
    totals = ExportTotals()
    weight_map: dict[str, str] = {}
    staged: list[tuple[str, str]] = []
    written: list[str] = []
    work: str | None = None
    total_bytes = sum(_nbytes(tensors[f]) for shard in shards for f in shard)
    lock: int | None = None
    try:
        created = _make_folders(out)
        lock = _lock_out(out)
        # Under the lock: an export that finished here since the command looked at OUT is not
        # mixed with this one, nor, with force, is one still writing here removed.
        if not force and os.listdir(out):
            raise ExportError(f"{out} is not empty; choose a new folder or pass --force to replace an export there")
        # The files are written in a folder of this export's own (mode 0700, a new name): in an OUT
        # others can write in, no one can swap what is being written for a symlink to a file of
        # theirs (safetensors opens its file by name), nor touch it before its rename into place.
        work = tempfile.mkdtemp(prefix=WORK_PREFIX, dir=out)
        with progress_bar(f"writing {len(shards)} safetensors file(s)", total_bytes) as progress:
            for name, shard in zip(names, shards, strict=True):
                state = {
                    fqn: torch.empty(tuple(tensors[fqn].size), dtype=tensors[fqn].properties.dtype) for fqn in shard
                }
                try:
                    with warnings.catch_warnings():
                        # no_dist is the point here; DCP warns about it on every call.
                        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                        dcp.load(state, storage_reader=reader, planner=SafeLoadPlanner(), no_dist=True)
                except (Exception, CheckpointException) as e:  # DCP's own is a BaseException
                    log.debug("dcp.load failed", exc_info=True)
                    raise ExportError(
                        f"{reader.folder}: DCP could not load {len(shard)} tensor(s) starting at "
                        f"{shard[0]!r}: {_first_failure(e)}",
                        invalid=True,
                    ) from None
                tmp = os.path.join(work, name)
                save_file({fqn[len(prefix) :]: t for fqn, t in state.items()}, tmp, metadata={"format": "pt"})
                os.chmod(tmp, mode)  # an export is for sharing
                staged.append((tmp, os.path.join(out, name)))
                shard_bytes = sum(t.nbytes for t in state.values())
                totals.tensors += len(state)
                totals.bytes += shard_bytes
                weight_map.update({fqn[len(prefix) :]: name for fqn in shard})
                del state
                if progress:
                    progress(shard_bytes)
                log.debug("wrote %s: %d tensors, %d bytes", tmp, len(shard), shard_bytes)
        index = {"metadata": {"total_size": totals.bytes}, "weight_map": weight_map}
        tmp = os.path.join(work, INDEX_NAME)
        with open(tmp, "wb") as f:
            f.write((json.dumps(index, indent=2, sort_keys=True) + "\n").encode())
        os.chmod(tmp, mode)
        # Everything is written: only now does an earlier export give way (a full disk halfway
        # through leaves it as it was). The index goes last: its presence says the export is complete.
        if force:
            _remove_earlier_export(out, ours=os.path.basename(work), removed=removed)
        for partial, path in staged:
            os.replace(partial, path)  # a link planted at ``path`` is replaced, never written through
            written.append(path)
        os.replace(tmp, os.path.join(out, INDEX_NAME))
    except BaseException as e:
        for path in written:
            # NotADirectoryError: OUT could not be made (a file is in the way), so nothing is in it.
            with contextlib.suppress(FileNotFoundError, NotADirectoryError):
                os.unlink(path)
        if work is not None:
            shutil.rmtree(work, ignore_errors=True)
        for folder in reversed(created):  # OUT first, then each parent this export made for it
            with contextlib.suppress(OSError):
                os.rmdir(folder)  # only if it is empty: never what another process put there
        if lock is not None:
            os.close(lock)
        if isinstance(e, Exception) and not isinstance(e, ExportError):
            log.debug("writing the export failed", exc_info=True)
            raise ExportError(f"cannot write the export in {out}: {_write_failure(e)}; nothing was exported") from None
        raise
    # After the try: the export is whole in OUT, and nothing left in its emptied folder undoes it.
    shutil.rmtree(work, ignore_errors=True)
    os.close(lock)
    return names, totals


_NO_LOCKS = NO_LOCKS | {errno.EBADF}
"""What ``flock`` says where a folder cannot be locked: a filesystem without locks, and NFS, which
refuses an exclusive lock on a file opened read-only (as a folder is)."""


def _lock_out(out: str) -> int:
    """Lock the folder ``out`` for this export (``flock`` on the folder itself, so nothing is left
    in it); the descriptor holds the lock until closed, or until the process dies. Another export
    into ``out`` holding it is an ``ExportError``. Where folders cannot be locked the export goes on
    unlocked; on NFS the lock is seen by the exports of this machine only."""
    fd = os.open(out, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise ExportError(
            f"another spotjob ckpt export is writing into {out}; wait for it to finish, or export to another folder"
        ) from None
    except OSError as e:
        if e.errno not in _NO_LOCKS:
            os.close(fd)
            raise
        log.debug("cannot lock %s (%s); exporting without the lock", out, e.strerror)
    return fd


def _make_folders(out: str) -> list[str]:
    """Make ``out`` and the parents it lacks, one by one; the folders made, outermost first.

    Only these are removed again when the export fails: a folder that was there before (or that
    another process made meanwhile) is never this export's to remove.
    """
    missing: list[str] = []
    path = out
    while not os.path.lexists(path):
        missing.append(path)
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    made: list[str] = []
    try:
        for path in reversed(missing):
            try:
                os.mkdir(path)
            except FileExistsError:
                if not os.path.isdir(path):
                    raise
                continue  # made by someone else since the look: not ours
            made.append(path)
    except BaseException:
        for path in reversed(made):
            with contextlib.suppress(OSError):
                os.rmdir(path)
        raise
    return made


_WRITE_FAILURES = {
    errno.ENOSPC: "no space left on the device: free some, or export to another folder",
    errno.EDQUOT: "the disk quota is exceeded: free some, or export to another folder",
    errno.EFBIG: "a file grew past what this filesystem, or this process's file-size limit (ulimit -f), allows",
    errno.EROFS: "the filesystem is read-only",
    errno.ENOTDIR: "a regular file is in the way (a folder on the path is a file): export to another folder",
    errno.EACCES: "permission denied",
    errno.EPERM: "permission denied",
}


def _write_failure(e: BaseException) -> str:
    """What went wrong writing a file, in words: an ``OSError``, or safetensors' error naming one."""
    code = e.errno if isinstance(e, OSError) else None
    if code is None:
        found = re.search(r"os error (\d+)", str(e))
        code = int(found.group(1)) if found else None
    if code in _WRITE_FAILURES:
        return _WRITE_FAILURES[code]
    if code is not None:
        return os.strerror(code)
    return f"{type(e).__name__}: {e}"


def _first_failure(e: BaseException) -> str:
    """DCP's CheckpointException holds a per-rank map of failures; the first one is the story.

    Each is an ``(exception, traceback)`` pair. A tensor record that weights_only loading refused
    is said as refused, without torch's advice to switch the check off.
    """
    import pickle

    from agent.rank_state import refusal_reason

    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        first = next(iter(failures.values()))
        first = first[0] if isinstance(first, tuple) and first else first
        if isinstance(first, BaseException):
            e = first
    if isinstance(e, pickle.UnpicklingError):
        return f"a record is not plain data, refused without running it: {refusal_reason(e)}"
    return f"{type(e).__name__}: {e}"


def _remove_earlier_export(out: str, ours: str, removed: RemovedFn | None) -> None:
    """An earlier export's shards and index, and what one killed before its renames left: its
    working folder (``WORK_PREFIX``), or the ``.<name>.partial`` files of a spotjob before
    2026-12-07; never this export's own working folder ``ours``. Called under OUT's lock
    (``_lock_out``): no other export is writing there, so any other working folder is a leftover.
    ``removed`` hears the names of those removed (sorted), those removed before a failure too."""
    gone: list[str] = []
    try:
        for entry in os.listdir(out):
            path = os.path.join(out, entry)
            if entry.startswith(WORK_PREFIX) and entry != ours and os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path)  # never follows a link inside it
                gone.append(entry)
                continue
            name = entry[1 : -len(".partial")] if entry.startswith(".") and entry.endswith(".partial") else entry
            if _SHARD_NAME_RE.match(name) or name == INDEX_NAME:  # never ours: a WORK_PREFIX folder
                os.unlink(path)
                gone.append(entry)
    finally:
        if gone and removed is not None:
            removed(sorted(gone))


class _ProgressStorage(Storage):
    """Delegates to ``inner``, adding ``progress`` to downloads that come without one.

    ``VerifiedReader`` fetches files without a progress callback; wrapping the store it reads
    from is how an export shows its transfers without changing the reader.
    """

    def __init__(self, inner: Storage) -> None:
        self.inner = inner
        self.uri = inner.uri
        self.progress: ProgressFn | None = None

    def get_file(
        self,
        key: str,
        local_path: str,
        *,
        size: int | None = None,
        crc32c: int | None = None,
        progress: ProgressFn | None = None,
    ) -> None:
        self.inner.get_file(key, local_path, size=size, crc32c=crc32c, progress=progress or self.progress)

    def put_file(
        self, local_path: str, key: str, *, crc32c: int | None = None, progress: ProgressFn | None = None
    ) -> None:
        self.inner.put_file(local_path, key, crc32c=crc32c, progress=progress)

    def put_bytes(self, key: str, data: bytes) -> None:
        self.inner.put_bytes(key, data)

    def put_bytes_if_absent(self, key: str, data: bytes) -> None:
        self.inner.put_bytes_if_absent(key, data)

    def get_bytes(self, key: str) -> bytes:
        return self.inner.get_bytes(key)

    def get_small(self, key: str, max_bytes: int) -> tuple[bytes, ObjectInfo]:
        return self.inner.get_small(key, max_bytes)

    def stat(self, key: str) -> ObjectInfo | None:
        return self.inner.stat(key)

    def list_dirs(self, prefix: str = "") -> list[str]:
        return self.inner.list_dirs(prefix)

    def delete(self, keys: Iterable[str]) -> None:
        self.inner.delete(keys)

    def delete_prefix(self, prefix: str) -> None:
        self.inner.delete_prefix(prefix)

    def url(self, key: str = "") -> str:
        return self.inner.url(key)

    def local_path(self, key: str) -> str | None:
        return self.inner.local_path(key)

    def close(self) -> None:
        self.inner.close()

    # Last: inside the class body, ``list`` names this method from here on.
    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        return self.inner.list(prefix)
