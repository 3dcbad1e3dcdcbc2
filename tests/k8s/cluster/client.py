"""A small JSON client for the kubelet and the test hooks, configured from a kubeconfig.

The kubelet is ours on every cluster (test API server, kind, k3s), so it reaches the API only
through a kubeconfig, like a real kubelet; the kubeconfig is read by the ``kubernetes`` package
(tokens, client certificates, CA) and requests go through urllib3 without model classes, which
keeps a thousand test nodes cheap.
"""

from __future__ import annotations

import json
import urllib.parse
from collections.abc import Iterator
from typing import Any

import urllib3


class ApiCallError(Exception):
    def __init__(self, status: int, body: dict[str, Any]) -> None:
        super().__init__(f"{status}: {body.get('reason', '')}: {body.get('message', body)}")
        self.status = status
        self.body = body
        self.reason = str(body.get("reason", ""))


class RestClient:
    def __init__(self, kubeconfig: str, context: str | None = None, timeout: float = 30.0) -> None:
        from kubernetes import client, config

        cfg = client.Configuration()
        config.load_kube_config(config_file=kubeconfig, context=context, client_configuration=cfg, persist_config=False)
        self.host = cfg.host.rstrip("/")
        self.headers = {"Accept": "application/json", "User-Agent": "spotjob-test-kubelet"}
        settings: Any = cfg.auth_settings()
        for setting in settings.values():
            if setting.get("in") == "header" and setting.get("value"):
                self.headers[setting["key"]] = setting["value"]
        kwargs: dict[str, Any] = {
            # A pod worker thread per pod reports at once when many pods start: a connection the
            # pool cannot keep is closed, and the next request pays a TLS handshake on both sides.
            "maxsize": 128,
            "block": False,
            "retries": False,
            "timeout": urllib3.Timeout(connect=5, read=timeout),
        }
        if self.host.startswith("https"):
            kwargs["cert_reqs"] = "CERT_REQUIRED" if cfg.verify_ssl else "CERT_NONE"
            if cfg.ssl_ca_cert:
                kwargs["ca_certs"] = cfg.ssl_ca_cert
            if cfg.cert_file:
                kwargs["cert_file"] = cfg.cert_file
                kwargs["key_file"] = cfg.key_file
        self.pool = urllib3.PoolManager(**kwargs)

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        query: dict[str, Any] | None = None,
        content_type: str = "application/json",
        timeout: float | None = None,
    ) -> Any:
        url = self.host + path
        if query:
            url += "?" + urllib.parse.urlencode({k: v for k, v in query.items() if v is not None})
        headers = dict(self.headers)
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = content_type
        kwargs: dict[str, Any] = {}
        if timeout is not None:
            kwargs["timeout"] = urllib3.Timeout(connect=5, read=timeout)
        r = self.pool.request(method, url, body=data, headers=headers, **kwargs)
        payload = json.loads(r.data) if r.data else {}
        if r.status >= 400:
            raise ApiCallError(r.status, payload if isinstance(payload, dict) else {"message": str(payload)})
        return payload

    def get(self, path: str, **query: Any) -> Any:
        return self.request("GET", path, query=query or None)

    def watch(
        self, path: str, resource_version: str, timeout_seconds: int = 60, **query: Any
    ) -> Iterator[dict[str, Any]]:
        """Stream watch events; ends when the server ends the watch."""
        q = {
            "watch": "true",
            "resourceVersion": resource_version,
            "allowWatchBookmarks": "true",
            "timeoutSeconds": timeout_seconds,
            **query,
        }
        url = self.host + path + "?" + urllib.parse.urlencode(q)
        r = self.pool.request(
            "GET",
            url,
            headers=self.headers,
            preload_content=False,
            timeout=urllib3.Timeout(connect=5, read=timeout_seconds + 30),
        )
        try:
            if r.status >= 400:
                raise ApiCallError(r.status, json.loads(r.read() or b"{}"))
            buf = b""
            for chunk in r.stream(65536, decode_content=True):
                buf += chunk
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    if line.strip():
                        yield json.loads(line)
        finally:
            r.release_conn()
