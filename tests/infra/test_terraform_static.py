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
