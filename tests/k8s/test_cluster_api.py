"""The test API server, through the real ``kubernetes`` client: what a controller relies on."""

from __future__ import annotations

import json
from typing import Any

import pytest
from kubernetes import client

from .cluster import Fault, TestCluster

WIDGETS = ("test.spotjob.dev", "v1", "widgets")
WAIT = 60.0  # generous for a loaded machine: waits end as soon as their condition holds


def reason(e: client.ApiException) -> str:
    return str(json.loads(e.body)["reason"])


def pod_body(name: str, **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": {"app": "demo"}},
        "spec": {"containers": [{"name": "main", "image": "python:3.11", "command": ["sleep", "60"]}], **spec},
    }


def test_objects_get_resource_versions_uids_and_generations(kube_client: Any, namespace: str) -> None:
    v1 = client.CoreV1Api(kube_client)
    cm = v1.create_namespaced_config_map(namespace, {"metadata": {"name": "c"}, "data": {"a": "1"}})
    assert cm.metadata.uid and cm.metadata.creation_timestamp and cm.metadata.resource_version
    listing = v1.list_namespaced_config_map(namespace)
    assert int(listing.metadata.resource_version) >= int(cm.metadata.resource_version)
    cm2 = v1.patch_namespaced_config_map("c", namespace, {"data": {"a": "2"}})
    assert int(cm2.metadata.resource_version) > int(cm.metadata.resource_version)
    same = v1.patch_namespaced_config_map("c", namespace, {"data": {"a": "2"}})
    assert same.metadata.resource_version == cm2.metadata.resource_version, "a no-op write changes nothing"

    svc = v1.create_namespaced_service(
        namespace, {"metadata": {"name": "s"}, "spec": {"clusterIP": "None", "ports": [{"port": 80}]}}
    )
    assert svc.metadata.generation == 1
    labelled = v1.patch_namespaced_service("s", namespace, {"metadata": {"labels": {"x": "y"}}})
    assert labelled.metadata.generation == 1, "metadata writes don't bump generation"
    respec = v1.patch_namespaced_service("s", namespace, {"spec": {"ports": [{"port": 81}]}})
    assert respec.metadata.generation == 2, "spec writes do"


def test_a_stale_update_conflicts_a_duplicate_exists_and_a_missing_object_is_not_found(
    kube_client: Any, namespace: str
) -> None:
    v1 = client.CoreV1Api(kube_client)
    cm = v1.create_namespaced_config_map(namespace, {"metadata": {"name": "c"}, "data": {"a": "1"}})
    v1.patch_namespaced_config_map("c", namespace, {"data": {"a": "2"}})
    cm.data = {"a": "3"}
    with pytest.raises(client.ApiException) as stale:
        v1.replace_namespaced_config_map("c", namespace, cm)
    assert stale.value.status == 409 and reason(stale.value) == "Conflict"
    with pytest.raises(client.ApiException) as dup:
        v1.create_namespaced_config_map(namespace, {"metadata": {"name": "c"}})
    assert dup.value.status == 409 and reason(dup.value) == "AlreadyExists"
    with pytest.raises(client.ApiException) as missing:
        v1.read_namespaced_config_map("nope", namespace)
    body = json.loads(missing.value.body)
    assert missing.value.status == 404 and body["kind"] == "Status" and body["reason"] == "NotFound"
    assert body["details"] == {"name": "nope", "kind": "configmaps"}
    with pytest.raises(client.ApiException) as no_ns:
        v1.create_namespaced_config_map("no-such-namespace", {"metadata": {"name": "c"}})
    assert no_ns.value.status == 404


def test_an_invalid_object_is_422_naming_the_field(kube_client: Any, namespace: str, cluster: TestCluster) -> None:
    v1 = client.CoreV1Api(kube_client)
    with pytest.raises(client.ApiException) as e:
        v1.create_namespaced_config_map(namespace, {"metadata": {"name": "Bad_Name"}})
    body = json.loads(e.value.body)
    assert e.value.status == 422 and body["reason"] == "Invalid"
    assert body["details"]["causes"][0]["field"] == "metadata.name"
    no_image = pod_body("p")
    del no_image["spec"]["containers"][0]["image"]
    with pytest.raises(client.ApiException) as e2:
        v1.create_namespaced_pod(namespace, no_image)
    assert json.loads(e2.value.body)["details"]["causes"][0]["field"] == "spec.containers[0].image"
    # "image": null, as a controller building a pod from a spec without one sent it: a real server
    # reads null as "" and answers the same 422; this one failed with a 500 (a str method on None).
    from .cluster import ApiCallError

    null_image = pod_body("q")
    null_image["spec"]["containers"][0]["image"] = None
    with pytest.raises(ApiCallError) as e3:
        cluster.rest.request("POST", f"/api/v1/namespaces/{namespace}/pods", null_image)
    assert e3.value.status == 422 and e3.value.body["details"]["causes"][0]["field"] == "spec.containers[0].image"


def test_a_pod_env_name_the_api_server_refuses_is_422_naming_the_entry(kube_client: Any, namespace: str) -> None:
    """As 1.32 checks a container's variable names (printable ASCII other than '=', not empty); the
    server had taken any name, where a real one refuses the pod. A NUL in a value is stored, as
    on a real server (the container runtime is what cannot start with it)."""
    v1 = client.CoreV1Api(kube_client)
    for i, (name, reason) in enumerate([("", "FieldValueRequired"), ("A=B", "FieldValueInvalid")]):
        body = pod_body(f"env-{i}")
        body["spec"]["containers"][0]["env"] = [{"name": "OK", "value": "1"}, {"name": name, "value": "1"}]
        with pytest.raises(client.ApiException) as e:
            v1.create_namespaced_pod(namespace, body)
        [cause] = json.loads(e.value.body)["details"]["causes"]
        assert e.value.status == 422 and (cause["field"], cause["reason"]) == ("spec.containers[0].env[1].name", reason)
    taken = pod_body("env-taken")
    taken["spec"]["containers"][0]["env"] = [{"name": "1 my.var-x", "value": "a\x00b"}]
    v1.create_namespaced_pod(namespace, taken)


def test_kubernetes_validate_strict_rejects_an_unknown_field_loudly(
    cluster: TestCluster, namespace: str, test_apiserver_only: None
) -> None:
    mark = len(cluster.validation_failures)
    bad = pod_body("typo")
    bad["spec"]["containers"][0]["comand"] = ["sleep"]
    from .cluster import ApiCallError

    with pytest.raises(ApiCallError) as e:
        cluster.rest.request("POST", f"/api/v1/namespaces/{namespace}/pods", bad)
    assert e.value.status == 422 and "comand" in e.value.body["message"]
    failures = cluster.validation_failures[mark:]
    assert [f.name for f in failures] == ["typo"] and "comand" in failures[0].message
    del cluster.validation_failures[mark:]  # expected here; the fixture fails any test that leaves one


def test_label_and_field_selectors_and_chunked_lists(kube_client: Any, namespace: str) -> None:
    v1 = client.CoreV1Api(kube_client)
    for i, (tier, zone) in enumerate([("web", "a"), ("web", "b"), ("db", "a"), ("cache", "")]):
        labels = {"tier": tier, **({"zone": zone} if zone else {})}
        v1.create_namespaced_config_map(namespace, {"metadata": {"name": f"c{i}", "labels": labels}})

    def names(**kw: Any) -> list[str]:
        return [c.metadata.name for c in v1.list_namespaced_config_map(namespace, **kw).items]

    assert names(label_selector="tier=web") == ["c0", "c1"]
    assert names(label_selector="tier==web,zone!=a") == ["c1"]
    assert names(label_selector="tier in (db,cache)") == ["c2", "c3"]
    assert names(label_selector="tier notin (web)") == ["c2", "c3"]
    assert names(label_selector="zone") == ["c0", "c1", "c2"]
    assert names(label_selector="!zone") == ["c3"]
    assert names(field_selector="metadata.name=c2") == ["c2"]
    assert names(field_selector="metadata.name!=c2,metadata.namespace=" + namespace) == ["c0", "c1", "c3"]
    with pytest.raises(client.ApiException) as e:
        v1.list_namespaced_config_map(namespace, field_selector="data.a=1")
    assert e.value.status == 400
    first = v1.list_namespaced_config_map(namespace, limit=3)
    assert len(first.items) == 3 and first.metadata._continue
    rest = v1.list_namespaced_config_map(namespace, limit=3, _continue=first.metadata._continue)
    assert [c.metadata.name for c in rest.items] == ["c3"] and not rest.metadata._continue


def test_each_patch_type_the_client_sends(
    kube_client: Any, namespace: str, cluster: TestCluster, test_apiserver_only: None
) -> None:
    """kubernetes 37: a dict body for a built-in kind goes as a strategic merge patch, a list as a
    JSON patch; custom objects always go as a merge patch."""
    v1 = client.CoreV1Api(kube_client)
    mark = cluster.audit_mark()
    v1.create_namespaced_pod(
        namespace,
        pod_body(
            "p",
            containers=[
                {"name": "a", "image": "x:1", "command": ["sleep"]},
                {"name": "b", "image": "y:1", "command": ["sleep"]},
            ],
        ),
    )
    # Strategic merge: containers merge by name; a label map merges; null deletes a key.
    p = v1.patch_namespaced_pod(
        "p",
        namespace,
        {"metadata": {"labels": {"extra": "1"}}, "spec": {"containers": [{"name": "b", "image": "y:2"}]}},
    )
    assert [(c.name, c.image) for c in p.spec.containers] == [("a", "x:1"), ("b", "y:2")]
    assert p.metadata.labels == {"app": "demo", "extra": "1"}
    p = v1.patch_namespaced_pod("p", namespace, {"metadata": {"labels": {"extra": None}}})
    assert p.metadata.labels == {"app": "demo"}
    # JSON patch.
    p = v1.patch_namespaced_pod("p", namespace, [{"op": "add", "path": "/metadata/annotations", "value": {"k": "v"}}])
    assert p.metadata.annotations == {"k": "v"}
    with pytest.raises(client.ApiException) as e:
        v1.patch_namespaced_pod("p", namespace, [{"op": "test", "path": "/metadata/name", "value": "other"}])
    assert e.value.status == 422
    ctypes = [r for r in cluster.audit_log(mark) if r.verb == "patch"]
    assert len(ctypes) == 4
    # Status through pods/status: conditions merge by type.
    v1.patch_namespaced_pod_status(
        "p", namespace, {"status": {"conditions": [{"type": "DisruptionTarget", "status": "True", "reason": "Test"}]}}
    )
    v1.patch_namespaced_pod_status("p", namespace, {"status": {"conditions": [{"type": "Other", "status": "True"}]}})
    conds = {c.type for c in v1.read_namespaced_pod("p", namespace).status.conditions}
    assert {"DisruptionTarget", "Other"} <= conds


def test_pod_spec_is_immutable_except_the_documented_fields(kube_client: Any, namespace: str) -> None:
    v1 = client.CoreV1Api(kube_client)
    v1.create_namespaced_pod(namespace, pod_body("p"))
    with pytest.raises(client.ApiException) as e:
        v1.patch_namespaced_pod("p", namespace, {"spec": {"restartPolicy": "Never"}})
    assert e.value.status == 422 and "pod updates may not change fields" in json.loads(e.value.body)["message"]


def test_leases_elect_by_compare_and_swap_on_resource_version(kube_client: Any, namespace: str) -> None:
    co = client.CoordinationV1Api(kube_client)
    lease = co.create_namespaced_lease(
        namespace,
        {
            "metadata": {"name": "leader"},
            "spec": {"holderIdentity": "a", "leaseDurationSeconds": 15, "leaseTransitions": 0},
        },
    )
    mine = co.read_namespaced_lease("leader", namespace)
    theirs = co.read_namespaced_lease("leader", namespace)
    mine.spec.holder_identity = "b"
    mine.spec.lease_transitions = 1
    co.replace_namespaced_lease("leader", namespace, mine)
    theirs.spec.holder_identity = "c"
    with pytest.raises(client.ApiException) as e:
        co.replace_namespaced_lease("leader", namespace, theirs)
    assert e.value.status == 409
    now = co.read_namespaced_lease("leader", namespace)
    assert now.spec.holder_identity == "b" and now.spec.lease_transitions == 1
    assert int(now.metadata.resource_version) > int(lease.metadata.resource_version)


def test_events_written_in_either_api_are_read_in_both_and_repeats_aggregate(kube_client: Any, namespace: str) -> None:
    """Aggregation is the client's job on a real server (client-go's recorder patches count or
    series); the server stores and converts, and both API shapes show the same event."""
    v1 = client.CoreV1Api(kube_client)
    ev1 = client.EventsV1Api(kube_client)
    cm = v1.create_namespaced_config_map(namespace, {"metadata": {"name": "subject"}})
    regarding = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "name": "subject",
        "namespace": namespace,
        "uid": cm.metadata.uid,
    }
    ev1.create_namespaced_event(
        namespace,
        {
            "metadata": {"name": "subject.flush"},
            "eventTime": "2025-01-01T00:00:00.000000Z",
            "reportingController": "spotjob.dev/controller",
            "reportingInstance": "controller-0",
            "action": "Flush",
            "reason": "FlushRequested",
            "note": "asked 2 agents to flush",
            "type": "Normal",
            "regarding": regarding,
        },
    )
    ev1.patch_namespaced_event(
        "subject.flush", namespace, {"series": {"count": 3, "lastObservedTime": "2025-01-01T00:01:00.000000Z"}}
    )
    core = v1.list_namespaced_event(
        namespace, field_selector=f"involvedObject.name=subject,involvedObject.uid={cm.metadata.uid}"
    ).items
    assert len(core) == 1 and core[0].message == "asked 2 agents to flush" and core[0].series.count == 3
    v1.create_namespaced_event(
        namespace,
        {
            "metadata": {"name": "subject.old"},
            "involvedObject": regarding,
            "reason": "Rescheduled",
            "message": "moved",
            "type": "Warning",
            "count": 1,
            "firstTimestamp": "2025-01-01T00:00:00Z",
            "lastTimestamp": "2025-01-01T00:00:00Z",
            "source": {"component": "spotjob"},
        },
    )
    v1.patch_namespaced_event("subject.old", namespace, {"count": 2, "lastTimestamp": "2025-01-01T00:00:05Z"})
    old = {e.reason: e for e in v1.list_namespaced_event(namespace, field_selector="involvedObject.name=subject").items}
    assert old["Rescheduled"].count == 2 and old["FlushRequested"].series.count == 3
    # A core event has no eventTime, which events.k8s.io/v1 requires: read it through core/v1
    # (a real server answers null there too, and the client's model rejects that).
    raw = ev1.api_client.call_api(
        "GET",
        f"{cluster_host(kube_client)}/apis/events.k8s.io/v1/namespaces/{namespace}/events/subject.old",
        {"Authorization": kube_client.configuration.api_key["BearerToken"]},
    )
    raw.read()
    shaped = json.loads(raw.data)
    assert shaped["deprecatedCount"] == 2 and shaped["note"] == "moved" and shaped["regarding"]["name"] == "subject"


def cluster_host(api: Any) -> str:
    return str(api.configuration.host)


def _widget(name: str, **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "test.spotjob.dev/v1",
        "kind": "Widget",
        "metadata": {"name": name},
        "spec": {"size": 1, **spec},
    }


def test_owner_references_cascade_in_the_background_in_the_foreground_and_orphan(
    kube_client: Any, namespace: str, cluster: TestCluster, widget_crd: None
) -> None:
    v1 = client.CoreV1Api(kube_client)
    co = client.CustomObjectsApi(kube_client)

    def owned(owner: dict[str, Any], name: str) -> None:
        ref = {
            "apiVersion": "test.spotjob.dev/v1",
            "kind": "Widget",
            "name": owner["metadata"]["name"],
            "uid": owner["metadata"]["uid"],
            "blockOwnerDeletion": True,
            "controller": True,
        }
        v1.create_namespaced_config_map(namespace, {"metadata": {"name": name, "ownerReferences": [ref]}})

    def exists(name: str) -> bool:
        try:
            v1.read_namespaced_config_map(name, namespace)
            return True
        except client.ApiException as e:
            assert e.status == 404
            return False

    for policy in ("Background", "Foreground", "Orphan"):
        w = co.create_namespaced_custom_object(*WIDGETS[:2], namespace, WIDGETS[2], _widget(policy.lower()))
        owned(w, f"{policy.lower()}-child")
        co.delete_namespaced_custom_object(
            *WIDGETS[:2], namespace, WIDGETS[2], policy.lower(), propagation_policy=policy
        )
        cluster.wait_for(
            lambda p=policy: not _widget_exists(co, namespace, p.lower()), WAIT, f"the {policy} owner to go"
        )
        if policy == "Orphan":
            orphan = v1.read_namespaced_config_map("orphan-child", namespace)
            assert not orphan.metadata.owner_references
        else:
            cluster.wait_for(lambda p=policy: not exists(f"{p.lower()}-child"), WAIT, f"{policy} cascade")
    # A dependent whose owner never existed is collected too.
    owned({"metadata": {"name": "ghost", "uid": "00000000-0000-0000-0000-000000000000"}}, "ghost-child")
    cluster.wait_for(lambda: not exists("ghost-child"), WAIT, "the ghost's child to be collected")


def _widget_exists(co: Any, namespace: str, name: str) -> bool:
    try:
        co.get_namespaced_custom_object(*WIDGETS[:2], namespace, WIDGETS[2], name)
        return True
    except client.ApiException as e:
        assert e.status == 404
        return False


def test_finalizers_hold_a_deleted_object_until_removed(kube_client: Any, namespace: str) -> None:
    v1 = client.CoreV1Api(kube_client)
    v1.create_namespaced_config_map(namespace, {"metadata": {"name": "held", "finalizers": ["spotjob.dev/cleanup"]}})
    v1.delete_namespaced_config_map("held", namespace)
    held = v1.read_namespaced_config_map("held", namespace)
    assert held.metadata.deletion_timestamp is not None
    with pytest.raises(client.ApiException) as e:
        v1.patch_namespaced_config_map("held", namespace, {"metadata": {"finalizers": ["spotjob.dev/cleanup", "more"]}})
    assert e.value.status == 422
    v1.patch_namespaced_config_map("held", namespace, {"metadata": {"$patch": "merge", "finalizers": None}})
    with pytest.raises(client.ApiException) as gone:
        v1.read_namespaced_config_map("held", namespace)
    assert gone.value.status == 404


def test_the_audit_log_records_identity_verb_and_resource(
    cluster: TestCluster, namespace: str, test_apiserver_only: None
) -> None:
    from kubernetes import config

    api = config.new_client_from_config(config_file=cluster.kubeconfig_for("system:serviceaccount:spotjob:controller"))
    v1 = client.CoreV1Api(api)
    mark = cluster.audit_mark()
    v1.create_namespaced_config_map(namespace, {"metadata": {"name": "a"}})
    v1.list_namespaced_config_map(namespace)
    v1.patch_namespaced_config_map("a", namespace, {"data": {"x": "1"}})
    v1.delete_namespaced_config_map("a", namespace)
    records = [r for r in cluster.audit_log(mark) if r.user == "system:serviceaccount:spotjob:controller"]
    assert [(r.verb, r.api_group, r.resource_path, r.namespace, r.name) for r in records] == [
        ("create", "", "configmaps", namespace, ""),
        ("list", "", "configmaps", namespace, ""),
        ("patch", "", "configmaps", namespace, "a"),
        ("delete", "", "configmaps", namespace, "a"),
    ]
    api.close()


def test_faults_fail_the_next_matching_requests(
    kube_client: Any, namespace: str, cluster: TestCluster, test_apiserver_only: None
) -> None:
    v1 = client.CoreV1Api(kube_client)
    throttle = cluster.add_fault(
        Fault(verb="list", resource="configmaps", namespace=namespace, status=429, retry_after=0, count=1)
    )
    cluster.add_fault(Fault(verb="create", resource="configmaps", status=500, count=1))
    mark = cluster.audit_mark()
    # kubernetes 37 retries a 429 that carries Retry-After by itself: the caller sees success.
    v1.list_namespaced_config_map(namespace, _request_timeout=5)
    assert throttle.hits == 1
    assert [r.code for r in cluster.audit_log(mark) if r.verb == "list" and r.namespace == namespace] == [429, 200]
    with pytest.raises(client.ApiException) as broken:
        v1.create_namespaced_config_map(namespace, {"metadata": {"name": "x"}})
    assert broken.value.status == 500 and reason(broken.value) == "InternalError"
    v1.create_namespaced_config_map(namespace, {"metadata": {"name": "x"}})  # the next one works
    # urllib3 retries a read timeout up to three times, so every try must hang.
    cluster.add_fault(Fault(verb="get", resource="configmaps", action="timeout", delay=1, count=4))
    with pytest.raises(Exception):  # noqa: B017 - urllib3 raises its own timeout type
        v1.read_namespaced_config_map("x", namespace, _request_timeout=0.5)


def test_a_node_field_selector_takes_one_value_per_requirement(kube_client: Any, namespace: str) -> None:
    v1 = client.CoreV1Api(kube_client)

    def affinity(*requirements: dict[str, Any]) -> dict[str, Any]:
        term = {"matchFields": list(requirements)}
        return {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [term]}}}

    two = {"key": "metadata.name", "operator": "NotIn", "values": ["a", "b"]}
    with pytest.raises(client.ApiException) as e:
        v1.create_namespaced_pod(namespace, pod_body("two", affinity=affinity(two)))
    body = json.loads(e.value.body)
    assert e.value.status == 422 and body["reason"] == "Invalid"
    assert body["details"]["causes"][0]["field"].endswith("nodeSelectorTerms[0].matchFields[0].values")
    one_each = [{"key": "metadata.name", "operator": "NotIn", "values": [n]} for n in ("a", "b")]
    v1.create_namespaced_pod(namespace, pod_body("one-each", affinity=affinity(*one_each)))
