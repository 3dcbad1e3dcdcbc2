"""``_split_state`` builds the modules' and optimizers' state itself where no module is a wrapper
(``agent.checkpoint._state._plain_state``): what it hands out is what torch's ``get_state_dict``
hands out, key for key, in the same order, the same tensors (no copies), the same param groups.

Each case builds the state twice: through ``_split_state`` and through torch's own calls on the same
``_ModuleBag`` (``get_state_dict`` for one optimizer, ``get_model_state_dict`` and
``get_optimizer_state_dict`` per optimizer otherwise), and compares them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint import state_dict as torch_state_dict

from agent.checkpoint import Checkpointer, _state
from agent.checkpoint._state import _ModuleBag


@pytest.fixture
def ckpt(tmp_path: Path) -> Iterator[Checkpointer]:
    with Checkpointer(str(tmp_path / "ckpt"), async_save=False) as c:
        yield c


def _step(model: nn.Module, *optims: torch.optim.Optimizer) -> None:
    out = model(torch.randn(3, 4))
    out.square().sum().backward()
    for optim in optims:
        optim.step()
        optim.zero_grad()


def _torchs(state: dict[str, Any], initialise: frozenset[str]) -> dict[str, Any]:
    """The DCP state as torch's calls hand it out (the fallback path of ``_split_state``)."""
    modules = {k: v for k, v in state.items() if isinstance(v, nn.Module)}
    optims = {k: v for k, v in state.items() if isinstance(v, torch.optim.Optimizer)}
    bag = _ModuleBag(modules)
    out: dict[str, Any] = {}
    if len(optims) == 1:
        ((key, opt),) = optims.items()
        if key in initialise:
            model_state, optim_state = torch_state_dict.get_state_dict(bag, opt)
        else:
            with _state._as_it_is(opt, initialise=False):
                model_state, optim_state = torch_state_dict.get_state_dict(bag, opt)
        out.update(model_state)
        out[key] = optim_state
        return out
    out.update(torch_state_dict.get_model_state_dict(bag))
    for key, opt in optims.items():
        out[key] = _state._optimizer_state(bag, opt, initialise=key in initialise)
    return out


def _assert_same(mine: Any, torchs: Any, where: str) -> None:
    """The same structure, keys in the same order; tensors: the optimizer's own object where torch
    hands it out, else a tensor of the same memory, dtype, shape, strides and requires_grad."""
    assert type(mine) is type(torchs), where
    if isinstance(torchs, dict):
        assert list(mine) == list(torchs), where
        for k in torchs:
            _assert_same(mine[k], torchs[k], f"{where}.{k}")
    elif isinstance(torchs, list | tuple):
        assert len(mine) == len(torchs), where
        for i, (a, b) in enumerate(zip(mine, torchs, strict=True)):
            _assert_same(a, b, f"{where}.{i}")
    elif isinstance(torchs, torch.Tensor):
        assert mine is torchs or (
            mine.untyped_storage().data_ptr() == torchs.untyped_storage().data_ptr()
            and mine.storage_offset() == torchs.storage_offset()
            and mine.dtype == torchs.dtype
            and mine.shape == torchs.shape
            and mine.stride() == torchs.stride()
            and mine.requires_grad == torchs.requires_grad
        ), where
    else:
        assert mine == torchs, where


def _compare(ckpt: Checkpointer, state: dict[str, Any], initialise: frozenset[str] = frozenset()) -> dict[str, Any]:
    calls: list[int] = []
    original = torch_state_dict._verify_options

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return original(*args, **kwargs)

    mp = pytest.MonkeyPatch()
    mp.setattr(torch_state_dict, "_verify_options", counted)
    try:
        mine, _ = ckpt._split_state(state, initialise=initialise)
    finally:
        mp.undo()
    assert calls == []  # torch's mapping of the names was not run
    torchs = _torchs(state, initialise)
    _assert_same(mine, torchs, "state")
    optims = [k for k, v in state.items() if isinstance(v, torch.optim.Optimizer)]
    for key in optims:  # the optimizer's own state tensors, not copies
        for name, per_param in mine[key]["state"].items():
            for k, v in per_param.items():
                if isinstance(v, torch.Tensor):
                    assert v is torchs[key]["state"][name][k]
    return mine


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 4, bias=False)
        self.head = nn.Linear(4, 4, bias=False)
        self.head.weight = self.embed.weight  # one parameter under two names

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(x))


class _WithBuffers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.bn = nn.BatchNorm1d(4)
        self.register_buffer("scale", torch.ones(4))
        self.register_buffer("cache", torch.zeros(4), persistent=False)  # not in any state dict

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.fc(x)) * self.scale


def _tied(initialise: bool) -> dict[str, Any]:
    model = _Tied()
    optim = torch.optim.Adam(model.parameters())
    _step(model, optim)
    return {"model": model, "optim": optim}


def _buffers(initialise: bool) -> dict[str, Any]:
    model = _WithBuffers()
    optim = torch.optim.AdamW(model.parameters())
    _step(model, optim)
    return {"model": model, "optim": optim}


def _frozen(initialise: bool) -> dict[str, Any]:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    model[0].weight.requires_grad_(False)  # no grad, in the optimizer all the same
    optim = torch.optim.Adam(model.parameters())
    _step(model, optim)
    return {"model": model, "optim": optim}


def _not_stepped(initialise: bool) -> dict[str, Any]:
    model = nn.Sequential(nn.Linear(4, 4))
    return {"model": model, "optim": torch.optim.Adam(model.parameters())}


def _groups(initialise: bool) -> dict[str, Any]:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4))
    optim = torch.optim.SGD(
        [{"params": model[2].parameters(), "lr": 0.1}, {"params": model[0].parameters(), "momentum": 0.9}],
        lr=0.01,
    )  # model[1] is in no group: trained by no optimizer
    _step(model, optim)
    return {"model": model, "optim": optim}


def _two_modules_two_optims(initialise: bool) -> dict[str, Any]:
    model, ema = nn.Sequential(nn.Linear(4, 4)), nn.Linear(4, 4)
    first = torch.optim.Adam(model.parameters())
    second = torch.optim.SGD(ema.parameters(), lr=0.1, momentum=0.9)
    _step(model, first)
    ema(torch.randn(2, 4)).sum().backward()
    second.step()
    return {"model": model, "ema": ema, "adam": first, "sgd": second}


def _no_optim(initialise: bool) -> dict[str, Any]:
    return {"model": _WithBuffers()}


CASES: dict[str, Callable[[bool], dict[str, Any]]] = {
    "tied parameters": _tied,
    "buffers, persistent and not": _buffers,
    "parameters without grad": _frozen,
    "an optimizer with no state yet": _not_stepped,
    "several param groups, a layer in none": _groups,
    "two modules and two optimizers": _two_modules_two_optims,
    "modules without an optimizer": _no_optim,
}


@pytest.mark.parametrize("initialise", [False, True])
@pytest.mark.parametrize("case", list(CASES))
def test_the_split_hands_out_what_torchs_get_state_dict_does(ckpt: Checkpointer, case: str, initialise: bool) -> None:
    """The same dict as torch's, without torch's mapping of every parameter to its names. With
    ``initialise`` (restore's path) an optimizer without state is initialised as torch does; without
    it, it is taken as it is. Fails while ``_split_state`` goes through ``get_state_dict`` (which
    maps the names: ``_verify_options``)."""
    torch.manual_seed(0)
    state = CASES[case](initialise)
    optims = frozenset(k for k, v in state.items() if isinstance(v, torch.optim.Optimizer))
    initialise_keys = optims if initialise else frozenset()
    before = {k: bool(state[k].state) for k in optims}
    mine = _compare(ckpt, state, initialise_keys)
    for key in optims:
        if not initialise:
            assert bool(state[key].state) == before[key]  # taken as it is: no state created
        if key in mine:
            assert list(mine[key]) == ["state", "param_groups"]


def test_a_tied_parameter_is_named_once_in_the_optimizer(ckpt: Checkpointer) -> None:
    """(Pins what torch does.) One parameter under two names: the module state holds both names, the
    optimizer state and its group the first name only, as torch's ``named_parameters`` gives it."""
    mine = _compare(ckpt, _tied(False))
    assert "model.embed.weight" in mine and "model.head.weight" in mine
    assert list(mine["optim"]["state"]) == ["model.embed.weight"]
    assert mine["optim"]["param_groups"][0]["params"] == ["model.embed.weight"]


class _OwnStateDict(nn.Linear):
    """A module that adds a name of its own to its state dict (a ``_save_to_state_dict`` of its own):
    an attribute that is neither a parameter nor a buffer (torch looks each name up as an attribute,
    and refuses one that is not)."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.calls = torch.tensor(1)

    def _save_to_state_dict(self, destination: dict[str, Any], prefix: str, keep_vars: bool) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        destination[prefix + "calls"] = self.calls


def _with_hook() -> nn.Module:
    model = nn.Linear(4, 4)
    model.register_state_dict_post_hook(lambda module, sd, prefix, local_metadata: None)
    return model


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda: _OwnStateDict(4, 4), id="its own _save_to_state_dict"),
        pytest.param(_with_hook, id="a state dict hook"),
    ],
)
def test_a_module_with_a_state_dict_of_its_own_takes_torchs_path(
    ckpt: Checkpointer, make: Callable[[], nn.Module], monkeypatch: pytest.MonkeyPatch
) -> None:
    """(Pins the fallback.) A module that makes its state dict its own way could add names that
    torch looks up as attributes: torch's path is taken (its mapping runs), and hands out the same."""
    model = make()
    optim = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    optim.step()
    state = {"model": model, "optim": optim}
    calls: list[int] = []
    original = torch_state_dict._verify_options

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(torch_state_dict, "_verify_options", counted)
    mine, _ = ckpt._split_state(state)
    assert calls == [1]
    monkeypatch.undo()
    _assert_same(mine, _torchs(state, frozenset()), "state")
