"""Checkpoints on every store (filesystem, S3 on moto, GCS on fake-gcs-server), and through faults.

Storage faults come from ``tests/faults.py``'s proxy between the client and the server: throttling
and dropped connections are ridden out by retries and the save commits; a 403, or 5xx past the
retry budget, fails the save loudly on the next call, and no manifest is ever written.
"""

from __future__ import annotations

import re
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from agent.catalog import CheckpointRef, inspect, list_checkpoints, verify_deep
from agent.checkpoint import Checkpointer, SaveFailedError
from agent.control_channel import ControlDir
from agent.ownership import claim
from agent.storage import open_storage

sys.path.insert(0, str(Path(__file__).resolve().parent / "scripts"))
import ckpt_harness as harness
from ckpt_compare import assert_same
from ckpt_state import SAVE_STEP, make_state, snapshot, train

try:
    from faults import FaultProxy
except ImportError:  # tests/ collected as a package
    from tests.faults import FaultProxy


def save_steps(uri: str, steps: int, keep: int, staging: Path) -> dict[int, dict[str, Any]]:
    state = make_state(0)
    saved = {}
    with Checkpointer(uri, every_steps=1, keep=keep, staging_dir=str(staging)) as ckpt:
        for step in range(1, steps + 1):
            train(state, 1, start=step - 1)
            ckpt.step(step, state)
            saved[step] = snapshot(state)
    return saved


def restore(uri: str, staging: Path) -> tuple[int, dict[str, Any]]:
    state = make_state(0, seed=11)
    with Checkpointer(uri, staging_dir=str(staging)) as ckpt:
        step = ckpt.restore(state)
    return step, snapshot(state)


def test_save_restore_and_fall_back_on_every_store(storage_uri: str, tmp_path: Path) -> None:
    saved = save_steps(storage_uri, 3, keep=2, staging=tmp_path)
    storage = open_storage(storage_uri)
    found = list_checkpoints(storage)
    assert [s.ref.step for s in found] == [3, 2] and all(s.valid for s in found)
    assert verify_deep(storage, found[0]) == []

    step, state = restore(storage_uri, tmp_path)
    assert step == 3
    assert_same(state, saved[3], "the state restored from step 3")

    # One flipped byte in the newest shard, same size: found as the bytes arrive, step 2 it is.
    key = CheckpointRef(3).key("__0_0.distcp")
    data = bytearray(storage.get_bytes(key))
    data[len(data) // 2] ^= 0x01
    storage.put_bytes(key, bytes(data))
    assert any("__0_0.distcp" in p for p in verify_deep(storage, inspect(storage, CheckpointRef(3))))
    step, state = restore(storage_uri, tmp_path)
    assert step == 2
    assert_same(state, saved[2], "the state restored from step 2")


@pytest.mark.slow
def test_two_torchrun_ranks_save_and_restore_on_an_object_store(
    fresh_uri: Callable[[str], str], tmp_path: Path
) -> None:
    """Each rank uploads its own files; on restore the ranks of a node share one verified cache."""
    uri = fresh_uri("s3")  # the server's address reaches the ranks through the environment
    harness.torchrun(2, harness.SCRIPTS / "ckpt_job.py", "save-restore", "--uri", uri, "--dump", str(tmp_path / "d"))
    for rank in range(2):
        d = torch.load(tmp_path / f"d.rank{rank}.pt", weights_only=False)
        assert d["step"] == SAVE_STEP
        assert_same(d["restored"], d["saved"], f"rank {rank}'s restored state")
        assert_same(d["rng_after"], d["saved_rng"], f"rank {rank}'s RNG streams")


# -- faults ----------------------------------------------------------------------------------------


def data_upload(scheme: str) -> dict[str, Any]:
    """Rule arguments matching the one-request upload of a shard or rank file, never the manifest
    nor the folder's claim (``WRITER.json``; nor, on S3, the create-only probe under ``.spotjob/``
    that the Checkpointer sends first)."""
    if scheme == "s3":
        create_only = ("MANIFEST", "WRITER.json", "/.spotjob/")
        return {"method": "PUT", "match": lambda r: not any(k in r.path for k in create_only)}
    return {"method": "POST", "path": r"uploadType=multipart", "match": lambda r: "ifGenerationMatch" not in r.path}


def manifest_writes(scheme: str, proxy: FaultProxy, saves: int) -> int:
    """How often the manifest was written, by ``saves`` saves. On GCS an object's name travels in
    the upload's body, which the proxy does not see: each save's claim of its folder
    (``WRITER.json``, create-only like the manifest, once a save) is counted out."""
    if scheme == "s3":
        return sum(1 for s in proxy.seen if s.method == "PUT" and "MANIFEST" in s.path)
    return sum(1 for s in proxy.seen if s.method == "POST" and re.search(r"ifGenerationMatch=0", s.path)) - saves


@pytest.fixture(params=["s3", "gs"])
def faulty_uri(
    request: pytest.FixtureRequest,
    monkeypatch: pytest.MonkeyPatch,
    fresh_uri: Callable[[str], str],
    fault_proxy: Callable[..., FaultProxy],
    fast_retries: None,
) -> tuple[str, str, FaultProxy]:
    """(scheme, uri, proxy): a fresh bucket whose every request goes through a fault proxy."""
    scheme: str = request.param
    uri = fresh_uri(scheme)
    # The URI's owner record is written create-only like a manifest: claim it directly, so that
    # the proxy's counts see checkpoint writes only.
    claim(open_storage(uri), None)
    if scheme == "s3":
        proxy = fault_proxy(request.getfixturevalue("moto_server"), "s3")
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
    else:
        proxy = fault_proxy(request.getfixturevalue("gcs_server"), "gcs")
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", proxy.url)
    return scheme, uri, proxy


def test_a_save_rides_out_throttling_and_a_dropped_connection(
    faulty_uri: tuple[str, str, FaultProxy], tmp_path: Path
) -> None:
    scheme, uri, proxy = faulty_uri
    throttled = proxy.fail(2, 503, **data_upload(scheme))
    dropped = proxy.drop(1, when="before", **data_upload(scheme))
    saved = save_steps(uri, 1, keep=3, staging=tmp_path)
    assert (throttled.served, dropped.served) == (2, 1)
    assert manifest_writes(scheme, proxy, saves=1) == 1
    step, state = restore(uri, tmp_path)
    assert step == 1
    assert_same(state, saved[1], "the state restored after a faulty save")


@pytest.mark.parametrize("faulty_uri", ["s3"], indirect=True)
@pytest.mark.parametrize("code", ["BadDigest", "XAmzContentChecksumMismatch"])
def test_an_s3_upload_the_store_says_arrived_damaged_is_sent_again_and_the_save_commits(
    faulty_uri: tuple[str, str, FaultProxy], code: str, tmp_path: Path
) -> None:
    """S3's answer to bytes that do not match the checksum sent with them (Content-MD5, the
    CRC32C header) failed the save at once as a permanent error, where GCS retries bytes damaged
    on the way: sent again, the upload goes through."""
    scheme, uri, proxy = faulty_uri
    damaged = proxy.fail(1, 400, code=code, message="the checksum does not match the bytes", **data_upload(scheme))
    saved = save_steps(uri, 1, keep=3, staging=tmp_path)
    assert damaged.served == 1
    assert manifest_writes(scheme, proxy, saves=1) == 1
    step, state = restore(uri, tmp_path)
    assert step == 1
    assert_same(state, saved[1], "the state restored after an upload damaged on the way")


@pytest.mark.parametrize("status", [403, 503], ids=["denied", "5xx-past-the-retries"])
def test_a_save_that_cannot_upload_fails_loudly_and_commits_nothing(
    faulty_uri: tuple[str, str, FaultProxy], status: int, tmp_path: Path
) -> None:
    scheme, uri, proxy = faulty_uri
    broken = proxy.fail(10_000, status, **data_upload(scheme))
    state = make_state(0)
    control = ControlDir(str(tmp_path / "control"))
    ckpt = Checkpointer(uri, keep=3, staging_dir=str(tmp_path), control_dir=control.path)
    train(state, 1)
    ckpt.save(1, state)
    with pytest.raises(SaveFailedError, match="step 1") as failed:
        ckpt.close()
    assert broken.served >= 1
    # One sentence from the store, not the repr of its exception ("PermanentStorageError('...')").
    assert f"upload failed: {'permission denied' if status == 403 else ''}" in str(failed.value)
    assert "StorageError(" not in str(failed.value)
    reported = control.infra_error()
    if status == 503:
        # The store failed for now, not the user's code: the agent is told, so it exits 74 (no restart spent).
        assert reported is not None and "step 1" in reported["error"] and uri in reported["error"]
    else:
        # A store that refuses for good refuses the next attempt too: no infrastructure error (that is
        # retried without end); the save's error ends the script and spends a restart.
        assert reported is None, reported
    assert manifest_writes(scheme, proxy, saves=1) == 0
    assert [s for s in list_checkpoints(open_storage(uri)) if s.committed] == []
    assert restore(uri, tmp_path)[0] == 0


def test_close_lets_the_object_stores_transfer_threads_go(
    fresh_uri: Callable[[str], str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A closed Checkpointer still held (a script's variable, a list of them) kept its store's
    pool of transfer threads, up to ``concurrency`` of them each."""
    monkeypatch.setenv("SPOTJOB_STORAGE_MULTIPART_THRESHOLD", "1MiB")  # 5 MiB parts: several per shard
    monkeypatch.setenv("SPOTJOB_STORAGE_PART_SIZE", "1MiB")
    uri = fresh_uri("s3")
    state = {"model": torch.nn.Linear(1800, 1800)}  # a 13 MB shard

    def transfer_threads() -> list[str]:
        return sorted(t.name for t in threading.enumerate() if t.name.startswith("spotjob-s3"))

    held = []
    for step in (1, 2):
        with Checkpointer(uri, staging_dir=str(tmp_path / "staging")) as ckpt:
            ckpt.restore(state)
            ckpt.save(step, state)
            ckpt.wait()
            assert transfer_threads(), "the shard went up in one request: nothing to check"
        held.append(ckpt)
        assert transfer_threads() == [], f"after close(): {transfer_threads()}"
    assert [s.ref.step for s in list_checkpoints(open_storage(uri)) if s.valid] == [2, 1]
