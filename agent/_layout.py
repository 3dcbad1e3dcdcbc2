"""Where things lie under a checkpoint URI, and reading a manifest within bounds. No torch import.

``<uri>/step-<9-digit step>[.<n>]/`` holds one checkpoint (``MANIFEST.json`` inside is its commit
marker); ``<uri>/.spotjob/`` holds the URI's owner and attempt records (``agent.ownership``) and is
never a checkpoint. The lowest layer of ``agent.ownership`` and ``agent.catalog``, which re-exports
what callers need.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import total_ordering

from agent.manifest import MANIFEST_NAME, MAX_MANIFEST_BYTES, Manifest, ManifestError
from agent.storage.base import Storage

CONTROL_FOLDER = ".spotjob"
"""spotjob's own records under a URI (owner, attempts): never listed as a checkpoint."""

_FOLDER_RE = re.compile(r"^step-(\d{9,})(?:\.(\d+))?$")


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
        m = _FOLDER_RE.match(folder)
        if not m:
            return None
        return cls(int(m.group(1)), int(m.group(2) or 0))


def find_checkpoints(storage: Storage) -> list[CheckpointRef]:
    """Every checkpoint folder under the URI, newest first (``.spotjob/`` and strays excluded)."""
    refs = [r for r in (CheckpointRef.parse(d) for d in storage.list_dirs("")) if r is not None]
    return sorted(refs, reverse=True)


def read_manifest(storage: Storage, ref: CheckpointRef, *, size: int | None = None) -> Manifest:
    """Read and validate one manifest; ``ManifestError``/``NotFoundError`` say what is wrong.

    ``size`` is the manifest's size from a listing, when the caller has one; otherwise it is
    stat'ed. An oversized manifest is refused before a byte of it is read.
    """
    key = ref.key(MANIFEST_NAME)
    if size is None:
        info = storage.stat(key)
        size = info.size if info is not None else None
    if size is not None and size > MAX_MANIFEST_BYTES:
        raise ManifestError(f"MANIFEST.json is {size} bytes, more than a manifest may be ({MAX_MANIFEST_BYTES})")
    manifest = Manifest.parse(storage.get_bytes(key))
    if manifest.step != ref.step:
        raise ManifestError(f"MANIFEST.json says step {manifest.step} but lies in folder {ref.folder}; refusing it")
    return manifest
