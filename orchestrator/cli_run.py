"""``spotjob run`` and ``spotjob status``: a job on this machine, driven by the real reconciler.

``spotjob run [OPTIONS] SCRIPT [ARGS...]`` runs ``spotjob-agent -- torchrun --nproc-per-node N
SCRIPT ARGS`` on a simulated spot node (``orchestrator.backends.local``), injects the preemptions
it is asked for, and lets ``Reconciler`` + ``Controller`` (the same state machine the Kubernetes
controller runs, on the real clock) flush, restart and resume it until it succeeds or fails.

In order, on the main thread: create ``./spotjob-runs/<name>/`` (the job store with
``local/<name>.json`` and its Events ``local/<name>.events.jsonl``, ``run.json``, the token, node
folders, one log per worker, ``timeline.jsonl``); store the job as ``local/<name>`` (its identity
in storage and the agents' job name); run the controller loop. Between two passes the loop
waits in ``LocalRun._wait``, which wakes early when the backend reports a change (a notice, an
exit, a commit) and refreshes the view meanwhile. At the end: stop everything, print the summary
(and write ``summary.json``), draw ``--plot``.

Exit status: 0 the job Succeeded; 1 it Failed (the reason is printed); 2 bad arguments; 130
interrupted (Ctrl-C or SIGTERM: every process of the run is stopped first).

``spotjob status`` lists the runs under ``./spotjob-runs``; ``spotjob status NAME`` shows one.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import signal
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from types import FrameType

from pydantic import ValidationError
from rich.console import Console

from orchestrator.backends.local import (
    EventKind,
    LocalBackend,
    LocalOptions,
    PreemptionPlan,
    Timeline,
    load_trace,
)
from orchestrator.events import JsonlEventSink, RecordedEvent, events_path, read_events
from orchestrator.live import (
    LiveView,
    LogView,
    NoticeView,
    RunRecord,
    RunView,
    Snapshot,
    Summary,
    plot_timeline,
    render_run_detail,
    render_run_list,
    summarize,
)
from orchestrator.model import (
    MAX_NAME_LENGTH,
    BackoffSpec,
    CheckpointSpec,
    JobKey,
    JobSpec,
    JobStatus,
    Phase,
    job_name_problem,
)
from orchestrator.reconciler import Controller, Reconciler, ReconcilerOptions, SystemClock
from orchestrator.store import JsonFileJobStore, StoreError

log = logging.getLogger(__name__)

RUNS_DIR = "spotjob-runs"
RUN_FILE = "run.json"
SUMMARY_FILE = "summary.json"
TIMELINE_FILE = "timeline.jsonl"

EXIT_SUCCEEDED = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130

VIEW_TICK = 0.25
RATE_WINDOW_SECONDS = 15.0
STATUS_REFRESH_SECONDS = 5.0
"""How stale the stored goodput and step hints of a local run may get between decisions."""


class RunExistsError(Exception):
    """A run of that name is in the runs folder already."""


@dataclass(frozen=True)
class RunConfig:
    """Everything ``spotjob run`` was told; checked up front (``JobSpec`` checks the rest)."""

    script: str
    """The training script, as torchrun takes it (made absolute)."""
    args: list[str]
    """The script's own arguments."""
    name: str
    runs_dir: str = RUNS_DIR
    """Where run folders go (``./spotjob-runs``)."""
    nproc: int = 2
    """Ranks per node (torchrun --nproc-per-node)."""
    checkpoint_uri: str | None = None
    """None: ``<runs_dir>/<name>/checkpoints``."""
    every_steps: int | None = None
    every_seconds: float | None = None
    keep: int = 3
    max_restarts: int = 3
    """Restarts after failures of the user's code (preemptions never consume it)."""
    flush_timeout: float = 120.0
    """How long the reconciler waits for a flush to commit before restarting from what is there."""
    notice: float = 30.0
    """The window of each injected notice, from the notice to the node's termination."""
    restart_backoff: float = 1.0
    """The first restart's delay (doubling, capped at max(this, 60 s)); a local node is there at once."""
    preempt_every: float | None = None
    preempt_jitter: float = 0.25
    preempt_at_steps: list[int] = field(default_factory=list)
    trace: list[float] = field(default_factory=list)
    seed: int | None = None
    ignore_notices: bool = False
    """A baseline: nobody listens for notices; a noticed node just dies when its window ends."""
    plot: str | None = None
    env: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        checks = [
            (self.nproc >= 1, f"--nproc must be at least 1, got {self.nproc}"),
            (self.notice > 0, f"--notice must be positive, got {self.notice}"),
            (self.flush_timeout > 0, f"--flush-timeout must be positive, got {self.flush_timeout}"),
            (self.restart_backoff >= 0, f"--restart-backoff must not be negative, got {self.restart_backoff}"),
            (all(s >= 0 for s in self.preempt_at_steps), "--preempt-at-step takes steps >= 0"),
            (all(t >= 0 for t in self.trace), "--trace times must be >= 0 seconds"),
            (job_name_problem(self.name) is None, f"--name: {job_name_problem(self.name)}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def path(self) -> str:
        return os.path.abspath(os.path.join(self.runs_dir, self.name))

    @property
    def key(self) -> JobKey:
        """The job's key: ``local/<name>`` (``orchestrator.model.LOCAL_NAMESPACE``)."""
        return JobKey.local(self.name)

    def job_spec(self) -> JobSpec:
        uri = self.checkpoint_uri or os.path.join(self.path, "checkpoints")
        if "://" not in uri:
            uri = os.path.abspath(uri)
        return JobSpec(
            command=[self.script, *self.args],
            env=self.env,
            replicas=1,
            nproc_per_node=self.nproc,
            checkpoint=CheckpointSpec(
                uri=uri, every_steps=self.every_steps, every_seconds=self.every_seconds, keep=self.keep
            ),
            max_restarts=self.max_restarts,
            flush_timeout_seconds=self.flush_timeout,
            notice_seconds=self.notice,
            restart_backoff=BackoffSpec(
                initial_seconds=self.restart_backoff, max_seconds=max(self.restart_backoff, 60.0)
            ),
        )

    def plan(self) -> PreemptionPlan:
        return PreemptionPlan(
            every=self.preempt_every,
            jitter=self.preempt_jitter,
            at_steps=list(self.preempt_at_steps),
            trace=list(self.trace),
            seed=self.seed,
        )


class LocalRun:
    """One ``spotjob run``: its folder, store, backend and controller loop. Usable in-process (tests)."""

    def __init__(self, config: RunConfig) -> None:
        self.config = config
        self.key = config.key
        self.name = config.name
        self.spec = config.job_spec()
        self.plan = config.plan()
        self.path = config.path
        self.store = JsonFileJobStore(self.path)
        if self.store.get(self.key) is not None:
            raise RunExistsError(
                f"a run named {self.name!r} exists in {self.path}; pick another --name or remove that folder"
            )
        self.events_path = events_path(self.path, self.key)
        self.timeline = Timeline(os.path.join(self.path, TIMELINE_FILE))
        self.backend = LocalBackend(
            LocalOptions(root=self.path, notice_seconds=config.notice, hear_notices=not config.ignore_notices),
            plan=self.plan,
            timeline=self.timeline,
        )
        # A local status write is a small file: the live view and `spotjob status` get goodput and
        # the step seen every few seconds, not every minute as a Kubernetes status would.
        self.reconciler = Reconciler(
            self.store,
            self.backend,
            SystemClock(),
            events=JsonlEventSink(self.path),
            options=ReconcilerOptions(status_refresh_seconds=STATUS_REFRESH_SECONDS),
        )
        self.status = JobStatus()
        self.events: list[RecordedEvent] = []
        self._view: RunView | None = None
        self._started = time.monotonic()
        self._ended: float | None = None
        self._rate: deque[tuple[float, int]] = deque()
        self._rate_attempt = -1
        self._commit_count = 0
        self._commits_read_at = 0.0

    # -- running ----------------------------------------------------------------------------------
    def run(self, view: RunView | None = None) -> JobStatus:
        """Run the job to Succeeded or Failed; always stops every process of the run before returning."""
        self._view = view
        self.store.create(self.key, self.spec)
        with open(os.path.join(self.path, RUN_FILE), "w") as f:
            json.dump({"pid": os.getpid(), "argv": sys.argv, "started_at": time.time()}, f)
        self.timeline.record(
            EventKind.RUN_STARTED, job=str(self.key), command=self.spec.command, nproc=self.config.nproc
        )
        log.info(
            "run %s: %s on %d rank(s); checkpoints at %s; state in %s",
            self.key,
            " ".join(self.spec.command),
            self.config.nproc,
            self.spec.checkpoint.uri,
            self.path,
        )
        try:
            controller = Controller(self.reconciler, SystemClock(), wait=self._wait)
            self.status = controller.run(self.key)
            self._note_status(self.status)
        finally:
            self._ended = time.monotonic()
            self.backend.close()
            self.events = read_events(self.events_path)
            self.timeline.record(EventKind.RUN_FINISHED, phase=str(self.status.phase))
            self._refresh()
        return self.status

    def _wait(self, seconds: float) -> None:
        """Between passes: refresh the view; return early when the backend saw something happen."""
        self._after_pass()
        end = time.monotonic() + seconds
        while True:
            self._refresh()
            left = end - time.monotonic()
            if left <= 0:
                return
            if self.backend.changed.wait(min(left, VIEW_TICK)):
                self.backend.changed.clear()
                return

    def _after_pass(self) -> None:
        try:
            stored = self.store.get(self.key)
        except StoreError as e:
            log.warning("cannot read the job's status: %s", e)
            return
        if stored is not None and stored.status is not None:
            self._note_status(stored.status)
        self.events = read_events(self.events_path)

    def _note_status(self, status: JobStatus) -> None:
        if status.phase is not self.status.phase or status.reason != self.status.reason:
            self.timeline.record(EventKind.PHASE, phase=str(status.phase), reason=status.reason)
        self.status = status

    def _refresh(self) -> None:
        if self._view is not None:
            self._view.update(self.snapshot())

    # -- what the views read ----------------------------------------------------------------------
    def snapshot(self) -> Snapshot:
        step = self.backend.observed_step(self.key)
        now = time.monotonic()
        attempt = self.status.attempt.number
        if attempt != self._rate_attempt:
            self._rate.clear()
            self._rate_attempt = attempt
        if step is not None and (not self._rate or self._rate[-1][1] != step):
            self._rate.append((now, step))
        while self._rate and now - self._rate[0][0] > RATE_WINDOW_SECONDS:
            self._rate.popleft()
        rate = None
        if len(self._rate) >= 2 and self._rate[-1][0] > self._rate[0][0]:
            rate = (self._rate[-1][1] - self._rate[0][1]) / (self._rate[-1][0] - self._rate[0][0])
        if step is None:
            step = self.status.attempt.observed_step
        wall = time.time()
        notices = [
            NoticeView(n.name, n.deadline - wall)
            for n in self.backend.nodes()
            if n.deadline is not None and not n.terminated
        ]
        return Snapshot(
            name=self.name,
            elapsed=(self._ended or now) - self._started,
            status=self.status,
            max_restarts=self.spec.max_restarts,
            step=step,
            steps_per_second=rate if rate and rate > 0 else None,
            commits=self._commits(),
            notices_sent=self.backend.notices_sent,
            notices=notices,
            events=self.events,
        )

    def _commits(self) -> int:
        """Commits in the timeline, re-counted at most once a second (the file only grows)."""
        now = time.monotonic()
        if self._ended is not None or now - self._commits_read_at >= 1.0:
            self._commits_read_at = now
            self._commit_count = sum(1 for e in Timeline.read(self.timeline.path) if e.kind == EventKind.COMMIT)
        return self._commit_count

    def summary(self) -> Summary:
        wall = (self._ended or time.monotonic()) - self._started
        return summarize(self.name, self.spec, self.status, Timeline.read(self.timeline.path), wall_seconds=wall)

    def plot(self, path: str) -> None:
        s = self.summary()
        title = (
            f"{s.name}: {s.phase}, {s.steps if s.steps is not None else '-'} steps, {s.preemptions} preemption(s), "
            f"goodput {'-' if s.goodput is None else f'{s.goodput:.0%}'}"
        )
        plot_timeline(Timeline.read(self.timeline.path), path, title=title)


# -- spotjob run ----------------------------------------------------------------------------------


def default_name(script: str) -> str:
    """``<script stem>-<yyyymmdd-hhmmss>``, made a DNS label."""
    stem = re.sub(r"[^a-z0-9-]+", "-", os.path.splitext(os.path.basename(script))[0].lower()).strip("-") or "job"
    suffix = time.strftime("%Y%m%d-%H%M%S")
    return f"{stem[: MAX_NAME_LENGTH - len(suffix) - 1].rstrip('-')}-{suffix}"


def config_from_args(args: argparse.Namespace) -> RunConfig:
    script = args.script
    if not os.path.isfile(script):
        raise ValueError(f"no such training script: {script}")
    trace = load_trace(args.trace) if args.trace else []
    return RunConfig(
        script=os.path.abspath(script),
        args=list(args.args),
        name=args.name or default_name(script),
        runs_dir=args.runs_dir,
        nproc=args.nproc,
        checkpoint_uri=args.checkpoint_uri,
        every_steps=args.every_steps,
        every_seconds=args.every_seconds,
        keep=args.keep,
        max_restarts=args.max_restarts,
        flush_timeout=args.flush_timeout,
        notice=args.notice,
        restart_backoff=args.restart_backoff,
        preempt_every=args.preempt_every,
        preempt_jitter=args.preempt_jitter,
        preempt_at_steps=list(args.preempt_at_step or []),
        trace=trace,
        seed=args.seed,
        ignore_notices=args.ignore_notices,
        plot=args.plot,
    )


def _interrupt_on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def run_command(args: argparse.Namespace) -> int:
    try:
        config = config_from_args(args)
        run = LocalRun(config)
    except (ValueError, OSError, RunExistsError) as e:
        # pydantic's ValidationError is a ValueError: a bad --name or budget reads the same way.
        message = e.errors()[0]["msg"] if isinstance(e, ValidationError) else str(e)
        print(f"spotjob run: {message}", file=sys.stderr)
        return EXIT_USAGE

    live = sys.stderr.isatty() and not args.no_live
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _interrupt_on_sigterm)
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

    summary = run.summary()
    with open(os.path.join(run.path, SUMMARY_FILE), "w") as f:
        json.dump(summary.to_json(), f, indent=2)
    print(summary.text(), flush=True)
    if config.plot:
        try:
            run.plot(config.plot)
            print(f"  {'plot':<15}  {os.path.abspath(config.plot)}")
        except Exception as e:  # a missing plot must not turn a finished job into a failure
            log.warning("could not draw the plot %s: %s", config.plot, e)
    print(f"  {'run folder':<15}  {run.path}  (spotjob status {run.name})")
    if interrupted:
        print(f"spotjob run: interrupted; every process of {run.name} was stopped", file=sys.stderr)
        return EXIT_INTERRUPTED
    if status.phase is Phase.SUCCEEDED:
        return EXIT_SUCCEEDED
    print(f"spotjob run: {run.name} failed: {status.reason}: {status.message}", file=sys.stderr)
    return EXIT_FAILED


# -- spotjob status -------------------------------------------------------------------------------


def _controller_alive(path: str) -> bool:
    try:
        with open(os.path.join(path, RUN_FILE)) as f:
            pid = int(json.load(f)["pid"])
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"spotjob" in f.read() or pid == os.getpid()
    except (OSError, ValueError, KeyError, TypeError):
        return False


def read_run(runs_dir: str, name: str) -> RunRecord | None:
    """The run folder ``<runs_dir>/<name>``: its job ``local/<name>``, status and Events; None if
    there is no such run."""
    path = os.path.abspath(os.path.join(runs_dir, name))
    if job_name_problem(name) is not None:
        return None
    key = JobKey.local(name)
    store = JsonFileJobStore(path, fsync=False, create=False)
    if not os.path.isfile(store.path(key)):
        if os.path.isfile(os.path.join(path, f"{name}.json")):  # the layout before jobs had namespaces
            return RunRecord(name, path, None, None, False, error="a run folder of an older spotjob (not read)")
        return None
    events = read_events(events_path(path, key))
    try:
        stored = store.get(key)
    except StoreError as e:
        return RunRecord(name, path, None, None, False, error=str(e), events=events)
    if stored is None:
        return None
    return RunRecord(
        name, path, stored.spec, stored.status, _controller_alive(path), error=stored.invalid, events=events
    )


def list_runs(runs_dir: str) -> list[RunRecord]:
    try:
        names = sorted(e.name for e in os.scandir(runs_dir) if e.is_dir())
    except FileNotFoundError:
        return []
    return [r for r in (read_run(runs_dir, n) for n in names) if r is not None]


def status_command(args: argparse.Namespace) -> int:
    # Piped or captured: wide lines rather than rich's 80 columns of ellipses.
    console = Console() if sys.stdout.isatty() else Console(width=200)
    if args.name is None:
        runs = list_runs(args.runs_dir)
        if args.json:
            print(json.dumps([_record_json(r) for r in runs], indent=2))
        elif not runs:
            console.print(f"no runs under {os.path.abspath(args.runs_dir)}")
        else:
            console.print(render_run_list(runs))
        return 0
    record = read_run(args.runs_dir, args.name)
    if record is None:
        print(f"spotjob status: no run named {args.name!r} under {os.path.abspath(args.runs_dir)}", file=sys.stderr)
        return EXIT_USAGE
    if args.json:
        print(json.dumps(_record_json(record), indent=2))
    else:
        console.print(render_run_detail(record))
    return 0


def _record_json(r: RunRecord) -> dict[str, object]:
    return {
        "name": r.name,
        "path": r.path,
        "controllerAlive": r.controller_alive,
        "spec": r.spec.model_dump(mode="json") if r.spec else None,
        "status": r.status.model_dump(mode="json", exclude_none=True) if r.status else None,
        "events": [
            {
                "time": e.time.isoformat(),
                "firstTime": e.first_time.isoformat(),
                "type": str(e.type),
                "reason": e.reason,
                "message": e.message,
                "count": e.count,
                **({"node": e.node} if e.node else {}),
            }
            for e in r.events
        ],
        "error": r.error,
    }


# -- registration ---------------------------------------------------------------------------------


def _positive_step(value: str) -> int:
    step = int(value)
    if step < 0:
        raise argparse.ArgumentTypeError("must be a step >= 0")
    return step


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    run = sub.add_parser(
        "run",
        help="run a training script under spotjob on this machine, with injected preemptions",
        usage="spotjob run [OPTIONS] SCRIPT [ARGS...]",
        description="Run SCRIPT under spotjob-agent -- torchrun --nproc-per-node N on a simulated spot node of "
        "this machine; preemptions injected by the options below travel the real path (an IMDSv2 spot "
        "instance-action the agent hears, a signal the reconciler acts on). Options go before SCRIPT; "
        "everything after it is the script's. Exit status: 0 the job succeeded, 1 it failed, 2 bad arguments, "
        "130 interrupted.",
    )
    run.add_argument("script", metavar="SCRIPT", help="the training script (it uses agent.Checkpointer)")
    run.add_argument("args", metavar="ARGS", nargs=argparse.REMAINDER, help="the script's own arguments")
    job = run.add_argument_group("the job")
    job.add_argument("--name", help="the run's name, a DNS label (default: <script>-<date>-<time>)")
    job.add_argument("--nproc", type=int, default=2, help="ranks (torchrun --nproc-per-node; default 2)")
    job.add_argument(
        "--checkpoint-uri",
        help=f"where checkpoints go: a path, s3://, gs:// (default: ./{RUNS_DIR}/<name>/checkpoints)",
    )
    job.add_argument("--every-steps", type=int, help="save a checkpoint every N steps")
    job.add_argument("--every-seconds", type=float, help="save a checkpoint at least this often")
    job.add_argument("--keep", type=int, default=3, help="committed checkpoints to keep (default 3)")
    job.add_argument(
        "--max-restarts",
        type=int,
        default=3,
        help="restarts after crashes of the script (default 3); preemptions never use it",
    )
    job.add_argument(
        "--flush-timeout", type=float, default=120.0, help="seconds to wait for a flush to commit (default 120)"
    )
    job.add_argument(
        "--restart-backoff", type=float, default=1.0, help="seconds before the first restart (default 1; doubles)"
    )
    inj = run.add_argument_group("injected preemptions")
    inj.add_argument("--preempt-every", type=float, metavar="SECONDS", help="a notice about every N seconds")
    inj.add_argument(
        "--preempt-jitter", type=float, default=0.25, help="the gaps vary uniformly by this fraction (default 0.25)"
    )
    inj.add_argument(
        "--preempt-at-step", type=_positive_step, action="append", metavar="N",
        help="a notice once the training reaches step N (repeatable)",
    )  # fmt: skip
    inj.add_argument(
        "--trace", metavar="FILE", help="notice times in seconds since the start: one a line, or a JSON list"
    )
    inj.add_argument("--notice", type=float, default=30.0, metavar="SECONDS", help="each notice's window (default 30)")
    inj.add_argument("--seed", type=int, help="seeds the jitter and which node a notice hits")
    inj.add_argument(
        "--ignore-notices", action="store_true",
        help="a baseline: nobody listens for notices (no flush); a noticed node just dies at the window's end",
    )  # fmt: skip
    out = run.add_argument_group("output")
    out.add_argument("--plot", metavar="FILE", help="draw a PNG timeline: steps, notices, commits, restarts")
    out.add_argument("--runs-dir", default=RUNS_DIR, help=f"where run folders go (default ./{RUNS_DIR})")
    out.add_argument("--no-live", action="store_true", help="log lines even on a terminal")
    run.set_defaults(func=run_command)

    status = sub.add_parser(
        "status",
        help="list local runs, or show one",
        description=f"Without NAME: every run under ./{RUNS_DIR}. With NAME: its phase, conditions and events.",
    )
    status.add_argument("name", metavar="NAME", nargs="?", help="a run's name")
    status.add_argument("--runs-dir", default=RUNS_DIR, help=f"default ./{RUNS_DIR}")
    status.add_argument("--json", action="store_true", help="the stored spec and status as JSON")
    status.set_defaults(func=status_command)


__all__ = ["LocalRun", "RunConfig", "RunExistsError", "register"]
