"""/healthz, /readyz and /metrics: the probes follow their checks; every metric family is exposed."""

from __future__ import annotations

import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest

from orchestrator.k8s.health import HealthServer
from orchestrator.k8s.metrics import ControllerMetrics


def fetch(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


@pytest.fixture
def served() -> Iterator[tuple[HealthServer, ControllerMetrics, dict[str, str | None]]]:
    metrics = ControllerMetrics()
    state: dict[str, str | None] = {"live": None, "ready": "caches not synced: nodes"}
    server = HealthServer(
        metrics, port=0, address="127.0.0.1", liveness=[lambda: state["live"]], readiness=[lambda: state["ready"]]
    )
    server.start()
    yield server, metrics, state
    server.stop()


def test_readyz_fails_until_the_caches_sync_and_healthz_follows_the_threads(served) -> None:
    server, _, state = served
    assert fetch(server.port, "/healthz") == (200, "ok\n")
    code, body = fetch(server.port, "/readyz")
    assert code == 503 and "not synced" in body
    state["ready"] = None
    assert fetch(server.port, "/readyz")[0] == 200
    state["live"] = "not running: Informer(nodes)"
    code, body = fetch(server.port, "/healthz")
    assert code == 503 and "Informer(nodes)" in body
    assert fetch(server.port, "/nope")[0] == 404


def test_metrics_exposes_every_family_the_controller_records(served) -> None:
    server, metrics, _ = served
    metrics.signal("SpotInterruption", "k8s-node")
    metrics.flush_request("accepted")
    metrics.notice_to_commit(12.5)
    metrics.preemption()
    metrics.restart("preemption")
    metrics.lost_steps(40)
    metrics.goodput("team-a", "llama", 0.93)
    metrics.reconciled(0.02, error=True)
    metrics.queue_depth(3)
    metrics.api_retry("list", "nodes", "500")
    metrics.leader(True)
    code, text = fetch(server.port, "/metrics")
    assert code == 200
    for line in (
        'spotjob_signals_total{kind="SpotInterruption",source="k8s-node"} 1.0',
        'spotjob_flush_requests_total{outcome="accepted"} 1.0',
        "spotjob_notice_to_commit_seconds_count 1.0",
        "spotjob_preemptions_total 1.0",
        'spotjob_restarts_total{cause="preemption"} 1.0',
        "spotjob_lost_steps_total 40.0",
        'spotjob_job_goodput_ratio{name="llama",namespace="team-a"} 0.93',
        "spotjob_reconcile_errors_total 1.0",
        "spotjob_reconcile_duration_seconds_count 1.0",
        "spotjob_workqueue_depth 3.0",
        'spotjob_api_retries_total{reason="500",resource="nodes",verb="list"} 1.0',
        "spotjob_leader 1.0",
    ):
        assert line in text, line


def test_a_deleted_jobs_goodput_disappears_from_metrics() -> None:
    metrics = ControllerMetrics()
    metrics.goodput("team-a", "llama", 0.5)
    metrics.goodput("team-a", "gpt", 0.7)
    metrics.job_deleted("team-a", "llama")
    metrics.job_deleted("team-a", "never-seen")  # harmless
    text = metrics.exposition().decode()
    assert 'name="llama"' not in text and 'name="gpt"' in text


def test_flushes_of_up_to_ten_minutes_land_in_a_bucket_of_their_own_not_in_inf() -> None:
    """A flush of a large model to a slow store takes minutes (``flushTimeoutSeconds`` may be up to a
    day): the notice-to-commit histogram resolves durations from 1 s to 10 min, so a 7-minute flush
    and a 10-minute one are told apart from each other and from one that never fit (``+Inf``)."""
    metrics = ControllerMetrics()
    for seconds in (0.8, 420.0, 600.0, 4000.0):
        metrics.notice_to_commit(seconds)
    buckets = {}
    for line in metrics.exposition().decode().splitlines():
        if line.startswith("spotjob_notice_to_commit_seconds_bucket"):
            le = line.split('le="', 1)[1].split('"', 1)[0]
            buckets[le] = float(line.rsplit(" ", 1)[1])
    assert buckets["1.0"] == 1
    assert buckets["300.0"] == 1
    assert buckets["450.0"] == 2
    assert buckets["600.0"] == 3
    assert buckets["+Inf"] == 4
