"""The RBAC a team needs for ``kubectl spotjob``: one list, ``PLUGIN_PERMISSIONS``, equal to the calls
the plugin made in this folder's tests (the test API server's audit log; this module runs after
test_kubectl_spotjob.py) and to the Role the README prints.
"""

from __future__ import annotations

import re

import pytest
import yaml
from plugin_support import REPO, USER

from orchestrator.k8s.plugin_client import PLUGIN_PERMISSIONS
from tests.k8s.cluster import TestCluster

Grant = tuple[str, str, str]
"""(API group, resource, verb)."""

PLUGIN = {(p.group, p.resource, p.verb) for p in PLUGIN_PERMISSIONS}


def readme_role() -> set[Grant]:
    text = (REPO / "README.md").read_text()
    section = text.split("### `kubectl spotjob`", 1)[1].split("\n### ", 1)[0]
    blocks = [yaml.safe_load(b) for b in re.findall(r"```yaml\n(.*?)```", section, re.S)]
    (role,) = [b for b in blocks if isinstance(b, dict) and b.get("kind") == "Role"]
    return {
        (group, resource, verb)
        for rule in role["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }


def test_the_readmes_role_grants_exactly_what_the_plugin_may_call() -> None:
    assert readme_role() == PLUGIN


def test_the_plugin_called_exactly_its_permissions_in_these_tests(
    cluster: TestCluster, test_apiserver_only: None
) -> None:
    records = [r for r in cluster.audit_log() if r.user == USER and r.resource]
    if not records:
        pytest.skip("run with test_kubectl_spotjob.py: no request of the plugin's user in the audit log")
    called = {(r.api_group, r.resource_path, r.verb) for r in records}
    assert called <= PLUGIN, f"calls outside PLUGIN_PERMISSIONS: {sorted(called - PLUGIN)}"
    assert called >= PLUGIN, f"permissions no test used: {sorted(PLUGIN - called)}"
