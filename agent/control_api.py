"""The agent's HTTP control API: ``GET /healthz``, ``GET /status``, ``POST /flush``.

The controller POSTs ``/flush`` to every agent of a job when it hears of a preemption the node
itself may not (a node taint, a queue message); tools read ``/status``. The server is stdlib
``ThreadingHTTPServer`` — a handful of requests per job, nothing that justifies a framework —
with pydantic models for every body, so the wire format is written down once, here.

Auth: every request but ``/healthz`` needs ``Authorization: Bearer <token>``, compared in constant
time. The token comes from ``SPOTJOB_AGENT_TOKEN`` or a mounted file; it is never logged and
never passed to the command. Without a token the API is unauthenticated, so it binds loopback
only, whatever host was asked for. A refused request changes nothing.

``POST /flush`` is idempotent: the first one writes ``flush.json`` and answers 202; any later
one answers 200 with the flush already under way, and starts nothing.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import logging
import os
import socket
import threading
from collections.abc import Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from agent.notices.base import NoticeKind

log = logging.getLogger(__name__)

ENV_AGENT_TOKEN = "SPOTJOB_AGENT_TOKEN"
MAX_BODY_BYTES = 64 * 1024

AgentState = Literal["starting", "running", "flushing", "flushed", "flush-failed", "stopping", "exited"]


# -- bodies ----------------------------------------------------------------------------------------


class FlushBody(BaseModel):
    """``POST /flush``. Unknown fields are ignored: a newer controller must still get its flush."""

    model_config = ConfigDict(extra="ignore")

    reason: str = Field(default="flush requested through the control API", min_length=1, max_length=1000)
    deadline: float | None = Field(default=None, gt=0, description="unix time the node goes away")
    kind: NoticeKind = NoticeKind.PREEMPTION


class NoticeInfo(BaseModel):
    source: str
    kind: NoticeKind
    deadline: float | None
    detail: str
    received_at: float


class FlushInfo(BaseModel):
    """The flush request as written to ``flush.json``."""

    id: str
    reason: str
    deadline: float | None
    requested_at: float


class FlushResultInfo(BaseModel):
    committed: bool
    step: int | None
    uri: str | None
    request_id: str | None
    notice_to_commit_seconds: float | None
    error: str | None
    finished_at: float | None


class FlushResponse(BaseModel):
    created: bool
    """False when a flush was already under way (this request started nothing)."""
    flush: FlushInfo


class StatusResponse(BaseModel):
    """``GET /status``."""

    state: AgentState
    pid: int
    command_pid: int | None
    uptime_seconds: float
    job_name: str | None
    control_dir: str
    rank_state: str | None = Field(description="status.json state from rank 0 (training, saving, ...)")
    step: int | None
    world_size: int | None
    last_committed_step: int | None
    last_committed_uri: str | None
    last_save_seconds: float | None
    status_updated_at: float | None = Field(description="when rank 0 last wrote status.json")
    notice: NoticeInfo | None = Field(description="the notice that started the flush (the first one)")
    flush: FlushInfo | None
    deadline: float | None = Field(description="the earliest deadline heard (unix time)")
    seconds_left: float | None
    window_ok: bool = Field(description="whether the time left can hold a flush as long as the last save")
    window_message: str
    flush_result: FlushResultInfo | None
    command_exit_code: int | None


class ErrorResponse(BaseModel):
    error: str
    detail: Any = None


# -- the server ------------------------------------------------------------------------------------


class FlushRefused(Exception):
    """The agent cannot take a flush now (the command has already ended): answered 409."""


class ControlHandler(Protocol):
    """What the API needs from the agent; called from server threads."""

    def status(self) -> StatusResponse: ...

    def request_flush(self, body: FlushBody) -> tuple[FlushInfo, bool]:
        """The flush now under way and whether this call created it."""
        ...


def load_token(token_file: str | None, env: Mapping[str, str] | None = None) -> str | None:
    """The bearer token from ``token_file`` if given, else ``SPOTJOB_AGENT_TOKEN``; None if neither.

    An empty token is a configuration error (an empty mounted secret), not "no auth".
    """
    env = os.environ if env is None else env
    if token_file:
        with open(token_file) as f:
            token = f.read().strip()
        if not token:
            raise ValueError(f"token file {token_file} is empty")
        return token
    value = env.get(ENV_AGENT_TOKEN)
    if value is None:
        return None
    if not value.strip():
        raise ValueError(f"{ENV_AGENT_TOKEN} is set but empty")
    return value.strip()


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    api: ControlApi


class _Server6(_Server):
    address_family = socket.AF_INET6


class ControlApi:
    """The control API on ``host:port`` (0: a free port; read ``.port`` after ``start``)."""

    def __init__(
        self, handler: ControlHandler, *, host: str = "127.0.0.1", port: int = 0, token: str | None = None
    ) -> None:
        if token is None and not is_loopback(host):
            log.warning(
                "no API token configured (%s or --token-file): binding the control API to 127.0.0.1, "
                "not %s, so nothing off this machine can ask for a flush",
                ENV_AGENT_TOKEN,
                host,
            )
            host = "127.0.0.1"
        self.handler = handler
        self.host = host
        self.port = port
        self._token = token.encode() if token is not None else None
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def auth_required(self) -> bool:
        return self._token is not None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def start(self) -> None:
        server_type = _Server6 if ":" in self.host else _Server
        server = server_type((self.host, self.port), _Handler)
        server.api = self
        self._server = server
        self.port = int(server.server_address[1])
        self._thread = threading.Thread(
            target=server.serve_forever, kwargs={"poll_interval": 0.1}, name="spotjob-control-api", daemon=True
        )
        self._thread.start()
        log.info("control API listening on %s (%s)", self.url, "bearer token required" if self._token else "no auth")

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def authorized(self, header: str | None) -> bool:
        if self._token is None:
            return True
        scheme, _, value = (header or "").partition(" ")
        # compare_digest runs in time independent of where the strings differ.
        ok = hmac.compare_digest(value.strip().encode(), self._token)
        return ok and scheme.lower() == "bearer"


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    server_version = "spotjob-agent"
    sys_version = ""

    def do_GET(self) -> None:
        self._route("GET")

    def do_POST(self) -> None:
        self._route("POST")

    def do_PUT(self) -> None:
        self._route("PUT")

    def do_DELETE(self) -> None:
        self._route("DELETE")

    def _route(self, method: str) -> None:
        path = self.path.split("?", 1)[0].rstrip("/") or "/"
        api = self.server.api
        if path == "/healthz":
            if method != "GET":
                return self._send(405, ErrorResponse(error="method not allowed"))
            return self._send(200, {"ok": True})
        if not api.authorized(self.headers.get("Authorization")):
            log.warning(
                "control API: refused %s %s from %s (missing or wrong token)", method, path, self.client_address[0]
            )
            return self._send(
                401, ErrorResponse(error="unauthorized"), {"WWW-Authenticate": 'Bearer realm="spotjob-agent"'}
            )
        try:
            if path == "/status":
                if method != "GET":
                    return self._send(405, ErrorResponse(error="method not allowed"))
                return self._send(200, api.handler.status())
            if path == "/flush":
                if method != "POST":
                    return self._send(405, ErrorResponse(error="method not allowed"))
                return self._flush(api)
            return self._send(404, ErrorResponse(error=f"no such endpoint: {path}"))
        except Exception:
            log.exception("control API: %s %s failed", method, path)
            return self._send(500, ErrorResponse(error="internal error"))

    def _flush(self, api: ControlApi) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        if length > MAX_BODY_BYTES:
            return self._send(413, ErrorResponse(error=f"body over {MAX_BODY_BYTES} bytes"))
        raw = self.rfile.read(length) if length else b""
        try:
            body = FlushBody.model_validate_json(raw or b"{}")
        except ValidationError as e:
            detail = [{"loc": err["loc"], "msg": err["msg"]} for err in e.errors()]
            return self._send(400, ErrorResponse(error="invalid flush body", detail=detail))
        try:
            flush, created = api.handler.request_flush(body)
        except FlushRefused as e:
            return self._send(409, ErrorResponse(error=str(e)))
        return self._send(202 if created else 200, FlushResponse(created=created, flush=flush))

    def _send(self, status: int, payload: BaseModel | dict[str, Any], headers: Mapping[str, str] | None = None) -> None:
        data = payload.model_dump_json().encode() if isinstance(payload, BaseModel) else json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Cache-Control", "no-store")
        self.send_header("Content-Length", str(len(data)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:
        # The request line only (never headers, so never the token), at debug.
        log.debug("control API %s: " + format, self.client_address[0], *args)
