"""Checkpoint hints on the test API server: the running workers of the current attempt carry the
newest commit as annotations, one merge patch per pod per commit however many commits a pass
brings, none when nothing changed (counted through the audit log)."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from ctl_support import CONTROLLER_USER, TestApi, wait_for

from orchestrator.k8s.api import PODS, KubeClient
from orchestrator.k8s.hints import STEP_ANNOTATION, TIME_ANNOTATION, CheckpointHints
from orchestrator.k8s.informer import Informer
from orchestrator.k8s.pods import JOB_LABEL
from orchestrator.model import CheckpointInfo, JobKey

KEY = JobKey("default", "train")
T0 = datetime(2026, 3, 1, 10, 0, tzinfo=UTC)


def checkpoint(step: int) -> CheckpointInfo:
    return CheckpointInfo(step=step, uri=f"s3://b/train/step-{step:09d}", time=T0 + timedelta(seconds=step))


def make_pod(test_api: TestApi, name: str, attempt: int, *, running: bool) -> None:
    body = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": "default",
            "labels": {JOB_LABEL: "train", "spotjob.dev/attempt": str(attempt), "spotjob.dev/index": name[-1]},
        },
        "spec": {"containers": [{"name": "trainer", "image": "train:1"}]},
    }
    test_api.admin.create(PODS, body, "default")
    if running:
        set_running(test_api, name)


def set_running(test_api: TestApi, name: str) -> None:
    test_api.admin.patch(PODS, name, {"status": {"phase": "Running"}}, "default", subresource="status")


class World:
    def __init__(self, test_api: TestApi) -> None:
        self.test_api = test_api
        self.client: KubeClient = test_api.client()
        self.pods = Informer(
            self.client,
            PODS,
            label_selector=JOB_LABEL,
            indexers={"job": lambda p: [f"default/{p['metadata']['labels'][JOB_LABEL]}"]},
        )
        self.pods.start()
        assert self.pods.wait_for_sync(30)
        self.hints = CheckpointHints(self.client, self.pods.cache)

    def hints_of(self, name: str) -> dict[str, str]:
        meta = self.test_api.admin.get(PODS, name, "default")["metadata"]
        annotations: dict[str, Any] = meta.get("annotations") or {}
        return {k: v for k, v in annotations.items() if k in (TIME_ANNOTATION, STEP_ANNOTATION)}

    def patches(self) -> list[str]:
        return [
            r["name"]
            for r in self.test_api.audit()
            if r["user"] == CONTROLLER_USER and r["verb"] == "patch" and r["resource"] == "pods"
        ]

    def cached(self, name: str, step: int) -> bool:
        pod = self.pods.cache.get("default", name) or {}
        return (pod.get("metadata", {}).get("annotations") or {}).get(STEP_ANNOTATION) == str(step)


@pytest.fixture
def world(test_api: TestApi) -> Iterator[World]:
    make_pod(test_api, "train-0-0", 0, running=True)  # the stopped attempt's, still running
    make_pod(test_api, "train-1-0", 1, running=True)
    make_pod(test_api, "train-1-1", 1, running=False)
    w = World(test_api)
    wait_for(lambda: len(w.pods.cache) == 3 and w.pods.cache.get("default", "train-1-0")["status"].get("phase"))
    yield w
    w.pods.stop()
    w.client.close()


def test_the_running_workers_of_the_attempt_carry_the_newest_commit(world: World) -> None:
    assert world.hints.sync(KEY, checkpoint(10), attempt=1) == 1

    assert world.hints_of("train-1-0") == {STEP_ANNOTATION: "10", TIME_ANNOTATION: "2026-03-01T10:00:10Z"}
    assert world.hints_of("train-1-1") == {}, "not running yet"
    assert world.hints_of("train-0-0") == {}, "not the current attempt"


def test_one_patch_per_commit_however_many_commits_a_pass_brings_and_none_when_nothing_changed(world: World) -> None:
    world.hints.sync(KEY, checkpoint(10), attempt=1)
    # Passes before the cache shows the patch: nothing is patched twice.
    assert world.hints.sync(KEY, checkpoint(10), attempt=1) == 0
    wait_for(lambda: world.cached("train-1-0", 10), what="the patch in the cache")
    assert world.hints.sync(KEY, checkpoint(10), attempt=1) == 0

    # Steps 20, 30 and 40 committed between two passes: one patch, the newest.
    assert world.hints.sync(KEY, checkpoint(40), attempt=1) == 1
    assert world.hints_of("train-1-0")[STEP_ANNOTATION] == "40"
    assert world.patches() == ["train-1-0", "train-1-0"]

    # The second worker starts running: it gets the hints at the next pass, once.
    set_running(world.test_api, "train-1-1")
    wait_for(lambda: world.pods.cache.get("default", "train-1-1")["status"].get("phase") == "Running")
    assert world.hints.sync(KEY, checkpoint(40), attempt=1) == 1
    assert world.hints_of("train-1-1")[STEP_ANNOTATION] == "40"
    assert world.hints.sync(KEY, checkpoint(40), attempt=1) == 0
    assert sorted(world.patches()) == ["train-1-0", "train-1-0", "train-1-1"]


def test_no_checkpoint_yet_patches_nothing(world: World) -> None:
    assert world.hints.sync(KEY, None, attempt=1) == 0
    assert world.patches() == []


def test_a_failed_patch_is_retried_at_the_next_pass(world: World) -> None:
    world.test_api.fault(verb="patch", resource="pods", status=500, count=100)
    assert world.hints.sync(KEY, checkpoint(10), attempt=1) == 0
    world.test_api.clear_faults()
    assert world.hints.sync(KEY, checkpoint(10), attempt=1) == 1
    assert world.hints_of("train-1-0")[STEP_ANNOTATION] == "10"
