"""``kubectl spotjob checkpoints``, ``flush`` and ``events`` (what each does for the user:
``orchestrator.kubectl_plugin``).

``checkpoints`` reads storage with the user's own cloud credentials and judges each checkpoint as
a restore would (``agent.catalog``); ``flush`` writes the request annotation and, with ``--wait``,
follows ``status.lastFlushRequest``; ``events`` lists the job's Events.
"""

from __future__ import annotations

import argparse
import re
import sys
import uuid
from datetime import UTC, datetime
from typing import Any

from agent.catalog import CheckpointStatus, list_checkpoints
from agent.control_channel import ENV_START_FRESH
from agent.ownership import OwnershipError
from agent.storage import StorageError, parse_uri
from orchestrator.ckpt_common import CommandError
from orchestrator.ckpt_output import LIST_HEADERS, checkpoint_json, list_rows, print_table, shown
from orchestrator.ckpt_select import opened_storage
from orchestrator.k8s.plugin_client import FLUSH_REQUEST_ANNOTATION, JobEvent, PluginError, SpotJobClient
from orchestrator.kubectl_common import (
    EXIT_FAILED,
    EXIT_OK,
    FLUSH_WAIT_MARGIN,
    PROG,
    TERMINAL_PHASES,
    UsageError,
    age,
    connect,
    human_duration,
    plugin_command,
    print_json,
)
from orchestrator.model import flush_request_id

# ----------------------------------------------------------------------------------------------
# checkpoints


def cmd_checkpoints(args: argparse.Namespace) -> int:
    client, namespace = connect(args)
    with client:
        job = client.get_job(namespace, args.name)
    uri = str(((job.get("spec") or {}).get("checkpoint") or {}).get("uri") or "")
    if not uri:
        raise PluginError(f"SpotJob {namespace}/{args.name} names no spec.checkpoint.uri")
    try:
        parse_uri(uri)
    except ValueError as e:  # a URI no store answers to
        raise PluginError(f"SpotJob {namespace}/{args.name}: spec.checkpoint.uri {uri!r}: {e}") from e
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
    except ValueError as e:
        # The URI parsed: a setting of this machine's that the store's client cannot use (an endpoint
        # variable without its scheme, or ending in '/'). ManifestError is a ValueError too, but
        # inspect keeps those as a checkpoint's reason.
        raise PluginError(f"cannot open the store of {uri} on this machine: {e}") from e
    resume = _restore_walk(statuses)
    if args.output == "json":
        for doc, s in zip(docs, statuses, strict=True):
            doc["resumesFromThis"] = s is resume and s.valid
        print_json(docs)
        return EXIT_OK
    if not statuses:
        print(f"No checkpoints under {uri} yet.", file=sys.stderr)
        return EXIT_OK
    print_table(LIST_HEADERS, list_rows(statuses))
    print(file=sys.stderr)
    print(_resume_line(uri, resume, statuses), file=sys.stderr)
    return EXIT_OK


def _restore_walk(statuses: list[CheckpointStatus]) -> CheckpointStatus | None:
    """Where a restore's walk, newest first, ends (``agent.checkpoint``'s ``restore``): it passes
    over what a fresh start retired and what is invalid, and stops at the first valid checkpoint,
    or at one a newer spotjob wrote (it never goes back in time past that one); None when it
    reaches the end."""
    for s in statuses:
        if s.retired:
            continue
        if s.valid or s.newer_format:
            return s
    return None


def _resume_line(uri: str, stop: CheckpointStatus | None, statuses: list[CheckpointStatus]) -> str:
    if stop is not None and stop.valid:
        return f"The next attempt resumes from {stop.ref.folder} (step {stop.ref.step}), the newest valid one."
    if stop is not None:
        return (
            f"The next attempt does not go back to an older checkpoint: {stop.ref.folder} (step {stop.ref.step}) "
            f"was written by a newer spotjob than this one ({' '.join(stop.reason.split())}). The job's restore "
            "loads it if the job runs that spotjob or a later one, and refuses otherwise: upgrade spotjob where "
            "the job runs."
        )
    # A restore starts from step 0 only where no committed checkpoint of the job's own is there:
    # over one it cannot load, it refuses rather than train again from scratch.
    own = [s for s in statuses if s.committed and not (s.retired or s.foreign or s.fenced)]
    if own:
        return (
            f"None of the checkpoints under {uri} is valid, and {len(own)} of them are the job's own committed "
            "ones: the next attempt's restore refuses to start from scratch over them (set "
            f"{ENV_START_FRESH}=1 in the job's env to start from step 0 on purpose; they are kept, set aside)."
        )
    return f"None of the checkpoints under {uri} is valid: the next attempt would start from scratch."


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
    """The id under which the controller handles the job's flush-request annotation (``invalid-...``
    for one that does not parse, as ``status.lastFlushRequest`` then names it); None without one."""
    raw = ((job.get("metadata") or {}).get("annotations") or {}).get(FLUSH_REQUEST_ANNOTATION)
    return flush_request_id(str(raw)) if raw else None


def _handled(job: dict[str, Any], rid: str) -> bool:
    """Whether the controller has handled the request ``rid``: its last one, or one before it."""
    last = (job.get("status") or {}).get("lastFlushRequest") or {}
    return rid == last.get("id") or rid in (last.get("earlierIds") or ())


def cmd_flush(args: argparse.Namespace) -> int:
    if args.timeout is not None and not args.wait:
        raise UsageError("--timeout goes with --wait")
    client, namespace = connect(args)
    with client:
        job = client.get_job(namespace, args.name)
        phase = (job.get("status") or {}).get("phase")
        if phase in TERMINAL_PHASES:
            raise PluginError(f"SpotJob {namespace}/{args.name} has {phase.lower()}: there is nothing to flush")
        mode = "checkpoint" if args.keep_running else "restart"
        reason = " ".join(args.reason.split()) or f"requested with {PROG} flush"
        request = flush_request(mode, reason)
        pending = _annotation_id(job)
        if pending is not None and not _handled(job, pending):
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
                "The controller records the outcome in status.lastFlushRequest: "
                + plugin_command("status", args.name, namespace),
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
                said = shown(str(answer.get("message") or "in progress"))  # the status is not only the controller's
                print(f"the controller took request {shown(str(rid))}: {said}", file=sys.stderr)
        elif rid in waiting:
            return _report_flush(answer, wanted)
        current = _annotation_id(job)
        if current is not None and current not in waiting and not taken:
            # Another flush request replaced ours before the controller read it: it answers that one.
            # (Once the controller took ours, a later request is answered after it, not instead.)
            print(
                f"request {wanted} was replaced by another flush request, {shown(current)}: waiting for that one",
                file=sys.stderr,
            )
            waiting.add(current)
        phase = (job.get("status") or {}).get("phase")
        if phase in TERMINAL_PHASES:
            raise PluginError(
                f"SpotJob {namespace}/{name} {phase.lower()} before the controller answered the flush request"
            )
    raise PluginError(
        f"no answer to flush request {wanted} within {human_duration(timeout)}: is spotjob-controller running and "
        f"serving namespace {namespace}? ({plugin_command('events', name, namespace)} shows what it did)"
    )


_REQUEST_PREFIX = re.compile(r"^flush request \S+ \(\w+\): ")


def _report_flush(answer: dict[str, Any], wanted: str) -> int:
    """Print the controller's answer; exit 0 when it committed a checkpoint, 1 when not."""
    outcome = shown(str(answer.get("outcome") or "no outcome given"))
    step = answer.get("step")
    head = f"flush ({answer['mode']})" if answer.get("mode") else "flush"
    if answer.get("id") != wanted:
        head += f", request {shown(str(answer.get('id')))} (which replaced yours)"
    if step is not None:
        print(f"{head}: {outcome}, step {step} committed")
        return EXIT_OK
    # Why not (the job was not Running, the flush timed out, the gang stopped first), as the
    # controller recorded it, less the "flush request <id> (<mode>): " its messages start with.
    why = _REQUEST_PREFIX.sub("", str(answer.get("message") or ""), count=1)
    print(f"{head}: {outcome}; no checkpoint was committed" + (f" ({shown(why)})" if why else ""))
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
    client, namespace = connect(args)
    with client:
        job = client.get_job(namespace, args.name)
        events = client.job_events(job)
    if args.output == "json":
        print_json([event_json(e) for e in events])
        return EXIT_OK
    if not events:
        print(f"No events for SpotJob {namespace}/{args.name}.", file=sys.stderr)
        return EXIT_OK
    now = datetime.now(UTC)
    rows = []
    for e in events:
        count = str(e.count)
        if e.count > 1 and e.first is not None:
            count += f" over {age(e.first, now)}"
        rows.append([age(e.last, now), e.type, e.reason, count, e.note])
    print_table(["LAST SEEN", "TYPE", "REASON", "COUNT", "NOTE"], rows)
    return EXIT_OK
