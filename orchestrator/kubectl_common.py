"""What every ``kubectl spotjob`` command shares: exit codes, the client, errors and formatting.

The commands are ``orchestrator.kubectl_status`` (``status``) and ``orchestrator.kubectl_commands``
(``checkpoints``, ``flush``, ``events``); the command line that reaches them is
``orchestrator.kubectl_plugin``.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from datetime import datetime
from typing import TYPE_CHECKING, Any

from orchestrator.held_notices import age as age
from orchestrator.held_notices import human_duration as human_duration
from orchestrator.model import parse_timestamp

if TYPE_CHECKING:
    from orchestrator.k8s.plugin_client import SpotJobClient

PROG = "kubectl spotjob"
EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2

TERMINAL_PHASES = ("Succeeded", "Failed")

FLUSH_WAIT_MARGIN = 60.0
"""``flush --wait`` waits the job's ``flushTimeoutSeconds`` plus this, unless ``--timeout`` says otherwise."""


def plugin_command(command: str, name: str, namespace: str) -> str:
    """``kubectl spotjob COMMAND NAME -n NAMESPACE``, quoted for the shell: a hint to run next works
    as printed whatever namespace the user's context is in."""
    return f"{PROG} {command} {shlex.quote(name)} -n {shlex.quote(namespace)}"


class UsageError(Exception):
    """A bad command line found after parsing (exit 2)."""


def print_error(command: str, message: str) -> None:
    print(f"error: {' '.join(message.split())}", file=sys.stderr)


def connect(args: argparse.Namespace) -> tuple[SpotJobClient, str]:
    """The client for the user's context, and the namespace the command works in."""
    # Here, not at the top: the client brings the kubernetes package (half a second), which the
    # command line's --help and its usage errors do without.
    from orchestrator.k8s.plugin_client import SpotJobClient, load_user_context

    user = load_user_context(args.kubeconfig, args.context, cluster=args.cluster, user=args.user)
    client = SpotJobClient(user, request_timeout=args.request_timeout or 30.0)
    return client, args.namespace or user.namespace


# ----------------------------------------------------------------------------------------------
# formatting


def age_seconds(value: Any, now: datetime) -> float | None:
    t = parse_timestamp(value)
    return round((now - t).total_seconds(), 3) if t is not None else None


def percent(value: Any) -> str:
    return f"{value:.1%}" if isinstance(value, int | float) else "-"


def dash(value: Any) -> str:
    return "-" if value is None or value == "" else str(value)


def print_json(doc: Any) -> None:
    print(json.dumps(doc, indent=2, default=str))
