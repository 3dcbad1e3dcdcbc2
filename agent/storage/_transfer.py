"""How the object-store backends move big objects: part sizes, a bounded pool, verified downloads.

Shared by ``s3`` and ``gs``. A download is split into byte ranges fetched in parallel; each range
is written at its offset into a temp file next to the destination while its CRC32C is computed
from the bytes as they arrive, and each range is retried on its own (a dropped connection costs
one range, not the file). The per-range CRCs are combined into the object's CRC32C, checked
against the caller's, and only then is the temp file renamed into place, so a failed or corrupt
download leaves nothing at the destination.

Each storage object owns one ``TransferPool``: it bounds the parts / ranges in flight across all
the files that object is moving at once. An upload reads each S3 part, GCS chunk and small file
whole into memory before sending it (S3: up to ``concurrency`` parts at once; GCS: one chunk per
file, and ``put_files`` sends several files at once), so each storage object also owns one
``ByteBudget`` of ``max_buffer_bytes``: a buffer is filled only once the budget holds its bytes, and
the bytes are given back once it is sent. ``SPOTJOB_STORAGE_MAX_BUFFER_BYTES`` is the node's budget:
a store opened by a training rank takes its share of it (``rank_share``), one opened elsewhere the
whole. A download holds no part: each range streams through a ``RangeSink`` (about 2 MiB per range
in flight, whatever ``part_size``).
"""

from __future__ import annotations

import base64
import collections
import contextlib
import logging
import os
import threading
import uuid
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, fields, replace
from typing import Generic, Protocol, TypeVar, cast

from agent.crc32c import crc32c_bytes, crc32c_concat, to_hex
from agent.settings import (
    MAX_BUFFER_BYTES,
    MAX_CONCURRENCY,
    MAX_TIMEOUT_S,
    MAX_TRANSFER_BYTES,
    MIN_BUFFER_BYTES,
    MIN_PART_SIZE,
    StorageEnv,
    load,
    local_world_size,
)
from agent.storage._errors import local_file
from agent.storage._retry import retry_transient
from agent.storage.base import (
    MAX_OBJECT_NAME_BYTES,
    CorruptObjectError,
    DamagedObjectError,
    MissingBucketError,
    NotFoundError,
    ObjectInfo,
    PermanentStorageError,
    ProgressFn,
    TooLargeError,
    TransientStorageError,
)

log = logging.getLogger(__name__)

T = TypeVar("T")

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB

# Bytes a range buffers before writing them out: big enough that the CRC and the pwrite run on
# large blocks (HTTP clients hand over 8 KiB at a time), small enough not to matter per range.
_SINK_FLUSH = 1 * MiB


@dataclass(frozen=True)
class TransferSettings:
    """How big objects move. Defaults suit multi-GB shards on a cloud VM.

    Every field can be set by the environment of the process that opens the storage (see
    ``from_env``), which is how tests and operators tune a store opened by URI alone.
    """

    part_size: int = 64 * MiB
    """Bytes per ranged GET (S3 and GCS downloads), at least 1 MiB (``MIN_PART_SIZE``)."""

    upload_part_size: int = 8 * MiB
    """Bytes per S3 multipart part, at most 5 GiB (S3's largest part); S3 raises it to 5 MiB (its
    minimum part) and to size/10000 (its part-count limit). Smaller than ``part_size``: a
    flush's shard goes up in more parts at once (boto3 and the AWS CLI send 8 MiB parts too), and
    the parts in flight hold ``concurrency x upload_part_size`` of memory (64 MiB) rather than
    512 MiB (and never more than ``max_buffer_bytes``)."""

    upload_chunk_size: int = 100 * MiB
    """Bytes per GCS resumable-upload chunk (rounded up to 256 KiB, GCS's granularity). An object's
    chunks go up one after another, each a request of its own, so fewer, bigger chunks are faster:
    100 MiB is google-cloud-storage's own default. A file being uploaded holds one chunk in
    memory (the files going up at once, together no more than ``max_buffer_bytes``)."""

    multipart_threshold: int = 64 * MiB
    """Objects this big or bigger go up in parts (S3) or chunks (GCS); smaller ones in one PUT (but
    never one above S3's largest PUT, 5 GiB, or GCS's simple-upload limit, 8 MiB)."""

    concurrency: int = 8
    """Parts or ranges in flight at once per storage object, whatever the number of files."""

    max_buffer_bytes: int = 1 * GiB
    """Bytes an upload may hold in memory at once per storage object: the S3 parts, GCS chunks and
    small files read and not yet sent, whatever the number of files, parts or threads
    (``ByteBudget``). One part bigger than the whole budget goes up alone. ``from_env`` reads
    ``SPOTJOB_STORAGE_MAX_BUFFER_BYTES`` as the node's budget and gives a training rank's store its
    share (``rank_share``). 1 GiB is above what the defaults ever hold in one process (8 files of
    up to 100 MiB chunks on GCS, of up to 64 MiB on S3); over 8 ranks it is 128 MiB each: a rank's 8
    S3 parts of 8 MiB, but one 100 MiB GCS chunk, or two files just under the 64 MiB threshold, at a
    time."""

    connect_timeout_s: float = 10.0
    """Seconds to open a connection before the attempt counts as a transient failure."""

    read_timeout_s: float = 60.0
    """Seconds without a byte from the server before the attempt counts as a transient failure."""

    s3_checksum_headers: bool = True
    """Send each S3 upload's CRC32C (``x-amz-checksum-crc32c``, a ``FULL_OBJECT`` CRC32C on
    multipart uploads) so the store checks the bytes it receives. Off for S3-compatible stores that
    refuse those headers (Backblaze B2: "Unsupported header"); spotjob still checks every file's
    CRC32C against the manifest when it reads it back, so a damaged upload is found at restore
    rather than refused at save."""

    s3_create_only_check: bool = True
    """Before a job's first create-only write, prove once per process that the store refuses a
    ``PutObject`` with ``If-None-Match: *`` on a key that exists (``S3Storage.check_create_only``).
    Off only to accept, knowingly, a store that ignores the header: a committed manifest could
    then be overwritten."""

    def __post_init__(self) -> None:
        # The bounds of ``agent.settings.StorageEnv``, for settings built in code.
        for name in ("part_size", "upload_part_size", "upload_chunk_size", "multipart_threshold"):
            value = getattr(self, name)
            if not 1 <= value <= MAX_TRANSFER_BYTES:
                raise ValueError(f"{name} must be from 1 byte to 5 GiB ({MAX_TRANSFER_BYTES}), got {value}")
        if self.part_size < MIN_PART_SIZE:
            raise ValueError(
                f"part_size must be from 1 MiB to 5 GiB ({MIN_PART_SIZE} to {MAX_TRANSFER_BYTES}), got {self.part_size}"
            )
        if not 1 <= self.concurrency <= MAX_CONCURRENCY:
            raise ValueError(f"concurrency must be from 1 to {MAX_CONCURRENCY}, got {self.concurrency}")
        if not MIN_BUFFER_BYTES <= self.max_buffer_bytes <= MAX_BUFFER_BYTES:
            raise ValueError(
                f"max_buffer_bytes must be from 1 MiB to 5 TiB ({MIN_BUFFER_BYTES} to {MAX_BUFFER_BYTES}), "
                f"got {self.max_buffer_bytes}"
            )
        if not (0 < self.connect_timeout_s <= MAX_TIMEOUT_S and 0 < self.read_timeout_s <= MAX_TIMEOUT_S):
            raise ValueError(f"timeouts must be positive and at most {MAX_TIMEOUT_S:g} seconds")

    @classmethod
    def from_env(cls) -> TransferSettings:
        """Defaults, overridden by ``SPOTJOB_STORAGE_<FIELD>`` for each field: ``PART_SIZE``,
        ``UPLOAD_PART_SIZE``, ``UPLOAD_CHUNK_SIZE``, ``MULTIPART_THRESHOLD``, ``MAX_BUFFER_BYTES``
        (bytes, or with a unit: 64MiB), ``CONCURRENCY``, ``CONNECT_TIMEOUT_S``, ``READ_TIMEOUT_S``,
        ``S3_CHECKSUM_HEADERS`` and ``S3_CREATE_ONLY_CHECK`` (``agent.settings`` checks each value).
        ``MAX_BUFFER_BYTES`` is the node's: a process with a ``LOCAL_WORLD_SIZE`` (a training rank)
        gets its share of it (``rank_share``), any other process the whole."""
        env = load(StorageEnv)
        defaults = cls()
        given = {f.name: getattr(env, f.name) for f in fields(cls)}
        # Each value as the type of its default: a ByteSize becomes a plain int.
        settings = cls(**{k: type(getattr(defaults, k))(v) for k, v in given.items() if v is not None})
        return replace(settings, max_buffer_bytes=rank_share(settings.max_buffer_bytes, local_world_size() or 1))


def rank_share(node_budget: int, local_ranks: int) -> int:
    """One rank's part of the node's upload budget: the budget split equally between the node's
    ``local_ranks`` (each rank's store holds its own, so the node holds at most the budget), and
    never under ``MIN_BUFFER_BYTES`` (1 MiB).

    The floor keeps every share a budget a store accepts (``TransferSettings`` refuses less); no
    share could stop an upload, as ``ByteBudget`` lets a part bigger than the whole budget go up
    alone once nothing else is held. So a rank holds at most its share or its biggest part,
    whichever is bigger, and a node whose budget is under 1 MiB per rank (8 ranks and the 1 MiB
    minimum) holds up to 1 MiB, or one part, per rank. Not a bigger floor (one part): a share
    below a part already sends parts one at a time, as a part-sized one would, and a bigger floor
    would only let more small files up beside it, over the node's budget."""
    return max(MIN_BUFFER_BYTES, node_budget // max(1, local_ranks))


def read_at(fd: int, length: int, offset: int) -> bytes:
    """``length`` bytes of the file ``fd`` from ``offset`` (fewer only at its end). One ``pread``
    is not enough: Linux returns at most 2 GiB - 4 KiB a call, less than a part or chunk may be (a
    part was then "shrank while being uploaded", a GCS chunk sent short of its 256 KiB multiple).
    The bytes of one ``pread`` as they are (no copy); only a read that came back short is joined."""
    data = os.pread(fd, length, offset)
    if len(data) == length or not data:
        return data
    pieces = [data]
    got = len(data)
    while got < length:
        more = os.pread(fd, length - got, offset + got)
        if not more:
            break
        pieces.append(more)
        got += len(more)
    return b"".join(pieces)


def spans(size: int, part_size: int) -> list[tuple[int, int]]:
    """``(offset, length)`` of consecutive parts covering ``size`` bytes (none for an empty object)."""
    return [(off, min(part_size, size - off)) for off in range(0, size, part_size)]


def crc_to_b64(crc: int) -> str:
    """CRC32C as the base64 of its 4 big-endian bytes: how S3 and GCS headers carry it."""
    return base64.b64encode((crc & 0xFFFFFFFF).to_bytes(4, "big")).decode("ascii")


def crc_from_b64(text: str) -> int:
    return int.from_bytes(base64.b64decode(text), "big")


# -- the pool --------------------------------------------------------------------------------
_QUEUED, _RUNNING, _DONE, _SKIPPED = range(4)


class _Calls(Generic[T]):
    """The calls of one ``TransferPool.map``, each run once: by whichever of a pool thread and the
    caller's thread claims it first. The pool is handed every call, but the caller runs those no
    pool thread will (no thread could start for it, or ``close()`` cancelled it): a work item the
    pool queued before its thread failed to start may still reach a thread later, and finds its
    call claimed. Once a call failed, or the caller was interrupted, the calls not started are
    skipped."""

    def __init__(
        self, fn: Callable[..., T], calls: Sequence[tuple[object, ...]], first: threading.Event | None
    ) -> None:
        self._fn = fn
        self._calls = calls
        self._first = first
        self._changed = threading.Condition()
        self._state = [_QUEUED] * len(calls)
        self._runner: list[int | None] = [None] * len(calls)  # the thread running each call
        self._stranded: set[int] = set()  # queued calls no pool thread will run: the caller runs them
        self._results: list[T | None] = [None] * len(calls)
        self._error: BaseException | None = None
        self._stopped = False

    def run(self, i: int) -> None:
        """Call ``i`` here, unless it is claimed already or the calls are stopped."""
        with self._changed:
            if self._state[i] != _QUEUED:
                return
            if self._stopped:
                self._state[i] = _SKIPPED
                self._changed.notify_all()
                return
            self._state[i] = _RUNNING
            self._runner[i] = threading.get_ident()
        result: T | None = None
        error: BaseException | None = None
        try:
            result = self._fn(*self._calls[i])
        except BaseException as e:  # the caller raises it
            error = e
        with self._changed:
            self._state[i] = _DONE
            self._results[i] = result
            if error is not None and self._error is None:
                self._error = error
                self._stopped = True
            self._changed.notify_all()
        if i == 0 and self._first is not None:
            self._first.set()  # the caller waits for it: the others go now, or not at all

    def strand(self, i: int) -> None:
        """No pool thread will run call ``i``: the caller does (``finish``)."""
        with self._changed:
            self._stranded.add(i)
            self._changed.notify_all()
        if i == 0 and self._first is not None:
            self._first.set()  # wake the caller waiting for it, to run it

    @property
    def failed(self) -> bool:
        with self._changed:
            return self._error is not None

    def finish(self) -> list[T]:
        """Wait for every call, running the stranded ones in this thread; raise the first failure
        or return the results in call order."""
        while True:
            with self._changed:
                if self._stopped:
                    self._skip_queued()
                if all(s in (_DONE, _SKIPPED) for s in self._state):
                    break
                mine = [i for i in sorted(self._stranded) if self._state[i] == _QUEUED]
                if not mine:
                    self._changed.wait()
                    continue
            for i in mine:
                self.run(i)
        if self._error is not None:
            raise self._error
        return cast("list[T]", self._results)

    def abandon(self) -> None:
        """(the caller, interrupted) Skip the calls not started; wait for those other threads run."""
        me = threading.get_ident()
        with self._changed:
            self._stopped = True
            self._skip_queued()
            while any(s == _RUNNING and r != me for s, r in zip(self._state, self._runner, strict=True)):
                self._changed.wait()

    def _skip_queued(self) -> None:
        for i, s in enumerate(self._state):
            if s == _QUEUED:
                self._state[i] = _SKIPPED


class TransferPool:
    """A lazily started thread pool shared by every transfer of one storage object.

    Only leaf requests run on it (a part, a range, a delete); callers block on their calls from
    their own threads, so a pool worker never waits for the pool and cannot deadlock it. Where no
    pool thread can start (a pids or ``ulimit -u`` limit; Python 3.12.0 and 3.12.1 once the main
    thread has ended, when a save in flight is finished before exit) the caller's thread runs the
    calls itself, as ``parallel_map`` does.
    """

    def __init__(self, workers: int, name: str) -> None:
        self._workers = workers
        self._name = name
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None

    def _executor(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=self._workers, thread_name_prefix=self._name)
            return self._pool

    def map(
        self, fn: Callable[..., T], calls: Sequence[tuple[object, ...]], *, first: threading.Event | None = None
    ) -> list[T]:
        """``[fn(*args) for args in calls]``, run in parallel; results in call order.

        With ``first``, the first call runs alone until it sets ``first`` (or ends): the others
        need something it learns early (GCS: the object's generation, from its answer's headers).
        The caller's thread waits for it, not a worker; a first call that fails sends none of the
        others. On the first failure the calls not yet started are skipped and the running ones
        waited for, then that failure is raised; so too when the caller is interrupted (Ctrl-C)
        while it waits: nothing is still writing when this returns or raises. A call no pool
        thread can take runs in the caller's thread.
        """
        if len(calls) <= 1 or self._workers <= 1:
            return [fn(*args) for args in calls]
        batch = _Calls(fn, calls, first)
        try:
            pool = self._executor()
            rest = range(len(calls))
            if first is not None:
                if not self._submit(pool, batch, 0):
                    batch.run(0)
                first.wait()
                batch.run(0)  # stranded (close() cancelled it): here, before the others
                rest = range(0) if batch.failed else range(1, len(calls))
            for i in rest:
                if not self._submit(pool, batch, i):
                    for j in range(i, len(calls)):
                        batch.strand(j)
                    break
            return batch.finish()
        except BaseException:
            batch.abandon()
            raise

    @staticmethod
    def _submit(pool: ThreadPoolExecutor, batch: _Calls[T], i: int) -> bool:
        """Hand call ``i`` to the pool; False when no thread can take it (``RuntimeError``: a
        thread that could not start, or a pool that ``close()`` shut down)."""
        try:
            future = pool.submit(batch.run, i)
        except RuntimeError:
            return False
        future.add_done_callback(lambda f: batch.strand(i) if f.cancelled() else None)
        return True

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)


# -- the upload buffer budget -----------------------------------------------------------------
class ByteBudget:
    """A semaphore counted in bytes: the upload buffers of one storage object, together.

    ``hold(n)`` waits until ``n`` more bytes fit under ``limit``, then holds them until its block
    ends; a buffer is filled inside the block and sent before it ends. Waiters are served in the
    order they came (a big part is not passed over for ever by small ones), and a request bigger
    than the whole budget is granted once nothing else is held: it goes alone rather than never.
    Holders never wait for anything that needs the budget (a part is read, sent and given back;
    pool workers and callers' threads alike), so waiting cannot deadlock.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._held = 0
        self._line: collections.deque[object] = collections.deque()
        self._changed = threading.Condition()

    @contextlib.contextmanager
    def hold(self, n: int) -> Iterator[None]:
        if n <= 0:
            yield
            return
        turn = object()
        with self._changed:
            self._line.append(turn)
            try:
                while self._line[0] is not turn or (self._held and self._held + n > self.limit):
                    self._changed.wait()
            except BaseException:
                self._line.remove(turn)
                self._changed.notify_all()
                raise
            self._line.popleft()
            self._held += n
            self._changed.notify_all()  # the next in line may fit too
        try:
            yield
        finally:
            with self._changed:
                self._held -= n
                self._changed.notify_all()


# -- verified ranged download ----------------------------------------------------------------
class RangeSink:
    """Where one range's bytes go as they arrive: written at their offset, CRC32C'd on the way.

    Has the ``write`` method client libraries stream into. Refuses bytes past the range's end, so
    a server that ignores the Range header cannot write over a neighbouring range.
    """

    def __init__(self, fd: int, offset: int, length: int, what: str, path: str | None = None) -> None:
        self._fd = fd
        self._path = path  # the local file ``fd`` is, for messages: ``pwrite``'s errors name none
        self._pos = offset
        self._length = length
        self._what = what
        self._buf = bytearray()
        self.received = 0
        self.crc = 0

    def write(self, data: bytes | bytearray | memoryview) -> int:
        n = len(data)
        if self.received + n > self._length:
            raise PermanentStorageError(f"{self._what}: the server sent more than the {self._length} bytes asked for")
        self.received += n
        self._buf += data
        if len(self._buf) >= _SINK_FLUSH:
            self.flush()
        return n

    def flush(self) -> None:
        if not self._buf:
            return
        data = bytes(self._buf)
        self._buf = bytearray()
        self.crc = crc32c_bytes(data, self.crc)
        view = memoryview(data)
        with local_file(f"cannot write what was downloaded of {self._what} to the local file"):
            try:
                while view:
                    written = os.pwrite(self._fd, view, self._pos)
                    self._pos += written
                    view = view[written:]
            except OSError as e:
                if e.filename is not None or self._path is None:
                    raise
                # Which file, on which disk: a full disk here is the local one, not the store.
                raise OSError(e.errno, e.strerror, self._path) from e


class FetchRange(Protocol):
    def __call__(self, offset: int, length: int, sink: RangeSink) -> None:
        """GET bytes ``[offset, offset + length)`` and ``sink.write`` them in order.

        Raises ``StorageError`` subclasses (transient ones are retried for this range alone).
        """


def download_verified(
    *,
    what: str,
    key: str,
    size: int,
    local_path: str,
    crc32c: int | None,
    part_size: int,
    pool: TransferPool,
    fetch: FetchRange,
    progress: ProgressFn | None = None,
    first: threading.Event | None = None,
) -> None:
    """Download a ``size``-byte object to ``local_path`` through ``fetch``, verifying its CRC32C.

    ``what`` is the object's URI, for messages and retry logs. The caller has already checked
    ``size`` against what it expects, or its ``fetch`` checks it from the first part's answer
    before keeping a byte; ranges that come back short are retried. With ``first``, the parts after
    the first are sent once the first part's ``fetch`` has set it, having read from its answer what
    they need (``TransferPool.map``). On any failure (including
    ``CorruptObjectError`` for a CRC mismatch) nothing is left at ``local_path``.
    """
    tmp = f"{local_path}.{uuid.uuid4().hex[:8]}.part"
    writing = f"cannot write the local file {tmp} (downloading {what})"
    with local_file(writing, key):
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        with local_file(writing, key):
            os.ftruncate(fd, size)

        def one_range(offset: int, length: int) -> int:
            label = f"GET {what} bytes={offset}-{offset + length - 1}"

            def attempt() -> int:
                sink = RangeSink(fd, offset, length, what, tmp)
                fetch(offset, length, sink)
                sink.flush()
                if sink.received != length:
                    raise TransientStorageError(
                        f"{label}: connection ended after {sink.received} of {length} bytes", key
                    )
                return sink.crc

            crc = retry_transient(label, attempt)
            if progress:
                progress(length)
            return crc

        parts = spans(size, part_size)
        crcs = pool.map(one_range, parts, first=first)
    except BaseException:
        os.close(fd)
        _unlink_quiet(tmp)
        raise
    os.close(fd)
    got = crc32c_concat([(crc, length) for crc, (_, length) in zip(crcs, parts, strict=True)])
    if crc32c is not None and got != crc32c:
        _unlink_quiet(tmp)
        raise CorruptObjectError(f"{what} has CRC32C {to_hex(got)}, the manifest says {to_hex(crc32c)}", key)
    with local_file(f"cannot write the local file {local_path} (downloading {what})", key):
        os.replace(tmp, local_path)


def check_size(what: str, key: str, actual: int, expected: int | None) -> None:
    """Raise ``CorruptObjectError`` before downloading anything when the stored size is wrong."""
    if expected is not None and actual != expected:
        raise CorruptObjectError(f"{what} is {actual} bytes, the manifest says {expected}", key)


def check_local_crc(what: str, key: str, local_path: str, actual: int, expected: int | None) -> None:
    """Refuse to upload a local file whose bytes are not the ones the caller checksummed."""
    if expected is not None and actual != expected:
        raise CorruptObjectError(
            f"not uploading {local_path} to {what}: it has CRC32C {to_hex(actual)}, "
            f"the caller says {to_hex(expected)} (was it changed while being uploaded?)",
            key,
        )


def _unlink_quiet(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def check_object_name(name: str, key: str | None = None) -> None:
    """Refuse an object name S3 or GCS would refuse, or the client would fail to send, before
    any request: one that is not UTF-8 (a lone surrogate, which is how Python passes on
    undecodable bytes from the command line) or longer than ``MAX_OBJECT_NAME_BYTES``. moto and
    fake-gcs-server accept longer names, so only this check keeps the tests honest."""
    try:
        size = len(name.encode("utf-8"))
    except UnicodeEncodeError:
        raise PermanentStorageError(
            f"the object name {name!r} is not valid UTF-8 (undecodable bytes in the checkpoint URI?); "
            "S3 and GCS names are UTF-8: spell the URI in UTF-8",
            key,
        ) from None
    if size > MAX_OBJECT_NAME_BYTES:
        raise PermanentStorageError(
            f"the object name {name[:80]!r}... is {size} bytes, more than the {MAX_OBJECT_NAME_BYTES} "
            "S3 and GCS allow; use a shorter checkpoint URI prefix",
            key,
        )


class PrefixedKeys:
    """Maps checkpoint keys to object names under the store's prefix, refusing keys that escape it.

    Shared by the object-store backends; they set ``prefix`` (no leading or trailing '/') and
    ``uri``.
    """

    prefix: str
    uri: str
    _bucket_seen = False
    """The bucket answered as existing once; from then on a 404 means a missing key."""

    def _bucket_label(self) -> str:  # implemented by the backend
        raise NotImplementedError

    def _bucket_exists(self) -> bool | None:
        """(backend) One request: does the bucket exist? None when that cannot be told (e.g. the
        credentials may read objects but not the bucket's metadata)."""
        raise NotImplementedError

    def _missing_bucket(self, what: str, key: str | None) -> MissingBucketError:
        return MissingBucketError(
            f"{what}: the bucket {self._bucket_label()!r} does not exist; create it (spotjob never creates "
            f"buckets) or correct the checkpoint URI {self.uri}",
            key,
        )

    def _raise_if_bucket_missing(self, what: str, key: str | None) -> None:
        """After a 404 that may mean "no such key" or "no such bucket": tell them apart."""
        if self._bucket_seen:
            return
        exists = self._bucket_exists()
        if exists is False:
            raise self._missing_bucket(what, key)
        if exists:
            self._bucket_seen = True

    def _object_key(self, key: str) -> str:
        if not key or key.startswith("/") or ".." in key.split("/"):
            raise PermanentStorageError(f"invalid key {key!r} under {self.uri}", key)
        name = f"{self.prefix}/{key}" if self.prefix else key
        check_object_name(name, key)
        return name

    def _list_prefix(self, prefix: str) -> str:
        if prefix.startswith("/") or ".." in prefix.split("/"):
            raise PermanentStorageError(f"invalid prefix {prefix!r} under {self.uri}", prefix)
        name = f"{self.prefix}/{prefix}" if self.prefix else prefix
        check_object_name(name, prefix)
        return name

    def _relative(self, object_key: str) -> str:
        return object_key[len(self.prefix) + 1 :] if self.prefix else object_key

    def get_bytes(self, key: str) -> bytes:  # implemented by the backend
        raise NotImplementedError

    def _request(self, what: str, key: str | None, fn: Callable[[], T]) -> T:
        """One attempt of one request, the client's exceptions translated (by the backend)."""
        raise NotImplementedError

    def _retrying(self, what: str, key: str | None, fn: Callable[[], T]) -> T:
        """One request, retried under the shared policy (``agent.storage._retry``)."""
        return retry_transient(what, lambda: self._request(what, key, fn))

    def _read_small(
        self, what: str, url: str, key: str, read: Callable[[], tuple[bytes, ObjectInfo]]
    ) -> tuple[bytes, ObjectInfo]:
        """``get_small``'s one GET (``read``), retried; its 404 told apart from a missing bucket as
        after a HEAD. An object read proves the bucket exists: a later 404 is a missing object."""
        reads: list[tuple[int, int | None] | None] = []  # each attempt: its mismatch, or None

        def attempt() -> tuple[bytes, ObjectInfo]:
            try:
                return read()
            except StoredChecksumMismatch as e:
                reads.append((e.kept, e.got))
                raise
            except BaseException:
                reads.append(None)
                raise

        try:
            result = self._retrying(what, key, attempt)
        except NotFoundError:
            self._raise_if_bucket_missing(what, key)
            raise
        except StoredChecksumMismatch as e:
            # Every attempt answered, with the same bytes against the same kept checksum: the object
            # is damaged where it is kept; read again it would fail the same way forever.
            if len(reads) > 1 and len(set(reads)) == 1:
                raise damaged_object(url, key, e.kept, e.got, len(reads)) from e
            raise
        self._bucket_seen = True
        return result

    _buffers: ByteBudget
    """The store's upload buffers (``max_buffer_bytes``), set by the backend."""

    def put_bytes(self, key: str, data: bytes) -> None:  # implemented by the backend
        raise NotImplementedError

    def _put_whole(
        self, local_path: str, key: str, size: int, crc32c: int | None, progress: ProgressFn | None, url: str
    ) -> None:
        """``put_file`` of a file sent in one request (to ``url``, said in errors): read whole once
        the store's budget holds its ``size`` bytes (given back once sent), checked against the
        caller's CRC32C, then put."""
        reading = f"cannot read the local file {local_path} (uploading to {url})"
        with self._buffers.hold(size):
            with local_file(reading, key), open(local_path, "rb") as f:
                data = read_at(f.fileno(), size, 0)
            if len(data) != size:
                raise PermanentStorageError(f"{local_path} shrank while being uploaded to {url}", key)
            check_local_crc(url, key, local_path, crc32c_bytes(data), crc32c)
            self.put_bytes(key, data)
        if progress:
            progress(size)

    def _holds(self, key: str, data: bytes) -> bool:
        """After an ambiguous create-only failure: is the object there with exactly our bytes?"""
        try:
            return self.get_bytes(key) == data
        except NotFoundError:
            return False


class StoredChecksumMismatch(TransientStorageError):
    """A ``get_small`` answer whose bytes do not match the CRC32C the store sent with them
    (``kept``; ``got``: the bytes', None where the client checked them itself and did not say).
    Transient: damage on the way goes away when read again. ``_read_small`` makes it a
    ``DamagedObjectError`` when every retried read failed so with the same bytes."""

    def __init__(self, message: str, key: str | None, kept: int, got: int | None) -> None:
        super().__init__(message, key)
        self.kept = kept
        self.got = got


def damaged_object(url: str, key: str, kept: int, got: int | None, reads: int) -> DamagedObjectError:
    """The error of a small object read ``reads`` times, each time with bytes (CRC32C ``got``)
    that do not match the CRC32C ``kept`` the store keeps for it."""
    bytes_crc = f", the bytes read have {got:08x}" if got is not None else ""
    return DamagedObjectError(
        f"{url} is damaged: its stored bytes do not match the CRC32C the store keeps for it ({kept:08x}"
        f"{bytes_crc}; the same in each of {reads} reads), so it was damaged where it is kept or rewritten "
        "by something that did not update its checksum. Reading it again cannot help: replace it with a "
        "good copy (or delete it)",
        key,
    )


def small_body(url: str, what: str, key: str, data: bytes, size: int | None, max_bytes: int) -> bytes:
    """A ``get_small`` answer's body, checked: ``data`` read up to ``max_bytes + 1`` bytes, ``size``
    what the answer said (None when it did not): ``TooLargeError`` past the bound, a transient error
    when the connection ended early."""
    if len(data) > max_bytes:
        raise TooLargeError(f"{url} is more than {max_bytes} bytes", key)
    if size is not None and len(data) != size:
        raise TransientStorageError(f"{what}: connection ended after {len(data)} of {size} bytes", key)
    return data
