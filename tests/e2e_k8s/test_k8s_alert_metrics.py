"""The series the chart's alert rules read, on a real ``spotjob-controller`` process's /metrics while
it drives a job of real ranks on the test cluster (checkpoints on file://): every metric a rule
names is exposed, the job's series follow its status, and they go with the job. The same run checks
what the completed job's status, Ready condition and Event say (they need the same job: one run)."""

from __future__ import annotations

import re
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest
from e2e_support import STEPS, Controller, create_job, job_events, jobs_path, spotjob_body, status, wait

from orchestrator.model import parse_timestamp
from tests.infra.infra_support import alert_rules, render, selectors
from tests.k8s.cluster import TestCluster

pytestmark = pytest.mark.slow

SUFFIXES = {"histogram": ("_bucket", "_sum", "_count")}
"""The series of a family beside its own name (a counter's ``# TYPE`` line names it with ``_total``)."""


def scrape(controller: Controller) -> tuple[set[str], dict[str, float]]:
    """The series names the controller's /metrics can carry (from its ``# TYPE`` lines), and its
    samples; nothing while it does not serve yet."""
    found = re.search(r"serving /healthz, /readyz and /metrics on port (\d+)", controller.log())
    if found is None:
        return set(), {}
    with urllib.request.urlopen(f"http://127.0.0.1:{found.group(1)}/metrics", timeout=10) as response:
        text = response.read().decode()
    names = set()
    for family, kind in re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M):
        names |= {family, *(family + suffix for suffix in SUFFIXES.get(kind, ()))}
    return names, controller.metrics()


def test_a_completed_job_says_its_last_committed_step_and_every_alert_metric_is_served_and_its_series_follow_it(
    cluster: TestCluster, namespace: str, start_controller: Callable[..., Controller], tmp_path: Path
) -> None:
    """One uninterrupted job on one node, read through its status and through the controller's
    /metrics while it runs and once it ends: both checks need that same job, node and controller,
    so they share one run (each assertion names what it is about).

    Status: the step the agents report reaches the status at most once a minute (a sampled hint),
    so a job shorter than that ends with only its first hint seen. Its ``Completed`` message, Ready
    condition, Event and ``attempt.observedStep`` (``kubectl spotjob``'s training step) said "last
    step seen 10" of a job that trained and committed all 60 steps, and while it ran the training
    step stayed below the newest checkpoint's; they now say at least the newest step this attempt
    committed.

    Metrics: the alert rules read per-job series (phase, newest checkpoint, start, restarts,
    flushes) the controller did not expose before. A rule naming a metric no controller serves is an
    alert that never fires, silently: each name the rendered rules read is checked against what a
    real controller serves, and the job's own series against its status; they go with the job."""
    rules = alert_rules(render({"metrics": {"serviceMonitor": {"enabled": True}, "prometheusRule": {"enabled": True}}}))
    read = {metric for rule in rules.values() for metric, _ in selectors(rule["expr"])} - {"up"}

    cluster.add_node(f"{namespace}-a")
    controller = start_controller(namespace)
    dumps = tmp_path / "dumps"
    dumps.mkdir()
    create_job(cluster, spotjob_body("train", namespace, uri=str(tmp_path / "ckpt"), dump_dir=dumps, step_sleep=0.3))
    job = f'name="train",namespace="{namespace}"'

    seen: list[dict] = []
    running: list[dict[str, float]] = []

    def ended() -> dict | None:
        now = status(cluster, namespace, "train")
        if now.get("phase") == "Running" and now.get("lastCheckpoint"):
            seen.append(now)
        if not running:
            _, samples = scrape(controller)
            phase = samples.get(f'spotjob_job_phase{{{job},phase="Running"}}')
            if phase == 1 and f"spotjob_job_last_checkpoint_step{{{job}}}" in samples:
                running.append(samples)
        return now if now.get("phase") == "Succeeded" else None

    final = wait(ended, "the job to succeed")
    # Status: while it runs, the step it trains at is never below the step it has committed.
    behind = [(s["attempt"].get("observedStep"), s["lastCheckpoint"]["step"]) for s in seen]
    assert any(committed > 10 for _, committed in behind), behind
    assert all(trained is not None and trained >= committed for trained, committed in behind), behind

    assert final["lastCheckpoint"]["step"] == STEPS, final
    assert final["attempt"]["observedStep"] == STEPS, final["attempt"]
    assert final["message"] == f"every worker exited 0 (last step seen {STEPS})", final["message"]
    (ready,) = [c for c in final["conditions"] if c["type"] == "Ready"]
    assert (ready["reason"], ready["message"]) == ("Completed", final["message"])
    (completed,) = wait(
        lambda: [e for e in job_events(cluster, namespace, "train") if e["reason"] == "Completed"],
        "the Completed Event (emitted after the status write)",
    )
    assert re.search(rf"last step seen {STEPS}\)", completed["note"]), completed

    # Metrics: while it ran, the job's series said Running with a checkpoint.
    assert running, "the job's series never said Running with a checkpoint while the job ran"
    assert running[0][f'spotjob_job_phase{{{job},phase="Pending"}}'] == 0
    assert running[0][f"spotjob_job_max_restarts{{{job}}}"] == 2
    assert running[0][f"spotjob_job_restarts{{{job}}}"] == 0
    assert f"spotjob_job_attempt_running_timestamp_seconds{{{job}}}" in running[0]
    assert running[0][f'spotjob_job_flushes_total{{{job},outcome="timed_out"}}'] == 0, "at 0 from the first pass"

    def succeeded() -> dict[str, float] | None:
        _, samples = scrape(controller)
        return samples if samples.get(f'spotjob_job_phase{{{job},phase="Succeeded"}}') == 1 else None

    ended_series = wait(succeeded, "the job's series to say Succeeded")
    names, _ = scrape(controller)
    assert not read - names, f"the alert rules read metrics the controller does not serve: {sorted(read - names)}"
    done = status(cluster, namespace, "train")
    checkpoint = done["lastCheckpoint"]
    assert ended_series[f"spotjob_job_last_checkpoint_step{{{job}}}"] == checkpoint["step"]
    assert ended_series[f"spotjob_job_last_checkpoint_timestamp_seconds{{{job}}}"] == pytest.approx(
        parse_timestamp(checkpoint["time"]).timestamp(), abs=1e-3
    )
    assert ended_series[f"spotjob_job_start_timestamp_seconds{{{job}}}"] == pytest.approx(
        parse_timestamp(done["startTime"]).timestamp(), abs=1e-3
    )
    assert ended_series[f'spotjob_job_phase{{{job},phase="Running"}}'] == 0

    cluster.rest.request("DELETE", jobs_path(namespace, "train"))
    wait(
        lambda: not any(f'namespace="{namespace}"' in key for key in scrape(controller)[1]),
        "the deleted job's series to go",
    )
