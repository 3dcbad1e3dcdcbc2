"""README "Upgrading": with ``crds.enabled=false`` the CRD is updated with ``kubectl apply -f
charts/spotjob/files/crds/spotjob.dev_spotjobs.yaml``. The real kubectl applies the shipped file
over an older CRD (today's less the status fields added since 2026-12-01), the SpotJobs stored
under it stay, and the status fields the older CRD dropped are kept from then on."""

from __future__ import annotations

import copy
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml

from orchestrator.crd import CRD_PATH

from .cluster import TestCluster

pytestmark = pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not on PATH")

CRD_NAME = "spotjobs.spotjob.dev"
GROUP_PATH = "/apis/spotjob.dev/v1alpha1"


def older_crd() -> dict[str, Any]:
    """The shipped CRD without the status fields added after 2026-12-01."""
    crd = copy.deepcopy(yaml.safe_load(CRD_PATH.read_text()))
    status = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"]
    del status["checkpointUri"]
    del status["attempt"]["properties"]["replicas"]
    del status["attempt"]["properties"]["notStarting"]
    return crd


def write_status(cluster: TestCluster, namespace: str) -> dict[str, Any]:
    path = f"{GROUP_PATH}/namespaces/{namespace}/spotjobs/old"
    job = cluster.rest.get(path)
    job["status"] = {"phase": "Running", "attempt": {"number": 0, "replicas": 1}}
    cluster.rest.request("PUT", f"{path}/status", job)
    return dict(cluster.rest.get(path)["status"])


def test_kubectl_apply_of_the_shipped_crd_upgrades_an_older_one_in_place(
    cluster: TestCluster, namespace: str, tmp_path: Path
) -> None:
    older = tmp_path / "older-crd.yaml"
    older.write_text(yaml.safe_dump(older_crd()))
    try:
        cluster.kubectl("apply", "-f", str(older))
        cluster.wait_for(lambda: cluster.rest.get(GROUP_PATH), 30, "the older CRD to be served")
        job = yaml.safe_load((Path(__file__).resolve().parents[2] / "examples" / "spotjob.yaml").read_text())
        job["metadata"]["name"] = "old"
        cluster.rest.request("POST", f"{GROUP_PATH}/namespaces/{namespace}/spotjobs", job)
        assert "replicas" not in write_status(cluster, namespace)["attempt"]  # the older CRD drops it

        out = cluster.kubectl("apply", "-f", str(CRD_PATH)).stdout
        assert f"customresourcedefinition.apiextensions.k8s.io/{CRD_NAME} configured" in out

        def kept() -> bool:
            return write_status(cluster, namespace)["attempt"].get("replicas") == 1

        cluster.wait_for(kept, 30, "status.attempt.replicas to be kept under the applied CRD")
        stored = cluster.rest.get(f"{GROUP_PATH}/namespaces/{namespace}/spotjobs/old")["spec"]
        assert stored["command"] == job["spec"]["command"] and stored["checkpoint"] == {
            **stored["checkpoint"],
            **job["spec"]["checkpoint"],
        }  # the SpotJob is there as written (defaults filled in)
    finally:
        cluster.kubectl("apply", "-f", str(CRD_PATH))  # the shipped CRD for the tests after this one
