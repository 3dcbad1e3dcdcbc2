"""What every ``kubectl spotjob`` command shares: exit codes, the client, errors and formatting.

The commands are ``orchestrator.kubectl_status`` (``status``) and ``orchestrator.kubectl_commands``
(``checkpoints``, ``flush``, ``events``); the command line that reaches them is
``orchestrator.kubectl_plugin``.
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import datetime
from typing import Any

from orchestrator.k8s.plugin_client import SpotJobClient, load_user_context
from orchestrator.model import parse_timestamp

PROG = "kubectl spotjob"
EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2

TERMINAL_PHASES = ("Succeeded", "Failed")


class UsageError(Exception):
    """A bad command line found after parsing (exit 2)."""


def print_error(command: str, message: str) -> None:
    print(f"error: {' '.join(message.split())}", file=sys.stderr)


def connect(args: argparse.Namespace) -> tuple[SpotJobClient, str]:
    """The client for the user's context, and the namespace the command works in."""
    user = load_user_context(args.kubeconfig, args.context, cluster=args.cluster, user=args.user)
    client = SpotJobClient(user, request_timeout=args.request_timeout or 30.0)
    return client, args.namespace or user.namespace


# ----------------------------------------------------------------------------------------------
# formatting


def human_duration(seconds: float) -> str:
    """An age as kubectl prints it: ``41s``, ``5m12s``, ``52m``, ``3h4m``, ``2d3h``, ``400d``."""
    if seconds < -1:
        return "<invalid>"
    s = int(max(seconds, 0))
    if s < 120:
        return f"{s}s"
    minutes = s // 60
    if minutes < 10:
        return f"{minutes}m{s % 60}s" if s % 60 else f"{minutes}m"
    if minutes < 180:
        return f"{minutes}m"
    hours = minutes // 60
    if hours < 8:
        return f"{hours}h{minutes % 60}m" if minutes % 60 else f"{hours}h"
    if hours < 48:
        return f"{hours}h"
    days = hours // 24
    if hours < 24 * 8:
        return f"{days}d{hours % 24}h" if hours % 24 else f"{days}d"
    if days < 365 * 2:
        return f"{days}d"
    years, rest = divmod(days, 365)
    return f"{years}y{rest}d" if years < 8 and rest else f"{years}y"


def age(value: Any, now: datetime) -> str:
    t = parse_timestamp(value) if not isinstance(value, datetime) else value
    return human_duration((now - t).total_seconds()) if t is not None else "-"


def age_seconds(value: Any, now: datetime) -> float | None:
    t = parse_timestamp(value)
    return round((now - t).total_seconds(), 3) if t is not None else None


def percent(value: Any) -> str:
    return f"{value:.1%}" if isinstance(value, int | float) else "-"


def dash(value: Any) -> str:
    return "-" if value is None or value == "" else str(value)


def print_json(doc: Any) -> None:
    print(json.dumps(doc, indent=2, default=str))
