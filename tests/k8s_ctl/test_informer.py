"""Informers against the test API server: sync, resume after a dropped watch, re-list after 410 Gone."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from ctl_support import TestApi, wait_for

from orchestrator.k8s.api import NODES, PODS
from orchestrator.k8s.informer import EventHandler, Informer


def node(name: str, **labels: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": labels}}


class Recorder:
    def __init__(self) -> None:
        self.events: list[tuple[str, str]] = []

    def handler(self) -> EventHandler:
        return EventHandler(
            on_add=lambda o: self.events.append(("add", o["metadata"]["name"])),
            on_update=lambda _old, new: self.events.append(("update", new["metadata"]["name"])),
            on_delete=lambda o: self.events.append(("delete", o["metadata"]["name"])),
        )


@pytest.fixture
def nodes(test_api: TestApi) -> Iterator[tuple[Informer, Recorder]]:
    test_api.admin.create(NODES, node("n1"))
    informer = Informer(test_api.client(), NODES, watch_timeout_seconds=60)
    recorder = Recorder()
    informer.add_handler(recorder.handler())
    informer.start()
    assert informer.wait_for_sync(30)
    yield informer, recorder
    informer.stop()
    assert not informer.alive()


def test_the_cache_holds_what_was_listed_and_follows_the_watch(test_api: TestApi, nodes) -> None:
    informer, recorder = nodes
    assert informer.has_synced() and informer.cache.get("", "n1") is not None
    test_api.admin.create(NODES, node("n2"))
    test_api.admin.patch(NODES, "n2", {"metadata": {"labels": {"zone": "a"}}})
    test_api.admin.delete(NODES, "n1")
    wait_for(lambda: ("delete", "n1") in recorder.events, what="the deletion")
    assert recorder.events == [("add", "n1"), ("add", "n2"), ("update", "n2"), ("delete", "n1")]
    assert informer.cache.get("", "n2")["metadata"]["labels"] == {"zone": "a"}
    assert informer.cache.get("", "n1") is None


def test_a_dropped_watch_resumes_from_the_last_version_without_losing_or_repeating_an_event(
    test_api: TestApi, nodes
) -> None:
    informer, recorder = nodes
    for i in range(3):
        assert test_api.drop_watches("nodes") >= 0
        test_api.admin.create(NODES, node(f"m{i}"))
    wait_for(lambda: len(informer.cache) == 4, what="every node")
    assert [e for e in recorder.events if e[0] == "add"] == [("add", "n1"), ("add", "m0"), ("add", "m1"), ("add", "m2")]
    assert informer.lists == 1  # resumed, never listed again


def test_an_expired_version_makes_the_informer_list_again_and_report_what_it_missed(test_api: TestApi, nodes) -> None:
    informer, recorder = nodes
    # Keep the informer from watching while the cluster changes, then forget the history it needs.
    # Its first watch must be open on the server before the fault: one still on its way then
    # passes the fault, escapes the drop and sees every change live, with no 410 ever (this
    # failed once under load, waiting for the second list).
    wait_for(lambda: test_api.open_watches("nodes") == 1, what="the informer's watch to be open")
    test_api.fault(verb="watch", resource="nodes", count=1000, status=500)
    assert test_api.drop_watches("nodes") == 1
    test_api.admin.create(NODES, node("n2"))
    test_api.admin.delete(NODES, "n1")
    test_api.expire_history()
    test_api.clear_faults()
    wait_for(lambda: informer.lists == 2, what="a second list after 410 Gone")
    wait_for(lambda: ("delete", "n1") in recorder.events, what="the missed deletion")
    assert ("add", "n2") in recorder.events
    assert [n["metadata"]["name"] for n in informer.cache.list()] == ["n2"]
    test_api.admin.create(NODES, node("n3"))  # and it watches again afterwards
    wait_for(lambda: informer.cache.get("", "n3") is not None, what="a change after the re-list")


def test_pods_are_watched_by_label_in_the_given_namespaces_with_an_index(test_api: TestApi) -> None:
    test_api.namespace("team-a")
    test_api.namespace("team-b")

    def pod(ns: str, name: str, labels: dict[str, str], node_name: str) -> dict[str, Any]:
        return {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "namespace": ns, "labels": labels},
            "spec": {"nodeName": node_name, "containers": [{"name": "c", "image": "busybox"}]},
        }

    informer = Informer(
        test_api.client(),
        PODS,
        namespaces=["team-a"],
        label_selector="spotjob.dev/job",
        indexers={"node": lambda p: [p["spec"].get("nodeName") or ""]},
    )
    informer.start()
    try:
        assert informer.wait_for_sync(30)
        test_api.admin.create(PODS, pod("team-a", "w0", {"spotjob.dev/job": "j"}, "n1"), "team-a")
        test_api.admin.create(PODS, pod("team-a", "other", {}, "n1"), "team-a")
        test_api.admin.create(PODS, pod("team-b", "w1", {"spotjob.dev/job": "j"}, "n1"), "team-b")
        wait_for(lambda: informer.cache.get("team-a", "w0") is not None, what="the worker pod")
        test_api.admin.create(PODS, pod("team-a", "w2", {"spotjob.dev/job": "j"}, "n2"), "team-a")
        wait_for(lambda: informer.cache.get("team-a", "w2") is not None, what="the second worker pod")
        assert sorted(p["metadata"]["name"] for p in informer.cache.list()) == ["w0", "w2"]
        assert [p["metadata"]["name"] for p in informer.cache.by_index("node", "n1")] == ["w0"]
    finally:
        informer.stop()


def test_a_watch_the_server_ends_is_resumed_without_a_new_list(test_api: TestApi) -> None:
    informer = Informer(test_api.client(), NODES, watch_timeout_seconds=1)
    informer.start()
    try:
        assert informer.wait_for_sync(30)
        for i in range(3):
            before = [r for r in test_api.audit() if r["verb"] == "watch"]
            wait_for(
                lambda before=before: len([r for r in test_api.audit() if r["verb"] == "watch"]) > len(before),
                what="the server to end the watch and the informer to watch again",
            )
            test_api.admin.create(NODES, node(f"t{i}"))
        wait_for(lambda: len(informer.cache) == 3, what="every node")
        assert informer.lists == 1
    finally:
        informer.stop()
