"""``spotjob``: the command line. Each command group lives in its own module and registers itself.

- ``spotjob ckpt list|verify|show|export|adopt`` — orchestrator/cli_ckpt.py
- ``spotjob run`` — orchestrator/cli_run.py, ``spotjob status`` — orchestrator/cli_status.py (local mode)
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence

from agent.streams import ENV_LOG_FORMAT, log_format, log_to_stderr, tolerate_unencodable_output
from agent.version import version_line
from orchestrator.cli_pipe import reader_gone, stdout_reader_left


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
    parser.add_argument("--version", action="version", version=version_line("spotjob"))
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    from orchestrator import cli_ckpt

    cli_ckpt.register(sub)
    from orchestrator import cli_run, cli_status

    cli_run.register(sub)
    cli_status.register(sub)
    return parser


ENV_LOG_LEVEL = "SPOTJOB_LOG_LEVEL"
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


def log_level(parser: argparse.ArgumentParser, verbose: bool) -> str:
    """``-v``: DEBUG; else ``SPOTJOB_LOG_LEVEL`` in any case (empty counts as unset), else INFO. Any
    other value is a usage error naming the variable (it used to be a traceback)."""
    if verbose:
        return "DEBUG"
    value = os.environ.get(ENV_LOG_LEVEL, "").strip()
    if not value:
        return "INFO"
    if value.upper() not in LOG_LEVELS:
        parser.error(
            f"{ENV_LOG_LEVEL}={value!r}: expected one of {', '.join(n.lower() for n in LOG_LEVELS)}; "
            "set it to one, or unset it"
        )
    return value.upper()


def main(argv: Sequence[str] | None = None) -> int:
    tolerate_unencodable_output()
    try:
        # Building the parser imports every command's module (most of the start's half second):
        # a Ctrl-C there was a traceback of 40 lines through the imports.
        parser = build_parser()
        args = parser.parse_args(argv)
    except KeyboardInterrupt:
        return 130
    level = log_level(parser, args.verbose)
    args.log_level = level  # the commands leave the cloud clients' loggers alone at DEBUG (cli_ckpt.logs_debug)
    try:
        kind = log_format(os.environ.get(ENV_LOG_FORMAT))
    except ValueError as e:
        parser.error(f"{ENV_LOG_FORMAT}={e}; set it to one, or unset it")
    handler = _StderrHandler()
    log_to_stderr(level, "%(asctime)s %(levelname)s %(name)s: %(message)s", handler, kind=kind)
    try:
        rc: int = args.func(args)
        sys.stdout.flush()  # here, not at the interpreter's exit, where a reader gone is a traceback
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        if not stdout_reader_left():
            raise
        return reader_gone()
    return rc


if __name__ == "__main__":
    sys.exit(main())
