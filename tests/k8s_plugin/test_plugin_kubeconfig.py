"""How ``kubectl spotjob`` (and the controller, run outside a cluster) read a messy kubeconfig: as kubectl does.

The tests without a cluster only load the configuration and look at where it points (nothing is
contacted); the others run the plugin against the test API server, most of them its ``main`` in the
test's process (the ``spotjob`` fixture): what they check is what a command makes of a kubeconfig
(the credential plugins it starts, the entries it picks); the TLS failures run through kubectl.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from orchestrator.k8s.kubeconfig import ConfigError, load_config
from orchestrator.k8s.plugin_client import load_user_context
from tests.k8s.cluster import TestCluster


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


# ----------------------------------------------------------------------------------------------
# Credential plugins (users[].user.exec), as EKS and GKE write them: small scripts stand in.

Run = Callable[..., subprocess.CompletedProcess[str]]


def exec_kubeconfig(path: Path, user_kubeconfig: str, exec_spec: dict[str, Any]) -> str:
    """The test cluster's kubeconfig (its server and CA) with a user whose credentials come from ``exec_spec``."""
    doc = yaml.safe_load(Path(user_kubeconfig).read_text())
    doc["users"] = [{"name": "sso", "user": {"exec": exec_spec}}]
    doc["contexts"][0]["context"]["user"] = "sso"
    path.write_text(yaml.safe_dump(doc))
    return str(path)


def script(path: Path, body: str) -> str:
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)
    return str(path)


def credential(token: str, api_version: str = "client.authentication.k8s.io/v1", **status: str) -> str:
    return json.dumps({"apiVersion": api_version, "kind": "ExecCredential", "status": {"token": token, **status}})


@pytest.mark.parametrize("api_version", ["client.authentication.k8s.io/v1", "client.authentication.k8s.io/v1beta1"])
def test_a_credential_plugin_gets_its_args_env_and_cluster_and_its_token_is_used(
    cluster: TestCluster, namespace: str, spotjob: Run, user_kubeconfig: str, tmp_path: Path, api_version: str
) -> None:
    """Pins what already worked (the client library ran the plugin), but for the cluster handed
    to it, which is now kubectl's: the CA as ``certificate-authority-data``."""
    token = cluster.add_user("sso@example.com")
    seen = tmp_path / "seen"
    plugin = script(
        tmp_path / "get-token",
        f'echo "$*" > {seen}.args; echo "$REGION" > {seen}.env; echo "$KUBERNETES_EXEC_INFO" > {seen}.info\n'
        f"echo '{credential(token, api_version, expirationTimestamp='2099-01-01T00:00:00Z')}'\n",
    )
    spec = {
        "apiVersion": api_version,
        "command": plugin,
        "args": ["eks", "get-token", "--cluster-name", "ml"],
        "env": [{"name": "REGION", "value": "eu-west-1"}],
        "interactiveMode": "Never",
        "provideClusterInfo": True,
    }

    proc = spotjob("status", "-n", namespace, kubeconfig=exec_kubeconfig(tmp_path / "kc", user_kubeconfig, spec))

    assert proc.returncode == 0, proc.stderr
    assert Path(f"{seen}.args").read_text().strip() == "eks get-token --cluster-name ml"
    assert Path(f"{seen}.env").read_text().strip() == "eu-west-1"
    info = json.loads(Path(f"{seen}.info").read_text())
    assert info["apiVersion"] == api_version and info["spec"]["interactive"] is False
    assert info["spec"]["cluster"]["server"] == cluster.server_url
    assert info["spec"]["cluster"]["certificate-authority-data"]


def test_a_credential_plugin_that_fails_is_named_with_its_exit_code_and_stderr_not_as_a_401(
    spotjob: Run, user_kubeconfig: str, tmp_path: Path
) -> None:
    # The client library logged the failure ("ERROR:root:exec: ...") and sent the request without
    # credentials: the user read "did not accept your credentials (401)" for an expired SSO login.
    plugin = script(tmp_path / "aws", 'echo "Error when retrieving token from sso: Token has expired" >&2; exit 255\n')
    spec = {"apiVersion": "client.authentication.k8s.io/v1beta1", "command": plugin, "args": ["eks", "get-token"]}

    proc = spotjob("status", kubeconfig=exec_kubeconfig(tmp_path / "kc", user_kubeconfig, spec))

    assert proc.returncode == 1
    (line,) = proc.stderr.splitlines()
    assert line.startswith(f'error: the credential plugin "{plugin}" of user "sso" failed (exit code 255): ')
    assert "Token has expired" in line and "401" not in line


def test_a_credential_plugin_answer_that_is_no_json_is_refused_without_echoing_the_token_in_it(
    spotjob: Run, user_kubeconfig: str, tmp_path: Path
) -> None:
    """A plugin printing a line of its own after the credential: the answer is no JSON, and the
    error quoted its first 200 characters, the token among them, onto the terminal (and, for the
    controller, into its log)."""
    plugin = script(tmp_path / "get-token", f"echo '{credential('s3cr3t-bearer-token')}'\necho 'token refreshed'\n")
    spec = {"apiVersion": "client.authentication.k8s.io/v1", "command": plugin, "interactiveMode": "Never"}

    proc = spotjob("status", kubeconfig=exec_kubeconfig(tmp_path / "kc", user_kubeconfig, spec))

    assert proc.returncode == 1
    assert f'credential plugin "{plugin}" of user "sso" printed no ExecCredential JSON' in proc.stderr
    assert "s3cr3t" not in proc.stderr and "Traceback" not in proc.stderr
    assert "Extra data: line 2" in proc.stderr, "the error says where the JSON stops"


def test_a_credential_plugin_missing_from_path_prints_its_install_hint(
    spotjob: Run, user_kubeconfig: str, tmp_path: Path
) -> None:
    hint = "Install gke-gcloud-auth-plugin for use with kubectl by following the GKE documentation"
    spec = {
        "apiVersion": "client.authentication.k8s.io/v1beta1",
        "command": "spotjob-test-no-such-auth-plugin",
        "installHint": hint,
        "provideClusterInfo": True,
    }

    proc = spotjob("status", kubeconfig=exec_kubeconfig(tmp_path / "kc", user_kubeconfig, spec))

    assert proc.returncode == 1
    assert 'credential plugin "spotjob-test-no-such-auth-plugin" of user "sso" is not installed' in proc.stderr
    assert hint in proc.stderr and "Traceback" not in proc.stderr


def test_a_token_the_server_refuses_is_fetched_again_once_as_kubectl_does(
    cluster: TestCluster, namespace: str, spotjob: Run, user_kubeconfig: str, tmp_path: Path
) -> None:
    # A token the plugin cached but the server no longer takes (revoked, or the clocks disagree):
    # kubectl runs the plugin again on a 401 and retries once; the plugin used to fail with 401.
    token = cluster.add_user("sso@example.com")
    runs = tmp_path / "runs"
    plugin = script(
        tmp_path / "get-token",
        f"echo run >> {runs}\n"
        f"if [ $(wc -l < {runs}) -eq 1 ]; then echo '{credential('revoked')}'; else echo '{credential(token)}'; fi\n",
    )
    spec = {"apiVersion": "client.authentication.k8s.io/v1", "command": plugin, "interactiveMode": "IfAvailable"}

    proc = spotjob("status", "-n", namespace, kubeconfig=exec_kubeconfig(tmp_path / "kc", user_kubeconfig, spec))

    assert proc.returncode == 0, proc.stderr
    assert runs.read_text().count("run") == 2


def test_a_token_refused_again_after_a_fresh_one_names_the_user_and_context(
    spotjob: Run, user_kubeconfig: str, tmp_path: Path
) -> None:
    plugin = script(tmp_path / "get-token", f"echo '{credential('never-valid')}'\n")
    spec = {"apiVersion": "client.authentication.k8s.io/v1", "command": plugin, "interactiveMode": "Never"}

    proc = spotjob("status", kubeconfig=exec_kubeconfig(tmp_path / "kc", user_kubeconfig, spec))

    assert proc.returncode == 1
    assert 'did not accept the credentials of user "sso" of context spotjob-test (401 Unauthorized' in proc.stderr


def test_a_credential_past_its_expiration_is_fetched_again_before_the_next_request(
    cluster: TestCluster, namespace: str, spotjob: Run, user_kubeconfig: str, tmp_path: Path
) -> None:
    """Pins what already worked (the client library re-ran an expired plugin too, 5 minutes early;
    now 30 seconds early, so a short-lived token is not fetched on every request)."""
    token = cluster.add_user("sso@example.com")
    runs = tmp_path / "runs"
    expired = credential(token, expirationTimestamp="2001-01-01T00:00:00Z")
    plugin = script(tmp_path / "get-token", f"echo run >> {runs}\necho '{expired}'\n")
    spec = {"apiVersion": "client.authentication.k8s.io/v1", "command": plugin, "interactiveMode": "Never"}

    proc = spotjob("status", "-n", namespace, kubeconfig=exec_kubeconfig(tmp_path / "kc", user_kubeconfig, spec))

    assert proc.returncode == 0, proc.stderr
    assert runs.read_text().count("run") >= 2


# ----------------------------------------------------------------------------------------------
# TLS: tls-server-name, and a certificate the kubeconfig does not trust


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"tls-server-name": "kubernetes.default.svc"}, None),
        ({"tls-server-name": "wrong.example"}, "Hostname mismatch, certificate is not valid for 'wrong.example'"),
        ({"certificate-authority-data": None}, "certificate verify failed"),
    ],
)
def test_a_tls_failure_names_the_server_the_context_and_what_to_check(
    namespace: str,
    kubectl_spotjob: Run,
    user_kubeconfig: str,
    tmp_path: Path,
    change: dict[str, Any],
    expected: str | None,
) -> None:
    # A refused certificate used to be a "server error" that said the request's name twice. The
    # first case pins what already worked: tls-server-name is the name checked against the
    # certificate (the test server's is for 127.0.0.1, localhost and kubernetes.default.svc).
    # A process of its own: the test API server runs in this one and writes the failed handshake
    # to this process's stderr, which is not the plugin's one error line.
    doc = yaml.safe_load(Path(user_kubeconfig).read_text())
    server = doc["clusters"][0]["cluster"]
    for key, value in change.items():
        if value is None:
            del server[key]
        else:
            server[key] = value
    (tmp_path / "kc").write_text(yaml.safe_dump(doc))

    proc = kubectl_spotjob("status", "-n", namespace, kubeconfig=str(tmp_path / "kc"))

    if expected is None:
        assert proc.returncode == 0, proc.stderr
        return
    assert proc.returncode == 1
    (line,) = proc.stderr.splitlines()
    assert line.startswith(f"error: cannot talk to the API server at {server['server']} over TLS (context spotjob-test")
    assert expected in line and "certificate-authority, tls-server-name and server address" in line


# ----------------------------------------------------------------------------------------------
# --cluster and --user, kubectl's flags for another entry than the context's


def test_cluster_and_user_flags_replace_the_contexts_own_before_or_after_the_command(
    namespace: str, spotjob: Run, user_kubeconfig: str, tmp_path: Path
) -> None:
    # kubectl's --cluster and --user were refused as unknown arguments (exit 2).
    doc = yaml.safe_load(Path(user_kubeconfig).read_text())
    real_cluster, real_user = doc["clusters"][0]["name"], doc["users"][0]["name"]
    doc["clusters"].append({"name": "old", "cluster": {"server": "https://127.0.0.1:9"}})
    doc["users"].append({"name": "nobody", "user": {"token": "not-a-token"}})
    doc["contexts"][0]["context"].update({"cluster": "old", "user": "nobody", "namespace": namespace})
    (tmp_path / "kc").write_text(yaml.safe_dump(doc))
    kc = str(tmp_path / "kc")

    after = spotjob("status", "--cluster", real_cluster, f"--user={real_user}", kubeconfig=kc)
    before = spotjob("--cluster", real_cluster, "--user", real_user, "status", kubeconfig=kc)
    unknown = spotjob("status", "--cluster", "nope", kubeconfig=kc)

    assert after.returncode == 0 and f'No SpotJobs in namespace "{namespace}"' in after.stderr, after.stderr
    assert before.returncode == 0, before.stderr
    assert unknown.returncode == 1
    assert f'error: --cluster nope: cluster "nope" is not in {kc} (it has: old, {real_cluster})' in unknown.stderr


# ----------------------------------------------------------------------------------------------
# proxy-url


@pytest.mark.skipif(importlib.util.find_spec("socks") is not None, reason="PySocks is installed here")
def test_a_socks_proxy_url_without_pysocks_is_one_error_line_naming_the_package(tmp_path: Path) -> None:
    # proxy-url: socks5://… (a bastion's `ssh -D`) ended in a ModuleNotFoundError traceback when the
    # client built its connection pool. No cluster is needed: nothing is contacted.
    kc = kubeconfig(
        tmp_path / "kc",
        {"c": ("c", "u")},
        "c",
        clusters={"c": {"server": "https://10.0.0.1:6443", "proxy-url": "socks5://127.0.0.1:1080"}},
        users={"u": {"token": "t"}},
    )
    proc = subprocess.run(
        [sys.executable, "-m", "orchestrator.kubectl_plugin", "status", "--kubeconfig", kc],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "PYTHONPATH": os.environ.get("PYTHONPATH", "")},
    )

    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    (line,) = proc.stderr.splitlines()
    assert "socks5://127.0.0.1:1080" in line and "needs the PySocks package" in line
    with pytest.raises(ConfigError, match="needs the PySocks package"):
        load_config(kc)
