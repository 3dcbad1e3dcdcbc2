"""A SpotJob's agent settings are checked when the job is applied, not when its pods start: the
controller runs spotjob-agent's own parsing (``agent.launcher_cli.usage_problem``) over the command
line and environment each worker would get, and refuses the spec (``spec_problems``) with the
agent's own message. Before, every worker's agent exited 2 in its pod and the job spent its
restarts on it.

Every variable the agent reads is listed from the agent's own parser (the names it looks up while
parsing, and the fields of its settings classes), so a variable added there cannot be left out of
the check."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from agent.launcher_cli import parse_args, usage_problem
from agent.settings import CheckpointerEnv, StorageEnv, variable_name
from orchestrator.backends.k8s import _worker_spec
from orchestrator.backends.local import LocalBackend
from orchestrator.backends.local_launch import LocalOptions
from orchestrator.crd import POLICY_ENV, SPOTJOB_SET_ENV
from orchestrator.k8s import pods
from orchestrator.model import JobKey, JobSpec
from orchestrator.run_config import RunConfig
from orchestrator.run_setup import _refuse_agent_settings

OPTIONS = pods.WorkerOptions(agent_port=8470, controller_namespace="spotjob-system", controller_pod_labels={})
ARGS = ["--checkpoint-uri", "s3://bucket/llama", "--", "torchrun", "train.py"]
MALFORMED = "-1 nodes?"
"""A value no setting of the agent takes: not a number, a boolean, a mode, a size nor a URL."""


class Reads(Mapping[str, str]):
    """An environment that records every name looked up in it."""

    def __init__(self, values: Mapping[str, str]) -> None:
        self._values = dict(values)
        self.read: set[str] = set()

    def __getitem__(self, key: str) -> str:
        self.read.add(key)
        return self._values[key]

    def __contains__(self, key: object) -> bool:
        self.read.add(str(key))
        return key in self._values

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)


def agent_variables() -> set[str]:
    """The ``SPOTJOB_*`` variables spotjob-agent's parser reads: looked up while it parses, and the
    fields of the settings it checks for its ranks (read through a copy of the mapping)."""
    env = Reads({})
    parse_args(ARGS, env)
    fields = {variable_name(cls, name) for cls in (CheckpointerEnv, StorageEnv) for name in cls.model_fields}
    return {v for v in env.read if v.startswith("SPOTJOB_")} | fields


def job_spec(env: dict[str, str], **changes: Any) -> JobSpec:
    doc: dict[str, Any] = {
        "image": "registry.example.com/train:1",
        "command": ["/workspace/train.py"],
        "replicas": 2,
        "checkpoint": {"uri": "s3://bucket/llama"},
        "env": env,
        **changes,
    }
    return JobSpec.model_validate(doc)


def refused(spec: JobSpec) -> str | None:
    return pods.agent_settings_problem("ml/llama", _worker_spec(spec), OPTIONS)


def test_the_agent_reads_the_variables_its_readme_table_names() -> None:
    """Pins what already worked: the recorded reads are the parser's (a sanity check of the list
    the next test walks), not an empty set that would make it pass without checking anything."""
    found = agent_variables()
    for variable in (
        "SPOTJOB_AGENT_PREFETCH",
        "SPOTJOB_AGENT_REBALANCE",
        "SPOTJOB_AGENT_RANK_CONNECT_TIMEOUT",
        "SPOTJOB_AGENT_FLUSH_LEAD",
        "SPOTJOB_AGENT_GCP_MAINTENANCE_SECONDS",
        "SPOTJOB_AGENT_POLL_INTERVAL",
        "SPOTJOB_AGENT_LAUNCHER",
        "SPOTJOB_CLOUD",
        "SPOTJOB_LOG_FORMAT",
        "SPOTJOB_AWS_METADATA_URL",
        "SPOTJOB_CHECKPOINT_URI",
        "SPOTJOB_STORAGE_CONCURRENCY",
        "SPOTJOB_EVERY_STEPS",
    ):
        assert variable in found, variable


def test_usage_problem_is_the_message_the_agent_exits_2_with(capsys: pytest.CaptureFixture[str]) -> None:
    env = {"SPOTJOB_AGENT_PREFETCH": "nodes"}
    problem = usage_problem(ARGS, env)
    assert problem == "SPOTJOB_AGENT_PREFETCH 'nodes': expected one of node, all, off"
    with pytest.raises(SystemExit) as e:
        parse_args(ARGS, env)
    assert e.value.code == 2 and capsys.readouterr().err.rstrip().endswith(f"error: {problem}")
    assert usage_problem(ARGS, {}) is None


@pytest.mark.parametrize("variable", sorted(agent_variables()))
def test_every_variable_the_agent_reads_malformed_in_a_spotjobs_env_is_refused_before_any_pod(variable: str) -> None:
    """Each variable the agent's parser reads, set to a value no setting takes, either makes the
    spec invalid naming the variable and the value (the agent's own words), or is one the
    controller sets over ``spec.env`` itself (the CRD refuses it there; ``template_problems`` in
    the template). Failed before the fix: nothing looked at ``spec.env``'s values."""
    if variable in SPOTJOB_SET_ENV:
        return  # set by the controller, over spec.env; refused there by the CRD's rule
    spec = job_spec({variable: MALFORMED})
    problem = refused(spec)
    assert problem is not None and variable in problem and repr(MALFORMED) in problem, (variable, problem)
    if variable in POLICY_ENV:
        # With the spec.checkpoint field that the agent passes over it (--every-steps), the
        # variable never reaches a rank: no problem of the agent's (the CRD refuses the pair).
        replaced = job_spec({variable: MALFORMED}, checkpoint={"uri": "s3://bucket/llama", POLICY_ENV[variable]: 10})
        assert refused(replaced) is None


@pytest.mark.parametrize(
    ("env", "said"),
    [
        ({"SPOTJOB_AGENT_PREFETCH": "nodes"}, "SPOTJOB_AGENT_PREFETCH 'nodes': expected one of node, all, off"),
        ({"SPOTJOB_AGENT_RANK_CONNECT_TIMEOUT": "-5"}, "SPOTJOB_AGENT_RANK_CONNECT_TIMEOUT='-5': must be more than 0"),
        ({"SPOTJOB_AGENT_REBALANCE": "always"}, "SPOTJOB_AGENT_REBALANCE='always': expected one of ignore, save-early"),
        ({"SPOTJOB_STORAGE_CONCURRENCY": "0"}, "SPOTJOB_STORAGE_CONCURRENCY='0' is not a whole number from 1 to 1024"),
        # Well-formed but below the smallest budget (64 meant as 64MiB): refused like a malformed one.
        (
            {"SPOTJOB_STORAGE_MAX_BUFFER_BYTES": "64"},
            "SPOTJOB_STORAGE_MAX_BUFFER_BYTES='64' is not a size in bytes from 1MiB to 5TiB",
        ),
    ],
)
def test_a_bad_agent_setting_in_a_spotjobs_env_is_refused_in_the_agents_words(env: dict[str, str], said: str) -> None:
    """Failed before the fix: nothing checked the values, and every pod's agent exited 2."""
    problem = refused(job_spec(env))
    assert problem is not None and problem.startswith(said), problem
    assert refused(job_spec({})) is None


def test_a_bad_agent_setting_in_the_templates_training_container_env_is_refused_too() -> None:
    container = {"name": "t", "image": "i", "env": [{"name": "SPOTJOB_AGENT_PREFETCH", "value": "nodes"}]}
    spec = job_spec({}, template={"spec": {"containers": [container]}})
    problem = refused(spec)
    assert problem is not None and "SPOTJOB_AGENT_PREFETCH 'nodes'" in problem
    # spec.env wins over the template's variable of the same name (README "The SpotJob resource").
    assert refused(job_spec({"SPOTJOB_AGENT_PREFETCH": "off"}, template={"spec": {"containers": [container]}})) is None
    # A valueFrom is known in the pod alone: not checked, not refused.
    container["env"] = [{"name": "SPOTJOB_AGENT_PREFETCH", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}]
    assert refused(job_spec({}, template={"spec": {"containers": [container]}})) is None


def test_a_local_run_refuses_a_bad_agent_setting_from_its_env_or_its_own_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``spotjob run``'s workers get its own environment and the spec's ``env``: a bad agent
    setting in either is a spec problem, not three restarts of agents that exit 2. Failed before
    the fix: the local backend had no spec problems at all."""
    monkeypatch.delenv("SPOTJOB_AGENT_PREFETCH", raising=False)
    spec = RunConfig(script="train.py", args=[], name="run", runs_dir=str(tmp_path)).job_spec()
    key = JobKey.local("run")
    with LocalBackend(LocalOptions(root=str(tmp_path / "run"))) as backend:
        assert backend.spec_problems(key, spec) == []
        bad = spec.model_copy(update={"env": {"SPOTJOB_AGENT_PREFETCH": "nodes"}})
        [problem] = backend.spec_problems(key, bad)
        assert "SPOTJOB_AGENT_PREFETCH 'nodes': expected one of node, all, off" in problem
        assert problem.endswith("spec.env or the environment of spotjob run")
        monkeypatch.setenv("SPOTJOB_AGENT_RANK_CONNECT_TIMEOUT", "-1")
        [problem] = backend.spec_problems(key, spec)
        assert "SPOTJOB_AGENT_RANK_CONNECT_TIMEOUT='-1': must be more than 0" in problem


def test_spotjob_run_refuses_a_bad_agent_variable_of_its_environment_giving_the_remedy_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before, the agent's remedy was followed by a second one: "...: set it to one, or unset it;
    fix or unset it in this environment"."""
    monkeypatch.setenv("SPOTJOB_AGENT_FLUSH_LEAD", "abc")
    spec = RunConfig(script="train.py", args=[], name="run", runs_dir=str(tmp_path)).job_spec()
    with pytest.raises(ValueError) as refused:
        _refuse_agent_settings(JobKey.local("run"), spec, LocalOptions(root=str(tmp_path / "run")))
    said = str(refused.value)
    assert "SPOTJOB_AGENT_FLUSH_LEAD='abc' is not a number of seconds" in said, said
    assert "read from this environment" in said, said
    assert said.count("unset it") == 1, said


@pytest.mark.parametrize(
    ("variable", "good", "bad", "said"),
    [
        ("SPOTJOB_ASYNC", "0", "maybe", "SPOTJOB_ASYNC='maybe'"),
        ("SPOTJOB_START_FRESH", "1", "maybe", "SPOTJOB_START_FRESH='maybe'"),
    ],
)
def test_spotjob_runs_environment_reaches_its_agents_with_what_no_option_of_it_sets_and_is_checked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, variable: str, good: str, bad: str, said: str
) -> None:
    """SPOTJOB_ASYNC, SPOTJOB_START_FRESH and SPOTJOB_STAGING_DIR were dropped from the workers'
    environment without a word (spotjob run has no option for them, so local mode could not save
    synchronously, stage elsewhere or start fresh on purpose), and a bad value was taken (rc 0)
    where spotjob-agent alone exits 2. Found walking the CLI as a user."""
    from orchestrator.backends.local_launch import worker_env

    spec = RunConfig(script="train.py", args=[], name="run", runs_dir=str(tmp_path)).job_spec()
    monkeypatch.setenv(variable, good)
    assert worker_env(spec)[variable] == good
    with LocalBackend(LocalOptions(root=str(tmp_path / "run"))) as backend:
        assert backend.spec_problems(JobKey.local("run"), spec) == []
        monkeypatch.setenv(variable, bad)
        [problem] = backend.spec_problems(JobKey.local("run"), spec)
    assert said in problem, problem
    monkeypatch.setenv("SPOTJOB_STAGING_DIR", "/mnt/nvme/spotjob")  # the ranks' Checkpointers check it
    assert worker_env(spec)["SPOTJOB_STAGING_DIR"] == "/mnt/nvme/spotjob"
