"""The save pipeline: stage, then in the background write and checksum each rank's files, upload
them, and (rank 0) commit MANIFEST.json create-only unless fenced; and the preemption flush."""

from __future__ import annotations

import errno
import logging
import os
import shutil
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from agent import rank_state
from agent._dcp_plan import DivergentReplicasError, SavePlanCache, dcp_save
from agent._dcp_write import ChecksummedFile, make_writer, sync_files
from agent._direct_io import release_buffers
from agent._staging import make_stager, stage_state
from agent.catalog import CheckpointRef, WrittenManifest, find_checkpoints
from agent.checkpoint import _claim
from agent.checkpoint._core import STAGING_LOCK, lock_staging_folder, size_text
from agent.checkpoint._vote import _Voting
from agent.checkpoint.errors import FencedSaveError, FlushFailedError, SaveFailedError, _is_infrastructure
from agent.control_channel import FlushRequest, FlushResult
from agent.crc32c import to_hex
from agent.dcp_safe import TensorIndexCache, load_dcp_metadata, tensor_index
from agent.manifest import DCP_METADATA_NAME, MANIFEST_NAME, MAX_MANIFEST_BYTES, FileEntry, Manifest, now_utc
from agent.ownership import FencedError, describe_job
from agent.restore_cache import default_staging
from agent.storage import AlreadyExistsError, PermanentStorageError, RetainedError, StorageError, put_files

log = logging.getLogger("agent.checkpoint")  # one logger for the package, as before it was split

T = TypeVar("T")


_in_flight: dict[int, _Save] = {}
"""Background saves not yet done, by ``id``: the interpreter's exit waits for them."""
_in_flight_lock = threading.Lock()
_exit_hook = False


def _wait_at_exit(save: _Save) -> None:
    """Have the interpreter's exit wait for ``save`` before thread pools stop taking work.

    When the main thread ends (a crash, or a script without ``close()``), Python first stops every
    ``concurrent.futures`` pool from taking new work, then joins the save thread, which is not a
    daemon: the save then failed at its next pool ("cannot schedule new futures after interpreter
    shutdown") and a checkpoint already staged was lost. ``threading``'s exit hooks run in reverse
    order of registration, so this one, registered after the pools', waits for the save first.
    Without that hook (another Python), the exit behaves as before. A forked child (a data-loader
    worker) inherits the hook but not the save thread: it waits for nothing.
    """
    global _exit_hook
    with _in_flight_lock:
        _in_flight[id(save)] = save
        if _exit_hook:
            return
        _exit_hook = True
        register = getattr(threading, "_register_atexit", None)
        if register is None:
            return
        os.register_at_fork(after_in_child=_forget_in_child)
        import concurrent.futures.thread  # noqa: F401  # its hook registered first, so it runs last

        try:
            register(_finish_saves_in_flight)
        except RuntimeError:  # the interpreter is already exiting
            pass


def _finish_saves_in_flight() -> None:
    with _in_flight_lock:
        saves = list(_in_flight.values())
    for save in saves:
        if save.done.is_set() or save.thread is None:
            continue
        save.go.set()
        log.info("the script ended with the save of step %d in flight: finishing it before exit", save.step)
        while not save.done.wait(0.5) and save.thread.is_alive():
            pass


def _forget_in_child() -> None:
    """(a forked child) The saves are the parent's threads' to finish; the lock may have been held."""
    global _in_flight_lock
    _in_flight_lock = threading.Lock()
    _in_flight.clear()


def _wait_for_saves_elsewhere(uri: str) -> None:
    """(restore, after its own save) Wait for the saves still in flight to ``uri`` in this process: a
    Checkpointer on the same URI that was never closed (a script that builds one per epoch).
    Listing the checkpoints before they commit would restore the one before them into the live
    state. Their failures are theirs to report (their thread logged them); this only waits."""
    with _in_flight_lock:
        saves = [s for s in _in_flight.values() if s.uri == uri and s.thread is not None]
    for save in saves:
        if save.done.is_set():
            continue
        log.warning(
            "restore: another Checkpointer on %s in this process has a save in flight (step %d); waiting for "
            "it to commit first. close() a Checkpointer before building another on the same URI",
            uri,
            save.step,
        )
        while not save.done.wait(_WAIT_SLICE_S) and save.thread is not None and save.thread.is_alive():
            pass


def _done_at_exit(save: _Save) -> None:
    with _in_flight_lock:
        _in_flight.pop(id(save), None)


@dataclass
class _Save:
    """One save in flight."""

    step: int
    started: float
    local_dir: str
    metadata: dict[str, Any]
    state_keys: list[str]
    rank_bytes: memoryview
    writer: Any = None
    cancel: threading.Event = field(default_factory=threading.Event)
    """Set when a flush supersedes this save: its write stops at the next block, nothing is committed."""
    number: int = 0
    """Which save of this Checkpointer it is (1, 2, ...): the same on every rank, as every rank
    starts the same saves (numbered once they agreed on it)."""
    given_up: bool = False
    """Some rank had set ``cancel`` when the save gathered its ranks' outcomes: the same on every
    rank, so every rank judges the save's failure alike (``_supersede``), whatever its own flag."""
    staged: Any = None
    """The staged DCP state the background thread writes (None: written already, or none)."""
    from_rank0: frozenset[str] = frozenset()
    """Names in ``staged`` written from rank 0's copy (``_State._from_rank0``)."""
    flush: FlushRequest | None = None
    trigger: str = "save"
    uri: str = ""
    """The store's URI (``storage.uri``): a restore through another Checkpointer on it waits."""
    done: threading.Event = field(default_factory=threading.Event)
    go: threading.Event = field(default_factory=threading.Event)
    """Set when the save thread may start its work: once the call that started the save returns
    (``_Saving._let_save_run``). Set sooner, the thread's Python work would hold the GIL while
    that call still runs, and ``Thread.start()`` alone waited out a switch interval (5 ms) for it."""
    error: BaseException | None = None
    committed_uri: str | None = None
    thread: threading.Thread | None = None
    folder_lock: int | None = None
    """The descriptor holding the lock on this save's staging folder (``lock_staging_folder``)."""
    claim_id: str = ""
    """(rank 0) The id in the claim (``_claim``) of the folder this save writes into."""
    claim: _claim.Claim | None = None
    """(rank 0) The claim written into the folder this save writes into."""
    renewal: _claim.Renewal | None = None
    """(rank 0) Renews the claim while the save is in flight; stopped before the commit (made
    before the folder is named, so a stop that comes first is never missed)."""
    committed_before: frozenset[str] = frozenset()
    """(rank 0) The folders of this step committed when this save named its own: one committed
    since is another writer's save of the same step, and this one's commit then fails."""
    interrupt: BaseException | None = None
    """A ``KeyboardInterrupt`` or ``SystemExit`` (a signal handler's) that arrived while the calling
    thread ran the save (a synchronous save, a flush): the save runs its collectives to the end and
    commits nothing, then ``wait()`` raises this instead of a ``SaveFailedError``, so the script
    stops the way the signal asked (exit code, ``except KeyboardInterrupt``)."""

    def note(self, e: BaseException, rank: int) -> None:
        """Keep the first interrupt that stopped a part of this save on ``rank`` (see ``interrupt``).
        DCP wraps whatever stops a rank's part of its collectives (the write of the shards) in a
        ``CheckpointException`` holding every rank's failure: only this rank's own is its interrupt
        (another rank's Ctrl-C is that rank's; here the save just failed)."""
        if isinstance(e, CheckpointException):
            own = e.failures.get(rank)
            if own is None:
                return
            e = own[0] if isinstance(own, tuple) else own
        if self.interrupt is None and isinstance(e, KeyboardInterrupt | SystemExit):
            self.interrupt = e

    def unlock(self) -> None:
        """Let go of the staging folder's lock (the folder is removed, or left to be cleaned)."""
        if self.folder_lock is not None:
            os.close(self.folder_lock)
            self.folder_lock = None


_WAIT_SLICE_S = 0.25
"""How often ``wait()`` wakes while a save is in flight, so that a signal's handler runs (see there)."""


def _keys_differ(keys_by_rank: list[list[str]]) -> list[str]:
    """(rank 0, before the commit) The error when the ranks handed states with other keys: the
    manifest records rank 0's, so a rank's own key would make the checkpoint refuse the very state
    that saved it (``MissingStateKeysError`` on restore), and a key only rank 0 holds is absent
    from the other ranks' files."""
    first = set(keys_by_rank[0])
    for rank, keys in enumerate(keys_by_rank[1:], start=1):
        if set(keys) != first:
            only_0, only_r = sorted(first - set(keys)), sorted(set(keys) - first)
            return [
                f"the ranks handed states with other keys: rank 0's holds {sorted(first)}, rank {rank}'s "
                f"{sorted(keys)} (only rank 0: {only_0}, only rank {rank}: {only_r}); every rank must hand the "
                "same keys (a rank without a part of the model hands it empty), or the checkpoint would not "
                "restore into the state that saved it"
            ]
    return []


def _writing_failure(e: BaseException, staging: str, uri_dir: str | None = None) -> str:
    """Why writing a rank's files to ``staging`` failed, in words: DCP's ``CheckpointException``
    unwrapped to the error it holds (its repr is a page of stack frames), and a full disk or quota,
    a disk's I/O error, a read-only or unwritable folder said as such, with where and what to do.

    Staged in a filesystem URI's own ``.spotjob-staging`` (the default there), the disk that
    refused is the checkpoints' own: staging elsewhere would only move the failure to where the
    files go next, and "keep fewer checkpoints" is offered only while more than one is there."""
    if isinstance(e, CheckpointException) and e.failures:
        first = next(iter(e.failures.values()))
        e = first[0] if isinstance(first, tuple) else first
    if isinstance(e, DivergentReplicasError):
        return str(e)
    elsewhere = "(Checkpointer(staging_dir=...) or SPOTJOB_STAGING_DIR)"
    # ``uri_dir``: the filesystem store's folder that the staging folder is the default one of;
    # None for a staging folder of its own (``staging_dir``, or an object store's in the temp folder).
    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
        where = f"{e.strerror} ({e.filename or staging})"
        if uri_dir is None:
            return (
                f"{where}: the disk of the staging folder {staging} is full or over its quota; free space "
                f"there, or stage on another disk {elsewhere}"
            )
        try:
            committed = sum(
                1
                for d in os.scandir(uri_dir)
                if d.name.startswith("step-") and os.path.exists(os.path.join(d.path, MANIFEST_NAME))
            )
        except OSError:
            committed = 0
        fewer = f", keep fewer checkpoints (keep=...; {committed} are there)" if committed > 1 else ""
        return (
            f"{where}: the filesystem of the checkpoint URI {uri_dir} is full or over its quota (saves stage "
            f"in {staging}, inside it, and link their files into place); free space there{fewer}, or save to "
            "a URI on a disk with room. Staging elsewhere cannot help: the checkpoint is written to that "
            "disk all the same"
        )
    if isinstance(e, OSError) and e.errno == errno.EIO:
        return (
            f"{e.strerror} ({e.filename or staging}): the disk of the staging folder {staging} failed to "
            "write or sync this rank's files, so their bytes cannot be trusted and nothing was committed; "
            "the checkpoints committed before are untouched. Check that disk (the kernel log names the "
            + (
                f"fault), or save to a URI on another disk: the checkpoints of {uri_dir} are on this one too"
                if uri_dir is not None
                else f"fault), or stage on another one {elsewhere}"
            )
        )
    if isinstance(e, OSError) and e.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
        why = "is on a read-only filesystem" if e.errno == errno.EROFS else "is not writable by this user"
        if uri_dir is None:
            return (
                f"{e.strerror} ({e.filename or staging}): the staging folder {staging} {why}; stage in a "
                f"folder this process can write {elsewhere}"
            )
        fix = "mount it read-write" if e.errno == errno.EROFS else f"give uid {os.geteuid()} write access there"
        return (
            f"{e.strerror} ({e.filename or staging}): the checkpoint URI's folder {uri_dir} {why} (saves stage "
            f"in {staging}, inside it); {fix}, or save to a URI this process can write"
        )
    return repr(e)


def _run_into(future: Future[T], fn: Callable[..., T], *args: Any) -> None:
    """``fn(*args)``'s result or exception into ``future`` (a thread's whole work)."""
    try:
        future.set_result(fn(*args))
    except BaseException as e:
        future.set_exception(e)


_STOP_ONE = (
    "the same script started twice, or a stale copy that no attempt number fences (spotjob-agent --attempt, "
    "set by the controller). Stop one; a job of its own needs a URI of its own"
)


def _two_writers(claim: _claim.Claim | None, me: str, remedy: str) -> str:
    """Who the two writers of the URI are: two Checkpointers of this process when ``claim`` (the
    other writer's, None when unknown) is this process's and not the Checkpointer ``me``'s; else two
    processes, with ``remedy``."""
    if claim is not None and claim.of_another_checkpointer_here(me):
        return (
            "Two Checkpointers of this process are saving to this URI: use one Checkpointer per URI in a "
            "process (close() the old one before building another on the same URI)"
        )
    return f"Two processes are saving to this URI: {remedy}"


class _Saving(_Voting):
    """One save at a time: started by ``step()``/``save()``/a flush, finished in the background."""

    _inflight: _Save | None
    _saves_started: int
    _fenced: FencedSaveError | None
    _direct_io: bool
    _plan_cache: SavePlanCache
    _tensor_index: TensorIndexCache

    def wait(self) -> None:
        """Block until the save in flight (if any) is committed; raise if it failed."""
        save = self._inflight
        if save is None:
            return
        self._check_process("wait()")
        save.go.set()
        # In slices: a Ctrl-C the kernel hands to another thread of the process (the save's, a
        # transfer's) only sets Python's flag, and the main thread blocked in one long wait would
        # not run the handler until the save is over. Waking each slice, it raises within one.
        while not save.done.wait(_WAIT_SLICE_S):
            pass
        if save.thread is not None:
            save.thread.join()
        self._inflight = None
        if save.interrupt is not None:
            raise save.interrupt
        if save.error is not None:
            kind = type(save.error) if isinstance(save.error, SaveFailedError) else SaveFailedError
            error = kind(f"checkpoint of step {save.step} in {self.storage.uri} failed: {save.error}")
            if isinstance(error, FencedSaveError):
                self._fenced = error
            raise error from save.error

    def _flush(self, step: int, state: Mapping[str, Any], metadata: dict[str, Any]) -> None:
        request = self._control.flush_request() if self._control is not None else None
        reason = request.reason if request else "a peer rank's notice"
        log.warning("flush: %s; committing step %d on all %d ranks", reason, step, self.world_size)
        self._status.state = "flushing"
        self._status.step = step
        self._report(force=True)
        if request and request.deadline:
            left = request.deadline - time.time()
            if left <= 0:
                log.warning(
                    "flush: the deadline passed %.1fs ago; trying anyway, as long as spotjob-agent lets the ranks "
                    "run (an unfinished save leaves no manifest, so restore cannot mistake it for a checkpoint)",
                    -left,
                )
            elif self.last_save_seconds and left < self.last_save_seconds:
                log.warning(
                    "flush: %.1fs left before the deadline but the last save took %.1fs; trying anyway "
                    "(an unfinished save leaves no manifest, so restore cannot mistake it for a checkpoint)",
                    left,
                    self.last_save_seconds,
                )
        try:
            inflight = self._inflight
            same_step = inflight is not None and inflight.step == step
            if inflight is not None and same_step:
                inflight.flush = request
                inflight.trigger = "flush"  # read by the commit, which has not happened yet or is this flush
            # A commit of this very step (a save() the script made, already waited for): the
            # flush's checkpoint is there. Every rank holds the same last commit (its outcome is
            # broadcast), so every rank skips alike.
            already = inflight is None and self.last_committed_step == step and self.last_committed_uri is not None
            if already:
                log.info(
                    "flush: step %d is committed already at %s; nothing more to write", step, self.last_committed_uri
                )
            elif not self._supersede(inflight, give_up=not same_step) or not same_step:
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

    def _supersede(self, inflight: _Save | None, *, give_up: bool = True) -> bool:
        """(every rank, at the flush's step) Settle the save in flight before the flush writes;
        whether it committed.

        ``give_up``: it holds an older step than the flush is about to commit, and the disk cannot
        write both in the time the notice leaves: waiting for it would about double the time to
        the flush's commit. Every rank stops writing at its next block; the save then fails on
        every rank alike (DCP gathers the failure) and commits nothing; the previous commit stays
        the newest until the flush's. A save whose writing was already done goes on to its commit.

        A save that failed, given up or on its own (a store that refused it, a rank's per-rank
        state), is logged and the flush goes on: the notice is the moment that matters, the flush
        writes the newer state, and if the store still refuses, the flush fails with its own
        error. Every rank holds the save's gathered outcome, so every rank goes on alike, whenever
        its own save thread finished. Only a fenced save (another writer owns the URI) stops it.
        """
        if inflight is None:
            return False
        if give_up and not inflight.done.is_set():
            inflight.cancel.set()
        try:
            self.wait()
        except FencedSaveError:
            raise
        except SaveFailedError as e:
            if inflight.given_up:
                log.info("flush: the save of step %d in flight was given up for the flush (%s)", inflight.step, e)
            else:
                log.error("flush: the save of step %d failed (%s); the flush writes its step anyway", inflight.step, e)
            return False
        return True

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
        started = time.monotonic()
        # Everything a rank does alone before the save's collectives (check the state, serialise its
        # own objects, make its folder, stage the tensors) is done first, and its outcome rides on
        # the step agreement: a rank that failed here raises, and so does every other rank, instead
        # of leaving them in the save's collectives waiting for a rank that never joins.
        # A Ctrl-C (or a signal handler's exit) while this rank prepares is a failure to prepare
        # too: the other ranks learn of it in the agreement instead of waiting there for this one,
        # and this rank then raises the interrupt itself.
        save: _Save | None = None
        problem: Exception | None = None
        interrupt: KeyboardInterrupt | SystemExit | None = None
        try:
            save = self._prepare_save(step, state, metadata, flush, blocking, trigger, started)
        except Exception as e:
            problem = e
        except (KeyboardInterrupt, SystemExit) as e:
            interrupt = e
        try:
            keys = [str(k) for k in state] if isinstance(state, Mapping) else []
            failed_rank, keys_differ = self._agree_on_step(
                step, keys, failed=problem is not None or interrupt is not None
            )
            # Every rank learned it alike: every rank gathers the keys, whatever it prepared.
            differ = _keys_differ(self._all_gather(keys, self._ctl_pg)) if keys_differ else []
        except BaseException:
            self._discard_prepared(save)
            raise
        if interrupt is not None:
            self._discard_prepared(save)
            raise interrupt
        if differ:
            self._discard_prepared(save)
            raise SaveFailedError(
                f"checkpoint of step {step} in {self.storage.uri} failed: {differ[0]}; nothing was written"
            )
        if problem is not None or failed_rank is not None:
            self._discard_prepared(save)
            if isinstance(problem, ValueError | TypeError):
                raise problem  # the state handed in does not fit: the caller's to mend
            if problem is not None:
                raise SaveFailedError(
                    f"rank {self.rank}: preparing the checkpoint of step {step} in {self.storage.uri} failed: "
                    f"{_writing_failure(problem, self._staging_root, self._staged_in_uri())}; nothing was written"
                ) from problem
            raise SaveFailedError(
                f"rank {failed_rank} could not prepare the checkpoint of step {step} in {self.storage.uri} "
                "(see its log); nothing was written"
            )
        assert save is not None
        self._saves_started += 1
        save.number = self._saves_started
        self._restart_deadline()
        background = self.config.async_save and not blocking
        self.last_blocking_seconds = time.monotonic() - started
        self._last_saved_step = step
        self._inflight = save
        self._status.state = "saving" if self._status.state != "flushing" else "flushing"
        if background:
            # The thread waits for ``save.go`` (set when this call returns, ``_let_save_run``):
            # started right into its Python work (DCP's local planning, on a rank other than 0),
            # it held the GIL for a switch interval (5 ms) while ``start()`` waited to hear it had
            # started. The staging copy is complete by now either way.
            save.thread = threading.Thread(
                target=self._finish_save_once_let_go, args=(save,), name="spotjob-save", daemon=False
            )
            save.uri = self.storage.uri
            _wait_at_exit(save)
            try:
                save.thread.start()
            except RuntimeError as e:
                # "can't start new thread": a pids or ulimit -u limit reached. The save is staged
                # and the other ranks are in its collectives already: finish it here instead of
                # raising with a save in flight that no thread runs (every rank then hung).
                log.warning(
                    "rank %d: could not start the save thread of step %d (%s: a process or thread limit, "
                    "ulimit -u or the pod's pids limit, reached?); saving in this thread, the loop waits",
                    self.rank,
                    step,
                    e,
                )
                save.thread = None
                background = False
        if not background:
            self._finish_save(save)
            self.wait()  # a synchronous save reports its failure from the call that made it

    def _staged_in_uri(self) -> str | None:
        """The filesystem store's folder when saves stage in its own ``.spotjob-staging`` (the
        default there): then the disk that refuses is the checkpoints' own. None otherwise."""
        uri_dir = self.storage.local_path("")
        if uri_dir is None:
            return None
        own = os.path.abspath(default_staging(self.storage, self.config.job))
        return uri_dir if os.path.abspath(self._staging_root) == own else None

    @staticmethod
    def _discard_prepared(save: _Save | None) -> None:
        """A prepared save that will not run: its folder goes, its staged tensors are let go."""
        if save is not None:
            shutil.rmtree(os.path.dirname(save.local_dir), ignore_errors=True)
            save.unlock()
            save.staged = None

    def _prepare_save(
        self,
        step: int,
        state: Mapping[str, Any],
        metadata: dict[str, Any],
        flush: FlushRequest | None,
        blocking: bool,
        trigger: str,
        started: float,
    ) -> _Save:
        """(every rank, alone) The save of ``step``: the state checked, this rank's objects
        serialised, its folder made and (in the background case) its tensors staged."""
        self._check_state(state)
        dcp_state, objects = self._split_state(state)
        self._check_extra_state_tensors(dcp_state)
        self._check_values_loadable(dcp_state)
        rank_bytes = rank_state.encode(
            {
                "step": step,
                "rank": self.rank,
                "world_size": self.world_size,
                "objects": objects,
                "rng": rank_state.capture_rng(),
            }
        )
        local_dir = os.path.join(self._staging_root, f"step-{step:09d}-{uuid.uuid4().hex[:8]}", f"rank-{self.rank}")
        save = _Save(
            step=step,
            started=started,
            local_dir=local_dir,
            metadata=metadata,
            state_keys=list(state.keys()),
            rank_bytes=rank_bytes,
            flush=flush,
            trigger="flush" if flush is not None or blocking else trigger,
            from_rank0=self._from_rank0(state, dcp_state),
        )
        # Locked before the rank's folder is made in it: another process's cleaning never removes it.
        save.folder_lock = lock_staging_folder(os.path.dirname(local_dir))
        try:
            os.makedirs(local_dir, exist_ok=True)
            modules, optims, _ = self._classify(state)
            # DCP's save is collective: where some ranks hold nothing of the state's modules (a
            # pipeline stage without parameters) it still runs on every rank, or the others wait for it.
            if dcp_state or (self._dist and self.world_size > 1 and (modules or optims)):
                save.writer = make_writer(
                    local_dir,
                    durable=self.storage.local_path("") is not None,
                    direct=self._direct_io,
                    any_size=self.config.direct_io is True,
                    cancel=save.cancel,
                )
                if self.config.async_save and not blocking:
                    if self._stager is None:
                        self._stager = make_stager()
                    save.staged = stage_state(self._stager, dcp_state)
                else:
                    save.staged = dcp_state  # written below, from the live tensors
        except BaseException:
            save.unlock()  # the folder stays, for the next Checkpointer's cleaning
            raise
        return save

    def _let_save_run(self) -> None:
        """(the end of ``step()`` and ``save()``, whatever they raise) Let the save thread this call
        started begin its work (``_Save.go``)."""
        save = self._inflight
        if save is not None:
            save.go.set()

    def _finish_save_once_let_go(self, save: _Save) -> None:
        """(the save thread) ``_finish_save`` once the call that started the save returned."""
        save.go.wait()
        self._finish_save(save)

    def _finish_save(self, save: _Save) -> None:
        """(every rank, background) write, upload, then (rank 0) commit. Always runs every collective.

        Whatever happens, ``save.done`` is set: a save thread that died without it would leave
        ``wait()`` (and ``close()``) blocked forever and the failure unreported.
        """
        try:
            self._write_upload_commit(save)
        except BaseException as e:
            save.note(e, self.rank)
            if save.committed_uri is None and save.error is None:
                save.error = SaveFailedError(f"rank {self.rank}: the save stopped unexpectedly: {e!r}")
                if self._dist and not (dist.is_available() and dist.is_initialized()):
                    # Not a fault to trace: the script destroyed the group under the save, which
                    # close() then says in its error. torch's traceback stays at debug level.
                    log.error(
                        "checkpoint of step %d failed, nothing committed: torch.distributed's process group was "
                        "destroyed while it was in flight (call close() before destroy_process_group())",
                        save.step,
                    )
                    log.debug("the save's failure", exc_info=e)
                else:
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
                release_buffers()
            save.unlock()
            if save.renewal is not None:
                save.renewal.stop()
            _claim.release(save.claim_id)
            save.done.set()
            _done_at_exit(save)

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
            save.claim_id = _claim.new_id(self._checkpointer_id)
            _claim.hold(save.claim_id)  # released when the save is done (``_finish_save``)
            save.renewal = _claim.Renewal(self.storage)
            try:
                threading.Thread(
                    target=self._name_then_renew, args=(naming, save), name="spotjob-name", daemon=True
                ).start()
            except RuntimeError:  # "can't start new thread" (a process limit): named before writing instead
                _run_into(naming, self._target_folder, save)  # the claim then goes unrenewed
        rank_file = os.path.join(save.local_dir, rank_state.rank_file_name(self.rank))
        try:
            written: dict[str, tuple[int, int]] = {}
            if save.staged is not None:
                dcp_save(
                    save.staged,
                    save.writer,
                    process_group=self._save_pg,
                    no_dist=not self._dist,
                    from_rank0=save.from_rank0,
                    plan_cache=self._plan_cache,
                )
                written.update(save.writer.written)
            with ChecksummedFile(rank_file) as f:
                f.write(save.rank_bytes)
            written[os.path.basename(rank_file)] = (f.crc, f.size)
            if save.writer is not None and save.writer.durable:
                # One wait for the disk, for every file of this rank, after the last is written.
                sync_files([os.path.join(save.local_dir, n) for n in written], self.config.io_threads)
            files = [(n, size, to_hex(crc)) for n, (crc, size) in sorted(written.items())]
        except BaseException as e:  # reported to every rank below, never swallowed
            save.note(e, self.rank)
            error = (
                f"rank {self.rank}: writing the shards failed: "
                f"{_writing_failure(e, save.local_dir, self._staged_in_uri())}"
            )
            infra = _is_infrastructure(e)
        if error is None:
            # Every save, on every rank, off the training's path: a checkpoint whose per-rank state
            # would not load is never committed. Its verdict rides on the save's one gather below.
            try:
                self._check_rank_file(rank_file, written[os.path.basename(rank_file)][1])
            except SaveFailedError as e:
                error = f"rank {self.rank}: {e}"
            except BaseException as e:
                save.note(e, self.rank)
                error = f"rank {self.rank}: reading back {rank_file} failed: {e!r}"
                infra = _is_infrastructure(e)
        target: tuple[str | None, str | None] = (None, None)  # (folder, why this attempt is fenced)
        if naming is not None:
            try:
                target = (naming.result(), None)
            except FencedError as e:
                target = (None, str(e))
            except BaseException as e:  # any error at all: the other ranks wait in the broadcast below
                save.note(e, self.rank)
                if error is None:
                    where = f"the folder of step {save.step} in {self.storage.uri}"
                    error = f"rank 0: cannot prepare {where}: {type(e).__name__}: {e}"
                    infra = _is_infrastructure(e)
        folder, fenced = self._broadcast(target, group=self._save_pg)
        if error is None and folder is not None:
            try:
                put_files(
                    self.storage,
                    [(os.path.join(save.local_dir, n), f"{folder}/{n}", int(c, 16)) for n, _, c in files],
                    parallelism=self.config.io_threads,
                    synced=save.writer is not None and save.writer.durable,  # by sync_files above
                )
            except BaseException as e:
                save.note(e, self.rank)
                # A StorageError already says what, where and what to do; anything else by its type too.
                said = str(e) if isinstance(e, StorageError) else repr(e)
                error, infra = f"rank {self.rank}: upload failed: {said}", _is_infrastructure(e)
        elif error is None and fenced is None:
            error = "rank 0 could not name the checkpoint folder"
        gathered = self._all_gather((files, error, infra, save.cancel.is_set(), save.state_keys), group=self._save_pg)
        if save.renewal is not None:
            # Every rank's files are written: nothing renews the claim after this (the commit, or
            # the removal of the failed save's files, must not meet a claim written again).
            save.renewal.stop()
        save.given_up = any(cancelled for _, _, _, cancelled, _ in gathered)
        outcome: tuple[str | None, str | None, bool, bool] = (None, fenced, fenced is not None, False)
        commit_files: list[tuple[str, int, str]] = []
        committed_bytes = 0
        if self.rank == 0 and fenced is None:
            errors = [e for _, e, _, _, _ in gathered if e] or _keys_differ([keys for *_, keys in gathered])
            if errors:
                outcome = (None, "; ".join(errors), False, any(i for _, _, i, _, _ in gathered))
            else:
                try:
                    commit_files = [f for fs, *_ in gathered for f in fs]
                    committed_bytes = sum(size for _, size, _ in commit_files)
                    outcome = (self._commit(save, folder or "", commit_files), None, False, False)
                except FencedError as e:
                    outcome = (None, str(e), True, False)
                except BaseException as e:  # any error at all: the other ranks wait for the outcome
                    save.note(e, self.rank)
                    where = self.storage.url(folder or "")
                    why = f"rank 0: committing {where} failed: {type(e).__name__}: {e}"
                    outcome = (None, why, False, _is_infrastructure(e))
        uri, failure, was_fenced, infra_failure = self._broadcast(outcome, group=self._save_pg)
        seconds = time.monotonic() - save.started
        if failure is None and uri is not None:
            save.committed_uri = uri
            self._committed_beside = save.committed_before
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
                log.info(
                    "committed step %d at %s in %.2fs (%s in %d files)",
                    save.step,
                    uri,
                    seconds,
                    size_text(committed_bytes),
                    len(commit_files),
                )
                if save.trigger != "flush":  # a flush reports its commit first, then retains
                    self._retain(CheckpointRef.parse(uri.rsplit("/", 1)[-1]) or CheckpointRef(save.step))
        elif was_fenced:
            save.error = FencedSaveError(
                f"nothing committed or deleted: {failure}. This worker belongs to a superseded attempt "
                f"({self.config.attempt}) of {self.config.job!r} and must stop"
            )
            log.error("checkpoint of step %d not committed: %s", save.step, failure)
        elif save.given_up:
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
        if save.committed_uri is None and not was_fenced and self.rank == 0 and folder is not None:
            self._remove_unfinished(folder, save.claim_id)
        shutil.rmtree(save.local_dir, ignore_errors=True)
        try:
            # Its lock file first: this save is done with the folder (a cleaner that locks a new one
            # meanwhile removes nothing of it but the folder).
            os.unlink(os.path.join(os.path.dirname(save.local_dir), STAGING_LOCK))
            os.rmdir(os.path.dirname(save.local_dir))
        except OSError:
            pass
        self._report(force=True)
        save.done.set()

    def _name_then_renew(self, naming: Future[str], save: _Save) -> None:
        """(rank 0, the naming thread) Name and claim the save's folder, then renew the claim until
        the save's files are written (``_claim.Renewal``): no thread of its own for it."""
        _run_into(naming, self._target_folder, save)
        if save.renewal is not None and save.claim is not None and naming.exception() is None:
            save.renewal.run(naming.result(), save.claim)

    def _target_folder(self, save: _Save) -> str:
        """(rank 0) The folder this step's save goes to, claimed for it (``_claim``); clears an
        uncommitted leftover there.

        A leftover is removed only when it is claimed by a writer that is gone, judged as retention
        judges it (``_claim.writer_alive_in``: the store's clock for another machine's renewed
        claim); one another writer may still be saving into (a second process of this job on the
        URI), or one with no claim
        (a spotjob from before claims may be saving into it), is passed over like a committed
        folder, as is one that cannot be deleted — the bucket keeps it (a GCS retention policy or
        hold, S3 Object Lock), or deletes are refused for good (a bucket policy that denies them):
        the save goes to the next suffix, ``step-N.1``. The folder is claimed create-only; a
        claim that loses the race to another writer's moves on to the next suffix too. A transient
        failure propagates. Raises ``FencedError`` (before anything is written) when this attempt
        is superseded.
        """
        step = save.step
        self._check_fence()
        suffix = 0
        committed: set[str] = set()
        store_times: list[float | None] = []  # the store's time, read once a save when needed

        def store_now() -> float | None:
            if not store_times:
                store_times.append(_claim.store_time_now(self.storage))
            return store_times[0]

        refs = find_checkpoints(self.storage)
        if self._began_with is None:
            self._began_with = frozenset(r.folder for r in refs)
        for ref in refs:
            if ref.step != step:
                continue
            if self.storage.stat(ref.key(MANIFEST_NAME)) is not None:
                if ref.folder not in self._own_folders and _claim.others_open(self._checkpointer_id):
                    # Another Checkpointer of this process (not closed) committed the step: saving
                    # it again beside it (step-N.1) committed a second copy of the step, and
                    # retention then removed the first one's as an older copy, without a word. One
                    # read of its claim, and none while this Checkpointer is the process's only one
                    # (a flush at the step just restored).
                    other = _claim.read_claim(self.storage, ref.folder)
                    if other is not None and other.of_another_open_checkpointer(self._checkpointer_id):
                        raise SaveFailedError(self._committed_by_another(ref.folder, other))
                suffix = max(suffix, ref.attempt + 1)
                committed.add(ref.folder)
                continue
            self._seen_uncommitted.add(ref.folder)
            claim, written = _claim.read_claim_stamped(self.storage, ref.folder)
            if claim is None:
                # Unclaimed: a spotjob from before claims (2026-12-05) saving into it now, which
                # would write its files over this save's, or a save that died before its claim
                # landed. Beside it, either way; retention removes it as it does any unfinished one.
                log.warning(
                    "saving step %d next to %s: an unfinished save there has no claim (a spotjob from before "
                    "2026-12-05 claims none, and may still be saving into it)",
                    step,
                    self.storage.url(ref.folder),
                )
                suffix = max(suffix, ref.attempt + 1)
                continue
            # Judged as retention judges it (the store's clock for a renewed claim of another
            # machine): a folder retention would remove is reused, not saved beside.
            if _claim.writer_alive_in(claim, written, self.config.attempt, store_now):
                log.warning(
                    "saving step %d next to %s: %s may still be saving into it. %s",
                    step,
                    self.storage.url(ref.folder),
                    claim.describe_to(self._checkpointer_id),
                    _two_writers(claim, self._checkpointer_id, "stop one"),
                )
                suffix = max(suffix, ref.attempt + 1)
                continue
            log.info("removing leftover of an unfinished save in %s", self.storage.url(ref.folder))
            self._check_fence()
            try:
                self.storage.delete_prefix(ref.folder + "/")
            except RetainedError as e:
                log.warning("saving step %d next to the leftover the bucket keeps: %s", step, e)
                suffix = max(suffix, ref.attempt + 1)
            except PermanentStorageError as e:
                log.warning("saving step %d next to the leftover that cannot be removed: %s", step, e)
                suffix = max(suffix, ref.attempt + 1)
        save.committed_before = frozenset(committed)
        claim = _claim.Claim.mine(save.claim_id, self.config.job, self.config.attempt)
        mine = claim.to_json()
        removed = 0
        while True:
            folder = CheckpointRef(step, suffix).folder
            try:
                self.storage.put_bytes_if_absent(f"{folder}/{_claim.CLAIM_NAME}", mine)
            except AlreadyExistsError:
                suffix += 1  # another writer claimed it a moment ago
                continue
            except PermanentStorageError as e:
                # A filesystem store: the folder just made for the claim was removed before the
                # claim was in it, by another writer's clean-up that took it for an unclaimed
                # leftover. Claim it again (made anew); the clean-up has passed by then.
                removed += 1
                if removed > 3 or not isinstance(e.__cause__, FileNotFoundError):
                    raise
                continue
            self._own_folders.add(folder)
            save.claim = claim
            return folder

    def _remove_unfinished(self, folder: str, claim_id: str) -> None:
        """(rank 0, after a save that failed, every rank done with it) Remove what it put in ``folder``.

        On a filesystem store the files are hard links to the staged ones: left there, they keep a
        whole checkpoint's blocks after staging is cleared, and on a full disk every later save
        fails for want of the space this one holds. Not when a manifest is there after all (a
        commit whose answer was lost), nor when fenced (the folder is another attempt's), nor when
        another writer's claim is there (this save's folder was removed, and claimed anew). A failure
        here is logged: the next save of the step, or retention, removes the folder instead.
        """
        try:
            if self.storage.stat(f"{folder}/{MANIFEST_NAME}") is not None:
                return
            claim = _claim.read_claim(self.storage, folder)
            if claim is not None and claim.id != claim_id:
                return  # another writer's since (this one's was removed): not this save's to clear
            self._check_fence()
            self.storage.delete_prefix(folder + "/")
            log.info("removed the files of the failed save in %s", self.storage.url(folder))
        except Exception as e:  # rank 0 alone, after the outcome: never a second failure
            log.warning("could not remove the failed save's files in %s: %s", self.storage.url(folder), e)

    def _commit(self, save: _Save, folder: str, files: list[tuple[str, int, str]]) -> str:
        """(rank 0) Write MANIFEST.json, create-only, unless fenced. Returns the committed folder's URI."""
        metadata_path = os.path.join(save.local_dir, DCP_METADATA_NAME)
        tensors = {}
        if save.writer is not None and save.writer.metadata is not None:
            tensors = self._tensor_index.index(save.writer.metadata)  # as written, without reading it back
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
        if len(data) > MAX_MANIFEST_BYTES:
            # Every reader refuses a bigger one unread: committed, it would be a checkpoint that
            # restore skips for an older one (going back in time) and retention never counts.
            listed = sum(len(t.files) for t in tensors.values())
            ranks = f"{self.world_size} rank{'s' if self.world_size > 1 else ''}"
            raise SaveFailedError(
                f"its MANIFEST.json would take {len(data)} bytes, more than the {MAX_MANIFEST_BYTES} a "
                f"restore reads: its tensor index lists {len(tensors)} tensors in {listed} shard-file entries "
                f"(from {ranks}). Nothing is committed. Save fewer tensors (flatten or fuse small "
                "parameters), give them shorter names, or save from fewer ranks"
            )
        self._check_fence()
        # The check and the manifest's write as one, for this process's Checkpointers of the URI
        # (another process's commit of the step meanwhile is told by retention, ``_say_if_twice``).
        with _claim.commit_lock(self.storage.uri):
            self._check_still_mine(save, folder)
            try:
                self.storage.put_bytes_if_absent(f"{folder}/{MANIFEST_NAME}", data)
                taken = False
            except AlreadyExistsError:
                taken = True
        if taken:
            raise SaveFailedError(self._committed_by_another(folder))
        self._hold_written(folder, WrittenManifest.of(data, manifest))
        return self.storage.url(folder)

    def _check_still_mine(self, save: _Save, folder: str) -> None:
        """(rank 0, just before the commit) Raise ``SaveFailedError`` naming the other writer when
        another process saving to this URI committed this step meanwhile (in a folder of its own),
        or removed or took over this save's folder: committing then would either make a second
        copy of the step the other writer is also saving, or name files that are gone."""
        for ref in find_checkpoints(self.storage):
            new = ref.step == save.step and ref.folder != folder and ref.folder not in save.committed_before
            if new and self.storage.stat(ref.key(MANIFEST_NAME)) is not None:
                raise SaveFailedError(self._committed_by_another(ref.folder))
        claim = _claim.read_claim(self.storage, folder)
        if claim is None or claim.id != save.claim_id:
            who = claim.describe_to(self._checkpointer_id) if claim is not None else "another writer of this URI"
            raise SaveFailedError(
                f"the files of this save in {self.storage.url(folder)} were removed while it wrote them, by "
                f"{who}; nothing is committed. {_two_writers(claim, self._checkpointer_id, _STOP_ONE)}"
            )

    def _committed_by_another(self, folder: str, claim: _claim.Claim | None = None) -> str:
        """(rank 0) Why this save's manifest could not be written: another writer committed the
        folder first. Names that writer from its manifest (best effort) and this one; ``claim``: the
        folder's claim where the caller read it already."""
        mine = self.config.attempt if self.config.attempt is not None else "none"
        me = f"{describe_job(self.config.job)} (attempt {mine})"
        try:
            other = Manifest.parse(self.storage.get_bytes(f"{folder}/{MANIFEST_NAME}"))
            attempt = other.attempt if other.attempt is not None else "none"
            who = f"{describe_job(other.job)} (attempt {attempt}, committed at {other.created_at.isoformat()})"
        except Exception as e:  # the message must not fail: say what is known
            who = f"another writer (its manifest could not be read: {type(e).__name__})"
        if claim is None:
            try:
                claim = _claim.read_claim(self.storage, folder)
            except Exception:  # as above
                claim = None
        if claim is not None and claim.of_another_checkpointer_here(self._checkpointer_id):
            who += f", another Checkpointer of this process (pid {claim.pid})"
        return (
            f"{self.storage.url(folder)} was committed meanwhile by {who}; this save is {me}. "
            f"{_two_writers(claim, self._checkpointer_id, _STOP_ONE)}"
        )

    def _failed_save_here(self) -> int | None:
        save = self._inflight
        return save.number if save is not None and save.done.is_set() and save.error is not None else None

    def _raise_agreed_failure(self, number: int) -> None:
        """(every rank, at the step the vote says some rank's background save failed) Raise it.

        Each rank's save ends with the same outcome (the failure is gathered), but each save
        thread finishes at its own moment; raising at the vote's step, not at each rank's next
        call after its thread finished, keeps a rank from training on (or waiting in the next
        collective) while its peer has stopped.

        Unless it was raised already: a ``save()``, ``wait()`` or ``close()`` between the vote and
        this step raised it on every rank (the save's outcome is gathered), and its save is no
        longer in flight, here or anywhere. A later save in flight is not that save.
        """
        save = self._inflight
        if save is None or save.number != number:
            return
        self.wait()  # this rank's save holds the same failure: raises it
        raise SaveFailedError(f"the save of step {save.step} failed on another rank; nothing was committed for it")

    def _raise_if_failed(self) -> None:
        if self._fenced is not None:
            raise self._fenced
        save = self._inflight
        if save is not None and save.done.is_set() and save.error is not None:
            self.wait()
