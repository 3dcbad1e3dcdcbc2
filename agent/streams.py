"""The standard streams of spotjob's own commands (``spotjob``, ``spotjob-agent``, the controller,
the kubectl plugin); never of the user's training process.

Their output holds text the terminal's encoding may not: a ``—`` or ``…`` of ours, a path or job
name the user chose. Under ``PYTHONIOENCODING=ascii``, a Latin-1 locale, or a file name whose
bytes are not UTF-8 (decoded to surrogates), Python's stdout raises ``UnicodeEncodeError`` for
such a character, which turned a finished command into a traceback. Writing it as an escape
(``\\u2014``) instead keeps the output whole and readable, and the exit status the command's own.
"""

from __future__ import annotations

import io
import sys


def tolerate_unencodable_output() -> None:
    """(each command, first thing) Write what stdout and stderr cannot encode as backslash escapes."""
    for stream in (sys.stdout, sys.stderr):
        if isinstance(stream, io.TextIOWrapper):  # not a test's StringIO, nor None (pythonw)
            stream.reconfigure(errors="backslashreplace")
