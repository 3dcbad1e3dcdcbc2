"""Preemption signals read from Node and Pod objects, as ``orchestrator.signals.Signal``.

Pure functions over the objects the informers cached (JSON dicts): no API calls, no sleeping, so a
test hands them dicts and a clock. What they read, and what each means:

Node taints (each key checked against its project's own docs or code, cited beside it):
- ``aws-node-termination-handler/spot-itn``: NTH received a spot interruption notice (2 minutes).
- ``aws-node-termination-handler/rebalance-recommendation``: elevated interruption risk; advisory
  unless ``--rebalance flush`` (then it is acted on like an interruption, the way NTH's
  rebalance draining does).
- ``aws-node-termination-handler/scheduled-maintenance``: an EC2 scheduled event (retirement,
  reboot) will take the instance.
- ``aws-node-termination-handler/asg-lifecycle-termination``: the ASG is terminating the instance.
- ``karpenter.sh/disrupted`` (Karpenter v1) and ``karpenter.sh/disruption`` (v0.32 to v0.37, value
  ``disrupting``): Karpenter is draining the node to delete it (interruption, consolidation, drift).
- ``cloud.google.com/impending-node-termination``: GKE (its node termination handler) is about to
  terminate the VM (preemption or host maintenance of a non-migratable VM: ~30 s).
- ``node.kubernetes.io/out-of-service``: an operator (or cloud provider) declared the node shut
  down without grace: nothing on it can flush; it is lost.

Node annotation ``spotjob.dev/interruption`` (JSON ``{kind, deadline, messageId, source, time, …}``):
written by the leader's interruption-queue reader (``orchestrator.k8s.interruption_queue``) from a
cloud message, before the message is deleted. ``kind`` is a ``SignalKind`` value; ``deadline`` and
``time`` are RFC 3339. A notice older than ``INTERRUPTION_TTL_SECONDS`` (its deadline, else its
time) no longer counts: EC2 has long acted on it, and a node stopped and started again under the
same name must not carry it for ever.

Node loss: a Node deleted, or NotReady/Unknown (or missing from the cache) for longer than a grace
period. One look at a cache proves nothing (a kubelet can miss a heartbeat), so
``NodeLossTracker`` remembers when it first saw each node not ready, across reconcile passes, by
its own clock; a deletion the Node informer reported counts at once.

Pod condition ``DisruptionTarget=True``: Kubernetes is about to terminate the pod; the reason says
why (PreemptionByScheduler, DeletionByTaintManager, EvictionByEvictionAPI, DeletionByPodGC,
TerminationByKubelet; see kubernetes.io/docs/concepts/workloads/pods/disruptions/#pod-disruption-conditions).

Signals are deduplicated per node: several notices about one node become one signal, of the most
severe kind, with the earliest deadline and every source named in its detail.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any

from orchestrator.model import parse_timestamp
from orchestrator.signals import Signal, SignalKind

log = logging.getLogger(__name__)

Object = dict[str, Any]

SOURCE_NODE = "k8s-node"
SOURCE_POD = "k8s-pod"
SOURCE_QUEUE = "aws-sqs"
INTERRUPTION_ANNOTATION = "spotjob.dev/interruption"
INTERRUPTION_TTL_SECONDS = 3600.0
"""How long after its deadline (or, without one, its time) an interruption annotation counts."""


class RebalancePolicy(StrEnum):
    """What an AWS rebalance recommendation does (``--rebalance``)."""

    IGNORE = "ignore"
    """Advisory: a Rebalance signal that stops nothing (the agent on the node may save early)."""
    FLUSH = "flush"
    """Acted on: the job flushes and moves off the node, as for an interruption notice."""


@dataclass(frozen=True)
class TaintRule:
    key: str
    kind: SignalKind
    meaning: str


# Sources (facts, not code, taken from each project):
# - NTH: aws/aws-node-termination-handler, pkg/node/node.go (SpotInterruptionTaint,
#   ScheduledMaintenanceTaint, ...) and config/helm/aws-node-termination-handler/README.md
#   (TAINT_NODE: "Currently used taint keys are aws-node-termination-handler/scheduled-maintenance,
#   .../spot-itn, .../asg-lifecycle-termination and .../rebalance-recommendation").
# - Karpenter v1: aws/karpenter-provider-aws, website/content/en/preview/concepts/disruption.md
#   (step 3: "Add the karpenter.sh/disrupted:NoSchedule taint"); older releases:
#   designs/no-schedule-taint.md in kubernetes-sigs/karpenter ("karpenter.sh/disruption=disrupting:NoSchedule",
#   v0.32+ with the v1beta1 APIs).
# - GKE: GoogleCloudPlatform/k8s-node-termination-handler (its --taint example,
#   "cloud.google.com/impending-node-termination::NoSchedule"), the taint GKE's termination
#   handling puts on a node whose VM is about to be terminated.
# - Kubernetes: kubernetes.io/docs/reference/labels-annotations-taints/#node-kubernetes-io-out-of-service
#   and kubernetes.io/docs/concepts/cluster-administration/node-shutdown/ (non-graceful shutdown).
TAINT_RULES: tuple[TaintRule, ...] = (
    TaintRule("aws-node-termination-handler/spot-itn", SignalKind.SPOT_INTERRUPTION, "spot interruption notice"),
    TaintRule(
        "aws-node-termination-handler/rebalance-recommendation", SignalKind.REBALANCE, "rebalance recommendation"
    ),
    TaintRule(
        "aws-node-termination-handler/scheduled-maintenance", SignalKind.TERMINATING, "EC2 scheduled maintenance"
    ),
    TaintRule("aws-node-termination-handler/asg-lifecycle-termination", SignalKind.TERMINATING, "ASG termination"),
    TaintRule("karpenter.sh/disrupted", SignalKind.TERMINATING, "Karpenter is disrupting the node"),
    TaintRule("karpenter.sh/disruption", SignalKind.TERMINATING, "Karpenter is disrupting the node (pre-v1)"),
    TaintRule("cloud.google.com/impending-node-termination", SignalKind.SPOT_INTERRUPTION, "GKE is terminating the VM"),
    TaintRule("node.kubernetes.io/out-of-service", SignalKind.NODE_LOST, "node declared out of service"),
)
_RULES = {r.key: r for r in TAINT_RULES}

# Most severe first: a node that is gone outranks one about to go, which outranks advice.
_SEVERITY = {
    SignalKind.NODE_LOST: 4,
    SignalKind.SPOT_INTERRUPTION: 3,
    SignalKind.TERMINATING: 2,
    SignalKind.DISRUPTION_TARGET: 1,
    SignalKind.REBALANCE: 0,
}

DISRUPTION_REASONS = (
    "PreemptionByScheduler",
    "DeletionByTaintManager",
    "EvictionByEvictionAPI",
    "DeletionByPodGC",
    "TerminationByKubelet",
)
"""The DisruptionTarget reasons Kubernetes documents; an unknown one is still a signal."""


def _name(obj: Object) -> str:
    return str((obj.get("metadata") or {}).get("name") or "")


def node_ready(node: Object) -> str | None:
    """The node's Ready condition status: "True", "False", "Unknown", or None if it reports none."""
    for condition in (node.get("status") or {}).get("conditions") or []:
        if condition.get("type") == "Ready":
            return str(condition.get("status") or "Unknown")
    return None


def taint_signals(node: Object, *, rebalance: RebalancePolicy, now: datetime) -> list[Signal]:
    """One signal per known taint on ``node`` (not deduplicated)."""
    name = _name(node)
    out: list[Signal] = []
    for taint in (node.get("spec") or {}).get("taints") or []:
        rule = _RULES.get(str(taint.get("key") or ""))
        if rule is None:
            continue
        kind = rule.kind
        if kind is SignalKind.REBALANCE and rebalance is RebalancePolicy.FLUSH:
            kind = SignalKind.SPOT_INTERRUPTION
        value = taint.get("value")
        detail = f"taint {rule.key}{'=' + str(value) if value else ''} ({rule.meaning})"
        out.append(Signal(kind=kind, source=SOURCE_NODE, node=name, detail=detail, observed_at=now))
    return out


@dataclass(frozen=True)
class Interruption:
    """The ``spotjob.dev/interruption`` annotation, read."""

    kind: SignalKind
    source: str
    deadline: datetime | None
    time: datetime | None
    message_id: str | None
    detail: str


def read_interruption(raw: str) -> Interruption | None:
    """The annotation's value parsed; None when it is not a notice (a malformed value)."""
    try:
        notice = json.loads(raw)
        kind = SignalKind(notice["kind"])
    except (ValueError, KeyError, TypeError):
        return None
    message = notice.get("messageId")
    return Interruption(
        kind=kind,
        source=str(notice.get("source") or "interruption-queue"),
        deadline=parse_timestamp(notice.get("deadline")),
        time=parse_timestamp(notice.get("time")),
        message_id=str(message) if message else None,
        detail=str(notice.get("detail") or ""),
    )


def notice_expired(notice: Interruption, now: datetime) -> bool:
    """Whether a notice is older than ``INTERRUPTION_TTL_SECONDS`` (past its deadline, else its time)."""
    when = notice.deadline or notice.time
    return when is not None and (now - when).total_seconds() > INTERRUPTION_TTL_SECONDS


def severity(kind: SignalKind) -> int:
    """How grave a kind is (a node gone > an interruption > a termination > a disruption > advice)."""
    return _SEVERITY[kind]


def annotation_signal(node: Object, *, rebalance: RebalancePolicy, now: datetime) -> Signal | None:
    """The interruption-queue reader's notice on ``node``, if any and not expired. A malformed one
    is logged and ignored."""
    raw = ((node.get("metadata") or {}).get("annotations") or {}).get(INTERRUPTION_ANNOTATION)
    if not raw:
        return None
    name = _name(node)
    notice = read_interruption(str(raw))
    if notice is None:
        log.warning("node %s: ignoring malformed %s annotation %r", name, INTERRUPTION_ANNOTATION, str(raw)[:200])
        return None
    if notice_expired(notice, now):
        log.debug("node %s: ignoring an expired %s annotation (%s)", name, INTERRUPTION_ANNOTATION, notice.kind)
        return None
    kind = notice.kind
    if kind is SignalKind.REBALANCE and rebalance is RebalancePolicy.FLUSH:
        kind = SignalKind.SPOT_INTERRUPTION
    detail = f"{INTERRUPTION_ANNOTATION} from {notice.source}"
    if notice.detail:
        detail += f": {notice.detail}"
    if notice.message_id:
        detail += f" (message {notice.message_id})"
    return Signal(
        kind=kind,
        source=notice.source,
        node=name,
        deadline=notice.deadline,
        detail=detail,
        observed_at=now,
    )


NOTICE_INDEX = "notice"
"""The Node informer's index (and its one value) of nodes that carry a known preemption taint or
the interruption annotation: the few nodes a pass must look at, out of possibly thousands."""


def notice_index(node: Object) -> list[str]:
    """The Node informer's indexer: ``[NOTICE_INDEX]`` for a node with a taint of ``TAINT_RULES``
    or the ``spotjob.dev/interruption`` annotation (whatever its content), else ``[]``."""
    taints = (node.get("spec") or {}).get("taints") or []
    if any(str(t.get("key") or "") in _RULES for t in taints):
        return [NOTICE_INDEX]
    if INTERRUPTION_ANNOTATION in ((node.get("metadata") or {}).get("annotations") or {}):
        return [NOTICE_INDEX]
    return []


def nodes_being_taken(nodes: Iterable[Object], *, rebalance: RebalancePolicy, now: datetime) -> frozenset[str]:
    """The names of ``nodes`` being taken away now: a preemption signal (a taint of ``TAINT_RULES``
    or an interruption notice) on them. Hand it the Node cache's ``by_index(NOTICE_INDEX,
    NOTICE_INDEX)``: every other node has neither, and copying a thousand of them per pass is what
    made a reconcile's cost grow with the cluster."""
    out = set()
    for node in nodes:
        found = taint_signals(node, rebalance=rebalance, now=now)
        notice = annotation_signal(node, rebalance=rebalance, now=now)
        if notice is not None:
            found.append(notice)
        if any(s.kind.is_preemption for s in found):
            out.add(_name(node))
    return frozenset(out)


def node_change_matters(old: Object, new: Object) -> bool:
    """Whether a Node update changed what a job's reconcile reads of it: its taints, its
    interruption notice, its Ready status, its labels (zone, instance type) or its deletion. A
    kubelet's periodic status post (heartbeat times only) changes none of them, and a thousand
    nodes post one every few minutes each: those wake no job."""

    def view(node: Object) -> tuple[Any, ...]:
        meta = node.get("metadata") or {}
        return (
            (node.get("spec") or {}).get("taints") or [],
            (meta.get("annotations") or {}).get(INTERRUPTION_ANNOTATION),
            meta.get("labels") or {},
            meta.get("deletionTimestamp"),
            node_ready(node),
        )

    return view(old) != view(new)


def new_node_notice(old: Object | None, new: Object) -> bool:
    """Whether Node ``new`` carries a preemption taint or an interruption annotation that ``old``
    did not: the moment the flush of its jobs becomes urgent. A node that carried one already (a
    rebalance recommendation, an expired notice) and now gets another (the spot interruption that
    follows) is urgent too."""
    return bool(_notices(new) - (_notices(old) if old is not None else set()))


def _notices(node: Object) -> set[str]:
    """The preemption taints (by key) and the interruption annotation (by value) on ``node``."""
    found = {"taint " + str(t.get("key") or "") for t in (node.get("spec") or {}).get("taints") or []}
    found &= {"taint " + key for key in _RULES}
    annotation = ((node.get("metadata") or {}).get("annotations") or {}).get(INTERRUPTION_ANNOTATION)
    if annotation is not None:
        found.add("annotation " + str(annotation))
    return found


def new_pod_notice(old: Object | None, new: Object) -> bool:
    """Whether Pod ``new`` carries DisruptionTarget=True and ``old`` did not."""
    now = datetime.now(UTC)
    return bool(pod_signals(new, now=now)) and not (old is not None and pod_signals(old, now=now))


def pod_signals(pod: Object, *, now: datetime) -> list[Signal]:
    """A DisruptionTarget=True condition on ``pod``, as a signal naming the worker and its node."""
    for condition in (pod.get("status") or {}).get("conditions") or []:
        if condition.get("type") == "DisruptionTarget" and condition.get("status") == "True":
            reason = str(condition.get("reason") or "Unknown")
            message = str(condition.get("message") or "")
            detail = f"DisruptionTarget {reason}" + (f": {message}" if message else "")
            node = (pod.get("spec") or {}).get("nodeName") or None
            return [
                Signal(
                    kind=SignalKind.DISRUPTION_TARGET,
                    source=SOURCE_POD,
                    node=node,
                    worker=_name(pod),
                    detail=detail,
                    observed_at=now,
                )
            ]
    return []


class NodeLossTracker:
    """Remembers, across passes, since when each node looked lost; declares it lost after a grace.

    ``observe`` is called with what the cache shows now (``None``: the node is not in the cache).
    A Ready node is forgotten. ``deleted`` (from the Node informer's delete handler) makes a node
    lost at once. Thread-safe: informer handlers and workers call it concurrently.
    """

    def __init__(
        self,
        grace_seconds: float,
        *,
        clock: Callable[[], float] = time.monotonic,
        remember_deleted_seconds: float = 3600.0,
    ) -> None:
        if grace_seconds < 0:
            raise ValueError("the node-lost grace cannot be negative")
        self.grace = grace_seconds
        self._clock = clock
        self._remember = remember_deleted_seconds
        self._lock = threading.Lock()
        self._unready_since: dict[str, float] = {}
        self._deleted_at: dict[str, float] = {}

    def deleted(self, name: str) -> None:
        with self._lock:
            self._deleted_at[name] = self._clock()
            self._unready_since.pop(name, None)

    def observe(self, name: str, node: Object | None) -> str | None:
        """Why ``name`` is lost now (a sentence), or None while it is not (yet)."""
        now = self._clock()
        with self._lock:
            self._expire(now)
            if node is not None:
                self._deleted_at.pop(name, None)  # re-registered under the same name: judge the new object
            elif name in self._deleted_at:
                return "node deleted"
            state = "absent from the cluster" if node is None else _unready(node)
            if state is None:
                self._unready_since.pop(name, None)
                return None
            since = self._unready_since.setdefault(name, now)
            waited = now - since
            if waited >= self.grace:
                return f"node {state} for {waited:.0f}s (grace {self.grace:.0f}s)"
            return None

    def _expire(self, now: float) -> None:
        for name in [n for n, t in self._deleted_at.items() if now - t > self._remember]:
            del self._deleted_at[name]


def _unready(node: Object) -> str | None:
    status = node_ready(node)
    if status == "True":
        return None
    return "NotReady" if status == "False" else "Ready=Unknown" if status is not None else "without a Ready condition"


def deduplicate(signals: Iterable[Signal]) -> list[Signal]:
    """One signal per node (the most severe kind, the earliest deadline, every detail); signals
    that name only a worker pass through. Order: by node name, then workers."""
    by_node: dict[str, list[Signal]] = {}
    rest: list[Signal] = []
    for s in signals:
        if s.node is not None and s.worker is None:
            by_node.setdefault(s.node, []).append(s)
        else:
            rest.append(s)
    out: list[Signal] = []
    for node in sorted(by_node):
        group = by_node[node]
        top = max(group, key=lambda s: _SEVERITY[s.kind])
        deadlines = [s.deadline for s in group if s.deadline is not None]
        details = "; ".join(dict.fromkeys(s.detail for s in sorted(group, key=lambda s: -_SEVERITY[s.kind])))
        # Sorted, not in arrival order: the joined sources are a metric label, one series per set.
        sources = ",".join(sorted({s.source for s in group}))
        out.append(
            Signal(
                kind=top.kind,
                source=top.source if len(group) == 1 else sources,
                node=node,
                deadline=min(deadlines) if deadlines else None,
                detail=details,
                observed_at=top.observed_at,
            )
        )
    return out + rest


class ClusterSignals:
    """The signals about a job's workers and their nodes, in one call per reconcile pass.

    The Kubernetes backend's ``signals(job)`` hands it the job's pods (from the Pod cache) and a
    lookup into the Node cache; the Node informer's delete handler calls ``node_deleted``.
    """

    def __init__(
        self,
        *,
        rebalance: RebalancePolicy = RebalancePolicy.IGNORE,
        node_lost_grace_seconds: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
        now: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        self.rebalance = rebalance
        self.tracker = NodeLossTracker(node_lost_grace_seconds, clock=clock)
        self._now = now

    def node_deleted(self, node: Object) -> None:
        self.tracker.deleted(_name(node))

    def for_node(self, name: str, node: Object | None) -> list[Signal]:
        """Every signal about one node (deduplicated to at most one)."""
        now = self._now()
        found: list[Signal] = []
        lost = self.tracker.observe(name, node)
        if lost is not None:
            found.append(Signal(kind=SignalKind.NODE_LOST, source=SOURCE_NODE, node=name, detail=lost, observed_at=now))
        if node is not None:
            found.extend(taint_signals(node, rebalance=self.rebalance, now=now))
            notice = annotation_signal(node, rebalance=self.rebalance, now=now)
            if notice is not None:
                found.append(notice)
        return deduplicate(found)

    def for_workers(self, pods: Iterable[Object], node: Callable[[str], Object | None]) -> list[Signal]:
        """Signals for the nodes ``pods`` run on and for the pods themselves."""
        found: list[Signal] = []
        nodes: set[str] = set()
        now = self._now()
        for pod in pods:
            found.extend(pod_signals(pod, now=now))
            name = (pod.get("spec") or {}).get("nodeName")
            if name:
                nodes.add(str(name))
        for name in sorted(nodes):
            found.extend(self.for_node(name, node(name)))
        return deduplicate(found)
