"""When the simulated cloud preempts: every N seconds of training (jittered), at chosen steps, or at
the times of a trace file (``load_trace``); and when it announces a host maintenance (at chosen
steps)."""

from __future__ import annotations

import bisect
import json
import math
import random
import re
from dataclasses import dataclass, field


@dataclass
class PreemptionPlan:
    """When the simulated cloud sends notices: every N seconds of training (jittered), at steps, at
    trace times.

    Example: ``every=60, jitter=0.25`` sends one after 45-75 s of training, the next 45-75 s of
    training after that one was due, and so on (seeded, so a rerun sees the same gaps). Its clock
    runs only while an attempt that a notice could hit trains (``due``'s ``training``): it stands
    still from a notice until the next attempt reports its first training step, so the attempt after
    a notice trains a gap before the next one however long restarts take, and gaps that fell due at one look
    (after a pause, a stall of the driver) are one notice, not a queue that would hit attempt after
    attempt as it starts. ``at_steps=[100, 200]`` sends one when a live worker first reports step
    100 or more, and one at 200. ``trace=[30.0, 95.5]`` sends them that many seconds after the
    start, training or not. A notice due while no worker runs waits for the next one to start
    (``LocalBackend`` keeps it pending), so every notice lands.

    ``maintenance_at_steps=[150]`` announces a host maintenance (a notice far ahead, which the
    node's agent holds) when a live worker first reports step 150 or more (``maintenance_due``).
    """

    every: float | None = None
    jitter: float = 0.25
    at_steps: list[int] = field(default_factory=list)
    trace: list[float] = field(default_factory=list)
    seed: int | None = None
    maintenance_at_steps: list[int] = field(default_factory=list)
    _rng: random.Random = field(init=False, repr=False)
    _next_every: float | None = field(init=False, default=None)
    """When the next ``every`` notice is due, in seconds of training (``_trained``)."""
    _trained: float = field(init=False, default=0.0)
    """Seconds during which an attempt trained, as ``due`` was told: the ``every`` notices' clock."""
    _looked: tuple[float, bool] | None = field(init=False, default=None)
    """The previous ``due`` call's ``elapsed`` and ``training``."""

    def __post_init__(self) -> None:
        if self.every is not None and self.every <= 0:
            raise ValueError(f"--preempt-every must be positive, got {self.every}")
        if not 0 <= self.jitter < 1:
            raise ValueError(f"the jitter must be in [0, 1), got {self.jitter}")
        self._rng = random.Random(self.seed)
        self.at_steps = sorted(self.at_steps)
        self.trace = sorted(self.trace)
        self.maintenance_at_steps = sorted(self.maintenance_at_steps)
        if self.every is not None:
            self._next_every = self._gap()

    @property
    def empty(self) -> bool:
        return self.every is None and not self.at_steps and not self.trace and not self.maintenance_at_steps

    def _gap(self) -> float:
        assert self.every is not None
        return self.every * self._rng.uniform(1 - self.jitter, 1 + self.jitter)

    def due(self, elapsed: float, step: int | None, training: bool = True) -> list[str]:
        """The notices due at ``elapsed`` seconds since the start with ``step`` observed; each once.

        ``training``: whether an attempt that a notice could hit trains now. The time since the
        previous call counts towards ``every`` if that call said so, and an ``every`` notice is due
        only at a call that says so; several due at once are one."""
        if self._looked is not None and self._looked[1]:
            self._trained += max(0.0, elapsed - self._looked[0])
        self._looked = (elapsed, training)
        out: list[str] = []
        while self.trace and self.trace[0] <= elapsed:
            out.append(f"trace time {self.trace.pop(0):g} s")
        if training and self._next_every is not None and self._next_every <= self._trained:
            due_at, skipped = self._next_every, 0
            self._next_every += self._gap()
            while self._next_every <= self._trained:
                skipped += 1
                self._next_every += self._gap()
            also = f"; {skipped} more due meanwhile, in this one" if skipped else ""
            out.append(f"every {self.every:g} s (due at {due_at:.1f} s of training{also})")
        while step is not None and self.at_steps and self.at_steps[0] <= step:
            out.append(f"step {self.at_steps.pop(0)} reached (at {step})")
        return out

    def maintenance_due(self, step: int | None) -> list[str]:
        """The host maintenances due with ``step`` observed; each once."""
        out: list[str] = []
        while step is not None and self.maintenance_at_steps and self.maintenance_at_steps[0] <= step:
            out.append(f"step {self.maintenance_at_steps.pop(0)} reached (at {step})")
        return out

    def random(self) -> random.Random:
        """The plan's seeded generator (which node a notice hits)."""
        return self._rng


def load_trace(path: str) -> list[float]:
    """Notice times in seconds since the start: a JSON list, or one number per line (``#`` comments).

    Every time must be a finite number of seconds >= 0. ``ValueError`` names the file and the line
    of the first one that is not (``trace.txt:3: 'abc' is not a number of seconds``), or says why
    the file cannot be read.
    """
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_TRACE_BYTES + 1)
    except OSError as e:
        raise ValueError(f"{path}: cannot read it: {e.strerror or e}") from None
    if len(raw) > MAX_TRACE_BYTES:
        raise ValueError(f"{path}: larger than {MAX_TRACE_BYTES // 1024} KiB; a trace is a list of notice times")
    try:
        text = raw.decode("utf-8-sig")  # an editor's byte order mark is not part of the first time
    except UnicodeDecodeError:
        raise ValueError(f"{path}: not a text file (expected seconds, one a line, or a JSON list)") from None
    if text.lstrip().startswith("["):
        return [_trace_time(path, line, value, shown) for line, value, shown in _json_list(path, text)]
    out = []
    for number, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if line:
            out.append(_trace_time(path, number, line))
    return out


MAX_TRACE_BYTES = 1024 * 1024


def _trace_time(path: str, line: int, value: object, shown: str | None = None) -> float:
    shown = shown if shown is not None else str(value)
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise ValueError(f"{path}:{line}: {shown} is not a number of seconds")
    try:
        seconds = float(value)
    except ValueError:
        raise ValueError(f"{path}:{line}: {shown!r} is not a number of seconds") from None
    if value is not shown and isinstance(value, str):
        raise ValueError(f"{path}:{line}: {shown} is not a number of seconds")
    if not math.isfinite(seconds):
        raise ValueError(f"{path}:{line}: {shown} is not a finite number of seconds")
    if seconds < 0:
        raise ValueError(f"{path}:{line}: {shown} is before the start; times are seconds >= 0")
    return seconds


def _json_list(path: str, text: str) -> list[tuple[int, object, str]]:
    """The items of the JSON list ``text``, each with the line it starts on and its text."""
    decoder = json.JSONDecoder(parse_constant=lambda name: name)  # NaN, Infinity: refused by _trace_time

    # The newlines' offsets, searched by bisection: counting the newlines before every item made a
    # list near the size limit (half a million items) take many minutes to read.
    newlines = [m.start() for m in re.finditer("\n", text)]

    def line_of(index: int) -> int:
        return bisect.bisect_left(newlines, index) + 1

    def fail(index: int, what: str) -> ValueError:
        return ValueError(f"{path}:{line_of(index)}: {what} (a trace is a JSON list of seconds, or one a line)")

    i = text.index("[") + 1
    items: list[tuple[int, object, str]] = []
    while True:
        while i < len(text) and text[i].isspace():
            i += 1
        if i >= len(text):
            raise fail(i, "the list is not closed with ']'")
        if text[i] == "]" and not items:
            i += 1
            break
        try:
            value, end = decoder.raw_decode(text, i)
        except json.JSONDecodeError as e:
            raise fail(e.pos, f"not JSON: {e.msg}") from None
        except RecursionError:
            raise fail(i, "lists nested too deeply; each item is a number of seconds") from None
        items.append((line_of(i), value, text[i:end]))
        i = end
        while i < len(text) and text[i].isspace():
            i += 1
        if i >= len(text):
            raise fail(i, "the list is not closed with ']'")
        if text[i] == ",":
            i += 1
        elif text[i] == "]":
            i += 1
            break
        else:
            raise fail(i, "expected ',' or ']' after an item")
    if text[i:].strip():
        raise fail(i + len(text[i:]) - len(text[i:].lstrip()), "text after the list")
    return items
