"""Where ``RankZeroSavePlanner`` has each rank write the values several ranks hold, and what it
refuses, from the plans the ranks send the coordinator (no process group: the coordinator's step
is a function of the gathered plans)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.planner import SavePlan
from torch.distributed.checkpoint.planner_helpers import _create_write_items

from agent._dcp_plan import DivergentReplicasError, RankZeroSavePlanner


def _plans(held: dict[str, tuple[Any, list[int]]], world: int) -> list[SavePlan]:
    """Each rank's plan: the values of ``held`` (name -> (value, the ranks holding it))."""
    return [
        SavePlan(
            [item for fqn, (value, ranks) in held.items() if rank in ranks for item in _create_write_items(fqn, value)]
        )
        for rank in range(world)
    ]


def _writers(plans: list[SavePlan]) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for rank, plan in enumerate(plans):
        for item in plan.items:
            out.setdefault(item.index.fqn, []).append(rank)
    return out


def test_a_value_rank_0_lacks_is_written_by_the_lowest_rank_holding_it() -> None:
    """Pins what already held since scalars moved to rank 0 (commit 66f2d77): a scalar or a
    non-tensor value that only some ranks hold (a pipeline stage's, a per-rank key) is written once,
    from the lowest rank holding it, never dropped nor written twice; one every rank holds from
    rank 0; a bigger tensor once, from any rank."""
    held: dict[str, tuple[Any, list[int]]] = {
        "optim.state.stage1.w.step": (torch.tensor(3.0), [1, 2]),
        "extra.note": ({"epoch": 2}, [2, 3]),
        "optim.param_groups.0.lr": (0.1, [0, 1, 2, 3]),
        "optim.state.w.step": (torch.tensor(3.0), [0, 1, 2, 3]),
        "model.w": (torch.ones(64), [0, 1, 2, 3]),
    }
    writers = _writers(RankZeroSavePlanner(frozenset(), check_replicas=False)._dedup_save_plans(_plans(held, 4)))
    assert writers.pop("model.w") in ([0], [1], [2], [3])
    assert writers == {
        "optim.state.stage1.w.step": [1],
        "extra.note": [2],
        "optim.param_groups.0.lr": [0],
        "optim.state.w.step": [0],
    }


def test_a_scalar_that_differs_between_the_ranks_holding_it_is_refused_naming_them() -> None:
    """Pins what already held: the coordinator compares the ranks' copies before it keeps one, so
    a scalar that ranks 1 and 2 hold with other values (rank 0 holding none) is refused, not
    saved from rank 1 alone; as it was refused when it went to the least busy rank."""
    planner = RankZeroSavePlanner(frozenset())
    plans = []
    for rank, step in enumerate((None, 3.0, 4.0)):
        planner.state_dict = {} if step is None else {"optim.state.b.step": torch.tensor(step)}
        plan = _plans({"optim.state.b.step": (torch.tensor(step or 0.0), [rank] if step else [])}, 3)[rank]
        plans.append(SavePlan(plan.items, planner_data=({}, planner._fingerprints(plan))))
    with pytest.raises(
        DivergentReplicasError, match=r"ranks 1 and 2 hold different values under the name optim\.state\.b\.step"
    ):
        planner.create_global_plan(plans)
