"""``spotjob``: the command line. Each command group lives in its own module and registers itself.

- ``spotjob ckpt list|verify|show|export`` — orchestrator/cli_ckpt.py
- ``spotjob run`` — orchestrator/cli_run.py, ``spotjob status`` — orchestrator/cli_status.py (local mode)
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
from collections.abc import Sequence


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is now (tests and the live view swap it)."""

    @property
    def stream(self) -> object:
        return sys.stderr

    @stream.setter
    def stream(self, _value: object) -> None:
        pass


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="spotjob", description="Preemption-proof PyTorch training on spot capacity.")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    from orchestrator import cli_ckpt

    cli_ckpt.register(sub)
    from orchestrator import cli_run, cli_status

    cli_run.register(sub)
    cli_status.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    handler = _StderrHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else getattr(logging, os.environ.get("SPOTJOB_LOG_LEVEL", "INFO")),
        handlers=[handler],
    )
    try:
        rc: int = args.func(args)
        sys.stdout.flush()  # here, not at the interpreter's exit, where a reader gone is a traceback
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return _reader_gone()
    return rc


EXIT_READER_GONE = 128 + 13
"""What a shell pipeline's writer exits with when its reader left (128 + SIGPIPE)."""


def _reader_gone() -> int:
    """The reader of stdout went away (``spotjob status --json | head``): no error, no traceback.

    stdout then points at /dev/null, so the interpreter's last flush of it cannot fail again.
    """
    with contextlib.suppress(OSError, ValueError):  # a stdout without a descriptor (tests) needs none
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    return EXIT_READER_GONE


if __name__ == "__main__":
    sys.exit(main())
