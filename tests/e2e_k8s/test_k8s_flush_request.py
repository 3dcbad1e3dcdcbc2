"""A person's flush request end to end (the annotation ``kubectl spotjob flush`` writes), with the
checkpoint hints on the workers' pods: ``checkpoint`` commits a checkpoint while training goes on,
``restart`` flushes every agent (each exits 75) and restarts the gang without counting a
preemption or a restart; the same id written again is not handled twice, and neither does a new
leader handle a request the old one handled. Bit-identical at the end.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from e2e_support import (
    CONTROLLER_USER,
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

from agent.catalog import list_checkpoints
from agent.storage import open_storage
from tests.k8s.cluster import TestCluster

pytestmark = pytest.mark.slow

ANNOTATION = "spotjob.dev/flush-request"


def ask(cluster: TestCluster, namespace: str, rid: str, mode: str, reason: str = "") -> None:
    """What the plugin does: a merge patch of the annotation (RBAC: patch on spotjobs)."""
    request = {"id": rid, "mode": mode, "reason": reason, "requestedAt": "2026-03-01T10:00:00Z"}
    cluster.rest.request(
        "PATCH",
        jobs_path(namespace, "train"),
        {"metadata": {"annotations": {ANNOTATION: json.dumps(request)}}},
        content_type="application/merge-patch+json",
    )


def handled(cluster: TestCluster, namespace: str, rid: str) -> dict[str, Any] | None:
    last = status(cluster, namespace, "train").get("lastFlushRequest") or {}
    return last if last.get("id") == rid and last.get("outcome") != "InProgress" else None


def _pods_of(cluster: TestCluster, namespace: str, attempt: int) -> list[dict[str, Any]]:
    pods = job_pods(cluster, namespace, "train")
    return [p for p in pods if p["metadata"]["labels"]["spotjob.dev/attempt"] == str(attempt)]


def test_both_modes_of_a_flush_request_each_handled_once_across_a_leader_change_with_hints_bit_identical(
    cluster: TestCluster,
    namespace: str,
    start_controller: Callable[..., Controller],
    uninterrupted: Path,
    tmp_path: Path,
) -> None:
    cluster.add_node(f"{namespace}-a", zone="us-east-1a")
    cluster.add_node(f"{namespace}-b", zone="us-east-1b")
    first = start_controller(namespace, leader_elect=True)
    mark = cluster.audit_mark() if cluster.on_test_server else 0
    dumps = tmp_path / "dumps"
    dumps.mkdir()
    uri = str(tmp_path / "ckpt")
    body = spotjob_body("train", namespace, uri=uri, dump_dir=dumps, step_sleep=0.4, every_steps=20)
    create_job(cluster, body)
    wait_phase(cluster, namespace, "train", "Running")
    wait(lambda: (status(cluster, namespace, "train").get("lastCheckpoint") or {}).get("step"), "a first checkpoint")

    # The running worker carries the newest commit as hints.
    def hinted() -> dict[str, str] | None:
        (pod,) = _pods_of(cluster, namespace, 0)
        annotations = pod["metadata"].get("annotations") or {}
        last = status(cluster, namespace, "train").get("lastCheckpoint") or {}
        return annotations if annotations.get("spotjob.dev/last-checkpoint-step") == str(last.get("step")) else None

    hints = wait(hinted, "the checkpoint hints on the worker")
    assert hints["spotjob.dev/last-checkpoint-time"].endswith("Z")

    # checkpoint: a commit now, training goes on.
    ask(cluster, namespace, "ckpt-1", "checkpoint", "before the eval")
    done = wait(lambda: handled(cluster, namespace, "ckpt-1"), "the checkpoint request to be handled")
    assert (done["mode"], done["outcome"]) == ("checkpoint", "Committed"), done
    s = status(cluster, namespace, "train")
    assert (s["phase"], s["attempt"]["number"]) == ("Running", 0)
    early = [c for c in list_checkpoints(open_storage(uri)) if c.manifest and c.manifest.trigger == "early"]
    assert early, "the agent's early save committed"

    # restart: every agent flushes, the gang restarts from that commit; nothing is counted.
    ask(cluster, namespace, "restart-1", "restart", "new data mix")
    done = wait(lambda: handled(cluster, namespace, "restart-1"), "the restart request to be handled")
    assert (done["mode"], done["outcome"]) == ("restart", "Committed"), done
    s = wait_phase(cluster, namespace, "train", "Running")
    assert s["attempt"]["number"] == 1 and s["attempt"]["resumedFromStep"] == done["step"]
    assert (s["preemptions"], s["restarts"]) == (0, 0)
    assert s.get("avoid") in (None, []), "no cool-down: the nodes are fine"
    agent_log = cluster.pod_log(namespace, "train-0-0", "trainer")
    assert "exiting 75: the flush committed step" in agent_log, agent_log[-3000:]

    # The same id again (a retried kubectl), then a new leader reading the same annotation: nothing.
    ask(cluster, namespace, "restart-1", "restart", "retried")
    first.kill()
    start_controller(namespace, leader_elect=True)

    final = wait_phase(cluster, namespace, "train", "Succeeded")
    assert final["attempt"]["number"] == 1, "a handled request is never handled again"
    assert [(h["cause"], h["reason"]) for h in final["restartHistory"]] == [("Requested", "FlushRequestedByUser")]
    assert not _pods_of(cluster, namespace, 2)
    reasons = event_reasons(cluster, namespace, "train")
    for reason in ("CheckpointRequestedByUser", "FlushRequestedByUser", "FlushRequestCommitted"):
        assert reason in reasons, reasons
    assert reasons.count("FlushRequestedByUser") == 1

    # At most one hint patch per pod per commit, never a patch that changes nothing.
    if cluster.on_test_server:
        commits = len([c for c in list_checkpoints(open_storage(uri)) if c.valid])
        patches: dict[str, int] = {}
        for r in cluster.audit_log(mark):
            if r.user == CONTROLLER_USER and r.resource == "pods" and r.verb == "patch" and r.namespace == namespace:
                patches[r.name] = patches.get(r.name, 0) + 1
        assert patches.get("train-0-0") and patches.get("train-1-0"), patches
        assert all(n <= commits for n in patches.values()), (patches, commits)
    (last,) = _pods_of(cluster, namespace, 1)
    assert_same_final_state(dumps / last["metadata"]["name"], uninterrupted)
