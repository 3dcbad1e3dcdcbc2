"""The Checkpointer's O_DIRECT saves on the filesystem store: on by default on a local block
filesystem for shards of ``DIRECT_MIN_BYTES`` or more (any size with ``direct_io=True``), off
with ``direct_io=False`` or SPOTJOB_DIRECT_IO=0; either way what is committed
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
import torch

from agent import _dcp_write, _direct_io
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


def spy_on_direct_opens(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the files a direct writer is opened for, from now on."""
    opened: list[str] = []
    real_open_direct = _dcp_write.open_direct

    def spy(path: str) -> DirectWriter | None:
        opened.append(os.path.basename(path))
        return real_open_direct(path)

    monkeypatch.setattr(_dcp_write, "open_direct", spy)
    return opened


@pytest.mark.parametrize("async_save", [True, False], ids=["async", "sync"])
@pytest.mark.parametrize(
    ("direct_io", "small_shards_direct", "expect_direct"),
    [(None, True, True), (None, False, False), (True, False, True), (False, True, False)],
    ids=["default", "default-small-shard", "direct", "buffered"],
)
def test_a_save_restores_bit_exactly_with_or_without_o_direct(
    tmp_path: Path,
    direct_io: bool | None,
    small_shards_direct: bool,
    expect_direct: bool,
    async_save: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``small_shards_direct``: the size under which the default writes a shard through the page
    cache is lowered to one byte, so this small state's shard is over it. Without that, the
    default writes it buffered and only ``direct_io=True`` writes it directly."""
    if direct_io is not False and not suits_direct_io(str(tmp_path)):
        pytest.skip(f"{tmp_path} is not on a local block filesystem")
    if small_shards_direct:
        monkeypatch.setattr(_direct_io, "DIRECT_MIN_BYTES", 1)
    opened = spy_on_direct_opens(monkeypatch)
    state = make_state(0)
    train(state, 2)
    with Checkpointer(str(tmp_path / "ckpt"), keep=None, async_save=async_save, direct_io=direct_io) as ckpt:
        assert ckpt._direct_io is (direct_io is not False)
        ckpt.save(2, state)
        ckpt.wait()
    saved = snapshot(state)
    written = shard(tmp_path / "ckpt")
    assert (written.name in opened) is expect_direct
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


@pytest.mark.parametrize(("over", "direct"), [(0, True), (1, False)], ids=["at-the-size", "one-byte-under"])
def test_the_default_writes_a_shard_directly_from_the_size_on_and_through_the_page_cache_under_it(
    tmp_path: Path, over: int, direct: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A shard's size is its tensors' bytes: a Linear(64, 32) is 64*32 + 32 float32 values."""
    if not suits_direct_io(str(tmp_path)):
        pytest.skip(f"{tmp_path} is not on a local block filesystem")
    monkeypatch.setattr(_direct_io, "DIRECT_MIN_BYTES", (64 * 32 + 32) * 4 + over)
    opened = spy_on_direct_opens(monkeypatch)
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 32)
    with Checkpointer(str(tmp_path / "ckpt"), keep=None, async_save=False) as ckpt:
        ckpt.save(1, {"model": model})
    assert (shard(tmp_path / "ckpt").name in opened) is direct
    fresh = torch.nn.Linear(64, 32)
    with Checkpointer(str(tmp_path / "ckpt")) as again:
        assert again.restore({"model": fresh}) == 1
    assert torch.equal(fresh.weight, model.weight) and torch.equal(fresh.bias, model.bias)
