"""Exact, recursive comparison of saved and restored state (tensors with ``torch.equal``)."""

from __future__ import annotations

from typing import Any

import torch


def differences(a: Any, b: Any, path: str = "") -> list[str]:
    """Every place where ``a`` and ``b`` differ; tensors must match in dtype, shape and every bit."""
    where = path or "<root>"
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return [f"{where}: {type(a).__name__} vs {type(b).__name__}"]
        if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(a, b):
            return [f"{where}: tensors differ ({a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)})"]
        return []
    if isinstance(a, dict) and isinstance(b, dict):
        out = [f"{where}: key {k!r} only on one side" for k in sorted(set(a) ^ set(b), key=repr)]
        for k in a.keys() & b.keys():
            out += differences(a[k], b[k], f"{path}.{k}" if path else str(k))
        return out
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        if len(a) != len(b):
            return [f"{where}: length {len(a)} vs {len(b)}"]
        out = []
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            out += differences(x, y, f"{path}[{i}]")
        return out
    if type(a) is not type(b) or a != b:
        return [f"{where}: {a!r} vs {b!r}"]
    return []


def assert_same(a: Any, b: Any, what: str = "state") -> None:
    diffs = differences(a, b)
    assert not diffs, f"{what} differs in {len(diffs)} place(s):\n  " + "\n  ".join(diffs[:20])


def assert_same_training_state(
    a: torch.nn.Module, b: torch.nn.Module, oa: torch.optim.Optimizer, ob: torch.optim.Optimizer
) -> None:
    """Two modules' state dicts, and their optimizers' per-parameter state, equal bit for bit."""
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert x.dtype == y.dtype and torch.equal(x, y), name
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        for key, value in oa.state[pa].items():
            assert torch.equal(value, ob.state[pb][key]), key
