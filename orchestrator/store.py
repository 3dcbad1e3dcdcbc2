"""Where jobs persist: the spec the user submitted and the status the reconciler keeps, by ``JobKey``.

One small interface with two homes: the SpotJob resource and its status subresource
(``orchestrator.k8s.store``, Kubernetes) and ``JsonFileJobStore`` (local mode: one JSON file per
job, the document ``kubectl get spotjob NAME -o json`` would show).

Contract:

- ``get`` never fails because of one job's content: a job whose stored spec does not validate is
  returned with ``spec=None`` and ``invalid`` naming the first bad field (``spec.replicas: ...``),
  so the reconciler can say so on that job (an ``Invalid`` condition and a Warning Event) and
  keep serving every other job. A status that does not validate is the same, with ``status=None``
  and ``invalid`` naming ``status.<field>``: the reconciler then writes nothing (writing would
  discard the job's memory) and only warns. ``StoreError`` is for the store itself failing.
- ``update_status`` is a compare-and-swap on ``version`` (Kubernetes' resourceVersion): it raises
  ``ConflictError`` if the job changed since it was read; the reconciler then re-reads ("409
  means re-read"). Writes are atomic: a reader sees the old document or the new one, never half.
- Status is the reconciler's only memory, so it must be durable once ``update_status`` returns.
- ``generation`` counts changes of the spec (Kubernetes' ``metadata.generation``); the reconciler
  copies the one it acted on into ``status.observedGeneration``. ``uid`` tells a job from an
  earlier one of the same key.
"""

from __future__ import annotations

import abc
import contextlib
import fcntl
import json
import logging
import os
import re
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from pydantic import ValidationError

from agent.atomic_file import write_atomic
from agent.version import spotjob_version
from orchestrator.model import FlushRequest, JobKey, JobSpec, JobStatus, describe_validation_error, parse_timestamp

log = logging.getLogger(__name__)


class StoreError(Exception):
    """The store cannot be read or written."""


class JobNotFoundError(StoreError, KeyError):
    """No job of that key."""


class JobExistsError(StoreError):
    """A job of that key exists already."""


class ConflictError(StoreError):
    """The job changed since it was read: re-read and decide again."""


@dataclass(frozen=True)
class StoredJob:
    """A job as read.

    ``spec`` is None exactly when the stored spec does not validate; ``status`` is None before
    the first status write, or when the stored status does not validate. ``invalid`` then says
    why, naming the field (``spec.checkpoint.uri: ...``, ``status.phase: ...``).
    """

    key: JobKey
    spec: JobSpec | None
    status: JobStatus | None
    version: str
    """The compare-and-swap token of ``update_status`` (resourceVersion)."""
    generation: int = 1
    """The spec's generation (``metadata.generation``)."""
    uid: str = ""
    created_at: datetime | None = None
    """When the job was created (``metadata.creationTimestamp``, to the second): a job deleted and
    created again under its name is a new one, created after its predecessor's attempt records."""
    invalid: str | None = None
    flush_request: FlushRequest | None = None
    """A person's request to flush (Kubernetes: the ``spotjob.dev/flush-request`` annotation)."""
    flush_request_problem: str | None = None
    """Why that request could not be read; ``flush_request_id`` then names it."""
    flush_request_id: str | None = None
    """The id the request is known by: its own, or for one that cannot be read a digest of it."""
    lost_nulls: tuple[str, ...] = ()
    """Paths under ``spec.fallback.template`` whose ``null`` the manifest had and the stored spec
    lacks (Kubernetes: client-side ``kubectl apply`` sends no null), where it would have removed a
    key of ``spec.template``."""
    deleting: bool = False
    """The job is being deleted (Kubernetes: ``metadata.deletionTimestamp``; a finalizer, or a
    foreground deletion waiting for the pods, keeps it readable meanwhile)."""


def parse_job(
    key: JobKey,
    spec: Any,
    status: Any,
    *,
    version: str,
    generation: int = 1,
    uid: str = "",
    created_at: datetime | None = None,
    newer: tuple[str, str] | None = None,
) -> StoredJob:
    """A ``StoredJob`` from a resource's raw ``spec`` and ``status`` (camelCase JSON values): the one
    place both stores turn stored documents into models, with the ``invalid`` rule of the module
    docstring. ``newer``: (spec, status) — what fields this spotjob does not know, and nothing else
    wrong, mean in this store (on Kubernetes the API server's schema let them in: a newer CRD, a
    newer controller), said instead of "Extra inputs are not permitted"."""
    problems: list[str] = []
    parsed_spec: JobSpec | None = None
    parsed_status: JobStatus | None = None
    try:
        parsed_spec = JobSpec.model_validate(spec)
    except ValidationError as e:
        problems.append(_describe(e, "spec", newer[0] if newer else None))
    if status is not None:
        try:
            parsed_status = JobStatus.model_validate(status)
        except ValidationError as e:
            problems.append(_describe(e, "status", newer[1] if newer else None))
    return StoredJob(
        key=key,
        spec=parsed_spec,
        status=parsed_status,
        version=version,
        generation=generation,
        uid=uid,
        created_at=created_at,
        invalid="; ".join(problems) or None,
    )


def _describe(error: ValidationError, prefix: str, newer: str | None) -> str:
    errors = error.errors()
    if newer is None or not all(item["type"] == "extra_forbidden" for item in errors):
        return describe_validation_error(error, prefix)
    fields = ", ".join(prefix + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in e["loc"]) for e in errors)
    return f"{fields}: not known to this controller (spotjob {spotjob_version()}): {newer}"


class JobStore(abc.ABC):
    """Jobs by key. See the module docstring for the contract."""

    @abc.abstractmethod
    def create(self, key: JobKey, spec: JobSpec) -> StoredJob:
        """Store a new job with no status; ``JobExistsError`` if the key is taken."""

    @abc.abstractmethod
    def get(self, key: JobKey) -> StoredJob | None:
        """The job, or None if there is none of that key (see the module docstring on ``invalid``)."""

    @abc.abstractmethod
    def update_status(self, key: JobKey, status: JobStatus, *, version: str) -> StoredJob:
        """Replace the job's status if it is still at ``version``; ``ConflictError`` otherwise,
        ``JobNotFoundError`` if it is gone."""

    @abc.abstractmethod
    def keys(self) -> list[JobKey]:
        """Every job's key, sorted."""

    @abc.abstractmethod
    def delete(self, key: JobKey) -> None:
        """Forget the job; a missing job is fine."""


class JsonFileJobStore(JobStore):
    """One ``<root>/<namespace>/<name>.json`` per job, shaped like the resource::

        {"apiVersion": "spotjob.dev/v1alpha1", "kind": "SpotJob",
         "metadata": {"namespace", "name", "uid", "generation", "resourceVersion", "creationTimestamp"},
         "spec": {...}, "status": {...}}

    Writes go to a temp file in the same folder, are fsynced and renamed over the old file (then
    the folder is fsynced), so a crash leaves the old document or the new one. The version check
    and the write happen under an advisory lock on ``<root>/<namespace>/.<name>.lock``, so two
    processes on one machine cannot both win a compare-and-swap. ``fsync=False`` keeps the atomic
    rename but not the durability across a power cut (tests, throwaway runs). Keys whose parts are
    not DNS labels are refused (they become file names). Local mode keeps one job per run folder,
    ``spotjob-runs/<name>/local/<name>.json``.
    """

    API_VERSION = "spotjob.dev/v1alpha1"
    KIND = "SpotJob"

    def __init__(self, root: str, *, fsync: bool = True, create: bool = True) -> None:
        """``create=False``: do not create ``root`` (a reader that must not leave folders behind)."""
        self.root = os.path.abspath(root)
        self._fsync = fsync
        if create:
            os.makedirs(self.root, exist_ok=True)

    def path(self, key: JobKey) -> str:
        _check_file_safe(key)
        return os.path.join(self.root, key.namespace, f"{key.name}.json")

    def create(self, key: JobKey, spec: JobSpec) -> StoredJob:
        with self._locked(key):
            if os.path.exists(self.path(key)):
                raise JobExistsError(f"job {key} exists already in {self.root}")
            document = {
                "apiVersion": self.API_VERSION,
                "kind": self.KIND,
                "metadata": {
                    "namespace": key.namespace,
                    "name": key.name,
                    "uid": str(uuid.uuid4()),
                    "generation": 1,
                    "resourceVersion": "1",
                    "creationTimestamp": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
                },
                "spec": spec.model_dump(mode="json", exclude_none=True),
            }
            self._write(key, document)
            return self._parse(key, document)

    def get(self, key: JobKey) -> StoredJob | None:
        document = self._read(key)
        return None if document is None else self._parse(key, document)

    def update_status(self, key: JobKey, status: JobStatus, *, version: str) -> StoredJob:
        with self._locked(key):
            document = self._read(key)
            if document is None:
                raise JobNotFoundError(str(key))
            current = str(document["metadata"].get("resourceVersion"))
            if current != version:
                raise ConflictError(f"job {key} is at version {current}, not {version}: it changed since it was read")
            document["status"] = status.model_dump(mode="json", exclude_none=True)
            document["metadata"]["resourceVersion"] = str(int(current) + 1)
            self._write(key, document)
            return self._parse(key, document)

    def keys(self) -> list[JobKey]:
        out: list[JobKey] = []
        try:
            namespaces = [e for e in os.scandir(self.root) if e.is_dir() and not e.name.startswith(".")]
        except FileNotFoundError:
            return out
        for ns in namespaces:
            for entry in os.scandir(ns.path):
                if entry.is_file() and entry.name.endswith(".json") and not entry.name.startswith("."):
                    out.append(JobKey(ns.name, entry.name[: -len(".json")]))
        return sorted(out)

    def delete(self, key: JobKey) -> None:
        with self._locked(key), contextlib.suppress(FileNotFoundError):
            os.unlink(self.path(key))

    def remove(self, key: JobKey) -> None:
        """``delete`` the job and its lock file too: for a job no other process knows of (one
        ``spotjob run`` made and gives up before driving it, ``LocalRun.discard``)."""
        self.delete(key)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._lock_path(key))

    # -- helpers -------------------------------------------------------------------------------
    def _read(self, key: JobKey) -> dict[str, Any] | None:
        path = self.path(key)
        try:
            with open(path, "rb") as f:
                raw = f.read()
        except FileNotFoundError:
            return None
        except OSError as e:
            raise StoreError(f"cannot read {path}: {e}") from e
        try:
            document = json.loads(raw)
        except ValueError as e:
            raise StoreError(f"{path} is not JSON: {e}") from e
        if not isinstance(document, dict) or not isinstance(document.get("metadata"), dict):
            raise StoreError(f"{path} is not a SpotJob document (no metadata)")
        if not str(document["metadata"].get("resourceVersion", "")).isdigit():
            raise StoreError(f"{path}: metadata.resourceVersion must be a number")
        return document

    def _parse(self, key: JobKey, document: dict[str, Any]) -> StoredJob:
        metadata = document["metadata"]
        generation = metadata.get("generation", 1)
        return parse_job(
            key,
            document.get("spec"),
            document.get("status"),
            version=str(metadata["resourceVersion"]),
            generation=generation if isinstance(generation, int) else 1,
            uid=str(metadata.get("uid", "")),
            created_at=parse_timestamp(metadata.get("creationTimestamp")),
        )

    def _lock_path(self, key: JobKey) -> str:
        return os.path.join(os.path.dirname(self.path(key)), f".{key.name}.lock")

    @contextlib.contextmanager
    def _locked(self, key: JobKey) -> Iterator[None]:
        lock = self._lock_path(key)
        os.makedirs(os.path.dirname(lock), exist_ok=True)
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # closing releases the lock

    def _write(self, key: JobKey, document: dict[str, Any]) -> None:
        dest = self.path(key)
        try:
            write_atomic(dest, json.dumps(document, indent=2).encode() + b"\n", durable=self._fsync)
        except OSError as e:
            raise StoreError(f"cannot write {dest}: {e}") from e
        log.debug("job %s: stored version %s", key, document["metadata"]["resourceVersion"])


_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")


def _check_file_safe(key: JobKey) -> None:
    for part in (key.namespace, key.name):
        if not _DNS_LABEL.fullmatch(part):
            raise StoreError(f"{key}: a local job's namespace and name must be DNS labels (they name files)")
