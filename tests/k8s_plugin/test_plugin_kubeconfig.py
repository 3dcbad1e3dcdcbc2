"""How ``kubectl spotjob`` (and the controller, run outside a cluster) read a messy kubeconfig: as kubectl does.

The tests without a cluster only load the configuration and look at where it points (nothing is
contacted); the others run the plugin through the real kubectl binary against the test API server.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from orchestrator.k8s.api import load_config
from orchestrator.k8s.plugin_client import load_user_context


def kubeconfig(
    path: Path,
    contexts: dict[str, tuple[str, str]],
    current: str | None = None,
    clusters: dict[str, dict[str, Any]] | None = None,
    users: dict[str, dict[str, Any]] | None = None,
) -> str:
    """A kubeconfig file: ``contexts`` maps a context to its (cluster, user)."""
    doc: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": n, "cluster": c} for n, c in (clusters or {}).items()],
        "users": [{"name": n, "user": u} for n, u in (users or {}).items()],
        "contexts": [{"name": n, "context": {"cluster": c, "user": u}} for n, (c, u) in contexts.items()],
    }
    if current is not None:
        doc["current-context"] = current
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(doc))
    return str(path)


def test_in_a_list_of_kubeconfigs_the_first_file_to_set_current_context_wins(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The client library let the last file's current-context win: with KUBECONFIG=mine:team the
    # plugin and the controller talked to another cluster than kubectl did.
    mine = kubeconfig(
        tmp_path / "mine",
        {"mine": ("c1", "u")},
        "mine",
        clusters={"c1": {"server": "https://one.example:6443"}},
        users={"u": {"token": "t"}},
    )
    team = kubeconfig(
        tmp_path / "team",
        {"team": ("c2", "u"), "mine": ("c2", "u")},
        "team",
        clusters={"c2": {"server": "https://two.example:6443"}, "c1": {"server": "https://other.example"}},
        users={"u": {"token": "x"}},
    )
    monkeypatch.setenv("KUBECONFIG", f"{mine}:{team}")

    user = load_user_context()
    controller = load_config()

    assert (user.context, user.server) == ("mine", "https://one.example:6443")
    assert controller.host == "https://one.example:6443"
    assert load_user_context(context="team").server == "https://two.example:6443"


def test_empty_entries_missing_files_and_an_empty_file_in_kubeconfig_are_skipped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # kubectl reads an empty file (`touch ~/.kube/config`) as an empty config; the client library
    # refused the whole list ("file is empty").
    (tmp_path / "empty").write_text("")
    real = kubeconfig(
        tmp_path / "real", {"c": ("c", "u")}, "c", clusters={"c": {"server": "https://x.example"}}, users={"u": {}}
    )
    monkeypatch.setenv("KUBECONFIG", f":{tmp_path / 'empty'}::{tmp_path / 'missing'}:{real}:")

    assert load_user_context().server == "https://x.example"
    assert load_config().host == "https://x.example"


def test_relative_file_names_are_read_against_the_folder_of_the_file_that_holds_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The cluster (and its CA) in one file, the user (and its client certificate) in another: the
    # client library read the user's files against the cluster's folder and found none.
    (tmp_path / "clusters").mkdir()
    (tmp_path / "clusters" / "ca.crt").write_text("CA")
    (tmp_path / "users").mkdir()
    for name in ("me.crt", "me.key", "token"):
        (tmp_path / "users" / name).write_text("x")
    clusters = kubeconfig(
        tmp_path / "clusters" / "config",
        {},
        clusters={"prod": {"server": "https://prod.example", "certificate-authority": "ca.crt"}},
    )
    users = kubeconfig(
        tmp_path / "users" / "config",
        {"prod": ("prod", "me"), "prod-token": ("prod", "bot")},
        "prod",
        users={"me": {"client-certificate": "me.crt", "client-key": "./me.key"}, "bot": {"tokenFile": "token"}},
    )
    monkeypatch.setenv("KUBECONFIG", f"{users}:{clusters}")
    monkeypatch.chdir(tmp_path)

    configuration = load_user_context().configuration
    by_token = load_user_context(context="prod-token").configuration

    assert configuration.ssl_ca_cert == str(tmp_path / "clusters" / "ca.crt")
    assert configuration.cert_file == str(tmp_path / "users" / "me.crt")
    assert configuration.key_file == str(tmp_path / "users" / "me.key")
    assert by_token.api_key["BearerToken"] == "Bearer x"
    assert load_config(context="prod").cert_file == str(tmp_path / "users" / "me.crt")
