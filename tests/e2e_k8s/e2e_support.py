"""Helpers of the controller's end-to-end tests (``conftest.py`` makes the fixtures).

Everything here reaches the cluster through its kubeconfig only (``TestCluster.rest``, ``kubectl``,
and the controller's own kubeconfig), so the tests run unchanged against a real API server
(``SPOTJOB_TEST_KUBECONFIG``); only the test kubelet is ours.

- ``Controller``: one real ``spotjob-controller`` process (the console script), its output in a
  file; ``kill()`` is SIGKILL (a crashed leader), ``stop()`` SIGTERM.
- ``spotjob_body``: a SpotJob that trains ``examples/train.py`` with a per-pod ``--dump``.
- ``job``, ``status``, ``job_pods``, ``job_events``: reads.
- ``PodHistory``: every worker pod the API server ever had for a namespace (a watch in a
  thread), to prove what never happened (two pods of one name, two attempts alive at once).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "e2e" / "scripts"))
sys.path.insert(0, str(REPO / "tests"))

from local_run_support import BIN, NPROC, STEPS, TRAIN, assert_same_final_state  # noqa: E402

from agent.catalog import list_checkpoints  # noqa: E402
from agent.storage import open_storage  # noqa: E402
from tests.k8s.cluster import TestCluster  # noqa: E402
from tests.k8s.cluster.client import ApiCallError  # noqa: E402
from tests.k8s.spotjob_crd import GROUP_PATH, install_crd  # noqa: E402,F401

__all__ = ["BIN", "NPROC", "STEPS", "TRAIN", "assert_same_final_state"]

CONTROLLER_NAMESPACE = "spotjob-system"
CONTROLLER_USER = f"system:serviceaccount:{CONTROLLER_NAMESPACE}:spotjob"
CONTROLLER_LABELS = "app.kubernetes.io/name=spotjob,app.kubernetes.io/instance=spotjob"
WAIT = 240.0
"""Generous: a loaded 2-core machine starts torch slowly. Only a hang ever reaches it."""


def jobs_path(namespace: str, name: str = "") -> str:
    return f"{GROUP_PATH}/namespaces/{namespace}/spotjobs" + (f"/{name}" if name else "")


# -- the controller -------------------------------------------------------------------------------


@dataclass
class Controller:
    """A ``spotjob-controller`` process started by ``start()``."""

    kubeconfig: str
    log_path: Path
    args: list[str]
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Controller:
        binary = BIN / "spotjob-controller"
        env = {**os.environ, **self.env, "KUBECONFIG": self.kubeconfig}
        with open(self.log_path, "ab") as out:
            self.proc = subprocess.Popen(
                [str(binary), *self.args], stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        return self

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL: the process dies mid-whatever, as a crashed or OOM-killed leader does."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)

    def stop(self) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)
        return self.proc.returncode

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def metrics(self) -> dict[str, float]:
        """Its /metrics (the port it logged), as ``{'name{labels}': value}``."""
        found = re.search(r"serving /healthz, /readyz and /metrics on port (\d+)", self.log())
        assert found, "the controller has not said where it serves /metrics"
        with urllib.request.urlopen(f"http://127.0.0.1:{found.group(1)}/metrics", timeout=10) as response:
            text = response.read().decode()
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                out[name] = float(value)
        return out


# -- SpotJobs -------------------------------------------------------------------------------------


def spotjob_body(
    name: str,
    namespace: str,
    *,
    uri: str,
    dump_dir: Path,
    steps: int = STEPS,
    step_sleep: float = 0.1,
    replicas: int = 1,
    nproc: int = NPROC,
    every_steps: int = 10,
    flush_timeout: float = 40.0,
    env: dict[str, str] | None = None,
    extra_args: list[str] | None = None,
    backoff: float = 1.0,
) -> dict[str, Any]:
    """A SpotJob training ``examples/train.py``; each pod dumps its final state to
    ``dump_dir/<pod name>.rank<r>.pt`` ($(POD_NAME) is expanded by the kubelet)."""
    return {
        "apiVersion": "spotjob.dev/v1alpha1",
        "kind": "SpotJob",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "image": "spotjob-test:local",
            "template": {
                "metadata": {"labels": {"team": "e2e"}},
                "spec": {
                    "containers": [
                        {
                            "name": "trainer",
                            "image": "spotjob-test:local",
                            "resources": {"requests": {"cpu": "1", "memory": "1Gi"}},
                        }
                    ]
                },
            },
            "command": [
                str(TRAIN),
                "--steps",
                str(steps),
                "--step-sleep",
                f"{step_sleep:g}",
                "--dump",
                f"{dump_dir}/$(POD_NAME)",
                *(extra_args or []),
            ],
            "env": {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "SPOTJOB_CLOUD": "none", **(env or {})},
            "replicas": replicas,
            "nprocPerNode": nproc,
            "checkpoint": {"uri": uri, "everySteps": every_steps, "keep": 3},
            "maxRestarts": 2,
            "flushTimeoutSeconds": flush_timeout,
            "restartBackoff": {"initialSeconds": backoff, "maxSeconds": max(backoff, 5.0)},
            "cooldown": {"avoidNode": True, "seconds": 600},
        },
    }


def job(cluster: TestCluster, namespace: str, name: str) -> dict[str, Any] | None:
    try:
        obj: dict[str, Any] = cluster.rest.get(jobs_path(namespace, name))
        return obj
    except ApiCallError as e:
        if e.status == 404:
            return None
        raise


def status(cluster: TestCluster, namespace: str, name: str) -> dict[str, Any]:
    obj = job(cluster, namespace, name)
    return dict((obj or {}).get("status") or {})


def phase(cluster: TestCluster, namespace: str, name: str) -> str | None:
    return status(cluster, namespace, name).get("phase")


def wait_phase(cluster: TestCluster, namespace: str, name: str, *phases: str, timeout: float = WAIT) -> dict[str, Any]:
    def check() -> dict[str, Any] | None:
        s = status(cluster, namespace, name)
        if s.get("phase") in ("Failed",) and "Failed" not in phases:
            raise AssertionError(f"SpotJob {namespace}/{name} failed: {s.get('reason')}: {s.get('message')}")
        for c in s.get("conditions") or []:
            if c.get("type") == "Invalid" and c.get("status") == "True":
                raise AssertionError(f"SpotJob {namespace}/{name} is invalid: {c.get('message')}")
        return s if s.get("phase") in phases else None

    return cluster.wait_for(check, timeout, f"SpotJob {namespace}/{name} to be {' or '.join(phases)}", interval=0.2)


def job_pods(cluster: TestCluster, namespace: str, name: str) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = cluster.rest.get(
        f"/api/v1/namespaces/{namespace}/pods", labelSelector=f"spotjob.dev/job={name}"
    )["items"]
    return sorted(items, key=lambda p: p["metadata"]["name"])


def running_pods(cluster: TestCluster, namespace: str, name: str, attempt: int) -> list[dict[str, Any]]:
    return [
        p
        for p in job_pods(cluster, namespace, name)
        if p["metadata"]["labels"].get("spotjob.dev/attempt") == str(attempt)
        and not p["metadata"].get("deletionTimestamp")
        and any(c["type"] == "Ready" and c["status"] == "True" for c in (p.get("status") or {}).get("conditions") or [])
    ]


def job_events(cluster: TestCluster, namespace: str, name: str) -> list[dict[str, Any]]:
    """Events about the SpotJob (events.k8s.io/v1), oldest first."""
    items = cluster.rest.get(f"/apis/events.k8s.io/v1/namespaces/{namespace}/events")["items"]
    about = [e for e in items if (e.get("regarding") or {}).get("kind") == "SpotJob" and e["regarding"]["name"] == name]
    return sorted(about, key=lambda e: e.get("eventTime") or "")


def event_reasons(cluster: TestCluster, namespace: str, name: str) -> list[str]:
    return [e["reason"] for e in job_events(cluster, namespace, name)]


def create_job(cluster: TestCluster, body: dict[str, Any]) -> dict[str, Any]:
    created: dict[str, Any] = cluster.rest.request("POST", jobs_path(body["metadata"]["namespace"]), body)
    return created


# -- what happened -------------------------------------------------------------------------------


class PodHistory:
    """Every version of every worker pod in a namespace the API server showed, from a watch."""

    def __init__(self, cluster: TestCluster, namespace: str) -> None:
        self._cluster = cluster
        self._namespace = namespace
        self.events: list[tuple[str, dict[str, Any]]] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        listing = cluster.rest.get(f"/api/v1/namespaces/{namespace}/pods", labelSelector="spotjob.dev/job")
        self._rv = listing["metadata"]["resourceVersion"]
        for p in listing["items"]:
            self.events.append(("ADDED", p))
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(Exception):
                for ev in self._cluster.rest.watch(
                    f"/api/v1/namespaces/{self._namespace}/pods", self._rv, 5, labelSelector="spotjob.dev/job"
                ):
                    obj = ev["object"]
                    self._rv = obj["metadata"].get("resourceVersion", self._rv)
                    if ev["type"] in ("ADDED", "MODIFIED", "DELETED"):
                        with self._lock:
                            self.events.append((ev["type"], obj))
                    if self._stop.is_set():
                        return

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def uids_by_name(self) -> dict[str, set[str]]:
        with self._lock:
            out: dict[str, set[str]] = {}
            for _, p in self.events:
                out.setdefault(p["metadata"]["name"], set()).add(p["metadata"]["uid"])
            return out

    def attempts_alive_together(self) -> list[tuple[str, str]]:
        """Pairs of pods of different attempts of one job that were both running (container
        started, not yet terminated) at one moment, replaying the history in order."""
        alive: dict[str, tuple[str, str]] = {}
        overlaps: list[tuple[str, str]] = []
        with self._lock:
            history = list(self.events)
        for kind, p in history:
            md = p["metadata"]
            job_name, attempt = md["labels"].get("spotjob.dev/job"), md["labels"].get("spotjob.dev/attempt")
            running = kind != "DELETED" and any(
                "running" in (c.get("state") or {}) for c in (p.get("status") or {}).get("containerStatuses") or []
            )
            if running:
                for other, (other_job, other_attempt) in alive.items():
                    if other != md["name"] and other_job == job_name and other_attempt != attempt:
                        overlaps.append((other, md["name"]))
                alive[md["name"]] = (job_name, attempt)
            else:
                alive.pop(md["name"], None)
        return overlaps


def wait(check: Callable[[], Any], what: str, timeout: float = WAIT) -> Any:
    return TestCluster.wait_for(check, timeout, what, interval=0.2)


def wait_for_a_commit(uri: str) -> None:
    """Storage holds a committed checkpoint. Read from storage, not the job's status, which a
    Running job refreshes every 10 s (and a controller that just took the lease over, later): a
    short job on a slow machine could end before it shows. One store for the whole wait."""
    store = open_storage(uri)
    try:
        wait(lambda: any(c.valid for c in list_checkpoints(store)), "a first committed checkpoint")
    finally:
        store.close()


def now() -> float:
    return time.monotonic()
