"""``spotjob run``: a job on this machine, driven by the real reconciler.

``spotjob run [OPTIONS] SCRIPT [ARGS...]`` runs ``spotjob-agent -- torchrun --nproc-per-node N
SCRIPT ARGS`` on a simulated spot node (``orchestrator.backends.local``), injects the preemptions
it is asked for, and lets ``Reconciler`` + ``Controller`` (the same state machine the Kubernetes
controller runs, on the real clock) flush, restart and resume it until it succeeds or fails.
``spotjob run --resume NAME`` drives an existing run again (its driver was killed, say).

In order, on the main thread: check every argument (a bad one exits 2 before anything exists:
the URI, the name, the trace, where the plot goes); create ``./spotjob-runs/<name>/`` and take
its driver lock (``DriverLock``: one process drives a run at a time, and the lock dies with it);
store the job as ``local/<name>`` (create-only: of two runs of one name started at once, one
wins and the other is refused), or, when resuming, take the stored job over (waiting for what
the dead driver's workers still flush); run the controller loop. Between two passes the loop
waits in ``LocalRun._wait``, which wakes early when the backend reports a change (a notice, an
exit, a commit) and refreshes the view meanwhile. At the end: stop everything, print the summary
(and write ``summary.json``), draw ``--plot``.

The first Ctrl-C or SIGTERM (``_Interrupts``) ends the controller loop; every worker whose ranks
train is then asked to flush, and every process of the run is stopped once they committed
(``orchestrator.run_interrupt``); a second one stops them at once, without the flush. Then one
pass of the reconciler (``Reconciler.driver_stopped``) ends the attempt as a restart asked for,
which ``--resume`` starts (no preemption counted), or finds the run Completed when every worker
exited 0 first (exit 0, as any finished run). One during
``--resume``'s wait for the dead driver's workers ends it, the run unchanged (``ResumeInterrupted``);
one as a new run is made is held until it is, and the run is then removed (``LocalRun.discard``);
one before a run's start is recorded is raised once it is (``InterruptState.starting``). Once a run
was made, SIGINT and SIGTERM stay ignored to the exit: its exit status is the run's.
When the driver dies without stopping its workers (SIGKILL), each agent notices that its parent is
gone (``spotjob-agent --exit-with-parent``), flushes a checkpoint and stops; ``--resume`` then
carries on from it with the same job identity, so the URI's ownership and the attempts' fencing
accept it.

Exit status: 0 the job Succeeded; 1 it Failed (the reason is printed, with the end of the failed
worker's log); 2 bad arguments, a run that exists (or is driven by another process), nothing to
resume; 130 interrupted (Ctrl-C or SIGTERM: the training workers flush, then every process of the
run is stopped; at once on a second one), unless the training finished meanwhile (then 0).

Where each part lives: this module is the command (its options; ``prepare``, the arguments made
a ``LocalRun``; ``run_command`` and ``_drive``); ``orchestrator.run_config`` what it is told
(``RunConfig``); ``orchestrator.run_driver`` the run and its controller loop (``LocalRun``);
``orchestrator.run_setup`` what refuses a run, and ``--resume``'s takeover;
``orchestrator.run_folder`` the run's folder and its driver lock;
``orchestrator.run_signal_handlers`` the handlers of Ctrl-C, SIGTERM and Ctrl-Z (``_Interrupts``,
``_pause``); ``orchestrator.run_interrupt`` the interrupt's flush; ``orchestrator.run_outcome`` the
exit status and what stderr says at the end.

``spotjob status`` reads the run folder: ``orchestrator.cli_status``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import os
import re
import signal
import sys
import threading
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from agent.atomic_file import write_atomic
from agent.torchrun import LAUNCHERS
from orchestrator.backends.local_cloud import CLOUDS
from orchestrator.backends.local_plan import load_trace
from orchestrator.cli_ckpt import NOISY_LOGGERS, logs_debug
from orchestrator.cli_pipe import reader_gone, stdout_reader_left
from orchestrator.live import LiveView, LogView
from orchestrator.model import MAX_NAME_LENGTH
from orchestrator.run_config import (
    RunConfig,
    checkpoint_uri_problem,
    folder_problem,
    nproc_within_machine,
    plot_problem,
)
from orchestrator.run_driver import LocalRun, RunJobGone
from orchestrator.run_folder import (
    RUNS_DIR,
    SUMMARY_FILE,
    empty_runs_dir_problem,
    runs_dir_option,
)
from orchestrator.run_outcome import EXIT_INTERRUPTED, EXIT_USAGE, _tell_outcome
from orchestrator.run_setup import ResumeInterrupted, RunError, RunExistsError
from orchestrator.run_signal_handlers import _Interrupts, _pause
from orchestrator.store import StoreError

log = logging.getLogger(__name__)


# -- spotjob run ----------------------------------------------------------------------------------


_STAMP = len("-yyyymmdd-hhmmss")
"""The end of a default name: its time."""


def default_name(script: str) -> str:
    """``<script stem>-<yyyymmdd-hhmmss>`` (UTC, as every time stored in the run), made a DNS label."""
    stem = re.sub(r"[^a-z0-9-]+", "-", os.path.splitext(os.path.basename(script))[0].lower()).strip("-") or "job"
    suffix = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
    return f"{stem[: MAX_NAME_LENGTH - len(suffix) - 1].rstrip('-')}-{suffix}"


def _numbered(name: str, again: int) -> str:
    """A default name chosen again: ``-<again>`` after its time, its stem shortened to make room
    (cutting the whole name cut the time's seconds: ``...-20261207-2253-2``)."""
    suffix = f"-{again}"
    stem, stamp = name[:-_STAMP], name[-_STAMP:]
    return f"{stem[: MAX_NAME_LENGTH - _STAMP - len(suffix)].rstrip('-')}{stamp}{suffix}"


_SPEC_OPTIONS = {
    "name": "--name",
    "nproc": "--nproc",
    "checkpoint_uri": "--checkpoint-uri",
    "every_steps": "--every-steps",
    "every_seconds": "--every-seconds",
    "keep": "--keep",
    "max_restarts": "--max-restarts",
    "flush_timeout": "--flush-timeout",
    "restart_backoff": "--restart-backoff",
    "notice": "--notice",
}
"""Options that shape the job's spec: a resumed run keeps its own."""


def plan_options(args: argparse.Namespace) -> dict[str, Any]:
    """The injected preemptions of this driver, checked (``--trace`` read and parsed)."""
    if not args.maintenance_at_step:
        shaping = (("--maintenance-notice", args.maintenance_notice), ("--flush-lead", args.flush_lead))
        lone = [option for option, value in shaping if value is not None]
        if lone:
            raise ValueError(
                f"{' and '.join(lone)} {'shape' if len(lone) > 1 else 'shapes'} a planned host maintenance: add "
                f"--maintenance-at-step N, or drop {'them' if len(lone) > 1 else 'it'}"
            )
    trace: list[float] = []
    if args.trace is not None:
        try:
            trace = load_trace(args.trace)
        except ValueError as e:
            raise ValueError(f"--trace {e}") from None
    return {
        "preempt_every": args.preempt_every,
        "preempt_jitter": 0.25 if args.preempt_jitter is None else args.preempt_jitter,
        "preempt_at_steps": list(args.preempt_at_step or []),
        "trace": trace,
        "seed": args.seed,
        "maintenance_at_steps": list(args.maintenance_at_step or []),
        **({"maintenance_notice": args.maintenance_notice} if args.maintenance_notice is not None else {}),
        **({"flush_lead": args.flush_lead} if args.flush_lead is not None else {}),
        "ignore_notices": args.ignore_notices,
        **({"interrupt_deadline": args.interrupt_deadline} if args.interrupt_deadline is not None else {}),
        "launcher": args.launcher,
        "plot": args.plot,
    }


def _refuse_empty_runs_dir(args: argparse.Namespace) -> None:
    problem = empty_runs_dir_problem(args.runs_dir)
    if problem is not None:
        raise ValueError(problem)


def config_from_args(args: argparse.Namespace) -> RunConfig:
    """A new run's ``RunConfig``; ``ValueError`` naming the option at the first bad argument."""
    script = args.script
    if script is None:
        raise ValueError("a SCRIPT to run is required (or --resume NAME to carry on with a run)")
    if os.path.isdir(script):  # it said "no such training script" of a folder that is there
        raise ValueError(f"SCRIPT {script} is a folder: name the training script (a .py file) to run")
    if not os.path.isfile(script):
        raise ValueError(f"no such training script: {script}")
    if args.checkpoint_uri is not None:
        problem = checkpoint_uri_problem(args.checkpoint_uri)
        if problem is not None:
            raise ValueError(problem)
    _refuse_empty_runs_dir(args)
    problem = folder_problem(os.path.abspath(args.runs_dir))
    if problem is not None:
        raise ValueError(f"--runs-dir {args.runs_dir}: {problem}")
    if args.plot is not None and (problem := plot_problem(args.plot)) is not None:
        raise ValueError(problem)
    given = {k: getattr(args, k) for k in _SPEC_OPTIONS if getattr(args, k) is not None}
    if args.cloud is not None:
        given["cloud"] = args.cloud
    if "nproc" in given and (problem := nproc_within_machine(given["nproc"])) is not None:
        raise ValueError(problem)
    name = given.pop("name", None)
    return RunConfig(
        script=os.path.abspath(script),
        args=list(args.args),
        name=name if name is not None else default_name(script),
        runs_dir=args.runs_dir,
        **given,
        **plan_options(args),
    )


def prepare(args: argparse.Namespace) -> LocalRun:
    """The ``LocalRun`` the arguments ask for, new or resumed; ``ValueError``/``RunError`` say why not."""
    if args.resume is None:
        config = config_from_args(args)
        if args.name is not None:
            return LocalRun(config)
        # The default name has a second's resolution: two runs started in one second (a loop, two
        # terminals) chose one name, and the second was told to resume the first, a live run of
        # someone else's. A name it chose itself, it chooses again.
        base = config.name
        for again in range(2, 10):
            try:
                return LocalRun(config)
            except RunExistsError:
                config = dataclasses.replace(config, name=_numbered(base, again))
        return LocalRun(config)
    _refuse_empty_runs_dir(args)  # or a run of that name in the working directory was resumed
    if args.script is not None:
        raise RunError(
            f"--resume {args.resume} takes no SCRIPT ({args.script}): the run carries on with the command it was "
            "started with"
        )
    fixed = [option for attr, option in _SPEC_OPTIONS.items() if getattr(args, attr) is not None]
    if fixed:
        raise RunError(
            f"--resume carries on with the run's own spec: drop {', '.join(fixed)} (start a new run to change them)"
        )
    if args.plot is not None and (problem := plot_problem(args.plot)) is not None:
        raise ValueError(problem)
    return LocalRun.resume(args.runs_dir, args.resume, cloud=args.cloud, **plan_options(args))


def run_command(args: argparse.Namespace) -> int:
    if not logs_debug(args):
        # The summary's own reads of storage would log botocore's "Found credentials in environment
        # variables" among the run's lines, as spotjob ckpt does not. Debug level (-v,
        # SPOTJOB_LOG_LEVEL=debug) keeps it.
        for noisy in NOISY_LOGGERS:
            logging.getLogger(noisy).setLevel(logging.WARNING)
    if threading.current_thread() is not threading.main_thread():
        prepared = _prepared(args)  # only the main thread can take signals
        return prepared if isinstance(prepared, int) else _drive(prepared, args)
    # From before the run is made: a Ctrl-C or SIGTERM during --resume's wait for the previous
    # driver's processes ended it with a traceback-less 130 and no word, or by the signal (143).
    interrupts = _Interrupts()
    # A new run is made whole, then given up if one came meanwhile (its name stays free); --resume's
    # wait must stay interruptible, and a resume not driven changes nothing to undo.
    interrupts.early.starting = args.resume is None
    saved = {signum: signal.signal(signum, interrupts) for signum in (signal.SIGTERM, signal.SIGINT)}
    made = False
    run: LocalRun | int | None = None  # the made run, once _prepared returns it
    try:
        run = _prepared(args)
        if isinstance(run, int):
            return run
        made = True
        interrupts.run = run  # from here, one is kept in run.interrupt until run() records the start
        if interrupts.early.signal is not None:
            run.interrupt.signal = interrupts.early.signal
        if signal.getsignal(signal.SIGTSTP) != signal.SIG_IGN and os.getpid() != 1:  # as spotjob-agent
            saved[signal.SIGTSTP] = signal.signal(signal.SIGTSTP, lambda signum, frame: _pause(run))
        if run.interrupt.signal is not None:
            return _not_driven(run, args)
        return _drive(run, args)
    except KeyboardInterrupt:  # --resume's, as its run was made: nothing of the run was changed
        made = True
        if run is not None and not isinstance(run, int):  # made, not yet in interrupts.run: close it
            with contextlib.suppress(Exception):  # the interrupt stays the outcome
                run.close()
        return _interrupted_before(args)
    finally:
        for signum, handler in saved.items():
            if (made or interrupts.received) and signum in (signal.SIGTERM, signal.SIGINT):
                # The run ended (or was given up): its exit status is said above, and a signal in
                # the moment before the process exits must not change it (130, 143) nor print a
                # traceback of the KeyboardInterrupt the default handler raises.
                signal.signal(signum, signal.SIG_IGN)
            elif handler is not None:  # None: not set from Python, nothing to put back
                signal.signal(signum, handler)


def _prepared(args: argparse.Namespace) -> LocalRun | int:
    """The run the arguments ask for, or the exit status of a refusal or an interrupt (said on stderr)."""
    try:
        return prepare(args)
    except (ValueError, RunError) as e:
        print(f"spotjob run: {e}", file=sys.stderr)
        return EXIT_USAGE
    except (OSError, StoreError) as e:
        print(f"spotjob run: cannot create the run: {e}", file=sys.stderr)
        return EXIT_USAGE
    except ResumeInterrupted as e:
        print(f"spotjob run: {e}", file=sys.stderr)
        return EXIT_INTERRUPTED
    except KeyboardInterrupt:
        return _interrupted_before(args)


def _interrupted_before(args: argparse.Namespace) -> int:
    """An interrupt before the run was driven: say what is left (of a new run, nothing: ``LocalRun``
    removes what it made when its making is cut short), and how to go on."""
    if args.resume is not None:
        again = f"`spotjob run{runs_dir_option(args.runs_dir)} --resume {args.resume}`"
        print(f"spotjob run: interrupted before it drove {args.resume}; carry on with {again}", file=sys.stderr)
    else:
        print("spotjob run: interrupted before the run started; nothing of it was made", file=sys.stderr)
    return EXIT_INTERRUPTED


def _not_driven(run: LocalRun, args: argparse.Namespace) -> int:
    """A Ctrl-C or SIGTERM came as the run was made, before it was driven: a new run is removed
    (nothing of it ran: the same command starts it, under the same name), a resumed one left as it
    was (its takeover is recorded only once it is driven)."""
    if run.resumed:
        run.close()
        return _interrupted_before(args)
    try:
        run.discard()
    except OSError as e:  # said, not raised: the interrupt is still the outcome
        print(f"spotjob run: interrupted before {run.name} started; could not remove {run.path}: {e}", file=sys.stderr)
        return EXIT_INTERRUPTED
    print(
        f"spotjob run: interrupted before {run.name} started; nothing of it was made: run the command again "
        "to start it",
        file=sys.stderr,
    )
    return EXIT_INTERRUPTED


def _drive(run: LocalRun, args: argparse.Namespace) -> int:
    """Run it, then tell: the summary, the plot, the exit status."""
    live = sys.stderr.isatty() and not args.no_live
    interrupted = False
    try:
        if live:
            view = LiveView()
            with view.showing():
                status = run.run(view)
        else:
            status = run.run(LogView())
    except KeyboardInterrupt:
        interrupted = True
        status = run.status
    except RunJobGone as e:
        run.close()
        print(f"spotjob run: {e}", file=sys.stderr)
        return 1
    finally:
        run.close()

    summary = run.summary()
    try:  # in one rename: a reader (or a full disk) never finds it cut short
        write_atomic(os.path.join(run.path, SUMMARY_FILE), json.dumps(summary.to_json(), indent=2).encode())
    except OSError as e:
        log.warning("could not write %s: %s", SUMMARY_FILE, e)
    # The plot is drawn before anything is printed: a stdout whose reader went away (`| head -1`)
    # fails the first print, and must not cost the image nor the failure said on stderr below.
    plot = run.config.plot
    plotted = None
    if plot:
        try:
            run.plot(plot)
            plotted = os.path.abspath(plot)
        except Exception as e:  # a missing plot must not turn a finished job into a failure
            log.warning("could not draw the plot %s: %s", plot, e)
    runs_dir = runs_dir_option(run.config.runs_dir)
    reader_left = False
    try:
        print(summary.text(), flush=True)
        if plotted is not None:
            print(f"  {'plot':<15}  {plotted}")
        print(f"  {'run folder':<15}  {run.path}  (spotjob status{runs_dir} {run.name})", flush=True)
    except BrokenPipeError:
        if not stdout_reader_left():
            raise
        reader_left = True  # exit 141 (below), once stderr has said what it has to say
    code = _tell_outcome(run, status, summary, interrupted, runs_dir)
    return reader_gone() if reader_left else code


# -- registration ---------------------------------------------------------------------------------


def _step(value: str) -> int:
    try:
        step = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a step (a whole number >= 0), got {value!r}") from None
    if step < 0:
        raise argparse.ArgumentTypeError(f"must be a step >= 0, got {step}")
    return step


def _number(kind: Callable[[str], Any], what: str) -> Callable[[str], Any]:
    def parse(value: str) -> Any:
        try:
            return kind(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {what}, got {value!r}") from None

    return parse


_INT = _number(int, "a whole number")
_SECONDS = _number(float, "a number of seconds")


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    run = sub.add_parser(
        "run",
        help="run a training script under spotjob on this machine, with injected preemptions",
        usage="spotjob run [OPTIONS] SCRIPT [ARGS...]\n       spotjob run --resume NAME [OPTIONS]",
        description="Run SCRIPT under spotjob-agent -- torchrun --nproc-per-node N on a simulated spot node of "
        "this machine; preemptions injected by the options below travel the real path (an IMDSv2 spot "
        "instance-action the agent hears, or GCE's or Azure's notice with --cloud; a signal the reconciler acts "
        "on). Options go before SCRIPT; "
        "everything after it is the script's. --resume NAME drives an existing run again (its spotjob run was "
        "killed, say) with its own spec, status and checkpoints. Exit status: 0 the job succeeded, 1 it failed, "
        "2 bad arguments (nothing is created), a run that exists or is driven elsewhere, 130 interrupted (Ctrl-C "
        "or SIGTERM: the training workers flush a checkpoint first; a second Ctrl-C stops at once, without it).",
    )
    run.add_argument("script", metavar="SCRIPT", nargs="?", help="the training script (it uses agent.Checkpointer)")
    run.add_argument("args", metavar="ARGS", nargs=argparse.REMAINDER, help="the script's own arguments")
    run.add_argument(
        "--resume", metavar="NAME", help="carry on with run NAME (its spec, status and checkpoints); no SCRIPT"
    )
    job = run.add_argument_group("the job (fixed once the run exists)")
    job.add_argument("--name", help="the run's name, a DNS label (default: <script>-<date>-<time>)")
    job.add_argument("--nproc", type=_INT, help="ranks (torchrun --nproc-per-node; default 2; at most 4 per CPU)")
    job.add_argument(
        "--checkpoint-uri",
        help="where checkpoints go: a path, s3://, gs:// (default: <runs-dir>/<name>/checkpoints)",
    )
    job.add_argument("--every-steps", type=_INT, help="save a checkpoint every N steps")
    job.add_argument("--every-seconds", type=_SECONDS, help="save a checkpoint at least this often")
    job.add_argument("--keep", type=_INT, help="committed checkpoints to keep (default 3)")
    job.add_argument(
        "--max-restarts", type=_INT, help="restarts after crashes of the script (default 3); preemptions never use it"
    )
    job.add_argument(
        "--flush-timeout", type=_SECONDS, help="seconds to wait for a flush to commit (default 120, at most 86400)"
    )
    job.add_argument("--restart-backoff", type=_SECONDS, help="seconds before the first restart (default 1; doubles)")
    job.add_argument(
        "--notice", type=_SECONDS, metavar="SECONDS", help="each notice's window (default 30, at most 86400)"
    )
    job.add_argument(
        "--cloud", choices=CLOUDS,
        help="the cloud the nodes simulate (default aws; --resume keeps the run's): aws, an IMDSv2 spot "
        "instance-action; gcp, GCE's instance/preempted TRUE; azure, a Scheduled Event Preempt whose NotBefore "
        "is the node's stop (the node stops early once its agent acknowledges it)",
    )  # fmt: skip
    inj = run.add_argument_group("injected preemptions")
    inj.add_argument(
        "--preempt-every", type=_SECONDS, metavar="SECONDS", help="a notice about every N seconds of training"
    )
    inj.add_argument(
        "--preempt-jitter", type=_number(float, "a fraction"), help="the gaps vary by this fraction (default 0.25)"
    )
    inj.add_argument(
        "--preempt-at-step", type=_step, action="append", metavar="N",
        help="a notice once the training reaches step N (repeatable)",
    )  # fmt: skip
    inj.add_argument(
        "--trace", metavar="FILE", help="notice times in seconds since the start: one a line, or a JSON list"
    )
    inj.add_argument("--seed", type=_INT, help="seeds the jitter and which node a notice hits")
    inj.add_argument(
        "--maintenance-at-step", type=_step, action="append", metavar="N",
        help="a host maintenance once the training reaches step N (GCE TERMINATE_ON_HOST_MAINTENANCE; on aws "
        "too, whose IMDS announces none: its nodes then also serve GCE metadata; on azure a Scheduled Event "
        "Redeploy): the node's agent holds the notice, training goes on, and it flushes --flush-lead before the "
        "node stops (repeatable)",
    )  # fmt: skip
    inj.add_argument(
        "--maintenance-notice", type=_SECONDS, metavar="SECONDS",
        help="from a host maintenance's notice to its node's stop (default 20; GCE gives a GPU VM 3600)",
    )  # fmt: skip
    inj.add_argument(
        "--flush-lead", type=_SECONDS, metavar="SECONDS",
        help="the agents hold a host maintenance until this long before the node stops (default 10; below "
        "--maintenance-notice)",
    )  # fmt: skip
    inj.add_argument(
        "--ignore-notices", action="store_true",
        help="a baseline: nobody listens for notices (no flush); a noticed node just dies at the window's end",
    )  # fmt: skip
    run.add_argument(
        "--interrupt-deadline", type=_SECONDS, metavar="SECONDS",
        help="on Ctrl-C or SIGTERM, the deadline of the training workers' flush before every process stops "
        "(default 30, at most 86400; --resume may give another): spotjob run waits at most that, plus half of "
        "it (5 to 15 s) for the agents to exit",
    )  # fmt: skip
    run.add_argument(
        "--launcher", choices=LAUNCHERS, default="direct",
        help="direct (default): each agent starts the ranks itself, as torchrun would, without torchrun's own "
        "start (a second or more of every restart); torchrun: run torchrun (spotjob-agent --launcher)",
    )  # fmt: skip
    out = run.add_argument_group("output")
    out.add_argument(
        "--plot",
        metavar="FILE",
        help="draw a timeline image (.png, .svg, .pdf, or .jpg, .eps, .ps, .tif, .webp): "
        "steps, notices, commits, restarts",
    )
    out.add_argument("--runs-dir", default=RUNS_DIR, help=f"where run folders go (default ./{RUNS_DIR})")
    out.add_argument("--no-live", action="store_true", help="log lines even on a terminal")
    run.set_defaults(func=run_command)


__all__ = ["register", "run_command"]
