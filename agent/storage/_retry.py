"""Bounded retries with exponential backoff and jitter for transient storage faults.

Backends translate their client's exceptions into ``TransientStorageError`` (throttling, 5xx,
connection errors) or ``PermanentStorageError`` (auth, other 4xx) and wrap each operation with
``retry_transient``. Only transient errors are retried; every retry is logged with the operation,
the key and the attempt; after the last attempt the transient error propagates.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import TypeVar

from tenacity import (
    RetryCallState,
    Retrying,
    retry_if_exception_type,
    stop_after_attempt,
    wait_random_exponential,
)

from agent.storage.base import TransientStorageError

log = logging.getLogger(__name__)

T = TypeVar("T")

MAX_ATTEMPTS = int(os.environ.get("SPOTJOB_STORAGE_MAX_ATTEMPTS", "6"))
MAX_BACKOFF_S = float(os.environ.get("SPOTJOB_STORAGE_MAX_BACKOFF_S", "8"))
BASE_BACKOFF_S = float(os.environ.get("SPOTJOB_STORAGE_BASE_BACKOFF_S", "0.2"))


def retry_transient(op: str, fn: Callable[[], T], *, attempts: int | None = None) -> T:
    """Call ``fn`` until it succeeds, retrying ``TransientStorageError`` with jittered backoff.

    ``op`` names the operation and key for the log ("PUT s3://b/k").
    """
    retrying = Retrying(
        retry=retry_if_exception_type(TransientStorageError),
        stop=stop_after_attempt(attempts or MAX_ATTEMPTS),
        wait=wait_random_exponential(multiplier=BASE_BACKOFF_S, max=MAX_BACKOFF_S),
        before_sleep=lambda s: _log_retry_named(op, s),
        reraise=True,
    )
    return retrying(fn)


def _log_retry_named(op: str, state: RetryCallState) -> None:
    err = state.outcome.exception() if state.outcome else None
    wait = state.next_action.sleep if state.next_action else 0.0
    log.warning(
        "retrying %s after attempt %d failed (%s); next try in %.2fs", op, state.attempt_number, err, wait
    )
