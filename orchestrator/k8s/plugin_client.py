"""The Kubernetes side of ``kubectl spotjob``: the user's kubeconfig and context, and every call it makes.

The plugin acts as the person running it, never as the controller: it loads the kubeconfig the
way kubectl does (``--kubeconfig``, else ``$KUBECONFIG`` — a list of files, merged — else
``~/.kube/config``, else the pod's service account), picks the context (``--context``, else the
current one) and its namespace, and reaches the API server through ``KubeClient`` with its own
short list of permissions, ``PLUGIN_PERMISSIONS``: what a team needs RBAC for, and nothing else
(the README prints it as a Role). Reads: the SpotJobs (get, list, watch), the job's pods (list)
and its Events (list). The one write: a flush request, a merge patch of the SpotJob's
``spotjob.dev/flush-request`` annotation — so RBAC on ``patch spotjobs`` decides who may flush.

Errors leave this module as ``PluginError``s that say what to do: ``NotServed`` (spotjob is not
installed, or the cluster is older than spotjob supports: no events.k8s.io/v1), ``JobNotFound``,
``AccessDenied`` (naming the verb, resource and namespace RBAC refused), ``Unreachable`` (no API
server answered), ``ServerError``; configuration problems are ``ContextError``. A command line tool
has a person waiting, so transient failures are retried briefly (three tries, well under two
seconds), not for minutes like the controller.
"""

from __future__ import annotations

import json
import os
import shlex
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import yaml
from kubernetes import client as k8s_client
from kubernetes import config as k8s_config
from kubernetes.config.config_exception import ConfigException

from orchestrator.k8s.api import (
    EVENTS,
    MIN_KUBERNETES,
    PODS,
    SPOTJOBS,
    Forbidden,
    Gone,
    KubeClient,
    KubeError,
    NotFound,
    Object,
    Permission,
    Resource,
    RetryPolicy,
    TLSError,
    TransientError,
    Verb,
    resource_version,
)
from orchestrator.k8s.kubeconfig import CredentialError, load_kubeconfig_dict, read_kubeconfig
from orchestrator.k8s.pods import JOB_LABEL
from orchestrator.model import parse_timestamp

__all__ = [
    "FLUSH_REQUEST_ANNOTATION",
    "PLUGIN_PERMISSIONS",
    "AccessDenied",
    "ContextError",
    "JobDeleted",
    "JobEvent",
    "JobNotFound",
    "NotServed",
    "PluginError",
    "ServerError",
    "SpotJobClient",
    "Unreachable",
    "UserContext",
    "load_user_context",
]

FLUSH_REQUEST_ANNOTATION = "spotjob.dev/flush-request"
"""The annotation ``kubectl spotjob flush`` writes; the controller answers in ``status.lastFlushRequest``."""

PLUGIN_PERMISSIONS: tuple[Permission, ...] = (
    Permission("spotjob.dev", "spotjobs", "get", "status NAME, checkpoints, events, flush: read the job"),
    Permission("spotjob.dev", "spotjobs", "list", "status: the table of jobs"),
    Permission("spotjob.dev", "spotjobs", "watch", "flush --wait: the job's status until the controller answers"),
    Permission("spotjob.dev", "spotjobs", "patch", "flush: the spotjob.dev/flush-request annotation"),
    Permission("", "pods", "list", "status NAME: the job's pods (without it, the controller's last view)"),
    Permission("events.k8s.io", "events", "list", "events: the job's Events"),
)
"""Every (group, resource, verb) ``kubectl spotjob`` may call: the RBAC a team needs for it."""

_SERVICE_ACCOUNT = "/var/run/secrets/kubernetes.io/serviceaccount"
_SPOTJOBS = f"{SPOTJOBS.plural}.{SPOTJOBS.group}"


# ----------------------------------------------------------------------------------------------
# Errors


class PluginError(Exception):
    """A reason a command stopped, worded for the person who ran it."""


class ContextError(PluginError):
    """No usable kubeconfig or context."""


class NotServed(PluginError):
    """The cluster does not serve an API the plugin needs: the SpotJob API (spotjob's CRD is not
    installed), or events.k8s.io/v1 (a Kubernetes older than spotjob supports)."""


class JobNotFound(PluginError):
    """No SpotJob of that name in that namespace."""


class JobDeleted(PluginError):
    """The SpotJob was deleted while the command waited on it."""


class AccessDenied(PluginError):
    """RBAC (or the credentials) refused a request; says which verb on which resource."""

    def __init__(self, message: str, *, verb: str, resource: str, namespace: str | None, status: int) -> None:
        super().__init__(message)
        self.verb = verb
        self.resource = resource
        self.namespace = namespace
        self.status = status


class Unreachable(PluginError):
    """No API server answered at the context's address."""


class ServerError(PluginError):
    """The API server answered with an error that is not the user's to fix."""


# ----------------------------------------------------------------------------------------------
# The user's kubeconfig and context


@dataclass(frozen=True)
class UserContext:
    """Where the plugin talks to, and as whom: what kubectl would use with the same flags."""

    configuration: k8s_client.Configuration
    namespace: str
    """The context's namespace (``default`` when it names none): the default for ``-n``."""
    context: str
    """The context's name ("" for the in-cluster service account)."""
    source: str
    """Where the configuration came from (files, or the service account), for messages."""
    user: str = ""
    """The context's user ("" for the in-cluster service account), for messages."""

    @property
    def server(self) -> str:
        return str(self.configuration.host)


def load_user_context(
    kubeconfig: str | None = None,
    context: str | None = None,
    *,
    cluster: str | None = None,
    user: str | None = None,
) -> UserContext:
    """The kubeconfig and context kubectl would pick: ``kubeconfig`` (``--kubeconfig``), else
    ``$KUBECONFIG`` (files joined by ``:``, merged), else ``~/.kube/config``, else the pod's
    service account; ``context`` (``--context``), else the current context; ``cluster`` and
    ``user`` (``--cluster``, ``--user``) in place of the context's own. A ``~`` in
    ``--kubeconfig`` is the home folder, as the loader reads it (``--kubeconfig=~/x`` reaches us
    unexpanded by the shell)."""
    kubeconfig = os.path.expanduser(kubeconfig) if kubeconfig else kubeconfig
    path = kubeconfig or os.environ.get("KUBECONFIG") or None
    if path is None:
        default = os.path.expanduser("~/.kube/config")
        if os.path.exists(default):
            path = default
        elif os.environ.get("KUBERNETES_SERVICE_HOST"):
            return _in_cluster({"--context": context, "--cluster": cluster, "--user": user})
        else:
            raise ContextError(
                "no kubeconfig: pass --kubeconfig PATH or set KUBECONFIG (kubectl spotjob uses the same "
                "configuration as kubectl)"
            )
    if kubeconfig and not os.path.exists(kubeconfig):
        raise ContextError(f"--kubeconfig {kubeconfig}: no such file")
    configuration = k8s_client.Configuration()
    try:
        merged = read_kubeconfig(path)
        contexts = merged["contexts"]
        chosen = context or merged.get("current-context")
        if not chosen:
            raise ContextError(f"{path} has no current context: pass --context NAME")
        found = next((c for c in contexts if c.get("name") == chosen), None)
        if found is None:
            raise ContextError(f'context "{chosen}" is not in {path} (it has: {_names(contexts)})')
        overrides = {"cluster": cluster, "user": user}
        for key, value in overrides.items():
            entries = merged[f"{key}s"]
            if value and not any(e.get("name") == value for e in entries):
                raise ContextError(f'--{key} {value}: {key} "{value}" is not in {path} (it has: {_names(entries)})')
        if cluster or user:
            fields = {**(found.get("context") or {}), **{k: v for k, v in overrides.items() if v}}
            found = {**found, "context": fields}
            merged["contexts"] = [found if c.get("name") == chosen else c for c in contexts]
        load_kubeconfig_dict(merged, str(chosen), configuration)
    except ContextError:
        raise
    except CredentialError as e:
        raise ContextError(f"{_one_line(e)} (context {chosen} of {path})") from e
    except (ConfigException, OSError, ValueError, TypeError, AttributeError, KeyError, yaml.YAMLError) as e:
        raise ContextError(f"cannot use the kubeconfig {path}: {_one_line(e)}") from e
    fields = found.get("context") or {}
    namespace = str(fields.get("namespace") or "default")
    return UserContext(configuration, namespace, str(chosen), path, str(fields.get("user") or ""))


def _names(entries: list[dict[str, Any]]) -> str:
    """The names of a kubeconfig's contexts, clusters or users, for a message."""
    return ", ".join(sorted(str(e.get("name")) for e in entries)) or "none"


def _one_line(error: Exception) -> str:
    """An error on one line: a YAML error's own text spans several ("in <file>, line 2, column 1")."""
    return " ".join(str(error).split())


def _in_cluster(flags: dict[str, str | None]) -> UserContext:
    """The pod's service account; ``flags`` (``--context`` …) name a kubeconfig's entries: none may be given."""
    for flag, value in flags.items():
        if value:
            raise ContextError(f"{flag} {value}: no kubeconfig to find it in (running with a pod's service account)")
    configuration = k8s_client.Configuration()
    try:
        k8s_config.load_incluster_config(client_configuration=configuration)
        with open(os.path.join(_SERVICE_ACCOUNT, "namespace")) as f:
            namespace = f.read().strip() or "default"
    except (ConfigException, OSError) as e:
        raise ContextError(f"no kubeconfig, and the pod's service account cannot be used: {e}") from e
    return UserContext(configuration, namespace, "", "the pod's service account")


# ----------------------------------------------------------------------------------------------
# Events, as events.k8s.io/v1 serves them


@dataclass(frozen=True)
class JobEvent:
    """One Event about a job (one written through core v1 too, as events.k8s.io/v1 shows it)."""

    type: str
    reason: str
    note: str
    count: int
    """How many times it happened (a series' count; 1 for a single occurrence)."""
    first: datetime | None
    last: datetime | None
    """The latest occurrence (the series' last observation)."""
    reporter: str
    """``reportingController``/``reportingInstance``."""
    related: str
    """``kind/name`` of the related object (e.g. the Node a notice came from), or ""."""


def _related(ref: Any) -> str:
    if not isinstance(ref, dict) or not ref.get("name"):
        return ""
    return f"{ref.get('kind') or '?'}/{ref['name']}"


def _v1_event(e: Object) -> JobEvent:
    series = e.get("series") or {}
    first = parse_timestamp(e.get("eventTime")) or parse_timestamp(e.get("deprecatedFirstTimestamp"))
    first = first or parse_timestamp((e.get("metadata") or {}).get("creationTimestamp"))
    last = parse_timestamp(series.get("lastObservedTime")) or parse_timestamp(e.get("deprecatedLastTimestamp")) or first
    count = int(series.get("count") or e.get("deprecatedCount") or 1)
    reporter = "/".join(x for x in (e.get("reportingController"), e.get("reportingInstance")) if x)
    return JobEvent(
        type=str(e.get("type") or ""),
        reason=str(e.get("reason") or ""),
        note=str(e.get("note") or ""),
        count=max(count, 1),
        first=first,
        last=last,
        reporter=reporter,
        related=_related(e.get("related")),
    )


# ----------------------------------------------------------------------------------------------
# The client


class SpotJobClient:
    """The calls ``kubectl spotjob`` makes, each checked against ``PLUGIN_PERMISSIONS``."""

    def __init__(self, user: UserContext, *, request_timeout: float = 30.0) -> None:
        self.user = user
        self._client = KubeClient(
            user.configuration,
            # A person's --request-timeout bounds each request; the call's deadline must not cut it
            # shorter: three attempts of it and the two waits between them (5 s at most each).
            retry=RetryPolicy(
                attempts=3, initial=0.2, maximum=1.0, max_retry_after=5.0, deadline=3 * request_timeout + 10.0
            ),
            request_timeout=request_timeout,
            permissions=PLUGIN_PERMISSIONS,
            user_agent="kubectl-spotjob",
        )

    def close(self) -> None:
        self._client.close()

    def __enter__(self) -> SpotJobClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- SpotJobs

    def list_jobs(self, namespace: str | None) -> list[Object]:
        """The SpotJobs of ``namespace`` (None: every namespace), sorted by namespace and name."""
        try:
            items, _ = self._client.list(SPOTJOBS, namespace)
        except NotFound:
            raise self._not_served() from None
        except KubeError as e:
            raise self._translate(e, "list", SPOTJOBS, namespace) from e
        return sorted(items, key=lambda o: (o["metadata"].get("namespace", ""), o["metadata"]["name"]))

    def get_job(self, namespace: str, name: str) -> Object:
        try:
            return self._client.get(SPOTJOBS, name, namespace)
        except NotFound:
            if not self._spotjobs_served():
                raise self._not_served() from None
            raise JobNotFound(f'{_SPOTJOBS} "{name}" not found in namespace "{namespace}"') from None
        except KubeError as e:
            raise self._translate(e, "get", SPOTJOBS, namespace) from e

    def request_flush(self, namespace: str, name: str, request: dict[str, Any]) -> Object:
        """Write ``request`` (JSON) into the job's flush-request annotation; the patched job."""
        patch = {"metadata": {"annotations": {FLUSH_REQUEST_ANNOTATION: json.dumps(request, separators=(",", ":"))}}}
        try:
            return self._client.patch(SPOTJOBS, name, patch, namespace)
        except NotFound:
            raise JobNotFound(f'{_SPOTJOBS} "{name}" not found in namespace "{namespace}"') from None
        except KubeError as e:
            raise self._translate(e, "patch", SPOTJOBS, namespace) from e

    def follow_job(self, namespace: str, name: str, since: str, timeout: float) -> Iterator[Object]:
        """Each new version of the job after resourceVersion ``since``, for up to ``timeout`` seconds.

        A watch on the job alone (``metadata.name``); a watch the server ends or drops is opened
        again from the last version seen, and an expired version (410) is read afresh. Raises
        ``JobDeleted`` when the job is deleted. Returns when the time is up.
        """
        deadline = time.monotonic() + timeout
        rv = since
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            try:
                with self._client.watch(
                    SPOTJOBS,
                    namespace,
                    resource_version=rv,
                    field_selector=f"metadata.name={name}",
                    timeout_seconds=max(1, min(int(left + 0.999), 300)),
                ) as stream:
                    for event in stream:
                        rv = resource_version(event.object) or rv
                        if event.type == "DELETED":
                            raise JobDeleted(f'{_SPOTJOBS} "{name}" was deleted in namespace "{namespace}"')
                        if event.type in ("ADDED", "MODIFIED"):
                            yield event.object
                        if time.monotonic() >= deadline:
                            return
            except Gone:
                job = self.get_job(namespace, name)
                rv = resource_version(job)
                yield job
            except TransientError:
                continue  # a dropped watch: open it again from the last version seen
            except KubeError as e:
                raise self._translate(e, "watch", SPOTJOBS, namespace) from e

    # -- what belongs to a job

    def job_pods(self, namespace: str, name: str) -> list[Object]:
        """The job's pods (by the ``spotjob.dev/job`` label), sorted by name."""
        try:
            items, _ = self._client.list(PODS, namespace, label_selector=f"{JOB_LABEL}={name}")
        except KubeError as e:
            raise self._translate(e, "list", PODS, namespace) from e
        return sorted(items, key=lambda p: p["metadata"]["name"])

    def job_events(self, job: Object) -> list[JobEvent]:
        """The Events about ``job`` (this incarnation of it: same uid, or none recorded), oldest
        first by their latest occurrence, from events.k8s.io/v1 (what the controller writes).
        ``NotServed`` where the cluster does not serve that API (below spotjob's minimum)."""
        meta = job.get("metadata") or {}
        namespace, name, uid = str(meta.get("namespace") or ""), str(meta["name"]), str(meta.get("uid") or "")
        kind = str(job.get("kind") or "SpotJob")
        try:
            served = self._client.api_group_served(EVENTS.group, EVENTS.version)
        except KubeError as e:
            raise self._translate(e, "get", EVENTS, namespace) from e
        if not served:
            raise NotServed(
                f"the cluster at {self.user.server} does not serve {EVENTS.group}/{EVENTS.version}, the Events "
                f"API of every Kubernetes since 1.19: spotjob needs Kubernetes {MIN_KUBERNETES} or later, and its "
                f"controller writes no Events there; `kubectl spotjob status {shlex.quote(name)} -n "
                f"{shlex.quote(namespace)}` shows the job's state and why"
            )
        try:
            selector = f"regarding.kind={kind},regarding.name={name}"
            items, _ = self._client.list(EVENTS, namespace, field_selector=selector)
        except KubeError as e:
            raise self._translate(e, "list", EVENTS, namespace) from e
        mine = [e for e in items if (e.get("regarding") or {}).get("uid") in (None, "", uid)]
        events = [_v1_event(e) for e in mine]
        never = datetime.min.replace(tzinfo=UTC)
        return sorted(events, key=lambda e: (e.last or never, e.first or never))

    # -- errors

    def _spotjobs_served(self) -> bool:
        try:
            return self._client.api_group_served(SPOTJOBS.group, SPOTJOBS.version)
        except KubeError:
            return True  # cannot tell: report the job as not found rather than guess

    def _not_served(self) -> NotServed:
        return NotServed(
            f"the cluster at {self.user.server} does not serve {SPOTJOBS.group}/{SPOTJOBS.version} SpotJobs: "
            "spotjob is not installed there (helm install spotjob charts/spotjob), or this is another cluster "
            "than you meant (check --context)"
        )

    def _translate(self, error: KubeError, verb: Verb | str, resource: Resource, namespace: str | None) -> PluginError:
        what = f"{resource.plural}.{resource.group}" if resource.group else resource.plural
        where = f' in namespace "{namespace}"' if namespace and resource.namespaced else ""
        if resource.namespaced and namespace is None:
            where = " at the cluster scope (all namespaces)"
        if isinstance(error, CredentialError):
            return ContextError(f"{_one_line(error)} (context {self.user.context} of {self.user.source})")
        if isinstance(error, Forbidden):
            detail = _server_message(error)
            if error.status == 401:
                who = f'user "{self.user.user}" of context {self.user.context}' if self.user.user else "the user"
                if not self.user.context:
                    who = "the pod's service account token"
                message = (
                    f"the API server at {self.user.server} did not accept the credentials of {who} "
                    f"(401 Unauthorized, {self.user.source}): log in again, or check that user's token, "
                    "client certificate or credential plugin"
                )
            else:
                # Only a ClusterRole grants a request at the cluster scope (`status -A`).
                cluster_wide = resource.namespaced and namespace is None
                grant = "ClusterRole (bound with a ClusterRoleBinding)" if cluster_wide else "Role"
                message = (
                    f"forbidden: RBAC does not let you {verb} {what}{where}"
                    + (f" ({detail})" if detail else "")
                    + f". Ask your cluster admin for a {grant} granting {verb} on {what}"
                    + ' (the README\'s "kubectl spotjob" section lists what each command needs)'
                )
            return AccessDenied(message, verb=str(verb), resource=what, namespace=namespace, status=error.status)
        if isinstance(error, TLSError):
            context = self.user.context or "(in-cluster)"
            return Unreachable(
                f"cannot talk to the API server at {self.user.server} over TLS (context {context} "
                f"from {self.user.source}): {_server_message(error)}. Check the cluster's certificate-authority, "
                "tls-server-name and server address in the kubeconfig"
            )
        if isinstance(error, TransientError) and error.status == 0:
            return Unreachable(
                f"cannot reach the API server at {self.user.server} (context {self.user.context or '(in-cluster)'} "
                f"from {self.user.source}): {_cause(error)}"
            )
        return ServerError(f"{verb} {what}{where}: {error}")


def _server_message(error: KubeError) -> str:
    """The server's own message of an error ("403 Forbidden: <message>"), without the prefix."""
    text = str(error)
    _, sep, message = text.partition(": ")
    return message.strip() if sep and message.strip() != "(no message)" else ""


def _cause(error: BaseException) -> str:
    """The root of a network error, in words ("Connection refused", a TLS failure, a timeout)."""
    seen: BaseException = error
    while seen.__cause__ is not None:
        seen = seen.__cause__
    reason = getattr(seen, "reason", None)
    text = str(reason or seen)
    for marker in ("Connection refused", "timed out", "Name or service not known", "CERTIFICATE_VERIFY_FAILED"):
        if marker in text:
            return {"CERTIFICATE_VERIFY_FAILED": "its TLS certificate is not trusted (certificate verify failed)"}.get(
                marker, marker.lower()
            )
    return text[:300]
