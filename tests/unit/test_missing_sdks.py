"""spotjob without one of its SDKs: each test runs a fresh Python in which a ``sys.meta_path``
finder makes the named modules fail to import, as in an image that never installed them (``pip
install --no-deps``) or holds a release too old to have a module the backend imports. The finder
does not model a half-installed package that imports and then fails later."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

BLOCKER = """
import importlib.abc, sys
BLOCKED = {blocked!r}
class Blocker(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if any(name == b or name.startswith(b + ".") for b in BLOCKED):
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None
sys.meta_path.insert(0, Blocker())
"""


def _run(blocked: list[str], code: str) -> subprocess.CompletedProcess[str]:
    script = BLOCKER.format(blocked=blocked) + code
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)


SDKS = ["boto3", "botocore", "s3transfer", "google"]

OPEN = """
from agent.storage import PermanentStorageError, open_storage
try:
    open_storage({uri!r})
except PermanentStorageError as e:
    print("REFUSED:", e)
"""


def test_an_s3_uri_without_boto3_names_what_to_install() -> None:
    done = _run(["boto3", "botocore", "s3transfer"], OPEN.format(uri="s3://bucket/run"))
    assert done.returncode == 0, done.stderr
    assert "REFUSED: s3:// checkpoint URIs need boto3" in done.stdout
    assert "pip install 'boto3" in done.stdout


def test_a_gs_uri_without_google_cloud_storage_names_what_to_install() -> None:
    done = _run(["google"], OPEN.format(uri="gs://bucket/run"))
    assert done.returncode == 0, done.stderr
    assert "REFUSED: gs:// checkpoint URIs need google-cloud-storage" in done.stdout
    assert "pip install 'google-cloud-storage" in done.stdout


def test_a_google_cloud_storage_too_old_for_the_backend_names_what_to_install() -> None:
    """google-cloud-storage 2.x has no ``google.cloud.storage.exceptions`` (3.0.0 added it)."""
    done = _run(["google.cloud.storage.exceptions"], OPEN.format(uri="gs://bucket/run"))
    assert done.returncode == 0, done.stderr
    assert "REFUSED: gs:// checkpoint URIs need google-cloud-storage" in done.stdout
    assert "google.cloud.storage.exceptions" in done.stdout


def test_a_file_uri_saves_and_restores_without_any_cloud_sdk(tmp_path: Path) -> None:
    """Pins behaviour that already worked: the Checkpointer on a filesystem URI never imports boto3
    or google-cloud-storage."""
    code = f"""
import torch
from agent import Checkpointer
model = torch.nn.Linear(2, 2)
ck = Checkpointer({str(tmp_path / "ckpt")!r}, async_save=False)
ck.save(1, {{"model": model}})
ck.close()
ck = Checkpointer({str(tmp_path / "ckpt")!r}, read_only=True)
print("RESTORED", ck.restore({{"model": model}}))
ck.close()
print("SDKS", sorted(m for m in sys.modules if m.partition(".")[0] in {SDKS!r}))
"""
    done = _run(SDKS, code)
    assert done.returncode == 0, done.stderr
    assert "RESTORED 1" in done.stdout
    assert "SDKS []" in done.stdout


def test_the_controller_side_imports_without_torch() -> None:
    """Pins behaviour that already worked: every module the controller image runs imports without
    torch, NumPy or safetensors (the import-linter contract says who may import them; this checks
    what actually happens at import time), and spotjob-controller starts far enough to print its
    help."""
    code = """
import importlib, pkgutil
import orchestrator
for m in pkgutil.walk_packages(orchestrator.__path__, "orchestrator."):
    importlib.import_module(m.name)
import agent.launcher, agent.storage, agent.catalog, agent.export
from orchestrator.k8s.main import main
try:
    main(["--help"])
except SystemExit as e:
    print("EXIT", e.code)
"""
    done = _run(["torch", "numpy", "safetensors"], code)
    assert done.returncode == 0, done.stderr
    assert "EXIT 0" in done.stdout


AS_TORCH = """
import torch
for version in {versions!r}:
    # Each version imports the Checkpointer afresh, as a new process would: the floor is checked
    # when agent.checkpoint is imported.
    for name in [m for m in sys.modules if m == "agent.checkpoint" or m.startswith("agent.checkpoint.")]:
        del sys.modules[name]
    torch.__version__ = version  # the one seam: the version this torch reports
    try:
        from agent import Checkpointer
        print(version, "IMPORTED")
    except ImportError as e:
        print(version, "REFUSED:", e)
"""

PRE_RELEASE, TOO_OLD = "2.9.0a0+50eac811a6", "2.8.1+cu126"


@pytest.fixture(scope="module")
def as_torch_versions() -> dict[str, str]:
    """What importing the Checkpointer printed under each reported torch version: one Python (and
    one import of torch) for both, the accepted version first, so that its import is that of a
    fresh process; the version is the only thing changed between the two."""
    done = _run([], AS_TORCH.format(versions=[PRE_RELEASE, TOO_OLD]))
    assert done.returncode == 0, done.stderr
    said: dict[str, str] = {}
    for line in done.stdout.splitlines():
        version, _, outcome = line.partition(" ")
        said[version] = outcome
    return said


def test_a_torch_older_than_the_extras_floor_is_refused_when_the_checkpointer_is_imported(
    as_torch_versions: dict[str, str],
) -> None:
    """A torch that predates DCP's DefaultStager (2.9) used to import and fail at the first save.
    Only the reported version is changed: the modules are this machine's torch."""
    said = as_torch_versions.get(TOO_OLD, "")
    assert said.startswith("REFUSED: spotjob's Checkpointer needs torch>=2.9"), said
    assert "this Python has torch 2.8.1+cu126" in said


def test_a_pre_release_build_of_a_supported_torch_is_accepted(as_torch_versions: dict[str, str]) -> None:
    """Pins that the floor compares release numbers only: NGC containers ship ``2.9.0a0+<git>``."""
    assert as_torch_versions.get(PRE_RELEASE) == "IMPORTED", as_torch_versions


CKPT = """
from orchestrator.cli import main
sys.exit(main({argv!r}))
"""


def test_ckpt_verify_deep_and_export_without_torch_say_what_to_install_before_reading(tmp_path: Path) -> None:
    """``pip install spotjob`` (no torch extra) on an operator's machine: ``verify --deep`` used to
    read every byte and then end in a ModuleNotFoundError traceback; ``export`` likewise."""
    import torch

    from agent import Checkpointer

    uri = tmp_path / "ckpt"
    # Sets the scene only (torch is there when the checkpoint is written), so it runs here.
    with Checkpointer(str(uri), async_save=False) as ck:
        ck.save(1, {"model": torch.nn.Linear(2, 2)})
    for argv in (["ckpt", "verify", "--deep", str(uri)], ["ckpt", "export", str(uri), str(tmp_path / "out")]):
        done = _run(["torch", "numpy", "safetensors"], CKPT.format(argv=argv))
        assert done.returncode == 2, done.stderr  # an error, not verify's 1 ("the checkpoint is invalid")
        assert "Traceback" not in done.stderr
        assert "needs torch" in done.stderr and "pip install 'spotjob[torch]'" in done.stderr
    assert not (tmp_path / "out").exists()
