"""The agent's HTTP control API: auth, the idempotent flush, and what /status says."""

from __future__ import annotations

import json
import logging
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agent.control_api import ControlApi, load_token
from agent.control_channel import ControlDir, RankStatus
from agent.launcher import Agent, AgentConfig

TOKEN = "s3cret-token-for-tests"


def call(
    api: ControlApi, method: str, path: str, *, token: str | None = None, body: Any = None, raw: bytes | None = None
) -> tuple[int, dict[str, Any]]:
    headers = {"Content-Type": "application/json"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    req = urllib.request.Request(api.url + path, method=method, headers=headers, data=data)
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def new_agent(tmp_path: Path) -> Agent:
    config = AgentConfig(command=["true"], checkpoint_uri="file:///ckpt", job_name="llama")
    return Agent(config, ControlDir(str(tmp_path)), env={})


@pytest.fixture
def agent(tmp_path: Path) -> Agent:
    return new_agent(tmp_path)


@pytest.fixture
def api(agent: Agent) -> Iterator[ControlApi]:
    server = ControlApi(agent, token=TOKEN)
    server.start()
    yield server
    server.stop()


class TestBinding:
    def test_without_a_token_it_binds_loopback_whatever_host_was_asked(
        self, agent: Agent, caplog: pytest.LogCaptureFixture
    ) -> None:
        with caplog.at_level(logging.WARNING):
            server = ControlApi(agent, host="0.0.0.0", token=None)
        assert server.host == "127.0.0.1" and "no API token" in caplog.text
        server.start()
        try:
            assert server.url.startswith("http://127.0.0.1:") and server.port > 0
            assert call(server, "GET", "/status")[0] == 200  # loopback-only, so no auth
        finally:
            server.stop()

    def test_with_a_token_it_keeps_the_host_it_was_given(self, agent: Agent) -> None:
        assert ControlApi(agent, host="0.0.0.0", token=TOKEN).host == "0.0.0.0"


class TestAuth:
    def test_healthz_needs_no_token(self, api: ControlApi) -> None:
        assert call(api, "GET", "/healthz") == (200, {"ok": True})

    @pytest.mark.parametrize("token", [None, "wrong", TOKEN + "x", ""])
    def test_a_missing_or_wrong_token_is_401_and_writes_no_flush(
        self, api: ControlApi, agent: Agent, token: str | None
    ) -> None:
        assert call(api, "POST", "/flush", token=token, body={"reason": "test"})[0] == 401
        assert call(api, "GET", "/status", token=token)[0] == 401
        assert not agent.control.flush_requested()

    def test_a_token_sent_under_another_scheme_is_refused(self, api: ControlApi, agent: Agent) -> None:
        req = urllib.request.Request(
            api.url + "/flush", method="POST", headers={"Authorization": f"Basic {TOKEN}"}, data=b"{}"
        )
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=10)
        assert e.value.code == 401 and e.value.headers["WWW-Authenticate"].startswith("Bearer")
        assert not agent.control.flush_requested()

    def test_the_token_is_never_logged(self, api: ControlApi, caplog: pytest.LogCaptureFixture) -> None:
        with caplog.at_level(logging.DEBUG):
            call(api, "GET", "/status", token=TOKEN)
            call(api, "GET", "/status", token="wrong")
            call(api, "POST", "/flush", token=TOKEN, body={"reason": "test"})
        assert TOKEN not in caplog.text and "refused" in caplog.text


class TestFlush:
    def test_the_right_token_writes_flush_json(self, api: ControlApi, agent: Agent) -> None:
        deadline = time.time() + 60
        status, body = call(api, "POST", "/flush", token=TOKEN, body={"reason": "node tainted", "deadline": deadline})
        assert status == 202 and body["created"] is True
        request = agent.control.flush_request()
        assert request is not None and request.id == body["flush"]["id"]
        assert request.deadline == deadline and "node tainted" in request.reason and request.reason.startswith("api")

    def test_a_second_post_returns_the_flush_under_way_and_starts_nothing(self, api: ControlApi, agent: Agent) -> None:
        first = call(api, "POST", "/flush", token=TOKEN, body={"reason": "one"})
        second = call(api, "POST", "/flush", token=TOKEN, body={"reason": "two"})
        assert first[0] == 202 and second[0] == 200
        assert second[1] == {"created": False, "flush": first[1]["flush"]}
        request = agent.control.flush_request()
        assert request is not None and request.id == first[1]["flush"]["id"] and "one" in request.reason

    def test_an_empty_body_is_a_flush_without_deadline(self, api: ControlApi, agent: Agent) -> None:
        status, body = call(api, "POST", "/flush", token=TOKEN, raw=b"")
        assert status == 202 and body["flush"]["deadline"] is None

    @pytest.mark.parametrize(
        "raw", [b"{not json", b'{"deadline": "soon"}', b'{"deadline": -1}', b'{"reason": ""}', b"[1, 2]"]
    )
    def test_an_invalid_body_is_400_and_writes_no_flush(self, api: ControlApi, agent: Agent, raw: bytes) -> None:
        status, body = call(api, "POST", "/flush", token=TOKEN, raw=raw)
        assert status == 400 and body["error"] == "invalid flush body"
        assert not agent.control.flush_requested()

    def test_unknown_fields_from_a_newer_controller_are_ignored(self, api: ControlApi) -> None:
        assert call(api, "POST", "/flush", token=TOKEN, body={"reason": "x", "priority": "high"})[0] == 202

    def test_wrong_methods_and_paths(self, api: ControlApi) -> None:
        assert call(api, "GET", "/flush", token=TOKEN)[0] == 405
        assert call(api, "POST", "/status", token=TOKEN)[0] == 405
        assert call(api, "GET", "/nope", token=TOKEN)[0] == 404


class TestStatus:
    def test_before_any_notice(self, api: ControlApi) -> None:
        status, body = call(api, "GET", "/status", token=TOKEN)
        assert status == 200
        assert body["state"] == "starting" and body["notice"] is None and body["flush"] is None
        assert body["window_ok"] is True and body["job_name"] == "llama" and body["pid"] > 0
        assert body["uptime_seconds"] >= 0

    def test_reports_the_training_state_the_notice_and_whether_the_window_holds_a_flush(
        self, api: ControlApi, agent: Agent
    ) -> None:
        agent.control.write_status(
            RankStatus(
                state="training",
                step=120,
                last_committed_step=100,
                last_committed_uri="file:///ckpt/step-000000100",
                last_save_seconds=8.0,
                world_size=4,
            )
        )
        deadline = time.time() + 5  # 5 s left, the last save took 8 s
        call(api, "POST", "/flush", token=TOKEN, body={"reason": "spot", "deadline": deadline})
        status, body = call(api, "GET", "/status", token=TOKEN)
        assert status == 200
        assert (body["state"], body["rank_state"], body["step"], body["world_size"]) == ("flushing", "training", 120, 4)
        assert body["last_committed_step"] == 100 and body["last_committed_uri"].endswith("step-000000100")
        assert body["last_save_seconds"] == 8.0
        assert body["notice"]["source"] == "api" and body["notice"]["deadline"] == deadline
        assert body["deadline"] == deadline and body["seconds_left"] <= 5
        assert body["window_ok"] is False and "may not commit in time" in body["window_message"]
        assert body["flush_result"] is None


class TestToken:
    def test_from_a_file_over_the_environment(self, tmp_path: Path) -> None:
        path = tmp_path / "token"
        path.write_text(" from-file\n")
        assert load_token(str(path), {"SPOTJOB_AGENT_TOKEN": "from-env"}) == "from-file"
        assert load_token(None, {"SPOTJOB_AGENT_TOKEN": "from-env"}) == "from-env"
        assert load_token(None, {}) is None

    def test_an_empty_token_is_an_error_not_no_auth(self, tmp_path: Path) -> None:
        path = tmp_path / "token"
        path.write_text("\n")
        with pytest.raises(ValueError, match="empty"):
            load_token(str(path), {})
        with pytest.raises(ValueError, match="empty"):
            load_token(None, {"SPOTJOB_AGENT_TOKEN": " "})
