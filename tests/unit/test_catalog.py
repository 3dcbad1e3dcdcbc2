"""One decision of validity (agent.catalog.inspect), on a real folder store, for what restore,
retention, the controller and ``spotjob ckpt`` all ask: can this checkpoint be used?"""

from __future__ import annotations

import json
import os
import tracemalloc
from datetime import UTC, datetime
from typing import Any

import pytest

from agent.catalog import CheckpointRef, inspect, latest_valid, list_checkpoints, verify_deep
from agent.crc32c import crc32c_bytes, to_hex
from agent.manifest import (
    DCP_METADATA_NAME,
    MANIFEST_NAME,
    MAX_MANIFEST_BYTES,
    FileEntry,
    Manifest,
    ManifestError,
    TensorEntry,
    rank_file_name,
)
from agent.storage import CorruptObjectError, TransientStorageError
from agent.storage.file import FileStorage

T0 = datetime(2025, 1, 1, tzinfo=UTC)


@pytest.fixture
def storage(tmp_path: Any) -> FileStorage:
    return FileStorage(str(tmp_path / "ckpt"))


def write(
    storage: FileStorage, step: int, files: dict[str, bytes], *, world_size: int = 1, **fields: Any
) -> CheckpointRef:
    """Files first, then a manifest listing exactly ``files`` (plus ``fields``), create-only."""
    ref = CheckpointRef(step)
    for name, data in files.items():
        storage.put_bytes(ref.key(name), data)
    manifest = Manifest(
        step=step,
        world_size=world_size,
        created_at=T0,
        torch_version="test",
        state_keys=["model"],
        files=[FileEntry(path=n, size=len(d), crc32c=to_hex(crc32c_bytes(d))) for n, d in files.items()],
        **fields,
    )
    storage.put_bytes_if_absent(ref.key(MANIFEST_NAME), manifest.to_json())
    return ref


def manifest_doc(files: list[dict[str, Any]]) -> dict[str, Any]:
    """The JSON of step 5's manifest listing ``files`` as given: ``Manifest`` itself would refuse
    the names the tests below craft before they could be written."""
    doc = {"step": 5, "world_size": 1, "created_at": T0.isoformat(), "torch_version": "test"}
    return {**doc, "state_keys": ["model"], "files": files}


def test_a_complete_checkpoint_is_valid(storage: FileStorage) -> None:
    ref = write(
        storage,
        5,
        {rank_file_name(0): b"r0", rank_file_name(1): b"r1", DCP_METADATA_NAME: b"m", "__0_0.distcp": b"t"},
        world_size=2,
        tensors={"model.w": TensorEntry(shape=[1], dtype="float32", files=["__0_0.distcp"])},
    )
    status = inspect(storage, ref)
    assert status.valid, status.reason


def test_a_manifest_nested_100000_deep_is_an_invalid_checkpoint_not_a_recursion_error(storage: FileStorage) -> None:
    good = write(storage, 5, {rank_file_name(0): b"r0"})
    bad = CheckpointRef(9)
    storage.put_bytes(bad.key(MANIFEST_NAME), b"[" * 100_000 + b"]" * 100_000)
    status = inspect(storage, bad)
    assert status.committed and not status.valid
    assert "nested more than" in status.reason
    latest = latest_valid(storage)
    assert latest is not None and latest.ref == good
    with pytest.raises(ManifestError, match="nested"):
        Manifest.parse(b'{"metadata": ' + b"{" * 100_000)


def test_brackets_inside_strings_do_not_count_as_nesting(storage: FileStorage) -> None:
    ref = write(storage, 5, {rank_file_name(0): b"r0"}, metadata={"note": "[[[[" * 1000 + '\\"{{'})
    assert inspect(storage, ref).valid


def test_an_oversized_manifest_is_refused_before_a_byte_of_it_is_read(
    storage: FileStorage, monkeypatch: pytest.MonkeyPatch
) -> None:
    ref = CheckpointRef(9)
    os.makedirs(storage.local_path(ref.folder) or "", exist_ok=True)
    with open(storage.local_path(ref.key(MANIFEST_NAME)) or "", "wb") as f:
        f.truncate(MAX_MANIFEST_BYTES + 1)  # sparse: costs no disk
    reads: list[str] = []
    original = storage.get_bytes
    monkeypatch.setattr(storage, "get_bytes", lambda key: reads.append(key) or original(key))
    status = inspect(storage, ref)
    assert not status.valid and "more than" in status.reason
    assert not [k for k in reads if k.endswith(MANIFEST_NAME)]


def test_a_manifest_that_lists_no_files_is_invalid(storage: FileStorage) -> None:
    ref = write(storage, 5, {})
    status = inspect(storage, ref)
    assert not status.valid and "per-rank file" in status.reason


def test_every_rank_needs_its_file(storage: FileStorage) -> None:
    ref = write(storage, 5, {rank_file_name(0): b"r0"}, world_size=2)
    status = inspect(storage, ref)
    assert not status.valid and "1 of its 2 rank(s)" in status.reason and rank_file_name(1) in status.reason


def test_tensors_without_dcp_metadata_are_invalid(storage: FileStorage) -> None:
    ref = write(
        storage,
        5,
        {rank_file_name(0): b"r0", "__0_0.distcp": b"t"},
        tensors={"model.w": TensorEntry(shape=[1], dtype="float32", files=["__0_0.distcp"])},
    )
    status = inspect(storage, ref)
    assert not status.valid and DCP_METADATA_NAME in status.reason


def test_a_file_of_the_wrong_size_or_missing_is_invalid(storage: FileStorage) -> None:
    ref = write(storage, 5, {rank_file_name(0): b"r0", "extra.bin": b"xyz"})
    storage.put_bytes(ref.key("extra.bin"), b"xy")
    status = inspect(storage, ref)
    assert not status.valid and "2 bytes, the manifest says 3" in status.reason
    storage.delete([ref.key("extra.bin")])
    status = inspect(storage, ref)
    assert not status.valid and "extra.bin is missing" in status.reason and status.unusable == {"extra.bin"}


def test_a_file_that_is_a_symlink_leaving_its_folder_is_invalid(storage: FileStorage, tmp_path: Any) -> None:
    secret = tmp_path / "secret"
    secret.write_bytes(b"r0")
    ref = write(storage, 5, {rank_file_name(0): b"r0"})
    path = storage.local_path(ref.key(rank_file_name(0))) or ""
    os.unlink(path)
    os.symlink(secret, path)  # same size, same bytes: only where it leads is wrong
    status = inspect(storage, ref)
    assert not status.valid and "symlink leading out of step-000000005" in status.reason


def test_a_step_folder_that_is_a_symlink_out_of_the_uri_is_invalid(storage: FileStorage, tmp_path: Any) -> None:
    """Whoever can write in the URI points ``step-…`` at another job's checkpoint, one only this
    job's user can read: it was valid (every file lay inside the folder the link resolves to), so
    restore loaded it and the next save put its state where they can read it."""
    other = FileStorage(str(tmp_path / "private"))
    write(other, 5, {rank_file_name(0): b"r0"})
    os.makedirs(storage.root)
    os.symlink(other.local_path("step-000000005") or "", storage.local_path("step-000000005") or "")
    status = inspect(storage, CheckpointRef(5))
    assert not status.valid and f"step-000000005 is a symlink leading out of {storage.uri}" in status.reason
    assert latest_valid(storage) is None


def test_a_uri_that_is_itself_a_symlink_is_fine(storage: FileStorage, tmp_path: Any) -> None:
    """Pins what already worked: the URI's own folder may be reached through a link."""
    write(storage, 5, {rank_file_name(0): b"r0"})
    os.symlink(storage.root, tmp_path / "alias")
    assert inspect(FileStorage(str(tmp_path / "alias")), CheckpointRef(5)).valid


def test_a_symlink_inside_its_folder_is_fine(storage: FileStorage) -> None:
    ref = write(storage, 5, {rank_file_name(0): b"r0", "alias.bin": b"r0"})
    alias = storage.local_path(ref.key("alias.bin")) or ""
    os.unlink(alias)
    os.symlink(rank_file_name(0), alias)
    assert inspect(storage, ref).valid


def test_uncommitted_folders_and_strays_are_not_checkpoints(storage: FileStorage) -> None:
    storage.put_bytes("step-000000007/rank-00000.pt", b"r0")
    storage.put_bytes("notes/readme.txt", b"hi")
    [status] = list_checkpoints(storage)
    assert not status.committed and status.reason.startswith("uncommitted")


def test_deep_verification_reports_a_storage_outage_instead_of_calling_the_checkpoint_corrupt(
    storage: FileStorage, monkeypatch: pytest.MonkeyPatch
) -> None:
    ref = write(storage, 5, {rank_file_name(0): b"r0"})
    status = inspect(storage, ref)

    def unreachable(key: str, local_path: str, **_: Any) -> None:
        raise TransientStorageError(f"{storage.url(key)}: connection reset (still failing after retries)", key)

    monkeypatch.setattr(storage, "get_file", unreachable)
    with pytest.raises(TransientStorageError):
        verify_deep(storage, status)
    assert status.valid and not status.unusable


def test_deep_verification_adds_what_it_finds_to_the_one_verdict(storage: FileStorage) -> None:
    ref = write(storage, 5, {rank_file_name(0): b"r0"})
    storage.put_bytes(ref.key(rank_file_name(0)), b"r1")  # same size, other bytes
    status = inspect(storage, ref)
    assert status.valid

    problems = verify_deep(storage, status)

    assert not status.valid and problems == status.problems
    assert f"file {rank_file_name(0)} is corrupt" in status.reason


def test_a_checkpoint_retired_by_a_fresh_start_is_never_the_newest_valid_one(storage: FileStorage) -> None:
    """After ``start_fresh`` the new run counts from 0 again, below the retired folders: the
    controller (latest_valid) must see the new run's commits, not the retired step 100."""
    from agent._fresh_start import retire

    files = {rank_file_name(0): b"r0"}
    old = write(storage, 100, files)
    retire(storage, [(old, "the model changed shape")], job=None, attempt=None)
    new = write(storage, 5, files)

    newest = latest_valid(storage)
    assert newest is not None and newest.ref == new
    status = inspect(storage, old)
    assert status.retired and not status.valid
    assert "fresh start" in status.reason
    assert [s.ref for s in list_checkpoints(storage) if s.valid] == [new]


def test_a_manifest_time_without_a_zone_is_utc_so_the_controller_can_compare_it() -> None:
    """A manifest written by hand or by another tool may carry ``created_at`` without a zone. The
    controller compares it with its own (aware) clock when it judges a checkpoint request; a naive
    time made that comparison raise TypeError on every pass."""
    doc = (
        b'{"step": 1, "world_size": 1, "created_at": "2026-01-01T10:00:00", "torch_version": "x",'
        b' "state_keys": ["model"], "files": []}'
    )
    manifest = Manifest.parse(doc)
    assert manifest.created_at == datetime(2026, 1, 1, 10, tzinfo=UTC)
    assert manifest.created_at < datetime(2026, 1, 2, tzinfo=UTC)


@pytest.mark.parametrize(
    ("names", "said"),
    [
        (["shards", "shards/__0_0.distcp"], "both as a file and as a folder"),
        (["s", "s-1", "s.2", "s/x/y"], "both as a file and as a folder"),
        (["__0_0.distcp", "__0_0.distcp.lock"], "restore cache keeps beside a file"),
        (["__0_0.distcp", "__0_0.distcp.verified"], "restore cache keeps beside a file"),
    ],
    ids=["file-and-folder", "file-and-folder-apart-when-sorted", "lock", "verified-marker"],
)
def test_a_manifest_listing_names_that_collide_in_the_restore_cache_is_invalid(
    names: list[str], said: str, storage: FileStorage
) -> None:
    """A restore from an object store keeps each file in a node-local folder beside a lock and a
    .verified marker: a listed name that is one of those (or a file that is also a folder) made
    the cache clobber one file with another, and the restore fail on the store as unavailable."""
    doc = manifest_doc([{"path": n, "size": 1, "crc32c": "00000000"} for n in [rank_file_name(0), *names]])
    with pytest.raises(ManifestError, match=said) as refused:
        Manifest.parse(json.dumps(doc).encode())
    assert names[0] in str(refused.value) or names[1] in str(refused.value)
    ref = CheckpointRef(5)
    storage.put_bytes(ref.key(rank_file_name(0)), b"r")
    storage.put_bytes(ref.key(MANIFEST_NAME), json.dumps(doc).encode())
    status = inspect(storage, ref)
    assert not status.valid and said in status.reason


@pytest.mark.parametrize("name", ["rank-00001.pt\nrestored step 99", "\x1b]0;owned\x07.distcp", "a\x85b"])
def test_a_manifest_naming_a_file_with_a_control_character_is_invalid_and_never_echoes_it(
    name: str, storage: FileStorage
) -> None:
    """Every problem with a listed file names it, and restore logs those problems: a newline in a
    crafted name forged log lines of its own, an escape sequence reached terminals."""
    ref = CheckpointRef(5)
    storage.put_bytes(ref.key(rank_file_name(0)), b"r")
    doc = manifest_doc(
        [
            {"path": rank_file_name(0), "size": 1, "crc32c": to_hex(crc32c_bytes(b"r"))},
            {"path": name, "size": 1, "crc32c": "00000000"},
        ]
    )
    storage.put_bytes(ref.key(MANIFEST_NAME), json.dumps(doc).encode())
    status = inspect(storage, ref)
    assert not status.valid and "control character" in status.reason
    assert name not in status.reason and not any(c in status.reason for c in "\n\x1b\x07\x85")


def test_a_manifest_listing_a_name_over_1024_bytes_is_invalid_saying_so(storage: FileStorage) -> None:
    """No store holds an object name over 1024 bytes (S3 and GCS refuse one): a longer listed
    name is crafted, and refused without being echoed whole."""
    doc = manifest_doc([{"path": "a/" * 600 + "b", "size": 1, "crc32c": "00000000"}])
    with pytest.raises(ManifestError, match="longer than the 1024 bytes a file name may have") as refused:
        Manifest.parse(json.dumps(doc).encode())
    assert len(str(refused.value)) < 300
    ok = manifest_doc([{"path": "a/" * 511 + "b", "size": 1, "crc32c": "00000000"}])
    assert Manifest.parse(json.dumps(ok).encode()).files[0].path.count("/") == 511


def test_deep_names_cost_memory_in_proportion_to_the_manifest_not_to_the_square_of_their_depth() -> None:
    """Each listed name was cut into all its parent folders to find a file that is also a folder:
    a name of n levels cost n strings of up to its length, so a 2 MB manifest of deep names took
    hundreds of MB (and a 64 MiB one hung restore and ``spotjob ckpt``). Measured with tracemalloc
    (allocations, not time)."""
    names = [f"{i:04d}/" + "a/" * 500 + "b" for i in range(2000)]
    data = json.dumps(manifest_doc([{"path": n, "size": 1, "crc32c": "00000000"} for n in names])).encode()
    tracemalloc.start()
    try:
        manifest = Manifest.parse(data)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(manifest.files) == 2000
    assert peak < 20 * len(data), f"parsing a {len(data)}-byte manifest peaked at {peak} bytes"


def test_a_fifo_planted_as_a_manifest_is_no_commit_and_hangs_no_reader(storage: FileStorage) -> None:
    """Whoever can write in the folder makes ``MANIFEST.json`` a FIFO: opening it would wait for a
    writer for ever, in ``spotjob ckpt list``, restore, retention and the controller alike. A
    FIFO is no object of the store: the folder reads as uncommitted."""
    storage.put_bytes("step-000000005/rank-00000.pt", b"r0")
    os.mkfifo(storage.local_path("step-000000005/" + MANIFEST_NAME) or "")
    assert [o.key for o in storage.list("step-000000005/")] == ["step-000000005/rank-00000.pt"]
    [status] = list_checkpoints(storage)
    assert not status.committed


def test_a_fifo_in_place_of_a_listed_file_makes_the_checkpoint_invalid_and_is_never_read(
    storage: FileStorage,
) -> None:
    """A manifest listing an empty file, then a FIFO put in its place (same size as listed: 0):
    invalid before anything opens it, and a direct read refuses it rather than waiting for ever."""
    ref = write(storage, 5, {rank_file_name(0): b"r0", "extra.bin": b""})
    path = storage.local_path(ref.key("extra.bin")) or ""
    os.unlink(path)
    os.mkfifo(path)
    status = inspect(storage, ref)
    assert not status.valid and "extra.bin is missing" in status.reason
    assert "extra.bin is missing" in " ".join(verify_deep(storage, status))
    with pytest.raises(CorruptObjectError, match="is a FIFO, not a regular file"):
        storage.get_bytes(ref.key("extra.bin"))
    with pytest.raises(CorruptObjectError, match="is a FIFO, not a regular file"):
        storage.get_file(ref.key("extra.bin"), path + ".copy")
    assert not os.path.exists(path + ".copy")
