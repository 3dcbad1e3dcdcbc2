"""The controller's half and the agent run where torch, NumPy and safetensors are not installed.

Each check runs in a subprocess whose ``sitecustomize`` puts a meta-path finder first that raises
ImportError for ``torch``, ``numpy`` and ``safetensors`` (what a controller image without the
``torch`` extra looks like), inherited by every process it starts. A checkpoint written by a
normal run (with torch, in this test process's environment) is then read with ``spotjob ckpt``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BLOCKED = ("torch", "numpy", "safetensors")

SITECUSTOMIZE = f"""
import sys

class _NoTorch:
    blocked = {BLOCKED!r}

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in self.blocked:
            raise ModuleNotFoundError(f"No module named {{name!r}} (blocked by the test)", name=name)
        return None

sys.meta_path.insert(0, _NoTorch())
"""


@pytest.fixture(scope="module")
def blocked_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    site = tmp_path_factory.mktemp("no-torch-site")
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPOTJOB_")}
    env["PYTHONPATH"] = os.pathsep.join([str(site), str(REPO), str(REPO / "tests" / "unit")])
    return env


def run(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=120, cwd=REPO)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A checkpoint written by a normal single-process run with torch."""
    uri = str(tmp_path_factory.mktemp("ckpt") / "run")
    code = textwrap.dedent(
        f"""
        import torch
        from agent import Checkpointer
        model = torch.nn.Linear(4, 3)
        ckpt = Checkpointer({uri!r}, async_save=False)
        state = {{"model": model}}
        ckpt.restore(state)
        ckpt.save(5, state)
        ckpt.close()
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert out.returncode == 0, out.stderr
    return uri


def test_the_blocker_really_blocks(blocked_env: dict[str, str]) -> None:
    for name in BLOCKED:
        out = run(blocked_env, "-c", f"import {name}")
        assert out.returncode != 0 and "blocked by the test" in out.stderr


def test_the_orchestrator_and_the_agent_import_without_torch(blocked_env: dict[str, str]) -> None:
    modules = [
        "orchestrator.reconciler",
        "orchestrator.backends.local",
        "orchestrator.store",
        "orchestrator.model",
        "orchestrator.cli",
        "orchestrator.cli_run",
        "orchestrator.cli_ckpt",
        "orchestrator.ckpt_commands",
        "orchestrator.ckpt_common",
        "orchestrator.ckpt_deep",
        "orchestrator.ckpt_export",
        "orchestrator.ckpt_output",
        "orchestrator.ckpt_select",
        "orchestrator.live",
        "agent.launcher",
        "agent.catalog",
        "agent.storage",
        "agent.storage.s3",
        "agent.storage.gs",
    ]
    out = run(blocked_env, "-c", f"import importlib\nfor m in {modules!r}: importlib.import_module(m)")
    assert out.returncode == 0, out.stderr


def test_the_reconciler_runs_a_job_through_a_preemption_without_torch(
    blocked_env: dict[str, str], tmp_path: Path
) -> None:
    code = textwrap.dedent(
        f"""
        from fakes import FakeBackend, FakeClock, FlakyStorage
        from orchestrator.model import JobKey, JobSpec, Phase
        from orchestrator.reconciler import Controller, Reconciler
        from orchestrator.store import JsonFileJobStore
        clock = FakeClock()
        storage = FlakyStorage({str(tmp_path / "ckpt")!r})
        spec = JobSpec.model_validate({{"command": ["python", "t.py"], "replicas": 2,
                                        "checkpoint": {{"uri": storage.uri}}}})
        from test_reconciler import NODES
        backend = FakeBackend(clock, storage, list(NODES), total_steps=300)
        store = JsonFileJobStore({str(tmp_path / "jobs")!r}, fsync=False)
        key = JobKey("team-a", "train")
        store.create(key, spec)
        controller = Controller(Reconciler(store, backend, clock, storage_factory=lambda uri: storage), clock)
        controller.run(key, max_passes=5)
        backend.notice("n0")
        status = controller.run(key)
        assert status.phase is Phase.SUCCEEDED and status.preemptions == 1, status
        print("ok")
        """
    )
    out = run(blocked_env, "-c", code)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_spotjob_ckpt_list_verify_and_show_read_a_real_checkpoint_without_torch(
    blocked_env: dict[str, str], checkpoint: str
) -> None:
    listed = run(blocked_env, "-m", "orchestrator.cli", "ckpt", "list", checkpoint)
    assert listed.returncode == 0, listed.stderr
    assert "5" in listed.stdout and "valid" in listed.stdout.lower()
    verified = run(blocked_env, "-m", "orchestrator.cli", "ckpt", "verify", checkpoint)
    assert verified.returncode == 0, verified.stderr + verified.stdout
    shown = run(blocked_env, "-m", "orchestrator.cli", "ckpt", "show", checkpoint)
    assert shown.returncode == 0, shown.stderr
    assert "model.weight" in shown.stdout and "model.bias" in shown.stdout


def test_spotjob_status_without_torch(blocked_env: dict[str, str], tmp_path: Path) -> None:
    code = textwrap.dedent(
        f"""
        from orchestrator.model import JobKey, JobSpec
        from orchestrator.store import JsonFileJobStore
        spec = JobSpec.model_validate({{"command": ["python", "t.py"],
                                        "checkpoint": {{"uri": {str(tmp_path / "ckpt")!r}}}}})
        JsonFileJobStore({str(tmp_path / "runs" / "demo")!r}).create(JobKey.local("demo"), spec)
        """
    )
    assert run(blocked_env, "-c", code).returncode == 0
    runs = str(tmp_path / "runs")
    listed = run(blocked_env, "-m", "orchestrator.cli", "status", "--runs-dir", runs)
    assert listed.returncode == 0 and "demo" in listed.stdout, listed.stderr
    one = run(blocked_env, "-m", "orchestrator.cli", "status", "demo", "--runs-dir", runs, "--json")
    assert one.returncode == 0, one.stderr
    assert json.loads(one.stdout)["name"] == "demo"


def test_spotjob_agent_runs_a_command_without_torch(blocked_env: dict[str, str], tmp_path: Path) -> None:
    out = run(
        blocked_env, "-m", "agent.launcher", "--checkpoint-uri", str(tmp_path / "c"), "--cloud", "none",
        "--", sys.executable, "-c", "print('trained')",
    )  # fmt: skip
    assert out.returncode == 0 and "trained" in out.stdout, out.stderr


def test_the_checkpointer_without_torch_says_how_to_install_it(blocked_env: dict[str, str]) -> None:
    out = run(blocked_env, "-c", "from agent import Checkpointer")
    assert out.returncode != 0
    assert "ImportError" in out.stderr and "pip install 'spotjob[torch]'" in out.stderr


def test_the_distribution_leaves_torch_to_an_extra_and_pins_it_for_development_only() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    core = " ".join(project["dependencies"])
    assert not any(name in core for name in BLOCKED), "a plain `pip install spotjob` must not bring torch"
    extra = project["optional-dependencies"]["torch"]
    torch_spec = next(d for d in extra if d.startswith("torch"))
    assert ">=" in torch_spec and "==" not in torch_spec, "a range, so a training image keeps its own torch"
    assert {d.split(">")[0].split("=")[0] for d in extra} == set(BLOCKED)
    constraints = (REPO / "constraints" / "dev.txt").read_text()
    assert "torch==2.13.0" in constraints.splitlines()
    assert "-c constraints/dev.txt" in (REPO / "Makefile").read_text()
