"""``kubectl spotjob`` against a real ``spotjob-controller``: the real kubectl binary finds
``kubectl-spotjob`` on PATH (tests/k8s_plugin/plugin_support.py runs it as there, under a user
identity of its own) and asks the controller, through the annotation, to flush a training job.
``flush --keep-running --wait`` exits 0 with the step the agents' early save committed, the job
trains on, and storage holds that step's early save, valid; ``flush --wait`` (restart) exits 0
with the flush's step and the job restarts from it, nothing counted. ``checkpoints`` (storage),
``status`` and ``events`` show what the controller and the agents wrote. The plugin's calls stay
within ``PLUGIN_PERMISSIONS``.

The job is small and short-lived (one rank, no periodic saves: every commit here is a flush's);
it is deleted at the end rather than trained to completion.

A job whose code used up its restarts is started again as ``status``'s ``Next:`` line says (delete,
apply under its name) and resumes from the step the line names.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from e2e_support import REPO, Controller, create_job, job_pods, spotjob_body, status, wait, wait_phase

from agent.catalog import list_checkpoints
from agent.storage import open_storage
from orchestrator.k8s.plugin_client import PLUGIN_PERMISSIONS
from tests.k8s.cluster import TestCluster

sys.path.insert(0, str(REPO / "tests" / "k8s_plugin"))
from plugin_support import USER, run_kubectl_spotjob

pytestmark = pytest.mark.slow

NAME = "train"


def ok(proc: subprocess.CompletedProcess[str]) -> str:
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return proc.stdout


def flushed(out: str, mode: str) -> tuple[str, int]:
    """The request id ``flush`` sent and the step it reports committed."""
    sent = re.search(rf"flush request (\S+) sent to SpotJob \S+/{NAME}", out)
    done = re.search(rf"^flush \({mode}\): Committed, step (\d+) committed$", out, re.M)
    assert sent and done, out
    return sent.group(1), int(done.group(1))


def test_kubectl_spotjob_flush_wait_asks_the_real_controller_in_both_modes_and_status_and_events_show_it(
    cluster: TestCluster,
    namespace: str,
    start_controller: Callable[..., Controller],
    tmp_path: Path,
) -> None:
    # A person of their own on the test API server, so the audit log tells their requests apart.
    kubeconfig = cluster.kubeconfig_for(USER) if cluster.on_test_server else cluster.kubeconfig
    mark = cluster.audit_mark() if cluster.on_test_server else 0

    def kubectl_spotjob(*args: str) -> subprocess.CompletedProcess[str]:
        return run_kubectl_spotjob(cluster, kubeconfig, *args, "-n", namespace)

    cluster.add_node(f"{namespace}-a")
    start_controller(namespace)
    uri = str(tmp_path / "ckpt")
    body = spotjob_body(
        NAME, namespace, uri=uri, dump_dir=tmp_path, steps=400, step_sleep=0.1, nproc=1, every_steps=100_000
    )
    create_job(cluster, body)
    wait_phase(cluster, namespace, NAME, "Running")

    # checkpoint: the agents' early save commits, the job trains on in the same attempt.
    out = ok(kubectl_spotjob("flush", NAME, "--keep-running", "--reason", "before the eval", "--wait"))
    ckpt_id, ckpt_step = flushed(out, "checkpoint")
    s = status(cluster, namespace, NAME)
    assert (s["phase"], s["attempt"]["number"]) == ("Running", 0), s
    last = s["lastFlushRequest"]
    assert (last["id"], last["mode"], last["outcome"], last["step"]) == (ckpt_id, "checkpoint", "Committed", ckpt_step)
    (early,) = [c for c in list_checkpoints(open_storage(uri)) if c.ref.step == ckpt_step]
    assert early.valid and early.manifest is not None and early.manifest.trigger == "early", early

    # restart: every agent flushes at one step, the gang restarts from it; nothing is counted.
    out = ok(kubectl_spotjob("flush", NAME, "--reason", "new data mix", "--wait"))
    restart_id, restart_step = flushed(out, "restart")
    assert restart_step > ckpt_step
    s = wait_phase(cluster, namespace, NAME, "Running")
    assert (s["attempt"]["number"], s["attempt"]["resumedFromStep"]) == (1, restart_step), s
    assert (s["preemptions"], s["restarts"]) == (0, 0), s
    assert [(h["cause"], h["reason"]) for h in s["restartHistory"]] == [("Requested", "FlushRequestedByUser")]
    last = s["lastFlushRequest"]
    assert (last["id"], last["mode"], last["outcome"], last["step"]) == (
        restart_id,
        "restart",
        "Committed",
        restart_step,
    )

    # What the user sees of it.
    listed = {doc["step"]: doc for doc in json.loads(ok(kubectl_spotjob("checkpoints", NAME, "-o", "json")))}
    assert listed[ckpt_step]["valid"] and listed[restart_step]["valid"], listed
    assert listed[restart_step]["resumesFromThis"], listed
    fields = {
        k: v.strip()
        for k, v in (ln.split(":", 1) for ln in ok(kubectl_spotjob("status", NAME)).splitlines() if ":" in ln)
    }
    assert fields["Phase"].startswith("Running"), fields
    assert fields["Attempt"].startswith("1, ") and f"resumed from step {restart_step}" in fields["Attempt"], fields
    assert fields["Restarts"].startswith("0 of 2") and fields["Preemptions"] == "0", fields
    assert "Requested FlushRequestedByUser" in fields["Last restart"], fields
    assert fields["Last flush"].startswith(f"restart request {restart_id}: Committed, step {restart_step}"), fields

    def events() -> list[dict[str, Any]] | None:
        """The job's Events once the last one of the restart is among them (the controller
        writes Events off its reconcile thread: they may trail the status by a moment)."""
        docs: list[dict[str, Any]] = json.loads(ok(kubectl_spotjob("events", NAME, "-o", "json")))
        return docs if any(restart_id in e["note"] and e["reason"] == "FlushRequestCommitted" for e in docs) else None

    listed_events = wait(events, "kubectl spotjob events to show the restart request committed")
    reasons = [e["reason"] for e in listed_events]
    for reason in ("CheckpointRequestedByUser", "FlushRequestedByUser", "FlushRequested", "FlushCommitted"):
        assert reason in reasons, reasons
    committed = [e["note"] for e in listed_events if e["reason"] == "FlushRequestCommitted"]
    assert any(ckpt_id in n and f"step {ckpt_step} committed" in n for n in committed), committed
    assert any(restart_id in n and f"step {restart_step} committed" in n for n in committed), committed
    table = ok(kubectl_spotjob("events", NAME))
    assert table.splitlines()[0].split()[:3] == ["LAST", "SEEN", "TYPE"] and "FlushRequestCommitted" in table, table

    # Everything the plugin sent was one of the calls its Role grants.
    if cluster.on_test_server:
        records = cluster.audit_log(mark)
        called = {(r.api_group, r.resource_path, r.verb) for r in records if r.user == USER and r.resource}
        assert ("spotjob.dev", "spotjobs", "patch") in called, called
        assert called <= {(p.group, p.resource, p.verb) for p in PLUGIN_PERMISSIONS}, called

    # Done: the job and its pods go (its processes with them).
    cluster.kubectl("delete", "sj", NAME, "-n", namespace)
    wait(lambda: not job_pods(cluster, namespace, NAME), "the job's pods to be deleted")


def test_a_job_whose_code_used_up_its_restarts_starts_again_as_status_says_and_resumes_from_its_checkpoint(
    cluster: TestCluster,
    namespace: str,
    start_controller: Callable[..., Controller],
    tmp_path: Path,
) -> None:
    """The code fails at step 12 after step 10's checkpoint, with no restart to spend: the job
    Fails (RestartBudgetExhausted) and a changed spec would run nothing. ``kubectl spotjob status``
    says what to do; done as it says (the commands taken from its ``Next:`` line, through the real
    kubectl), the job under its old name resumes from the step the line names and ends."""
    cluster.add_node(f"{namespace}-a")
    start_controller(namespace)
    uri = str(tmp_path / "ckpt")

    def body(*extra: str) -> str:
        doc = spotjob_body(
            NAME, namespace, uri=uri, dump_dir=tmp_path, steps=15, step_sleep=0.05, nproc=1, every_steps=5,
            extra_args=list(extra),
        )  # fmt: skip
        doc["spec"]["maxRestarts"] = 0
        return json.dumps(doc)

    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=body("--crash-at-step", "12"))
    failed = wait_phase(cluster, namespace, NAME, "Failed")
    assert failed["reason"] == "RestartBudgetExhausted", failed
    step = (failed.get("lastCheckpoint") or {}).get("step")
    assert isinstance(step, int) and step in (5, 10), failed  # 10's save may still be in flight at the crash

    [line] = [
        ln
        for ln in ok(run_kubectl_spotjob(cluster, cluster.kubeconfig, "status", NAME, "-n", namespace)).splitlines()
        if ln.startswith("Next:")
    ]
    assert f"it resumes from step {step}, the newest checkpoint" in line, line
    commands = re.findall(r"`([^`]+)`", line)
    delete = next(c for c in commands if c.startswith("kubectl delete"))
    apply = next(c for c in commands if c.startswith("kubectl apply"))
    assert shlex.split(delete) == ["kubectl", "delete", "spotjob", NAME, "-n", namespace], delete
    cluster.kubectl(*shlex.split(delete)[1:])
    cluster.kubectl(*shlex.split(apply)[1:], "-", "-n", namespace, input=body())  # the code fixed

    done = wait_phase(cluster, namespace, NAME, "Succeeded", "Failed")
    assert done["phase"] == "Succeeded", done
    assert done["attempt"]["resumedFromStep"] == step, done["attempt"]
    assert done["lastCheckpoint"]["step"] == 15, done
    assert done["restarts"] == 0, done
