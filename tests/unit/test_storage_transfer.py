"""Pure logic under the S3 / GCS backends: CRC combining, part spans, settings, the retry policy,
and how client exceptions are classified. No servers."""

from __future__ import annotations

import errno
import logging
import os
import random
import re
import socket
import threading
import time
from pathlib import Path

import botocore.exceptions
import google_crc32c
import pytest
import requests
from google.api_core import exceptions as api_exceptions

from agent.crc32c import crc32c_bytes, crc32c_combine, crc32c_concat
from agent.storage import (
    MissingBucketError,
    NotFoundError,
    PermanentStorageError,
    TransientStorageError,
    open_storage,
)
from agent.storage import gs as gs_backend
from agent.storage import s3 as s3_backend
from agent.storage._retry import max_attempts, retry_transient
from agent.storage._transfer import (
    ByteBudget,
    GiB,
    MiB,
    RangeSink,
    TransferPool,
    TransferSettings,
    crc_from_b64,
    crc_to_b64,
    rank_share,
    spans,
)


def crc(data: bytes) -> int:
    """An independent implementation (google-crc32c) to check awscrt's against."""
    return int(google_crc32c.value(data))


class TestCrcCombine:
    def test_combining_the_crcs_of_two_pieces_gives_the_crc_of_the_whole(self) -> None:
        rng = random.Random(7)
        data = rng.randbytes(100_003)
        for cut in (0, 1, 7, 4096, 65_537, 100_002, 100_003):
            a, b = data[:cut], data[cut:]
            assert crc32c_combine(crc(a), crc(b), len(b)) == crc(data)

    def test_concatenating_many_parts_in_order(self) -> None:
        rng = random.Random(11)
        parts = [rng.randbytes(n) for n in (5, 0, 1000, 3, 70_000, 1)]
        assert crc32c_concat([(crc(p), len(p)) for p in parts]) == crc(b"".join(parts))
        assert crc32c_concat([]) == 0

    def test_awscrt_agrees_with_google_crc32c_on_bytes_and_on_views_of_live_buffers(self) -> None:
        data = bytearray(random.Random(3).randbytes(300_001))
        view = memoryview(data)
        assert crc32c_bytes(data) == crc(bytes(data))
        assert crc32c_bytes(view[1000:], crc32c_bytes(view[:1000])) == crc(bytes(data))

    def test_base64_form_is_the_big_endian_bytes(self) -> None:
        assert crc_to_b64(crc(b"xyz")) == "JSNohQ=="  # as S3 and GCS report it
        assert crc_from_b64("JSNohQ==") == crc(b"xyz")


def test_spans_cover_the_object_with_a_short_last_part() -> None:
    assert spans(0, 10) == []
    assert spans(10, 10) == [(0, 10)]
    assert spans(25, 10) == [(0, 10), (10, 10), (20, 5)]


BUFFER_RANGE = (
    "a size in bytes from 1MiB to 5TiB (1048576 to 5497558138880), e.g. 1GiB: the upload buffers of the whole "
    "node, shared equally by its LOCAL_WORLD_SIZE ranks"
)


class TestSettings:
    def test_environment_overrides_the_defaults(self, monkeypatch: pytest.MonkeyPatch) -> None:
        d = TransferSettings()
        assert (d.part_size, d.upload_part_size, d.upload_chunk_size) == (64 * MiB, 8 * MiB, 100 * MiB)
        monkeypatch.setenv("SPOTJOB_STORAGE_PART_SIZE", "16MiB")
        monkeypatch.setenv("SPOTJOB_STORAGE_UPLOAD_PART_SIZE", "6MiB")
        monkeypatch.setenv("SPOTJOB_STORAGE_UPLOAD_CHUNK_SIZE", "32MiB")
        monkeypatch.setenv("SPOTJOB_STORAGE_MULTIPART_THRESHOLD", "1048576")
        monkeypatch.setenv("SPOTJOB_STORAGE_CONCURRENCY", "3")
        s = TransferSettings.from_env()
        assert (s.part_size, s.upload_part_size, s.upload_chunk_size, s.multipart_threshold, s.concurrency) == (
            16 * MiB,
            6 * MiB,
            32 * MiB,
            MiB,
            3,
        )

    def test_nonsense_is_refused_up_front(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv("SPOTJOB_STORAGE_PART_SIZE", "lots")
        with pytest.raises(ValueError, match="SPOTJOB_STORAGE_PART_SIZE"):
            TransferSettings.from_env()
        with pytest.raises(ValueError):
            TransferSettings(concurrency=0)
        with pytest.raises(ValueError, match="upload_part_size"):
            TransferSettings(upload_part_size=0)
        with pytest.raises(ValueError, match="upload_chunk_size"):
            TransferSettings(upload_chunk_size=0)
        monkeypatch.setenv("SPOTJOB_STORAGE_PART_SIZE", "64MiB")
        monkeypatch.setenv("SPOTJOB_STORAGE_UPLOAD_CHUNK_SIZE", "-1")
        with pytest.raises(ValueError, match="SPOTJOB_STORAGE_UPLOAD_CHUNK_SIZE"):
            TransferSettings.from_env()

    @pytest.mark.parametrize("value", ["1", "64KiB", str(MiB - 1)])
    def test_a_download_range_below_1mib_is_refused_naming_the_variable_and_the_range(
        self, monkeypatch: pytest.MonkeyPatch, value: str
    ) -> None:
        """``SPOTJOB_STORAGE_PART_SIZE=1`` was taken: a 400 kB restore sent some 210 000 one-byte
        range GETs. A range streams to its file in blocks of 1 MiB, so a smaller one saves no memory
        and only multiplies the requests."""
        monkeypatch.setenv("SPOTJOB_STORAGE_PART_SIZE", value)
        with pytest.raises(ValueError, match=f"SPOTJOB_STORAGE_PART_SIZE='{value}'") as refused:
            TransferSettings.from_env()
        assert "a size in bytes from 1MiB to 5GiB (1048576 to 5368709120)" in str(refused.value)
        with pytest.raises(ValueError, match="part_size must be from 1 MiB to 5 GiB"):
            TransferSettings(part_size=MiB - 1)
        monkeypatch.setenv("SPOTJOB_STORAGE_PART_SIZE", "1MiB")
        assert TransferSettings.from_env().part_size == MiB

    @pytest.mark.parametrize(
        ("variable", "value"),
        [
            ("SPOTJOB_STORAGE_MAX_ATTEMPTS", "inf"),
            ("SPOTJOB_STORAGE_MAX_ATTEMPTS", "2.5"),
            ("SPOTJOB_STORAGE_READ_TIMEOUT_S", "inf"),
            ("SPOTJOB_STORAGE_CONNECT_TIMEOUT_S", "nan"),
            ("SPOTJOB_STORAGE_READ_TIMEOUT_S", "1e12"),
            ("SPOTJOB_STORAGE_BASE_BACKOFF_S", "nan"),
            ("SPOTJOB_STORAGE_MAX_BACKOFF_S", "inf"),
        ],
    )
    def test_numbers_a_client_cannot_use_are_refused_up_front(
        self, monkeypatch: pytest.MonkeyPatch, variable: str, value: str
    ) -> None:
        """Not at the first retry (``int(inf)``) or on every request (a timeout past time_t),
        where the failure names no variable and an infinite timeout retries forever."""
        monkeypatch.setenv(variable, value)
        with pytest.raises(ValueError, match=f"{variable}='{value}'"):
            TransferSettings.from_env()
        with pytest.raises(ValueError, match=variable):
            max_attempts()

    @pytest.mark.parametrize(
        ("variable", "value", "allowed"),
        [
            ("SPOTJOB_STORAGE_CONCURRENCY", "10000", "a whole number from 1 to 1024"),
            ("SPOTJOB_STORAGE_MAX_ATTEMPTS", "1000000000", "a whole number from 0 to 100"),
            ("SPOTJOB_STORAGE_PART_SIZE", "64GiB", "a size in bytes from 1MiB to 5GiB (1048576 to 5368709120)"),
            ("SPOTJOB_STORAGE_UPLOAD_PART_SIZE", "8GiB", "a positive size in bytes up to 5GiB (5368709120)"),
            ("SPOTJOB_STORAGE_UPLOAD_CHUNK_SIZE", "100GiB", "a positive size in bytes up to 5GiB (5368709120)"),
            ("SPOTJOB_STORAGE_MULTIPART_THRESHOLD", "5368709121", "a positive size in bytes up to 5GiB (5368709120)"),
            ("SPOTJOB_STORAGE_MAX_BUFFER_BYTES", "6TiB", BUFFER_RANGE),
        ],
    )
    def test_a_value_past_its_upper_bound_is_refused_naming_the_variable_and_the_range(
        self, monkeypatch: pytest.MonkeyPatch, variable: str, value: str, allowed: str
    ) -> None:
        """Failed before the fix: only lower bounds were checked, so a slip (10000 for 100, GiB for
        MiB) was taken: thousands of threads, parts S3 refuses, a dead store retried for days."""
        monkeypatch.setenv(variable, value)
        with pytest.raises(ValueError, match=re.escape(f"{variable}={value!r} is not {allowed}")):
            TransferSettings.from_env()
        with pytest.raises(ValueError, match=variable):
            max_attempts()

    def test_the_upper_bounds_themselves_are_taken(self, monkeypatch: pytest.MonkeyPatch) -> None:
        for name in ("PART_SIZE", "UPLOAD_PART_SIZE", "UPLOAD_CHUNK_SIZE", "MULTIPART_THRESHOLD"):
            monkeypatch.setenv(f"SPOTJOB_STORAGE_{name}", "5GiB")
        monkeypatch.setenv("SPOTJOB_STORAGE_CONCURRENCY", "1024")
        monkeypatch.setenv("SPOTJOB_STORAGE_MAX_ATTEMPTS", "100")
        s = TransferSettings.from_env()
        assert (s.part_size, s.upload_part_size, s.upload_chunk_size, s.multipart_threshold) == (5 << 30,) * 4
        assert (s.concurrency, max_attempts()) == (1024, 100)
        # Settings built in code are held to the same bounds.
        with pytest.raises(ValueError, match="concurrency must be from 1 to 1024"):
            TransferSettings(concurrency=1025)
        with pytest.raises(ValueError, match="upload_chunk_size must be from 1 byte to 5 GiB"):
            TransferSettings(upload_chunk_size=(5 << 30) + 1)

    def test_the_upload_buffer_budget_defaults_above_what_the_defaults_hold_and_is_read_from_the_environment(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        d = TransferSettings()
        assert d.max_buffer_bytes == GiB
        # The defaults never hold more at once in one process (8 files of one 100 MiB GCS chunk; 8 S3
        # files under the 64 MiB threshold, or 8 parts of 8 MiB): the budget slows no default upload
        # of a node's only rank (with more, each takes a share: see rank_share).
        assert 8 * max(d.upload_chunk_size, d.multipart_threshold, d.concurrency * d.upload_part_size) <= GiB
        monkeypatch.setenv("SPOTJOB_STORAGE_MAX_BUFFER_BYTES", "256MiB")
        assert TransferSettings.from_env().max_buffer_bytes == 256 * MiB
        for bound, value in (("1MiB", MiB), ("5TiB", 5 << 40)):
            monkeypatch.setenv("SPOTJOB_STORAGE_MAX_BUFFER_BYTES", bound)
            assert TransferSettings.from_env().max_buffer_bytes == value

    @pytest.mark.parametrize("value", ["64", "1048575", "0", "-1GiB", "6TiB", "lots", "1.5.GiB"])
    def test_an_upload_buffer_budget_out_of_range_is_refused_naming_the_variable_the_value_and_the_range(
        self, monkeypatch: pytest.MonkeyPatch, value: str
    ) -> None:
        """A bare 64 is 64 bytes (meant as 64MiB): every part would go up alone."""
        monkeypatch.setenv("SPOTJOB_STORAGE_MAX_BUFFER_BYTES", value)
        with pytest.raises(
            ValueError, match=re.escape(f"SPOTJOB_STORAGE_MAX_BUFFER_BYTES={value!r} is not {BUFFER_RANGE}")
        ):
            TransferSettings.from_env()
        with pytest.raises(ValueError, match="SPOTJOB_STORAGE_MAX_BUFFER_BYTES"):
            max_attempts()

    def test_an_upload_buffer_budget_built_in_code_is_held_to_the_same_range(self) -> None:
        for bad in (MiB - 1, (5 << 40) + 1):
            with pytest.raises(
                ValueError,
                match=re.escape(f"max_buffer_bytes must be from 1 MiB to 5 TiB (1048576 to 5497558138880), got {bad}"),
            ):
                TransferSettings(max_buffer_bytes=bad)
        assert TransferSettings(max_buffer_bytes=MiB).max_buffer_bytes == MiB

    def test_a_rank_takes_its_share_of_the_node_budget_never_under_a_mebibyte(self) -> None:
        assert rank_share(GiB, 1) == GiB
        assert rank_share(GiB, 8) == 128 * MiB
        assert rank_share(10 * MiB, 3) == 10 * MiB // 3  # whole bytes, the node's sum at most its budget
        assert rank_share(4 * MiB, 8) == MiB  # half a MiB each would be under the smallest budget
        assert rank_share(MiB, 1 << 20) == MiB
        assert rank_share(GiB, 0) == GiB  # no ranks said: the whole

    @pytest.mark.parametrize(
        ("local_world_size", "share"),
        [(None, GiB), ("1", GiB), ("8", 128 * MiB), ("2048", MiB)]
        + [(garbage, GiB) for garbage in ("", "0", "-8", "eight", "8.0", " 8", "²", "٨")],
    )
    def test_a_store_opened_by_a_training_rank_takes_the_share_local_world_size_gives(
        self, monkeypatch: pytest.MonkeyPatch, local_world_size: str | None, share: int
    ) -> None:
        """``SPOTJOB_STORAGE_MAX_BUFFER_BYTES`` is the node's; a process torchrun (or spotjob-agent's
        own launcher) started knows its node's ranks by ``LOCAL_WORLD_SIZE``. Unset (the CLI, the
        controller) or unreadable, the store keeps the whole. The bounds are the node budget's."""
        if local_world_size is None:
            monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
        else:
            monkeypatch.setenv("LOCAL_WORLD_SIZE", local_world_size)
        assert TransferSettings.from_env().max_buffer_bytes == share
        monkeypatch.setenv("SPOTJOB_STORAGE_MAX_BUFFER_BYTES", "1GiB")
        assert TransferSettings.from_env().max_buffer_bytes == share
        monkeypatch.setenv("SPOTJOB_STORAGE_MAX_BUFFER_BYTES", "64")
        with pytest.raises(ValueError, match=re.escape(f"SPOTJOB_STORAGE_MAX_BUFFER_BYTES='64' is not {BUFFER_RANGE}")):
            TransferSettings.from_env()
        # Settings built in code are a store's own: not split.
        assert TransferSettings(max_buffer_bytes=GiB).max_buffer_bytes == GiB

    def test_a_retry_policy_read_before_does_not_hide_a_malformed_timeout_set_after(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """The retry policy is validated once per setting and cached; its cache key held only the
        three retry variables, so after one read a malformed ``SPOTJOB_STORAGE_READ_TIMEOUT_S`` went
        unrefused by ``max_attempts()`` (the test above passed or failed with the order tests ran in)."""
        for name in [n for n in os.environ if n.upper().startswith("SPOTJOB_STORAGE_")]:
            monkeypatch.delenv(name)
        assert max_attempts() == 6
        monkeypatch.setenv("SPOTJOB_STORAGE_READ_TIMEOUT_S", "inf")
        with pytest.raises(ValueError, match="SPOTJOB_STORAGE_READ_TIMEOUT_S"):
            max_attempts()

    def test_the_create_only_check_is_on_unless_switched_off_and_a_non_boolean_is_refused(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        assert TransferSettings.from_env().s3_create_only_check is True
        monkeypatch.setenv("SPOTJOB_STORAGE_S3_CREATE_ONLY_CHECK", "0")
        assert TransferSettings.from_env().s3_create_only_check is False
        monkeypatch.setenv("SPOTJOB_STORAGE_S3_CREATE_ONLY_CHECK", "maybe")
        with pytest.raises(ValueError, match="SPOTJOB_STORAGE_S3_CREATE_ONLY_CHECK='maybe'"):
            TransferSettings.from_env()

    @pytest.mark.parametrize("variable", ["SPOTJOB_STORAGE_MAX_ATTEMPTS", "SPOTJOB_STORAGE_PART_SIZE"])
    def test_a_file_store_refuses_nonsense_when_opened(
        self, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, variable: str
    ) -> None:
        """A folder has no transfer settings of its own but retries like every store: a malformed
        value is refused when the store is opened, not at the first NFS hiccup mid-save."""
        monkeypatch.setenv(variable, "lots")
        with pytest.raises(ValueError, match=f"{variable}='lots'"):
            open_storage(f"file://{tmp_path}")


class TestRetryPolicy:
    def test_transient_errors_are_retried_and_each_retry_is_logged(
        self, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
    ) -> None:
        monkeypatch.setenv("SPOTJOB_STORAGE_BASE_BACKOFF_S", "0")
        calls = []

        def flaky() -> str:
            calls.append(1)
            if len(calls) < 3:
                raise TransientStorageError("throttled", "k")
            return "ok"

        with caplog.at_level(logging.WARNING, logger="agent.storage._retry"):
            assert retry_transient("PUT s3://b/k", flaky) == "ok"
        assert len(calls) == 3
        assert [r.getMessage().split(" after")[0] for r in caplog.records] == ["retrying PUT s3://b/k"] * 2

    def test_the_attempt_budget_is_read_when_called_not_at_import(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv("SPOTJOB_STORAGE_BASE_BACKOFF_S", "0")
        monkeypatch.setenv("SPOTJOB_STORAGE_MAX_ATTEMPTS", "2")
        assert max_attempts() == 2
        calls = []

        def down() -> None:
            calls.append(1)
            raise TransientStorageError("503", "k")

        with pytest.raises(TransientStorageError):
            retry_transient("GET x", down)
        assert len(calls) == 2

    def test_permanent_errors_are_not_retried(self) -> None:
        calls = []

        def denied() -> None:
            calls.append(1)
            raise PermanentStorageError("403", "k")

        with pytest.raises(PermanentStorageError):
            retry_transient("GET x", denied)
        assert calls == [1]


def http_error(status: int) -> requests.HTTPError:
    response = requests.Response()
    response.status_code = status
    return requests.HTTPError(f"{status}", response=response)


def client_error(status: int, code: str) -> botocore.exceptions.ClientError:
    return botocore.exceptions.ClientError(
        {"Error": {"Code": code, "Message": "m"}, "ResponseMetadata": {"HTTPStatusCode": status}}, "Op"
    )


@pytest.mark.parametrize(
    ("error", "kind"),
    [
        (client_error(503, "SlowDown"), TransientStorageError),
        (client_error(500, "InternalError"), TransientStorageError),
        (client_error(400, "RequestTimeout"), TransientStorageError),
        (client_error(409, "ConditionalRequestConflict"), TransientStorageError),
        (client_error(404, "NoSuchKey"), NotFoundError),
        (client_error(404, "404"), NotFoundError),
        (client_error(403, "AccessDenied"), PermanentStorageError),
        (client_error(403, "InvalidAccessKeyId"), PermanentStorageError),
        (botocore.exceptions.EndpointConnectionError(endpoint_url="http://x"), TransientStorageError),
        (botocore.exceptions.ReadTimeoutError(endpoint_url="http://x"), TransientStorageError),
        (botocore.exceptions.IncompleteReadError(actual_bytes=1, expected_bytes=2), TransientStorageError),
        (botocore.exceptions.NoCredentialsError(), PermanentStorageError),
    ],
)
def test_s3_errors_are_classified_by_whether_retrying_can_help(error: Exception, kind: type[Exception]) -> None:
    classified = s3_backend._storage_error(error, "GET s3://b/k", "k")
    assert type(classified) is kind
    assert classified.key == "k"


@pytest.mark.parametrize(
    ("code", "said"),
    [
        ("InvalidAccessKeyId", "knows no such access key id"),
        ("SignatureDoesNotMatch", "secret access key does not match"),
    ],
)
def test_s3_keys_the_store_does_not_take_are_named_as_wrong_keys_not_a_missing_permission(code: str, said: str) -> None:
    """Checked against moto with its authentication on: a wrong secret and an unknown key id were
    "permission denied ... the credentials lack the permission, or a bucket policy refuses it"."""
    classified = s3_backend._storage_error(client_error(403, code), "LIST s3://b/run/", None)
    assert type(classified) is PermanentStorageError
    assert str(classified).startswith(f"invalid AWS credentials: LIST s3://b/run/: {code} (HTTP 403)")
    assert said in str(classified) and "lack the permission" not in str(classified)


def test_a_tls_handshake_that_failed_names_the_endpoint_variable_and_the_usual_slip(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An http:// emulator written https:// (AWS_ENDPOINT_URL, STORAGE_EMULATOR_HOST) failed with
    the SSL library's words alone, naming neither the variable nor the likely slip."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", "https://127.0.0.1:9000")
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", "https://127.0.0.1:4443")
    reason = "[SSL: WRONG_VERSION_NUMBER] wrong version number (_ssl.c:1006)"
    s3 = s3_backend._storage_error(
        botocore.exceptions.SSLError(endpoint_url="https://127.0.0.1:9000/b", error=reason), "LIST s3://b/run/", None
    )
    gcs = gs_backend._storage_error(
        requests.exceptions.SSLError(
            "HTTPSConnectionPool(host='127.0.0.1', port=4443): Max retries exceeded with url: /storage/v1/b/b/o?x=1 "
            f"(Caused by SSLError(SSLError(1, '{reason}')))"
        ),
        "LIST gs://bkt/run/",
        None,
    )
    for error, variable in ((s3, "AWS_ENDPOINT_URL"), (gcs, "STORAGE_EMULATOR_HOST")):
        said = str(error)
        assert isinstance(error, TransientStorageError) and reason in said, said
        assert f"check {variable}" in said and "a plain http server written https://" in said, said
    assert "the TLS handshake with 127.0.0.1:4443 failed" in str(gcs) and "/storage/v1" not in str(gcs)


def test_a_missing_s3_bucket_is_not_a_missing_key() -> None:
    classified = s3_backend._storage_error(client_error(404, "NoSuchBucket"), "GET s3://b/k", "k")
    assert isinstance(classified, MissingBucketError) and not isinstance(classified, NotFoundError)
    assert "bucket" in str(classified)


@pytest.mark.parametrize(
    ("error", "kind"),
    [
        (api_exceptions.ServiceUnavailable("down"), TransientStorageError),
        (api_exceptions.TooManyRequests("slow down"), TransientStorageError),
        (api_exceptions.InternalServerError("oops"), TransientStorageError),
        (api_exceptions.NotFound("gone"), NotFoundError),
        (api_exceptions.Forbidden("no"), PermanentStorageError),
        (api_exceptions.Unauthorized("who"), PermanentStorageError),
        (requests.ConnectionError("reset"), TransientStorageError),
        (requests.exceptions.ChunkedEncodingError("cut"), TransientStorageError),
        (requests.exceptions.ContentDecodingError("garbled"), TransientStorageError),
        (http_error(503), TransientStorageError),
        (http_error(400), PermanentStorageError),
        # The request itself is wrong: sending it again fails the same way.
        (requests.exceptions.InvalidSchema("No connection adapters were found"), PermanentStorageError),
        (requests.exceptions.MissingSchema("Invalid URL"), PermanentStorageError),
        (requests.exceptions.TooManyRedirects("Exceeded 30 redirects"), PermanentStorageError),
        (requests.exceptions.InvalidHeader("bad header"), PermanentStorageError),
    ],
)
def test_gcs_errors_are_classified_by_whether_retrying_can_help(error: Exception, kind: type[Exception]) -> None:
    classified = gs_backend._storage_error(error, "GET gs://bkt/k", "k")
    assert type(classified) is kind
    assert classified.key == "k"


def test_a_gcs_emulator_host_without_a_scheme_is_refused_when_the_store_opens(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """google-cloud-storage takes the variable as the endpoint URL: without ``http://`` every
    request would fail as a URL with no connection adapter, mid-save."""
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", "127.0.0.1:4443")
    with pytest.raises(ValueError, match=r"STORAGE_EMULATOR_HOST='127.0.0.1:4443'.*http://127.0.0.1:4443"):
        open_storage("gs://bkt/run")


def test_a_gcs_emulator_host_ending_in_a_slash_is_refused_rather_than_read_as_a_missing_bucket(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``http://127.0.0.1:4443/`` made every request ``//storage/v1/...``: fake-gcs-server answered
    404, and ``spotjob ckpt list`` said the bucket did not exist."""
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", "http://127.0.0.1:4443/")
    with pytest.raises(
        ValueError, match=r"STORAGE_EMULATOR_HOST='http://127.0.0.1:4443/' ends with '/'.*write http://127.0.0.1:4443$"
    ):
        open_storage("gs://bkt/run")


@pytest.mark.parametrize(
    ("tail", "said", "fixed"),
    [
        ("/storage/v1", "has the path '/storage/v1'", ""),
        ("/storage/v1/", "has the path '/storage/v1'", ""),
        ("/gw/storage/v1", "has a path ending in '/storage/v1'", "/gw"),
        ("/upload/storage/v1", "has the path '/upload/storage/v1'", ""),
        ("/gw/download", "has a path ending in '/download'", "/gw"),
        ("/gw//gcs", "has an empty path segment ('//')", "/gw/gcs"),
        ("?alt=json", "has a query", ""),
        ("?", "has a query", ""),
        ("#x", "has a fragment", ""),
        ("/p?alt=json#x", "has a query and a fragment", "/p"),
    ],
)
def test_a_gcs_emulator_host_with_the_api_path_a_query_or_fragment_is_refused_rather_than_read_as_a_missing_bucket(
    gcs_server: str, gcs_client: object, monkeypatch: pytest.MonkeyPatch, tail: str, said: str, fixed: str
) -> None:
    """The client puts ``/storage/v1/...`` after the value as written: the API's own path copied
    into it, or an empty segment, doubles it, a query or a fragment swallows it, and
    fake-gcs-server answered 404 to a bucket that exists, which ``spotjob ckpt list`` said was a
    bucket to create. Refused when the store opens, as the trailing ``/`` is, naming the variable
    and the URL to write (a path prefix before them kept: a gateway's)."""
    bucket = f"spotjob-{os.urandom(6).hex()}"
    gcs_client.create_bucket(bucket)  # type: ignore[attr-defined]
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs_server + tail)
    with pytest.raises(ValueError) as refused:
        open_storage(f"gs://{bucket}/run")
    text = str(refused.value)
    assert text.startswith(f"STORAGE_EMULATOR_HOST={gcs_server + tail!r} {said}: "), text
    assert "answered 404 (as if the bucket did not exist)" in text, text
    assert text.endswith(f"; write {gcs_server + fixed}"), text


@pytest.mark.parametrize(
    ("value", "said"),
    [
        ("ftp://127.0.0.1:4443", "has the scheme 'ftp', not http or https"),
        (
            " http://127.0.0.1:4443",
            "has whitespace at its start, which the client would keep in every request's URL: "
            "write http://127.0.0.1:4443",
        ),
        ("http://127.0.0.1:4443\n", "has whitespace at its end"),
        ("http://127.0.0.1: 4443", "has whitespace inside it"),
        ("127.0.0.1:99999", "is not a URL: it needs a scheme (http:// or https://), and it has the port 99999"),
        ("http://127.0.0.1:99999", "has the port 99999, out of range (1-65535)"),
        ("http://127.0.0.1:port", "has the port 'port', which is not a number"),
        ("http://:4443", "has no host"),
        ("http:/127.0.0.1:4443", "is not host:port"),
    ],
)
def test_a_gcs_emulator_host_that_is_no_usable_url_is_refused_with_advice_that_works(
    monkeypatch: pytest.MonkeyPatch, value: str, said: str
) -> None:
    """The advice was ``http://`` before the value whatever it was (``http://ftp://...``,
    ``http:// http://...``), and a port out of range or a URL without a host got through, to fail
    on every request. Each is named for what it is; only a bare host[:port] is told to put
    ``http://`` before it."""
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", value)
    with pytest.raises(ValueError) as refused:
        open_storage("gs://bkt/run")
    text = str(refused.value)
    assert text.startswith(f"STORAGE_EMULATOR_HOST={value!r} ") and said in text, text
    assert not re.search(r"http://\s*\w+://", text), text


@pytest.mark.parametrize(
    "value",
    [
        "http://[::1]:4443",
        "HTTPS://storage.test",
        "http://u:p@127.0.0.1:4443/prefix",
        "http://gw:8080/gcs",
        "http://gw:8080/storage/v2",
        "http://gw:8080/myupload",
    ],
)
def test_a_gcs_emulator_host_that_is_a_url_is_taken_as_written(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    """A path prefix works (the client and spotjob's transfers put the API's whole path after it):
    an emulator behind a gateway under ``/gcs`` is taken, not only ``scheme://host[:port]``."""
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", value)
    open_storage("gs://bkt/run").close()


@pytest.mark.parametrize(
    "value",
    [
        "u:GPWsecret9@127.0.0.1:4443",
        "http://u:GPWsecret9@127.0.0.1:4443/",
        "http://u:GP'Wsecret9@127.0.0.1:4443/",
        "u:GP Wsecret9@127.0.0.1:4443",
    ],
)
def test_a_refused_gcs_emulator_host_behind_basic_auth_is_named_without_its_password(
    monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    """``http://user:secret@host`` (an emulator behind basic auth) that is refused was repeated whole,
    the password in every log line and Event quoting the error; its ``user:secret@`` is masked as
    the S3 store masks its endpoint's, and a value the mask cannot reach is not repeated at all."""
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", value)
    with pytest.raises(ValueError, match="STORAGE_EMULATOR_HOST") as refused:
        open_storage("gs://bkt/run")
    said = str(refused.value)
    assert "secret9" not in said and "u:" not in said, said
    if "'" not in value and " " not in value:
        assert "***@127.0.0.1:4443" in said, said


def test_a_gcs_upload_chunk_that_cannot_connect_names_the_host_and_the_variable_but_not_the_session(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A resumable upload's chunk said only "ConnectionError" when the store went away mid-save,
    where every other request names the host and STORAGE_EMULATOR_HOST; the session URL (a bearer
    capability) must still stay out of it."""
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", f"http://127.0.0.1:{port}")
    storage = open_storage("gs://bkt/run")
    try:
        session = f"http://127.0.0.1:{port}/upload/storage/v1/b/b/o?uploadType=resumable&upload_id=SESSIONSECRET"
        upload = gs_backend._ResumableUpload(storage, session, "gs://bkt/run/k", "run/k", 3)  # type: ignore[arg-type]
        with pytest.raises(TransientStorageError) as raised:
            upload.send(0, b"abc", crc(b"abc"))
    finally:
        storage.close()
    said = str(raised.value)
    assert f"PUT gs://bkt/run/k bytes 0-2/3: cannot connect to 127.0.0.1:{port} (" in said
    assert "check STORAGE_EMULATOR_HOST and the network" in said
    assert "SESSIONSECRET" not in said and "upload_id" not in said


def _a_port_that_never_accepts() -> tuple[socket.socket, list[socket.socket]]:
    """A loopback listener whose accept queue is full: a new connection's SYN is dropped, so a
    connect times out (as to a firewalled endpoint). Close what it returns."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    filling = []
    for _ in range(4):
        c = socket.socket()
        c.setblocking(False)
        c.connect_ex(listener.getsockname())
        filling.append(c)
    time.sleep(0.1)
    return listener, filling


def test_an_endpoint_that_times_out_connecting_names_the_host_the_timeout_and_the_variable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A connect timeout (a firewalled or blackholed endpoint) said, on GCS, urllib3's pool repr
    with the request's path and query, without STORAGE_EMULATOR_HOST, and a resumable upload's
    chunk only "ConnectTimeout", where a refused connection names the host and the variable;
    neither backend named the setting that bounds the wait."""
    listener, filling = _a_port_that_never_accepts()
    port = listener.getsockname()[1]
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("SPOTJOB_STORAGE_CONNECT_TIMEOUT_S", "0.3")
    monkeypatch.setenv("SPOTJOB_STORAGE_MAX_ATTEMPTS", "1")
    storage = open_storage("gs://bkt/run")
    s3_storage = open_storage("s3://b/run")
    try:
        with pytest.raises(TransientStorageError) as listing:
            list(storage.list())
        session = f"http://127.0.0.1:{port}/upload/storage/v1/b/b/o?uploadType=resumable&upload_id=SESSIONSECRET"
        upload = gs_backend._ResumableUpload(storage, session, "gs://bkt/run/k", "run/k", 3)  # type: ignore[arg-type]
        with pytest.raises(TransientStorageError) as chunk:
            upload.send(0, b"abc", crc(b"abc"))
        with pytest.raises(TransientStorageError) as s3_get:
            s3_storage.get_bytes("k")
    finally:
        storage.close()
        s3_storage.close()
        for c in (listener, *filling):
            c.close()
    for said in (str(listing.value), str(chunk.value)):
        assert f"cannot connect to 127.0.0.1:{port} (timed out after 0.3 s: SPOTJOB_STORAGE_CONNECT_TIMEOUT_S)" in said
        assert "check STORAGE_EMULATOR_HOST and the network" in said
        assert "HTTPConnectionPool" not in said and "SESSIONSECRET" not in said
    said = str(s3_get.value)
    assert f"127.0.0.1:{port}" in said and "timed out after 0.3 s (SPOTJOB_STORAGE_CONNECT_TIMEOUT_S)" in said, said
    assert "check AWS_ENDPOINT_URL" in said


def test_a_store_that_accepts_but_never_answers_names_the_read_timeout_and_where_the_endpoint_comes_from(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A hung endpoint (accepts, then says nothing) said only "Read timed out": neither the setting
    that bounds the wait nor the variable that chose the endpoint."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)  # connections complete in the kernel; nothing ever reads or answers
    port = listener.getsockname()[1]
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("SPOTJOB_STORAGE_READ_TIMEOUT_S", "0.3")
    monkeypatch.setenv("SPOTJOB_STORAGE_MAX_ATTEMPTS", "1")
    said = {}
    try:
        for scheme in ("gs", "s3"):
            storage = open_storage(f"{scheme}://bkt/run")
            try:
                with pytest.raises(TransientStorageError) as raised:
                    storage.get_bytes("k")
            finally:
                storage.close()
            said[scheme] = str(raised.value)
    finally:
        listener.close()
    for scheme, variable in (("gs", "STORAGE_EMULATOR_HOST"), ("s3", "AWS_ENDPOINT_URL")):
        assert f"127.0.0.1:{port}" in said[scheme]
        assert "within 0.3 s (SPOTJOB_STORAGE_READ_TIMEOUT_S)" in said[scheme], said[scheme]
        assert f"check {variable}" in said[scheme], said[scheme]
    assert "HTTPConnectionPool" not in said["gs"]


def test_a_gs_uri_without_google_credentials_or_an_emulator_names_both_remedies(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A user of fake-gcs-server who forgot STORAGE_EMULATOR_HOST was told only about Google's own
    credentials."""
    import google.auth
    from google.auth import exceptions as auth_exceptions

    def no_credentials(**_: object) -> object:
        raise auth_exceptions.DefaultCredentialsError("Your default credentials were not found.")

    monkeypatch.delenv("STORAGE_EMULATOR_HOST", raising=False)
    monkeypatch.setattr(google.auth, "default", no_credentials)
    with pytest.raises(
        PermanentStorageError, match=r"no Google credentials for gs://bkt/run: .*set STORAGE_EMULATOR_HOST"
    ):
        open_storage("gs://bkt/run")


def _aws_env(monkeypatch: pytest.MonkeyPatch, **env: str) -> None:
    """Only ``env`` of the AWS settings, no config or credentials file (nothing here is sent)."""
    for name in [n for n in os.environ if n.startswith("AWS_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    for name, value in env.items():
        monkeypatch.setenv(name, value)


@pytest.mark.parametrize(
    ("env", "said"),
    [
        (
            {"AWS_PROFILE": "no-such-profile"},
            r"opening s3://b/run: The config profile \(no-such-profile\) could not be found: AWS_PROFILE .* unset",
        ),
        (
            {"AWS_ACCESS_KEY_ID": "AKIDONLYHALF"},
            r"opening s3://b/run: no usable AWS credentials \(Partial credentials found in env, missing: "
            r"AWS_SECRET_ACCESS_KEY\); give the process some",
        ),
    ],
    ids=["missing profile", "half the keys"],
)
def test_aws_credentials_botocore_cannot_resolve_are_a_storage_error_when_the_s3_store_opens(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], said: str
) -> None:
    """botocore resolves credentials when the client is made: these used to escape as botocore's
    own ``ProfileNotFound`` / ``PartialCredentialsError``, a traceback out of ``spotjob ckpt``,
    ``spotjob run`` and the Checkpointer."""
    _aws_env(monkeypatch, **env)
    with pytest.raises(PermanentStorageError, match=said) as raised:
        open_storage("s3://b/run")
    assert "AKIDONLYHALF" not in str(raised.value)


@pytest.mark.parametrize("key_id", [None, ""], ids=["unset", "empty"])
def test_a_secret_key_without_its_key_id_says_the_key_id_is_missing(
    monkeypatch: pytest.MonkeyPatch, key_id: str | None
) -> None:
    """botocore skips an environment with the secret but no key id, and says only
    NoCredentialsError (the key id without the secret names the secret as missing): a user who set
    half the pair was not told which half."""
    env = {"AWS_SECRET_ACCESS_KEY": "SECRETONLYHALF", "AWS_ENDPOINT_URL": "http://127.0.0.1:9"}
    _aws_env(monkeypatch, **env, **({} if key_id is None else {"AWS_ACCESS_KEY_ID": key_id}))
    storage = open_storage("s3://b/run")
    try:
        with pytest.raises(PermanentStorageError) as raised:
            list(storage.list(""))
    finally:
        storage.close()
    said = str(raised.value)
    assert "no usable AWS credentials (Partial credentials found in env, missing: AWS_ACCESS_KEY_ID)" in said, said
    assert "SECRETONLYHALF" not in said


def test_an_aws_endpoint_without_a_scheme_is_refused_naming_the_variable_and_no_password(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """botocore's own ``ValueError("Invalid endpoint: ...")`` named neither the variable nor the fix,
    and repeated a ``user:secret@`` that no scheme marked as one."""
    _aws_env(
        monkeypatch, AWS_ACCESS_KEY_ID="a", AWS_SECRET_ACCESS_KEY="b", AWS_ENDPOINT_URL_S3="admin:hunter2@minio:9000"
    )
    with pytest.raises(
        ValueError, match=r"AWS_ENDPOINT_URL_S3='\*\*\*@minio:9000' .*with its scheme, e.g. http://"
    ) as raised:
        open_storage("s3://b/run")
    assert "hunter2" not in str(raised.value)


@pytest.mark.parametrize(
    ("endpoint", "said"),
    [
        ("http://admin:hunter2@[::1:9000", "Invalid IPv6 URL"),  # no closing bracket
        ("http://127.0.0.1:9000/?X-Amz-Security-Token=hunter2", "a query"),
        ("http://127.0.0.1:9000/#hunter2", "a fragment"),
        ("http://hunter2@127.0.0.1:9000 ", "a space, tab or newline"),  # botocore takes these...
        (" http://hunter2@127.0.0.1:9000", "a space, tab or newline"),
        ("http://hunter2@127.0.0.1:99999", "its port is no number from 1 to 65535"),
        ("http://hunter2@127.0.0.1:0", "its port is no number from 1 to 65535"),
        ("ftp://hunter2@127.0.0.1:9000", "its scheme is ftp, not http or https"),
        ("http://hunter2@127.0.0.1 :9000", "a space, tab or newline"),  # ...botocore refuses these
        ("http://hunter2@127.0.0.1:9000\t", "a space, tab or newline"),
        ("http://hunter2@:9000", "it has no host"),
    ],
)
def test_an_aws_endpoint_url_botocore_cannot_use_is_refused_when_the_store_opens_naming_the_variable(
    monkeypatch: pytest.MonkeyPatch, endpoint: str, said: str
) -> None:
    """A malformed endpoint escaped as urllib's bare ``ValueError("Invalid IPv6 URL")``, naming no
    variable; one with a query or fragment opened, then failed every request with botocore's
    EndpointResolutionError repeating the whole URL (a token in its query included). So did a
    space after it, a port out of range or another scheme than http(s): botocore's raw "Custom
    endpoint ... was not a valid URI" at the first request, naming no variable (through the
    Checkpointer: a store that "refuses this job" at its create-only check). One that botocore does
    refuse itself, with a space inside it or no host, was told to "write it with its scheme"."""
    _aws_env(monkeypatch, AWS_ACCESS_KEY_ID="a", AWS_SECRET_ACCESS_KEY="b", AWS_ENDPOINT_URL=endpoint)
    with pytest.raises(ValueError, match=r"^AWS_ENDPOINT_URL .*is not a URL that S3 requests can go to") as raised:
        open_storage("s3://b/run")
    assert said in str(raised.value)
    assert "hunter2" not in str(raised.value)


@pytest.mark.parametrize(
    ("endpoint", "said"),
    [
        ("ftp://127.0.0.1:9000", "its scheme is ftp, not http or https"),
        ("http://127.0.0.1:99999", "its port is no number from 1 to 65535"),
        ("http://hunter2@127.0.0.1 :9000", "a space, tab or newline"),
        ("http://127.0.0.1:9000/?X-Amz-Security-Token=hunter2", "a query"),
    ],
)
def test_an_endpoint_url_of_the_aws_config_file_botocore_cannot_use_is_refused_naming_the_file(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, endpoint: str, said: str
) -> None:
    """The config file's ``endpoint_url`` is checked as the variables are, and named instead."""
    _aws_env(monkeypatch, AWS_ACCESS_KEY_ID="a", AWS_SECRET_ACCESS_KEY="b")
    config = tmp_path / "config"
    config.write_text(f"[default]\nendpoint_url = {endpoint}\n")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(config))
    with pytest.raises(ValueError, match=r"^the AWS config file's endpoint_url \(.*is not a URL that S3") as raised:
        open_storage("s3://b/run")
    assert said in str(raised.value)
    assert "hunter2" not in str(raised.value)


def test_an_aws_endpoint_url_with_a_trailing_space_stops_the_checkpointer_naming_the_variable(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Through the Checkpointer it read "the checkpoint store ... refuses this job: checking that the
    store refuses to overwrite on create-only writes: ... EndpointResolutionError": a store to blame."""
    from agent import Checkpointer

    _aws_env(monkeypatch, AWS_ACCESS_KEY_ID="a", AWS_SECRET_ACCESS_KEY="b", AWS_ENDPOINT_URL="http://127.0.0.1:9 ")
    monkeypatch.setenv("SPOTJOB_STORAGE_MAX_ATTEMPTS", "1")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=r"^AWS_ENDPOINT_URL \(it has a space, tab or newline in it or around it;"):
        Checkpointer("s3://wb1/run1", every_steps=1, staging_dir=str(tmp_path / "staging"))


def test_a_bucket_name_botocore_refuses_is_said_in_a_line_not_two_regular_expressions(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """botocore checks a bucket name before sending anything; its refusal was a ParamValidationError
    quoting two regular expressions. spotjob still lets botocore decide (S3-compatible stores take
    names AWS does not) and only says it plainly."""
    _aws_env(monkeypatch, AWS_ACCESS_KEY_ID="a", AWS_SECRET_ACCESS_KEY="b", AWS_ENDPOINT_URL="http://127.0.0.1:9")
    storage = open_storage("s3://my bucket/run")
    try:
        with pytest.raises(PermanentStorageError) as raised:
            list(storage.list(""))
    finally:
        storage.close()
    said = str(raised.value)
    assert "the bucket name 'my bucket' is not one S3's client can send" in said, said
    assert "regex" not in said and "s3://BUCKET/prefix" in said, said


def test_a_gcs_bucket_name_the_client_refuses_is_a_storage_error_naming_the_uri(gcs_server: str) -> None:
    """``parse_uri`` refuses such a name before any store opens; a store made without it (a name
    the client's own check refuses) used to raise the client's bare ValueError, naming nothing."""
    with pytest.raises(PermanentStorageError) as raised:
        gs_backend.GCSStorage("-b", "run")
    said = str(raised.value)
    assert said.startswith("cannot open gs://-b/run: the bucket name '-b': "), said


def test_a_range_refuses_bytes_past_its_end(tmp_path: object) -> None:
    path = os.path.join(str(tmp_path), "f")
    fd = os.open(path, os.O_RDWR | os.O_CREAT)
    try:
        sink = RangeSink(fd, 4, 3, "gs://bkt/k")
        sink.write(b"ab")
        with pytest.raises(PermanentStorageError, match="more than"):
            sink.write(b"cd")
        sink.write(b"c")
        sink.flush()
        assert (sink.received, sink.crc) == (3, crc(b"abc"))
        assert os.pread(fd, 3, 4) == b"abc"
    finally:
        os.close(fd)


def test_a_range_that_meets_a_full_disk_names_the_local_file(tmp_path: object, monkeypatch: pytest.MonkeyPatch) -> None:
    """``pwrite``'s error names no file: the sink names the one it writes, so a full local disk
    is not taken for the store's."""
    path = os.path.join(str(tmp_path), "f.part")
    fd = os.open(path, os.O_RDWR | os.O_CREAT)

    def full(*args: object) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    try:
        sink = RangeSink(fd, 0, 3, "gs://bkt/k", path)
        sink.write(b"abc")
        monkeypatch.setattr(os, "pwrite", full)
        with pytest.raises(PermanentStorageError, match=re.escape(f"no space left (or quota exceeded) ({path})")):
            sink.flush()
    finally:
        os.close(fd)


def test_a_pool_sends_the_other_calls_once_the_first_says_so_and_none_when_it_fails() -> None:
    """``map(first=...)``: GCS's parts after the first need the generation its answer says. The
    other calls start only once the first set the event, and a first call that fails before that
    sends none of them (its error is raised)."""
    pool = TransferPool(4, "test-first")
    try:
        first = threading.Event()
        seen: list[tuple[int, bool]] = []

        def call(i: int) -> int:
            seen.append((i, first.is_set()))
            if i == 0:
                first.set()
            return i * 10

        assert pool.map(call, [(0,), (1,), (2,)], first=first) == [0, 10, 20]
        assert sorted(seen) == [(0, False), (1, True), (2, True)]

        refused = threading.Event()
        calls: list[int] = []

        def fail_first(i: int) -> int:
            calls.append(i)
            if i == 0:
                raise PermanentStorageError("refused")
            return i

        with pytest.raises(PermanentStorageError, match="refused"):
            pool.map(fail_first, [(0,), (1,), (2,)], first=refused)
        assert calls == [0]
    finally:
        pool.close()


def test_a_pool_whose_thread_cannot_start_runs_each_call_once_and_returns_once_all_are_done(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A pids or ``ulimit -u`` limit reached, or Python 3.12.0/3.12.1 after the main thread ended
    (a save in flight finished before exit): ``Thread.start`` raises, and the RuntimeError came out
    of ``map``, failing a multipart upload or a download of several ranges where ``parallel_map``
    already ran its calls in the caller's thread. Here the pool's first thread starts and its
    second is refused: ``submit`` has queued that call before failing to start a thread for it, so
    the busy first thread would still run it later, after the caller ran it. Each call runs once,
    and ``map`` returns once all are done."""
    real_start = threading.Thread.start
    started: list[str] = []

    def second_refused(self: threading.Thread) -> None:
        if self.name.startswith("test-refused"):
            started.append(self.name)
            if len(started) > 1:
                raise RuntimeError("can't start new thread")
        real_start(self)

    monkeypatch.setattr(threading.Thread, "start", second_refused)
    pool = TransferPool(2, "test-refused")
    ran: list[int] = []
    last_ran = threading.Event()  # call 0 holds the pool's one thread until the caller ran the others
    try:

        def call(i: int) -> int:
            if i == 0:
                last_ran.wait()
            ran.append(i)
            if i == 2:
                last_ran.set()
            return i * 10

        assert pool.map(call, [(0,), (1,), (2,)]) == [0, 10, 20]
        assert sorted(ran) == [0, 1, 2]
    finally:
        last_ran.set()
        pool.close()  # the thread has taken the call queued for the refused one by now
    assert sorted(ran) == [0, 1, 2], "a call ran twice"
    assert len(started) == 2


def test_a_pool_interrupted_while_it_waits_returns_only_once_its_running_calls_ended() -> None:
    """Ctrl-C while a download waits for its ranges: ``map`` raised at once, the ranges still
    running went on writing into the temp file's descriptor, which ``download_verified`` closed
    meanwhile (and which the next file opened may reuse), and the parts of an upload went on after
    its abort. Now the calls not started are skipped and the running ones waited for. Call 1 sends
    SIGINT to the waiting caller; call 0 is still running then, until a moment after the signal."""
    import signal

    pool = TransferPool(2, "test-interrupted")
    released = threading.Event()
    ended: list[int] = []

    def on_sigint(signum: int, frame: object) -> None:
        threading.Timer(0.2, released.set).start()
        raise KeyboardInterrupt

    def call(i: int) -> int:
        if i == 0:
            released.wait()
        else:
            signal.pthread_kill(threading.main_thread().ident or 0, signal.SIGINT)
        ended.append(i)
        return i

    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        with pytest.raises(KeyboardInterrupt):
            pool.map(call, [(0,), (1,)])
        assert sorted(ended) == [0, 1], "map was left while a call still ran"
    finally:
        signal.signal(signal.SIGINT, previous)
        released.set()
        pool.close()


class TestByteBudget:
    def test_a_request_bigger_than_the_whole_budget_is_granted_alone(self) -> None:
        budget = ByteBudget(10)
        with budget.hold(25):  # nothing else held: it goes, rather than wait for ever
            pass
        with budget.hold(0), budget.hold(10):  # nothing to hold takes nothing
            pass

    def test_a_request_that_does_not_fit_waits_for_bytes_to_be_given_back_in_the_order_asked(self) -> None:
        budget = ByteBudget(10)
        got: list[str] = []
        first = budget.hold(6)
        first.__enter__()

        def ask(name: str, n: int) -> threading.Thread:
            def run() -> None:
                with budget.hold(n):
                    got.append(name)

            thread = threading.Thread(target=run)
            thread.start()
            return thread

        big = ask("big", 8)  # does not fit beside the 6 held
        while len(budget._line) < 1:
            time.sleep(0.001)
        small = ask("small", 3)  # would fit beside the 6, but comes after the big one: it waits its turn
        while len(budget._line) < 2:
            time.sleep(0.001)
        assert got == []
        first.__exit__(None, None, None)
        big.join()
        small.join()
        assert got == ["big", "small"]
