"""The reconciler on Kubernetes parts (``KubeJobStore``, ``KubernetesBackend``, the informers) over the
test API server with the chart's CRD, one pass at a time: what a pass does to a SpotJob that is
being deleted, and to one whose worker's node was replaced under its name. No kubelet: the pods
the controller creates stay Pending, and the test plays the garbage collector (and, where it says
so, the scheduler and the kubelet).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from ctl_support import TestApi, install_spotjob_crd, wait_for

from orchestrator.backends.k8s import BackendOptions, KubernetesBackend
from orchestrator.k8s.api import NODES, PODS, SPOTJOBS, KubeClient
from orchestrator.k8s.cluster_signals import NOTICE_INDEX, ClusterSignals, notice_index
from orchestrator.k8s.informer import Informer
from orchestrator.k8s.pods import JOB_LABEL
from orchestrator.k8s.store import KubeJobStore
from orchestrator.model import JobKey, Phase
from orchestrator.reconciler import Reconciler

KEY = JobKey("default", "llama")
HOLD = "example.com/hold"
"""Another tool's finalizer on the SpotJob: it keeps the job readable, being deleted, until removed."""


def _pod_job(pod: dict[str, Any]) -> list[str]:
    job = ((pod.get("metadata") or {}).get("labels") or {}).get(JOB_LABEL)
    return [f"{pod['metadata']['namespace']}/{job}"] if job else []


class Parts:
    """The controller's parts for one test, its informers running."""

    def __init__(self, api: TestApi, tmp_path: Path) -> None:
        self.client: KubeClient = api.client()
        self.jobs = Informer(self.client, SPOTJOBS, namespaces=["default"])
        self.pods = Informer(
            self.client, PODS, namespaces=["default"], label_selector=JOB_LABEL, indexers={"job": _pod_job}
        )
        self.nodes = Informer(self.client, NODES, indexers={NOTICE_INDEX: notice_index})
        for informer in (self.jobs, self.pods, self.nodes):
            informer.start()
        for informer in (self.jobs, self.pods, self.nodes):
            assert informer.wait_for_sync(30)
        backend = KubernetesBackend(
            self.client,
            jobs=self.jobs.cache,
            pods_cache=self.pods.cache,
            nodes=self.nodes.cache,
            signals=ClusterSignals(),
            token_key=b"k" * 32,
            options=BackendOptions(network_policy=False),
        )
        self.store = KubeJobStore(self.client, self.jobs.cache)
        self.reconciler = Reconciler(self.store, backend)
        self.uri = str(tmp_path / "ckpt")

    def stop(self) -> None:
        for informer in (self.jobs, self.pods, self.nodes):
            informer.stop()
        self.client.close()

    def pod_names(self) -> list[str]:
        return sorted(p["metadata"]["name"] for p in self.pods.cache.list())


@pytest.fixture
def parts(test_api: TestApi, tmp_path: Path) -> Iterator[Parts]:
    install_spotjob_crd(test_api)
    p = Parts(test_api, tmp_path)
    yield p
    p.stop()


def spotjob(uri: str) -> dict[str, Any]:
    return {
        "apiVersion": "spotjob.dev/v1alpha1",
        "kind": "SpotJob",
        "metadata": {"name": KEY.name, "finalizers": [HOLD]},
        "spec": {"image": "img:1", "command": ["train.py"], "checkpoint": {"uri": uri}},
    }


def test_a_spotjob_being_deleted_gets_no_new_attempt_when_its_pods_go(test_api: TestApi, parts: Parts) -> None:
    test_api.admin.create(SPOTJOBS, spotjob(parts.uri), "default")
    wait_for(lambda: parts.jobs.cache.get("default", KEY.name), what="the job in the cache")
    assert parts.reconciler.reconcile(KEY).phase is Phase.PENDING
    wait_for(lambda: parts.pod_names() == ["llama-0-0"], what="attempt 0's pod in the cache")

    # kubectl delete: the finalizer keeps the job, being deleted; its pods go (the garbage
    # collector's work with --cascade=foreground, played here).
    test_api.admin.delete(SPOTJOBS, KEY.name, "default")
    wait_for(
        lambda: (parts.jobs.cache.get("default", KEY.name) or {}).get("metadata", {}).get("deletionTimestamp"),
        what="the deletion in the cache",
    )
    test_api.admin.delete(PODS, "llama-0-0", "default", grace_period_seconds=0)
    wait_for(lambda: parts.pod_names() == [], what="the pod gone from the cache")
    for _ in range(3):
        parts.reconciler.reconcile(KEY)

    stored = parts.store.get(KEY)
    assert stored is not None and stored.status is not None
    assert stored.status.phase is Phase.PENDING and stored.status.preemptions == 0, stored.status
    assert stored.status.attempt.number == 0
    assert [p["metadata"]["name"] for p in test_api.admin.list(PODS, "default")[0]] == []


def _node(name: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name}}


def _register_node(test_api: TestApi, name: str) -> None:
    """A kubelet registering: the Node, then its Ready condition (the status subresource)."""
    node = test_api.admin.create(NODES, _node(name))
    node["status"] = {"conditions": [{"type": "Ready", "status": "True"}]}
    test_api.admin.replace(NODES, node, subresource="status")


def _run_on(test_api: TestApi, pod_name: str, node: str) -> None:
    """The scheduler's binding (the server stamps PodScheduled), then a kubelet's Running status
    with the training container ready."""
    binding = {"apiVersion": "v1", "kind": "Binding", "metadata": {"name": pod_name}, "target": {"name": node}}
    path = PODS.path("default", pod_name, "binding")
    test_api.admin._json("create", PODS, "POST", path, body=binding, subresource="binding")
    pod = test_api.admin.get(PODS, pod_name, "default")
    (trainer,) = pod["spec"]["containers"]
    pod["status"]["phase"] = "Running"
    pod["status"]["containerStatuses"] = [{"name": trainer["name"], "ready": True, "state": {"running": {}}}]
    test_api.admin.replace(PODS, pod, subresource="status")


def _running_on_n1(test_api: TestApi, parts: Parts) -> None:
    """The job created and reconciled, its one worker bound to node ``n1`` and running there."""
    _register_node(test_api, "n1")
    test_api.admin.create(SPOTJOBS, spotjob(parts.uri), "default")
    wait_for(lambda: parts.jobs.cache.get("default", KEY.name), what="the job in the cache")
    parts.reconciler.reconcile(KEY)
    wait_for(lambda: parts.pod_names() == ["llama-0-0"], what="attempt 0's pod in the cache")
    _run_on(test_api, "llama-0-0", "n1")
    wait_for(
        lambda: (parts.pods.cache.get("default", "llama-0-0") or {}).get("status", {}).get("phase") == "Running",
        what="the pod running in the cache",
    )
    assert parts.reconciler.reconcile(KEY).phase is Phase.RUNNING


def test_a_worker_whose_node_was_replaced_under_its_name_while_no_controller_watched_is_lost(
    test_api: TestApi, parts: Parts, tmp_path: Path
) -> None:
    """Karpenter and GKE reuse node names. The node of a running worker is deleted and a new one
    registers under its name while no controller watches (restarted, or a leader change): the new
    controller lists a Ready node and a pod that still says Running, and kept waiting on a worker
    no machine ran. The test plays the scheduler (a real binding: the server stamps PodScheduled)
    and the kubelet (the pod's status); what it does not model is what a real new kubelet does with
    a pod bound to its name, and the creation times are whole seconds, hence the pause."""
    _running_on_n1(test_api, parts)
    parts.stop()

    test_api.admin.delete(NODES, "n1")
    time.sleep(1.1)  # a creationTimestamp in a later second than the binding's PodScheduled
    _register_node(test_api, "n1")
    fresh = Parts(test_api, tmp_path)
    try:
        assert fresh.reconciler.reconcile(KEY).phase is not Phase.RUNNING
        status = test_api.admin.get(SPOTJOBS, KEY.name, "default")["status"]
        assert status["preemptions"] == 1 and status["restarts"] == 0, status
        (restart,) = status["restartHistory"]
        assert "node n1 was registered again" in restart["message"], restart
    finally:
        fresh.stop()


def test_a_worker_whose_container_the_kubelet_could_not_find_is_lost_not_failed(
    test_api: TestApi, parts: Parts
) -> None:
    """A node that rebooted (a kernel panic, a GPU's Xid error, host maintenance) and came back
    before ``--node-lost-grace-seconds``: its kubelet finds no container for a pod that was running
    and, the pod being ``restartPolicy: Never``, ends it with each container terminated
    ``ContainerStatusUnknown``, exit 137 (the kubelet's status manager, TerminatePod). That 137 is
    the kubelet's, not the agent's: the job counted a failure of the user's code and spent a
    restart. The test writes that status as the kubelet would; no kubelet runs."""
    _running_on_n1(test_api, parts)

    pod = test_api.admin.get(PODS, "llama-0-0", "default")
    unknown = {
        "exitCode": 137,
        "reason": "ContainerStatusUnknown",
        "message": "The container could not be located when the pod was terminated",
    }
    pod["status"]["phase"] = "Failed"
    pod["status"]["containerStatuses"][0].update(ready=False, state={"terminated": unknown})
    test_api.admin.replace(PODS, pod, subresource="status")
    wait_for(
        lambda: (parts.pods.cache.get("default", "llama-0-0") or {}).get("status", {}).get("phase") == "Failed",
        what="the failed pod in the cache",
    )
    parts.reconciler.reconcile(KEY)
    status = test_api.admin.get(SPOTJOBS, KEY.name, "default")["status"]
    assert status["preemptions"] == 1 and status["restarts"] == 0, status
    (restart,) = status["restartHistory"]
    assert restart["reason"] == "WorkerLost" and "ContainerStatusUnknown" in restart["message"], restart
