"""Which writer a checkpoint folder in flight belongs to: ``<folder>/WRITER.json``, its *claim*.

Rank 0 creates the claim create-only before any rank uploads into the folder, so two writers of
one URI never share a folder: of two that pick the same one, the second goes to the next suffix
(``step-N.1``). Without it, two processes of one job without attempt numbers (the same script
started twice, an old node still training after its job was restarted elsewhere) uploaded into
the same ``step-N`` and one overwrote the files of the other's committed checkpoint, and one's
clean-up of "an unfinished save's leftover" removed the other's files in flight.

A folder with another writer's claim and no manifest is only removed (by a save of its step, by
retention) once that writer is known to be gone: on the same machine (same kernel boot and pid
namespace) when its process is gone or its save is over, elsewhere once the claim is older than
``STALE_AFTER_S`` by this writer's clock, or at once when a newer attempt than the claim's is
running. The claim is never listed in a manifest; readers ignore it. No torch import.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from dataclasses import dataclass, fields

from agent._layout import read_bounded
from agent.manifest import UntrustedJSONError, loads_bounded
from agent.ownership import describe_job
from agent.process_tree import boot_id, read_proc
from agent.storage import NotFoundError, Storage

CLAIM_NAME = "WRITER.json"
MAX_CLAIM_BYTES = 64 << 10
STALE_AFTER_S = 3600.0
"""A claim from another machine this old (by this writer's clock) is taken for a dead writer's."""

_live: set[str] = set()
"""The claims of this process's saves still in flight (a second Checkpointer on the URI here)."""
_live_lock = threading.Lock()


def _started(pid: int) -> str:
    """The start time of process ``pid`` (``agent.process_tree.read_proc``'s ticks since boot), ""
    when there is none: with the pid, it tells a process from a later one that reuses the pid."""
    info = read_proc(pid)
    return str(info.start_ticks) if info is not None else ""


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

    def writer_alive(self, attempt: int | None) -> bool:
        """Whether its writer may still be saving into the folder (asked by a writer of ``attempt``)."""
        if attempt is not None and self.attempt is not None and self.attempt < attempt:
            return False  # superseded: fenced, whatever it still writes
        if self.machine and self.machine == _machine():
            if self.pid == os.getpid() and self.started == _started(self.pid):
                with _live_lock:
                    return self.id in _live
            return bool(self.started) and _started(self.pid) == self.started
        return time.time() - self.claimed_at < STALE_AFTER_S


def read_claim(storage: Storage, folder: str) -> Claim | None:
    """``folder``'s claim, or None (none, or unreadable: a folder no live writer holds)."""
    try:
        data = read_bounded(storage, f"{folder}/{CLAIM_NAME}", MAX_CLAIM_BYTES)
    except (NotFoundError, UntrustedJSONError):
        return None
    return Claim.parse(data)


def hold(claim_id: str) -> None:
    with _live_lock:
        _live.add(claim_id)


def release(claim_id: str) -> None:
    with _live_lock:
        _live.discard(claim_id)
