"""The claim of a checkpoint folder in flight (agent.checkpoint._claim): how it parses."""

from __future__ import annotations

import json

from agent.checkpoint import _claim

ELSEWHERE = "another-boot/pid:[4026531836]"
"""A machine that is not this one (no kernel boot has that id)."""


def claim_from_elsewhere(claim_id: str, claimed_at: float) -> _claim.Claim:
    return _claim.Claim(claim_id, "train", None, "vm-2", 4242, "123", ELSEWHERE, claimed_at)


def test_a_claim_with_a_field_this_spotjob_does_not_know_still_reads_as_a_claim() -> None:
    """A later spotjob may add a field to the claim: ``cls(**raw)`` took such a claim for none at
    all (a live writer's folder then cleared as a leftover). Fields it does not know are ignored;
    one it needs missing, or JSON that is not an object, is still no claim."""
    claim = claim_from_elsewhere("abc", 1.0)
    raw = json.loads(claim.to_json())
    assert _claim.Claim.parse(json.dumps({**raw, "renewed_at": 2.0, "more": [1]}).encode()) == claim
    del raw["pid"]
    assert _claim.Claim.parse(json.dumps(raw).encode()) is None
    assert _claim.Claim.parse(b"[1, 2]") is None
    assert _claim.Claim.parse(json.dumps({**raw, "pid": "4242"}).encode()) is None
