"""Helpers of the install and provisioning tests: the real helm and terraform binaries, and reading
what they produce.

- ``helm_binary()``: $SPOTJOB_HELM, else ``.tools/bin/helm`` (installed by scripts/get-helm.py, which
  ``make test`` runs; run here too when it is missing), else helm on PATH.
- ``render(values)``: ``helm template`` of charts/spotjob with those values; the rendered objects.
- ``controller_rules(objects)``: the RBAC rules the chart grants the controller's ServiceAccount, as
  ``Grant`` tuples. The test that compares them with the API calls the controller really makes
  (derived from the test API server's audit log) reads them from here.
- ``terraform(...)``: the terraform binary with a clean, offline environment.
- ``plugin_dir()``: the folder holding ``registry.terraform.io`` (a filesystem mirror of providers).
- ``validation_errors(...)``: a module's variable validations run by ``terraform plan``, no provider
  needed; ``plan_errors(output)``: a failed plan's errors per module call.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "spotjob"
CRD_FILE = CHART / "files" / "crds" / "spotjob.dev_spotjobs.yaml"
RBAC_FILE = CHART / "files" / "rbac.yaml"
TERRAFORM = REPO / "terraform"
EXAMPLES = REPO / "examples"

RELEASE = "spotjob"
NAMESPACE = "spotjob-system"

# The Kubernetes versions every rendered object is validated against (strict: unknown fields fail):
# the oldest the chart supports (Chart.yaml kubeVersion) and a recent one.
K8S_VERSIONS = ("1.29.0", "1.35.0")


# -- helm -------------------------------------------------------------------------------------------


def helm_binary() -> str:
    env = os.environ.get("SPOTJOB_HELM")
    if env:
        return env
    local = REPO / ".tools" / "bin" / "helm"
    if not local.exists():
        subprocess.run([sys.executable, str(REPO / "scripts" / "get-helm.py")], check=True)
    if local.exists():
        return str(local)
    found = shutil.which("helm")
    if found:
        return found
    raise RuntimeError("no helm binary: run `make helm` (scripts/get-helm.py) or set SPOTJOB_HELM")


def helm(*args: str, check: bool = False) -> subprocess.CompletedProcess[str]:
    """Run helm with an isolated home (no repositories, no plugins, no cluster)."""
    with tempfile.TemporaryDirectory(prefix="helm-home-") as home:
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": home,
            "HELM_CACHE_HOME": f"{home}/cache",
            "HELM_CONFIG_HOME": f"{home}/config",
            "HELM_DATA_HOME": f"{home}/data",
            "KUBECONFIG": os.devnull,
        }
        return subprocess.run([helm_binary(), *args], capture_output=True, text=True, env=env, check=check)


def template(values: Mapping[str, Any] | None = None, *extra: str) -> subprocess.CompletedProcess[str]:
    """``helm template`` of the chart with ``values`` (a -f file); the completed process."""
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", prefix="values-") as f:
        yaml.safe_dump(dict(values or {}), f)
        f.flush()
        return helm("template", RELEASE, str(CHART), "--namespace", NAMESPACE, "-f", f.name, *extra)


class StrictLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a mapping that names a key twice. PyYAML keeps the last one
    without a word; YAML forbids it, and kustomize (Flux, Argo CD, ``kubectl apply -k``) refuses
    the whole file ("mapping key ... already defined")."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"mapping key {key!r} on line {line} is already defined on line {seen[key]}"
                )
            seen[key] = line
        return super().construct_mapping(node, deep=deep)


def load_all(text: str) -> list[dict[str, Any]]:
    """The documents of a rendered manifest, each key of a mapping only once (``StrictLoader``)."""
    return [doc for doc in yaml.load_all(text, Loader=StrictLoader) if doc]


def render(values: Mapping[str, Any] | None = None, *extra: str) -> list[dict[str, Any]]:
    """The objects ``helm template`` renders with ``values``; fails with helm's message, or on a
    key written twice in one mapping."""
    proc = template(values, *extra)
    if proc.returncode != 0:
        raise AssertionError(f"helm template failed ({proc.returncode}):\n{proc.stderr}")
    return load_all(proc.stdout)


def alert_rules(objects: Iterable[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The PrometheusRule's alerting rules by name."""
    found: dict[str, dict[str, Any]] = {}
    for group in one(objects, "PrometheusRule")["spec"]["groups"]:
        for rule in group["rules"]:
            assert rule["alert"] not in found, f"{rule['alert']} twice"
            found[rule["alert"]] = rule
    return found


def selectors(expr: str) -> list[tuple[str, str]]:
    """``(metric name, matchers)`` of every series selector in the PromQL ``expr``, as a real PromQL
    parser (``promql-parser``) reads it; raises ValueError if it does not parse."""
    import promql_parser  # only the alert rules' tests need it

    named: list[tuple[str, str]] = []

    def visit(node: object) -> None:
        if isinstance(node, promql_parser.VectorSelector):
            named.append((node.name, str(node.matchers)))

    promql_parser.walk(promql_parser.parse(expr), visit)
    return named


def find(objects: Iterable[dict[str, Any]], kind: str, name: str | None = None) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]


def one(objects: Iterable[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    found = find(objects, kind, name)
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def container_args(objects: Iterable[dict[str, Any]]) -> list[str]:
    deployment = one(objects, "Deployment")
    return list(deployment["spec"]["template"]["spec"]["containers"][0]["args"])


# -- RBAC -------------------------------------------------------------------------------------------


class Grant(NamedTuple):
    """One permission: ``namespace`` None is cluster-wide (a ClusterRole); ``name`` None is any name."""

    namespace: str | None
    api_group: str
    resource: str
    verb: str
    name: str | None


def expand(rule: Mapping[str, Any], namespace: str | None) -> set[Grant]:
    names = rule.get("resourceNames") or [None]
    return {
        Grant(namespace, group, resource, verb, name)
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
        for name in names
    }


def controller_rules(objects: list[dict[str, Any]], service_account: str = RELEASE) -> set[Grant]:
    """Every permission the rendered chart binds to the controller's ServiceAccount."""
    grants: set[Grant] = set()
    for binding in objects:
        if binding["kind"] not in ("ClusterRoleBinding", "RoleBinding"):
            continue
        if not any(
            s["kind"] == "ServiceAccount" and s["name"] == service_account and s["namespace"] == NAMESPACE
            for s in binding.get("subjects", [])
        ):
            continue
        namespace = binding["metadata"].get("namespace")
        kind, name = binding["roleRef"]["kind"], binding["roleRef"]["name"]
        if kind == "ClusterRole":
            role = one(objects, kind, name)
        else:  # a RoleBinding's Role is the one of that name in the binding's namespace
            (role,) = [r for r in find(objects, kind, name) if r["metadata"]["namespace"] == namespace]
        for rule in role.get("rules") or []:
            grants |= expand(rule, namespace)
    return grants


def rbac_file_rules() -> list[dict[str, Any]]:
    """files/rbac.yaml: the rules as written (with why, access, scope, when)."""
    return list(yaml.safe_load(RBAC_FILE.read_text())["rules"])


# -- terraform --------------------------------------------------------------------------------------


def plugin_dir() -> Path | None:
    """The provider mirror: $SPOTJOB_TF_PLUGIN_DIR, else a folder holding registry.terraform.io/hashicorp/aws."""
    env = os.environ.get("SPOTJOB_TF_PLUGIN_DIR")
    candidates = [Path(env)] if env else [Path("/opt/tf-plugins"), Path.home() / ".terraform.d" / "plugins"]
    candidates += [Path(p) for p in ("/usr/share/terraform/plugins", "/usr/local/share/terraform/plugins")]
    for c in candidates:
        if (c / "registry.terraform.io" / "hashicorp" / "aws").is_dir():
            return c
    return None


def terraform_env(workdir: Path) -> dict[str, str]:
    """No CLI config of the developer's, no update checks, no prompts.

    GOGC=400 (unless set already) for terraform and the provider it starts: most of a command's CPU
    is the AWS provider building its whole schema, twice a command, and Go's default (100) collects
    over and over while it does. 400 cut a ``terraform validate`` from 5.8 to 4.4 CPU-seconds, its
    largest process (the provider) from 510 to 670 MB resident; what terraform does is the same."""
    config = workdir / ".terraformrc"
    config.write_text("")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TF_", "AWS_"))}
    env.update(
        TF_CLI_CONFIG_FILE=str(config),
        TF_IN_AUTOMATION="1",
        TF_INPUT="0",
        CHECKPOINT_DISABLE="1",
    )
    env.setdefault("GOGC", "400")
    return env


def terraform(
    workdir: Path, *args: str, env: Mapping[str, str] | None = None, stdin: str | None = None
) -> subprocess.CompletedProcess[str]:
    """``stdin``: what the command reads (``terraform console``'s expressions); None as before."""
    return subprocess.run(
        ["terraform", *args, "-no-color"],
        cwd=workdir,
        input=stdin,
        capture_output=True,
        text=True,
        env=dict(env) if env is not None else terraform_env(workdir),
    )


def plan_errors(output: str) -> dict[str, str]:
    """The errors of a failed ``terraform plan``, joined per module call they name (``in module
    "X"``; "" for those that name none)."""
    errors: dict[str, str] = {}
    for chunk in output.split("Error: ")[1:]:
        found = re.search(r'in module "([^"]+)"', chunk)
        label = found.group(1) if found else ""
        errors[label] = errors.get(label, "") + "Error: " + chunk
    return errors


def validation_errors(
    variables_tf: Path, workdir: Path, calls: Mapping[str, Mapping[str, str]], files: Mapping[str, str] | None = None
) -> dict[str, str]:
    """Each of ``calls`` (label: {variable: HCL expression}) given to a module made of
    ``variables_tf`` alone, planned at once: Terraform runs every validation block, and needs no
    provider (nothing else is in the module). ``files``: more of the module (name: text), such as a
    ``terraform_data`` resource carrying one of the real module's preconditions (Terraform's own
    resource: no provider either). The errors, per label (``plan_errors``)."""
    module = workdir / "variables_only"
    module.mkdir(parents=True)
    shutil.copy(variables_tf, module / "variables.tf")
    for name, text in (files or {}).items():
        (module / name).write_text(text)
    blocks = []
    for label, inputs in calls.items():
        lines = "".join(f"  {name} = {value}\n" for name, value in inputs.items())
        blocks.append(f'module "{label}" {{\n  source = "./variables_only"\n{lines}}}\n')
    (workdir / "main.tf").write_text("\n".join(blocks))
    init = terraform(workdir, "init", "-backend=false", "-input=false")
    assert init.returncode == 0, init.stdout + init.stderr
    plan = terraform(workdir, "plan", "-input=false")
    return plan_errors(plan.stdout + plan.stderr) if plan.returncode != 0 else {}


def load_hcl(path: Path) -> dict[str, Any]:
    """A .tf file as python-hcl2 reads it, strings unquoted and without block markers."""
    import hcl2
    from hcl2.utils import SerializationOptions

    options = SerializationOptions(with_comments=False, explicit_blocks=False, strip_string_quotes=True)
    with path.open() as f:
        data: dict[str, Any] = hcl2.load(f, serialization_options=options)
    return data


def hcl_blocks(data: Mapping[str, Any], kind: str) -> dict[tuple[str, str], dict[str, Any]]:
    """``{(type, name): body}`` of the ``resource`` or ``data`` blocks of a parsed file."""
    out: dict[tuple[str, str], dict[str, Any]] = {}
    for entry in data.get(kind, []):
        for type_, named in entry.items():
            for name, body in named.items():
                out[(type_.strip('"'), name.strip('"'))] = body
    return out


def dump(obj: Any) -> str:
    return json.dumps(obj, indent=2, sort_keys=True, default=str)
