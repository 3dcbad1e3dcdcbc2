"""The work queue: deduplicated, one reconcile per key at a time, delays, backoff, clean shutdown."""

from __future__ import annotations

import json
import logging
import threading
from collections import Counter

from ctl_support import wait_for

from agent.streams import JsonFormatter
from orchestrator.k8s.workqueue import ObjectKey, RetryBackoff, Workers, WorkQueue

A = ObjectKey("ns", "a")
B = ObjectKey("ns", "b")


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_burst_of_adds_for_one_key_is_handed_out_once() -> None:
    q = WorkQueue()
    for _ in range(50):
        q.add(A)
    q.add(B)
    assert q.get(timeout=0) == A
    assert q.get(timeout=0) == B
    assert q.get(timeout=0) is None


def test_a_key_added_while_processed_is_not_handed_to_another_worker_but_queued_again_after() -> None:
    q = WorkQueue()
    q.add(A)
    assert q.get(timeout=0) == A
    q.add(A)
    q.add(A)
    assert q.get(timeout=0) is None  # A is being processed: nobody else gets it
    q.done(A)
    assert q.get(timeout=0) == A  # ...and it comes back once, after
    q.done(A)
    assert q.get(timeout=0) is None


def test_a_delayed_key_is_handed_out_only_when_due_and_the_earlier_request_wins() -> None:
    clock = FakeClock()
    q = WorkQueue(clock=clock)
    q.add_after(A, 30)
    q.add_after(A, 10)
    q.add_after(A, 60)
    assert q.get(timeout=0) is None
    clock.now += 9.9
    assert q.get(timeout=0) is None
    clock.now += 0.1
    assert q.get(timeout=0) == A
    q.done(A)
    clock.now += 100
    assert q.get(timeout=0) is None  # the superseded 30 s and 60 s requests do not fire again


def test_failures_back_off_exponentially_per_key_and_success_resets_them() -> None:
    clock = FakeClock()
    q = WorkQueue(clock=clock, backoff=RetryBackoff(initial=1, maximum=8))
    delays = [q.add_rate_limited(A) for _ in range(5)]
    assert delays == [1, 2, 4, 8, 8]
    assert q.add_rate_limited(B) == 1  # per key
    q.forget(A)
    assert q.add_rate_limited(A) == 1


def test_workers_never_run_two_reconciles_of_one_key_at_once_and_coalesce_bursts() -> None:
    q = WorkQueue()
    running: Counter[ObjectKey] = Counter()
    overlap: list[ObjectKey] = []
    calls: Counter[ObjectKey] = Counter()
    lock = threading.Lock()
    release = threading.Event()
    first_started = threading.Event()

    def reconcile(key: ObjectKey) -> float | None:
        with lock:
            running[key] += 1
            calls[key] += 1
            if running[key] > 1:
                overlap.append(key)
        if key == A:
            first_started.set()
            release.wait(10)
        with lock:
            running[key] -= 1
        return None

    workers = Workers(q, reconcile, count=4)
    workers.start()
    q.add(A)
    wait_for(first_started.is_set, what="the first reconcile of A")
    for _ in range(100):  # a burst while A's first reconcile runs, on 4 workers
        q.add(A)
        q.add(B)
    wait_for(lambda: calls[B] >= 1, what="B to be reconciled meanwhile")
    release.set()
    wait_for(lambda: calls[A] == 2 and q.pending() == 0 and running[A] == 0, what="A's second reconcile")
    workers.stop()
    assert overlap == []
    assert calls[A] == 2  # the burst became exactly one more pass
    assert not workers.alive()


def test_a_reconcile_that_raises_is_retried_and_one_that_asks_is_looked_at_again() -> None:
    q = WorkQueue(backoff=RetryBackoff(initial=0.01, maximum=0.01))
    attempts: Counter[ObjectKey] = Counter()

    def reconcile(key: ObjectKey) -> float | None:
        attempts[key] += 1
        if key == A and attempts[A] < 3:
            raise RuntimeError("API down")
        if key == B and attempts[B] < 2:
            return 0.01
        return None

    errors: list[bool] = []

    class Metrics:
        def reconciled(self, seconds: float, error: bool) -> None:
            errors.append(error)

    workers = Workers(q, reconcile, count=2, metrics=Metrics())
    workers.start()
    q.add(A)
    q.add(B)
    wait_for(lambda: attempts[A] == 3 and attempts[B] == 2 and q.pending() == 0, what="retries")
    workers.stop()
    assert q.failures(A) == 0  # forgotten after the success
    assert errors.count(True) == 2


def test_shutdown_wakes_idle_workers_and_lets_a_running_reconcile_finish() -> None:
    q = WorkQueue()
    finished = threading.Event()
    started = threading.Event()

    def reconcile(key: ObjectKey) -> float | None:
        started.set()
        threading.Event().wait(0.2)
        finished.set()
        return 5.0

    workers = Workers(q, reconcile, count=3)
    workers.start()
    q.add(A)
    wait_for(started.is_set, what="a reconcile")
    workers.stop()
    assert finished.is_set()
    assert not workers.alive()
    q.add(B)
    assert q.get(timeout=0) is None  # nothing is handed out after shutdown


def test_keys_read_as_namespace_slash_name() -> None:
    assert str(ObjectKey("team-a", "llama")) == "team-a/llama"
    assert ObjectKey.parse("team-a/llama") == ObjectKey("team-a", "llama")


def test_an_urgent_key_is_reconciled_while_every_routine_worker_is_stuck_in_another_job() -> None:
    q = WorkQueue()
    release = threading.Event()
    order: list[str] = []

    def reconcile(key: ObjectKey) -> float | None:
        if key == A:
            order.append("a started")
            release.wait(60)  # A's API call hangs until the test lets it go
            order.append("a finished")
        else:
            order.append(f"{key.name} reconciled")
        return None

    workers = Workers(q, reconcile, count=1)
    workers.start()
    try:
        q.add(A)
        wait_for(lambda: order == ["a started"], what="A's reconcile to hang")
        q.add(ObjectKey("ns", "routine"))
        q.add(B, urgent=True)  # B's node got a preemption notice
        wait_for(lambda: "b reconciled" in order, what="B's urgent reconcile", timeout=30)
        assert order == ["a started", "b reconciled"]  # the routine key waits for a routine worker
    finally:
        release.set()
        wait_for(lambda: "routine reconciled" in order, what="the routine key after A")
        workers.stop()
    assert order == ["a started", "b reconciled", "a finished", "routine reconciled"]


def test_the_urgent_worker_takes_only_keys_added_urgent() -> None:
    q = WorkQueue()
    q.add(A)
    assert q.get(timeout=0, urgent_only=True) is None
    q.add(B, urgent=True)
    assert q.get(timeout=0, urgent_only=True) == B
    assert q.get(timeout=0, urgent_only=True) is None
    q.add(A, urgent=True)  # a waiting routine key made urgent moves to the front, for either worker
    assert q.get(timeout=0, urgent_only=True) == A
    q.done(B)
    q.add(B)
    q.add(B, urgent=True)
    assert q.get(timeout=0, urgent_only=True) == B


def test_json_log_lines_of_a_reconcile_pass_name_its_job_in_a_field_and_no_other_line_does() -> None:
    """A log pipeline indexes the controller's lines by job: those a pass writes (its failure's
    traceback too) carry ``job``: ``namespace/name``; the worker's own lines between passes do not."""
    lines: list[dict[str, object]] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(json.loads(self.format(record)))

    handler = Collect()
    handler.setFormatter(JsonFormatter({"command": "spotjob-controller"}))
    logger = logging.getLogger("orchestrator")
    logger.addHandler(handler)
    old_level = logger.level
    logger.setLevel(logging.INFO)
    q = WorkQueue(backoff=RetryBackoff(initial=0.01, maximum=0.01))
    seen: Counter[ObjectKey] = Counter()

    def reconcile(key: ObjectKey) -> float | None:
        seen[key] += 1
        logging.getLogger("orchestrator.reconciler").info("pass %d of %s", seen[key], key)
        if key == A and seen[A] == 1:
            raise RuntimeError("API down")
        return None

    workers = Workers(q, reconcile, count=2)
    try:
        workers.start()
        q.add(A)
        q.add(B)
        wait_for(lambda: seen[A] == 2 and seen[B] == 1 and q.pending() == 0, what="the passes")
        workers.stop()
        logging.getLogger("orchestrator.k8s").info("between passes")
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)
    by_message = {str(line["message"]): line for line in lines}
    assert by_message["pass 1 of ns/a"]["job"] == "ns/a" and by_message["pass 2 of ns/a"]["job"] == "ns/a"
    assert by_message["pass 1 of ns/b"]["job"] == "ns/b"
    (failed,) = [line for line in lines if str(line["message"]).startswith("reconcile ns/a failed")]
    assert failed["job"] == "ns/a" and "RuntimeError: API down" in str(failed["exception"])
    assert "job" not in by_message["between passes"] and by_message["between passes"]["command"] == "spotjob-controller"
