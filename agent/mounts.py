"""Which mounted filesystem holds a path: the longest mount point above it in ``/proc/self/mounts``.
No torch import; used to choose the save path's defaults (``agent._direct_io``), to name the
filesystem in the file store's "no hard links" error (``agent.storage.file``) and to describe the
benchmark machine's disk."""

from __future__ import annotations

import os
from typing import NamedTuple


class Mount(NamedTuple):
    device: str
    mount_point: str
    fstype: str


def mount_of(path: str, mounts: str | None = None) -> Mount | None:
    """The mount holding ``path``, from ``/proc/self/mounts`` (or ``mounts``, its text); None
    where it cannot be told (no such file: not Linux)."""
    if mounts is None:
        try:
            with open("/proc/self/mounts", encoding="utf-8", errors="replace") as f:
                mounts = f.read()
        except OSError:
            return None
    path = os.path.realpath(path)
    best: Mount | None = None
    for line in mounts.splitlines():
        parts = line.split()
        if len(parts) < 3:
            continue
        mount = parts[1].replace("\\040", " ")
        inside = path == mount or path.startswith(mount.rstrip("/") + "/")
        if inside and (best is None or len(mount) >= len(best.mount_point)):
            best = Mount(parts[0], mount, parts[2])
    return best
