"""One local run, driven to its end: ``LocalRun``.

A ``LocalRun`` holds the run's folder (under its driver lock), its store, the local backend and the
real ``Reconciler`` on the real clock. ``run()`` writes the run file, runs the controller loop
(between two passes ``_wait`` refreshes the view and wakes early when the backend reports a
change), and at the end stops every process of the run; after a Ctrl-C or SIGTERM it first has the
training workers flush (``orchestrator.run_interrupt``) and ends the attempt through
``Reconciler.driver_stopped``. ``snapshot``, ``summary`` and ``plot`` are what the live view, the
summary and ``--plot`` read.

``spotjob run`` (``orchestrator.cli_run``) makes one from its arguments and drives it; tests make
and run one in-process.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections import deque
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from agent.catalog import list_checkpoints
from agent.control_channel import STATUS_FILE, read_json
from agent.storage import StorageError, open_storage
from orchestrator.backends.local import (
    ENV_RUN,
    EventKind,
    LocalBackend,
    LocalOptions,
    Timeline,
    TimelineEvent,
    agent_settings_problem,
    kill_marked,
    run_pids,
)
from orchestrator.backends.local_timeline import TimelineTail
from orchestrator.controller_loop import Controller
from orchestrator.events import EventLog, EventType, JsonlEventSink, RecordedEvent, events_path
from orchestrator.live import (
    NoticeView,
    RunView,
    Snapshot,
    Summary,
    plot_timeline,
    summarize,
    timeline_commits,
)
from orchestrator.model import JobKey, JobSpec, JobStatus, Phase
from orchestrator.reconciler import Reconciler, ReconcilerOptions, SystemClock
from orchestrator.run_config import RunConfig, name_problem
from orchestrator.run_folder import (
    AGENT_EXITS,
    TIMELINE_FILE,
    DriverLock,
    hand_over_commands,
    older_layout_problem,
    read_cloud,
    reported_step,
    run_file_pid,
    run_file_workdir,
    runs_dir_option,
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

log = logging.getLogger("orchestrator.cli_run")  # spotjob run's one logger, as before it was split


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
