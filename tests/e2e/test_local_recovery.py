"""Local mode when things go wrong around the training, end to end with real ``spotjob run`` processes.

- The driver is killed with SIGKILL: its workers notice (``spotjob-agent --exit-with-parent``),
  flush and stop by themselves; ``spotjob status`` shows the truth from storage and the
  processes; ``spotjob run --resume`` is refused while the run is driven, and afterwards carries
  the run on to the end under the same job identity (owner, attempts, manifests), bit-identical to
  an uninterrupted run, with every commit counted.
- Ctrl-Z pauses the driver and every process of its run, ``fg`` resumes them; told then to stop
  (SIGTERM) again and again while it stops, the driver leaves no process of the run (one run for both).
- The summary's numbers are exact: every commit counted (a save every step on one rank commits
  faster than anyone samples), the last checkpoint named, never "None".
- A failed worker's reason says why (a usage error, a full disk, a read-only filesystem, a full
  checkpoint disk rather than the exception it caused) and where its log is.
- Two runs of one name started at once: one runs, the other is refused in one line (the one that
  runs is the summary's case).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "scripts"))
from local_run_support import (
    GIVE_UP_S,
    REPO,
    STEPS,
    TRAIN,
    assert_same_final_state,
    clean_env,
    flip_byte_in_place,
    job_document,
    process_states,
    tool,
    wait_for,
)
from status_in_process import spotjob_status

from agent.catalog import list_checkpoints
from agent.ownership import attempt_records, read_owner
from agent.storage import open_storage
from orchestrator.backends.local_cloud import run_pids
from orchestrator.events import events_path, read_events
from orchestrator.model import JobKey

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

SCRIPTS = Path(__file__).resolve().parent / "scripts"
FORBIDDEN = ("Traceback", "Input should be", "Value error", "errors.pydantic.dev")
COMMIT_LINE = re.compile(r"rank0 agent\.checkpoint: (?:committed step \d+|flush: step \d+ committed) at (\S+?)[,\s]")
"""How rank 0 of examples/train.py logs each checkpoint it commits (a flush's twice), with the
folder each commit made: the truth the summary must match."""


def commits_logged(run: Path) -> int:
    """Checkpoints committed, by the workers' own logs: one folder each (a step committed again
    goes to ``step-N.1``)."""
    logs = [p.read_text(errors="replace") for p in (run / "logs").glob("*.log")]
    return len({uri for text in logs for uri in COMMIT_LINE.findall(text)})


def start_driver(
    tmp_path: Path, argv: list[str], env: dict[str, str] | None = None, **popen: Any
) -> subprocess.Popen[bytes]:
    """``spotjob run`` in the background, its output in ``driver.log``."""
    with open(tmp_path / "driver.log", "wb") as out:
        return subprocess.Popen(
            argv, cwd=tmp_path, env=env or clean_env(), stdout=out, stderr=subprocess.STDOUT, **popen
        )


def wait_training(driver: subprocess.Popen[bytes], run: Path, steps: int) -> None:
    """Until the run's job document says it runs, past ``steps``; fails if the driver exits first."""

    def training() -> bool:
        assert driver.poll() is None, (run.parent.parent / "driver.log").read_text()[-4000:]
        status = job_document(run).get("status") or {}
        return status.get("phase") == "Running" and (status.get("attempt", {}).get("observedStep") or 0) >= steps

    wait_for(training, f"the run to train {steps} steps")


def spotjob(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([tool("spotjob"), *args], cwd=cwd, env=clean_env(), capture_output=True, text=True)


# -- the driver dies ------------------------------------------------------------------------------


def test_a_killed_driver_leaves_a_flushed_run_that_status_tells_truly_and_resume_carries_to_the_end(
    tmp_path: Path, uninterrupted: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "spotjob-runs" / "orphan"
    argv = [
        tool("spotjob"), "run", "--no-live", "--name", "orphan", "--every-steps", "5",
        str(TRAIN), "--steps", str(STEPS), "--step-sleep", "0.3", "--dump", str(tmp_path / "final"),
    ]  # fmt: skip
    # 0.3 s a step: the refused --resume below (a fresh spotjob process) must end before the run's
    # last step. At 0.15 s, 48 steps (7 s) were not enough on a machine at load 20: the run ended first.
    driver = start_driver(tmp_path, argv)
    try:
        wait_training(driver, run, 12)
        refused = spotjob("run", "--resume", "orphan", cwd=tmp_path)
        assert refused.returncode == 2, refused.stderr
        assert f"being driven by another spotjob run (pid {driver.pid})" in refused.stderr
        assert driver.poll() is None, "the run ended before its driver could be killed: give it more steps"

        driver.send_signal(signal.SIGKILL)
        driver.wait(timeout=30)
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait()

    # The workers notice their driver is gone, flush and stop by themselves.
    wait_for(lambda: not run_pids(str(run)), "the dead driver's workers to stop")
    agent_log = (run / "logs" / "orphan-0-0.log").read_text()
    assert "driver terminate" in agent_log and "exiting 75: the flush committed step" in agent_log
    flushed = int(re.findall(r"flush: step (\d+) committed at", agent_log)[-1])

    # spotjob status: not "every worker is running", but what storage and the processes say now.
    monkeypatch.chdir(tmp_path)  # where spotjob run was started
    detail = spotjob_status(capsys, "orphan")
    assert detail.returncode == 0, detail.stderr
    assert "nothing drives this run" in detail.stdout
    assert "none of its processes runs (0 alive)" in detail.stdout
    assert f"step {flushed}" in detail.stdout and "read from storage now" in detail.stdout
    assert "spotjob run --resume orphan" in detail.stdout
    listing = spotjob_status(capsys)
    [row] = [line for line in listing.stdout.splitlines() if line.split()[:1] == ["orphan"]]
    assert "Running (driver gone)" in row and f"step {flushed}" in row
    as_json = json.loads(spotjob_status(capsys, "orphan", "--json").stdout)
    assert as_json["now"]["processesAlive"] == 0 and as_json["now"]["lastCheckpoint"]["step"] == flushed

    resumed = spotjob("run", "--no-live", "--resume", "orphan", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-6000:]
    assert not any(p in resumed.stdout + resumed.stderr for p in FORBIDDEN)

    status = job_document(run)["status"]
    assert status["phase"] == "Succeeded"
    assert status["attempt"]["number"] == 1 and status["attempt"]["resumedFromStep"] == flushed
    assert [(h["attempt"], h["reason"]) for h in status["restartHistory"]] == [(0, "WorkerLost")]
    assert status["restarts"] == 0, "a lost driver uses none of --max-restarts"
    reasons = [e.reason for e in read_events(events_path(str(run), JobKey.local("orphan")))]
    assert reasons.index("Resumed") < reasons.index("WorkerLost") < reasons.index("Completed")
    # One job identity across both drivers: the URI's owner, the attempts recorded, the manifests.
    storage = open_storage(str(run / "checkpoints"))
    owner = read_owner(storage)
    assert owner is not None and owner.job == "local/orphan"
    assert [r.attempt for r in attempt_records(storage, "local/orphan")] == [0, 1]
    assert {c.manifest.job for c in list_checkpoints(storage) if c.manifest} == {"local/orphan"}
    # Every commit counted, the ones the dead driver never saw included.
    summary = json.loads((run / "summary.json").read_text())
    assert summary["commits"] == commits_logged(run)
    assert summary["steps"] == STEPS and summary["last_checkpoint"] == STEPS
    assert_same_final_state(tmp_path / "final", uninterrupted)


def test_a_resume_whose_newest_checkpoint_has_a_damaged_byte_warns_and_names_the_step_restored(
    tmp_path: Path,
) -> None:
    """Interrupted; a byte of the flush's checkpoint damaged, its size unchanged; --resume. The
    controller judges sizes only and names it; the rank's restore finds the CRC32C mismatch and
    restores the one before. That was said only in the rank's log: no CheckpointUnusable, the status
    named the damaged step, and the steps trained again were not counted."""
    run = tmp_path / "spotjob-runs" / "byte"
    argv = [
        tool("spotjob"), "run", "--no-live", "--name", "byte", "--nproc", "1", "--every-steps", "5",
        str(TRAIN), "--steps", "40", "--step-sleep", "0.1",
    ]  # fmt: skip
    driver = start_driver(tmp_path, argv)
    try:
        wait_training(driver, run, 12)
        driver.send_signal(signal.SIGTERM)
        driver.wait(timeout=GIVE_UP_S)
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait()
    storage = open_storage(str(run / "checkpoints"))
    newest, before = [c.ref for c in list_checkpoints(storage) if c.valid][:2]
    shard = run / "checkpoints" / newest.folder / "__0_0.distcp"
    flip_byte_in_place(shard)

    resumed = spotjob("run", "--no-live", "--resume", "byte", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-6000:]
    events = read_events(events_path(str(run), JobKey.local("byte")))
    [told] = [e for e in events if e.reason == "CheckpointUnusable"]
    assert told.message.startswith(f"step {newest.step}, the newest checkpoint this job had recorded, did not load")
    assert "CRC32C" in told.message and "__0_0.distcp" in told.message, told.message
    assert told.message.endswith(f": the job resumes from step {before.step}"), told.message
    status = job_document(run)["status"]
    assert status["phase"] == "Succeeded"
    assert (status["attempt"]["resumedFromStep"], status["attempt"]["restoredStep"]) == (newest.step, before.step)
    assert status["lostSteps"] == newest.step - before.step
    assert status["lastCheckpoint"]["step"] == 40 and status.get("unusableCheckpoint") is None


STOPPING_AGAIN = "received SIGTERM again: still stopping every process of pause"
"""What the driver logs for each SIGTERM that lands while it stops."""


@pytest.fixture(scope="module")
def paused_then_stopped(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One ``spotjob run`` of one rank, paused with Ctrl-Z, resumed with ``fg``, then told to stop
    (SIGTERM) again and again until it exits, read by the Ctrl-Z test and the
    stop-again test. Each had a driver of its own (a driver, an agent and a rank, about 4 CPU-s);
    the stop-again case needs a run whose processes run, which the resumed one is. One rank: the
    driver, its agent and its rank are the kinds of process that pause and that the stop must leave
    none of, as with more ranks."""
    tmp_path = tmp_path_factory.mktemp("pause")
    run = tmp_path / "spotjob-runs" / "pause"
    log = tmp_path / "driver.log"
    argv = [
        tool("spotjob"), "run", "--no-live", "--name", "pause", "--nproc", "1", "--every-steps", "5",
        str(TRAIN), "--steps", "100000", "--step-sleep", "0.1",
    ]  # fmt: skip
    # As a terminal starts it: Ctrl-Z not ignored.
    driver = start_driver(tmp_path, argv, preexec_fn=lambda: signal.signal(signal.SIGTSTP, signal.SIG_DFL))

    seen: dict[str, Any] = {}
    try:
        wait_training(driver, run, 5)
        driver.send_signal(signal.SIGTSTP)
        wait_for(
            lambda: process_states(driver, run) == {psutil.STATUS_STOPPED},
            "the driver and every process of its run stopped",
        )
        driver.send_signal(signal.SIGCONT)
        wait_for(
            lambda: psutil.STATUS_STOPPED not in process_states(driver, run),
            "the driver and every process of its run resumed",
        )
        seen["running"] = run_pids(str(run))
        # Until it exits, as a supervisor repeats it: the ones after its stop must not change its
        # exit 130 (one that came once the handler was given back ended it by the signal, -15).
        while driver.poll() is None:
            driver.send_signal(signal.SIGTERM)
            time.sleep(0.02)
        seen["code"] = driver.wait(timeout=GIVE_UP_S)
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait()
        left = run_pids(str(run))
        for pid in left:  # a failed case leaves them stopped: nothing else would ever end them
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    seen["left"] = left
    seen["log"] = log.read_text()
    return seen


def test_a_driver_told_to_stop_again_and_again_while_it_stops_still_leaves_no_process_of_the_run(
    paused_then_stopped: dict[str, Any],
) -> None:
    """A second Ctrl-C, or a supervisor repeating its SIGTERM, must not cut the stop short."""
    assert paused_then_stopped["running"], "the run's processes should be running"
    log = paused_then_stopped["log"]
    assert log.count(STOPPING_AGAIN) >= 3, "the driver ended before three more SIGTERMs landed in its stop"
    left = paused_then_stopped["left"]
    assert not left, f"processes of the run outlived its driver: {left}"
    # The first SIGTERM asks for a flush, the second stops the run at once (test_local_interrupt.py).
    assert "received SIGTERM again: stopping every process of pause at once, without the flush" in log, log[-4000:]
    assert re.search(r"spotjob run: interrupted; .*every process of pause was stopped", log), log[-4000:]
    assert "Traceback" not in log


def test_ctrl_z_pauses_the_driver_and_every_process_of_its_run_and_fg_resumes_them(
    paused_then_stopped: dict[str, Any],
) -> None:
    """Ctrl-Z reaches the driver alone (its workers run in sessions of their own): it used to stop
    the driver only, its agents and ranks training on with nobody driving the run (its notices,
    its simulated nodes' metadata servers, its status). Now every process of the run pauses with
    the driver (the fixture waits for that, and then for ``fg``, SIGCONT, to resume them all)."""
    assert paused_then_stopped["code"] == 130, paused_then_stopped["log"][-4000:]
    left = paused_then_stopped["left"]
    assert not left, f"processes of the run outlived its driver: {left}"
    assert "Traceback" not in paused_then_stopped["log"]


# -- why a worker failed --------------------------------------------------------------------------


def _user_namespaces() -> bool:
    unshare = shutil.which("unshare")
    return unshare is not None and subprocess.run([unshare, "-rm", "true"], capture_output=True).returncode == 0


def _in_namespace_with(mount: str, argv: list[str]) -> list[str]:
    """``argv`` run in a user and mount namespace of its own, after ``mount`` (a shell command)."""
    return ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", f'{mount} && exec "$@"', "sh", *argv]


FAILURES: dict[str, tuple[Callable[[Path], tuple[list[str], list[str]]], str, bool]] = {
    # name: (the run's options and script arguments, and a wrapper; the words of the cause; needs namespaces)
    # write_to.py, not train.py: the same argparse error without importing torch first (about 3 CPU-s).
    "a usage error of the script": (
        lambda tmp: ([str(SCRIPTS / "write_to.py"), "/dev/null", "--bogus"], []),
        "write_to.py: error: unrecognized arguments: --bogus",
        False,
    ),
    "a full disk under the script": (
        lambda tmp: ([str(SCRIPTS / "write_to.py"), "/dev/full"], []),
        "OSError: [Errno 28] No space left on device",
        False,
    ),
    "a read-only filesystem under the script": (
        lambda tmp: (
            [str(SCRIPTS / "write_to.py"), str(tmp / "ro" / "out.bin")],
            [f'mkdir -p "{tmp}/ro" && mount -t tmpfs -o ro,size=64k tmpfs "{tmp}/ro"'],
        ),
        "Read-only file system",
        True,
    ),
    "a full checkpoint disk": (
        lambda tmp: (
            ["--checkpoint-uri", str(tmp / "small" / "ckpt"), "--every-steps", "2", str(TRAIN), "--steps", "6",
             "--hidden", "512"],
            [f'mkdir -p "{tmp}/small" && mount -t tmpfs -o size=96k tmpfs "{tmp}/small"'],
        ),
        "No space left on device",
        True,
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", list(FAILURES))
def test_a_failed_workers_reason_says_why_and_where_its_log_is(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], case: str
) -> None:
    arrange, cause, needs_namespaces = FAILURES[case]
    if needs_namespaces and not _user_namespaces():
        pytest.skip("no user namespaces here: no tmpfs of the test's own to fill or make read-only")
    args, mount = arrange(tmp_path)
    argv = [tool("spotjob"), "run", "--no-live", "--name", "failing", "--nproc", "1", "--max-restarts", "0", *args]
    if mount:
        argv = _in_namespace_with(mount[0], argv)

    proc = subprocess.run(argv, cwd=tmp_path, env=clean_env(), capture_output=True, text=True, timeout=GIVE_UP_S)

    assert proc.returncode == 1, proc.stderr[-6000:]
    log = tmp_path / "spotjob-runs" / "failing" / "logs" / "failing-0-0.log"
    status = job_document(tmp_path / "spotjob-runs" / "failing")["status"]
    assert status["reason"] == "RestartBudgetExhausted"
    assert cause in status["message"] and f"(log: {log})" in status["message"], status["message"]
    assert "unexpected pos" not in status["message"]
    failed_line = next(line for line in proc.stderr.splitlines() if line.startswith("spotjob run: failing failed"))
    assert cause in failed_line and str(log) in failed_line
    assert f"the end of {log}:" in proc.stderr, "and the end of the log, to read on"
    monkeypatch.chdir(tmp_path)  # where spotjob run was started
    detail = " ".join(spotjob_status(capsys, "failing").stdout.split())
    assert cause in detail and f"the end of {log}:" in detail


# -- two drivers of one name, and the numbers of the one that ran ---------------------------------


@pytest.fixture(scope="module")
def counted_twice(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[tuple[int, str, str]]]:
    """Two ``spotjob run`` of one name started at once, a save every step on one rank: the one
    that runs is the summary's case, the one refused the refusal's. Each case had a run of its
    own; the refused driver starts no rank, so sharing saves a driver, an agent and a rank (about
    4 CPU-s) and each test still reads its own driver's output."""
    tmp_path = tmp_path_factory.mktemp("counted")
    argv = [
        tool("spotjob"), "run", "--no-live", "--name", "counted", "--nproc", "1", "--every-steps", "1", "--keep", "2",
        str(TRAIN), "--steps", "12",
    ]  # fmt: skip
    procs = [
        subprocess.Popen(argv, cwd=tmp_path, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    results = [(p.wait(timeout=GIVE_UP_S), *p.communicate()) for p in procs]
    return tmp_path / "spotjob-runs" / "counted", results


def test_two_runs_of_one_name_started_at_once_one_runs_and_the_other_is_refused_in_one_line(
    counted_twice: tuple[Path, list[tuple[int, str, str]]],
) -> None:
    run, results = counted_twice
    codes = sorted(code for code, _, _ in results)
    assert codes == [0, 2], [err[-3000:] for _, _, err in results]
    [(_, _, refused)] = [r for r in results if r[0] == 2]
    assert not any(p in refused for p in FORBIDDEN), refused
    assert "a run named 'counted' exists" in refused or "'counted' is being driven by another spotjob run" in refused
    assert len(refused.strip().splitlines()) == 1, refused
    status = job_document(run)["status"]
    assert status["phase"] == "Succeeded" and status["attempt"]["number"] == 0


def test_the_summary_counts_every_commit_even_when_they_come_faster_than_anyone_looks(
    counted_twice: tuple[Path, list[tuple[int, str, str]]],
) -> None:
    run, results = counted_twice
    assert [code for code, _, _ in results].count(0) == 1, [err[-3000:] for _, _, err in results]
    [(_, stdout, stderr)] = [r for r in results if r[0] == 0]

    logged = commits_logged(run)
    assert logged == 12, "a save every step"
    summary = json.loads((run / "summary.json").read_text())
    assert (summary["commits"], summary["last_checkpoint"]) == (12, 12)
    assert "checkpoints      12 committed; last: step 12" in stdout
    assert "None" not in stdout
    assert "a save that never finished" not in stderr, "a save in progress is not a failed one"


# -- ranks that never meet ------------------------------------------------------------------------


def test_ranks_that_never_meet_are_told_as_ranks_not_meeting_while_the_job_stays_pending(tmp_path: Path) -> None:
    """The script's ranks wait in init_process_group for a rank that never comes. Before, the run
    said only "Pending" until torch's timeout (the agent's warning stayed in the worker's log);
    now the agent's warning reaches the job: ``status.attempt.notStarting`` (RanksNotMeeting, with
    the agent's words) and one WorkerNotStarting Warning Event, the job still Pending."""
    run = tmp_path / "spotjob-runs" / "stuck"
    argv = [tool("spotjob"), "run", "--no-live", "--name", "stuck", str(REPO / "tests/e2e/scripts/never_meet.py")]
    driver = start_driver(tmp_path, argv, env=clean_env(SPOTJOB_AGENT_RANK_CONNECT_TIMEOUT="0.5"))
    key = JobKey("local", "stuck")

    def told() -> bool:
        assert driver.poll() is None, (tmp_path / "driver.log").read_text()[-4000:]
        return any(e.reason == "WorkerNotStarting" for e in read_events(events_path(str(run), key)))

    try:
        wait_for(told, "the WorkerNotStarting Event")
        status = job_document(run)["status"]
        stuck = status["attempt"]["notStarting"]
        assert status["phase"] == "Pending" and stuck["worker"] == "stuck-0-0" and stuck["reason"] == "RanksNotMeeting"
        assert "no rank has connected" in stuck["message"] and "They meet at 127.0.0.1:" in stuck["message"]
        event = next(e for e in read_events(events_path(str(run), key)) if e.reason == "WorkerNotStarting")
        assert event.type == "Warning" and "stuck-0-0 of attempt 0 is not starting: RanksNotMeeting" in event.message
        driver.send_signal(signal.SIGTERM)
        assert driver.wait(timeout=GIVE_UP_S) == 130
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait()
