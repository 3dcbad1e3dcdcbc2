"""What an operator reads in a SpotJob's status and Events once a job ended, on the test cluster with a
real ``spotjob-controller`` process and real ranks (checkpoints on file://)."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import pytest
from e2e_support import STEPS, Controller, create_job, job_events, spotjob_body, wait_phase

from tests.k8s.cluster import TestCluster

pytestmark = pytest.mark.slow


def test_a_completed_job_says_it_reached_its_last_committed_step_not_the_first_step_hint_it_sampled(
    cluster: TestCluster, namespace: str, start_controller: Callable[..., Controller], tmp_path: Path
) -> None:
    """The step the agents report reaches the status at most once a minute (a sampled hint), so a
    job shorter than that ends with only its first hint seen. Its ``Completed`` message, Ready
    condition, Event and ``attempt.observedStep`` said "last step seen 4" of a job that trained and
    committed all 60 steps; they now say at least the newest step this attempt committed."""
    cluster.add_node(f"{namespace}-a")
    start_controller(namespace)
    dumps = tmp_path / "dumps"
    dumps.mkdir()
    create_job(cluster, spotjob_body("train", namespace, uri=str(tmp_path / "ckpt"), dump_dir=dumps, step_sleep=0.2))

    final = wait_phase(cluster, namespace, "train", "Succeeded")

    assert final["lastCheckpoint"]["step"] == STEPS, final
    assert final["attempt"]["observedStep"] == STEPS, final["attempt"]
    assert final["message"] == f"every worker exited 0 (last step seen {STEPS})", final["message"]
    (ready,) = [c for c in final["conditions"] if c["type"] == "Ready"]
    assert (ready["reason"], ready["message"]) == ("Completed", final["message"])
    (completed,) = [e for e in job_events(cluster, namespace, "train") if e["reason"] == "Completed"]
    assert re.search(rf"last step seen {STEPS}\)", completed["note"]), completed
