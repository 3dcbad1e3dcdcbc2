"""Every spotjob-agent command line spotjob itself writes is one the agent accepts: a worker pod's
args and env for any SpotJob spec the model takes, a local worker's for any ``spotjob run``
options, and the flush deadline the reconciler sends (``POST /flush``) for any ``noticeSeconds``.

The specs are built at the bounds of each field the agent is given, read from the model, so a
bound changed on either side without the other fails here, not in a pod that exits 2."""

from __future__ import annotations

import copy
import re
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from agent.control_api import FlushBody
from agent.launcher_cli import AgentConfig, parse_args
from orchestrator.backends.k8s import _worker_spec
from orchestrator.backends.local import LocalBackend
from orchestrator.backends.local_launch import LocalOptions
from orchestrator.crd import crd
from orchestrator.k8s import pods
from orchestrator.model import CheckpointSpec, JobKey, JobSpec
from orchestrator.run_config import RunConfig
from orchestrator.store import parse_job
from tests.k8s.cluster.schema import StructuralSchema

REPO = Path(__file__).resolve().parents[2]

OWNER = pods.Owner("ml", "llama", "0f4c3a2e-1111-2222-3333-444455556666")
OPTIONS = pods.WorkerOptions(agent_port=8470, controller_namespace="spotjob-system", controller_pod_labels={})
POD_IP = "10.0.0.5"


def bound(model: Any, field: str) -> float:
    """The ``maximum`` the model's schema gives ``field`` (camelCase), optional or not."""
    node = model.model_json_schema()["properties"][field]
    [maximum] = [n["maximum"] for n in [node, *node.get("anyOf", [])] if "maximum" in n]
    return float(maximum)


SMALLEST = sys.float_info.min  # the smallest positive normal float: in range of every "gt 0"
FLUSH_MAX = bound(JobSpec, "flushTimeoutSeconds")
NOTICE_MAX = bound(JobSpec, "noticeSeconds")
EVERY_SECONDS_MAX = bound(CheckpointSpec, "everySeconds")

BOUNDARY_SPECS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "flushTimeoutSeconds at its smallest": {"flushTimeoutSeconds": SMALLEST},
    "flushTimeoutSeconds below a second": {"flushTimeoutSeconds": 0.4},
    "flushTimeoutSeconds at its maximum": {"flushTimeoutSeconds": FLUSH_MAX},
    "flushTimeoutSeconds just below its maximum": {"flushTimeoutSeconds": FLUSH_MAX - 0.5},
    "everySeconds at its smallest": {"checkpoint": {"everySeconds": SMALLEST}},
    "everySeconds at its maximum": {"checkpoint": {"everySeconds": EVERY_SECONDS_MAX}},
    "everySteps and keep at 1": {"checkpoint": {"everySteps": 1, "keep": 1}},
    "everySteps and keep huge": {"checkpoint": {"everySteps": 2**63 - 1, "keep": 2**31 - 1}},
    "one rank on one node": {"replicas": 1, "nprocPerNode": 1},
    "noticeSeconds at its maximum": {"noticeSeconds": NOTICE_MAX},
    "a gs:// store": {"checkpoint": {"uri": "gs://bucket/a/b"}},
    "a file:// store": {"checkpoint": {"uri": "file:///mnt/shared/ckpt"}},
    "a path": {"checkpoint": {"uri": "/mnt/shared/ckpt"}},
}


def job_spec(changes: dict[str, Any]) -> JobSpec:
    doc: dict[str, Any] = {
        "image": "registry.example.com/train:1",
        "command": ["/workspace/train.py"],
        "replicas": 2,
        "checkpoint": {"uri": "s3://bucket/llama"},
    }
    for key, value in changes.items():
        doc[key] = {**doc[key], **value} if isinstance(value, dict) else value
    return JobSpec.model_validate(doc)


def worker_pod(worker: Any, *, job: str = "ml/llama", attempt: int = 0, index: int = 0) -> dict[str, Any]:
    """The pod of replica ``index`` of ``attempt``, as the controller makes it (replica 0 first)."""
    return pods.worker_pod(
        OWNER,
        job,
        worker,
        name=f"{job.split('/')[1]}-{attempt}-{index}",
        attempt=attempt,
        index=index,
        master_addr=POD_IP if index else None,
        placement=pods.WorkerPlacement(),
        options=OPTIONS,
    )


def agent_of_pod(pod: dict[str, Any]) -> AgentConfig:
    """What the pod's agent is told, parsed as it parses it (Kubernetes' $(VAR) expansion done)."""
    [container] = pod["spec"]["containers"]
    env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    args = [a.replace("$(POD_IP)", POD_IP) for a in container["args"]]
    config, _ = parse_args(args, env)
    return config


@pytest.mark.parametrize("changes", BOUNDARY_SPECS.values(), ids=BOUNDARY_SPECS.keys())
@pytest.mark.parametrize("attempt", [0, 2**31 - 1])
def test_every_worker_pod_of_a_spec_the_model_takes_starts_its_agent(changes: dict[str, Any], attempt: int) -> None:
    spec = job_spec(changes)
    for index in range(spec.replicas):
        pod = worker_pod(_worker_spec(spec), attempt=attempt, index=index)
        config = agent_of_pod(pod)
        window = pods.flush_window_seconds(spec.flush_timeout_seconds)
        assert config.sigterm_grace == config.flush_timeout == window >= spec.flush_timeout_seconds
        assert config.checkpoint_uri == spec.checkpoint.uri and config.attempt == attempt
        assert config.keep == spec.checkpoint.keep and config.every_steps == spec.checkpoint.every_steps
        assert pod["spec"]["terminationGracePeriodSeconds"] > window


def test_a_spotjobs_env_gives_its_agents_the_notice_settings() -> None:
    """The controller writes the agent's command line; the SpotJob's ``env`` is how a user sets
    ``--flush-lead``, ``--gcp-maintenance-seconds`` and ``--rebalance`` on Kubernetes (README
    "Notices far ahead")."""
    env = {
        "SPOTJOB_AGENT_FLUSH_LEAD": "0",
        "SPOTJOB_AGENT_GCP_MAINTENANCE_SECONDS": "900",
        "SPOTJOB_AGENT_REBALANCE": "flush",
    }
    spec = job_spec({}).model_copy(update={"env": env})
    pod = worker_pod(_worker_spec(spec))
    config = agent_of_pod(pod)
    assert (config.flush_lead, config.gcp_maintenance_seconds, config.rebalance) == (0, 900, "flush")


def test_a_spotjobs_env_turns_its_agents_prefetch_off() -> None:
    """``SPOTJOB_AGENT_PREFETCH`` reaches every worker's agent through the SpotJob's ``env`` (the
    controller writes no ``--prefetch``: an agent older than the option would exit 2 on it).
    Before the fix no variable or option turned the prefetch off."""
    spec = job_spec({}).model_copy(update={"env": {"SPOTJOB_AGENT_PREFETCH": "off"}})
    for index in range(spec.replicas):
        assert agent_of_pod(worker_pod(_worker_spec(spec), index=index)).prefetch == "off"


# The options spotjob-agent accepted at c5f2419 (2026-12-01, the first day of the Helm
# chart), read from its agent.launcher_cli.build_parser: the oldest agent README "Upgrading" says a
# newer controller still starts. An option the controller adds must be one of these, or go in the
# environment (which an older agent ignores), else every worker of an older image exits 2.
OLDEST_SUPPORTED_AGENT_OPTIONS = frozenset(
    {
        "--async",
        "--attempt",
        "--aws-metadata-url",
        "--azure-metadata-url",
        "--checkpoint-uri",
        "--cloud",
        "--control-dir",
        "--control-host",
        "--control-port",
        "--every-seconds",
        "--every-steps",
        "--exit-timeout",
        "--exit-with-parent",
        "--expected-ranks",
        "--flush-timeout",
        "--gcp-metadata-url",
        "--gcp-notice-seconds",
        "--help",
        "--job-name",
        "--keep",
        "--kill-grace",
        "--log-level",
        "--no-aws",
        "--no-azure",
        "--no-gcp",
        "--no-sigterm",
        "--notices",
        "--parent-grace",
        "--poll-interval",
        "--rank-connect-timeout",
        "--rebalance",
        "--safety-margin",
        "--sigterm-grace",
        "--staging-dir",
        "--start-fresh",
        "--token-file",
    }
)


@pytest.mark.parametrize("launcher", ["direct", "torchrun"])
@pytest.mark.parametrize("changes", BOUNDARY_SPECS.values(), ids=BOUNDARY_SPECS.keys())
def test_a_worker_pod_gives_its_agent_only_options_the_oldest_supported_agent_takes(
    changes: dict[str, Any], launcher: Any
) -> None:
    spec = job_spec(changes)
    options = pods.WorkerOptions(agent_port=8470, agent_launcher=launcher)
    pod = pods.worker_pod(
        OWNER, "ml/llama", _worker_spec(spec), name="llama-0-1", attempt=0, index=1, master_addr=POD_IP,
        placement=pods.WorkerPlacement(), options=options,
    )  # fmt: skip
    args = pod["spec"]["containers"][0]["args"]
    given = {a for a in args[: args.index("--")] if a.startswith("--")}
    assert given <= OLDEST_SUPPORTED_AGENT_OPTIONS, sorted(given - OLDEST_SUPPORTED_AGENT_OPTIONS)
    assert agent_of_pod(pod).launcher == launcher  # and today's agent still gets the controller's launcher


def documented_spotjobs() -> dict[str, dict[str, Any]]:
    """Every SpotJob of examples/*.yaml and of README.md's yaml blocks, by where it is."""
    found: dict[str, dict[str, Any]] = {}
    for path in sorted((REPO / "examples").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc.get("kind") == "SpotJob":
                found[f"{path.name}:{doc['metadata']['name']}"] = doc
    readme = (REPO / "README.md").read_text()
    for block in re.finditer(r"^```ya?ml\n(.*?)^```", readme, re.S | re.M):
        for doc in yaml.safe_load_all(block.group(1)):
            if isinstance(doc, dict) and doc.get("kind") == "SpotJob":
                found[f"README.md:{readme[: block.start()].count(chr(10)) + 1}"] = doc
    return found


DOCUMENTED = documented_spotjobs()


def test_the_readme_and_the_examples_hold_spotjobs() -> None:
    assert {"spotjob.yaml:train-demo", "spotjob-eks.yaml:train-eks", "spotjob-gke.yaml:train-gke"} <= set(DOCUMENTED)
    assert any(where.startswith("README.md:") for where in DOCUMENTED)


@pytest.mark.parametrize("where", sorted(DOCUMENTED))
def test_every_documented_spotjob_passes_the_crd_and_the_controller_and_starts_its_agents(where: str) -> None:
    doc = copy.deepcopy(DOCUMENTED[where])
    schema = crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    result = StructuralSchema(schema).process(doc)
    assert not result.errors and not result.unknown, (result.errors, result.unknown)
    stored = parse_job(JobKey("ml", doc["metadata"]["name"]), doc["spec"], None, version="1")
    assert stored.invalid is None and stored.spec is not None, stored.invalid
    worker = _worker_spec(stored.spec)
    pod = worker_pod(worker, job="ml/job")
    trainer = pod["spec"]["containers"][worker.container if worker.template is not None else 0]
    env = {e["name"]: e["value"] for e in trainer["env"] if "value" in e}
    config, _ = parse_args([a.replace("$(POD_IP)", POD_IP) for a in trainer["args"]], env)
    assert config.checkpoint_uri == stored.spec.checkpoint.uri


def test_a_flush_timeout_or_notice_past_what_the_agent_takes_is_refused_by_the_spec() -> None:
    with pytest.raises(ValueError, match="flushTimeoutSeconds"):
        job_spec({"flushTimeoutSeconds": FLUSH_MAX + 1})
    with pytest.raises(ValueError, match="noticeSeconds"):
        job_spec({"noticeSeconds": NOTICE_MAX + 1})


def test_the_flush_deadline_of_the_longest_notice_is_one_the_agent_takes() -> None:
    # The reconciler's deadline when a signal carries none: now + spec.noticeSeconds.
    deadline = time.time() + job_spec({"noticeSeconds": NOTICE_MAX}).notice_seconds  # type: ignore[operator]
    assert FlushBody(deadline=deadline).deadline == deadline


RUN_BOUNDS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "the smallest numbers": {
        "nproc": 1,
        "every_steps": 1,
        "every_seconds": SMALLEST,
        "keep": 1,
        "flush_timeout": SMALLEST,
        "notice": SMALLEST,
    },
    "--notice 1": {"notice": 1.0},
    "the largest numbers": {
        "every_steps": 2**63 - 1,
        "every_seconds": EVERY_SECONDS_MAX,
        "keep": 2**31 - 1,
        "flush_timeout": FLUSH_MAX,
        "notice": NOTICE_MAX,
    },
    "an s3:// store": {"checkpoint_uri": "s3://bucket/run"},
    "the torchrun launcher": {"launcher": "torchrun"},
}


@pytest.mark.parametrize("options", RUN_BOUNDS.values(), ids=RUN_BOUNDS.keys())
def test_every_local_worker_of_options_spotjob_run_takes_starts_its_agent(
    tmp_path: Path, options: dict[str, Any]
) -> None:
    config = RunConfig(script="train.py", args=[], name="run", runs_dir=str(tmp_path), **options)
    spec = config.job_spec()
    with LocalBackend(LocalOptions(root=str(tmp_path / "run"), notice_seconds=config.notice)) as backend:
        node = backend._cloud.provision("zone-a", "type-a")
        command = backend._command(JobKey.local("run"), spec, 0, 0, node.imds.url, str(tmp_path / "control"), 29500)
        # The tool prefix is spotjob-agent's path, or python -m agent.launcher.
        agent_args = command[command.index("--notices") :]
        parsed, _ = parse_args(agent_args, {})
        assert backend.spec_problems(JobKey.local("run"), spec) == []
        assert parsed.checkpoint_uri == spec.checkpoint.uri and parsed.keep == config.keep
        # The reconciler's flush deadline when the simulated notice is heard: now + --notice.
        deadline = time.time() + config.notice
        assert FlushBody(deadline=deadline).deadline == deadline


@pytest.mark.parametrize(("notice", "lead"), [(20.0, 10.0), (FLUSH_MAX, FLUSH_MAX - 1), (10.0000001, 10.0)])
def test_the_agents_of_a_run_that_plans_a_host_maintenance_listen_to_their_nodes_gce_metadata(
    tmp_path: Path, notice: float, lead: float
) -> None:
    """``--maintenance-at-step`` with ``--maintenance-notice``/``--flush-lead`` at the bounds
    ``spotjob run`` takes: every agent accepts the command line, hears its own node's GCE metadata
    server with that notice and lead, and AWS's as before."""
    config = RunConfig(
        script="train.py", args=[], name="run", runs_dir=str(tmp_path),
        maintenance_at_steps=[5], maintenance_notice=notice, flush_lead=lead,
    )  # fmt: skip
    spec = config.job_spec()
    options = LocalOptions(root=str(tmp_path / "run"), maintenance_seconds=notice, flush_lead=lead)
    with LocalBackend(options, plan=config.plan()) as backend:
        node = backend._cloud.provision("zone-a", "type-a")
        assert node.gce is not None
        command = backend._command(
            JobKey.local("run"), spec, 0, 0, node.imds.url, str(tmp_path / "control"), 29500, node.gce.url
        )
        parsed, _ = parse_args(command[command.index("--notices") :], {})
        assert backend.spec_problems(JobKey.local("run"), spec) == []
        assert (parsed.aws_metadata_url, parsed.gcp_metadata_url) == (node.imds.url, node.gce.url)
    assert tuple(parsed.notices) == ("aws", "gcp"), parsed.notices
    assert (parsed.gcp_maintenance_seconds, parsed.flush_lead) == (notice, lead)


def test_a_flush_timeout_or_notice_past_a_day_is_refused_naming_the_option(tmp_path: Path) -> None:
    for option, field in (("--flush-timeout", "flush_timeout"), ("--notice", "notice")):
        with pytest.raises(ValueError, match=f"{option} must be .* at most {FLUSH_MAX:g} "):
            RunConfig(script="train.py", args=[], name="run", runs_dir=str(tmp_path), **{field: FLUSH_MAX + 1})  # type: ignore[arg-type]


@pytest.mark.parametrize("deadline", [None, 120.0, 0.1000001, FLUSH_MAX])
def test_a_killed_drivers_agents_flush_within_its_interrupt_deadline(tmp_path: Path, deadline: float | None) -> None:
    """Fails without the fix: ``spotjob run --interrupt-deadline 120`` gave an interrupt's flush two
    minutes, but its agents got no ``--parent-grace``, so a driver killed outright (SIGKILL, OOM)
    left them the agent's own 30 s and the flush that needed two minutes was lost. Each agent now
    gets the driver's deadline, exactly (the default 30 s when none is given), and accepts it."""
    from orchestrator.run_driver import LocalRun

    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    given = {} if deadline is None else {"interrupt_deadline": deadline}
    config = RunConfig(script=str(script), args=[], name="run", runs_dir=str(tmp_path / "runs"), nproc=1, **given)
    run = LocalRun(config)
    try:
        node = run.backend._cloud.provision("zone-a", "type-a")
        command = run.backend._command(run.key, run.spec, 0, 0, node.imds.url, str(tmp_path / "control"), 29500)
        parsed, _ = parse_args(command[command.index("--notices") :], {})
        assert run.backend.spec_problems(run.key, run.spec) == []
    finally:
        run.close()
    assert parsed.exit_with_parent
    assert parsed.parent_grace == (30.0 if deadline is None else deadline)
