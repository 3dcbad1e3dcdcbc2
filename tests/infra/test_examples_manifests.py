"""examples/spotjob-eks.yaml and examples/spotjob-gke.yaml: valid SpotJobs for the chart's CRD, pod
templates valid for Kubernetes, on the spot GPU capacity the Terraform modules create, with the
identities the Terraform examples bind."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from infra_support import CRD_FILE, EXAMPLES, K8S_VERSIONS, TERRAFORM, hcl_blocks, load_hcl

CLOUDS = {
    "eks": {
        "file": EXAMPLES / "spotjob-eks.yaml",
        "scheme": "s3://",
        "identity_annotation": "eks.amazonaws.com/role-arn",
        "notice_seconds": 120,
    },
    "gke": {
        "file": EXAMPLES / "spotjob-gke.yaml",
        "scheme": "gs://",
        "identity_annotation": "iam.gke.io/gcp-service-account",
        "notice_seconds": 30,
    },
}


def _docs(path: Path) -> dict[str, dict[str, Any]]:
    return {d["kind"]: d for d in yaml.safe_load_all(path.read_text()) if d}


def _strict(schema: dict[str, Any]) -> dict[str, Any]:
    """The CRD's structural schema as JSON Schema, with unknown fields refused (the API server
    prunes them silently; an example with one would not do what it says)."""
    schema = copy.deepcopy(schema)

    def walk(node: dict[str, Any]) -> None:
        preserved = node.get("x-kubernetes-preserve-unknown-fields")
        if node.get("type") == "object" and "properties" in node and not preserved:
            node.setdefault("additionalProperties", False)
        for sub in node.get("properties", {}).values():
            walk(sub)
        if isinstance(node.get("items"), dict):
            walk(node["items"])

    walk(schema)
    return schema


def _crd_schema() -> dict[str, Any]:
    crd = yaml.safe_load(CRD_FILE.read_text())
    (version,) = [v for v in crd["spec"]["versions"] if v["storage"]]
    return _strict(version["schema"]["openAPIV3Schema"])


@pytest.mark.parametrize("cloud", sorted(CLOUDS))
def test_the_spotjob_is_valid_for_the_crd(cloud: str) -> None:
    job = _docs(CLOUDS[cloud]["file"])["SpotJob"]
    crd = yaml.safe_load(CRD_FILE.read_text())
    assert job["apiVersion"] == f"{crd['spec']['group']}/v1alpha1"
    assert job["kind"] == crd["spec"]["names"]["kind"]
    # OpenAPI v3's boolean exclusiveMinimum is draft 4's.
    jsonschema.Draft4Validator(_crd_schema()).validate(job)


@pytest.mark.parametrize("cloud", sorted(CLOUDS))
def test_the_pod_template_and_service_account_are_valid_kubernetes(cloud: str) -> None:
    docs = _docs(CLOUDS[cloud]["file"])
    template = {
        "apiVersion": "v1",
        "kind": "PodTemplate",
        "metadata": {"name": "example"},
        "template": docs["SpotJob"]["spec"]["template"],
    }
    for version in K8S_VERSIONS:
        kubernetes_validate.validate(template, version, strict=True)
        kubernetes_validate.validate(docs["ServiceAccount"], version, strict=True)


@pytest.mark.parametrize("cloud", sorted(CLOUDS))
def test_the_job_trains_the_example_on_two_spot_gpu_nodes(cloud: str) -> None:
    docs = _docs(CLOUDS[cloud]["file"])
    spec = docs["SpotJob"]["spec"]
    assert spec["replicas"] == 2
    assert spec["command"][0] == "/workspace/train.py"  # where examples/Dockerfile.agent puts it
    assert spec["checkpoint"]["uri"].startswith(CLOUDS[cloud]["scheme"])
    assert set(spec) >= {"checkpoint", "maxRestarts", "flushTimeoutSeconds", "restartBackoff", "cooldown"}
    assert spec["flushTimeoutSeconds"] < CLOUDS[cloud]["notice_seconds"], "the flush must fit in the notice"
    (container,) = spec["template"]["spec"]["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    sa = docs["ServiceAccount"]
    assert spec["template"]["spec"]["serviceAccountName"] == sa["metadata"]["name"]
    assert sa["metadata"]["namespace"] == docs["SpotJob"]["metadata"]["namespace"]
    assert CLOUDS[cloud]["identity_annotation"] in sa["metadata"]["annotations"]


def _tolerates(tolerations: list[dict[str, Any]], key: str, value: str, effect: str) -> bool:
    for t in tolerations:
        if t.get("effect", effect) != effect or t.get("key") not in (key, None):
            continue
        if t.get("operator", "Equal") == "Exists" or t.get("value") == value:
            return True
    return False


def test_eks_lands_on_the_spot_gpu_node_group_of_the_aws_module() -> None:
    pod = _docs(CLOUDS["eks"]["file"])["SpotJob"]["spec"]["template"]["spec"]
    terms = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    selected = {
        (e["key"], v) for term in terms for e in term["matchExpressions"] if e["operator"] == "In" for v in e["values"]
    }
    # Karpenter's spot nodes and managed node groups' spot nodes (what the module creates).
    assert ("karpenter.sh/capacity-type", "spot") in selected
    assert ("eks.amazonaws.com/capacityType", "SPOT") in selected
    resources = hcl_blocks(load_hcl(TERRAFORM / "modules" / "aws" / "main.tf"), "resource")
    node_group = resources[("aws_eks_node_group", "this")]
    assert node_group["capacity_type"] == "SPOT"
    for taint in node_group["taint"]:
        effect = {"NO_SCHEDULE": "NoSchedule", "NO_EXECUTE": "NoExecute", "PREFER_NO_SCHEDULE": "PreferNoSchedule"}
        assert _tolerates(pod["tolerations"], taint["key"], taint["value"], effect[taint["effect"]]), taint


def test_gke_lands_on_the_spot_gpu_node_pool_of_the_gcp_module() -> None:
    pod = _docs(CLOUDS["gke"]["file"])["SpotJob"]["spec"]["template"]["spec"]
    assert pod["nodeSelector"]["cloud.google.com/gke-spot"] == "true"
    resources = hcl_blocks(load_hcl(TERRAFORM / "modules" / "gcp" / "main.tf"), "resource")
    pool = resources[("google_container_node_pool", "this")]
    (node_config,) = pool["node_config"]
    assert node_config["spot"] is True
    effect = {"NO_SCHEDULE": "NoSchedule", "NO_EXECUTE": "NoExecute", "PREFER_NO_SCHEDULE": "PreferNoSchedule"}
    for taint in node_config["taint"]:
        assert _tolerates(pod["tolerations"], taint["key"], taint["value"], effect[taint["effect"]]), taint
    # GKE taints GPU nodes nvidia.com/gpu=present:NoSchedule itself.
    assert _tolerates(pod["tolerations"], "nvidia.com/gpu", "present", "NoSchedule")


@pytest.mark.parametrize("cloud", sorted(CLOUDS))
def test_the_namespace_and_service_account_are_the_ones_terraform_binds(cloud: str) -> None:
    docs = _docs(CLOUDS[cloud]["file"])
    main = load_hcl(TERRAFORM / "examples" / cloud / "main.tf")
    (module,) = [m["spotjob"] for m in main["module"]]
    identities = module["training_identities"]
    bound = {(v["namespace"], v["service_account"], v["prefix"]) for v in identities.values()}
    sa = docs["ServiceAccount"]["metadata"]
    uri = docs["SpotJob"]["spec"]["checkpoint"]["uri"]
    prefix = uri.split("://", 1)[1].split("/", 1)[1].rsplit("/", 1)[0]
    assert (sa["namespace"], sa["name"], prefix) in bound, f"{cloud}: {sa} under {prefix!r} is not bound: {bound}"
