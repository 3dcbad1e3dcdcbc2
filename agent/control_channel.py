"""The channel between ``spotjob-agent`` and the training ranks it launched. No torch import.

The agent and the ranks share a node-local folder, ``$SPOTJOB_CONTROL_DIR``. Everything is a small
JSON file replaced atomically (temp + rename), so a reader never sees half a file:

- ``flush.json`` (agent → ranks): present means "flush now". The ranks look for it with one
  ``os.stat`` per step — no network call — and agree on one step through an asynchronous
  collective (see ``agent.checkpoint``). Written once; a second notice does not rewrite it.
- ``save.json`` (agent → ranks): "save early, keep training" (e.g. an AWS rebalance
  recommendation): one more ``os.stat`` per step. Handled once per request at an agreed step;
  the node's first rank then removes it.
- ``status.json`` (each node's local rank 0 → its agent): the training state the agent serves on
  ``GET /status`` and ``/readyz``.
- ``flushed.json`` (each node's local rank 0 → its agent): the flush committed; step, URI and
  notice-to-commit time.
- ``flush-failed.json`` (each node's local rank 0 → its agent): a flush was attempted and nothing
  could be committed.
- ``agent.json`` (agent → tools and local mode's controller): the agent's pid and control-API URL
  while it runs, whether its ranks have not met, and the cloud notice it holds.
- ``closed-rank-<r>`` (each rank → agent): ``Checkpointer.close()`` returned on that rank, i.e.
  the rank finished its work. An abort at interpreter exit after this is not a job failure.
- ``infra-error.json`` (any rank → agent): the rank is stopping because of an error that is not
  the user's fault (storage unreachable during restore, ...). The agent then exits
  ``EXIT_INFRA_ERROR``, which the reconciler treats as an infrastructure error (backoff, Degraded,
  restart budget untouched).

Environment variables the agent sets for ``Checkpointer.from_env()`` are named here too.
"""

from __future__ import annotations

import functools
import json
import os
import stat
import time
import types
import typing
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any

from agent.atomic_file import write_atomic

ENV_CHECKPOINT_URI = "SPOTJOB_CHECKPOINT_URI"
ENV_JOB_NAME = "SPOTJOB_JOB_NAME"
ENV_EVERY_STEPS = "SPOTJOB_EVERY_STEPS"
ENV_EVERY_SECONDS = "SPOTJOB_EVERY_SECONDS"
ENV_KEEP = "SPOTJOB_KEEP"
ENV_ASYNC = "SPOTJOB_ASYNC"
ENV_STAGING_DIR = "SPOTJOB_STAGING_DIR"
ENV_CONTROL_DIR = "SPOTJOB_CONTROL_DIR"
ENV_ATTEMPT = "SPOTJOB_ATTEMPT"
"""The attempt number the controller recorded in storage before starting these workers (fencing)."""
ENV_START_FRESH = "SPOTJOB_START_FRESH"
"""``1``: start from step 0 on purpose even though committed checkpoints exist (nothing is deleted)."""

# spotjob-agent's exit codes besides the command's own (documented in the README).
EXIT_PREEMPTED = 75
"""Stopped for a preemption notice with a committed checkpoint: restart me elsewhere (EX_TEMPFAIL)."""
EXIT_FLUSH_FAILED = 76
"""A flush was asked for but nothing could be committed: resume from the previous checkpoint."""
EXIT_INFRA_ERROR = 74
"""Stopped by an error that is not the user's (storage unreachable, rendezvous port taken): retry
with backoff without spending the restart budget (EX_IOERR)."""
EXIT_STOPPED = 79
"""Stopped on request (``POST /stop``) without a flush: the controller is stopping the gang for a
reason of its own (a peer's code failed). Neither a failure of this worker nor a preemption."""

FLUSH_FILE = "flush.json"
SAVE_FILE = "save.json"
STATUS_FILE = "status.json"
FLUSHED_FILE = "flushed.json"
FLUSH_FAILED_FILE = "flush-failed.json"
CLOSED_PREFIX = "closed-rank-"
INFRA_ERROR_FILE = "infra-error.json"
AGENT_FILE = "agent.json"


@dataclass
class FlushRequest:
    """Why and by when the ranks must commit a checkpoint."""

    reason: str
    deadline: float | None = None
    """Unix time by which the checkpoint must be committed (the node goes away then)."""
    requested_at: float = field(default_factory=time.time)
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])


@dataclass
class RankStatus:
    """What rank 0 reports; every field is optional so partial reports are fine."""

    state: str = "starting"
    """starting | training | saving | flushing | flushed | flush-failed | closed"""
    step: int | None = None
    last_committed_step: int | None = None
    last_committed_uri: str | None = None
    last_save_seconds: float | None = None
    """Wall time of the last save from the start of staging to the committed manifest."""
    commits: int = 0
    """Checkpoints this process's Checkpointer committed (a restore is none): how many were, even
    when several commit between two looks at this file."""
    world_size: int | None = None
    local_world_size: int | None = None
    """The ranks on this node (torchrun's ``LOCAL_WORLD_SIZE``): how many ``closed-rank-<r>`` marks
    the node's agent counts for a finished job. None where the rank cannot tell."""
    checkpoint_uri: str | None = None
    """The URI the script's Checkpointer writes to (the agent warns when it is not the agent's)."""
    restored_step: int | None = None
    """The step the ranks' last ``restore()`` loaded (0: none, they start from step 0); None before
    one returned."""
    restore_passed_over: str | None = None
    """Why that restore passed over a newer committed checkpoint of the job's (the newest it skipped,
    its folder and the ranks' reason: a CRC32C mismatch in a file of it, a file missing); None when
    it skipped none. The controller tells a ``CheckpointUnusable`` Warning by it: a checkpoint with a
    damaged byte looks valid to it, which judges sizes only."""
    updated_at: float = field(default_factory=time.time)


@dataclass
class FlushResult:
    step: int | None
    uri: str | None
    request_id: str | None
    notice_to_commit_seconds: float | None
    error: str | None = None
    finished_at: float = field(default_factory=time.time)


def write_json_atomic(path: str, payload: dict[str, Any]) -> None:
    """All or nothing, not durable: these files are rewritten often and worth nothing after a crash."""
    write_atomic(path, json.dumps(payload).encode(), durable=False)


MAX_FILE_BYTES = 1 << 20
"""The most a control file is read: they hold a few hundred bytes; a larger one is no file of spotjob's."""


def read_json(path: str) -> dict[str, Any] | None:
    """The JSON object in ``path``; None where there is none: no such file, not JSON, not an object,
    and whatever no spotjob process writes (a FIFO, a folder, over ``MAX_FILE_BYTES``, nested more
    than 64 deep). A crafted file in the control folder never hangs or crashes a rank or the agent:
    the open does not wait on a FIFO, and the bytes are bounded before they are parsed."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        raw = b""
        while len(raw) <= MAX_FILE_BYTES and (chunk := os.read(fd, MAX_FILE_BYTES + 1 - len(raw))):
            raw += chunk
    finally:
        os.close(fd)
    # Here, not at the top: agent.manifest brings pydantic (a tenth of a CPU-second to import), which
    # a process that only writes to the control folder, or finds no file in it, never needs.
    from agent.manifest import loads_bounded

    try:
        data = loads_bounded(raw, max_bytes=MAX_FILE_BYTES)
    except ValueError:
        return None
    return data if isinstance(data, dict) else None


@functools.cache
def _field_types(cls: type) -> tuple[tuple[str, tuple[type, ...]], ...]:
    """Each field of dataclass ``cls`` with the types its value may have."""
    out = []
    for name, hint in typing.get_type_hints(cls).items():
        allowed = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
        out.append((name, (*allowed, int) if float in allowed else allowed))
    return tuple(out)


def _fitting(cls: type, data: dict[str, Any], *, absent_as_none: bool = False) -> dict[str, Any]:
    """The fields of dataclass ``cls`` in ``data`` whose values have the field's type (an int
    counts as a float, a bool as no int). A value of another type is left out, as if absent (or
    None, with ``absent_as_none``), so a crafted file cannot hand the agent a string where it
    computes with a number."""
    out: dict[str, Any] = {}
    for name, allowed in _field_types(cls):
        value = data.get(name)
        if name in data and isinstance(value, allowed) and not (isinstance(value, bool) and bool not in allowed):
            out[name] = value
        elif absent_as_none:
            out[name] = None
    return out


def _request(data: dict[str, Any]) -> FlushRequest:
    """The request a ``flush.json`` or ``save.json`` holds. One without a ``reason`` string (no
    spotjob process writes one) is still a request, as the file's presence says; it never raises."""
    fields = _fitting(FlushRequest, data)
    fields.setdefault("reason", "a request file without a reason")
    return FlushRequest(**fields)


class ControlDir:
    """One node's control folder, as seen by the agent or by a rank."""

    def __init__(self, path: str) -> None:
        self.path = path
        os.makedirs(path, exist_ok=True)
        self._flush_path = os.path.join(path, FLUSH_FILE)

    def _p(self, name: str) -> str:
        return os.path.join(self.path, name)

    # -- agent side ----------------------------------------------------------------------------
    def request_flush(self, request: FlushRequest) -> FlushRequest:
        """Ask the ranks to flush; idempotent: an existing request is kept and returned."""
        existing = self.flush_request()
        if existing is not None:
            return existing
        write_json_atomic(self._flush_path, asdict(request))
        return request

    def request_save(self, reason: str, request_id: str | None = None) -> FlushRequest:
        """Ask the ranks for an early checkpoint without stopping (a soft notice). A request still
        waiting for the ranks is kept and returned: one save serves both."""
        existing = self.save_request()
        if existing is not None:
            return existing
        request = FlushRequest(reason=reason) if request_id is None else FlushRequest(reason=reason, id=request_id)
        write_json_atomic(self._p(SAVE_FILE), asdict(request))
        return request

    def flush_result(self) -> FlushResult | None:
        for name in (FLUSHED_FILE, FLUSH_FAILED_FILE):
            data = read_json(self._p(name))
            if data is not None:
                return FlushResult(**_fitting(FlushResult, data, absent_as_none=True))
        return None

    def status(self) -> RankStatus | None:
        data = read_json(self._p(STATUS_FILE))
        if data is None:
            return None
        return RankStatus(**_fitting(RankStatus, data))

    def infra_error(self) -> dict[str, Any] | None:
        """What a rank reported with ``report_infra_error`` (``{"rank", "error", "at"}``), if any."""
        return read_json(self._p(INFRA_ERROR_FILE))

    def closed_ranks(self) -> set[int]:
        out = set()
        for name in os.listdir(self.path):
            if name.startswith(CLOSED_PREFIX):
                try:
                    out.add(int(name[len(CLOSED_PREFIX) :]))
                except ValueError:
                    continue
        return out

    def reset(self) -> None:
        """Forget everything from a previous run of the command (the agent calls this at start)."""
        for name in os.listdir(self.path):
            if name in (
                FLUSH_FILE,
                SAVE_FILE,
                STATUS_FILE,
                FLUSHED_FILE,
                FLUSH_FAILED_FILE,
                INFRA_ERROR_FILE,
            ) or name.startswith(CLOSED_PREFIX):
                try:
                    os.unlink(self._p(name))
                except FileNotFoundError:
                    pass

    # -- rank side -----------------------------------------------------------------------------
    def flush_requested(self) -> bool:
        """The per-step check: a single stat of a local file."""
        return os.path.exists(self._flush_path)

    def flush_request(self) -> FlushRequest | None:
        data = read_json(self._flush_path)
        return _request(data) if data is not None else None

    def save_requested(self) -> bool:
        return os.path.exists(self._p(SAVE_FILE))

    def save_request(self) -> FlushRequest | None:
        data = read_json(self._p(SAVE_FILE))
        return _request(data) if data is not None else None

    def clear_save_request(self) -> None:
        try:
            os.unlink(self._p(SAVE_FILE))
        except FileNotFoundError:
            pass

    def write_status(self, status: RankStatus) -> None:
        status.updated_at = time.time()
        write_json_atomic(self._p(STATUS_FILE), asdict(status))

    def write_flush_result(self, result: FlushResult) -> None:
        name = FLUSHED_FILE if result.error is None else FLUSH_FAILED_FILE
        write_json_atomic(self._p(name), asdict(result))

    def report_infra_error(self, rank: int, error: str) -> None:
        """(a rank) It is stopping for an error that is not the user's; the first report is kept."""
        if self.infra_error() is None:
            write_json_atomic(self._p(INFRA_ERROR_FILE), {"rank": rank, "error": error, "at": time.time()})

    def unmark_closed(self, rank: int) -> None:
        """The rank raised after closing: its exit is a failure after all."""
        try:
            os.unlink(self._p(f"{CLOSED_PREFIX}{rank}"))
        except FileNotFoundError:
            pass

    def mark_closed(self, rank: int) -> None:
        # Replaced, never opened for writing: a symlink someone left under this name is not followed.
        write_atomic(self._p(f"{CLOSED_PREFIX}{rank}"), str(time.time()).encode(), durable=False)
