"""HTTP front of the test API server: routing, authentication, audit log, fault injection, watches.

A stdlib ``ThreadingHTTPServer`` speaking HTTP/1.1 with keep-alive: one thread per connection,
requests answered from memory under one lock. A watch is one long chunked response fed by its
``Watcher`` queue (event-driven: a thread sleeps on a condition until an event, a bookmark tick or
its timeout), with each event's JSON line encoded once for all watchers.

Test hooks live under ``/_test/`` (admin token only), so a test can drive a server in another
process the same way it drives one in its own: expire the watch history, count and drop open
watches, add faults, read the audit log.
"""

from __future__ import annotations

import contextlib
import datetime
import io
import json
import logging
import re
import socket
import ssl
import threading
import time
import urllib.parse
from dataclasses import asdict, dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import yaml

from . import resources as res
from .apiserver import ApiServer, DeleteOptions, bind, evict
from .errors import ApiError, bad_request
from .resources import ResourceType
from .schema import KUBERNETES_VERSION
from .store import Event, Obj, Watcher

log = logging.getLogger(__name__)

_TABLE_RE = re.compile(r"as=Table")


@dataclass(frozen=True)
class User:
    name: str
    groups: tuple[str, ...] = ("system:authenticated",)


@dataclass
class AuditRecord:
    """One request as RBAC sees it (verb in RBAC terms) and how it was answered."""

    seq: int
    user: str
    verb: str
    api_group: str
    resource: str
    subresource: str
    namespace: str
    name: str
    code: int
    path: str
    time: float = field(default_factory=time.time)
    created: str = ""
    """The name of the object a create made (RBAC sees a create without a name; its body has one)."""

    @property
    def resource_path(self) -> str:
        """``pods``, ``pods/status``, ``leases`` — the form RBAC rules use."""
        return f"{self.resource}/{self.subresource}" if self.subresource else self.resource


@dataclass
class Fault:
    """Make the next ``count`` requests that match fail with ``status`` (500, 429, 503, …), hang for
    ``delay`` seconds and then drop the connection (``action="timeout"``), hang until the faults are
    cleared (``delay`` seconds at most) and then drop it (``action="hang"``: a stuck admission webhook,
    a namespace that does not answer), drop it at once (``action="drop"``), or serve them and drop the
    connection instead of answering (``action="lost-answer"``: the write happened, the client cannot
    know), or serve them and drop the connection halfway through the answer's body
    (``action="torn-answer"``: the head arrived, the rest never will). ``hits`` counts the requests
    that met the fault so far (a hanging one as it starts). Empty matcher fields match anything;
    ``path`` matches the request's path exactly (discovery, e.g. ``/apis/events.k8s.io/v1``, has no
    resource to match on)."""

    verb: str = ""
    resource: str = ""
    subresource: str = ""
    namespace: str = ""
    name: str = ""
    user: str = ""
    path: str = ""
    count: int = 1
    action: str = "status"  # status | timeout | hang | drop | lost-answer | torn-answer
    status: int = 500
    retry_after: int = 1
    delay: float = 30.0
    hits: int = 0
    released: threading.Event = field(default_factory=threading.Event, repr=False, compare=False)
    """Set by ``clear_faults``: the requests a ``hang`` holds are let go."""

    def matches(
        self, user: str, verb: str, resource: str, subresource: str, namespace: str, name: str, path: str = ""
    ) -> bool:
        return all(
            not want or want == got
            for want, got in (
                (self.verb, verb),
                (self.resource, resource),
                (self.subresource, subresource),
                (self.namespace, namespace),
                (self.name, name),
                (self.user, user),
                (self.path, path),
            )
        )


@dataclass
class RequestInfo:
    verb: str = "get"
    group: str = ""
    version: str = ""
    resource: str = ""
    subresource: str = ""
    namespace: str = ""
    name: str = ""
    is_resource: bool = False
    rt: ResourceType | None = None
    created: str = ""


class HttpFront:
    """The HTTP server, its tokens, audit log and faults; ``ApiServer`` does the rest."""

    def __init__(self, api: ApiServer, tokens: dict[str, User], admin_token: str) -> None:
        self.api = api
        self.tokens = dict(tokens)
        self.admin_token = admin_token
        self.audit: list[AuditRecord] = []
        self._audit_lock = threading.Lock()
        self.faults: list[Fault] = []
        self._fault_lock = threading.Lock()
        self._watches: set[Watcher] = set()
        self._watch_lock = threading.Lock()
        self._httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self.url = ""
        self.stopping = False

    # Lifecycle ---------------------------------------------------------------------------------
    def start(self, host: str = "127.0.0.1", port: int = 0, tls: tuple[Path, Path] | None = None) -> str:
        """Serve on ``host:port`` (0: a free port); HTTPS with ``tls`` = (cert file, key file)."""
        front = self

        class Server(ThreadingHTTPServer):
            daemon_threads = True
            request_queue_size = 1024
            allow_reuse_address = True
            block_on_close = False

        class Handler(_Handler):
            pass

        Handler.front = front
        self._httpd = Server((host, port), Handler)
        scheme = "http"
        if tls is not None:
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            ctx.load_cert_chain(str(tls[0]), str(tls[1]))
            # The handshake happens in each connection's own thread, not in the accepting one.
            self._httpd.socket = ctx.wrap_socket(self._httpd.socket, server_side=True, do_handshake_on_connect=False)
            scheme = "https"
        self.url = f"{scheme}://{host}:{self._httpd.server_address[1]}"
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="test-apiserver", daemon=True)
        self._thread.start()
        return self.url

    def stop(self) -> None:
        self.stopping = True
        self.drop_watches()
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()

    # Hooks -------------------------------------------------------------------------------------
    def add_user(self, name: str, token: str, groups: tuple[str, ...] = ("system:authenticated",)) -> None:
        self.tokens[token] = User(name, groups)

    def add_fault(self, fault: Fault) -> Fault:
        with self._fault_lock:
            self.faults.append(fault)
        return fault

    def clear_faults(self) -> None:
        with self._fault_lock:
            for fault in self.faults:
                fault.released.set()
            self.faults.clear()

    def open_watches(self, resource: str = "", namespace: str | None = None) -> list[Watcher]:
        """The open watches (of ``resource``, a plural, if given; opened in ``namespace``, if given)."""
        with self._watch_lock:
            return [
                w
                for w in self._watches
                if (not resource or w.resource.endswith("/" + resource))
                and (namespace is None or w.namespace == namespace)
            ]

    def drop_watches(self, resource: str = "", namespace: str | None = None) -> int:
        """Cut every open watch (of ``resource``, a plural, if given; opened in ``namespace``, if
        given) mid-stream."""
        victims = self.open_watches(resource, namespace)
        for w in victims:
            w.close(dropped=True)
        return len(victims)

    def audit_records(self, since: int = 0) -> list[AuditRecord]:
        with self._audit_lock:
            return [r for r in self.audit if r.seq >= since]

    def _record(self, user: str, info: RequestInfo, code: int, path: str) -> None:
        with self._audit_lock:
            self.audit.append(
                AuditRecord(
                    len(self.audit),
                    user,
                    info.verb,
                    info.group,
                    info.resource,
                    info.subresource,
                    info.namespace,
                    info.name,
                    code,
                    path,
                    created=info.created,
                )
            )

    def _take_fault(self, user: str, info: RequestInfo, path: str = "") -> Fault | None:
        with self._fault_lock:
            for f in self.faults:
                if f.count > 0 and f.matches(
                    user, info.verb, info.resource, info.subresource, info.namespace, info.name, path
                ):
                    f.count -= 1
                    f.hits += 1
                    return f
        return None


def _reason_for(code: int) -> str:
    return {
        400: "BadRequest",
        401: "Unauthorized",
        403: "Forbidden",
        404: "NotFound",
        405: "MethodNotAllowed",
        409: "Conflict",
        410: "Expired",
        415: "UnsupportedMediaType",
        422: "Invalid",
        429: "TooManyRequests",
        500: "InternalError",
        503: "ServiceUnavailable",
        504: "Timeout",
    }.get(code, "Unknown")


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    front: HttpFront
    server_version = "spotjob-test-apiserver"
    # An answer is written as headers, then body: without TCP_NODELAY the body waits for the
    # client's delayed ACK of the headers (40 ms on Linux) on every keep-alive request.
    disable_nagle_algorithm = True

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s " + format, self.address_string(), *args)

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def do_PUT(self) -> None:
        self._dispatch("PUT")

    def do_PATCH(self) -> None:
        self._dispatch("PATCH")

    def do_DELETE(self) -> None:
        self._dispatch("DELETE")

    # Plumbing ----------------------------------------------------------------------------------
    def _send(self, code: int, body: Any, headers: dict[str, str] | None = None) -> None:
        data = json.dumps(body, separators=(",", ":")).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(data)

    def _send_error(self, e: ApiError) -> None:
        headers = {"Retry-After": str(e.retry_after)} if e.retry_after is not None else {}
        self._send(e.code, e.status(), headers)

    def _read_body(self) -> Any:
        length = int(self.headers.get("Content-Length") or 0)
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            chunks = []
            while True:
                size = int(self.rfile.readline().strip() or b"0", 16)
                if size == 0:
                    self.rfile.readline()
                    break
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
            raw = b"".join(chunks)
        else:
            raw = self.rfile.read(length) if length else b""
        if not raw:
            return None
        ctype = (self.headers.get("Content-Type") or "application/json").split(";")[0].strip()
        if "protobuf" in ctype or "cbor" in ctype:
            # kubectl's typed commands (`kubectl create namespace`, `create secret`, ...) send protobuf.
            raise ApiError(
                415,
                "UnsupportedMediaType",
                f"the test API server takes JSON and YAML bodies, not {ctype}: kubectl's typed "
                "commands such as `kubectl create namespace` send protobuf; write the object as "
                "YAML and `kubectl apply -f` it",
            )
        try:
            if "yaml" in ctype:
                return yaml.safe_load(raw)
            return json.loads(raw)
        except (ValueError, yaml.YAMLError) as e:
            raise bad_request(f"the body of the request could not be decoded: {e}") from None

    def _user(self) -> str | None:
        auth = self.headers.get("Authorization", "")
        if auth.startswith("Bearer "):
            user = self.front.tokens.get(auth[7:].strip())
            return user.name if user else None
        return None

    # Routing -----------------------------------------------------------------------------------
    def _dispatch(self, method: str) -> None:
        parsed = urllib.parse.urlsplit(self.path)
        query = {k: v[-1] for k, v in urllib.parse.parse_qs(parsed.query, keep_blank_values=True).items()}
        path = parsed.path.rstrip("/") or "/"
        info = RequestInfo(
            verb={"GET": "get", "POST": "create", "PUT": "update", "PATCH": "patch", "DELETE": "delete"}[method]
        )
        user = self._user()
        code = 200
        # The request is logged as its response starts (send_response), so a client holding its answer
        # always finds its request in the audit log; the finally logs one that never got that far.
        self._audit_entry = (user or "system:anonymous", info, path)
        try:
            if path in ("/version", "/healthz", "/readyz", "/livez") and method == "GET":
                self._send(200, _version() if path == "/version" else "ok")
                return
            if user is None:
                raise ApiError(401, "Unauthorized", "Unauthorized")
            if path.startswith("/_test/"):
                if self.headers.get("Authorization", "")[7:].strip() != self.front.admin_token:
                    raise ApiError(403, "Forbidden", "test hooks need the admin token")
                self._test_hook(method, path, query)
                return
            self._parse(path, method, query, info)
            fault = self.front._take_fault(user, info, path)
            if fault is not None and fault.action == "lost-answer":
                code = self._serve_answer_lost(method, path, query, info, user)
                return
            if fault is not None and fault.action == "torn-answer":
                code = self._serve_answer_torn(method, path, query, info, user)
                return
            if fault is not None:
                code = self._inject(fault)
                return
            code = self._serve(method, path, query, info, user)
        except ApiError as e:
            code = e.code
            # The body must be drained for the keep-alive connection to stay in step.
            with contextlib.suppress(Exception):
                self._read_body_if_unread()
            self._send_error(e)
        except (BrokenPipeError, ConnectionResetError, ssl.SSLError):
            code = 499
            self.close_connection = True
        except Exception as e:
            log.exception("test API server failed on %s %s", method, self.path)
            code = 500
            self._send_error(ApiError(500, "InternalError", f"test API server error: {e!r}"))
        finally:
            self._audit_now(code)

    _audit_entry: tuple[str, RequestInfo, str] | None = None

    def _audit_now(self, code: int) -> None:
        entry, self._audit_entry = self._audit_entry, None
        if entry is not None:
            self.front._record(entry[0], entry[1], code, entry[2])

    def send_response(self, code: int, message: str | None = None) -> None:
        self._audit_now(code)
        super().send_response(code, message)

    _body_read = False

    def _read_body_if_unread(self) -> None:
        if not self._body_read and self.command in ("POST", "PUT", "PATCH", "DELETE"):
            self._body_read = True
            self._read_body()

    def _body(self) -> Any:
        self._body_read = True
        return self._read_body()

    def handle_one_request(self) -> None:
        self._body_read = False
        self._audit_entry = None
        super().handle_one_request()

    def _serve_answer_lost(self, method: str, path: str, query: dict[str, str], info: RequestInfo, user: str) -> int:
        """Serve the request, then drop the connection where its answer would go."""
        answer, self.wfile = self.wfile, io.BytesIO()
        try:
            self._serve(method, path, query, info, user)
        except ApiError:
            pass  # refused: nothing happened, and the client hears nothing of it either
        finally:
            self.wfile = answer
        self.close_connection = True
        self.connection.shutdown(socket.SHUT_RDWR)
        return 0

    def _serve_answer_torn(self, method: str, path: str, query: dict[str, str], info: RequestInfo, user: str) -> int:
        """Serve the request, send its answer's head and half its body, then drop the connection."""
        answer, self.wfile = self.wfile, io.BytesIO()
        try:
            code = self._serve(method, path, query, info, user)
        finally:
            whole, self.wfile = self.wfile.getvalue(), answer  # type: ignore[attr-defined]
        body_at = whole.find(b"\r\n\r\n") + 4
        self.wfile.write(whole[: body_at + (len(whole) - body_at) // 2])
        self.wfile.flush()
        self.close_connection = True
        self.connection.shutdown(socket.SHUT_RDWR)
        return code

    def _inject(self, fault: Fault) -> int:
        self._read_body_if_unread()
        if fault.action in ("timeout", "hang"):
            if fault.action == "hang":
                fault.released.wait(fault.delay)
            else:
                time.sleep(fault.delay)
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)
            return 0
        if fault.action == "drop":
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)
            return 0
        e = ApiError(
            fault.status,
            _reason_for(fault.status),
            "the server has received too many requests and has asked us to try again later"
            if fault.status == 429
            else f"injected fault {fault.status}",
            retry_after=fault.retry_after if fault.status in (429, 503) else None,
        )
        self._send_error(e)
        return fault.status

    def _parse(self, path: str, method: str, query: dict[str, str], info: RequestInfo) -> None:
        parts = [urllib.parse.unquote(p) for p in path.strip("/").split("/")]
        if parts[0] == "api" and len(parts) >= 2:
            info.group, info.version, rest = "", parts[1], parts[2:]
        elif parts[0] == "apis" and len(parts) >= 3:
            info.group, info.version, rest = parts[1], parts[2], parts[3:]
        else:
            return
        if not rest:
            return
        if (
            rest[0] == "namespaces"
            and len(rest) >= 3
            and not (len(rest) == 3 and rest[2] in ("status", "finalize") and info.group == "")
        ):
            info.namespace = rest[1]
            rest = rest[2:]
        elif rest[0] == "namespaces" and len(rest) >= 2:
            info.name = rest[1]
        info.resource = rest[0]
        if len(rest) > 1:
            info.name = rest[1]
        if len(rest) > 2:
            info.subresource = rest[2]
        info.is_resource = True
        if method == "GET":
            info.verb = "watch" if query.get("watch") in ("true", "1") else ("get" if info.name else "list")
        elif method == "DELETE" and not info.name:
            info.verb = "deletecollection"
        if info.resource == "namespaces" and info.group == "" and info.namespace and not info.name:
            pass

    def _serve(self, method: str, path: str, query: dict[str, str], info: RequestInfo, user: str) -> int:
        api = self.front.api
        if path == "/api" and method == "GET":
            self._send(
                200,
                {
                    "kind": "APIVersions",
                    "versions": ["v1"],
                    "serverAddressByClientCIDRs": [
                        {"clientCIDR": "0.0.0.0/0", "serverAddress": self.headers.get("Host", "")}
                    ],
                },
            )
            return 200
        if path == "/apis" and method == "GET":
            self._send(200, self._group_list())
            return 200
        if path.startswith("/openapi/v3"):
            rest = path[len("/openapi/v3") :].strip("/")
            if not rest:
                self._send(200, api.openapi_v3_index())
                return 200
            parts = rest.split("/")
            group, version = ("", parts[1]) if parts[0] == "api" else (parts[1], parts[2])
            self._send(200, api.openapi_v3(group, version), {"Cache-Control": "public, immutable"})
            return 200
        if path.startswith("/openapi/v2"):
            raise ApiError(404, "NotFound", "OpenAPI v2 is not served by the test API server; clients use /openapi/v3")
        if not info.version:
            raise ApiError(404, "NotFound", "the server could not find the requested resource")
        if path.startswith("/apis/") and not info.is_resource:
            parts = path.strip("/").split("/")
            if len(parts) == 2:
                found: dict[str, Any] | None = next(
                    (g for g in self._group_list()["groups"] if g["name"] == parts[1]), None
                )
                if found is None:
                    raise ApiError(404, "NotFound", "the server could not find the requested resource")
                self._send(200, {"kind": "APIGroup", "apiVersion": "v1", **found})
                return 200
        if not info.is_resource:
            self._send(200, self._resource_list(info.group, info.version))
            return 200
        rt = api.registry.get(info.group, info.version, info.resource)
        if rt is None:
            raise ApiError(404, "NotFound", "the server could not find the requested resource")
        info.rt = rt
        if rt.namespaced is False and info.namespace:
            raise ApiError(404, "NotFound", "the server could not find the requested resource")
        dry_run = bool(query.get("dryRun"))
        validation = query.get("fieldValidation", "Warn")
        if method == "GET":
            if query.get("watch") in ("true", "1"):
                return self._watch(rt, info, query)
            if info.name:
                if info.subresource not in ("", "status"):
                    raise ApiError(404, "NotFound", "the server could not find the requested resource")
                obj = api.get(rt, info.namespace, info.name)
                if self._wants_table():
                    self._send(
                        200,
                        res.table(
                            rt,
                            [obj],
                            query.get("includeObject", "Metadata"),
                            {"resourceVersion": obj["metadata"]["resourceVersion"]},
                        ),
                    )
                else:
                    self._send(200, obj)
                return 200
            items, meta = api.list_objects(
                rt,
                info.namespace or None,
                label_selector=query.get("labelSelector"),
                field_selector=query.get("fieldSelector"),
                limit=int(query.get("limit") or 0),
                continue_token=query.get("continue"),
            )
            if self._wants_table():
                self._send(200, res.table(rt, items, query.get("includeObject", "Metadata"), meta))
            else:
                if rt.crd is None:
                    items = [{k: v for k, v in o.items() if k not in ("apiVersion", "kind")} for o in items]
                self._send(
                    200, {"kind": f"{rt.kind}List", "apiVersion": rt.api_version, "metadata": meta, "items": items}
                )
            return 200
        if method == "POST":
            body = self._body()
            if info.subresource == "binding" and rt.storage == "core/pods":
                bind(api, info.namespace, info.name, body, user)
                self._send(
                    201, {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "code": 201}
                )
                return 201
            if info.subresource == "eviction" and rt.storage == "core/pods":
                evict(api, info.namespace, info.name, body, user)
                self._send(
                    201, {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "code": 201}
                )
                return 201
            if info.name:
                raise ApiError(405, "MethodNotAllowed", f"POST is not supported on a named {rt.plural}")
            result = api.create(rt, info.namespace, body, user=user, dry_run=dry_run, field_validation=validation)
            info.created = str(result.obj.get("metadata", {}).get("name") or "")
            self._send(201, result.obj, self._warnings(result.warnings))
            return 201
        if method == "PUT":
            if not info.name:
                raise ApiError(405, "MethodNotAllowed", "PUT needs a name")
            result = api.update(
                rt,
                info.namespace,
                info.name,
                self._body(),
                user=user,
                subresource=info.subresource,
                dry_run=dry_run,
                field_validation=validation,
            )
            self._send(200, result.obj, self._warnings(result.warnings))
            return 200
        if method == "PATCH":
            if not info.name:
                raise ApiError(405, "MethodNotAllowed", "PATCH needs a name")
            result = api.patch(
                rt,
                info.namespace,
                info.name,
                self.headers.get("Content-Type", ""),
                self._body(),
                user=user,
                subresource=info.subresource,
                dry_run=dry_run,
                field_validation=validation,
            )
            self._send(200, result.obj, self._warnings(result.warnings))
            return 200
        if method == "DELETE":
            body = self._body()
            opts = DeleteOptions.parse(body if isinstance(body, dict) else None, query)
            if not info.name:
                items, _ = api.list_objects(
                    rt,
                    info.namespace or None,
                    label_selector=query.get("labelSelector"),
                    field_selector=query.get("fieldSelector"),
                )
                for o in items:
                    try:
                        api.delete(
                            rt,
                            info.namespace or o["metadata"].get("namespace", ""),
                            o["metadata"]["name"],
                            opts,
                            user=user,
                        )
                    except ApiError as e:
                        if e.code != 404:
                            raise
                self._send(
                    200, {"kind": f"{rt.kind}List", "apiVersion": rt.api_version, "metadata": {}, "items": items}
                )
                return 200
            obj, gone = api.delete(rt, info.namespace, info.name, opts, user=user)
            if gone and rt.storage not in ("core/pods", "core/services"):
                md = obj["metadata"]
                self._send(
                    200,
                    {
                        "kind": "Status",
                        "apiVersion": "v1",
                        "metadata": {},
                        "status": "Success",
                        "details": {"name": md["name"], "group": rt.group, "kind": rt.plural, "uid": md["uid"]},
                    },
                )
            else:
                self._send(200, obj)
            return 200
        raise ApiError(405, "MethodNotAllowed", f"{method} is not supported")

    def _warnings(self, warnings: list[str]) -> dict[str, str]:
        if not warnings:
            return {}
        # RFC 7234 warn-text is a quoted-string: a quote or backslash in the text is escaped
        # (a CEL rule's warning quotes the value's type), or clients drop the header.
        quoted = (w.replace("\\", "\\\\").replace('"', '\\"') for w in warnings)
        return {"Warning": ", ".join(f'299 - "{w}"' for w in quoted)}

    def _wants_table(self) -> bool:
        accept = self.headers.get("Accept", "")
        return bool(_TABLE_RE.search(accept)) and "g=meta.k8s.io" in accept

    # Discovery ---------------------------------------------------------------------------------
    def _group_list(self) -> dict[str, Any]:
        groups = []
        for group, versions in self.front.api.registry.group_versions().items():
            if not group:
                continue
            vs = [{"groupVersion": f"{group}/{v}", "version": v} for v in versions]
            groups.append({"name": group, "versions": vs, "preferredVersion": vs[0]})
        if not any(g["name"] == "policy" for g in groups):
            vs = [{"groupVersion": "policy/v1", "version": "v1"}]
            groups.append({"name": "policy", "versions": vs, "preferredVersion": vs[0]})
        return {"kind": "APIGroupList", "apiVersion": "v1", "groups": groups}

    def _resource_list(self, group: str, version: str) -> dict[str, Any]:
        types = [rt for rt in self.front.api.registry.types.values() if rt.group == group and rt.version == version]
        if not types and not (group == "policy" and version == "v1"):
            raise ApiError(404, "NotFound", "the server could not find the requested resource")
        resources = [r for rt in types for r in rt.discovery()]
        gv = f"{group}/{version}" if group else version
        return {"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": gv, "resources": resources}

    # Watches -----------------------------------------------------------------------------------
    def _watch(self, rt: ResourceType, info: RequestInfo, query: dict[str, str]) -> int:
        api = self.front.api
        match = api.matcher(rt, info.namespace or None, query.get("labelSelector"), query.get("fieldSelector"))
        if info.name:
            by_name = match

            def match(o: Obj) -> bool:
                return o["metadata"]["name"] == info.name and by_name(o)

        bookmarks = query.get("allowWatchBookmarks") in ("true", "1")
        timeout = float(query.get("timeoutSeconds") or 1800)
        table = self._wants_table()
        include = query.get("includeObject", "Metadata")
        started = api.watch(rt, query.get("resourceVersion"))
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        if started is None:
            since = query.get("resourceVersion")
            status = ApiError(410, "Expired", f"too old resource version: {since} ({api.store.history_floor})").status()
            self._chunk(json.dumps({"type": "ERROR", "object": status}).encode() + b"\n")
            self.wfile.write(b"0\r\n\r\n")
            return 200
        watcher, backlog, initial = started
        watcher.namespace = info.namespace or None
        with self.front._watch_lock:
            self.front._watches.add(watcher)

        def encode(etype: str, obj: Obj, ev: Event | None) -> bytes:
            if table:
                obj = res.table(rt, [rt.view(obj)], include, {"resourceVersion": obj["metadata"]["resourceVersion"]})
            elif rt.to_view is not None or ev is None or etype != ev.type:
                obj = rt.view(obj)
            else:
                return ev.line()
            return json.dumps({"type": etype, "object": obj}, separators=(",", ":")).encode() + b"\n"

        def deliver(ev: Event) -> bool:
            now_in = match(ev.obj)
            was_in = ev.prev is not None and match(ev.prev)
            if ev.type == "ADDED":
                etype = "ADDED" if now_in else ""
            elif ev.type == "DELETED":
                etype = "DELETED" if (was_in or now_in) else ""
            elif now_in and was_in:
                etype = "MODIFIED"
            elif now_in:
                etype = "ADDED"
            elif was_in:
                etype = "DELETED"
            else:
                etype = ""
            if etype:
                self._chunk(encode(etype, ev.obj, ev))
            return bool(etype)

        deadline = time.monotonic() + timeout
        last_rv = 0
        try:
            for obj in initial:
                if match(obj):
                    self._chunk(encode("ADDED", obj, None))
            if query.get("sendInitialEvents") == "true" and bookmarks:
                self._bookmark(rt, api.store.rv, initial_end=True)
            for past in backlog:
                deliver(past)
                last_rv = past.rv
            next_bookmark = time.monotonic() + api.bookmark_interval
            while not self.front.stopping:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                ev = watcher.next(
                    min(remaining, max(0.05, next_bookmark - time.monotonic())) if bookmarks else remaining
                )
                if ev is not None:
                    deliver(ev)
                    last_rv = ev.rv
                    continue
                if watcher.closed:
                    break
                if bookmarks and time.monotonic() >= next_bookmark:
                    with api.store.lock:
                        if watcher.closed:  # cut while the bookmark waited for the lock: it sees no newer version
                            continue
                        rv = api.store.rv if watcher.idle() else last_rv
                    if rv >= last_rv:  # sent every interval, as the watch cache's progress notifications are
                        self._bookmark(rt, rv)
                        last_rv = rv
                    next_bookmark = time.monotonic() + api.bookmark_interval
            if watcher.dropped:
                self.close_connection = True
                self.connection.shutdown(socket.SHUT_RDWR)
                return 200
            self.wfile.write(b"0\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError, OSError):
            self.close_connection = True
        finally:
            api.store.unwatch(watcher)
            with self.front._watch_lock:
                self.front._watches.discard(watcher)
        return 200

    def _bookmark(self, rt: ResourceType, rv: int, initial_end: bool = False) -> None:
        md: dict[str, Any] = {"resourceVersion": str(rv)}
        if initial_end:
            md["annotations"] = {"k8s.io/initial-events-end": "true"}
        self._chunk(
            json.dumps(
                {"type": "BOOKMARK", "object": {"kind": rt.kind, "apiVersion": rt.api_version, "metadata": md}}
            ).encode()
            + b"\n"
        )

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    # Test hooks --------------------------------------------------------------------------------
    def _test_hook(self, method: str, path: str, query: dict[str, str]) -> None:
        front = self.front
        hook = path[len("/_test/") :]
        if hook == "expire-history" and method == "POST":
            front.api.store.expire_history()
            self._send(200, {"historyFloor": front.api.store.history_floor})
        elif hook == "drop-watches" and method == "POST":
            self._send(200, {"dropped": front.drop_watches(query.get("resource", ""))})
        elif hook == "watches" and method == "GET":
            self._send(200, {"open": len(front.open_watches(query.get("resource", "")))})
        elif hook == "faults" and method == "POST":
            body = self._body() or {}
            front.add_fault(
                Fault(**{k: v for k, v in body.items() if k in Fault.__dataclass_fields__ and k != "released"})
            )
            self._send(201, {"faults": len(front.faults)})
        elif hook == "faults" and method == "DELETE":
            front.clear_faults()
            self._send(200, {"faults": 0})
        elif hook == "audit" and method == "GET":
            since = int(query.get("since") or 0)
            self._send(200, {"items": [asdict(r) for r in front.audit_records(since)]})
        elif hook == "validation-failures" and method == "GET":
            self._send(200, {"items": [asdict(f) for f in front.api.validation_failures]})
        else:
            raise ApiError(404, "NotFound", f"no test hook {method} {hook}")


def _version() -> dict[str, str]:
    major, minor = KUBERNETES_VERSION.split(".")
    return {
        "major": major,
        "minor": minor,
        "gitVersion": f"v{KUBERNETES_VERSION}.0-spotjob-test",
        "gitCommit": "0000000000000000000000000000000000000000",
        "gitTreeState": "clean",
        "buildDate": datetime.datetime(2025, 1, 1, tzinfo=datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "goVersion": "go1.23",
        "compiler": "gc",
        "platform": "linux/amd64",
    }
