"""The restore walk: newest committed checkpoint first, skipping only those proven bad; each file
verified as it is read, the state changed only once every rank has read its part."""

from __future__ import annotations

import copy
import errno
import logging
import os
import shutil
import time
from collections.abc import Mapping
from dataclasses import dataclass
from inspect import unwrap
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

from agent import _fresh_start, rank_state
from agent._layout import misplaced_uri_problem
from agent.catalog import CheckpointRef, CheckpointStatus, find_checkpoints, inspect, latest_valid
from agent.checkpoint._core import size_text
from agent.checkpoint._save import _wait_for_saves_elsewhere
from agent.checkpoint._state import _model_state, _ModuleBag
from agent.checkpoint._vote import _Voting
from agent.checkpoint.errors import (
    CheckpointUriError,
    MissingStateKeysError,
    RestoreRefusedError,
    StorageRefusedError,
)
from agent.control_channel import ENV_START_FRESH
from agent.crc32c import crc32c_bytes, to_hex
from agent.dcp_safe import (
    NewerTorchError,
    SafeEmptyLoadPlanner,
    SafeLoadPlanner,
    UnsafeCheckpointError,
    VerifiedReader,
    check_metadata_fits,
    dcp_load,
    load_dcp_metadata,
    manifest_disagreements,
)
from agent.loader import ResumableLoader
from agent.manifest import DCP_METADATA_NAME, MANIFEST_NAME, Manifest, ManifestError
from agent.ownership import Lineage, describe_job
from agent.restore_cache import RESTORE_FOLDER, fetch_verified
from agent.storage import CorruptObjectError, NotFoundError, PermanentStorageError, StorageError
from agent.version import spotjob_version

log = logging.getLogger("agent.checkpoint")  # one logger for the package, as before it was split


class _Failure:
    """How one attempt to load a checkpoint failed, worst first when ranks disagree."""

    REFUSED = "refused"  # the store refuses for good (permission denied): retrying cannot help
    STAGING = "staging"  # this node's staging folder (the restore cache) refuses: full, read-only, denied
    UNAVAILABLE = "unavailable"  # storage failed, or something that proves nothing about the checkpoint
    INCOMPATIBLE = "incompatible"  # the checkpoint is fine; this script's state cannot take it
    GONE = "gone"  # deleted while read (another process's retention): walk again from the newest
    BAD = "bad"  # proven bad: skip it for an older one
    SEVERITY = (REFUSED, STAGING, UNAVAILABLE, INCOMPATIBLE, GONE, BAD)


_LOCAL_REFUSALS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM})
"""How a local disk refuses for good: full or over quota, read-only, not this user's to write."""


def _staging_refusal(e: OSError, staging: str) -> str:
    """Why the restore cache in the staging folder ``staging`` could not be written, where, and what
    to do (in the words a save's ``_writing_failure`` uses for the same folder)."""
    where = f"{e.strerror or e} ({e.filename or staging})"
    elsewhere = "Checkpointer(staging_dir=...), SPOTJOB_STAGING_DIR or spotjob-agent --staging-dir"
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return (
            f"{where}: the disk of the staging folder {staging} is full or over its quota; free space "
            f"there, or stage on another disk ({elsewhere})"
        )
    why = "is on a read-only filesystem" if e.errno == errno.EROFS else "is not writable by this user"
    return f"{where}: the staging folder {staging} {why}; stage in a folder this process can write ({elsewhere})"


NEWER_SPOTJOB = "written by a newer spotjob"
NEWER_TORCH = "written by a newer torch"
OBJECT_REFUSED = "refused the state it saved"

_RELISTS = 3
"""How often a restore lists the checkpoints again after one was deleted while it was read (the job
saving to the URI saves on, and its retention removes old ones): the newest is then newer than the
one that went. Past that, a checkpoint deleted under the restore is passed over like a bad one."""
_PASSED_OVER_CHARS = 900
"""The most of ``RankStatus.restore_passed_over`` written: it goes into an Event and the job's status."""


# What proves a checkpoint bad (restore may then fall back to an older one); any other storage
# error proves nothing about it and stops the restore instead.
_PROVEN_BAD = (
    CorruptObjectError,
    NotFoundError,
    ManifestError,
    UnsafeCheckpointError,
    rank_state.RefusedPickleError,
    rank_state.RankStateError,
)


_NAMED_PER_KIND = 3
"""How many tensors of each kind of difference (reshaped, only in the model, only in the checkpoint)
a refused restore names."""


@dataclass
class _DirectOptimState:
    """What the fast path hands ``Optimizer.load_state_dict``: the checkpoint's optimizer state,
    already matched to this optimizer's parameters and groups by name (``_optimizer_state_by_name``)."""

    state: dict[str, Any]
    order: list[int]
    """For each of this optimizer's groups, the index of the saved group it took (``[1, 0]``: built
    in the other order); what its schedulers' per-group lists are put in order by."""


@dataclass
class _DcpPlan:
    """What ``_plan_dcp`` read, before anything live changed, for ``_load_dcp`` to load."""

    dcp_state: dict[str, Any] | None
    """Plain modules: their state, which DCP loads in place; None for the generic (sharded) path."""
    direct: dict[str, _DirectOptimState]
    """Plain modules: each optimizer's state from the checkpoint, matched to it by name."""
    stepped: frozenset[str]
    """Sharded: the optimizers the checkpoint holds state of (initialised before DCP loads into them)."""
    reordered: dict[int, list[int]]
    """id(optimizer): its groups' order, for each optimizer built with its groups in another order
    than saved; what its schedulers' per-group lists are put in order by (``_in_group_order``)."""
    through_dcp: bool = True
    """False when nothing was saved through DCP (modules without state, on every rank): nothing to load."""


_PER_GROUP = ("base_lrs", "_last_lr", "lr_lambdas", "min_lrs", "max_lrs")
"""The entries of torch's LR schedulers' state that hold one item per parameter group, in the
optimizer's group order (LambdaLR's and MultiplicativeLR's lr_lambdas, ReduceLROnPlateau's min_lrs,
CyclicLR's max_lrs). SequentialLR and ChainedScheduler keep their schedulers' states in ``_schedulers``."""


def _in_group_order(state: Any, order: list[int]) -> Any:
    """An LR scheduler's saved ``state`` with its per-group lists put in this optimizer's group
    order (``order[i]``: the saved group the optimizer's group ``i`` took). Loaded by position, a
    LambdaLR's base_lrs gave each group the other's learning rate at its next step, when the
    optimizer's groups were built in another order than saved (which the optimizer itself takes)."""
    if not isinstance(state, dict):
        return state
    out = dict(state)
    for key in _PER_GROUP:
        value = out.get(key)
        if isinstance(value, list) and len(value) == len(order):
            out[key] = [value[j] for j in order]
    if isinstance(out.get("_schedulers"), list):
        out["_schedulers"] = [_in_group_order(sub, order) for sub in out["_schedulers"]]
    return out


def _plain_modules(bag: nn.Module) -> bool:
    """True when no parameter is sharded (no DTensor, no FSDP): names map 1:1 to parameters."""
    from torch.distributed.tensor import DTensor

    if any(isinstance(p, DTensor) for p in bag.parameters()):
        return False
    return not any(type(m).__name__ in ("FullyShardedDataParallel", "FSDPModule") for m in bag.modules())


def _optimizer_state_by_name(bag: nn.Module, opt: torch.optim.Optimizer, saved: dict[str, Any]) -> _DirectOptimState:
    """The state dict for ``opt.load_state_dict``, built from ``saved`` (keyed by parameter name, as
    ``get_optimizer_state_dict`` writes it) — what ``set_optimizer_state_dict`` loads for plain
    modules, minus its initialising step. Checked before anything live changes.

    ``Optimizer.load_state_dict`` pairs groups, and parameters within them, by position. So every
    group here lists its parameters in this optimizer's order, with the hyperparameters (lr,
    weight_decay, ...) of the saved group that holds the same names: groups built in another order
    load as DCP loads them. An optimizer that groups its parameters otherwise than the saved one (a
    parameter moved to another group, a group added or removed) has no such match — the saved
    per-group hyperparameters could only land on other parameters — and is refused
    (``RestoreRefusedError``); a saved name the model lacks raises ``MissingStateKeysError``.
    """
    from torch.distributed.checkpoint.state_dict import _get_fqns

    name_of: dict[int, str] = {}
    for name, param in bag.named_parameters():
        for fqn in _get_fqns(bag, name):
            name_of[id(param)] = fqn
    current = [[name_of[id(p)] for p in g["params"]] for g in opt.param_groups]  # _check_state: all named
    saved_groups: list[dict[str, Any]] = saved["param_groups"]
    known = set(name_of.values())
    saved_group_of: dict[str, int] = {}
    for j, group in enumerate(saved_groups):
        for fqn in group["params"]:
            if fqn not in known:
                raise MissingStateKeysError(
                    f"the checkpoint's optimizer state names parameter {fqn!r}, which the model does not have"
                )
            saved_group_of[fqn] = j

    def refuse(problem: str) -> RestoreRefusedError:
        def listing(groups: list[list[str]]) -> str:
            def names(g: list[str]) -> str:
                more = f" and {len(g) - 3} more" if len(g) > 3 else ""
                return (", ".join(g[:3]) + more) or "(empty)"

            return "; ".join(f"[{i}] {names(g)}" for i, g in enumerate(groups))

        return RestoreRefusedError(
            f"the optimizer groups its parameters otherwise than the checkpoint: {problem}. The checkpoint's "
            f"param_groups: {listing([list(g['params']) for g in saved_groups])}; this optimizer's: "
            f"{listing(current)}. Restoring would put one group's lr and weight_decay on another's parameters: "
            "build the optimizer with the parameter groups it was saved with (their order may differ)"
        )

    if len(current) != len(saved_groups):
        raise refuse(
            f"it has {len(current)} parameter group(s), the checkpoint {len(saved_groups)} (a group added with "
            "add_param_group() during training belongs in the optimizer from the start, its parameters "
            "requires_grad=False, or lr=0, until the step that turned them on: a script cannot know before "
            "restore() which side of that step the checkpoint is)"
        )
    matched: list[int] = []
    for i, names in enumerate(current):
        if names:
            if names[0] not in saved_group_of:
                raise refuse(f"parameter {names[0]!r} is in no saved parameter group")
            j = saved_group_of[names[0]]
        else:  # DCP's rule: at most one group without parameters, matched to the saved empty one
            empty = [j for j, g in enumerate(saved_groups) if not g["params"]]
            if len(empty) != 1 or sum(not g for g in current) != 1:
                raise refuse("groups without parameters cannot be told apart by name")
            j = empty[0]
        if set(names) != set(saved_groups[j]["params"]) or len(names) != len(saved_groups[j]["params"]):
            raise refuse(f"parameter group {i} does not hold the same parameters as the saved group {j}")
        if j in matched:
            raise refuse(f"saved parameter group {j} matches more than one of this optimizer's groups")
        matched.append(j)
    kind = _another_kind_of_optimizer(opt, saved_groups, matched) or _state_another_step_lacks(
        opt, saved_groups, matched, current, saved.get("state", {})
    )
    if kind is not None:
        raise RestoreRefusedError(kind)

    index = {fqn: n for n, fqn in enumerate(fqn for names in current for fqn in names)}
    state = {index[fqn]: value for fqn, value in saved.get("state", {}).items()}
    groups = [
        {**{k: v for k, v in saved_groups[j].items() if k != "params"}, "params": [index[fqn] for fqn in names]}
        for names, j in zip(current, matched, strict=True)
    ]
    return _DirectOptimState({"state": state, "param_groups": groups}, matched)


_SET_BY_SCHEDULERS = frozenset({"initial_lr", "max_lr", "min_lr", "base_momentum", "max_momentum"})
"""Keys torch's LR schedulers add to an optimizer's groups: a scheduler built before the save and
not yet at the restore (or the other way round) is no change of optimizer."""


def _another_kind_of_optimizer(
    opt: torch.optim.Optimizer, saved_groups: list[dict[str, Any]], matched: list[int]
) -> str | None:
    """Why the saved groups were not saved from an optimizer of ``opt``'s kind, or None.

    Loaded into an SGD, an Adam's state replaced its groups' hyperparameters (its lr, too) and its
    moments, and the first ``step()`` failed inside torch (``KeyError: 'momentum'``), far from the
    cause. A kind is told by its groups' hyperparameters: each side holds some the other lacks (a
    torch release adds hyperparameters to an optimizer, and one with defaults, which only one side
    then lacks, is no other kind)."""
    for i, j in enumerate(matched):
        saved = set(saved_groups[j]) - {"params"} - _SET_BY_SCHEDULERS
        mine = set(opt.param_groups[i]) - {"params"} - _SET_BY_SCHEDULERS
        if saved - mine and mine - saved:
            return (
                f"the checkpoint's optimizer state was saved from another kind of optimizer than this "
                f"{type(opt).__name__}: its parameter groups hold {', '.join(sorted(saved - mine))}, which this "
                f"one's lack, and lack {', '.join(sorted(mine - saved))}. Restore into the optimizer it was saved "
                "with; to change optimizers, leave it out of the state handed to restore() (the model restores "
                "alone) and let the new one start fresh"
            )
    return None


_STATE_READ_BY_STEP: dict[str, frozenset[str]] = {
    "torch.optim.adam.Adam": frozenset({"step", "exp_avg", "exp_avg_sq"}),  # AdamW's step is Adam's
    "torch.optim.adamax.Adamax": frozenset({"step", "exp_avg", "exp_inf"}),
    "torch.optim.nadam.NAdam": frozenset({"step", "mu_product", "exp_avg", "exp_avg_sq"}),
    "torch.optim.radam.RAdam": frozenset({"step", "exp_avg", "exp_avg_sq"}),
    "torch.optim.adagrad.Adagrad": frozenset({"step", "sum"}),
    "torch.optim.adadelta.Adadelta": frozenset({"step", "square_avg", "acc_delta"}),
    "torch.optim.rmsprop.RMSprop": frozenset({"step", "square_avg"}),
    "torch.optim.asgd.ASGD": frozenset({"step", "eta", "mu", "ax"}),
    "torch.optim.rprop.Rprop": frozenset({"step", "prev", "step_size"}),
    "torch.optim.sparse_adam.SparseAdam": frozenset({"step", "exp_avg", "exp_avg_sq"}),
}
"""The per-parameter state each of torch's optimizers reads in ``step()`` once a parameter has any
(SGD reads none it cannot do without), before the keys its group's options add
(``_state_read_by_step``). Checked against the torch in use by the tests: each is what a first
step writes."""


def _state_read_by_step(opt: torch.optim.Optimizer, group: Mapping[str, Any]) -> frozenset[str] | None:
    """The per-parameter state ``opt``'s ``step()`` reads for a parameter of ``group`` (the saved
    group, whose options ``load_state_dict`` puts in place), or None for a step that is not one of
    torch's own (a subclass that only adds to ``__init__`` keeps its base's step)."""
    # torch wraps a class's step() in a profiling hook of the class's own (functools.wraps) the
    # first time one is built, so the function, unwrapped, tells whose step it is; not the class
    # that holds it, which is a subclass's or not depending on which class was built first.
    step = unwrap(type(opt).step)
    owner = f"{getattr(step, '__module__', '')}.{getattr(step, '__qualname__', '').rpartition('.')[0]}"
    keys = _STATE_READ_BY_STEP.get(owner)
    if keys is None:
        return None
    if owner == "torch.optim.adam.Adam" and group.get("amsgrad"):
        keys |= {"max_exp_avg_sq"}
    if owner == "torch.optim.rmsprop.RMSprop":
        keys |= {"momentum_buffer"} if group.get("momentum") else set()
        keys |= {"grad_avg"} if group.get("centered") else set()
    return keys


def _state_another_step_lacks(
    opt: torch.optim.Optimizer,
    saved_groups: list[dict[str, Any]],
    matched: list[int],
    current: list[list[str]],
    saved_state: Mapping[str, Any],
) -> str | None:
    """Why ``opt``'s step cannot run on the saved per-parameter state, or None.

    Some kinds hold the same hyperparameters and differ only in their moments: an Adamax handed
    an Adam's state loaded it, and its first ``step()`` failed inside torch with ``KeyError:
    'exp_inf'`` (Adam, AdamW, RAdam and NAdam among each other and Adamax likewise). A parameter
    without saved state is initialised by the step, as torch does."""
    for i, j in enumerate(matched):
        needs = _state_read_by_step(opt, saved_groups[j])
        if needs is None:
            return None
        for fqn in current[i]:
            held = saved_state.get(fqn)
            if not isinstance(held, Mapping) or not held:
                continue
            lacking = needs - set(held)
            if lacking:
                return (
                    f"the checkpoint's optimizer state was saved from another kind of optimizer than this "
                    f"{type(opt).__name__}: the saved state of {fqn!r} holds {', '.join(sorted(held))} and lacks "
                    f"{', '.join(sorted(lacking))}, which this one's step() reads. Restore into the optimizer it "
                    "was saved with; to change optimizers, leave it out of the state handed to restore() (the "
                    "model restores alone) and let the new one start fresh"
                )
    return None


def _runs_code_on_load(bag: nn.Module) -> bool:
    """True when loading a state dict into the modules does more than copy tensors: a module has
    load_state_dict pre- or post-hooks, or a ``_load_from_state_dict`` of its own (one outside
    ``torch.nn``'s modules, whose overrides only read older key layouts) — e.g. one that rebuilds
    a cache (a transposed weight, a non-persistent buffer) from the loaded parameters."""
    return any(_module_runs_code_on_load(module) for module in bag.modules())


def _module_runs_code_on_load(module: nn.Module) -> bool:
    if module._load_state_dict_pre_hooks or module._load_state_dict_post_hooks:
        return True
    if type(module).set_extra_state is not nn.Module.set_extra_state:
        return True  # it may keep more than get_extra_state() hands out (a scale derived from an amax)
    load = type(module)._load_from_state_dict
    return load is not nn.Module._load_from_state_dict and not load.__module__.startswith("torch.nn.modules.")


def _resized_on_load(bag: nn.Module, fqns: set[str]) -> set[str]:
    """Which of ``fqns`` (names as saved) belong to one of torch.ao's observers and fake-quantizers
    (quantization-aware training), whose ``_load_from_state_dict`` takes the shape of what it
    loads: a per-channel scale or min_val is [1] or [0] until calibrated, [C] after, so a fresh
    model never has the shape of a trained one's. Those are loaded into tensors of the saved shape
    and handed to the module's ``load_state_dict``, as ``model.load_state_dict`` would. Any other
    shape difference is refused before anything is loaded."""
    from torch.distributed.checkpoint.state_dict import _get_fqns

    found: set[str] = set()
    for name in bag.state_dict(keep_vars=True):
        owner = bag.get_submodule(name.rpartition(".")[0])
        if type(owner).__module__.startswith("torch.ao.") and _module_runs_code_on_load(owner):
            found.update(fqn for fqn in _get_fqns(bag, name) if fqn in fqns)
    return found


def _loaded_in_place(bag: nn.Module, loaded: Mapping[str, Any]) -> bool:
    """True when DCP loaded every tensor of the modules' state straight into their own tensors
    (plain modules: ``get_model_state_dict`` hands out the parameters' storage), so applying
    ``loaded`` again would only copy each tensor onto itself — and no module runs code of its own
    when loaded (``_runs_code_on_load``), which ``load_state_dict`` must then call."""
    if _runs_code_on_load(bag):
        return False
    current = bag.state_dict()
    if set(current) != set(loaded):
        return False
    for key, tensor in current.items():
        value = loaded[key]
        if not isinstance(tensor, torch.Tensor) or not isinstance(value, torch.Tensor):
            return False
        if value.data_ptr() != tensor.data_ptr() or value.shape != tensor.shape or value.dtype != tensor.dtype:
            return False
    return True


def _bad_key(status: CheckpointStatus) -> tuple[str, str]:
    """How ``_Restoring._proven_bad`` names the checkpoint ``status`` (one with a manifest)."""
    assert status.manifest is not None
    return status.ref.folder, status.manifest.created_at.isoformat()


def _by_job(folders: Mapping[str, str | None], most: int = 3) -> str:
    """``job 'b' (step-000000050), job 'a' (step-000000040, step-000000020)``: the folders (newest
    first, as walked) grouped by the job that wrote them, at most ``most`` named per job."""
    jobs: dict[str | None, list[str]] = {}
    for folder, job in folders.items():
        jobs.setdefault(job, []).append(folder)
    parts = []
    for job, names in jobs.items():
        more = f" and {len(names) - most} more" if len(names) > most else ""
        parts.append(f"{describe_job(job)} ({', '.join(names[:most])}{more})")
    return ", ".join(parts)


_NOT_KEPT = object()
"""In place of the state of a per-rank object whose ``state_dict()`` raised before it was loaded."""


def _state_before(obj: Any) -> Any:
    """A per-rank object's ``state_dict()``, copied where it can be (its lists and tensors may be the
    object's own, changed in place by its ``load_state_dict()``): what ``_put_back`` hands back."""
    state = obj.state_dict()
    try:
        return copy.deepcopy(state)
    except Exception:  # an entry that cannot be copied (a lock, a file): the state_dict() as it is
        return state


def _is_shape_or_key_mismatch(e: BaseException) -> bool:
    """DCP's and load_state_dict's words for a state that does not fit the checkpoint."""
    text = str(e).lower()
    return any(w in text for w in ("size mismatch", "missing key", "unexpected key", "shape mismatch"))


class _Restoring(_Voting):
    """``restore()`` and how one checkpoint is judged, loaded and applied on every rank."""

    _read_only: bool
    _left_out_said: set[tuple[str, ...]]
    """(rank 0, read-only) The sets of state keys a restore left out that were logged already."""
    _reading_as: str | None
    """(read-only, given ``job=``) The job whose checkpoints it reads (``Lineage.reading_as``)."""
    _proven_bad: set[tuple[str, str]]
    """The checkpoints (folder, the manifest's ``created_at``) a restore of this Checkpointer found
    bad only once it read them (a CRC32C mismatch): ``newest_step()`` passes over them, as restore
    does. The time tells a folder committed again under the same name from the one found bad."""

    def wait(self) -> None:
        """Block until the save in flight (if any) is committed; raise if it failed (``_Saving``)."""
        raise NotImplementedError

    def newest_step(self) -> int:
        """The step of the newest valid checkpoint of this job under the URI (0 when there is none):
        the one ``restore()`` would load now, judged as it judges, without loading anything (rank 0
        lists the folders and reads manifests, newest first, until one is valid; an uncommitted
        save in progress is never it). It reads no shard, so a checkpoint whose bytes are corrupt
        is named until a ``restore()`` of this Checkpointer proves it so; from then on it is passed
        over, as restore passes over it. For a reader polling beside a training job: restore only
        when this moved past the step it last restored. A newer spotjob's checkpoint (its manifest,
        or a record judging it, in a format this one does not read) above every valid one is named
        too, since ``restore()`` stops there (``RestoreRefusedError``, saying to upgrade) rather
        than load an older one. A read-only one given a URI that is no job's (a checkpoint's own
        folder, or the folder above the job's) raises ``CheckpointUriError``, as ``restore()`` does.
        Collective, like every call."""
        self._check_open("newest_step()")

        def newest() -> int | str:
            newer: list[int] = []  # the newest newer spotjob's checkpoint the walk passed, if any

            def skipped(s: CheckpointStatus) -> None:  # restore() says what it skips
                if s.newer_format and not newer:
                    newer.append(s.ref.step)

            reading_as = self._reading_as
            status = latest_valid(self.storage, on_skip=skipped, reading_as=reading_as)
            while status is not None and status.manifest is not None and _bad_key(status) in self._proven_bad:
                status = latest_valid(self.storage, before=status.ref, on_skip=skipped, reading_as=reading_as)
            if newer:
                return newer[0]
            if status is None and self._read_only and not find_checkpoints(self.storage):
                # As restore() refuses it: an eval polling the wrong folder waited for ever on 0.
                problem = misplaced_uri_problem(self.storage)
                if problem is not None:
                    return problem
            return status.manifest.step if status is not None and status.manifest is not None else 0

        found: int | str = self._on_rank0("listing the checkpoints", newest)
        if isinstance(found, str):
            raise CheckpointUriError(found)
        return found

    def restore(self, state: Mapping[str, Any]) -> int:
        """Load the newest valid checkpoint into ``state`` in place; return its step (0 if none).

        Walks this job's committed checkpoints newest to oldest. Skips (and logs) those proven bad
        — a CRC32C or size mismatch, a missing file, a manifest or metadata that does not parse or
        is unsafe — and those another job or a superseded attempt wrote, or a fresh start retired.
        Never falls back past anything else:

        - ``StorageUnavailableError`` when the store keeps failing (after its retries): an older
          checkpoint would silently re-train committed steps;
        - ``RestoreRefusedError`` when the newest checkpoint does not fit ``state`` (changed
          shapes), or when committed checkpoints exist and none loads — unless ``start_fresh``;
        - ``MissingStateKeysError`` when the checkpoint lacks keys of ``state``.

        Nothing is deleted on any of these paths.

        A save still in flight is waited for first (its failure raised, as ``wait()`` raises it):
        otherwise the restore would load an older checkpoint than the one just saved, which
        then commits beside the restored run.
        """
        try:
            return self._restore(state)
        finally:
            if self._pinner is not None:
                self._pinner.release()  # the read is over, whatever its outcome

    def _restore(self, state: Mapping[str, Any]) -> int:
        self._check_open("restore()")
        self._check_state(state)
        self._restore_called = True
        self.wait()
        _wait_for_saves_elsewhere(self.storage.uri)
        started = time.monotonic()
        self._drain_votes()
        # The run may go back below the last retention pass (a fresh start begins at step 0): the
        # next pass looks at every folder again, or the new run's leftovers there would stay.
        self._swept_through = None
        url = self.storage.url
        refs: list[CheckpointRef] = self._on_rank0("listing the checkpoints", lambda: find_checkpoints(self.storage))
        retired: set[str] = (
            self._on_rank0("reading the fresh-start records", lambda: _fresh_start.retired_folders(self.storage))
            if refs
            else set()
        )
        lineage: Lineage | None = None
        # Rank 0 keeps the manifest it parsed and checked in judge(): parsing it again from the JSON
        # sent to the other ranks gives the same Manifest (to_json round-trips), at the cost of a
        # second parse of a big one (an entry per tensor: a tenth of a restore of tiny tensors).
        judged: dict[CheckpointRef, Manifest] = {}
        metadata_read: dict[CheckpointRef, Metadata] = {}  # (rank 0) .metadata judged with its manifest
        tried: list[tuple[CheckpointRef, str]] = []
        partially_loaded = False
        remedy = "Restore with the model they were saved with"
        relists = 0
        # (rank 0) Committed folders this walk passed over as another job's (foreign or fenced): a
        # listing that holds only those holds nothing to walk again for.
        passed: set[str] = set()
        # (rank 0) Of those, the ones another job wrote (foreign), with that job: said when nothing
        # of this job's is there, rather than a bare "no committed checkpoint of this job".
        others: dict[str, str | None] = {}
        gone = 0  # how many of ``tried`` were deleted while read
        walk = list(refs)
        while True:
            if not walk:
                # No committed checkpoint seen, yet folders were listed: between the listing and
                # the look at each, the job saving to the URI can commit the newest (seen while in
                # progress) and retention delete the one before it (seen once gone). If the
                # new listing holds a committed one now, walk it: never start from step 0 over them.
                if tried or not refs or relists >= _RELISTS:
                    break
                fresh, committed = self._on_rank0("listing the checkpoints", lambda: self._committed_listing(passed))
                if not committed:
                    break
                relists += 1
                refs = fresh
                retired = self._on_rank0(
                    "reading the fresh-start records", lambda: _fresh_start.retired_folders(self.storage)
                )
                lineage = None
                walk = list(refs)
                continue
            ref = walk.pop(0)
            if ref.folder in retired:
                if self.rank == 0:
                    log.info("restore: skipping %s: retired by a fresh start", url(ref.folder))
                continue

            def judge(ref: CheckpointRef = ref) -> tuple[str | None, str, bool, bool, tuple[str, str] | None]:
                """(rank 0) (the manifest if usable, why not, whether it is this job's own, whether
                a newer spotjob wrote it, its ``_bad_key`` where the look proved it damaged)."""
                nonlocal lineage
                if self._pinner is not None:
                    # Before the look: a folder still committed once pinned stays while it is read
                    # (unless a retention pass that listed the pins before this one deletes it).
                    self._pinner.pin(ref.folder)
                lineage = lineage or Lineage.load(self.storage, reading_as=self._reading_as)
                status = inspect(self.storage, ref, lineage=lineage)
                if status.valid and status.manifest is not None:
                    damaged, metadata = self._manifest_damage(ref, status.manifest)
                    if damaged is not None:
                        return None, damaged, True, False, _bad_key(status)
                    if metadata is not None:
                        metadata_read[ref] = metadata
                    judged[ref] = status.manifest
                    return status.manifest.to_json().decode(), "", True, False, None
                ours = status.committed and not (status.foreign or status.fenced)
                if status.committed and (status.foreign or status.fenced):
                    passed.add(ref.folder)
                    if status.foreign and status.manifest is not None:
                        others[ref.folder] = status.manifest.job
                return None, status.reason, ours, status.newer_format, None

            manifest_json, reason, ours, newer, bad = self._on_rank0(f"checking {url(ref.folder)}", judge)
            if bad is not None:
                # newest_step() passes over it from now on, as over a CRC32C mismatch found reading.
                self._proven_bad.add(bad)
            if newer:
                # Not proven bad: only this spotjob cannot read it. An older checkpoint would be
                # going back in time past a newer one that an upgraded spotjob restores.
                if self.rank == 0:
                    log.error("restore: stopping at %s: %s", url(ref.folder), reason)
                tried.append((ref, reason))
                remedy = "Upgrade spotjob where the job runs to the version that wrote it"
                break
            if manifest_json is None:
                if self.rank == 0:
                    log.warning("restore: skipping %s: %s", url(ref.folder), reason)
                if ours:
                    tried.append((ref, reason))
                continue
            manifest = judged.pop(ref, None) or Manifest.parse(manifest_json.encode())
            # Agreed: a key that only some ranks' state holds would raise on those ranks alone and
            # leave the others waiting in the restore's next collective for ever.
            missing_on = self._all_gather(sorted(set(state) - set(manifest.state_keys)), self._ctl_pg)
            missing = sorted(set().union(*missing_on))
            if missing and not self.config.start_fresh:
                ranks = [r for r, keys in enumerate(missing_on) if keys]
                which = "" if len(ranks) == len(missing_on) else f" (the state of rank(s) {ranks} holds them)"
                raise MissingStateKeysError(
                    f"checkpoint {url(ref.folder)} holds state keys {manifest.state_keys}; "
                    f"it lacks {missing}{which}. Restore with the keys it was saved with, start fresh on purpose "
                    f"(Checkpointer(..., start_fresh=True) or {ENV_START_FRESH}=1), or use a new URI.",
                    [(url(ref.folder), f"lacks state keys {missing}")],
                )
            read: list[dict[str, Any]] = []  # the modules' state, once read to compare: loaded into next
            mismatch = (
                (_Failure.INCOMPATIBLE, f"incompatible with the state: it lacks state keys {missing}")
                if missing
                else self._agree_on_failure(self._incompatibility(manifest, state, read))
            )
            if mismatch is not None:
                tried.append((ref, mismatch[1]))
                break  # an older checkpoint would be going back in time on a changed model
            failure, loaded = self._try_load(
                ref, manifest, state, read[0] if read else None, metadata_read.pop(ref, None)
            )
            partially_loaded = partially_loaded or loaded
            if failure is not None and failure[1].startswith(NEWER_SPOTJOB):
                remedy = "Upgrade spotjob where the job runs to the version that wrote it"
            elif failure is not None and failure[1].startswith(NEWER_TORCH):
                remedy = "Restore it under the torch that wrote it, or a newer one"
            elif failure is not None and OBJECT_REFUSED in failure[1]:
                remedy = (
                    "Restore with per-rank objects whose load_state_dict() takes what their state_dict() saved "
                    "(they were loaded before the model and optimizers, which this failure left untouched)"
                )
            if failure is None:
                self._restored(ref, manifest, time.monotonic() - started, tried)
                self._warn_left_out(manifest, state)
                return manifest.step
            kind, reason = failure
            if kind == _Failure.GONE:
                gone += 1
            if kind == _Failure.GONE and relists < _RELISTS:
                # Every rank agreed on it: every rank walks the new listing, from its newest. Kept
                # in ``tried``: a walk that then finds nothing refuses, never starts from step 0.
                tried.append((ref, reason))
                relists += 1
                refs = self._on_rank0("listing the checkpoints", lambda: find_checkpoints(self.storage))
                retired = self._on_rank0(
                    "reading the fresh-start records", lambda: _fresh_start.retired_folders(self.storage)
                )
                lineage = None
                walk = list(refs)
                continue
            mixed = "; the state was partly loaded from it on some rank: do not train on from it" if loaded else ""
            if kind == _Failure.STAGING:
                # This node's disk, not the store: never reported as an infrastructure error, since a
                # restart on this node meets the same full or read-only folder.
                raise StorageRefusedError(
                    f"cannot restore {url(ref.folder)}: the staging folder where this node caches what it "
                    f"downloads refuses: {reason}{mixed}. The store is not at fault and retrying cannot help: "
                    "fix the staging folder, then start the job again"
                )
            if kind in (_Failure.REFUSED, _Failure.UNAVAILABLE):
                raise self._storage_failure(
                    f"reading {url(ref.folder)}: {reason}{mixed}", permanent=kind == _Failure.REFUSED
                )
            tried.append((ref, reason))
            if kind == _Failure.INCOMPATIBLE:
                break  # the checkpoint is not at fault: an older one would be going back in time
            if kind == _Failure.BAD:
                self._proven_bad.add((ref.folder, manifest.created_at.isoformat()))
        if not tried and not refs and self._read_only:
            # A writer's URI was checked when its job claimed it; a reader's is checked here, before
            # it says "no checkpoint yet" of the wrong folder (an eval of an untrained model).
            problem = self._on_rank0("looking at the URI", lambda: misplaced_uri_problem(self.storage))
            if problem is not None:
                raise CheckpointUriError(problem)
        if not tried:
            if self.rank == 0:
                if others:
                    whose = describe_job(self._reading_as) if self._reading_as is not None else "this job"
                    log.warning(
                        "restore: no committed checkpoint of %s under %s, only other jobs' (passed over as foreign: "
                        "%s); starting from step 0",
                        whose,
                        self.storage.uri,
                        _by_job(others),
                    )
                else:
                    what = "no committed checkpoint of this job" if refs else "no checkpoint yet"
                    log.info("restore: %s under %s; starting from step 0", what, self.storage.uri)
            self._report_restored(0, [])
            return 0
        if gone == len(tried):
            raise self._outrun(tried, partially_loaded)
        return self._refuse_or_start_fresh(tried, partially_loaded, remedy)

    def _outrun(self, tried: list[tuple[CheckpointRef, str]], partially_loaded: bool) -> RestoreRefusedError:
        """Every checkpoint tried was deleted while it was read: nothing is wrong with them, the job
        saving to the URI commits (and its retention deletes) faster than this restore reads. Never
        a reason to start fresh: its newest checkpoint is there, and retiring it loses the run."""
        url = self.storage.url
        listing = "\n".join(f"  {url(ref.folder)}: {reason}" for ref, reason in tried)
        state = (
            "The state was partly loaded from one of them on some rank: re-create the model and optimizer before "
            "retrying."
            if partially_loaded
            else "Nothing was loaded: the state is unchanged."
        )
        return RestoreRefusedError(
            f"restore gave up: each of the {len(tried)} checkpoint(s) it picked under {self.storage.uri} was deleted "
            f"while it was read (by the retention of the job saving to that URI as it committed newer ones, or by "
            f"hand):\n{listing}\n{state} Nothing is wrong with the checkpoints, and none was deleted by this "
            "restore. Retry the restore; a reader beside a job that saves this often needs the job to keep more "
            "checkpoints (keep=2 or more: a checkpoint stays keep saves after it is the newest), or reads from a "
            "copy (spotjob ckpt export).",
            [(url(r.folder), why) for r, why in tried],
        )

    def _refuse_or_start_fresh(
        self, tried: list[tuple[CheckpointRef, str]], partially_loaded: bool, remedy: str
    ) -> int:
        """Committed checkpoints exist and none can be used: raise, or (``start_fresh``) retire them."""
        url = self.storage.url
        listing = "\n".join(f"  {url(ref.folder)}: {reason}" for ref, reason in tried)
        if partially_loaded:
            raise RestoreRefusedError(
                f"restore refused: a checkpoint failed after part of it was loaded into the state (the "
                f"checkpoints tried, and why each failed):\n{listing}\nThe state now mixes checkpoint and initial "
                "values; nothing was deleted. Fix the cause, or re-create the state handed to restore() (the model, "
                "the optimizers, the other objects) before training from step 0.",
                [(url(r.folder), why) for r, why in tried],
            )
        if not self.config.start_fresh:
            raise RestoreRefusedError(
                f"restore refused: {len(tried)} committed checkpoint(s) under {self.storage.uri} tried, none can be "
                f"loaded into this state; the first failure: {tried[0][1]}\n{listing}\n"
                f"Nothing was deleted and the state is unchanged. {remedy}; or "
                f"start from step 0 on purpose with Checkpointer(..., start_fresh=True) or {ENV_START_FRESH}=1 "
                "(spotjob-agent --start-fresh), which keeps these checkpoints, never restores them and never lets "
                "retention delete them; or use a new URI.",
                [(url(r.folder), why) for r, why in tried],
            )
        reasons = {ref: why for ref, why in tried}

        def retire_all() -> int:
            older = "not tried: older than a checkpoint the fresh start refused"
            doomed: list[tuple[CheckpointRef, str]] = []
            retired = _fresh_start.retired_folders(self.storage)
            lineage = Lineage.load(self.storage)
            for ref in find_checkpoints(self.storage):
                if ref.folder in retired:
                    continue
                if ref in reasons:
                    doomed.append((ref, reasons[ref]))
                    continue
                status = inspect(self.storage, ref, lineage=lineage)
                if status.committed and not (status.foreign or status.fenced):
                    doomed.append((ref, status.reason or older))
            _fresh_start.retire(self.storage, doomed, job=self.config.job, attempt=self.config.attempt)
            return len(doomed)

        count = self._on_rank0("retiring the refused checkpoints", retire_all)
        if self.rank == 0:
            log.warning(
                "restore: starting from step 0 on purpose (start_fresh): %d committed checkpoint(s) under %s are "
                "retired: kept, never restored, never counted or deleted by retention. The first failure: %s",
                count,
                self.storage.uri,
                tried[0][1],
            )
        self._last_step = 0
        self._report_restored(0, tried)
        return 0

    def _report_restored(self, step: int, tried: list[tuple[CheckpointRef, str]]) -> None:
        """(each node's first rank) Tell the agent, in ``status.json``, the step restored and why the
        newest committed checkpoint passed over was (its controller names the checkpoint the attempt
        resumes from before any rank reads its bytes, and warns by this when the ranks could not)."""
        self._status.restored_step = step
        self._status.restore_passed_over = (
            f"{self.storage.url(tried[0][0].folder)}: {tried[0][1]}"[:_PASSED_OVER_CHARS] if tried else None
        )
        self._report(force=True)

    def _restored(
        self, ref: CheckpointRef, manifest: Manifest, seconds: float, tried: list[tuple[CheckpointRef, str]]
    ) -> None:
        self.last_committed_step = manifest.step
        self.last_committed_uri = self.storage.url(ref.folder)
        self._restored_folders.add(ref.folder)  # its older copies of the step are this run's (retention)
        self._last_saved_step = manifest.step
        self._last_step = manifest.step
        self._status.last_committed_step = manifest.step
        self._status.last_committed_uri = self.last_committed_uri
        self._status.step = manifest.step
        self._report_restored(manifest.step, [(r, why) for r, why in tried if manifest.step < r.step])
        if self._node_reporter:  # once per node, as the flush's outcome: every rank restored the same
            log.info(
                "restored step %d from %s in %.2fs (%s in %d files; saved by %d ranks, restored on %d)",
                manifest.step,
                self.last_committed_uri,
                seconds,
                size_text(manifest.total_bytes),
                len(manifest.files),
                manifest.world_size,
                self.world_size,
            )
            if self.config.start_fresh:
                # Asked for "step 0" and resumed from step N without a word otherwise.
                log.info(
                    "start_fresh is set (%s) and step %d loads, so the run resumes from it: start_fresh "
                    "starts from step 0 only where a restore would refuse, so that leaving it set across "
                    "restarts keeps their progress. To start over from step 0, use a new URI",
                    self._start_fresh_by,
                    manifest.step,
                )

    def _warn_left_out(self, manifest: Manifest, state: Mapping[str, Any]) -> None:
        """(rank 0) Keys the checkpoint holds that ``state`` left out stay as they were built: a
        restore without its optimizer, scheduler or loader resumes on fresh ones. Allowed (loading
        a model alone is a use), but never silent."""
        left_out = [key for key in manifest.state_keys if key not in state]
        if left_out and self.rank == 0 and self._read_only:
            # A reader (an eval loop) restores the model alone on purpose, and again at every new
            # checkpoint: said once per set of keys, not as a warning at every restore.
            if tuple(left_out) not in self._left_out_said:
                self._left_out_said.add(tuple(left_out))
                log.info(
                    "restore: the checkpoints hold %s too, which this read-only Checkpointer's restore() leaves "
                    "out: not restored (said once)",
                    ", ".join(repr(k) for k in left_out),
                )
        elif left_out and self.rank == 0:
            log.warning(
                "restore: the checkpoint of step %d also holds %s, which the state handed to restore() leaves out: "
                "not restored, so they go on from how the script built them. Add them to the state to resume "
                "them too",
                manifest.step,
                ", ".join(repr(k) for k in left_out),
            )

    def _incompatibility(
        self, manifest: Manifest, state: Mapping[str, Any], read: list[dict[str, Any]]
    ) -> tuple[str, str] | None:
        """Why the checkpoint's tensors cannot go into the modules of ``state`` (changed shapes,
        tensors added or removed), from the manifest alone — before anything is read or loaded.
        The modules' state read to compare is appended to ``read``: the load goes into it, without
        reading it again (``get_model_state_dict`` walks every tensor)."""
        modules, _, _ = self._classify(state)
        if not manifest.tensors and manifest.file(DCP_METADATA_NAME) is not None:
            return None  # no tensor index to compare with: DCP's load checks what it reads
        current: dict[str, torch.Tensor] = {}
        unreadable: Exception | None = None
        model_state: dict[str, Any] = {}
        if modules:
            try:
                model_state = _model_state(_ModuleBag(modules))
                # Named as DCP saves them: the tensors in a module's extra state (a dict) have names of their own.
                flat, _ = flatten_state_dict(model_state)
                current = {k: v for k, v in flat.items() if isinstance(v, torch.Tensor)}
            except Exception as e:  # reported to every rank, never raised on one alone
                unreadable = e
        # Every rank takes part (the manifest is the same on all): a layout where each rank holds
        # other modules (pipeline stages) has each checkpoint tensor on some rank, not on every one.
        held_somewhere = self._held_on_some_rank(manifest, current)
        if unreadable is not None:
            return _Failure.INCOMPATIBLE, f"the model's state cannot be read on rank {self.rank}: {unreadable!r}"
        if not modules:
            return None
        read.append(model_state)
        reshaped = {
            fqn
            for fqn, tensor in current.items()
            if fqn in manifest.tensors and list(manifest.tensors[fqn].shape) != list(tensor.shape)
        }
        for fqn in _resized_on_load(_ModuleBag(modules), reshaped) if reshaped else ():
            saved = manifest.tensors[fqn]
            dtype = getattr(torch, saved.dtype, None)
            if isinstance(dtype, torch.dtype) and fqn in model_state:
                model_state[fqn] = current[fqn] = torch.empty(saved.shape, dtype=dtype, device=current[fqn].device)
        reshaped_list, added, removed = [], [], []
        for fqn, tensor in current.items():
            entry = manifest.tensors.get(fqn)
            if entry is None:
                added.append(f"{fqn}: the model has it, the checkpoint does not")
            elif list(entry.shape) != list(tensor.shape):
                reshaped_list.append(
                    f"{fqn}: the checkpoint holds shape {list(entry.shape)}, the model {list(tensor.shape)}"
                )
        prefixes = tuple(f"{key}." for key in modules)
        for fqn in manifest.tensors:
            if fqn.startswith(prefixes) and fqn not in held_somewhere:
                where = "the model does not" if self.world_size == 1 else "the model does not on any rank"
                removed.append(f"{fqn}: the checkpoint holds it, {where}")
        if not (reshaped_list or added or removed):
            self._warn_converted(manifest, current)
            return None
        # A few of each kind: a renamed layer shows up as tensors the model has beside the ones the
        # checkpoint holds, and naming only the first problem hid the names to rename from.
        named = [p for kind in (reshaped_list, added, removed) for p in kind[:_NAMED_PER_KIND]]
        left = len(reshaped_list) + len(added) + len(removed) - len(named)
        more = f" (and {left} more)" if left else ""
        return _Failure.INCOMPATIBLE, f"incompatible with the model: {'; '.join(named)}{more}"

    def _held_on_some_rank(self, manifest: Manifest, current: Mapping[str, torch.Tensor]) -> set[str]:
        """(collective) The checkpoint's tensor names that the modules of at least one rank hold.

        Where every rank holds the same modules (data parallel, FSDP, tensor parallel) that is
        ``current``'s names; where each rank holds its own submodules (pipeline stages), a tensor
        of another stage is held there, and restored there, by name."""
        names = sorted(manifest.tensors)
        held = torch.tensor([name in current for name in names], dtype=torch.uint8)
        if self._dist and names:
            dist.all_reduce(held, op=dist.ReduceOp.MAX, group=self._ctl_pg)
        return {name for name, flag in zip(names, held.tolist(), strict=True) if flag}

    def _warn_converted(self, manifest: Manifest, current: Mapping[str, torch.Tensor]) -> None:
        """(rank 0) Tensors the model holds in another dtype than the checkpoint: loaded, their values
        are converted as ``load_state_dict`` converts them (rounded to bf16, cut to integers, complex
        without the imaginary part). Allowed (a change of precision is a use), but never silent."""
        converted = [
            f"{fqn} ({manifest.tensors[fqn].dtype} into {str(tensor.dtype).removeprefix('torch.')})"
            for fqn, tensor in current.items()
            if fqn in manifest.tensors and manifest.tensors[fqn].dtype != str(tensor.dtype).removeprefix("torch.")
        ]
        if converted and self.rank == 0:
            more = f" and {len(converted) - 1} more" if len(converted) > 1 else ""
            log.warning(
                "restore: the checkpoint of step %d holds tensors in another dtype than the model: %s%s; their "
                "values are converted to the model's dtype. Build the model in the saved dtypes to resume exactly",
                manifest.step,
                converted[0],
                more,
            )

    def _manifest_damage(self, ref: CheckpointRef, manifest: Manifest) -> tuple[str | None, Metadata | None]:
        """(rank 0) Why ``manifest`` is damaged, proven against DCP's ``.metadata`` (checked against
        the manifest's CRC32C; ``manifest_disagreements``); None when they agree, or when the
        ``.metadata`` cannot tell (missing, unreadable, not matching its CRC, unsafe:
        ``check_metadata_fits``): the load's own checks find what is wrong with it then, as before.

        A flipped bit in the manifest's tensor index or state keys was taken at its word: the model
        refused as changed ("the checkpoint holds shape [22, 16]"), or a state key missing, and the
        restore stopped there, naming start_fresh, with an older valid checkpoint beside it.

        Also the ``.metadata`` read, when it agrees: rank 0's load takes it instead of reading (and
        unpickling: half a second for 16 000 tensors) it again. From an object store it is fetched
        into the node's restore cache, as the load fetches it: once per node, the other ranks' loads
        (and the agent's prefetch) finding it there."""
        entry = manifest.file(DCP_METADATA_NAME)
        if entry is None:
            return None, None
        cache = None
        try:
            local = self.storage.local_path(ref.folder)
            if local is None:
                cache = os.path.join(self._staging_root, RESTORE_FOLDER, ref.folder)
                path = fetch_verified(self.storage, ref.folder, entry, cache)
                with open(path, "rb") as f:
                    data = f.read()
            else:
                data = self.storage.get_bytes(ref.key(DCP_METADATA_NAME))
                if len(data) != entry.size or to_hex(crc32c_bytes(data)) != entry.crc32c:
                    return None, None
            metadata = load_dcp_metadata(data)
            check_metadata_fits(metadata, manifest)  # a crafted .metadata is the load's to call unsafe
        except Exception:  # the load meets it again, with its own words and retries
            return None, None
        problems = manifest_disagreements(manifest, metadata)
        if problems:
            if cache is not None:
                shutil.rmtree(cache, ignore_errors=True)  # no load of it follows to clean it up
            return f"damaged: {'; '.join(problems)}", None
        return None, metadata

    def _try_load(
        self,
        ref: CheckpointRef,
        manifest: Manifest,
        state: Mapping[str, Any],
        model_state: dict[str, Any] | None = None,
        metadata: Metadata | None = None,
    ) -> tuple[tuple[str, str] | None, bool]:
        """Load one checkpoint on every rank. Returns (the agreed failure or None, anything was loaded).
        ``model_state``: the modules' state as ``_incompatibility`` read it, if it did; ``metadata``:
        its ``.metadata`` as ``_manifest_damage`` read and checked it, if it did (rank 0)."""
        local_dir = self.storage.local_path(ref.folder)
        cache = None
        if local_dir is None:
            cache = os.path.join(self._staging_root, RESTORE_FOLDER, ref.folder)
            local_dir = cache
        reader = VerifiedReader(
            self.storage, ref.folder, manifest, local_dir, self.config.io_threads, metadata=metadata
        )
        try:
            return self._load_with(reader, cache, ref, manifest, state, model_state)
        finally:
            reader.close()

    def _load_with(
        self,
        reader: VerifiedReader,
        cache: str | None,
        ref: CheckpointRef,
        manifest: Manifest,
        state: Mapping[str, Any],
        model_state: dict[str, Any] | None,
    ) -> tuple[tuple[str, str] | None, bool]:
        """``_try_load`` with its reader made (closed by the caller)."""
        failure: tuple[str, str] | None = None
        rank_payload: dict[str, Any] | None = None
        # Phase 1: DCP's metadata and the per-rank state, verified but not yet applied. Reading
        # the metadata here (the reader caches it) turns a corrupt or crafted .metadata into one
        # clear reason instead of DCP's retries and tracebacks.
        try:
            reader.hold_all()
            if manifest.file(DCP_METADATA_NAME) is not None:
                reader.read_metadata()
            src = rank_state.source_rank(self.rank, manifest.world_size)
            path = reader.ensure_local(rank_state.rank_file_name(src))
            with reader.open_verified(path) as stream:  # held open since its check, on a filesystem
                rank_payload = rank_state.decode(stream)
        except Exception as e:
            failure = self._load_failure(ref, e)
        if failure is None and rank_payload is not None:
            failure = self._newer_rank_state(rank_payload) or self._objects_not_saved_as_objects(state, rank_payload)
        failure = self._agree_on_failure(failure)
        if failure is not None:
            self._cleanup_cache(cache)
            return failure, False
        # Phase 2: what the optimizers take, read into fresh tensors and matched to them by name,
        # then the per-rank objects (small), each handed its saved state with the state it had kept
        # to put back: an object whose load_state_dict() raises is found on every rank before any
        # module or optimizer changes, and the objects already loaded are put back.
        payload = rank_payload or {}
        taken: list[tuple[str, Any, Any]] = []  # (key, object, its state from before) to put back
        plan: _DcpPlan | None = None
        try:
            plan = self._plan_dcp(reader, state, model_state)
        except (Exception, CheckpointException) as e:  # DCP's own is a BaseException
            failure = self._load_failure(ref, e)
        if plan is not None:
            failure = self._load_objects(state, payload, manifest, plan.reordered, taken)
        failure = self._agree_on_failure(failure)
        if failure is not None:
            self._cleanup_cache(cache)
            return self._put_back(taken, failure, changed=False)
        assert plan is not None
        # Phase 3: modules and optimizers through DCP (each file verified before it is read).
        dcp_state: dict[str, Any] = {}
        try:
            dcp_state = self._load_dcp(reader, state, plan)
        except (Exception, CheckpointException) as e:
            failure = self._load_failure(ref, e)
        failure = self._agree_on_failure(failure)
        if failure is not None:
            self._cleanup_cache(cache)
            # Did any rank's live state change before the failure? Then none may carry on from it.
            return self._put_back(taken, failure, changed=reader.data_read_started)
        try:
            self._apply(state, dcp_state, payload, manifest)
        except Exception as e:
            cause = str(e) if isinstance(e, RestoreRefusedError) else repr(e)
            failure = (_Failure.INCOMPATIBLE, f"incompatible with this state on rank {self.rank}: {cause}")
        failure = self._agree_on_failure(failure)
        self._cleanup_cache(cache)
        if failure is not None:
            return self._put_back(taken, failure, changed=True)
        return None, False

    def _load_objects(
        self,
        state: Mapping[str, Any],
        payload: Mapping[str, Any],
        manifest: Manifest,
        reordered: Mapping[int, list[int]],
        taken: list[tuple[str, Any, Any]],
    ) -> tuple[str, str] | None:
        """Hand each per-rank object of ``state`` its saved state, before the modules and optimizers
        are loaded; each one handed it (the one that raised too: it may have changed before it
        raised) goes into ``taken`` with its ``state_dict()`` from before, for ``_put_back``.
        ``reordered``: id(optimizer): its groups' order, where built otherwise than saved.

        Every object's state is kept first, then every object is loaded, whatever one raised: each
        rank calls the same methods of the same objects (one of them may be collective). An object
        whose ``state_dict()`` cannot be had before it is loaded (one set up lazily) is loaded all
        the same, as before objects were kept; only if this restore fails later can it not be put
        back, which ``_put_back`` then says."""
        _, _, others = self._classify(state)
        objects = payload.get("objects", {})
        new_rank = self.rank >= manifest.world_size
        kept: dict[str, Any] = {}
        for key, obj in others.items():
            try:
                kept[key] = _state_before(obj)
            except Exception as e:
                log.debug("restore: state[%r].state_dict() raised before it was loaded", key, exc_info=e)
                kept[key] = _NOT_KEPT
        failure: tuple[str, str] | None = None
        for key, obj in others.items():
            order = reordered.get(id(getattr(obj, "optimizer", None)))
            saved = objects[key] if order is None else _in_group_order(objects[key], order)
            before = kept[key]
            if new_rank and isinstance(obj, ResumableLoader) and isinstance(saved, dict) and isinstance(before, dict):
                # Rank 0's place, this rank's own generator: taken with rank 0's, the loader's
                # workers drew the same seeds (the same augmentations) as rank 0's, every epoch on.
                saved = {**saved, "generator": before["generator"]}
            taken.append((key, obj, before))
            try:
                obj.load_state_dict(saved)
            except Exception as e:
                log.debug("restore: state[%r].load_state_dict() raised", key, exc_info=e)
                failure = failure or (
                    _Failure.INCOMPATIBLE,
                    f"incompatible with this state on rank {self.rank}: state[{key!r}].load_state_dict() "
                    f"({type(obj).__name__}) {OBJECT_REFUSED}: {e!r}",
                )
        return failure

    def _put_back(
        self, taken: list[tuple[str, Any, Any]], failure: tuple[str, str], *, changed: bool
    ) -> tuple[tuple[str, str], bool]:
        """(collective, after a load of a checkpoint failed) Hand the per-rank objects loaded from it
        their state from before, newest first. Returns the failure, with the first object on any
        rank that could not be put back (its load_state_dict() raised again) named in it, and
        whether the state changed on any rank: ``changed`` on one, or an object not put back."""
        problem: str | None = None
        for key, obj, before in reversed(taken):
            if before is _NOT_KEPT:
                problem = problem or (
                    f"state[{key!r}] on rank {self.rank} gave no state_dict() before the restore to hand back, "
                    "so it keeps the checkpoint's"
                )
                continue
            try:
                obj.load_state_dict(before)
            except Exception as e:
                log.warning("restore: state[%r] could not be put back as it was: %r", key, e)
                problem = problem or (
                    f"state[{key!r}] on rank {self.rank} raised again when handed back its state from before the "
                    f"restore ({e!r}), so it may hold part of the checkpoint's"
                )
        gathered = self._all_gather((changed, problem), self._ctl_pg)
        problems = [p for _, p in gathered if p is not None]
        kind, reason = failure
        if problems:
            reason = f"{reason}; {problems[0]}"
        return (kind, reason), any(c for c, _ in gathered) or bool(problems)

    def _newer_rank_state(self, payload: Mapping[str, Any]) -> tuple[str, str] | None:
        """A rank file holding what this spotjob would not restore: a newer spotjob wrote it, and
        restoring the rest would be a partial restore, said nowhere. Not proven bad: never skipped."""
        unknown = rank_state.unknown_entries(dict(payload))
        if not unknown:
            return None
        return _Failure.INCOMPATIBLE, (
            f"{NEWER_SPOTJOB}: the per-rank state read on rank {self.rank} holds {', '.join(unknown[:5])}, which "
            f"this spotjob ({spotjob_version()}) does not restore; nothing was loaded from it"
        )

    def _objects_not_saved_as_objects(
        self, state: Mapping[str, Any], payload: Mapping[str, Any]
    ) -> tuple[str, str] | None:
        """A per-rank object of ``state`` (a scheduler, a loader) under a key the checkpoint saved
        as a module or optimizer has nothing to load: said before anything is loaded."""
        _, _, others = self._classify(state)
        saved = payload.get("objects", {})
        wrong = [key for key in others if key not in saved]
        if not wrong:
            return None
        key = wrong[0]
        return _Failure.INCOMPATIBLE, (
            f"incompatible with the state: state[{key!r}] is a {type(others[key]).__name__}, an object restored "
            f"through its load_state_dict(), but the checkpoint saved {key!r} as a module or optimizer. Restore "
            "each key with the kind of value it was saved from"
        )

    def _plan_dcp(
        self, reader: VerifiedReader, state: Mapping[str, Any], model_state: dict[str, Any] | None = None
    ) -> _DcpPlan:
        """What ``_load_dcp`` loads the modules and optimizers from, read without changing them.

        For plain and DDP modules the optimizer state is rebuilt from the checkpoint's metadata
        and handed to the optimizer directly: DCP's generic path first initialises a fresh
        optimizer with a zero-gradient step, which costs as much as a training step over every
        parameter. Sharded (DTensor/FSDP) modules take the generic path, which reshards.
        """
        modules, optims, _ = self._classify(state)
        if not modules or reader.manifest.file(DCP_METADATA_NAME) is None:
            # Nothing was saved through DCP (modules without state, an nn.Identity), on any rank.
            return _DcpPlan(None, {}, frozenset(), {}, through_dcp=False)
        bag = _ModuleBag(modules)
        no_dist = not self._dist
        if not _plain_modules(bag):
            # An optimizer saved before its first step has no state in the checkpoint: its target
            # gets none either, so the load leaves it as it was saved.
            held = reader.read_metadata().state_dict_metadata
            stepped = frozenset(k for k in optims if any(fqn.startswith(f"{k}.state.") for fqn in held))
            return _DcpPlan(None, {}, stepped, {})
        dcp_state = dict(_model_state(bag) if model_state is None else model_state)
        saved: dict[str, Any] = {}
        direct: dict[str, _DirectOptimState] = {}
        if optims:
            # The optimizer state first, into fresh tensors built from the checkpoint's metadata (as
            # dcp_to_torch_save does): nothing live changes, and while its files are checked the
            # pages of those tensors and of the model's (loaded next) are mapped, in one overlap.
            reader.into_live = False
            reader.prefault = [t for t in dcp_state.values() if isinstance(t, torch.Tensor)]
            dcp_load(saved, reader, SafeEmptyLoadPlanner(keys=set(optims)), process_group=self._ctl_pg, no_dist=no_dist)
            missing = sorted(set(optims) - set(saved))
            if missing:
                raise MissingStateKeysError(f"the checkpoint holds no optimizer state for {missing}")
            # Matched to the optimizers by name now, while nothing live has changed: a refusal
            # leaves the model and optimizers as they were. Agreed first, so that no rank waits in
            # the next load for one that refused.
            problem: Exception | None = None
            try:
                direct = {key: _optimizer_state_by_name(bag, opt, saved[key]) for key, opt in optims.items()}
            except Exception as e:
                problem = e
            if not self._all_ok(problem is None):
                raise problem or RestoreRefusedError(
                    "another rank's optimizer does not match the checkpoint (see its log)"
                )
            reader.into_live = True
        reordered = {id(optims[key]): d.order for key, d in direct.items() if d.order != sorted(d.order)}
        return _DcpPlan(dcp_state, direct, frozenset(), reordered)

    def _load_dcp(self, reader: VerifiedReader, state: Mapping[str, Any], plan: _DcpPlan) -> dict[str, Any]:
        """Load modules (in place) and optimizer state as ``plan`` says; returns the state dicts to apply."""
        if not plan.through_dcp:
            return {}
        no_dist = not self._dist
        if plan.dcp_state is None:  # sharded: the generic path
            dcp_state, _ = self._split_state(state, initialise=plan.stepped)
            dcp_load(dcp_state, reader, SafeLoadPlanner(), process_group=self._ctl_pg, no_dist=no_dist)
            return dcp_state
        dcp_state = plan.dcp_state
        dcp_load(dcp_state, reader, SafeLoadPlanner(), process_group=self._ctl_pg, no_dist=no_dist)
        dcp_state.update(plan.direct)
        return dcp_state

    def _load_failure(self, ref: CheckpointRef, e: BaseException) -> tuple[str, str]:
        """Classify a failure to load ``ref`` on this rank (see ``_Failure``) and say what it was."""
        if isinstance(e, CheckpointException) and e.failures:
            # DCP wraps every rank's failure; the first one says what went wrong.
            e = next(iter(e.failures.values()))[0]
        if self._deleted_under_us(ref, e):
            kind, msg = (
                _Failure.GONE,
                (
                    f"deleted while it was read on rank {self.rank} (the retention of a process saving to this URI "
                    f"removed it): {e}"
                ),
            )
        elif (disk := self._staging_disk_error(e)) is not None:
            kind, msg = _Failure.STAGING, f"rank {self.rank}: {_staging_refusal(disk, self._staging_root)}"
        elif isinstance(e, _PROVEN_BAD):
            if isinstance(e, CorruptObjectError):
                what = "corrupt"
            elif isinstance(e, NotFoundError):
                what = "missing a file"
            elif isinstance(e, UnsafeCheckpointError | rank_state.RefusedPickleError):
                what = "unsafe"
            else:
                what = "unreadable"
            kind, msg = _Failure.BAD, f"{what} on rank {self.rank}: {e}"
        elif isinstance(e, PermanentStorageError):
            kind, msg = _Failure.REFUSED, f"rank {self.rank}: {e}"
        elif isinstance(e, StorageError | OSError):
            # A store that kept failing (or a local disk) proves nothing about the checkpoint.
            kind, msg = _Failure.UNAVAILABLE, f"rank {self.rank}: {e}"
        elif isinstance(e, NewerTorchError):
            kind, msg = _Failure.INCOMPATIBLE, f"{NEWER_TORCH}, on rank {self.rank}: {e}"
        elif isinstance(e, RestoreRefusedError) or _is_shape_or_key_mismatch(e):
            kind, msg = _Failure.INCOMPATIBLE, f"incompatible with the model on rank {self.rank}: {e}"
        else:
            # Verified bytes that still fail to load: not proven bad, so never skipped for an
            # older checkpoint (that would go back in time); refused with the error instead.
            kind, msg = _Failure.INCOMPATIBLE, f"cannot be loaded on rank {self.rank}: {type(e).__name__}: {e}"
            log.debug("restore failure detail", exc_info=e)
        if kind == _Failure.GONE:
            log.warning("restore: %s was %s; trying the newest checkpoint again", self.storage.url(ref.folder), msg)
        elif kind == _Failure.BAD:
            log.warning("restore: skipping %s: it is %s", self.storage.url(ref.folder), msg)
        else:
            log.warning("restore: %s: %s", self.storage.url(ref.folder), msg)
        return kind, msg

    def _staging_disk_error(self, e: BaseException) -> OSError | None:
        """The local disk's refusal behind ``e`` (full, over quota, read-only, not writable) when
        ``e`` came from filling the restore cache in the staging folder: the checkpoint is read from
        an object store, so nothing else this rank does writes a local file. None otherwise (a
        filesystem store's own refusal is the store's)."""
        if self.storage.local_path("") is not None:
            return None
        root = os.path.realpath(self._staging_root)
        seen: BaseException | None = e
        while seen is not None:  # the OSError itself, or the StorageError it was translated to
            if isinstance(seen, OSError) and seen.errno in _LOCAL_REFUSALS:
                if seen.filename is not None:
                    # Only a file of the staging folder: the client's own files (a web-identity
                    # token, a CA bundle, a credentials cache) are not the staging folder's.
                    path = os.path.realpath(os.fsdecode(seen.filename))
                    if os.path.commonpath([path, root]) == root:
                        return seen
                elif seen.errno not in (errno.EACCES, errno.EPERM):
                    # Full or read-only with no file named (a write to an open file); a denied
                    # connect() names none either, and that is the store's to answer.
                    return seen
            seen = seen.__cause__
        return None

    def _committed_listing(self, passed: set[str]) -> tuple[list[CheckpointRef], bool]:
        """(rank 0) The checkpoint folders, and whether any not retired nor ``passed`` (another
        job's, seen so already) holds a manifest now."""
        refs = find_checkpoints(self.storage)
        retired = _fresh_start.retired_folders(self.storage)
        return refs, any(
            r.folder not in retired | passed and self.storage.stat(r.key(MANIFEST_NAME)) is not None for r in refs
        )

    def _deleted_under_us(self, ref: CheckpointRef, e: BaseException) -> bool:
        """A file of ``ref`` was missing because the checkpoint itself is gone (its manifest, which
        retention deletes first): not a broken checkpoint, nor an unavailable store."""
        if not isinstance(e, NotFoundError | FileNotFoundError):
            return False
        try:
            return self.storage.stat(ref.key(MANIFEST_NAME)) is None
        except StorageError:
            return False  # not proven gone: judged as before

    def _agree_on_failure(self, failure: tuple[str, str] | None) -> tuple[str, str] | None:
        """Every rank's failure (or None), gathered: the worst one, identical on every rank."""
        failures = [f for f in self._all_gather(failure, self._ctl_pg) if f is not None]
        if not failures:
            return None
        return min(failures, key=lambda f: _Failure.SEVERITY.index(f[0]))

    def _apply(
        self, state: Mapping[str, Any], dcp_state: dict[str, Any], payload: dict[str, Any], manifest: Manifest
    ) -> None:
        modules, optims, _ = self._classify(state)
        bag = _ModuleBag(modules)
        model_state = {k: v for k, v in dcp_state.items() if k not in optims}
        if model_state and not _loaded_in_place(bag, model_state):
            set_model_state_dict(bag, model_state)
        for key, opt in optims.items():
            if isinstance(dcp_state[key], _DirectOptimState):
                opt.load_state_dict(dcp_state[key].state)
            else:
                set_optimizer_state_dict(bag, opt, dcp_state[key])
        if self.rank < manifest.world_size:
            rank_state.restore_rng(payload["rng"])
        else:
            log.info(
                "rank %d did not exist in the saved world of %d ranks: keeping its own RNG streams (and its "
                "ResumableLoaders' generators)",
                self.rank,
                manifest.world_size,
            )
        if self.rank == 0 and manifest.world_size > self.world_size:
            log.info(
                "the per-rank state of %d ranks that no longer exist was dropped", manifest.world_size - self.world_size
            )

    def _cleanup_cache(self, cache: str | None) -> None:
        """(every rank, after the agreement that ends a load) Remove the node's restore cache: this
        checkpoint's files, and any left by an earlier restore or prefetch that was killed."""
        if cache is None:
            return
        shutil.rmtree(cache, ignore_errors=True)
        if int(os.environ.get("LOCAL_RANK", self.rank)) == 0:
            shutil.rmtree(os.path.join(self._staging_root, RESTORE_FOLDER), ignore_errors=True)
