"""``OSError`` → ``StorageError``: what a filesystem error means for a checkpoint store.

``FileStorage`` translates every error of the folder it serves here, and the object-store backends
the errors of the local files they read from or write to (a staged shard, a download's
destination), so that callers only ever see the ``StorageError`` subclasses ``base`` documents.

Permission denied (``EACCES``/``EPERM``) and a read-only filesystem say so, with the process's
user, because that is what an operator must fix; a full disk says so; ``ESTALE``, ``EIO`` and
timeouts (NFS, a flaky mount) are transient and retried; the rest are permanent.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
from collections.abc import Iterator

from agent.storage.base import PermanentStorageError, StorageError, TransientStorageError

_TRANSIENT = frozenset(
    {
        errno.EAGAIN,
        errno.EINTR,
        errno.EIO,
        errno.ESTALE,
        errno.ETIMEDOUT,
        errno.EBUSY,
        errno.ENOLCK,
        errno.ECONNRESET,
        errno.ECONNABORTED,
        errno.ENETDOWN,
        errno.ENETUNREACH,
        errno.EHOSTDOWN,
        errno.EHOSTUNREACH,
    }
)
_DENIED = frozenset({errno.EACCES, errno.EPERM})
_NO_SPACE = frozenset({errno.ENOSPC, errno.EDQUOT})


TLS_SLIP = (
    "whether the endpoint speaks https at all (a plain http server written https://), and the CA bundle that "
    "verifies its certificate"
)
"""What to check after a failed TLS handshake with a store's endpoint (S3's and GCS's messages)."""

URLLIB3_TIMEOUT = re.compile(r"\((connect|read) timeout=([0-9.]+)\)")
"""urllib3's "(connect timeout=5)" / "(read timeout=60)" in a timeout's text, under botocore's and
google-cloud-storage's errors alike: which wait ran out, and its seconds."""


def _user() -> str:
    try:
        return f"uid {os.geteuid()}"
    except AttributeError:  # not POSIX
        return "this process's user"


def translate_os_error(e: OSError, what: str, key: str | None = None) -> StorageError:
    """The ``StorageError`` for ``e``, raised while doing ``what`` (e.g. "cannot write file:///…")."""
    detail = e.strerror or type(e).__name__
    where = f" ({e.filename})" if e.filename else ""
    if e.errno in _DENIED or isinstance(e, PermissionError):
        return PermanentStorageError(
            f"permission denied: {what}{where}; give {_user()} access there, or choose another location", key
        )
    if e.errno == errno.EROFS:
        return PermanentStorageError(f"{what}: the filesystem is read-only{where}", key)
    if e.errno in _NO_SPACE:
        return PermanentStorageError(f"{what}: no space left (or quota exceeded){where}", key)
    if e.errno in _TRANSIENT:
        return TransientStorageError(f"{what}: {detail}{where}", key)
    return PermanentStorageError(f"{what}: {detail}{where}", key)


@contextlib.contextmanager
def local_file(what: str, key: str | None = None) -> Iterator[None]:
    """Translate ``OSError`` raised by local-file work inside the block (``what`` says which file)."""
    try:
        yield
    except OSError as e:
        raise translate_os_error(e, what, key) from e
