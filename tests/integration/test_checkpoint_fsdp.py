"""FSDP2-sharded modules on torchrun ranks over gloo: DTensor parameters, restored through DCP's
generic path (resharding, optimizer targets created for the load).

A checkpoint saved by 2 ranks restores bit-exact on 1 and 3. One saved before the optimizer's
first step changes nothing of the training: neither the run that saved it (torch would first run a
zero-lr step that gives Adam step 1 and zero moments) nor a run resumed from it.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent / "scripts"))
import ckpt_harness as harness
from ckpt_compare import assert_same

pytestmark = pytest.mark.slow

SCRIPT = harness.SCRIPTS / "ckpt_fsdp.py"


def load(prefix: Path, label: str) -> Any:
    return torch.load(f"{prefix}.{label}.pt", weights_only=False)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Four 2-rank runs: ``plain`` trains 3 steps and never saves, ``saved`` trains 3 and saves
    steps 0 and 2 in ``ckpt``, ``early`` saves step 0 alone in ``ckpt0`` and trains none, and
    ``resumed`` restores that (the latest there) and trains to step 3. All run in one torchrun
    (each with its own model, optimizer, seed and Checkpointer), ``plain`` first, so no save has
    happened in the process when ``plain`` trains: starting the ranks is most of the cost (a
    torchrun of its own for ``resumed`` cost ~7 CPU-seconds). ``resumed`` builds its model from
    another seed, so only its restore can give it step 0's weights."""
    tmp = tmp_path_factory.mktemp("fsdp")
    harness.torchrun(
        2,
        SCRIPT,
        *("--dump", str(tmp / "plain"), "--steps", "3", "--then"),
        *("--dump", str(tmp / "saved"), "--uri", str(tmp / "ckpt"), "--save-at", "0", "2", "--steps", "3", "--then"),
        *("--dump", str(tmp / "early"), "--uri", str(tmp / "ckpt0"), "--save-at", "0", "--then"),
        *("--dump", str(tmp / "resumed"), "--uri", str(tmp / "ckpt0"), "--restore", "--steps", "3"),
    )
    return tmp


def test_a_save_before_the_optimizers_first_step_changes_nothing_of_the_training(runs: Path) -> None:
    assert load(runs / "saved", "step0")["optim"] == {}, "the save of step 0 gave the optimizer state"
    assert_same(load(runs / "saved", "end"), load(runs / "plain", "end"), "a run that saved step 0")


def test_a_run_resumed_from_before_the_first_step_trains_as_one_never_saved(runs: Path) -> None:
    assert load(runs / "early", "step0")["optim"] == {}, "the save of step 0 gave the optimizer state"
    assert load(runs / "resumed", "restored")["optim"] == {}
    assert_same(load(runs / "resumed", "restored"), load(runs / "early", "step0"), "the state restored from step 0")
    assert_same(load(runs / "resumed", "end"), load(runs / "plain", "end"), "a run resumed from step 0")


@pytest.mark.parametrize("world", [1, 3])
def test_restores_bit_exact_on_a_different_world_size(runs: Path, tmp_path: Path, world: int) -> None:
    harness.torchrun(world, SCRIPT, "--dump", str(tmp_path / "restored"), "--uri", str(runs / "ckpt"), "--restore")
    restored = load(tmp_path / "restored", "restored")
    assert restored["optim"], "the optimizer state of step 2 was not restored"
    assert_same(restored, load(runs / "saved", "step2"), f"the state of step 2 restored on {world} rank(s)")
