"""The leader killed in every phase of a preemption: another replica takes over and finishes the job.

Two real ``spotjob-controller`` replicas (subprocesses) elect a leader on a Lease; at each phase —
Pending (pods created, ranks starting), Running, Flushing, Rescheduling — the test SIGKILLs the
replica holding the Lease the moment the SpotJob's status shows that phase, and starts a fresh
replica so two are always there. Subprocesses, not threads: SIGKILL is exactly a crashed leader
(no lease released, no reconcile finished, background flush requests lost with it).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from e2e_support import (
    Controller,
    PodHistory,
    assert_same_final_state,
    create_job,
    job_pods,
    running_pods,
    spotjob_body,
    status,
    wait,
    wait_for_a_commit,
    wait_phase,
)

from tests.k8s.cluster import TestCluster

pytestmark = pytest.mark.slow

LEASE = "spotjob-controller"


def _holder(cluster: TestCluster, namespace: str) -> str | None:
    lease = cluster.rest.get(f"/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases/{LEASE}")
    return lease["spec"].get("holderIdentity") or None


def test_a_leader_killed_in_every_phase_is_replaced_and_the_job_ends_right_with_no_duplicate_pods(
    cluster: TestCluster,
    namespace: str,
    start_controller: Callable[..., Controller],
    uninterrupted: Path,
    tmp_path: Path,
) -> None:
    cluster.add_node(f"{namespace}-a", zone="us-east-1a")
    cluster.add_node(f"{namespace}-b", zone="us-east-1b")
    replicas: dict[str, Controller] = {}
    serial = iter(range(100))

    def add_replica() -> None:
        name = f"controller-{next(serial)}"
        replica = start_controller(namespace, leader_elect=True, env={"POD_NAME": name})
        replicas[name] = replica

    def kill_leader(phase: str) -> None:
        leader = wait(lambda: _holder(cluster, namespace), "a leader")
        assert phase == status(cluster, namespace, "train").get("phase") or phase == "Pending"
        replicas.pop(leader).kill()
        killed.append((phase, leader))
        add_replica()
        # Another replica takes the Lease over once it expires (SIGKILL released nothing).
        wait(lambda: (_holder(cluster, namespace) or leader) != leader, f"a new leader after {phase}")

    killed: list[tuple[str, str]] = []
    add_replica()
    add_replica()
    history = PodHistory(cluster, namespace)
    dumps = tmp_path / "dumps"
    dumps.mkdir()
    create_job(cluster, spotjob_body("train", namespace, uri=str(tmp_path / "ckpt"), dump_dir=dumps, step_sleep=0.3))

    wait(lambda: job_pods(cluster, namespace, "train"), "the first pod")
    kill_leader("Pending")
    wait_phase(cluster, namespace, "train", "Running")
    kill_leader("Running")
    # From storage: the status shows a commit up to 10 s late, later still after a leader change,
    # and by then the short job may be over.
    wait_for_a_commit(str(tmp_path / "ckpt"))
    (pod,) = running_pods(cluster, namespace, "train", 0)
    cluster.taint_node(pod["spec"]["nodeName"], "aws-node-termination-handler/spot-itn", "true", "NoSchedule")
    wait_phase(cluster, namespace, "train", "Flushing")
    kill_leader("Flushing")
    wait_phase(cluster, namespace, "train", "Rescheduling")  # lasts while the next pod's ranks start
    kill_leader("Rescheduling")
    final = wait_phase(cluster, namespace, "train", "Succeeded")
    history.stop()

    assert [p for p, _ in killed] == ["Pending", "Running", "Flushing", "Rescheduling"], killed
    assert final["preemptions"] == 1 and final["restarts"] == 0, final
    assert final["attempt"]["number"] == 1, final["attempt"]  # one restart: no attempt started twice
    uids = history.uids_by_name()
    assert sorted(uids) == ["train-0-0", "train-1-0"], uids
    assert all(len(u) == 1 for u in uids.values()), uids  # never a pod deleted and created again
    assert not history.attempts_alive_together()
    assert_same_final_state(dumps / "train-1-0", uninterrupted)
