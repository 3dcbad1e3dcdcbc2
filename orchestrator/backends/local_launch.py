"""How a local run launches a worker: the run's options (``LocalOptions``), a worker's command line
(``spotjob-agent ... -- torchrun ...``) and environment, the check that its agent would start
(``agent_settings_problem``), and the run's bearer token, which the agents and the backend share."""

from __future__ import annotations

import os
import secrets
import shutil
import sys
from dataclasses import dataclass

from agent.atomic_file import write_atomic
from agent.control_api import ENV_AGENT_TOKEN
from agent.control_channel import (
    ENV_ATTEMPT,
    ENV_CHECKPOINT_URI,
    ENV_CONTROL_DIR,
    ENV_EVERY_SECONDS,
    ENV_EVERY_STEPS,
    ENV_JOB_NAME,
    ENV_KEEP,
)
from agent.launcher_cli import usage_problem
from agent.process_tree import ENV_AGENT_ID
from agent.torchrun import Launcher
from orchestrator.backends.local_cloud import CLOUDS, ENV_NODE, ENV_RUN, ENV_WORKER
from orchestrator.model import JobKey, JobSpec

_CHECK_IMDS_URL = "http://127.0.0.1:1"
"""The metadata URL ``spec_problems`` gives the agent's parser in place of a node's emulator's."""

# The agent reads these from its own flags; the user's shell must not override them underneath.
# (SPOTJOB_ASYNC, SPOTJOB_STAGING_DIR and SPOTJOB_START_FRESH are no flag of spotjob run's: they
# reach the agents from its environment, which the agent checks as its own, and the ranks.)
_AGENT_OWNED_ENV = (
    ENV_CHECKPOINT_URI,
    ENV_JOB_NAME,
    ENV_EVERY_STEPS,
    ENV_EVERY_SECONDS,
    ENV_KEEP,
    ENV_ATTEMPT,
    ENV_CONTROL_DIR,
    ENV_AGENT_ID,
    ENV_AGENT_TOKEN,
    "SPOTJOB_AWS_METADATA_URL",
    "SPOTJOB_GCP_METADATA_URL",
    "SPOTJOB_AZURE_METADATA_URL",
    "SPOTJOB_CLOUD",
    ENV_NODE,
    ENV_WORKER,
    ENV_RUN,
)


@dataclass(frozen=True)
class LocalOptions:
    """How the local backend runs workers. One instance per run folder."""

    root: str
    """The run's folder: ``nodes/``, ``logs/``, the token, the timeline."""
    notice_seconds: float = 30.0
    """The window of an injected notice: from the notice to the node's termination."""
    hear_notices: bool = True
    """False (a baseline): agents run with ``--notices none`` and ``signals()`` reports nothing;
    a noticed node just dies when its window ends."""
    poll_interval: float = 1.0
    """How often each agent polls its node's IMDS (spotjob-agent allows 1-5 s)."""
    kill_grace: float = 3.0
    """SIGTERM to SIGKILL when stopping a worker (a pod's termination grace period)."""
    workdir: str | None = None
    """The workers' working directory (default: this process's)."""
    launcher: Launcher = "direct"
    """``spotjob-agent --launcher``: direct (the agent starts the ranks as torchrun would, without
    torchrun's own start) or torchrun."""
    maintenance_seconds: float | None = None
    """The notice of a host maintenance (``maintain()``), from it to the node's stop: every node
    also serves GCE's metadata and every agent listens there with ``--gcp-maintenance-seconds`` this.
    None: a run that plans none (the nodes serve AWS's metadata alone)."""
    flush_lead: float = 10.0
    """The agents' ``--flush-lead`` where ``maintenance_seconds`` is set: a maintenance is held
    until this long before its deadline."""
    cloud: str = "aws"
    """The cloud the nodes simulate (``CLOUDS``): which metadata each serves, which source its agent
    hears, and how a notice is announced there."""
    parent_grace: float = 30.0
    """The agents' ``--parent-grace``: the deadline of the flush each agent begins by itself when the
    driver is gone (killed outright). ``spotjob run`` gives its ``--interrupt-deadline``, so a
    driver's death gives the flush what an interrupt would."""

    def __post_init__(self) -> None:
        if self.cloud not in CLOUDS:
            raise ValueError(f"cloud {self.cloud!r}: expected one of {', '.join(CLOUDS)}")


def _tool(name: str, module: str) -> list[str]:
    """A console script next to this interpreter, else ``python -m module``."""
    found = shutil.which(name, path=os.path.dirname(sys.executable))
    return [found] if found else [sys.executable, "-m", module]


def worker_command(
    options: LocalOptions,
    key: JobKey,
    job: JobSpec,
    attempt: int,
    index: int,
    imds_url: str | None,
    control_dir: str,
    port: int,
    gce_url: str | None = None,
    azure_url: str | None = None,
) -> list[str]:
    """A worker's command line: spotjob-agent (the tool prefix, then its options), ``--``, torchrun.
    ``imds_url``, ``gce_url``, ``azure_url``: the node's metadata servers (those it has): on AWS the
    IMDS, and GCE's where a host maintenance is announced; on GCP GCE's; on Azure Azure's."""
    ck = job.checkpoint
    cloud = options.cloud
    url = {"aws": imds_url, "gcp": gce_url, "azure": azure_url}[cloud]
    if url is None:
        raise ValueError(f"a worker on a simulated {cloud} node needs its {cloud} metadata server's URL")
    agent = [
        *_tool("spotjob-agent", "agent.launcher"),
        "--notices", cloud if options.hear_notices else "none",
        f"--{cloud}-metadata-url", url,
        "--poll-interval", f"{options.poll_interval:g}",
        "--token-file", token_file(options.root),
        "--checkpoint-uri", ck.uri,
        # The job's identity in storage (owner.json, attempt records): namespace/name.
        "--job-name", str(key),
        "--keep", str(ck.keep),
        "--control-dir", control_dir,
        "--kill-grace", f"{options.kill_grace:g}",
        "--launcher", options.launcher,
        "--attempt", str(attempt),
        # A killed driver leaves nobody to stop the workers: they flush and stop by themselves,
        # within the deadline its interrupt would have given them (exact: --resume waits for it).
        "--exit-with-parent",
        "--parent-grace", repr(float(options.parent_grace)),
    ]  # fmt: skip
    if cloud == "gcp" and options.hear_notices:
        # GCE's ~30 s from preempted=TRUE to the stop, scaled to this run's window.
        agent += ["--gcp-notice-seconds", repr(float(options.notice_seconds))]
    if options.hear_notices and options.maintenance_seconds is not None and (cloud != "aws" or gce_url is not None):
        if cloud == "aws":
            # AWS's IMDS announces no host maintenance: its nodes announce it GCE's way too.
            assert gce_url is not None
            agent[agent.index("--notices") + 1] = "aws,gcp"
            agent += ["--gcp-metadata-url", gce_url]
        if cloud != "azure":  # Azure's Redeploy carries its own NotBefore
            # Exact (not :g): a lead just under the notice must stay under it.
            agent += ["--gcp-maintenance-seconds", repr(float(options.maintenance_seconds))]
        agent += ["--flush-lead", repr(float(options.flush_lead))]
    if ck.every_steps is not None:
        agent += ["--every-steps", str(ck.every_steps)]
    if ck.every_seconds is not None:
        agent += ["--every-seconds", f"{ck.every_seconds:g}"]
    torchrun = [
        *_tool("torchrun", "torch.distributed.run"),
        "--nproc-per-node", str(job.nproc_per_node),
        "--nnodes", str(job.replicas),
        "--node-rank", str(index),
        "--master-addr", "127.0.0.1",
        "--master-port", str(port),
        "--max-restarts", "0",
    ]  # fmt: skip
    return [*agent, "--", *torchrun, *job.command]


def worker_env(job: JobSpec) -> dict[str, str]:
    """A worker's environment, less its marks: this process's (less what the agent's options set),
    then ``spec.env``."""
    env = {k: v for k, v in os.environ.items() if k not in _AGENT_OWNED_ENV}
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    env.update(job.env)
    return env


def agent_settings_problem(key: JobKey, spec: JobSpec, options: LocalOptions) -> str | None:
    """What every worker's spotjob-agent would refuse at its start (a usage error: it exits 2 before
    it starts anything) in the command line and the environment a worker gets (this process's
    environment, then ``spec.env``), in the agent's own words (``agent.launcher_cli.usage_problem``);
    None when it would start. ``spotjob run`` checks it before it creates a run, the reconciler on
    every pass (``spec_problems``)."""
    command = worker_command(
        options, key, spec, 0, 0, _CHECK_IMDS_URL, os.path.join(options.root, "check"), 1, _CHECK_IMDS_URL,
        _CHECK_IMDS_URL,
    )  # fmt: skip
    return usage_problem(command[len(_tool("spotjob-agent", "agent.launcher")) :], worker_env(spec))


def token_file(root: str) -> str:
    """The run's bearer token file (``write_token``)."""
    return os.path.join(root, "token")


def write_token(path: str) -> str:
    """A fresh random bearer token in a file readable by its owner only; returns the token.

    The token goes into a new file created 0600 (``O_EXCL``, so never one that already exists
    with a wider mode), which then replaces ``path`` in one rename: at no moment can anyone but
    the owner read it, whether ``path`` existed before or not.
    """
    token = secrets.token_urlsafe(32)
    write_atomic(path, (token + "\n").encode(), mode=0o600)
    return token
