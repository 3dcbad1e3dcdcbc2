"""Informers: a list, then a watch from the list's resourceVersion, into a thread-safe cache per kind.

What runs in order, in one thread per (kind, namespace):

1. list (all pages) → replace that namespace's part of the cache; objects that vanished meanwhile
   are reported as deleted, new ones as added, changed ones as updated; the informer is synced
   once every namespace's first list landed;
2. watch from the list's resourceVersion with bookmarks; each event updates the cache first, then
   calls the handlers (which only enqueue keys: they run on this thread and must not block);
3. the server ends the watch (timeoutSeconds) or the connection drops → watch again from the last
   resourceVersion seen (an event or a bookmark), so nothing is lost and nothing is listed again;
4. 410 Gone (the server no longer keeps that version) → back to 1. The client's ``watch.Watch``
   gives up after one 410, which is why this loop is ours.

In parallel: the threads of other kinds and namespaces, the work-queue workers reading the cache
(every read returns copies under the lock, so a reader never sees a half-applied event), and
``stop()`` from any thread, which closes the open watch so the thread exits at once.

The cache is a view, not the truth: a decision that matters (a node lost, a pod gone) is made
from what the cache shows *over time* (see ``cluster_signals.NodeLossTracker``), or confirmed
with a fresh read.
"""

from __future__ import annotations

import builtins
import logging
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from orchestrator.k8s.api import (
    Gone,
    KubeClient,
    KubeError,
    NotFound,
    Object,
    Resource,
    TransientError,
    object_key,
    resource_version,
)

log = logging.getLogger(__name__)

Key = tuple[str, str]
"""(namespace, name); namespace "" for cluster-scoped kinds."""

Indexer = Callable[[Object], Iterable[str]]
"""Index values of one object (e.g. the job a pod belongs to, the node it runs on)."""


@dataclass
class EventHandler:
    """Callbacks after the cache changed. They run on the informer's thread: enqueue, never block."""

    on_add: Callable[[Object], None] | None = None
    on_update: Callable[[Object, Object], None] | None = None
    on_delete: Callable[[Object], None] | None = None


def _copy(value: Any) -> Any:
    """A deep copy of a JSON tree (dicts, lists and immutable scalars): what the API server sends,
    at about twice the speed of ``copy.deepcopy``, which a cache of a thousand Nodes feels."""
    if isinstance(value, dict):
        return {k: _copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_copy(v) for v in value]
    return value


class Cache:
    """Objects of one kind by (namespace, name), with optional secondary indexes. Thread-safe.

    Reads return deep copies: callers may mutate what they get without corrupting the cache. A
    cached object is never changed in place (an event replaces it whole), so copies are made
    outside the lock: a reader copying a thousand objects does not hold up the informer.
    """

    def __init__(self, indexers: dict[str, Indexer] | None = None) -> None:
        self._lock = threading.Lock()
        self._objects: dict[Key, Object] = {}
        self._indexers = dict(indexers or {})
        self._indexes: dict[str, dict[str, set[Key]]] = {name: {} for name in self._indexers}

    def get(self, namespace: str, name: str) -> Object | None:
        with self._lock:
            obj = self._objects.get((namespace, name))
        return _copy(obj) if obj is not None else None

    def list(self, namespace: str | None = None) -> builtins.list[Object]:
        with self._lock:
            found = [o for (ns, _), o in self._objects.items() if namespace is None or ns == namespace]
        return [_copy(o) for o in found]

    def object_keys(self) -> builtins.list[Key]:
        with self._lock:
            return list(self._objects)

    def by_index(self, index: str, value: str) -> builtins.list[Object]:
        with self._lock:
            keys = self._indexes[index].get(value, set())
            found = [self._objects[k] for k in sorted(keys)]
        return [_copy(o) for o in found]

    def __len__(self) -> int:
        with self._lock:
            return len(self._objects)

    # -- writes (the informer's thread only)

    def _put(self, obj: Object) -> Object | None:
        key = object_key(obj)
        with self._lock:
            old = self._objects.get(key)
            if old is not None:
                self._unindex(key, old)
            self._objects[key] = obj
            self._index(key, obj)
            return old

    def _remove(self, key: Key) -> Object | None:
        with self._lock:
            old = self._objects.pop(key, None)
            if old is not None:
                self._unindex(key, old)
            return old

    def _keys_in(self, namespace: str | None) -> set[Key]:
        with self._lock:
            return {k for k in self._objects if namespace is None or k[0] == namespace}

    def _index(self, key: Key, obj: Object) -> None:
        for name, fn in self._indexers.items():
            for value in _safe_index(fn, obj):
                self._indexes[name].setdefault(value, set()).add(key)

    def _unindex(self, key: Key, obj: Object) -> None:
        for name, fn in self._indexers.items():
            for value in _safe_index(fn, obj):
                bucket = self._indexes[name].get(value)
                if bucket is not None:
                    bucket.discard(key)
                    if not bucket:
                        del self._indexes[name][value]


def _safe_index(fn: Indexer, obj: Object) -> list[str]:
    try:
        return list(fn(obj))
    except Exception:
        log.exception("indexer failed on %s", object_key(obj))
        return []


@dataclass(frozen=True)
class Backoff:
    """Delays between failed lists/watches: doubling from ``initial`` up to ``maximum``."""

    initial: float = 0.5
    maximum: float = 30.0

    def delay(self, failures: int) -> float:
        return min(self.maximum, self.initial * 2 ** max(0, failures - 1))


class Informer:
    """Lists and watches one kind (in some namespaces, or all) into a ``Cache``; calls handlers."""

    def __init__(
        self,
        client: KubeClient,
        resource: Resource,
        *,
        namespaces: Sequence[str] | None = None,
        label_selector: str | None = None,
        field_selector: str | None = None,
        indexers: dict[str, Indexer] | None = None,
        watch_timeout_seconds: int = 300,
        backoff: Backoff | None = None,
    ) -> None:
        self.resource = resource
        self.cache = Cache(indexers)
        self._client = client
        # A cluster-scoped kind is watched once, whatever namespaces the controller serves.
        self._scopes: list[str | None] = list(namespaces) if (namespaces and resource.namespaced) else [None]
        self._label_selector = label_selector
        self._field_selector = field_selector
        self._watch_timeout = watch_timeout_seconds
        self._backoff = backoff or Backoff()
        self._handlers: list[EventHandler] = []
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._synced: set[str | None] = set()
        self._all_synced = threading.Event()
        self._streams: dict[str | None, object] = {}
        self._versions: dict[str | None, str | None] = {}
        """The last resourceVersion applied per scope (None: list first). Written by its thread only."""
        self._lock = threading.Lock()
        self.lists = 0
        """How many lists ran (the first ones, and one after each 410): a test reads it."""

    def __repr__(self) -> str:
        return f"Informer({self.resource}, namespaces={self._scopes})"

    def add_handler(self, handler: EventHandler) -> None:
        """Register before ``start()``: events are not replayed to handlers added later."""
        self._handlers.append(handler)

    def start(self) -> None:
        for scope in self._scopes:
            thread = threading.Thread(
                target=self._run, args=(scope,), name=f"informer-{self.resource.plural}-{scope or 'all'}", daemon=True
            )
            self._threads.append(thread)
            thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        with self._lock:
            streams = list(self._streams.values())
        for stream in streams:
            stream.close()  # type: ignore[attr-defined]
        for thread in self._threads:
            thread.join(timeout)

    def has_synced(self) -> bool:
        with self._lock:
            return len(self._synced) == len(self._scopes)

    def wait_for_sync(self, timeout: float) -> bool:
        return self._all_synced.wait(timeout)

    def alive(self) -> bool:
        """Every thread runs (for /healthz). False after ``stop()`` or if a thread died."""
        return bool(self._threads) and all(t.is_alive() for t in self._threads) and not self._stop.is_set()

    # -- the loop

    def _run(self, scope: str | None) -> None:
        failures = 0
        while not self._stop.is_set():
            try:
                if self._versions.get(scope) is None:
                    self._versions[scope] = self._list(scope)
                self._watch(scope)
                failures = 0
            except Gone as e:
                log.info("%s: resourceVersion %s expired (%s); listing again", self, self._versions.get(scope), e)
                self._versions[scope] = None
            except TransientError as e:
                failures += 1
                log.warning("%s: %s; resuming from resourceVersion %s", self, e, self._versions.get(scope))
                self._stop.wait(self._backoff.delay(failures))
            except NotFound as e:
                failures += 1
                hint = " (is the SpotJob CRD installed?)" if self.resource.group == "spotjob.dev" else ""
                log.error("%s: %s%s; listing again after a pause", self, e, hint)
                self._versions[scope] = None
                self._stop.wait(self._backoff.delay(failures))
            except KubeError as e:
                failures += 1
                log.error("%s: %s; listing again after a pause", self, e)
                self._versions[scope] = None
                self._stop.wait(self._backoff.delay(failures))
            except Exception:
                failures += 1
                log.exception("%s: unexpected failure; listing again after a pause", self)
                self._versions[scope] = None
                self._stop.wait(self._backoff.delay(failures))

    def _list(self, scope: str | None) -> str:
        items, version = self._client.list(
            self.resource, scope, label_selector=self._label_selector, field_selector=self._field_selector
        )
        self.lists += 1
        fresh = {object_key(o): o for o in items}
        for key in self.cache._keys_in(scope) - fresh.keys():
            old = self.cache._remove(key)
            if old is not None:
                self._dispatch("DELETED", old, None)
        for obj in items:
            old = self.cache._put(obj)
            if old is None:
                self._dispatch("ADDED", obj, None)
            elif resource_version(old) != resource_version(obj):
                self._dispatch("MODIFIED", obj, old)
        with self._lock:
            self._synced.add(scope)
            if len(self._synced) == len(self._scopes):
                self._all_synced.set()
        log.debug("%s: listed %d objects at resourceVersion %s", self, len(items), version)
        return version

    def _watch(self, scope: str | None) -> None:
        """Watch from the last version seen, recording each event's version as it is applied, so
        that a drop (an exception out of here) resumes exactly after the last applied event."""
        stream = self._client.watch(
            self.resource,
            scope,
            resource_version=str(self._versions[scope]),
            label_selector=self._label_selector,
            field_selector=self._field_selector,
            timeout_seconds=self._watch_timeout,
        )
        with self._lock:
            self._streams[scope] = stream
        if self._stop.is_set():
            stream.close()
        try:
            for event in stream:
                if self._stop.is_set():
                    break
                obj = event.object
                if event.type in ("ADDED", "MODIFIED"):
                    old = self.cache._put(obj)
                    self._dispatch("MODIFIED" if old is not None else "ADDED", obj, old)
                elif event.type == "DELETED":
                    self.cache._remove(object_key(obj))
                    self._dispatch("DELETED", obj, None)
                self._versions[scope] = resource_version(obj) or self._versions[scope]
        finally:
            stream.close()
            with self._lock:
                self._streams.pop(scope, None)

    def _dispatch(self, kind: str, obj: Object, old: Object | None) -> None:
        for handler in self._handlers:
            try:
                if kind == "ADDED" and handler.on_add:
                    handler.on_add(obj)
                elif kind == "MODIFIED" and handler.on_update:
                    handler.on_update(old if old is not None else obj, obj)
                elif kind == "DELETED" and handler.on_delete:
                    handler.on_delete(obj)
            except Exception:
                log.exception("%s: handler failed on %s %s", self, kind, object_key(obj))
