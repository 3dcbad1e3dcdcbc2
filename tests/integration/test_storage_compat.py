"""S3-compatible stores and bucket configurations that differ from AWS S3 and from moto.

moto and fake-gcs-server behave like AWS and GCS at their most accommodating. The stores users
point spotjob at do not all: this file puts ``tests/faults.py``'s proxy in front of moto (or
fake-gcs-server) and has it answer the way such a store does, in that store's error dialect:

- ``requires_content_md5``: DeleteObjects without ``Content-MD5`` is refused with 400
  ``MissingContentMD5`` — MinIO releases before 2025, Dell PowerScale. It models that one check
  only; everything else is moto's.
- ``rejects_checksum_headers``: any request carrying an ``x-amz-checksum-*`` or
  ``x-amz-sdk-checksum-*`` header is refused with 400 ``InvalidArgument`` "Unsupported header …"
  — Backblaze B2's documented behaviour. It does not model B2's other differences (its ETags,
  its own lifecycle rules).
- ``ignores_if_none_match``: the proxy forwards every request without ``If-None-Match``, so a
  create-only PUT overwrites like a plain one — MinIO and Ceph RGW releases from before they
  supported conditional writes, and gateways that pass the header by. It models that one header.

A retention policy or an object hold on a GCS bucket, which fake-gcs-server does not enforce, is
modelled the same way: the proxy answers a DELETE with GCS's 403 and its message.
"""

from __future__ import annotations

import logging
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest

from agent._layout import PROBES_FOLDER
from agent.checkpoint import Checkpointer, StorageRefusedError
from agent.storage import MissingBucketError, PermanentStorageError, RetainedError, Storage, open_storage
from orchestrator.cli import main

sys.path.insert(0, str(Path(__file__).resolve().parent / "scripts"))
from ckpt_compare import assert_same
from ckpt_state import make_state, snapshot, train

try:
    from faults import FaultProxy, Request
except ImportError:  # tests/ collected as a package
    from tests.faults import FaultProxy, Request

FOREVER = 1_000_000


def _lacks_content_md5(req: Request) -> bool:
    return req.method == "POST" and req.path.endswith("?delete") and "Content-MD5" not in req.headers


def requires_content_md5(proxy: FaultProxy) -> Any:
    """Refuse DeleteObjects without ``Content-MD5`` as MinIO releases before 2025 do."""
    return proxy.fail(
        FOREVER,
        400,
        code="MissingContentMD5",
        message="Missing required header for this request: Content-Md5.",
        match=_lacks_content_md5,
    )


@pytest.fixture
def s3_behind_proxy(
    monkeypatch: pytest.MonkeyPatch,
    fresh_uri: Callable[[str], str],
    fault_proxy: Callable[..., FaultProxy],
    moto_server: str,
    fast_retries: None,
) -> tuple[str, FaultProxy]:
    """An ``s3://`` URI on a fresh moto bucket, reached through the proxy (``AWS_ENDPOINT_URL``)."""
    uri = fresh_uri("s3")
    proxy = fault_proxy(moto_server, "s3")
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
    return uri, proxy


def save_steps(uri: str, steps: list[int], *, keep: int | None) -> dict[int, dict[str, object]]:
    state = make_state(0)
    saved = {}
    with Checkpointer(uri, every_steps=1, keep=keep) as ckpt:
        done = 0
        for step in steps:
            train(state, step - done, start=done)
            done = step
            ckpt.step(step, state)
            saved[step] = snapshot(state)
    return saved


def folders(storage: Storage) -> list[str]:
    return [d for d in storage.list_dirs("") if d.startswith("step-")]


# -- DeleteObjects and Content-MD5 -----------------------------------------------------------------


def test_retention_removes_old_checkpoints_on_a_store_that_requires_content_md5_on_deletes(
    s3_behind_proxy: tuple[str, FaultProxy],
) -> None:
    uri, proxy = s3_behind_proxy
    refused = requires_content_md5(proxy)
    save_steps(uri, [1, 2, 3], keep=1)
    storage = open_storage(uri)
    try:
        assert folders(storage) == ["step-000000003"]
    finally:
        storage.close()
    assert refused.served == 0
    assert any(s.method == "POST" and s.path.endswith("?delete") for s in proxy.seen)


# -- stores that refuse the x-amz-checksum-* headers ------------------------------------------------


def _carries_checksum_header(req: Request) -> bool:
    return any(name.lower().startswith(("x-amz-checksum-", "x-amz-sdk-checksum-")) for name in req.headers)


def rejects_checksum_headers(proxy: FaultProxy) -> Any:
    """Refuse any request with an ``x-amz-checksum-*`` header, as Backblaze B2 does."""
    return proxy.fail(
        FOREVER,
        400,
        code="InvalidArgument",
        message="Unsupported header 'x-amz-checksum-crc32c' received for this API call.",
        match=_carries_checksum_header,
    )


@pytest.mark.parametrize("size", [100, 6 * 1024 * 1024], ids=["one PUT", "multipart"])
def test_a_store_that_refuses_checksum_headers_gets_an_error_that_names_the_switch(
    s3_behind_proxy: tuple[str, FaultProxy], monkeypatch: pytest.MonkeyPatch, tmp_path: Path, size: int
) -> None:
    uri, proxy = s3_behind_proxy
    monkeypatch.setenv("SPOTJOB_STORAGE_MULTIPART_THRESHOLD", "1MiB")
    refused = rejects_checksum_headers(proxy)
    src = tmp_path / "shard"
    src.write_bytes(b"x" * size)
    storage = open_storage(uri)
    try:
        with pytest.raises(PermanentStorageError) as caught:
            storage.put_file(str(src), "step-000000001/shard")
    finally:
        storage.close()
    assert refused.served == 1  # permanent: not retried
    assert "Unsupported header" in str(caught.value)
    assert "SPOTJOB_STORAGE_S3_CHECKSUM_HEADERS=0" in str(caught.value)


def test_with_checksum_headers_off_checkpoints_save_restore_and_expire_on_such_a_store(
    s3_behind_proxy: tuple[str, FaultProxy], monkeypatch: pytest.MonkeyPatch, s3_client: Any
) -> None:
    uri, proxy = s3_behind_proxy
    monkeypatch.setenv("SPOTJOB_STORAGE_S3_CHECKSUM_HEADERS", "0")
    monkeypatch.setenv("SPOTJOB_STORAGE_MULTIPART_THRESHOLD", "1KiB")  # the shards go up as multipart
    refused = rejects_checksum_headers(proxy)
    saved = save_steps(uri, [1, 2, 3], keep=2)
    state = make_state(0, seed=7)
    with Checkpointer(uri) as ckpt:
        assert ckpt.restore(state) == 3
    assert_same(snapshot(state), saved[3], "the state restored from step 3")
    storage = open_storage(uri)
    try:
        assert folders(storage) == ["step-000000002", "step-000000003"]
    finally:
        storage.close()
    assert refused.served == 0
    assert any("uploadId=" in s.path for s in proxy.seen)


def test_with_checksum_headers_off_a_shard_damaged_in_the_store_is_still_refused_at_restore(
    s3_behind_proxy: tuple[str, FaultProxy], monkeypatch: pytest.MonkeyPatch, s3_client: Any
) -> None:
    uri, proxy = s3_behind_proxy
    monkeypatch.setenv("SPOTJOB_STORAGE_S3_CHECKSUM_HEADERS", "0")
    rejects_checksum_headers(proxy)
    saved = save_steps(uri, [1, 2], keep=None)
    bucket, prefix = uri.removeprefix("s3://").split("/", 1)
    listed = s3_client.list_objects_v2(Bucket=bucket, Prefix=f"{prefix}/step-000000002/")["Contents"]
    shard = next(o["Key"] for o in listed if o["Key"].endswith(".distcp"))
    data = bytearray(s3_client.get_object(Bucket=bucket, Key=shard)["Body"].read())
    data[len(data) // 2] ^= 0xFF  # same size: only the CRC32C can tell
    s3_client.put_object(Bucket=bucket, Key=shard, Body=bytes(data))
    state = make_state(0, seed=7)
    with Checkpointer(uri) as ckpt:
        assert ckpt.restore(state) == 1
    assert_same(snapshot(state), saved[1], "the state restored from step 1")


# -- buckets that keep objects: GCS retention policies and holds, S3 Object Lock --------------------

GCS_RETENTION_MESSAGE = (
    "Object '{bucket}/x' is subject to bucket's retention policy and cannot be deleted, overwritten or "
    "archived until 2027-01-01T00:00:00.000000-00:00"
)


@pytest.fixture
def gs_behind_proxy(
    monkeypatch: pytest.MonkeyPatch,
    fresh_uri: Callable[[str], str],
    fault_proxy: Callable[..., FaultProxy],
    gcs_server: str,
    fast_retries: None,
) -> tuple[str, FaultProxy]:
    """A ``gs://`` URI on a fresh fake-gcs-server bucket, reached through the proxy."""
    uri = fresh_uri("gs")
    proxy = fault_proxy(gcs_server, "gcs")
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", proxy.url)
    return uri, proxy


def keeps_objects(proxy: FaultProxy, uri: str, under: str = "") -> Any:
    """Refuse every DELETE (under ``under``) as a GCS bucket with a retention policy does."""
    bucket, prefix = uri.removeprefix("gs://").split("/", 1)
    path = re.escape(quote(f"{prefix}/{under}", safe=""))
    return proxy.fail(
        FOREVER, 403, message=GCS_RETENTION_MESSAGE.format(bucket=bucket), method="DELETE", path=f"/o/{path}"
    )


def test_a_gcs_retention_policy_keeps_old_checkpoints_with_one_clear_warning_and_saves_go_on(
    gs_behind_proxy: tuple[str, FaultProxy], caplog: pytest.LogCaptureFixture
) -> None:
    uri, proxy = gs_behind_proxy
    refused = keeps_objects(proxy, uri)
    with caplog.at_level(logging.WARNING, logger="agent"):
        saved = save_steps(uri, [1, 2, 3, 4], keep=1)
    assert refused.served >= 3  # every save after the first tried, and was refused
    said = [r.getMessage() for r in caplog.records if "retention" in r.getMessage()]
    assert len(said) == 1, said
    assert "retention period" in said[0] and "keep=1" in said[0]
    assert "permission denied" not in said[0] and "credentials in use" not in said[0]
    storage = open_storage(uri)
    try:
        assert folders(storage) == [f"step-00000000{n}" for n in (1, 2, 3, 4)]
    finally:
        storage.close()
    state = make_state(0, seed=7)
    with Checkpointer(uri) as ckpt:
        assert ckpt.restore(state) == 4
    assert_same(snapshot(state), saved[4], "the state restored from step 4")


def test_a_save_whose_gcs_upload_session_is_lost_still_commits_and_restores(
    gs_behind_proxy: tuple[str, FaultProxy], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every shard past the multipart threshold goes up in a resumable session; GCS answers a
    chunk of a session it has ended with 410. That failed the shard's upload for good, and with it
    the save: nothing committed. The proxy ends one session (fake-gcs-server never does)."""
    uri, proxy = gs_behind_proxy
    monkeypatch.setenv("SPOTJOB_STORAGE_MULTIPART_THRESHOLD", "1")  # every shard: resumable
    lost = proxy.fail(1, 410, method="PUT", path=r"upload_id=")
    saved = save_steps(uri, [1], keep=None)
    assert lost.served == 1
    state = make_state(0, seed=7)
    with Checkpointer(uri) as ckpt:
        assert ckpt.restore(state) == 1
    assert_same(snapshot(state), saved[1], "the state restored from step 1")


def test_a_leftover_the_bucket_keeps_does_not_stop_that_step_from_being_saved(
    gs_behind_proxy: tuple[str, FaultProxy], gcs_client: Any
) -> None:
    uri, proxy = gs_behind_proxy
    bucket, prefix = uri.removeprefix("gs://").split("/", 1)
    leftover = gcs_client.bucket(bucket).blob(f"{prefix}/step-000000002/__0_0.distcp")
    leftover.upload_from_string(b"half a shard: the save was preempted")  # no manifest: uncommitted
    generation = gcs_client.bucket(bucket).get_blob(leftover.name).generation
    keeps_objects(proxy, uri, "step-000000002/")
    saved = save_steps(uri, [1, 2], keep=None)
    state = make_state(0, seed=7)
    with Checkpointer(uri) as ckpt:
        assert ckpt.restore(state) == 2
    assert_same(snapshot(state), saved[2], "the state restored from step 2")
    storage = open_storage(uri)
    try:
        assert folders(storage) == ["step-000000001", "step-000000002", "step-000000002.1"]
    finally:
        storage.close()
    assert gcs_client.bucket(bucket).get_blob(leftover.name).generation == generation  # never overwritten


def test_an_s3_object_lock_refusal_is_named_as_such_not_as_missing_permissions(
    s3_behind_proxy: tuple[str, FaultProxy],
) -> None:
    uri, proxy = s3_behind_proxy
    proxy.fail(FOREVER, 403, code="AccessDenied", message="Access Denied because object protected by object lock.")
    storage = open_storage(uri)
    try:
        with pytest.raises(RetainedError) as caught:
            storage.delete(["step-000000001/MANIFEST.json"])
    finally:
        storage.close()
    assert "Object Lock" in str(caught.value) and "credentials in use" not in str(caught.value)


# -- versioned buckets ------------------------------------------------------------------------------


def test_on_a_versioned_bucket_retention_removes_each_checkpoint_once_and_adds_no_marker_after(
    s3_behind_proxy: tuple[str, FaultProxy], s3_client: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """Deletes on a versioned bucket add delete markers and keep the bytes as noncurrent versions
    (README: Storage). moto, like MinIO, still lists a folder whose objects are all delete
    markers: retention must see that it holds nothing, not delete its manifest again each save."""
    uri, _ = s3_behind_proxy
    bucket, prefix = uri.removeprefix("s3://").split("/", 1)
    s3_client.put_bucket_versioning(Bucket=bucket, VersioningConfiguration={"Status": "Enabled"})
    with caplog.at_level(logging.INFO, logger="agent.checkpoint"):
        saved = save_steps(uri, [1, 2, 3, 4, 5], keep=1)
    removed = [r.getMessage() for r in caplog.records if r.getMessage().startswith("retention: removed")]
    assert sorted(removed) == [f"retention: removed {uri}/step-00000000{n}" for n in (1, 2, 3, 4)]
    storage = open_storage(uri)
    try:
        assert {o.key.split("/")[0] for o in storage.list("") if o.key.startswith("step-")} == {"step-000000005"}
    finally:
        storage.close()
    versions = s3_client.list_object_versions(Bucket=bucket, Prefix=f"{prefix}/step-000000001/")
    markers = [m["Key"] for m in versions.get("DeleteMarkers", [])]
    assert sorted(markers) == sorted(set(markers)) and f"{prefix}/step-000000001/MANIFEST.json" in markers
    assert versions.get("Versions")  # the bytes stay, noncurrent, until a lifecycle rule expires them
    state = make_state(0, seed=7)
    with Checkpointer(uri) as ckpt:
        assert ckpt.restore(state) == 5
    assert_same(snapshot(state), saved[5], "the state restored from step 5")


# -- Requester Pays ---------------------------------------------------------------------------------


def test_a_gcs_requester_pays_bucket_is_named_as_unsupported(gs_behind_proxy: tuple[str, FaultProxy]) -> None:
    uri, proxy = gs_behind_proxy
    proxy.fail(FOREVER, 400, code="required", message="Bucket is a requester pays bucket but no user project provided.")
    storage = open_storage(uri)
    try:
        with pytest.raises(PermanentStorageError) as caught:
            storage.put_bytes("step-000000001/MANIFEST.json", b"{}")
    finally:
        storage.close()
    assert "does not support Requester Pays" in str(caught.value)


def test_an_s3_refusal_mentions_requester_pays_among_its_causes(s3_behind_proxy: tuple[str, FaultProxy]) -> None:
    uri, proxy = s3_behind_proxy
    proxy.fail(FOREVER, 403, code="AccessDenied", message="Access Denied")
    storage = open_storage(uri)
    try:
        with pytest.raises(PermanentStorageError) as caught:
            storage.get_bytes("step-000000001/MANIFEST.json")
    finally:
        storage.close()
    assert "permission denied" in str(caught.value) and "Requester Pays" in str(caught.value)


def test_on_a_versioned_bucket_an_unfinished_saves_leftover_goes_once_with_keep_unset(
    s3_behind_proxy: tuple[str, FaultProxy], s3_client: Any, caplog: pytest.LogCaptureFixture
) -> None:
    uri, _ = s3_behind_proxy
    bucket, prefix = uri.removeprefix("s3://").split("/", 1)
    s3_client.put_bucket_versioning(Bucket=bucket, VersioningConfiguration={"Status": "Enabled"})
    s3_client.put_object(Bucket=bucket, Key=f"{prefix}/step-000000001/__0_0.distcp", Body=b"half a shard")
    with caplog.at_level(logging.INFO, logger="agent.checkpoint"):
        save_steps(uri, [2, 3, 4], keep=None)
    said = [(r.levelno, r.getMessage()) for r in caplog.records if r.getMessage().startswith("retention")]
    assert said == [(logging.INFO, f"retention: removed {uri}/step-000000001")]
    versions = s3_client.list_object_versions(Bucket=bucket, Prefix=f"{prefix}/step-000000001/")
    assert [m["Key"] for m in versions.get("DeleteMarkers", [])] == [f"{prefix}/step-000000001/__0_0.distcp"]


# -- stores that ignore If-None-Match (create-only PUTs) ----------------------------------------------


def ignores_if_none_match(proxy: FaultProxy) -> Any:
    """Forward every request without ``If-None-Match``, as a store that does not support it does."""
    return proxy.strip_header("If-None-Match")


def _probe_requests(proxy: FaultProxy) -> list[str]:
    return [f"{s.method} {s.path}" for s in proxy.seen if "create-only-probe-" in s.path or s.path.endswith("?delete")]


def _keys(s3_client: Any, uri: str) -> list[str]:
    bucket, prefix = uri.removeprefix("s3://").split("/", 1)
    return sorted(o["Key"] for o in s3_client.list_objects_v2(Bucket=bucket, Prefix=prefix).get("Contents", []))


def test_a_store_that_ignores_if_none_match_is_refused_before_the_first_save_naming_the_endpoint_and_switch(
    s3_behind_proxy: tuple[str, FaultProxy], s3_client: Any
) -> None:
    uri, proxy = s3_behind_proxy
    stripped = ignores_if_none_match(proxy)
    with pytest.raises(StorageRefusedError) as caught:
        Checkpointer(uri, every_steps=1)
    said = str(caught.value)
    assert "ignores If-None-Match" in said and proxy.url in said, said
    assert "SPOTJOB_STORAGE_S3_CREATE_ONLY_CHECK=0" in said and "Upgrade the store" in said
    assert stripped.served == 2  # the probe's two create-only PUTs, nothing more: no claim
    assert _keys(s3_client, uri) == []  # the probe is deleted, no owner.json was written


def test_the_probe_is_refused_on_its_second_put_by_a_store_that_enforces_if_none_match_and_leaves_nothing(
    s3_behind_proxy: tuple[str, FaultProxy], s3_client: Any
) -> None:
    uri, proxy = s3_behind_proxy
    storage = open_storage(uri)
    try:
        storage.check_create_only(PROBES_FOLDER)
        storage.check_create_only(PROBES_FOLDER)  # proven already in this process: no request
    finally:
        storage.close()
    probe = _probe_requests(proxy)
    assert [r.split(" ")[0] for r in probe] == ["PUT", "PUT", "POST"], probe
    assert f"/{PROBES_FOLDER}/create-only-probe-" in probe[0] and probe[0] == probe[1]
    assert _keys(s3_client, uri) == []


def test_a_probe_the_store_refused_outright_is_not_deleted_and_no_warning_says_it_could_not_be(
    s3_behind_proxy: tuple[str, FaultProxy], caplog: pytest.LogCaptureFixture
) -> None:
    """A missing bucket (or a denied PUT) wrote no probe: deleting it anyway only added a third
    request and a WARNING, "could not delete the create-only probe", to every such failed start."""
    _, proxy = s3_behind_proxy
    storage = open_storage("s3://spotjob-no-such-bucket/run")
    try:
        with caplog.at_level(logging.WARNING), pytest.raises(MissingBucketError):
            storage.check_create_only(PROBES_FOLDER)
    finally:
        storage.close()
    assert [r.split(" ")[0] for r in _probe_requests(proxy)] == ["PUT"]
    assert "could not delete the create-only probe" not in caplog.text


def test_checkpoints_save_and_restore_behind_the_probe_once_per_process_and_no_probe_is_left(
    s3_behind_proxy: tuple[str, FaultProxy], s3_client: Any
) -> None:
    uri, proxy = s3_behind_proxy
    saved = save_steps(uri, [1, 2], keep=None)
    state = make_state(0, seed=7)
    with Checkpointer(uri) as ckpt:  # a second Checkpointer in this process: no second probe
        assert ckpt.restore(state) == 2
    assert_same(snapshot(state), saved[2], "the state restored from step 2")
    assert len([r for r in _probe_requests(proxy) if r.startswith("PUT")]) == 2
    assert not [k for k in _keys(s3_client, uri) if "probe" in k]


def test_with_the_create_only_check_off_a_job_runs_on_such_a_store_and_sends_no_probe(
    s3_behind_proxy: tuple[str, FaultProxy], monkeypatch: pytest.MonkeyPatch
) -> None:
    uri, proxy = s3_behind_proxy
    monkeypatch.setenv("SPOTJOB_STORAGE_S3_CREATE_ONLY_CHECK", "0")
    ignores_if_none_match(proxy)
    saved = save_steps(uri, [1, 2], keep=1)
    state = make_state(0, seed=7)
    with Checkpointer(uri) as ckpt:
        assert ckpt.restore(state) == 2
    assert_same(snapshot(state), saved[2], "the state restored from step 2")
    assert not [s for s in proxy.seen if "create-only-probe-" in s.path]


def test_spotjob_ckpt_list_and_verify_only_read_a_store_that_ignores_if_none_match(
    s3_behind_proxy: tuple[str, FaultProxy], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    uri, proxy = s3_behind_proxy
    monkeypatch.setenv("SPOTJOB_STORAGE_S3_CREATE_ONLY_CHECK", "0")
    ignores_if_none_match(proxy)
    save_steps(uri, [1], keep=None)
    monkeypatch.delenv("SPOTJOB_STORAGE_S3_CREATE_ONLY_CHECK")
    before = len(proxy.seen)
    assert main(["ckpt", "list", uri]) == 0
    assert main(["ckpt", "verify", uri]) == 0
    assert "step-000000001" in capsys.readouterr().out
    assert {s.method for s in proxy.seen[before:]} <= {"GET", "HEAD"}


# -- stores that refuse If-None-Match outright (501 NotImplemented) ---------------------------------


def refuses_if_none_match(proxy: FaultProxy) -> Any:
    """Answer any request carrying ``If-None-Match`` with 501 ``NotImplemented``, as Alibaba OSS's
    S3 API does (and AWS itself for a header it does not implement). It models that one header."""
    return proxy.fail(
        FOREVER,
        501,
        code="NotImplemented",
        message="A header you provided implies functionality that is not implemented",
        match=lambda req: "If-None-Match" in req.headers,
    )


def test_a_store_that_answers_if_none_match_with_501_is_refused_at_once_naming_conditional_writes(
    s3_behind_proxy: tuple[str, FaultProxy], s3_client: Any
) -> None:
    """A 501 is the store saying it will never do this: not an outage to retry (and, under the
    agent, to restart on without end), but a refusal that names what the store lacks."""
    uri, proxy = s3_behind_proxy
    refused = refuses_if_none_match(proxy)
    with pytest.raises(StorageRefusedError) as caught:
        Checkpointer(uri, every_steps=1)
    said = str(caught.value)
    assert refused.served == 1, said  # permanent: not retried
    assert "NotImplemented (HTTP 501)" in said and "If-None-Match" in said, said
    assert "conditional writes" in said and proxy.url in said, said
    assert _keys(s3_client, uri) == []


def test_a_501_on_any_other_request_is_permanent_too(s3_behind_proxy: tuple[str, FaultProxy]) -> None:
    uri, proxy = s3_behind_proxy
    refused = proxy.fail(FOREVER, 501, code="NotImplemented", message="not implemented", method="PUT")
    storage = open_storage(uri)
    try:
        with pytest.raises(PermanentStorageError) as caught:
            storage.put_bytes("step-000000001/x", b"x")
    finally:
        storage.close()
    assert refused.served == 1
    assert "does not implement" in str(caught.value)


# -- stores whose multipart checksums are composite only --------------------------------------------


def composite_checksums_only(proxy: FaultProxy) -> Any:
    """Refuse a CompleteMultipartUpload that carries a whole-object ``x-amz-checksum-crc32c``, as
    MinIO releases before 2025 do: they ignore ``x-amz-checksum-type: FULL_OBJECT``, combine the
    parts' CRC32Cs into a composite checksum (a CRC of the CRCs) and compare the whole file's CRC32C
    with that. The same Complete without the header succeeds (the parts' own checksums were checked
    as each part arrived). It models that one check; the parts and everything else are moto's."""
    return proxy.fail(
        FOREVER,
        400,
        code="XAmzContentChecksumMismatch",
        message="The provided 'x-amz-checksum' header does not match what was computed.",
        match=lambda req: req.method == "POST" and "uploadId=" in req.path and "x-amz-checksum-crc32c" in req.headers,
    )


def test_a_store_without_full_object_multipart_checksums_still_takes_multipart_checkpoints(
    s3_behind_proxy: tuple[str, FaultProxy], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Every file at or above the multipart threshold (64 MiB: every real shard) failed its save
    there with a checksum mismatch that read as damaged data and named no remedy."""
    uri, proxy = s3_behind_proxy
    monkeypatch.setenv("SPOTJOB_STORAGE_MULTIPART_THRESHOLD", "1KiB")  # the shards go up as multipart
    refused = composite_checksums_only(proxy)
    with caplog.at_level(logging.WARNING, logger="agent.storage.s3"):
        saved = save_steps(uri, [1, 2], keep=None)
    state = make_state(0, seed=7)
    with Checkpointer(uri) as ckpt:
        assert ckpt.restore(state) == 2
    assert_same(snapshot(state), saved[2], "the state restored from step 2")
    # Learnt once per process and bucket (by the first save's uploads in flight together), not paid
    # again on every later upload.
    refusals = [s.path for s in proxy.seen if s.fault is not None]
    assert refusals and refused.served == len(refusals)
    assert all("/step-000000001/" in path for path in refusals), refusals
    completes = [s for s in proxy.seen if s.method == "POST" and "uploadId=" in s.path and s.fault is None]
    assert len(completes) > 2
    warned = [r.getMessage() for r in caplog.records if "full-object" in r.getMessage()]
    assert len(warned) == 1 and proxy.url in warned[0], warned


# -- a bucket policy that denies s3:DeleteObject ----------------------------------------------------


def denies_deletes(proxy: FaultProxy) -> Any:
    """Answer every DeleteObjects as S3 does under a bucket policy that denies ``s3:DeleteObject``:
    HTTP 200, each key listed with ``AccessDenied``. It does not model single-key DELETEs (spotjob
    sends those only for keys XML cannot carry) nor a policy that denies some keys only."""

    def per_key_denied(request: bytes) -> bytes:
        keys = re.findall(rb"<Key>(.*?)</Key>", request)
        errors = b"".join(
            b"<Error><Key>%s</Key><Code>AccessDenied</Code><Message>Access Denied</Message></Error>" % k for k in keys
        )
        return b'<?xml version="1.0" encoding="UTF-8"?>\n<DeleteResult>%s</DeleteResult>' % errors

    return proxy.answer(FOREVER, 200, per_key_denied, method="POST", match=lambda req: req.path.endswith("?delete"))


def test_under_a_policy_that_denies_deletes_a_step_with_an_unfinished_saves_leftover_is_still_saved(
    s3_behind_proxy: tuple[str, FaultProxy], s3_client: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """The leftover (a save cut off before its manifest) cannot be removed there; the save of that
    step used to fail on it, as it did not for a bucket that keeps objects by Object Lock. Retention
    keeps everything and says why: permission denied, and what it needs."""
    uri, proxy = s3_behind_proxy
    bucket, prefix = uri.removeprefix("s3://").split("/", 1)
    s3_client.put_object(Bucket=bucket, Key=f"{prefix}/step-000000002/__0_0.distcp", Body=b"cut off")
    denied = denies_deletes(proxy)
    with caplog.at_level(logging.WARNING):
        saved = save_steps(uri, [1, 2, 3], keep=1)
    state = make_state(0, seed=7)
    with Checkpointer(uri) as ckpt:
        assert ckpt.restore(state) == 3
    assert_same(snapshot(state), saved[3], "the state restored from step 3")
    storage = open_storage(uri)
    try:
        assert folders(storage) == ["step-000000001", "step-000000002", "step-000000002.1", "step-000000003"]
    finally:
        storage.close()
    assert denied.served > 0
    said = [r.getMessage() for r in caplog.records if "retention" in r.getMessage()]
    # Saves 2 and 3 both met the refusal; the second says it at debug level, not as a warning.
    assert len(said) == 1 and "permission denied" in said[0] and "s3:DeleteObject" in said[0], said


# -- stores without DeleteObjects -------------------------------------------------------------------


@pytest.mark.parametrize("status", [400, 501])
def test_retention_frees_space_on_a_store_without_multi_object_delete(
    s3_behind_proxy: tuple[str, FaultProxy], caplog: pytest.LogCaptureFixture, status: int
) -> None:
    """GCS's S3 (XML) interoperability answered ``POST ?delete`` with ``NotImplemented`` (HTTP 400
    in some reports, 501 in others) until it added multi-object delete; other gateways still do.
    The proxy models that one refusal: single-key DELETEs reach moto. Retention used to remove
    nothing there, ever."""
    uri, proxy = s3_behind_proxy
    refused = proxy.fail(
        FOREVER,
        status,
        code="NotImplemented",
        message="A header or query you provided requested a function that is not implemented.",
        method="POST",
        match=lambda req: req.path.endswith("?delete"),
    )
    with caplog.at_level(logging.INFO, logger="agent.storage.s3"):
        save_steps(uri, [1, 2, 3], keep=1)
    storage = open_storage(uri)
    try:
        assert folders(storage) == ["step-000000003"]
        assert not [o.key for o in storage.list("") if "create-only-probe-" in o.key]
    finally:
        storage.close()
    assert refused.served == 1  # learnt once per process and bucket
    assert any(s.method == "DELETE" for s in proxy.seen)
    said = [r.getMessage() for r in caplog.records if "DeleteObjects" in r.getMessage()]
    assert len(said) == 1 and proxy.url in said[0], said
