"""The controller's RBAC: least privilege, read and write apart, a comment on every rule, and exactly
the API calls the controller makes (the contract of issue #12, below) — in both directions.

When the controller exists, a test derives the calls it really makes from the test API server's
audit log and compares them with ``controller_rules(render(...))``; this file pins the contract
until then, and files/rbac.yaml is the one place both sides are written.
"""

from __future__ import annotations

from typing import Any

import pytest
import yaml
from infra_support import (
    CHART,
    NAMESPACE,
    RELEASE,
    Grant,
    controller_rules,
    find,
    helm,
    one,
    rbac_file_rules,
    render,
)

LEASE = "spotjob-controller"
QUEUE = {"interruptionQueue": {"url": "https://sqs.us-east-1.amazonaws.com/111122223333/spotjob-interruptions"}}


def contract(*, job_namespaces: list[str | None], queue: bool, network_policy: bool, leader: bool) -> set[Grant]:
    """The calls the controller makes, as the controller contract lists them."""
    grants: set[Grant] = set()

    def add(namespaces: list[str | None], group: str, resource: str, verbs: str, name: str | None = None) -> None:
        for ns in namespaces:
            for verb in verbs.split():
                grants.add(Grant(ns, group, resource, verb, name))

    add([None], "", "nodes", "get list watch")
    add(job_namespaces, "spotjob.dev", "spotjobs", "get list watch patch")
    add(job_namespaces, "", "pods", "get list watch create delete")
    add(job_namespaces, "", "services", "create")
    add(job_namespaces, "", "secrets", "create")
    add(job_namespaces, "spotjob.dev", "spotjobs/status", "update patch")
    add([None], "", "events", "create patch")
    add([None], "events.k8s.io", "events", "create patch")
    if network_policy:
        add(job_namespaces, "networking.k8s.io", "networkpolicies", "create")
    if queue:
        add([None], "", "nodes", "patch")
    if leader:
        add([NAMESPACE], "coordination.k8s.io", "leases", "get update", LEASE)
        add([NAMESPACE], "coordination.k8s.io", "leases", "create")
    return grants


CASES: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "defaults": ({}, {"job_namespaces": [None], "queue": False, "network_policy": True, "leader": True}),
    "queue": (QUEUE, {"job_namespaces": [None], "queue": True, "network_policy": True, "leader": True}),
    "no-network-policy": (
        {"networkPolicy": {"enabled": False}},
        {"job_namespaces": [None], "queue": False, "network_policy": False, "leader": True},
    ),
    "one-replica": (
        {"replicas": 1, "leaderElection": {"enabled": False}},
        {"job_namespaces": [None], "queue": False, "network_policy": True, "leader": False},
    ),
    "watch-namespaces": (
        {"watchNamespaces": ["ml-training", "research"], **QUEUE},
        {"job_namespaces": ["ml-training", "research"], "queue": True, "network_policy": True, "leader": True},
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_rendered_rules_are_exactly_the_controllers_calls(case: str) -> None:
    values, expected = CASES[case]
    granted = controller_rules(render(values))
    wanted = contract(**expected)
    assert not granted - wanted, f"granted but never called: {sorted(granted - wanted)}"
    assert not wanted - granted, f"called but not granted: {sorted(wanted - granted)}"


def test_no_wildcards_and_no_reads_of_secrets() -> None:
    for values, _ in CASES.values():
        for grant in controller_rules(render(values)):
            assert "*" not in (grant.api_group, grant.resource, grant.verb), grant
            if grant.resource == "secrets":
                assert grant.verb == "create", f"the controller only creates the per-job token: {grant}"
            assert grant.verb not in ("escalate", "bind", "impersonate", "deletecollection"), grant


def test_the_lease_is_named_except_for_create_which_cannot_be() -> None:
    for grant in controller_rules(render()):
        if grant.resource == "leases":
            assert grant.namespace == NAMESPACE
            assert (grant.name is None) == (grant.verb == "create"), grant


def test_watching_some_namespaces_leaves_only_cluster_scoped_rules_in_the_cluster_role() -> None:
    objects = render({"watchNamespaces": ["ml-training"]})
    cluster_role = one(objects, "ClusterRole", RELEASE)
    resources = {r for rule in cluster_role["rules"] for r in rule["resources"]}
    assert resources == {"nodes", "events"}
    role = next(r for r in find(objects, "Role", RELEASE) if r["metadata"]["namespace"] == "ml-training")
    assert {r for rule in role["rules"] for r in rule["resources"]} >= {"spotjobs", "pods", "secrets"}


def test_reads_come_before_writes_and_every_rule_has_its_comment() -> None:
    proc = helm("template", RELEASE, str(CHART), "--namespace", NAMESPACE, "--set", QUEUE_SET)
    assert proc.returncode == 0, proc.stderr
    checked = 0
    for document in proc.stdout.split("\n---\n"):
        obj = yaml.safe_load(document)
        if not obj or obj["kind"] not in ("ClusterRole", "Role"):
            continue
        if "aggregate-to-" in document:
            continue  # the user-facing roles (templates/user-roles.yaml), commented by hand
        lines = document.split("rules:", 1)[1].splitlines()
        accesses = []
        for i, line in enumerate(lines):
            if line.strip().startswith("- apiGroups:"):
                above = lines[i - 1].strip()
                comment_lines = [ln.strip() for ln in lines[:i] if ln.strip().startswith("#")]
                assert above.startswith("#"), f"rule without a comment:\n{document}"
                head = next(c for c in reversed(comment_lines) if c.startswith(("# Read:", "# Write:")))
                accesses.append(head.split(":", 1)[0][2:])
        assert accesses, document
        assert accesses == sorted(accesses, key=lambda a: a != "Read"), f"writes before reads: {accesses}"
        checked += 1
    assert checked == 2  # the ClusterRole and the leader-election Role


QUEUE_SET = "interruptionQueue.url=https://sqs.us-east-1.amazonaws.com/111122223333/q"


def test_the_rules_file_is_well_formed() -> None:
    rules = rbac_file_rules()
    assert rules
    for rule in rules:
        assert set(rule) <= {"why", "access", "scope", "when", "apiGroups", "resources", "verbs", "resourceNames"}
        assert rule["why"].strip(), rule
        assert rule["access"] in ("read", "write")
        assert rule["scope"] in ("cluster", "jobs", "leader")
        reading = set(rule["verbs"]) <= {"get", "list", "watch"}
        assert reading == (rule["access"] == "read"), f"read rules read and write rules write: {rule}"
        if "create" in rule["verbs"]:
            assert rule["verbs"] == ["create"] or not rule.get("resourceNames"), (
                "create cannot be limited by resourceNames: give it its own rule"
            )
