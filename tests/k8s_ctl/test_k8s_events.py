"""Events against the test API server: written about the object, repeats aggregated into a series."""

from __future__ import annotations

import logging

import pytest
from ctl_support import CONTROLLER_USER, TestApi

from orchestrator.k8s.api import EVENTS, MIN_KUBERNETES, Resource
from orchestrator.k8s.events import REPORTING_CONTROLLER, EventRecorder, ObjectRef, job_note
from orchestrator.model import JobKey

JOB = ObjectRef(kind="SpotJob", name="llama", namespace="default", api_version="spotjob.dev/v1alpha1", uid="u-1")
NODE = ObjectRef(kind="Node", name="ip-10-0-0-1", api_version="v1", uid="u-2")
CORE_EVENTS = Resource("", "v1", "events", "Event", namespaced=True)
"""What the recorder no longer writes: read here (as the administrator) to see that it did not."""


def events(test_api: TestApi, namespace: str = "default") -> list[dict]:
    return test_api.admin.list(EVENTS, namespace)[0]


def test_an_event_is_written_about_the_job_with_type_reason_and_note(test_api: TestApi) -> None:
    recorder = EventRecorder(test_api.client(), instance="replica-a")
    recorder.warning(JOB, "SpotInterrupted", "node ip-10-0-0-1 is reclaimed at 12:02", related=NODE)
    (event,) = events(test_api)
    assert event["regarding"]["name"] == "llama" and event["regarding"]["kind"] == "SpotJob"
    assert (event["type"], event["reason"]) == ("Warning", "SpotInterrupted")
    assert event["note"] == "node ip-10-0-0-1 is reclaimed at 12:02"
    assert event["related"]["name"] == "ip-10-0-0-1"
    assert (event["reportingController"], event["reportingInstance"]) == (REPORTING_CONTROLLER, "replica-a")


def test_repeats_of_one_event_aggregate_into_a_series_instead_of_new_objects(test_api: TestApi) -> None:
    recorder = EventRecorder(test_api.client(), instance="replica-a")
    for _ in range(4):
        recorder.normal(JOB, "FlushRequested", "asked 2 agents to flush")
    recorder.normal(JOB, "FlushRequested", "asked 3 agents to flush")  # another note: another event
    written = sorted(events(test_api), key=lambda e: e["note"])
    assert [e["note"] for e in written] == ["asked 2 agents to flush", "asked 3 agents to flush"]
    assert written[0]["series"]["count"] == 4
    assert "series" not in written[1] or not written[1]["series"]
    patches = [r for r in test_api.audit() if r["resource"] == "events" and r["verb"] == "patch"]
    assert len(patches) == 3


def test_one_storage_fault_whose_request_id_changes_each_pass_is_one_event_with_a_count(test_api: TestApi) -> None:
    recorder = EventRecorder(test_api.client(), instance="replica-a")
    for request_id, host_id in (
        ("4442587FB7D0A2F9", "Uuag1LuByRx9e6j5Onimru9pO4ZVKnJ2Qz7/C1NPcfTWAtRPfTaOFg=="),
        ("9B2C6A0F1E3D4C58", "yVzOw3ilHVzTRwM1pVlXX3kZC4zCvqFiFRsYrQ5cVLwYJbYhw7xyEw=="),
        ("07D1E5A3C9B2F6E4", "hT0hA1nnG9Lw4B2e1bUl0Xl3zjkcW2yq8PkqAFnN4tQZ0k8H9mTqVg=="),
    ):
        recorder.warning(
            JOB,
            "StorageUnreachable",
            "cannot read checkpoints at s3://bucket/llama: An error occurred (SlowDown) when calling the "
            f"ListObjectsV2 operation: Please reduce your request rate. (Request ID: {request_id}; "
            f"S3 Extended Request ID: {host_id})",
        )
    recorder.warning(JOB, "StorageUnreachable", "cannot read checkpoints at s3://bucket/llama: AccessDenied")
    written = sorted(events(test_api), key=lambda e: e["note"])
    assert len(written) == 2
    assert "AccessDenied" in written[0]["note"]
    assert "4442587FB7D0A2F9" in written[1]["note"] and written[1]["series"]["count"] == 3


def test_an_event_about_a_node_goes_to_the_default_namespace(test_api: TestApi) -> None:
    EventRecorder(test_api.client(), instance="r").normal(NODE, "NodeLost", "NotReady for 60s")
    (event,) = events(test_api, "default")
    assert event["regarding"]["kind"] == "Node"


def test_an_event_deleted_meanwhile_is_written_again_and_a_failure_never_raises(test_api: TestApi) -> None:
    recorder = EventRecorder(test_api.client(), instance="r")
    recorder.normal(JOB, "Rescheduled", "attempt 2 on nodes b, c")
    (first,) = events(test_api)
    test_api.admin.delete(EVENTS, first["metadata"]["name"], "default")
    recorder.normal(JOB, "Rescheduled", "attempt 2 on nodes b, c")
    assert len(events(test_api)) == 1
    test_api.fault(verb="create", resource="events", count=100, status=500)
    recorder.warning(JOB, "FlushTimedOut", "no manifest after 120s")  # logged, not raised
    test_api.clear_faults()
    assert [e["reason"] for e in events(test_api)] == ["Rescheduled"]


def stop_serving_events_k8s_io(test_api: TestApi, namespaces: tuple[str, ...] = ("default",)) -> None:
    """The test API server as one below spotjob's minimum answers: discovery of events.k8s.io/v1
    and its Events in ``namespaces`` are 404. Core v1 Events stay served, as on such a server."""
    test_api.fault(path="/apis/events.k8s.io/v1", count=1000, status=404)
    for ns in namespaces:
        test_api.fault(path=f"/apis/events.k8s.io/v1/namespaces/{ns}/events", count=1000, status=404)


def test_where_events_k8s_io_is_not_served_one_error_names_it_and_the_minimum_and_no_event_is_tried(
    test_api: TestApi, caplog: pytest.LogCaptureFixture
) -> None:
    """Core v1 Events were written there instead, which needed create and patch on core ``events``
    in the controller's ClusterRole for a path no supported cluster takes. Now: one error for the
    operator naming the API and the Kubernetes spotjob needs, and no Event is tried (each would be
    a bare 404, logged again and again); ``event()`` still never raises."""
    stop_serving_events_k8s_io(test_api)
    recorder = EventRecorder(test_api.client(), instance="r")
    with caplog.at_level(logging.INFO, logger="orchestrator.k8s.events"):
        for _ in range(3):
            recorder.warning(JOB, "FlushTimedOut", "no manifest after 120s")
        recorder.normal(NODE, "NodeLost", "NotReady for 60s", related=JOB)

    said = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "orchestrator.k8s.events"]
    assert len(said) == 1, said
    level, message = said[0]
    assert level == logging.ERROR
    assert "does not serve events.k8s.io/v1" in message, message
    assert f"spotjob needs Kubernetes {MIN_KUBERNETES} or later" in message, message
    assert test_api.admin.list(CORE_EVENTS, "default")[0] == []
    calls = [r for r in test_api.audit() if r["user"] == CONTROLLER_USER]
    assert [r for r in calls if r["resource"] == "events"] == [], "no Event write is tried"
    assert len([r for r in calls if r["path"] == "/apis/events.k8s.io/v1"]) == 1, "discovery is asked once"


def test_a_failed_discovery_is_asked_again_on_the_next_event(test_api: TestApi) -> None:
    """Discovery that does not answer decides nothing: that Event is lost (logged), the next one
    asks again and, events.k8s.io/v1 being served, is written."""
    test_api.fault(path="/apis/events.k8s.io/v1", count=100, status=503)
    recorder = EventRecorder(test_api.client(), instance="r")
    recorder.warning(JOB, "FlushTimedOut", "no manifest after 120s")  # logged, not raised
    test_api.clear_faults()
    recorder.normal(JOB, "Rescheduled", "attempt 2 on nodes b, c")
    assert [e["reason"] for e in events(test_api)] == ["Rescheduled"]


@pytest.mark.parametrize("reason", ["RestartBudgetExhausted", "InvalidCheckpointURI", "CheckpointURIOwned"])
def test_the_event_of_a_job_failed_for_good_points_at_its_next_line(reason: str) -> None:
    """Each reason that fails a job has a ``Next:`` line in ``kubectl spotjob status`` (how to go
    on, with the commands): its Event says where to read it, even when the message fills the
    note's 1 KB (the message is cut, not the pointer)."""
    key = JobKey("team-a", "llama")
    pointer = "; see `kubectl spotjob status llama -n team-a` for how to continue"
    assert job_note(key, reason, "owned by team-b/other") == "owned by team-b/other" + pointer
    long = job_note(key, reason, "x" * 2000)
    assert long.endswith("..." + pointer) and len(long.encode()) <= 1024, long


@pytest.mark.parametrize("reason", ["StorageRefused", "WorkerFailed", "FlushCommitted", "InvalidSpec"])
def test_an_event_of_a_job_that_goes_on_carries_its_message_alone(reason: str) -> None:
    """``StorageRefused`` also warns of a job that keeps running (no ``Next:`` line to point at)."""
    assert job_note(JobKey("team-a", "llama"), reason, "as it was") == "as it was"


def test_two_flush_requests_of_a_user_are_two_events_each_naming_its_own_id(test_api: TestApi) -> None:
    recorder = EventRecorder(test_api.client(), instance="replica-a")
    ids = ["5ed186b7-b71e-4d6c-8c67-8af565208eaf", "0b7f3c2e-9a41-4d8e-b6c5-2f1e8d7a9c03"]
    for request in ids:
        recorder.normal(JOB, "CheckpointRequestedByUser", f"flush request {request} (checkpoint): 2 agent(s) asked")
    notes = sorted(e["note"] for e in events(test_api))
    assert notes == sorted(f"flush request {r} (checkpoint): 2 agent(s) asked" for r in ids)
