"""CEL validation rules (``x-kubernetes-validations``): a CRD whose rule does not compile is refused,
and a served CRD's rules refuse what they say, at the node they sit on, on create, update, patch and
the status subresource, the way a real API server does (see cluster/cel.py)."""

from __future__ import annotations

import copy
import secrets
from collections.abc import Iterator
from typing import Any

import pytest

from .cluster import ApiCallError, TestCluster

CRDS = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"
GROUP = "cel.test.spotjob.dev"


def rule_crd(plural: str, schema: dict[str, Any]) -> dict[str, Any]:
    kind = plural.capitalize().rstrip("s")
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{plural}.{GROUP}"},
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {"plural": plural, "kind": kind},
            "versions": [
                {
                    "name": "v1",
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "schema": {"openAPIV3Schema": schema},
                }
            ],
        },
    }


# A vault: its bucket is fixed once set, its name is short, its spec says what it keeps, its status
# only counts up.
VAULT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "x-kubernetes-validations": [{"rule": "self.metadata.name.size() <= 12", "message": "a vault's name is short"}],
    "properties": {
        "spec": {
            "type": "object",
            "required": ["bucket"],
            "x-kubernetes-validations": [
                {"rule": "self.copies <= self.limit", "fieldPath": ".copies", "reason": "FieldValueForbidden"},
            ],
            "properties": {
                "bucket": {
                    "type": "string",
                    "x-kubernetes-validations": [{"rule": "self == oldSelf", "message": "bucket is immutable"}],
                },
                "copies": {"type": "integer", "default": 1},
                "limit": {"type": "integer", "default": 3},
                "kind": {"type": "string", "enum": ["hot", "cold"]},
                "shelves": {
                    "type": "array",
                    "x-kubernetes-list-type": "map",
                    "x-kubernetes-list-map-keys": ["name"],
                    "items": {
                        "type": "object",
                        "required": ["name"],
                        "properties": {
                            "name": {"type": "string"},
                            "size": {
                                "type": "integer",
                                "x-kubernetes-validations": [{"rule": "self >= oldSelf", "message": "shelves grow"}],
                            },
                        },
                    },
                },
            },
        },
        "status": {
            "type": "object",
            "properties": {
                "count": {
                    "type": "integer",
                    "x-kubernetes-validations": [{"rule": "self >= oldSelf", "message": "count only goes up"}],
                }
            },
        },
    },
}


@pytest.fixture(scope="module")
def vaults(k8s_cluster: TestCluster) -> Iterator[str]:
    """The vault CRD, served; yields its resource path's group-version."""
    crd = rule_crd("vaults", copy.deepcopy(VAULT_SCHEMA))
    try:
        k8s_cluster.rest.request("POST", CRDS, crd)
    except ApiCallError as e:
        if e.status != 409:
            raise
    k8s_cluster.wait_for(lambda: k8s_cluster.rest.get(f"/apis/{GROUP}/v1"), 60, "the vault CRD to be served")
    yield f"/apis/{GROUP}/v1"


def vault(name: str, **spec: Any) -> dict[str, Any]:
    return {"apiVersion": f"{GROUP}/v1", "kind": "Vault", "metadata": {"name": name}, "spec": {"bucket": "b1", **spec}}


def refused(call: Any) -> ApiCallError:
    with pytest.raises(ApiCallError) as e:
        call()
    assert e.value.status == 422 and e.value.reason == "Invalid", e.value
    return e.value


def causes(e: ApiCallError) -> list[tuple[str, str, str]]:
    return [(c["field"], c["reason"], c["message"]) for c in e.body["details"]["causes"]]


def test_a_crd_whose_rule_does_not_compile_is_refused_and_not_served(cluster: TestCluster) -> None:
    for plural, rule, why in (
        ("brokens", "self.size( <= 3", "Syntax error"),
        ("strays", "self == other", "undeclared reference to 'other'"),
    ):
        schema = {
            "type": "object",
            "properties": {
                "spec": {
                    "type": "object",
                    "properties": {"name": {"type": "string", "x-kubernetes-validations": [{"rule": rule}]}},
                }
            },
        }
        crd = rule_crd(plural, schema)
        e = refused(lambda: cluster.rest.request("POST", CRDS, crd))  # noqa: B023 (called at once)
        [(field, reason, message)] = causes(e)
        assert field == (
            "spec.versions[0].schema.openAPIV3Schema.properties[spec].properties[name].x-kubernetes-validations[0].rule"
        )
        assert reason == "FieldValueInvalid" and "compilation failed" in message and why in message
        with pytest.raises(ApiCallError) as gone:
            cluster.rest.get(f"{CRDS}/{plural}.{GROUP}")
        assert gone.value.status == 404


def test_a_rule_that_is_false_refuses_the_create_naming_its_node_and_message(
    cluster: TestCluster, namespace: str, vaults: str
) -> None:
    path = f"{vaults}/namespaces/{namespace}/vaults"
    e = refused(lambda: cluster.rest.request("POST", path, vault("a-much-too-long-name")))
    assert causes(e) == [("<nil>", "FieldValueInvalid", 'Invalid value: "object": a vault\'s name is short')]
    assert 'Vault.cel.test.spotjob.dev "a-much-too-long-name" is invalid: <nil>: Invalid value: "object"' in str(e)
    # A reason and a fieldPath: the error is of that type, at that path; no message: "failed rule".
    e = refused(lambda: cluster.rest.request("POST", path, vault("many", copies=5)))
    assert causes(e) == [("spec.copies", "FieldValueForbidden", "Forbidden: failed rule: self.copies <= self.limit")]
    # The rules run on defaulted values, and a transition rule not at all on create.
    assert cluster.rest.request("POST", path, vault("ok"))["spec"] == {"bucket": "b1", "copies": 1, "limit": 3}


def test_a_schema_error_that_blocks_the_rules_says_they_were_not_checked(
    cluster: TestCluster, namespace: str, vaults: str
) -> None:
    path = f"{vaults}/namespaces/{namespace}/vaults"
    e = refused(lambda: cluster.rest.request("POST", path, vault("a-much-too-long-name", kind="warm")))
    assert [c[:2] for c in causes(e)] == [("spec.kind", "FieldValueNotSupported"), ("<nil>", "FieldValueInvalid")]
    assert "some validation rules were not checked because the object was invalid" in causes(e)[1][2]


def test_a_transition_rule_refuses_a_change_by_update_and_patch_and_lets_other_changes_through(
    cluster: TestCluster, namespace: str, vaults: str
) -> None:
    path = f"{vaults}/namespaces/{namespace}/vaults"
    cluster.rest.request("POST", path, vault("v", shelves=[{"name": "a", "size": 2}]))
    current = cluster.rest.get(f"{path}/v")
    moved = copy.deepcopy(current)
    moved["spec"]["bucket"] = "b2"
    immutable = [("spec.bucket", "FieldValueInvalid", 'Invalid value: "string": bucket is immutable')]
    assert causes(refused(lambda: cluster.rest.request("PUT", f"{path}/v", moved))) == immutable
    merge = "application/merge-patch+json"
    patch = {"spec": {"bucket": "b2"}}
    assert causes(refused(lambda: cluster.rest.request("PATCH", f"{path}/v", patch, content_type=merge))) == immutable
    # A map-list item is its old self by its key: it may not shrink; a new shelf has nothing to compare.
    shrink = {"spec": {"shelves": [{"name": "a", "size": 1}, {"name": "b", "size": 1}]}}
    assert causes(refused(lambda: cluster.rest.request("PATCH", f"{path}/v", shrink, content_type=merge))) == [
        ("spec.shelves[0].size", "FieldValueInvalid", 'Invalid value: "integer": shelves grow')
    ]
    grown = {"spec": {"copies": 2, "shelves": [{"name": "b", "size": 1}, {"name": "a", "size": 3}]}}
    out = cluster.rest.request("PATCH", f"{path}/v", grown, content_type=merge)
    assert out["spec"]["bucket"] == "b1" and out["spec"]["copies"] == 2


def test_the_status_subresource_runs_the_status_rules_and_keeps_the_stored_spec(
    cluster: TestCluster, namespace: str, vaults: str
) -> None:
    path = f"{vaults}/namespaces/{namespace}/vaults"
    cluster.rest.request("POST", path, vault("s"))
    obj = cluster.rest.get(f"{path}/s")
    # The first count has no old value; the bucket's rule sees the stored spec, not the body's.
    obj["status"] = {"count": 2}
    obj["spec"]["bucket"] = "elsewhere"
    stored = cluster.rest.request("PUT", f"{path}/s/status", obj)
    assert stored["status"] == {"count": 2} and stored["spec"]["bucket"] == "b1"
    stored["status"] = {"count": 1}
    assert causes(refused(lambda: cluster.rest.request("PUT", f"{path}/s/status", stored))) == [
        ("status.count", "FieldValueInvalid", 'Invalid value: "integer": count only goes up')
    ]


def test_a_rule_added_later_lets_an_unchanged_value_stay_with_a_warning(cluster: TestCluster, namespace: str) -> None:
    """Ratcheting: a value stored before the rule existed may stay as it is; changing it must obey."""
    plural = f"ratchets{secrets.token_hex(2)}"
    schema: dict[str, Any] = {
        "type": "object",
        "properties": {
            "spec": {"type": "object", "properties": {"size": {"type": "integer"}, "note": {"type": "string"}}}
        },
    }
    crd = cluster.rest.request("POST", CRDS, rule_crd(plural, schema))
    try:
        base = f"/apis/{GROUP}/v1/namespaces/{namespace}/{plural}"
        cluster.wait_for(lambda: cluster.rest.get(base), 60, "the CRD to be served")
        kind = crd["spec"]["names"]["kind"]
        obj = {"apiVersion": f"{GROUP}/v1", "kind": kind, "metadata": {"name": "r"}, "spec": {"size": 9}}
        cluster.rest.request("POST", base, obj)
        size = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["size"]
        size["x-kubernetes-validations"] = [{"rule": "self < 5", "message": "at most 4"}]
        cluster.rest.request("PUT", f"{CRDS}/{crd['metadata']['name']}", crd)
        merge = "application/merge-patch+json"

        def rule_served() -> bool:
            try:
                cluster.rest.request("PATCH", f"{base}/r", {"spec": {"size": 8}}, content_type=merge)
            except ApiCallError as e:
                return e.status == 422 and "at most 4" in str(e)
            return False

        cluster.wait_for(rule_served, 60, "the new rule to be served")
        out = cluster.kubectl(
            "patch", f"{plural}.{GROUP}", "r", "-n", namespace, "--type=merge", "-p", '{"spec":{"note":"kept"}}'
        )
        assert "at most 4" in out.stderr and "Warning" in out.stderr
        assert cluster.rest.get(f"{base}/r")["spec"] == {"size": 9, "note": "kept"}
    finally:
        cluster.rest.request("DELETE", f"{CRDS}/{crd['metadata']['name']}")
