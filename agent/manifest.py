"""MANIFEST.json: the commit record of one checkpoint. No torch import.

A checkpoint folder counts only once its manifest exists (written last, create-only). The manifest
lists every file of the checkpoint with its size and CRC32C, so a reader can tell a complete,
intact checkpoint from a torn or tampered one without trusting anything else in the folder.
"""

from __future__ import annotations

import bisect
import json
import re
from datetime import UTC, datetime
from typing import Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    JsonValue,
    ValidationError,
    field_validator,
    model_validator,
)

from agent.version import spotjob_version

MANIFEST_NAME = "MANIFEST.json"
FORMAT_VERSION = 1
DCP_METADATA_NAME = ".metadata"
DCP_SHARD_SUFFIX = ".distcp"
"""DCP's shard files (``__<rank>_<n>.distcp``), which only its ``.metadata`` can read."""
CACHE_SUFFIXES = (".lock", ".verified")
"""What the node's restore cache keeps beside each file of a checkpoint (``agent.restore_cache``):
a lock, and the marker saying what the file was verified as. No checkpoint file ends so."""
RANK_FILE_RE = re.compile(r"^rank-\d{5,}\.pt$")


def rank_file_name(rank: int) -> str:
    """The per-rank state file of ``rank`` (RNG streams and non-module state), one per rank."""
    return f"rank-{rank:05d}.pt"


MAX_MANIFEST_BYTES = 64 * 2**20
"""The largest MANIFEST.json a reader accepts (and a writer may commit). A manifest lists every
tensor with every shard file holding part of it, so thousands of FSDP-sharded tensors over a
thousand ranks reach tens of MiB; anything bigger is refused unread."""
MAX_JSON_DEPTH = 64
"""The deepest nesting of arrays and objects a manifest (user metadata included) may have. The
manifest's own structure needs 4; Python's json recurses once per level, so a crafted file nested
100 000 deep would raise RecursionError out of any reader without this bound."""

_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.S)
_JSON_BRACKET = re.compile(rb"[\[\]{}]")


class ManifestError(ValueError):
    """A manifest that cannot be trusted: unparsable, a newer format, or unsafe paths."""


class NewerFormatError(ManifestError):
    """A manifest in a format newer than ``FORMAT_VERSION``, or with fields this spotjob does not
    know (and nothing else wrong): written by a newer spotjob. It proves
    nothing bad about the checkpoint, only that this spotjob cannot read it: restore stops there
    (an older checkpoint would be going back in time) and retention leaves it alone."""


class UntrustedJSONError(ValueError):
    """Bytes read from storage that are not JSON within spotjob's bounds (size, depth)."""


def check_json_depth(data: bytes, max_depth: int = MAX_JSON_DEPTH) -> None:
    """Raise ``UntrustedJSONError`` when ``data`` nests arrays/objects deeper than ``max_depth``.

    Scans the bytes without parsing (strings blanked first, then brackets counted), so it never
    recurses; for valid JSON the count is exact, for invalid JSON it is an upper bound on how deep
    ``json.loads`` could get before failing.
    """
    depth = 0
    for m in _JSON_BRACKET.finditer(_JSON_STRING.sub(b'""', data)):
        if m.group() in (b"[", b"{"):
            depth += 1
            if depth > max_depth:
                raise UntrustedJSONError(f"nested more than {max_depth} levels deep")
        else:
            depth -= 1


def loads_bounded(data: bytes, *, max_bytes: int, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """``json.loads`` for bytes read from storage: size and depth checked first, so that untrusted
    bytes fail with ``UntrustedJSONError`` (a ``ValueError``) and never with ``RecursionError``."""
    if len(data) > max_bytes:
        raise UntrustedJSONError(f"{len(data)} bytes, more than the {max_bytes} allowed")
    check_json_depth(data, max_depth)
    try:
        return json.loads(data)
    except (ValueError, UnicodeDecodeError) as e:
        raise UntrustedJSONError(f"not valid JSON: {e}") from None
    except RecursionError:  # unreachable after check_json_depth; kept so no reader can crash
        raise UntrustedJSONError("nested too deeply") from None


MAX_PATH_BYTES = 1024
"""The longest file name (UTF-8, relative to the checkpoint folder) a manifest may list. S3 and GCS
refuse object names over 1024 bytes with the URI's prefix included, so no checkpoint a store holds
lists a longer one; the bound keeps a crafted name from costing time or memory per character."""


def check_relative_path(path: str) -> str:
    """Accept only plain relative paths that stay inside the checkpoint folder."""
    if len(path.encode("utf-8", "surrogatepass")) > MAX_PATH_BYTES:
        raise ValueError(f"path {path[:64]!r}... is longer than the {MAX_PATH_BYTES} bytes a file name may have")
    if not path or path.startswith(("/", "\\")) or "\\" in path or ":" in path.split("/")[0]:
        raise ValueError(f"path {path!r} is not relative to the checkpoint folder")
    parts = path.split("/")
    if any(p in ("", ".", "..") for p in parts):
        raise ValueError(f"path {path!r} escapes or is not normalised within the checkpoint folder")
    if "\x00" in path:
        raise ValueError(f"path {path!r} contains a NUL byte")
    if any(ord(c) < 0x20 or 0x7F <= ord(c) < 0xA0 for c in path):
        # spotjob names no file so; each reason naming the file would carry them into the logs (a
        # newline forging a line of its own) and into terminals (escape sequences).
        raise ValueError(f"path {path!r} contains a control character")
    return path


class FileEntry(BaseModel):
    """One file of the checkpoint, relative to its folder."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    path: str
    size: int = Field(ge=0)
    crc32c: str = Field(pattern=r"^[0-9a-f]{8}$", description="CRC32C, 8 lowercase hex digits")

    @field_validator("path")
    @classmethod
    def _check_path(cls, v: str) -> str:
        return check_relative_path(v)


class TensorEntry(BaseModel):
    """Where a tensor lives, in the spirit of Hugging Face's ``model.safetensors.index.json``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    shape: list[int]
    dtype: str
    files: list[str] = Field(description="the shard files holding (parts of) this tensor")


class Manifest(BaseModel):
    """Versioned commit record; field names are the JSON keys."""

    model_config = ConfigDict(extra="forbid")

    format_version: int = FORMAT_VERSION
    step: int = Field(ge=0, description="completed training steps the checkpoint holds")
    world_size: int = Field(ge=1)
    created_at: datetime
    torch_version: str
    job: str | None = Field(default=None, description="the job that wrote it (see agent.ownership)")
    attempt: int | None = Field(
        default=None,
        ge=0,
        description="the controller's attempt number of the writer (SPOTJOB_ATTEMPT); None: not run by a "
        "controller, never fenced (see agent.ownership)",
    )
    state_keys: list[str] = Field(description="the keys of the state dict handed to save()")
    files: list[FileEntry]
    tensors: dict[str, TensorEntry] = Field(default_factory=dict)
    metadata: dict[str, JsonValue] = Field(default_factory=dict, description="user metadata")
    trigger: str | None = Field(
        default=None,
        description="what started the save: 'policy' (every_steps/every_seconds), 'flush' (a preemption "
        "notice), 'early' (the agent's save-early request) or 'save' (an explicit save() call)",
    )

    @field_validator("created_at", mode="after")
    @classmethod
    def _utc_if_zoneless(cls, value: datetime) -> datetime:
        """spotjob writes UTC; a time without a zone (a manifest written by hand or another tool)
        is read as UTC, so comparing it with the controller's clock cannot fail."""
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value

    @model_validator(mode="after")
    def _consistent(self) -> Manifest:
        if self.format_version > FORMAT_VERSION:
            raise ValueError(
                f"manifest format {self.format_version} is newer than this spotjob reads "
                f"({FORMAT_VERSION}); upgrade spotjob"
            )
        names = [f.path for f in self.files]
        if len(set(names)) != len(names):
            raise ValueError("manifest lists a file twice")
        if MANIFEST_NAME in names:
            raise ValueError("manifest lists itself")
        ordered = sorted(names)
        for name in names:
            # A name is a folder of another when some name starts with it and "/": in sorted order
            # the first name at or after ``name + "/"`` does, if any does. (Collecting every folder
            # of every name instead costs the square of a name's depth: a crafted name of 40 000
            # levels took 16 s and 1.5 GB.)
            i = bisect.bisect_left(ordered, name + "/")
            if i < len(ordered) and ordered[i].startswith(name + "/"):
                # No filesystem (a restore cache, a file:// store) holds a file and a folder of one name.
                raise ValueError(f"manifest lists {name!r} both as a file and as a folder of other files")
            if name.endswith(CACHE_SUFFIXES):
                raise ValueError(
                    f"manifest lists {name!r}, a name the restore cache keeps beside a file for itself "
                    f"(names ending in {' or '.join(CACHE_SUFFIXES)})"
                )
        known = set(names)
        for fqn, t in self.tensors.items():
            for f in t.files:
                if f not in known:
                    raise ValueError(f"tensor {fqn!r} points at {f!r}, which the manifest does not list")
        return self

    def file(self, path: str) -> FileEntry | None:
        for f in self.files:
            if f.path == path:
                return f
        return None

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    def to_json(self) -> bytes:
        return self.model_dump_json(indent=2).encode()

    @classmethod
    def parse(cls, data: bytes) -> Manifest:
        """Parse and validate; raise ``ManifestError`` saying what is wrong (never anything else):
        ``NewerFormatError`` for a manifest a newer spotjob wrote."""
        try:
            raw: Any = loads_bounded(data, max_bytes=MAX_MANIFEST_BYTES)
        except UntrustedJSONError as e:
            raise ManifestError(f"MANIFEST.json is refused: {e}") from None
        version = raw.get("format_version") if isinstance(raw, dict) else None
        if isinstance(version, int) and not isinstance(version, bool) and version > FORMAT_VERSION:
            raise NewerFormatError(
                f"MANIFEST.json is in format {version}, newer than this spotjob reads ({FORMAT_VERSION}): "
                f"it was written by a newer spotjob than this one (spotjob {spotjob_version()}); upgrade spotjob "
                "to restore it"
            )
        try:
            return cls.model_validate(raw)
        except ValidationError as e:
            errors = e.errors()
            if all(err["type"] == "extra_forbidden" for err in errors):
                # Fields this spotjob does not know: a newer one wrote them, and what they say (a
                # file's encoding, say) may change how the bytes read. Not proven bad: never
                # restored past, never deleted, as for a newer format_version.
                unknown = ", ".join(".".join(str(p) for p in err.get("loc", ())) for err in errors[:5])
                raise NewerFormatError(
                    f"MANIFEST.json has fields this spotjob does not know ({unknown}): it was written by a "
                    f"newer spotjob than this one (spotjob {spotjob_version()}, format {FORMAT_VERSION}); upgrade "
                    "spotjob to restore it"
                ) from None
            first = errors[0]
            where = ".".join(str(p) for p in first.get("loc", ()))
            raise ManifestError(f"MANIFEST.json is invalid at {where or 'top level'}: {first['msg']}") from None


def now_utc() -> datetime:
    return datetime.now(UTC)
