"""What every part of the Checkpointer shares: its state (set by ``Checkpointer.__init__``) and the
plumbing — collectives on the checkpoint's own groups, rank 0's errands, the fence, the node's
status for the agent."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import shutil
import time
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from agent.checkpoint._claim import LAPSES_AFTER_S
from agent.checkpoint.config import CheckpointConfig
from agent.checkpoint.errors import CheckpointError, RestoreError, StorageRefusedError, StorageUnavailableError
from agent.control_channel import ControlDir, RankStatus
from agent.ownership import check_not_fenced
from agent.pins import Pinner
from agent.restore_cache import default_staging, staging_dir_problem
from agent.storage import PermanentStorageError, Storage, StorageError

log = logging.getLogger("agent.checkpoint")  # one logger for the package, as before it was split

T = TypeVar("T")


_STATUS_INTERVAL_S = 1.0


def size_text(n: int) -> str:
    """``n`` bytes in decimal units, as ``spotjob ckpt list`` shows sizes: ``512 bytes``, ``4.2 MB``."""
    if n < 1000:
        return f"{n} bytes"
    value = float(n)
    for unit in ("kB", "MB", "GB", "TB"):
        value /= 1000
        if value < 1000 or unit == "TB":
            break
    return f"{value:.1f} {unit}"


class _Core:
    """The Checkpointer's shared state and plumbing; the parts (``_State``, ``_Retention``,
    ``_Voting``, ``_Saving``, ``_Restoring``) build on it and ``Checkpointer`` joins them."""

    config: CheckpointConfig
    storage: Storage
    rank: int
    world_size: int
    _dist: bool
    _node_reporter: bool
    _staging_root: str
    _save_pg: Any
    _ctl_pg: Any
    _control: ControlDir | None
    _status: RankStatus
    _status_written: float
    _last_step: int | None
    _last_saved_step: int | None
    _flushed: bool
    _start_fresh_by: str
    """What set ``config.start_fresh``: ``start_fresh=True`` passed, or ``SPOTJOB_START_FRESH``."""
    _stager: Any
    _closed: bool
    _pid: int
    _pinner: Pinner | None = None
    """(rank 0 of a read-only Checkpointer) Its pin on the checkpoint a restore reads (``agent.pins``)."""
    last_committed_step: int | None
    last_committed_uri: str | None
    last_save_seconds: float | None
    last_blocking_seconds: float | None

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

    def _storage_failure(self, message: str, *, permanent: bool) -> CheckpointError:
        """The error for a store that failed at ``message``: refused for good (no bucket, permission
        denied; the user's to fix, never reported as an infrastructure error), else unavailable."""
        if permanent:
            return StorageRefusedError(
                f"the checkpoint store {self.storage.uri} refuses this job: {message}. Retrying cannot help: "
                "fix the store or the checkpoint URI, then start the job again"
            )
        return self._unavailable(message)

    def _check_open(self, call: str) -> None:
        """(every rank, first thing in every collective call) ``close()`` released the process
        groups: a call after it would wait on groups that are gone, or on the training's own. The
        process and its process group are still the ones the Checkpointer was built in."""
        if self._closed:
            raise RuntimeError(
                f"{call}: the Checkpointer is closed; close() is the last call. Build a new "
                "Checkpointer to save or restore again"
            )
        self._check_process(call)
        if not self._dist and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            # Every rank would save and restore as the lone rank 0: each commits its own copy of
            # the same step into one folder, and a restore loads whichever rank's files won.
            raise RuntimeError(
                f"{call}: this Checkpointer was built before torch.distributed.init_process_group(), so it "
                f"works as a lone process (rank 0 of 1), but this process is rank {dist.get_rank()} of "
                f"{dist.get_world_size()}. Build the Checkpointer after init_process_group(), on every rank"
            )
        if self._dist and not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                f"{call}: torch.distributed's process group was destroyed after this Checkpointer was built, "
                "and its collectives went with it. Call close() before destroy_process_group()"
            )

    def _check_process(self, call: str) -> None:
        """A forked child (a DataLoader worker) holds a copy of the Checkpointer, not its save
        thread or its peers: its saves would commit its copy of the state as a step of the job, and
        its waits would wait for a thread that does not exist there."""
        if os.getpid() != self._pid:
            raise RuntimeError(
                f"{call}: called in process {os.getpid()}, forked from the process that built the Checkpointer "
                f"({self._pid}), e.g. in a DataLoader worker. Only the training process may call the "
                "Checkpointer: return what you need from the worker and call it in the training loop"
            )

    def _check_fence(self) -> None:
        """(rank 0) Before every commit and every delete: this attempt may still write here."""
        check_not_fenced(self.storage, self.config.job, self.config.attempt)

    def _on_rank0(self, what: str, fn: Callable[[], T]) -> T:
        """(collective) Run ``fn`` on rank 0 and hand every rank its result, or its failure: a
        storage failure as ``StorageUnavailableError`` (``StorageRefusedError`` when the store refuses
        for good), anything else as ``RestoreError``."""
        payload: tuple[str, Any] = ("", None)
        if self.rank == 0:
            try:
                payload = ("ok", fn())
            except StorageError as e:
                payload = ("refused" if isinstance(e, PermanentStorageError) else "storage", f"{what}: {e}")
            except Exception as e:
                log.debug("%s failed", what, exc_info=e)
                payload = ("error", f"{what}: {type(e).__name__}: {e}")
        kind, value = self._broadcast(payload)
        if kind in ("storage", "refused"):
            raise self._storage_failure(value, permanent=kind == "refused")
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
        on a filesystem store a full copy of a rank's shards beside the checkpoints. The folder is
        this job's own (``agent.restore_cache.staging_root``): another job's saves are elsewhere.
        A filesystem store's default staging folder, ``<uri>/.spotjob-staging``, is cleared too when
        the job now stages elsewhere (``staging_dir``, as spotjob-agent on Kubernetes always
        passes): a save killed before the job was given one left it there, and its files, hard
        links of a whole checkpoint's, kept that checkpoint's blocks on the disk after retention
        deleted its step folder.
        """
        if int(os.environ.get("LOCAL_RANK", self.rank)) != 0:
            return
        roots = [self._staging_root]
        if self.storage.local_path("") is not None:
            default = default_staging(self.storage, self.config.job)
            if os.path.abspath(default) != os.path.abspath(self._staging_root):
                roots.append(default)
        for root in roots:
            # Whatever saves in the URI's own folder is another process, and on a filesystem whose
            # locks another machine cannot see (NFS without lock service, a filesystem without
            # flock) its lock proves nothing: a folder written lately is left for a later start.
            self._clean_staging_folder(root, quiet_for=None if root == self._staging_root else LAPSES_AFTER_S)

    @staticmethod
    def _clean_staging_folder(root: str, quiet_for: float | None = None) -> None:
        """Remove the ``step-*`` folders in the staging folder ``root`` that no save holds (and,
        with ``quiet_for``, where nothing was written for that many seconds)."""
        try:
            entries = list(os.scandir(root))
        except (FileNotFoundError, NotADirectoryError):
            # Nothing staged there. A file in the way of the default staging folder is a URI
            # that is a file, which claiming the URI reports; of a given one, _check_staging_dir.
            return
        # ``restore/`` stays: spotjob-agent may be filling it for this very restore
        # (``agent.restore_cache.prefetch``); a restore clears it once it has loaded.
        # A folder whose lock is held is a save in flight in another process of the URI (an eval
        # job, or an older attempt still running, sharing a filesystem URI's ``.spotjob-staging``):
        # removing it would fail that save.
        for entry in entries:
            if entry.is_dir() and entry.name.startswith("step-"):
                if quiet_for is not None and time.time() - _newest_mtime(entry.path) < quiet_for:
                    log.debug("keeping a staging folder written in the last %.0f s: %s", quiet_for, entry.path)
                    continue
                fd = lock_staging_folder(entry.path, wait=False)
                if fd is None:
                    log.debug("keeping the staging folder of a save in flight: %s", entry.path)
                    continue
                try:
                    log.info("removing a stale staging folder left by an interrupted save: %s", entry.path)
                    shutil.rmtree(entry.path, ignore_errors=True)
                finally:
                    os.close(fd)

    def _check_staging_dir(self) -> None:
        """(every rank, at construction) A given ``staging_dir`` can hold folders, else every save
        and restore would fail on a bare ``OSError``."""
        problem = staging_dir_problem(self.config.staging_dir)
        if problem is not None:
            raise ValueError(
                f"staging_dir {problem} (Checkpointer(staging_dir=...), SPOTJOB_STAGING_DIR or spotjob-agent "
                "--staging-dir)"
            )

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


STAGING_LOCK = ".lock"
"""The file in a save's staging folder that its lock is taken on (``lock_staging_folder``)."""


def _newest_mtime(path: str) -> float:
    """The newest modification time of the folder ``path`` and of what it holds (0 when unreadable)."""
    newest = 0.0
    for folder, _, files in os.walk(path):
        for name in (folder, *(os.path.join(folder, f) for f in files)):
            with contextlib.suppress(OSError):
                newest = max(newest, os.lstat(name).st_mtime)
    return newest


def lock_staging_folder(path: str, *, wait: bool = True) -> int | None:
    """Lock the staging folder ``path`` of one save (``flock`` on its ``.lock`` file); return the
    descriptor that holds the lock until closed. The save holds it while in flight, so that
    ``_clean_stale_staging`` in another process never removes it. ``wait=False``: None when another
    process holds it, or when the folder is gone or no lock file can be opened there.

    The lock is on a regular file opened for writing, not on the folder: NFS takes a regular
    file's ``flock`` to the server, where the processes of every node see it, but keeps a folder's
    to the client that took it (and refuses an exclusive lock on a file not open for writing).
    """
    lock = os.path.join(path, STAGING_LOCK)
    while True:
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as e:
            if not wait:
                return None  # gone, or a folder this process cannot write: not its to remove
            if e.errno not in (errno.ENOENT, errno.ENOTDIR):
                raise
            os.makedirs(path, exist_ok=True)
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            os.close(fd)
            return None
        except OSError:  # a filesystem without locks: as before, nothing is protected
            return fd
        # Removed (and perhaps made again) between the open and the lock: the lock holds nothing.
        with contextlib.suppress(OSError):
            if os.stat(lock).st_ino == os.fstat(fd).st_ino:
                return fd
        os.close(fd)
        if not wait:
            return None
