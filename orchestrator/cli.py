"""``spotjob``: the command line. Each command group lives in its own module and registers itself.

- ``spotjob ckpt list|verify|show|export`` — orchestrator/cli_ckpt.py
- ``spotjob run`` — orchestrator/cli_run.py, ``spotjob status`` — orchestrator/cli_status.py (local mode)
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence

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
        if not stdout_reader_left():
            raise
        return reader_gone()
    return rc


if __name__ == "__main__":
    sys.exit(main())
