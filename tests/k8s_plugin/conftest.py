"""Fixtures of the ``kubectl spotjob`` tests: the real kubectl binary runs the plugin against the test cluster.

- the test cluster's fixtures (``k8s_cluster``, ``cluster``, ``namespace``, ``test_apiserver_only``),
  imported from tests/k8s/fixtures.py: one cluster for this folder's session;
- ``spotjob_crd`` (session): the chart's CRD, installed (see ``plugin_support.install_crd``);
- ``user_kubeconfig`` (session): a kubeconfig of a person of its own (``USER``), so the audit log
  tells the plugin's requests apart from the test's own;
- ``kubectl_spotjob``: ``kubectl_spotjob("status", "-n", ns)`` runs ``kubectl spotjob …`` — the
  kubectl binary on PATH, which finds ``kubectl-spotjob`` in the venv's bin — and returns the
  completed process (exit code, stdout, stderr);
- ``spotjob``: the same call and answer, the plugin's ``main`` run in the test's own process (for
  what a command prints given a cluster state, not what is about the process).
"""

from __future__ import annotations

import logging
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from plugin_support import USER, install_crd, run_kubectl_spotjob

from tests.k8s.cluster import TestCluster
from tests.k8s.fixtures import cluster, k8s_cluster, namespace, test_apiserver_only

__all__ = ["cluster", "k8s_cluster", "namespace", "test_apiserver_only"]

KubectlSpotjob = Callable[..., subprocess.CompletedProcess[str]]


@pytest.fixture(scope="session")
def spotjob_crd(k8s_cluster: TestCluster) -> None:
    install_crd(k8s_cluster)


@pytest.fixture(scope="session")
def user_kubeconfig(k8s_cluster: TestCluster) -> str:
    if not k8s_cluster.on_test_server:
        return k8s_cluster.kubeconfig
    return k8s_cluster.kubeconfig_for(USER)


@pytest.fixture
def kubectl_spotjob(spotjob_crd: None, user_kubeconfig: str, cluster: TestCluster) -> KubectlSpotjob:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not on PATH")

    def run(
        *args: str,
        kubeconfig: str | None = None,
        env: dict[str, str] | None = None,
        timeout: float = 120,
        stdout: int | None = None,
    ) -> subprocess.CompletedProcess[str]:
        return run_kubectl_spotjob(
            cluster, kubeconfig or user_kubeconfig, *args, env=env, timeout=timeout, stdout=stdout
        )

    return run


@pytest.fixture
def spotjob(
    spotjob_crd: None,
    user_kubeconfig: str,
    cluster: TestCluster,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> KubectlSpotjob:
    """``kubectl spotjob ARGS`` as ``kubectl_spotjob`` runs it, but the plugin's ``main`` in this
    process: the same parsing, the same requests to the test API server under the user's name
    (the RBAC test reads them) and the same printing, without starting kubectl and a Python that
    imports the kubernetes client (about 0.8 CPU-s a command). For what a command prints given a
    cluster state; what is about the process (a pipe's reader gone, an environment variable of
    this machine, kubectl finding the plugin) stays a ``kubectl_spotjob`` process."""
    from orchestrator import kubectl_plugin
    from orchestrator.cli_ckpt import NOISY_LOGGERS

    noisy = ("", *NOISY_LOGGERS, "orchestrator.k8s.api")

    def run(
        *args: str, kubeconfig: str | None = None, env: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        for name, value in {**cluster.env(), "KUBECONFIG": kubeconfig or user_kubeconfig, **(env or {})}.items():
            monkeypatch.setenv(name, value)
        capsys.readouterr()
        # main sets the cloud clients' log levels (and may set up the root logger) for the process
        # it owns; here the process is the test's, so they are put back as they were.
        levels = {name: logging.getLogger(name).level for name in noisy}
        handlers = list(logging.getLogger().handlers)
        try:
            code: int | str | None = kubectl_plugin.main(list(args))
        except SystemExit as e:
            code = e.code
        finally:
            for name, level in levels.items():
                logging.getLogger(name).setLevel(level)
            logging.getLogger().handlers[:] = handlers
        out, err = capsys.readouterr()
        return subprocess.CompletedProcess(["kubectl", "spotjob", *args], code, out, err)

    return run
