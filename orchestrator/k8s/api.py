"""One thin client over the official ``kubernetes`` package: retries, typed errors, permissions
(the cluster configuration it is given comes from ``orchestrator.k8s.kubeconfig``).

Every call the controller makes to the API server goes through ``KubeClient``; nothing else in the
project builds a request, and no ``kubernetes`` exception type leaves this module. Objects travel as
the JSON dicts the server sends (``metadata.resourceVersion``, camelCase), never as the client's
generated models: the caches hold what the server said, and the pure functions that read them
(``cluster_signals``) need nothing but dicts.

A call, in order:

1. its (resource, verb) is checked against ``PERMISSIONS`` — the one list a test compares with the
   Helm chart's RBAC rules, so a call that RBAC would refuse fails in every test first;
2. the request is sent with the client's own auth, TLS and token refresh (``ApiClient``);
3. 5xx, 429 and timeouts / dropped connections (an answer cut off halfway too: the body is read
   within the attempt) are retried with exponential backoff (tenacity), honouring ``Retry-After``,
   within one deadline for the whole call (``RetryPolicy.deadline``: no attempt outlives it, and
   no retry starts that would begin past it); after the last try, or at
   the deadline, ``TransientError``. A reconcile worker is the caller: a call that cannot finish
   in tens of seconds (a hanging admission webhook) gives the thread back, and the work queue
   retries the job with backoff, rather than hold it for minutes while other jobs wait;
4. other answers map to typed errors: 404 ``NotFound`` (``delete`` treats it as done), 409
   ``Conflict`` (re-read and retry) or ``AlreadyExists``, 410 ``Gone`` (re-list), 422 ``Invalid``,
   401/403 ``Forbidden``; all but the transient ones derive from ``PermanentError``: retrying the
   same request cannot help.

The client is thread-safe (urllib3's pool); informers, workers, the leader elector and the event
recorder share one.
"""

from __future__ import annotations

import builtins
import json
import logging
import random
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import tenacity
import urllib3
from kubernetes import client as k8s_client
from kubernetes.client import exceptions as k8s_exceptions

log = logging.getLogger(__name__)

Object = dict[str, Any]
"""A Kubernetes object as the API server serves it (JSON, camelCase)."""

Verb = Literal["get", "list", "watch", "create", "update", "patch", "delete"]


# ----------------------------------------------------------------------------------------------
# Resources and the one list of permissions


@dataclass(frozen=True)
class Resource:
    """A kind the controller talks to, as the API server's paths name it."""

    group: str
    """"" for the core group."""
    version: str
    plural: str
    kind: str
    namespaced: bool

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    def path(self, namespace: str | None = None, name: str | None = None, subresource: str | None = None) -> str:
        base = f"/apis/{self.group}/{self.version}" if self.group else f"/api/{self.version}"
        if self.namespaced and namespace is not None:
            base += f"/namespaces/{_segment(namespace)}"
        elif self.namespaced and name is not None:
            raise ValueError(f"a {self.kind} is namespaced: name its namespace")
        base += f"/{self.plural}"
        if name is not None:
            base += f"/{_segment(name)}"
            if subresource is not None:
                base += f"/{subresource}"
        return base

    def __str__(self) -> str:
        return f"{self.plural}.{self.group}" if self.group else self.plural


def _segment(value: str) -> str:
    if not value or "/" in value or value in (".", ".."):
        raise ValueError(f"{value!r} is not a valid name for a path segment")
    return value


NODES = Resource("", "v1", "nodes", "Node", namespaced=False)
PODS = Resource("", "v1", "pods", "Pod", namespaced=True)
SERVICES = Resource("", "v1", "services", "Service", namespaced=True)
SECRETS = Resource("", "v1", "secrets", "Secret", namespaced=True)
NETWORK_POLICIES = Resource("networking.k8s.io", "v1", "networkpolicies", "NetworkPolicy", namespaced=True)
EVENTS = Resource("events.k8s.io", "v1", "events", "Event", namespaced=True)
"""Events, in the one API group spotjob writes and reads them through (served since Kubernetes 1.19)."""
LEASES = Resource("coordination.k8s.io", "v1", "leases", "Lease", namespaced=True)
SPOTJOBS = Resource("spotjob.dev", "v1alpha1", "spotjobs", "SpotJob", namespaced=True)

MIN_KUBERNETES = "1.29"
"""The oldest Kubernetes spotjob supports: the chart's ``kubeVersion`` (a test keeps the two equal)."""


@dataclass(frozen=True)
class Permission:
    """One RBAC grant the controller needs: ``verb`` on ``resource`` (``"spotjobs/status"`` for a subresource)."""

    group: str
    resource: str
    verb: Verb
    why: str


PERMISSIONS: tuple[Permission, ...] = (
    # Reads: the informers' caches (list + watch) and fresh reads before a decision (get).
    Permission("", "nodes", "list", "the Node informer"),
    Permission("", "nodes", "watch", "the Node informer"),
    Permission("", "pods", "list", "the Pod informer (workers, by label)"),
    Permission("", "pods", "watch", "the Pod informer (workers, by label)"),
    Permission("spotjob.dev", "spotjobs", "get", "a fresh read of a job the cache lags behind on (or no longer has)"),
    Permission("spotjob.dev", "spotjobs", "list", "the SpotJob informer"),
    Permission("spotjob.dev", "spotjobs", "watch", "the SpotJob informer"),
    # Writes.
    Permission("", "pods", "create", "start a worker"),
    Permission("", "pods", "delete", "stop a worker (force-delete one stuck on a lost node)"),
    Permission("", "pods", "patch", "the checkpoint hints: a worker's last-checkpoint annotations"),
    Permission("", "nodes", "patch", "the interruption queue: a notice becomes an annotation on its Node"),
    Permission("", "services", "create", "the job's headless rendezvous Service"),
    Permission("", "secrets", "create", "the job's agent token Secret (never read back: the token is derived)"),
    Permission("networking.k8s.io", "networkpolicies", "create", "the job's NetworkPolicy (--network-policy)"),
    Permission("spotjob.dev", "spotjobs/status", "update", "write the reconciler's status (compare-and-swap)"),
    Permission("events.k8s.io", "events", "create", "Events about jobs and nodes"),
    Permission("events.k8s.io", "events", "patch", "aggregate a repeated Event into its series"),
    # The leader Lease (RBAC narrows update/get to the lease's name; create cannot be narrowed).
    Permission("coordination.k8s.io", "leases", "get", "leader election"),
    Permission("coordination.k8s.io", "leases", "create", "leader election: the first replica creates the Lease"),
    Permission("coordination.k8s.io", "leases", "update", "leader election: compare-and-swap renewals"),
)
"""Every (group, resource, verb) ``KubeClient`` may call. The Helm chart's RBAC must grant exactly these."""

_ALLOWED = frozenset((p.group, p.resource, p.verb) for p in PERMISSIONS)


def allowed(
    resource: Resource,
    verb: Verb,
    subresource: str | None = None,
    grants: frozenset[tuple[str, str, str]] = _ALLOWED,
) -> bool:
    """Whether ``grants`` (default: the controller's ``PERMISSIONS``) hold ``verb`` on the resource."""
    name = f"{resource.plural}/{subresource}" if subresource else resource.plural
    return (resource.group, name, verb) in grants


# ----------------------------------------------------------------------------------------------
# Errors


class KubeError(Exception):
    """The API server refused or could not answer a request. ``status`` is the HTTP code (0: none)."""

    def __init__(self, message: str, *, status: int = 0, reason: str = "", retry_after: float | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.reason = reason
        self.retry_after = retry_after


class TransientError(KubeError):
    """The server was unavailable, overloaded or unreachable, still after retries: try again later."""


class PermanentError(KubeError):
    """The same request will fail again: something must change first."""


class NotFound(PermanentError):
    """404: the object (or its namespace, or the API group) does not exist."""


class Conflict(PermanentError):
    """409 Conflict: the object changed since it was read (stale resourceVersion). Re-read, then retry."""


class AlreadyExists(Conflict):
    """409 AlreadyExists: an object of that name exists (a create repeated after a lost answer is done)."""


class Gone(PermanentError):
    """410: the resourceVersion is older than the server keeps (a watch must re-list)."""


class Invalid(PermanentError):
    """422 Invalid (or 400 BadRequest): the object breaks the schema; the message names the field."""


class Forbidden(PermanentError):
    """401/403: RBAC (or the credentials) refuse the request."""


class NotPermitted(PermanentError):
    """The controller tried a call that ``PERMISSIONS`` does not list: a bug, caught before any request."""


class TLSError(PermanentError):
    """The TLS handshake with the API server failed: its certificate is not trusted for that name
    (``certificate-authority``, ``tls-server-name``, the server address), or it refused ours."""


def _error_from_status(code: int, body: bytes | str | None, headers: Mapping[str, str] | None) -> KubeError:
    reason, message = "", ""
    text = body.decode("utf-8", "replace") if isinstance(body, bytes) else (body or "")
    try:
        status = json.loads(text) if text else {}
        if isinstance(status, dict):
            reason = str(status.get("reason") or "")
            message = str(status.get("message") or "")
    except ValueError:
        message = text[:300]
    retry_after = _retry_after(headers)
    text = f"{code} {reason or 'error'}: {message or '(no message)'}"
    kinds: dict[int, type[KubeError]] = {
        400: Invalid,
        401: Forbidden,
        403: Forbidden,
        404: NotFound,
        410: Gone,
        422: Invalid,
    }
    if code == 409:
        cls: type[KubeError] = AlreadyExists if reason == "AlreadyExists" else Conflict
    elif code == 429 or code >= 500:
        cls = TransientError
    else:
        cls = kinds.get(code, PermanentError)
    return cls(text, status=code, reason=reason, retry_after=retry_after)


def _retry_after(headers: Mapping[str, str] | None) -> float | None:
    if not headers:
        return None
    value = headers.get("Retry-After")
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        return None  # an HTTP date: rare from kube-apiserver; fall back to our own backoff


# ----------------------------------------------------------------------------------------------
# The client


@dataclass(frozen=True)
class RetryPolicy:
    """How transient failures are retried (exponential backoff with jitter, capped), within a deadline."""

    attempts: int = 6
    initial: float = 0.2
    maximum: float = 10.0
    max_retry_after: float = 60.0
    """A longer Retry-After is capped here so one overloaded answer cannot stall a worker for long."""
    deadline: float = 30.0
    """Seconds one call may take, all its attempts and waits together: each attempt's timeout is cut
    to what is left, and a retry whose wait would end past it is not made. Without it, six attempts
    of the 30 s request timeout (or six 60 s Retry-Afters) held the calling reconcile worker for
    minutes. A watch's stream, once open, is not bound by it (its own read timeout applies)."""

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ValueError(f"RetryPolicy.attempts must be at least 1, not {self.attempts}")
        if not self.deadline > 0:
            raise ValueError(f"RetryPolicy.deadline must be a positive number of seconds, not {self.deadline}")


@dataclass(frozen=True)
class WatchEvent:
    type: str
    """ADDED, MODIFIED, DELETED or BOOKMARK."""
    object: Object


RetryHook = Callable[[str, str, str], None]
"""Called as ``(verb, resource, reason)`` before each retry (the API-retries metric)."""

_NETWORK_ERRORS: tuple[type[BaseException], ...] = (urllib3.exceptions.HTTPError, OSError)


class KubeClient:
    """Typed, retried access to the API server. Objects in and out are JSON dicts."""

    def __init__(
        self,
        configuration: k8s_client.Configuration,
        *,
        retry: RetryPolicy | None = None,
        request_timeout: float = 30.0,
        on_retry: RetryHook | None = None,
        sleep: Callable[[float], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        restricted: bool = True,
        permissions: Iterable[Permission] | None = None,
        user_agent: str = "spotjob-controller",
    ) -> None:
        """``restricted=False`` lifts the permissions check: for tests and tools acting as an
        administrator, never for the controller. ``permissions``: the list checked instead of the
        controller's ``PERMISSIONS`` (another tool's own, e.g. ``kubectl spotjob``'s)."""
        configuration.retries = False  # the client must not retry underneath ours
        self._api = k8s_client.ApiClient(configuration)
        self._api.user_agent = user_agent
        self._retry = retry or RetryPolicy()
        self._timeout = request_timeout
        self._on_retry = on_retry
        self._sleep = sleep
        self._clock = clock
        self._restricted = restricted
        self._grants = (
            _ALLOWED if permissions is None else frozenset((p.group, p.resource, p.verb) for p in permissions)
        )
        self._grants_name = "orchestrator.k8s.api.PERMISSIONS" if permissions is None else "this client's permissions"
        self._watches: set[WatchStream] = set()
        self._lock = threading.Lock()

    @property
    def host(self) -> str:
        return str(self._api.configuration.host)

    def close(self) -> None:
        with self._lock:
            watches = list(self._watches)
        for stream in watches:
            stream.close()
        self._api.close()

    # -- reads

    def get(
        self, resource: Resource, name: str, namespace: str | None = None, *, subresource: str | None = None
    ) -> Object:
        return self._json("get", resource, "GET", resource.path(namespace, name, subresource), subresource=subresource)

    def list(
        self,
        resource: Resource,
        namespace: str | None = None,
        *,
        label_selector: str | None = None,
        field_selector: str | None = None,
    ) -> tuple[builtins.list[Object], str]:
        """Every object (following ``continue`` pages) and the collection's resourceVersion."""
        items: builtins.list[Object] = []
        token: str | None = None
        while True:
            query = _query(labelSelector=label_selector, fieldSelector=field_selector, limit=500, **{"continue": token})
            page = self._json("list", resource, "GET", resource.path(namespace), query=query)
            for item in page.get("items") or []:
                # List items carry no kind/apiVersion; fill them so a cached object reads like a GET.
                item.setdefault("kind", resource.kind)
                item.setdefault("apiVersion", resource.api_version)
                items.append(item)
            meta = page.get("metadata") or {}
            token = meta.get("continue") or None
            if not token:
                return items, str(meta.get("resourceVersion") or "")

    def watch(
        self,
        resource: Resource,
        namespace: str | None = None,
        *,
        resource_version: str,
        label_selector: str | None = None,
        field_selector: str | None = None,
        timeout_seconds: int = 300,
    ) -> WatchStream:
        """Changes after ``resource_version``, with bookmarks, until the server ends the watch.

        Opening is retried like any call; once open, a dropped connection raises ``TransientError``
        from the iterator, and an expired version raises ``Gone`` (the caller re-lists).
        """
        if self._restricted and not allowed(resource, "watch", grants=self._grants):
            raise NotPermitted(f"watch {resource} is not in {self._grants_name}")
        query = _query(
            watch="true",
            resourceVersion=resource_version,
            allowWatchBookmarks="true",
            timeoutSeconds=timeout_seconds,
            labelSelector=label_selector,
            fieldSelector=field_selector,
        )
        # The socket read timeout outlives the server's timeoutSeconds: a silent, dead connection
        # is noticed, a quiet but healthy watch is not cut short.
        response = self._request(
            "watch",
            resource,
            "GET",
            resource.path(namespace),
            query=query,
            timeout=(10.0, timeout_seconds + 30.0),
        )
        stream = WatchStream(response, resource, self)
        with self._lock:
            self._watches.add(stream)
        return stream

    # -- writes

    def create(self, resource: Resource, body: Object, namespace: str | None = None) -> Object:
        return self._json("create", resource, "POST", resource.path(namespace), body=body)

    def replace(self, resource: Resource, body: Object, *, subresource: str | None = None) -> Object:
        """PUT with the body's ``metadata.resourceVersion``: ``Conflict`` if the object changed since."""
        meta = body.get("metadata") or {}
        path = resource.path(meta.get("namespace"), meta["name"], subresource)
        return self._json("update", resource, "PUT", path, body=body, subresource=subresource)

    def patch(
        self,
        resource: Resource,
        name: str,
        patch: Object,
        namespace: str | None = None,
        *,
        subresource: str | None = None,
    ) -> Object:
        """A JSON merge patch (RFC 7386): the one patch type every resource, custom ones too, accepts."""
        return self._json(
            "patch",
            resource,
            "PATCH",
            resource.path(namespace, name, subresource),
            body=patch,
            content_type="application/merge-patch+json",
            subresource=subresource,
        )

    def delete(
        self,
        resource: Resource,
        name: str,
        namespace: str | None = None,
        *,
        propagation: str = "Background",
        grace_period_seconds: int | None = None,
        precondition_uid: str | None = None,
    ) -> bool:
        """Delete; False if it was already gone (404 on delete is done)."""
        options: Object = {"apiVersion": "v1", "kind": "DeleteOptions", "propagationPolicy": propagation}
        if grace_period_seconds is not None:
            options["gracePeriodSeconds"] = grace_period_seconds
        if precondition_uid is not None:
            options["preconditions"] = {"uid": precondition_uid}
        try:
            self._json("delete", resource, "DELETE", resource.path(namespace, name), body=options)
        except NotFound:
            return False
        return True

    def api_group_served(self, group: str, version: str) -> bool:
        """Whether the server serves ``/apis/group/version`` (discovery, allowed to every user)."""
        try:
            response = self._send("GET", f"/apis/{group}/{version}", query=[], body=None, timeout=self._timeout)
        except _NETWORK_ERRORS as e:
            raise TransientError(f"discovery of {group}/{version} failed: {e}") from e
        try:
            try:
                body = response.read()  # always read: an unread body would poison the pooled connection
            except _NETWORK_ERRORS as e:  # the answer cut off halfway
                raise TransientError(f"discovery of {group}/{version} failed reading the answer: {e}") from e
            if response.status == 404:
                return False
            if response.status >= 400:
                raise _error_from_status(response.status, body, response.headers)
            return True
        finally:
            response.response.release_conn()

    # -- the machinery

    def _json(
        self,
        verb: Verb,
        resource: Resource,
        method: str,
        path: str,
        *,
        query: builtins.list[tuple[str, str]] | None = None,
        body: Any = None,
        content_type: str | None = None,
        subresource: str | None = None,
    ) -> Object:
        data = self._request(
            verb,
            resource,
            method,
            path,
            query=query,
            body=body,
            content_type=content_type,
            subresource=subresource,
            read=True,
        )
        try:
            parsed = json.loads(data) if data else {}
        except ValueError as e:
            raise PermanentError(f"{method} {path}: the server's answer is not JSON: {data[:200]!r}") from e
        if not isinstance(parsed, dict):
            raise PermanentError(f"{method} {path}: the server's answer is not an object")
        return parsed

    def _request(
        self,
        verb: Verb,
        resource: Resource,
        method: str,
        path: str,
        *,
        query: builtins.list[tuple[str, str]] | None = None,
        body: Any = None,
        content_type: str | None = None,
        subresource: str | None = None,
        timeout: float | tuple[float, float] | None = None,
        read: bool = False,
    ) -> Any:
        """The response (``read``: its body, read within the attempt, so that an answer cut off
        halfway is retried like any dropped connection, within the same deadline)."""
        if self._restricted and not allowed(resource, verb, subresource, self._grants):
            target = f"{resource}/{subresource}" if subresource else str(resource)
            raise NotPermitted(f"{verb} {target} is not in {self._grants_name}")
        what = f"{verb} {resource}{'/' + subresource if subresource else ''}"
        ends_at = self._clock() + self._retry.deadline
        renewed = False

        def attempt() -> Any:
            nonlocal renewed
            left = ends_at - self._clock()
            if left <= 0:
                raise TransientError(f"{what}: no answer within the call's {self._retry.deadline:g}s deadline")
            try:
                response = self._send(
                    method,
                    path,
                    query=query or [],
                    body=body,
                    content_type=content_type,
                    timeout=_within(timeout or self._timeout, left),
                )
            except _NETWORK_ERRORS as e:
                raise TransientError(f"{what}: {type(e).__name__}: {e}") from e
            except k8s_exceptions.ApiException as e:  # the client's own refusals (TLS): not retryable
                reason = " ".join(str(e.reason).split())
                if reason.startswith("SSLError"):
                    raise TLSError(f"{what}: {reason.removeprefix('SSLError').strip()}") from e
                raise PermanentError(f"{what}: {reason}", status=int(e.status or 0)) from e
            if response.status < 400 and not read:
                return response  # a watch's stream: its iterator reads it
            try:
                data = response.read()
            except _NETWORK_ERRORS as e:  # the answer cut off halfway: as a dropped connection
                raise TransientError(f"{what}: {type(e).__name__} reading the answer: {e}") from e
            finally:
                response.response.release_conn()
            if response.status < 400:
                return data
            if response.status == 401 and not renewed and self._renew_credential():
                renewed = True  # as kubectl: a credential plugin's token refused is fetched again, once
                return attempt()
            raise _error_from_status(response.status, data, response.headers)

        def before_sleep(state: tenacity.RetryCallState) -> None:
            error = state.outcome.exception() if state.outcome else None
            reason = str(getattr(error, "status", "") or "network") if error else "unknown"
            log.warning("%s failed (%s), retrying: %s", what, reason, error)
            if self._on_retry is not None:
                self._on_retry(verb, str(resource), reason)

        retrying = tenacity.Retrying(
            retry=tenacity.retry_if_exception_type(TransientError),
            stop=tenacity.stop_after_attempt(self._retry.attempts) | _PastDeadline(ends_at, self._clock),
            wait=self._wait,
            before_sleep=before_sleep,
            reraise=True,
            sleep=self._sleep or tenacity.nap.sleep,
        )
        return retrying(attempt)

    def _renew_credential(self) -> bool:
        """After a 401: whether the configuration's credential source (``orchestrator.k8s.kubeconfig``:
        a credential plugin, a token file) gave a new token to try."""
        renew = getattr(self._api.configuration.refresh_api_key_hook, "renew", None)
        return bool(renew()) if callable(renew) else False

    def _wait(self, state: tenacity.RetryCallState) -> float:
        error = state.outcome.exception() if state.outcome else None
        retry_after = getattr(error, "retry_after", None)
        if retry_after is not None:
            return float(min(retry_after, self._retry.max_retry_after))
        backoff = min(self._retry.maximum, self._retry.initial * 2 ** (state.attempt_number - 1))
        return backoff * (0.5 + random.random() / 2)

    def _send(
        self,
        method: str,
        path: str,
        *,
        query: builtins.list[tuple[str, str]],
        body: Any,
        timeout: float | tuple[float, float],
        content_type: str | None = None,
    ) -> Any:
        headers = {"Accept": "application/json"}
        if body is not None:
            headers["Content-Type"] = content_type or "application/json"
        method_, url, header_params, serialized, _ = self._api.param_serialize(
            method=method,
            resource_path=path,
            query_params=query,
            header_params=headers,
            body=body,
            auth_settings=["BearerToken"],
        )
        return self._api.call_api(method_, url, header_params=header_params, body=serialized, _request_timeout=timeout)

    def _forget(self, stream: WatchStream) -> None:
        with self._lock:
            self._watches.discard(stream)


class _PastDeadline(tenacity.stop.stop_base):
    """Stop when the wait before the next attempt would end at or past ``ends_at``: a retry that
    would start too late to be worth it is not made. (tenacity computes the wait, then asks.)"""

    def __init__(self, ends_at: float, clock: Callable[[], float]) -> None:
        self._ends_at = ends_at
        self._clock = clock

    def __call__(self, retry_state: tenacity.RetryCallState) -> bool:
        return self._clock() + retry_state.upcoming_sleep >= self._ends_at


def _within(timeout: float | tuple[float, float], left: float) -> float | tuple[float, float]:
    """``timeout`` cut to the ``left`` seconds of the call's deadline; a watch's (connect, read)
    keeps its read timeout, which bounds each read of the stream, not the call."""
    if isinstance(timeout, tuple):
        return (min(timeout[0], left), timeout[1])
    return min(timeout, left)


def _query(**params: Any) -> list[tuple[str, str]]:
    return [(k, str(v)) for k, v in params.items() if v is not None]


class WatchStream:
    """An open watch: iterate for ``WatchEvent``s; ``close()`` (from any thread) ends it."""

    def __init__(self, response: Any, resource: Resource, owner: KubeClient) -> None:
        self._response = response.response  # the raw urllib3 response, read as it streams
        self._resource = resource
        self._owner = owner
        self._closed = threading.Event()

    def close(self) -> None:
        if not self._closed.is_set():
            self._closed.set()
            try:
                self._response.shutdown()  # unblocks a read in progress in another thread
            except Exception:
                pass
            # A watch cut short leaves its connection mid-body: close it rather than pool it.
            self._response.close()
            self._response.release_conn()
            self._owner._forget(self)

    def __enter__(self) -> WatchStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __iter__(self) -> Iterator[WatchEvent]:
        buffer = b""
        try:
            for chunk in self._response.stream(amt=None, decode_content=True):
                buffer += chunk
                while b"\n" in buffer:
                    line, buffer = buffer.split(b"\n", 1)
                    if line.strip():
                        yield self._event(line)
            if buffer.strip():
                yield self._event(buffer)
        except _NETWORK_ERRORS as e:
            if not self._closed.is_set():
                raise TransientError(f"watch {self._resource} dropped: {type(e).__name__}: {e}") from e
        finally:
            self.close()

    def _event(self, line: bytes) -> WatchEvent:
        try:
            event = json.loads(line)
            kind, obj = event["type"], event["object"]
        except (ValueError, KeyError, TypeError) as e:
            raise TransientError(f"watch {self._resource}: cannot parse {line[:200]!r}") from e
        if kind == "ERROR":
            code = int(obj.get("code") or 0) if isinstance(obj, dict) else 0
            raise _error_from_status(code or 500, json.dumps(obj), None)
        if isinstance(obj, dict) and kind != "BOOKMARK":
            obj.setdefault("kind", self._resource.kind)
            obj.setdefault("apiVersion", self._resource.api_version)
        return WatchEvent(kind, obj)


def object_key(obj: Mapping[str, Any]) -> tuple[str, str]:
    """(namespace, name) of an object; namespace "" for cluster-scoped kinds."""
    meta = obj.get("metadata") or {}
    return str(meta.get("namespace") or ""), str(meta.get("name") or "")


def resource_version(obj: Mapping[str, Any]) -> str:
    return str((obj.get("metadata") or {}).get("resourceVersion") or "")
