"""The Terraform modules and examples: formatted, valid with the AWS provider from the machine's
mirror, and laid out the terraform-aws-modules way. The GCP module cannot be validated offline (no
google provider on disk): test_terraform_gcp.py checks it structurally."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
from infra_support import TERRAFORM, hcl_blocks, load_hcl, terraform, terraform_env, validation_errors

DIRS = ["modules/aws", "modules/gcp", "examples/eks", "examples/gke"]


def test_terraform_fmt_check_recursive(terraform_bin: str, tmp_path: Path) -> None:
    proc = terraform(TERRAFORM, "fmt", "-check", "-recursive", "-diff", env=terraform_env(tmp_path))
    assert proc.returncode == 0, f"run `terraform fmt -recursive terraform/`:\n{proc.stdout}{proc.stderr}"


@pytest.fixture(scope="module")
def tf_copy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """terraform/ copied out of the repository, so init writes no .terraform/ or lock file into it."""
    root = tmp_path_factory.mktemp("tf") / "terraform"
    shutil.copytree(TERRAFORM, root, ignore=shutil.ignore_patterns(".terraform", "*.tfstate*", ".terraform.lock.hcl"))
    return root


@pytest.mark.parametrize("folder", ["modules/aws", "examples/eks"])
def test_terraform_validate_with_the_aws_provider(folder: str, tf_copy: Path, tf_plugin_dir: Path) -> None:
    workdir = tf_copy / folder
    init = terraform(workdir, "init", "-backend=false", f"-plugin-dir={tf_plugin_dir}", "-input=false")
    assert init.returncode == 0, init.stdout + init.stderr
    validate = terraform(workdir, "validate")
    assert validate.returncode == 0, validate.stdout + validate.stderr


def _variables(folder: str) -> dict[str, dict[str, object]]:
    data = load_hcl(TERRAFORM / folder / "variables.tf")
    return {k: v for entry in data.get("variable", []) for k, v in entry.items()}


def _outputs(folder: str) -> dict[str, dict[str, object]]:
    data = load_hcl(TERRAFORM / folder / "outputs.tf")
    return {k: v for entry in data.get("output", []) for k, v in entry.items()}


@pytest.mark.parametrize("folder", DIRS)
def test_the_terraform_aws_modules_layout(folder: str) -> None:
    path = TERRAFORM / folder
    for name in ("main.tf", "variables.tf", "outputs.tf", "versions.tf", "README.md"):
        assert (path / name).is_file(), f"{folder}/{name} is missing"
    for name, body in _variables(folder).items():
        assert body.get("type"), f"{folder}: variable {name} has no type"
        assert str(body.get("description", "")).strip(), f"{folder}: variable {name} has no description"
    for name, body in _outputs(folder).items():
        assert str(body.get("description", "")).strip(), f"{folder}: output {name} has no description"
    # Lower bounds only: a module must not stop working with the next provider release.
    versions = (path / "versions.tf").read_text()
    pins = re.findall(r'version\s*=\s*"([^"]+)"', versions) + re.findall(r'required_version\s*=\s*"([^"]+)"', versions)
    assert pins and all(p.startswith(">=") and "<" not in p for p in pins), pins


@pytest.mark.parametrize("folder", DIRS)
def test_the_readme_lists_every_input_and_output(folder: str) -> None:
    readme = (TERRAFORM / folder / "README.md").read_text()
    rows = set(re.findall(r"^\| `([a-z0-9_]+)` \|", readme, re.M))
    assert set(_variables(folder)) <= rows, f"inputs missing from {folder}/README.md: {set(_variables(folder)) - rows}"
    assert set(_outputs(folder)) <= rows, f"outputs missing from {folder}/README.md: {set(_outputs(folder)) - rows}"
    assert "## Inputs" in readme and "## Outputs" in readme


@pytest.mark.parametrize("folder", ["modules/aws", "modules/gcp"])
def test_a_resource_of_its_kind_alone_is_named_this(folder: str) -> None:
    resources = hcl_blocks(load_hcl(TERRAFORM / folder / "main.tf"), "resource")
    by_type: dict[str, list[str]] = {}
    for type_, name in resources:
        by_type.setdefault(type_, []).append(name)
    for type_, names in by_type.items():
        if len(names) == 1:
            assert names == ["this"], f"{folder}: {type_}.{names[0]} should be {type_}.this"


def test_the_modules_never_configure_providers() -> None:
    for folder in ("modules/aws", "modules/gcp"):
        for tf in (TERRAFORM / folder).glob("*.tf"):
            assert not load_hcl(tf).get("provider"), f"{tf}: a module takes its providers from the caller"


@pytest.mark.parametrize("folder", ["modules/aws", "modules/gcp"])
def test_the_destroy_guard_comes_before_every_resource(folder: str) -> None:
    """A destroy the bucket refuses (it holds checkpoints) must stop before anything else goes: the
    guard depends on every other resource of the module, so Terraform destroys it first, and it
    fails unless force_destroy is in the state. Before it, Terraform removed the bucket's settings
    (AWS), the roles or service accounts and the queue, then failed at the bucket.
    test_terraform_aws.py runs the AWS one; the GCP one is read here only (no google provider)."""
    resources = hcl_blocks(load_hcl(TERRAFORM / folder / "main.tf"), "resource")
    guard = resources[("terraform_data", "this")]
    assert guard["input"] == "${var.force_destroy}"
    assert guard["triggers_replace"] == "${local.bucket_name}"  # a renamed bucket is a destroyed one
    others = {f"${{{type_}.{name}}}" for type_, name in resources if type_ != "terraform_data"}
    assert set(guard["depends_on"]) == others
    ((kind, provisioner),) = guard["provisioner"][0].items()
    assert (kind, provisioner["when"]) == ("local-exec", "destroy")
    assert provisioner["command"].startswith('${self.input ? "exit 0" : "echo spotjob: refusing to destroy')
    assert provisioner["command"].endswith('exit 1"}')


@pytest.mark.parametrize("folder", ["modules/aws", "modules/gcp"])
def test_the_readme_states_the_version_floors_of_versions_tf(folder: str) -> None:
    """The GCP module's README said "the Google provider >= 5.0" after versions.tf had moved to
    >= 5.22 (soft_delete_policy): an operator pinning 5.x below that failed at plan."""
    versions = (TERRAFORM / folder / "versions.tf").read_text()
    readme = (TERRAFORM / folder / "README.md").read_text()
    requirements = readme[readme.index("## Requirements") :]
    floors = re.findall(r'version\s*=\s*">=\s*([0-9.]+)"', versions)
    assert floors
    for floor in floors:
        short = re.sub(r"\.0$", "", floor)
        assert f">= {short}" in requirements or f">= {floor}" in requirements, (folder, floor)


OIDC = '"arn:aws:iam::123456789012:oidc-provider/oidc.eks.us-east-1.amazonaws.com/id/EXAMPLE"'


def test_aws_names_s3_and_sqs_refuse_fail_at_plan_naming_the_variable(terraform_bin: str, tmp_path: Path) -> None:
    """A bucket_name with two adjacent dots, in an IP address's form, or with a prefix or suffix S3
    keeps for itself passed the plan and failed at CreateBucket; a fractional retention failed in
    the provider with "Attribute must be a whole number", naming neither variable. Each is now
    refused by the variable's validation; the names and the retention S3 and SQS take still pass."""
    refused_names = {
        "adjacent_dots": "my..checkpoints",
        "ip_address": "192.168.10.20",
        "punycode": "xn--checkpoints",
        "sthree": "sthree-checkpoints",
        "demo": "amzn-s3-demo-checkpoints",
        "access_point_alias": "checkpoints-s3alias",
        "object_lambda_alias": "checkpoints--ol-s3",
        "multi_region_access_point": "checkpoints.mrap",
        "directory_bucket": "checkpoints--x-s3",
    }
    accepted_names = {"dotted": "checkpoints.example-1", "digits_and_dots": "10.20.example", "default": None}
    calls = {
        label: {"oidc_provider_arn": OIDC, **({"bucket_name": f'"{name}"'} if name else {})}
        for label, name in {**refused_names, **accepted_names}.items()
    }
    calls["fractional_retention"] = {"oidc_provider_arn": OIDC, "queue_message_retention_seconds": "90.5"}
    calls["whole_retention"] = {"oidc_provider_arn": OIDC, "queue_message_retention_seconds": "90"}
    errors = validation_errors(TERRAFORM / "modules" / "aws" / "variables.tf", tmp_path, calls)
    assert set(errors) == {*refused_names, "fractional_retention"}, errors
    for label in refused_names:
        assert "bucket_name must be a name S3 accepts" in errors[label], errors[label]
    assert "queue_message_retention_seconds must be a whole number" in errors["fractional_retention"]


NODE_GROUP = 'cluster_name = "ml-cluster", subnet_ids = ["subnet-0123456789abcdef0", "subnet-0a1b2c3d"]'


def test_aws_tags_and_node_group_fields_aws_refuses_fail_at_plan_naming_the_input(
    terraform_bin: str, tmp_path: Path
) -> None:
    """A tag key beginning with aws: (AWS keeps the prefix), and node_group fields EKS or the
    provider refuses (a cluster name with a space, a subnet's name for its ID, an instance type in
    capitals, a fractional or negative size, a disk of 0 GiB, labels Kubernetes refuses, a role's
    name for its ARN), passed `terraform plan` and failed at apply (or in the provider, naming the
    node group's attribute): never naming the module's input. Each is now refused by the
    variable's validation, naming it; the values AWS takes still pass."""
    refused = {
        "aws_tag": ({"tags": '{ "aws:team" = "ml" }'}, "tags: no key may begin with aws:"),
        "aws_tag_upper": ({"tags": '{ "AWS:Team" = "ml" }'}, "tags: no key may begin with aws:"),
        "tag_character": ({"tags": '{ "team#1" = "ml" }'}, "tags: at most 50 tags"),
        "tag_value_long": ({"tags": f'{{ team = "{"v" * 257}" }}'}, "tags: at most 50 tags"),
        "too_many_tags": ({"tags": "{ " + ", ".join(f't{i} = "x"' for i in range(51)) + " }"}, "tags: at most 50"),
        "fractional_size": ({"node_group": f"{{ {NODE_GROUP}, desired_size = 1.5 }}"}, "whole numbers of nodes"),
        "negative_min": ({"node_group": f"{{ {NODE_GROUP}, min_size = -1, desired_size = 0 }}"}, "min_size at least 0"),
        "cluster_name": (
            {"node_group": '{ cluster_name = "ml cluster", subnet_ids = ["subnet-0a1b2c3d"] }'},
            "node_group.cluster_name must be",
        ),
        "subnet_name": (
            {"node_group": '{ cluster_name = "ml", subnet_ids = ["private-a"] }'},
            "node_group.subnet_ids must be",
        ),
        "instance_type": (
            {"node_group": f'{{ {NODE_GROUP}, instance_types = ["G5.XLARGE"] }}'},
            "node_group.instance_types must be",
        ),
        "disk_zero": ({"node_group": f"{{ {NODE_GROUP}, disk_size = 0 }}"}, "node_group.disk_size must be"),
        "label_key": (
            {"node_group": f'{{ {NODE_GROUP}, labels = {{ "team name" = "ml" }} }}'},
            "node_group.labels must be",
        ),
        "label_value_empty": (
            {"node_group": f'{{ {NODE_GROUP}, labels = {{ team = "" }} }}'},
            "node_group.labels must be",
        ),
        "role_name": (
            {"node_group": f'{{ {NODE_GROUP}, node_role_arn = "gpu-nodes" }}'},
            "node_group.node_role_arn must be",
        ),
    }
    accepted = {
        "tags": {"tags": '{ team = "ml", "cost-center" = "a b/c@d", "Name" = "spotjob:ckpt+=1", empty = "" }'},
        "node_group": {
            "node_group": f'{{ {NODE_GROUP}, instance_types = ["p4d.24xlarge", "u-6tb1.metal", "c7i.metal-24xl"], '
            'labels = { "example.com/team" = "ml", tier = "a_b.c-d" }, disk_size = 16384, '
            'node_role_arn = "arn:aws:iam::123456789012:role/gpu-nodes" }'
        },
        "node_group_defaults": {"node_group": '{ cluster_name = "ml_1", subnet_ids = ["subnet-0a1b2c3d"] }'},
        # EKS takes a cluster name of one character.
        "node_group_short_name": {"node_group": '{ cluster_name = "m", subnet_ids = ["subnet-0a1b2c3d"] }'},
    }
    calls = {label: {"oidc_provider_arn": OIDC, **inputs} for label, (inputs, _) in refused.items()}
    calls.update({label: {"oidc_provider_arn": OIDC, **inputs} for label, inputs in accepted.items()})
    errors = validation_errors(TERRAFORM / "modules" / "aws" / "variables.tf", tmp_path, calls)
    assert set(errors) == set(refused), {k: v[:300] for k, v in errors.items()}
    for label, (_, said) in refused.items():
        assert said in " ".join(errors[label].split()), (label, errors[label])  # terraform wraps messages


NODE_POOL = 'cluster = "ml", location = "us-central1"'


def test_gcp_labels_and_node_pool_fields_google_refuses_fail_at_plan_naming_the_input(
    terraform_bin: str, tmp_path: Path
) -> None:
    """The GCP module's equivalents: labels Google Cloud refuses (an upper-case key, one beginning
    with a digit, a value with a '.'), and node_pool fields the provider or GKE refuses (a
    fractional count, a disk under 10 GB, a node label Kubernetes refuses) passed the plan's checks
    of the module's inputs and failed later, naming the resource. Each is now refused naming the
    input; the values Google Cloud takes still pass."""
    base = {"project_id": '"my-project-1"', "location": '"us-central1"'}
    refused = {
        "label_upper": ({"labels": '{ Team = "ml" }'}, "labels: at most 64 labels"),
        "label_digit": ({"labels": '{ "1team" = "ml" }'}, "labels: at most 64 labels"),
        "label_value_dot": ({"labels": '{ team = "m.l" }'}, "labels: at most 64 labels"),
        "too_many_labels": ({"labels": "{ " + ", ".join(f'l{i} = "x"' for i in range(65)) + " }"}, "at most 64"),
        "fractional_count": ({"node_pool": f"{{ {NODE_POOL}, max_node_count = 2.5 }}"}, "must be whole numbers"),
        "negative_min": ({"node_pool": f"{{ {NODE_POOL}, min_node_count = -1 }}"}, "min_node_count at least 0"),
        "small_disk": ({"node_pool": f"{{ {NODE_POOL}, disk_size_gb = 5 }}"}, "node_pool.disk_size_gb must be"),
        "node_label": (
            {"node_pool": f'{{ {NODE_POOL}, labels = {{ "team name" = "ml" }} }}'},
            "node_pool.labels must be",
        ),
        "node_label_value": (
            {"node_pool": f'{{ {NODE_POOL}, labels = {{ team = "-ml" }} }}'},
            "node_pool.labels must be",
        ),
    }
    accepted = {
        "labels": {"labels": '{ team = "ml", "cost_center-1" = "", "\u00e9quipe" = "r\u00e9seau_1" }'},
        "node_pool": {
            "node_pool": f'{{ {NODE_POOL}, disk_size_gb = 10, labels = {{ "example.com/team" = "ml", tier = "" }} }}'
        },
    }
    calls = {label: {**base, **inputs} for label, (inputs, _) in refused.items()}
    calls.update({label: {**base, **inputs} for label, inputs in accepted.items()})
    errors = validation_errors(TERRAFORM / "modules" / "gcp" / "variables.tf", tmp_path, calls)
    assert set(errors) == set(refused), {k: v[:300] for k, v in errors.items()}
    for label, (_, said) in refused.items():
        assert said in " ".join(errors[label].split()), (label, errors[label])
