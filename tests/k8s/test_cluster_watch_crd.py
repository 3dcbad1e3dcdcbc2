"""Watches (bookmarks, 410 and the re-list, timeouts, dropped connections) and CRD semantics."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from typing import Any

import pytest
from kubernetes import client, watch

from .cluster import TestCluster

G, V, P = "test.spotjob.dev", "v1", "widgets"
WAIT = 60.0  # generous for a loaded machine: waits end as soon as their condition holds


def test_a_watch_streams_changes_after_a_resource_version_with_bookmarks(
    kube_client: Any, namespace: str, cluster: TestCluster
) -> None:
    v1 = client.CoreV1Api(kube_client)
    start = v1.list_namespaced_config_map(namespace).metadata.resource_version
    v1.create_namespaced_config_map(namespace, {"metadata": {"name": "a", "labels": {"keep": "yes"}}})
    v1.patch_namespaced_config_map("a", namespace, {"data": {"x": "1"}})
    v1.patch_namespaced_config_map("a", namespace, {"metadata": {"labels": {"keep": "no"}}})
    v1.delete_namespaced_config_map("a", namespace)
    seen = []
    w = watch.Watch()
    for ev in w.stream(
        v1.list_namespaced_config_map, namespace, resource_version=start, allow_watch_bookmarks=True, timeout_seconds=60
    ):
        seen.append(ev["type"])
        if ev["type"] == "BOOKMARK":
            w.stop()
    assert seen == ["ADDED", "MODIFIED", "MODIFIED", "DELETED", "BOOKMARK"]
    # Through a label selector, leaving the selector is a DELETED event.
    filtered = [
        ev["type"]
        for ev in watch.Watch().stream(
            v1.list_namespaced_config_map,
            namespace,
            resource_version=start,
            label_selector="keep=yes",
            timeout_seconds=1,
        )
    ]
    assert filtered == ["ADDED", "MODIFIED", "DELETED"]


def test_an_expired_resource_version_is_a_410_and_watch_gives_up_after_one(
    kube_client: Any, namespace: str, cluster: TestCluster, test_apiserver_only: None
) -> None:
    v1 = client.CoreV1Api(kube_client)
    old = v1.list_namespaced_config_map(namespace).metadata.resource_version
    v1.create_namespaced_config_map(namespace, {"metadata": {"name": "after"}})
    cluster.expire_watch_history()
    with pytest.raises(client.ApiException) as gone:
        list(watch.Watch().stream(v1.list_namespaced_config_map, namespace, resource_version=old, timeout_seconds=2))
    assert gone.value.status == 410
    # Without timeout_seconds the client retries once with the same RV, then raises: a controller re-lists.
    with pytest.raises(client.ApiException) as again:
        for _ in watch.Watch().stream(v1.list_namespaced_config_map, namespace, resource_version=old):
            pass
    assert again.value.status == 410
    fresh = v1.list_namespaced_config_map(namespace)
    assert [c.metadata.name for c in fresh.items] == ["after"]
    events = watch.Watch().stream(
        v1.list_namespaced_config_map, namespace, resource_version=fresh.metadata.resource_version, timeout_seconds=1
    )
    assert list(events) == []


def test_a_dropped_watch_breaks_the_stream_and_a_resumed_one_misses_nothing(
    kube_client: Any, namespace: str, cluster: TestCluster, test_apiserver_only: None
) -> None:
    v1 = client.CoreV1Api(kube_client)
    rv = v1.list_namespaced_config_map(namespace).metadata.resource_version
    got: list[str] = []
    errors: list[BaseException] = []

    def consume() -> None:
        try:
            for ev in watch.Watch().stream(
                v1.list_namespaced_config_map, namespace, resource_version=rv, timeout_seconds=30
            ):
                got.append(ev["object"].metadata.name)
        except BaseException as e:
            errors.append(e)

    t = threading.Thread(target=consume)
    t.start()
    v1.create_namespaced_config_map(namespace, {"metadata": {"name": "one"}})
    cluster.wait_for(lambda: got == ["one"], WAIT, "the first event")
    assert cluster.drop_watches("configmaps") >= 1
    t.join(WAIT)
    assert not t.is_alive() and errors, "a dropped connection surfaces as an error"
    v1.create_namespaced_config_map(namespace, {"metadata": {"name": "two"}})
    names = [
        ev["object"].metadata.name
        for ev in watch.Watch().stream(v1.list_namespaced_config_map, namespace, resource_version=rv, timeout_seconds=1)
    ]
    assert names == ["one", "two"]


def test_status_subresource_isolates_spec_and_status_writes(kube_client: Any, namespace: str, widget_crd: None) -> None:
    co = client.CustomObjectsApi(kube_client)
    w = co.create_namespaced_custom_object(
        G,
        V,
        namespace,
        P,
        {
            "apiVersion": f"{G}/{V}",
            "kind": "Widget",
            "metadata": {"name": "w"},
            "spec": {"size": 2},
            "status": {"phase": "Ignored"},
        },
    )
    assert "status" not in w and w["metadata"]["generation"] == 1
    s = co.patch_namespaced_custom_object_status(
        G, V, namespace, P, "w", {"spec": {"size": 9}, "status": {"phase": "Running"}}
    )
    assert s["status"] == {"phase": "Running"} and s["spec"]["size"] == 2 and s["metadata"]["generation"] == 1
    m = co.patch_namespaced_custom_object(G, V, namespace, P, "w", {"spec": {"size": 3}, "status": {"phase": "Lost"}})
    assert m["status"] == {"phase": "Running"} and m["spec"]["size"] == 3 and m["metadata"]["generation"] == 2
    with pytest.raises(client.ApiException) as e:
        co.patch_namespaced_custom_object(
            G, V, namespace, P, "w", {"spec": {"size": 4}}, _content_type="application/strategic-merge-patch+json"
        )
    assert e.value.status == 415


def test_a_custom_resource_is_pruned_defaulted_and_validated(
    kube_client: Any, namespace: str, widget_crd: None
) -> None:
    co = client.CustomObjectsApi(kube_client)
    spec = {"size": 1, "unknown": 1, "port": "http", "extra": {"free": {"form": 1}}, "note": None}
    body = {"apiVersion": f"{G}/{V}", "kind": "Widget", "metadata": {"name": "d"}, "spec": spec}
    w = co.create_namespaced_custom_object(G, V, namespace, P, body)
    assert w["spec"] == {"size": 1, "color": "green", "port": "http", "extra": {"free": {"form": 1}}, "note": None}

    def invalid(spec: dict[str, Any]) -> list[str]:
        with pytest.raises(client.ApiException) as e:
            co.create_namespaced_custom_object(
                G,
                V,
                namespace,
                P,
                {"apiVersion": f"{G}/{V}", "kind": "Widget", "metadata": {"name": "bad"}, "spec": spec},
            )
        body = json.loads(e.value.body)
        assert e.value.status == 422 and body["reason"] == "Invalid"
        return [c["field"] for c in body["details"]["causes"]]

    assert invalid({"size": 0}) == ["spec.size"]
    assert invalid({"size": 11}) == ["spec.size"]
    assert invalid({"size": "two"}) == ["spec.size"]
    assert invalid({}) == ["spec.size"]
    assert invalid({"size": 1, "color": "pink"}) == ["spec.color"]
    assert invalid({"size": 1, "name": "A1"}) == ["spec.name"]
    assert invalid({"size": 1, "name": "a"}) == ["spec.name"]
    assert invalid({"size": 1, "tags": ["a", "b", "c", "d"]}) == ["spec.tags"]
    assert invalid({"size": 1, "tags": [1]}) == ["spec.tags[0]"]
    assert invalid({"size": 1, "labels": {"a": 1}}) == ["spec.labels.a"]
    assert invalid({"size": 1, "port": 1.5}) == ["spec.port"]


def test_custom_resources_answer_a_table_with_their_printer_columns(
    cluster: TestCluster, namespace: str, widget_crd: None
) -> None:
    cluster.rest.request(
        "POST",
        f"/apis/{G}/{V}/namespaces/{namespace}/{P}",
        {"apiVersion": f"{G}/{V}", "kind": "Widget", "metadata": {"name": "t"}, "spec": {"size": 5}},
    )
    cluster.rest.request(
        "PATCH",
        f"/apis/{G}/{V}/namespaces/{namespace}/{P}/t/status",
        {"status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}},
        content_type="application/merge-patch+json",
    )
    headers = dict(cluster.rest.headers, Accept="application/json;as=Table;v=v1;g=meta.k8s.io,application/json")
    r = cluster.rest.pool.request(
        "GET", f"{cluster.rest.host}/apis/{G}/{V}/namespaces/{namespace}/{P}", headers=headers
    )
    table = json.loads(r.data)
    assert table["kind"] == "Table" and table["apiVersion"] == "meta.k8s.io/v1"
    cols = [(c["name"], c["type"], c["priority"]) for c in table["columnDefinitions"]]
    assert cols == [
        ("Name", "string", 0),
        ("Size", "integer", 0),
        ("Phase", "string", 0),
        ("Ready", "string", 0),
        ("Color", "string", 1),
        ("Age", "date", 0),
    ]
    cells = table["rows"][0]["cells"]
    assert cells[:5] == ["t", 5, "Running", "True", "green"] and cells[5].endswith("s")
    assert table["rows"][0]["object"]["kind"] == "PartialObjectMetadata"


def test_a_crd_that_is_not_structural_is_rejected(cluster: TestCluster) -> None:
    from .cluster import ApiCallError

    crd = {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": "gadgets.test.spotjob.dev"},
        "spec": {
            "group": "test.spotjob.dev",
            "scope": "Namespaced",
            "names": {"plural": "gadgets", "kind": "Gadget"},
            "versions": [
                {
                    "name": "v1",
                    "served": True,
                    "storage": True,
                    "schema": {"openAPIV3Schema": {"type": "object", "properties": {"spec": {"properties": {}}}}},
                }
            ],
        },
    }
    with pytest.raises(ApiCallError) as e:
        cluster.rest.request("POST", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions", crd)
    assert (
        e.value.status == 422
        and "spec.versions[0].schema.openAPIV3Schema.properties[spec].type" in e.value.body["message"]
    )


def test_a_watch_cut_with_the_history_never_saw_a_version_the_server_still_keeps(
    kube_client: Any, namespace: str, cluster: TestCluster, test_apiserver_only: None
) -> None:
    """The one-step hook (a write elsewhere, the history expired, open watches cut) leaves every
    client behind: not even a bookmark sent while the hook held the store reaches a cut watch with
    the new version, so the client's next watch is told 410 Gone. Bookmarks come every few
    milliseconds here, so a bookmark racing the cut is likely in some of the rounds."""
    assert cluster.front is not None
    api = cluster.front.api
    v1 = client.CoreV1Api(kube_client)
    interval, api.bookmark_interval = api.bookmark_interval, 0.002
    try:
        for _ in range(25):
            rv = v1.list_namespaced_config_map(namespace).metadata.resource_version
            seen: list[int] = []

            def consume(since: str = rv, seen: list[int] = seen) -> None:
                with contextlib.suppress(Exception):
                    for ev in watch.Watch().stream(
                        v1.list_namespaced_config_map,
                        namespace,
                        resource_version=since,
                        allow_watch_bookmarks=True,
                        timeout_seconds=30,
                    ):
                        seen.append(int(ev["raw_object"]["metadata"]["resourceVersion"]))

            t = threading.Thread(target=consume)
            t.start()
            cluster.wait_for(lambda seen=seen: len(seen) >= 3, WAIT, "bookmarks")
            time.sleep(0.01)
            assert cluster.expire_watch_history_and_drop_watches("configmaps") >= 1
            floor = api.store.history_floor
            t.join(WAIT)
            assert not t.is_alive()
            assert max(seen) < floor, f"a cut watch saw version {max(seen)}, which the server still keeps ({floor})"
            with pytest.raises(client.ApiException) as gone:
                list(
                    watch.Watch().stream(
                        v1.list_namespaced_config_map, namespace, resource_version=str(max(seen)), timeout_seconds=1
                    )
                )
            assert gone.value.status == 410
    finally:
        api.bookmark_interval = interval
