"""How S3's answers become spotjob's storage errors (``_storage_error``): which to retry, which to
refuse, and what the message tells the user to do (credentials, endpoints, Object Lock, archived
objects, checksum headers a store does not take). The store itself is ``agent.storage.s3``.
"""

from __future__ import annotations

import os
import re
from typing import Any

from botocore.exceptions import (
    ClientError,
    ConnectTimeoutError,
    EndpointConnectionError,
    FlexibleChecksumError,
    HTTPClientError,
    IncompleteReadError,
    NoCredentialsError,
    ParamValidationError,
    PartialCredentialsError,
    ProfileNotFound,
    ReadTimeoutError,
    SSLError,
)
from botocore.exceptions import ConnectionError as BotoConnectionError

from agent.storage._errors import TLS_SLIP, URLLIB3_TIMEOUT
from agent.storage.base import (
    ArchivedError,
    MissingBucketError,
    NotFoundError,
    PermanentStorageError,
    RetainedError,
    StorageError,
    TransientStorageError,
)

# Error codes that mean "try again": throttling, timeouts, server trouble. 409
# ConditionalRequestConflict means a concurrent conditional write was in flight; AWS's advice is to
# retry, and the retry then answers 412 (the other writer won) or succeeds.
_TRANSIENT_CODES = frozenset(
    {
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "RequestThrottled",
        "TooManyRequestsException",
        "RequestLimitExceeded",
        "BandwidthLimitExceeded",
        "RequestTimeout",
        "RequestTimeoutException",
        "PriorRequestNotComplete",
        "InternalError",
        "ServiceUnavailable",
        "OperationAborted",
        "ConditionalRequestConflict",
    }
)
_TRANSIENT_STATUS = frozenset({408, 429, 500, 502, 503, 504})
_DENIED_CODES = frozenset({"AccessDenied", "AllAccessDisabled", "InvalidAccessKeyId", "SignatureDoesNotMatch"})

# Keys the store does not take at all: no permission or bucket policy is the cause, and "lack the
# permission" would send the user to IAM instead of to the keys.
_WRONG_KEYS = {
    "InvalidAccessKeyId": (
        "the store knows no such access key id: the keys in use are wrong for this endpoint or account (a typo, "
        "a deleted key, another store's keys), not short of a permission; give the process the right ones"
    ),
    "SignatureDoesNotMatch": (
        "the secret access key does not match the access key id (a typo, a rotated secret; or a proxy that "
        "changed the request), not a permission of the bucket; give the process the right secret"
    ),
}

_BUCKET_IN_MESSAGE = re.compile(r'Invalid bucket name "([^"]*)"')

_EXPIRED_CODES = frozenset({"ExpiredToken", "ExpiredTokenException", "TokenRefreshRequired"})
"""S3's (and STS-aware stores') answer to a request signed with temporary credentials past their end."""


class _NoSuchBucket(MissingBucketError):
    """S3 said NoSuchBucket; the store replaces it with a ``MissingBucketError`` naming the bucket."""

    def __init__(self, what: str, key: str | None) -> None:
        super().__init__(f"{what}: the bucket does not exist", key)
        self.what = what


def _status_and_code(e: ClientError) -> tuple[int, str]:
    status = int(e.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)
    code = str(e.response.get("Error", {}).get("Code") or status)
    return status, code


# S3's (and MinIO's) refusal to delete or replace a version Object Lock keeps: "Access Denied because
# object protected by object lock." A delete without a version id is never refused (it adds a
# delete marker); this is for stores that refuse it anyway and for per-key DeleteObjects errors.
_OBJECT_LOCK = re.compile(r"object lock|retention|legal hold", re.IGNORECASE)
_OBJECT_LOCK_HINT = (
    "the bucket keeps it (Object Lock retention or a legal hold), whatever the credentials: spotjob "
    "cannot delete it until the retention period ends or the hold is released"
)
_ARCHIVED_HINT = (
    "the object is archived (its storage class is S3 Glacier Flexible Retrieval or Deep Archive, or an "
    "Intelligent-Tiering archive tier; a bucket lifecycle rule usually moved it there), not refused for "
    "want of a permission: it is listed and can be deleted, but not read until it is restored "
    "(`aws s3api restore-object`, or S3 Batch Operations for many objects) or copied back to a readable "
    "storage class. Keep checkpoint prefixes out of lifecycle transitions to those classes"
)
_CHECKSUM_HEADERS_HINT = (
    "this S3-compatible store does not accept the CRC32C checksum headers spotjob sends so that the "
    "store checks each upload; set SPOTJOB_STORAGE_S3_CHECKSUM_HEADERS=0 to send none (spotjob still "
    "checks every file against the manifest's CRC32C when it reads it back)"
)


def _not_implemented_hint(header: object) -> str:
    """What a 501 ``NotImplemented`` means: the store lacks what the request asks for (S3 names the
    header in the error's ``Header`` field), for good; retrying, or restarting the job, cannot help."""
    named = f" (the header {header})" if isinstance(header, str) and header else ""
    return f"the store does not implement what this request asks of it{named}; retrying cannot help"


def _refuses_checksum_headers(status: int, code: str, message: str) -> bool:
    """A store's "I do not support this" about the ``x-amz-checksum-*`` headers or a checksum
    type (Backblaze B2: 400 InvalidArgument "Unsupported header 'x-amz-checksum-crc32c'"; others
    answer 501 NotImplemented or 400 InvalidRequest about the checksum algorithm or type)."""
    if status not in (400, 501) or code in _CHECKSUM_MISMATCH_CODES:
        return False
    return "checksum" in message.lower()


def _skew_hint(error: dict[str, Any]) -> str:
    """What S3's ``RequestTimeTooSkewed`` means, with the two times it gives when it gives them."""
    times = ""
    if error.get("RequestTime") and error.get("ServerTime"):
        times = f" (this node sent {error['RequestTime']}, the store's time was {error['ServerTime']})"
    return (
        f"this node's clock is more than 15 minutes away from the store's{times}; the credentials are not "
        "the problem: set the node's time right (chrony or timedatectl, the cloud's time service)"
    )


def _expired_hint(source: str | None) -> str:
    """What to do about temporary credentials that ran out; ``source`` is botocore's name for where
    they came from (``env``, ``shared-credentials-file``, ``assume-role-with-web-identity``...)."""
    came = f" (botocore read them from {source!r})" if source else ""
    return (
        f"temporary AWS credentials have expired{came}. Keys given as fixed values (AWS_ACCESS_KEY_ID, "
        "AWS_SECRET_ACCESS_KEY and AWS_SESSION_TOKEN in the environment or a credentials file) are never "
        "renewed: a job that runs longer than they last fails every save once they end. Give the job a "
        "source that boto3 renews itself: IRSA / pod identity, an instance profile, or a profile with "
        "role_arn, credential_process or SSO"
    )


def _storage_error(
    e: Exception, what: str, key: str | None, source: str | None = None, temporary: bool = False
) -> StorageError:
    """Translate a boto3 exception into the StorageError that says whether to retry. ``source``:
    where the client's credentials came from (botocore's name), for the message of expired ones;
    ``temporary``: whether they carry a session token (only such credentials expire)."""
    if isinstance(e, ClientError):
        status, code = _status_and_code(e)
        message = e.response.get("Error", {}).get("Message") or ""
        text = f"{what}: {code} (HTTP {status}){': ' + message if message else ''}"
        if _refuses_checksum_headers(status, code, message):
            return PermanentStorageError(f"{text}; {_CHECKSUM_HEADERS_HINT}", key)
        if code in _EXPIRED_CODES:
            return PermanentStorageError(f"{text}; {_expired_hint(source)}", key)
        if code == "400" and what.startswith("HEAD ") and temporary:
            # A HEAD's answer has no body, so no code: expired temporary credentials look the same.
            return PermanentStorageError(
                f"{text}; a HEAD's 400 says no reason, and one cause is that the {_expired_hint(source)}",
                key,
            )
        if status == 501 or code == "NotImplemented":
            hint = _not_implemented_hint(e.response.get("Error", {}).get("Header"))
            return PermanentStorageError(f"{text}; {hint}", key)
        if code in _DAMAGED_ON_THE_WAY_CODES:
            return TransientStorageError(f"{text}; {_DAMAGED_ON_THE_WAY_HINT}", key)
        if code in _TRANSIENT_CODES or status in _TRANSIENT_STATUS or status >= 500:
            return TransientStorageError(text, key)
        if code == "NoSuchBucket":
            return _NoSuchBucket(what, key)
        if status == 404 or code in ("NoSuchKey", "NotFound"):
            return NotFoundError(f"{what}: no such object", key)
        if code == "RequestTimeTooSkewed":
            return PermanentStorageError(f"{text}; {_skew_hint(e.response.get('Error', {}))}", key)
        if code == "InvalidObjectState":
            return ArchivedError(f"{text}; {_ARCHIVED_HINT}", key)
        if (status == 403 or code == "AccessDenied") and _OBJECT_LOCK.search(message):
            return RetainedError(f"{text}; {_OBJECT_LOCK_HINT}", key)
        if code in _WRONG_KEYS:
            return PermanentStorageError(f"invalid AWS credentials: {text}; {_WRONG_KEYS[code]}", key)
        if status == 403 or code in _DENIED_CODES:
            # A HEAD's answer has no body, so no code: a refused signature time looks the same.
            bodiless = " A HEAD's 403 says no reason: a node clock 15 minutes off gets it too." if code == "403" else ""
            return PermanentStorageError(
                f"permission denied: {text}; the AWS credentials in use (role, profile or keys) lack the "
                "permission, or a bucket policy refuses it (or the bucket is Requester Pays, which spotjob "
                f"does not support).{bodiless}",
                key,
            )
        return PermanentStorageError(text, key)
    if isinstance(e, NoCredentialsError | PartialCredentialsError):
        # botocore's text for partial keys names the variable missing, never a value.
        said = str(e) if isinstance(e, PartialCredentialsError) else _half_a_pair() or type(e).__name__
        return PermanentStorageError(
            f"{what}: no usable AWS credentials ({said}); give the process some: "
            "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, AWS_PROFILE, or a role (IRSA / pod identity, "
            "an instance profile)",
            key,
        )
    if isinstance(e, ParamValidationError) and "Invalid bucket name" in str(e):
        # botocore's own check, before any request; its text is two regular expressions long.
        named = _BUCKET_IN_MESSAGE.search(str(e))
        bucket = f" {named.group(1)!r}" if named else ""
        return PermanentStorageError(
            f"{what}: the bucket name{bucket} is not one S3's client can send: a bucket name is letters, digits, "
            "'.', '-' and '_' (AWS's own buckets: 3 to 63 lowercase letters, digits, '.' and '-'), with no space; "
            "correct the bucket in the checkpoint URI (s3://BUCKET/prefix)",
            key,
        )
    if isinstance(e, ProfileNotFound):
        return PermanentStorageError(
            f"{what}: {e}: AWS_PROFILE (or AWS_DEFAULT_PROFILE) names a profile that neither the AWS config file "
            "(AWS_CONFIG_FILE, ~/.aws/config) nor the credentials file (AWS_SHARED_CREDENTIALS_FILE, "
            "~/.aws/credentials) holds; add it there, or unset the variable",
            key,
        )
    if isinstance(e, ConnectTimeoutError):
        return _timed_out(e, what, key, "timed out after", "SPOTJOB_STORAGE_CONNECT_TIMEOUT_S")
    if isinstance(e, EndpointConnectionError):
        return TransientStorageError(f"{what}: {_without_userinfo(str(e))}; check {_endpoint_source()}", key)
    if isinstance(e, SSLError):
        return TransientStorageError(f"{what}: {_without_userinfo(str(e))}; {_tls_hint(_endpoint_source())}", key)
    if isinstance(e, FlexibleChecksumError):
        # botocore's own check of an answer's body against the checksum the store sent with it
        # (a GET with ChecksumMode=ENABLED): the bytes were damaged on the way, as GCS's DataCorruption.
        return TransientStorageError(f"{what}: {e}", key)
    if isinstance(e, ReadTimeoutError):
        return _timed_out(e, what, key, "no answer within", "SPOTJOB_STORAGE_READ_TIMEOUT_S")
    if isinstance(e, HTTPClientError | BotoConnectionError | IncompleteReadError):
        return TransientStorageError(f"{what}: {_without_userinfo(str(e))}", key)
    return PermanentStorageError(f"{what}: {type(e).__name__}: {_without_userinfo(str(e))}", key)


def _half_a_pair() -> str | None:
    """What botocore does not say: the environment's secret key without its key id (botocore then
    skips the environment and reports no credentials at all, while a key id without its secret is
    a PartialCredentialsError naming the secret). Said as botocore says the other half; no value."""
    if os.environ.get("AWS_SECRET_ACCESS_KEY") and not os.environ.get("AWS_ACCESS_KEY_ID"):
        return "Partial credentials found in env, missing: AWS_ACCESS_KEY_ID"
    return None


def _timed_out(e: Exception, what: str, key: str | None, words: str, setting: str) -> StorageError:
    """A connect or read timeout, naming the seconds waited and the setting: botocore names the
    URL, not the wait (urllib3's error under it says the seconds)."""
    seconds = URLLIB3_TIMEOUT.search(str(getattr(e, "kwargs", {}).get("error", "")))
    waited = f"{words} {float(seconds.group(2)):g} s " if seconds else f"{words.rsplit(' ', 1)[0]} "
    return TransientStorageError(
        f"{what}: {_without_userinfo(str(e))}: {waited}({setting}); check {_endpoint_source()}", key
    )


def _tls_hint(check: str) -> str:
    """What to check when the TLS handshake with the store failed (``check``: where the endpoint
    comes from): an ``http://`` server written ``https://`` is the usual slip."""
    return f"the TLS handshake failed: check {check}: {TLS_SLIP}"


def _endpoint_variable() -> str | None:
    """The environment variable the S3 client takes its endpoint from (``AWS_ENDPOINT_URL_S3`` before
    ``AWS_ENDPOINT_URL``, as botocore reads them), or None when neither is set."""
    return next((v for v in ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL") if os.environ.get(v)), None)


def _endpoint_source() -> str:
    """Where a store that cannot be reached got its endpoint from, for the user to check."""
    named = _endpoint_variable()
    if named:
        return f"{named} (the endpoint comes from it) and the network"
    return "the network, and the endpoint (AWS's own unless the profile's endpoint_url names another)"


# What an XML 1.0 body cannot carry as written: characters outside XML's set (most controls,
# U+FFFE/FFFF, lone surrogates) and CR, which an XML parser reads as LF: another key.

# A URL's user information: everything after ``://`` up to the LAST ``@`` before the next ``/``,
# ``?``, ``#``, whitespace or the end, as urllib finds the host (``rpartition("@")``). A userinfo may
# hold any of RFC 3986's sub-delims, a quote ``'`` among them, ':' and %-escapes, and a password
# written with a raw ``@``; what cannot be inside it (``/ ? #``, whitespace) ends it. A quote is no
# end: a password ``PW'x`` left its tail unmasked, while the quote that closes a quoted URL comes
# after its host, so the match still stops at that URL's own ``@``; and a second URL's ``//`` ends it.
_USERINFO = re.compile(r"(?<=://)[^/?#\s]+@")


def _without_userinfo(text: str) -> str:
    """``text`` with the ``user:secret@`` of any URL in it masked: botocore's connection errors
    repeat the endpoint URL whole, and an endpoint behind basic auth carries its password there,
    whatever characters it holds (``_USERINFO``)."""
    return _USERINFO.sub("***@", text)


# Answers that say the checksum itself was wrong: the bytes were damaged, the headers were understood.
_CHECKSUM_MISMATCH_CODES = frozenset({"BadDigest", "InvalidDigest", "XAmzContentChecksumMismatch"})

# Of those, the ones that say what arrived differs from the checksum sent with it (Content-MD5 or
# x-amz-checksum-*): the bytes were damaged on the way, and sending them again can succeed, as GCS's
# DataCorruption is retried. InvalidDigest (a Content-MD5 that is not an MD5 at all) is the request's
# own fault and stays permanent. A CompleteMultipartUpload's mismatch of its whole-object checksum is
# told apart before this (``S3Storage._refuses_full_object_checksum``: a store with composite-only
# checksums); a store that always disagrees fails after the bounded retries, as for any 5xx.
_DAMAGED_ON_THE_WAY_CODES = frozenset({"BadDigest", "XAmzContentChecksumMismatch"})
_DAMAGED_ON_THE_WAY_HINT = (
    "the bytes the store received do not match their checksum: damaged on the way; sent again within the retries"
)
