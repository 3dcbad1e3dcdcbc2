"""Fixtures of the ``kubectl spotjob`` tests: the real kubectl binary runs the plugin against the test cluster.

- the test cluster's fixtures (``k8s_cluster``, ``cluster``, ``namespace``, ``test_apiserver_only``),
  imported from tests/k8s/fixtures.py: one cluster for this folder's session;
- ``spotjob_crd`` (session): the chart's CRD, installed (see ``plugin_support.install_crd``);
- ``user_kubeconfig`` (session): a kubeconfig of a person of its own (``USER``), so the audit log
  tells the plugin's requests apart from the test's own;
- ``kubectl_spotjob``: ``kubectl_spotjob("status", "-n", ns)`` runs ``kubectl spotjob …`` — the
  kubectl binary on PATH, which finds ``kubectl-spotjob`` in the venv's bin — and returns the
  completed process (exit code, stdout, stderr).
"""

from __future__ import annotations

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
