"""Google Cloud Storage as a checkpoint store, through google-cloud-storage.

Credentials: Application Default Credentials (workload identity, a service-account key, gcloud
login). When ``STORAGE_EMULATOR_HOST`` is set (fake-gcs-server; a URL, ``http://host:port``), the
client talks to it with anonymous credentials and the project from ``GOOGLE_CLOUD_PROJECT``
(default "test").

Retries: the library's own retries are off (``retry=None`` on every call); each request — one
simple upload, one chunk of a resumable upload, one range of a download, one page of a listing,
one delete — is a unit under ``retry_transient``, as in the S3 backend.

Uploads: objects smaller than ``multipart_threshold`` (and than 8 MiB, the library's limit for a
one-request upload) go up in one request carrying their CRC32C, which GCS checks. Bigger ones use a
resumable upload driven here: chunks of ``upload_chunk_size`` (100 MiB, the library's own default;
bigger chunks mean fewer sequential requests) are sent in order, and a failed chunk is simply sent
again from the last offset the server confirmed — what google-cloud-storage's own
chunk retry does, and what also works on fake-gcs-server (whose status query,
``Content-Range: bytes */N``, finalizes the upload instead of reporting it). The last chunk
carries the file's CRC32C in ``x-goog-hash`` so GCS rejects a corrupt assembly, and the CRC32C
GCS reports back is compared too. A session GCS no longer has (404 or 410 on a chunk: expired,
or ended by GCS after a failure of its own) cannot be resumed: the file starts again in a new
session, up to ``SPOTJOB_STORAGE_MAX_ATTEMPTS`` sessions. A resumable upload is sequential; files
go up in parallel through ``put_files``. The session URL is a bearer capability, so it is never
logged.

Why not ``google.cloud.storage.transfer_manager`` (3.x): ``upload_chunks_concurrently`` speaks
GCS's XML multipart API, which fake-gcs-server lacks, so a fallback to this resumable upload
would be the only path the tests could run — the library path would ship untested; its retries
(google-api-core) draw their jitter from Python's global ``random``, the training script's stream,
and the XML upload draws a boundary from it too (``_media._upload``); with retries off, one failed
chunk restarts the file. ``download_chunks_concurrently`` writes straight into the destination,
so a failed or corrupt download would leave a partial file where the contract says nothing is
left, and its chunk retries have the same jitter. Parallel composite uploads leave temporary
objects that soft delete keeps billing.

Create-only: a simple upload with ``ifGenerationMatch=0``, answered 412 when the object exists.
fake-gcs-server enforces the precondition on simple uploads only, which is why the manifest (a
few KB) always goes up in one request.

Downloads: parallel ranged reads of the generation seen first (so a replaced object is never
mixed with its successor), verified as they arrive (see ``_transfer``). A file of known size starts
with its first part's ranged GET, whose answer's headers say the object's size and generation
(``_get_media``): a file of N parts is N requests.
"""

from __future__ import annotations

import builtins
import functools
import json
import logging
import os
import re
import threading
import uuid
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

import google.auth
import requests
import urllib3.exceptions
from google.api_core import exceptions as api_exceptions
from google.auth import exceptions as auth_exceptions
from google.auth.credentials import AnonymousCredentials, Credentials
from google.auth.transport.requests import AuthorizedSession
from google.cloud import storage
from google.cloud.storage import exceptions as gcs_exceptions
from requests.adapters import HTTPAdapter

from agent.crc32c import crc32c_bytes
from agent.storage._errors import TLS_SLIP, URLLIB3_TIMEOUT, local_file
from agent.storage._gcs_answers import _answer_crc32c, _answer_generation, _answer_span, _answer_time
from agent.storage._retry import max_attempts, retry_transient
from agent.storage._s3_errors import _without_userinfo
from agent.storage._transfer import (
    ByteBudget,
    FetchRange,
    KiB,
    MiB,
    PrefixedKeys,
    RangeSink,
    StoredChecksumMismatch,
    TransferPool,
    TransferSettings,
    check_local_crc,
    check_size,
    crc_from_b64,
    crc_to_b64,
    download_verified,
    read_at,
    small_body,
)
from agent.storage.base import (
    DEFAULT_PARALLELISM,
    AlreadyExistsError,
    CorruptObjectError,
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

_SCOPES = ["https://www.googleapis.com/auth/devstorage.read_write"]
SIMPLE_UPLOAD_MAX = 8 * MiB  # google-cloud-storage sends bigger payloads as resumable uploads
CHUNK_GRANULARITY = 256 * KiB  # resumable chunks (all but the last) must be multiples of this
_TRANSIENT_STATUS = frozenset({408, 429, 500, 502, 503, 504})
_CONTENT_TYPE = "application/octet-stream"
LIST_PAGE_SIZE = 1000  # objects.list's maximum
_READ_CHUNK = 1 * MiB

_CONNECTION_ERRORS = (
    requests.ConnectionError,
    requests.Timeout,
    requests.exceptions.ChunkedEncodingError,
    urllib3.exceptions.HTTPError,
    auth_exceptions.TransportError,
    ConnectionError,
)


def _storage_error(e: Exception, what: str, key: str | None) -> StorageError:
    """Translate a google-cloud-storage / requests exception into the StorageError that says
    whether to retry."""
    if isinstance(e, StorageError):
        return e
    if isinstance(e, api_exceptions.GoogleAPICallError):
        status = int(e.code or 0)
        text = f"{what}: HTTP {status}: {_api_error_detail(e)}"
        if status in _TRANSIENT_STATUS or status >= 500:
            return TransientStorageError(text, key)
        if status == 404:
            return NotFoundError(f"{what}: no such object", key)
        if status == 403 and _RETAINED.search(_api_error_detail(e)):
            return RetainedError(f"{text}; {_RETAINED_HINT}", key)
        if status == 401:
            return PermanentStorageError(f"{text}; {_INVALID_CREDENTIALS_HINT}", key)
        elsewhere = _refused_elsewhere(_api_error_detail(e)) if status in (400, 403) else None
        if elsewhere:
            return PermanentStorageError(f"{'permission denied: ' if status == 403 else ''}{text}; {elsewhere}", key)
        if status == 403:
            return PermanentStorageError(
                f"permission denied: {text}; the Google credentials in use (workload identity, service "
                "account) lack the permission on the bucket",
                key,
            )
        if status == 400 and "requester pays" in text.lower():
            return PermanentStorageError(
                f"{text}; spotjob does not support Requester Pays buckets (it sends no billing project): "
                "turn Requester Pays off on the bucket or use another one",
                key,
            )
        return PermanentStorageError(text, key)
    if isinstance(e, gcs_exceptions.DataCorruption):
        # The bytes that arrived do not match the checksum GCS sent with them: damaged in flight.
        return TransientStorageError(f"{what}: checksum mismatch in transit", key)
    if isinstance(e, gcs_exceptions.InvalidResponse):
        status = int(getattr(e.response, "status_code", 0) or 0)
        error: StorageError = (
            TransientStorageError(f"{what}: HTTP {status}", key)
            if status in _TRANSIENT_STATUS or status >= 500
            else PermanentStorageError(
                f"{what}: HTTP {status}" + (f"; {_INVALID_CREDENTIALS_HINT}" if status == 401 else ""), key
            )
        )
        return error
    if isinstance(e, auth_exceptions.RefreshError):
        if getattr(e, "retryable", False):
            return TransientStorageError(f"{what}: refreshing credentials failed, retryably", key)
        cause = e.__cause__
        if isinstance(cause, auth_exceptions.TransportError) and len(cause.args) < 2:
            # The token source (the metadata server, for GCE and GKE's workload identity) did not
            # answer, or answered 5xx, through google-auth's own retries; a TransportError with a
            # response (the second argument) is a refusal, such as a 403 or 404 for an identity
            # the metadata server does not serve.
            return TransientStorageError(
                f"{what}: refreshing credentials failed: their token source did not answer ({cause}); on GCE "
                "and GKE that is the metadata server (with workload identity, the node's gke-metadata-server)",
                key,
            )
        return PermanentStorageError(f"{what}: refreshing credentials failed ({e})", key)
    if isinstance(e, _CONNECTION_ERRORS):
        return TransientStorageError(f"{what}: {_connection_failure(e)}", key)
    if isinstance(e, auth_exceptions.GoogleAuthError):
        return PermanentStorageError(f"{what}: {type(e).__name__}: {e}", key)
    if isinstance(e, requests.HTTPError):
        status = int(getattr(e.response, "status_code", 0) or 0)
        if status in _TRANSIENT_STATUS or status >= 500:
            return TransientStorageError(f"{what}: HTTP {status}", key)
        return PermanentStorageError(f"{what}: HTTP {status}", key)
    if isinstance(e, requests.RequestException):
        # What is left is the request itself being wrong (a URL without a scheme, a redirect
        # loop, a bad header): sending it again fails the same way. (ContentDecodingError, a
        # body garbled on the way, is a urllib3 HTTPError: transient, above.)
        return PermanentStorageError(f"{what}: {type(e).__name__}: {e}", key)
    raise e


# GCS's 403 for an object it keeps: "Object 'b/o' is subject to bucket's retention policy and cannot
# be deleted, overwritten or archived until <time>", "... is under active Event-Based hold ...".
_RETAINED = re.compile(r"retention policy|object retention|active (event-based |temporary )?hold", re.IGNORECASE)
_RETAINED_HINT = (
    "the bucket keeps it (a retention policy or an object hold), whatever the credentials: spotjob "
    "cannot delete or replace it until the retention period ends or the hold is released"
)
# GCS's 401 once the client's one refresh and retry did not help.
_INVALID_CREDENTIALS_HINT = (
    "the Google credentials in use are not valid (HTTP 401): expired or revoked, and refreshing them did "
    "not help (a service account key deleted or disabled, a workload identity binding removed). Not a "
    "permission of the bucket: give the process valid credentials (workload identity, "
    "GOOGLE_APPLICATION_CREDENTIALS, gcloud auth application-default login)"
)

# Refusals whose cause is not the credentials' permission on the bucket, by GCS's message.
_ELSEWHERE = (
    (
        re.compile(r"Cloud KMS|cloudkms", re.IGNORECASE),
        "the bucket encrypts with a Cloud KMS key (CMEK) that cannot be used: Cloud Storage's service agent "
        "of the bucket's project (service-<project number>@gs-project-accounts.iam.gserviceaccount.com) needs "
        "roles/cloudkms.cryptoKeyEncrypterDecrypter on the key, and the key must be enabled; the job's own "
        "credentials are not the cause",
    ),
    (
        re.compile(r"serviceusage\.services\.use|required permission to use project", re.IGNORECASE),
        "the credentials carry a quota project (quota_project_id in the application default credentials "
        "file, or GOOGLE_CLOUD_QUOTA_PROJECT) they may not use: grant them "
        "roles/serviceusage.serviceUsageConsumer on that project, or use credentials without one; not a "
        "permission on the bucket",
    ),
    (
        re.compile(r"organization's policy|vpcServiceControls", re.IGNORECASE),
        "a VPC Service Controls perimeter around the bucket's project refuses requests from this network or "
        "identity: the perimeter needs an ingress rule or access level that admits them; not the bucket's IAM",
    ),
    (
        re.compile(
            r"Insufficient Permission|scope\(s\) are not authorized|insufficient authentication scopes", re.IGNORECASE
        ),
        "the access token lacks a Cloud Storage read-write scope: the service account of a GCE VM (or of a GKE "
        "node, for pods without workload identity) is limited by the VM's access scopes, read-only for storage "
        "by default: give the VM or node pool the cloud-platform scope (a VM must be stopped to change it), or "
        "use workload identity; the bucket's IAM is not the cause",
    ),
    (
        re.compile(r"billing account", re.IGNORECASE),
        "the bucket's project has no active billing account (disabled or closed), and Cloud Storage refuses "
        "its requests until billing is enabled again; not a permission of the credentials",
    ),
)


def _refused_elsewhere(detail: str) -> str | None:
    """What to fix for a 403 (or 400) caused by something other than the bucket's IAM, if GCS's
    message says which: the bucket's CMEK key, the credentials' quota project, a VPC Service
    Controls perimeter, a VM's access scopes, the project's billing."""
    for pattern, hint in _ELSEWHERE:
        if pattern.search(detail):
            return hint
    return None


_POOL = re.compile(r"host='([^']+)', port=(\d+)")
_OS_ERROR = re.compile(r"\[Errno -?\d+\] ([^'\")]+)")
_SSL_REASON = re.compile(r"\[SSL[^\]]*\][^'\"]*")


def _connection_failure(e: Exception) -> str:
    """A connection that failed, in one line: the host, why, and where the endpoint comes from —
    not urllib3's pool repr with the request's whole path and query."""
    text = str(e)
    pool, reason = _POOL.search(text), _OS_ERROR.search(text)
    check = "STORAGE_EMULATOR_HOST and the network" if os.environ.get("STORAGE_EMULATOR_HOST") else "the network"
    if isinstance(e, requests.exceptions.SSLError):
        where = f" with {pool.group(1)}:{pool.group(2)}" if pool else ""
        ssl = _SSL_REASON.search(text)
        why = f" ({ssl.group(0).strip()})" if ssl else ""
        return f"SSLError: the TLS handshake{where} failed{why}; check {check}: {TLS_SLIP}"
    timed_out = URLLIB3_TIMEOUT.search(text)
    if pool is not None and timed_out is not None:
        # urllib3 says the seconds but not the setting, in its pool repr with the request's URL.
        seconds = f"{float(timed_out.group(2)):g} s"
        if timed_out.group(1) == "connect":
            return (
                f"cannot connect to {pool.group(1)}:{pool.group(2)} (timed out after {seconds}: "
                f"SPOTJOB_STORAGE_CONNECT_TIMEOUT_S); check {check}"
            )
        return (
            f"no answer from {pool.group(1)}:{pool.group(2)} within {seconds} (SPOTJOB_STORAGE_READ_TIMEOUT_S); "
            f"check {check}"
        )
    if pool is None or reason is None:
        return f"{type(e).__name__}: {text}"
    return f"cannot connect to {pool.group(1)}:{pool.group(2)} ({reason.group(1).strip()}); check {check}"


def _api_error_detail(e: api_exceptions.GoogleAPICallError) -> str:
    """The server's own error message, without the request URL and body the library adds."""
    response = getattr(e, "response", None)
    if response is not None:
        try:
            return str(response.json()["error"]["message"])
        except (ValueError, KeyError, TypeError, AttributeError):
            pass
    for err in e.errors or ():
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
    return str(e.message)[:200]


_TRANSLATED = (
    api_exceptions.GoogleAPICallError,
    gcs_exceptions.InvalidResponse,
    gcs_exceptions.DataCorruption,
    auth_exceptions.GoogleAuthError,
    requests.RequestException,
    urllib3.exceptions.HTTPError,
    ConnectionError,
)


def _shown(value: str) -> str | None:
    """``STORAGE_EMULATOR_HOST``'s value as a message may repeat it: the ``user:secret@`` of an
    emulator behind basic auth masked, as the S3 store masks its endpoint's. The mask finds it after
    a scheme, so a value written without one is masked as the URL it would be. ``None`` (not to be
    repeated at all) where the part before its ``@`` is still there, one the mask could not reach."""
    bare = "://" not in value
    masked = _without_userinfo(f"http://{value}" if bare else value)
    masked = masked.removeprefix("http://") if bare else masked
    userinfo = value.rpartition("@")[0].rpartition("://")[2]
    return None if userinfo and userinfo in masked else masked


def _emulator_host() -> str | None:
    """``STORAGE_EMULATOR_HOST``, which google-cloud-storage uses as the endpoint URL as it is:
    without a scheme every request would fail as a URL with no connection adapter. What it says
    about the value never repeats a ``user:secret@`` in it."""
    host = os.environ.get("STORAGE_EMULATOR_HOST")
    if not host:
        return host
    problem = _emulator_problem(host)
    if problem is not None:
        shown = _shown(host)
        where = (
            f"STORAGE_EMULATOR_HOST={shown!r}"
            if shown is not None
            else "STORAGE_EMULATOR_HOST (not repeated here: it holds a user:secret@)"
        )
        raise ValueError(f"{where} {problem}")
    return host


_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*)://")
_HOST_PORT = re.compile(r"(\[[^\[\]]*\]|[^:\[\]]*)(?::(.*))?", re.DOTALL)
# The end of a path that repeats what the client puts after STORAGE_EMULATOR_HOST itself.
_API_PATH = re.compile(r"(?:/upload|/download)(?:/storage/v1)?$|/storage/v1$")


def _emulator_problem(host: str) -> str | None:
    """What is wrong with ``host`` as ``STORAGE_EMULATOR_HOST`` (said after naming the variable, and
    its advice a URL that works), or ``None``: ``scheme://host[:port]``, or with a path prefix
    before the API's own path, which the client puts after it."""
    shown = _shown(host)
    if any(c.isspace() for c in host):
        stripped = host.strip()
        places = [
            place
            for place, found in (
                ("at its start", host[0].isspace()),
                ("at its end", host[-1].isspace()),
                ("inside it", any(c.isspace() for c in stripped)),
            )
            if found
        ]
        fix = "remove it"
        if stripped and not any(c.isspace() for c in stripped) and _emulator_problem(stripped) is None:
            fix = f"write {_shown(stripped) or 'it without the whitespace'}"
        return f"has whitespace {' and '.join(places)}, which the client would keep in every request's URL: {fix}"
    scheme = _SCHEME.match(host)
    if scheme is None:
        authority = host.removesuffix("/")  # a bare host[:port], written perhaps with a '/'
        problem = "is not host:port" if re.search(r"[/?#]", authority) else _authority_problem(authority)
        if problem is not None:
            return f"is not a URL: it needs a scheme (http:// or https://), and it {problem}"
        example = f"http://{shown.removesuffix('/')}" if shown is not None else "http://host:port"
        return f"needs a scheme: write it as a URL, e.g. {example}"
    if scheme.group(1).lower() not in ("http", "https"):
        return (
            f"has the scheme {scheme.group(1)!r}, not http or https: google-cloud-storage sends its requests "
            "over HTTP, to a URL such as http://127.0.0.1:4443"
        )
    authority = re.split(r"[/?#]", host[scheme.end() :], maxsplit=1)[0]
    problem = _authority_problem(authority)
    if problem is not None:
        return f"{problem}: no request can go to it"
    base = host[: scheme.end() + len(authority)]
    tail = host[len(base) :]
    before_fragment = tail.partition("#")[0]
    path = before_fragment.partition("?")[0]
    # The client puts "/storage/v1/..." (spotjob's transfers "/upload/storage/v1/...",
    # "/download/storage/v1/...") after the value as written, so a path prefix (an emulator behind a
    # gateway, http://gw:8080/gcs) works. A query or a fragment swallows what follows, an empty
    # segment or the API's own path copied into the value doubles it: every request is answered
    # 404, which reads as a bucket that does not exist.
    parts = [part for part, found in (("a query", "?" in before_fragment), ("a fragment", "#" in tail)) if found]
    fixed = path.rstrip("/")
    if "//" in fixed:
        parts.append("an empty path segment ('//')")
        fixed = re.sub(r"/{2,}", "/", fixed)
    api = _API_PATH.search(fixed)
    if api is not None:
        where = "the path" if api.start() == 0 else "a path ending in"
        parts.append(f"{where} {api.group()!r}")
        while api is not None:  # /storage/v1/storage/v1 too
            fixed = fixed[: api.start()]
            api = _API_PATH.search(fixed)
    if parts:
        said = ", ".join(parts[:-1]) + " and " + parts[-1] if len(parts) > 1 else parts[0]
        url = _shown(base + fixed)
        return (
            f"has {said}: the client puts /storage/v1/... after it as written, so every request would be "
            f"answered 404 (as if the bucket did not exist); write {url or 'the URL without it'}"
        )
    if host.endswith("/"):
        # The client puts "/storage/v1/..." after it as written: every request would go to
        # "//storage/v1/...", answered 404, which reads as a bucket that does not exist.
        url = shown.rstrip("/") if shown is not None else None
        return (
            f"ends with '/': requests would go to {url or '...'}//storage/v1/... "
            f"and be answered 404 (as if the bucket did not exist); write {url or 'it without the /'}"
        )
    return None


def _authority_problem(authority: str) -> str | None:
    """What is wrong with a URL's ``[user:secret@]host[:port]``, said as "has ...", or ``None``."""
    match = _HOST_PORT.fullmatch(authority.rpartition("@")[2])
    if match is None:
        return "has no usable host[:port]"
    host, port = match.groups()
    if not host:
        return "has no host"
    if port is None:
        return None
    if not port.isdigit() or not port.isascii():
        return f"has the port {port!r}, which is not a number"
    if not 1 <= int(port) <= 65535:
        return f"has the port {int(port)}, out of range (1-65535)"
    return None


class GCSStorage(PrefixedKeys, Storage):
    """``gs://bucket/prefix``. Thread-safe: one client and one HTTP session per object."""

    def __init__(self, bucket: str, prefix: str, *, settings: TransferSettings | None = None) -> None:
        if not bucket:
            raise ValueError("GCSStorage needs a bucket name")
        self.bucket_name = bucket
        self.prefix = prefix.strip("/")
        self.uri = f"gs://{bucket}/{self.prefix}" if self.prefix else f"gs://{bucket}"
        self.settings = settings or TransferSettings.from_env()
        self._timeout = (self.settings.connect_timeout_s, self.settings.read_timeout_s)

        credentials: Credentials
        session: requests.Session
        project = os.environ.get("GOOGLE_CLOUD_PROJECT") or os.environ.get("GCLOUD_PROJECT")
        if _emulator_host():
            credentials = AnonymousCredentials()
            session = requests.Session()
            project = project or "test"
        else:
            try:
                credentials, adc_project = google.auth.default(scopes=_SCOPES)
            except auth_exceptions.DefaultCredentialsError as e:
                raise PermanentStorageError(
                    f"no Google credentials for {self.uri}: {e} "
                    "(use workload identity, GOOGLE_APPLICATION_CREDENTIALS or gcloud auth application-default login; "
                    "for an emulator such as fake-gcs-server, set STORAGE_EMULATOR_HOST to its URL instead)"
                ) from e
            session = AuthorizedSession(credentials)
            project = project or adc_project
        # requests keeps 10 connections per host by default; pool workers plus the callers'
        # threads would keep opening and discarding connections past that.
        adapter = HTTPAdapter(pool_maxsize=self.settings.concurrency + DEFAULT_PARALLELISM, max_retries=0)
        session.mount("https://", adapter)
        session.mount("http://", adapter)
        self._session = session
        self._client = storage.Client(project=project, credentials=credentials, _http=session)
        # The client fetches each bucket's metadata (for tracing attributes) in a thread of its
        # own, retried by google-api-core with jitter drawn from Python's global ``random``: the
        # training script's stream, shifted at a moment nobody controls. spotjob has no use for
        # it; switched off for this client only (the environment switch would reach the user's).
        if getattr(self._client, "_bucket_metadata_cache", None) is not None:
            self._client._bucket_metadata_cache = None
        try:
            self._bucket = self._client.bucket(bucket)
        except ValueError as e:  # the client's own check of the name; parse_uri refuses such a URI first
            self._client.close()
            raise PermanentStorageError(f"cannot open {self.uri}: the bucket name {bucket!r}: {e}") from e
        self._pool = TransferPool(self.settings.concurrency, "spotjob-gcs")
        self._buffers = ByteBudget(self.settings.max_buffer_bytes)

    # -- plumbing ----------------------------------------------------------------------------
    def _request(self, what: str, key: str | None, fn: Callable[[], T]) -> T:
        """One attempt of one request, with the client's exceptions translated."""
        try:
            return fn()
        except _TRANSLATED as e:
            raise _storage_error(e, what, key) from e

    def _bucket_label(self) -> str:
        return self.bucket_name

    def _bucket_exists(self) -> bool | None:
        try:
            return bool(self._bucket.exists(retry=None, timeout=self._timeout))
        except Exception:  # no permission on the bucket's metadata, unreachable: cannot tell
            return None

    def _writing(self, what: str, key: str | None, fn: Callable[[], T]) -> T:
        """A write or a listing, where a 404 can only mean that the bucket is missing."""
        try:
            return self._retrying(what, key, fn)
        except NotFoundError as e:
            raise self._missing_bucket(what, key) from e

    def _reading(self, what: str, key: str | None, fn: Callable[[], T]) -> T:
        """A read of one object, where a 404 means a missing object or a missing bucket."""
        try:
            return self._retrying(what, key, fn)
        except NotFoundError:
            self._raise_if_bucket_missing(what, key)
            raise

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
        if size < min(self.settings.multipart_threshold, SIMPLE_UPLOAD_MAX + 1):
            self._put_whole(local_path, key, size, crc32c, progress, self.url(key))
            return
        self._put_resumable(local_path, key, size, crc32c, progress)

    def _upload_simple(self, key: str, data: bytes, *, if_generation_match: int | None = None) -> None:
        """One multipart upload request (JSON metadata, then the bytes), built here.

        Not through ``Blob.upload_from_string``: the library draws every request's multipart
        boundary from Python's global ``random`` — the training script's stream, shifted by each
        save from a background thread. The boundary here comes from ``uuid4`` (``os.urandom``).
        The CRC32C goes in the metadata, so GCS rejects bytes damaged on the way, and the CRC32C
        it stored is compared too. Failures raise what the library would (``_TRANSLATED``). The
        body goes out piece by piece (``_Pieces``): ``data`` is never copied into it, so a small file
        sent whole takes the memory its ``ByteBudget`` hold counts, not twice that.
        """
        crc = crc32c_bytes(data)
        metadata = {"name": self._object_key(key), "contentType": _CONTENT_TYPE, "crc32c": crc_to_b64(crc)}
        boundary = uuid.uuid4().hex.encode()
        sep = b"--" + boundary
        body = _Pieces(
            (
                sep,
                b"\r\ncontent-type: application/json; charset=UTF-8\r\n\r\n",
                json.dumps(metadata).encode(),
                b"\r\n",
                sep,
                b"\r\ncontent-type: " + _CONTENT_TYPE.encode() + b"\r\n\r\n",
                data,
                b"\r\n",
                sep,
                b"--",
            )
        )
        params = [("uploadType", "multipart")]
        if if_generation_match is not None:
            params.append(("ifGenerationMatch", str(if_generation_match)))
        resp = self._session.post(
            f"{self._client._connection.API_BASE_URL}/upload/storage/v1{self._bucket.path}/o",
            params=params,
            data=body,
            headers={"Content-Type": f'multipart/related; boundary="{boundary.decode()}"'},
            timeout=self._timeout,
        )
        if resp.status_code != 200:
            raise api_exceptions.from_http_response(resp)
        try:
            stored = resp.json().get("crc32c")
        except (ValueError, AttributeError):
            stored = None
        if stored and crc_from_b64(stored) != crc:
            raise gcs_exceptions.DataCorruption(resp, f"stored with CRC32C {crc_from_b64(stored):08x}, sent {crc:08x}")

    def put_bytes(self, key: str, data: bytes) -> None:
        self._object_key(key)
        self._writing(f"PUT {self.url(key)}", key, lambda: self._upload_simple(key, data))

    def put_bytes_if_absent(self, key: str, data: bytes) -> None:
        """Create-only upload (``ifGenerationMatch=0``), one request (see the module docstring).

        As in ``S3Storage``: after an ambiguous failed attempt, a 412 whose object holds exactly
        ``data`` is our own earlier write, and the call succeeds.
        """
        self._object_key(key)
        what = f"PUT (create-only) {self.url(key)}"
        ambiguous = False

        def attempt() -> None:
            nonlocal ambiguous
            try:
                self._upload_simple(key, data, if_generation_match=0)
            except api_exceptions.PreconditionFailed:
                if ambiguous and self._holds(key, data):
                    log.info("%s: an earlier attempt had already created it; done", what)
                    return
                raise AlreadyExistsError(f"{self.url(key)} already exists; refusing to overwrite it", key) from None
            except _TRANSLATED as e:
                err = _storage_error(e, what, key)
                ambiguous = ambiguous or isinstance(err, TransientStorageError)
                if isinstance(err, NotFoundError):
                    raise self._missing_bucket(what, key) from e
                raise err from e

        retry_transient(what, attempt)

    def _put_resumable(
        self, local_path: str, key: str, size: int, crc32c: int | None, progress: ProgressFn | None
    ) -> None:
        """The file through resumable upload sessions: a session GCS has lost (404 or 410 on a
        chunk: the session expired, or GCS ended it after a failure of its own) cannot be resumed,
        only started again, which is done up to ``max_attempts()`` sessions in all."""
        reported = 0  # bytes given to ``progress`` so far, over every session

        def report(upto: int) -> None:
            nonlocal reported
            if progress and upto > reported:
                progress(upto - reported)
            reported = max(reported, upto)

        lost_sessions = 0
        while True:
            try:
                self._put_session(local_path, key, size, crc32c, report)
                return
            except _SessionLost as lost:
                lost_sessions += 1
                if lost_sessions >= max_attempts():
                    raise TransientStorageError(
                        f"{lost}; GCS ended {lost_sessions} upload sessions of {self.url(key)} in a row", key
                    ) from None
                log.warning("%s; starting the upload of %s again in a new session", lost, self.url(key))

    def _put_session(
        self, local_path: str, key: str, size: int, crc32c: int | None, report: Callable[[int], None]
    ) -> None:
        url = self.url(key)
        name = self._object_key(key)
        chunk = -(-self.settings.upload_chunk_size // CHUNK_GRANULARITY) * CHUNK_GRANULARITY
        session_url: str = self._writing(
            f"start resumable upload {url}",
            key,
            lambda: self._bucket.blob(name).create_resumable_upload_session(
                content_type=_CONTENT_TYPE, size=size, checksum=None, retry=None, timeout=self._timeout
            ),
        )
        upload = _ResumableUpload(self, session_url, url, key, size)
        crc = 0  # CRC32C of the file's first crc_end bytes
        crc_end = 0
        stalls = 0  # chunks in a row the server answered without keeping a byte more
        reading = f"cannot read the local file {local_path} (uploading to {url})"
        with local_file(reading, key), open(local_path, "rb") as f:
            while upload.confirmed < size:
                offset = upload.confirmed
                length = min(chunk, size - offset)
                # The chunk is read once the store's budget holds its bytes, given back once sent.
                with self._buffers.hold(length):
                    with local_file(reading, key):
                        data = read_at(f.fileno(), length, offset)
                    if not data:
                        raise PermanentStorageError(f"{local_path} shrank while being uploaded to {url}", key)
                    if offset + len(data) > crc_end:
                        crc = crc32c_bytes(data[crc_end - offset :], crc)
                        crc_end = offset + len(data)
                    last = offset + len(data) == size
                    if last:
                        check_local_crc(url, key, local_path, crc, crc32c)
                    before = upload.confirmed
                    sent = len(data)
                    retry_transient(
                        f"PUT {url} bytes {offset}-{offset + sent - 1}/{size}",
                        functools.partial(upload.send, offset, data, crc if last else None),
                    )
                    del data  # not held past the budget's hold while the next chunk is read
                if upload.confirmed > before:
                    stalls = 0
                    report(upload.confirmed)
                    continue
                # A 308 that confirms nothing new is an answered request, so retry_transient never
                # counts it; without this bound such a server would have the chunk resent forever.
                stalls += 1
                if stalls >= max_attempts():
                    raise TransientStorageError(
                        f"PUT {url}: the server kept none of the bytes {offset}-{offset + sent - 1}/{size} "
                        f"in {stalls} attempts",
                        key,
                    )

    # -- reads -------------------------------------------------------------------------------
    def get_bytes(self, key: str) -> bytes:
        name = self._object_key(key)

        def read() -> bytes:
            data: bytes = self._bucket.blob(name).download_as_bytes(
                checksum="crc32c", retry=None, timeout=self._timeout
            )
            return data

        return self._reading(f"GET {self.url(key)}", key, read)

    def _media_url(self, key: str) -> str:
        """The object's media URL as google-cloud-storage builds it (blob.py, _DOWNLOAD_URL_TEMPLATE),
        to be sent with ``alt=media``."""
        path = self._bucket.blob(self._object_key(key)).path
        return f"{self._client._connection.API_BASE_URL}/download/storage/v1{path}"

    def get_small(self, key: str, max_bytes: int) -> tuple[bytes, ObjectInfo]:
        """One media GET, where the object's metadata GET and a media GET went before, on the
        client's own authorized session (as ``_get_media``): ``Content-Length`` is checked against
        ``max_bytes`` before a byte of the body is read, no more than ``max_bytes + 1`` bytes are
        read whatever it says, and the bytes are checked against the CRC32C of ``x-goog-hash`` when
        they are the stored ones (what ``download_as_bytes(checksum="crc32c")`` checked). The time
        is the answer's ``Last-Modified``: the metadata's ``updated``, to the second. A 404 is a
        missing object or bucket, told apart as after the metadata GET (once per store: not after an
        object was read)."""
        url = self.url(key)
        what = f"GET {url}"
        media = self._media_url(key)

        def read() -> tuple[bytes, ObjectInfo]:
            resp = self._session.get(
                media, params={"alt": "media"}, headers={"Accept-Encoding": "gzip"}, stream=True, timeout=self._timeout
            )
            with resp:
                if resp.status_code != 200:
                    raise api_exceptions.from_http_response(resp)
                encoded = resp.headers.get("Content-Encoding", "identity").strip().lower() not in ("", "identity")
                length = resp.headers.get("Content-Length", "").strip()
                size = int(length) if length.isdigit() and not encoded else None
                if size is not None and size > max_bytes:
                    raise TooLargeError(f"{url} is {size} bytes, more than {max_bytes}", key, size)
                # Decoded as the library does (an object stored gzip-encoded is read as its content).
                data = resp.raw.read(max_bytes + 1, decode_content=True)
            small_body(url, what, key, data, size, max_bytes)
            said = _answer_crc32c(resp)
            if said is not None and not encoded and said != (got := crc32c_bytes(data)):
                raise StoredChecksumMismatch(
                    f"{what}: x-goog-hash says the object's CRC32C is {said:08x}, the bytes read have {got:08x}: "
                    "damaged on the way (or where they are kept)",
                    key,
                    said,
                    got,
                )
            return data, ObjectInfo(key, len(data), _answer_time(resp))

        return self._read_small(what, url, key, read)

    def _get_blob(self, key: str) -> Any:
        name = self._object_key(key)
        what = f"HEAD {self.url(key)}"
        blob = self._reading(what, key, lambda: self._bucket.get_blob(name, retry=None, timeout=self._timeout))
        if blob is None:  # the library answers a 404 with None: no object, or no bucket
            self._raise_if_bucket_missing(what, key)
        return blob

    def get_file(
        self,
        key: str,
        local_path: str,
        *,
        size: int | None = None,
        crc32c: int | None = None,
        progress: ProgressFn | None = None,
    ) -> None:
        url = self.url(key)
        # A file of known size starts with its first part's ranged GET and no metadata GET: the
        # answer says the object's size, checked before a byte is kept, and its generation, which
        # the other parts are pinned to (one GET cannot mix two generations of the object). An
        # answer that does not say what is needed falls back to the metadata GET first.
        if size is not None and size > 0:
            try:
                self._get_media(key, local_path, size, crc32c, progress)
                return
            except _NotSaid as e:
                log.info("%s; reading its size and generation first", e)
            except _FirstMissing:
                self._raise_if_bucket_missing(f"GET {url}", key)
                raise NotFoundError(f"{url} does not exist", key) from None
        blob = self._get_blob(key)
        if blob is None:
            raise NotFoundError(f"{url} does not exist", key)
        actual = int(blob.size or 0)
        check_size(url, key, actual, size)
        self._download(url, key, actual, local_path, crc32c, self._pinned(url, key, blob.generation), progress)

    def _pinned(self, url: str, key: str, generation: int | None) -> FetchRange:
        """Ranges of this generation only: a replaced object fails instead of mixing versions."""
        pinned = self._bucket.blob(self._object_key(key), generation=generation)

        def fetch(offset: int, length: int, sink: RangeSink) -> None:
            try:
                self._request(
                    f"GET {url}",
                    key,
                    lambda: pinned.download_to_file(
                        sink,
                        start=offset,
                        end=offset + length - 1,
                        raw_download=True,
                        checksum=None,  # a range has no server checksum; we CRC every byte ourselves
                        retry=None,
                        timeout=self._timeout,
                    ),
                )
            except NotFoundError:
                gone = f"GET {url}: generation {generation} of the object is gone (replaced or deleted while read)"
                raise NotFoundError(gone, key) from None

        return fetch

    def _download(
        self,
        url: str,
        key: str,
        size: int,
        local_path: str,
        crc32c: int | None,
        fetch: FetchRange,
        progress: ProgressFn | None,
        first: threading.Event | None = None,
    ) -> None:
        """``size`` bytes of ``key`` into ``local_path`` in parts of ``fetch``, checked as they come."""
        download_verified(
            what=url,
            key=key,
            size=size,
            local_path=local_path,
            crc32c=crc32c,
            part_size=self.settings.part_size,
            pool=self._pool,
            fetch=fetch,
            progress=progress,
            first=first,
        )

    def _get_media(self, key: str, local_path: str, size: int, crc32c: int | None, progress: ProgressFn | None) -> None:
        """The ``size``-byte file, its first part's ranged media GET on the client's own authorized
        session first: a file of one part is that one request, a file of N parts N requests.

        Not through ``Blob.download_to_file``: it keeps of the answer only what
        ``Blob._extract_headers_from_download`` copies into the blob (generation, hashes, content
        type), not its ``Content-Range``, so the object's size would stay unknown; the library's
        ``RawDownload.consume`` (in the private ``google.cloud.storage._media``) returns the answer,
        but only once it has streamed the body. Here the size is read from the answer's headers
        before a byte of the body is: ``Content-Range`` of a 206 (which HTTP requires there; the
        library's own ``ChunkedDownload._process_response`` reads GCS's total size from it, and
        fake-gcs-server sends it), ``Content-Length`` of a 200 (a server that ignored the
        range sends the whole object), ``Content-Range: bytes */N`` or else 0 for a 416 (a range
        from byte 0 is unsatisfiable only on an empty object). ``Accept-Encoding: gzip``, as the
        library sends, has GCS serve the stored bytes as they are (no decompressive transcoding),
        whose CRC32C ``download_verified`` checks against the caller's.

        A file of several parts also takes the object's generation from that answer's
        ``x-goog-generation`` header (which GCS sends on every media download, fake-gcs-server too,
        and the library reads into ``Blob.generation``); the other parts are sent once it is read
        (``TransferPool.map``), and they and a retry of the first read that generation only
        (``_pinned``), so a replaced object fails instead of mixing versions, as after a metadata
        GET. ``_NotSaid`` when the answer lacks the size or,
        for several parts, the generation.
        """
        url = self.url(key)
        media = self._media_url(key)
        first = threading.Event() if size > self.settings.part_size else None
        pinned: list[FetchRange] = []  # the other parts' fetch, once the first answer is read

        def read_first(offset: int, length: int, sink: RangeSink) -> None:
            resp = self._session.get(
                media,
                params={"alt": "media"},
                headers={"Range": f"bytes={offset}-{offset + length - 1}", "Accept-Encoding": "gzip"},
                stream=True,
                timeout=self._timeout,
            )
            with resp:
                if resp.status_code == 404:
                    raise _FirstMissing(f"GET {url}: no such object", key)
                if resp.status_code not in (200, 206, 416):
                    raise api_exceptions.from_http_response(resp)
                start, total = _answer_span(resp)
                if total is None:
                    said = f"the answer (HTTP {resp.status_code}) does not say the object's size"
                    raise _NotSaid(f"GET {url}: {said}", key)
                check_size(url, key, total, size)
                if resp.status_code == 416 or start != offset:
                    raise PermanentStorageError(
                        f"GET {url}: asked for bytes {offset}-{offset + length - 1}, answered HTTP "
                        f"{resp.status_code} from byte {start}",
                        key,
                    )
                if first is not None:
                    generation = _answer_generation(resp)
                    if generation is None:
                        raise _NotSaid(f"GET {url}: the answer does not say the object's generation", key)
                    pinned.append(self._pinned(url, key, generation))
                    first.set()
                for chunk in resp.raw.stream(_READ_CHUNK, decode_content=False):
                    sink.write(chunk)

        def fetch(offset: int, length: int, sink: RangeSink) -> None:
            if pinned:
                pinned[0](offset, length, sink)
            else:
                self._request(f"GET {url}", key, lambda: read_first(offset, length, sink))

        self._download(url, key, size, local_path, crc32c, fetch, progress, first)

    def stat(self, key: str) -> ObjectInfo | None:
        blob = self._get_blob(key)
        return None if blob is None else ObjectInfo(key, int(blob.size or 0), store_time(blob.updated))

    def _pages(
        self, prefix: str, delimiter: str | None
    ) -> Iterator[tuple[builtins.list[tuple[str, int, float | None]], builtins.list[str]]]:
        """Listing pages, each fetched (and retried) on its own: (objects, sub-prefixes)."""
        what = f"LIST gs://{self.bucket_name}/{prefix}"
        token: str | None = None
        while True:

            def fetch(page_token: str | None = token) -> tuple[Any, Any, str | None]:
                it = self._client.list_blobs(
                    self._bucket,
                    prefix=prefix or None,
                    delimiter=delimiter,
                    page_token=page_token,
                    page_size=LIST_PAGE_SIZE,
                    retry=None,
                    timeout=self._timeout,
                )
                page = next(it.pages, None)
                if page is None:
                    return [], [], None
                items = [(b.name, int(b.size or 0), store_time(b.updated)) for b in page]
                return items, list(getattr(page, "prefixes", ())), it.next_page_token

            items, prefixes, token = self._writing(what, None, fetch)
            yield items, prefixes
            if not token:
                return

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        for items, _ in self._pages(self._list_prefix(prefix), None):
            for name, size, modified in items:
                yield ObjectInfo(self._relative(name), size, modified)

    def list_dirs(self, prefix: str = "") -> builtins.list[str]:
        if prefix and not prefix.endswith("/"):
            prefix += "/"  # as FileStorage does: "step-1" names the folder step-1/
        full = self._list_prefix(prefix)
        names: set[str] = set()
        for _, prefixes in self._pages(full, "/"):
            for p in prefixes:
                name = p[len(full) :].rstrip("/")
                if name:
                    names.add(name)
        return sorted(names)

    # -- deletes -----------------------------------------------------------------------------
    def delete(self, keys: Iterable[str]) -> None:
        names = [(k, self._object_key(k)) for k in keys]

        def delete_one(key: str, name: str) -> None:
            try:
                self._reading(
                    f"DELETE {self.url(key)}",
                    key,
                    lambda: self._bucket.blob(name).delete(retry=None, timeout=self._timeout),
                )
            except NotFoundError:
                pass  # deleting a missing key is done

        self._pool.map(delete_one, names)

    def close(self) -> None:
        self._pool.close()
        self._client.close()


class _Pieces:
    """A request body of several byte strings, sent one after another and never joined into one
    copy. Its length makes requests send a ``Content-Length`` (not a chunked body); it can be sent
    again (``AuthorizedSession`` resends a request once after refreshing its token)."""

    def __init__(self, pieces: tuple[bytes, ...]) -> None:
        self._pieces = pieces

    def __len__(self) -> int:
        return sum(len(p) for p in self._pieces)

    def __iter__(self) -> Iterator[bytes]:
        return iter(self._pieces)


class _NotSaid(PermanentStorageError):
    """A first media GET's answer that does not say the object's size (or, for a file of several
    parts, its generation): ``get_file`` falls back to reading them first."""


class _FirstMissing(NotFoundError):
    """The first media GET of a file found no object (or no bucket): ``get_file`` tells which."""


class _SessionLost(PermanentStorageError):
    """GCS no longer knows the resumable upload session (404 or 410 on a chunk): resending the
    chunk cannot help, a new session can (``GCSStorage._put_resumable``)."""


class _ResumableUpload:
    """The client side of one GCS resumable upload session: which bytes the server confirmed.

    ``send`` is one attempt at one chunk; it raises ``TransientStorageError`` for what a resend
    can fix. Messages name the object, never the session URL.
    """

    def __init__(self, storage: GCSStorage, session_url: str, url: str, key: str, size: int) -> None:
        self._storage = storage
        self._session_url = session_url
        self._url = url
        self._key = key
        self.size = size
        self.confirmed = 0
        self._ambiguous = False

    def send(self, offset: int, data: bytes, final_crc: int | None) -> None:
        what = f"PUT {self._url} bytes {offset}-{offset + len(data) - 1}/{self.size}"
        headers = {"Content-Range": f"bytes {offset}-{offset + len(data) - 1}/{self.size}"}
        if final_crc is not None:
            headers["x-goog-hash"] = f"crc32c={crc_to_b64(final_crc)}"
        try:
            resp = self._storage._session.put(
                self._session_url, data=data, headers=headers, timeout=self._storage._timeout
            )
        except (requests.RequestException, urllib3.exceptions.HTTPError, auth_exceptions.TransportError) as e:
            self._ambiguous = True
            # str(e) would carry the session URL, a bearer capability: only the host and the reason
            # of a connection that could not be made ("cannot connect to ..."), else the type.
            said = _connection_failure(e)
            said = said if said.startswith("cannot connect to ") else type(e).__name__
            raise TransientStorageError(f"{what}: {said}", self._key) from None
        status = resp.status_code
        if status == 308:
            rng = resp.headers.get("Range")  # "bytes=0-N": everything up to N is persisted
            self.confirmed = int(rng.rsplit("-", 1)[1]) + 1 if rng else 0
            return
        if status in (200, 201):
            self._finished(resp.json() if resp.content else {}, final_crc)
            return
        if status in _TRANSIENT_STATUS or status >= 500:
            self._ambiguous = True
            raise TransientStorageError(f"{what}: HTTP {status}", self._key)
        if status in (404, 410) and final_crc is not None and self._ambiguous:
            # The session is gone; if that is because our last chunk completed it and only the
            # answer was lost, the object is there with our CRC32C.
            blob = self._storage._get_blob(self._key)
            if blob is not None and blob.crc32c and crc_from_b64(blob.crc32c) == final_crc:
                log.info("%s: an earlier attempt had already completed the upload; done", what)
                self.confirmed = self.size
                return
        if status in (404, 410):
            raise _SessionLost(f"{what}: HTTP {status}: the upload session is gone", self._key)
        # As any other refused request says it (permission denied, credentials not valid, the
        # bucket keeps it, ...). Not ``from_http_response``: its message has the session URL.
        refused = api_exceptions.from_http_status(status, resp.reason or f"HTTP {status}", response=resp)
        raise _storage_error(refused, what, self._key) from None

    def _finished(self, meta: dict[str, Any], final_crc: int | None) -> None:
        if final_crc is None:
            raise PermanentStorageError(f"{self._url}: the server finished the upload before its last chunk", self._key)
        stored = meta.get("crc32c")
        if stored and crc_from_b64(stored) != final_crc:
            raise CorruptObjectError(
                f"{self._url} was stored with CRC32C {crc_from_b64(stored):08x}, the file has {final_crc:08x}",
                self._key,
            )
        if "size" in meta and int(meta["size"]) != self.size:
            raise CorruptObjectError(f"{self._url} was stored with {meta['size']} bytes, not {self.size}", self._key)
        self.confirmed = self.size
