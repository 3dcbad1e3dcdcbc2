"""The reconciler on Kubernetes parts (``KubeJobStore``, ``KubernetesBackend``, the informers) over the
test API server with the chart's CRD, one pass at a time: what a pass does to a SpotJob that is
being deleted. No kubelet: the pods the controller creates stay Pending, and the test plays the
garbage collector.
"""

from __future__ import annotations

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
