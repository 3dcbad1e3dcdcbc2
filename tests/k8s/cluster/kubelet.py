"""The test kubelet: test nodes whose pods run as local process trees on loopback pod IPs.

One ``Kubelet`` plays many nodes (like kubemark's hollow nodes) and talks to the API server only
through a kubeconfig, so it serves the test API server and a real one alike. Per node it registers
the Node, renews its Lease in ``kube-node-lease`` (the heartbeat) and posts status; per bound pod it
runs a worker that starts the containers' ``command`` + ``args`` as process trees (images are
ignored: the processes run with this machine's Python, the venv's bin first on PATH), each in a
session of its own with ``SPOTJOB_TEST_POD_UID`` in its environment so every descendant is found
and killed, even torchrun's ranks that start sessions of their own.

Containers see no filesystem of their own. Each volume is a host folder, and every occurrence of a
volumeMount's ``mountPath`` in the container's command, args, env values and workingDir is
rewritten to that folder: the mountPath is replaced where it stands as a whole path prefix (not
preceded by a letter, digit, ``.``, ``_``, ``-`` or ``/``; followed by ``/``, the end of the string
or any other character that cannot continue a path segment); longer mountPaths are rewritten first.
A path a process builds at run time from other pieces is not rewritten.

Init containers run one after the other before the regular ones; with ``restartPolicy: Never`` a
failed one fails the pod. Native sidecars (init containers with ``restartPolicy: Always``,
Kubernetes 1.29+) are modeled as the kubelet documents them: the next container starts once the
sidecar has started (no startup probes), it is restarted whatever the pod's policy, its readiness
counts towards the pod's, it does not decide the pod's phase, and it is stopped (reverse order,
preStop hook first) once every regular container has exited, both when they end by themselves and
when the pod is deleted (SIGTERM to the regular containers first, to the sidecars once those exited,
all within one grace period). Not modeled: image pulls (no ErrImagePull), startup probes, in-place
restarts of a sidecar during termination.

Node events tests drive: taints go through the API (as NTH, Karpenter or GKE would do it);
``set_ready`` posts Ready=False/True; ``stop_heartbeats`` lets the node controller declare it
Unknown; ``partition`` stops all of the node's API traffic while its processes run on (a zombie);
``delete_node`` kills its processes at once and deletes the Node, like a reclaimed VM.
"""

from __future__ import annotations

import base64
import contextlib
import copy
import datetime
import logging
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agent.process_tree import ProcInfo, marked, signal_process, stop_processes

from .client import ApiCallError, RestClient
from .selectors import dig

log = logging.getLogger(__name__)

MARKER = "SPOTJOB_TEST_POD_UID"
CONTAINER_MARKER = "SPOTJOB_TEST_CONTAINER"
LEASES = "/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases"
Obj = dict[str, Any]

# The environment a container gets from the node (besides its own env): a real container starts
# from its image's environment, not the kubelet's.
_NODE_ENV = ("HOME", "LANG", "LC_ALL", "TZ", "TMPDIR", "USER", "SYSTEMROOT")


def now_rfc3339() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def now_micro() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def processes_with(marker: str) -> list[int]:
    """Pids whose environment holds ``marker`` (``NAME=value``), found through /proc."""
    needle = marker.encode() + b"\0"
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = f.read()
        except OSError:
            continue
        if needle in env or env.endswith(needle[:-1]):
            out.append(int(entry))
    return out


def _marked(marker: str) -> list[ProcInfo]:
    name, _, value = marker.partition("=")
    return marked(name, value)


def kill_all(marker: str, sig: int) -> int:
    """Send ``sig`` once to every process carrying ``marker`` (``NAME=value``); how many got it."""
    n = 0
    for p in _marked(marker):
        with contextlib.suppress(PermissionError):
            n += signal_process(p, sig)
    return n


def _running(pid: int) -> bool:
    """Whether ``pid`` still runs: a zombie (exited, not yet reaped) or a vanished pid does not."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    state = stat[stat.rfind(b")") + 2 : stat.rfind(b")") + 3]  # the field after "(comm)"
    return state not in (b"Z", b"X", b"x", b"")


def kill_and_wait(marker: str, timeout: float = 10.0) -> bool:
    """SIGKILL every process carrying ``marker`` and wait until each has exited (a zombie or gone),
    as a container runtime reports a container stopped only once its processes are. A SIGKILLed
    process takes a moment to exit, longer on a loaded machine; one that appears meanwhile (a fork
    in flight) is killed too. False if some still ran after ``timeout`` seconds. The product's own
    way of stopping every process of a node (``agent.process_tree.stop_processes``)."""
    stop_processes(lambda: _marked(marker), grace=0, reason=f"test kubelet: {marker}", give_up=timeout, verbose=False)
    return not _marked(marker)


def claim_loopback_block() -> tuple[socket.socket, int]:
    """A second octet ``N`` of 127.N.x.y that no other test kubelet on this machine uses, for
    its host and pod IPs. The claim is a socket bound to 127.N.0.1:10250 (the kubelet's port, an
    address no pod gets): the kernel refuses a second bind, whichever process asks, and frees it
    when the kubelet stops or its process dies. A random pick alone let two clusters (two test
    sessions at once, or two clusters in one session) share pod IPs now and then."""
    octets = list(range(64, 251))
    random.SystemRandom().shuffle(octets)
    for octet in octets:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.bind((f"127.{octet}.0.1", 10250))
        except OSError:
            sock.close()
            continue
        return sock, octet
    raise RuntimeError("every loopback block 127.64-250.x.y is taken by other test kubelets")


def rewrite_paths(value: str, mounts: list[tuple[str, str]]) -> str:
    """Replace each mountPath standing as a whole path prefix with its host folder."""
    for mount_path, host in mounts:
        mp = mount_path.rstrip("/") or "/"
        pattern = re.compile(r"(?<![\w./-])" + re.escape(mp) + r"(?=/|$|[^\w.-])")
        value = pattern.sub(host.replace("\\", "\\\\"), value)
    return value


def expand_vars(value: str, env: dict[str, str]) -> str:
    """Kubernetes' ``$(VAR)`` expansion; ``$$(VAR)`` stays literal, unknown names stay as written."""

    def sub(m: re.Match[str]) -> str:
        if m.group(0).startswith("$$"):
            return m.group(0)[1:]
        return env.get(m.group(1), m.group(0))

    return re.sub(r"\$?\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)", sub, value)


@dataclass
class NodeConfig:
    name: str
    labels: dict[str, str] = field(default_factory=dict)
    taints: list[dict[str, Any]] = field(default_factory=list)
    capacity: dict[str, str] = field(default_factory=dict)
    provider_id: str = ""
    run_containers: bool = True  # False: pods go Running without processes (scale benchmarks)


class ConfigError(Exception):
    """A pod the kubelet cannot start yet (missing Secret, unsupported volume): CreateContainerConfigError."""


@dataclass
class ContainerRun:
    name: str
    spec: Obj
    proc: subprocess.Popen[bytes] | None = None
    started_at: str = ""
    restarts: int = 0
    last_exit: Obj | None = None
    terminated: Obj | None = None  # final state (no restart pending)
    waiting: tuple[str, str] | None = ("ContainerCreating", "")
    ready: bool = False
    probe_ok: int = 0
    probe_fail: int = 0
    live_fail: int = 0
    next_probe: float = 0.0
    next_live: float = 0.0
    restart_at: float = 0.0
    backoff: float = 0.0

    @property
    def sidecar(self) -> bool:
        """A native sidecar: an init container with ``restartPolicy: Always`` (Kubernetes 1.29+)."""
        return self.spec.get("restartPolicy") == "Always"


class Node:
    def __init__(self, kubelet: Kubelet, config: NodeConfig, host_ip: str) -> None:
        self.kubelet = kubelet
        self.config = config
        self.name = config.name
        self.host_ip = host_ip
        self.partitioned = False
        self.heartbeats = True
        self.deleted = False
        self.dir = kubelet.root / "nodes" / config.name
        self.dir.mkdir(parents=True, exist_ok=True)
        self.pods: dict[str, PodWorker] = {}  # by pod uid
        self.uid = ""  # the Node object's uid, which its Lease names as owner
        self.lease: Obj | None = None  # the Lease as last written: a renewal is one PUT, as client-go's
        # The Ready condition this kubelet reports: set_ready changes it, every status post repeats it.
        self.ready: tuple[str, str, str] = ("True", "KubeletReady", "kubelet is posting ready status")
        # Serialises the node's own API writes (Lease, status) and its state flags: the heartbeat
        # thread and a test's call (add_node, set_ready, partition, heal, delete) never interleave
        # their read-modify-writes, and once such a call returns no older write is still in flight.
        self.lock = threading.RLock()


class Kubelet:
    """Runs test nodes against the API server a kubeconfig names."""

    def __init__(
        self,
        kubeconfig: str,
        root: Path,
        *,
        heartbeat_interval: float = 0.5,
        status_interval: float = 10.0,
        restart_backoff: tuple[float, float] = (0.2, 5.0),
        sync_period: float = 0.1,
        extra_env: dict[str, str] | None = None,
        venv_bin: str | None = None,
    ) -> None:
        self.api = RestClient(kubeconfig)
        self.root = root
        self.heartbeat_interval = heartbeat_interval
        self.status_interval = status_interval
        self.restart_backoff = restart_backoff
        self.sync_period = sync_period
        self.extra_env = dict(extra_env or {})
        self.venv_bin = venv_bin or str(Path(sys.executable).parent)
        self.nodes: dict[str, Node] = {}
        self._lock = threading.RLock()
        self._stop = threading.Event()
        # Loopback addresses for this kubelet: a second octet of its own keeps parallel clusters apart.
        self._claim, self._octet = claim_loopback_block()
        self._next_pod_ip = 0
        self._next_host_ip = 0
        self._threads: list[threading.Thread] = []
        self._pods: dict[str, Obj] = {}  # latest pod object by uid, from the watch
        self._ran: set[str] = set()  # uid of every pod this kubelet ran, for leftover_processes()

    # Lifecycle ---------------------------------------------------------------------------------
    def start(self) -> None:
        for target, name in ((self._heartbeat_loop, "heartbeats"), (self._watch_loop, "pod-watch")):
            t = threading.Thread(target=target, name=f"test-kubelet-{name}", daemon=True)
            t.start()
            self._threads.append(t)

    def stop(self) -> None:
        """Stop every node: kill all pod processes at once (the test session is over)."""
        self._stop.set()  # before taking the list: _on_pod starts no worker once it is set
        with self._lock:
            workers = [w for n in self.nodes.values() for w in n.pods.values()]
        for w in workers:
            w.halt(kill=True)
        for t in self._threads:
            t.join(timeout=5)
        self._claim.close()

    def _pod_ip(self) -> str:
        with self._lock:
            n = self._next_pod_ip
            self._next_pod_ip += 1
        return f"127.{self._octet}.{1 + n // 250}.{2 + n % 250}"

    def _host_ip(self) -> str:
        with self._lock:
            n = self._next_host_ip
            self._next_host_ip += 1
        return f"127.{self._octet}.0.{2 + n}"

    # Nodes -------------------------------------------------------------------------------------
    def add_node(self, config: NodeConfig) -> Obj:
        """Register a Node (as a kubelet does on start) and start its heartbeat."""
        host_ip = self._host_ip()
        node = Node(self, config, host_ip)
        capacity = {"cpu": "8", "memory": "32Gi", "pods": "110", "ephemeral-storage": "100Gi", **config.capacity}
        labels = {
            "kubernetes.io/hostname": config.name,
            "kubernetes.io/os": "linux",
            "kubernetes.io/arch": "amd64",
            **config.labels,
        }
        body: Obj = {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {"name": config.name, "labels": labels},
            "spec": {},
        }
        if config.provider_id:
            body["spec"]["providerID"] = config.provider_id
        if config.taints:
            body["spec"]["taints"] = config.taints
        created = self.api.request("POST", "/api/v1/nodes", body)
        node.uid = created["metadata"]["uid"]
        status = {
            "capacity": capacity,
            "allocatable": capacity,
            "conditions": self._conditions(*node.ready),
            "addresses": [{"type": "InternalIP", "address": host_ip}, {"type": "Hostname", "address": config.name}],
            "daemonEndpoints": {"kubeletEndpoint": {"Port": 10250}},
            "nodeInfo": {
                "machineID": config.name,
                "systemUUID": config.name,
                "bootID": config.name,
                "kernelVersion": os.uname().release,
                "osImage": "spotjob test kubelet",
                "containerRuntimeVersion": "local-process://1",
                "kubeletVersion": "v1.32.0",
                "kubeProxyVersion": "v1.32.0",
                "operatingSystem": "linux",
                "architecture": "amd64",
            },
        }
        # Pods may bind to the node from now on, so the pod watch must know it at once; the
        # heartbeat thread sees it too, but writes for it only after the node's lock is released.
        with node.lock:
            with self._lock:
                self.nodes[config.name] = node
            self.api.request(
                "PATCH",
                f"/api/v1/nodes/{config.name}/status",
                {"status": status},
                content_type="application/merge-patch+json",
            )
            self._renew_lease(node)
        return created

    @staticmethod
    def _conditions(ready: str, reason: str, message: str) -> list[Obj]:
        now = now_rfc3339()
        conds = [
            {
                "type": t,
                "status": "False",
                "reason": f"KubeletHas{r}",
                "message": f"kubelet has {m}",
                "lastHeartbeatTime": now,
                "lastTransitionTime": now,
            }
            for t, r, m in (
                ("MemoryPressure", "SufficientMemory", "sufficient memory available"),
                ("DiskPressure", "NoDiskPressure", "no disk pressure"),
                ("PIDPressure", "SufficientPID", "sufficient PID available"),
            )
        ]
        conds.append(
            {
                "type": "Ready",
                "status": ready,
                "reason": reason,
                "message": message,
                "lastHeartbeatTime": now,
                "lastTransitionTime": now,
            }
        )
        return conds

    def set_ready(
        self,
        name: str,
        status: str = "False",
        reason: str = "KubeletNotReady",
        message: str = "container runtime is down",
    ) -> None:
        """Report the node's Ready condition from now on (``False`` makes the node controller taint
        it not-ready). The kubelet stays alive: its Lease is still renewed, as a real kubelet whose
        container runtime is down renews it; ``stop_heartbeats`` is the kubelet that is gone.
        ``True`` also resumes stopped heartbeats."""
        node = self.nodes[name]
        if status == "True":
            reason, message = "KubeletReady", "kubelet is posting ready status"
        with node.lock:
            node.ready = (status, reason, message)
            if status == "True":
                node.heartbeats = True
            self._post_ready(node, self._conditions(status, reason, message))

    def _post_ready(self, node: Node, conditions: list[Obj]) -> None:
        self.api.request(
            "PATCH",
            f"/api/v1/nodes/{node.name}/status",
            {"status": {"conditions": conditions}},
            content_type="application/strategic-merge-patch+json",
        )

    def stop_heartbeats(self, name: str) -> None:
        node = self.nodes[name]
        with node.lock:  # a renewal in flight ends first: none follows this call
            node.heartbeats = False

    def resume_heartbeats(self, name: str) -> None:
        node = self.nodes[name]
        with node.lock:
            node.heartbeats = True
            self._renew_lease(node)
            self.set_ready(name, "True")

    def partition(self, name: str) -> None:
        """Cut the node off the API server: no heartbeats, no status, no pod updates; its
        processes keep running."""
        node = self.nodes[name]
        with node.lock:
            node.partitioned = True
        log.info("test kubelet: node %s partitioned", name)

    def heal(self, name: str) -> None:
        """Reconnect: pods deleted meanwhile are killed, the others report status again."""
        node = self.nodes[name]
        with node.lock:
            node.partitioned = False
            self._renew_lease(node)
            self.set_ready(name, "True")
        pods = self.api.get("/api/v1/pods", fieldSelector=f"spec.nodeName={name}")["items"]
        alive = {p["metadata"]["uid"] for p in pods}
        for uid, worker in list(node.pods.items()):
            if uid not in alive:
                worker.halt(kill=True)
                node.pods.pop(uid, None)
        for p in pods:
            self._on_pod(p)

    def delete_node(self, name: str) -> None:
        """The VM is gone: its processes die at once, then the Node object is deleted."""
        with self._lock:  # from here on the pod watch starts no worker on the node
            node = self.nodes.pop(name)
        with node.lock:  # a heartbeat in flight ends first; none follows
            node.deleted = True
        for worker in list(node.pods.values()):
            worker.halt(kill=True)
        with contextlib.suppress(ApiCallError):
            self.api.request(
                "DELETE",
                f"/api/v1/nodes/{name}",
                {"apiVersion": "v1", "kind": "DeleteOptions", "preconditions": {"uid": node.uid}},
            )
        log.info("test kubelet: node %s deleted", name)

    def _renew_lease(self, node: Node) -> None:
        """Create or renew the node's Lease in ``kube-node-lease``, owned by its Node.

        A read-modify-write that others may interleave with: the garbage collector deletes the
        Lease of an earlier node of the same name (its owner is gone), a test or controller may
        write it. So a Lease that vanished (404 on the PUT), was created meanwhile (409 on the
        POST) or changed (409 on the PUT) is read again and the write retried, as client-go's
        lease controller does; an earlier node's Lease is taken over (its owner reference becomes
        this Node). Our own writers are serialised by the node's lock."""
        path = f"{LEASES}/{node.name}"
        owner = {"apiVersion": "v1", "kind": "Node", "name": node.name, "uid": node.uid}
        last: ApiCallError | None = None
        with node.lock:
            for _ in range(10):
                if node.deleted:
                    return
                try:
                    lease = node.lease if node.lease is not None else self.api.get(path)
                    node.lease = None  # read again if this write fails
                except ApiCallError as e:
                    if e.status != 404:
                        raise
                    body = {
                        "apiVersion": "coordination.k8s.io/v1",
                        "kind": "Lease",
                        "metadata": {"name": node.name, "namespace": "kube-node-lease", "ownerReferences": [owner]},
                        "spec": {"holderIdentity": node.name, "leaseDurationSeconds": 40, "renewTime": now_micro()},
                    }
                    try:
                        node.lease = self.api.request("POST", LEASES, body)
                        return
                    except ApiCallError as e:
                        if e.status != 409:
                            raise
                        last = e
                        continue
                refs = lease["metadata"].get("ownerReferences") or []
                if [r.get("uid") for r in refs] != [node.uid]:
                    lease["metadata"]["ownerReferences"] = [owner]
                lease["spec"]["holderIdentity"] = node.name
                lease["spec"]["renewTime"] = now_micro()
                try:
                    node.lease = self.api.request("PUT", path, lease)
                    return
                except ApiCallError as e:
                    if e.status not in (404, 409):
                        raise
                    last = e
        raise RuntimeError(f"the Lease of node {node.name} changed under every one of 10 renewals; last: {last}")

    def _heartbeat_loop(self) -> None:
        last_status: dict[str, float] = {}
        while not self._stop.wait(self.heartbeat_interval):
            with self._lock:
                nodes = list(self.nodes.values())
            for node in nodes:
                if self._stop.is_set():
                    return
                with node.lock:
                    if node.partitioned or not node.heartbeats or node.deleted:
                        continue
                    try:
                        self._renew_lease(node)
                        if time.monotonic() - last_status.get(node.name, 0) > self.status_interval:
                            last_status[node.name] = time.monotonic()
                            status, reason, message = node.ready
                            ready = {"type": "Ready", "status": status, "reason": reason, "message": message}
                            self._post_ready(node, [{**ready, "lastHeartbeatTime": now_rfc3339()}])
                    except Exception as e:  # the next beat tries again; the thread must not die
                        log.debug("test kubelet: heartbeat of %s failed: %s", node.name, e)

    # Pods --------------------------------------------------------------------------------------
    def _watch_loop(self) -> None:
        rv = ""
        while not self._stop.is_set():
            try:
                if not rv:
                    listing = self.api.get("/api/v1/pods", fieldSelector="spec.nodeName!=")
                    rv = listing["metadata"]["resourceVersion"]
                    seen = set()
                    for p in listing["items"]:
                        seen.add(p["metadata"]["uid"])
                        self._on_pod(p)
                    for node in list(self.nodes.values()):
                        for uid in list(node.pods):
                            if uid not in seen and not node.partitioned:
                                self._on_gone(node, uid)
                for ev in self.api.watch("/api/v1/pods", rv, timeout_seconds=30, fieldSelector="spec.nodeName!="):
                    if self._stop.is_set():
                        return
                    obj = ev["object"]
                    if ev["type"] == "ERROR":
                        rv = ""
                        break
                    rv = obj["metadata"]["resourceVersion"]
                    if ev["type"] == "BOOKMARK":
                        continue
                    if ev["type"] == "DELETED":
                        owner = self.nodes.get(dig(obj, "spec", "nodeName") or "")
                        if owner is not None and not owner.partitioned:
                            self._on_gone(owner, obj["metadata"]["uid"])
                    else:
                        self._on_pod(obj)
            except Exception as e:
                if self._stop.is_set():
                    return
                log.debug("test kubelet: pod watch broke (%s); re-listing", e)
                rv = ""
                time.sleep(0.2)

    def _on_pod(self, pod: Obj) -> None:
        uid = pod["metadata"]["uid"]
        with self._lock:  # delete_node and stop() take the lock too: no worker starts after them
            node = self.nodes.get(dig(pod, "spec", "nodeName") or "")
            if node is None or node.partitioned or node.deleted or self._stop.is_set():
                return
            worker = node.pods.get(uid)
            if worker is None:
                if (
                    dig(pod, "status", "phase") in ("Succeeded", "Failed")
                    and pod["metadata"].get("deletionTimestamp") is None
                ):
                    return
                worker = PodWorker(self, node, pod)
                node.pods[uid] = worker
                self._ran.add(uid)
                worker.start()
            else:
                worker.update(pod)

    def _on_gone(self, node: Node, uid: str) -> None:
        worker = node.pods.pop(uid, None)
        if worker is not None:
            worker.halt(kill=True)

    def workers(self) -> list[PodWorker]:
        with self._lock:
            return [w for n in self.nodes.values() for w in n.pods.values()]

    def leftover_processes(self) -> list[int]:
        """Pids still running of any pod this kubelet ran: after ``stop()`` there must be none."""
        with self._lock:
            uids = set(self._ran)
        prefix = MARKER.encode() + b"="
        found = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    env = f.read()
            except OSError:
                continue
            for var in env.split(b"\0"):
                if var.startswith(prefix) and var[len(prefix) :].decode(errors="replace") in uids:
                    if _running(int(entry)):
                        found.append(int(entry))
                    break
        return sorted(found)


class PodWorker:
    """Runs one pod: volumes, containers, probes, restarts, status, and its termination."""

    def __init__(self, kubelet: Kubelet, node: Node, pod: Obj) -> None:
        self.kubelet = kubelet
        self.node = node
        self.pod = pod
        md = pod["metadata"]
        self.uid = md["uid"]
        self.namespace = md["namespace"]
        self.name = md["name"]
        self.ip = kubelet._pod_ip()
        self.dir = node.dir / "pods" / f"{self.namespace}_{self.name}_{self.uid[:8]}"
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / "logs").mkdir(exist_ok=True)
        self.start_time = now_rfc3339()
        spec = pod.get("spec") or {}
        self.init = [ContainerRun(c["name"], c) for c in spec.get("initContainers") or []]
        self.containers = [ContainerRun(c["name"], c) for c in spec.get("containers") or []]
        self.init_done = not self.init
        self.config_error = ""
        self.mounts: list[tuple[str, str]] = []
        self.volumes: dict[str, str] = {}
        self.terminating = False
        self.finished = False
        self.halted = False
        self._lock = threading.Lock()
        # Held while a process starts, so that once halt() has it no new process can appear.
        self._spawn_lock = threading.Lock()
        # Set when the pod object changes: a worker on a node without containers has nothing to
        # poll (no process, no probe), so it sleeps until then instead of every sync period.
        self._changed = threading.Event()
        self._last_status: Obj | None = None
        self._thread = threading.Thread(target=self._run, name=f"test-pod-{self.name}", daemon=True)

    @property
    def marker(self) -> str:
        return f"{MARKER}={self.uid}"

    def start(self) -> None:
        self._thread.start()

    def update(self, pod: Obj) -> None:
        with self._lock:
            self.pod = pod
        self._changed.set()

    def pids(self) -> list[int]:
        return processes_with(self.marker)

    def halt(self, kill: bool) -> None:
        """Stop managing the pod; ``kill`` SIGKILLs its processes now (a node gone, a force delete)
        and returns once they have exited."""
        with self._spawn_lock:  # a container start in flight in the worker's thread ends first
            self.halted = True
        self._changed.set()
        if kill and self.node.config.run_containers:  # a node without containers has no process to find
            kill_and_wait(self.marker)
            for c in self.init + self.containers:
                proc = c.proc
                if proc is not None:
                    with contextlib.suppress(Exception):
                        proc.wait(timeout=5)

    # The loop ----------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self.halted and not self.kubelet._stop.is_set():
                with self._lock:
                    pod = self.pod
                if pod["metadata"].get("deletionTimestamp") and not self.terminating:
                    self._terminate(pod)
                    return
                if not self.finished:
                    self._sync(pod)
                self._report()
                if self.node.config.run_containers:
                    time.sleep(self.kubelet.sync_period)
                else:  # a failed status write is retried within a second
                    self._changed.wait(1.0)
                    self._changed.clear()
        except Exception:
            log.exception("test kubelet: pod %s/%s worker failed", self.namespace, self.name)

    def _sync(self, pod: Obj) -> None:
        if not self.node.config.run_containers:
            for c in self.containers:
                if c.waiting:
                    c.waiting, c.started_at, c.ready = None, now_rfc3339(), True
            return
        if not self.volumes:
            try:
                self._prepare_volumes(pod)
            except ConfigError as e:
                self._config_error(str(e))
                return
        if not self.init_done:
            self._sync_init(pod)
            return
        for c in self.containers:
            self._sync_container(pod, c, init=False)
        policy = (pod.get("spec") or {}).get("restartPolicy", "Always")
        done = all(c.terminated is not None for c in self.containers) and policy != "Always"
        if not done:
            for c in self.sidecars:  # restarted whatever the pod's policy, until the pod is done
                self._sync_container(pod, c, init=True, policy="Always")
        self._probe(pod)
        if done:
            self._stop_sidecars(pod)
            self.finished = True

    @property
    def sidecars(self) -> list[ContainerRun]:
        return [c for c in self.init if c.sidecar]

    def _stop_sidecars(self, pod: Obj) -> None:
        """Once every regular container has exited, the kubelet stops the native sidecars, in the
        reverse of their order, each with the pod's grace period; their exit codes do not decide
        the pod's phase."""
        grace = float(dig(pod, "spec", "terminationGracePeriodSeconds") or 30)
        for c in reversed(self.sidecars):
            if c.proc is not None:
                self._stop_container(c, grace)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    c.proc.wait(timeout=5)
                code = c.proc.returncode if c.proc.returncode is not None else -9
                c.terminated = self._terminated_state(c, code)
                c.proc = None
            elif c.terminated is None:  # waiting to be restarted: it stays as it last ended
                c.terminated = c.last_exit or self._terminated_state(c, 0)
            c.waiting, c.ready = None, False

    def _config_error(self, message: str) -> None:
        self.config_error = message
        for c in self.init + self.containers:
            if c.proc is None:
                c.waiting = ("CreateContainerConfigError", message)

    def _sync_init(self, pod: Obj) -> None:
        policy = (pod.get("spec") or {}).get("restartPolicy", "Always")
        for c in self.init:
            if c.sidecar:
                # A native sidecar: the next container starts once it has started (startup probes
                # are not modeled); it runs on beside the others.
                self._sync_container(pod, c, init=True, policy="Always")
                if c.proc is None and not c.restarts:
                    return
                continue
            if c.terminated is not None and c.terminated.get("exitCode") == 0:
                continue
            self._sync_container(pod, c, init=True, policy="OnFailure" if policy == "Always" else policy)
            if c.terminated is not None and c.terminated.get("exitCode") != 0 and policy == "Never":
                self._stop_sidecars(pod)  # the pod failed: its sidecars started so far are stopped
                self.finished = True
            return
        self.init_done = True

    def _sync_container(self, pod: Obj, c: ContainerRun, init: bool, policy: str | None = None) -> None:
        policy = policy or (pod.get("spec") or {}).get("restartPolicy", "Always")
        if c.proc is None:
            if c.terminated is not None or time.monotonic() < c.restart_at:
                return
            try:
                self._start_container(pod, c)
                self.config_error = ""
            except ConfigError as e:
                c.waiting = ("CreateContainerConfigError", str(e))
            return
        code = c.proc.poll()
        if code is None:
            return
        # The container's main process exited: kill whatever it left, and let it go before a restart
        # (a leftover child holding the container's port would fail the next start).
        kill_and_wait(f"{CONTAINER_MARKER}={self.uid}/{c.name}")
        state = self._terminated_state(c, code)
        if code < 0:
            state["signal"] = -code
        c.proc = None
        c.ready = False
        c.probe_ok = 0
        restart = policy == "Always" or (policy == "OnFailure" and code != 0)
        if restart and not self.terminating:
            lo, hi = self.kubelet.restart_backoff
            c.backoff = min(hi, c.backoff * 2 if c.backoff else lo)
            c.restart_at = time.monotonic() + c.backoff
            c.last_exit = state
            c.restarts += 1
            c.waiting = (
                "CrashLoopBackOff" if code != 0 else "Completed",
                f"back-off restarting failed container {c.name}",
            )
        else:
            c.terminated = state

    def _terminated_state(self, c: ContainerRun, code: int) -> Obj:
        """A container's ``terminated`` state for a process that ended with Popen's ``code``."""
        return {
            "exitCode": code if code >= 0 else 128 - code,
            "reason": "Completed" if code == 0 else "Error",
            "startedAt": c.started_at,
            "finishedAt": now_rfc3339(),
            "containerID": f"local://{self.uid}/{c.name}/{c.restarts}",
        }

    def _env(self, pod: Obj, spec: Obj) -> dict[str, str]:
        env: dict[str, str] = {k: os.environ[k] for k in _NODE_ENV if k in os.environ}
        env["PATH"] = self.kubelet.venv_bin + os.pathsep + os.environ.get("PATH", "/usr/bin:/bin")
        env.update(self.kubelet.extra_env)
        env["HOSTNAME"] = self.name
        for src in spec.get("envFrom") or []:
            prefix = src.get("prefix", "")
            if "configMapRef" in src:
                data = self._lookup(
                    "configmaps", src["configMapRef"]["name"], optional=src["configMapRef"].get("optional", False)
                )
                env.update({prefix + k: v for k, v in (data.get("data") or {}).items()})
            if "secretRef" in src:
                data = self._lookup(
                    "secrets", src["secretRef"]["name"], optional=src["secretRef"].get("optional", False)
                )
                env.update({prefix + k: base64.b64decode(v).decode() for k, v in (data.get("data") or {}).items()})
        for var in spec.get("env") or []:
            name = var["name"]
            if "value" in var:
                env[name] = expand_vars(str(var["value"]), env)
            elif "valueFrom" in var:
                value = self._value_from(pod, var["valueFrom"])
                if value is not None:
                    env[name] = value
            else:
                env[name] = ""
        for k, v in list(env.items()):
            env[k] = rewrite_paths(v, self.mounts)
        env[MARKER] = self.uid
        env[CONTAINER_MARKER] = f"{self.uid}/{spec['name']}"
        return env

    def _value_from(self, pod: Obj, source: Obj) -> str | None:
        if "fieldRef" in source:
            path = source["fieldRef"]["fieldPath"]
            m = re.match(r"metadata\.(labels|annotations)\['(.+)'\]$", path)
            if m:
                return str((pod["metadata"].get(m.group(1)) or {}).get(m.group(2), ""))
            values = {
                "metadata.name": self.name,
                "metadata.namespace": self.namespace,
                "metadata.uid": self.uid,
                "spec.nodeName": self.node.name,
                "spec.serviceAccountName": dig(pod, "spec", "serviceAccountName") or "",
                "status.podIP": self.ip,
                "status.podIPs": self.ip,
                "status.hostIP": self.node.host_ip,
                "status.hostIPs": self.node.host_ip,
            }
            if path not in values:
                raise ConfigError(f"unsupported fieldRef {path!r}")
            return values[path]
        for kind, key in (("secrets", "secretKeyRef"), ("configmaps", "configMapKeyRef")):
            if key in source:
                ref = source[key]
                obj = self._lookup(kind, ref["name"], optional=ref.get("optional", False))
                data = obj.get("data") or {}
                if ref["key"] not in data:
                    if ref.get("optional"):
                        return None
                    raise ConfigError(
                        f"couldn't find key {ref['key']} in "
                        f"{kind[:-1].replace('configmap', 'ConfigMap').replace('secret', 'Secret')} "
                        f"{self.namespace}/{ref['name']}"
                    )
                return base64.b64decode(data[ref["key"]]).decode() if kind == "secrets" else str(data[ref["key"]])
        if "resourceFieldRef" in source:
            return "0"
        raise ConfigError(f"unsupported valueFrom {sorted(source)}")

    def _lookup(self, kind: str, name: str, optional: bool = False) -> Obj:
        try:
            obj: Obj = self.kubelet.api.get(f"/api/v1/namespaces/{self.namespace}/{kind}/{name}")
            return obj
        except ApiCallError as e:
            if e.status == 404:
                if optional:
                    return {}
                raise ConfigError(f'{kind[:-1].replace("configmap", "configmap")} "{name}" not found') from None
            raise

    def _prepare_volumes(self, pod: Obj) -> None:
        volumes: dict[str, str] = {}
        for v in (pod.get("spec") or {}).get("volumes") or []:
            name = v["name"]
            if "emptyDir" in v:
                path = self.dir / "volumes" / name
                path.mkdir(parents=True, exist_ok=True)
            elif "hostPath" in v:
                # Node-local: a hostPath lives in the node's own folder, kept across its pods.
                path = self.node.dir / "hostpath" / v["hostPath"]["path"].lstrip("/")
                path.mkdir(parents=True, exist_ok=True)
            elif "secret" in v or "configMap" in v or "downwardAPI" in v or "projected" in v:
                path = self.dir / "volumes" / name
                path.mkdir(parents=True, exist_ok=True)
                sources = v["projected"].get("sources", []) if "projected" in v else [v]
                for src in sources:
                    self._materialise(pod, src, path)
            else:
                kind = next((k for k in v if k != "name"), "?")
                raise ConfigError(f"volume {name!r}: {kind} volumes are not modeled by the test kubelet")
            volumes[name] = str(path)
        mounts: list[tuple[str, str]] = []
        spec = pod.get("spec") or {}
        for c in (spec.get("initContainers") or []) + (spec.get("containers") or []):
            for m in c.get("volumeMounts") or []:
                host = volumes[m["name"]]
                if m.get("subPath"):
                    host = str(Path(host) / m["subPath"])
                    Path(host).mkdir(parents=True, exist_ok=True)
                if (m["mountPath"], host) not in mounts:
                    mounts.append((m["mountPath"], host))
        self.mounts = sorted(mounts, key=lambda m: -len(m[0]))
        self.volumes = volumes or {"": ""}

    def _materialise(self, pod: Obj, src: Obj, path: Path) -> None:
        if "secret" in src or "configMap" in src:
            kind, ref = ("secrets", src["secret"]) if "secret" in src else ("configmaps", src["configMap"])
            name = ref.get("secretName") or ref.get("name")
            obj = self._lookup(kind, name, optional=ref.get("optional", False))
            data = {
                k: (base64.b64decode(v) if kind == "secrets" else str(v).encode())
                for k, v in (obj.get("data") or {}).items()
            }
            items = ref.get("items")
            for item in items or [{"key": k, "path": k} for k in data]:
                if item["key"] in data:
                    target = path / item["path"]
                    target.parent.mkdir(parents=True, exist_ok=True)
                    target.write_bytes(data[item["key"]])
        if "downwardAPI" in src:
            for item in src["downwardAPI"].get("items") or []:
                fp = dig(item, "fieldRef", "fieldPath") or ""
                if fp in ("metadata.labels", "metadata.annotations"):
                    values = pod["metadata"].get(fp.split(".")[1]) or {}
                    text = "\n".join(f'{k}="{v}"' for k, v in sorted(values.items()))
                else:
                    text = self._value_from(pod, {"fieldRef": {"fieldPath": fp}}) or ""
                target = path / item["path"]
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_text(text)

    def _start_container(self, pod: Obj, c: ContainerRun) -> None:
        spec = c.spec
        argv = list(spec.get("command") or []) + list(spec.get("args") or [])
        if not spec.get("command"):
            raise ConfigError("the test kubelet runs no images: the container must set command")
        env = self._env(pod, spec)
        argv = [rewrite_paths(expand_vars(a, env), self.mounts) for a in argv]
        cwd = rewrite_paths(spec["workingDir"], self.mounts) if spec.get("workingDir") else str(self.dir)
        Path(cwd).mkdir(parents=True, exist_ok=True)
        logf = open(self.dir / "logs" / f"{c.name}.log", "ab")  # noqa: SIM115 - handed to the child
        try:
            with self._spawn_lock:
                if self.halted:  # halted while we prepared: a process started now would be left behind
                    return
                c.proc = subprocess.Popen(
                    argv,
                    env=env,
                    cwd=cwd,
                    stdout=logf,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,
                )
        except OSError as e:
            c.waiting = ("RunContainerError", str(e))
            c.restart_at = time.monotonic() + 1.0
            return
        finally:
            logf.close()
        c.started_at = now_rfc3339()
        c.waiting = None
        c.ready = not spec.get("readinessProbe")
        delay = float((spec.get("readinessProbe") or {}).get("initialDelaySeconds", 0))
        c.next_probe = time.monotonic() + delay
        c.next_live = time.monotonic() + float((spec.get("livenessProbe") or {}).get("initialDelaySeconds", 0))
        log.info(
            "test kubelet: started %s/%s container %s (pid %d) on %s at %s",
            self.namespace,
            self.name,
            c.name,
            c.proc.pid,
            self.node.name,
            self.ip,
        )

    # Probes --------------------------------------------------------------------------------------
    def _probe(self, pod: Obj) -> None:
        now = time.monotonic()
        for c in self.containers + self.sidecars:
            if c.proc is None:
                continue
            rp = c.spec.get("readinessProbe")
            if rp and now >= c.next_probe:
                c.next_probe = now + float(rp.get("periodSeconds", 10))
                if self._run_probe(pod, c, rp):
                    c.probe_ok += 1
                    c.probe_fail = 0
                    if c.probe_ok >= int(rp.get("successThreshold", 1)):
                        c.ready = True
                else:
                    c.probe_fail += 1
                    c.probe_ok = 0
                    if c.probe_fail >= int(rp.get("failureThreshold", 3)):
                        c.ready = False
            lp = c.spec.get("livenessProbe")
            if lp and now >= c.next_live:
                c.next_live = now + float(lp.get("periodSeconds", 10))
                if self._run_probe(pod, c, lp):
                    c.live_fail = 0
                else:
                    c.live_fail += 1
                    if c.live_fail >= int(lp.get("failureThreshold", 3)):
                        log.info(
                            "test kubelet: %s/%s container %s failed its liveness probe; restarting",
                            self.namespace,
                            self.name,
                            c.name,
                        )
                        c.live_fail = 0
                        self._stop_container(
                            c,
                            float(
                                lp.get("terminationGracePeriodSeconds")
                                or dig(pod, "spec", "terminationGracePeriodSeconds")
                                or 30
                            ),
                        )

    def _run_probe(self, pod: Obj, c: ContainerRun, probe: Obj) -> bool:
        timeout = float(probe.get("timeoutSeconds", 1))
        if "httpGet" in probe:
            hg = probe["httpGet"]
            port = self._port(c, hg.get("port"))
            url = f"{hg.get('scheme', 'HTTP').lower()}://{hg.get('host') or self.ip}:{port}{hg.get('path', '/')}"
            req = urllib.request.Request(url, headers={h["name"]: h["value"] for h in hg.get("httpHeaders") or []})
            try:
                with urllib.request.urlopen(req, timeout=timeout) as r:
                    return 200 <= r.status < 400
            except Exception:
                return False
        if "tcpSocket" in probe:
            try:
                with socket.create_connection(
                    (probe["tcpSocket"].get("host") or self.ip, self._port(c, probe["tcpSocket"].get("port"))),
                    timeout=timeout,
                ):
                    return True
            except OSError:
                return False
        if "exec" in probe:
            env = self._env(pod, c.spec)
            argv = [rewrite_paths(a, self.mounts) for a in probe["exec"].get("command") or []]
            return self._exec(argv, env, timeout) == 0
        return True

    def _exec(self, argv: list[str], env: dict[str, str], timeout: float) -> int | None:
        """Run a probe's or hook's command in the pod (its exit code; None if it could not run or
        timed out). Started under the spawn lock like a container, so a halted pod starts none."""
        with self._spawn_lock:
            if self.halted:
                return None
            try:
                proc = subprocess.Popen(
                    argv,
                    env=env,
                    cwd=str(self.dir),
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            except OSError:
                return None
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            return None

    @staticmethod
    def _port(c: ContainerRun, port: Any) -> int:
        if isinstance(port, str) and not port.isdigit():
            for p in c.spec.get("ports") or []:
                if p.get("name") == port:
                    return int(p["containerPort"])
            raise ValueError(f"no port named {port!r}")
        return int(port)

    def _stop_container(self, c: ContainerRun, grace: float) -> None:
        marker = f"{CONTAINER_MARKER}={self.uid}/{c.name}"
        stop_processes(lambda: _marked(marker), grace=grace, reason=f"test kubelet: stopping {marker}", verbose=False)

    # Termination -------------------------------------------------------------------------------
    def _terminate(self, pod: Obj) -> None:
        """Graceful deletion: preStop, SIGTERM to each container's main process, wait the grace
        period, SIGKILL what is left, report the final status, then delete the pod for good."""
        self.terminating = True
        grace = float(pod["metadata"].get("deletionGracePeriodSeconds") or 0)
        deadline = time.monotonic() + grace
        log.info("test kubelet: terminating %s/%s (grace %.0fs)", self.namespace, self.name, grace)
        for c in self.containers:
            self._pre_stop(pod, c, deadline)
        runs = self.node.config.run_containers  # a node without containers has no process to find
        if runs and self.sidecars:
            # Native sidecars outlive the regular containers: SIGTERM to those first, and to each
            # sidecar (its preStop hook first) once they and the sidecars after it have exited.
            self._stop(self.containers, deadline)
            for c in reversed(self.sidecars):
                self._pre_stop(pod, c, deadline)
                self._stop([c], deadline)
        if runs:
            self._stop(self.init + self.containers, deadline)
        while runs and time.monotonic() < deadline and self.pids() and not self.halted:
            time.sleep(0.05)
        if self.halted:
            return
        # The pod is gone only once every process is: the final status and the deletion follow.
        if runs:
            kill_and_wait(self.marker)
        for c in self.init + self.containers:
            if c.proc is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    c.proc.wait(timeout=5)
                code = c.proc.returncode if c.proc.returncode is not None else -9
                c.terminated = self._terminated_state(c, code)
                c.proc = None
            c.ready = False
            if c.terminated is None and c.waiting:
                c.waiting = None
                c.terminated = {
                    "exitCode": 0,
                    "reason": "ContainerStatusUnknown",
                    "startedAt": None,
                    "finishedAt": now_rfc3339(),
                }
        self.finished = True
        if self.node.partitioned or self.halted:
            return
        self._report(force=True)
        try:
            self.kubelet.api.request(
                "DELETE",
                f"/api/v1/namespaces/{self.namespace}/pods/{self.name}",
                {
                    "apiVersion": "v1",
                    "kind": "DeleteOptions",
                    "gracePeriodSeconds": 0,
                    "preconditions": {"uid": self.uid},
                },
            )
        except ApiCallError as e:
            if e.status not in (404, 409):
                log.warning("test kubelet: final delete of %s/%s failed: %s", self.namespace, self.name, e)
        self.node.pods.pop(self.uid, None)

    def _container_marker(self, c: ContainerRun) -> str:
        return f"{CONTAINER_MARKER}={self.uid}/{c.name}"

    def _pre_stop(self, pod: Obj, c: ContainerRun, deadline: float) -> None:
        """Run the container's exec preStop hook, within what is left of the grace period."""
        hook = dig(c.spec, "lifecycle", "preStop", "exec", "command")
        if hook and c.proc is not None:
            argv = [rewrite_paths(a, self.mounts) for a in hook]
            self._exec(argv, self._env(pod, c.spec), max(0.1, deadline - time.monotonic()))

    def _stop(self, containers: list[ContainerRun], deadline: float) -> None:
        """A container runtime's stop: SIGTERM to each container's main process (its PID 1) alone,
        never to its children (a real runtime signals the init process only: spotjob-agent's ranks
        hear of a deletion from the agent, not from the kubelet); once a main process has exited, the
        rest of its container is SIGKILLed at once, as the kernel ends a PID namespace whose init
        exited. Returns once every main process has exited, the deadline passed or the pod is halted."""
        running = [c for c in containers if c.proc is not None and c.proc.poll() is None]
        for c in running:
            with contextlib.suppress(OSError):
                os.kill(c.proc.pid, signal.SIGTERM)  # type: ignore[union-attr]
        while running and time.monotonic() < deadline and not self.halted:
            for c in [c for c in running if c.proc is None or c.proc.poll() is not None]:
                kill_and_wait(self._container_marker(c))
                running.remove(c)
            if running:
                time.sleep(0.05)
        for c in containers:
            if c.proc is None or c.proc.poll() is not None:
                kill_and_wait(self._container_marker(c))  # exited before the stop: leftovers go now

    # Status ------------------------------------------------------------------------------------
    def _container_status(self, c: ContainerRun) -> Obj:
        s: Obj = {
            "name": c.name,
            "image": c.spec.get("image", ""),
            "imageID": f"local://{c.spec.get('image', '')}",
            "ready": bool(c.ready and c.proc is not None),
            "restartCount": c.restarts,
            "started": c.proc is not None,
        }
        if c.proc is not None:
            s["state"] = {"running": {"startedAt": c.started_at}}
            s["containerID"] = f"local://{self.uid}/{c.name}/{c.restarts}"
        elif c.terminated is not None:
            s["state"] = {"terminated": c.terminated}
            if c.terminated.get("containerID"):
                s["containerID"] = c.terminated["containerID"]
        else:
            reason, message = c.waiting or ("ContainerCreating", "")
            s["state"] = {"waiting": {"reason": reason, **({"message": message} if message else {})}}
        if c.last_exit is not None:
            s["lastState"] = {"terminated": c.last_exit}
        return s

    def _phase(self, pod: Obj) -> str:
        cs = self.containers
        if not self.init_done:
            if any(c.terminated is not None and c.terminated.get("exitCode") != 0 for c in self.init) and self.finished:
                return "Failed"
            return "Pending"
        # Native sidecars do not decide the phase, but the pod ends only once they are stopped too.
        if all(c.terminated is not None for c in cs) and all(c.proc is None for c in self.sidecars):
            return "Succeeded" if all(c.terminated and c.terminated.get("exitCode") == 0 for c in cs) else "Failed"
        if any(c.proc is not None or c.restarts or c.terminated is not None for c in cs):
            return "Running"
        if not self.node.config.run_containers:
            return "Running"
        return "Pending"

    def _report(self, force: bool = False) -> None:
        if self.node.partitioned or self.halted or self.node.deleted:
            return
        with self._lock:
            pod = self.pod
        phase = self._phase(pod)
        statuses = [self._container_status(c) for c in self.containers]
        if not self.node.config.run_containers:
            for s in statuses:
                s.update(ready=True, started=True, state={"running": {"startedAt": self.start_time}})
        # Native sidecars count towards the pod's readiness, as regular containers do.
        sidecar_statuses = [self._container_status(c) for c in self.sidecars]
        ready = phase == "Running" and all(s["ready"] for s in statuses + sidecar_statuses)
        initialized = self.init_done

        def cond(ctype: str, ok: bool, reason: str = "") -> Obj:
            return {
                "type": ctype,
                "status": "True" if ok else "False",
                **({"reason": reason} if reason and not ok else {}),
            }

        conditions = [
            cond("PodReadyToStartContainers", True),
            cond("Initialized", initialized, "ContainersNotInitialized"),
            cond(
                "ContainersReady", ready, "PodCompleted" if phase in ("Succeeded", "Failed") else "ContainersNotReady"
            ),
            cond("Ready", ready, "PodCompleted" if phase in ("Succeeded", "Failed") else "ContainersNotReady"),
        ]
        status: Obj = {
            "phase": phase,
            "hostIP": self.node.host_ip,
            "hostIPs": [{"ip": self.node.host_ip}],
            "podIP": self.ip,
            "podIPs": [{"ip": self.ip}],
            "startTime": self.start_time,
            "containerStatuses": statuses,
        }
        if self.init:
            status["initContainerStatuses"] = [self._container_status(c) for c in self.init]
        # A copy: the conditions and the status are completed below, in place, before they are sent;
        # comparing with those completed dicts made every pass differ (a PATCH every sync period).
        key = copy.deepcopy({"status": status, "conditions": conditions})
        if key == self._last_status and not force:
            return
        # lastTransitionTime only for conditions that changed, as the kubelet keeps them.
        old = {c.get("type"): c for c in dig(pod, "status", "conditions") or []}
        now = now_rfc3339()
        for c in conditions:
            prev = old.get(c["type"])
            c["lastProbeTime"] = None
            c["lastTransitionTime"] = (
                prev.get("lastTransitionTime", now) if prev and prev.get("status") == c["status"] else now
            )
        status["conditions"] = conditions
        try:
            updated = self.kubelet.api.request(
                "PATCH",
                f"/api/v1/namespaces/{self.namespace}/pods/{self.name}/status",
                {"metadata": {"uid": self.uid}, "status": status},
                content_type="application/strategic-merge-patch+json",
            )
            self._last_status = key
            with self._lock:
                if updated["metadata"]["uid"] == self.uid:
                    self.pod = (
                        updated
                        if not self.pod["metadata"].get("deletionTimestamp")
                        or updated["metadata"].get("deletionTimestamp")
                        else self.pod
                    )
        except ApiCallError as e:
            if e.status == 404:
                self.halt(kill=True)
                self.node.pods.pop(self.uid, None)
            else:
                log.debug("test kubelet: status of %s/%s not written: %s", self.namespace, self.name, e)
        except Exception as e:
            log.debug("test kubelet: status of %s/%s not written: %s", self.namespace, self.name, e)
