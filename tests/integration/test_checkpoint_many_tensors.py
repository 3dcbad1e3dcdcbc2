"""What spotjob does once per tensor, on top of DCP, stays cheap for a state of thousands of
tensors, and the shortcuts taken for it give what the long way gave: the manifest parsed once per
restore (rank 0 keeps the one it checked), small tensors serialized in memory and written in one
call (the same bytes on disk)."""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from agent import _dcp_write
from agent.checkpoint import Checkpointer, SaveFailedError
from agent.manifest import MANIFEST_NAME, MAX_MANIFEST_BYTES, Manifest
from tests.ckpt_compare import assert_same, assert_same_training_state


class Many(nn.Module):
    """Many tiny parameters, of several dtypes, and a buffer: the per-tensor costs dominate."""

    def __init__(self, n: int = 40) -> None:
        super().__init__()
        self.ps = nn.ParameterList([nn.Parameter(torch.randn(2)) for _ in range(n)])
        self.wide = nn.Parameter(torch.randn(3, 5, dtype=torch.float64))
        self.big = nn.Parameter(torch.randn(256, 80))  # 80 KiB: above SERIALIZE_IN_MEMORY_BELOW
        self.register_buffer("count", torch.arange(7))


def trained(seed: int) -> tuple[Many, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = Many()
    optim = torch.optim.AdamW(model.parameters())
    (sum(p.sum() for p in model.ps) + model.wide.sum() + model.big.sum()).backward()
    optim.step()
    return model, optim


def test_a_restore_parses_the_manifest_once_and_restores_exactly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 0 used to parse MANIFEST.json in its check, then again from the JSON it sends the other
    ranks: for a big model each parse (JSON, then validation) costs a tenth of the restore."""
    model, optim = trained(0)
    with Checkpointer(str(tmp_path), async_save=False) as ckpt:
        ckpt.save(3, {"model": model, "optim": optim})
    fresh, fresh_optim = trained(1)
    parsed: list[int] = []
    original = Manifest.parse.__func__  # type: ignore[attr-defined]

    def counted(cls: type[Manifest], data: bytes) -> Manifest:
        parsed.append(len(data))
        return original(cls, data)  # type: ignore[no-any-return]

    monkeypatch.setattr(Manifest, "parse", classmethod(counted))
    with Checkpointer(str(tmp_path)) as ckpt:
        assert ckpt.restore({"model": fresh, "optim": fresh_optim}) == 3
    assert len(parsed) == 1
    assert_same_training_state(model, fresh, optim, fresh_optim)


def test_a_restore_reads_the_models_state_once_and_loads_into_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The modules' state read to compare shapes with the manifest is the one loaded into: it used
    to be read again for the load (``get_model_state_dict`` walks every tensor)."""
    from agent.checkpoint import _state

    model, optim = trained(0)
    with Checkpointer(str(tmp_path), async_save=False) as ckpt:
        ckpt.save(2, {"model": model, "optim": optim})
    fresh, fresh_optim = trained(1)
    calls: list[int] = []
    original = _state.get_model_state_dict

    def counted(module: nn.Module, *args: Any, **kwargs: Any) -> dict[str, Any]:
        calls.append(1)
        return original(module, *args, **kwargs)

    monkeypatch.setattr(_state, "get_model_state_dict", counted)
    with Checkpointer(str(tmp_path)) as ckpt:
        assert ckpt.restore({"model": fresh, "optim": fresh_optim}) == 2
    assert len(calls) == 1
    assert_same_training_state(model, fresh, optim, fresh_optim)


def test_the_manifest_other_ranks_parse_from_rank0s_json_equals_the_one_rank0_keeps(tmp_path: Path) -> None:
    """Rank 0 restores with the manifest it parsed from storage; the other ranks with the one parsed
    from its ``to_json()``: the two are equal, for a written manifest and for one written by hand
    (no time zone, user metadata)."""
    model, optim = trained(0)
    with Checkpointer(str(tmp_path), async_save=False) as ckpt:
        ckpt.save(5, {"model": model, "optim": optim}, metadata={"loss": 0.1 + 0.2, "tags": ["a", 1, None]})
    (folder,) = [p for p in tmp_path.iterdir() if (p / MANIFEST_NAME).exists()]
    on_disk = Manifest.parse((folder / MANIFEST_NAME).read_bytes())
    assert len(on_disk.tensors) > 40
    assert Manifest.parse(on_disk.to_json()) == on_disk
    by_hand = on_disk.model_dump(mode="json")
    by_hand["created_at"] = "2025-01-01T12:00:00"  # no zone: read as UTC
    kept = Manifest.model_validate(by_hand)
    assert Manifest.parse(kept.to_json()) == kept


@pytest.mark.parametrize(
    "tensor",
    [
        torch.arange(3, dtype=torch.int64),
        torch.randn(2),
        torch.randn(5, 7, dtype=torch.float64),
        torch.tensor([True, False, True]),
        torch.randn(4, dtype=torch.complex64),
        torch.empty(0, 3),
        torch.randn(100, 100).to(torch.bfloat16),
    ],
)
def test_a_small_tensor_serialized_in_memory_is_the_record_written_straight_to_the_file(
    tmp_path: Path, tensor: torch.Tensor
) -> None:
    """``_Writer`` serializes a small tensor into memory and writes it in one call; the record is the
    one torch's writer gives when it writes to the shard file itself, wherever in the file it lands."""
    memory = io.BytesIO()
    _dcp_write.save_tensor_without_crc(tensor, memory)
    path = str(tmp_path / "shard")
    prefix = os.urandom(37)  # an odd offset: the record lays itself out from its own start
    with _dcp_write.ChecksummedFile(path) as f:
        f.write(prefix)
        _dcp_write.save_tensor_without_crc(tensor, f)
    assert Path(path).read_bytes() == prefix + memory.getvalue()
    assert torch.equal(torch.load(io.BytesIO(memory.getvalue()), weights_only=True), tensor)


def shard_files(root: Path) -> dict[str, bytes]:
    (folder,) = [p for p in root.iterdir() if (p / MANIFEST_NAME).exists()]
    return {p.name: p.read_bytes() for p in folder.iterdir() if p.suffix == ".distcp"}


def test_a_save_writes_the_same_shard_bytes_with_small_tensors_serialized_in_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, optim = trained(0)
    state: dict[str, Any] = {"model": model, "optim": optim}
    monkeypatch.setattr(_dcp_write, "SERIALIZE_IN_MEMORY_BELOW", 0)  # every tensor straight to the file
    with Checkpointer(str(tmp_path / "straight"), async_save=False) as ckpt:
        ckpt.save(1, state)
    monkeypatch.undo()
    assert model.ps[0].nbytes < _dcp_write.SERIALIZE_IN_MEMORY_BELOW
    with Checkpointer(str(tmp_path / "gathered"), async_save=False) as ckpt:
        ckpt.save(1, state)
    straight, gathered = shard_files(tmp_path / "straight"), shard_files(tmp_path / "gathered")
    assert straight and straight == gathered
    fresh, fresh_optim = trained(1)
    with Checkpointer(str(tmp_path / "gathered")) as ckpt:
        assert ckpt.restore({"model": fresh, "optim": fresh_optim}) == 1
    assert_same_training_state(model, fresh, optim, fresh_optim)


def test_a_save_whose_manifest_no_restore_would_read_fails_and_commits_nothing(tmp_path: Path) -> None:
    """A manifest over ``MAX_MANIFEST_BYTES`` (a tensor index of thousands of tensors, each listing
    the shard files of a thousand ranks; here, a few tensors with names of a million characters)
    used to be committed, and every restore then skipped that checkpoint unread for an older one."""
    small = nn.Linear(2, 2)
    with Checkpointer(str(tmp_path), async_save=False) as ckpt:
        ckpt.save(1, {"model": small})
        named = nn.Module()
        for i in range(MAX_MANIFEST_BYTES // 10**6 + 2):
            named.register_buffer(f"b{i}_" + "x" * 10**6, torch.zeros(1))
        with pytest.raises(SaveFailedError, match=r"MANIFEST\.json would take \d+ bytes, more than the 67108864"):
            ckpt.save(2, {"model": small, "named": named})
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-000000001"]
    with Checkpointer(str(tmp_path)) as ckpt:
        assert ckpt.restore({"model": nn.Linear(2, 2)}) == 1


def test_the_tensor_index_written_is_the_one_of_tensor_entries_built_as_before(tmp_path: Path) -> None:
    """The manifest's tensor index (``dcp_safe.tensor_index``) validates each entry with pydantic's
    validator straight, not through ``TensorEntry(...)``: the bytes committed are the ones an index
    of ``TensorEntry(...)`` gives. Pins what the old code wrote: it passes with either."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from agent.dcp_safe import load_dcp_metadata, tensor_index
    from agent.manifest import DCP_METADATA_NAME, TensorEntry

    model, optim = trained(0)
    with Checkpointer(str(tmp_path), async_save=False) as ckpt:
        ckpt.save(4, {"model": model, "optim": optim})
    (folder,) = [p for p in tmp_path.iterdir() if (p / MANIFEST_NAME).exists()]
    written = (folder / MANIFEST_NAME).read_bytes()
    metadata = load_dcp_metadata((folder / DCP_METADATA_NAME).read_bytes())
    files: dict[str, set[str]] = {}
    for index, info in (metadata.storage_data or {}).items():
        files.setdefault(index.fqn, set()).add(info.relative_path)
    one_by_one = {
        fqn: TensorEntry(
            shape=list(md.size),
            dtype=str(md.properties.dtype).removeprefix("torch."),
            files=sorted(files.get(fqn, ())),
        )
        for fqn, md in metadata.state_dict_metadata.items()
        if isinstance(md, TensorStorageMetadata)
    }
    assert len(one_by_one) > 80  # 43 parameters and a buffer, and AdamW's state of each parameter
    index = tensor_index(metadata)
    assert index == one_by_one and all(type(e) is TensorEntry for e in index.values())
    on_disk = Manifest.parse(written)
    assert on_disk.model_copy(update={"tensors": one_by_one}).to_json() == written


@pytest.mark.parametrize("async_save", [False, True])
def test_a_save_of_a_state_that_kept_its_structure_reuses_the_last_saves_tensor_index(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, async_save: bool
) -> None:
    """Every save built the manifest's tensor index afresh: five objects the garbage collector
    tracks per tensor (an entry, its ``__dict__``, its set of fields, its two lists), a third of
    what a save of many small tensors hands to the collector's oldest generation, enough to set off
    a full collection nearly every save (bench/README.md). A save whose DCP metadata is the last
    one's (the cached plans) and whose tensors are in the same files takes the last index's
    entries; a state that changed builds its own. Each manifest committed is the index of its
    own .metadata."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from agent import dcp_safe
    from agent.manifest import DCP_METADATA_NAME

    built: list[str] = []
    validate = dcp_safe._tensor_entry

    def counted(fields: dict[str, Any]) -> Any:
        built.append(fields["dtype"])
        return validate(fields)

    monkeypatch.setattr(dcp_safe, "_tensor_entry", counted)
    model, optim = trained(0)
    state: dict[str, Any] = {"model": model, "optim": optim}
    tensors = []
    with Checkpointer(str(tmp_path), async_save=async_save, keep=10) as ckpt:
        ckpt.save(1, state)
        ckpt.wait()
        tensors.append(len(built))
        for step in (2, 3):  # new values, the same tensors: nothing built
            model.big.grad = torch.ones_like(model.big)
            optim.step()
            ckpt.save(step, state)
            ckpt.wait()
            tensors.append(len(built))
        model.extra = nn.Parameter(torch.randn(4))  # one more tensor: planned, and indexed, afresh
        state["optim"] = torch.optim.AdamW(model.parameters())
        ckpt.save(4, state)
        ckpt.wait()
        tensors.append(len(built))
        model.double()  # other dtypes, the same names
        ckpt.save(5, state)
        ckpt.wait()
        tensors.append(len(built))
    first = tensors[0]
    assert first > 80 and tensors[:3] == [first] * 3, tensors
    assert tensors[3] > tensors[2] and tensors[4] > tensors[3], tensors
    assert "float64" in built[tensors[3] :] and "float32" not in built[tensors[3] :]
    folders = sorted(p for p in tmp_path.iterdir() if (p / MANIFEST_NAME).exists())
    assert len(folders) == 5
    for folder in folders:
        manifest = Manifest.parse((folder / MANIFEST_NAME).read_bytes())
        metadata = dcp_safe.load_dcp_metadata((folder / DCP_METADATA_NAME).read_bytes())
        assert manifest.tensors == dcp_safe.tensor_index(metadata), folder.name
        assert len(manifest.tensors) == sum(
            isinstance(md, TensorStorageMetadata) for md in metadata.state_dict_metadata.values()
        )


@pytest.mark.parametrize("plain", [True, False])
@pytest.mark.parametrize("optimizer_stepped", [True, False])
def test_a_save_maps_the_parameters_to_their_names_once_and_splits_as_torchs_two_calls_do(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, optimizer_stepped: bool, plain: bool
) -> None:
    """The modules' and the one optimizer's state come from one ``get_state_dict``: torch's
    ``get_model_state_dict`` and ``get_optimizer_state_dict`` each mapped every parameter to its
    names first (``_verify_options``), a third of the split for 1000 small layers. What it hands out
    is what the two calls hand out, in the same order; an optimizer that has not stepped is still
    taken as it is (no state created in it). Where no module is a wrapper (``plain``) the split
    builds the same state without torch's mapping at all (``_plain_state``)."""
    from torch.distributed.checkpoint import state_dict as torch_state_dict

    from agent.checkpoint import _state
    from agent.checkpoint._state import _model_state, _ModuleBag, _optimizer_state

    if not plain:
        monkeypatch.setattr(_state, "_state_dict_as_torch_names_it", lambda bag: False)

    model, optim = trained(0)
    if not optimizer_stepped:
        optim = torch.optim.AdamW(model.parameters())
    state = {"model": model, "optim": optim}
    bag = _ModuleBag({"model": model})
    two_calls = {**_model_state(bag), "optim": _optimizer_state(bag, optim, initialise=False)}
    mapped: list[int] = []
    original = torch_state_dict._verify_options

    def counted(*args: Any, **kwargs: Any) -> Any:
        mapped.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(torch_state_dict, "_verify_options", counted)
    with Checkpointer(str(tmp_path), async_save=False) as ckpt:
        one_call, _ = ckpt._split_state(state)
    assert len(mapped) == (0 if plain else 1)
    assert list(one_call) == list(two_calls)
    assert_same(one_call, two_calls, "the split")
    assert bool(optim.state) == optimizer_stepped
