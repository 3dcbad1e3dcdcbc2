"""The reconciler on Kubernetes parts (``KubeJobStore``, ``KubernetesBackend``, the informers) over the
test API server with the chart's CRD, one pass at a time: what a pass does to a SpotJob that is
being deleted, and to one whose worker's node was replaced under its name. No kubelet: the pods
the controller creates stay Pending, and the test plays the garbage collector (and, where it says
so, the scheduler and the kubelet).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from ctl_support import CONTROLLER_USER, NAMESPACES, TestApi, install_spotjob_crd, wait_for

from agent.control_api import ControlApi
from agent.control_channel import ControlDir
from agent.launcher import Agent, AgentConfig
from agent.notices.base import Notice, NoticeKind
from orchestrator.backends.k8s import BackendOptions, KubernetesBackend
from orchestrator.k8s.agents import AgentCalls, derive_token
from orchestrator.k8s.api import EVENTS, MIN_KUBERNETES, NODES, PODS, SPOTJOBS, KubeClient, Resource
from orchestrator.k8s.cluster_signals import NOTICE_INDEX, ClusterSignals, notice_index
from orchestrator.k8s.events import EventRecorder, JobEventSink
from orchestrator.k8s.informer import Informer
from orchestrator.k8s.pods import JOB_LABEL
from orchestrator.k8s.store import LAST_APPLIED_ANNOTATION, KubeJobStore
from orchestrator.kubectl_status import next_step
from orchestrator.model import JobKey, Phase, parse_timestamp
from orchestrator.reconciler import Reconciler
from orchestrator.reconciler._pass import Clock

KEY = JobKey("default", "llama")
CORE_EVENTS = Resource("", "v1", "events", "Event", namespaced=True)
"""Events as core v1 serves them, which the controller never writes (read as the administrator)."""
HOLD = "example.com/hold"
"""Another tool's finalizer on the SpotJob: it keeps the job readable, being deleted, until removed."""


def _pod_job(pod: dict[str, Any]) -> list[str]:
    job = ((pod.get("metadata") or {}).get("labels") or {}).get(JOB_LABEL)
    return [f"{pod['metadata']['namespace']}/{job}"] if job else []


class Parts:
    """The controller's parts for one test, its informers running; ``agents`` and ``events`` as the
    controller wires them when given (else the backend's own and the reconciler's logging sink)."""

    def __init__(
        self,
        api: TestApi,
        tmp_path: Path,
        *,
        agents: AgentCalls | None = None,
        events: bool = False,
        clock: Clock | None = None,
    ) -> None:
        self.client: KubeClient = api.client()
        self.jobs = Informer(self.client, SPOTJOBS, namespaces=["default"])
        self.pods = Informer(
            self.client, PODS, namespaces=["default"], label_selector=JOB_LABEL, indexers={"job": _pod_job}
        )
        self.nodes = Informer(self.client, NODES, indexers={NOTICE_INDEX: notice_index})
        for informer in (self.jobs, self.pods, self.nodes):
            informer.start()
        for informer in (self.jobs, self.pods, self.nodes):
            assert informer.wait_for_sync(30)
        backend = KubernetesBackend(
            self.client,
            jobs=self.jobs.cache,
            pods_cache=self.pods.cache,
            nodes=self.nodes.cache,
            signals=ClusterSignals(),
            token_key=b"k" * 32,
            options=BackendOptions(network_policy=False),
            agents=agents,
        )
        self.store = KubeJobStore(self.client, self.jobs.cache)
        sink = JobEventSink(EventRecorder(self.client, instance="r"), self.jobs.cache, self.nodes.cache)
        self.reconciler = Reconciler(self.store, backend, clock, events=sink if events else None)
        self.uri = str(tmp_path / "ckpt")

    def stop(self) -> None:
        for informer in (self.jobs, self.pods, self.nodes):
            informer.stop()
        self.client.close()

    def pod_names(self) -> list[str]:
        return sorted(p["metadata"]["name"] for p in self.pods.cache.list())


@pytest.fixture
def parts(test_api: TestApi, tmp_path: Path) -> Iterator[Parts]:
    install_spotjob_crd(test_api)
    p = Parts(test_api, tmp_path)
    yield p
    p.stop()


def spotjob(uri: str) -> dict[str, Any]:
    return {
        "apiVersion": "spotjob.dev/v1alpha1",
        "kind": "SpotJob",
        "metadata": {"name": KEY.name, "finalizers": [HOLD]},
        "spec": {"image": "img:1", "command": ["train.py"], "checkpoint": {"uri": uri}},
    }


def test_a_spotjob_being_deleted_gets_no_new_attempt_when_its_pods_go(test_api: TestApi, parts: Parts) -> None:
    test_api.admin.create(SPOTJOBS, spotjob(parts.uri), "default")
    wait_for(lambda: parts.jobs.cache.get("default", KEY.name), what="the job in the cache")
    assert parts.reconciler.reconcile(KEY).phase is Phase.PENDING
    wait_for(lambda: parts.pod_names() == ["llama-0-0"], what="attempt 0's pod in the cache")

    # kubectl delete: the finalizer keeps the job, being deleted; its pods go (the garbage
    # collector's work with --cascade=foreground, played here).
    test_api.admin.delete(SPOTJOBS, KEY.name, "default")
    wait_for(
        lambda: (parts.jobs.cache.get("default", KEY.name) or {}).get("metadata", {}).get("deletionTimestamp"),
        what="the deletion in the cache",
    )
    test_api.admin.delete(PODS, "llama-0-0", "default", grace_period_seconds=0)
    wait_for(lambda: parts.pod_names() == [], what="the pod gone from the cache")
    for _ in range(3):
        parts.reconciler.reconcile(KEY)

    stored = parts.store.get(KEY)
    assert stored is not None and stored.status is not None
    assert stored.status.phase is Phase.PENDING and stored.status.preemptions == 0, stored.status
    assert stored.status.attempt.number == 0
    assert [p["metadata"]["name"] for p in test_api.admin.list(PODS, "default")[0]] == []


def _node(name: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name}}


def _register_node(test_api: TestApi, name: str) -> None:
    """A kubelet registering: the Node, then its Ready condition (the status subresource)."""
    node = test_api.admin.create(NODES, _node(name))
    node["status"] = {"conditions": [{"type": "Ready", "status": "True"}]}
    test_api.admin.replace(NODES, node, subresource="status")


def _run_on(test_api: TestApi, pod_name: str, node: str, pod_ip: str | None = None) -> None:
    """The scheduler's binding (the server stamps PodScheduled), then a kubelet's Running status
    with the training container ready (and ``pod_ip``, when given)."""
    binding = {"apiVersion": "v1", "kind": "Binding", "metadata": {"name": pod_name}, "target": {"name": node}}
    path = PODS.path("default", pod_name, "binding")
    test_api.admin._json("create", PODS, "POST", path, body=binding, subresource="binding")
    pod = test_api.admin.get(PODS, pod_name, "default")
    (trainer,) = pod["spec"]["containers"]
    pod["status"]["phase"] = "Running"
    pod["status"]["containerStatuses"] = [{"name": trainer["name"], "ready": True, "state": {"running": {}}}]
    if pod_ip is not None:
        pod["status"]["podIP"] = pod_ip
    test_api.admin.replace(PODS, pod, subresource="status")


def _running_on_n1(test_api: TestApi, parts: Parts, pod_ip: str | None = None, *, create: bool = True) -> None:
    """The job created (unless it is already) and reconciled, its one worker bound to node ``n1``
    and running there."""
    _register_node(test_api, "n1")
    if create:
        test_api.admin.create(SPOTJOBS, spotjob(parts.uri), "default")
    wait_for(lambda: parts.jobs.cache.get("default", KEY.name), what="the job in the cache")
    parts.reconciler.reconcile(KEY)
    wait_for(lambda: parts.pod_names() == ["llama-0-0"], what="attempt 0's pod in the cache")
    _run_on(test_api, "llama-0-0", "n1", pod_ip)
    wait_for(
        lambda: (parts.pods.cache.get("default", "llama-0-0") or {}).get("status", {}).get("phase") == "Running",
        what="the pod running in the cache",
    )
    assert parts.reconciler.reconcile(KEY).phase is Phase.RUNNING


def test_a_worker_whose_node_was_replaced_under_its_name_while_no_controller_watched_is_lost(
    test_api: TestApi, parts: Parts, tmp_path: Path
) -> None:
    """Karpenter and GKE reuse node names. The node of a running worker is deleted and a new one
    registers under its name while no controller watches (restarted, or a leader change): the new
    controller lists a Ready node and a pod that still says Running, and kept waiting on a worker
    no machine ran. The test plays the scheduler (a real binding: the server stamps PodScheduled)
    and the kubelet (the pod's status); what it does not model is what a real new kubelet does with
    a pod bound to its name, and the creation times are whole seconds, hence the pause."""
    _running_on_n1(test_api, parts)
    parts.stop()

    test_api.admin.delete(NODES, "n1")
    time.sleep(1.1)  # a creationTimestamp in a later second than the binding's PodScheduled
    _register_node(test_api, "n1")
    fresh = Parts(test_api, tmp_path)
    try:
        assert fresh.reconciler.reconcile(KEY).phase is not Phase.RUNNING
        status = test_api.admin.get(SPOTJOBS, KEY.name, "default")["status"]
        assert status["preemptions"] == 1 and status["restarts"] == 0, status
        (restart,) = status["restartHistory"]
        assert "node n1 was registered again" in restart["message"], restart
    finally:
        fresh.stop()


def test_a_worker_whose_container_the_kubelet_could_not_find_is_lost_not_failed(
    test_api: TestApi, parts: Parts
) -> None:
    """A node that rebooted (a kernel panic, a GPU's Xid error, host maintenance) and came back
    before ``--node-lost-grace-seconds``: its kubelet finds no container for a pod that was running
    and, the pod being ``restartPolicy: Never``, ends it with each container terminated
    ``ContainerStatusUnknown``, exit 137 (the kubelet's status manager, TerminatePod). That 137 is
    the kubelet's, not the agent's: the job counted a failure of the user's code and spent a
    restart. The test writes that status as the kubelet would; no kubelet runs."""
    _running_on_n1(test_api, parts)

    pod = test_api.admin.get(PODS, "llama-0-0", "default")
    unknown = {
        "exitCode": 137,
        "reason": "ContainerStatusUnknown",
        "message": "The container could not be located when the pod was terminated",
    }
    pod["status"]["phase"] = "Failed"
    pod["status"]["containerStatuses"][0].update(ready=False, state={"terminated": unknown})
    test_api.admin.replace(PODS, pod, subresource="status")
    wait_for(
        lambda: (parts.pods.cache.get("default", "llama-0-0") or {}).get("status", {}).get("phase") == "Failed",
        what="the failed pod in the cache",
    )
    parts.reconciler.reconcile(KEY)
    status = test_api.admin.get(SPOTJOBS, KEY.name, "default")["status"]
    assert status["preemptions"] == 1 and status["restarts"] == 0, status
    (restart,) = status["restartHistory"]
    assert restart["reason"] == "WorkerLost" and "ContainerStatusUnknown" in restart["message"], restart


@pytest.mark.parametrize(("gone", "crd"), [("withdrawn", "shipped"), ("flushing", "shipped"), ("withdrawn", "older")])
def test_a_notice_an_agent_holds_is_shown_on_the_spotjob_told_once_and_removed_when_it_goes(
    test_api: TestApi, tmp_path: Path, gone: str, crd: str
) -> None:
    """An Azure Reboot 15 minutes ahead: the worker's agent holds it (``--flush-lead``) and trains on.
    Before, only the agent's own ``GET /status`` said so: the SpotJob's status and Events did not.
    Now the poll that reads the step takes it: ``status.heldNotices`` names the worker, node,
    source, kind, deadline and flush time, one ``NoticeHeld`` Event tells it (on the job and the
    node), passes that find the same notice write nothing, a notice the cloud moves is told again
    with its new time, and it goes from the status once the cloud withdraws it or the flush
    starts. Under a CRD older than the field (``crds.enabled=false``, not applied yet) the server
    drops it: the status is not written again at each pass for that, nor the Event told again.
    The agent is the real one's state and control API (no ranks, no command); the test plays the
    kubelet (the pod's Running status and IP)."""
    install_spotjob_crd(test_api, without_status=("heldNotices",) if crd == "older" else ())
    agent = Agent(AgentConfig(command=["true"], checkpoint_uri="file:///c"), ControlDir(str(tmp_path / "ctl")), env={})
    job = test_api.admin.create(SPOTJOBS, spotjob(str(tmp_path / "ckpt")), "default")
    api = ControlApi(agent, token=derive_token(b"k" * 32, "default", KEY.name, job["metadata"]["uid"]))
    api.start()
    calls = AgentCalls(port=api.port, status_max_age=0.0)
    parts = Parts(test_api, tmp_path, agents=calls, events=True)
    try:
        _running_on_n1(test_api, parts, "127.0.0.1", create=False)
        deadline = time.time() + 900
        agent.on_notice(
            Notice(source="azure", kind=NoticeKind.MAINTENANCE, deadline=deadline, detail="Reboot e-1", event_id="e-1")
        )

        def held() -> list[dict[str, Any]] | None:
            parts.reconciler.reconcile(KEY)
            found: list[dict[str, Any]] | None = test_api.admin.get(SPOTJOBS, KEY.name, "default")["status"].get(
                "heldNotices"
            )
            return found

        if crd == "older":
            wait_for(lambda: held() is None and told(test_api), what="the NoticeHeld Event")
        else:
            (notice,) = wait_for(held, what="the held notice in the SpotJob's status")
            assert {k: notice[k] for k in ("worker", "node", "source", "kind", "detail")} == {
                "worker": "llama-0-0",
                "node": "n1",
                "source": "azure",
                "kind": "maintenance",
                "detail": "Reboot e-1",
            }, notice
            assert parse_timestamp(notice["deadline"]).timestamp() == round(deadline)
            assert parse_timestamp(notice["flushAt"]).timestamp() == round(deadline - 300)

        seen = len(test_api.audit())
        for _ in range(3):
            parts.reconciler.reconcile(KEY)
        writes = [r for r in test_api.audit(seen) if r["resource"] == "spotjobs" and r["verb"] == "update"]
        assert writes == [], writes  # nothing changed: no status write
        events = told(test_api)
        assert sorted(e["regarding"]["kind"] for e in events) == ["Node", "SpotJob"], events
        assert all(not e.get("series") for e in events), events  # told once, not once per pass
        assert "llama-0-0 on node n1 holds azure's maintenance notice (Reboot e-1), due at" in events[0]["note"]

        if crd == "older":
            return  # the server keeps no held notice for it to leave
        if gone == "withdrawn":
            # Azure moves the event: the status follows, and the new time is told.
            later = deadline + 120
            moved = Notice(
                source="azure", kind=NoticeKind.MAINTENANCE, deadline=later, detail="Reboot e-1", event_id="e-1"
            )
            agent.on_notice(moved)
            wait_for(
                lambda: [parse_timestamp(h["deadline"]).timestamp() for h in held() or []] == [round(later)],
                what="the moved deadline in the status",
            )
            assert len([e for e in told(test_api) if e["regarding"]["kind"] == "SpotJob"]) == 2
            withdrawn = Notice(
                source="azure", kind=NoticeKind.MAINTENANCE, deadline=None, detail="e-1", event_id="e-1", withdrawn=True
            )
            agent.on_notice(withdrawn)
        else:
            agent.on_notice(Notice(source="sigterm", kind=NoticeKind.TERMINATE, deadline=time.time() + 30, detail="x"))
        wait_for(lambda: held() is None, what="the held notice gone from the SpotJob's status")
    finally:
        parts.stop()
        calls.close()
        api.stop()


def told(test_api: TestApi) -> list[dict[str, Any]]:
    """The ``NoticeHeld`` Events in the namespace."""
    return [e for e in test_api.admin.list(EVENTS, "default")[0] if e["reason"] == "NoticeHeld"]


def _events(test_api: TestApi, reason: str) -> list[dict[str, Any]]:
    return [e for e in test_api.admin.list(EVENTS, "default")[0] if e["reason"] == reason]


def test_a_spotjob_whose_env_the_agent_would_refuse_is_invalid_before_any_pod_is_made(
    test_api: TestApi, tmp_path: Path
) -> None:
    """``SPOTJOB_AGENT_PREFETCH=nodes`` in ``spec.env``: the CRD takes any string, and before the
    fix every worker's agent exited 2 in its pod (a failure of the user's code, three restarts,
    Failed). Now the controller's first pass refuses it in the agent's own words: Invalid=True, an
    InvalidSpec Event, no pod. Fixing the value lets the job start."""
    install_spotjob_crd(test_api)
    parts = Parts(test_api, tmp_path, events=True)
    try:
        job = spotjob(parts.uri)
        job["spec"]["env"] = {"SPOTJOB_AGENT_PREFETCH": "nodes"}
        test_api.admin.create(SPOTJOBS, job, "default")
        wait_for(lambda: parts.jobs.cache.get("default", KEY.name), what="the job in the cache")
        parts.reconciler.reconcile(KEY)

        status = test_api.admin.get(SPOTJOBS, KEY.name, "default")["status"]
        [invalid] = [c for c in status["conditions"] if c["type"] == "Invalid"]
        assert invalid["status"] == "True" and invalid["reason"] == "InvalidSpec", invalid
        said = "SPOTJOB_AGENT_PREFETCH 'nodes': expected one of node, all, off"
        assert said in invalid["message"] and "spec.env" in invalid["message"], invalid
        [event] = _events(test_api, "InvalidSpec")
        assert event["type"] == "Warning" and said in event["note"], event
        assert test_api.admin.list(PODS, "default")[0] == []

        fixed = test_api.admin.get(SPOTJOBS, KEY.name, "default")
        fixed["spec"]["env"] = {"SPOTJOB_AGENT_PREFETCH": "node"}
        test_api.admin.replace(SPOTJOBS, fixed)
        wait_for(
            lambda: (
                (parts.jobs.cache.get("default", KEY.name) or {}).get("spec", {}).get("env")
                == {"SPOTJOB_AGENT_PREFETCH": "node"}
            ),
            what="the fixed spec in the cache",
        )
        parts.reconciler.reconcile(KEY)
        wait_for(lambda: parts.pod_names() == ["llama-0-0"], what="attempt 0's pod")
    finally:
        parts.stop()


def _no_image(spec: dict[str, Any]) -> None:
    del spec["image"]


def _template_env_as_a_map(spec: dict[str, Any]) -> None:
    spec["template"] = {"spec": {"containers": [{"name": "trainer", "image": "img:1", "env": {"NCCL_DEBUG": "INFO"}}]}}


def _template_label_value_with_a_space(spec: dict[str, Any]) -> None:
    spec["template"] = {
        "metadata": {"labels": {"team": "ml research"}},
        "spec": {"containers": [{"name": "trainer", "image": "img:1"}]},
    }


def _node_selector_value_a_boolean(spec: dict[str, Any]) -> None:
    spec["template"] = {"spec": {"containers": [{"name": "trainer", "image": "img:1"}], "nodeSelector": {"gpu": True}}}


def _sidecar_env_value_a_number(spec: dict[str, Any]) -> None:
    shipper = {"name": "shipper", "image": "s:1", "env": [{"name": "LOG_LEVEL", "value": 2}]}
    spec["template"] = {"spec": {"containers": [{"name": "trainer", "image": "img:1"}, shipper]}}


def _init_container_env_as_a_map(spec: dict[str, Any]) -> None:
    warm = {"name": "warm", "image": "s:1", "command": ["true"], "env": {"A": "1"}}
    spec["template"] = {"spec": {"initContainers": [warm], "containers": [{"name": "trainer", "image": "img:1"}]}}


def _fallback_container_name_with_a_typo(spec: dict[str, Any]) -> None:
    spec["template"] = {"spec": {"containers": [{"name": "trainer", "image": "img:1"}]}}
    spec["startTimeoutSeconds"] = 600
    on_demand = {"karpenter.sh/capacity-type": "on-demand"}
    gpu = {"limits": {"nvidia.com/gpu": 1}}
    spec["fallback"] = {
        "template": {"spec": {"nodeSelector": on_demand, "containers": [{"name": "trainr", "resources": gpu}]}}
    }


def _fallback_removes_the_training_image(spec: dict[str, Any]) -> None:
    del spec["image"]
    spec["template"] = {
        "spec": {"containers": [{"name": "trainer", "image": "img:1"}], "nodeSelector": {"pool": "spot-a100"}}
    }
    spec["startTimeoutSeconds"] = 3
    spec["fallback"] = {"template": {"spec": {"containers": [{"name": "trainer", "image": None}]}}}


@pytest.mark.parametrize(
    ("change", "said"),
    [
        (_no_image, "spec.image: required without spec.template"),
        (_template_env_as_a_map, "spec.template.spec.containers[0].env must be a list of objects, not an object"),
        (_template_label_value_with_a_space, "spec.template.metadata.labels.team: 'ml research' is no label value"),
        (_node_selector_value_a_boolean, "spec.template.spec.nodeSelector.gpu must be a string, not a boolean"),
        (_sidecar_env_value_a_number, "spec.template.spec.containers[1].env[0].value must be a string, not a number"),
        (_init_container_env_as_a_map, "spec.template.spec.initContainers[0].env must be a list of objects"),
        (
            _fallback_container_name_with_a_typo,
            "with spec.fallback.template merged in, spec.template.spec.containers[1].image is required",
        ),
        (
            _fallback_removes_the_training_image,
            "spec.template merged with spec.fallback.template: the training container 'trainer' has no image",
        ),
    ],
    ids=[
        "no-image",
        "template-env-as-a-map",
        "template-label-value-with-a-space",
        "node-selector-value-a-boolean",
        "sidecar-env-value-a-number",
        "init-container-env-as-a-map",
        "fallback-container-name-typo",
        "fallback-removes-the-training-image",
    ],
)
def test_a_spotjob_the_schema_takes_but_no_pod_can_be_built_from_is_invalid_naming_the_field(
    test_api: TestApi, tmp_path: Path, change: Any, said: str
) -> None:
    """Neither ``image`` nor ``template``: the CRD took it (both are optional; its rule refusing it
    is left out here, as on a job stored before the rule or a server without CEL), and the
    controller built a pod without an image, which the API server refused on every pass
    (``Degraded``, ``BackendUnavailable``), the job ``Pending`` for ever. ``env: {NCCL_DEBUG: INFO}`` in the
    template's training container (spec.env's map form; the CRD keeps the template as written):
    every pass raised AttributeError, and the SpotJob got no status and no Event at all. A label
    value the API server refuses in a pod (``ml research``): every worker pod was refused on every
    pass. A container of ``spec.fallback.template`` whose name has a typo (``trainr``) was added to
    the fallback pods as a container without an image: every pod refused, but only once the job
    fell back, when spot capacity was short. A ``spec.fallback.template`` that sets the training
    container's image to null (or "") with no ``spec.image``: accepted, and once the job fell back
    every pod was refused. All are now ``Invalid=True`` with an InvalidSpec Event
    naming the field, and no pod."""
    install_spotjob_crd(test_api, without_spec_rules=("has(self.template) || has(self.image)",))
    parts = Parts(test_api, tmp_path, events=True)
    try:
        job = spotjob(parts.uri)
        change(job["spec"])
        test_api.admin.create(SPOTJOBS, job, "default")
        wait_for(lambda: parts.jobs.cache.get("default", KEY.name), what="the job in the cache")
        result = parts.reconciler.reconcile(KEY)
        assert result.phase is Phase.PENDING and result.requeue_after is None, result

        status = test_api.admin.get(SPOTJOBS, KEY.name, "default")["status"]
        assert [c["type"] for c in status["conditions"]] == ["Invalid"], status["conditions"]
        [invalid] = status["conditions"]
        assert invalid["status"] == "True" and invalid["reason"] == "InvalidSpec", invalid
        assert said in invalid["message"], invalid
        [event] = _events(test_api, "InvalidSpec")
        assert event["type"] == "Warning" and said in event["note"], event
        assert test_api.admin.list(PODS, "default")[0] == []
    finally:
        parts.stop()


@pytest.mark.parametrize("name", ["x" * 41, "team.run"], ids=["41-characters", "with-a-dot"])
def test_a_job_under_a_name_no_pod_can_carry_is_told_to_be_created_again_under_another_name(
    test_api: TestApi, tmp_path: Path, name: str
) -> None:
    """A name the controller refuses (stored under a CRD older than its rule on metadata.name) was
    told "nothing is done for this job until its spec is fixed", though no edit of the spec, nor of
    anything else, changes a name. The message now says to create the job again under another name."""
    install_spotjob_crd(test_api, without_name_rule=True)
    parts = Parts(test_api, tmp_path, events=True)
    try:
        job = spotjob(parts.uri)
        job["metadata"]["name"] = name
        test_api.admin.create(SPOTJOBS, job, "default")
        wait_for(lambda: parts.jobs.cache.get("default", name), what="the job in the cache")
        result = parts.reconciler.reconcile(JobKey("default", name))
        assert result.phase is Phase.PENDING and result.requeue_after is None, result

        status = test_api.admin.get(SPOTJOBS, name, "default")["status"]
        [invalid] = [c for c in status["conditions"] if c["type"] == "Invalid"]
        assert invalid["status"] == "True" and invalid["reason"] == "InvalidSpec", invalid
        assert invalid["message"].startswith(f"metadata.name: job name {name!r}"), invalid
        said = "no edit changes a name: delete it and create it again under another name"
        assert invalid["message"].endswith(said), invalid
        assert "until its spec is fixed" not in invalid["message"], invalid
        [event] = _events(test_api, "InvalidSpec")
        assert event["note"].endswith(said), event
        assert test_api.admin.list(PODS, "default")[0] == []
    finally:
        parts.stop()


def test_an_unknown_spotjob_variable_in_env_is_a_warning_event_once_and_the_job_runs(
    test_api: TestApi, tmp_path: Path
) -> None:
    """``SPOTJOB_AGENT_PREFTECH`` (a typo): the agent reads no such variable; it logs a warning in
    each pod and runs without it. Before the fix the SpotJob said nothing; now one UnknownVariables
    Event names it and the variable meant, and the job starts as it would without it."""
    install_spotjob_crd(test_api)
    parts = Parts(test_api, tmp_path, events=True)
    try:
        job = spotjob(parts.uri)
        job["spec"]["env"] = {"SPOTJOB_AGENT_PREFTECH": "off", "NCCL_DEBUG": "INFO"}
        test_api.admin.create(SPOTJOBS, job, "default")
        wait_for(lambda: parts.jobs.cache.get("default", KEY.name), what="the job in the cache")
        for _ in range(3):
            parts.reconciler.reconcile(KEY)
        wait_for(lambda: parts.pod_names() == ["llama-0-0"], what="attempt 0's pod")
        [event] = _events(test_api, "UnknownVariables")
        assert event["type"] == "Warning" and not event.get("series"), event
        assert event["note"].startswith(
            "spec.env: SPOTJOB_AGENT_PREFTECH is set but no part of spotjob reads it "
            "(did you mean SPOTJOB_AGENT_PREFETCH?)"
        ), event
        status = test_api.admin.get(SPOTJOBS, KEY.name, "default")["status"]
        assert not [c for c in status.get("conditions") or [] if c["type"] == "Invalid"], status
    finally:
        parts.stop()


def test_a_fallback_null_that_kubectl_apply_did_not_send_is_told_once_and_one_sent_by_replace_is_not(
    test_api: TestApi, tmp_path: Path
) -> None:
    """``fallback.template`` with ``nodeSelector: {karpenter.sh/capacity-type: null}`` to drop the
    template's spot selector on the fallback: client-side ``kubectl apply`` keeps the null in its
    last-applied annotation and sends none (tests/k8s/test_cluster_kubectl.py shows the real
    kubectl doing so; here the job is created as it writes it), so the fallback kept the spot
    selector and waited for spot capacity again, with no word anywhere (only README said it). Now
    one FallbackNullsDropped Warning names the path and what to do; a replace that sends the null
    (``kubectl replace -f``) tells nothing more. A null under a key the template does not have
    (``zone``) removes nothing and is not named."""
    install_spotjob_crd(test_api)
    parts = Parts(test_api, tmp_path, events=True)
    try:
        job = spotjob(parts.uri)
        job["metadata"].pop("finalizers")
        job["spec"]["startTimeoutSeconds"] = 600
        job["spec"]["template"] = {
            "spec": {
                "containers": [{"name": "trainer"}],
                "nodeSelector": {"karpenter.sh/capacity-type": "spot", "pool": "gpu"},
            }
        }
        job["spec"]["fallback"] = {
            "template": {"spec": {"nodeSelector": {"karpenter.sh/capacity-type": None, "zone": None}}}
        }
        applied = json.loads(json.dumps(job))
        applied["metadata"]["annotations"] = {LAST_APPLIED_ANNOTATION: json.dumps(job)}
        applied["spec"]["fallback"]["template"]["spec"]["nodeSelector"] = {}
        test_api.admin.create(SPOTJOBS, applied, "default")
        wait_for(lambda: parts.jobs.cache.get("default", KEY.name), what="the job in the cache")
        for _ in range(3):
            parts.reconciler.reconcile(KEY)
        [event] = _events(test_api, "FallbackNullsDropped")
        assert event["type"] == "Warning", event
        assert event["note"].startswith(
            'spec.fallback.template.spec.nodeSelector["karpenter.sh/capacity-type"]: null in kubectl apply\'s '
            "last-applied configuration, absent from the stored spec"
        ), event
        assert "zone" not in event["note"] and "kubectl replace -f" in event["note"], event

        replaced = test_api.admin.get(SPOTJOBS, KEY.name, "default")
        replaced["spec"]["fallback"] = job["spec"]["fallback"]
        generation = test_api.admin.replace(SPOTJOBS, replaced)["metadata"]["generation"]
        wait_for(
            lambda: (
                (parts.jobs.cache.get("default", KEY.name) or {}).get("metadata", {}).get("generation") == generation
            ),
            what="the replaced job in the cache",
        )
        for _ in range(2):
            parts.reconciler.reconcile(KEY)
        status = test_api.admin.get(SPOTJOBS, KEY.name, "default")["status"]
        assert status["observedGeneration"] == generation > 1, status
        assert len(_events(test_api, "FallbackNullsDropped")) == 1
    finally:
        parts.stop()


def test_a_job_out_of_restarts_ends_its_event_with_where_to_read_what_next_and_cuts_the_workers_words(
    test_api: TestApi, tmp_path: Path
) -> None:
    """``RestartBudgetExhausted`` is the Event an operator reads (``kubectl describe``, an alert),
    and it held only the worker's last words; what to do, ``kubectl spotjob status``'s ``Next:``
    line, was nowhere near it. Its note now ends with where to read it. An eviction's message
    (up to 300 characters, here 3 bytes each) and its hint make the note longer than the API
    server's 1 KB: the words are cut, the pointer kept. The status (the ``Phase:`` line) is left
    as it was: its reason's message is the reconciler's, which local mode shares."""
    install_spotjob_crd(test_api)
    parts = Parts(test_api, tmp_path, events=True)
    try:
        job = spotjob(parts.uri)
        job["spec"]["maxRestarts"] = 0
        test_api.admin.create(SPOTJOBS, job, "default")
        _running_on_n1(test_api, parts, create=False)

        pod = test_api.admin.get(PODS, "llama-0-0", "default")
        said = "The node was low on resource: ephemeral-storage. " + "記憶域不足" * 60
        pod["status"].update(phase="Failed", reason="Evicted", message=said)
        pod["status"]["containerStatuses"][0].update(
            ready=False, state={"terminated": {"exitCode": 137, "reason": "Error"}}
        )
        test_api.admin.replace(PODS, pod, subresource="status")
        wait_for(
            lambda: (parts.pods.cache.get("default", "llama-0-0") or {}).get("status", {}).get("phase") == "Failed",
            what="the evicted pod in the cache",
        )
        assert parts.reconciler.reconcile(KEY).phase is Phase.FAILED

        stored = test_api.admin.get(SPOTJOBS, KEY.name, "default")
        status = stored["status"]
        assert status["reason"] == "RestartBudgetExhausted", status
        assert "kubectl spotjob status" not in status["message"], status["message"]
        assert next_step(stored) is not None, "the pointer points at a Next: line"
        [event] = _events(test_api, "RestartBudgetExhausted")
        note = event["note"]
        pointer = "; see `kubectl spotjob status llama -n default` for how to continue"
        assert len(note.encode()) <= 1024 and note.endswith("..." + pointer), note
        assert note.startswith("worker llama-0-0 exited with code 137 and all 0 restart(s) are used: evicted"), note
        assert status["message"].startswith(note.removesuffix("..." + pointer)), "the words are cut, not changed"
    finally:
        parts.stop()


def _exit_trainer(test_api: TestApi, parts: Parts, name: str, code: int, message: str = "") -> None:
    """Play the kubelet: pod ``name``'s training container exited ``code``, with ``message`` for its
    termination message (what ``FallbackToLogsOnError`` makes of the log's tail), and the pod ended."""
    pod = test_api.admin.get(PODS, name, "default")
    terminated: dict[str, Any] = {"exitCode": code, "reason": "Error" if code else "Completed"}
    if message:
        terminated["message"] = message
    pod["status"]["phase"] = "Failed" if code else "Succeeded"
    pod["status"]["containerStatuses"][0].update(ready=False, state={"terminated": terminated})
    test_api.admin.replace(PODS, pod, subresource="status")
    wait_for(
        lambda: (parts.pods.cache.get("default", name) or {}).get("status", {}).get("phase") == pod["status"]["phase"],
        what=f"{name} ended in the cache",
    )


def test_a_failed_jobs_pod_stays_for_kubectl_logs(test_api: TestApi, tmp_path: Path) -> None:
    """A user walk: a job whose code crashed with ``maxRestarts: 0`` went Failed, and the controller
    deleted its pod right after (the API server's audit log: a DELETE 28 ms after the status
    write), so the ``kubectl logs`` that README and ``Next:`` point to found no pod. Now the pod
    stays, on the pass that failed the job and on every later one, as a Succeeded job's does."""
    install_spotjob_crd(test_api)
    parts = Parts(test_api, tmp_path)
    try:
        job = spotjob(parts.uri)
        job["spec"]["maxRestarts"] = 0
        test_api.admin.create(SPOTJOBS, job, "default")
        _running_on_n1(test_api, parts, create=False)
        _exit_trainer(test_api, parts, "llama-0-0", 1)

        assert parts.reconciler.reconcile(KEY).phase is Phase.FAILED
        assert parts.reconciler.reconcile(KEY).phase is Phase.FAILED  # a later pass (a resync)

        pod = test_api.admin.get(PODS, "llama-0-0", "default")
        assert not pod["metadata"].get("deletionTimestamp"), "the failed worker's pod is not deleted"
    finally:
        parts.stop()


def test_a_failed_jobs_phase_line_and_event_carry_the_workers_last_words_and_where_to_read_the_rest(
    test_api: TestApi, tmp_path: Path
) -> None:
    """A user walk: examples/train.py with ``--crash-at-step 25`` and ``maxRestarts: 0`` ended with
    the Phase line "worker crash-0-0 exited with code 1 and all 0 restart(s) are used" and nothing
    more, though the termination message held the traceback and README says to read the worker's
    last words in the Event. Both now quote the exception and point at ``kubectl logs``."""
    install_spotjob_crd(test_api)
    parts = Parts(test_api, tmp_path, events=True)
    try:
        job = spotjob(parts.uri)
        job["spec"]["maxRestarts"] = 0
        test_api.admin.create(SPOTJOBS, job, "default")
        _running_on_n1(test_api, parts, create=False)
        tail = [
            "[rank0]: Traceback (most recent call last):",
            '[rank0]:   File "/app/train.py", line 113, in main',
            "[rank0]: RuntimeError: injected crash at step 25",
            "2026-01-01T00:00:00Z ERROR spotjob-agent[7] agent.launcher: exiting 1: the command exited 1",
        ]
        _exit_trainer(test_api, parts, "llama-0-0", 1, "\n".join(tail))

        assert parts.reconciler.reconcile(KEY).phase is Phase.FAILED

        status = test_api.admin.get(SPOTJOBS, KEY.name, "default")["status"]
        words = "RuntimeError: injected crash at step 25; kubectl logs llama-0-0 -n default"
        assert status["message"] == f"worker llama-0-0 exited with code 1 and all 0 restart(s) are used: {words}"
        [event] = _events(test_api, "RestartBudgetExhausted")
        assert words in event["note"], event["note"]
    finally:
        parts.stop()


def test_a_job_runs_where_events_k8s_io_is_not_served_and_one_error_says_which_kubernetes_it_needs(
    test_api: TestApi, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An API server below spotjob's minimum serves no events.k8s.io/v1. The controller used to
    write core v1 Events there (for which its ClusterRole granted core ``events``); now it writes
    none, says once why (the API and the Kubernetes it needs), and the job starts and runs all the
    same: Events are a courtesy, the status is the record."""
    install_spotjob_crd(test_api)
    test_api.fault(path="/apis/events.k8s.io/v1", count=1000, status=404)
    test_api.fault(path="/apis/events.k8s.io/v1/namespaces/default/events", count=1000, status=404)
    parts = Parts(test_api, tmp_path, events=True)
    try:
        with caplog.at_level(logging.WARNING):
            _running_on_n1(test_api, parts)
            parts.reconciler.reconcile(KEY)

        status = test_api.admin.get(SPOTJOBS, KEY.name, "default")["status"]
        assert status["phase"] == "Running", status
        said = [r for r in caplog.records if r.name == "orchestrator.k8s.events"]
        assert [(r.levelno, "does not serve events.k8s.io/v1" in r.getMessage()) for r in said] == [
            (logging.ERROR, True)
        ], [r.getMessage() for r in said]
        assert f"spotjob needs Kubernetes {MIN_KUBERNETES} or later" in said[0].getMessage()
        tried = [r for r in test_api.audit() if r["user"] == CONTROLLER_USER and r["resource"] == "events"]
        assert tried == [], tried
        assert test_api.admin.list(CORE_EVENTS, "default")[0] == [], "no core v1 Event instead"
    finally:
        parts.stop()


class _Clock:
    """Wall time that moves only when told (from now, as the test API server stamps its objects)."""

    def __init__(self) -> None:
        self._now, self._monotonic = datetime.now(UTC), 1000.0

    def now(self) -> datetime:
        return self._now

    def monotonic(self) -> float:
        return self._monotonic

    def sleep(self, seconds: float) -> None:
        self.advance(seconds)

    def advance(self, seconds: float) -> None:
        self._now += timedelta(seconds=seconds)
        self._monotonic += seconds


RESTRICTED_POD = {"runAsNonRoot": True, "runAsUser": 1000, "seccompProfile": {"type": "RuntimeDefault"}}
RESTRICTED_CONTAINER = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}


def _restricted_job(uri: str, **pod_spec: Any) -> dict[str, Any]:
    """A job whose template meets Pod Security ``restricted`` (plus ``pod_spec``)."""
    job = spotjob(uri)
    trainer = {"name": "trainer", "image": "img:1", "securityContext": RESTRICTED_CONTAINER}
    job["spec"]["template"] = {"spec": {"securityContext": RESTRICTED_POD, "containers": [trainer], **pod_spec}}
    return job


def _restrict_default_namespace(test_api: TestApi) -> None:
    labels = {"pod-security.kubernetes.io/enforce": "restricted"}
    test_api.admin.patch(NAMESPACES, "default", {"metadata": {"labels": labels}})


def _degraded(test_api: TestApi) -> str:
    status = test_api.admin.get(SPOTJOBS, KEY.name, "default")["status"]
    [degraded] = [c for c in status["conditions"] if c["type"] == "Degraded"]
    assert degraded["status"] == "True" and degraded["reason"] == "BackendUnavailable", degraded
    return str(degraded["message"])


def test_a_fallback_template_pod_security_refuses_is_blamed_on_spec_fallback_template(
    test_api: TestApi, tmp_path: Path
) -> None:
    """A restricted namespace; spec.template meets the standard but no node matches its
    nodeSelector; spec.fallback.template removes the pod's securityContext (a null). Once the job
    fell back, every pod was refused and Degraded said to set the securityContext in spec.template,
    which set all of it: the one to fix was spec.fallback.template. The refusal now names it, and
    the job stays in its phase and tries again, as for the same refusal of spec.template."""
    install_spotjob_crd(test_api)
    _restrict_default_namespace(test_api)
    clock = _Clock()
    parts = Parts(test_api, tmp_path, events=True, clock=clock)
    try:
        job = _restricted_job(parts.uri, nodeSelector={"pool": "spot"})
        job["spec"]["startTimeoutSeconds"] = 5
        job["spec"]["fallback"] = {"template": {"spec": {"securityContext": None, "nodeSelector": None}}}
        test_api.admin.create(SPOTJOBS, job, "default")
        wait_for(lambda: parts.jobs.cache.get("default", KEY.name), what="the job in the cache")
        # Checked up front: the merged template is one the controller can build pods from.
        assert parts.reconciler.reconcile(KEY).phase is Phase.PENDING
        wait_for(lambda: parts.pod_names() == ["llama-0-0"], what="attempt 0's pod (admitted) in the cache")
        # The scheduler finds no node for it.
        pod = test_api.admin.get(PODS, "llama-0-0", "default")
        unschedulable = {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": "0/1 nodes"}
        pod["status"]["conditions"] = [unschedulable]
        test_api.admin.replace(PODS, pod, subresource="status")
        wait_for(
            lambda: (parts.pods.cache.get("default", "llama-0-0") or {}).get("status", {}).get("conditions"),
            what="the pod unschedulable in the cache",
        )
        clock.advance(10)  # past startTimeoutSeconds
        assert parts.reconciler.reconcile(KEY).phase is Phase.RESCHEDULING
        assert test_api.admin.get(SPOTJOBS, KEY.name, "default")["status"]["capacity"] == "fallback"
        # Its pod gone (the test plays the kubelet), attempt 1 is built from the merged template.
        test_api.admin.delete(PODS, "llama-0-0", "default", grace_period_seconds=0)
        wait_for(lambda: parts.pod_names() == [], what="attempt 0's pod gone from the cache")
        assert parts.reconciler.reconcile(KEY).phase is Phase.RESCHEDULING
        message = _degraded(test_api)
        assert 'violates PodSecurity "restricted:latest"' in message, message
        assert "as spec.template with spec.fallback.template merged in describes it" in message, message
        assert "set what it names in spec.fallback.template (spec.securityContext" in message, message
        assert "a null there removes spec.template's" in message, message
        assert "in spec.template" not in message, message
        [event] = _events(test_api, "BackendUnavailable")
        assert event["type"] == "Warning" and "set what it names in spec.fallback.template" in event["note"], event
        assert parts.pod_names() == []
    finally:
        parts.stop()


def test_a_host_network_pod_security_refuses_is_told_to_be_removed_not_to_set_a_security_context(
    test_api: TestApi, tmp_path: Path
) -> None:
    """``hostNetwork: true`` in a restricted namespace, the template's securityContext complete:
    the refusal's advice was to set the securityContext, which the template did; it is to remove
    hostNetwork."""
    install_spotjob_crd(test_api)
    _restrict_default_namespace(test_api)
    parts = Parts(test_api, tmp_path)
    try:
        test_api.admin.create(SPOTJOBS, _restricted_job(parts.uri, hostNetwork=True), "default")
        wait_for(lambda: parts.jobs.cache.get("default", KEY.name), what="the job in the cache")
        assert parts.reconciler.reconcile(KEY).phase is Phase.PENDING
        message = _degraded(test_api)
        assert "host namespaces (hostNetwork=true)" in message, message
        assert "remove hostNetwork, hostPID or hostIPC (whichever it names) from spec.template" in message, message
        assert "set what it names" not in message, message
        assert parts.pod_names() == []
    finally:
        parts.stop()
