"""terraform/examples/eks (the AWS module, without the node group) applied and destroyed against
moto's server, and what it created checked with boto3: the bucket's settings, the roles' reach,
the queue's policy, and EventBridge delivering EC2 events to the queue in the envelope the
controller's queue reader parses (its parser is handed what arrived). Then the module's outputs feed the chart.

moto does not enforce IAM or queue policies: the policies are read back and evaluated here
(``_allowed``), not exercised by a denied request. Of the bucket policy it enforces the refusal of
plain HTTP, which its endpoint speaks: nothing here writes to the bucket through it. The EKS node
group is not applied (moto has no EC2 capacity to back it); `terraform validate` covers it.
"""

from __future__ import annotations

import ast
import fnmatch
import importlib
import inspect
import json
import shutil
import sys
import uuid
from collections.abc import Iterator
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import boto3
import botocore
import pytest
import yaml
from infra_support import REPO, TERRAFORM, container_args, one, render, terraform

from agent._layout import CHECKPOINT_MARKERS
from agent.catalog import CheckpointRef, latest_valid
from agent.ownership import OwnershipError, claim, read_attempt
from agent.storage import open_storage
from orchestrator.k8s.interruption_queue import MessageRejected, Outcome, SqsQueue, parse_message
from orchestrator.model import JobSpec, Phase
from orchestrator.reconciler import Reconciler, job_identity
from orchestrator.signals import SignalKind
from orchestrator.store import JsonFileJobStore

sys.path.insert(0, str(REPO / "tests" / "unit"))  # fakes: the reconciler tests' backend and clock
from fakes import KEY, FakeBackend, FakeClock, FakeNode, commit_checkpoint

pytestmark = pytest.mark.slow

OIDC = "arn:aws:iam::123456789012:oidc-provider/oidc.eks.us-east-1.amazonaws.com/id/EXAMPLED539D4633E53DE1B71EXAMPLE"
ISSUER = "oidc.eks.us-east-1.amazonaws.com/id/EXAMPLED539D4633E53DE1B71EXAMPLE"
# As production applies it: force_destroy left false. Stack.destroy sets it first.
VARS = ["-var", f"oidc_provider_arn={OIDC}"]
FORCE = ["-var", "force_destroy=true"]

OVERRIDE = """
provider "aws" {{
  region                      = "us-east-1"
  access_key                  = "testing"
  secret_key                  = "testing"
  skip_credentials_validation = true
  skip_metadata_api_check     = true
  skip_requesting_account_id  = true
  skip_region_validation      = true
  s3_use_path_style           = true

  endpoints {{
    s3     = "{endpoint}"
    iam    = "{endpoint}"
    sts    = "{endpoint}"
    sqs    = "{endpoint}"
    events = "{endpoint}"
    eks    = "{endpoint}"
  }}
}}
"""


class Stack:
    def __init__(self, workdir: Path, endpoint: str) -> None:
        self.workdir = workdir
        self.endpoint = endpoint
        self.outputs: dict[str, Any] = {}
        self.destroyed = False

    def client(self, service: str) -> Any:
        return boto3.session.Session().client(service, endpoint_url=self.endpoint, region_name="us-east-1")

    def output(self, name: str) -> Any:
        return self.outputs[name]["value"]

    def destroy(self) -> str:
        """force_destroy applied, then destroyed (a destroy reads force_destroy from the state).
        Neither refreshes: the apply or destroy before each (this file's, or the fixture's) read
        every resource back into the state already, and a refresh of them all costs each command
        a few CPU-seconds of the provider's."""
        for step in ("apply", "destroy"):
            proc = terraform(self.workdir, step, "-auto-approve", "-input=false", "-refresh=false", *VARS, *FORCE)
            if proc.returncode != 0:
                return proc.stdout + proc.stderr
        self.destroyed = True
        return ""


@pytest.fixture(scope="module")
def stack(moto_server: str, tf_plugin_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """The EKS example applied once against moto; destroyed at the end. About a minute, nearly all
    of it the AWS provider (5.100) waiting, not working: after PutBucketLifecycleConfiguration it
    reads the lifecycle back every 5 s for about 55 s (moto answers the same each time), and the
    queue's attributes for about 25 s alongside; the apply itself takes some 11 CPU-seconds. Those
    waits are fixed in the provider's resources: no provider-block setting switches them off
    (the skip_* settings below already spare the credential, account-id and metadata lookups)."""
    root = tmp_path_factory.mktemp("tf-aws") / "terraform"
    shutil.copytree(TERRAFORM, root, ignore=shutil.ignore_patterns(".terraform", "*.tfstate*", ".terraform.lock.hcl"))
    workdir = root / "examples" / "eks"
    # An *_override.tf file merges into the example's provider block: same code, moto's endpoints.
    (workdir / "moto_override.tf").write_text(OVERRIDE.format(endpoint=moto_server))
    init = terraform(workdir, "init", "-backend=false", f"-plugin-dir={tf_plugin_dir}", "-input=false")
    assert init.returncode == 0, init.stdout + init.stderr
    stack = Stack(workdir, moto_server)
    apply = terraform(workdir, "apply", "-auto-approve", "-input=false", *VARS)
    try:
        assert apply.returncode == 0, apply.stdout + apply.stderr
        out = terraform(workdir, "output", "-json")
        assert out.returncode == 0, out.stderr
        stack.outputs = json.loads(out.stdout)
        yield stack
    finally:
        if not stack.destroyed:
            stack.destroy()


# -- a small evaluator of identity policies (moto does not enforce them) ------------------------------


def _matches(patterns: str | list[str], value: str) -> bool:
    patterns = [patterns] if isinstance(patterns, str) else patterns
    return any(fnmatch.fnmatchcase(value, p) for p in patterns)


def _conditions_hold(condition: dict[str, Any], context: dict[str, str]) -> bool:
    for test, checks in condition.items():
        for key, wanted in checks.items():
            wanted = [wanted] if isinstance(wanted, str) else wanted
            have = context.get(key)
            if have is None:
                return False
            if test == "StringLike" and not any(fnmatch.fnmatchcase(have, w) for w in wanted):
                return False
            if test == "StringEquals" and have not in wanted:
                return False
            if test not in ("StringLike", "StringEquals"):
                raise AssertionError(f"the evaluator does not know {test}")
    return True


def _allowed(policy: dict[str, Any], action: str, resource: str, context: dict[str, str] | None = None) -> bool:
    """Whether an identity policy allows the request (Allow statements only; none here denies)."""
    for statement in policy["Statement"]:
        assert statement["Effect"] == "Allow", statement
        if not _matches(statement["Action"], action) or not _matches(statement["Resource"], resource):
            continue
        if _conditions_hold(statement.get("Condition", {}), context or {}):
            return True
    return False


def _role_policy(stack: Stack, role: str) -> dict[str, Any]:
    iam = stack.client("iam")
    (name,) = iam.list_role_policies(RoleName=role)["PolicyNames"]
    document = iam.get_role_policy(RoleName=role, PolicyName=name)["PolicyDocument"]
    return document if isinstance(document, dict) else json.loads(document)


def _trust(stack: Stack, role: str) -> dict[str, Any]:
    document = stack.client("iam").get_role(RoleName=role)["Role"]["AssumeRolePolicyDocument"]
    return document if isinstance(document, dict) else json.loads(document)


# -- the bucket --------------------------------------------------------------------------------------


def test_the_bucket_is_versioned_encrypted_private_and_tls_only(stack: Stack) -> None:
    s3 = stack.client("s3")
    bucket = stack.output("checkpoint_bucket")
    assert s3.get_bucket_versioning(Bucket=bucket)["Status"] == "Enabled"
    (rule,) = s3.get_bucket_encryption(Bucket=bucket)["ServerSideEncryptionConfiguration"]["Rules"]
    assert rule["ApplyServerSideEncryptionByDefault"]["SSEAlgorithm"] == "AES256"
    block = s3.get_public_access_block(Bucket=bucket)["PublicAccessBlockConfiguration"]
    assert block == dict.fromkeys(
        ("BlockPublicAcls", "IgnorePublicAcls", "BlockPublicPolicy", "RestrictPublicBuckets"), True
    )
    ownership = s3.get_bucket_ownership_controls(Bucket=bucket)["OwnershipControls"]["Rules"]
    assert ownership == [{"ObjectOwnership": "BucketOwnerEnforced"}]
    policy = json.loads(s3.get_bucket_policy(Bucket=bucket)["Policy"])
    denies = {s["Sid"]: s for s in policy["Statement"] if s["Effect"] == "Deny"}
    assert denies["DenyInsecureTransport"]["Condition"] == {"Bool": {"aws:SecureTransport": "false"}}
    assert denies["DenyOutdatedTLS"]["Condition"] == {"NumericLessThan": {"s3:TlsVersion": "1.2"}}
    assert not [s for s in policy["Statement"] if s["Effect"] == "Allow"]


def test_the_lifecycle_expires_only_what_spotjob_already_deleted(stack: Stack) -> None:
    rules = stack.client("s3").get_bucket_lifecycle_configuration(Bucket=stack.output("checkpoint_bucket"))["Rules"]
    by_id = {r["ID"]: r for r in rules}
    expire = by_id["expire-deleted-checkpoints"]
    assert expire["Status"] == "Enabled"
    assert expire["NoncurrentVersionExpiration"]["NoncurrentDays"] == 7
    # No Days or Date: current objects (the newest valid checkpoint) never expire.
    assert expire["Expiration"] == {"ExpiredObjectDeleteMarker": True}
    abort = by_id["abort-incomplete-multipart-uploads"]
    assert abort["AbortIncompleteMultipartUpload"]["DaysAfterInitiation"] == 1
    for rule in rules:
        assert rule["Filter"].get("Prefix", "") == "", "the rules cover the whole bucket"


# -- the roles ---------------------------------------------------------------------------------------


def test_the_training_role_is_trusted_by_its_namespace_and_reaches_only_its_prefix(stack: Stack) -> None:
    role_arn = stack.output("training_role_arns")["ml-training"]
    role = role_arn.rsplit("/", 1)[1]
    (statement,) = _trust(stack, role)["Statement"]
    assert statement["Action"] == "sts:AssumeRoleWithWebIdentity"
    assert statement["Principal"] == {"Federated": OIDC}
    assert statement["Condition"]["StringEquals"] == {
        f"{ISSUER}:sub": "system:serviceaccount:ml-training:spotjob-training",
        f"{ISSUER}:aud": "sts.amazonaws.com",
    }
    policy = _role_policy(stack, role)
    bucket = f"arn:aws:s3:::{stack.output('checkpoint_bucket')}"
    job = f"{bucket}/ml-training/train-eks"
    for action in ("s3:GetObject", "s3:PutObject", "s3:DeleteObject", "s3:AbortMultipartUpload"):
        assert _allowed(policy, action, f"{job}/step-000000100/MANIFEST.json"), action
        assert not _allowed(policy, action, f"{bucket}/research/train/step-000000100/MANIFEST.json"), action
        assert not _allowed(policy, action, f"{bucket}/ml-training-other/x"), action
    # Rank 0's create-only probe (agent/storage/s3.py check_create_only): written twice, deleted.
    for action in ("s3:PutObject", "s3:DeleteObject"):
        assert _allowed(policy, action, f"{job}/.spotjob/probes/create-only-probe-0123abcd"), action
    assert _allowed(policy, "s3:ListBucket", bucket, {"s3:prefix": "ml-training/train-eks/"})
    assert not _allowed(policy, "s3:ListBucket", bucket, {"s3:prefix": "research/"})
    assert not _allowed(policy, "s3:ListBucket", bucket, {"s3:prefix": ""})
    assert not _allowed(policy, "s3:DeleteBucket", bucket)
    assert not _allowed(policy, "sqs:ReceiveMessage", stack.output("interruption_queue_url"))


# Each S3 call of agent/storage/s3.py and the IAM action that authorises it
# (https://docs.aws.amazon.com/service-authorization/latest/reference/list_amazons3.html).
S3_CALL_ACTIONS = {
    "put_object": "s3:PutObject",
    "create_multipart_upload": "s3:PutObject",
    "upload_part": "s3:PutObject",
    "complete_multipart_upload": "s3:PutObject",
    "abort_multipart_upload": "s3:AbortMultipartUpload",
    "get_object": "s3:GetObject",
    "head_object": "s3:GetObject",
    "list_objects_v2": "s3:ListBucket",
    "head_bucket": "s3:ListBucket",
    "delete_objects": "s3:DeleteObject",
    "delete_object": "s3:DeleteObject",
}


def _s3_calls() -> set[str]:
    """Every method the storage calls on its boto3 client (``self._client.<method>``), read from its source."""
    source = (REPO / "agent" / "storage" / "s3.py").read_text()
    calls = {
        node.attr
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Attribute)
        and node.value.attr == "_client"
        and isinstance(node.value.value, ast.Name)
        and node.value.value.id == "self"
    }
    return calls - {"close", "meta"}  # neither sends a request: closing, the client's own metadata


def test_the_training_role_grants_exactly_what_the_s3_storage_calls(stack: Stack) -> None:
    calls = _s3_calls()
    unknown = calls - set(S3_CALL_ACTIONS)
    assert not unknown, f"agent/storage/s3.py calls {sorted(unknown)}: add their IAM actions to S3_CALL_ACTIONS"
    needed = {S3_CALL_ACTIONS[c] for c in calls}
    role = stack.output("training_role_arns")["ml-training"].rsplit("/", 1)[1]
    granted = {
        action
        for s in _role_policy(stack, role)["Statement"]
        for action in ([s["Action"]] if isinstance(s["Action"], str) else s["Action"])
        if action.startswith("s3:")
    }
    assert not granted - needed, f"granted but never called: {sorted(granted - needed)}"
    assert not needed - granted, f"called but not granted: {sorted(needed - granted)}"


def test_the_controller_role_reads_manifests_keeps_records_and_reads_its_queue(stack: Stack) -> None:
    role = "spotjob-controller"
    (statement,) = _trust(stack, role)["Statement"]
    assert statement["Condition"]["StringEquals"][f"{ISSUER}:sub"] == "system:serviceaccount:spotjob-system:spotjob"
    policy = _role_policy(stack, role)
    bucket = f"arn:aws:s3:::{stack.output('checkpoint_bucket')}"
    job = f"{bucket}/ml-training/train-eks"
    assert _allowed(policy, "s3:ListBucket", bucket)
    # The markers of a checkpoint's folder: the manifests it judges flushes by, and the claim its first
    # look at a URI looks for (a URI that is a checkpoint's own folder is refused).
    for name in CHECKPOINT_MARKERS:
        assert _allowed(policy, "s3:GetObject", f"{job}/step-000000100/{name}"), name
        assert _allowed(policy, "s3:GetObject", f"{job}/{name}"), name
    assert not _allowed(policy, "s3:GetObject", f"{job}/step-000000100/__0_0.distcp"), "the controller reads no shards"
    assert not _allowed(policy, "s3:GetObject", f"{job}/step-000000100/.metadata"), "nor DCP's metadata"
    assert not _allowed(policy, "s3:PutObject", f"{job}/step-000000100/MANIFEST.json")
    assert not _allowed(policy, "s3:DeleteObject", f"{job}/step-000000100/MANIFEST.json")
    for record in (".spotjob/owner.json", ".spotjob/attempts/ml-training_train-eks.1f3a/attempt-000000002.json"):
        assert _allowed(policy, "s3:PutObject", f"{job}/{record}"), record
        assert _allowed(policy, "s3:GetObject", f"{job}/{record}"), record
        assert not _allowed(policy, "s3:DeleteObject", f"{job}/{record}"), record
    queue = stack.client("sqs").get_queue_attributes(
        QueueUrl=stack.output("interruption_queue_url"), AttributeNames=["QueueArn"]
    )["Attributes"]["QueueArn"]
    for action in ("sqs:ReceiveMessage", "sqs:DeleteMessage"):
        assert _allowed(policy, action, queue), action
        assert not _allowed(policy, action, queue.replace("spotjob-interruptions", "Karpenter-training")), action
    assert not _allowed(policy, "sqs:SendMessage", queue)


def test_the_controller_role_grants_exactly_the_sqs_calls_the_queue_reader_makes(stack: Stack) -> None:
    """The reader is run against the queue and its requests recorded: the role allows each of them,
    and no other SQS action (the reader is handed the URL: it never looks the queue up)."""
    url = stack.output("interruption_queue_url")
    queue_arn = stack.client("sqs").get_queue_attributes(QueueUrl=url, AttributeNames=["QueueArn"])["Attributes"][
        "QueueArn"
    ]
    _drain(stack)
    stack.client("sqs").send_message(QueueUrl=url, MessageBody="{}")
    reader = SqsQueue(url, "us-east-1")
    called: set[str] = set()
    reader._client.meta.events.register("before-call.sqs", lambda model, **_: called.add(f"sqs:{model.name}"))
    messages = reader.receive(10, 1)
    assert messages
    for message in messages:
        reader.delete(message)
    assert called == {"sqs:ReceiveMessage", "sqs:DeleteMessage"}

    policy = _role_policy(stack, "spotjob-controller")
    granted = {
        action
        for s in policy["Statement"]
        if _matches(s["Resource"], queue_arn)
        for action in ([s["Action"]] if isinstance(s["Action"], str) else s["Action"])
        if action.startswith("sqs:")
    }
    assert granted == called, f"granted but never called: {sorted(granted - called)}"


TRACE_BUCKET = "controller-trace"
"""Where the controller's requests are traced: moto enforces the module's bucket's TLS-only policy on
its plain-HTTP endpoint, so they go to a bucket of their own and are judged as made to the module's."""

TRACED = {"claim", "latest_valid", "newest_attempt", "read_attempt", "record_attempt"}
"""The storage functions ``test_every_s3_request_the_controller_makes_is_granted`` runs."""


class _Trace:
    """The S3 requests made through one S3Storage's client, each as (IAM action, the resource in the
    module's bucket, the request's condition keys)."""

    def __init__(self, storage: Any, bucket_arn: str) -> None:
        self.requests: list[tuple[str, str, dict[str, str]]] = []
        self._bucket_arn = bucket_arn
        storage._client.meta.events.register("before-parameter-build.s3", self._record)

    def _record(self, model: Any, params: dict[str, Any], **_: Any) -> None:
        call = botocore.xform_name(model.name)
        assert call in S3_CALL_ACTIONS, f"the controller calls {call}: add its IAM action to S3_CALL_ACTIONS"
        key, context = params.get("Key"), {}
        if "Prefix" in params:
            context["s3:prefix"] = params["Prefix"]
        resource = self._bucket_arn + (f"/{key}" if key is not None else "")
        self.requests.append((S3_CALL_ACTIONS[call], resource, context))


def _storage_functions_the_controller_calls() -> set[str]:
    """The functions of agent.* that take a Storage which orchestrator/reconciler imports, read from its source."""
    found = set()
    for path in (REPO / "orchestrator" / "reconciler").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("agent."):
                module = importlib.import_module(node.module)
                for alias in node.names:
                    obj = getattr(module, alias.name)
                    if inspect.isfunction(obj) and "storage" in inspect.signature(obj).parameters:
                        found.add(alias.name)
    return found


def test_every_s3_request_the_controller_makes_is_granted(stack: Stack, tmp_path: Path) -> None:
    """The real reconciler runs a new SpotJob on S3 (moto) through its first attempt, a preemption
    and the attempt resumed from the checkpoint committed meanwhile; then the storage calls it makes
    on paths that run takes not (a URI holding another job's checkpoints, an attempt record read
    back, an older checkpoint looked for): every request is one the controller role grants. The
    first look at a new URI asked for WRITER.json, which the role did not grant: every new SpotJob on
    EKS failed with StorageRefused. (The workers' commits go through storage of their own, untraced:
    the training role's.)"""
    reconciler_calls = _storage_functions_the_controller_calls()
    assert reconciler_calls <= TRACED, f"the reconciler calls {sorted(reconciler_calls - TRACED)}: trace them here"
    stack.client("s3").create_bucket(Bucket=TRACE_BUCKET)
    bucket_arn = f"arn:aws:s3:::{stack.output('checkpoint_bucket')}"
    traces: list[_Trace] = []

    def controller_storage(uri: str) -> Any:
        storage = open_storage(uri)
        traces.append(_Trace(storage, bucket_arn))
        return storage

    uri = f"s3://{TRACE_BUCKET}/ml-training/train-eks"
    clock = FakeClock()
    nodes = [FakeNode(f"n{i}", "zone-a", "g5.xlarge") for i in range(3)]
    backend = FakeBackend(clock, open_storage(uri), nodes)
    store = JsonFileJobStore(str(tmp_path / "jobs"), fsync=False)
    spec = {"command": ["python", "train.py"], "replicas": 2, "checkpoint": {"uri": uri}, "flushTimeoutSeconds": 30}
    store.create(KEY, JobSpec.model_validate(spec))
    reconciler = Reconciler(store, backend, clock, storage_factory=controller_storage)

    def run_until(phase: Phase, attempt: int) -> None:
        for _ in range(200):
            result = reconciler.reconcile(KEY)
            status = store.get(KEY).status  # type: ignore[union-attr]
            assert status is not None and status.phase is not Phase.FAILED, status and status.message
            if status.phase is phase and status.attempt.number == attempt:
                return
            clock.sleep(result.requeue_after or 1.0)
        raise AssertionError(f"not {phase} in attempt {attempt} after 200 passes")

    run_until(Phase.RUNNING, 0)
    clock.sleep(20)
    backend.notice("n0")
    run_until(Phase.RUNNING, 1)
    assert backend.commits, "the flush committed a checkpoint, which attempt 1 resumed from"

    job = job_identity(KEY)
    storage = controller_storage(uri)
    read_attempt(storage, job, 1)
    latest_valid(storage, before=CheckpointRef(backend.commits[-1]))
    other = f"s3://{TRACE_BUCKET}/ml-training/copied"
    commit_checkpoint(open_storage(other), 10, clock.now(), job="research/train")
    with pytest.raises(OwnershipError):
        claim(controller_storage(other), job)

    requests = [r for trace in traces for r in trace.requests]
    assert {r[0] for r in requests} >= {"s3:GetObject", "s3:PutObject", "s3:ListBucket"}, requests
    policy = _role_policy(stack, "spotjob-controller")
    refused = [r for r in requests if not _allowed(policy, *r)]
    assert not refused, f"the controller role refuses these requests the controller makes: {refused}"


# -- the queue and its rules -------------------------------------------------------------------------


def test_the_queue_lets_only_eventbridge_send_and_only_for_spotjobs_rules(stack: Stack) -> None:
    attrs = stack.client("sqs").get_queue_attributes(
        QueueUrl=stack.output("interruption_queue_url"), AttributeNames=["All"]
    )["Attributes"]
    assert attrs["SqsManagedSseEnabled"] == "true"
    assert attrs["MessageRetentionPeriod"] == "300"
    policy = json.loads(attrs["Policy"])
    (allow,) = [s for s in policy["Statement"] if s["Effect"] == "Allow"]
    assert allow["Principal"] == {"Service": "events.amazonaws.com"}
    assert allow["Action"] == "sqs:SendMessage"
    assert allow["Resource"] == attrs["QueueArn"]
    rules = stack.output("interruption_event_rule_arns")
    assert set(rules) == {"spot-interruption", "rebalance", "state-change"}
    assert sorted(allow["Condition"]["ArnEquals"]["aws:SourceArn"]) == sorted(rules.values())
    (deny,) = [s for s in policy["Statement"] if s["Effect"] == "Deny"]
    assert deny["Condition"] == {"Bool": {"aws:SecureTransport": "false"}}


def test_each_rule_matches_its_ec2_event_and_targets_the_queue(stack: Stack) -> None:
    events = stack.client("events")
    queue_arn = stack.client("sqs").get_queue_attributes(
        QueueUrl=stack.output("interruption_queue_url"), AttributeNames=["QueueArn"]
    )["Attributes"]["QueueArn"]
    expected = {
        "spot-interruption": "EC2 Spot Instance Interruption Warning",
        "rebalance": "EC2 Instance Rebalance Recommendation",
        "state-change": "EC2 Instance State-change Notification",
    }
    for key, detail_type in expected.items():
        rule = events.describe_rule(Name=f"spotjob-{key}")
        pattern = json.loads(rule["EventPattern"])
        assert pattern["source"] == ["aws.ec2"] and pattern["detail-type"] == [detail_type]
        assert rule["State"] == "ENABLED"
        (target,) = events.list_targets_by_rule(Rule=f"spotjob-{key}")["Targets"]
        assert target["Arn"] == queue_arn


def _put(stack: Stack, detail_type: str, detail: dict[str, Any], instance: str) -> None:
    response = stack.client("events").put_events(
        Entries=[
            {
                "Source": "aws.ec2",
                "DetailType": detail_type,
                "Detail": json.dumps(detail),
                "Resources": [f"arn:aws:ec2:us-east-1b:instance/{instance}"],
            }
        ]
    )
    assert response["FailedEntryCount"] == 0, response


def _drain(stack: Stack) -> list[dict[str, Any]]:
    sqs = stack.client("sqs")
    url = stack.output("interruption_queue_url")
    bodies = []
    while True:
        messages = sqs.receive_message(QueueUrl=url, MaxNumberOfMessages=10, WaitTimeSeconds=1).get("Messages", [])
        if not messages:
            return bodies
        for m in messages:
            bodies.append(json.loads(m["Body"]))
            sqs.delete_message(QueueUrl=url, ReceiptHandle=m["ReceiptHandle"])


def test_a_spot_interruption_warning_reaches_the_queue_in_the_envelope_the_queue_reader_parses(stack: Stack) -> None:
    """The body EventBridge delivered is handed to the controller's queue reader's parser: a spot
    interruption of that instance, its deadline two minutes after the event's ``time``."""
    _drain(stack)
    instance = f"i-{uuid.uuid4().hex[:17]}"
    detail = {"instance-id": instance, "instance-action": "terminate"}
    _put(stack, "EC2 Spot Instance Interruption Warning", detail, instance)
    (body,) = _drain(stack)
    assert body["detail-type"] == "EC2 Spot Instance Interruption Warning"
    assert body["source"] == "aws.ec2"
    assert body["detail"]["instance-id"] == instance
    assert body["detail"]["instance-action"] == "terminate"
    # ISO 8601 in UTC, when EC2 issued the warning: the two minutes count from here.
    issued = datetime.fromisoformat(body["time"].replace("Z", "+00:00"))
    assert issued.tzinfo is not None
    assert body["region"] == "us-east-1"
    assert body["resources"] == [f"arn:aws:ec2:us-east-1b:instance/{instance}"]
    assert {"version", "id"} <= set(body)  # EventBridge also sends "account"; moto leaves it out

    message = parse_message(json.dumps(body))
    assert (message.kind, message.instance_id, message.message_id) == (
        SignalKind.SPOT_INTERRUPTION,
        instance,
        body["id"],
    )
    assert message.time == issued and message.deadline == issued + timedelta(minutes=2)


def test_rebalance_terminating_and_running_again_arrive_other_ec2_events_do_not(stack: Stack) -> None:
    """Running arrives too: an instance stopped and started again keeps its Node name, and the
    reader removes the notice of its stop from that Node when it hears it runs again."""
    _drain(stack)
    a, b, c, d, e = (f"i-{uuid.uuid4().hex[:17]}" for _ in range(5))
    _put(stack, "EC2 Instance Rebalance Recommendation", {"instance-id": a}, a)
    _put(stack, "EC2 Instance State-change Notification", {"instance-id": b, "state": "shutting-down"}, b)
    _put(stack, "EC2 Instance State-change Notification", {"instance-id": c, "state": "running"}, c)
    _put(stack, "EC2 Instance State-change Notification", {"instance-id": e, "state": "pending"}, e)
    _put(stack, "EC2 AMI State Change", {"ImageId": "ami-0123456789abcdef0", "State": "available"}, d)
    bodies = _drain(stack)
    arrived = {(m["detail-type"], m["detail"].get("instance-id")) for m in bodies}
    assert arrived == {
        ("EC2 Instance Rebalance Recommendation", a),
        ("EC2 Instance State-change Notification", b),
        ("EC2 Instance State-change Notification", c),
    }
    by_instance = {m["detail"]["instance-id"]: json.dumps(m) for m in bodies}
    parsed = {i: parse_message(by_instance[i]).kind for i in (a, b)}
    assert parsed == {a: SignalKind.REBALANCE, b: SignalKind.TERMINATING}
    with pytest.raises(MessageRejected) as running:
        parse_message(by_instance[c])
    assert running.value.outcome is Outcome.IGNORED and running.value.started is not None
    assert running.value.started[0] == c


# -- the chart takes the module's outputs ------------------------------------------------------------


def test_the_examples_helm_values_configure_the_chart(stack: Stack) -> None:
    values = yaml.safe_load(stack.output("helm_values_yaml"))
    objects = render(values)
    sa = one(objects, "ServiceAccount")
    assert sa["metadata"]["name"] == "spotjob"  # the name the controller role's trust names
    role_arn = "arn:aws:iam::123456789012:role/spotjob-controller"
    assert sa["metadata"]["annotations"]["eks.amazonaws.com/role-arn"] == role_arn
    assert one(objects, "Deployment")["spec"]["template"]["spec"]["serviceAccountName"] == "spotjob"
    args = container_args(objects)
    assert f"--interruption-queue-url={stack.output('interruption_queue_url')}" in args
    assert "--aws-region=us-east-1" in args
    assert "--namespace=ml-training" in args


def test_variable_validation_refuses_nested_prefixes(stack: Stack, tf_plugin_dir: Path) -> None:
    """An outer prefix's role could read and delete the inner one's checkpoints: refused at plan."""
    root = stack.workdir.parent / "nested-prefixes"
    root.mkdir()
    identities = (
        '{ outer = { namespace = "a", service_account = "t", prefix = "teams" },'
        ' inner = { namespace = "b", service_account = "t", prefix = "teams/b" } }'
    )
    (root / "main.tf").write_text(
        f'module "spotjob" {{\n  source = "../../modules/aws"\n  oidc_provider_arn = "{OIDC}"\n'
        f"  training_identities = {identities}\n}}\n"
    )
    shutil.copy(stack.workdir / "moto_override.tf", root / "provider.tf")
    init = terraform(root, "init", "-backend=false", f"-plugin-dir={tf_plugin_dir}", "-input=false")
    assert init.returncode == 0, init.stdout + init.stderr
    plan = terraform(root, "plan", "-input=false")
    assert plan.returncode != 0
    assert "inside another's" in plan.stderr, plan.stdout + plan.stderr


def test_a_name_that_makes_a_bucket_name_s3_refuses_fails_at_plan_naming_name(
    stack: Stack, tf_plugin_dir: Path
) -> None:
    """The default bucket name is "<name>-checkpoints-<account id>". bucket_name's validation refuses
    the prefixes S3 keeps for itself (xn--, sthree-, amzn-s3-demo-), but a name beginning with one
    passed the plan and S3 refused CreateBucket at apply. A precondition now refuses it at plan,
    naming name; with bucket_name given, name makes no bucket name and such a name passes."""
    root = stack.workdir.parent / "bucket-prefixes"
    root.mkdir()
    refused = ("xn--sj", "sthree-sj", "amzn-s3-demo-sj")
    calls = {**{name: "" for name in refused}, "xn--own": '  bucket_name = "own-checkpoints"\n'}
    (root / "main.tf").write_text(
        "".join(
            f'module "m{i}" {{\n  source = "../../modules/aws"\n  oidc_provider_arn = "{OIDC}"\n'
            f'  name = "{name}"\n  create_interruption_queue = false\n{extra}}}\n'
            for i, (name, extra) in enumerate(calls.items())
        )
    )
    shutil.copy(stack.workdir / "moto_override.tf", root / "provider.tf")
    init = terraform(root, "init", "-backend=false", f"-plugin-dir={tf_plugin_dir}", "-input=false")
    assert init.returncode == 0, init.stdout + init.stderr
    plan = terraform(root, "plan", "-input=false")
    assert plan.returncode != 0, plan.stdout
    said = " ".join((plan.stdout + plan.stderr).split())
    for name in refused:
        assert f'name "{name}" makes the bucket name "{name}-checkpoints-123456789012"' in said, said
    assert said.count("may not begin with xn--, sthree- or amzn-s3-demo-: choose another name") == 3, said
    assert 'name "xn--own"' not in said, "with bucket_name given, name makes no bucket name"


KMS_KEY = "arn:aws:kms:us-east-1:123456789012:key/1234abcd-12ab-34cd-56ef-1234567890ab"


def test_a_kms_key_encrypts_the_bucket_and_both_roles_may_use_it(stack: Stack, tf_plugin_dir: Path) -> None:
    """Pins what already worked (a plan, not an apply: moto has no such key): with ``kms_key_arn``
    the bucket encrypts with it (SSE-KMS and a bucket key), and the training and controller roles
    get kms:Decrypt and kms:GenerateDataKey on that key alone (a PutObject, a multipart upload and a
    GetObject of an SSE-KMS object are refused without them). No queue here, so the controller's
    policy is known at plan. The module is the root here, its inputs given with -var, so that
    ``terraform console -plan`` reads the planned resources in one command: a plan saved and then
    shown as JSON started the provider twice more (about 5 CPU-seconds)."""
    root = stack.workdir.parent / "kms"
    shutil.copytree(stack.workdir.parent.parent / "modules" / "aws", root)
    shutil.copy(stack.workdir / "moto_override.tf", root / "provider.tf")
    init = terraform(root, "init", "-backend=false", f"-plugin-dir={tf_plugin_dir}", "-input=false")
    assert init.returncode == 0, init.stdout + init.stderr
    inputs = {
        "oidc_provider_arn": OIDC,
        "kms_key_arn": KMS_KEY,
        "create_interruption_queue": "false",
        "training_identities": '{ ml = { namespace = "ml", service_account = "t", prefix = "ml" } }',
    }
    planned = (
        "jsonencode({ rule = aws_s3_bucket_server_side_encryption_configuration.this.rule,"
        ' training = aws_iam_role_policy.training["ml"].policy, controller = aws_iam_role_policy.controller.policy })'
    )
    variables = [arg for name, value in inputs.items() for arg in ("-var", f"{name}={value}")]
    console = terraform(root, "console", "-plan", *variables, stdin=planned)
    assert console.returncode == 0, console.stdout + console.stderr
    after = json.loads(json.loads(console.stdout))  # the console prints the JSON as a quoted string
    (rule,) = after["rule"]
    (default,) = rule["apply_server_side_encryption_by_default"]
    assert default == {"kms_master_key_id": KMS_KEY, "sse_algorithm": "aws:kms"}
    assert rule["bucket_key_enabled"] is True
    for role in ("training", "controller"):
        policy = json.loads(after[role])
        for action in ("kms:Decrypt", "kms:GenerateDataKey"):
            assert _allowed(policy, action, KMS_KEY), (role, action)
            assert not _allowed(policy, action, KMS_KEY.replace("1234abcd", "99999999")), (role, action)
        assert not _allowed(policy, "kms:Encrypt", KMS_KEY), role


LONG_NAME = "spotjob-checkpoints-platformteam"  # 32 characters, the most `name` takes
FITS, TOO_LONG = "vision-research-team-a", "vision-research-team-ab"  # "<name>-training-<key>": 64, 65


@pytest.fixture(scope="module")
def refused_plan(stack: Stack, tf_plugin_dir: Path) -> str:
    """One plan of the module with inputs each variable's validation passes but AWS refuses
    together; what it printed, on one line (Terraform wraps its messages). The module is the root,
    its inputs given with -var."""
    root = stack.workdir.parent / "refused"
    shutil.copytree(stack.workdir.parent.parent / "modules" / "aws", root)
    shutil.copy(stack.workdir / "moto_override.tf", root / "provider.tf")
    init = terraform(root, "init", "-backend=false", f"-plugin-dir={tf_plugin_dir}", "-input=false")
    assert init.returncode == 0, init.stdout + init.stderr
    identities = ", ".join(
        f'"{key}" = {{ namespace = "ml", service_account = "t", prefix = "{key}" }}' for key in (FITS, TOO_LONG)
    )
    inputs = {
        "oidc_provider_arn": OIDC,
        "name": LONG_NAME,
        "create_interruption_queue": "false",
        "training_identities": f"{{ {identities} }}",
        "kms_key_arn": KMS_KEY.replace("us-east-1", "eu-west-1"),
    }
    variables = [arg for name, value in inputs.items() for arg in ("-var", f"{name}={value}")]
    plan = terraform(root, "plan", "-input=false", *variables)
    assert plan.returncode != 0, plan.stdout
    return " ".join((plan.stdout + plan.stderr).split())


def test_a_training_role_name_iam_would_refuse_fails_at_plan_naming_name_and_the_key(refused_plan: str) -> None:
    """IAM role names are at most 64 characters, and "<name>-training-<key>" reached 73 within what
    each variable takes. The provider refused it at plan with "expected length of name to be in the
    range (1 - 64)", naming neither input; a precondition now names both, and which key."""
    assert "expected length of name" not in refused_plan, refused_plan
    role = f"{LONG_NAME}-training-{TOO_LONG}"
    assert f'The IAM role name "{role}" is longer than 64 characters' in refused_plan, refused_plan
    assert f'shorten name or the training_identities key "{TOO_LONG}"' in refused_plan, refused_plan
    assert f'The IAM role name "{LONG_NAME}-training-{FITS}"' not in refused_plan, "64 characters are allowed"
    assert refused_plan.count("Resource precondition failed") == 2, refused_plan  # this role, the key (below)


def test_a_kms_key_of_another_region_fails_at_plan(refused_plan: str) -> None:
    """S3 encrypts only with a key in the bucket's region. A key of another region planned and
    applied, and then every checkpoint write failed; now the plan refuses it, naming both regions."""
    assert "kms_key_arn is a key in eu-west-1, but the bucket is in us-east-1" in refused_plan, refused_plan


def _bucket_settings(stack: Stack) -> dict[str, Any]:
    s3, bucket = stack.client("s3"), stack.output("checkpoint_bucket")
    return {
        "versioning": s3.get_bucket_versioning(Bucket=bucket).get("Status"),
        "public access block": s3.get_public_access_block(Bucket=bucket)["PublicAccessBlockConfiguration"],
        "ownership": s3.get_bucket_ownership_controls(Bucket=bucket)["OwnershipControls"]["Rules"],
        "encryption": s3.get_bucket_encryption(Bucket=bucket)["ServerSideEncryptionConfiguration"]["Rules"],
        "lifecycle": s3.get_bucket_lifecycle_configuration(Bucket=bucket)["Rules"],
        "policy": json.loads(s3.get_bucket_policy(Bucket=bucket)["Policy"]),
    }


def test_destroy_without_force_destroy_is_refused_before_anything_is_removed(stack: Stack) -> None:
    """S3 refuses to delete a bucket holding checkpoints, but Terraform got there only after removing
    its policy, public access block, ownership controls, encryption and lifecycle, suspending its
    versioning and deleting the roles and the queue: the checkpoints were left in an unprotected
    bucket, and no job could run. (Failed before the guard: the destroy stopped at BucketNotEmpty
    with all of that gone.) The checkpoint is put into moto's store directly, in-process: the
    bucket's TLS-only policy refuses moto's plain-HTTP endpoint."""
    from moto.s3.models import s3_backends

    bucket = stack.output("checkpoint_bucket")
    key = "ml-training/train-eks/step-000000100/MANIFEST.json"
    s3_backends["123456789012"]["aws"].put_object(bucket, key, b"{}")
    before = _bucket_settings(stack)
    proc = terraform(stack.workdir, "destroy", "-auto-approve", "-input=false", *VARS)
    assert proc.returncode != 0, proc.stdout
    assert "refusing to destroy: force_destroy is false" in proc.stdout + proc.stderr, proc.stdout + proc.stderr
    assert _bucket_settings(stack) == before
    assert before["versioning"] == "Enabled"
    assert s3_backends["123456789012"]["aws"].get_object(bucket, key) is not None
    iam = stack.client("iam")
    for role in ("spotjob-controller", "spotjob-training-ml-training"):
        assert iam.get_role(RoleName=role)["Role"]["RoleName"] == role
        assert iam.list_role_policies(RoleName=role)["PolicyNames"]
    assert stack.client("sqs").get_queue_url(QueueName="spotjob-interruptions")["QueueUrl"]
    assert stack.client("events").list_targets_by_rule(Rule="spotjob-spot-interruption")["Targets"]


def test_a_new_bucket_name_is_refused_like_a_destroy(stack: Stack) -> None:
    """A new ``bucket_name`` (or ``name``, of which the default bucket name is made) replaces the
    bucket: Terraform destroyed its settings first and then failed at the bucket holding checkpoints,
    as a destroy did (or, with force_destroy, deleted every checkpoint). The guard is replaced with
    it, so the apply is refused first and the old bucket keeps its settings and its checkpoint.
    (Failed before triggers_replace: the apply went ahead.) Runs after the destroy test, which left
    a checkpoint in the bucket."""
    override = stack.workdir / "rename_override.tf"
    override.write_text('module "spotjob" {\n  bucket_name = "spotjob-renamed-checkpoints"\n}\n')
    before = _bucket_settings(stack)
    try:
        proc = terraform(stack.workdir, "apply", "-auto-approve", "-input=false", *VARS)
    finally:
        override.unlink()
    assert proc.returncode != 0, proc.stdout
    assert "refusing to destroy: force_destroy is false" in proc.stdout + proc.stderr, proc.stdout + proc.stderr
    assert _bucket_settings(stack) == before
    assert "spotjob-renamed-checkpoints" not in [b["Name"] for b in stack.client("s3").list_buckets()["Buckets"]]


def test_destroy_removes_everything(stack: Stack) -> None:
    """Last in this file: with force_destroy applied, the stack is gone afterwards, checkpoints and all."""
    error = stack.destroy()
    assert stack.destroyed, error
    s3, sqs, iam = stack.client("s3"), stack.client("sqs"), stack.client("iam")
    assert stack.output("checkpoint_bucket") not in [b["Name"] for b in s3.list_buckets()["Buckets"]]
    assert not [u for u in sqs.list_queues().get("QueueUrls", []) if u.endswith("/spotjob-interruptions")]
    assert not [r for r in iam.list_roles()["Roles"] if r["RoleName"].startswith("spotjob-")]
    assert not [r for r in stack.client("events").list_rules()["Rules"] if r["Name"].startswith("spotjob-")]
