"""Shared fixtures: real storage servers on loopback, and a fresh store per test.

Servers (session-scoped, started on first use, loopback only):

- ``moto_server``: moto's S3 in server mode on a free port. Sets ``AWS_ENDPOINT_URL`` and fake
  credentials in ``os.environ`` so boto3 here and in child processes (torchrun ranks, agents)
  reach it; a developer's own AWS config is kept out.
- ``gcs_server``: fake-gcs-server (a bundled Go binary). Sets ``STORAGE_EMULATOR_HOST`` (and
  ``GOOGLE_CLOUD_PROJECT=test``) for this process and its children.

Per test:

- ``storage_uri``: parametrized over ``file``, ``s3``, ``gs``; a URI rooted in a fresh bucket (or
  a fresh ``tmp_path`` folder), e.g. ``s3://spotjob-3f2a…/jobs/run1``. A test that takes it runs
  once per backend; only the servers a test needs are started.
- ``s3_client`` / ``gcs_client``: plain clients on those servers, to arrange state behind
  spotjob's back (session-scoped; they start their server).
- ``fresh_uri``: ``fresh_uri("s3")`` makes another such URI inside a test.
- ``make_storage``: ``make_storage(uri)`` opens a store like ``agent.storage.open_storage`` and
  closes it after the test.
- ``fast_retries``: tiny backoff and few attempts, for tests that provoke retries.
- ``fault_proxy``: ``fault_proxy(upstream_url, dialect)`` starts a ``tests/faults.py`` proxy,
  stopped after the test.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from agent.storage import Storage, open_storage

try:
    from faults import Dialect, FaultProxy
except ImportError:  # tests/ collected as a package
    from tests.faults import Dialect, FaultProxy

# Kept out of the test servers' environment: a developer's profile, SSO or region would otherwise
# leak into boto3's credential chain; IMDS is never consulted.
_AWS_ISOLATION = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_REGION": "us-east-1",
    "AWS_CONFIG_FILE": os.devnull,
    "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
    "AWS_EC2_METADATA_DISABLED": "true",
}
_AWS_REMOVED = ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN", "AWS_ENDPOINT_URL_S3")


# Folders whose tests share one server or one audit log across files and check it as a whole
# (the RBAC drift test reads every e2e_k8s scenario's requests; the plugin's RBAC test every plugin
# call): under pytest-xdist (``--dist loadfile``) each runs on one worker, in order. Every other
# file is one unit, as loadfile makes it: its module fixtures are set up once and its tests keep
# their order (e.g. Terraform's destroy last). xdist's own ``loadgroup`` cannot be used: with
# pytest 9 its ``xdist_group`` marks no longer reach the scheduler.
_ONE_WORKER_FOLDERS = frozenset({"e2e_k8s", "k8s_plugin", "scale"})


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class FileOrFolder(LoadScopeScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            parts = path.split("/")
            if len(parts) > 2 and parts[0] == "tests" and parts[1] in _ONE_WORKER_FOLDERS:
                return "/".join(parts[:2])
            return path

    return FileOrFolder(config, log)


def _set_env(values: dict[str, str], removed: tuple[str, ...] = ()) -> Callable[[], None]:
    """Set (and remove) variables in os.environ; return a function that restores them."""
    saved = {k: os.environ.get(k) for k in (*values, *removed)}
    os.environ.update(values)
    for k in removed:
        os.environ.pop(k, None)

    def restore() -> None:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v

    return restore


@pytest.fixture(autouse=True)
def _logger_levels_restored() -> Iterator[None]:
    """Put every logger's level back after each test. spotjob's commands, run in-process by tests,
    quiet the cloud clients' loggers (``botocore``, ``urllib3``, ...) for the process, as a command
    should; without this, a later test on the same worker that logs at debug level sees nothing
    from them, and whether it does depends on which files xdist gave that worker."""
    manager = logging.Logger.manager
    before = {name: lg.level for name, lg in manager.loggerDict.items() if isinstance(lg, logging.Logger)}
    root_level = logging.getLogger().level
    disabled = manager.disable
    yield
    for name, lg in list(manager.loggerDict.items()):
        if isinstance(lg, logging.Logger):
            lg.setLevel(before.get(name, logging.NOTSET))
    logging.getLogger().setLevel(root_level)
    logging.disable(disabled)


@pytest.fixture(scope="session")
def moto_server() -> Iterator[str]:
    """moto's S3 on 127.0.0.1:<free port>; yields its endpoint URL (also in AWS_ENDPOINT_URL)."""
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # one line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    restore = _set_env({**_AWS_ISOLATION, "AWS_ENDPOINT_URL": endpoint}, _AWS_REMOVED)
    try:
        yield endpoint
    finally:
        restore()
        server.stop()


@pytest.fixture(scope="session")
def gcs_server() -> Iterator[str]:
    """fake-gcs-server on 127.0.0.1:<free port>; yields its URL (also in STORAGE_EMULATOR_HOST).

    Started by the benchmarks' ``start_fake_gcs``: under pytest-xdist two workers can pick the same
    port, the second server exits while the first answers its readiness check, so it checks that
    our own process holds the listening socket and otherwise retries on another port."""
    from bench._common import start_fake_gcs

    server = start_fake_gcs()
    # The wrapper pipes the server's stderr, where it logs every request, and never reads it:
    # once the pipe buffer (64 KiB) fills, the server blocks mid-request. Drain it, keeping the
    # tail for diagnostics.
    tail: collections.deque[bytes] = collections.deque(maxlen=200)
    proc: Any = server._process
    drain = threading.Thread(target=lambda: tail.extend(iter(proc.stderr.readline, b"")), daemon=True)
    drain.start()
    restore = _set_env({"GOOGLE_CLOUD_PROJECT": "test"})
    try:
        yield server.url
    finally:
        restore()
        server.stop()  # also removes STORAGE_EMULATOR_HOST


@pytest.fixture(scope="session")
def s3_client(moto_server: str) -> Any:
    """A plain boto3 S3 client on moto, for arranging state behind spotjob's back."""
    import boto3

    return boto3.session.Session().client("s3", endpoint_url=moto_server)


@pytest.fixture(scope="session")
def gcs_client(gcs_server: str) -> Iterator[Any]:
    """A plain google-cloud-storage client on fake-gcs-server, for arranging state behind
    spotjob's back."""
    from google.cloud import storage

    client = storage.Client(project="test")
    yield client
    client.close()


def _unique_bucket() -> str:
    return f"spotjob-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def fresh_uri(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], str]:
    """``fresh_uri(scheme)``: a URI on a new, empty bucket (``s3``, ``gs``) or folder (``file``).

    Starts the server the scheme needs; buckets are created directly on it.
    """

    def make(scheme: str) -> str:
        if scheme == "s3":
            bucket = _unique_bucket()
            request.getfixturevalue("s3_client").create_bucket(Bucket=bucket)
            return f"s3://{bucket}/jobs/run1"
        if scheme == "gs":
            bucket = _unique_bucket()
            request.getfixturevalue("gcs_client").create_bucket(bucket)
            return f"gs://{bucket}/jobs/run1"
        if scheme == "file":
            # Outside the test's own tmp_path, which stays the test's local scratch space.
            return str(tmp_path_factory.mktemp("ckpt"))
        raise ValueError(f"unknown storage scheme {scheme!r}")

    return make


@pytest.fixture(params=["file", "s3", "gs"])
def storage_uri(request: pytest.FixtureRequest, fresh_uri: Callable[[str], str]) -> str:
    """A checkpoint URI on a fresh, empty bucket (or folder), once per backend."""
    return fresh_uri(request.param)


@pytest.fixture
def make_storage() -> Iterator[Callable[[str], Storage]]:
    """``make_storage(uri)``: ``open_storage(uri)``, closed when the test ends."""
    opened: list[Storage] = []

    def make(uri: str) -> Storage:
        storage = open_storage(uri)
        opened.append(storage)
        return storage

    yield make
    for storage in opened:
        storage.close()


@pytest.fixture
def fast_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    """Five attempts, millisecond backoff: retry tests run fast and give up fast."""
    monkeypatch.setenv("SPOTJOB_STORAGE_MAX_ATTEMPTS", "5")
    monkeypatch.setenv("SPOTJOB_STORAGE_BASE_BACKOFF_S", "0.001")
    monkeypatch.setenv("SPOTJOB_STORAGE_MAX_BACKOFF_S", "0.005")


@pytest.fixture
def fault_proxy() -> Iterator[Callable[[str, Dialect], FaultProxy]]:
    """``fault_proxy(upstream_url, dialect)``: a started ``FaultProxy``, stopped after the test."""
    started: list[FaultProxy] = []

    def start(upstream: str, dialect: Dialect) -> FaultProxy:
        proxy = FaultProxy(upstream, dialect=dialect).start()
        started.append(proxy)
        return proxy

    yield start
    for proxy in started:
        proxy.stop()
