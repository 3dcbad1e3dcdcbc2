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


def test_kubectl_create_namespace_is_refused_saying_protobuf_and_what_to_use_instead(cluster: TestCluster) -> None:
    """Found walking the README's install steps: `kubectl create namespace ml` sends a protobuf
    body, which the test API server does not decode, and the answer was "the body of the request
    could not be decoded: Expecting value: line 1 column 1 (char 0)". It now says why and what works."""
    proc = cluster.kubectl("create", "namespace", "t-protobuf", check=False)
    assert proc.returncode != 0
    assert "not application/vnd.kubernetes.protobuf" in proc.stderr, proc.stderr
    assert "kubectl apply -f" in proc.stderr, proc.stderr
    namespace = "apiVersion: v1\nkind: Namespace\nmetadata: {name: t-protobuf}\n"
    assert "created" in cluster.kubectl("apply", "-f", "-", input=namespace).stdout
    cluster.kubectl("delete", "namespace", "t-protobuf", "--wait=false")


def test_a_pod_disruption_budget_such_as_the_charts_is_served(cluster: TestCluster, namespace: str) -> None:
    """Found walking the README's install steps: `kubectl apply -f` of the chart's rendered
    objects failed as a whole ("error validating data: the server could not find the requested
    resource") because policy/v1 PodDisruptionBudget was not served. It is now stored and served,
    still never enforced (every eviction is allowed)."""
    pdb = (
        "apiVersion: policy/v1\nkind: PodDisruptionBudget\n"
        f"metadata: {{name: spotjob, namespace: {namespace}}}\n"
        "spec: {maxUnavailable: 1, selector: {matchLabels: {app.kubernetes.io/name: spotjob}}}\n"
    )
    assert "poddisruptionbudget.policy/spotjob created" in cluster.kubectl("apply", "-f", "-", input=pdb).stdout
    assert "spotjob" in cluster.kubectl("get", "pdb", "-n", namespace).stdout
