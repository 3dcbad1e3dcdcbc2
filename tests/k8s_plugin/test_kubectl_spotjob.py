"""``kubectl spotjob`` as a user runs it: the real kubectl binary finds ``kubectl-spotjob`` on PATH and
runs it against the test API server with the user's kubeconfig; each test checks what it prints,
its exit code and, for a flush, the request the API server received (the audit log). Tests of what
a command prints given a cluster state run the plugin's ``main`` in this process (``spotjob``),
against the same server with the same kubeconfig.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml
from plugin_support import (
    USER,
    ago,
    answer_flush_requests,
    create_job,
    create_pod,
    flush_annotation,
    jobs_path,
    rfc3339,
    running_status,
    set_status,
    wait_pod_running,
    write_event,
)

from agent.ownership import claim
from agent.storage import open_storage
from orchestrator import kubectl_plugin
from orchestrator.model import invalid_flush_request_id
from tests.k8s.cluster import Fault, TestCluster
from tests.unit.fakes import commit_checkpoint

Run = Callable[..., subprocess.CompletedProcess[str]]


def rows(table: str) -> dict[str, list[str]]:
    """A printed table as {first cell: cells}; the header row is keyed by its first column's name."""
    return {line.split()[0]: line.split() for line in table.splitlines() if line.strip()}


def ok(proc: subprocess.CompletedProcess[str]) -> str:
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return proc.stdout


def flush_wait_answered(
    cluster: TestCluster,
    namespace: str,
    kubectl_spotjob: Run,
    name: str,
    answer: dict[str, Any],
    *,
    timeout: str = "90s",
    **answering: Any,
) -> subprocess.CompletedProcess[str]:
    """``kubectl spotjob flush NAME --wait`` on a running job ``name`` while a stand-in for the
    controller answers its request with ``answer`` (``answer_flush_requests``, with ``answering``)."""
    create_job(cluster, namespace, name)
    set_status(cluster, namespace, name, running_status())
    stop = threading.Event()
    controller = threading.Thread(
        target=answer_flush_requests, args=(cluster, namespace, name, answer), kwargs={"stop": stop, **answering}
    )
    controller.start()
    try:
        return kubectl_spotjob("flush", name, "-n", namespace, "--wait", "--timeout", timeout)
    finally:
        stop.set()
        controller.join()


# -- status ---------------------------------------------------------------------------------------


def test_status_lists_the_namespaces_jobs_with_phase_step_checkpoint_age_counters_and_goodput(
    cluster: TestCluster, namespace: str, spotjob: Run
) -> None:
    create_job(cluster, namespace, "train-demo")
    set_status(cluster, namespace, "train-demo", running_status(step=1400, checkpoint_age=41, preemptions=1))
    create_job(cluster, namespace, "fresh", max_restarts=5)  # no controller has written a status yet

    table = rows(ok(spotjob("status", "-n", namespace)))

    assert table["NAME"] == ["NAME", "PHASE", "STEP", "CHECKPOINT", "PREEMPTIONS", "RESTARTS", "GOODPUT", "AGE"]
    _, phase, step, age, preemptions, restarts, goodput, _ = table["train-demo"]
    assert (phase, step, preemptions, restarts, goodput) == ("Running", "1400", "1", "0/3", "98.1%")
    assert re.fullmatch(r"4\ds", age), age  # 41s, a second or two later
    assert table["fresh"][1:3] == ["<no", "status>"]


@pytest.mark.parametrize("output", [[], ["-o", "json"]])
def test_a_reader_that_left_the_pipe_is_no_error(
    cluster: TestCluster, namespace: str, kubectl_spotjob: Run, output: list[str]
) -> None:
    """`kubectl spotjob status | head -1`: the reader may close the pipe before the output is
    written; that is exit 141 (as a shell pipeline's writer) and nothing on stderr, not a traceback."""
    create_job(cluster, namespace, "piped")
    set_status(cluster, namespace, "piped", running_status(step=7))
    read_end, write_end = os.pipe()
    os.close(read_end)  # every write now fails with EPIPE, as once `head` has left
    try:
        proc = kubectl_spotjob("status", "-n", namespace, *output, stdout=write_end)
    finally:
        os.close(write_end)
    assert proc.returncode == 128 + 13 and proc.stderr == "", proc.stderr


def test_status_in_every_namespace_adds_the_namespace_and_the_capacity_column(
    cluster: TestCluster, namespace: str, spotjob: Run
) -> None:
    create_job(cluster, namespace, "on-fallback")
    set_status(cluster, namespace, "on-fallback", running_status(capacity="fallback"))

    out = ok(spotjob("status", "-A"))

    header, *lines = [ln.split() for ln in out.splitlines()]
    assert header[0] == "NAMESPACE" and "CAPACITY" in header
    row = next(ln for ln in lines if ln[:2] == [namespace, "on-fallback"])
    assert row[header.index("CAPACITY")] == "fallback"


def test_status_lists_when_each_job_holding_a_notice_flushes_and_nothing_more_for_the_others(
    cluster: TestCluster, namespace: str, spotjob: Run
) -> None:
    """Two workers of one job hold a GCE maintenance notice each, the later one listed first (an
    older controller wrote them in the workers' order); another job holds none. Before, the table
    of jobs said nothing of held notices: only ``status NAME`` did, one job at a time. Now a
    HELD-FLUSH column says when the next flush starts and how many more are held, blank for a job
    holding none, and ``-o json`` carries each job's ``heldNotices``. A namespace where no job
    holds one shows no such column (pinned: that worked before)."""
    now = datetime.now(UTC)

    def held(worker: str, flush_in: float) -> dict[str, Any]:
        return {
            "worker": worker,
            "node": f"vm-{worker}",
            "source": "gcp",
            "kind": "maintenance",
            "detail": "MIGRATE_ON_HOST_MAINTENANCE",
            "deadline": rfc3339(now + timedelta(seconds=flush_in + 300)),
            "flushAt": rfc3339(now + timedelta(seconds=flush_in)),
            "heardAt": ago(5),
        }

    create_job(cluster, namespace, "plain")
    set_status(cluster, namespace, "plain", running_status())
    assert "HELD" not in ok(spotjob("status", "-n", namespace)).splitlines()[0]
    notices = [held("holding-1-0", 3000), held("holding-1-1", 600)]
    create_job(cluster, namespace, "holding", replicas=2)
    set_status(cluster, namespace, "holding", running_status(heldNotices=notices))

    header, *lines = ok(spotjob("status", "-n", namespace)).splitlines()
    listed = json.loads(ok(spotjob("status", "-n", namespace, "-o", "json")))
    # -o before the command, as kubectl takes it: it was refused ("invalid choice: 'json'").
    before = json.loads(ok(spotjob("-o", "json", "status", "-n", namespace)))
    assert [(j["name"], j["heldNotices"]) for j in before] == [(j["name"], j["heldNotices"]) for j in listed]

    assert header.split()[-2:] == ["HELD-FLUSH", "AGE"], header
    at, end = header.index("HELD-FLUSH"), header.index("AGE")
    cells = {line.split()[0]: line[at:end].strip() for line in lines}
    assert re.fullmatch(r"in (9m\d*s?|10m) \(\+1\)", cells["holding"]), cells
    assert cells["plain"] == "", cells
    assert {j["name"]: j["heldNotices"] for j in listed} == {"holding": notices, "plain": []}


def test_a_finished_job_an_earlier_controller_left_with_a_held_notice_shows_none(
    cluster: TestCluster, namespace: str, spotjob: Run
) -> None:
    """A controller before this release left ``status.heldNotices`` on a job that failed while an
    agent held a notice (it is never observed again, so the field stays). Before, the plugin showed
    that notice as due ("training goes on, the flush starts ...") on the Failed job, and in the
    table's HELD-FLUSH. A job that ended holds no notice: the plugin shows none, in JSON too."""
    stale = {
        "worker": "gone-1-1",
        "node": "vm-1",
        "source": "gcp",
        "kind": "maintenance",
        "deadline": ago(3000),
        "flushAt": ago(3300),
    }
    create_job(cluster, namespace, "gone")
    failed = running_status(heldNotices=[stale])
    failed.update(phase="Failed", reason="RestartBudgetExhausted", message="worker gone-1-0 exited with code 1")
    set_status(cluster, namespace, "gone", failed)

    table = ok(spotjob("status", "-n", namespace))
    one = ok(spotjob("status", "gone", "-n", namespace))
    listed = json.loads(ok(spotjob("status", "-n", namespace, "-o", "json")))

    assert "HELD" not in table.splitlines()[0], table
    assert "Held notice" not in one, one
    assert listed[0]["heldNotices"] == []


def test_status_wide_adds_the_attempt_why_each_job_is_in_its_phase_and_why_a_worker_does_not_start(
    cluster: TestCluster, namespace: str, spotjob: Run
) -> None:
    """``kubectl get sj -o wide`` adds ATTEMPT, REASON and NOT-STARTING; ``kubectl spotjob status -o
    wide`` was refused (exit 2, "invalid choice"), so the plugin's table could not say why a job is
    Flushing or what keeps its workers from starting. Now it adds the same three columns."""
    create_job(cluster, namespace, "flushing")
    flushing = running_status(attempt=2)
    flushing.update(phase="Flushing", reason="SpotInterrupted", message="SpotInterruption for node n2: flushing")
    set_status(cluster, namespace, "flushing", flushing)
    create_job(cluster, namespace, "stuck")
    stuck = running_status(attempt=1)
    stuck.update(phase="Pending", reason="WorkersStarted", message="attempt 1's workers are created")
    stuck["attempt"]["notStarting"] = {
        "worker": "stuck-1-0",
        "reason": "ImagePullBackOff",
        "message": "container trainer: Back-off pulling image",
        "since": ago(60),
    }
    set_status(cluster, namespace, "stuck", stuck)

    table = rows(ok(spotjob("status", "-n", namespace, "-o", "wide")))

    assert table["NAME"][-4:] == ["AGE", "ATTEMPT", "REASON", "NOT-STARTING"], table["NAME"]
    assert table["flushing"][1] == "Flushing" and table["flushing"][-3:] == ["2", "SpotInterrupted", "-"]
    assert table["stuck"][1] == "Pending" and table["stuck"][-3:] == ["1", "WorkersStarted", "ImagePullBackOff"]
    assert ok(spotjob("status", "stuck", "-n", namespace, "-o", "wide")).startswith("Name:")


def test_status_of_one_job_says_why_with_its_pods_nodes_zones_last_restart_flush_and_conditions(
    cluster: TestCluster, namespace: str, spotjob: Run
) -> None:
    cluster.add_node(f"{namespace}-b", zone="us-east-1b", run_containers=False)
    create_job(cluster, namespace, "llama", max_restarts=3)
    pod = create_pod(cluster, namespace, "llama", 1, 0, f"{namespace}-b")
    wait_pod_running(cluster, namespace, pod["metadata"]["name"])
    worker = {"name": "llama-1-0", "node": f"{namespace}-b", "zone": "us-east-1b", "phase": "Running", "step": 1420}
    now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    flush = {"id": "0b7c", "mode": "checkpoint", "outcome": "Committed", "step": 1400, "time": now}
    set_status(
        cluster,
        namespace,
        "llama",
        running_status(workers=[worker], restarts=1, capacity="spot", lastFlushRequest=flush),
    )

    out = ok(spotjob("status", "llama", "-n", namespace))

    fields = dict(line.split(":", 1) for line in out.splitlines() if re.match(r"^[A-Z][a-z ]+:", line))
    fields = {k: v.strip() for k, v in fields.items()}
    assert fields["Phase"] == "Running (AttemptRunning: every worker of attempt 1 runs)"
    assert fields["Step"].startswith("1420")
    assert re.fullmatch(r"step 1400, 4\ds ago \(s3://bucket/jobs/step-000001400\)", fields["Checkpoint"])
    assert fields["Preemptions"] == "1"
    assert fields["Restarts"].startswith("1 of 3")
    assert fields["Goodput"] == "98.1% (12 step(s) lost to preemptions and to checkpoints that did not load)"
    assert fields["Capacity"] == "spot"
    assert "Preemption SpotInterrupted — node spot-a is reclaimed" in fields["Last restart"]
    assert fields["Last flush"].startswith("checkpoint request 0b7c: Committed, step 1400")
    pods = rows(out.split("Pods:", 1)[1].split("Conditions:", 1)[0])
    assert pods["llama-1-0"] == ["llama-1-0", "1", "Running", "true", f"{namespace}-b", "us-east-1b", "-"]
    conditions = rows(out.split("Conditions:", 1)[1])
    assert conditions["Ready"][:3] == ["Ready", "True", "AttemptRunning"]


def test_status_of_a_job_whose_worker_does_not_start_says_which_and_why(
    cluster: TestCluster, namespace: str, spotjob: Run
) -> None:
    create_job(cluster, namespace, "pull")
    status = running_status(attempt=0)
    status.update(phase="Pending", reason="WorkersStarted", message="started 1 worker(s) of attempt 0")
    status["attempt"] = {
        "number": 0,
        "startedAt": ago(120),
        "notStarting": {
            "worker": "pull-0-0",
            "reason": "ImagePullBackOff",
            "message": 'container trainer: Back-off pulling image "train:typo"',
            "since": ago(100),
        },
    }
    set_status(cluster, namespace, "pull", status)

    out = ok(spotjob("status", "pull", "-n", namespace))

    [line] = [line for line in out.splitlines() if line.startswith("Not starting:")]
    assert re.search(r"pull-0-0, for 1\d\ds: ImagePullBackOff: container trainer: Back-off pulling image", line), line


def test_status_as_json_carries_the_same_facts(cluster: TestCluster, namespace: str, spotjob: Run) -> None:
    create_job(cluster, namespace, "j")
    set_status(cluster, namespace, "j", running_status(step=700, goodput=0.5))

    (listed,) = json.loads(ok(spotjob("status", "-n", namespace, "-o", "json")))
    one = json.loads(ok(spotjob("-n", namespace, "status", "j", "--output=json")))  # flags before or after

    assert (listed["name"], listed["phase"], listed["step"], listed["goodput"]) == ("j", "Running", 700, 0.5)
    assert listed["restarts"] == 0 and listed["maxRestarts"] == 3
    assert one["lastRestart"]["reason"] == "SpotInterrupted" and one["pods"] == []
    assert one["checkpointUri"] == "s3://bucket/jobs"


def test_status_of_one_job_shows_the_notices_its_agents_hold_and_when_each_flush_starts(
    cluster: TestCluster, namespace: str, spotjob: Run
) -> None:
    """An Azure Reboot the agent of a worker holds (``status.heldNotices``): the job trains on and
    flushes by itself at ``flushAt``. Before, ``kubectl spotjob status`` said nothing of it."""
    create_job(cluster, namespace, "held")
    now = datetime.now(UTC)
    held = {
        "worker": "held-1-0",
        "node": "vm-7",
        "source": "azure",
        "kind": "maintenance",
        "detail": "Reboot 3f2a",
        "deadline": rfc3339(now + timedelta(seconds=900)),
        "flushAt": rfc3339(now + timedelta(seconds=600)),
        "heardAt": ago(5),
    }
    set_status(cluster, namespace, "held", running_status(heldNotices=[held]))

    out = ok(spotjob("status", "held", "-n", namespace))
    one = json.loads(ok(spotjob("status", "held", "-n", namespace, "-o", "json")))

    [line] = [line for line in out.splitlines() if line.startswith("Held notice:")]
    assert re.fullmatch(
        r"Held notice: +held-1-0 on vm-7: azure maintenance \(Reboot 3f2a\), due \S+ \S+Z \(in 1[45]m\); "
        r"training goes on, the flush starts \S+ \S+Z \(in (9m\d*s?|10m)\)",
        line,
    ), line
    assert one["heldNotices"] == [held]
    set_status(cluster, namespace, "held", running_status())
    assert not [line for line in ok(spotjob("status", "held", "-n", namespace)).splitlines() if "Held" in line]


def test_status_of_a_finished_job_says_how_long_its_attempt_ran_not_a_time_that_grows(
    cluster: TestCluster, namespace: str, spotjob: Run
) -> None:
    create_job(cluster, namespace, "done")
    status = running_status(step=2000, completionTime=ago(86400))
    status.update(phase="Succeeded", reason="Completed", message="every worker exited 0 (last step seen 2000)")
    status["attempt"]["runningAt"] = ago(86400 + 600)
    set_status(cluster, namespace, "done", status)

    out = ok(spotjob("status", "done", "-n", namespace))

    [line] = [line for line in out.splitlines() if line.startswith("Attempt:")]
    assert ", ran for 10m, resumed from step 1300" in line, line
    assert "running for" not in line


@pytest.mark.parametrize(
    ("phase", "reason", "said"), [("Failed", "InvalidSpec", "never started"), ("Pending", "Created", "not started yet")]
)
def test_status_of_a_job_whose_first_attempt_never_started_does_not_say_it_started_from_scratch(
    cluster: TestCluster, namespace: str, spotjob: Run, phase: str, reason: str, said: str
) -> None:
    """A job refused on its first pass (InvalidSpec) has attempt 0 with no ``startedAt``: before,
    ``kubectl spotjob status`` said "Attempt: 0, started from scratch" for it."""
    create_job(cluster, namespace, "never")
    status = {"phase": phase, "reason": reason, "message": "spec.checkpoint.uri: ...", "attempt": {"number": 0}}
    set_status(cluster, namespace, "never", status)

    out = ok(spotjob("status", "never", "-n", namespace))

    [line] = [line for line in out.splitlines() if line.startswith("Attempt:")]
    assert re.fullmatch(rf"Attempt: +0, {said}", line), line


def test_status_of_a_failed_job_says_what_to_do_next_and_a_running_one_says_nothing(
    cluster: TestCluster, namespace: str, spotjob: Run
) -> None:
    """A Failed job is over (a changed spec runs nothing): ``Next:`` says, by its reason, what to fix
    and the commands that start it again under its name, and from which step that resumes
    (tests/e2e_k8s/test_k8s_kubectl_plugin.py follows it against the controller)."""
    create_job(cluster, namespace, "spent")
    spent = running_status(step=1400)
    spent.update(phase="Failed", reason="RestartBudgetExhausted", message="worker spent-1-0 exited with code 1")
    set_status(cluster, namespace, "spent", spent)
    create_job(cluster, namespace, "early")
    early = running_status()
    early.update(phase="Failed", reason="RestartBudgetExhausted", message="worker early-1-0 exited with code 1")
    del early["lastCheckpoint"]
    set_status(cluster, namespace, "early", early)
    create_job(cluster, namespace, "owned")
    owned = running_status()
    owned.update(phase="Failed", reason="CheckpointURIOwned", message="job 'ml/other' owns s3://bucket/jobs")
    set_status(cluster, namespace, "owned", owned)
    create_job(cluster, namespace, "runs")
    set_status(cluster, namespace, "runs", running_status())

    def next_line(name: str) -> str:
        [line] = [
            line for line in ok(spotjob("status", name, "-n", namespace)).splitlines() if line.startswith("Next:")
        ]
        return line

    line = next_line("spent")
    assert line.startswith("Next:") and "fix the code" in line, line
    assert f"`kubectl delete spotjob spent -n {namespace}`, then `kubectl apply -f` your manifest" in line, line
    assert line.endswith("it resumes from step 1400, the newest checkpoint (s3://bucket/jobs/step-000001400)"), line
    assert next_line("early").endswith("nothing was committed, so it starts from scratch")
    owned_line = next_line("owned")
    assert "a checkpoint URI of its own" in owned_line and "resumes" not in owned_line, owned_line
    assert "Next:" not in ok(spotjob("status", "runs", "-n", namespace))
    as_json = json.loads(ok(spotjob("status", "spent", "-n", namespace, "-o", "json")))
    assert as_json["next"] == line.removeprefix("Next:").strip()
    assert json.loads(ok(spotjob("status", "runs", "-n", namespace, "-o", "json")))["next"] is None


def _documented_json_keys() -> dict[str, list[str]]:
    """The README's table of ``kubectl spotjob … -o json`` keys: {row: keys, in order}."""
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    start = readme.index("| `-o json` of | keys |")
    out = {}
    for line in readme[start:].splitlines()[2:]:
        if not line.startswith("|"):
            break
        what, keys = (cell.strip() for cell in line.strip("|").split(" | "))
        # Keys are the backticked names outside parentheses (those say what is in them).
        out[what] = re.findall(r"`(\w+)`", re.sub(r"\([^)]*\)", "", keys))
    return out


def test_status_and_events_as_json_have_the_keys_the_readme_lists(
    cluster: TestCluster, namespace: str, spotjob: Run
) -> None:
    cluster.add_node(f"{namespace}-j", zone="us-east-1a", run_containers=False)
    job = create_job(cluster, namespace, "keys")
    pod = create_pod(cluster, namespace, "keys", 1, 0, f"{namespace}-j")
    wait_pod_running(cluster, namespace, pod["metadata"]["name"])
    set_status(cluster, namespace, "keys", running_status())
    write_event(cluster, namespace, job, "WorkersRunning", "every worker of attempt 1 is running", at=datetime.now(UTC))
    documented = _documented_json_keys()

    (listed,) = json.loads(ok(spotjob("status", "-n", namespace, "-o", "json")))
    one = json.loads(ok(spotjob("status", "keys", "-n", namespace, "-o", "json")))
    (event,) = json.loads(ok(spotjob("events", "keys", "-n", namespace, "-o", "json")))

    assert list(listed) == documented["`status`"]
    assert list(one) == documented["`status`"] + documented["`status NAME`"]  # "the same keys", then its own
    (pod_json,) = one["pods"]
    assert list(pod_json) == documented["`status NAME`, each of `pods`"]
    assert pod_json["attempt"] == one["attempt"] == 1  # a number, as the status has it: scripts compare them
    assert list(event) == documented["`events NAME`"]


def test_status_of_a_pending_job_without_pods_says_so(cluster: TestCluster, namespace: str, spotjob: Run) -> None:
    create_job(cluster, namespace, "new")

    out = ok(spotjob("status", "new", "-n", namespace))

    assert "<no status yet>" in out and f"serving namespace {namespace}" in out
    assert "Pods:\n  <none>" in out


# -- checkpoints ----------------------------------------------------------------------------------


def test_checkpoints_reads_the_jobs_uri_newest_first_and_judges_each_as_a_restore_would(
    cluster: TestCluster, namespace: str, spotjob: Run, tmp_path: Path
) -> None:
    uri = str(tmp_path / "ckpt")
    job_id = f"{namespace}/gpt"
    storage = open_storage(uri)
    claim(storage, job_id)
    when = datetime(2026, 1, 1, tzinfo=UTC)
    commit_checkpoint(storage, 100, when, job=job_id)
    commit_checkpoint(storage, 200, when + timedelta(minutes=5), job=job_id)
    commit_checkpoint(storage, 300, when + timedelta(minutes=10), job="someone/else")  # FOREIGN
    commit_checkpoint(storage, 400, when + timedelta(minutes=15), job=job_id)
    for f in (tmp_path / "ckpt" / "step-000000400").iterdir():
        if f.name != "MANIFEST.json":
            f.unlink()  # a committed checkpoint that lost a file: invalid
    storage.put_bytes("step-000000500/__0_0.distcp", b"half")  # a save that never committed
    create_job(cluster, namespace, "gpt", uri=uri)

    proc = spotjob("checkpoints", "gpt", "-n", namespace)

    table = rows(ok(proc))
    assert [k for k in table if k != "STEP"] == ["500", "400", "300", "200", "100"]
    assert " ".join(table["500"]).endswith(
        "uncommitted leftover — uncommitted: no MANIFEST.json (a save still in progress, or one that never finished)"
    )
    assert "INVALID — file" in " ".join(table["400"]) and "is missing" in " ".join(table["400"])
    assert "FOREIGN" in " ".join(table["300"])
    assert table["200"][-1] == "valid" and table["100"][-1] == "valid"
    assert "resumes from step-000000200 (step 200)" in proc.stderr

    docs = json.loads(ok(spotjob("checkpoints", "gpt", "-n", namespace, "-o", "json")))
    assert [(d["step"], d["valid"], d["foreign"], d["resumesFromThis"]) for d in docs] == [
        (500, False, False, False),
        (400, False, False, False),
        (300, False, True, False),
        (200, True, False, True),
        (100, True, False, False),
    ]


def test_checkpoints_names_where_a_restore_stops_not_an_older_one_past_a_newer_spotjobs(
    cluster: TestCluster, namespace: str, spotjob: Run, tmp_path: Path
) -> None:
    """A restore stops at a checkpoint a newer spotjob wrote (it loads it, or refuses, saying to
    upgrade) and refuses to start from scratch over committed checkpoints of the job's own that it
    cannot load: the plugin said it resumes from the older valid one, or starts from scratch."""
    uri = str(tmp_path / "ckpt")
    job_id = f"{namespace}/newer"
    storage = open_storage(uri)
    claim(storage, job_id)
    when = datetime(2026, 1, 1, tzinfo=UTC)
    commit_checkpoint(storage, 100, when, job=job_id)
    commit_checkpoint(storage, 200, when + timedelta(minutes=5), job=job_id)
    manifest = tmp_path / "ckpt" / "step-000000200" / "MANIFEST.json"
    raw = json.loads(manifest.read_text())
    raw["format_version"] = raw["format_version"] + 1  # written by a newer spotjob
    manifest.write_text(json.dumps(raw))
    create_job(cluster, namespace, "newer", uri=uri)

    proc = spotjob("checkpoints", "newer", "-n", namespace)

    assert rows(ok(proc))["100"][-1] == "valid"
    assert "resumes from step-000000100" not in proc.stderr
    assert "does not go back to an older checkpoint: step-000000200 (step 200)" in proc.stderr
    assert "upgrade spotjob where the job runs" in proc.stderr
    docs = json.loads(ok(spotjob("checkpoints", "newer", "-n", namespace, "-o", "json")))
    assert [(d["step"], d["resumesFromThis"]) for d in docs] == [(200, False), (100, False)]

    # Only invalid committed checkpoints of the job's own: the restore refuses, not step 0.
    uri2 = str(tmp_path / "broken")
    storage = open_storage(uri2)
    claim(storage, f"{namespace}/broken")
    commit_checkpoint(storage, 100, when, job=f"{namespace}/broken")
    for f in (tmp_path / "broken" / "step-000000100").iterdir():
        if f.name != "MANIFEST.json":
            f.unlink()
    create_job(cluster, namespace, "broken", uri=uri2)

    proc = spotjob("checkpoints", "broken", "-n", namespace)

    ok(proc)
    assert "would start from scratch" not in proc.stderr
    assert "the next attempt's restore refuses to start from scratch over them" in proc.stderr
    assert "SPOTJOB_START_FRESH=1" in proc.stderr


def test_checkpoints_of_a_path_that_is_not_on_this_machine_says_where_it_is(
    cluster: TestCluster, namespace: str, spotjob: Run, tmp_path: Path
) -> None:
    create_job(cluster, namespace, "remote", uri=str(tmp_path / "on-the-nodes"))

    proc = spotjob("checkpoints", "remote", "-n", namespace)

    assert proc.returncode == 1
    assert "no such folder" in proc.stderr and "a path on the cluster's nodes" in proc.stderr


def test_checkpoints_of_a_uri_no_store_answers_to_names_the_field(
    cluster: TestCluster, namespace: str, spotjob: Run
) -> None:
    create_job(cluster, namespace, "odd", uri="ftp://bucket/odd")

    proc = spotjob("checkpoints", "odd", "-n", namespace)

    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert f"SpotJob {namespace}/odd: spec.checkpoint.uri 'ftp://bucket/odd'" in proc.stderr


# -- flush ----------------------------------------------------------------------------------------


def test_flush_asks_through_an_annotation_patch_that_the_audit_log_records_under_the_users_name(
    cluster: TestCluster, namespace: str, spotjob: Run, test_apiserver_only: None
) -> None:
    create_job(cluster, namespace, "bert")
    set_status(cluster, namespace, "bert", running_status())
    mark = cluster.audit_mark()

    proc = spotjob("flush", "bert", "-n", namespace, "--reason", "before the maintenance window")

    out = ok(proc)
    request = flush_annotation(cluster.rest.get(jobs_path(namespace, "bert")))
    assert request is not None
    assert set(request) == {"id", "mode", "reason", "requestedAt"}
    assert request["mode"] == "restart" and request["reason"] == "before the maintenance window"
    assert re.fullmatch(r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[0-9a-f]{4}-[0-9a-f]{12}", request["id"])
    requested = datetime.strptime(request["requestedAt"], "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC)
    assert abs((datetime.now(UTC) - requested).total_seconds()) < 120
    assert f"flush request {request['id']} sent to SpotJob {namespace}/bert" in out
    mine = [(r.verb, r.api_group, r.resource_path, r.name, r.code) for r in cluster.audit_log(mark) if r.user == USER]
    assert mine == [
        ("get", "spotjob.dev", "spotjobs", "bert", 200),
        ("patch", "spotjob.dev", "spotjobs", "bert", 200),
    ]


INVALID_REQUEST = json.dumps({"id": "m2", "mode": "reboot"})  # its id parses, its mode does not


@pytest.mark.parametrize(
    ("annotation", "last", "replaced"),
    [
        # Answered Invalid, under the id the controller gives what does not parse: not "unanswered".
        (INVALID_REQUEST, {"id": invalid_flush_request_id(INVALID_REQUEST), "outcome": "Invalid"}, None),
        # An id the controller handled before its last one (earlierIds): answered too.
        (
            json.dumps({"id": "c-1", "mode": "checkpoint"}),
            {"id": "c-2", "outcome": "Committed", "step": 1400, "earlierIds": ["c-1"]},
            None,
        ),
        (json.dumps({"id": "c-3", "mode": "checkpoint"}), {"id": "c-2", "outcome": "Committed", "step": 1400}, "c-3"),
        (INVALID_REQUEST, None, invalid_flush_request_id(INVALID_REQUEST)),
    ],
)
def test_flush_says_it_replaces_a_request_only_while_the_controller_has_not_answered_it(
    cluster: TestCluster,
    namespace: str,
    spotjob: Run,
    annotation: str,
    last: dict[str, Any] | None,
    replaced: str | None,
) -> None:
    """A request the controller answered Invalid (recorded as ``invalid-<digest>``), or one it
    handled before its last (``earlierIds``), was called "not answered yet" by the next flush."""
    create_job(cluster, namespace, "again")
    patch = {"metadata": {"annotations": {"spotjob.dev/flush-request": annotation}}}
    cluster.rest.request("PATCH", jobs_path(namespace, "again"), patch, content_type="application/merge-patch+json")
    stamp = rfc3339(datetime.now(UTC))
    extra = {"lastFlushRequest": {"mode": "checkpoint", "time": stamp, **last}} if last else {}
    set_status(cluster, namespace, "again", running_status(**extra))

    proc = spotjob("flush", "again", "-n", namespace)

    assert proc.returncode == 0, proc.stderr
    line = f"(this replaces flush request {replaced}, which the controller has not answered yet)"
    if replaced is None:
        assert "not answered yet" not in proc.stderr, proc.stderr
    else:
        assert line in proc.stderr, proc.stderr


def test_flush_keep_running_asks_for_a_checkpoint_only(cluster: TestCluster, namespace: str, spotjob: Run) -> None:
    create_job(cluster, namespace, "t5")
    set_status(cluster, namespace, "t5", running_status())

    proc = spotjob("flush", "t5", "-n", namespace, "--keep-running")
    ok(proc)
    # The hint printed runs as printed: the namespace was not the context's (no -n: "not found").
    assert f"status.lastFlushRequest: kubectl spotjob status t5 -n {namespace}\n" in proc.stderr, proc.stderr

    request = flush_annotation(cluster.rest.get(jobs_path(namespace, "t5")))
    assert request is not None and request["mode"] == "checkpoint"
    assert request["reason"] == "requested with kubectl spotjob flush"


@pytest.mark.parametrize(
    ("answer", "code", "printed"),
    [
        ({"outcome": "Committed", "step": 1450}, 0, "flush (restart): Committed, step 1450 committed"),
        ({"outcome": "NotCommitted"}, 1, "flush (restart): NotCommitted; no checkpoint was committed"),
        # Why not, as the controller recorded it: the outcome alone sent the operator to `status`.
        (
            {"outcome": "Skipped", "message": "flush request r (restart): the job is Pending: no gang to flush"},
            1,
            "flush (restart): Skipped; no checkpoint was committed (the job is Pending: no gang to flush)",
        ),
    ],
)
def test_flush_wait_prints_the_controllers_answer_and_exits_by_whether_a_step_was_committed(
    cluster: TestCluster,
    namespace: str,
    kubectl_spotjob: Run,
    answer: dict[str, Any],
    code: int,
    printed: str,
) -> None:
    proc = flush_wait_answered(
        cluster, namespace, kubectl_spotjob, "opt", {**answer, "time": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")}
    )

    assert proc.returncode == code, proc.stderr
    assert printed in proc.stdout
    status = cluster.rest.get(jobs_path(namespace, "opt"))["status"]["lastFlushRequest"]
    assert status["id"] in proc.stdout  # the request it waited for is the one the status answers


def test_flush_wait_takes_the_controllers_in_progress_record_for_progress_not_for_the_answer(
    cluster: TestCluster, namespace: str, spotjob: Run
) -> None:
    """The controller records the request it takes as InProgress first (a restart commits only
    once the gang has flushed): --wait reports the outcome that follows, not that record."""
    answer = {"outcome": "Committed", "step": 1460, "time": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")}
    proc = flush_wait_answered(
        cluster, namespace, spotjob, "slow", answer, in_progress="flushing the gang and restarting it"
    )

    assert proc.returncode == 0, (proc.stdout, proc.stderr)
    assert "flush (restart): Committed, step 1460 committed" in proc.stdout
    assert "the controller took request" in proc.stderr and "flushing the gang and restarting it" in proc.stderr


def test_flush_wait_reports_its_own_request_when_another_comes_after_the_controller_took_it(
    cluster: TestCluster, namespace: str, spotjob: Run
) -> None:
    """A request written once the controller took ours (InProgress) is answered after ours, not
    instead of it: --wait said ours was replaced and waited for that one too."""
    create_job(cluster, namespace, "busy")
    set_status(cluster, namespace, "busy", running_status())
    stamp = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")

    def controller() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            job = cluster.rest.get(jobs_path(namespace, "busy"))
            request = flush_annotation(job)
            if request is not None:
                break
            time.sleep(0.05)
        else:
            return
        taken = {"id": request["id"], "mode": request["mode"], "outcome": "InProgress", "time": stamp}
        status = set_status(cluster, namespace, "busy", {**job["status"], "lastFlushRequest": taken})["status"]
        later = json.dumps({"id": "someone-else", "mode": "checkpoint", "reason": "", "requestedAt": stamp})
        patch = {"metadata": {"annotations": {"spotjob.dev/flush-request": later}}}
        cluster.rest.request("PATCH", jobs_path(namespace, "busy"), patch, content_type="application/merge-patch+json")
        answer = {**taken, "outcome": "Committed", "step": 1470}
        set_status(cluster, namespace, "busy", {**status, "lastFlushRequest": answer})

    thread = threading.Thread(target=controller)
    thread.start()
    try:
        proc = spotjob("flush", "busy", "-n", namespace, "--wait", "--timeout", "90")
    finally:
        thread.join()

    assert proc.returncode == 0, proc.stderr
    assert "flush (restart): Committed, step 1470 committed" in proc.stdout
    assert "which replaced yours" not in proc.stdout
    assert "was replaced" not in proc.stderr


def test_flush_wait_survives_a_dropped_watch_and_an_expired_history(
    cluster: TestCluster, namespace: str, spotjob: Run, test_apiserver_only: None
) -> None:
    answer = {"outcome": "Committed", "step": 1500, "time": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")}
    mark = cluster.audit_mark()
    proc = flush_wait_answered(cluster, namespace, spotjob, "resilient", answer, timeout="90", break_watches=True)

    assert proc.returncode == 0, proc.stderr
    assert "Committed, step 1500 committed" in proc.stdout
    mine = [(r.verb, r.name) for r in cluster.audit_log(mark) if r.user == USER]
    assert ("watch", "") in mine  # (a watch's record is written when it ends: the last one may still run)
    assert mine.count(("get", "resilient")) >= 2  # read afresh after its watch was told 410 Gone


def test_flush_wait_without_a_controller_gives_up_after_the_timeout_naming_what_to_check(
    cluster: TestCluster, namespace: str, spotjob: Run
) -> None:
    create_job(cluster, namespace, "alone")
    set_status(cluster, namespace, "alone", running_status())

    proc = spotjob("flush", "alone", "-n", namespace, "--wait", "--timeout", "2")

    assert proc.returncode == 1
    assert "no answer to flush request" in proc.stderr
    assert f"is spotjob-controller running and serving namespace {namespace}?" in proc.stderr
    # The hint runs as printed whatever namespace the user's context is in.
    assert f"(kubectl spotjob events alone -n {namespace} shows what it did)" in proc.stderr, proc.stderr


def test_flush_of_a_finished_job_is_refused_without_writing(cluster: TestCluster, namespace: str, spotjob: Run) -> None:
    create_job(cluster, namespace, "done")
    set_status(cluster, namespace, "done", {**running_status(), "phase": "Succeeded"})

    proc = spotjob("flush", "done", "-n", namespace)

    assert proc.returncode == 1 and "has succeeded: there is nothing to flush" in proc.stderr
    assert flush_annotation(cluster.rest.get(jobs_path(namespace, "done"))) is None


def test_a_user_rbac_refuses_to_patch_hears_which_verb_on_which_resource(
    cluster: TestCluster, namespace: str, spotjob: Run, test_apiserver_only: None
) -> None:
    create_job(cluster, namespace, "guarded")
    set_status(cluster, namespace, "guarded", running_status())
    cluster.add_fault(Fault(user=USER, verb="patch", resource="spotjobs", namespace=namespace, status=403))

    proc = spotjob("flush", "guarded", "-n", namespace)

    assert proc.returncode == 1
    assert f'forbidden: RBAC does not let you patch spotjobs.spotjob.dev in namespace "{namespace}"' in proc.stderr
    assert "Traceback" not in proc.stderr
    assert flush_annotation(cluster.rest.get(jobs_path(namespace, "guarded"))) is None


def test_a_user_rbac_refuses_to_list_jobs_of_every_namespace_hears_it_takes_a_clusterrole(
    cluster: TestCluster, namespace: str, spotjob: Run, test_apiserver_only: None
) -> None:
    """`status -A` lists at the cluster scope, which no Role can grant: the advice named a Role."""
    cluster.add_fault(
        Fault(user=USER, verb="list", resource="spotjobs", path="/apis/spotjob.dev/v1alpha1/spotjobs", status=403)
    )

    proc = spotjob("status", "-A")

    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert "forbidden: RBAC does not let you list spotjobs.spotjob.dev at the cluster scope" in proc.stderr
    assert "Ask your cluster admin for a ClusterRole (bound with a ClusterRoleBinding) granting list" in proc.stderr


def test_a_user_who_may_not_list_pods_still_gets_the_status_from_the_controllers_view(
    cluster: TestCluster, namespace: str, spotjob: Run, test_apiserver_only: None
) -> None:
    create_job(cluster, namespace, "quiet")
    worker = {"name": "quiet-1-0", "node": "spot-z", "zone": "us-east-1c", "phase": "Running"}
    set_status(cluster, namespace, "quiet", running_status(workers=[worker]))
    cluster.add_fault(Fault(user=USER, verb="list", resource="pods", namespace=namespace, status=403))

    out = ok(spotjob("status", "quiet", "-n", namespace))

    assert "you may not list pods" in out
    assert rows(out.split("Pods:", 1)[1].split("Conditions:", 1)[0])["quiet-1-0"][2:6] == [
        "Running", "-", "spot-z", "us-east-1c",
    ]  # fmt: skip


# -- events ---------------------------------------------------------------------------------------


def test_events_oldest_first_with_repeats_counted_and_only_this_incarnations(
    cluster: TestCluster, namespace: str, spotjob: Run
) -> None:
    job = create_job(cluster, namespace, "vit")
    now = datetime.now(UTC)
    write_event(
        cluster, namespace, job, "FlushRequested", "1 agent(s) accepted the request", at=now - timedelta(minutes=9)
    )
    write_event(
        cluster,
        namespace,
        job,
        "SpotInterrupted",
        "node spot-a is reclaimed",
        type="Warning",
        at=now - timedelta(minutes=10),
    )
    write_event(
        cluster, namespace, job, "CheckpointStale", "no commit for 20m", type="Warning",
        at=now - timedelta(minutes=30), count=4, last=now - timedelta(minutes=1),
    )  # fmt: skip
    write_event(cluster, namespace, job, "Rescheduled", "an older job of that name", at=now, uid="an-older-uid")

    proc = spotjob("events", "vit", "-n", namespace)

    lines = ok(proc).splitlines()
    assert lines[0].split() == ["LAST", "SEEN", "TYPE", "REASON", "COUNT", "NOTE"]
    reasons = [ln.split()[2] for ln in lines[1:]]
    assert reasons == ["SpotInterrupted", "FlushRequested", "CheckpointStale"]
    stale = lines[3].split()
    assert re.fullmatch(r"6\ds", stale[0]) and stale[1] == "Warning"
    assert " ".join(stale[3:6]) == "4 over 30m"

    docs = json.loads(ok(spotjob("events", "vit", "-n", namespace, "-o", "json")))
    assert [(d["reason"], d["count"], d["type"]) for d in docs] == [
        ("SpotInterrupted", 1, "Warning"),
        ("FlushRequested", 1, "Normal"),
        ("CheckpointStale", 4, "Warning"),
    ]
    assert docs[0]["reporter"] == "spotjob.dev/controller/spotjob-controller-0"


def test_events_where_events_k8s_io_is_not_served_say_which_kubernetes_spotjob_needs(
    cluster: TestCluster, namespace: str, spotjob: Run, test_apiserver_only: None
) -> None:
    """A cluster below spotjob's minimum serves no events.k8s.io/v1 (and its controller writes no
    Events there). The plugin used to read core v1 Events instead, which took ``list`` on core
    ``events`` in every team's Role; now it says what is wrong, in one line, exit 1 as for the
    plugin's other API errors, and reads nothing else."""
    job = create_job(cluster, namespace, "old-cluster")
    write_event(cluster, namespace, job, "Rescheduled", "attempt 1 starts", at=datetime.now(UTC), core=True)
    cluster.add_fault(Fault(user=USER, path="/apis/events.k8s.io/v1", status=404))
    cluster.add_fault(Fault(user=USER, path=f"/apis/events.k8s.io/v1/namespaces/{namespace}/events", status=404))
    mark = cluster.audit_mark()

    proc = spotjob("events", "old-cluster", "-n", namespace)

    assert (proc.returncode, proc.stdout) == (1, ""), proc
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("error: the cluster at https://") and "does not serve events.k8s.io/v1" in line, line
    assert "spotjob needs Kubernetes 1.29 or later" in line, line
    assert f"`kubectl spotjob status old-cluster -n {namespace}` shows the job's state and why" in line, line
    listed = [(r.api_group, r.resource) for r in cluster.audit_log(mark) if r.user == USER and r.verb == "list"]
    assert listed == []


def test_events_rbac_refuses_name_the_events_k8s_io_grant_and_read_no_core_events_instead(
    cluster: TestCluster, namespace: str, spotjob: Run, test_apiserver_only: None
) -> None:
    """The built-in ``view`` role grants Events through core v1 alone: the plugin read those when
    RBAC refused events.k8s.io. Now the chart's aggregated view role grants ``list`` on
    events.k8s.io Events (tests/infra/test_chart_rbac.py), and a Role without it is told which
    grant it lacks, as every other refusal is."""
    job = create_job(cluster, namespace, "viewer")
    write_event(cluster, namespace, job, "Rescheduled", "attempt 1 starts", at=datetime.now(UTC))
    path = f"/apis/events.k8s.io/v1/namespaces/{namespace}/events"
    cluster.add_fault(Fault(user=USER, verb="list", path=path, status=403))
    mark = cluster.audit_mark()

    proc = spotjob("events", "viewer", "-n", namespace)

    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert f'forbidden: RBAC does not let you list events.events.k8s.io in namespace "{namespace}"' in proc.stderr
    listed = [(r.api_group, r.code) for r in cluster.audit_log(mark) if r.user == USER and r.verb == "list"]
    assert listed == [("events.k8s.io", 403)]


# -- errors, flags and the kubeconfig ----------------------------------------------------------------


def test_no_such_job_is_named_with_its_namespace(
    cluster: TestCluster, namespace: str, kubectl_spotjob: Run, spotjob: Run
) -> None:
    # The first as a process (its exit status), the others from main (the same code's message).
    runs = {"status": kubectl_spotjob, "checkpoints": spotjob, "flush": spotjob, "events": spotjob}
    for command, run in runs.items():
        proc = run(command, "ghost", "-n", namespace)
        assert proc.returncode == 1, command
        assert proc.stderr.strip() == f'error: spotjobs.spotjob.dev "ghost" not found in namespace "{namespace}"'


def test_no_cluster_reachable_names_the_server_and_the_context(spotjob: Run, tmp_path: Path) -> None:
    kubeconfig = tmp_path / "gone.kubeconfig"
    kubeconfig.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [
                    {"name": "c", "cluster": {"server": "https://127.0.0.1:9", "insecure-skip-tls-verify": True}}
                ],
                "users": [{"name": "u", "user": {"token": "t"}}],
                "contexts": [{"name": "gone", "context": {"cluster": "c", "user": "u"}}],
                "current-context": "gone",
            }
        )
    )

    proc = spotjob("status", kubeconfig=str(kubeconfig))

    assert proc.returncode == 1
    assert "cannot reach the API server at https://127.0.0.1:9 (context gone" in proc.stderr
    assert "connection refused" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize("text", ["clusters: [\n", "- just\n- a list\n"])
def test_a_kubeconfig_that_is_no_kubeconfig_is_one_error_line(tmp_path: Path, text: str) -> None:
    # Malformed YAML used to end in a yaml.parser.ParserError traceback. No cluster is needed.
    kubeconfig = tmp_path / "bad.kubeconfig"
    kubeconfig.write_text(text)
    proc = subprocess.run(
        [sys.executable, "-m", "orchestrator.kubectl_plugin", "status", "--kubeconfig", str(kubeconfig)],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},
    )
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    (line,) = proc.stderr.splitlines()
    assert line.startswith(f"error: cannot use the kubeconfig {kubeconfig}: ")


def test_a_kubeconfig_under_the_home_folder_may_be_named_with_a_tilde(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # `--kubeconfig=~/x` reaches the plugin unexpanded; it used to say "no such file" for a file
    # its loader (and the controller) reads. No cluster is needed: nothing is contacted.
    from orchestrator.k8s.plugin_client import load_user_context

    (tmp_path / "team.kubeconfig").write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "c", "cluster": {"server": "https://127.0.0.1:9"}}],
                "users": [{"name": "u", "user": {"token": "t"}}],
                "contexts": [{"name": "team", "context": {"cluster": "c", "user": "u", "namespace": "ml"}}],
                "current-context": "team",
            }
        )
    )
    monkeypatch.setenv("HOME", str(tmp_path))
    user = load_user_context("~/team.kubeconfig")
    assert (user.namespace, user.context) == ("ml", "team")


def test_the_context_picks_the_cluster_user_and_namespace_as_kubectl_does(
    cluster: TestCluster, namespace: str, spotjob: Run, user_kubeconfig: str, tmp_path: Path
) -> None:
    create_job(cluster, namespace, "ctx-job")
    config = yaml.safe_load(Path(user_kubeconfig).read_text())
    base = config["contexts"][0]["context"]
    config["contexts"].append({"name": "team", "context": {**base, "namespace": namespace}})
    config["contexts"].append({"name": "elsewhere", "context": {**base, "namespace": "kube-system"}})
    config["current-context"] = "elsewhere"
    kubeconfig = tmp_path / "two-contexts"
    kubeconfig.write_text(yaml.safe_dump(config))

    by_context = rows(ok(spotjob("status", "--context", "team", kubeconfig=str(kubeconfig))))
    by_flag = rows(ok(spotjob("status", "--kubeconfig", str(kubeconfig), "--context=team")))
    current = spotjob("status", kubeconfig=str(kubeconfig))
    unknown = spotjob("status", "--context", "nope", kubeconfig=str(kubeconfig))

    assert "ctx-job" in by_context and "ctx-job" in by_flag
    assert current.returncode == 0 and 'No SpotJobs in namespace "kube-system"' in current.stderr
    assert unknown.returncode == 1 and 'context "nope" is not in' in unknown.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["flush", "x", "--wait", "--timeout", "soon"], "'soon' is not a duration"),
        (["flush", "x", "--wait", "--timeout", "inf"], "'inf' is not a finite duration"),
        (["flush", "x", "--wait", "--timeout", "nan"], "'nan' is not a finite duration"),
        (["flush", "x", "--wait", "--timeout", "1e400"], "'1e400' is not a finite duration"),
        (["flush", "x", "--wait", "--timeout", "169h"], "'169h' is longer than a week (168h)"),
        (["status", "--request-timeout", "inf"], "'inf' is not a finite duration"),
        # The controller takes a longer reason for no request at all (Invalid, under an id of its
        # own): `flush --wait` waited out its timeout and blamed the controller.
        (["flush", "x", "--reason", "why " * 250 + "so"], "--reason has 1002 characters; at most 1000"),
        (["status", "Bad_Name"], "is not a SpotJob name"),
        (["events"], "the following arguments are required: NAME"),
        (["status", "-o", "yaml"], "invalid choice: 'yaml'"),
        (["-o", "yaml", "status"], "invalid choice: 'yaml'"),
        (["-o", "wide", "checkpoints", "x"], "invalid choice for checkpoints: 'wide'"),
        (["-o", "json", "flush", "x"], "-o/--output is not an option of flush"),
        (["frobnicate"], "invalid choice: 'frobnicate'"),
    ],
)
def test_a_bad_command_line_exits_2_naming_the_problem(
    capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    """Refused by the parser before anything is read or contacted, so the plugin's ``main`` runs in
    this process (a process costs half a CPU-second); the real command's exit 2, through kubectl,
    is ``test_a_bad_command_line_through_kubectl_exits_2_naming_the_problem``."""
    with pytest.raises(SystemExit) as exited:
        kubectl_plugin.main(args)

    err = capsys.readouterr().err
    assert exited.value.code == 2, err
    assert message in err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["status", "x", "-A"], "a NAME and -A/--all-namespaces do not go together"),
        (["flush", "x", "--timeout", "5"], "--timeout goes with --wait"),
    ],
)
def test_a_bad_command_line_through_kubectl_exits_2_naming_the_problem(
    kubectl_spotjob: Run, args: list[str], message: str
) -> None:
    """The cases the commands refuse (after the parser), run as a user runs them: the real kubectl
    starting the installed ``kubectl-spotjob``, whose exit status and stderr kubectl passes on."""
    proc = kubectl_spotjob(*args)

    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr


@pytest.mark.parametrize("command", [["status"], ["checkpoints"], ["flush"], ["events"]])
def test_help_is_there_for_every_command(capsys: pytest.CaptureFixture[str], command: list[str]) -> None:
    """Each command's --help, from the plugin's ``main`` in this process (the help of the command
    line as a whole, through kubectl, is ``test_help_through_kubectl_names_the_kubectl_flags``)."""
    with pytest.raises(SystemExit) as exited:
        kubectl_plugin.main([*command, "--help"])

    out = capsys.readouterr().out
    assert exited.value.code == 0
    assert out.startswith("usage: kubectl spotjob")
    assert "--kubeconfig" in out and "--context" in out


def test_help_through_kubectl_names_the_kubectl_flags(kubectl_spotjob: Run) -> None:
    proc = kubectl_spotjob("--help")

    assert proc.returncode == 0
    assert proc.stdout.startswith("usage: kubectl spotjob")
    assert "--kubeconfig" in proc.stdout and "--context" in proc.stdout


def test_help_and_a_bad_command_line_load_no_client_storage_or_checkpoint_code() -> None:
    """``kubectl spotjob --help`` and a typo are answered by the parser alone: the commands, and the
    kubernetes client, cloud SDKs and checkpoint modules they bring (half a CPU-second at every
    start), are imported only once a command runs."""
    code = """
import contextlib, io, sys
from orchestrator import kubectl_plugin
for argv in (["--help"], ["flush", "--help"], ["status", "-o", "yaml"]):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.suppress(SystemExit), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        kubectl_plugin.main(argv)
heavy = ("kubernetes", "google", "boto3", "botocore", "orchestrator.cli_ckpt", "orchestrator.ckpt_", "agent.catalog")
heavy += ("orchestrator.k8s",)
print(sorted(m for m in sys.modules if m.startswith(heavy)))
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)

    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]", proc.stdout


def test_status_shows_each_pods_training_container_not_a_helper_that_finished_nor_the_pods_readiness() -> None:
    """A pod is Ready only while every container is, and the kubelet lists containers by name: a
    helper that exited 0 ("cache", before "trainer") must not stand for the worker."""
    from orchestrator.kubectl_status import job_pods_view

    pod = {
        "metadata": {"name": "llama-0-0", "labels": {"spotjob.dev/attempt": "0"}},
        "spec": {
            "nodeName": "n1",
            "containers": [
                {"name": "trainer", "ports": [{"name": "spotjob-agent", "containerPort": 8470}]},
                {"name": "cache"},
            ],
        },
        "status": {
            "phase": "Running",
            "conditions": [{"type": "Ready", "status": "False"}],
            "containerStatuses": [
                {"name": "cache", "ready": False, "state": {"terminated": {"exitCode": 0}}},
                {"name": "trainer", "ready": True, "state": {"running": {}}},
            ],
        },
    }
    (view,) = job_pods_view({"status": {}}, [pod])
    assert (view["ready"], view["exitCode"]) == (True, None)
    pod["status"]["containerStatuses"][1] = {
        "name": "trainer",
        "ready": False,
        "state": {"terminated": {"exitCode": 75}},
    }
    (view,) = job_pods_view({"status": {}}, [pod])
    assert (view["ready"], view["exitCode"]) == (False, 75)


def test_status_of_one_job_escapes_control_characters_in_what_it_prints(
    cluster: TestCluster, namespace: str, spotjob: Run
) -> None:
    """A status's messages come from pods, agents and stores the reader of ``kubectl spotjob status
    NAME`` need not trust (a container's waiting message, a restart's cause): an ANSI escape or a
    carriage return in one is printed escaped, as the tables of ``status`` and ``events`` do, so it
    cannot retitle the terminal, clear it or overwrite the line an operator reads."""
    create_job(cluster, namespace, "crafted")
    status = running_status()
    status["message"] = "runs\x1b]0;pwned\x07"
    status["conditions"][0]["message"] = "ok\x1b[2J\rFAKE"
    status["restartHistory"][0]["message"] = "gone\x1b[31m"
    status["attempt"]["notStarting"] = {
        "worker": "crafted-1-0",
        "reason": "Err",
        "message": "x\x1b[1A",
        "since": ago(5),
    }
    set_status(cluster, namespace, "crafted", status)

    out = ok(spotjob("status", "crafted", "-n", namespace))

    assert "\x1b" not in out and "\r" not in out and "\x07" not in out, repr(out)
    assert "runs\\x1b]0;pwned\\x07" in out and "ok\\x1b[2J\\rFAKE" in out and "gone\\x1b[31m" in out
    assert "x\\x1b[1A" in out


def test_flush_wait_escapes_control_characters_in_the_controllers_answer(
    cluster: TestCluster, namespace: str, spotjob: Run
) -> None:
    """The message of the request the controller took is read from the job's status, which more
    than the controller may write: printed raw, an ANSI escape in it reached the terminal. It is
    printed escaped, as ``status`` and ``events`` print what they read."""
    now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    answer = {"outcome": "Committed", "step": 1460, "time": now}
    proc = flush_wait_answered(cluster, namespace, spotjob, "loud", answer, in_progress="flushing\x1b]0;pwned\x07")

    assert proc.returncode == 0, (proc.stdout, proc.stderr)
    assert "\x1b" not in proc.stdout + proc.stderr and "\x07" not in proc.stderr, (proc.stdout, proc.stderr)
    assert "Committed, step 1460 committed" in proc.stdout
    assert "flushing\\x1b]0;pwned\\x07" in proc.stderr


@pytest.mark.parametrize(
    ("uri", "variable", "value"),
    [
        ("gs://bucket/run", "STORAGE_EMULATOR_HOST", "http://127.0.0.1:4443/"),
        ("gs://bucket/run", "STORAGE_EMULATOR_HOST", "127.0.0.1:4443"),
        ("s3://bucket/run", "AWS_ENDPOINT_URL", "127.0.0.1:9000"),
    ],
)
def test_checkpoints_with_a_store_setting_of_this_machine_that_is_wrong_blames_the_setting_not_the_uri(
    cluster: TestCluster, namespace: str, kubectl_spotjob: Run, uri: str, variable: str, value: str
) -> None:
    """A store endpoint variable of the machine running kubectl that cannot be used (no scheme, a
    trailing slash) is named as that machine's setting, without a traceback; the job's URI is fine."""
    create_job(cluster, namespace, "elsewhere", uri=uri)

    keys = {"AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "y", "AWS_DEFAULT_REGION": "us-east-1"}
    proc = kubectl_spotjob("checkpoints", "elsewhere", "-n", namespace, env={variable: value, **keys})

    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert variable in proc.stderr and "spec.checkpoint.uri" not in proc.stderr, proc.stderr
    assert "this machine" in proc.stderr, proc.stderr
