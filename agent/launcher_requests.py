"""The agent's state and the requests that change it, from any thread.

``AgentRequests`` holds everything an agent knows (its flush, its stop, the early saves asked for,
the problems it warned about, the command's pid and exit code) behind one lock, and answers the
callers that are not the watch loop: every notice source (``on_notice``), the control API
(``request_flush``, ``request_stop``, ``request_save``, ``ready``, ``status``). The first notice
that means "this node is going" writes ``flush.json`` once; later ones only log, and may bring the
kill time forward. ``agent.launcher.Agent`` builds on it with the running of the command (start,
watch, finish), on the main thread.

``flush_window`` says whether the time before a notice's deadline can hold a flush as long as the
last save; ``/status`` and the log show its answer.
"""

from __future__ import annotations

import collections
import logging
import os
import subprocess
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from agent.control_api import (
    AgentState,
    ControlApi,
    FlushBody,
    FlushInfo,
    FlushRefused,
    FlushResultInfo,
    NoticeInfo,
    ReadyResponse,
    SaveBody,
    SaveInfo,
    StatusResponse,
    StopBody,
    StopInfo,
    safe,
)
from agent.control_channel import ENV_CHECKPOINT_URI, ControlDir, FlushRequest, FlushResult
from agent.exit_codes import command_exit_code
from agent.launcher_cli import AgentConfig
from agent.notices.base import Notice, NoticeKind, NoticeSource, format_deadline, utc_stamp
from agent.torchrun import Rendezvous, torchrun_args

CLOUD_SOURCES = frozenset({"aws", "gcp", "azure"})
"""The notice sources whose far deadlines ``--flush-lead`` holds: a SIGTERM, the controller's or a
user's ``POST /flush`` and the driver's loss ask for a flush now."""

CLOCK_STEP = 1.0
"""How far back this node's clock must have been stepped since a held notice came to bring its
flush forward (less is the two clocks' drift)."""

RELEASE_SLACK = 1.0
"""How late after its time a held notice's flush may start and still be the flush the agent
scheduled to fit: the watch loop's tick and a scan of the process tree, with room. A flush that
starts as long before the deadline as the last save x ``--safety-margin`` has exactly that long,
less the moments the loop took to see its time had come: no warning that it may not fit."""

FLUSH_AT_MOVED = 1.0
"""How far a held notice's flush time must move (a later save took longer or less long) since the
agent said it to be said again."""

log = logging.getLogger("agent.launcher")  # the agent's one logger, as before the module was split

MAX_SAVE_IDS = 64
"""How many ``POST /save`` request ids an agent remembers (a retry of an older one saves again)."""


# -- the flush window ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Window:
    ok: bool
    message: str


def flush_window(
    deadline: float | None, last_save_seconds: float | None, margin: float, now: float, *, slack: float = 0.0
) -> Window:
    """Can the time left before ``deadline`` hold a flush as long as the last save (x ``margin``)?
    ``slack``: seconds the time left may fall short of that and still fit (``RELEASE_SLACK``)."""
    if deadline is None:
        return Window(True, "no deadline")
    left = deadline - now
    if left <= 0:
        return Window(False, f"the deadline passed {-left:.1f} s ago")
    if last_save_seconds is None:
        return Window(True, f"{left:.1f} s left; no save timed yet, so no estimate of a flush")
    need = last_save_seconds * margin
    if left + slack < need:
        return Window(
            False,
            f"{left:.1f} s left but the last save took {last_save_seconds:.1f} s "
            f"(x{margin:g} = {need:.1f} s): the flush may not commit in time",
        )
    return Window(True, f"{left:.1f} s left; the last save took {last_save_seconds:.1f} s (x{margin:g} = {need:.1f} s)")


# -- the agent -------------------------------------------------------------------------------------


@dataclass
class _Flush:
    request: FlushRequest
    notice: Notice
    deadline: float | None
    """The earliest deadline heard (a later notice may bring it forward; flush.json keeps its own)."""
    kill_at: float
    """Monotonic time at which the command's processes are killed if still running."""
    kill_reason: str
    result: FlushResult | None = None


class AgentRequests:
    """The agent's state, and what changes it from any thread: the notice sources' callback, the
    control API's requests, ``/status``. ``agent.launcher.Agent`` adds the running of the command."""

    def __init__(
        self,
        config: AgentConfig,
        control: ControlDir,
        sources: Sequence[NoticeSource] = (),
        *,
        token: str | None = None,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.config = config
        self.control = control
        self.sources = list(sources)
        self.token = token
        self.env = dict(os.environ if env is None else env)
        self.agent_id = uuid.uuid4().hex
        self._lock = threading.RLock()
        self._state: AgentState = "starting"
        self._flush: _Flush | None = None
        self._peer_result: FlushResult | None = None
        """A flush this node's ranks committed without this agent asking: another node's agent did
        (every rank of the job flushes at the same step), found in the control folder."""
        self._peer_kill_at: float | None = None
        """Monotonic time at which the command is killed after ``_peer_result`` (``--exit-timeout``)."""
        self._child: subprocess.Popen[bytes] | None = None
        self._returncode: int | None = None
        self._killed = False
        self._killed_at_work = True
        """When the agent killed the command: whether more than torchrun was left of it (a rank, a
        script still at work after close()); False when only torchrun waited (its exit barrier)."""
        self._started_monotonic = time.monotonic()
        self._started_at = time.time()
        self._terminate_requested: int | None = None
        self._suspend_requested = False
        """SIGTSTP (Ctrl-Z) came: the watch loop pauses the command's processes, then the agent."""
        self._stop: StopInfo | None = None
        self._parent_pid = os.getppid()
        self._parent_gone = False
        self._rank_seen = False
        self._connect_check_at = config.rank_connect_timeout
        """Seconds after the start at which ``_check_ranks`` next says that no rank connected."""
        self._connect_checking = threading.Event()
        """A check of the ranks' meeting point is under way (a thread of ``_warn_not_connected``)."""
        self._connect_found: str | None = None
        """What the last such check found (logged again only when it changes)."""
        self._agent_file_lock = threading.Lock()
        self._agent_file_removed = False
        """``agent.json`` is gone with the agent: nothing writes it again (a check's thread)."""
        self._agent_file_held: tuple[dict[str, Any] | None, int | None] = (None, None)
        """The held notice and flush time (to the second) ``agent.json`` says now."""
        self._problems: dict[str, str] = {}
        """What the agent warned about, by topic (shown in /status)."""
        self._rendezvous: Rendezvous | None = None
        self._torchrun = torchrun_args(config.command) is not None
        self._runner = "torchrun"
        """What runs the ranks, for messages: torchrun, or (``--launcher direct``) the agent's launcher."""
        self._holding: dict[tuple[str, str], Notice] = {}
        """The cloud notices far from their deadlines, by event (``_held_key``): the earliest
        (``_held``) decides when ``release_held`` starts the flush, ``--flush-lead`` before it."""
        self._flush_at_said: tuple[Notice | None, float] = (None, 0.0)
        """The held notice whose flush time the log said last, and that time (``_say_moved``)."""
        self._saves: collections.OrderedDict[str, SaveInfo] = collections.OrderedDict()
        """Save requests taken through ``POST /save``, by id (the newest ``MAX_SAVE_IDS``)."""
        self.api: ControlApi | None = None

    # -- notices (any thread) ------------------------------------------------------------------
    def on_notice(self, notice: Notice) -> None:
        """The callback every notice source calls."""
        if notice.withdrawn:
            self._withdraw(notice)
            return
        if notice.kind is NoticeKind.REBALANCE and self.config.rebalance != "flush":
            if self.config.rebalance == "ignore":
                log.info("rebalance recommendation from %s ignored (--rebalance ignore)", notice.source)
                return
            request = self.control.request_save(f"{notice.source} {notice.kind.value}: {notice.detail}")
            log.info("rebalance recommendation: asked the ranks for an early checkpoint (save %s)", request.id)
            return
        if self._hold(notice):
            return
        try:
            self._start_flush(notice)
        except FlushRefused as e:
            log.info("notice from %s ignored: %s", notice.source, e)

    def _flush_at(self, notice: Notice, *, assumed_too: bool = False) -> float | None:
        """When a held notice's flush starts: ``--flush-lead`` before its deadline, or as long before
        it as the last save took x ``--safety-margin``, whichever is sooner. None: not a notice to
        hold (no deadline, an assumed one unless ``assumed_too``, not a cloud's, a preemption, or
        ``--flush-lead 0``)."""
        schedule = self._schedule(notice, assumed_too=assumed_too)
        return schedule[0] if schedule is not None else None

    def _schedule(self, notice: Notice, *, assumed_too: bool = False) -> tuple[float, str] | None:
        """``_flush_at``, and what set its lead, in words for the log: ``--flush-lead``, or the last
        save's time x ``--safety-margin`` where that is longer."""
        lead = self.config.flush_lead
        if lead <= 0 or notice.deadline is None or notice.source not in CLOUD_SOURCES:
            return None
        if notice.deadline_assumed and not assumed_too:
            # The cloud did not say when (an Azure event already Started, a GCE maintenance found
            # set): the node may go at any moment, sooner than the guess. Held, the flush could
            # start after the node is gone.
            return None
        if notice.kind is NoticeKind.PREEMPTION:
            # Spot preemption gives 30 s to 2 minutes. One further away than --flush-lead is this
            # node's clock running behind the cloud's (AWS and Azure send a time of day): held, the
            # flush could come after the node is gone.
            return None
        set_by = "--flush-lead; 0 flushes at once"
        rank = self.control.status()
        if rank is not None and rank.last_save_seconds is not None:
            need = rank.last_save_seconds * self.config.safety_margin
            if need > lead:
                lead = need
                set_by = (
                    f"the last save took {rank.last_save_seconds:.1f} s x --safety-margin "
                    f"{self.config.safety_margin:g}, more than --flush-lead {self.config.flush_lead:g} s"
                )
        # The deadline is a time of day (GCE's counts from when the notice came, by this clock): a
        # clock stepped back since then would flush that much late. The time since the notice
        # (monotonic) counts too, whichever comes sooner; a clock stepped ahead flushes early.
        stepped_back = notice.received_at + (time.monotonic() - notice.received_monotonic) - time.time()
        return notice.deadline - lead - (stepped_back if stepped_back > CLOCK_STEP else 0.0), set_by

    def _hold(self, notice: Notice) -> bool:
        """Hold a cloud notice whose deadline is further away than ``--flush-lead`` (GCE gives a GPU
        VM an hour's notice of host maintenance, Azure 10-15 minutes of a Reboot or Redeploy):
        training goes on and ``release_held`` starts the flush in time. A flush at once would stop
        the job for the rest of the notice, and a job restarted on the same VM would flush again.
        A deadline the cloud did not tell (``Notice.deadline_assumed``) is never held."""
        schedule = self._schedule(notice)
        if schedule is None or schedule[0] <= time.time():
            if notice.deadline_assumed:
                self._say_assumed_not_held(notice)
            return False
        flush_at, set_by = schedule
        with self._lock:
            if self._flush is not None or self._stop is not None or self._returncode is not None:
                return False  # _start_flush answers it as it answers any notice now
            # One entry per event: the cloud moving a held event (same id, new time) replaces it.
            self._holding[_held_key(notice)] = notice
            if self._peer_result is not None:
                # No flush for it (the ranks are on their way out), but its node goes at the
                # deadline all the same: /status names it until the agent exits, for the controller.
                log.info(
                    "%s notice (%s): the job has committed a flush already; no flush of its own",
                    notice.source,
                    notice.detail,
                )
                return True
            if self._held is not notice:
                log.info("%s notice (%s): one is held for an earlier deadline", notice.source, notice.detail)
                return True
            self._flush_at_said = (notice, flush_at)
        log.warning(
            "%s notice (%s): deadline %s. Training goes on; the flush starts at %s, %.0f s before it "
            "(%s). A nearer notice, a SIGTERM or POST /flush flushes at once",
            notice.source,
            notice.detail,
            format_deadline(notice.deadline),
            utc_stamp(flush_at),
            (notice.deadline or flush_at) - flush_at,
            set_by,
        )
        return True

    def _say_assumed_not_held(self, notice: Notice) -> None:
        """Log that a notice a told deadline would have held flushes now: its deadline is a guess."""
        would = self._flush_at(notice, assumed_too=True)
        if would is None or would <= time.time():
            return  # it flushes now whatever its deadline: nothing to explain
        with self._lock:
            if self._flush is not None or self._stop is not None or self._returncode is not None:
                return  # no flush starts for it: _start_flush says what happens
        log.warning(
            "%s notice (%s): the cloud did not say when the node goes (deadline %s assumed), so it is not "
            "held for --flush-lead: the flush starts now",
            notice.source,
            notice.detail,
            format_deadline(notice.deadline),
        )

    def _withdraw(self, notice: Notice) -> None:
        """The cloud withdrew an event: a notice of it the agent holds is dropped. A flush it
        started already goes on: the ranks may be part-way through it."""
        with self._lock:
            held = self._holding.pop(_held_key(notice), None)
        if held is not None:
            log.warning(
                "%s withdrew its %s notice (%s): the flush held for %s is dropped, training goes on",
                notice.source,
                notice.kind.value,
                notice.detail,
                format_deadline(held.deadline),
            )
        else:
            log.info("%s withdrew its %s notice (%s)", notice.source, notice.kind.value, notice.detail)

    def release_held(self) -> None:
        """(the watch loop) Start the flush of a held notice once its time has come; never once
        the ranks committed another node's flush (``_peer_result``): the notice is only reported
        then, until the agent exits."""
        with self._lock:
            if self._peer_result is not None:
                return
            held = self._held
        if held is None:
            return
        schedule = self._schedule(held)
        if schedule is not None and time.time() < schedule[0]:
            self._say_moved(held, *schedule)
            return
        with self._lock:
            if self._held is not held or self._peer_result is not None:
                return
        log.info("%s notice held until now (deadline %s): flushing", held.source, format_deadline(held.deadline))
        try:
            self._start_flush(held, scheduled=schedule is not None)
        except FlushRefused as e:
            with self._lock:
                self._holding.clear()
            log.info("held notice from %s dropped: %s", held.source, e)

    def _say_moved(self, held: Notice, flush_at: float, set_by: str) -> None:
        """(the watch loop) Log at INFO a held notice's flush time that moved since it was said: a
        later save took longer or less long, and the last save x ``--safety-margin`` sets the lead
        (the flush starts at the time logged last, not at the one the notice's warning said)."""
        with self._lock:
            said_of, said_at = self._flush_at_said
            if said_of is held and abs(flush_at - said_at) < FLUSH_AT_MOVED:
                return
            self._flush_at_said = (held, flush_at)
        # Also said for a notice held behind another until that one was withdrawn: now its own comes first.
        log.info(
            "%s notice (%s): its flush now starts at %s, %.0f s before the deadline (%s)",
            held.source,
            held.detail,
            utc_stamp(flush_at),
            (held.deadline or flush_at) - flush_at,
            set_by,
        )

    @property
    def _held(self) -> Notice | None:
        """The held notice with the earliest deadline: the one whose flush comes first."""
        with self._lock:
            return min(self._holding.values(), key=lambda n: n.deadline or 0.0, default=None)

    def held_report(self) -> tuple[NoticeInfo | None, float | None]:
        """The notice held (the one whose flush comes first) and when its flush starts, as
        ``/status`` and ``agent.json`` say them; (None, None) while none is held."""
        held = self._held
        if held is None:
            return None, None
        return _notice_info(held), self._flush_at(held)

    def request_flush(self, body: FlushBody) -> tuple[FlushInfo, bool]:
        """``POST /flush`` (a control-API thread)."""
        notice = Notice(source="api", kind=body.kind, deadline=body.deadline, detail=safe(body.reason, 1000))
        log.info(
            "flush asked through the control API: %s, deadline %s", safe(body.reason), format_deadline(body.deadline)
        )
        request, created = self._start_flush(notice)
        return _flush_info(request), created

    def request_stop(self, body: StopBody) -> tuple[StopInfo, bool]:
        """``POST /stop`` (a control-API thread): stop the command without a flush.

        The controller stops the healthy workers of a gang this way after a peer's code failed:
        a flush would wait for ranks that are gone. The watch loop does the stopping.
        """
        with self._lock:
            if self._state == "exited" or self._returncode is not None:
                raise FlushRefused("the command has already ended")
            if self._stop is not None:
                return self._stop, False
            self._stop = StopInfo(reason=safe(body.reason, 1000), requested_at=time.time())
            self._state = "stopping"
        log.warning("stop asked through the control API: %s; stopping the command without a flush", safe(body.reason))
        return self._stop, True

    def request_save(self, body: SaveBody) -> tuple[SaveInfo, bool]:
        """``POST /save`` (a control-API thread): an early checkpoint, training goes on.

        The same ``save.json`` an AWS rebalance recommendation writes (``--rebalance save-early``);
        the ranks serve it at an agreed step. Idempotent per request id: an id seen before starts
        nothing. A new id while an earlier save still waits for the ranks joins it: the answer is
        that save, not created (one save.json serves both). A flush under way, or a command that has
        ended, refuses it (409): a flush commits a checkpoint anyway.
        """
        with self._lock:
            if self._state == "exited" or self._returncode is not None:
                raise FlushRefused("the command has already ended")
            if self._flush is not None or self._stop is not None:
                raise FlushRefused(f"the agent is {self._state}: no early save now")
            known = self._saves.get(body.id)
            if known is not None:
                return known, False
            request = self.control.request_save(safe(body.reason, 1000), body.id)
            # Another id: the save still pending (an earlier POST /save's, a rebalance's) was kept.
            created = request.id == body.id
            info = SaveInfo(id=request.id, reason=request.reason, requested_at=request.requested_at)
            self._saves[body.id] = info
            while len(self._saves) > MAX_SAVE_IDS:
                self._saves.popitem(last=False)
        log.info(
            "early checkpoint asked through the control API (save %s): %s%s",
            safe(body.id),
            safe(body.reason),
            "" if created else f"; joins save {safe(request.id)}, still waiting for the ranks",
        )
        return info, created

    def ready(self) -> ReadyResponse:
        """``GET /readyz``: ready once the node's ranks train (its first rank's status.json past "starting")."""
        with self._lock:
            state = self._state
        if state in ("stopping", "exited"):
            return ReadyResponse(ready=False, reason=f"the agent is {state}")
        rank = self.control.status()
        if rank is None:
            return ReadyResponse(ready=False, reason="no rank has reported yet")
        if rank.state == "starting":
            return ReadyResponse(ready=False, reason="the ranks are starting (rendezvous, restore)")
        return ReadyResponse(ready=True, reason=f"the ranks are {rank.state} at step {rank.step}")

    def _start_flush(self, notice: Notice, *, scheduled: bool = False) -> tuple[FlushRequest, bool]:
        """``scheduled``: a held notice's flush, started when the agent set it to start so that it
        fits (``RELEASE_SLACK``)."""
        with self._lock:
            if self._state == "exited" or self._returncode is not None:
                raise FlushRefused("the command has already ended")
            flush = self._flush
            if flush is not None:
                self._bring_forward(flush, notice)
                log.info(
                    "%s notice (%s) while flush %s from %s is under way: no second flush%s",
                    notice.source,
                    notice.detail,
                    flush.request.id,
                    flush.notice.source,
                    # A repeated Ctrl-C at a terminal: the one way to stop now rather than at the deadline.
                    "; SIGQUIT (Ctrl-\\) stops the command at once, without a flush"
                    if notice.source == "signal"
                    else "",
                )
                return flush.request, False
            if self._stop is not None:
                # The stop ends the ranks now, without a flush: a flush.json they will never serve
                # would only make /status say "flushing" and the caller wait for a checkpoint.
                raise FlushRefused(f"the agent is stopping on request ({self._stop.reason}): no flush")
            request = self.control.request_flush(
                FlushRequest(reason=f"{notice.source} {notice.kind.value}: {notice.detail}", deadline=notice.deadline)
            )
            if notice.deadline is not None and notice.deadline <= time.time():
                # A deadline already gone: flush now, bounded like a flush without one; killing
                # at once would throw away the one chance this job has to commit.
                kill_at = time.monotonic() + self.config.flush_timeout
                kill_reason = (
                    f"the deadline had passed when the notice came; no flush result within "
                    f"--flush-timeout {self.config.flush_timeout:g} s"
                )
                log.warning(
                    "the %s notice's deadline %s passed %.1f s ago by this node's clock: flushing now anyway, "
                    "bounded by --flush-timeout %g s. A deadline already past when its notice comes most "
                    "often means this node's clock runs ahead of the one that set it (the cloud's metadata "
                    "service, the controller's): check the node's time sync (chronyc tracking, timedatectl)",
                    notice.source,
                    utc_stamp(notice.deadline),
                    time.time() - notice.deadline,
                    self.config.flush_timeout,
                )
            elif notice.deadline is not None:
                kill_at, kill_reason = _monotonic_at(notice.deadline), "the deadline passed"
            else:
                kill_at = time.monotonic() + self.config.flush_timeout
                kill_reason = f"no flush result within --flush-timeout {self.config.flush_timeout:g} s"
            self._flush = _Flush(request, notice, notice.deadline, kill_at, kill_reason)
            for held in self._holding.values():
                self._bring_forward(self._flush, held)  # its deadline, if sooner, bounds this flush too
            self._holding.clear()
            self._state = "flushing"
        window = self._window(slack=RELEASE_SLACK if scheduled else 0.0)
        log.info(
            "flush %s requested: %s; deadline %s; %s",
            request.id,
            request.reason,
            format_deadline(notice.deadline),
            window.message,
        )
        if not window.ok:
            log.warning("the time left may not hold a flush: %s", window.message)
        return request, True

    def _bring_forward(self, flush: _Flush, notice: Notice) -> None:
        """(lock held) A notice during a flush: its deadline, if still ahead, may only make the
        command's kill time sooner, never later; the earliest wins.

        The kill time, not the deadline heard before, is what a new deadline is measured against:
        a flush that began on a deadline already gone is bounded by ``--flush-timeout`` (600 s by
        default), and a later notice saying the node goes in 20 s must end that wait then. A flush
        result has its own kill time (``--exit-timeout``), which a later deadline leaves alone.
        """
        now = time.time()
        if notice.deadline is None or notice.deadline <= now:
            return
        if flush.deadline is not None and now < flush.deadline <= notice.deadline:
            # The deadline in force already bounds the kill time: a controller's retried POST /flush
            # with the same deadline, converted to the monotonic clock again a moment later, came
            # out microseconds sooner and was logged as bringing the deadline forward.
            return
        kill_at = _monotonic_at(notice.deadline)
        if kill_at < flush.kill_at:
            flush.kill_at, flush.kill_reason = kill_at, "the deadline passed"
            flush.deadline = notice.deadline
            log.warning(
                "%s brings the deadline forward to %s (flush.json keeps its own)",
                notice.source,
                format_deadline(notice.deadline),
            )
        elif flush.deadline is None or notice.deadline < flush.deadline:
            flush.deadline = notice.deadline  # the earliest heard, for /status and the window

    # -- status (any thread) -------------------------------------------------------------------
    def _window(self, *, slack: float = 0.0) -> Window:
        with self._lock:
            deadline = self._flush.deadline if self._flush is not None else None
        if deadline is None and self._flush is None:
            held = self._held
            if held is not None and self._peer_result is not None:
                return Window(True, f"{held.source} notice held: no flush of its own, the ranks committed another's")
            flush_at = self._flush_at(held) if held is not None else None
            if held is not None and flush_at is not None:
                return Window(True, f"{held.source} notice held: its flush starts at {utc_stamp(flush_at)}")
            return Window(True, "no notice")
        rank = self.control.status()
        last = rank.last_save_seconds if rank is not None else None
        return flush_window(deadline, last, self.config.safety_margin, time.time(), slack=slack)

    def status(self) -> StatusResponse:
        rank = self.control.status()
        window = self._window()
        with self._lock:
            flush = self._flush
            state = self._state
            child_pid = self._child.pid if self._child is not None else None
            returncode = self._returncode
            stop = self._stop
            problems = list(self._problems.values())
            not_meeting = self._problems.get("connect")
        held_info, flush_at = self.held_report()
        result = flush.result if flush is not None else None
        deadline = flush.deadline if flush is not None else None
        return StatusResponse(
            state=state,
            pid=os.getpid(),
            command_pid=child_pid,
            uptime_seconds=round(time.monotonic() - self._started_monotonic, 3),
            job_name=self.config.job_name,
            control_dir=self.control.path,
            checkpoint_uri=self.checkpoint_uri,
            attempt=self.config.attempt,
            rank_state=rank.state if rank else None,
            rank_checkpoint_uri=rank.checkpoint_uri if rank else None,
            step=rank.step if rank else None,
            world_size=rank.world_size if rank else None,
            last_committed_step=rank.last_committed_step if rank else None,
            last_committed_uri=rank.last_committed_uri if rank else None,
            last_save_seconds=rank.last_save_seconds if rank else None,
            restored_step=rank.restored_step if rank else None,
            restore_passed_over=rank.restore_passed_over if rank else None,
            status_updated_at=rank.updated_at if rank else None,
            ranks_connected=rank is not None,
            problems=problems,
            ranks_not_meeting=not_meeting,
            notice=_notice_info(flush.notice) if flush is not None else None,
            held_notice=held_info,
            flush_at=flush_at,
            flush=_flush_info(flush.request) if flush is not None else None,
            deadline=deadline,
            seconds_left=round(deadline - time.time(), 3) if deadline is not None else None,
            window_ok=window.ok,
            window_message=window.message,
            flush_result=_result_info(result) if result is not None else None,
            stop=stop,
            infra_error=infra_error_text(self.control.infra_error()),
            command_exit_code=command_exit_code(returncode) if returncode is not None else None,
        )

    @property
    def checkpoint_uri(self) -> str | None:
        """Where the ranks are told to write: --checkpoint-uri, else the inherited variable."""
        return self.config.checkpoint_uri or self.env.get(ENV_CHECKPOINT_URI) or None


def infra_error_text(report: dict[str, Any] | None) -> str | None:
    """A rank's ``infra-error.json`` report as one line for ``/status`` and the exit message."""
    if report is None:
        return None
    return f"rank {safe(report.get('rank', '?'), 20)}: {safe(report.get('error', 'no detail'), 500)}"


def _held_key(notice: Notice) -> tuple[str, str]:
    """Which event a notice is of: its cloud's id (Azure's EventId), else its source and kind
    (GCE's one maintenance-event, which a withdrawal names the same way)."""
    return notice.source, notice.event_id or notice.kind.value


def _monotonic_at(unix_time: float) -> float:
    return time.monotonic() + (unix_time - time.time())


def _flush_info(request: FlushRequest) -> FlushInfo:
    return FlushInfo(id=request.id, reason=request.reason, deadline=request.deadline, requested_at=request.requested_at)


def _notice_info(notice: Notice) -> NoticeInfo:
    return NoticeInfo(
        source=notice.source,
        kind=notice.kind,
        deadline=notice.deadline,
        detail=notice.detail,
        received_at=notice.received_at,
    )


def _result_info(result: FlushResult) -> FlushResultInfo:
    return FlushResultInfo(
        committed=result.error is None,
        step=result.step,
        uri=result.uri,
        request_id=result.request_id,
        notice_to_commit_seconds=result.notice_to_commit_seconds,
        error=result.error,
        finished_at=result.finished_at,
    )
