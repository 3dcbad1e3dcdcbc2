"""values.yaml and values.schema.json: every key documented and typed, unknown keys nowhere
allowed, and a misspelt or wrongly typed value refused by helm with the key named."""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema
import pytest
import yaml
from infra_support import CHART, NAMESPACE, RELEASE, helm, load_all, render, template

SCHEMA = json.loads((CHART / "values.schema.json").read_text())
VALUES_TEXT = (CHART / "values.yaml").read_text()
DEFAULTS = yaml.safe_load(VALUES_TEXT)

# Kubernetes objects passed through as they are: Kubernetes' own schema checks them when rendered
# (kubernetes-validate, strict), and helm's `global` belongs to parent charts.
FREE_FORM = {
    "/global",
    "/affinity/nodeAffinity",
    "/affinity/podAffinity",
    "/affinity/podAntiAffinity",
    "/extraEnv/items/valueFrom",
    "/topologySpreadConstraints/items/labelSelector",
}


def _objects(schema: dict[str, Any], path: str = "") -> list[tuple[str, dict[str, Any]]]:
    found = []
    if schema.get("type") == "object" or "properties" in schema:
        found.append((path, schema))
    for key, sub in schema.get("properties", {}).items():
        found += _objects(sub, f"{path}/{key}")
    if isinstance(schema.get("items"), dict):
        found += _objects(schema["items"], f"{path}/items")
    for sub in schema.get("anyOf", []):
        found += _objects(sub, path)
    return found


def test_every_object_in_the_schema_refuses_unknown_keys() -> None:
    for path, node in _objects(SCHEMA):
        if path in FREE_FORM:
            continue
        extra = node.get("additionalProperties")
        assert extra is False or isinstance(extra, dict), f"{path or '/'} lets unknown keys through"
        if isinstance(extra, dict):  # a map: its values are typed
            assert extra.get("type") or extra.get("anyOf"), path
        if "patternProperties" in node:
            assert extra is False, path


def _keys(values: Any, path: str = "") -> list[str]:
    out = []
    if isinstance(values, dict):
        for k, v in values.items():
            out.append(f"{path}.{k}" if path else k)
            out += _keys(v, f"{path}.{k}" if path else k)
    return out


def test_every_key_of_values_yaml_is_in_the_schema_and_the_defaults_pass_it() -> None:
    jsonschema.Draft7Validator(SCHEMA).validate(DEFAULTS)
    for key in _keys(DEFAULTS):
        node: dict[str, Any] = SCHEMA
        for part in key.split("."):
            props = node.get("properties", {})
            if part in props:
                node = props[part]
            else:
                extra = node.get("additionalProperties")
                patterns = node.get("patternProperties", {})
                assert isinstance(extra, dict) or any(re.match(p, part) for p in patterns), f"{key} not in the schema"
                node = extra if isinstance(extra, dict) else next(iter(patterns.values()))
        assert node.get("type") or node.get("anyOf"), f"{key} has no type in the schema"


def test_every_key_of_values_yaml_has_a_comment_above_it() -> None:
    lines = VALUES_TEXT.splitlines()
    keyed = 0
    for i, line in enumerate(lines):
        if not re.match(r"^\s*[A-Za-z][A-Za-z0-9]*:", line):
            continue
        keyed += 1
        above = lines[i - 1].strip() if i else ""
        assert above.startswith("#"), f"values.yaml line {i + 1} ({line.strip()}) has no comment above it"
    assert keyed == len(_keys(DEFAULTS))


MISSPELT = [
    ("replicass=3", "replicass"),
    ("crds.enable=false", "enable"),
    ("serviceAccount.aws.rolearn=x", "rolearn"),
    ("metrics.serviceMonitor.enabeld=true", "enabeld"),
    ("networkPolicy.enable=false", "enable"),
    ("interruptionQueue.URL=x", "URL"),
    ("leaderElection.leaseNamespce=x", "leaseNamespce"),
    ("resources.request.cpu=1", "request"),
]


@pytest.mark.parametrize(("setting", "key"), MISSPELT)
def test_a_misspelt_key_fails_helm_template_naming_it(setting: str, key: str) -> None:
    proc = template(None, "--set", setting)
    assert proc.returncode != 0
    assert f"'{key}' not allowed" in proc.stderr, proc.stderr


WRONG_TYPES = [
    ({"replicas": "two"}, "/replicas"),
    ({"replicas": 0}, "/replicas"),
    ({"crds": {"enabled": "yes"}}, "/crds/enabled"),
    ({"watchNamespaces": "ml-training"}, "/watchNamespaces"),
    ({"watchNamespaces": ["Not_A_Namespace"]}, "/watchNamespaces/0"),
    ({"httpPort": 70000}, "/httpPort"),
    ({"agentLauncher": "fast"}, "/agentLauncher"),
    ({"serviceAccount": {"aws": {"roleArn": "spotjob-controller"}}}, "/serviceAccount/aws/roleArn"),
    ({"serviceAccount": {"gcp": {"serviceAccount": "controller@example.com"}}}, "/serviceAccount/gcp/serviceAccount"),
    ({"logLevel": "verbose"}, "/logLevel"),
    ({"logFormat": "xml"}, "/logFormat"),
    ({"image": {"digest": "latest"}}, "/image/digest"),
    ({"tolerations": [{"key": "a", "operater": "Exists"}]}, "/tolerations/0"),
    ({"resources": {"limits": {"memory": "lots"}}}, "/resources/limits/memory"),
    ({"extraArgs": ["leader-elect"]}, "/extraArgs/0"),
    ({"podDisruptionBudget": {"maxUnavailable": "half"}}, "/podDisruptionBudget/maxUnavailable"),
    # 0 would block every drain of the controller's nodes (and node group upgrades with them).
    ({"podDisruptionBudget": {"maxUnavailable": 0}}, "/podDisruptionBudget/maxUnavailable"),
    ({"podDisruptionBudget": {"maxUnavailable": "0%"}}, "/podDisruptionBudget/maxUnavailable"),
    # The controller refuses a queue URL without the account and queue (it would crash-loop, exit 2).
    ({"interruptionQueue": {"url": "https://sqs.us-east-1.amazonaws.com/"}}, "/interruptionQueue/url"),
    ({"interruptionQueue": {"url": "https://sqs.us-east-1.amazonaws.com"}}, "/interruptionQueue/url"),
    # They name every object: the API server would refuse them one object at a time.
    ({"fullnameOverride": "My_Controller"}, "/fullnameOverride"),
    ({"nameOverride": "Spot.Job"}, "/nameOverride"),
    # Names of objects the pod refers to: no object can be named so, and the controller pods could
    # never start (a token-key Secret that cannot exist: the pods wait for it to appear).
    ({"agentTokenKey": {"existingSecret": "Agent_Token_Key"}}, "/agentTokenKey/existingSecret"),
    ({"serviceAccount": {"name": "Spotjob Controller"}}, "/serviceAccount/name"),
    ({"priorityClassName": "High_Priority"}, "/priorityClassName"),
    ({"imagePullSecrets": [{"name": "Reg Cred"}]}, "/imagePullSecrets/0/name"),
    # Durations in Prometheus' form only: each unit once, the larger first. "1s1m" and "30s30s"
    # rendered, and the Prometheus Operator refused the ServiceMonitor (its CRD's pattern), PromQL
    # the rule ("not a valid duration string"), after the rest of the release was installed.
    ({"metrics": {"serviceMonitor": {"interval": "1s1m"}}}, "/metrics/serviceMonitor/interval"),
    ({"metrics": {"serviceMonitor": {"scrapeTimeout": "5s5s"}}}, "/metrics/serviceMonitor/scrapeTimeout"),
    ({"metrics": {"serviceMonitor": {"interval": "-30s"}}}, "/metrics/serviceMonitor/interval"),
    ({"metrics": {"serviceMonitor": {"interval": ""}}}, "/metrics/serviceMonitor/interval"),
    (
        {"metrics": {"prometheusRule": {"thresholds": {"reconcileErrorsWindow": "30m1h"}}}},
        "/metrics/prometheusRule/thresholds/reconcileErrorsWindow",
    ),
    # Label values the API server refuses: they rendered, and `helm install` failed on the object
    # (the Deployment, the ServiceMonitor) after the CRD, the RBAC and the Secret were created.
    ({"podLabels": {"team": "ML Platform"}}, "/podLabels/team"),
    ({"podLabels": {"cost-center": "x" * 64}}, "/podLabels/cost-center"),
    ({"podLabels": {"owner": "-ml"}}, "/podLabels/owner"),
    (
        {"nodeSelector": {"node.kubernetes.io/instance-type": "m5.large,"}},
        "/nodeSelector/node.kubernetes.io~1instance-type",
    ),
    (
        {"metrics": {"serviceMonitor": {"labels": {"release": "kube prometheus"}}}},
        "/metrics/serviceMonitor/labels/release",
    ),
    ({"metrics": {"prometheusRule": {"labels": {"release": "prom/stack"}}}}, "/metrics/prometheusRule/labels/release"),
    ({"tolerations": [{"key": "gpu", "value": "nvidia a100"}]}, "/tolerations/0/value"),
    # Names the API server refuses in every Kubernetes release the chart supports.
    ({"extraEnv": [{"name": "AWS REGION", "value": "x"}]}, "/extraEnv/0/name"),
    ({"extraEnv": [{"name": "1WORKERS", "value": "8"}]}, "/extraEnv/0/name"),
    ({"extraEnv": [{"name": "WORKERS=8"}]}, "/extraEnv/0/name"),
]


@pytest.mark.parametrize(("values", "path"), WRONG_TYPES, ids=[p for _, p in WRONG_TYPES])
def test_a_wrongly_typed_value_fails_helm_template_naming_it(values: dict[str, Any], path: str) -> None:
    proc = template(values)
    assert proc.returncode != 0
    assert f"at '{path}'" in proc.stderr, proc.stderr


def test_a_misspelt_key_fails_helm_install_too() -> None:
    proc = helm("install", RELEASE, str(CHART), "--namespace", NAMESPACE, "--dry-run=client", "--set", "replicass=3")
    assert proc.returncode != 0
    assert "'replicass' not allowed" in proc.stderr


@pytest.mark.parametrize(
    ("interval", "timeout"),
    [("30s", "1m"), ("15s", "15001ms"), ("1m", "1m30s")],
)
def test_a_scrape_timeout_longer_than_the_interval_fails_helm_template(interval: str, timeout: str) -> None:
    """values.yaml says the timeout is at most the interval; Prometheus refuses a scrape config whose
    timeout is longer. The chart rendered it anyway, for the Prometheus Operator to reject later."""
    monitor = {"enabled": True, "interval": interval, "scrapeTimeout": timeout}
    proc = template({"metrics": {"serviceMonitor": monitor}})
    assert proc.returncode != 0
    assert f"metrics.serviceMonitor.scrapeTimeout {timeout} is longer than its interval {interval}" in proc.stderr


@pytest.mark.parametrize(
    ("monitor", "said"),
    [
        ({"interval": "0s", "scrapeTimeout": "0s"}, "metrics.serviceMonitor.interval 0s is zero"),
        ({"interval": "0h0m"}, "metrics.serviceMonitor.interval 0h0m is zero"),
        ({"scrapeTimeout": "0ms"}, "metrics.serviceMonitor.scrapeTimeout 0ms is zero"),
    ],
)
def test_a_zero_scrape_interval_or_timeout_fails_helm_template_naming_it(monitor: dict[str, str], said: str) -> None:
    """0s is of the duration form the schema takes, and rendered: Prometheus reads a zero as unset
    and scrapes at its global interval, or times out at its global timeout (and refuses its whole
    configuration when that is longer than the interval), not at what the value says."""
    proc = template({"metrics": {"serviceMonitor": {"enabled": True, **monitor}}})
    assert proc.returncode != 0
    assert said in proc.stderr, proc.stderr
    assert "give a duration above zero" in proc.stderr


@pytest.mark.parametrize("window", ["flushFailureWindow", "reconcileErrorsWindow", "interruptionQueueErrorsWindow"])
def test_a_zero_alert_window_fails_helm_template_naming_it(window: str) -> None:
    """The windows are PromQL ranges (increase(...[W])): a zero one rendered, and the whole
    PrometheusRule was refused ("duration must be greater than 0"). A zero `for` stays valid."""
    rule = {"enabled": True, "selector": 'job="spotjob"', "thresholds": {window: "0m", "failedFor": "0s"}}
    proc = template({"metrics": {"prometheusRule": rule}})
    assert proc.returncode != 0
    assert f"metrics.prometheusRule.thresholds.{window} 0m is zero" in proc.stderr, proc.stderr
    rule["thresholds"][window] = "1h30m"
    render({"metrics": {"prometheusRule": rule}})


def test_a_scrape_timeout_up_to_the_interval_renders() -> None:
    """Pins what already worked: a timeout equal to the interval, in other units, is accepted."""
    monitor = {"enabled": True, "interval": "1m", "scrapeTimeout": "60000ms"}
    objects = render({"metrics": {"serviceMonitor": monitor}})
    [sm] = [o for o in objects if o["kind"] == "ServiceMonitor"]
    assert sm["spec"]["endpoints"][0]["scrapeTimeout"] == "60000ms"


@pytest.mark.parametrize(
    ("arg", "value"),
    [
        ("--http-port=9090", "httpPort"),
        ("--no-leader-elect", "leaderElection.enabled"),
        ("--namespace=ml", "watchNamespaces"),
        ("--agent-token-key-file=/key", "agentTokenKey.existingSecret"),
        ("--log-level", "logLevel"),
        ("--log-format=json", "logFormat"),
        ("--http=9090", "httpPort"),  # argparse takes an unambiguous prefix for the whole flag
    ],
)
def test_extra_args_cannot_repeat_a_flag_the_chart_sets_from_a_value(arg: str, value: str) -> None:
    """extraArgs come after the chart's own flags, and the last one wins: --http-port=9090 moved the
    controller off the port its probes, containerPort and Service use (a crash loop), and
    --no-leader-elect ran two leaders, past the check that refuses replicas > 1 without election."""
    proc = template({"extraArgs": [arg]})
    assert proc.returncode != 0
    assert f"extraArgs: {arg} repeats a flag the chart sets from {value}" in proc.stderr, proc.stderr


@pytest.mark.parametrize(
    ("arg", "said"),
    [
        ("--controller-namespace=ml", "the per-job NetworkPolicies let the controller in from"),
        ("--controller-name=ml", "the per-job NetworkPolicies let the controller in from"),  # a prefix
        ("--version", "restart it for ever"),
        ("--help", "restart it for ever"),
    ],
)
def test_extra_args_refuse_the_flags_that_break_the_release_though_no_value_stands_for_them(
    arg: str, said: str
) -> None:
    """--controller-namespace overrode the release's namespace, so the per-job NetworkPolicies let
    the wrong namespace's pods in; --version and --help made the controller exit 0 at once, and the
    Deployment restarted it in a loop. Both rendered without a word."""
    proc = template({"extraArgs": [arg]})
    assert proc.returncode != 0
    assert f"extraArgs: {arg} (" in proc.stderr and said in proc.stderr, proc.stderr


def test_extra_args_may_carry_the_flags_the_chart_does_not_model() -> None:
    """Pins what already worked: --workers, --rebalance and the lease timings pass through."""
    args = ["--workers=8", "--rebalance=flush", "--node-lost-grace-seconds=120", "--leader-elect-lease-duration=30"]
    [deployment] = [o for o in render({"extraArgs": args}) if o["kind"] == "Deployment"]
    assert deployment["spec"]["template"]["spec"]["containers"][0]["args"][-4:] == args


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("SPOTJOB_LOG_LEVEL", "logLevel"),
        ("SPOTJOB_LOG_FORMAT", "logFormat"),
        ("SPOTJOB_NAMESPACES", "watchNamespaces"),
        ("SPOTJOB_INTERRUPTION_QUEUE_URL", "interruptionQueue.url"),
        ("POD_NAMESPACE", "the downward API"),
    ],
)
def test_extra_env_cannot_set_what_the_chart_sets(name: str, value: str) -> None:
    """A flag wins over its variable, and the chart passes the flags: SPOTJOB_LOG_LEVEL=debug in
    extraEnv was ignored without a word (--log-level=info). SPOTJOB_NAMESPACES and the queue URL
    took effect, but without the Roles or the Node patch permission the chart grants from the
    values; POD_NAMESPACE, listed after the chart's own, replaced the downward API's."""
    proc = template({"extraEnv": [{"name": name, "value": "x"}]})
    assert proc.returncode != 0
    assert f"extraEnv: {name} is set by the chart from {value}" in proc.stderr, proc.stderr


def test_extra_env_may_carry_what_the_chart_does_not_set() -> None:
    """Pins what already worked: AWS_REGION, SPOTJOB_WORKERS and the like pass through."""
    env = [{"name": "AWS_REGION", "value": "eu-west-1"}, {"name": "SPOTJOB_WORKERS", "value": "8"}]
    [deployment] = [o for o in render({"extraEnv": env}) if o["kind"] == "Deployment"]
    assert deployment["spec"]["template"]["spec"]["containers"][0]["env"][-2:] == env


@pytest.mark.parametrize(
    ("env", "said"),
    [
        (
            {"name": "TOKEN", "value": "x", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}},
            "extraEnv: TOKEN has both value and valueFrom",
        ),
        (
            {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}, "fieldRef": {"fieldPath": "x"}}},
            "extraEnv: TOKEN has valueFrom with 2 sources (fieldRef, secretKeyRef)",
        ),
        ({"name": "TOKEN", "valueFrom": {}}, "extraEnv: TOKEN has valueFrom with 0 sources"),
    ],
)
def test_an_extra_env_the_api_server_refuses_is_refused_naming_it(env: dict[str, Any], said: str) -> None:
    """Each field passes the schema; the API server refused the Deployment (value and valueFrom are
    exclusive, and a valueFrom has exactly one source) after the rest of the release was created."""
    proc = template({"extraEnv": [env]})
    assert proc.returncode != 0
    assert said in proc.stderr, proc.stderr


def test_extra_env_from_one_source_renders() -> None:
    """Pins what already worked: a variable from a Secret, a name with '.' and '-', an empty value,
    and an empty value beside a valueFrom (the API server takes that: only a non-empty one it
    refuses there)."""
    env = [
        {"name": "AWS_ACCESS_KEY_ID", "valueFrom": {"secretKeyRef": {"name": "aws", "key": "id"}}},
        {"name": "my.setting-x", "value": ""},
        {"name": "POD_IP", "value": "", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
    ]
    [deployment] = [o for o in render({"extraEnv": env}) if o["kind"] == "Deployment"]
    assert deployment["spec"]["template"]["spec"]["containers"][0]["env"][-3:] == env


@pytest.mark.parametrize(
    ("values", "said"),
    [
        ({"podLabels": {"Team Name": "ml"}}, 'podLabels: "Team Name" is no label key'),
        ({"podLabels": {"team-": "ml"}}, 'podLabels: "team-" is no label key'),
        ({"podLabels": {"c" * 64: "ml"}}, "podLabels: "),
        ({"podLabels": {"Example.com/team": "ml"}}, 'its prefix "Example.com" is not a DNS subdomain'),
        ({"podLabels": {"a/b/team": "ml"}}, "it has more than one '/'"),
        ({"podLabels": {"/team": "ml"}}, 'its prefix "" is not a DNS subdomain'),
        ({"podLabels": {"example.com/": "ml"}}, 'its name "" is not 1 to 63'),
        ({"podLabels": {"x" * 254 + "/team": "ml"}}, "is not a DNS subdomain"),
        ({"nodeSelector": {"node pool": "gpu"}}, 'nodeSelector: "node pool" is no label key'),
        (
            {"podAnnotations": {"prometheus.io scrape": "true"}},
            'podAnnotations: "prometheus.io scrape" is no annotation key',
        ),
        ({"serviceAccount": {"annotations": {"owner team": "ml"}}}, 'serviceAccount.annotations: "owner team"'),
        ({"metrics": {"service": {"annotations": {"a b": "x"}}}}, 'metrics.service.annotations: "a b"'),
        (
            {"metrics": {"serviceMonitor": {"labels": {"Release Name": "x"}}}},
            'metrics.serviceMonitor.labels: "Release Name"',
        ),
        ({"metrics": {"prometheusRule": {"labels": {"a b": "x"}}}}, 'metrics.prometheusRule.labels: "a b"'),
        ({"metrics": {"prometheusRule": {"annotations": {"a b": "x"}}}}, 'metrics.prometheusRule.annotations: "a b"'),
        (
            {"tolerations": [{"key": "nvidia gpu", "operator": "Exists"}]},
            'tolerations[0].key: "nvidia gpu" is no taint key',
        ),
        (
            {
                "topologySpreadConstraints": [
                    {"maxSkew": 1, "topologyKey": "zone name", "whenUnsatisfiable": "DoNotSchedule"}
                ]
            },
            'topologySpreadConstraints[0].topologyKey: "zone name" is no label key',
        ),
        (
            {
                "topologySpreadConstraints": [
                    {
                        "maxSkew": 1,
                        "topologyKey": "topology.kubernetes.io/zone",
                        "whenUnsatisfiable": "ScheduleAnyway",
                        "matchLabelKeys": ["pod-template-hash", "Pod Template"],
                    }
                ]
            },
            'topologySpreadConstraints[0].matchLabelKeys[1]: "Pod Template" is no label key',
        ),
    ],
)
def test_a_label_or_annotation_key_the_api_server_refuses_is_refused_naming_it(
    values: dict[str, Any], said: str
) -> None:
    """These rendered, and `helm install` failed on the object that carries them (the Deployment,
    the ServiceAccount, the Service...) after the CRD, the RBAC and the Secret were created."""
    proc = template(values)
    assert proc.returncode != 0
    assert said in proc.stderr, proc.stderr
    assert "is no " in proc.stderr and "Use a key such as" in proc.stderr, proc.stderr


def test_labels_and_annotations_the_api_server_takes_render() -> None:
    """Pins what already worked: prefixed keys, '_' and '.' inside, an empty value, 63 characters."""
    labels = {"example.com/team": "ml_platform.v2", "cost-center": "", "Owner": "a" * 63, "x" * 63: "ml"}
    selector = {"karpenter.sh/capacity-type": "on-demand", "node.kubernetes.io/instance-type": "m5.large"}
    annotations = {"prometheus.io/scrape": "true", "a" * 253 + "/note": "any text, spaces and all"}
    values = {
        "podLabels": labels,
        "nodeSelector": selector,
        "podAnnotations": annotations,
        "tolerations": [{"key": "nvidia.com/gpu", "value": "A100_80GB", "effect": "NoSchedule"}],
    }
    [deployment] = [o for o in render(values) if o["kind"] == "Deployment"]
    pod = deployment["spec"]["template"]
    assert labels.items() <= pod["metadata"]["labels"].items()
    assert pod["metadata"]["annotations"] == annotations
    assert pod["spec"]["nodeSelector"] == selector


@pytest.mark.parametrize("name", ["team name", "9team", "__name__", "team-name"])
def test_an_alert_label_prometheus_refuses_is_refused_naming_it(name: str) -> None:
    """An alert label is a Prometheus label name (letters, digits and '_', no leading digit, no
    leading '__'): the Prometheus Operator refused the rule group after the release was created."""
    rule = {"enabled": True, "alertLabels": {name: "x"}}
    proc = template({"metrics": {"prometheusRule": rule, "serviceMonitor": {"enabled": True}}})
    assert proc.returncode != 0
    assert f'metrics.prometheusRule.alertLabels: "{name}" is no Prometheus label name' in proc.stderr, proc.stderr


def test_spread_constraints_and_alert_labels_prometheus_takes_render() -> None:
    """Pins what already worked: a zone spread matching the pod-template hash, and alert labels
    Prometheus takes."""
    spread = [
        {
            "maxSkew": 1,
            "topologyKey": "topology.kubernetes.io/zone",
            "whenUnsatisfiable": "ScheduleAnyway",
            "matchLabelKeys": ["pod-template-hash"],
        }
    ]
    values = {
        "topologySpreadConstraints": spread,
        "metrics": {
            "prometheusRule": {"enabled": True, "alertLabels": {"team": "ml", "_route": "pager", "Tier2": "x"}},
            "serviceMonitor": {"enabled": True},
        },
    }
    objects = render(values)
    [deployment] = [o for o in objects if o["kind"] == "Deployment"]
    assert deployment["spec"]["template"]["spec"]["topologySpreadConstraints"] == spread
    [rule] = [o for o in objects if o["kind"] == "PrometheusRule"]
    labels = rule["spec"]["groups"][0]["rules"][0]["labels"]
    assert {"team": "ml", "_route": "pager", "Tier2": "x"}.items() <= labels.items()


DIGEST = "sha256:" + "a" * 64


@pytest.mark.parametrize(
    ("image", "named"),
    [
        ({"repository": "registry.example.com/ml/spotjob-controller:0.2.0"}, "image.repository"),
        ({"repository": f"registry.example.com/ml/spotjob-controller@{DIGEST}"}, "image.repository"),
        ({"tag": DIGEST}, "image.tag"),
        ({"tag": "0.2.0 "}, "image.tag"),
        ({"tag": ".hidden"}, "image.tag"),
    ],
)
def test_a_tag_or_digest_in_the_wrong_image_value_is_refused_naming_it(image: dict[str, str], named: str) -> None:
    """The chart writes repository:tag (or repository@digest): a repository with its own tag
    rendered registry.example.com/ml/spotjob-controller:0.2.0:0.1.0, and a digest in the tag
    spotjob/spotjob-controller:sha256:..., references the kubelet refuses (InvalidImageName) after
    `helm install` reported the release deployed."""
    proc = template({"image": image})
    assert proc.returncode != 0
    assert f"{named} {json.dumps(next(iter(image.values())))}" in proc.stderr, proc.stderr
    assert "image.digest" in proc.stderr


@pytest.mark.parametrize(
    ("toleration", "said"),
    [
        ({"operator": "Equal", "value": "true"}, "tolerations[0] has no key, so its operator must be Exists"),
        ({"key": "gpu", "operator": "Exists", "value": "true"}, 'tolerations[0] has operator Exists and value "true"'),
        ({"key": "gpu", "tolerationSeconds": 60}, 'tolerations[0] sets tolerationSeconds with effect ""'),
        (
            {"key": "gpu", "effect": "NoSchedule", "tolerationSeconds": 60},
            'tolerations[0] sets tolerationSeconds with effect "NoSchedule"',
        ),
    ],
)
def test_a_toleration_the_api_server_refuses_is_refused_naming_it(toleration: dict[str, Any], said: str) -> None:
    """Each field passes the schema, the combination does not pass the API server's validation of
    the Deployment, which `helm install` met after creating the CRD, the RBAC and the Secret."""
    proc = template({"tolerations": [toleration]})
    assert proc.returncode != 0
    assert said in proc.stderr, proc.stderr


@pytest.mark.parametrize(
    "toleration",
    [
        {"operator": "Exists"},
        {"key": "gpu", "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 60},
        {"key": "gpu", "value": "true"},
    ],
)
def test_tolerations_the_api_server_takes_render(toleration: dict[str, Any]) -> None:
    """Pins what already worked: tolerate everything, a NoExecute toleration for a while, Equal by default."""
    [deployment] = [o for o in render({"tolerations": [toleration]}) if o["kind"] == "Deployment"]
    assert deployment["spec"]["template"]["spec"]["tolerations"] == [toleration]


@pytest.mark.parametrize(
    ("repository", "part"),
    [
        ("registry.example.com/MyTeam/spotjob-controller", "MyTeam"),
        ("Spotjob-Controller", "Spotjob-Controller"),
        ("registry.example.com/ml/-controller", "-controller"),
    ],
)
def test_a_repository_path_the_kubelet_refuses_is_refused_naming_it(repository: str, part: str) -> None:
    """An image path is lower case (letters and digits joined by '.', '_', '__' or '-'): the chart
    rendered registry.example.com/MyTeam/spotjob-controller as it was, `helm install` reported the
    release deployed, and every controller pod stayed in InvalidImageName."""
    proc = template({"image": {"repository": repository}})
    assert proc.returncode != 0
    assert f"image.repository {json.dumps(repository)}: its path part {json.dumps(part)}" in proc.stderr, proc.stderr
    assert "InvalidImageName" in proc.stderr


@pytest.mark.parametrize(
    ("image", "reference"),
    [
        (
            {"repository": "registry.example.com:5000/spotjob-controller"},
            "registry.example.com:5000/spotjob-controller:0.1.0",
        ),
        # A registry host may have capitals (host names ignore case); the path after it may not.
        (
            {"repository": "Registry.Example.com/ml_team/spot__job.controller"},
            "Registry.Example.com/ml_team/spot__job.controller:0.1.0",
        ),
        ({"repository": "localhost/ml/spotjob-controller"}, "localhost/ml/spotjob-controller:0.1.0"),
        ({"tag": "v0.2.0-rc.1_b7"}, "spotjob/spotjob-controller:v0.2.0-rc.1_b7"),
        ({"tag": f"0.2.0@{DIGEST}"}, f"spotjob/spotjob-controller:0.2.0@{DIGEST}"),
        ({"tag": "0.2.0", "digest": DIGEST}, f"spotjob/spotjob-controller@{DIGEST}"),
    ],
)
def test_image_references_the_kubelet_takes_render(image: dict[str, str], reference: str) -> None:
    """Pins what already worked: a registry with a port, a tag with every character a tag may hold,
    a tag with its digest, and a digest winning over the tag."""
    [deployment] = [o for o in render({"image": image}) if o["kind"] == "Deployment"]
    assert deployment["spec"]["template"]["spec"]["containers"][0]["image"] == reference


@pytest.mark.parametrize(
    ("resources", "named"),
    [
        (
            {"requests": {"memory": "1Gi"}},
            "resources.requests.memory (1Gi) is more than resources.limits.memory (512Mi)",
        ),
        ({"requests": {"memory": "600M"}}, "resources.requests.memory (600M) is more than resources.limits.memory"),
        ({"requests": {"cpu": 2}, "limits": {"cpu": "1500m"}}, "resources.requests.cpu (2) is more than"),
    ],
)
def test_a_request_above_its_limit_is_refused_naming_both(resources: dict[str, Any], named: str) -> None:
    """values.yaml says to raise the memory for large clusters: raising the request alone, over the
    default 512Mi limit, rendered a Deployment the API server refuses (after the CRD and the RBAC of
    the release were created)."""
    proc = template({"resources": resources})
    assert proc.returncode != 0
    assert named in proc.stderr, proc.stderr


def test_requests_up_to_their_limits_render() -> None:
    """Pins what already worked: equal quantities in other units, numbers, and a request that has no
    limit (ephemeral-storage; a removed memory limit is refused, see below)."""
    resources = {
        "requests": {"memory": "0.5Gi", "cpu": 0.5, "ephemeral-storage": "1Gi"},
        "limits": {"memory": "536870912", "cpu": "500m"},
    }
    [deployment] = [o for o in render({"resources": resources}) if o["kind"] == "Deployment"]
    got = deployment["spec"]["template"]["spec"]["containers"][0]["resources"]
    assert got["requests"]["memory"] == "0.5Gi" and got["limits"]["cpu"] == "500m"
    assert got["requests"]["ephemeral-storage"] == "1Gi" and "ephemeral-storage" not in got["limits"]


@pytest.mark.parametrize(
    ("resources", "named"),
    [
        ({"limits": None}, ["resources.limits.memory"]),
        ({"limits": {"memory": None}}, ["resources.limits.memory"]),
        ({"requests": {"cpu": None}}, ["resources.requests.cpu"]),
        ({"requests": None}, ["resources.requests.cpu", "resources.requests.memory"]),
        (None, ["resources.requests.cpu", "resources.requests.memory", "resources.limits.memory"]),
    ],
)
def test_a_removed_request_or_memory_limit_is_refused_naming_it(resources: Any, named: list[str]) -> None:
    """README ("Locked-down namespaces") says the controller's pods have CPU and memory requests and a
    memory limit with every value the chart takes, as admission policies that require them check: a
    null (helm's way of removing a default) rendered the container without them (``limits: {}``),
    and ``resources: null`` failed on a nil pointer."""
    proc = template({"resources": resources})
    assert proc.returncode != 0, "rendered a controller container without its requests or memory limit"
    said = proc.stderr.split("): ", 1)[-1]
    assert said.startswith(", ".join(named) + ": not set"), proc.stderr
    assert "nil pointer" not in proc.stderr


def _maps(values: dict[str, Any], path: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    found = []
    for key, value in values.items():
        if isinstance(value, dict):
            found.append((*path, key))
            found += _maps(value, (*path, key))
    return found


@pytest.mark.parametrize("path", _maps(DEFAULTS), ids=".".join)
def test_no_map_of_values_yaml_set_to_null_fails_on_a_nil_pointer(path: tuple[str, ...]) -> None:
    """A null is helm's way of removing a default (a values file, or --set KEY=null): the templates
    read securityContext, resources, crds, serviceAccount.aws, ... through it and stopped with
    "nil pointer evaluating interface {}.runAsUser" (or "index of untyped nil") naming a template
    line, not the value. Each map renders as empty, or is refused naming it; with the
    ServiceMonitor and the PrometheusRule on, so their templates read theirs too."""
    values: dict[str, Any] = {"metrics": {"serviceMonitor": {"enabled": True}, "prometheusRule": {"enabled": True}}}
    node = values
    for key in path[:-1]:
        node = node.setdefault(key, {})
    node[path[-1]] = None
    proc = template(values)
    assert "nil pointer" not in proc.stderr and "of untyped nil" not in proc.stderr, proc.stderr
    if proc.returncode != 0:
        named = f"missing property '{path[-1]}'" in proc.stderr or ".".join(path) in proc.stderr
        assert named, proc.stderr


@pytest.mark.parametrize(
    ("values", "said"),
    [
        ({"crds": None}, "at '': missing property 'crds'"),
        ({"image": None}, "at '': missing property 'image'"),
        ({"leaderElection": None}, "at '': missing property 'leaderElection'"),
        ({"networkPolicy": None}, "at '': missing property 'networkPolicy'"),
        ({"agentTokenKey": None}, "at '': missing property 'agentTokenKey'"),
        ({"interruptionQueue": None}, "at '': missing property 'interruptionQueue'"),
        ({"serviceAccount": None}, "at '': missing property 'serviceAccount'"),
        ({"serviceAccount": {"aws": None}}, "at '/serviceAccount': missing property 'aws'"),
        ({"serviceAccount": {"gcp": None}}, "at '/serviceAccount': missing property 'gcp'"),
        ({"rbac": None}, "at '': missing property 'rbac'"),
        ({"podDisruptionBudget": None}, "at '': missing property 'podDisruptionBudget'"),
        ({"metrics": None}, "at '': missing property 'metrics'"),
        ({"metrics": {"service": None}}, "at '/metrics': missing property 'service'"),
        ({"metrics": {"serviceMonitor": None}}, "at '/metrics': missing property 'serviceMonitor'"),
        (
            {"metrics": {"prometheusRule": {"enabled": True, "selector": 'job="spotjob"', "thresholds": None}}},
            "at '/metrics/prometheusRule': missing property 'thresholds'",
        ),
    ],
)
def test_a_map_whose_default_the_chart_needs_set_to_null_is_refused_naming_it(
    values: dict[str, Any], said: str
) -> None:
    """Left empty, these would turn off what the default turns on (the CRD, RBAC, the ServiceAccount,
    leader election, the per-job NetworkPolicies, the PodDisruptionBudget, the metrics Service) or
    leave the chart without what it reads (the image, the alerts' thresholds): the schema requires
    them, so helm refuses the values before rendering, naming the map."""
    proc = template(values)
    assert proc.returncode != 0
    assert said in proc.stderr, proc.stderr


@pytest.mark.parametrize("how", ["values file", "--set"])
def test_security_context_null_leaves_the_ids_to_the_platform(how: str) -> None:
    """README ("Locked-down namespaces") names `securityContext` null for the platform's IDs
    (OpenShift's restricted SCC assigns them): it failed on a nil pointer (deployment.yaml reading
    .Values.securityContext.runAsUser). It means both IDs null: the pod still runs as non-root and
    meets Pod Security restricted."""
    from tests.k8s.cluster.podsecurity import violations

    objects = (
        render({"securityContext": None}) if how == "values file" else render(None, "--set", "securityContext=null")
    )
    [deployment] = [o for o in objects if o["kind"] == "Deployment"]
    pod = deployment["spec"]["template"]["spec"]
    assert pod["securityContext"] == {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}}
    assert pod["containers"][0]["securityContext"]["runAsNonRoot"] is True
    assert violations(pod) == []


def test_service_account_annotations_null_is_none() -> None:
    """A null serviceAccount.annotations (its default is empty) failed on deepCopy of nil; it is
    empty, and the IRSA annotation is still written."""
    arn = "arn:aws:iam::111122223333:role/spotjob-controller"
    objects = render({"serviceAccount": {"annotations": None, "aws": {"roleArn": arn}}})
    [account] = [o for o in objects if o["kind"] == "ServiceAccount"]
    assert account["metadata"]["annotations"] == {"eks.amazonaws.com/role-arn": arn}


def _scalars(values: dict[str, Any], path: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    found = []
    for key, value in values.items():
        if isinstance(value, dict) and value:
            found += _scalars(value, (*path, key))
        elif not isinstance(value, dict | list):
            found.append((*path, key))
    return found


NULL_MEANS_ABSENT = {
    ("logFormat",): "the flag is left out: the controller's own default is the chart's",
    ("agentLauncher",): "the same",
    ("securityContext", "runAsUser"): "the platform's IDs (README 'Locked-down namespaces')",
    ("securityContext", "runAsGroup"): "the same",
}
"""Values whose null renders otherwise than their default, on purpose."""


def _without_random_secrets(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The objects, the agent token key's random data set aside (each render draws another)."""
    return [{k: v for k, v in o.items() if k != "data"} if o.get("kind") == "Secret" else o for o in objects]


@pytest.mark.parametrize("path", [p for p in _scalars(DEFAULTS) if p not in NULL_MEANS_ABSENT], ids=".".join)
def test_a_value_of_values_yaml_set_to_null_renders_its_default_or_is_refused_naming_it(path: tuple[str, ...]) -> None:
    """A null removes a default: crds.keep null rendered the CRD without helm.sh/resource-policy:
    keep (an uninstall then deletes every SpotJob), networkPolicy.enabled or rbac.create null left
    the NetworkPolicies or the RBAC out in silence, httpPort null rendered --http-port= and an empty
    containerPort, leaderElection.leaseName null resourceNames: [null], a threshold null PromQL
    ending in "> " — and leaderElection.enabled or metrics.service.enabled null stopped on invalid
    YAML naming nothing. Each scalar of values.yaml set to null now renders as its default does, or
    is refused naming it (the ServiceMonitor and the PrometheusRule on, so their values are read)."""
    on = {"metrics": {"serviceMonitor": {"enabled": True}, "prometheusRule": {"enabled": True}}}

    def values_with(value: Any) -> dict[str, Any]:
        values = json.loads(json.dumps(on))
        node = values
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
        return values

    default = DEFAULTS
    for key in path:
        default = default[key]
    proc = template(values_with(None))
    if proc.returncode != 0:
        assert f"missing property '{path[-1]}'" in proc.stderr or ".".join(path) in proc.stderr, proc.stderr
        return
    assert _without_random_secrets(load_all(proc.stdout)) == _without_random_secrets(render(values_with(default))), (
        f"{'.'.join(path)}: null renders otherwise than its default {default!r}"
    )
