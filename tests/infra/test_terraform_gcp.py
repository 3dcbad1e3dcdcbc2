"""terraform/modules/gcp checked structurally: the google provider is not on disk here, so Terraform
cannot validate it. python-hcl2 parses it; these tests read the settings that matter."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from infra_support import TERRAFORM, hcl_blocks, load_hcl, validation_errors

from agent._layout import CHECKPOINT_MARKERS

MODULE = TERRAFORM / "modules" / "gcp"
RESOURCES = hcl_blocks(load_hcl(MODULE / "main.tf"), "resource")


def _block(body: dict[str, Any], name: str) -> list[dict[str, Any]]:
    value = body.get(name, [])
    return value if isinstance(value, list) else [value]


def test_the_bucket_is_uniform_private_versioned_and_expires_only_what_spotjob_deleted() -> None:
    bucket = RESOURCES[("google_storage_bucket", "this")]
    assert bucket["uniform_bucket_level_access"] is True
    assert bucket["public_access_prevention"] == "enforced"
    assert _block(bucket, "versioning") == [{"enabled": True}]
    rules = {r["action"][0]["type"]: r["condition"][0] for r in _block(bucket, "lifecycle_rule")}
    assert set(rules) == {"Delete", "AbortIncompleteMultipartUpload"}
    # Delete applies to noncurrent versions only: a live checkpoint never expires.
    assert rules["Delete"]["with_state"] == "ARCHIVED"
    assert rules["Delete"]["days_since_noncurrent_time"] == "${var.noncurrent_version_expiration_days}"
    assert set(rules["Delete"]) == {"with_state", "days_since_noncurrent_time"}
    assert rules["AbortIncompleteMultipartUpload"]["age"] == "${var.abort_incomplete_multipart_upload_days}"


def test_soft_delete_does_not_keep_what_versioning_and_the_lifecycle_already_keep() -> None:
    """GCS soft-deletes for 7 days by default, also the noncurrent versions the lifecycle rule
    deletes: each checkpoint retention removed was billed noncurrent_version_expiration_days, then
    7 days more. The module left the default in force; it is now a variable, off unless set."""
    bucket = RESOURCES[("google_storage_bucket", "this")]
    (policy,) = _block(bucket, "soft_delete_policy")
    assert policy["retention_duration_seconds"] == "${var.soft_delete_retention_days * 86400}"
    variables = {k: v for entry in load_hcl(MODULE / "variables.tf")["variable"] for k, v in entry.items()}
    assert variables["soft_delete_retention_days"]["default"] == 0
    assert ">= 5.22" in (MODULE / "versions.tf").read_text()  # the provider release with soft_delete_policy


def test_a_cmek_key_is_granted_to_the_cloud_storage_service_agent_before_the_bucket_uses_it() -> None:
    """With ``kms_key_name`` set, Cloud Storage's service agent of the project encrypts and decrypts
    with the key, and GCS refuses to create the bucket (403 "Permission denied on Cloud KMS key")
    until that agent holds roles/cloudkms.cryptoKeyEncrypterDecrypter on it. The module granted
    nothing, so the CMEK option failed at apply (or every write failed, for a grant made later)."""
    data = hcl_blocks(load_hcl(MODULE / "main.tf"), "data")
    agent = data[("google_storage_project_service_account", "this")]
    assert agent["count"] == "${var.kms_key_name == null ? 0 : 1}"
    assert agent["project"] == "${var.project_id}"
    grant = RESOURCES[("google_kms_crypto_key_iam_member", "this")]
    assert grant["count"] == "${var.kms_key_name == null ? 0 : 1}"
    assert grant["crypto_key_id"] == "${var.kms_key_name}"
    assert grant["role"] == "roles/cloudkms.cryptoKeyEncrypterDecrypter"
    assert grant["member"] == "serviceAccount:${data.google_storage_project_service_account.this[0].email_address}"
    assert "${google_kms_crypto_key_iam_member.this}" in RESOURCES[("google_storage_bucket", "this")]["depends_on"]


def test_workload_identity_is_limited_to_one_service_account_of_one_namespace() -> None:
    for name, ksa in (
        ("training_workload_identity", "${each.value.namespace}/${each.value.service_account}"),
        ("controller_workload_identity", "${var.controller_namespace}/${var.controller_service_account}"),
    ):
        binding = RESOURCES[("google_service_account_iam_member", name)]
        assert binding["role"] == "roles/iam.workloadIdentityUser"
        assert binding["member"] == f"serviceAccount:${{local.workload_pool}}[{ksa}]"
    locals_ = {k: v for entry in load_hcl(MODULE / "main.tf")["locals"] for k, v in entry.items()}
    assert locals_["workload_pool"] == "${var.project_id}.svc.id.goog"
    # The member is an IAM binding on the service account, never a project-wide role.
    assert not [t for t, _ in RESOURCES if t.startswith("google_project_iam")]


def test_training_storage_access_is_conditioned_on_the_prefix() -> None:
    grant = RESOURCES[("google_storage_bucket_iam_member", "training")]
    assert grant["role"] == "roles/storage.objectUser"
    (condition,) = grant["condition"]
    expression = condition["expression"]
    assert 'resource.name.startsWith("${local.bucket_prefix}${each.value.prefix}/")' in expression
    locals_ = {k: v for entry in load_hcl(MODULE / "main.tf")["locals"] for k, v in entry.items()}
    assert locals_["bucket_prefix"] == "projects/_/buckets/${local.bucket_name}/objects/"


def test_the_controller_reads_manifests_and_creates_records_only() -> None:
    read = RESOURCES[("google_storage_bucket_iam_member", "controller_read")]
    assert read["role"] == "roles/storage.objectViewer"
    expression = read["condition"][0]["expression"]
    # The objects of a checkpoint's folder the controller reads (the manifest; the writer's claim, which
    # its first look at a new URI asks for: refused, every new SpotJob failed with StorageRefused), and
    # no other (never a shard).
    assert set(re.findall(r'resource\.name\.endsWith\("/([^"]+)"\)', expression)) == set(CHECKPOINT_MARKERS)
    assert 'resource.name.extract("/.spotjob/{record}") != ""' in expression
    assert "startsWith" not in expression
    create = RESOURCES[("google_storage_bucket_iam_member", "controller_records")]
    assert create["role"] == "roles/storage.objectCreator"  # create, never overwrite or delete
    assert "/.spotjob/" in create["condition"][0]["expression"]
    assert "MANIFEST" not in create["condition"][0]["expression"]


def test_the_node_pool_is_spot_gpu_tainted_and_uses_the_gke_metadata_server() -> None:
    pool = RESOURCES[("google_container_node_pool", "this")]
    assert pool["count"] == "${var.node_pool == null ? 0 : 1}"
    (config,) = pool["node_config"]
    assert config["spot"] is True
    assert config["taint"] == [{"key": "cloud.google.com/gke-spot", "value": "true", "effect": "NO_SCHEDULE"}]
    assert config["workload_metadata_config"] == [{"mode": "GKE_METADATA"}]
    (gpu,) = config["guest_accelerator"]
    assert gpu["gpu_driver_installation_config"]
    assert pool["autoscaling"][0]["location_policy"] == "ANY"
    assert "gke-spot" not in str(config.get("labels")), "GKE sets cloud.google.com/gke-spot itself"


def test_the_helm_values_output_feeds_the_charts_workload_identity_key() -> None:
    outputs = {k: v for e in load_hcl(MODULE / "outputs.tf")["output"] for k, v in e.items()}
    value = outputs["helm_values"]["value"]
    assert value["serviceAccount"]["gcp"]["serviceAccount"] == "${google_service_account.controller.email}"
    assert value["serviceAccount"]["name"] == "${var.controller_service_account}"


def test_kms_key_name_must_name_a_crypto_key() -> None:
    """A key version, a key ring or a console URL passed as ``kms_key_name`` went unchecked to the
    KMS grant and the bucket, which fail at apply (after other resources were created). The
    validation's pattern is read from variables.tf and run here with Python's re (it uses only what
    RE2 and re share); Terraform itself cannot run the module offline."""
    variables = {k: v for entry in load_hcl(MODULE / "variables.tf")["variable"] for k, v in entry.items()}
    (validation,) = variables["kms_key_name"]["validation"]
    condition = validation["condition"]
    assert condition.startswith("${var.kms_key_name == null || can(regex(")
    (pattern,) = re.findall(r'regex\("(.+?)", var\.kms_key_name\)', condition)
    key = "projects/example-project/locations/us-central1/keyRings/spotjob/cryptoKeys/checkpoints"
    assert re.search(pattern, key)
    for wrong in (
        f"{key}/cryptoKeyVersions/1",
        "projects/example-project/locations/us-central1/keyRings/spotjob",
        f"https://console.cloud.google.com/security/kms/{key}",
        "checkpoints",
    ):
        assert not re.search(pattern, wrong), wrong
    assert "cryptoKeys/KEY" in validation["error_message"]


def _precondition(resource_type: str, mentioning: str) -> str:
    """The text of the ``precondition`` block of main.tf's ``resource_type`` "this" that mentions ``mentioning``."""
    source = (MODULE / "main.tf").read_text()
    body = source[source.index(f'resource "{resource_type}" "this" {{') :]
    body = body[: body.index("\n}\n")]
    blocks = [b for b in re.findall(r"\n( +precondition \{\n.*?\n +\})", body, re.S) if mentioning in b]
    assert len(blocks) == 1, f"{len(blocks)} preconditions of {resource_type}.this mention {mentioning}"
    return blocks[0]


def test_a_bucket_name_google_cloud_refuses_fails_at_plan_naming_the_input(terraform_bin: str, tmp_path: Path) -> None:
    """Cloud Storage refuses a bucket name beginning with goog or containing google (or g00gle), and
    the default one is "<name>-checkpoints-<project id>": such a bucket_name, or name, passed the
    plan and failed at apply. bucket_name's validation refuses it now, and a precondition of the
    bucket refuses such a name when bucket_name is not given (it makes no bucket name otherwise).
    The precondition is run by Terraform on a ``terraform_data`` resource beside variables.tf (the
    module's own resources need the google provider, not on disk here)."""
    check = 'resource "terraform_data" "bucket" {\n  lifecycle {\n' + _precondition("google_storage_bucket", "goog")
    # The message names local.bucket_name, the default one (name given, bucket_name not).
    files = {
        "check.tf": check + "\n  }\n}\n",
        "locals.tf": 'locals {\n  bucket_name = "${var.name}-checkpoints-${var.project_id}"\n}\n',
    }
    base = {"project_id": '"example-project"', "location": '"us-central1"'}
    refused_names = {"goog_prefix": "googly", "google_inside": "my-google", "g00gle": "g00gle-ml"}
    refused_buckets = {"goog_bucket": "goog-checkpoints", "google_bucket": "ckpt-google-ml", "g00gle_bucket": "g00gle"}
    accepted = {
        "default": {},
        "go_prefix": {"name": '"go-ml"'},
        "own_bucket": {"name": '"googly"', "bucket_name": '"ml-ckpt"'},
    }
    # Two plans: a failed validation stops the plan before any precondition is checked.
    calls = {label: {**base, "bucket_name": f'"{name}"'} for label, name in refused_buckets.items()}
    errors = validation_errors(MODULE / "variables.tf", tmp_path / "validation", calls, files)
    assert set(errors) == set(refused_buckets), errors
    for label in refused_buckets:
        assert "bucket_name must be a name Cloud Storage accepts" in errors[label], errors[label]
    calls = {label: {**base, "name": f'"{name}"'} for label, name in refused_names.items()}
    calls.update({label: {**base, **inputs} for label, inputs in accepted.items()})
    errors = validation_errors(MODULE / "variables.tf", tmp_path / "precondition", calls, files)
    said = " ".join(" ".join(errors.values()).split())
    # A precondition's error names no module call: each is found by its name.
    for name in refused_names.values():
        assert f'name "{name}" makes the bucket name "{name}-checkpoints-example-project"' in said, said
    assert said.count("may not begin with goog or contain google or g00gle: choose another name") == 3, said
    assert said.count('name "googly" makes') == 1, "with bucket_name given, such a name passes"


def test_a_training_identity_key_ending_in_a_hyphen_is_refused_at_plan(terraform_bin: str, tmp_path: Path) -> None:
    """Service account IDs end in a letter or digit, and the key ends "<name>-training-<key>": a
    key such as "ml-" passed the validation and failed at apply, when Google refused the account.
    Terraform runs the module's variable validations here (they need no google provider)."""

    def identities(key: str) -> dict[str, str]:
        return {
            "project_id": '"example-project"',
            "location": '"us-central1"',
            "training_identities": f'{{ "{key}" = {{ namespace = "ml", service_account = "t", prefix = "ml" }} }}',
        }

    refused = {"trailing_hyphen": "ml-", "one_hyphen_more": "ml-team-"}
    accepted = {"short": "ml", "hyphen_inside": "ml-team", "one_character": "a", "eight": "ml-team1"}
    calls = {label: identities(key) for label, key in {**refused, **accepted}.items()}
    errors = validation_errors(MODULE / "variables.tf", tmp_path, calls)
    assert set(errors) == set(refused), errors
    for label in refused:
        assert "training_identities keys name service accounts" in errors[label], errors[label]
        assert "ending with a letter or digit" in errors[label], errors[label]
