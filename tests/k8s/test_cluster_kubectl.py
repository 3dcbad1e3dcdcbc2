"""The real kubectl binary against the test cluster: apply, get with printer columns, describe, delete."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from .cluster import TestCluster

MANIFESTS = Path(__file__).parent / "manifests"

WAIT = 60.0  # generous for a loaded machine: waits end as soon as their condition holds

pytestmark = pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not on PATH")


def test_kubectl_applies_gets_describes_and_deletes_a_custom_resource_with_its_pods(
    cluster: TestCluster, namespace: str, tmp_path: Path
) -> None:
    cluster.add_node("kubectl-node")
    out = cluster.kubectl("apply", "-f", str(MANIFESTS / "widget-crd.yaml")).stdout
    assert "customresourcedefinition.apiextensions.k8s.io/widgets.test.spotjob.dev" in out
    cluster.wait_for(
        lambda: cluster.kubectl("get", "crd", "widgets.test.spotjob.dev", check=False).returncode == 0, WAIT, "the CRD"
    )
    assert (
        "widget.test.spotjob.dev/w1 created"
        in cluster.kubectl("apply", "-n", namespace, "-f", str(MANIFESTS / "widget.yaml")).stdout
    )
    # Apply again: unchanged; with an edit: a merge patch carrying the last-applied annotation.
    assert "unchanged" in cluster.kubectl("apply", "-n", namespace, "-f", str(MANIFESTS / "widget.yaml")).stdout
    edited = tmp_path / "w1.yaml"
    edited.write_text((MANIFESTS / "widget.yaml").read_text().replace("size: 3", "size: 4"))
    assert "configured" in cluster.kubectl("apply", "-n", namespace, "-f", str(edited)).stdout
    w1 = cluster.rest.get(f"/apis/test.spotjob.dev/v1/namespaces/{namespace}/widgets/w1")
    assert (
        w1["spec"]["size"] == 4 and "kubectl.kubernetes.io/last-applied-configuration" in w1["metadata"]["annotations"]
    )

    # A pod the widget owns, as a controller would create it.
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": "w1-worker",
            "ownerReferences": [
                {
                    "apiVersion": "test.spotjob.dev/v1",
                    "kind": "Widget",
                    "name": "w1",
                    "uid": w1["metadata"]["uid"],
                    "controller": True,
                    "blockOwnerDeletion": True,
                }
            ],
        },
        "spec": {
            "terminationGracePeriodSeconds": 5,
            "containers": [
                {"name": "main", "image": "python:3.11", "command": ["python", "-c", "import time; time.sleep(300)"]}
            ],
        },
    }
    cluster.rest.request("POST", f"/api/v1/namespaces/{namespace}/pods", pod)
    cluster.wait_for(
        lambda: cluster.rest.get(f"/api/v1/namespaces/{namespace}/pods/w1-worker")["status"].get("phase") == "Running",
        WAIT,
        "the worker to run",
    )

    table = cluster.kubectl("get", "wd", "-n", namespace).stdout.splitlines()
    assert table[0].split() == ["NAME", "SIZE", "PHASE", "READY", "AGE"]
    assert table[1].split()[:2] == ["w1", "4"]
    wide = cluster.kubectl("get", "wd", "-n", namespace, "-o", "wide").stdout.splitlines()
    assert wide[0].split() == ["NAME", "SIZE", "PHASE", "READY", "COLOR", "AGE"] and "blue" in wide[1]
    pods = cluster.kubectl("get", "pods", "-n", namespace, "-o", "wide").stdout.splitlines()
    assert (
        pods[0].split()[:5] == ["NAME", "READY", "STATUS", "RESTARTS", "AGE"]
        and "Running" in pods[1]
        and "kubectl-node" in pods[1]
    )
    nodes = cluster.kubectl("get", "nodes").stdout
    assert "kubectl-node" in nodes and "Ready" in nodes

    cluster.rest.request(
        "POST",
        f"/api/v1/namespaces/{namespace}/events",
        {
            "metadata": {"name": "w1.noted"},
            "involvedObject": {
                "apiVersion": "test.spotjob.dev/v1",
                "kind": "Widget",
                "name": "w1",
                "namespace": namespace,
                "uid": w1["metadata"]["uid"],
            },
            "reason": "Noted",
            "message": "seen by the test",
            "type": "Normal",
            "count": 2,
            "firstTimestamp": "2025-01-01T00:00:00Z",
            "lastTimestamp": "2025-01-01T00:00:00Z",
            "source": {"component": "test"},
        },
    )
    described = cluster.kubectl("describe", "wd", "w1", "-n", namespace).stdout
    assert "Size:   4" in described and "Noted" in described and "seen by the test" in described
    assert "Successfully assigned" in cluster.kubectl("describe", "pod", "w1-worker", "-n", namespace).stdout

    assert 'widget.test.spotjob.dev "w1" deleted' in cluster.kubectl("delete", "wd", "w1", "-n", namespace).stdout
    cluster.wait_for(
        lambda: cluster.rest.get(f"/api/v1/namespaces/{namespace}/pods")["items"] == [],
        WAIT,
        "the owned pod to be deleted",
    )
    assert "No resources found" in cluster.kubectl("get", "wd", "-n", namespace).stderr


def test_kubectl_prints_the_servers_warnings_even_when_they_quote(
    cluster: TestCluster, namespace: str, widget_crd: None, tmp_path: Path
) -> None:
    """A Warning header's text is a quoted-string: an unescaped quote in it makes kubectl drop it."""
    manifest = tmp_path / "widget.yaml"
    manifest.write_text((MANIFESTS / "widget.yaml").read_text().replace("  color: blue", "  color: blue\n  bogus: 1"))
    out = cluster.kubectl("create", "-n", namespace, "--validate=warn", "-f", str(manifest))
    assert 'Warning: unknown field "spec.bogus"' in out.stderr
