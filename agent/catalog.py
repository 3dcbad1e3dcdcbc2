"""What is committed under a checkpoint URI, and whether it can be trusted. No torch import.

Layout: ``<uri>/step-<9-digit step>/`` holds one checkpoint; ``MANIFEST.json`` inside it is the
commit marker. If a committed folder for a step already exists (a broken checkpoint that restore
skipped, and the job then reached that step again), or another writer claims it (``WRITER.json``,
``agent.checkpoint._claim``), the new save goes to ``step-<N>.<n>/`` (the next free suffix:
``step-N.1``, ``step-N.2``, ...; not an attempt number) so that no manifest is ever overwritten.
``<uri>/.spotjob/`` holds the owner and attempt records (``agent.ownership``), the readers' pins
(``agent.pins``), the records of retired checkpoints (``agent._fresh_start``) and the create-only
probes, and is never a checkpoint.

Validity is decided here, once, by ``inspect`` — for restore, retention, the controller
(``latest_valid``) and every ``spotjob ckpt`` command alike. A checkpoint is valid when:

1. it is committed (``MANIFEST.json`` is listed);
2. the manifest is at most ``MAX_MANIFEST_BYTES``, nested at most ``MAX_JSON_DEPTH`` deep, parses,
   is safe (paths inside the folder) and names the folder's step;
3. it lists the files a restore needs: a per-rank file for every rank of its world, and DCP's
   ``.metadata`` whenever it has a tensor index or shard files;
4. every listed file is there with its listed size, and (on a filesystem) is not a symlink
   leading out of the folder, nor is the folder one leading out of the URI's;
5. it is not *foreign* (written by a job the URI's owner does not accept) or *fenced* (written by
   a stale attempt; see ``agent.ownership``), and the records that tell are readable here.

A checkpoint that fails only for want of reading something — a manifest or a record a newer
spotjob wrote, one archived, a record gone as it was read — is ``undecided``: not valid, not proven
bad either (``spotjob ckpt verify`` exits 2 for it, 1 for a checkpoint proven invalid).

Checks 1-5 cost one listing per folder, one manifest read, and per sweep the owner record plus
what fencing needs. ``verify_deep`` also reads every byte and checks every CRC32C. Storage errors
(unreachable, throttled past the retries, permission denied) propagate: a checkpoint is called
invalid only when it is proven so, never because storage could not be read. One exception, for
sweeps that must see past it (``inspect_all``, retention): a manifest in an archive storage class
(``ArchivedError``, a lifecycle rule's doing), or an archived attempt record needed to judge it,
makes that one folder unusable, with the reason, rather than failing the sweep. Restore and
``latest_valid`` still stop there: going back past an archived checkpoint would be going back in
time, and the older ones are likely archived too.
"""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from agent._layout import (
    CONTROL_FOLDER,
    CheckpointRef,
    MisplacedUriError,
    WrittenManifest,
    checkpoint_uris_below,
    find_checkpoints,
    folder_name,
    read_manifest,
    reserved_uri_problem,
)
from agent.crc32c import from_hex
from agent.manifest import (
    DCP_METADATA_NAME,
    DCP_SHARD_SUFFIX,
    MANIFEST_NAME,
    Manifest,
    ManifestError,
    NewerFormatError,
    rank_file_name,
)
from agent.ownership import Judgement, Lineage
from agent.storage.base import (
    ArchivedError,
    CorruptObjectError,
    NotFoundError,
    ProgressFn,
    Storage,
    parallel_map,
)

__all__ = [
    "CONTROL_FOLDER",
    "CheckpointRef",
    "CheckpointStatus",
    "Lineage",
    "MisplacedUriError",
    "WrittenManifest",
    "checkpoint_uris_below",
    "find_checkpoints",
    "folder_name",
    "inspect",
    "inspect_all",
    "latest_valid",
    "list_checkpoints",
    "read_manifest",
    "reserved_uri_problem",
    "uncommitted_older_than",
    "verify_deep",
]

log = logging.getLogger(__name__)


@dataclass
class CheckpointStatus:
    """What one folder holds: committed or not, valid or not and why."""

    ref: CheckpointRef
    committed: bool
    manifest: Manifest | None = None
    problems: list[str] = field(default_factory=list)
    stored_bytes: int = 0
    unusable: set[str] = field(default_factory=set)
    """Listed files found missing, short or (after ``verify_deep``) corrupt or unreadable."""
    foreign: bool = False
    """Written by a job the URI's owner does not accept: never restored, counted or deleted."""
    fenced: bool = False
    """Written by a stale attempt of the job (``agent.ownership``): never restored or counted."""
    retired: bool = False
    """Set aside by a deliberate fresh start (``agent._fresh_start``): kept, never used."""
    newer_format: bool = False
    """Its manifest is in a format newer than this spotjob reads (``NewerFormatError``), or a record
    that judges it is (the owner's or the next attempt's, ``Judgement.newer``, and nothing else is
    wrong with it): not proven bad, so
    never restored past (restore refuses), never counted or deleted by retention."""
    uri_wide: bool = False
    """What left it undecided is the URI's owner record (``Judgement.uri_wide``), which judges every
    checkpoint there alike: no other checkpoint there can be decided either until it is dealt with."""
    unproven: list[str] = field(default_factory=list)
    """Those of ``problems`` that prove nothing about the checkpoint, only that it could not be
    judged here: a manifest or a record a newer spotjob wrote, one archived (``report_archived``),
    a record gone as it was read (a ``Judgement`` of kind ``undecided``)."""

    @property
    def valid(self) -> bool:
        return self.committed and self.manifest is not None and not self.problems

    @property
    def undecided(self) -> bool:
        """Not valid, but only because it could not be judged here: every problem is ``unproven``
        (``spotjob ckpt verify`` exits 2, "cannot check", not 1). It is used no more than an invalid
        one: restore and retention decide by ``valid``, ``newer_format``, ``foreign`` and ``fenced``."""
        return self.committed and bool(self.problems) and all(p in self.unproven for p in self.problems)

    @property
    def reason(self) -> str:
        """Why the checkpoint cannot be used ("" when it can)."""
        if not self.committed:
            return "uncommitted: no MANIFEST.json (a save still in progress, or one that never finished)"
        return "; ".join(self.problems)


def _required_files(manifest: Manifest) -> list[str]:
    """What a restore of this checkpoint needs that the manifest does not list."""
    listed = {f.path for f in manifest.files}
    problems = []
    ranks = [rank_file_name(r) for r in range(manifest.world_size)]
    absent = [name for name in ranks if name not in listed]
    if absent:
        problems.append(
            f"the manifest lists no per-rank file for {len(absent)} of its {manifest.world_size} rank(s) "
            f"(e.g. {absent[0]}): nothing to restore them from"
        )
    shards = any(p.endswith(DCP_SHARD_SUFFIX) for p in listed)
    if (manifest.tensors or shards) and DCP_METADATA_NAME not in listed:
        problems.append(f"the manifest lists tensors or shard files but no {DCP_METADATA_NAME}: DCP cannot read them")
    return problems


def _escapes_folder(storage: Storage, ref: CheckpointRef, path: str) -> bool:
    """A file that is (or lies behind) a symlink resolving outside its checkpoint folder."""
    folder = storage.local_path(ref.folder)
    if folder is None:
        return False
    root = os.path.realpath(folder)
    return not os.path.realpath(os.path.join(folder, path)).startswith(root + os.sep)


def _folder_escapes(storage: Storage, ref: CheckpointRef) -> bool:
    """A checkpoint folder that is (or lies behind) a symlink resolving outside the URI's folder:
    whoever can write in the URI could point ``step-…`` at a folder only this job's user can read
    (another job's checkpoint), and the restore would load it and the next save store it where
    they can read it."""
    root = storage.local_path("")
    if root is None:
        return False
    real_root = os.path.realpath(root)
    return not os.path.realpath(os.path.join(root, ref.folder)).startswith(real_root + os.sep)


def inspect(
    storage: Storage,
    ref: CheckpointRef,
    *,
    lineage: Lineage | None = None,
    report_archived: bool = False,
    written: Mapping[str, WrittenManifest] | None = None,
) -> CheckpointStatus:
    """Decide whether the checkpoint in ``ref`` is valid (the module docstring's checks 1-5).

    ``lineage`` is the URI's owner and attempt records, read once for a sweep over many folders
    (``Lineage.load``); read here when not given. Raises ``StorageError`` when storage cannot be
    read — never for what the folder holds. ``report_archived``: a manifest (or the attempt record
    that judges it) in an archive storage class makes the checkpoint invalid, with the reason,
    instead of raising ``ArchivedError``. ``written``: the manifests this process committed, by
    folder (retention's, ``_layout.read_manifest``): read still, not parsed again when unchanged.
    """
    sizes = {o.key[len(ref.folder) + 1 :]: o.size for o in storage.list(ref.folder + "/")}
    status = CheckpointStatus(ref, committed=MANIFEST_NAME in sizes, stored_bytes=sum(sizes.values()))
    if not status.committed:
        return status
    try:
        manifest = status.manifest = read_manifest(
            storage, ref, size=sizes[MANIFEST_NAME], written=(written or {}).get(ref.folder)
        )
    except NotFoundError:
        # Listed a moment ago but gone now: deleted by retention under our feet.
        status.committed = False
        return status
    except ArchivedError as e:
        if not report_archived:
            raise
        status.problems.append(f"its MANIFEST.json cannot be read: {e}")
        status.unproven.append(status.problems[-1])
        return status
    except NewerFormatError as e:
        status.problems.append(str(e))
        status.unproven.append(str(e))
        status.newer_format = True
        return status
    except ManifestError as e:
        status.problems.append(str(e))
        return status
    status.problems += _required_files(manifest)
    if _folder_escapes(storage, ref):
        status.problems.append(f"{ref.folder} is a symlink leading out of {storage.url('')}")
    for f in manifest.files:
        have = sizes.get(f.path)
        if have is None:
            status.problems.append(f"file {f.path} is missing")
            status.unusable.add(f.path)
        elif have != f.size:
            status.problems.append(f"file {f.path} is {have} bytes, the manifest says {f.size}")
            status.unusable.add(f.path)
        elif _escapes_folder(storage, ref, f.path):
            status.problems.append(f"file {f.path} is a symlink leading out of {ref.folder}")
            status.unusable.add(f.path)
    lineage = lineage or Lineage.load(storage)
    try:
        judgement = lineage.judge(ref, manifest.job, manifest.attempt, manifest.created_at)
    except ArchivedError as e:
        # The attempt record that judges it (written once, when that attempt started) is archived.
        if not report_archived:
            raise
        judgement = Judgement("undecided", f"cannot tell whether it is fenced: {e}")
    if judgement is not None:
        _apply(status, judgement)
    return status


def _apply(status: CheckpointStatus, judgement: Judgement) -> None:
    # A newer spotjob's record makes a checkpoint one to stop at and keep (``newer_format``) only
    # when nothing is proven wrong with it: one missing a file is broken whoever judges it.
    if judgement.newer and not status.problems:
        status.newer_format = True
    status.foreign = judgement.kind == "foreign"
    status.fenced = judgement.kind == "fenced"
    status.retired = judgement.kind == "retired"
    status.problems.append(judgement.reason)
    if judgement.kind == "undecided":
        status.unproven.append(judgement.reason)
        status.uri_wide = judgement.uri_wide


def inspect_all(
    storage: Storage, refs: list[CheckpointRef], *, lineage: Lineage | None = None, parallelism: int = 8
) -> list[CheckpointStatus]:
    """``inspect`` for each of ``refs`` (in their order), several folders at a time: each costs
    round trips to the store (a listing, the manifest), and a run that keeps every checkpoint has
    thousands after a few days. ``StorageError`` as ``inspect``; an archived manifest is that
    folder's reason, not an error of the whole sweep."""
    lineage = lineage or Lineage.load(storage)
    statuses: list[CheckpointStatus | None] = [None] * len(refs)

    def one(i: int, ref: CheckpointRef) -> None:
        statuses[i] = inspect(storage, ref, lineage=lineage, report_archived=True)

    parallel_map(one, list(enumerate(refs)), parallelism)
    return [s for s in statuses if s is not None]


def list_checkpoints(storage: Storage) -> list[CheckpointStatus]:
    """Every checkpoint folder with its status, newest first."""
    return inspect_all(storage, find_checkpoints(storage))


def latest_valid(
    storage: Storage,
    *,
    before: CheckpointRef | None = None,
    on_skip: Callable[[CheckpointStatus], None] | None = None,
    reading_as: str | None = None,
) -> CheckpointStatus | None:
    """The newest valid checkpoint (older than ``before`` if given), logging each one skipped
    (or handing it to ``on_skip``: a caller that asks again and again says each skip once).

    Foreign and fenced checkpoints are skipped like broken ones: they never outrank what this
    job's current attempts wrote. ``reading_as``: judged as that job's (``Lineage.reading_as``).
    ``StorageError`` when storage cannot be read.
    """
    lineage = Lineage.load(storage, reading_as=reading_as)
    for ref in find_checkpoints(storage):
        if before is not None and not ref < before:
            continue
        status = inspect(storage, ref, lineage=lineage)
        if status.valid:
            return status
        if on_skip is not None:
            on_skip(status)
            continue
        # A folder without a manifest is as likely a save in progress as a leftover: not worth a warning.
        report = log.warning if status.committed else log.debug
        report("skipping checkpoint %s: %s", storage.url(ref.folder), status.reason)
    return None


def verify_deep(
    storage: Storage,
    status: CheckpointStatus,
    *,
    progress: ProgressFn | None = None,
    parallelism: int = 4,
) -> list[str]:
    """Read every byte of a committed checkpoint and check every CRC32C; return all its problems.

    Files found corrupt or gone are added to ``status.unusable`` and their problems to
    ``status.problems``, so ``status.valid`` then says what a deep check found. Storage errors
    other than a missing file propagate (a file that cannot be read now is not proven bad).
    """
    if status.manifest is None:
        return [status.reason or "no manifest"]
    problems: list[str] = []
    manifest = status.manifest
    missing = set(status.unusable)
    with tempfile.TemporaryDirectory(prefix="spotjob-verify-") as tmp:

        def check(path: str, size: int, crc: str) -> None:
            local = os.path.join(tmp, path.replace("/", "__"))
            try:
                storage.get_file(status.ref.key(path), local, size=size, crc32c=from_hex(crc), progress=progress)
            except CorruptObjectError as e:
                problems.append(f"file {path} is corrupt: {e}")
                status.unusable.add(path)
            except NotFoundError:
                problems.append(f"file {path} is missing")
                status.unusable.add(path)
            finally:
                if os.path.exists(local):
                    os.unlink(local)

        parallel_map(
            check,
            [(f.path, f.size, f.crc32c) for f in manifest.files if f.path not in missing],
            parallelism,
        )
    status.problems += sorted(problems)
    return list(status.problems)


def uncommitted_older_than(storage: Storage, ref: CheckpointRef) -> list[CheckpointRef]:
    """Folders older than ``ref`` that hold no manifest: leftovers of saves that never committed."""
    out = []
    for r in find_checkpoints(storage):
        if r < ref and storage.stat(r.key(MANIFEST_NAME)) is None:
            out.append(r)
    return out
