"""Helpers of the ``kubectl spotjob`` tests (``conftest.py`` makes the fixtures).

The plugin only reads what the controller writes (and writes one annotation), so these tests need
no controller: the test writes a SpotJob and its status (as the controller would), the job's pods
(bound to nodes that run no containers, which the test kubelet reports Running), its Events and
its checkpoints, then checks what ``kubectl spotjob`` shows. ``install_crd`` installs the CRD
exactly as the chart ships it. ``run_kubectl_spotjob`` runs the real kubectl binary, which finds
``kubectl-spotjob`` in the venv's bin on PATH (tests/e2e_k8s uses it too, against a real controller).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from tests.k8s.cluster import TestCluster
from tests.k8s.cluster.client import ApiCallError
from tests.k8s.spotjob_crd import GROUP_PATH, install_crd  # noqa: F401

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
USER = "jane@example.com"
"""The person running ``kubectl spotjob`` (an identity of its own in the audit log)."""


def run_kubectl_spotjob(
    cluster: TestCluster,
    kubeconfig: str,
    *args: str,
    env: dict[str, str] | None = None,
    timeout: float = 120,
    stdout: int | None = None,
) -> subprocess.CompletedProcess[str]:
    """``kubectl spotjob ARGS`` as a user runs it: the kubectl binary on PATH, the venv's bin (where
    ``kubectl-spotjob`` is installed) first on PATH, ``kubeconfig`` as $KUBECONFIG. ``stdout``: a
    file descriptor to write the output to (else it is captured)."""
    kubectl = shutil.which("kubectl")
    assert kubectl is not None, "kubectl is not on PATH"
    assert (BIN / "kubectl-spotjob").exists(), "the plugin is not installed in the venv (make venv)"
    full = {
        **os.environ,
        **cluster.env(),
        "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
        "KUBECONFIG": kubeconfig,
        **(env or {}),
    }
    if stdout is not None:
        return subprocess.run(
            [kubectl, "spotjob", *args],
            stdout=stdout,
            stderr=subprocess.PIPE,
            text=True,
            env=full,
            timeout=timeout,
            check=False,
        )
    return subprocess.run(
        [kubectl, "spotjob", *args], capture_output=True, text=True, env=full, timeout=timeout, check=False
    )


def jobs_path(namespace: str, name: str = "") -> str:
    return f"{GROUP_PATH}/namespaces/{namespace}/spotjobs" + (f"/{name}" if name else "")


def rfc3339(t: datetime) -> str:
    return t.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def ago(seconds: float) -> str:
    return rfc3339(datetime.now(UTC) - timedelta(seconds=seconds))


def create_job(
    cluster: TestCluster,
    namespace: str,
    name: str,
    *,
    uri: str = "s3://bucket/jobs",
    max_restarts: int = 3,
    flush_timeout: float = 120.0,
    replicas: int = 1,
) -> dict[str, Any]:
    body = {
        "apiVersion": "spotjob.dev/v1alpha1",
        "kind": "SpotJob",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "image": "registry.example.com/train:1",
            "command": ["/workspace/train.py"],
            "replicas": replicas,
            "nprocPerNode": 2,
            "checkpoint": {"uri": uri, "everySteps": 100},
            "maxRestarts": max_restarts,
            "flushTimeoutSeconds": flush_timeout,
        },
    }
    created: dict[str, Any] = cluster.rest.request("POST", jobs_path(namespace), body)
    return created


def set_status(cluster: TestCluster, namespace: str, name: str, status: dict[str, Any]) -> dict[str, Any]:
    """Write the job's status as the controller does (PUT on the status subresource)."""
    for _ in range(10):
        job = cluster.rest.get(jobs_path(namespace, name))
        job["status"] = status
        try:
            updated: dict[str, Any] = cluster.rest.request("PUT", jobs_path(namespace, name) + "/status", job)
            return updated
        except ApiCallError as e:
            if e.status != 409:
                raise
    raise AssertionError(f"could not write the status of {namespace}/{name}: conflicts")


def running_status(
    *,
    step: int = 1400,
    checkpoint_age: float = 41,
    preemptions: int = 1,
    restarts: int = 0,
    goodput: float = 0.9812,
    attempt: int = 1,
    workers: list[dict[str, Any]] | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """A status the controller writes for a job that runs (attempt ``attempt``, one restart behind it)."""
    status: dict[str, Any] = {
        "phase": "Running",
        "reason": "AttemptRunning",
        "message": f"every worker of attempt {attempt} runs",
        "observedGeneration": 1,
        "conditions": [
            {
                "type": "Ready",
                "status": "True",
                "reason": "AttemptRunning",
                "message": "every worker runs",
                "lastTransitionTime": ago(300),
            }
        ],
        "attempt": {
            "number": attempt,
            "startedAt": ago(320),
            "runningAt": ago(300),
            "resumedFromStep": 1300,
            "observedStep": step + 20,
            "observedStepAt": ago(2),
        },
        "workers": workers or [],
        "restarts": restarts,
        "preemptions": preemptions,
        "restartHistory": [
            {
                "time": ago(330),
                "attempt": attempt - 1,
                "cause": "Preemption",
                "reason": "SpotInterrupted",
                "message": "node spot-a is reclaimed (aws-node-termination-handler/spot-itn)",
            }
        ],
        "lastCheckpoint": {"step": step, "uri": f"s3://bucket/jobs/step-{step:09d}", "time": ago(checkpoint_age)},
        "lostSteps": 12,
        "goodput": goodput,
        "createdAt": ago(3600),
        "startTime": ago(3500),
    }
    status.update(extra)
    return status


def create_pod(cluster: TestCluster, namespace: str, job: str, attempt: int, index: int, node: str) -> dict[str, Any]:
    """A worker pod of ``job`` bound to ``node`` (a node that runs no containers: it goes Running)."""
    name = f"{job}-{attempt}-{index}"
    body = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": {"spotjob.dev/job": job, "spotjob.dev/attempt": str(attempt), "spotjob.dev/index": str(index)},
        },
        "spec": {
            "nodeName": node,
            "restartPolicy": "Never",
            "containers": [{"name": "trainer", "image": "registry.example.com/train:1", "command": ["sleep", "1"]}],
        },
    }
    created: dict[str, Any] = cluster.rest.request("POST", f"/api/v1/namespaces/{namespace}/pods", body)
    return created


def wait_pod_running(cluster: TestCluster, namespace: str, name: str) -> None:
    cluster.wait_for(
        lambda: (
            cluster.rest.get(f"/api/v1/namespaces/{namespace}/pods/{name}").get("status", {}).get("phase") == "Running"
        ),
        60,
        f"pod {name} to run",
    )


def write_event(
    cluster: TestCluster,
    namespace: str,
    job: dict[str, Any],
    reason: str,
    note: str,
    *,
    type: str = "Normal",
    at: datetime,
    count: int = 1,
    last: datetime | None = None,
    uid: str | None = None,
    core: bool = False,
) -> None:
    """An Event about ``job`` as the controller's recorder writes it (events.k8s.io/v1), or with
    ``core`` as a client of core v1 Events does (which events.k8s.io/v1 serves too)."""
    ref = {
        "apiVersion": "spotjob.dev/v1alpha1",
        "kind": "SpotJob",
        "name": job["metadata"]["name"],
        "namespace": namespace,
        "uid": job["metadata"]["uid"] if uid is None else uid,
    }
    stamp = at.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    name = f"{job['metadata']['name']}.{uuid.uuid4().hex[:16]}"
    if core:
        body: dict[str, Any] = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"name": name, "namespace": namespace},
            "involvedObject": ref,
            "reason": reason,
            "message": note,
            "type": type,
            "count": count,
            "firstTimestamp": rfc3339(at),
            "lastTimestamp": rfc3339(last or at),
            "source": {"component": "spotjob.dev/controller"},
        }
        cluster.rest.request("POST", f"/api/v1/namespaces/{namespace}/events", body)
        return
    body = {
        "apiVersion": "events.k8s.io/v1",
        "kind": "Event",
        "metadata": {"name": name, "namespace": namespace},
        "eventTime": stamp,
        "reportingController": "spotjob.dev/controller",
        "reportingInstance": "spotjob-controller-0",
        "action": reason,
        "reason": reason,
        "type": type,
        "note": note,
        "regarding": ref,
    }
    if count > 1:
        body["series"] = {
            "count": count,
            "lastObservedTime": (last or at).astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ"),
        }
    cluster.rest.request("POST", f"/apis/events.k8s.io/v1/namespaces/{namespace}/events", body)


def flush_annotation(job: dict[str, Any]) -> dict[str, Any] | None:
    raw = (job["metadata"].get("annotations") or {}).get("spotjob.dev/flush-request")
    return json.loads(raw) if raw else None


def answer_flush_requests(
    cluster: TestCluster,
    namespace: str,
    name: str,
    answer: dict[str, Any],
    *,
    stop: Any,
    timeout: float = 60,
    break_watches: bool = False,
    in_progress: str | None = None,
) -> None:
    """Play the controller's side of a flush: once the annotation holds a request, record
    ``answer`` (plus the request's id and mode) in ``status.lastFlushRequest``. ``break_watches``:
    first expire the watch history and cut the open SpotJob watch (the plugin's), so the plugin
    must watch again from a version the server no longer keeps, be told 410 Gone and read the
    job afresh. ``in_progress``: first record the request as taken (outcome ``InProgress`` with
    this message), as the real controller does, then the answer."""
    deadline = time.monotonic() + timeout
    while not stop.is_set() and time.monotonic() < deadline:
        job = cluster.rest.get(jobs_path(namespace, name))
        request = flush_annotation(job)
        if request is not None:
            if break_watches:
                # One step on the server (a write elsewhere, the history expired, the watch cut), so
                # no bookmark can carry the plugin past the expiry: whatever it saw is now too old.
                # Repeated until the plugin's watch was open to be cut.
                # Only this namespace's: a leftover watch of an earlier test, cut instead of the
                # plugin's, let the plugin read the answer on the watch it still had.
                while (
                    cluster.expire_watch_history_and_drop_watches("spotjobs", namespace) == 0
                    and time.monotonic() < deadline
                ):
                    time.sleep(0.05)
            status = dict(job.get("status") or {})
            if in_progress is not None:
                taken = {"outcome": "InProgress", "message": in_progress, "time": answer["time"]}
                status["lastFlushRequest"] = {"id": request["id"], "mode": request["mode"], **taken}
                status = dict(set_status(cluster, namespace, name, status)["status"])
            status["lastFlushRequest"] = {"id": request["id"], "mode": request["mode"], **answer}
            set_status(cluster, namespace, name, status)
            return
        time.sleep(0.05)
