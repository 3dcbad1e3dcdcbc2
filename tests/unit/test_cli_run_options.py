"""spotjob run's own checks of its options, below the command line (tests/e2e/test_cli_errors.py
runs the real command): what a spec refusal says when a check of ours missed it, and the checks
of paths that must not create anything."""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from orchestrator.live import RunRecord, _resume_command
from orchestrator.model import JobSpec
from orchestrator.run_config import RunConfig, checkpoint_uri_problem, describe_option_error, plot_problem


def spec_error(**fields: object) -> ValidationError:
    base: dict[str, object] = {"command": ["train.py"], "checkpoint": {"uri": "/ckpt"}}
    base.update(fields)
    with pytest.raises(ValidationError) as caught:
        JobSpec.model_validate(base)
    return caught.value


@pytest.mark.parametrize(
    ("fields", "said"),
    [
        ({"checkpoint": {"uri": "/ckpt", "keep": 0}}, "--keep must be greater than or equal to 1"),
        ({"nprocPerNode": 0}, "--nproc must be greater than or equal to 1"),
        ({"maxRestarts": -1}, "--max-restarts must be greater than or equal to 0"),
        ({"flushTimeoutSeconds": 0}, "--flush-timeout must be greater than 0"),
        ({"restartBackoff": {"initialSeconds": 90, "maxSeconds": 60}}, "--restart-backoff: restartBackoff.maxSeconds"),
        ({"flushTimeoutSeconds": 2 * 24 * 3600}, "--flush-timeout must be less than or equal to 86400"),
        ({"startTimeoutSeconds": 400 * 24 * 3600}, "startTimeoutSeconds must be less than or equal to 31536000"),
        ({"noticeSeconds": float("inf")}, "--notice must be a finite number"),
    ],
)
def test_a_spec_refusal_is_said_of_the_option_in_plain_words(fields: dict[str, object], said: str) -> None:
    message = describe_option_error(spec_error(**fields))

    assert message.startswith(said), message
    assert "Input should be" not in message and "Value error" not in message and "pydantic" not in message


def test_checking_a_checkpoint_folder_or_a_plot_path_leaves_nothing_behind(tmp_path: Path) -> None:
    assert checkpoint_uri_problem(str(tmp_path / "new" / "ckpt")) is None
    assert plot_problem(str(tmp_path / "plots" / "run.png")) is None
    (tmp_path / "afile").write_text("x")
    assert "regular file" in (checkpoint_uri_problem(str(tmp_path / "afile")) or "")
    assert "is a file" in (checkpoint_uri_problem(str(tmp_path / "afile" / "ckpt")) or "")
    assert [p.name for p in tmp_path.iterdir()] == ["afile"], "the probes are gone"


@pytest.mark.parametrize(
    "fields",
    [
        {"flushTimeoutSeconds": float("inf")},
        {"flushTimeoutSeconds": float("nan")},
        {"noticeSeconds": 10**9},
        {"startTimeoutSeconds": float("inf")},
        {"checkpoint": {"uri": "/ckpt", "everySeconds": float("inf")}},
        {"restartBackoff": {"initialSeconds": 1, "maxSeconds": float("inf")}},
        {"restartBackoff": {"resetAfterSeconds": 1e12}},
        {"cooldown": {"seconds": float("inf")}},
        {
            "template": {"spec": {"containers": [{"name": "t", "image": "i"}]}},
            "startTimeoutSeconds": 60,
            "fallback": {"template": {}, "returnAfterSeconds": float("inf")},
        },
    ],
)
def test_every_duration_of_the_spec_is_finite_and_at_most_a_year(fields: dict[str, object]) -> None:
    spec_error(**fields)


def test_a_year_is_still_a_duration_and_a_day_a_flush_timeout() -> None:
    spec = JobSpec.model_validate(
        {
            "command": ["train.py"],
            "checkpoint": {"uri": "/ckpt"},
            "startTimeoutSeconds": 365 * 24 * 3600,
            "flushTimeoutSeconds": 24 * 3600,
        }
    )
    assert spec.start_timeout_seconds == 365 * 24 * 3600 and spec.flush_timeout_seconds == 24 * 3600


@pytest.mark.parametrize(
    ("option", "change"),
    [
        ("--every-seconds", {"every_seconds": 1e12}),
        ("--restart-backoff", {"restart_backoff": float("inf")}),
        ("--restart-backoff", {"restart_backoff": 4e7}),
        ("--preempt-every", {"preempt_every": float("inf")}),
    ],
)
def test_a_local_duration_that_is_not_finite_or_over_a_year_is_refused_naming_the_option(
    option: str, change: dict[str, object]
) -> None:
    with pytest.raises(ValueError, match=f"^{option} must be .*at most 31536000 \\(one year\\)"):
        RunConfig(script="/train.py", args=[], name="run", **change)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("option", "change"),
    [
        ("--flush-timeout", {"flush_timeout": float("inf")}),
        ("--flush-timeout", {"flush_timeout": 1e9}),
        ("--notice", {"notice": float("nan")}),
        ("--notice", {"notice": 2 * 24 * 3600}),
    ],
)
def test_a_local_flush_timeout_or_notice_not_finite_or_over_a_day_is_refused_naming_the_option(
    option: str, change: dict[str, object]
) -> None:
    with pytest.raises(ValueError, match=f"^{option} must be .*at most 86400 \\(a day: what spotjob-agent takes\\)"):
        RunConfig(script="/train.py", args=[], name="run", **change)  # type: ignore[arg-type]


def test_a_run_is_resumed_with_its_own_nproc_on_a_machine_with_fewer_cpus(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--nproc is bounded by the CPUs when a run is made (a mistyped 20000), but a run made on a
    larger machine (a shared runs folder, a VM resized smaller) keeps its spec, which --resume
    cannot change: it used to be refused with '--nproc must be at most ...', an option the
    resumed run does not take."""
    from orchestrator.run_driver import LocalRun

    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    runs = str(tmp_path / "runs")
    monkeypatch.setattr("os.cpu_count", lambda: 4)
    made = LocalRun(RunConfig(script=str(script), args=[], name="big", runs_dir=runs, nproc=16))
    made.close()

    monkeypatch.setattr("os.cpu_count", lambda: 1)
    resumed = LocalRun.resume(runs, "big")
    try:
        assert resumed.config.nproc == 16
    finally:
        resumed.close()


def test_a_run_made_and_closed_without_running_leaves_no_thread_behind(tmp_path: Path) -> None:
    """Before, close() only gave up the driver lock: the backend's monitor thread ran on (and, in a
    test process, broke a later test's check that an agent leaves no spotjob thread behind)."""
    import threading

    from orchestrator.run_driver import LocalRun

    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    before = set(threading.enumerate())
    made = LocalRun(RunConfig(script=str(script), args=[], name="unrun", runs_dir=str(tmp_path / "runs"), nproc=1))
    made.close()
    resumed = LocalRun.resume(str(tmp_path / "runs"), "unrun")
    resumed.close()
    resumed.close()  # idempotent
    assert not [t.name for t in threading.enumerate() if t not in before and t.is_alive()]


def test_a_bad_agent_setting_in_spotjob_runs_environment_is_refused_before_anything_is_created(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``SPOTJOB_AGENT_PREFETCH=nodes`` in the shell reaches every worker's agent, which exits 2 on
    it. Before the fix the run was created and its workers failed; now ``spotjob run`` refuses it as
    it refuses a bad option, in the agent's words, and creates no run folder. A resumed run is
    checked in the environment of the ``spotjob run`` that resumes it."""
    from orchestrator.run_driver import LocalRun

    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    runs = tmp_path / "runs"
    monkeypatch.setenv("SPOTJOB_AGENT_PREFETCH", "nodes")
    with pytest.raises(
        ValueError, match=r"SPOTJOB_AGENT_PREFETCH 'nodes': expected one of node, all, off \(read from this environment"
    ):
        LocalRun(RunConfig(script=str(script), args=[], name="bad", runs_dir=str(runs), nproc=1))
    assert not (runs / "bad").exists()

    monkeypatch.delenv("SPOTJOB_AGENT_PREFETCH")
    LocalRun(RunConfig(script=str(script), args=[], name="good", runs_dir=str(runs), nproc=1)).close()
    monkeypatch.setenv("SPOTJOB_AGENT_RANK_CONNECT_TIMEOUT", "-1")
    with pytest.raises(ValueError, match=r"SPOTJOB_AGENT_RANK_CONNECT_TIMEOUT='-1': must be more than 0"):
        LocalRun.resume(str(runs), "good")
    monkeypatch.delenv("SPOTJOB_AGENT_RANK_CONNECT_TIMEOUT")
    LocalRun.resume(str(runs), "good").close()  # the driver lock was given back


def test_a_checkpoint_uri_another_job_owns_is_refused_before_the_run_is_made(tmp_path: Path) -> None:
    """Before, the run was made, its first worker failed (CheckpointURIOwned), and the advice, adopt
    the URI for job local/b, left the checkpoints to a Failed run b that could neither run again
    (the name is taken) nor be resumed (it failed). Now nothing is made, and the advice works: adopt
    for this run's job, then the same command runs."""
    from agent.ownership import adopt, claim
    from agent.storage import open_storage
    from orchestrator.run_driver import LocalRun
    from orchestrator.run_setup import RunError

    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    uri, runs = tmp_path / "ckpt", tmp_path / "runs"
    storage = open_storage(str(uri))
    claim(storage, "local/a")

    def config() -> RunConfig:
        return RunConfig(script=str(script), args=[], name="b", runs_dir=str(runs), nproc=1, checkpoint_uri=str(uri))

    with pytest.raises(RunError) as refused:
        LocalRun(config())
    said = str(refused.value)
    assert "belongs to job 'local/a', not to this run (local/b)" in said and "--job local/b" in said, said
    assert not (runs / "b").exists()
    adopt(storage, "local/b")  # what `spotjob ckpt adopt URI --job local/b` does
    LocalRun(config()).close()


def test_resume_refuses_a_checkpoint_uri_another_job_owns_or_storage_refuses_and_leaves_the_run_resumable(
    tmp_path: Path,
) -> None:
    """``spotjob ckpt adopt URI --job local/b`` of run a's URI, or its checkpoints folder turned
    into a file: ``--resume a`` drove the run into Failed (CheckpointURIOwned, StorageRefused), whose
    advice (adopt the URI for local/a; fix it and submit again) then met "run 'a' failed already,
    there is nothing to resume ... (they belong to local/a)". Now --resume is refused (exit 2)
    naming the owner, the run is unchanged, and once the URI is fixed the same --resume runs."""
    from agent.ownership import adopt, claim
    from agent.storage import open_storage
    from orchestrator.run_driver import LocalRun
    from orchestrator.run_setup import RunError

    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    runs = tmp_path / "runs"
    LocalRun(RunConfig(script=str(script), args=[], name="a", runs_dir=str(runs), nproc=1)).close()
    folder, job_file = runs / "a" / "checkpoints", runs / "a" / "local" / "a.json"
    storage = open_storage(str(folder))
    claim(storage, "local/a")  # what the run's first worker does
    adopt(storage, "local/b")  # what `spotjob ckpt adopt URI --job local/b` does
    before = job_file.read_text()

    with pytest.raises(RunError) as refused:
        LocalRun.resume(str(runs), "a")
    said = str(refused.value)
    assert f"its checkpoint URI {folder} belongs to job 'local/b', not to this run (local/a)" in said, said
    assert f"`spotjob ckpt adopt {folder} --job local/a`, then run `spotjob run --runs-dir {runs}" in said, said
    assert "Nothing of run 'a' was changed, and it can still be resumed" in said, said
    assert job_file.read_text() == before, "a refused --resume changed the run"

    adopt(storage, "local/a")  # the advice
    LocalRun.resume(str(runs), "a").close()

    folder.rename(tmp_path / "away")
    folder.write_text("not a folder")
    before = job_file.read_text()
    with pytest.raises(RunError) as refused:
        LocalRun.resume(str(runs), "a")
    said = str(refused.value)
    assert f"storage refuses its checkpoint URI {folder} (" in said and "is a regular file, not a folder" in said
    assert f"make {folder} readable again" in said and "Nothing of run 'a' was changed" in said, said
    assert job_file.read_text() == before, "a refused --resume changed the run"

    folder.unlink()
    (tmp_path / "away").rename(folder)
    LocalRun.resume(str(runs), "a").close()


def test_resume_of_a_failed_run_names_who_owns_its_checkpoints_now(tmp_path: Path) -> None:
    """Its refusal said "(they belong to local/NAME)" whoever owned them: after `spotjob ckpt
    adopt --job local/b` they are local/b's."""
    from agent.ownership import adopt, claim
    from agent.storage import open_storage
    from orchestrator.model import JobKey, JobStatus, Phase
    from orchestrator.run_driver import LocalRun
    from orchestrator.run_setup import RunError
    from orchestrator.store import JsonFileJobStore

    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    runs = tmp_path / "runs"
    LocalRun(RunConfig(script=str(script), args=[], name="a", runs_dir=str(runs), nproc=1)).close()
    store = JsonFileJobStore(str(runs / "a"), create=False)
    stored = store.get(JobKey.local("a"))
    assert stored is not None
    failed = JobStatus(phase=Phase.FAILED, reason="RestartBudgetExhausted", message="all 3 restart(s) are used")
    store.update_status(JobKey.local("a"), failed, version=stored.version)
    storage = open_storage(str(runs / "a" / "checkpoints"))
    claim(storage, "local/a")
    adopt(storage, "local/b")

    with pytest.raises(RunError) as refused:
        LocalRun.resume(str(runs), "a")
    said = str(refused.value)
    assert f"its checkpoints in {runs / 'a' / 'checkpoints'} (they belong to job 'local/b')" in said, said
    assert "local/a)" not in said, said


def test_a_run_that_stopped_on_an_invalid_spec_says_why_not_its_phases_reason() -> None:
    """A local job the reconciler found invalid stops while its phase is still Pending (reason
    Created): ``spotjob run`` said "failed: Created: waiting for the first pass", never the
    Invalid condition's message that says what to fix."""
    from datetime import UTC, datetime

    from orchestrator.model import Condition, JobStatus, Phase
    from orchestrator.run_outcome import failure_line

    status = JobStatus(phase=Phase.PENDING, reason="Created", message="waiting for the first pass")
    assert failure_line("r1", status) == "spotjob run: r1 failed: Created: waiting for the first pass"
    status.conditions.append(
        Condition(
            type="Invalid",
            status="True",
            reason="InvalidSpec",
            message="spec.env: fix SPOTJOB_AGENT_X",
            last_transition_time=datetime.now(UTC),
        )
    )
    line = failure_line("r1", status)
    assert line == "spotjob run: r1 did not start: InvalidSpec: spec.env: fix SPOTJOB_AGENT_X"


def test_only_a_run_whose_script_used_up_its_restarts_with_a_checkpoint_is_told_how_to_carry_on() -> None:
    """The carry-on line names the newest checkpoint and commands a shell takes as they are (a URI
    with a space quoted); a run that failed otherwise (another job owns the URI) or left nothing
    committed gets none (tests/e2e/test_local_run.py follows the commands)."""
    import shlex

    from orchestrator.model import JobStatus, Phase
    from orchestrator.run_outcome import carry_on_line

    used_up = JobStatus(phase=Phase.FAILED, reason="RestartBudgetExhausted", message="all 1 restart(s) are used")
    line = carry_on_line("r1", "/data/my runs/ckpt", used_up, 40)
    assert line is not None and "the newest checkpoint of r1, step 40, stays in /data/my runs/ckpt" in line
    adopt, run = re.findall(r"`([^`]+)`", line)
    assert shlex.split(adopt) == ["spotjob", "ckpt", "adopt", "/data/my runs/ckpt", "--job", "local/NEW"]
    assert shlex.split(run)[:6] == ["spotjob", "run", "--name", "NEW", "--checkpoint-uri", "/data/my runs/ckpt"]
    # A run under another --runs-dir: the new run goes beside it, where `spotjob status` finds both.
    elsewhere = carry_on_line("r1", "/ckpt", used_up, 40, "/data/my runs")
    assert elsewhere is not None
    _, run = re.findall(r"`([^`]+)`", elsewhere)
    assert shlex.split(run)[:4] == ["spotjob", "run", "--runs-dir", "/data/my runs"], run
    assert carry_on_line("r1", "/ckpt", used_up, None) is None
    # run_folder spells the reconciler's reason for `spotjob status`, which does not import it.
    from orchestrator.reconciler import RESTART_BUDGET_EXHAUSTED
    from orchestrator.run_folder import RESTART_BUDGET_EXHAUSTED as SPELLED

    assert RESTART_BUDGET_EXHAUSTED.name == SPELLED
    owned = JobStatus(phase=Phase.FAILED, reason="CheckpointURIOwned", message="another job owns it")
    assert carry_on_line("r1", "/ckpt", owned, 40) is None
    assert carry_on_line("r1", "/ckpt", JobStatus(phase=Phase.SUCCEEDED, reason="Completed", message=""), 40) is None


def test_a_plot_of_a_type_matplotlib_cannot_write_is_refused_naming_every_type_it_can(tmp_path: Path) -> None:
    """``--plot run.bmp`` was told "use .png, .svg or .pdf" while .jpg, .eps, .tif and the others
    were accepted too (found walking the README); the refusal now names them all, and a .jpg or
    .webp path passes."""
    said = plot_problem(str(tmp_path / "run.bmp")) or ""
    assert "cannot draw a '.bmp' file" in said
    for kind in ("png", "svg", "pdf", "jpg", "eps", "tif", "webp"):
        assert f".{kind}" in said, said
    assert plot_problem(str(tmp_path / "run.jpg")) is None and plot_problem(str(tmp_path / "run.webp")) is None


_INTERRUPTED_THEN_SIGNALLED = """
import os, signal, sys
from types import SimpleNamespace

import orchestrator.cli_run as cli_run
from orchestrator.cli import main
from orchestrator.run_interrupt import InterruptState

run = SimpleNamespace(name="demo", stopping=False, interrupt=InterruptState())


def drive(_run, _args):
    try:
        os.kill(os.getpid(), signal.SIGTERM)  # the first: ends the controller loop
        signal.pause()
    except KeyboardInterrupt:
        run.stopping = True
        os.kill(os.getpid(), signal.SIGTERM)  # a repeat while it stops: logged, the stop goes on
    return 130


cli_run.prepare = lambda args: run
cli_run._drive = drive
code = main(["run", "train.py"])
os.kill(os.getpid(), signal.SIGTERM)  # a repeat after the stop, before the process ends
# Ignored, not handled: the interpreter's shutdown puts a Python handler back to the default.
print("exited by itself;", "ignored" if signal.getsignal(signal.SIGTERM) is signal.SIG_IGN else "handled", flush=True)
sys.exit(code)
"""


def test_a_sigterm_repeated_after_an_interrupted_run_stopped_does_not_end_the_driver_by_the_signal(
    tmp_path: Path,
) -> None:
    """A supervisor repeats its SIGTERM until the process is gone. The driver put its handlers back
    once the run was stopped, so a repeat in the moment before the process ended killed it by the
    signal (-15; 143 to a shell) instead of its exit 130. The moment is made certain here: the
    repeat is sent once ``spotjob run``'s command has returned (its run and driving stubbed). The
    signal stays ignored, not handled, to the end: the interpreter's shutdown gives a Python
    handler back to the default (tests/e2e/test_local_recovery.py repeats it until the exit)."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", _INTERRUPTED_THEN_SIGNALLED],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 130, (done.returncode, done.stderr[-3000:])
    assert done.stdout.strip() == "exited by itself; ignored"
    assert "received SIGTERM again: still stopping every process of demo" in done.stderr, done.stderr[-3000:]


_PLOT_ON_A_NEW_MACHINE = """
import sys
from types import SimpleNamespace

import orchestrator.cli_run as cli_run
from orchestrator.cli import main
from orchestrator.run_interrupt import InterruptState


def drive(_run, _args):
    import matplotlib.font_manager  # noqa: F401  (what the run's plot imports first)

    return 0


cli_run.prepare = lambda args: SimpleNamespace(name="demo", stopping=False, interrupt=InterruptState())
cli_run._drive = drive
sys.exit(main(["run", "train.py"]))
"""


def test_matplotlib_building_its_font_cache_on_a_new_machine_says_nothing_among_the_runs_lines(
    tmp_path: Path,
) -> None:
    """``make demo`` on a new machine printed "INFO matplotlib.font_manager: generated new
    fontManager" among the run's lines, as its plot was drawn: matplotlib logs it the first time it
    runs on a machine, which an empty ``MPLCONFIGDIR`` makes every time here. The run and its
    driving are stubbed; the driving imports matplotlib's font manager as the plot does. With -v
    it is said, as the cloud clients' lines are."""
    import subprocess
    import sys

    def run(*extra: str) -> str:
        config = tmp_path / f"mpl{len(extra)}"
        config.mkdir()
        env = {**os.environ, "MPLCONFIGDIR": str(config)}
        script = _PLOT_ON_A_NEW_MACHINE.replace('["run", "train.py"]', repr([*extra, "run", "train.py"]))
        done = subprocess.run(
            [sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0, done.stderr[-3000:]
        return done.stderr

    assert "fontManager" not in run()
    assert "generated new fontManager" in run("-v")


class _ResumedRunInterruptedAsHandedOver:
    """A resumed run as ``prepare`` hands it over, with a Ctrl-C landing at once: the first look at
    it (``isinstance(run, int)``, which reads ``__class__``) raises the handler's
    ``KeyboardInterrupt``, in the moment before ``spotjob run`` keeps the run where its signal
    handler finds it."""

    def __init__(self) -> None:
        self.closed = 0
        self.interrupted = False

    @property  # type: ignore[misc]
    def __class__(self) -> type:
        if not self.interrupted:
            self.interrupted = True
            raise KeyboardInterrupt("signal 2")
        return _ResumedRunInterruptedAsHandedOver

    def close(self) -> None:
        self.closed += 1


def test_an_interrupt_as_a_resumed_run_is_handed_over_closes_it_and_says_how_to_carry_on(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A Ctrl-C in the moment between ``--resume``'s run being made and ``spotjob run`` keeping it
    for its signal handler exited 130 without closing the run (its backend's threads and its driver
    lock were left to the process's exit). Now the run is closed, and the exit is the same."""
    import orchestrator.cli_run as cli_run
    from orchestrator.cli import main

    run = _ResumedRunInterruptedAsHandedOver()
    monkeypatch.setattr(cli_run, "prepare", lambda args: run)
    # The command leaves SIGINT and SIGTERM ignored until its process exits: not this one's.
    handlers = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGTSTP)}
    try:
        code = main(["run", "--resume", "demo"])
    finally:
        for signum, handler in handlers.items():
            signal.signal(signum, handler)

    assert run.interrupted
    assert code == 130
    assert run.closed == 1
    assert "interrupted before it drove demo; carry on with `spotjob run --resume demo`" in capsys.readouterr().err


@pytest.mark.parametrize("flushing", [True, False], ids=["during-the-flush", "before-it-began"])
def test_the_first_interrupt_flushes_the_second_stops_at_once_and_the_others_are_only_logged(
    flushing: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """The handler of ``spotjob run``'s SIGINT and SIGTERM, called as the interpreter calls it. The
    first ends the controller loop (the run then flushes); the second cuts the flush short: it
    interrupts a flush under way, and one that comes before the flush began keeps it from beginning
    (``LocalRun`` looks at ``again`` first); once the run is stopping, the others are only logged, so
    a supervisor repeating its SIGTERM still reads 130 (tests/e2e/test_local_interrupt.py drives a
    real run)."""
    import signal
    from types import SimpleNamespace

    from orchestrator.run_interrupt import InterruptState
    from orchestrator.run_signal_handlers import _Interrupts

    run = SimpleNamespace(name="demo", stopping=False, interrupt=InterruptState())
    handler = _Interrupts(run)  # type: ignore[arg-type]
    with pytest.raises(KeyboardInterrupt):
        handler(signal.SIGINT, None)
    assert (run.interrupt.signal, run.interrupt.again) == ("SIGINT", None)
    run.interrupt.flushing = flushing
    if flushing:
        with pytest.raises(KeyboardInterrupt):
            handler(signal.SIGTERM, None)
    else:
        handler(signal.SIGTERM, None)
    assert run.interrupt.again == "SIGTERM"
    assert "received SIGTERM again: stopping every process of demo at once, without the flush" in caplog.text
    handler(signal.SIGTERM, None)  # still flushing, or stopping: nothing more to cut short
    run.stopping = True
    handler(signal.SIGINT, None)
    assert caplog.text.count("still stopping every process of demo") == 2


@pytest.mark.parametrize("flushing", [False, True], ids=["first-signal", "second-during-the-flush"])
def test_a_signal_handled_while_ctrl_z_resumes_the_workers_is_raised_once_they_go_on(
    flushing: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fails without the fix: a SIGTERM sent to a paused ``spotjob run`` (with the SIGCONT after it)
    reaches whichever thread of the driver runs first, so its handler can run in the main thread
    once the Ctrl-Z handler's stop has returned, inside ``continue_workers`` before any SIGCONT went
    out. Its ``KeyboardInterrupt`` left every agent stopped: the interrupt's ``POST /flush`` timed
    out and nothing committed (tests/e2e/test_local_interrupt.py's paused run, now and then). Here
    the handler runs just there; the workers must be continued, then the interrupt raised."""
    import signal
    from types import SimpleNamespace

    from orchestrator.run_interrupt import InterruptState
    from orchestrator.run_signal_handlers import _Interrupts, _pause

    said: list[str] = []
    interrupts = _Interrupts()

    class Workers:
        def signal_workers(self, sig: int, *, until_stopped: float = 0.0) -> int:
            said.append(signal.Signals(sig).name)
            return 1

        def continue_workers(self) -> int:
            interrupts(signal.SIGTERM, None)  # the signal's handler lands here, before the SIGCONT
            said.append("SIGCONT")
            return 1

    state = InterruptState(signal="SIGINT", flushing=True) if flushing else InterruptState()
    run = SimpleNamespace(name="demo", stopping=False, interrupt=state, backend=Workers())
    interrupts.run = run  # type: ignore[assignment]
    monkeypatch.setattr("os.kill", lambda pid, sig: said.append(signal.Signals(sig).name))
    with pytest.raises(KeyboardInterrupt):
        _pause(run)  # type: ignore[arg-type]
    assert said == ["SIGTSTP", "SIGSTOP", "SIGCONT"]
    assert (state.signal, state.again) == (("SIGINT", "SIGTERM") if flushing else ("SIGTERM", None))
    assert not state.pausing


def test_a_signal_while_ctrl_z_pauses_the_workers_keeps_the_driver_from_stopping(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A first signal while the agents are being paused: the driver does not stop itself (nobody may
    be there to continue it), the workers go on, and the interrupt is raised."""
    import signal
    from types import SimpleNamespace

    from orchestrator.run_interrupt import InterruptState
    from orchestrator.run_signal_handlers import _Interrupts, _pause

    said: list[str] = []
    interrupts = _Interrupts()

    class Workers:
        def signal_workers(self, sig: int, *, until_stopped: float = 0.0) -> int:
            interrupts(signal.SIGINT, None)
            said.append(signal.Signals(sig).name)
            return 1

        def continue_workers(self) -> int:
            said.append("SIGCONT")
            return 1

    run = SimpleNamespace(name="demo", stopping=False, interrupt=InterruptState(), backend=Workers())
    interrupts.run = run  # type: ignore[assignment]
    monkeypatch.setattr("os.kill", lambda pid, sig: said.append(signal.Signals(sig).name))
    with pytest.raises(KeyboardInterrupt):
        _pause(run)  # type: ignore[arg-type]
    assert said == ["SIGTSTP", "SIGCONT"]
    assert run.interrupt.signal == "SIGINT"


def test_a_signal_that_comes_as_the_run_ends_by_itself_or_after_the_first_left_is_said_as_what_it_is(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Fails without the fix: a first Ctrl-C as a finished run stopped its processes (or drew its
    plot) was logged as "received SIGINT again: still stopping every process", and a second one
    after the first ended ``--resume``'s wait, when nothing is being stopped (its processes are left
    to end their flush), said the same."""
    import signal
    from types import SimpleNamespace

    from orchestrator.model import JobStatus, Phase
    from orchestrator.run_interrupt import InterruptState
    from orchestrator.run_signal_handlers import _Interrupts

    ended = SimpleNamespace(
        name="demo", stopping=True, interrupt=InterruptState(), status=JobStatus(phase=Phase.SUCCEEDED)
    )
    _Interrupts(ended)(signal.SIGINT, None)  # type: ignore[arg-type]
    assert "received SIGINT as demo ends by itself (Succeeded): it exits as the run ended" in caplog.text
    assert ended.interrupt.signal is None, "a finished run is not an interrupted one"

    early = _Interrupts()
    with pytest.raises(KeyboardInterrupt):
        early(signal.SIGTERM, None)
    early(signal.SIGTERM, None)
    assert "received SIGTERM again: spotjob run is leaving already, as the first one made it" in caplog.text
    assert "still stopping" not in caplog.text

    # While a new run is being made, the first one is held (the run is given up once it is made),
    # and nothing is leaving yet: a second one says what will happen instead.
    caplog.clear()
    making = _Interrupts()
    making.early.starting = True
    making(signal.SIGINT, None)
    making(signal.SIGINT, None)
    assert making.early.signal == "SIGINT"
    assert "received SIGINT again: the run being made is given up as soon as it is, as the first one asked" in (
        caplog.text
    )
    assert "leaving already" not in caplog.text


_SUMMARY_TO_A_READER_GONE = """
import os, sys
from types import SimpleNamespace

import orchestrator.cli_run as cli_run
from orchestrator.cli import main
from orchestrator.model import JobStatus, Phase
from orchestrator.run_interrupt import InterruptState

read, write = os.pipe()
os.close(read)  # the reader went away (`spotjob run ... | head -1` once head has its line)
os.dup2(write, sys.stdout.fileno())
status = JobStatus(phase=Phase.FAILED, reason="RestartBudgetExhausted", message="all 3 restart(s) are used")
summary = SimpleNamespace(
    to_json=lambda: {}, text=lambda: "spotjob run demo: Failed\\n" + "  a summary line\\n" * 5000, last_checkpoint=None
)


def plot(path):
    with open(path, "w") as f:
        f.write("an image")


run = SimpleNamespace(
    name="demo", path=os.getcwd(), stopping=False, status=status,
    config=SimpleNamespace(plot="run.png", runs_dir="spotjob-runs"),
    spec=SimpleNamespace(checkpoint=SimpleNamespace(uri="/ckpt")),
    run=lambda view: status, close=lambda: None, summary=lambda: summary, plot=plot,
    failed_worker_logs=lambda: [], interrupt_outcome=None, interrupt=InterruptState(),
)
cli_run.prepare = lambda args: run
sys.exit(main(["run", "--no-live", "train.py"]))
"""


def test_a_summary_whose_reader_went_away_still_draws_the_plot_and_says_why_the_run_failed(tmp_path: Path) -> None:
    """``spotjob run --plot run.png ... | head -1``: the first write of the summary to a stdout whose
    reader had gone raised, so ``--plot`` was never drawn (or, when head left a moment later, was
    drawn but logged as "could not draw the plot: Broken pipe") and a failed run's reason never
    reached stderr. The plot is drawn, the failure is said, and the exit is still 141."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", _SUMMARY_TO_A_READER_GONE],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 141, (done.returncode, done.stderr[-3000:])
    assert (tmp_path / "run.png").read_text() == "an image"
    assert "could not draw the plot" not in done.stderr, done.stderr[-3000:]
    assert "spotjob run: demo failed: RestartBudgetExhausted: all 3 restart(s) are used" in done.stderr
    assert "Traceback" not in done.stderr, done.stderr[-3000:]


def test_a_resumed_run_trains_in_the_folder_the_run_began_in_not_where_resume_was_typed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``spotjob status`` offers ``spotjob run --runs-dir /abs/runs --resume NAME``, which works from
    any folder; its workers ran in that folder, so a script's relative paths (``--dump dumps/x``,
    its data) named other things and the resumed run failed on them, for good (a failed run is not
    resumed). The workers now run where the run's first ones did; a folder gone since is refused."""
    import shutil

    from orchestrator.run_driver import LocalRun
    from orchestrator.run_folder import write_run_file
    from orchestrator.run_setup import RunError

    began, elsewhere, runs = tmp_path / "project", tmp_path / "home", tmp_path / "runs"
    began.mkdir()
    elsewhere.mkdir()
    script = began / "train.py"
    script.write_text("print('hi')\n")
    monkeypatch.chdir(began)
    made = LocalRun(
        RunConfig(script=str(script), args=["--dump", "dumps/x"], name="moved", runs_dir=str(runs), nproc=1)
    )
    assert made.backend.options.workdir == str(began)
    write_run_file(
        made.path, made.workdir, ["spotjob", "run"], parent_grace=30.0
    )  # as its driver does when it starts the run
    made.close()

    monkeypatch.chdir(elsewhere)
    resumed = LocalRun.resume(str(runs), "moved")
    try:
        assert resumed.backend.options.workdir == str(began)
    finally:
        resumed.close()

    shutil.rmtree(began)
    with pytest.raises(RunError, match=r"its workers ran in .*project, which is gone"):
        LocalRun.resume(str(runs), "moved")
    # spotjob status's "to continue" said `spotjob run --resume moved` alone, which this refuses.
    record = RunRecord(name="moved", path=made.path, spec=None, status=None, controller_alive=False)
    assert _resume_command(record) == f"create {began} again (its workers ran there), then " + (
        f"spotjob run --runs-dir {runs} --resume moved"
    )


def test_a_resume_takes_the_step_the_ranks_last_reported_so_the_steps_an_interrupt_lost_are_counted(
    tmp_path: Path,
) -> None:
    """Ctrl-C stops a run without a flush, up to a status refresh (5 s) after the step its status
    last stored: the ranks had reported step 44, the status said 25, the newest commit was 25, and
    the resumed run counted 0 steps lost (and no retraining) for the 19 it trained again. The
    resume now takes the step the ranks last wrote in their control folders, as `spotjob status`
    shows it ("its ranks last reported step 44")."""
    import json
    from datetime import UTC, datetime

    from orchestrator.model import AttemptStatus, JobStatus, Phase, WorkerPhase, WorkerStatus
    from orchestrator.run_driver import LocalRun

    _script, runs, store, key, stored = _made_run(tmp_path, "cut")
    now = datetime.now(UTC)
    status = JobStatus(
        phase=Phase.RUNNING,
        reason="WorkersRunning",
        message="every worker of attempt 0 is running",
        start_time=now,
        attempt=AttemptStatus(number=0, started_at=now, observed_step=25, observed_step_at=now),
        workers=[WorkerStatus(name="cut-0-0", node="local-node-0", phase=WorkerPhase.RUNNING, step=25)],
    )
    store.update_status(key, status, version=stored.version)
    control = runs / "cut" / "nodes" / "local-node-0" / "cut-0-0"
    control.mkdir(parents=True)
    (control / "status.json").write_text(json.dumps({"step": 44, "commits": 1, "last_committed_step": 25}))

    resumed = LocalRun.resume(str(runs), "cut")
    resumed.close()
    after = store.get(key)
    assert after is not None and after.status is not None
    assert after.status.attempt.observed_step == 44


def _made_run(tmp_path: Path, name: str) -> tuple[Path, Path, Any, Any, Any]:
    """A run made (and closed) and never driven: its script, the runs folder, its store, its key
    and what the store holds of it."""
    from orchestrator.model import JobKey
    from orchestrator.run_driver import LocalRun
    from orchestrator.store import JsonFileJobStore

    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    runs = tmp_path / "runs"
    LocalRun(RunConfig(script=str(script), args=[], name=name, runs_dir=str(runs), nproc=1)).close()
    store, key = JsonFileJobStore(str(runs / name), create=False), JobKey.local(name)
    stored = store.get(key)
    assert stored is not None
    return script, runs, store, key, stored


def _run_gone_for_a_while(tmp_path: Path, name: str, gone: float) -> tuple[Path, Path]:
    """A run whose driver trained it and died ``gone`` seconds ago (its last timeline record): the
    script, and the runs folder."""
    import json
    import time
    from datetime import UTC, datetime

    from orchestrator.backends.local_timeline import EventKind
    from orchestrator.model import AttemptStatus, JobStatus, Phase

    script, runs, store, key, stored = _made_run(tmp_path, name)
    now = datetime.now(UTC)
    status = JobStatus(
        phase=Phase.RUNNING,
        reason="WorkersRunning",
        message="every worker of attempt 0 is running",
        start_time=now,
        attempt=AttemptStatus(number=0, started_at=now),
    )
    store.update_status(key, status, version=stored.version)
    with (runs / name / "timeline.jsonl").open("a") as f:
        f.write(json.dumps({"t": time.time() - gone, "kind": EventKind.RUN_STARTED, "job": str(key)}) + "\n")
    return script, runs


def _restarting_and_resumed(runs: Path, name: str) -> tuple[float, int]:
    from orchestrator.events import EventLog, events_path
    from orchestrator.model import JobKey
    from orchestrator.store import JsonFileJobStore

    key = JobKey.local(name)
    stored = JsonFileJobStore(str(runs / name), create=False).get(key)
    assert stored is not None and stored.status is not None
    resumed = [e for e in EventLog(events_path(str(runs / name), key)).read() if e.reason == "Resumed"]
    return stored.status.restarting_seconds, len(resumed)


def test_a_resume_that_never_drove_the_run_counts_no_downtime_and_the_next_counts_it_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fails without the fix: ``--resume`` counted the time nobody drove the run (from the timeline's
    last record to now) into the status, and said so in a ``Resumed`` Event, as it took the run
    over, before its backend started or its start was recorded. A resume whose backend then failed
    (or that an interrupt ended there) left both, and the next resume, measuring from the same
    record, counted that time again. Now both wait for the run to be driven (``LocalRun.run``)."""
    import orchestrator.run_driver as run_driver

    gone = 10_000.0  # the run's own start counts a moment more, far below a second count of it
    _, runs = _run_gone_for_a_while(tmp_path, "gap", gone)

    def backend_fails(*args: object, **kwargs: object) -> None:
        raise OSError("No space left on device")

    with monkeypatch.context() as patched:
        patched.setattr(run_driver, "LocalBackend", backend_fails)
        with pytest.raises(OSError):
            run_driver.LocalRun.resume(str(runs), "gap")
    assert _restarting_and_resumed(runs, "gap") == (0.0, 0)

    resumed = run_driver.LocalRun.resume(str(runs), "gap")
    resumed.interrupt.signal = "SIGINT"  # as the handler keeps one that comes while it starts
    with pytest.raises(KeyboardInterrupt):
        resumed.run()  # records its start, then stops for the interrupt
    restarting, events = _restarting_and_resumed(runs, "gap")
    assert events == 1
    assert gone <= restarting < 2 * gone, restarting


_INTERRUPTED_AS_THE_RUN_IS_MADE = """
import os, signal, sys

import orchestrator.cli_run as cli_run
from orchestrator.cli import main

made = cli_run.prepare


def prepare(args):
    run = made(args)
    os.kill(os.getpid(), signal.SIGINT)  # lands as the run is made, before it is driven
    return run


cli_run.prepare = prepare
sys.exit(main(sys.argv[1:]))
"""


def _interrupted_as_made(tmp_path: Path, *args: str) -> tuple[int, str]:
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", _INTERRUPTED_AS_THE_RUN_IS_MADE, "run", "--no-live", "--runs-dir", "runs", *args],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    return done.returncode, done.stderr


def test_a_new_run_interrupted_as_it_is_made_is_removed_and_its_name_stays_free(tmp_path: Path) -> None:
    """Fails without the fix: a Ctrl-C (or SIGTERM) that came just as the run was made said
    "interrupted before the run started; nothing of it runs", but the run's folder and stored job
    stayed: the same command was then refused ("a run named 'demo' exists"). The run is made whole,
    then removed, and the line says so."""
    (tmp_path / "train.py").write_text("print('hi')\n")
    code, said = _interrupted_as_made(tmp_path, "--name", "demo", "--nproc", "1", "train.py")
    assert code == 130, said[-3000:]
    assert "interrupted before demo started; nothing of it was made: run the command again to start it" in said
    assert not (tmp_path / "runs" / "demo").exists()


def test_a_resume_interrupted_as_it_takes_the_run_over_leaves_the_run_as_it_was(tmp_path: Path) -> None:
    """Fails without the fix: ``--resume`` interrupted once it had taken the run over, before it
    drove it, said "nothing was changed" yet left a ``Resumed`` Event and the downtime counted."""
    _, runs = _run_gone_for_a_while(tmp_path, "gap", 600.0)
    code, said = _interrupted_as_made(tmp_path, "--resume", "gap")
    assert code == 130, said[-3000:]
    assert "interrupted before it drove gap; carry on with `spotjob run --runs-dir runs --resume gap`" in said
    assert _restarting_and_resumed(runs, "gap") == (0.0, 0)


_CTRL_C_AS_A_FINISHED_RUN_EXITS = """
import os, signal, sys
from types import SimpleNamespace

import orchestrator.cli_run as cli_run
from orchestrator.cli import main
from orchestrator.model import JobStatus, Phase
from orchestrator.run_interrupt import InterruptState

status = JobStatus(phase=Phase.SUCCEEDED, reason="Completed", message="every worker exited 0")
summary = SimpleNamespace(to_json=lambda: {}, text=lambda: "spotjob run demo: Succeeded", last_checkpoint=None)
run = SimpleNamespace(
    name="demo", path=os.getcwd(), stopping=False, status=status, resumed=False, interrupt=InterruptState(),
    config=SimpleNamespace(plot=None, runs_dir="spotjob-runs"),
    spec=SimpleNamespace(checkpoint=SimpleNamespace(uri="/ckpt")),
    close=lambda: None, summary=lambda: summary, failed_worker_logs=lambda: [], interrupt_outcome=None,
)


def finished(view):
    run.stopping = True  # as LocalRun.run, which stops every process of the run at its end
    return status


run.run = finished
cli_run.prepare = lambda args: run
code = main(["run", "--no-live", "train.py"])
os.kill(os.getpid(), signal.SIGINT)  # a Ctrl-C in the last moment before the process exits
print("exited by itself", flush=True)
sys.exit(code)
"""


def test_a_ctrl_c_as_a_finished_run_exits_prints_no_traceback_and_keeps_its_exit_status(tmp_path: Path) -> None:
    """Fails without the fix: once a finished run's command returned, SIGINT was put back to
    Python's default, and a Ctrl-C in the moment before the process ended raised a
    ``KeyboardInterrupt`` whose traceback was printed (the exit by the signal, not the run's 0).
    Nothing is cut short by then: it is ignored, and the run's exit status stands."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", _CTRL_C_AS_A_FINISHED_RUN_EXITS],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    assert done.returncode == 0, (done.returncode, done.stderr[-3000:])
    assert done.stdout.splitlines()[-1] == "exited by itself"


def test_a_new_run_given_up_in_a_folder_that_was_there_removes_only_what_it_made(tmp_path: Path) -> None:
    """``LocalRun.discard`` of a new run whose folder existed before (a user's file in it): the run's
    job, the store's lock file, its folders and files go; what was there stays."""
    from orchestrator.run_driver import LocalRun

    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    folder = tmp_path / "runs" / "kept"
    folder.mkdir(parents=True)
    (folder / "notes.txt").write_text("mine")
    (folder / "local").mkdir()  # where the job store keeps the job and its lock file
    run = LocalRun(RunConfig(script=str(script), args=[], name="kept", runs_dir=str(tmp_path / "runs"), nproc=1))
    assert len(list(folder.iterdir())) > 1, "the run made nothing"
    run.discard()
    assert sorted(p.name for p in folder.iterdir()) == ["local", "notes.txt"]
    assert list((folder / "local").iterdir()) == [], "the job or its lock file is left"
    assert (folder / "notes.txt").read_text() == "mine"


def test_two_runs_whose_default_names_meet_each_get_one_of_their_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two `spotjob run` without --name started in one second chose one name (a second's
    resolution), and the second exited 2 telling the user to resume the first, a live run driven
    by another process. A name it chose itself, it chooses again; a name given is never changed."""
    import orchestrator.cli_run as cli_run
    from orchestrator.cli import build_parser
    from orchestrator.run_setup import RunExistsError

    monkeypatch.setattr(cli_run, "default_name", lambda script: "train-20261207-141226")
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    argv = ["run", "--no-live", "--runs-dir", str(tmp_path / "runs"), str(script)]
    made = [cli_run.prepare(build_parser().parse_args(argv)) for _ in range(3)]
    try:
        assert [r.name for r in made] == ["train-20261207-141226", "train-20261207-141226-2", "train-20261207-141226-3"]
    finally:
        for run in made:
            run.close()
    with pytest.raises(RunExistsError):
        cli_run.prepare(build_parser().parse_args(["run", "--name", "train-20261207-141226", *argv[1:]]))


@pytest.mark.parametrize(
    ("given", "script", "args"),
    [
        (["train.py", "--", "--x"], "train.py", ["--", "--x"]),
        (["train.py", "--steps", "3", "--name", "n"], "train.py", ["--steps", "3", "--name", "n"]),
        (["--nproc", "1", "--no-live", "train.py", "--", "--", "-v"], "train.py", ["--", "--", "-v"]),
        (["--plot=t.png", "--no-l", "--nam", "n", "--", "train.py", "--", "--x"], "train.py", ["--", "--x"]),
        (["--", "--odd.py", "--x"], "--odd.py", ["--x"]),
        (["--nproc", "1", "train.py"], "train.py", []),
    ],
)
def test_everything_after_the_script_is_the_scripts_as_given(given: list[str], script: str, args: list[str]) -> None:
    """argparse's REMAINDER dropped the script's own first `--` (`train.py -- --x` ran `train.py
    --x`); a `--` before SCRIPT still ends spotjob's options."""
    from orchestrator.cli import build_parser

    parsed = build_parser().parse_args(["run", *given])

    assert (parsed.script, parsed.args) == (script, args)


def test_a_command_parser_refuses_an_option_whose_values_the_split_at_script_cannot_skip() -> None:
    """The split skips one value after each option: an option of nargs '?' would have its SCRIPT
    taken for its value, or its value for SCRIPT, without a word."""
    import argparse

    from orchestrator.cli import _CommandParser

    parser = _CommandParser(prog="spotjob odd")
    parser.add_argument("--maybe", nargs="?")
    parser.add_argument("script")
    parser.add_argument("args", nargs=argparse.REMAINDER)

    with pytest.raises(TypeError, match=r"\['--maybe'\] take an optional or a variable number of values"):
        parser.parse_args(["--maybe", "train.py"])


@pytest.mark.parametrize(
    ("left", "said"),
    [
        ("made", "resume it with `spotjob run --runs-dir {runs} --resume taken`, or pick another --name"),
        ("succeeded", "and succeeded already (Completed): pick another --name"),
        ("failed", "and failed already (RestartBudgetExhausted): pick another --name"),
        ("driven", "and is running, driven by pid {pid}: watch it with `spotjob status --runs-dir {runs} taken`, or "
         "pick another --name"),
    ],
)  # fmt: skip
def test_a_name_taken_is_refused_with_what_can_be_done_with_the_run_that_has_it(
    tmp_path: Path, left: str, said: str
) -> None:
    """The refusal always said to resume the run, which --resume then refused for a run that
    ended (nothing to resume) or one another spotjob run drives."""
    from orchestrator.model import JobKey, JobStatus, Phase
    from orchestrator.run_driver import LocalRun
    from orchestrator.run_setup import RunExistsError
    from orchestrator.store import JsonFileJobStore

    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    runs = tmp_path / "runs"
    config = RunConfig(script=str(script), args=[], name="taken", runs_dir=str(runs), nproc=1)
    first = LocalRun(config)
    try:
        if left != "driven":
            first.close()
        if left in ("succeeded", "failed"):
            store = JsonFileJobStore(str(runs / "taken"), create=False)
            stored = store.get(JobKey.local("taken"))
            assert stored is not None
            reason, message = ("Completed", "done") if left == "succeeded" else ("RestartBudgetExhausted", "crashed")
            status = JobStatus(phase=Phase(left.capitalize()), reason=reason, message=message)
            store.update_status(JobKey.local("taken"), status, version=stored.version)
        with pytest.raises(RunExistsError) as refused:
            LocalRun(config)
    finally:
        first.close()

    assert str(refused.value).startswith(f"a run named 'taken' exists in {runs / 'taken'}"), refused.value
    assert str(refused.value).endswith(said.format(runs=runs, pid=os.getpid())), refused.value


def test_a_long_default_name_chosen_again_shortens_its_stem_and_keeps_the_whole_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The second run of a long-named script in one second was named
    `abcdefghijklmnopqrstuvwx-20261207-2253-2`: the `-2` took the place of the time's seconds."""
    import orchestrator.cli_run as cli_run
    from orchestrator.cli import build_parser
    from orchestrator.model import MAX_NAME_LENGTH

    script = tmp_path / "abcdefghijklmnopqrstuvwxyz_long_name.py"
    script.write_text("print('hi')\n")
    name = cli_run.default_name(str(script))
    monkeypatch.setattr(cli_run, "default_name", lambda script: name)  # both in one second
    assert len(name) == MAX_NAME_LENGTH and name.startswith("abcdefghijklmnopqrstuvwx-")
    argv = ["run", "--no-live", "--runs-dir", str(tmp_path / "runs"), str(script)]
    made = [cli_run.prepare(build_parser().parse_args(argv)) for _ in range(2)]
    try:
        assert [r.name for r in made] == [name, f"abcdefghijklmnopqrstuv{name[-16:]}-2"]
    finally:
        for run in made:
            run.close()


@pytest.mark.parametrize(
    ("baseline", "said"),
    [(10, "nothing newer than step 10 committed within 30 s"), (None, "nothing committed within 30 s")],
)
def test_an_interrupt_flush_that_never_committed_says_what_was_awaited(baseline: int | None, said: str) -> None:
    """With no checkpoint before the Ctrl-C, the reason read "nothing newer than nothing committed"."""
    from orchestrator.backends.base import WorkerObservation, WorkerPhase
    from orchestrator.run_interrupt import InterruptState, _why_not

    w = WorkerObservation(name="w-0", attempt=0, index=0, phase=WorkerPhase.RUNNING)
    assert _why_not([], ["w-0"], {"w-0": w}, baseline, InterruptState(), 30.0) == said
