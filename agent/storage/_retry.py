"""Bounded retries with exponential backoff and jitter for transient storage faults.

Backends translate their client's exceptions into ``TransientStorageError`` (throttling, 5xx,
connection errors) or ``PermanentStorageError`` (auth, other 4xx) and wrap each operation with
``retry_transient``. Only transient errors are retried; every retry is logged with the operation,
the key and the attempt; after the last attempt the transient error propagates.

The policy is read from the environment on every call, not at import, so a process (or a test)
that sets ``SPOTJOB_STORAGE_MAX_ATTEMPTS`` / ``SPOTJOB_STORAGE_BASE_BACKOFF_S`` /
``SPOTJOB_STORAGE_MAX_BACKOFF_S`` after importing spotjob still gets what it asked for.
"""

from __future__ import annotations

import functools
import logging
import os
import random
from collections.abc import Callable
from typing import TypeVar

from tenacity import (
    RetryCallState,
    Retrying,
    retry_if_exception_type,
    stop_after_attempt,
    wait_exponential,
)

from agent.settings import StorageEnv, load
from agent.storage.base import TransientStorageError

log = logging.getLogger(__name__)

T = TypeVar("T")

DEFAULT_MAX_ATTEMPTS = 6
DEFAULT_MAX_BACKOFF_S = 8.0
DEFAULT_BASE_BACKOFF_S = 0.2


_POLICY_PREFIX = "SPOTJOB_STORAGE_"


@functools.lru_cache(maxsize=8)
def _policy(raw: tuple[tuple[str, str], ...]) -> tuple[int, float, float]:
    """(attempts, base backoff, cap) for this setting of the ``SPOTJOB_STORAGE_*`` variables:
    validated once per distinct setting, not on every storage operation. The key is every such
    variable, not only the three read here: ``StorageEnv`` refuses any of them that is malformed,
    and a key of three let a cached answer hide a malformed timeout set later."""
    env = load(StorageEnv)
    attempts = DEFAULT_MAX_ATTEMPTS if env.max_attempts is None else max(1, env.max_attempts)
    base = DEFAULT_BASE_BACKOFF_S if env.base_backoff_s is None else env.base_backoff_s
    cap = DEFAULT_MAX_BACKOFF_S if env.max_backoff_s is None else env.max_backoff_s
    return attempts, base, cap


def policy() -> tuple[int, float, float]:
    """The retry policy the environment sets now (``agent.settings.StorageEnv``)."""
    return _policy(tuple(sorted((k, v) for k, v in os.environ.items() if k.upper().startswith(_POLICY_PREFIX))))


def max_attempts() -> int:
    """Attempts per operation (first try included): ``SPOTJOB_STORAGE_MAX_ATTEMPTS``, default 6."""
    return policy()[0]


class _FullJitter(wait_exponential):
    """tenacity's ``wait_random_exponential`` (a uniform draw up to the exponential backoff),
    drawing from a generator of its own: tenacity's draws from Python's global ``random``, which
    belongs to the training script (retries run on its ranks, in their save threads)."""

    _rng = random.Random()  # seeded from os.urandom; never the global stream

    def __call__(self, retry_state: RetryCallState) -> float:
        return self._rng.uniform(0.0, super().__call__(retry_state))


def retry_transient(op: str, fn: Callable[[], T], *, attempts: int | None = None) -> T:
    """Call ``fn`` until it succeeds, retrying ``TransientStorageError`` with jittered backoff.

    ``op`` names the operation and key for the log ("PUT s3://b/k"); it must not carry secrets
    (signed or session URLs), because it is logged on every retry.
    """
    # The common case, one attempt that succeeds, costs no more than the call: tenacity (and its
    # per-call setup) comes in only once an attempt has failed, and then sees that failure as
    # its first attempt, so the count, the backoff and the log lines are the same.
    try:
        return fn()
    except TransientStorageError as e:
        first: TransientStorageError | None = e
    tries, base, cap = policy()

    def again() -> T:
        nonlocal first
        if first is not None:
            failed, first = first, None
            raise failed
        return fn()

    retrying = Retrying(
        retry=retry_if_exception_type(TransientStorageError),
        stop=stop_after_attempt(attempts or tries),
        wait=_FullJitter(multiplier=base, max=cap),
        before_sleep=lambda s: _log_retry_named(op, s),
        reraise=True,
    )
    return retrying(again)


def _log_retry_named(op: str, state: RetryCallState) -> None:
    err = state.outcome.exception() if state.outcome else None
    wait = state.next_action.sleep if state.next_action else 0.0
    log.warning("retrying %s after attempt %d failed (%s); next try in %.2fs", op, state.attempt_number, err, wait)
