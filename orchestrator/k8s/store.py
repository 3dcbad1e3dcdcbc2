"""The Kubernetes ``JobStore``: SpotJob resources, their status written through the status subresource.

Reads come from the SpotJob informer's cache (no request per pass); writes are a PUT to
``spotjobs/<name>/status`` carrying the ``resourceVersion`` the pass read, so the API server
does the compare-and-swap: 409 Conflict becomes ``ConflictError`` (the reconciler re-reads).

Two details keep the cache honest:

- *write-through*: after a status write, the cache may still hold the version the write
  replaced, or on a loaded node one a write before it replaced (two writes in a row, the watch
  behind both); ``get`` returns the last written object until the cache moves past every version
  our own writes replaced, so the next pass does not fail its compare-and-swap on its own write;
- after a conflict, or when the cache does not have the job, the next ``get`` reads it fresh
  (GET), so a job the cache lags behind on is seen as the server has it, and a job deleted
  since is confirmed gone (404) rather than guessed;
- a conflict whose fresh read holds exactly the status written is our own write, whose answer
  was lost (a reset connection; the client's retry met it as a 409): it is a success, so the
  pass tells what it wrote.

The annotation ``spotjob.dev/flush-request`` (a person asking for a flush, ``kubectl spotjob
flush``) is read into ``StoredJob.flush_request``; the controller never writes it (only people do,
with ``patch`` on spotjobs), and records in the status which request it handled.

A spec or status that does not validate is returned as an invalid ``StoredJob``
(``orchestrator.store.parse_job``): the reconciler says so on that job, every other job is served.
The controller never creates or deletes SpotJobs (people and their tools do): ``create`` and
``delete`` refuse.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
from collections.abc import Callable
from typing import Any

from orchestrator.k8s.api import SPOTJOBS, Conflict, KubeClient, KubeError, NotFound, Object, resource_version
from orchestrator.k8s.informer import Cache
from orchestrator.model import (
    FLUSH_REQUEST_ANNOTATION,
    JobKey,
    JobSpec,
    JobStatus,
    dropped_template_nulls,
    invalid_flush_request_id,
    parse_flush_request,
    parse_timestamp,
)
from orchestrator.store import ConflictError, JobNotFoundError, JobStore, StoredJob, StoreError, parse_job

log = logging.getLogger(__name__)

NEWER_FIELDS = (
    "the SpotJob CRD is newer than this controller (the API server's schema let the fields in); "
    "upgrade the controller to the spotjob whose CRD this is (README 'Upgrading')",
    "written by a newer spotjob controller; upgrade the controller to it (README 'Upgrading': going back "
    "to an older controller is not supported)",
)
"""What fields the controller's model does not know mean on Kubernetes (``parse_job``'s ``newer``)."""

LAST_APPLIED_ANNOTATION = "kubectl.kubernetes.io/last-applied-configuration"


class KubeJobStore(JobStore):
    """SpotJobs through ``KubeClient`` and the SpotJob informer's ``Cache``. Thread-safe."""

    def __init__(
        self, client: KubeClient, cache: Cache, *, on_writing: Callable[[str, str, object], None] | None = None
    ) -> None:
        """``on_writing(namespace, name, status)`` is told each status just before it is written
        (``controller.OwnStatusWrites``: the job is not queued again for its own write)."""
        self._client = client
        self._cache = cache
        self._on_writing = on_writing
        self._lock = threading.Lock()
        self._written: dict[JobKey, tuple[frozenset[str], Object]] = {}
        """key -> (the resourceVersions our writes in a row replaced, the object the last returned)."""
        self._fresh: set[JobKey] = set()
        """Keys to read from the server on their next ``get`` (after a conflict)."""

    def get(self, key: JobKey) -> StoredJob | None:
        obj = self._object(key)
        if obj is None:
            return None
        return _stored(key, obj)

    def update_status(self, key: JobKey, status: JobStatus, *, version: str) -> StoredJob:
        current = self._object(key, prefer_cache=True)
        if current is None:
            raise JobNotFoundError(str(key))
        document = status.model_dump(mode="json", exclude_none=True)
        if resource_version(current) == version and current.get("status") == document:
            return _stored(key, current)  # nothing changed: no write, no new resourceVersion
        body: Object = {
            "apiVersion": SPOTJOBS.api_version,
            "kind": SPOTJOBS.kind,
            "metadata": {"name": key.name, "namespace": key.namespace, "resourceVersion": version},
            # The server keeps its own spec on a status write; sending the one read keeps the
            # body a whole, valid SpotJob for servers that validate it before merging.
            "spec": current.get("spec"),
            "status": document,
        }
        if self._on_writing is not None:
            self._on_writing(key.namespace, key.name, document)
        try:
            written = self._client.replace(SPOTJOBS, body, subresource="status")
        except Conflict as e:
            landed = self._landed(key, document)
            if landed is None:
                with self._lock:
                    self._fresh.add(key)
                    self._written.pop(key, None)
                raise ConflictError(f"SpotJob {key} changed since it was read: {e}") from e
            # Our own write: it landed and its answer was lost (the client's retry met it as a
            # 409). Taken for a conflict, the pass would tell none of what it wrote.
            log.info("SpotJob %s: the answer to its status write was lost; the status it wrote is there", key)
            written = landed
        except NotFound as e:
            raise JobNotFoundError(str(key)) from e
        except KubeError as e:
            raise StoreError(f"cannot write the status of SpotJob {key}: {e}") from e
        written.setdefault("kind", SPOTJOBS.kind)
        written.setdefault("apiVersion", SPOTJOBS.api_version)
        with self._lock:
            before = self._written.get(key)
            replaced = frozenset({version})
            if before is not None and resource_version(before[1]) == version:
                replaced |= before[0]  # a write on top of our own: the cache may lag behind both
            self._written[key] = (replaced, written)
        return _stored(key, written)

    def _landed(self, key: JobKey, document: Object) -> Object | None:
        """The job as the server has it now, if its status is ``document``; else (or unreadable) None."""
        try:
            obj = self._client.get(SPOTJOBS, key.name, key.namespace)
        except KubeError:
            return None
        return obj if obj.get("status") == document else None

    def keys(self) -> list[JobKey]:
        return sorted(JobKey(ns, name) for ns, name in self._cache.object_keys())

    def create(self, key: JobKey, spec: JobSpec) -> StoredJob:
        raise StoreError(f"the controller does not create SpotJobs ({key}): apply one with kubectl")

    def delete(self, key: JobKey) -> None:
        raise StoreError(f"the controller does not delete SpotJobs ({key}): delete it with kubectl")

    def forget(self, key: JobKey) -> None:
        """Drop what is remembered about ``key`` (the job was deleted)."""
        with self._lock:
            self._written.pop(key, None)
            self._fresh.discard(key)

    # --

    def _object(self, key: JobKey, *, prefer_cache: bool = False) -> Object | None:
        with self._lock:
            fresh = key in self._fresh and not prefer_cache
            written = self._written.get(key)
        cached = None if fresh else self._cache.get(key.namespace, key.name)
        if cached is not None:
            if written is not None:
                replaced, obj = written
                if resource_version(cached) in replaced:
                    return obj  # the cache has not caught up with our own writes yet
                with self._lock:
                    self._written.pop(key, None)
            return cached
        if prefer_cache and written is not None:
            return written[1]
        try:
            obj = self._client.get(SPOTJOBS, key.name, key.namespace)
        except NotFound:
            self.forget(key)
            return None
        except KubeError as e:
            raise StoreError(f"cannot read SpotJob {key}: {e}") from e
        obj.setdefault("kind", SPOTJOBS.kind)
        obj.setdefault("apiVersion", SPOTJOBS.api_version)
        with self._lock:
            self._fresh.discard(key)
        return obj


def _stored(key: JobKey, obj: Object) -> StoredJob:
    meta: dict[str, Any] = obj.get("metadata") or {}
    stored = parse_job(
        key,
        obj.get("spec"),
        obj.get("status") or None,
        version=resource_version(obj),
        generation=int(meta.get("generation") or 1),
        uid=str(meta.get("uid") or ""),
        created_at=parse_timestamp(meta.get("creationTimestamp")),
        newer=NEWER_FIELDS,
    )
    if meta.get("deletionTimestamp"):
        stored = dataclasses.replace(stored, deleting=True)
    lost = _lost_fallback_nulls(obj.get("spec"), (meta.get("annotations") or {}).get(LAST_APPLIED_ANNOTATION))
    if lost:
        stored = dataclasses.replace(stored, lost_nulls=tuple(lost))
    raw = (meta.get("annotations") or {}).get(FLUSH_REQUEST_ANNOTATION)
    if not raw:
        return stored
    try:
        request = parse_flush_request(str(raw))
    except ValueError as e:
        # Handled once too: known by a digest of what was written.
        rid = invalid_flush_request_id(str(raw))
        return dataclasses.replace(stored, flush_request_problem=str(e), flush_request_id=rid)
    return dataclasses.replace(stored, flush_request=request, flush_request_id=request.id)


def _lost_fallback_nulls(spec: Any, last_applied: Any) -> list[str]:
    """The nulls of ``spec.fallback.template`` that ``kubectl apply`` kept in its last-applied
    annotation and did not send (``dropped_template_nulls``); none when either cannot be read."""
    if not isinstance(spec, dict) or not isinstance(spec.get("fallback"), dict) or not isinstance(last_applied, str):
        return []
    try:
        applied = json.loads(last_applied)
    except ValueError:
        return []
    for key in ("spec", "fallback"):
        applied = applied.get(key) if isinstance(applied, dict) else None
    if not isinstance(applied, dict) or not isinstance(applied.get("template"), dict):
        return []
    return dropped_template_nulls(spec.get("template"), spec["fallback"].get("template") or {}, applied["template"])
