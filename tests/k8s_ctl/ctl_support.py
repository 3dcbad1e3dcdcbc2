"""Support for the controller machinery's tests (``conftest.py`` makes the fixture).

The tests run against the project's test API server (tests/k8s/cluster), spoken to over HTTP by
the real ``kubernetes`` client, exactly as the controller speaks to a real one.

``test_api`` starts one in this process on a loopback port, with two users: the controller
(token ``controller-token``) and an administrator for the tests' own setup. The server's test hooks
(expire the watch history, drop watches, inject faults, read the audit log) are driven over HTTP
(``/_test/…``), so they work the same for controller replicas running as subprocesses.
"""

from __future__ import annotations

import json
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from orchestrator.k8s.api import KubeClient, NotFound, Resource, RetryPolicy  # noqa: E402
from orchestrator.k8s.kubeconfig import load_config  # noqa: E402

CRDS = Resource("apiextensions.k8s.io", "v1", "customresourcedefinitions", "CustomResourceDefinition", namespaced=False)
NAMESPACES = Resource("", "v1", "namespaces", "Namespace", namespaced=False)

CONTROLLER_TOKEN = "controller-token"
CONTROLLER_USER = "system:serviceaccount:spotjob:spotjob-controller"
ADMIN_TOKEN = "admin-token"

# Until the model work generates the real CRD, a SpotJob is any object: these tests exercise the
# machinery (watches, keys, Events), not the schema.
SPOTJOB_CRD: dict[str, Any] = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": "spotjobs.spotjob.dev"},
    "spec": {
        "group": "spotjob.dev",
        "scope": "Namespaced",
        "names": {"plural": "spotjobs", "singular": "spotjob", "kind": "SpotJob", "shortNames": ["sj"]},
        "versions": [
            {
                "name": "v1alpha1",
                "served": True,
                "storage": True,
                "subresources": {"status": {}},
                "schema": {
                    "openAPIV3Schema": {
                        "type": "object",
                        "properties": {
                            "spec": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
                            "status": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
                        },
                    }
                },
            }
        ],
    },
}


def wait_for(condition: Callable[[], Any], timeout: float = 30.0, what: str = "condition") -> Any:
    """Poll until ``condition()`` is truthy (generous timeouts; the outcome is what is asserted)."""
    end = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def kubeconfig_file(path: Path, url: str, token: str) -> Path:
    path.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "test", "cluster": {"server": url}}],
                "users": [{"name": "user", "user": {"token": token}}],
                "contexts": [{"name": "test", "context": {"cluster": "test", "user": "user"}}],
                "current-context": "test",
            }
        )
    )
    return path


@dataclass
class TestApi:
    url: str
    kubeconfig: Path
    """The controller's credentials."""
    admin_kubeconfig: Path
    admin: KubeClient
    front: Any

    __test__ = False  # not a test class

    def client(self, **kw: Any) -> KubeClient:
        """A controller client (restricted to PERMISSIONS) whose retries do not wait long."""
        kw.setdefault("retry", RetryPolicy(attempts=4, initial=0.01, maximum=0.05))
        return KubeClient(load_config(str(self.kubeconfig)), **kw)

    def hook(self, method: str, name: str, body: dict[str, Any] | None = None, query: str = "") -> Any:
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(
            f"{self.url}/_test/{name}{'?' + query if query else ''}",
            data=data,
            method=method,
            headers={"Authorization": f"Bearer {ADMIN_TOKEN}", "Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=10) as response:
            return json.loads(response.read() or b"{}")

    def fault(self, **fault: Any) -> None:
        self.hook("POST", "faults", fault)

    def clear_faults(self) -> None:
        self.hook("DELETE", "faults")

    def expire_history(self) -> None:
        self.hook("POST", "expire-history")

    def drop_watches(self, resource: str = "") -> int:
        return int(self.hook("POST", "drop-watches", query=f"resource={resource}" if resource else "")["dropped"])

    def open_watches(self, resource: str = "") -> int:
        """How many watches (of ``resource``, a plural) the server has open: registered, so that a
        ``drop_watches`` now cuts them. A watch whose request is still on its way is not counted."""
        return int(self.hook("GET", "watches", query=f"resource={resource}" if resource else "")["open"])

    def audit(self, since: int = 0) -> list[dict[str, Any]]:
        return list(self.hook("GET", "audit", query=f"since={since}")["items"])

    def install_spotjob_crd(self) -> None:
        self.admin.create(CRDS, SPOTJOB_CRD)

        def served() -> bool:
            try:
                self.admin.list(Resource("spotjob.dev", "v1alpha1", "spotjobs", "SpotJob", True), "default")
            except NotFound:
                return False
            return True

        wait_for(served, what="the SpotJob CRD to be served")

    def namespace(self, name: str) -> None:
        self.admin.create(NAMESPACES, {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})


SPOTJOB_CRD_FILE = REPO / "charts" / "spotjob" / "files" / "crds" / "spotjob.dev_spotjobs.yaml"


def install_spotjob_crd(
    test_api: TestApi,
    *,
    without_status: tuple[str, ...] = (),
    without_spec_rules: tuple[str, ...] = (),
    without_name_rule: bool = False,
) -> None:
    """Create the chart's SpotJob CRD in the test API server and wait until SpotJobs are served;
    ``without_status``: status fields to leave out (an older CRD, whose server drops them);
    ``without_spec_rules``: CEL rules of ``spec`` to leave out (an older CRD, or a server that
    does not evaluate CEL), by their rule text; ``without_name_rule``: leave out the rule on
    ``metadata.name`` (a CRD older than it)."""
    import yaml

    from orchestrator.k8s.api import SPOTJOBS

    crd = yaml.safe_load(SPOTJOB_CRD_FILE.read_text())
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    for field in without_status:
        del schema["properties"]["status"]["properties"][field]
    spec = schema["properties"]["spec"]
    kept = [r for r in spec["x-kubernetes-validations"] if r["rule"] not in without_spec_rules]
    assert len(kept) == len(spec["x-kubernetes-validations"]) - len(without_spec_rules), "no such rule"
    spec["x-kubernetes-validations"] = kept
    if without_name_rule:
        rules = schema["x-kubernetes-validations"]
        schema["x-kubernetes-validations"] = [r for r in rules if "metadata.name" not in r["rule"]]
        assert len(schema["x-kubernetes-validations"]) == len(rules) - 1, "no name rule"
    test_api.admin.create(CRDS, crd)

    def served() -> bool:
        try:
            test_api.admin.list(SPOTJOBS, "default")
        except Exception:
            return False
        return True

    wait_for(served, what="the SpotJob CRD")
