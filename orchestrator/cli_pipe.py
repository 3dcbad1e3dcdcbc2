"""A command's stdout whose reader went away (``spotjob status --json | head``, ``kubectl spotjob
status | head -1``): no error and no traceback, the exit status a shell pipeline's writer has."""

from __future__ import annotations

import contextlib
import os
import select
import sys

EXIT_READER_GONE = 128 + 13
"""What a shell pipeline's writer exits with when its reader left (128 + SIGPIPE)."""


def stdout_reader_left() -> bool:
    """Whether stdout is a pipe whose reader has closed it: a ``BrokenPipeError`` from anything
    else (a socket or pipe of a storage or API client) is an error, never a reader that left."""
    try:
        poller = select.poll()
        # Linux reports a pipe whose reader left as POLLERR, whatever was asked; macOS's poll
        # (kqueue underneath) reports nothing for an fd asked for no events, and a write end whose
        # reader left as POLLHUP: so ask for POLLOUT and take either.
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & (select.POLLERR | select.POLLHUP) for _, events in poller.poll(0))
    except (OSError, ValueError, AttributeError):  # a stdout without a descriptor (tests)
        return False


def reader_gone() -> int:
    """Point stdout at /dev/null, so the interpreter's last flush of it cannot fail again, and
    return ``EXIT_READER_GONE``. For ``except BrokenPipeError`` around a command that has flushed
    its stdout inside the ``try``, once ``stdout_reader_left()`` said it was stdout's."""
    with contextlib.suppress(OSError, ValueError):  # a stdout without a descriptor (tests) needs none
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    return EXIT_READER_GONE
