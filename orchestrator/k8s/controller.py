"""The controller process: informers, work queue, leader election, Events, health and metrics, wired.

In order, on the main thread (``Controller.run``):

1. the HTTP server starts (/healthz answers at once; /readyz fails until step 2 is done);
2. the informers (SpotJobs, the workers' Pods, Nodes) start and sync their caches;
3. leader election starts; non-leaders stay here, ready but idle, their caches warm;
4. on becoming the leader: every cached SpotJob is queued and the workers start reconciling; with
   ``--interruption-queue-url``, the leader alone starts reading the queue
   (``orchestrator.k8s.interruption_queue``: a message becomes an annotation on its Node, whose
   update queues the jobs on that node like any Node event);
5. on SIGTERM: the workers finish the reconcile they are in, the queue reader stops, the lease is
   released, the informers and the server stop, and the process exits 0. A leader that loses its
   lease exits at once with ``EXIT_LEADERSHIP_LOST`` instead (no reconcile of a deposed leader may
   run on, nor any read of the queue).

In parallel: one thread per informer (and namespace), ``--workers`` reconcile threads, the leader
elector and its watchdog, the HTTP server's threads. Informer handlers only map events to job keys
and queue them: a SpotJob event queues that job (except the echo of this process's own status
write, ``OwnStatusWrites``: the pass that wrote it chose when to look again); a worker Pod event
queues the job named by its ``spotjob.dev/job`` label; a Node event queues every job with a
worker on that node (via the Pod cache's node index) — only when the update changed what a reconcile reads (taints, the
interruption notice, Ready, labels), and ahead of every other key when a notice first appears
(``WorkQueue.add(urgent=True)``) — and a Node deletion is remembered by the node-loss tracker.

The reconcile seam: ``ReconcileFactory`` builds the per-key reconcile function from a
``ControllerContext`` (client, caches, Events, metrics, signals, options), before the informers
start (so it may add informer handlers). ``orchestrator.k8s.wiring.spotjob_reconcile`` is the real
one; this module knows nothing of what a reconcile does.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from agent.torchrun import Launcher
from orchestrator.k8s.api import NODES, PODS, SPOTJOBS, KubeClient, Object, object_key
from orchestrator.k8s.cluster_signals import (
    NOTICE_INDEX,
    ClusterSignals,
    RebalancePolicy,
    new_node_notice,
    new_pod_notice,
    node_change_matters,
    notice_index,
)
from orchestrator.k8s.events import EventRecorder
from orchestrator.k8s.health import HealthServer
from orchestrator.k8s.informer import EventHandler, Informer
from orchestrator.k8s.interruption_queue import INSTANCE_INDEX, InterruptionQueueReader, Queue, SqsQueue, instance_id
from orchestrator.k8s.leader import LeaderElector, LeaseTiming
from orchestrator.k8s.metrics import ControllerMetrics
from orchestrator.k8s.pods import JOB_LABEL
from orchestrator.k8s.workqueue import ObjectKey, Reconcile, Workers, WorkQueue

log = logging.getLogger(__name__)

__all__ = ["JOB_LABEL", "Controller", "ControllerContext", "ControllerOptions", "ReconcileFactory"]

EXIT_LEADERSHIP_LOST = 3
"""Exit status of a replica that lost (or could not renew) its lease; the Deployment restarts it."""


@dataclass(frozen=True)
class ControllerOptions:
    """What ``spotjob-controller``'s flags set (see ``orchestrator.k8s.main``)."""

    namespaces: tuple[str, ...] = ()
    """Namespaces to serve; empty: all."""
    leader_elect: bool = True
    lease_name: str = "spotjob-controller"
    lease_namespace: str = ""
    identity: str = ""
    lease_timing: LeaseTiming = field(default_factory=LeaseTiming)
    http_port: int = 8080
    agent_port: int = 8470
    network_policy: bool = True
    controller_namespace: str = ""
    """The namespace the controller's pods run in (the per-job NetworkPolicies admit them from it)."""
    controller_pod_labels: tuple[tuple[str, str], ...] = ()
    """Labels of the controller's pods (``--controller-pod-labels``), for the NetworkPolicies."""
    agent_token_key_file: str | None = None
    """The key the agents' tokens are derived from (``--agent-token-key-file``); None: a random one."""
    interruption_queue_url: str | None = None
    aws_region: str | None = None
    rebalance: RebalancePolicy = RebalancePolicy.IGNORE
    node_lost_grace_seconds: float = 60.0
    workers: int = 4
    sync_timeout_seconds: float = 300.0
    shutdown_wait_seconds: float = 30.0
    """How long a shutdown waits for each reconcile in progress; one still running after it keeps
    the Lease from being released (it expires on its own)."""
    agent_launcher: Launcher = "direct"
    """How the worker pods' agents start the ranks (``spotjob-agent --launcher``): direct or torchrun."""


class OwnStatusWrites:
    """The status each SpotJob was last given by this process (``KubeJobStore`` records it before
    the write goes out). The watch event a status write brings back is no news to the reconcile
    that wrote it: queueing the job for it would run the next pass at once, whatever delay the pass
    asked for — a job failing every pass (a pod the namespace refuses, storage down) writes a new
    failure count each time, and its retry backoff became a loop of passes as fast as the API
    server answers. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._status: dict[tuple[str, str], object] = {}

    def writing(self, namespace: str, name: str, status: object) -> None:
        with self._lock:
            self._status[(namespace, name)] = status

    def is_own(self, obj: Object) -> bool:
        """The object's status is the one this process last wrote for it."""
        with self._lock:
            written = self._status.get(object_key(obj))
        return written is not None and written == obj.get("status")

    def forget(self, namespace: str, name: str) -> None:
        with self._lock:
            self._status.pop((namespace, name), None)


def only_status_changed(old: Object, new: Object) -> bool:
    """Nothing but the status (and the bookkeeping every write changes) differs."""

    def rest(obj: Object) -> Object:
        meta = {k: v for k, v in (obj.get("metadata") or {}).items() if k not in ("resourceVersion", "managedFields")}
        return {**{k: v for k, v in obj.items() if k != "status"}, "metadata": meta}

    return rest(old) == rest(new)


@dataclass
class ControllerContext:
    """Everything a reconcile (and the Kubernetes backend) may use. Built once per process."""

    client: KubeClient
    jobs: Informer
    pods: Informer
    nodes: Informer
    events: EventRecorder
    metrics: ControllerMetrics
    signals: ClusterSignals
    queue: WorkQueue
    options: ControllerOptions
    status_writes: OwnStatusWrites = field(default_factory=OwnStatusWrites)
    """Recorded by the job store, read by the SpotJob handler: a job is not queued for its own status write."""


ReconcileFactory = Callable[[ControllerContext], Reconcile]


def _pod_job(pod: Object) -> list[str]:
    ns, _ = object_key(pod)
    job = ((pod.get("metadata") or {}).get("labels") or {}).get(JOB_LABEL)
    return [f"{ns}/{job}"] if job else []


def _pod_node(pod: Object) -> list[str]:
    node = (pod.get("spec") or {}).get("nodeName")
    return [str(node)] if node else []


def _exit_process(why: str) -> None:
    for handler in logging.getLogger().handlers:
        handler.flush()
    os._exit(EXIT_LEADERSHIP_LOST)


class Controller:
    """One replica of the controller. ``run()`` blocks until ``stop()`` (or a signal handler calls it)."""

    def __init__(
        self,
        client: KubeClient,
        options: ControllerOptions,
        reconcile_factory: ReconcileFactory,
        *,
        metrics: ControllerMetrics | None = None,
        on_leadership_lost: Callable[[str], None] = _exit_process,
        interruption_queue: Queue | None = None,
    ) -> None:
        """``interruption_queue`` replaces the SQS queue ``options.interruption_queue_url`` names
        (tests); without either, no queue is read."""
        self.options = options
        self.client = client
        self.metrics = metrics or ControllerMetrics()
        self._stop = threading.Event()
        self._on_lost = on_leadership_lost
        namespaces: Sequence[str] | None = options.namespaces or None
        self.jobs = Informer(client, SPOTJOBS, namespaces=namespaces)
        self.pods = Informer(
            client, PODS, namespaces=namespaces, label_selector=JOB_LABEL, indexers={"job": _pod_job, "node": _pod_node}
        )
        self.nodes = Informer(client, NODES, indexers={INSTANCE_INDEX: instance_id, NOTICE_INDEX: notice_index})
        self.queue = WorkQueue(on_depth=self.metrics.queue_depth)
        self.signals = ClusterSignals(
            rebalance=options.rebalance, node_lost_grace_seconds=options.node_lost_grace_seconds
        )
        self.events = EventRecorder(client, instance=options.identity, background=True)
        self.context = ControllerContext(
            client=client,
            jobs=self.jobs,
            pods=self.pods,
            nodes=self.nodes,
            events=self.events,
            metrics=self.metrics,
            signals=self.signals,
            queue=self.queue,
            options=options,
        )
        self.workers = Workers(self.queue, reconcile_factory(self.context), count=options.workers, metrics=self.metrics)
        self.queue_reader: InterruptionQueueReader | None = None
        if interruption_queue is None and options.interruption_queue_url:
            interruption_queue = SqsQueue(options.interruption_queue_url, options.aws_region)
        if interruption_queue is not None:
            self.queue_reader = InterruptionQueueReader(
                client, self.nodes.cache, interruption_queue, metrics=self.metrics
            )
        self._workers_started = threading.Event()
        self.elector: LeaderElector | None = None
        if options.leader_elect:
            self.elector = LeaderElector(
                client,
                namespace=options.lease_namespace,
                name=options.lease_name,
                identity=options.identity,
                timing=options.lease_timing,
                on_started=self._start_leading,
                on_lost=self._leadership_lost,
            )
        self.http = HealthServer(self.metrics, port=options.http_port)
        self.http.add_liveness(self._check_threads)
        self.http.add_readiness(self._check_synced)
        self._wire_handlers()

    # -- handlers: events → keys

    def _wire_handlers(self) -> None:
        def job_key(obj: Object) -> None:
            ns, name = object_key(obj)
            self.queue.add(ObjectKey(ns, name))

        def job_updated(old: Object, new: Object) -> None:
            if only_status_changed(old, new) and self.context.status_writes.is_own(new):
                return  # this process's own status write: the pass that wrote it chose when to look again
            job_key(new)

        def job_deleted(obj: Object) -> None:
            ns, name = object_key(obj)
            self.metrics.job_deleted(ns, name)
            self.context.status_writes.forget(ns, name)
            self.queue.add(ObjectKey(ns, name))

        self.jobs.add_handler(EventHandler(on_add=job_key, on_update=job_updated, on_delete=job_deleted))

        def pod_changed(pod: Object, urgent: bool = False) -> None:
            for key in _pod_job(pod):
                self.queue.add(ObjectKey.parse(key), urgent=urgent)

        self.pods.add_handler(
            EventHandler(
                on_add=pod_changed,
                on_update=lambda old, new: pod_changed(new, new_pod_notice(old, new)),
                on_delete=pod_changed,
            )
        )

        # A notice that appears on a node makes its jobs urgent (their flush must not queue behind
        # routine passes); an update that changes nothing a reconcile reads (a heartbeat) wakes none.
        def node_changed(node: Object, urgent: bool = False) -> None:
            _, name = object_key(node)
            for pod in self.pods.cache.by_index("node", name):
                pod_changed(pod, urgent)

        def node_updated(old: Object, new: Object) -> None:
            if node_change_matters(old, new):
                node_changed(new, new_node_notice(old, new))

        def node_deleted(node: Object) -> None:
            self.signals.node_deleted(node)
            node_changed(node, urgent=True)

        self.nodes.add_handler(
            EventHandler(
                on_add=lambda node: node_changed(node, new_node_notice(None, node)),
                on_update=node_updated,
                on_delete=node_deleted,
            )
        )

    # -- leadership

    def _start_leading(self) -> None:
        self.metrics.leader(True)
        for ns, name in self.jobs.cache.object_keys():
            self.queue.add(ObjectKey(ns, name))
        self.workers.start()
        self._workers_started.set()
        if self.queue_reader is not None:
            self.queue_reader.start()

    def _leadership_lost(self, why: str) -> None:
        self.metrics.leader(False)
        self.metrics.forget_jobs()  # the new leader exports them: no stale copy here to page on
        self._on_lost(why)

    @property
    def is_leader(self) -> bool:
        return self._workers_started.is_set() and (self.elector is None or self.elector.is_leader)

    # -- probes

    def _check_threads(self) -> str | None:
        dead = [repr(i) for i in (self.jobs, self.pods, self.nodes) if not i.alive()]
        if self.elector is not None and not self.elector.alive() and not self._stop.is_set():
            dead.append("leader election")
        if self._workers_started.is_set() and not self.workers.alive() and not self._stop.is_set():
            dead.append("reconcile workers")
        if self.queue_reader is not None and not self.queue_reader.alive():
            dead.append("interruption-queue reader")
        return f"not running: {', '.join(dead)}" if dead else None

    def _check_synced(self) -> str | None:
        waiting = [repr(i) for i in (self.jobs, self.pods, self.nodes) if not i.has_synced()]
        return f"caches not synced: {', '.join(waiting)}" if waiting else None

    # -- lifecycle

    def run(self) -> None:
        """Start everything, wait for ``stop()``, then shut down cleanly."""
        self.http.start()
        log.info("serving /healthz, /readyz and /metrics on port %d", self.http.port)
        for informer in (self.jobs, self.pods, self.nodes):
            informer.start()
        try:
            for informer in (self.jobs, self.pods, self.nodes):
                while not informer.wait_for_sync(1.0):
                    if self._stop.is_set():
                        return
            log.info(
                "caches synced: %d SpotJobs, %d worker pods, %d nodes",
                len(self.jobs.cache),
                len(self.pods.cache),
                len(self.nodes.cache),
            )
            if self.elector is not None:
                self.elector.start()
            else:
                self._start_leading()
            self._stop.wait()
        finally:
            self._shutdown()

    def stop(self) -> None:
        self._stop.set()

    def _shutdown(self) -> None:
        log.info("shutting down")
        if self.queue_reader is not None:
            self.queue_reader.stop()
        finished = True
        if self._workers_started.is_set():
            finished = self.workers.stop(self.options.shutdown_wait_seconds)
        else:
            self.queue.shut_down()
        if self.elector is not None:
            # Releasing hands the lease over at once: only once no reconcile of ours still runs.
            # One stuck past the wait would act alongside the next leader; the lease then runs
            # out on its own, after the process exited.
            if not finished:
                log.warning("a reconcile still runs: the lease is not released, it expires on its own")
            self.elector.stop(release=finished)
        self.metrics.leader(False)
        self.events.close(timeout=5.0)
        for informer in (self.jobs, self.pods, self.nodes):
            informer.stop()
        self.http.stop()
        self.client.close()
        log.info("stopped")


def reconcile_not_wired(context: ControllerContext) -> Reconcile:
    """The reconcile seam while no reconciler is plugged in: says so, once per job, and does nothing.

    The SpotJob reconciler (model/reconciler work) replaces this with its own factory in
    ``orchestrator.k8s.main.RECONCILE_FACTORY``.
    """
    warned: set[ObjectKey] = set()
    lock = threading.Lock()

    def reconcile(key: ObjectKey) -> float | None:
        with lock:
            first = key not in warned
            warned.add(key)
        if first:
            log.warning(
                "SpotJob %s is not reconciled: this build of spotjob-controller has no reconciler wired in", key
            )
        return None

    return reconcile
