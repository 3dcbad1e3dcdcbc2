"""A fault-injecting HTTP reverse proxy, for proving that storage clients retry what they should.

``FaultProxy`` listens on loopback and forwards every request to one upstream (moto's server,
fake-gcs-server, any HTTP service). Tests arm it with rules; each request is checked against the
rules in the order they were added, and the first armed rule that matches fires instead of (or
around) the normal forwarding:

- ``fail(times, status)``: answer with an error in the upstream's dialect (S3 XML or GCS JSON)
  without forwarding — throttling (503 SlowDown, 429), a 500, a 403;
- ``drop(times, when=...)``: close the connection without an answer — ``"before"`` the request
  reaches the upstream (it never happened), ``"after"`` it did (the write landed but its answer is
  lost), or ``"mid_body"`` after sending the status, headers and half the body;
- ``strip_header(name)``: forward the request without that header — a store that does not know a
  header and ignores it (``If-None-Match`` on an older MinIO);
- ``answer(times, status, body)``: answer without forwarding, with a body made from the request's
  (``body(request_body)``) — a ``DeleteObjects`` that succeeds (200) while listing per-key errors;
- ``damage(times, body)``: forward, and relay the upstream's answer (status, headers) with its body
  made ``body(answer_body)`` — bytes damaged on the way, or where they are kept when every read is.

Every request is recorded in ``seen`` (method, path, the rule that fired), and each rule counts
``served``, so a test can assert the faults were really delivered. ``Location`` headers that point
at the upstream are rewritten to the proxy, so a resumable upload's later requests come through it
too. The proxy reads whole bodies into memory: it is for tests, not for large data.

Example::

    with FaultProxy(moto_url, dialect="s3") as proxy:
        throttle = proxy.fail(2, 503, method="PUT", path=r"partNumber=")
        proxy.drop(1, when="before", method="PUT", path=r"partNumber=")
        ...  # point the client at proxy.url, run the operation
        assert throttle.served == 2
"""

from __future__ import annotations

import http.client
import json
import logging
import re
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from email.message import Message
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Literal
from urllib.parse import urlsplit

log = logging.getLogger(__name__)

Dialect = Literal["s3", "gcs"]
DropWhen = Literal["before", "after", "mid_body"]

# Per-connection headers a proxy must not pass on (RFC 9110 7.6.1), plus Expect: the handler has
# already answered "100 Continue" itself and forwards the body in one piece.
_HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-connection",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "expect",
    }
)

_S3_CODES = {
    400: "BadRequest",
    403: "AccessDenied",
    404: "NoSuchKey",
    409: "ConditionalRequestConflict",
    412: "PreconditionFailed",
    429: "SlowDown",
    500: "InternalError",
    502: "BadGateway",
    503: "SlowDown",
    504: "GatewayTimeout",
}
_GCS_REASONS = {
    400: "badRequest",
    403: "forbidden",
    404: "notFound",
    412: "conditionNotMet",
    429: "rateLimitExceeded",
    500: "backendError",
    502: "badGateway",
    503: "backendError",
    504: "gatewayTimeout",
}


@dataclass(frozen=True)
class Request:
    """What a rule's ``match`` sees of a request."""

    method: str
    path: str
    """The request target: path and query string."""
    headers: Message


@dataclass
class FaultRule:
    """One armed fault. ``served`` counts how often it fired; it stops after ``times``."""

    action: Literal["fail", "drop", "strip", "answer", "damage"]
    times: int
    match: Callable[[Request], bool]
    status: int = 503
    code: str = ""
    message: str = ""
    when: DropWhen = "before"
    header: str = ""
    body: Callable[[bytes], bytes] | None = None
    served: int = 0

    @property
    def exhausted(self) -> bool:
        return self.served >= self.times

    def describe(self) -> str:
        if self.action == "strip":
            return f"strip {self.header}"
        if self.action == "answer":
            return f"answer {self.status}"
        if self.action == "damage":
            return "damage the answer's body"
        return f"fail {self.status} {self.code}" if self.action == "fail" else f"drop {self.when}"


@dataclass(frozen=True)
class Seen:
    method: str
    path: str
    fault: str | None
    """The fired rule's description, or None when the request was forwarded untouched."""


@dataclass
class _State:
    rules: list[FaultRule] = field(default_factory=list)
    seen: list[Seen] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


def _matcher(
    method: str | None, path: str | None, match: Callable[[Request], bool] | None
) -> Callable[[Request], bool]:
    path_re = re.compile(path) if path else None

    def matches(req: Request) -> bool:
        if method and req.method.upper() != method.upper():
            return False
        if path_re and not path_re.search(req.path):
            return False
        return match(req) if match else True

    return matches


class FaultProxy:
    """A reverse proxy to ``upstream`` (``http://host:port``) that injects armed faults."""

    def __init__(self, upstream: str, *, dialect: Dialect = "s3") -> None:
        parts = urlsplit(upstream)
        if parts.scheme != "http" or not parts.hostname or not parts.port:
            raise ValueError(f"upstream must be http://host:port, got {upstream!r}")
        self.upstream = f"http://{parts.hostname}:{parts.port}"
        self.dialect = dialect
        self._upstream_addr = (parts.hostname, parts.port)
        self._state = _State()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> FaultProxy:
        server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        server.daemon_threads = True
        server.proxy = self  # type: ignore[attr-defined]
        self._server = server
        self._thread = threading.Thread(
            target=server.serve_forever, kwargs={"poll_interval": 0.05}, name="fault-proxy", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    @property
    def url(self) -> str:
        if self._server is None:
            raise RuntimeError("the proxy is not started")
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    # -- arming ------------------------------------------------------------------------------
    def fail(
        self,
        times: int = 1,
        status: int = 503,
        *,
        code: str | None = None,
        message: str | None = None,
        method: str | None = None,
        path: str | None = None,
        match: Callable[[Request], bool] | None = None,
    ) -> FaultRule:
        """Answer the next ``times`` matching requests with ``status`` instead of forwarding them.

        ``path`` is a regex searched in the request target; ``code`` defaults to the usual S3
        error code (or GCS reason) for the status.
        """
        default_code = (_S3_CODES if self.dialect == "s3" else _GCS_REASONS).get(status, "Fault")
        rule = FaultRule(
            "fail",
            times,
            _matcher(method, path, match),
            status=status,
            code=code or default_code,
            message=message or f"injected fault: HTTP {status}",
        )
        return self._arm(rule)

    def drop(
        self,
        times: int = 1,
        *,
        when: DropWhen = "before",
        method: str | None = None,
        path: str | None = None,
        match: Callable[[Request], bool] | None = None,
    ) -> FaultRule:
        """Close the connection of the next ``times`` matching requests without a (whole) answer."""
        return self._arm(FaultRule("drop", times, _matcher(method, path, match), when=when))

    def answer(
        self,
        times: int,
        status: int,
        body: Callable[[bytes], bytes],
        *,
        method: str | None = None,
        path: str | None = None,
        match: Callable[[Request], bool] | None = None,
    ) -> FaultRule:
        """Answer the next ``times`` matching requests with ``status`` and ``body(request body)``
        (XML for S3) instead of forwarding them."""
        return self._arm(FaultRule("answer", times, _matcher(method, path, match), status=status, body=body))

    def damage(
        self,
        times: int,
        body: Callable[[bytes], bytes],
        *,
        method: str | None = None,
        path: str | None = None,
        match: Callable[[Request], bool] | None = None,
    ) -> FaultRule:
        """Forward the next ``times`` matching requests and relay each answer with its body replaced
        by ``body(answer body)``, its status and headers (a checksum the store sent) as they came."""
        return self._arm(FaultRule("damage", times, _matcher(method, path, match), body=body))

    def strip_header(
        self,
        name: str,
        times: int = 1_000_000,
        *,
        method: str | None = None,
        path: str | None = None,
        match: Callable[[Request], bool] | None = None,
    ) -> FaultRule:
        """Forward the next ``times`` matching requests that carry header ``name`` without it, as a
        store that ignores the header would handle them. Requests without it are left alone."""

        def carries(req: Request) -> bool:
            return name in req.headers and (match(req) if match else True)

        return self._arm(FaultRule("strip", times, _matcher(method, path, carries), header=name))

    def _arm(self, rule: FaultRule) -> FaultRule:
        with self._state.lock:
            self._state.rules.append(rule)
        return rule

    def clear(self) -> None:
        """Disarm every rule (the record of what was seen stays)."""
        with self._state.lock:
            self._state.rules.clear()

    @property
    def seen(self) -> list[Seen]:
        with self._state.lock:
            return list(self._state.seen)

    @property
    def faults_served(self) -> int:
        return sum(1 for s in self.seen if s.fault is not None)

    def _pick(self, req: Request) -> FaultRule | None:
        with self._state.lock:
            for rule in self._state.rules:
                if not rule.exhausted and rule.match(req):
                    rule.served += 1
                    self._state.seen.append(Seen(req.method, req.path, rule.describe()))
                    return rule
            self._state.seen.append(Seen(req.method, req.path, None))
            return None

    def _error_body(self, rule: FaultRule) -> tuple[str, bytes]:
        if self.dialect == "s3":
            xml = (
                '<?xml version="1.0" encoding="UTF-8"?>\n'
                f"<Error><Code>{rule.code}</Code><Message>{rule.message}</Message>"
                "<RequestId>spotjob-fault</RequestId></Error>"
            )
            return "application/xml", xml.encode()
        doc = {
            "error": {
                "code": rule.status,
                "message": rule.message,
                "errors": [{"domain": "global", "reason": rule.code, "message": rule.message}],
            }
        }
        return "application/json; charset=UTF-8", json.dumps(doc).encode()


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, like the real servers, so clients reuse sockets

    @property
    def proxy(self) -> FaultProxy:
        return self.server.proxy  # type: ignore[attr-defined,no-any-return]

    def log_message(self, format: str, *args: object) -> None:
        log.debug("fault proxy: " + format, *args)

    def _handle(self) -> None:
        body = self._read_body()
        req = Request(self.command, self.path, self.headers)
        rule = self.proxy._pick(req)
        if rule is None:
            self._relay(*self._forward(body))
            return
        if rule.action == "strip":
            log.debug("fault proxy: %s on %s %s", rule.describe(), self.command, self.path)
            self._relay(*self._forward(body, without=rule.header))
            return
        log.info("fault proxy: %s on %s %s", rule.describe(), self.command, self.path)
        if rule.action == "answer" and rule.body is not None:
            self._relay(rule.status, "Answered", [("Content-Type", "application/xml")], rule.body(body))
            return
        if rule.action == "damage" and rule.body is not None:
            status, reason, headers, payload = self._forward(body)
            self._relay(status, reason, headers, rule.body(payload))
            return
        if rule.action == "fail":
            content_type, payload = self.proxy._error_body(rule)
            self._relay(rule.status, rule.code, [("Content-Type", content_type)], payload)
            return
        if rule.when == "before":
            self._drop()
            return
        status, reason, headers, payload = self._forward(body)
        if rule.when == "after":
            self._drop()
            return
        self._relay(status, reason, headers, payload, cut=len(payload) // 2)
        self._drop()

    do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = do_PATCH = _handle

    def _read_body(self) -> bytes:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            data = bytearray()
            while True:
                size = int(self.rfile.readline().split(b";", 1)[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass  # trailers
                    return bytes(data)
                data += self.rfile.read(size)
                self.rfile.readline()
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def _forward(self, body: bytes, without: str = "") -> tuple[int, str, list[tuple[str, str]], bytes]:
        host, port = self.proxy._upstream_addr
        conn = http.client.HTTPConnection(host, port, timeout=60)
        try:
            conn.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
            for name, value in self.headers.items():
                if name.lower() not in _HOP_BY_HOP and name.lower() not in ("content-length", without.lower()):
                    conn.putheader(name, value)
            if body or self.command in ("PUT", "POST", "PATCH"):
                conn.putheader("Content-Length", str(len(body)))
            conn.endheaders(body or None)
            resp = conn.getresponse()
            payload = resp.read()
            return resp.status, resp.reason, resp.getheaders(), payload
        finally:
            conn.close()

    def _relay(
        self,
        status: int,
        reason: str,
        headers: list[tuple[str, str]],
        payload: bytes,
        *,
        cut: int | None = None,
    ) -> None:
        self.send_response_only(status, reason)
        no_body = self.command == "HEAD" or status in (204, 304) or 100 <= status < 200
        for name, value in headers:
            lower = name.lower()
            if lower in _HOP_BY_HOP:
                continue
            if lower == "content-length" and self.command != "HEAD":
                continue  # recomputed below; a HEAD keeps the object's length
            if lower == "location":
                value = value.replace(self.proxy.upstream, self.proxy.url)
            self.send_header(name, value)
        if not no_body:
            self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        if not no_body and payload:
            self.wfile.write(payload if cut is None else payload[:cut])
        self.wfile.flush()

    def _drop(self) -> None:
        self.close_connection = True
        try:
            self.wfile.flush()
            self.connection.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
