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

import contextlib
import logging
import os
import shutil
import sys
import time
from collections import deque
from datetime import UTC, datetime
from typing import Any

from agent.catalog import list_checkpoints
from agent.storage import StorageError, open_storage
from orchestrator.backends.local import LocalBackend
from orchestrator.backends.local_launch import LocalOptions
from orchestrator.backends.local_timeline import EventKind, Timeline, TimelineEvent, TimelineTail
from orchestrator.controller_loop import Controller
from orchestrator.events import EventLog, EventType, JsonlEventSink, RecordedEvent, events_path
from orchestrator.live import NoticeView, RunView, Snapshot, Summary, plot_timeline, summarize, timeline_commits
from orchestrator.model import JobStatus, Phase
from orchestrator.reconciler import Reconciler, ReconcilerOptions, SystemClock
from orchestrator.run_config import RunConfig
from orchestrator.run_folder import (
    TIMELINE_FILE,
    DriverLock,
    failed_worker_logs,
    run_file_workdir,
    runs_dir_option,
    write_cloud,
    write_run_file,
)
from orchestrator.run_interrupt import (
    INTERRUPTED_AT_COMPLETION,
    INTERRUPTED_AT_FAILURE,
    InterruptOutcome,
    InterruptState,
    at_completion,
    at_failure,
    cut_short,
    flush_before_stop,
)
from orchestrator.run_setup import (
    RunDrivenError,
    RunExistsError,
    Takeover,
    _refuse_agent_settings,
    _refuse_owned_uri,
    _RunSetup,
    resume_config,
)
from orchestrator.store import JobExistsError, JobNotFoundError, JsonFileJobStore, StoreError

log = logging.getLogger("orchestrator.cli_run")  # spotjob run's one logger, as before it was split


VIEW_TICK = 0.25
RATE_WINDOW_SECONDS = 15.0
STATUS_REFRESH_SECONDS = 5.0
"""How stale the stored goodput and step hints of a local run may get between decisions."""


# -- one run ----------------------------------------------------------------------------------------


class RunJobGone(Exception):
    """The run's job file was removed while the run went on: its workers were flushed and stopped;
    the message says so, and how to go on from its checkpoints."""


class LocalRun(_RunSetup):
    """One ``spotjob run``: its folder, store, backend and controller loop. Usable in-process (tests).

    ``LocalRun(config)`` creates a new run (``RunExistsError`` if the name is taken);
    ``LocalRun.resume(runs_dir, name)`` takes an existing one over. Either holds the run's driver
    lock until ``close()`` (``run()`` closes). Refusing a run and taking one over are
    ``_RunSetup``'s (``orchestrator.run_setup``).
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
            # A killed driver's agents flush within the deadline its interrupt would give them.
            parent_grace=config.interrupt_deadline,
        )
        if not resume:
            spec = config.job_spec()  # before anything exists: a bad option creates nothing
            # Nor a setting of this environment every worker's agent would exit 2 on
            # (SPOTJOB_AGENT_PREFETCH=nodes): said as the agent says it, and nothing is created.
            _refuse_agent_settings(self.key, spec, options)
            _refuse_owned_uri(self.key, spec)
        self.store = JsonFileJobStore(self.path, create=False)
        self._before: set[str] | None = None
        """(a new run) What its folder held before it was made (None: no folder): ``discard``."""
        self._made = False
        """(a new run) Its job is stored: this process made the run, and ``discard`` may remove it."""
        if not resume:
            self._refuse_existing()
            self._before = set(os.listdir(self.path)) if os.path.isdir(self.path) else None
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
                self._refuse_unusable_uri(self.spec)  # another job's, or refused: not a Failed run
            else:
                try:
                    self.store.create(self.key, spec)
                except JobExistsError:
                    raise RunExistsError(self._exists_message(locked=True)) from None
                self._made = True
                # Without it, --resume would simulate AWS: the run is not made (below).
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
            # A new run that cannot be made whole is not made: its name stays free.
            self._unmake()
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
        self.job_gone: str | None = None
        """The job file's path, once the run found it removed (``RunJobGone``)."""
        """``run()`` is stopping every process of the run (its end, or an interrupt's)."""
        self.interrupt = InterruptState(starting=True)
        """Ctrl-C and SIGTERM so far (``_Interrupts`` sets it; the first flushes, the second stops at
        once). One that comes before ``run()`` recorded the run's start is kept, not raised."""
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
        return cls(resume_config(runs_dir, name, cloud=cloud, **plan), resume=True)

    def close(self) -> None:
        """Stop the backend's threads (``run()`` has, if it ran) and give up the driver lock
        (idempotent): a run made and closed without running left its monitor thread behind."""
        try:
            self.backend.close()
        finally:
            self.lock.release()

    def discard(self) -> None:
        """Close a new run that was never driven and remove what making it created (its job, its
        folder, or, in a folder that was there before, what it added): its name is free again, and
        the same command starts it. A resumed run is only closed."""
        try:
            self.backend.close()
        finally:
            try:
                self._unmake()
            finally:
                self.lock.release()

    def _unmake(self) -> None:
        """Under the driver lock: what ``discard`` removes, once this process stored the run's job."""
        if not self._made:
            return
        self._made = False
        if self._before is None:
            shutil.rmtree(self.path, ignore_errors=True)
            return
        with contextlib.suppress(StoreError, OSError):
            self.store.remove(self.key)
        for entry in sorted(set(os.listdir(self.path)) - self._before):
            where = os.path.join(self.path, entry)
            if os.path.isdir(where) and not os.path.islink(where):
                shutil.rmtree(where, ignore_errors=True)
            else:
                with contextlib.suppress(OSError):
                    os.unlink(where)

    # -- running ----------------------------------------------------------------------------------
    def run(self, view: RunView | None = None) -> JobStatus:
        """Run the job to Succeeded or Failed; always stops every process of the run before returning.
        ``KeyboardInterrupt`` when Ctrl-C or SIGTERM stopped it first, unless the job ended
        meanwhile (its training finished during the interrupt's flush): then its status."""
        self._view = view
        interrupted = False
        try:
            # The grace its agents get: a --resume after this driver is killed waits for their flush.
            write_run_file(self.path, self.workdir, sys.argv, parent_grace=self.backend.options.parent_grace)
            if self.takeover is not None:  # counted here, where the timeline's next record ends the gap
                self.takeover = self._record_takeover(self.takeover)
            self.timeline.record(
                EventKind.RUN_STARTED,
                job=str(self.key),
                command=self.spec.command,
                nproc=self.spec.nproc_per_node,
                resumed=self.resumed,
            )
            self._made = False  # driven: an interrupt from here on leaves a run to --resume
            self.interrupt.starting = False
            if self.interrupt.signal is not None:  # kept while the start was recorded
                raise KeyboardInterrupt(self.interrupt.signal)
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
        except JobNotFoundError:
            # The job file was removed under the run (by hand, or with the run folder): a traceback
            # before, and the workers stopped without a flush. Flushed and stopped as for a Ctrl-C,
            # then said; nothing is recorded in a job that is gone.
            gone = self.store.path(self.key)
            log.error(
                "run %s: its job file %s was removed while the run went on: flushing, then stopping", self.name, gone
            )
            self.job_gone = gone
            if self.interrupt.signal is None:
                self.interrupt.signal = "its job file was removed"
            self._flush_for_interrupt()
        finally:
            self.stopping = True  # from here on, a Ctrl-C must not cut the stop short
            self._ended = time.monotonic()
            self.backend.close()
            if self.interrupt.signal is not None and self.job_gone is None:
                self._record_interrupt()
            self.events = _events(self._event_log)
            self.timeline.record(EventKind.RUN_FINISHED, phase=str(self.status.phase))
            self._refresh()
            self.close()
        if self.job_gone is not None:
            outcome = self.interrupt_outcome
            flushed = f"; {outcome.flush_said()}" if outcome is not None else ""
            raise RunJobGone(
                f"the run's job file {self.job_gone} was removed while the run went on, so the run cannot go on "
                f"nor be resumed{flushed}. Its checkpoints stay at {self.spec.checkpoint.uri}, owned by job "
                f"{self.key}: to go on from them, `spotjob ckpt adopt {self.spec.checkpoint.uri} --job local/NEW`, "
                f"then `spotjob run --name NEW --checkpoint-uri {self.spec.checkpoint.uri} ...`"
            )
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
                    deadline_seconds=self.config.interrupt_deadline,
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
        0 first, the run Succeeded as any finished run does; or, when the script failed by itself
        meanwhile with no restart left, the run Failed as that failure would leave it: then the
        reconciler told only the failure, and ``InterruptedAtFailure`` tells the interrupt."""
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
                self.key,
                reason=reason,
                message=message,
                warning=kind is EventType.WARNING,
                since=state.asked_at,
                before_stop=state.before_stop(),
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
        elif status.phase is Phase.FAILED:
            said = at_failure(
                outcome, os.getpid(), state.failed, status, self.spec.checkpoint.uri, self.config.runs_dir
            )
            self.sink.emit(self.key, EventType.WARNING, INTERRUPTED_AT_FAILURE, said)

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
        """The logs of the workers whose failure ended the run: their exit was the script's, or
        their script failed by itself during a flush (their agent exited 76 saying so)."""
        return failed_worker_logs(self.path, self.status.workers)


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


def _events(events: EventLog) -> list[RecordedEvent]:
    try:
        return events.read()
    except (OSError, ValueError) as e:
        log.warning("cannot read the run's events %s: %s", events.path, e)
        return []
