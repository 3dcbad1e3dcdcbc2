"""The Checkpointer changes nothing the process owns: torch's serialization options, the warning
filters, the state it saves. spotjob's own files skip torch.save's zip CRC-32 (the manifest's
CRC32C covers them), but only spotjob's: a ``torch.save`` the user makes meanwhile, in any thread,
keeps its CRC-32.
"""

from __future__ import annotations

import io
import subprocess
import sys
import threading
import warnings
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.filesystem import FileSystemWriter

from agent._dcp_write import save_tensor_without_crc
from agent.checkpoint import Checkpointer

sys.path.insert(0, str(Path(__file__).resolve().parent / "scripts"))
from ckpt_compare import assert_same
from ckpt_state import make_state, snapshot, train

# torch.distributed.checkpoint itself installs a filter at import (sympy's, through torch's
# symbolic shapes): imported first, so that only what spotjob adds is compared.
IMPORT_CHANGES_NOTHING = """
import warnings, torch, torch.distributed.checkpoint, torch.distributed.checkpoint.state_dict
filters, crc = list(warnings.filters), torch.serialization.get_crc32_options()
import agent, agent.checkpoint
assert warnings.filters == filters, [f for f in warnings.filters if f not in filters]
assert torch.serialization.get_crc32_options() == crc
print("unchanged")
"""


def test_importing_the_checkpointer_changes_no_warning_filter_and_no_torch_option() -> None:
    out = subprocess.run([sys.executable, "-c", IMPORT_CHANGES_NOTHING], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "unchanged", out.stderr


@pytest.mark.parametrize("async_save", [True, False], ids=["async", "sync"])
def test_saving_and_restoring_alone_warns_nothing_and_changes_no_filter_or_option(
    tmp_path: Path, async_save: bool
) -> None:
    filters = list(warnings.filters)
    state = make_state(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with Checkpointer(str(tmp_path / "ckpt"), async_save=async_save) as ckpt:
            train(state, 1)
            ckpt.save(1, state)
        with Checkpointer(str(tmp_path / "ckpt")) as again:
            assert again.restore(make_state(0, seed=3)) == 1
    assert [str(w.message) for w in caught] == []
    assert warnings.filters == filters
    assert torch.serialization.get_crc32_options() is True


@pytest.mark.parametrize("async_save", [True, False], ids=["async", "sync"])
def test_a_save_before_the_optimizers_first_step_changes_nothing_of_the_training(
    tmp_path: Path, async_save: bool
) -> None:
    """For an optimizer without state, torch's ``get_optimizer_state_dict`` first runs a step with
    zero gradients and lr 0 on it: Adam then holds step 1 and zero moments (its first real step
    runs as its second) and its step hooks run. A save of step 0 must change nothing, and a run
    resumed from it must train as one that never saved."""
    uri = str(tmp_path / "ckpt")
    uninterrupted = make_state(0)
    train(uninterrupted, 3)

    saved = make_state(0)
    hooked: list[int] = []
    saved["optim"].register_step_post_hook(lambda *_: hooked.append(1))
    with Checkpointer(uri, async_save=async_save) as ckpt:
        ckpt.save(0, saved)
    assert saved["optim"].state_dict()["state"] == {} and hooked == []
    assert all(p.grad is None for p in saved["model"].parameters())
    train(saved, 3)
    assert_same(snapshot(saved), snapshot(uninterrupted), "a run that saved step 0")

    resumed = make_state(0, seed=3)
    with Checkpointer(uri) as ckpt:
        assert ckpt.restore(resumed) == 0
    assert resumed["optim"].state_dict()["state"] == {}
    train(resumed, 3)
    assert_same(snapshot(resumed), snapshot(uninterrupted), "a run resumed from step 0")


def zip_crcs_hold(path: Path) -> bool:
    """Every record of a torch.save zip carries a CRC-32 that matches its bytes."""
    with zipfile.ZipFile(path) as z:
        return z.testzip() is None and all(i.CRC != 0 for i in z.infolist() if i.file_size)


@pytest.mark.parametrize("async_save", [True, False], ids=["async", "sync"])
def test_a_users_torch_save_during_a_spotjob_save_keeps_its_zip_crc32(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, async_save: bool
) -> None:
    user_files: list[Path] = []
    finish = FileSystemWriter.finish

    def finish_while_the_user_saves(self: FileSystemWriter, *args: Any, **kwargs: Any) -> None:
        # Deep inside spotjob's save (DCP has written the shards, the metadata comes next), the
        # user's own thread saves a file of its own.
        path = tmp_path / f"user-{len(user_files)}.pt"
        user = threading.Thread(target=torch.save, args=({"w": torch.randn(256)}, path))
        user.start()
        user.join()
        user_files.append(path)
        finish(self, *args, **kwargs)

    monkeypatch.setattr(FileSystemWriter, "finish", finish_while_the_user_saves)
    state = make_state(0)
    with Checkpointer(str(tmp_path / "ckpt"), keep=None, async_save=async_save) as ckpt:
        for step in (1, 2):
            train(state, 1, start=step - 1)
            ckpt.save(step, state)
    assert len(user_files) == 2, "the user's saves did not run during spotjob's"
    assert all(zip_crcs_hold(p) for p in user_files), "a user's torch.save lost its CRC-32 to spotjob's save"
    assert torch.serialization.get_crc32_options() is True


def test_spotjobs_own_tensor_records_skip_the_zip_crc32_and_load_back_exactly() -> None:
    tensor = torch.randn(64, 3)
    buf = io.BytesIO()
    save_tensor_without_crc(tensor, buf)
    with zipfile.ZipFile(io.BytesIO(buf.getvalue())) as z:
        assert [i.CRC for i in z.infolist() if i.file_size and i.filename.endswith("/data/0")] == [0]
    assert torch.equal(torch.load(io.BytesIO(buf.getvalue()), weights_only=True), tensor)
    assert torch.serialization.get_crc32_options() is True
