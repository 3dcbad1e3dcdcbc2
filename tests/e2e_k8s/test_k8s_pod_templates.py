"""The pod templates users bring, on the test cluster with a real ``spotjob-controller``: other
containers beside the trainer (a classic sidecar that never exits, a helper that exits at once, a
native sidecar), init containers that fail, and what the pods need that is not there (a Secret, a
ServiceAccount). What the controller must get right: the trainer's own state decides, whatever
the other containers do, and a pod that cannot run is told, never taken for a lost node.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from e2e_support import (
    Controller,
    assert_same_final_state,
    create_job,
    event_reasons,
    job_events,
    job_pods,
    spotjob_body,
    status,
    wait,
    wait_phase,
)

from agent.catalog import list_checkpoints
from agent.storage import open_storage
from tests.k8s.cluster import TestCluster

pytestmark = pytest.mark.slow

FOREVER = ["python", "-c", "import time\nwhile True: time.sleep(1)"]
"""A log shipper, a proxy: a process that runs until it is told to stop."""


def _phase_before(cluster: TestCluster, namespace: str, wanted: str, *never: str) -> dict[str, Any]:
    """The job's status once it is ``wanted``; fails at once if it reaches one of ``never`` first."""

    def check() -> dict[str, Any] | None:
        s = status(cluster, namespace, "train")
        if s.get("phase") in never:
            raise AssertionError(f"the job went {s.get('phase')} before it was ever {wanted}: {s.get('message')}")
        return s if s.get("phase") == wanted else None

    result: dict[str, Any] = wait(check, f"the job {wanted}")
    return result


def _condition(s: dict[str, Any], kind: str) -> dict[str, Any]:
    return next((c for c in s.get("conditions") or [] if c["type"] == kind), {})


def test_a_sidecar_that_never_exits_and_a_helper_that_exited_neither_hide_the_trainer_nor_its_flush(
    cluster: TestCluster,
    namespace: str,
    start_controller: Callable[..., Controller],
    uninterrupted: Path,
    tmp_path: Path,
) -> None:
    """The helper's container ended, so the pod is never Ready (a pod is Ready only when every
    container is); the trainer's own readiness (its agent's /readyz) says the ranks train. The
    job is Running, a notice reaches the agent and its flush commits; at the end the sidecar that
    still runs does not keep the pod and its node."""
    cluster.add_node(f"{namespace}-a", zone="us-east-1a")
    cluster.add_node(f"{namespace}-b", zone="us-east-1b")
    start_controller(namespace)
    dumps = tmp_path / "dumps"
    dumps.mkdir()
    body = spotjob_body("train", namespace, uri=str(tmp_path / "ckpt"), dump_dir=dumps, step_sleep=0.3)
    body["spec"]["containerName"] = "trainer"
    body["spec"]["template"]["spec"]["containers"] = [
        {"name": "log-shipper", "image": "shipper:1", "command": FOREVER},
        *body["spec"]["template"]["spec"]["containers"],
        {"name": "warm-cache", "image": "helper:1", "command": ["python", "-c", "print('cache warm')"]},
    ]
    create_job(cluster, body)

    _phase_before(cluster, namespace, "Running", "Succeeded", "Failed")
    wait(lambda: any(c.valid for c in list_checkpoints(open_storage(str(tmp_path / "ckpt")))), "a first commit")
    (first,) = [p for p in job_pods(cluster, namespace, "train") if not p["metadata"].get("deletionTimestamp")]
    ready = next(c for c in first["status"]["conditions"] if c["type"] == "Ready")
    assert ready["status"] == "False", "the helper ended: the pod itself is not Ready"
    cluster.taint_node(first["spec"]["nodeName"], "aws-node-termination-handler/spot-itn", "true", "NoSchedule")

    final = wait_phase(cluster, namespace, "train", "Succeeded")
    assert (final["preemptions"], final["restarts"]) == (1, 0), final
    reasons = event_reasons(cluster, namespace, "train")
    for reason in ("SpotInterrupted", "FlushRequested", "FlushCommitted", "Rescheduled"):
        assert reason in reasons, reasons
    # The last attempt's sidecar runs on after the agent exited 0: the pod is deleted so that it
    # does not hold its node.
    wait(lambda: not job_pods(cluster, namespace, "train"), "the pods whose sidecar ran on deleted")
    assert_same_final_state(dumps / "train-1-0", uninterrupted)


def test_an_init_container_that_fails_is_the_jobs_failure_counted_and_named_never_a_lost_node(
    cluster: TestCluster,
    namespace: str,
    start_controller: Callable[..., Controller],
    tmp_path: Path,
) -> None:
    """With restartPolicy Never a failed init container fails the pod before the agent ever ran:
    a Failed pod without the agent's exit code. That is the template's doing, not a node lost:
    it is counted against maxRestarts and the job fails naming the container."""
    cluster.add_node(f"{namespace}-a", zone="us-east-1a")
    cluster.add_node(f"{namespace}-b", zone="us-east-1b")
    start_controller(namespace)
    body = spotjob_body("train", namespace, uri=str(tmp_path / "ckpt"), dump_dir=tmp_path)
    body["spec"]["maxRestarts"] = 1
    body["spec"]["template"]["spec"]["initContainers"] = [
        {
            "name": "fetch-dataset",
            "image": "fetch:1",
            "command": ["python", "-c", "import sys; print('no such dataset'); sys.exit(3)"],
        }
    ]
    create_job(cluster, body)

    def ended() -> dict[str, Any] | None:
        s = status(cluster, namespace, "train")
        if s.get("preemptions"):
            raise AssertionError(f"a failed init container was taken for a preemption: {s.get('message')}")
        return s if s.get("phase") == "Failed" else None

    final = wait(ended, "the job Failed")
    assert (final["preemptions"], final["restarts"]) == (0, 1), final
    assert final["reason"] == "RestartBudgetExhausted", final
    assert "init container fetch-dataset exited 3" in final["message"], final["message"]
    failed = wait(
        lambda: [e for e in job_events(cluster, namespace, "train") if e["reason"] == "WorkerFailed"],
        "a WorkerFailed Event (emitted after the status write)",
    )
    assert failed and "init container fetch-dataset exited 3" in failed[0]["note"], failed
    assert "WorkerLost" not in event_reasons(cluster, namespace, "train")


def test_a_native_sidecar_runs_beside_the_trainer_and_is_stopped_after_it_so_the_pod_completes(
    cluster: TestCluster,
    namespace: str,
    start_controller: Callable[..., Controller],
    uninterrupted: Path,
    tmp_path: Path,
) -> None:
    """An init container with restartPolicy Always (Kubernetes 1.29+): started before the trainer,
    running beside it, stopped by the kubelet once the trainer exited; the pod then Succeeds."""
    cluster.add_node(f"{namespace}-a")
    start_controller(namespace)
    dumps = tmp_path / "dumps"
    dumps.mkdir()
    body = spotjob_body("train", namespace, uri=str(tmp_path / "ckpt"), dump_dir=dumps)
    body["spec"]["template"]["spec"]["initContainers"] = [
        {"name": "proxy", "image": "proxy:1", "restartPolicy": "Always", "command": FOREVER}
    ]
    create_job(cluster, body)

    _phase_before(cluster, namespace, "Running", "Succeeded", "Failed")
    final = wait_phase(cluster, namespace, "train", "Succeeded")
    assert (final["preemptions"], final["restarts"]) == (0, 0), final

    def completed() -> dict[str, Any] | None:
        (pod,) = job_pods(cluster, namespace, "train")
        return pod if pod["status"]["phase"] == "Succeeded" else None

    pod = wait(completed, "the pod Succeeded once its sidecar was stopped")
    (proxy,) = pod["status"]["initContainerStatuses"]
    assert "terminated" in proxy["state"], proxy
    assert_same_final_state(dumps / "train-0-0", uninterrupted)


def test_a_secret_the_trainer_needs_that_is_missing_is_told_and_the_job_starts_once_it_exists(
    cluster: TestCluster,
    namespace: str,
    start_controller: Callable[..., Controller],
    tmp_path: Path,
) -> None:
    cluster.add_node(f"{namespace}-a")
    start_controller(namespace)
    # One rank, ten steps: what is checked is that the pod waits for the Secret and then runs to
    # the end, not the training itself.
    body = spotjob_body("train", namespace, uri=str(tmp_path / "ckpt"), dump_dir=tmp_path, steps=10, nproc=1)
    (trainer,) = body["spec"]["template"]["spec"]["containers"]
    trainer["env"] = [{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}}]
    create_job(cluster, body)

    def told() -> dict[str, Any] | None:
        events = [e for e in job_events(cluster, namespace, "train") if e["reason"] == "WorkerNotStarting"]
        return events[0] if events else None

    event = wait(told, "a WorkerNotStarting event")
    assert event["type"] == "Warning" and "CreateContainerConfigError" in event["note"], event
    assert 'secret "hf" not found' in event["note"], event
    s = status(cluster, namespace, "train")
    assert s["phase"] == "Pending" and s["attempt"]["notStarting"]["reason"] == "CreateContainerConfigError", s

    cluster.rest.request(
        "POST",
        f"/api/v1/namespaces/{namespace}/secrets",
        {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "hf"}, "stringData": {"token": "t"}},
    )
    final = wait_phase(cluster, namespace, "train", "Succeeded")
    assert (final["preemptions"], final["restarts"]) == (0, 0), final


def backend_unavailable_events(cluster: TestCluster, namespace: str) -> list[dict[str, Any]]:
    """The job's BackendUnavailable Events. The controller writes the status before it emits the
    pass's Events, so a test that saw the status must wait for them too, not read them at once."""
    return [e for e in job_events(cluster, namespace, "train") if e["reason"] == "BackendUnavailable"]


def test_a_service_account_that_does_not_exist_leaves_the_job_degraded_with_an_event_naming_it(
    cluster: TestCluster,
    namespace: str,
    start_controller: Callable[..., Controller],
    tmp_path: Path,
) -> None:
    cluster.add_node(f"{namespace}-a")
    start_controller(namespace)
    body = spotjob_body("train", namespace, uri=str(tmp_path / "ckpt"), dump_dir=tmp_path)
    body["spec"]["template"]["spec"]["serviceAccountName"] = "trainer-sa"
    create_job(cluster, body)

    def degraded() -> dict[str, Any] | None:
        s = status(cluster, namespace, "train")
        return s if _condition(s, "Degraded").get("status") == "True" else None

    s = wait(degraded, "the job Degraded")
    assert 'serviceaccount "trainer-sa" not found' in _condition(s, "Degraded")["message"], s
    assert s.get("phase") == "Pending" and not job_pods(cluster, namespace, "train"), s
    events = wait(lambda: backend_unavailable_events(cluster, namespace), "a BackendUnavailable Event")
    assert events and events[0]["type"] == "Warning" and "trainer-sa" in events[0]["note"], events


RESTRICTED_POD = {"runAsNonRoot": True, "runAsUser": 1000, "seccompProfile": {"type": "RuntimeDefault"}}
RESTRICTED_CONTAINER = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}


def test_a_template_pod_security_refuses_leaves_the_job_degraded_saying_what_to_set_and_a_fixed_one_starts(
    cluster: TestCluster,
    namespace: str,
    start_controller: Callable[..., Controller],
    tmp_path: Path,
) -> None:
    """A namespace at Pod Security ``enforce: restricted`` refuses a worker pod whose template sets no
    securityContext (403, worded as a real API server words it: tests/k8s/cluster/podsecurity.py).
    The job says so (Degraded, a Warning Event) naming what to set and where, creates no pod, and
    starts once spec.template is fixed; the pod keeps the template's securityContext, and nothing
    spotjob adds (its volumes, port, env, probes) is refused.

    The test API server models only the ``restricted`` level on pod creates; not the ``warn`` and
    ``audit`` modes, versions other than ``latest``, or exemptions."""
    cluster.rest.request(
        "PATCH",
        f"/api/v1/namespaces/{namespace}",
        {"metadata": {"labels": {"pod-security.kubernetes.io/enforce": "restricted"}}},
        content_type="application/merge-patch+json",
    )
    cluster.add_node(f"{namespace}-a")
    start_controller(namespace)
    # One rank, ten steps: the fixed template's pod starts and is only read; its training is not
    # what is checked (the namespace's deletion stops it).
    body = spotjob_body("train", namespace, uri=str(tmp_path / "ckpt"), dump_dir=tmp_path, steps=10, nproc=1)
    create_job(cluster, body)

    def degraded() -> dict[str, Any] | None:
        s = status(cluster, namespace, "train")
        return s if _condition(s, "Degraded").get("status") == "True" else None

    s = wait(degraded, "the job Degraded")
    message = _condition(s, "Degraded")["message"]
    assert 'violates PodSecurity "restricted:latest"' in message, s
    assert 'container "trainer" must set securityContext.allowPrivilegeEscalation=false' in message, s
    assert "set what it names in spec.template" in message and "Locked-down namespaces" in message, s
    assert s.get("phase") == "Pending" and not job_pods(cluster, namespace, "train"), s
    events = wait(lambda: backend_unavailable_events(cluster, namespace), "a BackendUnavailable Event")
    assert events and events[0]["type"] == "Warning" and "spec.template" in events[0]["note"], events

    trainer = {
        "name": "trainer",
        "image": "spotjob-test:local",
        "resources": {"requests": {"cpu": "1", "memory": "1Gi"}},
        "securityContext": RESTRICTED_CONTAINER,
    }
    cluster.rest.request(
        "PATCH",
        f"/apis/spotjob.dev/v1alpha1/namespaces/{namespace}/spotjobs/train",
        {"spec": {"template": {"spec": {"securityContext": RESTRICTED_POD, "containers": [trainer]}}}},
        content_type="application/merge-patch+json",
    )
    (pod,) = wait(lambda: job_pods(cluster, namespace, "train") or None, "the fixed template's worker pod")
    assert pod["spec"]["securityContext"] == RESTRICTED_POD
    assert pod["spec"]["containers"][0]["securityContext"] == RESTRICTED_CONTAINER
