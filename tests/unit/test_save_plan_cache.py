"""DCP's save plans reused between a Checkpointer's saves (``agent._dcp_plan.SavePlanCache``):
planned afresh whenever the state's structure changed, and the replica check as strong as when
every save was planned afresh.

The Checkpointer tests save in one process on the filesystem store, change the state's structure,
save again and restore the second save bit for bit into a state of the new structure. The planner
tests run DCP's planning steps for several ranks in one process (each rank's planner and cache,
the coordinator's step on the gathered plans), as ``_save_state_dict`` runs them across ranks.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.planner import SavePlan

from agent._dcp_plan import DivergentReplicasError, RankZeroSavePlanner, SavePlanCache
from agent.checkpoint import Checkpointer
from agent.dcp_safe import load_dcp_metadata, tensor_index
from agent.manifest import DCP_METADATA_NAME, MANIFEST_NAME, Manifest


def _model_and_optim(width: int = 4, dtype: torch.dtype = torch.float32) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = nn.Sequential(nn.Linear(width, width), nn.Linear(width, 2)).to(dtype)
    optim = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(3, width, dtype=dtype)).float().square().sum().backward()
    optim.step()
    optim.zero_grad()
    return model, optim


def _tensors(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    out = {f"model.{k}": v for k, v in state["model"].state_dict().items()}
    optim = state["optim"].state_dict()
    for i, per_param in optim["state"].items():
        out.update({f"optim.{i}.{k}": v for k, v in per_param.items() if isinstance(v, torch.Tensor)})
    for g, group in enumerate(optim["param_groups"]):
        out[f"optim.group.{g}"] = torch.tensor([group["lr"], len(group["params"])], dtype=torch.float64)
    return out


def _add_tensor(model: nn.Module, optim: torch.optim.Optimizer) -> tuple[nn.Module, torch.optim.Optimizer]:
    model.register_buffer("seen", torch.arange(6.0))
    return model, optim


def _resize(model: nn.Module, optim: torch.optim.Optimizer) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(2)
    return _model_and_optim(width=6)


def _param_group(model: nn.Module, optim: torch.optim.Optimizer) -> tuple[nn.Module, torch.optim.Optimizer]:
    extra = nn.Parameter(torch.randn(5))
    model.register_parameter("extra", extra)
    optim.add_param_group({"params": [extra], "lr": 0.01})
    extra.grad = torch.randn(5)
    optim.step()
    return model, optim


def _dtype(model: nn.Module, optim: torch.optim.Optimizer) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(3)
    return _model_and_optim(dtype=torch.float64)  # the same sizes, another dtype


def _remove_tensor(model: nn.Module, optim: torch.optim.Optimizer) -> tuple[nn.Module, torch.optim.Optimizer]:
    model[0].bias = None  # no longer a parameter: the model and Adam's state lose a tensor each
    return model, torch.optim.Adam(model.parameters(), lr=0.1)


CHANGES: dict[str, Callable[[nn.Module, torch.optim.Optimizer], tuple[nn.Module, torch.optim.Optimizer]]] = {
    "a tensor added": _add_tensor,
    "tensors resized": _resize,
    "a param group added": _param_group,
    "the dtype changed": _dtype,
    "a tensor removed": _remove_tensor,
}


@pytest.mark.parametrize("change", list(CHANGES))
def test_a_save_after_the_structure_changed_restores_bit_exact(change: str, tmp_path: Path) -> None:
    """Saved twice as it was (the second save reuses the first one's plans), then changed and saved
    again: the last save restores bit for bit into a state of the new structure. Fails when the
    plans of the earlier saves are reused after the change (a cache that never sees a change)."""
    torch.manual_seed(1)
    model, optim = _model_and_optim()
    uri = str(tmp_path / "ckpt")
    with Checkpointer(uri, keep=None, async_save=False) as ckpt:
        ckpt.save(1, {"model": model, "optim": optim})
        ckpt.save(2, {"model": model, "optim": optim})
        model, optim = CHANGES[change](model, optim)
        ckpt.save(3, {"model": model, "optim": optim})
        saved = {k: v.clone() for k, v in _tensors({"model": model, "optim": optim}).items()}
    # A state of the same structure with other values: every value must come from the checkpoint.
    with torch.no_grad():
        for t in list(model.state_dict().values()) + [
            v for s in optim.state.values() for v in s.values() if isinstance(v, torch.Tensor)
        ]:
            t.copy_(torch.full_like(t, 7))
    for group in optim.param_groups:
        group["lr"] = 0.5
    with Checkpointer(uri, read_only=True) as reader:
        assert reader.restore({"model": model, "optim": optim}) == 3
    restored = _tensors({"model": model, "optim": optim})
    assert restored.keys() == saved.keys()
    for name, value in saved.items():
        assert restored[name].dtype == value.dtype and torch.equal(restored[name], value), name
    # MANIFEST.json's tensor index, which the second save took from the first: each step's is its own
    # .metadata's, the changed one's too.
    for folder in sorted((tmp_path / "ckpt").glob("step-*")):
        manifest = Manifest.parse((folder / MANIFEST_NAME).read_bytes())
        assert manifest.tensors == tensor_index(load_dcp_metadata((folder / DCP_METADATA_NAME).read_bytes()))


def test_saves_of_an_unchanged_state_reuse_the_first_plans(tmp_path: Path) -> None:
    """The point of the cache: the second and third saves of a state whose structure did not change
    (its values did) are not planned again, and each restores its own values."""
    torch.manual_seed(1)
    model, optim = _model_and_optim()
    uri = str(tmp_path / "ckpt")
    with Checkpointer(uri, keep=None, async_save=False) as ckpt:
        planned = []
        for step in (1, 2, 3):
            with torch.no_grad():
                model[0].weight.fill_(step)
            ckpt.save(step, {"model": model, "optim": optim})
            planned.append(ckpt._plan_cache.planned)
    assert planned == [1, 1, 1]
    with Checkpointer(uri, read_only=True) as reader:
        assert reader.restore({"model": model, "optim": optim}) == 3
    assert torch.equal(model[0].weight, torch.full((4, 4), 3.0))


def _plan_save(
    states: list[dict[str, Any]], caches: list[SavePlanCache], from_rank0: frozenset[str] = frozenset()
) -> list[SavePlan]:
    """DCP's planning of one save for ``len(states)`` ranks in this process, as ``dcp_save`` runs
    it: every rank's final plan."""
    for cache in caches:
        cache.bind(len(states))
    planners = [RankZeroSavePlanner(from_rank0, cache=cache) for cache in caches]
    for rank, (planner, state) in enumerate(zip(planners, states, strict=True)):
        planner.set_up_planner(state, None, rank == 0)
    central, _ = planners[0].create_global_plan([p.create_local_plan() for p in planners])
    return [p.finish_plan(c) for p, c in zip(planners, central, strict=True)]


def _written(plans: list[SavePlan]) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for rank, plan in enumerate(plans):
        for item in plan.items:
            out.setdefault(item.index.fqn, []).append(rank)
    return out


def test_replicas_that_differ_are_refused_when_the_plans_are_reused() -> None:
    """The replica check sees every save's values, also when no rank sends its plan: ranks that
    held the same values at the first save and hold different ones at the second (the same
    structure, so the plans are reused) are refused. Fails if the fingerprints travel only with a
    full plan."""
    caches = [SavePlanCache(), SavePlanCache()]
    states = [{"w": torch.ones(64), "step": torch.tensor(1.0)} for _ in caches]
    _plan_save(states, caches)
    states[1]["w"] = torch.ones(64) * 2
    with pytest.raises(DivergentReplicasError, match=r"ranks 0 and 1 hold different values under the name w"):
        _plan_save(states, caches)


def test_a_cache_from_another_world_size_is_not_reused() -> None:
    """A cache bound to two ranks, then used by one (the Checkpointer's cache lives in its process,
    so a restart starts empty; this is a cache handed to another group): planned afresh, every
    value written by the one rank. Without the world size check the coordinator holds two ranks'
    plans for one rank's save."""
    caches = [SavePlanCache(), SavePlanCache()]
    states = [{"w": torch.ones(64), "v": torch.zeros(64), "step": torch.tensor(1.0)} for _ in caches]
    _plan_save(states, caches)
    plans = _plan_save(states[:1], caches[:1])
    assert _written(plans) == {"w": [0], "v": [0], "step": [0]}


def test_a_changed_from_rank0_replans_from_the_cached_plans() -> None:
    """Every rank's local plan unchanged but ``from_rank0`` another: the coordinator plans afresh
    from the plans it cached, and the value it names is written by rank 0."""
    caches = [SavePlanCache() for _ in range(4)]
    states = [{f"w{i}": torch.ones(64) for i in range(8)} for _ in caches]
    first = _written(_plan_save(states, caches))
    assert sorted(r for ranks in first.values() for r in ranks) != [0] * 8  # spread over the ranks
    again = _written(_plan_save(states, caches, from_rank0=frozenset(f"w{i}" for i in range(8))))
    assert again == {f"w{i}": [0] for i in range(8)}


def test_one_rank_changed_is_planned_with_the_others_cached_plans() -> None:
    """Rank 2 alone adds a value and resizes one (a pipeline stage's state changing): it sends its
    plan, ranks 0, 1 and 3 only a marker, and the coordinator plans the save from rank 2's new plan
    and the others' cached ones: every rank writes what it would with the save planned afresh."""
    world = 4
    caches = [SavePlanCache() for _ in range(world)]

    def states() -> list[dict[str, Any]]:
        return [
            {"shared": torch.ones(64), f"own{r}": torch.full((8,), float(r)), "step": torch.tensor(1.0)}
            for r in range(world)
        ]

    before = states()
    _plan_save(before, caches)
    after = states()
    after[2]["extra"] = torch.zeros(16)
    after[2]["own2"] = torch.zeros(32)
    planned = [
        [(i.index.fqn, i.tensor_data.size if i.tensor_data else None) for i in p.items]
        for p in _plan_save(after, caches)
    ]
    afresh = [
        [(i.index.fqn, i.tensor_data.size if i.tensor_data else None) for i in p.items]
        for p in _plan_save(after, [SavePlanCache() for _ in range(world)])
    ]
    assert planned[2] != [] and ("extra", torch.Size([16])) in planned[2]
    assert ("own2", torch.Size([32])) in planned[2]
    assert [sorted(p) for p in planned] == [sorted(p) for p in afresh]


def _plan_with_metadata(states: list[dict[str, Any]], caches: list[SavePlanCache]) -> tuple[list[SavePlan], Any]:
    """``_plan_save``, and the metadata the coordinator made for the save."""
    for cache in caches:
        cache.bind(len(states))
    planners = [RankZeroSavePlanner(frozenset(), cache=cache) for cache in caches]
    for rank, (planner, state) in enumerate(zip(planners, states, strict=True)):
        planner.set_up_planner(state, None, rank == 0)
    central, metadata = planners[0].create_global_plan([p.create_local_plan() for p in planners])
    return [p.finish_plan(c) for p, c in zip(planners, central, strict=True)], metadata


def _items(plans: list[SavePlan]) -> list[list[Any]]:
    """Every rank's write items as DCP would write them (name, offsets, kind, chunk, dtype, layout,
    requires_grad, pinning, size), in order."""
    return [list(p.items) for p in plans]


def _cast(state: dict[str, Any]) -> None:
    state["w"] = state["w"].to(torch.float64)


def _reshape(state: dict[str, Any]) -> None:
    state["w"] = state["w"].reshape(8, 4)  # as many elements, another shape


def _grow(state: dict[str, Any]) -> None:
    state["w"] = torch.zeros(4, 16)


def _transposed_copy(state: dict[str, Any]) -> None:
    state["w"] = state["w"].t().contiguous()  # (8, 4): the sizes swap


def _to_value(state: dict[str, Any]) -> None:
    state["w"] = 3.5  # no longer a tensor: written as bytes


def _to_tensor(state: dict[str, Any]) -> None:
    state["lr"] = torch.tensor(0.1)


def _requires_grad(state: dict[str, Any]) -> None:
    state["w"] = state["w"].clone().requires_grad_(True)  # DCP's metadata records requires_grad


def _pinned(state: dict[str, Any]) -> None:
    state["w"] = state["w"].pin_memory()  # DCP's metadata records pin_memory; needs an accelerator


def _renamed(state: dict[str, Any]) -> None:
    state["v"] = state.pop("w")


def _reordered(state: dict[str, Any]) -> None:
    state["w"] = state.pop("w")  # the same names, in another order


def _nested(state: dict[str, Any]) -> None:
    state["opt"] = {"step": state.pop("opt.step")}  # flattens to the same name, from another place


STALE: dict[str, Callable[[dict[str, Any]], None]] = {
    "a dtype cast": _cast,
    "a reshape to as many elements": _reshape,
    "a resize": _grow,
    "a transposed contiguous copy": _transposed_copy,
    "a tensor turned into a non-tensor value": _to_value,
    "a non-tensor value turned into a tensor": _to_tensor,
    "requires_grad set": _requires_grad,
    "pinned": _pinned,
    "a name renamed": _renamed,
    "the names reordered": _reordered,
    "a name flattened from another nesting": _nested,
}


_NO_PINNING = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="pinned host memory needs a GPU (torch.cuda.is_available() is False)"
)


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("change", [pytest.param(c, marks=_NO_PINNING) if c == "pinned" else c for c in STALE])
def test_every_change_to_what_the_local_plan_records_plans_afresh(change: str, world: int) -> None:
    """(Pins behaviour that already worked, for whoever tells an unchanged state more cheaply than
    by DCP's local plan.) Each change to what DCP's local plan records of a value (its dtype, size,
    requires_grad, pinning, being a tensor at all, its name, its place among the names and in the
    nesting) is planned as it would be with no cache, items and metadata alike. A one-pass key of
    the state that left one of these out failed its case here (the cached plans of the earlier
    saves reused, the metadata describing the old tensor): tried on 2026-12-05 with such a key."""

    def states() -> list[dict[str, Any]]:
        return [{"w": torch.ones(4, 8), "lr": 0.5, "opt.step": torch.tensor(3.0)} for _ in range(world)]

    caches = [SavePlanCache() for _ in range(world)]
    _plan_with_metadata(states(), caches)
    _plan_with_metadata(states(), caches)
    assert caches[0].planned == 1  # the second save reused the first one's plans
    changed = states()
    for state in changed:
        STALE[change](state)
    plans, metadata = _plan_with_metadata(changed, caches)
    fresh_plans, fresh_metadata = _plan_with_metadata(changed, [SavePlanCache() for _ in range(world)])
    assert _items(plans) == _items(fresh_plans)
    assert metadata.state_dict_metadata == fresh_metadata.state_dict_metadata
    assert metadata.planner_data == fresh_metadata.planner_data
    assert caches[0].planned == 2


def test_a_square_transposed_view_reuses_the_plans_and_writes_its_values(tmp_path: Path) -> None:
    """(Pins behaviour that already worked.) A square tensor replaced by its transposed view keeps
    what DCP's plan records (size, dtype; strides are not recorded): the plans are reused, and the
    checkpoint holds the transposed values, which the writer takes from the state when it writes."""
    model = nn.Linear(4, 4)
    uri = str(tmp_path / "ckpt")
    with Checkpointer(uri, keep=None, async_save=False) as ckpt:
        ckpt.save(1, {"model": model})
        transposed = model.weight.detach().t()
        model.weight = nn.Parameter(transposed)  # a view with swapped strides
        assert not model.weight.is_contiguous()
        ckpt.save(2, {"model": model})
        assert ckpt._plan_cache.planned == 1
    expected = transposed.clone()
    fresh = nn.Linear(4, 4)
    with Checkpointer(uri, read_only=True) as reader:
        assert reader.restore({"model": fresh}) == 2
    assert torch.equal(fresh.weight, expected)
