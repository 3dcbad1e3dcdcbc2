"""Ctrl-C and SIGTERM to ``spotjob run``, end to end with real ``spotjob run`` processes and ranks.

- The first Ctrl-C flushes: every training worker's agent is asked to flush (the control API's
  ``POST /flush``, as for a preemption), the step the ranks reached is committed, then every process
  stops (130); the Event and the status name the step, and ``--resume`` carries on from it to the
  end, bit-identical to a run never stopped. It used to stop everything at once, losing every step
  since the newest commit (here: all of them, the run commits only on a flush).
  The interrupt ends the attempt as a restart asked for (``Reconciler.driver_stopped``), which
  ``--resume`` carries on from: no preemption counted (it used to find the gang gone, ``WorkerLost``,
  and count one), no restart of ``--max-restarts``, the next attempt numbered on, and ``spotjob
  status`` and the summary say so.
- A training that finishes during the interrupt's flush (every worker exits 0: the ranks hold after
  their last step, ``scripts/hold_step.py --hold-at-end``, until the flush was asked for) is a
  finished run: Succeeded (``Completed``), exit 0, its summary, a line saying the interrupt came as
  it finished. It used to exit 130 as interrupted, its status Running, for ``--resume`` to train
  again from the newest checkpoint.
- A script that fails by itself while the interrupt's flush is asked for (its ranks raise:
  ``scripts/hold_step.py --fail-after-hold``; the agent exits 76, saying the command ended) is that
  failure, as without the interrupt: a restart of ``--max-restarts`` (``WorkerFailed``), ``--resume``
  starting the next attempt after it, exit 130 still; with no restart left the run is Failed and
  ``spotjob run`` ends as a failed run (1). It used to be a restart asked for, costing nothing.
  That failed run's Event ``InterruptedAtFailure`` and the line before its last ones say the
  interrupt came as the script failed, and, as after any failure, the end of the worker's log and
  how a new run carries on from the newest checkpoint, no ``--resume``: the interrupt used to go
  untold (the run's Events named only the failure), and the log was left out (its agent exited 76).
- A second Ctrl-C while that flush runs stops every process at once, without waiting for it: the
  ranks are held inside a step (``scripts/hold_step.py``), so that the flush cannot commit first.
- A SIGTERM that comes while the run is paused (Ctrl-Z), and the SIGCONT after it (as bash's ``kill``
  of a stopped job and systemd send), flushes as any first one does: the driver's Ctrl-Z handler,
  which the interrupt's ``KeyboardInterrupt`` left as the driver went on, left its workers stopped,
  so their agents could not answer the flush (``POST /flush`` timed out) and every step was lost.
- An agent that does not answer the interrupt's ``POST /flush`` within the request's timeout (here
  stopped for a while, as one on a loaded machine can be slow) is asked again while its worker runs
  and the flush's deadline is ahead, as the reconciler asks again at its next pass: that one
  request used to be all it got, and every step since the newest commit was lost.
- Ctrl-C or SIGTERM while ``--resume`` waits for the processes a killed driver left: exit 130 with a
  message saying what happens to them and how to carry on, the run unchanged; their flush still
  commits, and the next ``--resume`` carries on from it. SIGINT used to end it with no word, SIGTERM
  by the signal (143), before ``spotjob run``'s handlers were set.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "scripts"))
from local_run_support import (
    GIVE_UP_S,
    STEPS,
    TRAIN,
    assert_same_final_state,
    clean_env,
    job_document,
    process_states,
    tool,
    wait_for,
)
from status_in_process import spotjob_status

from agent.catalog import list_checkpoints
from agent.storage import open_storage
from orchestrator.backends.local_cloud import run_pids
from orchestrator.events import events_path, read_events
from orchestrator.model import JobKey

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

SCRIPTS = Path(__file__).resolve().parent / "scripts"
HOLD_STEP = SCRIPTS / "hold_step.py"
FORBIDDEN = ("Traceback", "Input should be", "Value error")


def exited_130(code: int | None, said: str) -> None:
    """The driver exited 130 (interrupted), and its log holds none of ``FORBIDDEN``."""
    assert code == 130, said[-6000:]
    assert not any(p in said for p in FORBIDDEN), said[-6000:]


def events(run: Path) -> list[Any]:
    return read_events(events_path(str(run), JobKey.local(run.name)))


def start(tmp_path: Path, argv: list[str], log: str = "driver.log", **popen: Any) -> subprocess.Popen[bytes]:
    """``spotjob run`` in the background, its output in ``log``."""
    with open(tmp_path / log, "wb") as out:
        return subprocess.Popen(argv, cwd=tmp_path, env=clean_env(), stdout=out, stderr=subprocess.STDOUT, **popen)


def until_exit(driver: subprocess.Popen[bytes]) -> int:
    return driver.wait(timeout=GIVE_UP_S)


def kill_left(run: Path, *drivers: subprocess.Popen[bytes]) -> None:
    for driver in drivers:
        if driver.poll() is None:
            driver.kill()
            driver.wait()
    for pid in run_pids(str(run)):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def running(driver: subprocess.Popen[bytes], run: Path, log: Path) -> Callable[[], bool]:
    def check() -> bool:
        assert driver.poll() is None, log.read_text()[-4000:]
        return (job_document(run).get("status") or {}).get("phase") == "Running"

    return check


def steps_reported(run: Path) -> int:
    """The highest step the ranks of the run wrote in their control folders."""
    steps = [0]
    for path in (run / "nodes").glob("*/*/status.json"):
        try:
            steps.append(int(json.loads(path.read_text()).get("step") or 0))
        except (OSError, ValueError):
            continue  # between its writes: the next look reads it
    return max(steps)


def test_the_first_ctrl_c_flushes_the_step_reached_then_stops_and_resume_carries_on_from_it(
    tmp_path: Path, uninterrupted: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "spotjob-runs" / "once"
    log = tmp_path / "driver.log"
    # No --every-steps: the run commits only on a flush, so every step it trained rides on that flush.
    argv = [
        tool("spotjob"), "run", "--no-live", "--name", "once",
        str(TRAIN), "--steps", str(STEPS), "--step-sleep", "0.3", "--dump", str(tmp_path / "final"),
    ]  # fmt: skip
    driver = start(tmp_path, argv)
    try:
        wait_for(running(driver, run, log), "the run to train")
        wait_for(lambda: steps_reported(run) >= 5, "five steps")
        reached = steps_reported(run)
        assert driver.poll() is None, "the run ended before it was interrupted: give it more steps"
        driver.send_signal(signal.SIGINT)
        code = until_exit(driver)
    finally:
        kill_left(run, driver)
    said = log.read_text()
    exited_130(code, said)
    assert "SIGINT: flushing a checkpoint of once before stopping it" in said
    assert "Ctrl-C (or SIGTERM) again stops it at once, without the flush" in said
    assert not run_pids(str(run)), "every process of the run is stopped"

    # What committed: one checkpoint, the flush's, at the step reached or after.
    [checkpoint] = [c for c in list_checkpoints(open_storage(str(run / "checkpoints"))) if c.valid]
    step = checkpoint.ref.step
    assert checkpoint.manifest is not None and checkpoint.manifest.trigger == "flush"
    assert reached <= step < STEPS
    assert f"exiting 75: the flush committed step {step}" in (run / "logs" / "once-0-0.log").read_text()
    [told] = [e for e in events(run) if e.reason == "InterruptFlushCommitted"]
    assert f"SIGINT interrupted spotjob run (pid {driver.pid}): the flush it asked for committed step {step}" in (
        told.message
    )
    assert f"--resume carries on from step {step}" in told.message
    assert f"spotjob run: interrupted; the flush committed step {step}, then every process of once was stopped" in (
        said
    )
    # The attempt ended as a restart asked for, which --resume starts: not a preemption.
    stopped = job_document(run)["status"]
    assert stopped["lastCheckpoint"]["step"] == step
    assert (stopped["phase"], stopped["reason"]) == ("Rescheduling", "InterruptFlushCommitted")
    assert (stopped["preemptions"], stopped["restarts"], stopped["attempt"]["number"]) == (0, 0, 1)
    assert [(h["attempt"], h["cause"], h["reason"]) for h in stopped["restartHistory"]] == [
        (0, "Requested", "InterruptFlushCommitted")
    ]
    assert "spotjob run once: Rescheduling" in said and "0 (notices sent: 0)" in said
    monkeypatch.chdir(tmp_path)  # where spotjob run was started
    detail = spotjob_status(capsys, "once")
    assert detail.returncode == 0, detail.stderr
    assert "Rescheduling" in detail.stdout and "InterruptFlushCommitted" in detail.stdout
    assert "preemptions 0, restarts 0" in detail.stdout and "not started yet" in detail.stdout

    resumed = subprocess.run(
        [tool("spotjob"), "run", "--no-live", "--resume", "once"],
        cwd=tmp_path,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=GIVE_UP_S * 2,
    )
    assert resumed.returncode == 0, resumed.stderr[-6000:]
    status = job_document(run)["status"]
    assert status["phase"] == "Succeeded" and status["attempt"]["resumedFromStep"] == step
    assert status["lostSteps"] == 0, "the flush took every step the ranks had trained"
    # An interrupt is no preemption and uses none of --max-restarts; the attempts are numbered on.
    assert (status["preemptions"], status["restarts"], status["attempt"]["number"]) == (0, 0, 1)
    assert [(h["attempt"], h["cause"], h["reason"]) for h in status["restartHistory"]] == [
        (0, "Requested", "InterruptFlushCommitted")
    ]
    reasons = [e.reason for e in events(run)]
    assert "WorkerLost" not in reasons and "AgentPreempted" not in reasons, reasons
    [took_over] = [e for e in events(run) if e.reason == "Resumed"]
    assert (
        f"the previous driver (pid {driver.pid}) was interrupted and stopped every process of the run "
        f"(InterruptFlushCommitted); the newest checkpoint it recorded is step {step}" in took_over.message
    )
    assert reasons.index("InterruptFlushCommitted") < reasons.index("Resumed") < reasons.index("Completed")
    summary = json.loads((run / "summary.json").read_text())
    assert (summary["preemptions"], summary["restarts"], summary["attempts"]) == (0, 0, 2)
    assert "preemptions      0 (notices sent: 0)" in resumed.stdout
    detail = spotjob_status(capsys, "once")
    assert detail.returncode == 0, detail.stderr
    assert "preemptions 0, restarts 0, steps lost 0" in detail.stdout
    assert "attempt" in detail.stdout and f"1, resumed from step {step}" in detail.stdout
    assert_same_final_state(tmp_path / "final", uninterrupted)


def _held_run(tmp_path: Path, name: str) -> tuple[Path, Path, list[str]]:
    """A run of ``hold_step.py`` on one rank whose ranks will hold in step 10 (its hold file made)."""
    hold = tmp_path / "hold"
    hold.touch()
    argv = [tool("spotjob"), "run", "--no-live", "--name", name, "--nproc", "1", str(HOLD_STEP), "--hold", str(hold)]
    return tmp_path / "spotjob-runs" / name, hold, argv


def test_a_training_that_finishes_during_the_interrupts_flush_is_a_finished_run(tmp_path: Path) -> None:
    run, hold, argv = _held_run(tmp_path, "done")
    argv.append("--hold-at-end")
    log = tmp_path / "driver.log"
    driver = start(tmp_path, argv)
    try:
        wait_for(running(driver, run, log), "the run to train")
        wait_for(lambda: Path(f"{hold}.held").exists(), "the ranks to end their last step")
        driver.send_signal(signal.SIGINT)
        wait_for(lambda: "asked the agent of done-0-0 to flush (accepted)" in log.read_text(), "the flush request")
        # Asked to flush, the ranks have no step left to serve it: they finish, and every worker exits 0.
        hold.unlink()
        code = until_exit(driver)
    finally:
        kill_left(run, driver)
    said = log.read_text()
    assert code == 0, said[-6000:]
    assert not any(p in said for p in FORBIDDEN), said[-6000:]
    assert "exiting 0" in (run / "logs" / "done-0-0.log").read_text()
    assert not run_pids(str(run)), "every process of the run is stopped"
    status = job_document(run)["status"]
    assert (status["phase"], status["reason"]) == ("Succeeded", "Completed")
    assert (status["preemptions"], status["restarts"], status["restartHistory"]) == (0, 0, [])
    reasons = [e.reason for e in events(run)]
    assert not [r for r in reasons if r.startswith("Interrupt") and r != "InterruptedAtCompletion"], reasons
    [told] = [e for e in events(run) if e.reason == "InterruptedAtCompletion"]
    assert f"SIGINT interrupted spotjob run (pid {driver.pid}) as the training finished: every worker exited 0" in (
        told.message
    )
    assert reasons.index("Completed") < reasons.index("InterruptedAtCompletion")
    # Its usual summary, and a line for the interrupt; not "interrupted ... carry on with --resume".
    assert "spotjob run done: Succeeded" in said and "outcome          Succeeded (Completed)" in said
    assert "spotjob run: the interrupt (SIGINT) came as done finished: every worker exited 0" in said
    assert "--resume" not in said
    assert json.loads((run / "summary.json").read_text())["phase"] == "Succeeded"
    again = subprocess.run(
        [tool("spotjob"), "run", "--resume", "done"], cwd=tmp_path, env=clean_env(), capture_output=True, text=True
    )
    assert again.returncode == 2 and "succeeded already" in again.stderr, again.stderr


def test_a_second_ctrl_c_during_the_flush_stops_every_process_at_once_without_it(tmp_path: Path) -> None:
    run, hold, argv = _held_run(tmp_path, "twice")
    log = tmp_path / "driver.log"
    driver = start(tmp_path, argv)
    try:
        wait_for(running(driver, run, log), "the run to train")
        wait_for(lambda: Path(f"{hold}.held").exists(), "the ranks to hold in their step")
        driver.send_signal(signal.SIGINT)
        # The driver says it flushes before it asks the agent, and logs the agent's answer after:
        # wait for the answer (the second signal must come while the flush is under way).
        wait_for(lambda: "asked the agent of twice-0-0 to flush" in log.read_text(), "the agent's answer")
        said = log.read_text()
        assert "flushing a checkpoint of twice" in said, said
        assert "asked the agent of twice-0-0 to flush (accepted)" in said, said
        driver.send_signal(signal.SIGINT)
        code = until_exit(driver)
    finally:
        kill_left(run, driver)
    said = log.read_text()
    exited_130(code, said)
    assert "received SIGINT again: stopping every process of twice at once, without the flush" in said
    assert not run_pids(str(run)), "every process of the run is stopped"
    # Held in its step all along, the flush never ran: the driver stopped the agent and its ranks
    # rather than wait for the flush's deadline, when the agent would have stopped them itself.
    assert hold.exists()
    assert not [c for c in list_checkpoints(open_storage(str(run / "checkpoints"))) if c.valid]
    agent_log = (run / "logs" / "twice-0-0.log").read_text()
    assert "flush asked through the control API: spotjob run was interrupted (SIGINT)" in agent_log
    assert "the deadline passed" not in agent_log, agent_log[-3000:]
    [told] = [e for e in events(run) if e.reason.startswith("Interrupt")]
    assert told.reason == "InterruptFlushNotCommitted" and told.type == "Warning"
    assert "the flush committed nothing (a second SIGINT stopped the run at once)" in told.message
    assert "--resume carries on from the start (no checkpoint)" in told.message
    assert (
        "spotjob run: interrupted; the flush committed nothing (a second SIGINT stopped the run at once); every "
        "process of twice was stopped" in said
    )


def _the_interrupts_flush_committed(run: Path, said: str) -> tuple[int, Any]:
    """The run's one valid checkpoint is a flush's, its interrupt Event says it committed, and so
    does the driver's last line: that checkpoint's step and the Event."""
    [checkpoint] = [c for c in list_checkpoints(open_storage(str(run / "checkpoints"))) if c.valid]
    assert checkpoint.manifest is not None and checkpoint.manifest.trigger == "flush"
    [told] = [e for e in events(run) if e.reason.startswith("Interrupt")]
    assert told.reason == "InterruptFlushCommitted", told.message
    assert f"spotjob run: interrupted; the flush committed step {checkpoint.ref.step}" in said
    return checkpoint.ref.step, told


def _endless(tmp_path: Path, name: str, **popen: Any) -> tuple[Path, Path, subprocess.Popen[bytes]]:
    """A one-rank run that trains until it is stopped and commits only on a flush (no
    --every-steps), started in the background: its folder, the driver's log, the driver."""
    argv = [
        tool("spotjob"), "run", "--no-live", "--name", name, "--nproc", "1",
        str(TRAIN), "--steps", "100000", "--step-sleep", "0.1",
    ]  # fmt: skip
    return tmp_path / "spotjob-runs" / name, tmp_path / "driver.log", start(tmp_path, argv, **popen)


def test_a_sigterm_that_comes_while_the_run_is_paused_flushes_once_the_run_goes_on(tmp_path: Path) -> None:
    # As a terminal starts it: Ctrl-Z not ignored.
    run, log, driver = _endless(tmp_path, "paused", preexec_fn=lambda: signal.signal(signal.SIGTSTP, signal.SIG_DFL))

    try:
        wait_for(running(driver, run, log), "the run to train")
        wait_for(lambda: steps_reported(run) >= 3, "three steps")
        driver.send_signal(signal.SIGTSTP)
        wait_for(
            lambda: process_states(driver, run) == {psutil.STATUS_STOPPED},
            "the driver and every process of its run stopped",
        )
        # A supervisor's stop of a paused process: the signal, then SIGCONT so that it is handled.
        driver.send_signal(signal.SIGTERM)
        driver.send_signal(signal.SIGCONT)
        code = until_exit(driver)
    finally:
        kill_left(run, driver)
    said = log.read_text()
    exited_130(code, said)
    assert not run_pids(str(run)), "every process of the run is stopped"
    agent_log = (run / "logs" / "paused-0-0.log").read_text()
    assert "timed out" not in said, f"{said[-5000:]}\n--- the agent's log:\n{agent_log[-5000:]}"
    step, told = _the_interrupts_flush_committed(run, said)
    assert f"the flush it asked for committed step {step}" in told.message


def test_an_agent_that_does_not_answer_the_interrupts_flush_in_time_is_asked_again(tmp_path: Path) -> None:
    run, log, driver = _endless(tmp_path, "slow")
    asked_again = "asking the agent of slow-0-0 to flush again"
    try:
        wait_for(running(driver, run, log), "the run to train")
        wait_for(lambda: steps_reported(run) >= 3, "three steps")
        [agent] = [p for p in map(psutil.Process, run_pids(str(run))) if "spotjob-agent" in " ".join(p.cmdline())]
        # Stopped, the agent answers nothing within the request's timeout (5 s), as an agent on a
        # machine loaded enough may not: the interrupt's one request used to be all it got.
        agent.suspend()
        driver.send_signal(signal.SIGINT)
        wait_for(lambda: asked_again in log.read_text() or driver.poll() is not None, "the request asked again")
        with contextlib.suppress(psutil.NoSuchProcess):
            agent.resume()
        code = until_exit(driver)
    finally:
        kill_left(run, driver)
    said = log.read_text()
    exited_130(code, said)
    assert f"{asked_again} (POST /flush to the agent of slow-0-0 failed: timed out)" in said, said[-6000:]
    assert not run_pids(str(run)), "every process of the run is stopped"
    _the_interrupts_flush_committed(run, said)


def _fails_during_the_flush(
    tmp_path: Path, name: str, *options: str, committed: int | None = None
) -> tuple[Path, int, str]:
    """Interrupt a held run (once its checkpoint of step ``committed`` is valid, if given), then let
    its ranks go to fail (raise) while the flush is asked for; (run folder, exit status, what the
    driver said)."""
    run, hold, argv = _held_run(tmp_path, name)
    fail = tmp_path / "fail"
    argv = [*argv[:2], *options, *argv[2:], "--fail-after-hold", str(fail)]  # spotjob run's options first
    log = tmp_path / "driver.log"
    driver = start(tmp_path, argv)
    try:
        wait_for(running(driver, run, log), "the run to train")
        wait_for(lambda: Path(f"{hold}.held").exists(), "the ranks to hold in their step")
        if committed is not None:
            storage = open_storage(str(run / "checkpoints"))

            def valid() -> bool:
                return any(c.valid and c.ref.step == committed for c in list_checkpoints(storage))

            wait_for(valid, f"the checkpoint of step {committed} to commit")
        driver.send_signal(signal.SIGINT)
        wait_for(lambda: f"asked the agent of {name}-0-0 to flush (accepted)" in log.read_text(), "the flush request")
        fail.touch()
        hold.unlink()  # the ranks raise: the script fails by itself while its flush is asked for
        code = until_exit(driver)
    finally:
        kill_left(run, driver)
    fail.unlink()
    said = log.read_text()
    assert not run_pids(str(run)), "every process of the run is stopped"
    assert "fails after the hold in step 10, as asked" in (run / "logs" / f"{name}-0-0.log").read_text()
    return run, code, said


def test_a_script_that_fails_during_the_interrupts_flush_is_that_failure_and_resume_restarts_after_it(
    tmp_path: Path,
) -> None:
    run, code, said = _fails_during_the_flush(tmp_path, "crash")
    # Still an interrupt (130, carry on with --resume), but the attempt ended as the crash it was: a
    # restart of --max-restarts, as without the interrupt. It used to be a restart asked for.
    exited_130(code, said)
    status = job_document(run)["status"]
    assert (status["phase"], status["reason"]) == ("Rescheduling", "InterruptFlushNotCommitted")
    assert (status["preemptions"], status["restarts"], status["attempt"]["number"]) == (0, 1, 1)
    assert [(h["attempt"], h["cause"], h["reason"]) for h in status["restartHistory"]] == [
        (0, "Failure", "WorkerFailed")
    ]
    [told] = [e for e in events(run) if e.reason.startswith("Interrupt")]
    assert told.reason == "InterruptFlushNotCommitted"
    assert "the script of crash-0-0 failed during the flush, a failure of the script (exit 76" in told.message
    [failed] = [e for e in events(run) if e.reason == "WorkerFailed"]
    assert "worker crash-0-0 exited with code 76; restart 1 of 3" in failed.message
    assert "the command ended before its ranks reported one" in failed.message
    assert "spotjob run: interrupted; the flush committed nothing (the script of crash-0-0 failed during" in said

    resumed = subprocess.run(
        [tool("spotjob"), "run", "--no-live", "--resume", "crash"],
        cwd=tmp_path,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=GIVE_UP_S * 2,
    )
    assert resumed.returncode == 0, resumed.stderr[-6000:]
    status = job_document(run)["status"]
    assert status["phase"] == "Succeeded"
    assert (status["preemptions"], status["restarts"], status["attempt"]["number"]) == (0, 1, 1)


@pytest.mark.parametrize("every_steps", [None, 4], ids=["no-checkpoint", "checkpoint"])
def test_a_script_that_fails_during_the_interrupts_flush_with_no_restart_left_is_a_failed_run(
    tmp_path: Path, every_steps: int | None, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    saves = ["--every-steps", str(every_steps)] if every_steps is not None else []
    # With --every-steps 4 the ranks held in step 10 committed steps 4 and 8 before it.
    newest = 8 if every_steps is not None else None
    run, code, said = _fails_during_the_flush(tmp_path, "spent", "--max-restarts", "0", *saves, committed=newest)
    # Failed, as the crash would leave it without the interrupt: nothing is left to resume, so it
    # ends as a failed run does (1, why, the end of the log), not as an interrupt to carry on from.
    assert code == 1, said[-6000:]
    # (the script's own traceback, in the end of its log, is indented: spotjob's would not be)
    assert not any(p in line for line in said.splitlines() if not line.startswith("  ") for p in FORBIDDEN), said
    status = job_document(run)["status"]
    assert (status["phase"], status["reason"]) == ("Failed", "RestartBudgetExhausted")
    assert (status["preemptions"], status["restarts"]) == (0, 0)
    assert "interrupted;" not in said and "--resume" not in said, said[-6000:]
    # The interrupt is told, in an Event and in the last lines, as what ended in the failure: it
    # used to go untold (the reconciler's pass told only the failure), and the failed worker's log
    # (its agent exited 76) was not shown.
    uri = str(run / "checkpoints")
    hand_over = f"`spotjob ckpt adopt {uri} --job local/NEW`, then `spotjob run --name NEW --checkpoint-uri {uri}"
    reasons = [e.reason for e in events(run)]
    assert not [r for r in reasons if r.startswith("Interrupt") and r != "InterruptedAtFailure"], reasons
    assert reasons.index("RestartBudgetExhausted") < reasons.index("InterruptedAtFailure")
    [told] = [e for e in events(run) if e.reason == "InterruptedAtFailure"]
    assert told.type == "Warning"
    assert re.match(
        r"SIGINT interrupted spotjob run \(pid \d+\) as the script of spent-0-0 failed by itself; the flush "
        r"committed nothing\. With no restart of --max-restarts left, that failure ended the run: Failed "
        r"\(RestartBudgetExhausted\), and a failed run is not resumed; ",
        told.message,
    ), told.message
    if newest is None:
        assert told.message.endswith("it committed no checkpoint to carry on from"), told.message
        assert "the newest checkpoint" not in said
    else:
        assert f"its newest checkpoint, step {newest}, stays in {uri}: to carry on from it once the script is" in (
            told.message
        )
        assert hand_over in told.message
    lines = said[said.index("\nspotjob run: the interrupt") + 1 :].splitlines()
    assert lines[:3] == [
        "spotjob run: the interrupt (SIGINT) came as the script of spent-0-0 failed by itself; the flush committed "
        "nothing; that failure ended spent: it failed, and a failed run is not resumed",
        lines[1],
        f"the end of {run / 'logs' / 'spent-0-0.log'}:",
    ], said[-6000:]
    assert lines[1].startswith(
        "spotjob run: spent failed: RestartBudgetExhausted: worker spent-0-0 exited with code 76"
    )
    assert any("fails after the hold in step 10, as asked" in line for line in lines[3:]), said[-6000:]
    if newest is None:
        assert lines[-1].startswith("  "), lines[-1]  # the log's end: nothing to carry on from
    else:
        assert lines[-1].startswith(f"spotjob run: the newest checkpoint of spent, step {newest}, stays in {uri}")
        assert hand_over in lines[-1]
    # `spotjob status NAME` shows the end of that log too: its agent's 76 says the command ended by
    # itself during the flush, so the log tells why (status used to leave every 76's log out).
    monkeypatch.chdir(tmp_path)  # where spotjob run was started
    detail = spotjob_status(capsys, "spent")
    assert detail.returncode == 0, detail.stderr
    shown = " ".join(detail.stdout.split())  # the terminal's width may fold the path
    assert f"the end of {run / 'logs' / 'spent-0-0.log'}:" in shown, detail.stdout
    assert "fails after the hold in step 10, as asked" in shown, detail.stdout


def test_an_agents_flush_for_a_maintenance_only_it_heard_met_by_the_interrupt_is_the_preemption_it_was(
    tmp_path: Path,
) -> None:
    """A planned host maintenance (GCE ``TERMINATE_ON_HOST_MAINTENANCE``) is the agent's alone: no
    backend signal. Its agent holds it, then flushes for it while the ranks are held in a step; the
    Ctrl-C comes then, and its ``POST /flush`` meets that flush under way (no second flush). Once
    the ranks are let go the agent exits 75 for the maintenance, and its exit line says so. That 75
    used to be counted as the interrupt's own flush: a restart asked for, no preemption. It is the
    preemption that came first, as without the interrupt: counted (``AgentPreempted``), still 130,
    and ``--resume`` carries on from the flush."""
    run, hold, argv = _held_run(tmp_path, "maint")
    # The maintenance is announced once step 5 is seen; its flush starts 10 s later (60 - 50), with
    # the ranks held in step 10 by then, and the node stops 60 s after the notice.
    options = ["--maintenance-at-step", "5", "--maintenance-notice", "60", "--flush-lead", "50"]
    argv = [*argv[:2], *options, *argv[2:]]  # spotjob run's options first
    log = tmp_path / "driver.log"
    agent_log = run / "logs" / "maint-0-0.log"
    driver = start(tmp_path, argv)
    try:
        wait_for(running(driver, run, log), "the run to train")
        wait_for(lambda: Path(f"{hold}.held").exists(), "the ranks to hold in their step")
        wait_for(
            lambda: agent_log.exists() and "requested: gcp maintenance: " in agent_log.read_text(),
            "the agent to flush for the maintenance it held",
        )
        assert driver.poll() is None and hold.exists()
        driver.send_signal(signal.SIGINT)
        wait_for(lambda: "asked the agent of maint-0-0 to flush (already flushing)" in log.read_text(), "the request")
        hold.unlink()  # the ranks go on and commit the maintenance's flush
        code = until_exit(driver)
    finally:
        kill_left(run, driver)
    said = log.read_text()
    exited_130(code, said)
    assert not run_pids(str(run)), "every process of the run is stopped"
    [checkpoint] = [c for c in list_checkpoints(open_storage(str(run / "checkpoints"))) if c.valid]
    step = checkpoint.ref.step
    # The agent's exit line names the notice its flush answered: the maintenance, not the request.
    [line] = [x for x in agent_log.read_text().splitlines() if "exiting 75: " in x]
    assert f"exiting 75: the flush committed step {step} at " in line, line
    assert "; the flush answered gcp maintenance: " in line, line
    assert "exited 75 for a flush of its own, not the interrupt's (it answered gcp maintenance: " in said
    # Counted as the preemption it was; the interrupt still ends the run's driving (130, --resume).
    status = job_document(run)["status"]
    assert (status["phase"], status["reason"]) == ("Rescheduling", "InterruptFlushCommitted")
    assert (status["preemptions"], status["restarts"]) == (1, 0)
    assert [(h["attempt"], h["cause"], h["reason"]) for h in status["restartHistory"]] == [
        (0, "Preemption", "AgentPreempted")
    ]
    assert status["lastCheckpoint"]["step"] == step
    [preempted] = [e for e in events(run) if e.reason == "AgentPreempted"]
    assert "the agent of maint-0-0 on node local-node-0 heard a notice itself and exited 75 (its flush answered " in (
        preempted.message
    )
    assert "gcp maintenance: " in preempted.message
    # The interrupt's Event says whose flush committed the step: not one the driver asked for.
    [told] = [e for e in events(run) if e.reason == "InterruptFlushCommitted"]
    assert (
        f"the flush maint-0-0's agent began for a notice of its own (met by the interrupt's) committed step {step}"
        in (told.message)
    ), told.message
    assert f"spotjob run: interrupted; the flush committed step {step}" in said


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_an_interrupt_during_resumes_wait_for_a_killed_drivers_processes_leaves_the_run_resumable(
    tmp_path: Path, signum: int
) -> None:
    run, hold, argv = _held_run(tmp_path, "waited")
    first = start(tmp_path, argv)
    resume = [tool("spotjob"), "run", "--no-live", "--resume", "waited"]
    waiter = None
    try:
        wait_for(running(first, run, tmp_path / "driver.log"), "the run to train")
        wait_for(lambda: Path(f"{hold}.held").exists(), "the ranks to hold in their step")
        # Killed: its agent flushes by itself (--exit-with-parent), which the held ranks keep from
        # committing until the hold is lifted; meanwhile --resume waits for them.
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=30)
        waiter = start(tmp_path, resume, "resume.log")
        waiting = tmp_path / "resume.log"
        wait_for(lambda: "waiting up to 45 s for their flush" in waiting.read_text(), "--resume to wait")
        before = job_document(run)
        waiter.send_signal(signum)
        code = until_exit(waiter)
        said = waiting.read_text()
        exited_130(code, said)
        assert "process(es) the previous driver of waited left: their agents go on with the flush" in said
        assert "Nothing of the run was changed: carry on with `spotjob run --resume waited`" in said
        assert job_document(run) == before, "an interrupted --resume changed the run"
        assert "Resumed" not in [e.reason for e in events(run)]

        # Left to end their flush (stopped, it would be lost), which commits once the hold is
        # lifted; then the run carries on from it.
        assert run_pids(str(run)), "the killed driver's processes were stopped before their flush"
        hold.unlink()
        wait_for(lambda: not run_pids(str(run)), "the killed driver's processes to stop")
        agent_log = (run / "logs" / "waited-0-0.log").read_text()
        flushed = re.findall(r"exiting 75: the flush committed step (\d+)", agent_log)
        assert flushed, agent_log[-4000:]
        carried = subprocess.run(
            resume, cwd=tmp_path, env=clean_env(), capture_output=True, text=True, timeout=GIVE_UP_S
        )
        assert carried.returncode == 0, carried.stderr[-6000:]
        status = job_document(run)["status"]
        assert status["phase"] == "Succeeded" and status["attempt"]["resumedFromStep"] == int(flushed[-1])
    finally:
        kill_left(run, first, *([waiter] if waiter is not None else []))


def _job_file_removed_while_it_trains(tmp_path: Path) -> tuple[Path, Path, int]:
    """Run "gone" trains three steps, then ``rm spotjob-runs/gone/local/gone.json``: its folder,
    the driver's log and the driver's exit code."""
    run, log, driver = _endless(tmp_path, "gone")
    try:
        wait_for(running(driver, run, log), "the run to train")
        wait_for(lambda: steps_reported(run) >= 3, "three steps")
        (run / "local" / "gone.json").unlink()
        code = until_exit(driver)
    finally:
        kill_left(run, driver)
    return run, log, code


def test_a_job_file_removed_while_the_run_goes_on_is_flushed_stopped_and_said_not_a_traceback(tmp_path: Path) -> None:
    """``rm spotjob-runs/NAME/local/NAME.json`` (or the whole folder) under a running run: the
    controller loop raised JobNotFoundError out of ``spotjob run`` (a traceback, exit 1) and the
    workers were stopped without a flush, losing the steps since the last checkpoint."""
    run, log, code = _job_file_removed_while_it_trains(tmp_path)
    said = log.read_text()
    assert code == 1 and "Traceback" not in said, said[-6000:]
    assert "gone.json was removed while the run went on, so the run cannot go on nor be resumed" in said, said[-4000:]
    [checkpoint] = [c for c in list_checkpoints(open_storage(str(run / "checkpoints"))) if c.valid]
    assert checkpoint.manifest is not None and checkpoint.manifest.trigger == "flush"
    assert f"committed step {checkpoint.ref.step}" in said and "spotjob ckpt adopt" in said
    assert not run_pids(str(run)), "a process of the run was left running"


def test_a_run_folder_whose_job_file_was_removed_is_no_free_name_and_status_lists_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Its job file removed, the run "can neither go on nor be resumed", yet ``spotjob run --name
    gone ...`` was not refused: it started in the old folder under the same job local/gone,
    restored the old run's checkpoint from the default URI and appended to its timeline, and
    ``spotjob status`` said there were no runs. Now the new run is refused (exit 2) naming the
    folder and what to do, nothing of the folder changes, and ``status`` lists it as unreadable."""
    run, log, code = _job_file_removed_while_it_trains(tmp_path)
    assert code == 1, log.read_text()[-4000:]
    timeline = (run / "timeline.jsonl").read_text()
    uri = run / "checkpoints"
    committed = [c.ref.step for c in list_checkpoints(open_storage(str(uri))) if c.valid]
    assert committed, log.read_text()[-4000:]

    again = subprocess.run(
        [tool("spotjob"), "run", "--no-live", "--name", "gone", "--nproc", "1", str(TRAIN), "--steps", "5"],
        cwd=tmp_path,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=GIVE_UP_S,
    )
    said = again.stderr
    assert again.returncode == 2, (again.stdout + said)[-6000:]
    assert f"a run named 'gone' was in {run}: its job file local/gone.json is gone, so the run can neither" in said
    assert "(its folder holds what it left: run.json, timeline.jsonl" in said, said
    assert "Pick another --name, or move that folder away (removed, its checkpoints in it go with it)" in said
    assert f"`spotjob ckpt adopt {uri} --job local/NEW`" in said, said
    assert (run / "timeline.jsonl").read_text() == timeline, "the refused run wrote in the old run's timeline"
    assert not (run / "local" / "gone.json").exists()
    assert [c.ref.step for c in list_checkpoints(open_storage(str(uri))) if c.valid] == committed

    runs = str(tmp_path / "spotjob-runs")
    listing = spotjob_status(capsys, "--runs-dir", runs)
    assert listing.returncode == 0 and "no runs under" not in listing.stdout, listing
    [line] = [x for x in listing.stdout.splitlines() if "gone" in x]
    assert "unreadable" in line, listing.stdout
    detail = spotjob_status(capsys, "--runs-dir", runs, "gone")
    assert detail.returncode == 0 and "can neither go on nor be resumed" in detail.stdout, detail
    resumed = subprocess.run(
        [tool("spotjob"), "run", "--no-live", "--resume", "gone"],
        cwd=tmp_path,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=GIVE_UP_S,
    )
    assert resumed.returncode == 2 and "can neither go on nor be resumed" in resumed.stderr, resumed.stderr
