"""Corrupt, tampered and malicious checkpoints are refused; restore falls back to the one before.

A job committed step 1 and step 2 (one process, filesystem store). Each test damages step 2 and
restores into fresh objects: the restore must return step 1 with step 1's exact state and log why
it skipped step 2. The malicious cases also fix up the manifest's size and CRC32C, so that only
the unpicklers stand between the bytes and code execution; their payload would create a marker
file, which must never appear.
"""

from __future__ import annotations

import dataclasses
import io
import json
import logging
import os
import pickle
import shlex
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

from agent.catalog import CheckpointRef, inspect, verify_deep
from agent.checkpoint import Checkpointer, RestoreRefusedError
from agent.crc32c import crc32c_bytes, to_hex
from agent.dcp_safe import load_dcp_metadata
from agent.manifest import DCP_METADATA_NAME, MANIFEST_NAME
from agent.storage import open_storage

sys.path.insert(0, str(Path(__file__).resolve().parent / "scripts"))
import ckpt_harness as harness
from ckpt_compare import assert_same
from ckpt_state import make_state, snapshot, train

STEP2 = "step-000000002"


class RunsShell:
    """Unpickling this runs a shell command: what a crafted checkpoint would carry."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (os.system, (self.command,))


@pytest.fixture(scope="module")
def committed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """A store holding committed steps 1 and 2; returns it with a snapshot of step 1's state."""
    root = tmp_path_factory.mktemp("corruption") / "ckpt"
    state = make_state(0)
    with Checkpointer(str(root), keep=None, async_save=False) as ckpt:
        train(state, 2)
        ckpt.save(1, state)
        step1 = snapshot(state)
        train(state, 2, start=2)
        ckpt.save(2, state)
    return root, step1


@pytest.fixture
def store(committed: tuple[Path, dict[str, Any]], tmp_path: Path) -> Path:
    """A private copy of the committed store for one test to damage."""
    root = tmp_path / "ckpt"
    shutil.copytree(committed[0], root)
    return root


@pytest.fixture
def marker(tmp_path: Path) -> Path:
    return tmp_path / "PWNED"


def restore(root: Path) -> tuple[int, dict[str, Any]]:
    state = make_state(0, seed=9)
    with Checkpointer(str(root), keep=None) as ckpt:
        step = ckpt.restore(state)
    return step, snapshot(state)


def skip_reasons(caplog: pytest.LogCaptureFixture) -> str:
    return "\n".join(r.getMessage() for r in caplog.records if "skipping" in r.getMessage() and STEP2 in r.getMessage())


def assert_falls_back_to_step_1(root: Path, step1: dict[str, Any], caplog: pytest.LogCaptureFixture) -> str:
    """Restore; it must land on step 1 exactly and say why step 2 was skipped. Returns the reason."""
    caplog.set_level(logging.INFO, logger="agent")
    step, restored = restore(root)
    assert step == 1
    assert_same(restored, step1, "the state restored from step 1")
    reason = skip_reasons(caplog)
    assert reason, "restore skipped step 2 without saying why"
    return reason


def edit_manifest(folder: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    doc = json.loads((folder / MANIFEST_NAME).read_text())
    edit(doc)
    (folder / MANIFEST_NAME).write_text(json.dumps(doc))


def replace_sealed(folder: Path, name: str, data: bytes) -> None:
    """Write ``data`` as ``name`` and record its true size and CRC32C in the manifest."""
    (folder / name).write_bytes(data)

    def reseal(doc: dict[str, Any]) -> None:
        (entry,) = [f for f in doc["files"] if f["path"] == name]
        entry["size"], entry["crc32c"] = len(data), to_hex(crc32c_bytes(data))

    edit_manifest(folder, reseal)


# -- corruption ----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["__0_0.distcp", DCP_METADATA_NAME])
def test_a_flipped_byte_is_reported_by_verify_deep_and_restore_falls_back(
    name: str, store: Path, committed: tuple[Path, dict[str, Any]], caplog: pytest.LogCaptureFixture
) -> None:
    harness.flip_byte(store / STEP2 / name)
    storage = open_storage(str(store))

    status = inspect(storage, CheckpointRef(2))
    assert status.valid, "a same-size flip is invisible to the cheap check; only the bytes tell"
    problems = verify_deep(storage, status)
    assert len(problems) == 1 and name in problems[0] and "corrupt" in problems[0]
    assert verify_deep(storage, inspect(storage, CheckpointRef(1))) == []

    reason = assert_falls_back_to_step_1(store, committed[1], caplog)
    assert name in reason and "CRC32C" in reason


# -- tampered manifests --------------------------------------------------------------------------


def _file(doc: dict[str, Any], name: str) -> dict[str, Any]:
    return next(f for f in doc["files"] if f["path"] == name)


TAMPERINGS: dict[str, Callable[[dict[str, Any]], None]] = {
    "size-edited": lambda d: _file(d, "__0_0.distcp").update(size=_file(d, "__0_0.distcp")["size"] + 1),
    "path-escapes": lambda d: _file(d, "rank-00000.pt").update(path="../x"),
    "path-absolute": lambda d: _file(d, "rank-00000.pt").update(path="/etc/passwd"),
    "step-mismatch": lambda d: d.update(step=5),
}


@pytest.mark.parametrize("tamper", [*TAMPERINGS, "invalid-json"])
def test_a_tampered_manifest_is_refused(
    tamper: str, store: Path, committed: tuple[Path, dict[str, Any]], caplog: pytest.LogCaptureFixture
) -> None:
    folder = store / STEP2
    if tamper == "invalid-json":
        (folder / MANIFEST_NAME).write_bytes((folder / MANIFEST_NAME).read_bytes()[:-40])
    else:
        edit_manifest(folder, TAMPERINGS[tamper])

    status = inspect(open_storage(str(store)), CheckpointRef(2))
    assert status.committed and not status.valid
    expected = {
        "size-edited": "the manifest says",
        "path-escapes": "../x",
        "path-absolute": "/etc/passwd",
        "step-mismatch": "says step 5",
        "invalid-json": "not valid JSON",
    }[tamper]
    assert expected in status.reason
    reason = assert_falls_back_to_step_1(store, committed[1], caplog)
    assert expected in reason


def _first_tensor(doc: dict[str, Any]) -> dict[str, Any]:
    return doc["tensors"][sorted(doc["tensors"])[0]]


def _rename_a_state_key(doc: dict[str, Any]) -> None:
    """The optimizer's state key, one letter changed ("optim" → "optio"); the model's stays, for export's --key."""
    key = "optim"
    assert any(fqn.startswith(f"{key}.") for fqn in doc["tensors"])
    doc["state_keys"][doc["state_keys"].index(key)] = key[:-1] + chr(ord(key[-1]) ^ 2)


SILENT_DAMAGE: dict[str, Callable[[dict[str, Any]], None]] = {
    "a shape": lambda d: _first_tensor(d).update(shape=[n + 10 for n in _first_tensor(d)["shape"]]),
    "a dtype": lambda d: _first_tensor(d).update(dtype="float22"),
    "a state key": _rename_a_state_key,
}


@pytest.mark.parametrize("damage", SILENT_DAMAGE)
def test_a_manifest_damaged_where_only_metadata_tells_is_passed_over_and_verify_deep_finds_it(
    damage: str,
    store: Path,
    committed: tuple[Path, dict[str, Any]],
    caplog: pytest.LogCaptureFixture,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
) -> None:
    """A flipped bit in the manifest's tensor index or state keys (the manifest has no checksum of
    its own): the restore took it at its word, refused the model as changed ("the checkpoint holds
    shape [22, 16]") or a state key as missing, and stopped there naming start_fresh, with step 1
    valid beside it; a dtype nobody has loaded anyway. And verify --deep called the state-key case
    valid. DCP's .metadata (under the manifest's CRC32C) says what the manifest should."""
    from orchestrator.ckpt_deep import _check_unpickling

    edit_manifest(store / STEP2, SILENT_DAMAGE[damage])
    storage = open_storage(str(store))
    status = inspect(storage, CheckpointRef(2))
    assert status.valid, "the cheap check cannot see it"
    assert any("disagrees with" in p or "under none of" in p for p in _check_unpickling(storage, status, skip=set()))
    assert _check_unpickling(storage, inspect(storage, CheckpointRef(1)), skip=set()) == []

    reason = assert_falls_back_to_step_1(store, committed[1], caplog)
    assert "damaged" in reason and DCP_METADATA_NAME in reason, reason
    # An eval polling newest_step() passes over it once a restore proved it damaged (else it named
    # step 2 at every poll, and each poll restored step 1 again).
    with Checkpointer(str(store), read_only=True) as reader:
        assert reader.newest_step() == 2
        assert reader.restore(make_state(0, seed=9)) == 1
        assert reader.newest_step() == 1
    # export takes the one a restore loads (it exported step 2 from .metadata, silently).
    from orchestrator.cli import main

    assert main(["ckpt", "export", str(store), str(tmp_path / "export")]) == 0
    err = capsys.readouterr().err
    assert "passing over step-000000002" in err and "damaged" in err, err
    assert (tmp_path / "export" / "model.safetensors").exists()


# -- malicious pickles ---------------------------------------------------------------------------


def _metadata_with_payload(folder: Path, marker: Path) -> bytes:
    """Genuine DCP metadata with the payload tucked inside, where a lax unpickler would run it."""
    metadata = load_dcp_metadata((folder / DCP_METADATA_NAME).read_bytes())
    metadata.planner_data = RunsShell(f"touch {shlex.quote(str(marker))}")
    return pickle.dumps(metadata)


@pytest.mark.parametrize("where", ["bare", "inside-real-metadata"])
def test_a_malicious_metadata_pickle_is_refused_without_running_it(
    where: str,
    store: Path,
    committed: tuple[Path, dict[str, Any]],
    marker: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    folder = store / STEP2
    if where == "bare":
        payload = pickle.dumps(RunsShell(f"touch {shlex.quote(str(marker))}"))
    else:
        payload = _metadata_with_payload(folder, marker)
    replace_sealed(folder, DCP_METADATA_NAME, payload)
    storage = open_storage(str(store))
    assert verify_deep(storage, inspect(storage, CheckpointRef(2))) == []  # sizes and CRCs all match

    reason = assert_falls_back_to_step_1(store, committed[1], caplog)
    assert "references posix.system" in reason and "refusing" in reason
    assert not marker.exists()


def test_a_malicious_rank_file_is_refused_by_weights_only_loading(
    store: Path, committed: tuple[Path, dict[str, Any]], marker: Path, caplog: pytest.LogCaptureFixture
) -> None:
    folder = store / STEP2
    evil = {
        "step": 2,
        "rank": 0,
        "world_size": 1,
        "objects": {"counter": RunsShell(f"touch {shlex.quote(str(marker))}")},
        "rng": {},
    }
    buf = io.BytesIO()
    torch.save(evil, buf)
    replace_sealed(folder, "rank-00000.pt", buf.getvalue())

    reason = assert_falls_back_to_step_1(store, committed[1], caplog)
    assert "refused without running it" in reason and "posix.system" in reason
    assert not marker.exists()


def plant_malicious_value(folder: Path, marker: Path, *, in_model: bool = False) -> str:
    """Re-point a value at a pickle that runs code: an optimizer hyper-parameter, or (``in_model``)
    the model's last tensor, whose record then no longer reads in place and goes through DCP's
    ``torch.load`` after the model's other tensors were read into the live model."""
    metadata = load_dcp_metadata((folder / DCP_METADATA_NAME).read_bytes())
    if in_model:
        fqn = [
            k
            for k, v in metadata.state_dict_metadata.items()
            if isinstance(v, TensorStorageMetadata) and k.startswith("model")
        ][-1]
    else:
        fqn = next(
            k
            for k, v in metadata.state_dict_metadata.items()
            if isinstance(v, BytesStorageMetadata) and k.startswith("optim") and k.endswith(".lr")
        )
    index = next(i for i in metadata.storage_data if i.fqn == fqn)
    info = metadata.storage_data[index]
    buf = io.BytesIO()
    torch.save(RunsShell(f"touch {shlex.quote(str(marker))}"), buf)
    shard = folder / info.relative_path
    data = shard.read_bytes()
    metadata.storage_data[index] = dataclasses.replace(info, offset=len(data), length=len(buf.getvalue()))
    replace_sealed(folder, info.relative_path, data + buf.getvalue())
    replace_sealed(folder, DCP_METADATA_NAME, pickle.dumps(metadata))
    return fqn


def test_a_malicious_value_inside_a_shard_is_refused_by_weights_only_loading(
    store: Path, committed: tuple[Path, dict[str, Any]], marker: Path, caplog: pytest.LogCaptureFixture
) -> None:
    fqn = plant_malicious_value(store / STEP2, marker)
    reason = assert_falls_back_to_step_1(store, committed[1], caplog)
    assert fqn in reason and "not plain data" in reason and "posix.system" in reason
    assert not marker.exists()


def test_when_every_checkpoint_is_corrupt_restore_refuses_and_touches_nothing(
    store: Path, caplog: pytest.LogCaptureFixture
) -> None:
    for step in (1, 2):
        harness.flip_byte(store / f"step-{step:09d}" / "__0_0.distcp")
    before = sorted(p.relative_to(store).as_posix() for p in store.rglob("*"))
    caplog.set_level(logging.INFO, logger="agent")
    state = make_state(0, seed=9)
    with Checkpointer(str(store), keep=1) as ckpt, pytest.raises(RestoreRefusedError) as refused:
        ckpt.restore(state)
    message = str(refused.value)
    # Names every checkpoint tried and the first failure, and how to start fresh on purpose.
    assert "step-000000002" in message and "step-000000001" in message and "CRC32C" in message
    assert "start_fresh=True" in message and "SPOTJOB_START_FRESH=1" in message
    assert [url.rsplit("/", 1)[-1] for url, _ in refused.value.tried] == ["step-000000002", "step-000000001"]
    # Every file is CRC-checked before DCP copies from it: the state is untouched, nothing deleted.
    assert_same(snapshot(state), snapshot(make_state(0, seed=9)), "the untouched initial state")
    assert sorted(p.relative_to(store).as_posix() for p in store.rglob("*")) == before
    assert len(skip_reasons(caplog).splitlines()) == 1


def test_restore_refuses_to_go_on_when_every_checkpoint_failed_after_a_partial_load(
    store: Path, marker: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # The model's other tensors are read into it before the refused one: continuing from step 0
    # with them would be a silent mix, so restore refuses and says the state is mixed.
    for step in (1, 2):
        plant_malicious_value(store / f"step-{step:09d}", marker, in_model=True)
    caplog.set_level(logging.INFO, logger="agent")
    with pytest.raises(RestoreRefusedError) as refused:
        restore(store)
    # Verified bytes that fail to load are not proven bad, so no older checkpoint is tried.
    assert "after part of it was loaded into the state" in str(refused.value)
    assert "Weights only load failed" in str(refused.value)
    assert [url.rsplit("/", 1)[-1] for url, _ in refused.value.tried] == [STEP2]
    assert not marker.exists()


def test_a_refused_optimizer_value_is_found_before_the_model_changes(
    store: Path, marker: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # The optimizer's state is read (into fresh tensors) before anything goes into the live model:
    # when every checkpoint carries a refused value there, the state is left as it was.
    for step in (1, 2):
        plant_malicious_value(store / f"step-{step:09d}", marker)
    caplog.set_level(logging.INFO, logger="agent")
    state = make_state(0, seed=9)
    with Checkpointer(str(store), keep=None) as ckpt, pytest.raises(RestoreRefusedError) as refused:
        ckpt.restore(state)
    assert "Nothing was deleted and the state is unchanged" in str(refused.value)
    assert_same(snapshot(state), snapshot(make_state(0, seed=9)), "the untouched initial state")
    assert len(skip_reasons(caplog).splitlines()) == 1
    assert not marker.exists()


def test_spotjob_ckpt_commands_never_run_a_malicious_tensor_record_and_export_refuses_it_in_one_line(
    store: Path, marker: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Export loads the model's tensors (through DCP's own tensor path and the in-place one); the
    # other commands read the manifest, .metadata and the per-rank files.
    from orchestrator.cli import main

    plant_malicious_value(store / STEP2, marker, in_model=True)
    for argv in (
        ["list", str(store)],
        ["show", str(store), "--step", "2"],
        ["verify", str(store), "--step", "2", "--deep"],
    ):
        main(["ckpt", *argv])
    capsys.readouterr()
    out = tmp_path / "export"

    rc = main(["ckpt", "export", str(store), str(out), "--step", "2"])

    err = capsys.readouterr().err
    assert not marker.exists()
    assert rc == 1 and "Traceback" not in err, err
    assert "could not load" in err and "refused without running it" in err and "posix.system" in err
    assert "weights_only` set to `False`" not in err, "the refusal passes on torch's advice to turn the check off"
    assert not out.exists(), "export left a folder behind for a refused checkpoint"


def claim_a_huge_tensor(folder: Path, how: str) -> str:
    """Reseal ``.metadata`` so that an optimizer tensor claims 2**50 elements (4 PiB): only its
    size (``size``), or its size and its one chunk's (``chunk``), or its region in the shard file
    (``region``: past the file's end); or a shape of 200 000 dimensions (``dims``: a product of
    them multiplied ever longer integers, and the reason quoted the shape whole), or a region at an
    offset of 5 001 digits (``offset``: more than Python turns into text)."""
    metadata = load_dcp_metadata((folder / DCP_METADATA_NAME).read_bytes())
    fqn = next(
        k
        for k, v in metadata.state_dict_metadata.items()
        if isinstance(v, TensorStorageMetadata) and k.startswith("optim") and k.endswith("exp_avg")
    )
    md = metadata.state_dict_metadata[fqn]
    assert isinstance(md, TensorStorageMetadata)
    huge = torch.Size([2**50])
    if how == "dims":
        huge = torch.Size([2] * 200_000)
    if how in ("region", "offset"):
        index = next(i for i in metadata.storage_data if i.fqn == fqn)
        info = metadata.storage_data[index]
        if how == "offset":
            metadata.storage_data[index] = dataclasses.replace(info, offset=10**5000)
        else:
            metadata.storage_data[index] = dataclasses.replace(info, length=2**50)
    else:
        metadata.state_dict_metadata[fqn] = dataclasses.replace(md, size=huge)
        if how in ("chunk", "dims"):
            (chunk,) = md.chunks
            md.chunks[0] = dataclasses.replace(chunk, sizes=huge)
    replace_sealed(folder, DCP_METADATA_NAME, pickle.dumps(metadata))
    return fqn


@pytest.mark.parametrize("how", ["size", "chunk", "region", "dims", "offset"])
def test_a_metadata_claiming_a_tensor_bigger_than_its_files_is_skipped_before_anything_is_allocated(
    how: str,
    store: Path,
    committed: tuple[Path, dict[str, Any]],
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A load allocates every optimizer tensor (and an export every tensor) at the size .metadata
    claims, and maps its pages, before reading a byte: a crafted size failed the allocation (restore
    refused to go on instead of skipping the checkpoint) or, a little smaller, took the node's memory."""
    from orchestrator.cli import main

    fqn = claim_a_huge_tensor(store / STEP2, how)
    reason = assert_falls_back_to_step_1(store, committed[1], caplog)
    assert "unsafe" in reason and DCP_METADATA_NAME in reason and fqn in reason, reason[:2000]
    assert len(reason) < 2000, f"the reason quotes crafted values whole ({len(reason)} characters)"

    out = tmp_path / "export"
    rc = main(["ckpt", "export", str(store), str(out), "--step", "2", "--key", "optim"])
    err = capsys.readouterr().err
    assert rc == 1 and "Traceback" not in err and fqn in err and DCP_METADATA_NAME in err, err[-2000:]
    assert not out.exists()


def test_a_manifest_damaged_where_only_metadata_tells_is_passed_over_on_every_store(storage_uri: str) -> None:
    """The same check on S3 and GCS, where rank 0 fetches ``.metadata`` into the node's restore
    cache (once per node: the load then takes that copy) and removes it when the manifest is damaged."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    with Checkpointer(storage_uri, async_save=False) as ckpt:
        ckpt.save(1, {"model": model})
        step1 = {k: v.clone() for k, v in model.state_dict().items()}
        with torch.no_grad():
            model.weight.add_(1.0)
        ckpt.save(2, {"model": model})
    storage = open_storage(storage_uri)
    key = f"{STEP2}/{MANIFEST_NAME}"
    doc = json.loads(storage.get_bytes(key))
    doc["tensors"]["model.weight"]["shape"] = [2, 4]  # a flipped bit: 3 → 2
    storage.delete([key])
    storage.put_bytes(key, json.dumps(doc).encode())
    fresh = torch.nn.Linear(4, 3)
    with Checkpointer(storage_uri, async_save=False) as ckpt:
        assert ckpt.restore({"model": fresh}) == 1
    for name, tensor in step1.items():
        assert torch.equal(fresh.state_dict()[name], tensor), name
