"""What is committed under a checkpoint URI, and whether it can be trusted. No torch import.

Layout: ``<uri>/step-<9-digit step>/`` holds one checkpoint; ``MANIFEST.json`` inside it is the
commit marker. If a committed folder for a step already exists (a broken checkpoint that restore
skipped, and the job then reached that step again), the new save goes to ``step-<N>.<attempt>/``
so that no manifest is ever overwritten.

Validity (cheap, one listing per folder): the manifest parses, names the folder's step, and every
file it lists exists with its listed size. ``verify_deep`` also reads every byte and checks every
CRC32C. The controller uses ``latest_valid`` as its source of truth for "what is committed".
"""

from __future__ import annotations

import logging
import os
import tempfile
from dataclasses import dataclass, field

from agent._layout import CheckpointRef, find_checkpoints, read_manifest
from agent.crc32c import from_hex
from agent.manifest import MANIFEST_NAME, Manifest, ManifestError
from agent.storage.base import (
    CorruptObjectError,
    NotFoundError,
    ProgressFn,
    Storage,
    StorageError,
    parallel_map,
)

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

    @property
    def valid(self) -> bool:
        return self.committed and self.manifest is not None and not self.problems

    @property
    def reason(self) -> str:
        """Why the checkpoint cannot be used ("" when it can)."""
        if not self.committed:
            return "uncommitted: no MANIFEST.json (a save that never finished)"
        return "; ".join(self.problems)


def inspect(storage: Storage, ref: CheckpointRef) -> CheckpointStatus:
    """Check one folder: manifest present and sound, every listed file there with its size."""
    sizes = {o.key[len(ref.folder) + 1 :]: o.size for o in storage.list(ref.folder + "/")}
    status = CheckpointStatus(ref, committed=MANIFEST_NAME in sizes, stored_bytes=sum(sizes.values()))
    if not status.committed:
        return status
    try:
        status.manifest = read_manifest(storage, ref)
    except NotFoundError:
        # Listed a moment ago but gone now: deleted by retention under our feet.
        status.committed = False
        return status
    except ManifestError as e:
        status.problems.append(str(e))
        return status
    for f in status.manifest.files:
        have = sizes.get(f.path)
        if have is None:
            status.problems.append(f"file {f.path} is missing")
            status.unusable.add(f.path)
        elif have != f.size:
            status.problems.append(f"file {f.path} is {have} bytes, the manifest says {f.size}")
            status.unusable.add(f.path)
    return status


def list_checkpoints(storage: Storage) -> list[CheckpointStatus]:
    """Every checkpoint folder with its status, newest first."""
    return [inspect(storage, ref) for ref in find_checkpoints(storage)]


def latest_valid(storage: Storage, *, before: CheckpointRef | None = None) -> CheckpointStatus | None:
    """The newest valid checkpoint (older than ``before`` if given), logging each one skipped."""
    for ref in find_checkpoints(storage):
        if before is not None and not ref < before:
            continue
        status = inspect(storage, ref)
        if status.valid:
            return status
        log.warning("skipping checkpoint %s: %s", storage.url(ref.folder), status.reason)
    return None


def verify_deep(
    storage: Storage,
    status: CheckpointStatus,
    *,
    progress: ProgressFn | None = None,
    parallelism: int = 4,
) -> list[str]:
    """Read every byte of a committed checkpoint and check every CRC32C; return the problems.

    Files found corrupt or unreadable are added to ``status.unusable``.
    """
    if status.manifest is None:
        return [status.reason or "no manifest"]
    problems = list(status.problems)
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
            except StorageError as e:
                problems.append(f"file {path} could not be read: {e}")
                status.unusable.add(path)
            finally:
                if os.path.exists(local):
                    os.unlink(local)

        parallel_map(
            check,
            [(f.path, f.size, f.crc32c) for f in manifest.files if f.path not in missing],
            parallelism,
        )
    return problems


def uncommitted_older_than(storage: Storage, ref: CheckpointRef) -> list[CheckpointRef]:
    """Folders older than ``ref`` that hold no manifest: leftovers of saves that never committed."""
    out = []
    for r in find_checkpoints(storage):
        if r < ref and storage.stat(r.key(MANIFEST_NAME)) is None:
            out.append(r)
    return out
