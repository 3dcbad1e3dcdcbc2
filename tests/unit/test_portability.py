"""spotjob off Linux (a user's macOS laptop): every Linux-only call has a guard, and the path
taken without it still works. This machine is Linux, so each test simulates the other platform at
the one seam the code looks at (an attribute that is not there, ``/proc`` that cannot be opened,
``sys.platform``) and runs the real code and real processes behind it; each test's docstring says
what it simulates and what it does not model. Nothing here has run on macOS itself.
"""

from __future__ import annotations

import errno
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from agent.atomic_file import write_atomic
from agent.checkpoint import Checkpointer
from agent.storage.file import FileStorage
from tests.ckpt_compare import assert_same_training_state

REPO = Path(__file__).resolve().parents[2]
MACOS_F_FULLFSYNC = 51
"""``F_FULLFSYNC`` in macOS's <fcntl.h>; on Linux ``fcntl`` refuses this command with ``EINVAL``."""


# -- durability: F_FULLFSYNC where the platform has it --------------------------------------------


class FullFsyncs:
    """Records ``fcntl(fd, F_FULLFSYNC)`` and ``os.fsync(fd)`` by the inode they reached."""

    def __init__(self) -> None:
        self.full: set[int] = set()
        self.plain: set[int] = set()


@pytest.fixture
def macos_fullfsync(monkeypatch: pytest.MonkeyPatch) -> Iterator[FullFsyncs]:
    """``fcntl.F_FULLFSYNC`` exists and works, as on macOS; ``os.fsync`` still works but is recorded."""
    seen = FullFsyncs()
    real_fcntl, real_fsync = fcntl.fcntl, os.fsync

    def fake_fcntl(fd: Any, cmd: int, arg: Any = 0) -> Any:
        if cmd == MACOS_F_FULLFSYNC:
            os.fdatasync(fd)  # Linux's nearest: the bytes do get synced, so the save is real
            seen.full.add(os.fstat(fd).st_ino)
            return 0
        return real_fcntl(fd, cmd, arg)

    def recorded_fsync(fd: int) -> None:
        seen.plain.add(os.fstat(fd).st_ino)
        real_fsync(fd)

    monkeypatch.setattr(fcntl, "F_FULLFSYNC", MACOS_F_FULLFSYNC, raising=False)
    monkeypatch.setattr(fcntl, "fcntl", fake_fcntl)
    monkeypatch.setattr(os, "fsync", recorded_fsync)
    yield seen


class Small(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 8)
        self.b = nn.Parameter(torch.randn(300, 300))  # 360 KB: a tensor restored in place


def trained(seed: int) -> tuple[Small, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = Small()
    optim = torch.optim.AdamW(model.parameters())
    (model.a(torch.randn(4, 16)).sum() + model.b.sum()).backward()
    optim.step()
    return model, optim


def test_every_fsync_of_a_checkpoints_commit_is_a_full_fsync_where_the_platform_has_one(
    tmp_path: Path, macos_fullfsync: FullFsyncs
) -> None:
    """On macOS, fsync(2) leaves the bytes in the drive's cache, which a power cut loses:
    a checkpoint whose MANIFEST.json (or shard) was only fsynced can be gone after the crash it
    was written for. Every sync of the commit (each shard, the manifest, the folders their names
    are in) must be ``fcntl(F_FULLFSYNC)`` where it exists.

    Simulates macOS by giving ``fcntl`` an ``F_FULLFSYNC`` (recorded, then synced with Linux's
    fdatasync); a real Checkpointer saves and restores on a real folder. Does not model a drive
    cache or a power cut, nor APFS."""
    model, optim = trained(0)
    root = tmp_path / "ckpt"
    with Checkpointer(str(root), async_save=False) as ckpt:
        ckpt.save(5, {"model": model, "optim": optim})
    step_folder = next(p for p in root.iterdir() if p.is_dir() and (p / "MANIFEST.json").exists())
    committed = {p.name: p.stat().st_ino for p in step_folder.iterdir()}
    assert "MANIFEST.json" in committed and len(committed) > 1, committed
    not_full = sorted(name for name, ino in committed.items() if ino not in macos_fullfsync.full)
    assert not not_full, f"committed without F_FULLFSYNC: {not_full}"
    assert step_folder.stat().st_ino in macos_fullfsync.full, "the checkpoint's folder was not full-synced"
    assert not macos_fullfsync.plain, "a plain fsync where F_FULLFSYNC exists"
    fresh, fresh_optim = trained(1)
    with Checkpointer(str(root)) as ckpt:
        assert ckpt.restore({"model": fresh, "optim": fresh_optim}) == 5
    assert_same_training_state(model, fresh, optim, fresh_optim)


def test_a_filesystem_without_full_fsync_gets_a_plain_fsync(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """SMB and some network mounts on macOS refuse F_FULLFSYNC (ENOTSUP/EINVAL): the write still
    happens, with fsync, the most that filesystem offers (SQLite does the same).

    Simulates macOS's constant only: the real Linux ``fcntl`` refuses command 51 with EINVAL, as
    such a filesystem would. Does not model a real SMB mount."""
    synced: list[int] = []
    real_fsync = os.fsync

    def recorded_fsync(fd: int) -> None:
        synced.append(fd)
        real_fsync(fd)

    monkeypatch.setattr(fcntl, "F_FULLFSYNC", MACOS_F_FULLFSYNC, raising=False)
    monkeypatch.setattr(os, "fsync", recorded_fsync)
    storage = FileStorage(str(tmp_path))
    storage.put_bytes_if_absent("step-1/MANIFEST.json", b"{}")
    write_atomic(str(tmp_path / "status.json"), b"{}")
    assert (tmp_path / "step-1" / "MANIFEST.json").read_bytes() == b"{}"
    assert (tmp_path / "status.json").read_bytes() == b"{}"
    assert len(synced) >= 4  # two files and their folders


def test_a_full_fsync_that_fails_with_an_io_error_fails_the_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An EIO from F_FULLFSYNC means bytes may be lost: it is raised, not papered over by a
    plain fsync that could then report success, and no temp file is left.

    Simulates macOS's ``F_FULLFSYNC`` failing with EIO; does not model a failing disk."""

    def failing(fd: Any, cmd: int, arg: Any = 0) -> Any:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(fcntl, "F_FULLFSYNC", MACOS_F_FULLFSYNC, raising=False)
    monkeypatch.setattr(fcntl, "fcntl", failing)
    with pytest.raises(OSError) as raised:
        write_atomic(str(tmp_path / "MANIFEST.json"), b"{}")
    assert raised.value.errno == errno.EIO
    assert os.listdir(tmp_path) == []
