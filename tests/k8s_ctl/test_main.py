"""``spotjob-controller``'s flags: defaults, environment equivalents, and exit 2 with a clear message."""

from __future__ import annotations

import subprocess
import sys

import pytest

from orchestrator.k8s.cluster_signals import RebalancePolicy
from orchestrator.k8s.main import parse_options

ENV = (
    "POD_NAMESPACE",
    "POD_NAME",
    "KUBECONFIG",
    "AWS_REGION",
    "AWS_DEFAULT_REGION",
    "KUBERNETES_SERVICE_HOST",
)


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ENV:
        monkeypatch.delenv(name, raising=False)
    for name in [n for n in __import__("os").environ if n.startswith("SPOTJOB_")]:
        monkeypatch.delenv(name, raising=False)


def test_the_defaults_are_what_the_chart_expects(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("POD_NAMESPACE", "spotjob-system")
    monkeypatch.setenv("POD_NAME", "spotjob-controller-7c9-abcde")
    _, o = parse_options([])
    assert o.namespaces == () and o.leader_elect
    assert (o.lease_name, o.lease_namespace, o.identity) == (
        "spotjob-controller",
        "spotjob-system",
        "spotjob-controller-7c9-abcde",
    )
    assert (o.http_port, o.agent_port, o.workers) == (8080, 8470, 4)
    assert o.network_policy and o.rebalance is RebalancePolicy.IGNORE and o.node_lost_grace_seconds == 60
    assert o.interruption_queue_url is None
    assert o.agent_launcher == "direct"


def test_every_flag_the_chart_passes_is_accepted() -> None:
    _, o = parse_options(
        [
            "--kubeconfig=/tmp/kc",
            "--namespace=team-a",
            "--namespace=team-b",
            "--no-leader-elect",
            "--lease-name=ctl",
            "--http-port=9090",
            "--agent-port=9470",
            "--agent-launcher=torchrun",
            "--no-network-policy",
            "--interruption-queue-url=https://sqs.us-east-1.example/123456789012/spotjob",
            "--aws-region=us-east-1",
            "--rebalance=flush",
            "--node-lost-grace-seconds=30",
            "--workers=8",
            "--log-level=DEBUG",
        ]
    )
    assert o.namespaces == ("team-a", "team-b") and not o.leader_elect and o.lease_name == "ctl"
    assert (o.http_port, o.agent_port, o.workers, o.node_lost_grace_seconds) == (9090, 9470, 8, 30.0)
    assert not o.network_policy and o.rebalance is RebalancePolicy.FLUSH
    assert o.aws_region == "us-east-1" and o.interruption_queue_url is not None
    assert o.agent_launcher == "torchrun"


def test_the_environment_sets_what_flags_do_not(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPOTJOB_NAMESPACES", "team-a, team-b")
    monkeypatch.setenv("SPOTJOB_LEADER_ELECT", "false")
    monkeypatch.setenv("SPOTJOB_REBALANCE", "flush")
    monkeypatch.setenv("SPOTJOB_WORKERS", "2")
    monkeypatch.setenv("SPOTJOB_AGENT_LAUNCHER", "torchrun")
    monkeypatch.setenv("AWS_REGION", "eu-west-1")
    _, o = parse_options(["--workers=3"])
    assert o.namespaces == ("team-a", "team-b") and not o.leader_elect
    assert o.rebalance is RebalancePolicy.FLUSH and o.aws_region == "eu-west-1"
    assert o.workers == 3  # the flag wins
    assert o.agent_launcher == "torchrun"


def test_the_queue_urls_region_wins_over_the_environments(monkeypatch: pytest.MonkeyPatch) -> None:
    """EKS's pod identity webhook sets AWS_REGION to the cluster's region: a queue of another
    region, named in its URL, was read at the cluster region's endpoint. The URL's region is the
    queue's; the environment's serves a URL that names none (a VPC endpoint, a local server)."""
    monkeypatch.setenv("AWS_REGION", "eu-west-1")
    url = "--interruption-queue-url=https://sqs.us-east-1.amazonaws.com/123456789012/spotjob"
    _, o = parse_options(["--no-leader-elect", url])
    assert o.aws_region == "us-east-1"
    _, o = parse_options(["--no-leader-elect", url, "--aws-region=us-east-1"])
    assert o.aws_region == "us-east-1"
    _, o = parse_options(["--no-leader-elect", "--interruption-queue-url=https://vpce-0a.sqs.example/1/q"])
    assert o.aws_region == "eu-west-1"


@pytest.mark.parametrize(
    ("argv", "env", "message"),
    [
        (["--workers=0"], {}, "--workers"),
        (["--http-port=70000"], {}, "--http-port"),
        (["--namespace=Team_A"], {}, "--namespace"),
        (["--rebalance=sometimes"], {}, "--rebalance"),
        (["--agent-launcher=fast"], {}, "--agent-launcher"),
        (["--lease-namespace=x"], {"SPOTJOB_AGENT_LAUNCHER": "fast"}, "SPOTJOB_AGENT_LAUNCHER"),
        (["--node-lost-grace-seconds=-1"], {}, "--node-lost-grace-seconds"),
        # nan: a NotReady node would never count as lost, its workers never restarted elsewhere.
        (["--lease-namespace=x", "--node-lost-grace-seconds=nan"], {}, "--node-lost-grace-seconds"),
        (["--lease-namespace=x"], {"SPOTJOB_NODE_LOST_GRACE_SECONDS": "inf"}, "--node-lost-grace-seconds"),
        # inf: the leader's Lease would never expire, so no standby takes over when it dies.
        (["--lease-namespace=x", "--leader-elect-lease-duration=inf"], {}, "--leader-elect-lease-duration"),
        (["--interruption-queue-url=sqs-queue"], {}, "--interruption-queue-url"),
        # A queue URL that names no region (a VPC endpoint), and no region given: which one?
        (["--no-leader-elect", "--interruption-queue-url=https://vpce-0a.sqs.example/1/q"], {}, "--aws-region"),
        # A region that contradicts the URL's: the queue was read at the wrong region's endpoint,
        # and every receive failed (SpotJobInterruptionQueueErrors) rather than the start.
        (
            [
                "--no-leader-elect",
                "--interruption-queue-url=https://sqs.us-east-1.amazonaws.com/1/q",
                "--aws-region=eu-west-1",
            ],
            {},
            "--aws-region eu-west-1 is not the region of --interruption-queue-url "
            "'https://sqs.us-east-1.amazonaws.com/1/q' (us-east-1)",
        ),
        (["--leader-elect-lease-duration=2"], {}, "--leader-elect"),
        # A 0 used to be taken for "not given" and replaced by the default, without a word.
        (["--lease-namespace=x", "--leader-elect-retry-period=0"], {}, "got 0.0, 10.0, 15.0"),
        (["--lease-namespace=x", "--leader-elect-renew-deadline=0"], {}, "got 2.0, 0.0, 15.0"),
        (["--lease-namespace=x", "--leader-elect-lease-duration=0"], {}, "got 2.0, 10.0, 0.0"),
        # More seconds than the Lease's int32 leaseDurationSeconds holds: every write would be refused.
        (
            ["--lease-namespace=x", "--leader-elect-lease-duration=1e300"],
            {},
            "--leader-elect-lease-duration must be at most",
        ),
        ([], {}, "--lease-namespace"),  # leader election on, and no namespace for the Lease
        (["--lease-namespace=x", "--bogus"], {}, "--bogus"),
        (["--lease-namespace=x"], {"SPOTJOB_WORKERS": "many"}, "SPOTJOB_WORKERS"),
        (["--lease-namespace=x"], {"SPOTJOB_LEADER_ELECT": "maybe"}, "SPOTJOB_LEADER_ELECT"),
        # The refusal names every spelling taken (it said "true or false" and took 1/0, yes/no, on/off).
        (["--lease-namespace=x"], {"SPOTJOB_NETWORK_POLICY": "maybe"}, "true or false (or 1/0, yes/no, on/off)"),
        # A bad value from a variable is said of the variable, not of a flag that was never given.
        (
            ["--lease-namespace=x"],
            {"SPOTJOB_NAMESPACES": "ml,Team_A"},
            "$SPOTJOB_NAMESPACES (for --namespace) 'Team_A'",
        ),
        (["--lease-namespace=x"], {"SPOTJOB_LEASE_NAME": "Lease!"}, "$SPOTJOB_LEASE_NAME (for --lease-name) 'Lease!'"),
        (["--lease-namespace=x"], {"SPOTJOB_REBALANCE": "move"}, "$SPOTJOB_REBALANCE (for --rebalance) must be"),
        (
            ["--lease-namespace=x"],
            {"SPOTJOB_CONTROLLER_POD_LABELS": "app"},
            "$SPOTJOB_CONTROLLER_POD_LABELS (for --controller-pod-labels): 'app'",
        ),
        (["--lease-namespace=x", "--namespace=Team_A"], {}, "--namespace 'Team_A'"),
        # ... also when the variable is a number out of range (these named the flag alone).
        (["--lease-namespace=x"], {"SPOTJOB_WORKERS": "0"}, "$SPOTJOB_WORKERS (for --workers) must be between"),
        (["--lease-namespace=x"], {"SPOTJOB_HTTP_PORT": "70000"}, "$SPOTJOB_HTTP_PORT (for --http-port) 70000 is"),
        (["--lease-namespace=x"], {"SPOTJOB_AGENT_PORT": "0"}, "$SPOTJOB_AGENT_PORT (for --agent-port) 0 is not"),
        (
            ["--lease-namespace=x"],
            {"SPOTJOB_NODE_LOST_GRACE_SECONDS": "-1"},
            "$SPOTJOB_NODE_LOST_GRACE_SECONDS (for --node-lost-grace-seconds) must be",
        ),
        (
            ["--lease-namespace=x"],
            {"SPOTJOB_AGENT_LAUNCHER": "fast"},
            "$SPOTJOB_AGENT_LAUNCHER (for --agent-launcher) must be",
        ),
        (["--lease-namespace=x", "--workers=0"], {"SPOTJOB_WORKERS": "2"}, "error: --workers must be between"),
        # $POD_NAMESPACE stands in for two flags (README: a bad value names the variable it came from).
        ([], {"POD_NAMESPACE": "Team_A"}, "$POD_NAMESPACE (for --lease-namespace) 'Team_A'"),
        (["--lease-namespace=x"], {"POD_NAMESPACE": "Team_A"}, "$POD_NAMESPACE (for --controller-namespace) 'Team_A'"),
        (["--lease-namespace=Team_A"], {"POD_NAMESPACE": "ops"}, "error: --lease-namespace 'Team_A'"),
    ],
)
def test_bad_flags_exit_2_naming_the_problem(
    argv: list[str], env: dict[str, str], message: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(SystemExit) as exit_:
        parse_options(argv)
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_the_console_script_exits_2_without_a_cluster(tmp_path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "orchestrator.k8s.main", "--no-leader-elect", f"--kubeconfig={tmp_path / 'none'}"],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},
    )
    assert result.returncode == 2
    assert "cannot load the cluster configuration" in result.stderr


@pytest.mark.parametrize(
    ("text", "why"),
    [("clusters: [\n", "no YAML"), ("- just\n- a list\n", "a list"), ("just a string\n", "a string")],
)
def test_a_kubeconfig_that_is_no_kubeconfig_exits_2_in_one_line(tmp_path, text: str, why: str) -> None:
    # Malformed YAML used to end in a yaml.parser.ParserError traceback, and a list in a TypeError.
    kubeconfig = tmp_path / "bad kubeconfig ü.yaml"
    kubeconfig.write_text(text)
    result = subprocess.run(
        [sys.executable, "-m", "orchestrator.k8s.main", "--no-leader-elect", f"--kubeconfig={kubeconfig}"],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},
    )
    assert result.returncode == 2, why
    assert "Traceback" not in result.stderr, why
    (line,) = result.stderr.splitlines()
    assert line.startswith(f"spotjob-controller: cannot load the cluster configuration from {kubeconfig}: "), why


def test_the_network_policy_settings_and_the_token_key_are_read(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("POD_NAMESPACE", "spotjob-system")
    _, o = parse_options(
        [
            "--controller-pod-labels=app.kubernetes.io/name=spotjob,app.kubernetes.io/instance=prod",
            "--agent-token-key-file=/etc/spotjob/agent-token-key/key",
        ]
    )
    assert o.controller_namespace == "spotjob-system"  # where the NetworkPolicies admit the controller from
    assert dict(o.controller_pod_labels) == {"app.kubernetes.io/name": "spotjob", "app.kubernetes.io/instance": "prod"}
    assert o.agent_token_key_file == "/etc/spotjob/agent-token-key/key"
    monkeypatch.setenv("SPOTJOB_AGENT_TOKEN_KEY_FILE", "/k")
    assert parse_options(["--controller-namespace=ops"])[1].agent_token_key_file == "/k"
    assert parse_options(["--controller-namespace=ops"])[1].controller_namespace == "ops"


@pytest.mark.parametrize("labels", ["app", "=x", "a b=c", "app=x,,team=ml y"])
def test_a_bad_controller_pod_label_exits_2_naming_the_flag(
    labels: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.setenv("POD_NAMESPACE", "spotjob-system")
    with pytest.raises(SystemExit) as exit_:
        parse_options([f"--controller-pod-labels={labels}"])
    assert exit_.value.code == 2 and "--controller-pod-labels" in capsys.readouterr().err


def test_a_misspelled_spotjob_variable_is_named_with_the_one_it_resembles(tmp_path) -> None:
    """SPOTJOB_NAMESPACE (for SPOTJOB_NAMESPACES) in the chart's extraEnv used to be ignored without a
    word: the controller then served every namespace. Its log now names the variable and the known
    one it resembles (a warning: the variable may be someone else's)."""
    result = subprocess.run(
        [sys.executable, "-m", "orchestrator.k8s.main", "--no-leader-elect", f"--kubeconfig={tmp_path / 'none'}"],
        capture_output=True,
        text=True,
        timeout=60,
        env={
            "PATH": "/usr/bin:/bin",
            "HOME": str(tmp_path),
            "PYTHONPATH": __import__("os").environ.get("PYTHONPATH", ""),
            "SPOTJOB_NAMESPACE": "ml",
            "SPOTJOB_WORKERS": "8",
        },
    )
    assert result.returncode == 2, result.stderr
    assert "SPOTJOB_NAMESPACE is set but no part of spotjob reads it (did you mean SPOTJOB_NAMESPACES?)" in (
        result.stderr
    )
    assert "SPOTJOB_WORKERS is set" not in result.stderr
