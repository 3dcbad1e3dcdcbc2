"""The SpotJob reconcile for ``spotjob-controller``: the shared ``Reconciler`` on Kubernetes parts.

``spotjob_reconcile(context)`` is the controller's ``ReconcileFactory``. Built once per process,
before the informers start: the Kubernetes store (``orchestrator.k8s.store``), the backend
(``orchestrator.backends.k8s``), the Events sink (``events.JobEventSink``) and the metrics
(``ControllerMetrics``) around one ``Reconciler`` — the same state machine local mode runs. Each
call reconciles one job key and answers when to look again; the work queue runs at most one call
per key at a time, and informer events (a pod became Ready, a node was tainted) bring a job's
next pass forward. After each pass, the job's running pods get its newest checkpoint as hint
annotations (``orchestrator.k8s.hints``).
"""

from __future__ import annotations

import logging

from orchestrator.backends.k8s import BackendOptions, KubernetesBackend
from orchestrator.k8s.agents import load_token_key
from orchestrator.k8s.controller import ControllerContext
from orchestrator.k8s.events import JobEventSink
from orchestrator.k8s.hints import CheckpointHints
from orchestrator.k8s.informer import EventHandler
from orchestrator.k8s.pods import WorkerOptions
from orchestrator.k8s.store import KubeJobStore
from orchestrator.k8s.workqueue import ObjectKey, Reconcile
from orchestrator.model import JobKey
from orchestrator.reconciler import Reconciler, ReconcilerOptions

log = logging.getLogger(__name__)


def spotjob_reconcile(context: ControllerContext, *, options: ReconcilerOptions | None = None) -> Reconcile:
    """The reconcile function of the controller; see the module docstring.

    Raises ``agents.TokenKeyError`` when ``--agent-token-key-file`` cannot be read.
    """
    opts = context.options
    backend = KubernetesBackend(
        context.client,
        jobs=context.jobs.cache,
        pods_cache=context.pods.cache,
        nodes=context.nodes.cache,
        signals=context.signals,
        token_key=load_token_key(opts.agent_token_key_file),
        options=BackendOptions(
            workers=WorkerOptions(
                agent_port=opts.agent_port,
                agent_launcher=opts.agent_launcher,
                controller_namespace=opts.controller_namespace,
                controller_pod_labels=dict(opts.controller_pod_labels),
            ),
            network_policy=opts.network_policy,
        ),
        wake=lambda job: context.queue.add(ObjectKey(job.namespace, job.name)),
    )
    hints = CheckpointHints(context.client, context.pods.cache, metrics=context.metrics)
    context.pods.add_handler(EventHandler(on_delete=backend.pod_deleted))
    context.pods.add_handler(EventHandler(on_delete=hints.forget))
    store = KubeJobStore(context.client, context.jobs.cache, on_writing=context.status_writes.writing)
    reconciler = Reconciler(
        store,
        backend,
        events=JobEventSink(context.events, context.jobs.cache, context.nodes.cache),
        metrics=context.metrics,
        options=options,
    )

    def reconcile(key: ObjectKey) -> float | None:
        job = JobKey(key.namespace, key.name)
        requeue = reconciler.reconcile(job).requeue_after
        _sync_hints(hints, store, job)
        return requeue

    return reconcile


def _sync_hints(hints: CheckpointHints, store: KubeJobStore, job: JobKey) -> None:
    """After a pass: the running workers' checkpoint hints follow the status it wrote (or kept)."""
    try:
        stored = store.get(job)
        if stored is None or stored.status is None or stored.status.phase.terminal:
            return
        hints.sync(job, stored.status.last_checkpoint, stored.status.attempt.number)
    except Exception:  # a hint is a courtesy: never fail the pass for it
        log.exception("job %s: updating the checkpoint hints failed", job)
