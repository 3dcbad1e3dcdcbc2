"""What an interrupted ``spotjob run`` does before it stops: flush, so that a stop loses nothing.

The first Ctrl-C or SIGTERM ends the controller loop; then ``flush_before_stop`` asks the agent of
every worker whose ranks train (``LocalBackend.training_workers``) to flush through its control
API, the request a preemption sends (``LocalBackend.request_flush``: ``POST /flush`` with the run's
token; an agent that did not answer is asked again while its worker runs and the deadline is
ahead), with a deadline ``INTERRUPT_FLUSH_SECONDS`` away, or ``spotjob run --interrupt-deadline``
away: the one a driver's death gives them too (``spotjob-agent --parent-grace``). Each agent has its
ranks commit a checkpoint at one step and exits (75 committed, 76 not); the driver waits for those
exits (at most the deadline and ``exit_margin`` of it), reads storage, the judge of what committed,
as the reconciler does, and then stops every process of the run. A second Ctrl-C or SIGTERM
meanwhile cuts the wait short: the run is stopped at once, without the flush. Nothing is flushed
when no worker trains (the attempt starts, or the run is between two attempts): the run is stopped
at once, as before.

``InterruptOutcome`` says how it went: the Event ``spotjob run`` records (``InterruptFlushCommitted``
with the step, ``InterruptFlushNotCommitted`` with why, or ``Interrupted`` when nothing was
flushed) and its last line. Once every process is stopped, ``Reconciler.driver_stopped`` takes
that Event as the end of the attempt (no preemption: ``--resume`` starts the next one from the
newest valid checkpoint), or finds that every worker exited 0 first: the run Succeeded, and
``spotjob run`` exits 0, its Event ``InterruptedAtCompletion``; or finds that the script failed by
itself meanwhile with no restart of ``--max-restarts`` left (below): the run Failed, and ``spotjob
run`` exits 1 as a failed run does, its Event ``InterruptedAtFailure``, which says how a new run
carries on (a failed run is not resumed).

What the driver saw before it stopped anything goes with it (``InterruptState.before_stop``), since
the stop cannot have made it: the backend's preemption notices as the interrupt came, and the
workers lost meanwhile (their node reclaimed): a preemption already under way, counted as one; the
workers whose agent exited 75 for a flush of its own, not the interrupt's (a notice only it heard, a
GCE host maintenance: its exit line says what its flush answered), the preemption that came first,
counted as one (``AgentPreempted``); the workers whose own code failed while it waited
(``failed_by_itself``): counted as that failure, a restart of ``--max-restarts`` (or the run Failed
when none is left), as without the interrupt; and the judgement's read of storage when no process
of the run was left to commit, which the reconciler's pass takes rather than read storage again.
Exits after the stop are the stop's doing (its SIGTERM and SIGKILL exits would read as failures)
and are never looked at.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta

from agent.catalog import CheckpointStatus, latest_valid
from agent.control_channel import EXIT_FLUSH_FAILED, EXIT_INFRA_ERROR, EXIT_PREEMPTED, EXIT_STOPPED
from agent.exit_codes import COMMAND_ENDED_DURING_FLUSH, answered_source
from agent.storage import Storage, StorageError, open_storage
from orchestrator.backends.base import BackendError, FlushRequestOutcome, WorkerObservation
from orchestrator.backends.local import LocalBackend
from orchestrator.events import EventType
from orchestrator.model import JobKey, JobSpec, JobStatus, WorkerPhase
from orchestrator.reconciler import BeforeStop
from orchestrator.run_folder import RUNS_DIR, hand_over_commands, used_up_restarts
from orchestrator.signals import Signal

log = logging.getLogger(__name__)

INTERRUPT_FLUSH_SECONDS = 30.0
"""The deadline an interrupt gives the agents' flush unless ``--interrupt-deadline`` says otherwise.
Whichever it is, the driver gives it its agents as ``spotjob-agent --parent-grace``
(``LocalOptions.parent_grace``): the deadline they give themselves when it dies outright."""
EXIT_MARGIN_SECONDS = 15.0
"""Past the deadline, how long the driver still waits at most for the agents to exit (an agent kills
its ranks at the deadline and then exits) before it stops them itself."""
MIN_EXIT_MARGIN_SECONDS = 5.0
"""The least of that wait: an agent's stop of its ranks (``--kill-grace`` 3 s) and its exit."""


def exit_margin(deadline_seconds: float) -> float:
    """How long past a flush's deadline of ``deadline_seconds`` the driver waits for the agents to
    exit: half the deadline, from ``MIN_EXIT_MARGIN_SECONDS`` to ``EXIT_MARGIN_SECONDS`` (15 s for
    the default 30 s), so that a short deadline, given for a supervisor's short grace, is not
    followed by a wait as long as the default's."""
    return min(EXIT_MARGIN_SECONDS, max(MIN_EXIT_MARGIN_SECONDS, deadline_seconds / 2))


POLL_SECONDS = 0.1
ASK_AGAIN_SECONDS = 1.0
"""How long after a request that failed (its agent did not answer in time) the agent is asked
again, while its worker runs and the flush's deadline is ahead."""

INTERRUPT_FLUSH_COMMITTED = "InterruptFlushCommitted"
INTERRUPT_FLUSH_NOT_COMMITTED = "InterruptFlushNotCommitted"
INTERRUPTED = "Interrupted"
"""The Event reasons of an interrupt: its flush committed, it did not, nothing was flushed."""
INTERRUPTED_AT_COMPLETION = "InterruptedAtCompletion"
"""The Event reason of an interrupt that came as the training finished (every worker exited 0):
the run Succeeded, and nothing is left to resume."""
INTERRUPTED_AT_FAILURE = "InterruptedAtFailure"
"""The Event reason of an interrupt during which the script failed by itself, a failure that ended
the run (no restart of ``--max-restarts`` left): the run Failed, and is not resumed."""
INTERRUPT_REASONS = (INTERRUPT_FLUSH_COMMITTED, INTERRUPT_FLUSH_NOT_COMMITTED, INTERRUPTED)
"""The status reason of a run an interrupt stopped (``Reconciler.driver_stopped``). Not the two
above: the run they tell of ended (Succeeded ``Completed``, Failed by its failure's reason)."""


@dataclass
class InterruptState:
    """How far Ctrl-C and SIGTERM have got, shared by the signal handler and the run."""

    signal: str | None = None
    """The first one (SIGINT, SIGTERM): flush, then stop."""
    again: str | None = None
    """The second one: stop at once, without the flush."""
    pausing: bool = False
    """Ctrl-Z's handler is pausing the workers or resuming them (``run_signal_handlers._pause``): a
    first signal now (or a second during the flush) is raised by that handler once the workers go
    on, not where it lands."""
    starting: bool = False
    """The run is being made or its start recorded (``LocalRun.run`` clears it once the timeline
    says the run started): a first signal now is kept here, not raised where it lands, and the run
    is given up before it is driven (``spotjob run`` removes a new one) or ``LocalRun.run`` raises
    it once the start is recorded."""
    flushing: bool = False
    """The flush is under way: a second signal interrupts it (before, the flush sees ``again`` and
    does not begin)."""
    asked_at: datetime | None = None
    """When the agents were asked to flush (a checkpoint of a flush made since is this one's)."""
    asked: list[str] = field(default_factory=list)
    """The workers whose agent accepted."""
    reason: str | None = None
    """Why the agents were asked to flush (``POST /flush``'s reason): the words by which an agent's
    exit 75 says that its flush answered this request (``flushed_for_another_notice``)."""
    failed: list[str] = field(default_factory=list)
    """Workers of the newest attempt whose own code failed while nothing was stopped yet
    (``failed_by_itself``), in the order seen."""
    heard: list[Signal] = field(default_factory=list)
    """The backend's preemption notices as the interrupt came: a preemption already under way."""
    lost: list[str] = field(default_factory=list)
    """Workers of the newest attempt gone without an exit code (their node reclaimed) while nothing
    was stopped yet: a preemption too."""
    preempted: list[str] = field(default_factory=list)
    """Workers of the newest attempt whose agent exited 75 for a flush that answered a notice other
    than the interrupt's request (``flushed_for_another_notice``: a GCE host maintenance, a SIGTERM
    only it heard) while nothing was stopped yet: a preemption that came first. Those whose exit line
    says their flush answered a notice of their own come first
    (``WorkerObservation.flushed_for_own_notice``), before an agent whose ranks flushed with
    another's (``PEER_FLUSH``) or whose line does not say."""
    own_notice: list[str] = field(default_factory=list)
    """Those of ``preempted`` whose flush answered a notice their agent heard."""
    newest: tuple[CheckpointStatus | None] | None = None
    """The newest valid checkpoint, read once no process of the run was left to commit one (the
    flush's judgement): the reconciler's pass takes it rather than read storage again."""

    def before_stop(self) -> BeforeStop:
        """What ``Reconciler.driver_stopped`` is told the driver saw before it stopped anything."""
        return BeforeStop(
            failed=tuple(self.failed),
            signals=tuple(self.heard),
            lost=tuple(self.lost),
            preempted=tuple(self.preempted),
            newest=self.newest,
        )


@dataclass(frozen=True)
class InterruptOutcome:
    """How an interrupt's flush went."""

    signal: str
    tried: bool = False
    """Workers trained, and their agents were asked to flush (False: nothing was flushed)."""
    asked: tuple[str, ...] = ()
    """The workers whose agent accepted."""
    step: int | None = None
    """The step the flush committed; None when it committed nothing."""
    uri: str | None = None
    """Where that checkpoint is."""
    why: str | None = None
    """Why nothing was flushed, or why the flush committed nothing."""
    newest: CheckpointStatus | None = None
    """The newest valid checkpoint in storage once the workers stopped (what ``--resume`` restores)."""
    resume_from: int | None = None
    """Its step (or, when storage was not read, the one the status last held)."""
    cut_short: bool = False
    """A second signal stopped the run before the flush ended."""
    own_flush_of: str | None = None
    """The worker whose agent was flushing for a notice of its own (``InterruptState.preempted``)
    when the interrupt asked: what committed ``step`` is then that flush, not one the driver asked for."""

    def resume_point(self) -> str:
        return f"step {self.resume_from}" if self.resume_from is not None else "the start (no checkpoint)"

    def flush_said(self) -> str:
        """How the flush went, for a run that then Failed (``at_failure``). Why it committed nothing
        goes unsaid, but for a second signal's: the failure told beside it is why (or left the other
        workers' flush without a commit), and its Event has the worker's words."""
        if self.step is not None:
            return f"{self._which_flush()} committed step {self.step} at {self.uri}"
        if self.cut_short:
            return f"the flush committed nothing ({self.why})"
        if self.tried:
            return "the flush committed nothing"
        return f"nothing was flushed ({self.why})"

    def event(self, pid: int) -> tuple[EventType, str, str]:
        """(type, reason, message) of the Event the run records."""
        said = f"{self.signal} interrupted spotjob run (pid {pid})"
        then = f"every process of the run was stopped, and --resume carries on from {self.resume_point()}"
        if self.step is not None:
            return (
                EventType.NORMAL,
                INTERRUPT_FLUSH_COMMITTED,
                f"{said}: {self._which_flush()} committed step {self.step} at {self.uri}; {then}",
            )
        if self.tried or self.cut_short:
            message = f"{said}: the flush committed nothing ({self.why}); {then}"
            return EventType.WARNING, INTERRUPT_FLUSH_NOT_COMMITTED, message
        return EventType.NORMAL, INTERRUPTED, f"{said}: nothing was flushed ({self.why}); {then}"

    def _which_flush(self) -> str:
        if self.own_flush_of is not None:
            return f"the flush {self.own_flush_of}'s agent began for a notice of its own (met by the interrupt's)"
        return "the flush it asked for"

    def line(self, name: str, resume: str) -> str:
        """What ``spotjob run`` says last (``resume``: the command that carries on)."""
        if self.step is not None:
            return (
                f"interrupted; the flush committed step {self.step}, then every process of {name} was stopped "
                f"(carry on from it with {resume})"
            )
        if self.tried or self.cut_short:
            return (
                f"interrupted; the flush committed nothing ({self.why}); every process of {name} was stopped "
                f"(carry on from {self.resume_point()} with {resume})"
            )
        return f"interrupted ({self.why}); every process of {name} was stopped (carry on with {resume})"


def at_failure(
    outcome: InterruptOutcome,
    pid: int,
    failed: Sequence[str],
    status: JobStatus,
    uri: str,
    runs_dir: str = RUNS_DIR,
) -> str:
    """The message of ``InterruptedAtFailure``: the run ``status`` Failed after the interrupt
    ``outcome``, because the script of ``failed`` (workers) failed by itself meanwhile; no
    ``--resume``, but, when the script used up its restarts, where the newest checkpoint is
    (``outcome.resume_from``, in ``uri``) and how a new run carries on from it, as ``spotjob run``
    says of any run whose script used up its restarts."""
    said = f"{outcome.signal} interrupted spotjob run (pid {pid}) as {_who_failed(failed)}"
    spent = used_up_restarts(status)
    message = (
        f"{said}; {outcome.flush_said()}. {'With no restart of --max-restarts left, that' if spent else 'That'} "
        f"failure ended the run: Failed ({status.reason}), and a failed run is not resumed"
    )
    if not spent:
        return message
    if outcome.resume_from is None:
        return f"{message}; it committed no checkpoint to carry on from"
    return (
        f"{message}; its newest checkpoint, step {outcome.resume_from}, stays in {uri}: to carry on from it once "
        f"the script is fixed, hand it to a new run and start that with the same script and options: "
        f"{hand_over_commands(uri, runs_dir)}"
    )


def at_failure_line(outcome: InterruptOutcome, name: str, failed: Sequence[str]) -> str:
    """What ``spotjob run`` says of an interrupt whose run Failed meanwhile (``at_failure``), before
    it ends as a failed run does (why, the end of the failed workers' logs, how to carry on)."""
    return (
        f"the interrupt ({outcome.signal}) came as {_who_failed(failed)}; {outcome.flush_said()}; that "
        f"failure ended {name}: it failed, and a failed run is not resumed"
    )


def _who_failed(failed: Sequence[str]) -> str:
    """(none: the run had failed as the interrupt came, before the driver looked)"""
    return f"the script of {', '.join(failed)} failed by itself" if failed else "the run failed"


def at_completion(signal: str, pid: int) -> str:
    """The message of ``InterruptedAtCompletion``."""
    return (
        f"{signal} interrupted spotjob run (pid {pid}) as the training finished: every worker exited 0, so the run "
        "is complete (Completed), and nothing is left to resume"
    )


def flush_before_stop(
    backend: LocalBackend,
    key: JobKey,
    spec: JobSpec,
    state: InterruptState,
    *,
    name: str,
    phase: str,
    last_known: int | None,
    idle: Callable[[float], None],
    deadline_seconds: float = INTERRUPT_FLUSH_SECONDS,
) -> InterruptOutcome:
    """Ask every training worker's agent to flush and wait for them to exit (see the module
    docstring); the outcome. ``phase``: the job's, said when no worker trains; ``last_known``: the
    newest checkpoint step the status holds (said when nothing is flushed); ``deadline_seconds``:
    the flush's deadline from the request (``--interrupt-deadline``). ``idle(seconds)``: how
    to wait between two looks (refreshing the view). ``KeyboardInterrupt`` (a second signal while
    ``state.flushing``) is the caller's to catch: ``cut_short`` then tells what the flush did."""
    assert state.signal is not None, "no interrupt to flush for"
    backend.hold_notices()
    try:
        state.heard = [s for s in backend.signals(key, spec) if s.kind.is_preemption]
    except BackendError as e:
        log.warning("cannot read the notices of %s before stopping it: %s", name, e)
    _note_before_stop(state, backend.list_workers(key, spec))
    training = backend.training_workers(key)
    if not training:
        why = f"no worker was training: the job was {phase}"
        return InterruptOutcome(state.signal, why=why, resume_from=last_known)
    log.warning(
        "%s: flushing a checkpoint of %s before stopping it (a %.0f s deadline); Ctrl-C (or SIGTERM) again "
        "stops it at once, without the flush",
        state.signal,
        name,
        deadline_seconds,
    )
    unread = ""
    try:
        storage: Storage | None = open_storage(spec.checkpoint.uri)
    except (StorageError, ValueError) as e:
        storage, unread = None, f"cannot read checkpoints at {spec.checkpoint.uri}: {e}"
    try:
        out = _flush(backend, key, spec, state, training, storage, idle, deadline_seconds)
    finally:
        if storage is not None:
            storage.close()
    return out if storage is not None else replace(out, why=unread, resume_from=last_known)


def _flush(
    backend: LocalBackend,
    key: JobKey,
    spec: JobSpec,
    state: InterruptState,
    training: list[WorkerObservation],
    storage: Storage | None,
    idle: Callable[[float], None],
    deadline_seconds: float = INTERRUPT_FLUSH_SECONDS,
) -> InterruptOutcome:
    """Ask, wait, judge (``storage``: None when it cannot be read; the outcome then says nothing)."""
    assert state.signal is not None
    baseline = _newest(storage) if storage is not None else None
    state.asked_at = datetime.now(UTC)
    deadline = state.asked_at + timedelta(seconds=deadline_seconds)
    reason = state.reason = (
        f"spotjob run was interrupted ({state.signal}): flushing before every process of the run stops"
    )
    asked = state.asked
    unasked: dict[str, str] = {}  # the workers whose agent could not be asked, and why

    def ask(ws: list[WorkerObservation]) -> None:
        for w in ws:
            answer = backend.request_flush(key, spec, w, reason, deadline)
            if answer.outcome is FlushRequestOutcome.FAILED:
                unasked[w.name] = answer.error
            else:
                unasked.pop(w.name, None)
                asked.append(w.name)

    ask(training)
    started = time.monotonic()
    waited = deadline_seconds + exit_margin(deadline_seconds)
    give_up = started + waited
    ask_until = started + deadline_seconds
    ask_again_at = started + ASK_AGAIN_SECONDS
    last: dict[str, WorkerObservation] = {}
    seen: list[WorkerObservation] = []
    retrying = dict(unasked)
    while asked or retrying:
        seen = backend.list_workers(key, spec)
        _note_before_stop(state, seen)
        last = {w.name: w for w in seen if w.name in asked}
        running = {w.name: w for w in seen if w.phase in (WorkerPhase.PENDING, WorkerPhase.RUNNING)}
        now = time.monotonic()
        # As the reconciler asks again at its next pass: an agent that did not answer in time (a
        # machine loaded enough to hold its answer past the request's timeout) is asked again
        # while its worker runs and the deadline leaves time; the request is idempotent.
        retrying = {n: e for n, e in unasked.items() if n in running and now < ask_until}
        if not any(n in running for n in last) and not retrying:
            break
        if now >= give_up:
            break
        if retrying and now >= ask_again_at:
            for name, error in retrying.items():
                log.warning("asking the agent of %s to flush again (%s)", name, error)
            ask([running[n] for n in retrying])
            ask_again_at = time.monotonic() + ASK_AGAIN_SECONDS
            continue
        idle(POLL_SECONDS)
    refused = [f"could not ask the agent of {name} to flush: {error}" for name, error in unasked.items()]
    # No process of the run left (every worker of the last look exited): nothing can commit after
    # the read below, which is then as good as one after the stop, and the reconciler's pass takes it.
    settled = bool(seen) and all(w.phase not in (WorkerPhase.PENDING, WorkerPhase.RUNNING) for w in seen)
    own = state.preempted[0] if state.preempted else None
    out = InterruptOutcome(state.signal, tried=True, asked=tuple(asked), own_flush_of=own)
    if storage is None:
        return out
    try:
        newest = latest_valid(storage)
    except StorageError as e:
        return replace(out, why=f"cannot read checkpoints at {spec.checkpoint.uri}: {e}")
    if settled:
        state.newest = (newest,)
    out = replace(out, newest=newest, resume_from=newest.ref.step if newest is not None else None)
    codes = [last[n].exit_code if n in last else None for n in asked]
    committed = newest is not None and (
        (_is_flush(newest) and (baseline is None or newest.ref.step > baseline))
        # Every agent exited 75: its flush found its step committed by the script's own save.
        or (bool(asked) and all(code == EXIT_PREEMPTED for code in codes) and not refused)
    )
    if committed and newest is not None:
        return replace(out, step=newest.ref.step, uri=storage.url(newest.ref.folder))
    return replace(out, why=_why_not(refused, asked, last, baseline, state, waited))


def cut_short(state: InterruptState, uri: str, last_known: int | None) -> InterruptOutcome:
    """The outcome of a flush a second signal cut short, read from storage once every process of
    the run is stopped: a flush checkpoint made since the agents were asked is this flush's (it
    committed before the second signal), the newest valid one is where ``--resume`` carries on."""
    assert state.signal is not None
    out = InterruptOutcome(
        state.signal,
        tried=state.asked_at is not None,
        asked=tuple(state.asked),
        cut_short=True,
        why=f"a second {state.again or 'signal'} stopped the run at once",
        resume_from=last_known,
    )
    try:
        storage = open_storage(uri)
    except (StorageError, ValueError) as e:
        log.warning("cannot read checkpoints at %s: %s", uri, e)
        return out
    try:
        newest = latest_valid(storage)
    except StorageError as e:
        log.warning("cannot read checkpoints at %s: %s", uri, e)
        return out
    finally:
        storage.close()
    if newest is None:
        return replace(out, resume_from=None)
    out = replace(out, newest=newest, resume_from=newest.ref.step)
    made = newest.manifest.created_at if newest.manifest is not None else None
    if state.asked_at is not None and _is_flush(newest) and made is not None and made >= state.asked_at:
        return replace(out, step=newest.ref.step, uri=storage.url(newest.ref.folder))
    return out


def failed_by_itself(w: WorkerObservation) -> bool:
    """The worker's own code failed, seen before the driver stopped anything: an exit no agent
    gives for a flush, a stop or an infrastructure error, or a 76 whose agent says the command
    ended by itself, failing, while the flush was asked (``COMMAND_ENDED_DURING_FLUSH``: the
    script raised, or a rank died). Not a 76 whose flush failed, or whose agent stopped the command
    at the flush's deadline: those are the flush's. Once the driver stops the run, exits are its
    doing and are not looked at (its SIGTERM and SIGKILL exits would read as failures)."""
    code = w.exit_code
    if code is None or code in (0, EXIT_PREEMPTED, EXIT_INFRA_ERROR, EXIT_STOPPED):
        return False
    if code == EXIT_FLUSH_FAILED:
        return COMMAND_ENDED_DURING_FLUSH in (w.detail or "")
    return True


def flushed_for_another_notice(w: WorkerObservation, reason: str | None) -> bool:
    """The worker's agent exited 75 for a flush that was not the interrupt's: one seen before the
    driver asked for any (``reason`` None), or whose exit line says its flush answered a notice of
    another source or reason than the interrupt's ``POST /flush`` with ``reason`` (the agent heard
    a GCE host maintenance or a SIGTERM itself and was flushing for it when the request came, which
    then began no flush of its own). Not when its line does not say (an older agent), nor for a
    flush another node's agent asked for (``PEER_FLUSH``): that one's own agent tells."""
    if w.exit_code != EXIT_PREEMPTED:
        return False
    if reason is None:
        return True
    answered = w.flush_answered
    if answered is None or answered_source(answered) is None:
        return False
    source, _, said = answered.partition(" ")
    return not (source == "api" and said.partition(": ")[2] == reason)


def _note_before_stop(state: InterruptState, workers: list[WorkerObservation]) -> None:
    """Note the workers of the newest attempt in ``workers`` whose own code failed, that were lost
    (Failed without an exit code: their node was reclaimed), or whose agent flushed for a notice
    other than the interrupt's request (``flushed_for_another_notice``)."""
    newest = max((w.attempt for w in workers), default=None)
    for w in workers:
        if w.attempt != newest:
            continue
        if w.name not in state.failed and failed_by_itself(w):
            state.failed.append(w.name)
        if w.name not in state.lost and w.phase is WorkerPhase.FAILED and w.exit_code is None:
            state.lost.append(w.name)
        if w.name not in state.preempted and flushed_for_another_notice(w, state.reason):
            if w.flushed_for_own_notice:
                # Ahead of a peer seen before it: the interrupt's outcome names the first as the
                # agent whose flush committed (``InterruptOutcome.own_flush_of``).
                at = next((i for i, n in enumerate(state.preempted) if n not in state.own_notice), None)
                state.preempted.insert(len(state.preempted) if at is None else at, w.name)
                state.own_notice.append(w.name)
                why = f"for a flush of its own, not the interrupt's (it answered {w.flush_answered})"
            else:
                state.preempted.append(w.name)
                why = (
                    "for a flush another node's agent asked for"
                    if w.flush_answered is not None
                    else "for a flush its line does not name"
                ) + ", before the interrupt asked for any"
            log.warning(
                "the agent of %s exited %d %s: a preemption that came first, counted as one",
                w.name,
                EXIT_PREEMPTED,
                why,
            )


def _newest(storage: Storage) -> int | None:
    try:
        newest = latest_valid(storage)
    except StorageError:
        return None
    return newest.ref.step if newest is not None else None


def _is_flush(checkpoint: CheckpointStatus) -> bool:
    """A flush's checkpoint, not a periodic save that committed meanwhile (a manifest that does not
    say counts as a flush, as the reconciler counts it)."""
    manifest = checkpoint.manifest
    return manifest is None or manifest.trigger in (None, "flush")


def _why_not(
    refused: list[str],
    asked: list[str],
    last: dict[str, WorkerObservation],
    baseline: int | None,
    state: InterruptState,
    waited: float,
) -> str:
    if state.again is not None:
        return f"a second {state.again} stopped the run at once"
    for name in asked:
        w = last.get(name)
        if w is None:
            continue
        detail = f": {w.detail}" if w.detail else ""
        if name in state.failed:
            return f"the script of {name} failed during the flush, a failure of the script (exit {w.exit_code}{detail})"
        if w.exit_code == EXIT_FLUSH_FAILED:
            return f"the agent of {name} exited {EXIT_FLUSH_FAILED}: its flush committed nothing{detail}"
        if w.exit_code == 0:
            return f"{name} exited 0: the training ended before the flush"
        if w.phase in (WorkerPhase.PENDING, WorkerPhase.RUNNING):
            newer = f" newer than step {baseline}" if baseline is not None else ""
            return f"nothing{newer} committed within {waited:.0f} s"
        if w.exit_code != EXIT_PREEMPTED:
            code = "without an exit code" if w.exit_code is None else f"{w.exit_code}"
            return f"{name} exited {code} before its flush committed{detail}"
    if refused:
        return "; ".join(refused)
    return "storage shows no checkpoint of the flush"
