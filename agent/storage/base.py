"""The one small interface every checkpoint store implements.

A ``Storage`` is rooted at a URI (``s3://bucket/prefix``, ``gs://bucket/prefix``,
``file:///path``); keys are ``/``-separated and relative to that root. Checkpoint code only ever
talks to this interface, so the commit protocol is written once:

0. (rank 0) ``put_bytes_if_absent("step-N/WRITER.json", ...)`` — the folder's claim for this
   save, so that no other writer of the URI uploads into it (``agent.checkpoint._claim``); a save
   in flight for minutes rewrites it with ``put_bytes`` (renewal);
1. (every rank) ``put_file`` its shard files into ``step-N/`` — plain writes that may overwrite,
   because nothing in an uncommitted folder counts;
2. (rank 0) ``put_bytes_if_absent("step-N/MANIFEST.json", ...)`` — the create-only commit. It
   raises ``AlreadyExistsError`` if the key exists, so a committed manifest is never replaced.

Contract of every implementation:

- Each object appears whole or not at all: a reader never sees a partial object (filesystem: temp
  file + fsync + rename; object stores: their PUT / completed multipart upload).
- ``delete`` and ``delete_prefix`` are idempotent: a missing key is not an error.
- ``get_file`` verifies size and CRC32C when given them and raises ``CorruptObjectError`` naming
  the key; nothing half-downloaded is left at the destination.
- Transient faults (throttling, 5xx, dropped connections) are retried inside the implementation
  (see ``agent.storage._retry``); what escapes is a ``StorageError`` subclass that says whether
  retrying could help (``TransientStorageError``) or not (``PermanentStorageError``). Nothing
  else escapes — not the client library's exceptions, not an ``OSError`` of a local file (a staged
  shard, a download's destination) or of the store's own folder. Permission denied says
  "permission denied"; a missing bucket is a ``MissingBucketError`` naming it; an object the
  bucket keeps (retention policy, hold, Object Lock) is a ``RetainedError``, never "permission
  denied".
- Implementations are thread-safe: the parallel helpers below call them from a thread pool.
"""

from __future__ import annotations

import abc
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

ProgressFn = Callable[[int], None]
"""Called with a number of bytes just transferred (from any thread)."""

DEFAULT_PARALLELISM = 8

MAX_OBJECT_NAME_BYTES = 1024
"""S3's limit on a key and GCS's on an object name, in UTF-8 bytes."""

# ``Storage.list`` shadows the builtin inside the class body; annotations there use this alias.
StrList = list[str]


class StorageError(Exception):
    """A storage operation failed. ``key`` names the object when there is one."""

    def __init__(self, message: str, key: str | None = None) -> None:
        super().__init__(message)
        self.key = key


class TransientStorageError(StorageError):
    """Throttling, a 5xx or a dropped connection that outlived the retries."""


class PermanentStorageError(StorageError):
    """Auth, permission, a missing bucket, any other 4xx: retrying cannot help."""


class NotFoundError(PermanentStorageError):
    """The key does not exist."""


class MissingBucketError(PermanentStorageError):
    """The URI's bucket does not exist (never a ``NotFoundError``: no key can exist there)."""


class RetainedError(PermanentStorageError):
    """The bucket keeps the object: a GCS retention policy or object hold, an S3 Object Lock
    retention or legal hold. It cannot be deleted or replaced until that ends; not a permission
    problem of the credentials."""


class ArchivedError(PermanentStorageError):
    """The object is in an archive storage class (S3 Glacier Flexible Retrieval or Deep Archive, an
    Intelligent-Tiering archive tier), most often moved there by a lifecycle rule: it is listed and
    can be deleted, but not read until it is restored. Not a permission problem of the credentials."""


class AlreadyExistsError(PermanentStorageError):
    """A create-only write found the key already there (a committed manifest)."""


class TooLargeError(PermanentStorageError):
    """A small object read with a bound (``Storage.get_small``) is bigger than the bound; ``size``
    is its size where the store said it (else None: more bytes came than the bound)."""

    def __init__(self, message: str, key: str | None = None, size: int | None = None) -> None:
        super().__init__(message, key)
        self.size = size


class DamagedObjectError(PermanentStorageError):
    """A small object (a manifest, a record) whose bytes did not match the checksum the store
    keeps for it in every one of the retried reads, the same bytes and the same checksum each
    time: damaged where it is kept, or rewritten by something that did not update its checksum.
    Reading it again cannot help (a mismatch that goes away on a retry was damage on the way)."""


class CorruptObjectError(StorageError):
    """The bytes read back do not match the size or CRC32C they were committed with."""


@dataclass(frozen=True)
class ObjectInfo:
    key: str
    size: int
    modified: float | None = None
    """When the store says the object was written (seconds since the epoch, the store's clock:
    S3's LastModified, GCS's ``updated``, a file's mtime); None where it does not say."""


def store_time(value: object) -> float | None:
    """A timestamp an object store's client gave (a ``datetime``) as ``ObjectInfo.modified``."""
    timestamp = getattr(value, "timestamp", None)
    return float(timestamp()) if callable(timestamp) else None


class Storage(abc.ABC):
    """An object store rooted at ``uri``. See the module docstring for the contract."""

    uri: str

    # -- writes ------------------------------------------------------------------------------
    @abc.abstractmethod
    def put_file(
        self,
        local_path: str,
        key: str,
        *,
        crc32c: int | None = None,
        progress: ProgressFn | None = None,
    ) -> None:
        """Upload a local file to ``key`` (overwriting). Large files go up in parallel parts.

        ``crc32c``, when given, is the file's CRC32C; stores that can check it server-side do.
        """

    @abc.abstractmethod
    def put_bytes(self, key: str, data: bytes) -> None:
        """Write a small object (overwriting)."""

    @abc.abstractmethod
    def put_bytes_if_absent(self, key: str, data: bytes) -> None:
        """Create ``key`` only if it does not exist; raise ``AlreadyExistsError`` otherwise.

        Atomic against concurrent writers: of two racing calls, exactly one succeeds. A retry
        after an attempt that failed ambiguously (it may have created the key: a lost reply, a
        failed folder sync) reads the key back and succeeds when it holds exactly ``data``.
        """

    def check_create_only(self, under: str) -> None:  # noqa: B027 - optional hook
        """(a writer, once, before its first ``put_bytes_if_absent``) Prove that the store refuses
        a create-only write to a key that exists; raise ``PermanentStorageError`` saying what to do
        when it does not.

        May write and delete one small probe object under the folder ``under`` (a name listings
        never take for a checkpoint). The default does nothing: a filesystem's hard link and GCS's
        ``ifGenerationMatch=0`` are enforced by the store itself. S3 overrides it: an S3-compatible
        store may accept ``If-None-Match: *`` and overwrite anyway. Readers never call it.
        """

    def put_files(
        self,
        files: Sequence[tuple[str, str, int | None]],
        *,
        progress: ProgressFn | None = None,
        parallelism: int = DEFAULT_PARALLELISM,
        synced: bool = False,
    ) -> None:
        """``put_file`` for each ``(local_path, key, crc32c)``, in parallel; every object is whole
        once this returns. A store may do it as one batch (``FileStorage``: one folder sync).

        ``synced``: the caller has made these local files' bytes durable already (the
        Checkpointer fsyncs its staged shards); a store that links them into place
        (``FileStorage``) then syncs only its folders. Object stores upload either way."""
        parallel_map(
            lambda local, key, crc: self.put_file(local, key, crc32c=crc, progress=progress),
            files,
            parallelism,
        )

    # -- reads -------------------------------------------------------------------------------
    @abc.abstractmethod
    def get_bytes(self, key: str) -> bytes:
        """Read a whole (small) object; ``NotFoundError`` if missing."""

    def get_small(self, key: str, max_bytes: int) -> tuple[bytes, ObjectInfo]:
        """A small object (a record, a claim, a manifest) read whole, with its size and time, in as
        few requests as the store allows (S3, GCS: one GET, no HEAD first); ``NotFoundError`` if
        missing, ``TooLargeError`` when it is bigger than ``max_bytes``, refused before its body
        is read where the store says its size first, and never read past ``max_bytes + 1`` bytes.
        One answer gives the size, the time and the bytes, so they are of one version of it.

        This default (a store without a better way) is ``stat`` and then ``get_bytes``."""
        info = self.stat(key)
        if info is None:
            raise NotFoundError(f"{self.url(key)} does not exist", key)
        if info.size > max_bytes:
            raise TooLargeError(f"{self.url(key)} is {info.size} bytes, more than {max_bytes}", key, info.size)
        data = self.get_bytes(key)
        if len(data) > max_bytes:  # replaced by a bigger one since the stat
            raise TooLargeError(f"{self.url(key)} is {len(data)} bytes, more than {max_bytes}", key, len(data))
        return data, ObjectInfo(key, len(data), info.modified)

    @abc.abstractmethod
    def get_file(
        self,
        key: str,
        local_path: str,
        *,
        size: int | None = None,
        crc32c: int | None = None,
        progress: ProgressFn | None = None,
    ) -> None:
        """Download ``key`` to ``local_path`` (parallel ranged reads for large objects).

        When ``size``/``crc32c`` are given, the bytes are checked as they arrive and a mismatch
        raises ``CorruptObjectError``; ``local_path`` is then left absent.
        """

    @abc.abstractmethod
    def stat(self, key: str) -> ObjectInfo | None:
        """Size of ``key``, or None if it does not exist."""

    @abc.abstractmethod
    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        """Every object whose key starts with ``prefix`` (recursive), in no particular order."""

    @abc.abstractmethod
    def list_dirs(self, prefix: str = "") -> StrList:
        """Names of the immediate "folders" under ``prefix`` (``prefix`` ends with / or is "")."""

    # -- deletes -----------------------------------------------------------------------------
    @abc.abstractmethod
    def delete(self, keys: Iterable[str]) -> None:
        """Delete these keys; missing ones are fine."""

    def delete_prefix(self, prefix: str) -> None:
        """Delete every object under ``prefix`` (which must end with '/')."""
        if not prefix.endswith("/"):
            raise ValueError(f"delete_prefix needs a folder prefix ending in '/', got {prefix!r}")
        self.delete([o.key for o in self.list(prefix)])

    # -- helpers -----------------------------------------------------------------------------
    def url(self, key: str = "") -> str:
        """The full URI of ``key``."""
        return self.uri.rstrip("/") + ("/" + key if key else "")

    def local_path(self, key: str) -> str | None:
        """A path on this machine's filesystem where ``key`` can be read directly, if any."""
        return None

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release clients and thread pools."""


def parallel_map(
    fn: Callable[..., object], calls: Sequence[tuple[object, ...]], parallelism: int = DEFAULT_PARALLELISM
) -> None:
    """Run ``fn(*args)`` for every args tuple in a thread pool; re-raise the first failure.

    Every call is waited for before raising, so no transfer is still running afterwards.
    """
    if not calls:
        return
    if len(calls) == 1 or parallelism <= 1:
        for args in calls:
            fn(*args)
        return
    with ThreadPoolExecutor(max_workers=min(parallelism, len(calls)), thread_name_prefix="spotjob-io") as pool:
        try:
            first = pool.submit(fn, *calls[0])
        except RuntimeError:
            # No thread could start, so nothing of the pool runs: Python 3.12.0 and 3.12.1 refuse new
            # threads once the main thread has ended ("can't create new thread at interpreter
            # shutdown"), when a save in flight is finished before exit. The calls run here instead.
            for args in calls:
                fn(*args)
            return
        futures = [first, *(pool.submit(fn, *args) for args in calls[1:])]
        errors = [f.exception() for f in futures]
    for err in errors:
        if err is not None:
            raise err


def put_files(
    storage: Storage,
    files: Sequence[tuple[str, str, int | None]],
    *,
    progress: ProgressFn | None = None,
    parallelism: int = DEFAULT_PARALLELISM,
    synced: bool = False,
) -> None:
    """Upload ``(local_path, key, crc32c)`` triples in parallel (``Storage.put_files``)."""
    storage.put_files(files, progress=progress, parallelism=parallelism, synced=synced)


def get_files(
    storage: Storage,
    files: Sequence[tuple[str, str, int | None, int | None]],
    *,
    progress: ProgressFn | None = None,
    parallelism: int = DEFAULT_PARALLELISM,
) -> None:
    """Download ``(key, local_path, size, crc32c)`` tuples in parallel, verifying each."""
    for _, local, _, _ in files:
        os.makedirs(os.path.dirname(local) or ".", exist_ok=True)
    parallel_map(
        lambda key, local, size, crc: storage.get_file(key, local, size=size, crc32c=crc, progress=progress),
        files,
        parallelism,
    )
