"""The generated SpotJob CRD against an API server: tests/k8s's test API server (or the cluster
``SPOTJOB_TEST_KUBECONFIG`` names), and the real kubectl.

The server takes the CRD (a structural schema), serves SpotJobs with it: the examples are accepted
and read back as valid jobs, what the schema refuses is answered 422 naming the field, a status as
the reconciler writes it is stored whole (nothing pruned), and ``kubectl get sj`` shows the
printer columns.
"""

from __future__ import annotations

import copy
import json
import shutil
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml

from orchestrator.crd import CRD_PATH
from orchestrator.model import (
    MAX_REPLICAS,
    AttemptStatus,
    Avoidance,
    Cause,
    CheckpointInfo,
    Condition,
    HeldNotice,
    JobKey,
    JobStatus,
    NodeRef,
    NotStarting,
    Phase,
    RecoveryStatus,
    RestartRecord,
    WorkerPhase,
    WorkerStatus,
    job_name_problem,
)
from orchestrator.store import parse_job
from tests.k8s.cluster import ApiCallError, TestCluster
from tests.k8s.fixtures import cluster, k8s_cluster, namespace
from tests.k8s.spotjob_crd import install_crd

__all__ = ["cluster", "k8s_cluster", "namespace"]

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = [REPO / "examples" / "spotjob-eks.yaml", REPO / "examples" / "spotjob-gke.yaml"]
PATH = "/apis/spotjob.dev/v1alpha1/namespaces/{ns}/spotjobs"


@pytest.fixture(scope="module")
def spotjob_crd(k8s_cluster: TestCluster) -> None:
    """The generated CRD, installed (replaced if one is there)."""
    install_crd(k8s_cluster)


def example(path: Path, namespace: str, name: str | None = None) -> dict[str, Any]:
    job = next(d for d in yaml.safe_load_all(path.read_text()) if d and d["kind"] == "SpotJob")
    job["metadata"]["namespace"] = namespace
    if name is not None:
        job["metadata"]["name"] = name
    return dict(job)


def a_status_as_the_reconciler_writes_it() -> JobStatus:
    """Every field of the status set, the way a job that was preempted and is flushing again has them."""
    t = datetime(2026, 3, 1, 12, 0, 0, tzinfo=UTC)
    return JobStatus(
        phase=Phase.FLUSHING,
        reason="SpotInterrupted",
        message="SpotInterruption for node n2 (from k8s-node): flushing the gang and moving it",
        observed_generation=1,
        conditions=[
            Condition(type="Ready", status="False", reason="SpotInterrupted", message="...", last_transition_time=t),
            Condition(type="Flushing", status="True", reason="SpotInterrupted", message="", last_transition_time=t),
            Condition(type="Degraded", status="False", reason="Healthy", message="ok", last_transition_time=t),
        ],
        attempt=AttemptStatus(
            number=2,
            started_at=t - timedelta(minutes=10),
            running_at=t - timedelta(minutes=9),
            resumed_from_step=500,
            first_step=501,
            first_step_at=t - timedelta(minutes=9),
            observed_step=940,
            observed_step_at=t,
            not_starting=NotStarting(
                worker="train-eks-2-1",
                reason="ImagePullBackOff",
                message="container trainer: Back-off pulling image",
                since=t - timedelta(minutes=10),
            ),
        ),
        workers=[
            WorkerStatus(
                name="train-eks-2-0",
                node="n2",
                zone="us-east-1a",
                instance_type="g5.xlarge",
                phase=WorkerPhase.RUNNING,
                step=940,
            ),
            WorkerStatus(name="train-eks-2-1", node="n3", phase=WorkerPhase.FAILED, exit_code=76),
        ],
        restarts=1,
        preemptions=2,
        consecutive_restarts=2,
        restart_history=[
            RestartRecord(
                time=t - timedelta(hours=1),
                attempt=0,
                cause=Cause.PREEMPTION,
                reason="SpotInterrupted",
                message="notice",
            ),
            RestartRecord(
                time=t - timedelta(minutes=11), attempt=1, cause=Cause.FAILURE, reason="WorkerFailed", message="exit 1"
            ),
        ],
        recovery=RecoveryStatus(
            cause=Cause.PREEMPTION,
            reason="SpotInterrupted",
            message="notice",
            detected_at=t,
            preempted=[NodeRef(node="n2", zone="us-east-1a", instance_type="g5.xlarge")],
            flush_deadline=t + timedelta(minutes=2),
            flush_timeout_at=t + timedelta(seconds=90),
            baseline_step=500,
            flush_requested=["train-eks-2-0"],
            flush_failed=["train-eks-2-1"],
        ),
        avoid=[Avoidance(kind="node", value="n1", until=t + timedelta(minutes=20), reason="SpotInterrupted")],
        checkpoint_uri="s3://bucket/ml/train",
        last_checkpoint=CheckpointInfo(step=500, uri="s3://bucket/ml/train/step-000000500", time=t),
        lost_steps=12,
        flushing_seconds=31.5,
        restarting_seconds=120.25,
        retraining_seconds=12.0,
        goodput=0.9312,
        created_at=t - timedelta(hours=2),
        start_time=t - timedelta(hours=2),
        infra_errors=0,
    )


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_the_example_spotjobs_are_accepted_and_read_back_as_valid_jobs(
    cluster: TestCluster, namespace: str, spotjob_crd: None, path: Path
) -> None:
    job = example(path, namespace)
    created = cluster.rest.request("POST", PATH.format(ns=namespace), job)

    name = created["metadata"]["name"]
    stored = parse_job(
        JobKey(namespace, name),
        created["spec"],
        created.get("status"),
        version=created["metadata"]["resourceVersion"],
        generation=created["metadata"]["generation"],
        uid=created["metadata"]["uid"],
    )
    assert stored.invalid is None and stored.spec is not None
    assert stored.spec.template == job["spec"]["template"], "the pod template is kept as written"
    assert stored.spec.replicas == 2 and stored.generation == 1


def test_the_api_server_refuses_what_the_schema_rejects_naming_the_field(
    cluster: TestCluster, namespace: str, spotjob_crd: None
) -> None:
    base = example(EXAMPLES[0], namespace, "refused")

    def refused(change: Any) -> str:
        job = copy.deepcopy(base)
        change(job["spec"])
        with pytest.raises(ApiCallError) as e:
            cluster.rest.request("POST", PATH.format(ns=namespace), job)
        assert e.value.status == 422
        return str(e.value)

    assert "spec.replicas" in refused(lambda s: s.update(replicas=0))
    assert "spec.checkpoint.uri" in refused(lambda s: s["checkpoint"].pop("uri"))
    assert "spec.flushTimeoutSeconds" in refused(lambda s: s.update(flushTimeoutSeconds=0))
    assert "spec.command" in refused(lambda s: s.update(command=[]))


def test_replicas_above_what_the_status_can_hold_are_refused_and_a_stored_job_with_them_is_invalid(
    cluster: TestCluster, namespace: str, spotjob_crd: None
) -> None:
    """replicas had no upper bound: a gang larger than MAX_REPLICAS outgrows the status the
    controller must write for it (a record per worker; tests/unit/test_crd.py has the sizes). The
    API server refuses it at create, naming spec.replicas, and a job stored before the bound (the
    API server never checks it again) is Invalid naming the same field, not run."""
    job = example(EXAMPLES[0], namespace, "replicas-max")
    job["spec"]["replicas"] = MAX_REPLICAS + 1
    with pytest.raises(ApiCallError) as e:
        cluster.rest.request("POST", PATH.format(ns=namespace), job)
    assert e.value.status == 422
    [cause] = e.value.body["details"]["causes"]
    assert cause["field"] == "spec.replicas" and str(MAX_REPLICAS) in cause["message"], cause
    stored = parse_job(JobKey(namespace, "replicas-max"), job["spec"], None, version="1")
    assert stored.spec is None and stored.invalid is not None
    assert stored.invalid.startswith("spec.replicas:") and str(MAX_REPLICAS) in stored.invalid, stored.invalid
    job["spec"]["replicas"] = MAX_REPLICAS
    assert cluster.rest.request("POST", PATH.format(ns=namespace), job)["spec"]["replicas"] == MAX_REPLICAS


def _no_template(spec: dict[str, Any]) -> None:
    spec.pop("template")
    spec.update(image="registry.example.com/train:1", startTimeoutSeconds=600, fallback={"template": {}})


@pytest.mark.parametrize(
    ("change", "field", "words"),
    [
        (lambda s: s.update(restartBackoff={"initialSeconds": 60, "maxSeconds": 30}), "spec.restartBackoff", "below"),
        # maxSeconds left out is its default, 300
        (lambda s: s.update(restartBackoff={"initialSeconds": 400}), "spec.restartBackoff", "below"),
        (lambda s: s.update(fallback={"template": {}}), "spec", "startTimeoutSeconds"),
        (_no_template, "spec", "spec.template"),
    ],
    ids=["max-below-initial", "default-max-below-initial", "fallback-without-timeout", "fallback-without-template"],
)
def test_the_api_server_refuses_what_the_controller_would_find_invalid(
    cluster: TestCluster, namespace: str, spotjob_crd: None, change: Any, field: str, words: str
) -> None:
    """The model's rules across fields (restartBackoff's cap below its start, a fallback without
    startTimeoutSeconds or without a template to patch) were checked by the controller only: the
    SpotJob was created, and the job then turned Invalid. The CRD's CEL rules refuse them at
    ``kubectl apply``, naming the field, as the model does. (The test API server evaluates CEL with
    cel-python, which does not type-check a rule against the schema as cel-go does.)"""
    job = example(EXAMPLES[0], namespace, "cross-field")
    change(job["spec"])
    model_problem = parse_job(JobKey(namespace, "cross-field"), job["spec"], None, version="1").invalid
    assert model_problem is not None and words in model_problem
    with pytest.raises(ApiCallError) as e:
        cluster.rest.request("POST", PATH.format(ns=namespace), job)
    assert e.value.status == 422
    [cause] = e.value.body["details"]["causes"]
    assert cause["field"] == field and words in cause["message"], cause


@pytest.mark.parametrize(
    ("env", "checkpoint", "words"),
    [
        ({"SPOTJOB_KEEP": "10"}, {}, "spec.checkpoint.keep"),
        ({"SPOTJOB_CHECKPOINT_URI": "s3://elsewhere/x"}, {}, "spec.checkpoint.uri"),
        ({"SPOTJOB_AGENT_LAUNCHER": "torchrun"}, {}, "agentLauncher"),
        ({"POD_IP": "10.0.0.1"}, {}, "downward API"),
        ({"SPOTJOB_EVERY_STEPS": "10"}, {"everySteps": 500}, "spec.checkpoint.everySteps"),
    ],
    ids=["keep", "uri", "launcher", "pod-ip", "every-steps-with-the-field"],
)
def test_spec_env_cannot_set_what_spotjob_sets_over_it(
    cluster: TestCluster, namespace: str, spotjob_crd: None, env: dict[str, str], checkpoint: Any, words: str
) -> None:
    """The controller passes the agent --keep, --checkpoint-uri, --job-name, --attempt, ... and sets
    SPOTJOB_AGENT_LAUNCHER and POD_NAME/POD_NAMESPACE/POD_IP itself: the same names in spec.env
    were accepted and then silently overridden (SPOTJOB_KEEP=10 kept 3 checkpoints). The API server
    refuses them, naming the field to use instead."""
    job = example(EXAMPLES[0], namespace, "env-over")
    job["spec"]["checkpoint"] = {"uri": job["spec"]["checkpoint"]["uri"], **checkpoint}
    job["spec"]["env"] = env
    with pytest.raises(ApiCallError) as e:
        cluster.rest.request("POST", PATH.format(ns=namespace), job)
    assert e.value.status == 422
    [cause] = e.value.body["details"]["causes"]
    assert cause["field"] == "spec.env" and words in cause["message"], cause


def test_spec_env_may_set_the_policy_variables_the_spec_leaves_out(
    cluster: TestCluster, namespace: str, spotjob_crd: None
) -> None:
    """Pins what already worked: without spec.checkpoint.everySteps the controller passes no
    --every-steps, so SPOTJOB_EVERY_STEPS in spec.env reaches the ranks and is accepted."""
    job = example(EXAMPLES[0], namespace, "env-policy")
    job["spec"]["checkpoint"] = {"uri": job["spec"]["checkpoint"]["uri"]}
    job["spec"]["env"] = {"SPOTJOB_EVERY_STEPS": "10", "SPOTJOB_STORAGE_CONCURRENCY": "4"}
    created = cluster.rest.request("POST", PATH.format(ns=namespace), job)
    assert created["spec"]["env"]["SPOTJOB_EVERY_STEPS"] == "10"


def test_a_nul_in_a_spec_env_value_is_refused_at_create(
    cluster: TestCluster, namespace: str, spotjob_crd: None
) -> None:
    """A NUL in a value (no process environment can carry it: the container never starts) was
    stored, and every attempt's pods then failed. The API server refuses it at create, naming the
    variable (a schema ``pattern``). The names are the controller's to check (``InvalidSpec``,
    ``tests/k8s_ctl/test_backend.py``): a CEL rule on them would walk the map."""
    job = example(EXAMPLES[0], namespace, "env-refused")
    job["spec"]["env"] = {"DATA": "a\x00b"}
    with pytest.raises(ApiCallError) as e:
        cluster.rest.request("POST", PATH.format(ns=namespace), job)
    assert e.value.status == 422
    [cause] = e.value.body["details"]["causes"]
    assert cause["field"] == "spec.env.DATA" and "should match" in cause["message"], cause


def test_spec_env_names_kubernetes_takes_since_1_32_are_accepted(
    cluster: TestCluster, namespace: str, spotjob_crd: None
) -> None:
    """Pins what already worked: '.', '-', a space or a leading digit in a name (taken since
    Kubernetes 1.32), and any character but NUL in a value."""
    job = example(EXAMPLES[0], namespace, "env-taken")
    job["spec"]["env"] = {"my.var-1": "line\nbreak", "1X": "\u00e9t\u00e9", "A B": "", "~!@#": "x"}
    created = cluster.rest.request("POST", PATH.format(ns=namespace), job)
    assert created["spec"]["env"] == job["spec"]["env"]


def crd_rule(*properties: str) -> dict[str, Any]:
    """The one CEL rule the shipped CRD puts on the node the property names lead to."""
    crd = yaml.safe_load(CRD_PATH.read_text())
    node = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    for name in properties:
        node = node["properties"][name]
    [rule] = node["x-kubernetes-validations"]
    return dict(rule)


def test_the_checkpoint_uri_cannot_change_by_update_or_merge_patch_while_the_rest_of_the_spec_can(
    cluster: TestCluster, namespace: str, spotjob_crd: None
) -> None:
    path = PATH.format(ns=namespace)
    message = crd_rule("spec", "checkpoint", "uri")["message"]
    created = cluster.rest.request("POST", path, example(EXAMPLES[0], namespace, "pinned"))
    immutable = {
        "reason": "FieldValueInvalid",
        "field": "spec.checkpoint.uri",
        "message": f'Invalid value: "string": {message}',
    }

    moved = copy.deepcopy(created)
    moved["spec"]["checkpoint"]["uri"] = "s3://another-bucket/ml-training/train-eks"
    with pytest.raises(ApiCallError) as e:
        cluster.rest.request("PUT", f"{path}/pinned", moved)
    assert e.value.status == 422 and e.value.body["details"]["causes"] == [immutable]
    patch: dict[str, Any] = {"spec": {"checkpoint": {"uri": "s3://another-bucket/x"}}}
    with pytest.raises(ApiCallError) as e:
        cluster.rest.request("PATCH", f"{path}/pinned", patch, content_type="application/merge-patch+json")
    assert e.value.status == 422 and e.value.body["details"]["causes"] == [immutable]
    assert cluster.rest.get(f"{path}/pinned")["spec"]["checkpoint"]["uri"] == created["spec"]["checkpoint"]["uri"]

    # The same URI written again, and every other field, still go through.
    edited = copy.deepcopy(created)
    edited["spec"]["checkpoint"]["everySteps"] = 250
    assert cluster.rest.request("PUT", f"{path}/pinned", edited)["spec"]["checkpoint"]["everySteps"] == 250
    patch = {"spec": {"replicas": 3, "checkpoint": {"uri": created["spec"]["checkpoint"]["uri"]}}}
    patched = cluster.rest.request("PATCH", f"{path}/pinned", patch, content_type="application/merge-patch+json")
    assert patched["spec"]["replicas"] == 3 and patched["metadata"]["generation"] == 3


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not on PATH")
def test_kubectl_apply_of_a_new_checkpoint_uri_is_refused_with_the_crds_message(
    cluster: TestCluster, namespace: str, spotjob_crd: None, tmp_path: Path
) -> None:
    message = crd_rule("spec", "checkpoint", "uri")["message"]
    job = example(EXAMPLES[1], namespace, "applied")
    manifest = tmp_path / "job.yaml"
    manifest.write_text(yaml.safe_dump(job))
    assert "created" in cluster.kubectl("apply", "-f", str(manifest)).stdout

    job["spec"]["checkpoint"]["uri"] = "gs://another-bucket/applied"
    manifest.write_text(yaml.safe_dump(job))
    out = cluster.kubectl("apply", "-f", str(manifest), check=False)
    assert out.returncode != 0
    assert f'spec.checkpoint.uri: Invalid value: "string": {message}' in out.stderr

    job = example(EXAMPLES[1], namespace, "applied")
    job["spec"]["replicas"] = 3
    manifest.write_text(yaml.safe_dump(job))
    assert "configured" in cluster.kubectl("apply", "-f", str(manifest)).stdout
    assert cluster.rest.get(f"{PATH.format(ns=namespace)}/applied")["spec"]["replicas"] == 3


def test_a_name_over_40_characters_is_refused_at_create(
    cluster: TestCluster, namespace: str, spotjob_crd: None
) -> None:
    message = crd_rule()["message"]
    path = PATH.format(ns=namespace)
    long_name = "a" * 41
    with pytest.raises(ApiCallError) as e:
        cluster.rest.request("POST", path, example(EXAMPLES[0], namespace, long_name))
    assert e.value.status == 422
    assert e.value.body["details"]["causes"] == [
        {"reason": "FieldValueInvalid", "field": "<nil>", "message": f'Invalid value: "object": {message}'}
    ]
    assert f'SpotJob.spotjob.dev "{long_name}" is invalid: <nil>: Invalid value: "object": {message}' in str(e.value)
    assert cluster.rest.request("POST", path, example(EXAMPLES[0], namespace, "a" * 40))["metadata"]["name"] == "a" * 40


@pytest.mark.parametrize("name", ["train.v2", "ml.team-a.llama"])
def test_a_name_that_is_no_dns_label_is_refused_at_create_as_the_controller_would_never_run_it(
    cluster: TestCluster, namespace: str, spotjob_crd: None, name: str
) -> None:
    """The API server takes any DNS subdomain as an object's name, dots included; the controller
    runs only a DNS label (its pods, Service and labels carry the name), so ``train.v2`` was created
    and then Invalid for good, its name being the one thing that cannot be edited. The CRD's rule
    on the name refuses it at create, with the controller's own pattern."""
    assert job_name_problem(name) is not None
    message = crd_rule()["message"]
    assert "no '.'" in message and "40 characters" in message, message
    with pytest.raises(ApiCallError) as e:
        cluster.rest.request("POST", PATH.format(ns=namespace), example(EXAMPLES[0], namespace, name))
    assert e.value.status == 422
    assert e.value.body["details"]["causes"] == [
        {"reason": "FieldValueInvalid", "field": "<nil>", "message": f'Invalid value: "object": {message}'}
    ]
    taken = "train-v2-0"
    assert job_name_problem(taken) is None
    created = cluster.rest.request("POST", PATH.format(ns=namespace), example(EXAMPLES[0], namespace, taken))
    assert created["metadata"]["name"] == taken


def test_a_spotjob_with_neither_image_nor_template_is_refused_at_create_and_one_of_them_is_enough(
    cluster: TestCluster, namespace: str, spotjob_crd: None
) -> None:
    """Both fields are optional, and without either the controller built a pod with no image, which
    the API server refused on every pass. The controller now finds it Invalid (spec_problems); the
    CRD's rule refuses it at ``kubectl apply``, naming spec.image."""
    path = PATH.format(ns=namespace)
    job = example(EXAMPLES[0], namespace, "no-image")
    job["spec"].pop("template")
    job["spec"].pop("image", None)
    with pytest.raises(ApiCallError) as e:
        cluster.rest.request("POST", path, job)
    assert e.value.status == 422
    [cause] = e.value.body["details"]["causes"]
    assert cause["field"] == "spec" and "spec.image is required without spec.template" in cause["message"], cause
    job["spec"]["image"] = "registry.example.com/train:1"
    assert cluster.rest.request("POST", path, job)["spec"]["image"] == "registry.example.com/train:1"
    with_template = example(EXAMPLES[0], namespace, "template-only")
    assert "image" not in with_template["spec"]
    cluster.rest.request("POST", path, with_template)


def test_a_status_as_the_reconciler_writes_it_is_stored_whole_and_shown_in_the_printer_columns(
    cluster: TestCluster, namespace: str, spotjob_crd: None
) -> None:
    created = cluster.rest.request("POST", PATH.format(ns=namespace), example(EXAMPLES[0], namespace, "shown"))
    status = a_status_as_the_reconciler_writes_it()
    body = {**created, "status": status.model_dump(mode="json", exclude_none=True)}

    written = cluster.rest.request("PUT", f"{PATH.format(ns=namespace)}/shown/status", body)

    assert written["status"] == body["status"], "nothing pruned, nothing defaulted"
    assert JobStatus.model_validate(written["status"]) == status
    bad = copy.deepcopy(written)
    bad["status"]["phase"] = "Sleeping"
    with pytest.raises(ApiCallError) as e:
        cluster.rest.request("PUT", f"{PATH.format(ns=namespace)}/shown/status", bad)
    assert e.value.status == 422 and "status.phase" in str(e.value)

    headers = dict(cluster.rest.headers, Accept="application/json;as=Table;v=v1;g=meta.k8s.io,application/json")
    answer = cluster.rest.pool.request("GET", f"{cluster.rest.host}{PATH.format(ns=namespace)}", headers=headers)
    table = json.loads(answer.data)
    columns = [c["name"] for c in table["columnDefinitions"] if c["priority"] == 0]
    assert columns == [
        "Name", "Phase", "Step", "Checkpoint", "Preemptions", "Restarts", "Goodput", "Capacity", "Held-Flush-At", "Age"
    ]  # fmt: skip
    [row] = table["rows"]
    assert row["cells"][:7] == ["shown", "Flushing", 500, row["cells"][3], 2, 1, 0.9312]


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not on PATH")
def test_kubectl_get_sj_shows_the_jobs_columns(cluster: TestCluster, namespace: str, spotjob_crd: None) -> None:
    created = cluster.rest.request("POST", PATH.format(ns=namespace), example(EXAMPLES[1], namespace, "seen"))
    status = a_status_as_the_reconciler_writes_it()
    body = {**created, "status": status.model_dump(mode="json", exclude_none=True)}
    cluster.rest.request("PUT", f"{PATH.format(ns=namespace)}/seen/status", body)

    out = cluster.kubectl("get", "sj", "-n", namespace).stdout
    header, line = out.splitlines()[:2]
    assert header.split() == [
        "NAME", "PHASE", "STEP", "CHECKPOINT", "PREEMPTIONS", "RESTARTS", "GOODPUT", "CAPACITY", "HELD-FLUSH-AT", "AGE"
    ]  # fmt: skip
    assert line.split()[:3] == ["seen", "Flushing", "500"] and line.split()[4:7] == ["2", "1", "0.9312"]
    wide = cluster.kubectl("get", "spotjobs", "-n", namespace, "-o", "wide").stdout
    assert wide.splitlines()[0].split()[-3:] == ["ATTEMPT", "REASON", "NOT-STARTING"]
    assert wide.splitlines()[1].split()[-3:] == ["2", "SpotInterrupted", "ImagePullBackOff"]


def test_kubectl_get_sj_shows_when_the_next_held_notice_flushes_and_nothing_for_a_job_holding_none(
    cluster: TestCluster, namespace: str, spotjob_crd: None
) -> None:
    """Two workers' agents hold a GCE maintenance notice each, listed next flush first as the
    reconciler writes them; another job holds none. Before, ``kubectl get sj`` showed neither: an
    operator scanning the list could not tell which jobs will flush, nor when. The column is the
    first notice's ``flushAt`` as written (UTC), and empty for the job that holds none."""
    t = datetime(2026, 3, 1, 12, 0, 0, tzinfo=UTC)

    def held(worker: str, flush_at: datetime) -> HeldNotice:
        return HeldNotice(
            worker=worker,
            node=f"node-{worker}",
            source="gcp",
            kind="maintenance",
            deadline=flush_at + timedelta(minutes=5),
            flush_at=flush_at,
            heard_at=t,
        )

    running = a_status_as_the_reconciler_writes_it().model_copy(
        update={"phase": Phase.RUNNING, "reason": "WorkersRunning", "recovery": None}
    )
    statuses = {
        "holding": running.model_copy(
            update={"held_notices": [held("w-1", t + timedelta(minutes=10)), held("w-0", t + timedelta(minutes=50))]}
        ),
        "plain": running,
    }
    for name, status in statuses.items():
        created = cluster.rest.request("POST", PATH.format(ns=namespace), example(EXAMPLES[0], namespace, name))
        body = {**created, "status": status.model_dump(mode="json", exclude_none=True)}
        cluster.rest.request("PUT", f"{PATH.format(ns=namespace)}/{name}/status", body)

    headers = dict(cluster.rest.headers, Accept="application/json;as=Table;v=v1;g=meta.k8s.io,application/json")
    answer = cluster.rest.pool.request("GET", f"{cluster.rest.host}{PATH.format(ns=namespace)}", headers=headers)
    table = json.loads(answer.data)
    column = [c["name"] for c in table["columnDefinitions"]].index("Held-Flush-At")
    assert {r["cells"][0]: r["cells"][column] for r in table["rows"]} == {
        "holding": "2026-03-01T12:10:00Z",
        "plain": None,
    }
    if shutil.which("kubectl") is None:
        return
    out = cluster.kubectl("get", "sj", "-n", namespace).stdout.splitlines()
    at = out[0].index("HELD-FLUSH-AT")
    width = len("2026-03-01T12:10:00Z")
    assert {line.split()[0]: line[at : at + width].strip() for line in out[1:]} == {
        "holding": "2026-03-01T12:10:00Z",
        "plain": "",
    }, out
