"""The controller's side of the agents' control API (orchestrator.k8s.agents): derived tokens, and
flush/stop/status requests that run in the background against the real agent's API server."""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from agent.control_api import ControlApi
from agent.control_channel import ControlDir, RankStatus
from agent.launcher import Agent, AgentConfig
from orchestrator.k8s.agents import (
    AgentCalls,
    AgentReport,
    CallResult,
    CallState,
    Endpoint,
    TokenKeyError,
    derive_token,
    load_token_key,
)

KEY = b"k" * 32


@pytest.fixture
def agent(tmp_path: Path) -> Agent:
    config = AgentConfig(command=["true"], checkpoint_uri="file:///ckpt", job_name="ml/llama")
    return Agent(config, ControlDir(str(tmp_path / "control")), env={})


@pytest.fixture
def api(agent: Agent) -> Iterator[ControlApi]:
    server = ControlApi(agent, token=derive_token(KEY, "ml", "llama", "uid-1"))
    server.start()
    yield server
    server.stop()


@pytest.fixture
def calls(api: ControlApi) -> Iterator[AgentCalls]:
    client = AgentCalls(port=api.port, timeout=5.0, status_max_age=0.0)
    yield client
    client.close()


def endpoint(uid: str = "pod-uid-1", token: str | None = None) -> Endpoint:
    return Endpoint(uid, "llama-0-0", "127.0.0.1", token or derive_token(KEY, "ml", "llama", "uid-1"))


def settle(calls: AgentCalls, what: str, uid: str = "pod-uid-1", tag: str = "") -> CallResult:
    """The request's outcome once it is done (waits for the background thread, not for time)."""
    done = threading.Event()

    def poll() -> None:
        while True:
            state = calls.state(what, uid, tag)
            if state is not None and state.state is not CallState.PENDING:
                done.set()
                return
            threading.Event().wait(0.01)

    threading.Thread(target=poll, daemon=True).start()
    assert done.wait(30), f"the {what} request never finished"
    result = calls.state(what, uid, tag)
    assert result is not None
    return result


def reported(calls: AgentCalls) -> AgentReport:
    """The report once the background refresh has read the agent's status (step 7, as these
    tests' agents answer); waits for the thread, not for time."""
    calls.report(endpoint())
    for _ in range(3000):
        if calls.report(endpoint()).step == 7:
            break
        threading.Event().wait(0.01)
    return calls.report(endpoint())


def test_a_token_is_derived_from_the_key_and_the_jobs_identity_and_incarnation() -> None:
    token = derive_token(KEY, "ml", "llama", "uid-1")
    assert token == derive_token(KEY, "ml", "llama", "uid-1")  # any replica computes the same
    assert len(token) == 43 and token.isascii()
    others = {
        derive_token(b"x" * 32, "ml", "llama", "uid-1"),
        derive_token(KEY, "ml", "llama", "uid-2"),  # the job deleted and created again
        derive_token(KEY, "ml2", "llama", "uid-1"),
        derive_token(KEY, "ml", "llama2", "uid-1"),
    }
    assert token not in others and len(others) == 4


def test_an_endpoint_printed_or_logged_never_shows_its_token(caplog: pytest.LogCaptureFixture) -> None:
    """The dataclass's own repr held the agent's bearer token: an endpoint in a log line, a
    traceback's locals or an assertion's message gave away what flushes and stops the job."""
    ep = endpoint()
    with caplog.at_level(logging.DEBUG):
        logging.getLogger("orchestrator.k8s.agents").debug("calling %s (%r): %s", ep, ep, [ep])
    shown = [repr(ep), str(ep), f"{ep}", repr({ep.pod_uid: ep}), caplog.text]
    assert all(ep.token not in text and "token=<redacted>" in text for text in shown), shown
    assert "pod='llama-0-0'" in repr(ep) and "ip='127.0.0.1'" in repr(ep)
    assert ep == endpoint() and ep != endpoint(token="another")  # the token still tells two apart


def test_a_token_key_must_be_readable_and_long_enough(tmp_path: Path) -> None:
    good = tmp_path / "key"
    good.write_text("a" * 40 + "\n")
    assert load_token_key(str(good)) == b"a" * 40
    short = tmp_path / "short"
    short.write_text("abc")
    with pytest.raises(TokenKeyError, match="at least 32"):
        load_token_key(str(short))
    with pytest.raises(TokenKeyError, match="cannot read"):
        load_token_key(str(tmp_path / "missing"))
    assert len(load_token_key(None)) >= 32  # a random one, with a warning


def test_a_flush_is_pending_then_accepted_and_the_agent_has_it(agent: Agent, calls: AgentCalls) -> None:
    deadline = datetime.now(UTC) + timedelta(seconds=60)
    first = calls.flush(endpoint(), "SpotInterrupted for node a", deadline)
    assert first.state is CallState.PENDING  # answered at once; the POST runs in the background
    assert settle(calls, "flush").state is CallState.ACCEPTED
    flush = agent.control.flush_request()
    assert flush is not None and flush.reason.endswith("SpotInterrupted for node a")
    assert flush.deadline == pytest.approx(deadline.timestamp())
    # Asking again answers the first outcome and sends nothing new.
    assert calls.flush(endpoint(), "again", None).state is CallState.ACCEPTED


def test_a_wrong_token_fails_naming_the_key_and_the_next_call_tries_again(agent: Agent, calls: AgentCalls) -> None:
    wrong = endpoint(token=derive_token(b"z" * 32, "ml", "llama", "uid-1"))
    calls.flush(wrong, "notice", None)
    failed = settle(calls, "flush")
    assert failed.state is CallState.FAILED and "--agent-token-key-file" in failed.detail
    # A pod IP reused by another job's pod (whose agent knows another token) is refused the same way.
    assert "another pod's agent" in failed.detail
    assert agent.control.flush_request() is None
    assert calls.flush(wrong, "notice", None).state is CallState.FAILED  # the failure, answered once
    assert calls.flush(endpoint(), "notice", None).state is CallState.PENDING  # then a new request
    assert settle(calls, "flush").state is CallState.ACCEPTED


def test_an_agent_that_cannot_be_reached_is_a_failure_not_a_hang() -> None:
    calls = AgentCalls(port=9, timeout=2.0)  # discard: nothing listens
    try:
        assert calls.flush(endpoint(), "notice", None).state is CallState.PENDING
        result = settle(calls, "flush")
        assert result.state is CallState.FAILED and "cannot reach the agent" in result.detail
    finally:
        calls.close()


def test_a_hung_agent_never_blocks_the_caller(calls: AgentCalls) -> None:
    release = threading.Event()

    def hanging(*_: object) -> tuple[int, bytes]:
        release.wait(30)
        return 202, b"{}"

    stuck = AgentCalls(port=calls.port, transport=hanging)
    try:
        for _ in range(3):
            assert stuck.flush(endpoint(), "notice", None).state is CallState.PENDING
        release.set()
        assert settle(stuck, "flush").state is CallState.ACCEPTED
    finally:
        stuck.close()


def test_a_stop_is_sent_without_a_flush(agent: Agent, calls: AgentCalls) -> None:
    calls.stop(endpoint(), "a peer's code failed")
    assert settle(calls, "stop").state is CallState.ACCEPTED
    assert agent.status().stop is not None and agent.control.flush_request() is None


def test_the_step_comes_from_the_agents_status_in_the_background(agent: Agent, calls: AgentCalls) -> None:
    assert calls.step(endpoint()) is None  # nothing known yet; a refresh starts
    agent.control.write_status(RankStatus(state="training", step=42, world_size=2))

    def step() -> int | None:
        return calls.step(endpoint())

    seen = None
    for _ in range(3000):
        seen = step()
        if seen == 42:
            break
        threading.Event().wait(0.01)
    assert seen == 42
    calls.forget("pod-uid-1")
    assert calls.state("flush", "pod-uid-1") is None


def test_a_save_is_asked_once_per_request_id_and_a_new_id_asks_again(agent: Agent, calls: AgentCalls) -> None:
    assert calls.save(endpoint(), "req-1", "kubectl spotjob flush").state is CallState.PENDING
    assert settle(calls, "save", tag="req-1").state is CallState.ACCEPTED
    written = agent.control.save_request()
    assert written is not None and written.id == "req-1" and not agent.control.flush_requested()

    agent.control.clear_save_request()  # the ranks served it
    assert calls.save(endpoint(), "req-1", "again").state is CallState.ACCEPTED  # remembered: no second call
    assert agent.control.save_request() is None

    calls.save(endpoint(), "req-2", "another")
    assert settle(calls, "save", tag="req-2").state is CallState.ACCEPTED
    assert agent.control.save_request().id == "req-2"  # type: ignore[union-attr]


def test_an_agent_whose_packets_are_dropped_fails_pointing_at_a_network_policy_and_a_refusal_does_not() -> None:
    """A NetworkPolicy that does not admit the controller drops its packets: the connection times
    out. Modeled by the kernel itself: a listener whose accept queue is full drops the next SYN, as
    a policy would. Before, the failure said only "timed out"; it names the policy and the port to
    open now, and a port nobody listens on (refused at once) is not blamed on one."""
    import socket

    full = socket.socket()
    held = socket.socket()
    try:
        full.bind(("127.0.0.1", 0))
        full.listen(0)
        held.connect(full.getsockname())  # fills the accept queue: the next SYN is dropped
        calls = AgentCalls(port=full.getsockname()[1], timeout=1.0)
        try:
            calls.flush(endpoint(), "notice", None)
            result = settle(calls, "flush")
        finally:
            calls.close()
        assert result.state is CallState.FAILED
        assert "no answer to the connection within 1s" in result.detail, result.detail
        assert "NetworkPolicy" in result.detail and f"port {full.getsockname()[1]}" in result.detail, result.detail
        assert "Locked-down namespaces" in result.detail
    finally:
        held.close()
        full.close()

    refused = AgentCalls(port=9, timeout=2.0)  # discard: nothing listens, the kernel refuses
    try:
        refused.flush(endpoint(), "notice", None)
        detail = settle(refused, "flush").detail
        assert "cannot reach the agent" in detail and "NetworkPolicy" not in detail, detail
    finally:
        refused.close()


def test_agents_whose_packets_are_dropped_do_not_hold_up_the_flush_of_a_reachable_one(
    agent: Agent, api: ControlApi
) -> None:
    """A mass preemption: the nodes of many workers are gone (their packets dropped, each request
    waits out its timeout) while one agent is still there to flush. Before, flush requests ran on a
    pool of 8 threads: eight dead agents held every thread for their whole timeout, and the live
    agent's request waited behind them — longer than a 30 s notice allows at the default timeout
    once a gang has a few dozen dead workers. Now every flush request is sent at once.

    The dead agents are modeled as in the test above (a listener on another loopback address whose
    accept queue is full drops the SYNs); what is asserted is order: the live agent accepted while
    the dead ones were still waiting, never a duration."""
    import socket

    full, held = socket.socket(), socket.socket()
    calls = AgentCalls(port=api.port, timeout=20.0)
    try:
        full.bind(("127.0.0.2", api.port))
        full.listen(0)
        held.connect(full.getsockname())  # fills the accept queue: the next SYNs are dropped
        dead = [Endpoint(f"dead-{i}", f"llama-0-{i + 1}", "127.0.0.2", endpoint().token) for i in range(8)]
        for e in dead:
            assert calls.flush(e, "notice", None).state is CallState.PENDING
        calls.flush(endpoint(), "notice", None)
        assert settle(calls, "flush").state is CallState.ACCEPTED
        still = [calls.state("flush", e.pod_uid) for e in dead]
        assert all(s is not None and s.state is CallState.PENDING for s in still), still
        assert agent.control.flush_request() is not None
        held.close()
        full.close()  # the dead agents' next SYN is refused: their requests end, quietly, before the test does
        assert all(settle(calls, "flush", e.pod_uid).state is CallState.FAILED for e in dead)
    finally:
        calls.close()
        held.close()
        full.close()


@pytest.mark.parametrize(
    "body",
    [
        b'{"state": "running", "step": 7}',
        b'{"state": "running", "step": 7, "held_notice": "soon", "flush_at": "later"}',
        b'{"state": "running", "step": 7, "held_notice": {"kind": "maintenance"}, "flush_at": 1}',
    ],
    ids=["older-agent", "not-an-object", "no-source"],
)
def test_an_agent_whose_status_has_no_held_notice_of_its_shape_reports_its_step_and_none(body: bytes) -> None:
    """An agent older than ``held_notice``/``flush_at`` (or one answering something else there)
    still reports its step, and holds no notice as far as the controller can tell. The transport is
    replaced to answer as such an agent would; what it does not model is the network."""

    def older_agent(*_: object) -> tuple[int, bytes]:
        return 200, body

    calls = AgentCalls(port=1, status_max_age=0.0, transport=older_agent)
    try:
        reported(calls)
        assert calls.report(endpoint()) == AgentReport(step=7, held_notice=None)
    finally:
        calls.close()


@pytest.mark.parametrize(
    ("said", "kept"),
    [(None, None), (5, None), ("", None), ("no rank has connected", "no rank has connected"), ("x" * 5000, "x" * 900)],
    ids=["older-agent", "not-a-string", "empty", "said", "bounded"],
)
def test_the_agents_word_that_its_ranks_have_not_connected_is_kept_bounded(said: object, kept: str | None) -> None:
    """``ranks_not_meeting`` goes into an Event and the job's status: only a string, at most 900
    characters (pins the parsing; the field's path end to end is in tests/e2e_k8s). The transport is
    replaced to answer as such an agent would; what it does not model is the network."""
    body = json.dumps({"state": "running", "step": 7, "ranks_not_meeting": said}).encode()
    calls = AgentCalls(port=1, status_max_age=0.0, transport=lambda *_: (200, body))
    try:
        reported(calls)
        assert calls.report(endpoint()).ranks_not_meeting == kept
    finally:
        calls.close()


def test_an_agent_reports_what_its_ranks_do_so_a_timed_out_flush_can_name_the_ones_that_never_took_it() -> None:
    """``rank_state`` of an agent's ``/status``: the controller keeps it beside the step
    (``WorkerObservation.ranks_state``), and a FlushTimedOut names the workers by it."""

    def agent_answers(*_: object) -> tuple[int, bytes]:
        return 200, b'{"state": "flushing", "rank_state": "flushing", "step": 7}'

    calls = AgentCalls(port=1, status_max_age=0.0, transport=agent_answers)
    try:
        reported(calls)
        assert calls.report(endpoint()).ranks_state == "flushing"
    finally:
        calls.close()


def test_the_step_the_ranks_restored_and_the_checkpoint_they_passed_over_come_from_the_agents_status(
    agent: Agent, calls: AgentCalls
) -> None:
    """``restored_step`` and ``restore_passed_over`` of the real agent's ``/status`` (from its ranks'
    ``status.json``) reach ``AgentReport.restored``, which the Kubernetes backend hands to the
    reconciler as ``WorkerObservation.restored`` (its CheckpointUnusable for a damaged byte). Before
    the ranks' restore returned, the agent says nothing restored; a later answer that says nothing
    (the ranks' status.json rewritten without it) keeps what the restore said."""
    agent.control.write_status(RankStatus(state="starting", step=7, world_size=2))
    assert reported(calls).restored is None  # no restore returned yet: the agent answers null
    why = "file:///ckpt/step-9: CRC32C mismatch in rank-0/model.pt"
    agent.control.write_status(
        RankStatus(state="training", step=8, world_size=2, restored_step=5, restore_passed_over=why)
    )
    for _ in range(3000):
        if calls.report(endpoint()).step == 8:
            break
        threading.Event().wait(0.01)
    assert calls.report(endpoint()) == AgentReport(step=8, ranks_state="training", restored=(5, why))

    agent.control.write_status(RankStatus(state="training", step=9, world_size=2))
    for _ in range(3000):
        if calls.report(endpoint()).step == 9:
            break
        threading.Event().wait(0.01)
    assert calls.report(endpoint()).restored == (5, why)


def test_an_agent_that_restored_the_newest_checkpoint_reports_its_step_and_nothing_passed_over(
    agent: Agent, calls: AgentCalls
) -> None:
    agent.control.write_status(RankStatus(state="training", step=7, world_size=2, restored_step=0))
    for _ in range(3000):
        if calls.report(endpoint()).restored is not None:
            break
        threading.Event().wait(0.01)
    assert calls.report(endpoint()).restored == (0, None)  # from step 0: nothing to restore, none passed over


@pytest.mark.parametrize(
    ("fields", "kept"),
    [
        ({}, None),
        ({"restored_step": None, "restore_passed_over": None}, None),
        ({"restored_step": 5, "restore_passed_over": "x" * 5000}, (5, "x" * 900)),
        ({"restored_step": 5, "restore_passed_over": ""}, (5, None)),
    ],
    ids=["older-agent", "nothing-restored-yet", "bounded", "empty-reason"],
)
def test_an_agent_that_says_no_restored_step_or_one_of_its_shape_is_taken_quietly(
    fields: dict[str, object], kept: tuple[int, str | None] | None, caplog: pytest.LogCaptureFixture
) -> None:
    """An agent older than ``restored_step``/``restore_passed_over`` sends neither key: it reports
    its step and nothing restored, with no log line (the reconciler then tells no
    CheckpointUnusable of the ranks'). The reason goes into an Event and the job's status: at most
    900 characters. The transport is replaced to answer as such an agent would; what it does not
    model is the network."""
    body = json.dumps({"state": "running", "step": 7, **fields}).encode()
    calls = AgentCalls(port=1, status_max_age=0.0, transport=lambda *_: (200, body))
    try:
        with caplog.at_level(logging.DEBUG, logger="orchestrator.k8s.agents"):
            reported(calls)
        assert calls.report(endpoint()) == AgentReport(step=7, restored=kept)
        assert "restored_step" not in caplog.text
    finally:
        calls.close()


@pytest.mark.parametrize(
    ("fields", "kept"),
    [
        ({"restored_step": "5", "restore_passed_over": "why"}, None),
        ({"restored_step": -1}, None),
        ({"restored_step": True}, None),
        ({"restored_step": 5.5}, None),
        ({"restored_step": {"step": 5}, "restore_passed_over": ["why"]}, None),
        ({"restored_step": 5, "restore_passed_over": 42}, (5, None)),
    ],
    ids=["string-step", "negative", "bool", "float", "object", "reason-not-a-string"],
)
def test_an_agent_whose_restored_step_is_not_of_its_shape_is_ignored_with_a_log_line_once(
    fields: dict[str, object], kept: tuple[int, str | None] | None, caplog: pytest.LogCaptureFixture
) -> None:
    """A malformed ``restored_step``/``restore_passed_over`` (no spotjob agent sends one: its model
    types them; another agent or a proxy could) never fails the status refresh nor the
    controller: the step is still reported, the malformed value is ignored as if absent, and one
    log line names the pod and what it sent, not one per refresh."""
    body = json.dumps({"state": "running", "step": 7, "rank_state": "training", **fields}).encode()
    answers: list[int] = []

    def agent_answers(*_: object) -> tuple[int, bytes]:
        answers.append(1)
        return 200, body

    calls = AgentCalls(port=1, status_max_age=0.0, transport=agent_answers)
    try:
        with caplog.at_level(logging.WARNING, logger="orchestrator.k8s.agents"):
            reported(calls)
            for _ in range(3000):  # a second answer, read the same way
                if len(answers) >= 3:
                    break
                calls.report(endpoint())
                threading.Event().wait(0.01)
            assert calls.report(endpoint()) == AgentReport(step=7, ranks_state="training", restored=kept)
        lines = [r.getMessage() for r in caplog.records if "restored_step" in r.getMessage()]
        assert len(answers) >= 3 and len(lines) == 1, (answers, lines)
        assert "llama-0-0" in lines[0] and "ignored" in lines[0], lines
    finally:
        calls.close()
