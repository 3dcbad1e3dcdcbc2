"""What a state dict may hold, and how it splits into DCP state (modules and optimizers, which
reshard) and per-rank objects."""

from __future__ import annotations

import contextlib
import functools
import io
import itertools
import logging
import os
import pickle
import sys
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict, get_state_dict
from torch.nn.modules.module import _EXTRA_STATE_KEY_SUFFIX
from torch.nn.parameter import is_lazy

from agent import rank_state
from agent.checkpoint._core import _Core
from agent.checkpoint.config import encodes_as_utf8
from agent.checkpoint.errors import SaveFailedError

log = logging.getLogger("agent.checkpoint")  # one logger for the package, as before it was split


def _is_zero_redundancy_optimizer(value: Any) -> bool:
    """Whether ``value`` is torch's ``ZeroRedundancyOptimizer``, without importing its module (which
    warns, through torch.jit, in the training process): a script that made one has imported it."""
    module = sys.modules.get("torch.distributed.optim.zero_redundancy_optimizer")
    zero = getattr(module, "ZeroRedundancyOptimizer", None)
    return isinstance(zero, type) and isinstance(value, zero)


class _ModuleBag(nn.Module):
    """Holds the job's modules under their state keys, so tensor names read "model.fc.weight"."""

    def __init__(self, modules: Mapping[str, nn.Module]) -> None:
        super().__init__()
        for key, module in modules.items():
            self.add_module(key, module)


@functools.cache
def _module_attributes() -> frozenset[str]:
    """The names a ``_ModuleBag`` has before any module is added (its class's and those each
    instance sets, such as ``training``): none can be a state key of a module."""
    return frozenset(dir(_ModuleBag({})))


def _model_state(bag: nn.Module) -> dict[str, Any]:
    """``get_model_state_dict(bag)``, or {} for modules without any state (an ``nn.Identity``):
    torch refuses those with an error about a process group instead."""
    if not bag.state_dict():
        return {}
    return get_model_state_dict(bag)


@contextlib.contextmanager
def _as_it_is(opt: torch.optim.Optimizer, *, initialise: bool) -> Iterator[None]:
    """Around torch's ``get_optimizer_state_dict`` / ``get_state_dict`` of ``opt``: unless
    ``initialise``, an optimizer that has no state yet (it has not stepped) is taken as it is, its
    state empty.

    For such an optimizer torch first runs a step with zero gradients and lr 0 on it, to create the
    state it then hands out: the live optimizer keeps it (Adam's step 1 and zero moments, so the
    first real step runs as its second) and the optimizer's step hooks run. A save before the first
    step would change the training after it, and a restore from that save would too. Torch skips
    that step when any parameter has a gradient: one gets a zero gradient for the call. Restore's
    generic path initialises on purpose: the state created is what DCP loads into.
    """
    params = [p for group in opt.param_groups for p in group["params"]]
    if initialise or opt.state or not params or any(p.grad is not None for p in params):
        yield
        return
    smallest = min(params, key=lambda p: p.numel())
    smallest.grad = torch.zeros_like(smallest)
    try:
        yield
    finally:
        smallest.grad = None


def _optimizer_state(bag: nn.Module, opt: torch.optim.Optimizer, *, initialise: bool) -> dict[str, Any]:
    """``get_optimizer_state_dict(bag, opt)``, an optimizer without state taken as it is unless
    ``initialise`` (``_as_it_is``)."""
    with _as_it_is(opt, initialise=initialise):
        return get_optimizer_state_dict(bag, opt)


def _model_and_optimizer_state(
    bag: nn.Module, opt: torch.optim.Optimizer, *, initialise: bool
) -> tuple[dict[str, Any], dict[str, Any]]:
    """``_model_state(bag)`` and ``_optimizer_state(bag, opt, initialise=...)`` from one call of
    torch's ``get_state_dict``, which hands out what its two halves hand out: each half first maps
    every parameter to its names (``_get_fqns``, a walk down the modules per parameter), and that
    was a third of this split for 1000 small layers. A model without state takes the two calls
    (``get_state_dict`` refuses it, as ``get_model_state_dict`` does)."""
    if not bag.state_dict():
        return {}, _optimizer_state(bag, opt, initialise=initialise)
    with _as_it_is(opt, initialise=initialise):
        model_state, optim_state = get_state_dict(bag, opt)
    return model_state, optim_state


def _state_dict_as_torch_names_it(bag: nn.Module) -> bool:
    """Whether torch's ``get_state_dict`` / ``get_model_state_dict`` / ``get_optimizer_state_dict``
    of ``bag`` hand out ``bag.state_dict()`` as it is and the optimizers' ``state_dict()`` keyed by
    ``bag.named_parameters()``'s names (``_plain_state``): every name is its own FQN
    (``_names_are_fqns``: no DDP, FSDP, compiled or renaming module), no module comes from
    ``torch.distributed`` (an activation-checkpointing wrapper, ``fully_shard``'s), and none
    makes its state dict its own way (a ``state_dict`` or ``_save_to_state_dict`` of its own, a
    state-dict hook that may add names torch would look up as attributes). One look at each module."""
    if not _names_are_fqns(bag):
        return False
    for module in bag.modules():
        kind = type(module)
        if (
            kind.state_dict is not nn.Module.state_dict
            or kind._save_to_state_dict is not nn.Module._save_to_state_dict
            or module._state_dict_hooks
            or "state_dict" in module.__dict__
            or kind.__module__.startswith("torch.distributed.")
        ):
            return False
    return True


def _plain_state(
    bag: nn.Module, optims: Mapping[str, torch.optim.Optimizer], *, initialise: frozenset[str]
) -> tuple[dict[str, Any], dict[str, dict[str, Any]]] | None:
    """What torch's ``get_state_dict`` (or ``get_model_state_dict`` and ``get_optimizer_state_dict``
    per optimizer) hands out for ``bag`` and ``optims``, built as torch builds it where
    ``_state_dict_as_torch_names_it(bag)``, without its mapping of every parameter to its names (a
    walk down the modules per name, twice, about 0.1 ms a layer): the modules' ``state_dict()`` as
    it is, each optimizer's ``state_dict()`` with its parameter ids replaced by their names. The
    same keys in the same order, the same tensors (views of the same memory for the modules'; the
    optimizer's own for its state), the same param groups. An optimizer in ``initialise`` is
    initialised as torch initialises it (``_init_optim_state``); the others are taken as they are.
    None where a name could be taken apart by torch (activation checkpointing's prefix): torch's
    path is taken instead."""
    from torch.distributed.checkpoint.state_dict import _CHECKPOINT_PREFIX, _init_optim_state, _state_dict_fn

    with torch.no_grad():  # as torch takes both
        model_state = bag.state_dict()
        prefix = _CHECKPOINT_PREFIX.rstrip(".")
        if any(prefix in name for name in model_state):
            return None
        osds = {}
        for key, opt in optims.items():
            if key in initialise:
                _init_optim_state(opt)
            osds[key] = _state_dict_fn(opt, "state_dict")()
    names: list[tuple[str, nn.Parameter]] | None = None
    optim_states: dict[str, dict[str, Any]] = {}
    for key, opt in optims.items():
        osd = osds[key]
        if names is None:
            names = list(bag.named_parameters())
        params = [p for group in opt.param_groups for p in group["params"]]
        index = dict(zip(params, range(len(params)), strict=True))
        name_of: dict[int, str] = {}
        for name, param in names:
            i = index.get(param)
            if i is not None:
                name_of[i] = name
        for group in osd["param_groups"]:
            group["params"] = [name_of[i] for i in group["params"]]
        optim_states[key] = {
            "state": {name_of[i]: value for i, value in osd["state"].items()},
            "param_groups": list(osd["param_groups"]),
        }
    return model_state, optim_states


_BITS_DTYPES = frozenset(
    getattr(torch, name) for name in ("bits1x8", "bits2x4", "bits4x2", "bits8", "bits16") if hasattr(torch, name)
)
"""Dtypes that DCP cannot size (its planner asks ``torch.iinfo`` of them, and fails)."""


def _uncopyable_dtypes() -> frozenset[torch.dtype]:
    """The dtypes this torch has no copy kernel for: torch 2.9.1 saves a float4_e2m1fn_x2 tensor,
    but a restore copies each saved tensor into its target and failed with the state half loaded.
    Found by trying a one-byte copy, once, on a tensor of its own."""
    found = set()
    for name in ("float4_e2m1fn_x2",):
        dtype = getattr(torch, name, None)
        if dtype is None:
            continue
        try:
            torch.zeros(1, dtype=torch.uint8).view(dtype).clone()
        except (NotImplementedError, RuntimeError):
            found.add(dtype)
    return frozenset(found)


_UNCOPYABLE_DTYPES = _uncopyable_dtypes()


def _unsaveable(tensor: torch.Tensor) -> str | None:
    """Why DCP cannot save ``tensor`` and restore it bit for bit, in words (what it is, why, what
    to do), or None. Tensors from torch's own distributed wrappers (DTensor, FSDP's flat
    parameters) are DCP's to handle and pass."""
    kind = type(tensor)
    if kind.__module__.startswith("torch.") and kind not in (torch.Tensor, nn.Parameter):
        return None
    if tensor.is_quantized:
        return (
            f"is a quantized tensor ({tensor.dtype}): a checkpoint would keep its integers but not its scale "
            "and zero point, and restore other values. Save the float model (dequantize()), or keep quantized "
            "tensors (a torch.ao quantized model) in an object whose state_dict() returns them and whose "
            "load_state_dict() loads them back (saved whole, per rank)"
        )
    if tensor.is_nested:
        return (
            "is a nested tensor: checkpoints hold dense tensors. Keep its components (unbind()) instead, or "
            "keep it in an object whose state_dict() returns it (saved whole, per rank)"
        )
    if tensor.layout != torch.strided:
        return (
            f"is a sparse tensor ({tensor.layout}): checkpoints hold dense tensors. Keep it dense (to_dense()), "
            "or keep it in an object whose state_dict() returns it (saved whole, per rank)"
        )
    if tensor.dtype in _UNCOPYABLE_DTYPES:
        return (
            f"is a {tensor.dtype} tensor, a dtype this torch ({torch.__version__}) cannot copy, and a restore "
            "copies each saved tensor into its target. Register a view of it as bytes (tensor.view(torch.uint8)) "
            "and view it back where it is used, or use a torch that copies it (2.13 does)"
        )
    if tensor.dtype in _BITS_DTYPES:
        name = str(tensor.dtype)
        as_int = "torch.uint8" if tensor.element_size() == 1 else "torch.int16"
        return (
            f"is a {name} tensor: torch's distributed checkpoint cannot save that dtype (it has no integer "
            f"range). Register a view of it as integers of its size (tensor.view({as_int})) and view it back as "
            f"{name} where it is used, or keep it in an object whose state_dict() returns it (saved whole, per rank)"
        )
    if tensor.device.type == "meta":
        return (
            "is on the meta device and holds no values: materialise the module first "
            "(module.to_empty(device=...), then initialise it) before save() or restore()"
        )
    if tensor.is_conj() or tensor.is_neg():
        return (
            "is a lazily conjugated or negated view (x.conj(), x.mH, x.conj().imag): its memory holds the values "
            "before the conjugation, which an async save would write, and a restore reading a big one straight "
            "into that memory fails halfway. Register a tensor of its own instead (x.resolve_conj(), or "
            "x.resolve_neg() for a negated one)"
        )
    if torch._debug_has_internal_overlap(tensor) == 1:
        return (
            f"has elements that share memory (an expand()ed view, strides {tuple(tensor.stride())}): a restore "
            "cannot write into it, so its checkpoint could never load. Register a clone() of it instead"
        )
    if kind not in (torch.Tensor, nn.Parameter):
        # Restore loads every tensor record with weights_only: a class it does not allow fails the
        # restore halfway. Checked the way restore loads it, without the data.
        record = io.BytesIO()
        try:
            with torch.serialization.skip_data():
                torch.save(tensor.detach(), record)
            record.seek(0)
            with torch.serialization.skip_data():
                torch.load(record, weights_only=True)
        except pickle.UnpicklingError as e:
            reason = rank_state.refusal_reason(e).rstrip(".")
            return (
                f"is a {kind.__module__}.{kind.__qualname__} (a torch.Tensor subclass) that a restore, which loads "
                f"tensors with weights_only, would refuse ({reason}). Allow the class with "
                "torch.serialization.add_safe_globals([...]) before save() and restore(), or register a plain "
                "tensor (as_subclass(torch.Tensor))"
            )
        except Exception:  # not this check's to judge: DCP says what it says
            return None
    return None


def _tensors_of_own_state(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors that ``module`` adds to its ``state_dict()`` besides its parameters and buffers,
    by their names under it: a module that overrides ``_save_to_state_dict`` (torch.ao's quantized
    ones hand out their packed weight and bias as a tuple) is asked, others cost nothing."""
    if type(module)._save_to_state_dict is nn.Module._save_to_state_dict:
        return
    own: dict[str, Any] = {}
    module._save_to_state_dict(own, "", keep_vars=True)
    plain = set(module._parameters) | set(module._buffers)
    for name, value in own.items():
        if name not in plain:
            yield from _tensors_under(name, value)


def _tensors_under(name: str, value: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors in ``value`` (looked into dicts, lists and tuples) with their dotted names
    (under ``name``, or none)."""
    if isinstance(value, torch.Tensor):
        yield name, value
    elif isinstance(value, Mapping):
        for key, item in value.items():
            yield from _tensors_under(f"{name}.{key}" if name else str(key), item)
    elif type(value) in (list, tuple):
        for i, item in enumerate(value):
            yield from _tensors_under(f"{name}.{i}" if name else str(i), item)


_PLAIN_VALUES = (int, float, bool, str, bytes, type(None), torch.dtype, torch.device, torch.Size)
"""Value types that every ``weights_only`` load takes: not checked by ``_check_values_loadable``."""


def _unplain_values(name: str, value: Any) -> Iterator[tuple[str, Any]]:
    """The values under ``value`` that are neither tensors nor ``_PLAIN_VALUES``, with their dotted
    names (``model._extra_state.amax``); dicts, lists and tuples are looked into."""
    if isinstance(value, torch.Tensor) or type(value) in _PLAIN_VALUES:
        return
    if isinstance(value, Mapping):
        for key, item in value.items():
            yield from _unplain_values(f"{name}.{key}" if name else str(key), item)
    elif type(value) in (list, tuple):
        for i, item in enumerate(value):
            yield from _unplain_values(f"{name}.{i}", item)
    else:
        yield name, value


def _names_are_fqns(bag: nn.Module) -> bool:
    """Whether torch's ``_get_fqns(bag, name)`` is ``{name}`` less activation checkpointing's
    wrapper prefix (``_CHECKPOINT_PREFIX``, which it drops from every name) for every
    parameter name of ``bag``: none of its modules is one that walk sees through or renames under
    (DDP, FSDP, a ``torch.compile`` wrapper, one with ``_fqn_modifiers``). That walk, per name,
    cost 2 µs a parameter in every save's blocking part; this looks at each module once."""
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.nn.parallel import DistributedDataParallel

    wrappers: tuple[type, ...] = (DistributedDataParallel, FullyShardedDataParallel)  # as _get_fqns tests them
    compiled = sys.modules.get("torch._dynamo.eval_frame")  # not imported: no compiled module exists
    if compiled is not None:
        wrappers += (compiled.OptimizedModule,)
    return not any(isinstance(m, wrappers) or hasattr(m, "_fqn_modifiers") for m in bag.modules())


class _State(_Core):
    """What a state dict may hold, and how it splits into DCP state and per-rank objects."""

    @staticmethod
    def _classify(
        state: Mapping[str, Any],
    ) -> tuple[dict[str, nn.Module], dict[str, torch.optim.Optimizer], dict[str, Any]]:
        modules = {k: v for k, v in state.items() if isinstance(v, nn.Module)}
        optims = {k: v for k, v in state.items() if isinstance(v, torch.optim.Optimizer)}
        others = {k: v for k, v in state.items() if k not in modules and k not in optims}
        return modules, optims, others

    def _check_state(self, state: Mapping[str, Any]) -> None:
        if not isinstance(state, Mapping) and not callable(getattr(state, "items", None)):  # a ModuleDict will do
            raise TypeError(
                f"state must be a dict of names to what to save, e.g. {{'model': model, 'optim': optimizer}}; "
                f"got a {type(state).__name__}"
            )
        if not state:
            raise ValueError("state is empty: pass e.g. {'model': model, 'optim': optimizer}")
        for key, value in state.items():
            if not isinstance(key, str) or not key or "." in key or "/" in key:
                raise ValueError(f"state key {key!r} must be a non-empty string without '.' or '/'")
            if key.startswith("__"):
                raise ValueError(f"state key {key!r} is reserved (keys starting with '__')")
            if not encodes_as_utf8(key):
                # The manifest lists the state keys as UTF-8 JSON: its commit failed, every save.
                raise ValueError(
                    f"state key {key!r} is not valid UTF-8: it holds a lone surrogate, as a name that is not "
                    "UTF-8 does when Python decodes it (a file name from os.listdir), and the manifest records "
                    "state keys as UTF-8 JSON. Use a key of valid text, e.g. os.fsencode(key).decode(errors="
                    "'replace'), the same in save() and restore()"
                )
            if isinstance(value, nn.Module) and key in _module_attributes():
                # The modules are saved as children of one module under their keys (so names read
                # "model.fc.weight"), and torch walks them by attribute: such a key would name the
                # method, not the module (add_module refused it with a bare KeyError).
                raise ValueError(
                    f"state key {key!r} holds a module, and {key!r} is the name of an nn.Module attribute, "
                    f"which cannot name a module in a checkpoint: use another key (e.g. {key + '_model'!r}), "
                    "the same in save() and restore()"
                )
            if _is_zero_redundancy_optimizer(value):
                raise TypeError(
                    f"state[{key!r}] is a ZeroRedundancyOptimizer: each rank holds only its own shard of the "
                    "optimizer state, and its state_dict() first needs consolidate_state_dict(to=r), which gathers "
                    "the whole state on that one rank only, so it cannot be saved by name on every rank. Keep each "
                    "rank's shard in an object of your own instead (its state_dict() returns "
                    f"{key}.optim.state_dict() and the param_groups' hyperparameters; see 'ZeroRedundancyOptimizer' "
                    "in spotjob's README; it restores on the same number of ranks only), or shard with FSDP2 "
                    "(fully_shard), whose optimizer state DCP saves and reshards"
                )
            if not isinstance(value, nn.Module | torch.optim.Optimizer) and not (
                callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None))
            ):
                hint = ""
                if isinstance(value, torch.Generator):
                    hint = (
                        ": wrap it in an object whose state_dict() returns its get_state() and whose "
                        "load_state_dict() calls set_state()"
                    )
                elif isinstance(value, torch.utils.data.DataLoader):
                    hint = (
                        ": a DataLoader keeps no position to save. Wrap it: agent.ResumableLoader(loader) keeps "
                        "its epoch, the batches drawn in it and its generator= as the epoch began, and hands "
                        'out the same batches after a restore (spotjob\'s README, "A plain `DataLoader`"); '
                        "or use torchdata's StatefulDataLoader (its place in the epoch, though not its "
                        "workers' random streams)"
                    )
                elif value is None:
                    hint = ": leave the key out (a state value is restored in place; None holds nothing)"
                elif isinstance(value, torch.Tensor):
                    hint = (
                        ": restore loads in place and cannot rebind state[key]; make it a buffer of one of the "
                        "modules (register_buffer), or keep it in an object whose state_dict() returns it and "
                        "whose load_state_dict() copies it back"
                    )
                elif isinstance(value, int | float | str | bytes | list | tuple | dict | set):
                    hint = (
                        ": restore loads in place and cannot rebind state[key] to the saved value; keep it in "
                        "an object whose state_dict() returns it and whose load_state_dict() sets it back "
                        "(a value only for the record, such as the loss, goes in metadata= instead)"
                    )
                raise TypeError(
                    f"state[{key!r}] is a {type(value).__name__}; values must be modules, optimizers, "
                    f"or objects with state_dict()/load_state_dict(){hint}"
                )
        self._check_no_lazy_tensors(state)
        self._check_tensors_saveable(state)
        self._check_optimizers_own_modules(state)

    def _check_no_lazy_tensors(self, state: Mapping[str, Any]) -> None:
        """A lazy module (``nn.LazyLinear``) has no shapes before its first forward: its tensors
        cannot be saved, nor compared with a checkpoint's and loaded into."""
        modules, _, _ = self._classify(state)
        for key, module in modules.items():
            lazy = [
                name
                for name, tensor in itertools.chain(module.named_parameters(), module.named_buffers())
                if is_lazy(tensor)
            ]
            if lazy:
                more = f" and {len(lazy) - 1} more" if len(lazy) > 1 else ""
                raise ValueError(
                    f"state[{key!r}] holds uninitialized lazy parameters ({key}.{lazy[0]}{more}): they have no "
                    "shape yet to save or restore. Run one forward pass (a sample batch) before save() or restore(), "
                    "as before building the optimizer"
                )

    def _check_tensors_saveable(self, state: Mapping[str, Any]) -> None:
        """Every tensor of the modules' state (parameters, persistent buffers) and the optimizers'
        state is one DCP saves and restores bit for bit (``_unsaveable``): refused up front, naming
        it, instead of a save that fails deep in DCP, or one that restores other values or none."""
        modules, optims, _ = self._classify(state)
        for key, module in modules.items():
            for prefix, sub in module.named_modules():
                saved = itertools.chain(
                    sub._parameters.items(),
                    ((n, b) for n, b in sub._buffers.items() if n not in sub._non_persistent_buffers_set),
                )
                for name, tensor in itertools.chain(saved, _tensors_of_own_state(sub)):
                    why = _unsaveable(tensor) if tensor is not None else None
                    if why:
                        raise ValueError(
                            f"state[{key!r}] holds {key}.{prefix + '.' if prefix else ''}{name}, which {why}"
                        )
        for key, opt in optims.items():
            for i, param_state in enumerate(opt.state.values()):
                for name, value in _tensors_under("", param_state):
                    why = _unsaveable(value)
                    if why:
                        raise ValueError(
                            f"state[{key!r}] holds optimizer state {name!r} (of its parameter {i}), which {why}"
                        )

    def _check_optimizers_own_modules(self, state: Mapping[str, Any]) -> None:
        """Optimizer state is saved and restored under its parameters' names in the state's modules:
        a parameter outside them has no name, and its state (and its place in its group) could only
        be dropped or put on another parameter."""
        modules, optims, _ = self._classify(state)
        if not optims:
            return
        named = {id(p) for module in modules.values() for p in module.parameters()}
        for key, opt in optims.items():
            for i, group in enumerate(opt.param_groups):
                for j, param in enumerate(group["params"]):
                    if id(param) not in named:
                        raise ValueError(
                            f"state[{key!r}] optimizes a tensor (param_groups[{i}]['params'][{j}], shape "
                            f"{list(param.shape)}) that is not a parameter of the modules in the state "
                            f"({', '.join(sorted(modules)) or 'none'}): its state could not be saved or restored "
                            "by name. Put the module that owns it in the same state dict (fp32 master weights of "
                            "a lower-precision model: make them a module's parameters, master = "
                            "copy.deepcopy(model).float(), and put that module in the state too), or leave it out "
                            "of the optimizer"
                        )

    def _split_state(
        self, state: Mapping[str, Any], *, initialise: frozenset[str] = frozenset()
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """DCP state (modules + optimizers, resharded on load) and per-rank plain objects.

        ``initialise``: the optimizers (by state key) whose state is created first if they have
        none (``_optimizer_state``): the targets of a load; a save takes every optimizer as it is.
        """
        modules, optims, others = self._classify(state)
        dcp_state: dict[str, Any] = {}
        plain = None
        if modules:
            bag = _ModuleBag(modules)
            if _state_dict_as_torch_names_it(bag):
                plain = _plain_state(bag, optims, initialise=initialise)
        if plain is not None:
            model_state, optim_states = plain
            dcp_state.update(model_state)  # the modules' names first, as torch's path writes them
            dcp_state.update(optim_states)
        elif modules:
            if len(optims) == 1:
                ((key, opt),) = optims.items()
                model_state, optim_state = _model_and_optimizer_state(bag, opt, initialise=key in initialise)
                dcp_state.update(model_state)  # the modules' names first, as written before
                dcp_state[key] = optim_state
            else:
                dcp_state.update(_model_state(bag))
                for key, opt in optims.items():
                    dcp_state[key] = _optimizer_state(bag, opt, initialise=key in initialise)
        elif optims:
            raise ValueError("optimizers need their modules in the same state dict to be saved by name")
        objects = {key: obj.state_dict() for key, obj in others.items()}
        return dcp_state, objects

    @staticmethod
    def _check_extra_state_tensors(dcp_state: Mapping[str, Any]) -> None:
        """The tensors of the modules' extra state (``get_extra_state()``), neither parameters nor
        buffers, are refused as theirs are (``_unsaveable``), naming them, before anything is
        written: DCP saves and loads them the same way."""
        for fqn, value in dcp_state.items():
            if fqn.rsplit(".", 1)[-1] != _EXTRA_STATE_KEY_SUFFIX:
                continue
            for name, tensor in _tensors_under(fqn, value):
                why = _unsaveable(tensor)
                if why:
                    raise ValueError(f"state[{fqn.split('.', 1)[0]!r}] holds {name}, which {why}")

    @staticmethod
    def _check_values_loadable(dcp_state: Mapping[str, Any]) -> None:
        """The values of the modules' and optimizers' state that are not tensors (a module's extra
        state, optimizer hyperparameters) go through DCP pickled, and a restore loads them with
        ``weights_only``: one it would refuse makes every checkpoint holding it unrestorable, so it
        is refused here, naming it, before anything is written. It runs in every save's blocking
        part, so it walks the state itself (DCP's ``flatten_state_dict`` cost about 2 µs a tensor)."""
        for fqn, value in _unplain_values("", dcp_state):
            kind = type(value)
            if kind.__module__.startswith("torch.distributed."):
                continue
            record = io.BytesIO()
            try:
                torch.save(value, record)
                record.seek(0)
                torch.load(record, weights_only=True)
            except pickle.UnpicklingError as e:
                reason = rank_state.refusal_reason(e).rstrip(".")
                raise ValueError(
                    f"{fqn} is a {kind.__module__}.{kind.__qualname__}, which a restore (it loads these values with "
                    f"weights_only) would refuse ({reason}): no checkpoint holding it could be restored. Hand out "
                    "tensors and plain Python values instead (get_extra_state(): torch.tensor(x), float(x), dicts "
                    "and lists of them), or allow the class with torch.serialization.add_safe_globals([...]) before "
                    "save() and restore()"
                ) from None

    def _from_rank0(self, state: Mapping[str, Any], dcp_state: Mapping[str, Any]) -> frozenset[str]:
        """The names in ``dcp_state`` to save from rank 0 (``agent._dcp_plan.RankZeroSavePlanner``),
        unchecked: the modules' state that nothing keeps identical across ranks. That is buffers and
        extra state (each DDP rank's BatchNorm statistics follow its own batch until DDP's next
        forward overwrites them with rank 0's), and the plain parameters of a state module that no
        optimizer in the state trains and that holds no ``DistributedDataParallel``: an EMA of the
        model or a teacher, kept beside it. timm's recipe copies the EMA before DDP broadcasts rank
        0's weights, after a seed per rank, so each rank's EMA is its own and never becomes
        bit-identical to the others'. The parameters of the other modules, frozen ones included
        (DDP broadcast them), are compared across ranks and their writes spread over the ranks."""
        from torch.distributed.checkpoint.state_dict import _CHECKPOINT_PREFIX, _get_fqns
        from torch.distributed.tensor import DTensor
        from torch.nn.parallel import DistributedDataParallel

        modules, optims, _ = self._classify(state)
        if not modules:
            return frozenset()
        if self.config.replicas == "rank0":
            return frozenset(dcp_state)  # every copy that is not a shard: rank 0's, unchecked
        trained = {id(p) for opt in optims.values() for group in opt.param_groups for p in group["params"]}
        kept = {
            key
            for key, module in modules.items()
            if any(isinstance(m, DistributedDataParallel) for m in module.modules())
            or any(id(p) in trained for p in module.parameters())
        }
        bag = _ModuleBag(modules)
        names = [
            name
            for name, p in bag.named_parameters(remove_duplicate=False)
            if name.split(".", 1)[0] in kept or isinstance(p, DTensor)  # DTensors: saved shard by shard
        ]
        if _names_are_fqns(bag):  # torch's walk down the modules per name would find each name itself
            params = {name.replace(_CHECKPOINT_PREFIX, "") for name in names}
        else:
            params = {fqn for name in names for fqn in _get_fqns(bag, name)}
        return frozenset(k for k in dcp_state if k not in optims and k not in params)

    def _check_rank_file(self, path: str, size: int) -> None:
        """(every rank, in the save's background thread, every save) The rank file as written
        loads back the way restore loads it (``weights_only``); raises ``SaveFailedError`` naming
        the problem. Its bytes come from the page cache: this costs no disk read, and its tensors
        are mapped, not copied (a state_dict() holding gigabytes is not held a second time)."""
        held = os.path.getsize(path)
        if held != size:
            raise SaveFailedError(f"{path} holds {held} bytes after {size} were written")
        try:
            try:
                rank_state.decode(path, mmap=True)
            except rank_state.RankStateError:  # a filesystem that cannot map files (some FUSE ones)
                rank_state.decode(path)
        except rank_state.RefusedPickleError as e:
            raise SaveFailedError(_refused_in_words(path, e)) from None
        except Exception as e:
            raise SaveFailedError(
                "the per-rank state cannot be restored: a state_dict() in it holds something that "
                f"weights_only loading refuses: {str(e).rstrip('.')}. Convert it to tensors and plain Python values"
            ) from None


def _refused_in_words(path: str, e: rank_state.RefusedPickleError) -> str:
    """Why the rank file at ``path`` would not load, naming where the values are that the load
    refuses (``state['sampler'].state_dict()['order'] is a numpy.ndarray``): looked for only now,
    as the decode that refused them cannot say (a walk of every save's objects would cost each one)."""
    reason = (e.reason or str(e)).rstrip(".")
    try:
        found = rank_state.refused_values(path)
    except Exception:  # then the message without the places (TORCH_FORCE_WEIGHTS_ONLY_LOAD set)
        found = []
    fix = (
        "Hand back tensors and plain Python values from state_dict() instead (a NumPy array: "
        "torch.from_numpy(a); a NumPy scalar: int(x) or float(x)), or allow the class with "
        "torch.serialization.add_safe_globals([...]) before save() and restore()"
    )
    if not found:
        return (
            "the per-rank state cannot be restored: a state_dict() in it holds something that weights_only "
            f"loading refuses ({reason}). {fix}"
        )
    places = [
        f"state[{where[0]!r}].state_dict(){''.join(f'[{k!r}]' for k in where[1:])} is {what}"
        if where
        else f"a state_dict() holds {what}"
        for where, what in found
    ]
    more = f" (and {', '.join(places[1:])})" if len(places) > 1 else ""
    return (
        f"the per-rank state cannot be restored: {places[0]}{more}, which weights_only loading (as restore "
        f"loads it) refuses ({reason}). {fix}"
    )
