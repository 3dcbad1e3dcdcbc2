"""What a local run shows: the live view while it runs, the summary at the end, the timeline plot,
and ``spotjob status``. No torch import; matplotlib only inside ``plot_timeline``.

The run loop (``LocalRun``, ``orchestrator.run_driver``) hands a ``Snapshot`` to a view a few times a second. On a
terminal ``LiveView`` redraws one rich panel in place (log lines scroll above it); elsewhere
``LogView`` writes a progress line now and then, and the reconciler's own log lines carry the
Events. Both read only the snapshot: a view never touches the backend or the store. Events are
not in the job's status: the run loop reads them from the run's events file
(``orchestrator.events.read_events``) into the snapshot, and ``spotjob status`` reads them the
same way.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any, Protocol

from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.logging import RichHandler
from rich.markup import escape
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from agent.control_api import safe
from orchestrator.backends.local_cloud import cloud_text, notice_name
from orchestrator.backends.local_timeline import EventKind, TimelineEvent
from orchestrator.events import EventType, RecordedEvent
from orchestrator.held_notices import held_cell, held_notices, held_text
from orchestrator.model import CheckpointInfo, JobSpec, JobStatus, Phase
from orchestrator.run_folder import hand_over_commands, run_file_workdir, runs_dir_option, used_up_restarts

log = logging.getLogger(__name__)

PROGRESS_EVERY_SECONDS = 15.0
"""How often ``LogView`` writes a progress line."""

_PHASE_STYLE = {
    Phase.PENDING: "cyan",
    Phase.RUNNING: "green",
    Phase.FLUSHING: "yellow",
    Phase.RESCHEDULING: "magenta",
    Phase.SUCCEEDED: "bold green",
    Phase.FAILED: "bold red",
}


_PHASE_COLOR = {
    str(Phase.PENDING): "tab:cyan",
    str(Phase.RUNNING): "tab:green",
    str(Phase.FLUSHING): "tab:orange",
    str(Phase.RESCHEDULING): "tab:purple",
}
"""Matplotlib colours of the phase strip in ``plot_timeline``."""


# -- what the views show ----------------------------------------------------------------------


@dataclass(frozen=True)
class NoticeView:
    node: str
    seconds_left: float
    maintenance: bool = False
    """A host maintenance (its agent holds it until its flush), not a spot interruption."""
    cloud: str = "aws"
    """The cloud the run simulates: GCP's and Azure's notices are named (AWS's read as they always did)."""

    def text(self) -> str:
        what = "host maintenance: stops" if self.maintenance else "goes away"
        left = f"{self.node} {what} in {max(0.0, self.seconds_left):.0f} s"
        if self.cloud == "aws":
            return left
        early = " (or once its agent acknowledges it)" if self.cloud == "azure" else ""
        return f"{notice_name(self.cloud, maintenance=self.maintenance)}: {left}{early}"


@dataclass(frozen=True)
class Snapshot:
    """One moment of a run, as the views show it."""

    name: str
    elapsed: float
    status: JobStatus
    max_restarts: int
    step: int | None
    """The newest live attempt's step (a hint from status.json), else the last one the status saw."""
    steps_per_second: float | None
    commits: int
    notices_sent: int
    notices: list[NoticeView] = field(default_factory=list)
    events: Sequence[RecordedEvent] = ()
    """The job's Events so far, oldest first by their latest occurrence."""
    cloud: str = "aws"
    """The cloud the run simulates (``spotjob run --cloud``)."""


def _ago(when: datetime | None, now: datetime | None = None) -> str:
    if when is None:
        return "-"
    if when.tzinfo is None:  # written without a zone: spotjob writes UTC
        when = when.replace(tzinfo=UTC)
    seconds = ((now or datetime.now(UTC)) - when).total_seconds()
    if seconds < -60:
        # Written by a clock ahead of this one (another machine's): not a negative age.
        return f"{_span(-seconds)} ahead of this clock"
    return f"{_span(max(0.0, seconds))} ago"


def _span(seconds: float) -> str:
    """A length of time in s, min, h or d, as ages are said (and times ahead: those were always in
    minutes, 4320 of them for three days)."""
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 120 * 60:
        return f"{seconds / 60:.0f} min"
    if seconds < 48 * 3600:
        return f"{seconds / 3600:.0f} h"
    return f"{seconds / 86400:.0f} d"


def _utc(when: datetime) -> str:
    """A time people read in ``spotjob status``: UTC with its date, as ``spotjob ckpt list`` shows
    them (the machine's zone would make one run folder read differently from elsewhere)."""
    return when.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S")


def _clock(seconds: float) -> str:
    minutes, s = divmod(int(seconds), 60)
    return f"{minutes:d}:{s:02d}"


def _goodput(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def _raw(value: object) -> str:
    """Text a run's records carry (names, messages, paths, a store's errors, a log's lines) with
    its control characters escaped: an ANSI escape in it cannot retitle or clear the terminal."""
    text = str(value)
    return safe(text, limit=len(text))


def _data(value: object, **kw: Any) -> Text:
    """Such text as a cell: escaped, and never read as rich markup (a `[/x]` in a message would
    otherwise stop the command, a `[link=...]` make a hyperlink)."""
    return Text(_raw(value), **kw)


def _mk(value: object) -> str:
    """Such text inside a string that holds spotjob's own markup."""
    return escape(_raw(value))


def checkpoint_text(status: JobStatus) -> str:
    c = status.last_checkpoint
    return "none yet" if c is None else f"step {c.step} ({_ago(c.time)})"


def held(status: JobStatus) -> list[dict[str, Any]]:
    """The cloud notices the agents hold (``status.heldNotices``) as ``kubectl spotjob status``
    reads them (JSON, camelCase); none once the job ended."""
    notices = [h.model_dump(mode="json") for h in status.held_notices or []]
    return held_notices({"phase": str(status.phase), "heldNotices": notices})


def render_snapshot(s: Snapshot) -> RenderableType:
    st = s.status
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="dim", justify="right")
    grid.add_column()
    phase = Text(str(st.phase), style=_PHASE_STYLE.get(st.phase, ""))
    phase.append(f"  attempt {st.attempt.number}", style="dim")
    if st.workers:
        phase.append(f" on {', '.join(_raw(w.node or '?') for w in st.workers)}", style="dim")
    grid.add_row("phase", phase)
    if s.cloud != "aws":
        grid.add_row("cloud", cloud_text(s.cloud))
    rate = f"  ({s.steps_per_second:.1f} steps/s)" if s.steps_per_second and not st.phase.terminal else ""
    grid.add_row("step", f"{s.step if s.step is not None else '-'}{rate}")
    grid.add_row("checkpoint", f"{checkpoint_text(st)}  [dim]{s.commits} committed this run[/dim]")
    grid.add_row(
        "preemptions",
        f"{st.preemptions}  [dim](notices sent {s.notices_sent})[/dim]   restarts {st.restarts}/{s.max_restarts}"
        f"   steps lost {st.lost_steps}",
    )
    grid.add_row(
        "goodput",
        f"{_goodput(st.goodput)}  [dim]flushing {st.flushing_seconds:.1f} s, restarting "
        f"{st.restarting_seconds:.1f} s, retraining {st.retraining_seconds:.1f} s[/dim]",
    )
    for n in s.notices:
        grid.add_row("[red]notice[/red]", f"[red]{_mk(n.text())}[/red]")
    for notice in held(st):
        grid.add_row("held notice", _data(held_text(notice, datetime.now(UTC)), overflow="fold"))
    if st.message:
        grid.add_row("why", _data(f"{st.reason}: {st.message}", overflow="fold"))
    events = Table.grid(padding=(0, 1))
    for e in s.events[-5:]:
        style = "yellow" if e.type is EventType.WARNING else "dim"
        count = f" x{e.count}" if e.count > 1 else ""
        events.add_row(
            Text(e.time.astimezone(UTC).strftime("%H:%M:%SZ"), style="dim"),
            _data(f"{e.reason}{count}", style=style),
            _data(e.message, overflow="ellipsis", no_wrap=True),
        )
    title = f"spotjob run [bold]{_mk(s.name)}[/bold]  {_clock(s.elapsed)}"
    return Panel(Group(grid, Text(""), events), title=title, title_align="left")


class RunView(Protocol):
    def update(self, snapshot: Snapshot) -> None: ...


class LogView:
    """Not a terminal: a progress line every ``PROGRESS_EVERY_SECONDS`` and on every phase change."""

    def __init__(self, every: float = PROGRESS_EVERY_SECONDS) -> None:
        self._every = every
        self._next = 0.0
        self._phase: Phase | None = None

    def update(self, s: Snapshot) -> None:
        now = time.monotonic()
        if now < self._next and s.status.phase is self._phase:
            return
        self._next, self._phase = now + self._every, s.status.phase
        rate = f" ({s.steps_per_second:.1f} steps/s)" if s.steps_per_second else ""
        log.info(
            "%s [%s] %s: step %s%s; checkpoint %s; %d preemption(s), %d restart(s); goodput %s",
            s.name,
            _clock(s.elapsed),
            s.status.phase,
            s.step if s.step is not None else "-",
            rate,
            checkpoint_text(s.status),
            s.status.preemptions,
            s.status.restarts,
            _goodput(s.status.goodput),
        )


class LiveView:
    """A terminal: one panel redrawn in place; log records print above it (through rich)."""

    def __init__(self, console: Console | None = None) -> None:
        self.console = console or Console(stderr=True)
        self._snapshot: Snapshot | None = None

    def update(self, snapshot: Snapshot) -> None:
        self._snapshot = snapshot

    def _render(self) -> RenderableType:
        return render_snapshot(self._snapshot) if self._snapshot is not None else Text("starting ...")

    @contextmanager
    def showing(self) -> Iterator[LiveView]:
        root = logging.getLogger()
        saved = root.handlers[:]
        handler = RichHandler(console=self.console, show_path=False, rich_tracebacks=False, markup=False)
        handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
        root.handlers = [handler]
        try:
            with Live(console=self.console, get_renderable=self._render, refresh_per_second=4, transient=True):
                yield self
        finally:
            root.handlers = saved
            if self._snapshot is not None:
                self.console.print(render_snapshot(self._snapshot))


# -- the summary ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Summary:
    """A finished (or stopped) run in numbers."""

    name: str
    phase: Phase
    reason: str
    message: str
    wall_seconds: float
    steps: int | None
    attempts: int
    preemptions: int
    notices_sent: int
    restarts: int
    max_restarts: int
    steps_lost: int
    goodput: float | None
    flushing_seconds: float
    restarting_seconds: float
    retraining_seconds: float
    commits: int
    last_checkpoint: int | None
    cloud: str = "aws"
    """The cloud the run simulated: in the JSON always, a row of the text only where it is not AWS."""

    def rows(self) -> list[tuple[str, str]]:
        named = cloud_text(self.cloud)
        cloud = [("cloud", named)] if self.cloud != "aws" else []
        return [
            *cloud,
            # A run stopped before anything happened to it (Pending) has no reason to give.
            ("outcome", f"{self.phase} ({self.reason})" if self.reason else str(self.phase)),
            ("wall time", f"{self.wall_seconds:.1f} s"),
            ("steps", "-" if self.steps is None else str(self.steps)),
            ("attempts", str(self.attempts)),
            ("preemptions", f"{self.preemptions} (notices sent: {self.notices_sent})"),
            ("restarts", f"{self.restarts} of {self.max_restarts} (failures of the user's code)"),
            ("steps lost", f"{self.steps_lost} (to preemptions and to checkpoints that did not load)"),
            ("goodput", _goodput(self.goodput)),
            ("time flushing", f"{self.flushing_seconds:.1f} s"),
            ("time restarting", f"{self.restarting_seconds:.1f} s"),
            ("time retraining", f"{self.retraining_seconds:.1f} s (lost steps, at the observed rate)"),
            ("checkpoints", f"{self.commits} committed; last: {_step_or_none(self.last_checkpoint)}"),
        ]

    def text(self) -> str:
        width = max(len(k) for k, _ in self.rows())
        lines = [f"spotjob run {self.name}: {self.phase}"]
        lines += [f"  {k:<{width}}  {v}" for k, v in self.rows()]
        if self.phase is Phase.FAILED:
            lines.append(f"  {'reason':<{width}}  {self.message}")
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        return {k: (str(v) if isinstance(v, Phase) else v) for k, v in self.__dict__.items()}


def _step_or_none(step: int | None) -> str:
    return "none" if step is None else f"step {step}"


def summarize(
    name: str,
    spec: JobSpec,
    status: JobStatus,
    events: Sequence[TimelineEvent],
    *,
    wall_seconds: float | None = None,
    committed: tuple[int, int | None] | None = None,
    cloud: str = "aws",
) -> Summary:
    """The summary of a run from its final status, its timeline and what storage holds.

    The timeline covers every driver of the run (a resumed run's too): the wall time runs from its
    first start to its last finish. Commits are counted twice over and the larger count is kept:
    the timeline's (each worker's own counter, read as it went) and ``committed``, the
    checkpoints this job wrote during the run that storage holds now (retention deleted the
    older ones), with the newest valid step there.
    """
    started = next((e.t for e in events if e.kind == EventKind.RUN_STARTED), None)
    ended = next((e.t for e in reversed(events) if e.kind == EventKind.RUN_FINISHED), None)
    if wall_seconds is None:
        wall_seconds = max(0.0, (ended or time.time()) - started) if started is not None else 0.0
    stored = status.last_checkpoint.step if status.last_checkpoint else None
    last = committed[1] if committed is not None else stored
    steps = [int(e.data["step"]) for e in events if e.kind == EventKind.STEP and "step" in e.data]
    final = status.attempt.observed_step
    if final is None and steps:
        final = steps[-1]
    return Summary(
        name=name,
        phase=status.phase,
        reason=status.reason,
        message=status.message,
        wall_seconds=wall_seconds,
        steps=final,
        # The attempt a run stopped in Rescheduling numbered, but never started, did not run.
        attempts=status.attempt.number + (1 if status.attempt.started_at is not None else 0),
        preemptions=status.preemptions,
        notices_sent=sum(1 for e in events if e.kind == EventKind.NOTICE),
        restarts=status.restarts,
        max_restarts=spec.max_restarts,
        steps_lost=status.lost_steps,
        goodput=status.goodput,
        flushing_seconds=status.flushing_seconds,
        restarting_seconds=status.restarting_seconds,
        retraining_seconds=status.retraining_seconds,
        commits=max(timeline_commits(events), committed[0] if committed else 0),
        last_checkpoint=last,
        cloud=cloud,
    )


def timeline_commits(events: Sequence[TimelineEvent]) -> int:
    """Commits the timeline saw: each commit event counts what its worker reported since the last."""
    total = 0
    for e in events:
        if e.kind == EventKind.COMMIT:
            count = e.data.get("count", 1)
            total += count if isinstance(count, int) and not isinstance(count, bool) and count > 0 else 1
    return total


# -- the plot ---------------------------------------------------------------------------------


def plot_timeline(events: Sequence[TimelineEvent], path: str, *, title: str) -> None:
    """A PNG of steps against time with notices (and their windows), commits and restarts marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not events:
        raise ValueError("the timeline is empty: nothing to plot")
    t0 = next((e.t for e in events if e.kind == EventKind.RUN_STARTED), events[0].t)
    fig, ax = plt.subplots(figsize=(11, 5.5), dpi=110)
    by_attempt: dict[int, list[tuple[float, int]]] = {}
    for e in events:
        if e.kind == EventKind.STEP:
            by_attempt.setdefault(int(e.data.get("attempt", 0)), []).append((e.t - t0, int(e.data["step"])))
    colors = plt.get_cmap("tab10")
    for attempt, points in sorted(by_attempt.items()):
        xs, ys = zip(*points, strict=True)
        ax.plot(xs, ys, color=colors(attempt % 10), lw=1.8, label=f"attempt {attempt}")
    commits = [(e.t - t0, int(e.data["step"])) for e in events if e.kind == EventKind.COMMIT]
    if commits:
        xs, ys = zip(*commits, strict=True)
        ax.scatter(xs, ys, marker="o", s=22, color="black", zorder=3, label="checkpoint committed")
    labelled: set[str] = set()

    def once(label: str) -> str | None:
        if label in labelled:
            return None
        labelled.add(label)
        return label

    for e in events:
        x = e.t - t0
        if e.kind == EventKind.NOTICE and e.data.get("maintenance"):
            # Held (training goes on) until its flush, then the window the flush has.
            deadline = float(e.data.get("deadline", e.t)) - t0
            flush_at = float(e.data.get("flush_at", e.t)) - t0
            named = f"{e.data['notice']} " if isinstance(e.data.get("notice"), str) else "host maintenance "
            ax.axvline(x, color="tab:purple", ls="--", lw=1.2, label=once(f"{named}notice (held)"))
            ax.axvspan(flush_at, deadline, color="tab:purple", alpha=0.1, label=once("its flush, until the node stops"))
        elif e.kind == EventKind.NOTICE:
            deadline = float(e.data.get("deadline", e.t)) - t0
            named = f"{e.data['notice']} " if isinstance(e.data.get("notice"), str) else "spot "
            ax.axvline(x, color="red", ls="--", lw=1.2, label=once(f"{named}notice"))
            ax.axvspan(x, deadline, color="red", alpha=0.08, label=once("notice window"))
        elif e.kind == EventKind.NODE_TERMINATED:
            early = " (acknowledged)" if e.data.get("stopped") == "acknowledged" else ""
            ax.axvline(x, color="red", ls=":", lw=1.0, label=once(f"node reclaimed{early}"))
        elif e.kind == EventKind.WORKER_STARTED and int(e.data.get("attempt", 0)) > 0:
            ax.axvline(x, color="tab:green", ls="-.", lw=1.0, label=once("restart (workers started)"))
    # The job's phase as a strip along the bottom: where the wall time went.
    end = events[-1].t - t0
    phases = [(e.t - t0, str(e.data.get("phase", ""))) for e in events if e.kind == EventKind.PHASE]
    for (x, phase), (x_next, _) in zip(phases, [*phases[1:], (end, "")], strict=True):
        color = _PHASE_COLOR.get(phase)
        if color is not None and x_next > x:
            ax.axvspan(x, x_next, ymin=0, ymax=0.03, color=color, lw=0, label=once(f"phase {phase}"))
    ax.set_xlim(left=0)
    ax.set_ylim(bottom=0)
    ax.set_xlabel("seconds since the run started")
    ax.set_ylabel("training step")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


# -- spotjob status ---------------------------------------------------------------------------


@dataclass(frozen=True)
class RunTruth:
    """A run nobody drives, as it is now (its status stopped at its driver's last write)."""

    processes: int
    """Processes of its workers still alive (a killed driver's agents flush, then stop)."""
    checkpoint: CheckpointInfo | None
    """The newest valid checkpoint in storage now."""
    storage_problem: str | None
    """Why storage could not be read, if it could not."""
    reported_step: int | None
    """The highest step its ranks last wrote in their control folders."""


@dataclass(frozen=True)
class RunRecord:
    """One run folder as ``spotjob status`` finds it."""

    name: str
    path: str
    spec: JobSpec | None
    status: JobStatus | None
    controller_alive: bool
    """A process drives the run (``spotjob run``, or ``spotjob run --resume``)."""
    error: str | None = None
    """Why the run cannot be read, or which stored part does not validate."""
    events: Sequence[RecordedEvent] = ()
    driver_pid: int | None = None
    notes: Sequence[str] = ()
    """Smaller troubles reading the folder (its events file, say)."""
    truth: RunTruth | None = None
    """Read from storage and the processes when nobody drives a run that has not ended."""
    cloud: str = "aws"
    """The cloud the run simulates (its ``cloud.json``)."""

    def with_truth(
        self,
        *,
        processes: int,
        checkpoint: CheckpointInfo | None,
        storage_problem: str | None,
        reported_step: int | None,
    ) -> RunRecord:
        return replace(self, truth=RunTruth(processes, checkpoint, storage_problem, reported_step))


def _undriven(r: RunRecord) -> bool:
    return r.status is not None and not r.status.phase.terminal and not r.controller_alive


def _gone_note(r: RunRecord) -> str:
    """What a run nobody drives is doing now, and how to carry on."""
    t = r.truth
    left = (
        "its processes are stopping (flushing)"
        if t is not None and t.processes
        else "none of its processes runs"
        if t is not None
        else "its processes were not looked at"
    )
    return f"driver gone: {left}; carry on with `{_resume_command(r)}`"


def _resume_command(r: RunRecord) -> str:
    command = f"spotjob run{runs_dir_option(os.path.dirname(r.path))} --resume {r.name}"
    workdir = run_file_workdir(r.path)
    if workdir is not None and not os.path.isdir(workdir):
        # --resume refuses it until then (its script's relative paths name things there).
        return f"create {workdir} again (its workers ran there), then {command}"
    return command


def _carry_on(r: RunRecord) -> str | None:
    """For a run whose script used up its restarts (the reconciler's ``RestartBudgetExhausted``;
    ``spotjob run`` ends with the same advice) after committing a checkpoint: how a new run carries
    on from it. A failed run is not resumed, so its checkpoints are handed over."""
    st = r.status
    if st is None or r.spec is None or not used_up_restarts(st) or st.last_checkpoint is None:
        return None
    return f"fix the script, then {hand_over_commands(r.spec.checkpoint.uri, os.path.dirname(r.path))}"


def _within(r: RunRecord, text: str) -> str:
    """``text`` with the run folder's own path left out (the listing names the run already)."""
    return text.replace(r.path + os.sep, "")


def _short(text: str, limit: int = 90) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def render_run_list(records: Sequence[RunRecord]) -> RenderableType:
    table = Table(box=None, header_style="bold")
    now = datetime.now(UTC)
    # As `kubectl spotjob status`: a HELD-FLUSH column only where a run's agents hold a notice.
    holding = {id(r): held(r.status) if r.status is not None and not _undriven(r) else [] for r in records}
    with_held = any(holding.values())
    columns = ["NAME", "PHASE", "STEP", "PREEMPTIONS", "RESTARTS", "LAST CHECKPOINT", "GOODPUT"]
    columns += ["HELD-FLUSH"] if with_held else []
    for column in (*columns, "UPDATED"):
        table.add_column(column, no_wrap=True)
    table.add_column("NOTE", overflow="fold")
    for r in records:
        st = r.status
        if st is None:
            # One unreadable folder is one line that says what is wrong; the table stays a table.
            what = Text("unreadable" if r.error else "no status yet", style="red" if r.error else "")
            blanks = [""] * (len(columns) - 1)  # the other columns and UPDATED
            table.add_row(_data(r.name), what, *blanks, _data(_short(_within(r, r.error or ""))))
            continue
        phase = Text(str(st.phase), style=_PHASE_STYLE.get(st.phase, ""))
        note = _short(_within(r, r.error)) if r.error else ""
        step = (
            st.attempt.observed_step
            if st.attempt.observed_step is not None
            else max((w.step for w in st.workers if w.step is not None), default=None)
        )
        checkpoint = checkpoint_text(st)
        if _undriven(r):
            phase.append(" (driver gone)", style="red")
            note = _gone_note(r)
            t = r.truth
            if t is not None:
                step = t.reported_step if t.reported_step is not None else step
                if t.storage_problem is not None:
                    checkpoint = "storage unreadable"
                    note += f"; {_short(t.storage_problem, 60)}"
                else:
                    checkpoint = (
                        "none yet" if t.checkpoint is None else f"step {t.checkpoint.step} ({_ago(t.checkpoint.time)})"
                    )
        updated = r.events[-1].time if r.events else st.created_at
        table.add_row(
            _data(r.name),
            phase,
            "-" if step is None else str(step),
            str(st.preemptions),
            f"{st.restarts}/{r.spec.max_restarts if r.spec else '?'}",
            checkpoint,
            _goodput(st.goodput),
            *([held_cell(holding[id(r)], now)] if with_held else []),
            _ago(updated),
            _data(note),
        )
    return table


def render_run_detail(r: RunRecord, *, failed_logs: Sequence[tuple[str, Sequence[str]]] = ()) -> RenderableType:
    parts: list[RenderableType] = []
    head = Table.grid(padding=(0, 2))
    head.add_column(style="dim", justify="right")
    head.add_column()
    head.add_row("run", f"{_mk(r.name)}  [dim]{_mk(r.path)}[/dim]")
    if r.cloud != "aws":
        head.add_row("cloud", cloud_text(r.cloud))
    if r.spec is not None:
        sp = r.spec
        head.add_row("command", _data(" ".join(sp.command)))
        head.add_row("ranks", f"{sp.replicas} node(s) x {sp.nproc_per_node} rank(s)")
        every = ", ".join(
            x
            for x in (
                f"every {sp.checkpoint.every_steps} steps" if sp.checkpoint.every_steps else "",
                f"every {sp.checkpoint.every_seconds:g} s" if sp.checkpoint.every_seconds else "",
            )
            if x
        )
        head.add_row("checkpoints", f"{_mk(sp.checkpoint.uri)}  [dim]{every or 'on notices only'}[/dim]")
        head.add_row("budget", f"maxRestarts {sp.max_restarts}, flush timeout {sp.flush_timeout_seconds:g} s")
    for note in r.notes:
        head.add_row("[yellow]note[/yellow]", _data(note, overflow="fold"))
    st = r.status
    if st is None:
        head.add_row("status", _data(r.error or "no status yet", style="red" if r.error else "", overflow="fold"))
        return head
    if r.error:
        head.add_row("[yellow]note[/yellow]", _data(r.error, overflow="fold"))
    phase = Text(str(st.phase), style=_PHASE_STYLE.get(st.phase, ""))
    undriven = _undriven(r)
    if undriven:
        phase.append("  (its spotjob run process is gone: nothing drives this run)", style="red")
    elif not st.phase.terminal and r.driver_pid:
        phase.append(f"  driven by pid {r.driver_pid}", style="dim")
    head.add_row("phase", phase)
    head.add_row("reason" if not undriven else "last decision", _data(f"{st.reason}: {st.message}", overflow="fold"))
    a = st.attempt
    if a.started_at is None:
        # Between two attempts (after an interrupt, until --resume): "resumed from scratch" read
        # as if the next attempt had thrown the checkpoint away.
        head.add_row("attempt", f"{a.number}, not started yet (it starts from the newest valid checkpoint)")
    else:
        resumed = "scratch" if a.resumed_from_step is None else f"step {a.resumed_from_step}"
        seen = "-" if a.observed_step is None else str(a.observed_step)
        head.add_row("attempt", f"{a.number}, resumed from {resumed}, step seen {seen}")
    t = r.truth
    if undriven and t is not None:
        now = "its processes are still stopping (a flush first)" if t.processes else "none of its processes runs"
        step = "" if t.reported_step is None else f"; its ranks last reported step {t.reported_step}"
        head.add_row("[red]now[/red]", f"{now} ({t.processes} alive){step}")
        if t.storage_problem is not None:
            head.add_row("checkpoint", _data(f"storage cannot be read now: {t.storage_problem}", overflow="fold"))
        elif t.checkpoint is None:
            head.add_row("checkpoint", "none in storage yet")
        else:
            head.add_row(
                "checkpoint",
                f"step {t.checkpoint.step} ({_ago(t.checkpoint.time)}), read from storage now  "
                f"[dim]{_mk(t.checkpoint.uri)}[/dim]",
            )
        head.add_row("to continue", _data(_resume_command(r)))
    else:
        where = f"  [dim]{_mk(st.last_checkpoint.uri)}[/dim]" if st.last_checkpoint else ""
        head.add_row("checkpoint", checkpoint_text(st) + where)
        carry_on = _carry_on(r)
        if carry_on:
            head.add_row("to continue", _data(carry_on, overflow="fold"))
    head.add_row(
        "counts",
        f"preemptions {st.preemptions}, restarts {st.restarts}, steps lost {st.lost_steps}",
    )
    head.add_row(
        "goodput",
        f"{_goodput(st.goodput)}  [dim]flushing {st.flushing_seconds:.1f} s, restarting {st.restarting_seconds:.1f} s,"
        f" retraining {st.retraining_seconds:.1f} s[/dim]",
    )
    for av in st.avoid:
        head.add_row("avoiding", _data(f"{av.kind} {av.value} until {_utc(av.until)} UTC ({av.reason})"))
    if not undriven:  # else the agents that held them are gone with their driver
        for notice in held(st):
            head.add_row("held notice", _data(held_text(notice, datetime.now(UTC)), overflow="fold"))
    parts.append(head)

    if st.workers:
        title = "workers (as last seen by its driver)" if undriven else "workers"
        workers = Table(title=title, title_justify="left", box=None, header_style="bold")
        for column in ("NAME", "NODE", "ZONE", "TYPE", "PHASE", "EXIT", "STEP"):
            workers.add_column(column, no_wrap=True)
        for w in st.workers:
            workers.add_row(
                _data(w.name),
                _data(w.node or "-"),
                _data(w.zone or "-"),
                _data(w.instance_type or "-"),
                str(w.phase),
                "-" if w.exit_code is None else str(w.exit_code),
                "-" if w.step is None else str(w.step),
            )
        parts += [Text(""), workers]

    for path, lines in failed_logs:
        parts += [
            Text(""),
            _data(f"the end of {path}:", style="bold"),
            Text("\n".join(f"  {_raw(line)}" for line in lines)),
        ]

    conditions = Table(title="conditions", title_justify="left", box=None, header_style="bold")
    for column in ("TYPE", "STATUS", "REASON", "SINCE (UTC)", "MESSAGE"):
        conditions.add_column(column, overflow="fold")
    for c in st.conditions:
        conditions.add_row(
            _data(c.type), str(c.status), _data(c.reason), _utc(c.last_transition_time), _data(c.message)
        )
    parts += [Text(""), conditions]

    if st.restart_history:
        history = Table(title="restarts (oldest first)", title_justify="left", box=None, header_style="bold")
        for column in ("TIME (UTC)", "ATTEMPT", "CAUSE", "REASON", "MESSAGE"):
            history.add_column(column, overflow="fold")
        for h in st.restart_history:
            history.add_row(_utc(h.time), str(h.attempt), str(h.cause), _data(h.reason), _data(h.message))
        parts += [Text(""), history]

    events = Table(title="events (oldest first)", title_justify="left", box=None, header_style="bold")
    for column in ("TIME (UTC)", "TYPE", "REASON", "COUNT", "MESSAGE"):
        events.add_column(column, overflow="fold")
    for e in r.events:
        events.add_row(
            _utc(e.time),
            Text(str(e.type), style="yellow" if e.type is EventType.WARNING else ""),
            _data(e.reason),
            str(e.count),
            _data(e.message),
        )
    parts += [Text(""), events]
    return Group(*parts)
