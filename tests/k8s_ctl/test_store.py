"""The Kubernetes JobStore (orchestrator.k8s.store) on the test API server with the chart's CRD:
status through the status subresource with compare-and-swap, invalid specs reported, the cache's
lag never mistaken for a conflict."""

from __future__ import annotations

import json
from typing import Any

import pytest
from ctl_support import TestApi, install_spotjob_crd

from orchestrator.k8s.api import SPOTJOBS
from orchestrator.k8s.informer import Cache
from orchestrator.k8s.store import KubeJobStore
from orchestrator.model import JobKey, JobStatus, Phase
from orchestrator.store import ConflictError, StoredJob, StoreError

KEY = JobKey("default", "llama")


def spotjob(name: str = "llama", **spec: Any) -> dict[str, Any]:
    body = {
        "image": "img:1",
        "command": ["train.py"],
        "checkpoint": {"uri": "s3://bucket/llama"},
        **spec,
    }
    return {"apiVersion": "spotjob.dev/v1alpha1", "kind": "SpotJob", "metadata": {"name": name}, "spec": body}


@pytest.fixture
def api(test_api: TestApi) -> TestApi:
    install_spotjob_crd(test_api)
    return test_api


def cached(api: TestApi, cache: Cache, name: str = "llama") -> dict[str, Any]:
    obj = api.admin.get(SPOTJOBS, name, "default")
    obj.setdefault("kind", "SpotJob")
    obj.setdefault("apiVersion", "spotjob.dev/v1alpha1")
    cache._put(obj)
    return obj


def served_job(api: TestApi) -> tuple[KubeJobStore, Cache, StoredJob]:
    """The store, its cache holding the job "llama" as created, and the job as the store reads it."""
    api.admin.create(SPOTJOBS, spotjob(), "default")
    cache = Cache()
    store = KubeJobStore(api.client(), cache)
    cached(api, cache)
    job = store.get(KEY)
    assert job is not None
    return store, cache, job


def status_writes(api: TestApi, since: int = 0) -> list[dict[str, Any]]:
    return [
        r
        for r in api.audit(since)
        if r["resource"] == "spotjobs" and r["subresource"] == "status" and r["verb"] == "update"
    ]


def test_a_job_is_read_with_its_identity_and_its_status_written_by_compare_and_swap(api: TestApi) -> None:
    api.admin.create(SPOTJOBS, spotjob(), "default")
    cache = Cache()
    store = KubeJobStore(api.client(), cache)
    obj = cached(api, cache)
    job = store.get(KEY)
    assert job is not None and job.spec is not None and job.invalid is None
    assert (job.uid, job.generation, job.version) == (
        obj["metadata"]["uid"],
        1,
        obj["metadata"]["resourceVersion"],
    )
    assert job.status is None and job.spec.image == "img:1"

    written = store.update_status(KEY, JobStatus(phase=Phase.RUNNING, reason="WorkersRunning"), version=job.version)
    assert written.version != job.version and written.status is not None
    assert api.admin.get(SPOTJOBS, "llama", "default")["status"]["phase"] == "Running"
    assert api.admin.get(SPOTJOBS, "llama", "default")["metadata"]["generation"] == 1  # status writes keep it

    # The cache still holds the old object: the store answers with what it wrote, not a conflict.
    again = store.get(KEY)
    assert again is not None and again.version == written.version
    store.update_status(KEY, JobStatus(phase=Phase.FLUSHING), version=again.version)

    with pytest.raises(ConflictError):
        store.update_status(KEY, JobStatus(phase=Phase.SUCCEEDED), version=job.version)  # stale


def test_a_cache_two_own_writes_behind_is_not_mistaken_for_a_conflict(api: TestApi) -> None:
    # Seen in CI on a loaded machine: two status writes in a row, the watch behind both. The cache
    # still holds the version the first write replaced; the next pass must get the last written
    # object from the store, not the stale one (a 409, then a GET to recover).
    store, cache, job = served_job(api)
    first = store.update_status(KEY, JobStatus(phase=Phase.RUNNING), version=job.version)
    second = store.update_status(KEY, JobStatus(phase=Phase.FLUSHING), version=first.version)
    mark = len(api.audit())
    again = store.get(KEY)
    assert again is not None and again.version == second.version
    store.update_status(KEY, JobStatus(phase=Phase.RESCHEDULING), version=again.version)
    calls = [(r["verb"], r["subresource"]) for r in api.audit(mark) if r["resource"] == "spotjobs"]
    assert calls == [("update", "status")], calls  # no 409, no GET to recover from one
    assert api.admin.get(SPOTJOBS, "llama", "default")["status"]["phase"] == "Rescheduling"

    # Once the cache shows a version our writes did not replace, it is believed again.
    cached(api, cache)
    latest = store.get(KEY)
    assert latest is not None and latest.status is not None and latest.status.phase == Phase.RESCHEDULING


def test_after_a_conflict_the_next_read_is_fresh_from_the_server(api: TestApi) -> None:
    store, _, read = served_job(api)
    # Someone else (a user editing the spec) writes; the cache has not seen it.
    current = api.admin.get(SPOTJOBS, "llama", "default")
    current["spec"]["maxRestarts"] = 9
    api.admin.replace(SPOTJOBS, current)
    with pytest.raises(ConflictError):
        store.update_status(KEY, JobStatus(), version=read.version)
    fresh = store.get(KEY)
    assert fresh is not None and fresh.spec is not None and fresh.spec.max_restarts == 9 and fresh.generation == 2
    store.update_status(KEY, JobStatus(), version=fresh.version)


def test_a_status_write_whose_answer_was_lost_is_not_taken_for_a_conflict(api: TestApi) -> None:
    store, _, read = served_job(api)
    # The write lands, its answer is lost on the way back (a connection reset); the client's
    # retry of the same compare-and-swap then meets its own write as a 409.
    api.fault(verb="update", resource="spotjobs", subresource="status", action="lost-answer")
    status = JobStatus(phase=Phase.RESCHEDULING, reason="Rescheduled", restarts=1)
    since = len(api.audit())

    written = store.update_status(KEY, status, version=read.version)

    assert written.status == status
    assert [r["code"] for r in status_writes(api, since)] == [200, 409]
    latest = store.get(KEY)
    assert latest is not None and latest.status == status
    store.update_status(KEY, status.model_copy(update={"restarts": 2}), version=latest.version)


def test_an_unchanged_status_is_not_written_again(api: TestApi) -> None:
    store, _, job = served_job(api)
    status = JobStatus(phase=Phase.RUNNING, reason="WorkersRunning")
    written = store.update_status(KEY, status, version=job.version)
    mark = len(api.audit())
    same = store.update_status(KEY, status.model_copy(deep=True), version=written.version)
    assert same.version == written.version and status_writes(api, mark) == []


def test_a_spec_the_model_refuses_is_an_invalid_job_naming_the_field(api: TestApi) -> None:
    # A rule the CRD cannot carry (its CEL rules refuse restartBackoff's cap below its start): the
    # template is kept as written, unchecked by the schema.
    template = {"spec": {"containers": [{"name": "trainer", "image": "img:1"}]}}
    api.admin.create(SPOTJOBS, spotjob("bad", template=template, containerName="trainr"), "default")
    cache = Cache()
    cached(api, cache, "bad")
    job = KubeJobStore(api.client(), cache).get(JobKey("default", "bad"))
    assert job is not None and job.spec is None
    assert job.invalid is not None and "containerName 'trainr'" in job.invalid, job.invalid


def test_a_job_the_cache_does_not_have_is_read_from_the_server_and_a_deleted_one_is_none(api: TestApi) -> None:
    api.admin.create(SPOTJOBS, spotjob(), "default")
    store = KubeJobStore(api.client(), Cache())
    mark = len(api.audit())
    job = store.get(KEY)
    assert job is not None and job.spec is not None
    assert [r["verb"] for r in api.audit(mark) if r["resource"] == "spotjobs"] == ["get"]
    assert store.get(JobKey("default", "gone")) is None
    assert store.keys() == []  # keys come from the cache: the jobs this controller serves


def test_the_controller_creates_and_deletes_no_spotjobs(api: TestApi) -> None:
    store = KubeJobStore(api.client(), Cache())
    with pytest.raises(StoreError, match="kubectl"):
        store.delete(KEY)


def test_a_flush_request_annotation_is_read_with_the_job_and_a_bad_one_is_known_by_a_stable_digest(
    api: TestApi,
) -> None:
    request = {"id": "req-7", "mode": "checkpoint", "reason": "before the eval", "requestedAt": "2026-03-01T10:00:00Z"}
    body = spotjob()
    body["metadata"]["annotations"] = {"spotjob.dev/flush-request": json.dumps(request)}
    api.admin.create(SPOTJOBS, body, "default")
    cache = Cache()
    cached(api, cache)
    job = KubeJobStore(api.client(), cache).get(KEY)
    assert job is not None and job.flush_request is not None and job.flush_request_problem is None
    assert (job.flush_request_id, job.flush_request.mode, job.flush_request.reason) == (
        "req-7",
        "checkpoint",
        "before the eval",
    )

    # What a person wrote wrong: named, and known by the same id at every read (handled once).
    current = api.admin.get(SPOTJOBS, "llama", "default")
    current["metadata"]["annotations"] = {"spotjob.dev/flush-request": json.dumps({"id": "r", "mode": "reboot"})}
    api.admin.replace(SPOTJOBS, current)
    cached(api, cache)
    store = KubeJobStore(api.client(), cache)
    first, second = store.get(KEY), store.get(KEY)
    assert first is not None and second is not None and first.flush_request is None
    assert first.flush_request_problem is not None and "spotjob.dev/flush-request.mode" in first.flush_request_problem
    assert first.flush_request_id == second.flush_request_id and str(first.flush_request_id).startswith("invalid-")
    assert first.spec is not None, "a bad request does not make the job invalid"


def test_fields_of_a_newer_crd_than_the_controller_make_the_job_invalid_saying_to_upgrade_the_controller(
    test_api: TestApi,
) -> None:
    """A CRD newer than the controller (applied first, or kept after the controller went back): the
    API server keeps the spec and status fields it declares, this controller's model knows none of
    them. The newer CRD is the shipped one with one spec and one status field added."""
    import yaml
    from ctl_support import CRDS, SPOTJOB_CRD_FILE, wait_for

    crd = yaml.safe_load(SPOTJOB_CRD_FILE.read_text())
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]
    schema["spec"]["properties"]["priorityBoost"] = {"type": "integer"}
    schema["status"]["properties"]["preemptionForecast"] = {"type": "string"}
    test_api.admin.create(CRDS, crd)
    wait_for(lambda: test_api.admin.list(SPOTJOBS, "default") is not None, what="the newer SpotJob CRD")

    test_api.admin.create(SPOTJOBS, spotjob("newer", priorityBoost=3), "default")
    cache = Cache()
    job = KubeJobStore(test_api.client(), cache).get(JobKey("default", "newer"))
    assert job is not None and job.spec is None and job.invalid is not None
    assert "spec.priorityBoost" in job.invalid and "upgrade the controller" in job.invalid, job.invalid

    obj = test_api.admin.get(SPOTJOBS, "newer", "default")
    obj["spec"].pop("priorityBoost")
    obj = test_api.admin.replace(SPOTJOBS, obj)
    obj["status"] = {"phase": "Running", "preemptionForecast": "low"}
    test_api.admin.replace(SPOTJOBS, obj, subresource="status")
    job = KubeJobStore(test_api.client(), Cache()).get(JobKey("default", "newer"))
    assert job is not None and job.spec is not None and job.status is None and job.invalid is not None
    assert "status.preemptionForecast" in job.invalid and "newer spotjob controller" in job.invalid, job.invalid
