"""Preemption signals from Node and Pod objects: taints, the interruption annotation, DisruptionTarget,
and node loss after a grace remembered across passes (with a fake clock: nothing sleeps)."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

import pytest

from orchestrator.k8s.cluster_signals import (
    INTERRUPTION_ANNOTATION,
    ClusterSignals,
    NodeLossTracker,
    RebalancePolicy,
    deduplicate,
    pod_signals,
    taint_signals,
)
from orchestrator.signals import Signal, SignalKind

NOW = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)


class FakeClock:
    def __init__(self) -> None:
        self.now = 500.0

    def __call__(self) -> float:
        return self.now


def node(
    name: str = "n1",
    *,
    taints: list[dict[str, Any]] | None = None,
    ready: str | None = "True",
    annotations: dict[str, str] | None = None,
) -> dict[str, Any]:
    obj: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "annotations": annotations or {}},
        "spec": {"taints": taints or []},
        "status": {"conditions": [] if ready is None else [{"type": "Ready", "status": ready}]},
    }
    return obj


def pod(name: str, node_name: str, conditions: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "namespace": "ns", "labels": {"spotjob.dev/job": "j"}},
        "spec": {"nodeName": node_name},
        "status": {"conditions": conditions or []},
    }


@pytest.mark.parametrize(
    ("key", "kind"),
    [
        ("aws-node-termination-handler/spot-itn", SignalKind.SPOT_INTERRUPTION),
        ("aws-node-termination-handler/scheduled-maintenance", SignalKind.TERMINATING),
        ("aws-node-termination-handler/asg-lifecycle-termination", SignalKind.TERMINATING),
        ("karpenter.sh/disrupted", SignalKind.TERMINATING),
        ("karpenter.sh/disruption", SignalKind.TERMINATING),
        ("cloud.google.com/impending-node-termination", SignalKind.SPOT_INTERRUPTION),
        ("node.kubernetes.io/out-of-service", SignalKind.NODE_LOST),
    ],
)
def test_each_termination_taint_becomes_a_signal_of_its_kind_naming_the_node(key: str, kind: SignalKind) -> None:
    found = taint_signals(
        node(taints=[{"key": key, "value": "evt-1", "effect": "NoSchedule"}]), rebalance=RebalancePolicy.IGNORE, now=NOW
    )
    assert [(s.kind, s.node, s.source) for s in found] == [(kind, "n1", "k8s-node")]
    assert key in found[0].detail and kind.is_preemption


def test_unknown_and_ordinary_taints_are_no_signal() -> None:
    taints = [
        {"key": "nvidia.com/gpu", "effect": "NoSchedule"},
        {"key": "node.kubernetes.io/unschedulable", "effect": "NoSchedule"},
    ]
    assert taint_signals(node(taints=taints), rebalance=RebalancePolicy.IGNORE, now=NOW) == []


def test_a_rebalance_recommendation_is_advisory_unless_told_to_flush() -> None:
    tainted = node(taints=[{"key": "aws-node-termination-handler/rebalance-recommendation", "effect": "NoSchedule"}])
    (advisory,) = taint_signals(tainted, rebalance=RebalancePolicy.IGNORE, now=NOW)
    assert advisory.kind is SignalKind.REBALANCE and not advisory.kind.is_preemption
    (acted,) = taint_signals(tainted, rebalance=RebalancePolicy.FLUSH, now=NOW)
    assert acted.kind.is_preemption


def test_the_interruption_queue_annotation_becomes_a_signal_with_its_deadline_and_source() -> None:
    notice = {"kind": "SpotInterruption", "deadline": "2026-01-01T12:02:00Z", "messageId": "m-1", "source": "aws-sqs"}
    signals = ClusterSignals(now=lambda: NOW).for_node(
        "n1", node(annotations={INTERRUPTION_ANNOTATION: json.dumps(notice)})
    )
    assert len(signals) == 1
    s = signals[0]
    assert (s.kind, s.source, s.node) == (SignalKind.SPOT_INTERRUPTION, "aws-sqs", "n1")
    assert s.deadline == datetime(2026, 1, 1, 12, 2, tzinfo=UTC)
    assert "m-1" in s.detail


@pytest.mark.parametrize("raw", ["not json", json.dumps({"kind": "Meteor"}), json.dumps({"deadline": "x"}), "[1]"])
def test_a_malformed_interruption_annotation_is_ignored(raw: str) -> None:
    assert ClusterSignals(now=lambda: NOW).for_node("n1", node(annotations={INTERRUPTION_ANNOTATION: raw})) == []


@pytest.mark.parametrize(
    "reason",
    [
        "PreemptionByScheduler",
        "DeletionByTaintManager",
        "EvictionByEvictionAPI",
        "DeletionByPodGC",
        "TerminationByKubelet",
    ],
)
def test_a_disruption_target_condition_names_the_worker_its_node_and_the_reason(reason: str) -> None:
    p = pod("j-0-1", "n2", [{"type": "DisruptionTarget", "status": "True", "reason": reason, "message": "drain"}])
    (s,) = pod_signals(p, now=NOW)
    assert (s.kind, s.worker, s.node, s.source) == (SignalKind.DISRUPTION_TARGET, "j-0-1", "n2", "k8s-pod")
    assert reason in s.detail


def test_a_false_disruption_target_or_other_conditions_are_no_signal() -> None:
    p = pod("j-0-1", "n2", [{"type": "DisruptionTarget", "status": "False"}, {"type": "Ready", "status": "True"}])
    assert pod_signals(p, now=NOW) == []


def test_several_notices_about_one_node_become_one_signal_of_the_most_severe_kind() -> None:
    early = datetime(2026, 1, 1, 12, 1, tzinfo=UTC)
    late = datetime(2026, 1, 1, 12, 5, tzinfo=UTC)
    merged = deduplicate(
        [
            Signal(SignalKind.TERMINATING, "k8s-node", node="n1", detail="karpenter", deadline=late),
            Signal(SignalKind.SPOT_INTERRUPTION, "aws-sqs", node="n1", detail="queue", deadline=early),
            Signal(SignalKind.REBALANCE, "k8s-node", node="n2", detail="advice"),
            Signal(SignalKind.DISRUPTION_TARGET, "k8s-pod", node="n1", worker="w", detail="evicted"),
        ]
    )
    n1 = [s for s in merged if s.node == "n1" and s.worker is None]
    assert len(n1) == 1
    assert n1[0].kind is SignalKind.SPOT_INTERRUPTION and n1[0].deadline == early
    assert "karpenter" in n1[0].detail and "queue" in n1[0].detail
    assert [s.kind for s in merged if s.node == "n2"] == [SignalKind.REBALANCE]
    assert [s.worker for s in merged if s.worker] == ["w"]  # a worker's own signal passes through


def test_the_sources_of_one_nodes_signals_are_joined_in_one_order_whatever_order_they_came_in() -> None:
    """The joined sources are the ``source`` label of ``spotjob_signals_total``: in arrival order,
    the same pair made two series (``k8s-node,aws-sqs`` and ``aws-sqs,k8s-node``)."""
    taint = Signal(SignalKind.TERMINATING, "k8s-node", node="n1", detail="karpenter")
    queue = Signal(SignalKind.SPOT_INTERRUPTION, "aws-sqs", node="n1", detail="queue")
    again = Signal(SignalKind.SPOT_INTERRUPTION, "k8s-node", node="n1", detail="taint")
    for order in ([taint, queue, again], [queue, again, taint], [again, taint, queue]):
        (merged,) = deduplicate(order)
        assert merged.source == "aws-sqs,k8s-node", order


def test_a_not_ready_node_is_lost_only_after_the_grace_remembered_across_passes() -> None:
    clock = FakeClock()
    tracker = NodeLossTracker(60, clock=clock)
    unready = node(ready="False")
    assert tracker.observe("n1", unready) is None
    clock.now += 59
    assert tracker.observe("n1", unready) is None
    clock.now += 1
    why = tracker.observe("n1", unready)
    assert why is not None and "NotReady" in why


def test_a_node_ready_again_within_the_grace_starts_over() -> None:
    clock = FakeClock()
    tracker = NodeLossTracker(60, clock=clock)
    tracker.observe("n1", node(ready="Unknown"))
    clock.now += 50
    assert tracker.observe("n1", node(ready="True")) is None
    clock.now += 50
    assert tracker.observe("n1", node(ready="Unknown")) is None  # a fresh grace
    clock.now += 60
    assert "Unknown" in (tracker.observe("n1", node(ready="Unknown")) or "")


def test_a_deleted_node_is_lost_at_once_and_a_missing_one_after_the_grace() -> None:
    clock = FakeClock()
    tracker = NodeLossTracker(30, clock=clock)
    tracker.deleted("gone")
    assert tracker.observe("gone", None) == "node deleted"
    assert tracker.observe("never-seen", None) is None
    clock.now += 30
    assert "absent" in (tracker.observe("never-seen", None) or "")


def test_the_workers_signals_cover_their_nodes_and_themselves_deduplicated() -> None:
    clock = FakeClock()
    signals = ClusterSignals(node_lost_grace_seconds=10, clock=clock, now=lambda: NOW)
    nodes = {
        "n1": node("n1", taints=[{"key": "aws-node-termination-handler/spot-itn", "effect": "NoSchedule"}]),
        "n2": node("n2", ready="False"),
        "n3": node("n3"),
    }
    pods = [
        pod("j-0-0", "n1"),
        pod("j-0-1", "n1"),
        pod("j-0-2", "n2"),
        pod("j-0-3", "n3", [{"type": "DisruptionTarget", "status": "True", "reason": "EvictionByEvictionAPI"}]),
    ]
    first = signals.for_workers(pods, nodes.get)
    assert [(s.kind, s.node, s.worker) for s in first] == [
        (SignalKind.SPOT_INTERRUPTION, "n1", None),  # once, though two workers run there
        (SignalKind.DISRUPTION_TARGET, "n3", "j-0-3"),
    ]
    clock.now += 10
    later = signals.for_workers(pods, nodes.get)
    assert (SignalKind.NODE_LOST, "n2", None) in [(s.kind, s.node, s.worker) for s in later]
