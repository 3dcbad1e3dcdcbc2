"""How an async save stages a rank's state into host buffers kept between saves.

``make_stager`` builds DCP's stager once per Checkpointer (pinned buffers with CUDA, torchtitan's
way); ``stage_state`` copies a state into it, through ``_KeptBuffers.stage_plain`` when the state is
plain tensors and values (a module's and an optimizer's state), DCP's deep copy otherwise.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
import weakref
from typing import Any

import torch


def staging_options(cuda: bool) -> Any:
    """How a save stages its tensors in host memory, torchtitan's way on GPUs.

    With CUDA: host buffers pinned (page-locked, so device-to-host copies run as DMA at full link
    speed) and kept between saves, the copies enqueued without blocking and waited for once at
    the end. Without it: plain host buffers, kept between saves, filled by a memcpy.
    """
    from torch.distributed.checkpoint.staging import StagingOptions

    return StagingOptions(
        use_pinned_memory=cuda, use_shared_memory=False, use_async_staging=False, use_non_blocking_copy=cuda
    )


def make_stager(cuda: bool | None = None) -> Any:
    """One stager for the Checkpointer's lifetime: it keeps its host buffers between saves (DCP's
    ``StateDictStager`` caches one per source storage), so a save copies into memory that is
    already there instead of allocating (and first-touching, or pinning) a state-sized buffer
    every time. Safe because a save is staged only after the previous one is done with its
    buffers. ``close()`` frees them. Stage through ``stage_state`` (see ``_KeptBuffers``)."""
    stager = _stager_class()(staging_options(torch.cuda.is_available() if cuda is None else cuda))
    inner = getattr(stager, "_state_dict_stager", None)
    if inner is not None and hasattr(inner, "_stage_untyped_storage"):
        inner._stage_untyped_storage = _KeptBuffers(inner)
    if inner is not None and callable(getattr(inner, "close", None)):
        # torch 2.11 and 2.12's DefaultStager closes its StateDictStager after every stage, which
        # empties its deep-copy table (the next stage then fails: KeyError: <class 'type'>) and its
        # kept buffers. The stager is kept for the Checkpointer's life: only Stager.close closes it.
        inner.close = _no_close
    return stager


def _no_close() -> None:
    """What DCP's stager calls on its StateDictStager after a stage, under torch 2.11 and 2.12."""


@functools.cache
def _stager_class() -> type:
    """DCP's ``DefaultStager``, whose ``close()`` also frees the buffers of ``stage_state``'s plain
    path (``_KeptBuffers.plain``). Made on first use: torch's staging module is imported then."""
    from torch.distributed.checkpoint.staging import DefaultStager

    class Stager(DefaultStager):
        def close(self) -> None:
            inner = getattr(self, "_state_dict_stager", None)
            kept = getattr(inner, "_stage_untyped_storage", None)
            super().close()
            if inner is not None and inner.__dict__.get("close") is _no_close:
                type(inner).close(inner)
            if isinstance(kept, _KeptBuffers):
                kept.clear()

    return Stager


def stage_state(stager: Any, state: dict[str, Any]) -> Any:
    """``state`` staged into ``stager``'s buffers; afterwards it keeps the buffers of this save only.

    A state of plain tensors (on the CPU or CUDA) and plain values in dicts, lists and tuples, which
    is what a module's and an optimizer's state are, is staged by ``_KeptBuffers.stage_plain``: the
    same staged state as DCP's deep copy makes, in about a third of its time for many small tensors.
    Anything else (DTensors, tensor subclasses, other objects) goes through DCP's stager."""
    kept = getattr(getattr(stager, "_state_dict_stager", None), "_stage_untyped_storage", None)
    if isinstance(kept, _KeptBuffers):
        config = getattr(stager, "_config", None)
        staged = kept.stage_plain(state, non_blocking=bool(getattr(config, "use_non_blocking_copy", False)))
        if staged is not None:
            return staged
        kept.used.clear()
    sharded: list[Any] = []
    held = _without_sharded(state, sharded)
    staged = stager.stage(state if not sharded else (held, [[s.tensor for s in x.local_shards()] for x in sharded]))
    staged = staged.result() if hasattr(staged, "result") else staged
    if getattr(stager, "should_synchronize_after_execute", False):
        stager.synchronize_staging()
    if isinstance(kept, _KeptBuffers):
        kept.forget_unused()
    if sharded:
        held, tensors = staged
        staged = _with_sharded(held, [_sharded_over(x, t) for x, t in zip(sharded, tensors, strict=True)])
    return staged


def _sharded_tensor_class() -> type | None:
    """torch's ``ShardedTensor`` (the state of an FSDP1 ``FullyShardedDataParallel`` module), or
    None where nothing imported it (then no state holds one)."""
    module = sys.modules.get("torch.distributed._shard.sharded_tensor.api")
    found = getattr(module, "ShardedTensor", None)
    return found if isinstance(found, type) else None


class _ShardedSlot:
    """Where the ``index``-th ShardedTensor of a state stood while DCP's stager stages the rest
    (``_without_sharded``)."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index


def _without_sharded(value: Any, found: list[Any]) -> Any:
    """``value`` with each ShardedTensor in its dicts, lists and tuples replaced by a
    ``_ShardedSlot`` (and appended to ``found``); the containers above none are ``value``'s own.
    DCP's stager copies a tensor through its ``data_ptr()``, which a ShardedTensor refuses: every
    async save of an FSDP1 model that went to DCP's stager failed ("'data_ptr' ... not supported
    for ShardedTensor!"). Its local shards are staged beside the state instead."""
    sharded = _sharded_tensor_class()
    if sharded is None:
        return value
    return _slot(value, found, sharded)


def _slot(value: Any, found: list[Any], sharded: type) -> Any:
    kind = type(value)
    if kind is dict:
        items = {k: _slot(v, found, sharded) for k, v in value.items()}
        return items if any(items[k] is not v for k, v in value.items()) else value
    if kind is list or kind is tuple:
        listed = [_slot(v, found, sharded) for v in value]
        return kind(listed) if any(a is not b for a, b in zip(listed, value, strict=True)) else value
    if kind is sharded:
        found.append(value)
        return _ShardedSlot(len(found) - 1)
    return value


def _with_sharded(value: Any, staged: list[Any]) -> Any:
    """The staged ``value`` (of ``_without_sharded``) with each slot holding its staged ShardedTensor."""
    kind = type(value)
    if kind is dict:
        return {k: _with_sharded(v, staged) for k, v in value.items()}
    if kind is list or kind is tuple:
        return kind(_with_sharded(v, staged) for v in value)
    if kind is _ShardedSlot:
        return staged[value.index]
    return value


def _sharded_over(source: Any, tensors: list[torch.Tensor]) -> Any:
    """A ShardedTensor like ``source`` whose local shards are ``tensors`` (their staged copies, in
    the order of ``source.local_shards()``), on this rank only: what DCP saves of it, its global
    metadata and the offsets and sizes of this rank's shards, are ``source``'s. A staged copy lies
    in host memory (pinned where CUDA is used), which its metadata then says; torch checks that."""
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor

    metadata = source.metadata()
    replaced: dict[tuple[int, ...], ShardMetadata] = {}  # by offsets: this rank's shards, moved
    local = []
    for shard, tensor in zip(source.local_shards(), tensors, strict=True):
        meta = shard.metadata
        place = meta.placement
        if place is not None and place.device() != tensor.device:
            meta = ShardMetadata(meta.shard_offsets, meta.shard_sizes, f"rank:{place.rank()}/{tensor.device}")
            replaced[tuple(meta.shard_offsets)] = meta
        local.append(Shard(tensor, meta))
    rank = source.local_shards()[0].metadata.placement.rank() if replaced else -1
    properties = metadata.tensor_properties
    pinned = bool(tensors) and tensors[0].is_pinned()
    if replaced or properties.pin_memory != pinned or properties.requires_grad:
        metadata = dataclasses.replace(
            metadata,
            shards_metadata=[
                replaced.get(tuple(m.shard_offsets), m) if m.placement and m.placement.rank() == rank else m
                for m in metadata.shards_metadata
            ],
            tensor_properties=dataclasses.replace(properties, pin_memory=pinned, requires_grad=False),
        )
    return ShardedTensor._init_from_local_shards_and_global_metadata(
        local, metadata, process_group=source._process_group
    )


_ATOMIC = frozenset({type(None), bool, int, float, complex, str, bytes})
"""Values a deep copy returns as they are (DCP's stager does too)."""


class _NotPlain(Exception):
    """The state holds something ``_KeptBuffers.stage_plain`` leaves to DCP's stager."""


class _KeptBuffers:
    """DCP's staging of one storage (``StateDictStager._stage_untyped_storage``), with the cache of
    host buffers it keeps between saves held to what the state holds now.

    - A storage resized in place since the last save (``buffer.resize_(n)``, a cache or vocabulary
      grown where it lies) keeps its cache key at a new size, and DCP asserted "Cached storage size
      does not match": every async save from then on failed, while a synchronous one worked. Its
      stale buffer is dropped and one of the new size allocated, as for a new tensor.
    - DCP drops a buffer only when its source tensor is freed: a value that left the state but
      lives on in the script (an EMA saved now and then, an old layer the script still holds)
      kept its copy in host memory for the Checkpointer's life, beyond the one copy of the state
      that staging is documented to take. ``forget_unused`` drops every buffer the last save did
      not use.

    ``stage_plain`` stages a state of plain tensors without DCP's generic deep copy, into buffers
    of its own (``plain``: by the source storage's id, a weak reference to it and its buffer), by
    the same rules: one buffer per source storage (tensors that share a storage stay views of one
    buffer), reused while the storage keeps its size, dropped when a save does not use it or the
    storage is freed.
    """

    def __init__(self, inner: Any) -> None:
        self.stage_storage = inner._stage_untyped_storage
        self.cache = getattr(inner, "_cached_storage_mapping", None)
        self.used: set[int] = set()
        self.plain: dict[int, tuple[Any, Any, dict[Any, torch.Tensor]]] = {}
        self.plain_state = True
        """False once a state was not plain: the states of a Checkpointer keep their kind, and each
        of its later saves then goes to DCP's stager at once instead of after a partial walk."""

    def __call__(self, storage: Any, *args: Any, **kwargs: Any) -> Any:
        if self.cache is not None:
            cached = self.cache.get(storage)
            if cached is not None and cached.size() != storage.size():
                del self.cache[storage]
        self.used.add(id(storage))
        return self.stage_storage(storage, *args, **kwargs)

    def forget_unused(self) -> None:
        if self.cache is not None:
            for source in list(self.cache.keys()):
                if id(source) not in self.used:
                    del self.cache[source]
        self.used.clear()
        self.plain.clear()  # staged through DCP: none of them was used

    def clear(self) -> None:
        """Let every buffer go (the stager is closed)."""
        self.plain.clear()
        self.used.clear()
        if self.cache is not None:
            self.cache.clear()

    def stage_plain(self, state: dict[str, Any], *, non_blocking: bool) -> dict[str, Any] | None:
        """``state`` staged as DCP's stager stages it, or None when it holds something other than
        plain tensors and plain values in dicts, lists and tuples: DCP's stager then stages it, into
        the buffers of the storages this walk reached before it met that value."""
        if self.cache is None or not self.plain_state:
            return None
        walk = _PlainWalk(self, non_blocking)
        try:
            staged = walk.stage(state)
        except _NotPlain:
            self.plain_state = False
            # The buffers of the storages walked so far go to DCP's cache: its stager, which stages
            # this save, uses them instead of allocating their like again.
            for storage in walk.storages:
                self.cache[storage] = walk.kept[id(storage)][1]
            self.plain.clear()
            return None
        if walk.copied and non_blocking:
            torch.accelerator.synchronize()  # the device-to-host copies were only enqueued
        self.plain = walk.kept
        self.used.clear()
        if len(self.cache):
            self.cache.clear()  # buffers of an earlier save staged through DCP: none used now
        return staged

    def _forget(self, key: int, ref: Any) -> None:
        """(weakref callback) The source storage was freed: its buffer goes too."""
        entry = self.plain.get(key)
        if entry is not None and entry[0] is ref:
            del self.plain[key]


class _PlainWalk:
    """One save's ``_KeptBuffers.stage_plain``: what was staged (``memo``, by the source object's
    id, as a deep copy's memo) and the buffers this save used (``kept``)."""

    def __init__(self, buffers: _KeptBuffers, non_blocking: bool) -> None:
        self.buffers = buffers
        self.non_blocking = non_blocking
        self.memo: dict[int, Any] = {}
        self.kept: dict[int, tuple[Any, Any, dict[Any, torch.Tensor]]] = {}
        self.alive: list[Any] = []  # the sources staged, held until the walk is done: their ids stay theirs
        self.storages: list[Any] = []  # the source storages staged, in order
        self.copied = False

    def stage(self, x: Any) -> Any:
        kind = type(x)
        if kind in _ATOMIC:
            return x
        done = self.memo.get(id(x))
        if done is not None:
            return done
        y: Any
        if kind is torch.Tensor:
            y = self.tensor(x)
        elif kind is dict:
            y = {}
            self.memo[id(x)] = y
            for k, v in x.items():
                y[self.stage(k)] = self.stage(v)
        elif kind is list:
            y = []
            self.memo[id(x)] = y
            y.extend([self.stage(v) for v in x])
        elif kind is tuple:
            items = [self.stage(v) for v in x]
            y = tuple(items) if any(a is not b for a, b in zip(items, x, strict=True)) else x
        elif kind is _sharded_tensor_class():  # an FSDP1 module's state: its local shards are plain
            y = _sharded_over(x, [self.stage(shard.tensor) for shard in x.local_shards()])
        else:
            raise _NotPlain
        self.memo[id(x)] = y
        self.alive.append(x)
        return y

    def tensor(self, x: torch.Tensor) -> torch.Tensor:
        if x.layout is not torch.strided or x.is_quantized or x.is_nested or x.is_conj() or x.is_neg() or x.__dict__:
            raise _NotPlain
        device = x.device.type
        if device != "cpu" and device != "cuda":
            raise _NotPlain
        storage = x.untyped_storage()
        key = id(storage)
        entry = self.kept.get(key)
        if entry is None:
            entry = self.buffers.plain.get(key)
            if entry is None or entry[0]() is not storage or entry[1].size() != storage.size():
                # New, or resized in place since the last save: a buffer of its size, DCP's way
                # (pinned with CUDA), which is then this path's, not DCP's cache's.
                buffer = self.buffers(storage, non_blocking=self.non_blocking)
                if self.buffers.cache is not None:
                    self.buffers.cache.pop(storage, None)
                ref = weakref.ref(storage, functools.partial(_forget_plain, weakref.ref(self.buffers), key))
                entry = (ref, buffer, {})
            else:
                entry[1].copy_(storage, non_blocking=self.non_blocking)
            self.kept[key] = entry
            self.storages.append(storage)
            self.copied = self.copied or device != "cpu"
        # The staged tensor: a view of the buffer where the source is a view of its storage. The
        # one made for the same view at an earlier save is handed out again (making one, set_,
        # costs more than copying a small tensor's bytes); it holds no memory of its own.
        views = entry[2]
        shape = (x.dtype, x.storage_offset(), x.size(), x.stride())
        y = views.get(shape)
        if y is None:
            if len(views) >= _VIEWS_KEPT:
                views.clear()
            y = torch.empty(0, dtype=x.dtype, device="cpu")  # not the user's default device
            y.set_(entry[1], shape[1], shape[2], shape[3])
            views[shape] = y
        return y


_VIEWS_KEPT = 16
"""Staged views kept per buffer between saves (``_PlainWalk.tensor``); more are made afresh."""


def _forget_plain(buffers: Any, key: int, ref: Any) -> None:
    kept = buffers()
    if kept is not None:
        kept._forget(key, ref)
