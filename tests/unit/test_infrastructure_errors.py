"""Which save failures the agent reports as infrastructure errors (exit 74, retried without spending
``maxRestarts``) and which it leaves to spend the budget: a store that refuses for good."""

from __future__ import annotations

import errno

import pytest
from torch.distributed.checkpoint.api import CheckpointException

from agent.checkpoint import _is_infrastructure
from agent.ownership import FencedError
from agent.storage import AlreadyExistsError, MissingBucketError, PermanentStorageError, TransientStorageError


def _in_dcp(error: BaseException) -> CheckpointException:
    return CheckpointException("write", {0: (error, None)})  # type: ignore[dict-item]


@pytest.mark.parametrize(
    "error",
    [
        TransientStorageError("503 past the retries", None),
        OSError(errno.EIO, "Input/output error"),
        OSError(errno.ETIMEDOUT, "Connection timed out"),
    ],
    ids=["5xx", "eio", "timeout"],
)
def test_a_store_failing_for_now_is_infrastructure(error: BaseException) -> None:
    assert _is_infrastructure(error)
    assert _is_infrastructure(_in_dcp(error))


@pytest.mark.parametrize(
    "error",
    [
        OSError(errno.ENOSPC, "No space left on device"),
        OSError(errno.EDQUOT, "Disk quota exceeded"),
        OSError(errno.EROFS, "Read-only file system"),
        PermissionError(errno.EACCES, "Permission denied"),
        PermanentStorageError("403 AccessDenied", None),
        MissingBucketError("no such bucket", None),
        AlreadyExistsError("another writer", None),
        FencedError("superseded attempt"),
        ValueError("the user's own bug"),
    ],
    ids=["full", "quota", "read-only", "denied", "403", "no-bucket", "exists", "fenced", "user"],
)
def test_a_store_refusing_for_good_ownership_and_user_errors_are_not(error: BaseException) -> None:
    # Without this, a full checkpoint disk restarted the job without end (each attempt exiting 74).
    assert not _is_infrastructure(error)
    assert not _is_infrastructure(_in_dcp(error))
