"""A SpotJob through preemptions on the test cluster, driven by a real ``spotjob-controller`` process.

Each test: its own namespace, nodes and controller (``--namespace``); checkpoints on file:// (the
pods are local processes) or on s3:// through moto; the final state compared bit for bit with an
uninterrupted run of the same script.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from e2e_support import (
    Controller,
    PodHistory,
    assert_same_final_state,
    create_job,
    event_reasons,
    job_events,
    job_pods,
    running_pods,
    spotjob_body,
    status,
    wait,
    wait_for_a_commit,
    wait_phase,
)

from agent.catalog import latest_valid, list_checkpoints
from agent.ownership import read_attempt, recorded_attempts
from agent.storage import open_storage
from tests.k8s.cluster import TestCluster

pytestmark = pytest.mark.slow


def _node_of(pod: dict) -> str:
    return str(pod["spec"]["nodeName"])


def test_a_spot_interruption_taint_flushes_the_job_moves_it_tells_each_transition_once_and_it_ends_bit_identical(
    cluster: TestCluster,
    namespace: str,
    start_controller: Callable[..., Controller],
    uninterrupted: Path,
    tmp_path: Path,
) -> None:
    """The taint preemption cycle end to end: flushed, moved to the other node, no pod name reused
    and no two attempts alive at once, bit-identical at the end.

    What an operator reads of it (the same run; it was a test of its own with the very same job):
    a preemption taint carries no deadline, so the flush is bounded by ``flushTimeoutSeconds``: its
    ``FlushRequested`` Event said "accepted the request to flush by no deadline". It now names the
    time the controller gives up on the flush and why. Also pins (already right) one Event per
    transition of the cycle, and the controller's counters matching the one preemption (the job's
    own flush counters too: one committed)."""
    history = PodHistory(cluster, namespace)
    controller, dumps, preempted = _trained_to_a_commit_on_two_nodes(cluster, namespace, start_controller, tmp_path)
    cluster.taint_node(preempted, "aws-node-termination-handler/spot-itn", "true", "NoSchedule")

    final = wait_phase(cluster, namespace, "train", "Succeeded")
    history.stop()

    assert final["preemptions"] == 1 and final["restarts"] == 0, final
    pods = job_pods(cluster, namespace, "train")
    (last,) = [p for p in pods if p["metadata"]["labels"]["spotjob.dev/attempt"] == "1"]
    assert _node_of(last) != preempted
    reasons = event_reasons(cluster, namespace, "train")
    for reason in ("SpotInterrupted", "FlushRequested", "FlushCommitted", "Rescheduled", "WorkersRunning"):
        assert reason in reasons, reasons
    assert all(len(uids) == 1 for uids in history.uids_by_name().values()), history.uids_by_name()
    assert not history.attempts_alive_together()
    metrics = controller.metrics()
    assert metrics['spotjob_signals_total{kind="SpotInterruption",source="k8s-node"}'] >= 1
    assert metrics['spotjob_flush_requests_total{outcome="accepted"}'] >= 1
    assert metrics["spotjob_notice_to_commit_seconds_count"] == 1
    assert metrics["spotjob_preemptions_total"] == 1
    assert metrics['spotjob_restarts_total{cause="preemption"}'] == 1
    goodput = {k: v for k, v in metrics.items() if k.startswith("spotjob_job_goodput_ratio")}
    assert goodput == {f'spotjob_job_goodput_ratio{{name="train",namespace="{namespace}"}}': final["goodput"]}
    assert_same_final_state(dumps / last["metadata"]["name"], uninterrupted)

    # What an operator reads: one Event per transition, the flush's deadline named, the counters.
    # The pass that wrote Succeeded emits its Event after the write: wait for it, not read at once.
    def completed() -> list[dict[str, Any]] | None:
        events = job_events(cluster, namespace, "train")
        return events if any(e["reason"] == "Completed" for e in events) else None

    events = wait(completed, "the Completed Event")
    assert [e["reason"] for e in events] == [
        "WorkersStarted",
        "WorkersRunning",
        "SpotInterrupted",
        "FlushRequested",
        "FlushCommitted",
        "Rescheduled",
        "WorkersStarted",
        "WorkersRunning",
        "Completed",
    ], events
    (requested,) = [e for e in events if e["reason"] == "FlushRequested"]
    assert re.fullmatch(
        r"1 agent\(s\) accepted the request to flush by \d{4}-\d\d-\d\dT\S+ \(flushTimeoutSeconds: the signal "
        r"gave no deadline\): train-0-0",
        requested["note"],
    ), requested["note"]
    metrics = controller.metrics()
    assert metrics["spotjob_preemptions_total"] == final["preemptions"]
    job = f'name="train",namespace="{namespace}"'
    assert metrics[f'spotjob_job_flushes_total{{{job},outcome="committed"}}'] == 1
    assert metrics[f'spotjob_job_flushes_total{{{job},outcome="timed_out"}}'] == 0
    assert metrics[f"spotjob_job_agent_flush_failures_total{{{job}}}"] == 0


def test_a_noexecute_taint_the_worker_does_not_tolerate_is_a_preemption_it_flushes_for_bit_identical(
    cluster: TestCluster,
    namespace: str,
    start_controller: Callable[..., Controller],
    uninterrupted: Path,
    tmp_path: Path,
) -> None:
    """Pins what already worked: a ``NoExecute`` taint spotjob does not know (an operator's, or the
    node lifecycle controller's once its toleration runs out) makes the taint manager mark the
    worker ``DisruptionTarget``/``DeletionByTaintManager`` and delete it with its grace period. The
    controller takes the condition as a preemption (no restart counted) and the agent the SIGTERM
    as a notice: the flush commits and the job moves. The test control plane's taint manager plays
    the real one (it does not model ``tolerationSeconds`` added by admission)."""
    _, dumps, tainted = _trained_to_a_commit_on_two_nodes(cluster, namespace, start_controller, tmp_path)
    cluster.taint_node(tainted, "example.com/maintenance", "true", "NoExecute")

    final = wait_phase(cluster, namespace, "train", "Succeeded")
    assert final["preemptions"] == 1 and final["restarts"] == 0, final
    (last,) = [
        p for p in job_pods(cluster, namespace, "train") if p["metadata"]["labels"]["spotjob.dev/attempt"] == "1"
    ]
    assert _node_of(last) != tainted
    assert "SpotInterrupted" in event_reasons(cluster, namespace, "train")
    assert_same_final_state(dumps / last["metadata"]["name"], uninterrupted)


def _trained_to_a_commit_on_two_nodes(
    cluster: TestCluster, namespace: str, start_controller: Callable[..., Controller], tmp_path: Path
) -> tuple[Controller, Path, str]:
    """Two nodes in two zones, a controller, and job ``train`` running with a committed checkpoint:
    (the controller, the folder of the workers' final-state dumps, the node its worker runs on)."""
    cluster.add_node(f"{namespace}-a", zone="us-east-1a")
    cluster.add_node(f"{namespace}-b", zone="us-east-1b")
    controller = start_controller(namespace)
    dumps = tmp_path / "dumps"
    dumps.mkdir()
    create_job(cluster, spotjob_body("train", namespace, uri=str(tmp_path / "ckpt"), dump_dir=dumps, step_sleep=0.3))
    wait_phase(cluster, namespace, "train", "Running")
    wait_for_a_commit(str(tmp_path / "ckpt"))
    (first,) = _still_running(cluster, namespace)
    return controller, dumps, _node_of(first)


def _still_running(cluster: TestCluster, namespace: str) -> list[dict[str, Any]]:
    pods = running_pods(cluster, namespace, "train", 0)
    assert pods, f"the job ended before it could be preempted ({status(cluster, namespace, 'train').get('phase')})"
    return pods


def _aws_env() -> dict[str, str]:
    """moto's endpoint and fake credentials (set by the moto_server fixture), for the pods."""
    return {k: v for k, v in os.environ.items() if k.startswith("AWS_")}


def test_a_node_deleted_without_notice_loses_its_worker_and_the_job_resumes_from_s3_bit_identical(
    cluster: TestCluster,
    namespace: str,
    start_controller: Callable[..., Controller],
    uninterrupted: Path,
    fresh_uri: Callable[[str], str],
    tmp_path: Path,
) -> None:
    uri = fresh_uri("s3")
    cluster.add_node(f"{namespace}-a", zone="us-east-1a")
    cluster.add_node(f"{namespace}-b", zone="us-east-1b")
    start_controller(namespace)
    dumps = tmp_path / "dumps"
    dumps.mkdir()
    create_job(cluster, spotjob_body("train", namespace, uri=uri, dump_dir=dumps, env=_aws_env(), step_sleep=0.3))

    wait_phase(cluster, namespace, "train", "Running")
    wait_for_a_commit(uri)
    (first,) = _still_running(cluster, namespace)
    lost = _node_of(first)
    cluster.delete_node(lost)  # the VM is gone: its processes die at once, no notice, no flush

    final = wait_phase(cluster, namespace, "train", "Succeeded")
    assert final["preemptions"] == 1 and final["restarts"] == 0, final
    (last,) = [
        p for p in job_pods(cluster, namespace, "train") if p["metadata"]["labels"]["spotjob.dev/attempt"] == "1"
    ]
    assert _node_of(last) != lost
    history = final.get("restartHistory") or []
    assert [h["cause"] for h in history] == ["Preemption"], history
    assert "FlushRequested" not in event_reasons(cluster, namespace, "train")  # nobody left to flush
    assert uri.startswith("s3://") and final["lastCheckpoint"]["uri"].startswith(uri)
    assert_same_final_state(dumps / last["metadata"]["name"], uninterrupted)


def test_a_zombie_of_the_old_attempt_that_trains_on_behind_a_partition_never_counts_and_the_job_ends_bit_identical(
    cluster: TestCluster,
    namespace: str,
    start_controller: Callable[..., Controller],
    uninterrupted: Path,
    tmp_path: Path,
) -> None:
    cluster.add_node(f"{namespace}-a", zone="us-east-1a")
    cluster.add_node(f"{namespace}-b", zone="us-east-1b")
    start_controller(namespace)
    dumps = tmp_path / "dumps"
    dumps.mkdir()
    uri = str(tmp_path / "ckpt")
    # Slow steps, frequent saves: the zombie is still training, and tries to save, well after the
    # controller has started the next attempt.
    create_job(cluster, spotjob_body("train", namespace, uri=uri, dump_dir=dumps, step_sleep=0.3, every_steps=5))
    wait_phase(cluster, namespace, "train", "Running")
    wait_for_a_commit(uri)
    (zombie,) = running_pods(cluster, namespace, "train", 0)
    partitioned = _node_of(zombie)
    cluster.partition_node(partitioned)  # its kubelet loses the API server; its processes train on

    storage = open_storage(uri)
    job_id = f"{namespace}/train"
    wait(lambda: 1 in recorded_attempts(storage, job_id), "attempt 1 to be recorded in storage")
    fence = read_attempt(storage, job_id, 1).fence
    assert cluster.pod_pids(namespace, "train-0-0"), "the zombie should still be running after attempt 1 was recorded"

    final = wait_phase(cluster, namespace, "train", "Succeeded")
    (last,) = [
        p for p in job_pods(cluster, namespace, "train") if p["metadata"]["labels"]["spotjob.dev/attempt"] == "1"
    ]
    assert _node_of(last) != partitioned
    zombie_log = cluster.pod_log(namespace, "train-0-0", "trainer")
    assert "superseded attempt" in zombie_log, zombie_log[-3000:]  # it tried to commit and was refused

    # Nothing the zombie wrote after the fence counts: attempt 1 resumed from the fence, and every
    # checkpoint attempt 0 committed past it (if one slipped in) is judged fenced, never valid.
    assert final["attempt"]["number"] == 1
    assert (fence.step if fence else None) == final["attempt"].get("resumedFromStep"), (fence, final["attempt"])
    for checkpoint in list_checkpoints(storage):
        manifest = checkpoint.manifest
        if manifest is not None and manifest.attempt == 0 and fence is not None and checkpoint.ref.step > fence.step:
            assert checkpoint.fenced and not checkpoint.valid, checkpoint
    newest = latest_valid(storage)
    assert newest is not None and newest.manifest is not None and newest.manifest.attempt == 1
    assert_same_final_state(dumps / last["metadata"]["name"], uninterrupted)
    storage.close()


def test_two_replicas_rendezvous_without_dns_each_turn_ready_each_agent_exits_75_after_a_flush_bit_identical(
    cluster: TestCluster,
    namespace: str,
    start_controller: Callable[..., Controller],
    uninterrupted: Path,
    tmp_path: Path,
) -> None:
    for zone, suffix in (("us-east-1a", "a"), ("us-east-1b", "b"), ("us-east-1c", "c")):
        cluster.add_node(f"{namespace}-{suffix}", zone=zone)
    start_controller(namespace)
    dumps = tmp_path / "dumps"
    dumps.mkdir()
    create_job(
        cluster, spotjob_body("train", namespace, uri=str(tmp_path / "ckpt"), dump_dir=dumps, replicas=2, nproc=1)
    )
    wait_phase(cluster, namespace, "train", "Running")
    # Every replica's own agent says its ranks train (each node's first rank reports to it).
    pods = running_pods(cluster, namespace, "train", 0)
    assert len(pods) == 2
    master = pods[0]["status"]["podIP"]
    assert master in pods[1]["spec"]["containers"][0]["args"]  # replica 1 got replica 0's pod IP
    wait_for_a_commit(str(tmp_path / "ckpt"))
    preempted = _node_of(pods[1])
    cluster.taint_node(preempted, "aws-node-termination-handler/spot-itn", "true", "NoSchedule")

    final = wait_phase(cluster, namespace, "train", "Succeeded")
    assert final["preemptions"] == 1 and final["restarts"] == 0, final
    last = sorted(
        (p for p in job_pods(cluster, namespace, "train") if p["metadata"]["labels"]["spotjob.dev/attempt"] == "1"),
        key=lambda p: p["metadata"]["name"],
    )
    assert len(last) == 2 and preempted not in {_node_of(p) for p in last}
    # Every agent of attempt 0 saw the flush's result on its own node and exited 75, not only
    # replica 0's (whose node hosts global rank 0).
    for index in (0, 1):
        agent_log = cluster.pod_log(namespace, f"train-0-{index}", "trainer")
        assert "exiting 75: the flush committed step" in agent_log, agent_log[-3000:]
        # The controller's default --agent-launcher direct: the agents started the ranks themselves,
        # replica 0's rank hosting the rendezvous store on its pod IP.
        assert "started the 1 rank(s) of torchrun" in agent_log and "directly" in agent_log, agent_log[:3000]
    # One rank per pod: rank r of the world is replica r's only rank.
    for rank, pod in enumerate(last):
        got = dumps / f"{pod['metadata']['name']}.rank{rank}.pt"
        assert got.exists(), sorted(p.name for p in dumps.iterdir())
    merged = tmp_path / "merged"
    for rank, pod in enumerate(last):
        (Path(f"{merged}.rank{rank}.pt")).write_bytes((dumps / f"{pod['metadata']['name']}.rank{rank}.pt").read_bytes())
    assert_same_final_state(merged, uninterrupted)
