"""The series the chart's alert rules read, on a real ``spotjob-controller`` process's /metrics while
it drives a job of real ranks on the test cluster (checkpoints on file://): every metric a rule
names is exposed, the job's series follow its status, and they go with the job."""

from __future__ import annotations

import re
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest
from e2e_support import Controller, create_job, jobs_path, spotjob_body, status, wait

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


def test_every_metric_the_alert_rules_read_is_on_the_controllers_metrics_and_the_jobs_series_follow_it(
    cluster: TestCluster, namespace: str, start_controller: Callable[..., Controller], tmp_path: Path
) -> None:
    """Feature: the alert rules read per-job series (phase, newest checkpoint, start, restarts,
    flushes) the controller did not expose before. A rule naming a metric no controller serves is an
    alert that never fires, silently: each name the rendered rules read is checked against what a
    real controller serves, and the job's own series against its status."""
    rules = alert_rules(render({"metrics": {"serviceMonitor": {"enabled": True}, "prometheusRule": {"enabled": True}}}))
    read = {metric for rule in rules.values() for metric, _ in selectors(rule["expr"])} - {"up"}

    cluster.add_node(f"{namespace}-a")
    controller = start_controller(namespace)
    dumps = tmp_path / "dumps"
    dumps.mkdir()
    create_job(cluster, spotjob_body("train", namespace, uri=str(tmp_path / "ckpt"), dump_dir=dumps, step_sleep=0.3))
    job = f'name="train",namespace="{namespace}"'

    def running_with_a_checkpoint() -> dict[str, float] | None:
        _, samples = scrape(controller)
        phase = samples.get(f'spotjob_job_phase{{{job},phase="Running"}}')
        return samples if phase == 1 and f"spotjob_job_last_checkpoint_step{{{job}}}" in samples else None

    running = wait(running_with_a_checkpoint, "the job's series to say Running with a checkpoint")
    assert running[f'spotjob_job_phase{{{job},phase="Pending"}}'] == 0
    assert running[f"spotjob_job_max_restarts{{{job}}}"] == 2
    assert running[f"spotjob_job_restarts{{{job}}}"] == 0
    assert f"spotjob_job_attempt_running_timestamp_seconds{{{job}}}" in running
    assert running[f'spotjob_job_flushes_total{{{job},outcome="timed_out"}}'] == 0, "at 0 from the first pass"

    def succeeded() -> dict[str, float] | None:
        _, samples = scrape(controller)
        return samples if samples.get(f'spotjob_job_phase{{{job},phase="Succeeded"}}') == 1 else None

    final = wait(succeeded, "the job's series to say Succeeded")
    names, _ = scrape(controller)
    assert not read - names, f"the alert rules read metrics the controller does not serve: {sorted(read - names)}"
    done = status(cluster, namespace, "train")
    checkpoint = done["lastCheckpoint"]
    assert final[f"spotjob_job_last_checkpoint_step{{{job}}}"] == checkpoint["step"]
    assert final[f"spotjob_job_last_checkpoint_timestamp_seconds{{{job}}}"] == pytest.approx(
        parse_timestamp(checkpoint["time"]).timestamp(), abs=1e-3
    )
    assert final[f"spotjob_job_start_timestamp_seconds{{{job}}}"] == pytest.approx(
        parse_timestamp(done["startTime"]).timestamp(), abs=1e-3
    )
    assert final[f'spotjob_job_phase{{{job},phase="Running"}}'] == 0

    cluster.rest.request("DELETE", jobs_path(namespace, "train"))
    wait(
        lambda: not any(f'namespace="{namespace}"' in key for key in scrape(controller)[1]),
        "the deleted job's series to go",
    )
