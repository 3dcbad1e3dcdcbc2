"""Why a local worker failed, told from the end of its log: the line that says why."""

from __future__ import annotations

import os
import re

from agent.exit_codes import KILLED_BY, exit_words, signal_name

LOG_TAIL_BYTES = 256 * 1024
"""How much of the end of a worker's log is read to tell why it failed."""
_RANK_PREFIX = re.compile(r"^\[(?:default)?rank\d+\]:\s?")
_OS_CAUSE = re.compile(
    r"No space left on device|Disk quota exceeded|Read-only file system|Permission denied|"
    r"Cannot allocate memory|Out of memory|no space left|the filesystem is read-only|permission denied",
)
"""What an operator fixes outside the script, wherever a line says it: it outranks the exception
it caused (``No space left on device`` rather than ``unexpected pos 704 vs 598``)."""
_EXCEPTION = re.compile(r"^(?:[A-Za-z_][\w]*\.)*[A-Za-z_]\w*(?:Error|Exception|Exit|Interrupt)\b(?::.*)?$")
_USAGE = re.compile(r"^\S+: error: .+")
_TORCHRUN_FAILURE = "ChildFailedError"
_TORCHRUN_LOG = re.compile(r"^[IWE]\d{4} [\d:.]+ +\d+ torch/distributed/")
"""torchrun's own log lines (glog style): how it noticed, not why."""
MAX_CAUSE_CHARS = 240
_LAUNCHER_KILLED = re.compile(rf"spotjob-agent launcher: (rank \d+ \(pid \d+\) {KILLED_BY} SIG\w+)")
"""The direct launcher's word on a rank a signal ended (``agent.ranks``)."""
_TORCHRUN_ROOT_RANK = re.compile(r"^\s*rank\s*:\s*(\d+)")
_TORCHRUN_ROOT_SIGNAL = re.compile(r"^\s*exitcode\s*:\s*-(\d+) \(pid: (\d+)\)")
_AGENT_STOPPED = re.compile(
    r"spotjob-agent\[\d+\].* exiting \d+: .*; (spotjob-agent stopped the command without a flush on .*)$"
)
"""The agent's exit line for a command it stopped on a signal it does not take as a notice
(``agent.launcher``): the script's own lines cannot say why it ended."""
_KILLED_HINT = "out of memory? (the kernel's OOM killer sends SIGKILL; see README 'Staging memory')"
_AGENT_KILLED_HINT = "by hand, or by the kernel's OOM killer when the machine ran out of memory"


def _killed_rank(text: str) -> str | None:
    """A rank a signal ended, as the launcher reported it: the direct launcher's line, or the root
    cause of torchrun's failure table (``exitcode : -9``). The other ranks' errors after it (gloo's
    "Connection closed by peer") are its consequence, not the cause."""
    lines = text.splitlines()
    for line in reversed(lines):
        m = _LAUNCHER_KILLED.search(line)
        if m is not None:
            return m.group(1)
    root = next((i for i in range(len(lines) - 1, -1, -1) if lines[i].startswith("Root Cause")), None)
    if root is None:
        return None
    rank = None
    for line in lines[root + 1 : root + 12]:
        if (m := _TORCHRUN_ROOT_RANK.match(line)) is not None:
            rank = m.group(1)
        elif (m := _TORCHRUN_ROOT_SIGNAL.match(line)) is not None:
            who = f"rank {rank} (pid {m.group(2)})" if rank is not None else f"pid {m.group(2)}"
            return f"{who} {KILLED_BY} {signal_name(int(m.group(1)))} (torchrun's report)"
    return None


def _log_tail(path: str) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - LOG_TAIL_BYTES))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def _log_lines(text: str) -> list[str]:
    """The end of a worker's log (``_log_tail``) as lines, without torchrun's ``[rankN]:`` prefixes,
    the agent's own lines, or torchrun's report of the failure (its traceback and the table after it)."""
    lines = [_RANK_PREFIX.sub("", line.rstrip()) for line in text.splitlines()]
    for i in range(len(lines) - 1, -1, -1):
        if _TORCHRUN_FAILURE in lines[i]:
            start = max((j for j in range(i) if lines[j].startswith("Traceback (most recent call last)")), default=i)
            lines = lines[:start]
            break
    return [
        line
        for line in lines
        if line.strip() and not _agent_line(line) and not line.startswith("#") and not _TORCHRUN_LOG.match(line)
    ]


def _agent_line(line: str) -> bool:
    """A log line of the agent's own, as text or (``SPOTJOB_LOG_FORMAT=json``) as JSON."""
    return "spotjob-agent[" in line or (line.startswith("{") and '"command": "spotjob-agent"' in line)


def _shorten(line: str, match: re.Match[str] | None = None) -> str:
    line = line.strip()
    if len(line) <= MAX_CAUSE_CHARS:
        return line
    if match is None or match.end() <= MAX_CAUSE_CHARS - 20:
        end = match.end() if match is not None else MAX_CAUSE_CHARS - 20
        return line[: max(end, MAX_CAUSE_CHARS - 40)].rstrip() + " …"
    return f"{line[:140].rstrip()} … {line[max(0, match.start() - 40) : match.end() + 10].strip()} …"


def failure_cause(log_path: str) -> str | None:
    """The line of a failed worker's log that says why, or None when none does.

    In order: a rank a signal ended (SIGKILL: the OOM killer, most likely), as the launcher
    reported it; a cause outside the script (a full disk, a read-only filesystem, permission
    denied, memory); the last exception a rank raised or the last usage error (``train.py: error:
    ...``), whichever came later. torchrun's own report of the failure is not the cause, except for
    the signal in its root cause.
    """
    return failure_cause_in(_log_tail(log_path))


def failure_cause_in(text: str) -> str | None:
    """``failure_cause`` of a worker's output ``text`` (the end of its log; on Kubernetes, the
    termination message ``FallbackToLogsOnError`` makes of it)."""
    killed = _killed_rank(text)
    if killed is not None:
        return f"{killed}: {_KILLED_HINT}" if "SIGKILL" in killed else killed
    for line in reversed(text.splitlines()[-20:]):
        m = _AGENT_STOPPED.search(line.rstrip())
        if m is not None:
            return _shorten(m.group(1))
    lines = _log_lines(text)
    for line in reversed(lines):
        m = _OS_CAUSE.search(line)
        if m is not None:
            return _shorten(line, m)
    for line in reversed(lines):
        if _EXCEPTION.match(line.strip()) or _USAGE.match(line.strip()):
            return _shorten(line)
    return None


def agent_exit_words(log_path: str, code: int) -> str | None:
    """The agent's own words on why it exited ``code``, from ``exiting N:`` on, whole: its last
    such line in the worker's log, as text or as JSON. None when the log has none (an agent that
    could not say)."""
    for line in reversed(_log_tail(log_path).splitlines()[-40:]):
        said = exit_words(line, code) if _agent_line(line) else None
        if said:
            return said
    return None


def agent_exit_line(log_path: str, code: int) -> str | None:
    """The agent's own words on why it exited ``code`` (74, an infrastructure error; 76, a flush
    that committed nothing), shortened, with the log's path (``agent_exit_words``)."""
    said = agent_exit_words(log_path, code)
    return f"{_shorten(said)} (log: {log_path})" if said else None


def log_excerpt(log_path: str, lines: int = 12) -> list[str]:
    """The last ``lines`` lines of a worker's log that the script wrote (see ``_log_lines``)."""
    return _log_lines(_log_tail(log_path))[-lines:]


def telling_line(text: str) -> str | None:
    """The telling line of a failed worker's output ``text`` (see ``failure_cause_in``): the line
    that says why, else ``its log ends: <the last line the script wrote>`` (never the agent's own
    lines, its ``exiting N`` among them); None when the script wrote nothing."""
    cause = failure_cause_in(text)
    if cause is not None:
        return cause
    lines = _log_lines(text)
    return f"its log ends: {_shorten(lines[-1])}" if lines else None


def failure_detail(log_path: str, agent_signal: int | None = None) -> str:
    """What a failed worker's reason carries: the telling line of its log, and the log's path.

    ``agent_signal``: the signal that ended the worker's ``spotjob-agent`` itself, if one did. Then
    nothing in the log says why (the agent had no chance to), so the reason names the signal first
    rather than pass the last line the script wrote for the cause."""
    said = telling_line(_log_tail(log_path)) or "its log says nothing"
    if agent_signal is not None:
        name = signal_name(agent_signal)
        hint = f" ({_AGENT_KILLED_HINT})" if name == "SIGKILL" else ""
        said = f"spotjob-agent itself {KILLED_BY} {name}{hint}; {said}"
    return f"{said} (log: {log_path})"
