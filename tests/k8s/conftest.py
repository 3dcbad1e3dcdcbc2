"""Fixtures of the test Kubernetes cluster; see fixtures.py (other test folders import them the same way)."""

from .fixtures import cluster, k8s_cluster, kube_client, namespace, test_apiserver_only

__all__ = ["cluster", "k8s_cluster", "kube_client", "namespace", "test_apiserver_only"]


import pathlib
from collections.abc import Iterator

import pytest

from .cluster import TestCluster

MANIFESTS = pathlib.Path(__file__).parent / "manifests"


@pytest.fixture(scope="session")
def widget_crd(k8s_cluster: TestCluster) -> Iterator[None]:
    """The sample Widget CRD (test.spotjob.dev/v1, short name wd), served for the session."""
    import yaml

    crd = yaml.safe_load((MANIFESTS / "widget-crd.yaml").read_text())
    try:
        k8s_cluster.rest.request("POST", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions", crd)
    except Exception as e:
        if getattr(e, "status", None) != 409:
            raise
    k8s_cluster.wait_for(lambda: k8s_cluster.rest.get("/apis/test.spotjob.dev/v1"), 60, "the Widget CRD to be served")
    yield
