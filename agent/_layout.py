"""Where things lie under a checkpoint URI, and reading a manifest within bounds. No torch import.

``<uri>/step-<9-digit step>[.<n>]/`` holds one checkpoint (``MANIFEST.json`` inside is its commit
marker); ``<uri>/.spotjob/`` holds the URI's owner and attempt records (``agent.ownership``), pins
(``agent.pins``), retirement records (``agent._fresh_start``) and probes, and is never a
checkpoint. The lowest layer of ``agent.ownership`` and ``agent.catalog``, which re-exports what
callers need.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from functools import total_ordering

from agent.manifest import MANIFEST_NAME, MAX_MANIFEST_BYTES, Manifest, ManifestError, UntrustedJSONError
from agent.storage.base import DamagedObjectError, ObjectInfo, Storage, TooLargeError

CONTROL_FOLDER = ".spotjob"
"""spotjob's own records under a URI (owner, attempts, pins, retired, probes): never listed as a checkpoint."""

STAGING_FOLDER = ".spotjob-staging"
"""Where a filesystem URI's saves are staged by default (``agent.restore_cache.default_staging``):
every ``step-*`` folder there is taken for an interrupted save's leftover and removed."""

PROBES_FOLDER = f"{CONTROL_FOLDER}/probes"
"""Where a writer's short-lived probe objects go (``Storage.check_create_only``), deleted at once."""

_FOLDER_RE = re.compile(r"step-([0-9]{9,})(?:\.([0-9]+))?")


def folder_name(step: int, attempt: int = 0) -> str:
    return f"step-{step:09d}" + (f".{attempt}" if attempt else "")


@total_ordering
@dataclass(frozen=True)
class CheckpointRef:
    """One checkpoint folder under the URI (committed or not).

    ``attempt`` is the folder's suffix (``step-N.1`` when ``step-N`` was already committed), not
    the controller's attempt number.
    """

    step: int
    attempt: int = 0

    @property
    def folder(self) -> str:
        return folder_name(self.step, self.attempt)

    def key(self, name: str) -> str:
        return f"{self.folder}/{name}"

    def __lt__(self, other: object) -> bool:
        if not isinstance(other, CheckpointRef):
            return NotImplemented
        return (self.step, self.attempt) < (other.step, other.attempt)

    @classmethod
    def parse(cls, folder: str) -> CheckpointRef | None:
        """The checkpoint named ``folder``, or None when ``folder`` is not one's name exactly as
        ``folder_name`` spells it: another spelling of the same number (``step-0000000002``,
        ``step-000000002.0``, other scripts' digits, a trailing newline) would stand for a real
        checkpoint's folder, which retention would then count twice and delete."""
        m = _FOLDER_RE.fullmatch(folder)
        if not m:
            return None
        ref = cls(int(m.group(1)), int(m.group(2) or 0))
        return ref if ref.folder == folder else None


def find_checkpoints(storage: Storage, dirs: list[str] | None = None) -> list[CheckpointRef]:
    """Every checkpoint folder under the URI, newest first (``.spotjob/`` and strays excluded);
    ``dirs``: the URI's folders, when the caller listed them already."""
    names = storage.list_dirs("") if dirs is None else dirs
    refs = [r for r in (CheckpointRef.parse(d) for d in names) if r is not None]
    return sorted(refs, reverse=True)


CLAIM_NAME = "WRITER.json"
"""A checkpoint folder's claim: the writer saving into it (``agent.checkpoint._claim``)."""

CHECKPOINT_MARKERS = (MANIFEST_NAME, CLAIM_NAME)
"""What marks a folder as a checkpoint's own (``misplaced_uri_problem``). With a URI's ``.spotjob``
records, the only objects the controller reads (never a shard): the Terraform modules' controller
roles grant reading these names, and no other of a checkpoint's."""

SUBFOLDERS_LOOKED_AT = 32
"""How many of a checkpoint-less URI's folders ``checkpoint_uris_below`` looks into (a listing each)."""


def checkpoint_uris_below(storage: Storage, dirs: list[str] | None = None) -> list[str]:
    """The folders right under ``storage``'s URI that hold checkpoints (the first 32 looked at): the
    URI given was the parent of a job's (``spotjob-runs/NAME`` for ``spotjob-runs/NAME/checkpoints``,
    a bucket for its prefix). ``dirs``: the URI's folders, when the caller listed them already."""
    found = []
    for name in sorted(storage.list_dirs("") if dirs is None else dirs)[:SUBFOLDERS_LOOKED_AT]:
        if name.startswith(".") or CheckpointRef.parse(name) is not None:
            continue
        if any(CheckpointRef.parse(d) is not None for d in storage.list_dirs(name + "/")):
            found.append(storage.url(name))
    return found


class MisplacedUriError(ValueError):
    """A URI that is not one a job saves to: one that holds no checkpoint folders and is a
    checkpoint's own folder or a folder above job URIs, or any folder in a job URI's ``.spotjob``
    or ``.spotjob-staging`` (``misplaced_uri_problem``, ``reserved_uri_problem``)."""


_CONTROL_ENTRIES = frozenset({"owner.json", "attempts", "pins", "probes", "retired"})
"""What spotjob keeps in a job URI's ``.spotjob``: a URI under any of them is in the records' layout."""


def reserved_uri_problem(uri: str) -> str | None:
    """Why ``uri`` (a URI or a path), which lies in a job URI's own ``.spotjob`` or
    ``.spotjob-staging`` folder, is not one a job saves to, or None. No request: told by its name.

    A job there saved its checkpoints where the other job deleted them without a word (every
    ``step-*`` folder of the staging folder is an interrupted save's leftover to the job whose
    staging it is, removed as its next Checkpointer is built), or wrote its records among the other
    job's. Under ``.spotjob`` only spotjob's own entries count (``owner.json``, ``attempts``, ``pins``,
    ``probes``, ``retired``): a folder of the user's that happens to be named so is left alone."""
    scheme, sep, rest = uri.partition("://")
    head, parts = (f"{scheme}{sep}", rest.rstrip("/").split("/")) if sep else ("", uri.rstrip("/").split("/"))
    for i, name in enumerate(parts):
        if name not in (CONTROL_FOLDER, STAGING_FOLDER) or (i == 0 and sep and scheme != "file"):
            continue  # a bucket's name is no job's folder
        if name == CONTROL_FOLDER and i + 1 < len(parts) and parts[i + 1] not in _CONTROL_ENTRIES:
            continue  # a folder of the user's own of that name (~/.spotjob/ckpts): not the records' layout
        job = head + "/".join(parts[:i]) or "."
        folder = head + "/".join(parts[: i + 1])
        if name == STAGING_FOLDER:
            kind = "the staging folder"
            what = (
                "that job's next Checkpointer removes every step-* folder in it as an interrupted save's "
                "leftover (a job saving here would lose its checkpoints without a word)"
            )
        else:
            kind = "the records folder"
            what = "it holds spotjob's own records of that job (owner, attempts, pins), never a job's checkpoints"
        where = "is" if i == len(parts) - 1 else f"lies in {folder},"
        return (
            f"{uri} {where} {kind} of the job URI {job}: {what}. Give a job a folder of its own outside "
            f"{folder}: the URI {job} itself to resume that job, or a new folder beside {job}"
        )
    return None


def misplaced_uri_problem(storage: Storage, dirs: list[str] | None = None) -> str | None:
    """Why ``storage``'s URI, which holds no checkpoint folders, is not one a job saves to, or None.

    A checkpoint's own folder (named ``step-N``, or holding a ``MANIFEST.json`` or ``WRITER.json``:
    the folder a log line or ``spotjob ckpt show`` printed, pasted as the URI) or a folder whose
    subfolders hold checkpoints (the parent of the job's URI): a Checkpointer there started from
    step 0 without a word, and one in a checkpoint's folder wrote into it, where the job's
    retention later deleted what it saved. Also a folder in a job URI's ``.spotjob`` or
    ``.spotjob-staging`` (``reserved_uri_problem``). Costs two stats and a listing (none when ``dirs``,
    the URI's folders, are given), and a listing for each subfolder (at most ``SUBFOLDERS_LOOKED_AT``)."""
    reserved = reserved_uri_problem(storage.uri)
    if reserved is not None:
        return reserved
    parent, _, leaf = storage.uri.rstrip("/").rpartition("/")
    if CheckpointRef.parse(leaf) is not None:
        return (
            f"{storage.uri} is a checkpoint's own folder (its name is a checkpoint folder's), not the URI a job "
            f"saves to: give the URI its job saves to, {parent}, whose newest valid checkpoint restore() loads"
        )
    held = next((name for name in CHECKPOINT_MARKERS if storage.stat(name) is not None), None)
    if held is not None:  # a copy of one, under a name of its own
        return (
            f"{storage.uri} is a checkpoint's own folder (it holds {held}), not the URI a job saves to: give the "
            "URI its job saves to, the folder that holds its step-NNNNNNNNN folders"
        )
    below = checkpoint_uris_below(storage, dirs)
    if below:
        more = f" (and {len(below) - 3} more)" if len(below) > 3 else ""
        return (
            f"{storage.uri} holds no checkpoints, but folders in it do: to resume a job, give the URI it saves "
            f"to, e.g. {', '.join(below[:3])}{more}; to start a new one, give it a folder of its own"
        )
    return None


def read_bounded(storage: Storage, key: str, max_bytes: int, *, size: int | None = None) -> bytes:
    """An untrusted record's bytes: one bigger than ``max_bytes`` is refused unread
    (``read_bounded_stamped``)."""
    return read_bounded_stamped(storage, key, max_bytes, size=size)[0]


def read_bounded_stamped(
    storage: Storage, key: str, max_bytes: int, *, size: int | None = None
) -> tuple[bytes, ObjectInfo]:
    """An untrusted record's bytes and what the store says of them (size, time), in one request on
    S3 and GCS (``Storage.get_small``: one GET, where a HEAD and a GET went before); one bigger
    than ``max_bytes`` is refused unread.

    ``size`` is the object's size from a listing, when the caller has one: a listed size above
    ``max_bytes`` is refused without a request. Raises ``UntrustedJSONError`` (too big, or
    damaged where it is kept: ``DamagedObjectError``), ``NotFoundError`` or ``StorageError``.
    """
    if size is not None and size > max_bytes:
        raise UntrustedJSONError(f"{size} bytes, more than the {max_bytes} allowed")
    try:
        return storage.get_small(key, max_bytes)
    except DamagedObjectError as e:  # read as one that is not JSON: what it holds is not known
        raise UntrustedJSONError(str(e)) from None
    except TooLargeError as e:
        if e.size is None:
            raise UntrustedJSONError(f"more than the {max_bytes} bytes allowed") from None
        raise UntrustedJSONError(f"{e.size} bytes, more than the {max_bytes} allowed") from None


@dataclass(frozen=True)
class WrittenManifest:
    """A manifest as this process committed it: the SHA-256 of the bytes it wrote, and the
    ``Manifest`` those bytes encode (the object they were serialised from)."""

    digest: bytes
    manifest: Manifest
    size: int
    """How many bytes were written."""

    @classmethod
    def of(cls, data: bytes, manifest: Manifest) -> WrittenManifest:
        return cls(hashlib.sha256(data).digest(), manifest, len(data))


def read_manifest(
    storage: Storage, ref: CheckpointRef, *, size: int | None = None, written: WrittenManifest | None = None
) -> Manifest:
    """Read and validate one manifest; ``ManifestError``/``NotFoundError`` say what is wrong.

    ``size`` is the manifest's size from a listing, when the caller has one; otherwise it is
    stat'ed. An oversized manifest is refused before a byte of it is read.

    ``written``: what this process committed in ``ref``, when it did. The manifest is still read;
    when its bytes are the ones written, their ``Manifest`` is taken instead of parsing them again
    (a manifest of 8000 tensors took as long to validate as a tenth of its save); other bytes (the
    folder removed and committed anew by another writer, a tampered file) are parsed as always.
    """
    try:
        data = read_bounded(storage, ref.key(MANIFEST_NAME), MAX_MANIFEST_BYTES, size=size)
    except UntrustedJSONError as e:
        raise ManifestError(f"MANIFEST.json is refused: {e}") from None
    if written is not None and hashlib.sha256(data).digest() == written.digest:
        manifest = written.manifest
    else:
        manifest = Manifest.parse(data)
    if manifest.step != ref.step:
        raise ManifestError(f"MANIFEST.json says step {manifest.step} but lies in folder {ref.folder}; refusing it")
    return manifest
