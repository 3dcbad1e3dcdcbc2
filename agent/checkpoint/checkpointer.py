"""``Checkpointer``: what the training script calls (see the package docstring for the call order).

The class joins the parts: ``_Saving`` (the save pipeline and the flush, ``wait()``) and
``_Restoring`` (``restore()``), both on ``_Voting`` (the per-step vote), ``_Retention``, ``_State``
and ``_Core`` (shared state and plumbing)."""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import uuid
import weakref
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from agent._dcp_plan import SavePlanCache
from agent._direct_io import suits_direct_io
from agent._layout import PROBES_FOLDER, MisplacedUriError, reserved_uri_problem
from agent.checkpoint import _claim
from agent.checkpoint._restore import _Restoring
from agent.checkpoint._save import _Save, _Saving
from agent.checkpoint.config import CheckpointConfig, _check_metadata, _check_step, normalise_uri, switch
from agent.checkpoint.errors import (
    CheckpointOwnershipError,
    CheckpointUriError,
    FencedSaveError,
    SaveFailedError,
    StorageRefusedError,
)
from agent.control_channel import (
    ENV_ATTEMPT,
    ENV_CHECKPOINT_URI,
    ENV_EVERY_SECONDS,
    ENV_EVERY_STEPS,
    ENV_KEEP,
    ENV_START_FRESH,
    ControlDir,
    RankStatus,
)
from agent.dcp_safe import TensorIndexCache
from agent.ownership import OwnershipError, claim, read_owner
from agent.pins import Pinner
from agent.restore_cache import staging_root
from agent.settings import CheckpointerEnv, load, local_world_size
from agent.storage import PermanentStorageError, StorageError, open_storage

log = logging.getLogger("agent.checkpoint")  # one logger for the package, as before it was split


_closed_marks: dict[tuple[str, int], ControlDir] = {}
"""The "closed" markers this process wrote, by (control folder, rank): taken back on a crash."""
_closed_marks_pid = 0
"""The process that wrote them: a child forked after close() (a worker of the script's) inherits
the hook, and its crash is its own, not the rank's."""
_crash_hook: Any = None


def _take_back_closed_on_crash(control: ControlDir, rank: int) -> None:
    """If the script dies of an unhandled exception after close(), remove the "closed" marker.

    The marker lets the agent forgive an abort at interpreter exit after the work is done; a
    traceback after close() (writing results, say) is a real failure and must stay one. A
    ``sys.exit(non-zero)`` after close() is not seen here (no hook runs for it). One hook for
    every Checkpointer the process closes: a hook per close made a chain that grew with each one.
    A child forked later (``os.fork`` in the script) that dies of an exception leaves them be.
    """
    global _crash_hook, _closed_marks_pid
    _closed_marks[(control.path, rank)] = control
    _closed_marks_pid = os.getpid()
    if _crash_hook is not None and sys.excepthook is _crash_hook:
        return
    previous = sys.excepthook

    def hook(kind: type[BaseException], value: BaseException, tb: Any) -> None:
        if os.getpid() == _closed_marks_pid:
            for (_, marked_rank), marked in list(_closed_marks.items()):
                marked.unmark_closed(marked_rank)
        previous(kind, value, tb)

    _crash_hook = sys.excepthook = hook


def _exception_in_flight() -> bool:
    exc = sys.exc_info()[1]
    if exc is None:
        return False
    return not (isinstance(exc, SystemExit) and exc.code in (0, None))


def _local_world_size(world_size: int) -> int | None:
    """The ranks on this node, for its agent: torchrun's (and ``agent.ranks``') ``LOCAL_WORLD_SIZE``,
    else 1 for a single process, else None (a launcher that does not say)."""
    local = local_world_size()
    if local is not None:
        return local
    return 1 if world_size == 1 else None


def _uri_text(uri: Any) -> str:
    """The checkpoint URI as a string: a ``pathlib.Path`` (any ``os.PathLike`` naming a str path) is
    the folder it names; anything else but a string is a ``TypeError`` naming it (an int or a Path
    reached the URI parser as an ``AttributeError`` about ``strip``). None is one too: most often
    ``os.environ.get(...)`` of a variable that is unset, where ``from_env()`` names it."""
    if isinstance(uri, os.PathLike):
        uri = os.fspath(uri)
    if not isinstance(uri, str):
        hint = f"; Checkpointer.from_env() takes it from {ENV_CHECKPOINT_URI}" if uri is None else ""
        raise TypeError(
            f"the checkpoint URI must be a string (s3://bucket/prefix, gs://bucket/prefix or a folder's path) "
            f"or a pathlib.Path, got {uri!r} ({type(uri).__name__}){hint}"
        )
    return uri


class Checkpointer(_Saving, _Restoring):
    """Save and restore a training job's full state; see ``agent.checkpoint`` for the call order.

    Under spotjob-agent (``SPOTJOB_CONTROL_DIR`` set) every Checkpointer joins the agent's control
    channel, whatever constructor built it, and takes ``job`` (``SPOTJOB_JOB_NAME``) and
    ``attempt`` (``SPOTJOB_ATTEMPT``) from the environment when they are not passed;
    ``start_fresh`` defaults to ``SPOTJOB_START_FRESH=1``; ``async_save``, ``staging_dir``,
    ``release_staging`` and ``direct_io`` default to ``SPOTJOB_ASYNC`` (true when unset),
    ``SPOTJOB_STAGING_DIR``, ``SPOTJOB_RELEASE_STAGING`` and ``SPOTJOB_DIRECT_IO`` (with or without
    an agent).

    ``start_fresh``: where ``restore`` would refuse (the newest checkpoint does not fit the state,
    or committed checkpoints exist and none loads) it returns 0 instead and *retires* the job's
    committed checkpoints, the refused ones and any older (``agent._fresh_start``): they are kept
    as they are, never restored, never counted or deleted by retention, and their folder names
    stay taken, so the new run's saves (whose steps start again from 0, below theirs) can never be
    mistaken for them. It has no effect when a checkpoint loads, so leaving it set across restarts
    never throws the new run's own progress away.

    ``read_only``: for another program reading the job's checkpoints (an eval script): it restores
    the URI owner's checkpoints (or ``job``'s) and writes and deletes nothing under the URI (no
    claim, no probe objects, no staging clean-up); ``save()`` and ``step()`` raise ``RuntimeError``.
    """

    def __init__(
        self,
        uri: str | os.PathLike[str],
        every_steps: int | None = None,
        keep: int | None = 3,
        *,
        every_seconds: float | None = None,
        async_save: bool | None = None,
        staging_dir: str | None = None,
        control_dir: str | None = None,
        job: str | None = None,
        attempt: int | None = None,
        start_fresh: bool | None = None,
        io_threads: int = 8,
        release_staging: bool | None = None,
        direct_io: bool | None = None,
        read_only: bool = False,
        replicas: str = "identical",
    ) -> None:
        uri = _uri_text(uri)
        # Under an agent, the channel and the job's identity come from it, whatever the script passed.
        env = load(CheckpointerEnv)
        control_dir = control_dir or env.control_dir
        # The node's staging folder is the agent's to choose (its prefetch fills the job's folder
        # there; a Kubernetes worker's staging volume): whatever constructor built this one.
        staging_dir = staging_dir if staging_dir is not None else env.staging_dir
        if staging_dir:
            # A relative folder is the one it names now, as a relative URI is: a script that
            # changes its working folder later would otherwise stage each save elsewhere than the
            # folder checked and cleaned here, where no later Checkpointer cleans a killed save's copy.
            staging_dir = os.path.abspath(staging_dir)
        given_job = job
        job = job if job is not None else env.job_name
        if attempt is not None and env.attempt is not None and attempt != env.attempt and not read_only:
            # Fencing compares the attempt each manifest records with the newest the controller
            # recorded: a script's own number in place of the agent's would fence nothing, silently.
            raise ValueError(
                f"attempt={attempt!r} but {ENV_ATTEMPT}={env.attempt} (the attempt this worker runs as, set "
                "by spotjob-agent --attempt; fencing checks it): drop attempt= and let the Checkpointer "
                f"take the agent's, or pass the same number"
            )
        attempt = attempt if attempt is not None else env.attempt
        # The restore's log line names what set it: a script's argument, or the agent's variable.
        self._start_fresh_by = ENV_START_FRESH if start_fresh is None else "start_fresh=True"
        start_fresh = env.start_fresh if start_fresh is None else switch(start_fresh, "start_fresh")
        read_only = switch(read_only, "read_only")
        if read_only and start_fresh:
            raise ValueError(
                "read_only=True with start_fresh: a read-only Checkpointer never retires checkpoints; "
                f"drop start_fresh (or unset {ENV_START_FRESH} for this process)"
            )
        self._read_only = bool(read_only)
        # A reader given job= reads that job's checkpoints, whoever owns the URI (an eval of a job
        # whose URI another job owns); from the environment, the job is the agent's, not a choice.
        self._reading_as = given_job if self._read_only else None
        self.config = CheckpointConfig(
            uri=uri,
            every_steps=every_steps,
            every_seconds=every_seconds,
            keep=keep,
            async_save=env.async_save if async_save is None else async_save,
            staging_dir=staging_dir,
            control_dir=control_dir,
            job=job,
            attempt=attempt,
            start_fresh=start_fresh,
            io_threads=io_threads,
            release_staging=env.release_staging if release_staging is None else release_staging,
            direct_io=env.direct_io if direct_io is None else direct_io,
            replicas=replicas,
        )
        try:
            self.storage = open_storage(uri)
        except PermanentStorageError as e:
            # Nothing to start with (no Google credentials, an AWS profile that does not exist, an
            # SDK missing): a refusal like a missing bucket's, not the store layer's own error.
            raise StorageRefusedError(
                f"the checkpoint store {uri} refuses this job: {e}. Retrying cannot help: fix the store's "
                "settings or credentials, then start the job again"
            ) from e
        self._dist = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self._dist else 0
        self.world_size = dist.get_world_size() if self._dist else 1
        self._save_pg: Any = None
        self._ctl_pg: Any = None
        self._control = ControlDir(control_dir) if control_dir else None
        if self._read_only and (reserved := reserved_uri_problem(self.storage.uri)) is not None:
            # A writer is refused so as it claims the URI; a reader here (a job's staging folder
            # holding interrupted saves' leftovers) said "no committed checkpoint" and started from 0.
            # Told by its name on every rank alike: no request, no group.
            self._close_storage()
            raise CheckpointUriError(reserved)
        if self._read_only:
            # A reader cleans no staging folder, so its groups can come first: rank 0 alone reads
            # the owner record and hands it on (on every rank, a 1000-rank eval job sent 2000
            # requests for one small object at once).
            self._make_groups()
            if job is None:
                # Another program reading a job's checkpoints (an eval script) reads them as that job's.
                try:
                    found, owner_job = self._owner_from_rank0()
                except BaseException:
                    self._destroy_groups()
                    self._close_storage()
                    raise
                if found:
                    self.config = dataclasses.replace(self.config, job=owner_job)
        self._node_reporter = int(os.environ.get("LOCAL_RANK", self.rank)) == 0
        """This rank is its node's first (local rank 0): it writes the node's status.json and flush
        result, which that node's agent reads (its readiness, its step, its exit code). Every rank
        knows the same state and the commit's outcome, so each node's first rank can tell it."""
        try:
            self._staging_root = staging_root(self.storage, self.config.job, staging_dir)
        except BaseException:
            self._destroy_groups()  # a reader's, made above
            self._close_storage()
            raise
        self._direct_io = self.storage.local_path("") is not None and (
            self.config.direct_io if self.config.direct_io is not None else suits_direct_io(self._staging_root)
        )
        """Shards go to the disk with O_DIRECT (a filesystem store: the staged files are the checkpoint)."""
        # Before the groups: creating them waits for every rank, so no rank can start a save
        # while local rank 0 is still clearing the staging folder.
        if not self._read_only:
            self._check_staging_dir()
            self._clean_stale_staging()
            self._make_groups()
        self._inflight: _Save | None = None
        self._last_saved_step: int | None = None
        self._last_step: int | None = None
        """The highest step seen by step(), save() or restore(): steps never go back."""
        self._stepped: int | None = None
        """The step of the last step() call: the same one again is logged (``_warn_if_repeated``)."""
        self._warned_repeat = False
        self._warned_flushed = False
        self._restart_deadline()
        self.last_committed_step: int | None = None
        self.last_committed_uri: str | None = None
        self.last_save_seconds: float | None = None
        self.last_blocking_seconds: float | None = None
        self._flushed = False
        self._flushed_step: int | None = None
        """The step the flush committed: a later ``save()`` moves ``last_committed_step`` on."""
        self._fenced: FencedSaveError | None = None
        self._stager: Any = None
        # DCP's save plans of the last save, reused while the state keeps its structure.
        self._plan_cache = SavePlanCache()
        # The manifest's tensor index of the last save, reused while the plans are.
        self._tensor_index = TensorIndexCache()
        self._handled_save_mtime: int | None = None
        self._votes: list[tuple[Any, torch.Tensor]] = []
        self._saves_started = 0
        self._swept_through = None
        self._refusals_said = set()
        self._own_folders = set()
        self._restored_folders = set()
        self._checkpointer_id = uuid.uuid4().hex
        _claim.opened(self._checkpointer_id)
        # One never closed stops counting as open once it is collected.
        weakref.finalize(self, _claim.closed, self._checkpointer_id)
        self._seen_uncommitted = set()
        self._writers_of = {}
        self._written = {}
        self._writers_said = set()
        self._proven_bad = set()
        self._left_out_said = set()
        self._status = RankStatus(
            state="starting",
            world_size=self.world_size,
            local_world_size=_local_world_size(self.world_size),
            checkpoint_uri=self.storage.uri,
        )
        self._status_written = 0.0
        self._closed = False
        self._pid = os.getpid()
        self._pinner = Pinner(self.storage) if self._read_only and self.rank == 0 else None
        self._warn_if_not_the_agents_uri()
        self._warn_if_not_the_agents_policy(env)
        try:
            if not self._read_only:
                self._claim()
        except BaseException:
            self._destroy_groups()
            self._close_storage()
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
        self._check_open("step()")
        self._check_writable("step()")
        step = self._check_next_step(step, "step()")
        metadata = _check_metadata(metadata, "step()")
        if self._fenced is not None:
            raise self._fenced
        if self._flushed:
            self._warn_after_flush(step)
            return True
        self._warn_if_repeated(step)
        vote = self._read_vote(step)
        if vote.flush:
            # Before any failed save is raised: the flush settles (and logs) a save in flight that
            # failed, and writes this step anyway.
            self._flush(step, state, metadata)
            self._flushed_step = step
            return True
        if vote.failed_save is not None:
            self._raise_agreed_failure(vote.failed_save)
        due = vote.time_due or bool(self.config.every_steps and step % self.config.every_steps == 0)
        if vote.save_early:
            log.info("saving early at step %d: the agent asked for a checkpoint without stopping", step)
            self._consume_save_request()
        try:
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
        finally:
            self._let_save_run()  # the save thread starts its work once this call is done
        return False

    def save(self, step: int, state: Mapping[str, Any], *, metadata: dict[str, Any] | None = None) -> None:
        """Save ``state`` as the checkpoint of ``step`` now (asynchronously unless configured not).

        Waits for a save still in flight first (at most one is in flight). ``step`` is a whole
        number not lower than the last step seen; ``metadata`` a dict of JSON values (a NaN or
        infinite float in it is recorded as the string ``"nan"``, ``"inf"`` or ``"-inf"``).
        """
        self._check_open("save()")
        self._check_writable("save()")
        step = self._check_next_step(step, "save()")
        metadata = _check_metadata(metadata, "save()")
        try:
            self._start_save(step, state, metadata, trigger="save")
        finally:
            self._let_save_run()
        self._last_step = step

    def close(self) -> None:
        """Wait for the save in flight, then release the process groups, the staging buffers and
        the store's transfer threads and connections. Idempotent."""
        if self._closed:
            return
        self._check_process("close()")
        destroyed = self._dist and not (dist.is_available() and dist.is_initialized())
        try:
            try:
                self.wait()
            except SaveFailedError as e:
                if not destroyed:
                    raise
                raise SaveFailedError(
                    f"{e}. torch.distributed's process group was destroyed before close(), and the save's "
                    "collectives with it: call close() before destroy_process_group()"
                ) from e
        except BaseException:
            save = self._inflight
            if save is not None and save.thread is not None and save.thread.is_alive():
                # Interrupted (Ctrl-C, a signal handler's exit) while the save in flight still
                # writes: it keeps its process groups, staging buffers and store, which releasing
                # them now would pull from under it (its collectives would fall back to the
                # training's default group). The interpreter's exit waits for it; a later close()
                # waits for it too and then releases them.
                raise
            self._release()
            raise
        self._release()

    def _release(self) -> None:
        """(close) Mark this rank closed for the agent, then let go of what the Checkpointer holds."""
        self._drain_votes()
        self._closed = True
        _claim.closed(self._checkpointer_id)
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
        self._close_storage()

    def _close_storage(self) -> None:
        """An object store's transfer pool (up to ``concurrency`` threads) and its connections would
        otherwise outlive ``close()`` for as long as anything holds the Checkpointer."""
        try:
            self.storage.close()
        except Exception as e:  # nothing is left to write; a failed close costs nothing more
            log.debug("closing the checkpoint store: %r", e)

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None, tb: Any) -> None:
        """``close()``; when the body raised, a save that failed meanwhile is logged (its thread
        logged it too) and the body's exception goes on: a ``SaveFailedError`` in its place would
        hide the script's own error, or turn Ctrl-C into an exit code 1."""
        if kind is None:
            self.close()
            return
        try:
            self.close()
        except Exception as e:
            log.error("closing the Checkpointer while %s propagates: %s", kind.__name__, e)

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

    def _warn_if_not_the_agents_policy(self, env: CheckpointerEnv) -> None:
        """(rank 0) Only ``from_env()`` reads the agent's save policy (its --every-steps, --keep;
        spec.checkpoint on Kubernetes): a Checkpointer built with other values keeps its own, which
        should not pass unnoticed by whoever set the job's."""
        if self._control is None or self.rank != 0 or self._read_only:
            return
        wanted = {
            "every_steps": (ENV_EVERY_STEPS, env.every_steps),
            "every_seconds": (ENV_EVERY_SECONDS, env.every_seconds),
            "keep": (ENV_KEEP, env.keep or None),  # 0: keep every one, as the config says with None
        }
        differ = [
            f"{variable}={os.environ.get(variable)} but {name}={getattr(self.config, name)!r}"
            for name, (variable, value) in wanted.items()
            if os.environ.get(variable) and value != getattr(self.config, name)
        ]
        if differ:
            log.warning(
                "this Checkpointer does not save as the job asks (%s): its own arguments win over what "
                "spotjob-agent passes (--every-steps, --every-seconds, --keep; spec.checkpoint on Kubernetes). "
                "Build it with Checkpointer.from_env(), or pass the same values",
                "; ".join(differ),
            )

    def _warn_after_flush(self, step: int) -> None:
        """(rank 0, once) The loop goes on after ``step()`` returned True: it saves nothing more."""
        if self._warned_flushed or self.rank != 0:
            return
        self._warned_flushed = True
        log.warning(
            "step(%d) after step() returned True: a flush committed step %s (a preemption notice) and nothing "
            "more is saved. Stop the training loop when step() returns True (`if ckpt.step(...): break`); "
            "under spotjob-agent a command still running after its flush is killed (--exit-timeout)",
            step,
            self._flushed_step,
        )

    def _warn_if_repeated(self, step: int) -> None:
        """(rank 0, once) ``step()`` twice with one step: most often a call per micro-batch of a
        gradient accumulation cycle, whose flush would save the data position mid-cycle with the
        model of the cycle before (the resume skips those micro-batches)."""
        repeated = step == self._stepped
        self._stepped = step
        if not repeated or self._warned_repeat or self.rank != 0:
            return
        self._warned_repeat = True
        log.warning(
            "step(%d) was called again with the same step: call step() once per optimizer step (after "
            "optimizer.step()), not per micro-batch; a flush in the middle of a gradient accumulation cycle "
            "would save the data position mid-cycle with the model of the cycle before, and the resumed run "
            "would skip those micro-batches. Logged once",
            step,
        )

    def _check_writable(self, call: str) -> None:
        if self._read_only:
            raise RuntimeError(
                f"{call}: this Checkpointer is read-only (read_only=True): it restores and never writes to "
                f"{self.storage.uri}. Build one without read_only to save"
            )

    def _make_groups(self) -> None:
        """(collective) The Checkpointer's own gloo groups: saves, and everything else."""
        if self._dist:
            self._save_pg = dist.new_group(backend="gloo")
            self._ctl_pg = dist.new_group(backend="gloo")

    def _owner_from_rank0(self) -> tuple[bool, str | None]:
        """(collective, read-only) Whether the URI has an owner record, and its job, read by rank 0.
        Every rank raises what rank 0's read raised: the same ``StorageError`` or ``OwnershipError``."""
        payload: tuple[str, Any] = ("", None)
        error: BaseException | None = None
        if self.rank == 0:
            try:
                owner = read_owner(self.storage)
                payload = ("ok", (owner is not None, None if owner is None else owner.job))
            except OwnershipError as e:
                error, payload = e, ("owner", (str(e), e.uri, e.job, e.owner, e.newer))
            except StorageError as e:
                error, payload = e, ("storage", e)  # picklable: (message, key)
            except BaseException as e:
                error, payload = e, ("error", f"rank 0 could not read the owner record of {self.storage.uri}: {e!r}")
        kind, value = self._broadcast(payload)
        if error is not None:
            raise error
        if kind == "owner":
            message, uri, job, owner, newer = value
            raise OwnershipError(message, uri=uri, job=job, owner=owner, newer=newer)
        if kind == "storage":
            raise value
        if kind == "error":
            raise RuntimeError(value)
        return value

    def _claim(self) -> None:
        """(rank 0, collective) Make this job the URI's owner, or fail on every rank."""
        outcome: tuple[str, str, str | None] = ("", "", None)
        if self.rank == 0:
            doing = "checking that the store refuses to overwrite on create-only writes"
            try:
                # Told by its name, before the probe below writes into another job's folder.
                reserved = reserved_uri_problem(self.storage.uri)
                if reserved is not None:
                    raise MisplacedUriError(reserved)
                # Rank 0 makes every create-only write (the claim, the commits): prove the store
                # enforces them before the first, not after hours of training.
                self.storage.check_create_only(PROBES_FOLDER)
                doing = "claiming the URI for the job"
                claim(self.storage, self.config.job)
                outcome = ("ok", "", None)
            except OwnershipError as e:
                # An eval script reading the job's checkpoints must not take the URI over: adopting
                # it would stop the job's writers at their next commit.
                hint = (
                    ""
                    if e.newer  # a read-only Checkpointer cannot read it either
                    else "; to only restore its checkpoints in another program (an eval script), build the "
                    "Checkpointer with read_only=True"
                )
                outcome = ("owner", f"{e}{hint}", e.owner)
            except MisplacedUriError as e:
                outcome = ("misplaced", str(e), None)
            except StorageError as e:
                kind = "refused" if isinstance(e, PermanentStorageError) else "storage"
                outcome = (kind, f"{doing}: {e}", None)
        kind, message, owner = self._broadcast(outcome)
        if kind == "owner":
            raise CheckpointOwnershipError(message, uri=self.storage.uri, job=self.config.job, owner=owner)
        if kind == "misplaced":
            raise CheckpointUriError(message)
        if kind in ("storage", "refused"):
            raise self._storage_failure(message, permanent=kind == "refused")

    def _check_next_step(self, step: Any, call: str) -> int:
        value = _check_step(step, call)
        if self._last_step is not None and value < self._last_step:
            raise ValueError(
                f"{call}: step {value} is lower than the last step ({self._last_step}); steps count completed "
                "training steps and never go back (a checkpoint of a lower step would sort below the newer ones)"
            )
        return value
