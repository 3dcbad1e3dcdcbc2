"""The test API server's storage: one versioned map of objects, a bounded event history, watchers.

Every write takes the one lock, bumps the global resourceVersion (an integer, sent as a string),
appends an event to the history and hands it to the watchers of that resource. Stored objects are
never mutated after they are stored (writers store new dicts), so readers, watchers and the event
history share them without copying. A watch resumes from a resourceVersion only while the history
still holds every event after it; ``expire_history()`` drops it all, as compaction would, so a
client's re-list after a 410 can be tested on demand.
"""

from __future__ import annotations

import collections
import json
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

Obj = dict[str, Any]
Key = tuple[str, str]  # (namespace or "", name)


@dataclass
class Event:
    type: str  # ADDED, MODIFIED, DELETED
    resource: str  # the resource's storage id, e.g. "core/pods"
    rv: int
    obj: Obj
    prev: Obj | None = None
    _line: bytes | None = field(default=None, repr=False)

    def line(self) -> bytes:
        """The JSON line a watch sends for this event, encoded once for all watchers."""
        if self._line is None:
            self._line = json.dumps({"type": self.type, "object": self.obj}, separators=(",", ":")).encode() + b"\n"
        return self._line


class Watcher:
    """One watch connection's queue; ``close()`` ends it (``dropped`` says it was cut, not timed out)."""

    def __init__(self, resource: str) -> None:
        self.resource = resource
        self.namespace: str | None = None
        """The namespace the watch was opened in (the HTTP layer sets it), None for cluster-wide."""
        self._queue: collections.deque[Event] = collections.deque()
        self._cond = threading.Condition(threading.Lock())
        self.closed = False
        self.dropped = False

    def push(self, event: Event) -> None:
        with self._cond:
            if self.closed:
                return  # a watch the server ended, or cut, hears of nothing after it
            self._queue.append(event)
            self._cond.notify()

    def close(self, dropped: bool = False) -> None:
        """End the watch. A cut one (``dropped``) loses what waits in its queue, as a real
        connection cut mid-stream loses what was in flight: its client resumes from the last event
        it got. (Delivering them anyway let a change made after the cut reach the client over the
        cut connection, under load, when the connection's thread woke late.)"""
        with self._cond:
            self.closed = True
            self.dropped = dropped
            if dropped:
                self._queue.clear()
            self._cond.notify()

    def idle(self) -> bool:
        """No event waits (call under the store lock to know a bookmark's RV covers them all)."""
        return not self._queue

    def next(self, timeout: float) -> Event | None:
        """The next event, or None after ``timeout`` seconds or once closed."""
        with self._cond:
            if not self._queue and not self.closed:
                self._cond.wait(timeout)
            if self._queue:
                return self._queue.popleft()
            return None


class Store:
    def __init__(self, history_size: int = 20000) -> None:
        self.lock = threading.RLock()
        self.rv = 1
        self._objects: dict[str, dict[Key, Obj]] = collections.defaultdict(dict)
        self._history: collections.deque[Event] = collections.deque()
        self._history_size = history_size
        self.history_floor = 1  # a watch may resume from any RV >= this
        self._watchers: dict[str, set[Watcher]] = collections.defaultdict(set)
        self._listeners: list[Callable[[Event], None]] = []

    # Reads -------------------------------------------------------------------------------------
    def get(self, resource: str, namespace: str, name: str) -> Obj | None:
        return self._objects[resource].get((namespace, name))

    def select(self, resource: str, namespace: str | None = None) -> list[Obj]:
        with self.lock:
            items = self._objects[resource]
            if namespace is None:
                return list(items.values())
            return [o for (ns, _), o in items.items() if ns == namespace]

    def items(self, resource: str) -> Iterable[tuple[Key, Obj]]:
        return list(self._objects[resource].items())

    def resources(self) -> list[str]:
        return list(self._objects)

    # Writes (callers hold ``lock`` across read-modify-write) ------------------------------------
    def next_rv(self) -> int:
        self.rv += 1
        return self.rv

    def put(self, resource: str, obj: Obj, event_type: str, prev: Obj | None, rv: int) -> None:
        md = obj["metadata"]
        self._objects[resource][(md.get("namespace", ""), md["name"])] = obj
        self._emit(Event(event_type, resource, rv, obj, prev))

    def remove(self, resource: str, obj: Obj, rv: int) -> None:
        md = obj["metadata"]
        prev = self._objects[resource].pop((md.get("namespace", ""), md["name"]), None)
        self._emit(Event("DELETED", resource, rv, obj, prev))

    def _emit(self, event: Event) -> None:
        self._history.append(event)
        while len(self._history) > self._history_size:
            self.history_floor = self._history.popleft().rv
        for w in self._watchers.get(event.resource, ()):
            w.push(event)
        for listener in self._listeners:
            listener(event)

    # Watches -----------------------------------------------------------------------------------
    def watch(self, resource: str, since: int) -> tuple[Watcher, list[Event]] | None:
        """Register a watcher; return it with the history after ``since``, or None when expired."""
        with self.lock:
            if since < self.history_floor:
                return None
            w = Watcher(resource)
            backlog = [e for e in self._history if e.rv > since and e.resource == resource] if since < self.rv else []
            self._watchers[resource].add(w)
            return w, backlog

    def unwatch(self, w: Watcher) -> None:
        with self.lock:
            self._watchers[w.resource].discard(w)

    def watchers(self, resource: str | None = None) -> Iterator[Watcher]:
        with self.lock:
            pools = [self._watchers[resource]] if resource else list(self._watchers.values())
            return iter([w for pool in pools for w in pool])

    def expire_history(self) -> None:
        """Forget every event so far: any watch from an older RV now gets 410 Expired."""
        with self.lock:
            self._history.clear()
            self.history_floor = self.rv

    def add_listener(self, listener: Callable[[Event], None]) -> None:
        """Called under the lock for every event; must not block (controllers enqueue work)."""
        self._listeners.append(listener)
