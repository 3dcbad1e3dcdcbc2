"""The chart, rendered by the real helm with the defaults and with the value sets operators use:
every object valid for Kubernetes (strict), and each setting visible where the controller and the
cluster read it."""

from __future__ import annotations

import copy
import json
import re
import subprocess
from typing import Any

import kubernetes_validate
import pytest
import yaml
from infra_support import (
    CHART,
    CRD_FILE,
    K8S_VERSIONS,
    NAMESPACE,
    RELEASE,
    container_args,
    find,
    helm,
    one,
    template,
)
from infra_support import render as render_with_helm

from orchestrator.k8s.interruption_queue import region_of
from orchestrator.k8s.main import parse_options

SELECTOR = {
    "app.kubernetes.io/name": "spotjob",
    "app.kubernetes.io/component": "controller",
    "app.kubernetes.io/instance": RELEASE,
}
ROLE_ARN = "arn:aws:iam::111122223333:role/spotjob-controller"
QUEUE_URL = "https://sqs.us-east-1.amazonaws.com/111122223333/spotjob-interruptions"
GSA = "spotjob-controller@example-project.iam.gserviceaccount.com"

# name -> values; each is rendered, validated and checked below.
VALUE_SETS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "one-replica": {"replicas": 1, "leaderElection": {"enabled": False}},
    "no-crds": {"crds": {"enabled": False}},
    "crds-not-kept": {"crds": {"keep": False}},
    "irsa": {
        "serviceAccount": {"aws": {"roleArn": ROLE_ARN}},
        "interruptionQueue": {"url": QUEUE_URL, "region": "us-east-1"},
    },
    "workload-identity": {"serviceAccount": {"gcp": {"serviceAccount": GSA}}},
    "servicemonitor": {"metrics": {"serviceMonitor": {"enabled": True, "labels": {"release": "prometheus"}}}},
    "prometheusrule": {
        "metrics": {
            "serviceMonitor": {"enabled": True},
            "prometheusRule": {"enabled": True, "labels": {"release": "prometheus"}, "alertLabels": {"team": "ml"}},
        }
    },
    "watch-namespaces": {"watchNamespaces": ["ml-training", "research"]},
    "network-policy-off": {"networkPolicy": {"enabled": False}},
    # Each value the controller is given at the low and the high end of what the schema takes.
    "bounds-low": {
        "httpPort": 1,
        "agentPort": 1,
        "logLevel": "debug",
        "leaderElection": {"leaseName": "0", "leaseNamespace": "0"},
        "watchNamespaces": ["0", "true"],  # names YAML would read as a number and a boolean
        "nameOverride": "0",
    },
    "bounds-high": {
        "httpPort": 65535,
        "agentPort": 65535,
        "logLevel": "error",
        "logFormat": "json",
        "agentLauncher": "torchrun",
        "leaderElection": {"leaseName": "a" * 253, "leaseNamespace": "b" * 63},
        "watchNamespaces": ["a" * 63, "ml-training"],
    },
    "queue-region-in-its-url": {"interruptionQueue": {"url": QUEUE_URL}},
    "everything": {
        "image": {"digest": "sha256:" + "a" * 64},
        "imagePullSecrets": [{"name": "regcred"}],
        "priorityClassName": "system-cluster-critical",
        "nodeSelector": {"kubernetes.io/os": "linux"},
        "tolerations": [{"key": "CriticalAddonsOnly", "operator": "Exists"}],
        "topologySpreadConstraints": [
            {
                "maxSkew": 1,
                "topologyKey": "topology.kubernetes.io/zone",
                "whenUnsatisfiable": "ScheduleAnyway",
                "labelSelector": {"matchLabels": SELECTOR},
            }
        ],
        "affinity": {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [{"matchExpressions": [{"key": "pool", "operator": "In", "values": ["a"]}]}]
                }
            }
        },
        "podAnnotations": {"example.com/team": "ml-platform"},
        "podLabels": {"team": "ml-platform", "app.kubernetes.io/name": "overridden"},
        "extraArgs": ["--rebalance=flush"],
        "extraEnv": [{"name": "AWS_STS_REGIONAL_ENDPOINTS", "value": "regional"}],
        "securityContext": {"runAsUser": None, "runAsGroup": None},
        "metrics": {"service": {"annotations": {"prometheus.io/scrape": "true"}}},
        "rbac": {"aggregateToDefaultRoles": False},
        "podDisruptionBudget": {"maxUnavailable": "50%"},
        "leaderElection": {"leaseName": "spotjob-leader", "leaseNamespace": "kube-system"},
    },
}


_RENDERED: dict[str, list[dict[str, Any]]] = {}


def render(values: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """The objects ``helm template`` renders with ``values``, each set of values rendered once per
    module (helm's output depends on nothing else) and handed out as a fresh copy, so a test that
    changed what it got cannot change what the next one reads."""
    key = json.dumps(values or {}, sort_keys=True)
    if key not in _RENDERED:
        _RENDERED[key] = render_with_helm(values)
    return copy.deepcopy(_RENDERED[key])


@pytest.fixture(scope="module", params=sorted(VALUE_SETS))
def rendered(request: pytest.FixtureRequest) -> tuple[str, list[dict[str, Any]]]:
    return request.param, render(VALUE_SETS[request.param])


_VALID: set[tuple[str, str]] = set()
"""(an object as JSON, a Kubernetes version) found valid: most objects are the same in every value
set (the CRD above all), and the same object is judged the same way again."""


def _validate(obj: dict[str, Any]) -> None:
    text = json.dumps(obj, sort_keys=True)
    for version in K8S_VERSIONS:
        if (text, version) in _VALID:
            continue
        try:
            kubernetes_validate.validate(obj, version, strict=True)
            _VALID.add((text, version))
        except kubernetes_validate.ValidationError as e:
            path = "/".join(str(p) for p in e.path)
            raise AssertionError(
                f"{obj['kind']}/{obj['metadata']['name']} is invalid for Kubernetes {version} at {path}: {e.message}"
            ) from None


def test_helm_lint_strict_passes_with_the_defaults_and_every_value_set(helm_bin: str, tmp_path: Any) -> None:
    for name, values in VALUE_SETS.items():
        values_file = tmp_path / f"{name}.yaml"
        values_file.write_text(yaml.safe_dump(values))
        proc = helm("lint", "--strict", str(CHART), "--namespace", NAMESPACE, "-f", str(values_file))
        assert proc.returncode == 0, f"helm lint --strict with {name}:\n{proc.stdout}\n{proc.stderr}"


def test_every_rendered_object_is_valid_kubernetes_in_strict_mode(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    _, objects = rendered
    assert objects
    for obj in objects:
        if obj["apiVersion"].startswith("monitoring.coreos.com/"):
            continue  # a Prometheus Operator CRD: checked against the Service it scrapes below
        _validate(obj)


def test_every_namespaced_object_lands_in_the_release_namespace(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    name, objects = rendered
    elsewhere = {"Role", "RoleBinding"}  # watched namespaces and the lease namespace
    for obj in objects:
        if obj["kind"] in ("CustomResourceDefinition", "ClusterRole", "ClusterRoleBinding") or obj["kind"] in elsewhere:
            continue
        assert obj["metadata"].get("namespace") == NAMESPACE, f"{name}: {obj['kind']}/{obj['metadata']['name']}"


def test_the_controller_pod_is_hardened(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    name, objects = rendered
    pod = one(objects, "Deployment")["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    sc = container["securityContext"]
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["privileged"] is False
    assert sc["capabilities"] == {"drop": ["ALL"]}
    assert sc["seccompProfile"] == {"type": "RuntimeDefault"}
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
    assert container["resources"]["requests"] and container["resources"]["limits"]["memory"]
    assert {"name": "tmp", "mountPath": "/tmp"} in container["volumeMounts"]
    env = {e["name"]: e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") for e in container["env"]}
    assert env["POD_NAME"] == "metadata.name"
    assert env["POD_NAMESPACE"] == "metadata.namespace"
    if name != "everything":
        assert pod["securityContext"]["runAsUser"] == 65532


def test_every_pod_the_chart_renders_meets_pod_security_restricted(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    """Pins what already held: with every value set, each pod spec the chart renders (the
    Deployment's; the chart has no Job, hook or DaemonSet, and none may appear without meeting
    this) passes the ``restricted`` Pod Security Standard, checked control by control for
    containers, init containers and ephemeral containers by the test API server's checker."""
    from tests.k8s.cluster.podsecurity import violations

    name, objects = rendered
    templates = {"Deployment", "StatefulSet", "DaemonSet", "Job", "ReplicaSet"}
    specs = [o["spec"]["template"]["spec"] for o in objects if o["kind"] in templates]
    specs += [o["spec"]["jobTemplate"]["spec"]["template"]["spec"] for o in objects if o["kind"] == "CronJob"]
    specs += [o["spec"] for o in objects if o["kind"] == "Pod"]
    assert specs, name
    for spec in specs:
        assert violations(spec) == [], name
    # The checker can fail: the same pod without the pod-level runAsNonRoot and seccomp profile
    # still passes (each container sets both), and one whose container may escalate does not.
    pod = copy.deepcopy(specs[0])
    del pod["securityContext"]["runAsNonRoot"], pod["securityContext"]["seccompProfile"]
    assert violations(pod) == []
    pod["containers"][0]["securityContext"]["allowPrivilegeEscalation"] = True
    assert [v.split(" (")[0] for v in violations(pod)] == ["allowPrivilegeEscalation != false"]


def test_selectors_of_the_pdb_service_and_policy_flag_match_the_controller_pods(
    rendered: tuple[str, list[dict[str, Any]]],
) -> None:
    name, objects = rendered
    labels = one(objects, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert {k: labels[k] for k in SELECTOR} == SELECTOR, "the chart's selector labels always win over podLabels"
    assert one(objects, "Deployment")["spec"]["selector"]["matchLabels"] == SELECTOR
    assert one(objects, "PodDisruptionBudget")["spec"]["selector"]["matchLabels"] == SELECTOR
    assert one(objects, "Service")["spec"]["selector"] == SELECTOR
    args = container_args(objects)
    if name == "network-policy-off":
        assert "--no-network-policy" in args
        assert not [a for a in args if a.startswith("--controller-pod-labels")]
    else:
        assert "--network-policy" in args
        (flag,) = [a for a in args if a.startswith("--controller-pod-labels=")]
        pairs = dict(p.split("=", 1) for p in flag.split("=", 1)[1].split(","))
        assert pairs == SELECTOR


def test_defaults_run_two_leader_elected_replicas_with_the_crd_kept() -> None:
    objects = render()
    deployment = one(objects, "Deployment")
    assert deployment["spec"]["replicas"] == 2
    args = container_args(objects)
    assert "--leader-elect" in args
    assert "--lease-name=spotjob-controller" in args
    assert f"--lease-namespace={NAMESPACE}" in args
    assert "--http-port=8080" in args and "--agent-port=8470" in args and "--log-level=info" in args
    assert "--agent-launcher=direct" in args
    assert not [a for a in args if a.startswith(("--namespace", "--interruption-queue-url", "--aws-region"))]
    assert one(objects, "PodDisruptionBudget")["spec"]["maxUnavailable"] == 1
    assert one(objects, "ServiceAccount")["metadata"].get("annotations") is None
    assert not find(objects, "ServiceMonitor")
    crd = one(objects, "CustomResourceDefinition")
    assert crd["metadata"]["annotations"] == {"helm.sh/resource-policy": "keep"}
    # Spot capacity is avoided by default: the controller must outlive the nodes it watches.
    preferred = deployment["spec"]["template"]["spec"]["affinity"]["nodeAffinity"][
        "preferredDuringSchedulingIgnoredDuringExecution"
    ]
    keys = {e["key"] for term in preferred for e in term["preference"]["matchExpressions"]}
    assert {"karpenter.sh/capacity-type", "eks.amazonaws.com/capacityType", "cloud.google.com/gke-spot"} <= keys


def test_the_crd_is_the_generated_file_itself_not_a_copy() -> None:
    source = yaml.safe_load(CRD_FILE.read_text())
    rendered = one(render(), "CustomResourceDefinition")
    assert rendered["metadata"]["name"] == source["metadata"]["name"] == "spotjobs.spotjob.dev"
    assert rendered["spec"] == source["spec"]
    assert rendered["metadata"]["labels"]["app.kubernetes.io/name"] == "spotjob"
    first_line = CRD_FILE.read_text().splitlines()[0]
    assert first_line.startswith("#") and "python -m orchestrator.crd" in first_line


def test_the_crd_keeps_large_integers_exact(tmp_path: Any) -> None:
    """A fromYaml/toYaml round trip would print 2147483647 as 2.147483647e+09; the chart uses the
    file's text."""
    chart = tmp_path / "spotjob"
    import shutil

    shutil.copytree(CHART, chart)
    crd = chart / "files" / "crds" / "spotjob.dev_spotjobs.yaml"
    indent = " " * 18
    text = crd.read_text()
    bounded = text.replace(f"{indent}minimum: 1\n", f"{indent}minimum: 1\n{indent}maximum: 2147483647\n", 1)
    assert bounded != text
    crd.write_text(bounded)
    proc = helm("template", RELEASE, str(chart), "--namespace", NAMESPACE)
    assert proc.returncode == 0, proc.stderr
    assert "maximum: 2147483647" in proc.stdout


def test_a_crd_file_with_its_own_labels_is_refused_with_the_reason(tmp_path: Any) -> None:
    import shutil

    chart = tmp_path / "spotjob"
    shutil.copytree(CHART, chart)
    crd = chart / "files" / "crds" / "spotjob.dev_spotjobs.yaml"
    crd.write_text(crd.read_text().replace("metadata:\n  name:", "metadata:\n  labels:\n    a: b\n  name:", 1))
    proc = helm("template", RELEASE, str(chart))
    assert proc.returncode != 0
    assert "metadata must hold only the name" in proc.stderr


def test_crds_can_be_left_out_or_not_kept() -> None:
    assert not find(render(VALUE_SETS["no-crds"]), "CustomResourceDefinition")
    crd = one(render(VALUE_SETS["crds-not-kept"]), "CustomResourceDefinition")
    assert "annotations" not in crd["metadata"]


def test_one_replica_runs_without_leader_election_or_lease_rules() -> None:
    objects = render(VALUE_SETS["one-replica"])
    assert one(objects, "Deployment")["spec"]["replicas"] == 1
    args = container_args(objects)
    assert "--no-leader-elect" in args
    assert not [a for a in args if a.startswith("--lease")]
    assert not [r for r in find(objects, "Role") if r["metadata"]["name"].endswith("leader-election")]


def test_two_replicas_without_leader_election_are_refused_naming_the_values() -> None:
    proc = template({"leaderElection": {"enabled": False}})
    assert proc.returncode != 0
    assert "leaderElection.enabled" in proc.stderr and "replicas" in proc.stderr


def test_irsa_annotates_the_service_account_and_passes_the_queue() -> None:
    objects = render(VALUE_SETS["irsa"])
    sa = one(objects, "ServiceAccount")
    assert sa["metadata"]["annotations"] == {"eks.amazonaws.com/role-arn": ROLE_ARN}
    args = container_args(objects)
    assert f"--interruption-queue-url={QUEUE_URL}" in args
    assert "--aws-region=us-east-1" in args


REGIONLESS_QUEUE_URL = "https://sqs.amazonaws.com/111122223333/spotjob-interruptions"


@pytest.mark.parametrize(
    ("values", "env"),
    [
        ({"interruptionQueue": {"url": REGIONLESS_QUEUE_URL, "region": "eu-west-1"}}, {}),
        (
            {
                "interruptionQueue": {"url": REGIONLESS_QUEUE_URL},
                "extraEnv": [{"name": "AWS_REGION", "value": "eu-west-1"}],
            },
            {"AWS_REGION": "eu-west-1"},
        ),
    ],
    ids=["interruptionQueue.region", "AWS_REGION in extraEnv"],
)
def test_a_queue_url_naming_no_region_runs_with_a_region_given_elsewhere(
    values: dict[str, Any], env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("POD_NAMESPACE", NAMESPACE)
    for name in ("AWS_REGION", "AWS_DEFAULT_REGION"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    _, options = parse_options(container_args(render(values)))
    assert options.interruption_queue_url == REGIONLESS_QUEUE_URL


def test_a_queue_url_naming_no_region_without_one_is_refused_naming_the_value() -> None:
    """The controller would exit 2 at start (no region for SQS): a crash-looping install."""
    for url in (REGIONLESS_QUEUE_URL, "http://localhost:9324/000000000000/q"):
        proc = template({"interruptionQueue": {"url": url}})
        assert proc.returncode != 0, url
        assert "interruptionQueue.region" in proc.stderr and url in proc.stderr


def test_a_region_that_contradicts_the_queue_urls_is_refused_as_the_controller_refuses_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """interruptionQueue.region eu-west-1 with a us-east-1 queue URL rendered, and the controller
    read the queue at eu-west-1's endpoint (every receive failed); it now refuses the pair at start
    (exit 2), and the render refuses it first, naming both. The region the URL names itself renders."""
    proc = template({"interruptionQueue": {"url": QUEUE_URL, "region": "eu-west-1"}})
    assert proc.returncode != 0
    said = f'interruptionQueue.region "eu-west-1" is not the region of interruptionQueue.url "{QUEUE_URL}" (us-east-1)'
    assert said in proc.stderr, proc.stderr
    monkeypatch.setenv("POD_NAMESPACE", NAMESPACE)
    args = container_args(render({"interruptionQueue": {"url": QUEUE_URL, "region": "us-east-1"}}))
    parse_options(args)
    args[args.index("--aws-region=us-east-1")] = "--aws-region=eu-west-1"  # what the render refuses
    with pytest.raises(SystemExit) as exited:
        parse_options(args)
    assert exited.value.code == 2


@pytest.mark.parametrize(
    "url",
    [
        QUEUE_URL,
        "https://eu-west-1.queue.amazonaws.com/111122223333/q",  # legacy: refused as naming no region
        "https://queue.amazonaws.com/111122223333/q",  # legacy us-east-1
        "https://sqs-fips.us-gov-west-1.amazonaws.com/111122223333/q",
        "https://vpce-0abc-1xyz.sqs.ap-southeast-2.vpce.amazonaws.com/111122223333/q",
        "https://sqs.cn-north-1.amazonaws.com.cn/111122223333/q",
        "http://sqs.localhost:9324/000000000000/q",
    ],
)
def test_the_chart_reads_a_queue_urls_region_as_the_controller_reads_it(url: str) -> None:
    """A region that is not the URL's is refused naming the URL's, the one ``region_of`` finds; a URL
    naming none is refused for want of one (the controller's check at start, said at install)."""
    proc = template({"interruptionQueue": {"url": url, "region": "zz-nowhere-9"}})
    url_region = region_of(url)
    if url_region is None:
        assert proc.returncode == 0, proc.stderr
        refused = template({"interruptionQueue": {"url": url}})
        assert refused.returncode != 0 and "names no AWS region" in refused.stderr
    else:
        assert proc.returncode != 0
        assert f'is not the region of interruptionQueue.url "{url}" ({url_region})' in proc.stderr, proc.stderr
        assert template({"interruptionQueue": {"url": url}}).returncode == 0


def test_workload_identity_annotates_the_service_account() -> None:
    sa = one(render(VALUE_SETS["workload-identity"]), "ServiceAccount")
    assert sa["metadata"]["annotations"] == {"iam.gke.io/gcp-service-account": GSA}


def test_the_service_monitor_scrapes_the_metrics_service() -> None:
    objects = render(VALUE_SETS["servicemonitor"])
    monitor = one(objects, "ServiceMonitor")
    service = one(objects, "Service")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["labels"]["release"] == "prometheus"
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    selector = monitor["spec"]["selector"]["matchLabels"]
    assert selector.items() <= service["metadata"]["labels"].items()
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]}
    assert endpoint["path"] == "/metrics"
    assert set(monitor["spec"]) == {"namespaceSelector", "selector", "endpoints"}
    assert set(endpoint) == {"port", "path", "interval", "scrapeTimeout", "honorLabels"}
    # The Service forwards to the container port the controller serves /metrics on.
    (container,) = one(objects, "Deployment")["spec"]["template"]["spec"]["containers"]
    assert service["spec"]["ports"][0]["targetPort"] == container["ports"][0]["name"]


def test_the_service_monitor_keeps_the_jobs_namespace_label_the_controller_exposes() -> None:
    """The per-job series (``spotjob_job_goodput_ratio{namespace,name}``, ...) carry the SpotJob's
    namespace as ``namespace``. A ServiceMonitor adds its own target label ``namespace`` (the
    controller's), and without ``honorLabels`` Prometheus renames the scraped one to
    ``exported_namespace``: every job's series arrived labelled ``namespace="spotjob-system"``, and
    a query for a job by its namespace (as the README's table documents the label) found nothing.
    The exposed label now wins."""
    (endpoint,) = one(render(VALUE_SETS["servicemonitor"]), "ServiceMonitor")["spec"]["endpoints"]
    assert endpoint["honorLabels"] is True


def test_a_service_monitor_without_the_service_is_refused() -> None:
    proc = template({"metrics": {"service": {"enabled": False}, "serviceMonitor": {"enabled": True}}})
    assert proc.returncode != 0
    assert "metrics.service.enabled" in proc.stderr


def test_the_everything_value_set_reaches_the_pod() -> None:
    objects = render(VALUE_SETS["everything"])
    pod = one(objects, "Deployment")["spec"]["template"]
    spec = pod["spec"]
    assert spec["containers"][0]["image"] == "spotjob/spotjob-controller@sha256:" + "a" * 64
    assert spec["imagePullSecrets"] == [{"name": "regcred"}]
    assert spec["priorityClassName"] == "system-cluster-critical"
    assert spec["nodeSelector"] == {"kubernetes.io/os": "linux"}
    assert spec["affinity"] == VALUE_SETS["everything"]["affinity"]
    assert "runAsUser" not in spec["securityContext"] and "runAsGroup" not in spec["securityContext"]
    assert pod["metadata"]["labels"]["team"] == "ml-platform"
    assert pod["metadata"]["labels"]["app.kubernetes.io/name"] == "spotjob"
    assert pod["metadata"]["annotations"] == {"example.com/team": "ml-platform"}
    args = container_args(objects)
    assert args[-1] == "--rebalance=flush"
    assert "--lease-namespace=kube-system" in args and "--lease-name=spotjob-leader" in args
    lease_role = one(objects, "Role", f"{RELEASE}-leader-election")
    assert lease_role["metadata"]["namespace"] == "kube-system"
    assert {"name": "AWS_STS_REGIONAL_ENDPOINTS", "value": "regional"} in spec["containers"][0]["env"]
    assert not [r for r in find(objects, "ClusterRole") if r["metadata"]["name"].endswith(("-view", "-edit"))]


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_the_controller_accepts_the_flags_the_chart_renders(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The container's args, parsed by the controller's own parser (a flag it refuses exits 2: a
    crash-looping install that `helm install` reported as deployed)."""
    monkeypatch.setenv("POD_NAMESPACE", NAMESPACE)  # the downward API's, as the Deployment sets it
    values = VALUE_SETS[name]
    args = container_args(render(values))
    try:
        _, options = parse_options(args)
    except SystemExit as e:
        raise AssertionError(f"spotjob-controller exits {e.code} on the args the chart renders: {args}") from None
    assert options.leader_elect == values.get("leaderElection", {}).get("enabled", True)
    assert options.namespaces == tuple(values.get("watchNamespaces", ()))
    assert options.network_policy == values.get("networkPolicy", {}).get("enabled", True)
    assert options.interruption_queue_url == (values.get("interruptionQueue", {}).get("url") or None)


def test_an_identity_for_a_service_account_the_chart_does_not_create_is_refused() -> None:
    for identity in (
        {"aws": {"roleArn": ROLE_ARN}},
        {"gcp": {"serviceAccount": GSA}},
        {"annotations": {"example.com/owner": "ml-platform"}},
    ):
        proc = template({"serviceAccount": {"create": False, "name": "spotjob-controller", **identity}})
        assert proc.returncode != 0, f"{identity} was ignored"
        assert "serviceAccount.create is false" in proc.stderr, proc.stderr
    objects = render({"serviceAccount": {"create": False, "name": "spotjob-controller"}})
    assert not find(objects, "ServiceAccount")
    assert one(objects, "Deployment")["spec"]["template"]["spec"]["serviceAccountName"] == "spotjob-controller"


DNS_LABEL = re.compile(r"^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$")
DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")


@pytest.mark.parametrize(
    ("release", "values"),
    [
        ("a" * 53, {}),  # the longest release name helm accepts
        ("team-a", {"fullnameOverride": "f" * 63}),
    ],
    ids=["long-release-name", "long-fullname-override"],
)
def test_object_names_stay_valid_with_the_longest_names(release: str, values: dict[str, Any], tmp_path: Any) -> None:
    """The API server checks name lengths, not kubernetes-validate: a Service is named by a DNS
    label (63 characters), everything else here by a DNS subdomain (253)."""
    values_file = tmp_path / "values.yaml"
    values_file.write_text(yaml.safe_dump(values))
    proc = helm(
        "template",
        release,
        str(CHART),
        "--namespace",
        NAMESPACE,
        "-f",
        str(values_file),
        "--set",
        "metrics.serviceMonitor.enabled=true",
    )
    assert proc.returncode == 0, proc.stderr
    for obj in (o for o in yaml.safe_load_all(proc.stdout) if o):
        name = obj["metadata"]["name"]
        pattern = DNS_LABEL if obj["kind"] == "Service" else DNS_SUBDOMAIN
        assert pattern.match(name), f"{obj['kind']} name {name!r} ({len(name)} characters) is invalid"
    notes = helm("install", release, str(CHART), "--namespace", NAMESPACE, "-f", str(values_file), "--dry-run=client")
    assert notes.returncode == 0, notes.stderr
    services = [o["metadata"]["name"] for o in yaml.safe_load_all(proc.stdout) if o and o["kind"] == "Service"]
    assert f"port-forward service/{services[0]} " in notes.stdout


@pytest.fixture(scope="module")
def default_install(helm_bin: str) -> subprocess.CompletedProcess[str]:
    """``helm install --dry-run=client`` with the defaults: the notes tests only read it."""
    return helm("install", RELEASE, str(CHART), "--namespace", NAMESPACE, "--dry-run=client")


def test_notes_say_where_the_alerts_are_or_how_to_turn_them_on(
    default_install: subprocess.CompletedProcess[str],
) -> None:
    off = default_install
    assert off.returncode == 0, off.stderr
    assert "set metrics.prometheusRule.enabled" in off.stdout.split("NOTES:", 1)[1]
    on = helm(
        "install", RELEASE, str(CHART), "--namespace", NAMESPACE, "--dry-run=client",
        "--set", "metrics.prometheusRule.enabled=true", "--set", "metrics.serviceMonitor.enabled=true",
    )  # fmt: skip
    assert on.returncode == 0, on.stderr
    notes = on.stdout.split("NOTES:", 1)[1]
    assert f"kubectl -n {NAMESPACE} get prometheusrules" in notes and "set metrics.prometheusRule" not in notes


def test_notes_tell_how_to_check_the_install(default_install: subprocess.CompletedProcess[str]) -> None:
    proc = default_install
    assert proc.returncode == 0, proc.stderr
    notes = proc.stdout.split("NOTES:", 1)[1]
    assert "kubectl get sj" in notes
    assert "kubectl spotjob status" in notes
    assert f"rollout status deployment/{RELEASE}" in notes


def test_extra_labels_that_the_chart_sets_itself_are_written_once() -> None:
    """metrics.serviceMonitor.labels, metrics.prometheusRule.labels and .alertLabels were written
    after the chart's own labels: a key in both (the severity values.yaml says alertLabels may
    replace, app.kubernetes.io/name) came out twice in one mapping, which YAML forbids and kustomize
    refuses ("mapping key ... already defined"); PyYAML and helm kept the last without a word.
    ``render`` refuses such a manifest; the chart's own labels win, except the alerts' severity."""
    values = {
        "metrics": {
            "serviceMonitor": {"enabled": True, "labels": {"app.kubernetes.io/name": "other", "release": "prom"}},
            "prometheusRule": {
                "enabled": True,
                "labels": {"app.kubernetes.io/instance": "other", "release": "prom"},
                "alertLabels": {"severity": "page", "team": "ml"},
            },
        }
    }
    objects = render(values)
    for kind in ("ServiceMonitor", "PrometheusRule"):
        labels = one(objects, kind)["metadata"]["labels"]
        assert labels["release"] == "prom", kind
        assert labels["app.kubernetes.io/name"] == "spotjob" and labels["app.kubernetes.io/instance"] == RELEASE, kind
    for group in one(objects, "PrometheusRule")["spec"]["groups"]:
        for rule in group["rules"]:
            assert rule["labels"] == {"severity": "page", "team": "ml"}, rule["alert"]


def _template_as(
    release: str, values: dict[str, Any], tmp_path: Any, namespace: str = NAMESPACE
) -> subprocess.CompletedProcess[str]:
    values_file = tmp_path / "values.yaml"
    values_file.write_text(yaml.safe_dump(values))
    return helm("template", release, str(CHART), "--namespace", namespace, "-f", str(values_file))


def test_names_and_labels_that_yaml_reads_as_numbers_or_booleans_stay_strings(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    """helm takes a release named 123, and the values below are valid names, but they were written
    unquoted: YAML read them as a number or a boolean, every object carrying the instance label was
    invalid, and --controller-pod-labels said ``app.kubernetes.io/instance=%!s(float64=123)`` (the
    controller exits 2 on it)."""
    values = {
        "priorityClassName": "true",
        "serviceAccount": {"name": "1234"},
        "metrics": {"service": {"enabled": False}},  # a Service cannot be named after 123: below
    }
    proc = _template_as("123", values, tmp_path)
    assert proc.returncode == 0, proc.stderr
    objects = [o for o in yaml.safe_load_all(proc.stdout) if o]
    for obj in objects:
        _validate(obj)
    pod = one(objects, "Deployment")["spec"]["template"]
    assert pod["metadata"]["labels"]["app.kubernetes.io/instance"] == "123"
    assert pod["spec"]["priorityClassName"] == "true"
    assert pod["spec"]["serviceAccountName"] == "1234"
    assert one(objects, "ServiceAccount")["metadata"]["name"] == "1234"
    monkeypatch.setenv("POD_NAMESPACE", NAMESPACE)
    _, options = parse_options(container_args(objects))
    assert dict(options.controller_pod_labels)["app.kubernetes.io/instance"] == "123"
    monitor_values = {"metrics": {"serviceMonitor": {"enabled": True}}, "fullnameOverride": "spotjob"}
    monitor = _template_as("2024", monitor_values, tmp_path, namespace="2025")
    assert monitor.returncode == 0, monitor.stderr
    sm = one([o for o in yaml.safe_load_all(monitor.stdout) if o], "ServiceMonitor")
    assert sm["spec"]["selector"]["matchLabels"]["app.kubernetes.io/instance"] == "2024"
    assert sm["spec"]["namespaceSelector"]["matchNames"] == ["2025"]


@pytest.mark.parametrize("release", ["123", "1st-team", "spotjob.prod"])
def test_a_release_name_that_cannot_name_the_metrics_service_is_refused_naming_the_way_out(
    release: str, tmp_path: Any
) -> None:
    """A Service's name must start with a letter and hold no dot; helm's release names may do
    both. The API server refused the Service after creating the rest of the release."""
    proc = _template_as(release, {}, tmp_path)
    assert proc.returncode != 0
    assert f'release name "{release}"' in proc.stderr and "set fullnameOverride" in proc.stderr, proc.stderr
    fixed = _template_as(release, {"fullnameOverride": "spotjob"}, tmp_path)
    assert fixed.returncode == 0, fixed.stderr
    assert one([o for o in yaml.safe_load_all(fixed.stdout) if o], "Service")["metadata"]["name"] == "spotjob-metrics"
