"""What keeps a reconcile's cost flat in a cluster of a thousand nodes, and a notice's flush first in a burst:
urgent keys in the work queue, Node updates that wake no job, the index of Nodes that carry a notice,
Events written off the reconcile thread, cache reads that copy outside the lock.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import pytest
from ctl_support import TestApi

from orchestrator.k8s.api import EVENTS, KubeClient, Object, Resource
from orchestrator.k8s.cluster_signals import (
    INTERRUPTION_ANNOTATION,
    NOTICE_INDEX,
    RebalancePolicy,
    annotation_signal,
    new_node_notice,
    new_pod_notice,
    node_change_matters,
    nodes_being_taken,
    notice_index,
    taint_signals,
)
from orchestrator.k8s.controller import JOB_LABEL, Controller, ControllerContext, ControllerOptions
from orchestrator.k8s.events import EventRecorder, ObjectRef
from orchestrator.k8s.informer import Cache
from orchestrator.k8s.workqueue import ObjectKey, Reconcile, WorkQueue

NOW = datetime(2026, 6, 1, 12, 0, tzinfo=UTC)
SPOT_ITN = {"key": "aws-node-termination-handler/spot-itn", "value": "true", "effect": "NoSchedule"}


def node(name: str, *, taints: list[dict[str, Any]] | None = None, ready: str = "True", **annotations: str) -> Object:
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "resourceVersion": "1",
            "labels": {"topology.kubernetes.io/zone": "us-east-1a"},
            "annotations": dict(annotations),
        },
        "spec": {"taints": taints or []},
        "status": {
            "conditions": [
                {
                    "type": "Ready",
                    "status": ready,
                    "lastHeartbeatTime": "2026-06-01T12:00:00Z",
                    "reason": "KubeletReady",
                }
            ]
        },
    }


# -- the work queue ------------------------------------------------------------------------------


def test_an_urgent_key_is_handed_out_before_the_keys_already_waiting() -> None:
    queue = WorkQueue()
    for name in ("a", "b", "c"):
        queue.add(ObjectKey("ns", name))
    queue.add(ObjectKey("ns", "notice"), urgent=True)

    assert [queue.get(0) for _ in range(4)] == [ObjectKey("ns", n) for n in ("notice", "a", "b", "c")]


def test_an_urgent_add_moves_a_waiting_key_to_the_front_without_queueing_it_twice() -> None:
    queue = WorkQueue()
    for name in ("a", "b", "c"):
        queue.add(ObjectKey("ns", name))
    queue.add(ObjectKey("ns", "c"), urgent=True)

    assert [queue.get(0) for _ in range(3)] == [ObjectKey("ns", n) for n in ("c", "a", "b")]
    assert queue.get(0) is None


def test_a_key_made_urgent_while_it_is_processed_goes_first_once_done() -> None:
    queue = WorkQueue()
    busy = ObjectKey("ns", "busy")
    queue.add(busy)
    assert queue.get(0) == busy
    queue.add(ObjectKey("ns", "a"))
    queue.add(busy, urgent=True)
    queue.done(busy)

    assert [queue.get(0), queue.get(0)] == [busy, ObjectKey("ns", "a")]


# -- Node updates --------------------------------------------------------------------------------


def test_a_heartbeat_changes_nothing_a_reconcile_reads_but_taints_notices_ready_and_labels_do() -> None:
    old = node("n1")
    heartbeat = copy.deepcopy(old)
    heartbeat["status"]["conditions"][0]["lastHeartbeatTime"] = "2026-06-01T12:05:00Z"
    heartbeat["metadata"]["resourceVersion"] = "2"
    relabelled = copy.deepcopy(old)
    relabelled["metadata"]["labels"]["topology.kubernetes.io/zone"] = "us-east-1b"

    assert not node_change_matters(old, heartbeat)
    assert node_change_matters(old, node("n1", taints=[SPOT_ITN]))
    assert node_change_matters(old, node("n1", **{INTERRUPTION_ANNOTATION: '{"kind": "SpotInterruption"}'}))
    assert node_change_matters(old, node("n1", ready="False"))
    assert node_change_matters(old, relabelled)


def test_a_notice_is_new_only_the_first_time_it_appears() -> None:
    plain, tainted = node("n1"), node("n1", taints=[SPOT_ITN])
    other_taint = node("n1", taints=[{"key": "example.com/maintenance", "effect": "NoSchedule"}])

    assert new_node_notice(plain, tainted) and new_node_notice(None, tainted)
    assert not new_node_notice(tainted, tainted) and not new_node_notice(plain, other_taint)
    pod: Object = {"kind": "Pod", "metadata": {"name": "p"}, "spec": {"nodeName": "n1"}, "status": {"conditions": []}}
    disrupted = copy.deepcopy(pod)
    disrupted["status"]["conditions"] = [
        {"type": "DisruptionTarget", "status": "True", "reason": "DeletionByTaintManager"}
    ]
    assert new_pod_notice(pod, disrupted) and not new_pod_notice(disrupted, disrupted)


def test_a_spot_interruption_after_a_rebalance_recommendation_is_a_new_notice() -> None:
    """A node already carrying a rebalance recommendation (advisory) gets the spot interruption
    that follows it, as a taint or as the queue's annotation. Before, only a node's first notice
    made its jobs urgent: this flush queued behind routine passes, with two minutes to run."""
    rebalance_taint = {"key": "aws-node-termination-handler/rebalance-recommendation", "effect": "NoSchedule"}
    advised = node("n1", taints=[rebalance_taint])
    assert new_node_notice(advised, node("n1", taints=[rebalance_taint, SPOT_ITN]))
    assert not new_node_notice(node("n1", taints=[rebalance_taint, SPOT_ITN]), advised)  # one removed

    rebalance = '{"kind": "Rebalance", "time": "2026-06-01T12:00:00Z"}'
    spot = '{"kind": "SpotInterruption", "deadline": "2026-06-01T12:05:00Z", "time": "2026-06-01T12:03:00Z"}'
    annotated = node("n1", **{INTERRUPTION_ANNOTATION: rebalance})
    assert new_node_notice(annotated, node("n1", **{INTERRUPTION_ANNOTATION: spot}))
    assert not new_node_notice(annotated, copy.deepcopy(annotated))
    assert not new_node_notice(annotated, node("n1"))


def test_the_notice_index_finds_the_same_nodes_a_scan_of_every_node_does() -> None:
    nodes = [node(f"n{i}") for i in range(200)]
    nodes[3] = node("n3", taints=[SPOT_ITN])
    nodes[7] = node(
        "n7", taints=[{"key": "aws-node-termination-handler/rebalance-recommendation", "effect": "NoSchedule"}]
    )
    nodes[9] = node(
        "n9", **{INTERRUPTION_ANNOTATION: '{"kind": "SpotInterruption", "deadline": "2026-06-01T12:02:00Z"}'}
    )
    nodes[11] = node("n11", taints=[{"key": "node.kubernetes.io/unreachable", "effect": "NoExecute"}])
    cache = Cache(indexers={NOTICE_INDEX: notice_index})
    for n in nodes:
        cache._put(n)

    for policy in RebalancePolicy:

        def scan(p: RebalancePolicy = policy) -> frozenset[str]:  # what the backend computed over every node
            out = set()
            for n in cache.list():
                found = taint_signals(n, rebalance=p, now=NOW)
                notice = annotation_signal(n, rebalance=p, now=NOW)
                found += [notice] if notice is not None else []
                if any(s.kind.is_preemption for s in found):
                    out.add(n["metadata"]["name"])
            return frozenset(out)

        indexed = nodes_being_taken(cache.by_index(NOTICE_INDEX, NOTICE_INDEX), rebalance=policy, now=NOW)
        assert indexed == scan()
    assert len(cache.by_index(NOTICE_INDEX, NOTICE_INDEX)) == 3  # of 200: only these are copied


class EveryNodeRefused(Cache):
    """The Node cache of a thousand-node cluster, as a pass must read it: never whole."""

    def list(self, namespace: str | None = None) -> list[Object]:
        raise AssertionError("a pass copied every Node of the cluster")


def test_starting_workers_reads_only_the_nodes_that_carry_a_notice_and_keeps_off_them() -> None:
    from test_backend import KEY, UID, FakeAgents, FakeClient, _pod_job, spec

    from orchestrator.backends.base import Placement
    from orchestrator.backends.k8s import KubernetesBackend
    from orchestrator.k8s.cluster_signals import ClusterSignals

    nodes = EveryNodeRefused(indexers={NOTICE_INDEX: notice_index})
    for i in range(1000):
        nodes._put(node(f"n{i}", taints=[SPOT_ITN] if i in (3, 500) else None))
    jobs = Cache()
    jobs._put({"kind": "SpotJob", "metadata": {"name": KEY.name, "namespace": KEY.namespace, "uid": UID}})
    client = FakeClient()
    backend = KubernetesBackend(
        client,  # type: ignore[arg-type]
        jobs=jobs,
        pods_cache=Cache({"job": _pod_job}),
        nodes=nodes,
        signals=ClusterSignals(),
        token_key=b"k" * 32,
        agents=FakeAgents(),  # type: ignore[arg-type]
    )

    backend.start_workers(KEY, spec(), 0, Placement())

    (pod,) = [body for kind, body in client.created if kind == "pods"]
    (term,) = pod["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"
    ]
    assert term["matchFields"] == [{"key": "metadata.name", "operator": "NotIn", "values": [n]} for n in ("n3", "n500")]


def test_cache_reads_are_copies_the_caller_may_change() -> None:
    cache = Cache(indexers={NOTICE_INDEX: notice_index})
    cache._put(node("n1", taints=[SPOT_ITN]))
    for read in (cache.get("", "n1"), cache.list()[0], cache.by_index(NOTICE_INDEX, NOTICE_INDEX)[0]):
        assert read is not None
        read["spec"]["taints"].clear()
        read["metadata"]["labels"]["x"] = "y"
    assert cache.get("", "n1") == node("n1", taints=[SPOT_ITN])


# -- Events off the reconcile thread ---------------------------------------------------------------


class GatedClient(KubeClient):
    """Creates wait until the test opens the gate (the API server is slow)."""

    gate: threading.Event
    created: list[str]

    def create(self, resource: Resource, body: Object, namespace: str | None = None) -> Object:
        self.gate.wait(30)
        self.created.append(str(body.get("reason")))
        return super().create(resource, body, namespace)


def test_a_background_recorder_returns_before_the_write_and_writes_in_order_by_close(test_api: TestApi) -> None:
    client = test_api.client()
    client.__class__ = GatedClient
    gated: Any = client
    gated.gate, gated.created = threading.Event(), []
    recorder = EventRecorder(client, instance="r", background=True)
    job = ObjectRef(kind="SpotJob", name="llama", namespace="default", api_version="spotjob.dev/v1alpha1", uid="u")

    for reason in ("SpotInterrupted", "FlushRequested", "FlushCommitted"):
        recorder.normal(job, reason, f"{reason} happened")  # returns although no write can finish
    assert gated.created == []
    gated.gate.set()
    recorder.close(timeout=30)

    assert gated.created == ["SpotInterrupted", "FlushRequested", "FlushCommitted"]
    events = test_api.admin.list(EVENTS, "default")[0]
    assert sorted(e["reason"] for e in events) == ["FlushCommitted", "FlushRequested", "SpotInterrupted"]


# -- the controller: heartbeats wake no job, notices go first ----------------------------------------


def pod_on(name: str, job: str, node_name: str) -> Object:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "default", "uid": f"uid-{name}", "labels": {JOB_LABEL: job}},
        "spec": {"nodeName": node_name, "containers": [{"name": "agent", "image": "spotjob"}]},
    }


def queued(queue: WorkQueue) -> list[str]:
    out = []
    while (key := queue.get(0)) is not None:
        out.append(key.name)
    return out


@pytest.fixture
def controller(test_api: TestApi) -> Iterator[Controller]:
    """A controller that is not started: its informers' handlers are called by the test itself."""

    def factory(_context: ControllerContext) -> Reconcile:
        return lambda _key: None

    built = Controller(test_api.client(), ControllerOptions(leader_elect=False, http_port=0, identity="solo"), factory)
    for name, job in (("a-0-0", "a"), ("b-0-0", "b")):
        built.pods.cache._put(pod_on(name, job, "n2"))
    built.pods.cache._put(pod_on("c-0-0", "c", "n1"))
    yield built
    built.http._httpd.server_close()  # bound, never served
    built.client.close()


def node_event(controller: Controller, old: Object | None, new: Object) -> None:
    for handler in controller.nodes._handlers:
        if old is None and handler.on_add is not None:
            handler.on_add(new)
        elif old is not None and handler.on_update is not None:
            handler.on_update(old, new)


def test_a_node_heartbeat_queues_no_job(controller: Controller) -> None:
    old = node("n2")
    heartbeat = copy.deepcopy(old)
    heartbeat["status"]["conditions"][0]["lastHeartbeatTime"] = "2026-06-01T12:05:00Z"

    node_event(controller, old, heartbeat)

    assert queued(controller.queue) == []


def test_a_new_notice_on_a_node_queues_its_jobs_ahead_of_the_others(controller: Controller) -> None:
    controller.queue.add(ObjectKey("default", "c"))  # a routine pass, waiting
    node_event(controller, node("n2"), node("n2", taints=[SPOT_ITN]))
    node_event(controller, node("n1"), node("n1", ready="False"))  # a change, not a notice

    order = queued(controller.queue)
    assert sorted(order[:2]) == ["a", "b"] and order[2:] == ["c"]
