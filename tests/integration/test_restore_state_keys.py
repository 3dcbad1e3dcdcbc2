"""What restore does when the state handed to it is not the one saved, key by key.

- a lazy module that has not run a forward yet (no shapes) is refused up front with what to do,
  on save and on restore, instead of torch's shape error from deep inside the restore walk;
- a bare ``torch.Generator`` is refused with the wrapper to use, and that wrapper resumes its stream.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from agent.checkpoint import Checkpointer

sys.path.insert(0, str(Path(__file__).resolve().parent / "scripts"))
from ckpt_compare import assert_same
from ckpt_state import make_state


def saved_checkpoint(tmp_path: Path, state: dict[str, Any], step: int = 3) -> str:
    uri = str(tmp_path / "ckpt")
    with Checkpointer(uri, async_save=False, staging_dir=str(tmp_path / "staging")) as ckpt:
        ckpt.save(step, state)
    return uri


def restore(tmp_path: Path, uri: str, state: dict[str, Any]) -> int:
    with Checkpointer(uri, async_save=False, staging_dir=str(tmp_path / "staging")) as ckpt:
        return ckpt.restore(state)


def lazy_state() -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.LazyLinear(4), nn.ReLU(), nn.Linear(4, 2))
    return {"model": model}


def test_a_lazy_module_before_its_first_forward_is_refused_with_what_to_do(tmp_path: Path) -> None:
    ready = lazy_state()
    ready["model"](torch.randn(3, 8))
    uri = saved_checkpoint(tmp_path, ready)
    unready = lazy_state()
    with pytest.raises(ValueError, match=r"state\['model'\] holds uninitialized lazy parameters \(model\.0\.weight"):
        restore(tmp_path, uri, unready)
    with (
        Checkpointer(str(tmp_path / "other"), async_save=False, staging_dir=str(tmp_path / "staging")) as ckpt,
        pytest.raises(ValueError, match="Run one forward pass"),
    ):
        ckpt.save(1, unready)
    # What the message says to do works.
    unready["model"](torch.randn(3, 8))
    assert restore(tmp_path, uri, unready) == 3
    assert_same(unready["model"].state_dict(), ready["model"].state_dict(), "the restored lazy model")


class GeneratorState:
    """The wrapper the README and the error suggest for a torch.Generator of the script's own."""

    def __init__(self, generator: torch.Generator) -> None:
        self.generator = generator

    def state_dict(self) -> dict[str, Any]:
        return {"state": self.generator.get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.generator.set_state(state["state"])


def test_a_bare_generator_is_refused_with_the_wrapper_to_use_and_the_wrapper_resumes_its_stream(
    tmp_path: Path,
) -> None:
    state = make_state(0)
    generator = torch.Generator().manual_seed(11)
    with (
        Checkpointer(str(tmp_path / "other"), async_save=False, staging_dir=str(tmp_path / "staging")) as ckpt,
        pytest.raises(TypeError, match=r"state\['data_rng'\] is a Generator.*returns its get_state\(\)"),
    ):
        ckpt.save(1, {**state, "data_rng": generator})
    torch.rand(5, generator=generator)
    uri = saved_checkpoint(tmp_path, {**state, "data_rng": GeneratorState(generator)})
    expected = torch.rand(5, generator=generator)
    other = torch.Generator().manual_seed(99)
    assert restore(tmp_path, uri, {**make_state(0, seed=5), "data_rng": GeneratorState(other)}) == 3
    assert torch.equal(torch.rand(5, generator=other), expected)
