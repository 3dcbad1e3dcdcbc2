"""How ``spotjob run`` ends: its exit status, and what it says on stderr of a run that did not
simply succeed. Interrupted: every process was stopped, how the interrupt's flush went, and the
``--resume`` command that carries on (130). Interrupted as the training finished: a finished run
(0). Failed: the reason (``failure_line``), the end of the failed workers' logs, and, when the
script used up its restarts, where the newest checkpoint is and how a new run carries on from it
(``carry_on_line``) (1); first, when an interrupt came as the script failed (during its flush), a
line saying so (``at_failure_line``).

``orchestrator.cli_run`` prints the summary, then hands over to ``_tell_outcome``.
"""

from __future__ import annotations

import sys

from orchestrator.backends.local_failure import log_excerpt
from orchestrator.live import Summary
from orchestrator.model import JobStatus, Phase
from orchestrator.reconciler import INVALID
from orchestrator.run_driver import LocalRun
from orchestrator.run_folder import LOG_EXCERPT_LINES, RUNS_DIR, hand_over_commands, used_up_restarts
from orchestrator.run_interrupt import at_failure_line

EXIT_SUCCEEDED = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


def failure_line(name: str, status: JobStatus) -> str:
    """What ``spotjob run`` says of a run that did not succeed: its phase's reason, or, for a job that
    stopped because its spec is invalid (its phase still the one it had), the Invalid condition's
    message (it said "failed: Created: waiting for the first pass")."""
    invalid = status.condition(INVALID)
    if invalid is not None and invalid.status == "True":
        return f"spotjob run: {name} did not start: {invalid.reason}: {invalid.message}"
    return f"spotjob run: {name} failed: {status.reason}: {status.message}"


def carry_on_line(name: str, uri: str, status: JobStatus, newest: int | None, runs_dir: str = RUNS_DIR) -> str | None:
    """After a run whose script used up its restarts, with a checkpoint in storage: where it is and
    how a new run carries on from it once the script is fixed (a failed run is not resumed, and a
    new run is refused a URI another job owns until it is handed over)."""
    if not used_up_restarts(status) or newest is None:
        return None
    return (
        f"spotjob run: the newest checkpoint of {name}, step {newest}, stays in {uri}. To carry on from it once "
        f"the script is fixed, hand it to a new run and start that with the same script and options: "
        f"{hand_over_commands(uri, runs_dir)}"
    )


def _tell_outcome(run: LocalRun, status: JobStatus, summary: Summary, interrupted: bool, runs_dir: str) -> int:
    """On stderr: how the run ended, when it did not succeed; the exit status."""
    if interrupted:
        resume = f"`spotjob run{runs_dir} --resume {run.name}`"
        outcome = run.interrupt_outcome
        said = (
            f"interrupted; every process of {run.name} was stopped (carry on with {resume})"
            if outcome is None
            else outcome.line(run.name, resume)
        )
        print(f"spotjob run: {said}", file=sys.stderr)
        return EXIT_INTERRUPTED
    if status.phase is Phase.SUCCEEDED:
        if run.interrupt.signal is not None:
            # The training finished during the interrupt's flush: a finished run, which says so.
            print(
                f"spotjob run: the interrupt ({run.interrupt.signal}) came as {run.name} finished: every worker "
                "exited 0, so the run is complete and nothing is left to resume",
                file=sys.stderr,
            )
        return EXIT_SUCCEEDED
    outcome = run.interrupt_outcome
    if outcome is not None:
        # The script failed by itself during the interrupt's flush, with no restart left: say that
        # the interrupt came, and that nothing is resumed (the hand-over, if any, follows).
        print(f"spotjob run: {at_failure_line(outcome, run.name, run.interrupt.failed)}", file=sys.stderr)
    print(failure_line(run.name, status), file=sys.stderr)
    for path in run.failed_worker_logs():
        print(f"the end of {path}:", file=sys.stderr)
        for line in log_excerpt(path, LOG_EXCERPT_LINES):
            print(f"  {line[:300]}", file=sys.stderr)
    carry_on = carry_on_line(run.name, run.spec.checkpoint.uri, status, summary.last_checkpoint, run.config.runs_dir)
    if carry_on is not None:
        print(carry_on, file=sys.stderr)
    return EXIT_FAILED
