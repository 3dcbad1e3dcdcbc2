"""Shards written with O_DIRECT (agent._direct_io) through ChecksummedFile: the same bytes and CRC32C
as a buffered write, whatever the sizes; a filesystem that refuses O_DIRECT at open or at a write
gets a buffered file; a write error reaches the caller and leaves no file."""

from __future__ import annotations

import errno
import os
import threading
from pathlib import Path
from typing import Any

import pytest

from agent import _direct_io
from agent._dcp_write import ChecksummedFile, SaveCancelledError
from agent._direct_io import ALIGN, BLOCK, filesystem_type, suits_direct_io
from agent.crc32c import crc32c_bytes, crc32c_file

pytestmark = pytest.mark.skipif(not hasattr(os, "O_DIRECT"), reason="O_DIRECT is Linux's")


@pytest.fixture
def direct_dir(tmp_path: Path) -> Path:
    if not suits_direct_io(str(tmp_path)):
        pytest.skip(f"{tmp_path} is on {filesystem_type(str(tmp_path))}, not a local block filesystem")
    return tmp_path


def pieces(sizes: list[int]) -> list[bytes]:
    return [os.urandom(n) for n in sizes]


@pytest.mark.parametrize(
    "sizes",
    [
        [],
        [1],
        [ALIGN - 1],
        [ALIGN],
        [ALIGN + 1],
        [BLOCK - 1],
        [BLOCK],
        [BLOCK + 1],
        [100, 3 * BLOCK + 123, 7, 2 << 20, 5],  # headers, a big tensor, a pickle, a 2 MiB tensor
    ],
    ids=lambda sizes: "+".join(str(n) for n in sizes) or "empty",
)
def test_a_direct_write_holds_exactly_the_bytes_given_and_their_crc(direct_dir: Path, sizes: list[int]) -> None:
    path = str(direct_dir / "shard")
    data = pieces(sizes)
    with ChecksummedFile(path, direct=True) as f:
        assert f.direct
        for piece in data:
            f.write(piece)
    whole = b"".join(data)
    assert (f.crc, f.size) == (crc32c_bytes(whole), len(whole))
    assert (f.crc, f.size) == crc32c_file(path)
    with open(path, "rb") as g:
        assert g.read() == whole  # the zero padding of the last block was cut off


def test_without_direct_the_same_bytes_go_through_the_page_cache(tmp_path: Path) -> None:
    path = str(tmp_path / "shard")
    data = pieces([10, BLOCK + 5])
    with ChecksummedFile(path, writeback=True) as f:
        assert not f.direct
        for piece in data:
            f.write(piece)
    assert (f.crc, f.size) == crc32c_file(path) == (crc32c_bytes(b"".join(data)), BLOCK + 15)


def test_a_filesystem_refusing_o_direct_at_open_gets_a_buffered_file(
    direct_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_open = os.open

    def no_direct(path: Any, flags: int, *args: Any) -> int:
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument", path)
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", no_direct)
    path = str(direct_dir / "shard")
    data = os.urandom(BLOCK + 77)
    with ChecksummedFile(path, direct=True) as f:
        f.write(data)
    assert not f.direct
    assert Path(path).read_bytes() == data and f.crc == crc32c_bytes(data)


def test_a_filesystem_refusing_a_direct_write_gets_the_rest_buffered(
    direct_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_pwrite = os.pwrite
    refused: list[int] = []

    def refuse_the_second_write(fd: int, data: Any, offset: int) -> int:
        if offset > 0 and not refused and fcntl_flags(fd) & os.O_DIRECT:
            refused.append(offset)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", refuse_the_second_write)
    path = str(direct_dir / "shard")
    data = os.urandom(3 * BLOCK + 5)
    with ChecksummedFile(path, direct=True) as f:
        f.write(data)
        writer = f._direct
    assert refused == [BLOCK]
    assert writer is not None and not writer.direct
    assert Path(path).read_bytes() == data and (f.crc, f.size) == crc32c_file(path)


def fcntl_flags(fd: int) -> int:
    import fcntl

    return fcntl.fcntl(fd, fcntl.F_GETFL)


def test_a_write_error_is_raised_at_close_and_leaves_no_file(direct_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def full(fd: int, data: Any, offset: int) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwrite", full)
    path = direct_dir / "shard"
    with pytest.raises(OSError) as raised, ChecksummedFile(str(path), direct=True) as f:
        f.write(os.urandom(2 * BLOCK + 1))  # write() never raises (torch's zip writer calls it)
    assert raised.value.errno == errno.ENOSPC
    assert not path.exists()


def test_a_cancelled_direct_write_stops_and_leaves_no_file(direct_dir: Path) -> None:
    path = direct_dir / "shard"
    cancel = threading.Event()
    with pytest.raises(SaveCancelledError), ChecksummedFile(str(path), direct=True, cancel=cancel) as f:
        f.write(os.urandom(2 << 20))
        cancel.set()
        f.write(os.urandom(2 << 20))
        f.check()
    assert not path.exists()


def test_the_buffers_are_kept_between_files_until_released(direct_dir: Path) -> None:
    _direct_io.release_buffers()
    with ChecksummedFile(str(direct_dir / "a"), direct=True) as f:
        f.write(os.urandom(ALIGN))
        first = set(map(id, f._direct._buffers)) if f._direct else set()
    assert len(_direct_io._POOL._free) == _direct_io.DEPTH
    with ChecksummedFile(str(direct_dir / "b"), direct=True) as f:
        f.write(os.urandom(ALIGN))
        assert f._direct is not None and set(map(id, f._direct._buffers)) == first
    _direct_io.release_buffers()
    assert _direct_io._POOL._free == []


MOUNTS = """\
/dev/vda / ext4 rw,relatime 0 0
tmpfs /dev/shm tmpfs rw 0 0
server:/export /mnt/nfs nfs4 rw 0 0
/dev/nvme1n1 /mnt/nvme xfs rw 0 0
/dev/nvme2n1 /mnt/my\\040disk btrfs rw 0 0
overlay /mnt/nvme/overlaid overlay rw 0 0
"""


@pytest.mark.parametrize(
    ("path", "fstype", "direct"),
    [
        ("/work/ckpt", "ext4", True),
        ("/dev/shm/ckpt", "tmpfs", False),
        ("/mnt/nfs/job/ckpt", "nfs4", False),
        ("/mnt/nvme/ckpt", "xfs", True),
        ("/mnt/nvme/overlaid/ckpt", "overlay", False),  # the longest mount point above the path wins
        ("/mnt/nvme2/ckpt", "ext4", True),  # /mnt/nvme is not a folder above /mnt/nvme2
        ("/mnt/my disk/ckpt", "btrfs", True),
    ],
)
def test_o_direct_is_the_default_on_local_block_filesystems_only(path: str, fstype: str, direct: bool) -> None:
    assert filesystem_type(path, MOUNTS) == fstype
    assert suits_direct_io(path, MOUNTS) is direct
