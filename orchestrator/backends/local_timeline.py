"""The local run's timeline: what happened when (notices, steps, commits, workers, nodes), one
JSON line an event, read back by ``spotjob status``, the live view and the goodput benchmark."""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Any

from agent.atomic_file import append_line

log = logging.getLogger(__name__)


class EventKind:
    """What the timeline records (``Timeline``); plain strings in the JSON lines."""

    RUN_STARTED = "run-started"
    WORKER_STARTED = "worker-started"
    STEP = "step"
    COMMIT = "commit"
    NOTICE = "notice"
    NODE_TERMINATED = "node-terminated"
    WORKER_EXITED = "worker-exited"
    PHASE = "phase"
    RUN_FINISHED = "run-finished"


@dataclass(frozen=True)
class TimelineEvent:
    t: float
    """Unix time."""
    kind: str
    data: dict[str, Any]


class Timeline:
    """An append-only JSON-lines record of what happened in the local world, for the plot and summary.

    One line per event: ``{"t": <unix time>, "kind": "...", ...}``. Written from several threads;
    each line is appended whole under a lock, after ending a line a full disk or a kill cut short
    (``append_line``). Readers skip a torn line.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._failing = False

    def record(self, kind: str, **data: Any) -> None:
        """Append one event. A write that fails (a full disk under the run folder) loses that line
        only: it is warned once, until a write succeeds again, and never ends the run whose record
        it is (it was raised into the thread that watched the workers)."""
        line = json.dumps({"t": round(time.time(), 3), "kind": kind, **data}, default=str)
        with self._lock:
            try:
                append_line(self.path, line)
            except OSError as e:
                if not self._failing:
                    log.warning(
                        "could not record %s in the run's timeline %s: %s (the plot will miss it)", kind, self.path, e
                    )
                self._failing = True
                return
            if self._failing:
                log.warning("the run's timeline %s is written again", self.path)
            self._failing = False

    @staticmethod
    def read(path: str) -> list[TimelineEvent]:
        try:
            with open(path) as f:
                lines = f.read().splitlines()
        except FileNotFoundError:
            return []
        return _parse(lines)


class TimelineTail:
    """The events appended to a timeline since the last look: ``read_new`` parses only the whole
    lines written since, so a look every second costs the same on a run's first day and on its
    tenth (the whole file is ~2 lines a second per worker while it trains)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._offset = 0

    def read_new(self) -> tuple[list[TimelineEvent], bool]:
        """(the events appended since the last call, whether they start from the file's beginning:
        the first call, or a file that got shorter, i.e. was replaced)."""
        start = self._offset == 0
        try:
            with open(self.path, "rb") as f:
                if os.fstat(f.fileno()).st_size < self._offset:
                    self._offset, start = 0, True
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            self._offset = 0
            return [], True
        whole = data.rfind(b"\n") + 1  # a line still being written is read once it is whole
        self._offset += whole
        return _parse(data[:whole].decode(errors="replace").splitlines()), start


def _parse(lines: list[str]) -> list[TimelineEvent]:
    """The events of timeline lines; a torn or foreign line is skipped."""
    events: list[TimelineEvent] = []
    for line in lines:
        try:
            raw = json.loads(line)
            events.append(TimelineEvent(float(raw.pop("t")), str(raw.pop("kind")), raw))
        except (ValueError, KeyError, TypeError):
            continue
    return events
