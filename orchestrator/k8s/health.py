"""One HTTP server for the kubelet's probes and Prometheus: /healthz, /readyz, /metrics.

- ``/healthz`` (liveness): 200 while every check passes — the process answers and its informer,
  worker and election threads are alive. A failure makes the kubelet restart the container.
- ``/readyz`` (readiness): 200 once the informers have synced. A replica that is not the leader
  is ready too (ready but idle: it only waits to take over).
- ``/metrics``: the Prometheus text format of ``ControllerMetrics``.

The server runs on its own threads (one per request); the checks only read flags, so a probe never
waits for a reconcile or an API call.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from orchestrator.k8s.metrics import CONTENT_TYPE_LATEST, ControllerMetrics

log = logging.getLogger(__name__)

Check = Callable[[], "str | None"]
"""A probe check: None when fine, else what is wrong (shown in the response body)."""


class HealthServer:
    """Serves the three endpoints on ``address:port`` (port 0: any free port; see ``port``)."""

    def __init__(
        self,
        metrics: ControllerMetrics,
        *,
        port: int = 8080,
        address: str = "",
        liveness: list[Check] | None = None,
        readiness: list[Check] | None = None,
    ) -> None:
        self._metrics = metrics
        self._liveness = list(liveness or [])
        self._readiness = list(readiness or [])
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                path = self.path.split("?", 1)[0]
                if path == "/metrics":
                    self._send(200, server._metrics.exposition(), CONTENT_TYPE_LATEST)
                elif path == "/healthz":
                    self._probe(server._liveness)
                elif path == "/readyz":
                    self._probe(server._readiness)
                else:
                    self._send(404, b"not found: try /healthz, /readyz or /metrics\n", "text/plain")

            def _probe(self, checks: list[Check]) -> None:
                failures = [f for f in (_run(c) for c in checks) if f]
                if failures:
                    self._send(503, ("\n".join(failures) + "\n").encode(), "text/plain")
                else:
                    self._send(200, b"ok\n", "text/plain")

            def _send(self, code: int, body: bytes, content_type: str) -> None:
                self.send_response(code)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:
                log.debug("%s %s", self.address_string(), format % args)

        self._httpd = ThreadingHTTPServer((address, port), Handler)
        self._httpd.daemon_threads = True
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return int(self._httpd.server_address[1])

    def add_liveness(self, check: Check) -> None:
        self._liveness.append(check)

    def add_readiness(self, check: Check) -> None:
        self._readiness.append(check)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="http", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()


def _run(check: Check) -> str | None:
    try:
        return check()
    except Exception as e:
        return f"check failed: {e}"
