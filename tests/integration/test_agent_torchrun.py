"""spotjob-agent around REAL torchrun ranks (2 ranks, CPU, gloo) running examples/train.py.

For each notice source in turn (AWS IMDSv2, GCE, Azure emulators; SIGTERM; POST /flush) the job
must commit one checkpoint at the same step on both ranks, exit 75, and a restart must resume from
that step and end bit-identical to an uninterrupted run. Then the awkward cases: a notice during
an async save, two notices in a row, a window too short to hold a flush, and the control API
without a token and with a wrong one. Last, ``--launcher direct`` (the agent starts the ranks
without torchrun): the ranks' environment against real torchrun's, a flush and a bit-identical
restart, a failing rank, and options it leaves to torchrun.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch
from ckpt_compare import assert_same

from agent.catalog import list_checkpoints
from agent.control_channel import EXIT_INFRA_ERROR, EXIT_PREEMPTED, ControlDir, FlushResult
from agent.manifest import MANIFEST_NAME, Manifest
from agent.notices.emulators import AzureScheduledEventsEmulator, GceMetadataEmulator, ImdsEmulator
from agent.ranks import free_port
from agent.storage import open_storage

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
TRAIN = REPO / "examples" / "train.py"
BIN = Path(sys.executable).parent
STEPS = 120
TOKEN = "torchrun-e2e-token"


def wait_until(
    pred: Callable[[], bool], what: str, proc: subprocess.Popen[bytes] | None = None, timeout: float = 120.0
) -> None:
    give_up = time.monotonic() + timeout
    while not pred():
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"process exited {proc.returncode} while waiting for {what}")
        if time.monotonic() > give_up:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


@dataclass
class AgentRun:
    proc: subprocess.Popen[bytes]
    control: ControlDir
    log_path: Path
    extra: dict[str, Any] = field(default_factory=dict)

    def step(self) -> int:
        status = self.control.status()
        return status.step or 0 if status else 0

    def url(self) -> str:
        info = json.loads((Path(self.control.path) / "agent.json").read_text())
        return str(info["url"])

    def wait(self, timeout: float = 180.0) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        finally:
            if self.proc.poll() is None:
                # Everything it started first: torchrun's ranks sit in sessions of their own, and an
                # agent killed alone would leave them training into the next tests.
                try:
                    tree = psutil.Process(self.proc.pid).children(recursive=True)
                except psutil.Error:
                    tree = []
                for child in tree:
                    with contextlib.suppress(psutil.Error):
                        child.kill()
                self.proc.kill()
                self.proc.wait(timeout=30)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-6000:]


def start_agent(
    tmp: Path,
    name: str,
    uri: str,
    agent_args: list[str],
    train_args: list[str],
    token: str | None = TOKEN,
    torchrun_args: tuple[str, ...] = (),
    script: Path = TRAIN,
    extra_env: dict[str, str] | None = None,
) -> AgentRun:
    control = tmp / f"control-{name}"
    log_path = tmp / f"{name}.log"
    env = dict(os.environ, OMP_NUM_THREADS="1", SPOTJOB_AGENT_POLL_INTERVAL="0.2", PYTHONUNBUFFERED="1")
    env.update(extra_env or {})
    env.pop("SPOTJOB_AGENT_TOKEN", None)
    args = [
        str(BIN / "spotjob-agent"),
        "--checkpoint-uri",
        uri,
        "--job-name",
        "e2e",
        "--control-dir",
        str(control),
        "--control-port",
        "0",
        "--kill-grace",
        "2",
    ]
    if token is not None:
        token_file = tmp / f"token-{name}"
        token_file.write_text(token)
        args += ["--token-file", str(token_file)]
    args += [
        *agent_args,
        "--",
        str(BIN / "torchrun"),
        # torchrun's defaults here, unless the test gives its own (torchrun takes the last of two)
        *(() if "--nproc-per-node" in torchrun_args else ("--nproc-per-node", "2")),
        *(() if "--master-port" in torchrun_args else ("--master-port", str(free_port()))),
        *torchrun_args,
        str(script),
        "--steps",
        str(STEPS),
        *train_args,
    ]
    with open(log_path, "wb") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=str(tmp))
    return AgentRun(proc, ControlDir(str(control)), log_path)


def load_dump(prefix: Path, rank: int) -> dict[str, Any]:
    return torch.load(f"{prefix}.rank{rank}.pt", weights_only=False)  # our own test output


def assert_bit_identical(a_prefix: Path, b_prefix: Path) -> None:
    """Model, optimizer, schedule, loader position and every RNG stream equal on both ranks."""
    for rank in (0, 1):
        assert_same(load_dump(a_prefix, rank), load_dump(b_prefix, rank), f"rank {rank}'s final state")


def committed_steps_per_rank(uri: str, step: int) -> set[int]:
    """The step recorded in every rank's file of the checkpoint committed for ``step``."""
    storage = open_storage(uri)
    status = next(s for s in list_checkpoints(storage) if s.ref.step == step)
    assert status.valid, status.reason
    manifest = Manifest.parse(storage.get_bytes(status.ref.key(MANIFEST_NAME)))
    assert manifest.world_size == 2
    assert manifest.trigger == "flush", "the flush checkpoint must say so, for the controller"
    steps = set()
    for rank in (0, 1):
        data = storage.get_bytes(status.ref.key(f"rank-{rank:05d}.pt"))
        steps.add(torch.load(io.BytesIO(data), weights_only=True)["step"])
    return steps


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An uninterrupted run of examples/train.py under the agent, dumped for comparison."""
    tmp = tmp_path_factory.mktemp("reference")
    run = start_agent(tmp, "ref", str(tmp / "ckpt"), ["--cloud", "none"], ["--dump", str(tmp / "ref")])
    assert run.wait() == 0, run.log()
    return tmp / "ref"


@pytest.fixture
def imds() -> Iterator[ImdsEmulator]:
    with ImdsEmulator() as e:
        yield e


@pytest.fixture
def gce(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Iterator[GceMetadataEmulator]:
    # The agents' maintenance records (TMPDIR) go to a folder of this test's own, not the machine's.
    monkeypatch.setenv("TMPDIR", str(tmp_path_factory.mktemp("tempdir")))
    with GceMetadataEmulator() as e:
        yield e


@pytest.fixture
def azure() -> Iterator[AzureScheduledEventsEmulator]:
    with AzureScheduledEventsEmulator() as e:
        yield e


def post_flush(run: AgentRun, token: str | None, reason: str = "test") -> int:
    req = urllib.request.Request(
        run.url() + "/flush",
        data=json.dumps({"reason": reason}).encode(),
        method="POST",
        headers={"Content-Type": "application/json"},
    )
    if token is not None:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as e:
        return int(e.code)


SOURCES = ["aws", "gcp", "azure", "sigterm", "api"]


@pytest.mark.parametrize("source", SOURCES)
def test_a_notice_from_each_source_commits_one_step_on_both_ranks_and_a_restart_from_it_is_bit_identical(
    source: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """Each source's notice is heard and flushed at one step on both ranks. The restart from that
    flush is run once, after the SIGTERM's: it hears no notice source (``--cloud none``), and the
    commit it reads is the same whatever asked for the flush, so four more restarts (a torchrun
    and its ranks each) would check nothing new."""
    uri = str(tmp_path / "ckpt")
    agent_args = {
        "aws": lambda: ["--notices", "aws", "--aws-metadata-url", request.getfixturevalue("imds").url],
        "gcp": lambda: ["--notices", "gcp", "--gcp-metadata-url", request.getfixturevalue("gce").url],
        "azure": lambda: ["--notices", "azure", "--azure-metadata-url", request.getfixturevalue("azure").url],
        "sigterm": lambda: ["--notices", "sigterm"],
        "api": lambda: ["--cloud", "none"],
    }[source]()
    run = start_agent(tmp_path, "preempted", uri, agent_args, ["--step-sleep", "0.05", "--every-steps", "25"])
    wait_until(lambda: run.step() >= 30, "training to pass step 30", run.proc)
    if source == "aws":
        request.getfixturevalue("imds").set_spot_action("terminate", time.time() + 60)
    elif source == "gcp":
        request.getfixturevalue("gce").set_preempted(True)
    elif source == "azure":
        az = request.getfixturevalue("azure")
        event_id = az.add_event(EventType="Preempt", NotBefore=time.time() + 60)
    elif source == "sigterm":
        run.proc.send_signal(signal.SIGTERM)
    else:
        # The control API refuses a flush without the token or with a wrong one, and the job trains
        # on (once its own test, which started a job of its own for it); then the token's flush.
        assert post_flush(run, None) == 401
        assert post_flush(run, "not-the-token") == 401
        assert run.control.flush_request() is None
        assert run.proc.poll() is None, "the job must keep training"
        assert post_flush(run, TOKEN, "operator") in (200, 202)
    rc = run.wait()
    assert rc == EXIT_PREEMPTED, run.log()
    result = run.control.flush_result()
    assert result is not None and result.error is None and result.step is not None
    flushed = result.step
    assert flushed > 30 and flushed < STEPS
    assert committed_steps_per_rank(uri, flushed) == {flushed}
    if source == "azure":
        assert event_id in request.getfixturevalue("azure").start_requests

    if source != "sigterm":
        return
    resumed = start_agent(tmp_path, "resumed", uri, ["--cloud", "none"], ["--dump", str(tmp_path / "resumed")])
    assert resumed.wait() == 0, resumed.log()
    assert f"starting at step {flushed} of {STEPS}" in resumed.log()
    assert_bit_identical(request.getfixturevalue("reference"), tmp_path / "resumed")


def held_status(run: AgentRun) -> dict[str, Any]:
    req = urllib.request.Request(run.url() + "/status", headers={"Authorization": f"Bearer {TOKEN}"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        status: dict[str, Any] = json.loads(resp.read())
    return status


def stop_job(run: AgentRun) -> None:
    """End a job of 100000 steps that a failed wait left training (``POST /stop``: the agent stops
    its ranks without a flush), rather than leave it loading the machine for the tests after it
    (``AgentRun.wait`` SIGKILLs the agent alone, which leaves its torchrun and ranks running)."""
    post_stop(run)
    with contextlib.suppress(subprocess.TimeoutExpired):
        run.wait(timeout=60)


@dataclass
class HeldMaintenance:
    """The first job of the hour-of-maintenance tests, SIGTERMed while it held the notice."""

    gce: GceMetadataEmulator
    tmp: Path
    uri: str
    env: dict[str, str]  # the VM's: the agents' maintenance records go to its TMPDIR
    held_at: int
    status: dict[str, Any]  # /status once training went on 5 steps past the held notice
    rc: int
    log: str
    result: FlushResult | None


MAINTENANCE_ARGS = ["--notices", "gcp,sigterm", "--gcp-maintenance-seconds", "3600"]
MAINTENANCE_TRAIN = ["--steps", "100000", "--step-sleep", "0.05", "--every-steps", "25"]


@pytest.fixture(scope="module")
def held_maintenance(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HeldMaintenance]:
    """GCE gives a GPU VM an hour's notice of a host maintenance that stops it: the agent holds it
    (``--gcp-maintenance-seconds 3600``), training goes on, then a SIGTERM stops the job. The two
    tests after it read this one job, which each ran for itself before (a torchrun and its ranks
    each): what it showed while it held the notice and its flush; and the job started again on
    the same VM during that hour. The emulator stays up for that restart."""
    tmp = tmp_path_factory.mktemp("maintenance")
    # The agents' maintenance records (TMPDIR) go to a folder of this VM's own, not the machine's.
    env = {"TMPDIR": str(tmp_path_factory.mktemp("tempdir"))}
    uri = str(tmp / "ckpt")
    with GceMetadataEmulator() as gce:
        agent_args = [*MAINTENANCE_ARGS, "--gcp-metadata-url", gce.url]
        run = start_agent(tmp, "first", uri, agent_args, MAINTENANCE_TRAIN, extra_env=env)
        try:
            wait_until(lambda: run.step() >= 10, "training to pass step 10", run.proc)
            gce.set_maintenance_event("TERMINATE_ON_HOST_MAINTENANCE")
            wait_until(lambda: "Training goes on" in run.log(), "the notice to be held", run.proc)
            held_at = run.step()
            wait_until(lambda: run.step() >= held_at + 5, "training to go on while the notice is held", run.proc)
            status = held_status(run)
            run.proc.send_signal(signal.SIGTERM)
            rc = run.proc.wait(timeout=180)
        except BaseException:
            stop_job(run)
            raise
        yield HeldMaintenance(gce, tmp, uri, env, held_at, status, rc, run.log(), run.control.flush_result())


def test_a_gpu_vms_hour_of_maintenance_notice_is_held_while_training_goes_on_and_a_sigterm_still_flushes(
    held_maintenance: HeldMaintenance,
) -> None:
    """GCE gives a GPU VM an hour's notice of a host maintenance that stops it. Before, the agent
    flushed at once and the job stood still for the rest of the hour. Now the notice is held
    (``--flush-lead``): the ranks keep training, ``/status`` shows it, and a SIGTERM (the VM's
    shutdown coming sooner) flushes at once. That the flush starts by itself ``--flush-lead``
    before the deadline is tested in tests/unit/test_launcher.py (``TestHeldNotices``)."""
    first = held_maintenance
    status = first.status
    assert status["flush"] is None and status["held_notice"]["source"] == "gcp", status
    assert status["flush_at"] == pytest.approx(status["held_notice"]["deadline"] - 300), status
    assert first.rc == EXIT_PREEMPTED, first.log
    result = first.result
    assert result is not None and result.error is None and result.step is not None and result.step > first.held_at
    assert committed_steps_per_rank(first.uri, result.step) == {result.step}


def test_a_job_restarted_on_the_vm_during_its_hour_of_maintenance_notice_holds_it_to_the_same_deadline(
    held_maintenance: HeldMaintenance,
) -> None:
    """The first agent hears GCE's hour of notice as it comes and holds it; the job is stopped
    (a SIGTERM: it flushes and exits) and started again on the same VM during that hour. The new
    agent finds the value already set: it takes the time the first one recorded on the machine and
    holds the notice to the same deadline, training on. Before, it assumed 60 s and flushed at
    once, on every restart until the maintenance."""
    first = held_maintenance
    deadline = first.status["held_notice"]["deadline"]
    assert first.rc == EXIT_PREEMPTED, first.log

    agent_args = [*MAINTENANCE_ARGS, "--gcp-metadata-url", first.gce.url]
    again = start_agent(first.tmp, "again", first.uri, agent_args, MAINTENANCE_TRAIN, extra_env=first.env)
    try:
        wait_until(lambda: "Training goes on" in again.log(), "the restart to hold the notice", again.proc)
        resumed_at = again.step()
        wait_until(lambda: again.step() >= resumed_at + 5, "training to go on after the restart", again.proc)
        status = held_status(again)
    except BaseException:
        stop_job(again)
        raise
    assert status["flush"] is None and status["held_notice"]["deadline"] == deadline, status
    assert "first seen at" in status["held_notice"]["detail"], status
    again.proc.send_signal(signal.SIGTERM)
    assert again.wait() == EXIT_PREEMPTED, again.log()


@dataclass
class HeldReboots:
    """What one job saw of two Azure Reboots it held in turn (``held_reboots``)."""

    uri: str
    dropped: AssertionError | None  # why the first Reboot was not seen dropped, if it was not
    status_after_drop: dict[str, Any] | None
    held_at: int  # the step when the second Reboot was held
    rc: int
    log: str
    result: FlushResult | None


def held_count(run: AgentRun) -> int:
    """How many notices the agent has held so far (its whole log: ``AgentRun.log`` keeps the end)."""
    return run.log_path.read_text(errors="replace").count("Training goes on")


@pytest.fixture(scope="module")
def held_reboots(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HeldReboots]:
    """One job for the two tests after it, which each ran a job of their own before (a torchrun
    and its ranks each). An Azure Reboot 15 minutes ahead is held, then leaves the list: the
    agent drops it and trains on. A second Reboot 15 minutes ahead is held, then started by
    someone else: the job flushes at once. A first Reboot never dropped is kept for its own test to
    raise: the second Reboot is still added and started, for the other test."""
    tmp = tmp_path_factory.mktemp("reboots")
    uri = str(tmp / "ckpt")
    with AzureScheduledEventsEmulator() as azure:
        agent_args = ["--notices", "azure", "--azure-metadata-url", azure.url]
        train_args = ["--steps", "100000", "--step-sleep", "0.05", "--every-steps", "25"]
        run = start_agent(tmp, "reboots", uri, agent_args, train_args)
        try:
            wait_until(lambda: run.step() >= 10, "training to pass step 10", run.proc)
            azure.add_event(EventType="Reboot", NotBefore=time.time() + 900)
            wait_until(lambda: "Training goes on" in run.log(), "the notice to be held", run.proc)
            dropped: AssertionError | None = None
            status_after_drop = None
            azure.clear()
            try:
                wait_until(
                    lambda: "is dropped, training goes on" in run.log(), "the held notice to be dropped", run.proc
                )
                status_after_drop = held_status(run)
            except AssertionError as e:
                dropped = e
            held_before = held_count(run)
            event_id = azure.add_event(EventType="Reboot", NotBefore=time.time() + 900)
            wait_until(lambda: held_count(run) > held_before, "the second notice to be held", run.proc)
            held_at = run.step()
            # Started by someone else (another container's agent on the VM, a user, the platform).
            body = json.dumps({"StartRequests": [{"EventId": event_id}]}).encode()
            req = urllib.request.Request(
                azure.url + "/metadata/scheduledevents?api-version=2020-07-01",
                data=body,
                method="POST",
                headers={"Metadata": "true", "Content-Type": "application/json"},
            )
            with urllib.request.urlopen(req, timeout=10):
                pass
            rc = run.proc.wait(timeout=180)
        except BaseException:
            stop_job(run)
            raise
        yield HeldReboots(uri, dropped, status_after_drop, held_at, rc, run.log(), run.control.flush_result())


def test_a_held_azure_reboot_that_leaves_the_list_is_dropped_and_training_goes_on(held_reboots: HeldReboots) -> None:
    """Azure cancels a held Reboot: the event leaves the list. Before, the agent went on holding
    it and stopped the job at its time for nothing; now it drops it, as a GCE maintenance-event
    back to NONE, and training goes on (until the next test's Reboot, in the same job)."""
    if held_reboots.dropped is not None:
        raise held_reboots.dropped
    status = held_reboots.status_after_drop
    assert status is not None
    assert status["held_notice"] is None and status["flush_at"] is None and status["flush"] is None, status


def test_a_held_azure_reboot_that_the_platform_starts_early_flushes_at_once(held_reboots: HeldReboots) -> None:
    """An Azure Reboot 15 minutes ahead is held. Then the event is started (``StartRequests`` from
    someone else: an agent in another container on the VM, a user, the platform): it turns
    ``Started`` with an empty ``NotBefore``, and the VM reboots in seconds. Before, the source
    heard each event once: the agent kept holding it until its old flush time, and the reboot
    came first, losing everything since the last checkpoint."""
    assert held_reboots.rc == EXIT_PREEMPTED, held_reboots.log
    result = held_reboots.result
    assert result is not None and result.error is None and result.step is not None
    assert result.step > held_reboots.held_at
    assert committed_steps_per_rank(held_reboots.uri, result.step) == {result.step}


def test_a_sigterm_after_the_committed_flush_ends_torchrun_at_once_and_stops_the_ranks(tmp_path: Path) -> None:
    """Local mode's controller stops the old gang as soon as the flush committed, and its agents
    take SIGTERM as a stop (signals are not notices there), so the SIGTERM often lands while the
    ranks are still leaving (here: a script that lingers after training, as one uploading its logs
    would). torchrun's own SIGTERM handling (stop the ranks, wait, report,
    close its rendezvous) holds nothing of the job's by then: the agent SIGKILLs it first, and the
    ranks get the SIGTERM and the grace."""
    uri = str(tmp_path / "ckpt")
    lingering = tmp_path / "lingering_train.py"
    lingering.write_text(
        "import runpy, sys, time\n"
        f"sys.argv[0] = {str(TRAIN)!r}\n"
        "try:\n"
        f"    runpy.run_path({str(TRAIN)!r}, run_name='__main__')\n"
        "finally:\n"
        "    print('lingering after training', flush=True)\n"
        "    time.sleep(120)\n"
    )
    run = start_agent(
        tmp_path,
        "lingering",
        uri,
        ["--cloud", "none", "--no-sigterm"],
        ["--step-sleep", "0.05", "--every-steps", "25"],
        script=lingering,
    )
    wait_until(lambda: run.step() >= 10, "training to pass step 10", run.proc)
    assert post_flush(run, TOKEN) in (200, 202)
    wait_until(lambda: "lingering after training" in run.log(), "the ranks to stop training", run.proc)
    wait_until(
        lambda: any("agent.launcher: flush" in line and "committed step" in line for line in run.log().splitlines()),
        "the agent to see the commit",
        run.proc,
    )
    run.proc.send_signal(signal.SIGTERM)
    rc = run.wait(timeout=60)  # the ranks linger for 120 s unless stopped
    log = run.log()
    assert rc == EXIT_PREEMPTED, log
    assert "the flush committed: ending torchrun" in log, log
    assert "Received 15 death signal" not in log, log  # torchrun never ran its SIGTERM handling
    result = run.control.flush_result()
    assert result is not None and result.error is None and result.step is not None
    assert committed_steps_per_rank(uri, result.step) == {result.step}


def test_a_notice_during_an_async_save_commits_the_flush_after_the_save_in_flight(
    tmp_path: Path, reference: Path
) -> None:
    uri = str(tmp_path / "ckpt")
    # A save every step keeps one in flight at almost every step boundary.
    run = start_agent(tmp_path, "busy", uri, ["--cloud", "none"], ["--every-steps", "1", "--step-sleep", "0.02"])
    wait_until(lambda: (run.control.status() or _none()).last_committed_step is not None, "a first commit", run.proc)
    assert post_flush(run, TOKEN) in (200, 202)
    assert run.wait() == EXIT_PREEMPTED, run.log()
    result = run.control.flush_result()
    assert result is not None and result.step is not None
    storage = open_storage(uri)
    statuses = {s.ref.step: s for s in list_checkpoints(storage)}
    assert statuses[result.step].valid
    resumed = start_agent(tmp_path, "resumed", uri, ["--cloud", "none"], ["--dump", str(tmp_path / "resumed")])
    assert resumed.wait() == 0, resumed.log()
    assert_bit_identical(reference, tmp_path / "resumed")


def _none() -> Any:
    class _S:
        last_committed_step = None

    return _S()


def test_two_notices_in_a_row_start_one_flush(tmp_path: Path, imds: ImdsEmulator) -> None:
    uri = str(tmp_path / "ckpt")
    run = start_agent(
        tmp_path, "twice", uri, ["--notices", "aws,sigterm", "--aws-metadata-url", imds.url], ["--step-sleep", "0.05"]
    )
    wait_until(lambda: run.step() >= 10, "training to pass step 10", run.proc)
    imds.set_spot_action("terminate", time.time() + 60)
    run.proc.send_signal(signal.SIGTERM)
    assert post_flush(run, TOKEN, "again") in (200, 202, 409)
    assert run.wait() == EXIT_PREEMPTED, run.log()
    steps = [s.ref.step for s in list_checkpoints(open_storage(uri)) if s.valid]
    assert len(steps) == 1, f"expected exactly one flush checkpoint, found {steps}"


@dataclass
class LateFlush:
    """A job flushed through the control API with a deadline already past (``late_flush``)."""

    uri: str
    status: dict[str, Any]  # /status right after the flush was asked for
    rc: int
    in_time: bool  # whether the agent exited within 120 s, long before torchrun's monitor tick (600 s)
    log: str
    result: FlushResult | None


@pytest.fixture(scope="module")
def late_flush(tmp_path_factory: pytest.TempPathFactory) -> LateFlush:
    """One job for the two tests after it, which each ran a job of their own before (a torchrun
    and its ranks each): a flush asked for through the control API once a first checkpoint
    committed, with a deadline already past, under a torchrun that notices its ranks' exit only at
    its next monitor tick (600 s: an agent that waited for it cannot pass for one that did not, on
    however slow a machine)."""
    tmp = tmp_path_factory.mktemp("late")
    uri = str(tmp / "ckpt")
    run = start_agent(
        tmp,
        "late",
        uri,
        ["--cloud", "none"],
        ["--step-sleep", "0.05", "--every-steps", "10"],
        torchrun_args=("--monitor-interval", "600"),
    )
    try:
        wait_until(
            lambda: (run.control.status() or _none()).last_committed_step is not None, "a first commit", run.proc
        )
        # A deadline already in the past: no flush can fit.
        req = urllib.request.Request(
            run.url() + "/flush",
            method="POST",
            data=json.dumps({"reason": "late notice", "deadline": time.time() - 1}).encode(),
            headers={"Content-Type": "application/json", "Authorization": f"Bearer {TOKEN}"},
        )
        with urllib.request.urlopen(req, timeout=10) as resp:
            assert resp.status in (200, 202)
        status = held_status(run)
    finally:
        try:
            rc = run.proc.wait(timeout=120)  # torchrun alone would take 600 s to notice its ranks' exit
            in_time = True
        except subprocess.TimeoutExpired:
            in_time = False  # the second test's failure, and the first's: no exit code to read
            try:
                rc = run.wait(timeout=1)  # kills the agent and what it started
            except subprocess.TimeoutExpired:
                rc = -9
    return LateFlush(uri, status, rc, in_time, run.log(), run.control.flush_result())


def test_a_deadline_already_past_is_reported_and_still_flushed_not_killed(late_flush: LateFlush) -> None:
    status = late_flush.status
    assert status["window_ok"] is False and status["window_message"], status
    # A deadline in the past means "flush now": the ranks get their chance, nobody kills them first.
    assert late_flush.rc == EXIT_PREEMPTED, late_flush.log
    result = late_flush.result
    assert result is not None and result.error is None and result.step is not None
    for s in list_checkpoints(open_storage(late_flush.uri)):
        assert s.valid or not s.committed, s.reason


def test_once_the_flush_committed_and_the_ranks_exited_the_agent_ends_torchrun_without_its_teardown(
    late_flush: LateFlush,
) -> None:
    """torchrun notices its ranks' exit only at its next monitor tick (600 s here), then reports the
    failed workers and closes its rendezvous: the agent does not wait for any of it once the flush
    committed and no rank is left, so torchrun never gets to print its failure report. (The flush
    is the one of the test above, whose deadline is past: what the agent does once it committed
    does not depend on it.) Without the early end the agent still ends torchrun, 30 s after the
    commit (``--exit-timeout``, its wait for the ranks to exit): the log line tells the two apart, and ``in_time``
    says that neither waits for torchrun's tick."""
    log = late_flush.log
    assert late_flush.in_time, f"the agent waited for torchrun's monitor tick\n{log}"
    assert late_flush.rc == EXIT_PREEMPTED, log
    result = late_flush.result
    assert result is not None and result.error is None and result.step is not None
    assert committed_steps_per_rank(late_flush.uri, result.step) == {result.step}
    assert "the ranks exited after the committed flush: ending torchrun" in log, log
    assert "ChildFailedError" not in log, log
    assert "exiting 75: the flush committed step" in log, log


def test_a_taken_rendezvous_port_exits_74_before_torchrun_starts(tmp_path: Path) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        log_path = tmp_path / "agent.log"
        with open(log_path, "wb") as out:
            rc = subprocess.run(
                [
                    str(BIN / "spotjob-agent"),
                    "--checkpoint-uri",
                    str(tmp_path / "ckpt"),
                    "--cloud",
                    "none",
                    "--control-dir",
                    str(tmp_path / "control"),
                    "--",
                    str(BIN / "torchrun"),
                    "--nproc-per-node",
                    "2",
                    "--master-port",
                    str(port),
                    str(TRAIN),
                    "--steps",
                    "5",
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
                timeout=120,
            ).returncode
    log = log_path.read_text()
    assert rc == EXIT_INFRA_ERROR, log
    assert f"rendezvous port {port}" in log and ControlDir(str(tmp_path / "control")).status() is None


@pytest.mark.parametrize("launcher", ["torchrun", "direct"])
def test_a_one_node_torchrun_without_a_master_port_runs_beside_a_job_holding_29500(
    tmp_path: Path, launcher: str
) -> None:
    """Two jobs on one machine, neither given a port: torchrun 2.12 and later give a one-node static
    rendezvous without ``--master-port`` a free port of their own, so the second job runs. Before,
    the agent checked 29500 anyway and exited 74 ("port taken"), and ``--launcher direct`` bound
    29500 itself (the same 74); torchrun 2.9.1 bound 29500 (``EADDRINUSE``) until the agent added
    ``--standalone`` for it. The job holding 29500 is a plain listener here."""
    with socket.socket() as holder:
        try:
            holder.bind(("0.0.0.0", 29500))
            holder.listen()
        except OSError:
            pass  # held already, by another process of this machine: just as good
        log_path = tmp_path / "agent.log"
        env = dict(os.environ, OMP_NUM_THREADS="1")
        with open(log_path, "wb") as out:
            rc = subprocess.run(
                [
                    str(BIN / "spotjob-agent"), "--checkpoint-uri", str(tmp_path / "ckpt"), "--cloud", "none",
                    "--launcher", launcher, "--control-dir", str(tmp_path / "control"), "--",
                    str(BIN / "torchrun"), "--nproc-per-node", "2", str(RANK_ENV), str(tmp_path / "ranks"),
                ],
                stdout=out, stderr=subprocess.STDOUT, env=env, timeout=180,
            ).returncode  # fmt: skip
    assert rc == 0, log_path.read_text()[-4000:]
    ranks = read_ranks(tmp_path / "ranks")
    assert [r["sum"] for r in ranks] == [2.0, 2.0], "the ranks met"
    assert {r["MASTER_PORT"] for r in ranks} != {"29500"}
    if launcher == "torchrun":
        assert "adding --standalone" in log_path.read_text(), "as torchrun 2.12 does, for any torch"


# -- --launcher direct: the agent starts the ranks itself, without torchrun ------------------------

RANK_ENV = REPO / "tests" / "integration" / "scripts" / "rank_env.py"
DIRECT = ["--cloud", "none", "--launcher", "direct"]


def read_ranks(prefix: Path) -> list[dict[str, Any]]:
    return [json.loads(Path(f"{prefix}.{rank}.json").read_text()) for rank in (0, 1)]


def test_direct_launch_gives_each_rank_what_torchrun_gives_it_and_they_meet(tmp_path: Path) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    torchrun = [str(BIN / "torchrun"), "--nproc-per-node", "2", "--master-port", str(free_port())]
    plain = subprocess.run([*torchrun, str(RANK_ENV), str(tmp_path / "torchrun")], env=env, capture_output=True)
    assert plain.returncode == 0, plain.stderr.decode()[-3000:]
    run = start_agent(tmp_path, "direct", str(tmp_path / "ckpt"), DIRECT, [str(tmp_path / "direct")], script=RANK_ENV)
    assert run.wait() == 0, run.log()
    assert "started the 2 rank(s) of" in run.log() and "directly, without torchrun's own start" in run.log()
    # Only what differs by design: the port, who hosts the store, torchrun's error file for @record.
    differ = {"MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_ERROR_FILE", "argv", "pid"}
    for by_torchrun, direct in zip(read_ranks(tmp_path / "torchrun"), read_ranks(tmp_path / "direct"), strict=True):
        assert direct["sum"] == 2.0, "the ranks met and all-reduced"
        assert {k: v for k, v in direct.items() if k not in differ} == {
            k: v for k, v in by_torchrun.items() if k not in differ
        }
        assert (by_torchrun["TORCHELASTIC_USE_AGENT_STORE"], direct["TORCHELASTIC_USE_AGENT_STORE"]) == (
            "True",
            "False",
        )
        assert direct["TORCHELASTIC_ERROR_FILE"] is None
    # The ranks run on the interpreter torchrun's own first line names, as torchrun runs them.
    assert {seen["executable"] for seen in read_ranks(tmp_path / "direct")} == {
        seen["executable"] for seen in read_ranks(tmp_path / "torchrun")
    }


def test_direct_launch_on_two_nodes_numbers_the_ranks_across_them_and_they_meet(tmp_path: Path) -> None:
    """Two agents, one rank each, torchrun's static rendezvous on two nodes: rank 0 hosts the store."""
    port = str(free_port())

    def node(index: int) -> AgentRun:
        two_nodes = ("--nproc-per-node", "1", "--nnodes", "2", "--node-rank", str(index))
        return start_agent(
            tmp_path, f"node{index}", str(tmp_path / "ckpt"), DIRECT, [str(tmp_path / "two")], script=RANK_ENV,
            torchrun_args=(*two_nodes, "--master-addr", "127.0.0.1", "--master-port", port),
        )  # fmt: skip

    runs = [node(1), node(0)]  # the second node first: its rank waits for the store rank 0 hosts
    assert [run.wait() for run in runs] == [0, 0], [run.log() for run in runs]
    seen = read_ranks(tmp_path / "two")
    assert [(s["RANK"], s["LOCAL_RANK"], s["GROUP_RANK"], s["WORLD_SIZE"], s["GROUP_WORLD_SIZE"]) for s in seen] == [
        ("0", "0", "0", "2", "2"),
        ("1", "0", "1", "2", "2"),
    ]
    assert [s["sum"] for s in seen] == [2.0, 2.0]
    assert all("started the 1 rank(s) of" in run.log() for run in runs)


def test_direct_launch_a_notice_commits_on_both_ranks_and_the_restart_is_bit_identical(
    tmp_path: Path, reference: Path
) -> None:
    uri = str(tmp_path / "ckpt")
    args = ["--notices", "sigterm", "--launcher", "direct"]
    run = start_agent(tmp_path, "preempted", uri, args, ["--step-sleep", "0.05", "--every-steps", "25"])
    wait_until(lambda: run.step() >= 30, "training to pass step 30", run.proc)
    run.proc.send_signal(signal.SIGTERM)
    assert run.wait() == EXIT_PREEMPTED, run.log()
    result = run.control.flush_result()
    assert result is not None and result.error is None and result.step is not None
    assert 30 < result.step < STEPS
    assert committed_steps_per_rank(uri, result.step) == {result.step}
    resumed = start_agent(tmp_path, "resumed", uri, DIRECT, ["--dump", str(tmp_path / "resumed")])
    assert resumed.wait() == 0, resumed.log()
    assert f"starting at step {result.step} of {STEPS}" in resumed.log()
    assert_bit_identical(reference, tmp_path / "resumed")


def test_direct_launch_a_failing_rank_stops_the_other_and_the_agent_exits_with_its_code(tmp_path: Path) -> None:
    prefix = tmp_path / "failing"
    run = start_agent(
        tmp_path, "failing", str(tmp_path / "ckpt"), DIRECT, [str(prefix), "--fail-rank", "1"], script=RANK_ENV
    )
    assert run.wait() == 3, run.log()
    log = run.log()
    assert "rank 1 (pid" in log and "exited 3: stopping the other 1 rank(s)" in log
    survivor = read_ranks(prefix)[0]["pid"]
    assert not Path(f"/proc/{survivor}").exists(), "rank 0 was left running"


def test_direct_launch_leaves_a_command_with_torchruns_own_options_to_torchrun(tmp_path: Path) -> None:
    # One rank: whether torchrun ran shows in any rank's environment (a second rank importing torch
    # showed nothing more).
    logs = tmp_path / "torchrun-logs"
    run = start_agent(
        tmp_path, "own", str(tmp_path / "ckpt"), DIRECT, [str(tmp_path / "own")],
        torchrun_args=("--nproc-per-node", "1", "--log-dir", str(logs)), script=RANK_ENV,
    )  # fmt: skip
    assert run.wait() == 0, run.log()
    assert "running the command as written, because --log-dir is torchrun's own" in run.log()
    rank0 = json.loads((tmp_path / "own.0.json").read_text())
    assert rank0["TORCHELASTIC_USE_AGENT_STORE"] == "True"  # torchrun's store: torchrun ran
    assert any(logs.iterdir()), "torchrun wrote its log folder"


def test_a_notice_on_one_node_of_two_ends_both_torchruns_once_the_flush_committed(tmp_path: Path) -> None:
    """Two nodes (two agents, torchrun's static rendezvous), a notice reaching node 1 only: every rank
    commits the flush at one step, and node 0's agent, which heard nothing, still ends its torchrun
    once its ranks exited. Before, it waited on torchrun, stuck in its exit barrier (300 s) for
    node 1's torchrun, which node 1's agent had ended right after the commit."""
    port = str(free_port())
    uri = str(tmp_path / "ckpt")

    def node(index: int) -> AgentRun:
        # One rank a node: what is tested is between the nodes (a second rank on each imported torch,
        # about 2.5 CPU-s, for nothing this test reads).
        two_nodes = (
            "--nproc-per-node", "1", "--nnodes", "2", "--node-rank", str(index),
            "--master-addr", "127.0.0.1", "--master-port", port,
        )  # fmt: skip
        return start_agent(
            tmp_path, f"node{index}", uri, ["--notices", "sigterm"], ["--step-sleep", "0.05", "--every-steps", "25"],
            torchrun_args=two_nodes,
        )  # fmt: skip

    node1, node0 = node(1), node(0)
    wait_until(lambda: node0.step() >= 30, "training to pass step 30", node0.proc)
    node1.proc.send_signal(signal.SIGTERM)  # the notice reaches node 1 only
    assert node1.wait() == EXIT_PREEMPTED, node1.log()
    assert node0.wait(timeout=120) == EXIT_PREEMPTED, node0.log()
    results = [run.control.flush_result() for run in (node0, node1)]
    assert all(r is not None and r.error is None for r in results)
    assert results[0] is not None and results[1] is not None and results[0].step == results[1].step
    assert "for a flush another node's agent asked for (no notice here)" in node0.log()
    assert "the ranks exited after the committed flush: ending torchrun" in node0.log()


def test_the_readmes_slurm_recipe_each_node_expands_its_own_rank_and_sigusr1_to_every_task_flushes_one_step(
    tmp_path: Path,
) -> None:
    """Pins behaviour that already worked (README, "On bare machines and batch schedulers"): what
    ``srun bash -c 'exec spotjob-agent ... --node-rank "$SLURM_NODEID" ...'`` starts on each node,
    two nodes on loopback, and ``--signal=USR1@N`` (every task signalled): both agents flush one
    step and exit 75, the code the batch script requeues on. No SLURM here: each "task" is that
    bash line with the variables srun would set (SLURM_NODEID, SLURM_NNODES); what srun itself
    does (its exit code, its signal delivery) is not modelled."""
    port, uri = free_port(), str(tmp_path / "ckpt")
    line = (
        f"exec {BIN / 'spotjob-agent'} --checkpoint-uri {uri} --job-name slurm --cloud none --control-dir "
        f'{tmp_path}/control-$SLURM_NODEID --sigterm-grace 60 -- {BIN / "torchrun"} --nnodes "$SLURM_NNODES" '
        f'--node-rank "$SLURM_NODEID" --nproc-per-node 2 --master-addr "$MASTER_ADDR" --master-port {port} '
        f"{TRAIN} --steps {STEPS} --step-sleep 0.05 --every-steps 25"
    )
    runs = []
    for node in (1, 0):
        env = dict(os.environ, OMP_NUM_THREADS="1", SLURM_NODEID=str(node), SLURM_NNODES="2", MASTER_ADDR="127.0.0.1")
        log_path = tmp_path / f"node{node}.log"
        with open(log_path, "wb") as out:
            proc = subprocess.Popen(["bash", "-c", line], stdout=out, stderr=subprocess.STDOUT, env=env)
        runs.append(AgentRun(proc, ControlDir(str(tmp_path / f"control-{node}")), log_path))
    node1, node0 = runs
    wait_until(lambda: node0.step() >= 30 and node1.step() >= 30, "both nodes past step 30", node0.proc)
    for run in runs:
        run.proc.send_signal(signal.SIGUSR1)  # bash exec'd the agent: the task's pid is the agent's
    assert [run.wait() for run in runs] == [EXIT_PREEMPTED, EXIT_PREEMPTED], [run.log() for run in runs]
    steps = {r.step for r in (run.control.flush_result() for run in runs) if r is not None and r.error is None}
    assert len(steps) == 1 and next(iter(steps)) is not None, [run.log() for run in runs]
    (step,) = steps
    committed = next(c for c in list_checkpoints(open_storage(uri)) if c.ref.step == step)
    assert committed.valid and committed.manifest is not None and committed.manifest.world_size == 4, committed.reason


# -- ranks that do not meet --------------------------------------------------------------------------


def get_status(run: AgentRun) -> dict[str, Any]:
    req = urllib.request.Request(run.url() + "/status", headers={"Authorization": f"Bearer {TOKEN}"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        return dict(json.loads(resp.read()))


def post_stop(run: AgentRun) -> None:
    """``POST /stop``: the agent stops its command without a flush and exits 79 (a signal may be
    ignored: a test runner started in the background by a shell ignores SIGINT and SIGQUIT)."""
    with contextlib.suppress(OSError):  # gone already (no agent.json): its exit code tells
        req = urllib.request.Request(
            run.url() + "/stop", data=b'{"reason": "test"}', method="POST",
            headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"},
        )  # fmt: skip
        urllib.request.urlopen(req, timeout=10).close()


@pytest.mark.parametrize("launcher", ["torchrun", "direct"])
def test_a_node_whose_master_address_nothing_listens_on_is_warned_about_naming_the_address(
    tmp_path: Path, launcher: str
) -> None:
    """Node 1 of 2 given a master port nothing listens on: its rank (or torchrun, for it) waits in
    the rendezvous. Before, the agent said only, after --rank-connect-timeout, that no rank had
    connected and asked whether the script used the Checkpointer: nothing named the address, and
    the controller was told nothing (``/status`` and ``agent.json`` had no field for it)."""
    port = free_port()
    run = start_agent(
        tmp_path, "lonely", str(tmp_path / "ckpt"),
        ["--cloud", "none", "--launcher", launcher, "--rank-connect-timeout", "0.5"], [str(tmp_path / "never")],
        torchrun_args=("--nproc-per-node", "1", "--nnodes", "2", "--node-rank", "1",
                       "--master-addr", "127.0.0.1", "--master-port", str(port)),
        script=RANK_ENV,
    )  # fmt: skip
    try:
        wait_until(lambda: "nothing accepts connections" in run.log(), "the warning", run.proc)
        said = f"They meet at 127.0.0.1:{port}"
        assert said in run.log() and "WARNING" in run.log()
        # Under torchrun, node 1 waits in torchrun's own rendezvous (its timeout, not the script's).
        waits = {"torchrun": "torchrun's rendezvous timeout (--rdzv-conf timeout=", "direct": "init_process_group's"}
        assert f"wait there until {waits[launcher]}" in run.log()
        status = get_status(run)
        assert status["ranks_connected"] is False
        assert said in status["ranks_not_meeting"] and f"127.0.0.1:{port} (refused)" in status["ranks_not_meeting"]
        agent_file = json.loads((Path(run.control.path) / "agent.json").read_text())
        assert agent_file["ranks_not_meeting"] == status["ranks_not_meeting"]
    finally:
        post_stop(run)
    assert run.wait() == 79, run.log()


def test_a_notice_while_torchrun_waits_for_its_rendezvous_is_a_flush_the_agent_cut_short(tmp_path: Path) -> None:
    """Node 1 of 2, its master not there yet: torchrun waits in its rendezvous, no rank started, and
    a notice comes. The agent kills torchrun at the deadline. It said "the command ended before its
    ranks reported one", the words of a command that ended by itself (which ``spotjob run`` counts
    as the script's failure): a torchrun without ranks looked like one alone in its exit barrier."""
    run = start_agent(
        tmp_path, "waiting", str(tmp_path / "ckpt"),
        ["--cloud", "none", "--sigterm-grace", "1"], [str(tmp_path / "never")],
        torchrun_args=("--nproc-per-node", "1", "--nnodes", "2", "--node-rank", "1",
                       "--master-addr", "127.0.0.1", "--master-port", str(free_port())),
        script=RANK_ENV,
    )  # fmt: skip
    wait_until(lambda: "started " in run.log(), "the command's start", run.proc)
    time.sleep(1)  # torchrun importing, then in its rendezvous: either way no rank of it runs
    run.proc.send_signal(signal.SIGTERM)
    assert run.wait() == 76, run.log()
    assert "spotjob-agent stopped the command before its ranks reported one" in run.log(), run.log()


def test_a_node_waiting_for_its_peer_says_the_store_answers_and_the_peer_that_comes_meets_it(tmp_path: Path) -> None:
    """Node 0 alone: its rank 0 hosts the store and waits for node 1. The agent's check connects to
    that store (and leaves); the warning says it answered. Node 1 then comes, the ranks meet through
    the same store, train and finish, and node 0's agent takes the warning back. (What it pins
    beyond the first test: the check does not disturb a store the ranks then meet through.)"""
    port = str(free_port())
    uri = str(tmp_path / "ckpt")

    def node(index: int, *extra: str) -> AgentRun:
        two_nodes = (
            "--nproc-per-node",
            "1",
            "--nnodes",
            "2",
            "--node-rank",
            str(index),
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            port,
        )
        return start_agent(
            tmp_path, f"node{index}", uri, [*DIRECT, *extra], ["--step-sleep", "0.01"], torchrun_args=two_nodes,
        )  # fmt: skip

    node0 = node(0, "--rank-connect-timeout", "0.5")
    try:
        wait_until(lambda: "accepted a connection" in node0.log(), "the warning", node0.proc)
        assert f"127.0.0.1:{port} accepted a connection" in get_status(node0)["ranks_not_meeting"]
    except BaseException:
        post_stop(node0)  # its rank too, without a flush
        node0.wait(timeout=60)
        raise
    node1 = node(1)
    assert [node0.wait(), node1.wait()] == [0, 0], [node0.log(), node1.log()]
    assert "a rank has connected to the control folder after all" in node0.log()
