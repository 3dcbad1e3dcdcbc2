"""Ranks that start but never meet, on the test cluster with a real ``spotjob-controller`` and real
agents: the agent's warning that no rank has connected reaches the SpotJob while it stays Pending.

The test kubelet runs the pods as local processes and enforces no NetworkPolicy, so the ranks are
kept apart by the script instead (``never_meet.py``: a world size one larger than the ranks
started); what the agent sees, and the controller reads from its ``/status``, is the same: no
rank past init_process_group."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from e2e_support import REPO, Controller, create_job, job_events, spotjob_body, status, wait

from tests.k8s.cluster import TestCluster

pytestmark = pytest.mark.slow


def test_ranks_that_never_meet_raise_ranks_not_meeting_and_one_warning_event_while_the_job_stays_pending(
    cluster: TestCluster, namespace: str, start_controller: Callable[..., Controller], tmp_path: Path
) -> None:
    """Before, the job said ``Pending`` (WorkersStarted) with no Event until init_process_group's
    timeout: the controller asked nothing of an agent whose pod was not ready, and the agent's
    warning stayed in ``kubectl logs``."""
    cluster.add_node(f"{namespace}-a")
    start_controller(namespace)
    body = spotjob_body(
        "stuck", namespace, uri=str(tmp_path / "ckpt"), dump_dir=tmp_path, nproc=1,
        # PYTHONPATH: the pods' agent is this checkout's, whichever one the venv was installed from.
        env={"SPOTJOB_AGENT_RANK_CONNECT_TIMEOUT": "0.5", "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    body["spec"]["command"] = [str(REPO / "tests" / "e2e" / "scripts" / "never_meet.py")]
    create_job(cluster, body)

    def told() -> dict[str, Any] | None:
        s = status(cluster, namespace, "stuck")
        stuck = (s.get("attempt") or {}).get("notStarting") or {}
        return s if stuck.get("reason") == "RanksNotMeeting" and stuck.get("warned") else None

    s = wait(told, "notStarting RanksNotMeeting")
    stuck = s["attempt"]["notStarting"]
    assert s["phase"] == "Pending" and stuck["worker"] == "stuck-0-0", s
    assert "no rank has connected" in stuck["message"] and "They meet at " in stuck["message"], stuck

    def warned() -> list[dict[str, Any]] | None:
        found = [e for e in job_events(cluster, namespace, "stuck") if e.get("reason") == "WorkerNotStarting"]
        return found or None

    # The Event is posted after the status that says it was warned: wait for it, then count it.
    events = wait(warned, "the WorkerNotStarting Event")
    assert len(events) == 1 and events[0]["type"] == "Warning", events
    assert "stuck-0-0 of attempt 0 is not starting: RanksNotMeeting: its agent: no rank has connected" in (
        events[0].get("message") or events[0].get("note") or ""
    ), events
