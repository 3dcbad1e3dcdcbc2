"""``flushed_for_another_notice``: which exits 75 ``spotjob run`` saw while its interrupt's flush ran
are a preemption that came first (counted as one by ``Reconciler.driver_stopped``), and which are
that flush's. An agent flushing for a notice only it heard (a GCE host maintenance) when the
interrupt's ``POST /flush`` came starts no second flush and exits 75 for its own: its exit line
says what its flush answered, as the local backend reads it from the worker's log. Before, every
75 during the interrupt was counted as the interrupt's flush."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest

from agent.control_channel import FlushResult
from agent.exit_codes import PEER_FLUSH, decide_exit_code
from orchestrator.backends.base import FlushRequestState, WorkerObservation
from orchestrator.backends.local_worker import LocalWorker, observe_worker
from orchestrator.model import JobKey, WorkerPhase
from orchestrator.run_interrupt import InterruptState, _flush, _note_before_stop, flushed_for_another_notice

REASON = "spotjob run was interrupted (SIGINT): flushing before every process of the run stops"
COMMITTED = FlushResult(step=10, uri="file:///r/checkpoints/step-000000010", request_id="r", notice_to_commit_seconds=1)


def exited_75(tmp_path: Path, answered: str | None, kind: str = "text") -> WorkerObservation:
    """A local worker whose agent exited 75 saying ``answered`` (None: an older agent's line), as
    the local backend observes it from its log."""
    code, why = decide_exit_code(
        0, flush_requested=True, result=COMMITTED, closed_ranks=set(), expected_ranks=1, killed=False, answered=answered
    )
    message = f"exiting {code}: {why}"
    if kind == "json":
        line = json.dumps({"level": "INFO", "message": message, "command": "spotjob-agent", "pid": 7})
    else:
        line = f"2026-12-06T10:00:00.000Z INFO spotjob-agent[7] job=local/x agent.launcher: {message}"
    log = tmp_path / "x-0-0.log"
    log.write_text(f"[rank0]: exiting 75: the script's own words\n{line}\n")
    proc = subprocess.Popen([sys.executable, "-c", f"raise SystemExit({code})"])
    proc.wait()
    node = cast(Any, SimpleNamespace(name="local-node-0", zone="local-a", instance_type="local.cpu-small"))
    worker = LocalWorker("x-0-0", JobKey.local("x"), 0, 0, node, proc, str(tmp_path / "c"), str(log), "")
    return observe_worker(worker)


@pytest.mark.parametrize("kind", ["text", "json"])
@pytest.mark.parametrize(
    "answered",
    [
        "gcp maintenance: TERMINATE_ON_HOST_MAINTENANCE, the node stops in 20 s",
        "signal terminate: SIGTERM received (grace 30 s)",
        "api preemption: node tainted",  # someone else's POST /flush
        "api preemption: spotjob run was interrupted (SIGTERM): flushing before every process of the run stops",
    ],
)
def test_a_75_for_a_notice_other_than_the_interrupts_request_is_a_preemption_that_came_first(
    tmp_path: Path, kind: str, answered: str
) -> None:
    seen = exited_75(tmp_path, answered, kind)
    assert seen.flush_answered == answered
    assert flushed_for_another_notice(seen, REASON)
    state = InterruptState(signal="SIGINT", reason=REASON)
    _note_before_stop(state, [seen])
    assert state.preempted == ["x-0-0"] and state.before_stop().preempted == ("x-0-0",)
    assert state.failed == [] and state.lost == []


@pytest.mark.parametrize("answered", [f"api preemption: {REASON}", PEER_FLUSH, None], ids=["own", "peer", "unsaid"])
def test_a_75_that_answered_the_interrupts_request_or_does_not_say_is_the_interrupts(
    tmp_path: Path, answered: str | None
) -> None:
    seen = exited_75(tmp_path, answered)
    assert seen.flush_answered == answered
    assert not flushed_for_another_notice(seen, REASON)
    state = InterruptState(signal="SIGINT", reason=REASON)
    _note_before_stop(state, [seen])
    assert state.preempted == []


def test_a_75_seen_before_the_interrupt_asked_for_any_flush_is_not_its_flush(tmp_path: Path) -> None:
    for answered in (None, f"api preemption: {REASON}"):
        assert flushed_for_another_notice(exited_75(tmp_path, answered), None)
    state = InterruptState(signal="SIGINT")
    _note_before_stop(state, [exited_75(tmp_path, None)])
    assert state.preempted == ["x-0-0"]


def test_the_interrupts_flush_is_named_as_the_agent_that_heard_the_notice_not_a_peer_that_exited_first(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Worker 1's agent flushed for a host maintenance only it heard; worker 0's ranks flushed the
    same step with them and its agent exited 75 first, before the interrupt asked for any flush (a
    preemption that came first, as both are). The interrupt's Event named worker 0's agent as the one
    that "began [the flush] for a notice of its own", and the log said worker 0's agent flushed "for
    a flush of its own" while quoting its line that says it heard none. The flush is worker 1's."""
    peer = replace(exited_75(tmp_path, PEER_FLUSH), name="x-0-0")
    hearer = replace(exited_75(tmp_path, "gcp maintenance: TERMINATE_ON_HOST_MAINTENANCE"), name="x-0-1")
    state = InterruptState(signal="SIGINT")
    with caplog.at_level(logging.WARNING, logger="orchestrator"):
        _note_before_stop(state, [peer])  # as the interrupt came: only worker 0 had exited
        running = replace(hearer, phase=WorkerPhase.RUNNING, exit_code=None)
        backend = SimpleNamespace(
            request_flush=lambda *_: FlushRequestState.accepted(),
            list_workers=lambda *_: [peer, hearer],
        )
        spec = cast(Any, SimpleNamespace())
        out = _flush(cast(Any, backend), JobKey.local("x"), spec, state, [running], None, lambda _: None)
    assert set(state.preempted) == {"x-0-0", "x-0-1"}
    assert out.own_flush_of == "x-0-1"
    committed = replace(out, step=10, uri="file:///r/checkpoints/step-000000010")  # as storage then says
    assert "the flush x-0-1's agent began for a notice of its own" in committed.event(7)[2]
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("the agent of x-0-0 exited 75")]
    assert said and all("for a flush of its own" not in m for m in said), said
