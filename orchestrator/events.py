"""Where the reconciler's decisions are told: Events (an ``EventSink``) and metrics (``JobMetrics``).

Both are courtesies next to the record, which is the job's status. Order of use, fixed by the
reconciler (Karpenter's rule): one pass decides, writes the status once, and only after that write
succeeded (or when nothing needed writing) emits the pass's Events and metrics, so neither ever
claims what the status does not show, and a replayed pass is not counted twice.

Homes:

- Kubernetes: a sink on ``orchestrator.k8s.events.EventRecorder`` (Events on the SpotJob, and on
  the Node when one is named) and ``orchestrator.k8s.metrics.ControllerMetrics`` (Prometheus).
- Local mode: ``JsonlEventSink`` appends one JSON line per Event to ``<name>.events.jsonl`` next
  to the job's file in the store's folder, and logs it; ``spotjob status`` and the live view read
  them back with ``read_events`` (repeats of one Event counted on it, as on Kubernetes). Metrics:
  ``NULL_METRICS``.

Neither an ``EventSink`` nor a ``JobMetrics`` may raise into the reconciler: a failure to tell is
logged and dropped. This module imports neither ``kubernetes`` nor ``prometheus_client``.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import StrEnum
from typing import Protocol, runtime_checkable

from agent.atomic_file import append_line
from agent.control_api import safe
from orchestrator.model import JobKey, JobStatus

log = logging.getLogger(__name__)


class EventType(StrEnum):
    """Kubernetes' two Event types."""

    NORMAL = "Normal"
    WARNING = "Warning"


@runtime_checkable
class EventSink(Protocol):
    """Receives the reconciler's Events, after the status write of the pass that decided them."""

    def emit(self, key: JobKey, type: EventType, reason: str, message: str, *, node: str | None = None) -> None:
        """Record one Event about job ``key``: a CamelCase ``reason`` and a ``message`` for people.

        ``node`` names the Node the Event concerns too (a notice for it, a worker lost with it);
        a Kubernetes sink may record it on the Node as well. Never raises.
        """
        ...


FLUSH_OUTCOMES = ("committed", "workers_exited", "timed_out")
"""How a flush ends (``JobMetrics.flush_ended``): its checkpoint committed (FlushCommitted), no
worker left to flush (WorkersExited), or ``flushTimeoutSeconds`` passed (FlushTimedOut)."""


@runtime_checkable
class JobMetrics(Protocol):
    """What the reconciler counts; ``orchestrator.k8s.metrics.ControllerMetrics`` has this shape.

    - ``signal(kind, source)``: a preemption signal acted on (each once per recovery);
    - ``flush_request(outcome)``: an agent's answer to a flush request: ``accepted`` or ``failed``;
    - ``notice_to_commit(seconds)``: from a preemption's detection to its flushed manifest (none
      for a flush committed before the pass that detected it: how long it took is not known);
    - ``preemption()``: a preemption handled; ``restart(cause)``: a gang restarted, by cause
      (``preemption``, ``failure``, ``infrastructure``);
    - ``lost_steps(steps)``: steps a restart lost (trained, not committed);
    - ``goodput(namespace, name, ratio)``: the job's goodput, at each status write;
    - ``job_state(namespace, name, status, max_restarts)``: the job's status as stored (written by
      the pass, or unchanged), after every pass that did not conflict, ended jobs' included (a new
      leader exports them too); ``max_restarts`` is None when the spec does not validate;
    - ``flush_ended(namespace, name, outcome, agents_failed)``: a flush ended (``FLUSH_OUTCOMES``),
      ``agents_failed`` of its agents having exited 76;
    - ``job_deleted(namespace, name)``: forget the job's series.
    """

    def signal(self, kind: str, source: str) -> None: ...
    def flush_request(self, outcome: str) -> None: ...
    def notice_to_commit(self, seconds: float) -> None: ...
    def preemption(self) -> None: ...
    def restart(self, cause: str) -> None: ...
    def lost_steps(self, steps: int) -> None: ...
    def goodput(self, namespace: str, name: str, ratio: float) -> None: ...
    def job_state(self, namespace: str, name: str, status: JobStatus, max_restarts: int | None) -> None: ...
    def flush_ended(self, namespace: str, name: str, outcome: str, agents_failed: int) -> None: ...
    def job_deleted(self, namespace: str, name: str) -> None: ...


class NullMetrics:
    """Counts nothing (local mode, tests)."""

    def signal(self, kind: str, source: str) -> None:
        pass

    def flush_request(self, outcome: str) -> None:
        pass

    def notice_to_commit(self, seconds: float) -> None:
        pass

    def preemption(self) -> None:
        pass

    def restart(self, cause: str) -> None:
        pass

    def lost_steps(self, steps: int) -> None:
        pass

    def goodput(self, namespace: str, name: str, ratio: float) -> None:
        pass

    def job_state(self, namespace: str, name: str, status: JobStatus, max_restarts: int | None) -> None:
        pass

    def flush_ended(self, namespace: str, name: str, outcome: str, agents_failed: int) -> None:
        pass

    def job_deleted(self, namespace: str, name: str) -> None:
        pass


NULL_METRICS = NullMetrics()


def _long_hex(m: re.Match[str]) -> str:
    """A token of 16 or more hex digits (S3's request id unlabelled, a digest) is an id; a shorter
    one (a step, a CRC, an exit code beside a letter) is kept."""
    return "<id>" if len(m.group(0)) >= 16 else m.group(0)


_VOLATILE = (
    # A request id a store or an API put in its error (S3's RequestId and HostId, GCS's upload id,
    # a trace id), labelled: the value changes at every request.
    (
        re.compile(
            r"(?i)\b((?:x-amz-)?request[ _-]?id|x-amz-id-2|host[ _-]?id|x-guploader-uploadid|trace[ _-]?id)"
            r"([\"']?\s*[:=]\s*[\"']?|\s+)[A-Za-z0-9+/=._-]{4,}"
        ),
        r"\1\2<id>",
    ),
    (re.compile(r"\b[0-9a-fA-F]{8}(?:-[0-9a-fA-F]{4}){3}-[0-9a-fA-F]{12}\b"), "<id>"),  # a UUID
    (re.compile(r"\b0x[0-9a-fA-F]{6,}\b"), "<address>"),  # an object's repr: <... at 0x7f...>
    (re.compile(r"\b[0-9a-fA-F]*(?:[0-9][a-fA-F]|[a-fA-F][0-9])[0-9a-fA-F]*\b"), _long_hex),
    # The time an error says it was answered (labelled "date", ISO 8601), or an HTTP date. Not any
    # time: one of ours is what the Event says (a notice's new due time is another Event).
    (
        re.compile(
            r"(?i)\b(date[\"']?\s*[:=]\s*[\"']?)\d{4}-\d{2}-\d{2}[T ]\d{2}:\d{2}:\d{2}(?:[.,]\d+)?"
            r"(?:Z|[+-]\d{2}:?\d{2})?"
        ),
        r"\1<time>",
    ),
    (
        re.compile(r"\b(?:Mon|Tue|Wed|Thu|Fri|Sat|Sun), \d{1,2} [A-Z][a-z]{2} \d{4} \d{2}:\d{2}:\d{2} GMT\b"),
        "<time>",
    ),
    # An address and port: a pod's IP and a client's ephemeral port change from pass to pass.
    (re.compile(r"\b(?:\d{1,3}\.){3}\d{1,3}(?::\d{1,5})?\b"), "<address>"),
    (re.compile(r"\[[0-9a-fA-F:]*:[0-9a-fA-F:.]*\](?::\d{1,5})?"), "<address>"),
    (re.compile(r"\b(localhost):\d{1,5}\b"), r"\1:<port>"),
    (re.compile(r"\b(port[=:] ?)\d{1,5}\b"), r"\1<port>"),
)


VOLATILE_ERROR_REASONS = frozenset(
    {"StorageUnreachable", "StorageRefused", "BackendUnavailable", "FlushRequestFailed", "SaveRequestFailed"}
)
"""The reasons whose message carries another component's error text (a store's, the API server's,
an agent's connection), which may carry a request id, a time or an address that changes at every
try of one fault. Only their messages are masked (``event_identity``): every other message is
spotjob's own words, whose every part says something (a notice's due time, a user's flush request
id), and two that differ at all are two Events."""


def event_identity(reason: str, message: str) -> str:
    """What tells one Event of ``reason`` from another: ``message`` itself, or, for a reason in
    ``VOLATILE_ERROR_REASONS``, ``message`` with what changes from one try to the next of one fault
    masked: request ids, UUIDs, object addresses, long hex ids, the time an error was answered, IP
    addresses and ports. Two Events of one identity are one Event counted up (``read_events``, the
    Kubernetes recorder's series): a store failing the same way on every pass is one
    ``StorageUnreachable`` with a count, not one Event a pass because each of its errors carries
    another request id. Steps, worker and node names, paths and error codes are kept: a different
    fault stays a different Event."""
    if reason not in VOLATILE_ERROR_REASONS:
        return message
    text = message
    for pattern, replacement in _VOLATILE:
        text = pattern.sub(replacement, text)
    return text


class LoggingEventSink:
    """Logs each Event (Warning at WARNING, Normal at INFO): what a sink adds to any other."""

    def emit(self, key: JobKey, type: EventType, reason: str, message: str, *, node: str | None = None) -> None:
        # An Event quotes others (a worker's last words, a store's error): one log line, escaped.
        where = f" (node {safe(node, len(node))})" if node else ""
        log.log(
            logging.WARNING if type is EventType.WARNING else logging.INFO,
            "job %s %s%s: %s",
            key,
            safe(reason, len(reason)),
            where,
            safe(message, len(message)),
        )


EVENTS_SUFFIX = ".events.jsonl"

SERIES_WINDOW_SECONDS = 3600.0
"""A repeat of an Event at most this long after its last occurrence is counted on it; a later one
is a new Event (the Kubernetes recorder's series window, which local mode's reading matches)."""


def events_path(root: str, key: JobKey) -> str:
    """Where ``JsonlEventSink(root)`` keeps the Events of ``key``: beside the job's store file."""
    return os.path.join(os.path.abspath(root), key.namespace, f"{key.name}{EVENTS_SUFFIX}")


class JsonlEventSink(LoggingEventSink):
    """Local mode: appends ``{"time", "type", "reason", "message", "node"?}`` lines to
    ``events_path(root, key)`` and logs each Event. Thread-safe; each line is written whole, after
    ending a line a full disk or a kill cut short (``append_line``)."""

    def __init__(self, root: str, *, now: Callable[[], datetime] = lambda: datetime.now(UTC)) -> None:
        self.root = os.path.abspath(root)
        self._now = now
        self._lock = threading.Lock()

    def emit(self, key: JobKey, type: EventType, reason: str, message: str, *, node: str | None = None) -> None:
        super().emit(key, type, reason, message, node=node)
        record: dict[str, str] = {
            "time": self._now().isoformat(),
            "type": str(type),
            "reason": reason,
            "message": message,
        }
        if node:
            record["node"] = node
        path = events_path(self.root, key)
        try:
            with self._lock:
                os.makedirs(os.path.dirname(path), exist_ok=True)
                append_line(path, json.dumps(record))
        except OSError as e:
            log.warning("could not record event %s of job %s in %s: %s", reason, key, path, e)


@dataclass(frozen=True)
class RecordedEvent:
    """An Event as ``read_events`` gives it back; ``count`` repeats of it, the last at ``time``."""

    time: datetime
    first_time: datetime
    type: EventType
    reason: str
    message: str
    node: str | None = None
    count: int = 1


def read_events(path: str) -> list[RecordedEvent]:
    """The Events of a ``JsonlEventSink`` file, oldest first by their latest occurrence, as
    ``kubectl spotjob events`` lists them; repeats of one Event (same type, reason, node and
    ``event_identity`` of the reason and message), whatever came between, become one with a count
    and the latest message, as the Kubernetes recorder counts them (a repeat more than
    ``SERIES_WINDOW_SECONDS`` after the last is a new Event). A torn or foreign line is skipped; a
    missing file is no Events."""
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        return []
    events = _Events()
    events.add_lines(lines)
    return events.list()


class EventLog:
    """``read_events`` of one ``JsonlEventSink`` file that a run keeps appending to: each ``read``
    parses only the whole lines appended since the last one, so what a look costs does not grow
    with the run (``spotjob run`` looks after every reconcile pass). A file that got shorter (it
    was replaced) is read again from its start."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._offset = 0
        self._events = _Events()

    def read(self) -> list[RecordedEvent]:
        """Every Event so far, as ``read_events`` gives them. Raises ``OSError`` (not for a missing file)."""
        try:
            with open(self.path, "rb") as f:
                if os.fstat(f.fileno()).st_size < self._offset:
                    self._offset, self._events = 0, _Events()
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            self._offset, self._events = 0, _Events()
            return []
        whole = data.rfind(b"\n") + 1  # a line still being written is read once it is whole
        self._events.add_lines(data[:whole].decode(errors="replace").splitlines())
        self._offset += whole
        return self._events.list()


class _Events:
    """Recorded Events in the order of their latest occurrence, each repeat counted on its Event."""

    def __init__(self) -> None:
        # Each Event by the order it was first seen in: a repeat moves its Event to the end.
        self._events: OrderedDict[int, RecordedEvent] = OrderedDict()
        self._latest: dict[tuple[object, ...], int] = {}  # (type, reason, node, identity) -> its latest Event

    def add_lines(self, lines: list[str]) -> None:
        for line in lines:
            try:
                raw = json.loads(line)
                event = RecordedEvent(
                    time=datetime.fromisoformat(raw["time"]),
                    first_time=datetime.fromisoformat(raw["time"]),
                    type=EventType(raw["type"]),
                    reason=str(raw["reason"]),
                    message=str(raw["message"]),
                    node=raw.get("node"),
                )
            except (ValueError, KeyError, TypeError):
                continue
            identity = (event.type, event.reason, event.node, event_identity(event.reason, event.message))
            at = self._latest.get(identity)
            last = self._events.get(at) if at is not None else None
            # A repeat dated before the last (a clock stepped back, a --resume on a machine behind)
            # starts a new Event: merged, its time would come before its firstTime.
            if last is not None and at is not None and 0 <= _seconds(event.time, last.time) <= SERIES_WINDOW_SECONDS:
                # The same fault again: counted on the one Event, which shows the latest words.
                self._events[at] = RecordedEvent(
                    event.time, last.first_time, last.type, last.reason, event.message, last.node, last.count + 1
                )
                self._events.move_to_end(at)
            else:
                self._latest[identity] = at = len(self._events)  # never removed from: a new number
                self._events[at] = event

    def list(self) -> list[RecordedEvent]:
        return list(self._events.values())


def _seconds(later: datetime, earlier: datetime) -> float:
    """``later - earlier`` in seconds; a time without a zone (a hand-written line) is taken as UTC."""
    later, earlier = (t if t.tzinfo else t.replace(tzinfo=UTC) for t in (later, earlier))
    return (later - earlier).total_seconds()


__all__ = [
    "NULL_METRICS",
    "SERIES_WINDOW_SECONDS",
    "VOLATILE_ERROR_REASONS",
    "EventLog",
    "EventSink",
    "EventType",
    "JobMetrics",
    "JsonlEventSink",
    "LoggingEventSink",
    "NullMetrics",
    "RecordedEvent",
    "event_identity",
    "events_path",
    "read_events",
]
