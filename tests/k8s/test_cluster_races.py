"""The cluster's own loops against the races of a busy cluster: writes that interleave with theirs,
objects deleted and created again under the same name, processes starting while a node goes."""

from __future__ import annotations

from typing import Any

import pytest

from .cluster import Fault, TestCluster
from .cluster.apiserver import ApiServer, DeleteOptions
from .cluster.controlplane import GarbageCollector
from .cluster.kubelet import MARKER, processes_with
from .cluster.store import Event, Watcher
from .test_cluster_kubelet import pod, running

WAIT = 60.0  # generous for a loaded machine: waits end as soon as their condition holds
LEASES = "/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases"


def _ref(owner: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "ConfigMap", "name": owner["metadata"]["name"], "uid": owner["metadata"]["uid"]}


def test_the_garbage_collector_deletes_nothing_written_since_it_read_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Between the collector's read of a dependent and its delete, one dependent is taken over by
    a new owner (a node of the same name renewing its predecessor's Lease) and another is deleted
    and created again under its name. Neither may be deleted on the stale reading."""
    api = ApiServer(validate="off")
    gc = GarbageCollector(api)  # its thread is not started: each pass runs here, in order
    cms = api.rt("", "v1", "configmaps")
    old = api.create(cms, "default", {"metadata": {"name": "old-owner"}}, user="test").obj
    new = api.create(cms, "default", {"metadata": {"name": "new-owner"}}, user="test").obj
    for name in ("taken-over", "recreated", "orphaned"):
        api.create(cms, "default", {"metadata": {"name": name, "ownerReferences": [_ref(old)]}}, user="test")
    gc.step()
    api.delete(cms, "default", "old-owner", DeleteOptions(), user="test")

    real_delete = api.delete

    def interleaved(rt: Any, namespace: str, name: str, opts: DeleteOptions, *, user: str) -> Any:
        if name == "taken-over":
            api.mutate(
                rt.storage, namespace, name, lambda o: o["metadata"].update(ownerReferences=[_ref(new)]), user="kubelet"
            )
        elif name == "recreated":
            real_delete(rt, namespace, name, DeleteOptions(), user="someone")
            api.create(rt, namespace, {"metadata": {"name": name, "ownerReferences": [_ref(new)]}}, user="someone")
        return real_delete(rt, namespace, name, opts, user=user)

    monkeypatch.setattr(api, "delete", interleaved)
    gc.step()
    monkeypatch.setattr(api, "delete", real_delete)
    gc.step()  # what the stale reading could not settle is looked at again

    for name in ("taken-over", "recreated"):
        kept = api.store.get("core/configmaps", "default", name)
        assert kept is not None and kept["metadata"]["ownerReferences"] == [_ref(new)], name
    assert api.store.get("core/configmaps", "default", "orphaned") is None, "a real dependent still goes"


def test_a_lease_renewal_rides_out_conflicts_and_a_lease_that_vanishes(
    cluster: TestCluster, test_apiserver_only: None
) -> None:
    """The renewal the kubelet does for add_node, heal and resume_heartbeats: a Lease changed by
    someone else (409 on the PUT), one deleted under it (404 on the PUT), one missing and then
    found created (404 on the GET, 409 on the POST) are read again, not raised to the caller."""
    cluster.add_node("f-node", run_containers=False)
    cluster.stop_heartbeats("f-node")  # once it returns no renewal is in flight: ours meets the faults
    before = cluster.rest.get(f"{LEASES}/f-node")["spec"]["renewTime"]
    kubelet = "system:node:test-kubelet"
    faults = [
        cluster.add_fault(Fault(verb=verb, resource="leases", name="f-node", user=kubelet, status=code))
        for verb, code in (("get", 404), ("update", 409), ("update", 404))
    ]
    cluster.resume_heartbeats("f-node")
    assert [f.hits for f in faults] == [1, 1, 1]
    assert cluster.rest.get(f"{LEASES}/f-node")["spec"]["renewTime"] > before


def test_a_node_added_again_under_its_name_takes_its_lease_over(cluster: TestCluster) -> None:
    """A spot node replaced by one of the same name: the old Lease may still be there (the garbage
    collector deletes it at any moment) when the new kubelet renews it."""
    for _ in range(3):
        cluster.add_node("again", run_containers=False)
        cluster.delete_node("again")
    uid = cluster.add_node("again", run_containers=False)["metadata"]["uid"]
    cluster.wait_for(
        lambda: [r["uid"] for r in cluster.rest.get(f"{LEASES}/again")["metadata"].get("ownerReferences", [])] == [uid],
        WAIT,
        "the Lease to be the new node's",
    )
    ready = [c for c in cluster.node("again")["status"]["conditions"] if c["type"] == "Ready"]
    assert ready[0]["status"] == "True"


def test_deleting_a_node_while_its_pods_start_leaves_no_process(cluster: TestCluster, namespace: str) -> None:
    cluster.add_node("busy")
    names = [f"s{i}" for i in range(4)]
    for name in names:
        cluster.rest.request(
            "POST", f"/api/v1/namespaces/{namespace}/pods", pod(name, ["python", "-c", "import time; time.sleep(600)"])
        )

    def bound() -> list[str]:
        pods = cluster.rest.get(f"/api/v1/namespaces/{namespace}/pods")["items"]
        if len(pods) < len(names) or any(p["spec"].get("nodeName") != "busy" for p in pods):
            return []
        return [p["metadata"]["uid"] for p in pods]

    uids = cluster.wait_for(bound, WAIT, "the pods to be bound")
    # Some containers run, others are starting: the node goes in the middle of it.
    cluster.wait_for(lambda: any(cluster.pod_pids(namespace, n) for n in names), WAIT, "a first process")
    cluster.delete_node("busy")
    left = [pid for uid in uids for pid in processes_with(f"{MARKER}={uid}") if running(pid)]
    assert not left, "processes of a deleted node's pods still run"


def test_a_cut_watch_delivers_nothing_queued_before_the_cut_or_pushed_after_it() -> None:
    # Whenever the connection's thread wakes, a cut watch has nothing left to send: the client
    # resumes from the last event it got (the informer's 410 test flaked when it did).
    def event(rv: int) -> Event:
        return Event("ADDED", "core/nodes", rv, {"metadata": {"name": f"n{rv}", "resourceVersion": str(rv)}})

    cut = Watcher("core/nodes")
    cut.push(event(1))
    cut.close(dropped=True)
    cut.push(event(2))
    assert cut.next(0) is None and cut.idle()
    ended = Watcher("core/nodes")  # ended by the server (a timeout), not cut: what it had is sent
    ended.push(event(3))
    ended.close()
    ended.push(event(4))
    first = ended.next(0)
    assert first is not None and first.rv == 3
    assert ended.next(0) is None
