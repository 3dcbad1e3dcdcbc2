"""The objects a SpotJob owns (orchestrator.k8s.pods): valid Kubernetes in strict mode, the user's
template kept, spotjob's additions merged in, and templates the controller cannot run named."""

from __future__ import annotations

import base64
import copy
import itertools
import re
from typing import Any

import kubernetes_validate
import pytest

from orchestrator.k8s import pods
from orchestrator.k8s.cluster_signals import TAINT_RULES

VERSIONS = ("1.29.0", "1.32.0")
OWNER = pods.Owner("ml", "llama", "0f4c3a2e-1111-2222-3333-444455556666")
OPTIONS = pods.WorkerOptions(
    agent_port=8470,
    controller_namespace="spotjob-system",
    controller_pod_labels={"app.kubernetes.io/name": "spotjob", "app.kubernetes.io/instance": "spotjob"},
)

USER_TEMPLATE: dict[str, Any] = {
    "metadata": {"labels": {"team": "ml", "spotjob.dev/job": "forged"}, "annotations": {"a": "b"}},
    "spec": {
        "serviceAccountName": "trainer",
        "nodeSelector": {"kubernetes.io/os": "linux"},
        "affinity": {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [
                        {
                            "matchExpressions": [
                                {"key": "karpenter.sh/capacity-type", "operator": "In", "values": ["spot"]}
                            ]
                        },
                        {
                            "matchExpressions": [
                                {"key": "eks.amazonaws.com/capacityType", "operator": "In", "values": ["SPOT"]}
                            ]
                        },
                    ]
                },
                "preferredDuringSchedulingIgnoredDuringExecution": [
                    {"weight": 10, "preference": {"matchExpressions": [{"key": "gpu", "operator": "Exists"}]}}
                ],
            }
        },
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        "volumes": [{"name": "data", "emptyDir": {}}],
        "containers": [
            {"name": "sidecar", "image": "busybox:1", "command": ["sleep", "infinity"]},
            {
                "name": "trainer",
                "image": "registry.example.com/train:1",
                "env": [{"name": "NCCL_DEBUG", "value": "INFO"}, {"name": "SHARED", "value": "template"}],
                "resources": {"limits": {"nvidia.com/gpu": 1}},
                "volumeMounts": [{"name": "data", "mountPath": "/data"}],
            },
        ],
    },
}


def spec(**changes: Any) -> pods.WorkerSpec:
    base: dict[str, Any] = dict(
        template=copy.deepcopy(USER_TEMPLATE),
        container=1,
        container_name="trainer",
        image=None,
        command=["/workspace/train.py", "--steps", "100"],
        env={"SHARED": "spec", "OMP_NUM_THREADS": "1"},
        replicas=2,
        nproc_per_node=4,
        checkpoint_uri="s3://bucket/llama",
        every_steps=50,
        every_seconds=None,
        keep=3,
        flush_timeout_seconds=90.0,
    )
    base.update(changes)
    return pods.WorkerSpec(**base)


def pod(index: int = 0, *, placement: pods.WorkerPlacement | None = None, **changes: Any) -> dict[str, Any]:
    return pods.worker_pod(
        OWNER,
        "ml/llama",
        spec(**changes),
        name=f"llama-3-{index}",
        attempt=3,
        index=index,
        master_addr="10.0.0.7" if index else None,
        placement=placement or pods.WorkerPlacement(),
        options=OPTIONS,
    )


def trainer(p: dict[str, Any]) -> dict[str, Any]:
    (c,) = [c for c in p["spec"]["containers"] if c["name"] == "trainer"]
    return c


def strict(obj: dict[str, Any]) -> None:
    for version in VERSIONS:
        kubernetes_validate.validate(obj, version, strict=True)


def test_every_object_a_job_owns_is_valid_kubernetes_in_strict_mode() -> None:
    avoid = pods.WorkerPlacement(frozenset({"node-a"}), frozenset({"us-east-1a"}), frozenset({"g5.xlarge"}))
    for obj in (
        pod(0, placement=avoid),
        pod(1, placement=avoid),
        pod(0, template=None, container=0, image="img:1"),
        pods.headless_service(OWNER, 8470),
        pods.token_secret(OWNER, "t0ken"),
        pods.network_policy(OWNER, OPTIONS),
    ):
        strict(obj)
        assert obj["metadata"]["ownerReferences"] == [
            {
                "apiVersion": "spotjob.dev/v1alpha1",
                "kind": "SpotJob",
                "name": "llama",
                "uid": OWNER.uid,
                "controller": True,
            }
        ]
        assert obj["metadata"]["labels"]["spotjob.dev/job"] == "llama"


def test_the_agent_wraps_torchrun_with_the_attempt_the_job_identity_and_the_rendezvous() -> None:
    first, second = trainer(pod(0)), trainer(pod(1))
    assert first["command"] == ["spotjob-agent"]
    args = first["args"]
    split = args.index("--")
    agent, torchrun = args[:split], args[split + 1 :]
    assert agent[agent.index("--attempt") + 1] == "3"
    assert agent[agent.index("--job-name") + 1] == "ml/llama"
    assert agent[agent.index("--control-host") + 1] == "$(POD_IP)"
    assert agent[agent.index("--token-file") + 1] == "/var/run/spotjob/token/token"
    assert agent[agent.index("--every-steps") + 1] == "50" and "--every-seconds" not in agent
    env = {e["name"]: e.get("value") for e in first["env"]}
    assert env["SPOTJOB_AGENT_LAUNCHER"] == "direct" and "--launcher" not in agent  # the controller's --agent-launcher
    assert torchrun[:1] == ["torchrun"] and torchrun[-3:] == ["/workspace/train.py", "--steps", "100"]
    assert torchrun[torchrun.index("--nnodes") + 1] == "2"
    assert torchrun[torchrun.index("--nproc-per-node") + 1] == "4"
    assert torchrun[torchrun.index("--node-rank") + 1] == "0"
    assert torchrun[torchrun.index("--master-addr") + 1] == "$(POD_IP)"
    other = second["args"][second["args"].index("--") + 1 :]
    assert other[other.index("--node-rank") + 1] == "1"
    assert other[other.index("--master-addr") + 1] == "10.0.0.7"
    port = str(pods.rendezvous_port("ml", "llama", 3))
    assert torchrun[torchrun.index("--master-port") + 1] == port == other[other.index("--master-port") + 1]
    with pytest.raises(ValueError, match="replica 0's address"):
        pods.worker_pod(
            OWNER, "ml/llama", spec(), name="llama-3-1", attempt=3, index=1, master_addr=None,
            placement=pods.WorkerPlacement(), options=OPTIONS,
        )  # fmt: skip


def test_the_training_container_reports_the_tail_of_its_log_unless_the_template_says_otherwise() -> None:
    made = pods.worker_pod(
        OWNER, "ml/llama", spec(), name="llama-3-0", attempt=3, index=0, master_addr=None,
        placement=pods.WorkerPlacement(), options=OPTIONS,
    )  # fmt: skip
    assert trainer(made)["terminationMessagePolicy"] == "FallbackToLogsOnError"
    template = copy.deepcopy(USER_TEMPLATE)
    template["spec"]["containers"][1]["terminationMessagePolicy"] = "File"
    kept = pods.worker_pod(
        OWNER, "ml/llama", spec(template=template), name="llama-3-0", attempt=3, index=0, master_addr=None,
        placement=pods.WorkerPlacement(), options=OPTIONS,
    )  # fmt: skip
    assert trainer(kept)["terminationMessagePolicy"] == "File"


def test_the_controllers_agent_launcher_reaches_every_agent() -> None:
    options = pods.WorkerOptions(agent_launcher="torchrun")
    made = pods.worker_pod(
        OWNER, "ml/llama", spec(), name="llama-3-0", attempt=3, index=0, master_addr=None,
        placement=pods.WorkerPlacement(), options=options,
    )  # fmt: skip
    env = {e["name"]: e.get("value") for e in trainer(made)["env"]}
    assert env["SPOTJOB_AGENT_LAUNCHER"] == "torchrun"


def test_the_rendezvous_port_is_stable_per_attempt_and_moves_with_the_next_one() -> None:
    ports = [pods.rendezvous_port("ml", "llama", a) for a in range(50)]
    assert ports == [pods.rendezvous_port("ml", "llama", a) for a in range(50)]
    assert all(20000 <= p < 30000 for p in ports)
    assert sum(a != b for a, b in itertools.pairwise(ports)) >= 45


def test_the_users_template_is_kept_and_spotjobs_labels_win() -> None:
    p = pod(0)
    assert p["metadata"]["labels"] == {
        "team": "ml",
        "spotjob.dev/job": "llama",
        "spotjob.dev/attempt": "3",
        "spotjob.dev/index": "0",
    }
    assert p["metadata"]["annotations"] == {"a": "b"}
    s = p["spec"]
    assert s["serviceAccountName"] == "trainer" and s["nodeSelector"] == {"kubernetes.io/os": "linux"}
    assert s["containers"][0] == USER_TEMPLATE["spec"]["containers"][0]  # the sidecar, untouched
    t = trainer(p)
    assert t["image"] == "registry.example.com/train:1" and t["resources"] == {"limits": {"nvidia.com/gpu": 1}}
    env = {e["name"]: e for e in t["env"]}
    assert env["NCCL_DEBUG"]["value"] == "INFO" and env["SHARED"]["value"] == "spec"  # spec.env wins
    assert env["POD_IP"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert {"name": "data", "mountPath": "/data"} in t["volumeMounts"]
    assert s["restartPolicy"] == "Never" and s["hostname"] == "llama-3-0" and s["subdomain"] == "llama"
    assert s["terminationGracePeriodSeconds"] == 90 + pods.EXIT_SLACK_SECONDS
    assert {v["name"] for v in s["volumes"]} == {"data", "spotjob-token", "spotjob-control", "spotjob-staging"}
    assert USER_TEMPLATE["spec"]["containers"][1].get("command") is None  # the input is not mutated


def test_every_replica_is_probed_for_readiness_and_for_liveness() -> None:
    for index in (0, 1):
        assert trainer(pod(index))["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "spotjob-agent"}
        assert trainer(pod(index))["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "spotjob-agent"}


def test_a_volume_named_spotjob_staging_in_the_template_replaces_the_default_one() -> None:
    template = copy.deepcopy(USER_TEMPLATE)
    template["spec"]["volumes"].append({"name": "spotjob-staging", "hostPath": {"path": "/mnt/nvme/spotjob"}})
    volumes = {v["name"]: v for v in pod(0, template=template)["spec"]["volumes"]}
    assert volumes["spotjob-staging"] == {"name": "spotjob-staging", "hostPath": {"path": "/mnt/nvme/spotjob"}}


def test_avoided_nodes_are_excluded_from_every_term_and_zones_and_types_are_only_preferred() -> None:
    placement = pods.WorkerPlacement(frozenset({"b", "a"}), frozenset({"us-east-1a"}), frozenset({"g5.xlarge"}))
    affinity = pod(0, placement=placement)["spec"]["affinity"]
    terms = affinity["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert len(terms) == 2  # the user's two alternatives (ORed), each now excluding the nodes
    for term in terms:
        # One value per requirement: the API server refuses more in a node field selector.
        assert term["matchFields"] == [
            {"key": "metadata.name", "operator": "NotIn", "values": ["a"]},
            {"key": "metadata.name", "operator": "NotIn", "values": ["b"]},
        ]
        assert term["matchExpressions"]
    preferred = affinity["nodeAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert preferred[0]["weight"] == 10  # the user's own preference stays
    keys = {
        p["preference"]["matchExpressions"][0]["key"]: p["preference"]["matchExpressions"][0] for p in preferred[1:]
    }
    assert keys["topology.kubernetes.io/zone"]["values"] == ["us-east-1a"]
    assert keys["node.kubernetes.io/instance-type"]["values"] == ["g5.xlarge"]
    (anti,) = affinity["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert anti["topologyKey"] == "kubernetes.io/hostname"
    assert anti["labelSelector"] == {"matchLabels": {"spotjob.dev/job": "llama", "spotjob.dev/attempt": "3"}}


def test_without_avoidances_no_required_node_term_is_invented() -> None:
    s = pod(0, template=None, container=0, image="img:1")["spec"]
    assert "nodeAffinity" not in s["affinity"]
    assert s["containers"][0]["name"] == "trainer" and s["containers"][0]["image"] == "img:1"


def test_noexecute_preemption_taints_are_tolerated_for_the_flush_window_but_noschedule_ones_are_not() -> None:
    tolerations = pod(0)["spec"]["tolerations"]
    assert tolerations[0] == USER_TEMPLATE["spec"]["tolerations"][0]
    ours = {t["key"]: t for t in tolerations[1:]}
    assert "node.kubernetes.io/out-of-service" not in ours  # a dead node's pods must go at once
    assert set(ours) == {r.key for r in TAINT_RULES} - {"node.kubernetes.io/out-of-service"}
    for t in ours.values():
        assert t == {
            "key": t["key"],
            "operator": "Exists",
            "effect": "NoExecute",
            "tolerationSeconds": 90 + pods.EXIT_SLACK_SECONDS,
        }


@pytest.mark.parametrize(
    ("change", "field"),
    [
        (lambda t: t["spec"]["containers"][1].update(command=["python"]), "spec.template.spec.containers[1].command"),
        (lambda t: t["spec"]["containers"][1].update(args=["x"]), "spec.template.spec.containers[1].args"),
        (lambda t: t["spec"].update(restartPolicy="Always"), "spec.template.spec.restartPolicy"),
        (
            lambda t: t["spec"]["volumes"].append({"name": "spotjob-token", "emptyDir": {}}),
            "spec.template.spec.volumes[1]",
        ),
        (lambda t: t["spec"].update(hostname="x"), "spec.template.spec.hostname"),
        (
            # On a sidecar it would mark that container as the trainer: its readiness and exit
            # code would stand for the worker's.
            lambda t: t["spec"]["containers"][0].update(ports=[{"name": "spotjob-agent", "containerPort": 9}]),
            "spec.template.spec.containers[0].ports[0].name",
        ),
        (
            lambda t: t["spec"]["containers"][1].update(ports=[{"name": "spotjob-agent", "containerPort": 9}]),
            "spec.template.spec.containers[1].ports[0].name",
        ),
        (
            lambda t: t["spec"]["containers"][1]["env"].append({"name": "POD_IP", "value": "1.2.3.4"}),
            "spec.template.spec.containers[1].env[2].name",
        ),
    ],
)
def test_a_template_spotjob_cannot_run_is_refused_naming_the_field(change: Any, field: str) -> None:
    template = copy.deepcopy(USER_TEMPLATE)
    change(template)
    problems = pods.template_problems(template, 1)
    assert any(p.startswith(field) for p in problems), problems
    with pytest.raises(pods.TemplateError, match=field.replace("[", r"\[").replace("]", r"\]")):
        pod(0, template=template)


@pytest.mark.parametrize(
    ("metadata", "said"),
    [
        ({"labels": {"team name": "ml"}}, "spec.template.metadata.labels: 'team name' is no label key"),
        ({"labels": {"example.com/a/b": "ml"}}, "spec.template.metadata.labels: 'example.com/a/b' is no label key"),
        ({"labels": {"Example.com/team": "ml"}}, "spec.template.metadata.labels: 'Example.com/team' is no label key"),
        ({"labels": {"/team": "ml"}}, "spec.template.metadata.labels: '/team' is no label key"),
        ({"labels": {"t" * 64: "ml"}}, f"spec.template.metadata.labels: '{'t' * 64}' is no label key"),
        ({"labels": {"team": "ml team"}}, "spec.template.metadata.labels.team: 'ml team' is no label value"),
        ({"labels": {"team": "m" * 64}}, "spec.template.metadata.labels.team: 'mmm"),
        ({"labels": {"team": "ml-"}}, "spec.template.metadata.labels.team: 'ml-' is no label value"),
        ({"annotations": {"a note": "x"}}, "spec.template.metadata.annotations: 'a note' is no annotation key"),
        (
            {"annotations": {"a": "x" * (256 * 1024)}},
            "spec.template.metadata.annotations take 262145 bytes (keys and values), more than the 262144",
        ),
        (
            # Counted in bytes, as the API server counts them: 2 bytes per 'é'.
            {"annotations": {"a": "é" * (128 * 1024)}},
            "spec.template.metadata.annotations take 262145 bytes",
        ),
    ],
)
def test_labels_and_annotations_the_api_server_refuses_in_a_pod_are_refused_naming_the_field_and_rule(
    metadata: dict[str, Any], said: str
) -> None:
    """The CRD keeps the template as written, so a label or annotation the API server refuses in a
    pod reached the pod builder, and every worker pod of every attempt was refused (422) on every
    pass. They are named with the rule at the spec's check instead, as every other template problem."""
    template = copy.deepcopy(USER_TEMPLATE)
    template["metadata"] = metadata
    problems = pods.template_problems(template, 1)
    assert any(p.startswith(said) for p in problems), problems
    with pytest.raises(pods.TemplateError, match=re.escape(said)):
        pod(0, template=template)


def assert_refused_naming(change: Any, said: str) -> None:
    """The template ``change`` makes is a problem starting with ``said``, and the pod builder refuses it."""
    template = copy.deepcopy(USER_TEMPLATE)
    change(template)
    problems = pods.template_problems(template, 1)
    assert any(p.startswith(said) for p in problems), problems
    with pytest.raises(pods.TemplateError, match=re.escape(said)):
        pod(0, template=template)


@pytest.mark.parametrize(
    ("change", "said"),
    [
        (
            lambda t: t["spec"]["nodeSelector"].update({"pool": "gpu a100"}),
            "spec.template.spec.nodeSelector.pool: 'gpu a100' is no label value Kubernetes takes",
        ),
        (
            lambda t: t["spec"]["nodeSelector"].update({"GPU type": "a100"}),
            "spec.template.spec.nodeSelector: 'GPU type' is no label key",
        ),
        (
            lambda t: t["spec"]["containers"][0].update(name="Log_Shipper"),
            "spec.template.spec.containers[0].name: 'Log_Shipper' is no container name Kubernetes takes",
        ),
        (
            lambda t: t["spec"].update(initContainers=[{"name": "fetch.data", "image": "busybox"}]),
            "spec.template.spec.initContainers[0].name: 'fetch.data' is no container name",
        ),
    ],
)
def test_a_node_selector_or_container_name_the_api_server_refuses_is_named_with_the_rule(
    change: Any, said: str
) -> None:
    """As labels: a nodeSelector or a container name the API server refuses made every worker pod
    of every pass a 422."""
    assert_refused_naming(change, said)


def _mount(container: int, name: str, path: str) -> Any:
    return lambda t: (
        t["spec"]["containers"][container].setdefault("volumeMounts", []).append({"name": name, "mountPath": path})
    )


@pytest.mark.parametrize(
    ("change", "said"),
    [
        (
            lambda t: t["spec"]["containers"][0].pop("image"),
            "spec.template.spec.containers[0].image is required: Kubernetes refuses a pod with a container without",
        ),
        (
            # A container of spec.fallback.template named none of spec.template's is added as another.
            lambda t: t["spec"]["containers"].append({"name": "trainr", "resources": {"limits": {"cpu": "1"}}}),
            "spec.template.spec.containers[2].image is required",
        ),
        (
            lambda t: t["spec"].update(initContainers=[{"name": "fetch", "image": ""}]),
            "spec.template.spec.initContainers[0].image is required",
        ),
        (
            lambda t: t["spec"]["containers"][0].update(image="busybox:1 "),
            "spec.template.spec.containers[0].image: 'busybox:1 ' has spaces around it",
        ),
        (
            lambda t: t["spec"]["containers"][1].update(image=" registry.example.com/train:1"),
            "spec.template.spec.containers[1].image: ' registry.example.com/train:1' has spaces around it",
        ),
        (
            lambda t: t["spec"]["containers"][0].update(image=3),
            "spec.template.spec.containers[0].image must be a string",
        ),
        (
            lambda t: t["spec"].update(initContainers=[{"name": "trainer", "image": "busybox"}]),
            "spec.template.spec.containers[1].name: 'trainer' is also spec.template.spec.initContainers[0]'s",
        ),
        (
            lambda t: t["spec"].update(initContainers=[{"image": "busybox"}]),
            "spec.template.spec.initContainers[0].name is required",
        ),
        (
            # A local disk mounted where spotjob mounts its staging volume: two mounts at one path.
            _mount(1, "data", "/var/run/spotjob/staging"),
            "spec.template.spec.containers[1].volumeMounts[1].mountPath: /var/run/spotjob/staging is where spotjob "
            "mounts spotjob-staging; to stage checkpoints on a disk of your own, name its volume spotjob-staging",
        ),
        (
            _mount(1, "data", "/var/run/spotjob/token/"),
            "spec.template.spec.containers[1].volumeMounts[1].mountPath: /var/run/spotjob/token/ is where spotjob "
            "mounts spotjob-token; mount it elsewhere",
        ),
        (
            _mount(1, "data", "/data/"),
            "spec.template.spec.containers[1].volumeMounts[1].mountPath: /data/ is volumeMounts[0]'s too",
        ),
        (
            _mount(0, "scratch", "/scratch"),
            "spec.template.spec.containers[0].volumeMounts[0].name: 'scratch' is no volume of the pod",
        ),
    ],
    ids=[
        "sidecar-no-image",
        "fallback-typo-no-image",
        "init-empty-image",
        "image-trailing-space",
        "trainer-image-leading-space",
        "image-a-number",
        "name-twice-across-init",
        "init-no-name",
        "mount-at-staging",
        "mount-at-token",
        "two-mounts-one-path",
        "mount-of-no-volume",
    ],
)
def test_a_container_image_name_or_mount_the_api_server_refuses_is_named_with_the_fix(change: Any, said: str) -> None:
    """A sidecar without an image (a container of spec.fallback.template whose name had a typo was
    added as one), an image with a space around it, a name taken twice, a mount of a local disk at
    spotjob's staging path (where the pod builder mounts spotjob-staging too), two mounts at one path,
    a mount of no volume: the API server refuses each such pod, so every worker of every pass was
    refused and the job sat Pending with BackendUnavailable Events. Found walking the chart and the
    controller as a user; each case passed before."""
    assert_refused_naming(change, said)


def test_mounts_and_images_the_api_server_takes_pass() -> None:
    """The training container without an image (spec.image gives it), its own mount of the
    spotjob-staging volume (replaced by spotjob's, at spotjob's path), and a sidecar mounting
    spotjob's staging volume to read the staged checkpoints."""
    template = copy.deepcopy(USER_TEMPLATE)
    del template["spec"]["containers"][1]["image"]
    template["spec"]["volumes"].append({"name": "spotjob-staging", "hostPath": {"path": "/mnt/nvme"}})
    template["spec"]["containers"][1]["volumeMounts"].append({"name": "spotjob-staging", "mountPath": "/staging"})
    template["spec"]["containers"][0]["volumeMounts"] = [{"name": "spotjob-staging", "mountPath": "/staging"}]
    assert pods.template_problems(template, 1) == []
    built = pod(0, template=template, image="registry.example.com/train:2")
    strict(built)
    assert trainer(built)["image"] == "registry.example.com/train:2"
    assert [(m["name"], m["mountPath"]) for m in trainer(built)["volumeMounts"]] == [
        ("data", "/data"),
        ("spotjob-token", "/var/run/spotjob/token"),
        ("spotjob-control", "/var/run/spotjob/control"),
        ("spotjob-staging", "/var/run/spotjob/staging"),
    ]


def test_labels_and_annotations_the_api_server_takes_pass() -> None:
    """Prefixed keys, empty and 63-character values, annotation keys in capitals (the API server
    checks them lowercased), and annotations of exactly 256 KiB."""
    template = copy.deepcopy(USER_TEMPLATE)
    template["metadata"] = {
        "labels": {"app.kubernetes.io/name": "trainer", "team": "", "t" * 63: "v" * 63, "a_b.c-d": "X.y_z-1"},
        "annotations": {"Example.com/Note": "any text at all: spaces, é"},
    }
    used = len("Example.com/Note") + len("any text at all: spaces, é".encode()) + len("big")
    template["metadata"]["annotations"]["big"] = "x" * (256 * 1024 - used)
    assert pods.template_problems(template, 1) == []
    built = pod(0, template=template)
    assert built["metadata"]["annotations"] == template["metadata"]["annotations"]


@pytest.mark.parametrize(
    ("change", "field"),
    [
        # spec.env's map form, written in the template's container: the likeliest of these.
        (lambda t: t["spec"]["containers"][1].update(env={"NCCL_DEBUG": "INFO"}), "spec.containers[1].env must be"),
        (lambda t: t["spec"]["containers"][1].update(env=["NCCL_DEBUG=INFO"]), "spec.containers[1].env[0] must be"),
        (lambda t: t["spec"]["containers"][1].update(env=[{"value": "x"}]), "spec.containers[1].env[0].name is"),
        (
            lambda t: t["spec"]["containers"][1].update(env=[{"name": "WORLD", "value": 2}]),
            "spec.containers[1].env[0].value must be a string, not a number: quote it",
        ),
        (lambda t: t["spec"]["containers"][1].update(ports=[8080]), "spec.containers[1].ports[0] must be"),
        (lambda t: t["spec"]["containers"][1].update(volumeMounts={"name": "data"}), "spec.containers[1].volumeMounts"),
        (lambda t: t["spec"]["containers"][1].update(lifecycle={"preStop": "sleep 5"}), "lifecycle.preStop must be"),
        (lambda t: t["spec"].update(volumes={"name": "data", "emptyDir": {}}), "spec.volumes must be"),
        (lambda t: t["spec"].update(tolerations=["nvidia.com/gpu"]), "spec.tolerations[0] must be"),
        (lambda t: t["spec"].update(terminationGracePeriodSeconds="two minutes"), "spec.terminationGracePeriodSeconds"),
        (lambda t: t["spec"].update(affinity=[]), "spec.affinity must be an object, not a list"),
        (
            lambda t: t["spec"]["affinity"].update(
                podAntiAffinity={"requiredDuringSchedulingIgnoredDuringExecution": {}}
            ),
            "spec.affinity.podAntiAffinity.requiredDuringSchedulingIgnoredDuringExecution must be a list",
        ),
        (
            lambda t: t["metadata"].update(labels=["team=ml"]),
            "metadata.labels must be an object of strings, not a list",
        ),
        (lambda t: t["metadata"]["labels"].update(version=2), "metadata.labels.version must be a string, not a number"),
        # Every container's, not only the training container's: the API server refuses the pod all the same.
        (
            lambda t: t["spec"]["containers"][0].update(env=[{"name": "LOG_LEVEL", "value": 2}]),
            "spec.containers[0].env[0].value must be a string, not a number: quote it",
        ),
        (lambda t: t["spec"]["containers"][0].update(env={"A": "1"}), "spec.containers[0].env must be a list of"),
        (
            lambda t: t["spec"]["containers"][0].update(volumeMounts={"name": "data"}),
            "spec.containers[0].volumeMounts must be a list of objects, not an object",
        ),
        (
            lambda t: t["spec"].update(initContainers=[{"name": "warm", "image": "busybox:1", "env": {"A": "1"}}]),
            "spec.initContainers[0].env must be a list of objects, not an object",
        ),
        (
            lambda t: t["spec"].update(initContainers={"name": "warm", "image": "busybox:1"}),
            "spec.initContainers must be a list of objects, not an object",
        ),
        (
            lambda t: t["spec"]["containers"][1].update(lifecycle={"preStop": {"sleep": {"seconds": "5"}}}),
            "spec.containers[1].lifecycle.preStop.sleep.seconds must be a whole number, not a string",
        ),
        (
            lambda t: t["spec"]["containers"][0].update(lifecycle={"preStop": {"sleep": {"seconds": 2.5}}}),
            "spec.containers[0].lifecycle.preStop.sleep.seconds must be a whole number, not a number",
        ),
        # `gpu: true` in YAML is a boolean: the API server refused every pod (a node's labels are strings).
        (
            lambda t: t["spec"]["nodeSelector"].update(gpu=True),
            'spec.nodeSelector.gpu must be a string, not a boolean: quote it ("true", "2")',
        ),
        (lambda t: t["spec"]["nodeSelector"].update(slots=8), "spec.nodeSelector.slots must be a string, not a number"),
        (
            lambda t: t["spec"].update(nodeSelector=["kubernetes.io/os=linux"]),
            "spec.nodeSelector must be an object of strings, not a list",
        ),
    ],
)
def test_a_template_part_of_the_wrong_json_type_is_refused_naming_it_instead_of_failing_the_pod_builder(
    change: Any, field: str
) -> None:
    """The CRD keeps the template as written, so nothing checked these types before the pod
    builder: ``env: {NCCL_DEBUG: INFO}`` in the training container (spec.env's map form) raised
    AttributeError in the controller's check of the spec, and a list where an object belongs (or
    the reverse) in the pod builder, on every pass, without a word on the SpotJob; a number where
    the Pod API takes a string built a pod the API server refused on every pass."""
    template = copy.deepcopy(USER_TEMPLATE)
    change(template)
    problems = pods.template_problems(template, 1)
    assert any(p.startswith("spec.template.") and field in p for p in problems), problems
    with pytest.raises(pods.TemplateError, match=re.escape(field)):
        pod(0, template=template)
    # The agent's settings are checked on the same pass: that check must not fail on it either.
    assert pods.agent_settings_problem("ml/llama", spec(template=template), OPTIONS) is None


def test_the_template_types_check_leaves_a_valid_template_and_nulls_alone() -> None:
    template = copy.deepcopy(USER_TEMPLATE)
    template["metadata"]["annotations"] = None
    template["spec"].update(terminationGracePeriodSeconds="60", tolerations=None)  # "60" was always taken
    template["spec"]["containers"][1]["lifecycle"] = {"preStop": {"sleep": {"seconds": 5}}}
    assert pods.template_problems(USER_TEMPLATE, 1) == []
    assert pods.template_problems(template, 1) == []
    strict(pod(0, template=template))


def test_the_network_policy_admits_the_jobs_pods_on_every_port_and_the_controller_on_the_agents_only() -> None:
    policy = pods.network_policy(OWNER, OPTIONS)["spec"]
    assert policy["podSelector"] == {"matchLabels": {"spotjob.dev/job": "llama"}}
    assert policy["policyTypes"] == ["Ingress"]
    peers, controller = policy["ingress"]
    assert peers == {"from": [{"podSelector": {"matchLabels": {"spotjob.dev/job": "llama"}}}]}
    assert controller["ports"] == [{"protocol": "TCP", "port": 8470}]
    (source,) = controller["from"]  # one peer: namespace AND pod labels
    assert source["namespaceSelector"] == {"matchLabels": {"kubernetes.io/metadata.name": "spotjob-system"}}
    assert source["podSelector"] == {"matchLabels": dict(OPTIONS.controller_pod_labels)}


def test_the_token_secret_is_immutable_and_named_for_the_jobs_incarnation() -> None:
    secret = pods.token_secret(OWNER, "s3cret")
    assert secret["immutable"] is True and base64.b64decode(secret["data"]["token"]) == b"s3cret"
    again = pods.Owner("ml", "llama", "99999999-0000-0000-0000-000000000000")
    assert pods.token_secret_name(again) != pods.token_secret_name(OWNER)


def test_a_job_name_starting_with_a_digit_still_gets_a_valid_service_name() -> None:
    assert pods.service_name("llama") == "llama"
    owner = pods.Owner("ml", "7b-run", OWNER.uid)
    service = pods.headless_service(owner, 8470)
    assert service["metadata"]["name"] == "sj-7b-run"
    strict(service)


def test_a_pre_stop_sleep_of_the_trainer_is_added_to_the_grace_period_so_the_flush_window_stays_whole() -> None:
    # The kubelet runs the hook, then SIGTERMs the agent, all within one grace period.
    template = copy.deepcopy(USER_TEMPLATE)
    template["spec"]["containers"][1]["lifecycle"] = {"preStop": {"sleep": {"seconds": 20}}}
    template["spec"]["containers"][0]["lifecycle"] = {"preStop": {"sleep": {"seconds": 600}}}  # not the agent's
    p = pod(0, template=template)
    assert trainer(p)["lifecycle"] == {"preStop": {"sleep": {"seconds": 20}}}  # the user's hook is kept
    assert p["spec"]["terminationGracePeriodSeconds"] == 90 + pods.EXIT_SLACK_SECONDS + 20
    strict(p)
    template["spec"]["terminationGracePeriodSeconds"] = 3600  # a longer one of the user's stays
    assert pod(0, template=template)["spec"]["terminationGracePeriodSeconds"] == 3600


def _restricted_template() -> dict[str, Any]:
    """USER_TEMPLATE made to meet Pod Security ``restricted``: every container (an init container
    too) non-root, no privilege escalation, all capabilities dropped, seccomp RuntimeDefault."""
    template = copy.deepcopy(USER_TEMPLATE)
    hardened = {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }
    template["spec"]["securityContext"] = {
        "runAsNonRoot": True,
        "runAsUser": 1000,
        "fsGroup": 1000,
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    template["spec"]["initContainers"] = [{"name": "fetch", "image": "busybox:1", "command": ["true"]}]
    for c in [*template["spec"]["containers"], *template["spec"]["initContainers"]]:
        c["securityContext"] = copy.deepcopy(hardened)
    return template


def test_a_template_pod_security_restricted_admits_stays_admitted_with_everything_spotjob_adds() -> None:
    """Pins what already held: spotjob adds only what ``restricted`` allows (a Secret and emptyDir
    volumes, a containerPort, downward-API env, probes, affinity, tolerations) and keeps the
    template's securityContext, pod and containers, as written. The checker is the test API
    server's (tests/k8s/cluster/podsecurity.py), written from the published standard."""
    from tests.k8s.cluster.podsecurity import violations

    template = _restricted_template()
    assert violations(template["spec"]) == []
    for index in (0, 1):
        p = pod(index, template=copy.deepcopy(template))
        assert violations(p["spec"]) == [], index
        assert p["spec"]["securityContext"] == template["spec"]["securityContext"]
        for c in p["spec"]["containers"] + p["spec"]["initContainers"]:
            assert c["securityContext"] == template["spec"]["containers"][0]["securityContext"], c["name"]
    # The checker can fail: a job without a template gets a container with no securityContext.
    bare = pod(template=None, container=0, image="img:1")
    assert [v.split(" (")[0] for v in violations(bare["spec"])] == [
        "allowPrivilegeEscalation != false",
        "unrestricted capabilities",
        "runAsNonRoot != true",
        "seccompProfile",
    ]


@pytest.mark.parametrize(
    ("variable", "source"),
    [
        ("SPOTJOB_CHECKPOINT_URI", "spec.checkpoint.uri"),
        ("SPOTJOB_KEEP", "spec.checkpoint.keep"),
        ("SPOTJOB_AGENT_LAUNCHER", "agentLauncher"),
        ("SPOTJOB_EVERY_STEPS", "spec.checkpoint.everySteps"),
    ],
)
def test_a_template_env_variable_spotjob_sets_over_it_is_refused_naming_where_it_comes_from(
    variable: str, source: str
) -> None:
    """The CRD refuses these in spec.env, but cannot see into the template: a training container's
    SPOTJOB_CHECKPOINT_URI=s3://other was replaced by spec.checkpoint.uri without a word (the
    worker saved elsewhere than the user's env said). The pod builder refuses it, naming the field."""
    template = copy.deepcopy(USER_TEMPLATE)
    template["spec"]["containers"][1]["env"].append({"name": variable, "value": "1"})
    field = "spec.template.spec.containers[1].env[2].name"
    problems = pods.template_problems(template, 1, policy=["SPOTJOB_EVERY_STEPS"])
    assert any(p.startswith(f"{field}: {variable} is set by spotjob") and source in p for p in problems), problems
    with pytest.raises(pods.TemplateError, match=re.escape(field)):
        pod(0, template=template)


@pytest.mark.parametrize(
    ("kind", "index", "entry", "field", "words"),
    [
        ("containers", 1, {"name": "A=B", "value": "1"}, "name", "'A=B' is no name Kubernetes takes"),
        ("containers", 1, {"name": "T\u00c9MP", "value": "1"}, "name", "is no name Kubernetes takes"),
        ("containers", 1, {"name": "TAB\tNAME", "value": "1"}, "name", "is no name Kubernetes takes"),
        ("containers", 1, {"name": "DATA", "value": "a\x00b"}, "value", "holds a NUL character"),
        # Other containers too: any one of them keeps the pod from being created or started.
        ("containers", 0, {"name": "", "value": "1"}, "name", "'' is no name Kubernetes takes"),
        ("initContainers", 0, {"name": "X", "value": "\x00"}, "value", "holds a NUL character"),
    ],
    ids=["equals", "non-ascii", "tab", "nul-value", "sidecar-empty-name", "init-nul-value"],
)
def test_a_template_env_entry_kubernetes_refuses_is_a_problem_naming_the_field(
    kind: str, index: int, entry: dict[str, str], field: str, words: str
) -> None:
    """An env name the API server refuses for a container's variable (in any Kubernetes version:
    '=', a character other than printable ASCII, an empty name), or a NUL in a value (the API server
    stores it; the container runtime cannot start a process with it), reached the API server in
    every attempt's pods: refused on every pass, or a container that never started. The template
    check names the entry before any pod is made."""
    template = copy.deepcopy(USER_TEMPLATE)
    containers = template["spec"].setdefault(kind, [{"name": "init", "image": "busybox:1"}])
    containers[index].setdefault("env", []).append(entry)
    at = f"spec.template.spec.{kind}[{index}].env[{len(containers[index]['env']) - 1}].{field}"
    problems = pods.template_problems(template, 1)
    assert any(p.startswith(f"{at}: ") and words in p for p in problems), problems
    with pytest.raises(pods.TemplateError, match=re.escape(at)):
        pod(0, template=template)


def test_template_env_names_every_kubernetes_version_takes_are_no_problem() -> None:
    """Pins what already worked: names with '.', '-', a space or a leading digit are taken since
    Kubernetes 1.32 (RelaxedEnvironmentVariableValidation); older servers refuse the last two
    themselves, which the controller leaves to them. A value may hold any other character."""
    template = copy.deepcopy(USER_TEMPLATE)
    template["spec"]["containers"][1]["env"] += [
        {"name": "my.var-1", "value": "line\nbreak"},
        {"name": "1X", "value": "\u00e9t\u00e9"},
        {"name": "WITH SPACE", "value": ""},
    ]
    assert pods.template_problems(template, 1) == []


def test_a_template_env_variable_spotjob_leaves_alone_reaches_the_worker() -> None:
    """(Pins what already worked.) SPOTJOB_EVERY_SECONDS without spec.checkpoint.everySeconds, and
    the SPOTJOB_STORAGE_* tuning, are the user's to set in the template: the agent passes them on."""
    template = copy.deepcopy(USER_TEMPLATE)
    template["spec"]["containers"][1]["env"] += [
        {"name": "SPOTJOB_EVERY_SECONDS", "value": "600"},
        {"name": "SPOTJOB_STORAGE_CONCURRENCY", "value": "4"},
    ]
    assert pods.template_problems(template, 1, policy=["SPOTJOB_EVERY_STEPS"]) == []
    env = {e["name"]: e.get("value") for e in pod(0, template=template)["spec"]["containers"][1]["env"]}
    assert env["SPOTJOB_EVERY_SECONDS"] == "600"
    assert env["SPOTJOB_STORAGE_CONCURRENCY"] == "4"


def test_a_template_with_a_pod_deadline_is_refused_naming_the_field() -> None:
    """``activeDeadlineSeconds`` in the template: on a real cluster the kubelet ends a pod that ran
    that long (phase Failed, reason DeadlineExceeded) by stopping its containers with their grace
    period. The agent takes that SIGTERM as a notice, flushes and exits 75, so the job counted a
    preemption, started the next attempt with the same deadline, and so on for ever: no restart
    budget spent, never an end. (The test kubelet does not enforce the deadline; this checks the
    refusal, the rule the controller applies before any pod exists.)"""
    template = copy.deepcopy(USER_TEMPLATE)
    template["spec"]["activeDeadlineSeconds"] = 3600
    problems = pods.template_problems(template, 1)
    assert any(p.startswith("spec.template.spec.activeDeadlineSeconds") for p in problems), problems
