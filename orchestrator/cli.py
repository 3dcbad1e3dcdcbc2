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
from typing import cast

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


class _CommandParser(argparse.ArgumentParser):
    """A command's parser. A positional followed by a ``REMAINDER`` one (``spotjob run SCRIPT ARGS``)
    splits the command line: what follows the first is the second's as given. argparse dropped the
    first ``--`` of it (``train.py -- --x`` ran ``train.py --x``); a ``--`` before SCRIPT still ends
    the command's options."""

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        given = list(sys.argv[1:] if args is None else args)
        positionals = [a for a in self._actions if not a.option_strings]
        rest = positionals[-1] if len(positionals) > 1 and positionals[-1].nargs == argparse.REMAINDER else None
        at = None
        if rest is not None:
            odd = [a.option_strings[0] for a in self._actions if a.option_strings and a.nargs not in (None, 0)]
            if odd:  # a programming error, found by the parser tests
                raise TypeError(
                    f"{self.prog}: {odd} take an optional or a variable number of values: "
                    "the split at SCRIPT cannot skip them"
                )
            at = self._first_positional(given)
        if rest is None or at is None:
            return super().parse_known_args(given, namespace)
        parsed, extras = super().parse_known_args(given[: at + 1], namespace)
        setattr(parsed, rest.dest, given[at + 1 :])
        return parsed, extras

    def _first_positional(self, given: list[str]) -> int | None:
        """The index of the first argument that is neither an option nor an option's value."""
        i = 0
        while i < len(given):
            arg = given[i]
            if arg == "--":
                return i + 1 if i + 1 < len(given) else None
            if not arg.startswith("-") or arg == "-":
                return i
            i += 1
            if "=" in arg:  # --option=value
                continue
            action = self._option_string_actions.get(arg)
            if action is None and arg.startswith("--"):  # argparse takes a long option's unique prefix
                found = {a for o, a in self._option_string_actions.items() if o.startswith(arg)}
                action = found.pop() if len(found) == 1 else None
            if action is not None and action.nargs != 0:  # its value; an unknown option argparse refuses
                i += 1
        return None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="spotjob", description="Preemption-proof PyTorch training on spot capacity.")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument("--version", action="version", version=version_line("spotjob"))
    # Typed as what the commands register on: a _CommandParser is an ArgumentParser.
    sub: argparse._SubParsersAction[argparse.ArgumentParser] = cast(
        "argparse._SubParsersAction[argparse.ArgumentParser]",
        parser.add_subparsers(dest="command", metavar="COMMAND", required=True, parser_class=_CommandParser),
    )
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
