"""Capacity fallback on the test cluster: a job that selects spot nodes finds none it may use, says
CapacityUnavailable after its start timeout, moves to the fallback (on-demand) pool once one
appears, and after the preemption-free period its next restart — here a person's flush request —
brings it back to spot. Bit-identical at the end.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from e2e_support import (
    Controller,
    assert_same_final_state,
    create_job,
    event_reasons,
    job_pods,
    jobs_path,
    spotjob_body,
    status,
    wait,
    wait_phase,
)

from tests.k8s.cluster import TestCluster

pytestmark = pytest.mark.slow

CAPACITY_TYPE = "karpenter.sh/capacity-type"
RETURN_AFTER = 4.0


def _condition(s: dict[str, Any], kind: str) -> dict[str, Any] | None:
    return next((c for c in s.get("conditions") or [] if c["type"] == kind), None)


def _pods_of(cluster: TestCluster, namespace: str, attempt: int) -> list[dict[str, Any]]:
    pods = job_pods(cluster, namespace, "train")
    return [p for p in pods if p["metadata"]["labels"]["spotjob.dev/attempt"] == str(attempt)]


def test_no_spot_capacity_moves_the_job_to_the_fallback_pool_and_after_the_period_a_restart_brings_it_back(
    cluster: TestCluster,
    namespace: str,
    start_controller: Callable[..., Controller],
    uninterrupted: Path,
    tmp_path: Path,
) -> None:
    spot = f"{namespace}-spot"
    on_demand = f"{namespace}-od"
    # The spot pool has a node, but it takes no new pods (reserved): no spot capacity for the job.
    cluster.add_node(spot, capacity_type="spot", taints=[{"key": "example.com/reserved", "effect": "NoSchedule"}])
    start_controller(namespace)
    dumps = tmp_path / "dumps"
    dumps.mkdir()
    # Paced so that the fallback attempt still trains when the test asks for the restart, RETURN_AFTER
    # + 1 s after it started: about 17 of its 60 steps by then, 13 s of training left at the least.
    body = spotjob_body("train", namespace, uri=str(tmp_path / "ckpt"), dump_dir=dumps, step_sleep=0.3)
    body["spec"]["template"]["spec"]["nodeSelector"] = {CAPACITY_TYPE: "spot"}
    body["spec"]["startTimeoutSeconds"] = 5
    body["spec"]["fallback"] = {
        "template": {"spec": {"nodeSelector": {CAPACITY_TYPE: "on-demand"}}},
        "returnAfterSeconds": RETURN_AFTER,
    }
    create_job(cluster, body)

    # No spot capacity: after the start timeout the job says so and its next attempt is the fallback's.
    def fell_back() -> dict[str, Any] | None:
        s = status(cluster, namespace, "train")
        c = _condition(s, "CapacityUnavailable")
        return s if c and c["status"] == "True" and s.get("capacity") == "fallback" else None

    s = wait(fell_back, "CapacityUnavailable and the fallback")
    assert "found no capacity within startTimeoutSeconds" in _condition(s, "CapacityUnavailable")["message"]  # type: ignore[index]
    assert s["phase"] in ("Rescheduling", "Pending") and s["preemptions"] == 0 and s["restarts"] == 0

    # The fallback pool appears; the job runs there.
    cluster.add_node(on_demand, capacity_type="on-demand", zone="us-east-1b")
    s = wait_phase(cluster, namespace, "train", "Running")
    assert s["capacity"] == "fallback" and s["attempt"]["number"] == 1
    (worker,) = _pods_of(cluster, namespace, 1)
    assert worker["spec"]["nodeName"] == on_demand
    assert worker["spec"]["nodeSelector"] == {CAPACITY_TYPE: "on-demand"}
    assert _condition(s, "CapacityUnavailable")["status"] == "False"  # type: ignore[index]
    header, row = cluster.kubectl("get", "sj", "train", "-n", namespace).stdout.splitlines()[:2]
    at = header.index("CAPACITY")  # columns are aligned; empty cells (no checkpoint yet) are blank
    assert row[at:].split()[0] == "fallback", (header, row)

    # Spot capacity comes back; nothing moves the job for that alone. After the preemption-free
    # period, the next restart (a person's flush request) goes back to spot.
    cluster.untaint_node(spot, "example.com/reserved")
    since = datetime.fromisoformat(str(s["fallbackSince"]).replace("Z", "+00:00"))
    while datetime.now(UTC) < since + timedelta(seconds=RETURN_AFTER + 1):
        time.sleep(0.2)
    request = {"id": "back-to-spot", "mode": "restart", "reason": "spot is back", "requestedAt": "2026-03-01T10:00:00Z"}
    cluster.rest.request(
        "PATCH",
        jobs_path(namespace, "train"),
        {"metadata": {"annotations": {"spotjob.dev/flush-request": json.dumps(request)}}},
        content_type="application/merge-patch+json",
    )

    final = wait_phase(cluster, namespace, "train", "Succeeded")
    assert final["capacity"] == "spot" and final["attempt"]["number"] == 2
    (last,) = _pods_of(cluster, namespace, 2)
    assert last["spec"]["nodeName"] == spot and last["spec"]["nodeSelector"] == {CAPACITY_TYPE: "spot"}
    assert (final["preemptions"], final["restarts"]) == (0, 0)
    assert [(h["cause"], h["reason"]) for h in final["restartHistory"]] == [
        ("Capacity", "CapacityUnavailable"),
        ("Requested", "FlushRequestedByUser"),
    ]
    assert final["lastFlushRequest"]["outcome"] == "Committed"
    reasons = event_reasons(cluster, namespace, "train")
    for reason in ("CapacityUnavailable", "ReturningToSpot", "FlushRequestedByUser", "FlushRequestCommitted"):
        assert reason in reasons, reasons
    assert_same_final_state(dumps / last["metadata"]["name"], uninterrupted)


def test_a_gang_only_partly_placed_past_the_start_timeout_gives_its_node_back_and_runs_once_whole(
    cluster: TestCluster,
    namespace: str,
    start_controller: Callable[..., Controller],
    tmp_path: Path,
) -> None:
    """replicas: 2 with room for one worker and no fallback: replica 0 is placed and its agent waits
    in the rendezvous for replica 1, which no node takes. It used to hold its node for as long as
    capacity was missing. Past startTimeoutSeconds it is stopped (GangIncomplete), and once a second
    node comes the gang runs whole. (The test scheduler places one worker a node here through their
    CPU requests, not the anti-affinity term, which it does not model.)"""
    pool = {"example.com/pool": namespace}
    cluster.add_node(f"{namespace}-a", labels=pool, cpu="1")
    start_controller(namespace)
    dumps = tmp_path / "dumps"
    dumps.mkdir()
    # 20 steps: the whole gang runs to the end with two commits; the training's own result is not
    # what is checked here.
    body = spotjob_body("train", namespace, uri=str(tmp_path / "ckpt"), dump_dir=dumps, replicas=2, nproc=1, steps=20)
    body["spec"]["template"]["spec"]["nodeSelector"] = pool
    body["spec"]["startTimeoutSeconds"] = 5
    create_job(cluster, body)

    def released() -> dict[str, Any] | None:
        s = status(cluster, namespace, "train")
        history = [(h["cause"], h["reason"]) for h in s.get("restartHistory") or []]
        return s if ("Capacity", "GangIncomplete") in history else None

    s = wait(released, "the partly placed gang stopped")
    message = _condition(s, "CapacityUnavailable")["message"]  # type: ignore[index]
    assert "train-0-1 found no capacity" in message and "stopping train-0-0" in message, message
    wait(lambda: not _pods_of(cluster, namespace, 0), "attempt 0's placed worker gone")
    assert (s["preemptions"], s["restarts"]) == (0, 0)

    cluster.add_node(f"{namespace}-b", labels=pool, cpu="1", zone="us-east-1b")
    final = wait_phase(cluster, namespace, "train", "Succeeded")
    assert (final["preemptions"], final["restarts"]) == (0, 0), final
    assert _condition(final, "CapacityUnavailable")["status"] == "False"  # type: ignore[index]
