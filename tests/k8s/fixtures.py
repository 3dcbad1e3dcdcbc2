"""Pytest fixtures for the test Kubernetes cluster (import them into a conftest.py).

- ``k8s_cluster`` (session): a started ``TestCluster``; ``KUBECONFIG`` and ``KUBECACHEDIR`` are set
  in ``os.environ`` for this process and its children while it runs. With
  ``SPOTJOB_TEST_KUBECONFIG`` set it uses that cluster instead of starting the test API server.
  At the end, a process of any pod still running after the cluster stopped fails the session.
- ``cluster`` (per test): the same cluster; nodes the test added are deleted afterwards, faults
  cleared, and the test fails if kubernetes-validate (strict) rejected any object it wrote.
- ``namespace`` (per test): a fresh namespace, deleted afterwards.
- ``kube_client`` (per test): a ``kubernetes.client.ApiClient`` from the kubeconfig.
- ``test_apiserver_only``: skips a test that needs a hook of the test API server (audit log,
  faults, expiring the watch history) when a real cluster is in use.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
from collections.abc import Iterator
from typing import Any

import pytest

from .cluster import TestCluster


@pytest.fixture(scope="session")
def k8s_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestCluster]:
    cluster = TestCluster.from_env(tmp_path_factory.mktemp("k8s")).start()
    saved = {k: os.environ.get(k) for k in cluster.env()}
    os.environ.update(cluster.env())
    try:
        yield cluster
    finally:
        cluster.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    left = cluster.leftover_processes()
    for pid in left:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    if left:
        pytest.fail(f"processes of pods outlived the test cluster (now killed): {left}")


@pytest.fixture
def cluster(k8s_cluster: TestCluster) -> Iterator[TestCluster]:
    before_nodes = set(k8s_cluster.node_names())
    before_failures = len(k8s_cluster.validation_failures) if k8s_cluster.on_test_server else 0
    yield k8s_cluster
    k8s_cluster.clear_faults()
    for name in set(k8s_cluster.node_names()) - before_nodes:
        k8s_cluster.delete_node(name)
    if k8s_cluster.on_test_server:
        new = k8s_cluster.validation_failures[before_failures:]
        if new:
            details = "\n".join(f"  {f.user} {f.verb} {f.kind} {f.namespace}/{f.name}: {f.message}" for f in new)
            pytest.fail(f"kubernetes-validate (strict) rejected objects written during this test:\n{details}")


@pytest.fixture
def namespace(cluster: TestCluster) -> Iterator[str]:
    name = f"t-{secrets.token_hex(4)}"
    cluster.rest.request(
        "POST", "/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}}
    )
    # Pods need the namespace's default ServiceAccount, which appears with the namespace.
    cluster.wait_for(
        lambda: cluster.rest.get(f"/api/v1/namespaces/{name}/serviceaccounts/default"), 60, "the default ServiceAccount"
    )
    yield name
    try:
        cluster.rest.request("DELETE", f"/api/v1/namespaces/{name}")
    except Exception:
        pass


@pytest.fixture
def kube_client(cluster: TestCluster) -> Iterator[Any]:
    client = cluster.client()
    yield client
    client.close()


@pytest.fixture
def test_apiserver_only(cluster: TestCluster) -> None:
    if not cluster.on_test_server:
        pytest.skip("needs a hook of the test API server; SPOTJOB_TEST_KUBECONFIG names a real cluster")
