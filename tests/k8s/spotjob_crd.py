"""The chart's SpotJob CRD installed on a test cluster exactly as shipped (shared by the
end-to-end and the plugin tests)."""

from __future__ import annotations

import yaml

from orchestrator.crd import CRD_PATH
from tests.k8s.cluster import TestCluster
from tests.k8s.cluster.client import ApiCallError

GROUP_PATH = "/apis/spotjob.dev/v1alpha1"


def install_crd(cluster: TestCluster) -> None:
    """Create (or replace) the CRD and wait until its group is served."""
    crd = yaml.safe_load(CRD_PATH.read_text())
    path = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"
    try:
        cluster.rest.request("POST", path, crd)
    except ApiCallError as e:
        if e.status != 409:
            raise
        current = cluster.rest.get(f"{path}/{crd['metadata']['name']}")
        crd["metadata"]["resourceVersion"] = current["metadata"]["resourceVersion"]
        cluster.rest.request("PUT", f"{path}/{crd['metadata']['name']}", crd)
    cluster.wait_for(lambda: cluster.rest.get(GROUP_PATH), 30, "the SpotJob CRD to be served")
