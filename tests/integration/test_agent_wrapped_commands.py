"""What users wrap with ``spotjob-agent --``, and the signals around it, with real processes.

- A shell around torchrun and a pipe into ``tee``: the notice still reaches the rank through
  the control folder, the flush commits, the agent exits 75, nothing is left behind.
- SIGQUIT (Ctrl-\\) to the agent stops the command rather than kill the agent alone and leave
  the ranks training with nobody to hear a notice; a SIGHUP or SIGQUIT inherited ignored (nohup,
  a shell's background job) stays ignored; a SIGTERM or Ctrl-C while the agent exits cannot
  change its exit code; SIGUSR1/SIGUSR2 (a batch scheduler's warning) are notices, not the
  default that ended the agent alone.
- The zombies of orphans that exited before the agent saw them are reaped (and, as PID 1 of a pid
  namespace, as a container without an init runs it, every orphan, as an init would).
- A command that cannot start says why: a missing ``#!`` interpreter, a program not on PATH.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from test_agent_launcher import (  # the helpers of the agent's other end-to-end tests
    FAKE_RANKS,
    WAIT,
    Run,
    agent_command,
    marked_processes,
    wait_until,
)

from agent.control_channel import EXIT_PREEMPTED, ControlDir
from agent.launcher import Agent, parse_args
from agent.ranks import free_port

REPO = Path(__file__).resolve().parents[2]
TRAIN = REPO / "examples" / "train.py"
BIN = Path(sys.executable).parent
TORCHRUN_START = 120.0  # seconds for real torchrun ranks to reach a step: torch imports, loaded CI


def start_agent(
    tmp: Path,
    command: list[str],
    *agent_args: str,
    prefix: tuple[str, ...] = (),
    extra_env: dict[str, str] | None = None,
) -> Run:
    """The agent (after ``prefix``, e.g. ``unshare ...``) running ``command``, logging to tmp/agent.log."""
    control = tmp / "control"
    args = [
        *prefix,
        *agent_command(),
        "--checkpoint-uri", f"file://{tmp}/ckpt",
        "--control-dir", str(control),
        "--cloud", "none",
        "--kill-grace", "1",
        *agent_args,
        "--",
        *command,
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPOTJOB_")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **(extra_env or {}))
    log_path = tmp / "agent.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            args, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=str(tmp), preexec_fn=_as_from_a_terminal
        )
    return Run(proc, ControlDir(str(control)), log_path, tmp)


def _as_from_a_terminal() -> None:
    """(in the child, before exec) SIGQUIT and SIGHUP at their defaults, as a terminal starts a
    program: pytest run as a shell's background job (``.ci/run &``) inherits them ignored, and the
    agent rightly keeps an inherited ignore. A ``prefix`` such as ``nohup`` ignores them itself."""
    signal.signal(signal.SIGQUIT, signal.SIG_DFL)
    signal.signal(signal.SIGHUP, signal.SIG_DFL)
    signal.signal(signal.SIGTSTP, signal.SIG_DFL)


def agent_id(run: Run) -> str:
    return str(run.agent_info()["agent_id"])


def zombie_children(pid: int) -> list[int]:
    try:
        return [c.pid for c in psutil.Process(pid).children() if c.status() == psutil.STATUS_ZOMBIE]
    except psutil.NoSuchProcess:
        return []


def stop(run: Run) -> None:
    """The agent and whatever of its command it left running (``Run.kill``): a test that failed
    before the agent stopped its command (a slow start under load) used to leave torchrun and its
    ranks training for ever, loading the machine for every test after it."""
    run.kill()


@contextlib.contextmanager
def fake_ranks_training(tmp_path: Path) -> Iterator[tuple[Run, str]]:
    """The agent over two fake ranks, once they train: (the run, its agent id). Whatever a dead
    agent left running is killed afterwards."""
    fake = [sys.executable, str(FAKE_RANKS), "--nproc", "2", "--mode", "flush"]
    run = start_agent(tmp_path, fake)
    ident = ""
    try:
        ident = agent_id(run)
        run.wait_training(steps=3)
        assert marked_processes(ident), "the command's processes should be running"
        yield run, ident
    finally:
        stop(run)  # and what a dead agent left running


@contextlib.contextmanager
def fake_ranks_signalled(tmp_path: Path, sig: signal.Signals) -> Iterator[tuple[Run, str, int]]:
    """The agent over two fake ranks, sent ``sig`` once they train: (the run, its agent id, its
    exit code)."""
    with fake_ranks_training(tmp_path) as (run, ident):
        run.signal(sig)
        yield run, ident, run.exit_code()


@pytest.mark.slow
def test_a_shell_that_pipes_torchrun_into_tee_still_flushes_exits_75_and_leaves_nothing(tmp_path: Path) -> None:
    # One rank: what is tested is the shell and the pipe between the agent and torchrun; how the
    # ranks of a job agree on the flush is test_agent_torchrun.py's (a second rank here imported
    # torch, about 2.5 CPU-s, for nothing this test reads).
    torchrun = shlex.join(
        [str(BIN / "torchrun"), "--nproc-per-node", "1", "--master-port", str(free_port()), str(TRAIN)]
    )
    script = f"{torchrun} --steps 100000 --step-sleep 0.05 2>&1 | tee train.log; echo wrapper done"
    run = start_agent(tmp_path, ["sh", "-c", script])
    try:
        ident = agent_id(run)
        # Real torchrun ranks import torch before their first step: on a loaded machine that
        # alone took over WAIT (30 s, sized for the fake ranks), as test_agent_torchrun.py allows.
        run.wait_training(steps=3, timeout=TORCHRUN_START)
        run.signal(signal.SIGTERM)
        assert run.exit_code() == EXIT_PREEMPTED, run.log()
        result = run.control.flush_result()
        assert result is not None and result.error is None and result.step, run.log()
        assert "wrapper done" in run.log()  # the shell went on after torchrun, as written
        assert "committed step" in (tmp_path / "train.log").read_text()  # tee got the ranks' output
        assert marked_processes(ident) == []
    finally:
        stop(run)


def test_sigquit_to_the_agent_stops_every_process_of_the_command_instead_of_orphaning_them(
    tmp_path: Path,
) -> None:
    # Ctrl-\ in a terminal reaches the agent only (the command has a session of its own). Python
    # leaves SIGQUIT at its default, so the agent used to dump core and leave the launcher and
    # its ranks training on, with nobody to hear a notice or flush.
    with fake_ranks_signalled(tmp_path, signal.SIGQUIT) as (run, ident, code):
        assert code >= 0, f"the agent died of signal {-code}\n{run.log()}"
        assert marked_processes(ident) == [], run.log()
        assert "SIGQUIT" in run.log()
        assert run.control.flush_request() is None  # a quit is no notice: no flush was asked for


@pytest.mark.parametrize("sig", [signal.SIGUSR1, signal.SIGUSR2])
def test_sigusr1_or_sigusr2_to_the_agent_is_a_notice_the_ranks_flush_on(tmp_path: Path, sig: signal.Signals) -> None:
    # SLURM's `--signal=[B:]USR1@120` (and other batch schedulers) warn of the end of an allocation
    # with SIGUSR1 or SIGUSR2. Python leaves both at their default, which ended the agent alone
    # (-10 / -12) and left the launcher and its ranks training with nobody to hear a notice.
    with fake_ranks_signalled(tmp_path, sig) as (run, ident, code):
        assert code == EXIT_PREEMPTED, f"exit {code}\n{run.log()}"
        request = run.control.flush_request()
        assert request is not None and sig.name in request.reason, run.log()
        assert marked_processes(ident) == [], run.log()


def test_torchrun_restarting_its_workers_in_place_is_warned_of_at_start_and_a_plain_run_is_not(
    tmp_path: Path,
) -> None:
    # torchrun --max-restarts N restarts a failed worker group in place, which under torch 2.13's
    # gloo fails or hangs in the Checkpointer's process groups (README "Known limits"): the
    # agent says so when it starts the command, before any restart could hang it.
    # The warning comes from the command line and environment alone, so the real torchrun runs a
    # rank that imports nothing and exits 0 (it ran examples/train.py for 3 steps, which added a
    # process importing torch to each of the three runs and tested nothing more here).
    warned = "restarts the worker group in place"
    rank = tmp_path / "rank.py"
    rank.write_text("import os\nassert os.environ['RANK'] == '0'\nprint('rank 0 ran')\n")
    for restarts, env in (("2", {}), ("0", {}), (None, {"PET_MAX_RESTARTS": "1"})):
        run_dir = tmp_path / f"run-{restarts}-{len(env)}"
        run_dir.mkdir()
        option = ["--max-restarts", restarts] if restarts is not None else []
        torchrun = [str(BIN / "torchrun"), *option, "--nproc-per-node", "1", "--master-port", str(free_port())]
        run = start_agent(run_dir, [*torchrun, str(rank)], extra_env=env)
        try:
            assert run.exit_code() == 0, run.log()
            assert "rank 0 ran" in run.log(), run.log()
            assert (warned in run.log()) is (restarts != "0"), run.log()
        finally:
            stop(run)


def _orphans_then_wait(go: Path, started: Path, setsid: bool = False) -> list[str]:
    """A shell that leaves orphans exiting at once (``(/bin/true &)``: they are the agent's
    children as a subreaper, and exit before its walk can see them), then waits for ``go``."""
    spawn = "(/bin/true &); (/bin/true &); (/bin/true &)"
    if setsid:  # a daemon's way: a session of its own, whose leader is gone before anyone saw it
        spawn = f"setsid sh -c {shlex.quote(spawn)}"
    script = f"{spawn}; touch {shlex.quote(str(started))}; while [ ! -e {shlex.quote(str(go))} ]; do sleep 0.05; done"
    return ["sh", "-c", script]


def test_orphans_that_exit_before_the_agent_sees_them_are_reaped_not_left_as_zombies(tmp_path: Path) -> None:
    go, started = tmp_path / "go", tmp_path / "started"
    run = start_agent(tmp_path, _orphans_then_wait(go, started))
    try:
        wait_until(started.exists, "the orphans to be started", run)
        # Without reaping they stay zombies for the job's whole life (the agent is their parent).
        wait_until(lambda: zombie_children(run.proc.pid) == [], "the agent to reap its zombie children", run)
        go.touch()
        assert run.exit_code() == 0, run.log()
    finally:
        stop(run)


def _unshare_works() -> bool:
    if shutil.which("unshare") is None:
        return False
    try:
        done = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"], capture_output=True, timeout=WAIT)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


@pytest.mark.skipif(not _unshare_works(), reason="needs unshare --pid --fork --mount-proc (root, or user namespaces)")
def test_as_pid_1_of_a_pid_namespace_the_agent_reaps_even_orphans_of_other_sessions(tmp_path: Path) -> None:
    # A container without an init: the agent is PID 1, so every orphan in it is its child,
    # including a daemon's, whose session (its own, its leader gone) says nothing of the job.
    go, started = tmp_path / "go", tmp_path / "started"
    run = start_agent(
        tmp_path, _orphans_then_wait(go, started, setsid=True), prefix=("unshare", "--pid", "--fork", "--mount-proc")
    )
    try:
        wait_until(started.exists, "the orphans to be started", run)
        agent = psutil.Process(run.proc.pid).children()  # unshare forks; its child is PID 1 inside
        assert len(agent) == 1, agent
        wait_until(lambda: zombie_children(agent[0].pid) == [], "PID 1 (the agent) to reap its zombie children", run)
        go.touch()
        assert run.exit_code() == 0, run.log()
    finally:
        stop(run)


def test_a_script_whose_interpreter_is_missing_exits_127_naming_the_interpreter_not_the_script(
    tmp_path: Path,
) -> None:
    # exec() fails with ENOENT for a missing #! interpreter too: the log used to say
    # "No such file or directory: 'train.sh'" about a script that is right there.
    script = tmp_path / "train.sh"
    script.write_text("#!/nonexistent/bin/python3\nprint('never')\n")
    script.chmod(0o755)
    run = start_agent(tmp_path, [str(script)])
    try:
        assert run.exit_code() == 127, run.log()
        assert "the interpreter its first line names (/nonexistent/bin/python3) does not" in run.log()
    finally:
        stop(run)


def test_a_program_not_on_path_exits_127_and_says_where_it_looked(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text("print('here')\n")
    run = start_agent(tmp_path, ["train.py"])
    try:
        assert run.exit_code() == 127, run.log()
        assert "train.py: not found on PATH (" in run.log()
        assert "the one in the working folder is ./train.py" in run.log()
    finally:
        stop(run)


def test_a_hangup_the_agent_was_started_ignoring_stays_ignored(tmp_path: Path) -> None:
    # `nohup spotjob-agent ... &`: the agent used to install its handler over the inherited
    # SIG_IGN, so closing the terminal flushed and ended the job nohup was meant to keep running.
    # The SIGTERM after it is the notice (the two are handled in the order they came).
    ignoring = ("sh", "-c", 'trap "" HUP; exec "$@"', "sh")
    fake = [sys.executable, str(FAKE_RANKS), "--nproc", "2", "--mode", "flush"]
    run = start_agent(tmp_path, fake, prefix=ignoring)
    try:
        run.wait_training(steps=3)
        run.signal(signal.SIGHUP)
        run.signal(signal.SIGTERM)
        assert run.exit_code() == EXIT_PREEMPTED, run.log()
        assert "SIGTERM received" in run.flush_reason(), run.log()
        assert "SIGHUP: ignored when the agent started" in run.log()
    finally:
        stop(run)


def test_a_quit_or_hangup_ignored_when_the_agent_started_gets_no_stop_handler(tmp_path: Path) -> None:
    # The handlers that stop the command without a flush (SIGQUIT always; the rest with no signal
    # source) leave an inherited SIG_IGN of SIGQUIT or SIGHUP alone: a shell's background job
    # ignores SIGQUIT so that Ctrl-\ at its terminal does not end it. SIGTERM, SIGINT, SIGUSR1 and
    # SIGUSR2 are heard.
    config, _ = parse_args(["--checkpoint-uri", f"file://{tmp_path}/ckpt", "--no-sigterm", "--", "x"], {})
    agent = Agent(config, ControlDir(str(tmp_path / "control")), env={})
    watched = (
        signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGTSTP
    )  # fmt: skip
    before = {sig: signal.getsignal(sig) for sig in watched}
    try:
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        signal.signal(signal.SIGQUIT, signal.SIG_IGN)
        signal.signal(signal.SIGTSTP, signal.SIG_DFL)
        previous = agent._install_fallback_signals()
        assert set(previous) == {signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGTSTP}
        assert signal.getsignal(signal.SIGHUP) == signal.getsignal(signal.SIGQUIT) == signal.SIG_IGN
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


def test_a_sigterm_or_ctrl_c_while_the_agent_exits_does_not_take_its_exit_code_away(tmp_path: Path) -> None:
    # The agent restored the default handlers on its way out: a second SIGTERM (or Ctrl-C) in
    # those last milliseconds, after the flush committed, killed it, and 75 became 143 (or a
    # KeyboardInterrupt traceback). Here the signals come right after main() returned, in the
    # same process, where the agent's exit (cli(): os._exit(code)) would come.
    code = (
        "import os, signal, sys\n"
        "from agent.launcher import main\n"
        f"code = main(['--checkpoint-uri', {f'file://{tmp_path}/ckpt'!r}, '--cloud', 'none', '--', 'true'])\n"
        "os.kill(os.getpid(), signal.SIGTERM)\n"
        "os.kill(os.getpid(), signal.SIGINT)\n"
        "os.kill(os.getpid(), signal.SIGHUP)\n"
        "os.kill(os.getpid(), signal.SIGQUIT)\n"
        "print('survived', flush=True)\n"
        "os._exit(code)\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPOTJOB_")}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=WAIT)
    assert (done.returncode, done.stdout.strip()) == (0, "survived"), done.stderr


def test_ctrl_z_pauses_every_process_of_the_command_and_fg_resumes_them(tmp_path: Path) -> None:
    # Ctrl-Z at a terminal sends SIGTSTP to the foreground process group: the agent alone, since
    # the command runs in a session of its own. The agent used to stop by the default and leave
    # the launcher and its ranks training on, with nobody to hear a notice. Now it stops every
    # process of the command, then itself; `fg` (SIGCONT) resumes them all and a notice still
    # flushes. A job of several nodes is not modelled: only this node's processes pause.
    with fake_ranks_training(tmp_path) as (run, ident):

        def states() -> set[str]:
            out = set()
            for pid in [run.proc.pid, *marked_processes(ident)]:
                with contextlib.suppress(psutil.NoSuchProcess):
                    out.add(psutil.Process(pid).status())
            return out

        run.signal(signal.SIGTSTP)
        wait_until(lambda: states() == {psutil.STATUS_STOPPED}, "the agent and its command stopped", run)
        assert len(marked_processes(ident)) == 3  # the launcher and both ranks, paused, not gone
        run.signal(signal.SIGCONT)
        wait_until(lambda: psutil.STATUS_STOPPED not in states(), "the agent and its command resumed", run)
        status = run.control.status()
        assert status is not None and status.step is not None
        run.wait_training(steps=status.step + 3)  # training goes on
        run.signal(signal.SIGTERM)
        assert run.exit_code() == EXIT_PREEMPTED, run.log()
        assert "SIGTSTP" in run.log()
        assert marked_processes(ident) == []


def test_a_command_the_agent_had_to_sigkill_is_not_blamed_on_the_oom_killer(tmp_path: Path) -> None:
    # A script that ignores SIGTERM, stopped without a flush (here: SIGTERM with --no-sigterm; a
    # SIGQUIT or POST /stop alike), outlives --kill-grace and the agent SIGKILLs it. The exit line
    # used to send the user to dmesg for the OOM killer, although the agent had just killed it.
    ignores = "import signal; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
    exit_line = _exit_line_of_a_sigterm_without_flush(tmp_path, ignores, 137)
    assert "OOM" not in exit_line, exit_line
    assert "--kill-grace" in exit_line and "SIGKILL" in exit_line, exit_line


def _exit_line_of_a_sigterm_without_flush(tmp_path: Path, setup: str, code: int) -> str:
    """Start ``setup`` and then a sleep under an agent that does not flush on SIGTERM (--no-sigterm),
    SIGTERM the agent once the command runs, check it exits ``code`` with nothing of the command
    left, and return its exit line."""
    script = f"{setup}import time; print('up', flush=True); time.sleep(600)"
    run = start_agent(tmp_path, [sys.executable, "-c", script], "--no-sigterm")
    try:
        ident = agent_id(run)
        wait_until(lambda: "up" in run.log().splitlines(), "the command running", run)
        run.signal(signal.SIGTERM)
        assert run.exit_code() == code, run.log()
        assert marked_processes(ident) == []
        return next(line for line in run.log().splitlines() if f"exiting {code}" in line)
    finally:
        stop(run)


def test_a_second_ctrl_c_during_a_flush_says_how_to_stop_at_once_and_ctrl_backslash_does(tmp_path: Path) -> None:
    # At a terminal, a second Ctrl-C while the flush waits for ranks that will not answer (a
    # script without spotjob's Checkpointer, a hung rank) changes nothing, by design; the log
    # used to say only "no second flush", leaving the user to wait out --sigterm-grace.
    loop = "import time\nwhile True: time.sleep(0.05)\n"
    run = start_agent(tmp_path, [sys.executable, "-c", loop], "--sigterm-grace", "600")
    try:
        ident = agent_id(run)
        wait_until(lambda: bool(marked_processes(ident)), "the command running", run)
        run.signal(signal.SIGINT)
        wait_until(lambda: run.control.flush_request() is not None, "the flush", run)
        run.signal(signal.SIGINT)
        wait_until(lambda: "no second flush" in run.log(), "the second Ctrl-C logged", run)
        repeat = next(line for line in run.log().splitlines() if "no second flush" in line)
        assert "SIGQUIT (Ctrl-\\)" in repeat, repeat
        run.signal(signal.SIGQUIT)
        assert run.exit_code() == 76, run.log()
        assert marked_processes(ident) == []
    finally:
        stop(run)


def test_a_command_stopped_on_a_signal_the_agent_does_not_take_as_a_notice_is_not_said_to_have_failed_by_itself(
    tmp_path: Path,
) -> None:
    """The chaos soak SIGTERMed the agent of a `spotjob run` worker (its agents hear only their
    cloud: --notices aws). The agent stopped the command without a flush, as it should, and said
    only "exiting 143: the command exited 143", as if the command had failed by itself."""
    exit_line = _exit_line_of_a_sigterm_without_flush(tmp_path, "", 143)
    assert "spotjob-agent stopped the command without a flush on SIGTERM, which it does not take" in exit_line, (
        exit_line
    )
    assert "does not take as a notice" in exit_line, exit_line
