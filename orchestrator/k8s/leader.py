"""Leader election on a ``coordination.k8s.io/v1`` Lease, so that one replica acts at a time.

Why our own: the client's helper keeps calling the leader's work after the lease is lost. Here a
leader that loses the lease, or cannot renew it before ``renew_deadline``, calls ``on_lost`` —
which in the controller exits the process (non-zero; the Deployment restarts it). No work of an
old leader can outlive its lease, so two leaders never act at once.

What runs in order, on the elector's thread:

1. *acquire*, every ``retry_period``: read the Lease; create it if missing; take it over with a
   compare-and-swap update (the read's resourceVersion; 409 means someone else wrote first) when
   it is free (no holder) or has expired. Expiry is judged by *our* clock: a lease counts as
   expired when its record (holder, renewTime, resourceVersion) has not changed for
   ``leaseDurationSeconds`` since we first saw it — never by comparing the holder's renewTime with
   our wall clock, which may be skewed;
2. *lead*: ``on_started`` runs (the controller starts its work queue there), then every
   ``retry_period`` the lease is renewed by a compare-and-swap update of ``renewTime``;
3. *lost*: a renewal finding another holder, or no successful renewal for ``renew_deadline``,
   calls ``on_lost`` once and the elector stops.

In parallel, a watchdog thread checks the time since the last successful renewal was sent (not
answered: the server wrote it in between, and others count from that write), so a renewal
stuck in a hung request cannot keep a stale leader alive: ``renew_deadline`` < ``lease_duration``
guarantees the old leader gives up before any other replica may take over.

``release()`` (clean shutdown) clears the holder so the next replica takes over at once.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime

from orchestrator.k8s.api import LEASES, Conflict, KubeClient, KubeError, NotFound, Object

log = logging.getLogger(__name__)


def default_identity() -> str:
    """$POD_NAME in a pod (unique per replica, readable in the Lease), else hostname + a random id."""
    return os.environ.get("POD_NAME") or f"{socket.gethostname()}-{uuid.uuid4().hex[:8]}"


@dataclass(frozen=True)
class LeaseTiming:
    """Durations of the election. ``renew_deadline`` < ``lease_duration`` (checked)."""

    lease_duration: float = 15.0
    """How long a lease lasts after its last renewal before another replica may take it."""
    renew_deadline: float = 10.0
    """How long a leader keeps trying to renew before it gives up (and exits)."""
    retry_period: float = 2.0
    """How often candidates try to acquire, and leaders renew."""

    def __post_init__(self) -> None:
        if not 0 < self.retry_period < self.renew_deadline < self.lease_duration:
            raise ValueError(
                "leader election needs 0 < retry period < renew deadline < lease duration, got "
                f"{self.retry_period}, {self.renew_deadline}, {self.lease_duration}"
            )


def _now_micro() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class LeaderElector:
    """Campaigns for ``namespace/name`` as ``identity``; see the module docstring."""

    def __init__(
        self,
        client: KubeClient,
        *,
        namespace: str,
        name: str,
        identity: str,
        on_started: Callable[[], None],
        on_lost: Callable[[str], None],
        timing: LeaseTiming | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._client = client
        self._namespace = namespace
        self._name = name
        self.identity = identity
        self._on_started = on_started
        self._on_lost = on_lost
        self._timing = timing or LeaseTiming()
        self._clock = clock
        self._stop = threading.Event()
        self._leading = threading.Event()
        self._lost = threading.Event()
        self._lock = threading.Lock()
        self._last_renew = 0.0
        self._observed: tuple[str, str, str] | None = None  # (holder, renewTime, resourceVersion)
        self._observed_at = 0.0
        self._lease: Object | None = None
        self._thread: threading.Thread | None = None
        self._watchdog: threading.Thread | None = None

    @property
    def is_leader(self) -> bool:
        return self._leading.is_set() and not self._lost.is_set()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="leader-election", daemon=True)
        self._thread.start()

    def stop(self, *, release: bool = True, timeout: float = 10.0) -> None:
        """Stop campaigning; a leader releases the lease (clears the holder) unless told not to."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
        if release and self.is_leader:
            self.release()

    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # -- the loop

    def _run(self) -> None:
        t = self._timing
        log.info("campaigning for lease %s/%s as %s", self._namespace, self._name, self.identity)
        # A round's success counts from when its request was *sent*, not when the answer came: the
        # server wrote the renewTime somewhere in between, and the other replicas count the lease's
        # duration from seeing that write. Counting from the answer, a slow one (retries, a
        # congested server) let this leader outlive its lease by as long as the answer took.
        while not self._stop.is_set():
            sent = self._clock()
            if self._try_acquire_or_renew():
                break
            self._stop.wait(t.retry_period)
        if self._stop.is_set():
            return
        with self._lock:
            self._last_renew = sent
        self._leading.set()
        log.info("became the leader (lease %s/%s, %s)", self._namespace, self._name, self.identity)
        self._watchdog = threading.Thread(target=self._watch_deadline, name="leader-watchdog", daemon=True)
        self._watchdog.start()
        try:
            self._on_started()
        except Exception:
            log.exception("starting the leader's work failed")
            self._lose("the leader's work could not start")
            return
        while not self._stop.wait(t.retry_period) and not self._lost.is_set():
            sent = self._clock()
            try:
                renewed = self._try_acquire_or_renew()
            except Exception:
                log.exception("renewing the lease failed")
                renewed = False
            if renewed:
                with self._lock:
                    self._last_renew = max(self._last_renew, sent)
            elif self._lease is not None and self._holder(self._lease) != self.identity:
                self._lose(f"the lease is now held by {self._holder(self._lease)!r}")
                return

    def _watch_deadline(self) -> None:
        t = self._timing
        while not self._stop.is_set() and not self._lost.is_set():
            with self._lock:
                since = self._clock() - self._last_renew
            if since > t.renew_deadline:
                self._lose(f"no renewal for {since:.1f}s (renew deadline {t.renew_deadline:.1f}s)")
                return
            self._stop.wait(min(t.retry_period, t.renew_deadline) / 4)

    def _lose(self, why: str) -> None:
        with self._lock:
            if self._lost.is_set():
                return
            self._lost.set()
        log.error("lost leadership of lease %s/%s: %s", self._namespace, self._name, why)
        self._on_lost(why)

    # -- one compare-and-swap round

    def _try_acquire_or_renew(self) -> bool:
        """True if we hold the lease after this round (acquired or renewed)."""
        t = self._timing
        try:
            lease = self._client.get(LEASES, self._name, self._namespace)
        except NotFound:
            try:
                self._lease = self._client.create(LEASES, self._record(None), self._namespace)
            except Conflict:
                return False  # another replica created it first
            except KubeError as e:
                log.warning("cannot create lease %s/%s: %s", self._namespace, self._name, e)
                return False
            return True
        except KubeError as e:
            log.warning("cannot read lease %s/%s: %s", self._namespace, self._name, e)
            return False
        self._lease = lease
        spec = lease.get("spec") or {}
        holder = self._holder(lease)
        record = (holder, str(spec.get("renewTime") or ""), str(lease["metadata"].get("resourceVersion") or ""))
        now = self._clock()
        if record != self._observed:
            self._observed, self._observed_at = record, now
        duration = float(spec.get("leaseDurationSeconds") or t.lease_duration)
        if holder and holder != self.identity and now < self._observed_at + duration:
            return False  # held by a live leader
        try:
            self._lease = self._client.replace(LEASES, self._record(lease))
        except Conflict:
            return False
        except KubeError as e:
            log.warning("cannot update lease %s/%s: %s", self._namespace, self._name, e)
            return False
        return True

    def _record(self, current: Object | None) -> Object:
        now = _now_micro()
        spec = dict((current or {}).get("spec") or {})
        taking_over = self._holder(current) != self.identity if current is not None else True
        spec["holderIdentity"] = self.identity
        spec["leaseDurationSeconds"] = max(1, round(self._timing.lease_duration))
        spec["renewTime"] = now
        if taking_over:
            spec["acquireTime"] = now
            if current is not None:
                spec["leaseTransitions"] = int(spec.get("leaseTransitions") or 0) + 1
            else:
                spec["leaseTransitions"] = 0
        metadata: Object = {"name": self._name, "namespace": self._namespace}
        if current is not None:
            metadata = dict(current["metadata"])
        return {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": metadata, "spec": spec}

    @staticmethod
    def _holder(lease: Object | None) -> str:
        return str(((lease or {}).get("spec") or {}).get("holderIdentity") or "")

    def release(self) -> None:
        """Give the lease up (clean shutdown): the next candidate need not wait for it to expire."""
        try:
            lease = self._client.get(LEASES, self._name, self._namespace)
            if self._holder(lease) != self.identity:
                return
            spec = dict(lease.get("spec") or {})
            spec["holderIdentity"] = ""
            spec["leaseDurationSeconds"] = 1
            spec["renewTime"] = _now_micro()
            lease["spec"] = spec
            self._client.replace(LEASES, lease)
            log.info("released lease %s/%s", self._namespace, self._name)
        except KubeError as e:
            log.warning("could not release lease %s/%s (it expires on its own): %s", self._namespace, self._name, e)
        finally:
            self._leading.clear()
