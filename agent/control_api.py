"""The agent's HTTP control API: ``/healthz``, ``/readyz``, ``/status``, ``/flush``, ``/save``, ``/stop``.

The controller POSTs ``/flush`` to every agent of a job when it hears of a preemption the node
itself may not (a node taint, a queue message), ``/save`` when someone asks for a checkpoint now
without stopping (``kubectl spotjob flush --keep-running``), and ``/stop`` when it stops a gang
for a reason that needs no checkpoint (a peer's code failed); Kubernetes probes ``/healthz`` (liveness) and
``/readyz`` (readiness: the ranks train); tools read ``/status``. The server is stdlib
``ThreadingHTTPServer`` — a handful of requests per job, nothing that justifies a framework —
with pydantic models for every body, so the wire format is written down once, here.

Auth: every request but ``/healthz`` and ``/readyz`` needs ``Authorization: Bearer <token>``,
compared in constant time. The token comes from ``SPOTJOB_AGENT_TOKEN`` or a mounted file; it is
never logged and never passed to the command. Without a token the API binds loopback only,
whatever host was asked for, and serves only this user's processes (and root's): on a machine
shared by several users (a batch node) anyone could otherwise stop or flush another user's job.
The client's user is the owner of its socket in ``/proc/net/tcp`` (``peer_uid``), found by both
ends' addresses and ports; a client whose socket is gone or has no owner there is refused. Where
there is no ``/proc`` (macOS), loopback is all that is checked. A refused request changes nothing.

On a pod network anyone can connect, so the server is bounded: at most ``max_connections``
connections at once, one request per connection, and
every connection must deliver its whole request (line, headers, body) within
``request_timeout`` seconds of being accepted, or it gets ``408`` and is closed. The bound is
enforced from the serving thread (``service_actions``), so a client that trickles one byte at a
time cannot stretch it. With every slot taken, a new connection cuts off the one among them that has
waited longest for its request (``408``), so that no one holding the slots with requests that
never finish keeps a flush out; only when every slot serves a request that has arrived does a new
connection get ``503`` and is closed at once. Bodies are at most ``MAX_BODY_BYTES``; a bad ``Content-Length`` is 400,
a larger body 413 (unread). A client that hangs up is logged at debug level, never as an error.
Anything a client sent reaches the log escaped (``safe``): no forged lines, no terminal escapes.

``POST /flush`` is idempotent: the first one writes ``flush.json`` and answers 202; any later
one answers 200 with the flush already under way, and starts nothing. After ``POST /stop`` a
flush not already under way is refused (409): the stop ends the ranks without one. ``POST /stop`` is
idempotent too (202, then 200). ``POST /save`` is idempotent per request ``id``: the first one
with an id writes ``save.json`` (the same early save an AWS rebalance recommendation asks for)
and answers 202; the same id again answers 200 and starts nothing; a new id asks for a new save,
unless an earlier one still waits for the ranks: that one serves both, and the answer (200,
``created: false``) is that save, under its own id.
"""

from __future__ import annotations

import contextlib
import errno
import hmac
import ipaddress
import json
import logging
import math
import os
import re
import socket
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from agent.notices.base import NoticeKind

log = logging.getLogger(__name__)

ENV_AGENT_TOKEN = "SPOTJOB_AGENT_TOKEN"
MAX_BODY_BYTES = 64 * 1024
MAX_CONNECTIONS = 32
"""Connections served at once; a 33rd cuts off the oldest unfinished request, or is answered 503."""
REQUEST_TIMEOUT = 10.0
"""Seconds a connection has, from accept, to deliver its whole request."""
SERVE_POLL = 0.1
"""How often the serving loop wakes with nothing to accept, to cut off overdue requests."""
MAX_DEADLINE_DISTANCE = 24 * 3600.0
"""A flush ``deadline`` more than this far from now (either way) is not a unix time in seconds."""

AgentState = Literal["starting", "running", "flushing", "flushed", "flush-failed", "stopping", "exited"]

_ALLOWED = {"/healthz": "GET", "/readyz": "GET", "/status": "GET", "/flush": "POST", "/save": "POST", "/stop": "POST"}
_OPEN = ("/healthz", "/readyz")
"""Endpoints without a token: probes carry none, and they reveal nothing but up/ready."""
_QUERY = re.compile(r"\?[^\s\"']*")
"""A request line's query string, which is never logged (a client may have put the token there)."""


def safe(value: object, limit: int = 200, *, backslashes: bool = True) -> str:
    """``value`` fit for one log line: control characters escaped, at most ``limit`` characters.

    Whatever a client sends (a reason, a path) goes through this before it is logged, so that a
    newline cannot forge a log line and an ANSI escape cannot rewrite an operator's terminal.
    A backslash is doubled, so that a sent ``\\n`` reads otherwise than an escaped newline, unless
    ``backslashes`` is False (text whose names were quoted with ``repr`` already).
    """
    text = str(value)
    out = []
    for ch in text[:limit]:
        code = ord(ch)
        if ch == "\\" and backslashes:
            out.append("\\\\")
        elif code < 0x20 or 0x7F <= code < 0xA0 or ch in "\u2028\u2029":
            out.append(repr(ch)[1:-1] if code < 0x100 else f"\\u{code:04x}")
        else:
            out.append(ch)
    return "".join(out) + ("..." if len(text) > limit else "")


# -- bodies ----------------------------------------------------------------------------------------


class FlushBody(BaseModel):
    """``POST /flush``. Unknown fields are ignored: a newer controller must still get its flush.

    ``deadline`` is the unix time (seconds) the node goes away. One that has passed already means
    "flush now" (it is never a reason to kill the ranks before they tried); one more than a day
    away from now, or not finite, is a mistake (milliseconds, a duration) and is refused.
    """

    model_config = ConfigDict(extra="ignore")

    reason: str = Field(default="flush requested through the control API", min_length=1, max_length=1000)
    deadline: float | None = Field(default=None, description="unix time the node goes away")
    kind: NoticeKind = NoticeKind.PREEMPTION

    @field_validator("deadline")
    @classmethod
    def _plausible_deadline(cls, value: float | None) -> float | None:
        if value is None:
            return None
        if not math.isfinite(value):
            raise ValueError("deadline must be a finite unix time in seconds")
        now = time.time()
        if abs(value - now) > MAX_DEADLINE_DISTANCE:
            raise ValueError(
                f"deadline {value:g} is not a unix time in seconds within a day of now ({now:.0f}); "
                "send the time the node goes away, e.g. time.time() + 30"
            )
        return value


class StopBody(BaseModel):
    """``POST /stop``: stop the command without a flush (the controller is stopping the gang)."""

    model_config = ConfigDict(extra="ignore")

    reason: str = Field(default="stop requested through the control API", min_length=1, max_length=1000)


class SaveBody(BaseModel):
    """``POST /save``: commit a checkpoint now and keep training. ``id`` names the request: the
    agent serves each id once, so a caller that retries (a lost answer, a new leader) starts no
    second save."""

    model_config = ConfigDict(extra="ignore")

    id: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._:-]+$")
    reason: str = Field(default="checkpoint requested through the control API", min_length=1, max_length=1000)


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


class SaveInfo(BaseModel):
    """The save request as written to ``save.json`` (``id``: the caller's request id, or that of the
    earlier save still pending that the call joined)."""

    id: str
    reason: str
    requested_at: float


class SaveResponse(BaseModel):
    created: bool
    """False when this request id was taken before, or an earlier save still waits for the ranks
    and ``save`` is that one (this call started nothing)."""
    save: SaveInfo


class StopInfo(BaseModel):
    reason: str
    requested_at: float


class StopResponse(BaseModel):
    created: bool
    """False when a stop was already under way."""
    stop: StopInfo


class ReadyResponse(BaseModel):
    """``GET /readyz``: 200 once the node's first rank reports training, else 503."""

    ready: bool
    reason: str


class StatusResponse(BaseModel):
    """``GET /status``."""

    state: AgentState
    pid: int
    command_pid: int | None
    uptime_seconds: float
    job_name: str | None
    control_dir: str
    checkpoint_uri: str | None = Field(description="the agent's --checkpoint-uri (what the controller watches)")
    attempt: int | None = Field(description="the attempt number the controller gave (--attempt)")
    rank_state: str | None = Field(description="status.json state from the node's first rank (training, saving, ...)")
    rank_checkpoint_uri: str | None = Field(description="where the script's Checkpointer says it writes")
    step: int | None
    world_size: int | None
    last_committed_step: int | None
    last_committed_uri: str | None
    last_save_seconds: float | None
    restored_step: int | None = Field(
        default=None,
        description="the step the node's ranks restored (0: none, they started from step 0); None before a "
        "restore returned",
    )
    restore_passed_over: str | None = Field(
        default=None,
        description="the newest committed checkpoint that restore passed over for an older one, and why (a "
        "CRC32C mismatch in a file of it); None when it passed over none",
    )
    status_updated_at: float | None = Field(description="when the node's first rank last wrote status.json")
    ranks_connected: bool = Field(description="whether a rank has written status.json since the start")
    problems: list[str] = Field(description="what the agent warned about: no rank connected, URI mismatch")
    ranks_not_meeting: str | None = Field(
        default=None,
        description="no rank has connected --rank-connect-timeout after the start (they have not met in "
        "init_process_group, or build no Checkpointer): the warning, what was checked; None otherwise",
    )
    notice: NoticeInfo | None = Field(description="the notice that started the flush (the first one)")
    held_notice: NoticeInfo | None = Field(
        default=None, description="a cloud notice far from its deadline: training goes on until flush_at (--flush-lead)"
    )
    flush_at: float | None = Field(default=None, description="when the held notice's flush starts (unix time)")
    flush: FlushInfo | None
    deadline: float | None = Field(description="the earliest deadline heard (unix time)")
    seconds_left: float | None
    window_ok: bool = Field(description="whether the time left can hold a flush as long as the last save")
    window_message: str
    flush_result: FlushResultInfo | None
    stop: StopInfo | None = Field(description="the stop asked for through POST /stop, if any")
    infra_error: str | None = Field(description="an infrastructure error a rank reported, if any")
    command_exit_code: int | None


class ErrorResponse(BaseModel):
    error: str
    detail: Any = None


# -- the server ------------------------------------------------------------------------------------


class FlushRefused(Exception):
    """The agent cannot take a flush or a stop now (the command has already ended, or a new flush
    after ``POST /stop``): answered 409."""


class ControlApiBindError(Exception):
    """The control API cannot listen where it was told. ``usage``: the address or port asked for
    can never work here (no address of this machine, a privileged port), a fault of the options;
    else the port is taken (or another fault of the machine), which a later attempt may not meet."""

    def __init__(self, message: str, *, usage: bool) -> None:
        super().__init__(message)
        self.usage = usage


def _bind_error(host: str, port: int, error: OSError | OverflowError) -> ControlApiBindError:
    where = f"the control API cannot listen on {host}:{port}"
    number = getattr(error, "errno", None)
    if number == errno.EADDRINUSE:
        return ControlApiBindError(
            f"{where}: port {port} is in use by another process; free it, or choose another port "
            f"with --control-port (0 picks a free one)",
            usage=False,
        )
    if number == errno.EACCES:
        return ControlApiBindError(
            f"{where}: not permitted to bind port {port} (ports under 1024 need privileges); "
            f"choose another with --control-port",
            usage=True,
        )
    if isinstance(error, (socket.gaierror, OverflowError)) or number in (errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT):
        return ControlApiBindError(
            f"{where}: {host!r} is no address of this machine ({error}); pass one with --control-host "
            f"(127.0.0.1, 0.0.0.0, or the pod's IP)",
            usage=True,
        )
    return ControlApiBindError(f"{where}: {error}", usage=False)


class ControlHandler(Protocol):
    """What the API needs from the agent; called from server threads."""

    def status(self) -> StatusResponse: ...

    def ready(self) -> ReadyResponse: ...

    def request_flush(self, body: FlushBody) -> tuple[FlushInfo, bool]:
        """The flush now under way and whether this call created it."""
        ...

    def request_stop(self, body: StopBody) -> tuple[StopInfo, bool]:
        """The stop now under way and whether this call created it."""
        ...

    def request_save(self, body: SaveBody) -> tuple[SaveInfo, bool]:
        """The save asked for under ``body.id`` and whether this call asked for it."""
        ...


def load_token(token_file: str | None, env: Mapping[str, str] | None = None) -> str | None:
    """The bearer token from ``token_file`` if given, else ``SPOTJOB_AGENT_TOKEN``; None if neither.

    An empty token is a configuration error (an empty mounted secret), not "no auth".
    """
    env = os.environ if env is None else env
    if token_file:
        try:
            with open(token_file, encoding="utf-8") as f:
                token = f.read().strip()
        except (OSError, UnicodeDecodeError) as e:
            # The bare OSError said "[Errno 2] No such file or directory: '...'": neither the
            # option nor what to do.
            why = "not UTF-8 text" if isinstance(e, UnicodeDecodeError) else e.strerror or str(e)
            raise ValueError(
                f"--token-file {token_file}: cannot read it ({why}); give a file this user can read that "
                f"holds the token (a mounted secret), or leave the option out and set {ENV_AGENT_TOKEN}"
            ) from e
        if not token:
            raise ValueError(
                f"token file {token_file} is empty: write the token into it (an empty token would leave the "
                f"control API without auth), or leave --token-file out"
            )
        return token
    value = env.get(ENV_AGENT_TOKEN)
    if value is None:
        return None
    if not value.strip():
        raise ValueError(
            f"{ENV_AGENT_TOKEN} is set but empty: set it to the token, or unset it (the control API then "
            f"listens on 127.0.0.1 only, without auth)"
        )
    return value.strip()


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _proc_address(field: str) -> tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int]:
    """An ``address:port`` of ``/proc/net/tcp[6]``: hex, each 32-bit word of the address in the
    machine's byte order. An IPv4 address mapped into IPv6 comes back as IPv4."""
    host, _, port = field.rpartition(":")
    raw = bytes.fromhex(host)
    if sys.byteorder == "little":
        raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return _plain(ipaddress.ip_address(raw)), int(port, 16)


def _plain(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


NO_OWNER = -1
"""``peer_uid`` for a client socket ``/proc/net/tcp`` no longer lists with an owner."""


def peer_uid(peer: tuple[Any, ...], local: tuple[Any, ...]) -> int | None:
    """The user owning the loopback client socket ``peer`` (address, port) connected to ``local``
    (the accepted socket's own address and port) on this machine, from ``/proc/net/tcp`` and
    ``tcp6``; None where neither can be read (no ``/proc``); ``NO_OWNER`` where the client's
    socket is not listed, or listed without an owner (inode 0: closed, its uid column meaningless).

    Both ends are matched by address and port. Ports alone are not enough: a client bound to
    another loopback address on the API's own port (127.0.0.2:<port> to 127.0.0.1:<port>) would
    match the agent's side of the same connection too, and pass for the agent's user. A client
    that closed or reset its socket right after sending cannot be told apart from any other user,
    so it is no one's."""
    want = (
        (_plain(ipaddress.ip_address(peer[0].split("%")[0])), int(peer[1])),
        (_plain(ipaddress.ip_address(local[0].split("%")[0])), int(local[1])),
    )
    read = False
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                lines = f.read().splitlines()[1:]
        except OSError:
            continue
        read = True
        for line in lines:
            fields = line.split()
            if len(fields) < 10:
                continue
            try:
                if (_proc_address(fields[1]), _proc_address(fields[2])) == want:
                    return int(fields[7]) if fields[9] != "0" else NO_OWNER
            except ValueError:
                continue
    return NO_OWNER if read else None


@dataclass
class _Connection:
    sock: socket.socket
    peer: str
    deadline: float
    """Monotonic time by which the whole request must have arrived."""
    reading: bool = True
    timed_out: bool = False


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    # Refused connections are answered at once, so a longer queue only holds clients longer.
    request_queue_size = 64
    api: ControlApi

    def __init__(self, address: tuple[str, int], api: ControlApi) -> None:
        self.api = api
        self._conns: dict[int, _Connection] = {}
        self._conns_lock = threading.Lock()
        super().__init__(address, _Handler)

    # accept thread ---------------------------------------------------------------------------
    def process_request(self, request: Any, client_address: Any) -> None:
        sock: socket.socket = request
        peer = str(client_address[0])
        displaced: _Connection | None = None
        with self._conns_lock:
            live = [c for c in self._conns.values() if not c.timed_out]
            full = len(live) >= self.api.max_connections
            waiting = [c for c in live if c.reading]
            if full and waiting:
                # Every slot taken, some by requests still arriving: the one that has waited
                # longest makes room. Else whoever holds the slots with unfinished requests (no
                # token needed for that) would keep the controller's flush out for as long as
                # it keeps them; a request that has arrived is never cut off.
                displaced = min(waiting, key=lambda c: c.deadline)
                displaced.timed_out = True
                full = False
            if not full:
                deadline = time.monotonic() + self.api.request_timeout
                self._conns[id(sock)] = _Connection(sock, peer, deadline)
        if displaced is not None:
            with contextlib.suppress(OSError):
                displaced.sock.shutdown(socket.SHUT_RD)  # its handler answers 408 and closes
            log.info(
                "control API: %d connections open, cutting off the oldest unfinished request, from %s (408), "
                "to serve one from %s",
                self.api.max_connections,
                safe(displaced.peer),
                safe(peer),
            )
        if full:
            log.warning(
                "control API: %d connections open, refusing one from %s (503)", self.api.max_connections, safe(peer)
            )
            _refuse(sock)
            self.shutdown_request(sock)
            return
        try:
            super().process_request(request, client_address)
        except Exception:
            self.forget(sock)
            raise

    def service_actions(self) -> None:
        """(the serving thread, every poll) Cut off connections whose request is overdue."""
        now = time.monotonic()
        with self._conns_lock:
            overdue = [c for c in self._conns.values() if c.reading and not c.timed_out and now >= c.deadline]
            for conn in overdue:
                conn.timed_out = True
                # Unblocks the handler's read with end-of-file; it then answers 408 and closes.
                try:
                    conn.sock.shutdown(socket.SHUT_RD)
                except OSError:
                    pass
        for conn in overdue:
            log.info(
                "control API: a request from %s did not arrive in %gs (408)", safe(conn.peer), self.api.request_timeout
            )

    # handler threads -------------------------------------------------------------------------
    def connection(self, sock: socket.socket) -> _Connection | None:
        with self._conns_lock:
            return self._conns.get(id(sock))

    def done_reading(self, sock: socket.socket) -> bool:
        """The request has arrived: no more cut-off. False if it was cut off already."""
        with self._conns_lock:
            conn = self._conns.get(id(sock))
            if conn is None:
                return True
            conn.reading = False
            return not conn.timed_out

    def forget(self, sock: socket.socket) -> None:
        with self._conns_lock:
            self._conns.pop(id(sock), None)

    @property
    def open_connections(self) -> int:
        with self._conns_lock:
            return len(self._conns)

    def shutdown_request(self, request: Any) -> None:
        self.forget(request)
        super().shutdown_request(request)

    def handle_error(self, request: Any, client_address: Any) -> None:
        # socketserver would print a traceback to stderr; a peer that went away is routine.
        error = sys.exc_info()[1]
        if isinstance(error, OSError):
            log.debug("control API: connection from %s ended: %r", safe(client_address[0]), error)
        else:
            log.exception("control API: unexpected error serving %s", safe(client_address[0]))


class _Server6(_Server):
    address_family = socket.AF_INET6


def _refuse(sock: socket.socket) -> None:
    data = ErrorResponse(error="too many connections; try again shortly").model_dump_json().encode()
    head = (
        "HTTP/1.0 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: 1\r\n"
        f"Connection: close\r\nContent-Length: {len(data)}\r\n\r\n"
    ).encode()
    try:
        sock.settimeout(0.5)
        sock.sendall(head + data)
    except OSError:
        pass


class ControlApi:
    """The control API on ``host:port`` (0: a free port; read ``.port`` after ``start``)."""

    def __init__(
        self,
        handler: ControlHandler,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        token: str | None = None,
        max_connections: int = MAX_CONNECTIONS,
        request_timeout: float = REQUEST_TIMEOUT,
    ) -> None:
        if token is None and not is_loopback(host):
            log.warning(
                "no API token configured (%s or --token-file): binding the control API to 127.0.0.1, "
                "not %s, so nothing off this machine can ask for a flush",
                ENV_AGENT_TOKEN,
                host,
            )
            host = "127.0.0.1"
        if max_connections < 1 or request_timeout <= 0:
            raise ValueError("max_connections must be >= 1 and request_timeout > 0")
        self.handler = handler
        self.host = host
        self.port = port
        self.max_connections = max_connections
        self.request_timeout = request_timeout
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

    @property
    def open_connections(self) -> int:
        """Connections being served now (for tests and /status)."""
        return self._server.open_connections if self._server is not None else 0

    def start(self) -> None:
        """Listen and serve on a thread of its own; ``ControlApiBindError`` when it cannot listen."""
        server_type = _Server6 if ":" in self.host else _Server
        try:
            server = server_type((self.host, self.port), self)
        except (OSError, OverflowError) as e:
            raise _bind_error(self.host, self.port, e) from e
        self._server = server
        self.port = int(server.server_address[1])
        self._thread = threading.Thread(
            target=server.serve_forever, kwargs={"poll_interval": SERVE_POLL}, name="spotjob-control-api", daemon=True
        )
        self._thread.start()
        log.info("control API listening on %s (%s)", self.url, "bearer token required" if self._token else "no auth")

    def stop(self) -> None:
        if self._server is not None:
            # The serving loop would notice the shutdown only at its next poll (up to SERVE_POLL, which
            # every restart waits for when the agent exits). A listening socket shut down reads
            # as ready at once (Linux; accept then fails, which socketserver ignores), so the
            # loop wakes and sees the request; where shutting it down fails, the poll still ends it.
            with contextlib.suppress(OSError):
                self._server.socket.shutdown(socket.SHUT_RDWR)
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


class _BadRequest(Exception):
    def __init__(self, status: int, error: str) -> None:
        super().__init__(error)
        self.status = status
        self.error = error


class _HeaderReader:
    """The handler's ``rfile`` as ``parse_request`` reads the headers from it, line by line: ``cut``
    when a read met end-of-file, before the blank line that ends them."""

    def __init__(self, rfile: Any) -> None:
        self._rfile = rfile
        self.cut = False

    def readline(self, limit: int = -1) -> bytes:
        line: bytes = self._rfile.readline(limit)
        if not line:
            self.cut = True
        return line


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    server_version = "spotjob-agent"
    sys_version = ""
    error_content_type = "application/json"

    def setup(self) -> None:
        super().setup()
        # A bound on each read and write, past the whole-request cut-off (which answers 408 first).
        self.connection.settimeout(self.server.api.request_timeout + 1.0)

    def finish(self) -> None:
        try:
            super().finish()
        except OSError:
            pass
        self.server.forget(self.connection)

    def handle(self) -> None:
        try:
            super().handle()
        except TimeoutError:
            log.info("control API: %s went silent (408)", safe(self.client_address[0]))
            try:
                self._send(408, ErrorResponse(error="request timeout"))
            except OSError:
                pass
        except OSError as e:
            # The client hung up (reset, broken pipe) or went silent: routine, not an error.
            log.debug("control API: connection from %s ended early: %r", safe(self.client_address[0]), e)
            self.close_connection = True

    def handle_one_request(self) -> None:
        self.close_connection = True  # one request per connection
        self.command, self.requestline, self.request_version = "", "", "HTTP/1.0"
        self.raw_requestline = self.rfile.readline(65537)
        if self._timed_out():
            return self._send(408, ErrorResponse(error="request timeout"))
        if len(self.raw_requestline) > 65536:
            self.requestline = self.request_version = self.command = ""
            return self._send(414, ErrorResponse(error="request line too long"))
        if not self.raw_requestline:
            return None
        reader = _HeaderReader(self.rfile)
        rfile, self.rfile = self.rfile, reader  # type: ignore[assignment]
        try:
            parsed = self.parse_request()
        finally:
            self.rfile = rfile
        if not parsed:  # answered already, through send_error
            return None
        if self._timed_out():
            return self._send(408, ErrorResponse(error="request timeout"))
        if reader.cut:
            # parse_request takes end-of-file for the blank line that ends the headers: a request
            # whose client hung up (or was cut off, at the agent's exit) before its Authorization
            # header arrived was refused as a missing token, 401 and a warning of an auth failure.
            log.debug(
                "control API: the request from %s ended before its headers did (the client hung up)",
                safe(self.client_address[0]),
            )
            return self._send(400, ErrorResponse(error="the request ended before its headers did"))
        self._route(self.command)
        self.wfile.flush()
        return None

    def _timed_out(self) -> bool:
        conn = self.server.connection(self.connection)
        return conn is not None and conn.timed_out

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """What parse_request refuses (a malformed request line, too many headers), as JSON."""
        self.close_connection = True
        try:
            phrase = HTTPStatus(code).phrase
        except ValueError:
            phrase = "error"
        self._send(code, ErrorResponse(error=(message or phrase).lower()))

    def _route(self, method: str) -> None:
        path = self.path.split("?", 1)[0].rstrip("/") or "/"
        api = self.server.api
        if path not in _OPEN and not api.auth_required:
            uid = peer_uid(self.client_address, self.connection.getsockname())
            if uid is not None and uid not in (os.getuid(), 0):
                self._discard_body()
                log.warning(
                    "control API: refused %s %s from %s: without a token only this user (%d) may use it",
                    safe(method, 16),
                    safe(path, 100),
                    f"user id {uid}" if uid != NO_OWNER else "a client whose socket has closed (user unknown)",
                    os.getuid(),
                )
                return self._send(
                    403,
                    ErrorResponse(
                        error="this agent has no API token, so only its own user may use it: "
                        "run as that user, or give the agent a token (--token-file)"
                    ),
                )
        if path not in _OPEN and not api.authorized(self.headers.get("Authorization")):
            self._discard_body()
            log.warning(
                "control API: refused %s %s from %s (missing or wrong token)",
                safe(method, 16),
                safe(path, 100),
                safe(self.client_address[0]),
            )
            return self._send(
                401,
                ErrorResponse(
                    error="unauthorized",
                    detail="a missing or wrong token: send 'Authorization: Bearer <token>' with the agent's token "
                    f"(its --token-file or {ENV_AGENT_TOKEN}); a token in the query string is not read",
                ),
                {"WWW-Authenticate": 'Bearer realm="spotjob-agent"'},
            )
        allowed = _ALLOWED.get(path)
        if allowed is None:
            self._discard_body()
            return self._send(404, ErrorResponse(error=f"no such endpoint: {path[:100]}"))
        if method != allowed:
            self._discard_body()
            return self._send(405, ErrorResponse(error=f"method not allowed; use {allowed}"), {"Allow": allowed})
        if allowed == "GET":
            self.server.done_reading(self.connection)  # no body: the whole request has arrived
        try:
            if path == "/healthz":
                return self._send(200, {"ok": True})
            if path == "/readyz":
                ready = api.handler.ready()
                return self._send(200 if ready.ready else 503, ready)
            if path == "/status":
                return self._send(200, api.handler.status())
            raw = self._read_body()
            if path == "/flush":
                return self._flush(api, raw)
            if path == "/save":
                return self._save(api, raw)
            return self._stop(api, raw)
        except _BadRequest as e:
            return self._send(e.status, ErrorResponse(error=e.error))
        except OSError:
            raise  # the client went away: handle() logs it at debug level
        except Exception:
            log.exception("control API: %s %s failed", safe(method, 16), safe(path, 100))
            return self._send(500, ErrorResponse(error="internal error"))

    def _content_length(self) -> int:
        if self.headers.get("Transfer-Encoding"):
            raise _BadRequest(411, "chunked bodies are not accepted; send Content-Length")
        values = self.headers.get_all("Content-Length") or []
        if not values:
            return 0
        if len(set(values)) != 1 or not (values[0].strip().isascii() and values[0].strip().isdigit()):
            raise _BadRequest(400, "invalid Content-Length")
        length = int(values[0].strip())
        if length > MAX_BODY_BYTES:
            raise _BadRequest(413, f"body over {MAX_BODY_BYTES} bytes")
        return length

    def _read_body(self) -> bytes:
        length = self._content_length()
        chunks: list[bytes] = []
        left = length
        while left > 0:
            chunk = self.rfile.read(left)
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        if not self.server.done_reading(self.connection):
            raise _BadRequest(408, "request timeout")
        if left:
            raise _BadRequest(400, f"body shorter than its Content-Length ({length - left} of {length} bytes)")
        return b"".join(chunks)

    def _discard_body(self) -> None:
        """Nothing more is read: the answer goes out and the connection closes."""
        self.server.done_reading(self.connection)

    def _flush(self, api: ControlApi, raw: bytes) -> None:
        try:
            body = FlushBody.model_validate_json(raw or b"{}")
        except ValidationError as e:
            return self._send(400, ErrorResponse(error="invalid flush body", detail=_problems(e)))
        try:
            flush, created = api.handler.request_flush(body)
        except FlushRefused as e:
            return self._send(409, ErrorResponse(error=str(e)))
        return self._send(202 if created else 200, FlushResponse(created=created, flush=flush))

    def _save(self, api: ControlApi, raw: bytes) -> None:
        try:
            body = SaveBody.model_validate_json(raw or b"{}")
        except ValidationError as e:
            return self._send(400, ErrorResponse(error="invalid save body", detail=_problems(e)))
        try:
            save, created = api.handler.request_save(body)
        except FlushRefused as e:
            return self._send(409, ErrorResponse(error=str(e)))
        return self._send(202 if created else 200, SaveResponse(created=created, save=save))

    def _stop(self, api: ControlApi, raw: bytes) -> None:
        try:
            body = StopBody.model_validate_json(raw or b"{}")
        except ValidationError as e:
            return self._send(400, ErrorResponse(error="invalid stop body", detail=_problems(e)))
        try:
            stop, created = api.handler.request_stop(body)
        except FlushRefused as e:
            return self._send(409, ErrorResponse(error=str(e)))
        return self._send(202 if created else 200, StopResponse(created=created, stop=stop))

    def _send(self, status: int, payload: BaseModel | dict[str, Any], headers: Mapping[str, str] | None = None) -> None:
        self.server.done_reading(self.connection)
        if self.request_version == "HTTP/0.9":  # unparsable or HTTP/0.9: answer with a status line all the same
            self.request_version = "HTTP/1.0"
        data = payload.model_dump_json().encode() if isinstance(payload, BaseModel) else json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Cache-Control", "no-store")
        self.send_header("Connection", "close")
        self.send_header("Content-Length", str(len(data)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:
        # The request line only (never headers, so never the token), escaped, at debug. Its query
        # string is left out: the API reads none, and a client may have put the token there.
        line = _QUERY.sub("?<query not logged>", format % args)
        log.debug("control API %s: %s", safe(self.client_address[0]), safe(line, 300))


def _problems(e: ValidationError) -> list[dict[str, Any]]:
    """Pydantic's errors without its input echo or documentation URLs."""
    return [{"loc": list(err["loc"]), "msg": err["msg"].removeprefix("Value error, ")} for err in e.errors()]
