"""S3 (and S3-compatible stores) as a checkpoint store, through boto3.

Credentials come from boto3's standard chain (env, profile, SSO, IRSA / pod identity, IMDS);
``AWS_ENDPOINT_URL`` / ``AWS_ENDPOINT_URL_S3`` point it at another endpoint (moto, MinIO), read by
botocore itself.

Retries: botocore's own retries are off (``total_max_attempts=1``). Each request this module makes
— one PUT, one part of a multipart upload, one range of a download, one page of a listing, one
delete batch — is a unit under ``retry_transient``: a throttled part is re-sent alone instead of the
whole upload restarting, and one policy (``SPOTJOB_STORAGE_*``) with one log line per retry is in
force. Keeping botocore's retries for parts would have given part-level retries too, but hidden
(debug-level logs), on a second schedule, multiplying our attempts.

Large files (``>= multipart_threshold``) go up as a multipart upload whose parts are read and sent
in parallel, each with its CRC32C; the upload is declared ``FULL_OBJECT`` CRC32C and completed
with the whole file's CRC32C, combined from the parts, so S3 itself checks the assembled object.
A store that refuses that whole-object checksum (one that only knows composite multipart checksums)
gets the upload completed without it, once warned per process and bucket.
A failed upload is aborted, the abort retried like any request (best effort: a bucket lifecycle
rule should also abort incomplete multipart uploads after a day; it alone reclaims an upload that a
``CreateMultipartUpload`` whose answer was lost started, which listing the bucket's uploads would
find only with a permission wider than a training role's prefix). Downloads are parallel ranged GETs
pinned with ``If-Match`` to the ETag seen first, so an object replaced mid-download fails instead
of mixing two versions.

Create-only: ``PutObject`` with ``If-None-Match: *``; S3 answers 412 when the key exists. moto
enforces it too (tested). moto does not verify checksums we send, hence ``get_file`` verifies
every byte itself.

Not every S3-compatible store enforces it: older MinIO and Ceph RGW releases and some gateways
accept the header and overwrite. ``check_create_only`` (called by the Checkpointer's rank 0 before
its first create-only write) proves it once per process and endpoint/bucket with a probe object:
create it, create it again (must be 412), delete it; a store that overwrites is refused, naming
``SPOTJOB_STORAGE_S3_CREATE_ONLY_CHECK=0`` for whoever accepts the risk knowingly.

Why not boto3's transfer manager (s3transfer 0.19, which does forward a full-object CRC32C on a
multipart upload, and moto accepts it): its per-part retries are botocore's, whose jitter draws
from Python's global ``random`` — the training script's stream, shifted from a save thread at
moments nobody controls — and its downloads name their temporary file from the same stream
(``s3transfer.utils.random_file_extension``); switching botocore's retries off instead would make
one throttled part restart a whole multi-GB upload. Its ranged downloads also carry no checksum,
so the manifest's CRC32C would need a second pass over the file, where ``download_verified``
checks the bytes as they arrive.

What S3's answers mean (which to retry, which to refuse, and what each message tells the user to
do) is ``agent.storage._s3_errors``'s ``_storage_error``.
"""

from __future__ import annotations

import base64
import builtins
import functools
import hashlib
import logging
import os
import re
import threading
import uuid
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar
from urllib.parse import urlsplit

import boto3
import botocore.loaders
import botocore.session
from botocore.config import Config
from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    FlexibleChecksumError,
)

from agent.crc32c import crc32c_bytes
from agent.storage._errors import local_file
from agent.storage._retry import retry_transient
from agent.storage._s3_errors import (
    _CHECKSUM_MISMATCH_CODES,
    _OBJECT_LOCK,
    _OBJECT_LOCK_HINT,
    _TRANSIENT_CODES,
    _endpoint_variable,
    _NoSuchBucket,
    _refuses_checksum_headers,
    _status_and_code,
    _storage_error,
    _without_userinfo,
)
from agent.storage._transfer import (
    ByteBudget,
    GiB,
    MiB,
    PrefixedKeys,
    RangeSink,
    StoredChecksumMismatch,
    TransferPool,
    TransferSettings,
    check_local_crc,
    check_size,
    crc32c_concat,
    crc_from_b64,
    crc_to_b64,
    download_verified,
    read_at,
    small_body,
    spans,
)
from agent.storage.base import (
    DEFAULT_PARALLELISM,
    AlreadyExistsError,
    CorruptObjectError,
    MissingBucketError,
    NotFoundError,
    ObjectInfo,
    PermanentStorageError,
    ProgressFn,
    RetainedError,
    Storage,
    StorageError,
    TooLargeError,
    TransientStorageError,
    store_time,
)

log = logging.getLogger(__name__)

T = TypeVar("T")

S3_MIN_PART = 5 * MiB
S3_MAX_PART = 5 * GiB
S3_MAX_PARTS = 10_000
S3_MAX_PUT = 5 * GiB  # PutObject's largest body: a bigger file goes up in parts, whatever the threshold
DELETE_BATCH = 1000  # DeleteObjects' limit
LIST_PAGE_SIZE = 1000  # ListObjectsV2's maximum
_READ_CHUNK = 1 * MiB

_loader_lock = threading.Lock()
_loader: botocore.loaders.Loader | None = None


def _new_session() -> boto3.session.Session:
    """A private boto3 session sharing one process-wide botocore data loader.

    boto3's default session is not safe to share across threads, so every store gets its own;
    but a fresh session re-parses botocore's bundled JSON models (~0.2-0.5 s per store), which
    the loader caches. Credentials and endpoint are still resolved per session.
    """
    global _loader
    with _loader_lock:
        if _loader is None:
            _loader = botocore.loaders.create_loader(os.environ.get("AWS_DATA_PATH"))
        loader = _loader
    core = botocore.session.get_session()
    core.register_component("data_loader", loader)
    return boto3.session.Session(botocore_session=core)


_CREATE_ONLY_SWITCH = "SPOTJOB_STORAGE_S3_CREATE_ONLY_CHECK=0"


# (endpoint, bucket) pairs whose create-only PUTs this process has seen refused on an existing key.
_create_only_proven: set[tuple[str, str]] = set()
_create_only_lock = threading.Lock()
"""Guards this set and the other per-store sets below (``_first_seen``)."""


# (endpoint, bucket) pairs seen refusing a multipart upload's whole-object CRC32C: stores that only
# combine the parts' checksums into a composite one (MinIO releases before 2025 ignore
# ``ChecksumType=FULL_OBJECT`` and compare our whole-file CRC32C with their CRC of the parts' CRCs).
_full_object_refused: set[tuple[str, str]] = set()

# (endpoint, bucket) pairs that answered DeleteObjects with NotImplemented (GCS's S3 interoperability
# before it had multi-object delete, some gateways): their deletes go one key a request.
_multi_delete_refused: set[tuple[str, str]] = set()


def _first_seen(stores: set[tuple[str, str]], store: tuple[str, str]) -> bool:
    """Add ``store`` to one of the sets above; whether it was new (so that what it means is logged
    once per process and bucket, whichever thread saw it first)."""
    with _create_only_lock:
        new = store not in stores
        stores.add(store)
    return new


class _MultiDeleteRefused(PermanentStorageError):
    """The store does not implement DeleteObjects; ``delete`` then deletes key by key."""


_XML_UNSAFE = re.compile("[^\t\n\x20-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")


def _content_md5_instead_of_crc32(params: dict[str, Any], **_: Any) -> None:
    """(botocore ``before-call`` handler) Give a DeleteObjects request ``Content-MD5``, not a CRC32.

    S3 requires an integrity header on DeleteObjects. botocore 1.36 and later send a CRC32
    (``x-amz-checksum-crc32`` with ``x-amz-sdk-checksum-algorithm``) where it sent ``Content-MD5``
    before, and many S3-compatible stores refuse that: MinIO releases before 2025 and Dell
    PowerScale answer 400 ``MissingContentMD5``, Backblaze B2 "Unsupported header". Every old
    checkpoint would then be undeletable. S3 itself accepts either, so every store gets the MD5.
    Where MD5 is unavailable (a FIPS build) botocore's CRC32 is left in place.
    """
    body = params.get("body")
    if not isinstance(body, bytes | bytearray):
        return
    try:
        digest = hashlib.md5(body, usedforsecurity=False).digest()
    except ValueError:  # FIPS: no MD5 at all
        return
    checksum = params.get("context", {}).get("checksum")
    if isinstance(checksum, dict):
        checksum.pop("request_algorithm", None)
        checksum.pop("request_algorithm_header", None)
    params["headers"]["Content-MD5"] = base64.b64encode(digest).decode("ascii")


def _unusable_endpoint(why: str) -> ValueError:
    """The endpoint botocore was given cannot be used: said naming where it comes from, not
    repeating it (a ``user:secret@`` or a token in its query would be in every log line)."""
    named = _endpoint_variable()
    where = named or "the AWS config file's endpoint_url"
    return ValueError(
        f"{where} ({why}; its value is not repeated here) is not a URL that S3 requests can go to: write "
        "the scheme, host and port only, e.g. http://127.0.0.1:9000 or https://s3.example.com"
    )


def _endpoint_flaw(url: str) -> str | None:
    """Why ``url`` (with its scheme) cannot be the endpoint S3 requests go to, or None where it can;
    said without repeating it. A URL's parts that botocore checks only at the first request, or not
    at all: whitespace anywhere (urllib strips it before the scheme, botocore keeps it after the
    port), a scheme other than http or https, no host, a port that is no number from 1 to 65535, a
    query or a fragment (every request's URL would carry them, a token in them with it)."""
    if any(c.isspace() for c in url):
        return "it has a space, tab or newline in it or around it"
    try:
        split = urlsplit(url)
        port = split.port
    except ValueError:  # "Port out of range 0-65535", "Port could not be cast to integer value"
        return "its port is no number from 1 to 65535"
    if split.scheme.lower() not in ("http", "https"):
        return f"its scheme is {split.scheme or 'missing'}, not http or https"
    if not split.hostname:
        return "it has no host"
    if port == 0:
        return "its port is no number from 1 to 65535"
    if split.query or split.fragment:
        return "it has a query" if split.query else "it has a fragment"
    return None


def _stored_crc32c(resp: dict[str, Any]) -> int | None:
    """The whole object's CRC32C a GetObject answer says (asked with ``ChecksumMode=ENABLED``),
    or None where it says none: no CRC32C kept, or a ``COMPOSITE`` one (``<base64>-<parts>``, a
    CRC of the parts' CRCs, which the bytes alone cannot be checked against), or one that is not
    four bytes of base64 (a store's own spelling, left unchecked rather than refused)."""
    said = resp.get("ChecksumCRC32C")
    if not isinstance(said, str) or "-" in said or resp.get("ChecksumType") == "COMPOSITE":
        return None
    try:
        raw = base64.b64decode(said, validate=True)
    except ValueError:
        return None
    return crc_from_b64(said) if len(raw) == 4 else None


class S3Storage(PrefixedKeys, Storage):
    """``s3://bucket/prefix``. Thread-safe: one botocore client (itself thread-safe) per object."""

    def __init__(self, bucket: str, prefix: str, *, settings: TransferSettings | None = None) -> None:
        if not bucket:
            raise ValueError("S3Storage needs a bucket name")
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.uri = f"s3://{bucket}/{self.prefix}" if self.prefix else f"s3://{bucket}"
        self.settings = settings or TransferSettings.from_env()
        config = Config(
            retries={"total_max_attempts": 1, "mode": "standard"},
            connect_timeout=self.settings.connect_timeout_s,
            read_timeout=self.settings.read_timeout_s,
            # Pool workers plus the callers' own threads (put_files/get_files) may all hold one.
            max_pool_connections=self.settings.concurrency + DEFAULT_PARALLELISM,
            # We compute and send CRC32C ourselves and verify downloads against the manifest;
            # botocore's defaults would add a second checksum pass (CRC32) on every request.
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
            tcp_keepalive=True,
        )
        self._client: Any = self._new_client(config)
        self._client.meta.events.register("before-call.s3.DeleteObjects", _content_md5_instead_of_crc32)
        self._pool = TransferPool(self.settings.concurrency, "spotjob-s3")
        self._buffers = ByteBudget(self.settings.max_buffer_bytes)
        self._checksums = self.settings.s3_checksum_headers
        self.endpoint = _without_userinfo(str(self._client.meta.endpoint_url))
        """The URL requests go to (``AWS_ENDPOINT_URL`` or AWS's own), without any credentials in it."""

    def _new_client(self, config: Config) -> Any:
        """The store's botocore client. botocore resolves the credentials and the endpoint here, so
        a profile that does not exist, half a pair of keys, a malformed config file or an endpoint
        URL without its scheme fails now: said as a ``PermanentStorageError`` (a ``ValueError`` for
        the endpoint, which is a setting to correct), never as botocore's own exception. So does an
        endpoint botocore takes here but no request can go to (``_endpoint_flaw``)."""
        try:
            client = _new_session().client("s3", config=config)
        except BotoCoreError as e:
            raise _storage_error(e, f"opening {self.uri}", None) from e
        except ValueError as e:
            if not str(e).startswith("Invalid endpoint"):
                # urllib's own refusal of the URL ("Invalid IPv6 URL"), which names nothing.
                raise _unusable_endpoint(str(e)) from None
            # botocore's message is the value itself; a user:secret@ in it has no scheme to mask it by.
            named = _endpoint_variable()
            value = os.environ[named] if named else str(e).partition(": ")[2]
            flaw = _endpoint_flaw(value) if "://" in value else None
            if flaw:  # it has its scheme: "write it with its scheme" would be the wrong advice
                raise _unusable_endpoint(flaw) from None
            value = value.strip()
            value = ("***@" + value.rpartition("@")[2]) if "@" in value else value
            where = f"{named}={value!r}" if named else f"the AWS config file's endpoint_url {value!r}"
            raise ValueError(
                f"{where} is not a URL that S3 requests can go to: write it with its scheme, e.g. "
                "http://127.0.0.1:9000 or https://s3.example.com"
            ) from None
        # botocore takes these here (a query, a fragment, another scheme, a port out of range, a
        # space after it), then fails every request with its raw EndpointResolutionError or a
        # connection error, naming neither the variable nor the fix, or repeating the whole URL.
        flaw = _endpoint_flaw(str(client.meta.endpoint_url))
        if flaw:
            raise _unusable_endpoint(flaw)
        return client

    def _crc_args(self, crc: int) -> dict[str, str]:
        """The CRC32C argument of an upload request, or none with ``s3_checksum_headers`` off."""
        return {"ChecksumCRC32C": crc_to_b64(crc)} if self._checksums else {}

    # -- plumbing ----------------------------------------------------------------------------
    def _request(self, what: str, key: str | None, fn: Callable[[], T]) -> T:
        """One attempt of one request, with boto3's exceptions translated."""
        try:
            return fn()
        except (ClientError, BotoCoreError) as e:
            raise self._error(e, what, key) from e

    def _error(self, e: Exception, what: str, key: str | None) -> StorageError:
        source, temporary = self._credential_kind()
        err = _storage_error(e, what, key, source, temporary)
        return self._missing_bucket(what, key) if isinstance(err, _NoSuchBucket) else err

    def _credential_kind(self) -> tuple[str | None, bool]:
        """botocore's name for where this client's credentials came from (when it says), and whether
        they are temporary (carry a session token). The token is read from the object's fields, not
        its ``token`` property, which would refresh refreshable credentials (a call to their source)."""
        credentials = getattr(getattr(self._client, "_request_signer", None), "_credentials", None)
        method = getattr(credentials, "method", None)
        fields = getattr(credentials, "__dict__", {})
        token = fields.get("token") or fields.get("_token")
        return (method if isinstance(method, str) and method else None), bool(token)

    def _bucket_label(self) -> str:
        return self.bucket

    def _missing_bucket(self, what: str, key: str | None) -> MissingBucketError:
        missing = super()._missing_bucket(what, key)
        named = _endpoint_variable()
        if named is None:
            return missing
        # At an endpoint of the user's choosing the bucket may be fine and the endpoint wrong (another
        # server's port, one that is no S3 API at all).
        return MissingBucketError(f"{missing}, or {named} (the requests went to {self.endpoint})", key)

    def _bucket_exists(self) -> bool | None:
        try:
            self._client.head_bucket(Bucket=self.bucket)
        except ClientError as e:
            status = _status_and_code(e)[0]
            return False if status == 404 else None
        except BotoCoreError:
            return None
        return True

    # -- writes ------------------------------------------------------------------------------
    def put_file(
        self,
        local_path: str,
        key: str,
        *,
        crc32c: int | None = None,
        progress: ProgressFn | None = None,
    ) -> None:
        reading = f"cannot read the local file {local_path} (uploading to {self.url(key)})"
        with local_file(reading, key):
            size = os.path.getsize(local_path)
        if size < self.settings.multipart_threshold and size <= S3_MAX_PUT:
            self._put_whole(local_path, key, size, crc32c, progress, self.url(key))
            return
        self._put_multipart(local_path, key, size, crc32c, progress)

    def put_bytes(self, key: str, data: bytes) -> None:
        obj = self._object_key(key)
        crc = crc32c_bytes(data)
        self._retrying(
            f"PUT {self.url(key)}",
            key,
            lambda: self._client.put_object(Bucket=self.bucket, Key=obj, Body=data, **self._crc_args(crc)),
        )

    def put_bytes_if_absent(self, key: str, data: bytes) -> None:
        """Create-only PUT (``If-None-Match: *``).

        An attempt that fails ambiguously (dropped connection, 5xx) may still have created the
        object. If a later attempt then gets 412, the object is read back: holding exactly
        ``data``, it is our own earlier write and the call succeeds; anything else is
        ``AlreadyExistsError``. (Two writers racing with byte-identical data can thus both
        succeed — harmless, the stored state is the one each of them asked for.)
        """
        obj = self._object_key(key)
        what = f"PUT (create-only) {self.url(key)}"
        crc = crc32c_bytes(data)
        ambiguous = False

        def attempt() -> None:
            nonlocal ambiguous
            try:
                self._client.put_object(Bucket=self.bucket, Key=obj, Body=data, IfNoneMatch="*", **self._crc_args(crc))
            except ClientError as e:
                status, code = _status_and_code(e)
                if status == 412 or code == "PreconditionFailed":
                    if ambiguous and self._holds(key, data):
                        log.info("%s: an earlier attempt had already created it; done", what)
                        return
                    raise AlreadyExistsError(f"{self.url(key)} already exists; refusing to overwrite it", key) from None
                if status == 501 or code == "NotImplemented":
                    raise PermanentStorageError(
                        f"{what}: {code} (HTTP {status}): the S3 endpoint {self.endpoint} (bucket {self.bucket}) does "
                        "not implement conditional writes (If-None-Match: * on PutObject), which spotjob needs to "
                        "commit a checkpoint's MANIFEST.json and the job's owner and attempt records without ever "
                        "overwriting one. Upgrade the store to a release that supports them, or use another store; "
                        f"{_CREATE_ONLY_SWITCH} does not help (every commit sends the header)",
                        key,
                    ) from e
                err = self._error(e, what, key)
                ambiguous = ambiguous or isinstance(err, TransientStorageError)
                raise err from e
            except BotoCoreError as e:
                err = self._error(e, what, key)
                ambiguous = ambiguous or isinstance(err, TransientStorageError)
                raise err from e

        retry_transient(what, attempt)

    def check_create_only(self, under: str) -> None:
        """Prove once per process and endpoint/bucket that ``If-None-Match: *`` is enforced.

        Three requests: a create-only PUT of a fresh probe key under ``under``, a second one of the
        same key (it must be refused: 412), a delete. A failed delete is only a warning: the probe
        is a few bytes in a folder no listing of checkpoints reads.
        """
        if not self.settings.s3_create_only_check:
            return
        proven = (self.endpoint, self.bucket)
        with _create_only_lock:
            if proven in _create_only_proven:
                return
        key = f"{under.strip('/')}/create-only-probe-{uuid.uuid4().hex}"
        refused = False
        try:
            try:
                self.put_bytes_if_absent(key, b"spotjob create-only probe: first write\n")
            except AlreadyExistsError:
                raise  # a retry of a PUT that had landed: the probe is there, delete it
            except PermanentStorageError:
                refused = True  # no bucket, denied: nothing was written, nothing to delete
                raise
            try:
                self.put_bytes_if_absent(key, b"spotjob create-only probe: second write\n")
            except AlreadyExistsError:
                pass  # refused, as it must be
            else:
                raise PermanentStorageError(
                    f"the S3 endpoint {self.endpoint} (bucket {self.bucket}) ignores If-None-Match: *: a second "
                    f"create-only PUT of {self.url(key)} replaced the object instead of being refused (HTTP 412), "
                    "so a committed MANIFEST.json or the job's owner and attempt records could be silently "
                    "overwritten. Upgrade the store to a release that supports conditional writes "
                    "(If-None-Match on PutObject), or, to accept that risk knowingly, set "
                    f"{_CREATE_ONLY_SWITCH}",
                    key,
                )
        finally:
            try:
                if not refused:
                    self.delete([key])
            except StorageError as e:
                log.warning("could not delete the create-only probe %s (harmless, a few bytes): %s", self.url(key), e)
        with _create_only_lock:
            _create_only_proven.add(proven)
        log.debug("%s refuses create-only writes to existing keys, as spotjob needs", self.endpoint)

    def _put_multipart(
        self, local_path: str, key: str, size: int, crc32c: int | None, progress: ProgressFn | None
    ) -> None:
        obj = self._object_key(key)
        url = self.url(key)
        # S3 refuses a part above 5 GiB (EntityTooLarge) for good; size/10000 stays below it up
        # to S3's largest object (5 TiB).
        part_size = min(max(self.settings.upload_part_size, S3_MIN_PART, -(-size // S3_MAX_PARTS)), S3_MAX_PART)
        parts = spans(size, part_size)
        upload = self._retrying(
            f"CreateMultipartUpload {url}",
            key,
            lambda: self._client.create_multipart_upload(
                Bucket=self.bucket,
                Key=obj,
                **({"ChecksumAlgorithm": "CRC32C", "ChecksumType": "FULL_OBJECT"} if self._checksums else {}),
            ),
        )
        upload_id: str = upload["UploadId"]
        log.debug("uploading %s to %s in %d parts of %d bytes", local_path, url, len(parts), part_size)
        reading = f"cannot read the local file {local_path} (uploading to {url})"
        try:
            with local_file(reading, key), open(local_path, "rb") as f:
                fd = f.fileno()

                def send_part(number: int, offset: int, length: int) -> tuple[int, str]:
                    # The part is read only once the store's budget holds its bytes, and they are
                    # given back once it is sent: a budget, not concurrency x part size, of memory.
                    with self._buffers.hold(length):
                        with local_file(reading, key):
                            data = read_at(fd, length, offset)
                        if len(data) != length:
                            raise PermanentStorageError(f"{local_path} shrank while being uploaded to {url}", key)
                        crc = crc32c_bytes(data)
                        resp = self._retrying(
                            f"PUT {url} part {number}/{len(parts)}",
                            key,
                            lambda: self._client.upload_part(
                                Bucket=self.bucket,
                                Key=obj,
                                UploadId=upload_id,
                                PartNumber=number,
                                Body=data,
                                **self._crc_args(crc),
                            ),
                        )
                    if progress:
                        progress(length)
                    return crc, str(resp["ETag"])

                sent = self._pool.map(send_part, [(n, off, ln) for n, (off, ln) in enumerate(parts, 1)])
            whole = crc32c_concat([(crc, ln) for (crc, _), (_, ln) in zip(sent, parts, strict=True)])
            check_local_crc(url, key, local_path, whole, crc32c)
            self._complete(
                url,
                key,
                obj,
                upload_id,
                size,
                [{"PartNumber": n, "ETag": etag, **self._crc_args(crc)} for n, (crc, etag) in enumerate(sent, 1)],
                whole,
            )
        except BaseException:
            self._abort(url, obj, upload_id)
            raise

    def _complete(
        self, url: str, key: str, obj: str, upload_id: str, size: int, parts: list[dict[str, Any]], crc: int
    ) -> None:
        what = f"CompleteMultipartUpload {url}"
        ambiguous = False
        store = (self.endpoint, self.bucket)

        def send(whole: bool) -> None:
            self._client.complete_multipart_upload(
                Bucket=self.bucket,
                Key=obj,
                UploadId=upload_id,
                MultipartUpload={"Parts": parts},
                **(dict(self._crc_args(crc), ChecksumType="FULL_OBJECT") if whole else {}),
            )

        def attempt() -> None:
            nonlocal ambiguous
            try:
                whole = self._checksums and store not in _full_object_refused
                try:
                    send(whole)
                except ClientError as e:
                    if not (whole and self._refuses_full_object_checksum(e)):
                        raise
                    # Our CRC32C is the whole file's, combined from the parts the store accepted
                    # with their own CRC32Cs: a store that disagrees computes another kind of checksum.
                    if _first_seen(_full_object_refused, store):
                        log.warning(
                            "the S3 endpoint %s (bucket %s) refused the full-object CRC32C of a multipart "
                            "upload (%s: %s): it supports only per-part checksums (MinIO before 2025 does). "
                            "Multipart uploads there are completed without it from now on; each part's CRC32C "
                            "is still checked by the store, and every file by spotjob when it is read back",
                            self.endpoint,
                            self.bucket,
                            _status_and_code(e)[1],
                            e.response.get("Error", {}).get("Message") or "",
                        )
                    send(False)
            except ClientError as e:
                _, code = _status_and_code(e)
                # An earlier attempt completed it and only its answer was lost.
                if code == "NoSuchUpload" and ambiguous:
                    info = self.stat(key)
                    if info is not None and info.size == size:
                        log.info("%s: an earlier attempt had already completed it; done", what)
                        return
                err = self._error(e, what, key)
                ambiguous = ambiguous or isinstance(err, TransientStorageError)
                raise err from e
            except BotoCoreError as e:
                err = self._error(e, what, key)
                ambiguous = ambiguous or isinstance(err, TransientStorageError)
                raise err from e

        retry_transient(what, attempt)

    @staticmethod
    def _refuses_full_object_checksum(e: ClientError) -> bool:
        """A CompleteMultipartUpload's refusal of the whole-object checksum it carried: a checksum
        mismatch, or the store saying it does not support that checksum (type)."""
        status, code = _status_and_code(e)
        message = e.response.get("Error", {}).get("Message") or ""
        return code in _CHECKSUM_MISMATCH_CODES or _refuses_checksum_headers(status, code, message)

    def _abort(self, url: str, obj: str, upload_id: str) -> None:
        """Abort a multipart upload, retried like any request: the throttling that failed the
        upload is likely to meet its abort too, and an upload left open bills its parts."""
        what = f"AbortMultipartUpload {url}"

        def attempt() -> None:
            try:
                self._client.abort_multipart_upload(Bucket=self.bucket, Key=obj, UploadId=upload_id)
            except ClientError as e:
                if _status_and_code(e)[1] == "NoSuchUpload":
                    return  # already aborted (or completed): nothing left to reclaim
                raise self._error(e, what, None) from e
            except BotoCoreError as e:
                raise self._error(e, what, None) from e

        try:
            retry_transient(what, attempt)
        except Exception as e:
            # Not fatal: the parts are invisible and a lifecycle rule reclaims them, but say so.
            log.warning("could not abort the failed multipart upload of %s: %s", url, e)

    # -- reads -------------------------------------------------------------------------------
    def get_bytes(self, key: str) -> bytes:
        obj = self._object_key(key)

        def read() -> bytes:
            resp = self._client.get_object(Bucket=self.bucket, Key=obj)
            body = resp["Body"]
            try:
                return bytes(body.read())
            finally:
                body.close()

        return self._retrying(f"GET {self.url(key)}", key, read)

    def get_small(self, key: str, max_bytes: int) -> tuple[bytes, ObjectInfo]:
        """One GET, where a HEAD and a GET went before: the answer's ``Content-Length`` is checked
        against ``max_bytes`` before a byte of the body is read, and no more than ``max_bytes + 1``
        bytes are read whatever it says. Its ``LastModified`` is what the HEAD said. A missing key
        is S3's ``NoSuchKey``, which says the bucket exists (a missing one is ``NoSuchBucket``); a
        bare 404 (a gateway) asks about the bucket once, as after a HEAD.

        The GET asks for the object's stored checksum (``ChecksumMode=ENABLED``, unless
        ``s3_checksum_headers`` is off: a store that refuses ``x-amz-checksum-*`` headers refuses
        that one too), and the bytes are checked against its CRC32C, as GCS's are against
        ``x-goog-hash``: a mismatch is a ``TransientStorageError`` (damaged on the way; read again
        within the retries, then raised), or a ``DamagedObjectError`` when every read found the same
        bytes against the same kept checksum (damaged where it is kept: ``_read_small``). Every
        object spotjob writes carries a CRC32C on a store that keeps it. Nothing is checked when the
        answer carries no whole-object CRC32C: an object another tool wrote without one (or with
        another algorithm: CRC32, CRC64NVME, SHA), a multipart object whose checksum is
        ``COMPOSITE`` (a CRC of its parts' CRCs, ``...-N``), a store that keeps no checksums (moto
        unless the upload names its algorithm)."""
        obj = self._object_key(key)
        url = self.url(key)
        what = f"GET {url}"
        mode = {"ChecksumMode": "ENABLED"} if self._checksums else {}

        def read() -> tuple[bytes, ObjectInfo]:
            try:
                resp = self._client.get_object(Bucket=self.bucket, Key=obj, **mode)
            except ClientError as e:
                if _status_and_code(e)[1] == "NoSuchKey":
                    self._bucket_seen = True
                raise
            body = resp["Body"]
            try:
                said = resp.get("ContentLength")
                size = int(said) if said is not None else None
                if size is not None and size > max_bytes:
                    raise TooLargeError(f"{url} is {size} bytes, more than {max_bytes}", key, size)
                kept = _stored_crc32c(resp)
                try:
                    data = bytes(body.read(max_bytes + 1))
                except FlexibleChecksumError as e:
                    # botocore checks the body itself where its first read ends it (an empty object).
                    if kept is None:
                        raise
                    raise StoredChecksumMismatch(f"{what}: {e}", key, kept, None) from e
            finally:
                body.close()
            small_body(url, what, key, data, size, max_bytes)
            if kept is not None and (got := crc32c_bytes(data)) != kept:
                raise StoredChecksumMismatch(
                    f"{what}: the store says the object's CRC32C is {kept:08x}, the bytes read have "
                    f"{got:08x}: damaged on the way (or where they are kept)",
                    key,
                    kept,
                    got,
                )
            return data, ObjectInfo(key, len(data), store_time(resp.get("LastModified")))

        return self._read_small(what, url, key, read)

    def _head(self, key: str) -> dict[str, Any]:
        obj = self._object_key(key)
        what = f"HEAD {self.url(key)}"
        try:
            resp: dict[str, Any] = self._retrying(
                what, key, lambda: self._client.head_object(Bucket=self.bucket, Key=obj)
            )
        except NotFoundError:
            # A HEAD's 404 has no body, so it cannot say NoSuchBucket: ask once.
            self._raise_if_bucket_missing(what, key)
            raise
        return resp

    def get_file(
        self,
        key: str,
        local_path: str,
        *,
        size: int | None = None,
        crc32c: int | None = None,
        progress: ProgressFn | None = None,
    ) -> None:
        obj = self._object_key(key)
        url = self.url(key)
        # A file the caller knows to fit one part takes one ranged GET and no HEAD: the answer's
        # Content-Range says the object's size, checked before a byte is kept, and a single GET
        # cannot mix two versions of the object (the ETag of a HEAD only ties several together).
        one_get = size is not None and 0 < size <= self.settings.part_size
        etag, actual = None, size or 0
        if not one_get:
            head = self._head(key)
            etag, actual = head.get("ETag"), int(head["ContentLength"])
            check_size(url, key, actual, size)

        def fetch(offset: int, length: int, sink: RangeSink) -> None:
            def read() -> None:
                extra = {"IfMatch": etag} if etag else {}
                try:
                    resp = self._client.get_object(
                        Bucket=self.bucket, Key=obj, Range=f"bytes={offset}-{offset + length - 1}", **extra
                    )
                except ClientError as e:
                    if _status_and_code(e)[0] == 412:
                        raise PermanentStorageError(f"{url} was replaced while being downloaded", key) from e
                    if one_get and _status_and_code(e)[0] == 416:  # no byte 0: an empty object
                        raise CorruptObjectError(f"{url} is 0 bytes, the manifest says {size}", key) from e
                    raise
                if one_get:
                    total = str(resp.get("ContentRange") or "").rpartition("/")[2]
                    try:
                        check_size(url, key, int(total) if total.isdigit() else int(resp["ContentLength"]), size)
                    except CorruptObjectError:
                        resp["Body"].close()
                        raise
                body = resp["Body"]  # StreamingBody: checks Content-Length, wraps urllib3 errors
                try:
                    for chunk in body.iter_chunks(_READ_CHUNK):
                        sink.write(chunk)
                finally:
                    body.close()

            self._request(f"GET {url}", key, read)

        download_verified(
            what=url,
            key=key,
            size=actual,
            local_path=local_path,
            crc32c=crc32c,
            part_size=self.settings.part_size,
            pool=self._pool,
            fetch=fetch,
            progress=progress,
        )

    def stat(self, key: str) -> ObjectInfo | None:
        try:
            head = self._head(key)
        except NotFoundError:
            return None
        return ObjectInfo(key, int(head["ContentLength"]), store_time(head.get("LastModified")))

    def _pages(self, prefix: str, delimiter: str | None) -> Iterator[dict[str, Any]]:
        """ListObjectsV2 pages, each fetched (and retried) on its own."""
        args: dict[str, Any] = {"Bucket": self.bucket, "Prefix": prefix, "MaxKeys": LIST_PAGE_SIZE}
        if delimiter:
            args["Delimiter"] = delimiter
        what = f"LIST s3://{self.bucket}/{prefix}"
        token: str | None = None
        while True:
            page_args = dict(args, ContinuationToken=token) if token else args
            try:
                page: dict[str, Any] = self._retrying(
                    what, None, functools.partial(self._client.list_objects_v2, **page_args)
                )
            except NotFoundError as e:
                # A listing has no object to miss: S3 answers it 404 only for a bucket it does not
                # have (NoSuchBucket, translated already). A bare 404 is a server that is no S3 API.
                raise self._missing_bucket(what, None) from e
            yield page
            token = page.get("NextContinuationToken")
            if not page.get("IsTruncated") or not token:
                return

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        full = self._list_prefix(prefix)
        for page in self._pages(full, None):
            for item in page.get("Contents", []):
                yield ObjectInfo(self._relative(item["Key"]), int(item["Size"]), store_time(item.get("LastModified")))

    def list_dirs(self, prefix: str = "") -> builtins.list[str]:
        if prefix and not prefix.endswith("/"):
            prefix += "/"  # as FileStorage does: "step-1" names the folder step-1/
        full = self._list_prefix(prefix)
        names: set[str] = set()
        for page in self._pages(full, "/"):
            for common in page.get("CommonPrefixes", []):
                name = common["Prefix"][len(full) :].rstrip("/")
                if name:
                    names.add(name)
        return sorted(names)

    # -- deletes -----------------------------------------------------------------------------
    def delete(self, keys: Iterable[str]) -> None:
        objects = [self._object_key(k) for k in keys]
        # DeleteObjects names its keys in an XML body, which cannot carry every key: a stray object
        # someone put in a checkpoint folder under such a name goes alone, by DeleteObject.
        for obj in [o for o in objects if _XML_UNSAFE.search(o)]:
            self._retrying(
                f"DELETE {obj!r} in s3://{self.bucket}",  # repr: the key holds control characters
                None,
                functools.partial(self._client.delete_object, Bucket=self.bucket, Key=obj),
            )
        objects = [o for o in objects if not _XML_UNSAFE.search(o)]
        store = (self.endpoint, self.bucket)
        for start in range(0, len(objects), DELETE_BATCH):
            batch = objects[start : start + DELETE_BATCH]
            what = f"DELETE {len(batch)} objects under {self.uri}"
            if store not in _multi_delete_refused:
                try:
                    self._retrying(what, None, functools.partial(self._delete_batch, what, batch))
                    continue
                except _MultiDeleteRefused as e:
                    if _first_seen(_multi_delete_refused, store):
                        log.info(
                            "the S3 endpoint %s (bucket %s) does not implement DeleteObjects (%s); deleting one "
                            "key a request there from now on",
                            self.endpoint,
                            self.bucket,
                            e,
                        )
            self._pool.map(self._delete_one, [(o,) for o in batch])

    def _delete_one(self, obj: str) -> None:
        self._retrying(
            f"DELETE s3://{self.bucket}/{obj}",
            None,
            functools.partial(self._client.delete_object, Bucket=self.bucket, Key=obj),
        )

    def _delete_batch(self, what: str, batch: builtins.list[str]) -> None:
        try:
            resp = self._client.delete_objects(
                Bucket=self.bucket, Delete={"Objects": [{"Key": k} for k in batch], "Quiet": True}
            )
        except ClientError as e:
            status, code = _status_and_code(e)
            if code == "NotImplemented":
                raise _MultiDeleteRefused(f"{code} (HTTP {status})") from e
            raise
        # DeleteObjects answers 200 and lists per-key failures; a missing key is not one (S3
        # reports it deleted), so any error here is real. Re-sending the batch is idempotent.
        errors = [e for e in resp.get("Errors", []) if e.get("Code") != "NoSuchKey"]
        if not errors:
            return
        first = errors[0]
        text = f"{what}: {len(errors)} failed, e.g. {first.get('Key')}: {first.get('Code')} {first.get('Message', '')}"
        if all(e.get("Code") in _TRANSIENT_CODES for e in errors):
            raise TransientStorageError(text)
        if all(e.get("Code") == "AccessDenied" and _OBJECT_LOCK.search(str(e.get("Message", ""))) for e in errors):
            raise RetainedError(f"{text}; {_OBJECT_LOCK_HINT}")
        if all(e.get("Code") == "AccessDenied" for e in errors):
            # S3 answers 200 and denies key by key: s3:DeleteObject is checked per object.
            raise PermanentStorageError(
                f"permission denied: {text}; the AWS credentials in use lack s3:DeleteObject on these keys, or "
                "a bucket policy refuses it: nothing committed is lost, but old checkpoints and unfinished "
                "saves stay until deletes are allowed"
            )
        raise PermanentStorageError(text)

    def close(self) -> None:
        self._pool.close()
        self._client.close()
