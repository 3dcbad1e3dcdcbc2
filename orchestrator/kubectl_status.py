"""``kubectl spotjob status``: a table of jobs, or one job in detail.

The table: phase, committed step and its age, counters, goodput, capacity and HELD-FLUSH (when
the next flush of a held cloud notice starts) where any job has them, and age; ``-o wide`` adds
the attempt, the reason and why a worker does not start, as ``kubectl get sj -o wide`` does.

One job's detail: its phase and why, step and checkpoint age, preemptions, restarts of
maxRestarts, goodput, capacity, the cloud notices its agents hold (``status.heldNotices``: when
each flush starts), its pods and their nodes, zones and phases, the last restart's reason, the last
flush request, what to do next for a Failed job (``next_step``), and its conditions. Status is
read as raw JSON, not through the model: an older plugin must still show what a newer controller
writes.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from datetime import UTC, datetime
from typing import Any

from orchestrator.ckpt_output import print_table, shown
from orchestrator.held_notices import held_cell, held_notices, held_text
from orchestrator.k8s.plugin_client import AccessDenied, SpotJobClient
from orchestrator.k8s.pods import training_container_status
from orchestrator.kubectl_common import (
    EXIT_OK,
    UsageError,
    age,
    age_seconds,
    connect,
    dash,
    percent,
    print_json,
)
from orchestrator.model import Phase, parse_timestamp

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
        "checkpointAgeSeconds": age_seconds((checkpoint or {}).get("time"), now),
        "preemptions": status.get("preemptions", 0) if status else None,
        "restarts": status.get("restarts", 0) if status else None,
        "maxRestarts": spec.get("maxRestarts"),
        "goodput": status.get("goodput"),
        "capacity": status.get("capacity"),
        "attempt": (status.get("attempt") or {}).get("number") if status else None,
        "heldNotices": held_notices(status),
        "creationTimestamp": meta.get("creationTimestamp"),
        "ageSeconds": age_seconds(meta.get("creationTimestamp"), now),
    }


def next_step(job: dict[str, Any]) -> str | None:
    """What to do about a Failed job, by its reason, with the commands; None for any other job.

    A Failed job is over: a changed spec runs nothing (``SpecChangeIgnored``). Deleted and created
    again under its name, it is the same job to its storage (the owner of its checkpoint URI is
    ``<namespace>/<name>``), so it resumes from the newest checkpoint there and its attempt numbers
    go on past the last one recorded."""
    meta, status = job.get("metadata") or {}, job.get("status") or {}
    if status.get("phase") != Phase.FAILED:
        return None
    name, namespace = shlex.quote(str(meta.get("name"))), shlex.quote(str(meta.get("namespace")))
    again = (
        f"then delete the SpotJob and create it again under its name (`kubectl delete spotjob {name} -n {namespace}`, "
        "then `kubectl apply -f` your manifest)"
    )
    checkpoint = status.get("lastCheckpoint") or {}
    step = checkpoint.get("step")
    resumes = (
        f": it resumes from step {step}, the newest checkpoint ({checkpoint.get('uri')})"
        if isinstance(step, int)
        else ": nothing was committed, so it starts from scratch"
    )
    reason = status.get("reason")
    if reason == "RestartBudgetExhausted":
        return (
            f"fix the code (the worker's last words are in the Phase line, `kubectl spotjob events {name} -n "
            f"{namespace}` and the pod's `kubectl logs`), {again}{resumes}"
        )
    if reason in ("InvalidCheckpointURI", "StorageRefused"):
        return f"fix spec.checkpoint.uri, the bucket or the job's credentials, as the Phase line says, {again}"
    if reason == "CheckpointURIOwned":
        return f"give the job a checkpoint URI of its own, or hand this one over as the Phase line says, {again}"
    return f"the Phase line says why; {again}"


def _restarts_text(summary: dict[str, Any]) -> str:
    if summary["restarts"] is None:
        return "-"
    limit = summary["maxRestarts"]
    return f"{summary['restarts']}/{limit}" if limit is not None else str(summary["restarts"])


def cmd_status(args: argparse.Namespace) -> int:
    if args.name and args.all_namespaces:
        raise UsageError("a NAME and -A/--all-namespaces do not go together: name a job, or list them all")
    client, namespace = connect(args)
    with client:
        if args.name:
            return _status_one(client, namespace, args.name, args.output)
        jobs = client.list_jobs(None if args.all_namespaces else namespace)
    now = datetime.now(UTC)
    summaries = [job_summary(j, now) for j in jobs]
    if args.output == "json":
        print_json(summaries)
        return EXIT_OK
    if not summaries:
        where = "any namespace" if args.all_namespaces else f'namespace "{namespace}"'
        print(f"No SpotJobs in {where}.", file=sys.stderr)
        return EXIT_OK
    with_capacity = any(s["capacity"] for s in summaries)
    with_held = any(s["heldNotices"] for s in summaries)
    headers = ["NAME", "PHASE", "STEP", "CHECKPOINT", "PREEMPTIONS", "RESTARTS", "GOODPUT"]
    headers += ["CAPACITY"] if with_capacity else []
    headers += ["HELD-FLUSH"] if with_held else []
    headers += ["AGE"]
    wide = args.output == "wide"
    headers += ["ATTEMPT", "REASON", "NOT-STARTING"] if wide else []  # kubectl get sj -o wide's
    if args.all_namespaces:
        headers.insert(0, "NAMESPACE")
    rows = []
    for s, job in zip(summaries, jobs, strict=True):
        row = [
            s["name"],
            dash(s["phase"]) if job.get("status") else "<no status>",
            dash(s["step"]),
            age((s["lastCheckpoint"] or {}).get("time"), now),
            dash(s["preemptions"]),
            _restarts_text(s),
            percent(s["goodput"]),
        ]
        row += [dash(s["capacity"])] if with_capacity else []
        row += [held_cell(s["heldNotices"], now)] if with_held else []
        row += [age(s["creationTimestamp"], now)]
        if wide:
            stuck = ((job.get("status") or {}).get("attempt") or {}).get("notStarting") or {}
            row += [dash(s["attempt"]), dash(s["reason"]), dash(stuck.get("reason"))]
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
    """The training container's readiness (its agent's /readyz: the ranks train), not the pod's: a
    pod with a helper container that finished is never Ready, yet its worker trains."""
    return training_container_status(pod).get("ready") is True


def _pod_exit_code(pod: dict[str, Any]) -> int | None:
    """The agent's exit code, not a sidecar's or a helper's (the kubelet lists containers by name)."""
    code = ((training_container_status(pod).get("state") or {}).get("terminated") or {}).get("exitCode")
    return code if isinstance(code, int) else None


def _attempt_label(meta: dict[str, Any]) -> int | None:
    """The pod's attempt (its ``spotjob.dev/attempt`` label) as the number the status says."""
    label = str((meta.get("labels") or {}).get("spotjob.dev/attempt") or "")
    return int(label) if label.isdigit() else None


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
                "attempt": _attempt_label(meta),
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
            heldNotices=held_notices(status),
            recovery=status.get("recovery"),
            lostSteps=status.get("lostSteps"),
            generation=meta.get("generation"),
            observedGeneration=status.get("observedGeneration"),
            checkpointUri=(spec.get("checkpoint") or {}).get("uri"),
            next=next_step(job),
        )
        print_json(summary)
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
        if running:
            # A finished job's attempt ran until the job ended, not until now.
            ended = parse_timestamp(status.get("completionTime"))
            text += f", ran for {age(running, ended)}" if ended else f", running for {age(running, now)}"
        if not attempt.get("startedAt") and not running:
            # Refused before its first start (InvalidSpec), or waiting for it: nothing ran, so it
            # neither resumed nor started from scratch.
            over = status.get("phase") in (Phase.SUCCEEDED, Phase.FAILED)
            text += ", never started" if over else ", not started yet"
        else:
            text += f", resumed from step {resumed}" if resumed is not None else ", started from scratch"
        lines.append(("Attempt", text))
        stuck = attempt.get("notStarting")
        if isinstance(stuck, dict):
            said = ": ".join(str(x) for x in (stuck.get("reason"), stuck.get("message")) if x)
            lines.append(("Not starting", f"{stuck.get('worker')}, for {age(stuck.get('since'), now)}: {said}"))
    step = summary["trainingStep"]
    lines.append(("Step", "-" if step is None else f"{step} (the agents' last report)"))
    ckpt = status.get("lastCheckpoint")
    lines.append(
        (
            "Checkpoint",
            f"step {ckpt.get('step')}, {age(ckpt.get('time'), now)} ago ({ckpt.get('uri')})"
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
            (
                "Goodput",
                percent(status.get("goodput"))
                + (f" ({lost} step(s) lost to preemptions and to checkpoints that did not load)" if lost else ""),
            )
        )
        if status.get("capacity"):
            lines.append(("Capacity", str(status["capacity"])))
    if history:
        last = history[-1]
        lines.append(
            (
                "Last restart",
                f"{age(last.get('time'), now)} ago, attempt {last.get('attempt')}: {last.get('cause', '-')} "
                f"{last.get('reason', '')}" + (f" — {last['message']}" if last.get("message") else ""),
            )
        )
    lines += [("Held notice", held_text(h, now)) for h in held_notices(status)]
    recovery = status.get("recovery")
    if recovery:
        lines.append(
            (
                "Recovery",
                f"{recovery.get('cause', '-')} {recovery.get('reason', '')} since "
                f"{age(recovery.get('detectedAt'), now)} ago"
                + (f" — {recovery['message']}" if recovery.get("message") else ""),
            )
        )
    flush = status.get("lastFlushRequest")
    if flush:
        lines.append(("Last flush", _flush_text(flush, now)))
    advice = next_step(job)
    if advice:
        lines.append(("Next", advice))
    width = max(len(k) for k, _ in lines) + 2
    for key, value in lines:
        # Messages come from pods, agents and stores: escaped, as print_table does.
        print(f"{key + ':':<{width}}{shown(value)}")

    print("Pods:" + (f"  ({pods_note})" if pods_note else ""))
    if view:
        rows = [
            [
                str(p["name"]),
                dash(p["attempt"]),
                dash(p["phase"]),
                "-" if p["ready"] is None else str(p["ready"]).lower(),
                dash(p["node"]),
                dash(p["zone"]),
                dash(p["exitCode"]),
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
                dash(c.get("reason")),
                age(c.get("lastTransitionTime"), now),
                str(c.get("message") or ""),
            ]
            for c in conditions
        ]
        _print_indented(["TYPE", "STATUS", "REASON", "AGE", "MESSAGE"], rows)
    else:
        print("  <none>")
    return EXIT_OK


def _print_indented(headers: list[str], rows: list[list[str]]) -> None:
    rows = [[shown(cell) for cell in row] for row in rows]
    widths = [max(len(r[i]) for r in [headers, *rows]) for i in range(len(headers) - 1)]
    for row in [headers, *rows]:
        cells = [cell.ljust(w) for cell, w in zip(row, widths, strict=False)] + [row[-1]]
        print(("  " + "  ".join(cells)).rstrip())


def _flush_text(flush: dict[str, Any], now: datetime) -> str:
    text = f"{flush.get('mode', '?')} request {flush.get('id', '?')}: {flush.get('outcome') or 'no outcome'}"
    if flush.get("step") is not None:
        text += f", step {flush['step']}"
    if flush.get("time"):
        text += f", {age(flush.get('time'), now)} ago"
    return text
