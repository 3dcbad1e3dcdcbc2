"""The Checkpointer's O_DIRECT saves on the filesystem store: on by default on a local block
filesystem, off with ``direct_io=False`` or SPOTJOB_DIRECT_IO=0; either way what is committed
restores bit-exactly, sync and async. What the page cache holds of the committed shard is read
from the kernel (mincore): nothing either way (direct writes bypass it; buffered ones are dropped
once written back), so which path wrote it is told by whether a direct writer was opened."""

from __future__ import annotations

import ctypes
import mmap
import os
import sys
from pathlib import Path

import pytest

from agent import _dcp
from agent._direct_io import DirectWriter, suits_direct_io
from agent.checkpoint import Checkpointer

sys.path.insert(0, str(Path(__file__).resolve().parent / "scripts"))
from ckpt_compare import assert_same
from ckpt_state import make_state, snapshot, train

pytestmark = pytest.mark.skipif(not hasattr(os, "O_DIRECT"), reason="O_DIRECT is Linux's")


def cached_pages(path: Path) -> int:
    """How many of the file's pages are in the page cache now (mincore(2) on a private mapping,
    which reads nothing: it only asks the kernel)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    size = path.stat().st_size
    pages = -(-size // mmap.PAGESIZE)
    vec = ctypes.create_string_buffer(pages)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY) as m:
        anchor = ctypes.c_char.from_buffer(m)
        try:
            if libc.mincore(ctypes.addressof(anchor), size, vec) != 0:
                raise OSError(ctypes.get_errno(), "mincore failed")
        finally:
            del anchor
    return sum(b & 1 for b in vec.raw)


def shard(ckpt_dir: Path) -> Path:
    (found,) = ckpt_dir.glob("step-*/__0_0.distcp")
    return found


@pytest.mark.parametrize("async_save", [True, False], ids=["async", "sync"])
@pytest.mark.parametrize("direct_io", [None, True, False], ids=["default", "direct", "buffered"])
def test_a_save_restores_bit_exactly_with_or_without_o_direct(
    tmp_path: Path, direct_io: bool | None, async_save: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if direct_io is not False and not suits_direct_io(str(tmp_path)):
        pytest.skip(f"{tmp_path} is not on a local block filesystem")
    opened: list[str] = []
    real_open_direct = _dcp.open_direct

    def spy(path: str) -> DirectWriter | None:
        opened.append(os.path.basename(path))
        return real_open_direct(path)

    monkeypatch.setattr(_dcp, "open_direct", spy)
    state = make_state(0)
    train(state, 2)
    with Checkpointer(str(tmp_path / "ckpt"), keep=None, async_save=async_save, direct_io=direct_io) as ckpt:
        assert ckpt._direct_io is (direct_io is not False)
        ckpt.save(2, state)
        ckpt.wait()
    saved = snapshot(state)
    written = shard(tmp_path / "ckpt")
    assert (written.name in opened) is (direct_io is not False)
    assert cached_pages(written) == 0  # either way, nothing of the checkpoint is left in the cache
    fresh = make_state(0, seed=7)
    with Checkpointer(str(tmp_path / "ckpt")) as again:
        assert again.restore(fresh) == 2
    assert_same(snapshot(fresh), saved, "the restored state")


def test_the_environment_turns_o_direct_off_and_an_argument_wins_over_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not suits_direct_io(str(tmp_path)):
        pytest.skip(f"{tmp_path} is not on a local block filesystem")
    monkeypatch.setenv("SPOTJOB_DIRECT_IO", "0")
    with Checkpointer(str(tmp_path / "a")) as ckpt:
        assert ckpt.config.direct_io is False and ckpt._direct_io is False
    with Checkpointer(str(tmp_path / "b"), direct_io=True) as ckpt:
        assert ckpt._direct_io is True
    monkeypatch.setenv("SPOTJOB_DIRECT_IO", "sometimes")
    with pytest.raises(ValueError, match="SPOTJOB_DIRECT_IO='sometimes' is not a boolean"):
        Checkpointer(str(tmp_path / "c"))


def test_a_direct_io_that_is_not_a_bool_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="direct_io must be True, False or None"):
        Checkpointer(str(tmp_path / "ckpt"), direct_io="yes")  # type: ignore[arg-type]
    assert not (tmp_path / "ckpt").exists()
