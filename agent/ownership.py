"""Who may write under a checkpoint URI: the owning job, and which of its attempts. No torch import.

**Ownership.** A URI belongs to one job, recorded in ``<uri>/.spotjob/owner.json``, written
create-only by the first writer (the controller when it first looks at the job's storage, or the
rank 0 ``Checkpointer`` when no controller runs) and never rewritten except by ``adopt`` — the one
deliberate take-over (``spotjob ckpt adopt URI --job NEW``). The job identity is the
Checkpointer's ``job`` (``SPOTJOB_JOB_NAME``; ``<namespace>/<name>`` on Kubernetes); ``None`` is
"an unnamed job", a distinct owner. ``claim`` refuses a second job with ``OwnershipError``. A
checkpoint whose manifest names a job the owner does not ``accept`` is *foreign*: never restored,
counted or deleted. An adopted job's checkpoints are accepted up to the newest folder committed
when it was adopted; anything it commits later is foreign.

**Fencing.** Within a job, the controller records each attempt before starting it, create-only,
in ``.spotjob/attempts/<job key>/attempt-<N, 9 digits>.json``: the attempt number and the *fence*,
the newest valid checkpoint at that moment (what attempt N resumes from). A manifest records its
writer's attempt (``Manifest.attempt``; None — no controller — is never fenced). The rule
(``is_fenced``): a checkpoint written by attempt ``a`` is fenced iff some attempt ``b > a`` of its
job is recorded and, for the smallest such ``b``, the checkpoint's folder is newer than ``fence_b``
(or ``fence_b`` is null). Attempt ``b`` resumed from ``fence_b``, so whatever ``a`` committed past
it was written by a worker that should have stopped (a partitioned node training on). Fenced
checkpoints are never restored, never counted by the controller and never outrank what a newer
attempt wrote.

A writer calls ``check_not_fenced`` before every commit and every delete. Between that check and
the write a newer attempt may be recorded; the rule covers that race: a manifest that lands after
the record is newer than the record's fence, hence fenced, whatever the writer believed. Deletes
have no such after-the-fact cover; they are only ever of folders older than the writer's own
newest commit, which a newer attempt's fence already outranks or equals.

Records are per job (``<job key>`` below) so that a job adopted by another, or a job deleted and
created again under the same name, never mixes its attempt numbers with another's: the controller
continues a job's numbering past its newest record (see ``newest_attempt``).

Everything read here is untrusted: records are size- and depth-bounded and a record that does not
parse raises ``OwnershipError`` (owner) or is reported, never a crash.
"""

from __future__ import annotations

import builtins
import hashlib
import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime

from agent._layout import CONTROL_FOLDER, CheckpointRef
from agent.storage.base import Storage

log = logging.getLogger(__name__)

OWNER_KEY = f"{CONTROL_FOLDER}/owner.json"
ATTEMPTS_PREFIX = f"{CONTROL_FOLDER}/attempts/"
RECORD_FORMAT = 1
MAX_RECORD_BYTES = 1 << 20
"""owner.json and attempt records are a few hundred bytes; anything past this is refused unread."""

_ATTEMPT_RE = re.compile(r"^attempt-(\d{9,})\.json$")


class OwnershipError(Exception):
    """Another job owns the URI (or its owner record is unreadable). The message names the owner
    and the remedy: a fresh URI, or ``spotjob ckpt adopt URI --job JOB`` to take it over."""

    def __init__(self, message: str, *, uri: str, job: str | None, owner: str | None = None) -> None:
        super().__init__(message)
        self.uri = uri
        self.job = job
        self.owner = owner


class FencedError(Exception):
    """This writer lost the right to write: a newer attempt of its job is recorded, or another job
    adopted the URI. It must commit and delete nothing and stop."""


def describe_job(job: str | None) -> str:
    """``job 'train-7b'`` or ``an unnamed job`` (a Checkpointer without ``job``)."""
    return f"job {job!r}" if job is not None else "an unnamed job"


def job_key(job: str | None) -> str:
    """The folder name of a job's attempt records: readable, and distinct for distinct jobs.

    ``ns/train`` → ``ns_train.1f3a…`` (the hash keeps ``ns/train`` and ``ns_train`` apart);
    ``None`` → ``unnamed`` (no dot, so no named job maps there).
    """
    if job is None:
        return "unnamed"
    slug = re.sub(r"[^A-Za-z0-9_-]+", "_", job)[:48] or "_"
    return f"{slug}.{hashlib.sha256(job.encode()).hexdigest()[:12]}"


# -- owner -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Adoption:
    """A job whose checkpoints the owner took over with ``adopt``."""

    job: str | None
    adopted_at: datetime
    upto: CheckpointRef | None
    """The newest checkpoint folder committed when it was adopted; its newer ones are foreign."""


@dataclass(frozen=True)
class Owner:
    """The content of ``owner.json``."""

    job: str | None
    created_at: datetime
    adopted: tuple[Adoption, ...] = ()

    def accepts(self, job: str | None, ref: CheckpointRef | None = None) -> bool:
        """Whether a checkpoint written by ``job`` (in folder ``ref``) belongs to this owner's history.

        The owner's own checkpoints always; an adopted job's only up to its ``upto`` folder
        (``ref`` None: whether any of that job's checkpoints could be accepted).
        """
        if job == self.job:
            return True
        return any(a.job == job and (ref is None or (a.upto is not None and not a.upto < ref)) for a in self.adopted)

    def describe(self) -> str:
        return describe_job(self.job)

    def to_json(self) -> bytes:
        raise NotImplementedError

    @classmethod
    def parse(cls, data: bytes) -> Owner:
        """Parse ``owner.json``; ``ValueError`` saying what is wrong."""
        raise NotImplementedError


def read_owner(storage: Storage) -> Owner | None:
    """The URI's owner, or None when no job has claimed it yet.

    Raises ``OwnershipError`` when ``owner.json`` exists but cannot be read as one (the remedy:
    ``spotjob ckpt adopt``), and ``StorageError`` when storage fails.
    """
    raise NotImplementedError


def claim(storage: Storage, job: str | None) -> Owner:
    """Make ``job`` the URI's owner unless another job is; return the owner. Idempotent.

    Creates ``owner.json`` create-only when absent (of two racing claimers exactly one wins; the
    other re-reads). A URI without an owner record but with checkpoints another job committed
    (written before spotjob recorded owners) is refused too: those are that job's.
    Raises ``OwnershipError`` (another owner, or an unreadable record) or ``StorageError``.
    """
    raise NotImplementedError


def adopt(storage: Storage, job: str | None) -> Owner:
    """Take the URI over for ``job`` on purpose (``spotjob ckpt adopt``); return the new owner.

    The one overwrite of ``owner.json``: ``job`` becomes the owner and the previous owner (or,
    with no or an unreadable record, every other job whose checkpoints lie there) joins
    ``adopted`` up to the newest checkpoint folder committed now, so ``job`` resumes from them.
    Adopting a URI one already owns changes nothing.
    """
    raise NotImplementedError


# -- attempts ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class AttemptRecord:
    """The content of one attempt record: the controller is about to start ``attempt`` of ``job``."""

    attempt: int
    job: str | None
    fence: CheckpointRef | None
    """The newest valid checkpoint when the attempt was recorded (what it resumes from)."""
    recorded_at: datetime

    def to_json(self) -> bytes:
        raise NotImplementedError

    @classmethod
    def parse(cls, data: bytes) -> AttemptRecord:
        """Parse one record; ``ValueError`` saying what is wrong."""
        raise NotImplementedError


def attempt_key(job: str | None, attempt: int) -> str:
    return f"{ATTEMPTS_PREFIX}{job_key(job)}/attempt-{attempt:09d}.json"


def recorded_attempts(storage: Storage, job: str | None) -> builtins.list[int]:
    """The attempt numbers recorded for ``job``, ascending (one listing, no record read)."""
    raise NotImplementedError


def newest_attempt(storage: Storage, job: str | None) -> int | None:
    """The highest attempt number recorded for ``job``, or None."""
    numbers = recorded_attempts(storage, job)
    return numbers[-1] if numbers else None


def record_attempt(storage: Storage, job: str | None, attempt: int, fence: CheckpointRef | None) -> AttemptRecord:
    """(controller) Record that ``attempt`` of ``job`` starts, resuming from ``fence``; create-only.

    Replaying the same attempt returns the record already there (its fence stands). Raises
    ``FencedError`` when a newer attempt of the job is recorded already (the caller is stale: a
    controller must number its next attempt past ``newest_attempt``), ``StorageError`` when the
    record cannot be written — then the attempt must not start.
    """
    raise NotImplementedError


def attempt_records(storage: Storage, job: str | None) -> builtins.list[AttemptRecord]:
    """Every readable attempt record of ``job``, sorted by attempt (unreadable ones are logged and
    skipped: a record that cannot be read fences nothing)."""
    raise NotImplementedError


def is_fenced(ref: CheckpointRef, written_by: int | None, records: Sequence[AttemptRecord]) -> bool:
    """The fencing rule (module docstring) for a checkpoint in folder ``ref`` written by attempt
    ``written_by`` of a job whose records are ``records``."""
    if written_by is None:
        return False
    later = [r for r in records if r.attempt > written_by]
    if not later:
        return False
    first = min(later, key=lambda r: r.attempt)
    return first.fence is None or first.fence < ref


def check_not_fenced(storage: Storage, job: str | None, attempt: int | None) -> None:
    """(writer) Raise ``FencedError`` if ``job``'s attempt ``attempt`` may no longer write here:
    an attempt newer than it is recorded, or another job owns (adopted) the URI.

    ``attempt`` None (no controller) is never fenced by attempts; the owner is still checked.
    Call before every commit and every delete. ``StorageError`` when storage cannot tell.
    """
    raise NotImplementedError


# -- what the catalog asks -----------------------------------------------------------------------


@dataclass
class Lineage:
    """The URI's owner and attempt records, read once for a sweep over its checkpoints.

    ``judge`` says why a checkpoint is foreign or fenced. Records are fetched lazily (one listing
    per job, then only the record the rule needs) and kept: they are immutable once written.
    """

    storage: Storage
    owner: Owner | None
    owner_error: str | None = None
    _numbers: dict[str | None, builtins.list[int]] = field(default_factory=dict)
    _records: dict[tuple[str | None, int], AttemptRecord | None] = field(default_factory=dict)

    @classmethod
    def load(cls, storage: Storage) -> Lineage:
        """Read the owner (``StorageError`` when storage fails; an unreadable record is kept as
        ``owner_error`` and makes every checkpoint untrusted)."""
        raise NotImplementedError

    def judge(self, ref: CheckpointRef, job: str | None, attempt: int | None) -> str | None:
        """Why the checkpoint in ``ref`` (its manifest names ``job`` and ``attempt``) must not be
        used, or None. ``StorageError`` when storage fails."""
        raise NotImplementedError


__all__ = [
    "ATTEMPTS_PREFIX",
    "OWNER_KEY",
    "Adoption",
    "AttemptRecord",
    "FencedError",
    "Lineage",
    "Owner",
    "OwnershipError",
    "adopt",
    "attempt_key",
    "attempt_records",
    "check_not_fenced",
    "claim",
    "describe_job",
    "is_fenced",
    "job_key",
    "newest_attempt",
    "read_owner",
    "record_attempt",
    "recorded_attempts",
]
