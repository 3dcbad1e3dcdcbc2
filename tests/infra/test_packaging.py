"""What ``pip install spotjob`` puts on a machine: the console scripts and their ``--version``, and
the wheel's files. The wheel is built from the sources Dockerfile.controller copies (pyproject.toml,
README.md, agent/, orchestrator/), so a file the package needs at run time but that the image
leaves out fails here too."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
import zipfile
from importlib.metadata import version

import pytest
from infra_support import REPO

PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
SCRIPTS: dict[str, str] = PROJECT["scripts"]
# What each script calls itself in its usage line (kubectl runs kubectl-spotjob as `kubectl spotjob`).
PROGS = {"kubectl-spotjob": "kubectl spotjob"}


def _run_script(name: str, *args: str) -> subprocess.CompletedProcess[str]:
    """The console script's entry point, as the installed wrapper calls it, on this checkout."""
    module, _, func = SCRIPTS[name].partition(":")
    code = f"import sys; from {module} import {func} as f; sys.argv = [{name!r}, *sys.argv[1:]]; sys.exit(f())"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env, timeout=60)


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_every_console_script_prints_the_package_version(name: str) -> None:
    done = _run_script(name, "--version")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"{PROGS.get(name, name)} {PROJECT['version']}"
    assert version("spotjob") == PROJECT["version"], "the installed metadata is stale: reinstall (make venv)"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> zipfile.ZipFile:
    """The wheel, built without the network from a copy of what Dockerfile.controller copies."""
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(REPO / name, src / name)
    for package in ("agent", "orchestrator"):
        shutil.copytree(REPO / package, src / package, ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path_factory.mktemp("dist")
    build = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(src)]
    done = subprocess.run(build, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    (path,) = out.glob("spotjob-*.whl")
    return zipfile.ZipFile(path)


def _sources() -> set[str]:
    return {
        p.relative_to(REPO).as_posix()
        for package in ("agent", "orchestrator")
        for p in (REPO / package).rglob("*")
        if p.is_file() and "__pycache__" not in p.parts and p.suffix in (".py", ".typed")
    }


def test_the_wheel_holds_every_module_and_py_typed_and_nothing_else(wheel: zipfile.ZipFile) -> None:
    """Pins behaviour that already worked. Nothing in agent/ or orchestrator/ reads a data file
    at run time (the CRD and the chart live in charts/, which the wheel does not carry): a new
    one must be added to package-data, and this test to its list."""
    info = f"spotjob-{PROJECT['version']}.dist-info/"
    names = {n for n in wheel.namelist() if not n.startswith(info)}
    assert names == _sources()
    assert {"agent/py.typed", "orchestrator/py.typed"} <= names


def test_the_wheel_declares_the_console_scripts_and_the_python_it_needs(wheel: zipfile.ZipFile) -> None:
    """Pins behaviour that already worked: the four console scripts (kubectl finds the plugin as
    ``kubectl-spotjob`` on PATH) and ``Requires-Python``, as pyproject.toml says."""
    info = f"spotjob-{PROJECT['version']}.dist-info/"
    entry_points = wheel.read(info + "entry_points.txt").decode()
    section = entry_points.split("[console_scripts]\n", 1)[1].split("\n\n", 1)[0]
    declared = dict(line.split(" = ", 1) for line in section.strip().splitlines())
    assert declared == SCRIPTS
    assert set(SCRIPTS) == {"spotjob", "spotjob-agent", "spotjob-controller", "kubectl-spotjob"}
    metadata = wheel.read(info + "METADATA").decode()
    assert f"Requires-Python: {PROJECT['requires-python']}" in metadata.splitlines()


def test_the_wheel_carries_the_license_it_declares(wheel: zipfile.ZipFile) -> None:
    """The Apache-2.0 text ships in the wheel (and so in the controller's image), and the metadata
    names the license by its SPDX expression, as pyproject.toml declares it."""
    info = f"spotjob-{PROJECT['version']}.dist-info/"
    assert PROJECT["license"] == "Apache-2.0"
    shipped = wheel.read(info + "licenses/LICENSE").decode()
    assert shipped == (REPO / "LICENSE").read_text()
    assert shipped.split()[:4] == ["Apache", "License", "Version", "2.0,"]
    assert "END OF TERMS AND CONDITIONS" in shipped
    metadata = wheel.read(info + "METADATA").decode().splitlines()
    assert "License-Expression: Apache-2.0" in metadata
    assert "License-File: LICENSE" in metadata
