"""CRC32C of bytes and files, rendered the way the manifest stores it (8 lowercase hex digits)."""

from __future__ import annotations

import os
from typing import BinaryIO

import google_crc32c

CHUNK = 8 * 1024 * 1024


def crc32c_bytes(data: bytes, crc: int = 0) -> int:
    return int(google_crc32c.extend(crc, data))


def crc32c_stream(stream: BinaryIO, chunk: int = CHUNK) -> tuple[int, int]:
    """Return (crc32c, size) of everything left in ``stream``."""
    crc = 0
    size = 0
    while True:
        data = stream.read(chunk)
        if not data:
            return crc, size
        crc = int(google_crc32c.extend(crc, data))
        size += len(data)


def crc32c_file(path: str | os.PathLike[str]) -> tuple[int, int]:
    """Return (crc32c, size) of a local file."""
    with open(path, "rb") as f:
        return crc32c_stream(f)


def to_hex(crc: int) -> str:
    return f"{crc & 0xFFFFFFFF:08x}"


def from_hex(text: str) -> int:
    return int(text, 16)
