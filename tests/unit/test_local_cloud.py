"""The simulated cloud of a local run: what one node costs the driver for as long as it lives."""

from __future__ import annotations

import time
from pathlib import Path

from agent.notices.aws import AwsImdsSource
from agent.notices.emulators import ImdsEmulator
from orchestrator.backends.local_cloud import SimulatedCloud

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
