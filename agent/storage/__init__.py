"""Checkpoint stores behind one interface: ``open_storage(uri)`` picks the backend.

``s3://bucket/prefix`` (boto3; standard credential chain; ``AWS_ENDPOINT_URL`` honoured),
``gs://bucket/prefix`` (google-cloud-storage; ``STORAGE_EMULATOR_HOST`` honoured),
``file:///path`` and plain paths. Only this package imports boto3 and google-cloud-storage.
"""

from __future__ import annotations

import os
import re
from importlib import metadata
from urllib.parse import urlparse

from agent.storage._errors import translate_os_error
from agent.storage.base import (
    MAX_OBJECT_NAME_BYTES,
    AlreadyExistsError,
    ArchivedError,
    CorruptObjectError,
    DamagedObjectError,
    MissingBucketError,
    NotFoundError,
    ObjectInfo,
    PermanentStorageError,
    RetainedError,
    Storage,
    StorageError,
    TooLargeError,
    TransientStorageError,
    get_files,
    put_files,
)
from agent.version import DISTRIBUTION

__all__ = [
    "MAX_PREFIX_BYTES",
    "AlreadyExistsError",
    "ArchivedError",
    "CorruptObjectError",
    "DamagedObjectError",
    "MissingBucketError",
    "NotFoundError",
    "ObjectInfo",
    "PermanentStorageError",
    "RetainedError",
    "Storage",
    "StorageError",
    "TooLargeError",
    "TransientStorageError",
    "get_files",
    "open_storage",
    "parse_uri",
    "put_files",
    "translate_os_error",
]


PREFIX_RESERVE_BYTES = 128
"""Room kept for the names spotjob writes under a URI's prefix (the longest, an attempt record
``.spotjob/attempts/<job>/attempt-<n>.json``, is about 100 bytes)."""

MAX_PREFIX_BYTES = MAX_OBJECT_NAME_BYTES - 1 - PREFIX_RESERVE_BYTES
"""The longest ``s3://`` / ``gs://`` prefix accepted, in UTF-8 bytes (895)."""

_CREDENTIAL_SOURCES = {
    "s3": "AWS credential chain (environment, profile, IRSA, instance role)",
    "gs": "Application Default Credentials (GOOGLE_APPLICATION_CREDENTIALS, Workload Identity)",
}


def parse_uri(uri: str) -> tuple[str, str, str]:
    """``(scheme, bucket, path)`` of a checkpoint URI by ``open_storage``'s rules, opening nothing.

    ``scheme`` is ``s3``, ``gs`` or ``file``; ``bucket`` is empty for ``file``; ``path`` is the
    prefix inside the bucket (no surrounding slashes) or the filesystem path as written. Raises
    ``ValueError`` with what to write instead when the URI is not one spotjob knows, or holds a
    ``#``, a ``?`` or a control character, or (``s3``, ``gs``) has an empty, ``.`` or ``..``
    segment in its prefix, is not UTF-8 or has a prefix longer than ``MAX_PREFIX_BYTES``, or
    (``gs``) names a bucket GCS's naming rules refuse.
    """
    if not uri or not uri.strip():
        raise ValueError("empty checkpoint URI; use s3://bucket/prefix, gs://bucket/prefix or a path")
    control = sorted({c for c in uri if ord(c) < 0x20 or 0x7F <= ord(c) < 0xA0})
    if control:
        # A URL parser silently drops tabs and newlines (s3://b/ru\nn is s3://b/run, another run's
        # prefix), and each log line naming the URI would carry them into the logs. A plain path is
        # refused too: spotjob spells it as a file:// URI again.
        raise ValueError(
            f"{uri!r}: control characters ({', '.join(repr(c) for c in control)}) are not supported in "
            "checkpoint URIs (a URI parser drops tabs and newlines, naming another location); remove them"
        )
    if uri != uri.strip():
        # Almost always a copy-and-paste or YAML quoting slip: ' /data/ckpt' would be a folder named
        # ' ' under the working directory, 's3://b/run ' another prefix than 's3://b/run'.
        raise ValueError(
            f"{uri!r} begins or ends with white space; checkpoint URIs are taken as written: "
            f"remove it ({uri.strip()!r})"
        )
    if uri[0] in "\"'" or uri[-1] in "\"'":
        # A value quoted twice (YAML around a Secret's, a shell's inside an env file): '"s3://b/run"'
        # has no scheme, so it was a relative folder named '"s3:' under the working directory.
        raise ValueError(
            f"{uri!r} begins or ends with a quote; checkpoint URIs are taken as written (a value quoted "
            f"twice, in YAML or an env file?): remove the quotes ({uri.strip(chr(34) + chr(39))!r})"
        )
    head = urlparse(uri)
    if head.scheme.lower() in ("s3", "gs") and any(c in head.netloc for c in ":@"):
        # No bucket name holds ':' or '@': this is user:secret@bucket. Said without the URI, which
        # would otherwise be repeated in every log line, Event and status that names it.
        raise ValueError(
            f"a {head.scheme.lower()}:// checkpoint URI takes no credentials (user:secret@ before the bucket; "
            f"the URI is not repeated here): spotjob reaches storage with the "
            f"{_CREDENTIAL_SOURCES[head.scheme.lower()]}; write {head.scheme.lower()}://BUCKET/PREFIX"
        )
    if "@" in head.netloc:
        # Another scheme, refused below, but not by a message that repeats the URI: an S3-compatible
        # endpoint behind basic auth (https://user:secret@minio.local/bucket) is a likely mistake.
        raise ValueError(
            "a checkpoint URI takes no credentials (user:secret@ before the host; the URI is not repeated "
            "here); use s3://bucket/prefix (an S3-compatible store's endpoint goes in AWS_ENDPOINT_URL), "
            "gs://bucket/prefix, file:///path or a plain path"
        )
    if "#" in uri or "?" in uri:
        # A URL parser reads them as a fragment or a query and drops them, so s3://b/run#1 would
        # silently be s3://b/run, another run's prefix. A plain path is refused too: spotjob spells
        # it as a file:// URI again (a store's uri, the comparisons of two URIs).
        raise ValueError(
            f"{uri!r}: '#' and '?' are not supported in checkpoint URIs (a URI would drop what "
            "follows them); choose a prefix or folder name without them"
        )
    parsed = urlparse(uri)
    scheme = parsed.scheme.lower()
    if scheme in ("s3", "gs"):
        if not parsed.netloc:
            raise ValueError(f"{uri!r} names no bucket; write {scheme}://BUCKET/PREFIX")
        prefix = parsed.path.strip("/")
        # The bucket first: the prefix checks below advise a URI with the same bucket, which would
        # then be refused for it (gs://b/a/../run told to write gs://b/run).
        problem = _gcs_bucket_problem(parsed.netloc, prefix) if scheme == "gs" else None
        if problem is not None:
            raise ValueError(f"{uri!r}: the bucket name {parsed.netloc!r} {problem}")
        if "//" in prefix:
            # ``agent.launcher.canonical_uri`` and ``normalise_uri`` compare s3://b/a//c as s3://b/a/c,
            # and spotjob before 2026-12-03 wrote it under the keys "a//c/": neither spelling can be
            # picked silently without losing sight of checkpoints written under the other.
            tidy = f"{scheme}://{parsed.netloc}/" + "/".join(p for p in prefix.split("/") if p)
            raise ValueError(
                f"{uri!r} has an empty folder ('//') in its path; write {tidy}. Checkpoints an older spotjob "
                f"wrote to {uri!r} are under the key prefix {prefix + '/'!r}: copy them under "
                f"{tidy.split('/', 3)[3] + '/'!r} first to resume from them"
            )
        dots = [p for p in prefix.split("/") if p in (".", "..")]
        if dots:
            raise ValueError(_dot_segment_refused(uri, scheme, parsed.netloc, prefix, dots[0]))
        try:
            uri.encode("utf-8")
        except UnicodeEncodeError:
            # Undecodable bytes from the command line or the environment reach Python as lone
            # surrogates; the client libraries would fail on them with a bare UnicodeEncodeError.
            raise ValueError(
                f"{uri!r} is not valid UTF-8 (undecodable bytes in it): S3 and GCS names are UTF-8; "
                "spell the URI in UTF-8"
            ) from None
        prefix_bytes = len(prefix.encode("utf-8"))
        if prefix_bytes > MAX_PREFIX_BYTES:
            raise ValueError(
                f"the prefix of {uri[:80]!r}... is {prefix_bytes} bytes: S3 and GCS take object names of at most "
                f"{MAX_OBJECT_NAME_BYTES} bytes and spotjob's names under the prefix need up to "
                f"{PREFIX_RESERVE_BYTES + 1}, so a prefix may have at most {MAX_PREFIX_BYTES}; choose a shorter one"
            )
        return scheme, parsed.netloc, prefix
    if scheme == "file":
        if parsed.netloc not in ("", "localhost") or not parsed.path.startswith("/"):
            # file:relative would be a folder under the working directory, spelled as a URI.
            raise ValueError(
                f"{uri!r}: file URIs take an absolute path, e.g. file:///data/ckpt "
                "(a folder relative to the working directory is written as a plain path)"
            )
        return "file", "", parsed.path
    if scheme == "" or (len(scheme) == 1 and os.name == "nt"):
        if uri.startswith("~"):
            # Nothing expands it here (the shell leaves --checkpoint-uri=~/x alone): it would be a
            # folder named '~' in the working directory, not the home folder.
            raise ValueError(
                f"{uri!r}: '~' is not expanded in a checkpoint URI; write the full path "
                f"({os.path.expanduser(uri)!r} for your home folder) or ./{uri} for a folder named '~'"
            )
        return "file", "", uri
    raise ValueError(
        f"unsupported checkpoint URI scheme {scheme!r} in {uri!r}; "
        "use s3://bucket/prefix, gs://bucket/prefix, file:///path or a plain path"
    )


_GCS_BUCKET_CHARACTERS = re.compile(r"[a-z0-9._-]+")
_DOTTED_DECIMAL = re.compile(r"[0-9]+(\.[0-9]+){3}")


def _gcs_bucket_problem(bucket: str, prefix: str) -> str | None:
    """Which of GCS's bucket naming rules ``bucket`` breaks and what to do, said after "the bucket
    name 'x'", or ``None``. No bucket breaking one can exist, so a URI naming one is refused before
    anything is made: google-cloud-storage checks only the first and last characters, with a message
    that names neither the URI nor the bucket, and GCS answers the others 400 or 404 (read as a
    missing bucket). Emulators accept more (fake-gcs-server takes ``b``); spotjob holds them to GCS's
    rules, so a URI that works against one works against GCS. Upper case is told the lower-case
    name only where that name breaks no other rule."""
    rule = _gcs_bucket_rule(bucket)
    if rule is None:
        return None
    lower = bucket.lower()
    if lower != bucket and _GCS_BUCKET_CHARACTERS.fullmatch(lower):
        other = _gcs_bucket_rule(lower)
        if other is None:
            # No checkpoint can be under a bucket that cannot exist: the prefix is written tidy.
            tidy = f"gs://{lower}/{_resolved(prefix)}".rstrip("/")
            return f"{rule}; write {tidy}"
        rule = f"has upper-case letters (GCS bucket names are lower case) and {other}"
    return f"{rule}; correct the bucket in the checkpoint URI (gs://BUCKET/prefix)"


def _gcs_bucket_rule(bucket: str) -> str | None:
    """The first of GCS's bucket naming rules ``bucket`` breaks, said after "the bucket name 'x'",
    or ``None``."""
    if not _GCS_BUCKET_CHARACTERS.fullmatch(bucket):
        if _GCS_BUCKET_CHARACTERS.fullmatch(bucket.lower()):
            return "has upper-case letters: GCS bucket names are lower case"
        others = [repr(c) for c in dict.fromkeys(bucket.lower()) if not _GCS_BUCKET_CHARACTERS.fullmatch(c)]
        upper = " (and upper-case letters)" if bucket != bucket.lower() else ""
        return f"has {', '.join(others)}{upper}: a GCS bucket name is lowercase letters, digits, '-', '_' and '.'"
    if not (bucket[0].isalnum() and bucket[-1].isalnum()):
        return "must start and end with a letter or a digit"
    longest = 222 if "." in bucket else 63
    if not 3 <= len(bucket) <= longest:
        limit = "3 to 63" if len(bucket) < 3 or longest == 63 else "at most 222 (with dots)"
        return f"is {len(bucket)} character{'s' if len(bucket) != 1 else ''} long: GCS takes {limit}"
    part = max(bucket.split("."), key=len)
    if len(part) > 63:
        return f"has a dot-separated part {len(part)} characters long: GCS takes at most 63"
    if _DOTTED_DECIMAL.fullmatch(bucket):
        return "is in dotted-decimal form (as an IP address is), which GCS refuses for a bucket name"
    if bucket.startswith("goog"):
        return "begins with 'goog', which GCS keeps for itself"
    if "google" in bucket:
        return "contains 'google', which GCS keeps for itself"
    return None


def _resolved(prefix: str) -> str:
    """``prefix`` with its empty, ``.`` and ``..`` segments resolved as a URL would."""
    parts: list[str] = []
    for part in prefix.split("/"):
        if part == "..":
            if parts:
                parts.pop()
        elif part not in ("", "."):
            parts.append(part)
    return "/".join(parts)


def _dot_segment_refused(uri: str, scheme: str, bucket: str, prefix: str, segment: str) -> str:
    """Why ``uri``, whose prefix holds the ``segment`` ``.`` or ``..``, is refused, and what to write.

    S3 and GCS keep such a segment as a literal name (the key ``a/../b/step-1/...``), while a URL
    resolves it and so do tools and emulators on the way: fake-gcs-server writes and reads
    ``a/../b`` at ``b`` yet lists the literal prefix, so a save's checkpoints were not found by the
    next restore. Either reading taken silently loses sight of the other's checkpoints."""
    resolved = _resolved(prefix)
    tidy = f"{scheme}://{bucket}/{resolved}".rstrip("/")
    where = f"under {resolved + '/'!r}" if resolved else "to the top of the bucket"
    return (
        f"{uri!r} has a {segment!r} segment in its path: S3 and GCS keep it as a literal folder name, "
        f"while URL resolution (and some tools and emulators) would read it as {tidy}, so saves and "
        f"listings could name different places; write {tidy} (or choose a name without '.' or '..' "
        f"segments). Checkpoints an older spotjob wrote to {uri!r} may be under the key prefix "
        f"{prefix + '/'!r}: copy them {where} first to resume from them"
    )


# The distributions each remote scheme needs, as pyproject.toml names them, and the top-level
# modules they (and what they bring) are imported as.
_SDKS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "s3": (("boto3", "awscrt"), ("boto3", "botocore", "s3transfer", "awscrt")),
    "gs": (("google-cloud-storage",), ("google",)),
}


def _sdk_missing(scheme: str, e: ImportError) -> BaseException:
    """What to raise when the backend of ``scheme`` cannot be imported: a ``PermanentStorageError``
    naming the SDK, the version found and the requirement to install, when the SDK is what is
    missing (or too old to have what the backend imports); ``e`` itself otherwise."""
    dists, modules = _SDKS[scheme]
    if (e.name or "").partition(".")[0] not in modules:
        return e
    try:
        declared = [r.split(";")[0].strip() for r in metadata.requires(DISTRIBUTION) or []]
    except metadata.PackageNotFoundError:  # a checkout that was never installed
        declared = []
    wanted = [next((r for r in declared if re.match(rf"{re.escape(d)}\b(?!-)", r)), d) for d in dists]
    found = []
    for d in dists:
        try:
            found.append(f"{d} {metadata.version(d)}")
        except metadata.PackageNotFoundError:
            found.append(f"no {d}")
    return PermanentStorageError(
        f"{scheme}:// checkpoint URIs need {' and '.join(wanted)}, which this Python cannot import "
        f"({e}; installed: {', '.join(found)}). spotjob depends on them, so they were left out "
        f"(pip install --no-deps) or downgraded after it was installed: pip install {' '.join(repr(w) for w in wanted)}"
    )


def open_storage(uri: str) -> Storage:
    """Open the store a checkpoint URI names.

    Raises ``ValueError`` with what to write instead when the URI is not one spotjob knows, and
    ``PermanentStorageError`` naming what to install when the scheme's SDK cannot be imported.
    """
    scheme, bucket, path = parse_uri(uri)
    if scheme == "s3":
        try:
            from agent.storage.s3 import S3Storage
        except ImportError as e:
            raise _sdk_missing(scheme, e) from e

        return S3Storage(bucket, path)
    if scheme == "gs":
        try:
            from agent.storage.gs import GCSStorage
        except ImportError as e:
            raise _sdk_missing(scheme, e) from e

        return GCSStorage(bucket, path)
    from agent.storage.file import FileStorage

    return FileStorage(path)
