"""The controller's Prometheus metrics, behind methods that say what happened.

The reconciler and the Kubernetes backend record through ``ControllerMetrics`` (or anything with
the same methods, ``orchestrator.events.JobMetrics``); they never import prometheus_client. Every
family lives in the instance's own registry (not the process-global one), so two controllers in
one test process do not collide. Families (all prefixed ``spotjob_``):

- ``signals_total{kind,source}``                   preemption signals seen, by kind and source
                                                   (``SIGNAL_SOURCES``, any other ``other``)
- ``flush_requests_total{outcome}``                flush requests sent to agents: accepted, failed
- ``notice_to_commit_seconds``                     histogram: from a notice to the flushed manifest
- ``preemptions_total``, ``restarts_total{cause}``  preemptions handled; gang restarts (preemption, failure,
                                                   infrastructure, capacity, requested)
- ``lost_steps_total``                             training steps redone after restarts
- ``job_goodput_ratio{namespace,name}``            per job; removed when the job is deleted
- ``job_phase{namespace,name,phase}``              per job: 1 for its phase, 0 for the five others
- ``job_last_checkpoint_timestamp_seconds``, ``job_last_checkpoint_step``, ``job_start_timestamp_seconds``,
  ``job_attempt_running_timestamp_seconds``, ``job_restarts``, ``job_max_restarts``
  (``{namespace,name}``): the job's status, at each pass
- ``job_flushes_total{namespace,name,outcome}``    flushes ended: committed, workers_exited, timed_out
- ``job_agent_flush_failures_total{namespace,name}`` agents that exited 76 during a flush
- ``reconcile_errors_total``, ``reconcile_duration_seconds``
- ``workqueue_depth``                              keys ready to reconcile
- ``api_retries_total{verb,resource,reason}``      API requests retried (5xx, 429, network)
- ``leader``                                       1 while this replica leads
- ``interruption_messages_total{kind,outcome}``    interruption-queue messages, by what became of
                                                   them (annotated, duplicate, unknown_node,
                                                   ignored, cleared, unparsable, retry)
- ``interruption_queue_errors_total``              failed receives or deletes on the queue
- ``checkpoint_hint_patches_total{outcome}``       pod annotation patches of the checkpoint hints

Every per-job series (``{namespace,name}``) is removed when the job is deleted, and all of them when
this replica stops leading (a follower exports none: two replicas never page twice for one job).

README.md, "Events and metrics", documents each family; a test keeps the two equal.
"""

from __future__ import annotations

import threading
from datetime import datetime

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from orchestrator.events import FLUSH_OUTCOMES, JobMetrics
from orchestrator.k8s.cluster_signals import SOURCE_NODE, SOURCE_POD, SOURCE_QUEUE
from orchestrator.model import JobStatus, Phase

__all__ = ["CONTENT_TYPE_LATEST", "SIGNAL_SOURCES", "ControllerMetrics", "JobMetrics", "signal_source_label"]

SIGNAL_SOURCES = (SOURCE_NODE, SOURCE_POD, SOURCE_QUEUE)
"""The ``source`` label values of ``spotjob_signals_total`` (each alone, or several joined)."""
OTHER_SOURCE = "other"


def signal_source_label(source: str) -> str:
    """``source`` as ``spotjob_signals_total`` labels it: each of its comma-joined sources that is
    not one of ``SIGNAL_SOURCES`` becomes ``other``, sorted and once each. A Node's
    ``spotjob.dev/interruption`` annotation names its own source, in any text whoever wrote it
    chose: a label taken from it as it stands was a new series per text, without bound."""
    names = {name if name in SIGNAL_SOURCES else OTHER_SOURCE for name in source.split(",")}
    return ",".join(sorted(names))


FLUSH_REQUEST_OUTCOMES = ("accepted", "failed")
"""The ``outcome`` of ``spotjob_flush_requests_total``: an agent's answer (``FlushRequestOutcome``
less ``pending``, which is no answer)."""


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
        # Exported at 0 from the start: an alert's increase() needs a sample before the first
        # failure, or the first failures (after each controller start, too) never count.
        for outcome in FLUSH_REQUEST_OUTCOMES:
            self._flushes.labels(outcome=outcome)
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
        for outcome in ("ok", "failed"):
            self._hint_patches.labels(outcome=outcome)
        job = ["namespace", "name"]
        self._phase = Gauge(
            "spotjob_job_phase", "1 for the job's phase, 0 for the others.", [*job, "phase"], registry=r
        )
        self._checkpoint_time = Gauge(
            "spotjob_job_last_checkpoint_timestamp_seconds",
            "When the job's newest valid checkpoint was committed (its manifest's time), Unix seconds.",
            job,
            registry=r,
        )
        self._checkpoint_step = Gauge(
            "spotjob_job_last_checkpoint_step", "The step the job's newest valid checkpoint holds.", job, registry=r
        )
        self._start_time = Gauge(
            "spotjob_job_start_timestamp_seconds",
            "When every worker of the job first ran (status.startTime), Unix seconds.",
            job,
            registry=r,
        )
        self._running_time = Gauge(
            "spotjob_job_attempt_running_timestamp_seconds",
            "When every worker of the job's current attempt first ran (status.attempt.runningAt), Unix seconds.",
            job,
            registry=r,
        )
        self._job_restarts = Gauge(
            "spotjob_job_restarts", "Restarts after failures of the user's code (status.restarts).", job, registry=r
        )
        self._max_restarts = Gauge("spotjob_job_max_restarts", "The job's spec.maxRestarts.", job, registry=r)
        self._job_flushes = Counter(
            "spotjob_job_flushes",
            "The job's flushes, by how they ended (committed, workers_exited, timed_out).",
            [*job, "outcome"],
            registry=r,
        )
        self._agent_flush_failures = Counter(
            "spotjob_job_agent_flush_failures",
            "The job's agents that exited 76 during a flush (their flush committed nothing).",
            job,
            registry=r,
        )
        self._per_job = (
            self._goodput,
            self._checkpoint_time,
            self._checkpoint_step,
            self._start_time,
            self._running_time,
            self._job_restarts,
            self._max_restarts,
            self._agent_flush_failures,
        )
        self._jobs_lock = threading.Lock()
        self._jobs: set[tuple[str, str]] = set()

    # -- JobMetrics

    def signal(self, kind: str, source: str) -> None:
        self._signals.labels(kind=kind, source=signal_source_label(source)).inc()

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
            self._seen(namespace, name)
            self._goodput.labels(namespace=namespace, name=name).set(ratio)

    def job_state(self, namespace: str, name: str, status: JobStatus, max_restarts: int | None) -> None:
        with self._jobs_lock:
            self._seen(namespace, name)
            # The new phase's 1 before the others' 0: a scrape (which takes no lock of ours) between
            # the two writes sees the job in two phases, never in none, which would start the `for:`
            # clock of an alert over several phases (SpotJobNotRunning) again.
            self._phase.labels(namespace, name, status.phase.value).set(1)
            for phase in Phase:
                if phase is not status.phase:
                    self._phase.labels(namespace, name, phase.value).set(0)
            checkpoint = status.last_checkpoint
            self._set(self._checkpoint_time, namespace, name, None if checkpoint is None else checkpoint.time)
            self._set(self._checkpoint_step, namespace, name, None if checkpoint is None else checkpoint.step)
            self._set(self._start_time, namespace, name, status.start_time)
            self._set(self._running_time, namespace, name, status.attempt.running_at)
            self._job_restarts.labels(namespace, name).set(status.restarts)
            self._set(self._max_restarts, namespace, name, max_restarts)
            if status.goodput is not None:
                self._goodput.labels(namespace, name).set(status.goodput)

    def flush_ended(self, namespace: str, name: str, outcome: str, agents_failed: int) -> None:
        with self._jobs_lock:
            self._seen(namespace, name)
            self._job_flushes.labels(namespace, name, outcome).inc()
            if agents_failed > 0:
                self._agent_flush_failures.labels(namespace, name).inc(agents_failed)

    def job_deleted(self, namespace: str, name: str) -> None:
        with self._jobs_lock:
            if (namespace, name) in self._jobs:
                self._jobs.discard((namespace, name))
                self._remove(namespace, name)

    def forget_jobs(self) -> None:
        """Remove every job's series (this replica no longer leads: what it knew goes stale)."""
        with self._jobs_lock:
            for namespace, name in self._jobs:
                self._remove(namespace, name)
            self._jobs.clear()

    def _seen(self, namespace: str, name: str) -> None:
        """Under the lock: a job's counters start at 0 the first time it is seen, so that
        ``increase()`` counts its first flush (a series born at 1 shows no increase)."""
        if (namespace, name) in self._jobs:
            return
        self._jobs.add((namespace, name))
        for outcome in FLUSH_OUTCOMES:
            self._job_flushes.labels(namespace, name, outcome)
        self._agent_flush_failures.labels(namespace, name)

    def _remove(self, namespace: str, name: str) -> None:
        for family in self._per_job:
            family.remove(namespace, name)
        for phase in Phase:
            self._phase.remove(namespace, name, phase.value)
        for outcome in FLUSH_OUTCOMES:
            self._job_flushes.remove(namespace, name, outcome)

    @staticmethod
    def _set(gauge: Gauge, namespace: str, name: str, value: float | datetime | None) -> None:
        if value is None:
            gauge.remove(namespace, name)
        else:
            gauge.labels(namespace, name).set(value.timestamp() if isinstance(value, datetime) else value)

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
