"""Fixtures of the install and provisioning tests (helpers: infra_support.py beside this file).

- ``helm_bin`` (session): the path of the real helm binary (installed on first use if missing).
- ``terraform_bin`` (session): the terraform binary on PATH; skips with the reason when absent.
- ``tf_plugin_dir`` (session): the terraform provider mirror; skips with the reason when absent.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from infra_support import helm_binary, plugin_dir


@pytest.fixture(scope="session")
def helm_bin() -> str:
    return helm_binary()


@pytest.fixture(scope="session")
def terraform_bin() -> str:
    found = shutil.which("terraform")
    if found is None:
        pytest.skip("no terraform binary on PATH: the Terraform tests need terraform >= 1.5")
    return found


@pytest.fixture(scope="session")
def tf_plugin_dir(terraform_bin: str) -> Path:
    found = plugin_dir()
    if found is None:
        pytest.skip(
            "no terraform provider mirror with registry.terraform.io/hashicorp/aws on this machine "
            "(looked in $SPOTJOB_TF_PLUGIN_DIR, /opt/tf-plugins, ~/.terraform.d/plugins): terraform init "
            "cannot run offline. Set SPOTJOB_TF_PLUGIN_DIR to a filesystem mirror to run these tests."
        )
    return found
