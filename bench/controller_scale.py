"""The controller at scale: a real ``spotjob-controller`` against the test API server with 100 or 1000 nodes.

What runs (per cluster size, one after the other):

- the test cluster (``tests/k8s/cluster``) in this process: the test API server with its control
  plane, and the test kubelet playing every node. Its nodes start no processes: a pod bound to one
  is reported Running and Ready at once with a pod IP (a hundred torchrun gangs do not fit on two
  cores). Node Leases are renewed every 10 s and a Node's status is posted every 5 min when
  nothing changed, as a kubelet does since Kubernetes 1.17; object validation is off;
- ``bench._fake_agents`` in a process of its own: a simulated agent per pod on the pod's IP and the
  agents' port, speaking the real control API (its module docstring says what it simulates);
- the real ``spotjob-controller`` console script in a process of its own, under an identity of its
  own (the audit log tells its requests apart), serving one namespace of ``--jobs`` SpotJobs (one
  pod each, 1 CPU requested, 8 per node), with its default 4 reconcile workers.

What is measured, in order:

1. start-up: every job Running; then the controller's API calls while nothing happens (``idle``);
2. ``--rounds`` rounds of preemptions: ``--per-round`` jobs at a time get the
   ``aws-node-termination-handler/spot-itn`` taint on their node. Signal → flush request latency
   is the time from just before the taint is written to the simulated agent receiving
   ``POST /flush``; recovery is until the job runs again in its next attempt. The preempted nodes
   are then deleted and replaced by fresh ones (a spot pool keeps its size);
3. a burst: ``--burst`` jobs preempted at once — the same latencies, and the controller's
   reconcile throughput (reconciles per second from its own metrics);
4. API calls by the controller (the audit log): per preemption (the calls naming the preempted
   jobs, their pods, their Events and their nodes' Events), per reconcile, by verb and resource;
   list calls after the informers synced (must be none); and the controller's resident memory.

``python -m bench.controller_scale`` runs 100 and 1000 nodes; ``--nodes 1000 --jobs 100 --rounds
10 --per-round 10 --burst 50`` are the defaults. Results go to ``bench/out/controller_scale.json``
and a summary to stdout; ``bench/README.md`` holds the numbers of a run and the machine.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import multiprocessing
import os
import random
import secrets
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench import _fake_agents  # noqa: E402
from bench._common import describe_machine, log, write_results  # noqa: E402
from orchestrator.k8s.agents import derive_token  # noqa: E402
from tests.k8s.cluster import AuditRecord, TestCluster  # noqa: E402

NAMESPACE = "bench"
CONTROLLER_NAMESPACE = "spotjob-system"
CONTROLLER_USER = f"system:serviceaccount:{CONTROLLER_NAMESPACE}:spotjob"
TAINT = "aws-node-termination-handler/spot-itn"
AGENT_PORT = 8470
CRD_FILE = REPO / "charts" / "spotjob" / "files" / "crds" / "spotjob.dev_spotjobs.yaml"
GROUP_PATH = "/apis/spotjob.dev/v1alpha1"
TARGET_P99_SECONDS = 1.0


@dataclass
class ScaleConfig:
    nodes: int
    jobs: int = 100
    rounds: int = 10
    per_round: int = 10
    burst: int = 50
    idle_seconds: float = 30.0
    flush_seconds: float = 0.2
    """How long a simulated agent takes from POST /flush to its committed manifest."""
    heartbeat_interval: float = 10.0
    status_interval: float = 300.0
    node_monitor_grace: float = 60.0
    controller_workers: int = 4
    wait_seconds: float = 600.0
    """A hang guard per wait; nothing asserts how long anything took."""
    seed: int = 1


@dataclass
class Preemption:
    job: str
    node: str
    attempt: int
    phase: str
    """"round" or "burst"."""
    signal_at: float
    flush_at: float | None = None
    recovered_at: float | None = None

    @property
    def flush_latency(self) -> float | None:
        return None if self.flush_at is None else self.flush_at - self.signal_at

    @property
    def recovery(self) -> float | None:
        return None if self.recovered_at is None else self.recovered_at - self.signal_at


@dataclass
class Window:
    """The controller's API calls and reconciles between two points of the run."""

    name: str
    seconds: float
    calls: int
    by_call: dict[str, int]
    reconciles: int
    lists: int
    watches: int
    attributed: int = 0
    """Calls naming the preempted jobs, their pods, Events and their nodes' Events."""
    attributed_by_call: dict[str, int] = field(default_factory=dict)
    pods_deleted: int = 0
    """Distinct pods among the attributed deletes (a delete may be sent again on a stale cache)."""
    preemptions: int = 0


@dataclass
class SizeResult:
    config: ScaleConfig
    startup_seconds: float
    preemptions: list[Preemption]
    windows: list[Window]
    controller_rss_bytes: int
    controller_peak_rss_bytes: int
    reconcile_seconds_mean: float
    burst_reconciles_per_second: float
    burst_peak_reconciles_per_second: float
    lists_after_sync: int
    errors: list[str]
    load_average: tuple[float, float] = (0.0, 0.0)
    """The machine's 1-minute load average when this size started and when it ended."""

    def latencies(self, phase: str | None = None) -> list[float]:
        return sorted(
            p.flush_latency for p in self.preemptions if p.flush_latency is not None and phase in (None, p.phase)
        )

    def summary(self) -> dict[str, Any]:
        lat = self.latencies()
        rec = sorted(p.recovery for p in self.preemptions if p.recovery is not None)
        preempt = next((w for w in self.windows if w.name == "rounds"), None)
        burst = next((w for w in self.windows if w.name == "burst"), None)
        measured = [w for w in self.windows if w.name in ("rounds", "burst")]
        calls = sum(w.calls for w in measured)
        reconciles = sum(w.reconciles for w in measured)
        return {
            "nodes": self.config.nodes,
            "jobs": self.config.jobs,
            "preemptions": len(self.preemptions),
            "flushes_received": len(lat),
            "flush_latency_p50_s": percentile(lat, 50),
            "flush_latency_p99_s": percentile(lat, 99),
            "flush_latency_max_s": lat[-1] if lat else None,
            "burst_flush_latency_p50_s": percentile(self.latencies("burst"), 50),
            "burst_flush_latency_p99_s": percentile(self.latencies("burst"), 99),
            "recovery_p50_s": percentile(rec, 50),
            "recovery_p99_s": percentile(rec, 99),
            "calls_per_preemption": (preempt.attributed / preempt.preemptions)
            if preempt and preempt.preemptions
            else None,
            "calls_per_preemption_by_call": {
                k: round(v / preempt.preemptions, 2) for k, v in sorted(preempt.attributed_by_call.items())
            }
            if preempt and preempt.preemptions
            else {},
            "calls_per_reconcile": calls / reconciles if reconciles else None,
            "idle_calls_per_minute": next(
                (w.calls * 60 / w.seconds for w in self.windows if w.name == "idle" and w.seconds), None
            ),
            "lists_after_sync": self.lists_after_sync,
            "burst_reconciles_per_second": self.burst_reconciles_per_second,
            "burst_peak_reconciles_per_second": self.burst_peak_reconciles_per_second,
            "burst_seconds": burst.seconds if burst else None,
            "reconcile_seconds_mean": self.reconcile_seconds_mean,
            "startup_seconds": self.startup_seconds,
            "controller_rss_mib": self.controller_rss_bytes / 2**20,
            "controller_peak_rss_mib": self.controller_peak_rss_bytes / 2**20,
            "load_average_start_end": self.load_average,
            "errors": self.errors,
        }


def percentile(values: Sequence[float], pct: float) -> float | None:
    """The nearest-rank percentile (p99 of 100 values is the 99th smallest)."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, -(-len(ordered) * pct // 100))
    return ordered[int(rank) - 1]


# ----------------------------------------------------------------------------------------------
# the pieces


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ControllerProcess:
    """The real ``spotjob-controller`` console script, its log in a file."""

    def __init__(self, kubeconfig: str, root: Path, token_key: Path, workers: int) -> None:
        self.http_port = free_port()
        self.log_path = root / "controller.log"
        binary = Path(sys.executable).parent / "spotjob-controller"
        args = [
            str(binary),
            f"--namespace={NAMESPACE}",
            "--no-leader-elect",
            f"--http-port={self.http_port}",
            f"--agent-port={AGENT_PORT}",
            f"--agent-token-key-file={token_key}",
            f"--controller-namespace={CONTROLLER_NAMESPACE}",
            "--controller-pod-labels=app.kubernetes.io/name=spotjob",
            f"--workers={workers}",
            "--log-level=info",
        ]
        env = {**os.environ, "KUBECONFIG": kubeconfig}
        with open(self.log_path, "ab") as out:
            self.proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def metrics(self) -> dict[str, float]:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.http_port}/metrics", timeout=10) as response:
            text = response.read().decode()
        out: dict[str, float] = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                out[name] = float(value)
        return out

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.http_port}/readyz", timeout=2) as response:
                return bool(response.status == 200)
        except OSError:
            return False

    def reconciles(self) -> tuple[float, float]:
        """(count, total seconds) of reconcile passes so far."""
        m = self.metrics()
        return m.get("spotjob_reconcile_duration_seconds_count", 0.0), m.get(
            "spotjob_reconcile_duration_seconds_sum", 0.0
        )

    def rss(self) -> tuple[int, int]:
        """(VmRSS, VmHWM) of the controller process, in bytes."""
        values = {}
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in ("VmRSS", "VmHWM"):
                    values[key] = int(rest.split()[0]) * 1024
        return values.get("VmRSS", 0), values.get("VmHWM", 0)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)

    def log_tail(self, n: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except FileNotFoundError:
            return ""


class Agents:
    """The simulated agents' process, fed with the pods the test kubelet runs (see ``_fake_agents``)."""

    def __init__(self, cluster: TestCluster, key: bytes, flush_seconds: float) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._cluster = cluster
        self._key = key
        self.reports: Any = ctx.Queue()
        self._commands, child = ctx.Pipe()
        self._process = ctx.Process(
            target=_fake_agents.serve, args=(child, self.reports, 10.0, flush_seconds), daemon=True
        )
        self._process.start()
        self._running: dict[str, str] = {}  # pod uid -> job
        self.job_uids: dict[str, str] = {}  # job name -> SpotJob uid
        self.uris: dict[str, str] = {}  # job name -> checkpoint URI
        self.flushes: dict[str, float] = {}  # pod uid -> when POST /flush arrived
        self.pod_jobs: dict[str, tuple[str, int]] = {}  # pod uid -> (job, attempt)
        self.errors: list[str] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._follow_pods, name="bench-agents", daemon=True),
            threading.Thread(target=self._read_reports, name="bench-reports", daemon=True),
        ]
        for t in self._threads:
            t.start()

    def _follow_pods(self) -> None:
        kubelet = self._cluster.kubelet
        assert kubelet is not None
        while not self._stop.wait(0.05):
            seen = set()
            for worker in kubelet.workers():
                labels = (worker.pod.get("metadata") or {}).get("labels") or {}
                job = labels.get("spotjob.dev/job")
                if worker.namespace != NAMESPACE or not job or job not in self.job_uids:
                    continue
                seen.add(worker.uid)
                if worker.uid in self._running or worker.halted:
                    continue
                attempt = int(labels.get("spotjob.dev/attempt", "0"))
                token = derive_token(self._key, NAMESPACE, job, self.job_uids[job])
                with self._lock:
                    self._running[worker.uid] = job
                    self.pod_jobs[worker.uid] = (job, attempt)
                self._commands.send(
                    ("start", worker.uid, worker.ip, AGENT_PORT, token, f"{NAMESPACE}/{job}", attempt, self.uris[job])
                )
            with self._lock:
                gone = [uid for uid in self._running if uid not in seen]
                for uid in gone:
                    self._running.pop(uid)
            for uid in gone:
                self._commands.send(("stop", uid))

    def _read_reports(self) -> None:
        while not self._stop.is_set():
            try:
                report = self.reports.get(timeout=0.2)
            except Exception:  # queue.Empty, or the queue closed at the end
                continue
            with self._lock:
                if report[0] == "flush":
                    self.flushes.setdefault(report[1], report[2])
                elif report[0] == "error":
                    self.errors.append(report[2])

    def flush_of(self, job: str, attempt: int) -> float | None:
        with self._lock:
            return min((t for uid, t in self.flushes.items() if self.pod_jobs.get(uid) == (job, attempt)), default=None)

    def close(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=5)
        with contextlib.suppress(Exception):
            self._commands.send(("quit",))
        self._process.join(timeout=20)
        if self._process.is_alive():
            self._process.kill()


class JobWatch:
    """Every SpotJob of the namespace as the API server shows it now (a watch, as admin)."""

    def __init__(self, cluster: TestCluster) -> None:
        self._cluster = cluster
        self._lock = threading.Lock()
        self.jobs: dict[str, dict[str, Any]] = {}
        self._stop = threading.Event()
        listing = cluster.rest.get(f"{GROUP_PATH}/namespaces/{NAMESPACE}/spotjobs")
        self._rv = listing["metadata"]["resourceVersion"]
        for item in listing["items"]:
            self.jobs[item["metadata"]["name"]] = item
        self._thread = threading.Thread(target=self._run, name="bench-jobs", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                for ev in self._cluster.rest.watch(f"{GROUP_PATH}/namespaces/{NAMESPACE}/spotjobs", self._rv, 30):
                    obj = ev["object"]
                    if ev["type"] == "ERROR":
                        raise RuntimeError(f"job watch: {obj}")
                    self._rv = obj["metadata"].get("resourceVersion", self._rv)
                    if ev["type"] in ("ADDED", "MODIFIED"):
                        with self._lock:
                            self.jobs[obj["metadata"]["name"]] = obj
                    elif ev["type"] == "DELETED":
                        with self._lock:
                            self.jobs.pop(obj["metadata"]["name"], None)
                    if self._stop.is_set():
                        return
            except Exception as e:
                if self._stop.is_set():
                    return
                log(f"job watch broke ({e}); listing again")
                with contextlib.suppress(Exception):
                    listing = self._cluster.rest.get(f"{GROUP_PATH}/namespaces/{NAMESPACE}/spotjobs")
                    self._rv = listing["metadata"]["resourceVersion"]
                    with self._lock:
                        self.jobs = {i["metadata"]["name"]: i for i in listing["items"]}

    def status(self, name: str) -> dict[str, Any]:
        with self._lock:
            return dict((self.jobs.get(name) or {}).get("status") or {})

    def running(self) -> dict[str, tuple[int, list[str]]]:
        """Jobs that run now: attempt and the nodes of its workers."""
        out = {}
        with self._lock:
            items = list(self.jobs.items())
        for name, job in items:
            st = job.get("status") or {}
            if st.get("phase") == "Running":
                nodes = [w.get("node") for w in st.get("workers") or [] if w.get("node")]
                out[name] = (int((st.get("attempt") or {}).get("number") or 0), nodes)
        return out

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=35)


# ----------------------------------------------------------------------------------------------
# one cluster size


def install_crd(cluster: TestCluster) -> None:
    import yaml

    crd = yaml.safe_load(CRD_FILE.read_text())
    cluster.rest.request("POST", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions", crd)
    cluster.wait_for(lambda: cluster.rest.get(GROUP_PATH), 60, "the SpotJob CRD to be served")


def job_body(name: str, uri: str) -> dict[str, Any]:
    return {
        "apiVersion": "spotjob.dev/v1alpha1",
        "kind": "SpotJob",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": {
            "image": "registry.example.com/train:1",
            "template": {
                "spec": {
                    "containers": [
                        {
                            "name": "trainer",
                            "image": "registry.example.com/train:1",
                            "resources": {"requests": {"cpu": "1", "memory": "1Gi"}},
                        }
                    ]
                }
            },
            "command": ["/workspace/train.py"],
            "replicas": 1,
            "nprocPerNode": 1,
            "checkpoint": {"uri": uri, "everySteps": 1000},
            "maxRestarts": 3,
            "flushTimeoutSeconds": 60,
            "restartBackoff": {"initialSeconds": 0, "maxSeconds": 0},
            "cooldown": {"avoidNode": True, "seconds": 1800},
        },
    }


def wait(check: Any, timeout: float, what: str, interval: float = 0.1) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


def controller_window(
    name: str,
    records: list[AuditRecord],
    seconds: float,
    reconciles: float,
    preempted: Sequence[Preemption] = (),
) -> Window:
    """The controller's calls among ``records``, and those naming the ``preempted`` jobs, their pods,
    their Events and their nodes' Events (Events are named after the object they are about)."""
    mine = [r for r in records if r.user == CONTROLLER_USER]
    by_call = Counter(f"{r.verb} {r.resource_path}" for r in mine)
    window = Window(
        name=name,
        seconds=round(seconds, 3),
        calls=sum(n for call, n in by_call.items() if not call.startswith("watch ")),
        by_call=dict(sorted(by_call.items())),
        reconciles=int(reconciles),
        lists=sum(1 for r in mine if r.verb == "list"),
        watches=sum(1 for r in mine if r.verb == "watch"),
    )
    if preempted:
        jobs = {p.job for p in preempted}
        nodes = {p.node for p in preempted}

        def about(r: AuditRecord) -> bool:
            name = r.name or r.created
            if r.resource == "spotjobs":
                return name in jobs
            if r.resource == "pods":
                return name.rsplit("-", 2)[0] in jobs
            if r.resource == "events":
                return name.split(".", 1)[0] in jobs | nodes
            return False

        picked = [r for r in mine if about(r)]
        window.attributed = len(picked)
        window.attributed_by_call = dict(sorted(Counter(f"{r.verb} {r.resource_path}" for r in picked).items()))
        window.pods_deleted = len({r.name for r in picked if r.verb == "delete" and r.resource == "pods"})
        window.preemptions = len(preempted)
    return window


def run_size(config: ScaleConfig, root: Path) -> SizeResult:
    """Start everything for ``config.nodes`` nodes, measure, stop everything (see the module docstring)."""
    rng = random.Random(config.seed)
    errors: list[str] = []
    load_start = os.getloadavg()[0]
    cluster = TestCluster(
        root / "cluster",
        validate="off",
        heartbeat_interval=config.heartbeat_interval,
        status_interval=config.status_interval,
        node_monitor_grace=config.node_monitor_grace,
        history_size=200_000,
    ).start()
    controller: ControllerProcess | None = None
    agents: Agents | None = None
    jobs_watch: JobWatch | None = None
    node_counter = 0

    def add_node() -> str:
        nonlocal node_counter
        name = f"spot-{node_counter:05d}"
        node_counter += 1
        cluster.add_node(name, zone=f"us-east-1{'abcd'[node_counter % 4]}", run_containers=False)
        return name

    try:
        install_crd(cluster)
        for ns in (NAMESPACE, CONTROLLER_NAMESPACE):
            cluster.rest.request(
                "POST", "/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}}
            )
        cluster.wait_for(
            lambda: cluster.rest.get(f"/api/v1/namespaces/{NAMESPACE}/serviceaccounts/default"), 60, "the SA"
        )
        started = time.monotonic()
        for _ in range(config.nodes):
            add_node()
        log(f"{config.nodes} nodes registered in {time.monotonic() - started:.1f}s")

        key = secrets.token_urlsafe(48).encode()  # text, as the chart's Secret holds it
        key_file = root / "agent-token-key"
        key_file.write_bytes(key)
        key_file.chmod(0o600)
        agents = Agents(cluster, key, config.flush_seconds)
        kubeconfig = cluster.kubeconfig_for(CONTROLLER_USER)
        controller = ControllerProcess(kubeconfig, root, key_file, config.controller_workers)
        ctl = controller

        def ready() -> bool:
            if ctl.proc.poll() is not None:
                raise RuntimeError(f"spotjob-controller exited with {ctl.proc.returncode}: {ctl.log_tail(2000)}")
            return ctl.ready()

        wait(ready, config.wait_seconds, "the controller's caches to sync", 0.2)
        synced_mark = cluster.audit_mark()

        started = time.monotonic()
        for i in range(config.jobs):
            name = f"job-{i:03d}"
            uri = f"file://{root}/checkpoints/{name}"
            agents.uris[name] = uri
            created = cluster.rest.request("POST", f"{GROUP_PATH}/namespaces/{NAMESPACE}/spotjobs", job_body(name, uri))
            agents.job_uids[name] = created["metadata"]["uid"]
        jobs_watch = JobWatch(cluster)
        watch = jobs_watch
        wait(lambda: len(watch.running()) == config.jobs, config.wait_seconds, "every job to run", 0.5)
        startup = time.monotonic() - started
        log(f"{config.jobs} jobs Running {startup:.1f}s after their creation")

        # Idle: nothing happens; what does the controller ask of the API server?
        time.sleep(5)
        mark, t0, (r0, _) = cluster.audit_mark(), time.monotonic(), controller.reconciles()
        time.sleep(config.idle_seconds)
        windows = [
            controller_window("idle", cluster.audit_log(mark), time.monotonic() - t0, controller.reconciles()[0] - r0)
        ]

        preemptions: list[Preemption] = []

        def preempt(nodes: list[str], phase: str) -> list[Preemption]:
            running = watch.running()
            victims = {job: (attempt, ns) for job, (attempt, ns) in running.items() if set(ns) & set(nodes)}
            batch: list[Preemption] = []
            for node in nodes:
                at = time.monotonic()
                cluster.taint_node(node, TAINT, "true", "NoSchedule")
                for job, (attempt, ns) in victims.items():
                    if node in ns:
                        batch.append(Preemption(job, node, attempt, phase, at))
            return batch

        def settle(batch: list[Preemption]) -> None:
            def done() -> bool:
                running = watch.running()
                for p in batch:
                    if p.recovered_at is None and p.job in running and running[p.job][0] > p.attempt:
                        p.recovered_at = time.monotonic()
                return all(p.recovered_at is not None for p in batch)

            wait(done, config.wait_seconds, f"{len(batch)} preempted jobs to run again", 0.05)

            def heard() -> bool:
                for p in batch:
                    p.flush_at = p.flush_at or agents.flush_of(p.job, p.attempt)
                return all(p.flush_at is not None for p in batch)

            with contextlib.suppress(TimeoutError):
                wait(heard, 30, "the agents' reports")  # the reports travel through a queue
            errors.extend(
                f"{p.job} attempt {p.attempt}: its agent never received POST /flush"
                for p in batch
                if p.flush_at is None
            )

        def pick(count: int) -> list[str]:
            running = watch.running()
            nodes = sorted({n for _, ns in running.values() for n in ns})
            return rng.sample(nodes, min(count, len(nodes)))

        def replace(batch: list[Preemption]) -> None:
            for node in sorted({p.node for p in batch}):
                cluster.delete_node(node)
                add_node()

        # Rounds of preemptions, one after the other.
        mark, t0, (r0, _) = cluster.audit_mark(), time.monotonic(), controller.reconciles()
        for i in range(config.rounds):
            batch = preempt(pick(config.per_round), "round")
            settle(batch)
            preemptions += batch
            lat = [p.flush_latency for p in batch if p.flush_latency is not None]
            median = statistics.median(lat) if lat else float("nan")
            log(
                f"round {i + 1}/{config.rounds}: {len(batch)} preemptions, flush requested after "
                f"{median:.3f}s (median), max {max(lat, default=float('nan')):.3f}s"
            )
            replace(batch)
            time.sleep(1.0)
        windows.append(
            controller_window(
                "rounds", cluster.audit_log(mark), time.monotonic() - t0, controller.reconciles()[0] - r0, preemptions
            )
        )

        # The burst: many at once, while the reconcile rate is sampled.
        time.sleep(2)
        mark, t0, (r0, _) = cluster.audit_mark(), time.monotonic(), controller.reconciles()
        samples: list[tuple[float, float]] = [(t0, r0)]
        sampling = threading.Event()

        def sample() -> None:
            while not sampling.wait(0.5):
                with contextlib.suppress(OSError):
                    samples.append((time.monotonic(), controller.reconciles()[0]))

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        log(f"burst: the nodes of {config.burst} running jobs tainted at once")
        burst = preempt(pick(config.burst), "burst")
        settle(burst)
        sampling.set()
        sampler.join()
        t1, (r1, _) = time.monotonic(), controller.reconciles()
        samples.append((t1, r1))
        preemptions += burst
        windows.append(controller_window("burst", cluster.audit_log(mark), t1 - t0, r1 - r0, burst))
        peak = max(
            ((b[1] - a[1]) / (b[0] - a[0]) for a, b in zip(samples, samples[2:], strict=False) if b[0] > a[0]),
            default=0.0,
        )
        count, total = controller.reconciles()
        rss, hwm = controller.rss()
        lists_after_sync = sum(
            1 for r in cluster.audit_log(synced_mark) if r.user == CONTROLLER_USER and r.verb == "list"
        )
        errors += agents.errors
        if controller.proc.poll() is not None:
            errors.append(f"the controller exited with {controller.proc.returncode}")
        return SizeResult(
            config=config,
            startup_seconds=round(startup, 3),
            preemptions=preemptions,
            windows=windows,
            controller_rss_bytes=rss,
            controller_peak_rss_bytes=hwm,
            reconcile_seconds_mean=total / count if count else 0.0,
            burst_reconciles_per_second=(r1 - r0) / (t1 - t0) if t1 > t0 else 0.0,
            burst_peak_reconciles_per_second=peak,
            lists_after_sync=lists_after_sync,
            errors=errors,
            load_average=(load_start, os.getloadavg()[0]),
        )
    except BaseException:
        if controller is not None:
            sys.stderr.write(f"\n----- controller log (tail) -----\n{controller.log_tail()}\n")
        raise
    finally:
        if jobs_watch is not None:
            jobs_watch.stop()
        if controller is not None:
            controller.stop()
        if agents is not None:
            agents.close()
        cluster.stop()


# ----------------------------------------------------------------------------------------------
# the command line


def _fmt(value: Any, unit: str = "", digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}{unit}"
    return f"{value}{unit}"


def report(results: list[SizeResult]) -> str:
    rows = [r.summary() for r in results]
    lines = [
        "| nodes | jobs | preemptions | flush p50 | flush p99 | burst p99 | recovery p50 | calls / preemption | "
        "calls / reconcile | idle calls / min | lists after sync | burst reconciles/s (peak) | RSS (peak) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in rows:
        lines.append(
            f"| {s['nodes']} | {s['jobs']} | {s['preemptions']} | {_fmt(s['flush_latency_p50_s'], ' s')} | "
            f"{_fmt(s['flush_latency_p99_s'], ' s')} | {_fmt(s['burst_flush_latency_p99_s'], ' s')} | "
            f"{_fmt(s['recovery_p50_s'], ' s', 2)} | {_fmt(s['calls_per_preemption'], '', 1)} | "
            f"{_fmt(s['calls_per_reconcile'], '', 2)} | {_fmt(s['idle_calls_per_minute'], '', 1)} | "
            f"{s['lists_after_sync']} | {_fmt(s['burst_reconciles_per_second'], '', 1)} "
            f"({_fmt(s['burst_peak_reconciles_per_second'], '', 1)}) | "
            f"{_fmt(s['controller_rss_mib'], ' MiB', 0)} ({_fmt(s['controller_peak_rss_mib'], ' MiB', 0)}) |"
        )
    for s in rows:
        lines.append(f"\n{s['nodes']} nodes, calls per preemption by call: {s['calls_per_preemption_by_call']}")
        lines.append(f"{s['nodes']} nodes, load average at start and end: {s['load_average_start_end']}")
        if s["errors"]:
            lines.append(f"{s['nodes']} nodes, errors: {s['errors']}")
    lines.append("")
    for s in rows:
        p99 = s["flush_latency_p99_s"]
        verdict = "met" if p99 is not None and p99 < TARGET_P99_SECONDS else "missed"
        lines.append(
            f"{s['nodes']} nodes: signal → flush p99 {_fmt(p99, ' s')} (< {TARGET_P99_SECONDS:g} s: {verdict})"
        )
        lines.append(f"{s['nodes']} nodes: list calls after the informers synced: {s['lists_after_sync']} (0: "
                     f"{'met' if s['lists_after_sync'] == 0 else 'missed'})")  # fmt: skip
    if len(rows) > 1:
        small, large = rows[0], rows[-1]
        a, b = small["calls_per_reconcile"], large["calls_per_reconcile"]
        if a and b:
            grows = b > a * 1.25
            lines.append(
                f"API calls per reconcile, {small['nodes']} → {large['nodes']} nodes: {a:.2f} → {b:.2f} "
                f"({'grows' if grows else 'does not grow'} with the cluster)"
            )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.controller_scale", description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", default="100,1000", help="cluster sizes to run, comma-separated (default 100,1000)")
    p.add_argument("--jobs", type=int, default=100, help="SpotJobs on the cluster, one pod each (default 100)")
    p.add_argument("--rounds", type=int, default=10, help="rounds of preemptions (default 10)")
    p.add_argument("--per-round", type=int, default=10, help="jobs preempted in each round (default 10)")
    p.add_argument("--burst", type=int, default=50, help="jobs preempted at once in the burst (default 50)")
    p.add_argument(
        "--idle-seconds",
        type=float,
        default=30.0,
        help="seconds the controller's API calls are counted while nothing happens (default 30)",
    )
    p.add_argument("--workers", type=int, default=4, help="the controller's --workers")
    p.add_argument("--keep", action="store_true", help="keep the work folder (the controller's log, checkpoints)")
    args = p.parse_args(argv)
    try:
        sizes = [int(n) for n in args.nodes.split(",") if n.strip()]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        p.error(f"--nodes takes cluster sizes of 1 node or more, comma-separated; got {args.nodes!r}")
    if args.jobs < 1 or args.per_round < 1 or args.burst < 1 or args.rounds < 0 or not args.idle_seconds >= 0:
        p.error("--jobs, --per-round and --burst must be >= 1, --rounds and --idle-seconds >= 0")
    logging.basicConfig(level=logging.WARNING)
    # A SIGTERM (``timeout``, a CI runner's cancel) ends it the way Ctrl-C does, through the
    # ``finally`` blocks that stop the controller and the test cluster; by default it left both running.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    results = []
    for nodes in sizes:
        config = ScaleConfig(
            nodes=nodes,
            jobs=args.jobs,
            rounds=args.rounds,
            per_round=args.per_round,
            burst=args.burst,
            idle_seconds=args.idle_seconds,
            controller_workers=args.workers,
        )
        log(f"--- {nodes} nodes, {args.jobs} jobs")
        root = Path(tempfile.mkdtemp(prefix=f"spotjob-scale-{nodes}-"))
        try:
            results.append(run_size(config, root))
        finally:
            if args.keep:
                log(f"kept {root}")
            else:
                shutil.rmtree(root, ignore_errors=True)
    text = report(results)
    print(text)
    write_results(
        "controller_scale",
        {
            "machine": describe_machine(tempfile.gettempdir()),
            "target_p99_seconds": TARGET_P99_SECONDS,
            "sizes": [
                {
                    "summary": r.summary(),
                    "config": asdict(r.config),
                    "windows": [asdict(w) for w in r.windows],
                    "preemptions": [asdict(p) for p in r.preemptions],
                }
                for r in results
            ],
        },
    )
    return 0 if all(not r.errors for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
