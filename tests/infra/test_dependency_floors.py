"""The lower bounds pyproject.toml declares are versions the code really runs on.

``pip install spotjob`` keeps an installed dependency that satisfies the declared range, so a
training image that already has an older SDK keeps it: a floor below the first release with an API
the code calls is a crash at run time, not at install time. Each entry of ``FLOORS`` names the API
that sets the floor; the declared floor must be exactly that version (higher would refuse images
that work). The versions were checked by installing the release before and the release itself.
"""

from __future__ import annotations

import tomllib

import pytest
from infra_support import REPO
from packaging.requirements import Requirement
from packaging.version import Version

PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())

FLOORS = {
    # agent/storage/s3.py: botocore's Config(request_checksum_calculation=..., response_checksum_validation=...)
    # and ChecksumType="FULL_OBJECT" on multipart uploads are botocore 1.36.0's (1.35.99: TypeError);
    # boto3 1.36.0 is the first to require botocore 1.36.
    "boto3": ("1.36.0", "botocore.config.Config(request_checksum_calculation=...)"),
    # agent/crc32c.py: awscrt.checksums.combine_crc32c first shipped in 0.31.0 (0.30.0 lacks it).
    # A higher floor would also force botocore[crt]'s exact awscrt pin up, refusing images whose
    # botocore is pinned by something else (aiobotocore, say).
    "awscrt": ("0.31.0", "awscrt.checksums.combine_crc32c"),
    # agent/storage/gs.py imports google.cloud.storage.exceptions (DataCorruption, InvalidResponse):
    # the module arrived in 3.0.0, when google-resumable-media was folded into the library.
    "google-cloud-storage": ("3.0.0", "google.cloud.storage.exceptions"),
}


def _floor(name: str) -> Version:
    reqs = [Requirement(r) for r in PYPROJECT["project"]["dependencies"]]
    (req,) = [r for r in reqs if r.name == name]
    lows = [Version(s.version) for s in req.specifier if s.operator in (">=", "==", "~=")]
    assert lows, f"{name} has no lower bound in pyproject.toml"
    return max(lows)


@pytest.mark.parametrize("name", sorted(FLOORS))
def test_the_declared_floor_is_the_first_release_with_the_api_used(name: str) -> None:
    version, api = FLOORS[name]
    assert _floor(name) == Version(version), f"{name}: {api} needs {version}; pyproject.toml declares {_floor(name)}"


def test_the_checkpointers_torch_floor_is_the_torch_extras() -> None:
    """The Checkpointer refuses an older torch at import (agent.checkpoint._torch_floor); the
    extra's floor and that check must name the same release."""
    from agent.checkpoint._torch_floor import MIN_TORCH

    (req,) = [Requirement(r) for r in PYPROJECT["project"]["optional-dependencies"]["torch"] if r.startswith("torch")]
    (low,) = [Version(s.version) for s in req.specifier if s.operator == ">="]
    assert low.release[:2] == MIN_TORCH
