"""``spotjob run --cloud``: local mode simulates a GCP or an Azure spot VM, not only AWS.

Per cloud, the wiring in-process (each node serves only its cloud's metadata, its agent accepts
the command line it gets and hears only that source; a notice is announced as that cloud does;
Azure's node stops once its agent acknowledges the event), the run folder keeping the cloud for
``--resume``, and one real ``spotjob run`` per cloud (GCP, Azure): one preemption, flushed and
resumed to the end, as its checkpoints, its exit code, ``spotjob status`` and the timeline say.
"""

from __future__ import annotations

import io
import json
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest
from rich.console import Console

sys.path.insert(0, str(Path(__file__).resolve().parent / "scripts"))
from local_run_support import TRAIN
from status_in_process import spotjob_status

from agent.catalog import list_checkpoints
from agent.launcher_cli import AgentConfig, parse_args
from agent.notices.azure import parse_not_before
from agent.notices.emulators import AzureScheduledEventsEmulator, GceMetadataEmulator
from agent.storage import open_storage
from orchestrator.backends.local import LocalBackend
from orchestrator.backends.local_cloud import LocalNode, cloud_text
from orchestrator.backends.local_launch import LocalOptions
from orchestrator.backends.local_timeline import EventKind, Timeline
from orchestrator.live import NoticeView, Snapshot, render_snapshot
from orchestrator.model import JobKey, JobStatus
from orchestrator.run_config import RunConfig
from orchestrator.run_driver import LocalRun
from orchestrator.run_setup import RunError

GIVE_UP_S = 120.0
"""Only stops a hung test; nothing here asserts how long anything took."""


def wait_for(predicate: Callable[[], bool], what: str) -> None:
    give_up = time.monotonic() + GIVE_UP_S
    while not predicate():
        assert time.monotonic() < give_up, f"gave up waiting for {what}"
        time.sleep(0.02)


def agent_options(backend: LocalBackend, tmp_path: Path) -> tuple[LocalNode, AgentConfig]:
    """What a worker's spotjob-agent on a fresh node of ``backend`` is told, as the agent parses it."""
    config = RunConfig(script="train.py", args=[], name="run", runs_dir=str(tmp_path), cloud=backend.options.cloud)
    spec = config.job_spec()
    node = backend._cloud.provision("zone-a", "type-a")
    urls = [e.url if e is not None else None for e in (node.imds, node.gce, node.azure)]
    command = backend._command(JobKey.local("run"), spec, 0, 0, urls[0], str(tmp_path / "c"), 29500, urls[1], urls[2])
    assert backend.spec_problems(JobKey.local("run"), spec) == []
    parsed, _ = parse_args(command[command.index("--notices") :], {})
    return node, parsed


# -- the wiring, in-process -------------------------------------------------------------------------


def test_a_gcp_node_serves_gce_metadata_alone_and_announces_a_preemption_as_gce_does(tmp_path: Path) -> None:
    options = LocalOptions(root=str(tmp_path / "run"), notice_seconds=12.0, cloud="gcp")
    with LocalBackend(options) as backend:
        node, parsed = agent_options(backend, tmp_path)
        assert node.imds is None and node.azure is None and node.gce is not None
        assert parsed.notices == ("gcp",) and parsed.gcp_metadata_url == node.gce.url
        # GCE's ~30 s from preempted=TRUE to the stop, scaled to the run's window.
        assert parsed.gcp_notice_seconds == 12.0
        assert backend.preempt(node.name, why="the test") == node.name
        with urllib.request.urlopen(
            urllib.request.Request(
                f"{node.gce.url}{GceMetadataEmulator.PREFIX}instance/preempted", headers={"Metadata-Flavor": "Google"}
            )
        ) as resp:
            assert resp.read() == b"TRUE"
        [signal] = backend.signals(JobKey.local("run"), RunConfig("t.py", [], "run").job_spec())
        assert "GCE instance/preempted TRUE" in signal.detail and "GCE preempted" in signal.describe()
    [notice] = [e for e in Timeline.read(str(tmp_path / "run" / "timeline.jsonl")) if e.kind == EventKind.NOTICE]
    assert (notice.data["cloud"], notice.data["notice"]) == ("gcp", "GCE preempted"), notice


def test_an_azure_node_serves_scheduled_events_alone_and_a_preemption_is_a_preempt_event_at_its_stop(
    tmp_path: Path,
) -> None:
    options = LocalOptions(root=str(tmp_path / "run"), notice_seconds=40.0, cloud="azure")
    with LocalBackend(options) as backend:
        node, parsed = agent_options(backend, tmp_path)
        assert node.imds is None and node.gce is None and node.azure is not None
        assert parsed.notices == ("azure",) and parsed.azure_metadata_url == node.azure.url
        assert backend.preempt(node.name, why="the test") == node.name
        [event] = node.azure.document["Events"]
        assert (event["EventType"], event["Resources"], event["EventStatus"]) == ("Preempt", [node.name], "Scheduled")
        assert parse_not_before(event["NotBefore"]) == node.deadline
        [signal] = backend.signals(JobKey.local("run"), RunConfig("t.py", [], "run").job_spec())
        assert f"Azure Scheduled Event Preempt {event['EventId']}" in signal.detail
        assert "Azure Preempt" in signal.describe()


def test_a_planned_host_maintenance_is_each_clouds_own_and_its_agent_is_told_to_hold_it(tmp_path: Path) -> None:
    """On azure a Redeploy event NotBefore the node's stop; on gcp TERMINATE_ON_HOST_MAINTENANCE, as
    before; on aws (whose IMDS announces no host maintenance) the nodes also serve GCE metadata for
    it, as before (pinned by test_agent_accepts_what_spotjob_writes)."""
    for cloud in ("gcp", "azure"):
        options = LocalOptions(
            root=str(tmp_path / cloud), cloud=cloud, maintenance_seconds=20.0, flush_lead=6.0
        )  # fmt: skip
        with LocalBackend(options) as backend:
            node, parsed = agent_options(backend, tmp_path)
            assert parsed.notices == (cloud,) and parsed.flush_lead == 6.0, parsed
            assert backend.maintain(node.name, why="the test") == node.name
            assert backend.signals(JobKey.local("run"), RunConfig("t.py", [], "run").job_spec()) == []  # held
            if cloud == "gcp":
                assert parsed.gcp_maintenance_seconds == 20.0
                assert node.azure is None and node.gce is not None
                assert node.gce._values["instance/maintenance-event"] == "TERMINATE_ON_HOST_MAINTENANCE"
            else:
                assert node.azure is not None and node.gce is None
                [event] = node.azure.document["Events"]
                assert event["EventType"] == "Redeploy" and parse_not_before(event["NotBefore"]) == node.deadline


def test_an_azure_node_stops_once_its_agent_acknowledges_the_event_and_the_timeline_says_so(tmp_path: Path) -> None:
    """Azure may act as soon as an event is acknowledged (StartRequests): the node stops then, not at NotBefore."""
    with LocalBackend(LocalOptions(root=str(tmp_path / "run"), notice_seconds=3600.0, cloud="azure")) as backend:
        node = backend._cloud.provision("zone-a", "type-a")
        assert backend.preempt(node.name, why="the test") == node.name
        assert node.azure is not None and node.event_id is not None
        ack = json.dumps({"StartRequests": [{"EventId": node.event_id}]}).encode()
        request = urllib.request.Request(
            f"{node.azure.url}{AzureScheduledEventsEmulator.EVENTS_PATH}?api-version=2020-07-01",
            data=ack,
            method="POST",
            headers={"Metadata": "true"},
        )
        with urllib.request.urlopen(request) as resp:
            assert resp.status == 200
        wait_for(lambda: node.terminated, "the acknowledged node to stop")
    timeline = Timeline.read(str(tmp_path / "run" / "timeline.jsonl"))
    [ended] = [e for e in timeline if e.kind == EventKind.NODE_TERMINATED]
    assert ended.data["stopped"] == "acknowledged", ended


def test_the_live_panel_names_the_cloud_and_its_notice_and_says_an_aws_notice_as_before() -> None:
    """The AWS line only pins what the panel already said; the GCP and Azure ones are new."""

    def panel(cloud: str, maintenance: bool = False) -> str:
        notice = NoticeView("local-node-0", 24.2, maintenance=maintenance, cloud=cloud)
        snapshot = Snapshot("r", 3.0, JobStatus(), 3, 5, None, 0, 1, notices=[notice], cloud=cloud)
        console = Console(width=200, record=True, file=io.StringIO())
        console.print(render_snapshot(snapshot))
        return console.export_text()

    aws = panel("aws")
    assert "local-node-0 goes away in 24 s" in aws and "cloud" not in aws and "Azure" not in aws, aws
    assert "GCE preempted: local-node-0 goes away in 24 s" in panel("gcp")
    assert cloud_text("gcp") in panel("gcp")
    azure = panel("azure", maintenance=True)
    assert "Azure Redeploy: local-node-0 host maintenance: stops in 24 s (or once its agent acknowledges it)" in azure


def test_the_run_folder_keeps_its_cloud_and_resume_refuses_another(tmp_path: Path) -> None:
    runs = str(tmp_path / "runs")
    LocalRun(RunConfig(script=str(TRAIN), args=[], name="kept", runs_dir=runs, cloud="azure")).close()
    resumed = LocalRun.resume(runs, "kept")
    try:
        assert resumed.config.cloud == "azure" and resumed.backend.options.cloud == "azure"
    finally:
        resumed.close()
    with pytest.raises(RunError, match=r"simulates azure .*--resume keeps it: drop --cloud gcp"):
        LocalRun.resume(runs, "kept", cloud="gcp")


def test_a_cloud_spotjob_does_not_simulate_is_refused_naming_the_ones_it_does(
    tmp_path: Path, spotjob: Callable[..., subprocess.CompletedProcess[str]]
) -> None:
    refused = spotjob("run", "--cloud", "ibm", str(TRAIN), cwd=tmp_path)
    assert refused.returncode == 2
    assert "--cloud: invalid choice: 'ibm' (choose from 'aws', 'gcp', 'azure')" in refused.stderr, refused.stderr
    assert not (tmp_path / "spotjob-runs").exists()


# -- a real spotjob run per cloud -------------------------------------------------------------------

STEPS = 40
PREEMPT_AT = 6


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize(("cloud", "notice"), [("gcp", "GCE preempted"), ("azure", "Azure Preempt")])
def test_a_run_on_a_simulated_cloud_hears_its_notice_flushes_and_resumes_to_the_end(
    tmp_path: Path,
    spotjob: Callable[..., subprocess.CompletedProcess[str]],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    cloud: str,
    notice: str,
) -> None:
    name = f"on-{cloud}"
    done = spotjob(
        "run", "--no-live", "--name", name, "--cloud", cloud, "--nproc", "1", "--every-steps", "10", "--keep", "10",
        "--preempt-at-step", str(PREEMPT_AT), str(TRAIN), "--steps", str(STEPS), "--step-sleep", "0.1",
        cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-6000:]
    assert f"{'cloud':<15}  {cloud_text(cloud)}" in done.stdout, done.stdout
    run = tmp_path / "spotjob-runs" / name
    agent_log = (run / "logs" / f"{name}-0-0.log").read_text()
    assert f"--notices {cloud} --{cloud}-metadata-url" in agent_log.splitlines()[0]

    # Attempt 1 went on from the flush at the notice, to the end.
    doc = json.loads((run / "local" / f"{name}.json").read_text())["status"]
    assert doc["phase"] == "Succeeded" and (doc["preemptions"], doc["restarts"]) == (1, 0), doc
    flushed = doc["attempt"]["resumedFromStep"]
    assert doc["attempt"]["number"] == 1 and flushed >= PREEMPT_AT, doc["attempt"]
    steps = sorted(c.ref.step for c in list_checkpoints(open_storage(str(run / "checkpoints"))) if c.committed)
    assert flushed in steps and steps[-1] == STEPS, steps

    timeline = Timeline.read(str(run / "timeline.jsonl"))
    [noticed] = [e for e in timeline if e.kind == EventKind.NOTICE]
    assert (noticed.data["cloud"], noticed.data["notice"], noticed.data["node"]) == (cloud, notice, "local-node-0")
    if cloud == "azure":
        # Its agent acknowledged the Preempt after the flush: the node stopped then, not at NotBefore.
        [ended] = [e for e in timeline if e.kind == EventKind.NODE_TERMINATED]
        assert ended.data["stopped"] == "acknowledged", ended

    monkeypatch.chdir(tmp_path)  # where spotjob run was started
    detail = spotjob_status(capsys, name)
    assert detail.returncode == 0, detail.stderr
    assert cloud_text(cloud) in detail.stdout, detail.stdout
    as_json = json.loads(spotjob_status(capsys, name, "--json").stdout)
    assert as_json["cloud"] == cloud
    assert json.loads((run / "summary.json").read_text())["cloud"] == cloud
    said = f"SpotInterruption for node local-node-0 (from local {notice})"
    assert any(said in e["message"] for e in as_json["events"]), as_json["events"]

    refused = spotjob("run", "--resume", name, "--cloud", "aws", cwd=tmp_path)
    assert refused.returncode == 2 and "drop --cloud aws" in refused.stderr, refused.stderr
