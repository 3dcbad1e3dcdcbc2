"""``spotjob-controller``: the command the Helm chart runs. Flags (and their environment variables).

Every flag can also be set by an environment variable, named in ``--help``; a flag on the command
line wins. Bad flags or values exit 2 with a message that names the flag and what it accepts;
a replica that loses its leader lease exits 3 (see ``controller``); SIGTERM exits 0 after a clean
shutdown.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import signal
import sys
from collections.abc import Sequence
from types import FrameType
from urllib.parse import urlparse

from orchestrator.k8s.api import ConfigError, KubeClient, load_config
from orchestrator.k8s.cluster_signals import RebalancePolicy
from orchestrator.k8s.controller import Controller, ControllerOptions, ReconcileFactory, reconcile_not_wired
from orchestrator.k8s.leader import LeaseTiming, default_identity
from orchestrator.k8s.metrics import ControllerMetrics

log = logging.getLogger("spotjob.controller")

RECONCILE_FACTORY: ReconcileFactory = reconcile_not_wired
"""The reconcile seam: the SpotJob reconciler's factory goes here once it exists."""

EXIT_USAGE = 2
_SERVICE_ACCOUNT_NAMESPACE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")


def _env(name: str, default: str | None = None) -> str | None:
    value = os.environ.get(name)
    return value if value not in (None, "") else default


def _bool_env(name: str, default: bool) -> bool:
    value = _env(name)
    if value is None:
        return default
    if value.lower() in ("1", "true", "yes", "on"):
        return True
    if value.lower() in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"${name} must be true or false, not {value!r}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="spotjob-controller",
        description="Runs SpotJobs on Kubernetes: watches preemption signals, asks the agents to flush a "
        "checkpoint, and restarts the job's pods elsewhere, where they resume.",
    )
    p.add_argument("--kubeconfig", help="kubeconfig file ($KUBECONFIG; default: in-cluster, then ~/.kube/config)")
    p.add_argument(
        "--namespace",
        action="append",
        dest="namespaces",
        metavar="NS",
        help="serve SpotJobs in NS; repeat for several; none: all namespaces ($SPOTJOB_NAMESPACES, comma-separated)",
    )
    p.add_argument(
        "--leader-elect",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="elect one acting replica on a Lease (default on; $SPOTJOB_LEADER_ELECT)",
    )
    p.add_argument("--lease-name", help="the leader Lease's name (default spotjob-controller; $SPOTJOB_LEASE_NAME)")
    p.add_argument(
        "--lease-namespace", help="the leader Lease's namespace (default $POD_NAMESPACE, else the pod's own namespace)"
    )
    p.add_argument("--leader-elect-lease-duration", type=float, metavar="S", help="lease duration in seconds (15)")
    p.add_argument("--leader-elect-renew-deadline", type=float, metavar="S", help="renew deadline in seconds (10)")
    p.add_argument("--leader-elect-retry-period", type=float, metavar="S", help="retry period in seconds (2)")
    p.add_argument("--http-port", type=int, help="port of /healthz, /readyz and /metrics (8080; $SPOTJOB_HTTP_PORT)")
    p.add_argument("--agent-port", type=int, help="port of the agents' control API (8470; $SPOTJOB_AGENT_PORT)")
    p.add_argument(
        "--network-policy",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="the Kubernetes backend gives each job a NetworkPolicy admitting only the controller and the job's pods "
        "(default on; $SPOTJOB_NETWORK_POLICY)",
    )
    p.add_argument(
        "--interruption-queue-url", help="SQS queue of EC2 interruption events ($SPOTJOB_INTERRUPTION_QUEUE_URL)"
    )
    p.add_argument("--aws-region", help="region of the interruption queue ($AWS_REGION)")
    p.add_argument(
        "--rebalance",
        choices=[r.value for r in RebalancePolicy],
        help="what an AWS rebalance recommendation does: ignore (advisory) or flush and move (default ignore; "
        "$SPOTJOB_REBALANCE)",
    )
    p.add_argument(
        "--node-lost-grace-seconds",
        type=float,
        metavar="S",
        help="how long a node may be NotReady before its jobs count it lost (60; $SPOTJOB_NODE_LOST_GRACE_SECONDS)",
    )
    p.add_argument(
        "--workers", type=int, metavar="N", help="concurrent reconciles, one per job at a time (4; $SPOTJOB_WORKERS)"
    )
    p.add_argument(
        "--log-level",
        choices=["debug", "info", "warning", "error"],
        type=str.lower,
        help="log level (info; $SPOTJOB_LOG_LEVEL)",
    )
    return p


def parse_options(argv: Sequence[str] | None = None) -> tuple[argparse.Namespace, ControllerOptions]:
    """Flags, then environment, then defaults; every error exits 2 through ``parser.error``."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        options = _options(args)
    except ValueError as e:
        parser.error(str(e))
    return args, options


def _options(args: argparse.Namespace) -> ControllerOptions:
    namespaces = args.namespaces or [n.strip() for n in (_env("SPOTJOB_NAMESPACES") or "").split(",") if n.strip()]
    for ns in namespaces:
        if not _DNS_LABEL.match(ns):
            raise ValueError(f"--namespace {ns!r} is not a namespace name (lower-case letters, digits, '-')")
    leader_elect = args.leader_elect if args.leader_elect is not None else _bool_env("SPOTJOB_LEADER_ELECT", True)
    lease_name = args.lease_name or _env("SPOTJOB_LEASE_NAME", "spotjob-controller") or ""
    if not _DNS_SUBDOMAIN.match(lease_name):
        raise ValueError(f"--lease-name {lease_name!r} is not a valid object name")
    lease_namespace = args.lease_namespace or _env("POD_NAMESPACE") or _service_account_namespace() or ""
    if leader_elect and not lease_namespace:
        raise ValueError(
            "leader election needs a namespace for its Lease: pass --lease-namespace NS (or set POD_NAMESPACE), "
            "or --no-leader-elect for a single replica"
        )
    if lease_namespace and not _DNS_LABEL.match(lease_namespace):
        raise ValueError(f"--lease-namespace {lease_namespace!r} is not a namespace name")
    try:
        timing = LeaseTiming(
            lease_duration=args.leader_elect_lease_duration or 15.0,
            renew_deadline=args.leader_elect_renew_deadline or 10.0,
            retry_period=args.leader_elect_retry_period or 2.0,
        )
    except ValueError as e:
        raise ValueError(f"--leader-elect-*: {e}") from e
    http_port = _int(args.http_port, "SPOTJOB_HTTP_PORT", 8080, "--http-port")
    if not 0 <= http_port <= 65535:
        raise ValueError(f"--http-port {http_port} is not a port (0-65535; 0 picks a free one)")
    agent_port = _int(args.agent_port, "SPOTJOB_AGENT_PORT", 8470, "--agent-port")
    if not 1 <= agent_port <= 65535:
        raise ValueError(f"--agent-port {agent_port} is not a port (1-65535)")
    network_policy = (
        args.network_policy if args.network_policy is not None else _bool_env("SPOTJOB_NETWORK_POLICY", True)
    )
    queue_url = args.interruption_queue_url or _env("SPOTJOB_INTERRUPTION_QUEUE_URL")
    if queue_url:
        parsed = urlparse(queue_url)
        if parsed.scheme not in ("https", "http") or not parsed.netloc or not parsed.path.strip("/"):
            raise ValueError(f"--interruption-queue-url {queue_url!r} is not a queue URL (https://host/account/queue)")
    region = args.aws_region or _env("AWS_REGION") or _env("AWS_DEFAULT_REGION")
    rebalance_text = args.rebalance or _env("SPOTJOB_REBALANCE", "ignore") or "ignore"
    try:
        rebalance = RebalancePolicy(rebalance_text)
    except ValueError:
        raise ValueError(f"--rebalance must be ignore or flush, not {rebalance_text!r}") from None
    grace = _float(args.node_lost_grace_seconds, "SPOTJOB_NODE_LOST_GRACE_SECONDS", 60.0, "--node-lost-grace-seconds")
    if grace < 0:
        raise ValueError(f"--node-lost-grace-seconds cannot be negative ({grace})")
    workers = _int(args.workers, "SPOTJOB_WORKERS", 4, "--workers")
    if not 1 <= workers <= 256:
        raise ValueError(f"--workers must be between 1 and 256, not {workers}")
    return ControllerOptions(
        namespaces=tuple(namespaces),
        leader_elect=leader_elect,
        lease_name=lease_name,
        lease_namespace=lease_namespace,
        identity=default_identity(),
        lease_timing=timing,
        http_port=http_port,
        agent_port=agent_port,
        network_policy=network_policy,
        interruption_queue_url=queue_url,
        aws_region=region,
        rebalance=rebalance,
        node_lost_grace_seconds=grace,
        workers=workers,
    )


def _int(value: int | None, env: str, default: int, flag: str) -> int:
    if value is not None:
        return value
    text = _env(env)
    if text is None:
        return default
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"${env} (for {flag}) must be an integer, not {text!r}") from None


def _float(value: float | None, env: str, default: float, flag: str) -> float:
    if value is not None:
        return value
    text = _env(env)
    if text is None:
        return default
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"${env} (for {flag}) must be a number, not {text!r}") from None


def _service_account_namespace() -> str | None:
    try:
        with open(_SERVICE_ACCOUNT_NAMESPACE) as f:
            return f.read().strip() or None
    except OSError:
        return None


def main(argv: Sequence[str] | None = None, *, reconcile_factory: ReconcileFactory | None = None) -> int:
    args, options = parse_options(argv)
    level = (args.log_level or _env("SPOTJOB_LOG_LEVEL", "info") or "info").upper()
    if level not in ("DEBUG", "INFO", "WARNING", "ERROR"):
        build_parser().error(f"$SPOTJOB_LOG_LEVEL must be debug, info, warning or error, not {level.lower()!r}")
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    try:
        configuration = load_config(args.kubeconfig)
    except ConfigError as e:
        print(f"spotjob-controller: {e}", file=sys.stderr)
        return EXIT_USAGE
    metrics = ControllerMetrics()
    client = KubeClient(configuration, on_retry=metrics.api_retry)
    if options.interruption_queue_url:
        log.warning(
            "--interruption-queue-url is accepted, but this build has no interruption-queue reader: "
            "notices come from node taints and pod conditions only"
        )
    try:
        controller = Controller(client, options, reconcile_factory or RECONCILE_FACTORY, metrics=metrics)
    except OSError as e:
        print(f"spotjob-controller: cannot serve on --http-port {options.http_port}: {e}", file=sys.stderr)
        return EXIT_USAGE

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        log.info("received %s", signal.Signals(signum).name)
        controller.stop()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    log.info(
        "spotjob-controller %s: namespaces %s, leader election %s",
        options.identity,
        ", ".join(options.namespaces) or "all",
        f"on lease {options.lease_namespace}/{options.lease_name}" if options.leader_elect else "off",
    )
    controller.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
