"""What a restart fetches on each node: where DCP puts the values every rank reads.

A 4-rank FSDP2 job (real torchrun ranks, CPU, gloo; ``scripts/ckpt_fsdp.py``) saves with Adam.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from agent.manifest import MANIFEST_NAME, Manifest

sys.path.insert(0, str(Path(__file__).resolve().parent / "scripts"))
import ckpt_harness as harness

pytestmark = pytest.mark.slow

FSDP = harness.SCRIPTS / "ckpt_fsdp.py"


def test_an_fsdp_states_replicated_scalars_are_all_in_rank_0s_file(tmp_path: Path) -> None:
    """Adam's ``step`` counter of each parameter is a tensor every rank holds alike, which DCP
    keeps once. Before the fix it went to whichever rank had written least so far, a different
    rank's file for each parameter (ranks 1, 2 and 3 here), so every rank's restore read nearly
    every rank's file. Now such scalars are written from rank 0, beside its shards."""
    uri = str(tmp_path / "ckpt")
    harness.torchrun(4, FSDP, "--dump", str(tmp_path / "saved"), "--uri", uri, "--save-at", "2", "--steps", "2")
    (manifest_path,) = Path(uri).glob(f"step-*/{MANIFEST_NAME}")
    manifest = Manifest.parse(manifest_path.read_bytes())
    whole = {name: t.files for name, t in manifest.tensors.items() if len(t.files) == 1}
    assert any(name.endswith(".step") for name in whole), whole
    assert {f for files in whole.values() for f in files} == {"__0_0.distcp"}, whole
