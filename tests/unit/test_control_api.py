"""The agent's HTTP control API: auth, the idempotent flush, and what /status says."""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import struct
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from agent import control_api
from agent.control_api import MAX_BODY_BYTES, ControlApi, load_token
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
        status, body = call(api, "GET", "/status", token=token)
        assert status == 401 and body["error"] == "unauthorized"
        # It said only "unauthorized", detail null: not what the client should send.
        assert "Authorization: Bearer <token>" in body["detail"] and "SPOTJOB_AGENT_TOKEN" in body["detail"]
        assert TOKEN not in json.dumps(body)
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

    def test_a_token_sent_in_a_query_string_is_not_logged(
        self, api: ControlApi, caplog: pytest.LogCaptureFixture
    ) -> None:
        """A client that puts the token in the URL (which the API never reads) leaves it out of the
        log: before, the debug line of every request quoted the request line whole, query included."""
        with caplog.at_level(logging.DEBUG, logger="agent.control_api"):
            assert call(api, "GET", f"/status?token={TOKEN}")[0] == 401
            assert call(api, "GET", f"/healthz?token={TOKEN}")[0] == 200
            assert raw(api, f"GET /status?t={TOKEN} HTTP/1.0\r\n\r\n".encode())[0] == 401
        assert TOKEN not in caplog.text and "GET /healthz?" in caplog.text


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
        # Unlike every other SPOTJOB_* setting, an empty token is no "unset": that would mean no auth.
        with pytest.raises(ValueError, match="set but empty"):
            load_token(None, {"SPOTJOB_AGENT_TOKEN": ""})

    def test_a_token_that_cannot_be_had_names_the_setting_and_what_to_do(self, tmp_path: Path) -> None:
        """spotjob-agent said "cannot read the API token: [Errno 2] No such file or directory: '...'",
        and "SPOTJOB_AGENT_TOKEN is set but empty", with no word of what to do."""
        missing, empty, binary = tmp_path / "missing", tmp_path / "empty", tmp_path / "binary"
        empty.write_text("")
        binary.write_bytes(b"\xff\xfe")
        for path, why in (
            (missing, "No such file or directory"),
            (tmp_path, "Is a directory"),
            (binary, "not UTF-8 text"),
        ):
            with pytest.raises(ValueError) as e:
                load_token(str(path), {})
            assert f"--token-file {path}: cannot read it ({why})" in str(e.value)
            assert "leave the option out and set SPOTJOB_AGENT_TOKEN" in str(e.value)
        with pytest.raises(ValueError, match="write the token into it") as e:
            load_token(str(empty), {})
        with pytest.raises(ValueError, match="set it to the token, or unset it"):
            load_token(None, {"SPOTJOB_AGENT_TOKEN": ""})


# A client of another user that binds its socket to another loopback address on the API's own port
# (127.0.0.2:<port>, which nothing holds), then asks for /stop.
_OTHER_USER_CLIENT = """
import socket, sys
port = int(sys.argv[1])
for _ in range(5):
    s = socket.socket()
    s.bind(("127.0.0.2", port))
    s.connect(("127.0.0.1", port))
    s.sendall(b"POST /stop HTTP/1.0\\r\\nContent-Length: 2\\r\\n\\r\\n{}")
    data = b""
    while chunk := s.recv(65536):
        data += chunk
    print(data.split()[1].decode())
    s.close()
"""


class TestWithoutAToken:
    @pytest.mark.skipif(not hasattr(os, "getuid") or os.getuid() != 0, reason="needs root to act as another user")
    def test_another_user_connecting_from_the_apis_own_port_is_still_refused(self, agent: Agent) -> None:
        """Before, the client's user was looked up in /proc/net/tcp by ports alone (local port = the
        client's, remote port = the API's). A client bound to 127.0.0.2 on the API's own port
        matched the agent's own accepted socket as well (local 127.0.0.1:<port>, remote
        127.0.0.2:<port>), which is listed first more often than not: another user's POST /stop got
        202. Now addresses count too, and it gets 403 every time."""
        python = shutil.which("python3", path="/usr/bin:/bin")  # one that user may run (not the venv's)
        if python is None:
            pytest.skip("no system python3 for the other user")
        server = ControlApi(agent)
        server.start()
        try:
            other = subprocess.run(
                [python, "-c", _OTHER_USER_CLIENT, str(server.port)],
                user=65534,
                capture_output=True,
                text=True,
                timeout=60,
            )
        finally:
            server.stop()
        assert other.stdout.split() == ["403"] * 5, other.stdout + other.stderr
        assert agent.status().stop is None

    @pytest.mark.skipif(not hasattr(os, "getuid") or os.getuid() != 0, reason="needs root to act as another user")
    def test_another_user_whose_socket_is_gone_when_its_request_is_read_is_refused(
        self, agent: Agent, caplog: pytest.LogCaptureFixture
    ) -> None:
        """Before, a client socket not found in /proc/net/tcp counted as "cannot tell" (as on macOS)
        and was served, and one closed already (a timewait entry) read as root's: another user who
        sent POST /stop and reset the connection at once (SO_LINGER 0) stopped the job, most often
        at the first try. Now a socket that is gone or has no owner is refused, where /proc is there."""
        python = shutil.which("python3", path="/usr/bin:/bin")
        if python is None:
            pytest.skip("no system python3 for the other user")
        server = ControlApi(agent)
        server.start()
        client = (
            "import socket, struct, sys\n"
            "s = socket.create_connection(('127.0.0.1', int(sys.argv[1])))\n"
            "s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack('ii', 1, 0))\n"
            "s.sendall(b'POST /stop HTTP/1.0\\r\\nContent-Length: 0\\r\\n\\r\\n')\n"
            "s.close()\n"
        )

        def served(tries: int) -> bool:  # each connection answered, refused or dropped
            said = [r.getMessage() for r in caplog.records if r.name == "agent.control_api"]
            return sum(("refused" in m or "ended" in m or '" 20' in m) for m in said) >= tries

        try:
            with caplog.at_level(logging.DEBUG):
                for tries in range(1, 6):
                    subprocess.run([python, "-c", client, str(server.port)], user=65534, timeout=60, check=True)
                    wait_until(lambda n=tries: served(n) or agent.status().stop is not None, "the request served")
                    assert agent.status().stop is None, f"stopped at try {tries}"
        finally:
            server.stop()

    @pytest.mark.skipif(not hasattr(os, "getuid") or os.getuid() != 0, reason="needs root to act as another user")
    def test_another_user_on_ipv6_loopback_is_refused(self, agent: Agent) -> None:
        """Pins what worked before the match by address: the client's socket is found in
        /proc/net/tcp6 too (a socket not found would let the request through)."""
        python = shutil.which("python3", path="/usr/bin:/bin")
        if python is None or not socket.has_ipv6:
            pytest.skip("no system python3 for the other user, or no IPv6")
        server = ControlApi(agent, host="::1")
        try:
            server.start()
        except control_api.ControlApiBindError:
            pytest.skip("no IPv6 loopback here")
        client = (
            "import socket, sys\n"
            "s = socket.create_connection(('::1', int(sys.argv[1])))\n"
            "s.sendall(b'POST /stop HTTP/1.0\\r\\n\\r\\n')\n"
            "print(s.recv(100).split()[1].decode())\n"
        )
        try:
            other = subprocess.run(
                [python, "-c", client, str(server.port)], user=65534, capture_output=True, text=True, timeout=60
            )
        finally:
            server.stop()
        assert other.stdout.split() == ["403"], other.stdout + other.stderr
        assert agent.status().stop is None


# -- facing a pod network ---------------------------------------------------------------------------

WAIT = 30.0


def wait_until(predicate: Callable[[], bool], what: str) -> None:
    give_up = time.monotonic() + WAIT
    while not predicate():
        if time.monotonic() > give_up:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def read_response(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """Everything the server sends until it closes: (status, lower-cased headers, body)."""
    sock.settimeout(WAIT)
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    return int(lines[0].split()[1]), headers, body


def raw(api: ControlApi, data: bytes) -> tuple[int, dict[str, str], bytes]:
    with socket.create_connection(("127.0.0.1", api.port), timeout=WAIT) as sock:
        sock.sendall(data)
        return read_response(sock)


def post(path: str, body: bytes, *extra: str, token: str = TOKEN) -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: x", f"Authorization: Bearer {token}", *extra]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


@pytest.fixture
def make_api(agent: Agent) -> Iterator[Callable[..., ControlApi]]:
    servers: list[ControlApi] = []

    def make(**kw: Any) -> ControlApi:
        server = ControlApi(agent, token=TOKEN, **kw)
        server.start()
        servers.append(server)
        return server

    yield make
    for server in servers:
        server.stop()


class TestConnections:
    def test_with_every_slot_serving_an_arrived_request_a_further_connection_gets_503_at_once(
        self, make_api: Callable[..., ControlApi], agent: Agent, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """(Pins behaviour that already worked.) ``/status`` is held inside the handler (the one
        seam patched) so that every slot serves a request that has arrived: none is cut off."""
        release = threading.Event()
        served = agent.status
        arrived = threading.Semaphore(0)

        def held_status() -> Any:
            arrived.release()
            release.wait(WAIT)
            return served()

        monkeypatch.setattr(agent, "status", held_status)
        api = make_api(max_connections=4, request_timeout=600)
        holders = [
            threading.Thread(target=call, args=(api, "GET", "/status"), kwargs={"token": TOKEN}) for _ in range(4)
        ]
        for t in holders:
            t.start()
        try:
            # Inside the handler, not only connected: a connection whose request is still arriving
            # would make room for the next one (README), and the 503 below would be a 200.
            for _ in range(4):
                assert arrived.acquire(timeout=WAIT), "four requests being served"
            assert api.open_connections == 4
            for _ in range(3):
                status, headers, body = raw(api, b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
                assert status == 503 and headers["retry-after"] == "1" and json.loads(body)["error"]
        finally:
            release.set()
            for t in holders:
                t.join()
        wait_until(lambda: api.open_connections == 0, "the slots to be freed once answered")
        assert call(api, "GET", "/healthz") == (200, {"ok": True})

    def test_with_every_slot_held_by_unfinished_requests_a_new_connection_cuts_off_the_oldest(
        self, make_api: Callable[..., ControlApi], agent: Agent
    ) -> None:
        api = make_api(max_connections=4, request_timeout=600)
        slow = [socket.create_connection(("127.0.0.1", api.port), timeout=WAIT) for _ in range(4)]
        try:
            for s in slow:
                s.sendall(b"GET /status HTTP/1.1\r\nHost: x\r\n")  # headers never finish
            wait_until(lambda: api.open_connections == 4, "four connections held")
            status, _, body = raw(api, post("/flush", b"{}", "Content-Length: 2"))
            assert status == 202 and json.loads(body)["created"] is True
            assert read_response(slow[0])[0] == 408  # the oldest made room; the others wait on
            assert agent.control.flush_requested()
        finally:
            for s in slow:
                s.close()
        wait_until(lambda: api.open_connections == 0, "the slots to be freed when the clients hang up")

    def test_a_client_trickling_its_headers_is_cut_off_with_408_and_changes_nothing(
        self, make_api: Callable[..., ControlApi], agent: Agent
    ) -> None:
        api = make_api(request_timeout=0.5)
        request = post("/flush", b"{}", "Content-Length: 2")
        with socket.create_connection(("127.0.0.1", api.port), timeout=WAIT) as sock:
            # One byte every 0.1 s: each read is quick, only the whole request is slow.
            for byte in request[:-4]:
                try:
                    sock.send(bytes([byte]))
                except OSError:
                    break
                time.sleep(0.1)
                if api.open_connections == 0:
                    break
            status, _, body = read_response(sock)
        assert status == 408 and json.loads(body) == {"error": "request timeout", "detail": None}
        assert not agent.control.flush_requested()

    def test_a_body_that_never_arrives_is_cut_off_with_408(
        self, make_api: Callable[..., ControlApi], agent: Agent
    ) -> None:
        api = make_api(request_timeout=0.5)
        with socket.create_connection(("127.0.0.1", api.port), timeout=WAIT) as sock:
            sock.sendall(post("/flush", b'{"rea', "Content-Length: 100"))
            status, _, _ = read_response(sock)
        assert status == 408 and not agent.control.flush_requested()
        wait_until(lambda: api.open_connections == 0, "the slot to be freed")

    def test_a_client_that_hangs_up_is_no_error(
        self, api: ControlApi, caplog: pytest.LogCaptureFixture, capfd: pytest.CaptureFixture[str]
    ) -> None:
        with caplog.at_level(logging.DEBUG):
            with socket.create_connection(("127.0.0.1", api.port)) as sock:
                sock.sendall(post("/flush", b'{"reason": "x"', "Content-Length: 100"))
            # A reset while the answer is written (SO_LINGER 0 sends RST on close).
            with socket.create_connection(("127.0.0.1", api.port)) as sock:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                sock.sendall(
                    b"GET /status HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + TOKEN.encode() + b"\r\n\r\n"
                )
            wait_until(lambda: api.open_connections == 0, "both connections to end")
        assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
        assert "Traceback" not in capfd.readouterr().err

    @pytest.mark.parametrize(
        "sent",
        [
            b"POST /flush HTTP/1.1",
            b"POST /flush HTTP/1.1\r\nHost: x\r\n",
            b"POST /flush HTTP/1.1\r\nHost: x\r\nAuthorization: Bear",
            b"POST /flush HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + TOKEN[:5].encode(),
        ],
        ids=["request line", "after a header", "mid-header", "mid-token"],
    )
    def test_a_request_cut_off_mid_headers_is_no_auth_failure_and_a_missing_token_still_is(
        self, api: ControlApi, agent: Agent, sent: bytes, caplog: pytest.LogCaptureFixture
    ) -> None:
        """parse_request takes end-of-file for the end of the headers: a client hanging up (or cut
        off at the agent's exit) before its Authorization header arrived was answered 401 and
        logged as a refused token, a warning of an auth failure that never was."""
        with caplog.at_level(logging.DEBUG, logger="agent.control_api"):
            with socket.create_connection(("127.0.0.1", api.port), timeout=WAIT) as sock:
                sock.sendall(sent)
                sock.shutdown(socket.SHUT_WR)
                status, _, body = read_response(sock)
            assert status == 400 and json.loads(body)["error"] == "the request ended before its headers did"
            said = [(r.levelno, r.getMessage()) for r in caplog.records]
            assert not [m for level, m in said if level >= logging.INFO], said
            assert any("ended before its headers did (the client hung up)" in m for _, m in said)
            caplog.clear()
            # The same request, whole, without its token: an auth failure, said as one.
            assert raw(api, b"POST /flush HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n")[0] == 401
        warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert warned == ["control API: refused POST /flush from 127.0.0.1 (missing or wrong token)"]
        assert not agent.control.flush_requested()


class TestServerStop:
    def test_stop_does_not_wait_for_the_serving_loops_next_poll(
        self, agent: Agent, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        # An agent's exit (and so every restart) waits for stop(); with a poll of a minute, a stop
        # that waited for the loop's next poll would take up to that minute.
        monkeypatch.setattr(control_api, "SERVE_POLL", 60.0)
        server = ControlApi(agent, token=TOKEN)
        server.start()
        assert call(server, "GET", "/healthz")[0] == 200
        stopper = threading.Thread(target=server.stop, daemon=True)
        stopper.start()
        stopper.join(timeout=20)
        assert not stopper.is_alive(), "stop() waited for the serving loop's poll"
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", server.port), timeout=2).close()


class TestRequests:
    @pytest.mark.parametrize(
        ("header", "status"),
        [
            ("Content-Length: -1", 400),
            ("Content-Length: abc", 400),
            ("Content-Length: 1e3", 400),
            (f"Content-Length: {MAX_BODY_BYTES + 1}", 413),
            ("Content-Length: 99999999999999999999", 413),
            ("Transfer-Encoding: chunked", 411),
        ],
    )
    def test_a_bad_or_oversized_content_length_is_refused_and_writes_no_flush(
        self, api: ControlApi, agent: Agent, header: str, status: int
    ) -> None:
        got, headers, body = raw(api, post("/flush", b'{"reason": "x"}', header))
        assert got == status and headers["content-type"] == "application/json" and json.loads(body)["error"]
        assert not agent.control.flush_requested()

    def test_a_content_length_of_a_non_ascii_digit_is_400_not_500(
        self, api: ControlApi, agent: Agent, caplog: pytest.LogCaptureFixture
    ) -> None:
        """Byte 0xB2 reads as "²" (headers are Latin-1), which ``str.isdigit`` takes for a digit and
        ``int`` refuses: before, the answer was 500 with a traceback logged at ERROR."""
        request = post("/flush", b"", token=TOKEN).replace(b"\r\n\r\n", b"\r\nContent-Length: \xb2\r\n\r\n", 1)
        with caplog.at_level(logging.ERROR, logger="agent.control_api"):
            got, _, body = raw(api, request + b"{}")
        assert (got, json.loads(body)["error"]) == (400, "invalid Content-Length")
        assert not caplog.records and not agent.control.flush_requested()

    def test_two_different_content_lengths_are_refused(self, api: ControlApi, agent: Agent) -> None:
        assert raw(api, post("/flush", b"{}", "Content-Length: 2", "Content-Length: 0"))[0] == 400
        assert not agent.control.flush_requested()

    def test_a_post_without_content_length_has_an_empty_body_a_flush_without_deadline(
        self, api: ControlApi, agent: Agent
    ) -> None:
        got, _, body = raw(api, post("/flush", b""))  # what `curl -X POST .../flush` sends
        assert got == 202 and json.loads(body)["flush"]["deadline"] is None
        assert agent.control.flush_requested()

    def test_a_body_shorter_than_its_length_is_400(self, api: ControlApi, agent: Agent) -> None:
        with socket.create_connection(("127.0.0.1", api.port), timeout=WAIT) as sock:
            sock.sendall(post("/flush", b"{}", "Content-Length: 10"))
            sock.shutdown(socket.SHUT_WR)
            assert read_response(sock)[0] == 400
        assert not agent.control.flush_requested()

    @pytest.mark.parametrize(
        ("method", "path", "allow"),
        [
            ("PUT", "/flush", "POST"),
            ("DELETE", "/stop", "POST"),
            ("PATCH", "/status", "GET"),
            ("BREW", "/healthz", "GET"),
        ],
    )
    def test_other_methods_get_json_405_with_allow(self, api: ControlApi, method: str, path: str, allow: str) -> None:
        status, headers, body = raw(
            api, f"{method} {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n\r\n".encode()
        )
        assert (status, headers["allow"], headers["content-type"]) == (405, allow, "application/json")
        assert "method not allowed" in json.loads(body)["error"]

    def test_a_malformed_request_gets_json(self, api: ControlApi) -> None:
        status, headers, body = raw(api, b"GET /status HTTP/9\r\n\r\n")
        assert status >= 400 and headers["content-type"] == "application/json" and json.loads(body)["error"]


class TestDeadlines:
    @pytest.mark.parametrize("deadline", ["1e17", "1e400", "-1e400", "NaN", "0", "1700000000000"])
    def test_an_absurd_deadline_is_400_and_writes_no_flush(self, api: ControlApi, agent: Agent, deadline: str) -> None:
        status, body = call(api, "POST", "/flush", token=TOKEN, raw=f'{{"deadline": {deadline}}}'.encode())
        assert status == 400 and body["error"] == "invalid flush body", body
        assert "http" not in json.dumps(body["detail"]) and "Value error" not in json.dumps(body["detail"])
        assert not agent.control.flush_requested()

    def test_a_deadline_in_the_past_means_flush_now_not_kill_now(self, api: ControlApi, agent: Agent) -> None:
        late = time.time() - 5
        status, _ = call(api, "POST", "/flush", token=TOKEN, body={"reason": "late", "deadline": late})
        assert status == 202 and agent.control.flush_requested()
        flush = agent._flush
        assert flush is not None
        # Bounded by --flush-timeout (600 s here), as a flush without a deadline is: never "now".
        assert flush.kill_at - time.monotonic() > agent.config.flush_timeout / 2
        assert "--flush-timeout" in flush.kill_reason
        status_body = call(api, "GET", "/status", token=TOKEN)[1]
        assert status_body["window_ok"] is False and "passed" in status_body["window_message"]


class TestLogInjection:
    def test_request_fields_reach_the_log_escaped(
        self, api: ControlApi, agent: Agent, caplog: pytest.LogCaptureFixture
    ) -> None:
        forged = "node tainted\n2030-01-01 00:00:00 ERROR spotjob: forged line\x1b[2J\x1b[31m"
        with caplog.at_level(logging.DEBUG):
            assert call(api, "POST", "/flush", token=TOKEN, body={"reason": forged})[0] == 202
            call(api, "POST", "/stop", token=TOKEN, body={"reason": forged})
            raw(api, b"GET /\x1b[2Jstat\rus HTTP/1.0\r\n\r\n")
        text = "\n".join(r.getMessage() for r in caplog.records)
        assert "\x1b" not in text and "\nERROR" not in text and "\r" not in text
        assert "node tainted\\n2030" in text and "\\x1b[2J" in text
        request = agent.control.flush_request()
        assert request is not None and "\n" not in request.reason and "\x1b" not in request.reason


class TestReadyz:
    def test_needs_no_token_and_is_ready_only_once_the_nodes_ranks_train(self, api: ControlApi, agent: Agent) -> None:
        status, body = call(api, "GET", "/readyz")
        assert status == 503 and body["ready"] is False and "no rank" in body["reason"]
        agent.control.write_status(RankStatus(state="starting"))
        assert call(api, "GET", "/readyz")[0] == 503
        agent.control.write_status(RankStatus(state="training", step=3))
        assert call(api, "GET", "/readyz") == (200, {"ready": True, "reason": "the ranks are training at step 3"})


class TestStop:
    def test_needs_the_token(self, api: ControlApi, agent: Agent) -> None:
        assert call(api, "POST", "/stop", body={"reason": "peer failed"})[0] == 401
        assert agent.status().stop is None and agent.status().state == "starting"

    def test_asks_the_agent_to_stop_without_a_flush_once(self, api: ControlApi, agent: Agent) -> None:
        status, body = call(api, "POST", "/stop", token=TOKEN, body={"reason": "worker 1 failed"})
        assert status == 202 and body["created"] is True and body["stop"]["reason"] == "worker 1 failed"
        again = call(api, "POST", "/stop", token=TOKEN, body={"reason": "again"})
        assert again == (200, {"created": False, "stop": body["stop"]})
        assert not agent.control.flush_requested()
        status_body = call(api, "GET", "/status", token=TOKEN)[1]
        assert status_body["state"] == "stopping" and status_body["stop"]["reason"] == "worker 1 failed"
        assert call(api, "GET", "/readyz")[0] == 503

    def test_a_flush_after_the_stop_is_refused_with_409_and_writes_no_flush(
        self, api: ControlApi, agent: Agent
    ) -> None:
        # The stop ends the ranks now: a 202 would promise a checkpoint that nobody will write.
        assert call(api, "POST", "/stop", token=TOKEN, body={"reason": "worker 1 failed"})[0] == 202
        status, body = call(api, "POST", "/flush", token=TOKEN, body={"reason": "node drained"})
        assert status == 409 and "stop" in body["error"], body
        assert not agent.control.flush_requested()
        status_body = call(api, "GET", "/status", token=TOKEN)[1]
        assert (status_body["state"], status_body["flush"]) == ("stopping", None)

    def test_a_stop_during_a_flush_keeps_answering_that_flush(self, api: ControlApi, agent: Agent) -> None:
        first = call(api, "POST", "/flush", token=TOKEN, body={"reason": "spot"})
        assert first[0] == 202
        assert call(api, "POST", "/stop", token=TOKEN, body={"reason": "worker 1 failed"})[0] == 202
        again = call(api, "POST", "/flush", token=TOKEN, body={"reason": "spot again"})
        assert again == (200, {"created": False, "flush": first[1]["flush"]})

    def test_an_invalid_body_is_400(self, api: ControlApi, agent: Agent) -> None:
        assert call(api, "POST", "/stop", token=TOKEN, raw=b'{"reason": ""}')[0] == 400
        assert agent.status().stop is None


class TestSave:
    def test_needs_the_token(self, api: ControlApi, agent: Agent) -> None:
        assert call(api, "POST", "/save", body={"id": "req-1"})[0] == 401
        assert agent.control.save_request() is None

    def test_writes_the_same_save_json_as_a_rebalance_once_per_request_id(self, api: ControlApi, agent: Agent) -> None:
        status, body = call(api, "POST", "/save", token=TOKEN, body={"id": "req-1", "reason": "kubectl spotjob flush"})
        assert status == 202 and body["created"] is True and body["save"]["id"] == "req-1"
        written = agent.control.save_request()
        assert written is not None and written.id == "req-1" and written.reason == "kubectl spotjob flush"
        assert not agent.control.flush_requested(), "a save keeps training: no flush"

        # The ranks served it (local rank 0 removes save.json): the same id again starts nothing.
        agent.control.clear_save_request()
        again = call(api, "POST", "/save", token=TOKEN, body={"id": "req-1", "reason": "retried"})
        assert again == (200, {"created": False, "save": body["save"]})
        assert agent.control.save_request() is None

        # A new id is a new save.
        status, body = call(api, "POST", "/save", token=TOKEN, body={"id": "req-2"})
        assert status == 202 and agent.control.save_request().id == "req-2"  # type: ignore[union-attr]

    def test_a_new_id_while_a_save_still_waits_joins_it_and_says_so(self, api: ControlApi, agent: Agent) -> None:
        """One save.json serves both; the answer was 202 created:true with the earlier request's
        reason and time, as if this call had asked for a save of its own."""
        first = call(api, "POST", "/save", token=TOKEN, body={"id": "req-1", "reason": "first"})
        assert first[0] == 202
        status, body = call(api, "POST", "/save", token=TOKEN, body={"id": "req-2", "reason": "second"})
        assert (status, body) == (200, {"created": False, "save": first[1]["save"]})
        assert agent.control.save_request().id == "req-1"  # type: ignore[union-attr]
        # A retry of req-2 answers the same; once the ranks served it, a new id saves again.
        assert call(api, "POST", "/save", token=TOKEN, body={"id": "req-2"}) == (status, body)
        agent.control.clear_save_request()
        assert call(api, "POST", "/save", token=TOKEN, body={"id": "req-3"})[0] == 202

    @pytest.mark.parametrize("raw", [b"{}", b'{"id": ""}', b'{"id": "a b"}', b'{"id": "x", "reason": ""}', b"[1]"])
    def test_an_invalid_body_is_400_and_writes_nothing(self, api: ControlApi, agent: Agent, raw: bytes) -> None:
        assert call(api, "POST", "/save", token=TOKEN, raw=raw)[0] == 400
        assert agent.control.save_request() is None

    def test_a_flush_under_way_refuses_it_with_409(self, api: ControlApi, agent: Agent) -> None:
        assert call(api, "POST", "/flush", token=TOKEN, body={"reason": "spot"})[0] == 202
        status, body = call(api, "POST", "/save", token=TOKEN, body={"id": "req-1"})
        assert status == 409 and "flushing" in body["error"]
        assert agent.control.save_request() is None

    def test_wrong_method_is_405(self, api: ControlApi) -> None:
        assert call(api, "GET", "/save", token=TOKEN)[0] == 405
