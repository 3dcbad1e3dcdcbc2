"""How the ranks of a Checkpointer's save agree on what each one writes: DCP's save planning.

``RankZeroSavePlanner`` is DCP's default planner, except that named values (a module's buffers,
scalars, non-tensor values) are written from the lowest rank, and that replicas every rank holds
are checked to agree before anything is written (``DivergentReplicasError``). ``SavePlanCache``
keeps the plans between saves while the state keeps its structure. ``dcp_save`` is DCP's save
without the warning its public wrapper emits on every single-process call. The files are written by
``agent._dcp_write``.
"""

from __future__ import annotations

import dataclasses
import functools
import pickle
import zlib
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint._dedup_save_plans import dedup_save_plans
from torch.distributed.checkpoint.default_planner import (
    DefaultSavePlanner,
)
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import (
    SavePlan,
    WriteItem,
    WriteItemType,
)


class RankZeroSavePlanner(DefaultSavePlanner):
    """DCP's save planner, except that the values under ``from_rank0`` are written from the lowest
    rank that holds them.

    DCP keeps one copy of a value every rank holds under the same name, and by default takes it
    from whichever rank has the least to write so far: fine for what the ranks keep identical
    (DDP's parameters and optimizer state), wrong for what only looks replicated. A module's
    buffers under DDP are the case: each rank's forward updates its BatchNorm running statistics
    from its own batch, and DDP's next forward overwrites them all with rank 0's. A checkpoint
    holding rank 1's copy resumes on other statistics than the uninterrupted run goes on with.
    ``from_rank0`` names such values by their flattened name, or a prefix of it (``model.bn``
    covers ``model.bn.running_mean``). Scalars and non-tensor values are written from the lowest
    rank too (``_small_whole_value``); everything else is spread over the ranks as DCP does.
    """

    def __init__(
        self, from_rank0: frozenset[str], *, check_replicas: bool = True, cache: SavePlanCache | None = None
    ) -> None:
        super().__init__()
        self._from_rank0 = from_rank0
        self._check_replicas = check_replicas
        self._cache = cache
        self._local: SavePlan | None = None  # this save's local plan as DCP made it, for the cache

    def create_local_plan(self) -> SavePlan:
        """DCP's local plan, with a fingerprint of each value the coordinator may keep one copy of
        (``_fingerprints``) riding beside DCP's own planner data. With a ``cache`` holding the same
        local plan from an earlier save, only the fingerprints travel (``_Unchanged``)."""
        plan = super().create_local_plan()
        fingerprints = self._fingerprints(plan) if self._check_replicas else None
        cache = self._cache
        if cache is not None:
            self._local = plan
            if cache.generation and cache.local is not None and _same_local_plan(plan, cache.local):
                self.plan = plan = SavePlan([], planner_data=_Unchanged(cache.generation, fingerprints))
                return plan
        if fingerprints is not None:
            self.plan = plan = dataclasses.replace(plan, planner_data=(plan.planner_data, fingerprints))
        return plan

    def _fingerprints(self, plan: SavePlan) -> dict[str, int]:
        """A CRC of a sample of each whole (unsharded) value of ``plan`` by name: the bytes of up to
        256 elements spread over a tensor (``_tensor_fingerprints``), a pickle of a non-tensor
        value. Values written from rank 0 (buffers, which may differ between ranks on purpose) are
        left out."""
        out: dict[str, int] = {}
        tensors: dict[str, torch.Tensor] = {}
        for item in plan.items:
            fqn = item.index.fqn
            if item.type == WriteItemType.SHARD or self._takes_rank0(fqn):
                continue
            value = self.state_dict.get(fqn)
            if isinstance(value, torch.Tensor):
                tensors[fqn] = value
            elif item.type == WriteItemType.BYTE_IO:
                if isinstance(value, list) and _is_group_params(fqn):
                    # An optimizer group's parameter names: which, not in what order. Groups built
                    # from a set list them in another order in each process, and train alike.
                    value = sorted(value, key=str)
                try:
                    out[fqn] = zlib.crc32(pickle.dumps(value, protocol=4))
                except Exception:  # not this check's to judge: DCP writes it as it does
                    continue
        out.update(zip(tensors, _tensor_fingerprints(list(tensors.values())), strict=True))
        return out

    def _check_replicas_agree(self, all_plans: list[SavePlan]) -> None:
        """(coordinator) Refuse values that several ranks hold under one name with other contents:
        DCP would keep one rank's copy, and every rank would restore it."""
        seen: dict[str, tuple[int, int]] = {}
        differ: dict[str, tuple[str, int, int]] = {}  # by name: the first two ranks that differ
        for rank, plan in enumerate(all_plans):
            data = plan.planner_data
            fingerprints = data.fingerprints if isinstance(data, _Unchanged) else data[1]
            for fqn, fingerprint in (fingerprints or {}).items():
                first = seen.setdefault(fqn, (rank, fingerprint))
                if first[1] != fingerprint:
                    differ.setdefault(fqn, (fqn, first[0], rank))
        if differ:
            raise DivergentReplicasError.of(list(differ.values()))

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        """(coordinator) The replica check on every rank's fingerprints, then DCP's global plan; with
        a ``cache``, the last save's when no rank's local plan changed and ``from_rank0`` is the
        same, else DCP's from the changed plans and the cached ones of the ranks that sent none."""
        if self._check_replicas:
            self._check_replicas_agree(all_plans)
        cache = self._cache
        unchanged = [isinstance(p.planner_data, _Unchanged) for p in all_plans]
        if any(unchanged):
            generations = {p.planner_data.generation for p, u in zip(all_plans, unchanged, strict=True) if u}
            if (
                cache is None
                or cache.all_plans is None
                or len(cache.all_plans) != len(all_plans)
                or generations != {cache.planned}
            ):
                held = None if cache is None or cache.all_plans is None else (cache.planned, len(cache.all_plans))
                raise RuntimeError(
                    f"the ranks reuse the save plans of save(s) {sorted(generations)} of {len(all_plans)} rank(s); "
                    f"the coordinator holds {held} (plan, ranks): an earlier save failed on some ranks only. This "
                    "save is given up and every rank plans the next one afresh"
                )
        cached = cache is not None and cache.all_plans is not None
        if cache is not None and cached and all(unchanged) and cache.from_rank0 == self._from_rank0:
            assert cache.global_plan is not None and cache.metadata is not None
            self.global_plan, self.metadata = cache.global_plan, dataclasses.replace(cache.metadata)
            reply = SavePlan([], planner_data=_Unchanged(cache.planned, None))
            return [reply] * len(all_plans), self.metadata
        if self._check_replicas:  # DCP's own planner data, without the fingerprints
            all_plans = [
                p if u else dataclasses.replace(p, planner_data=p.planner_data[0])
                for p, u in zip(all_plans, unchanged, strict=True)
            ]
        if cache is not None and cache.all_plans is not None:  # a rank that sent none: its cached plan
            all_plans = [c if u else p for c, p, u in zip(cache.all_plans, all_plans, unchanged, strict=True)]
        global_plan, metadata = super().create_global_plan(all_plans)
        if cache is None:
            return global_plan, metadata
        cache.planned += 1
        cache.all_plans = all_plans
        cache.global_plan, cache.metadata, cache.from_rank0 = global_plan, metadata, self._from_rank0
        self.metadata = dataclasses.replace(metadata)  # DCP's writer sets its storage_data per save
        return [dataclasses.replace(p, planner_data=_Planned(cache.planned, p.planner_data)) for p in global_plan], (
            self.metadata
        )

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        """This rank's part of the global plan: the cached one when the coordinator says it is
        unchanged (``_Unchanged``), else the one it sent, kept in the cache with the local plan."""
        data = new_plan.planner_data
        cache = self._cache
        if isinstance(data, _Unchanged):
            if cache is None or cache.final is None or cache.generation != data.generation:
                raise RuntimeError(
                    f"the coordinator reused the save plan of save {data.generation}, which this rank does not "
                    f"hold ({cache.generation if cache is not None else None}): a save failed on some ranks only. "
                    "This save is given up and every rank plans the next one afresh"
                )
            return super().finish_plan(cache.final)
        if isinstance(data, _Planned):
            new_plan = dataclasses.replace(new_plan, planner_data=data.planner_data)
            if cache is not None and self._local is not None:
                cache.local, cache.final, cache.generation = self._local, new_plan, data.generation
        return super().finish_plan(new_plan)

    def _takes_rank0(self, fqn: str) -> bool:
        if not self._from_rank0:
            return False
        if fqn in self._from_rank0:
            return True
        parts = fqn.split(".")
        return any(".".join(parts[:n]) in self._from_rank0 for n in range(1, len(parts)))

    def _dedup_save_plans(self, all_plans: list[SavePlan]) -> list[SavePlan]:
        # Once per name. Scalars and non-tensor values every rank holds (an optimizer's ``step``
        # counters and ``param_groups``) go to the lowest rank too: spread, they put a value every rank reads
        # into nearly every rank's file, and a restore of a sharded state then reads every file on
        # every node instead of its own shards and rank 0's (``agent.restore_cache.node_files``).
        takes = {
            i.index.fqn: self._takes_rank0(i.index.fqn) or _small_whole_value(i) for p in all_plans for i in p.items
        }

        def part(rank0: bool) -> list[SavePlan]:
            return [
                dataclasses.replace(p, items=[i for i in p.items if takes[i.index.fqn] == rank0]) for p in all_plans
            ]

        lowest = dedup_save_plans(part(True), save_to_lowest_rank=True)
        spread = dedup_save_plans(part(False), save_to_lowest_rank=False)
        return [
            dataclasses.replace(p, items=a.items + b.items) for p, a, b in zip(all_plans, lowest, spread, strict=True)
        ]


@dataclasses.dataclass(frozen=True)
class _Unchanged:
    """The planner data of a plan that stands for the one of save ``generation``: from a rank, its
    local plan is the same as then (only this save's replica ``fingerprints`` travel, when the
    replicas are checked); from the coordinator, so is the rank's part of the global plan."""

    generation: int
    fingerprints: dict[str, int] | None


@dataclasses.dataclass(frozen=True)
class _Planned:
    """The planner data of a rank's part of a new global plan (DCP's own ``planner_data``), the
    coordinator's number for it: the rank caches both."""

    generation: int
    planner_data: Any


def _same_local_plan(plan: SavePlan, cached: SavePlan) -> bool:
    """Whether DCP would plan ``plan`` as it planned ``cached``: the same items (name, offset, kind,
    and a tensor's size, chunk, dtype, layout and other properties), DCP's own planner data (the
    names' places in the nested state) and storage data. A stricter test than torch's own
    ``_compare_save_plans``, which leaves dtypes out."""
    return (
        plan.planner_data == cached.planner_data
        and plan.storage_data == cached.storage_data
        and plan.items == cached.items
    )


class SavePlanCache:
    """The save plans of a Checkpointer's last save, reused while the state keeps its structure.

    DCP plans every save afresh: each rank lists its items (``create_local_plan``), the lists are
    gathered to the coordinator, which decides who writes what and builds the metadata
    (``create_global_plan``), and scatters a plan back to each rank. With many small tensors that
    is a large part of a save, and with several ranks most of it is pickling the lists to and fro,
    though the state's structure rarely changes between saves. With this cache a rank whose local
    plan is the same as at the last save sends only a marker (and this save's replica
    fingerprints, so the check stays what it was); when every rank's is, and ``from_rank0`` is the
    same, the coordinator answers each with a marker too and every rank writes its cached plan.
    Any change (a tensor added, removed, resized, of another dtype or sharding; a new param group;
    another ``from_rank0``) has that rank send its full plan and the coordinator plan the save
    afresh, with the cached plans of the others. The data is taken from the state at write time,
    never from the plans (``resolve_data``), and the plans hold no tensors.

    One per Checkpointer (its own save group, so one world size); not shared between
    Checkpointers, unlike torch's own plan caching (``enable_plan_caching``: one cache per planner
    class, for the whole process). ``clear`` after a failed save.
    """

    def __init__(self) -> None:
        self.planned = 0
        """(coordinator) The number of the last global plan it made (counting up, never reused)."""
        self.world_size = 0
        self.clear()

    def bind(self, world_size: int) -> None:
        """Forget the plans if they were made for another number of ranks."""
        if world_size != self.world_size:
            self.clear()
            self.world_size = world_size

    def clear(self) -> None:
        # This rank's: its last local plan, its part of the global plan, and that plan's number.
        self.local: SavePlan | None = None
        self.final: SavePlan | None = None
        self.generation = 0
        # The coordinator's: every rank's local plan, the global plan and metadata, for from_rank0.
        self.all_plans: list[SavePlan] | None = None
        self.global_plan: list[SavePlan] | None = None
        self.metadata: Metadata | None = None
        self.from_rank0: frozenset[str] | None = None


SCALAR_BYTES = 16
"""The most bytes a one-element tensor takes (complex128)."""


def _small_whole_value(item: WriteItem) -> bool:
    """Whether ``item`` is a non-tensor value or a whole one-element tensor (an optimizer's ``step``):
    written from the lowest rank that holds it (``RankZeroSavePlanner._dedup_save_plans``). Bigger
    replicated tensors (DDP's parameters) stay spread over the ranks, each writing its part."""
    if item.type == WriteItemType.BYTE_IO:
        return True
    return item.type == WriteItemType.TENSOR and (item.tensor_storage_size() or SCALAR_BYTES + 1) <= SCALAR_BYTES


def _is_group_params(fqn: str) -> bool:
    """Whether ``fqn`` names an optimizer group's list of parameter names
    (``optim.param_groups.0.params``)."""
    parts = fqn.rsplit(".", 3)
    return len(parts) == 4 and parts[1] == "param_groups" and parts[2].isdigit() and parts[3] == "params"


_SAMPLE = 256
"""Elements of a tensor in its fingerprint, spread over it, the first and the last among them."""


_AS_INTEGERS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
"""An integer dtype of each element size: elements are sampled as the bytes they are, whatever
their dtype (float4_e2m1fn_x2 has no indexing kernel, on the CPU or an accelerator)."""


@functools.lru_cache(maxsize=1024)
def _sample_positions(n: int) -> np.ndarray:
    """The flat positions of the elements sampled from a tensor of ``n`` elements (integers: exact
    at any size), read-only: models repeat a few sizes, and each is computed once."""
    k = min(n, _SAMPLE)
    positions = np.arange(k, dtype=np.int64) * (n - 1) // max(k - 1, 1)
    positions.flags.writeable = False
    return positions


def _tensor_fingerprints(tensors: list[torch.Tensor]) -> list[int]:
    """A CRC of the shape, dtype and the bytes of up to 256 elements spread over each tensor: equal
    for equal tensors, and in practice different for tensors that were initialised or trained
    apart (shards of one layer, different experts). Cheap at any size: the sample only is read.

    On the CPU the sample is indexed through NumPy (a third of what torch's indexing costs a small
    tensor), without copying a tensor that is not contiguous. On an accelerator each tensor's
    sample is gathered there and all of a device's samples come to the host in one copy (one
    synchronisation per device, not one per tensor). Either way the bytes are those of the sampled
    elements in order, one element after the other: the same fingerprint wherever a tensor is.
    """
    out: list[int] = []
    on_device: dict[torch.device, list[tuple[int, torch.Tensor]]] = {}
    for i, tensor in enumerate(tensors):
        head = zlib.crc32(f"{tuple(tensor.shape)}:{tensor.dtype}".encode())
        out.append(head)
        n = tensor.numel()
        if n == 0:
            continue
        t = tensor.detach()
        as_integers = _AS_INTEGERS.get(t.element_size())
        if as_integers is not None and t.dtype != as_integers:
            t = t.view(as_integers)  # the same bytes, whatever the strides
        if t.device.type == "cpu" and type(t) is torch.Tensor:
            positions = _sample_positions(n)
            if t.is_contiguous():
                # Indexed as whole elements of their size in bytes: any dtype (float8, complex, bool) alike.
                elements = t.view(-1).view(torch.uint8).numpy().view(f"V{t.element_size()}")
                out[i] = zlib.crc32(elements[positions].tobytes(), head)
            else:
                index = tuple(torch.from_numpy(d) for d in np.unravel_index(positions, t.shape))
                out[i] = zlib.crc32(t[index].view(torch.uint8).numpy().tobytes(), head)
            continue
        positions_here = torch.from_numpy(_sample_positions(n).copy()).to(t.device)
        on_device.setdefault(t.device, []).append((i, t.reshape(-1)[positions_here].view(torch.uint8)))
    for samples in on_device.values():
        host = torch.cat([sample for _, sample in samples]).cpu().numpy()
        start = 0
        for i, sample in samples:
            out[i] = zlib.crc32(host[start : start + sample.numel()].tobytes(), out[i])
            start += sample.numel()
    return out


def _tensor_fingerprint(tensor: torch.Tensor) -> int:
    """``_tensor_fingerprints`` of one tensor."""
    return _tensor_fingerprints([tensor])[0]


class DivergentReplicasError(ValueError):
    """Ranks hold different values under one name (``RankZeroSavePlanner``); nothing is written."""

    @classmethod
    def of(cls, differ: list[tuple[str, int, int]]) -> DivergentReplicasError:
        """The error for ``differ``: (name, a rank, another rank holding other contents). The name
        that tells the cause comes first: an optimizer's parameter list, then its hyperparameters
        (a per-rank learning rate makes the parameters it updated differ too), then the rest."""

        def order(d: tuple[str, int, int]) -> int:
            return 0 if _is_group_params(d[0]) else 1 if ".param_groups." in d[0] else 2

        differ = sorted(differ, key=order)
        fqn, a, b = differ[0]
        more = f" (and {len(differ) - 1} more: {', '.join(d[0] for d in differ[1:4])})" if len(differ) > 1 else ""
        if order(differ[0]) == 0:
            how = (
                "The optimizers of the ranks hold different parameters (pipeline stages): keep each stage's "
                "optimizer in a per-rank object instead (see 'Pipeline stages' in spotjob's README)"
            )
        elif order(differ[0]) == 1:
            how = (
                "The ranks' optimizers use different hyperparameters, and the parameters they update drift apart "
                "with them: an LR scheduler stepped on each rank's own value (ReduceLROnPlateau given a loss or "
                "metric that was not averaged over the ranks), or a setting changed on some ranks only. Give "
                "every rank the same value (all-reduce the metric before scheduler.step(metric))"
            )
        else:
            how = (
                "Under DDP, replicas drift apart when weights are set after DistributedDataParallel wrapped the "
                "model (initialised or loaded on a seed per rank; DDP broadcasts rank 0's only when it wraps) or "
                "changed outside the optimizer on some ranks: set them before wrapping. Keep tensor- or "
                "expert-parallel shards as DTensors (parallelize_module, distribute_tensor), which are saved "
                "shard by shard, or keep each rank's own values in a per-rank object; where replicas differ on "
                'purpose (local SGD, DiLoCo), Checkpointer(..., replicas="rank0") saves rank 0\'s copy'
            )
        return cls(
            f"ranks {a} and {b} hold different values under the name {fqn}{more}. A checkpoint keeps one copy "
            "of a name that several ranks hold (data-parallel replicas are identical), so every rank would "
            f"restore the same rank's values. {how}. Nothing was saved"
        )


def dcp_save(
    state: dict[str, Any],
    writer: FileSystemWriter,
    *,
    process_group: Any,
    no_dist: bool,
    from_rank0: frozenset[str] = frozenset(),
    plan_cache: SavePlanCache | None = None,
) -> None:
    """What ``dcp.save`` does with a storage writer given, without its warning; the values named
    in ``from_rank0`` are written from the lowest rank (``RankZeroSavePlanner``). ``plan_cache``:
    the plans of the last save through it are reused while the state keeps its structure
    (``SavePlanCache``); it is cleared when the save fails.

    ``dcp.save`` warns on every single-process call; silencing that would mean editing the
    process's warning filters, which belong to the user. The function below it does the work.
    """
    from torch.distributed.checkpoint.state_dict_saver import _save_state_dict

    if plan_cache is not None:
        plan_cache.bind(1 if no_dist else torch.distributed.get_world_size(process_group))
    try:
        _save_state_dict(
            state_dict=state,
            storage_writer=writer,
            process_group=process_group,
            no_dist=no_dist,
            planner=RankZeroSavePlanner(from_rank0, check_replicas=not no_dist, cache=plan_cache),
        )
    except BaseException:
        # DCP raises a failure on every rank (planning and writing end in collectives): every
        # rank forgets its plans, and the next save is planned afresh everywhere.
        if plan_cache is not None:
            plan_cache.clear()
        raise
