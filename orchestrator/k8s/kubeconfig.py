"""Where the cluster is and who we are: kubeconfig files and the in-cluster service account.

``load_config`` is what the controller uses (``--kubeconfig``, $KUBECONFIG, in-cluster, then
~/.kube/config); the plugin (``orchestrator.k8s.plugin_client``) reads the same files with
``read_kubeconfig`` and ``load_kubeconfig_dict`` to honour kubectl's ``--context``, ``--cluster``
and ``--user``. Both do what kubectl does where the client library does not:

- a $KUBECONFIG list is merged as kubectl merges it (the first file to name an entry wins), and
  relative file names are read against the folder of the file that holds them;
- an ``exec`` credential plugin (``aws eks get-token``, ``gke-gcloud-auth-plugin``) is run here,
  so a missing or failing plugin is an error that says so (``CredentialError``), and its token is
  fetched again before it expires and once after a 401 (``KubeClient`` calls the ``renew`` of the
  configuration's ``refresh_api_key_hook``);
- a ``tokenFile`` is read again once a minute and after a 401, trimmed;
- a SOCKS proxy without PySocks is an error that names the package.
"""

from __future__ import annotations

import base64
import copy
import importlib.util
import json
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from datetime import datetime
from typing import Any

import yaml
from kubernetes import client as k8s_client
from kubernetes import config as k8s_config
from kubernetes.config.config_exception import ConfigException

from orchestrator.k8s.api import PermanentError

log = logging.getLogger(__name__)


class CredentialError(PermanentError):
    """A kubeconfig user's credential plugin (``exec``) gave no credentials: the message says why."""


class ConfigError(Exception):
    """No usable cluster configuration: names where it looked and what to do."""


_PATH_FIELDS = {
    "clusters": ("cluster", ("certificate-authority",)),
    "users": ("user", ("client-certificate", "client-key", "tokenFile")),
}
"""The fields of a kubeconfig that name files: kubectl reads a relative one against the folder of the file it is in."""


def read_kubeconfig(paths: str) -> dict[str, Any]:
    """The kubeconfig kubectl would use from ``paths`` (files joined by ``os.pathsep``, as in
    $KUBECONFIG), merged as kubectl merges them: empty entries and missing files are skipped, an
    empty file is an empty config, the first file to name a cluster, user or context wins for it, and
    so does the first to set ``current-context``. Relative file names (``certificate-authority``,
    ``client-certificate``, ``client-key``, ``tokenFile``, an exec ``command`` with a ``/``) are made
    absolute against the folder of the file that holds them. Raises ``ConfigException`` (no file at
    all, or one that is no kubeconfig), ``OSError`` or ``yaml.YAMLError``."""
    merged: dict[str, Any] = {"apiVersion": "v1", "kind": "Config", "clusters": [], "users": [], "contexts": []}
    read = 0
    for path in paths.split(os.pathsep):
        path = os.path.expanduser(path)
        if not path or not os.path.exists(path):
            continue
        read += 1
        with open(path) as f:
            doc = yaml.safe_load(f)
        if doc is None:
            continue
        if not isinstance(doc, dict):
            raise ConfigException(f"{path} is not a kubeconfig (not a YAML mapping)")
        folder = os.path.dirname(os.path.abspath(path))
        for section in ("clusters", "users", "contexts"):
            entries = doc.get(section) or []
            if not isinstance(entries, list):
                raise ConfigException(f"{path}: {section} is not a list")
            for entry in entries:
                if not isinstance(entry, dict) or not entry.get("name"):
                    raise ConfigException(f"{path}: an entry of {section} has no name")
                if any(e["name"] == entry["name"] for e in merged[section]):
                    continue  # the first file to name it wins
                merged[section].append(_resolved(section, copy.deepcopy(entry), folder))
        if not merged.get("current-context") and doc.get("current-context"):
            merged["current-context"] = doc["current-context"]
    if not read:
        raise ConfigException(f"no kubeconfig file found at {paths}")
    return merged


def _resolved(section: str, entry: dict[str, Any], folder: str) -> dict[str, Any]:
    inner, fields = _PATH_FIELDS.get(section, ("", ()))
    body = entry.get(inner)
    if not isinstance(body, dict):
        return entry
    for field in fields:
        if isinstance(body.get(field), str) and body[field]:
            body[field] = os.path.normpath(os.path.join(folder, os.path.expanduser(body[field])))
    command = (body.get("exec") or {}).get("command") if isinstance(body.get("exec"), dict) else None
    if isinstance(command, str) and "/" in command:
        body["exec"]["command"] = os.path.normpath(os.path.join(folder, os.path.expanduser(command)))
    return entry


_EXEC_API_VERSIONS = ("client.authentication.k8s.io/v1", "client.authentication.k8s.io/v1beta1")
_EXEC_EARLY = 30.0
"""Seconds before a credential's ``expirationTimestamp`` that the plugin is run again."""


class ExecCredential:
    """A kubeconfig user's client-go credential plugin (``users[].user.exec``: ``aws eks get-token``,
    ``gke-gcloud-auth-plugin``), run as kubectl runs it: ``args`` and ``env`` added, the request in
    ``$KUBERNETES_EXEC_INFO`` (with the cluster when ``provideClusterInfo``), interactive (the
    terminal's stdin, its stderr shown as it comes) when stdin is a terminal and ``interactiveMode``
    is not ``Never``. Its token is kept until ``expirationTimestamp`` (less ``_EXEC_EARLY``) and
    then fetched again; ``renew`` runs it again after a 401. Installed as the configuration's
    ``refresh_api_key_hook``, which the client calls before each request."""

    def __init__(self, spec: Mapping[str, Any], cluster: Mapping[str, Any], *, user: str) -> None:
        self.command = str(spec.get("command") or "")
        self.api_version = str(spec.get("apiVersion") or "")
        if not self.command:
            raise ConfigException(f'user "{user}": exec has no command')
        if self.api_version not in _EXEC_API_VERSIONS:
            raise ConfigException(
                f'user "{user}": exec apiVersion {self.api_version or "(none)"} is not one of '
                f"{', '.join(_EXEC_API_VERSIONS)}"
            )
        self.user = user
        self._spec = dict(spec)
        self._cluster = dict(cluster)
        self._lock = threading.Lock()
        self.status: dict[str, Any] = {}
        self.expiry: float | None = None
        """When the credential expires (``time.time()``), or None: kept until a 401."""
        self.runs = 0

    @property
    def token(self) -> str:
        return str(self.status.get("token") or "")

    def fetch(self) -> dict[str, Any]:
        """Run the plugin; its ``status`` (``token``, or ``clientCertificateData`` and ``clientKeyData``).
        Raises ``CredentialError`` saying why there is none."""
        interactive = self._interactive()
        request: dict[str, Any] = {"interactive": interactive}
        if self._spec.get("provideClusterInfo"):
            request["cluster"] = self._cluster_info()
        env = dict(os.environ)
        for item in self._spec.get("env") or []:
            env[str(item["name"])] = str(item["value"])
        env["KUBERNETES_EXEC_INFO"] = json.dumps(
            {"apiVersion": self.api_version, "kind": "ExecCredential", "spec": request}
        )
        argv = [self.command, *(str(a) for a in self._spec.get("args") or [])]
        self.runs += 1
        try:
            process = subprocess.run(
                argv,
                env=env,
                stdin=None if interactive else subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=None if interactive else subprocess.PIPE,
                text=True,
                check=False,
            )
        except FileNotFoundError:
            hint = str(self._spec.get("installHint") or "").strip()
            raise CredentialError(
                f'the credential plugin "{self.command}" of user "{self.user}" is not installed (not found on PATH). '
                + (hint or "Install it, or fix users[].user.exec.command in the kubeconfig")
            ) from None
        except OSError as e:
            raise CredentialError(
                f'the credential plugin "{self.command}" of user "{self.user}" cannot be run: {e}'
            ) from e
        stderr = (process.stderr or "").strip()
        if process.returncode != 0:
            raise CredentialError(
                f'the credential plugin "{self.command}" of user "{self.user}" failed (exit code '
                f"{process.returncode})" + (f": {stderr[-2000:]}" if stderr else "")
            )
        if stderr:
            print(stderr, file=sys.stderr)  # what kubectl shows too: a plugin's warnings
        self.status, self.expiry = self._parse(process.stdout)
        return self.status

    def _interactive(self) -> bool:
        mode = str(self._spec.get("interactiveMode") or "IfAvailable")
        terminal = sys.stdin is not None and sys.stdin.isatty()
        if mode == "Always" and not terminal:
            raise CredentialError(
                f'the credential plugin "{self.command}" of user "{self.user}" needs a terminal '
                "(interactiveMode: Always), and standard input is not one: run the command in a terminal"
            )
        return mode != "Never" and terminal

    def _cluster_info(self) -> dict[str, Any]:
        c = self._cluster
        info: dict[str, Any] = {"server": c.get("server")}
        for key in ("tls-server-name", "insecure-skip-tls-verify", "proxy-url", "disable-compression"):
            if key in c:
                info[key] = c[key]
        if c.get("certificate-authority-data"):
            info["certificate-authority-data"] = c["certificate-authority-data"]
        elif c.get("certificate-authority"):
            with open(c["certificate-authority"], "rb") as f:
                info["certificate-authority-data"] = base64.b64encode(f.read()).decode()
        for extension in c.get("extensions") or []:
            if isinstance(extension, dict) and extension.get("name") == "client.authentication.k8s.io/exec":
                info["config"] = extension.get("extension")
        return info

    def _parse(self, stdout: str) -> tuple[dict[str, Any], float | None]:
        what = f'the credential plugin "{self.command}" of user "{self.user}"'
        try:
            answer = json.loads(stdout)
        except ValueError as e:
            # Never quoted: what it printed may hold the token (a credential, then a line of its own).
            raise CredentialError(
                f"{what} printed no ExecCredential JSON on its standard output ({len(stdout)} characters; "
                f"{e}): run the plugin by hand to see what it prints"
            ) from None
        status = answer.get("status") if isinstance(answer, dict) else None
        if not isinstance(status, dict) or answer.get("apiVersion") != self.api_version:
            raise CredentialError(
                f"{what} answered no {self.api_version} ExecCredential with a status "
                f"(apiVersion {answer.get('apiVersion') if isinstance(answer, dict) else None})"
            )
        if not status.get("token") and not (status.get("clientCertificateData") and status.get("clientKeyData")):
            raise CredentialError(f"{what} answered neither a token nor a client certificate and key")
        expires = status.get("expirationTimestamp")
        if not expires:
            return status, None
        try:
            return status, datetime.fromisoformat(str(expires).replace("Z", "+00:00")).timestamp()
        except ValueError:
            raise CredentialError(f"{what} answered an expirationTimestamp that is no time: {expires!r}") from None

    def __call__(self, configuration: k8s_client.Configuration) -> None:
        """The ``refresh_api_key_hook``: the token, fetched again when it is about to expire."""
        with self._lock:
            if self.expiry is not None and time.time() >= self.expiry - _EXEC_EARLY:
                self.fetch()
            configuration.api_key["BearerToken"] = f"Bearer {self.token}"

    def renew(self) -> bool:
        """Run the plugin again (the server refused its token): whether it gave another token."""
        with self._lock:
            old = self.token
            self.fetch()
            return self.token != old


class TokenFile:
    """A kubeconfig user's ``tokenFile`` (a projected service-account token, rotated by the
    kubelet), read again as client-go reads it: once it is a minute old, and at once after a 401.
    The client library read it once, so a long-running controller kept an expired token."""

    PERIOD = 60.0

    def __init__(self, path: str) -> None:
        self.path = path
        self.token = ""
        self._lock = threading.Lock()
        self._read_at = 0.0
        self._read()

    def _read(self) -> None:
        with open(self.path) as f:
            token = f.read().strip()
        if token:  # an empty file (mid-rotation) keeps the last token
            self.token = token
        self._read_at = time.monotonic()

    def __call__(self, configuration: k8s_client.Configuration) -> None:
        """The ``refresh_api_key_hook``: the file's token, at most ``PERIOD`` seconds old."""
        with self._lock:
            if time.monotonic() - self._read_at >= self.PERIOD:
                try:
                    self._read()
                except OSError as e:
                    log.warning("cannot read the token file %s again, keeping its last token: %s", self.path, e)
            configuration.api_key["BearerToken"] = f"Bearer {self.token}"

    def renew(self) -> bool:
        """Read the file again (the server refused its token): whether it holds another token."""
        with self._lock:
            old = self.token
            try:
                self._read()
            except OSError:
                return False
            return self.token != old


def load_kubeconfig_dict(merged: dict[str, Any], context: str | None, configuration: k8s_client.Configuration) -> None:
    """Load ``merged`` (``read_kubeconfig``) into ``configuration`` for ``context`` (None: the
    current one). A user whose credentials come from a plugin (``exec``) gets them from
    ``ExecCredential`` — its failures are errors here, not a request sent without credentials —
    and one with a ``tokenFile`` from ``TokenFile``: either stays the configuration's hook for
    fresh tokens (``KubeClient`` renews it once after a 401)."""
    name = context or merged.get("current-context")
    found = next((c for c in merged.get("contexts") or [] if c.get("name") == name), None)
    ctx = (found or {}).get("context") or {}
    user_entry: dict[str, Any] | None = next(
        (u for u in merged.get("users") or [] if u.get("name") == ctx.get("user")), None
    )
    body = (user_entry or {}).get("user")
    credential: ExecCredential | TokenFile | None = None
    if (
        isinstance(body, dict)
        and isinstance(body.get("exec"), dict)
        and not any(body.get(k) for k in ("token", "tokenFile", "auth-provider"))
    ):
        cluster_entry = next((c for c in merged.get("clusters") or [] if c.get("name") == ctx.get("cluster")), None)
        credential = ExecCredential(body["exec"], (cluster_entry or {}).get("cluster") or {}, user=str(ctx["user"]))
        status = credential.fetch()
        replaced = {k: v for k, v in body.items() if k != "exec"}
        if credential.token:
            replaced["token"] = credential.token
        else:
            for field, key in (
                ("client-certificate-data", "clientCertificateData"),
                ("client-key-data", "clientKeyData"),
            ):
                replaced[field] = base64.b64encode(str(status[key]).encode()).decode()
        users = [{"name": ctx["user"], "user": replaced} if u is user_entry else u for u in merged["users"]]
        merged = {**merged, "users": users}
    elif isinstance(body, dict) and body.get("tokenFile") and not body.get("token") and not body.get("auth-provider"):
        credential = TokenFile(str(body["tokenFile"]))
    k8s_config.load_kube_config_from_dict(
        merged, context=name, client_configuration=configuration, persist_config=False
    )
    _check_proxy(configuration)
    if credential is not None and credential.token:
        # The client types the hook as None; it calls any callable set there before each request.
        configuration.refresh_api_key_hook = credential  # type: ignore[assignment]


_SOCKS = ("socks4", "socks4a", "socks5", "socks5h")


def _check_proxy(configuration: k8s_client.Configuration) -> None:
    """A SOCKS proxy (``proxy-url: socks5://…``, as for a bastion's ``ssh -D``, or $HTTPS_PROXY)
    needs PySocks, which the client imports only when it builds its connection pool: without it,
    an error that says so here rather than a traceback later."""
    proxy = str(configuration.proxy or "")
    if proxy.partition("://")[0].lower() in _SOCKS and importlib.util.find_spec("socks") is None:
        raise ConfigException(
            f"the proxy {proxy} (the cluster's proxy-url, or $HTTPS_PROXY) is a SOCKS proxy, which needs the "
            "PySocks package: pip install PySocks, or use an HTTP proxy"
        )


def load_config(kubeconfig: str | None = None, *, context: str | None = None) -> k8s_client.Configuration:
    """The cluster to talk to: ``kubeconfig`` (``--kubeconfig``), else $KUBECONFIG (files joined by
    ``:``, merged as kubectl merges them), else the pod's service account (in-cluster), else
    ~/.kube/config — the order controller-runtime uses."""
    configuration = k8s_client.Configuration()
    path = kubeconfig or os.environ.get("KUBECONFIG")
    try:
        if not path and os.environ.get("KUBERNETES_SERVICE_HOST"):
            k8s_config.load_incluster_config(client_configuration=configuration)
            return configuration
        if not path:
            path = os.path.expanduser("~/.kube/config")
            if not os.path.exists(path):
                raise ConfigError(
                    "no cluster configuration: pass --kubeconfig PATH or set KUBECONFIG, or run the "
                    "controller in a pod with a service account"
                )
        load_kubeconfig_dict(read_kubeconfig(path), context, configuration)
    except (
        ConfigException,
        CredentialError,
        OSError,
        ValueError,
        yaml.YAMLError,
        TypeError,
        AttributeError,
        KeyError,
    ) as e:
        # YAMLError: a file that is no YAML; TypeError/AttributeError/KeyError: YAML that is no
        # kubeconfig, which the client reads without checking its shape.
        where = path or "the in-cluster service account"
        raise ConfigError(f"cannot load the cluster configuration from {where}: {' '.join(str(e).split())}") from e
    return configuration
