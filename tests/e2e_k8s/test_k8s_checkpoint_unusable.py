"""A checkpoint with a byte damaged in place on the test cluster, driven by a real ``spotjob-controller``.

The controller judges checkpoints by their files' sizes and reads no byte of them; the ranks check
each file's CRC32C as they restore and pass over a damaged one for an older one. On Kubernetes the
controller learns it from the agents' ``GET /status`` (``restored_step``, ``restore_passed_over``).
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from e2e_support import (
    Controller,
    assert_same_final_state,
    create_job,
    job_events,
    job_pods,
    running_pods,
    spotjob_body,
    status,
    wait,
    wait_phase,
)
from local_run_support import flip_byte_in_place

from agent.catalog import list_checkpoints
from agent.storage import open_storage
from tests.k8s.cluster import TestCluster

pytestmark = pytest.mark.slow


def test_a_flushed_checkpoint_damaged_in_place_before_the_next_attempt_restores_is_told_and_its_steps_counted(
    cluster: TestCluster,
    namespace: str,
    start_controller: Callable[..., Controller],
    uninterrupted: Path,
    tmp_path: Path,
) -> None:
    """Preempted on the only node: the flush commits, the next attempt's pod waits for a node and
    is named to resume from the flush's step. A byte of that checkpoint is then flipped, its size
    unchanged, and a node added: the ranks restore the one before. The Kubernetes path had not been
    run: the agents' report of it must reach the reconciler, which tells CheckpointUnusable with
    the ranks' reason, records the step restored, and counts the steps trained again."""
    uri = str(tmp_path / "ckpt")
    cluster.add_node(f"{namespace}-a", zone="us-east-1a")
    start_controller(namespace)
    dumps = tmp_path / "dumps"
    dumps.mkdir()
    create_job(cluster, spotjob_body("train", namespace, uri=uri, dump_dir=dumps, step_sleep=0.3, every_steps=5))
    wait_phase(cluster, namespace, "train", "Running")
    storage = open_storage(uri)
    wait(lambda: sum(c.valid for c in list_checkpoints(storage)) >= 2, "two committed checkpoints")
    assert running_pods(cluster, namespace, "train", 0), "the job ended before it could be preempted"
    cluster.taint_node(f"{namespace}-a", "aws-node-termination-handler/spot-itn", "true", "NoSchedule")

    def waiting_for_a_node() -> dict[str, Any] | None:
        st = status(cluster, namespace, "train")
        attempt = st.get("attempt") or {}
        return st if attempt.get("number") == 1 and attempt.get("resumedFromStep") is not None else None

    before_damage = wait(waiting_for_a_node, "attempt 1 named the flush's checkpoint, its pod waiting for a node")
    assert not running_pods(cluster, namespace, "train", 1)
    damaged, older = [c for c in list_checkpoints(storage) if c.valid][:2]
    newest, before = damaged.ref, older.ref
    assert damaged.manifest is not None
    assert before_damage["attempt"]["resumedFromStep"] == newest.step, (before_damage["attempt"], newest)
    shard = Path(uri) / newest.folder / "__0_0.distcp"
    flip_byte_in_place(shard)
    lost_before = before_damage.get("lostSteps", 0)
    cluster.add_node(f"{namespace}-b", zone="us-east-1b")

    def told() -> list[dict[str, Any]]:
        return [e for e in job_events(cluster, namespace, "train") if e["reason"] == "CheckpointUnusable"]

    [event] = wait(told, "the CheckpointUnusable Event")
    note = event["note"]
    assert event["type"] == "Warning"
    assert note.startswith(f"step {newest.step}, the newest checkpoint this job had recorded, did not load"), note
    assert "CRC32C" in note and "__0_0.distcp" in note, note
    assert f"after step {before.step} are trained again" in note, note
    assert note.endswith(f": the job resumes from step {before.step}"), note
    # The pass that told it took the damaged checkpoint out of lastCheckpoint: back to the step
    # restored while that is storage's newest usable one (remembered in unusableCheckpoint), or the
    # newer one the ranks committed since (the report comes with the agents' /status, polled).
    told_status = status(cluster, namespace, "train")
    named = told_status["lastCheckpoint"]
    shown = (named["uri"], named["step"], datetime.fromisoformat(named["time"].replace("Z", "+00:00")))
    assert shown != (f"file://{uri}/{newest.folder}", newest.step, damaged.manifest.created_at), named
    assert named["step"] >= before.step, named
    unusable = told_status.get("unusableCheckpoint")
    if unusable is not None:  # the ranks had committed no newer one yet
        assert (unusable["step"], unusable["restoredStep"]) == (newest.step, before.step), unusable
        assert "CRC32C" in unusable["reason"] and named["step"] == before.step, (unusable, named)

    final = wait_phase(cluster, namespace, "train", "Succeeded")
    storage.close()
    assert (final["attempt"]["resumedFromStep"], final["attempt"]["restoredStep"]) == (newest.step, before.step)
    assert final["lostSteps"] - lost_before == newest.step - before.step, (final["lostSteps"], lost_before)
    assert final["lastCheckpoint"]["step"] > newest.step and final.get("unusableCheckpoint") is None, final
    assert len(told()) == 1  # told once, not at every pass
    (last,) = [
        p for p in job_pods(cluster, namespace, "train") if p["metadata"]["labels"]["spotjob.dev/attempt"] == "1"
    ]
    assert_same_final_state(dumps / last["metadata"]["name"], uninterrupted)
