"""``spotjob ckpt list|verify|show|export`` against real checkpoints written by ``Checkpointer``.

Most tests use the filesystem (tmp_path); the "on every store" tests repeat the essentials on S3
(moto) and GCS (fake-gcs-server) through the shared ``storage_uri`` fixture. Every tampering
goes through the Storage interface, never a local path, so any test here can move to
``saved_anywhere`` unchanged.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import pickle
import re
import socket
import stat
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from agent import Checkpointer
from agent.catalog import CheckpointRef, inspect, latest_valid, list_checkpoints
from agent.checkpoint.errors import RestoreRefusedError
from agent.crc32c import crc32c_bytes, to_hex
from agent.export import INDEX_NAME
from agent.manifest import DCP_METADATA_NAME, FORMAT_VERSION, MANIFEST_NAME, FileEntry, Manifest
from agent.ownership import OWNER_KEY, OwnershipError, attempt_key, claim, read_owner, record_attempt
from agent.storage import Storage, TransientStorageError, open_storage
from agent.storage._transfer import crc_to_b64
from agent.storage.file import FileStorage
from agent.version import spotjob_version
from orchestrator import ckpt_deep, ckpt_export, ckpt_output, ckpt_select, cli_ckpt
from orchestrator.cli import main

REPO = Path(__file__).resolve().parents[2]


# -- building checkpoints -----------------------------------------------------------------------


@dataclass
class Saved:
    uri: str
    storage: Storage
    weights: dict[int, dict[str, torch.Tensor]]  # step → the model's state_dict at that step

    def folder(self, step: int) -> str:
        return CheckpointRef(step).folder

    def key(self, step: int, name: str) -> str:
        return f"{self.folder(step)}/{name}"

    def manifest(self, step: int) -> Manifest:
        return Manifest.parse(self.storage.get_bytes(self.key(step, MANIFEST_NAME)))

    def shard(self, step: int) -> str:
        """The name of the DCP data file of a single-rank checkpoint."""
        (name,) = [f.path for f in self.manifest(step).files if f.path.endswith(".distcp")]
        return name


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))


@pytest.fixture(autouse=True)
def _restore_logging() -> Iterator[None]:
    # cli.main's logging.basicConfig binds a handler to this test's captured stderr, which is
    # closed afterwards; later tests' log lines would then hit a closed file.
    # The ckpt commands also quiet the cloud clients' loggers; give other tests theirs back.
    handlers = list(logging.root.handlers)
    levels = {name: logging.getLogger(name).level for name in cli_ckpt.NOISY_LOGGERS}
    yield
    logging.root.handlers[:] = handlers
    for name, level in levels.items():
        logging.getLogger(name).setLevel(level)


@contextlib.contextmanager
def _save_three_steps(uri: str) -> Iterator[Saved]:
    """Steps 1, 2 and 3 committed by a real Checkpointer, the model changing between them."""
    model = _model()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    weights: dict[int, dict[str, torch.Tensor]] = {}
    with Checkpointer(uri, keep=None, async_save=False) as ckpt:
        for step in (1, 2, 3):
            model(torch.randn(4, 16)).pow(2).sum().backward()
            optim.step()
            optim.zero_grad()
            ckpt.save(step, {"model": model, "optim": optim}, metadata={"lr": 1e-2, "note": f"step {step}"})
            weights[step] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    storage = open_storage(uri)
    try:
        yield Saved(uri, storage, weights)
    finally:
        storage.close()


@pytest.fixture
def saved(tmp_path: Path) -> Iterator[Saved]:
    """Three checkpoints on the filesystem: most tests here are about the CLI, not the store."""
    with _save_three_steps(str(tmp_path / "ckpts")) as s:
        yield s


@pytest.fixture
def saved_anywhere(storage_uri: str) -> Iterator[Saved]:
    """The same three checkpoints on each store (file, S3 on moto, GCS on fake-gcs-server)."""
    with _save_three_steps(storage_uri) as s:
        yield s


# -- tampering, through the Storage interface -----------------------------------------------------


def flip_byte(storage: Storage, key: str, offset: int = 64) -> None:
    data = bytearray(storage.get_bytes(key))
    data[offset] ^= 0x01
    storage.put_bytes(key, bytes(data))


def truncate(storage: Storage, key: str, by: int = 7) -> None:
    storage.put_bytes(key, storage.get_bytes(key)[:-by])


def rewrite_manifest(saved: Saved, step: int, edit: Callable[[dict[str, object]], None]) -> None:
    raw = json.loads(saved.storage.get_bytes(saved.key(step, MANIFEST_NAME)))
    edit(raw)
    saved.storage.put_bytes(saved.key(step, MANIFEST_NAME), json.dumps(raw).encode())


def replace_file_vouched(saved: Saved, step: int, name: str, data: bytes) -> None:
    """Swap a file *and* fix its manifest entry: what someone with write access to storage can do."""
    saved.storage.put_bytes(saved.key(step, name), data)
    manifest = saved.manifest(step)
    manifest.files = [
        FileEntry(path=f.path, size=len(data), crc32c=to_hex(crc32c_bytes(data))) if f.path == name else f
        for f in manifest.files
    ]
    saved.storage.put_bytes(saved.key(step, MANIFEST_NAME), manifest.to_json())


def ckpt(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = main(["ckpt", *argv])
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    return rc, out, err


# -- list -------------------------------------------------------------------------------------------


def test_list_shows_valid_invalid_and_uncommitted_rows(saved: Saved, capsys: pytest.CaptureFixture[str]) -> None:
    saved.storage.delete([saved.key(2, saved.shard(2))])
    # A save that died before its manifest: shard files, no MANIFEST.json.
    saved.storage.put_bytes(f"{CheckpointRef(4).folder}/__0_0.distcp", b"half a shard")

    rc, out, _ = ckpt(capsys, "list", saved.uri)

    assert rc == 0
    header, *rows = out.splitlines()
    assert header.split()[:2] == ["STEP", "FOLDER"]
    assert [r.split()[0] for r in rows] == ["4", "3", "2", "1"]
    assert "uncommitted" in rows[0] and "no MANIFEST.json" in rows[0]
    assert rows[1].endswith("valid") and rows[3].endswith("valid")
    assert "INVALID" in rows[2] and f"file {saved.shard(2)} is missing" in rows[2]


def test_list_reads_the_checkpoint_folders_side_by_side(
    saved: Saved, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run that keeps every checkpoint has hundreds after a few days, and ``ckpt list`` (and
    ``kubectl spotjob checkpoints``) read them one after another: two requests a folder, each a
    round trip to the bucket, minutes of silence for a few thousand. The folders are now read side
    by side. Seen through the store's own ``list`` (the one narrow seam patched): the first two
    folder listings must be in flight together, which one-at-a-time reading never is (the barrier
    then breaks after its timeout and the command fails)."""
    meeting = threading.Barrier(2, timeout=60)
    met = {"n": 0}
    original = FileStorage.list

    def listing(self: FileStorage, prefix: str = "") -> Iterator[Any]:
        if prefix.startswith("step-") and met["n"] < 2:
            met["n"] += 1
            meeting.wait()
        return original(self, prefix)

    monkeypatch.setattr(FileStorage, "list", listing)
    rc, out, _ = ckpt(capsys, "list", saved.uri)
    assert rc == 0 and [r.split()[0] for r in out.splitlines()[1:]] == ["3", "2", "1"]
    meeting.reset()
    met["n"] = 0
    assert [s.ref.step for s in list_checkpoints(saved.storage)] == [3, 2, 1]


def test_list_json_says_why_each_checkpoint_is_invalid(saved: Saved, capsys: pytest.CaptureFixture[str]) -> None:
    truncate(saved.storage, saved.key(3, saved.shard(3)))

    rc, out, _ = ckpt(capsys, "list", saved.uri, "--json")

    assert rc == 0
    rows = {r["step"]: r for r in json.loads(out)}
    assert rows[3]["valid"] is False and rows[3]["committed"] is True
    assert f"file {saved.shard(3)} is" in rows[3]["problems"][0] and "the manifest says" in rows[3]["reason"]
    assert rows[1]["valid"] is True and rows[1]["world_size"] == 1 and rows[1]["state_keys"] == ["model", "optim"]


def test_list_json_says_why_an_uncommitted_folder_is_invalid_as_verify_json_does(
    saved: Saved, capsys: pytest.CaptureFixture[str]
) -> None:
    """``list --json`` gave a save that never finished ``"valid": false`` with ``"problems": []``
    (its reason only in ``reason``), while ``verify --json --step`` of the same folder listed that
    reason in ``problems``: one folder, two answers, and a script reading ``problems`` for why a
    row is not valid found nothing. Every row that is not valid now names why in ``problems``."""
    saved.storage.put_bytes(f"{CheckpointRef(4).folder}/__0_0.distcp", b"half a shard")

    rc, out, _ = ckpt(capsys, "list", saved.uri, "--json")
    assert rc == 0
    rows = {r["step"]: r for r in json.loads(out)}
    assert rows[4]["committed"] is False and rows[4]["valid"] is False
    assert rows[4]["problems"] == [rows[4]["reason"]] and "no MANIFEST.json" in rows[4]["reason"]
    assert all(r["problems"] for r in rows.values() if not r["valid"])
    assert rows[3]["problems"] == []

    rc, out, _ = ckpt(capsys, "verify", saved.uri, "--step", "4", "--json")
    assert rc == 1
    verified = json.loads(out)
    assert verified["problems"] == rows[4]["problems"] and verified["reason"] == rows[4]["reason"]


def test_list_json_tells_a_retired_checkpoint_apart_from_a_broken_one(
    saved: Saved, capsys: pytest.CaptureFixture[str]
) -> None:
    """A fresh start (``start_fresh``) retires the checkpoints its restore refused: kept, never
    restored. The table said RETIRED but ``--json`` had no key for it (``foreign`` and ``fenced``
    had theirs), so a script saw ``valid: false`` and could only grep the reason; nor for a
    manifest of a newer format (``newer_format``)."""
    changed = nn.Linear(16, 8)  # another model: the restore refuses every checkpoint there
    with Checkpointer(saved.uri, keep=None, async_save=False, start_fresh=True) as fresh:
        assert fresh.restore({"model": changed}) == 0

    rc, out, _ = ckpt(capsys, "list", saved.uri, "--json")

    assert rc == 0
    rows = json.loads(out)
    assert [(r["step"], r["retired"], r["valid"], r["newer_format"]) for r in rows] == [
        (3, True, False, False),
        (2, True, False, False),
        (1, True, False, False),
    ], rows


# -- verify -----------------------------------------------------------------------------------------


def test_verify_checks_the_newest_committed_checkpoint_and_exits_0(
    saved: Saved, capsys: pytest.CaptureFixture[str]
) -> None:
    saved.storage.put_bytes(f"{CheckpointRef(9).folder}/__0_0.distcp", b"a save still running")

    rc, out, _ = ckpt(capsys, "verify", saved.uri)

    assert rc == 0
    assert out.startswith(f"{saved.folder(3)}: valid")


def test_verify_of_a_checkpoint_a_newer_spotjob_wrote_exits_2_not_calling_it_invalid(
    saved: Saved, capsys: pytest.CaptureFixture[str]
) -> None:
    """A manifest in a format newer than this spotjob reads is not proven bad, only unreadable here
    (a restore stops at it, export exits 2 there). ``verify`` called it "INVALID — MANIFEST.json
    refused, nothing in this folder is trusted" and exited 1, "the checkpoint is invalid": a script
    replacing checkpoints that fail verify would throw away a newer spotjob's progress. Nothing
    could be checked, so it exits 2, saying to upgrade; ``--json`` still prints the folder's
    object (``newer_format``)."""
    rewrite_manifest(saved, 3, lambda raw: raw.update(format_version=FORMAT_VERSION + 1))

    for args in (["verify"], ["verify", "--deep"], ["verify", "--step", "3"]):
        rc, out, err = ckpt(capsys, *args, saved.uri)
        assert rc == 2 and out == "", (args, out)
        assert f"{saved.folder(3)} was written by a newer spotjob" in err and "upgrade spotjob" in err, err
        assert "INVALID" not in err
    rc, out, _ = ckpt(capsys, "verify", saved.uri, "--json")
    doc = json.loads(out)
    assert rc == 2 and doc["folder"] == saved.folder(3) and doc["newer_format"] is True
    assert "newer than this spotjob reads" in doc["reason"]
    rc, out, _ = ckpt(capsys, "verify", saved.uri, "--step", "2")
    assert rc == 0 and out.startswith(f"{saved.folder(2)}: valid")


def test_verify_exits_1_naming_a_missing_file(saved: Saved, capsys: pytest.CaptureFixture[str]) -> None:
    saved.storage.delete([saved.key(2, saved.shard(2))])

    assert ckpt(capsys, "verify", saved.uri, "--step", "3")[0] == 0
    rc, out, _ = ckpt(capsys, "verify", saved.uri, "--step", "2")

    assert rc == 1
    assert f"file {saved.shard(2)} is missing" in out


def test_plain_verify_fails_on_a_truncated_file_naming_it(saved: Saved, capsys: pytest.CaptureFixture[str]) -> None:
    truncate(saved.storage, saved.key(3, saved.shard(3)))

    rc, out, _ = ckpt(capsys, "verify", saved.uri)

    assert rc == 1
    assert f"file {saved.shard(3)} is " in out and "the manifest says" in out


def test_a_flipped_shard_byte_passes_plain_verify_and_fails_deep_naming_the_file(
    saved: Saved, capsys: pytest.CaptureFixture[str]
) -> None:
    flip_byte(saved.storage, saved.key(3, saved.shard(3)), offset=1000)

    rc_plain, _, _ = ckpt(capsys, "verify", saved.uri)
    rc_deep, out, _ = ckpt(capsys, "verify", saved.uri, "--deep")

    assert rc_plain == 0  # same size: only reading the bytes can tell
    assert rc_deep == 1
    assert f"file {saved.shard(3)} is corrupt" in out and "CRC32C" in out


def test_export_passes_over_a_shard_whose_crc32c_proves_it_corrupt_as_restore_does(
    saved: Saved, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    flip_byte(saved.storage, saved.key(3, saved.shard(3)), offset=1000)  # same size: only its CRC32C tells
    out = tmp_path / "hf"

    rc, stdout, err = ckpt(capsys, "export", saved.uri, str(out))

    assert rc == 0 and saved.folder(2) in stdout
    assert "passing over step-000000003: " in err and "CRC32C" in err
    model = _model()
    state = {"model": model, "optim": torch.optim.AdamW(model.parameters(), lr=1e-2)}
    with Checkpointer(saved.uri, keep=None, async_save=False) as restoring:
        assert restoring.restore(state) == 2  # the one restore loads is the one exported
    _, exported = _read_export(out)
    assert exported.keys() == saved.weights[2].keys()
    assert all(torch.equal(exported[k], saved.weights[2][k]) for k in exported)
    # Asked for by its step, the corrupt one is refused, and nothing is written.
    rc, _, err = ckpt(capsys, "export", saved.uri, str(tmp_path / "hf3"), "--step", "3")
    assert rc == 1 and "CRC32C" in err and not (tmp_path / "hf3").exists()


def test_a_flipped_metadata_byte_fails_deep_verify_naming_metadata(
    saved: Saved, capsys: pytest.CaptureFixture[str]
) -> None:
    flip_byte(saved.storage, saved.key(3, DCP_METADATA_NAME), offset=100)

    rc, out, _ = ckpt(capsys, "verify", saved.uri, "--deep", "--json")

    assert rc == 1
    doc = json.loads(out)
    assert doc["valid"] is False and doc["deep"] is True
    assert any(p.startswith(f"file {DCP_METADATA_NAME} is corrupt") for p in doc["problems"])


def test_deep_verify_json_says_deep_only_when_it_read_the_bytes(
    saved: Saved, capsys: pytest.CaptureFixture[str]
) -> None:
    """``verify --deep --json`` of a folder whose manifest is refused read nothing (no manifest to
    check the bytes against), yet said ``deep: true``, as if every CRC32C had been checked."""
    rewrite_manifest(saved, 3, lambda raw: raw["files"][0].update(path="../escape"))  # type: ignore[index]

    rc, out, _ = ckpt(capsys, "verify", saved.uri, "--deep", "--json")
    doc = json.loads(out)
    assert rc == 1 and doc["manifest_bytes"] is None and "escapes" in doc["reason"]
    assert doc["deep"] is False
    rc, out, _ = ckpt(capsys, "verify", saved.uri, "--deep", "--json", "--step", "2")
    assert rc == 0 and json.loads(out)["deep"] is True
    rc, out, _ = ckpt(capsys, "verify", saved.uri, "--json", "--step", "2")
    assert rc == 0 and json.loads(out)["deep"] is False


def test_deep_verify_passes_an_intact_checkpoint(saved: Saved, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = ckpt(capsys, "verify", saved.uri, "--deep", "--step", "1")

    assert rc == 0
    assert "every CRC32C matches" in out


def test_a_manifest_naming_a_path_outside_its_folder_is_refused(
    saved: Saved, capsys: pytest.CaptureFixture[str]
) -> None:
    def escape(raw: dict[str, object]) -> None:
        files = raw["files"]
        assert isinstance(files, list)
        files[0]["path"] = "../escape"

    rewrite_manifest(saved, 3, escape)

    rc, out, _ = ckpt(capsys, "verify", saved.uri, "--deep")
    assert rc == 1
    assert "MANIFEST.json refused" in out and "'../escape' escapes" in out

    rc, _, err = ckpt(capsys, "show", saved.uri)
    assert rc == 1 and "'../escape' escapes" in err
    rc, _, err = ckpt(capsys, "export", saved.uri, str(Path(saved.uri).parent / "out"), "--step", "3")
    assert rc == 1 and "'../escape' escapes" in err
    # Without --step, export takes what a restore would load, and says what it passed over.
    rc, out, err = ckpt(capsys, "export", saved.uri, str(Path(saved.uri).parent / "out"))
    assert rc == 0 and "step-000000002" in out
    assert "passing over step-000000003" in err and "'../escape' escapes" in err


def test_export_names_a_checkpoint_its_reading_proves_bad_once_when_none_is_left_to_export(
    saved: Saved, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The CRC32C mismatch is found only by reading the shard: the refusal (exit 1) says it, and no
    # "passing over" line before it says it again.
    flip_byte(saved.storage, saved.key(3, saved.shard(3)))
    bad = saved.storage.url(saved.key(3, saved.shard(3)))

    rc, out, err = ckpt(capsys, "export", saved.uri, str(tmp_path / "out"), "--step", "3")

    assert rc == 1 and out == ""
    assert f"{saved.folder(3)} is invalid, refusing to export it" in err and "CRC32C" in err, err
    assert err.count(bad) == 1 and "passing over" not in err, err


class _RunsCode:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, ...]:
        return (os.system, (f"touch {self.marker}",))


def test_an_unsafe_metadata_pickle_is_flagged_by_deep_verify_and_refused_by_export(
    saved: Saved, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    marker = tmp_path / "code-ran"
    replace_file_vouched(saved, 3, DCP_METADATA_NAME, pickle.dumps(_RunsCode(str(marker))))

    rc_plain, _, _ = ckpt(capsys, "verify", saved.uri)
    rc, out, _ = ckpt(capsys, "verify", saved.uri, "--deep")
    assert rc_plain == 0  # the manifest vouches for it; only unpickling reveals it
    assert rc == 1 and f"file {DCP_METADATA_NAME} is unsafe" in out and "not a DCP metadata class" in out

    rc, _, err = ckpt(capsys, "export", saved.uri, str(tmp_path / "out"), "--step", "3")
    assert rc == 1 and "refusing to export" in err
    # Without --step, export takes what a restore would load: restore skips an unsafe .metadata.
    rc, out, err = ckpt(capsys, "export", saved.uri, str(tmp_path / "out"))
    assert rc == 0 and saved.folder(2) in out
    assert "passing over step-000000003" in err and "refusing to export" in err
    assert not marker.exists()


def test_a_rank_file_that_is_not_plain_data_fails_deep_verify(
    saved: Saved, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    marker = tmp_path / "code-ran"
    replace_file_vouched(saved, 3, "rank-00000.pt", pickle.dumps(_RunsCode(str(marker))))

    rc, out, _ = ckpt(capsys, "verify", saved.uri, "--deep")

    assert rc == 1 and "file rank-00000.pt does not load with weights_only" in out
    assert not marker.exists()


def test_deep_verify_of_a_rank_file_holding_what_this_spotjob_does_not_restore_exits_2_as_restore_refuses(
    saved_anywhere: Saved, capsys: pytest.CaptureFixture[str]
) -> None:
    """A newer spotjob keeping more in ``rank-NNNNN.pt`` (another device's RNG stream) without a new
    manifest format: ``restore()`` refuses it as a newer spotjob's, loading nothing, but ``verify
    --deep``, which loads the per-rank files "as a restore would", called it valid (exit 0). It is
    not proven bad, only unreadable here: exit 2 naming the entry and the newer spotjob, as for a
    newer manifest. ``list`` and plain ``verify`` read no per-rank file: valid there (README)."""
    saved = saved_anywhere
    payload = torch.load(io.BytesIO(saved.storage.get_bytes(saved.key(3, "rank-00000.pt"))), weights_only=True)
    payload["rng"]["xla"] = torch.zeros(4, dtype=torch.uint8)
    newer = io.BytesIO()
    torch.save(payload, newer)
    replace_file_vouched(saved, 3, "rank-00000.pt", newer.getvalue())

    rc, out, err = ckpt(capsys, "verify", saved.uri, "--deep")
    assert rc == 2 and out == "", out
    assert err.count("\n") == 1 and "INVALID" not in err, err
    assert f"{saved.folder(3)} was written by a newer spotjob" in err, err
    assert "rank-00000.pt holds rng.xla" in err and f"this spotjob ({spotjob_version()})" in err, err
    assert "upgrade spotjob" in err and "--step" in err, err
    rc, out, _ = ckpt(capsys, "verify", saved.uri, "--deep", "--json")
    doc = json.loads(out)
    assert rc == 2 and (doc["valid"], doc["undecided"], doc["newer_format"], doc["deep"]) == (False, True, True, True)
    assert "rng.xla" in doc["reason"]
    assert ckpt(capsys, "verify", saved.uri, "--deep", "--step", "2")[0] == 0
    # Only reading the per-rank files tells: list and plain verify read none.
    assert ckpt(capsys, "verify", saved.uri)[0] == 0
    rc, out, _ = ckpt(capsys, "list", saved.uri)
    assert rc == 0 and out.splitlines()[1].endswith("valid"), out

    model = _model()
    state = {"model": model, "optim": torch.optim.AdamW(model.parameters(), lr=1e-2)}
    with (
        pytest.raises(RestoreRefusedError, match="newer spotjob") as refused,
        Checkpointer(saved.uri, keep=None, async_save=False) as restoring,
    ):
        restoring.restore(state)
    assert "rng.xla" in str(refused.value)  # the same rule (rank_state.unknown_entries) decides both


def test_a_checkpoint_whose_metadata_a_newer_torch_wrote_is_undecided_by_deep_verify_and_stops_export(
    saved_anywhere: Saved, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """DCP's ``.metadata`` written under a newer torch names a dtype this torch lacks (the CLI's
    torch older than the training image's). A restore stops there, naming both torch versions;
    ``verify --deep`` and ``export`` ended in a traceback (``NewerTorchError``, exit 1). Nothing is
    proven bad: verify exits 2 (UNDECIDED), and export stops with exit 2, as restore does, never
    going back to an older step unless one is named with ``--step``. The other commands read no
    ``.metadata``. The newer torch's file is today's with its float32 renamed to a dtype no torch has."""
    saved = saved_anywhere
    data = saved.storage.get_bytes(saved.key(3, DCP_METADATA_NAME))
    newer = data.replace(b"float32", b"float99")
    assert newer != data
    replace_file_vouched(saved, 3, DCP_METADATA_NAME, newer)
    rewrite_manifest(saved, 3, lambda raw: raw.update(torch_version="99.0.0"))

    rc, out, err = ckpt(capsys, "verify", saved.uri, "--deep")
    assert rc == 2 and out == "" and err.count("\n") == 1, (out, err)
    assert f"{saved.folder(3)} cannot be checked here" in err and "INVALID" not in err, err
    assert "torch 99.0.0" in err and f"torch ({torch.__version__})" in err and "float99" in err, err
    rc, out, _ = ckpt(capsys, "verify", saved.uri, "--deep", "--json")
    doc = json.loads(out)
    assert rc == 2 and (doc["valid"], doc["undecided"], doc["newer_format"], doc["deep"]) == (False, True, False, True)
    assert "99.0.0" in doc["reason"]
    for args in (["verify"], ["show"], ["show", "--json"], ["list"]):  # MANIFEST.json only: no torch
        assert ckpt(capsys, *args, saved.uri)[0] == 0, args

    for step in ([], ["--step", "3"], ["--step", "3.0"]):
        rc, out, err = ckpt(capsys, "export", saved.uri, str(tmp_path / "hf"), *step)
        assert rc == 2 and out == "" and err.count("\n") == 1, (step, out, err)
        assert "torch 99.0.0" in err and torch.__version__ in err and "passing over" not in err, err
        assert not (tmp_path / "hf").exists()
    rc, out, _ = ckpt(capsys, "export", saved.uri, str(tmp_path / "hf"), "--step", "2")
    assert rc == 0 and saved.folder(2) in out

    model = _model()
    state = {"model": model, "optim": torch.optim.AdamW(model.parameters(), lr=1e-2)}
    with (
        pytest.raises(RestoreRefusedError, match=r"torch 99\.0\.0"),
        Checkpointer(saved.uri, keep=None, async_save=False) as restoring,
    ):
        restoring.restore(state)


# -- show -------------------------------------------------------------------------------------------


def test_show_prints_the_tensor_index_and_the_checkpoint_facts(
    saved: Saved, capsys: pytest.CaptureFixture[str]
) -> None:
    rc, out, _ = ckpt(capsys, "show", saved.uri, "--step", "2")

    assert rc == 0
    assert "step:       2" in out and "world size: 1" in out and "state keys: model, optim" in out
    assert '"note": "step 2"' in out
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.startswith(("model.", "optim."))}
    assert rows["model.0.weight"][1:4] == ["[32,", "16]", "float32"]
    assert rows["model.2.bias"][1:3] == ["[8]", "float32"]
    assert "optim.state.model.0.weight.exp_avg" in rows


def test_show_lists_tensors_by_state_key_then_by_name_with_numbers_as_numbers(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``show`` listed the tensors in DCP's order, which mixes modules and sizes (``model.2.bias``
    first, then the optimizer's step counters, then the rest): a model's layers did not read in
    order. They are listed by state key as the checkpoint lists them (here the optimizer first, as
    the state dict had it), then by name, ``layers.2`` before ``layers.10``; ``--json`` the same."""
    uri = str(tmp_path / "ckpts")
    model = nn.Sequential(*[nn.Linear(2, 2) for _ in range(12)])
    optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(1, 2)).sum().backward()
    optim.step()
    with Checkpointer(uri, async_save=False) as saver:
        saver.save(1, {"optim": optim, "model": model})

    rc, out, _ = ckpt(capsys, "show", uri)
    assert rc == 0
    names = [line.split()[0] for line in out.splitlines() if line.startswith(("model.", "optim."))]
    layers = [f"model.{i}.{p}" for i in range(12) for p in ("bias", "weight")]
    buffers = [f"optim.state.model.{i}.{p}.momentum_buffer" for i in range(12) for p in ("bias", "weight")]
    assert names == buffers + layers

    rc, out, _ = ckpt(capsys, "show", uri, "--json")
    assert rc == 0 and list(json.loads(out)["manifest"]["tensors"]) == buffers + layers


def test_show_prints_a_nan_loss_as_nan(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A loss gone NaN was recorded, and shown, as ``null``: "metadata: {"loss": null}"."""
    uri = str(tmp_path / "ckpts")
    with Checkpointer(uri, async_save=False) as saver:
        saver.save(1, {"model": _model()}, metadata={"loss": float("nan"), "scale": float("inf")})

    rc, out, _ = ckpt(capsys, "show", uri)
    assert rc == 0
    assert 'metadata:   {"loss": "nan", "scale": "inf"}' in out.splitlines()

    rc, out, _ = ckpt(capsys, "show", uri, "--json")
    assert rc == 0 and json.loads(out)["manifest"]["metadata"] == {"loss": "nan", "scale": "inf"}


class _Counter:
    """State that is not a module or optimizer: saved per rank, never as DCP tensors."""

    def __init__(self) -> None:
        self.seen = 7

    def state_dict(self) -> dict[str, int]:
        return {"seen": self.seen}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.seen = state["seen"]


def test_show_of_a_key_without_tensors_says_why_rather_than_print_a_bare_header(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    uri = str(tmp_path / "ckpts")
    with Checkpointer(uri, async_save=False) as saver:
        saver.save(1, {"model": _model(), "counter": _Counter()})

    rc, out, _ = ckpt(capsys, "show", uri, "--key", "counter")

    assert rc == 0 and "TENSOR" not in out
    assert out.splitlines()[-1].startswith("no tensors under state key 'counter': only modules and optimizers")
    rc, out, _ = ckpt(capsys, "show", uri, "--key", "model")
    assert rc == 0 and "TENSOR" in out and "model.0.weight" in out


# An OSC 0 (retitle the window) and a CSI that erases the line and moves the cursor up: what a
# crafted manifest would use to rewrite what an operator reads.
ESCAPES = "\x1b]0;owned\x07\x1b[2K\x1b[1A"


def test_text_from_a_crafted_manifest_reaches_the_terminal_with_its_control_characters_escaped(
    saved: Saved, capsys: pytest.CaptureFixture[str]
) -> None:
    def craft(raw: dict[str, object]) -> None:
        raw["torch_version"] = f"2.13{ESCAPES}"
        raw["job"] = f"train{ESCAPES}"
        raw["state_keys"] = ["model", f"optim{ESCAPES}"]
        tensors = raw["tensors"]
        assert isinstance(tensors, dict)
        fqn = next(iter(tensors))
        tensors[f"{fqn}{ESCAPES}"] = tensors.pop(fqn)

    rewrite_manifest(saved, 3, craft)

    outputs = []
    for argv in (["show", saved.uri, "--step", "3"], ["list", saved.uri], ["verify", saved.uri, "--step", "3"]):
        _, out, err = ckpt(capsys, *argv)
        outputs.append(out + err)
    rewrite_manifest(saved, 3, lambda raw: raw["files"][0].update(path=f"gone{ESCAPES}"))  # type: ignore[index]
    for argv in (["list", saved.uri], ["verify", saved.uri, "--step", "3"], ["show", saved.uri, "--step", "3"]):
        _, out, err = ckpt(capsys, *argv)
        outputs.append(out + err)

    for argv, text in zip(["show", "list", "verify"] * 2, outputs, strict=True):
        assert "\x1b" not in text and "\x07" not in text, f"spotjob ckpt {argv} printed a raw control character"
    assert "2.13\\x1b]0;owned\\x07" in outputs[0], "the escaped value is still shown"
    # A listed path with control characters refuses the manifest, naming the path (escaped).
    assert "'gone\\x1b" in outputs[4] and "contains a control character" in outputs[4], outputs[4]
    # Escaped once, the same in the reason (whose names repr quoted) as in the field: the reason read
    # 'train\\x1b]0;...', its backslashes doubled a second time.
    shown_job = "train\\x1b]0;owned\\x07\\x1b[2K\\x1b[1A"
    assert f"job:        {shown_job}\n" in outputs[0], outputs[0]
    assert f"written by job '{shown_job}'" in outputs[0] and f"written by job '{shown_job}'" in outputs[1], outputs[1]


def test_a_backslash_in_a_job_name_or_the_metadata_is_not_doubled_again_on_the_terminal(
    saved: Saved, capsys: pytest.CaptureFixture[str]
) -> None:
    """A job named ``team\\run`` (a legal name) read ``'team\\\\\\\\run'`` in a FOREIGN reason, four
    backslashes for one, while ``job:`` read ``team\\\\run``; the metadata's JSON escape of an ESC
    read ``\\\\u001b``. Found walking ``spotjob ckpt``."""

    def craft(raw: dict[str, object]) -> None:
        raw["job"] = "team\\run"
        raw["metadata"] = {"note": "hi\x1b[31m"}

    rewrite_manifest(saved, 3, craft)
    _, out, _ = ckpt(capsys, "show", saved.uri, "--step", "3")
    assert "job:        team\\run\n" in out, out
    assert "written by job 'team\\\\run'" in out, out  # repr's quoting: one escape
    assert 'metadata:   {"note": "hi\\u001b[31m"}' in out, out
    _, listed, _ = ckpt(capsys, "list", saved.uri)
    assert "written by job 'team\\\\run'" in listed and "\\\\\\\\" not in listed, listed


def test_export_escapes_the_out_folder_its_last_line_names(
    saved: Saved, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``exported … to OUT`` printed OUT as given, a control character in its name reaching the
    terminal raw, where export's other lines naming OUT (``--force``'s) escape them."""
    rc, out, err = ckpt(capsys, "export", saved.uri, str(tmp_path / f"hf{ESCAPES}"))

    assert rc == 0, err
    assert "\x1b" not in out and "\x07" not in out
    assert "hf\\x1b]0;owned\\x07" in out, out
    assert (tmp_path / f"hf{ESCAPES}" / "model.safetensors").exists()


def test_export_escapes_the_reason_it_passes_a_checkpoint_over(
    saved: Saved, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A refused manifest's reason names the crafted tensor name it was refused at.
    rewrite_manifest(saved, 3, lambda raw: raw["tensors"].update({f"x{ESCAPES}": {"shape": "bad"}}))  # type: ignore[attr-defined]

    rc, out, err = ckpt(capsys, "export", saved.uri, str(tmp_path / "hf"))

    assert rc == 0 and saved.folder(2) in out
    assert f"passing over {saved.folder(3)}" in err and "x\\x1b]0;owned" in err, err
    assert "\x1b" not in err and "\x07" not in err, "export printed a raw control character"


def test_show_json_can_narrow_to_one_state_key(saved: Saved, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = ckpt(capsys, "show", saved.uri, "--json", "--key", "model")

    assert rc == 0
    doc = json.loads(out)
    assert doc["folder"] == saved.folder(3) and doc["valid"] is True
    tensors = doc["manifest"]["tensors"]
    assert set(tensors) == {f"model.{k}" for k in saved.weights[3]}
    assert tensors["model.0.weight"]["shape"] == [32, 16]
    assert doc["manifest"]["metadata"] == {"lr": 1e-2, "note": "step 3"}


# -- export -----------------------------------------------------------------------------------------


def _read_export(out: Path) -> tuple[dict[str, object], dict[str, torch.Tensor]]:
    index = json.loads((out / INDEX_NAME).read_text())
    tensors: dict[str, torch.Tensor] = {}
    for name in sorted(set(index["weight_map"].values())):
        loaded = load_file(out / name)
        assert not set(loaded) & set(tensors), "a tensor is in two files"
        tensors.update(loaded)
    return index, tensors


def test_export_writes_the_models_state_dict_as_safetensors(
    saved: Saved, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "hf"

    rc, stdout, _ = ckpt(capsys, "export", saved.uri, str(out), "--step", "2", "--format", "safetensors")

    assert rc == 0 and "exported 4 tensors" in stdout
    assert sorted(os.listdir(out)) == sorted([INDEX_NAME, "model.safetensors"])
    index, tensors = _read_export(out)
    expected = saved.weights[2]
    assert set(index["weight_map"]) == set(expected) == set(tensors)  # type: ignore[call-overload]
    for name, value in expected.items():
        assert torch.equal(tensors[name], value), name
    assert index["metadata"] == {"total_size": sum(v.nbytes for v in expected.values())}
    with open(out / "model.safetensors", "rb") as f:  # safetensors header: u64 length, then JSON
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    assert header["__metadata__"] == {"format": "pt"}


def test_export_shards_by_max_shard_size_with_hugging_face_names(
    saved: Saved, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "hf"

    rc, _, _ = ckpt(capsys, "export", saved.uri, str(out), "--max-shard-size", "1.1KB")

    assert rc == 0
    index, tensors = _read_export(out)
    weight_map: dict[str, str] = index["weight_map"]  # type: ignore[assignment]
    files = sorted(set(weight_map.values()))
    # 0.weight (2048 bytes) is over the limit: a shard of its own. 0.bias (128) + 2.weight (1024)
    # would exceed 1100 bytes; 2.weight + 2.bias (32) fit.
    assert files == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert weight_map["0.weight"] == files[0] and weight_map["0.bias"] == files[1]
    assert weight_map["2.weight"] == weight_map["2.bias"] == files[2]
    assert sorted(os.listdir(out)) == sorted([*files, INDEX_NAME])
    for name, value in saved.weights[3].items():
        assert torch.equal(tensors[name], value), name


def test_export_of_another_state_key_strips_that_prefix(
    saved: Saved, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rc, _, _ = ckpt(capsys, "export", saved.uri, str(tmp_path / "opt"), "--key", "optim")

    assert rc == 0
    _, tensors = _read_export(tmp_path / "opt")
    assert "state.model.0.weight.exp_avg" in tensors
    # Hugging Face's file name whatever the key, as README says (pins what already worked).
    assert sorted(p.name for p in (tmp_path / "opt").iterdir()) == ["model.safetensors", "model.safetensors.index.json"]


class _WithExtraState(nn.Linear):
    def get_extra_state(self) -> dict[str, int]:
        return {"scale": 3}

    def set_extra_state(self, state: Any) -> None:
        self.extra = state


def test_export_names_the_non_tensor_entries_it_leaves_out(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Before, a module's ``_extra_state`` (and an optimizer's ``param_groups``) vanished from the
    export with exit 0 and no word: ``load_state_dict`` then failed on a key the user never saw go."""
    model = nn.Sequential(_WithExtraState(4, 4), nn.Linear(4, 2))
    uri = str(tmp_path / "ckpts")
    with Checkpointer(uri, async_save=False) as ckpt_:
        ckpt_.save(1, {"model": model})

    rc, stdout, stderr = ckpt(capsys, "export", uri, str(tmp_path / "hf"))

    assert rc == 0 and "exported 4 tensors" in stdout
    assert "1 entry of state key 'model' is not a tensor and not in the export" in stderr
    assert "'0._extra_state'" in stderr and "strict=False" in stderr
    assert "reports it missing" in stderr and "them" not in stderr, stderr
    _, tensors = _read_export(tmp_path / "hf")
    fresh = nn.Sequential(_WithExtraState(4, 4), nn.Linear(4, 2))
    assert fresh.load_state_dict(tensors, strict=False).missing_keys == ["0._extra_state"]


def test_export_refuses_a_non_empty_out_unless_forced(
    saved: Saved, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "hf"
    assert ckpt(capsys, "export", saved.uri, str(out), "--max-shard-size", "1KB")[0] == 0
    (out / "config.json").write_text("{}")

    rc, _, err = ckpt(capsys, "export", saved.uri, str(out))
    assert rc == 2 and "is not empty" in err and "--force" in err

    rc, _, _ = ckpt(capsys, "export", saved.uri, str(out), "--force", "--step", "1")
    assert rc == 0
    # The earlier three shards are gone, other files are kept.
    assert sorted(os.listdir(out)) == sorted([INDEX_NAME, "config.json", "model.safetensors"])
    _, tensors = _read_export(out)
    assert all(torch.equal(tensors[k], v) for k, v in saved.weights[1].items())


def test_export_with_force_reports_what_it_removed_as_its_other_messages_on_stderr(
    saved: Saved, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--force`` reported each file it removed from OUT as a log record (``2026-… INFO
    agent.export: --force: removed …``, one per file, OUT unescaped), while every other message of
    export is a ``spotjob ckpt export: …`` line on stderr, with what it names escaped for the
    terminal. It is one such line now, naming what was removed."""
    out = tmp_path / "hf\x1b]0;owned\x07"
    assert ckpt(capsys, "export", saved.uri, str(out), "--max-shard-size", "1KB")[0] == 0
    earlier = sorted(os.listdir(out))
    assert len(earlier) == 5  # four shards and the index

    rc, stdout, err = ckpt(capsys, "export", saved.uri, str(out), "--force", "--step", "1")

    assert rc == 0 and "exported 4 tensors" in stdout
    shards = [n for n in earlier if n != INDEX_NAME]
    assert err.splitlines() == [
        f"spotjob ckpt export: --force: removed 5 files of an earlier export from {tmp_path}/hf\\x1b]0;owned\\x07: "
        + ", ".join([*shards, INDEX_NAME])
    ], err
    assert sorted(os.listdir(out)) == sorted([INDEX_NAME, "model.safetensors"])

    # Nothing of an earlier export there: nothing to report.
    rc, _, err = ckpt(capsys, "export", saved.uri, str(tmp_path / "other"), "--force")
    assert rc == 0 and err == ""


def test_export_with_force_removes_the_partial_files_a_killed_export_left(
    saved: Saved, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """README "What a crash leaves": an export of a spotjob before 2026-12-07 killed before its
    renames left `.partial` files in OUT, to be exported again with `--force`. `--force` removed
    the earlier export's shards and index but not those hidden `.…partial` files: one a new export
    did not write again under its name (a different `--max-shard-size`, another step's sharding)
    stayed in OUT, a shard's size each. The leftovers here are written by hand under the names
    such an export gave them."""
    out = tmp_path / "hf"
    out.mkdir()
    leftovers = [".model-00002-of-00003.safetensors.partial", f".{INDEX_NAME}.partial"]
    for name in leftovers:
        (out / name).write_bytes(b"cut short")
    (out / "config.json").write_text("{}")

    rc, _, _ = ckpt(capsys, "export", saved.uri, str(out), "--force", "--step", "1")

    assert rc == 0
    assert sorted(os.listdir(out)) == sorted([INDEX_NAME, "config.json", "model.safetensors"])


def _assert_the_export_of_step_1(out: Path, saved: Saved) -> None:
    """OUT holds the export of step 1's model and nothing else: no link, the weights as saved."""
    assert sorted(os.listdir(out)) == sorted([INDEX_NAME, "model.safetensors"])
    assert not any((out / n).is_symlink() for n in os.listdir(out))
    _, tensors = _read_export(out)
    assert all(torch.equal(tensors[k], v) for k, v in saved.weights[1].items())


def test_export_with_force_never_writes_through_a_symlink_at_a_partial_name(
    saved: Saved, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Export wrote each shard and the index to ``.<name>.partial`` in OUT with a plain open, and
    chmod'ed the shard: a symlink planted under such a name (in a folder others can write, exported
    to with ``--force``) had the export's bytes written into the file it named, and that file's
    mode widened to 0644, before the link was renamed into place. Now the link is replaced."""
    out = tmp_path / "hf"
    out.mkdir()
    victims = {".model.safetensors.partial": tmp_path / "secret-a", f".{INDEX_NAME}.partial": tmp_path / "secret-b"}
    for name, victim in victims.items():
        victim.write_text("keep me")
        victim.chmod(0o600)
        (out / name).symlink_to(victim)

    rc, _, err = ckpt(capsys, "export", saved.uri, str(out), "--force", "--step", "1")

    assert rc == 0, err
    for victim in victims.values():
        assert victim.read_text() == "keep me"
        assert stat.S_IMODE(victim.stat().st_mode) == 0o600
    _assert_the_export_of_step_1(out, saved)


def test_export_into_a_shared_folder_cannot_be_made_to_write_through_a_link_swapped_in_while_it_writes(
    saved: Saved, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Export created each ``.<name>.partial`` in OUT (refusing a link there), then had safetensors
    write it by name: another user of a shared OUT could swap the new file for a symlink in
    between. safetensors 0.8 (installed here) writes a new file and renames it over the name, so
    the link was replaced, but the releases spotjob accepts (>= 0.4) include ones that write
    through it, into a file of that user's choosing. The files are now written in a folder of the
    export's own, mode 0700, whatever safetensors does. The other user is emulated at the moment
    safetensors is called: they swap the file for a link wherever the folder's mode lets a user
    other than its owner write (as the kernel would let them); the test runs as one user, so the
    mode is what the emulation reads, not a permission the kernel enforces."""
    import safetensors.torch

    out = tmp_path / "shared"
    out.mkdir()
    out.chmod(0o1777)  # like /tmp: everyone may add files
    victim = tmp_path / "victims-file"
    victim.write_text("keep me")
    victim.chmod(0o600)
    real_save_file = safetensors.torch.save_file
    attempts: list[tuple[str, bool]] = []

    def save_file_with_a_swap(tensors: Any, filename: str, metadata: Any = None) -> None:
        folder = os.path.dirname(filename)
        others_may_write = bool(stat.S_IMODE(os.stat(folder).st_mode) & 0o022)
        attempts.append((folder, others_may_write))
        if others_may_write:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(filename)
            os.symlink(victim, filename)
        real_save_file(tensors, filename, metadata=metadata)

    monkeypatch.setattr(safetensors.torch, "save_file", save_file_with_a_swap)
    rc, _, err = ckpt(capsys, "export", saved.uri, str(out), "--force", "--step", "1")

    assert victim.read_text() == "keep me"
    assert stat.S_IMODE(victim.stat().st_mode) == 0o600
    assert rc == 0, err
    assert attempts and not any(may for _, may in attempts), attempts
    _assert_the_export_of_step_1(out, saved)


def test_a_file_left_in_the_exports_working_folder_does_not_undo_the_finished_export(
    saved: Saved, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The working folder is removed once every file is renamed into OUT, whatever is still in it
    (here a file dropped beside the shard as it is written): the export stands."""
    import safetensors.torch

    real_save_file = safetensors.torch.save_file

    def save_file_and_a_stray(tensors: Any, filename: str, metadata: Any = None) -> None:
        real_save_file(tensors, filename, metadata=metadata)
        Path(filename).with_name("stray").write_bytes(b"x")

    monkeypatch.setattr(safetensors.torch, "save_file", save_file_and_a_stray)
    out = tmp_path / "hf"
    rc, _, err = ckpt(capsys, "export", saved.uri, str(out), "--step", "1")

    assert rc == 0, err
    _assert_the_export_of_step_1(out, saved)


def test_export_with_force_removes_the_working_folder_a_killed_export_left(
    saved: Saved, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An export killed before its renames leaves its hidden working folder in OUT (its shards
    in it); ``--force`` removes it with the earlier export's files and says so."""
    out = tmp_path / "hf"
    out.mkdir()
    left = out / ".spotjob-export-k1ll3d"
    left.mkdir(mode=0o700)
    (left / "model-00001-of-00002.safetensors").write_bytes(b"cut short")

    rc, _, err = ckpt(capsys, "export", saved.uri, str(out))
    assert rc == 2 and "is not empty" in err
    rc, _, err = ckpt(capsys, "export", saved.uri, str(out), "--force", "--step", "1")

    assert rc == 0, err
    assert ".spotjob-export-k1ll3d" in err
    assert sorted(os.listdir(out)) == sorted([INDEX_NAME, "model.safetensors"])


def test_an_export_into_the_folder_another_export_is_writing_into_is_refused_and_changes_nothing(
    saved: Saved, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Two exports into one OUT wrote their shards and indexes into it at once (and with
    ``--force`` one removed the other's working folder): OUT could end with one export's index and
    the other's shards. An export holds a lock on OUT while it writes; the other export is held
    here by the test (a second ``flock`` on the folder, as another process's would be)."""
    import fcntl

    out = tmp_path / "hf"
    out.mkdir()
    working = out / ".spotjob-export-0ther"
    working.mkdir(mode=0o700)
    (working / "model.safetensors").write_bytes(b"being written")
    other = os.open(out, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
        rc, _, err = ckpt(capsys, "export", saved.uri, str(out), "--force", "--step", "1")
        assert rc == 2, err
        assert f"another spotjob ckpt export is writing into {out}" in err and "wait for it" in err, err
        assert sorted(os.listdir(out)) == [".spotjob-export-0ther"]
        assert (working / "model.safetensors").read_bytes() == b"being written"
    finally:
        os.close(other)
    rc, _, err = ckpt(capsys, "export", saved.uri, str(out), "--force", "--step", "1")
    assert rc == 0, err  # once the other is gone (its lock with it), its folder is a leftover
    _assert_the_export_of_step_1(out, saved)


def test_an_export_that_finished_in_out_after_the_command_looked_is_not_mixed_with_this_one(
    saved: Saved, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``OUT is not empty`` is checked as the command starts, but an export writes only after its
    fetches: one into the same OUT could finish in between. OUT is looked at again under the lock;
    without ``--force`` the other export is left whole."""
    import agent.export

    other = tmp_path / "other"
    assert ckpt(capsys, "export", saved.uri, str(other), "--step", "1", "--max-shard-size", "1KB")[0] == 0
    out = tmp_path / "hf"
    real_fetch = agent.export._fetch

    def fetch_while_the_other_finishes(*args: Any) -> None:
        real_fetch(*args)
        out.mkdir(exist_ok=True)
        for name in os.listdir(other):
            os.link(other / name, out / name)

    monkeypatch.setattr(agent.export, "_fetch", fetch_while_the_other_finishes)
    rc, _, err = ckpt(capsys, "export", saved.uri, str(out))

    assert rc == 2 and f"{out} is not empty" in err and "--force" in err, err
    assert sorted(os.listdir(out)) == sorted(os.listdir(other))
    for name in os.listdir(other):
        assert (out / name).read_bytes() == (other / name).read_bytes()


@pytest.mark.parametrize(
    ("args", "rc", "message"),
    [
        (["--key", "nope"], 2, "no state key 'nope'; it holds model, optim: name one of them with --key"),
        (["--step", "7"], 2, "no checkpoint of step 7"),
        (["--step", "2"], 1, "is invalid, refusing to export it"),
        (["--max-shard-size", "5 parsecs"], 2, "is not a size"),
    ],
)
def test_export_refuses_what_it_cannot_do_cleanly(
    saved: Saved, tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], rc: int, message: str
) -> None:
    saved.storage.delete([saved.key(2, saved.shard(2))])
    out = tmp_path / "hf"

    if args[0] == "--max-shard-size":
        with pytest.raises(SystemExit) as exc:
            main(["ckpt", "export", saved.uri, str(out), *args])
        got, err = exc.value.code, capsys.readouterr().err
    else:
        got, _, err = ckpt(capsys, "export", saved.uri, str(out), *args)

    assert got == rc
    assert message in err
    assert not out.exists() or not os.listdir(out)


def test_a_failed_export_removes_the_folders_it_made_for_out_and_none_that_were_there(
    saved: Saved, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """OUT's missing parents are made for it; a failed export removed OUT and left those behind."""
    shard = saved.shard(3)
    entry = saved.manifest(3).file(shard)
    assert entry is not None
    # Bytes the manifest vouches for that DCP cannot load: it fails once OUT is made and written to.
    replace_file_vouched(saved, 3, shard, bytes(entry.size))
    there = tmp_path / "exports"
    there.mkdir()  # there before, and empty: not the export's to remove
    out = there / "run1" / "v3" / "hf"

    rc, stdout, err = ckpt(capsys, "export", saved.uri, str(out), "--step", "3")

    assert rc == 1 and stdout == "" and "DCP could not load" in err, err
    assert there.is_dir() and os.listdir(there) == []


def test_an_export_folder_under_a_regular_file_is_one_line_naming_it_and_exit_2(
    saved: Saved, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a_file = tmp_path / "a-file"
    a_file.write_text("not a folder")

    rc, out, err = ckpt(capsys, "export", saved.uri, str(a_file / "hf"))

    assert rc == 2 and out == ""
    assert len(err.strip().splitlines()) == 1, err
    assert f"cannot write the export in {a_file / 'hf'}" in err and "a regular file is in the way" in err
    assert a_file.read_text() == "not a folder"


def test_an_export_folder_that_is_a_dangling_link_is_named_as_one(
    saved: Saved, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    link = tmp_path / "hf"
    link.symlink_to(tmp_path / "gone")

    rc, out, err = ckpt(capsys, "export", saved.uri, str(link))

    assert rc == 2 and out == ""
    assert f"{link} is a symbolic link to {tmp_path / 'gone'}, which does not exist" in err, err
    assert link.is_symlink() and not (tmp_path / "gone").exists()


@pytest.mark.parametrize("inside", ["step-000000003/hf", "step-000000003", "step-000000009", ".spotjob/hf"])
def test_export_refuses_a_folder_in_a_checkpoint_folder_or_spotjobs_own(
    saved: Saved, capsys: pytest.CaptureFixture[str], inside: str
) -> None:
    root = Path(saved.uri)
    before = {p: p.read_bytes() for p in (root / saved.folder(3)).iterdir()}

    rc, out, err = ckpt(capsys, "export", saved.uri, str(root / inside), "--force")

    assert rc == 2 and out == ""
    assert f"lies in {saved.storage.url(inside.split('/')[0])}" in err and "Export to a folder outside it" in err, err
    assert {p: p.read_bytes() for p in (root / saved.folder(3)).iterdir()} == before
    assert not (root / inside).exists() or inside == saved.folder(3)
    # Beside the checkpoints (not in one) is fine.
    assert ckpt(capsys, "export", saved.uri, str(root / "hf"))[0] == 0


class _ObjectStoreLike(FileStorage):
    """A filesystem store that hides its local paths, so readers download as from S3/GCS."""

    def local_path(self, key: str) -> str | None:
        return None


def test_export_and_deep_verify_report_bytes_fetched_from_an_object_store(
    saved: Saved, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ckpt_select, "open_storage", lambda uri: _ObjectStoreLike(uri))
    bars: dict[str, tuple[int, list[int]]] = {}

    @contextlib.contextmanager
    def recording_bar(description: str, total: int) -> Iterator[Callable[[int], None]]:
        got: list[int] = []
        bars[description.split()[0]] = (total, got)
        yield got.append

    monkeypatch.setattr(ckpt_deep, "_progress_bar", recording_bar)
    monkeypatch.setattr(ckpt_export, "_progress_bar", recording_bar)
    manifest = saved.manifest(3)

    assert ckpt(capsys, "verify", saved.uri, "--deep")[0] == 0
    assert ckpt(capsys, "export", saved.uri, str(tmp_path / "hf"))[0] == 0

    total, got = bars["verifying"]
    assert total == sum(got) == manifest.total_bytes
    total, got = bars["fetching"]
    assert total == sum(got) == manifest.file(saved.shard(3)).size  # type: ignore[union-attr]
    _, tensors = _read_export(tmp_path / "hf")
    assert all(torch.equal(tensors[k], v) for k, v in saved.weights[3].items())


def test_progress_bars_render_on_a_terminal(
    saved: Saved, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ckpt_output, "_interactive", lambda: True)
    monkeypatch.setattr(ckpt_select, "open_storage", lambda uri: _ObjectStoreLike(uri))

    assert ckpt(capsys, "verify", saved.uri, "--deep")[0] == 0
    assert ckpt(capsys, "export", saved.uri, str(tmp_path / "hf"))[0] == 0


class _ShardsUnreachable(_ObjectStoreLike):
    """An object store that still fails every shard download after its retries (503s, say)."""

    def get_file(self, key: str, local_path: str, **kwargs: Any) -> None:
        if key.endswith(".distcp"):
            raise TransientStorageError(f"{self.url(key)}: 503 Slow Down, still failing after 6 attempts", key)
        super().get_file(key, local_path, **kwargs)


def test_an_unreachable_store_stops_export_with_exit_2_and_never_exports_an_older_checkpoint(
    saved: Saved, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ckpt_select, "open_storage", lambda uri: _ShardsUnreachable(uri))

    rc, out, err = ckpt(capsys, "export", saved.uri, str(tmp_path / "hf"))

    # A store that fails proves nothing about the checkpoint: not "invalid" (1), and no going back in time.
    assert rc == 2 and out == ""
    assert "503 Slow Down" in err and saved.folder(3) in err and "passing over" not in err
    assert not (tmp_path / "hf").exists()


# -- errors -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("uri", "message"),
    [
        ("ftp://host/ckpts", "unsupported checkpoint URI scheme 'ftp'"),
        ("s3:///ckpts", "names no bucket"),
        ("s3://b/ckpts#1", "'#' and '?' are not supported in checkpoint URIs"),
        ("{tmp}/no-such-folder", "no such folder"),
        ("{tmp}", "no checkpoints under"),
    ],
)
@pytest.mark.parametrize("command", [["list"], ["verify"], ["verify", "--deep"], ["show"]])
def test_bad_uris_get_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], uri: str, message: str, command: list[str]
) -> None:
    rc, out, err = ckpt(capsys, command[0], uri.format(tmp=tmp_path), *command[1:])

    assert rc == 2
    assert out == ""
    assert len(err.strip().splitlines()) == 1 and message in err


def test_a_uri_without_checkpoints_says_what_to_give_instead(
    storage_uri: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A URI with no ``step-…`` folders said only "no checkpoints under URI (no step-NNNNNNNNN/
    folders)". Most often it is the parent of the job's URI (a bucket for its prefix,
    ``spotjob-runs/NAME`` for ``spotjob-runs/NAME/checkpoints``): the folders in it that hold
    checkpoints are named now, and a URI with none below either says what URI to give."""
    with Checkpointer(f"{storage_uri}/run1", async_save=False) as saving:
        saving.save(1, {"model": nn.Linear(2, 2)})
    with contextlib.closing(open_storage(storage_uri)) as parent:
        job_uri = parent.url("run1")
        parent_uri = parent.uri
    empty = tmp_path / "empty"
    empty.mkdir()

    for command in (["list"], ["verify", "--deep"]):
        rc, out, err = ckpt(capsys, command[0], storage_uri, *command[1:])
        assert rc == 2 and out == "" and len(err.strip().splitlines()) == 1, err
        assert f"no checkpoints under {parent_uri}, but folders in it hold some" in err, err
        assert err.rstrip().endswith(f"e.g. {job_uri}"), err

        rc, out, err = ckpt(capsys, command[0], str(empty), *command[1:])
        assert rc == 2 and out == ""
        assert "check the URI; it is the one the job saves to" in err, err


@pytest.mark.parametrize("command", [["list"], ["verify"], ["show"]])
def test_a_checkpoints_own_folder_given_as_the_uri_is_answered_with_its_parent_and_step(
    saved: Saved, capsys: pytest.CaptureFixture[str], command: list[str]
) -> None:
    """``show`` prints each checkpoint's own URI ("checkpoint: .../step-000000002"); pasted back as
    the URI it only said "no checkpoints under" it."""
    rc, out, err = ckpt(capsys, command[0], f"{saved.uri}/{saved.folder(2)}")

    assert rc == 2 and out == ""
    assert "it is a checkpoint's own folder" in err and f"ckpts --step {saved.folder(2)}" in err, err


def test_only_uncommitted_folders_is_no_checkpoint_to_verify(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    FileStorage(str(tmp_path)).put_bytes(f"{CheckpointRef(5).folder}/__0_0.distcp", b"x")

    rc, _, err = ckpt(capsys, "verify", str(tmp_path))
    assert rc == 2 and "no committed checkpoint" in err
    # export said 1 (a checkpoint proven invalid), where show and verify say 2: nothing was proven.
    for command in (["show", str(tmp_path)], ["export", str(tmp_path), str(tmp_path.parent / "hf")]):
        rc, _, err = ckpt(capsys, *command)
        assert rc == 2 and "no committed checkpoint" in err, (command, rc, err)
    # Named explicitly, the leftover is a checkpoint that is not valid.
    rc, out, _ = ckpt(capsys, "verify", str(tmp_path), "--step", "5")
    assert rc == 1 and "uncommitted" in out


def test_list_show_and_plain_verify_never_import_torch(saved: Saved) -> None:
    code = (
        "import sys\n"
        "from orchestrator.cli import main\n"
        "rc = main(sys.argv[1:])\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
        "sys.exit(rc)\n"
    )
    for argv in (["list"], ["verify"], ["show", "--json"]):
        proc = subprocess.run(
            [sys.executable, "-c", code, "ckpt", *argv, saved.uri],
            capture_output=True, text=True, cwd=REPO, timeout=120,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("argv", [["ckpt", "list"], ["ckpt", "show", "--json"], ["status", "--json"]])
def test_a_reader_that_left_the_pipe_is_no_error(saved: Saved, tmp_path: Path, argv: list[str]) -> None:
    """`spotjob ckpt list URI | head -1`: the reader may close the pipe before the output is written."""
    read_end, write_end = os.pipe()
    os.close(read_end)  # every write now fails with EPIPE, as once `head` has left
    target = [saved.uri] if argv[0] == "ckpt" else ["--runs-dir", str(tmp_path)]
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "orchestrator.cli", *argv, *target],
            stdout=write_end, stderr=subprocess.PIPE, text=True, cwd=REPO, timeout=120,
        )  # fmt: skip
    finally:
        os.close(write_end)
    assert proc.returncode == 128 + 13 and proc.stderr == "", proc.stderr


# -- on every store ---------------------------------------------------------------------------------


def test_list_and_verify_on_every_store(saved_anywhere: Saved, capsys: pytest.CaptureFixture[str]) -> None:
    saved = saved_anywhere
    saved.storage.delete([saved.key(1, saved.shard(1))])
    truncate(saved.storage, saved.key(2, "rank-00000.pt"))
    flip_byte(saved.storage, saved.key(3, saved.shard(3)), offset=1000)
    saved.storage.put_bytes(f"{CheckpointRef(4).folder}/__0_0.distcp", b"half a shard")

    rc, out, _ = ckpt(capsys, "list", saved.uri)
    assert rc == 0
    rows = out.splitlines()[1:]
    assert [r.split()[0] for r in rows] == ["4", "3", "2", "1"]
    assert "uncommitted" in rows[0]
    assert rows[1].endswith("valid")  # a flipped byte keeps the size: list cannot see it
    assert "file rank-00000.pt is" in rows[2]
    assert f"file {saved.shard(1)} is missing" in rows[3]

    assert ckpt(capsys, "verify", saved.uri)[0] == 0
    rc, out, _ = ckpt(capsys, "verify", saved.uri, "--deep")
    assert rc == 1 and f"file {saved.shard(3)} is corrupt" in out
    rc, out, _ = ckpt(capsys, "verify", saved.uri, "--step", "2")
    assert rc == 1 and "file rank-00000.pt is" in out
    rc, out, _ = ckpt(capsys, "verify", saved.uri, "--step", "1", "--deep")
    assert rc == 1 and f"file {saved.shard(1)} is missing" in out


def test_show_and_export_on_every_store(
    saved_anywhere: Saved, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    saved = saved_anywhere

    rc, out, _ = ckpt(capsys, "show", saved.uri, "--json")
    assert rc == 0 and json.loads(out)["uri"] == saved.storage.url(saved.folder(3))
    rc, _, _ = ckpt(capsys, "export", saved.uri, str(tmp_path / "hf"), "--step", "1", "--max-shard-size", "1.1KB")
    assert rc == 0
    _, tensors = _read_export(tmp_path / "hf")
    assert set(tensors) == set(saved.weights[1])
    assert all(torch.equal(tensors[k], v) for k, v in saved.weights[1].items())


@pytest.mark.parametrize("scheme", ["s3", "gs"])
def test_a_missing_bucket_is_one_line_and_exit_2(
    scheme: str, request: pytest.FixtureRequest, capsys: pytest.CaptureFixture[str]
) -> None:
    request.getfixturevalue("moto_server" if scheme == "s3" else "gcs_server")

    rc, out, err = ckpt(capsys, "list", f"{scheme}://spotjob-no-such-bucket/jobs/run1")

    assert rc == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and "spotjob-no-such-bucket" in err


def test_an_unreachable_gcs_endpoint_is_one_line_naming_the_host_and_the_setting_and_exit_2(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, fast_retries: None
) -> None:
    with socket.socket() as s:  # a loopback port nobody listens on: connection refused at once
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("GOOGLE_CLOUD_PROJECT", "test")

    rc, out, err = ckpt(capsys, "list", "gs://spotjob-bucket/jobs/run1")

    assert rc == 2 and out == ""
    assert len(err.strip().splitlines()) == 1, err
    assert f"cannot connect to 127.0.0.1:{port} (Connection refused); check STORAGE_EMULATOR_HOST" in err
    assert "HTTPConnectionPool" not in err and "maxResults" not in err


# -- one validity, untrusted bytes, ownership ---------------------------------------------------------


def test_a_manifest_nested_100000_deep_is_one_invalid_row_and_verify_exits_1(
    saved: Saved, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    saved.storage.put_bytes(saved.key(3, MANIFEST_NAME), b"[" * 100_000 + b"]" * 100_000)

    rc, out, _ = ckpt(capsys, "list", saved.uri)
    assert rc == 0
    assert "INVALID" in out.splitlines()[1] and "nested more than" in out.splitlines()[1]
    for args in (["verify"], ["verify", "--deep"], ["show"]):
        rc, out, err = ckpt(capsys, *args, saved.uri)
        assert rc == 1 and "nested more than" in out + err, args
    rc, _, err = ckpt(capsys, "export", saved.uri, str(tmp_path / "hf"), "--step", "3")
    assert rc == 1 and "nested more than" in err
    status = latest_valid(saved.storage)  # what the controller and restore ask
    assert status is not None and status.ref == CheckpointRef(2)


def test_verify_restore_and_export_agree_that_a_manifest_listing_no_files_is_invalid(
    saved: Saved, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    def empty(raw: dict[str, object]) -> None:
        raw["files"], raw["tensors"] = [], {}

    rewrite_manifest(saved, 3, empty)

    assert not inspect(saved.storage, CheckpointRef(3)).valid  # restore's and retention's question
    for args in (["verify"], ["verify", "--deep"]):
        rc, out, _ = ckpt(capsys, *args, saved.uri)
        assert rc == 1 and "per-rank file" in out, args
    rc, _, err = ckpt(capsys, "export", saved.uri, str(tmp_path / "hf"), "--step", "3")
    assert rc == 1 and "per-rank file" in err
    rc, out, err = ckpt(capsys, "export", saved.uri, str(tmp_path / "hf"))
    assert rc == 0 and saved.folder(2) in out and "passing over step-000000003" in err


def test_export_with_nothing_valid_names_every_checkpoint_and_why(
    saved: Saved, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for step in (1, 2, 3):
        saved.storage.delete([saved.key(step, saved.shard(step))])

    rc, out, err = ckpt(capsys, "export", saved.uri, str(tmp_path / "hf"))

    assert rc == 1 and out == ""
    assert "no valid checkpoint" in err
    assert all(f"{saved.folder(step)}: file {saved.shard(step)} is missing" in err for step in (1, 2, 3))
    assert not (tmp_path / "hf").exists()


def test_export_of_a_step_takes_its_newest_valid_attempt_as_restore_does(
    saved_anywhere: Saved, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A step committed twice (``step-N``, then ``step-N.1``): ``--step N`` exported the newest
    attempt, refusing it when broken although the older attempt was valid and was what a restore
    loads. It now takes the newest valid attempt, and says which it passed over and which it took.
    On every store: an object store lists, reads and checks the attempts through other code than a
    folder does (the shards are downloaded, CRC32C-checked, to a temporary folder first)."""
    saved = saved_anywhere
    shard = saved.key(3, saved.shard(3))
    kept = saved.storage.get_bytes(shard)
    saved.storage.delete([shard])  # step 3 broken: the job restores step 2 and commits step 3 again
    model = _model()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with Checkpointer(saved.uri, keep=None, async_save=False) as again:
        assert again.restore({"model": model, "optim": optim}) == 2
        model(torch.randn(4, 16)).pow(2).sum().backward()
        optim.step()
        again.save(3, {"model": model, "optim": optim})
    retry = CheckpointRef(3, 1)
    assert saved.storage.stat(retry.key(MANIFEST_NAME)) is not None
    saved.storage.put_bytes(shard, kept)  # the first attempt whole again (an archived object brought back)
    (retry_shard,) = [f.path for f in Manifest.parse(saved.storage.get_bytes(retry.key(MANIFEST_NAME))).files
                      if f.path.endswith(".distcp")]  # fmt: skip
    retry_bytes = saved.storage.get_bytes(retry.key(retry_shard))
    saved.storage.delete([retry.key(retry_shard)])  # and the newer attempt broken

    rc, out, err = ckpt(capsys, "export", saved.uri, str(tmp_path / "hf"), "--step", "3")

    assert rc == 0 and saved.storage.url(saved.folder(3)) + " to" in out, out
    assert f"passing over {retry.folder}: file {retry_shard} is missing" in err
    assert f"exporting {saved.folder(3)}, the newest valid attempt of step 3" in err
    _, exported = _read_export(tmp_path / "hf")
    assert all(torch.equal(exported[k], saved.weights[3][k]) for k in saved.weights[3])
    restored = _model()
    with Checkpointer(saved.uri, read_only=True) as reader:
        assert reader.restore({"model": restored}) == 3
    assert all(torch.equal(restored.state_dict()[k], v) for k, v in saved.weights[3].items())

    # The broken attempt named exactly is refused; the valid one named exactly is exported.
    rc, _, err = ckpt(capsys, "export", saved.uri, str(tmp_path / "hf31"), "--step", "3.1")
    assert rc == 1 and f"{retry.folder} is invalid, refusing to export it" in err
    assert not (tmp_path / "hf31").exists()
    rc, out, _ = ckpt(capsys, "export", saved.uri, str(tmp_path / "hf30"), "--step", "3.0")
    assert rc == 0 and saved.storage.url(saved.folder(3)) + " to" in out

    # A newer attempt whose bytes prove it bad once read (its CRC32C) is passed over too.
    saved.storage.put_bytes(retry.key(retry_shard), retry_bytes)
    flip_byte(saved.storage, retry.key(retry_shard), offset=1000)
    rc, out, err = ckpt(capsys, "export", saved.uri, str(tmp_path / "hf4"), "--step", "3")
    assert rc == 0 and saved.storage.url(saved.folder(3)) + " to" in out
    assert f"passing over {retry.folder}: " in err and "CRC32C" in err

    # A broken first attempt and a whole newer one: the newer one, without a word about the older.
    saved.storage.put_bytes(retry.key(retry_shard), retry_bytes)
    saved.storage.delete([shard])
    rc, out, err = ckpt(capsys, "export", saved.uri, str(tmp_path / "hf2"), "--step", "3")
    assert rc == 0 and saved.storage.url(retry.folder) + " to" in out and err == ""

    # Neither valid: each is named, and why.
    saved.storage.delete([retry.key(retry_shard)])
    rc, out, err = ckpt(capsys, "export", saved.uri, str(tmp_path / "hf3"), "--step", "3")
    assert rc == 1 and out == "" and "no valid attempt of step 3" in err
    assert f"{retry.folder}: file {retry_shard} is missing" in err
    assert f"{saved.folder(3)}: file {saved.shard(3)} is missing" in err
    assert not (tmp_path / "hf3").exists()


def test_step_takes_a_folder_name_however_its_attempt_is_spelled(
    saved: Saved, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--step 3.0`` and ``--step step-000000003`` named the folder step-000000003, but
    ``--step step-000000003.0``, the folder name with ``.0`` as ``3.0`` has it, was refused (exit 2)."""
    for step in ("3.0", "step-000000003", "step-000000003.0", "step-3"):
        rc, out, err = ckpt(capsys, "verify", saved.uri, "--step", step, "--json")
        assert rc == 0, (step, err)
        assert (json.loads(out)["folder"], json.loads(out)["attempt"]) == (saved.folder(3), 0), step
    rc, _, err = ckpt(capsys, "verify", saved.uri, "--step", "step-000000003.1")
    assert rc == 2 and "no checkpoint step-000000003.1" in err
    with pytest.raises(SystemExit) as exited:
        main(["ckpt", "verify", saved.uri, "--step", "step-three"])
    assert exited.value.code == 2
    assert "write N, N.ATTEMPT or a folder name (step-N, step-N.ATTEMPT)" in capsys.readouterr().err


def test_another_jobs_checkpoints_are_listed_as_foreign_and_never_exported(
    saved: Saved, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    claim(saved.storage, None)  # the saving script had no job name
    rewrite_manifest(saved, 3, lambda raw: raw.update(job="intruder"))

    rc, out, _ = ckpt(capsys, "list", saved.uri)
    row = out.splitlines()[1]
    assert rc == 0 and row.split()[0] == "3" and "FOREIGN" in row and "job 'intruder'" in row
    rc, out, _ = ckpt(capsys, "list", saved.uri, "--json")
    assert [(r["step"], r["foreign"], r["valid"]) for r in json.loads(out)] == [
        (3, True, False),
        (2, False, True),
        (1, False, True),
    ]
    rc, out, _ = ckpt(capsys, "verify", saved.uri)
    assert rc == 1 and "foreign" in out
    rc, out, _ = ckpt(capsys, "export", saved.uri, str(tmp_path / "hf"))
    assert rc == 0 and saved.folder(2) in out


def test_adopt_lets_a_second_job_continue_from_the_first_jobs_checkpoints(
    saved: Saved, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    claim(saved.storage, None)
    with pytest.raises(OwnershipError, match=f"spotjob ckpt adopt {saved.storage.uri} --job second"):
        claim(saved.storage, "second")

    caplog.set_level(logging.DEBUG)
    rc, out, _ = ckpt(capsys, "adopt", saved.uri, "--job", "second")

    assert rc == 0
    assert "now belongs to job 'second'" in out and "an unnamed job up to step-000000003" in out
    # Said once, on stdout: not again as an INFO line of the log, which goes to stderr.
    assert not [r for r in caplog.records if r.levelno >= logging.INFO and "belongs to" in r.getMessage()]
    assert claim(saved.storage, "second").job == "second"
    status = latest_valid(saved.storage)
    assert status is not None and status.ref == CheckpointRef(3)
    rc, out, _ = ckpt(capsys, "adopt", saved.uri, "--job", "second")
    assert rc == 0 and "already belongs" in out
    rc, out, _ = ckpt(capsys, "list", saved.uri)
    assert ".spotjob" not in out and len(out.splitlines()) == 4


def test_adopt_repairs_an_unreadable_owner_record(saved: Saved, capsys: pytest.CaptureFixture[str]) -> None:
    saved.storage.put_bytes(OWNER_KEY, b"{" * 100_000)
    rc, out, _ = ckpt(capsys, "verify", saved.uri)
    assert rc == 1 and "unreadable" in out and "spotjob ckpt adopt" in out

    rc, out, _ = ckpt(capsys, "adopt", saved.uri, "--unnamed")

    assert rc == 0 and "now belongs to an unnamed job" in out
    owner = read_owner(saved.storage)
    assert owner is not None and owner.job is None
    assert ckpt(capsys, "verify", saved.uri)[0] == 0


def test_an_owner_record_a_newer_spotjob_wrote_makes_verify_exit_2_saying_to_upgrade(
    saved: Saved, capsys: pytest.CaptureFixture[str]
) -> None:
    """An owner record in a format this spotjob does not know proves nothing about the checkpoints
    under it: a newer spotjob wrote it. ``verify`` called every one INVALID (exit 1), which a script
    replacing checkpoints that fail verify reads as "throw it away". It cannot be checked here: exit
    2, saying to upgrade, and ``list`` and ``--json`` say the same (``undecided``). A record whose
    bytes are garbage is a broken record and stays exit 1 (``adopt`` rewrites it)."""
    doc = json.loads(saved.storage.get_bytes(OWNER_KEY))
    saved.storage.put_bytes(OWNER_KEY, json.dumps({**doc, "format": 2}).encode())

    rc, out, err = ckpt(capsys, "verify", saved.uri)
    assert rc == 2 and out == "", out
    assert f"{saved.folder(3)} cannot be checked here" in err and "upgrade spotjob" in err, err
    assert "INVALID" not in err and "makes JOB the owner" not in err
    rc, out, _ = ckpt(capsys, "verify", saved.uri, "--json")
    verified = json.loads(out)
    assert rc == 2 and (verified["valid"], verified["undecided"], verified["newer_format"]) == (False, True, True)
    rc, out, _ = ckpt(capsys, "list", saved.uri)
    assert rc == 0 and all("UNDECIDED — " in row and "newer spotjob" in row for row in out.splitlines()[1:]), out
    rc, out, _ = ckpt(capsys, "list", saved.uri, "--json")
    listed = json.loads(out)
    assert [(r["valid"], r["undecided"]) for r in listed] == [(False, True)] * 3
    assert listed[0]["reason"] == verified["reason"]
    assert latest_valid(saved.storage) is None  # restore and the controller still use none of them

    saved.storage.put_bytes(OWNER_KEY, b"not json")  # garbage: broken, proven so
    rc, out, _ = ckpt(capsys, "verify", saved.uri)
    assert rc == 1 and "INVALID" in out and "unreadable" in out and "spotjob ckpt adopt" in out
    rc, out, _ = ckpt(capsys, "verify", saved.uri, "--json")
    assert rc == 1 and json.loads(out)["undecided"] is False
    rc, out, _ = ckpt(capsys, "list", saved.uri)
    assert "UNDECIDED" not in out and out.count("INVALID — ") == 3


def _newer_owner_record(saved: Saved) -> None:
    """The URI's owner record as a newer spotjob would write it (today's, in format 2)."""
    doc = json.loads(saved.storage.get_bytes(OWNER_KEY))
    saved.storage.put_bytes(OWNER_KEY, json.dumps({**doc, "format": 2}).encode())


@pytest.mark.parametrize(
    ("record", "rc", "says"),
    [
        ({"fence": {"step": 2, "folder": "step-000000002"}}, 1, "fenced: written by attempt 0"),
        (b"[" * 100_000, 1, "nested"),
        ({}, 2, "newer spotjob"),
    ],
    ids=["fences-it", "garbage", "does-not-fence-it"],
)
def test_what_the_attempt_records_prove_wins_over_an_owner_record_a_newer_spotjob_wrote(
    saved: Saved, capsys: pytest.CaptureFixture[str], record: dict[str, object] | bytes, rc: int, says: str
) -> None:
    """Step 3 written by attempt 0, and attempt 1's record: fencing is told by the job's attempt
    records and the manifest alone, never by the owner record. With the owner record a newer
    spotjob's, ``verify`` said step 3 "cannot be checked here" (exit 2, upgrade) even where attempt
    1 resumed from step 2, which proves step 3 fenced (or where the record that tells is broken):
    exit 1, FENCED, as with a readable owner record. What the records do not prove stays undecided,
    and so do the steps no attempt record judges."""
    _judged_by_attempt_1(saved)
    key = attempt_key(None, 1)
    if isinstance(record, bytes):
        saved.storage.put_bytes(key, record)
    else:
        saved.storage.put_bytes(key, json.dumps({**json.loads(saved.storage.get_bytes(key)), **record}).encode())
    _newer_owner_record(saved)

    got, out, err = ckpt(capsys, "verify", saved.uri)
    assert got == rc and says in out + err, (out, err)
    assert ("INVALID" in out) is (rc == 1), out
    got, out, _ = ckpt(capsys, "verify", saved.uri, "--json")
    verified = json.loads(out)
    assert got == rc
    assert (verified["undecided"], verified["newer_format"], verified["fenced"]) == (
        rc == 2,
        rc == 2,
        "fenced" in says,
    )
    _, out, _ = ckpt(capsys, "list", saved.uri)
    rows = out.splitlines()[1:]
    assert ("UNDECIDED — " in rows[0]) is (rc == 2) and ("FENCED — " in rows[0]) is ("fenced" in says), rows[0]
    assert all("UNDECIDED — " in row and "newer spotjob" in row for row in rows[1:]), rows
    assert ckpt(capsys, "verify", saved.uri, "--step", "2")[0] == 2
    status = inspect(saved.storage, CheckpointRef(3))  # what restore and retention ask
    assert (status.newer_format, status.fenced) == (rc == 2, "fenced" in says)
    assert latest_valid(saved.storage) is None


def test_an_owner_record_a_newer_spotjob_wrote_is_not_passed_by_naming_another_step(
    saved: Saved, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The owner record judges every checkpoint at the URI alike: ``verify`` of one it leaves
    undecided said "name an older checkpoint with --step to verify that one", and ``export`` "or
    name an older one with --step", sending the reader to a step that is refused the same way. They
    say only what helps: upgrade. Where the newer record is an attempt record, which judges only the
    checkpoints of the attempt before it, naming another step still helps and is still said."""
    _newer_owner_record(saved)
    for step in ([], ["--step", "2"]):
        rc, out, err = ckpt(capsys, "verify", saved.uri, *step)
        assert rc == 2 and out == "" and "upgrade spotjob" in err, err
        assert f"judges every checkpoint under {saved.storage.uri} alike" in err and "--step" not in err, err
        rc, _, err = ckpt(capsys, "export", saved.uri, str(tmp_path / "out"), *step)
        assert rc == 2 and "upgrade spotjob to export it" in err and "--step" not in err, err
        assert not (tmp_path / "out").exists()

    saved.storage.put_bytes(
        OWNER_KEY, json.dumps({**json.loads(saved.storage.get_bytes(OWNER_KEY)), "format": 1}).encode()
    )
    _judged_by_attempt_1(saved)
    key = attempt_key(None, 1)
    saved.storage.put_bytes(key, json.dumps({**json.loads(saved.storage.get_bytes(key)), "format": 2}).encode())
    rc, _, err = ckpt(capsys, "verify", saved.uri)
    assert rc == 2 and "name an older checkpoint with --step" in err and "alike" not in err, err
    rc, _, err = ckpt(capsys, "export", saved.uri, str(tmp_path / "out"))
    assert rc == 2 and "or name an older one with --step" in err, err


def _judged_by_attempt_1(saved: Saved) -> None:
    """Step 3 written by attempt 0 of the (unnamed) job, and attempt 1 recorded resuming from step 3:
    step 3 is valid, judged by attempt 1's record."""
    rewrite_manifest(saved, 3, lambda raw: raw.update(attempt=0))
    record_attempt(saved.storage, None, 1, CheckpointRef(3))
    assert inspect(saved.storage, CheckpointRef(3)).valid


@pytest.mark.parametrize(
    ("record", "rc", "says"),
    [
        ({"format": 2}, 2, "newer spotjob"),
        ({"lease": "x"}, 2, "newer spotjob"),
        ({"attempt": 7}, 1, "records attempt 7"),
        ({"fence": {"step": 2, "folder": "step-000000002"}}, 1, "FENCED"),
        (b"[" * 100_000, 1, "nested"),
    ],
    ids=["newer-format", "newer-field", "contradicts", "fences-it", "garbage"],
)
def test_verify_exits_2_only_when_the_attempt_record_judging_a_checkpoint_cannot_be_read_here(
    saved: Saved, capsys: pytest.CaptureFixture[str], record: dict[str, object] | bytes, rc: int, says: str
) -> None:
    """The record of the attempt after the one that wrote a checkpoint tells whether it is fenced.
    One a newer spotjob wrote proves nothing: ``verify`` said INVALID (exit 1) and now exits 2 saying
    to upgrade. One that parses and fences the checkpoint, or contradicts where it lies, or whose bytes
    are garbage, is proven: exit 1. ``list`` and ``--json`` agree with the exit status."""
    _judged_by_attempt_1(saved)
    key = attempt_key(None, 1)
    if isinstance(record, bytes):
        saved.storage.put_bytes(key, record)
    else:
        saved.storage.put_bytes(key, json.dumps({**json.loads(saved.storage.get_bytes(key)), **record}).encode())

    got, out, err = ckpt(capsys, "verify", saved.uri)
    assert got == rc, (out, err)
    assert says.lower() in (out + err).lower(), (out, err)
    if rc == 2:
        assert out == "" and "cannot be checked here" in err and "upgrade spotjob" in err
    else:
        assert "INVALID" in out
    got, out, _ = ckpt(capsys, "verify", saved.uri, "--json")
    verified = json.loads(out)
    assert got == rc and verified["valid"] is False and verified["undecided"] is (rc == 2)
    _, out, _ = ckpt(capsys, "list", saved.uri, "--json")
    listed = {r["folder"]: r for r in json.loads(out)}
    assert (listed[saved.folder(3)]["undecided"], listed[saved.folder(3)]["reason"]) == (
        verified["undecided"],
        verified["reason"],
    )
    _, out, _ = ckpt(capsys, "list", saved.uri)
    row = next(line for line in out.splitlines() if saved.folder(3) in line)
    assert ("UNDECIDED — " in row) is (rc == 2), row
    status = latest_valid(saved.storage)  # what restore and the controller ask: never step 3
    assert status is not None and status.ref == CheckpointRef(2)


def test_export_stopping_at_a_checkpoint_a_newer_record_judges_does_not_say_a_newer_spotjob_wrote_it(
    saved: Saved, capsys: pytest.CaptureFixture[str]
) -> None:
    """Step 3's manifest is this spotjob's; the attempt record that judges it is a newer one's. The
    export stops there as a restore does, but said step 3 "was written by a newer spotjob", which
    sends the reader looking for a writer that never ran. It says the record is the newer one's."""
    _judged_by_attempt_1(saved)
    key = attempt_key(None, 1)
    saved.storage.put_bytes(key, json.dumps({**json.loads(saved.storage.get_bytes(key)), "format": 2}).encode())

    rc, _, err = ckpt(capsys, "export", saved.uri, str(Path(saved.uri).parent / "out"))
    assert rc == 2, err
    assert f"{saved.folder(3)}, the newest checkpoint a restore would consider, cannot be judged here" in err, err
    assert "a record that judges it is a newer spotjob's" in err and "upgrade spotjob to export it" in err, err
    assert "was written by a newer spotjob" not in err.split("(")[0], err

    rewrite_manifest(saved, 3, lambda raw: raw.update(format_version=FORMAT_VERSION + 1))  # a newer manifest
    rc, _, err = ckpt(capsys, "export", saved.uri, str(Path(saved.uri).parent / "out"))
    assert (
        rc == 2 and f"{saved.folder(3)}, the newest checkpoint a restore would consider, was written by a newer" in err
    )


def test_a_checkpoint_proven_broken_exits_1_even_when_its_attempt_record_cannot_be_read_here(
    saved: Saved, capsys: pytest.CaptureFixture[str]
) -> None:
    """A missing file is proven whatever the attempt record says: exit 1, not 2."""
    _judged_by_attempt_1(saved)
    key = attempt_key(None, 1)
    saved.storage.put_bytes(key, json.dumps({**json.loads(saved.storage.get_bytes(key)), "format": 2}).encode())
    saved.storage.delete([saved.key(3, saved.shard(3))])

    rc, out, _ = ckpt(capsys, "verify", saved.uri)
    assert rc == 1 and f"file {saved.shard(3)} is missing" in out and "newer spotjob" in out
    rc, out, _ = ckpt(capsys, "verify", saved.uri, "--json")
    # Proven broken, so not one a restore stops at or retention keeps for a newer spotjob either.
    assert rc == 1 and (json.loads(out)["undecided"], json.loads(out)["newer_format"]) == (False, False)
    status = inspect(saved.storage, CheckpointRef(3))
    assert not status.newer_format and not status.valid


@pytest.mark.parametrize("record", ["owner", "attempt"])
@pytest.mark.parametrize("scheme", ["s3", "gs"])
def test_a_record_storage_refuses_to_read_makes_verify_and_list_exit_2_naming_the_record_and_why(
    request: pytest.FixtureRequest,
    fresh_uri: Callable[[str], str],
    fault_proxy: Callable[..., Any],
    fast_retries: None,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    scheme: str,
    record: str,
) -> None:
    """Pins behaviour that already held: an owner or attempt record the credentials may not read
    (403) proves nothing about the checkpoints it judges. ``verify`` and ``list`` stop with exit 2
    ("cannot check"), naming the record and the permission, never calling a checkpoint invalid."""
    with _save_three_steps(fresh_uri(scheme)) as saved:
        if record == "attempt":
            _judged_by_attempt_1(saved)
    server = request.getfixturevalue("moto_server" if scheme == "s3" else "gcs_server")
    proxy = fault_proxy(server, scheme if scheme == "s3" else "gcs")
    monkeypatch.setenv("AWS_ENDPOINT_URL" if scheme == "s3" else "STORAGE_EMULATOR_HOST", proxy.url)
    name = "owner.json" if record == "owner" else "attempt-000000001.json"
    denied = proxy.fail(10_000, 403, method="GET", path=re.escape(name))

    for args in (["verify"], ["verify", "--json"], ["list"], ["list", "--json"]):
        rc, out, err = ckpt(capsys, *args, saved.uri)
        assert rc == 2 and out == "", (args, out)
        assert "permission denied" in err.lower() and name in err, (args, err)
        assert "INVALID" not in err
    assert denied.served >= 4


def test_adopt_refuses_a_job_name_no_checkpointer_can_run_as(saved: Saved, capsys: pytest.CaptureFixture[str]) -> None:
    # A name read from a file edited on Windows: the owner would be a job nothing can run as, and
    # the job's own writers would stop at their next commit.
    before = saved.storage.get_bytes(OWNER_KEY)

    rc, out, err = ckpt(capsys, "adopt", saved.uri, "--job", "train\r")

    assert rc == 2 and out == ""
    assert "--job" in err and "control characters" in err, err
    # Escaped once, as spotjob-agent --job-name and the Checkpointer print it (it read 'train\\\\r').
    assert "the job name 'train\\r' holds control characters ('\\r')" in err, err
    assert saved.storage.get_bytes(OWNER_KEY) == before


def test_adopt_needs_a_job_and_an_existing_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, _, err = ckpt(capsys, "adopt", str(tmp_path / "nowhere"), "--job", "x")
    assert rc == 2 and "no such folder" in err
    with pytest.raises(SystemExit):
        main(["ckpt", "adopt", str(tmp_path)])
    capsys.readouterr()


@pytest.mark.parametrize("scheme", ["s3", "gs"])
def test_adopt_of_a_bucket_prefix_holding_nothing_is_refused_as_a_missing_folder_is(
    scheme: str, fresh_uri: Callable[[str], str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A typo in the job's URI (jobs/rn1 for jobs/run1): on the filesystem the folder is not there
    # and adopt refuses; a bucket has no folders, and an owner record written there would judge
    # nothing while the job meant stays another's.
    uri = fresh_uri(scheme)
    rc, out, err = ckpt(capsys, "adopt", str(tmp_path / "rn1"), "--job", "second")
    assert rc == 2 and out == "" and "no such folder" in err

    rc, out, err = ckpt(capsys, "adopt", uri, "--job", "second")

    assert rc == 2 and out == ""
    assert f"nothing is stored under {uri}" in err and "nothing was changed" in err and "check the URI" in err, err
    storage = open_storage(uri)
    try:
        assert list(storage.list("")) == []
    finally:
        storage.close()


def test_adopt_of_a_checkpoints_own_folder_or_of_a_folder_above_the_uri_changes_nothing(
    saved: Saved, capsys: pytest.CaptureFixture[str]
) -> None:
    # The folder show prints, or the bucket of the job's prefix, pasted as the URI: an owner record
    # there would sit inside a committed checkpoint, or judge nothing, and the job's URI stays as it was.
    parent = saved.uri.rstrip("/").rpartition("/")[0]
    before = saved.storage.get_bytes(OWNER_KEY)
    files = sorted(i.key for i in saved.storage.list(saved.folder(3) + "/"))

    rc, out, err = ckpt(capsys, "adopt", f"{saved.uri}/{saved.folder(3)}", "--job", "second")
    assert rc == 2 and out == ""
    assert "checkpoint's own folder" in err and f"adopt the URI its job saves to, {saved.storage.uri}" in err, err
    assert sorted(i.key for i in saved.storage.list(saved.folder(3) + "/")) == files

    rc, out, err = ckpt(capsys, "adopt", parent, "--job", "second")
    assert rc == 2 and out == ""
    assert "folders in it hold some" in err and saved.storage.uri in err, err
    above = open_storage(parent)
    try:
        assert above.stat(OWNER_KEY) is None
    finally:
        above.close()

    assert saved.storage.get_bytes(OWNER_KEY) == before


def test_a_manifest_damaged_where_it_is_kept_makes_its_checkpoint_invalid_on_s3(
    fresh_uri: Callable[[str], str],
    s3_client: Any,
    fast_retries: None,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A MANIFEST.json whose bytes never match the CRC32C the store keeps for it (stored here by
    plain boto3 with the CRC32C of other bytes: damaged at rest) failed every read as a transient
    fault: `list`/`verify` exited 2 without calling the checkpoint invalid and a restore said the
    store was unavailable, forever. It is invalid, as a manifest that is not JSON is: restore takes
    the one before it, `list` says why, `verify` exits 1."""
    uri = fresh_uri("s3")
    with _save_three_steps(uri) as saved:
        bucket, prefix = urlparse(uri).netloc, urlparse(uri).path.strip("/")
        key = f"{prefix}/{saved.key(3, MANIFEST_NAME)}"
        body = s3_client.get_object(Bucket=bucket, Key=key)["Body"].read()
        s3_client.put_object(
            Bucket=bucket,
            Key=key,
            Body=body,
            ChecksumAlgorithm="CRC32C",
            ChecksumCRC32C=crc_to_b64(crc32c_bytes(body + b" ")),
        )

        rc, out, _ = ckpt(capsys, "list", uri, "--json")
        assert rc == 0
        rows = {r["step"]: r for r in json.loads(out)}
        assert rows[3]["valid"] is False and "is damaged" in rows[3]["reason"], rows[3]
        assert "do not match the CRC32C the store keeps" in rows[3]["reason"], rows[3]
        assert rows[2]["valid"] is True

        rc, out, err = ckpt(capsys, "verify", uri, "--step", "3")
        assert rc == 1, out + err
        assert "is damaged" in out + err and "unavailable" not in out + err, out + err

        model = _model()
        optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
        with Checkpointer(uri, keep=None, async_save=False) as again:
            assert again.restore({"model": model, "optim": optim}) == 2
        assert all(torch.equal(v, saved.weights[2][k]) for k, v in model.state_dict().items())


def test_a_damaged_checkpoint_above_the_next_attempts_fence_is_invalid_first_and_not_said_to_come_after_it(
    saved: Saved, capsys: pytest.CaptureFixture[str]
) -> None:
    """An interrupt flush of attempt 0 committed step 3, a file of it was damaged, and attempt 1 was
    recorded resuming from step 2 (the newest that loaded). `list` said FENCED, 'written ... after
    attempt 1 was recorded ... (a worker that should have stopped)': false of a checkpoint committed
    before attempt 1 started, and it hid the damage. Found walking the CLI as a user. Now INVALID,
    naming the damage first; the fence is said as what it is (newer than the step resumed from)."""
    rewrite_manifest(saved, 3, lambda raw: raw.update(attempt=0))
    truncate(saved.storage, saved.key(3, saved.shard(3)))
    record_attempt(saved.storage, None, 1, CheckpointRef(2))
    _, out, _ = ckpt(capsys, "list", saved.uri)
    row = next(line for line in out.splitlines() if saved.folder(3) in line)
    assert "INVALID — " in row and "FENCED" not in row, row
    assert row.index("bytes") < row.index("fenced: written by attempt 0 of an unnamed job, newer than step-000000002,")
    assert "after attempt" not in row
