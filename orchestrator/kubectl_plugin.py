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
  so RBAC on ``patch spotjobs`` decides who may; ``--wait`` follows the job until the controller
  records the outcome in ``status.lastFlushRequest``;
- ``events NAME``: the job's Events, oldest first.

The flags kubectl users expect work everywhere on the line (``--kubeconfig``, ``--context``,
``-n/--namespace``, ``-o json``); the cluster is reached through ``orchestrator.k8s.plugin_client``
only (this module imports no ``kubernetes``). Status is read as raw JSON, not through the model:
an older plugin must still show what a newer controller writes.

Exit status: 0 done; 1 the command failed (no such job, cluster unreachable, forbidden, storage
unreadable, a flush that committed nothing or was not answered in time); 2 a bad command line.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import sys
import uuid
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from typing import Any

from agent.catalog import CheckpointStatus, list_checkpoints
from agent.ownership import OwnershipError
from agent.storage import StorageError
from orchestrator.cli_ckpt import LIST_HEADERS, CommandError, checkpoint_json, list_rows, opened_storage, print_table
from orchestrator.k8s.plugin_client import (
    FLUSH_REQUEST_ANNOTATION,
    AccessDenied,
    JobEvent,
    PluginError,
    SpotJobClient,
    load_user_context,
)

log = logging.getLogger(__name__)

PROG = "kubectl spotjob"
EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2

FLUSH_WAIT_MARGIN = 60.0
"""``flush --wait`` waits the job's ``flushTimeoutSeconds`` plus this, unless ``--timeout`` says otherwise."""

_NAME = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")
_NAMESPACE = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
_DURATION = re.compile(r"^(?:(\d+(?:\.\d+)?)h)?(?:(\d+(?:\.\d+)?)m(?!s))?(?:(\d+(?:\.\d+)?)s)?$")
_TERMINAL = ("Succeeded", "Failed")
_NOISY_LOGGERS = ("botocore", "boto3", "s3transfer", "urllib3", "google", "awscrt", "orchestrator.k8s.api")

_EXIT_CODES = (
    "exit status: 0 done; 1 the command failed (no such job, cluster unreachable, forbidden, storage "
    "unreadable, a flush that committed nothing or got no answer in time); 2 bad command line"
)


class UsageError(Exception):
    """A bad command line found after parsing (exit 2)."""


# ----------------------------------------------------------------------------------------------
# the command line


def _duration(text: str) -> float:
    """Seconds from ``90``, ``90s``, ``5m``, ``1h30m`` (kubectl's duration style)."""
    value = text.strip()
    try:
        seconds = float(value)
    except ValueError:
        m = _DURATION.match(value)
        if not value or not m or not any(m.groups()):
            raise argparse.ArgumentTypeError(f"{text!r} is not a duration: write e.g. 90, 90s, 5m or 1h30m") from None
        h, mins, s = (float(g) if g else 0.0 for g in m.groups())
        seconds = h * 3600 + mins * 60 + s
    if seconds <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: a timeout must be positive")
    return seconds


def _job_name(text: str) -> str:
    if not _NAME.match(text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a SpotJob name (lowercase letters, digits, '-' and '.')")
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


def _output_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-o", "--output", choices=["table", "json"], default="table", help="table (default) or json")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="See what SpotJobs are doing, read their checkpoints and Events, and ask the controller to "
        "flush one. Uses your kubeconfig and context, as kubectl does.",
        epilog=_EXIT_CODES,
    )
    _connection_flags(parser, top=True)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser(
        "status",
        help="a table of jobs, or one job in detail",
        description="Without NAME: one line per SpotJob (phase, committed step and its age, preemptions, restarts "
        "of maxRestarts, goodput, capacity, age). With NAME: the job in detail — phase and why, the training step "
        "and the newest checkpoint, preemptions, restarts, goodput, capacity, its pods with their nodes, zones and "
        "phases, the last restart's reason, the last flush request, and the conditions.",
        epilog=_EXIT_CODES,
    )
    _connection_flags(p, top=False)
    p.add_argument("name", nargs="?", type=_job_name, metavar="NAME", help="a SpotJob (default: all of the namespace)")
    p.add_argument("-A", "--all-namespaces", action="store_true", help="jobs of every namespace (without NAME)")
    _output_flag(p)
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
    p.add_argument("--reason", default="", help="why, for the job's status and Events")
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
        "latest occurrence, with repeats counted: events.k8s.io/v1 where the cluster serves it, core v1 Events "
        "otherwise.",
        epilog=_EXIT_CODES,
    )
    _connection_flags(p, top=False)
    p.add_argument("name", type=_job_name, metavar="NAME", help="the SpotJob")
    _output_flag(p)
    p.set_defaults(func=cmd_events)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    if not args.verbose:
        # The answer goes to stdout and one error line to stderr; retries and the cloud clients'
        # chatter are not part of it (-v keeps them).
        for noisy in _NOISY_LOGGERS:
            logging.getLogger(noisy).setLevel(logging.ERROR)
    command: Callable[[argparse.Namespace], int] = args.func
    try:
        return command(args)
    except UsageError as e:
        parser.exit(EXIT_USAGE, f"{PROG} {args.command}: error: {e}\n")
    except (PluginError, CommandError, StorageError) as e:
        log.debug("%s failed", args.command, exc_info=True)
        _error(args.command, str(e))
        return EXIT_FAILED
    except KeyboardInterrupt:
        return 130


def _error(command: str, message: str) -> None:
    print(f"error: {' '.join(message.split())}", file=sys.stderr)


def _client(args: argparse.Namespace) -> tuple[SpotJobClient, str]:
    """The client for the user's context, and the namespace the command works in."""
    user = load_user_context(args.kubeconfig, args.context)
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


def _time(value: Any) -> datetime | None:
    if not isinstance(value, str) or not value:
        return None
    try:
        parsed = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)


def _age(value: Any, now: datetime) -> str:
    t = _time(value) if not isinstance(value, datetime) else value
    return human_duration((now - t).total_seconds()) if t is not None else "-"


def _age_seconds(value: Any, now: datetime) -> float | None:
    t = _time(value)
    return round((now - t).total_seconds(), 3) if t is not None else None


def _percent(value: Any) -> str:
    return f"{value:.1%}" if isinstance(value, int | float) else "-"


def _dash(value: Any) -> str:
    return "-" if value is None or value == "" else str(value)


def _print_json(doc: Any) -> None:
    print(json.dumps(doc, indent=2, default=str))


# ----------------------------------------------------------------------------------------------
# status


def _training_step(status: dict[str, Any]) -> int | None:
    observed = (status.get("attempt") or {}).get("observedStep")
    if isinstance(observed, int):
        return observed
    steps = [w.get("step") for w in status.get("workers") or [] if isinstance(w.get("step"), int)]
    return max(steps) if steps else None


def job_summary(job: dict[str, Any], now: datetime) -> dict[str, Any]:
    """What the table shows of one job, as JSON (camelCase, like the resource)."""
    meta = job.get("metadata") or {}
    spec = job.get("spec") or {}
    status = job.get("status") or {}
    checkpoint = status.get("lastCheckpoint") or None
    return {
        "namespace": meta.get("namespace"),
        "name": meta.get("name"),
        "phase": status.get("phase"),
        "reason": status.get("reason") or None,
        "message": status.get("message") or None,
        "step": (checkpoint or {}).get("step"),
        "trainingStep": _training_step(status),
        "lastCheckpoint": checkpoint,
        "checkpointAgeSeconds": _age_seconds((checkpoint or {}).get("time"), now),
        "preemptions": status.get("preemptions", 0) if status else None,
        "restarts": status.get("restarts", 0) if status else None,
        "maxRestarts": spec.get("maxRestarts"),
        "goodput": status.get("goodput"),
        "capacity": status.get("capacity"),
        "attempt": (status.get("attempt") or {}).get("number") if status else None,
        "creationTimestamp": meta.get("creationTimestamp"),
        "ageSeconds": _age_seconds(meta.get("creationTimestamp"), now),
    }


def _restarts_text(summary: dict[str, Any]) -> str:
    if summary["restarts"] is None:
        return "-"
    limit = summary["maxRestarts"]
    return f"{summary['restarts']}/{limit}" if limit is not None else str(summary["restarts"])


def cmd_status(args: argparse.Namespace) -> int:
    if args.name and args.all_namespaces:
        raise UsageError("a NAME and -A/--all-namespaces do not go together: name a job, or list them all")
    client, namespace = _client(args)
    with client:
        if args.name:
            return _status_one(client, namespace, args.name, args.output)
        jobs = client.list_jobs(None if args.all_namespaces else namespace)
    now = datetime.now(UTC)
    summaries = [job_summary(j, now) for j in jobs]
    if args.output == "json":
        _print_json(summaries)
        return EXIT_OK
    if not summaries:
        where = "any namespace" if args.all_namespaces else f'namespace "{namespace}"'
        print(f"No SpotJobs in {where}.", file=sys.stderr)
        return EXIT_OK
    with_capacity = any(s["capacity"] for s in summaries)
    headers = ["NAME", "PHASE", "STEP", "CHECKPOINT", "PREEMPTIONS", "RESTARTS", "GOODPUT"]
    headers += ["CAPACITY"] if with_capacity else []
    headers += ["AGE"]
    if args.all_namespaces:
        headers.insert(0, "NAMESPACE")
    rows = []
    for s, job in zip(summaries, jobs, strict=True):
        row = [
            s["name"],
            _dash(s["phase"]) if job.get("status") else "<no status>",
            _dash(s["step"]),
            _age((s["lastCheckpoint"] or {}).get("time"), now),
            _dash(s["preemptions"]),
            _restarts_text(s),
            _percent(s["goodput"]),
        ]
        row += [_dash(s["capacity"])] if with_capacity else []
        row += [_age(s["creationTimestamp"], now)]
        if args.all_namespaces:
            row.insert(0, s["namespace"])
        rows.append(row)
    print_table(headers, rows)
    return EXIT_OK


def _pod_phase(pod: dict[str, Any]) -> str:
    if (pod.get("metadata") or {}).get("deletionTimestamp"):
        return "Terminating"
    return str((pod.get("status") or {}).get("phase") or "Pending")


def _pod_ready(pod: dict[str, Any]) -> bool:
    for c in (pod.get("status") or {}).get("conditions") or []:
        if c.get("type") == "Ready":
            return c.get("status") == "True"
    return False


def _pod_exit_code(pod: dict[str, Any]) -> int | None:
    for c in (pod.get("status") or {}).get("containerStatuses") or []:
        code = ((c.get("state") or {}).get("terminated") or {}).get("exitCode")
        if isinstance(code, int):
            return code
    return None


def job_pods_view(job: dict[str, Any], pods: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """The job's pods as the API shows them now, with zones from the controller's view of its
    workers; without ``pods`` (not allowed to list them), the controller's view alone."""
    workers = {str(w.get("name")): w for w in (job.get("status") or {}).get("workers") or []}
    if pods is None:
        return [
            {
                "name": name,
                "attempt": None,
                "phase": w.get("phase"),
                "ready": None,
                "node": w.get("node"),
                "zone": w.get("zone"),
                "instanceType": w.get("instanceType"),
                "podIP": None,
                "exitCode": w.get("exitCode"),
            }
            for name, w in workers.items()
        ]
    out = []
    for pod in pods:
        meta = pod.get("metadata") or {}
        w = workers.get(str(meta.get("name")), {})
        out.append(
            {
                "name": meta.get("name"),
                "attempt": (meta.get("labels") or {}).get("spotjob.dev/attempt"),
                "phase": _pod_phase(pod),
                "ready": _pod_ready(pod),
                "node": (pod.get("spec") or {}).get("nodeName") or w.get("node"),
                "zone": w.get("zone"),
                "instanceType": w.get("instanceType"),
                "podIP": (pod.get("status") or {}).get("podIP"),
                "exitCode": _pod_exit_code(pod),
            }
        )
    return out


def _status_one(client: SpotJobClient, namespace: str, name: str, output: str) -> int:
    job = client.get_job(namespace, name)
    pods_note = ""
    try:
        pods: list[dict[str, Any]] | None = client.job_pods(namespace, name)
    except AccessDenied as e:
        pods, pods_note = (
            None,
            f"you may not list pods in {namespace} ({e.verb} {e.resource}): the controller's last view",
        )
    now = datetime.now(UTC)
    meta, spec, status = job.get("metadata") or {}, job.get("spec") or {}, job.get("status") or {}
    summary = job_summary(job, now)
    view = job_pods_view(job, pods)
    history = status.get("restartHistory") or []
    if output == "json":
        summary.update(
            pods=view,
            conditions=status.get("conditions") or [],
            lastRestart=history[-1] if history else None,
            lastFlushRequest=status.get("lastFlushRequest"),
            recovery=status.get("recovery"),
            lostSteps=status.get("lostSteps"),
            generation=meta.get("generation"),
            observedGeneration=status.get("observedGeneration"),
            checkpointUri=(spec.get("checkpoint") or {}).get("uri"),
        )
        _print_json(summary)
        return EXIT_OK

    lines: list[tuple[str, str]] = [("Name", str(meta.get("name"))), ("Namespace", str(meta.get("namespace")))]
    if not status:
        lines.append(
            (
                "Phase",
                "<no status yet>: no controller has written one — is spotjob-controller running and serving "
                f"namespace {namespace}?",
            )
        )
    else:
        why = ": ".join(x for x in (status.get("reason"), status.get("message")) if x)
        lines.append(("Phase", f"{status.get('phase', '-')}" + (f" ({why})" if why else "")))
        generation, observed = meta.get("generation"), status.get("observedGeneration")
        if isinstance(generation, int) and isinstance(observed, int) and observed < generation:
            lines.append(("Spec", f"generation {generation}; the controller has acted on {observed} so far"))
    replicas, nproc = spec.get("replicas", 1), spec.get("nprocPerNode", 1)
    lines.append(("Workers", f"{replicas} pod(s) x {nproc} rank(s)"))
    attempt = status.get("attempt") or {}
    if status:
        resumed = attempt.get("resumedFromStep")
        running = attempt.get("runningAt")
        text = f"{attempt.get('number', 0)}"
        text += f", running for {_age(running, now)}" if running else ""
        text += f", resumed from step {resumed}" if resumed is not None else ", started from scratch"
        lines.append(("Attempt", text))
    step = summary["trainingStep"]
    lines.append(("Step", "-" if step is None else f"{step} (the agents' last report)"))
    ckpt = status.get("lastCheckpoint")
    lines.append(
        (
            "Checkpoint",
            f"step {ckpt.get('step')}, {_age(ckpt.get('time'), now)} ago ({ckpt.get('uri')})"
            if ckpt
            else f"none committed yet (under {(spec.get('checkpoint') or {}).get('uri', '-')})",
        )
    )
    if status:
        lines.append(("Preemptions", str(status.get("preemptions", 0))))
        lines.append(
            (
                "Restarts",
                f"{status.get('restarts', 0)} of {spec.get('maxRestarts', '-')} "
                "(failures of your code; preemptions never count)",
            )
        )
        lost = status.get("lostSteps")
        lines.append(
            ("Goodput", _percent(status.get("goodput")) + (f" ({lost} step(s) lost to preemptions)" if lost else ""))
        )
        if status.get("capacity"):
            lines.append(("Capacity", str(status["capacity"])))
    if history:
        last = history[-1]
        lines.append(
            (
                "Last restart",
                f"{_age(last.get('time'), now)} ago, attempt {last.get('attempt')}: {last.get('cause', '-')} "
                f"{last.get('reason', '')}" + (f" — {last['message']}" if last.get("message") else ""),
            )
        )
    recovery = status.get("recovery")
    if recovery:
        lines.append(
            (
                "Recovery",
                f"{recovery.get('cause', '-')} {recovery.get('reason', '')} since "
                f"{_age(recovery.get('detectedAt'), now)} ago"
                + (f" — {recovery['message']}" if recovery.get("message") else ""),
            )
        )
    flush = status.get("lastFlushRequest")
    if flush:
        lines.append(("Last flush", _flush_text(flush, now)))
    width = max(len(k) for k, _ in lines) + 2
    for key, value in lines:
        print(f"{key + ':':<{width}}{value}")

    print("Pods:" + (f"  ({pods_note})" if pods_note else ""))
    if view:
        rows = [
            [
                str(p["name"]),
                _dash(p["attempt"]),
                _dash(p["phase"]),
                "-" if p["ready"] is None else str(p["ready"]).lower(),
                _dash(p["node"]),
                _dash(p["zone"]),
                _dash(p["exitCode"]),
            ]
            for p in view
        ]
        _print_indented(["NAME", "ATTEMPT", "PHASE", "READY", "NODE", "ZONE", "EXIT"], rows)
    else:
        print("  <none>")
    conditions = status.get("conditions") or []
    print("Conditions:")
    if conditions:
        rows = [
            [
                str(c.get("type")),
                str(c.get("status")),
                _dash(c.get("reason")),
                _age(c.get("lastTransitionTime"), now),
                str(c.get("message") or ""),
            ]
            for c in conditions
        ]
        _print_indented(["TYPE", "STATUS", "REASON", "AGE", "MESSAGE"], rows)
    else:
        print("  <none>")
    return EXIT_OK


def _print_indented(headers: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(r[i]) for r in [headers, *rows]) for i in range(len(headers) - 1)]
    for row in [headers, *rows]:
        cells = [cell.ljust(w) for cell, w in zip(row, widths, strict=False)] + [row[-1]]
        print(("  " + "  ".join(cells)).rstrip())


def _flush_text(flush: dict[str, Any], now: datetime) -> str:
    text = f"{flush.get('mode', '?')} request {flush.get('id', '?')}: {flush.get('outcome') or 'no outcome'}"
    if flush.get("step") is not None:
        text += f", step {flush['step']}"
    if flush.get("time"):
        text += f", {_age(flush.get('time'), now)} ago"
    return text


# ----------------------------------------------------------------------------------------------
# checkpoints


def cmd_checkpoints(args: argparse.Namespace) -> int:
    client, namespace = _client(args)
    with client:
        job = client.get_job(namespace, args.name)
    uri = str(((job.get("spec") or {}).get("checkpoint") or {}).get("uri") or "")
    if not uri:
        raise PluginError(f"SpotJob {namespace}/{args.name} names no spec.checkpoint.uri")
    try:
        with opened_storage(uri) as storage:
            statuses = list_checkpoints(storage)
            docs = [checkpoint_json(storage, s) for s in statuses]
    except CommandError as e:
        if "://" not in uri or uri.startswith("file://"):
            raise PluginError(
                f"{e}: the job's checkpoint URI is a path on the cluster's nodes, not on this machine "
                "(read it where it is mounted, e.g. spotjob ckpt list PATH)"
            ) from e
        raise
    except (StorageError, OwnershipError, OSError) as e:
        raise PluginError(f"cannot read the checkpoints at {uri} with this machine's credentials: {e}") from e
    except ValueError as e:  # a URI no store answers to (ManifestError is one too, but inspect keeps those)
        raise PluginError(f"SpotJob {namespace}/{args.name}: spec.checkpoint.uri {uri!r}: {e}") from e
    resume = next((s for s in statuses if s.valid), None)
    if args.output == "json":
        for doc, s in zip(docs, statuses, strict=True):
            doc["resumesFromThis"] = s is resume
        _print_json(docs)
        return EXIT_OK
    if not statuses:
        print(f"No checkpoints under {uri} yet.", file=sys.stderr)
        return EXIT_OK
    print_table(LIST_HEADERS, list_rows(statuses))
    print(file=sys.stderr)
    print(_resume_line(uri, resume), file=sys.stderr)
    return EXIT_OK


def _resume_line(uri: str, resume: CheckpointStatus | None) -> str:
    if resume is None:
        return f"None of the checkpoints under {uri} is valid: the next attempt would start from scratch."
    return f"The next attempt resumes from {resume.ref.folder} (step {resume.ref.step}), the newest valid one."


# ----------------------------------------------------------------------------------------------
# flush


def flush_request(mode: str, reason: str, now: datetime | None = None) -> dict[str, str]:
    """The annotation's JSON: a unique id, the mode, why, and when (RFC 3339, UTC)."""
    when = (now or datetime.now(UTC)).astimezone(UTC)
    return {
        "id": str(uuid.uuid4()),
        "mode": mode,
        "reason": reason,
        "requestedAt": when.strftime("%Y-%m-%dT%H:%M:%SZ"),
    }


def _annotation_id(job: dict[str, Any]) -> str | None:
    raw = ((job.get("metadata") or {}).get("annotations") or {}).get(FLUSH_REQUEST_ANNOTATION)
    try:
        value = json.loads(raw) if raw else None
    except ValueError:
        return None
    return str(value.get("id")) if isinstance(value, dict) and value.get("id") else None


def cmd_flush(args: argparse.Namespace) -> int:
    if args.timeout is not None and not args.wait:
        raise UsageError("--timeout goes with --wait")
    client, namespace = _client(args)
    with client:
        job = client.get_job(namespace, args.name)
        phase = (job.get("status") or {}).get("phase")
        if phase in _TERMINAL:
            raise PluginError(f"SpotJob {namespace}/{args.name} has {phase.lower()}: there is nothing to flush")
        mode = "checkpoint" if args.keep_running else "restart"
        reason = " ".join(args.reason.split()) or f"requested with {PROG} flush"
        request = flush_request(mode, reason)
        pending = _annotation_id(job)
        answered = ((job.get("status") or {}).get("lastFlushRequest") or {}).get("id")
        if pending is not None and pending != answered:
            print(
                f"(this replaces flush request {pending}, which the controller has not answered yet)", file=sys.stderr
            )
        patched = client.request_flush(namespace, args.name, request)
        what = (
            "flush a checkpoint and keep training" if mode == "checkpoint" else "flush a checkpoint and restart from it"
        )
        print(f"flush request {request['id']} sent to SpotJob {namespace}/{args.name}: {what}")
        if not args.wait:
            print(
                f"The controller records the outcome in status.lastFlushRequest: {PROG} status {args.name}",
                file=sys.stderr,
            )
            return EXIT_OK
        timeout = args.timeout
        if timeout is None:
            timeout = float((job.get("spec") or {}).get("flushTimeoutSeconds") or 120.0) + FLUSH_WAIT_MARGIN
        print(f"waiting up to {human_duration(timeout)} for the controller's answer...", file=sys.stderr)
        return _wait_for_flush(
            client, namespace, args.name, request["id"], str(patched["metadata"]["resourceVersion"]), timeout
        )


def _wait_for_flush(client: SpotJobClient, namespace: str, name: str, wanted: str, since: str, timeout: float) -> int:
    """Follow the job until ``status.lastFlushRequest`` answers ``wanted`` (or a request that replaced it)
    with an outcome: the controller first records the request it took as ``InProgress`` (a restart
    flushes, stops and starts the gang before it commits), which is not an answer yet."""
    waiting = {wanted}
    taken: set[str] = set()
    for job in client.follow_job(namespace, name, since, timeout):
        answer = (job.get("status") or {}).get("lastFlushRequest") or {}
        rid = answer.get("id")
        if rid in waiting and answer.get("outcome") == "InProgress":
            if rid not in taken:
                taken.add(rid)
                print(f"the controller took request {rid}: {answer.get('message') or 'in progress'}", file=sys.stderr)
        elif rid in waiting:
            return _report_flush(answer, wanted)
        current = _annotation_id(job)
        if current is not None and current not in waiting:
            # Another flush request replaced ours before the controller read it: it answers that one.
            print(
                f"request {wanted} was replaced by another flush request, {current}: waiting for that one",
                file=sys.stderr,
            )
            waiting.add(current)
        phase = (job.get("status") or {}).get("phase")
        if phase in _TERMINAL:
            raise PluginError(
                f"SpotJob {namespace}/{name} {phase.lower()} before the controller answered the flush request"
            )
    raise PluginError(
        f"no answer to flush request {wanted} within {human_duration(timeout)}: is spotjob-controller running and "
        f"serving namespace {namespace}? ({PROG} events {name} shows what it did)"
    )


def _report_flush(answer: dict[str, Any], wanted: str) -> int:
    """Print the controller's answer; exit 0 when it committed a checkpoint, 1 when not."""
    outcome = answer.get("outcome") or "no outcome given"
    step = answer.get("step")
    head = f"flush ({answer['mode']})" if answer.get("mode") else "flush"
    if answer.get("id") != wanted:
        head += f", request {answer.get('id')} (which replaced yours)"
    if step is not None:
        print(f"{head}: {outcome}, step {step} committed")
        return EXIT_OK
    print(f"{head}: {outcome}; no checkpoint was committed")
    return EXIT_FAILED


# ----------------------------------------------------------------------------------------------
# events


def event_json(e: JobEvent) -> dict[str, Any]:
    return {
        "type": e.type,
        "reason": e.reason,
        "note": e.note,
        "count": e.count,
        "firstTime": e.first.isoformat() if e.first else None,
        "lastTime": e.last.isoformat() if e.last else None,
        "reporter": e.reporter or None,
        "related": e.related or None,
    }


def cmd_events(args: argparse.Namespace) -> int:
    client, namespace = _client(args)
    with client:
        job = client.get_job(namespace, args.name)
        events = client.job_events(job)
    if args.output == "json":
        _print_json([event_json(e) for e in events])
        return EXIT_OK
    if not events:
        print(f"No events for SpotJob {namespace}/{args.name}.", file=sys.stderr)
        return EXIT_OK
    now = datetime.now(UTC)
    rows = []
    for e in events:
        count = str(e.count)
        if e.count > 1 and e.first is not None:
            count += f" over {_age(e.first, now)}"
        rows.append([_age(e.last, now), e.type, e.reason, count, e.note])
    print_table(["LAST SEEN", "TYPE", "REASON", "COUNT", "NOTE"], rows)
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
