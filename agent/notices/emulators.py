"""Fake cloud metadata servers that follow each cloud's documented contract. No torch import.

Used by the tests and by the local backend (one emulator per simulated node; injecting a
preemption is ``set_spot_action`` / ``set_preempted`` / ``add_event``). Each one listens on
``127.0.0.1:<free port>`` (``.url``), runs in daemon threads, records requests for assertions
(``.count(...)`` counts every one; ``.requests`` holds the newest ``HISTORY``: an agent polls
its node's emulator every second for as long as a local run lasts) and is a context manager.

What each enforces, because the real one does and a client that skips it would break in the cloud:

- ``ImdsEmulator`` (AWS IMDSv2 only): ``PUT /latest/api/token`` needs
  ``X-aws-ec2-metadata-token-ttl-seconds`` in 1..21600 (else 400) and no ``X-Forwarded-For``
  (else 403); every ``GET`` needs a live ``X-aws-ec2-metadata-token`` (else 401). Tokens expire
  after their TTL or at ``expire_tokens()``. ``put_hop_limit_exceeded=True`` models a container
  behind an instance whose ``HttpPutResponseHopLimit`` is 1: a token PUT is never answered (held
  until the emulator stops), while GETs still are. ``http_tokens="optional"`` models an instance
  that still allows IMDSv1 (``HttpTokens: optional``): a ``GET`` without a token is answered, one
  with an invalid token still gets 401. ``http_endpoint="disabled"`` models an instance whose IMDS
  is turned off: every request is answered 403. ``spot/instance-action`` and
  ``events/recommendations/rebalance`` are 404 until set.
- ``GceMetadataEmulator``: every request needs ``Metadata-Flavor: Google`` (else 403); answers
  carry that header and an ``ETag``. ``?wait_for_change=true`` returns at once when ``last_etag``
  differs from the current ETag, else holds the request until the value changes or
  ``timeout_sec`` passes (then returns the unchanged value). ``gke_metadata_server=True`` models
  what a GKE pod under Workload Identity reaches instead: the ``gke-metadata-server`` serves a
  subset of ``instance/`` (``attributes/``, ``hostname``, ``id``, ``service-accounts/``, ``zone``)
  and answers 404 for the rest, ``preempted`` and ``maintenance-event`` among them.
- ``AzureScheduledEventsEmulator``: every request needs ``Metadata: true`` and an
  ``api-version`` (else 400). ``DocumentIncarnation`` goes up on every change; a POSTed
  ``{"StartRequests": [{"EventId": ...}]}`` is recorded and starts those events. Azure enables
  Scheduled Events on a VM at its first request, whose answer can take up to two minutes:
  ``first_call_delay=N`` holds every scheduled events request until N seconds after the first
  one arrived (whether or not its client is still waiting), as the service starts.
"""

from __future__ import annotations

import abc
import collections
import email.utils
import hashlib
import json
import logging
import secrets
import threading
import time
import urllib.parse
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Any, Self

log = logging.getLogger(__name__)


HISTORY = 1000
"""Requests an emulator keeps for ``.requests`` (the newest); ``.count`` counts them all."""


@dataclass(frozen=True)
class RecordedRequest:
    method: str
    path: str
    """Without the query string."""
    query: dict[str, str]
    headers: dict[str, str]
    """Lower-cased names."""
    body: bytes
    status: int
    at: float


@dataclass
class _Reply:
    status: int
    body: bytes = b""
    headers: dict[str, str] = field(default_factory=dict)

    @classmethod
    def text(cls, status: int, text: str, **headers: str) -> _Reply:
        return cls(status, text.encode(), {"Content-Type": "text/plain", **headers})

    @classmethod
    def json(cls, status: int, payload: Any, **headers: str) -> _Reply:
        return cls(status, json.dumps(payload).encode(), {"Content-Type": "application/json", **headers})


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    emulator: MetadataEmulator


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    server_version = "spotjob-emulator/1"

    def _dispatch(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        parts = urllib.parse.urlsplit(self.path)
        query = {k: v[-1] for k, v in urllib.parse.parse_qs(parts.query, keep_blank_values=True).items()}
        headers = {k.lower(): v for k, v in self.headers.items()}
        reply = self.server.emulator._serve(self.command, parts.path, query, headers, body)
        try:
            self.send_response(reply.status)
            for name, value in reply.headers.items():
                self.send_header(name, value)
            self.send_header("Content-Length", str(len(reply.body)))
            self.end_headers()
            self.wfile.write(reply.body)
        except OSError:
            pass  # the client went away (a long poll it aborted)

    do_GET = do_PUT = do_POST = do_DELETE = _dispatch

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s: " + format, self.server.emulator.__class__.__name__, *args)


class MetadataEmulator(abc.ABC):
    """A fake metadata server. ``start()`` (or ``with``) binds; ``stop()`` releases long polls.

    ``history``: how many of the newest requests ``.requests`` keeps (default ``HISTORY``; 0: none,
    for a server nobody inspects, like a local run's nodes); ``.count`` counts every one either way."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, history: int | None = None) -> None:
        self._host = host
        self._port = port
        self._cond = threading.Condition()
        """Guards the state; notified on every change so held long polls can re-check."""
        self._closing = False
        self._requests: collections.deque[RecordedRequest] = collections.deque(
            maxlen=HISTORY if history is None else history
        )
        self._counts: collections.Counter[tuple[str, str, int]] = collections.Counter()
        """Every request served, by (method, path, status): counted, not kept."""
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    # -- lifecycle -----------------------------------------------------------------------------
    def start(self) -> Self:
        server = _Server((self._host, self._port), _Handler)
        server.emulator = self
        self._server = server
        self._thread = threading.Thread(
            target=server.serve_forever, kwargs={"poll_interval": 0.05}, name=type(self).__name__, daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join(timeout=5)

    def __enter__(self) -> Self:
        return self.start() if self._server is None else self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    @property
    def url(self) -> str:
        if self._server is None:
            raise RuntimeError("emulator not started")
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    # -- assertions ----------------------------------------------------------------------------
    @property
    def requests(self) -> list[RecordedRequest]:
        with self._cond:
            return list(self._requests)

    def count(self, method: str | None = None, path: str | None = None, status: int | None = None) -> int:
        """How many requests matched (``None`` matches anything), of all the emulator served."""
        with self._cond:
            counts = list(self._counts.items())
        return sum(
            n
            for (m, p, st), n in counts
            if (method is None or m == method) and (path is None or p == path) and (status is None or st == status)
        )

    # -- serving -------------------------------------------------------------------------------
    def _serve(self, method: str, path: str, query: dict[str, str], headers: dict[str, str], body: bytes) -> _Reply:
        try:
            reply = self._handle(method, path, query, headers, body)
        except Exception:
            log.exception("%s failed on %s %s", type(self).__name__, method, path)
            reply = _Reply.text(500, "internal error")
        with self._cond:
            self._requests.append(RecordedRequest(method, path, query, headers, body, reply.status, time.time()))
            self._counts[(method, path, reply.status)] += 1
        return reply

    @abc.abstractmethod
    def _handle(self, method: str, path: str, query: dict[str, str], headers: dict[str, str], body: bytes) -> _Reply:
        """Called on a server thread; take ``self._cond`` to read or change state."""

    def _changed(self) -> None:
        """Call with ``self._cond`` held after changing state."""
        self._cond.notify_all()


def _unix(when: float | datetime) -> float:
    return when.timestamp() if isinstance(when, datetime) else float(when)


# -- AWS -------------------------------------------------------------------------------------------


class ImdsEmulator(MetadataEmulator):
    """AWS EC2 instance metadata: IMDSv2, and IMDSv1 too where ``http_tokens="optional"``."""

    TOKEN_PATH = "/latest/api/token"
    INSTANCE_ACTION_PATH = "/latest/meta-data/spot/instance-action"
    REBALANCE_PATH = "/latest/meta-data/events/recommendations/rebalance"
    MAX_TTL = 21600

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        instance_id: str = "i-0spotjob0emulator0",
        put_hop_limit_exceeded: bool = False,
        http_tokens: str = "required",
        http_endpoint: str = "enabled",
        history: int | None = None,
    ) -> None:
        if http_tokens not in ("required", "optional"):
            raise ValueError(f"http_tokens={http_tokens!r}: expected 'required' or 'optional'")
        if http_endpoint not in ("enabled", "disabled"):
            raise ValueError(f"http_endpoint={http_endpoint!r}: expected 'enabled' or 'disabled'")
        self.http_endpoint = http_endpoint
        super().__init__(host, port, history=history)
        self.instance_id = instance_id
        self.put_hop_limit_exceeded = put_hop_limit_exceeded
        self.http_tokens = http_tokens
        self._tokens: dict[str, float] = {}
        self._instance_action: dict[str, str] | None = None
        self._rebalance: dict[str, str] | None = None

    @staticmethod
    def format_time(when: float | datetime | str) -> str:
        if isinstance(when, str):
            return when
        return datetime.fromtimestamp(_unix(when), UTC).strftime("%Y-%m-%dT%H:%M:%SZ")

    def set_spot_action(self, action: str = "terminate", time: float | datetime | str | None = None) -> str:
        """Schedule a spot interruption (``time`` defaults to now + 2 minutes); returns the body served."""
        when = self.format_time(_now() + 120 if time is None else time)
        with self._cond:
            self._instance_action = {"action": action, "time": when}
            self._changed()
            return json.dumps(self._instance_action)

    def set_rebalance(self, notice_time: float | datetime | str | None = None) -> str:
        """Issue a rebalance recommendation (``noticeTime`` defaults to now); returns the body served."""
        when = self.format_time(_now() if notice_time is None else notice_time)
        with self._cond:
            self._rebalance = {"noticeTime": when}
            self._changed()
            return json.dumps(self._rebalance)

    def clear(self) -> None:
        """No interruption, no rebalance recommendation."""
        with self._cond:
            self._instance_action = None
            self._rebalance = None
            self._changed()

    def expire_tokens(self) -> None:
        """Every token issued so far is now invalid (as after an IMDS restart): GETs answer 401."""
        with self._cond:
            self._tokens.clear()

    @property
    def token_requests(self) -> int:
        return self.count("PUT", self.TOKEN_PATH, status=200)

    def _handle(self, method: str, path: str, query: dict[str, str], headers: dict[str, str], body: bytes) -> _Reply:
        if self.http_endpoint == "disabled":
            return _Reply.text(403, "Forbidden")
        if path == self.TOKEN_PATH:
            return self._issue_token(method, headers)
        if not path.startswith("/latest/"):
            return _Reply.text(404, "Not Found")
        if method != "GET":
            return _Reply.text(405, "Method Not Allowed")
        with self._cond:
            presented = headers.get("x-aws-ec2-metadata-token")
            expiry = self._tokens.get(presented or "")
            v1_read = presented is None and self.http_tokens == "optional"
            if not v1_read and (expiry is None or expiry < time.monotonic()):
                return _Reply.text(401, "Unauthorized")
            if path == self.INSTANCE_ACTION_PATH:
                document = self._instance_action
            elif path == self.REBALANCE_PATH:
                document = self._rebalance
            elif path == "/latest/meta-data/instance-id":
                return _Reply.text(200, self.instance_id)
            elif path.rstrip("/") == "/latest/meta-data":
                return _Reply.text(200, "instance-id\nspot/\nevents/\n")
            else:
                document = None
        if document is None:
            return _Reply.text(404, "Not Found")
        return _Reply.json(200, document)

    def _issue_token(self, method: str, headers: dict[str, str]) -> _Reply:
        if method != "PUT":
            return _Reply.text(405, "Method Not Allowed")
        if "x-forwarded-for" in headers:
            return _Reply.text(403, "Forbidden")
        if self.put_hop_limit_exceeded:
            # The answer's IP TTL runs out on the way into the container: the client hears nothing.
            with self._cond:
                self._cond.wait_for(lambda: self._closing)
            return _Reply.text(200, "")
        try:
            ttl = int(headers["x-aws-ec2-metadata-token-ttl-seconds"])
        except (KeyError, ValueError):
            return _Reply.text(400, "Bad Request")
        if not 1 <= ttl <= self.MAX_TTL:
            return _Reply.text(400, "Bad Request")
        token = secrets.token_urlsafe(32)
        with self._cond:
            self._tokens[token] = time.monotonic() + ttl
        return _Reply.text(200, token, **{"X-aws-ec2-metadata-token-ttl-seconds": str(ttl)})


# -- GCP -------------------------------------------------------------------------------------------


class GceMetadataEmulator(MetadataEmulator):
    """The GCE metadata server's ``/computeMetadata/v1/`` with ``wait_for_change`` long polls."""

    PREFIX = "/computeMetadata/v1/"
    MAX_WAIT_SECONDS = 300
    GKE_INSTANCE_KEYS = (
        "instance/attributes/",
        "instance/hostname",
        "instance/id",
        "instance/service-accounts/",
        "instance/zone",
    )
    """What GKE's metadata server serves a Workload Identity pod under ``instance/`` (prefixes)."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        instance_name: str = "spotjob-vm-0",
        gke_metadata_server: bool = False,
        history: int | None = None,
    ) -> None:
        super().__init__(host, port, history=history)
        self.gke_metadata_server = gke_metadata_server
        self._values: dict[str, str] = {
            "instance/preempted": "FALSE",
            "instance/maintenance-event": "NONE",
            "instance/name": instance_name,
            "instance/hostname": f"{instance_name}.c.spotjob-project.internal",
            "instance/id": "1234567890123456789",
            "instance/zone": "projects/123456789012/zones/us-central1-a",
            "instance/attributes/cluster-name": "spotjob",
            "instance/service-accounts/default/email": "spotjob@spotjob-project.iam.gserviceaccount.com",
            "instance/scheduling/preemptible": "TRUE",
            "project/project-id": "spotjob-project",
        }
        self._waiting = 0
        self._held: collections.Counter[tuple[str, str]] = collections.Counter()
        """Long polls held, by (key, the ETag each waits to change from)."""

    def set_preempted(self, preempted: bool = True) -> None:
        self.set_value("instance/preempted", "TRUE" if preempted else "FALSE")

    def set_maintenance_event(self, value: str = "TERMINATE_ON_HOST_MAINTENANCE") -> None:
        """``NONE`` | ``MIGRATE_ON_HOST_MAINTENANCE`` | ``TERMINATE_ON_HOST_MAINTENANCE``."""
        self.set_value("instance/maintenance-event", value)

    def set_value(self, key: str, value: str) -> None:
        with self._cond:
            self._values[key] = value
            self._changed()

    def clear(self) -> None:
        """Not preempted, no maintenance event."""
        with self._cond:
            self._values["instance/preempted"] = "FALSE"
            self._values["instance/maintenance-event"] = "NONE"
            self._changed()

    @property
    def waiting(self) -> int:
        """How many ``wait_for_change`` requests are being held right now."""
        with self._cond:
            return self._waiting

    def wait_for_waiters(self, n: int = 1, timeout: float = 10.0) -> bool:
        """Block until at least ``n`` long polls are held (tests: the client is really waiting)."""
        with self._cond:
            return self._cond.wait_for(lambda: self._waiting >= n, timeout)

    def wait_for_waiter_on(self, key: str, value: str, timeout: float = 10.0) -> bool:
        """Block until a long poll of ``key`` is held that waits for it to change from ``value``
        (tests: a client has read that value and waits on it; a stopped client's polls on an
        earlier value do not count)."""
        since = self.etag(value)
        with self._cond:
            return self._cond.wait_for(lambda: self._held[(key, since)] > 0, timeout)

    @staticmethod
    def etag(value: str) -> str:
        # Content-derived, as GCE's are: the same value has the same ETag.
        return hashlib.sha256(value.encode()).hexdigest()[:16]

    def _handle(self, method: str, path: str, query: dict[str, str], headers: dict[str, str], body: bytes) -> _Reply:
        flavor = {"Metadata-Flavor": "Google"}
        if not path.startswith(self.PREFIX):
            return _Reply.text(404, "Not Found", **flavor)
        if headers.get("metadata-flavor") != "Google" or "x-forwarded-for" in headers:
            return _Reply.text(403, "Missing Metadata-Flavor:Google header.", **flavor)
        if method != "GET":
            return _Reply.text(405, "Method Not Allowed", **flavor)
        key = path[len(self.PREFIX) :]
        with self._cond:
            values = {k: v for k, v in self._values.items() if self._served(k)}
            if key == "" or key.endswith("/"):
                children = sorted({_first_segment(k[len(key) :]) for k in values if k.startswith(key)})
                if not children:
                    return _Reply.text(404, "Not Found", **flavor)
                return _Reply.text(200, "\n".join(children) + "\n", **flavor)
            if key not in values:
                return _Reply.text(404, "Not Found", **flavor)
            if query.get("wait_for_change", "").lower() == "true":
                self._wait_for_change(key, query)
            value = self._values[key]
        return _Reply.text(200, value, ETag=self.etag(value), **flavor)

    def _served(self, key: str) -> bool:
        """Whether this server serves ``key`` at all (GKE's serves a pod a subset of ``instance/``)."""
        if not self.gke_metadata_server or not key.startswith("instance/"):
            return True
        return any(key == k or (k.endswith("/") and key.startswith(k)) for k in self.GKE_INSTANCE_KEYS)

    def _wait_for_change(self, key: str, query: dict[str, str]) -> None:
        """With ``self._cond`` held: return once the value's ETag differs from the caller's."""
        try:
            timeout = min(float(query.get("timeout_sec", self.MAX_WAIT_SECONDS)), self.MAX_WAIT_SECONDS)
        except ValueError:
            timeout = self.MAX_WAIT_SECONDS
        since = query.get("last_etag") or self.etag(self._values[key])
        self._waiting += 1
        self._held[(key, since)] += 1
        self._cond.notify_all()
        try:
            self._cond.wait_for(lambda: self._closing or self.etag(self._values[key]) != since, timeout)
        finally:
            self._waiting -= 1
            self._held[(key, since)] -= 1


# -- Azure -----------------------------------------------------------------------------------------


class AzureScheduledEventsEmulator(MetadataEmulator):
    """Azure IMDS Scheduled Events (``/metadata/scheduledevents``) and the instance name."""

    EVENTS_PATH = "/metadata/scheduledevents"

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        vm_name: str = "spotjob-vm-0",
        first_call_delay: float = 0.0,
        history: int | None = None,
    ) -> None:
        super().__init__(host, port, history=history)
        self.vm_name = vm_name
        self.first_call_delay = first_call_delay
        self._started_at: float | None = None
        """When the first scheduled events request arrived (monotonic): the service starts then."""
        self._incarnation = 1
        self._events: list[dict[str, Any]] = []
        self._start_requests: list[str] = []

    def add_event(
        self,
        EventType: str = "Preempt",
        NotBefore: float | datetime | str | None = None,
        *,
        Resources: list[str] | None = None,
        EventId: str | None = None,
        EventStatus: str = "Scheduled",
        Description: str = "",
        EventSource: str = "Platform",
        DurationInSeconds: int = -1,
    ) -> str:
        """Publish an event (``NotBefore`` defaults to now + 30 s, ``Resources`` to this VM); returns its EventId."""
        if NotBefore is None:
            NotBefore = _now() + 30
        not_before = NotBefore if isinstance(NotBefore, str) else email.utils.formatdate(_unix(NotBefore), usegmt=True)
        event_id = EventId or str(uuid.uuid4()).upper()
        event = {
            "EventId": event_id,
            "EventType": EventType,
            "ResourceType": "VirtualMachine",
            "Resources": [self.vm_name] if Resources is None else list(Resources),
            "EventStatus": EventStatus,
            "NotBefore": not_before,
            "Description": Description or f"{EventType} scheduled by the spotjob emulator",
            "EventSource": EventSource,
            "DurationInSeconds": DurationInSeconds,
        }
        with self._cond:
            self._events.append(event)
            self._incarnation += 1
            self._changed()
        return event_id

    def move_event(self, event_id: str, NotBefore: float | datetime | str) -> None:
        """Reschedule an event (a new ``NotBefore``), as the platform may."""
        not_before = NotBefore if isinstance(NotBefore, str) else email.utils.formatdate(_unix(NotBefore), usegmt=True)
        with self._cond:
            for event in self._events:
                if event["EventId"] == event_id:
                    event["NotBefore"] = not_before
            self._incarnation += 1
            self._changed()

    def clear(self) -> None:
        """No events (as after they completed)."""
        with self._cond:
            self._events.clear()
            self._incarnation += 1
            self._changed()

    @property
    def document(self) -> dict[str, Any]:
        with self._cond:
            return {"DocumentIncarnation": self._incarnation, "Events": [dict(e) for e in self._events]}

    @property
    def start_requests(self) -> list[str]:
        """EventIds acknowledged through ``StartRequests``, in the order received."""
        with self._cond:
            return list(self._start_requests)

    def wait_for_start_request(self, event_id: str, timeout: float = 10.0) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: event_id in self._start_requests, timeout)

    def _handle(self, method: str, path: str, query: dict[str, str], headers: dict[str, str], body: bytes) -> _Reply:
        if not path.startswith("/metadata/"):
            return _Reply.json(404, {"error": "Not found"})
        if headers.get("metadata", "").lower() != "true":
            return _Reply.json(400, {"error": "Bad request. Required metadata header not specified"})
        if not query.get("api-version"):
            return _Reply.json(400, {"error": "Bad request. api-version was not specified in the request."})
        if path == self.EVENTS_PATH:
            self._wait_until_enabled()
            if method == "GET":
                return _Reply.json(200, self.document)
            if method == "POST":
                return self._start(body)
            return _Reply.json(405, {"error": "Method not allowed"})
        if method != "GET":
            return _Reply.json(405, {"error": "Method not allowed"})
        compute = {"name": self.vm_name, "priority": "Spot", "vmId": "00000000-0000-0000-0000-000000000000"}
        if path == "/metadata/instance":
            return _Reply.json(200, {"compute": compute, "network": {"interface": []}})
        if path == "/metadata/instance/compute/name" and query.get("format") == "text":
            return _Reply.text(200, self.vm_name)
        return _Reply.json(404, {"error": "Not found"})

    def _wait_until_enabled(self) -> None:
        """Hold a scheduled events request until the service has started on this VM."""
        with self._cond:
            if self._started_at is None:
                self._started_at = time.monotonic()
            up_at = self._started_at + self.first_call_delay
            self._cond.wait_for(lambda: self._closing or time.monotonic() >= up_at, max(0.0, up_at - time.monotonic()))

    def _start(self, body: bytes) -> _Reply:
        try:
            ids = [str(r["EventId"]) for r in json.loads(body)["StartRequests"]]
        except (ValueError, KeyError, TypeError):
            return _Reply.json(400, {"error": 'Bad request. Body must be {"StartRequests": [{"EventId": ...}]}'})
        with self._cond:
            self._start_requests.extend(ids)
            for event in self._events:
                if event["EventId"] in ids:
                    event["EventStatus"] = "Started"
                    event["NotBefore"] = ""
            self._incarnation += 1
            self._changed()
        return _Reply(200)


def _first_segment(rest: str) -> str:
    """``scheduling/preemptible`` → ``scheduling/`` (a folder, as GCE lists it); ``name`` → ``name``."""
    head, sep, _ = rest.partition("/")
    return head + sep


def _now() -> float:
    return time.time()
