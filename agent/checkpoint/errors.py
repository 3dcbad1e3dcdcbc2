"""The errors the Checkpointer raises, and which failures are the infrastructure's (exit 74)."""

from __future__ import annotations

import logging

from torch.distributed.checkpoint.api import CheckpointException

from agent.ownership import FencedError, OwnershipError
from agent.storage import AlreadyExistsError, PermanentStorageError, StorageError, translate_os_error

log = logging.getLogger("agent.checkpoint")  # one logger for the package, as before it was split


class CheckpointError(Exception):
    """Base of the errors the Checkpointer raises."""


class SaveFailedError(CheckpointError):
    """A background save failed; nothing was committed for its step."""


class FlushFailedError(SaveFailedError):
    """A preemption flush could not commit a checkpoint."""


class FencedSaveError(SaveFailedError, FencedError):
    """This worker's attempt was superseded (a newer attempt of the job is recorded, or another job
    took the URI over): it committed and deleted nothing and must stop. Raised on every rank, and
    again by every later ``step()``/``save()``."""


class CheckpointOwnershipError(CheckpointError, OwnershipError):
    """The URI belongs to another job; raised on every rank at construction, nothing written."""


class CheckpointUriError(CheckpointError, ValueError):
    """The URI is not one a job saves to: a checkpoint's own folder, or a folder above the job's
    URI (it holds no checkpoints; folders in it do). Raised on every rank, nothing written: by the
    constructor for a URI no job owns yet, and by a read-only Checkpointer's ``restore()``."""


class RestoreError(CheckpointError):
    """Restore could not leave the job in a consistent state."""


class RestoreRefusedError(RestoreError):
    """Committed checkpoints exist but restore will not go on: the newest one is incompatible with
    the model (shapes changed), or none of them loads. Nothing was deleted and the state was not
    changed. ``tried`` lists each checkpoint tried (URI, why it failed), newest first."""

    def __init__(self, message: str, tried: list[tuple[str, str]] | None = None) -> None:
        super().__init__(message)
        self.tried = list(tried or [])


class MissingStateKeysError(RestoreRefusedError):
    """``restore`` was handed state keys the newest checkpoint does not hold (a refusal: nothing
    was loaded or deleted)."""


class StorageUnavailableError(CheckpointError):
    """The checkpoint store still failed after its retries (or failed in a way that proves nothing
    about the checkpoints): restore stopped rather than fall back to an older checkpoint. Not the
    user's fault: under spotjob-agent it is reported as an infrastructure error (exit 74)."""


class StorageRefusedError(CheckpointError):
    """The checkpoint store refuses for good (no such bucket, permission denied, a URI that is a
    regular file): retrying cannot help, so it is the user's to fix and, under spotjob-agent, not
    reported as an infrastructure error — the script's own exit stands and the job fails saying why."""


def _is_infrastructure(error: BaseException) -> bool:
    """A failure of the store or of this node's disk that a later attempt may not meet.

    Not the user's code, not ownership, and not a store that refuses for good (permission denied,
    no space left, read-only, no such bucket): the next attempt would meet that refusal too, so it
    spends ``maxRestarts`` and the job fails saying why, instead of restarting without end.
    """
    if isinstance(error, CheckpointException) and error.failures:
        error = next(iter(error.failures.values()))[0]
    if isinstance(error, AlreadyExistsError | FencedError):
        return False  # another writer on the URI: ownership, not infrastructure
    if isinstance(error, OSError):
        error = translate_os_error(error, "writing the checkpoint")
    return isinstance(error, StorageError) and not isinstance(error, PermanentStorageError)


# Raised to users as ``agent.checkpoint.X``: tracebacks and logs keep naming the public module.
for _error in (
    CheckpointError,
    SaveFailedError,
    FlushFailedError,
    FencedSaveError,
    CheckpointOwnershipError,
    RestoreError,
    RestoreRefusedError,
    MissingStateKeysError,
    StorageUnavailableError,
    StorageRefusedError,
):
    _error.__module__ = "agent.checkpoint"
