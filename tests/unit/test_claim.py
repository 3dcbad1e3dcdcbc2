"""The claim of a checkpoint folder in flight (agent.checkpoint._claim): how it parses, when its
writer counts as live, and its renewal while a save is in flight, on a real folder store."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from agent.checkpoint import _claim
from agent.storage.file import FileStorage

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


def test_a_renewed_claim_has_the_fields_of_yesterdays_claim() -> None:
    """spotjob up to 2026-12-05 takes a claim with a field it does not know for no claim at all,
    and would clear a live writer's folder: a renewed claim says it is renewed by its id, with the
    same eight fields as before (pins what the renewal keeps, not a fix)."""
    claim = _claim.Claim.mine(_claim.new_id(), "train", 3)
    assert list(json.loads(claim.to_json())) == [
        "id", "job", "attempt", "host", "pid", "started", "machine", "claimed_at"
    ]  # fmt: skip
    assert claim.renewed and _claim.Claim.parse(claim.to_json()) == claim


def test_a_renewed_claim_from_another_machine_lapses_by_the_stores_clock() -> None:
    """A renewed claim (its id says so) from another machine is live while the store wrote it less
    than ``LAPSES_AFTER_S`` ago, whatever its ``claimed_at`` says (another machine's clock); a claim
    that is not renewed (spotjob up to 2026-12-05) keeps the hour by ``claimed_at``, and so does a
    renewed one where the store gives no time."""
    now = time.time()
    renewed = claim_from_elsewhere(_claim.new_id(), now)
    assert renewed.renewed
    assert renewed.writer_alive(None, age=10.0)
    assert not renewed.writer_alive(None, age=_claim.LAPSES_AFTER_S + 1)
    assert claim_from_elsewhere(_claim.new_id(), now - 2 * _claim.STALE_AFTER_S).writer_alive(None, age=10.0)
    assert renewed.writer_alive(None)  # no store time: by claimed_at
    old_style = claim_from_elsewhere("0123abcd", now)
    assert not old_style.renewed
    assert old_style.writer_alive(None, age=_claim.LAPSES_AFTER_S + 1)
    assert not claim_from_elsewhere("0123abcd", now - _claim.STALE_AFTER_S - 1).writer_alive(None, age=1.0)


def test_a_save_in_flights_claim_is_renewed_and_renewal_leaves_another_writers_claim_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``Renewal`` rewrites the claim (same id, a later ``claimed_at``, a new store time) every
    period; once the folder holds another writer's claim (this save's folder was removed and
    claimed anew) it writes nothing more and ends."""
    monkeypatch.setattr(_claim, "RENEW_EVERY_S", 0.02)
    storage = FileStorage(str(tmp_path))
    mine = _claim.Claim.mine(_claim.new_id(), "train", None)
    mine = _claim.Claim(**{**mine.__dict__, "claimed_at": mine.claimed_at - 100})
    key = f"step-000000001/{_claim.CLAIM_NAME}"
    storage.put_bytes_if_absent(key, mine.to_json())
    renewal = _claim.Renewal(storage)
    threading.Thread(target=renewal.run, args=("step-000000001", mine), daemon=True).start()
    try:
        deadline = time.monotonic() + 60
        while (found := _claim.read_claim(storage, "step-000000001")) == mine and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        renewal.stop()
    assert found is not None and found.id == mine.id and found.claimed_at > mine.claimed_at, found

    theirs = claim_from_elsewhere(_claim.new_id(), 5.0)
    storage.put_bytes(key, theirs.to_json())
    written = threading.Event()
    real_put = storage.put_bytes

    def put_bytes(k: str, data: bytes) -> None:
        written.set()
        real_put(k, data)

    storage.put_bytes = put_bytes  # type: ignore[method-assign]
    renewal = _claim.Renewal(storage)
    thread = threading.Thread(target=renewal.run, args=("step-000000001", mine), daemon=True)
    thread.start()
    thread.join(60)
    assert not thread.is_alive()
    assert not written.is_set()
    assert _claim.read_claim(storage, "step-000000001") == theirs
