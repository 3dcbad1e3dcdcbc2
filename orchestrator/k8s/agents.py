"""Talking to a job's agents: their bearer token, and their control API, off the reconcile path.

**The token** of a job's agents is derived, never stored where the controller must read it back:
``HMAC-SHA256(key, namespace, name, uid)``, with ``key`` the controller's agent-token key (a file
the chart mounts from a Secret of its own; ``--agent-token-key-file``). The controller writes it
once into the job's Secret (create-only: a second create finds the same bytes), the agents read
it from the mounted file, and any leader recomputes it — so the controller needs no permission to
read Secrets, and a new leader reaches the agents the old one started. A job created again under
the same name has a new uid, hence a new token.

**Calls** (``POST /flush``, ``POST /save``, ``POST /stop``, ``GET /status``) run in background
threads, never in a reconcile pass: the first ``flush()`` for a pod starts the request and answers PENDING; later
calls answer how it went (ACCEPTED, or FAILED with why), and after a FAILED the next call tries
again. Every request has a timeout (``timeout`` seconds to connect and to read), and the pools are
bounded. Flushes, stops and saves have their own pool, so that step polling never delays them, and
it is wide (``MAX_FLUSH_CALLS`` threads, started only as requests need them): the agents of nodes
that are gone answer nothing, and each request to one holds its thread for the whole timeout. A
narrow pool queued the live agents' flushes behind them: eight dead workers held a reachable one
back by a timeout each, more than a 30 s notice leaves. Only past ``MAX_FLUSH_CALLS`` at once do
requests queue.

``report()`` answers the last step an agent reported (``GET /status``, at most every
``status_max_age`` seconds per pod, in the background): a hint for the reconciler's accounting,
never a decision; and, from the same answer, the cloud notice the agent holds (``held_notice``,
``flush_at``: a deadline further away than its ``--flush-lead``), for the job's status; and the
step its node's ranks restored, with why they passed over a newer checkpoint (``restored_step``,
``restore_passed_over``: the reconciler's CheckpointUnusable for a damaged byte). An agent that does
not send those fields (older than them) holds none and says nothing restored as far as the
controller can tell; values not of their shape are ignored the same way, with a log line.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import http.client
import json
import logging
import secrets
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime
from enum import StrEnum
from typing import Any

from orchestrator.backends.base import HeldNoticeReport, held_notice, ranks_not_meeting, ranks_state, restored

log = logging.getLogger(__name__)

KEY_MIN_BYTES = 32
MAX_FLUSH_CALLS = 512
"""Flush, stop and save requests in flight at once (threads, each mostly waiting on the network)."""


class TokenKeyError(ValueError):
    """The agent-token key file is missing, unreadable or too short."""


def load_token_key(path: str | None) -> bytes:
    """The controller's agent-token key from ``path``; a fresh random key (this process only) if None.

    Without a key file, tokens change when the controller restarts: agents started by an earlier
    controller refuse the new one's flush requests (they still flush on their own notices).
    """
    if path is None:
        log.warning(
            "no --agent-token-key-file: agent tokens are derived from a random key that dies with this process; "
            "after a restart or a leader change the controller cannot ask running agents to flush"
        )
        return secrets.token_bytes(KEY_MIN_BYTES)
    try:
        with open(path, "rb") as f:
            key = f.read().strip()
    except OSError as e:
        raise TokenKeyError(f"cannot read the agent-token key {path}: {e}") from e
    if len(key) < KEY_MIN_BYTES:
        raise TokenKeyError(f"the agent-token key in {path} has {len(key)} bytes; it needs at least {KEY_MIN_BYTES}")
    return key


def derive_token(key: bytes, namespace: str, name: str, uid: str) -> str:
    """The bearer token of one job's agents (URL-safe text, 43 characters)."""
    message = b"spotjob agent token v1\0" + f"{namespace}\0{name}\0{uid}".encode()
    digest = hmac.new(key, message, hashlib.sha256).digest()
    return base64.urlsafe_b64encode(digest).rstrip(b"=").decode()


class CallState(StrEnum):
    PENDING = "pending"
    ACCEPTED = "accepted"
    FAILED = "failed"


@dataclass(frozen=True)
class CallResult:
    state: CallState
    detail: str = ""


@dataclass(frozen=True)
class Endpoint:
    """One agent: its pod's uid (the key calls are remembered by), IP and token."""

    pod_uid: str
    pod: str
    ip: str
    token: str = field(repr=False)

    def __repr__(self) -> str:
        # The dataclass's own repr printed the token: one endpoint in a log line, a traceback's
        # locals or a debugger's view, and anyone reading it could flush or stop the job's agents.
        return f"Endpoint(pod_uid={self.pod_uid!r}, pod={self.pod!r}, ip={self.ip!r}, token=<redacted>)"


@dataclass(frozen=True)
class AgentReport:
    """What an agent's last ``GET /status`` said that the controller keeps."""

    step: int | None = None
    held_notice: HeldNoticeReport | None = None
    ranks_not_meeting: str | None = None
    """The agent's warning that no rank has connected past its ``--rank-connect-timeout`` (its ranks
    wait in init_process_group, or build no Checkpointer); None when it gives none."""
    ranks_state: str | None = None
    """Its ``rank_state``: what its node's ranks do (training, flushing, flushed, ...)."""
    restored: tuple[int, str | None] | None = None
    """Its ``restored_step`` and ``restore_passed_over``: the step its node's ranks restored, and
    why they passed over a newer checkpoint (``orchestrator.backends.base.restored``)."""


@dataclass
class _Status:
    report: AgentReport = AgentReport()
    fetched_at: float = float("-inf")
    future: Future[None] | None = None
    malformed_restored: bool = False
    """A log line said that the agent's ``restored_step``/``restore_passed_over`` were not of their shape."""


Transport = Callable[[str, int, str, str, bytes | None, str, float], tuple[int, bytes]]
"""``(ip, port, method, path, body, token, timeout) -> (status, body)``; raises ``OSError`` on network errors."""


class ConnectTimeout(TimeoutError):
    """No answer to the connection itself: the packets were dropped on the way (a NetworkPolicy, a
    firewall), or the node is gone. An agent that is there but not listening refuses at once."""


def http_transport(
    ip: str, port: int, method: str, path: str, body: bytes | None, token: str, timeout: float
) -> tuple[int, bytes]:
    host = f"[{ip}]" if ":" in ip and not ip.startswith("[") else ip
    connection = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        try:
            connection.connect()
        except TimeoutError as e:
            raise ConnectTimeout(f"no answer to the connection within {timeout:g}s") from e
        headers = {"Authorization": f"Bearer {token}", "Connection": "close"}
        if body is not None:
            headers["Content-Type"] = "application/json"
        connection.request(method, path, body=body, headers=headers)
        response = connection.getresponse()
        return response.status, response.read(64 * 1024)
    finally:
        connection.close()


class AgentCalls:
    """The controller's side of the agents' control API. Thread-safe; see the module docstring."""

    def __init__(
        self,
        *,
        port: int,
        timeout: float = 5.0,
        workers: int = MAX_FLUSH_CALLS,
        status_workers: int = 2,
        status_max_age: float = 5.0,
        transport: Transport = http_transport,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.port = port
        self._timeout = timeout
        self._transport = transport
        self._clock = clock
        self._status_max_age = status_max_age
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="agent-call")
        self._status_pool = ThreadPoolExecutor(max_workers=status_workers, thread_name_prefix="agent-status")
        self._lock = threading.Lock()
        self._calls: dict[tuple[str, str, str], Future[CallResult]] = {}
        """(what, pod uid, request tag) -> the call in flight or answered."""
        self._status: dict[str, _Status] = {}

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._status_pool.shutdown(wait=False, cancel_futures=True)

    # -- flush and stop

    # ``answered``, when given, is called (on the call's thread) once a request this call started
    # has its answer: the reconcile that got PENDING looks again then, not at its next poll.

    def flush(
        self, agent: Endpoint, reason: str, deadline: datetime | None, *, answered: Callable[[], None] | None = None
    ) -> CallResult:
        body = {"reason": reason[:1000] or "flush", "deadline": deadline.timestamp() if deadline else None}
        return self._call("flush", agent, body, answered=answered)

    def stop(self, agent: Endpoint, reason: str, *, answered: Callable[[], None] | None = None) -> CallResult:
        return self._call("stop", agent, {"reason": reason[:1000] or "stop"}, answered=answered)

    def save(
        self, agent: Endpoint, request_id: str, reason: str, *, answered: Callable[[], None] | None = None
    ) -> CallResult:
        """``POST /save``: a checkpoint now, training goes on; one call per (pod, request id)."""
        body = {"id": request_id, "reason": reason[:1000] or "save"}
        return self._call("save", agent, body, tag=request_id, answered=answered)

    def state(self, what: str, pod_uid: str, tag: str = "") -> CallResult | None:
        """How the last ``what`` ("flush", "stop"; "save" with its request id as ``tag``) request to
        that pod went, without starting one."""
        with self._lock:
            future = self._calls.get((what, pod_uid, tag))
        if future is None:
            return None
        return future.result() if future.done() else CallResult(CallState.PENDING)

    def _call(
        self,
        what: str,
        agent: Endpoint,
        body: dict[str, Any],
        *,
        tag: str = "",
        answered: Callable[[], None] | None = None,
    ) -> CallResult:
        key = (what, agent.pod_uid, tag)
        with self._lock:
            future = self._calls.get(key)
            if future is not None and future.done() and future.result().state is CallState.FAILED:
                # Answer the failure once; the next call tries again.
                del self._calls[key]
                return future.result()
            if future is None:
                future = self._calls[key] = self._pool.submit(self._post, what, agent, body)
                if answered is not None:
                    future.add_done_callback(lambda _done: _quietly(answered))
                return CallResult(CallState.PENDING)
        return future.result() if future.done() else CallResult(CallState.PENDING)

    def _post(self, what: str, agent: Endpoint, body: dict[str, Any]) -> CallResult:
        try:
            status, answer = self._transport(
                agent.ip, self.port, "POST", f"/{what}", json.dumps(body).encode(), agent.token, self._timeout
            )
        except (OSError, http.client.HTTPException) as e:
            detail = f"cannot reach the agent at {agent.ip}:{self.port}: {e}"
            if isinstance(e, ConnectTimeout):
                detail += (
                    f" (dropped on the way: is there a NetworkPolicy that does not let the controller's pods reach "
                    f"port {self.port} of the worker pods? A default-deny egress policy in the controller's namespace, "
                    "or ingress policies of yours in the job's, must allow it besides the job's own; README "
                    "'Locked-down namespaces'. Else a firewall between nodes, or a node that is gone. The agent still "
                    "flushes on its own notices, and on the SIGTERM of its pod's deletion)"
                )
            log.warning("POST /%s to the agent of %s (%s) failed: %s", what, agent.pod, agent.ip, detail)
            return CallResult(CallState.FAILED, detail)
        text = answer[:300].decode("utf-8", "replace")
        if status in (200, 202):
            created = status == 202
            log.info("the agent of %s %s the %s", agent.pod, "accepted" if created else "was already doing", what)
            return CallResult(CallState.ACCEPTED, "accepted" if created else "already under way")
        if status == 409:
            # The command has ended: the pod's exit code says how.
            return CallResult(CallState.ACCEPTED, f"nothing left to {what}: {text}")
        if status in (401, 403):
            message = (
                f"the agent at {agent.ip} refused the token ({status}): the controller's agent-token key changed "
                "since the pod started (see --agent-token-key-file), or the pod is gone and its IP now serves "
                "another pod's agent"
            )
        else:
            message = f"the agent answered {status}: {text}"
        log.warning("POST /%s to the agent of %s: %s", what, agent.pod, message)
        return CallResult(CallState.FAILED, message)

    # -- steps and held notices

    def step(self, agent: Endpoint) -> int | None:
        """The last step the agent reported; refreshes in the background when older than the max age."""
        return self.report(agent).step

    def report(self, agent: Endpoint) -> AgentReport:
        """The agent's last report (step, held notice); refreshes in the background when older than
        the max age."""
        now = self._clock()
        with self._lock:
            entry = self._status.setdefault(agent.pod_uid, _Status())
            stale = now - entry.fetched_at >= self._status_max_age
            if stale and (entry.future is None or entry.future.done()):
                entry.fetched_at = now  # also bounds retries of an agent that does not answer
                entry.future = self._status_pool.submit(self._fetch_status, agent, entry)
            return entry.report

    def _fetch_status(self, agent: Endpoint, entry: _Status) -> None:
        try:
            status, answer = self._transport(agent.ip, self.port, "GET", "/status", None, agent.token, self._timeout)
            if status != 200:
                return
            body = json.loads(answer)
            step = body.get("step")
        except (OSError, http.client.HTTPException, ValueError, AttributeError) as e:
            log.debug("GET /status of the agent of %s failed: %s", agent.pod, e)
            return
        held = held_notice(body)
        with self._lock:
            # A step the answer lacks keeps the last one (a hint); the held notice is the answer's
            # own: one the agent no longer holds (withdrawn, or its flush started) is gone.
            kept = step if isinstance(step, int) and not isinstance(step, bool) else entry.report.step
            entry.report = AgentReport(
                kept,
                held,
                ranks_not_meeting(body.get("ranks_not_meeting")),
                ranks_state(body.get("rank_state")),
                _restored(agent, entry, body) or entry.report.restored,
            )

    # -- housekeeping

    def forget(self, pod_uid: str) -> None:
        """Drop what is remembered about a pod (the Pod informer saw it deleted)."""
        with self._lock:
            for key in [k for k in self._calls if k[1] == pod_uid]:
                del self._calls[key]
            self._status.pop(pod_uid, None)


def _restored(agent: Endpoint, entry: _Status, body: dict[str, Any]) -> tuple[int, str | None] | None:
    """The ``restored_step`` and ``restore_passed_over`` of an agent's ``/status`` answer
    (``orchestrator.backends.base.restored``); values not of their shape (an agent or a proxy that
    answers something else there) are ignored as if absent, with a log line once per pod. Called
    with the lock held."""
    step, why = body.get("restored_step"), body.get("restore_passed_over")
    said = restored(step, why)
    if ((step is not None and said is None) or (why is not None and not isinstance(why, str))) and not (
        entry.malformed_restored
    ):
        entry.malformed_restored = True
        log.warning(
            "the agent of %s answered restored_step=%.100r restore_passed_over=%.100r on GET /status, not a step "
            "and a reason: ignored (a checkpoint its ranks passed over as they restored goes untold)",
            agent.pod,
            step,
            why,
        )
    return said


def _quietly(answered: Callable[[], None]) -> None:
    """Run an ``answered`` callback on a call's thread; its failure is logged, never raised there."""
    try:
        answered()
    except Exception:
        log.exception("after an agent call was answered")
