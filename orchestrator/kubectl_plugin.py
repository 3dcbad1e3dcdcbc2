"""``kubectl spotjob``: what a SpotJob is doing, its checkpoints and Events, and a flush on request.

Installed with the package as the console script ``kubectl-spotjob``, which kubectl finds on
PATH: ``kubectl spotjob status`` runs it with ``status``. Commands:

- ``status [NAME]``: a table of jobs (``-A``: every namespace), or one job in detail: its phase
  and why, step and checkpoint age, preemptions, restarts of maxRestarts, goodput, capacity, its
  pods and their nodes, zones and phases, the last restart's reason, the last flush request, and
  its conditions;
- ``checkpoints NAME``: the checkpoints under the job's ``spec.checkpoint.uri``, read from
  storage with the user's own cloud credentials and judged exactly as a restore would
  (``agent.catalog``), newest first;
- ``flush NAME``: asks the controller for a flush through the API (an annotation on the SpotJob),
  so RBAC on ``patch spotjobs`` decides who may; the job restarts from it, or with
  ``--keep-running`` trains on (a checkpoint now); ``--wait`` follows the job until the controller
  records the outcome in ``status.lastFlushRequest``;
- ``events NAME``: the job's Events, oldest first.

The flags kubectl users expect work everywhere on the line (``--kubeconfig``, ``--context``,
``--cluster``, ``--user``, ``-n/--namespace``, ``-o``); the cluster is reached through
``orchestrator.k8s.plugin_client`` only (the plugin imports no ``kubernetes``). Status is read as
raw JSON, not through the model: an older plugin must still show what a newer controller writes.

This module is the command line (the parser, ``main``); the commands are
``orchestrator.kubectl_status`` (``status``) and ``orchestrator.kubectl_commands`` (the others),
over ``orchestrator.kubectl_common`` (exit codes, the client, formatting).

Exit status: 0 done; 1 the command failed (no such job, cluster unreachable, forbidden, storage
unreadable, a flush that committed nothing or was not answered in time); 2 a bad command line.
"""

from __future__ import annotations

import argparse
import logging
import math
import re
import sys
from collections.abc import Callable, Sequence

from agent.streams import log_to_stderr, tolerate_unencodable_output
from agent.version import version_line
from orchestrator.cli_pipe import reader_gone, stdout_reader_left
from orchestrator.kubectl_common import EXIT_FAILED, EXIT_USAGE, FLUSH_WAIT_MARGIN, PROG, UsageError, print_error
from orchestrator.model import FLUSH_REASON_MAX_LENGTH, FLUSH_REQUEST_ANNOTATION

# The commands (and the kubernetes client, storage and checkpoint modules they bring, about half
# a second) are imported once the command line is parsed: --help and a bad command line do
# without them.

log = logging.getLogger(__name__)

_NAME = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")
_NAMESPACE = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
_DURATION = re.compile(r"^(?:(\d+(?:\.\d+)?)h)?(?:(\d+(?:\.\d+)?)m(?!s))?(?:(\d+(?:\.\d+)?)s)?$")
MAX_WAIT_SECONDS = 7 * 24 * 3600
"""The longest ``--timeout`` or ``--request-timeout`` (a week): longer is a typo, not a wait."""

_EXIT_CODES = (
    "exit status: 0 done; 1 the command failed (no such job, cluster unreachable, forbidden, storage "
    "unreadable, a flush that committed nothing or got no answer in time); 2 bad command line"
)


# ----------------------------------------------------------------------------------------------
# the commands, imported when one runs


def cmd_status(args: argparse.Namespace) -> int:
    from orchestrator import kubectl_status

    return kubectl_status.cmd_status(args)


def cmd_checkpoints(args: argparse.Namespace) -> int:
    from orchestrator import kubectl_commands

    return kubectl_commands.cmd_checkpoints(args)


def cmd_flush(args: argparse.Namespace) -> int:
    from orchestrator import kubectl_commands

    return kubectl_commands.cmd_flush(args)


def cmd_events(args: argparse.Namespace) -> int:
    from orchestrator import kubectl_commands

    return kubectl_commands.cmd_events(args)


# ----------------------------------------------------------------------------------------------
# the command line


def _duration(text: str) -> float:
    """Seconds from ``90``, ``90s``, ``5m``, ``1h30m`` (kubectl's duration style): positive, finite and at
    most ``MAX_WAIT_SECONDS`` (a week; ``inf``, ``nan`` or ``1e400`` would wait for ever or overflow)."""
    value = text.strip()
    try:
        seconds = float(value)
    except ValueError:
        m = _DURATION.match(value)
        if not value or not m or not any(m.groups()):
            raise argparse.ArgumentTypeError(f"{text!r} is not a duration: write e.g. 90, 90s, 5m or 1h30m") from None
        h, mins, s = (float(g) if g else 0.0 for g in m.groups())
        seconds = h * 3600 + mins * 60 + s
    if not math.isfinite(seconds):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite duration: write e.g. 90, 90s, 5m or 1h30m")
    if seconds <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: a timeout must be positive")
    if seconds > MAX_WAIT_SECONDS:
        raise argparse.ArgumentTypeError(
            f"{text!r} is longer than a week ({MAX_WAIT_SECONDS // 3600}h): write a shorter duration"
        )
    return seconds


def _job_name(text: str) -> str:
    if not _NAME.match(text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a SpotJob name (lowercase letters, digits, '-' and '.')")
    return text


def _reason(text: str) -> str:
    """A flush request's reason as the controller takes it (its whitespace collapsed, as sent): a
    longer one would make the controller refuse the whole request, under an id of its own."""
    length = len(" ".join(text.split()))
    if length > FLUSH_REASON_MAX_LENGTH:
        raise argparse.ArgumentTypeError(f"--reason has {length} characters; at most {FLUSH_REASON_MAX_LENGTH}")
    return text


def _namespace(text: str) -> str:
    if not _NAMESPACE.match(text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a namespace name (lowercase letters, digits and '-')")
    return text


def _connection_flags(parser: argparse.ArgumentParser, *, top: bool) -> None:
    """The kubectl-style flags, accepted before the command and after it alike.

    On the subcommands they default to SUPPRESS, so a flag given before the command is not
    reset by the subcommand's parser."""
    default = None if top else argparse.SUPPRESS
    parser.add_argument(
        "--kubeconfig",
        default=default,
        metavar="PATH",
        help="kubeconfig file (default: $KUBECONFIG, then ~/.kube/config)",
    )
    parser.add_argument(
        "--context", default=default, metavar="NAME", help="the kubeconfig context to use (default: the current one)"
    )
    parser.add_argument(
        "--cluster", default=default, metavar="NAME", help="the kubeconfig cluster to use (default: the context's)"
    )
    parser.add_argument(
        "--user", default=default, metavar="NAME", help="the kubeconfig user to use (default: the context's)"
    )
    parser.add_argument(
        "-n",
        "--namespace",
        type=_namespace,
        default=default,
        metavar="NS",
        help="the namespace (default: the context's)",
    )
    parser.add_argument(
        "--request-timeout",
        type=_duration,
        default=default,
        metavar="S",
        help="timeout of each API request (default 30s)",
    )
    parser.add_argument(
        "-v", "--verbose", action="store_true", default=default or False, help="debug logging on stderr"
    )


def _output_flag(parser: argparse.ArgumentParser, *, wide: str = "") -> None:
    """-o/--output: table or json, and wide where ``wide`` says what it adds. SUPPRESS as a default,
    as the connection flags: an ``-o`` given before the command (``_top_output_flag``) stands."""
    choices = ["table", "wide", "json"] if wide else ["table", "json"]
    what = f"table (default), wide ({wide}) or json" if wide else "table (default) or json"
    parser.add_argument("-o", "--output", choices=choices, default=argparse.SUPPRESS, help=what)
    parser.set_defaults(output_choices=choices)


def _top_output_flag(parser: argparse.ArgumentParser) -> None:
    """-o/--output before the command, as kubectl users type it (``kubectl spotjob -o json status``);
    ``_settle_output`` checks it against the command's own choices."""
    parser.add_argument(
        "-o",
        "--output",
        choices=["table", "wide", "json"],
        default=None,
        help="table (default) or json; wide for status (also after the command)",
    )


def _settle_output(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The output the command prints: what ``-o`` said, before the command or after it, else table.
    A command without ``-o`` (``flush``), or ``wide`` for one without it, is a usage error naming it."""
    output = getattr(args, "output", None)
    choices: list[str] | None = getattr(args, "output_choices", None)  # set by the command's ``_output_flag``
    if choices is None:
        if output is not None:
            parser.error(f"-o/--output is not an option of {args.command}")
        return
    if output is not None and output not in choices:
        said = ", ".join(repr(c) for c in choices)
        parser.error(f"argument -o/--output: invalid choice for {args.command}: {output!r} (choose from {said})")
    args.output = output or "table"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="See what SpotJobs are doing, read their checkpoints and Events, and ask the controller to "
        "flush one. Uses your kubeconfig and context, as kubectl does.",
        epilog=_EXIT_CODES,
    )
    parser.add_argument("--version", action="version", version=version_line(PROG))
    _connection_flags(parser, top=True)
    _top_output_flag(parser)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser(
        "status",
        help="a table of jobs, or one job in detail",
        description="Without NAME: one line per SpotJob (phase, committed step and its age, preemptions, restarts "
        "of maxRestarts, goodput, capacity, when a held cloud notice's flush starts, age). With NAME: the job in "
        "detail — phase and why, the training step and the newest checkpoint, preemptions, restarts, goodput, "
        "capacity, the cloud notices its agents hold, its pods with their nodes, zones and phases, the last "
        "restart's reason, the last flush request, and the conditions.",
        epilog=_EXIT_CODES,
    )
    _connection_flags(p, top=False)
    p.add_argument("name", nargs="?", type=_job_name, metavar="NAME", help="a SpotJob (default: all of the namespace)")
    p.add_argument("-A", "--all-namespaces", action="store_true", help="jobs of every namespace (without NAME)")
    _output_flag(p, wide="the table adds each job's attempt, reason and why a worker does not start")
    p.set_defaults(func=cmd_status)

    p = sub.add_parser(
        "checkpoints",
        help="the job's checkpoints in storage, newest first, valid or not and why",
        description="List the checkpoints under the job's spec.checkpoint.uri, read from storage with your own "
        "cloud credentials (the AWS or Google default credentials of this machine), newest first, judged as a "
        "restore would judge them: valid, or why not (uncommitted leftover, a missing or short file, a refused "
        "manifest; FOREIGN: written by a job that does not own the URI; FENCED: written by a stale attempt; "
        "RETIRED: set aside by a fresh start). The newest valid one is what the next attempt resumes from.",
        epilog=_EXIT_CODES,
    )
    _connection_flags(p, top=False)
    p.add_argument("name", type=_job_name, metavar="NAME", help="the SpotJob")
    _output_flag(p)
    p.set_defaults(func=cmd_checkpoints)

    p = sub.add_parser(
        "flush",
        help="ask the controller to flush a checkpoint now (and restart the job, unless --keep-running)",
        description="Ask the controller to flush a checkpoint of the job now: it tells the job's agents to commit "
        "one at the same step on every rank, and then restarts the job from it (a restart in place of a "
        "preemption), or with --keep-running lets it train on. The request is an annotation on the SpotJob "
        f"({FLUSH_REQUEST_ANNOTATION}), so whoever may patch the SpotJob may flush it; the controller records "
        "the outcome in status.lastFlushRequest and in Events.",
        epilog=_EXIT_CODES,
    )
    _connection_flags(p, top=False)
    p.add_argument("name", type=_job_name, metavar="NAME", help="the SpotJob")
    p.add_argument(
        "--keep-running", action="store_true", help="commit a checkpoint and keep training (mode checkpoint)"
    )
    p.add_argument(
        "--reason",
        type=_reason,
        default="",
        help=f"why, for the job's status and Events (at most {FLUSH_REASON_MAX_LENGTH} characters)",
    )
    p.add_argument(
        "--wait",
        action="store_true",
        help="wait until the controller answers, print the outcome; exit 1 if nothing was committed",
    )
    p.add_argument(
        "--timeout",
        type=_duration,
        metavar="S",
        help=f"with --wait: how long to wait (default: the job's flushTimeoutSeconds + {FLUSH_WAIT_MARGIN:g}s)",
    )
    p.set_defaults(func=cmd_flush)

    p = sub.add_parser(
        "events",
        help="the job's Events, oldest first",
        description="The Events about the SpotJob (what the controller did and why), oldest first by their "
        "latest occurrence, with repeats counted (events.k8s.io/v1, which the controller writes).",
        epilog=_EXIT_CODES,
    )
    _connection_flags(p, top=False)
    p.add_argument("name", type=_job_name, metavar="NAME", help="the SpotJob")
    _output_flag(p)
    p.set_defaults(func=cmd_events)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    tolerate_unencodable_output()
    parser = build_parser()
    args = parser.parse_args(argv)
    _settle_output(parser, args)
    from agent.storage import StorageError
    from orchestrator.ckpt_common import CommandError
    from orchestrator.cli_ckpt import NOISY_LOGGERS
    from orchestrator.k8s.plugin_client import PluginError

    log_to_stderr(logging.DEBUG if args.verbose else logging.WARNING, "%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not args.verbose:
        # The answer goes to stdout and one error line to stderr; retries and the cloud clients'
        # chatter are not part of it (-v keeps them).
        for noisy in (*NOISY_LOGGERS, "orchestrator.k8s.api"):
            logging.getLogger(noisy).setLevel(logging.ERROR)
    command: Callable[[argparse.Namespace], int] = args.func
    try:
        rc = command(args)
        sys.stdout.flush()  # here, not at the interpreter's exit, where a reader gone is a traceback
        return rc
    except BrokenPipeError:
        if not stdout_reader_left():
            raise
        return reader_gone()  # the reader of stdout left (`| head`): no error
    except UsageError as e:
        parser.exit(EXIT_USAGE, f"{PROG} {args.command}: error: {e}\n")
    except (PluginError, CommandError, StorageError) as e:
        log.debug("%s failed", args.command, exc_info=True)
        print_error(args.command, str(e))
        return EXIT_FAILED
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
