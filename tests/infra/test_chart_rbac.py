"""The controller's RBAC: least privilege, read and write apart, a comment on every rule, and exactly
the API calls the controller makes — in both directions.

Two sides, one list: ``orchestrator.k8s.api.PERMISSIONS`` is every call the controller may make
(``KubeClient`` refuses any other before sending it, so every test of the controller proves its
calls are in it), and files/rbac.yaml is what the chart grants. Here the rendered rules are compared
with PERMISSIONS for every way the chart can be configured; tests/e2e_k8s/test_k8s_rbac_drift.py
compares them with the calls the controller really made in the end-to-end scenarios (the test API
server's audit log).
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
    expand,
    find,
    helm,
    one,
    rbac_file_rules,
    render,
)

from orchestrator.k8s.api import MIN_KUBERNETES, PERMISSIONS
from orchestrator.k8s.plugin_client import PLUGIN_PERMISSIONS

LEASE = "spotjob-controller"
QUEUE = {"interruptionQueue": {"url": "https://sqs.us-east-1.amazonaws.com/111122223333/spotjob-interruptions"}}
CLUSTER_SCOPED = {"nodes", "events"}
"""Nodes are cluster-scoped; a Node's Events live in the default namespace, so Events are granted cluster-wide."""


def expected(*, job_namespaces: list[str | None], network_policy: bool, leader: bool, queue: bool) -> set[Grant]:
    """PERMISSIONS as the chart must grant them: cluster-scoped kinds in the ClusterRole, the Lease
    by name in its namespace (create cannot be narrowed by name), everything else in the namespaces
    jobs run in (None: all, the ClusterRole); NetworkPolicies only when the controller creates them,
    the Lease only with leader election, the patch of Nodes only with an interruption queue."""
    grants: set[Grant] = set()
    for p in PERMISSIONS:
        if p.resource == "networkpolicies" and not network_policy:
            continue
        if (p.resource, p.verb) == ("nodes", "patch") and not queue:
            continue
        if p.resource == "leases":
            if leader:
                grants.add(Grant(NAMESPACE, p.group, p.resource, p.verb, None if p.verb == "create" else LEASE))
        elif p.resource in CLUSTER_SCOPED:
            grants.add(Grant(None, p.group, p.resource, p.verb, None))
        else:
            grants |= {Grant(ns, p.group, p.resource, p.verb, None) for ns in job_namespaces}
    return grants


CASES: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "defaults": ({}, {"job_namespaces": [None], "network_policy": True, "leader": True, "queue": False}),
    # The queue reader annotates Nodes: only then may the controller patch them.
    "queue": (QUEUE, {"job_namespaces": [None], "network_policy": True, "leader": True, "queue": True}),
    "no-network-policy": (
        {"networkPolicy": {"enabled": False}},
        {"job_namespaces": [None], "network_policy": False, "leader": True, "queue": False},
    ),
    "one-replica": (
        {"replicas": 1, "leaderElection": {"enabled": False}},
        {"job_namespaces": [None], "network_policy": True, "leader": False, "queue": False},
    ),
    "watch-namespaces": (
        {"watchNamespaces": ["ml-training", "research"], **QUEUE},
        {"job_namespaces": ["ml-training", "research"], "network_policy": True, "leader": True, "queue": True},
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_rendered_rules_are_exactly_the_controllers_permission_list(case: str) -> None:
    values, settings = CASES[case]
    granted = controller_rules(render(values))
    wanted = expected(**settings)
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


def _granted(role: dict[str, Any]) -> set[tuple[str, str, str]]:
    return {(g.api_group, g.resource, g.verb) for rule in role.get("rules") or [] for g in expand(rule, None)}


@pytest.mark.parametrize("case", sorted(CASES))
def test_events_are_granted_through_events_k8s_io_alone(case: str) -> None:
    """The controller writes and the plugin reads Events through events.k8s.io/v1 only (served
    since Kubernetes 1.19; the chart needs 1.29): no role of the chart grants anything on core v1
    ``events``, which a fallback for servers without events.k8s.io once needed."""
    values, _ = CASES[case]
    objects = render(values)
    roles = find(objects, "ClusterRole") + find(objects, "Role")
    core = sorted(
        (r["kind"], r["metadata"]["name"], verb)
        for r in roles
        for group, resource, verb in _granted(r)
        if (group, resource) == ("", "events")
    )
    assert not core, f"grants on core v1 events: {core}"
    events = {(g.api_group, g.verb) for g in controller_rules(objects) if g.resource == "events"}
    assert events == {("events.k8s.io", "create"), ("events.k8s.io", "patch")}


def test_the_view_role_lets_a_team_read_its_jobs_events_through_events_k8s_io() -> None:
    """``kubectl spotjob events`` lists events.k8s.io/v1 Events, which the built-in ``view`` role
    does not grant (it reads Events through core v1 alone): the chart's role aggregated into it
    adds that ``list``, so a team bound to ``view`` can run ``events`` as the README says."""
    view = one(render(), "ClusterRole", f"{RELEASE}-view")
    assert view["metadata"]["labels"]["rbac.authorization.k8s.io/aggregate-to-view"] == "true"
    granted = _granted(view)
    assert ("events.k8s.io", "events", "list") in granted
    reads = {(p.group, p.resource, p.verb) for p in PLUGIN_PERMISSIONS if p.verb != "patch"}
    builtin_view = {("", "pods", "list")}  # the built-in view role's own, among the plugin's reads
    assert reads <= granted | builtin_view, sorted(reads - granted - builtin_view)


def test_the_minimum_kubernetes_the_controller_names_is_the_charts() -> None:
    """Where events.k8s.io/v1 is not served, the controller and the plugin say which Kubernetes
    spotjob needs: the chart's ``kubeVersion``, not a number of their own."""
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["kubeVersion"] == f">={MIN_KUBERNETES}.0-0"
