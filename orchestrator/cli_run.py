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
``--resume``'s wait for the dead driver's workers ends it, the run unchanged (``ResumeInterrupted``).
When the driver dies without stopping its workers (SIGKILL), each agent notices that its parent is
gone (``spotjob-agent --exit-with-parent``), flushes a checkpoint and stops; ``--resume`` then
carries on from it with the same job identity, so the URI's ownership and the attempts' fencing
accept it.

Exit status: 0 the job Succeeded; 1 it Failed (the reason is printed, with the end of the failed
worker's log); 2 bad arguments, a run that exists (or is driven by another process), nothing to
resume; 130 interrupted (Ctrl-C or SIGTERM: the training workers flush, then every process of the
run is stopped; at once on a second one), unless the training finished meanwhile (then 0).

``spotjob status`` reads the run folder: ``orchestrator.cli_status``.
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
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from types import FrameType
from typing import Any

from agent.catalog import list_checkpoints
from agent.control_channel import STATUS_FILE, read_json
from agent.storage import StorageError, open_storage
from agent.torchrun import LAUNCHERS
from orchestrator.backends.local import (
    CLOUDS,
    ENV_RUN,
    EventKind,
    LocalBackend,
    LocalOptions,
    Timeline,
    TimelineEvent,
    agent_settings_problem,
    kill_marked,
    load_trace,
    log_excerpt,
    run_pids,
)
from orchestrator.backends.local_timeline import TimelineTail
from orchestrator.cli_ckpt import NOISY_LOGGERS
from orchestrator.cli_pipe import reader_gone, stdout_reader_left
from orchestrator.controller_loop import Controller
from orchestrator.events import EventLog, EventType, JsonlEventSink, RecordedEvent, events_path
from orchestrator.live import (
    LiveView,
    LogView,
    NoticeView,
    RunView,
    Snapshot,
    Summary,
    plot_timeline,
    summarize,
    timeline_commits,
)
from orchestrator.model import (
    MAX_NAME_LENGTH,
    JobKey,
    JobSpec,
    JobStatus,
    Phase,
)
from orchestrator.reconciler import INVALID, Reconciler, ReconcilerOptions, SystemClock
from orchestrator.run_config import (
    RunConfig,
    checkpoint_uri_problem,
    describe_option_error,
    folder_problem,
    name_problem,
    nproc_within_machine,
    plot_problem,
)
from orchestrator.run_folder import (
    AGENT_EXITS,
    LOG_EXCERPT_LINES,
    RUNS_DIR,
    SUMMARY_FILE,
    TIMELINE_FILE,
    DriverLock,
    empty_runs_dir_problem,
    hand_over_commands,
    older_layout_problem,
    read_cloud,
    reported_step,
    run_file_pid,
    run_file_workdir,
    runs_dir_option,
    used_up_restarts,
    write_cloud,
    write_run_file,
)
from orchestrator.run_interrupt import (
    INTERRUPT_REASONS,
    INTERRUPTED_AT_COMPLETION,
    InterruptOutcome,
    InterruptState,
    at_completion,
    cut_short,
    flush_before_stop,
)
from orchestrator.store import JobExistsError, JsonFileJobStore, StoreError

log = logging.getLogger(__name__)


EXIT_SUCCEEDED = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130

VIEW_TICK = 0.25
RATE_WINDOW_SECONDS = 15.0
STATUS_REFRESH_SECONDS = 5.0
"""How stale the stored goodput and step hints of a local run may get between decisions."""
LEFTOVER_WAIT_SECONDS = 45.0
"""How long ``--resume`` waits for a killed driver's workers to finish their flush and stop (their
agents' ``--parent-grace`` is 30 s) before it stops what is left."""


class RunError(Exception):
    """A run cannot be created or resumed as asked: a message for people, exit status 2."""


class RunExistsError(RunError):
    """A run of that name is in the runs folder already."""


class RunDrivenError(RunError):
    """Another process drives that run right now."""


class ResumeInterrupted(Exception):
    """Ctrl-C or SIGTERM during ``--resume``'s wait for the previous driver's processes: a message
    for people, exit status 130. Nothing of the run was changed."""


# -- one driver per run ---------------------------------------------------------------------------


# -- one run ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Takeover:
    """What ``--resume`` found of the previous driver."""

    previous_pid: int | None
    leftovers: int
    """Processes of the run still alive when the resume began."""
    stopped: int
    """Of those, how many had to be stopped (the rest finished their flush on their own)."""
    gap_seconds: float | None
    """How long nobody drove the run (counted as restart time), when the run had trained."""
    late_commits: int = 0
    """Checkpoints its workers committed while nobody watched (their flush when the driver died)."""


def _refuse_agent_settings(key: JobKey, spec: JobSpec, options: LocalOptions) -> None:
    """A ``ValueError`` (exit 2) for a setting of this environment (or of the run's ``spec.env``)
    every worker's spotjob-agent would exit 2 on (``SPOTJOB_AGENT_PREFETCH=nodes``), in the agent's
    words: before any worker starts, rather than a job that ends Invalid."""
    refused = agent_settings_problem(key, spec, options)
    if refused is not None:
        raise ValueError(
            # The agent's words say what to do; this says where the value comes from (not the remedy again).
            f"every worker's spotjob-agent would refuse its settings and exit 2: {refused} (read from this "
            "environment, or from the run's spec.env, both of which every worker gets)"
        )


class LocalRun:
    """One ``spotjob run``: its folder, store, backend and controller loop. Usable in-process (tests).

    ``LocalRun(config)`` creates a new run (``RunExistsError`` if the name is taken);
    ``LocalRun.resume(runs_dir, name)`` takes an existing one over. Either holds the run's driver
    lock until ``close()`` (``run()`` closes).
    """

    def __init__(self, config: RunConfig, *, resume: bool = False) -> None:
        self.config = config
        self.key = config.key
        self.name = config.name
        self.path = config.path
        self.plan = config.plan()
        self.resumed = resume
        self.takeover: Takeover | None = None
        # The script's relative paths (its arguments, its data) name what they named when the run
        # began: a resumed run's workers run where the run's first workers ran, not wherever
        # `spotjob run --resume` was typed (`spotjob status` offers that command from anywhere).
        self.workdir = (run_file_workdir(self.path) if resume else None) or os.getcwd()
        options = LocalOptions(
            workdir=self.workdir,
            root=self.path,
            notice_seconds=config.notice,
            hear_notices=not config.ignore_notices,
            launcher=config.launcher,
            # Only a run that plans a host maintenance gives its nodes GCE metadata to announce it on.
            maintenance_seconds=config.maintenance_notice if config.maintenance_at_steps else None,
            flush_lead=config.flush_lead,
            cloud=config.cloud,
        )
        if not resume:
            spec = config.job_spec()  # before anything exists: a bad option creates nothing
            # Nor a setting of this environment every worker's agent would exit 2 on
            # (SPOTJOB_AGENT_PREFETCH=nodes): said as the agent says it, and nothing is created.
            _refuse_agent_settings(self.key, spec, options)
        self.store = JsonFileJobStore(self.path, create=False)
        if not resume:
            self._refuse_existing()
            os.makedirs(self.path, exist_ok=True)
        self.lock = DriverLock(self.path)
        if not self.lock.acquire():
            pid = DriverLock.holder(self.path)
            by = f"pid {pid}" if pid else "another process"
            raise RunDrivenError(
                f"run {self.name!r} is being driven by another spotjob run ({by}); watch it with "
                f"`spotjob status{runs_dir_option(self.config.runs_dir)} {self.name}`, or stop that process first"
            )
        try:
            if resume:
                self.spec, status, version = self._read_for_resume()
                _refuse_agent_settings(self.key, self.spec, options)
            else:
                try:
                    self.store.create(self.key, spec)
                except JobExistsError:
                    raise RunExistsError(self._exists_message()) from None
                write_cloud(self.path, config.cloud)
                self.spec, status, version = spec, JobStatus(), ""
            self.events_path = events_path(self.path, self.key)
            self._event_log = EventLog(self.events_path)
            self.timeline = Timeline(os.path.join(self.path, TIMELINE_FILE))
            self._timeline_tail = TimelineTail(self.timeline.path)
            self.sink = JsonlEventSink(self.path)
            if resume:
                self.takeover = self._take_over(status, version)
            self.backend = LocalBackend(
                options,
                plan=self.plan,
                timeline=self.timeline,
            )
        except BaseException:
            self.lock.release()
            raise
        # A local status write is a small file: the live view and `spotjob status` get goodput and
        # the step seen every few seconds, not every minute as a Kubernetes status would.
        self.reconciler = Reconciler(
            self.store,
            self.backend,
            SystemClock(),
            events=self.sink,
            options=ReconcilerOptions(status_refresh_seconds=STATUS_REFRESH_SECONDS),
        )
        self.status = status or JobStatus()
        self.events: list[RecordedEvent] = []
        self._view: RunView | None = None
        self.stopping = False
        """``run()`` is stopping every process of the run (its end, or an interrupt's)."""
        self.interrupt = InterruptState()
        """Ctrl-C and SIGTERM so far (``_Interrupts`` sets it; the first flushes, the second stops at once)."""
        self.interrupt_outcome: InterruptOutcome | None = None
        """How the interrupt's flush went, once the run stopped after one."""
        self._started = time.monotonic()
        self._ended: float | None = None
        self._rate: deque[tuple[float, int]] = deque()
        self._rate_attempt = -1
        self._commit_count = 0
        self._commits_read_at = 0.0

    @classmethod
    def resume(cls, runs_dir: str, name: str, *, cloud: str | None = None, **plan: Any) -> LocalRun:
        """Take over the run ``name`` under ``runs_dir`` with its stored spec (``plan``: the
        injected preemptions of this driver, ``RunConfig``'s fields of that group) and the cloud it
        simulates (``cloud``, if given, must be that one: ``RunError`` otherwise)."""
        problem = name_problem(name)
        if problem is not None:
            raise RunError(problem.replace("--name", "--resume", 1))
        path = os.path.abspath(os.path.join(runs_dir, name))
        store = JsonFileJobStore(path, create=False)
        key = JobKey.local(name)
        if not os.path.exists(store.path(key)):
            older = older_layout_problem(path, name)
            if older is not None:
                uri = os.path.join(path, "checkpoints")
                raise RunError(
                    f"{older}: it cannot be resumed. To carry on from its checkpoints, hand them to a new run "
                    f"and start it with the same script and options: {hand_over_commands(uri, runs_dir)}"
                )
            raise RunError(f"no run named {name!r} under {os.path.abspath(runs_dir)} to resume")
        try:
            stored = store.get(key)
        except StoreError as e:
            raise RunError(f"run {name!r} cannot be resumed: {e}") from None
        if stored is None or stored.spec is None:
            why = stored.invalid if stored is not None else "it is gone"
            raise RunError(f"run {name!r} cannot be resumed: its stored spec does not validate ({why})")
        spec = stored.spec
        try:
            recorded = read_cloud(path)
        except ValueError as e:
            raise RunError(f"run {name!r} cannot be resumed: {e}") from None
        if cloud is not None and cloud != recorded:
            raise RunError(
                f"run {name!r} simulates {recorded} (it was started with --cloud {recorded}), and --resume keeps "
                f"it: drop --cloud {cloud}, or start a new run to simulate {cloud}"
            )
        workdir = run_file_workdir(path)
        if workdir is not None and not os.path.isdir(workdir):
            raise RunError(
                f"run {name!r} cannot be resumed: its workers ran in {workdir}, which is gone, and its script's "
                "relative paths name things there; create that folder again (with what the script reads there)"
            )
        config = RunConfig(
            script=spec.command[0],
            args=list(spec.command[1:]),
            name=name,
            runs_dir=runs_dir,
            nproc=spec.nproc_per_node,
            checkpoint_uri=spec.checkpoint.uri,
            every_steps=spec.checkpoint.every_steps,
            every_seconds=spec.checkpoint.every_seconds,
            keep=spec.checkpoint.keep,
            max_restarts=spec.max_restarts,
            flush_timeout=spec.flush_timeout_seconds,
            notice=spec.notice_seconds or 30.0,
            restart_backoff=spec.restart_backoff.initial_seconds,
            env=dict(spec.env),
            cloud=recorded,
            **plan,
        )
        return cls(config, resume=True)

    def close(self) -> None:
        """Stop the backend's threads (``run()`` has, if it ran) and give up the driver lock
        (idempotent): a run made and closed without running left its monitor thread behind."""
        try:
            self.backend.close()
        finally:
            self.lock.release()

    # -- creating and taking over -------------------------------------------------------------------
    def _exists_message(self) -> str:
        return (
            f"a run named {self.name!r} exists in {self.path}: resume it with "
            f"`spotjob run{runs_dir_option(self.config.runs_dir)} --resume {self.name}`, "
            "or pick another --name"
        )

    def _refuse_existing(self) -> None:
        if os.path.exists(self.store.path(self.key)):
            raise RunExistsError(self._exists_message())
        older = older_layout_problem(self.path, self.name)
        if older is not None:  # a new run would mix its files (and its checkpoints) with the older run's
            raise RunExistsError(f"{older}: pick another --name, or move that folder away")

    def _read_for_resume(self) -> tuple[JobSpec, JobStatus | None, str]:
        try:
            stored = self.store.get(self.key)
        except StoreError as e:
            raise RunError(f"run {self.name!r} cannot be resumed: {e}") from None
        if stored is None or stored.spec is None:
            raise RunError(f"run {self.name!r} cannot be resumed: its job file is gone or its spec does not validate")
        if stored.status is None and stored.invalid is not None:
            raise RunError(
                f"run {self.name!r} cannot be resumed: its stored status does not validate ({stored.invalid})"
            )
        status = stored.status
        if status is not None and status.phase.terminal:
            uri = stored.spec.checkpoint.uri
            raise RunError(
                f"run {self.name!r} {status.phase.value.lower()} already ({status.reason}: {status.message}); "
                f"there is nothing to resume. To carry on from its checkpoints in {uri} (they belong to "
                f"local/{self.name}), hand them to a new run and start that with the same script and options: "
                f"{hand_over_commands(uri, self.config.runs_dir)}"
            )
        return stored.spec, status, stored.version

    def _take_over(self, status: JobStatus | None, version: str) -> Takeover:
        """Wait for what the dead driver left running (its agents flush, then stop), stop the rest,
        count the time nobody drove the run, and say so in an Event."""
        previous = run_file_pid(self.path)
        pids = run_pids(self.path)
        stopped = 0
        if pids:
            log.warning(
                "run %s: %d process(es) of the previous driver still run; waiting up to %.0f s for their flush",
                self.key,
                len(pids),
                LEFTOVER_WAIT_SECONDS,
            )
            give_up = time.monotonic() + LEFTOVER_WAIT_SECONDS
            try:
                while run_pids(self.path) and time.monotonic() < give_up:
                    time.sleep(0.25)
            except KeyboardInterrupt:
                raise ResumeInterrupted(self._interrupted_waiting(len(run_pids(self.path)))) from None
            stopped = kill_marked(ENV_RUN, self.path, grace=3.0, reason=f"resuming {self.key}")
        # The old driver's last record in the timeline: about when it died.
        last = max((e.t for e in Timeline.read(self.timeline.path)), default=None)
        late = self._commits_seen_late()
        gap = None
        changed = False
        # The step the ranks last reached, which the status stores only every few seconds: an
        # interrupt (no flush) loses the steps past the newest commit, and they count as lost.
        reported = reported_step(self.path, status) if status is not None and status.recovery is None else None
        if status is not None and reported is not None and reported > (status.attempt.observed_step or 0):
            status.attempt.observed_step = reported
            changed = True
        # Nobody drove the run between the old driver's last record and now: not training time.
        # (A recovery in progress counts that time itself when the next attempt runs.)
        if status is not None and status.recovery is None and status.start_time is not None and last is not None:
            gap = max(0.0, time.time() - last)
            status.restarting_seconds += gap
            changed = True
        if status is not None and changed:
            try:
                self.store.update_status(self.key, status, version=version)
            except StoreError as e:
                raise RunError(f"run {self.name!r} cannot be resumed: {e}") from None
        takeover = Takeover(previous, len(pids), stopped, gap, late)
        driver = f"the previous driver{f' (pid {previous})' if previous else ''}"
        if status is not None and status.reason in INTERRUPT_REASONS:
            # It stopped every process itself, and ended their attempt (Reconciler.driver_stopped):
            # nothing was lost with it, and no preemption is counted.
            newest = status.last_checkpoint
            said = (
                f"{driver} was interrupted and stopped every process of the run ({status.reason}); the next attempt "
                f"starts from {f'step {newest.step}' if newest is not None else 'the start (no checkpoint)'}"
            )
        else:
            said = f"{driver} is gone"
        message = (
            f"spotjob run --resume (pid {os.getpid()}) drives the run again; {said}"
            + (f"; {len(pids)} of its processes still ran ({stopped} had to be stopped)" if pids else "")
            + (f"; {late} checkpoint(s) committed after it was gone" if late else "")
            + (f"; nothing drove the run for {gap:.0f} s (counted as restart time)" if gap is not None else "")
        )
        self.sink.emit(self.key, EventType.NORMAL, "Resumed", message)
        return takeover

    def _interrupted_waiting(self, left: int) -> str:
        """What a Ctrl-C or SIGTERM during the wait for the previous driver's processes says. They
        are left to end their flush: stopped now, the steps since the newest commit would be lost."""
        again = f"`spotjob run{runs_dir_option(self.config.runs_dir)} --resume {self.name}`"
        if not left:
            return f"interrupted; nothing of {self.name} runs, and nothing of it was changed: carry on with {again}"
        return (
            f"interrupted while waiting for {left} process(es) the previous driver of {self.name} left: their "
            "agents go on with the flush they began when that driver died and stop by themselves once it ends. "
            f"Nothing of the run was changed: carry on with {again}"
        )

    def _commits_seen_late(self) -> int:
        """Record in the timeline the commits the dead driver's workers made after it stopped
        watching (their flush, at least): each rank 0 left its count in its control folder."""
        events = Timeline.read(self.timeline.path)
        counted: dict[str, int] = {}
        attempts: dict[str, int] = {}
        for e in events:
            worker = str(e.data.get("worker", ""))
            if e.kind == EventKind.WORKER_STARTED:
                attempts[worker] = int(e.data.get("attempt", 0))
            elif e.kind == EventKind.COMMIT:
                count = e.data.get("count", 1)
                counted[worker] = counted.get(worker, 0) + (count if isinstance(count, int) and count > 0 else 1)
        late = 0
        for worker, attempt in attempts.items():
            folders = [os.path.join(self.path, "nodes", n, worker) for n in _listdir(os.path.join(self.path, "nodes"))]
            for folder in folders:
                data = read_json(os.path.join(folder, STATUS_FILE))
                commits = data.get("commits") if data else None
                step = data.get("last_committed_step") if data else None
                if not isinstance(commits, int) or not isinstance(step, int) or commits <= counted.get(worker, 0):
                    continue
                missed = commits - counted.get(worker, 0)
                self.timeline.record(
                    EventKind.COMMIT, worker=worker, attempt=attempt, step=step, count=missed, unwatched=True
                )
                late += missed
        return late

    # -- running ----------------------------------------------------------------------------------
    def run(self, view: RunView | None = None) -> JobStatus:
        """Run the job to Succeeded or Failed; always stops every process of the run before returning.
        ``KeyboardInterrupt`` when Ctrl-C or SIGTERM stopped it first, unless the job ended
        meanwhile (its training finished during the interrupt's flush): then its status."""
        self._view = view
        interrupted = False
        try:
            write_run_file(self.path, self.workdir, sys.argv)
            self.timeline.record(
                EventKind.RUN_STARTED,
                job=str(self.key),
                command=self.spec.command,
                nproc=self.spec.nproc_per_node,
                resumed=self.resumed,
            )
            log.info(
                "run %s%s: %s on %d rank(s); checkpoints at %s; state in %s",
                self.key,
                " (resumed)" if self.resumed else "",
                " ".join(self.spec.command),
                self.spec.nproc_per_node,
                self.spec.checkpoint.uri,
                self.path,
            )
            controller = Controller(self.reconciler, SystemClock(), wait=self._wait)
            self.status = controller.run(self.key)
            self._note_status(self.status)
        except KeyboardInterrupt:
            self._flush_for_interrupt()
            interrupted = True
        finally:
            self.stopping = True  # from here on, a Ctrl-C must not cut the stop short
            self._ended = time.monotonic()
            self.backend.close()
            if self.interrupt.signal is not None:
                self._record_interrupt()
            self.events = _events(self._event_log)
            self.timeline.record(EventKind.RUN_FINISHED, phase=str(self.status.phase))
            self._refresh()
            self.close()
        if interrupted and not self.status.phase.terminal:
            raise KeyboardInterrupt(self.interrupt.signal)
        return self.status

    # -- an interrupt ---------------------------------------------------------------------------------
    def _flush_for_interrupt(self) -> None:
        """(the first Ctrl-C or SIGTERM ended the controller loop) Have every training worker's agent
        flush before ``run()`` stops every process (``orchestrator.run_interrupt``); a second signal
        meanwhile cuts that short. ``interrupt_outcome`` is set unless it was cut short."""
        state = self.interrupt
        if state.signal is None:
            state.signal = "SIGINT"  # the interpreter's own Ctrl-C: no handler of spotjob run's in this thread
        checkpoint = self.status.last_checkpoint
        try:
            state.flushing = True
            if state.again is None:  # a second signal before the flush began: nothing is asked
                self.interrupt_outcome = flush_before_stop(
                    self.backend,
                    self.key,
                    self.spec,
                    state,
                    name=self.name,
                    phase=str(self.status.phase),
                    last_known=checkpoint.step if checkpoint is not None else None,
                    idle=self._idle,
                )
        except KeyboardInterrupt:
            self.interrupt_outcome = None  # cut short: told from storage once everything is stopped
        except Exception as e:  # the stop must still happen, and say why nothing was flushed
            log.exception("could not flush %s before stopping it", self.name)
            self.interrupt_outcome = InterruptOutcome(state.signal, why=f"the flush could not be asked for: {e}")
        finally:
            state.flushing = False

    def _idle(self, seconds: float) -> None:
        self._refresh()
        if self.backend.changed.wait(seconds):
            self.backend.changed.clear()

    def _record_interrupt(self) -> None:
        """(every process stopped) Say how the interrupt went, and end the attempt it stopped
        through the reconciler (``Reconciler.driver_stopped``): no preemption, the flush's
        checkpoint in the status, the next attempt for ``--resume``; or, when every worker exited
        0 first, the run Succeeded as any finished run does."""
        state = self.interrupt
        assert state.signal is not None
        checkpoint = self.status.last_checkpoint
        last_known = checkpoint.step if checkpoint is not None else None
        outcome = self.interrupt_outcome
        if outcome is None:
            outcome = self.interrupt_outcome = cut_short(state, self.spec.checkpoint.uri, last_known)
        kind, reason, message = outcome.event(os.getpid())
        try:
            status = self.reconciler.driver_stopped(
                self.key, reason=reason, message=message, warning=kind is EventType.WARNING, since=state.asked_at
            )
        except StoreError as e:
            log.warning("could not record the interrupt in the status of %s: %s", self.name, e)
            status = None
        if status is None:
            self.sink.emit(self.key, kind, reason, message)  # the reconciler told nothing
            return
        self._note_status(status)
        if status.phase is Phase.SUCCEEDED:
            self.sink.emit(
                self.key, EventType.NORMAL, INTERRUPTED_AT_COMPLETION, at_completion(state.signal, os.getpid())
            )

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
        self.events = _events(self._event_log)

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
            NoticeView(n.name, n.deadline - wall, maintenance=n.maintenance, cloud=self.config.cloud)
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
            cloud=self.config.cloud,
        )

    def _commits(self) -> int:
        """Commits in the timeline, counted on from what was appended since the last look, at most
        once a second (the file only grows)."""
        now = time.monotonic()
        if self._ended is not None or now - self._commits_read_at >= 1.0:
            self._commits_read_at = now
            new, from_start = self._timeline_tail.read_new()
            self._commit_count = timeline_commits(new) + (0 if from_start else self._commit_count)
        return self._commit_count

    def summary(self) -> Summary:
        """The run in numbers: the status, the whole timeline (every driver's) and storage."""
        events = Timeline.read(self.timeline.path)
        return summarize(
            self.name,
            self.spec,
            self.status,
            events,
            committed=committed_in_storage(self, events),
            cloud=self.config.cloud,
        )

    def plot(self, path: str) -> None:
        s = self.summary()
        title = (
            f"{s.name}: {s.phase}, {s.steps if s.steps is not None else '-'} steps, {s.preemptions} preemption(s), "
            f"goodput {'-' if s.goodput is None else f'{s.goodput:.0%}'}"
        )
        plot_timeline(Timeline.read(self.timeline.path), path, title=title)

    def failed_worker_logs(self) -> list[str]:
        """The logs of the workers whose failure ended the run (their exit was the script's)."""
        names = [w.name for w in self.status.workers if w.exit_code not in AGENT_EXITS]
        return [p for p in (os.path.join(self.path, "logs", f"{n}.log") for n in names) if os.path.isfile(p)]


def committed_in_storage(run: LocalRun, events: list[TimelineEvent]) -> tuple[int, int | None] | None:
    """(checkpoints this job committed during the run that storage still holds, the newest valid
    step), or None when storage cannot be read. Retention deletes old ones, so this is a floor."""
    started = next((e.t for e in events if e.kind == EventKind.RUN_STARTED), None)
    try:
        storage = open_storage(run.spec.checkpoint.uri)
        found = list_checkpoints(storage)
    except (StorageError, ValueError) as e:
        log.warning("cannot count the checkpoints in storage: %s", e)
        return None
    identity = str(run.key)
    since = datetime.fromtimestamp(started, UTC) if started is not None else None
    ours = [
        c
        for c in found
        if c.manifest is not None
        and c.manifest.job == identity
        and (since is None or c.manifest.created_at.astimezone(UTC) >= since)
    ]
    newest = next((c.ref.step for c in found if c.valid), None)
    return len(ours), newest


def _listdir(path: str) -> list[str]:
    try:
        return sorted(os.listdir(path))
    except OSError:
        return []


def _events(events: EventLog) -> list[RecordedEvent]:
    try:
        return events.read()
    except (OSError, ValueError) as e:
        log.warning("cannot read the run's events %s: %s", events.path, e)
        return []


# -- spotjob run ----------------------------------------------------------------------------------


def default_name(script: str) -> str:
    """``<script stem>-<yyyymmdd-hhmmss>`` (UTC, as every time stored in the run), made a DNS label."""
    stem = re.sub(r"[^a-z0-9-]+", "-", os.path.splitext(os.path.basename(script))[0].lower()).strip("-") or "job"
    suffix = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
    return f"{stem[: MAX_NAME_LENGTH - len(suffix) - 1].rstrip('-')}-{suffix}"


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
        return LocalRun(config_from_args(args))
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


class _Interrupts:
    """Ctrl-C and SIGTERM while ``spotjob run`` runs. The first one ends what runs
    (``KeyboardInterrupt``): the controller loop, after which ``LocalRun.run`` has every training
    worker's agent flush before it stops every process of the run; or, before the run is driven,
    ``--resume``'s wait for the previous driver's processes. A second one while that flush runs
    stops the run at once, without it. Once the run is stopping its processes, none interrupts
    that: a third Ctrl-C (or a supervisor's repeated SIGTERM) used to cut ``LocalBackend.close``
    short and leave the run's processes running after the driver said it had stopped them.

    Once an interrupted run is stopped, SIGTERM and SIGINT are ignored until the process exits: put
    back to what they were (the default, for the command), a supervisor's SIGTERM repeated in the
    moment between the stop and the exit ended the driver by the signal (143 to a shell) instead of
    its exit 130. Ignored, not a handler of ours: the interpreter's shutdown puts Python handlers
    back to the default before the process ends, but keeps an ignored signal ignored."""

    def __init__(self, run: LocalRun | None = None) -> None:
        self.run = run
        """The run, once ``prepare`` made it (before: ``--resume``'s wait, say)."""
        self.received = 0
        self._early = InterruptState()

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        self.received += 1
        name = signal.Signals(signum).name
        run = self.run
        state = run.interrupt if run is not None else self._early
        stopping = run is not None and run.stopping
        if state.signal is None and not stopping:
            state.signal = name
            raise KeyboardInterrupt(f"signal {signum}")
        if run is not None and state.signal is not None and state.again is None and not stopping:
            state.again = name
            log.warning("received %s again: stopping every process of %s at once, without the flush", name, run.name)
            if state.flushing:
                raise KeyboardInterrupt(f"signal {signum} again")
            return
        log.warning(
            "received %s again: still stopping every process of %s (SIGKILL this process to leave them running)",
            name,
            run.name if run is not None else "the run",
        )


def _pause(run: LocalRun) -> None:
    """Ctrl-Z (SIGTSTP, which reaches the driver alone: its workers run in sessions of their own):
    each worker's agent pauses its processes and itself, then the driver stops; ``fg`` or ``bg``
    (SIGCONT) resumes the driver, which resumes them. Left to the default, the driver alone
    stopped and its workers trained on with nobody driving the run."""
    paused = run.backend.signal_workers(signal.SIGTSTP, until_stopped=5.0)
    log.info("Ctrl-Z: pausing %s (%d worker(s) and this driver); fg or SIGCONT resumes it", run.name, paused)
    os.kill(os.getpid(), signal.SIGSTOP)  # returns once continued
    run.backend.signal_workers(signal.SIGCONT)
    log.info("resumed %s", run.name)


def run_command(args: argparse.Namespace) -> int:
    if not getattr(args, "verbose", False):
        # The summary's own reads of storage would log botocore's "Found credentials in environment
        # variables" among the run's lines, as spotjob ckpt does not. -v keeps it.
        for noisy in NOISY_LOGGERS:
            logging.getLogger(noisy).setLevel(logging.WARNING)
    if threading.current_thread() is not threading.main_thread():
        run = _prepared(args)  # only the main thread can take signals
        return run if isinstance(run, int) else _drive(run, args)
    # From before the run is made: a Ctrl-C or SIGTERM during --resume's wait for the previous
    # driver's processes ended it with a traceback-less 130 and no word, or by the signal (143).
    interrupts = _Interrupts()
    saved = {signum: signal.signal(signum, interrupts) for signum in (signal.SIGTERM, signal.SIGINT)}
    try:
        run = _prepared(args)
        if isinstance(run, int):
            return run
        interrupts.run = run
        if signal.getsignal(signal.SIGTSTP) != signal.SIG_IGN and os.getpid() != 1:  # as spotjob-agent
            saved[signal.SIGTSTP] = signal.signal(signal.SIGTSTP, lambda signum, frame: _pause(run))
        return _drive(run, args)
    finally:
        for signum, handler in saved.items():
            if interrupts.received and signum in (signal.SIGTERM, signal.SIGINT):
                signal.signal(signum, signal.SIG_IGN)  # the run is stopped: its exit is 130 (above)
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
        if args.resume is not None:
            again = f"`spotjob run{runs_dir_option(args.runs_dir)} --resume {args.resume}`"
            print(f"spotjob run: interrupted before it drove {args.resume}; carry on with {again}", file=sys.stderr)
        else:
            print("spotjob run: interrupted before the run started; nothing of it runs", file=sys.stderr)
        return EXIT_INTERRUPTED


def failure_line(name: str, status: JobStatus) -> str:
    """What ``spotjob run`` says of a run that did not succeed: its phase's reason, or, for a job that
    stopped because its spec is invalid (its phase still the one it had), the Invalid condition's
    message (it said "failed: Created: waiting for the first pass")."""
    invalid = status.condition(INVALID)
    if invalid is not None and invalid.status == "True":
        return f"spotjob run: {name} did not start: {invalid.reason}: {invalid.message}"
    return f"spotjob run: {name} failed: {status.reason}: {status.message}"


def carry_on_line(name: str, uri: str, status: JobStatus, newest: int | None, runs_dir: str = RUNS_DIR) -> str | None:
    """After a run whose script used up its restarts, with a checkpoint in storage: where it is and
    how a new run carries on from it once the script is fixed (a failed run is not resumed, and a
    new run is refused a URI another job owns until it is handed over)."""
    if not used_up_restarts(status) or newest is None:
        return None
    return (
        f"spotjob run: the newest checkpoint of {name}, step {newest}, stays in {uri}. To carry on from it once "
        f"the script is fixed, hand it to a new run and start that with the same script and options: "
        f"{hand_over_commands(uri, runs_dir)}"
    )


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
    finally:
        run.close()

    summary = run.summary()
    try:
        with open(os.path.join(run.path, SUMMARY_FILE), "w") as f:
            json.dump(summary.to_json(), f, indent=2)
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


def _tell_outcome(run: LocalRun, status: JobStatus, summary: Summary, interrupted: bool, runs_dir: str) -> int:
    """On stderr: how the run ended, when it did not succeed; the exit status."""
    if interrupted:
        resume = f"`spotjob run{runs_dir} --resume {run.name}`"
        outcome = run.interrupt_outcome
        said = (
            f"interrupted; every process of {run.name} was stopped (carry on with {resume})"
            if outcome is None
            else outcome.line(run.name, resume)
        )
        print(f"spotjob run: {said}", file=sys.stderr)
        return EXIT_INTERRUPTED
    if status.phase is Phase.SUCCEEDED:
        if run.interrupt.signal is not None:
            # The training finished during the interrupt's flush: a finished run, which says so.
            print(
                f"spotjob run: the interrupt ({run.interrupt.signal}) came as {run.name} finished: every worker "
                "exited 0, so the run is complete and nothing is left to resume",
                file=sys.stderr,
            )
        return EXIT_SUCCEEDED
    print(failure_line(run.name, status), file=sys.stderr)
    for path in run.failed_worker_logs():
        print(f"the end of {path}:", file=sys.stderr)
        for line in log_excerpt(path, LOG_EXCERPT_LINES):
            print(f"  {line[:300]}", file=sys.stderr)
    carry_on = carry_on_line(run.name, run.spec.checkpoint.uri, status, summary.last_checkpoint, run.config.runs_dir)
    if carry_on is not None:
        print(carry_on, file=sys.stderr)
    return EXIT_FAILED


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
    inj.add_argument("--preempt-every", type=_SECONDS, metavar="SECONDS", help="a notice about every N seconds")
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


__all__ = [
    "DriverLock",
    "LocalRun",
    "RunConfig",
    "RunDrivenError",
    "RunError",
    "RunExistsError",
    "checkpoint_uri_problem",
    "describe_option_error",
    "plot_problem",
    "register",
]
