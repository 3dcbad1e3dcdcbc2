"""What restore does when the state handed to it is not the one saved, key by key.

- a key the checkpoint holds but the state leaves out (the optimizer forgotten) is not restored,
  and a warning names it: the run would otherwise resume on a fresh optimizer without a word;
- a per-rank object whose ``load_state_dict`` refuses its saved state is named in the refusal, and
  found before the model and optimizers are loaded: they stay as they were, and the objects loaded
  before it are put back (on every rank, when it refuses on one);
- a per-rank object under a key the checkpoint saved as a module is refused before anything is
  loaded, naming the key;
- a lazy module that has not run a forward yet (no shapes) is refused up front with what to do,
  on save and on restore, instead of torch's shape error from deep inside the restore walk;
- a quantization-aware model (torch.ao's fake-quantizers, whose per-channel scales take their shape
  from calibration) restores into a freshly prepared one, as ``load_state_dict`` would load it;
- a module's extra state (``get_extra_state``) comes back through its ``set_extra_state``, a dict
  holding tensors included, and one a restore could not load is refused when saved;
- a model saved wrapped (``torch.compile``: ``_orig_mod.``) restores into the bare module and the
  other way round, exactly (DDP's ``module.``: ``test_checkpoint_ddp_buffers``).
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from agent import ResumableLoader
from agent.checkpoint import Checkpointer, RestoreRefusedError, SaveFailedError

sys.path.insert(0, str(Path(__file__).resolve().parent / "scripts"))
import ckpt_harness as harness
from ckpt_compare import assert_same
from ckpt_object_refused import Position
from ckpt_state import make_state, snapshot, train


def saved_checkpoint(tmp_path: Path, state: dict[str, Any], step: int = 3) -> str:
    uri = str(tmp_path / "ckpt")
    with Checkpointer(uri, async_save=False, staging_dir=str(tmp_path / "staging")) as ckpt:
        ckpt.save(step, state)
    return uri


def restore(tmp_path: Path, uri: str, state: dict[str, Any]) -> int:
    with Checkpointer(uri, async_save=False, staging_dir=str(tmp_path / "staging")) as ckpt:
        return ckpt.restore(state)


def trained_and_fresh(tmp_path: Path) -> tuple[dict[str, Any], str, dict[str, Any]]:
    """A state trained 3 steps and saved at step 3, its checkpoint's URI, and a fresh state to restore into."""
    state = make_state(0)
    train(state, 3)
    return state, saved_checkpoint(tmp_path, state), make_state(0, seed=5)


def test_keys_the_restore_leaves_out_are_named_in_a_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    state, uri, fresh = trained_and_fresh(tmp_path)
    caplog.set_level(logging.WARNING, logger="agent.checkpoint")
    assert restore(tmp_path, uri, {"model": fresh["model"], "counter": fresh["counter"]}) == 3
    assert_same(fresh["model"].state_dict(), state["model"].state_dict(), "the restored model")
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("'optim', 'sched'" in w and "leaves out" in w for w in warnings), warnings
    assert fresh["optim"].state_dict()["state"] == {}  # left as built, as the warning says


def test_the_full_state_restores_without_that_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    state, uri, fresh = trained_and_fresh(tmp_path)
    caplog.set_level(logging.WARNING, logger="agent.checkpoint")
    assert restore(tmp_path, uri, fresh) == 3
    assert_same(snapshot(fresh), snapshot(state), "the restored state")
    assert not [r for r in caplog.records if "leaves out" in r.getMessage()]


class Refusing:
    """A per-rank object whose load_state_dict rejects what it saved (its format changed)."""

    def state_dict(self) -> dict[str, Any]:
        return {"version": 1}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        raise KeyError("position")


def test_an_object_that_refuses_its_saved_state_is_named(tmp_path: Path) -> None:
    state = make_state(0)
    uri = saved_checkpoint(tmp_path, {**state, "loader": Refusing()})
    with pytest.raises(RestoreRefusedError) as caught:
        restore(tmp_path, uri, {**make_state(0), "loader": Refusing()})
    assert "state['loader'].load_state_dict() (Refusing) refused the state it saved: KeyError('position')" in str(
        caught.value
    )


def test_an_object_that_refuses_its_saved_state_leaves_the_state_as_it_was(tmp_path: Path) -> None:
    """Loaded after the model and optimizers, an object whose load_state_dict() raised left them
    (and the objects before it) holding the checkpoint's values, the rest the initial ones: the
    README promises the state untouched. The objects now load first, the others are put back."""
    state = make_state(0)
    train(state, 3)
    uri = saved_checkpoint(tmp_path, {**state, "position": Position(strict=False)})
    fresh = {**make_state(0, seed=5), "position": Position(strict=True)}  # reads a key the save lacks
    fresh["counter"].ticks = 11
    before = snapshot(fresh)
    with pytest.raises(RestoreRefusedError) as caught:
        restore(tmp_path, uri, fresh)
    assert_same(snapshot(fresh), before, "the state after the refusal")
    message = str(caught.value)
    assert "state['position'].load_state_dict() (Position) refused the state it saved: KeyError('position')" in message
    assert "the state is unchanged" in message and "part of it was loaded" not in message
    assert fresh["position"].state_dict() == {"position": 0}


class Lazy:
    """A per-rank object set up by its first load or use: no state_dict() before (a lazily built
    sampler, a metric)."""

    def __init__(self) -> None:
        self.n: int | None = None

    def state_dict(self) -> dict[str, int]:
        if self.n is None:
            raise RuntimeError("not set up yet")
        return {"n": self.n}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.n = state["n"]


def test_an_object_with_no_state_dict_before_it_is_loaded_is_loaded_as_before(tmp_path: Path) -> None:
    """Keeping each object's state to put back called its state_dict() before its load, and one
    that raised failed the checkpoint as incompatible: the restore refused a checkpoint it had
    always loaded, and with start_fresh retired them all. Found in review. It is loaded as before;
    only a failure later in the same restore could not put it back."""
    state = make_state(0)
    train(state, 3)
    saved = Lazy()
    saved.n = 5
    uri = saved_checkpoint(tmp_path, {**state, "lazy": saved})
    fresh = {**make_state(0, seed=5), "lazy": Lazy()}
    assert restore(tmp_path, uri, fresh) == 3
    assert fresh["lazy"].n == 5


def test_an_object_refused_on_one_rank_leaves_every_ranks_state_as_it_was(tmp_path: Path) -> None:
    """(2 ranks) Rank 1's object refuses; rank 0's objects all loaded: every rank refuses alike and
    every rank's state is as it was, rank 0's loaded objects put back."""
    uri, dump = str(tmp_path / "ckpt"), tmp_path / "restored"
    harness.torchrun(2, harness.SCRIPTS / "ckpt_object_refused.py", "--uri", uri, "--dump", str(dump))
    outcomes = []
    for rank in range(2):
        got = torch.load(f"{dump}.rank{rank}.pt", weights_only=False)
        assert isinstance(got["outcome"], str), f"rank {rank} restored step {got['outcome']}"
        outcomes.append(got["outcome"])
        assert_same(got["after"], got["before"], f"rank {rank}'s state after the refusal")
    assert outcomes[0] == outcomes[1]
    assert "on rank 1: state['position'].load_state_dict() (Position) refused the state it saved" in outcomes[0]
    assert "the state is unchanged" in outcomes[0] and "part of it was loaded" not in outcomes[0]


def test_an_object_under_a_key_saved_as_a_module_is_refused_before_anything_loads(tmp_path: Path) -> None:
    state = make_state(0)
    train(state, 2)
    uri = saved_checkpoint(tmp_path, {"model": state["model"], "ema": nn.Linear(2, 2)})
    fresh = make_state(0, seed=5)
    before = snapshot(fresh)
    with pytest.raises(RestoreRefusedError) as caught:
        restore(tmp_path, uri, {"model": fresh["model"], "ema": fresh["counter"]})
    message = str(caught.value)
    assert "state['ema'] is a Counter" in message and "saved 'ema' as a module or optimizer" in message
    assert "part of it was loaded" not in message
    assert_same(fresh["model"].state_dict(), before["model"], "the model after the refusal")


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


def compiled(model: nn.Module) -> nn.Module:
    return torch.compile(model, backend="eager")  # the wrapper and its _orig_mod. names, no compiler


@pytest.mark.parametrize(
    ("save_as", "restore_as"),
    [(compiled, lambda m: m), (lambda m: m, compiled)],
    ids=["compiled-to-bare", "bare-to-compiled"],
)
def test_a_compiled_model_and_its_bare_module_restore_into_each_other(
    tmp_path: Path, save_as: Any, restore_as: Any
) -> None:
    state = make_state(0)
    train(state, 3)
    uri = saved_checkpoint(tmp_path, {**state, "model": save_as(state["model"])})
    fresh = make_state(0, seed=5)
    assert restore(tmp_path, uri, {**fresh, "model": restore_as(fresh["model"])}) == 3
    assert_same(snapshot(fresh), snapshot(state), "the restored state")
    train(state, 2, start=3)
    train(fresh, 2, start=3)
    assert_same(snapshot(fresh), snapshot(state), "the state two steps after the restore")


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


def test_a_plain_dataloader_is_refused_with_what_keeps_a_position(tmp_path: Path) -> None:
    """The message names both ways to keep a position: spotjob's ResumableLoader (and where the
    README tells of it) and torchdata's StatefulDataLoader. Wrapped, with a generator= of its own
    (which the wrapper asks for), the same loader is saved and restored."""
    loader = torch.utils.data.DataLoader(list(range(10)), batch_size=2, shuffle=True)
    with (
        Checkpointer(str(tmp_path / "ckpt"), async_save=False, staging_dir=str(tmp_path / "staging")) as ckpt,
        pytest.raises(
            TypeError,
            match=r"state\['loader'\] is a DataLoader.*keeps no position.*agent.ResumableLoader\(loader\).*"
            r"generator=.*README, \"A plain `DataLoader`\".*StatefulDataLoader",
        ),
    ):
        ckpt.save(1, {**make_state(0), "loader": loader})
    with pytest.raises(ValueError, match=r"generator=torch.Generator\(\).manual_seed\(rank\)"):
        ResumableLoader(loader)
    seeded = torch.utils.data.DataLoader(
        list(range(10)), batch_size=2, shuffle=True, generator=torch.Generator().manual_seed(4)
    )
    data = ResumableLoader(seeded)
    for _ in range(7):  # an epoch of 5 batches and 2 of the next
        data.next_batch()
    with Checkpointer(str(tmp_path / "ok"), async_save=False, staging_dir=str(tmp_path / "staging")) as ckpt:
        ckpt.save(1, {**make_state(0), "loader": data})
    again = ResumableLoader(
        torch.utils.data.DataLoader(list(range(10)), batch_size=2, shuffle=True, generator=torch.Generator())
    )
    with Checkpointer(str(tmp_path / "ok"), async_save=False, staging_dir=str(tmp_path / "staging")) as ckpt:
        assert ckpt.restore({**make_state(0), "loader": again}) == 1
    assert (again.epoch, again.seen) == (1, 2)
    more = [again.next_batch() for _ in range(3)]
    assert [b.tolist() for b in more] == [b.tolist() for b in [data.next_batch() for _ in range(3)]]


@pytest.mark.parametrize("key", ["eval", "cpu", "state_dict", "training"])
def test_a_module_under_a_key_that_names_a_module_attribute_is_refused_naming_it(tmp_path: Path, key: str) -> None:
    """Fails without the fix: a module under a key such as "eval" (an eval copy of the model) failed
    the save as ``SaveFailedError: ... KeyError("attribute 'eval' already exists")``, naming neither
    the key's problem nor what to do, and a restore failed the same way."""
    state = {**make_state(0), key: nn.Linear(2, 2)}
    with (
        Checkpointer(str(tmp_path / "ckpt"), async_save=False, staging_dir=str(tmp_path / "staging")) as ckpt,
        pytest.raises(ValueError, match=rf"state key '{key}' holds a module.*nn.Module attribute.*'{key}_model'"),
    ):
        ckpt.save(1, state)
    assert not (tmp_path / "ckpt").exists() or not any((tmp_path / "ckpt").glob("step-*")), "nothing is committed"


def test_a_state_key_that_is_not_utf8_is_refused_naming_it_before_anything_is_written(tmp_path: Path) -> None:
    """Fails without the fix: a key holding a lone surrogate (a name decoded from bytes that are not
    UTF-8) passed the key check, the shards were written and the commit failed with a
    PydanticSerializationError that named neither the key nor what to do, every save."""
    key = os.fsdecode(b"shard-\xff")
    state = {**make_state(0), key: nn.Linear(2, 2)}
    with (
        Checkpointer(str(tmp_path / "ckpt"), async_save=False, staging_dir=str(tmp_path / "staging")) as ckpt,
        pytest.raises(ValueError, match=r"state key 'shard-\\udcff' is not valid UTF-8.*os\.fsencode\(key\)"),
    ):
        ckpt.save(1, state)
    assert not (tmp_path / "ckpt").exists() or not any((tmp_path / "ckpt").glob("step-*")), "nothing is written"


@pytest.mark.parametrize(
    ("value", "hint"),
    [
        (7, "an object whose state_dict\\(\\) returns it and whose load_state_dict\\(\\) sets it back"),
        ({"best_loss": 0.5}, "an object whose state_dict\\(\\) returns it"),
        ([1, 2], "an object whose state_dict\\(\\) returns it"),
        (torch.zeros(3), "register_buffer"),
        (None, "leave the key out"),
    ],
    ids=["int", "dict", "list", "tensor", "None"],
)
def test_a_plain_value_in_the_state_is_refused_saying_how_to_keep_it(tmp_path: Path, value: Any, hint: str) -> None:
    """``{"model": m, "epoch": 7}``: the refusal listed what a value may be but not how to keep an
    epoch count, a dict of counters or a bare tensor (restore loads in place and cannot rebind
    ``state['epoch']``, so a plain value could never come back)."""
    with Checkpointer(str(tmp_path / "ckpt"), async_save=False, staging_dir=str(tmp_path / "staging")) as ckpt:
        for call in (ckpt.save, ckpt.restore):
            args = (1, {**make_state(0), "extra": value}) if call == ckpt.save else ({**make_state(0), "extra": value},)
            with pytest.raises(TypeError, match=rf"state\['extra'\] is a {type(value).__name__}.*{hint}"):
                call(*args)  # type: ignore[operator]
    assert not list((tmp_path / "ckpt").glob("step-*"))


def qat_state(seed: int, hidden: int = 16) -> dict[str, Any]:
    import torch.ao.quantization as tq

    torch.manual_seed(seed)
    model = nn.Sequential(tq.QuantStub(), nn.Linear(8, hidden), nn.ReLU(), nn.Linear(hidden, 4), tq.DeQuantStub())
    model.qconfig = tq.get_default_qat_qconfig("fbgemm")  # per-channel weight fake-quantizers
    tq.prepare_qat(model, inplace=True)
    return {"model": model, "optim": torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)}


def train_qat(state: dict[str, Any], steps: int, start: int = 0) -> None:
    for step in range(start, start + steps):
        state["optim"].zero_grad()
        state["model"](torch.randn(4, 8, generator=torch.Generator().manual_seed(step))).pow(2).mean().backward()
        state["optim"].step()


@pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")  # torch.ao's own
def test_a_quantization_aware_model_restores_into_a_freshly_prepared_one(tmp_path: Path) -> None:
    """A fresh model's per-channel fake-quant scales have shape [1] (their observers' min_val [0])
    until a forward calibrates them to [C]: the restore refused every QAT checkpoint as "the
    checkpoint holds shape [16], the model [1]", though it is the model they were saved from and
    ``load_state_dict`` takes them."""
    state = qat_state(0)
    train_qat(state, 3)
    uri = saved_checkpoint(tmp_path, state)
    fresh = qat_state(5)
    assert fresh["model"].state_dict()["1.weight_fake_quant.scale"].shape == (1,)
    assert restore(tmp_path, uri, fresh) == 3
    assert_same(fresh["model"].state_dict(), state["model"].state_dict(), "the restored QAT model")
    train_qat(state, 2, start=3)
    train_qat(fresh, 2, start=3)
    assert_same(fresh["model"].state_dict(), state["model"].state_dict(), "the QAT model two steps on")
    # A QAT model of another size is still refused before anything is loaded (a pin: it was).
    other = qat_state(5, hidden=32)
    before = {k: v.clone() for k, v in other["model"].state_dict().items()}
    with pytest.raises(RestoreRefusedError, match=r"model\.1\.weight: the checkpoint holds shape \[16, 8\]"):
        restore(tmp_path, uri, other)
    assert_same(other["model"].state_dict(), before, "the QAT model a restore refused")


class Calibrated(nn.Module):
    """Extra state as quantization and fp8 libraries keep it: ``get_extra_state()`` hands out the
    module's own amax tensor (or a dict of such tensors), and ``set_extra_state()`` derives the
    scale the forward uses from it."""

    def __init__(self, amax: float, as_dict: bool = False, extra: Any = None) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.amax = torch.full((2,), amax)
        self.scale = 1.0 / self.amax
        self.as_dict, self.extra = as_dict, extra

    def get_extra_state(self) -> Any:
        if self.extra is not None:
            return self.extra
        return {"amax": self.amax, "version": 2} if self.as_dict else self.amax

    def set_extra_state(self, state: Any) -> None:
        amax = state["amax"] if self.as_dict else state
        self.amax = amax.clone()
        self.scale = 1.0 / self.amax


@pytest.mark.parametrize("as_dict", [False, True], ids=["tensor", "dict"])
def test_a_modules_extra_state_comes_back_through_set_extra_state(tmp_path: Path, as_dict: bool) -> None:
    """A tensor handed out by ``get_extra_state()`` was loaded into in place, and the restore then
    skipped ``load_state_dict`` as a copy onto itself: ``set_extra_state()`` never ran and the
    scale derived from it stayed the fresh model's. A dict holding tensors was refused as "the
    checkpoint holds model._extra_state.amax, the model does not", so no checkpoint of such a model
    could ever be restored."""
    model = Calibrated(4.0, as_dict)
    uri = saved_checkpoint(tmp_path, {"model": model})
    fresh = Calibrated(1.0, as_dict)
    assert restore(tmp_path, uri, {"model": fresh}) == 3
    assert torch.equal(fresh.amax, model.amax)
    assert torch.equal(fresh.scale, model.scale)


def test_extra_state_a_restore_could_not_load_is_refused_when_saved(tmp_path: Path) -> None:
    """Extra state goes through DCP, whose values a restore loads with ``weights_only``: a NumPy
    scalar saved without a word made every checkpoint of the run unrestorable ("not plain data"),
    found out only at the restore after a preemption."""
    import numpy as np

    model = Calibrated(4.0, extra={"amax": np.float32(4.0)})
    uri = str(tmp_path / "ckpt")
    with (
        Checkpointer(uri, async_save=False, staging_dir=str(tmp_path / "staging")) as ckpt,
        pytest.raises(ValueError, match=r"model\._extra_state\.amax.*numpy.*weights_only.*plain Python values"),
    ):
        ckpt.save(1, {"model": model})
    assert not list(Path(uri).glob("step-*"))


class Sampler:
    """A per-rank object whose state holds NumPy values (its order, a seed), which a restore's
    ``weights_only`` load refuses, beside plain ones."""

    def __init__(self, order: Any) -> None:
        self.order = order

    def state_dict(self) -> dict[str, Any]:
        return {"pos": 3, "order": self.order, "seeds": [7, self.order[0]]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.order = state["order"]


def test_a_per_rank_value_a_restore_could_not_load_fails_the_save_naming_where_it_is_and_the_remedy(
    tmp_path: Path,
) -> None:
    """Fails without the fix: the SaveFailedError named neither the state key nor the value ("a
    state_dict() in it holds something that weights_only loading refuses: ... by default..
    Convert it"), nor torch.from_numpy. A plain order saves."""
    import numpy as np

    uri = str(tmp_path / "ckpt")
    with Checkpointer(uri, async_save=False, staging_dir=str(tmp_path / "staging")) as ckpt:
        with pytest.raises(SaveFailedError) as refused:
            ckpt.save(1, {**make_state(0), "sampler": Sampler(np.arange(4))})
        said = str(refused.value)
        assert "rank 0: the per-rank state cannot be restored: state['sampler'].state_dict()['order'] is a " in said
        assert "is a numpy.ndarray (and state['sampler'].state_dict()['seeds'][1] is a NumPy scalar), " in said
        assert "torch.from_numpy(a)" in said and "int(x)" in said and "default.." not in said, said
        assert not list(Path(uri).glob("step-*"))
        ckpt.save(2, {**make_state(0), "sampler": Sampler(torch.arange(4))})
    assert [p.name for p in Path(uri).glob("step-*")] == ["step-000000002"]


def test_a_renamed_layer_is_refused_naming_the_tensors_on_both_sides(tmp_path: Path) -> None:
    """The refusal named the first difference only ("model.head.weight: the model has it, ... (and 3
    more)"), hiding the names the checkpoint holds instead: the ones to rename the layer back to."""
    saved = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    uri = saved_checkpoint(tmp_path, {"model": saved})
    renamed = nn.Sequential()
    renamed.add_module("0", nn.Linear(3, 4))
    renamed.add_module("1", nn.ReLU())
    renamed.add_module("head", nn.Linear(4, 2))
    before = {k: v.clone() for k, v in renamed.state_dict().items()}
    with pytest.raises(RestoreRefusedError) as refused:
        restore(tmp_path, uri, {"model": renamed})
    message = str(refused.value)
    for fqn in ("model.head.weight", "model.head.bias"):
        assert f"{fqn}: the model has it, the checkpoint does not" in message
    for fqn in ("model.2.weight", "model.2.bias"):
        assert f"{fqn}: the checkpoint holds it, the model does not" in message
    assert_same(renamed.state_dict(), before, "the model after a refused restore")
