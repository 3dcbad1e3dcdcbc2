"""The scale benchmark in small, so that it cannot rot: the same code as ``make bench`` runs (a real
``spotjob-controller``, the test API server, simulated agents on the real control API), with 8
nodes and 4 jobs. It asserts what the benchmark counts — every preemption flushed and recovered,
the API calls each one took, no list after the informers synced — never how long anything took.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.controller_scale import ScaleConfig, SizeResult, run_size

pytestmark = pytest.mark.slow

ROUNDS, PER_ROUND, BURST = 2, 1, 2


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory) -> SizeResult:
    config = ScaleConfig(
        nodes=8, jobs=4, rounds=ROUNDS, per_round=PER_ROUND, burst=BURST, idle_seconds=3.0, wait_seconds=240.0
    )
    return run_size(config, Path(tmp_path_factory.mktemp("scale")))


def test_every_preemption_reached_its_agent_and_the_job_ran_again_elsewhere(result: SizeResult) -> None:
    assert result.errors == []
    assert len(result.preemptions) >= ROUNDS * PER_ROUND + BURST
    for p in result.preemptions:
        assert p.flush_at is not None and p.recovered_at is not None, p
        assert p.flush_at >= p.signal_at  # the flush followed the taint


def test_no_list_after_the_informers_synced(result: SizeResult) -> None:
    assert result.lists_after_sync == 0
    assert all(w.lists == 0 for w in result.windows)


def test_a_preemption_costs_one_pod_deleted_one_created_a_few_status_writes_and_its_events(result: SizeResult) -> None:
    for name in ("rounds", "burst"):
        window = next(w for w in result.windows if w.name == name)
        n = window.preemptions
        calls = window.attributed_by_call
        allowed = {
            "create events",
            "patch events",
            "create pods",
            "delete pods",
            "update spotjobs/status",
            "patch pods",
        }
        assert set(calls) <= allowed, calls
        # The checkpoint hints: one patch per pod per commit. A preemption brings the flush's commit,
        # hinted on the old pod while it still runs and on the new one once it runs (one pod per job).
        assert calls.get("patch pods", 0) <= n * 2, calls
        assert window.pods_deleted == n and calls["create pods"] == n, (window.pods_deleted, calls)
        # A delete may go out again when the next pass still finds the pod in its cache (seen once in
        # CI on a loaded machine): idempotent, and bounded.
        assert n <= calls["delete pods"] <= 2 * n, calls
        assert n * 2 <= calls["update spotjobs/status"] <= n * 10, calls
        assert n * 3 <= calls.get("create events", 0) + calls.get("patch events", 0) <= n * 10, calls


def test_nothing_happening_costs_at_most_a_status_refresh_per_job(result: SizeResult) -> None:
    idle = next(w for w in result.windows if w.name == "idle")
    assert set(idle.by_call) <= {"update spotjobs/status", "watch nodes", "watch pods", "watch spotjobs"}
    assert idle.calls <= result.config.jobs


def test_a_reconcile_makes_few_calls(result: SizeResult) -> None:
    summary = result.summary()
    assert summary["calls_per_reconcile"] is not None and summary["calls_per_reconcile"] <= 4


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["--nodes", "abc"], "--nodes takes cluster sizes of 1 node or more"),
        (["--nodes", "0"], "--nodes takes cluster sizes of 1 node or more"),
        (["--jobs", "0"], "--jobs, --per-round and --burst must be >= 1"),
        (["--rounds", "-1"], "--rounds and --idle-seconds >= 0"),
    ],
)
def test_settings_that_measure_nothing_are_usage_errors(
    argv: list[str], said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--nodes abc`` ended in a ValueError traceback; ``--nodes 0`` or ``--jobs 0`` started the test
    cluster and a controller to measure an empty cluster. Refused before anything starts."""
    from bench.controller_scale import main

    with pytest.raises(SystemExit) as stopped:
        main(argv)
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and said in err, err


def test_a_sigterm_stops_the_controller_and_the_test_cluster_it_started(tmp_path: Path) -> None:
    """Ended by SIGTERM (``timeout``, a runner's cancel), the benchmark left its controller and its
    test cluster running, with their folder, until someone killed them by hand."""
    import os
    import signal
    import subprocess
    import sys
    import time

    import psutil

    env = {**os.environ, "TMPDIR": str(tmp_path), "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    argv = ["--nodes", "2", "--jobs", "1", "--rounds", "0", "--burst", "1", "--idle-seconds", "60"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "bench.controller_scale", *argv],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip

    def ours() -> list[psutil.Process]:
        found = []
        for p in psutil.process_iter(["pid", "cmdline"]):
            if p.pid != proc.pid and any(str(tmp_path) in a for a in p.info["cmdline"] or ()):
                found.append(p)
        return found

    try:
        assert proc.stdout is not None
        for line in proc.stdout:  # the controller runs once the jobs do
            if "jobs Running" in line:
                break
        assert proc.poll() is None and ours(), "the controller started, under the benchmark's folder"
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
        deadline = time.monotonic() + 30
        while ours() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not ours(), [p.info["cmdline"] for p in ours()]
        assert not list(tmp_path.glob("spotjob-scale-*")), "its work folder is removed"
    finally:
        proc.kill()
        for p in ours():
            p.kill()
