"""Cluster- and cloud-level signals, normalised to one ``Signal`` type (Karpenter's messages).

Every source — an AWS interruption queue message, a GCP preemption notice seen on a node, a
Kubernetes node taint or a pod's DisruptionTarget condition, a preemption injected in local mode —
becomes a ``Signal`` naming the node (or worker) it concerns. A message a source cannot parse is
logged and dropped there; the reconciler only ever sees ``Signal``. The sources live beside the
backend that reads them: ``orchestrator.k8s.cluster_signals`` (taints, pod conditions, node loss,
the annotation ``orchestrator.k8s.interruption_queue`` writes) and ``orchestrator.backends.local``
(a simulated node's notice).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum


class SignalKind(StrEnum):
    """What a signal says is about to happen."""

    SPOT_INTERRUPTION = "SpotInterruption"
    """The cloud reclaims the instance at ``deadline`` (AWS: 2 minutes, GCP/Azure: 30 seconds)."""
    REBALANCE = "Rebalance"
    """Elevated risk of interruption (AWS rebalance recommendation). Advisory: nothing is stopped;
    the agent that hears it saves early on its own."""
    NODE_LOST = "NodeLost"
    """The node is gone or unreachable now (deleted, NotReady): no flush is possible there."""
    DISRUPTION_TARGET = "DisruptionTarget"
    """Kubernetes is about to evict the worker (pod condition DisruptionTarget: drain, preemption)."""
    TERMINATING = "Terminating"
    """The node is shutting down (a termination taint, a graceful node shutdown)."""

    @property
    def is_preemption(self) -> bool:
        """Whether the capacity goes away: the job must flush and move. False for advisory kinds."""
        return self is not SignalKind.REBALANCE


@dataclass(frozen=True)
class Signal:
    """One normalised notice about a node or a worker.

    At least one of ``node`` and ``worker`` is set; the reconciler acts on a signal only if it
    names a node or worker of the job's current attempt.
    """

    kind: SignalKind
    source: str
    """Where it came from: "aws-sqs", "gcp-metadata", "k8s-node", "k8s-pod", "local" …"""
    node: str | None = None
    worker: str | None = None
    deadline: datetime | None = None
    """When the capacity goes away, if the source says (timezone-aware)."""
    detail: str = ""
    """The source's own words (message id, taint key, condition message), for events and logs."""
    observed_at: datetime | None = None

    def __post_init__(self) -> None:
        if self.node is None and self.worker is None:
            raise ValueError(f"a {self.kind} signal from {self.source} must name a node or a worker")

    def describe(self) -> str:
        where = f"node {self.node}" if self.node is not None else f"worker {self.worker}"
        return f"{self.kind} for {where} (from {self.source})"


__all__ = ["Signal", "SignalKind"]
