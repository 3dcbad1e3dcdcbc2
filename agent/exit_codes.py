"""The agent's exit code: what the command's end, the flush and the ranks' reports add up to.

Exit code: 75 (EXIT_PREEMPTED) if a flush committed; else 79 (EXIT_STOPPED) after ``POST /stop``;
else 74 (EXIT_INFRA_ERROR) if a rank reported an infrastructure error and the command failed (not
an abort at interpreter exit after every rank wrote ``closed-rank-<r>``: the job finished); else
76 if the flush failed; else 0 if the command succeeded or every rank wrote ``closed-rank-<r>``
and the command ended by itself (not killed by the agent);
else 76 (EXIT_FLUSH_FAILED) if a flush was asked for; else the command's own code — 1 if that is
one of 74/75/76/79, which mean what the agent saw (``agent.launcher`` adds the rendezvous case)."""

from __future__ import annotations

import json
import signal

from agent.control_channel import EXIT_FLUSH_FAILED, EXIT_INFRA_ERROR, EXIT_PREEMPTED, EXIT_STOPPED, FlushResult

EXIT_USAGE = 2
"""Bad options or settings, found before the command starts (argparse's own code for a usage error)."""


COMMAND_ENDED_DURING_FLUSH = "the command ended before its ranks reported one"
"""How an agent's 76 says that its command ended by itself, failing, while a flush was asked and
before its ranks committed one: the user's code failed during the flush, nothing stopped it
(``spotjob run`` tells such a failure during an interrupt's flush from one the flush met)."""


FLUSH_ANSWERED = "; the flush answered "
"""How an agent's exit-75 words go on after ``the flush committed step N at URI``: what the flush
answered, as the agent's flush request says it (``<source> <kind>: <detail>``: ``api preemption:
<the POST /flush reason>``, ``signal terminate: SIGTERM ...``, ``gcp maintenance: ...``), or
``PEER_FLUSH``. ``spotjob run`` tells its interrupt's own flush from one the agent began for a notice
of its own by it (``flush_answered``)."""
PEER_FLUSH = "no notice of this agent's: another node's agent asked for it"
"""What the flush of an agent that heard no notice itself answered: its ranks committed a flush
another node's agent asked for (every rank of the job flushes at the same step)."""


def flush_answered(words: str) -> str | None:
    """What an agent's exit-75 words (``exit_words``) say its flush answered (after
    ``FLUSH_ANSWERED``); None when they do not say (an agent older than these words)."""
    at = words.find(FLUSH_ANSWERED)
    return words[at + len(FLUSH_ANSWERED) :] if at >= 0 else None


def answered_source(answered: str) -> str | None:
    """The source of the notice a flush answered (``api``, ``signal``, ``gcp``, ``aws``,
    ``azure``, ``driver``; ``flush_answered``'s words), or None for ``PEER_FLUSH``."""
    if answered == PEER_FLUSH:
        return None
    source, _, _ = answered.partition(" ")
    return source or None


def exit_words(line: str, code: int) -> str | None:
    """What one of spotjob-agent's log lines (text or ``--log-format json``) says from ``exiting
    <code>:`` on, the agent's reason for that exit, with unprintable characters as ``?``; None
    when the line is no such exit line. The controller and ``spotjob run`` quote it."""
    marker = f"exiting {code}: "
    if marker not in line:
        return None
    if line.lstrip().startswith("{"):
        try:
            line = str(json.loads(line).get("message") or "")
        except (ValueError, AttributeError):
            return None
        if marker not in line:
            return None
    return "".join(c if c.isprintable() else "?" for c in line[line.index(marker) :].strip())


def command_exit_code(returncode: int) -> int:
    """Popen's returncode as a shell reports it (killed by signal N → 128 + N)."""
    return 128 - returncode if returncode < 0 else returncode


KILLED_BY_SIGKILL = 128 + 9
OOM_HINT = (
    "SIGKILL is what the kernel's OOM killer sends when the container or node runs out of memory "
    "(dmesg, kubectl describe pod); an async save holds a second host copy of the state while it "
    "stages, so the memory limit must allow it (README 'Staging memory': release_staging=True, "
    "async_save=False)"
)
"""Said with an exit 137: nothing else tells a rank the OOM killer took from one killed by hand."""


KILLED_BY = "was killed by"
"""How ``describe_exit`` says a signal ended a process: what the failure readers look for
(``orchestrator.backends.local_failure``, ``orchestrator.backends.k8s``)."""


def signal_name(number: int) -> str:
    """``SIGKILL`` for 9; ``signal 99`` for a number no signal has."""
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def describe_exit(returncode: int) -> str:
    """A process's end in words: ``exited 3``, or ``was killed by SIGKILL (exit 137: ...)``."""
    if returncode >= 0:
        return f"exited {returncode}"
    hint = f": {OOM_HINT}" if -returncode == signal.SIGKILL else ""
    return f"{KILLED_BY} {signal_name(-returncode)} (exit {command_exit_code(returncode)}{hint})"


RESERVED_EXIT_CODES = frozenset({EXIT_INFRA_ERROR, EXIT_PREEMPTED, EXIT_FLUSH_FAILED, EXIT_STOPPED})
"""Codes only the agent reports, for what it saw itself; a command's own use of one is remapped."""
EXIT_COMMAND_USED_RESERVED = 1
"""What the agent reports for a command that exited 74/75/76/79 by itself: a plain failure."""


def decide_exit_code(
    returncode: int,
    *,
    flush_requested: bool,
    result: FlushResult | None,
    closed_ranks: set[int],
    expected_ranks: int | None,
    killed: bool,
    stopped: str | None = None,
    infra_error: str | None = None,
    sigkilled_by_agent: float | None = None,
    answered: str | None = None,
) -> tuple[int, str]:
    """The agent's exit code for a command that ended with ``returncode``, and why.

    ``killed``: the agent stopped the command while more than torchrun was left of it (torchrun
    alone, waiting in its exit barrier after its ranks exited, is not the job's work); ``stopped``:
    why ``POST /stop`` stopped the command; ``infra_error``: the infrastructure
    error a rank reported (or the agent found), if any; ``sigkilled_by_agent``: the agent's
    ``--kill-grace`` when it had to SIGKILL the command's processes itself, else None. 75, 76, 74
    and 79 are reported only for what this agent saw: a command that exits with one of them by
    itself gets 1. ``answered``: what the flush answered (``FLUSH_ANSWERED``), said after a
    committed flush.
    """
    code = command_exit_code(returncode)
    if result is not None and result.error is None:
        said = f"{FLUSH_ANSWERED}{answered}" if answered else ""
        return EXIT_PREEMPTED, f"the flush committed step {result.step} at {result.uri}{said}"
    if stopped is not None:
        return EXIT_STOPPED, f"stopped on request without a flush: {stopped} (command exit code {code})"
    every_rank_closed = bool(expected_ranks) and len(closed_ranks) >= (expected_ranks or 0)
    if infra_error is not None and (code != 0 or killed) and not (every_rank_closed and not killed):
        # Only when the command failed: a script that caught a failed save and finished its work
        # did finish, whatever the store did meanwhile; so did one whose every rank closed and a
        # worker then aborted at interpreter exit (forgiven below), which 74 would run again.
        return EXIT_INFRA_ERROR, f"infrastructure error: {infra_error} (command exit code {code})"
    if result is not None:
        # Before the closed-rank check: a script that calls close() in a `finally` marks its
        # ranks closed after a failed flush too, and that job did not finish.
        return EXIT_FLUSH_FAILED, f"the flush failed: {result.error} (command exit code {code})"
    if every_rank_closed and not killed:
        # The known abort at interpreter exit ("terminate called without an active exception")
        # after every rank finished its work: the job is done, whatever torchrun says. Not when
        # the agent stopped the command itself: the script was still at work after close().
        return 0, f"every rank closed ({len(closed_ranks)}/{expected_ranks}); the command exited {code}"
    if every_rank_closed and flush_requested:
        return EXIT_FLUSH_FAILED, (
            f"no checkpoint was committed: the flush was asked for after every rank closed its Checkpointer "
            f"({len(closed_ranks)}/{expected_ranks}), so no rank could serve it, and the command, still at work "
            f"after close() (an export, an eval), was stopped before it finished (command exit code {code}); the "
            f"restart resumes from the newest checkpoint and runs what follows close() again"
        )
    if code == 0 and not killed:
        return 0, "the command finished"
    if flush_requested:
        # "No checkpoint was committed" alone read as "none at all": the job's earlier checkpoints
        # are there, and the restart resumes from the newest of them.
        how = (
            "spotjob-agent stopped the command before its ranks reported one"
            if killed
            else f"{COMMAND_ENDED_DURING_FLUSH} (a rank that failed or was killed is named in its output above)"
        )
        return EXIT_FLUSH_FAILED, (
            f"the flush committed no checkpoint: {how} (command exit code {code}); a restart (if one is left) "
            f"resumes from the newest checkpoint committed before the flush"
        )
    if code in RESERVED_EXIT_CODES:
        return EXIT_COMMAND_USED_RESERVED, (
            f"the command exited {code} by itself, a code spotjob-agent reserves for what it saw itself "
            f"(74 infrastructure error, 75 committed flush, 76 failed flush, 79 stopped): "
            f"reporting {EXIT_COMMAND_USED_RESERVED}, a failure of the command"
        )
    if code == KILLED_BY_SIGKILL and killed and sigkilled_by_agent is not None:
        return code, (
            f"the command exited {code}: spotjob-agent stopped it, and it was still running --kill-grace "
            f"{sigkilled_by_agent:g} s after the agent's SIGTERM, so the agent killed it with SIGKILL (a script that "
            f"ignores SIGTERM, or whose SIGTERM handler takes longer than that)"
        )
    if code == KILLED_BY_SIGKILL:
        return code, f"the command exited {code}, killed by SIGKILL or reporting a rank that was: {OOM_HINT}"
    return code, f"the command exited {code}"
