"""The storage contract (agent/storage/base.py), held by every backend against a real server.

Each test in the first part runs once per backend (``storage_uri``: a folder, moto's S3,
fake-gcs-server). The second part puts ``tests/faults.py`` between the client and the S3 / GCS
server and proves what is retried, what is not, and that every retry is logged.
"""

from __future__ import annotations

import errno
import http.client
import logging
import os
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass
from email.message import Message
from pathlib import Path
from typing import Any, TypedDict
from urllib.parse import quote, urlparse

import pytest

from agent.catalog import find_checkpoints
from agent.checkpoint import _claim
from agent.crc32c import crc32c_bytes, crc32c_file
from agent.ownership import (
    MAX_RECORD_BYTES,
    OWNER_KEY,
    OwnershipError,
    attempt_key,
    claim,
    read_attempt,
    read_owner,
    record_attempt,
)
from agent.storage import (
    AlreadyExistsError,
    CorruptObjectError,
    DamagedObjectError,
    NotFoundError,
    PermanentStorageError,
    Storage,
    TooLargeError,
    TransientStorageError,
)
from agent.storage import gs as gs_backend
from agent.storage import s3 as s3_backend
from agent.storage._transfer import crc_to_b64
from agent.storage.base import get_files, parallel_map, put_files

try:
    from faults import Dialect, FaultProxy
except ImportError:  # tests/ collected as a package
    from tests.faults import Dialect, FaultProxy

MiB = 1024 * 1024
PART = 5 * MiB  # S3's smallest part; GCS and the range reader use it as given
BIG = 2 * PART + 123  # three parts / chunks / ranges, the last one short

RETRY_LOGGER = "agent.storage._retry"


@pytest.fixture
def small_parts(monkeypatch: pytest.MonkeyPatch) -> None:
    """Parts of 5 MiB from 5 MiB up, so an ~10 MiB file goes up in parts and comes down in ranges."""
    monkeypatch.setenv("SPOTJOB_STORAGE_PART_SIZE", str(PART))
    monkeypatch.setenv("SPOTJOB_STORAGE_UPLOAD_PART_SIZE", str(PART))
    monkeypatch.setenv("SPOTJOB_STORAGE_UPLOAD_CHUNK_SIZE", str(PART))
    monkeypatch.setenv("SPOTJOB_STORAGE_MULTIPART_THRESHOLD", str(PART))
    monkeypatch.setenv("SPOTJOB_STORAGE_CONCURRENCY", "4")


def write_random(path: Path, size: int) -> tuple[int, int]:
    path.write_bytes(os.urandom(size))
    return crc32c_file(path)


@pytest.fixture
def overwrite_behind_the_backends_back(request: pytest.FixtureRequest) -> Callable[[str, str, bytes], None]:
    """``overwrite(uri, key, data)``: replace a stored object through the server's own API."""

    def overwrite(uri: str, key: str, data: bytes) -> None:
        parsed = urlparse(uri)
        name = f"{parsed.path.strip('/')}/{key}"
        if parsed.scheme == "s3":
            request.getfixturevalue("s3_client").put_object(Bucket=parsed.netloc, Key=name, Body=data)
        elif parsed.scheme == "gs":
            request.getfixturevalue("gcs_client").bucket(parsed.netloc).blob(name).upload_from_string(data)
        else:
            Path(uri, key).write_bytes(data)

    return overwrite


def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


# -- the contract, on every backend ----------------------------------------------------------
@pytest.mark.usefixtures("small_parts")
class TestContract:
    def test_a_multipart_sized_file_round_trips_with_its_crc(
        self, storage_uri: str, make_storage: Callable[[str], Storage], tmp_path: Path
    ) -> None:
        store = make_storage(storage_uri)
        src = tmp_path / "src.bin"
        crc, size = write_random(src, BIG)
        sent: list[int] = []
        store.put_file(str(src), "step-000000001/rank0.distcp", crc32c=crc, progress=sent.append)
        assert sum(sent) == size

        got: list[int] = []
        dst = tmp_path / "dst.bin"
        store.get_file("step-000000001/rank0.distcp", str(dst), size=size, crc32c=crc, progress=got.append)
        assert crc32c_file(dst) == (crc, size)
        assert sum(got) == size
        assert leftovers(tmp_path) == ["dst.bin", "src.bin"]
        info = store.stat("step-000000001/rank0.distcp")
        assert info is not None and info.size == size

    def test_an_empty_file_round_trips(
        self, storage_uri: str, make_storage: Callable[[str], Storage], tmp_path: Path
    ) -> None:
        store = make_storage(storage_uri)
        (tmp_path / "empty").write_bytes(b"")
        store.put_file(str(tmp_path / "empty"), "step-1/empty", crc32c=0)
        store.get_file("step-1/empty", str(tmp_path / "back"), size=0, crc32c=0)
        assert (tmp_path / "back").read_bytes() == b""
        info = store.stat("step-1/empty")
        assert info is not None and info.size == 0

    def test_a_small_object_is_read_with_its_size_and_time_within_a_bound(
        self, storage_uri: str, make_storage: Callable[[str], Storage]
    ) -> None:
        store = make_storage(storage_uri)
        store.put_bytes("step-1/WRITER.json", b'{"id": 1}')
        data, info = store.get_small("step-1/WRITER.json", 9)
        assert (data, info.key, info.size) == (b'{"id": 1}', "step-1/WRITER.json", 9)
        assert info.modified is not None
        store.put_bytes("step-1/empty", b"")
        assert store.get_small("step-1/empty", 0)[0] == b""
        with pytest.raises(TooLargeError) as caught:
            store.get_small("step-1/WRITER.json", 8)
        assert caught.value.size == 9 and "more than 8" in str(caught.value)
        with pytest.raises(NotFoundError):
            store.get_small("step-1/none.json", 8)

    def test_many_files_go_up_and_come_down_in_parallel(
        self, storage_uri: str, make_storage: Callable[[str], Storage], tmp_path: Path
    ) -> None:
        store = make_storage(storage_uri)
        files = []
        for i in range(6):
            src = tmp_path / f"shard{i}.bin"
            crc, size = write_random(src, 100_000 + i)
            files.append((str(src), f"step-2/shard{i}", crc, size))
        put_files(store, [(p, k, c) for p, k, c, _ in files])
        get_files(store, [(k, str(tmp_path / "out" / k), s, c) for _, k, c, s in files])
        for local, key, _, _ in files:
            assert (tmp_path / "out" / key).read_bytes() == Path(local).read_bytes()

    def test_get_file_rejects_a_wrong_crc_and_leaves_nothing_behind(
        self, storage_uri: str, make_storage: Callable[[str], Storage], tmp_path: Path
    ) -> None:
        store = make_storage(storage_uri)
        src = tmp_path / "src.bin"
        crc, size = write_random(src, BIG)
        store.put_file(str(src), "step-1/shard", crc32c=crc)
        out = tmp_path / "out"
        out.mkdir()
        with pytest.raises(CorruptObjectError) as caught:
            store.get_file("step-1/shard", str(out / "shard"), size=size, crc32c=crc ^ 1)
        assert caught.value.key == "step-1/shard"
        assert "step-1/shard" in str(caught.value)
        assert leftovers(out) == []

    def test_get_file_rejects_a_wrong_size_and_leaves_nothing_behind(
        self, storage_uri: str, make_storage: Callable[[str], Storage], tmp_path: Path
    ) -> None:
        store = make_storage(storage_uri)
        store.put_bytes("step-1/small", b"0123456789")
        out = tmp_path / "out"
        out.mkdir()
        with pytest.raises(CorruptObjectError) as caught:
            store.get_file("step-1/small", str(out / "small"), size=11, crc32c=crc32c_bytes(b"0123456789"))
        assert caught.value.key == "step-1/small"
        assert leftovers(out) == []

    def test_get_file_detects_an_object_changed_in_storage(
        self,
        storage_uri: str,
        make_storage: Callable[[str], Storage],
        tmp_path: Path,
        overwrite_behind_the_backends_back: Callable[[str, str, bytes], None],
    ) -> None:
        store = make_storage(storage_uri)
        data = os.urandom(PART + 1000)
        src = tmp_path / "src.bin"
        src.write_bytes(data)
        store.put_file(str(src), "step-3/shard", crc32c=crc32c_bytes(data))
        flipped = bytearray(data)
        flipped[PART + 10] ^= 0xFF  # same size, one bit-flipped byte in the second range
        overwrite_behind_the_backends_back(storage_uri, "step-3/shard", bytes(flipped))
        with pytest.raises(CorruptObjectError, match="step-3/shard"):
            store.get_file("step-3/shard", str(tmp_path / "dst"), size=len(data), crc32c=crc32c_bytes(data))
        assert not (tmp_path / "dst").exists()

    def test_create_only_write_refuses_the_second_writer_and_keeps_the_first(
        self, storage_uri: str, make_storage: Callable[[str], Storage]
    ) -> None:
        store = make_storage(storage_uri)
        store.put_bytes_if_absent("step-4/MANIFEST.json", b'{"first": true}')
        with pytest.raises(AlreadyExistsError) as caught:
            store.put_bytes_if_absent("step-4/MANIFEST.json", b'{"second": true}')
        assert caught.value.key == "step-4/MANIFEST.json"
        assert store.get_bytes("step-4/MANIFEST.json") == b'{"first": true}'

    def test_of_racing_create_only_writers_exactly_one_wins(
        self, storage_uri: str, make_storage: Callable[[str], Storage]
    ) -> None:
        store = make_storage(storage_uri)
        barrier = threading.Barrier(8)
        outcomes: dict[int, str] = {}

        def commit(i: int) -> None:
            barrier.wait()
            try:
                store.put_bytes_if_absent("step-5/MANIFEST.json", f"writer {i}".encode())
                outcomes[i] = "won"
            except AlreadyExistsError:
                outcomes[i] = "refused"

        threads = [threading.Thread(target=commit, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        winners = [i for i, o in outcomes.items() if o == "won"]
        assert len(outcomes) == 8 and len(winners) == 1
        assert store.get_bytes("step-5/MANIFEST.json") == f"writer {winners[0]}".encode()

    def test_missing_objects(self, storage_uri: str, make_storage: Callable[[str], Storage], tmp_path: Path) -> None:
        store = make_storage(storage_uri)
        with pytest.raises(NotFoundError) as caught:
            store.get_bytes("step-9/MANIFEST.json")
        assert caught.value.key == "step-9/MANIFEST.json"
        with pytest.raises(NotFoundError):
            store.get_file("step-9/shard", str(tmp_path / "x"))
        assert not (tmp_path / "x").exists()
        assert store.stat("step-9/shard") is None
        store.delete(["step-9/shard", "never/was"])  # missing keys are fine
        store.delete_prefix("step-9/")
        assert list(store.list()) == []
        assert store.list_dirs() == []

    def test_list_list_dirs_and_deletes(self, storage_uri: str, make_storage: Callable[[str], Storage]) -> None:
        store = make_storage(storage_uri)
        keys = {
            "step-000000001/MANIFEST.json": b"m1",
            "step-000000001/rank0/shard": b"s10",
            "step-000000001/rank1/shard": b"s11x",
            "step-000000002/rank0/shard": b"s20",
            "step-000000010/MANIFEST.json": b"m10",
            "latest": b"step-000000010",
        }
        for key, data in keys.items():
            store.put_bytes(key, data)

        assert {(o.key, o.size) for o in store.list()} == {(k, len(v)) for k, v in keys.items()}
        assert {o.key for o in store.list("step-000000001/")} == {
            "step-000000001/MANIFEST.json",
            "step-000000001/rank0/shard",
            "step-000000001/rank1/shard",
        }
        # A prefix is a string prefix, not a folder: "step-00000001" also matches step-000000010.
        assert {o.key for o in store.list("step-00000001")} == {
            "step-000000010/MANIFEST.json",
        } | {k for k in keys if k.startswith("step-00000001")}
        assert store.list_dirs() == ["step-000000001", "step-000000002", "step-000000010"]
        assert store.list_dirs("step-000000001/") == ["rank0", "rank1"]
        assert store.list_dirs("step-000000010/") == []

        info = store.stat("step-000000001/rank1/shard")
        assert info is not None and (info.key, info.size) == ("step-000000001/rank1/shard", 4)

        store.delete(["step-000000001/rank0/shard", "latest", "not-there"])
        assert store.stat("latest") is None
        assert store.stat("step-000000001/rank0/shard") is None
        store.delete_prefix("step-000000001/")
        assert store.list_dirs() == ["step-000000002", "step-000000010"]
        assert {o.key for o in store.list()} == {"step-000000002/rank0/shard", "step-000000010/MANIFEST.json"}
        with pytest.raises(ValueError):
            store.delete_prefix("step-000000002")  # not a folder prefix: refused, nothing deleted
        assert store.stat("step-000000002/rank0/shard") is not None

    def test_keys_that_escape_the_root_are_refused(
        self, storage_uri: str, make_storage: Callable[[str], Storage]
    ) -> None:
        store = make_storage(storage_uri)
        for bad in ("../other-job/MANIFEST.json", "/abs", "step-1/../../x"):
            with pytest.raises(PermanentStorageError):
                store.put_bytes(bad, b"x")


# -- object stores only ----------------------------------------------------------------------
@pytest.mark.parametrize("storage_uri", ["s3", "gs"], indirect=True)
class TestObjectStores:
    @pytest.mark.usefixtures("small_parts")
    def test_put_file_refuses_a_file_that_is_not_what_the_caller_checksummed(
        self, storage_uri: str, make_storage: Callable[[str], Storage], tmp_path: Path
    ) -> None:
        store = make_storage(storage_uri)
        for size in (1000, BIG):  # one request, and parts / chunks
            src = tmp_path / f"src{size}"
            crc, _ = write_random(src, size)
            with pytest.raises(CorruptObjectError, match="was it changed"):
                store.put_file(str(src), f"step-1/shard{size}", crc32c=crc ^ 0x10)
            assert store.stat(f"step-1/shard{size}") is None

    @pytest.mark.usefixtures("small_parts")
    def test_where_no_transfer_thread_can_start_files_of_several_parts_still_go_up_and_come_down(
        self, storage_uri: str, make_storage: Callable[[str], Storage], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """A pids or ``ulimit -u`` limit, or Python 3.12.0/3.12.1 once the main thread has ended (a
        save in flight is finished before exit): the store's transfer threads cannot start. An S3
        multipart upload, a download of several ranges and a delete of several keys (GCS: one
        request a key) raised the RuntimeError of ``Thread.start``, and the save was lost; the
        calls now run in the caller's thread."""
        store = make_storage(storage_uri)
        real_start = threading.Thread.start

        def refused(self: threading.Thread) -> None:
            if self.name.startswith(("spotjob-s3", "spotjob-gcs")):
                raise RuntimeError("can't create new thread at interpreter shutdown")
            real_start(self)

        monkeypatch.setattr(threading.Thread, "start", refused)
        src = tmp_path / "src.bin"
        crc, size = write_random(src, BIG)

        store.put_file(str(src), "step-1/shard", crc32c=crc)
        store.put_bytes("step-1/MANIFEST.json", b"{}")
        store.get_file("step-1/shard", str(tmp_path / "dst"), size=size, crc32c=crc)
        store.delete_prefix("step-1/")

        assert crc32c_file(tmp_path / "dst") == (crc, size)
        assert list(store.list()) == []

    def test_listing_and_deleting_go_page_by_page(
        self, storage_uri: str, make_storage: Callable[[str], Storage], monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.setattr(s3_backend, "LIST_PAGE_SIZE", 4)
        monkeypatch.setattr(s3_backend, "DELETE_BATCH", 3)
        monkeypatch.setattr(gs_backend, "LIST_PAGE_SIZE", 4)
        store = make_storage(storage_uri)
        keys = [f"step-{i:09d}/MANIFEST.json" for i in range(11)]
        put_files_bytes(store, keys)
        assert sorted(o.key for o in store.list()) == keys
        assert store.list_dirs() == [k.split("/")[0] for k in keys]
        store.delete(keys[:7])
        assert sorted(o.key for o in store.list()) == keys[7:]

    def test_past_a_real_page_of_1000_every_checkpoint_and_file_is_listed_and_deleted(
        self, storage_uri: str, make_storage: Callable[[str], Storage]
    ) -> None:
        """The page size of the server itself (1000 names), not a patched one: find_checkpoints and
        inspect see all of 1001 folders and of a folder's 1001 files, and delete_prefix removes
        more than one DeleteObjects batch."""
        store = make_storage(storage_uri)
        folders = [f"step-{i:09d}/MANIFEST.json" for i in range(1001)]
        files = [f"step-999999999/__{i}_0.distcp" for i in range(1001)]
        put_tiny_objects(storage_uri, folders + files)
        assert len(find_checkpoints(store)) == 1002
        assert sorted(o.key for o in store.list("step-999999999/")) == sorted(files)
        store.delete_prefix("step-999999999/")
        assert list(store.list("step-999999999/")) == []
        assert sum(1 for _ in store.list()) == 1001

    def test_the_uri_prefix_isolates_jobs_in_one_bucket(
        self, storage_uri: str, make_storage: Callable[[str], Storage]
    ) -> None:
        store = make_storage(storage_uri)
        neighbour = make_storage(storage_uri.replace("/jobs/run1", "/jobs/run10"))
        neighbour.put_bytes("step-1/MANIFEST.json", b"n")
        store.put_bytes("step-1/MANIFEST.json", b"s")
        assert [o.key for o in store.list()] == ["step-1/MANIFEST.json"]
        store.delete_prefix("step-1/")
        assert neighbour.get_bytes("step-1/MANIFEST.json") == b"n"

    def test_a_name_s3_or_gcs_would_refuse_is_refused_before_any_request_and_nothing_is_stored(
        self, storage_uri: str, make_storage: Callable[[str], Storage]
    ) -> None:
        """moto and fake-gcs-server store names over 1024 bytes that S3 and GCS refuse mid-save, and
        a lone surrogate (undecodable bytes from the command line) made the clients raise a bare
        UnicodeEncodeError, outside the StorageError contract."""
        store = make_storage(storage_uri)
        parsed = urlparse(storage_uri)
        backend = s3_backend.S3Storage if parsed.scheme == "s3" else gs_backend.GCSStorage
        long_key = "step-000000001/" + "k" * 1100
        with pytest.raises(PermanentStorageError, match="more than the 1024 S3 and GCS allow"):
            store.put_bytes(long_key, b"x")
        stray = backend(parsed.netloc, "jobs/caf\udce9")
        try:
            with pytest.raises(PermanentStorageError, match="is not valid UTF-8"):
                stray.put_bytes("step-000000001/MANIFEST.json", b"x")
            with pytest.raises(PermanentStorageError, match="is not valid UTF-8"):
                list(stray.list())
        finally:
            stray.close()
        assert list(store.list()) == []


@pytest.mark.usefixtures("fast_retries")
def test_s3_deletes_a_folder_holding_keys_that_xml_cannot_carry(
    fresh_uri: Callable[[str], str], make_storage: Callable[[str], Storage], s3_client: Any
) -> None:
    """DeleteObjects lists its keys in XML: a key with a control character (or U+FFFE) made the
    whole batch fail, so retention could never remove a checkpoint folder holding such a stray
    object; a CR would be read as LF, naming another key."""
    uri = fresh_uri("s3")
    parsed = urlparse(uri)
    store = make_storage(uri)
    keys = [f"step-000000001/{name}" for name in ("MANIFEST.json", "stray\x01", "stray\ufffe", "stray\rcr")]
    for key in keys:
        s3_client.put_object(Bucket=parsed.netloc, Key=f"{parsed.path.strip('/')}/{key}", Body=b"x")
    store.put_bytes("step-000000002/MANIFEST.json", b"kept")
    assert sorted(o.key for o in store.list("step-000000001/")) == sorted(keys)
    store.delete_prefix("step-000000001/")
    assert [o.key for o in store.list()] == ["step-000000002/MANIFEST.json"]


def test_s3_reads_a_small_object_only_when_its_bytes_match_the_crc32c_the_store_keeps(
    fresh_uri: Callable[[str], str],
    make_storage: Callable[[str], Storage],
    s3_client: Any,
    fast_retries: None,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """``get_small`` (manifests, owner and attempt records, claims) checked no checksum on S3, where
    GCS's checks ``x-goog-hash``. moto keeps the CRC32C an upload names (with its algorithm) without
    checking it: an object stored with the CRC32C of other bytes stands for one damaged where it is
    kept. Read again within the retries, it fails each time with the same bytes: no longer a
    transient fault (the store is not down, advice to retry never helped) but a damaged object.
    One with no CRC32C kept, or a composite one (a multipart object's), is read unchecked."""
    uri = fresh_uri("s3")
    bucket, prefix = urlparse(uri).netloc, urlparse(uri).path.strip("/")
    store = make_storage(uri)
    body, other = b'{"step": 1}', b'{"step": 2}'

    def put(key: str, crc: int, data: bytes = body) -> None:
        s3_client.put_object(
            Bucket=bucket, Key=f"{prefix}/{key}", Body=data, ChecksumAlgorithm="CRC32C", ChecksumCRC32C=crc_to_b64(crc)
        )

    put("step-1/MANIFEST.json", crc32c_bytes(other))
    caplog.set_level(logging.WARNING, logger=RETRY_LOGGER)
    with pytest.raises(DamagedObjectError) as caught:
        store.get_small("step-1/MANIFEST.json", 100)
    said = str(caught.value)
    assert f"CRC32C the store keeps for it ({crc32c_bytes(other):08x}" in said, said
    assert "step-1/MANIFEST.json is damaged" in said and "each of 5 reads" in said, said
    assert caught.value.key == "step-1/MANIFEST.json"
    assert not isinstance(caught.value, TransientStorageError)
    assert len(retry_lines(caplog)) == 4, "read again within the retries, as any fault in transit"

    # An empty body ends at the first read, where botocore checks it itself: the same error.
    put("step-1/empty.json", crc32c_bytes(other), b"")
    with pytest.raises(DamagedObjectError, match=r"step-1/empty\.json is damaged"):
        store.get_small("step-1/empty.json", 100)

    put("step-2/MANIFEST.json", crc32c_bytes(body))
    assert store.get_small("step-2/MANIFEST.json", 100)[0] == body

    s3_client.put_object(Bucket=bucket, Key=f"{prefix}/step-3/MANIFEST.json", Body=body)  # no CRC32C kept
    assert store.get_small("step-3/MANIFEST.json", 100)[0] == body

    key = f"{prefix}/step-4/MANIFEST.json"
    upload = s3_client.create_multipart_upload(Bucket=bucket, Key=key, ChecksumAlgorithm="CRC32C")["UploadId"]
    part = s3_client.upload_part(
        Bucket=bucket, Key=key, UploadId=upload, PartNumber=1, Body=body, ChecksumCRC32C=crc_to_b64(crc32c_bytes(body))
    )
    s3_client.complete_multipart_upload(
        Bucket=bucket,
        Key=key,
        UploadId=upload,
        MultipartUpload={
            "Parts": [{"PartNumber": 1, "ETag": part["ETag"], "ChecksumCRC32C": crc_to_b64(crc32c_bytes(body))}]
        },
    )
    kept = s3_client.get_object(Bucket=bucket, Key=key, ChecksumMode="ENABLED")
    kept["Body"].close()
    assert kept["ChecksumCRC32C"].endswith("-1"), kept  # composite: a CRC of the parts' CRCs
    assert store.get_small("step-4/MANIFEST.json", 100)[0] == body


@pytest.mark.usefixtures("fast_retries")
def test_s3_owner_and_attempt_records_damaged_where_they_are_kept_read_as_unreadable_records(
    fresh_uri: Callable[[str], str], make_storage: Callable[[str], Storage], s3_client: Any
) -> None:
    """An owner or attempt record whose bytes never match the CRC32C the store keeps for it failed
    every read as a transient fault (the store "unavailable", forever). It reads as a broken
    record does: the owner record unreadable, with ``spotjob ckpt adopt`` as the remedy, the
    attempt record unreadable (untrusted), the damage named in both."""
    uri = fresh_uri("s3")
    bucket, prefix = urlparse(uri).netloc, urlparse(uri).path.strip("/")
    store = make_storage(uri)
    claim(store, "train")
    record_attempt(store, "train", 1, None)

    def damage(key: str) -> None:
        body = s3_client.get_object(Bucket=bucket, Key=f"{prefix}/{key}")["Body"].read()
        s3_client.put_object(
            Bucket=bucket,
            Key=f"{prefix}/{key}",
            Body=body,
            ChecksumAlgorithm="CRC32C",
            ChecksumCRC32C=crc_to_b64(crc32c_bytes(body + b" ")),
        )

    damage(OWNER_KEY)
    with pytest.raises(OwnershipError) as owner:
        read_owner(store)
    said = str(owner.value)
    assert "is unreadable" in said and "is damaged" in said and "spotjob ckpt adopt" in said, said

    damage(attempt_key("train", 1))
    with pytest.raises(ValueError) as attempt:
        read_attempt(store, "train", 1)
    said = str(attempt.value)
    assert "is unreadable" in said and "is damaged" in said and "CRC32C the store keeps" in said, said


def test_s3_sends_parts_of_the_upload_part_size_and_reads_ranges_of_the_part_size(
    fresh_uri: Callable[[str], str],
    make_storage: Callable[[str], Storage],
    s3_client: Any,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("SPOTJOB_STORAGE_MULTIPART_THRESHOLD", str(PART))
    monkeypatch.setenv("SPOTJOB_STORAGE_PART_SIZE", str(4 * PART))  # ranges: the object in one
    uri = fresh_uri("s3")
    bucket = urlparse(uri).netloc
    src = tmp_path / "src.bin"
    crc, size = write_random(src, 2 * 8 * MiB + 123)
    store = make_storage(uri)  # the default upload part size: 8 MiB
    store.put_file(str(src), "step-1/shard", crc32c=crc)
    # A multipart object's ETag ends with its part count.
    assert s3_client.head_object(Bucket=bucket, Key="jobs/run1/step-1/shard")["ETag"].strip('"').endswith("-3")
    monkeypatch.setenv("SPOTJOB_STORAGE_UPLOAD_PART_SIZE", str(PART))
    smaller = make_storage(uri)
    smaller.put_file(str(src), "step-1/again", crc32c=crc)
    assert s3_client.head_object(Bucket=bucket, Key="jobs/run1/step-1/again")["ETag"].strip('"').endswith("-4")
    ranges: list[int] = []
    smaller.get_file("step-1/again", str(tmp_path / "back.bin"), size=size, crc32c=crc, progress=ranges.append)
    assert ranges == [size], "read back in one range of SPOTJOB_STORAGE_PART_SIZE"


def test_s3_keeps_within_its_largest_put_and_part_whatever_the_sizes_set(
    fresh_uri: Callable[[str], str],
    make_storage: Callable[[str], Storage],
    s3_client: Any,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """S3 refuses a PutObject above 5 GiB and a part above 5 GiB (EntityTooLarge) for good: a
    SPOTJOB_STORAGE_MULTIPART_THRESHOLD or SPOTJOB_STORAGE_UPLOAD_PART_SIZE set higher (to turn
    multipart off, or a unit slip) failed every save of a shard that big, after reading it whole
    into memory. moto takes any size, so the limits are shrunk here to what it can hold. (Values
    above 5 GiB are refused when the store opens, naming the variable, since the bounds exist.)"""
    monkeypatch.setattr(s3_backend, "S3_MAX_PUT", 2 * PART)
    monkeypatch.setattr(s3_backend, "S3_MAX_PART", 2 * PART)
    monkeypatch.setenv("SPOTJOB_STORAGE_MULTIPART_THRESHOLD", "5GiB")
    monkeypatch.setenv("SPOTJOB_STORAGE_UPLOAD_PART_SIZE", "5GiB")
    uri = fresh_uri("s3")
    bucket = urlparse(uri).netloc
    src = tmp_path / "src.bin"
    crc, size = write_random(src, 4 * PART + 123)
    store = make_storage(uri)
    store.put_file(str(src), "step-1/shard", crc32c=crc)
    # A multipart object's ETag ends with its part count: parts of the largest size, 3 of them.
    assert s3_client.head_object(Bucket=bucket, Key="jobs/run1/step-1/shard")["ETag"].strip('"').endswith("-3")
    store.get_file("step-1/shard", str(tmp_path / "back.bin"), size=size, crc32c=crc)
    assert (tmp_path / "back.bin").read_bytes() == src.read_bytes()
    # Up to the largest PutObject, one PUT as before.
    crc, _ = write_random(src, 2 * PART)
    store.put_file(str(src), "step-1/small", crc32c=crc)
    assert "-" not in s3_client.head_object(Bucket=bucket, Key="jobs/run1/step-1/small")["ETag"]


def test_gcs_sends_chunks_of_the_upload_chunk_size_and_reads_ranges_of_the_part_size(
    fresh_uri: Callable[[str], str],
    make_storage: Callable[[str], Storage],
    gcs_client: Any,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("SPOTJOB_STORAGE_MULTIPART_THRESHOLD", str(PART))
    monkeypatch.setenv("SPOTJOB_STORAGE_PART_SIZE", str(PART))  # ranges: not what sizes the chunks
    uri = fresh_uri("gs")
    src = tmp_path / "src.bin"
    crc, size = write_random(src, 2 * 8 * MiB + 123)
    # A resumable upload reports progress once per chunk the server confirmed.
    chunks: list[int] = []
    make_storage(uri).put_file(str(src), "step-1/shard", crc32c=crc, progress=chunks.append)
    assert chunks == [size], "the default 100 MiB chunk takes the whole object at once"
    monkeypatch.setenv("SPOTJOB_STORAGE_UPLOAD_CHUNK_SIZE", str(PART))
    smaller = make_storage(uri)
    chunks.clear()
    smaller.put_file(str(src), "step-1/again", crc32c=crc, progress=chunks.append)
    assert chunks == [PART, PART, PART, size - 3 * PART]
    bucket = gcs_client.bucket(urlparse(uri).netloc)
    assert bucket.get_blob("jobs/run1/step-1/again").size == size
    ranges: list[int] = []
    smaller.get_file("step-1/again", str(tmp_path / "back.bin"), size=size, crc32c=crc, progress=ranges.append)
    assert len(ranges) == 4, "read back in ranges of SPOTJOB_STORAGE_PART_SIZE"


@pytest.mark.usefixtures("fast_retries")
def test_gcs_small_read_whose_bytes_never_match_x_goog_hash_is_damaged_and_one_that_does_once_is_read_again(
    fresh_uri: Callable[[str], str],
    fault_proxy: Callable[[str, Dialect], FaultProxy],
    gcs_server: str,
    make_storage: Callable[[str], Storage],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Bytes that never match the CRC32C of ``x-goog-hash`` in any of the retried reads (the same
    bytes each time: damaged where they are kept; fake-gcs-server keeps no wrong checksum, so the
    proxy damages every answer alike) were raised as a transient fault, as if the store were down.
    Damaged in one answer only, they are read again and returned."""
    uri = fresh_uri("gs")
    proxy = fault_proxy(gcs_server, "gcs")
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", proxy.url)
    store = make_storage(uri)
    body = b'{"step": 1}'
    store.put_bytes("step-1/MANIFEST.json", body)

    def media(req: Any) -> bool:
        return req.method == "GET" and "alt=media" in req.path

    damaged = proxy.damage(1_000_000, lambda data: data.replace(b"1", b"2"), match=media)
    with pytest.raises(DamagedObjectError) as caught:
        store.get_small("step-1/MANIFEST.json", 100)
    said = str(caught.value)
    assert "step-1/MANIFEST.json is damaged" in said and "each of 5 reads" in said, said
    assert f"({crc32c_bytes(body):08x}, the bytes read have {crc32c_bytes(body.replace(b'1', b'2')):08x}" in said
    assert damaged.served == 5
    proxy.clear()

    once = proxy.damage(1, lambda data: data.replace(b"1", b"2"), match=media)
    assert store.get_small("step-1/MANIFEST.json", 100)[0] == body
    assert once.served == 1

    # Damaged differently on each read: on the way each time, never proven at rest.
    flips = iter(range(2, 9))
    proxy.damage(1_000_000, lambda data: data.replace(b"1", str(next(flips)).encode()), match=media)
    with pytest.raises(TransientStorageError, match="damaged on the way"):
        store.get_small("step-1/MANIFEST.json", 100)


def test_gcs_reads_a_file_of_one_part_in_one_request(
    fresh_uri: Callable[[str], str],
    fault_proxy: Callable[[str, Dialect], FaultProxy],
    gcs_server: str,
    make_storage: Callable[[str], Storage],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A file no bigger than a part is one media GET; before the fix the object's metadata GET came
    first. A server that ignores the Range header (200 and the whole object) still costs one GET,
    the size read from its Content-Length. An answer that says no size falls back to reading the
    metadata first (fake-gcs-server always says it: the parsing is patched to find none)."""
    uri = fresh_uri("gs")
    proxy = fault_proxy(gcs_server, "gcs")
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", proxy.url)
    store = make_storage(uri)
    data = os.urandom(1000)
    store.put_bytes("step-1/shard", data)

    def reads() -> list[str]:
        got = [s for s in proxy.seen if s.method == "GET" and "shard" in s.path]
        return ["media" if "alt=media" in s.path else "metadata" for s in got]

    def read_back(name: str) -> bytes:
        store.get_file("step-1/shard", str(tmp_path / name), size=len(data), crc32c=crc32c_bytes(data))
        return (tmp_path / name).read_bytes()

    assert read_back("one") == data
    assert reads() == ["media"]
    ignored = proxy.strip_header("Range")
    assert read_back("whole") == data
    assert ignored.served == 1 and reads() == ["media"] * 2
    proxy.clear()
    monkeypatch.setattr(gs_backend, "_answer_span", lambda resp: (0, None))
    assert read_back("fallback") == data
    assert reads() == ["media"] * 3 + ["metadata", "media"]
    assert leftovers(tmp_path) == ["fallback", "one", "whole"]


class TestGCSFileOfSeveralParts:
    """A file of three parts, read through a recording proxy in front of fake-gcs-server: parts of
    1 MiB (the smallest SPOTJOB_STORAGE_PART_SIZE), 4 at a time."""

    SIZE = 5 * MiB // 2

    @pytest.fixture
    def setup(
        self,
        fresh_uri: Callable[[str], str],
        fault_proxy: Callable[[str, Dialect], FaultProxy],
        gcs_server: str,
        make_storage: Callable[[str], Storage],
        monkeypatch: pytest.MonkeyPatch,
    ) -> tuple[Storage, FaultProxy, str, bytes]:
        monkeypatch.setenv("SPOTJOB_STORAGE_PART_SIZE", "1MiB")
        monkeypatch.setenv("SPOTJOB_STORAGE_CONCURRENCY", "4")
        uri = fresh_uri("gs")
        proxy = fault_proxy(gcs_server, "gcs")
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", proxy.url)
        store = make_storage(uri)
        data = os.urandom(self.SIZE)
        store.put_bytes("step-1/shard", data)
        return store, proxy, uri, data

    @staticmethod
    def reads(proxy: FaultProxy) -> list[str]:
        got = [s for s in proxy.seen if s.method == "GET" and "shard" in s.path]
        return ["media" if "alt=media" in s.path else "metadata" for s in got]

    def test_three_parts_cost_three_gets_and_a_wrong_size_is_refused_after_one(
        self, setup: tuple[Storage, FaultProxy, str, bytes], tmp_path: Path
    ) -> None:
        """The first part's media GET says the object's size and generation; before the fix the
        object's metadata GET came first (4 requests). A size other than the manifest's is refused
        from that first answer, and nothing is left."""
        store, proxy, _, data = setup
        store.get_file("step-1/shard", str(tmp_path / "back"), size=len(data), crc32c=crc32c_bytes(data))
        assert (tmp_path / "back").read_bytes() == data
        assert self.reads(proxy) == ["media"] * 3
        with pytest.raises(CorruptObjectError, match=f"is {self.SIZE} bytes, the manifest says {self.SIZE + 1}"):
            store.get_file("step-1/shard", str(tmp_path / "wrong"), size=len(data) + 1, crc32c=crc32c_bytes(data))
        assert self.reads(proxy) == ["media"] * 4
        assert leftovers(tmp_path) == ["back"]

    def test_an_answer_without_the_generation_falls_back_to_the_metadata_get(
        self,
        setup: tuple[Storage, FaultProxy, str, bytes],
        tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture,
    ) -> None:
        """fake-gcs-server always sends ``x-goog-generation``: the parsing is patched to find none.
        The first GET's answer is dropped unread and the read starts again the old way, said at
        INFO."""
        store, proxy, _, data = setup
        monkeypatch.setattr(gs_backend, "_answer_generation", lambda resp: None)
        caplog.set_level(logging.INFO, logger=gs_backend.__name__)
        store.get_file("step-1/shard", str(tmp_path / "back"), size=len(data), crc32c=crc32c_bytes(data))
        assert (tmp_path / "back").read_bytes() == data
        assert self.reads(proxy) == ["media", "metadata", "media", "media", "media"]
        said = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO and "generation" in r.getMessage()]
        assert said == [
            f"GET {store.url('step-1/shard')}: the answer does not say the object's generation; "
            "reading its size and generation first"
        ]
        assert leftovers(tmp_path) == ["back"]

    def test_a_first_part_refused_fails_the_read_without_the_other_parts(
        self, setup: tuple[Storage, FaultProxy, str, bytes], tmp_path: Path
    ) -> None:
        """The parts after the first are sent once its answer is read; when the first part fails
        for good before that (a 403 here) they are never sent, and its error is raised. Without
        the first part's end releasing the wait, the read waits forever (tried: the test times
        out); before the fix the three parts went out together after the metadata GET."""
        store, proxy, _, data = setup
        denied = proxy.fail(1, 403, method="GET", path=r"shard\?alt=media")
        with pytest.raises(PermanentStorageError, match="permission denied"):
            store.get_file("step-1/shard", str(tmp_path / "back"), size=len(data), crc32c=crc32c_bytes(data))
        assert denied.served == 1 and self.reads(proxy).count("media") == 1
        assert leftovers(tmp_path) == []

    def test_an_object_replaced_after_the_first_answer_is_refused(
        self,
        setup: tuple[Storage, FaultProxy, str, bytes],
        tmp_path: Path,
        overwrite_behind_the_backends_back: Callable[[str, str, bytes], None],
    ) -> None:
        """The object is replaced (through the server, not the proxy) as the second media GET
        reaches the proxy, before it is forwarded: the other parts read the first answer's
        generation, which is gone, and nothing of either version is kept. Before the fix the
        metadata GET's generation was pinned, and this was refused too."""
        store, proxy, uri, data = setup
        media: list[str] = []

        def replace_at_the_second(req: Any) -> bool:
            if "alt=media" not in req.path:
                return False
            media.append(req.path)
            if len(media) == 2:
                overwrite_behind_the_backends_back(uri, "step-1/shard", os.urandom(self.SIZE))
            return False  # never fires: only watches

        proxy.fail(1, 503, method="GET", path=r"shard\?", match=replace_at_the_second)
        with pytest.raises(NotFoundError, match=r"generation \d+ of the object is gone"):
            store.get_file("step-1/shard", str(tmp_path / "back"), size=len(data), crc32c=crc32c_bytes(data))
        assert len(media) == 3 and proxy.faults_served == 0
        assert leftovers(tmp_path) == []


def put_tiny_objects(uri: str, keys: list[str]) -> None:
    """Store ``b"x"`` under each key below ``uri``, behind the store's back: this only sets the
    scene for a test of listing and deleting (``put_bytes`` has tests of its own), and 2002 uploads
    through the store's client cost more CPU than the rest of such a test. On S3 the objects go
    straight into moto's backend, which the server in this process answers from; on GCS as plain
    media uploads to fake-gcs-server, one connection per thread."""
    parsed = urlparse(uri)
    bucket, prefix = parsed.netloc, parsed.path.strip("/")
    if parsed.scheme == "s3":
        from moto.core import DEFAULT_ACCOUNT_ID
        from moto.s3.models import s3_backends

        backend = s3_backends[DEFAULT_ACCOUNT_ID]["aws"]
        for key in keys:
            backend.put_object(bucket, f"{prefix}/{key}", b"x")
        return
    server = urlparse(os.environ["STORAGE_EMULATOR_HOST"])
    local = threading.local()
    opened: list[http.client.HTTPConnection] = []

    def put(key: str) -> None:
        target = f"/upload/storage/v1/b/{bucket}/o?uploadType=media&name={quote(f'{prefix}/{key}', safe='')}"
        for _ in range(2):  # once more on a fresh connection if the server closed the kept one
            conn = getattr(local, "conn", None)
            if conn is None:
                conn = local.conn = http.client.HTTPConnection(server.hostname, server.port, timeout=60)
                opened.append(conn)
            try:
                conn.request("POST", target, body=b"x", headers={"Content-Type": "application/octet-stream"})
                resp = conn.getresponse()
                body = resp.read()
            except (ConnectionError, http.client.HTTPException):
                conn.close()
                local.conn = None
                continue
            if resp.will_close:
                conn.close()
                local.conn = None
            assert resp.status == 200, f"POST {target}: {resp.status} {body[:300]!r}"
            return
        raise AssertionError(f"POST {target}: the server closed the connection twice")

    try:
        parallel_map(put, [(k,) for k in keys], 4)
    finally:
        for conn in opened:
            conn.close()


def put_files_bytes(store: Storage, keys: list[str]) -> None:
    for key in keys:
        store.put_bytes(key, key.encode())


# -- faults: what is retried, what is not ----------------------------------------------------
class Pattern(TypedDict, total=False):
    """Which requests a fault rule hits: ``FaultProxy.fail(..., **pattern)``."""

    method: str
    path: str


@dataclass
class Faulty:
    """A store whose every request goes through a fault proxy in front of the real server.

    The request patterns name each backend's wire protocol, so rules hit only the requests a test
    means (google-cloud-storage also fetches bucket metadata in the background, for tracing).
    """

    store: Storage
    proxy: FaultProxy
    scheme: str

    def part_upload(self) -> Pattern:
        """A part of a multipart upload (S3) / a chunk of a resumable upload (GCS)."""
        return {"method": "PUT", "path": r"partNumber=" if self.scheme == "s3" else r"upload_id="}

    def ranged_read(self) -> Pattern:
        return {"method": "GET", "path": r"step-1/shard" if self.scheme == "s3" else r"shard\?alt=media"}

    def small_put(self) -> Pattern:
        """A one-request upload of the manifest (S3 PutObject / GCS multipart upload)."""
        if self.scheme == "s3":
            return {"method": "PUT", "path": r"MANIFEST"}
        return {"method": "POST", "path": r"uploadType=multipart"}

    def small_get(self) -> Pattern:
        return {"method": "GET", "path": r"MANIFEST\.json$" if self.scheme == "s3" else r"MANIFEST\.json\?alt=media"}

    def metadata_read(self) -> Pattern:
        """HEAD (S3) / the object's metadata GET (GCS): what stat() sends."""
        if self.scheme == "s3":
            return {"method": "HEAD"}
        return {"method": "GET", "path": r"^/storage/v1/b/[^/?]+/o/[^?]+\?"}  # not /download/...?alt=media

    def count(self, pattern: Pattern) -> int:
        """Requests the proxy saw that match ``pattern``."""
        path = re.compile(pattern.get("path", ""))
        return sum(1 for s in self.proxy.seen if s.method == pattern["method"] and path.search(s.path))


@pytest.fixture(params=["s3", "gs"])
def faulty(
    request: pytest.FixtureRequest,
    monkeypatch: pytest.MonkeyPatch,
    fresh_uri: Callable[[str], str],
    fault_proxy: Callable[[str, Dialect], FaultProxy],
    make_storage: Callable[[str], Storage],
    fast_retries: None,
    small_parts: None,
) -> Faulty:
    scheme: str = request.param
    uri = fresh_uri(scheme)  # bucket created directly on the server, not through the proxy
    if scheme == "s3":
        proxy = fault_proxy(request.getfixturevalue("moto_server"), "s3")
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
    else:
        proxy = fault_proxy(request.getfixturevalue("gcs_server"), "gcs")
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", proxy.url)
    return Faulty(make_storage(uri), proxy, scheme)


def retry_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == RETRY_LOGGER and "retrying" in r.getMessage()]


class TestFaults:
    def test_a_big_upload_rides_out_throttling_and_a_dropped_connection(
        self, faulty: Faulty, tmp_path: Path, caplog: pytest.LogCaptureFixture
    ) -> None:
        caplog.set_level(logging.WARNING, logger=RETRY_LOGGER)
        throttled = faulty.proxy.fail(2, 503, **faulty.part_upload())
        dropped = faulty.proxy.drop(1, when="before", **faulty.part_upload())
        src = tmp_path / "src.bin"
        crc, size = write_random(src, BIG)

        faulty.store.put_file(str(src), "step-1/shard", crc32c=crc)

        assert (throttled.served, dropped.served) == (2, 1)
        assert len(retry_lines(caplog)) == 3
        assert all("step-1/shard" in line for line in retry_lines(caplog))
        faulty.store.get_file("step-1/shard", str(tmp_path / "dst"), size=size, crc32c=crc)
        assert crc32c_file(tmp_path / "dst") == (crc, size)

    def test_a_download_rides_out_throttling_and_a_body_cut_short(
        self, faulty: Faulty, tmp_path: Path, caplog: pytest.LogCaptureFixture
    ) -> None:
        caplog.set_level(logging.WARNING, logger=RETRY_LOGGER)
        src = tmp_path / "src.bin"
        crc, size = write_random(src, BIG)
        faulty.store.put_file(str(src), "step-1/shard", crc32c=crc)
        throttled = faulty.proxy.fail(1, 429, **faulty.ranged_read())
        cut = faulty.proxy.drop(2, when="mid_body", **faulty.ranged_read())

        faulty.store.get_file("step-1/shard", str(tmp_path / "dst"), size=size, crc32c=crc)

        assert (throttled.served, cut.served) == (1, 2)
        assert len(retry_lines(caplog)) == 3
        assert crc32c_file(tmp_path / "dst") == (crc, size)
        assert leftovers(tmp_path) == ["dst", "src.bin"]

    def test_a_commit_whose_answer_was_lost_is_not_mistaken_for_someone_elses(
        self, faulty: Faulty, caplog: pytest.LogCaptureFixture
    ) -> None:
        caplog.set_level(logging.INFO, logger="agent.storage")
        lost = faulty.proxy.drop(1, when="after", **faulty.small_put())

        faulty.store.put_bytes_if_absent("step-1/MANIFEST.json", b'{"step": 1}')  # landed, answer lost

        assert lost.served == 1
        assert len(retry_lines(caplog)) == 1
        assert any("an earlier attempt had already created it" in r.getMessage() for r in caplog.records)
        assert faulty.store.get_bytes("step-1/MANIFEST.json") == b'{"step": 1}'
        with pytest.raises(AlreadyExistsError):
            faulty.store.put_bytes_if_absent("step-1/MANIFEST.json", b'{"step": 1, "other": true}')

    def test_a_record_is_read_with_one_get_that_keeps_every_check_the_head_made(
        self, faulty: Faulty, caplog: pytest.LogCaptureFixture
    ) -> None:
        """The owner record, an attempt record, a claim, a manifest whose size no listing gave:
        each was read with a HEAD (GCS: the object's metadata GET) and then a GET, two requests on
        every fence check, retention pass and controller pass. Now one GET, whose answer does what
        the HEAD did: the record's size checked before its body is read, its time (a claim's age),
        not-found told from a missing bucket. Counted at the proxy, on the real protocols."""
        store, proxy = faulty.store, faulty.proxy
        claim = _claim.Claim.mine(_claim.new_id(), "train", 3)
        store.put_bytes(f"step-1/{_claim.CLAIM_NAME}", claim.to_json())
        claim_get = {"method": "GET", "path": re.escape(quote(_claim.CLAIM_NAME))}

        def requests_for(read: Callable[[], Any]) -> tuple[Any, list[str]]:
            before = len(proxy.seen)
            result = read()
            return result, [s.method for s in proxy.seen[before:]]

        caplog.set_level(logging.WARNING, logger=RETRY_LOGGER)
        throttled = proxy.fail(1, 503, **claim_get)
        (read, written), methods = requests_for(lambda: _claim.read_claim_stamped(store, "step-1"))
        assert read == claim and written is not None, (read, written)
        assert (throttled.served, methods) == (1, ["GET", "GET"]), "one GET, sent again after the 503"
        assert len(retry_lines(caplog)) == 1

        (read, written), methods = requests_for(lambda: _claim.read_claim_stamped(store, "step-1"))
        assert read == claim and methods == ["GET"], methods
        assert faulty.count(faulty.metadata_read()) == 0, "a HEAD (a metadata GET) came back"

        # None there: one GET too (the bucket is known to exist), and no claim.
        assert requests_for(lambda: _claim.read_claim_stamped(store, "step-2")) == ((None, None), ["GET"])
        with pytest.raises(NotFoundError):
            store.get_small("step-2/other.json", 10)

        # Too big: refused as the HEAD's size refused it, from the answer's Content-Length.
        store.put_bytes(".spotjob/owner.json", b" " * (MAX_RECORD_BYTES + 1))
        before = len(proxy.seen)
        with pytest.raises(OwnershipError, match=f"{MAX_RECORD_BYTES + 1} bytes, more than the {MAX_RECORD_BYTES}"):
            read_owner(store)
        assert [s.method for s in proxy.seen[before:]] == ["GET"]
        assert faulty.count(faulty.metadata_read()) == 0

    def test_a_part_or_chunk_longer_than_one_read_of_the_file_goes_up_whole(
        self, faulty: Faulty, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Linux's pread returns at most 2 GiB - 4 KiB a call, and SPOTJOB_STORAGE_UPLOAD_PART_SIZE
        and UPLOAD_CHUNK_SIZE may be up to 5 GiB: a part read with one pread failed its upload,
        "shrank while being uploaded" (S3), and a GCS chunk went up short of its 256 KiB multiple
        (GCS refuses it; fake-gcs-server takes it, hence the count). The kernel's cap is brought
        down here to 1 MiB - 4 KiB, under the 5 MiB parts, which a test can afford."""
        real_pread = os.pread
        monkeypatch.setattr(os, "pread", lambda fd, n, offset: real_pread(fd, min(n, MiB - 4096), offset))
        src = tmp_path / "src.bin"
        crc, size = write_random(src, BIG)

        faulty.store.put_file(str(src), "step-1/shard", crc32c=crc)

        assert faulty.count(faulty.part_upload()) == 3, "one request per 5 MiB part or chunk"
        faulty.store.get_file("step-1/shard", str(tmp_path / "dst"), size=size, crc32c=crc)
        assert crc32c_file(tmp_path / "dst") == (crc, size)

    def test_the_last_step_of_a_big_upload_whose_answer_was_lost_still_succeeds(
        self, faulty: Faulty, tmp_path: Path, caplog: pytest.LogCaptureFixture
    ) -> None:
        caplog.set_level(logging.INFO, logger="agent.storage")
        # S3: CompleteMultipartUpload lands, its answer is lost, the retry is told NoSuchUpload
        # (what S3 may answer for a completed upload; moto would complete it again, so the proxy
        # plays S3 for that one answer).
        # GCS: the last chunk lands, its answer is lost, the retry finds the session gone (404).
        if faulty.scheme == "s3":
            lost = faulty.proxy.drop(1, when="after", method="POST", path=r"uploadId=")
            faulty.proxy.fail(1, 404, code="NoSuchUpload", method="POST", path=r"uploadId=")
        else:
            lost = faulty.proxy.drop(
                1, when="after", method="PUT", path=r"upload_id=", match=lambda r: _is_last_chunk(r.headers)
            )
        src = tmp_path / "src.bin"
        crc, size = write_random(src, BIG)

        faulty.store.put_file(str(src), "step-1/shard", crc32c=crc)

        assert lost.served == 1
        assert any("an earlier attempt had already completed" in r.getMessage() for r in caplog.records)
        faulty.store.get_file("step-1/shard", str(tmp_path / "dst"), size=size, crc32c=crc)

    def test_persistent_server_errors_give_up_after_the_configured_attempts(
        self, faulty: Faulty, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
    ) -> None:
        caplog.set_level(logging.WARNING, logger=RETRY_LOGGER)
        monkeypatch.setenv("SPOTJOB_STORAGE_MAX_ATTEMPTS", "3")
        broken = faulty.proxy.fail(1000, 500, **faulty.small_put())

        with pytest.raises(TransientStorageError) as caught:
            faulty.store.put_bytes("step-1/MANIFEST.json", b"{}")

        assert caught.value.key == "step-1/MANIFEST.json"
        # Exactly our three attempts reached the wire: the client library adds none of its own.
        assert broken.served == 3
        assert faulty.count(faulty.small_put()) == 3
        assert len(retry_lines(caplog)) == 2

    def test_a_403_is_permanent_and_not_retried(self, faulty: Faulty, caplog: pytest.LogCaptureFixture) -> None:
        caplog.set_level(logging.WARNING, logger=RETRY_LOGGER)
        faulty.store.put_bytes("step-1/MANIFEST.json", b"{}")
        denied = faulty.proxy.fail(1, 403, **faulty.small_get())

        with pytest.raises(PermanentStorageError) as caught:
            faulty.store.get_bytes("step-1/MANIFEST.json")

        assert not isinstance(caught.value, NotFoundError)
        assert caught.value.key == "step-1/MANIFEST.json"
        assert denied.served == 1
        assert faulty.count(faulty.small_get()) == 1  # not retried
        assert retry_lines(caplog) == []

    def test_stat_retries_throttling_and_sees_a_missing_key_as_none(
        self, faulty: Faulty, caplog: pytest.LogCaptureFixture
    ) -> None:
        caplog.set_level(logging.WARNING, logger=RETRY_LOGGER)
        faulty.store.put_bytes("step-1/MANIFEST.json", b"{}")
        throttled = faulty.proxy.fail(2, 503, **faulty.metadata_read())
        info = faulty.store.stat("step-1/MANIFEST.json")
        assert info is not None and info.size == 2
        assert throttled.served == 2
        assert faulty.store.stat("step-1/nothing") is None
        assert len(retry_lines(caplog)) == 2


@pytest.mark.usefixtures("fast_retries")
def test_a_file_commit_whose_folder_sync_failed_once_is_not_mistaken_for_someone_elses(
    tmp_path: Path, make_storage: Callable[[str], Storage], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The file store's lost last answer: the link landed, the folder's sync (an NFS reply) failed,
    and the retry's link finds the name taken by our own write."""
    from agent.storage import file as file_backend

    store = make_storage(f"file://{tmp_path / 'ckpt'}")
    sync = file_backend._fsync_dir
    failed = []

    def sync_failing_once(path: str) -> None:
        if not failed:
            failed.append(path)
            raise OSError(errno.EIO, "Input/output error", path)
        sync(path)

    monkeypatch.setattr(file_backend, "_fsync_dir", sync_failing_once)

    store.put_bytes_if_absent("step-1/MANIFEST.json", b'{"step": 1}')

    assert failed
    assert store.get_bytes("step-1/MANIFEST.json") == b'{"step": 1}'
    assert leftovers(tmp_path / "ckpt" / "step-1") == ["MANIFEST.json"]
    with pytest.raises(AlreadyExistsError):
        store.put_bytes_if_absent("step-1/MANIFEST.json", b'{"step": 1, "other": true}')


def test_a_file_commit_retried_after_a_failed_sync_still_refuses_someone_elses_bytes(
    tmp_path: Path, make_storage: Callable[[str], Storage], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Reading back is no licence to overwrite: when the name a retry finds holds other bytes (a
    writer that got in between), the commit is still someone else's."""
    from agent.storage import file as file_backend

    monkeypatch.setenv("SPOTJOB_STORAGE_BASE_BACKOFF_S", "0")
    store = make_storage(f"file://{tmp_path / 'ckpt'}")
    sync = file_backend._fsync_dir

    def sync_then_someone_else_wins(path: str) -> None:
        monkeypatch.setattr(file_backend, "_fsync_dir", sync)
        other = tmp_path / "other-writer"
        other.write_bytes(b'{"step": 1, "other": true}')
        os.replace(other, os.path.join(path, "MANIFEST.json"))
        raise OSError(errno.EIO, "Input/output error", path)

    monkeypatch.setattr(file_backend, "_fsync_dir", sync_then_someone_else_wins)

    with pytest.raises(AlreadyExistsError):
        store.put_bytes_if_absent("step-1/MANIFEST.json", b'{"step": 1}')
    assert store.get_bytes("step-1/MANIFEST.json") == b'{"step": 1, "other": true}'


def _is_last_chunk(headers: Message) -> bool:
    rng = headers.get("Content-Range", "")  # "bytes START-END/TOTAL"
    if "-" not in rng or "/" not in rng:
        return False
    end, total = rng.split("-", 1)[1].split("/")
    return end.isdigit() and total.isdigit() and int(end) + 1 == int(total)
