"""Every store raises only the errors ``agent.storage.base`` documents, and says what is wrong.

Each case runs a battery of every ``Storage`` operation against a broken store and checks that
what comes out is a ``StorageError`` with a useful message, never an ``OSError`` or a client
library's exception: a URI that is a regular file, a folder (or bucket) this identity may not
touch, a bucket that does not exist.

Permission denied on a folder needs a user that file modes bind: root ignores them. When the tests
run as root (as they do here), the folder case runs in a child interpreter that drops to uid/gid
65534 (nobody) after importing what it needs, so the ``EACCES`` is the kernel's own. The object
stores' 403s come from the fault proxy in the store's own error dialect (moto and fake-gcs-server
enforce no permissions).
"""

from __future__ import annotations

import errno
import io
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from agent.catalog import find_checkpoints
from agent.storage import (
    MissingBucketError,
    NotFoundError,
    PermanentStorageError,
    RetainedError,
    Storage,
    StorageError,
    TransientStorageError,
    gs,
    open_storage,
)
from agent.storage._errors import translate_os_error
from agent.streams import UtcFormatter

try:
    from faults import Dialect, FaultProxy
except ImportError:  # tests/ collected as a package
    from tests.faults import Dialect, FaultProxy

REPO = Path(__file__).resolve().parents[2]


def battery(storage: Storage, scratch: Path) -> dict[str, BaseException | None]:
    """Every operation once; what each raised (None: it succeeded). Only StorageErrors may come out."""
    src = scratch / "src.bin"
    src.write_bytes(b"abc")
    ops: dict[str, Callable[[], object]] = {
        "list_dirs": lambda: storage.list_dirs(""),
        "list": lambda: list(storage.list("")),
        "stat": lambda: storage.stat("step-000000001/MANIFEST.json"),
        "get_bytes": lambda: storage.get_bytes("step-000000001/MANIFEST.json"),
        "get_file": lambda: storage.get_file("step-000000001/MANIFEST.json", str(scratch / "out")),
        "put_bytes": lambda: storage.put_bytes("step-000000002/a", b"x"),
        "put_bytes_if_absent": lambda: storage.put_bytes_if_absent("step-000000002/b", b"x"),
        "put_file": lambda: storage.put_file(str(src), "step-000000002/c"),
        "delete": lambda: storage.delete(["step-000000002/a"]),
        "delete_prefix": lambda: storage.delete_prefix("step-000000002/"),
    }
    results: dict[str, BaseException | None] = {}
    for name, op in ops.items():
        try:
            op()
        except StorageError as e:
            results[name] = e
        except Exception as e:  # the defect these tests exist for
            pytest.fail(f"{name} let {type(e).__name__} escape: {e}")
        else:
            results[name] = None
    return results


# -- a URI that is a regular file -----------------------------------------------------------------


def test_a_folder_uri_that_is_a_regular_file_is_refused_by_every_operation(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    root.write_text("not a folder")
    results = battery(open_storage(str(root)), tmp_path)
    for name, error in results.items():
        if name == "delete":
            assert error is None, "deleting a key that cannot exist is done"
            continue
        assert isinstance(error, PermanentStorageError) and not isinstance(error, NotFoundError), name
        assert "is a regular file, not a folder" in str(error) and str(root) in str(error), name
    assert root.read_text() == "not a folder"


# Not on fake-gcs-server: it keeps objects as files on disk, so an object "run1" and objects under
# "run1/" cannot coexist there (it answers 500 "not a directory"); GCS itself allows both.
@pytest.mark.parametrize("scheme", ["s3"])
def test_an_object_named_like_the_uri_prefix_does_not_get_in_the_way(
    scheme: str, fresh_uri: Callable[[str], str], make_storage: Callable[[str], Storage], tmp_path: Path
) -> None:
    """Object stores have no folders: an object at ``bucket/jobs/run1`` and keys under
    ``jobs/run1/`` coexist, and the object is never taken for a checkpoint."""
    uri = fresh_uri(scheme)
    make_storage(uri.rsplit("/", 1)[0]).put_bytes("run1", b"a stray object")
    storage = make_storage(uri)
    results = battery(storage, tmp_path)
    assert isinstance(results["get_bytes"], NotFoundError)
    assert isinstance(results["get_file"], NotFoundError)
    assert {k for k, e in results.items() if e is not None} == {"get_bytes", "get_file"}
    assert find_checkpoints(storage) == []


# -- permission denied ----------------------------------------------------------------------------

_UNPRIVILEGED = textwrap.dedent(
    """
    import json, os, sys
    from pathlib import Path
    from agent.catalog import inspect, CheckpointRef
    from agent.storage import StorageError
    from agent.storage.file import FileStorage
    from orchestrator.cli import main
    import rich.filesize  # what `ckpt list` imports lazily; the interpreter's own files are root's
    import orchestrator.cli_run, orchestrator.cli_status  # what main() imports to register every command
    from agent.version import spotjob_version
    spotjob_version()  # --version's metadata read: Python 3.13 imports importlib.metadata._adapters then

    root, hidden, scratch = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    if os.geteuid() == 0:
        os.setgid(65534)
        os.setuid(65534)
    storage = FileStorage(root)
    out = {}
    for name, op in {
        "list": lambda: list(storage.list("step-000000001/")),
        "inspect": lambda: inspect(storage, CheckpointRef(1)),
        "get_bytes": lambda: storage.get_bytes("step-000000001/MANIFEST.json"),
        "stat": lambda: storage.stat("step-000000001/MANIFEST.json"),
        "put_bytes": lambda: storage.put_bytes("step-000000001/x", b"x"),
        "put_bytes_if_absent": lambda: storage.put_bytes_if_absent("step-000000001/MANIFEST.2", b"x"),
        "put_file": lambda: storage.put_file(str(scratch / "src.bin"), "step-000000001/y"),
        "delete": lambda: storage.delete(["step-000000001/MANIFEST.json"]),
        "list a root behind a closed folder": lambda: list(FileStorage(hidden).list("")),
        "list_dirs of a root behind a closed folder": lambda: FileStorage(hidden).list_dirs(""),
    }.items():
        try:
            op()
            out[name] = None
        except StorageError as e:
            out[name] = [type(e).__name__, str(e)]
        except Exception as e:
            out[name] = ["ESCAPED " + type(e).__name__, str(e)]
    print(json.dumps(out))
    sys.stdout.flush()
    sys.exit(100 + main(["ckpt", "list", root]))
    """
)


@pytest.fixture
def open_tmp() -> Iterator[Path]:
    """A scratch folder every user can enter (pytest's own tmp_path is private to its owner)."""
    path = Path(tempfile.mkdtemp(prefix="spotjob-perm-"))
    path.chmod(0o755)
    yield path
    for sub in path.rglob("*"):
        if sub.is_dir() and not sub.is_symlink():
            sub.chmod(0o755)
    shutil.rmtree(path)


def test_a_folder_this_user_may_not_enter_is_permission_denied_not_an_uncommitted_leftover(open_tmp: Path) -> None:
    root = open_tmp / "ckpt"
    folder = root / "step-000000001"
    folder.mkdir(parents=True)
    (folder / "MANIFEST.json").write_text("{}")
    (open_tmp / "src.bin").write_bytes(b"abc")
    closed = open_tmp / "closed"
    (closed / "ckpt" / "step-000000001").mkdir(parents=True)
    for p in (root, closed / "ckpt"):
        p.chmod(0o755)
    (open_tmp / "src.bin").chmod(0o644)
    folder.chmod(0o000)
    closed.chmod(0o700)
    proc = subprocess.run(
        [sys.executable, "-c", _UNPRIVILEGED, str(root), str(closed / "ckpt"), str(open_tmp)],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        timeout=120,
    )
    assert proc.stdout, proc.stderr
    results: dict[str, Any] = json.loads(proc.stdout.splitlines()[0])
    for name, result in results.items():
        assert result is not None, f"{name} succeeded where it may not go"
        kind, message = result
        assert kind == "PermanentStorageError", (name, result)
        assert "permission denied" in message, (name, message)
    # `spotjob ckpt list` says so in one line and exits 2 (could not check), not "uncommitted".
    assert proc.returncode == 100 + 2, proc.stderr
    assert "permission denied" in proc.stderr and "step-000000001" in proc.stderr
    assert "Traceback" not in proc.stderr and "uncommitted" not in proc.stdout


@pytest.mark.parametrize(
    ("code", "kind", "words"),
    [
        (errno.EACCES, PermanentStorageError, "permission denied"),
        (errno.EPERM, PermanentStorageError, "permission denied"),
        (errno.EROFS, PermanentStorageError, "read-only"),
        (errno.ENOSPC, PermanentStorageError, "no space left"),
        (errno.EDQUOT, PermanentStorageError, "quota"),
        (errno.ESTALE, TransientStorageError, "Stale"),
        (errno.EIO, TransientStorageError, "Input/output"),
        (errno.ENAMETOOLONG, PermanentStorageError, "too long"),
    ],
)
def test_filesystem_errors_translate_into_what_they_mean_for_a_store(
    code: int, kind: type[StorageError], words: str
) -> None:
    """The seam every filesystem error passes through (what the root-only cases cannot provoke)."""
    error = translate_os_error(OSError(code, os.strerror(code), "/data/ckpt/x"), "cannot write file:///data/ckpt/x")
    assert type(error) is kind
    assert words in str(error) and "/data/ckpt/x" in str(error)


@pytest.fixture(params=["s3", "gs"])
def guarded(
    request: pytest.FixtureRequest,
    monkeypatch: pytest.MonkeyPatch,
    fresh_uri: Callable[[str], str],
    fault_proxy: Callable[[str, Dialect], FaultProxy],
    make_storage: Callable[[str], Storage],
    fast_retries: None,
) -> tuple[Storage, FaultProxy]:
    """A store behind the fault proxy, on a bucket created directly on the server."""
    scheme: str = request.param
    uri = fresh_uri(scheme)
    dialect: Dialect = "s3" if scheme == "s3" else "gcs"
    proxy = fault_proxy(request.getfixturevalue("moto_server" if scheme == "s3" else "gcs_server"), dialect)
    monkeypatch.setenv("AWS_ENDPOINT_URL" if scheme == "s3" else "STORAGE_EMULATOR_HOST", proxy.url)
    return make_storage(uri), proxy


def test_an_object_store_that_refuses_access_says_permission_denied_on_every_operation(
    guarded: tuple[Storage, FaultProxy], tmp_path: Path
) -> None:
    storage, proxy = guarded
    storage.put_bytes("step-000000001/MANIFEST.json", b"{}")  # so reads reach a real object
    denied = proxy.fail(1000, 403)
    results = battery(storage, tmp_path)
    assert denied.served >= len(results)
    for name, error in results.items():
        assert isinstance(error, PermanentStorageError) and not isinstance(error, NotFoundError), (name, error)
        assert "permission denied" in str(error), (name, error)


@pytest.mark.parametrize("guarded", ["s3"], indirect=True)
def test_an_s3_request_refused_for_a_skewed_clock_names_the_clock_not_permissions(
    guarded: tuple[Storage, FaultProxy], tmp_path: Path
) -> None:
    """S3 refuses a request signed more than 15 minutes away from its own time with 403
    ``RequestTimeTooSkewed``; botocore does not correct for it, and the store said "permission
    denied: the AWS credentials in use lack the permission", sending the user to IAM for a node
    whose clock is wrong. The fault proxy gives S3's answer (moto checks no request times)."""
    storage, proxy = guarded
    storage.put_bytes("step-000000001/MANIFEST.json", b"{}")
    skewed = proxy.fail(
        1000,
        403,
        code="RequestTimeTooSkewed",
        message="The difference between the request time and the current time is too large.",
    )
    results = battery(storage, tmp_path)
    assert skewed.served >= len(results)
    for name, error in results.items():
        assert isinstance(error, PermanentStorageError), (name, error)
        assert "clock" in str(error), (name, error)
        if "HEAD " not in str(error):  # a HEAD's answer has no body: its 403 cannot say why
            assert "permission denied" not in str(error) and "RequestTimeTooSkewed" in str(error), (name, error)


@pytest.fixture
def session_token(moto_server: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Temporary keys in the environment (a session token beside the fixed test keys); request it
    before ``guarded`` so that the store's client is built with it (after ``moto_server``, whose
    set-up removes any session token)."""
    monkeypatch.setenv("AWS_SESSION_TOKEN", "session-token")


@pytest.mark.parametrize("guarded", ["s3"], indirect=True)
def test_an_s3_request_refused_for_expired_temporary_credentials_says_so_and_what_lasts(
    session_token: None, guarded: tuple[Storage, FaultProxy], tmp_path: Path
) -> None:
    """A job that runs for days outlives temporary keys (an assumed role's, SSO's) exported into its
    environment: S3 then answers every request 400 ``ExpiredToken``, and the store said only
    "ExpiredToken (HTTP 400)", every save failing without a word of why or what to give the job
    instead. A HEAD's 400 (the stat of a restore) has no body and said even less. The fault proxy
    gives S3's answer: moto never expires the credentials it issues."""
    storage, proxy = guarded
    storage.put_bytes("step-000000001/MANIFEST.json", b"{}")
    expired = proxy.fail(1000, 400, code="ExpiredToken", message="The provided token has expired.")
    results = battery(storage, tmp_path)
    assert expired.served >= len(results)
    for name, error in results.items():
        assert isinstance(error, PermanentStorageError) and not isinstance(error, NotFoundError), (name, error)
        assert "expired" in str(error) and "AWS_SESSION_TOKEN" in str(error), (name, error)
        assert "IRSA" in str(error), (name, error)  # what to give a long job instead
        assert "from 'env'" in str(error), (name, error)  # where these keys came from (conftest's variables)
        if "HEAD " not in str(error):
            assert "ExpiredToken" in str(error), (name, error)


@pytest.mark.parametrize("guarded", ["s3"], indirect=True)
def test_a_head_refused_400_does_not_blame_expiry_on_keys_that_cannot_expire(
    guarded: tuple[Storage, FaultProxy], tmp_path: Path
) -> None:
    """Only temporary credentials (with a session token) expire. A HEAD's bare 400 under fixed keys
    (the test's, no token) does not send the user after expired credentials it cannot have."""
    storage, proxy = guarded
    storage.put_bytes("step-000000001/MANIFEST.json", b"{}")
    proxy.fail(1000, 400, code="ExpiredToken", message="The provided token has expired.")
    heads = {name: e for name, e in battery(storage, tmp_path).items() if "HEAD " in str(e)}
    assert heads, "the battery makes no HEAD request"
    for name, error in heads.items():
        assert isinstance(error, PermanentStorageError), (name, error)
        assert "expired" not in str(error), (name, error)


@pytest.mark.parametrize("guarded", ["gs"], indirect=True)
def test_a_gcs_request_refused_for_credentials_that_are_no_longer_valid_does_not_blame_permissions(
    guarded: tuple[Storage, FaultProxy], tmp_path: Path
) -> None:
    """GCS answers 401 ``Invalid Credentials`` to a token that is expired or revoked (the client has
    already refreshed once and retried by then): a service account key deleted during the run, a
    workload identity binding removed. The store said "permission denied ... lack the permission on
    the bucket", sending the user to the bucket's IAM for credentials that are not valid at all.
    The fault proxy gives GCS's answer (fake-gcs-server checks no credentials)."""
    storage, proxy = guarded
    storage.put_bytes("step-000000001/MANIFEST.json", b"{}")
    refused = proxy.fail(1000, 401, code="authError", message="Invalid Credentials")
    results = battery(storage, tmp_path)
    assert refused.served >= len(results)
    for name, error in results.items():
        assert isinstance(error, PermanentStorageError) and not isinstance(error, NotFoundError), (name, error)
        assert "permission denied" not in str(error) and "not valid" in str(error), (name, error)


# GCS's messages for refusals the bucket's IAM does not cause, and what the error must then name.
_REFUSED_ELSEWHERE = {
    "cmek": (
        403,
        "Permission denied on Cloud KMS key. Please ensure that your Cloud Storage service account has been "
        "authorized to use this key.",
        "cryptoKeyEncrypterDecrypter",
    ),
    "quota-project": (
        403,
        "spotjob@example.iam.gserviceaccount.com does not have serviceusage.services.use access to the Google "
        "Cloud project.",
        "GOOGLE_CLOUD_QUOTA_PROJECT",
    ),
    "vpc-sc": (
        403,
        "Request is prohibited by organization's policy. vpcServiceControlsUniqueIdentifier: 0123456789abcdef",
        "VPC Service Controls",
    ),
    "billing": (403, "The billing account for the owning project is disabled in state closed", "billing"),
    "vm-scopes": (403, "Insufficient Permission", "access scopes"),
    "vm-scopes-older": (403, "Provided scope(s) are not authorized", "access scopes"),
    "cmek-disabled": (400, "The Cloud KMS key is disabled, destroyed, or scheduled to be destroyed.", "CMEK"),
}


@pytest.mark.parametrize("guarded", ["gs"], indirect=True)
@pytest.mark.parametrize("cause", sorted(_REFUSED_ELSEWHERE))
def test_a_gcs_refusal_the_buckets_iam_does_not_cause_names_its_cause(
    guarded: tuple[Storage, FaultProxy], tmp_path: Path, cause: str
) -> None:
    """A bucket's CMEK key the Cloud Storage service agent may not use (or a disabled key), a quota
    project the credentials may not use, a VPC Service Controls perimeter, a project whose billing
    is off, a GCE VM (or GKE node) whose access scopes make storage read-only: GCS refuses every
    request, and the store said "the Google credentials in use lack the permission on the bucket",
    sending the user to the bucket's IAM, where nothing is wrong. The fault proxy gives GCS's
    answer (fake-gcs-server has no IAM, KMS, perimeters, scopes or billing)."""
    storage, proxy = guarded
    storage.put_bytes("step-000000001/MANIFEST.json", b"{}")
    status, message, named = _REFUSED_ELSEWHERE[cause]
    refused = proxy.fail(1000, status, code="forbidden", message=message)
    results = battery(storage, tmp_path)
    assert refused.served >= len(results)
    for name, error in results.items():
        assert isinstance(error, PermanentStorageError) and not isinstance(error, NotFoundError), (name, error)
        assert named in str(error) and "lack the permission" not in str(error), (name, error)
        assert message in str(error), (name, error)  # GCS's own words stay


@pytest.mark.parametrize("guarded", ["gs"], indirect=True)
@pytest.mark.parametrize(
    ("status", "message", "said"),
    [
        (
            403,
            "spotjob@example.iam.gserviceaccount.com does not have storage.objects.create access",
            "permission denied",
        ),
        (401, "Invalid Credentials", "are not valid"),
        (
            403,
            "Object 'b/x' is subject to bucket's retention policy and cannot be deleted, overwritten or archived "
            "until 2027-01-01T00:00:00.000000-00:00",
            "the bucket keeps it",
        ),
    ],
)
def test_a_refused_chunk_of_a_gcs_resumable_upload_says_what_any_other_refused_request_says(
    guarded: tuple[Storage, FaultProxy],
    make_storage: Callable[[str], Storage],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    status: int,
    message: str,
    said: str,
) -> None:
    """A file past the multipart threshold goes up in chunks of a resumable session, whose refusals
    the store turned into a bare "HTTP 403: <message>": no "permission denied", no word on
    credentials that are not valid, and a retention policy's refusal was no ``RetainedError``.
    The fault proxy refuses the chunks (not the session's start) as GCS does."""
    storage, proxy = guarded
    monkeypatch.setenv("SPOTJOB_STORAGE_MULTIPART_THRESHOLD", str(256 * 1024))
    monkeypatch.setenv("SPOTJOB_STORAGE_UPLOAD_CHUNK_SIZE", str(256 * 1024))
    chunked = make_storage(storage.uri)
    src = tmp_path / "src.bin"
    src.write_bytes(os.urandom(600 * 1024))
    refused = proxy.fail(1000, status, code="forbidden", message=message, method="PUT", path=r"upload_id=")
    with pytest.raises(PermanentStorageError) as caught:
        chunked.put_file(str(src), "step-000000002/shard")
    assert refused.served == 1
    assert said in str(caught.value) and message in str(caught.value), caught.value
    assert "upload_id" not in str(caught.value)
    assert isinstance(caught.value, RetainedError) == (said == "the bucket keeps it")


class _MetadataServer(BaseHTTPRequestHandler):
    """The GCE metadata server's documented contract, as much of it as ``google.auth.default`` and a
    token refresh use: ``Metadata-Flavor: Google`` on every answer, the default service account's
    info and token. The first ``failures`` requests for the service account are answered 503. It
    does not model scopes, identities other than the default, or GKE's own refusals."""

    failures = 0
    requests: list[str] = []

    def log_message(self, format: str, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        type(self).requests.append(self.path)
        account = "/computeMetadata/v1/instance/service-accounts/default/"
        if self.path.startswith(account) and type(self).failures > 0:
            type(self).failures -= 1
            self._answer(503, b"")
        elif self.path.startswith(account + "token"):
            self._answer(200, json.dumps({"access_token": "t", "expires_in": 3600, "token_type": "Bearer"}).encode())
        elif self.path.startswith(account):
            self._answer(
                200, json.dumps({"email": "spotjob@test.iam.gserviceaccount.com", "aliases": ["default"]}).encode()
            )
        else:
            self._answer(200 if self.path == "/" else 404, b"")

    def _answer(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Metadata-Flavor", "Google")
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def test_gcs_credentials_the_metadata_server_could_not_refresh_for_a_while_are_retried(
    monkeypatch: pytest.MonkeyPatch, fresh_uri: Callable[[str], str], fast_retries: None, tmp_path: Path
) -> None:
    """Workload identity on GKE (and a GCE VM's service account) gets its token from the metadata
    server; google-auth retries that five times over about 15 s, then raises a RefreshError the
    store took for permanent: one metadata server blip (the node's gke-metadata-server restarting)
    failed the save, though the next request would have worked. The store runs the real ADC path
    (``google.auth.default`` finds the fake metadata server through ``GCE_METADATA_HOST``); the
    one seam patched is ``_emulator_host``, so that the client sends those credentials to
    fake-gcs-server instead of anonymous ones. google-auth's own waits between its attempts are
    skipped (its backoff module's ``time.sleep`` alone): its five attempts and its RefreshError
    are real, the 15 s are not needed to show them."""
    from google.auth import _exponential_backoff

    monkeypatch.setattr(_exponential_backoff, "time", SimpleNamespace(sleep=lambda _seconds: None))
    server = ThreadingHTTPServer(("127.0.0.1", 0), _MetadataServer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    address = f"127.0.0.1:{server.server_address[1]}"
    monkeypatch.setenv("GCE_METADATA_HOST", address)
    monkeypatch.setenv("GCE_METADATA_IP", address)
    monkeypatch.delenv("GOOGLE_APPLICATION_CREDENTIALS", raising=False)
    monkeypatch.setenv("CLOUDSDK_CONFIG", str(tmp_path / "no-gcloud"))
    uri = fresh_uri("gs")
    monkeypatch.setattr(gs, "_emulator_host", lambda: None)
    _MetadataServer.failures, _MetadataServer.requests = 5, []  # 5: google-auth's attempts for one refresh
    storage = open_storage(uri)
    try:
        storage.put_bytes("step-000000001/MANIFEST.json", b"{}")
        assert storage.get_bytes("step-000000001/MANIFEST.json") == b"{}"
    finally:
        storage.close()
        server.shutdown()
    assert _MetadataServer.failures == 0
    assert any(p.endswith("/token") or "/token?" in p for p in _MetadataServer.requests)


_CREDENTIAL_PROCESS = """
import datetime, os, sys
folder = sys.argv[1]
with open(os.path.join(folder, "calls"), "a") as f:
    f.write("call\\n")
if os.path.exists(os.path.join(folder, "revoked")):
    sys.exit("the role's session was revoked")
ends = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(minutes=2)
print('{"Version": 1, "AccessKeyId": "AKIAEXAMPLE", "SecretAccessKey": "s", "SessionToken": "t", '
      '"Expiration": "%s"}' % ends.strftime("%Y-%m-%dT%H:%M:%SZ"))
"""


def test_renewable_s3_credentials_are_renewed_in_the_same_store_and_a_failed_renewal_says_why(
    fresh_uri: Callable[[str], str],
    make_storage: Callable[[str], Storage],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    """(Pins behaviour that already worked.) A store is built once and used for days: credentials
    from a source that renews them (here a real ``credential_process`` handing out keys that end in
    two minutes, inside botocore's refresh window) must be fetched again as they near their end, not
    frozen at construction; once the source fails, what the user sees names the source's own
    reason. moto accepts any keys, so only the renewals are observed, not a refusal."""
    uri = fresh_uri("s3")
    script = tmp_path / "creds.py"
    script.write_text(_CREDENTIAL_PROCESS)
    config = tmp_path / "config"
    config.write_text(f"[default]\ncredential_process = {sys.executable} {script} {tmp_path}\n")
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(config))
    storage = make_storage(uri)
    for n in range(3):
        storage.put_bytes(f"step-000000001/{n}", b"x")
    assert len((tmp_path / "calls").read_text().split()) >= 3, "the credentials were not renewed"
    (tmp_path / "revoked").touch()
    with pytest.raises(PermanentStorageError, match="the role's session was revoked"):
        storage.put_bytes("step-000000001/late", b"x")


# -- a missing bucket -----------------------------------------------------------------------------


@pytest.mark.parametrize("scheme", ["s3", "gs"])
def test_a_missing_bucket_is_named_by_every_operation_never_read_as_a_missing_key(
    scheme: str, request: pytest.FixtureRequest, make_storage: Callable[[str], Storage], tmp_path: Path
) -> None:
    request.getfixturevalue("moto_server" if scheme == "s3" else "gcs_server")
    storage = make_storage(f"{scheme}://spotjob-no-such-bucket/jobs/run1")
    results = battery(storage, tmp_path)
    for name, error in results.items():
        assert isinstance(error, MissingBucketError), (name, error)
        assert not isinstance(error, NotFoundError)
        assert "'spotjob-no-such-bucket' does not exist" in str(error) and "create it" in str(error), name


def test_an_s3_endpoint_that_is_no_s3_api_is_named_with_the_bucket_not_read_as_no_such_object(
    gcs_server: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """AWS_ENDPOINT_URL at another server's port (here fake-gcs-server's) answers the listing a bare
    404: ``spotjob ckpt list`` said "LIST ...: no such object", naming neither the bucket nor the
    endpoint. A missing bucket at a chosen endpoint also names the endpoint, which may be the slip."""
    for name, value in {
        "AWS_ENDPOINT_URL": gcs_server,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_REGION": "us-east-1",
        "AWS_CONFIG_FILE": os.devnull,
        "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
        "SPOTJOB_STORAGE_MAX_ATTEMPTS": "1",
    }.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    storage = open_storage("s3://spotjob-walk/run")
    try:
        with pytest.raises(MissingBucketError) as raised:
            storage.list_dirs("")
    finally:
        storage.close()
    said = str(raised.value)
    assert "the bucket 'spotjob-walk' does not exist" in said, said
    assert f"or AWS_ENDPOINT_URL (the requests went to {gcs_server})" in said, said


def test_a_store_that_cannot_even_be_opened_is_a_storage_refused_error_from_the_checkpointer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The README promises ``StorageRefusedError`` for a store that refuses for good "here or already
    at Checkpointer(...)": a store with nothing to start with (here an AWS profile that does not
    exist; likewise no Google credentials) escaped as the store layer's PermanentStorageError."""
    from agent.checkpoint import Checkpointer, StorageRefusedError

    monkeypatch.setenv("AWS_PROFILE", "spotjob-no-such-profile")
    monkeypatch.setenv("AWS_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)
    with pytest.raises(StorageRefusedError, match=r"s3://b/run refuses this job: .*spotjob-no-such-profile"):
        Checkpointer("s3://b/run")


@pytest.mark.parametrize("scheme", ["s3", "gs"])
def test_a_local_file_that_cannot_be_read_or_written_is_a_storage_error(
    scheme: str, fresh_uri: Callable[[str], str], make_storage: Callable[[str], Storage], tmp_path: Path
) -> None:
    storage = make_storage(fresh_uri(scheme))
    with pytest.raises(PermanentStorageError, match=r"cannot read the local file .*nope"):
        storage.put_file(str(tmp_path / "nope"), "k")
    storage.put_bytes("k", b"abc")
    with pytest.raises(PermanentStorageError, match="cannot write the local file"):
        storage.get_file("k", str(tmp_path / "no-such-folder" / "out"))
    assert not (tmp_path / "no-such-folder").exists()


def test_a_file_stores_local_file_errors_name_the_local_file(tmp_path: Path) -> None:
    storage = open_storage(str(tmp_path / "ckpt"))
    with pytest.raises(PermanentStorageError, match=r"cannot read the local file .*nope"):
        storage.put_file(str(tmp_path / "nope"), "k")
    storage.put_bytes("k", b"abc")
    with pytest.raises(PermanentStorageError, match="cannot write the local file") as e:
        storage.get_file("k", str(tmp_path / "no-such-folder" / "out"))
    assert not isinstance(e.value, NotFoundError), "the stored key exists; the destination is the problem"


# -- credentials in debug logs ------------------------------------------------------------------


@pytest.mark.parametrize("scheme", ["s3", "gs"])
def test_debug_logs_of_spotjobs_commands_blank_the_credentials_the_clients_log(
    scheme: str,
    fresh_uri: Callable[[str], str],
    make_storage: Callable[[str], Storage],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    """At debug level (``-v``, ``SPOTJOB_LOG_LEVEL=debug``) botocore logs each request's headers,
    an STS session token among them, and urllib3 each URL, a GCS resumable session's ``upload_id``
    (a bearer capability: whoever has it may write the object) among them. The formatter of
    spotjob's own commands (``log_to_stderr``) blanks them; the lines stay. moto accepts any
    session token and fake-gcs-server needs no OAuth token, so those two are what is checked, and
    for S3 an endpoint behind basic auth (``http://user:password@host``), whose URL botocore's debug
    lines repeat whole."""
    uri = fresh_uri(scheme)  # starts the server, which clears AWS_SESSION_TOKEN
    monkeypatch.setenv("AWS_SESSION_TOKEN", "FwoGZXIvYXdzEXAMPLESESSIONTOKEN")
    if scheme == "s3":
        endpoint = os.environ["AWS_ENDPOINT_URL"]
        monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint.replace("://", "://proxyuser:EXAMPLEPASSWORD@", 1))
    big = tmp_path / "shard"
    big.write_bytes(os.urandom(9 * 1024 * 1024))  # over GCS's simple upload limit: a resumable session
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(UtcFormatter("%(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    old_level = root.level
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)
    try:
        make_storage(uri).put_file(str(big), "step-000000001/shard")
    finally:
        root.removeHandler(handler)
        root.setLevel(old_level)
    text = out.getvalue()
    if scheme == "s3":
        assert "X-Amz-Security-Token': b'<redacted>'" in text and "'Authorization': b'<redacted>'" in text, text
        assert "EXAMPLESESSIONTOKEN" not in text and "Signature=" not in text
        assert "EXAMPLEPASSWORD" not in text and "://<redacted>@127.0.0.1" in text, text
    else:
        assert "upload_id=<redacted>" in text, text
        assert not re.search(r"upload_id=(?!<redacted>)", text), text
