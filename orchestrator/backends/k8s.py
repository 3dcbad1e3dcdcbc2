"""The Kubernetes backend: a job's workers are Pods, observed through the controller's informer caches.

What each call does (``orchestrator.backends.base`` has the contract; ``orchestrator.k8s.pods``
builds the objects):

- ``start_workers``: once per job (per uid, per process), create the job's token Secret, its
  headless Service and, with ``--network-policy``, its NetworkPolicy (create-only: "already
  exists" is done). Then create the attempt's missing pods: replica 0 first; the others once
  replica 0 has a pod IP, which they get as torchrun's ``--master-addr`` (the reconciler calls
  ``start_workers`` every pass while the attempt starts). Pods of earlier attempts whose agent
  exited and that are still there (a stop cut short by a leader change or an API error) are
  deleted. Every pod keeps off the nodes in
  cool-down and off nodes that are being taken away right now (a preemption taint, an interruption
  notice, NotReady): a NoExecute preemption taint is tolerated for the flush window, so without
  that exclusion a new worker could be scheduled onto the very node being reclaimed.
- ``stop_workers``: delete the pods (their grace period covers a flush: SIGTERM is a notice to the
  agent); with ``keep_exited`` (the job ended), not those that ended, which stay for
  ``kubectl logs``, only those still running (a live agent, or a sidecar after the agent exited). With
  ``flush=False`` each live agent is first told ``POST /stop`` (in the background) and its pod is
  deleted once the agent answered or could not be reached. A pod on a node that is lost (deleted,
  or NotReady past ``--node-lost-grace-seconds``, its kubelet gone), deleted now or stuck
  terminating since an earlier stop (forced when the next attempt starts), is force-deleted
  (grace 0) so it never holds the next attempt back; if its processes still run
  behind a partition, fencing keeps what they write from counting.
- Every call reads the pods of this incarnation of the job only (their owner reference names
  its uid): a job deleted and created again under the same name finds its predecessor's pods
  still terminating under the same names, and waits for them to go instead of adopting them.
- ``list_workers``: the job's pods from the cache, as observations. A worker is Running once its
  ranks train, not when its container starts: once its training container is ready (its agent's
  /readyz: the node's first rank trains, which needs every rank of the gang joined and restored).
  The container's readiness, not the pod's: the pod is Ready only while every container is, and
  the template's other containers (a helper that finished, a sidecar with a probe of its own) say
  nothing about training. The training container's exit code is the agent's; a pod that failed
  because an init container did (the agent never ran) failed with that container's code, a
  failure of the template like one of the training code; a training container the kubelet ended
  without finding it (``ContainerStatusUnknown``, exit 137: its node rebooted) has no code of the
  agent's, and unless the pod was evicted it is lost; a pod that failed without either
  (deleted with its node, evicted before it started) was lost, and so is a pod whose node is lost
  (deleted, or NotReady past the grace): its object may say Running for minutes, but no kubelet
  reports for it and no flush can reach it. A running worker's step and the cloud notice its agent
  holds (``held_notice``) come from its agent's last ``GET /status`` (``AgentCalls.report``).
- ``signals``: ``orchestrator.k8s.cluster_signals`` over the job's pods and their nodes: the live and
  the failed ones (a pod its node took down failed), never the succeeded ones.
- ``request_flush`` / ``request_save``: ``POST /flush`` / ``POST /save`` to the agent on the pod's
  IP, in the background (``orchestrator.k8s.agents``): pending, then accepted or failed.
- A Pending pod the scheduler cannot place (``PodScheduled=False``, reason Unschedulable) is
  observed with the scheduler's message (``WorkerObservation.unschedulable``): what the spec's
  ``startTimeoutSeconds`` counts on. A placed Pending pod with a container waiting for a reason it
  will not get past alone (ErrImagePull, ImagePullBackOff, CreateContainerConfigError, ...) is
  observed with it (``WorkerObservation.not_starting``).

Nothing here blocks on the network in a pass except the writes (pod creates and deletes).
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from agent.control_channel import (
    ENV_EVERY_SECONDS,
    ENV_EVERY_STEPS,
    EXIT_FLUSH_FAILED,
    EXIT_INFRA_ERROR,
    EXIT_PREEMPTED,
    EXIT_STOPPED,
)
from agent.exit_codes import (
    EXIT_COMMAND_USED_RESERVED,
    EXIT_USAGE,
    KILLED_BY,
    RESERVED_EXIT_CODES,
    exit_words,
    flush_answered,
)
from orchestrator.backends.base import (
    RANKS_NOT_MEETING,
    BackendError,
    FlushRequestOutcome,
    FlushRequestState,
    Placement,
    WorkerObservation,
    agent_refusal,
    worker_name,
)
from orchestrator.backends.local_failure import telling_line
from orchestrator.k8s import pods
from orchestrator.k8s.agents import AgentCalls, AgentReport, CallResult, CallState, Endpoint, derive_token
from orchestrator.k8s.api import (
    NETWORK_POLICIES,
    PODS,
    SECRETS,
    SERVICES,
    AlreadyExists,
    KubeClient,
    KubeError,
    NotFound,
    Object,
)
from orchestrator.k8s.cluster_signals import NOTICE_INDEX, ClusterSignals, nodes_being_taken
from orchestrator.k8s.informer import Cache
from orchestrator.model import DEFAULT_CONTAINER_NAME, JobKey, JobSpec, WorkerPhase, parse_timestamp
from orchestrator.signals import Signal

log = logging.getLogger(__name__)

NODE_ZONE_LABEL = "topology.kubernetes.io/zone"
NODE_INSTANCE_TYPE_LABEL = "node.kubernetes.io/instance-type"


@dataclass(frozen=True)
class BackendOptions:
    """The Kubernetes backend's settings (``spotjob-controller`` flags)."""

    workers: pods.WorkerOptions = field(default_factory=pods.WorkerOptions)
    network_policy: bool = True


class KubernetesBackend:
    """Workers as Pods; see the module docstring. Thread-safe across jobs (one pass per job at a time)."""

    def __init__(
        self,
        client: KubeClient,
        *,
        jobs: Cache,
        pods_cache: Cache,
        nodes: Cache,
        signals: ClusterSignals,
        token_key: bytes,
        options: BackendOptions | None = None,
        agents: AgentCalls | None = None,
        now: Callable[[], datetime] = lambda: datetime.now(UTC),
        wake: Callable[[JobKey], None] | None = None,
    ) -> None:
        """``nodes``: the Node informer's cache, with the ``cluster_signals.NOTICE_INDEX`` index.
        ``wake(key)`` queues the job's reconcile: called when an agent answers a flush, save or stop
        request a pass left PENDING, so the next pass takes the answer at once."""
        self._client = client
        self._jobs = jobs
        self._pods = pods_cache
        self._nodes = nodes
        self._signals = signals
        self._key = token_key
        self.options = options or BackendOptions()
        self.agents = agents or AgentCalls(port=self.options.workers.agent_port)
        self._now = now
        self._wake = wake
        self._ensured: dict[tuple[str, str], str] = {}
        """(namespace, name) → uid of each job whose Secret, Service and NetworkPolicy this process
        created (or found); a job gone from the SpotJob cache is dropped at the next creation."""
        self._ensured_lock = threading.Lock()
        """Held to change ``_ensured``: reconcile workers start different jobs at the same time."""
        self._no_flush: set[str] = set()
        """uids of pods to stop without a flush (POST /stop before the delete)."""

    def close(self) -> None:
        self.agents.close()

    def pod_deleted(self, pod: Object) -> None:
        """The Pod informer saw a pod go: forget what was remembered about it."""
        uid = str((pod.get("metadata") or {}).get("uid") or "")
        self.agents.forget(uid)
        self._no_flush.discard(uid)

    # -- the Backend protocol ---------------------------------------------------------------------

    def spec_problems(self, key: JobKey, spec: JobSpec) -> list[str]:
        index = _training_container(spec)[0]
        every = ((ENV_EVERY_STEPS, spec.checkpoint.every_steps), (ENV_EVERY_SECONDS, spec.checkpoint.every_seconds))
        policy = [v for v, on in every if on is not None]
        problems = pods.env_problems(spec.env, policy=policy)
        problems += pods.template_problems(spec.template, index, policy=policy)
        if spec.template is None and spec.image is None:
            # The model checks the image of a template's container only (local mode needs none): the
            # pod was built with no image, and the API server refused it on every pass.
            problems.append(
                f"spec.image: required without spec.template (the image of the training container "
                f"{DEFAULT_CONTAINER_NAME!r}); set spec.image, or give spec.template a container with an image"
            )
        if spec.image is not None and spec.image != spec.image.strip():
            problems.append(f"spec.image: {spec.image!r} has spaces around it, which Kubernetes refuses: remove them")
        if spec.template is None and spec.container_name is not None:
            problems += pods.container_name_problems(spec.container_name, "spec.containerName")
        uri = spec.checkpoint.uri
        if "://" not in uri and not uri.startswith(("/", "file:")):
            # Each process would resolve it against its own working folder: the workers' image's and
            # the controller's are different folders, so the controller would never see a checkpoint.
            problems.append(
                f"spec.checkpoint.uri: {uri!r} is a relative path, which the workers and the controller would "
                "each read against their own working folder; use an absolute path on a volume both mount "
                "(/path or file:///path), or s3://bucket/prefix or gs://bucket/prefix"
            )
        refused = pods.agent_settings_problem(str(key), _worker_spec(spec), self.options.workers)
        if refused is not None:
            # --checkpoint-uri is the one option the agent is given from a field of the spec that the
            # CRD's schema does not check; every other refusal is of a variable.
            if refused.startswith("--checkpoint-uri"):
                problems.append(agent_refusal(refused, "spec.checkpoint.uri", fix="fix it"))
            else:
                problems.append(agent_refusal(refused, "spec.env or the template's training container env"))
        return problems

    def start_workers(self, key: JobKey, spec: JobSpec, attempt: int, placement: Placement) -> None:
        owner = self._owner(key)
        self._ensure_job_objects(owner)
        job_pods = self._job_pods(key)
        self._delete_finished_leftovers(job_pods, attempt)
        existing = {_name(p): p for p in job_pods if _attempt(p) == attempt}
        view = _worker_spec(spec)
        where = pods.WorkerPlacement(
            avoid_nodes=self._still_avoided(placement) | self._doomed_nodes(),
            avoid_zones=frozenset(placement.avoid_zones),
            avoid_instance_types=frozenset(placement.avoid_instance_types),
        )
        first = worker_name(key, attempt, 0)
        if first not in existing:
            self._create_pod(owner, key, view, attempt, 0, None, where, fallback=placement.fallback)
            return  # the others need its pod IP: next pass
        master = (existing[first].get("status") or {}).get("podIP")
        if not master or _deleting(existing[first]):
            return
        for index in range(1, spec.replicas):
            if worker_name(key, attempt, index) not in existing:
                self._create_pod(owner, key, view, attempt, index, str(master), where, fallback=placement.fallback)

    def stop_workers(
        self,
        key: JobKey,
        spec: JobSpec,
        *,
        keep_attempt: int | None = None,
        flush: bool = True,
        keep_exited: bool = False,
    ) -> None:
        token: str | None = None
        for pod in self._job_pods(key):
            if keep_attempt is not None and _attempt(pod) == keep_attempt:
                continue
            meta = pod.get("metadata") or {}
            uid = str(meta.get("uid") or "")
            if _deleting(pod):
                self._maybe_force_delete(pod)
                continue
            if keep_exited and not _alive(pod) and not _still_running(pod):
                continue  # the job ended: an exited pod stays for kubectl logs (it holds no node)
            if not flush:
                self._no_flush.add(uid)
            if uid in self._no_flush and _alive(pod) and _pod_ip(pod):
                token = token or self._token(key)
                answer = self.agents.stop(
                    self._endpoint(pod, token), "the gang is stopping without a flush", answered=self._waker(key)
                )
                if answer.state is CallState.PENDING:
                    continue  # deleted once the agent answered (or could not be reached)
            # On a lost node no kubelet finishes a graceful delete: forced at once (the pod would
            # stay Terminating until the node came back; nothing forces it once the next attempt runs).
            if not self._maybe_force_delete(pod):
                self._delete_pod(pod)

    def list_workers(self, key: JobKey, spec: JobSpec) -> list[WorkerObservation]:
        token: str | None = None
        out = []
        for pod in self._job_pods(key):
            attempt, index = _attempt(pod), _index(pod)
            if attempt is None or index is None:
                continue
            phase, exit_code = _phase(pod)
            node_name = (pod.get("spec") or {}).get("nodeName")
            lost = self._lost_node_of(pod) if phase.alive else None
            if lost is not None:
                # Its kubelet is gone: the pod object still says Running, but nothing there can be
                # reached or flushed (and if processes run on behind a partition, fencing holds).
                phase, exit_code = WorkerPhase.FAILED, None
            labels = self._node_labels(node_name)
            report = AgentReport()
            if (phase is WorkerPhase.RUNNING or _agent_started(pod)) and _pod_ip(pod):
                token = token or self._token_or_none(key)
                if token is not None:
                    report = self.agents.report(self._endpoint(pod, token))
            out.append(
                WorkerObservation(
                    name=_name(pod),
                    attempt=attempt,
                    index=index,
                    phase=phase,
                    node=node_name or None,
                    zone=labels.get(NODE_ZONE_LABEL),
                    instance_type=labels.get(NODE_INSTANCE_TYPE_LABEL),
                    exit_code=exit_code,
                    detail=lost or _failure_detail(pod, exit_code),
                    flush_answered=_flush_answered(pod) if exit_code == EXIT_PREEMPTED else None,
                    step=report.step,
                    ranks_state=report.ranks_state if phase is WorkerPhase.RUNNING else None,
                    held_notice=report.held_notice,
                    restored=report.restored,
                    unschedulable=_unschedulable(pod) if phase is WorkerPhase.PENDING else None,
                    not_starting=_not_starting(pod, report) if phase is WorkerPhase.PENDING else None,
                    holds_node=exit_code is not None and _still_running(pod),
                )
            )
        return sorted(out, key=lambda w: (w.attempt, w.index))

    def signals(self, key: JobKey, spec: JobSpec) -> list[Signal]:
        # A worker that failed is evidence too: a pod killed by its node going away (a taint, a
        # DisruptionTarget, a notice on the node) was preempted, not failed by the user's code. A
        # worker that succeeded finished its work: nothing about its node concerns the job.
        watched = [p for p in self._job_pods(key) if _phase(p)[0] is not WorkerPhase.SUCCEEDED]
        return self._signals.for_workers(watched, lambda name: self._nodes.get("", name))

    def request_flush(
        self, key: JobKey, spec: JobSpec, worker: WorkerObservation, reason: str, deadline: datetime | None
    ) -> FlushRequestState:
        pod = next((p for p in self._job_pods(key) if _name(p) == worker.name), None)
        if pod is None:
            return FlushRequestState.failed(f"worker {worker.name} has no pod")
        if not _pod_ip(pod):
            return FlushRequestState.failed(f"worker {worker.name} has no pod IP yet")
        answer = self.agents.flush(self._endpoint(pod, self._token(key)), reason, deadline, answered=self._waker(key))
        if answer.state is CallState.FAILED and not _deleting(pod):
            # The agent did not take the request (unreachable, the token refused, an error). Its
            # pod's deletion reaches it all the same: the SIGTERM is a notice it flushes on, within
            # the pod's grace period. Waiting for flushTimeoutSeconds instead spent a short notice
            # (30 s on GCP) before the agent heard of it, and the checkpoint with it.
            self._delete_pod(pod)
            return FlushRequestState.failed(
                f"{answer.detail}; deleted the pod instead, so that the agent flushes on its SIGTERM"
            )
        return _flush_state(answer)

    def request_save(
        self, key: JobKey, spec: JobSpec, worker: WorkerObservation, request_id: str, reason: str
    ) -> FlushRequestState:
        pod = next((p for p in self._job_pods(key) if _name(p) == worker.name), None)
        if pod is None:
            return FlushRequestState.failed(f"worker {worker.name} has no pod")
        if not _pod_ip(pod):
            return FlushRequestState.failed(f"worker {worker.name} has no pod IP yet")
        answer = self.agents.save(self._endpoint(pod, self._token(key)), request_id, reason, answered=self._waker(key))
        return _flush_state(answer)

    # -- inside ---------------------------------------------------------------------------------

    def _waker(self, key: JobKey) -> Callable[[], None] | None:
        wake = self._wake
        return None if wake is None else (lambda: wake(key))

    def _job_pods(self, key: JobKey) -> list[Object]:
        """The pods of this incarnation of the job. A SpotJob deleted and created again under the
        same name leaves its pods terminating for their flush window, with the same labels and
        names: those belong to the old uid, and are neither its workers nor its to stop."""
        found = self._pods.by_index("job", str(key))
        job = self._jobs.get(key.namespace, key.name)
        uid = str(((job or {}).get("metadata") or {}).get("uid") or "")
        if not uid:
            return found
        return [p for p in found if _owner_uid(p) in (None, uid)]

    def _owner(self, key: JobKey) -> pods.Owner:
        job = self._jobs.get(key.namespace, key.name)
        uid = str(((job or {}).get("metadata") or {}).get("uid") or "")
        if not uid:
            raise BackendError(f"SpotJob {key} is not in the controller's cache (yet)")
        return pods.Owner(key.namespace, key.name, uid)

    def _token(self, key: JobKey) -> str:
        owner = self._owner(key)
        return derive_token(self._key, owner.namespace, owner.name, owner.uid)

    def _token_or_none(self, key: JobKey) -> str | None:
        try:
            return self._token(key)
        except BackendError:
            return None

    def _endpoint(self, pod: Object, token: str) -> Endpoint:
        meta = pod.get("metadata") or {}
        return Endpoint(str(meta.get("uid") or ""), _name(pod), str(_pod_ip(pod)), token)

    def _ensure_job_objects(self, owner: pods.Owner) -> None:
        if self._ensured.get((owner.namespace, owner.name)) == owner.uid:
            return
        token = derive_token(self._key, owner.namespace, owner.name, owner.uid)
        objects: list[tuple[Any, Object]] = [
            (SECRETS, pods.token_secret(owner, token)),
            (SERVICES, pods.headless_service(owner, self.options.workers.agent_port)),
        ]
        if self.options.network_policy:
            objects.append((NETWORK_POLICIES, pods.network_policy(owner, self.options.workers)))
        for resource, body in objects:
            try:
                self._client.create(resource, body, owner.namespace)
                log.info(
                    "job %s/%s: created %s %s", owner.namespace, owner.name, resource.kind, body["metadata"]["name"]
                )
            except AlreadyExists:
                pass  # created by an earlier pass or leader; its content is derived, hence the same
            except KubeError as e:
                raise BackendError(
                    f"cannot create the {resource.kind} of SpotJob {owner.namespace}/{owner.name}: {e}"
                ) from e
        # One entry per job that exists, not one per job ever started: a job deleted (or replaced
        # under its name) is forgotten here, as the reconciler forgets it.
        known = set(self._jobs.object_keys())
        with self._ensured_lock:
            for gone in [k for k in self._ensured if k not in known]:
                del self._ensured[gone]
            self._ensured[(owner.namespace, owner.name)] = owner.uid

    def _create_pod(
        self,
        owner: pods.Owner,
        key: JobKey,
        view: pods.WorkerSpec,
        attempt: int,
        index: int,
        master: str | None,
        where: pods.WorkerPlacement,
        *,
        fallback: bool = False,
    ) -> None:
        """``fallback``: ``view`` is built from the template merged with ``spec.fallback.template``."""
        name = worker_name(key, attempt, index)
        try:
            body = pods.worker_pod(
                owner,
                str(key),
                view,
                name=name,
                attempt=attempt,
                index=index,
                master_addr=master,
                placement=where,
                options=self.options.workers,
            )
        except (pods.TemplateError, ValueError) as e:
            raise BackendError(f"cannot build pod {name}: {e}") from e
        try:
            self._client.create(PODS, body, key.namespace)
        except AlreadyExists:
            return  # an earlier pass created it; the cache has not shown it yet
        except KubeError as e:
            raise BackendError(
                f"cannot create pod {key.namespace}/{name}: {e}{_refusal_hint(e, fallback=fallback)}"
            ) from e
        log.info(
            "job %s: created pod %s (attempt %d, replica %d%s)",
            key,
            name,
            attempt,
            index,
            f", rendezvous at {master}" if master else "",
        )

    def _delete_pod(self, pod: Object, *, force: bool = False) -> None:
        meta = pod.get("metadata") or {}
        try:
            self._client.delete(
                PODS,
                _name(pod),
                str(meta.get("namespace") or ""),
                grace_period_seconds=0 if force else None,
                precondition_uid=str(meta.get("uid") or "") or None,
            )
        except NotFound:
            return
        except KubeError as e:
            if getattr(e, "status", 0) == 409:
                return  # the precondition: a newer pod of that name; not ours to delete
            raise BackendError(f"cannot delete pod {meta.get('namespace')}/{_name(pod)}: {e}") from e

    def _delete_finished_leftovers(self, job_pods: list[Object], attempt: int) -> None:
        """Delete the pods of earlier attempts whose agent has exited, and force-delete those stuck
        terminating on a lost node.

        The stop that ends an attempt deletes its pods once, in the pass that decided it; a
        leader that died before that stop went out, or a stop the API server refused, leaves them
        behind, and the reconciler only waits for workers still alive. An exited agent's pod
        would stay for good: clutter when it completed, and a node held by its other containers
        (a sidecar keeps a pod Running after the agent exits)."""
        for pod in job_pods:
            earlier = _attempt(pod)
            if earlier is not None and earlier != attempt and _deleting(pod):
                self._maybe_force_delete(pod)  # stuck terminating on a node lost since its delete
                continue
            if earlier is None or earlier == attempt or _alive(pod):
                continue
            log.info("pod %s of attempt %d is left from an earlier stop: deleting it", _name(pod), earlier)
            self._delete_pod(pod)

    def _node_lost(self, name: str) -> str | None:
        """Why node ``name`` counts as lost (deleted, or not Ready past the grace), or None."""
        return self._signals.tracker.observe(name, self._nodes.get("", name))

    def _lost_node_of(self, pod: Object) -> str | None:
        """Why the node ``pod`` ran on is lost: deleted, not Ready past the grace, or replaced by a
        new Node object under its name (created after the pod was placed). None: not lost, or the
        pod is on no node yet."""
        node_name = (pod.get("spec") or {}).get("nodeName")
        if not node_name:
            return None
        lost = self._node_lost(node_name)
        if lost is not None:
            return lost
        return _replaced_node(pod, self._nodes.get("", node_name))

    def _maybe_force_delete(self, pod: Object) -> bool:
        """Force-delete a pod whose node is lost (terminating, or about to be deleted): no kubelet will
        ever finish a graceful delete (on a node replaced under its name, the machine that ran it is
        gone). True if it did."""
        node_name = (pod.get("spec") or {}).get("nodeName")
        lost = self._lost_node_of(pod)
        if lost is None:
            return False
        state = "stuck terminating" if _deleting(pod) else "to be deleted"
        log.warning("pod %s is %s on node %s (%s): force-deleting it", _name(pod), state, node_name, lost)
        self._delete_pod(pod, force=True)
        return True

    def _still_avoided(self, placement: Placement) -> frozenset[str]:
        """The nodes in cool-down, less those whose name now names a new machine: a Node object
        created after the cool-down began (GKE recreates a preempted VM under its instance name,
        and Karpenter's names come from the instance's private DNS name)."""
        since = dict(placement.nodes_avoided_since)
        out = set()
        for name in placement.avoid_nodes:
            began = since.get(name)
            node = self._nodes.get("", name)
            created = parse_timestamp(((node or {}).get("metadata") or {}).get("creationTimestamp"))
            if began is not None and created is not None and created > began:
                log.debug("node %s was registered again since its cool-down began: a new machine, not avoided", name)
                continue
            out.add(name)
        return frozenset(out)

    def _doomed_nodes(self) -> frozenset[str]:
        """Nodes a new worker must not land on: a preemption taint or an interruption notice on them.

        Read from the Node cache's notice index, never from every Node: this runs on every pass
        while an attempt starts, and copying a thousand Nodes each time is what made a reconcile's
        cost grow with the cluster (bench/README.md). (NotReady nodes are not listed: the scheduler
        keeps pods off them by their not-ready taint, and a required exclusion would outlive a node
        that recovers.)"""
        return nodes_being_taken(
            self._nodes.by_index(NOTICE_INDEX, NOTICE_INDEX), rebalance=self._signals.rebalance, now=self._now()
        )

    def _node_labels(self, name: str | None) -> Mapping[str, str]:
        if not name:
            return {}
        node = self._nodes.get("", name)
        return ((node or {}).get("metadata") or {}).get("labels") or {}


# -- reading pods ---------------------------------------------------------------------------------


def _name(pod: Object) -> str:
    return str((pod.get("metadata") or {}).get("name") or "")


def _owner_uid(pod: Object) -> str | None:
    """The uid of the SpotJob that controls the pod (None: no such owner reference)."""
    for ref in (pod.get("metadata") or {}).get("ownerReferences") or []:
        if ref.get("kind") == pods.KIND and ref.get("controller"):
            return str(ref.get("uid") or "")
    return None


def _label_int(pod: Object, label: str) -> int | None:
    value = ((pod.get("metadata") or {}).get("labels") or {}).get(label)
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


def _attempt(pod: Object) -> int | None:
    return _label_int(pod, pods.ATTEMPT_LABEL)


def _index(pod: Object) -> int | None:
    return _label_int(pod, pods.INDEX_LABEL)


def _pod_ip(pod: Object) -> str | None:
    ip = (pod.get("status") or {}).get("podIP")
    return str(ip) if ip else None


def _deleting(pod: Object) -> bool:
    return bool((pod.get("metadata") or {}).get("deletionTimestamp"))


def _replaced_node(pod: Object, node: Object | None) -> str | None:
    """Why ``pod`` ran on an earlier node of its node's name, or None.

    Karpenter names a node after its instance's private DNS name and GKE after its VM: a node
    deleted and registered again under the same name is a new Node object, created after the pod
    was placed on the old one (the scheduler binds only to nodes that exist, and its PodScheduled
    time and the Node's creationTimestamp are both control-plane clocks). A controller that missed
    the deletion (restarted, or a relist that shows the new Node as an update) would otherwise see
    a Ready node and the pod still saying Running. Whole seconds: a node replaced within the second
    its pod was placed is not told apart (a replacement takes a new machine's boot)."""
    if node is None:
        return None
    created = parse_timestamp((node.get("metadata") or {}).get("creationTimestamp"))
    placed = None
    for condition in (pod.get("status") or {}).get("conditions") or []:
        if condition.get("type") == "PodScheduled" and condition.get("status") == "True":
            placed = parse_timestamp(condition.get("lastTransitionTime"))
    if created is None or placed is None or created <= placed:
        return None
    return (
        f"node {_name(node)} was registered again at {created.isoformat()}, after the pod was placed on the "
        f"earlier node of that name at {placed.isoformat()}"
    )


def _failed_init_container(pod: Object) -> Mapping[str, Any] | None:
    """The status of the init container whose failure failed the pod before the agent ran, if any.

    With ``restartPolicy: Never`` (what spotjob sets) an init container that exits non-zero fails
    the pod at once: the template's doing, like a failure of the training code, and no node lost.
    A native sidecar (an init container with ``restartPolicy: Always``) is not one: the kubelet
    restarts it, and stops it itself when the pod ends. A pod the kubelet evicted is not one
    either: its node was short of memory or disk, whatever the container said as it was killed."""
    status = pod.get("status") or {}
    if status.get("phase") != "Failed" or status.get("reason") == "Evicted":
        return None
    sidecars = {
        c.get("name") for c in (pod.get("spec") or {}).get("initContainers") or [] if c.get("restartPolicy") == "Always"
    }
    for container in status.get("initContainerStatuses") or []:
        terminated = (container.get("state") or {}).get("terminated") or {}
        if container.get("name") not in sidecars and terminated.get("exitCode") not in (None, 0):
            return container
    return None


CONTAINER_STATUS_UNKNOWN = "ContainerStatusUnknown"
"""The reason the kubelet gives a container it ends without having found it (exit code 137)."""


def _container_not_found(pod: Object) -> bool:
    """Whether the kubelet ended the training container without finding it (``ContainerStatusUnknown``:
    its node rebooted, or the runtime lost it) and wrote exit 137 itself, outside an eviction (one for
    the pod's own storage limit keeps its code: the job's failure)."""
    terminated = (pods.training_container_status(pod).get("state") or {}).get("terminated") or {}
    evicted = (pod.get("status") or {}).get("reason") == "Evicted"
    return terminated.get("reason") == CONTAINER_STATUS_UNKNOWN and not evicted


def _phase(pod: Object) -> tuple[WorkerPhase, int | None]:
    """The worker's phase and the agent's exit code (see the module docstring)."""
    status = pod.get("status") or {}
    trainer = pods.training_container_status(pod)
    terminated = (trainer.get("state") or {}).get("terminated")
    if terminated is not None and terminated.get("exitCode") is not None:
        if _container_not_found(pod):
            # The kubelet found no container to read a code from (its node rebooted, or the
            # runtime lost it) and wrote 137 itself: no exit of the agent's, a lost worker. An
            # eviction keeps its code: one for the pod's own storage limit is the job's failure.
            return WorkerPhase.FAILED, None
        # The agent exited: its code decides, whatever sidecars still run in the pod.
        code = int(terminated["exitCode"])
        return (WorkerPhase.SUCCEEDED if code == 0 else WorkerPhase.FAILED), code
    phase = status.get("phase")
    if phase == "Succeeded":
        return WorkerPhase.SUCCEEDED, 0
    if phase == "Failed":
        init = _failed_init_container(pod)
        if init is not None:
            # The codes the agent reserves for what it saw (75: flushed, ...) mean nothing from an
            # init container: reported as a plain failure, as the agent reports a command's.
            code = int(init["state"]["terminated"]["exitCode"])
            return WorkerPhase.FAILED, EXIT_COMMAND_USED_RESERVED if code in RESERVED_EXIT_CODES else code
        return WorkerPhase.FAILED, None  # no exit code: lost with its node, or evicted before it ran
    # The trainer's own readiness (its agent's /readyz), not the pod's: a pod is Ready only while
    # every container is, so a helper container that finished, or a sidecar whose own probe
    # fails, would keep a training worker from ever counting as running (no flush on a notice).
    if phase == "Running" and trainer.get("ready") is True:
        return WorkerPhase.RUNNING, None
    return WorkerPhase.PENDING, None


AGENT_USAGE_ERROR = "spotjob-agent: error:"
"""How spotjob-agent (argparse) begins the line that says which option or setting it refused."""


def _refused_options(pod: Object) -> str | None:
    """For an agent that exited 2 (``EXIT_USAGE``): the line of its termination message (the tail of
    its log, ``FallbackToLogsOnError``) saying what it refused, and the likely cause after an
    upgrade. Only that line: the rest of the log is the user's and stays behind ``kubectl logs``."""
    terminated = (pods.training_container_status(pod).get("state") or {}).get("terminated") or {}
    lines = [line for line in str(terminated.get("message") or "").splitlines() if AGENT_USAGE_ERROR in line]
    if not lines:
        return None
    said = "".join(c if c.isprintable() else "?" for c in lines[-1].strip())[:300]
    if re.search(r"\bSPOTJOB_[A-Z0-9_]+\b", said.split(AGENT_USAGE_ERROR, 1)[-1]):
        # A setting the controller could not see when it checked the spec (spec_problems checks the
        # values written in spec.env and the template): one from valueFrom, envFrom or the image.
        return (
            f"{said} (the image's spotjob-agent refused a setting of the pod's environment: one from a "
            f"ConfigMap or Secret (valueFrom, envFrom) or the image's own ENV; fix it there; kubectl logs {_name(pod)})"
        )
    return (
        f"{said} (the image's spotjob-agent refused the command line the controller gave it: is the "
        f"image's spotjob older than the controller? See README 'Upgrading'; kubectl logs {_name(pod)})"
    )


def _agent_exit_words(pod: Object, code: int) -> str | None:
    """For an agent that exited ``code``: its last line of the termination message (the tail of its
    log, ``FallbackToLogsOnError``) that says why, from ``exiting N:`` on, whole."""
    terminated = (pods.training_container_status(pod).get("state") or {}).get("terminated") or {}
    found = [w for line in str(terminated.get("message") or "").splitlines() if (w := exit_words(line, code))]
    return found[-1] if found else None


def _agent_exit_line(pod: Object, code: int) -> str | None:
    """For an agent that exited ``code`` (74, an infrastructure error; 76, a flush that committed
    nothing): its line that says why and what to do (``_agent_exit_words``), and where the rest is."""
    said = _agent_exit_words(pod, code)
    return f"{said[:400]}; kubectl logs {_name(pod)}" if said else None


def _flush_answered(pod: Object) -> str | None:
    """For an agent that exited 75: what its flush answered, from its exit line in the termination
    message (``agent.exit_codes.flush_answered``); None when the message holds no such line (an
    agent older than those words, a message cut before it). The exit code alone decides what the
    exit is (``AgentPreempted``); these words only say which notice in its message."""
    said = _agent_exit_words(pod, EXIT_PREEMPTED)
    return (flush_answered(said) if said else None) or None


def _failure_detail(pod: Object, exit_code: int | None) -> str | None:
    """Why a worker that exited failed, when the pod says: an init container that failed (the
    agent never ran), the options an agent refused (exit 2), its infrastructure error (74), why
    its flush committed nothing (76), an eviction or an out-of-memory kill; for any other failure,
    the last words of its termination message (``_last_words``)."""
    init = _failed_init_container(pod)
    if init is not None:
        terminated = init["state"]["terminated"]
        said = " ".join(str(terminated.get("message") or "").split())[-300:]
        return (
            f"init container {init.get('name')} exited {terminated.get('exitCode')}"
            f"{' (' + str(terminated['reason']) + ')' if terminated.get('reason') else ''} before the training "
            f"container started{': ' + said if said else ''}; kubectl logs {_name(pod)} -c {init.get('name')}"
        )
    if exit_code is None and _container_not_found(pod):
        return (
            "the kubelet could not find the training container (ContainerStatusUnknown): its node restarted, "
            "or the container runtime lost it"
        )
    if exit_code in (EXIT_INFRA_ERROR, EXIT_FLUSH_FAILED):
        return _evicted(pod) or _agent_exit_line(pod, exit_code)
    told = _evicted(pod) or (_refused_options(pod) if exit_code == EXIT_USAGE else _oom_killed(pod))
    if told is not None or exit_code in (None, 0, EXIT_PREEMPTED, EXIT_STOPPED):
        return told
    return _last_words(pod)


def _last_words(pod: Object) -> str | None:
    """For an agent whose command failed (any other exit): the telling line of its termination
    message (the tail of its log, ``FallbackToLogsOnError``), as local mode picks it from a log
    (``local_failure.telling_line``: the last exception a rank raised, else the last line the script
    wrote), and where to read the rest; None when the message says nothing."""
    terminated = (pods.training_container_status(pod).get("state") or {}).get("terminated") or {}
    said = telling_line(str(terminated.get("message") or ""))
    if said is None:
        return None
    said = "".join(c if c.isprintable() else "?" for c in said)
    namespace = (pod.get("metadata") or {}).get("namespace") or "default"
    return f"{said}; kubectl logs {_name(pod)} -n {namespace}"


def _evicted(pod: Object) -> str | None:
    """For a pod the kubelet evicted (status reason Evicted): its message. An eviction for the pod's
    own ephemeral-storage limit or an emptyDir's sizeLimit kills at once (the trainer ends 137, which
    would read as an out-of-memory kill) and sets no DisruptionTarget, so it stays the job's failure;
    the checkpoints staged in the spotjob-staging emptyDir count against that limit."""
    status = pod.get("status") or {}
    said = " ".join(str(status.get("message") or "").split())[:300]
    if status.get("reason") != "Evicted" or not said:
        return None
    hint = ""
    if "ephemeral" in said.lower() or "emptydir" in said.lower():
        hint = (
            f"; checkpoints are staged on the node's disk in the {pods.STAGING_VOLUME} emptyDir, which counts "
            "against it: raise resources.limits.ephemeral-storage (or the emptyDir's sizeLimit), or give the "
            f"template a volume named {pods.STAGING_VOLUME} (a local disk)"
        )
    return f"evicted by the kubelet: {said}{hint}; kubectl describe pod {_name(pod)}"


_RANK_KILLED = f") {KILLED_BY} SIGKILL"
"""How the agent's direct launcher says a rank was SIGKILLed (``agent.ranks``)."""


def _oom_killed(pod: Object) -> str | None:
    """For a training container the kubelet reports ``OOMKilled``: the limit it ran into and what
    takes host memory besides the training (a cgroup v2 node kills the whole container, agent and
    ranks, so no log line of the agent's says so); for an agent that reported a rank killed by
    SIGKILL, its line."""
    status = pods.training_container_status(pod)
    terminated = (status.get("state") or {}).get("terminated") or {}
    if terminated.get("reason") != "OOMKilled":
        # The agent outlived a rank the kernel killed (cgroup v1, or a kubelet that kills one
        # process): its log's tail, the termination message, has the launcher's line on it.
        killed = [line for line in str(terminated.get("message") or "").splitlines() if _RANK_KILLED in line]
        if not killed:
            return None
        said = "".join(c if c.isprintable() else "?" for c in killed[-1].strip())[:400]
        return f"{said}; kubectl logs {_name(pod)}"
    containers = (pod.get("spec") or {}).get("containers") or []
    trainer: Object = next((c for c in containers if c.get("name") == status.get("name")), {})
    limit = ((trainer.get("resources") or {}).get("limits") or {}).get("memory")
    return (
        f"the training container was killed for running out of memory (OOMKilled, exit "
        f"{terminated.get('exitCode')}; memory limit {limit or 'none set: the node ran out'}): raise "
        "resources.limits.memory, or make the checkpoints' share smaller: an async save holds a second host copy "
        "of the state while it stages (README 'Staging memory': release_staging=True, async_save=False); "
        f"kubectl describe pod {_name(pod)}"
    )


def _still_running(pod: Object) -> bool:
    """The pod itself has not ended (a sidecar runs on after the agent exited) and is not going."""
    return (pod.get("status") or {}).get("phase") not in ("Succeeded", "Failed") and not _deleting(pod)


def _unschedulable(pod: Object) -> str | None:
    """The scheduler's word on a pod it cannot place (``PodScheduled=False``, reason Unschedulable)."""
    if (pod.get("spec") or {}).get("nodeName"):
        return None
    for condition in (pod.get("status") or {}).get("conditions") or []:
        if (
            condition.get("type") == "PodScheduled"
            and condition.get("status") == "False"
            and condition.get("reason") == "Unschedulable"
        ):
            return str(condition.get("message") or "no node fits the pod")
    return None


_NOT_STARTING = frozenset(
    {
        "ErrImagePull",
        "ImagePullBackOff",
        "ErrImageNeverPull",
        "InvalidImageName",
        "CreateContainerConfigError",
        "CreateContainerError",
        "RunContainerError",
        "CrashLoopBackOff",
    }
)
"""A container's waiting reasons that mean it will not start by itself (containerCreating and
PodInitializing are a start in progress)."""


def _agent_started(pod: Object) -> bool:
    """The pod runs and its training container (the agent) is up, though not ready: its ranks have
    not reported. Its ``/status`` says whether they have been waiting too long (``RANKS_NOT_MEETING``)."""
    running = (pods.training_container_status(pod).get("state") or {}).get("running")
    return (pod.get("status") or {}).get("phase") == "Running" and running is not None


def _not_starting(pod: Object, report: AgentReport) -> tuple[str, str] | None:
    """The first container (init containers first) waiting for a reason it will not get past alone;
    else, for an agent that runs, its word that its ranks have not connected (``RANKS_NOT_MEETING``)."""
    status = pod.get("status") or {}
    for container in (status.get("initContainerStatuses") or []) + (status.get("containerStatuses") or []):
        waiting = (container.get("state") or {}).get("waiting") or {}
        reason = str(waiting.get("reason") or "")
        if reason in _NOT_STARTING:
            message = str(waiting.get("message") or "")
            where = f"container {container.get('name')}"
            return reason, f"{where}: {message}" if message else where
    if report.ranks_not_meeting is not None:
        return RANKS_NOT_MEETING, f"its agent: {report.ranks_not_meeting}"
    return None


POD_SECURITY_REFUSAL = "violates PodSecurity"
"""How the API server words a pod that the namespace's Pod Security admission refuses."""


# The controls of the Pod Security Standards a refusal names ("<control> (<detail>)", Kubernetes'
# pod-security-admission policy checks), by what fixes them: a securityContext field to set, or
# something the pod asks for that the standard forbids, to remove.
_PSS_SET = ("allowPrivilegeEscalation != false", "unrestricted capabilities", "runAsNonRoot != true", "seccompProfile")
_PSS_REMOVE = {
    "host namespaces": "hostNetwork, hostPID or hostIPC (whichever it names)",
    "hostPort": "the containers' hostPort",
    "hostPath volume": "the hostPath volumes it names",
    "restricted volume type": "the volumes it names (or use a type the standard allows: configMap, csi, "
    "downwardAPI, emptyDir, ephemeral, persistentVolumeClaim, projected, secret)",
    "privileged": "securityContext.privileged: true",
    "hostProcess": "securityContext.windowsOptions.hostProcess",
    "runAsUser=0": "runAsUser: 0",
    "seLinuxOptions": "the seLinuxOptions it names",
    "procMount": "securityContext.procMount",
    "forbidden sysctl": "the sysctls it names",
    "forbidden AppArmor profile": "the Unconfined AppArmor profile",
    "non-default capabilities": "the capabilities it adds (capabilities.add) beyond the default set",
}
"""Controls by the name a refusal gives them, in the singular: the API server names some in the
plural when several values break them ("hostPorts", "forbidden AppArmor profiles")."""


def _pss_controls(said: str) -> list[str]:
    """The controls a Pod Security refusal names."""
    listed = said.split(POD_SECURITY_REFUSAL, 1)[1]
    return [c for c in (*_PSS_SET, *_PSS_REMOVE) if re.search(rf'(?:": |\), ){re.escape(c)}s? \(', listed)]


def _refusal_hint(error: KubeError, *, fallback: bool = False) -> str:
    """What to change when an admission policy of the namespace (Pod Security admission, a
    validating webhook such as Kyverno's or Gatekeeper's) refuses a worker pod; "" for other errors.

    spotjob adds nothing these policies forbid (README "Locked-down namespaces"): what they name
    comes from the job's ``spec.template`` (or its absence), and is changed there; on the fallback
    capacity (``fallback``) from the template merged with ``spec.fallback.template``, whose values
    and nulls (a null removes a key of spec.template's, its securityContext say) are what differs; the advice follows
    the controls a Pod Security refusal names: a field to set, or something to remove (``hostNetwork``)."""
    if error.status != 403:
        return ""
    said = str(error)
    if fallback:
        built = "spec.template with spec.fallback.template merged in describes it (the attempt runs on the fallback)"
        where = "spec.fallback.template"
    else:
        built, where = "spec.template describes it", "spec.template"
    if POD_SECURITY_REFUSAL in said:
        controls = _pss_controls(said)
        advice = []
        if any(c in _PSS_SET for c in controls) or not controls:
            none = "; a null there removes spec.template's" if fallback else "; a job without a template gets none"
            advice.append(
                f"set what it names in {where} (spec.securityContext and each container's securityContext{none})"
            )
        removes = [_PSS_REMOVE[c] for c in controls if c in _PSS_REMOVE]
        if removes:
            whose = "spec.template or spec.fallback.template, whichever sets it" if fallback else where
            advice.append(f"remove {', '.join(removes)} from {whose}")
        return (
            ". The namespace's Pod Security admission (label pod-security.kubernetes.io/enforce) refuses the worker "
            f"pod as {built}: {'; '.join(advice)}, then the next try creates it "
            "(README 'Locked-down namespaces')"
        )
    if "admission webhook" in said and "denied the request" in said:
        return (
            f". An admission policy of the cluster refuses the worker pod as {built}: change "
            f"{where} as it says (or have the policy exempt the job), then the next try creates it "
            "(README 'Locked-down namespaces')"
        )
    return ""


def _alive(pod: Object) -> bool:
    return _phase(pod)[0].alive


def _flush_state(answer: CallResult) -> FlushRequestState:
    if answer.state is CallState.ACCEPTED:
        return FlushRequestState.accepted()
    if answer.state is CallState.FAILED:
        return FlushRequestState(FlushRequestOutcome.FAILED, answer.detail)
    return FlushRequestState.pending()


def _training_container(spec: JobSpec) -> tuple[int, Mapping[str, Any]]:
    found = spec.training_container()
    # Without a template, the one container built is named spec.containerName, else "trainer".
    return found if found is not None else (0, {"name": spec.container_name or DEFAULT_CONTAINER_NAME})


def _worker_spec(spec: JobSpec) -> pods.WorkerSpec:
    index, container = _training_container(spec)
    ck = spec.checkpoint
    return pods.WorkerSpec(
        template=spec.template,
        container=index,
        container_name=str(container.get("name") or DEFAULT_CONTAINER_NAME),
        image=spec.image,
        command=list(spec.command),
        env=dict(spec.env),
        replicas=spec.replicas,
        nproc_per_node=spec.nproc_per_node,
        checkpoint_uri=ck.uri,
        every_steps=ck.every_steps,
        every_seconds=ck.every_seconds,
        keep=ck.keep,
        flush_timeout_seconds=spec.flush_timeout_seconds,
    )
