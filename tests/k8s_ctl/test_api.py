"""The API layer against the test API server: retries on 5xx/429/drops, typed errors, the permission list."""

from __future__ import annotations

import json
import threading

import pytest
from ctl_support import CONTROLLER_TOKEN, CONTROLLER_USER, TestApi

from orchestrator.k8s.api import (
    LEASES,
    NODES,
    PERMISSIONS,
    PODS,
    SPOTJOBS,
    AlreadyExists,
    Conflict,
    Invalid,
    KubeClient,
    NotFound,
    NotPermitted,
    PermanentError,
    RetryPolicy,
    TransientError,
)
from orchestrator.k8s.kubeconfig import ConfigError, load_config
from tests.k8s.cluster.http import Fault


def lease(name: str = "l") -> dict:
    return {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": {"name": name}, "spec": {}}


def test_a_call_retries_through_injected_500s_and_succeeds(test_api: TestApi) -> None:
    retries: list[tuple[str, str, str]] = []
    client = test_api.client(on_retry=lambda *a: retries.append(a))
    test_api.fault(verb="list", resource="nodes", count=2, status=500)
    items, version = client.list(NODES)
    assert items == [] and version
    assert retries == [("list", "nodes", "500"), ("list", "nodes", "500")]


def test_a_429_is_retried_after_the_servers_retry_after(test_api: TestApi) -> None:
    waits: list[float] = []
    client = test_api.client(sleep=waits.append)
    test_api.fault(verb="get", resource="leases", count=1, status=429, retry_after=7)
    client.create(LEASES, lease(), "default")
    assert client.get(LEASES, "l", "default")["metadata"]["name"] == "l"
    assert waits == [7.0]  # recorded, not slept: the injected sleep


def test_a_dropped_connection_is_retried(test_api: TestApi) -> None:
    client = test_api.client()
    test_api.fault(verb="get", resource="leases", name="l", count=1, action="drop")
    test_api.admin.create(LEASES, lease(), "default")
    assert client.get(LEASES, "l", "default")["metadata"]["name"] == "l"


def test_an_answer_cut_off_in_its_body_is_retried_like_a_dropped_connection(test_api: TestApi) -> None:
    # The connection drops after the head of the answer (a proxy or API server restarting while it
    # sends a big LIST page): the body read failed outside the retries, as a bare urllib3 error
    # that no caller expects (they handle KubeError), and was never retried.
    retries: list[tuple[str, str, str]] = []
    client = test_api.client(on_retry=lambda *a: retries.append(a))
    test_api.admin.create(LEASES, lease("torn"), "default")
    test_api.fault(verb="get", resource="leases", name="torn", count=1, action="torn-answer")
    assert client.get(LEASES, "torn", "default")["metadata"]["name"] == "torn"
    assert retries == [("get", "leases.coordination.k8s.io", "network")]


def test_a_discovery_answer_cut_off_in_its_body_is_a_transient_error(test_api: TestApi) -> None:
    client = test_api.client()
    test_api.fault(path="/apis/events.k8s.io/v1", count=1, action="torn-answer")
    with pytest.raises(TransientError):
        client.api_group_served("events.k8s.io", "v1")
    assert client.api_group_served("events.k8s.io", "v1")


def test_retries_give_up_with_a_typed_transient_error(test_api: TestApi) -> None:
    client = test_api.client(retry=RetryPolicy(attempts=3, initial=0.01, maximum=0.01))
    test_api.fault(verb="list", resource="pods", count=10, status=503)
    with pytest.raises(TransientError) as error:
        client.list(PODS, "default")
    assert error.value.status == 503
    assert not isinstance(error.value, PermanentError)
    hits = [r for r in test_api.audit() if r["resource"] == "pods" and r["verb"] == "list"]
    assert len(hits) == 3


def test_a_stale_update_is_a_conflict_and_a_second_create_already_exists(test_api: TestApi) -> None:
    client = test_api.client()
    created = client.create(LEASES, lease(), "default")
    current = dict(created, spec={"holderIdentity": "a"})
    client.replace(LEASES, current)
    stale = dict(created, spec={"holderIdentity": "b"})  # still carries the first resourceVersion
    with pytest.raises(Conflict) as conflict:
        client.replace(LEASES, stale)
    assert not isinstance(conflict.value, AlreadyExists)
    with pytest.raises(AlreadyExists):
        client.create(LEASES, lease(), "default")


def test_a_missing_object_is_not_found_and_deleting_it_is_done(test_api: TestApi) -> None:
    client = test_api.client()
    with pytest.raises(NotFound):
        client.get(LEASES, "nope", "default")
    assert client.delete(PODS, "nope", "default") is False


def test_an_invalid_object_is_a_permanent_invalid_error(test_api: TestApi) -> None:
    client = test_api.client()
    with pytest.raises(Invalid):
        client.create(LEASES, lease("Not_A_Valid_Name"), "default")


def test_a_call_outside_the_permission_list_fails_before_any_request(test_api: TestApi) -> None:
    client = test_api.client()
    with pytest.raises(NotPermitted):
        client.create(NODES, {"apiVersion": "v1", "kind": "Node", "metadata": {"name": "n9"}})
    with pytest.raises(NotPermitted):
        client.delete(SPOTJOBS, "j", "default")
    assert [r for r in test_api.audit() if r["user"] == CONTROLLER_USER] == []


def test_the_permission_list_is_well_formed() -> None:
    triples = [(p.group, p.resource, p.verb) for p in PERMISSIONS]
    assert len(triples) == len(set(triples))
    assert all(p.why for p in PERMISSIONS)
    assert {"get", "create", "update"} <= {p.verb for p in PERMISSIONS if p.resource == "leases"}


def test_a_missing_kubeconfig_is_a_config_error_naming_the_file(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    with pytest.raises(ConfigError, match=r"nope\.yaml"):
        load_config(str(tmp_path / "nope.yaml"))


def test_kubeconfig_comes_from_the_environment_when_no_flag_names_one(test_api: TestApi, monkeypatch) -> None:
    monkeypatch.setenv("KUBECONFIG", str(test_api.kubeconfig))
    assert load_config().host == test_api.url


def test_a_rotated_token_file_is_read_again_after_a_401(test_api: TestApi, tmp_path, monkeypatch) -> None:
    # A controller run outside the cluster with a kubeconfig whose user has a tokenFile (a
    # projected token the kubelet rotates): the client library read the file once and got 401
    # for ever after the rotation. Now the file is read again (a minute old, or after a 401).
    token = tmp_path / "token"
    token.write_text("the-token-before-the-rotation")
    doc = json.loads(test_api.kubeconfig.read_text())
    doc["users"][0]["user"] = {"tokenFile": "token"}
    (tmp_path / "rotating.kubeconfig").write_text(json.dumps(doc))
    client = KubeClient(load_config(str(tmp_path / "rotating.kubeconfig")))
    token.write_text(CONTROLLER_TOKEN)  # rotated: the old token is no longer accepted

    assert client.list(NODES)[0] == []
    client.close()


def test_a_token_file_that_ends_in_a_newline_is_read_as_kubectl_reads_it(test_api: TestApi, tmp_path) -> None:
    # `echo "$TOKEN" > token`: the client library sent the newline in the Authorization header,
    # and every request failed with "ValueError: Invalid header value".
    (tmp_path / "token").write_text(CONTROLLER_TOKEN + "\n")
    doc = json.loads(test_api.kubeconfig.read_text())
    doc["users"][0]["user"] = {"tokenFile": str(tmp_path / "token")}
    (tmp_path / "newline.kubeconfig").write_text(json.dumps(doc))
    client = KubeClient(load_config(str(tmp_path / "newline.kubeconfig")))

    assert client.list(NODES)[0] == []
    client.close()


def test_a_request_that_hangs_times_out_and_is_retried(test_api: TestApi) -> None:
    retries: list[tuple[str, str, str]] = []
    client = test_api.client(request_timeout=0.5, on_retry=lambda *a: retries.append(a))
    test_api.admin.create(LEASES, lease("slow"), "default")
    test_api.fault(verb="get", resource="leases", name="slow", count=1, action="timeout", delay=5)
    assert client.get(LEASES, "slow", "default")["metadata"]["name"] == "slow"
    assert retries == [("get", "leases.coordination.k8s.io", "network")]


def test_a_call_whose_request_hangs_gives_up_at_its_deadline_while_the_server_still_holds_it(
    test_api: TestApi,
) -> None:
    # A request timeout of 30 s and six attempts: without the deadline the call held its thread
    # for three minutes. The hang lasts until the test lets it go.
    client = test_api.client(retry=RetryPolicy(attempts=6, initial=0.01, maximum=0.05, deadline=1.0))
    hang = test_api.front.add_fault(Fault(verb="create", resource="leases", action="hang", count=100, delay=600))
    outcome: list[BaseException] = []

    def call() -> None:
        try:
            client.create(LEASES, lease("stuck"), "default")
        except BaseException as e:  # the outcome is what the test reads
            outcome.append(e)

    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    thread.join(60)  # a failure bound, not a measure
    try:
        assert not thread.is_alive(), "the call was still waiting on the hanging request"
        assert not hang.released.is_set()  # the server still held it: the client gave up on its own
        assert len(outcome) == 1 and isinstance(outcome[0], TransientError), outcome
    finally:
        test_api.clear_faults()


def test_a_retry_after_that_would_end_past_the_deadline_is_not_waited_for(test_api: TestApi) -> None:
    waits: list[float] = []
    client = test_api.client(sleep=waits.append, retry=RetryPolicy(attempts=6, deadline=20.0))
    test_api.fault(verb="get", resource="leases", count=10, status=429, retry_after=60)
    with pytest.raises(TransientError) as error:
        client.get(LEASES, "l", "default")
    assert error.value.status == 429
    assert waits == []  # not five waits of 60 s: the job is retried later, its worker freed now
    assert len([r for r in test_api.audit() if r["resource"] == "leases" and r["verb"] == "get"]) == 1


def test_a_retry_policy_without_attempts_or_time_is_refused() -> None:
    with pytest.raises(ValueError, match="deadline"):
        RetryPolicy(deadline=0)
    with pytest.raises(ValueError, match="attempts"):
        RetryPolicy(attempts=0)
