"""``TestCluster``: the test API server, its control plane and the test kubelet, behind a kubeconfig.

What the controller's end-to-end tests and the scale benchmark use::

    cluster = TestCluster(tmp_dir).start()          # or TestCluster.from_env(tmp_dir)
    cluster.kubeconfig                               # path; child processes get KUBECONFIG
    cluster.add_node("spot-a", zone="us-east-1a", instance_type="g5.xlarge", capacity_type="spot")
    cluster.taint_node("spot-a", "aws-node-termination-handler/spot-itn", "true", "NoSchedule")
    cluster.partition_node("spot-a"); cluster.heal_node("spot-a")
    cluster.delete_node("spot-a")
    cluster.audit_log(); cluster.add_fault(Fault(verb="patch", resource="pods", status=500))
    cluster.stop()

With ``SPOTJOB_TEST_KUBECONFIG`` set, ``from_env`` starts no API server: the kubeconfig names a
real one (kind, k3s) whose own scheduler and controllers run, and only the test kubelet is ours.
The hooks that exist only on the test API server (audit log, faults, expiring the watch history,
validation failures) then raise ``NotOnTestServer``, which the fixtures turn into a skip.
"""

from __future__ import annotations

import base64
import contextlib
import logging
import os
import secrets
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import yaml

from .apiserver import ApiServer, ValidationFailure
from .client import ApiCallError, RestClient
from .controlplane import GarbageCollector, NamespaceController, NodeLifecycle, PodGC, Scheduler
from .http import AuditRecord, Fault, HttpFront, User
from .kubelet import Kubelet, NodeConfig, PodWorker
from .tls import ServingCert, make_serving_cert

log = logging.getLogger(__name__)

T = TypeVar("T")

KUBECONFIG_ENV = "SPOTJOB_TEST_KUBECONFIG"
ADMIN = "test-admin"


class NotOnTestServer(RuntimeError):
    """A test hook that only the test API server has, asked of a real cluster."""


def write_kubeconfig(
    path: Path, server: str, token: str, user: str = ADMIN, context: str = "spotjob-test", ca_pem: bytes | None = None
) -> Path:
    cluster: dict[str, Any] = {"server": server}
    if ca_pem:
        cluster["certificate-authority-data"] = base64.b64encode(ca_pem).decode()
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "spotjob-test", "cluster": cluster}],
        "users": [{"name": user, "user": {"token": token}}],
        "contexts": [{"name": context, "context": {"cluster": "spotjob-test", "user": user, "namespace": "default"}}],
        "current-context": context,
    }
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    path.chmod(0o600)
    return path


class TestCluster:
    """A cluster for tests. Timings default to short, test-friendly values; a real cluster's
    defaults are in brackets: ``node_monitor_grace`` (40 s), ``pod_gc_grace`` (40 s),
    ``default_toleration_seconds`` (300 s), ``heartbeat_interval`` (the Lease, 10 s),
    ``status_interval`` (a Node status post when nothing changed: 5 min since Kubernetes 1.17)."""

    __test__ = False  # not a pytest test class

    def __init__(
        self,
        root: Path,
        *,
        external_kubeconfig: str | None = None,
        validate: str = "strict",
        node_monitor_grace: float = 4.0,
        pod_gc_grace: float = 1.0,
        default_toleration_seconds: int = 300,
        heartbeat_interval: float = 0.5,
        status_interval: float = 10.0,
        bookmark_interval: float = 1.0,
        restart_backoff: tuple[float, float] = (0.2, 5.0),
        history_size: int = 20000,
        extra_env: dict[str, str] | None = None,
    ) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.external = external_kubeconfig
        self.api: ApiServer | None = None
        self.front: HttpFront | None = None
        self._loops: list[Any] = []
        self.kubelet: Kubelet | None = None
        self.kubeconfig = ""
        self.admin_token = ""
        self._settings = dict(
            validate=validate,
            node_monitor_grace=node_monitor_grace,
            pod_gc_grace=pod_gc_grace,
            default_toleration_seconds=default_toleration_seconds,
            heartbeat_interval=heartbeat_interval,
            status_interval=status_interval,
            bookmark_interval=bookmark_interval,
            restart_backoff=restart_backoff,
            history_size=history_size,
        )
        self._extra_env = extra_env
        self._tls: ServingCert | None = None
        self._rest: RestClient | None = None

    @classmethod
    def from_env(cls, root: Path, **kwargs: Any) -> TestCluster:
        return cls(root, external_kubeconfig=os.environ.get(KUBECONFIG_ENV) or None, **kwargs)

    # Lifecycle ---------------------------------------------------------------------------------
    def start(self) -> TestCluster:
        s = self._settings
        if self.external:
            self.kubeconfig = self.external
        else:
            self.api = ApiServer(
                validate=str(s["validate"]),
                history_size=int(s["history_size"]),  # type: ignore[call-overload]
                default_toleration_seconds=int(s["default_toleration_seconds"]),  # type: ignore[call-overload]
                bookmark_interval=float(s["bookmark_interval"]),  # type: ignore[arg-type]
            )
            self.admin_token = secrets.token_urlsafe(24)
            self.front = HttpFront(
                self.api, {self.admin_token: User(ADMIN, ("system:masters", "system:authenticated"))}, self.admin_token
            )
            self._tls = make_serving_cert(self.root / "pki")
            url = self.front.start(tls=(self._tls.cert_file, self._tls.key_file))
            self._loops = [
                Scheduler(self.api),
                NodeLifecycle(self.api, node_monitor_grace=float(s["node_monitor_grace"])),  # type: ignore[arg-type]
                PodGC(self.api, grace=float(s["pod_gc_grace"])),  # type: ignore[arg-type]
                GarbageCollector(self.api),
                NamespaceController(self.api),
            ]
            for loop in self._loops:
                loop.start()
            self.kubeconfig = str(
                write_kubeconfig(self.root / "kubeconfig", url, self.admin_token, ca_pem=self._tls.ca_pem)
            )
        kubelet_token = self.add_user("system:node:test-kubelet") if self.front else None
        kubelet_config = (
            str(
                write_kubeconfig(
                    self.root / "kubelet.kubeconfig",
                    self.server_url,
                    kubelet_token,
                    "system:node:test-kubelet",
                    ca_pem=self._tls.ca_pem,
                )
            )
            if kubelet_token and self._tls
            else self.kubeconfig
        )
        self.kubelet = Kubelet(
            kubelet_config,
            self.root / "kubelet",
            heartbeat_interval=float(s["heartbeat_interval"]),  # type: ignore[arg-type]
            status_interval=float(s["status_interval"]),  # type: ignore[arg-type]
            restart_backoff=s["restart_backoff"],  # type: ignore[arg-type]
            extra_env=self._extra_env,
        )
        self.kubelet.start()
        return self

    def stop(self) -> None:
        if self.kubelet is not None:
            self.kubelet.stop()
        for loop in self._loops:
            loop.stop()
        if self.front is not None:
            self.front.stop()

    @property
    def server_url(self) -> str:
        if self.front is not None:
            return self.front.url
        return self.rest.host

    @property
    def rest(self) -> RestClient:
        if self._rest is None:
            self._rest = RestClient(self.kubeconfig)
        return self._rest

    @property
    def on_test_server(self) -> bool:
        return self.front is not None

    def _front(self) -> HttpFront:
        if self.front is None:
            raise NotOnTestServer(
                "this hook exists only on the test API server (SPOTJOB_TEST_KUBECONFIG names a real cluster)"
            )
        return self.front

    def add_user(self, name: str, groups: tuple[str, ...] = ("system:authenticated",)) -> str:
        """A bearer token for ``name`` (the audit log records requests under that name)."""
        token = secrets.token_urlsafe(24)
        self._front().add_user(name, token, groups)
        return token

    def kubeconfig_for(self, user: str, path: Path | None = None) -> str:
        """A kubeconfig for a new identity, so the audit log can tell its requests apart."""
        token = self.add_user(user)
        target = path or self.root / f"kubeconfig-{user.replace(':', '_')}"
        return str(
            write_kubeconfig(Path(target), self.server_url, token, user, ca_pem=self._tls.ca_pem if self._tls else None)
        )

    def env(self) -> dict[str, str]:
        """The environment a child process (controller, kubectl) needs to reach this cluster."""
        return {"KUBECONFIG": self.kubeconfig, "KUBECACHEDIR": str(self.root / "kube-cache")}

    def client(self) -> Any:
        """A ``kubernetes.client.ApiClient`` from the kubeconfig (the real client, as the controller uses it)."""
        from kubernetes import config

        return config.new_client_from_config(config_file=self.kubeconfig)

    def kubectl(
        self, *args: str, input: str | None = None, check: bool = True, timeout: float = 60
    ) -> subprocess.CompletedProcess[str]:
        binary = shutil.which("kubectl")
        if binary is None:
            raise FileNotFoundError("kubectl is not on PATH")
        env = {**os.environ, **self.env()}
        proc = subprocess.run([binary, *args], input=input, capture_output=True, text=True, env=env, timeout=timeout)
        if check and proc.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
        return proc

    # Nodes -------------------------------------------------------------------------------------
    def add_node(
        self,
        name: str,
        *,
        zone: str = "us-east-1a",
        instance_type: str = "g5.xlarge",
        capacity_type: str | None = "spot",
        labels: dict[str, str] | None = None,
        taints: list[dict[str, Any]] | None = None,
        cpu: str = "8",
        memory: str = "32Gi",
        gpus: int = 0,
        pods: int = 110,
        provider_id: str | None = None,
        run_containers: bool = True,
    ) -> dict[str, Any]:
        """A Ready test node. ``capacity_type`` sets the Karpenter, EKS and GKE capacity labels
        (``spot``/``on-demand``); ``provider_id`` defaults to ``aws:///<zone>/i-<random>``."""
        all_labels = {
            "topology.kubernetes.io/zone": zone,
            "topology.kubernetes.io/region": zone[:-1] if zone[-1:].isalpha() else zone,
            "node.kubernetes.io/instance-type": instance_type,
        }
        if capacity_type:
            all_labels["karpenter.sh/capacity-type"] = capacity_type
            all_labels["eks.amazonaws.com/capacityType"] = capacity_type.upper().replace("-", "_")
            if capacity_type == "spot":
                all_labels["cloud.google.com/gke-spot"] = "true"
        all_labels.update(labels or {})
        capacity = {"cpu": cpu, "memory": memory, "pods": str(pods)}
        if gpus:
            capacity["nvidia.com/gpu"] = str(gpus)
        config = NodeConfig(
            name=name,
            labels=all_labels,
            taints=list(taints or []),
            capacity=capacity,
            provider_id=provider_id or f"aws:///{zone}/i-{secrets.token_hex(8)}",
            run_containers=run_containers,
        )
        assert self.kubelet is not None
        return self.kubelet.add_node(config)

    def node(self, name: str) -> dict[str, Any]:
        node: dict[str, Any] = self.rest.get(f"/api/v1/nodes/{name}")
        return node

    def taint_node(self, name: str, key: str, value: str = "", effect: str = "NoSchedule") -> None:
        """Add a taint through the API, as NTH, Karpenter or GKE do."""
        for _ in range(10):
            node = self.node(name)
            taints = [t for t in node["spec"].get("taints") or [] if not (t["key"] == key and t["effect"] == effect)]
            taint: dict[str, Any] = {"key": key, "effect": effect}
            if value:
                taint["value"] = value
            if effect == "NoExecute":
                taint["timeAdded"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
            node["spec"]["taints"] = [*taints, taint]
            try:
                self.rest.request("PUT", f"/api/v1/nodes/{name}", node)
                return
            except ApiCallError as e:
                if e.status != 409:
                    raise
        raise RuntimeError(f"could not taint node {name}: too many conflicts")

    def untaint_node(self, name: str, key: str) -> None:
        for _ in range(10):
            node = self.node(name)
            node["spec"]["taints"] = [t for t in node["spec"].get("taints") or [] if t["key"] != key]
            try:
                self.rest.request("PUT", f"/api/v1/nodes/{name}", node)
                return
            except ApiCallError as e:
                if e.status != 409:
                    raise
        raise RuntimeError(f"could not untaint node {name}: too many conflicts")

    def set_node_ready(
        self,
        name: str,
        status: str = "False",
        reason: str = "KubeletNotReady",
        message: str = "container runtime is down",
    ) -> None:
        """The kubelet reports Ready=``status`` (False: the node controller taints it not-ready)."""
        assert self.kubelet is not None
        self.kubelet.set_ready(name, status, reason, message)

    def stop_heartbeats(self, name: str) -> None:
        """The node stops renewing its Lease; after the grace the node controller says Unknown."""
        assert self.kubelet is not None
        self.kubelet.stop_heartbeats(name)

    def resume_heartbeats(self, name: str) -> None:
        assert self.kubelet is not None
        self.kubelet.resume_heartbeats(name)

    def partition_node(self, name: str) -> None:
        """The node's kubelet loses the API server; its processes keep running (zombies)."""
        assert self.kubelet is not None
        self.kubelet.partition(name)

    def heal_node(self, name: str) -> None:
        assert self.kubelet is not None
        self.kubelet.heal(name)

    def delete_node(self, name: str) -> None:
        """The VM is reclaimed: its processes die at once and its Node is deleted."""
        assert self.kubelet is not None
        self.kubelet.delete_node(name)

    def node_names(self) -> list[str]:
        assert self.kubelet is not None
        return list(self.kubelet.nodes)

    # Pods --------------------------------------------------------------------------------------
    def worker(self, namespace: str, name: str) -> PodWorker | None:
        assert self.kubelet is not None
        for w in self.kubelet.workers():
            if w.namespace == namespace and w.name == name:
                return w
        return None

    def pod_pids(self, namespace: str, name: str) -> list[int]:
        """Pids of the pod's processes (all descendants, whatever session they started)."""
        w = self.worker(namespace, name)
        return w.pids() if w else []

    def leftover_processes(self) -> list[int]:
        """Pids of pods' processes still running; none may be left once ``stop()`` has returned."""
        return self.kubelet.leftover_processes() if self.kubelet is not None else []

    def pod_log(self, namespace: str, name: str, container: str) -> str:
        assert self.kubelet is not None
        for path in (self.kubelet.root / "nodes").glob(f"*/pods/{namespace}_{name}_*/logs/{container}.log"):
            return path.read_text(errors="replace")
        return ""

    # Test hooks (test API server only) -----------------------------------------------------------
    def audit_log(self, since: int = 0) -> list[AuditRecord]:
        return self._front().audit_records(since)

    def audit_mark(self) -> int:
        """The sequence number the next request will get: ``audit_log(since=mark)``."""
        return len(self._front().audit)

    def add_fault(self, fault: Fault) -> Fault:
        return self._front().add_fault(fault)

    def clear_faults(self) -> None:
        if self.front is not None:
            self.front.clear_faults()

    def drop_watches(self, resource: str = "") -> int:
        return self._front().drop_watches(resource)

    def expire_watch_history(self) -> None:
        front = self._front()
        front.api.store.expire_history()

    def expire_watch_history_and_drop_watches(self, resource: str = "", namespace: str | None = None) -> int:
        """In one step, as no client can observe in between: a write elsewhere (etcd's revision is
        global), the history expired, and every open watch (of ``resource``) cut. Every version a
        client has seen, bookmarks included, is then older than the server keeps: its next watch is
        told 410 Gone. Returns how many watches were cut: with none open, nothing is done (a
        caller that repeats this until it cuts one must not expire the history under a client that
        is between reading a version and watching from it: that client would be told 410 on every
        try)."""
        front = self._front()
        store = front.api.store
        with store.lock:
            if not front.open_watches(resource, namespace):
                return 0
            store.next_rv()
            store.expire_history()
            return front.drop_watches(resource, namespace)

    @property
    def validation_failures(self) -> list[ValidationFailure]:
        return self._front().api.validation_failures

    # Waiting -----------------------------------------------------------------------------------
    @staticmethod
    def wait_for(check: Callable[[], T], timeout: float = 30.0, what: str = "condition", interval: float = 0.05) -> T:
        """Poll ``check`` until it returns something truthy; fail naming ``what`` after ``timeout``."""
        deadline = time.monotonic() + timeout
        last: Any = None
        while True:
            with contextlib.suppress(ApiCallError):
                last = check()
                if last:
                    return last
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what} (last: {last!r})")
            time.sleep(interval)


def python() -> str:
    return sys.executable


def iter_pids(cluster: TestCluster) -> Iterator[int]:
    assert cluster.kubelet is not None
    for w in cluster.kubelet.workers():
        yield from w.pids()
