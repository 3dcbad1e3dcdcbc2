"""spotjob-agent end to end with real processes: the agent, a fake torchrun and its fake ranks.

Every notice source in turn (AWS, GCP and Azure emulators, SIGTERM, POST /flush) must end in a
committed flush and exit 75; a failed flush exits 76; a job that ends by itself keeps its code;
and no process of the job outlives the agent. ``fake_ranks.py`` talks to the agent through the
control folder only, exactly as ``Checkpointer`` does. Loopback only; no torch.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from agent import control_api
from agent.control_channel import EXIT_FLUSH_FAILED, EXIT_INFRA_ERROR, EXIT_PREEMPTED, EXIT_STOPPED, ControlDir
from agent.exit_codes import COMMAND_ENDED_DURING_FLUSH, answered_source, exit_words, flush_answered
from agent.notices.emulators import AzureScheduledEventsEmulator, GceMetadataEmulator, ImdsEmulator
from agent.process_tree import ENV_AGENT_ID, all_processes, read_proc

FAKE_RANKS = Path(__file__).with_name("fake_ranks.py")
WAIT = 30.0
TOKEN = "integration-test-token"


def agent_command() -> list[str]:
    script = shutil.which("spotjob-agent", path=str(Path(sys.executable).parent))
    return [script] if script else [sys.executable, "-m", "agent.launcher"]


def wait_until(predicate: Callable[[], bool], what: str, run: Run | None = None, timeout: float = WAIT) -> None:
    give_up = time.monotonic() + timeout
    while not predicate():
        if run is not None and run.proc.poll() is not None:
            raise AssertionError(f"the agent exited {run.proc.returncode} while waiting for {what}\n{run.log()}")
        if time.monotonic() > give_up:
            raise AssertionError(f"timed out waiting for {what}" + (f"\n{run.log()}" if run else ""))
        time.sleep(0.02)


def marked_processes(agent_id: str) -> list[int]:
    """Live processes carrying this agent's marker: the job's, wherever they were re-parented."""
    marker = f"{ENV_AGENT_ID}={agent_id}".encode()
    out = []
    for p in all_processes():
        if p.state == "Z":
            continue
        try:
            with open(f"/proc/{p.pid}/environ", "rb") as f:
                if marker in f.read().split(b"\0"):
                    out.append(p.pid)
        except OSError:
            continue
    return out


@dataclass
class Run:
    proc: subprocess.Popen[bytes]
    control: ControlDir
    log_path: Path
    tmp: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def kill(self) -> None:
        """SIGKILL the agent if it still runs, then whatever of its command it left running: the
        command's ranks run in sessions of their own and outlive a killed agent, so they are found
        by its marker."""
        ident = ""
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            ident = str(json.loads((Path(self.control.path) / "agent.json").read_text())["agent_id"])
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for pid in marked_processes(ident) if ident else []:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def agent_info(self) -> dict[str, Any]:
        path = Path(self.control.path) / "agent.json"
        wait_until(path.exists, "agent.json", self)
        return dict(json.loads(path.read_text()))

    def wait_training(self, steps: int = 3, timeout: float = WAIT) -> None:
        def training() -> bool:
            status = self.control.status()
            return status is not None and (status.step or 0) >= steps

        wait_until(training, f"rank 0 at step {steps}", self, timeout=timeout)

    def signal(self, sig: signal.Signals) -> None:
        os.kill(self.proc.pid, sig)

    def post_flush(self, body: dict[str, Any], token: str | None = None) -> tuple[int, dict[str, Any]]:
        return self.post("/flush", body, token)

    def post(self, path: str, body: dict[str, Any], token: str | None = None) -> tuple[int, dict[str, Any]]:
        headers = {"Content-Type": "application/json"}
        if token is not None:
            headers["Authorization"] = f"Bearer {token}"
        req = urllib.request.Request(
            self.agent_info()["url"] + path, method="POST", headers=headers, data=json.dumps(body).encode()
        )
        try:
            with urllib.request.urlopen(req, timeout=10) as resp:
                return resp.status, json.loads(resp.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    def exit_code(self) -> int:
        try:
            return self.proc.wait(timeout=WAIT)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the agent did not exit\n{self.log()}") from None

    def flush_reason(self) -> str:
        request = self.control.flush_request()
        assert request is not None, self.log()
        return request.reason


def starter(tmp_path: Path, runs: list[Run]) -> Callable[..., Run]:
    """Starts agents with their files under ``tmp_path``, each added to ``runs``."""

    def _start(
        *agent_args: str,
        mode: str = "flush",
        nproc: int = 2,
        fake_args: tuple[str, ...] = (),
        env: dict[str, str] | None = None,
        name: str = "",
    ) -> Run:
        """``name``: a second job on this machine, with a control folder, log and events of its own."""
        control = tmp_path / f"control{name}"
        command = [
            *agent_command(),
            "--checkpoint-uri", f"file://{tmp_path}/ckpt",
            "--job-name", "it",
            "--control-dir", str(control),
            "--control-port", "0",
            "--cloud", "none",
            "--kill-grace", "1",
            *agent_args,
            "--",
            sys.executable, str(FAKE_RANKS), "--nproc", str(nproc), "--mode", mode,
            "--events", str(tmp_path / f"events{name}"),
            *fake_args,
        ]  # fmt: skip
        full_env = {k: v for k, v in os.environ.items() if not k.startswith("SPOTJOB_")}
        full_env.update({"SPOTJOB_AGENT_POLL_INTERVAL": "0.05", **(env or {})})
        log_path = tmp_path / f"agent{name}.log"
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(command, env=full_env, stdout=log, stderr=subprocess.STDOUT)
        run = Run(proc, ControlDir(str(control)), log_path, tmp_path)
        runs.append(run)
        return run

    return _start


def kill_left_running(runs: list[Run]) -> None:
    for run in runs:
        if run.proc.poll() is None:
            run.kill()  # a job a test left running (the neighbour of a two-job test)


@pytest.fixture
def start(tmp_path: Path) -> Iterator[Callable[..., Run]]:
    runs: list[Run] = []
    yield starter(tmp_path, runs)
    kill_left_running(runs)


def events(run: Run) -> list[str]:
    path = run.tmp / "events"
    return path.read_text().splitlines() if path.exists() else []


def exit_75_words(run: Run) -> str:
    """The agent's own exit-75 words (text or JSON line), from ``exiting 75:`` on."""
    [words] = [w for line in run.log().splitlines() if (w := exit_words(line, EXIT_PREEMPTED))]
    return words


def assert_preempted(run: Run, source: str) -> None:
    code = run.exit_code()
    log = run.log()
    assert code == EXIT_PREEMPTED, log
    result = run.control.flush_result()
    assert result is not None and result.error is None and result.uri and result.step, log
    assert run.flush_reason().startswith(source), log
    # The exit line names what the flush answered (spotjob run tells its interrupt's own from it).
    words = exit_75_words(run)
    assert words.startswith(f"exiting 75: the flush committed step {result.step} at {result.uri}"), words
    assert flush_answered(words) == " ".join(run.flush_reason().split()), words
    assert "from notice to commit" in log
    assert [e for e in events(run) if e.startswith("flush")] == [f"flush {result.request_id}"]
    assert not (Path(run.control.path) / "agent.json").exists()


# -- each notice source ends in a committed flush and 75 ------------------------------------------------


@pytest.fixture(scope="module")
def aws_preemption(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Run]:
    """One agent through an AWS spot interruption to its exit, which two tests read: what it did and
    how it logged it (an agent run each cost as much again)."""
    runs: list[Run] = []
    start = starter(tmp_path_factory.mktemp("aws"), runs)
    try:
        with ImdsEmulator() as imds:
            run = start("--notices", "aws,sigterm", "--aws-metadata-url", imds.url)
            run.wait_training()
            imds.set_spot_action("terminate", time.time() + 60)
            run.exit_code()
        yield run
    finally:
        kill_left_running(runs)


def test_an_aws_spot_interruption_flushes_and_exits_75(aws_preemption: Run) -> None:
    assert_preempted(aws_preemption, "aws preemption")


def test_an_aws_rebalance_recommendation_asks_for_an_early_save_and_keeps_training(
    start: Callable[..., Run],
) -> None:
    with ImdsEmulator() as imds:
        run = start("--notices", "aws", "--aws-metadata-url", imds.url, "--rebalance", "save-early")
        run.wait_training()
        imds.set_rebalance()
        wait_until(lambda: any(e.startswith("save") for e in events(run)), "an early save", run)
        assert run.proc.poll() is None and not run.control.flush_requested()
        imds.set_spot_action("terminate", time.time() + 60)
        assert_preempted(run, "aws preemption")


def test_a_gce_preemption_flushes_and_exits_75(start: Callable[..., Run]) -> None:
    with GceMetadataEmulator() as gce:
        run = start("--notices", "gcp", "--gcp-metadata-url", gce.url)
        run.wait_training()
        assert gce.wait_for_waiters(2)
        gce.set_preempted(True)
        assert_preempted(run, "gcp preemption")
        request = run.control.flush_request()
        assert request is not None and request.deadline is not None
        assert request.deadline - request.requested_at == pytest.approx(30, abs=5)


def test_an_azure_preempt_event_flushes_exits_75_and_is_acknowledged(start: Callable[..., Run]) -> None:
    with AzureScheduledEventsEmulator() as azure:
        run = start("--notices", "azure", "--azure-metadata-url", azure.url)
        run.wait_training()
        event_id = azure.add_event(EventType="Preempt", NotBefore=time.time() + 60)
        assert_preempted(run, "azure preemption")
        assert azure.start_requests == [event_id]


def test_an_azure_agent_waits_out_the_first_scheduled_events_request_and_still_flushes(
    start: Callable[..., Run],
) -> None:
    """Azure answers a VM's first scheduled events request once the service started (up to two
    minutes): before, the agent gave it 2 s and every Azure job started with a timeout warning."""
    with AzureScheduledEventsEmulator(first_call_delay=3.0) as azure:
        run = start("--notices", "azure", "--azure-metadata-url", azure.url)
        run.wait_training()
        event_id = azure.add_event(EventType="Preempt", NotBefore=time.time() + 60)
        assert_preempted(run, "azure preemption")
        assert azure.start_requests == [event_id]
        assert "up to two minutes" in run.log() and "timed out" not in run.log()


def test_in_a_gke_pod_under_workload_identity_the_agent_says_why_gcp_is_silent_and_sigterm_flushes(
    start: Callable[..., Run],
) -> None:
    """GKE's metadata server serves a Workload Identity pod no instance/preempted (404): before,
    the agent's warning said only "answered 404"."""
    with GceMetadataEmulator(gke_metadata_server=True) as gke:
        run = start("--cloud", "gcp", "--gcp-metadata-url", gke.url, "--sigterm-grace", "20")
        run.wait_training()
        wait_until(lambda: "Workload Identity" in run.log(), "the warning naming Workload Identity", run)
        assert "hostNetwork: true" in run.log()
        run.signal(signal.SIGTERM)
        assert_preempted(run, "signal terminate")


def test_two_jobs_on_one_azure_vm_the_first_to_flush_leaves_the_event_to_the_last(
    start: Callable[..., Run], tmp_path: Path
) -> None:
    """A Preempt event is the VM's: two jobs on the VM both flush for it. Before, the job that
    committed first acknowledged it at once, which lets Azure evict the VM while the other job was
    still flushing (its checkpoint lost). Now the acknowledgement waits for the other job's
    agent to finish or be gone: the last job acknowledges. Both agents are this user's, in one
    process namespace and one temp folder (what the register needs: README, "Known limits")."""
    hold = tmp_path / "hold"
    with AzureScheduledEventsEmulator() as azure:
        args = ("--notices", "azure", "--azure-metadata-url", azure.url)
        quick = start(*args, name="-quick")
        slow = start(*args, name="-slow", fake_args=("--hold-file", str(hold)))
        quick.wait_training()
        slow.wait_training()
        event_id = azure.add_event(EventType="Preempt", NotBefore=time.time() + 60)
        assert quick.exit_code() == EXIT_PREEMPTED, quick.log()
        assert azure.start_requests == [], "acknowledged while the other job was still flushing"
        assert f"not acknowledging Azure scheduled event {event_id} yet: the agent(s) of another job" in quick.log()
        assert slow.proc.poll() is None and slow.control.flush_result() is None
        hold.touch()
        assert slow.exit_code() == EXIT_PREEMPTED, slow.log()
        assert azure.start_requests == [event_id], slow.log()


def test_a_reboot_one_job_on_the_vm_holds_is_not_acknowledged_by_the_job_that_flushed_at_once(
    start: Callable[..., Run],
) -> None:
    """Pins behaviour that already worked, with notices now held (``--flush-lead``): two jobs on
    one Azure VM hear a Reboot 15 minutes ahead; one flushes at once (``--flush-lead 0``), the
    other holds it and trains on. The first must not acknowledge the event (Azure would reboot
    the VM under the second); the second acknowledges once its own flush is done."""
    with AzureScheduledEventsEmulator() as azure:
        args = ("--notices", "azure,sigterm", "--azure-metadata-url", azure.url)
        quick = start(*args, "--flush-lead", "0", name="-quick")
        holding = start(*args, name="-holding")
        quick.wait_training()
        holding.wait_training()
        event_id = azure.add_event(EventType="Reboot", NotBefore=time.time() + 900)
        assert quick.exit_code() == EXIT_PREEMPTED, quick.log()
        assert azure.start_requests == [], "acknowledged while the other job still holds its flush"
        assert "Training goes on" in holding.log() and holding.proc.poll() is None
        holding.signal(signal.SIGTERM)
        assert holding.exit_code() == EXIT_PREEMPTED, holding.log()
        assert azure.wait_for_start_request(event_id), holding.log()


def test_sigterm_to_the_agent_flushes_and_exits_75(start: Callable[..., Run]) -> None:
    run = start("--sigterm-grace", "20")
    run.wait_training()
    run.signal(signal.SIGTERM)
    assert_preempted(run, "signal terminate")
    request = run.control.flush_request()
    assert request is not None and request.deadline is not None
    assert request.deadline - request.requested_at == pytest.approx(20, abs=5)


def test_post_flush_with_the_token_flushes_and_exits_75_and_a_wrong_token_changes_nothing(
    start: Callable[..., Run],
) -> None:
    run = start(env={"SPOTJOB_AGENT_TOKEN": TOKEN})
    run.wait_training()
    assert run.post_flush({"reason": "node tainted"}, token="wrong")[0] == 401
    assert run.post_flush({"reason": "node tainted"})[0] == 401
    assert not run.control.flush_requested() and run.proc.poll() is None
    status, body = run.post_flush({"reason": "node tainted", "deadline": time.time() + 60}, token=TOKEN)
    assert status == 202 and body["created"] is True
    assert_preempted(run, "api preemption: node tainted")
    assert TOKEN not in run.log()


def test_a_client_holding_every_connection_with_unfinished_requests_cannot_keep_the_flush_out(
    start: Callable[..., Run],
) -> None:
    """A client on the pod network needs no token to open connections: one that opens as many as
    the API serves and never finishes its requests must not turn the controller's ``POST /flush``
    away (503) for as long as it keeps them open. The server accepts connections in the order they
    came, so all of the holder's are registered before the flush's."""
    run = start(env={"SPOTJOB_AGENT_TOKEN": TOKEN})
    run.wait_training()
    port = int(run.agent_info()["port"])
    held = [socket.create_connection(("127.0.0.1", port), timeout=WAIT) for _ in range(control_api.MAX_CONNECTIONS)]
    try:
        for sock in held:
            sock.sendall(b"GET /status HTTP/1.1\r\nHost: x\r\n")  # the headers never end
        status, body = run.post_flush({"reason": "node tainted", "deadline": time.time() + 60}, token=TOKEN)
        assert status == 202 and body["created"] is True, (status, body)
        answered = held[0].recv(4096)
        assert answered.startswith(b"HTTP/1.0 408"), answered  # the oldest unfinished request made room
    finally:
        for sock in held:
            sock.close()
    assert_preempted(run, "api preemption: node tainted")


def test_a_second_notice_during_a_flush_does_not_start_another(start: Callable[..., Run], tmp_path: Path) -> None:
    hold = tmp_path / "hold"
    run = start(fake_args=("--hold-file", str(hold)))
    run.wait_training()
    run.signal(signal.SIGTERM)
    wait_until(run.control.flush_requested, "flush.json", run)
    first = run.control.flush_request()
    run.signal(signal.SIGTERM)
    run.signal(signal.SIGINT)
    status, body = run.post_flush({"reason": "again"})
    assert status == 200 and body["created"] is False and first is not None and body["flush"]["id"] == first.id
    wait_until(lambda: run.log().count("no second flush") >= 3, "the repeats to be heard", run)
    hold.touch()
    assert_preempted(run, "signal terminate")
    assert run.control.flush_request() == first
    assert run.log().count("requested:") == 1


def test_the_exit_line_of_a_flush_a_later_request_met_names_the_notice_that_began_it_text_and_json(
    start: Callable[..., Run], tmp_path: Path
) -> None:
    """A POST /flush (spotjob run's interrupt) that meets a flush the agent began for a notice of
    its own starts none, and the flush's exit 75 said only "the flush committed step N": whoever
    asked last could not tell that it answered the earlier notice. The line names it, in the text
    and in JSON (there also as fields of its own)."""
    hold = tmp_path / "hold"
    run = start("--log-format", "json", "--sigterm-grace", "20", fake_args=("--hold-file", str(hold)))
    run.wait_training()
    run.signal(signal.SIGTERM)
    wait_until(run.control.flush_requested, "flush.json", run)
    status, body = run.post_flush({"reason": "spotjob run was interrupted (SIGINT)"})
    assert status == 200 and body["created"] is False
    hold.touch()
    assert_preempted(run, "signal terminate")
    words = exit_75_words(run)
    answered = flush_answered(words)
    assert answered is not None and answered.startswith("signal terminate: "), words
    assert answered_source(answered) == "signal"
    [line] = [json.loads(x) for x in run.log().splitlines() if "exiting 75: " in x]
    assert (line["flush_source"], line["flush_kind"]) == ("signal", "terminate"), line


# -- failures and jobs that end by themselves -----------------------------------------------------------


def test_a_flush_that_cannot_commit_exits_76(start: Callable[..., Run]) -> None:
    run = start(mode="fail")
    run.wait_training()
    run.signal(signal.SIGTERM)
    assert run.exit_code() == EXIT_FLUSH_FAILED, run.log()
    assert "simulated storage outage" in run.log()


def test_a_job_that_finishes_exits_0(start: Callable[..., Run]) -> None:
    run = start(mode="finish", fake_args=("--steps", "5"))
    assert run.exit_code() == 0, run.log()
    assert not run.control.flush_requested() and run.control.closed_ranks() == {0, 1}


def test_a_job_that_fails_by_itself_exits_with_its_own_code(start: Callable[..., Run]) -> None:
    run = start(mode="crash", fake_args=("--steps", "5", "--exit-code", "3"))
    assert run.exit_code() == 3, run.log()
    assert not run.control.flush_requested()


def test_an_abort_at_exit_after_every_rank_closed_is_success(start: Callable[..., Run]) -> None:
    run = start(mode="finish-abort", fake_args=("--steps", "5"))
    assert run.exit_code() == 0, run.log()
    assert run.control.closed_ranks() == {0, 1}
    assert "WARNING" in run.log() and "the command exited 1" in run.log()


def test_a_command_killed_at_the_deadline_after_every_rank_closed_did_not_finish_and_exits_76(
    start: Callable[..., Run], tmp_path: Path
) -> None:
    """Every rank closed its Checkpointer, then the script went on with work of its own (an
    export, an eval) and a notice came: nobody answers the flush, and the agent kills the command
    at the deadline. That command did not finish: the "every rank closed" forgiveness is for an
    abort at interpreter exit, not for the agent's own kill, and exit 0 would mark the job done
    with its last work cut short."""
    hold = tmp_path / "never"  # the work after close() never ends by itself
    run = start(
        "--sigterm-grace",
        "0.5",
        "--log-format",
        "json",
        mode="finish-hold",
        fake_args=("--steps", "3", "--hold-file", str(hold)),
    )
    wait_until(lambda: "closed" in events(run), "every rank closed", run)
    wait_until(lambda: run.control.closed_ranks() == {0, 1}, "both closed marks", run)
    run.signal(signal.SIGTERM)
    assert run.exit_code() == EXIT_FLUSH_FAILED, run.log()
    assert "after every rank closed" in run.log()
    # No rank reported an error, so no other line is at ERROR: this one was at WARNING, and
    # `--log-level error` printed nothing at all of a flush that committed nothing.
    [line] = [json.loads(x) for x in run.log().splitlines() if "exiting 76: " in x]
    assert line["level"] == "ERROR", line


def test_an_abort_at_exit_after_a_committed_flush_is_still_75(start: Callable[..., Run]) -> None:
    run = start(mode="abort-after-flush")
    run.wait_training()
    run.signal(signal.SIGTERM)
    assert_preempted(run, "signal terminate")


# -- no process of the job outlives the agent -----------------------------------------------------------


def test_after_a_commit_the_agent_kills_every_process_even_in_other_sessions_ignoring_sigterm(
    start: Callable[..., Run], tmp_path: Path
) -> None:
    pid_file = tmp_path / "orphan.pid"
    run = start("--exit-timeout", "0.5", "--kill-grace", "0.5", mode="orphan", fake_args=("--pid-file", str(pid_file)))
    agent_id = run.agent_info()["agent_id"]
    run.wait_training()
    orphan = int(pid_file.read_text())
    run.signal(signal.SIGTERM)
    assert_preempted(run, "signal terminate")
    assert "SIGKILL" in run.log()
    assert marked_processes(agent_id) == []
    assert orphan not in {p.pid for p in all_processes() if p.state != "Z"}


def test_a_sigterm_to_one_jobs_agent_kills_its_processes_only_and_the_neighbour_trains_on(
    start: Callable[..., Run], tmp_path: Path
) -> None:
    """Pins behaviour that already worked: two jobs on one machine, run by one user; the agent of
    the first is sent SIGTERM and, its ranks never answering the flush, kills every process of its
    job at the deadline, including one it finds by its marker alone. The second job's processes
    (same user, same fake-ranks program) keep running, and its agent keeps training."""
    doomed = start("--sigterm-grace", "0.5", "--kill-grace", "0.5", mode="ignore-flush", name="-doomed")
    neighbour = start(name="-neighbour")
    doomed.wait_training()
    neighbour.wait_training()
    doomed_id, neighbour_id = doomed.agent_info()["agent_id"], neighbour.agent_info()["agent_id"]
    survivors = marked_processes(neighbour_id)
    assert survivors and marked_processes(doomed_id)
    doomed.signal(signal.SIGTERM)
    assert doomed.exit_code() == EXIT_FLUSH_FAILED, doomed.log()
    assert marked_processes(doomed_id) == []
    assert marked_processes(neighbour_id) == survivors, "the neighbour's processes were touched"
    status = neighbour.control.status()
    neighbour.wait_training((status.step or 0) + 5 if status else 5)
    assert neighbour.proc.poll() is None and neighbour.control.flush_request() is None


def test_a_second_agent_given_the_control_folder_of_a_running_one_exits_2_and_leaves_it_alone(
    start: Callable[..., Run], tmp_path: Path
) -> None:
    """Two jobs given one ``--control-dir`` (a fixed path in a script, a shared home): before, the
    second agent cleared the first one's files and its ranks read the first's ``flush.json``, so a
    notice to one job flushed and stopped both (the second exited 75). Now it refuses to start."""
    first = start()
    first.wait_training()
    shared = ("--control-dir", first.control.path)
    second = start(*shared, name="-second")
    assert second.exit_code() == 2, second.log()
    assert f"--control-dir {first.control.path} is in use by another agent (pid {first.proc.pid}" in second.log()
    assert first.agent_info()["pid"] == first.proc.pid
    first.signal(signal.SIGTERM)
    assert_preempted(first, "signal terminate")


@pytest.mark.skipif(not hasattr(os, "getuid") or os.getuid() != 0, reason="needs root to act as another user")
def test_without_a_token_another_user_of_the_machine_cannot_stop_or_flush_the_job(start: Callable[..., Run]) -> None:
    """A machine shared by users (a batch node): before, any local user could POST /stop or /flush
    to another user's agent on loopback when it had no token, and end that user's job. Now such a
    request from another user id gets 403 and changes nothing; the agent's own user still may."""
    run = start()
    run.wait_training()
    url = run.agent_info()["url"]
    request = (
        "import sys, urllib.request as u, urllib.error as e\n"
        "for path in ('/stop', '/flush'):\n"
        "    try: print(u.urlopen(u.Request(sys.argv[1] + path, data=b'{}', method='POST'), timeout=10).status)\n"
        "    except e.HTTPError as x: print(x.code)\n"
    )
    python = shutil.which("python3", path="/usr/bin:/bin")  # one that user may run (not the venv's)
    if python is None:
        pytest.skip("no system python3 for the other user")
    other = subprocess.run([python, "-c", request, url], user=65534, capture_output=True, text=True, timeout=60)
    assert other.stdout.split() == ["403", "403"], other.stdout + other.stderr + run.log()
    assert "refused POST /stop from user id 65534" in run.log()
    assert run.proc.poll() is None and run.control.flush_request() is None
    status, _ = run.post("/stop", {"reason": "the owner"})
    assert status == 202
    assert run.exit_code() == EXIT_STOPPED


def test_when_the_deadline_passes_with_no_flush_the_agent_kills_the_job_and_exits_76(
    start: Callable[..., Run],
) -> None:
    run = start(mode="ignore-flush")
    agent_id = run.agent_info()["agent_id"]
    run.wait_training()
    assert run.post_flush({"reason": "short notice", "deadline": time.time() + 1})[0] == 202
    assert run.exit_code() == EXIT_FLUSH_FAILED, run.log()
    assert "the deadline passed" in run.log()
    assert marked_processes(agent_id) == []


# -- exit codes the agent reports only for what it saw ---------------------------------------------------


@pytest.mark.parametrize("own", [74, 75, 76, 79])
def test_a_command_that_exits_with_an_agent_code_by_itself_is_reported_as_1_and_says_why(
    start: Callable[..., Run], own: int
) -> None:
    run = start(mode="crash", fake_args=("--steps", "3", "--exit-code", str(own)))
    assert run.exit_code() == 1, run.log()
    assert f"exited {own} by itself" in run.log()


def test_a_rank_reporting_an_infrastructure_error_makes_the_agent_exit_74(start: Callable[..., Run]) -> None:
    run = start(mode="infra", fake_args=("--steps", "3"))
    assert run.exit_code() == EXIT_INFRA_ERROR, run.log()
    assert "infrastructure error: rank 0: storage unreachable" in run.log()


# -- POST /stop -------------------------------------------------------------------------------------------


def test_post_stop_stops_every_process_without_a_flush_and_exits_79(start: Callable[..., Run]) -> None:
    run = start(env={"SPOTJOB_AGENT_TOKEN": TOKEN})
    agent_id = run.agent_info()["agent_id"]
    run.wait_training()
    assert run.post("/stop", {"reason": "worker 1 of the gang failed"})[0] == 401
    assert run.proc.poll() is None
    status, body = run.post("/stop", {"reason": "worker 1 of the gang failed"}, token=TOKEN)
    assert status == 202 and body["created"] is True
    assert run.exit_code() == EXIT_STOPPED, run.log()
    assert not run.control.flush_requested() and not [e for e in events(run) if e.startswith("flush")]
    assert marked_processes(agent_id) == []
    assert "worker 1 of the gang failed" in run.log()


def test_post_stop_after_the_command_exited_with_its_ranks_still_flushing_stops_them_and_exits_79(
    start: Callable[..., Run], tmp_path: Path
) -> None:
    """torchrun died during a flush whose deadline is ten minutes away; its ranks flush on. A
    second flush request is the same flush; a stop is not left waiting for the deadline: the
    ranks are stopped, nothing is committed, and the agent exits 79."""
    hold = tmp_path / "never"  # rank 0 never commits
    run = start(
        env={"SPOTJOB_AGENT_TOKEN": TOKEN},
        fake_args=("--hold-file", str(hold), "--launcher-exits-on-flush"),
    )
    agent_id = run.agent_info()["agent_id"]
    run.wait_training()
    body = {"reason": "spot", "deadline": time.time() + 600}
    assert run.post_flush(body, token=TOKEN)[0] == 202
    wait_until(lambda: "still flushing" in run.log(), "the command's exit with its ranks flushing", run)
    assert marked_processes(agent_id), "the ranks should still be running"
    status, again = run.post_flush(body, token=TOKEN)
    assert status == 200 and again["created"] is False
    status, stopped = run.post("/stop", {"reason": "worker 1 of the gang failed"}, token=TOKEN)
    assert status == 202 and stopped["created"] is True
    assert run.exit_code() == EXIT_STOPPED, run.log()
    assert marked_processes(agent_id) == []
    assert run.control.flush_result() is None and "Traceback" not in run.log()


def test_ranks_still_flushing_at_the_deadline_after_the_command_exited_are_the_agents_stop(
    start: Callable[..., Run], tmp_path: Path
) -> None:
    """torchrun died during a flush; its ranks flush on and commit nothing by the deadline, when
    the agent stops them. Its 76 says so, not that the command ended by itself during the flush
    (``COMMAND_ENDED_DURING_FLUSH``), which ``spotjob run`` takes for the script's own failure."""
    hold = tmp_path / "never"  # rank 0 never commits
    run = start(
        env={"SPOTJOB_AGENT_TOKEN": TOKEN},
        fake_args=("--hold-file", str(hold), "--launcher-exits-on-flush"),
    )
    agent_id = run.agent_info()["agent_id"]
    run.wait_training()
    assert run.post_flush({"reason": "spot", "deadline": time.time() + 5}, token=TOKEN)[0] == 202
    wait_until(lambda: "still flushing" in run.log(), "the command's exit with its ranks flushing", run)
    assert run.exit_code() == EXIT_FLUSH_FAILED, run.log()
    said = next(w for line in run.log().splitlines() if (w := exit_words(line, EXIT_FLUSH_FAILED)))
    assert "spotjob-agent stopped the command before its ranks reported one" in said
    assert COMMAND_ENDED_DURING_FLUSH not in said
    assert marked_processes(agent_id) == []
    assert run.control.flush_result() is None and "Traceback" not in run.log()


# -- the rendezvous port --------------------------------------------------------------------------------


def fake_torchrun(tmp_path: Path, body: str) -> Path:
    """An executable named ``torchrun`` (what the agent recognises), running ``body`` in Python."""
    path = tmp_path / "bin" / "torchrun"
    path.parent.mkdir(exist_ok=True)
    path.write_text(f"#!{sys.executable}\n{body}\n")
    path.chmod(0o755)
    return path


def test_a_taken_rendezvous_port_exits_74_before_the_command_starts(tmp_path: Path) -> None:
    started = tmp_path / "started"
    torchrun = fake_torchrun(tmp_path, f"open({str(started)!r}, 'w').close()")
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        command = [
            *agent_command(), "--checkpoint-uri", f"file://{tmp_path}/ckpt", "--cloud", "none", "--",
            str(torchrun), "--nproc-per-node", "2", "--master-port", str(port), "train.py",
        ]  # fmt: skip
        out = subprocess.run(command, capture_output=True, text=True, timeout=WAIT)
    assert out.returncode == EXIT_INFRA_ERROR, out.stderr
    assert f"rendezvous port {port}" in out.stderr and "--master-port" in out.stderr
    assert not started.exists()


def test_a_control_port_that_is_also_the_rendezvous_port_exits_2_not_74(tmp_path: Path) -> None:
    """The agent's own control API held the port torchrun was to bind, and the agent exited 74 saying
    it was "taken by another process": an infrastructure error the reconciler retries on every
    attempt without spending a restart, for two options that name one port."""
    started = tmp_path / "started"
    torchrun = fake_torchrun(tmp_path, f"open({str(started)!r}, 'w').close()")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [
        *agent_command(), "--checkpoint-uri", f"file://{tmp_path}/ckpt", "--cloud", "none",
        "--control-port", str(port), "--", str(torchrun), "--nproc-per-node", "2", "--master-port", str(port),
        "train.py",
    ]  # fmt: skip
    out = subprocess.run(command, capture_output=True, text=True, timeout=WAIT)
    assert out.returncode == 2, out.stderr
    assert f"--control-port {port} is also torchrun's rendezvous port" in out.stderr
    assert "another process" not in out.stderr and not started.exists()


def start_plain(tmp_path: Path, command: list[str]) -> Run:
    """spotjob-agent with a short SIGTERM grace around ``command`` (not fake_ranks' launcher)."""
    args = [
        *agent_command(), "--checkpoint-uri", f"file://{tmp_path}/ckpt", "--cloud", "none", "--kill-grace", "1",
        "--sigterm-grace", "0.5", "--control-dir", str(tmp_path / "control"), "--", *command,
    ]  # fmt: skip
    log_path = tmp_path / "agent.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPOTJOB_")}
    with open(log_path, "wb") as out:
        proc = subprocess.Popen(args, env=env, stdout=out, stderr=subprocess.STDOUT)
    return Run(proc, ControlDir(str(tmp_path / "control")), log_path, tmp_path)


def test_torchrun_killed_at_the_deadline_in_its_exit_barrier_after_every_rank_closed_and_exited_is_success(
    tmp_path: Path,
) -> None:
    """Every rank closed and exited; torchrun waits in its exit barrier (for another node's
    torchrun) when a notice comes, and the agent kills it at the deadline: the job's work on this
    node is done, so the agent exits 0, unlike a script still at work after close() (76). Pins
    behaviour that worked before that case was made 76 (and failed with its first version)."""
    # One node and no port: the agent adds --standalone (as torchrun 2.12 runs it), which this
    # torchrun takes and ignores.
    body = (
        "import runpy, sys\nsys.argv = sys.argv[1:]\nif sys.argv[0] == '--standalone': del sys.argv[0]\n"
        "runpy.run_path(sys.argv[0], run_name='__main__')"
    )
    torchrun = fake_torchrun(tmp_path, body)
    never = tmp_path / "never"
    run = start_plain(
        tmp_path,
        [
            str(torchrun), str(FAKE_RANKS), "--nproc", "2", "--mode", "finish", "--steps", "3",
            "--events", str(tmp_path / "events"), "--launcher-waits-for", str(never),
        ],
    )  # fmt: skip
    try:
        wait_until(lambda: "ranks exited" in events(run), "the ranks' exit", run)
        run.signal(signal.SIGTERM)
        assert run.exit_code() == 0, run.log()
        assert "the deadline passed" in run.log() and "every rank closed (2/2)" in run.log()
    finally:
        if run.proc.poll() is None:
            run.proc.kill()


def test_a_notice_whose_deadline_passes_before_any_rank_connected_says_so_at_exit(tmp_path: Path) -> None:
    """A notice while the ranks are still starting (torch importing, the rendezvous): nothing can
    flush, and the agent's exit line says that no rank had connected, rather than only "no
    checkpoint was committed", which reads as a failed save. The command here stands for ranks
    that never reach their Checkpointer: it waits for a file that never comes."""
    never, started = tmp_path / "never", tmp_path / "started"
    body = (
        f"import os, time\nopen({str(started)!r}, 'w').close()\n"
        f"while not os.path.exists({str(never)!r}): time.sleep(0.01)"
    )
    run = start_plain(tmp_path, [sys.executable, "-c", body])
    try:
        wait_until(started.exists, "the command's start", run)
        run.signal(signal.SIGTERM)
        assert run.exit_code() == EXIT_FLUSH_FAILED, run.log()
        assert "no rank had connected" in run.log()
    finally:
        if run.proc.poll() is None:
            run.proc.kill()


def test_torchrun_failing_while_another_process_took_its_rendezvous_port_exits_74(tmp_path: Path) -> None:
    go = tmp_path / "go"
    # Free at the agent's check; taken (by the test) before "torchrun" tries to bind and fails.
    torchrun = fake_torchrun(
        tmp_path, f"import os, sys, time\nwhile not os.path.exists({str(go)!r}): time.sleep(0.01)\nsys.exit(1)"
    )
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [
        *agent_command(), "--checkpoint-uri", f"file://{tmp_path}/ckpt", "--cloud", "none", "--",
        str(torchrun), "--master-port", str(port), "train.py",
    ]  # fmt: skip
    proc = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    try:
        with socket.socket() as holder:
            holder.bind(("127.0.0.1", port))
            holder.listen()
            go.touch()
            _, err = proc.communicate(timeout=WAIT)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == EXIT_INFRA_ERROR, err
    assert f"rendezvous port {port}" in err


def test_torchrun_failing_with_a_free_port_is_the_commands_failure(tmp_path: Path) -> None:
    torchrun = fake_torchrun(tmp_path, "import sys; sys.exit(3)")
    command = [
        *agent_command(), "--checkpoint-uri", f"file://{tmp_path}/ckpt", "--cloud", "none", "--",
        str(torchrun), "--master-port", "1", "train.py",
    ]  # fmt: skip
    out = subprocess.run(command, capture_output=True, text=True, timeout=WAIT)
    assert out.returncode == 3, out.stderr


# The agent names every malformed variable of one settings class in a single refusal: the cases of
# a class share one agent run, each still asserting its own words.
MALFORMED = [
    [  # CheckpointerEnv
        ("SPOTJOB_EVERY_STEPS", "100s", "a whole number of steps"),
        ("SPOTJOB_KEEP", "-1", "a whole number, at least 0"),
        ("SPOTJOB_ASYNC", "maybe", "a boolean"),
    ],
    [  # StorageEnv
        ("SPOTJOB_STORAGE_CONCURRENCY", "0", "a whole number from 1 to 1024"),
        ("SPOTJOB_STORAGE_PART_SIZE", "64 megs", "a size in bytes from 1MiB to 5GiB"),
    ],
]


@dataclass
class Refusal:
    out: subprocess.CompletedProcess[str]
    started: Path


@pytest.fixture(scope="module")
def malformed_refusals(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Refusal]:
    """Each variable's agent run: one per settings class, every variable of the class malformed."""
    refusals: dict[str, Refusal] = {}
    for group in MALFORMED:
        tmp_path = tmp_path_factory.mktemp("malformed")
        started = tmp_path / "started"
        command = [
            *agent_command(), "--checkpoint-uri", f"file://{tmp_path}/ckpt", "--cloud", "none", "--launcher", "direct",
            "--", sys.executable, "-c", f"open({str(started)!r}, 'w').close()",
        ]  # fmt: skip
        env = {**os.environ, **{variable: value for variable, value, _ in group}}
        out = subprocess.run(command, capture_output=True, text=True, timeout=WAIT, env=env)
        refusals.update({variable: Refusal(out, started) for variable, _, _ in group})
    return refusals


@pytest.mark.parametrize(("variable", "value", "words"), [case for group in MALFORMED for case in group])
def test_a_malformed_variable_the_ranks_would_read_exits_2_before_the_command_starts(
    malformed_refusals: dict[str, Refusal], variable: str, value: str, words: str
) -> None:
    """The agent passes its SPOTJOB_* variables on to the ranks, whose every Checkpointer (and every
    store) reads them: a malformed one used to start the command, and every rank then failed with
    a traceback once its script built a Checkpointer (spending a restart on Kubernetes)."""
    refusal = malformed_refusals[variable]
    assert refusal.out.returncode == 2, refusal.out.stderr
    assert f"{variable}={value!r} is not {words}" in refusal.out.stderr
    assert not refusal.started.exists()


def test_an_option_replaces_the_malformed_variable_it_sets_for_the_ranks(tmp_path: Path) -> None:
    """Pins what already worked: --every-steps wins over SPOTJOB_EVERY_STEPS, so a malformed
    variable it replaces is no reason to refuse the start."""
    started = tmp_path / "started"
    command = [
        *agent_command(), "--checkpoint-uri", f"file://{tmp_path}/ckpt", "--cloud", "none", "--launcher", "direct",
        "--every-steps", "5", "--", sys.executable, "-c", f"open({str(started)!r}, 'w').close()",
    ]  # fmt: skip
    env = {**os.environ, "SPOTJOB_EVERY_STEPS": "100s"}
    out = subprocess.run(command, capture_output=True, text=True, timeout=WAIT, env=env)
    assert out.returncode == 0, out.stderr
    assert started.exists()


def test_a_misspelled_spotjob_variable_is_named_with_the_one_it_resembles(tmp_path: Path) -> None:
    """SPOTJOB_EVERY_STEP (for SPOTJOB_EVERY_STEPS) used to be ignored without a word: the ranks never
    saved periodically. The agent warns, naming the known variable it resembles, and runs the command
    (the variable may be the script's own)."""
    started = tmp_path / "started"
    command = [
        *agent_command(), "--checkpoint-uri", f"file://{tmp_path}/ckpt", "--cloud", "none", "--launcher", "direct",
        "--", sys.executable, "-c", f"open({str(started)!r}, 'w').close()",
    ]  # fmt: skip
    env = {**os.environ, "SPOTJOB_EVERY_STEP": "100", "SPOTJOB_STORAGE_CONCURENCY": "4", "SPOTJOB_KEEP": "2"}
    out = subprocess.run(command, capture_output=True, text=True, timeout=WAIT, env=env)
    assert out.returncode == 0, out.stderr
    assert started.exists()
    assert "SPOTJOB_EVERY_STEP is set but no part of spotjob reads it (did you mean SPOTJOB_EVERY_STEPS?)" in out.stderr
    assert "did you mean SPOTJOB_STORAGE_CONCURRENCY?" in out.stderr
    assert "SPOTJOB_KEEP is set" not in out.stderr


def test_a_variable_named_in_another_case_is_ignored_everywhere_and_named_in_a_warning(tmp_path: Path) -> None:
    """The ranks' settings were read case-insensitively (pydantic-settings' default) while the agent
    and every other reader match names exactly: ``spotjob_storage_max_attempts=abc`` was refused
    under a name the user never set (SPOTJOB_STORAGE_MAX_ATTEMPTS), and ``spotjob_keep=5`` placed
    after SPOTJOB_KEEP in the environment beat ``--keep 2`` on the ranks, without a word. Names are
    matched exactly everywhere now, and one that differs only in case is named in a warning."""
    seen = tmp_path / "seen"
    rank = (
        "from agent.settings import CheckpointerEnv, StorageEnv, load; "
        f"open({str(seen)!r}, 'w').write(f'{{load(CheckpointerEnv).keep}} {{load(StorageEnv).max_attempts}}')"
    )
    command = [
        *agent_command(), "--checkpoint-uri", f"file://{tmp_path}/ckpt", "--cloud", "none", "--launcher", "direct",
        "--keep", "2", "--", sys.executable, "-c", rank,
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith(("SPOTJOB_KEEP", "SPOTJOB_STORAGE_"))}
    env = {**env, "SPOTJOB_KEEP": "9", "spotjob_keep": "5", "spotjob_storage_max_attempts": "abc"}
    out = subprocess.run(command, capture_output=True, text=True, timeout=WAIT, env=env)
    assert out.returncode == 0, out.stderr
    assert seen.read_text() == "2 None"
    assert (
        "spotjob_keep is set but spotjob reads only SPOTJOB_KEEP (variable names are case-sensitive); "
        "spotjob ignores it" in out.stderr
    )
    assert "spotjob_storage_max_attempts is set but spotjob reads only SPOTJOB_STORAGE_MAX_ATTEMPTS" in out.stderr


def test_a_quoted_checkpoint_uri_in_the_environment_exits_2_before_anything_starts(tmp_path: Path) -> None:
    """SPOTJOB_CHECKPOINT_URI='"s3://b/run"' (quoted twice in a Secret or an env file) was taken as a
    relative path: the agent started the command, and the ranks checkpointed to a local folder
    named '"s3:' in their working directory, not to the bucket."""
    started = tmp_path / "started"
    command = [
        *agent_command(), "--cloud", "none", "--launcher", "direct",
        "--", sys.executable, "-c", f"open({str(started)!r}, 'w').close()",
    ]  # fmt: skip
    env = {**os.environ, "SPOTJOB_CHECKPOINT_URI": '"s3://b/run"'}
    out = subprocess.run(command, capture_output=True, text=True, timeout=WAIT, env=env, cwd=tmp_path)
    assert out.returncode == 2, out.stderr
    assert not started.exists()
    assert "SPOTJOB_CHECKPOINT_URI: '\"s3://b/run\"' begins or ends with a quote" in out.stderr
    assert "remove the quotes ('s3://b/run')" in out.stderr


@pytest.mark.parametrize("option", ["--checkpoint-uri", "--job-name", "--staging-dir"])
def test_an_empty_option_exits_2_instead_of_blanking_the_variable_the_ranks_read(tmp_path: Path, option: str) -> None:
    """``--checkpoint-uri ""`` (``--checkpoint-uri=$URI`` with URI unset) let the agent check and use
    SPOTJOB_CHECKPOINT_URI, but the ranks got SPOTJOB_CHECKPOINT_URI="" over it: every
    ``Checkpointer.from_env()`` failed with "no checkpoint URI" once the job had started."""
    started = tmp_path / "started"
    command = [
        *agent_command(), "--cloud", "none", "--launcher", "direct", option, "",
        "--", sys.executable, "-c", f"open({str(started)!r}, 'w').close()",
    ]  # fmt: skip
    env = {**os.environ, "SPOTJOB_CHECKPOINT_URI": f"file://{tmp_path}/ckpt"}
    out = subprocess.run(command, capture_output=True, text=True, timeout=WAIT, env=env)
    assert out.returncode == 2, out.stderr
    assert not started.exists()
    assert f"{option} is empty" in out.stderr


def test_a_relative_checkpoint_path_names_the_agents_folder_on_the_ranks(tmp_path: Path) -> None:
    """A relative --checkpoint-uri (or SPOTJOB_CHECKPOINT_URI) reached the ranks as written: a script
    that changes its working directory before building its Checkpointer wrote under another folder
    than the one the agent watches for commits (a flush then looked like nothing committed). The
    agent resolves it against its own working directory, once, for itself and its ranks."""
    seen = tmp_path / "seen"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    rank = (
        f"import os; os.chdir({str(elsewhere)!r}); from agent.storage import open_storage; "
        f"open({str(seen)!r}, 'w').write(open_storage(os.environ['SPOTJOB_CHECKPOINT_URI']).uri)"
    )
    base = [*agent_command(), "--cloud", "none", "--launcher", "direct"]
    for how, env in (
        (["--checkpoint-uri", "ck"], {k: v for k, v in os.environ.items() if k != "SPOTJOB_CHECKPOINT_URI"}),
        ([], {**os.environ, "SPOTJOB_CHECKPOINT_URI": "ck"}),
    ):
        command = [*base, *how, "--", sys.executable, "-c", rank]
        out = subprocess.run(command, capture_output=True, text=True, timeout=WAIT, env=env, cwd=tmp_path)
        assert out.returncode == 0, out.stderr
        assert seen.read_text() == f"file://{tmp_path}/ck", how


def test_a_relative_control_and_staging_folder_reach_a_command_that_changes_folder_and_it_flushes(
    tmp_path: Path,
) -> None:
    """A relative --control-dir and --staging-dir (or SPOTJOB_STAGING_DIR) reached the ranks as
    written, while the checkpoint path was made absolute: a wrapper that changes folder
    (``sh -c 'cd / && exec python train.py'``) had its ranks report in another control folder than
    the agent's. They never heard the flush, were killed at the deadline, and the agent exited 76
    saying no rank had connected. Both are resolved against the agent's folder, once."""
    seen = tmp_path / "seen"
    for how, env in (
        (["--staging-dir", "stage"], {}),
        ([], {"SPOTJOB_STAGING_DIR": "stage"}),
    ):
        control = tmp_path / "control"
        shutil.rmtree(control, ignore_errors=True)
        ranks = (
            f"cd / && env > {str(seen)!r} && exec {sys.executable} {FAKE_RANKS} --nproc 1 "
            f"--events {str(tmp_path / 'events')!r}"
        )
        command = [
            *agent_command(), "--cloud", "none", "--checkpoint-uri", f"file://{tmp_path}/ckpt",
            "--control-dir", "control", "--sigterm-grace", "20", "--kill-grace", "1", *how,
            "--", "sh", "-c", ranks,
        ]  # fmt: skip
        full_env = {k: v for k, v in os.environ.items() if not k.startswith("SPOTJOB_")}
        full_env.update({"SPOTJOB_AGENT_POLL_INTERVAL": "0.05", **env})
        log_path = tmp_path / "agent.log"
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(command, env=full_env, stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path)
        run = Run(proc, ControlDir(str(control)), log_path, tmp_path)
        try:
            run.wait_training()
            ranks_env = dict(line.split("=", 1) for line in seen.read_text().splitlines() if "=" in line)
            assert ranks_env["SPOTJOB_CONTROL_DIR"] == str(control), how
            assert ranks_env["SPOTJOB_STAGING_DIR"] == str(tmp_path / "stage"), how
            run.signal(signal.SIGTERM)
            assert run.exit_code() == EXIT_PREEMPTED, run.log()
        finally:
            run.kill()


def test_keep_0_reaches_the_ranks_as_keep_every_checkpoint(tmp_path: Path) -> None:
    """SPOTJOB_KEEP=0 is how Checkpointer.from_env() keeps every checkpoint, but spotjob-agent
    refused --keep 0 ("must be at least 1"): keeping them all needed the variable instead of the
    option that stands for it."""
    seen = tmp_path / "seen"
    command = [
        *agent_command(), "--checkpoint-uri", f"file://{tmp_path}/ckpt", "--cloud", "none", "--launcher", "direct",
        "--keep", "0", "--", sys.executable, "-c",
        f"import os; open({str(seen)!r}, 'w').write(os.environ['SPOTJOB_KEEP'])",
    ]  # fmt: skip
    out = subprocess.run(command, capture_output=True, text=True, timeout=WAIT)
    assert out.returncode == 0, out.stderr
    assert seen.read_text() == "0"
    negative = [*command[:-5], "-1", *command[-4:]]
    refused = subprocess.run(negative, capture_output=True, text=True, timeout=WAIT)
    assert refused.returncode == 2 and "--keep: must be at least 0" in refused.stderr, refused.stderr


# -- the driver dies ------------------------------------------------------------------------------------

DRIVER = """
import subprocess, sys
proc = subprocess.Popen(sys.argv[2:], stdout=open(sys.argv[1], "ab"), stderr=subprocess.STDOUT,
                        start_new_session=True)
print(proc.pid, flush=True)
proc.wait()
"""


def test_when_the_driver_is_killed_the_ranks_flush_and_every_process_is_gone(tmp_path: Path) -> None:
    control = tmp_path / "control"
    log_path = tmp_path / "agent.log"
    agent = [
        *agent_command(), "--checkpoint-uri", f"file://{tmp_path}/ckpt", "--control-dir", str(control),
        "--cloud", "none", "--kill-grace", "1", "--exit-with-parent", "--parent-grace", "20",
        "--", sys.executable, str(FAKE_RANKS), "--nproc", "2", "--events", str(tmp_path / "events"),
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPOTJOB_")}
    driver = subprocess.Popen(
        [sys.executable, "-c", DRIVER, str(log_path), *agent], stdout=subprocess.PIPE, text=True, env=env
    )
    assert driver.stdout is not None
    agent_pid = int(driver.stdout.readline())
    run = Run(driver, ControlDir(str(control)), log_path, tmp_path)
    agent_id = run.agent_info()["agent_id"]
    run.wait_training()
    driver.kill()  # SIGKILL: the driver gets no chance to stop anything
    driver.wait()
    wait_until(lambda: not alive(agent_pid), "the agent to exit after its driver died", timeout=60)
    wait_until(lambda: marked_processes(agent_id) == [], "every process of the job to be gone")
    result = run.control.flush_result()
    assert result is not None and result.error is None, run.log()
    request = run.control.flush_request()
    assert request is not None and request.reason.startswith("driver"), run.log()
    assert [e for e in events(run) if e.startswith("flush")] == [f"flush {result.request_id}"]
    assert "exiting 75" in run.log()


def alive(pid: int) -> bool:
    info = read_proc(pid)
    return info is not None and info.state != "Z"


# -- a command that never connects -------------------------------------------------------------------


def test_a_command_whose_ranks_never_connect_is_warned_about_in_the_log_and_status(tmp_path: Path) -> None:
    done = tmp_path / "done"
    control = tmp_path / "control"
    command = [
        *agent_command(), "--checkpoint-uri", f"file://{tmp_path}/ckpt", "--cloud", "none",
        "--control-dir", str(control), "--rank-connect-timeout", "0.5", "--",
        sys.executable, "-c", f"import os, time\nwhile not os.path.exists({str(done)!r}): time.sleep(0.05)",
    ]  # fmt: skip
    log_path = tmp_path / "agent.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPOTJOB_")}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    run = Run(proc, ControlDir(str(control)), log_path, tmp_path)
    try:
        wait_until(lambda: "no rank has connected" in run.log(), "the warning", run)
        url = run.agent_info()["url"]
        with urllib.request.urlopen(url + "/status", timeout=10) as resp:
            status = json.loads(resp.read())
        assert status["ranks_connected"] is False and "Checkpointer" in status["problems"][0]
        assert "WARNING" in run.log()
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(url + "/readyz", timeout=10)
        assert e.value.code == 503
    finally:
        done.touch()
    assert run.exit_code() == 0, run.log()


def test_a_normal_preemption_flush_is_logged_at_info_not_as_a_warning(aws_preemption: Run) -> None:
    """A notice heard and flushed is the normal path on spot capacity (its Events are Normal), so
    an alert on the agent's WARNING lines must not fire for each one: the request and the commit
    were both WARNING lines. Problems around a flush (a window too short, a deadline already past,
    a failed flush) keep their WARNING or ERROR."""
    run = aws_preemption
    assert_preempted(run, "aws preemption")
    lines = [line for line in run.log().splitlines() if " spotjob-agent[" in line]
    flush_lines = [line for line in lines if " flush " in line]
    assert any("requested" in line for line in flush_lines) and any("committed" in line for line in flush_lines)
    assert all(" INFO " in line for line in flush_lines), "\n".join(flush_lines)
