"""What a save derives from the state's structure (``_split_state``'s names, ``_from_rank0``'s
rank-0-only names, ``_check_state``'s refusals) follows every change between two saves: nothing of
it is kept from one save to the next, and a cache of it would have to notice each change below.
Each test fails with a cache keyed on the state's keys (or its objects): they pin behaviour that
held before, for whoever makes these cheaper next."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

from agent.checkpoint import Checkpointer


@pytest.fixture
def ckpt(tmp_path: Path) -> Iterator[Checkpointer]:
    with Checkpointer(str(tmp_path / "ckpt"), async_save=False) as c:
        yield c


def stepped(model: nn.Module, optim: torch.optim.Optimizer) -> None:
    model(torch.randn(3, 4)).square().sum().backward()
    optim.step()
    optim.zero_grad()


def derived(ckpt: Checkpointer, state: dict[str, object]) -> tuple[dict[str, object], frozenset[str]]:
    """What ``_prepare_save`` derives from ``state``: its DCP state and the names saved from rank 0."""
    ckpt._check_state(state)
    dcp_state, _ = ckpt._split_state(state)
    return dcp_state, ckpt._from_rank0(state, dcp_state)


def test_a_parameter_added_between_saves_is_named_trained_and_checked(ckpt: Checkpointer) -> None:
    model = nn.Sequential(nn.Linear(4, 2))
    optim = torch.optim.Adam(model.parameters())
    stepped(model, optim)
    state = {"model": model, "optim": optim}
    before, _ = derived(ckpt, state)
    assert "model.extra" not in before
    model.register_parameter("extra", nn.Parameter(torch.ones(3)))
    after, from_rank0 = derived(ckpt, state)
    assert "model.extra" in after
    assert "model.extra" not in from_rank0  # a parameter of a trained module: compared across ranks
    model.register_parameter("late", nn.Parameter(torch.ones(3, device="meta")))
    with pytest.raises(ValueError, match=r"model\.late, which is on the meta device"):
        derived(ckpt, state)


def test_a_param_group_added_between_saves_is_saved_and_moves_its_module_off_rank0(ckpt: Checkpointer) -> None:
    model = nn.Sequential(nn.Linear(4, 2))
    ema = nn.Linear(4, 2)  # trained by no optimizer: its parameters are rank 0's, unchecked
    optim = torch.optim.Adam(model.parameters(), lr=0.1)
    stepped(model, optim)
    state = {"model": model, "ema": ema, "optim": optim}
    before, from_rank0 = derived(ckpt, state)
    assert {"ema.weight", "ema.bias"} <= from_rank0
    assert len(before["optim"]["param_groups"]) == 1  # type: ignore[index]
    optim.add_param_group({"params": list(ema.parameters()), "lr": 0.01})
    after, from_rank0 = derived(ckpt, state)
    groups = after["optim"]["param_groups"]  # type: ignore[index]
    assert [g["lr"] for g in groups] == [0.1, 0.01]
    assert groups[1]["params"] == ["ema.weight", "ema.bias"]
    assert not {"ema.weight", "ema.bias"} & from_rank0


def test_a_different_optimizer_object_under_the_same_key_is_the_one_saved_and_checked(ckpt: Checkpointer) -> None:
    model = nn.Sequential(nn.Linear(4, 2))
    optim: torch.optim.Optimizer = torch.optim.Adam(model.parameters())
    stepped(model, optim)
    state = {"model": model, "optim": optim}
    before, _ = derived(ckpt, state)
    assert "exp_avg" in before["optim"]["state"]["model.0.weight"]  # type: ignore[index]
    state["optim"] = optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    stepped(model, optim)
    after, _ = derived(ckpt, state)
    assert set(after["optim"]["state"]["model.0.weight"]) == {"momentum_buffer"}  # type: ignore[index]
    state["optim"] = optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    stepped(model, optim)
    optim.state[model[0].weight]["momentum_buffer"] = torch.eye(2, 4).to_sparse()
    with pytest.raises(ValueError, match="is a sparse tensor"):
        derived(ckpt, state)


class _Renaming(nn.Module):
    """A module whose child's tensors are named in the state as if they were its own (torch's
    ``_fqn_modifiers``: ``model.0.weight`` for ``model.0.inner.weight``)."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(4, 2)

    def _fqn_modifiers(self) -> dict[str, str]:
        return {"weight": "inner", "bias": "inner"}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)


@pytest.mark.parametrize("wrap", ["plain", "activation_checkpointing", "compiled", "fqn_modifiers"])
def test_the_names_saved_from_rank0_are_those_torchs_walk_names(
    ckpt: Checkpointer, monkeypatch: pytest.MonkeyPatch, wrap: str
) -> None:
    """``_from_rank0`` takes a parameter's name as its FQN where no module is one torch's
    ``_get_fqns`` sees through or renames under, and asks that walk otherwise: the same names either
    way, for a model wrapped each way (pins behaviour that already held)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    from agent.checkpoint import _state

    inner: nn.Module = {
        "plain": lambda: nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)),
        "activation_checkpointing": lambda: nn.Sequential(checkpoint_wrapper(nn.Linear(4, 4)), nn.BatchNorm1d(4)),
        "compiled": lambda: torch.compile(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))),
        "fqn_modifiers": lambda: nn.Sequential(_Renaming(), nn.BatchNorm1d(2)),
    }[wrap]()
    ema = nn.Linear(4, 2)  # trained by no optimizer: its parameters are rank 0's
    optim = torch.optim.SGD(inner.parameters(), lr=0.1)
    state = {"model": inner, "ema": ema, "optim": optim}
    assert _state._names_are_fqns(_state._ModuleBag({"model": inner, "ema": ema})) == (
        wrap != "compiled" and wrap != "fqn_modifiers"
    )
    _, fast = derived(ckpt, state)
    monkeypatch.setattr(_state, "_names_are_fqns", lambda bag: False)
    _, walked = derived(ckpt, state)
    assert fast == walked
    assert {"ema.weight", "ema.bias"} <= fast
    assert not any("_checkpoint_wrapped_module" in name or "_orig_mod" in name for name in fast)
