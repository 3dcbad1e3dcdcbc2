"""What every concern of the reconciler writes into a pass: the phase, conditions (changed only when
their value changes, as JobSet's ``ensureCondition``), queued Events, the end of a recovery."""

from __future__ import annotations

import logging
import threading
from datetime import datetime, timedelta

from orchestrator.backends.base import Backend, Placement
from orchestrator.events import EventType
from orchestrator.model import CapacityType, Condition, ConditionStatus, JobKey, JobStatus, Phase
from orchestrator.reconciler._pass import Clock, ReconcilerOptions, _Event, _Pass
from orchestrator.reconciler._reasons import Reason

log = logging.getLogger("orchestrator.reconciler")  # one logger for the package, as before it was split


class _Base:
    """The state every concern reads (set by ``Reconciler.__init__``) and the pass helpers."""

    _backend: Backend
    _options: ReconcilerOptions
    _lock: threading.Lock
    _flush_in_flight: dict[JobKey, set[str]]
    _clock: Clock
    _flush_clock: dict[JobKey, tuple[datetime, datetime, float]]
    _asker_wait: dict[JobKey, tuple[int, float]]

    def _flush_now(self, p: _Pass, detected_at: datetime) -> datetime:
        """This pass's now for the flush timeout of the recovery detected at ``detected_at``: the
        wall clock when this process first saw that recovery, moved on by the monotonic clock since.

        The timeout is a wall time in the status (a new leader takes it over), but within one process
        a step of the wall clock (NTP correcting a clock that was behind, a VM resumed) must neither
        end a flush at once nor hold it for the length of the step.
        """
        mono = self._clock.monotonic()
        with self._lock:
            known = self._flush_clock.get(p.key)
            if known is None or known[0] != detected_at:
                known = self._flush_clock[p.key] = (detected_at, p.now, mono)
        return known[1] + timedelta(seconds=mono - known[2])

    def _close_recovery(self, p: _Pass) -> None:
        """The recovery in progress ends (the attempt runs, or fails or is preempted while starting)."""
        recovery = p.status.recovery
        if recovery is None:
            return
        if recovery.stopped_at is not None and p.status.start_time is not None:
            p.status.restarting_seconds += (p.now - recovery.stopped_at).total_seconds()
        p.status.recovery = None

    def _placement(self, status: JobStatus, cooldown_seconds: float) -> Placement:
        def values(kind: str) -> frozenset[str]:
            return frozenset(a.value for a in status.avoid if a.kind == kind)

        # When each node's cool-down began: its end less the spec's length (an end clamped to a
        # shorter cool-down only makes that later, never earlier than the preemption).
        since = tuple(
            (a.value, a.until - timedelta(seconds=cooldown_seconds)) for a in status.avoid if a.kind == "node"
        )
        fallback = status.capacity is CapacityType.FALLBACK  # as _effective_spec builds the spec
        return Placement(values("node"), values("zone"), values("instanceType"), since, fallback)

    def _set_phase(self, p: _Pass, phase: Phase, reason: str, message: str) -> None:
        if phase is not p.status.phase:
            log.info("job %s [%s] -> %s (%s): %s", p.key, p.status.phase, phase, reason, message)
        p.status.phase, p.status.reason, p.status.message = phase, reason, message

    def _condition(self, p: _Pass, type_: str, value: bool, reason: str, message: str) -> None:
        text: ConditionStatus = "True" if value else "False"
        existing = p.status.condition(type_)
        if existing is None:
            p.status.conditions.append(
                Condition(type=type_, status=text, reason=reason, message=message, last_transition_time=p.now)
            )
            return
        if existing.status != text:
            existing.status, existing.last_transition_time = text, p.now
        existing.reason, existing.message = reason, message

    def _event(
        self, p: _Pass, why: Reason, *, message: str | None = None, node: str | None = None, **fields: object
    ) -> None:
        """Queue an Event of this pass; ``_commit`` emits it once the status is written."""
        text = message if message is not None else why.message(**fields)
        kind = EventType.WARNING if why.warning else EventType.NORMAL
        p.events.append(_Event(kind, why.name, text, node))

    def _debug(self, p: _Pass, message: str, *args: object) -> None:
        log.debug("job %s [%s]: " + message, p.key, p.status.phase, *args)
