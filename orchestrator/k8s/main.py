"""``spotjob-controller``: the command the Helm chart runs. Flags (and their environment variables).

Every flag can also be set by an environment variable, named in ``--help``; a flag on the command
line wins. Bad flags or values exit 2 with a message that names the flag and what it accepts;
a replica that loses its leader lease exits 3 (see ``controller``); SIGTERM exits 0 after a clean
shutdown.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import math
import os
import re
import signal
import sys
from collections.abc import Sequence
from types import FrameType
from typing import cast
from urllib.parse import urlparse

from agent.settings import unknown_variables
from agent.streams import ENV_LOG_FORMAT, LOG_FORMATS, log_format, log_to_stderr, tolerate_unencodable_output
from agent.torchrun import ENV_LAUNCHER, LAUNCHERS, Launcher
from agent.version import version_line
from orchestrator.k8s.agents import TokenKeyError
from orchestrator.k8s.api import KubeClient
from orchestrator.k8s.cluster_signals import RebalancePolicy
from orchestrator.k8s.controller import Controller, ControllerOptions, ReconcileFactory
from orchestrator.k8s.interruption_queue import region_of
from orchestrator.k8s.kubeconfig import ConfigError, load_config
from orchestrator.k8s.leader import LeaseTiming, default_identity
from orchestrator.k8s.metrics import ControllerMetrics
from orchestrator.k8s.wiring import spotjob_reconcile

log = logging.getLogger("spotjob.controller")

RECONCILE_FACTORY: ReconcileFactory = spotjob_reconcile
"""The reconcile seam: the SpotJob reconciler (tests may pass another to ``main``)."""

EXIT_USAGE = 2
MAX_LEASE_SECONDS = 2**31 - 1
"""The longest lease duration: a Lease stores it as an int32 number of seconds."""
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
    raise ValueError(f"${name} must be true or false (or 1/0, yes/no, on/off), not {value!r}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="spotjob-controller",
        description="Runs SpotJobs on Kubernetes: watches preemption signals, asks the agents to flush a "
        "checkpoint, and restarts the job's pods elsewhere, where they resume.",
    )
    p.add_argument("--version", action="version", version=version_line("spotjob-controller"))
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
        "--controller-pod-labels",
        metavar="K=V,...",
        help="labels of the controller's own pods: the per-job NetworkPolicies admit them to the agents' port "
        "(the chart sets it; without it, every pod of the controller's namespace is admitted; "
        "$SPOTJOB_CONTROLLER_POD_LABELS)",
    )
    p.add_argument(
        "--controller-namespace",
        metavar="NS",
        help="the namespace the controller's pods run in, for the NetworkPolicies (default $POD_NAMESPACE, "
        "else the pod's own namespace)",
    )
    p.add_argument(
        "--agent-token-key-file",
        metavar="PATH",
        help="the key (32+ bytes) each job's agent token is derived from; every replica needs the same one "
        "(the chart mounts it from a Secret; default: a random key, lost on restart; $SPOTJOB_AGENT_TOKEN_KEY_FILE)",
    )
    p.add_argument(
        "--interruption-queue-url",
        help="spotjob's own SQS queue of EC2 interruption events (EventBridge), read by the leader; never "
        "Karpenter's or aws-node-termination-handler's: a message is consumed once ($SPOTJOB_INTERRUPTION_QUEUE_URL)",
    )
    p.add_argument("--aws-region", help="region of the interruption queue (default: the one in its URL; $AWS_REGION)")
    p.add_argument(
        "--rebalance",
        choices=[r.value for r in RebalancePolicy],
        help="what an AWS rebalance recommendation does: ignore (advisory) or flush and move (default ignore; "
        "$SPOTJOB_REBALANCE)",
    )
    p.add_argument(
        "--agent-launcher",
        choices=LAUNCHERS,
        help="how the worker pods' agents start the ranks (spotjob-agent --launcher): direct, as torchrun would "
        "without torchrun's own start (a second or more off every restart; torchrun's own options keep torchrun), "
        f"or torchrun (default direct; ${ENV_LAUNCHER})",
    )
    p.add_argument(
        "--node-lost-grace-seconds",
        type=float,
        metavar="S",
        help="how long a node may be NotReady before its jobs count it lost (60; $SPOTJOB_NODE_LOST_GRACE_SECONDS)",
    )
    p.add_argument(
        "--workers",
        type=int,
        metavar="N",
        help="concurrent reconciles, one per job at a time, besides one kept for jobs with a new preemption notice "
        "(4; $SPOTJOB_WORKERS)",
    )
    p.add_argument(
        "--log-level",
        choices=["debug", "info", "warning", "error"],
        type=str.lower,
        help="log level (info; $SPOTJOB_LOG_LEVEL)",
    )
    p.add_argument(
        "--log-format",
        choices=list(LOG_FORMATS),
        type=str.lower,
        help="log lines as text, or one JSON object each (text; $SPOTJOB_LOG_FORMAT)",
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
            where = _source("--namespace", args.namespaces, "SPOTJOB_NAMESPACES")
            raise ValueError(f"{where} {ns!r} is not a namespace name (lower-case letters, digits, '-')")
    leader_elect = args.leader_elect if args.leader_elect is not None else _bool_env("SPOTJOB_LEADER_ELECT", True)
    lease_name = args.lease_name or _env("SPOTJOB_LEASE_NAME", "spotjob-controller") or ""
    if not _DNS_SUBDOMAIN.match(lease_name):
        where = _source("--lease-name", args.lease_name, "SPOTJOB_LEASE_NAME")
        raise ValueError(f"{where} {lease_name!r} is not a valid object name")
    lease_namespace = args.lease_namespace or _env("POD_NAMESPACE") or _service_account_namespace() or ""
    if leader_elect and not lease_namespace:
        raise ValueError(
            "leader election needs a namespace for its Lease: pass --lease-namespace NS (or set POD_NAMESPACE), "
            "or --no-leader-elect for a single replica"
        )
    if lease_namespace and not _DNS_LABEL.match(lease_namespace):
        where = _namespace_source("--lease-namespace", args.lease_namespace)
        raise ValueError(f"{where} {lease_namespace!r} is not a namespace name")
    for flag, value in (
        ("--leader-elect-lease-duration", args.leader_elect_lease_duration),
        ("--leader-elect-renew-deadline", args.leader_elect_renew_deadline),
        ("--leader-elect-retry-period", args.leader_elect_retry_period),
    ):
        if value is not None and not math.isfinite(value):  # an endless Lease is never taken over
            raise ValueError(f"{flag} must be a finite number of seconds, not {value}")
        if value is not None and value > MAX_LEASE_SECONDS:  # the Lease's int32 leaseDurationSeconds
            raise ValueError(f"{flag} must be at most {MAX_LEASE_SECONDS} seconds, not {value:g}")
    defaults = LeaseTiming()
    try:
        # `is None`, not `or`: a 0 given on the command line is refused below, not taken for the default.
        timing = LeaseTiming(
            lease_duration=_given(args.leader_elect_lease_duration, defaults.lease_duration),
            renew_deadline=_given(args.leader_elect_renew_deadline, defaults.renew_deadline),
            retry_period=_given(args.leader_elect_retry_period, defaults.retry_period),
        )
    except ValueError as e:
        raise ValueError(f"--leader-elect-*: {e}") from e
    http_port = _int(args.http_port, "SPOTJOB_HTTP_PORT", 8080, "--http-port")
    if not 0 <= http_port <= 65535:
        where = _source("--http-port", args.http_port is not None, "SPOTJOB_HTTP_PORT")
        raise ValueError(f"{where} {http_port} is not a port (0-65535; 0 picks a free one)")
    agent_port = _int(args.agent_port, "SPOTJOB_AGENT_PORT", 8470, "--agent-port")
    if not 1 <= agent_port <= 65535:
        where = _source("--agent-port", args.agent_port is not None, "SPOTJOB_AGENT_PORT")
        raise ValueError(f"{where} {agent_port} is not a port (1-65535)")
    network_policy = (
        args.network_policy if args.network_policy is not None else _bool_env("SPOTJOB_NETWORK_POLICY", True)
    )
    pod_labels = _labels(
        args.controller_pod_labels or _env("SPOTJOB_CONTROLLER_POD_LABELS") or "",
        _source("--controller-pod-labels", args.controller_pod_labels, "SPOTJOB_CONTROLLER_POD_LABELS"),
    )
    controller_namespace = args.controller_namespace or _env("POD_NAMESPACE") or _service_account_namespace() or ""
    if controller_namespace and not _DNS_LABEL.match(controller_namespace):
        where = _namespace_source("--controller-namespace", args.controller_namespace)
        raise ValueError(f"{where} {controller_namespace!r} is not a namespace name")
    token_key_file = args.agent_token_key_file or _env("SPOTJOB_AGENT_TOKEN_KEY_FILE")
    queue_url = args.interruption_queue_url or _env("SPOTJOB_INTERRUPTION_QUEUE_URL")
    if queue_url:
        parsed = urlparse(queue_url)
        if parsed.scheme not in ("https", "http") or not parsed.netloc or not parsed.path.strip("/"):
            raise ValueError(f"--interruption-queue-url {queue_url!r} is not a queue URL (https://host/account/queue)")
    # SQS answers for a queue at its own region's endpoint only: the URL's region, when it names
    # one, is the queue's. An --aws-region that contradicts it is a mistake to refuse; the
    # environment's (which EKS's pod identity webhook sets to the cluster's region) gives way to it.
    url_region = region_of(queue_url) if queue_url else None
    if url_region and args.aws_region and args.aws_region != url_region:
        raise ValueError(
            f"--aws-region {args.aws_region} is not the region of --interruption-queue-url {queue_url!r} "
            f"({url_region}), and SQS answers for a queue only at its own region's endpoint: drop --aws-region "
            "(the URL's region is used) or fix the one that is wrong"
        )
    region = url_region or args.aws_region or _env("AWS_REGION") or _env("AWS_DEFAULT_REGION")
    if queue_url and not region:
        raise ValueError(
            f"--interruption-queue-url {queue_url!r} names no region: pass --aws-region (or set AWS_REGION)"
        )
    rebalance_text = args.rebalance or _env("SPOTJOB_REBALANCE", "ignore") or "ignore"
    try:
        rebalance = RebalancePolicy(rebalance_text)
    except ValueError:
        where = _source("--rebalance", args.rebalance, "SPOTJOB_REBALANCE")
        raise ValueError(f"{where} must be ignore or flush, not {rebalance_text!r}") from None
    launcher = args.agent_launcher or _env(ENV_LAUNCHER, "direct")
    if launcher not in LAUNCHERS:  # a flag's value argparse checked: this one is the variable's
        raise ValueError(f"${ENV_LAUNCHER} (for --agent-launcher) must be {' or '.join(LAUNCHERS)}, not {launcher!r}")
    grace = _float(args.node_lost_grace_seconds, "SPOTJOB_NODE_LOST_GRACE_SECONDS", 60.0, "--node-lost-grace-seconds")
    if not math.isfinite(grace) or grace < 0:  # nan: no NotReady node would ever count as lost
        where = _source(
            "--node-lost-grace-seconds", args.node_lost_grace_seconds is not None, "SPOTJOB_NODE_LOST_GRACE_SECONDS"
        )
        raise ValueError(f"{where} must be a finite number of seconds >= 0, not {grace}")
    workers = _int(args.workers, "SPOTJOB_WORKERS", 4, "--workers")
    if not 1 <= workers <= 256:
        where = _source("--workers", args.workers is not None, "SPOTJOB_WORKERS")
        raise ValueError(f"{where} must be between 1 and 256, not {workers}")
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
        controller_namespace=controller_namespace,
        controller_pod_labels=pod_labels,
        agent_token_key_file=token_key_file,
        interruption_queue_url=queue_url,
        aws_region=region,
        rebalance=rebalance,
        node_lost_grace_seconds=grace,
        workers=workers,
        agent_launcher=cast(Launcher, launcher),
    )


_LABEL_KEY = re.compile(r"^([a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")
_LABEL_VALUE = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?$")


def _source(flag: str, given: object, env: str) -> str:
    """What a bad value is said to come from: the flag when it was given, else its variable."""
    return flag if given else f"${env} (for {flag})"


def _namespace_source(flag: str, given: str | None) -> str:
    """Where a namespace flag's value came from: the flag, $POD_NAMESPACE, or the pod's service account."""
    if given:
        return flag
    return f"$POD_NAMESPACE (for {flag})" if _env("POD_NAMESPACE") else f"{_SERVICE_ACCOUNT_NAMESPACE} (for {flag})"


def _labels(text: str, where: str = "--controller-pod-labels") -> tuple[tuple[str, str], ...]:
    """``k=v,k=v`` as label pairs; ValueError naming ``where`` (the flag or variable) and the bad pair."""
    out = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        key, sep, value = part.partition("=")
        if not sep or not _LABEL_KEY.match(key) or not _LABEL_VALUE.match(value):
            raise ValueError(f"{where}: {part!r} is not a label (key=value)")
        out.append((key, value))
    return tuple(out)


def _given(value: float | None, default: float) -> float:
    return default if value is None else value


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


def _refuse(kind: str, message: str) -> int:
    """(exit 2) Why the controller cannot start, in one line: ``spotjob-controller: <why>``, or under
    ``--log-format json`` one ERROR object, so that a log pipeline reads a crash loop's reason."""
    if kind == "json":
        log.error("%s", message)
    else:
        print(f"spotjob-controller: {message}", file=sys.stderr)
    return EXIT_USAGE


def main(argv: Sequence[str] | None = None, *, reconcile_factory: ReconcileFactory | None = None) -> int:
    tolerate_unencodable_output()
    args, options = parse_options(argv)
    level = (args.log_level or _env("SPOTJOB_LOG_LEVEL", "info") or "info").upper()
    if level not in ("DEBUG", "INFO", "WARNING", "ERROR"):
        build_parser().error(f"$SPOTJOB_LOG_LEVEL must be debug, info, warning or error, not {level.lower()!r}")
    try:
        kind = log_format(args.log_format or _env(ENV_LOG_FORMAT))
    except ValueError as e:
        build_parser().error(f"${ENV_LOG_FORMAT}={e}")
    log_to_stderr(level, "%(asctime)s %(levelname)s %(name)s: %(message)s", kind=kind)
    for line in unknown_variables(os.environ):
        log.warning("%s", line)
    for chatty in ("botocore", "boto3"):
        # Their debug output is every request's headers and hooks: ours says what matters.
        logging.getLogger(chatty).setLevel(max(logging.INFO, logging.getLevelName(level)))
    try:
        configuration = load_config(args.kubeconfig)
    except ConfigError as e:
        return _refuse(kind, str(e))
    metrics = ControllerMetrics()
    client = KubeClient(configuration, on_retry=metrics.api_retry)
    if options.network_policy and not options.controller_namespace:
        log.warning(
            "--network-policy: the controller's namespace is unknown (no --controller-namespace, $POD_NAMESPACE "
            "or service account), so no NetworkPolicy could admit it to the agents: none is created"
        )
        options = dataclasses.replace(options, network_policy=False)
    try:
        controller = Controller(client, options, reconcile_factory or RECONCILE_FACTORY, metrics=metrics)
    except TokenKeyError as e:
        return _refuse(kind, f"--agent-token-key-file: {e}")
    except OSError as e:
        return _refuse(kind, f"cannot serve on --http-port {options.http_port}: {e}")

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        log.info("received %s", signal.Signals(signum).name)
        controller.stop()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    log.info(
        "%s (%s): namespaces %s, leader election %s, interruption queue %s",
        version_line("spotjob-controller"),
        options.identity,
        ", ".join(options.namespaces) or "all",
        f"on lease {options.lease_namespace}/{options.lease_name}" if options.leader_elect else "off",
        options.interruption_queue_url or "none",
    )
    controller.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
