"""The controller's wiring: SpotJob, worker Pod and Node events become job keys; the seam is called."""

from __future__ import annotations

import dataclasses
import threading
from collections import Counter
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import pytest
from ctl_support import TestApi, wait_for

from orchestrator.k8s.api import LEASES, NODES, PODS, Resource
from orchestrator.k8s.controller import JOB_LABEL, Controller, ControllerContext, ControllerOptions
from orchestrator.k8s.interruption_queue import QueueMessage
from orchestrator.k8s.leader import LeaseTiming
from orchestrator.k8s.workqueue import ObjectKey, Reconcile
from orchestrator.model import JobStatus, Phase

CANDIDATE = ControllerOptions(
    leader_elect=True,
    lease_namespace="default",
    identity="candidate",
    lease_timing=LeaseTiming(lease_duration=3.0, renew_deadline=2.0, retry_period=0.2),
    http_port=0,
    workers=1,
)
"""A replica that campaigns for the lease in the default namespace, with short lease times."""

SPOTJOBS = Resource("spotjob.dev", "v1alpha1", "spotjobs", "SpotJob", namespaced=True)


class Seen:
    def __init__(self) -> None:
        self.calls: Counter[ObjectKey] = Counter()
        self.context: ControllerContext | None = None
        self.tainted_when_reconciled: set[str] = set()  # nodes with a taint in the cache at some reconcile

    def factory(self, context: ControllerContext) -> Reconcile:
        self.context = context

        def reconcile(key: ObjectKey) -> float | None:
            self.calls[key] += 1
            for node in context.nodes.cache.list():
                if (node.get("spec") or {}).get("taints"):
                    self.tainted_when_reconciled.add(node["metadata"]["name"])
            return None

        return reconcile


@pytest.fixture
def running(test_api: TestApi) -> Iterator[tuple[Controller, Seen]]:
    test_api.install_spotjob_crd()
    test_api.admin.create(NODES, {"apiVersion": "v1", "kind": "Node", "metadata": {"name": "n1"}})
    seen = Seen()
    options = ControllerOptions(leader_elect=False, http_port=0, workers=2, identity="solo")
    controller = Controller(test_api.client(), options, seen.factory)
    thread = threading.Thread(target=controller.run, daemon=True)
    thread.start()
    wait_for(lambda: controller.is_leader, what="the controller to start its workers")
    yield controller, seen
    controller.stop()
    thread.join(30)
    assert not thread.is_alive()


def worker_pod(name: str, job: str, node: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "default", "labels": {JOB_LABEL: job}},
        "spec": {"nodeName": node, "containers": [{"name": "agent", "image": "spotjob"}]},
    }


def test_job_pod_and_node_events_reconcile_the_job_they_concern(test_api: TestApi, running) -> None:
    controller, seen = running
    job = ObjectKey("default", "llama")
    test_api.admin.create(
        SPOTJOBS, {"apiVersion": "spotjob.dev/v1alpha1", "kind": "SpotJob", "metadata": {"name": "llama"}}, "default"
    )
    wait_for(lambda: seen.calls[job] >= 1, what="the new job's reconcile")
    test_api.admin.create(PODS, worker_pod("llama-0-0", "llama", "n1"), "default")
    wait_for(lambda: controller.pods.cache.by_index("node", "n1"), what="the worker pod in the cache")
    test_api.admin.patch(
        NODES, "n1", {"spec": {"taints": [{"key": "aws-node-termination-handler/spot-itn", "effect": "NoSchedule"}]}}
    )
    # A reconcile that read the taint: the pod's own event may bring one more reconcile before the
    # taint reaches the cache, so counting reconciles alone would race.
    wait_for(lambda: "n1" in seen.tainted_when_reconciled, what="a reconcile after the node's taint")
    assert seen.context is not None and seen.context.nodes.cache.get("", "n1") is not None
    (signal,) = seen.context.signals.for_workers(
        seen.context.pods.cache.by_index("job", "default/llama"), lambda n: seen.context.nodes.cache.get("", n)
    )
    assert signal.kind.value == "SpotInterruption" and signal.node == "n1"
    assert [k for k in seen.calls if k != job] == []  # nothing else was reconciled


class RecordingQueue:
    """An interruption queue that is always empty, and says when it was first read."""

    def __init__(self) -> None:
        self.received = threading.Event()
        self._stop = threading.Event()

    def receive(self, max_messages: int, wait_seconds: int) -> list[QueueMessage]:
        self.received.set()
        self._stop.wait(0.05)
        return []

    def delete(self, message: QueueMessage) -> None:
        raise AssertionError("nothing was received")


def test_only_the_leader_reads_the_interruption_queue(test_api: TestApi) -> None:
    test_api.install_spotjob_crd()
    now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    lease = {
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": {"name": "spotjob-controller", "namespace": "default"},
        "spec": {"holderIdentity": "another-replica", "leaseDurationSeconds": 3600, "renewTime": now},
    }
    test_api.admin.create(LEASES, lease, "default")
    queue = RecordingQueue()
    options = CANDIDATE
    controller = Controller(test_api.client(), options, Seen().factory, interruption_queue=queue)
    thread = threading.Thread(target=controller.run, daemon=True)
    thread.start()
    try:
        wait_for(lambda: controller.elector is not None and controller.elector.alive(), what="the campaign")
        # Campaigning against a live leader: no reconcile workers, no queue reader.
        assert controller.queue_reader is not None and not controller.is_leader
        assert not queue.received.is_set()
        test_api.admin.delete(LEASES, "spotjob-controller", "default")  # the other replica is gone
        wait_for(lambda: controller.is_leader, what="the candidate to lead")
        wait_for(queue.received.is_set, what="the leader to read the queue")
    finally:
        controller.stop()
        thread.join(30)
    assert not thread.is_alive()


def test_a_replica_that_loses_the_lease_stops_exporting_its_jobs_series(test_api: TestApi) -> None:
    """Only the leader reconciles, so only its job series are current. One that loses its lease
    (here to a usurper on the test API server) kept exporting what it knew last: a Failed job or a
    checkpoint age stayed on its /metrics next to the new leader's, and every job alert would fire
    from both replicas, or keep firing from the stale one. It now drops them as it gives up. The
    job's series are set through the metrics object directly: this controller's reconcile seam is
    a recorder (the reconciler's own reporting is tested in tests/unit)."""
    test_api.install_spotjob_crd()
    lost: list[str] = []
    options = CANDIDATE
    controller = Controller(test_api.client(), options, Seen().factory, on_leadership_lost=lost.append)
    thread = threading.Thread(target=controller.run, daemon=True)
    thread.start()
    try:
        wait_for(lambda: controller.is_leader, what="the replica to lead")
        controller.metrics.job_state("team-a", "llama", JobStatus(phase=Phase.FAILED), max_restarts=3)
        assert 'name="llama"' in controller.metrics.exposition().decode()
        lease = test_api.admin.get(LEASES, "spotjob-controller", "default")
        lease["spec"]["holderIdentity"] = "usurper"
        test_api.admin.replace(LEASES, lease)
        wait_for(lambda: lost, what="the replica to give up")
        text = controller.metrics.exposition().decode()
        assert 'name="llama"' not in text
        assert "spotjob_leader 0.0" in text
    finally:
        controller.stop()
        thread.join(30)
    assert not thread.is_alive()


def test_a_jobs_own_status_write_does_not_queue_it_again_and_a_change_of_its_metadata_does(test_api: TestApi) -> None:
    """A pass that writes the status and asks to look again in an hour is not run again by the watch
    event its own write brings back: before, every pass that wrote a new failure count (a pod the
    namespace refuses, storage down) was followed at once by another, and the retry backoff was a
    loop of passes as fast as the API server answered. An annotation (a flush request) still
    queues the job at once."""
    from orchestrator.k8s.informer import EventHandler
    from orchestrator.k8s.store import KubeJobStore
    from orchestrator.model import JobKey, JobStatus

    test_api.install_spotjob_crd()
    job = ObjectKey("default", "llama")
    calls: Counter[ObjectKey] = Counter()

    def factory(context: ControllerContext) -> Reconcile:
        store = KubeJobStore(context.client, context.jobs.cache, on_writing=context.status_writes.writing)

        def reconcile(key: ObjectKey) -> float | None:
            calls[key] += 1
            stored = store.get(JobKey(key.namespace, key.name))
            assert stored is not None
            failing = JobStatus(created_at=datetime.now(UTC), reason="Created", infra_errors=calls[key])
            store.update_status(stored.key, failing, version=stored.version)
            return 3600.0

        return reconcile

    options = ControllerOptions(leader_elect=False, http_port=0, workers=2, identity="solo")
    controller = Controller(test_api.client(), options, factory)
    queued: Counter[ObjectKey] = Counter()
    add = controller.queue.add

    def counting_add(key: ObjectKey, *, urgent: bool = False) -> None:
        queued[key] += 1
        add(key, urgent=urgent)

    controller.queue.add = counting_add  # type: ignore[method-assign]
    written: list[int] = []
    # Handlers run in the order they were added, on the informer's thread: once this one saw the
    # write come back, the controller's own handler has decided whether to queue the job for it.
    controller.jobs.add_handler(
        EventHandler(on_update=lambda _old, new: written.append(int((new.get("status") or {}).get("infraErrors", 0))))
    )
    thread = threading.Thread(target=controller.run, daemon=True)
    thread.start()
    try:
        wait_for(lambda: controller.is_leader, what="the controller to start its workers")
        test_api.admin.create(
            SPOTJOBS,
            {"apiVersion": "spotjob.dev/v1alpha1", "kind": "SpotJob", "metadata": {"name": "llama"}},
            "default",
        )
        wait_for(lambda: 1 in written, what="the first pass's status write to come back")
        assert (calls[job], queued[job]) == (1, 1)  # queued for its creation only

        test_api.admin.patch(SPOTJOBS, "llama", {"metadata": {"annotations": {"example.com/x": "1"}}}, "default")
        wait_for(lambda: 2 in written, what="the second pass's status write to come back")
        assert (calls[job], queued[job]) == (2, 2)  # the annotation queued it; its write did not
    finally:
        controller.stop()
        thread.join(30)


def test_a_leader_whose_reconcile_outlives_the_shutdown_does_not_release_the_lease(test_api: TestApi) -> None:
    """A clean shutdown hands the lease over at once by releasing it. With a reconcile still running
    past the workers' wait (a pass stuck on slow calls), the next leader would take over while it
    still acts: two leaders at once. The lease is then left to expire instead."""
    test_api.install_spotjob_crd()
    entered = threading.Event()
    let_go = threading.Event()

    def factory(context: ControllerContext) -> Reconcile:
        def reconcile(key: ObjectKey) -> float | None:
            entered.set()
            let_go.wait(120)
            return None

        return reconcile

    # The workers' wait shortened from its 30 s, so that it runs out here at once.
    controller = Controller(test_api.client(), dataclasses.replace(CANDIDATE, shutdown_wait_seconds=1.0), factory)
    thread = threading.Thread(target=controller.run, daemon=True)
    thread.start()
    try:
        wait_for(lambda: controller.is_leader, what="the replica to lead")
        test_api.admin.create(
            SPOTJOBS,
            {"apiVersion": "spotjob.dev/v1alpha1", "kind": "SpotJob", "metadata": {"name": "j"}, "spec": {}},
            "default",
        )
        wait_for(entered.is_set, what="the reconcile to start")
        controller.stop()
        thread.join(90)  # the workers' wait runs out while the reconcile still runs
        assert not thread.is_alive() and not let_go.is_set()
        lease = test_api.admin.get(LEASES, "spotjob-controller", "default")
        assert lease["spec"]["holderIdentity"] == "candidate"
    finally:
        let_go.set()
        controller.stop()
        thread.join(30)
