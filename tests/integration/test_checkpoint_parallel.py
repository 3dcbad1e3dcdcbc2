"""Parallel layouts beyond data parallel and 1-D FSDP2, on torchrun ranks over gloo (CPU): tensor
parallel (DTensor), 2-D FSDP2 + tensor parallel, and pipeline stages (each rank holds other
submodules). Every rank must get its own tensors, optimizer state, loader position and RNG back.

Starting the ranks (importing torch) is most of each case's cost, so the 2-rank cases run as two
torchruns for the module: every save (each to its own folder) in one, then every restore (each
from its own copy of the checkpoint it reads) in another, each case with its own model and
Checkpointer (``--then`` in the rank script). A 2-rank restore never runs in a process that saved.
The 2-D mesh needs 4 ranks: one 4-rank torchrun saves it, then restores it on the same mesh as a
case of its own (a second 4-rank launch cost ~13 CPU-seconds; the restoring case builds its model
with other weights and reseeds the RNG, so only the restore can bring the saved values back), and
its restore with the dp degree halved is one of the 2-rank restores.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "scripts"))
import ckpt_harness as harness

pytestmark = pytest.mark.slow

SCRIPT = harness.SCRIPTS / "ckpt_parallel.py"

Dumps = list[dict[str, Any]]

# The 2-rank saves: case -> the rank script's arguments.
SAVES: dict[str, tuple[str, ...]] = {
    "pp": ("pp", "--optim", "rank"),
    "pp_sync": ("pp", "--optim", "rank", "--sync"),
    "pp_by_name": ("pp",),
    "pp_empty_stage": ("pp", "--optim", "none", "--split", "d", "--sync"),
    "shards": ("shards",),
    "shards_sync": ("shards", "--sync"),
    "shards_frozen": ("shards", "--frozen", "--sync"),
    "replicas": ("shards", "--replicas", "rank0"),
    "tp": ("tp",),
}

# The 2-rank restores: case -> (the save it reads, the rank script's arguments).
RESTORES: dict[str, tuple[str, tuple[str, ...]]] = {
    "pp_same": ("pp", ("pp", "--optim", "rank", "--restore")),
    "pp_other_split": ("pp", ("pp", "--optim", "none", "--restore", "--split", "b")),
    "pp_dropped": ("pp_sync", ("pp", "--optim", "rank", "--restore", "--split", "c")),
    "pp_moved": ("pp_sync", ("pp", "--optim", "rank", "--restore", "--split", "b")),
    "pp_empty_stage_moved": ("pp_empty_stage", ("pp", "--optim", "none", "--restore", "--split", "a")),
    "pp_empty_stage_back": ("pp_empty_stage", ("pp", "--optim", "none", "--restore", "--split", "d")),
    "replicas": ("replicas", ("shards", "--replicas", "rank0", "--restore")),
    "tp": ("tp", ("tp", "--restore")),
    "dp_tp_halved": ("dp_tp", ("dp_tp", "--restore")),  # the 4-rank save's, on a (1, 2) mesh
}


def run_cases(world: int, root: Path, cases: dict[str, tuple[str, ...]]) -> dict[str, Dumps]:
    """Run every case in one torchrun, case ``c`` on ``root/c/ckpt``; each case's ranks' dumps."""
    argv: list[str] = []
    for case, args in cases.items():
        argv += [*(["--then"] if argv else []), *args, "--uri", str(root / case / "ckpt")]
        argv += ["--dump", str(root / case / "dump")]
        (root / case).mkdir(exist_ok=True)
    harness.torchrun(world, SCRIPT, *argv)
    return {c: [json.loads((root / c / f"dump.r{r}.json").read_text()) for r in range(world)] for c in cases}


@pytest.fixture(scope="module")
def saves(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Dumps]]:
    """Every 2-rank save, each in its own folder; (the root, each case's dumps)."""
    root = tmp_path_factory.mktemp("saves")
    return root, run_cases(2, root, SAVES)


@pytest.fixture(scope="module")
def mesh_2d(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Dumps]]:
    """The 4-rank torchrun: FSDP2 + tensor parallel on a (2, 2) mesh saves (``dp_tp``), then
    restores that checkpoint on the same mesh (``dp_tp_same``, a case of its own after the save's
    has closed); (the root, each case's dumps)."""
    root = tmp_path_factory.mktemp("mesh-2d")
    (root / "dp_tp").mkdir()
    save = ["dp_tp", "--sync", "--uri", str(root / "dp_tp" / "ckpt"), "--dump", str(root / "dp_tp" / "dump")]
    same = ["dp_tp", "--restore", "--uri", str(root / "dp_tp" / "ckpt"), "--dump", str(root / "dp_tp" / "same")]
    harness.torchrun(4, SCRIPT, *save, "--then", *same)
    return root, {
        c: [json.loads((root / "dp_tp" / f"{label}.r{r}.json").read_text()) for r in range(4)]
        for c, label in (("dp_tp", "dump"), ("dp_tp_same", "same"))
    }


@pytest.fixture(scope="module")
def restores(
    saves: tuple[Path, dict[str, Dumps]],
    mesh_2d: tuple[Path, dict[str, Dumps]],
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[str, Dumps]:
    """Every 2-rank restore, each from its own copy of the checkpoint it reads."""
    root = tmp_path_factory.mktemp("restores")
    for case, (source, _) in RESTORES.items():
        saved = mesh_2d[0] if source in mesh_2d[1] else saves[0]
        shutil.copytree(saved / source / "ckpt", root / case / "ckpt")
    return run_cases(2, root, {case: args for case, (_, args) in RESTORES.items()})


def whole(dumps: Dumps) -> dict[str, float]:
    """Every rank's tensor digests by name, as one model (ranks holding a name agree on it)."""
    merged: dict[str, float] = {}
    for dump in dumps:
        for name, value in dump["tensors"].items():
            assert merged.setdefault(name, value) == value, f"ranks disagree on {name}"
    return merged


def assert_resumed(saved: Dumps, restored: Dumps) -> None:
    for rank, (before, after) in enumerate(zip(saved, restored, strict=True)):
        assert "error" not in after, f"rank {rank}: {after.get('error')}"
        assert after["start"] == 2
        assert (after["pos"], after["rng"]) == (before["pos"], before["rng"]), f"rank {rank}'s own state"
        assert after["tensors"] == before["tensors"], f"rank {rank}'s tensors"


def test_pipeline_stages_restore_on_the_same_layout(
    saves: tuple[Path, dict[str, Dumps]], restores: dict[str, Dumps]
) -> None:
    """Each rank holds other layers (no tensor on every rank) and keeps its optimizer as a per-rank
    object: every rank gets its stage's tensors, optimizer, loader position and RNG back. Before,
    restore refused the checkpoint it had just saved ("model.l2.weight: the checkpoint holds it,
    the model does not"), judging each rank's stage against the whole checkpoint."""
    saved = saves[1]["pp"]
    assert "error" not in saved[0], saved[0]
    assert_resumed(saved, restores["pp_same"])


def test_pipeline_stages_missing_a_layer_on_every_rank_are_refused_naming_it(
    saves: tuple[Path, dict[str, Dumps]], restores: dict[str, Dumps]
) -> None:
    """A split that leaves a saved layer on no rank is refused before anything is loaded, naming
    it; and the per-rank optimizer of a stage that holds other layers refuses, never loads into
    other parameters (pins behaviour: the recipe's names check)."""
    assert [d.get("error") for d in saves[1]["pp_sync"]] == [None, None]
    for dump in restores["pp_dropped"]:
        assert "RestoreRefusedError" in dump["error"]
        assert "model.l1.weight: the checkpoint holds it, the model does not on any rank" in dump["error"]
    for dump in restores["pp_moved"]:
        assert "RestoreRefusedError" in dump["error"] and "this stage has" in dump["error"], dump["error"]


@pytest.mark.parametrize("sync", [False, True])
def test_rank_specific_tensors_under_one_name_are_refused_not_merged(
    saves: tuple[Path, dict[str, Dumps]], sync: bool
) -> None:
    """Tensor-parallel shards kept as plain tensors: every rank's model.l0.weight is its own. DCP
    keeps one copy of a name several ranks hold, so before, the save committed and every rank
    restored a mix of rank 0's and rank 1's tensors without a word. Now the save fails on every
    rank, naming the tensor and the ranks, and commits nothing. (Detected from a sample of each
    tensor's bytes: tensors that differ in a few elements only may pass, as README says.)"""
    for dump in saves[1]["shards_sync" if sync else "shards"]:
        assert "SaveFailedError" in dump["error"], dump
        assert "ranks 0 and 1 hold different values under the name model.l0.weight" in dump["error"]


def test_frozen_shards_of_a_trained_module_are_still_compared(saves: tuple[Path, dict[str, Dumps]]) -> None:
    """The same shards with model.l0 frozen and left out of the optimizer: its weights are still
    compared (and named first), as the module's other layers are trained. Only a state module that
    nothing trains and no DDP holds (an EMA, a teacher) is saved from rank 0 unchecked; an earlier
    version of that rule judged each parameter alone and let frozen layers through unchecked."""
    root, dumps = saves
    for dump in dumps["shards_frozen"]:
        assert "SaveFailedError" in dump["error"], dump
        assert "ranks 0 and 1 hold different values under the name model.l0.weight" in dump["error"]
        assert "DTensor" in dump["error"]
    assert not list((root / "shards_frozen" / "ckpt").glob("step-*")), "a checkpoint was committed"


def test_replicas_that_differ_on_purpose_save_rank_0s_copy_with_replicas_rank0(
    saves: tuple[Path, dict[str, Dumps]], restores: dict[str, Dumps]
) -> None:
    """Local SGD and DiLoCo let the replicas drift between synchronisations: with replicas="rank0"
    such a save commits, and every rank restores rank 0's copy of every tensor (a mix of the ranks'
    copies, as DCP's spreading of the writes would give, is never restored)."""
    saved = saves[1]["replicas"]
    assert [d.get("error") for d in saved] == [None, None]
    assert saved[0]["tensors"] != saved[1]["tensors"], "the replicas should differ"
    for dump in restores["replicas"]:
        assert "error" not in dump, dump.get("error")
        model = {k: v for k, v in dump["tensors"].items() if k.startswith("model.")}
        assert model == {k: v for k, v in saved[0]["tensors"].items() if k.startswith("model.")}


def test_pipeline_stages_restore_the_model_by_name_on_another_split(
    saves: tuple[Path, dict[str, Dumps]], restores: dict[str, Dumps]
) -> None:
    """Layers saved by stages l0+l1 | l2+l3 restore into stages l0 | l1+l2+l3 by name: every
    layer lands on the rank that now holds it, with the values it was saved with."""
    saved, moved = saves[1]["pp"], restores["pp_other_split"]
    assert [d.get("error") for d in moved] == [None, None]
    assert whole(moved) == {k: v for k, v in whole(saved).items() if k.startswith("model.")}
    assert sorted(moved[0]["tensors"]) == ["model.l0.bias", "model.l0.weight"]


def test_pipeline_stages_with_the_optimizer_saved_by_name_are_refused(saves: tuple[Path, dict[str, Dumps]]) -> None:
    """Each stage's optimizer has one parameter group of other parameters, saved under the same
    name (optim.param_groups.0.params): before, one stage's list was kept and the other stages'
    optimizer state could never be matched on restore. The save now fails naming it and the
    remedy (a per-rank optimizer, README's 'Pipeline stages')."""
    root, dumps = saves
    for dump in dumps["pp_by_name"]:
        assert "under the name optim.param_groups.0.params" in dump["error"], dump
        assert "per-rank object" in dump["error"]
    assert not list((root / "pp_by_name" / "ckpt").glob("step-*")), "a checkpoint was committed"


def test_a_pipeline_stage_without_parameters_does_not_hang_the_save_or_the_restore(
    saves: tuple[Path, dict[str, Dumps]], restores: dict[str, Dumps]
) -> None:
    """Rank 1's stage holds no parameters and the state keeps no optimizer by name (a model alone,
    or README's per-rank StageOptimizer): rank 1 has nothing for DCP. Before, it skipped DCP's
    collective save, rank 0 waited in it, and the save never finished (nor would the restore).
    Now both ranks take part: the save commits, and restores on another split by name."""
    saved = saves[1]["pp_empty_stage"]
    assert [d.get("error") for d in saved] == [None, None]
    moved = restores["pp_empty_stage_moved"]
    assert [d.get("error") for d in moved] == [None, None]
    assert whole(moved) == {k: v for k, v in whole(saved).items() if k.startswith("model.")}
    back = restores["pp_empty_stage_back"]
    assert [d.get("error") for d in back] == [None, None] and back[1]["tensors"] == {}


def test_tensor_parallel_restores_every_shard_and_every_ranks_own_state(
    saves: tuple[Path, dict[str, Dumps]], restores: dict[str, Dumps]
) -> None:
    """parallelize_module (Colwise/Rowwise) on a CPU mesh: DTensor parameters and Adam state,
    saved asynchronously, come back shard for shard; the loader and RNG per rank (pins behaviour
    that already worked)."""
    saved = saves[1]["tp"]
    assert "error" not in saved[0], saved[0]
    assert_resumed(saved, restores["tp"])


def test_fsdp_and_tensor_parallel_on_a_2d_mesh_restore_with_the_dp_degree_changed(
    mesh_2d: tuple[Path, dict[str, Dumps]], restores: dict[str, Dumps]
) -> None:
    """FSDP2 over "dp" and tensor parallel over "tp" on a (2, 2) mesh: restores exactly on the same
    mesh, and on (1, 2) (tp kept, dp halved) with the same whole tensors, ranks 0 and 1 getting
    their own loader position and RNG back (pins behaviour that already worked)."""
    saved = mesh_2d[1]["dp_tp"]
    assert "error" not in saved[0], saved[0]
    assert_resumed(saved, mesh_2d[1]["dp_tp_same"])
    halved = restores["dp_tp_halved"]
    assert [d.get("error") for d in halved] == [None, None]
    assert whole(halved) == whole(saved)
    assert [(d["start"], d["pos"], d["rng"]) for d in halved] == [(2, d["pos"], d["rng"]) for d in saved[:2]]
