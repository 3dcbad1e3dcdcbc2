"""The chart's RBAC against the calls the controller really made: the test API server's audit log of
the controller's identity over this folder's scenarios, compared in both directions with the rules
``helm template`` renders (tests/infra/infra_support.py).

It runs last in the folder (file order) and reads what the scenarios before it did: every request
``spotjob-controller`` sent — reads, writes, refused ones (a 404 or a 409 still needed the grant).
"Called but not granted" is checked whatever ran; "granted but never called" only when every
scenario of the folder ran in this session (a ``-k`` selection exercises less).
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest
from e2e_support import CONTROLLER_USER, REPO

from tests.k8s.cluster import TestCluster

sys.path.insert(0, str(REPO / "tests" / "infra"))
from infra_support import Grant, controller_rules, render

pytestmark = pytest.mark.slow

HERE = Path(__file__).resolve().parent

WITH_QUEUE = {"interruptionQueue": {"url": "https://sqs.us-east-1.amazonaws.com/111122223333/spotjob-interruptions"}}
"""test_k8s_interruption_queue.py runs a controller with a queue: the chart grants the Node patch only then."""


def _scenarios() -> set[str]:
    """``file::test`` of every test function in this folder but this file."""
    out = set()
    for path in sorted(HERE.glob("test_*.py")):
        if path.name == Path(__file__).name:
            continue
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
                out.add(f"{path.name}::{node.name}")
    return out


def _allows(grant: Grant, group: str, resource: str, verb: str, name: str) -> bool:
    return (grant.api_group, grant.resource, grant.verb) == (group, resource, verb) and (
        grant.name is None or grant.name == name
    )


def test_the_chart_grants_exactly_the_calls_the_controller_made(
    k8s_cluster: TestCluster, request: pytest.FixtureRequest
) -> None:
    if not k8s_cluster.on_test_server:
        pytest.skip("reads the test API server's audit log")
    # Discovery (GET /apis/<group>/<version>, no resource) is every authenticated user's by default.
    records = [r for r in k8s_cluster.audit_log() if r.user == CONTROLLER_USER and r.resource]
    if not records:
        pytest.skip("no scenario of tests/e2e_k8s ran in this session: this test reads their audit log")
    # The defaults plus an interruption queue: all namespaces (a ClusterRole), leader election,
    # per-job NetworkPolicies, the queue reader — as the scenarios ran the controller. The Lease
    # lives in the release namespace in the chart and in the test's namespace here: names are
    # compared, namespaces are not.
    granted = controller_rules(render(WITH_QUEUE))

    refused = sorted(
        {
            (r.api_group, r.resource_path, r.verb, r.name if r.resource == "leases" else "")
            for r in records
            if not any(_allows(g, r.api_group, r.resource_path, r.verb, r.name) for g in granted)
        }
    )
    assert not refused, f"called but not granted by the chart: {refused}"

    collected = {item.nodeid.split("/")[-1] for item in request.session.items}
    missing = _scenarios() - collected
    if missing:
        pytest.skip(f"not every scenario ran in this session ({len(missing)} did not): 'never called' is not judged")
    called = {(r.api_group, r.resource_path, r.verb) for r in records}
    unused = sorted({(g.api_group, g.resource, g.verb) for g in granted} - called)
    assert not unused, f"granted but never called: {unused}"
