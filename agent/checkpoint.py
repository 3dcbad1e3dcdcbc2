"""Checkpointer: sharded, resumable, asynchronous checkpoints committed by a manifest written last.

What the training script calls, in order (every rank calls every method):

1. ``Checkpointer(uri, ...)`` or ``Checkpointer.from_env()`` — creates two gloo groups of its own
   (a collective: all ranks construct it in the same order). One carries the background save
   (DCP's async save must not share a group with training collectives, or they deadlock); the
   other carries the per-step vote and restore. (rank 0) claims the URI for the job
   (``agent.ownership``); another job's URI fails on every rank.
2. ``restore(state)`` — loads the newest valid checkpoint in place, returns its step (0 if none).
3. ``step(n, state)`` per step — saves per policy; returns True when the job must stop now (a
   preemption flush committed).
4. ``close()`` — waits for the save in flight.

One save, from the training loop's point of view: ``state`` is turned into DCP state dicts
(modules and optimizers, which reshard) and per-rank bytes (everything else and the RNG streams);
the tensors are staged to CPU memory — the only time the loop is blocked. In a background thread
each rank then writes its DCP shard, CRC32Cs and uploads its own files; rank 0 gathers every
rank's file list, checks that its attempt is not fenced, writes MANIFEST.json create-only and
tells every rank the outcome; then it applies retention. At most one save is in flight; a failed
one raises on the next call.

The vote: the agent drops ``flush.json`` (stop) or ``save.json`` (save early) in the control
folder. At the end of each ``step()`` every rank launches an asynchronous all-reduce on the
control group of [flush asked, save-early asked, every_seconds due, step, -step]; its result is
read at the next ``step()``, so every rank acts on the same flags at the same step without the
loop ever waiting on the network, and ranks that report different steps are caught. The flags
are gathered after the step's own save started, so one trigger makes one save.

Restore never goes back in time on its own: a checkpoint proven bad (CRC mismatch, a missing or
short file, a manifest or metadata that does not parse or is unsafe) is skipped for an older one;
a store that keeps failing raises ``StorageUnavailableError``; a checkpoint the model cannot take
(changed shapes) raises ``RestoreRefusedError``, as does a URI whose committed checkpoints all
fail — unless ``start_fresh`` says to begin at step 0, which retires them (``agent._fresh_start``).

Nothing here touches what the process owns: no global RNG draw or reseed (only a restore sets
the streams, to the checkpoint's), no change to torch's serialization options, no warning filter.
"""

from __future__ import annotations

import json
import logging
import operator
import os
import shutil
import sys
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, TypeVar
from urllib.parse import urlparse

import torch
import torch.distributed as dist
from pydantic import JsonValue, TypeAdapter, ValidationError
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from agent import _fresh_start, _rank_state
from agent._dcp import (
    ChecksummedFile,
    SafeEmptyLoadPlanner,
    SafeLoadPlanner,
    UnsafeCheckpointError,
    VerifiedReader,
    dcp_load,
    dcp_save,
    load_dcp_metadata,
    make_stager,
    make_writer,
    sync_files,
    tensor_index,
)
from agent.catalog import CheckpointRef, find_checkpoints, inspect
from agent.control_channel import (
    ENV_CHECKPOINT_URI,
    ENV_START_FRESH,
    ControlDir,
    FlushRequest,
    FlushResult,
    RankStatus,
)
from agent.crc32c import to_hex
from agent.manifest import (
    DCP_METADATA_NAME,
    MANIFEST_NAME,
    MAX_JSON_DEPTH,
    FileEntry,
    Manifest,
    ManifestError,
    check_json_depth,
    now_utc,
)
from agent.ownership import FencedError, Lineage, OwnershipError, check_not_fenced, claim
from agent.restore_cache import RESTORE_FOLDER, default_staging
from agent.settings import CheckpointerEnv, load
from agent.storage import (
    AlreadyExistsError,
    CorruptObjectError,
    NotFoundError,
    PermanentStorageError,
    StorageError,
    open_storage,
    put_files,
    translate_os_error,
)

log = logging.getLogger(__name__)

T = TypeVar("T")

_STATUS_INTERVAL_S = 1.0
_METADATA = TypeAdapter(dict[str, JsonValue])
_MAX_METADATA_BYTES = 1 << 20


class CheckpointError(Exception):
    """Base of the errors the Checkpointer raises."""


class SaveFailedError(CheckpointError):
    """A background save failed; nothing was committed for its step."""


class FlushFailedError(SaveFailedError):
    """A preemption flush could not commit a checkpoint."""


class FencedSaveError(SaveFailedError, FencedError):
    """This worker's attempt was superseded (a newer attempt of the job is recorded, or another job
    took the URI over): it committed and deleted nothing and must stop. Raised on every rank, and
    again by every later ``step()``/``save()``."""


class CheckpointOwnershipError(CheckpointError, OwnershipError):
    """The URI belongs to another job; raised on every rank at construction, nothing written."""


class RestoreError(CheckpointError):
    """Restore could not leave the job in a consistent state."""


class RestoreRefusedError(RestoreError):
    """Committed checkpoints exist but restore will not go on: the newest one is incompatible with
    the model (shapes changed), or none of them loads. Nothing was deleted and the state was not
    changed. ``tried`` lists each checkpoint tried (URI, why it failed), newest first."""

    def __init__(self, message: str, tried: list[tuple[str, str]] | None = None) -> None:
        super().__init__(message)
        self.tried = list(tried or [])


class MissingStateKeysError(RestoreRefusedError):
    """``restore`` was handed state keys the newest checkpoint does not hold (a refusal: nothing
    was loaded or deleted)."""


class StorageUnavailableError(CheckpointError):
    """The checkpoint store still failed after its retries (or failed in a way that proves nothing
    about the checkpoints): restore stopped rather than fall back to an older checkpoint. Not the
    user's fault: under spotjob-agent it is reported as an infrastructure error (exit 74)."""


@dataclass
class CheckpointConfig:
    """How and where to checkpoint. Cross-field checks run at construction, not deep in DCP."""

    uri: str
    """Where checkpoints go: s3://bucket/prefix, gs://bucket/prefix, file:///path or a path."""
    every_steps: int | None = None
    """Save every N completed steps (None: only on request or flush)."""
    every_seconds: float | None = None
    """Save when this much wall time has passed since the last save started (ranks agree)."""
    keep: int | None = 3
    """Committed checkpoints to keep (None: all). The newest valid one is never deleted."""
    async_save: bool = True
    """Block the loop only while staging to CPU memory; write and upload in the background."""
    staging_dir: str | None = None
    """Node-local folder ranks write to before uploading (the node's NVMe in production)."""
    control_dir: str | None = None
    """The folder shared with spotjob-agent (flush requests, status); None: no agent."""
    job: str | None = None
    """The job's name: the URI's owner (``agent.ownership``), recorded in manifests and logs."""
    attempt: int | None = None
    """The controller's attempt number for these workers (fencing); None: not fenced."""
    start_fresh: bool = False
    """Start from step 0 when committed checkpoints exist but none loads (they are retired)."""
    io_threads: int = 8
    """Parallel transfers per rank."""
    release_staging: bool = False
    """Free the host buffers an async save staged into as soon as that save is committed, instead of
    keeping them for the next save. Gives a state-sized block of memory back between saves, at the
    price of allocating (first-touching; pinning, with CUDA) it again on the next one."""

    def __post_init__(self) -> None:
        if self.every_steps is not None and self.every_steps < 1:
            raise ValueError(f"every_steps must be >= 1 (or None to disable), got {self.every_steps}")
        if self.every_seconds is not None and self.every_seconds <= 0:
            raise ValueError(f"every_seconds must be > 0 (or None to disable), got {self.every_seconds}")
        if self.keep is not None and self.keep < 1:
            raise ValueError(f"keep must be >= 1 (or None to keep everything), got {self.keep}")
        if self.io_threads < 1:
            raise ValueError(f"io_threads must be >= 1, got {self.io_threads}")
        if self.attempt is not None and (isinstance(self.attempt, bool) or not isinstance(self.attempt, int)):
            raise TypeError(f"attempt must be an int (or None), got {self.attempt!r}")
        if self.attempt is not None and self.attempt < 0:
            raise ValueError(f"attempt must be >= 0 (or None), got {self.attempt}")


@dataclass
class _Save:
    """One save in flight."""

    step: int
    started: float
    local_dir: str
    metadata: dict[str, Any]
    state_keys: list[str]
    rank_bytes: bytes
    writer: Any = None
    cancel: threading.Event = field(default_factory=threading.Event)
    """Set when a flush supersedes this save: its write stops at the next block, nothing is committed."""
    staged: Any = None
    """The staged DCP state the background thread writes (None: written already, or none)."""
    flush: FlushRequest | None = None
    trigger: str = "save"
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None
    committed_uri: str | None = None
    thread: threading.Thread | None = None


def _is_infrastructure(error: BaseException) -> bool:
    """A failure of the store or of this node's disk that a later attempt may not meet.

    Not the user's code, not ownership, and not a store that refuses for good (permission denied,
    no space left, read-only, no such bucket): the next attempt would meet that refusal too, so it
    spends ``maxRestarts`` and the job fails saying why, instead of restarting without end.
    """
    if isinstance(error, CheckpointException) and error.failures:
        error = next(iter(error.failures.values()))[0]
    if isinstance(error, AlreadyExistsError | FencedError):
        return False  # another writer on the URI: ownership, not infrastructure
    if isinstance(error, OSError):
        error = translate_os_error(error, "writing the checkpoint")
    return isinstance(error, StorageError) and not isinstance(error, PermanentStorageError)


def normalise_uri(uri: str) -> str:
    """One spelling per location: ``s3://b/p``, ``gs://b/p``, ``file:///abs/path``."""
    parsed = urlparse(uri)
    scheme = parsed.scheme.lower()
    if scheme in ("s3", "gs"):
        prefix = "/".join(p for p in parsed.path.split("/") if p)
        return f"{scheme}://{parsed.netloc}/{prefix}".rstrip("/")
    path = parsed.path if scheme == "file" else uri
    return "file://" + os.path.normpath(os.path.abspath(os.path.expanduser(path)))


def _check_step(step: Any, call: str) -> int:
    """A step is a whole number of completed steps, >= 0."""
    if isinstance(step, bool):
        raise TypeError(f"{call}: step must be an int (completed steps), got the bool {step!r}")
    try:
        value = operator.index(step)
    except TypeError:
        raise TypeError(
            f"{call}: step must be an int (completed steps), got {step!r} ({type(step).__name__})"
        ) from None
    if value < 0:
        raise ValueError(f"{call}: step must be >= 0 (completed steps), got {value}")
    return value


def _check_metadata(metadata: Any, call: str) -> dict[str, Any]:
    """User metadata goes into MANIFEST.json: a dict of JSON values, checked before anything is written."""
    if metadata is None:
        return {}
    if not isinstance(metadata, Mapping):
        raise TypeError(f"{call}: metadata must be a dict of JSON values, got {type(metadata).__name__}")
    try:
        checked = _METADATA.validate_python(dict(metadata))
        encoded = json.dumps(checked).encode()
    except (ValidationError, TypeError, ValueError, RecursionError) as e:
        where = ""
        if isinstance(e, ValidationError) and e.errors():
            loc = e.errors()[0].get("loc", ())
            where = "".join(f"[{p!r}]" for p in loc[:1]) or ""
        raise TypeError(
            f"{call}: metadata{where} is not JSON (numbers, strings, bools, None, lists, dicts with str keys); "
            "convert tensors with float(...) or .tolist()"
        ) from None
    if len(encoded) > _MAX_METADATA_BYTES:
        raise ValueError(
            f"{call}: metadata is {len(encoded)} bytes as JSON, more than {_MAX_METADATA_BYTES}; it goes into "
            "every manifest: keep it to small values (loss, tokens seen) and save bulky data as state"
        )
    try:
        check_json_depth(encoded, MAX_JSON_DEPTH - 3)  # the manifest nests it 2 levels deep, readers allow 64
    except ValueError:
        raise ValueError(f"{call}: metadata nests more than {MAX_JSON_DEPTH - 3} levels deep") from None
    return checked


def _take_back_closed_on_crash(control: ControlDir, rank: int) -> None:
    """If the script dies of an unhandled exception after close(), remove the "closed" marker.

    The marker lets the agent forgive an abort at interpreter exit after the work is done; a
    traceback after close() (writing results, say) is a real failure and must stay one. A
    ``sys.exit(non-zero)`` after close() is not seen here (no hook runs for it).
    """
    previous = sys.excepthook

    def hook(kind: type[BaseException], value: BaseException, tb: Any) -> None:
        control.unmark_closed(rank)
        previous(kind, value, tb)

    sys.excepthook = hook


def _exception_in_flight() -> bool:
    exc = sys.exc_info()[1]
    if exc is None:
        return False
    return not (isinstance(exc, SystemExit) and exc.code in (0, None))


@dataclass(frozen=True)
class _Vote:
    """What every rank agreed on for one step: identical on all ranks, or collectives diverge."""

    flush: bool = False
    save_early: bool = False
    time_due: bool = False
    lowest_step: int | None = None
    highest_step: int | None = None

    @classmethod
    def reduced(cls, values: list[int]) -> _Vote:
        flush, early, due, high, neg_low = values
        return cls(bool(flush), bool(early), bool(due), -neg_low, high)


class _Failure:
    """How one attempt to load a checkpoint failed, worst first when ranks disagree."""

    UNAVAILABLE = "unavailable"  # storage failed, or something that proves nothing about the checkpoint
    INCOMPATIBLE = "incompatible"  # the checkpoint is fine; this script's state cannot take it
    BAD = "bad"  # proven bad: skip it for an older one
    SEVERITY = (UNAVAILABLE, INCOMPATIBLE, BAD)


# What proves a checkpoint bad (restore may then fall back to an older one); any other storage
# error proves nothing about it and stops the restore instead.
_PROVEN_BAD = (
    CorruptObjectError,
    NotFoundError,
    ManifestError,
    UnsafeCheckpointError,
    _rank_state.RefusedPickleError,
    _rank_state.RankStateError,
)


@dataclass
class _DirectOptimState:
    """Optimizer state rebuilt from a checkpoint, keyed by parameter name, for the fast path."""

    state: dict[str, Any]


def _plain_modules(bag: nn.Module) -> bool:
    """True when no parameter is sharded (no DTensor, no FSDP): names map 1:1 to parameters."""
    from torch.distributed.tensor import DTensor

    if any(isinstance(p, DTensor) for p in bag.parameters()):
        return False
    return not any(type(m).__name__ in ("FullyShardedDataParallel", "FSDPModule") for m in bag.modules())


def _load_optimizer_directly(bag: nn.Module, opt: torch.optim.Optimizer, saved: dict[str, Any]) -> None:
    """What ``set_optimizer_state_dict`` does for plain modules, minus its initialising step."""
    from torch.distributed.checkpoint.state_dict import _get_fqns

    index = {id(p): i for i, p in enumerate(p for g in opt.param_groups for p in g["params"])}
    by_name: dict[str, int] = {}
    for name, param in bag.named_parameters():
        if id(param) in index:
            for fqn in _get_fqns(bag, name):
                by_name[fqn] = index[id(param)]
    try:
        state = {by_name[fqn]: value for fqn, value in saved.get("state", {}).items()}
        groups = [{**g, "params": [by_name[fqn] for fqn in g["params"]]} for g in saved["param_groups"]]
    except KeyError as e:
        raise MissingStateKeysError(
            f"the checkpoint's optimizer state names parameter {e.args[0]!r}, which the model does not have"
        ) from None
    opt.load_state_dict({"state": state, "param_groups": groups})


def _run_into(future: Future[T], fn: Callable[..., T], *args: Any) -> None:
    """``fn(*args)``'s result or exception into ``future`` (a thread's whole work)."""
    try:
        future.set_result(fn(*args))
    except BaseException as e:
        future.set_exception(e)


def _loaded_in_place(bag: nn.Module, loaded: Mapping[str, Any]) -> bool:
    """True when DCP loaded every tensor of the modules' state straight into their own tensors
    (plain modules: ``get_model_state_dict`` hands out the parameters' storage), so applying
    ``loaded`` again would only copy each tensor onto itself."""
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


def _is_shape_or_key_mismatch(e: BaseException) -> bool:
    """DCP's and load_state_dict's words for a state that does not fit the checkpoint."""
    text = str(e).lower()
    return any(w in text for w in ("size mismatch", "missing key", "unexpected key", "shape mismatch"))


class _ModuleBag(nn.Module):
    """Holds the job's modules under their state keys, so tensor names read "model.fc.weight"."""

    def __init__(self, modules: Mapping[str, nn.Module]) -> None:
        super().__init__()
        for key, module in modules.items():
            self.add_module(key, module)


class Checkpointer:
    """Save and restore a training job's full state; see the module docstring for call order.

    Under spotjob-agent (``SPOTJOB_CONTROL_DIR`` set) every Checkpointer joins the agent's control
    channel, whatever constructor built it, and takes ``job`` (``SPOTJOB_JOB_NAME``) and
    ``attempt`` (``SPOTJOB_ATTEMPT``) from the environment when they are not passed;
    ``start_fresh`` defaults to ``SPOTJOB_START_FRESH=1``.

    ``start_fresh``: where ``restore`` would refuse (the newest checkpoint does not fit the state,
    or committed checkpoints exist and none loads) it returns 0 instead and *retires* the job's
    committed checkpoints, the refused ones and any older (``agent._fresh_start``): they are kept
    as they are, never restored, never counted or deleted by retention, and their folder names
    stay taken, so the new run's saves (whose steps start again from 0, below theirs) can never be
    mistaken for them. It has no effect when a checkpoint loads, so leaving it set across restarts
    never throws the new run's own progress away.
    """

    def __init__(
        self,
        uri: str,
        every_steps: int | None = None,
        keep: int | None = 3,
        *,
        every_seconds: float | None = None,
        async_save: bool = True,
        staging_dir: str | None = None,
        control_dir: str | None = None,
        job: str | None = None,
        attempt: int | None = None,
        start_fresh: bool | None = None,
        io_threads: int = 8,
        release_staging: bool = False,
    ) -> None:
        # Under an agent, the channel and the job's identity come from it, whatever the script passed.
        env = load(CheckpointerEnv)
        control_dir = control_dir or env.control_dir
        job = job if job is not None else env.job_name
        attempt = attempt if attempt is not None else env.attempt
        start_fresh = env.start_fresh if start_fresh is None else bool(start_fresh)
        self.config = CheckpointConfig(
            uri=uri,
            every_steps=every_steps,
            every_seconds=every_seconds,
            keep=keep,
            async_save=async_save,
            staging_dir=staging_dir,
            control_dir=control_dir,
            job=job,
            attempt=attempt,
            start_fresh=start_fresh,
            io_threads=io_threads,
            release_staging=release_staging,
        )
        self.storage = open_storage(uri)
        self._dist = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self._dist else 0
        self.world_size = dist.get_world_size() if self._dist else 1
        self._node_reporter = int(os.environ.get("LOCAL_RANK", self.rank)) == 0
        """This rank is its node's first (local rank 0): it writes the node's status.json and flush
        result, which that node's agent reads (its readiness, its step, its exit code). Every rank
        knows the same state and the commit's outcome, so each node's first rank can tell it."""
        self._staging_root = staging_dir or self._default_staging()
        # Before the groups: creating them waits for every rank, so no rank can start a save
        # while local rank 0 is still clearing the staging folder.
        self._clean_stale_staging()
        self._save_pg: Any = None
        self._ctl_pg: Any = None
        if self._dist:
            self._save_pg = dist.new_group(backend="gloo")
            self._ctl_pg = dist.new_group(backend="gloo")
        self._control = ControlDir(control_dir) if control_dir else None
        self._inflight: _Save | None = None
        self._last_saved_step: int | None = None
        self._last_step: int | None = None
        """The highest step seen by step(), save() or restore(): steps never go back."""
        self._last_save_started = time.monotonic()
        self.last_committed_step: int | None = None
        self.last_committed_uri: str | None = None
        self.last_save_seconds: float | None = None
        self.last_blocking_seconds: float | None = None
        self._flushed = False
        self._fenced: FencedSaveError | None = None
        self._stager: Any = None
        self._handled_save_mtime: int | None = None
        self._votes: list[tuple[Any, torch.Tensor]] = []
        self._status = RankStatus(state="starting", world_size=self.world_size, checkpoint_uri=self.storage.uri)
        self._status_written = 0.0
        self._checked_rank_bytes = False
        self._closed = False
        self._warn_if_not_the_agents_uri()
        try:
            self._claim()
        except BaseException:
            self._destroy_groups()
            raise
        self._report(force=True)

    @classmethod
    def from_env(cls, **overrides: Any) -> Checkpointer:
        """Build from the variables spotjob-agent sets (``agent.settings.CheckpointerEnv``); keyword
        arguments win over them."""
        env = load(CheckpointerEnv)
        uri = overrides.pop("uri", None) or env.checkpoint_uri
        if not uri:
            raise ValueError(
                f"no checkpoint URI: set {ENV_CHECKPOINT_URI} (spotjob-agent --checkpoint-uri does) or pass uri=..."
            )
        kwargs: dict[str, Any] = {
            "every_steps": env.every_steps,
            "every_seconds": env.every_seconds,
            "async_save": env.async_save,
            "staging_dir": env.staging_dir,
            "release_staging": env.release_staging,
        }
        if env.keep is not None:
            kwargs["keep"] = env.keep if env.keep > 0 else None
        kwargs.update(overrides)
        return cls(uri, **kwargs)

    # ------------------------------------------------------------------------------------------
    # the training-side API
    # ------------------------------------------------------------------------------------------
    def step(self, step: int, state: Mapping[str, Any], *, metadata: dict[str, Any] | None = None) -> bool:
        """Record that ``step`` steps are done; save per policy. True means "stop now".

        ``step`` must not be lower than the last step seen, and every rank must pass the same
        one (checked through the per-step vote: a difference raises ``ValueError`` on every rank
        at the next call, and before any file of a save is written).
        """
        step = self._check_next_step(step, "step()")
        metadata = _check_metadata(metadata, "step()")
        self._raise_if_failed()
        if self._flushed:
            return True
        vote = self._read_vote(step)
        if vote.flush:
            self._flush(step, state, metadata)
            return True
        due = vote.time_due or bool(self.config.every_steps and step % self.config.every_steps == 0)
        if vote.save_early:
            log.info("saving early at step %d: the agent asked for a checkpoint without stopping", step)
            self._consume_save_request()
        if (vote.save_early or due) and self._last_saved_step != step:
            # At most one save in flight: a policy save waits for the previous one. Deterministic
            # checkpoints every N steps are worth more than never blocking; a hung store is
            # bounded by the storage retries and, above them, the controller's flush timeout.
            self._start_save(step, state, metadata, trigger="early" if vote.save_early else "policy")
        self._last_step = step
        self._status.step = step
        if self._status.state == "starting":
            self._status.state = "training"
        # Launched after this step's save started: a deadline or request it just served is not
        # voted on again (one trigger, one save).
        self._launch_vote(step)
        self._report()
        return False

    def save(self, step: int, state: Mapping[str, Any], *, metadata: dict[str, Any] | None = None) -> None:
        """Save ``state`` as the checkpoint of ``step`` now (asynchronously unless configured not).

        Waits for a save still in flight first (at most one is in flight). ``step`` is a whole
        number not lower than the last step seen; ``metadata`` a dict of JSON values.
        """
        step = self._check_next_step(step, "save()")
        metadata = _check_metadata(metadata, "save()")
        self._start_save(step, state, metadata, trigger="save")
        self._last_step = step

    def wait(self) -> None:
        """Block until the save in flight (if any) is committed; raise if it failed."""
        save = self._inflight
        if save is None:
            return
        save.done.wait()
        if save.thread is not None:
            save.thread.join()
        self._inflight = None
        if save.error is not None:
            kind = type(save.error) if isinstance(save.error, SaveFailedError) else SaveFailedError
            error = kind(f"checkpoint of step {save.step} failed: {save.error}")
            if isinstance(error, FencedSaveError):
                self._fenced = error
            raise error from save.error

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
        """
        self._check_state(state)
        self._drain_votes()
        url = self.storage.url
        refs: list[CheckpointRef] = self._on_rank0("listing the checkpoints", lambda: find_checkpoints(self.storage))
        retired: set[str] = (
            self._on_rank0("reading the fresh-start records", lambda: _fresh_start.retired_folders(self.storage))
            if refs
            else set()
        )
        lineage: Lineage | None = None
        tried: list[tuple[CheckpointRef, str]] = []
        partially_loaded = False
        for ref in refs:
            if ref.folder in retired:
                if self.rank == 0:
                    log.info("restore: skipping %s: retired by a fresh start", url(ref.folder))
                continue

            def judge(ref: CheckpointRef = ref) -> tuple[str | None, str, bool]:
                """(rank 0) (the manifest if usable, why not, whether it is this job's own)."""
                nonlocal lineage
                lineage = lineage or Lineage.load(self.storage)
                status = inspect(self.storage, ref, lineage=lineage)
                if status.valid and status.manifest is not None:
                    return status.manifest.to_json().decode(), "", True
                return None, status.reason, status.committed and not (status.foreign or status.fenced)

            manifest_json, reason, ours = self._on_rank0(f"checking {url(ref.folder)}", judge)
            if manifest_json is None:
                if self.rank == 0:
                    log.warning("restore: skipping %s: %s", url(ref.folder), reason)
                if ours:
                    tried.append((ref, reason))
                continue
            manifest = Manifest.parse(manifest_json.encode())
            missing = sorted(set(state) - set(manifest.state_keys))
            if missing and not self.config.start_fresh:
                raise MissingStateKeysError(
                    f"checkpoint {url(ref.folder)} holds state keys {manifest.state_keys}; "
                    f"it lacks {missing}. Restore with the keys it was saved with, start fresh on purpose "
                    f"(Checkpointer(..., start_fresh=True) or {ENV_START_FRESH}=1), or use a new URI.",
                    [(url(ref.folder), f"lacks state keys {missing}")],
                )
            mismatch = (
                (_Failure.INCOMPATIBLE, f"incompatible with the state: it lacks state keys {missing}")
                if missing
                else self._agree_on_failure(self._incompatibility(manifest, state))
            )
            if mismatch is not None:
                tried.append((ref, mismatch[1]))
                break  # an older checkpoint would be going back in time on a changed model
            failure, loaded = self._try_load(ref, manifest, state)
            partially_loaded = partially_loaded or loaded
            if failure is None:
                self._restored(ref, manifest)
                return manifest.step
            kind, reason = failure
            if kind == _Failure.UNAVAILABLE:
                mixed = "; the state was partly loaded from it on some rank: do not train on from it" if loaded else ""
                raise self._unavailable(f"reading {url(ref.folder)}: {reason}{mixed}")
            tried.append((ref, reason))
            if kind == _Failure.INCOMPATIBLE:
                break  # the checkpoint is not at fault: an older one would be going back in time
        if not tried:
            if refs and self.rank == 0:
                log.info(
                    "restore: no committed checkpoint of this job under %s; starting from step 0", self.storage.uri
                )
            return 0
        return self._refuse_or_start_fresh(tried, partially_loaded)

    def close(self) -> None:
        """Wait for the save in flight, then release the process groups. Idempotent."""
        if self._closed:
            return
        try:
            self.wait()
        finally:
            self._drain_votes()
            self._closed = True
            # "closed" tells the agent this rank finished its work, so an abort at interpreter exit
            # is not a failure. Not while an exception propagates (close() in a finally or a with
            # block during a crash): that must stay a failure.
            if self._control is not None and not _exception_in_flight():
                self._control.mark_closed(self.rank)
                _take_back_closed_on_crash(self._control, self.rank)
            if self._status.state not in ("flushed", "flush-failed"):
                self._status.state = "closed"
            self._report(force=True)
            self._destroy_groups()
            if self._stager is not None:
                self._stager.close()  # frees the staging buffers kept between saves
                self._stager = None

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------------------------------
    # construction: the agent's URI, ownership
    # ------------------------------------------------------------------------------------------
    def _warn_if_not_the_agents_uri(self) -> None:
        """(rank 0) The controller watches the agent's URI for flush commits: a script writing
        elsewhere would flush where nobody looks."""
        agents = os.environ.get(ENV_CHECKPOINT_URI)
        if self._control is None or not agents or self.rank != 0:
            return
        try:
            differs = normalise_uri(agents) != normalise_uri(self.storage.uri)
        except ValueError:
            differs = True
        if differs:
            log.error(
                "this Checkpointer writes to %s but spotjob-agent watches %s (%s): flushes would be "
                "committed where the controller never looks. Pass the agent's URI, or use "
                "Checkpointer.from_env().",
                self.storage.uri,
                agents,
                ENV_CHECKPOINT_URI,
            )

    def _claim(self) -> None:
        """(rank 0, collective) Make this job the URI's owner, or fail on every rank."""
        outcome: tuple[str, str, str | None] = ("", "", None)
        if self.rank == 0:
            try:
                claim(self.storage, self.config.job)
                outcome = ("ok", "", None)
            except OwnershipError as e:
                outcome = ("owner", str(e), e.owner)
            except StorageError as e:
                outcome = ("storage", str(e), None)
        kind, message, owner = self._broadcast(outcome)
        if kind == "owner":
            raise CheckpointOwnershipError(message, uri=self.storage.uri, job=self.config.job, owner=owner)
        if kind == "storage":
            raise self._unavailable(f"claiming the URI for the job: {message}")

    def _unavailable(self, message: str) -> StorageUnavailableError:
        """The error for a store that still fails after its retries, reported to the agent."""
        error = StorageUnavailableError(
            f"the checkpoint store {self.storage.uri} is unavailable: {message}. Not falling back to an "
            "older checkpoint (that would re-train committed steps); retry when the store answers."
        )
        if self._control is not None:
            try:
                self._control.report_infra_error(self.rank, str(error))
            except OSError as e:
                log.debug("could not report the infrastructure error to the agent: %s", e)
        return error

    def _refuse_or_start_fresh(self, tried: list[tuple[CheckpointRef, str]], partially_loaded: bool) -> int:
        """Committed checkpoints exist and none can be used: raise, or (``start_fresh``) retire them."""
        url = self.storage.url
        listing = "\n".join(f"  {url(ref.folder)}: {reason}" for ref, reason in tried)
        if partially_loaded:
            raise RestoreRefusedError(
                f"restore refused: a checkpoint failed after part of it was loaded into the state, and no "
                f"older one loads:\n{listing}\nThe state now mixes checkpoint and initial values; nothing was "
                "deleted. Fix the cause, or re-create the model and optimizer before training from step 0.",
                [(url(r.folder), why) for r, why in tried],
            )
        if not self.config.start_fresh:
            raise RestoreRefusedError(
                f"restore refused: {len(tried)} committed checkpoint(s) under {self.storage.uri} tried, none can be "
                f"loaded into this state; the first failure: {tried[0][1]}\n{listing}\n"
                "Nothing was deleted and the state is unchanged. Restore with the model they were saved with; or "
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
                "retired — kept, never restored, never counted or deleted by retention. The first failure: %s",
                count,
                self.storage.uri,
                tried[0][1],
            )
        self._last_step = 0
        return 0

    def _restored(self, ref: CheckpointRef, manifest: Manifest) -> None:
        self.last_committed_step = manifest.step
        self.last_committed_uri = self.storage.url(ref.folder)
        self._last_saved_step = manifest.step
        self._last_step = manifest.step
        self._status.last_committed_step = manifest.step
        self._status.last_committed_uri = self.last_committed_uri
        self._status.step = manifest.step
        self._report(force=True)
        log.info(
            "restored step %d from %s (saved by %d ranks, restored on %d)",
            manifest.step,
            self.last_committed_uri,
            manifest.world_size,
            self.world_size,
        )

    # ------------------------------------------------------------------------------------------
    # the vote
    # ------------------------------------------------------------------------------------------
    def _check_next_step(self, step: Any, call: str) -> int:
        value = _check_step(step, call)
        if self._last_step is not None and value < self._last_step:
            raise ValueError(
                f"{call}: step {value} is lower than the last step ({self._last_step}); steps count completed "
                "training steps and never go back (a checkpoint of a lower step would sort below the newer ones)"
            )
        return value

    def _local_flags(self) -> list[int]:
        """[flush requested, save-early requested, every_seconds due]."""
        flush = save_early = 0
        if self._control is not None:
            flush = int(self._control.flush_requested())
            mtime = self._save_request_mtime()
            if mtime is not None and mtime != self._handled_save_mtime:
                save_early = 1
        time_due = int(
            self.config.every_seconds is not None
            and time.monotonic() - self._last_save_started >= self.config.every_seconds
        )
        return [flush, save_early, time_due]

    def _save_request_mtime(self) -> int | None:
        assert self._control is not None
        try:
            return os.stat(os.path.join(self._control.path, "save.json")).st_mtime_ns
        except FileNotFoundError:
            return None

    def _consume_save_request(self) -> None:
        """A save-early request is being served: this rank stops voting for it, and the node's
        first rank removes it, so the agent's next request is a new file (and a new save)."""
        if self._control is None:
            return
        self._handled_save_mtime = self._save_request_mtime() or self._handled_save_mtime
        if int(os.environ.get("LOCAL_RANK", self.rank)) == 0:
            self._control.clear_save_request()

    def _read_vote(self, step: int) -> _Vote:
        """What every rank agreed on at the previous step (this step's flags when alone)."""
        if not self._dist or self.world_size == 1:
            return _Vote.reduced([*self._local_flags(), step, -step])
        if not self._votes:
            return _Vote()
        work, buf = self._votes.pop(0)
        work.wait()
        vote = _Vote.reduced([int(v) for v in buf.tolist()])
        self._check_same_step(vote, "step()")
        return vote

    def _launch_vote(self, step: int) -> None:
        """Launch this step's vote; its result is read by the next ``step()``."""
        if not self._dist or self.world_size == 1:
            return
        buf = torch.tensor([*self._local_flags(), step, -step], dtype=torch.int64)
        work = dist.all_reduce(buf, op=dist.ReduceOp.MAX, group=self._ctl_pg, async_op=True)
        self._votes.append((work, buf))

    def _agree_on_step(self, step: int) -> None:
        """(every rank, before a save writes anything) Same step everywhere, or raise everywhere.

        Shaped like the per-step vote, so that a rank that skipped this save (it saw another
        step) pairs it with its next vote, and both sides see the difference.
        """
        if not self._dist or self.world_size == 1:
            return
        buf = torch.tensor([0, 0, 0, step, -step], dtype=torch.int64)
        dist.all_reduce(buf, op=dist.ReduceOp.MAX, group=self._ctl_pg)
        self._check_same_step(_Vote.reduced([int(v) for v in buf.tolist()]), "save")

    def _check_same_step(self, vote: _Vote, call: str) -> None:
        if vote.lowest_step != vote.highest_step:
            self._drain_votes()
            raise ValueError(
                f"{call}: the ranks passed different steps to the same call (lowest {vote.lowest_step}, highest "
                f"{vote.highest_step}); every rank must count completed steps the same way"
            )

    def _drain_votes(self) -> None:
        while self._votes:
            work, _ = self._votes.pop(0)
            work.wait()

    def _flush(self, step: int, state: Mapping[str, Any], metadata: dict[str, Any]) -> None:
        request = self._control.flush_request() if self._control is not None else None
        reason = request.reason if request else "a peer rank's notice"
        log.warning("flush: %s; committing step %d on all %d ranks", reason, step, self.world_size)
        self._status.state = "flushing"
        self._status.step = step
        self._report(force=True)
        if request and request.deadline and self.last_save_seconds:
            left = request.deadline - time.time()
            if left < self.last_save_seconds:
                log.warning(
                    "flush: %.1fs left before the deadline but the last save took %.1fs; trying anyway "
                    "(an unfinished save leaves no manifest, so restore cannot mistake it for a checkpoint)",
                    left,
                    self.last_save_seconds,
                )
        try:
            inflight = self._inflight
            if inflight is not None and inflight.step == step:
                inflight.flush = request
                inflight.trigger = "flush"  # read by the commit, which has not happened yet or is this flush
                self.wait()
            else:
                self._supersede(inflight)
                # The loop stops after this save anyway: write straight from the live tensors
                # instead of staging a copy first (saves a full memcpy of the state).
                self._start_save(step, state, metadata, flush=request, blocking=True)
                self.wait()
        except SaveFailedError as e:
            self._status.state = "flush-failed"
            self._report(force=True)
            if self._control is not None and self._node_reporter:
                self._control.write_flush_result(
                    FlushResult(
                        step=None,
                        uri=None,
                        request_id=request.id if request else None,
                        notice_to_commit_seconds=None,
                        error=str(e),
                    )
                )
            if isinstance(e, FencedSaveError):
                raise
            raise FlushFailedError(f"flush at step {step} could not commit: {e}") from e
        self._flushed = True
        self._last_step = step
        self._status.state = "flushed"
        self._report(force=True)
        if self._control is not None and self._node_reporter:
            latency = time.time() - request.requested_at if request else None
            self._control.write_flush_result(
                FlushResult(
                    step=step,
                    uri=self.last_committed_uri,
                    request_id=request.id if request else None,
                    notice_to_commit_seconds=latency,
                )
            )
            log.warning(
                "flush: step %d committed at %s%s",
                step,
                self.last_committed_uri,
                f", {latency:.2f}s after the notice" if latency is not None else "",
            )
        # Only now, with the commit reported: retention must not stand between a flush and the
        # controller that is waiting for it.
        if self.rank == 0 and self.last_committed_uri is not None:
            self._retain(CheckpointRef.parse(self.last_committed_uri.rsplit("/", 1)[-1]) or CheckpointRef(step))

    def _supersede(self, inflight: _Save | None) -> None:
        """(every rank, at the flush's step) Give up the save in flight, if it is still writing.

        It holds an older step than the flush is about to commit, and the disk cannot write both
        in the time the notice leaves: waiting for it would about double the time to the flush's
        commit. Every rank stops writing at its next block; the save then fails on every rank
        alike (DCP gathers the failure) and commits nothing; the previous commit stays the newest
        until the flush's. A save whose writing was already done goes on to its commit.
        """
        if inflight is None:
            return
        if not inflight.done.is_set():
            inflight.cancel.set()
        try:
            self.wait()
        except FencedSaveError:
            raise
        except SaveFailedError as e:
            if not inflight.cancel.is_set():
                raise
            log.info("flush: the save of step %d in flight was given up for the flush (%s)", inflight.step, e)

    # ------------------------------------------------------------------------------------------
    # saving
    # ------------------------------------------------------------------------------------------
    def _start_save(
        self,
        step: int,
        state: Mapping[str, Any],
        metadata: dict[str, Any],
        flush: FlushRequest | None = None,
        blocking: bool = False,
        trigger: str = "save",
    ) -> None:
        self._raise_if_failed()
        self.wait()  # at most one save in flight
        self._check_state(state)
        self._agree_on_step(step)
        started = time.monotonic()
        self._last_save_started = started
        dcp_state, objects = self._split_state(state)
        rank_bytes = _rank_state.encode(
            {
                "step": step,
                "rank": self.rank,
                "world_size": self.world_size,
                "objects": objects,
                "rng": _rank_state.capture_rng(),
            }
        )
        if not self._checked_rank_bytes:
            self._check_rank_bytes(rank_bytes)
        local_dir = os.path.join(self._staging_root, f"step-{step:09d}-{uuid.uuid4().hex[:8]}", f"rank-{self.rank}")
        os.makedirs(local_dir, exist_ok=True)
        save = _Save(
            step=step,
            started=started,
            local_dir=local_dir,
            metadata=metadata,
            state_keys=list(state.keys()),
            rank_bytes=rank_bytes,
            flush=flush,
            trigger="flush" if flush is not None or blocking else trigger,
        )
        background = self.config.async_save and not blocking
        if dcp_state:
            save.writer = make_writer(local_dir, durable=self.storage.local_path("") is not None, cancel=save.cancel)
            if background:
                if self._stager is None:
                    self._stager = make_stager()
                staged = self._stager.stage(dcp_state)
                save.staged = staged.result() if hasattr(staged, "result") else staged
                if getattr(self._stager, "should_synchronize_after_execute", False):
                    self._stager.synchronize_staging()
            else:
                save.staged = dcp_state  # written below, from the live tensors
        self.last_blocking_seconds = time.monotonic() - started
        self._last_saved_step = step
        self._inflight = save
        self._status.state = "saving" if self._status.state != "flushing" else "flushing"
        if background:
            save.thread = threading.Thread(target=self._finish_save, args=(save,), name="spotjob-save", daemon=False)
            save.thread.start()
        else:
            self._finish_save(save)
            self.wait()  # a synchronous save reports its failure from the call that made it

    def _finish_save(self, save: _Save) -> None:
        """(every rank, background) write, upload, then (rank 0) commit. Always runs every collective.

        Whatever happens, ``save.done`` is set: a save thread that died without it would leave
        ``wait()`` (and ``close()``) blocked forever and the failure unreported.
        """
        try:
            self._write_upload_commit(save)
        except BaseException as e:
            if save.committed_uri is None and save.error is None:
                save.error = SaveFailedError(f"rank {self.rank}: the save stopped unexpectedly: {e!r}")
                log.error("checkpoint of step %d failed, nothing committed", save.step, exc_info=e)
            elif save.committed_uri is not None:
                log.warning("after committing step %d: %r", save.step, e, exc_info=e)
            shutil.rmtree(save.local_dir, ignore_errors=True)
        finally:
            save.staged = None  # the staged tensors are the stager's to reuse
            if self.config.release_staging and self._stager is not None:
                # The next save waits for this one before it stages, so nothing else uses the stager.
                self._stager.close()
                self._stager = None
            save.done.set()

    def _write_upload_commit(self, save: _Save) -> None:
        files: list[tuple[str, int, str]] = []
        error: str | None = None
        # Whether the failure is the infrastructure's (the store, this node's disk), not the
        # user's code: the agent then exits 74 and the controller retries without spending the
        # restart budget.
        infra = False
        # (rank 0) Naming the checkpoint folder takes a few round trips to the store (the fence, a
        # listing); they run while the shards are written, not after.
        naming: Future[str] | None = None
        if self.rank == 0:
            naming = Future()
            threading.Thread(
                target=_run_into, args=(naming, self._target_folder, save.step), name="spotjob-name", daemon=True
            ).start()
        try:
            written: dict[str, tuple[int, int]] = {}
            if save.staged is not None:
                dcp_save(save.staged, save.writer, process_group=self._save_pg, no_dist=not self._dist)
                written.update(save.writer.written)
            name = _rank_state.rank_file_name(self.rank)
            with ChecksummedFile(os.path.join(save.local_dir, name)) as f:
                f.write(save.rank_bytes)
            written[name] = (f.crc, f.size)
            if save.writer is not None and save.writer.durable:
                # One wait for the disk, for every file of this rank, after the last is written.
                sync_files([os.path.join(save.local_dir, n) for n in written], self.config.io_threads)
            files = [(n, size, to_hex(crc)) for n, (crc, size) in sorted(written.items())]
        except BaseException as e:  # reported to every rank below, never swallowed
            error = f"rank {self.rank}: writing the shards failed: {e!r}"
            infra = _is_infrastructure(e)
        target: tuple[str | None, str | None] = (None, None)  # (folder, why this attempt is fenced)
        if naming is not None:
            try:
                target = (naming.result(), None)
            except FencedError as e:
                target = (None, str(e))
            except (StorageError, OSError) as e:
                if error is None:
                    error, infra = f"rank 0: cannot prepare the checkpoint folder: {e}", _is_infrastructure(e)
        folder, fenced = self._broadcast(target, group=self._save_pg)
        if error is None and folder is not None:
            try:
                put_files(
                    self.storage,
                    [(os.path.join(save.local_dir, n), f"{folder}/{n}", int(c, 16)) for n, _, c in files],
                    parallelism=self.config.io_threads,
                )
            except BaseException as e:
                error, infra = f"rank {self.rank}: upload failed: {e!r}", _is_infrastructure(e)
        elif error is None and fenced is None:
            error = "rank 0 could not name the checkpoint folder"
        gathered = self._all_gather((files, error, infra), group=self._save_pg)
        outcome: tuple[str | None, str | None, bool, bool] = (None, fenced, fenced is not None, False)
        if self.rank == 0 and fenced is None:
            errors = [e for _, e, _ in gathered if e]
            if errors:
                outcome = (None, "; ".join(errors), False, any(i for _, _, i in gathered))
            else:
                try:
                    commit_files = [f for fs, _, _ in gathered for f in fs]
                    outcome = (self._commit(save, folder or "", commit_files), None, False, False)
                except FencedError as e:
                    outcome = (None, str(e), True, False)
                except BaseException as e:
                    outcome = (None, f"rank 0: commit failed: {e!r}", False, _is_infrastructure(e))
        uri, failure, was_fenced, infra_failure = self._broadcast(outcome, group=self._save_pg)
        seconds = time.monotonic() - save.started
        if failure is None and uri is not None:
            save.committed_uri = uri
            self.last_committed_step = save.step
            self.last_committed_uri = uri
            self.last_save_seconds = seconds
            self._status.last_committed_step = save.step
            self._status.last_committed_uri = uri
            self._status.last_save_seconds = seconds
            self._status.commits += 1
            if self._status.state == "saving":
                self._status.state = "training"
            if self.rank == 0:
                log.info("committed step %d at %s in %.2fs", save.step, uri, seconds)
                if save.trigger != "flush":  # a flush reports its commit first, then retains
                    self._retain(CheckpointRef.parse(uri.rsplit("/", 1)[-1]) or CheckpointRef(save.step))
        elif was_fenced:
            save.error = FencedSaveError(
                f"nothing committed or deleted: {failure}. This worker belongs to a superseded attempt "
                f"({self.config.attempt}) of {self.config.job!r} and must stop"
            )
            log.error("checkpoint of step %d not committed: %s", save.step, failure)
        elif save.cancel.is_set():
            save.error = SaveFailedError(f"given up for a flush: {failure}")
            log.info("checkpoint of step %d given up for a flush, nothing committed", save.step)
        else:
            save.error = SaveFailedError(failure or "unknown failure")
            log.error("checkpoint of step %d failed, nothing committed: %s", save.step, failure)
            if infra_failure and self._control is not None:
                # If the script lets this error end it, the agent reports an infrastructure error.
                try:
                    self._control.report_infra_error(
                        self.rank, f"the checkpoint of step {save.step} failed on {self.storage.uri}: {failure}"
                    )
                except OSError as e:
                    log.debug("could not report the infrastructure error to the agent: %s", e)
        shutil.rmtree(save.local_dir, ignore_errors=True)
        try:
            os.rmdir(os.path.dirname(save.local_dir))  # the last rank of the node out removes it
        except OSError:
            pass
        self._report(force=True)
        save.done.set()

    def _check_fence(self) -> None:
        """(rank 0) Before every commit and every delete: this attempt may still write here."""
        check_not_fenced(self.storage, self.config.job, self.config.attempt)

    def _target_folder(self, step: int) -> str:
        """(rank 0) The folder this step's save goes to; clears an uncommitted leftover there.

        Raises ``FencedError`` (before anything is written) when this attempt is superseded.
        """
        self._check_fence()
        suffix = 0
        for ref in find_checkpoints(self.storage):
            if ref.step != step:
                continue
            if self.storage.stat(ref.key(MANIFEST_NAME)) is not None:
                suffix = max(suffix, ref.attempt + 1)
            else:
                log.info("removing leftover of an unfinished save in %s", self.storage.url(ref.folder))
                self._check_fence()
                self.storage.delete_prefix(ref.folder + "/")
        return CheckpointRef(step, suffix).folder

    def _commit(self, save: _Save, folder: str, files: list[tuple[str, int, str]]) -> str:
        """(rank 0) Write MANIFEST.json, create-only, unless fenced. Returns the committed folder's URI."""
        metadata_path = os.path.join(save.local_dir, DCP_METADATA_NAME)
        tensors = {}
        if save.writer is not None and save.writer.metadata is not None:
            tensors = tensor_index(save.writer.metadata)  # as written, without reading it back
        elif os.path.exists(metadata_path):
            with open(metadata_path, "rb") as f:
                tensors = tensor_index(load_dcp_metadata(f.read()))
        manifest = Manifest(
            step=save.step,
            world_size=self.world_size,
            created_at=now_utc(),
            torch_version=torch.__version__,
            job=self.config.job,
            attempt=self.config.attempt,
            state_keys=save.state_keys,
            files=sorted((FileEntry(path=n, size=s, crc32c=c) for n, s, c in files), key=lambda f: f.path),
            tensors=tensors,
            metadata=save.metadata,
            trigger=save.trigger,
        )
        data = manifest.to_json()
        self._check_fence()
        try:
            self.storage.put_bytes_if_absent(f"{folder}/{MANIFEST_NAME}", data)
        except AlreadyExistsError:
            raise SaveFailedError(
                f"{self.storage.url(folder)} was committed by someone else meanwhile; "
                "is another job writing to the same URI?"
            ) from None
        return self.storage.url(folder)

    def _retain(self, committed: CheckpointRef) -> None:
        """(rank 0) Keep the newest ``keep`` valid committed checkpoints; remove old leftovers.

        Never touches anything newer than the checkpoint just committed, nor another job's, a
        superseded attempt's or a retired checkpoint (they are not counted either). Checks the
        fence before every delete. A failed delete is a warning, never a failed save.
        """
        url = self.storage.url
        try:
            retired = _fresh_start.retired_folders(self.storage)
            older = [r for r in find_checkpoints(self.storage) if r < committed and r.folder not in retired]
            lineage = Lineage.load(self.storage)
            doomed: list[CheckpointRef] = []
            kept = 0
            for ref in older:  # newest first
                status = inspect(self.storage, ref, lineage=lineage)
                if not status.committed:
                    doomed.append(ref)  # a save that never finished
                    continue
                if status.foreign or status.fenced:
                    continue  # not this job's history: never counted, never deleted
                if self.config.keep is None:
                    continue
                # Only valid checkpoints count towards ``keep``: a refused one kept in place of a
                # valid one would leave fewer to fall back to than asked for. Broken folders newer
                # than the oldest one kept stay (for a post-mortem); older ones go with the rest.
                if kept >= self.config.keep - 1:
                    doomed.append(ref)
                elif status.valid:
                    kept += 1
            for ref in doomed:
                self._check_fence()
                # Manifest first: a half-deleted folder then reads as uncommitted, not as broken.
                self.storage.delete([ref.key(MANIFEST_NAME)])
                self.storage.delete_prefix(ref.folder + "/")
                log.info("retention: removed %s", url(ref.folder))
        except FencedError as e:
            log.error("retention: deleting nothing: %s", e)
        except (StorageError, OwnershipError, OSError) as e:
            log.warning("retention: could not remove old checkpoints (will retry next save): %s", e)

    # ------------------------------------------------------------------------------------------
    # restoring
    # ------------------------------------------------------------------------------------------
    def _incompatibility(self, manifest: Manifest, state: Mapping[str, Any]) -> tuple[str, str] | None:
        """Why the checkpoint's tensors cannot go into the modules of ``state`` (changed shapes,
        tensors added or removed), from the manifest alone — before anything is read or loaded."""
        modules, _, _ = self._classify(state)
        if not modules or not manifest.tensors:
            return None
        try:
            model_state = get_model_state_dict(_ModuleBag(modules))
        except Exception as e:  # reported to every rank, never raised on one alone
            return _Failure.INCOMPATIBLE, f"the model's state cannot be read on rank {self.rank}: {e!r}"
        current = {k: v for k, v in model_state.items() if isinstance(v, torch.Tensor)}
        problems = []
        for fqn, tensor in current.items():
            entry = manifest.tensors.get(fqn)
            if entry is None:
                problems.append(f"{fqn}: the model has it, the checkpoint does not")
            elif list(entry.shape) != list(tensor.shape):
                problems.append(
                    f"{fqn}: the checkpoint holds shape {list(entry.shape)}, the model {list(tensor.shape)}"
                )
        prefixes = tuple(f"{key}." for key in modules)
        for fqn in manifest.tensors:
            if fqn.startswith(prefixes) and fqn not in current:
                problems.append(f"{fqn}: the checkpoint holds it, the model does not")
        if not problems:
            return None
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        return _Failure.INCOMPATIBLE, f"incompatible with the model: {problems[0]}{more}"

    def _try_load(
        self, ref: CheckpointRef, manifest: Manifest, state: Mapping[str, Any]
    ) -> tuple[tuple[str, str] | None, bool]:
        """Load one checkpoint on every rank. Returns (the agreed failure or None, anything was loaded)."""
        local_dir = self.storage.local_path(ref.folder)
        cache = None
        if local_dir is None:
            cache = os.path.join(self._staging_root, RESTORE_FOLDER, ref.folder)
            local_dir = cache
        reader = VerifiedReader(self.storage, ref.folder, manifest, local_dir, self.config.io_threads)
        failure: tuple[str, str] | None = None
        rank_payload: dict[str, Any] | None = None
        # Phase 1: DCP's metadata and the per-rank state, verified but not yet applied. Reading
        # the metadata here (the reader caches it) turns a corrupt or crafted .metadata into one
        # clear reason instead of DCP's retries and tracebacks.
        try:
            if manifest.file(DCP_METADATA_NAME) is not None:
                reader.read_metadata()
            src = _rank_state.source_rank(self.rank, manifest.world_size)
            path = reader.ensure_local(_rank_state.rank_file_name(src))
            with open(path, "rb") as f:
                rank_payload = _rank_state.decode(f.read())
        except Exception as e:
            failure = self._load_failure(ref, e)
        failure = self._agree_on_failure(failure)
        if failure is not None:
            self._cleanup_cache(cache)
            return failure, False
        # Phase 2: modules and optimizers through DCP (each file verified before it is read).
        dcp_state: dict[str, Any] = {}
        try:
            dcp_state = self._load_dcp(reader, state)
        except (Exception, CheckpointException) as e:  # DCP's own is a BaseException
            failure = self._load_failure(ref, e)
        failure = self._agree_on_failure(failure)
        if failure is not None:
            self._cleanup_cache(cache)
            # Did any rank's live state change before the failure? Then none may carry on from it.
            return failure, not self._all_ok(not reader.data_read_started)
        try:
            self._apply(state, dcp_state, rank_payload or {}, manifest)
        except Exception as e:
            failure = (_Failure.INCOMPATIBLE, f"incompatible with this state on rank {self.rank}: {e!r}")
        failure = self._agree_on_failure(failure)
        self._cleanup_cache(cache)
        return failure, failure is not None

    def _load_dcp(self, reader: VerifiedReader, state: Mapping[str, Any]) -> dict[str, Any]:
        """Load modules (in place) and optimizer state; returns the state dicts to apply.

        For plain and DDP modules the optimizer state is rebuilt from the checkpoint's metadata
        and handed to the optimizer directly: DCP's generic path first initialises a fresh
        optimizer with a zero-gradient step, which costs as much as a training step over every
        parameter. Sharded (DTensor/FSDP) modules take the generic path, which reshards.
        """
        modules, optims, _ = self._classify(state)
        if not modules:
            return {}
        bag = _ModuleBag(modules)
        no_dist = not self._dist
        if not _plain_modules(bag):
            dcp_state, _ = self._split_state(state)
            dcp_load(dcp_state, reader, SafeLoadPlanner(), process_group=self._ctl_pg, no_dist=no_dist)
            return dcp_state
        dcp_state = dict(get_model_state_dict(bag))
        dcp_load(dcp_state, reader, SafeLoadPlanner(), process_group=self._ctl_pg, no_dist=no_dist)
        if optims:
            # An empty target is filled from the checkpoint's metadata, as dcp_to_torch_save does.
            saved: dict[str, Any] = {}
            dcp_load(saved, reader, SafeEmptyLoadPlanner(keys=set(optims)), process_group=self._ctl_pg, no_dist=no_dist)
            missing = sorted(set(optims) - set(saved))
            if missing:
                raise MissingStateKeysError(f"the checkpoint holds no optimizer state for {missing}")
            dcp_state.update({key: _DirectOptimState(saved[key]) for key in optims})
        return dcp_state

    def _load_failure(self, ref: CheckpointRef, e: BaseException) -> tuple[str, str]:
        """Classify a failure to load ``ref`` on this rank (see ``_Failure``) and say what it was."""
        if isinstance(e, CheckpointException) and e.failures:
            # DCP wraps every rank's failure; the first one says what went wrong.
            e = next(iter(e.failures.values()))[0]
        if isinstance(e, _PROVEN_BAD):
            if isinstance(e, CorruptObjectError):
                what = "corrupt"
            elif isinstance(e, NotFoundError):
                what = "missing a file"
            elif isinstance(e, UnsafeCheckpointError | _rank_state.RefusedPickleError):
                what = "unsafe"
            else:
                what = "unreadable"
            kind, msg = _Failure.BAD, f"{what} on rank {self.rank}: {e}"
        elif isinstance(e, StorageError | OSError):
            # A store that kept failing (or a local disk) proves nothing about the checkpoint.
            kind, msg = _Failure.UNAVAILABLE, f"rank {self.rank}: {e}"
        elif isinstance(e, MissingStateKeysError) or _is_shape_or_key_mismatch(e):
            kind, msg = _Failure.INCOMPATIBLE, f"incompatible with the model on rank {self.rank}: {e}"
        else:
            # Verified bytes that still fail to load: not proven bad, so never skipped for an
            # older checkpoint (that would go back in time); refused with the error instead.
            kind, msg = _Failure.INCOMPATIBLE, f"cannot be loaded on rank {self.rank}: {type(e).__name__}: {e}"
            log.debug("restore failure detail", exc_info=e)
        if kind == _Failure.BAD:
            log.warning("restore: skipping %s: it is %s", self.storage.url(ref.folder), msg)
        else:
            log.warning("restore: %s: %s", self.storage.url(ref.folder), msg)
        return kind, msg

    def _agree_on_failure(self, failure: tuple[str, str] | None) -> tuple[str, str] | None:
        """Every rank's failure (or None), gathered: the worst one, identical on every rank."""
        failures = [f for f in self._all_gather(failure, self._ctl_pg) if f is not None]
        if not failures:
            return None
        return min(failures, key=lambda f: _Failure.SEVERITY.index(f[0]))

    def _apply(
        self, state: Mapping[str, Any], dcp_state: dict[str, Any], payload: dict[str, Any], manifest: Manifest
    ) -> None:
        modules, optims, others = self._classify(state)
        bag = _ModuleBag(modules)
        model_state = {k: v for k, v in dcp_state.items() if k not in optims}
        if modules and not _loaded_in_place(bag, model_state):
            set_model_state_dict(bag, model_state)
        for key, opt in optims.items():
            if isinstance(dcp_state[key], _DirectOptimState):
                _load_optimizer_directly(bag, opt, dcp_state[key].state)
            else:
                set_optimizer_state_dict(bag, opt, dcp_state[key])
        objects = payload.get("objects", {})
        for key, obj in others.items():
            obj.load_state_dict(objects[key])
        if self.rank < manifest.world_size:
            _rank_state.restore_rng(payload["rng"])
        else:
            log.info(
                "rank %d did not exist in the saved world of %d ranks: keeping its own RNG streams",
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

    # ------------------------------------------------------------------------------------------
    # state handling
    # ------------------------------------------------------------------------------------------
    @staticmethod
    def _classify(
        state: Mapping[str, Any],
    ) -> tuple[dict[str, nn.Module], dict[str, torch.optim.Optimizer], dict[str, Any]]:
        modules = {k: v for k, v in state.items() if isinstance(v, nn.Module)}
        optims = {k: v for k, v in state.items() if isinstance(v, torch.optim.Optimizer)}
        others = {k: v for k, v in state.items() if k not in modules and k not in optims}
        return modules, optims, others

    def _check_state(self, state: Mapping[str, Any]) -> None:
        if not state:
            raise ValueError("state is empty: pass e.g. {'model': model, 'optim': optimizer}")
        for key, value in state.items():
            if not isinstance(key, str) or not key or "." in key or "/" in key:
                raise ValueError(f"state key {key!r} must be a non-empty string without '.' or '/'")
            if key.startswith("__"):
                raise ValueError(f"state key {key!r} is reserved (keys starting with '__')")
            if not isinstance(value, nn.Module | torch.optim.Optimizer) and not (
                callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None))
            ):
                raise TypeError(
                    f"state[{key!r}] is a {type(value).__name__}; values must be modules, optimizers, "
                    "or objects with state_dict()/load_state_dict()"
                )

    def _split_state(self, state: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        """DCP state (modules + optimizers, resharded on load) and per-rank plain objects."""
        modules, optims, others = self._classify(state)
        dcp_state: dict[str, Any] = {}
        if modules:
            bag = _ModuleBag(modules)
            dcp_state.update(get_model_state_dict(bag))
            for key, opt in optims.items():
                dcp_state[key] = get_optimizer_state_dict(bag, opt)
        elif optims:
            raise ValueError("optimizers need their modules in the same state dict to be saved by name")
        objects = {key: obj.state_dict() for key, obj in others.items()}
        return dcp_state, objects

    def _check_rank_bytes(self, data: bytes) -> None:
        try:
            _rank_state.decode(data)
        except Exception as e:
            raise TypeError(
                "a state_dict() in the per-rank state holds something that cannot be restored safely "
                f"(weights_only loading): {e}. Convert it to tensors and plain Python values."
            ) from None
        self._checked_rank_bytes = True

    # ------------------------------------------------------------------------------------------
    # plumbing
    # ------------------------------------------------------------------------------------------
    def _raise_if_failed(self) -> None:
        if self._fenced is not None:
            raise self._fenced
        save = self._inflight
        if save is not None and save.done.is_set() and save.error is not None:
            self.wait()

    def _on_rank0(self, what: str, fn: Callable[[], T]) -> T:
        """(collective) Run ``fn`` on rank 0 and hand every rank its result, or its failure: a
        storage failure as ``StorageUnavailableError``, anything else as ``RestoreError``."""
        payload: tuple[str, Any] = ("", None)
        if self.rank == 0:
            try:
                payload = ("ok", fn())
            except StorageError as e:
                payload = ("storage", f"{what}: {e}")
            except Exception as e:
                log.debug("%s failed", what, exc_info=e)
                payload = ("error", f"{what}: {type(e).__name__}: {e}")
        kind, value = self._broadcast(payload)
        if kind == "storage":
            raise self._unavailable(value)
        if kind == "error":
            raise RestoreError(value)
        return value

    def _destroy_groups(self) -> None:
        for pg in (self._save_pg, self._ctl_pg):
            if pg is not None:
                try:
                    dist.destroy_process_group(pg)
                except Exception as e:  # a torn-down default group already took it
                    log.debug("destroying a checkpoint process group: %s", e)
        self._save_pg = self._ctl_pg = None

    def _clean_stale_staging(self) -> None:
        """(local rank 0, at construction) Remove what killed saves and restores left staged.

        No save of this job can be in flight yet, so every ``step-*`` folder there is garbage —
        on a filesystem store a full copy of a rank's shards beside the checkpoints.
        """
        if int(os.environ.get("LOCAL_RANK", self.rank)) != 0:
            return
        try:
            entries = list(os.scandir(self._staging_root))
        except FileNotFoundError:
            return
        # ``restore/`` stays: spotjob-agent may be filling it for this very restore
        # (``agent.restore_cache.prefetch``); a restore clears it once it has loaded.
        for entry in entries:
            if entry.is_dir() and entry.name.startswith("step-"):
                log.info("removing a stale staging folder left by an interrupted save: %s", entry.path)
                shutil.rmtree(entry.path, ignore_errors=True)

    def _default_staging(self) -> str:
        return default_staging(self.storage, self.config.job)

    def _broadcast(self, obj: Any, group: Any = None) -> Any:
        if not self._dist:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=group if group is not None else self._ctl_pg)
        return box[0]

    def _all_gather(self, obj: Any, group: Any) -> list[Any]:
        if not self._dist:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=group)
        return out

    def _all_ok(self, ok: bool) -> bool:
        if not self._dist:
            return ok
        flag = torch.tensor([0 if ok else 1], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._ctl_pg)
        return int(flag.item()) == 0

    def _report(self, force: bool = False) -> None:
        """(each node's local rank 0) Write the node's ``status.json`` for its agent (at most every
        second unless forced): every agent serves /readyz and /status from its own node's file."""
        if self._control is None or not self._node_reporter:
            return
        now = time.monotonic()
        if not force and now - self._status_written < _STATUS_INTERVAL_S:
            return
        self._status_written = now
        try:
            self._control.write_status(self._status)
        except OSError as e:
            log.debug("could not write status for the agent: %s", e)
