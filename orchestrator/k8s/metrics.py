"""The controller's Prometheus metrics, behind methods that say what happened.

The reconciler and the Kubernetes backend record through ``ControllerMetrics`` (or anything with
the same methods, ``orchestrator.events.JobMetrics``); they never import prometheus_client. Every
family lives in the instance's own registry (not the process-global one), so two controllers in
one test process do not collide. Families (all prefixed ``spotjob_``):

- ``signals_total{kind,source}``                   preemption signals seen, by kind and source
- ``flush_requests_total{outcome}``                flush requests sent to agents: accepted, failed
- ``notice_to_commit_seconds``                     histogram: from a notice to the flushed manifest
- ``preemptions_total``, ``restarts_total{cause}``  preemptions handled; gang restarts (preemption, failure,
                                                   infrastructure, capacity, requested)
- ``lost_steps_total``                             training steps redone after restarts
- ``job_goodput_ratio{namespace,name}``            per job; removed when the job is deleted
- ``reconcile_errors_total``, ``reconcile_duration_seconds``
- ``workqueue_depth``                              keys ready to reconcile
- ``api_retries_total{verb,resource,reason}``      API requests retried (5xx, 429, network)
- ``leader``                                       1 while this replica leads
- ``interruption_messages_total{kind,outcome}``    interruption-queue messages, by what became of
                                                   them (annotated, duplicate, unknown_node,
                                                   ignored, cleared, unparsable, retry)
- ``interruption_queue_errors_total``              failed receives or deletes on the queue
- ``checkpoint_hint_patches_total{outcome}``       pod annotation patches of the checkpoint hints

README.md, "Events and metrics", documents each family; a test keeps the two equal.
"""

from __future__ import annotations

import threading

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from orchestrator.events import JobMetrics

__all__ = ["CONTENT_TYPE_LATEST", "ControllerMetrics", "JobMetrics"]


class ControllerMetrics:
    """Every spotjob metric, in one registry. Thread-safe (prometheus_client is)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self._signals = Counter(
            "spotjob_signals", "Preemption signals seen, by kind and source.", ["kind", "source"], registry=r
        )
        self._flushes = Counter(
            "spotjob_flush_requests", "Flush requests sent to agents, by outcome.", ["outcome"], registry=r
        )
        self._notice_to_commit = Histogram(
            "spotjob_notice_to_commit_seconds",
            "Seconds from a preemption notice to the committed flush manifest.",
            buckets=(1, 2.5, 5, 10, 15, 20, 30, 45, 60, 90, 120, 180, 300, 450, 600, 900, 1800),
            registry=r,
        )
        self._preemptions = Counter("spotjob_preemptions", "Preemptions handled.", registry=r)
        self._restarts = Counter(
            "spotjob_restarts",
            "Gang restarts, by cause (preemption, failure, infrastructure, capacity, requested).",
            ["cause"],
            registry=r,
        )
        self._lost_steps = Counter("spotjob_lost_steps", "Training steps redone after restarts.", registry=r)
        self._goodput = Gauge(
            "spotjob_job_goodput_ratio",
            "Share of the job's wall time spent on steps that were kept.",
            ["namespace", "name"],
            registry=r,
        )
        self._reconcile_errors = Counter("spotjob_reconcile_errors", "Reconcile passes that raised.", registry=r)
        self._reconcile_seconds = Histogram(
            "spotjob_reconcile_duration_seconds",
            "Duration of one reconcile pass.",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
            registry=r,
        )
        self._depth = Gauge("spotjob_workqueue_depth", "Keys ready to reconcile.", registry=r)
        self._api_retries = Counter(
            "spotjob_api_retries",
            "Kubernetes API requests retried, by verb, resource and reason (HTTP code or network).",
            ["verb", "resource", "reason"],
            registry=r,
        )
        self._leader = Gauge("spotjob_leader", "1 while this replica is the leader.", registry=r)
        self._queue_messages = Counter(
            "spotjob_interruption_messages",
            "Interruption-queue messages, by kind and by what became of them.",
            ["kind", "outcome"],
            registry=r,
        )
        self._queue_errors = Counter(
            "spotjob_interruption_queue_errors", "Failed receives or deletes on the interruption queue.", registry=r
        )
        self._hint_patches = Counter(
            "spotjob_checkpoint_hint_patches",
            "Patches of the pods' checkpoint-hint annotations, by outcome (ok, failed).",
            ["outcome"],
            registry=r,
        )
        self._jobs_lock = threading.Lock()
        self._jobs: set[tuple[str, str]] = set()

    # -- JobMetrics

    def signal(self, kind: str, source: str) -> None:
        self._signals.labels(kind=kind, source=source).inc()

    def flush_request(self, outcome: str) -> None:
        self._flushes.labels(outcome=outcome).inc()

    def notice_to_commit(self, seconds: float) -> None:
        self._notice_to_commit.observe(max(0.0, seconds))

    def preemption(self) -> None:
        self._preemptions.inc()

    def restart(self, cause: str) -> None:
        self._restarts.labels(cause=cause).inc()

    def lost_steps(self, steps: int) -> None:
        if steps > 0:
            self._lost_steps.inc(steps)

    def goodput(self, namespace: str, name: str, ratio: float) -> None:
        with self._jobs_lock:
            self._jobs.add((namespace, name))
        self._goodput.labels(namespace=namespace, name=name).set(ratio)

    def job_deleted(self, namespace: str, name: str) -> None:
        with self._jobs_lock:
            known = (namespace, name) in self._jobs
            self._jobs.discard((namespace, name))
        if known:
            self._goodput.remove(namespace, name)

    # -- the machinery's own

    def reconciled(self, seconds: float, error: bool) -> None:
        self._reconcile_seconds.observe(seconds)
        if error:
            self._reconcile_errors.inc()

    def queue_depth(self, depth: int) -> None:
        self._depth.set(depth)

    def api_retry(self, verb: str, resource: str, reason: str) -> None:
        self._api_retries.labels(verb=verb, resource=resource, reason=reason).inc()

    def leader(self, leading: bool) -> None:
        self._leader.set(1 if leading else 0)

    def interruption_message(self, kind: str, outcome: str) -> None:
        self._queue_messages.labels(kind=kind, outcome=outcome).inc()

    def interruption_queue_error(self) -> None:
        self._queue_errors.inc()

    def checkpoint_hint_patch(self, outcome: str) -> None:
        self._hint_patches.labels(outcome=outcome).inc()

    def exposition(self) -> bytes:
        """The text format served at /metrics."""
        return generate_latest(self.registry)
