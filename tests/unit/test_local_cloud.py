"""The simulated cloud of a local run: what one node costs the driver for as long as it lives."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest

from agent.notices.aws import AwsImdsSource
from agent.notices.emulators import ImdsEmulator
from orchestrator.backends.local import LocalBackend
from orchestrator.backends.local_cloud import SimulatedCloud
from orchestrator.backends.local_launch import LocalOptions

GIVE_UP_S = 60.0  # only stops a hung test; nothing here asserts how long anything took


def test_a_nodes_metadata_server_keeps_nothing_of_its_agents_polls(tmp_path: Path) -> None:
    """Its agent polls it every second for as long as the run lasts, and a terminated node stays
    listed: the driver would hold every request of every node it ever had."""
    cloud = SimulatedCloud(str(tmp_path), "run1")
    node = cloud.provision("local-a", "local.cpu-small")
    source = AwsImdsSource(node.imds.url, interval=0.01)
    source.start(lambda notice: None)
    try:
        give_up = time.monotonic() + GIVE_UP_S
        while node.imds.count("GET", ImdsEmulator.INSTANCE_ACTION_PATH, status=404) < 30:
            assert time.monotonic() < give_up, "the agent's source never polled 30 times"
            time.sleep(0.01)
    finally:
        source.stop()
        node.imds.stop()
    assert node.imds.requests == [], "the node's metadata server kept its agent's requests"
    assert node.imds.token_requests >= 1


def test_a_notice_and_the_end_of_a_node_that_lost_nothing_are_logged_at_info(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Every preemption of a local run is the normal path of spot capacity (the agent logs its
    flush at INFO, the Events are Normal), yet the simulated cloud logged the notice and the end of
    a node its flush had already emptied at WARNING, so a run's log had a warning per preemption."""
    with LocalBackend(LocalOptions(root=str(tmp_path / "run"))) as backend:
        node = backend._cloud.provision("zone-a", "local.cpu-small")
        with caplog.at_level(logging.INFO, logger="orchestrator.backends.local"):
            assert backend.preempt(node.name, why="the test") == node.name
            backend._terminate(node)
    lines = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "orchestrator.backends.local"]
    assert any(f"notice for {node.name}" in m for _, m in lines), lines
    assert any(f"{node.name} is gone" in m and "lost nothing" in m for _, m in lines), lines
    assert all(level == logging.INFO for level, _ in lines), lines
