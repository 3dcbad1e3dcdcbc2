"""Checkpoint-aware preemption hints: a running worker's pod says when its job last committed.

Every running worker pod of a SpotJob with a checkpoint carries two annotations, for schedulers and policy scripts
that choose which pods to preempt (the cheapest victim is one that just checkpointed):

- ``spotjob.dev/last-checkpoint-time``: when the newest valid checkpoint was committed (RFC 3339, UTC);
- ``spotjob.dev/last-checkpoint-step``: the training step it holds.

They follow the job's ``status.lastCheckpoint`` — storage's word, read by the reconciler; a
template that sets either is refused (``pods.template_problems``), so a pod never carries one the
controller did not write — and are kept current without hammering the API server:
``CheckpointHints.sync`` runs after each reconcile pass of the job, so several commits between two
passes become one patch carrying the newest; a pod that already shows the values (in the cache, or
as this process last patched them while the cache catches up) is not patched; a pod that is not
running, or is being deleted, is left alone. At most one merge patch per pod per commit, then. A
failed patch is logged, counted and tried again at the next pass; it never fails the reconcile.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from datetime import UTC
from typing import Any, Protocol

from orchestrator.k8s.api import PODS, KubeClient, KubeError, NotFound, Object
from orchestrator.k8s.informer import Cache
from orchestrator.k8s.pods import ATTEMPT_LABEL, CHECKPOINT_STEP_ANNOTATION, CHECKPOINT_TIME_ANNOTATION
from orchestrator.model import CheckpointInfo, JobKey

log = logging.getLogger(__name__)

TIME_ANNOTATION = CHECKPOINT_TIME_ANNOTATION
STEP_ANNOTATION = CHECKPOINT_STEP_ANNOTATION


def hint_annotations(checkpoint: CheckpointInfo) -> dict[str, str]:
    """The two annotations for ``checkpoint``."""
    return {
        TIME_ANNOTATION: checkpoint.time.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        STEP_ANNOTATION: str(checkpoint.step),
    }


class HintMetrics(Protocol):
    """What ``CheckpointHints`` counts (``ControllerMetrics.checkpoint_hint_patch``)."""

    def checkpoint_hint_patch(self, outcome: str) -> None: ...


class CheckpointHints:
    """Keeps the hint annotations of each job's running pods current. Thread-safe (passes of
    different jobs run on different workers)."""

    def __init__(self, client: KubeClient, pods: Cache, *, metrics: HintMetrics | None = None) -> None:
        self._client = client
        self._pods = pods
        self._metrics = metrics
        self._lock = threading.Lock()
        self._written: dict[str, dict[str, str]] = {}
        """pod uid -> the hints this process last patched onto it (the cache may lag behind)."""

    def sync(self, key: JobKey, checkpoint: CheckpointInfo | None, attempt: int) -> int:
        """Patch the running pods of ``attempt`` whose hints differ from ``checkpoint``; how many were patched."""
        if checkpoint is None:
            return 0
        want = hint_annotations(checkpoint)
        patched = 0
        for pod in self._pods.by_index("job", str(key)):
            meta = pod.get("metadata") or {}
            uid = str(meta.get("uid") or "")
            if not _running(pod) or meta.get("deletionTimestamp") or _attempt(meta) != attempt:
                continue
            if _shows(meta.get("annotations") or {}, want):
                with self._lock:
                    self._written[uid] = want
                continue
            with self._lock:
                if self._written.get(uid) == want:
                    continue  # patched already; the cache has not caught up yet
            if self._patch(key, pod, want):
                patched += 1
                with self._lock:
                    self._written[uid] = want
        return patched

    def forget(self, pod: Object) -> None:
        """The Pod informer saw a pod go."""
        with self._lock:
            self._written.pop(str((pod.get("metadata") or {}).get("uid") or ""), None)

    def _patch(self, key: JobKey, pod: Object, want: Mapping[str, str]) -> bool:
        name = str((pod.get("metadata") or {}).get("name") or "")
        try:
            self._client.patch(PODS, name, {"metadata": {"annotations": dict(want)}}, key.namespace)
        except NotFound:
            return False  # gone meanwhile
        except KubeError as e:
            log.warning(
                "job %s: cannot update the checkpoint hints of pod %s (next pass tries again): %s", key, name, e
            )
            self._count("failed")
            return False
        log.debug("job %s: pod %s hints step %s", key, name, want[STEP_ANNOTATION])
        self._count("ok")
        return True

    def _count(self, outcome: str) -> None:
        if self._metrics is not None:
            try:
                self._metrics.checkpoint_hint_patch(outcome)
            except Exception:  # a metric is a courtesy
                log.exception("counting a hint patch failed")


def _shows(annotations: Mapping[str, Any], want: Mapping[str, str]) -> bool:
    return all(annotations.get(k) == v for k, v in want.items())


def _running(pod: Object) -> bool:
    return (pod.get("status") or {}).get("phase") == "Running"


def _attempt(meta: Mapping[str, Any]) -> int | None:
    value = (meta.get("labels") or {}).get(ATTEMPT_LABEL)
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None
