"""README "Upgrading": ``helm upgrade --reuse-values`` from a chart older than some of today's values.

With ``--reuse-values`` helm renders the new templates over the values of the release it upgrades,
the old chart's defaults included, and not over the new chart's ``values.yaml``: a value added since
is absent, not its default. The real helm runs the upgrade (``--dry-run=client``, the release held
by helm's memory driver, the test API server answering helm's version query); the controller's own
option parser reads the Deployment's args it rendered. Not modelled: applying the objects."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

from orchestrator.k8s.main import parse_options

from .cluster import TestCluster

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "infra"))
from infra_support import CHART, NAMESPACE, RELEASE, helm_binary  # noqa: E402

ADDED_SINCE_2026_12_01 = (("logFormat",), ("agentLauncher",), ("metrics", "prometheusRule"))
"""The chart values a release installed from the chart of 2026-12-01 (afac6e2) does not have: the
first two are absent from 2026-12-03's too, ``metrics.prometheusRule`` (2026-12-04) from every chart
before 070850b, 2026-12-03's (1e61ff8) included."""


def older_chart(root: Path) -> Path:
    """Today's chart without the values added since 2026-12-01 (its templates are never rendered)."""
    chart = root / "older-chart"
    shutil.copytree(CHART, chart)
    values = yaml.safe_load((chart / "values.yaml").read_text())
    for *parents, key in ADDED_SINCE_2026_12_01:
        node = values
        for parent in parents:
            node = node[parent]
        del node[key]
    (chart / "values.yaml").write_text(yaml.safe_dump(values))
    return chart


def helm(env: dict[str, str], *args: str) -> dict[str, Any]:
    proc = subprocess.run(
        [helm_binary(), *args, "--namespace", NAMESPACE, "--dry-run=client", "-o", "yaml"],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    return dict(yaml.safe_load(proc.stdout))


def test_helm_upgrade_reuse_values_from_an_older_chart_renders_flags_the_controller_accepts(
    cluster: TestCluster, tmp_path: Path
) -> None:
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(tmp_path / "home"),
        "HELM_CACHE_HOME": str(tmp_path / "home" / "cache"),
        "HELM_CONFIG_HOME": str(tmp_path / "home" / "config"),
        "HELM_DATA_HOME": str(tmp_path / "home" / "data"),
        "HELM_DRIVER": "memory",
        "HELM_MEMORY_DRIVER_DATA": os.devnull,
        "KUBECONFIG": cluster.kubeconfig,
    }
    installed = helm(env, "install", RELEASE, str(older_chart(tmp_path)))
    installed["info"]["status"] = "deployed"
    releases = tmp_path / "releases.yaml"
    releases.write_text(yaml.safe_dump([installed]))

    upgraded = helm({**env, "HELM_MEMORY_DRIVER_DATA": str(releases)}, "upgrade", RELEASE, str(CHART), "--reuse-values")
    assert upgraded["version"] == 2  # rendered: templates reading metrics.prometheusRule once failed on its absence
    assert "PrometheusRule" not in [doc["kind"] for doc in yaml.safe_load_all(upgraded["manifest"]) if doc]
    deployment = next(doc for doc in yaml.safe_load_all(upgraded["manifest"]) if doc and doc["kind"] == "Deployment")
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert not [a for a in args if a.endswith("=")], args  # the controller exits 2 on "--agent-launcher="
    parsed, options = parse_options(args)
    assert options.agent_launcher == "direct"  # the controller's default is the chart's
    assert parsed.log_format is None  # the controller's own default: text
