"""A DDP job with BatchNorm resumes bit-identical to an uninterrupted run.

Each DDP rank's forward updates its BatchNorm running statistics from its own batch; DDP's next
forward overwrites every rank's with rank 0's. So the checkpoint must hold rank 0's buffers: DCP
keeps one copy of a name every rank holds, and left alone takes it from whichever rank has the
least to write, which for a buffer may be rank 1's statistics: the resumed run then continues on
statistics the uninterrupted one never had.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent / "scripts"))
import ckpt_harness as harness
from ckpt_compare import assert_same

pytestmark = pytest.mark.slow

JOB = harness.SCRIPTS / "ckpt_ddp_buffers.py"


MODES = pytest.mark.parametrize("mode", ["async", "sync"])


def dumped(dump: Path, command: str) -> list[dict]:
    """Each rank's dump of one case; a case that raised left its traceback instead."""
    ranks = [torch.load(f"{dump}.{command}.rank{r}.pt") for r in range(2)]
    for rank, out in enumerate(ranks):
        assert "error" not in out, f"rank {rank}'s {command} case failed:\n{out['error']}"
    return ranks


@pytest.fixture(scope="module")
def saves(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One torchrun for every case that saves: ``full`` (train 6 steps, save step 3), ``ema`` and
    ``order`` (each saves and restores in its own run), each with async and with sync saves. Each
    case seeds and builds its own model, optimizer and Checkpointer under its own
    ``<root>/<command>-<mode>/``, as the six separate runs this replaced did (a launch of
    torchrun and two ranks costs ~9 CPU-seconds)."""
    root = tmp_path_factory.mktemp("ddp-buffers")
    cases = ["full", "full:sync", "ema", "ema:sync", "order", "order:sync"]
    harness.torchrun(2, JOB, "cases", "--root", str(root), *cases)
    return root


@pytest.fixture(scope="module")
def restores(saves: Path) -> Path:
    """One later torchrun for the cases that only restore what ``full`` committed: ``resume`` (async
    and sync, each from ``full`` of its mode) and ``bare`` (from the sync ``full``). A process of
    its own, so the restores read the checkpoints from the store, not from anything the saving
    process kept."""
    harness.torchrun(2, JOB, "cases", "--root", str(saves), "resume", "resume:sync", "bare:sync")
    return saves


@MODES
def test_a_ddp_job_with_batchnorm_resumes_bit_identical_to_an_uninterrupted_one(restores: Path, mode: str) -> None:
    full_dump, dump = restores / f"full-{mode}" / "dump", restores / f"resume-{mode}" / "dump"
    full, resumed = dumped(full_dump, "full"), dumped(dump, "resume")
    saved0, saved1 = full[0]["saved"], full[1]["saved"]
    # What makes the case: the ranks' statistics differed when the save was taken.
    assert not torch.equal(saved0["1.running_mean"], saved1["1.running_mean"])
    for rank in range(2):
        assert resumed[rank]["start"] == 3
        assert_same(resumed[rank]["final"], full[rank]["final"], f"rank {rank}'s model after resuming")


def test_a_ddp_checkpoint_restores_into_the_bare_module_on_every_rank(restores: Path) -> None:
    """DDP's ``module.`` prefix is not part of the saved names: a script that unwraps (evaluation,
    export, another parallelism) restores the saved parameters and rank 0's buffers exactly."""
    full_dump, dump = restores / "full-sync" / "dump", restores / "bare-sync" / "dump"
    saved = dumped(full_dump, "full")[0]["saved"]
    for rank, bare in enumerate(dumped(dump, "bare")):
        assert bare["start"] == 3
        assert_same(bare["final"], saved, f"rank {rank}'s bare module after the restore")


@MODES
def test_an_ema_copied_before_ddp_is_saved_from_rank0_not_refused(saves: Path, mode: str) -> None:
    """timm's recipe (a seed per rank, the EMA copied before DDP wraps the model): each rank's EMA
    started from its own weights and is never bit-identical to the others'. Parameters that no
    optimizer in the state trains and no DDP keeps identical are saved from rank 0, as buffers are,
    and every rank restores rank 0's EMA. Before, every save of such a job failed ("ranks 0 and 1
    hold different values under the name ema.0.weight"); the model's own parameters, which DDP
    keeps identical, are still compared."""
    dump = saves / f"ema-{mode}" / "dump"
    ranks = dumped(dump, "ema")
    # What makes the case: the ranks' EMAs differed when the save was taken, their models did not.
    assert not torch.equal(ranks[0]["saved"]["0.weight"], ranks[1]["saved"]["0.weight"])
    assert_same(ranks[0]["model"], ranks[1]["model"], "the DDP replicas")
    for rank in range(2):
        assert ranks[rank]["start"] == 3
        assert_same(ranks[rank]["restored"], ranks[0]["saved"], f"rank {rank}'s EMA after the restore")
        assert_same(ranks[rank]["restored_model"], ranks[0]["model"], f"rank {rank}'s model after the restore")


@MODES
def test_optimizer_groups_listing_their_parameters_in_another_order_per_rank_save_and_restore(
    saves: Path, mode: str
) -> None:
    """Groups built from a set of parameters list them in another order in each process, and the
    ranks still train alike. The save-time check compared each group's list of names as it was,
    so every save failed ("ranks 0 and 1 hold different values under the name
    optim.param_groups.0.params", blaming pipeline stages). A group's names are compared as a set
    now; every rank restores each parameter's state and its group's weight decay by name."""
    dump = saves / f"order-{mode}" / "dump"
    ranks = dumped(dump, "order")
    for rank in range(2):
        saved, restored = ranks[rank]["saved"], ranks[rank]["restored"]
        assert ranks[rank]["start"] == 3
        assert restored["decay"] == saved["decay"] == {"0.weight": 0.1, "2.weight": 0.1, "0.bias": 0.0, "2.bias": 0.0}
        for name, state in saved["state"].items():
            assert_same(restored["state"][name], state, f"rank {rank}'s optimizer state of {name}")
