"""Checkpointer: sharded, resumable, asynchronous checkpoints committed by a manifest written last.

What the training script calls, in order (every rank calls every method):

1. ``Checkpointer(uri, ...)`` or ``Checkpointer.from_env()`` — creates two gloo groups of its own
   (a collective: all ranks construct it in the same order). One carries the background save
   (DCP's async save must not share a group with training collectives, or they deadlock); the
   other carries the per-step flush vote and restore.
2. ``restore(state)`` — loads the newest valid checkpoint in place, returns its step (0 if none).
3. ``step(n, state)`` per step — saves per policy; returns True when the job must stop now (a
   preemption flush committed).
4. ``close()`` — waits for the save in flight.

One save, from the training loop's point of view: ``state`` is turned into DCP state dicts
(modules and optimizers, which reshard) and per-rank bytes (everything else and the RNG streams);
DCP stages the tensors to CPU memory and returns — the only time the loop is blocked. In a
background thread each rank then waits for DCP's local write, CRC32Cs and uploads its own files;
rank 0 gathers every rank's file list, writes MANIFEST.json create-only and tells every rank the
outcome. At most one save is in flight; a failed one raises on the next call.

The flush: the agent drops ``flush.json`` in the control folder. Each rank looks for it with one
``stat`` per step and votes through an asynchronous all-reduce on the control group; the result
of the vote launched at step k is read at step k+1, so every rank sees it at the same step
without the loop ever waiting on the network. That step is saved, committed and reported, and
``step()`` returns True everywhere.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import tempfile
import threading
import time
import uuid
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from agent import _rank_state
from agent._dcp import (
    SafeEmptyLoadPlanner,
    SafeLoadPlanner,
    UnsafeCheckpointError,
    VerifiedReader,
    make_stager,
    make_writer,
    tensor_index,
)
from agent.catalog import CheckpointRef, find_checkpoints, inspect
from agent.control_channel import (
    ENV_ASYNC,
    ENV_CHECKPOINT_URI,
    ENV_CONTROL_DIR,
    ENV_EVERY_SECONDS,
    ENV_EVERY_STEPS,
    ENV_JOB_NAME,
    ENV_KEEP,
    ENV_STAGING_DIR,
    ControlDir,
    FlushRequest,
    FlushResult,
    RankStatus,
)
from agent.crc32c import crc32c_bytes, crc32c_file, to_hex
from agent.manifest import DCP_METADATA_NAME, MANIFEST_NAME, FileEntry, Manifest, ManifestError, now_utc
from agent.storage import AlreadyExistsError, StorageError, open_storage, put_files

log = logging.getLogger(__name__)

# Single-process use (no process group) is intended here, not a mistake worth a warning per save.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")

_STATUS_INTERVAL_S = 1.0


class CheckpointError(Exception):
    """Base of the errors the Checkpointer raises."""


class SaveFailedError(CheckpointError):
    """A background save failed; nothing was committed for its step."""


class FlushFailedError(SaveFailedError):
    """A preemption flush could not commit a checkpoint."""


class MissingStateKeysError(CheckpointError):
    """``restore`` was handed state keys the checkpoint does not hold."""


class RestoreError(CheckpointError):
    """Restore could not leave the job in a consistent state."""


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
    """Job name, recorded in manifests and logs."""
    io_threads: int = 8
    """Parallel transfers per rank."""

    def __post_init__(self) -> None:
        if self.every_steps is not None and self.every_steps < 1:
            raise ValueError(f"every_steps must be >= 1 (or None to disable), got {self.every_steps}")
        if self.every_seconds is not None and self.every_seconds <= 0:
            raise ValueError(f"every_seconds must be > 0 (or None to disable), got {self.every_seconds}")
        if self.keep is not None and self.keep < 1:
            raise ValueError(f"keep must be >= 1 (or None to keep everything), got {self.keep}")
        if self.io_threads < 1:
            raise ValueError(f"io_threads must be >= 1, got {self.io_threads}")


@dataclass
class _Save:
    """One save in flight."""

    step: int
    started: float
    local_dir: str
    metadata: dict[str, Any]
    state_keys: list[str]
    rank_bytes: bytes
    future: Any = None
    flush: FlushRequest | None = None
    trigger: str = "save"
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None
    committed_uri: str | None = None
    thread: threading.Thread | None = None


# torch.save's zip records carry a CRC-32 that costs about two thirds of a DCP write here
# (bench/README.md). spotjob's files are covered by the manifest's CRC32C, so the zip CRC is
# switched off while spotjob's own writes run and put back after; torch.load reads either.
_crc32_lock = threading.Lock()
_crc32_writers = 0
_crc32_saved = True


def _crc32_window_open() -> None:
    global _crc32_writers, _crc32_saved
    with _crc32_lock:
        if _crc32_writers == 0:
            _crc32_saved = torch.serialization.get_crc32_options()
            torch.serialization.set_crc32_options(False)
        _crc32_writers += 1


def _crc32_window_close() -> None:
    global _crc32_writers
    with _crc32_lock:
        _crc32_writers -= 1
        if _crc32_writers == 0:
            torch.serialization.set_crc32_options(_crc32_saved)


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
    flush: bool
    save_early: bool
    time_due: bool


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


class _ModuleBag(nn.Module):
    """Holds the job's modules under their state keys, so tensor names read "model.fc.weight"."""

    def __init__(self, modules: Mapping[str, nn.Module]) -> None:
        super().__init__()
        for key, module in modules.items():
            self.add_module(key, module)


class Checkpointer:
    """Save and restore a training job's full state; see the module docstring for call order."""

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
        io_threads: int = 8,
    ) -> None:
        self.config = CheckpointConfig(
            uri=uri,
            every_steps=every_steps,
            every_seconds=every_seconds,
            keep=keep,
            async_save=async_save,
            staging_dir=staging_dir,
            control_dir=control_dir,
            job=job,
            io_threads=io_threads,
        )
        self.storage = open_storage(uri)
        self._dist = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self._dist else 0
        self.world_size = dist.get_world_size() if self._dist else 1
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
        self._last_save_started = time.monotonic()
        self.last_committed_step: int | None = None
        self.last_committed_uri: str | None = None
        self.last_save_seconds: float | None = None
        self.last_blocking_seconds: float | None = None
        self._flushed = False
        self._stager: Any = None
        self._handled_save_mtime: int | None = None
        self._votes: list[tuple[Any, torch.Tensor]] = []
        self._status = RankStatus(state="starting", world_size=self.world_size)
        self._status_written = 0.0
        self._checked_rank_bytes = False
        self._closed = False
        self._report(force=True)

    @classmethod
    def from_env(cls, **overrides: Any) -> Checkpointer:
        """Build from the variables spotjob-agent sets; keyword arguments win over them."""
        env = os.environ
        uri = overrides.pop("uri", None) or env.get(ENV_CHECKPOINT_URI)
        if not uri:
            raise ValueError(
                f"no checkpoint URI: set {ENV_CHECKPOINT_URI} (spotjob-agent --checkpoint-uri does) or pass uri=..."
            )

        def num(name: str, kind: type) -> Any:
            raw = env.get(name)
            if raw in (None, ""):
                return None
            try:
                return kind(raw)
            except ValueError:
                raise ValueError(f"{name}={raw!r} is not a valid {kind.__name__}") from None

        kwargs: dict[str, Any] = {
            "every_steps": num(ENV_EVERY_STEPS, int),
            "every_seconds": num(ENV_EVERY_SECONDS, float),
            "async_save": env.get(ENV_ASYNC, "1").lower() not in ("0", "false", "no"),
            "staging_dir": env.get(ENV_STAGING_DIR) or None,
            "control_dir": env.get(ENV_CONTROL_DIR) or None,
            "job": env.get(ENV_JOB_NAME) or None,
        }
        keep = num(ENV_KEEP, int)
        if keep is not None:
            kwargs["keep"] = keep if keep > 0 else None
        kwargs.update(overrides)
        return cls(uri, **kwargs)

    # ------------------------------------------------------------------------------------------
    # the training-side API
    # ------------------------------------------------------------------------------------------
    def step(self, step: int, state: Mapping[str, Any], *, metadata: dict[str, Any] | None = None) -> bool:
        """Record that ``step`` steps are done; save per policy. True means "stop now"."""
        self._raise_if_failed()
        if self._flushed:
            return True
        vote = self._vote()
        if vote.flush:
            self._flush(step, state, metadata)
            return True
        due = vote.time_due or bool(self.config.every_steps and step % self.config.every_steps == 0)
        if vote.save_early and self._last_saved_step != step:
            self._start_save(step, state, metadata, trigger="early")
        elif due and self._last_saved_step != step:
            # At most one save in flight: a policy save waits for the previous one. Deterministic
            # checkpoints every N steps are worth more than never blocking; a hung store is
            # bounded by the storage retries and, above them, the controller's flush timeout.
            self._start_save(step, state, metadata, trigger="policy")
        self._status.step = step
        if self._status.state == "starting":
            self._status.state = "training"
        self._report()
        return False

    def save(self, step: int, state: Mapping[str, Any], *, metadata: dict[str, Any] | None = None) -> None:
        """Save ``state`` as the checkpoint of ``step`` now (asynchronously unless configured not).

        Waits for a save still in flight first (at most one is in flight).
        """
        self._start_save(step, state, metadata, trigger="save")

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
            raise SaveFailedError(f"checkpoint of step {save.step} failed: {save.error}") from save.error

    def restore(self, state: Mapping[str, Any]) -> int:
        """Load the newest valid checkpoint into ``state`` in place; return its step (0 if none).

        Walks checkpoints newest to oldest, skipping (and logging) every one that is uncommitted,
        incomplete, corrupt or unsafe. Raises ``MissingStateKeysError`` when the checkpoint lacks
        keys of ``state``.
        """
        self._check_state(state)
        self._drain_votes()
        refs = self._broadcast(find_checkpoints(self.storage) if self.rank == 0 else None)
        partially_loaded = False
        for ref in refs:
            manifest_json, reason = None, None
            if self.rank == 0:
                status = inspect(self.storage, ref)
                if status.valid and status.manifest is not None:
                    manifest_json = status.manifest.to_json()
                else:
                    reason = status.reason
            manifest_json, reason = self._broadcast((manifest_json, reason))
            if manifest_json is None:
                if self.rank == 0:
                    log.warning("restore: skipping %s: %s", self.storage.url(ref.folder), reason)
                continue
            manifest = Manifest.parse(manifest_json)
            missing = sorted(set(state) - set(manifest.state_keys))
            if missing:
                raise MissingStateKeysError(
                    f"checkpoint {self.storage.url(ref.folder)} holds state keys {manifest.state_keys}; "
                    f"it lacks {missing}. Restore with the keys it was saved with, or start a new URI."
                )
            ok, loaded = self._try_load(ref, manifest, state)
            partially_loaded = partially_loaded or loaded
            if ok:
                self.last_committed_step = manifest.step
                self.last_committed_uri = self.storage.url(ref.folder)
                self._last_saved_step = manifest.step
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
                return manifest.step
        if partially_loaded:
            raise RestoreError(
                "a checkpoint failed verification after some ranks had loaded part of it and no older "
                "valid checkpoint exists; refusing to continue with mixed state"
            )
        if refs and self.rank == 0:
            log.error("restore: none of %d checkpoint folders is valid; starting from step 0", len(refs))
        return 0

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
            for pg in (self._save_pg, self._ctl_pg):
                if pg is not None:
                    try:
                        dist.destroy_process_group(pg)
                    except Exception as e:  # a torn-down default group already took it
                        log.debug("destroying a checkpoint process group: %s", e)
            self._save_pg = self._ctl_pg = None
            if self._stager is not None:
                self._stager.close()  # frees the staging buffers kept between saves
                self._stager = None

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------------------------------
    # the flush vote
    # ------------------------------------------------------------------------------------------
    def _local_flags(self) -> list[int]:
        """[flush requested, save-early requested, every_seconds due]."""
        flush = save_early = 0
        if self._control is not None:
            flush = int(self._control.flush_requested())
            try:
                mtime = os.stat(os.path.join(self._control.path, "save.json")).st_mtime_ns
            except FileNotFoundError:
                mtime = None
            if mtime is not None and mtime != self._handled_save_mtime:
                save_early = 1
        time_due = int(
            self.config.every_seconds is not None
            and time.monotonic() - self._last_save_started >= self.config.every_seconds
        )
        return [flush, save_early, time_due]

    def _vote(self) -> _Vote:
        """What every rank agrees on at this step: identical on all ranks, or collectives diverge."""
        flags = self._local_flags()
        if not self._dist or self.world_size == 1:
            agreed = flags
        else:
            # Read the vote launched at the previous step (long since done), launch this one.
            agreed = [0, 0, 0]
            if self._votes:
                work, buf = self._votes.pop(0)
                work.wait()
                agreed = [int(v) for v in buf.tolist()]
            buf = torch.tensor(flags, dtype=torch.int32)
            work = dist.all_reduce(buf, op=dist.ReduceOp.MAX, group=self._ctl_pg, async_op=True)
            self._votes.append((work, buf))
        vote = _Vote(*(bool(v) for v in agreed))
        if vote.save_early and self._control is not None:
            try:
                self._handled_save_mtime = os.stat(os.path.join(self._control.path, "save.json")).st_mtime_ns
            except FileNotFoundError:
                pass
            log.info("saving early: the agent asked for a checkpoint without stopping")
        return vote

    def _drain_votes(self) -> None:
        while self._votes:
            work, _ = self._votes.pop(0)
            work.wait()

    def _flush(self, step: int, state: Mapping[str, Any], metadata: dict[str, Any] | None) -> None:
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
                self.wait()
                # The loop stops after this save anyway: write straight from the live tensors
                # instead of staging a copy first (saves a full memcpy of the state).
                self._start_save(step, state, metadata, flush=request, blocking=True)
                self.wait()
        except SaveFailedError as e:
            self._status.state = "flush-failed"
            self._report(force=True)
            if self._control is not None and self.rank == 0:
                self._control.write_flush_result(
                    FlushResult(
                        step=None,
                        uri=None,
                        request_id=request.id if request else None,
                        notice_to_commit_seconds=None,
                        error=str(e),
                    )
                )
            raise FlushFailedError(f"flush at step {step} could not commit: {e}") from e
        self._flushed = True
        self._status.state = "flushed"
        self._report(force=True)
        if self._control is not None and self.rank == 0:
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

    # ------------------------------------------------------------------------------------------
    # saving
    # ------------------------------------------------------------------------------------------
    def _start_save(
        self,
        step: int,
        state: Mapping[str, Any],
        metadata: dict[str, Any] | None,
        flush: FlushRequest | None = None,
        blocking: bool = False,
        trigger: str = "save",
    ) -> None:
        self._raise_if_failed()
        self.wait()  # at most one save in flight
        self._check_state(state)
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
            metadata=dict(metadata or {}),
            state_keys=list(state.keys()),
            rank_bytes=rank_bytes,
            flush=flush,
            trigger="flush" if flush is not None or blocking else trigger,
        )
        background = self.config.async_save and not blocking
        if dcp_state:
            writer = make_writer(local_dir, durable=self.storage.local_path("") is not None)
            _crc32_window_open()
            try:
                if background:
                    if self._stager is None:
                        self._stager = make_stager()
                    save.future = dcp.async_save(
                        dcp_state,
                        storage_writer=writer,
                        process_group=self._save_pg,
                        no_dist=not self._dist,
                        async_stager=self._stager,
                    )
                else:
                    dcp.save(dcp_state, storage_writer=writer, process_group=self._save_pg, no_dist=not self._dist)
            except BaseException:
                _crc32_window_close()
                raise
            if not background:
                _crc32_window_close()
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
            save.done.set()

    def _write_upload_commit(self, save: _Save) -> None:
        files: list[tuple[str, int, str]] = []
        error: str | None = None
        try:
            if save.future is not None:
                try:
                    save.future.result()
                finally:
                    _crc32_window_close()
            path = os.path.join(save.local_dir, _rank_state.rank_file_name(self.rank))
            with open(path, "wb") as f:
                f.write(save.rank_bytes)
                f.flush()
                os.fsync(f.fileno())
            for name in sorted(os.listdir(save.local_dir)):
                crc, size = crc32c_file(os.path.join(save.local_dir, name))
                files.append((name, size, to_hex(crc)))
        except BaseException as e:  # reported to every rank below, never swallowed
            error = f"rank {self.rank}: writing the shards failed: {e!r}"
        folder: str | None = None
        if self.rank == 0:
            try:
                folder = self._target_folder(save.step)
            except (StorageError, OSError) as e:
                error = error or f"rank 0: cannot prepare the checkpoint folder: {e}"
        folder = self._broadcast(folder, group=self._save_pg)
        if error is None and folder is not None:
            try:
                put_files(
                    self.storage,
                    [(os.path.join(save.local_dir, n), f"{folder}/{n}", int(c, 16)) for n, _, c in files],
                    parallelism=self.config.io_threads,
                )
            except BaseException as e:
                error = f"rank {self.rank}: upload failed: {e!r}"
        elif error is None:
            error = "rank 0 could not name the checkpoint folder"
        gathered = self._all_gather((files, error), group=self._save_pg)
        outcome: tuple[str | None, str | None] = (None, None)
        if self.rank == 0:
            errors = [e for _, e in gathered if e]
            if errors:
                outcome = (None, "; ".join(errors))
            else:
                try:
                    outcome = (self._commit(save, folder or "", [f for fs, _ in gathered for f in fs]), None)
                except BaseException as e:
                    outcome = (None, f"rank 0: commit failed: {e!r}")
        uri, failure = self._broadcast(outcome, group=self._save_pg)
        seconds = time.monotonic() - save.started
        if failure is None and uri is not None:
            save.committed_uri = uri
            self.last_committed_step = save.step
            self.last_committed_uri = uri
            self.last_save_seconds = seconds
            self._status.last_committed_step = save.step
            self._status.last_committed_uri = uri
            self._status.last_save_seconds = seconds
            if self._status.state == "saving":
                self._status.state = "training"
            if self.rank == 0:
                log.info("committed step %d at %s in %.2fs", save.step, uri, seconds)
                self._retain(CheckpointRef.parse(uri.rsplit("/", 1)[-1]) or CheckpointRef(save.step))
        else:
            save.error = SaveFailedError(failure or "unknown failure")
            log.error("checkpoint of step %d failed, nothing committed: %s", save.step, failure)
        shutil.rmtree(save.local_dir, ignore_errors=True)
        try:
            os.rmdir(os.path.dirname(save.local_dir))  # the last rank of the node out removes it
        except OSError:
            pass
        self._report(force=True)
        save.done.set()

    def _target_folder(self, step: int) -> str:
        """(rank 0) The folder this step's save goes to; clears an uncommitted leftover there."""
        attempt = 0
        for ref in find_checkpoints(self.storage):
            if ref.step != step:
                continue
            if self.storage.stat(ref.key(MANIFEST_NAME)) is not None:
                attempt = max(attempt, ref.attempt + 1)
            else:
                log.info("removing leftover of an unfinished save in %s", self.storage.url(ref.folder))
                self.storage.delete_prefix(ref.folder + "/")
        return CheckpointRef(step, attempt).folder

    def _commit(self, save: _Save, folder: str, files: list[tuple[str, int, str]]) -> str:
        """(rank 0) Write MANIFEST.json, create-only. Returns the committed folder's URI."""
        metadata_path = os.path.join(save.local_dir, DCP_METADATA_NAME)
        tensors = {}
        if os.path.exists(metadata_path):
            from agent._dcp import load_dcp_metadata

            with open(metadata_path, "rb") as f:
                tensors = tensor_index(load_dcp_metadata(f.read()))
        manifest = Manifest(
            step=save.step,
            world_size=self.world_size,
            created_at=now_utc(),
            torch_version=torch.__version__,
            job=self.config.job,
            state_keys=save.state_keys,
            files=sorted((FileEntry(path=n, size=s, crc32c=c) for n, s, c in files), key=lambda f: f.path),
            tensors=tensors,
            metadata=save.metadata,
            trigger=save.trigger,
        )
        try:
            self.storage.put_bytes_if_absent(f"{folder}/{MANIFEST_NAME}", manifest.to_json())
        except AlreadyExistsError:
            raise SaveFailedError(
                f"{self.storage.url(folder)} was committed by someone else meanwhile; "
                "is another job writing to the same URI?"
            ) from None
        return self.storage.url(folder)

    def _retain(self, committed: CheckpointRef) -> None:
        """(rank 0) Keep the newest ``keep`` valid committed checkpoints; remove old leftovers.

        Never touches anything newer than the checkpoint just committed. A failed delete is a
        warning, never a failed save.
        """
        try:
            older = [r for r in find_checkpoints(self.storage) if r < committed]
            committed_older = [r for r in older if self.storage.stat(r.key(MANIFEST_NAME)) is not None]
            doomed = [r for r in older if r not in committed_older]  # never committed
            if self.config.keep is not None:
                # Only valid checkpoints count towards ``keep``: a refused one kept in place of a
                # valid one would leave fewer to fall back to than asked for. Broken folders newer
                # than the oldest one kept stay (for a post-mortem); older ones go with the rest.
                kept = 0
                for ref in committed_older:  # newest first
                    if kept >= self.config.keep - 1:
                        doomed.append(ref)
                    elif inspect(self.storage, ref).valid:
                        kept += 1
            for ref in doomed:
                # Manifest first: a half-deleted folder then reads as uncommitted, not as broken.
                self.storage.delete([ref.key(MANIFEST_NAME)])
                self.storage.delete_prefix(ref.folder + "/")
                log.info("retention: removed %s", self.storage.url(ref.folder))
        except (StorageError, OSError) as e:
            log.warning("retention: could not remove old checkpoints (will retry next save): %s", e)

    # ------------------------------------------------------------------------------------------
    # restoring
    # ------------------------------------------------------------------------------------------
    def _try_load(self, ref: CheckpointRef, manifest: Manifest, state: Mapping[str, Any]) -> tuple[bool, bool]:
        """Load one checkpoint on every rank. Returns (all ranks succeeded, anything was loaded)."""
        local_dir = self.storage.local_path(ref.folder)
        cache = None
        if local_dir is None:
            cache = os.path.join(self._staging_root, "restore", ref.folder)
            local_dir = cache
        reader = VerifiedReader(self.storage, ref.folder, manifest, local_dir, self.config.io_threads)
        error: str | None = None
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
            error = self._load_error(ref, e)
        if not self._all_ok(error is None):
            self._cleanup_cache(cache)
            return False, False
        # Phase 2: modules and optimizers through DCP (each file verified before it is read).
        dcp_state: dict[str, Any] = {}
        try:
            dcp_state = self._load_dcp(reader, state)
        except (Exception, CheckpointException) as e:  # DCP's own is a BaseException
            error = self._load_error(ref, e)
        if not self._all_ok(error is None):
            self._cleanup_cache(cache)
            # Did any rank's live state change before the failure? Then none may carry on from it.
            return False, not self._all_ok(not reader.data_read_started)
        self._apply(state, dcp_state, rank_payload or {}, manifest)
        self._cleanup_cache(cache)
        return True, True

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
        load = partial(dcp.load, storage_reader=reader, process_group=self._ctl_pg, no_dist=not self._dist)
        if not _plain_modules(bag):
            dcp_state, _ = self._split_state(state)
            load(dcp_state, planner=SafeLoadPlanner())
            return dcp_state
        dcp_state = dict(get_model_state_dict(bag))
        load(dcp_state, planner=SafeLoadPlanner())
        if optims:
            # dcp.load copies its argument's keys into a new dict, so an empty target would come back
            # empty; the lower-level loader fills the dict it is given, as dcp_to_torch_save does.
            from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

            saved: dict[str, Any] = {}
            _load_state_dict(
                saved,
                storage_reader=reader,
                process_group=self._ctl_pg,
                no_dist=not self._dist,
                planner=SafeEmptyLoadPlanner(keys=set(optims)),
            )
            missing = sorted(set(optims) - set(saved))
            if missing:
                raise MissingStateKeysError(f"the checkpoint holds no optimizer state for {missing}")
            dcp_state.update({key: _DirectOptimState(saved[key]) for key in optims})
        return dcp_state

    def _load_error(self, ref: CheckpointRef, e: BaseException) -> str:
        if isinstance(e, CheckpointException) and e.failures:
            # DCP wraps every rank's failure; the first one says what went wrong.
            e = next(iter(e.failures.values()))[0]
        if isinstance(e, StorageError):
            kind = "corrupt"
        elif isinstance(e, UnsafeCheckpointError | _rank_state.RefusedPickleError):
            kind = "unsafe"
        else:
            kind = "unreadable"
        msg = f"{self.storage.url(ref.folder)} is {kind} on rank {self.rank}: {e}"
        log.warning("restore: skipping %s", msg)
        if not isinstance(e, StorageError | UnsafeCheckpointError | ManifestError | ValueError | RuntimeError):
            log.debug("restore failure detail", exc_info=e)
        return msg

    def _apply(
        self, state: Mapping[str, Any], dcp_state: dict[str, Any], payload: dict[str, Any], manifest: Manifest
    ) -> None:
        modules, optims, others = self._classify(state)
        bag = _ModuleBag(modules)
        if modules:
            set_model_state_dict(bag, {k: v for k, v in dcp_state.items() if k not in optims})
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

    @staticmethod
    def _cleanup_cache(cache: str | None) -> None:
        if cache is not None:
            shutil.rmtree(cache, ignore_errors=True)

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
        save = self._inflight
        if save is not None and save.done.is_set() and save.error is not None:
            self.wait()

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
        for entry in entries:
            if entry.is_dir() and (entry.name.startswith("step-") or entry.name == "restore"):
                log.info("removing a stale staging folder left by an interrupted save: %s", entry.path)
                shutil.rmtree(entry.path, ignore_errors=True)

    def _default_staging(self) -> str:
        local = self.storage.local_path("")
        if local is not None:
            # Same filesystem as the destination: committing links the files instead of copying.
            return os.path.join(local, ".spotjob-staging")
        # Deterministic across ranks, so the ranks of a node share one restore cache.
        name = (self.config.job or "job") + "-" + to_hex(crc32c_bytes(self.storage.uri.encode()))
        return os.path.join(tempfile.gettempdir(), "spotjob-staging", name)

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
        if self._control is None or self.rank != 0:
            return
        now = time.monotonic()
        if not force and now - self._status_written < _STATUS_INTERVAL_S:
            return
        self._status_written = now
        try:
            self._control.write_status(self._status)
        except OSError as e:
            log.debug("could not write status for the agent: %s", e)
