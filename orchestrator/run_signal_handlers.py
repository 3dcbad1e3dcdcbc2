"""The handlers ``spotjob run`` puts on its signals while it runs (``orchestrator.cli_run``'s
``run_command`` installs them, and puts the previous ones back after): ``_Interrupts`` for Ctrl-C
and SIGTERM (the first ends what runs, a second cuts the interrupt's flush short, the rest are only
logged), ``_pause`` for Ctrl-Z. What an interrupt then does to the run is ``LocalRun``'s
(``orchestrator.run_driver``) and ``orchestrator.run_interrupt``'s.
"""

from __future__ import annotations

import logging
import os
import signal
from types import FrameType

from orchestrator.run_driver import LocalRun
from orchestrator.run_interrupt import InterruptState

log = logging.getLogger("orchestrator.cli_run")  # spotjob run's one logger, as before it was split


class _Interrupts:
    """Ctrl-C and SIGTERM while ``spotjob run`` runs. The first one ends what runs
    (``KeyboardInterrupt``): the controller loop, after which ``LocalRun.run`` has every training
    worker's agent flush before it stops every process of the run; or, before the run is driven,
    ``--resume``'s wait for the previous driver's processes. A second one while that flush runs
    stops the run at once, without it. Once the run is stopping its processes, none interrupts
    that: a third Ctrl-C (or a supervisor's repeated SIGTERM) used to cut ``LocalBackend.close``
    short and leave the run's processes running after the driver said it had stopped them.

    While a new run is being made, and until ``LocalRun.run`` has recorded a run's start, a first
    one is kept in the run's ``InterruptState`` (``starting``), not raised where it lands: raised
    between the making of a new run and its driving, it left the run's name taken while ``spotjob
    run`` said that nothing of it ran. ``spotjob run`` then removes a new run it made (a resumed
    one is left as it was), or ``LocalRun.run`` raises it once the timeline says the run started.

    Once a run was made, SIGTERM and SIGINT are ignored until the process exits, however it ended:
    put back to what they were (the default, for the command), a supervisor's SIGTERM repeated in
    the moment between an interrupted run's stop and the exit ended the driver by the signal (143
    to a shell) instead of its exit 130, and a Ctrl-C then after a finished run printed a
    ``KeyboardInterrupt`` traceback (or made its exit 130). Ignored, not a handler of ours: the
    interpreter's shutdown puts Python handlers back to the default before the process ends, but
    keeps an ignored signal ignored."""

    def __init__(self, run: LocalRun | None = None) -> None:
        self.run = run
        """The run, once ``prepare`` made it (before: ``--resume``'s wait, say)."""
        self.received = 0
        self.early = InterruptState()
        """Before the run is made (``spotjob run`` keeps a first one here while it makes a new run)."""

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        self.received += 1
        name = signal.Signals(signum).name
        run = self.run
        state = run.interrupt if run is not None else self.early
        stopping = run is not None and run.stopping
        if state.signal is None and not stopping:
            state.signal = name
            if state.pausing:
                return  # raised by _pause once the workers go on
            if state.starting:  # the run is being made: given up once it is, or raised once its start is recorded
                return
            raise KeyboardInterrupt(f"signal {signum}")
        if run is not None and state.signal is not None and state.again is None and not stopping:
            state.again = name
            log.warning("received %s again: stopping every process of %s at once, without the flush", name, run.name)
            if state.flushing and not state.pausing:
                raise KeyboardInterrupt(f"signal {signum} again")
            return
        if run is None and state.starting:  # a new run is being made: the first one gives it up once it is
            log.warning(
                "received %s again: the run being made is given up as soon as it is, as the first one asked", name
            )
        elif run is None:  # the first one ended what ran before the run was driven: nothing is being stopped
            log.warning("received %s again: spotjob run is leaving already, as the first one made it", name)
        elif state.signal is None:  # the run ended by itself (Succeeded, Failed): this is no second one
            log.warning(
                "received %s as %s ends by itself (%s): it exits as the run ended, once every process of it is "
                "stopped (SIGKILL this process to leave any running)",
                name,
                run.name,
                run.status.phase,
            )
        else:
            log.warning(
                "received %s again: still stopping every process of %s (SIGKILL this process to leave them running)",
                name,
                run.name,
            )


def _pause(run: LocalRun) -> None:
    """Ctrl-Z (SIGTSTP, which reaches the driver alone: its workers run in sessions of their own):
    each worker's agent pauses its processes and itself, then the driver stops; ``fg`` or ``bg``
    (SIGCONT) resumes the driver, which resumes them. Left to the default, the driver alone
    stopped and its workers trained on with nobody driving the run.

    A SIGTERM or SIGINT that comes while the run is paused (a supervisor's, or bash's ``kill`` of a
    stopped job, which sends SIGCONT after it) is handled as soon as the driver goes on: its
    ``KeyboardInterrupt`` is raised here once the workers are continued, not where the signal's
    handler lands. Such a signal reaches whichever thread of the driver runs first, so its handler
    could run in the main thread after the stop had returned, inside ``continue_workers`` before a
    SIGCONT was sent: the agents stayed stopped, could not answer the interrupt's flush (its ``POST
    /flush`` timed out), and every step since the newest commit was lost. One that comes while the
    workers are being paused is raised here too, and the driver does not stop. So is a second one
    during the interrupt's flush (which it cuts short)."""
    state = run.interrupt
    before = (state.signal, state.again)
    state.pausing = True
    try:
        paused = run.backend.signal_workers(signal.SIGTSTP, until_stopped=5.0)
        if (state.signal, state.again) == before:
            log.info("Ctrl-Z: pausing %s (%d worker(s) and this driver); fg or SIGCONT resumes it", run.name, paused)
            os.kill(os.getpid(), signal.SIGSTOP)  # returns once continued
    finally:
        try:
            run.backend.continue_workers()
        finally:
            state.pausing = False
    if before[0] is None and state.signal is not None:
        raise KeyboardInterrupt(f"{state.signal} while {run.name} was paused")
    if before[1] is None and state.again is not None and state.flushing:
        raise KeyboardInterrupt(f"{state.again} again while {run.name} was paused")
    log.info("resumed %s", run.name)
