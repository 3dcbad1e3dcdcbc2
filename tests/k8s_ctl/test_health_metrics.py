"""/healthz, /readyz and /metrics: the probes follow their checks; every metric family is exposed."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from prometheus_client import Gauge

from orchestrator.k8s.cluster_signals import INTERRUPTION_ANNOTATION, ClusterSignals
from orchestrator.k8s.health import HealthServer
from orchestrator.k8s.metrics import ControllerMetrics
from orchestrator.model import AttemptStatus, CheckpointInfo, JobStatus, Phase

T0 = datetime(2026, 5, 1, 12, 0, tzinfo=UTC)


def node(name: str, *, taints: list[dict[str, Any]] | None = None, annotations: dict[str, str]) -> dict[str, Any]:
    status = {"conditions": [{"type": "Ready", "status": "True"}]}
    return {"metadata": {"name": name, "annotations": annotations}, "spec": {"taints": taints or []}, "status": status}


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
    metrics.reconciled(0.02, error=True)
    metrics.queue_depth(3)
    metrics.api_retry("list", "nodes", "500")
    metrics.leader(True)
    metrics.job_state("team-a", "llama", running_with_checkpoint(), max_restarts=3)
    metrics.flush_ended("team-a", "llama", "timed_out", agents_failed=1)
    metrics.goodput("team-a", "llama", 0.93)
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
        'spotjob_job_phase{name="llama",namespace="team-a",phase="Running"} 1.0',
        'spotjob_job_last_checkpoint_step{name="llama",namespace="team-a"} 1200.0',
        'spotjob_job_flushes_total{name="llama",namespace="team-a",outcome="timed_out"} 1.0',
        'spotjob_job_agent_flush_failures_total{name="llama",namespace="team-a"} 1.0',
    ):
        assert line in text, line


def test_a_signals_source_label_takes_only_the_known_sources_and_other_whatever_a_node_annotation_says() -> None:
    """The ``spotjob.dev/interruption`` annotation names its own source, in any text whoever wrote
    it chose: taken as the label, every text (a message, a hostname, a line break) was a new series
    of ``spotjob_signals_total``, without bound."""
    metrics = ControllerMetrics()
    signals = ClusterSignals(now=lambda: T0)
    spot = {"kind": "SpotInterruption", "deadline": "2026-05-01T12:02:00Z"}
    sources = ["aws-sqs", "nth on ip-10-0-0-1 at 12:00:01", "evil\nspotjob_leader 1", "k8s-node,forged", ""]
    nodes = [
        node(f"n{i}", annotations={INTERRUPTION_ANNOTATION: json.dumps({**spot, "source": src})})
        for i, src in enumerate(sources)
    ]
    itn = [{"key": "aws-node-termination-handler/spot-itn", "effect": "NoExecute"}]
    nodes.append(
        node("tainted", taints=itn, annotations={INTERRUPTION_ANNOTATION: json.dumps({**spot, "source": "?"})})
    )
    for n in nodes:
        for s in signals.for_node(n["metadata"]["name"], n):
            metrics.signal(str(s.kind), s.source)  # as the reconciler counts each signal acted on
    assert samples(metrics, "spotjob_signals_total") == {
        'kind="SpotInterruption",source="aws-sqs"': 1,
        'kind="SpotInterruption",source="other"': 3,
        'kind="SpotInterruption",source="k8s-node,other"': 2,
    }
    text = metrics.exposition().decode()
    assert "ip-10-0-0-1" not in text and "evil" not in text and "forged" not in text


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


def running_with_checkpoint(step: int = 1200) -> JobStatus:
    return JobStatus(
        phase=Phase.RUNNING,
        restarts=2,
        start_time=T0 - timedelta(hours=1),
        attempt=AttemptStatus(number=1, running_at=T0 - timedelta(minutes=30)),
        last_checkpoint=CheckpointInfo(step=step, uri="s3://b/ckpt/step-1200", time=T0),
        goodput=0.9,
    )


def samples(metrics: ControllerMetrics, name: str) -> dict[str, float]:
    """``{'label="value",...': value}`` of one family's samples (sorted labels, as exposed)."""
    out = {}
    for line in metrics.exposition().decode().splitlines():
        if line.startswith(name + "{"):
            labels, _, value = line[len(name) + 1 :].rpartition("} ")
            out[labels] = float(value)
    return out


def test_a_jobs_state_is_one_phase_its_newest_checkpoint_and_its_restarts_and_follows_the_status() -> None:
    """The per-job series the alert rules read: one ``spotjob_job_phase`` per phase (1 for the
    current one), when the newest checkpoint was committed (Unix seconds, so ``time() - x`` is its
    age) and its step, when the job and its current attempt first ran, and its restarts against
    ``maxRestarts``."""
    metrics = ControllerMetrics()
    job = 'name="llama",namespace="team-a"'
    metrics.job_state("team-a", "llama", JobStatus(phase=Phase.PENDING), max_restarts=3)
    assert samples(metrics, "spotjob_job_phase")[f'{job},phase="Pending"'] == 1
    assert samples(metrics, "spotjob_job_last_checkpoint_timestamp_seconds") == {}, "no checkpoint yet: no series"
    assert samples(metrics, "spotjob_job_start_timestamp_seconds") == {}

    metrics.job_state("team-a", "llama", running_with_checkpoint(), max_restarts=3)
    phases = samples(metrics, "spotjob_job_phase")
    assert {k.rsplit('phase="', 1)[1].rstrip('"'): v for k, v in phases.items()} == {
        "Pending": 0,
        "Running": 1,
        "Flushing": 0,
        "Rescheduling": 0,
        "Succeeded": 0,
        "Failed": 0,
    }
    assert samples(metrics, "spotjob_job_last_checkpoint_timestamp_seconds") == {job: T0.timestamp()}
    assert samples(metrics, "spotjob_job_last_checkpoint_step") == {job: 1200}
    assert samples(metrics, "spotjob_job_start_timestamp_seconds") == {job: (T0 - timedelta(hours=1)).timestamp()}
    assert samples(metrics, "spotjob_job_attempt_running_timestamp_seconds") == {
        job: (T0 - timedelta(minutes=30)).timestamp()
    }
    assert samples(metrics, "spotjob_job_restarts") == {job: 2}
    assert samples(metrics, "spotjob_job_max_restarts") == {job: 3}
    assert samples(metrics, "spotjob_job_goodput_ratio") == {job: 0.9}

    metrics.job_state("team-a", "llama", JobStatus(phase=Phase.FAILED), max_restarts=None)  # spec invalid
    assert samples(metrics, "spotjob_job_phase")[f'{job},phase="Failed"'] == 1
    assert samples(metrics, "spotjob_job_max_restarts") == {}
    assert samples(metrics, "spotjob_job_last_checkpoint_step") == {}


def test_a_scrape_during_a_phase_change_sees_the_job_in_some_phase_never_in_none(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The phase gauges were written in the enum's order, the old phase's 0 before the new one's 1:
    a scrape between the two (the exposition takes no lock of the controller's) saw the job in no
    phase at all on Running -> Flushing and Flushing -> Rescheduling, and SpotJobNotRunning's
    single ``for:`` clock (max over Pending, Flushing, Rescheduling) started again. Found reading
    the code. What a scrape would see is read after every gauge write: the job is always at 1 in
    some phase, and after the write in its new one only."""
    metrics = ControllerMetrics()
    job = 'name="llama",namespace="team-a"'
    seen: list[dict[str, float]] = []
    real_set = Gauge.set

    def set_and_scrape(gauge: Gauge, value: float) -> None:
        real_set(gauge, value)
        phases = samples(metrics, "spotjob_job_phase")
        seen.append({k.rsplit('phase="', 1)[1].rstrip('"'): v for k, v in phases.items() if k.startswith(job)})

    monkeypatch.setattr(Gauge, "set", set_and_scrape)
    for phase in (Phase.PENDING, Phase.RUNNING, Phase.FLUSHING, Phase.RESCHEDULING, Phase.PENDING, Phase.FAILED):
        seen.clear()
        metrics.job_state("team-a", "llama", JobStatus(phase=phase), max_restarts=3)
        scrapes = [s for s in seen if s]
        assert scrapes, phase
        for scrape in scrapes:
            assert 1 in scrape.values(), f"a scrape during the change to {phase} saw no phase: {scrape}"
        assert [p for p, v in scrapes[-1].items() if v == 1] == [phase.value]


def test_a_jobs_flush_counters_start_at_zero_so_its_first_flush_is_an_increase() -> None:
    """A counter series that first appears at 1 shows no ``increase()`` in Prometheus: the first
    flush that timed out would never page. Each outcome is exposed at 0 once the job is seen."""
    metrics = ControllerMetrics()
    metrics.job_state("team-a", "llama", JobStatus(phase=Phase.RUNNING), max_restarts=3)
    job = 'name="llama",namespace="team-a"'
    assert samples(metrics, "spotjob_job_flushes_total") == {
        f'{job},outcome="committed"': 0,
        f'{job},outcome="workers_exited"': 0,
        f'{job},outcome="timed_out"': 0,
    }
    assert samples(metrics, "spotjob_job_agent_flush_failures_total") == {job: 0}
    metrics.flush_ended("team-a", "llama", "committed", agents_failed=0)
    assert samples(metrics, "spotjob_job_flushes_total")[f'{job},outcome="committed"'] == 1
    assert samples(metrics, "spotjob_job_agent_flush_failures_total") == {job: 0}


def test_every_series_of_a_deleted_job_goes_and_a_replica_that_stops_leading_drops_them_all() -> None:
    metrics = ControllerMetrics()
    for name in ("llama", "gpt"):
        metrics.job_state("team-a", name, running_with_checkpoint(), max_restarts=3)
        metrics.flush_ended("team-a", name, "committed", agents_failed=1)
    metrics.job_deleted("team-a", "llama")
    text = metrics.exposition().decode()
    assert 'name="llama"' not in text
    assert 'spotjob_job_phase{name="gpt",namespace="team-a",phase="Running"} 1.0' in text

    metrics.forget_jobs()
    text = metrics.exposition().decode()
    assert 'namespace="team-a"' not in text, "a follower exports no job: the leader's are the only ones"
    metrics.job_state("team-a", "gpt", running_with_checkpoint(), max_restarts=3)  # leading again
    assert samples(metrics, "spotjob_job_last_checkpoint_step") == {'name="gpt",namespace="team-a"': 1200}
