"""The standard streams of spotjob's own commands (``spotjob``, ``spotjob-agent``, the controller,
the kubectl plugin); never of the user's training process.

Their output holds text the terminal's encoding may not: a ``—`` or ``…`` of ours, a path or job
name the user chose. Under ``PYTHONIOENCODING=ascii``, a Latin-1 locale, or a file name whose
bytes are not UTF-8 (decoded to surrogates), Python's stdout raises ``UnicodeEncodeError`` for
such a character, which turned a finished command into a traceback. Writing it as an escape
(``\\u2014``) instead keeps the output whole and readable, and the exit status the command's own.

Their log lines carry UTC times in ISO 8601 with a ``Z`` (``2026-12-04T03:25:00.123Z``): the same
on every node and controller whatever its ``TZ``, and comparable with the deadlines they log,
which are UTC too. Python's default is the machine's local time without a zone.
"""

from __future__ import annotations

import io
import logging
import sys
import time


def tolerate_unencodable_output() -> None:
    """(each command, first thing) Write what stdout and stderr cannot encode as backslash escapes."""
    for stream in (sys.stdout, sys.stderr):
        if isinstance(stream, io.TextIOWrapper):  # not a test's StringIO, nor None (pythonw)
            stream.reconfigure(errors="backslashreplace")


class UtcFormatter(logging.Formatter):
    """``%(asctime)s`` as UTC, ISO 8601, milliseconds and a ``Z``."""

    @staticmethod
    def converter(secs: float | None = None, /) -> time.struct_time:
        return time.gmtime(secs)

    default_time_format = "%Y-%m-%dT%H:%M:%S"
    default_msec_format = "%s.%03dZ"


def log_to_stderr(level: int | str, fmt: str, handler: logging.Handler | None = None) -> None:
    """(each command, once) Its log lines to ``handler`` (default: stderr), times in UTC."""
    handler = handler if handler is not None else logging.StreamHandler(sys.stderr)
    handler.setFormatter(UtcFormatter(fmt))
    logging.basicConfig(level=level, handlers=[handler])
