"""S3 and GCS under partial failures: what a failed or retried multipart upload leaves behind, a
GCS resumable upload whose chunks are not kept or whose session is lost, and what a store without
credentials says.

Every request goes through a fault proxy in front of moto (or fake-gcs-server); the bucket's
in-progress multipart uploads are read straight from moto, not through the proxy.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pytest

from agent.crc32c import crc32c_file
from agent.storage import PermanentStorageError, Storage, TransientStorageError

try:
    from faults import Dialect, FaultProxy
except ImportError:  # run from the repository root
    from tests.faults import Dialect, FaultProxy

REPO = Path(__file__).resolve().parents[2]
PART = 5 * 1024 * 1024
BIG = 2 * PART + 123  # three parts


@pytest.fixture
def s3_behind_proxy(
    monkeypatch: pytest.MonkeyPatch,
    fresh_uri: Callable[[str], str],
    fault_proxy: Callable[[str, Dialect], FaultProxy],
    make_storage: Callable[[str], Storage],
    moto_server: str,
    fast_retries: None,
) -> tuple[Storage, FaultProxy, str]:
    for name, value in {
        "SPOTJOB_STORAGE_UPLOAD_PART_SIZE": PART,
        "SPOTJOB_STORAGE_MULTIPART_THRESHOLD": PART,
        "SPOTJOB_STORAGE_PART_SIZE": PART,
        "SPOTJOB_STORAGE_CONCURRENCY": 4,
    }.items():
        monkeypatch.setenv(name, str(value))
    uri = fresh_uri("s3")  # bucket created directly on moto, not through the proxy
    proxy = fault_proxy(moto_server, "s3")
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
    return make_storage(uri), proxy, urlparse(uri).netloc


@pytest.fixture
def gcs_behind_proxy(
    monkeypatch: pytest.MonkeyPatch,
    fresh_uri: Callable[[str], str],
    fault_proxy: Callable[[str, Dialect], FaultProxy],
    make_storage: Callable[[str], Storage],
    gcs_server: str,
    fast_retries: None,
) -> tuple[Storage, FaultProxy]:
    """A GCS store on fake-gcs-server behind the fault proxy, uploading in chunks of ``PART``."""
    monkeypatch.setenv("SPOTJOB_STORAGE_UPLOAD_CHUNK_SIZE", str(PART))
    monkeypatch.setenv("SPOTJOB_STORAGE_MULTIPART_THRESHOLD", str(PART))
    uri = fresh_uri("gs")
    proxy = fault_proxy(gcs_server, "gcs")
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", proxy.url)
    return make_storage(uri), proxy


def in_progress_uploads(s3_client: Any, bucket: str) -> list[str]:
    return [u["Key"] for u in s3_client.list_multipart_uploads(Bucket=bucket).get("Uploads", [])]


def write_random(path: Path, size: int) -> tuple[int, int]:
    path.write_bytes(os.urandom(size))
    return crc32c_file(path)


def test_a_multipart_upload_given_up_in_a_slowdown_storm_is_still_aborted(
    s3_behind_proxy: tuple[Storage, FaultProxy, str], s3_client: Any, tmp_path: Path
) -> None:
    store, proxy, bucket = s3_behind_proxy
    proxy.fail(1000, 503, code="SlowDown", method="PUT", path=r"partNumber=")
    abort_throttled = proxy.fail(2, 503, code="SlowDown", method="DELETE", path=r"uploadId=")
    src = tmp_path / "src.bin"
    crc, _ = write_random(src, BIG)

    with pytest.raises(TransientStorageError):
        store.put_file(str(src), "step-1/shard", crc32c=crc)

    assert abort_throttled.served == 2
    assert in_progress_uploads(s3_client, bucket) == []
    assert store.stat("step-1/shard") is None


def test_an_s3_store_without_credentials_says_where_spotjob_looks_for_them(
    monkeypatch: pytest.MonkeyPatch, moto_server: str, tmp_path: Path
) -> None:
    from agent.storage import open_storage

    for name in (
        "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY",
        "AWS_SESSION_TOKEN",
        "AWS_PROFILE",
        "AWS_ROLE_ARN",
        "AWS_WEB_IDENTITY_TOKEN_FILE",
        "AWS_CONTAINER_CREDENTIALS_FULL_URI",
        "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
    ):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_server)
    store = open_storage("s3://some-bucket/run")
    try:
        with pytest.raises(PermanentStorageError) as caught:
            store.put_bytes("step-1/MANIFEST.json", b"{}")
    finally:
        store.close()

    message = str(caught.value)
    assert "s3://some-bucket/run/step-1/MANIFEST.json" in message
    assert "AWS_ACCESS_KEY_ID" in message and "AWS_PROFILE" in message


def test_a_gcs_upload_whose_chunks_the_server_never_keeps_gives_up_within_the_attempts(
    gcs_behind_proxy: tuple[Storage, FaultProxy],
    tmp_path: Path,
) -> None:
    """Each chunk answered 308 "persisted nothing" is a request that succeeded, so the retry
    policy never saw a failure: the upload resent the same chunk for as long as that went on."""
    store, proxy = gcs_behind_proxy
    stalled = proxy.fail(20, 308, method="PUT", path=r"upload_id=")
    src = tmp_path / "src.bin"
    crc, _ = write_random(src, BIG)

    with pytest.raises(TransientStorageError) as caught:
        store.put_file(str(src), "step-1/shard", crc32c=crc)

    assert "step-1/shard" in str(caught.value) and "upload_id" not in str(caught.value)
    assert stalled.served == 5  # SPOTJOB_STORAGE_MAX_ATTEMPTS of fast_retries
    assert store.stat("step-1/shard") is None


def test_an_unreachable_s3_endpoint_is_reported_without_the_secret_in_its_url(
    monkeypatch: pytest.MonkeyPatch, moto_server: str, fast_retries: None, caplog: pytest.LogCaptureFixture
) -> None:
    """An endpoint behind basic auth (``http://user:secret@host``): botocore's connection error
    repeats the URL whole, and the message is logged on every retry and ends up in Events. The
    message also names where the endpoint came from: it said only botocore's "Could not connect to
    the endpoint URL" (the GCS store names STORAGE_EMULATOR_HOST), so a stale AWS_ENDPOINT_URL left
    in a pod's environment was not the first thing a user looked at."""
    from agent.storage import open_storage

    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://spotjob:hunter2@127.0.0.1:9")
    store = open_storage("s3://some-bucket/run")
    try:
        with pytest.raises(TransientStorageError) as caught:
            store.put_bytes("step-1/MANIFEST.json", b"{}")
    finally:
        store.close()

    assert "127.0.0.1:9" in str(caught.value) and "check AWS_ENDPOINT_URL" in str(caught.value), caught.value
    assert "hunter2" not in str(caught.value)
    assert not any("hunter2" in r.getMessage() for r in caplog.records)


# A password holding every character a URL's userinfo may hold besides letters and digits (RFC
# 3986's sub-delims, ':' and a %-escape), each between two parts that must all be blanked.
_ODD_PASSWORD = "Zq0'Zq1\"Zq2(Zq3)Zq4!Zq5$Zq6&Zq7*Zq8+Zq9,Zr0;Zr1=Zr2:Zr3%27Zr4"


def _password_parts_in(text: str) -> list[str]:
    return [part for part in re.split(r"[^A-Za-z0-9]+", _ODD_PASSWORD) if part and part in text]


def test_a_password_with_quotes_and_sub_delims_is_never_printed_by_spotjob_ckpt_even_at_debug(
    tmp_path: Path,
) -> None:
    """``AWS_ENDPOINT_URL=http://alice:PW'secret@host``: a quote is legal in a userinfo, and the
    masks stopped at it, so the error and eight ``-v`` debug lines (botocore's url=, Endpoint and
    endpoint provider lines, the traceback) printed the password whole."""
    with socket.socket() as s:  # a loopback port nobody listens on: connection refused at once
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SPOTJOB_", "AWS_"))}
    env.update(
        HOME=str(tmp_path), PYTHONPATH=str(REPO), AWS_ACCESS_KEY_ID="a", AWS_SECRET_ACCESS_KEY="b",
        AWS_REGION="us-east-1", AWS_CONFIG_FILE=os.devnull, AWS_SHARED_CREDENTIALS_FILE=os.devnull,
        AWS_EC2_METADATA_DISABLED="true", SPOTJOB_STORAGE_MAX_ATTEMPTS="1",
        AWS_ENDPOINT_URL=f"http://alice:{_ODD_PASSWORD}@127.0.0.1:{port}",
    )  # fmt: skip
    for verbose in ([], ["-v"]):
        done = subprocess.run(
            [sys.executable, "-m", "orchestrator.cli", *verbose, "ckpt", "list", "s3://b/run"],
            env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert done.returncode == 2, done.stderr
        assert f'Could not connect to the endpoint URL: "http://***@127.0.0.1:{port}/b?' in done.stderr, done.stderr
        assert not _password_parts_in(done.stdout + done.stderr), done.stderr
    assert f"http://<redacted>@127.0.0.1:{port}" in done.stderr  # the debug lines are there, blanked


def test_a_password_with_quotes_and_sub_delims_is_never_in_the_checkpointers_error_or_warnings(
    monkeypatch: pytest.MonkeyPatch, moto_server: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The same endpoint through the Checkpointer: its refusal (StorageUnavailableError, what the
    training script prints) and its warnings repeated botocore's URL with the password in it."""
    from agent import Checkpointer
    from agent.checkpoint.errors import StorageUnavailableError

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://alice:{_ODD_PASSWORD}@127.0.0.1:{port}")
    monkeypatch.setenv("SPOTJOB_STORAGE_MAX_ATTEMPTS", "1")
    monkeypatch.chdir(tmp_path)

    with pytest.raises(StorageUnavailableError) as caught:
        Checkpointer("s3://wb1/run1", every_steps=1, staging_dir=str(tmp_path / "staging"))

    said = str(caught.value)
    assert f"http://***@127.0.0.1:{port}/wb1" in said and "check AWS_ENDPOINT_URL" in said, said
    assert not _password_parts_in(said), said
    assert not [r.getMessage() for r in caplog.records if _password_parts_in(r.getMessage())]


@pytest.mark.parametrize("status", [410, 404])
def test_a_gcs_upload_whose_session_is_lost_midway_starts_again_in_a_new_session(
    gcs_behind_proxy: tuple[Storage, FaultProxy],
    tmp_path: Path,
    status: int,
) -> None:
    """GCS answers a chunk of a session it no longer has with 410 (it ended the session after a
    failure of its own) or 404 (the session expired): resending the chunk cannot help, only a new
    session can. The upload failed permanently, and with it the whole save. fake-gcs-server never
    loses a session; the proxy answers one chunk as GCS then does, and models nothing else."""
    store, proxy = gcs_behind_proxy
    lost = proxy.fail(
        1, status, method="PUT", match=lambda req: req.headers.get("Content-Range", "").startswith(f"bytes {PART}-")
    )
    src = tmp_path / "src.bin"
    crc, _ = write_random(src, BIG)
    reported: list[int] = []

    store.put_file(str(src), "step-1/shard", crc32c=crc, progress=reported.append)

    assert lost.served == 1
    assert sum(1 for s in proxy.seen if s.method == "POST" and "uploadType=resumable" in s.path) == 2
    assert store.get_bytes("step-1/shard") == src.read_bytes()
    assert sum(reported) == BIG  # the chunk sent again in the new session is not counted twice


def test_a_gcs_upload_whose_sessions_keep_being_lost_gives_up_as_transient(
    gcs_behind_proxy: tuple[Storage, FaultProxy],
    tmp_path: Path,
) -> None:
    """The restart is bounded: a new session per attempt, SPOTJOB_STORAGE_MAX_ATTEMPTS in all."""
    store, proxy = gcs_behind_proxy
    lost = proxy.fail(1000, 410, method="PUT", path=r"upload_id=")
    src = tmp_path / "src.bin"
    crc, _ = write_random(src, BIG)

    with pytest.raises(TransientStorageError) as caught:
        store.put_file(str(src), "step-1/shard", crc32c=crc)

    assert lost.served == 5  # SPOTJOB_STORAGE_MAX_ATTEMPTS of fast_retries, one per session
    assert "5 upload sessions" in str(caught.value) and "upload_id" not in str(caught.value)
    assert store.stat("step-1/shard") is None
