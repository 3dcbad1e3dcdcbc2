"""CRC32C of bytes and files, and of concatenations, rendered the way the manifest stores it.

The arithmetic is ``awscrt.checksums`` (the AWS Common Runtime, already installed for boto3's
CRC32C support): hardware CRC32C on any bytes-like object, memoryviews of live buffers included,
with the GIL released while it runs, so a writer thread can checksum one block while another
thread writes the previous one; and ``combine_crc32c``, the CRC32C of ``A + B`` from the CRCs of
``A`` and ``B`` and the length of ``B``, which lets parts checksummed in parallel be joined without
reading them again.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Sequence
from typing import BinaryIO

from awscrt import checksums

CHUNK = 8 * 1024 * 1024

Buffer = bytes | bytearray | memoryview


def crc32c_bytes(data: Buffer, crc: int = 0) -> int:
    """CRC32C of ``data``, continuing from ``crc`` (the CRC32C of what came before it)."""
    return int(checksums.crc32c(data, crc))


def crc32c_combine(crc1: int, crc2: int, len2: int) -> int:
    """CRC32C of ``A + B`` from ``crc1 = crc32c(A)``, ``crc2 = crc32c(B)`` and ``len2 = len(B)``."""
    return int(checksums.combine_crc32c(crc1, crc2, len2))


def crc32c_concat(parts: Sequence[tuple[int, int]]) -> int:
    """CRC32C of consecutive pieces given as ``(crc32c, length)``, in order."""
    crc = 0
    for part_crc, length in parts:
        crc = crc32c_combine(crc, part_crc, length)
    return crc


def crc32c_stream(stream: BinaryIO, chunk: int = CHUNK) -> tuple[int, int]:
    """Return (crc32c, size) of everything left in ``stream``."""
    crc = 0
    size = 0
    buf = bytearray(chunk)
    view = memoryview(buf)
    while True:
        n = stream.readinto(view)  # type: ignore[attr-defined]
        if not n:
            return crc, size
        crc = crc32c_bytes(view[:n], crc)
        size += n


def crc32c_file(path: str | os.PathLike[str]) -> tuple[int, int]:
    """Return (crc32c, size) of a local file."""
    with open(path, "rb", buffering=0) as f:
        return crc32c_stream(f)


def crc32c_file_parallel(
    path: str | os.PathLike[str], parallelism: int = 4, piece: int = 64 * 1024 * 1024, *, fd: int | None = None
) -> tuple[int, int]:
    """(crc32c, size) of a local file read in ``piece``-sized ranges by up to ``parallelism`` threads,
    their CRCs combined: the disk gets several reads in flight and the checksum runs on every core
    (awscrt releases the GIL), so a cold file is checked at the speed it can be read. ``fd``: the
    file already open (read from its start, left open), ``path`` then only names it in errors."""
    from concurrent.futures import ThreadPoolExecutor

    owned = fd is None
    if fd is None:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        size = os.fstat(fd).st_size
        ranges = [(off, min(piece, size - off)) for off in range(0, size, piece)]
        if len(ranges) <= 1 or parallelism <= 1:
            os.lseek(fd, 0, os.SEEK_SET)
            with open(fd, "rb", buffering=0, closefd=False) as f:
                return crc32c_stream(f)
        with contextlib.suppress(OSError, AttributeError):
            os.posix_fadvise(fd, 0, size, os.POSIX_FADV_WILLNEED)  # start reading it all now
        local = threading.local()

        def one(offset: int, length: int) -> int:
            buf = getattr(local, "buf", None)
            if buf is None:
                buf = local.buf = memoryview(bytearray(CHUNK))
            crc = 0
            end = offset + length
            while offset < end:
                n = os.preadv(fd, [buf[: min(CHUNK, end - offset)]], offset)
                if n <= 0:
                    raise OSError(f"{path} shrank while being read")
                crc = crc32c_bytes(buf[:n], crc)
                offset += n
            return crc

        with ThreadPoolExecutor(max_workers=min(parallelism, len(ranges)), thread_name_prefix="spotjob-crc") as pool:
            crcs = list(pool.map(lambda r: one(*r), ranges))
        return crc32c_concat([(c, length) for c, (_, length) in zip(crcs, ranges, strict=True)]), size
    finally:
        if owned:
            os.close(fd)


def to_hex(crc: int) -> str:
    return f"{crc & 0xFFFFFFFF:08x}"


def from_hex(text: str) -> int:
    return int(text, 16)
