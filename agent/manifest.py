"""MANIFEST.json: the commit record of one checkpoint. No torch import.

A checkpoint folder counts only once its manifest exists (written last, create-only). The manifest
lists every file of the checkpoint with its size and CRC32C, so a reader can tell a complete,
intact checkpoint from a torn or tampered one without trusting anything else in the folder.
"""

from __future__ import annotations

import json
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

MANIFEST_NAME = "MANIFEST.json"
FORMAT_VERSION = 1
DCP_METADATA_NAME = ".metadata"


class ManifestError(ValueError):
    """A manifest that cannot be trusted: unparsable, a newer format, or unsafe paths."""


def check_relative_path(path: str) -> str:
    """Accept only plain relative paths that stay inside the checkpoint folder."""
    if not path or path.startswith(("/", "\\")) or "\\" in path or ":" in path.split("/")[0]:
        raise ValueError(f"path {path!r} is not relative to the checkpoint folder")
    parts = path.split("/")
    if any(p in ("", ".", "..") for p in parts):
        raise ValueError(f"path {path!r} escapes or is not normalised within the checkpoint folder")
    if "\x00" in path:
        raise ValueError(f"path {path!r} contains a NUL byte")
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
    job: str | None = None
    state_keys: list[str] = Field(description="the keys of the state dict handed to save()")
    files: list[FileEntry]
    tensors: dict[str, TensorEntry] = Field(default_factory=dict)
    metadata: dict[str, JsonValue] = Field(default_factory=dict, description="user metadata")
    trigger: str | None = Field(
        default=None,
        description="what started the save: 'policy' (every_steps/every_seconds), 'flush' (a preemption "
        "notice), 'early' (the agent's save-early request) or 'save' (an explicit save() call)",
    )

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
        """Parse and validate; raise ``ManifestError`` saying what is wrong."""
        try:
            raw: Any = json.loads(data)
        except (ValueError, UnicodeDecodeError) as e:
            raise ManifestError(f"MANIFEST.json is not valid JSON: {e}") from None
        try:
            return cls.model_validate(raw)
        except ValidationError as e:
            first = e.errors()[0]
            where = ".".join(str(p) for p in first.get("loc", ()))
            raise ManifestError(f"MANIFEST.json is invalid at {where or 'top level'}: {first['msg']}") from None


def now_utc() -> datetime:
    return datetime.now(UTC)
