"""One normalised ``Notice`` for every way a node can be told it is going away. No torch import.

Each cloud says "this machine will be taken" differently (AWS IMDSv2 instance-action, the GCE
metadata server's ``preempted``, Azure Scheduled Events, a SIGTERM from the kubelet). A
``NoticeSource`` turns its cloud's message into a ``Notice`` and hands it to one callback; what a
notice *does* (write ``flush.json`` once, ask for an early save, ignore it) is the agent's
decision, not the source's.

Threads: every source runs its own thread(s) that poll or long-poll; ``start`` returns at once,
``stop`` returns once the threads have ended (or after a bounded wait — they are daemon threads,
so a stuck one never keeps the process alive). The callback is called from a source's thread,
so it must be thread-safe; it is called once per distinct cloud event, never again for the same
one once a call returned. An event is marked as heard only *after* its callback returned: a
callback that raises is logged and called again with the same event at the next poll, with the
same deadline (one counted from when the event was seen is not counted again). A message
that cannot be reached or parsed is logged and polling goes on: a metadata endpoint that is
briefly down must not stop the agent from hearing the next notice.
"""

from __future__ import annotations

import abc
import enum
import http.client
import logging
import re
import socket
import threading
import time
import urllib.parse
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

log = logging.getLogger(__name__)


class NoticeKind(enum.StrEnum):
    PREEMPTION = "preemption"
    """Spot/preemptible capacity is being reclaimed (AWS instance-action, GCE preempted, Azure Preempt)."""
    REBALANCE = "rebalance"
    """A soft signal: the capacity is at elevated risk, nothing is scheduled yet (AWS rebalance)."""
    MAINTENANCE = "maintenance"
    """Host maintenance that stops this VM (GCE TERMINATE_ON_HOST_MAINTENANCE, Azure Reboot/Redeploy)."""
    TERMINATE = "terminate"
    """The process or VM is being shut down for another reason (SIGTERM, Azure Terminate)."""


@dataclass(frozen=True)
class Notice:
    """One cloud event, normalised. ``deadline`` is the unix time the node goes away, if known."""

    source: str
    """Who told us: ``aws`` | ``gcp`` | ``azure`` | ``signal`` | ``api``."""
    kind: NoticeKind
    deadline: float | None
    detail: str
    """Human-readable: what the cloud said, for logs and ``/status``."""
    event_id: str | None = None
    """The cloud's id of the event, where it has one (Azure EventId): what gets acknowledged."""
    received_at: float = field(default_factory=time.time)
    received_monotonic: float = field(default_factory=time.monotonic)
    withdrawn: bool = False
    """The cloud withdrew the event this source announced earlier with this kind (GCE's
    maintenance-event back to NONE): a notice the agent holds is dropped; a flush under way goes on."""
    deadline_assumed: bool = False
    """The cloud did not say when (an Azure event ``Started``, its ``NotBefore`` empty; a GCE
    maintenance-event already set when the agent started, with no record of when): ``deadline`` is
    the source's guess. The node may go sooner, so such a notice is never held (``--flush-lead``):
    it flushes at once, and the guess only bounds the flush."""


NoticeCallback = Callable[[Notice], None]


class NoticeSource(abc.ABC):
    """Where notices come from.

    Call order (the agent): ``start(callback)`` once, then any number of ``flush_finished()``,
    then ``stop()`` once. ``stop`` is idempotent and safe to call without ``start``.
    """

    name: str

    @abc.abstractmethod
    def start(self, callback: NoticeCallback) -> None:
        """Begin listening; return at once. ``callback`` is called from the source's thread."""

    @abc.abstractmethod
    def stop(self) -> None:
        """Stop listening and end the source's threads (bounded wait)."""

    def flush_finished(self) -> None:  # noqa: B027 - an optional hook, a no-op for most sources
        """The flush this source's notice started has ended (committed or failed).

        Sources whose cloud wants an acknowledgement (Azure ``StartRequests``) send it now, so the
        platform does not proceed before the checkpoint is safe — and proceeds early once it is.
        """


class SourceError(Exception):
    """A metadata endpoint answered something this source cannot use (logged, polling goes on)."""


# -- HTTP ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class HttpResponse:
    status: int
    headers: Mapping[str, str]
    """Lower-cased header names."""
    body: bytes

    def text(self) -> str:
        return self.body.decode("utf-8", errors="replace")


_HOST = re.compile(r"[A-Za-z0-9._-]+|[0-9A-Fa-f:.]+(%[A-Za-z0-9._-]+)?")
"""A host name, an IPv4 address, or an IPv6 literal (``urlsplit`` takes its brackets off; a zone
after ``%``)."""


def metadata_url_problem(base_url: str) -> str | None:
    """Why ``base_url`` cannot be a metadata endpoint's base URL (``http(s)://host[:port][/prefix]``),
    or None. The one check: the agent's start-up (which names the option) and ``HttpClient``."""
    try:
        parts = urllib.parse.urlsplit(base_url)
        port = parts.port
    except ValueError as e:  # a port that is no number or past 65535, a broken [IPv6] literal
        return f"not a URL with a usable host and port ({e})"
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return "it does not start with http:// or https:// and a host"
    # http.client refuses these at every request (a traceback per poll, the cloud's notices never
    # seen), and a host with a tab failed its name lookup at every poll instead.
    odd = sorted({c for c in base_url if c.isspace() or not c.isprintable()})
    if odd:
        return f"it holds {', '.join(repr(c) for c in odd)}: a URL holds no spaces or control characters"
    if not _HOST.fullmatch(parts.hostname):
        return f"{parts.hostname!r} is no host name or IP address"
    if port == 0:
        return "port 0 is no port to connect to"
    if parts.query or parts.fragment:
        return "a base URL takes no ?query or #fragment"
    return None


class HttpClient:
    """Blocking HTTP/1.1 to one metadata base URL, one request at a time per client.

    Metadata servers are plain HTTP on a link-local address, so ``http.client`` is enough and
    keeps the agent free of client libraries. ``abort`` lets another thread end a long poll
    (GCE ``wait_for_change``) at once instead of waiting for its server-side timeout.
    """

    def __init__(self, base_url: str) -> None:
        problem = metadata_url_problem(base_url)
        if problem is not None:
            raise ValueError(f"metadata URL {base_url!r}: {problem}")
        parts = urllib.parse.urlsplit(base_url)
        assert parts.hostname is not None  # metadata_url_problem said so
        self.base_url = base_url.rstrip("/")
        self._https = parts.scheme == "https"
        self._host = parts.hostname
        # Always a number: given None, http.client reads a port off the host's last colon, which
        # turns an IPv6 literal (AWS's http://[fd00:ec2::254]) into host "fd00:ec2:", port 254.
        self._port = parts.port if parts.port is not None else (443 if self._https else 80)
        self._prefix = parts.path.rstrip("/")
        self._lock = threading.Lock()
        self._conn: http.client.HTTPConnection | None = None
        self._aborted = False

    def url(self, path: str) -> str:
        return self.base_url + path

    def request(
        self,
        method: str,
        path: str,
        *,
        headers: Mapping[str, str] | None = None,
        body: bytes | None = None,
        timeout: float = 2.0,
        connect_timeout: float | None = None,
    ) -> HttpResponse:
        """One exchange. Transport failures raise ``OSError`` (incl. timeouts and aborts).

        ``connect_timeout`` (default ``timeout``) bounds the TCP connect alone: a server known to
        answer slowly gets a long ``timeout`` without an unreachable one holding on as long."""
        conn_type = http.client.HTTPSConnection if self._https else http.client.HTTPConnection
        conn = conn_type(self._host, self._port, timeout=timeout if connect_timeout is None else connect_timeout)
        with self._lock:
            if self._aborted:
                raise ConnectionAbortedError("client stopped")
            self._conn = conn
        try:
            conn.connect()
            with self._lock:
                # An abort() that came while connecting found no socket to shut down.
                if self._aborted:
                    raise ConnectionAbortedError("client stopped")
            if connect_timeout is not None and conn.sock is not None:
                conn.sock.settimeout(timeout)
            conn.request(method, self._prefix + path, body=body, headers=dict(headers or {}))
            resp = conn.getresponse()
            data = resp.read()
            return HttpResponse(resp.status, {k.lower(): v for k, v in resp.getheaders()}, data)
        except http.client.HTTPException as e:
            raise ConnectionError(f"{method} {self.url(path)}: {e!r}") from e
        finally:
            with self._lock:
                self._conn = None
            conn.close()

    def abort(self) -> None:
        """End the request in flight (if any) and refuse new ones."""
        with self._lock:
            self._aborted = True
            conn = self._conn
        if conn is not None and conn.sock is not None:
            try:
                conn.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


# -- a polling thread --------------------------------------------------------------------------


class _Health:
    """Logs an unreachable endpoint once (then at debug) and its recovery once."""

    def __init__(self, what: str) -> None:
        self._what = what
        self._failing = False

    def failed(self, error: BaseException) -> None:
        if not self._failing:
            log.warning("%s: %s (will keep trying)", self._what, error)
            self._failing = True
        else:
            log.debug("%s still failing: %s", self._what, error)

    def ok(self) -> None:
        if self._failing:
            log.info("%s: reachable again", self._what)
            self._failing = False


class PollingNoticeSource(NoticeSource):
    """A source with one thread that calls ``_poll`` every ``interval`` seconds.

    Subclasses implement ``_poll`` (raise on failure; call ``_emit`` for each notice) and may
    override ``_on_stopping`` for a last action on the thread (Azure's pending acknowledgement).
    ``_emit`` drops a notice whose ``key`` was emitted before, so a notice that stays visible in
    the metadata (AWS keeps instance-action until the end) reaches the agent once.
    """

    abort_on_stop = True
    """Whether ``stop`` cuts a request in flight (long polls) or lets it finish (acks)."""

    def __init__(self, client: HttpClient, interval: float) -> None:
        self.client = client
        self.interval = interval
        self._stop_event = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._callback: NoticeCallback | None = None
        self._seen: set[str] = set()
        self._first_seen: dict[str, float] = {}
        """When each event not yet delivered was first seen (unix time), by ``_emit``'s key."""
        self._health = _Health(f"{self.name} notices from {client.base_url}")

    def start(self, callback: NoticeCallback) -> None:
        if self._thread is not None:
            raise RuntimeError(f"{self.name} notice source already started")
        self._callback = callback
        self._thread = threading.Thread(target=self._run, name=f"spotjob-notice-{self.name}", daemon=True)
        self._thread.start()
        log.info("listening for %s notices at %s (%s)", self.name, self.client.base_url, self._how())

    def stop(self) -> None:
        self._stop_event.set()
        self._wake.set()
        if self.abort_on_stop:
            self.client.abort()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
            if self._thread.is_alive():
                log.warning("%s notice thread did not stop in time (daemon; left behind)", self.name)

    @property
    def stopping(self) -> bool:
        return self._stop_event.is_set()

    def _run(self) -> None:
        while not self._stop_event.is_set():
            pause = self.interval
            try:
                self._poll()
            except (OSError, SourceError, ValueError) as e:
                if self._stop_event.is_set():
                    break
                self._health.failed(e)
            except Exception:  # a bug here must not silence notices for the rest of the job
                log.exception("%s notice source: unexpected error (polling goes on)", self.name)
            else:
                self._health.ok()
                pause = self._pause()
            if pause > 0:
                self._wake.wait(pause)
                self._wake.clear()
        try:
            self._on_stopping()
        except Exception:
            log.exception("%s notice source: error while stopping", self.name)

    @abc.abstractmethod
    def _poll(self) -> None: ...

    def _how(self) -> str:
        return f"every {self.interval:g} s"

    def _pause(self) -> float:
        """Seconds to wait after a successful poll (a long poll returns 0: it did the waiting)."""
        return self.interval

    def _on_stopping(self) -> None:
        """Runs on the source's thread after the last poll."""

    def _emit(self, key: str, notice: Notice) -> bool:
        """Hand ``notice`` to the callback unless ``key`` was delivered already; True if delivered now.

        ``key`` is marked as seen only once the callback returned, so a failed delivery is tried
        again when the next poll finds the event still there.
        """
        if key in self._seen:
            return False
        if not deliver_notice(self.name, self._callback, notice):
            return False
        self._seen.add(key)
        self._first_seen.pop(key, None)
        return True

    def _withdraw(self, notice: Notice) -> bool:
        """Tell the callback that the cloud withdrew an event delivered before (``notice.withdrawn``);
        False if the callback raised (logged, never raised)."""
        if self._callback is None:
            return True
        try:
            self._callback(notice)
        except Exception:
            log.exception("%s: the agent failed to take the withdrawal of %s", self.name, notice.detail)
            return False
        return True

    def _seen_since(self, key: str) -> float:
        """When the event ``key`` was first seen: a deadline counted from then (GCE's 30 s, a
        default where the cloud gave no time) stays put while a failed delivery is retried."""
        return self._first_seen.setdefault(key, time.time())

    def _forget(self, key_prefix: str) -> None:
        """The cloud withdrew an event: a new one with the same key counts again."""
        self._seen = {k for k in self._seen if not k.startswith(key_prefix)}
        self._first_seen = {k: t for k, t in self._first_seen.items() if not k.startswith(key_prefix)}


def deliver_notice(source: str, callback: NoticeCallback | None, notice: Notice) -> bool:
    """Log ``notice`` and call ``callback``; False if the callback raised (logged, never raised)."""
    log.info(
        "notice from %s: %s, deadline %s%s (%s)",
        source,
        notice.kind.value,
        format_deadline(notice.deadline),
        ", assumed" if notice.deadline_assumed and notice.deadline is not None else "",
        notice.detail,
    )
    if callback is None:
        return True
    try:
        callback(notice)
    except Exception:
        log.exception("handling a %s notice failed; it will be delivered again", source)
        return False
    return True


def format_deadline(deadline: float | None, now: float | None = None) -> str:
    if deadline is None:
        return "none"
    left = deadline - (time.time() if now is None else now)
    return f"{utc_stamp(deadline)} (in {left:.1f} s)"


def utc_stamp(when: float) -> str:
    """A unix time as people read it in the log: ``2026-12-04T03:25:00Z``."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(when))
