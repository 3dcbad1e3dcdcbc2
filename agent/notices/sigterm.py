"""SIGTERM (and SIGINT, SIGHUP, SIGUSR1, SIGUSR2) to the agent as a notice with a grace-period deadline.

The kubelet, systemd and most schedulers stop a process with SIGTERM and kill it a grace period
later; a spot node drained by a termination handler does the same. Batch schedulers warn of the
end of an allocation with SIGUSR1 or SIGUSR2 (SLURM's ``--signal=[B:]USR1@120``): Python leaves
both at their default, which would end the agent alone. The agent must not die on it:
the ranks are in sessions of their own and would be orphaned mid-step. So the signal becomes a
notice, ``deadline = arrival + grace_seconds``, and the flush decides what happens next.

Python runs signal handlers on the main thread between bytecodes, so ``start`` must be called
from the main thread and the handler does nothing but put the signal on a ``SimpleQueue`` (safe
to call re-entrantly from a handler); the source's own thread turns it into a notice. Every
signal is delivered (the agent's flush is idempotent and logs a repeat); one whose delivery
failed (the callback raised) is delivered again every ``retry_seconds`` until it succeeds or the
source stops. ``stop`` restores the previous handlers.

A hangup or a quit the agent was started ignoring (``nohup spotjob-agent ...``, or a non-interactive
shell's ``spotjob-agent ... &``, which ignores SIGQUIT for its background jobs) stays ignored:
whoever started it asked for the job to outlive the terminal. SIGTERM and SIGINT are always heard.
"""

from __future__ import annotations

import logging
import queue
import signal
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

from agent.notices.base import Notice, NoticeCallback, NoticeKind, NoticeSource, deliver_notice

log = logging.getLogger(__name__)

DEFAULT_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)
KEPT_IGNORED = (signal.SIGHUP, signal.SIGQUIT)
"""Signals that stay ignored when the agent's process started with them ignored (nohup, a shell's
background job). Never SIGTERM, how the kubelet and schedulers ask for a flush."""


def ignored_by_starter(sig: signal.Signals) -> bool:
    """Whether ``sig`` is one of ``KEPT_IGNORED`` and ignored now (as inherited: nothing in the
    agent ignores a signal itself), so no handler should be installed for it."""
    return sig in KEPT_IGNORED and signal.getsignal(sig) == signal.SIG_IGN


_STOP = -1

_Handler = Callable[[int, FrameType | None], Any] | int | signal.Handlers | None


class SignalSource(NoticeSource):
    """Termination signals to this process, each a ``terminate`` notice."""

    name = "signal"

    def __init__(
        self,
        grace_seconds: float = 30.0,
        signals: tuple[signal.Signals, ...] = DEFAULT_SIGNALS,
        *,
        retry_seconds: float = 1.0,
    ) -> None:
        self.grace_seconds = grace_seconds
        self.signals = signals
        self.retry_seconds = retry_seconds
        self._queue: queue.SimpleQueue[tuple[int, float]] = queue.SimpleQueue()
        self._previous: dict[signal.Signals, _Handler] = {}
        self._thread: threading.Thread | None = None
        self._callback: NoticeCallback | None = None

    def start(self, callback: NoticeCallback) -> None:
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("SignalSource.start must be called from the main thread")
        self._callback = callback
        self._thread = threading.Thread(target=self._run, name="spotjob-notice-signal", daemon=True)
        self._thread.start()
        kept = [sig for sig in self.signals if ignored_by_starter(sig)]
        for sig in self.signals:
            if sig not in kept:
                self._previous[sig] = signal.signal(sig, self._handle)
        log.info("listening for %s (grace %g s)", ", ".join(s.name for s in self._previous), self.grace_seconds)
        if kept:
            log.info(
                "%s: ignored when the agent started (nohup, a background job), so left ignored",
                ", ".join(s.name for s in kept),
            )

    def stop(self) -> None:
        if threading.current_thread() is threading.main_thread():
            for sig, previous in self._previous.items():
                signal.signal(sig, previous)
            self._previous.clear()
        if self._thread is not None:
            self._queue.put((_STOP, 0.0))
            self._thread.join(timeout=5.0)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self._queue.put((signum, time.time()))

    def _run(self) -> None:
        pending: Notice | None = None
        while True:
            try:
                signum, arrived = self._queue.get(timeout=self.retry_seconds if pending is not None else None)
            except queue.Empty:
                signum, arrived = 0, 0.0  # time to retry the pending one
            if signum == _STOP:
                return
            if signum:
                name = signal.Signals(signum).name
                pending = Notice(
                    source=self.name,
                    kind=NoticeKind.TERMINATE,
                    deadline=arrived + self.grace_seconds,
                    detail=f"{name} received (grace {self.grace_seconds:g} s)",
                    received_at=arrived,
                )
            if pending is not None and deliver_notice(self.name, self._callback, pending):
                pending = None
