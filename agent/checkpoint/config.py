"""How and where to checkpoint (``CheckpointConfig``), one spelling per URI, and the checks on
what the training script passes (steps, metadata) before anything is written."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import numbers
import operator
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

from pydantic import JsonValue, TypeAdapter, ValidationError

from agent.manifest import MAX_JSON_DEPTH, check_json_depth
from agent.ownership import job_name_problem

log = logging.getLogger("agent.checkpoint")  # one logger for the package, as before it was split


_METADATA = TypeAdapter(dict[str, JsonValue])
_MAX_METADATA_BYTES = 1 << 20
MAX_STEP = (1 << 63) - 1
"""The highest step: the per-step vote carries steps in int64 tensors."""


@dataclass
class CheckpointConfig:
    """How and where to checkpoint. Cross-field checks run at construction, not deep in DCP."""

    uri: str
    """Where checkpoints go: s3://bucket/prefix, gs://bucket/prefix, file:///path or a path."""
    every_steps: int | None = None
    """Save every N completed steps (None: only on request or flush)."""
    every_seconds: float | None = None
    """Save when this much wall time has passed since the last save started (ranks agree)."""
    keep: int | None = 3
    """Committed checkpoints to keep (None: all). The newest valid one is never deleted."""
    async_save: bool = True
    """Block the loop only while staging to CPU memory; write and upload in the background."""
    staging_dir: str | None = None
    """Node-local folder ranks write to before uploading (the node's NVMe in production). The job
    stages in a folder of its own inside it (``agent.restore_cache.staging_root``), so jobs sharing
    it never touch each other's files. None: ``agent.restore_cache.default_staging``."""
    control_dir: str | None = None
    """The folder shared with spotjob-agent (flush requests, status); None: no agent."""
    job: str | None = None
    """The job's name: the URI's owner (``agent.ownership``), recorded in manifests and logs."""
    attempt: int | None = None
    """The controller's attempt number for these workers (fencing); None: not fenced."""
    start_fresh: bool = False
    """Start from step 0 when committed checkpoints exist but none loads (they are retired)."""
    io_threads: int = 8
    """Parallel transfers per rank."""
    release_staging: bool = False
    """Free the host buffers an async save staged into as soon as that save is committed, instead of
    keeping them for the next save. Gives a state-sized block of memory back between saves, at the
    price of allocating (first-touching; pinning, with CUDA) it again on the next one."""
    direct_io: bool | None = None
    """Write a filesystem store's shards with ``O_DIRECT`` (from memory to the disk, without the
    page cache; ``agent._direct_io``). None: where the staging folder is on a local block
    filesystem (ext4, XFS, btrfs, f2fs), not on NFS, FUSE, overlay or tmpfs, for shards of
    ``agent._direct_io.DIRECT_MIN_BYTES`` (256 MiB) or more. True: on any filesystem, at any size.
    Object stores' staged files are upload buffers read straight back, and always go through the
    page cache."""

    replicas: str = "identical"
    """What the ranks' copies of a module's parameters and an optimizer's state are (those not sharded
    as DTensors). ``"identical"`` (data parallel, DDP): the save checks a sample of each and refuses
    copies that differ (tensor-parallel shards kept as plain tensors, pipeline stages' optimizers),
    which one checkpoint copy would silently merge. ``"rank0"``: they may differ on purpose (local SGD,
    DiLoCo: replicas drift between synchronisations), and rank 0's copy is saved, unchecked."""

    def __post_init__(self) -> None:
        # Types first: a string or a float would pass (or crash) the comparisons below and then
        # schedule saves at the wrong steps, or never ("5" < 1 raises; 2.5 saves at step 5 only).
        self.every_steps = _whole_or_none(self.every_steps, "every_steps", "(or None to disable)")
        self.keep = _whole_or_none(self.keep, "keep", "(or None to keep everything)")
        self.io_threads = _whole(self.io_threads, "io_threads", "")
        if self.every_seconds is not None:
            if isinstance(self.every_seconds, bool) or not isinstance(self.every_seconds, numbers.Real):
                raise TypeError(
                    f"every_seconds must be a number of seconds (or None to disable), got {self.every_seconds!r}"
                )
            self.every_seconds = float(self.every_seconds)
            if not math.isfinite(self.every_seconds):  # nan never comes due: no periodic save, silently
                raise ValueError(
                    "every_seconds must be a finite number of seconds > 0 (or None to disable), "
                    f"got {self.every_seconds}"
                )
        if self.every_steps is not None and self.every_steps < 1:
            raise ValueError(f"every_steps must be >= 1 (or None to disable), got {self.every_steps}")
        if self.every_seconds is not None and self.every_seconds <= 0:
            raise ValueError(f"every_seconds must be > 0 (or None to disable), got {self.every_seconds}")
        if self.keep is not None and self.keep < 1:
            raise ValueError(f"keep must be >= 1 (or None to keep everything), got {self.keep}")
        if self.io_threads < 1:
            raise ValueError(f"io_threads must be >= 1, got {self.io_threads}")
        self.async_save = switch(self.async_save, "async_save")
        self.start_fresh = switch(self.start_fresh, "start_fresh")
        self.release_staging = switch(self.release_staging, "release_staging")
        if self.direct_io is not None and not isinstance(self.direct_io, bool):
            raise TypeError(f"direct_io must be True, False or None (choose by filesystem), got {self.direct_io!r}")
        if self.attempt is not None and (isinstance(self.attempt, bool) or not isinstance(self.attempt, int)):
            raise TypeError(f"attempt must be an int (or None), got {self.attempt!r}")
        if self.attempt is not None and self.attempt < 0:
            raise ValueError(f"attempt must be >= 0 (or None), got {self.attempt}")
        if self.replicas not in REPLICAS:
            raise ValueError(f"replicas must be one of {', '.join(map(repr, REPLICAS))}, got {self.replicas!r}")
        problem = None if self.job is None else job_name_problem(self.job)
        if problem is not None:
            raise (TypeError if not isinstance(self.job, str) else ValueError)(f"job: {problem}")


REPLICAS = ("identical", "rank0")


def switch(value: Any, name: str) -> bool:
    """``value`` as a bool: True, False, 1, 0 or a NumPy bool; ``TypeError`` naming ``name`` for
    anything else. A string ("no", "false") is truthy, and would turn the switch on."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if type(value).__module__ == "numpy" and type(value).__name__ in ("bool", "bool_"):
        return bool(value)
    raise TypeError(f"{name} must be True or False, got {value!r}")


def _whole(value: Any, name: str, none: str) -> int:
    """``value`` as an int (NumPy's integers too, and a float that is whole: ``total_steps / 10``
    is 100.0); ``TypeError`` naming ``name`` for anything else (2.5, "5", True)."""
    if not isinstance(value, bool):
        with contextlib.suppress(TypeError):
            return operator.index(value)
        if isinstance(value, numbers.Real) and math.isfinite(value) and float(value).is_integer():
            return int(float(value))
    what = f"a whole number {none}".rstrip()
    raise TypeError(f"{name} must be {what}, got {value!r} ({type(value).__name__})")


def _whole_or_none(value: Any, name: str, none: str) -> int | None:
    return None if value is None else _whole(value, name, none)


def normalise_uri(uri: str) -> str:
    """One spelling per location: ``s3://b/p``, ``gs://b/p``, ``file:///abs/path``."""
    parsed = urlparse(uri)
    scheme = parsed.scheme.lower()
    if scheme in ("s3", "gs"):
        prefix = "/".join(p for p in parsed.path.split("/") if p)
        return f"{scheme}://{parsed.netloc}/{prefix}".rstrip("/")
    path = parsed.path if scheme == "file" else uri
    return "file://" + os.path.normpath(os.path.abspath(os.path.expanduser(path)))


def _check_step(step: Any, call: str) -> int:
    """A step is a whole number of completed steps, >= 0."""
    if isinstance(step, bool):
        raise TypeError(f"{call}: step must be an int (completed steps), got the bool {step!r}")
    try:
        value = operator.index(step)
    except TypeError:
        raise TypeError(
            f"{call}: step must be an int (completed steps), got {step!r} ({type(step).__name__})"
        ) from None
    if value < 0:
        raise ValueError(f"{call}: step must be >= 0 (completed steps), got {value}")
    if value > MAX_STEP:
        # The ranks agree on steps through int64 collectives: a larger one fails there, mid-save.
        raise ValueError(f"{call}: step must be at most {MAX_STEP} (2**63 - 1), got {value}")
    return value


def _check_metadata(metadata: Any, call: str) -> dict[str, Any]:
    """User metadata goes into MANIFEST.json: a dict of JSON values, checked before anything is written."""
    if metadata is None:
        return {}
    if not isinstance(metadata, Mapping):
        raise TypeError(f"{call}: metadata must be a dict of JSON values, got {type(metadata).__name__}")
    try:
        checked = _METADATA.validate_python(dict(metadata))
        encoded = json.dumps(checked).encode()
    except (ValidationError, TypeError, ValueError, RecursionError) as e:
        where = ""
        if isinstance(e, ValidationError) and e.errors():
            loc = e.errors()[0].get("loc", ())
            where = "".join(f"[{p!r}]" for p in loc[:1]) or ""
        raise TypeError(
            f"{call}: metadata{where} is not JSON (numbers, strings, bools, None, lists, dicts with str keys); "
            "convert tensors with float(...) or .tolist()"
        ) from None
    try:
        check_json_depth(encoded, MAX_JSON_DEPTH - 3)  # the manifest nests it 2 levels deep, readers allow 64
    except ValueError:
        raise ValueError(f"{call}: metadata nests more than {MAX_JSON_DEPTH - 3} levels deep") from None
    bad = _not_utf8(checked, "metadata")  # nested at most MAX_JSON_DEPTH levels: no recursion limit
    if bad is not None:
        where, text = bad
        # json.dumps escapes a lone surrogate (\udcff), so the checks above took it; the manifest is
        # written as UTF-8, which has no such character: the commit failed, on every later save too.
        raise ValueError(
            f"{call}: {where} is not valid UTF-8: {text!r} holds a lone surrogate, as a file name "
            "that is not UTF-8 does when Python decodes it (os.listdir, sys.argv, os.environ), and the "
            "manifest is UTF-8 JSON. Record it as text, e.g. os.fsencode(name).decode(errors='replace'), "
            "or its bytes' .hex()"
        )
    checked = _non_finite_as_text(checked)  # nested at most MAX_JSON_DEPTH levels: no recursion limit
    encoded = json.dumps(checked, allow_nan=False).encode()
    if len(encoded) > _MAX_METADATA_BYTES:
        raise ValueError(
            f"{call}: metadata is {len(encoded)} bytes as JSON, more than {_MAX_METADATA_BYTES}; it goes into "
            "every manifest: keep it to small values (loss, tokens seen) and save bulky data as state"
        )
    return checked


def _not_utf8(value: Any, where: str) -> tuple[str, str] | None:
    """Where in ``value`` (JSON: dicts, lists, strings, numbers), named ``where``, a key or a string
    is that UTF-8 cannot encode (a lone surrogate), with it: ``("metadata['files'][0]", text)`` or
    ``("a key of metadata['files']", key)``; None when every one encodes."""
    if isinstance(value, str):
        return None if encodes_as_utf8(value) else (where, value)
    if isinstance(value, dict):
        for key, item in value.items():
            if not encodes_as_utf8(key):
                return (f"a key of {where}", key)
            found = _not_utf8(item, f"{where}[{key!r}]")
            if found is not None:
                return found
    elif isinstance(value, list):
        for i, item in enumerate(value):
            found = _not_utf8(item, f"{where}[{i}]")
            if found is not None:
                return found
    return None


def encodes_as_utf8(text: str) -> bool:
    """Whether UTF-8 can encode ``text``: not when it holds a lone surrogate, as a name that is not
    UTF-8 does once Python decoded it (``os.listdir``, ``os.environ``: ``surrogateescape``)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _non_finite_as_text(value: Any) -> Any:
    """``value`` with each NaN or infinity made the string ``"nan"``, ``"inf"`` or ``"-inf"``.

    JSON has no such numbers: the manifest would hold ``null``, and a loss that went NaN (the one
    value worth seeing then) would read as never recorded. ``float()`` of the string gives it back.
    """
    if isinstance(value, float) and not math.isfinite(value):
        return str(float(value))  # a float subclass (numpy.float64) spelled as Python spells it
    if isinstance(value, dict):
        return {k: _non_finite_as_text(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_non_finite_as_text(v) for v in value]
    return value
