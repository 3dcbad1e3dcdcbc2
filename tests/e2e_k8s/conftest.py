"""Fixtures of the controller's end-to-end tests (helpers: ``e2e_support.py``).

- the test cluster's fixtures (``k8s_cluster``, ``cluster``, ``namespace``, ``test_apiserver_only``),
  imported from tests/k8s/fixtures.py: one cluster for this folder's whole session;
- ``spotjob_crd`` (session): the CRD the chart ships (charts/spotjob/files/crds), installed;
- ``controller_kubeconfig`` (session): the controller's own identity (``CONTROLLER_USER``), so the
  audit log tells its requests apart (the RBAC drift test reads them);
- ``token_key`` (session): an agent-token key file every controller replica shares;
- ``start_controller``: ``start_controller(namespace, *extra_flags)`` starts a real
  ``spotjob-controller`` serving that namespace (stopped after the test; its log is printed
  when the test fails);
- ``uninterrupted`` (session): the job run once with plain torchrun, the dump every preempted run
  must end bit-identical to.
"""

from __future__ import annotations

import secrets
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from e2e_support import (
    CONTROLLER_LABELS,
    CONTROLLER_NAMESPACE,
    CONTROLLER_USER,
    Controller,
    install_crd,
)
from local_run_support import uninterrupted_dump

from tests.k8s.cluster import TestCluster
from tests.k8s.fixtures import cluster, k8s_cluster, namespace, test_apiserver_only

__all__ = ["cluster", "k8s_cluster", "namespace", "test_apiserver_only"]


@pytest.fixture(scope="session")
def spotjob_crd(k8s_cluster: TestCluster) -> None:
    install_crd(k8s_cluster)


@pytest.fixture(scope="session")
def controller_kubeconfig(k8s_cluster: TestCluster) -> str:
    if not k8s_cluster.on_test_server:
        return k8s_cluster.kubeconfig  # a real cluster: the caller's own credentials
    return k8s_cluster.kubeconfig_for(CONTROLLER_USER)


@pytest.fixture(scope="session")
def token_key(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("controller") / "agent-token-key"
    path.write_text(secrets.token_urlsafe(48))
    path.chmod(0o600)
    return path


@pytest.fixture
def start_controller(
    spotjob_crd: None,
    controller_kubeconfig: str,
    token_key: Path,
    tmp_path: Path,
    request: pytest.FixtureRequest,
) -> Iterator[Callable[..., Controller]]:
    started: list[Controller] = []

    def start(namespace: str, *extra: str, leader_elect: bool = False, env: dict[str, str] | None = None) -> Controller:
        args = [
            f"--namespace={namespace}",
            "--http-port=0",
            "--log-level=debug",
            "--node-lost-grace-seconds=3",
            "--network-policy",
            f"--controller-pod-labels={CONTROLLER_LABELS}",
            f"--controller-namespace={CONTROLLER_NAMESPACE}",
            f"--agent-token-key-file={token_key}",
        ]
        if leader_elect:
            # Short enough that a killed leader is replaced within seconds, long enough that a
            # leader whose renewals wait behind a busy test server (2 loaded cores) keeps its
            # lease: with a 3 s renew deadline, one stalled renewal in a full run on a loaded machine
            # made the only leader give up, and the job waited for a controller that never came.
            args += [
                "--leader-elect",
                f"--lease-namespace={namespace}",
                "--lease-name=spotjob-controller",
                "--leader-elect-lease-duration=8",
                "--leader-elect-renew-deadline=6",
                "--leader-elect-retry-period=0.5",
            ]
        else:
            args.append("--no-leader-elect")
        controller = Controller(
            controller_kubeconfig, tmp_path / f"controller-{len(started)}.log", [*args, *extra], env=dict(env or {})
        ).start()
        started.append(controller)
        return controller

    yield start
    for c in started:
        c.stop()
    report = getattr(request.node, "rep_call", None)
    if report is not None and report.failed:
        for i, c in enumerate(started):
            sys.stderr.write(f"\n----- controller {i} log (tail) -----\n{c.log()[-20000:]}\n")


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()  # type: ignore[attr-defined]
    setattr(item, f"rep_{report.when}", report)


@pytest.fixture(scope="session")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The dump prefix of the job run start to finish with plain torchrun (no spotjob, no notices),
    shared with the other suite and the other workers of this session."""
    return uninterrupted_dump(tmp_path_factory)
