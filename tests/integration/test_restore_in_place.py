"""A filesystem restore reads each verified tensor's bytes straight into its parameter or optimizer
state when nothing needs converting (``VerifiedReader._read_in_place``), and leaves every other
item to DCP's own path: non-tensor values, non-contiguous tensors, a tensor of another dtype.
Either way the state comes back exactly."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from agent import dcp_safe
from agent.checkpoint import Checkpointer
from tests.ckpt_compare import assert_same_training_state

needs_in_place = pytest.mark.skipif(
    not dcp_safe.IN_PLACE_READS,
    reason="this torch's file reader has no get_record_size (torch 2.9.1): DCP's path reads every tensor",
)
"""For tests that count tensors read in place."""


@pytest.fixture
def in_place(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """(tensors read in place, items in the plan) per read_data call; every tensor, however small,
    may take the fast path (these tests' models are small)."""
    monkeypatch.setattr(dcp_safe, "IN_PLACE_MIN_BYTES", 0)
    return count_reads(monkeypatch)


def count_reads(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    seen: list[tuple[int, int]] = []
    original = dcp_safe.VerifiedReader.read_data

    def counted(self: dcp_safe.VerifiedReader, plan: Any, planner: Any) -> Any:
        before = self.read_in_place
        result = original(self, plan, planner)
        seen.append((self.read_in_place - before, len(plan.items)))
        return result

    monkeypatch.setattr(dcp_safe.VerifiedReader, "read_data", counted)
    return seen


def trained(seed: int, *, transposed: bool = False) -> tuple[nn.Sequential, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 4))
    if transposed:  # a parameter whose memory is not in row order
        model[1].weight = nn.Parameter(torch.randn(4, 32).t().contiguous().t())
        assert not model[1].weight.is_contiguous()
    optim = torch.optim.Adam(model.parameters())
    model(torch.randn(3, 16)).sum().backward()
    optim.step()
    return model, optim


def round_trip(tmp_path: Path, *, transposed: bool = False) -> None:
    """Saves a trained model and its optimizer, restores them into a differently seeded pair and
    checks that every value came back."""
    model, optim = trained(0, transposed=transposed)
    with Checkpointer(str(tmp_path), async_save=False) as ckpt:
        ckpt.save(1, {"model": model, "optim": optim})
    fresh, fresh_optim = trained(1, transposed=transposed)
    with Checkpointer(str(tmp_path)) as ckpt:
        assert ckpt.restore({"model": fresh, "optim": fresh_optim}) == 1
    assert_same_training_state(model, fresh, optim, fresh_optim)


def layers(model: nn.Sequential) -> tuple[nn.Linear, nn.Linear]:
    first, second = model
    assert isinstance(first, nn.Linear) and isinstance(second, nn.Linear)
    return first, second


@needs_in_place
def test_every_tensor_of_a_plain_model_is_read_straight_into_place(
    tmp_path: Path, in_place: list[tuple[int, int]]
) -> None:
    round_trip(tmp_path)
    tensors = 4 + 4 * 3  # 4 parameters; Adam's exp_avg, exp_avg_sq and step for each
    read, items = (sum(column) for column in zip(*in_place, strict=True))  # model and optimizer loads
    assert read == tensors and items > tensors  # the rest are the param groups' plain values


def test_a_torch_whose_reader_cannot_size_a_record_reads_every_tensor_through_dcps_path(
    tmp_path: Path, in_place: list[tuple[int, int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch 2.9.1's file reader has no ``get_record_size``: every in-place read was tried (a
    skip_data load of its record) and given up on the missing method. There, the Checkpointer
    reads every tensor through DCP's path and tries none; played here by switching it off."""
    monkeypatch.setattr(dcp_safe, "IN_PLACE_READS", False)
    round_trip(tmp_path)
    assert in_place and all(read == 0 for read, _ in in_place)


@needs_in_place
def test_a_non_contiguous_parameter_goes_through_dcps_path_and_comes_back_exactly(
    tmp_path: Path, in_place: list[tuple[int, int]]
) -> None:
    round_trip(tmp_path, transposed=True)
    read = sum(r for r, _ in in_place)
    # All but the transposed weight and its two Adam moments (created with the weight's strides).
    assert read == 4 + 4 * 3 - 3


@needs_in_place
def test_a_parameter_of_another_dtype_is_converted_by_dcps_path(
    tmp_path: Path, in_place: list[tuple[int, int]]
) -> None:
    model, _ = trained(0)
    with Checkpointer(str(tmp_path), async_save=False) as ckpt:
        ckpt.save(1, {"model": model})
    fresh, _ = trained(1)
    fresh[0].to(torch.float64)
    with Checkpointer(str(tmp_path)) as ckpt:
        assert ckpt.restore({"model": fresh}) == 1
    (saved_first, saved_second), (first, second) = (layers(model), layers(fresh))
    assert first.weight.dtype == torch.float64
    assert torch.equal(first.weight, saved_first.weight.double())
    assert torch.equal(second.weight, saved_second.weight)
    ((read, _),) = in_place
    assert read == 2  # the second layer's weight and bias; the first layer's two are converted


def test_the_models_pages_are_mapped_while_the_files_are_first_checked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The optimizer state loads first (into fresh tensors); the model's tensors, loaded next, are
    # mapped in that same pass, while the shard is read and CRC-checked, not alone afterwards.
    model, optim = trained(0)
    with Checkpointer(str(tmp_path), async_save=False) as ckpt:
        ckpt.save(1, {"model": model, "optim": optim})
    mapped: list[set[int]] = []
    original = dcp_safe.map_for_writing

    def spy(tensors: list[torch.Tensor]) -> None:
        mapped.append({t.data_ptr() for t in tensors})
        original(tensors)

    monkeypatch.setattr(dcp_safe, "map_for_writing", spy)
    fresh, fresh_optim = trained(1)
    params = {p.data_ptr() for p in fresh.parameters()}
    with Checkpointer(str(tmp_path)) as ckpt:
        assert ckpt.restore({"model": fresh, "optim": fresh_optim}) == 1
    assert_same_training_state(model, fresh, optim, fresh_optim)
    assert len(mapped) == 2  # the optimizer's load, then the model's
    moments = {v.data_ptr() for s in fresh_optim.state.values() for k, v in s.items() if k != "step"}
    assert params <= mapped[0] and moments <= mapped[0]


class CachedTranspose(nn.Module):
    """Keeps its weight's transpose in a non-persistent buffer, rebuilt whenever it is loaded:
    by a load_state_dict post-hook, or (``override``) by its own ``_load_from_state_dict``."""

    def __init__(self, seed: int, *, override: bool = False) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.weight = nn.Parameter(torch.randn(4, 6))
        self.register_buffer("weight_t", self.weight.detach().t().contiguous(), persistent=False)
        if not override:
            self.register_load_state_dict_post_hook(lambda module, _: module.rebuild())

    def rebuild(self) -> None:
        self.weight_t.copy_(self.weight.detach().t())


class CachedTransposeOverride(CachedTranspose):
    def __init__(self, seed: int) -> None:
        super().__init__(seed, override=True)

    def _load_from_state_dict(self, *args: Any, **kwargs: Any) -> None:
        super()._load_from_state_dict(*args, **kwargs)
        self.rebuild()


@needs_in_place
@pytest.mark.parametrize("kind", [CachedTranspose, CachedTransposeOverride], ids=["post-hook", "override"])
def test_a_module_that_rebuilds_a_cache_when_loaded_gets_its_load_code_run(
    tmp_path: Path, kind: type[CachedTranspose], in_place: list[tuple[int, int]]
) -> None:
    """Reading the bytes straight into the parameters loads them; the module's own code that
    runs when a state dict is loaded must still run, as ``load_state_dict`` would run it."""
    saved = kind(0)
    with Checkpointer(str(tmp_path), async_save=False) as ckpt:
        ckpt.save(1, {"model": saved})
    fresh = kind(1)
    with Checkpointer(str(tmp_path)) as ckpt:
        assert ckpt.restore({"model": fresh}) == 1
    assert sum(read for read, _ in in_place) == 1  # the fast path still read the weight in place
    assert torch.equal(fresh.weight, saved.weight)
    assert torch.equal(fresh.weight_t, saved.weight_t), "the cache still holds the initial weight's transpose"


@needs_in_place
def test_only_tensors_from_the_size_limit_up_are_read_in_place_and_all_come_back_exactly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Inspecting a record costs more than DCP's own path for a small tensor: a model of thousands
    of tiny parameters restored 1.9x slower than plain ``dcp.load`` when each was read in place."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 4))  # 256 KiB weight; the rest far below
    optim = torch.optim.Adam(model.parameters())
    model(torch.randn(3, 256)).sum().backward()
    optim.step()
    with Checkpointer(str(tmp_path), async_save=False) as ckpt:
        ckpt.save(1, {"model": model, "optim": optim})
    torch.manual_seed(1)
    fresh = nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 4))
    fresh_optim = torch.optim.Adam(fresh.parameters())
    fresh(torch.randn(3, 256)).sum().backward()
    fresh_optim.step()
    reads = count_reads(monkeypatch)
    with Checkpointer(str(tmp_path)) as ckpt:
        assert ckpt.restore({"model": fresh, "optim": fresh_optim}) == 1
    assert_same_training_state(model, fresh, optim, fresh_optim)
    assert model[0].weight.nbytes == dcp_safe.IN_PLACE_MIN_BYTES
    assert sum(read for read, _ in reads) == 3  # the first weight and its two Adam moments
