"""The node's restore cache, and filling it before the ranks ask. No torch import.

A rank restoring from an object store reads every file from ``<staging>/restore/<step folder>/``:
each file is downloaded once per node (the ranks of a node take a lock per file), verified
against the manifest's size and CRC32C as it arrives, and marked ``<file>.verified``. The marker
says what was verified — the file's URL in the store, its size and CRC32C from the manifest — and
a file is trusted without a second download only when its marker says exactly that of the entry
asked for now (``fetch_verified``): a file another checkpoint, URI or job left under the same
name is fetched and verified again, never handed out.

``prefetch`` is what spotjob-agent does while torchrun starts, torch imports and the ranks meet
— seconds the restore would otherwise wait for: it finds the job's newest valid checkpoint the way
``Checkpointer.restore`` does and fetches its files into the same cache, through the same locks
and markers, so a rank that arrives first waits for the file in flight instead of fetching it
again. On a filesystem store there is nothing to fetch; ``prefetch`` reads (and CRC-checks) the
files once so the restore finds them in the page cache. A failed prefetch is logged and
harmless: the restore fetches what it lacks and checks everything itself.

Told which ranks the node runs (``ranks``), the prefetch fetches only what they will read when
the checkpoint's world size is theirs (``node_files``): a file left out that a rank does read is
fetched by that rank's restore, as without a prefetch.
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
import stat
import tempfile
import threading
import time
from collections.abc import Callable

from agent import _fresh_start
from agent._layout import STAGING_FOLDER
from agent.atomic_file import write_atomic
from agent.catalog import CheckpointRef, find_checkpoints, inspect
from agent.crc32c import crc32c_bytes, crc32c_file_parallel, from_hex, to_hex
from agent.manifest import CACHE_SUFFIXES, DCP_METADATA_NAME, DCP_SHARD_SUFFIX, FileEntry, Manifest, rank_file_name
from agent.ownership import Lineage, OwnershipError
from agent.storage import CorruptObjectError, Storage, StorageError
from agent.storage.base import parallel_map

log = logging.getLogger(__name__)

RESTORE_FOLDER = "restore"
LOCK_SUFFIX, VERIFIED_SUFFIX = CACHE_SUFFIXES


def staging_root(storage: Storage, job: str | None, staging_dir: str | None = None) -> str:
    """The node's staging folder of ``job`` on ``storage``: where its ranks stage saves and cache
    restores, and where spotjob-agent's prefetch puts the files. The Checkpointer and the agent
    both ask here, so they agree.

    ``staging_dir`` given (``Checkpointer(staging_dir=...)``, ``SPOTJOB_STAGING_DIR``,
    ``spotjob-agent --staging-dir``): a folder inside it named after the job and the URI, so jobs
    sharing one staging disk on a node never touch each other's files — a job clears only its own
    stale saves and its own restore cache. None: ``default_staging``.
    """
    if not staging_dir:
        return default_staging(storage, job)
    return os.path.join(staging_dir, _job_folder(storage, job))


def staging_dir_problem(staging_dir: str | None) -> str | None:
    """What keeps a given staging folder from holding folders, said after its name: it, or a folder
    above it, is a file. None when there is nothing in the way (or none was given)."""
    if not staging_dir:
        return None
    path = os.path.abspath(staging_dir)
    while not os.path.isdir(path):
        if os.path.lexists(path):
            where = "is" if path == os.path.abspath(staging_dir) else f"is under {path}, which is"
            what = "a regular file, not a folder" if os.path.isfile(path) else "not a folder"
            return (
                f"{staging_dir!r} {where} {what}: saves and restores stage their files in it; choose a "
                "folder (a new or an existing one) on a local disk"
            )
        parent = os.path.dirname(path)
        if parent == path:
            return None
        path = parent
    return None


def default_staging(storage: Storage, job: str | None) -> str:
    """Where a rank stages its saves and caches restores when no staging folder is given.

    A filesystem store: a folder beside the checkpoints (same filesystem, so committing links the
    files instead of copying them). An object store: a folder in ``private_temp_folder`` named
    after the job and the URI, the same for every rank of the node, so they share one cache.
    """
    local = storage.local_path("")
    if local is not None:
        return os.path.join(local, STAGING_FOLDER)
    return os.path.join(private_temp_folder(), _job_folder(storage, job))


class StagingFolderError(PermissionError):
    """The default staging folder under the shared temp folder is not this user's alone."""


def no_temp_folder(error: BaseException) -> bool:
    """Whether ``error`` is ``tempfile``'s "No usable temporary directory found": ``gettempdir()``
    found no folder it could write (told by where it was raised, not by its words)."""
    tb = error.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return (
        isinstance(error, FileNotFoundError)
        and tb is not None
        and tb.tb_frame.f_code.co_filename == tempfile.__file__
        and tb.tb_frame.f_code.co_name == "_get_default_tempdir"
    )


def private_temp_folder() -> str:
    """``<temp folder>/spotjob-staging-<uid>``: this user's staging folders on the node.

    The node's temp folder is shared and the name is predictable, and what lies inside is trusted
    (staged saves; restore-cache files a ``.verified`` marker vouches for). So the folder is made
    here 0700, and one that is there already is used only when it is a real folder (not a
    symlink) of this user that nobody else can read or write; otherwise ``StagingFolderError``.
    """
    try:
        path = os.path.join(tempfile.gettempdir(), f"spotjob-staging-{os.getuid()}")
        with contextlib.suppress(FileExistsError):
            os.mkdir(path, 0o700)
    except OSError as e:
        # gettempdir() found no folder it could write (TMPDIR, /tmp, /var/tmp, /usr/tmp, the
        # working folder): a read-only root filesystem, Kubernetes' readOnlyRootFilesystem.
        raise StagingFolderError(
            f"no writable temporary folder for the default staging folder ({e.strerror or e}: a read-only "
            "root filesystem?); saves and restores of an object store stage their files on a local "
            "disk. Give a staging folder on a writable volume (an emptyDir on Kubernetes): "
            "Checkpointer(staging_dir=...), SPOTJOB_STAGING_DIR or spotjob-agent --staging-dir, or set TMPDIR"
        ) from e
    info = os.lstat(path)
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode):
        problem = "not a folder but a symlink" if stat.S_ISLNK(info.st_mode) else "not a folder"
    elif info.st_uid != os.getuid():
        problem = f"owned by user id {info.st_uid}, not by this user ({os.getuid()})"
    elif info.st_mode & 0o077:
        problem = f"open to other users (mode {stat.S_IMODE(info.st_mode):o})"
    else:
        return path
    raise StagingFolderError(
        f"the default staging folder {path} is {problem}; spotjob stages checkpoints only in a folder "
        "nobody else can read or replace. Remove it if it is yours, or give a staging folder "
        "(Checkpointer(staging_dir=...), SPOTJOB_STAGING_DIR or spotjob-agent --staging-dir)"
    )


def _job_folder(storage: Storage, job: str | None) -> str:
    """One folder name per job and URI: the job's name made safe for a path (``ns/name`` is
    ``ns_name``), then the URI's CRC32C, which tells apart jobs of one name on other URIs."""
    name = re.sub(r"[^A-Za-z0-9._-]", "_", job or "job")[:100].lstrip(".") or "job"
    # surrogateescape: a folder's path need not be UTF-8 (Linux names are bytes; Python hands the
    # undecodable ones over as lone surrogates), and these are then its bytes as written.
    return name + "-" + to_hex(crc32c_bytes(storage.uri.encode("utf-8", "surrogateescape")))


def fetch_verified(storage: Storage, folder: str, entry: FileEntry, local_dir: str) -> str:
    """``entry`` of the checkpoint in ``folder`` under ``local_dir``, downloaded and verified once per
    node (see the module docstring); returns its local path. ``CorruptObjectError`` on a mismatch
    (nothing is left behind), ``StorageError`` when the store fails."""
    path = os.path.join(local_dir, entry.path)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    key = f"{folder}/{entry.path}"
    with open(path + LOCK_SUFFIX, "w") as lock:
        _lock_unless_unsupported(lock.fileno(), path)
        marker = path + VERIFIED_SUFFIX
        vouches = _marker_text(storage.url(key), entry)
        if not _verified_as(path, marker, vouches, entry.size):
            # The marker goes first: a download that fails half way leaves no marker beside it.
            with contextlib.suppress(FileNotFoundError):
                os.unlink(marker)
            storage.get_file(key, path, size=entry.size, crc32c=from_hex(entry.crc32c))
            write_atomic(marker, vouches, durable=False)
    return path


NO_LOCKS = frozenset({errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS, errno.EINVAL})
"""What ``flock`` says on a filesystem without locks (NFS without lockd, some FUSE mounts)."""
_warned_no_locks: set[str] = set()


def _lock_unless_unsupported(fd: int, path: str) -> None:
    """``flock`` the cache's lock of ``path``; on a filesystem without locks, go on without it.

    The lock only spares a node's ranks a second download of the same file: ``Storage.get_file``
    writes to a part file of its own and renames it into place whole, and the marker is written
    after that, so an unlocked rank may fetch a file again but never hands out a partial one.
    """
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
    except OSError as e:
        if e.errno not in NO_LOCKS:
            raise
        folder = os.path.dirname(path)
        if folder not in _warned_no_locks:
            _warned_no_locks.add(folder)
            log.warning(
                "restore cache: %s is on a filesystem without file locks (%s); the ranks of this node "
                "may each download a file once; stage on a local disk to avoid it",
                folder,
                e.strerror,
            )


def _marker_text(url: str, entry: FileEntry) -> bytes:
    """What a ``.verified`` marker holds: which file of which store was verified, against what."""
    return json.dumps({"source": url, "size": entry.size, "crc32c": entry.crc32c}, sort_keys=True).encode()


def _verified_as(path: str, marker: str, vouches: bytes, size: int) -> bool:
    """True when ``path`` is there at ``size`` bytes and its marker vouches for exactly ``vouches``
    (a marker of another file, of another version of it, or of an earlier spotjob: fetch again)."""
    try:
        with open(marker, "rb") as f:
            if f.read() != vouches:
                log.info("restore cache: %s was verified as another file; fetching it again", path)
                return False
        return os.path.getsize(path) == size
    except OSError:
        return False


def newest_valid(storage: Storage) -> tuple[CheckpointRef, Manifest] | None:
    """The newest committed checkpoint ``Checkpointer.restore`` would try first (valid, not retired
    by a fresh start, written by the URI's own lineage), with its manifest; None if there is none,
    or if a newer spotjob's checkpoint comes first (the restore stops there, refused)."""
    retired = _fresh_start.retired_folders(storage)
    lineage = Lineage.load(storage)
    for ref in find_checkpoints(storage):
        if ref.folder in retired:
            continue
        status = inspect(storage, ref, lineage=lineage)
        if status.valid and status.manifest is not None:
            return ref, status.manifest
        if status.newer_format:
            return None
    return None


_SHARD_FILE_RE = re.compile(r"^__(\d+)_\d+" + re.escape(DCP_SHARD_SUFFIX) + "$")
"""DCP's shard file names: ``__<the rank that wrote it>_<n>.distcp``."""
_RANK_FILE_RE = re.compile(r"^rank-(\d{5,})\.pt$")


def node_files(manifest: Manifest, ranks: range, world_size: int) -> list[FileEntry]:
    """The files of ``manifest`` that the ranks ``ranks`` of a job of ``world_size`` ranks read
    on restore; every file when the checkpoint was saved at another world size (DCP reshards, and
    any rank may read any file).

    At the same world size each rank holds the shards it wrote, so of a tensor spread over several
    files a rank reads the one it wrote (the manifest's tensor index says which files hold what);
    a tensor none of whose files the node's ranks wrote (a replicated value DCP kept one copy of:
    an optimizer's ``step`` counter, a DDP parameter; under HSDP, a tensor whose shards another
    replica wrote) is read from all of its files. DCP's ``.metadata``, each rank's
    ``rank-NNNNN.pt``, rank 0's shard files (which hold what the tensor index does not list: an
    optimizer's ``param_groups``) and any file of another kind are read too. An empty shard file
    holds nothing to read. (An FSDP rank whose shard of a small tensor is empty still writes that
    empty shard, so a sharded tensor lists the file of every rank of its mesh.)
    """
    if manifest.world_size != world_size:
        return list(manifest.files)
    own: set[str] = set()  # the shards the node's ranks wrote
    wanted = {DCP_METADATA_NAME, *(rank_file_name(r) for r in ranks)}
    for entry in manifest.files:
        shard = _SHARD_FILE_RE.match(entry.path)
        if shard is None:
            if not _RANK_FILE_RE.match(entry.path):
                wanted.add(entry.path)  # a file of another kind
        elif entry.size and int(shard.group(1)) in ranks:
            own.add(entry.path)
        elif entry.size and int(shard.group(1)) == 0:
            wanted.add(entry.path)  # the values every rank reads (see above)
    wanted |= own
    for tensor in manifest.tensors.values():
        # Rank 0's file is fetched on every node, but counts as the node's own only where rank 0
        # runs: under HSDP a tensor written from ranks 0 and 1 is read by the other nodes from both.
        mine = [f for f in tensor.files if f in own]
        wanted.update(mine or tensor.files)
    return [e for e in manifest.files if e.path in wanted]


def prefetch(
    storage: Storage,
    staging_root: str,
    *,
    parallelism: int = 8,
    restored: Callable[[], bool] | None = None,
    ranks: tuple[range, int] | None = None,
) -> str | None:
    """Fetch (object store) or read once (filesystem) the newest valid checkpoint's files; returns
    its folder, or None when there is none. Raises ``StorageError`` / ``OSError`` on failure.

    ``ranks``: ``(the node's global ranks, the job's world size)``, when known: only the files
    they read are fetched (``node_files``). None: every file.

    ``restored``: whether the node's ranks have restored already (they train). From then on no
    further file is fetched, and what the prefetch fetched is removed once it ends: the ranks'
    restore removed the cache when it had loaded, and a prefetch still at work (on a node of a
    multi-node job it fetches the other nodes' shards too, which no rank here waits for) would
    otherwise fill it again and leave it on the node's disk for the whole attempt.
    """
    found = newest_valid(storage)
    if found is None:
        return None
    ref, manifest = found
    folder = ref.folder
    files = manifest.files
    if ranks is not None:
        files = node_files(manifest, *ranks)
        log.info(
            "prefetching the %d of the %d files of %s that this node's ranks (%d-%d of %d) read",
            len(files),
            len(manifest.files),
            storage.url(folder),
            ranks[0].start,
            ranks[0].stop - 1,
            ranks[1],
        )
    local = storage.local_path(folder)
    if local is not None:

        def check(entry: FileEntry) -> None:
            crc, size = crc32c_file_parallel(os.path.join(local, entry.path), parallelism)
            if size != entry.size or crc != from_hex(entry.crc32c):
                raise CorruptObjectError(f"{storage.url(folder + '/' + entry.path)} does not match its manifest")

        parallel_map(check, [(e,) for e in files], parallelism)
        return folder
    cache = os.path.join(staging_root, RESTORE_FOLDER, folder)
    late = threading.Event()

    def fetch(entry: FileEntry) -> None:
        if late.is_set() or (restored is not None and restored()):
            late.set()
            return
        fetch_verified(storage, folder, entry, cache)

    try:
        parallel_map(fetch, [(e,) for e in files], parallelism)
    finally:
        if late.is_set() or (restored is not None and restored()):
            log.info("the ranks restored before the prefetch ended: removing what it fetched (%s)", cache)
            shutil.rmtree(cache, ignore_errors=True)
    return folder


def prefetch_in_background(
    open_store: Callable[[], Storage],
    staging_root: Callable[[Storage], str],
    *,
    parallelism: int = 8,
    restored: Callable[[], bool] | None = None,
    ranks: tuple[range, int] | None = None,
) -> threading.Thread:
    """``prefetch`` in a daemon thread (the agent's, while torchrun starts); failures are logged.
    ``staging_root`` names the node's staging folder for the opened store; ``restored`` and
    ``ranks`` are ``prefetch``'s."""

    def run() -> None:
        started = time.monotonic()
        storage = None
        try:
            storage = open_store()
            folder = prefetch(storage, staging_root(storage), parallelism=parallelism, restored=restored, ranks=ranks)
            if folder is not None:
                log.info("prefetched %s in %.2fs", storage.url(folder), time.monotonic() - started)
        except (StorageError, OSError, OwnershipError, ValueError) as e:
            log.info("prefetching the newest checkpoint failed (the ranks' restore will fetch it): %s", e)
        except Exception as e:  # never let a prefetch take the agent down
            log.warning("prefetching the newest checkpoint failed unexpectedly: %r", e)
        finally:
            if storage is not None:
                storage.close()

    thread = threading.Thread(target=run, name="spotjob-prefetch", daemon=True)
    thread.start()
    return thread
