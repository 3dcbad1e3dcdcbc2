"""Kubernetes Events about SpotJobs (and Nodes): what the controller did and why, for ``kubectl describe``.

An Event says, about one object (``regarding``), a CamelCase ``reason`` (a constant next to its
message, Karpenter style), a ``note`` for people, and a type: Normal or Warning. Order of use,
fixed by the reconciler work: the caller writes the job's status first and emits the pass's
Events only after that write succeeded, so an Event never claims what the status does not show.

Repeats aggregate: the same (object, type, reason, note's ``event_identity``) within ``series_window`` PATCHes
the existing Event's series (``series.count``, ``series.lastObservedTime``) instead of creating
another object — a job flapping for an hour leaves one Event with a count, not thousands. The
recorder remembers the Events it wrote in a bounded LRU; a forgotten or expired one (404 on the
PATCH) is simply created again.

Events are ``events.k8s.io/v1`` only, which every Kubernetes since 1.19 serves (the chart needs
``MIN_KUBERNETES``). Whether the API server serves it is asked once, on the first Event; where it
does not (a cluster below that minimum), one error says so and no Event is written: the
controller reconciles on without them. Emitting never raises: an Event that cannot be written is
logged (an Event is a courtesy; the status is the record). By default an Event is written on the
caller's thread; with ``background=True`` (the controller) ``event()`` only queues it, and one
thread writes the queue in order, as client-go's event broadcaster does: a reconcile worker never
waits on Event writes (a preemption writes half a dozen), so it is free for the next job's flush
sooner. The time of an Event is when it was queued; ``close()`` writes what is queued, within a
timeout.
"""

from __future__ import annotations

import logging
import queue
import shlex
import threading
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any

from orchestrator.events import SERIES_WINDOW_SECONDS, LoggingEventSink, event_identity
from orchestrator.events import EventType as JobEventType
from orchestrator.k8s.api import EVENTS, MIN_KUBERNETES, AlreadyExists, KubeClient, KubeError, NotFound, Object
from orchestrator.k8s.informer import Cache
from orchestrator.model import JobKey
from orchestrator.reconciler import CHECKPOINT_URI_OWNED, INVALID_CHECKPOINT_URI, RESTART_BUDGET_EXHAUSTED

log = logging.getLogger(__name__)

REPORTING_CONTROLLER = "spotjob.dev/controller"
_NOTE_LIMIT = 1024  # bytes; the API server rejects longer notes
_REASON_LIMIT = 128


class EventType(StrEnum):
    NORMAL = "Normal"
    WARNING = "Warning"


@dataclass(frozen=True)
class ObjectRef:
    """The object an Event is about (an ObjectReference)."""

    kind: str
    name: str
    namespace: str = ""
    api_version: str = "v1"
    uid: str = ""
    resource_version: str = ""

    @classmethod
    def of(cls, obj: Object) -> ObjectRef:
        meta = obj.get("metadata") or {}
        return cls(
            kind=str(obj.get("kind") or ""),
            name=str(meta.get("name") or ""),
            namespace=str(meta.get("namespace") or ""),
            api_version=str(obj.get("apiVersion") or "v1"),
            uid=str(meta.get("uid") or ""),
            resource_version=str(meta.get("resourceVersion") or ""),
        )

    def as_reference(self) -> Object:
        ref: Object = {"kind": self.kind, "name": self.name, "apiVersion": self.api_version}
        if self.namespace:
            ref["namespace"] = self.namespace
        if self.uid:
            ref["uid"] = self.uid
        return ref


@dataclass
class _Written:
    name: str
    namespace: str
    count: int
    last: datetime


def _micro(t: datetime) -> str:
    return t.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _truncate(text: str, limit: int) -> str:
    raw = text.encode("utf-8")
    if len(raw) <= limit:
        return text
    return raw[: limit - 3].decode("utf-8", "ignore") + "..."


class EventRecorder:
    """Writes Events; see the module docstring. Thread-safe."""

    def __init__(
        self,
        client: KubeClient,
        *,
        instance: str,
        events_namespace_for_cluster_objects: str = "default",
        series_window: float = SERIES_WINDOW_SECONDS,
        cache_size: int = 4096,
        now: Callable[[], datetime] = lambda: datetime.now(UTC),
        background: bool = False,
        queue_size: int = 10000,
    ) -> None:
        """``background``: queue Events and write them from a thread of the recorder's own (see
        the module docstring); ``queue_size`` bounds that queue (a full queue drops an Event, logged)."""
        self._client = client
        self._instance = instance
        self._cluster_namespace = events_namespace_for_cluster_objects
        self._window = series_window
        self._cache_size = cache_size
        self._now = now
        self._lock = threading.Lock()
        self._written: OrderedDict[tuple[Any, ...], _Written] = OrderedDict()
        self._served: bool | None = None  # events.k8s.io/v1, once discovery has answered
        self._queue: queue.Queue[tuple[Any, ...] | None] | None = None
        self._thread: threading.Thread | None = None
        if background:
            self._queue = queue.Queue(maxsize=queue_size)
            self._thread = threading.Thread(target=self._drain, name="event-recorder", daemon=True)
            self._thread.start()

    def event(
        self,
        regarding: ObjectRef,
        type: EventType,
        reason: str,
        note: str,
        *,
        action: str | None = None,
        related: ObjectRef | None = None,
    ) -> None:
        """Record one Event (or count a repeat), or queue it (``background``). Never raises."""
        item = (regarding, type, reason, note, action or reason, related, self._now())
        if self._queue is None:
            self._write(item)
            return
        try:
            self._queue.put_nowait(item)
        except queue.Full:
            log.warning("event queue full: dropped event %s on %s %s", reason, regarding.kind, regarding.name)

    def close(self, timeout: float = 10.0) -> None:
        """Write the Events still queued (at most ``timeout`` seconds), then stop the writer thread."""
        if self._queue is None or self._thread is None:
            return
        try:
            self._queue.put(None, timeout=timeout)
        except queue.Full:
            log.warning("event queue full at shutdown: queued Events are dropped")
            return
        self._thread.join(timeout)

    def _drain(self) -> None:
        assert self._queue is not None
        while True:
            item = self._queue.get()
            if item is None:
                return
            self._write(item)

    def _write(self, item: tuple[Any, ...]) -> None:
        regarding, reason = item[0], item[2]
        try:
            self._event(*item)
        except KubeError as e:
            log.warning("could not record event %s on %s %s: %s", reason, regarding.kind, regarding.name, e)
        except Exception:
            log.exception("could not record event %s on %s %s", reason, regarding.kind, regarding.name)

    def normal(self, regarding: ObjectRef, reason: str, note: str, **kw: Any) -> None:
        self.event(regarding, EventType.NORMAL, reason, note, **kw)

    def warning(self, regarding: ObjectRef, reason: str, note: str, **kw: Any) -> None:
        self.event(regarding, EventType.WARNING, reason, note, **kw)

    # --

    def _event(
        self,
        regarding: ObjectRef,
        type: EventType,
        reason: str,
        note: str,
        action: str,
        related: ObjectRef | None,
        now: datetime,
    ) -> None:
        if not reason or len(reason) > _REASON_LIMIT or not reason[0].isupper():
            raise ValueError(f"an Event reason is CamelCase and at most {_REASON_LIMIT} characters: {reason!r}")
        note = _truncate(note, _NOTE_LIMIT)
        namespace = regarding.namespace or self._cluster_namespace
        if not self._events_served():
            return
        # One fault's repeats count on one Event though their words differ by a request id, a time
        # or an address (``event_identity``); the Event keeps its first note (events.k8s.io/v1
        # notes cannot change), the log has each one's words.
        identity = event_identity(reason, note)
        key = (regarding.kind, regarding.namespace, regarding.name, regarding.uid, type.value, reason, identity)
        with self._lock:
            seen = self._written.get(key)
            if seen is not None:
                self._written.move_to_end(key)
        if seen is not None and (now - seen.last).total_seconds() <= self._window:
            try:
                self._client.patch(EVENTS, seen.name, self._series_patch(seen.count + 1, now), seen.namespace)
            except NotFound:
                pass  # expired or deleted meanwhile: write a new one
            else:
                with self._lock:
                    seen.count += 1
                    seen.last = now
                return
        body = self._new_event(regarding, type, reason, note, action, related, namespace, now)
        name = str(body["metadata"]["name"])
        try:
            self._client.create(EVENTS, body, namespace)
        except AlreadyExists:
            pass  # our own create, retried after its answer was lost: the name is unique to it
        with self._lock:
            self._written[key] = _Written(name, namespace, 1, now)
            self._written.move_to_end(key)
            while len(self._written) > self._cache_size:
                self._written.popitem(last=False)

    def _events_served(self) -> bool:
        """Whether the API server serves events.k8s.io/v1: asked once (a failed discovery is asked
        again on the next Event, and that Event is logged as not recorded). Where it does not, one
        error for the operator, then no Event is attempted: each would fail with a bare 404."""
        served = self._served
        if served is None:
            served = self._client.api_group_served(EVENTS.group, EVENTS.version)
            with self._lock:
                first, self._served = self._served is None, served
            if first and not served:
                log.error(
                    "the API server does not serve %s/%s, the Events API of every Kubernetes since 1.19: "
                    "spotjob needs Kubernetes %s or later. No Events are written (kubectl describe and "
                    "kubectl spotjob events show none); jobs are reconciled as usual, their status is the record",
                    EVENTS.group,
                    EVENTS.version,
                    MIN_KUBERNETES,
                )
        return served

    def _new_event(
        self,
        regarding: ObjectRef,
        type: EventType,
        reason: str,
        note: str,
        action: str,
        related: ObjectRef | None,
        namespace: str,
        now: datetime,
    ) -> Object:
        name = f"{regarding.name}.{uuid.uuid4().hex[:16]}"
        body: Object = {
            "apiVersion": f"{EVENTS.group}/{EVENTS.version}",
            "kind": "Event",
            "metadata": {"name": name, "namespace": namespace},
            "eventTime": _micro(now),
            "reportingController": REPORTING_CONTROLLER,
            "reportingInstance": self._instance,
            "action": action[:_REASON_LIMIT],
            "reason": reason,
            "type": type.value,
            "note": note,
            "regarding": regarding.as_reference(),
        }
        if related is not None:
            body["related"] = related.as_reference()
        return body

    @staticmethod
    def _series_patch(count: int, now: datetime) -> Object:
        return {"series": {"count": count, "lastObservedTime": _micro(now)}}


_POINTED = frozenset({RESTART_BUDGET_EXHAUSTED.name, INVALID_CHECKPOINT_URI.name, CHECKPOINT_URI_OWNED.name})
"""The reasons whose Event on the SpotJob ends with a pointer to ``kubectl spotjob status``, whose
``Next:`` line says how to go on (``orchestrator.kubectl_status.next_step``): each of them fails the
job. Not ``StorageRefused``: the same reason also warns of a job that goes on (no ``Next:`` line),
and the failing one's message already says what to do. Not the reconciler's message: local mode
shares it, and says the same with ``spotjob run``'s last lines and ``spotjob status NAME``."""


def job_note(key: JobKey, reason: str, message: str) -> str:
    """The note of the Event on the SpotJob: ``message``, and for a reason in ``_POINTED`` a pointer
    to the advice after it, within the API server's limit; where they do not fit, the message (the
    worker's last words) is cut, never the pointer."""
    if reason not in _POINTED:
        return message
    pointer = (
        f"; see `kubectl spotjob status {shlex.quote(key.name)} -n {shlex.quote(key.namespace)}` for how to continue"
    )
    return _truncate(message, _NOTE_LIMIT - len(pointer.encode())) + pointer


class JobEventSink:
    """The reconciler's ``orchestrator.events.EventSink`` on Kubernetes: Events on the SpotJob, and
    on the Node the Event names (a notice for it, a worker lost with it), each pointing at the other
    (``related``), so ``kubectl describe node`` tells which jobs a node's preemption moved.

    The SpotJob's uid comes from the informer's cache (an Event without it still lands, matched by
    name). Also logs each Event. Never raises.
    """

    def __init__(self, recorder: EventRecorder, jobs: Cache, nodes: Cache) -> None:
        """``jobs`` and ``nodes``: the SpotJob and Node informers' caches."""
        self._recorder = recorder
        self._jobs = jobs
        self._nodes = nodes
        self._log = LoggingEventSink()

    def emit(self, key: JobKey, type: JobEventType, reason: str, message: str, *, node: str | None = None) -> None:
        self._log.emit(key, type, reason, message, node=node)
        note = job_note(key, reason, message)
        kind = EventType(str(type))
        try:
            cached = self._jobs.get(key.namespace, key.name)
            job = (
                ObjectRef.of(cached)
                if cached is not None
                else ObjectRef("SpotJob", key.name, key.namespace, api_version="spotjob.dev/v1alpha1")
            )
            node_ref: ObjectRef | None = None
            if node:
                cached_node = self._nodes.get("", node)
                node_ref = ObjectRef.of(cached_node) if cached_node is not None else ObjectRef("Node", node)
        except Exception:
            log.exception("could not describe event %s of job %s", reason, key)
            return
        self._recorder.event(job, kind, reason, note, related=node_ref)
        if node_ref is not None:
            self._recorder.event(node_ref, kind, reason, f"SpotJob {key}: {message}", related=job)
