"""The bytes an upload holds in memory, on moto's S3 and fake-gcs-server: bounded by
``SPOTJOB_STORAGE_MAX_BUFFER_BYTES`` whatever ``CONCURRENCY`` x the part size and the number of
files at once.

What is measured is independent of the budget's own bookkeeping: every buffer the backend fills
from a local file goes through ``read_at`` (wrapped here to count its bytes in), and is let go when
the request that sends it has been answered (the client's send wrapped to count them out). The
high-water mark of what is in between is what the uploads held at once.
"""

from __future__ import annotations

import os
import threading
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from agent.crc32c import crc32c_file
from agent.storage import Storage
from agent.storage import _transfer as transfer
from agent.storage import gs as gs_backend
from agent.storage import s3 as s3_backend
from agent.storage.base import get_files, put_files

KiB = 1024
MiB = 1024 * KiB


class InFlight:
    """Bytes read for an upload and not yet sent, and their high-water mark."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.now = 0
        self.high = 0
        self.buffers = 0

    def read(self, real: Callable[[int, int, int], bytes]) -> Callable[[int, int, int], bytes]:
        def read_at(fd: int, length: int, offset: int) -> bytes:
            data = real(fd, length, offset)
            with self._lock:
                self.now += len(data)
                self.high = max(self.high, self.now)
                self.buffers += 1
            return data

        return read_at

    def sent(self, n: int) -> None:
        with self._lock:
            self.now -= n


def make_files(tmp_path: Path, sizes: list[int]) -> list[tuple[str, str, int, int]]:
    """``(local path, key, crc32c, size)`` of new files of random bytes."""
    files = []
    for i, size in enumerate(sizes):
        src = tmp_path / f"shard{i}.bin"
        src.write_bytes(os.urandom(size))
        crc, _ = crc32c_file(src)
        files.append((str(src), f"step-1/shard{i}", crc, size))
    return files


def round_trip(store: Storage, files: list[tuple[str, str, int, int]], tmp_path: Path) -> None:
    put_files(store, [(p, k, c) for p, k, c, _ in files], parallelism=len(files))
    get_files(store, [(k, str(tmp_path / "back" / k), s, c) for _, k, c, s in files])
    for local, key, _, _ in files:
        assert (tmp_path / "back" / key).read_bytes() == Path(local).read_bytes()


def watched_s3(store: Any, monkeypatch: pytest.MonkeyPatch) -> InFlight:
    flight = InFlight()
    monkeypatch.setattr(s3_backend, "read_at", flight.read(s3_backend.read_at))  # parts
    monkeypatch.setattr(transfer, "read_at", flight.read(transfer.read_at))  # files sent whole
    client = store._client
    for method in ("upload_part", "put_object"):
        real = getattr(client, method)

        def send(real: Any = real, **kwargs: Any) -> Any:
            answer = real(**kwargs)
            flight.sent(len(kwargs["Body"]))
            return answer

        monkeypatch.setattr(client, method, send)
    return flight


def watched_gcs(store: Any, monkeypatch: pytest.MonkeyPatch) -> InFlight:
    flight = InFlight()
    monkeypatch.setattr(gs_backend, "read_at", flight.read(gs_backend.read_at))  # chunks
    monkeypatch.setattr(transfer, "read_at", flight.read(transfer.read_at))  # files sent whole
    real_put = store._session.put
    real_simple = store._upload_simple

    def put(url: str, data: bytes, **kwargs: Any) -> Any:  # a resumable upload's chunk
        answer = real_put(url, data=data, **kwargs)
        flight.sent(len(data))
        return answer

    def simple(key: str, data: bytes, **kwargs: Any) -> None:  # a small file's one request
        real_simple(key, data, **kwargs)
        flight.sent(len(data))

    monkeypatch.setattr(store._session, "put", put)
    monkeypatch.setattr(store, "_upload_simple", simple)
    return flight


class TestS3:
    PART = 5 * MiB  # S3's smallest part

    @pytest.fixture(autouse=True)
    def _parts(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv("SPOTJOB_STORAGE_UPLOAD_PART_SIZE", str(self.PART))
        monkeypatch.setenv("SPOTJOB_STORAGE_MULTIPART_THRESHOLD", str(self.PART))
        monkeypatch.setenv("SPOTJOB_STORAGE_CONCURRENCY", "8")

    def test_parts_and_small_files_in_flight_stay_within_the_budget(
        self,
        fresh_uri: Callable[[str], str],
        make_storage: Callable[[str], Storage],
        tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch,
    ) -> None:
        """Two files of 8 parts each and three small files go up at once, 8 parts in flight: 40 MiB
        of parts read at once before the fix, whatever the budget; two parts' worth with it."""
        budget = 2 * self.PART
        monkeypatch.setenv("SPOTJOB_STORAGE_MAX_BUFFER_BYTES", str(budget))
        store = make_storage(fresh_uri("s3"))
        flight = watched_s3(store, monkeypatch)
        files = make_files(tmp_path, [8 * self.PART, 8 * self.PART - 7, 3 * MiB, 4 * MiB, 1 * MiB])

        round_trip(store, files, tmp_path)

        assert self.PART <= flight.high <= budget, f"{flight.high} bytes in flight, the budget is {budget}"
        assert flight.buffers == 8 + 8 + 3, "every part and small file was read through read_at"

    def test_a_part_bigger_than_the_whole_budget_goes_up_alone(
        self,
        fresh_uri: Callable[[str], str],
        make_storage: Callable[[str], Storage],
        tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch,
    ) -> None:
        """A 1 MiB budget under 5 MiB parts: each part waits for the one before (rather than for a
        budget it can never fit in), so the upload completes with one part in memory at a time."""
        monkeypatch.setenv("SPOTJOB_STORAGE_MAX_BUFFER_BYTES", "1MiB")
        store = make_storage(fresh_uri("s3"))
        flight = watched_s3(store, monkeypatch)
        files = make_files(tmp_path, [4 * self.PART + 123, 3 * self.PART])

        round_trip(store, files, tmp_path)

        assert flight.high == self.PART
        assert flight.buffers == 5 + 3


class TestGCS:
    CHUNK = 1 * MiB  # a multiple of GCS's 256 KiB

    @pytest.fixture(autouse=True)
    def _chunks(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv("SPOTJOB_STORAGE_UPLOAD_CHUNK_SIZE", str(self.CHUNK))
        monkeypatch.setenv("SPOTJOB_STORAGE_MULTIPART_THRESHOLD", str(self.CHUNK))

    def test_chunks_of_files_going_up_at_once_stay_within_the_budget(
        self,
        fresh_uri: Callable[[str], str],
        make_storage: Callable[[str], Storage],
        tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch,
    ) -> None:
        """A resumable upload holds one chunk per file, and ``put_files`` sends 8 files at once: 8
        chunks read at once before the fix, whatever the budget; two chunks' worth with it."""
        budget = 2 * self.CHUNK
        monkeypatch.setenv("SPOTJOB_STORAGE_MAX_BUFFER_BYTES", str(budget))
        store = make_storage(fresh_uri("gs"))
        flight = watched_gcs(store, monkeypatch)
        files = make_files(tmp_path, [3 * self.CHUNK] * 6 + [self.CHUNK - 1, 300 * KiB])

        round_trip(store, files, tmp_path)

        assert self.CHUNK <= flight.high <= budget, f"{flight.high} bytes in flight, the budget is {budget}"
        assert flight.buffers == 6 * 3 + 2, "every chunk and small file was read through read_at"

    def test_a_chunk_bigger_than_the_whole_budget_goes_up_alone(
        self,
        fresh_uri: Callable[[str], str],
        make_storage: Callable[[str], Storage],
        tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch,
    ) -> None:
        monkeypatch.setenv("SPOTJOB_STORAGE_UPLOAD_CHUNK_SIZE", str(2 * self.CHUNK))
        monkeypatch.setenv("SPOTJOB_STORAGE_MAX_BUFFER_BYTES", "1MiB")
        store = make_storage(fresh_uri("gs"))
        flight = watched_gcs(store, monkeypatch)
        files = make_files(tmp_path, [5 * self.CHUNK + 5] * 4)

        round_trip(store, files, tmp_path)

        assert flight.high == 2 * self.CHUNK
        assert flight.buffers == 4 * 3

    def test_a_file_sent_in_one_request_is_held_once_not_copied_into_the_request(
        self,
        fresh_uri: Callable[[str], str],
        make_storage: Callable[[str], Storage],
        tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch,
    ) -> None:
        """A file under GCS's 8 MiB one-request limit is read whole, its size held under the budget,
        and was then joined with the request's metadata into a second copy, sent while the first was
        still held: twice its size in memory, the budget counting one. Measured by tracemalloc around
        the upload (fake-gcs-server is another process): the file's bytes, and not a second time."""
        monkeypatch.setenv("SPOTJOB_STORAGE_MULTIPART_THRESHOLD", "64MiB")  # the default: one request
        store = make_storage(fresh_uri("gs"))
        size = 7 * MiB
        (src, key, crc, _), warm = make_files(tmp_path, [size, 1000])
        store.put_file(warm[0], warm[1], crc32c=warm[2])  # the client's first request, its allocations

        tracemalloc.start()
        try:
            store.put_file(src, key, crc32c=crc)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()

        assert peak < size + size // 4, f"{peak} bytes held at once to upload a file of {size}"
        assert store.stat(key) is not None and store.stat(key).size == size  # type: ignore[union-attr]
