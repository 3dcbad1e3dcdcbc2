"""The Kubernetes backend (orchestrator.backends.k8s) over caches a test fills and a client that
records what it is asked: how pods read as workers, what is created when, how a gang stops."""

from __future__ import annotations

import copy
import json
import logging
import os
import socket
import subprocess
import sys
import threading
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from agent.streams import JsonFormatter, UtcFormatter
from orchestrator.backends.base import BackendError, FlushRequestOutcome, Placement
from orchestrator.backends.k8s import BackendOptions, KubernetesBackend
from orchestrator.k8s.agents import AgentCalls, AgentReport, CallResult, CallState, Endpoint
from orchestrator.k8s.api import AlreadyExists, Resource
from orchestrator.k8s.cluster_signals import NOTICE_INDEX, ClusterSignals, notice_index
from orchestrator.k8s.informer import Cache
from orchestrator.model import JobKey, JobSpec, WorkerPhase
from orchestrator.signals import SignalKind

KEY = JobKey("ml", "llama")
UID = "11111111-2222-3333-4444-555555555555"


class FakeClient:
    def __init__(self) -> None:
        self.created: list[tuple[str, dict[str, Any]]] = []
        self.deleted: list[tuple[str, str, int | None]] = []

    def create(self, resource: Resource, body: dict[str, Any], namespace: str | None = None) -> dict[str, Any]:
        name = body["metadata"]["name"]
        if any(r == resource.plural and b["metadata"]["name"] == name for r, b in self.created):
            raise AlreadyExists(f"{name} exists", status=409, reason="AlreadyExists")
        self.created.append((resource.plural, body))
        return body

    def delete(self, resource: Resource, name: str, namespace: str | None = None, **kw: Any) -> bool:
        self.deleted.append((resource.plural, name, kw.get("grace_period_seconds")))
        return True

    def kinds(self) -> list[str]:
        return [r for r, _ in self.created]


class FakeAgents:
    """Answers as told; records what was asked."""

    def __init__(self) -> None:
        self.answer = CallResult(CallState.ACCEPTED)
        self.asked: list[tuple[str, str]] = []

    def flush(self, agent: Endpoint, reason: str, deadline: Any, *, answered: Any = None) -> CallResult:
        self.asked.append(("flush", agent.pod))
        return self.answer

    def stop(self, agent: Endpoint, reason: str, *, answered: Any = None) -> CallResult:
        self.asked.append(("stop", agent.pod))
        return self.answer

    def report(self, agent: Endpoint) -> AgentReport:
        return AgentReport(step=7)

    def forget(self, uid: str) -> None:
        pass

    def close(self) -> None:
        pass


def spec(**changes: Any) -> JobSpec:
    raw = {"image": "img:1", "command": ["train.py"], "replicas": 2, "checkpoint": {"uri": "s3://b/llama"}}
    raw.update(changes)
    return JobSpec.model_validate(raw)


def node(
    name: str, *, ready: str = "True", taints: list[dict[str, Any]] | None = None, **labels: str
) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "labels": {"topology.kubernetes.io/zone": "us-east-1a", "node.kubernetes.io/instance-type": "g5", **labels},
        },
        "spec": {"taints": taints or []},
        "status": {"conditions": [{"type": "Ready", "status": ready}]},
    }


def pod(
    index: int,
    *,
    attempt: int = 0,
    phase: str = "Running",
    ready: bool = True,
    exit_code: int | None = None,
    node_name: str = "n1",
    ip: str | None = "10.0.0.1",
    deleting: bool = False,
    sidecar: bool = False,
) -> dict[str, Any]:
    trainer_state: dict[str, Any] = {"running": {}} if exit_code is None else {"terminated": {"exitCode": exit_code}}
    statuses = [{"name": "trainer", "state": trainer_state, "ready": ready and exit_code is None}]
    containers = [{"name": "trainer", "ports": [{"name": "spotjob-agent", "containerPort": 8470}]}]
    if sidecar:
        containers.insert(0, {"name": "proxy"})
        statuses.insert(0, {"name": "proxy", "state": {"running": {}}})
    obj: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": f"llama-{attempt}-{index}",
            "namespace": "ml",
            "uid": f"uid-{attempt}-{index}",
            "labels": {
                "spotjob.dev/job": "llama",
                "spotjob.dev/attempt": str(attempt),
                "spotjob.dev/index": str(index),
            },
        },
        "spec": {"nodeName": node_name, "containers": containers},
        "status": {
            "phase": phase,
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
            "containerStatuses": statuses,
        },
    }
    if ip:
        obj["status"]["podIP"] = ip
    if deleting:
        obj["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return obj


def _pod_job(p: dict[str, Any]) -> list[str]:
    return [f"{p['metadata']['namespace']}/{p['metadata']['labels']['spotjob.dev/job']}"]


class World:
    def __init__(self, agents: Any = None, wake: Any = None) -> None:
        """``agents``: ``FakeAgents`` unless given; ``wake``: the backend's, unless None."""
        self.client = FakeClient()
        self.jobs = Cache()
        self.pods = Cache({"job": _pod_job})
        self.nodes = Cache({NOTICE_INDEX: notice_index})  # as the controller's Node informer
        self.signals = ClusterSignals(node_lost_grace_seconds=0)
        self.agents = agents or FakeAgents()
        self.jobs._put(
            {
                "apiVersion": "spotjob.dev/v1alpha1",
                "kind": "SpotJob",
                "metadata": {"name": "llama", "namespace": "ml", "uid": UID},
            }
        )
        self.backend = KubernetesBackend(
            self.client,  # type: ignore[arg-type]
            jobs=self.jobs,
            pods_cache=self.pods,
            nodes=self.nodes,
            signals=self.signals,
            token_key=b"k" * 32,
            options=BackendOptions(),
            agents=self.agents,
            wake=wake,
        )

    def add(self, *objects: dict[str, Any]) -> None:
        for obj in objects:
            (self.nodes if obj["kind"] == "Node" else self.pods)._put(copy.deepcopy(obj))

    def phases(self) -> dict[str, tuple[WorkerPhase, int | None]]:
        return {w.name: (w.phase, w.exit_code) for w in self.backend.list_workers(KEY, spec())}


@pytest.fixture
def world() -> World:
    w = World()
    w.add(node("n1"), node("n2"))
    return w


def test_each_worker_runs_once_its_own_pod_is_ready_whatever_replica_0_says(world: World) -> None:
    world.add(pod(0, ready=False), pod(1, ready=False, ip="10.0.0.2"))
    assert world.phases() == {"llama-0-0": (WorkerPhase.PENDING, None), "llama-0-1": (WorkerPhase.PENDING, None)}
    world.add(pod(0, ready=True))
    # Replica 1's container runs, but its own agent has not said its ranks train.
    assert world.phases() == {"llama-0-0": (WorkerPhase.RUNNING, None), "llama-0-1": (WorkerPhase.PENDING, None)}
    world.add(pod(1, ready=True, ip="10.0.0.2"))
    assert world.phases() == {"llama-0-0": (WorkerPhase.RUNNING, None), "llama-0-1": (WorkerPhase.RUNNING, None)}
    steps = {w.name: w.step for w in world.backend.list_workers(KEY, spec())}
    assert steps == {"llama-0-0": 7, "llama-0-1": 7}


def test_a_pod_the_scheduler_cannot_place_is_pending_with_the_schedulers_words(world: World) -> None:
    unplaced = pod(0, phase="Pending", ready=False, ip=None)
    unplaced["spec"].pop("nodeName", None)
    unplaced["status"] = {
        "phase": "Pending",
        "conditions": [
            {
                "type": "PodScheduled",
                "status": "False",
                "reason": "Unschedulable",
                "message": "0/3 nodes are available: 3 node(s) didn't match Pod's node affinity/selector.",
            }
        ],
    }
    world.add(unplaced, pod(1, phase="Pending", ready=False))
    observed = {w.name: w for w in world.backend.list_workers(KEY, spec())}
    assert observed["llama-0-0"].phase is WorkerPhase.PENDING
    assert (
        observed["llama-0-0"].unschedulable
        == "0/3 nodes are available: 3 node(s) didn't match Pod's node affinity/selector."
    )
    assert observed["llama-0-1"].unschedulable is None, "placed: starting, not short of capacity"


def test_the_agents_exit_code_decides_even_while_a_sidecar_keeps_the_pod_running(world: World) -> None:
    world.add(pod(0, exit_code=75, sidecar=True))
    world.pods._put(
        {**pod(1, phase="Failed"), "status": {"phase": "Failed", "conditions": [], "containerStatuses": []}}
    )
    assert world.phases() == {"llama-0-0": (WorkerPhase.FAILED, 75), "llama-0-1": (WorkerPhase.FAILED, None)}
    world.add(pod(0, phase="Succeeded", exit_code=0))
    assert world.phases()["llama-0-0"] == (WorkerPhase.SUCCEEDED, 0)


def test_an_agent_that_refused_its_options_says_which_and_points_at_an_older_image(world: World) -> None:
    # What a spotjob-agent older than the controller leaves in its termination message (the tail of
    # its log, FallbackToLogsOnError) when the controller gives it an option it does not know.
    refused = pod(0, exit_code=2)
    refused["status"]["containerStatuses"][0]["state"]["terminated"]["message"] = (
        "usage: spotjob-agent [OPTIONS] -- COMMAND [ARGS...]\n"
        "spotjob-agent: error: unrecognized arguments: --some-new-option 1\n"
    )
    own = pod(1, exit_code=2, ip="10.0.0.2")  # the training command's own exit 2: no refusal to name
    own["status"]["containerStatuses"][0]["state"]["terminated"]["message"] = "Traceback ...\nSystemExit: 2\n"
    world.add(refused, own)
    detail = {w.name: w.detail for w in world.backend.list_workers(KEY, spec())}
    assert detail["llama-0-1"] == "SystemExit: 2; kubectl logs llama-0-1 -n ml", "its own last words, no hint"
    assert detail["llama-0-0"] is not None
    assert "unrecognized arguments: --some-new-option 1" in detail["llama-0-0"]
    assert "older than the controller" in detail["llama-0-0"] and "Upgrading" in detail["llama-0-0"]


def test_an_agent_that_refused_a_setting_of_its_environment_points_there_not_at_an_older_image(world: World) -> None:
    # A bad SPOTJOB_AGENT_* value the controller could not check up front (from a ConfigMap through
    # valueFrom or envFrom, or the image's ENV): the agent's own words, then where to fix it. It used
    # to ask whether the image's spotjob was older than the controller.
    refused = pod(0, exit_code=2)
    refused["status"]["containerStatuses"][0]["state"]["terminated"]["message"] = (
        "usage: spotjob-agent [OPTIONS] -- COMMAND [ARGS...]\n"
        "spotjob-agent: error: SPOTJOB_AGENT_PREFETCH 'nodes': expected one of node, all, off\n"
    )
    world.add(refused)
    detail = {w.name: w.detail for w in world.backend.list_workers(KEY, spec())}["llama-0-0"]
    assert detail is not None
    assert "SPOTJOB_AGENT_PREFETCH 'nodes': expected one of node, all, off" in detail
    assert "valueFrom, envFrom" in detail and "older than the controller" not in detail


def _agent_log(lines: list[str], kind: str) -> str:
    """These messages as spotjob-agent's log writes them, text or JSON (``agent.streams``)."""
    fields = {"command": "spotjob-agent", "pid": 7}
    if kind == "json":
        formatter: logging.Formatter = JsonFormatter(fields)
    else:
        formatter = UtcFormatter("%(asctime)s %(levelname)s spotjob-agent[%(process)d] %(name)s: %(message)s")
    records = [logging.LogRecord("agent.launcher", logging.WARNING, __file__, 1, m, (), None) for m in lines]
    return "\n".join(formatter.format(r) for r in records)


@pytest.mark.parametrize("kind", ["text", "json"])
def test_an_agent_that_exited_76_says_why_its_flush_committed_nothing_from_its_own_log(world: World, kind: str) -> None:
    """The termination message of an agent that exited 76 (the tail of its log) holds its exit line:
    why the flush committed nothing. The worker's detail is that line, which the AgentFlushFailed
    and FlushFailed messages carry; it was None (the messages said only "committed nothing")."""
    why = 'exiting 76: the flush failed: the store refused the upload "step-000000100" (AccessDenied)'
    flushed = pod(0, exit_code=76)
    tail = _agent_log(["flush f-1 failed after 2.10 s: AccessDenied", why], kind)
    flushed["status"]["containerStatuses"][0]["state"]["terminated"]["message"] = tail
    world.add(flushed)
    world.add(pod(1, exit_code=76))  # its termination message is empty: nothing to say
    first, second = world.backend.list_workers(KEY, spec())
    assert first.detail == f"{why}; kubectl logs llama-0-0", first.detail
    assert second.detail is None


@pytest.mark.parametrize("kind", ["text", "json"])
def test_an_agent_that_exited_75_says_which_notice_its_flush_answered_from_its_own_log(world: World, kind: str) -> None:
    """The termination message of an agent that exited 75 holds its exit line, which now names what
    its flush answered: the worker says it (the AgentPreempted message carries it). What the exit
    is stays the exit code's: a 75 whose line does not say (an older agent) is one all the same,
    and its detail (a failure's) stays None."""
    answered = "gcp maintenance: TERMINATE_ON_HOST_MAINTENANCE, the node stops in 3600 s"
    why = f"exiting 75: the flush committed step 100 at gs://b/llama/step-000000100; the flush answered {answered}"
    flushed = pod(0, exit_code=75)
    flushed["status"]["containerStatuses"][0]["state"]["terminated"]["message"] = _agent_log(
        ["flush f-1 ok", why], kind
    )
    world.add(flushed)
    older = pod(1, exit_code=75)
    older["status"]["containerStatuses"][0]["state"]["terminated"]["message"] = _agent_log(
        ["exiting 75: the flush committed step 100 at gs://b/llama/step-000000100"], kind
    )
    world.add(older)
    first, second = world.backend.list_workers(KEY, spec())
    assert (first.exit_code, first.flush_answered, first.detail) == (75, answered, None)
    assert (second.exit_code, second.flush_answered, second.detail) == (75, None, None)


def test_an_agent_that_exited_74_says_which_infrastructure_error_from_its_own_log(world: World, tmp_path: Path) -> None:
    """A real spotjob-agent on node rank 0 of a two-node torchrun whose rendezvous port another
    process holds exits 74; its log's tail (what FallbackToLogsOnError makes the termination
    message) is the pod's. The worker's detail is its "exiting 74" line (the port, what to do),
    which the WorkerInfraError message used to leave out for a generic list of causes."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        command = ["torchrun", "--nnodes", "2", "--node-rank", "0", "--master-addr", "127.0.0.1"]
        command += ["--master-port", str(port), "--nproc-per-node", "1", "train.py"]
        agent = subprocess.run(
            [
                sys.executable,
                "-c",
                "from agent.launcher import cli; cli()",
                "--checkpoint-uri",
                str(tmp_path / "ckpt"),
                "--",
                *command,
            ],
            env={**os.environ, "SPOTJOB_CLOUD": "none"},
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert agent.returncode == 74, agent.stderr[-2000:]
    infra = pod(1, exit_code=74)
    infra["status"]["containerStatuses"][0]["state"]["terminated"]["message"] = agent.stderr[-2048:]
    world.add(infra)
    (worker,) = world.backend.list_workers(KEY, spec())
    assert worker.detail is not None and worker.detail.startswith("exiting 74: "), worker.detail
    assert f"rendezvous port {port}" in worker.detail and "free the port" in worker.detail
    assert "kubectl logs llama-0-1" in worker.detail


CRASH_TAIL = [
    "[rank0]: Traceback (most recent call last):",
    '[rank0]:   File "/app/train.py", line 113, in main',
    '[rank0]:     raise RuntimeError(f"injected crash at step {step + 1}")',
    "[rank0]: RuntimeError: injected crash at step 25",
]


@pytest.mark.parametrize("kind", ["text", "json"])
def test_a_worker_whose_code_failed_quotes_the_telling_line_of_its_termination_message(world: World, kind: str) -> None:
    """A user walk: a job whose code raised went Failed with only "exited with code 1", though the
    termination message (the log's tail, ``FallbackToLogsOnError``) held the traceback and README
    promises the worker's last words in the Event and the Phase line. The detail is now the line
    local mode picks from a log (the last exception, never the agent's own ``exiting 1`` line), or
    the script's last line when it raised nothing, with where to read the rest."""
    crashed = pod(0, phase="Failed", ready=False, exit_code=1)
    agent = _agent_log(["exiting 1: the command exited 1"], kind)
    crashed["status"]["containerStatuses"][0]["state"]["terminated"]["message"] = "\n".join([*CRASH_TAIL, agent])
    quiet = pod(1, phase="Failed", ready=False, exit_code=3, ip="10.0.0.2")
    said = "step 25: loss is nan, giving up"
    quiet["status"]["containerStatuses"][0]["state"]["terminated"]["message"] = f"step 24\n{said}\n{agent}"
    world.add(crashed, quiet, pod(2, phase="Failed", ready=False, exit_code=1, ip="10.0.0.3"))
    details = [w.detail for w in world.backend.list_workers(KEY, spec(replicas=3))]
    assert details == [
        "RuntimeError: injected crash at step 25; kubectl logs llama-0-0 -n ml",
        f"its log ends: {said}; kubectl logs llama-0-1 -n ml",
        None,  # no termination message: nothing to quote
    ]


def test_an_exited_agent_whose_sidecar_runs_on_holds_its_node_and_a_completed_pod_does_not(world: World) -> None:
    world.add(pod(0, exit_code=0, sidecar=True), pod(1, phase="Succeeded", exit_code=0, ip="10.0.0.2"))
    holding = {w.name: w.holds_node for w in world.backend.list_workers(KEY, spec())}
    assert holding == {"llama-0-0": True, "llama-0-1": False}


def test_a_pod_on_a_deleted_node_is_a_lost_worker_although_its_object_says_running(world: World) -> None:
    world.add(pod(0, node_name="n2"), pod(1, ip="10.0.0.2"))
    world.nodes._remove(("", "n2"))
    world.signals.node_deleted(node("n2"))
    assert world.phases()["llama-0-0"] == (WorkerPhase.FAILED, None)
    assert world.phases()["llama-0-1"] == (WorkerPhase.RUNNING, None)
    (signal,) = world.backend.signals(KEY, spec())
    assert signal.kind is SignalKind.NODE_LOST and signal.node == "n2"


def test_the_first_start_creates_the_jobs_objects_once_then_replica_0_then_the_others_with_its_ip(
    world: World,
) -> None:
    world.backend.start_workers(KEY, spec(), 0, Placement())
    assert world.client.kinds() == ["secrets", "services", "networkpolicies", "pods"]
    world.backend.start_workers(KEY, spec(), 0, Placement())  # replica 0 not in the cache yet: nothing new
    assert world.client.kinds().count("pods") == 1
    world.add(pod(0, ready=False, ip=None))
    world.backend.start_workers(KEY, spec(), 0, Placement())
    assert world.client.kinds().count("pods") == 1  # no IP yet
    world.add(pod(0, ready=False, ip="10.1.2.3"))
    world.backend.start_workers(KEY, spec(), 0, Placement())
    pods_created = [b for r, b in world.client.created if r == "pods"]
    assert [p["metadata"]["name"] for p in pods_created] == ["llama-0-0", "llama-0-1"]
    args = pods_created[1]["spec"]["containers"][0]["args"]
    assert args[args.index("--master-addr") + 1] == "10.1.2.3"
    assert world.client.kinds().count("secrets") == 1


def test_what_the_backend_remembers_of_created_job_objects_is_one_entry_per_existing_job(world: World) -> None:
    # Before, it kept the uid of every job it ever started, for the controller's life.
    def job(name: str, uid: str) -> dict[str, Any]:
        return {
            "apiVersion": "spotjob.dev/v1alpha1",
            "kind": "SpotJob",
            "metadata": {"name": name, "namespace": "ml", "uid": uid},
        }

    for n in range(5):
        world.jobs._put(job(f"j{n}", f"uid-{n}"))
        world.backend.start_workers(JobKey("ml", f"j{n}"), spec(), 0, Placement())
        world.jobs._remove(("ml", f"j{n}"))  # deleted once it ran
    world.backend.start_workers(KEY, spec(), 0, Placement())
    assert world.backend._ensured == {("ml", "llama"): UID}
    # The same name again with a new uid: its objects are created again (the old ones went with
    # their owner), and only the new incarnation is remembered.
    secrets = world.client.kinds().count("secrets")
    world.jobs._put(job("llama", "uid-new"))
    world.backend.start_workers(KEY, spec(), 1, Placement())
    assert world.client.kinds().count("secrets") == secrets + 1
    assert world.backend._ensured == {("ml", "llama"): "uid-new"}


def test_jobs_started_at_once_by_several_reconcile_workers_all_have_their_objects_remembered(world: World) -> None:
    # The controller's reconcile workers start different jobs at the same time, and what the
    # backend remembers of created job objects is one dict they all update. Here a second worker
    # remembers its job exactly while the first walks that dict to drop the jobs gone: before, the
    # walk failed ("dictionary changed size during iteration") and the first job's start with it.
    errors: list[BaseException] = []

    def start(key: JobKey) -> None:
        try:
            world.backend.start_workers(key, spec(), 0, Placement())
        except BaseException as e:
            errors.append(e)

    for name in ("walked", "first", "second"):
        world.jobs._put(
            {
                "apiVersion": "spotjob.dev/v1alpha1",
                "kind": "SpotJob",
                "metadata": {"name": name, "namespace": "ml", "uid": f"uid-{name}"},
            }
        )
    second = threading.Thread(target=start, args=(JobKey("ml", "second"),))

    class Namespace(str):
        """The namespace "ml", which starts the second job the moment the first's walk looks at it."""

        armed = False

        def __hash__(self) -> int:
            if Namespace.armed:
                Namespace.armed = False
                second.start()
                second.join(timeout=2.0)  # done at once if nothing holds it back; else it waits its turn
            return str.__hash__(self)

    world.backend.start_workers(JobKey(Namespace("ml"), "walked"), spec(), 0, Placement())
    Namespace.armed = True
    start(JobKey("ml", "first"))
    second.join()
    assert not Namespace.armed, "the walk never looked at the walked job"
    assert errors == []
    assert set(world.backend._ensured) == {("ml", "walked"), ("ml", "first"), ("ml", "second")}


def test_new_workers_keep_off_nodes_in_cool_down_and_nodes_being_taken_away(world: World) -> None:
    world.add(
        node("n3", taints=[{"key": "aws-node-termination-handler/spot-itn", "effect": "NoExecute"}]),
        node("n4", taints=[{"key": "aws-node-termination-handler/rebalance-recommendation", "effect": "NoSchedule"}]),
    )
    annotated = node("n5")
    annotated["metadata"]["annotations"] = {
        "spotjob.dev/interruption": '{"kind": "SpotInterruption", "source": "aws-sqs"}'
    }
    world.add(annotated)
    world.backend.start_workers(KEY, spec(), 0, Placement(avoid_nodes=frozenset({"n1"})))
    (created,) = [b for r, b in world.client.created if r == "pods"]
    (term,) = created["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"
    ]
    # n4's rebalance recommendation is advisory (--rebalance ignore): not avoided.
    assert term["matchFields"] == [
        {"key": "metadata.name", "operator": "NotIn", "values": [n]} for n in ("n1", "n3", "n5")
    ]


def test_a_gang_stopped_without_a_flush_is_told_to_stop_first_and_deleted_once_the_agent_answered(
    world: World,
) -> None:
    world.add(pod(0), pod(1, ip="10.0.0.2"))
    world.agents.answer = CallResult(CallState.PENDING)
    world.backend.stop_workers(KEY, spec(), flush=False)
    assert world.agents.asked == [("stop", "llama-0-0"), ("stop", "llama-0-1")]
    assert world.client.deleted == []  # not before the agents were told (or could not be reached)
    world.agents.answer = CallResult(CallState.FAILED, "unreachable")
    world.backend.stop_workers(KEY, spec())  # a later pass, flush not repeated: the intent is remembered
    assert [name for _, name, _ in world.client.deleted] == ["llama-0-0", "llama-0-1"]


def test_a_gang_stopped_as_its_job_ends_keeps_the_exited_pods_and_deletes_those_still_running(world: World) -> None:
    """The stop of a job that ended (``keep_exited``): a Failed job's pods were all deleted, the
    crashed worker's with them, so ``kubectl logs`` found nothing. Now a live agent is told to stop
    and its pod deleted, an exited agent whose sidecar keeps its pod Running is deleted (it holds
    its node), and the pods that ended stay, whatever their exit."""
    world.add(
        pod(0, phase="Failed", ready=False, exit_code=1),
        pod(1, ip="10.0.0.2"),
        pod(2, exit_code=1, sidecar=True, ip="10.0.0.3"),
        pod(3, phase="Succeeded", ready=False, exit_code=0, ip="10.0.0.4"),
    )
    world.backend.stop_workers(KEY, spec(replicas=4), flush=False, keep_exited=True)
    assert world.agents.asked == [("stop", "llama-0-1")]
    assert sorted(name for _, name, _ in world.client.deleted) == ["llama-0-1", "llama-0-2"]


def test_a_gang_stopped_after_a_preemption_is_deleted_at_once_and_the_kept_attempt_left_alone(world: World) -> None:
    world.add(pod(0), pod(0, attempt=1, ip="10.0.0.9"))
    world.backend.stop_workers(KEY, spec(), keep_attempt=1)
    assert world.agents.asked == [] and world.client.deleted == [("pods", "llama-0-0", None)]


def test_starting_an_attempt_deletes_what_an_interrupted_stop_left_of_earlier_ones_but_never_a_live_agent(
    world: World,
) -> None:
    # Attempt 0 stopped without its delete going out (the leader died after writing the status):
    # replica 0 completed, replica 1's agent exited but a sidecar keeps its pod Running.
    world.add(
        pod(0, phase="Succeeded", ready=False, exit_code=75),
        pod(1, exit_code=75, sidecar=True, ip="10.0.0.2"),
        pod(0, attempt=1, phase="Pending", ready=False, ip=None),
    )
    world.backend.start_workers(KEY, spec(), 2, Placement())
    assert sorted(name for _, name, _ in world.client.deleted) == ["llama-0-0", "llama-0-1"]
    # A live agent of another attempt (attempt 1, still pending) is the reconciler's to stop, with
    # or without a flush: starting never deletes it.
    assert "llama-1-0" not in [name for _, name, _ in world.client.deleted]


def test_a_job_created_again_under_its_name_never_takes_its_predecessors_terminating_pods_for_its_own(
    world: World,
) -> None:
    # kubectl delete sj llama; kubectl apply: the old incarnation's pods flush for their grace
    # period under the same names and labels; one of them already exited (SIGTERM: 143).
    old = [pod(0, deleting=True), pod(1, exit_code=143, ip="10.0.0.2")]
    for p in old:
        p["metadata"]["ownerReferences"] = [
            {"apiVersion": "spotjob.dev/v1alpha1", "kind": "SpotJob", "name": "llama", "uid": "old", "controller": True}
        ]
    world.add(*old)
    assert world.backend.list_workers(KEY, spec()) == []
    world.backend.start_workers(KEY, spec(), 0, Placement())
    world.backend.stop_workers(KEY, spec(), flush=False)
    assert world.client.deleted == [] and world.agents.asked == []
    # Replica 0 is asked for (the API server answers AlreadyExists until the old pod is gone; the
    # next pass asks again), and no other replica is created against the old pod's address.
    assert [b["metadata"]["name"] for r, b in world.client.created if r == "pods"] == ["llama-0-0"]


def _placed(p: dict[str, Any], at: str) -> dict[str, Any]:
    p["status"]["conditions"].append({"type": "PodScheduled", "status": "True", "lastTransitionTime": at})
    return p


def _created(n: dict[str, Any], at: str) -> dict[str, Any]:
    n["metadata"]["creationTimestamp"] = at
    return n


def test_a_pod_placed_on_an_earlier_node_of_its_nodes_name_is_lost_and_force_deleted_when_terminating(
    world: World,
) -> None:
    """Karpenter names nodes after the instance's private DNS name and GKE after its VM, so a node
    can be deleted and a new one registered under the same name. A controller that did not see the
    deletion (restarted, a new leader, or its Node watch relisted after 410 Gone: a relist shows
    the new node as an update of the old) saw a Ready node and the pods bound to that name still
    saying Running: the worker was never lost and the job waited on a machine that no longer ran it.
    A pod placed (PodScheduled) before its node's Node object was created ran on an earlier one.
    What the dicts do not model: what a real new kubelet does with pods bound to its name (it may
    run them again from the start); that is what stopping them at once avoids."""
    world.add(
        _created(node("n1"), "2026-01-01T00:00:00Z"),
        _created(node("n2"), "2026-01-01T02:00:00Z"),  # replaced under its name after the pod came
        _placed(pod(0, node_name="n1"), "2026-01-01T00:00:00Z"),  # same second: the node's own pod
        _placed(pod(1, node_name="n2", ip="10.0.0.2"), "2026-01-01T01:00:00Z"),
    )
    assert world.phases() == {"llama-0-0": (WorkerPhase.RUNNING, None), "llama-0-1": (WorkerPhase.FAILED, None)}
    world.add(
        _placed(pod(0, node_name="n1", deleting=True), "2026-01-01T00:00:00Z"),
        _placed(pod(1, node_name="n2", ip="10.0.0.2", deleting=True), "2026-01-01T01:00:00Z"),
    )
    world.backend.stop_workers(KEY, spec())
    assert world.client.deleted == [("pods", "llama-0-1", 0)], "only the pod of the replaced node is forced"


def test_a_pod_stuck_terminating_on_a_lost_node_is_force_deleted_and_one_on_a_live_node_is_not(world: World) -> None:
    world.add(pod(0, deleting=True, node_name="n1"), pod(1, deleting=True, node_name="n2", ip="10.0.0.2"))
    world.add(node("n2", ready="Unknown"))
    world.backend.stop_workers(KEY, spec())
    assert world.client.deleted == [("pods", "llama-0-1", 0)]


@pytest.mark.parametrize("flush", [True, False])
def test_a_pod_on_a_lost_node_is_force_deleted_by_the_stop_itself(world: World, flush: bool) -> None:
    """A node partitioned away past the grace: the stop that follows NodeLost deleted its pod with
    the pod's own grace, which no kubelet would ever finish, and nothing forced it later (the next
    attempt had started): the pod stayed Terminating until the node came back. A pod on a live node
    is deleted gracefully as before."""
    world.add(pod(0, node_name="n1"), pod(1, node_name="n2", ip="10.0.0.2"))
    world.add(node("n1"), node("n2", ready="Unknown"))
    world.backend.stop_workers(KEY, spec(), flush=flush)
    deleted = dict(((name, grace) for _, name, grace in world.client.deleted))
    assert deleted.get("llama-0-1") == 0, world.client.deleted
    if flush:
        assert deleted.get("llama-0-0", "absent") is None, "the live node's pod keeps its grace"


def test_an_earlier_attempts_pod_stuck_terminating_on_a_lost_node_is_forced_when_the_next_attempt_starts(
    world: World,
) -> None:
    world.add(pod(0, node_name="n2", ip="10.0.0.2", deleting=True), pod(1, node_name="n1", deleting=True))
    world.add(node("n1"), node("n2", ready="Unknown"))
    world.backend.start_workers(KEY, spec(), 1, Placement())
    assert [(name, grace) for _, name, grace in world.client.deleted] == [("llama-0-0", 0)]


def test_a_node_in_cool_down_registered_again_under_its_name_is_a_new_machine_and_not_avoided(world: World) -> None:
    """GKE recreates a preempted spot VM of a node pool under the same instance name, and its node
    registers under the same node name. The cool-down kept the job off that name for
    ``cooldown.seconds`` (30 minutes by default): on a pool as large as the job, every replacement
    node stayed out of reach and the attempt waited Unschedulable that long. A name whose Node
    object was created after the cool-down began is a new machine; one created before stays
    avoided, and so does a name with no Node object at all."""
    preempted_at = datetime(2026, 1, 1, 1, 0, tzinfo=UTC)
    world.add(
        _created(node("n1"), "2026-01-01T01:02:00Z"),  # recreated after the preemption
        _created(node("n2"), "2026-01-01T00:00:00Z"),  # the same machine, back
    )
    since = tuple((n, preempted_at) for n in ("n1", "n2", "gone"))
    world.backend.start_workers(
        KEY, spec(), 0, Placement(avoid_nodes=frozenset({"n1", "n2", "gone"}), nodes_avoided_since=since)
    )
    (created,) = [b for r, b in world.client.created if r == "pods"]
    (term,) = created["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"
    ]
    assert term["matchFields"] == [{"key": "metadata.name", "operator": "NotIn", "values": [n]} for n in ("gone", "n2")]


def test_a_flush_to_a_pod_without_an_ip_fails_at_once_and_one_with_an_ip_goes_to_its_agent(world: World) -> None:
    world.add(pod(0, ip=None), pod(1, ip="10.0.0.2"))
    workers = {w.name: w for w in world.backend.list_workers(KEY, spec())}
    state = world.backend.request_flush(KEY, spec(), workers["llama-0-0"], "notice", None)
    assert state.outcome is FlushRequestOutcome.FAILED and "pod IP" in state.error
    state = world.backend.request_flush(KEY, spec(), workers["llama-0-1"], "notice", None)
    assert state.outcome is FlushRequestOutcome.ACCEPTED and world.agents.asked == [("flush", "llama-0-1")]


@pytest.mark.parametrize("what", ["flush", "save"])
def test_an_agents_answer_to_a_request_a_pass_left_pending_wakes_the_job(what: str) -> None:
    """Fails without the fix: the answer waited for the pass's next poll (1 s while flushing). A
    flush that committed and ended its worker within that second was never told as accepted (no
    FlushRequested Event), which the job's own status writes had hidden by waking it at once.

    The real ``AgentCalls``, whose transport (no HTTP here) answers once the test lets it."""
    release, woken = threading.Event(), threading.Event()
    keys: list[JobKey] = []

    def transport(*_call: Any) -> tuple[int, bytes]:
        assert release.wait(30), "the test never let the agent answer"
        return 202, b"{}"

    def wake(key: JobKey) -> None:
        keys.append(key)
        woken.set()

    agents = AgentCalls(port=8470, transport=transport)
    world = World(agents, wake)
    world.add(node("n1"))
    try:
        world.add(pod(0))
        worker = world.backend.list_workers(KEY, spec())[0]

        def ask() -> FlushRequestOutcome:
            if what == "flush":
                return world.backend.request_flush(KEY, spec(), worker, "notice", None).outcome
            return world.backend.request_save(KEY, spec(), worker, "r-1", "asked").outcome

        assert ask() is FlushRequestOutcome.PENDING
        assert not woken.is_set(), "woken before the agent answered"
        release.set()
        assert woken.wait(30), "the agent's answer did not wake the job"
        assert keys == [KEY]
        assert ask() is FlushRequestOutcome.ACCEPTED
    finally:
        agents.close()


def test_a_template_the_pods_cannot_be_built_from_is_a_spec_problem_naming_the_field(world: World) -> None:
    bad = spec(template={"spec": {"containers": [{"name": "t", "image": "i", "args": ["x"]}]}})
    problems = world.backend.spec_problems(KEY, bad)
    assert problems and problems[0].startswith("spec.template.spec.containers[0].args")
    assert world.backend.spec_problems(KEY, spec()) == []


def test_checkpoint_hint_annotations_in_the_template_are_a_spec_problem_and_reach_no_pod(world: World) -> None:
    """spotjob.dev/last-checkpoint-{time,step} written in spec.template.metadata.annotations were
    copied into every worker pod: with no checkpoint committed the controller never patched them,
    so a pod advertised a checkpoint (2099, step 999999) that did not exist, and the README's
    freshest-first listing ranked it first. They are the controller's to set: the job is Invalid."""
    container = {"name": "t", "image": "i"}
    for key, value in (
        ("spotjob.dev/last-checkpoint-time", "2099-01-01T00:00:00Z"),
        ("spotjob.dev/last-checkpoint-step", "999999"),
    ):
        template = {"metadata": {"annotations": {"team": "ml", key: value}}, "spec": {"containers": [container]}}
        problems = world.backend.spec_problems(KEY, spec(template=template))
        assert len(problems) == 1, f"the hint annotation {key} in the template is no spec problem: {problems}"
        problem = problems[0]
        assert problem.startswith(f"spec.template.metadata.annotations: {key!r} is set by the controller"), problem
        assert "status.lastCheckpoint" in problem and problem.endswith("remove it"), problem
        with pytest.raises(BackendError, match="is set by the controller"):
            world.backend.start_workers(KEY, spec(template=template), 0, Placement())
    assert not [b for r, b in world.client.created if r == "pods"]
    # The template's other annotations are the user's and reach the pod.
    ok = {"metadata": {"annotations": {"team": "ml"}}, "spec": {"containers": [container]}}
    assert world.backend.spec_problems(KEY, spec(template=ok)) == []
    world.backend.start_workers(KEY, spec(template=ok), 0, Placement())
    [created] = [b for r, b in world.client.created if r == "pods"]
    assert created["metadata"]["annotations"] == {"team": "ml"}


def test_without_a_template_the_container_is_named_by_container_name_which_must_be_a_name_kubernetes_takes(
    world: World,
) -> None:
    """spec.containerName was taken without a template and ignored (the container was named
    'trainer' whatever it said, and 'Trainer_X' passed); it now names the one container built, and
    a name Kubernetes refuses is a spec problem, as is an image with a space around it."""
    assert world.backend.spec_problems(KEY, spec(containerName="main")) == []
    world.backend.start_workers(KEY, spec(containerName="main"), 0, Placement())
    [created] = [b for r, b in world.client.created if r == "pods"]
    assert [c["name"] for c in created["spec"]["containers"]] == ["main"]
    [problem] = world.backend.spec_problems(KEY, spec(containerName="Trainer_X"))
    assert problem.startswith("spec.containerName: 'Trainer_X' is no container name Kubernetes takes"), problem
    [problem] = world.backend.spec_problems(KEY, spec(image="img:1 "))
    assert problem == "spec.image: 'img:1 ' has spaces around it, which Kubernetes refuses: remove them"


def test_a_template_env_variable_the_checkpoint_spec_sets_over_it_is_a_spec_problem(world: World) -> None:
    """SPOTJOB_EVERY_STEPS in the training container's env was replaced by spec.checkpoint.everySteps
    without a word; without everySteps it is the user's to set and stays."""
    container = {"name": "t", "image": "i", "env": [{"name": "SPOTJOB_EVERY_STEPS", "value": "10"}]}
    template = {"spec": {"containers": [container]}}
    with_policy = spec(template=template, checkpoint={"uri": "s3://b/llama", "everySteps": 50})
    problems = world.backend.spec_problems(KEY, with_policy)
    assert problems and problems[0].startswith("spec.template.spec.containers[0].env[0].name: SPOTJOB_EVERY_STEPS")
    assert "spec.checkpoint.everySteps" in problems[0]
    assert world.backend.spec_problems(KEY, spec(template=template)) == []


def test_a_spec_env_variable_spotjob_sets_over_it_is_a_spec_problem_as_a_stored_older_job_has_it(world: World) -> None:
    """The CRD refuses these in spec.env since 2026-12-04, but a SpotJob stored before (or under an
    older CRD) keeps them, and the API server never checks a stored object again: SPOTJOB_KEEP=10
    was replaced by spec.checkpoint.keep without a word, so retention removed checkpoints the user
    meant to keep. Found upgrading from 2026-12-03's controller; before the fix, no problem."""
    [problem] = world.backend.spec_problems(KEY, spec(env={"SPOTJOB_KEEP": "10"}))
    assert problem.startswith("spec.env.SPOTJOB_KEEP: set by spotjob in every worker, from spec.checkpoint.keep")
    assert problem.endswith("remove it from spec.env"), problem
    [problem] = world.backend.spec_problems(KEY, spec(env={"POD_IP": "10.0.0.1"}))
    assert problem.startswith("spec.env.POD_IP: set by spotjob (the downward API)"), problem
    # SPOTJOB_EVERY_STEPS is the user's to set unless spec.checkpoint.everySteps sets it too.
    assert world.backend.spec_problems(KEY, spec(env={"SPOTJOB_EVERY_STEPS": "10"})) == []
    both = spec(env={"SPOTJOB_EVERY_STEPS": "10"}, checkpoint={"uri": "s3://b/llama", "everySteps": 50})
    [problem] = world.backend.spec_problems(KEY, both)
    assert problem.startswith("spec.env.SPOTJOB_EVERY_STEPS: set by spotjob in every worker, from spec.checkpoint")
    assert "everySteps" in problem


@pytest.mark.parametrize(
    ("env", "said"),
    [
        ({"": "1"}, "spec.env: '' is no name Kubernetes takes for a container's variable"),
        ({"A=B": "1"}, "spec.env: 'A=B' is no name Kubernetes takes for a container's variable"),
        ({"CAF\u00c9": "1"}, "spec.env: 'CAF\u00c9' is no name Kubernetes takes for a container's variable"),
        ({"NL\n": "1"}, "spec.env: 'NL\\n' is no name Kubernetes takes for a container's variable"),
        ({"DATA": "a\x00b"}, "spec.env.DATA: the value holds a NUL character"),
    ],
    ids=["empty", "equals", "non-ascii", "newline", "nul-value"],
)
def test_a_spec_env_entry_kubernetes_refuses_is_a_spec_problem_naming_it(
    world: World, env: dict[str, str], said: str
) -> None:
    """The CRD refuses a NUL in a value at kubectl apply (a pattern), but not the names (a CEL rule
    would walk the map, at a cost no real API server estimated here), and a SpotJob stored under
    an older CRD keeps either: every attempt's pods were refused by the API server (a name it takes for no
    variable) or never started (a NUL in a value), and the job only counted infrastructure errors.
    The spec check names the variable, so the job is Invalid before any pod is made."""
    [problem] = world.backend.spec_problems(KEY, spec(env=env))
    assert problem.startswith(said), problem
    # Names every Kubernetes version since 1.32 takes are the user's.
    assert world.backend.spec_problems(KEY, spec(env={"my.var-1": "x", "1X": "\u00e9", "A B": ""})) == []


def test_a_queue_notice_on_the_node_the_job_left_is_no_signal_for_it_and_one_on_its_node_is(world: World) -> None:
    """The interruption-queue reader's annotation (what orchestrator.k8s.interruption_queue writes),
    read from the Node like a taint: only for the jobs with a worker there."""
    deadline = (datetime.now(UTC) + timedelta(minutes=2)).strftime("%Y-%m-%dT%H:%M:%SZ")
    notice = json.dumps({"kind": "SpotInterruption", "deadline": deadline, "messageId": "m-1", "source": "aws-sqs"})
    left = node("n2")
    left["metadata"]["annotations"] = {"spotjob.dev/interruption": notice}
    world.add(left, pod(0, node_name="n1"))
    assert world.backend.signals(KEY, spec()) == [], "a stale notice on a node the job has left changes nothing"

    here = node("n1")
    here["metadata"]["annotations"] = {"spotjob.dev/interruption": notice}
    world.add(here)
    (signal,) = world.backend.signals(KEY, spec())
    assert (signal.kind, signal.node, signal.source) == (SignalKind.SPOT_INTERRUPTION, "n1", "aws-sqs")


def test_a_failed_pod_carries_its_preemption_signal_and_a_succeeded_one_carries_none(world: World) -> None:
    """A worker killed by its node going away fails: the taint or DisruptionTarget on it says it was a
    preemption, not the user's code. A worker that finished has no signal to give."""
    failed = pod(0, phase="Failed", exit_code=143, node_name="n1")
    failed["status"]["conditions"].append(
        {"type": "DisruptionTarget", "status": "True", "reason": "DeletionByTaintManager"}
    )
    done = pod(1, phase="Succeeded", exit_code=0, node_name="n2", ip="10.0.0.2")
    tainted = [{"key": "aws-node-termination-handler/spot-itn", "effect": "NoExecute"}]
    world.add(failed, done, node("n1", taints=tainted), node("n2", taints=tainted))
    signals = world.backend.signals(KEY, spec())
    assert {s.node for s in signals} == {"n1"}, "nothing about n2, where a worker finished"
    assert {(s.kind, s.worker) for s in signals} == {
        (SignalKind.SPOT_INTERRUPTION, None),
        (SignalKind.DISRUPTION_TARGET, "llama-0-0"),
    }


def test_a_placed_pod_whose_image_cannot_be_pulled_is_a_worker_not_starting_and_one_creating_is_not(
    world: World,
) -> None:
    pulling = pod(0, phase="Pending", ready=False, ip=None)
    pulling["status"]["containerStatuses"] = [
        {"name": "trainer", "state": {"waiting": {"reason": "ImagePullBackOff", "message": 'Back-off pulling "x"'}}}
    ]
    creating = pod(1, phase="Pending", ready=False, ip=None, node_name="n2")
    creating["status"]["containerStatuses"] = [
        {"name": "trainer", "state": {"waiting": {"reason": "ContainerCreating"}}}
    ]
    bad_init = pod(2, phase="Pending", ready=False, ip=None, node_name="n3")
    bad_init["status"]["initContainerStatuses"] = [
        {"name": "fetch", "state": {"waiting": {"reason": "CreateContainerConfigError", "message": "no secret s"}}}
    ]
    world.add(pulling, creating, bad_init, node("n1"), node("n2"), node("n3"))

    observed = {w.name: w.not_starting for w in world.backend.list_workers(KEY, spec())}

    assert observed == {
        "llama-0-0": ("ImagePullBackOff", 'container trainer: Back-off pulling "x"'),
        "llama-0-1": None,
        "llama-0-2": ("CreateContainerConfigError", "container fetch: no secret s"),
    }


def test_workers_avoiding_several_nodes_are_accepted_by_the_api_server(test_api: Any) -> None:
    """A node field selector takes one value per NotIn: the API server refuses a list of nodes."""
    from orchestrator.k8s.api import PODS

    namespaces = Resource("", "v1", "namespaces", "Namespace", namespaced=False)
    test_api.admin.create(namespaces, {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "ml"}})
    w = World()
    w.backend = KubernetesBackend(
        test_api.admin,
        jobs=w.jobs,
        pods_cache=w.pods,
        nodes=w.nodes,
        signals=w.signals,
        token_key=b"k" * 32,
        options=BackendOptions(network_policy=False),
        agents=w.agents,  # type: ignore[arg-type]
    )
    w.add(node("n3", taints=[{"key": "aws-node-termination-handler/spot-itn", "effect": "NoExecute"}]))
    w.backend.start_workers(KEY, spec(), 0, Placement(avoid_nodes=frozenset({"n1", "n2"})))
    created = test_api.admin.get(PODS, "llama-0-0", "ml")
    (term,) = created["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"
    ]
    assert term["matchFields"] == [
        {"key": "metadata.name", "operator": "NotIn", "values": [n]} for n in ("n1", "n2", "n3")
    ]


def test_a_worker_runs_once_its_trainer_is_ready_though_a_helper_that_finished_keeps_the_pod_unready(
    world: World,
) -> None:
    # A pod is Ready only while every container is: a helper container that exited 0 (or a
    # sidecar whose own readiness probe fails) keeps it unready for good. The trainer's own
    # readiness is its agent's /readyz, and it alone says the ranks train.
    helped = pod(0, ready=False)
    helped["spec"]["containers"].append({"name": "warm-cache"})
    helped["status"]["containerStatuses"][0]["ready"] = True
    helped["status"]["containerStatuses"].append(
        {"name": "warm-cache", "ready": False, "state": {"terminated": {"exitCode": 0}}}
    )
    starting = pod(1, ready=True, ip="10.0.0.2")  # the pod says Ready, its trainer not (yet)
    starting["status"]["containerStatuses"][0]["ready"] = False
    world.add(helped, starting)
    assert world.phases() == {"llama-0-0": (WorkerPhase.RUNNING, None), "llama-0-1": (WorkerPhase.PENDING, None)}


def _failed_by_init(index: int, code: int, **init: Any) -> dict[str, Any]:
    failed = pod(index, phase="Failed", ready=False, ip=f"10.0.0.{index + 1}")
    failed["spec"]["initContainers"] = [{"name": "fetch", **init}]
    failed["status"]["containerStatuses"][0]["state"] = {"waiting": {"reason": "PodInitializing"}}
    failed["status"]["initContainerStatuses"] = [
        {"name": "fetch", "state": {"terminated": {"exitCode": code, "reason": "Error", "message": "no dataset\n"}}}
    ]
    return failed


def test_a_pod_failed_by_its_init_container_is_that_containers_failure_and_no_lost_worker(world: World) -> None:
    evicted = _failed_by_init(3, 137)
    evicted["status"]["reason"] = "Evicted"
    world.add(
        _failed_by_init(0, 3),
        _failed_by_init(1, 75),  # an agent's code from another program means nothing: a plain failure
        _failed_by_init(2, 1, restartPolicy="Always"),  # a native sidecar the kubelet stopped: no verdict
        evicted,  # the node was short of memory: lost, whatever the container said
        node("n3"),
    )
    observed = {w.name: w for w in world.backend.list_workers(KEY, spec(replicas=4))}
    assert {n: (w.phase, w.exit_code) for n, w in observed.items()} == {
        "llama-0-0": (WorkerPhase.FAILED, 3),
        "llama-0-1": (WorkerPhase.FAILED, 1),
        "llama-0-2": (WorkerPhase.FAILED, None),
        "llama-0-3": (WorkerPhase.FAILED, None),
    }
    assert observed["llama-0-0"].detail == (
        "init container fetch exited 3 (Error) before the training container started: no dataset; "
        "kubectl logs llama-0-0 -c fetch"
    )
    assert observed["llama-0-1"].detail is not None and "exited 75" in observed["llama-0-1"].detail
    assert observed["llama-0-2"].detail is None and observed["llama-0-3"].detail is None


def test_an_oom_killed_training_container_or_rank_says_so_with_its_memory_limit_and_the_staging_copy(
    world: World,
) -> None:
    """The kubelet's ``OOMKilled`` (a cgroup v2 node kills the whole container: the agent leaves no
    line about it). The worker read only "exited with code 137", like a script's own exit; the
    detail now names the out-of-memory kill, the limit, and the async save's staging copy. A 137
    that is not the kubelet's OOM kill (reason Error) gets no such detail, unless the agent's log
    tail (the termination message) says its launcher saw a rank killed by SIGKILL: that line."""
    oom = pod(0, exit_code=137, phase="Failed")
    oom["status"]["containerStatuses"][0]["state"]["terminated"]["reason"] = "OOMKilled"
    oom["spec"]["containers"][0]["resources"] = {"limits": {"memory": "8Gi"}}
    killed = pod(1, exit_code=137, phase="Failed", ip="10.0.0.2")
    killed["status"]["containerStatuses"][0]["state"]["terminated"]["reason"] = "Error"
    rank_killed = pod(2, exit_code=137, phase="Failed", ip="10.0.0.3")
    rank_killed["status"]["containerStatuses"][0]["state"]["terminated"].update(
        reason="Error",
        message="step 40\nspotjob-agent launcher: rank 3 (pid 77) was killed by SIGKILL (exit 137: SIGKILL is "
        "what the kernel's OOM killer sends ...): stopping the other 1 rank(s)\n",
    )
    world.add(oom, killed, rank_killed)
    observed = {w.name: w for w in world.backend.list_workers(KEY, spec())}
    assert (observed["llama-0-0"].phase, observed["llama-0-0"].exit_code) == (WorkerPhase.FAILED, 137)
    detail = observed["llama-0-0"].detail
    assert detail is not None and "out of memory (OOMKilled, exit 137; memory limit 8Gi)" in detail, detail
    assert "second host copy" in detail and "release_staging=True" in detail, detail
    assert observed["llama-0-1"].detail is None
    detail = observed["llama-0-2"].detail
    assert detail is not None and detail.startswith("spotjob-agent launcher: rank 3 (pid 77) was killed by SIGKILL")
    assert detail.endswith("kubectl logs llama-0-2"), detail


def test_a_worker_the_kubelet_evicted_for_its_own_storage_limit_says_so_and_names_the_staging_folder(
    world: World,
) -> None:
    """The kubelet evicts a pod past its own ephemeral-storage limit or an emptyDir's sizeLimit at
    once (grace 0, so the trainer ends 137) with status reason Evicted and its message, and no
    DisruptionTarget (that condition is for node-pressure evictions): a failure of the job, as
    before, but the worker read only "exited with code 137", which reads as an out-of-memory kill.
    Checkpoints staged in the spotjob-staging emptyDir count against that limit. The statuses are
    the kubelet's as its eviction manager writes them; no kubelet runs here."""
    evicted = pod(0, exit_code=137, phase="Failed")
    evicted["status"]["containerStatuses"][0]["state"]["terminated"]["reason"] = "Error"
    evicted["status"].update(
        reason="Evicted", message="Pod ephemeral local storage usage exceeds the total limit of containers 20Gi. "
    )
    sized = pod(1, exit_code=137, phase="Failed", ip="10.0.0.2")
    sized["status"].update(reason="Evicted", message='Usage of EmptyDir volume "data" exceeds the limit "1Gi". ')
    # As the kubelet often writes it: the container it killed is "not located", 137 all the same.
    sized["status"]["containerStatuses"][0]["state"]["terminated"]["reason"] = "ContainerStatusUnknown"
    world.add(evicted, sized)
    observed = {w.name: w for w in world.backend.list_workers(KEY, spec())}
    assert (observed["llama-0-0"].phase, observed["llama-0-0"].exit_code) == (WorkerPhase.FAILED, 137)
    assert (observed["llama-0-1"].phase, observed["llama-0-1"].exit_code) == (WorkerPhase.FAILED, 137)
    detail = observed["llama-0-0"].detail
    assert detail is not None and detail.startswith(
        "evicted by the kubelet: Pod ephemeral local storage usage exceeds the total limit of containers 20Gi."
    ), detail
    assert "spotjob-staging" in detail and "ephemeral-storage" in detail, detail
    detail = observed["llama-0-1"].detail
    assert detail is not None and 'EmptyDir volume "data" exceeds the limit "1Gi"' in detail, detail


def test_a_worker_whose_agent_cannot_be_asked_to_flush_is_deleted_so_that_its_sigterm_flushes() -> None:
    """Fails without the fix: an agent the controller could not reach (a NetworkPolicy, a refused
    token) was asked again every pass and its pod left running until flushTimeoutSeconds (90 s by
    default) — the whole of a 30 s notice, with the agent never told. Its pod is now deleted
    gracefully at the first failure: the SIGTERM is a notice the agent flushes on. A pod already
    being deleted is not deleted again.

    The real ``AgentCalls`` against a port nothing listens on (refused); the client is the fake of
    this file, which records the deletion but models no kubelet sending the SIGTERM."""
    agents = AgentCalls(port=9, timeout=2.0)
    world = World(agents, None)
    world.add(node("n1"))
    try:
        world.add(pod(0, ip="127.0.0.1"))
        worker = world.backend.list_workers(KEY, spec())[0]
        assert world.backend.request_flush(KEY, spec(), worker, "notice", None).outcome is FlushRequestOutcome.PENDING
        for _ in range(3000):
            if agents.state("flush", "uid-0-0") != CallResult(CallState.PENDING):
                break
            threading.Event().wait(0.01)
        state = world.backend.request_flush(KEY, spec(), worker, "notice", None)
        assert state.outcome is FlushRequestOutcome.FAILED and "cannot reach the agent" in state.error
        assert "SIGTERM" in state.error
        assert world.client.deleted == [("pods", "llama-0-0", None)], "deleted gracefully, once"

        world.add(pod(0, ip="127.0.0.1", deleting=True))
        world.backend.request_flush(KEY, spec(), worker, "notice", None)
        world.backend.request_flush(KEY, spec(), worker, "notice", None)
        assert world.client.deleted == [("pods", "llama-0-0", None)], "a pod being deleted is not deleted again"
    finally:
        agents.close()


def test_a_checkpoint_uri_the_agent_refuses_points_at_spec_checkpoint_uri_not_at_env(world: World) -> None:
    """Found walking the README on the test cluster: `checkpoint: {uri: ftp://x/y}` made the job
    Invalid with "fix or remove it in spec.env or the template's training container env", where
    no such variable is; the URI comes from spec.checkpoint.uri, so the message now says that."""
    [problem] = world.backend.spec_problems(KEY, spec(checkpoint={"uri": "ftp://x/y"}))
    assert "unsupported checkpoint URI scheme 'ftp'" in problem, problem
    assert problem.endswith("fix it in spec.checkpoint.uri"), problem
    [problem] = world.backend.spec_problems(KEY, spec(env={"SPOTJOB_AGENT_PREFETCH": "nodes"}))
    assert problem.endswith("fix or remove it in spec.env or the template's training container env"), problem


def test_a_relative_checkpoint_path_is_refused_on_kubernetes_naming_the_field(world: World) -> None:
    """Found walking the README on the test cluster: `checkpoint: {uri: ckpt/run}` ran, the workers
    writing under their own working folder and the controller listing another under its own, so
    STEP stayed empty and a restart would resume from what the controller saw (nothing)."""
    [problem] = world.backend.spec_problems(KEY, spec(checkpoint={"uri": "ckpt/run"}))
    assert problem.startswith("spec.checkpoint.uri: 'ckpt/run' is a relative path"), problem
    assert "file:///" in problem and "s3://" in problem, problem
    assert world.backend.spec_problems(KEY, spec(checkpoint={"uri": "/shared/ckpt/run"})) == []
    assert world.backend.spec_problems(KEY, spec(checkpoint={"uri": "file:///shared/ckpt/run"})) == []


def test_the_pod_security_controls_a_refusal_names_are_told_in_the_singular_and_the_plural() -> None:
    """The API server names a control in the plural when several values break it ("hostPorts",
    "hostPath volumes", "forbidden AppArmor profiles", "restricted volume types", "forbidden
    sysctls"), and the baseline's "non-default capabilities" was no control the advice knew: a
    refusal naming only these was told to set a securityContext, where the fix is to remove them.
    Found in review."""
    from orchestrator.backends.k8s import _pss_controls

    said = (
        'pods "train-0-0" is forbidden: violates PodSecurity "restricted:latest": hostPorts (container '
        '"trainer" uses hostPorts 80, 81), forbidden AppArmor profiles (annotations "a", "b"), non-default '
        'capabilities (container "trainer" must not include "NET_ADMIN" in securityContext.capabilities.add), '
        'hostPath volume (volume "data"), restricted volume types (volumes "a", "b"), forbidden sysctl (a.b)'
    )
    assert _pss_controls(said) == [
        "hostPort",
        "hostPath volume",
        "restricted volume type",
        "forbidden sysctl",
        "forbidden AppArmor profile",
        "non-default capabilities",
    ]
