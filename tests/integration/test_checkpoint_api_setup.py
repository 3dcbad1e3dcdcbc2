"""The Checkpointer used in setups other than "build after init_process_group, call from the
training process, close before destroy_process_group": each one is a clear error before anything
is written, never a save or restore that acts as the wrong rank or from the wrong process.

The multi-rank cases run two real torchrun ranks (``scripts/ckpt_api_setup.py``): both
scenarios in one torchrun, one after the other, each with its own URI and its own lines.
"""

from __future__ import annotations

import logging
import sys
import threading
from pathlib import Path

import pytest
import torch

from agent.catalog import list_checkpoints
from agent.checkpoint import Checkpointer, _restore
from agent.checkpoint.config import MAX_STEP
from agent.storage import open_storage

sys.path.insert(0, str(Path(__file__).resolve().parent / "scripts"))
import ckpt_harness as harness
from ckpt_state import make_state, train

SETUP = harness.SCRIPTS / "ckpt_api_setup.py"


def committed_steps(uri: str) -> list[int]:
    return sorted(s.ref.step for s in list_checkpoints(open_storage(uri)) if s.valid)


@pytest.fixture(scope="module")
def setups(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, str], str]:
    """The ranks' output of both scenarios (run in one torchrun: built-before-init, then
    destroyed-first), each scenario's URI, a folder of its own, and the ranks' logs."""
    tmp = tmp_path_factory.mktemp("api-setup")
    uris = {scenario: str(tmp / scenario / "ckpt") for scenario in ("built-before-init", "destroyed-first")}
    proc = harness.torchrun(2, SETUP, *(arg for item in uris.items() for arg in item))
    return proc.stdout, uris, proc.stderr


@pytest.mark.slow
def test_a_checkpointer_built_before_init_process_group_refuses_to_act_as_rank_0_on_every_rank(
    setups: tuple[str, dict[str, str], str],
) -> None:
    """Built before the group existed, it took itself for a lone process: every rank saved as
    rank 0 into the same folder, and a restore loaded whichever rank's files were there."""
    out, uris, _ = setups
    uri = uris["built-before-init"]
    for rank in (0, 1):
        for call in ("restore", "step", "save"):
            said = f"built-before-init rank{rank} {call} RuntimeError: {call}(): this Checkpointer was built before "
            assert said in out, out
        assert f"but this process is rank {rank} of 2. Build the Checkpointer after init_process_group()" in out
    assert committed_steps(uri) == []
    assert not list(Path(uri).glob("step-*"))


@pytest.mark.slow
def test_destroying_the_process_group_before_close_is_named_in_the_errors(
    setups: tuple[str, dict[str, str], str],
) -> None:
    """The save in flight fails on each rank with one line saying why, not torch's 15-line
    traceback ending in "Group ... is not registered"."""
    out, uris, logs = setups
    uri = uris["destroyed-first"]
    told = [line for line in logs.splitlines() if "checkpoint of step 2 failed" in line]
    assert len(told) == 2 and all("process group was destroyed while it was in flight" in t for t in told), logs
    assert "is not registered" not in logs, logs
    for rank in (0, 1):
        said = f"destroyed-first rank{rank} step RuntimeError: step(): torch.distributed's process group was destroyed"
        assert said in out, out
        assert f"destroyed-first rank{rank} close SaveFailedError: checkpoint of step 2" in out, out
        closed = out.split(f"destroyed-first rank{rank} close ")[1].splitlines()[0]
        assert "call close() before destroy_process_group()" in closed
    assert committed_steps(uri) == [1], "the save that lost its collectives commits nothing"


class _CallsTheCheckpointer(torch.utils.data.Dataset[str]):
    """A dataset whose items call the Checkpointer: in a DataLoader worker, a forked copy of it."""

    def __init__(self, ckpt: Checkpointer, state: dict[str, object]) -> None:
        self.ckpt, self.state = ckpt, state

    def __len__(self) -> int:
        return 1

    def __getitem__(self, index: int) -> str:
        try:
            self.ckpt.step(100, self.state)
        except RuntimeError as e:
            return str(e)
        return "stepped"


def test_a_forked_data_loader_worker_cannot_save_its_copy_of_the_state(tmp_path: Path) -> None:
    """The worker's copy of the Checkpointer committed step 100 with the worker's copy of the
    state: a checkpoint of the job, above the training's, that the next restore would load."""
    uri = str(tmp_path / "ckpt")
    state = make_state(0)
    with Checkpointer(uri, every_steps=1) as ckpt:
        train(state, 1)
        loader = torch.utils.data.DataLoader(
            _CallsTheCheckpointer(ckpt, state), batch_size=None, num_workers=1, multiprocessing_context="fork"
        )
        (answer,) = list(loader)
        assert answer.startswith("step(): called in process ") and "e.g. in a DataLoader worker" in answer
        ckpt.step(1, state)
    assert committed_steps(uri) == [1]


def test_a_step_beyond_int64_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    """The ranks agree on steps in int64 tensors: a larger step failed mid-save with torch's
    "Overflow when unpacking long long"."""
    uri = str(tmp_path / "ckpt")
    state = make_state(0)
    with Checkpointer(uri, every_steps=1) as ckpt:
        with pytest.raises(ValueError, match=r"step\(\): step must be at most 9223372036854775807"):
            ckpt.step(MAX_STEP + 1, state)
        with pytest.raises(ValueError, match=r"save\(\): step must be at most"):
            ckpt.save(MAX_STEP + 1, state)
        ckpt.save(MAX_STEP, state)
    assert committed_steps(uri) == [MAX_STEP]


def test_a_checkpointer_built_again_without_close_restores_the_save_the_previous_one_has_in_flight(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A script that builds a Checkpointer per epoch and never closes the previous one: the new
    one's restore() listed the URI while the old one's save of the epoch just done was still
    writing, and loaded the checkpoint before it into the live model (training rolled back by an
    epoch, without a word). The old save's commit is held at one seam (``_commit``) until the new
    restore has listed the checkpoints or said that it waits for that save, so the order is fixed."""

    uri = str(tmp_path / "ckpt")
    state = make_state(0)
    release = threading.Event()
    listing = _restore.find_checkpoints

    def listed(storage: object) -> object:
        release.set()
        return listing(storage)  # type: ignore[arg-type]

    class _Waiting(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "has a save in flight" in record.getMessage():
                release.set()

    handler = _Waiting()
    logging.getLogger("agent.checkpoint").addHandler(handler)
    monkeypatch.setattr(_restore, "find_checkpoints", listed)
    try:
        old = Checkpointer(uri)
        commit = old._commit

        def held(*args: object) -> str:
            release.wait(60)
            return commit(*args)  # type: ignore[arg-type]

        monkeypatch.setattr(old, "_commit", held)
        train(state, 1)
        old.save(1, state)
        new = Checkpointer(uri)
        train(state, 1, start=1)  # what the old save holds differs from the live model
        assert new.restore(state) == 1
        new.close()
    finally:
        logging.getLogger("agent.checkpoint").removeHandler(handler)
        release.set()
    assert committed_steps(uri) == [1]
