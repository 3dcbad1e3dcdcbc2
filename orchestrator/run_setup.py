"""Setting a local run up, beside ``LocalRun``'s constructor (``orchestrator.run_driver``): what
refuses a run (a name taken, a run another process drives, one that cannot be resumed:
``RunError``, exit 2), and ``--resume``'s takeover of a run whose driver is gone.

``resume_config`` reads a stored run back into the ``RunConfig`` it carries on with.
``_RunSetup``, which ``LocalRun`` joins as a mixin, refuses a new run whose name is taken, reads
the stored job for a resume and takes it over (``Takeover``): it waits up to
``leftover_wait_seconds`` for the processes the dead driver left (their agents flush when it dies,
within its ``--interrupt-deadline``, then stop) and stops what is left; once the run is driven
(``LocalRun.run``), it records the commits they made while nobody watched, counts the time nobody
drove the run as restart time, and says so in a ``Resumed`` Event. A Ctrl-C or SIGTERM during
that wait ends it with nothing of the run changed (``ResumeInterrupted``).
"""

from __future__ import annotations

import logging
import os
import shlex
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from agent.control_channel import STATUS_FILE, read_json
from orchestrator.backends.local_cloud import ENV_RUN, kill_marked, run_pids
from orchestrator.backends.local_launch import LocalOptions, agent_settings_problem
from orchestrator.backends.local_timeline import EventKind, Timeline
from orchestrator.events import EventType, JsonlEventSink
from orchestrator.model import JobKey, JobSpec, JobStatus
from orchestrator.run_config import RunConfig, name_problem
from orchestrator.run_folder import (
    DriverLock,
    hand_over_commands,
    job_file_gone_advice,
    job_file_gone_problem,
    older_layout_problem,
    read_cloud,
    reported_step,
    run_file_parent_grace,
    run_file_pid,
    run_file_workdir,
    runs_dir_option,
)
from orchestrator.run_interrupt import INTERRUPT_REASONS
from orchestrator.store import JsonFileJobStore, StoreError

if TYPE_CHECKING:
    from agent.ownership import Owner

log = logging.getLogger("orchestrator.cli_run")  # spotjob run's one logger, as before it was split


LEFTOVER_MARGIN_SECONDS = 15.0
"""Past the dead driver's agents' ``--parent-grace``, how long ``--resume`` still waits for its
workers: an agent notices its driver gone within a poll, kills its ranks at the flush's deadline
(``--kill-grace``) and then exits."""
LEFTOVER_WAIT_SECONDS = 45.0
"""How long ``--resume`` waits for a killed driver's workers to finish their flush and stop when its
``run.json`` does not say their ``--parent-grace`` (a folder from before it was recorded: its agents
had the agent's default, 30 s, and this is that and ``LEFTOVER_MARGIN_SECONDS``)."""


def leftover_wait_seconds(path: str) -> float:
    """How long ``--resume`` of the run in folder ``path`` waits for the processes its dead driver
    left before it stops what is left: their agents' ``--parent-grace`` (the dead driver's
    ``--interrupt-deadline``, as its ``run.json`` records it) and ``LEFTOVER_MARGIN_SECONDS``, or
    ``LEFTOVER_WAIT_SECONDS`` where it is not recorded."""
    grace = run_file_parent_grace(path)
    return LEFTOVER_WAIT_SECONDS if grace is None else grace + LEFTOVER_MARGIN_SECONDS


class RunError(Exception):
    """A run cannot be created or resumed as asked: a message for people, exit status 2."""


class RunExistsError(RunError):
    """A run of that name is in the runs folder already."""


class RunDrivenError(RunError):
    """Another process drives that run right now."""


class ResumeInterrupted(Exception):
    """Ctrl-C or SIGTERM during ``--resume``'s wait for the previous driver's processes: a message
    for people, exit status 130. Nothing of the run was changed."""


@dataclass(frozen=True)
class Takeover:
    """What ``--resume`` found of the previous driver."""

    previous_pid: int | None
    leftovers: int
    """Processes of the run still alive when the resume began."""
    stopped: int
    """Of those, how many had to be stopped (the rest finished their flush on their own)."""
    gap_seconds: float | None
    """How long nobody drove the run (counted as restart time), when the run had trained; None
    until the run is driven (``_record_takeover``)."""
    late_commits: int = 0
    """Checkpoints its workers committed while nobody watched (their flush when the driver died)."""


def _refuse_owned_uri(key: JobKey, spec: JobSpec) -> None:
    """A ``RunError`` (exit 2) for a new run whose ``--checkpoint-uri`` another job owns, before
    anything is made. The run failed at its first worker (``CheckpointURIOwned``) instead, having
    used up its name, and its advice (adopt the URI for this run's job) left the checkpoints to a
    Failed run that can neither run again nor be resumed. A store that cannot be read now is left
    to the run, which says so in its own words."""
    from orchestrator.reconciler import job_identity

    job = job_identity(key)
    owner = _stored_owner(spec.checkpoint.uri)
    if owner is None or owner.job == job:  # claim()'s rule: the run's first worker claims the URI
        return
    uri = spec.checkpoint.uri
    raise RunError(
        f"--checkpoint-uri {uri} belongs to {owner.describe()}, not to this run ({job}): its checkpoints are "
        f"never restored by another job. To go on from them on purpose, first `spotjob ckpt adopt {uri} "
        f"--job {job}`, then run this command again; or give a --checkpoint-uri of its own"
    )


def _stored_owner(uri: str) -> Owner | None:
    """The owner of the checkpoints in ``uri`` as storage says now, or None when storage cannot say
    (no owner recorded, a record or a store that cannot be read)."""
    from agent.ownership import OwnershipError, read_owner
    from agent.storage import StorageError, open_storage

    try:
        storage = open_storage(uri)
    except (StorageError, ValueError):
        return None
    try:
        return read_owner(storage)
    except (StorageError, OwnershipError):
        return None
    finally:
        storage.close()


def _owner_said(uri: str) -> str:
    """`` (they belong to job 'local/b1')``: the owner of the checkpoints in ``uri`` as storage says
    now, or nothing when storage cannot say."""
    owner = _stored_owner(uri)
    return f" (they belong to {owner.describe()})" if owner is not None else ""


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


def resume_config(runs_dir: str, name: str, *, cloud: str | None = None, **plan: Any) -> RunConfig:
    """The ``RunConfig`` of the run ``name`` under ``runs_dir``, which ``LocalRun.resume`` takes over:
    its stored spec, ``plan`` (the injected preemptions of this driver, ``RunConfig``'s fields of that
    group) and the cloud it simulates (``cloud``, if given, must be that one: ``RunError`` otherwise)."""
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
        gone = job_file_gone_problem(path, name)
        if gone is not None:
            raise RunError(f"run {name!r} in {path}: {gone}; {job_file_gone_advice(path, runs_dir)}")
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
    return RunConfig(
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


class _RunSetup:
    """What ``LocalRun`` does to set itself up beside its constructor: refuse a new run whose name is
    taken, and read and take over a run whose driver is gone (``--resume``). ``LocalRun.__init__``
    sets the attributes below; ``LocalRun`` joins this class as a mixin."""

    config: RunConfig
    key: JobKey
    name: str
    path: str
    store: JsonFileJobStore
    timeline: Timeline
    sink: JsonlEventSink

    def _exists_message(self, *, locked: bool = False) -> str:
        """What to do about the run that has the name: it always said to resume it, which ``--resume``
        refuses of a run that ended and of one another spotjob run drives. ``locked``: this process
        holds the run's driver lock (the run was stored as it took it), so no other drives it."""
        taken = f"a run named {self.name!r} exists in {self.path}"
        runs_dir = runs_dir_option(self.config.runs_dir)
        try:
            stored = self.store.get(self.key)
        except StoreError:
            stored = None  # unreadable: --resume says why
        status = stored.status if stored is not None else None
        if status is not None and status.phase.terminal:
            why = f" ({status.reason})" if status.reason else ""
            return f"{taken} and {status.phase.value.lower()} already{why}: pick another --name"
        pid = None if locked else DriverLock.holder(self.path)
        if pid is not None:
            by = f"pid {pid}" if pid else "another process"
            return (
                f"{taken} and is running, driven by {by}: watch it with `spotjob status{runs_dir} {self.name}`, "
                "or pick another --name"
            )
        return f"{taken}: resume it with `spotjob run{runs_dir} --resume {self.name}`, or pick another --name"

    def _refuse_existing(self) -> None:
        if os.path.exists(self.store.path(self.key)):
            raise RunExistsError(self._exists_message())
        older = older_layout_problem(self.path, self.name)
        if older is not None:  # a new run would mix its files (and its checkpoints) with the older run's
            raise RunExistsError(f"{older}: pick another --name, or move that folder away")
        gone = job_file_gone_problem(self.path, self.name)
        if gone is not None:
            # Its job was local/NAME too: a new run there restored that run's checkpoints (the
            # default URI's owner accepts it) and appended to its timeline, without a word.
            raise RunExistsError(
                f"a run named {self.name!r} was in {self.path}: {gone}, and a new run there would mix its files "
                "with that run's and go on from its checkpoints. "
                f"Pick another --name, or move that folder away (removed, its checkpoints in it go with it); "
                f"{job_file_gone_advice(self.path, self.config.runs_dir)}"
            )

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
            # Whose they are now, as storage says: `spotjob ckpt adopt` may have given them to another job.
            raise RunError(
                f"run {self.name!r} {status.phase.value.lower()} already ({status.reason}: {status.message}); "
                f"there is nothing to resume. To carry on from its checkpoints in {uri}{_owner_said(uri)}, hand "
                f"them to a new run and start that with the same script and options: "
                f"{hand_over_commands(uri, self.config.runs_dir)}"
            )
        return stored.spec, status, stored.version

    def _refuse_unusable_uri(self, spec: JobSpec) -> None:
        """(--resume, before anything of the run changes) A ``RunError`` (exit 2) when the run's
        checkpoint URI would fail its next attempt at once: another job owns it (``spotjob ckpt
        adopt`` gave it away: ``CheckpointURIOwned``), its owner record cannot be read, or storage
        refuses it for good (a file where its folder was, no such bucket, access denied:
        ``StorageRefused``). The resume drove the run into Failed instead, with advice (adopt the
        URI, fix it and submit again) after which ``--resume`` was refused as a failed run's, as
        ``_refuse_owned_uri`` says of a new run. Refused here, the run stays resumable, and the same
        ``--resume`` runs once the URI is fixed. A store that does not answer now (an outage) is
        left to the run, which waits for it (Degraded) as any attempt does."""
        from agent.ownership import OwnershipError, read_owner
        from agent.storage import PermanentStorageError, StorageError, open_storage
        from orchestrator.reconciler import job_identity

        uri = spec.checkpoint.uri
        job = job_identity(self.key)
        again = f"`spotjob run{runs_dir_option(self.config.runs_dir)} --resume {self.name}`"
        kept = f"Nothing of run {self.name!r} was changed, and it can still be resumed"
        try:
            storage = open_storage(uri)
            try:
                owner = read_owner(storage)
                if owner is None or owner.job == job:
                    storage.list_dirs("")  # what its next attempt lists first
            finally:
                storage.close()
        except OwnershipError as e:
            raise RunError(
                f"run {self.name!r} cannot be resumed now: its next attempt would fail on its checkpoint URI: {e}. "
                f"{kept}: once the record names this run's job ({job}), run {again} again"
            ) from None
        except PermanentStorageError as e:
            raise RunError(
                f"run {self.name!r} cannot be resumed now: storage refuses its checkpoint URI {uri} ({e}), and its "
                f"next attempt would fail on it (StorageRefused). --resume keeps the run's checkpoint URI, where "
                f"its checkpoints are: make {uri} readable again (put its folder back, fix the bucket or the "
                f"credentials), then run {again} again. {kept}"
            ) from None
        except (StorageError, ValueError):
            return
        if owner is None or owner.job == job:
            return
        raise RunError(
            f"run {self.name!r} cannot be resumed now: its checkpoint URI {uri} belongs to {owner.describe()}, "
            f"not to this run ({job}), and its next attempt would fail on it (CheckpointURIOwned). {kept}: to carry "
            f"on with it from those checkpoints (and from what {owner.describe()} committed there), take the URI "
            f"back with `spotjob ckpt adopt {shlex.quote(uri)} --job {job}`, then run {again} again; or leave "
            f"them to {owner.describe()}"
        )

    def _take_over(self, status: JobStatus | None, version: str) -> Takeover:
        """Wait for what the dead driver left running (its agents flush, then stop) and stop the
        rest. The rest of the takeover (``_record_takeover``) waits until the run is driven: a
        resume that never drives the run (an interrupt before it does, a backend that fails to
        start) counts no downtime and leaves no ``Resumed`` Event, and the next one counts it once."""
        previous = run_file_pid(self.path)
        pids = run_pids(self.path)
        stopped = 0
        if pids:
            wait = leftover_wait_seconds(self.path)
            log.warning(
                "run %s: %d process(es) of the previous driver still run; waiting up to %.0f s for their flush",
                self.key,
                len(pids),
                wait,
            )
            give_up = time.monotonic() + wait
            try:
                while run_pids(self.path) and time.monotonic() < give_up:
                    time.sleep(0.25)
            except KeyboardInterrupt:
                raise ResumeInterrupted(self._interrupted_waiting(len(run_pids(self.path)))) from None
            stopped = kill_marked(ENV_RUN, self.path, grace=3.0, reason=f"resuming {self.key}")
        # The step the ranks last reached, which the status stores only every few seconds: an
        # interrupt (no flush) loses the steps past the newest commit, and they count as lost.
        reported = reported_step(self.path, status) if status is not None and status.recovery is None else None
        if status is not None and reported is not None and reported > (status.attempt.observed_step or 0):
            status.attempt.observed_step = reported
            try:
                self.store.update_status(self.key, status, version=version)
            except StoreError as e:
                raise RunError(f"run {self.name!r} cannot be resumed: {e}") from None
        return Takeover(previous, len(pids), stopped, None)

    def _record_takeover(self, found: Takeover) -> Takeover:
        """(the resumed run is being driven, just before its start is recorded in the timeline)
        Record the commits the dead driver's workers made unwatched, count the time nobody drove
        the run as restart time, and say so in a ``Resumed`` Event. The gap ends at the timeline's
        next record (``RUN_STARTED``, which follows at once), where the next resume's begins."""
        # The old driver's last record in the timeline: about when it died.
        last = max((e.t for e in Timeline.read(self.timeline.path)), default=None)
        late = self._commits_seen_late()
        try:
            stored = self.store.get(self.key)
        except StoreError as e:
            log.warning("cannot read the status of %s to count the time nobody drove it: %s", self.name, e)
            stored = None
        status = stored.status if stored is not None else None
        gap = None
        # Nobody drove the run between the old driver's last record and now: not training time.
        # (A recovery in progress counts that time itself when the next attempt runs.)
        trained = status is not None and status.recovery is None and status.start_time is not None
        if stored is not None and status is not None and trained and last is not None:
            gap = max(0.0, time.time() - last)
            status.restarting_seconds += gap
            try:
                self.store.update_status(self.key, status, version=stored.version)
            except StoreError as e:
                log.warning("could not count the %.0f s nobody drove %s as restart time: %s", gap, self.name, e)
                gap = None
        pids = found.leftovers
        previous = found.previous_pid
        driver = f"the previous driver{f' (pid {previous})' if previous else ''}"
        if status is not None and status.reason in INTERRUPT_REASONS:
            # It stopped every process itself, and ended their attempt (Reconciler.driver_stopped):
            # nothing was lost with it, and no preemption is counted.
            newest = status.last_checkpoint
            # What the status recorded, not where the next attempt starts: that is its newest
            # checkpoint that loads, read from storage when it starts (WorkersStarted says it).
            said = f"{driver} was interrupted and stopped every process of the run ({status.reason}); " + (
                f"the newest checkpoint it recorded is step {newest.step}"
                if newest is not None
                else "it recorded no checkpoint"
            )
        else:
            said = f"{driver} is gone"
        message = (
            f"spotjob run --resume (pid {os.getpid()}) drives the run again; {said}"
            + (f"; {pids} of its processes still ran ({found.stopped} had to be stopped)" if pids else "")
            + (f"; {late} checkpoint(s) committed after it was gone" if late else "")
            + (f"; nothing drove the run for {gap:.0f} s (counted as restart time)" if gap is not None else "")
        )
        self.sink.emit(self.key, EventType.NORMAL, "Resumed", message)
        return Takeover(previous, pids, found.stopped, gap, late)

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


def _listdir(path: str) -> list[str]:
    try:
        return sorted(os.listdir(path))
    except OSError:
        return []
