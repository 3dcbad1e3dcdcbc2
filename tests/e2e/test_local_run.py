"""Local mode end to end: real agents, torchrun, DDP ranks, IMDSv2 emulators and the reconciler.

Each test runs examples/train.py (2 ranks, 60 steps) under spotjob's local backend and checks
what the job ends with, never how long anything took: the final state bit-identical to an
uninterrupted run after notices at random steps, during saves and during a restart (the agents
starting the ranks themselves, ``spotjob run``'s default); a crashing script (one rank) failing the
job once ``--max-restarts`` is used (its checkpoint URI owned by ``local/<name>``, the identity the
agents got); a flush that storage refuses timing out and the job resuming from the checkpoint
before it, under ``--launcher torchrun`` (one run, read by that test and the torchrun one); a gang
stopped without a flush, its agent told ``POST /stop``; a notice an agent holds in the run's
status, its Events and ``spotjob status``; a planned host maintenance held, then flushed, and the
job resumed elsewhere.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "scripts"))
from local_run_support import STEPS, TRAIN, assert_same_final_state, clean_env, tool
from status_in_process import spotjob_status

from agent.catalog import list_checkpoints
from agent.control_channel import EXIT_STOPPED
from agent.notices.emulators import GceMetadataEmulator
from agent.ownership import attempt_records, read_owner
from agent.storage import open_storage
from orchestrator.backends import local
from orchestrator.backends.base import Placement
from orchestrator.backends.local import LocalBackend
from orchestrator.backends.local_cloud import ENV_NODE, marked_pids
from orchestrator.backends.local_launch import LocalOptions
from orchestrator.backends.local_timeline import EventKind, Timeline
from orchestrator.cli_status import status_command
from orchestrator.events import events_path, read_events
from orchestrator.model import CheckpointSpec, JobKey, JobSpec, Phase, WorkerPhase
from orchestrator.run_config import RunConfig
from orchestrator.run_driver import LocalRun

try:
    from faults import FaultProxy
except ImportError:  # tests/ collected as a package
    from tests.faults import FaultProxy

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

GIVE_UP_S = 300.0
"""How long a test waits for something to happen before calling the run hung."""
SEED = int(os.environ.get("SPOTJOB_E2E_SEED", "20261129"))


def wait_for(predicate: Callable[[], bool], what: str, *, done: threading.Event | None = None) -> None:
    give_up = time.monotonic() + GIVE_UP_S
    while not predicate():
        if done is not None and done.is_set():
            raise AssertionError(f"the run ended before {what}")
        if time.monotonic() > give_up:
            raise AssertionError(f"gave up waiting for {what}")
        time.sleep(0.05)


def run_files(tmp_path: Path, name: str) -> tuple[Path, Path]:
    """The job file and the Events file of run ``name`` under ``tmp_path/spotjob-runs``."""
    run = tmp_path / "spotjob-runs" / name
    return run / "local" / f"{name}.json", Path(events_path(str(run), JobKey.local(name)))


def read_status(path: Path) -> dict[str, Any] | None:
    try:
        return dict(json.loads(path.read_text()).get("status") or {})
    except (FileNotFoundError, ValueError):
        return None


def dumped_run(tmp_path: Path, name: str, step_sleep: float, **options: Any) -> RunConfig:
    """examples/train.py for STEPS steps, paced, its final state dumped to ``tmp_path/final``."""
    return RunConfig(
        script=str(TRAIN),
        args=["--steps", str(STEPS), "--step-sleep", f"{step_sleep:g}", "--dump", str(tmp_path / "final")],
        name=name,
        runs_dir=str(tmp_path / "runs"),
        **options,
    )


def event_reasons(events_file: Path) -> list[str]:
    return [e.reason for e in read_events(str(events_file))]


# -- preemptions at random moments --------------------------------------------------------------


def test_a_job_preempted_at_random_steps_during_saves_and_during_a_restart_ends_bit_identical(
    tmp_path: Path, uninterrupted: Path
) -> None:
    rng = random.Random(SEED)
    first, third = rng.randint(10, 25), rng.randint(38, 50)
    # A save every step, and at most one in flight: whenever a notice lands, a save is under way.
    config = dumped_run(tmp_path, "preempted", 0.1, every_steps=1, notice=6.0, flush_timeout=60.0)
    run = LocalRun(config)
    backend, spec, key = run.backend, run.spec, run.key
    done = threading.Event()
    failures: list[BaseException] = []
    starting_when_noticed: list[bool] = []

    def attempts() -> set[int]:
        return {w.attempt for w in backend.list_workers(key, spec)}

    def drive() -> None:
        try:
            wait_for(lambda: (backend.observed_step(key) or 0) >= first, f"step {first}", done=done)
            assert backend.preempt(why=f"the test: step {first}") is not None
            wait_for(lambda: 1 in attempts(), "attempt 1's worker", done=done)
            starting = [w for w in backend.list_workers(key, spec) if w.attempt == 1]
            starting_when_noticed.append(all(w.phase is WorkerPhase.PENDING for w in starting))
            assert backend.preempt(why="the test: attempt 1 is still starting") is not None
            wait_for(
                lambda: max(attempts(), default=0) >= 2 and (backend.observed_step(key) or 0) >= third,
                f"attempt 2 at step {third}",
                done=done,
            )
            assert backend.preempt(why=f"the test: step {third}") is not None
        except BaseException as e:
            failures.append(e)

    driver = threading.Thread(target=drive, name="test-driver", daemon=True)
    driver.start()
    try:
        status = run.run()
    finally:
        done.set()
        driver.join(timeout=30)
    assert not failures, f"seed {SEED}: {failures[0]!r}"

    assert status.phase is Phase.SUCCEEDED, f"seed {SEED}: {status.reason}: {status.message}"
    assert (status.preemptions, status.restarts) == (3, 0)
    # No assertion on steps lost: with a save every step, a periodic commit that lands between the
    # notice and the flush is taken for the flush (storage holds a newer manifest), and the gang is
    # stopped a step or two before its own flush commits. The final state is what must not change.
    reasons = [e.reason for e in run.events]
    assert reasons.count("FlushCommitted") >= 2, reasons
    assert "WorkersExited" in reasons, "attempt 1 had no running worker to flush"

    timeline = Timeline.read(str(Path(run.path) / "timeline.jsonl"))
    notices = [e for e in timeline if e.kind == EventKind.NOTICE]
    assert len(notices) == 3
    started = {e.data["attempt"]: e.data["node"] for e in timeline if e.kind == EventKind.WORKER_STARTED}
    assert notices[1].data["node"] == started[1]
    assert starting_when_noticed == [True]
    trained_in_attempt_1 = [
        e for e in timeline if e.kind == EventKind.STEP and e.data["attempt"] == 1 and e.data["state"] != "starting"
    ]
    assert not trained_in_attempt_1, "the second notice came while attempt 1 was still starting"
    assert len(set(started.values())) == len(started), "no node is used twice after a notice"

    for node in backend.nodes():
        assert marked_pids(ENV_NODE, node.marker) == [], f"a process of {node.name} outlived the run"
    assert_same_final_state(tmp_path / "final", uninterrupted)
    starts = started_lines(Path(run.path))
    assert len(starts) >= 3, starts  # attempt 1's agent may be killed before it starts anything
    assert all("directly, without torchrun's own start" in line for line in starts), (
        "spotjob run's agents start the ranks themselves by default"
    )


def started_lines(run_path: Path) -> list[str]:
    """Every agent's "started ..." line in the run's worker logs."""
    texts = [p.read_text(errors="replace") for p in sorted((run_path / "logs").glob("*.log"))]
    return [line for text in texts for line in text.splitlines() if "agent.launcher: started" in line]


# -- the script's arguments ----------------------------------------------------------------------


def test_the_script_gets_every_argument_after_it_as_given(
    tmp_path: Path, spotjob: Callable[..., subprocess.CompletedProcess[str]]
) -> None:
    """`spotjob run train.py -- --x` ran `train.py --x`: argparse dropped the script's own `--`."""
    script = tmp_path / "argv.py"
    script.write_text("import json, sys\nopen(sys.argv[0] + '.json', 'w').write(json.dumps(sys.argv[1:]))\n")
    said = tmp_path / "argv.py.json"
    proc = spotjob("run", "--nproc", "1", "--no-live", str(script), "--", "--x", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-6000:]
    assert json.loads(said.read_text()) == ["--", "--x"]


# -- a crashing script --------------------------------------------------------------------------


def test_a_script_that_keeps_crashing_uses_up_max_restarts_and_fails_the_job_with_the_reason(
    tmp_path: Path,
    spotjob: Callable[..., subprocess.CompletedProcess[str]],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # One rank: nothing here reads a rank's own state, and a second rank cost about 3 CPU-s an attempt.
    proc = spotjob(
        "run", "--name", "crashing", "--nproc", "1", "--max-restarts", "1", "--every-steps", "5",
        str(TRAIN), "--steps", str(STEPS), "--crash-at-step", "12",
        cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr[-6000:]
    assert "crashing failed: RestartBudgetExhausted" in proc.stderr
    assert "Failed" in proc.stdout  # the summary

    job_file, events_file = run_files(tmp_path, "crashing")
    status = read_status(job_file)
    assert status is not None
    assert (status["phase"], status["reason"]) == ("Failed", "RestartBudgetExhausted")
    assert "all 1 restart(s) are used" in status["message"]
    assert (status["restarts"], status["preemptions"]) == (1, 0)
    reasons = event_reasons(events_file)
    assert reasons.count("WorkerFailed") == 1
    # Its Event is the status's message, as spotjob run's last lines say it: the pointer a
    # Kubernetes Event ends with (`kubectl spotjob status`) is none of local mode's, whose advice
    # is in those last lines and in `spotjob status NAME`.
    [exhausted] = [e for e in read_events(str(events_file)) if e.reason == "RestartBudgetExhausted"]
    assert exhausted.message == status["message"] and "kubectl" not in proc.stderr, proc.stderr[-3000:]
    # An attempt whose agent exits 74 (the infrastructure's fault, e.g. a rendezvous port another
    # process took: seen once in CI on a loaded machine) is retried without spending the budget.
    infra = reasons.count("WorkerInfraError")
    # Step 10's save was committed before the crash at step 12, or was in flight and finished
    # before the ranks exited: never lost for an older one.
    assert status["attempt"]["number"] == 1 + infra and status["attempt"]["resumedFromStep"] == 10
    history = [(h["cause"], h["reason"]) for h in status["restartHistory"]]
    assert sorted(history) == sorted([("Failure", "WorkerFailed")] + [("Infrastructure", "WorkerInfraError")] * infra)
    assert [h["attempt"] for h in status["restartHistory"]] == list(range(1 + infra))

    # The job's identity is local/crashing end to end: the controller claimed the URI and recorded
    # the attempts under it, and the agents' Checkpointers wrote their manifests as it.
    storage = open_storage(str(tmp_path / "spotjob-runs" / "crashing" / "checkpoints"))
    owner = read_owner(storage)
    assert owner is not None and owner.job == "local/crashing"
    assert [r.attempt for r in attempt_records(storage, "local/crashing")] == [0, 1]
    manifests = [c.manifest for c in list_checkpoints(storage) if c.manifest is not None]
    assert manifests and {m.job for m in manifests} == {"local/crashing"}

    monkeypatch.chdir(tmp_path)  # where spotjob run was started
    listing = spotjob_status(capsys)
    assert listing.returncode == 0 and "crashing" in listing.stdout and "Failed" in listing.stdout
    detail = spotjob_status(capsys, "crashing")
    assert detail.returncode == 0 and "RestartBudgetExhausted" in detail.stdout
    assert "WorkerFailed" in detail.stdout, "the Events, read from the run's events file"
    as_json = json.loads(spotjob_status(capsys, "crashing", "--json").stdout)
    assert [e["reason"] for e in as_json["events"]] == event_reasons(events_file)

    # The end of the run says where its newest checkpoint is and how to carry on from it; done as
    # it says, with the crash fixed, a new run starts from that checkpoint and ends.
    uri = str(tmp_path / "spotjob-runs" / "crashing" / "checkpoints")
    assert f"the newest checkpoint of crashing, step 10, stays in {uri}" in proc.stderr
    adopt = f"spotjob ckpt adopt {uri} --job local/NEW"
    assert adopt in proc.stderr and f"spotjob run --name NEW --checkpoint-uri {uri} SCRIPT ..." in proc.stderr
    # `spotjob status NAME` says the same afterwards, for whoever looks at the run later.
    later = " ".join(detail.stdout.split())  # rich folds the long row
    assert f"to continue fix the script, then `{adopt}`" in later, detail.stdout
    adopted = spotjob(*adopt.replace("NEW", "fixed").split()[1:], cwd=tmp_path)
    assert adopted.returncode == 0, adopted.stderr
    fixed = spotjob(
        "run", "--name", "fixed", "--checkpoint-uri", uri, "--nproc", "1", "--every-steps", "5",
        str(TRAIN), "--steps", "15",
        cwd=tmp_path,
    )  # fmt: skip
    assert fixed.returncode == 0, fixed.stderr[-6000:]
    resumed = read_status(run_files(tmp_path, "fixed")[0])
    assert resumed is not None and resumed["phase"] == "Succeeded"
    assert resumed["attempt"]["number"] == 0 and resumed["attempt"]["resumedFromStep"] == 10
    assert resumed["lastCheckpoint"]["step"] == 15


# -- storage refuses the flush, under --launcher torchrun ------------------------------------------


@pytest.fixture(scope="module")
def storage_down(tmp_path_factory: pytest.TempPathFactory, moto_server: str, s3_client: Any) -> dict[str, Any]:
    """One ``spotjob run --launcher torchrun`` whose flush storage refuses, read by two tests: the
    flush timing out and the job resuming from the checkpoint before it, and the agents running
    torchrun through a preempted job. A launch of its own for the torchrun launcher cost two more
    attempts (an agent, torchrun and two ranks each, about 17 CPU-s) and checked nothing this run
    does not: a preemption, no restart, the starts, the bit-identical end (a flush that commits
    under torchrun is tests/integration/test_agent_torchrun.py's)."""
    tmp_path = tmp_path_factory.mktemp("storage-down")
    bucket = f"spotjob-e2e-{uuid.uuid4().hex[:10]}"
    s3_client.create_bucket(Bucket=bucket)
    status_file, events_file = run_files(tmp_path, "storage-down")
    with FaultProxy(moto_server, dialect="s3") as proxy:
        # Step 10 commits; every other checkpoint's writes are refused (503 SlowDown) until cleared,
        # and the agents keep retrying: whatever step the flush picks, it cannot commit. 100 attempts
        # (the most SPOTJOB_STORAGE_MAX_ATTEMPTS takes) 0.5 s apart outlast the 8 s flush timeout.
        refused = proxy.fail(10**9, 503, method="PUT", path=r"/step-(?!0{7}10/)\d{9}/")
        env = clean_env(
            AWS_ENDPOINT_URL=proxy.url, SPOTJOB_STORAGE_MAX_ATTEMPTS="100", SPOTJOB_STORAGE_MAX_BACKOFF_S="0.5"
        )
        argv = [
            tool("spotjob"), "run", "--name", "storage-down", "--checkpoint-uri", f"s3://{bucket}/job",
            "--every-steps", "10", "--preempt-at-step", "12", "--notice", "30", "--flush-timeout", "8",
            "--launcher", "torchrun",
            str(TRAIN), "--steps", str(STEPS), "--step-sleep", "0.1", "--dump", str(tmp_path / "final"),
        ]  # fmt: skip
        log_path = tmp_path / "spotjob-run.log"
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(argv, cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:

            def timed_out() -> bool:
                status = read_status(status_file)
                if proc.poll() is not None:
                    raise AssertionError(f"spotjob run exited {proc.returncode}:\n{log_path.read_text()[-6000:]}")
                return status is not None and "FlushTimedOut" in event_reasons(events_file)

            wait_for(timed_out, "the flush to time out")
            proxy.clear()  # storage is back
            code = proc.wait(timeout=GIVE_UP_S)
        finally:
            if proc.poll() is None:
                proc.terminate()
                proc.wait(timeout=60)
    output = log_path.read_text()
    assert code == 0, output[-6000:]
    return {
        "refused": refused.served,
        "status": read_status(status_file),
        "events": read_events(str(events_file)),
        "output": output,
        "starts": started_lines(tmp_path / "spotjob-runs" / "storage-down"),
        "final": tmp_path / "final",
    }


def test_a_flush_that_storage_refuses_times_out_and_the_job_resumes_from_the_checkpoint_before_it(
    storage_down: dict[str, Any], uninterrupted: Path
) -> None:
    assert storage_down["refused"] > 0
    status = storage_down["status"]
    assert status is not None and status["phase"] == "Succeeded"
    timed_out_event = next(e for e in storage_down["events"] if e.reason == "FlushTimedOut")
    # It names the worker whose ranks had not committed their part, and what its agent said of them
    # (the store refuses the flush's writes: its ranks took the flush and retry, or gave up).
    assert re.fullmatch(
        r"nothing newer than step 10 committed within \d+s; resuming from step 10; not committed by "
        r"storage-down-0-0 on local-node-0 \((its ranks took the flush and wait for it to commit|its ranks' flush "
        r"failed)\)",
        timed_out_event.message,
    ), timed_out_event
    assert status["preemptions"] == 1 and status["restarts"] == 0
    assert status["lostSteps"] > 0
    output = storage_down["output"]
    assert "resumed from step 10" in output or "from step 10" in output
    assert_same_final_state(storage_down["final"], uninterrupted)


def test_with_launcher_torchrun_the_agents_run_torchrun_and_a_preempted_job_still_ends_bit_identical(
    storage_down: dict[str, Any], uninterrupted: Path
) -> None:
    status = storage_down["status"]
    assert status is not None and status["phase"] == "Succeeded", status
    assert (status["preemptions"], status["restarts"]) == (1, 0)
    starts = storage_down["starts"]
    assert len(starts) == 2 and all("/torchrun --nproc-per-node" in line and "directly" not in line for line in starts)
    assert_same_final_state(storage_down["final"], uninterrupted)


# -- starting an attempt, pass after pass ----------------------------------------------------------


def one_rank_job(tmp_path: Path, name: str) -> tuple[JobKey, JobSpec]:
    """A one-rank job that trains for as long as the test lets it, checkpointing under ``tmp_path``."""
    spec = JobSpec(
        command=[str(TRAIN), "--steps", "100000", "--step-sleep", "0.2"],
        nproc_per_node=1,
        checkpoint=CheckpointSpec(uri=str(tmp_path / "ckpt")),
    )
    return JobKey.local(name), spec


def test_a_preempt_every_shorter_than_a_restart_still_lets_the_run_train_to_its_end(
    tmp_path: Path, spotjob: Callable[..., subprocess.CompletedProcess[str]]
) -> None:
    """A ``--preempt-every`` shorter than the time an attempt takes to start starved the run (README,
    Limits): the notices due meanwhile queued up and hit each attempt as it started, before it had
    trained a step, so the run never ended. The gap's clock now runs only while an attempt trains:
    here one second of training between notices, much less than an attempt's start on any machine
    (an agent, a rank, torch imported), and the run trains to its end; every notice hit a node whose
    worker had trained."""
    proc = spotjob(
        "run", "--name", "short-gaps", "--nproc", "1", "--every-steps", "5",
        "--preempt-every", "1", "--preempt-jitter", "0", "--seed", "1",
        str(TRAIN), "--steps", "30", "--step-sleep", "0.1",
        cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-6000:]
    job_file, _ = run_files(tmp_path, "short-gaps")
    status = read_status(job_file)
    assert status is not None and status["phase"] == "Succeeded", status
    assert status["preemptions"] >= 1, status  # the plan did preempt it, and it still ended

    timeline = Timeline.read(str(tmp_path / "spotjob-runs" / "short-gaps" / "timeline.jsonl"))
    notices = [e for e in timeline if e.kind == EventKind.NOTICE]
    assert notices and all(e.data["why"].startswith("every 1 s") for e in notices), notices
    for notice in notices:
        worker = [
            e.data["worker"]
            for e in timeline
            if e.kind == EventKind.WORKER_STARTED and e.data["node"] == notice.data["node"] and e.t <= notice.t
        ][-1]
        trained = [
            e
            for e in timeline
            if e.kind == EventKind.STEP and e.data["worker"] == worker and e.data["state"] != "starting"
            and e.t <= notice.t
        ]  # fmt: skip
        assert trained, f"the notice {notice.data} hit {worker} before it trained a step"


def test_starting_an_attempt_again_spawns_nothing_and_does_not_wake_the_controller(tmp_path: Path) -> None:
    """The reconciler calls start_workers on every pass while an attempt starts. Each call used to
    wake the controller again at once, so `spotjob run` spun at a full core (thousands of passes)
    exactly while the ranks imported torch, and took a fresh port each time."""
    key, spec = one_rank_job(tmp_path, "again")
    with LocalBackend(LocalOptions(root=str(tmp_path / "run"))) as backend:
        backend.start_workers(key, spec, 0, Placement())
        assert backend.changed.is_set(), "a worker started: the controller looks again"
        backend.changed.clear()
        ports = dict(backend._ports)
        for _ in range(5):
            backend.start_workers(key, spec, 0, Placement())
        assert not backend.changed.is_set(), "nothing new happened"
        assert backend._ports == ports
        timeline = Timeline.read(str(tmp_path / "run" / "timeline.jsonl"))
        started = [e for e in timeline if e.kind == EventKind.WORKER_STARTED]
        assert [e.data["worker"] for e in started] == ["again-0-0"]
        backend.stop_workers(key, spec, flush=False)


def test_the_rendezvous_port_is_chosen_once_the_nodes_metadata_servers_hold_theirs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A new node's IMDS server binds an ephemeral port. A rendezvous port chosen (and let go)
    before the node was provisioned could be handed to that server, and the agent then exited 74
    (port taken): seen in a goodput run, 8 s lost. Each port must be chosen after placement."""
    key, spec = one_rank_job(tmp_path, "ports")
    with LocalBackend(LocalOptions(root=str(tmp_path / "run"))) as backend:
        bound_when_chosen: list[set[str]] = []
        real_free_port = local.free_port

        def free_port(host: str = "") -> int:
            bound_when_chosen.append({n.imds.url for n in backend.nodes()})
            return real_free_port(host)

        monkeypatch.setattr(local, "free_port", free_port)
        for attempt in (0, 1):
            backend.start_workers(key, spec, attempt, Placement())
        workers = list(backend._workers.values())
        assert len(bound_when_chosen) == 2 and sorted(w.attempt for w in workers) == [0, 1]
        for w in workers:
            assert w.node.imds.url in bound_when_chosen[w.attempt], f"attempt {w.attempt}'s node came after its port"
        backend.stop_workers(key, spec, flush=False)


# -- a gang stopped without a flush -------------------------------------------------------------


def test_a_gang_stopped_without_a_flush_is_told_post_stop_and_exits_79(tmp_path: Path) -> None:
    key, spec = one_rank_job(tmp_path, "stopped")
    with LocalBackend(LocalOptions(root=str(tmp_path / "run"))) as backend:
        backend.start_workers(key, spec, 0, Placement())
        wait_for(
            lambda: any(w.phase is WorkerPhase.RUNNING for w in backend.list_workers(key, spec)),
            "the worker to train",
        )

        backend.stop_workers(key, spec, flush=False)
        wait_for(lambda: not backend.list_workers(key, spec), "the worker to be gone")

    exits = [e for e in Timeline.read(str(tmp_path / "run" / "timeline.jsonl")) if e.kind == EventKind.WORKER_EXITED]
    assert [(e.data["worker"], e.data["code"]) for e in exits] == [("stopped-0-0", EXIT_STOPPED)]
    assert list_checkpoints(open_storage(str(tmp_path / "ckpt"))) == [], "stopped, not flushed"


def test_stopping_gang_after_gang_keeps_only_the_stops_still_running(tmp_path: Path) -> None:
    """Every gang stopped (a peer preempted, a peer failed) has a thread per live worker; the
    backend kept every one of them for close() to join, one more per restart for the whole run."""
    key, spec = one_rank_job(tmp_path, "gangs")
    with LocalBackend(LocalOptions(root=str(tmp_path / "run"), kill_grace=0.5)) as backend:
        for attempt in range(4):
            backend.start_workers(key, spec, attempt, Placement())
            backend.stop_workers(key, spec, flush=False)
            give_up = time.monotonic() + 120
            while backend._workers:
                assert time.monotonic() < give_up, "a stopped worker was never removed"
                time.sleep(0.05)
        assert len(backend._threads) <= 1, f"{len(backend._threads)} stop threads kept after 4 gangs"


def test_an_interrupt_that_lands_before_a_stop_thread_starts_leaves_close_to_stop_the_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """spotjob run's Ctrl-C is a KeyboardInterrupt its handler raises at whatever bytecode the main
    thread runs, here as the reconciler stops a gang: after the stop's thread was kept for close()
    to join, before it started. close() then failed joining a thread never started ("cannot join
    thread before it is started"): the rest of LocalRun.run's stop was skipped and spotjob run
    ended in a traceback instead of 130. The handler's raise is put where it lands: at the start of
    the thread's start()."""
    key, spec = one_rank_job(tmp_path, "cut")
    real = threading.Thread

    class CutBeforeStart(real):
        def start(self) -> None:
            if self.name.startswith("stop-"):
                raise KeyboardInterrupt("signal 2")
            super().start()

    backend = LocalBackend(LocalOptions(root=str(tmp_path / "run")))
    try:
        backend.start_workers(key, spec, 0, Placement())
        node = next(iter(backend.nodes()))
        monkeypatch.setattr(local.threading, "Thread", CutBeforeStart)
        with pytest.raises(KeyboardInterrupt):
            backend.stop_workers(key, spec, flush=False)
        monkeypatch.setattr(local.threading, "Thread", real)
    finally:
        backend.close(grace=0.5)
    assert not marked_pids(ENV_NODE, node.marker), "close() left the worker's processes running"


# -- a notice an agent holds ----------------------------------------------------------------------


def test_a_notice_a_local_agent_holds_is_in_the_runs_status_its_events_and_spotjob_status(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """GCE gives an hour's notice of a host maintenance; the agent holds it (``--flush-lead``) and
    training goes on. Before, in local mode only the agent's log and ``/status`` said so: the run's
    status had no ``heldNotices``, no ``NoticeHeld`` Event came, and ``spotjob status`` showed
    nothing. Local mode's agents listen to their node's AWS metadata alone, whose notices are never
    held; so here each agent's command line also names a GCE metadata emulator (the one seam)."""
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))  # the agents' maintenance records
    (tmp_path / "tmp").mkdir()
    runs_dir = tmp_path / "runs"
    with GceMetadataEmulator() as gce:
        command = LocalBackend._command

        def also_gce(self: LocalBackend, *args: Any) -> list[str]:
            argv = command(self, *args)
            at = argv.index("--notices")
            argv[at + 1 : at + 2] = ["aws,gcp", "--gcp-metadata-url", gce.url, "--gcp-maintenance-seconds", "3600"]
            return argv

        monkeypatch.setattr(LocalBackend, "_command", also_gce)
        config = RunConfig(
            script=str(TRAIN),
            args=["--steps", "100000", "--step-sleep", "0.1"],
            name="held",
            runs_dir=str(runs_dir),
            nproc=1,
        )
        run = LocalRun(config)
        status_file = Path(run.store.path(run.key))
        events_file = Path(run.events_path)
        stop, done = threading.Event(), threading.Event()
        ended: list[BaseException] = []
        real_wait = run._wait

        def wait(seconds: float) -> None:
            if stop.is_set():
                raise KeyboardInterrupt("the test has seen what it came for")  # as spotjob run's Ctrl-C
            real_wait(seconds)

        monkeypatch.setattr(run, "_wait", wait)

        def drive() -> None:
            try:
                run.run()
            except BaseException as e:
                ended.append(e)
            finally:
                done.set()

        driver = threading.Thread(target=drive, name="test-driver", daemon=True)
        driver.start()
        try:
            wait_for(lambda: (run.backend.observed_step(run.key) or 0) >= 2, "training", done=done)
            gce.set_maintenance_event("TERMINATE_ON_HOST_MAINTENANCE")

            def recorded() -> bool:
                status = read_status(status_file) or {}
                return bool(status.get("heldNotices")) and "NoticeHeld" in event_reasons(events_file)

            wait_for(recorded, "the held notice in the run's status and Events", done=done)
            assert status_command(argparse.Namespace(name="held", runs_dir=str(runs_dir), json=False)) == 0
            detail = capsys.readouterr().out
            assert status_command(argparse.Namespace(name=None, runs_dir=str(runs_dir), json=False)) == 0
            listing = capsys.readouterr().out
            assert status_command(argparse.Namespace(name="held", runs_dir=str(runs_dir), json=True)) == 0
            doc = json.loads(capsys.readouterr().out)
        finally:
            stop.set()
            run.backend.changed.set()
            driver.join(timeout=GIVE_UP_S)
        assert [type(e) for e in ended] == [KeyboardInterrupt], ended

    [held] = doc["status"]["heldNotices"]
    assert (held["worker"], held["source"], held["kind"]) == ("held-0-0", "gcp", "maintenance"), held
    deadline, flush_at = (datetime.fromisoformat(held[k]) for k in ("deadline", "flushAt"))
    assert flush_at == deadline - timedelta(seconds=300), held  # --flush-lead's default
    assert "NoticeHeld" in [e["reason"] for e in doc["events"]]
    line = next(x for x in detail.splitlines() if x.strip().startswith("held notice"))
    assert f"held-0-0 on {held['node']}: gcp maintenance (" in line, line
    assert "training goes on, the flush starts" in line, line
    assert "HELD-FLUSH" in listing.splitlines()[0] and "in 5" in listing, listing
    assert "FlushCommitted" not in event_reasons(events_file), "a held notice flushes nothing"


def test_a_planned_host_maintenance_is_held_shown_then_flushed_and_the_job_resumes_elsewhere_bit_identical(
    tmp_path: Path, uninterrupted: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--maintenance-at-step``: the node's GCE metadata says TERMINATE_ON_HOST_MAINTENANCE with a
    notice of seconds; its agent holds it (the run's status, ``spotjob status`` and an Event say
    so, with its flush time) while training goes on, flushes ``--flush-lead`` before the node
    stops, and the job resumes on another node from that flush. Before, local mode's nodes sent
    spot interruptions alone and nothing was ever held."""
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))  # the agents' maintenance records
    (tmp_path / "tmp").mkdir()
    # A step takes 0.3 s or more: the 6 s held (15 - 9) end before step 5 + 20 < STEPS. The flush then
    # has 9 s before the node stops (6 s was too little for two ranks on a machine at load 20-30).
    config = dumped_run(
        tmp_path, "maintained", 0.3, every_steps=10, maintenance_at_steps=[5], maintenance_notice=15.0, flush_lead=9.0
    )
    run = LocalRun(config)
    status_file = Path(run.store.path(run.key))
    runs_dir = str(tmp_path / "runs")
    done = threading.Event()
    seen: dict[str, Any] = {}
    failures: list[BaseException] = []

    def watch() -> None:
        try:
            wait_for(lambda: bool((read_status(status_file) or {}).get("heldNotices")), "the held notice", done=done)
            seen["step"] = run.backend.observed_step(run.key)
            assert status_command(argparse.Namespace(name="maintained", runs_dir=runs_dir, json=True)) == 0
            seen["doc"] = json.loads(capsys.readouterr().out)
            assert status_command(argparse.Namespace(name="maintained", runs_dir=runs_dir, json=False)) == 0
            seen["detail"] = capsys.readouterr().out
        except BaseException as e:
            failures.append(e)

    watcher = threading.Thread(target=watch, name="test-watcher", daemon=True)
    watcher.start()
    try:
        status = run.run()
    finally:
        done.set()
        watcher.join(timeout=30)
    assert not failures, repr(failures[0])
    assert status.phase is Phase.SUCCEEDED, f"{status.reason}: {status.message}"
    assert (status.preemptions, status.restarts) == (1, 0)

    [held] = seen["doc"]["status"]["heldNotices"]
    assert (held["worker"], held["source"], held["kind"]) == ("maintained-0-0", "gcp", "maintenance"), held
    assert "TERMINATE_ON_HOST_MAINTENANCE" in held["detail"], held
    deadline, flush_at = (datetime.fromisoformat(held[k]) for k in ("deadline", "flushAt"))
    assert flush_at == deadline - timedelta(seconds=9), held  # --flush-lead
    line = next(x for x in seen["detail"].splitlines() if x.strip().startswith("held notice"))
    assert "maintained-0-0 on local-node-0: gcp maintenance (" in line and "the flush starts" in line, line

    reasons = [e.reason for e in run.events]
    assert "NoticeHeld" in reasons and "AgentPreempted" in reasons, reasons
    assert reasons.index("NoticeHeld") < reasons.index("AgentPreempted"), reasons
    # The agent's flush is that flush, whether or not a pass recorded it before the exit 75 was seen.
    assert "FlushCommitted" in reasons and "WorkersExited" not in reasons, reasons
    timeline = Timeline.read(str(Path(run.path) / "timeline.jsonl"))
    [notice] = [e for e in timeline if e.kind == EventKind.NOTICE]
    assert notice.data["maintenance"] and notice.data["node"] == "local-node-0", notice
    started = {e.data["attempt"]: e.data["node"] for e in timeline if e.kind == EventKind.WORKER_STARTED}
    assert started == {0: "local-node-0", 1: "local-node-1"}, started
    # The maintained node stops at its deadline, which may come after the run's end; no other does.
    assert {e.data["node"] for e in timeline if e.kind == EventKind.NODE_TERMINATED} <= {"local-node-0"}
    # Training went on while the notice was held; the flush committed no earlier than the step the
    # held notice was seen at, and attempt 1 went on from there (not from an older checkpoint).
    flushed = max(e.data["step"] for e in timeline if e.kind == EventKind.COMMIT and e.data["attempt"] == 0)
    assert flushed >= seen["step"] >= 5, (flushed, seen["step"])
    resumed = [e.data["step"] for e in timeline if e.kind == EventKind.STEP and e.data["attempt"] == 1]
    assert resumed and min(resumed) >= flushed, (flushed, resumed[:3])
    assert_same_final_state(tmp_path / "final", uninterrupted)
