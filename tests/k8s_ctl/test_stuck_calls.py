"""A job whose API calls hang never holds back another job's preemption flush.

The real controller (informers, work queue, ``spotjob_reconcile``: the reconciler, the Kubernetes
store and backend) over the test API server, with one routine reconcile worker. The test plays the
scheduler and the kubelet (it binds the pods and writes their status) and the agents (one HTTP
server on loopback that takes ``POST /flush``). Job A's pod creation hangs, as behind a stuck
admission webhook; then job B's node gets a spot-interruption taint: B's flush must reach its
agent while A's call still hangs.

The client's deadline per call (``RetryPolicy.deadline``) is tested in ``test_api.py``.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from ctl_support import TestApi, install_spotjob_crd, wait_for

from orchestrator.k8s.api import NODES, PODS, SPOTJOBS
from orchestrator.k8s.controller import Controller, ControllerOptions
from orchestrator.k8s.wiring import spotjob_reconcile
from tests.k8s.cluster.apiserver import bind
from tests.k8s.cluster.http import Fault

NS = "default"
SPOT_ITN = {"key": "aws-node-termination-handler/spot-itn", "value": "true", "effect": "NoSchedule"}


class Agents:
    """Every job's agent, on 127.0.0.1 (the pods' IP): records the requests, accepts every flush."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, str]] = []
        self.flushed = threading.Event()
        agents = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                agents.requests.append(("POST", self.path))
                if self.path == "/flush":
                    agents.flushed.set()
                self._answer(202, {"accepted": True})

            def do_GET(self) -> None:
                agents.requests.append(("GET", self.path))
                self._answer(200, {"step": 10})

            def _answer(self, code: int, body: dict[str, Any]) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def spotjob(name: str, uri: str) -> dict[str, Any]:
    return {
        "apiVersion": "spotjob.dev/v1alpha1",
        "kind": "SpotJob",
        "metadata": {"name": name},
        "spec": {"image": "img:1", "command": ["train.py"], "checkpoint": {"uri": uri}},
    }


def node(name: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "labels": {"topology.kubernetes.io/zone": "us-east-1a"}},
        "status": {"conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady"}]},
    }


def run_pod(test_api: TestApi, name: str, node_name: str) -> None:
    """The scheduler binds the pod, the kubelet reports it running and Ready on 127.0.0.1."""
    bind(test_api.front.api, NS, name, {"target": {"kind": "Node", "name": node_name}}, "system:kube-scheduler")
    pod = test_api.admin.get(PODS, name, NS)
    container = pod["spec"]["containers"][0]["name"]
    pod["status"] = {
        "phase": "Running",
        "podIP": "127.0.0.1",
        "podIPs": [{"ip": "127.0.0.1"}],
        "conditions": [{"type": "Ready", "status": "True"}, {"type": "PodScheduled", "status": "True"}],
        "containerStatuses": [
            {"name": container, "ready": True, "state": {"running": {"startedAt": "2026-06-01T12:00:00Z"}}}
        ],
    }
    test_api.admin.replace(PODS, pod, subresource="status")


@pytest.fixture
def agents() -> Iterator[Agents]:
    a = Agents()
    yield a
    a.stop()


@pytest.fixture
def controller(test_api: TestApi, agents: Agents) -> Iterator[Controller]:
    install_spotjob_crd(test_api)
    options = ControllerOptions(
        namespaces=(NS,),
        leader_elect=False,
        http_port=0,
        identity="solo",
        workers=1,  # one routine worker: one job whose calls hang holds all of them
        agent_port=agents.port,
        network_policy=False,
    )
    # The client a controller runs with (30 s per request, the default retries), so that before the
    # deadline per call one hanging create held the worker for minutes.
    c = Controller(test_api.client(retry=None), options, spotjob_reconcile)
    thread = threading.Thread(target=c.run, daemon=True)
    thread.start()
    wait_for(lambda: c.is_leader, what="the controller to start its workers")
    yield c
    test_api.clear_faults()  # lets the hanging requests go
    c.stop()
    thread.join(60)
    assert not thread.is_alive()


def _phase(test_api: TestApi, name: str) -> str | None:
    return (test_api.admin.get(SPOTJOBS, name, NS).get("status") or {}).get("phase")


def _pods(test_api: TestApi) -> list[str]:
    return sorted(p["metadata"]["name"] for p in test_api.admin.list(PODS, NS)[0])


def test_a_preempted_jobs_flush_reaches_its_agent_while_another_jobs_pod_creation_hangs(
    test_api: TestApi, controller: Controller, agents: Agents, tmp_path: Path
) -> None:
    test_api.admin.create(NODES, node("node-b"))
    test_api.admin.create(SPOTJOBS, spotjob("b", str(tmp_path / "b")), NS)
    wait_for(lambda: _pods(test_api) == ["b-0-0"], what="job B's worker pod")
    run_pod(test_api, "b-0-0", "node-b")
    wait_for(lambda: _phase(test_api, "b") == "Running", what="job B running", timeout=60)

    # Job A's pod creation hangs (a stuck admission webhook) until the test lets it go.
    hang = test_api.front.add_fault(Fault(verb="create", resource="pods", action="hang", count=1000, delay=600))
    test_api.admin.create(SPOTJOBS, spotjob("a", str(tmp_path / "a")), NS)
    wait_for(lambda: hang.hits >= 1, what="job A's pod creation to hang", timeout=60)

    # B's node is about to be reclaimed.
    taint = test_api.admin.get(NODES, "node-b")
    taint["spec"] = {"taints": [SPOT_ITN]}
    test_api.admin.replace(NODES, taint)

    # Failure bound only: before the fix the one worker sat in A's create for 6 x 30 s.
    assert agents.flushed.wait(60), "job B's flush was not sent while job A's pod creation hung"
    assert not hang.released.is_set() and "a-0-0" not in _pods(test_api)  # A's calls still hang
    assert ("POST", "/flush") in agents.requests
