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
have no such after-the-fact cover (storage offers no conditional delete): a writer that passed its
check just before the record landed could still delete. Retention therefore deletes only folders
older than a checkpoint it has just found valid — not fenced — and checks before each delete,
which narrows the window to the moment between one check and one delete.

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
import shlex
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from agent import _fresh_start
from agent._layout import (
    CONTROL_FOLDER,
    CheckpointRef,
    MisplacedUriError,
    find_checkpoints,
    misplaced_uri_problem,
    read_bounded,
    read_manifest,
    reserved_uri_problem,
)
from agent.manifest import MANIFEST_NAME, ManifestError, UntrustedJSONError, loads_bounded, now_utc
from agent.storage.base import AlreadyExistsError, NotFoundError, Storage, TransientStorageError
from agent.version import spotjob_version

log = logging.getLogger(__name__)

OWNER_KEY = f"{CONTROL_FOLDER}/owner.json"
ATTEMPTS_PREFIX = f"{CONTROL_FOLDER}/attempts/"
RECORD_FORMAT = 1
MAX_RECORD_BYTES = 1 << 20
"""owner.json and attempt records are a few hundred bytes; anything past this is refused unread."""

_ATTEMPT_RE = re.compile(r"attempt-([0-9]{9,})\.json")


class OwnershipError(Exception):
    """Another job owns the URI (or its owner record is unreadable). The message names the owner
    and the remedy: a fresh URI, or ``spotjob ckpt adopt URI --job JOB`` to take it over."""

    def __init__(
        self, message: str, *, uri: str, job: str | None, owner: str | None = None, newer: bool = False
    ) -> None:
        super().__init__(message)
        self.uri = uri
        self.job = job
        self.owner = owner
        self.newer = newer
        """The owner record was written by a newer spotjob: upgrade, never ``adopt`` over it."""


class NewerRecordError(ValueError):
    """A record (``owner.json``, an attempt record) in a newer format, or with fields this spotjob
    does not know: a newer spotjob wrote it. Nothing bad is proven; this spotjob must neither judge
    checkpoints by it nor rewrite it in its own, older format (``adopt``)."""


class FencedError(Exception):
    """This writer lost the right to write: a newer attempt of its job is recorded, or another job
    adopted the URI. It must commit and delete nothing and stop."""


def describe_job(job: str | None) -> str:
    """``job 'train-7b'`` or ``an unnamed job`` (a Checkpointer without ``job``)."""
    return f"job {job!r}" if job is not None else "an unnamed job"


def job_name_problem(job: object) -> str | None:
    """Why ``job`` cannot name a job (None when it can): not a string, not UTF-8 (undecodable bytes
    from the command line or the environment), or holding a control character. A job name goes
    into the owner record, every manifest and every log line naming the job: the record could not
    be written (a bare serialisation error at the first claim), and a newline would forge a log
    line of its own."""
    if not isinstance(job, str):
        return f"a job name must be a string, got {job!r} ({type(job).__name__})"
    if not job:
        # An owner of its own kind otherwise: neither an unnamed job (no job=, or SPOTJOB_JOB_NAME
        # empty) nor any name `spotjob ckpt adopt --job` takes.
        return "the job name is empty: give the job a name, or leave it out (an unnamed job)"
    try:
        job.encode("utf-8")
    except UnicodeEncodeError:
        return f"the job name {job!r} is not valid UTF-8 (undecodable bytes in it); spell it in UTF-8"
    control = sorted({c for c in job if ord(c) < 0x20 or 0x7F <= ord(c) < 0xA0})
    if control:
        return f"the job name {job!r} holds control characters ({', '.join(repr(c) for c in control)}); remove them"
    return None


def job_key(job: str | None) -> str:
    """The folder name of a job's attempt records: readable, and distinct for distinct jobs.

    ``ns/train`` → ``ns_train.1f3a…`` (the hash keeps ``ns/train`` and ``ns_train`` apart);
    ``None`` → ``unnamed`` (no dot, so no named job maps there).
    """
    if job is None:
        return "unnamed"
    slug = re.sub(r"[^A-Za-z0-9_-]+", "_", job)[:48] or "_"
    return f"{slug}.{hashlib.sha256(job.encode()).hexdigest()[:12]}"


# -- the records' JSON (pydantic at the edge, dataclasses inside) --------------------------------


class _RefDoc(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    step: int = Field(ge=0)
    folder: str

    @model_validator(mode="after")
    def _names_its_step(self) -> _RefDoc:
        ref = CheckpointRef.parse(self.folder)
        if ref is None or ref.step != self.step:
            raise ValueError(f"{self.folder!r} is not the checkpoint folder of step {self.step}")
        return self

    @classmethod
    def of(cls, ref: CheckpointRef | None) -> _RefDoc | None:
        return None if ref is None else cls(step=ref.step, folder=ref.folder)

    def ref(self) -> CheckpointRef:
        parsed = CheckpointRef.parse(self.folder)
        assert parsed is not None  # checked by the validator
        return parsed


class _AdoptionDoc(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    job: str | None
    adopted_at: datetime
    upto: _RefDoc | None

    @field_validator("adopted_at", mode="after")
    @classmethod
    def _utc_if_zoneless(cls, value: datetime) -> datetime:
        """A time without a zone (a record written by hand) is UTC, as a manifest's is: comparable
        with a checkpoint's ``created_at``."""
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value


class _OwnerDoc(BaseModel):
    model_config = ConfigDict(extra="forbid")

    format: int = RECORD_FORMAT
    job: str | None
    created_at: datetime
    adopted: list[_AdoptionDoc] = Field(default_factory=list)


class _AttemptDoc(BaseModel):
    model_config = ConfigDict(extra="forbid")

    format: int = RECORD_FORMAT
    attempt: int = Field(ge=0)
    job: str | None
    fence: _RefDoc | None
    recorded_at: datetime


_D = TypeVar("_D", _OwnerDoc, _AttemptDoc)


def _parse_doc(model: type[_D], data: bytes) -> _D:
    """Parse an untrusted record within bounds; ``ValueError`` saying what is wrong."""
    try:
        raw: Any = loads_bounded(data, max_bytes=MAX_RECORD_BYTES)
    except UntrustedJSONError as e:
        raise ValueError(str(e)) from None
    if isinstance(raw, dict) and isinstance(raw.get("format"), int) and raw["format"] > RECORD_FORMAT:
        raise NewerRecordError(_by_a_newer_spotjob(f"in record format {raw['format']}"))
    try:
        return model.model_validate(raw)
    except ValidationError as e:
        errors = e.errors()
        if all(err["type"] == "extra_forbidden" for err in errors):
            unknown = ", ".join(".".join(str(p) for p in err.get("loc", ())) for err in errors[:5])
            raise NewerRecordError(_by_a_newer_spotjob(f"with fields this spotjob does not know ({unknown})")) from None
        first = errors[0]
        where = ".".join(str(p) for p in first.get("loc", ()))
        raise ValueError(f"invalid at {where or 'top level'}: {first['msg']}") from None


def _by_a_newer_spotjob(what: str) -> str:
    return (
        f"{what}: written by a newer spotjob than this one ({spotjob_version()}, which reads record format "
        f"{RECORD_FORMAT}); upgrade spotjob here (the training image, or the CLI) to the version that wrote it"
    )


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
        doc = _OwnerDoc(
            job=self.job,
            created_at=self.created_at,
            adopted=[_AdoptionDoc(job=a.job, adopted_at=a.adopted_at, upto=_RefDoc.of(a.upto)) for a in self.adopted],
        )
        return doc.model_dump_json(indent=2).encode()

    @classmethod
    def parse(cls, data: bytes) -> Owner:
        """Parse ``owner.json``; ``ValueError`` saying what is wrong."""
        doc = _parse_doc(_OwnerDoc, data)
        return cls(
            job=doc.job,
            created_at=doc.created_at,
            adopted=tuple(
                Adoption(a.job, a.adopted_at, a.upto.ref() if a.upto is not None else None) for a in doc.adopted
            ),
        )


def _adopt_hint(storage: Storage, job: str | None) -> str:
    flag = f"--job {shlex.quote(job)}" if job is not None else "--unnamed"  # a command to paste: quoted
    return f"`spotjob ckpt adopt {shlex.quote(storage.uri)} {flag}`"


def read_owner(storage: Storage) -> Owner | None:
    """The URI's owner, or None when no job has claimed it yet.

    Raises ``OwnershipError`` when ``owner.json`` exists but cannot be read as one (the remedy:
    ``spotjob ckpt adopt``), and ``StorageError`` when storage fails.
    """
    try:
        data = read_bounded(storage, OWNER_KEY, MAX_RECORD_BYTES)
    except NotFoundError:
        return None
    except UntrustedJSONError as e:
        data, error = b"", str(e)
    else:
        error = ""
    if not error:
        try:
            return Owner.parse(data)
        except NewerRecordError as e:
            raise OwnershipError(
                f"{storage.url(OWNER_KEY)}, the record of who owns {storage.uri}, is {e}. Until then nothing "
                "there is used, and `spotjob ckpt adopt` refuses: rewriting the record in this spotjob's older "
                "format would drop what the newer one keeps in it",
                uri=storage.uri,
                job=None,
                newer=True,
            ) from None
        except ValueError as e:
            error = str(e)
    raise OwnershipError(
        f"{storage.url(OWNER_KEY)}, the record of who owns {storage.uri}, is unreadable ({error}); nothing "
        f"there is trusted until it is rewritten: {_adopt_hint(storage, None).replace('--unnamed', '--job JOB')} "
        "makes JOB the owner",
        uri=storage.uri,
        job=None,
    )


def _owned_message(storage: Storage, owner: str, job: str | None) -> str:
    return (
        f"{storage.uri} belongs to {owner}, not to {describe_job(job)}: a checkpoint URI holds one job's "
        f"checkpoints. Give this job a fresh checkpoint URI, or take this one over on purpose with "
        f"{_adopt_hint(storage, job)} (it then resumes from the other job's checkpoints)"
    )


def _legacy_writers(storage: Storage, refs: list[CheckpointRef] | None = None) -> dict[str | None, CheckpointRef]:
    """Jobs whose committed checkpoints lie under an unclaimed URI, each with its newest folder
    (``refs``: the URI's checkpoint folders, when the caller listed them already).

    Manifests that cannot be read name no job and are left to the catalog to report.
    """
    writers: dict[str | None, CheckpointRef] = {}
    for ref in find_checkpoints(storage) if refs is None else refs:
        try:
            manifest = read_manifest(storage, ref)
        except (NotFoundError, ManifestError):
            continue
        writers.setdefault(manifest.job, ref)
    return writers


def claim(storage: Storage, job: str | None) -> Owner:
    """Make ``job`` the URI's owner unless another job is; return the owner. Idempotent.

    Creates ``owner.json`` create-only when absent (of two racing claimers exactly one wins; the
    other re-reads). A URI without an owner record but with checkpoints another job committed
    (copied there without ``.spotjob/``, or written before spotjob recorded owners) is refused too:
    those are that job's.
    Raises ``OwnershipError`` (another owner, or an unreadable record), ``MisplacedUriError`` (an
    unclaimed URI without checkpoints that is a checkpoint's own folder, or holds a job's URI) or
    ``StorageError``. A URI in another job URI's ``.spotjob`` or ``.spotjob-staging`` is refused
    whatever it holds (``MisplacedUriError``, no request): that job deletes what is saved there.
    """
    reserved = reserved_uri_problem(storage.uri)
    if reserved is not None:
        raise MisplacedUriError(reserved)
    owner = read_owner(storage)
    if owner is None:
        dirs = storage.list_dirs("")  # one listing for both looks below
        refs = find_checkpoints(storage, dirs)
        others = [w for w in _legacy_writers(storage, refs) if w != job]
        if others:
            names = ", ".join(describe_job(w) for w in others)
            raise OwnershipError(
                _owned_message(
                    storage,
                    f"{names} (checkpoints there with no owner record: copied here without its .spotjob folder, or "
                    "written before spotjob recorded owners)",
                    job,
                ),
                uri=storage.uri,
                job=job,
                owner=others[0],
            )
        if not refs:
            # The URI becomes a job's here: not one that is a checkpoint's own folder or holds the
            # job's URI (a Checkpointer there would start from step 0 without a word).
            problem = misplaced_uri_problem(storage, dirs)
            if problem is not None:
                raise MisplacedUriError(problem)
        mine = Owner(job=job, created_at=now_utc())
        try:
            storage.put_bytes_if_absent(OWNER_KEY, mine.to_json())
        except AlreadyExistsError:
            owner = read_owner(storage)  # another writer claimed it first
            if owner is None:
                raise TransientStorageError(f"{storage.url(OWNER_KEY)} exists and then does not", OWNER_KEY) from None
        else:
            log.info("%s now belongs to %s (%s)", storage.uri, describe_job(job), storage.url(OWNER_KEY))
            return mine
    if owner.job != job:
        raise OwnershipError(_owned_message(storage, owner.describe(), job), uri=storage.uri, job=job, owner=owner.job)
    return owner


def _newest_committed(storage: Storage) -> CheckpointRef | None:
    for ref in find_checkpoints(storage):
        if storage.stat(ref.key(MANIFEST_NAME)) is not None:
            return ref
    return None


def adopt(storage: Storage, job: str | None) -> Owner:
    """Take the URI over for ``job`` on purpose (``spotjob ckpt adopt``); return the new owner.

    The one overwrite of ``owner.json``: ``job`` becomes the owner and the previous owner (or,
    with no or an unreadable record, every other job whose checkpoints lie there) joins
    ``adopted`` up to the newest checkpoint folder committed now, so ``job`` resumes from them.
    Adopting a URI one already owns takes in the checkpoints other jobs left there that it does not
    accept yet (one copied in with ``cp -r`` or ``aws s3 sync``), up to the newest folder committed
    now; with none, it changes nothing.
    """
    try:
        old = read_owner(storage)
    except OwnershipError as e:
        if e.newer:
            raise
        log.warning("%s", e)
        old = None
    now = now_utc()
    upto = _newest_committed(storage)
    if old is not None and old.job == job:
        strangers = [w for w, ref in _legacy_writers(storage).items() if not old.accepts(w, ref)]
        if not strangers:
            return old
        taken = Owner(job, old.created_at, (*old.adopted, *(Adoption(w, now, upto) for w in strangers)))
        storage.put_bytes(OWNER_KEY, taken.to_json())
        log.info(
            "%s: %s now takes in the checkpoints of %s up to %s",
            storage.uri,
            describe_job(job),
            ", ".join(describe_job(w) for w in strangers),
            upto.folder if upto else "(none yet)",
        )
        return taken
    if old is not None:
        adopted = [*old.adopted, Adoption(old.job, now, upto)]
    else:
        adopted = [Adoption(w, now, upto) for w in _legacy_writers(storage)]
    new = Owner(job=job, created_at=now, adopted=tuple(a for a in adopted if a.job != job))
    storage.put_bytes(OWNER_KEY, new.to_json())
    # Debug: its one caller, `spotjob ckpt adopt`, prints the outcome as its answer on stdout.
    log.debug(
        "%s now belongs to %s, adopting the checkpoints of %s up to %s",
        storage.uri,
        describe_job(job),
        ", ".join(describe_job(a.job) for a in new.adopted) or "no other job",
        upto.folder if upto else "(none yet)",
    )
    return new


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
        doc = _AttemptDoc(
            attempt=self.attempt, job=self.job, fence=_RefDoc.of(self.fence), recorded_at=self.recorded_at
        )
        return doc.model_dump_json(indent=2).encode()

    @classmethod
    def parse(cls, data: bytes) -> AttemptRecord:
        """Parse one record; ``ValueError`` saying what is wrong."""
        doc = _parse_doc(_AttemptDoc, data)
        return cls(doc.attempt, doc.job, doc.fence.ref() if doc.fence is not None else None, doc.recorded_at)


def attempt_key(job: str | None, attempt: int) -> str:
    return f"{ATTEMPTS_PREFIX}{job_key(job)}/attempt-{attempt:09d}.json"


def recorded_attempts(storage: Storage, job: str | None) -> builtins.list[int]:
    """The attempt numbers recorded for ``job``, ascending (one listing, no record read)."""
    numbers = []
    for info in storage.list(f"{ATTEMPTS_PREFIX}{job_key(job)}/"):
        name = info.key.rsplit("/", 1)[-1]
        m = _ATTEMPT_RE.fullmatch(name)
        # Only the name attempt_key spells: another spelling of a number (ten digits, non-ASCII
        # digits) is a stray that names no record, yet would count as a newer attempt.
        if m and attempt_key(job, int(m.group(1))).endswith("/" + name):
            numbers.append(int(m.group(1)))
    return sorted(numbers)


def newest_attempt(storage: Storage, job: str | None) -> int | None:
    """The highest attempt number recorded for ``job``, or None."""
    numbers = recorded_attempts(storage, job)
    return numbers[-1] if numbers else None


def read_attempt(storage: Storage, job: str | None, attempt: int) -> AttemptRecord:
    """One record; ``NotFoundError`` if absent, ``ValueError`` if unreadable, ``StorageError``."""
    key = attempt_key(job, attempt)
    try:
        record = AttemptRecord.parse(read_bounded(storage, key, MAX_RECORD_BYTES))
    except NewerRecordError as e:
        raise NewerRecordError(f"{storage.url(key)} is {e}") from None
    except ValueError as e:
        raise ValueError(f"{storage.url(key)} is unreadable: {e}") from None
    if record.attempt != attempt or record.job != job:
        raise ValueError(
            f"{storage.url(key)} is unreadable: it records attempt {record.attempt} of {describe_job(record.job)}"
        )
    return record


def record_attempt(storage: Storage, job: str | None, attempt: int, fence: CheckpointRef | None) -> AttemptRecord:
    """(controller) Record that ``attempt`` of ``job`` starts, resuming from ``fence``; create-only.

    Replaying the same attempt returns the record already there (its fence stands). Raises
    ``FencedError`` when a newer attempt of the job is recorded already (the caller is stale: a
    controller must number its next attempt past ``newest_attempt``), ``StorageError`` when the
    record cannot be written — then the attempt must not start.
    """
    if attempt < 0:
        raise ValueError(f"attempt numbers start at 0, got {attempt}")
    newer = [n for n in recorded_attempts(storage, job) if n > attempt]
    if newer:
        raise FencedError(
            f"attempt {newer[-1]} of {describe_job(job)} is recorded at {storage.uri} already; "
            f"attempt {attempt} may not start (number it past {newer[-1]})"
        )
    record = AttemptRecord(attempt, job, fence, now_utc())
    key = attempt_key(job, attempt)
    try:
        storage.put_bytes_if_absent(key, record.to_json())
    except AlreadyExistsError:
        try:
            return read_attempt(storage, job, attempt)
        except NotFoundError:
            raise TransientStorageError(f"{storage.url(key)} exists and then does not", key) from None
        except ValueError as e:
            # Only judgements of older attempts' checkpoints depend on it; this attempt may run.
            log.warning("%s; attempt %d starts regardless", e, attempt)
            return record
    log.info(
        "recorded attempt %d of %s at %s, resuming from %s",
        attempt,
        describe_job(job),
        storage.uri,
        fence.folder if fence else "scratch",
    )
    return record


def attempt_records(storage: Storage, job: str | None) -> builtins.list[AttemptRecord]:
    """Every readable attempt record of ``job``, sorted by attempt (unreadable ones are logged and
    skipped; ``Lineage.judge`` reports the checkpoints they would have judged as untrusted)."""
    records = []
    for n in recorded_attempts(storage, job):
        try:
            records.append(read_attempt(storage, job, n))
        except NotFoundError:
            continue
        except ValueError as e:
            log.warning("%s", e)
    return records


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
    try:
        owner = read_owner(storage)
    except OwnershipError as e:
        raise FencedError(f"{describe_job(job)} stops writing to {storage.uri}: {e}") from None
    if owner is not None and owner.job != job:
        raise FencedError(
            f"{storage.uri} belongs to {owner.describe()} now (adopted from {describe_job(job)}): "
            "this writer commits and deletes nothing more there"
        )
    if attempt is None:
        return
    newer = [n for n in recorded_attempts(storage, job) if n > attempt]
    if newer:
        raise FencedError(
            f"attempt {newer[-1]} of {describe_job(job)} is recorded at {storage.uri}: this worker of attempt "
            f"{attempt} is stale (its gang was replaced) and commits and deletes nothing more there"
        )


# -- what the catalog asks -----------------------------------------------------------------------


@dataclass(frozen=True)
class Judgement:
    """Why a committed checkpoint must not be used although its bytes may be fine.

    ``untrusted``: a record it is judged by is broken (not JSON, too big or too deep, fields of the
    wrong kind, or one that contradicts where it lies); ``undecided``: that record could not be
    judged by here — a newer spotjob wrote it, it is archived, or it went away as it was read —
    which proves nothing about the checkpoint (``spotjob ckpt verify`` exits 2, not 1). Neither is
    ever restored or counted."""

    kind: Literal["foreign", "fenced", "retired", "untrusted", "undecided"]
    reason: str
    newer: bool = False
    """(``undecided``) A newer spotjob wrote the record: the checkpoint is then treated as one whose
    manifest a newer spotjob wrote (``CheckpointStatus.newer_format``): a restore stops at it rather
    than go back past it, and retention keeps it."""
    uri_wide: bool = False
    """(``undecided``) The record is the URI's owner record, which judges every checkpoint there
    alike: naming another checkpoint there cannot get past it, only dealing with the record can."""


@dataclass
class Lineage:
    """The URI's owner and attempt records, read once for a sweep over its checkpoints.

    ``judge`` says why a checkpoint is foreign or fenced. Records are fetched lazily (one listing
    per job, then only the record the rule needs) and kept: they are immutable once written.
    """

    storage: Storage
    owner: Owner | None
    owner_error: str | None = None
    owner_newer: bool = False
    """``owner_error`` says the owner record is a newer spotjob's (not broken: upgrade)."""
    retired: frozenset[str] = frozenset()
    """Folders a deliberate fresh start set aside (``agent._fresh_start``): kept, never used."""
    reading_as: str | None = None
    """(a read-only Checkpointer given ``job=``) Judge as that job's, not the owner's: its
    checkpoints are the ones to read (an eval of a job that is not the URI's owner)."""
    _numbers: dict[str | None, builtins.list[int]] = field(default_factory=dict)
    _records: dict[tuple[str | None, int], AttemptRecord | Judgement] = field(default_factory=dict)

    @classmethod
    def load(cls, storage: Storage, *, reading_as: str | None = None) -> Lineage:
        """Read the owner (``StorageError`` when storage fails; an unreadable record is kept as
        ``owner_error`` and makes every checkpoint untrusted, or undecided when a newer spotjob
        wrote it and the job's attempt records prove nothing against the checkpoint)."""
        retired = frozenset(_fresh_start.retired_folders(storage))
        try:
            return cls(storage, read_owner(storage), retired=retired, reading_as=reading_as)
        except OwnershipError as e:
            return cls(storage, None, str(e), owner_newer=e.newer, retired=retired, reading_as=reading_as)

    def judge(
        self, ref: CheckpointRef, job: str | None, attempt: int | None, created_at: datetime | None = None
    ) -> Judgement | None:
        """Why the checkpoint in ``ref`` (its manifest names ``job``, ``attempt`` and ``created_at``)
        must not be used, or None. ``StorageError`` when storage fails."""
        if self.owner_error is not None:
            if not self.owner_newer:
                return Judgement("untrusted", self.owner_error)
            # A newer spotjob's owner record cannot tell whose the checkpoint is, but whether it is
            # fenced it never told: the job's own attempt records do (the manifest names the job and
            # the attempt; the records are keyed and checked by that job, not by the owner). What
            # they prove (fenced, or the record that tells broken) is proven whoever owns the URI,
            # and wins over the owner record that proves nothing, as a missing file does. A retired
            # folder stays undecided: beside a readable owner record it is judged retired, not fenced.
            proven = None if ref.folder in self.retired else self._by_attempts(ref, job, attempt)
            if proven is not None and proven.kind in ("fenced", "untrusted"):
                return proven
            return Judgement("undecided", self.owner_error, newer=True, uri_wide=True)
        if ref.folder in self.retired:
            return Judgement(
                "retired",
                "retired by a deliberate fresh start (start_fresh): kept as it is, never restored, counted or "
                f"deleted (record {_fresh_start.retired_key(ref)})",
            )
        owner = self.owner
        if self.reading_as is not None and (owner is None or not owner.accepts(self.reading_as)):
            # A reader of another job's checkpoints than the owner's (job=), or of a URI without an
            # owner record (a copy without its .spotjob folder, where several jobs' may lie): that
            # job's are the ones. A manifest naming no job is an unnamed job's, as a claim takes it.
            if job != self.reading_as:
                reads = f"this read-only Checkpointer reads {describe_job(self.reading_as)}'s checkpoints (job=)"
                if owner is not None:
                    reads += f", not those of {owner.describe()}, which owns {self.storage.uri}"
                else:
                    reads += f", and {self.storage.uri} has no owner record that takes another job's in"
                    if job is None:
                        reads += (
                            " (its manifest names no job: an unnamed job's, or one a spotjob from before 2026-12-01 "
                            "wrote, which recorded none; a read-only Checkpointer without job= reads it)"
                        )
                return Judgement("foreign", f"foreign: written by {describe_job(job)}; {reads}")
            return self._by_attempts(ref, job, attempt)
        if owner is not None and not owner.accepts(job, ref):
            # The job's newest adoption: what it wrote after that is a stray writer's. One created
            # before it yet not taken in was not there then: copied in since, as into a URI the
            # owner never adopted anything of, and the same command takes it in.
            adopted = max((a for a in owner.adopted if a.job == job), key=lambda a: a.adopted_at, default=None)
            if adopted is not None and (created_at is None or created_at >= adopted.adopted_at):
                upto = adopted.upto.folder if adopted.upto else "none"
                why = (
                    f"written by {describe_job(job)} after {owner.describe()} adopted {self.storage.uri} "
                    f"(it took over checkpoints up to {upto})"
                )
                hint = ""
            else:
                why = f"written by {describe_job(job)}, but {self.storage.uri} belongs to {owner.describe()}"
                hint = f" (copied here to go on from it? {_adopt_hint(self.storage, owner.job)} takes it in)"
            return Judgement(
                "foreign", f"foreign: {why}; never restored, counted or deleted by {owner.describe()}{hint}"
            )
        return self._by_attempts(ref, job, attempt)

    def _by_attempts(self, ref: CheckpointRef, job: str | None, attempt: int | None) -> Judgement | None:
        """What ``job``'s attempt records say of the checkpoint in ``ref`` written by ``attempt``:
        fenced, or why the record that tells cannot be used, or None (not fenced)."""
        if attempt is None:
            return None
        later = [n for n in self._recorded(job) if n > attempt]
        if not later:
            return None
        record = self._record(job, later[0])
        if isinstance(record, Judgement):
            return Judgement(
                record.kind,
                f"cannot tell whether attempt {attempt}'s checkpoint is fenced: {record.reason}",
                newer=record.newer,
            )
        if not is_fenced(ref, attempt, [record]):
            return None
        resumed = record.fence.folder if record.fence is not None else "scratch"
        return Judgement(
            "fenced",
            f"fenced: written by attempt {attempt} of {describe_job(job)}, newer than {resumed}, which attempt "
            f"{record.attempt} was recorded resuming from (so taken for a worker that should have stopped; a "
            "checkpoint that did not load when that attempt started is fenced the same way)",
        )

    def _recorded(self, job: str | None) -> builtins.list[int]:
        if job not in self._numbers:
            self._numbers[job] = recorded_attempts(self.storage, job)
        return self._numbers[job]

    def _record(self, job: str | None, attempt: int) -> AttemptRecord | Judgement:
        """The record, or why it cannot be read: ``undecided`` when that proves nothing (a newer
        spotjob's record, one gone since the listing), ``untrusted`` when the record is broken."""
        key = (job, attempt)
        if key not in self._records:
            try:
                self._records[key] = read_attempt(self.storage, job, attempt)
            except NotFoundError:
                self._records[key] = Judgement(
                    "undecided",
                    f"{self.storage.url(attempt_key(job, attempt))} was listed but is gone (deleted while it was "
                    "read): look again",
                )
            except NewerRecordError as e:
                self._records[key] = Judgement("undecided", str(e), newer=True)
            except ValueError as e:
                self._records[key] = Judgement("untrusted", str(e))
        return self._records[key]


__all__ = [
    "ATTEMPTS_PREFIX",
    "OWNER_KEY",
    "Adoption",
    "AttemptRecord",
    "FencedError",
    "Judgement",
    "Lineage",
    "NewerRecordError",
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
    "read_attempt",
    "read_owner",
    "record_attempt",
    "recorded_attempts",
]
