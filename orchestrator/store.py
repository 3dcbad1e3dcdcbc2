"""Where jobs persist: the spec the user submitted and the status the reconciler keeps.

One small interface with two homes: the SpotJob resource's status subresource (Kubernetes, later)
and ``JsonFileJobStore`` (local mode: one JSON file per job, the same document
``kubectl get spotjob NAME -o json`` shows, less the metadata).

Contract:

- ``update_status`` is a compare-and-swap on ``version`` (Kubernetes' resourceVersion): it raises
  ``ConflictError`` if the job changed since it was read; the reconciler then re-reads ("409
  means re-read"). Writes are atomic: a reader sees the old document or the new one, never half.
- Status is the reconciler's only memory, so it must be durable once ``update_status`` returns.
"""

from __future__ import annotations

import abc
import contextlib
import fcntl
import logging
import os
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

from pydantic import ValidationError

from orchestrator.model import JobSpec, JobStatus, SpotJob

log = logging.getLogger(__name__)


class StoreError(Exception):
    """The store cannot be read or written."""


class JobNotFoundError(StoreError, KeyError):
    """No job of that name."""


class JobExistsError(StoreError):
    """A job of that name exists already."""


class ConflictError(StoreError):
    """The job changed since it was read: re-read and decide again."""


class _Document(SpotJob):
    """The local file: the resource plus the version the compare-and-swap checks."""

    resource_version: str


@dataclass(frozen=True)
class StoredJob:
    """A job as read: its spec, its status (None before the first reconcile) and its version."""

    spec: JobSpec
    status: JobStatus | None
    version: str


class JobStore(abc.ABC):
    """Jobs by name. See the module docstring for the contract."""

    @abc.abstractmethod
    def create(self, spec: JobSpec) -> StoredJob:
        """Store a new job with no status; ``JobExistsError`` if the name is taken."""

    @abc.abstractmethod
    def get(self, name: str) -> StoredJob | None:
        """The job, or None if there is none of that name."""

    @abc.abstractmethod
    def update_status(self, name: str, status: JobStatus, *, version: str) -> StoredJob:
        """Replace the job's status if it is still at ``version``; ``ConflictError`` otherwise."""

    @abc.abstractmethod
    def names(self) -> list[str]:
        """Every job's name, sorted."""

    @abc.abstractmethod
    def delete(self, name: str) -> None:
        """Forget the job; a missing job is fine."""


class JsonFileJobStore(JobStore):
    """One ``<root>/<name>.json`` per job: ``{"resourceVersion": "N", "spec": …, "status": …}``.

    Writes go to a temp file in the same folder, are fsynced and renamed over the old file (then
    the folder is fsynced), so a crash leaves the old document or the new one. The version check
    and the write happen under an advisory lock on ``<root>/.<name>.lock``, so two processes on one
    machine cannot both win a compare-and-swap. ``fsync=False`` keeps the atomic rename but not
    the durability across a power cut (tests, throwaway runs).
    """

    def __init__(self, root: str, *, fsync: bool = True) -> None:
        self.root = os.path.abspath(root)
        self._fsync = fsync
        os.makedirs(self.root, exist_ok=True)

    def path(self, name: str) -> str:
        # Job names are DNS labels (validated by JobSpec), so they are safe file names.
        return os.path.join(self.root, f"{name}.json")

    def create(self, spec: JobSpec) -> StoredJob:
        with self._locked(spec.name):
            if os.path.exists(self.path(spec.name)):
                raise JobExistsError(f"job {spec.name!r} exists already in {self.root}")
            return self._write(_Document(spec=spec, resource_version="1"))

    def get(self, name: str) -> StoredJob | None:
        try:
            with open(self.path(name), "rb") as f:
                raw = f.read()
        except FileNotFoundError:
            return None
        except OSError as e:
            raise StoreError(f"cannot read {self.path(name)}: {e}") from e
        try:
            document = _Document.model_validate_json(raw)
        except ValidationError as e:
            raise StoreError(f"{self.path(name)} is not a spotjob job document: {e}") from e
        return StoredJob(document.spec, document.status, document.resource_version)

    def update_status(self, name: str, status: JobStatus, *, version: str) -> StoredJob:
        with self._locked(name):
            current = self.get(name)
            if current is None:
                raise JobNotFoundError(name)
            if current.version != version:
                raise ConflictError(
                    f"job {name!r} is at version {current.version}, not {version}: it changed since it was read"
                )
            return self._write(_Document(spec=current.spec, status=status, resource_version=str(int(version) + 1)))

    def names(self) -> list[str]:
        return sorted(
            entry.name[: -len(".json")]
            for entry in os.scandir(self.root)
            if entry.is_file() and entry.name.endswith(".json") and not entry.name.startswith(".")
        )

    def delete(self, name: str) -> None:
        with self._locked(name), contextlib.suppress(FileNotFoundError):
            os.unlink(self.path(name))

    # -- helpers -------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _locked(self, name: str) -> Iterator[None]:
        fd = os.open(os.path.join(self.root, f".{name}.lock"), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # closing releases the lock

    def _write(self, document: _Document) -> StoredJob:
        name = document.spec.name
        dest = self.path(name)
        tmp = os.path.join(self.root, f".{name}.{uuid.uuid4().hex[:8]}.tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(document.model_dump_json(indent=2, exclude_none=True).encode() + b"\n")
                f.flush()
                if self._fsync:
                    os.fsync(f.fileno())
            os.replace(tmp, dest)
            if self._fsync:
                dir_fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY)
                try:
                    os.fsync(dir_fd)
                finally:
                    os.close(dir_fd)
        except OSError as e:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise StoreError(f"cannot write {dest}: {e}") from e
        log.debug("job %s: stored version %s", name, document.resource_version)
        return StoredJob(document.spec, document.status, document.resource_version)
