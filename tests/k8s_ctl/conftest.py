"""Fixtures of the controller machinery's tests; see ``ctl_support`` for what the test API server is."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from ctl_support import ADMIN_TOKEN, CONTROLLER_TOKEN, CONTROLLER_USER, TestApi, kubeconfig_file

from orchestrator.k8s.api import KubeClient
from orchestrator.k8s.kubeconfig import load_config


@pytest.fixture
def test_api(tmp_path: Path) -> Iterator[TestApi]:
    cluster = pytest.importorskip(
        "tests.k8s.cluster.http", reason="the test API server (tests/k8s/cluster) is not on this branch yet"
    )
    from tests.k8s.cluster.apiserver import ApiServer

    api = ApiServer(validate="off", bookmark_interval=0.5)
    front = cluster.HttpFront(
        api,
        {CONTROLLER_TOKEN: cluster.User(CONTROLLER_USER)},
        ADMIN_TOKEN,
    )
    front.add_user("admin", ADMIN_TOKEN, ("system:masters",))
    url = front.start()
    controller = kubeconfig_file(tmp_path / "controller.kubeconfig", url, CONTROLLER_TOKEN)
    admin_path = kubeconfig_file(tmp_path / "admin.kubeconfig", url, ADMIN_TOKEN)
    admin = KubeClient(load_config(str(admin_path)), restricted=False)
    yield TestApi(url, controller, admin_path, admin, front)
    admin.close()
    front.stop()
