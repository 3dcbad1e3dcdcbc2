"""Which writer a checkpoint folder in flight belongs to: ``<folder>/WRITER.json``, its *claim*.

Rank 0 creates the claim create-only before any rank uploads into the folder, so two writers of
one URI never share a folder: of two that pick the same one, the second goes to the next suffix
(``step-N.1``). Without it, two processes of one job without attempt numbers (the same script
started twice, an old node still training after its job was restarted elsewhere) uploaded into
the same ``step-N`` and one overwrote the files of the other's committed checkpoint, and one's
clean-up of "an unfinished save's leftover" removed the other's files in flight.

A folder with another writer's claim and no manifest is only removed (by a save of its step, by
retention) once that writer is known to be gone: on the same machine (same kernel boot and pid
namespace) when its process is gone or its save is over, or at once when a newer attempt than the
claim's is running. From another machine, a *renewed* claim (below) once the store's clock says
its last renewal is ``LAPSES_AFTER_S`` old; any other claim once it is older than
``STALE_AFTER_S`` by its own ``claimed_at`` against this writer's clock.

Renewal: while a save is in flight, its writer rewrites the claim every ``RENEW_EVERY_S`` (the
same fields, ``claimed_at`` set to the renewal's time; ``Renewal``), so a save that takes longer
than ``STALE_AFTER_S`` keeps its folder, and a crashed save's leftover goes within minutes instead
of an hour. A claim says that its writer renews it by its id (``RENEWED_PREFIX``), not by a field
of its own: the spotjob of 2026-12-05 before 03:40 UTC (the first to claim, never renewing) parses
a claim with ``cls(**raw)`` and takes one with an unknown field for no claim at all. From now on
``Claim.parse`` ignores fields it does not know.

The claim stays in the folder after the commit (nothing removes it): it names the process that
committed the checkpoint, which retention uses to tell another writer's checkpoints from this
writer's. The claim is never listed in a manifest; readers ignore it. No torch import.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, fields, replace

from agent._layout import CLAIM_NAME, PROBES_FOLDER, read_bounded_stamped
from agent.manifest import UntrustedJSONError, loads_bounded
from agent.ownership import describe_job
from agent.process_tree import boot_id, read_proc
from agent.storage import NotFoundError, Storage, StorageError

log = logging.getLogger("agent.checkpoint")  # one logger for the package

MAX_CLAIM_BYTES = 64 << 10
STALE_AFTER_S = 3600.0
"""A claim from another machine this old (by this writer's clock) is taken for a dead writer's,
when it is not a renewed one (``RENEWED_PREFIX``); the same age, of the newest claim of a writer
seen, is how long retention takes another machine's writer of committed checkpoints for a live one."""
RENEW_EVERY_S = 300.0
"""How often a save in flight rewrites its claim (the first time this long after it claimed the
folder: a save that takes seconds never renews)."""
LAPSES_AFTER_S = 3 * RENEW_EVERY_S + 60.0
"""A renewed claim from another machine whose last write is this old, by the store's clock, is
taken for a dead writer's: three renewals missed, and a minute for the store's time resolution."""
RENEWED_PREFIX = "renewed-"
"""The start of the id of a claim whose writer renews it (``new_id``)."""

_live: set[str] = set()
"""The claims of this process's saves still in flight (a second Checkpointer on the URI here)."""
_live_lock = threading.Lock()

_commit_locks: dict[str, threading.RLock] = {}
"""One lock per URI (``commit_lock``), held by this process's Checkpointers while they check that
nobody committed their step meanwhile and write their manifest."""

_open: set[str] = set()
"""The ids of this process's Checkpointers not closed yet (``Claim.checkpointer``): a folder one of
them committed is another live writer's to the others."""


def _started(pid: int) -> str:
    """The start time of process ``pid`` (``agent.process_tree.read_proc``'s ticks since boot), ""
    when there is none: with the pid, it tells a process from a later one that reuses the pid."""
    info = read_proc(pid)
    return str(info.start_ticks) if info is not None else ""


def new_id(checkpointer: str = "") -> str:
    """A fresh claim id, one that says its writer renews the claim while its save is in flight, and
    names the Checkpointer that writes it (``Claim.checkpointer``) when ``checkpointer`` is given:
    in the id, not in a field of its own, which the spotjob of 2026-12-05 takes for no claim."""
    return RENEWED_PREFIX + (f"{checkpointer}." if checkpointer else "") + uuid.uuid4().hex


def _machine() -> str:
    """This kernel boot and pid namespace ("" where /proc does not say): claims that name the same
    one name pids this process can look up."""
    boot = boot_id()
    try:
        ns = os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""
    return f"{boot}/{ns}" if boot else ""


@dataclass(frozen=True)
class Claim:
    id: str
    job: str | None
    attempt: int | None
    host: str
    pid: int
    started: str
    machine: str
    claimed_at: float

    @classmethod
    def mine(cls, claim_id: str, job: str | None, attempt: int | None) -> Claim:
        pid = os.getpid()
        return cls(claim_id, job, attempt, socket.gethostname(), pid, _started(pid), _machine(), time.time())

    def to_json(self) -> bytes:
        return json.dumps(self.__dict__, indent=2).encode()

    @classmethod
    def parse(cls, data: bytes) -> Claim | None:
        """The claim, or None when it does not read as one (taken for no writer's). Fields it does
        not know (a later spotjob's) are ignored; one it needs missing makes it no claim."""
        try:
            raw = loads_bounded(data, max_bytes=MAX_CLAIM_BYTES)
            if not isinstance(raw, dict):
                return None
            claim = cls(**{f.name: raw[f.name] for f in fields(cls) if f.name in raw})
        except (UntrustedJSONError, TypeError, ValueError):
            return None
        ints = isinstance(claim.pid, int) and (claim.attempt is None or isinstance(claim.attempt, int))
        return claim if ints and isinstance(claim.claimed_at, int | float) else None

    def describe(self) -> str:
        attempt = self.attempt if self.attempt is not None else "none"
        return f"{describe_job(self.job)} (attempt {attempt}) on host {self.host!r}, pid {self.pid}"

    @property
    def checkpointer(self) -> str:
        """The id of the Checkpointer that wrote it, from its id (``new_id``; "" in a claim from
        before 2026-12-07): tells two Checkpointers of one process apart."""
        if not self.renewed:
            return ""
        name, dot, _ = self.id[len(RENEWED_PREFIX) :].partition(".")
        return name if dot else ""

    @property
    def renewed(self) -> bool:
        """Its writer rewrites it while its save is in flight (``Renewal``)."""
        return isinstance(self.id, str) and self.id.startswith(RENEWED_PREFIX)

    @property
    def writer(self) -> tuple[str, str, int, str]:
        """Which process wrote it: the same for every claim of that process."""
        return (self.host, self.machine, self.pid, self.started)

    def here(self) -> bool:
        """Written on this machine (the same kernel boot and pid namespace)."""
        return bool(self.machine) and self.machine == _machine()

    def this_process(self) -> bool:
        """Written by this very process (another Checkpointer of it, or this one)."""
        return (
            bool(self.machine)
            and self.machine == _machine()
            and self.pid == os.getpid()
            and (self.started == _started(self.pid))
        )

    def of_another_checkpointer_here(self, me: str) -> bool:
        """Written by another Checkpointer of this very process than ``me`` (its id)."""
        return self.checkpointer != me and self.this_process()

    def of_another_open_checkpointer(self, me: str) -> bool:
        """Written by another Checkpointer of this very process than ``me`` (its id), one not closed yet."""
        if not self.checkpointer or not self.of_another_checkpointer_here(me):
            return False
        with _live_lock:
            return self.checkpointer in _open

    def describe_to(self, me: str) -> str:
        """``describe()``, saying so when it is another Checkpointer of this process than ``me``."""
        if self.of_another_checkpointer_here(me):
            return f"{self.describe()}: another Checkpointer of this process"
        return self.describe()

    def writer_alive(self, attempt: int | None, age: float | None = None) -> bool:
        """Whether its writer may still be saving into the folder (asked by a writer of ``attempt``).

        ``age``: how long ago the store wrote the claim, by the store's clock, when known. A renewed
        claim from another machine is live while that is under ``LAPSES_AFTER_S``; without it, and
        for a claim that is not renewed, while ``claimed_at`` is under ``STALE_AFTER_S`` old by this
        process's clock.
        """
        if attempt is not None and self.attempt is not None and self.attempt < attempt:
            return False  # superseded: fenced, whatever it still writes
        if self.machine and self.machine == _machine():
            if self.this_process():
                with _live_lock:
                    return self.id in _live
            return bool(self.started) and _started(self.pid) == self.started
        if self.renewed and age is not None:
            return age < LAPSES_AFTER_S
        return time.time() - self.claimed_at < STALE_AFTER_S

    def writer_running(self, attempt: int | None) -> bool:
        """Whether the process that wrote it may still be running (asked by a writer of ``attempt``),
        whatever became of this claim's save: on the same machine, while its process runs; from
        another machine, while the claim (renewed or not) is under ``STALE_AFTER_S`` old by this
        process's clock. Not when a newer attempt than the claim's is running."""
        if attempt is not None and self.attempt is not None and self.attempt < attempt:
            return False
        if self.machine and self.machine == _machine():
            return self.this_process() or (bool(self.started) and _started(self.pid) == self.started)
        return time.time() - self.claimed_at < STALE_AFTER_S


def read_claim(storage: Storage, folder: str) -> Claim | None:
    """``folder``'s claim, or None (none, or unreadable: a folder no live writer holds)."""
    return read_claim_stamped(storage, folder)[0]


def read_claim_stamped(storage: Storage, folder: str) -> tuple[Claim | None, float | None]:
    """``folder``'s claim (or None, as ``read_claim``), and when the store wrote it (its clock; None
    where it does not say). The one request of ``read_claim``: its answer says the time too."""
    try:
        data, info = read_bounded_stamped(storage, f"{folder}/{CLAIM_NAME}", MAX_CLAIM_BYTES)
    except (NotFoundError, UntrustedJSONError):
        return None, None
    return Claim.parse(data), info.modified


def writer_alive_in(
    claim: Claim, written: float | None, attempt: int | None, store_now: Callable[[], float | None]
) -> bool:
    """Whether the writer of an uncommitted folder's ``claim``, which the store wrote at ``written``
    (its clock; None where it does not say), may still be saving into the folder: the one judgement
    of a save of the folder's step (reuse the folder, or go beside it) and of retention (remove it,
    or leave it), so that they never disagree. ``store_now`` gives the store's time now, at least
    (None where it does not say): asked only for a renewed claim from another machine, whose writer
    is taken for gone ``LAPSES_AFTER_S`` after the last renewal the store took (``writer_alive``)."""
    age = None
    if claim.renewed and written is not None and not claim.here():
        now = store_now()
        if now is not None:
            age = max(now, written) - written
    return claim.writer_alive(attempt, age)


def store_time_now(storage: Storage) -> float | None:
    """The store's time now (its clock; None where it does not say): when it wrote a probe object,
    written under ``PROBES_FOLDER`` and deleted at once (three requests). A probe left behind (its
    delete failed) is a few bytes no listing of checkpoints reads. Raises ``StorageError`` when the
    probe cannot be written or read."""
    key = f"{PROBES_FOLDER}/clock-probe-{uuid.uuid4().hex}"
    storage.put_bytes(key, b"spotjob store clock probe\n")
    try:
        info = storage.stat(key)
    finally:
        try:
            storage.delete([key])
        except StorageError as e:
            log.debug("could not delete the store clock probe %s: %s", storage.url(key), e)
    return info.modified if info is not None else None


class Renewal:
    """Rewrites one save's claim every ``RENEW_EVERY_S``, in the thread that calls ``run()`` (the
    one that named the save's folder), until ``stop()``.

    Each renewal first reads the claim back: one that is gone or another writer's (this save's
    folder was removed, and claimed anew) is left alone, and renewal ends. A failed renewal is
    logged and tried again at the next period. Once ``stop()`` returns, nothing more is written
    and the thread has ended.
    """

    def __init__(self, storage: Storage) -> None:
        self._storage = storage
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def run(self, folder: str, claim: Claim) -> None:
        """Renew ``claim``, written in ``folder``, until ``stop()`` (at once when it was called already)."""
        with self._lock:
            if self._stop.is_set():
                return
            self._thread = threading.current_thread()
        key = f"{folder}/{CLAIM_NAME}"
        while not self._stop.wait(RENEW_EVERY_S):
            try:
                current = read_claim(self._storage, folder)
                with self._lock:
                    if self._stop.is_set():
                        return
                    if current is None or current.id != claim.id:
                        log.debug("not renewing the claim %s: it is no longer this save's", self._storage.url(key))
                        return
                    self._storage.put_bytes(key, replace(claim, claimed_at=time.time()).to_json())
            except StorageError as e:
                log.warning(
                    "could not renew this save's claim %s (tried again in %.0f s; another writer of the URI "
                    "takes the folder for a dead writer's %.0f s after the last renewal the store took): %s",
                    self._storage.url(key),
                    RENEW_EVERY_S,
                    LAPSES_AFTER_S,
                    e,
                )

    def stop(self) -> None:
        """Stop renewing: waits for a renewal being written, and for the thread to end."""
        with self._lock:
            self._stop.set()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()


def opened(checkpointer: str) -> None:
    """A Checkpointer of this process with id ``checkpointer`` was built."""
    with _live_lock:
        _open.add(checkpointer)


def others_open(checkpointer: str) -> bool:
    """Whether a Checkpointer of this process other than ``checkpointer`` is open (not closed)."""
    with _live_lock:
        return bool(_open - {checkpointer})


def closed(checkpointer: str) -> None:
    """The Checkpointer with id ``checkpointer`` was closed (or collected unclosed)."""
    with _live_lock:
        _open.discard(checkpointer)


def commit_lock(uri: str) -> threading.RLock:
    """The lock this process's Checkpointers of ``uri`` hold around their last check and their
    commit: two saving the same step at one moment both passed the check before either manifest
    was in, and both committed. With it, the second sees the first's manifest and fails. Reentrant:
    a store that calls back into another Checkpointer's save while committing (as the tests that
    stand in for another process do) does not wait for itself."""
    with _live_lock:
        return _commit_locks.setdefault(uri, threading.RLock())


def hold(claim_id: str) -> None:
    with _live_lock:
        _live.add(claim_id)


def release(claim_id: str) -> None:
    with _live_lock:
        _live.discard(claim_id)
