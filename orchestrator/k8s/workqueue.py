"""The work queue: keys (namespace/name) to reconcile, one reconcile per key at a time.

Modelled on client-go's workqueue, which every Kubernetes controller relies on for these rules:

- *Deduplicated*: a key added while it waits is queued once; a burst of events for one job
  becomes one reconcile.
- *One at a time per key*: a key added while a worker processes it is not handed to another
  worker; it is queued again when the first reconcile finishes (so the change is not lost, and two
  reconciles of one job never run at once).
- *Delays*: ``add_after(key, s)`` hands the key out no earlier than ``s`` seconds from now (the
  reconciler's "look again in N s"); an earlier request for the same key wins.
- *Backoff*: a reconcile that raised is retried after a per-key exponential delay, reset when
  the key next succeeds.
- *Urgent keys first*: ``add(key, urgent=True)`` puts the key at the front of the queue (or
  moves it there), and one being processed goes to the front when it is done. The controller
  marks a job urgent when a new preemption notice for one of its nodes or pods appears: its
  flush request must not wait behind the routine passes of a hundred other jobs in a burst.
  Nor behind jobs whose API calls hang: ``Workers`` keeps a thread of its own for urgent keys
  (``get(urgent_only=True)``), so a flush starts even while every routine worker is stuck in
  another job's call (each bounded by the client's deadline, ``api.RetryPolicy.deadline``).

In parallel: any number of producers (informer handlers) call ``add``; ``Workers`` runs a bounded
number of threads that take keys and call the reconcile function. ``shut_down()`` wakes them all;
each finishes the reconcile it is in and exits.
"""

from __future__ import annotations

import heapq
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple, Protocol

from agent.streams import log_fields

log = logging.getLogger(__name__)


class ObjectKey(NamedTuple):
    """A namespaced object's identity; ``str()`` is ``namespace/name``."""

    namespace: str
    name: str

    def __str__(self) -> str:
        return f"{self.namespace}/{self.name}" if self.namespace else self.name

    @classmethod
    def parse(cls, text: str) -> ObjectKey:
        namespace, _, name = text.rpartition("/")
        if not name:
            raise ValueError(f"{text!r} is not a namespace/name key")
        return cls(namespace, name)


Reconcile = Callable[[ObjectKey], "float | None"]
"""The reconcile seam: one pass for one key. Returns seconds until it wants to look again (None:
only when something changes); raises to be retried with backoff. Never called concurrently for
one key."""


class QueueMetrics(Protocol):
    def reconciled(self, seconds: float, error: bool) -> None: ...


@dataclass(frozen=True)
class RetryBackoff:
    """Per-key delays after failed reconciles: doubling from ``initial`` up to ``maximum``."""

    initial: float = 0.5
    maximum: float = 300.0

    def delay(self, failures: int) -> float:
        return min(self.maximum, self.initial * 2 ** max(0, failures - 1))


class WorkQueue:
    """Thread-safe, deduplicated, per-key exclusive queue with delays. See the module docstring."""

    def __init__(
        self,
        *,
        backoff: RetryBackoff | None = None,
        clock: Callable[[], float] = time.monotonic,
        on_depth: Callable[[int], None] | None = None,
    ) -> None:
        self._cond = threading.Condition()
        self._queue: deque[ObjectKey] = deque()
        self._dirty: set[ObjectKey] = set()  # waiting to be handed out (in _queue, or back after processing)
        self._processing: set[ObjectKey] = set()
        self._urgent: set[ObjectKey] = set()  # processing now, to the front of the queue when done
        self._urgent_waiting: set[ObjectKey] = set()  # in _queue, put at its front as urgent (a prefix of it)
        self._delayed: list[tuple[float, int, ObjectKey]] = []  # heap of (ready at, seq, key)
        self._ready_at: dict[ObjectKey, float] = {}
        self._seq = 0
        self._failures: dict[ObjectKey, int] = {}
        self._backoff = backoff or RetryBackoff()
        self._clock = clock
        self._on_depth = on_depth
        self._shutting_down = False

    # -- producers

    def add(self, key: ObjectKey, *, urgent: bool = False) -> None:
        """Queue ``key`` (once); ``urgent``: at the front, ahead of the keys already waiting."""
        with self._cond:
            self._add_locked(key, urgent=urgent)

    def add_after(self, key: ObjectKey, delay: float) -> None:
        if delay <= 0:
            self.add(key)
            return
        with self._cond:
            if self._shutting_down:
                return
            at = self._clock() + delay
            current = self._ready_at.get(key)
            if current is not None and current <= at:
                return  # an earlier look is already due
            self._ready_at[key] = at
            self._seq += 1
            heapq.heappush(self._delayed, (at, self._seq, key))
            self._cond.notify_all()

    def add_rate_limited(self, key: ObjectKey) -> float:
        """Queue ``key`` after its next backoff delay; returns that delay."""
        with self._cond:
            failures = self._failures.get(key, 0) + 1
            self._failures[key] = failures
        delay = self._backoff.delay(failures)
        self.add_after(key, delay)
        return delay

    def forget(self, key: ObjectKey) -> None:
        """The key succeeded: its next failure starts the backoff from the beginning."""
        with self._cond:
            self._failures.pop(key, None)

    def failures(self, key: ObjectKey) -> int:
        with self._cond:
            return self._failures.get(key, 0)

    # -- consumers

    def get(self, timeout: float | None = None, *, urgent_only: bool = False) -> ObjectKey | None:
        """The next key to process (now marked processing), or None on shutdown or timeout.
        ``urgent_only``: only a key added urgent (the urgent worker's call)."""
        end = None if timeout is None else self._clock() + timeout
        with self._cond:
            while True:
                self._promote_due()
                if self._queue and (not urgent_only or self._queue[0] in self._urgent_waiting):
                    key = self._queue.popleft()
                    self._urgent_waiting.discard(key)
                    self._dirty.discard(key)
                    self._processing.add(key)
                    self._report_depth()
                    return key
                if self._shutting_down:
                    return None
                wait = self._next_due_in()
                if end is not None:
                    left = end - self._clock()
                    if left <= 0:
                        return None
                    wait = left if wait is None else min(wait, left)
                self._cond.wait(wait)

    def done(self, key: ObjectKey) -> None:
        """Processing of ``key`` finished; if it was added meanwhile, it is queued again now."""
        with self._cond:
            self._processing.discard(key)
            urgent = key in self._urgent
            self._urgent.discard(key)
            if key in self._dirty and not self._shutting_down:
                if urgent:
                    self._queue.appendleft(key)
                    self._urgent_waiting.add(key)
                else:
                    self._queue.append(key)
                self._report_depth()
                self._cond.notify_all()  # the waiters differ (urgent-only or not): wake them all

    def shut_down(self) -> None:
        with self._cond:
            self._shutting_down = True
            self._cond.notify_all()

    @property
    def shutting_down(self) -> bool:
        with self._cond:
            return self._shutting_down

    def __len__(self) -> int:
        """Keys ready now (not counting delayed ones or those being processed)."""
        with self._cond:
            return len(self._queue)

    def pending(self) -> int:
        """Keys ready or delayed."""
        with self._cond:
            return len(self._queue) + len(self._ready_at)

    # -- internals (lock held)

    def _add_locked(self, key: ObjectKey, *, urgent: bool = False) -> None:
        if self._shutting_down:
            return
        if key in self._dirty:
            if urgent:
                if key in self._processing:
                    self._urgent.add(key)
                elif key in self._queue:
                    self._queue.remove(key)  # O(queue), and only for a notice's first sight
                    self._queue.appendleft(key)
                    self._urgent_waiting.add(key)
                    self._cond.notify_all()
            return
        self._dirty.add(key)
        if key in self._processing:
            if urgent:
                self._urgent.add(key)
            return  # done() queues it again
        if urgent:
            self._queue.appendleft(key)
            self._urgent_waiting.add(key)
        else:
            self._queue.append(key)
        self._report_depth()
        self._cond.notify_all()  # the waiters differ (urgent-only or not): wake them all

    def _promote_due(self) -> None:
        now = self._clock()
        while self._delayed and self._delayed[0][0] <= now:
            at, _, key = heapq.heappop(self._delayed)
            if self._ready_at.get(key) != at:
                continue  # superseded by an earlier request
            del self._ready_at[key]
            self._add_locked(key)

    def _next_due_in(self) -> float | None:
        while self._delayed and self._ready_at.get(self._delayed[0][2]) != self._delayed[0][0]:
            heapq.heappop(self._delayed)
        if not self._delayed:
            return None
        return max(0.0, self._delayed[0][0] - self._clock())

    def _report_depth(self) -> None:
        if self._on_depth is not None:
            self._on_depth(len(self._queue))


class Workers:
    """``count`` threads that take keys from ``queue`` and reconcile them, and ``urgent`` more that
    take only the keys added urgent (a preemption notice's flush): however long other jobs' calls
    hold the ``count`` threads, an urgent key finds one free unless urgent work fills it.

    A reconcile that returns a delay is queued after it; one that raises is retried with the
    key's backoff (and counted as an error); one that returns None is forgotten until an event
    adds it again.
    """

    def __init__(
        self,
        queue: WorkQueue,
        reconcile: Reconcile,
        *,
        count: int = 4,
        urgent: int = 1,
        metrics: QueueMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if count < 1:
            raise ValueError("at least one worker is needed")
        if urgent < 0:
            raise ValueError(f"the number of urgent workers cannot be negative ({urgent})")
        self._queue = queue
        self._reconcile = reconcile
        self._count = count
        self._urgent_count = urgent
        self._metrics = metrics
        self._clock = clock
        self._threads: list[threading.Thread] = []

    def start(self) -> None:
        lanes = [(f"reconcile-{i}", False) for i in range(self._count)]
        lanes += [(f"reconcile-urgent-{i}", True) for i in range(self._urgent_count)]
        for name, urgent_only in lanes:
            thread = threading.Thread(target=self._run, args=(urgent_only,), name=name, daemon=True)
            self._threads.append(thread)
            thread.start()

    def stop(self, timeout: float = 30.0) -> bool:
        """Shut the queue down and wait for the workers to finish their current reconcile; False
        if one still runs after ``timeout`` (each thread's wait)."""
        self._queue.shut_down()
        for thread in self._threads:
            thread.join(timeout)
        return not any(t.is_alive() for t in self._threads)

    def alive(self) -> bool:
        return bool(self._threads) and all(t.is_alive() for t in self._threads)

    def _run(self, urgent_only: bool = False) -> None:
        while True:
            key = self._queue.get(urgent_only=urgent_only)
            if key is None:
                return
            try:
                self.process(key)
            finally:
                self._queue.done(key)

    def process(self, key: ObjectKey) -> None:
        started = self._clock()
        error = False
        try:
            with log_fields(job=str(key)):  # the pass's JSON log lines name the job in a field of their own
                requeue = self._reconcile(key)
        except Exception:
            error = True
            delay = self._queue.add_rate_limited(key)
            with log_fields(job=str(key)):
                log.exception("reconcile %s failed; retrying in %.1fs", key, delay)
        else:
            self._queue.forget(key)
            if requeue is not None:
                self._queue.add_after(key, max(0.0, requeue))
        finally:
            if self._metrics is not None:
                self._metrics.reconciled(self._clock() - started, error)
