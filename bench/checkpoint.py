"""Checkpoint benchmark: spotjob's Checkpointer next to torch.save, plain DCP and the raw floor.

For each state size (a model of plain ``nn.Linear`` layers plus Adam after one step: Adam's two
moments make the state about 3x the parameters) and each backend (filesystem; S3 served by moto
on loopback; GCS served by fake-gcs-server on loopback), every repetition measures, in this order
and in the same process:

- baselines: ``torch.save`` of the full state to one file with fsync, and ``torch.load`` of it
  (cold page cache, then warm: the warm one is "deserialise"); plain ``dcp.save`` /
  ``dcp.load`` with ``FileSystemWriter`` / ``FileSystemReader``; the floor: the state's bytes
  written raw to one file with fsync and read back cold (filesystem), or ``upload_file`` /
  ``download_file`` of a file of that many bytes with boto3 (S3), or google-cloud-storage's own
  chunked resumable upload and ``transfer_manager.download_chunks_concurrently`` of it (GCS);
- the Checkpointer: ``step()`` with ``async_save=False`` (the whole save), ``restore()`` into a
  fresh model and optimizer (cold page cache), and ``step()`` with async saves (how long it
  blocks) followed by ``wait()`` (``last_save_seconds``: from the save call to the commit);
- diagnostics (filesystem only): the pieces an async save is made of, timed alone.

Single process, no ``torch.distributed``: one rank writes one shard file. On a 2-core machine more
ranks would only share the same two cores and disk, so one rank is the honest measurement here.

``--device cuda`` puts the model and Adam's state on the current GPU (restores go into a model on
it too): the floor of the async blocking is then a device-to-host copy into pinned host buffers
that exist, and every timing of work on device tensors synchronises the device before and after.
The report names the device (``torch.cuda.get_device_name``). The default, ``cpu``, is unchanged.

``--many-layers N`` measures instead a state of N small Linear layers (8 tensors each) against plain
DCP, where per-tensor and per-save costs dominate (``run_many``); ``--profile`` adds a cProfile of it,
``--gc-loop`` saves back to back with the garbage collections inside each (``gc_loop_saves``).

Run ``python -m bench.checkpoint --help``; results go to ``bench/out/checkpoint-*.json`` and a
Markdown rendering to ``bench/out/checkpoint-latest.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from typing import Any, TypeVar

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.utils.serialization import config as serialization_config

from agent.checkpoint import Checkpointer
from bench._common import (
    GB,
    OUT_DIR,
    FullCollections,
    MiB,
    Samples,
    child_peak_rss_bytes,
    current_rss_bytes,
    describe_machine,
    drop_from_page_cache,
    fake_gcs_server,
    fmt_bytes,
    log,
    measure,
    moto_s3_server,
    peak_rss_bytes,
    remove,
    reset_peak_rss,
    s3_environment,
    s3_floor_transfer,
    sizes_gb,
    tree_bytes,
    write_results,
)

warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")

T = TypeVar("T")


def layer_width(size_gb: float) -> int:
    """Features of every Linear layer; the number of layers then sets the state's size.

    Layers widen with the state, as in real models: 4096x4096 fp32 weights (67 MB) from 0.5 GB
    on. That size matters: glibc serves blocks above 32 MB with fresh ``mmap``s, so a new staging
    copy of such tensors pays a page fault per 4 KiB on every save, while smaller ones are
    recycled from the heap.
    """
    return 4096 if size_gb >= 0.5 else 2048


S3_BUCKET = "spotjob-bench"
GS_BUCKET = "spotjob-bench"

TARGETS = {
    "async_block_vs_sync": 0.05,
    "commit_vs_floor.file": 1.25,
    "commit_vs_floor.s3": 1.5,
    "commit_vs_floor.gs": 1.5,
    "restore_vs_floor": 1.25,
}
"""From the issue: async step() blocks <= 5% of a sync save; commit <= 1.25x (file) / 1.5x (S3) the
raw floor (GCS: as S3); restore <= 1.25x the raw read/download plus deserialisation."""


# -- the workload ------------------------------------------------------------------------------
def build_model(layers: int, width: int) -> nn.Sequential:
    return nn.Sequential(*(nn.Linear(width, width) for _ in range(layers)))


@dataclass
class Workload:
    """A model and its Adam optimizer with state, about ``size_gb`` GB of tensors together."""

    size_gb: float
    layers: int
    width: int
    model: nn.Sequential
    optim: torch.optim.Adam
    state_bytes: int
    tensor_count: int
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    """Where the model and the optimizer's state live (``--device``)."""

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def measure(self, samples: Samples, fn: Callable[[], T]) -> T:
        """``bench._common.measure`` of ``fn``; on a GPU with the device synchronised before and after
        it, so that work still queued on the device is timed where it belongs (a copy enqueued with
        ``non_blocking=True`` returns before the bytes moved)."""
        if not self.cuda:
            return measure(samples, fn)
        torch.cuda.synchronize(self.device)

        def synced() -> T:
            out = fn()
            torch.cuda.synchronize(self.device)
            return out

        return measure(samples, synced)

    def host_tensors(self) -> list[torch.Tensor]:
        """The state's tensors in host memory: themselves on CPU, copies of them from a GPU."""
        tensors = state_tensors(self.model, self.optim)
        return [t.cpu() for t in tensors] if self.cuda else tensors

    def state(self) -> dict[str, Any]:
        """What the training script hands the Checkpointer."""
        return {"model": self.model, "optim": self.optim}

    def plain_state_dict(self) -> dict[str, Any]:
        """What a script hands ``torch.save``."""
        return {"model": self.model.state_dict(), "optim": self.optim.state_dict()}

    def fresh(self) -> tuple[nn.Sequential, torch.optim.Adam]:
        """A model of the same shape (memory allocated, not initialised) and an optimizer with no state.

        What a restarted job has before it restores. Allocation is outside every timing; first
        touch of the pages is inside, the same for every restore method.
        """
        with torch.device("meta"):
            model = build_model(self.layers, self.width)
        model.to_empty(device=self.device)
        return model, torch.optim.Adam(model.parameters(), lr=1e-3)

    def check_restored(self, model: nn.Module, optim: torch.optim.Optimizer, what: str) -> None:
        """Raise unless a restored copy holds the same first/last weights and Adam moments."""
        src = list(self.model.parameters())
        dst = list(model.parameters())
        for i in (0, len(src) - 1):
            if not torch.equal(src[i], dst[i]):
                raise AssertionError(f"{what}: parameter {i} differs after restore")
            for name in ("exp_avg", "exp_avg_sq", "step"):
                if not torch.equal(self.optim.state[src[i]][name], optim.state[dst[i]][name]):
                    raise AssertionError(f"{what}: Adam {name} of parameter {i} differs after restore")


def build_workload(size_gb: float, width: int, device: torch.device | None = None) -> Workload:
    device = device or torch.device("cpu")
    per_layer = 3 * 4 * (width * width + width)  # fp32 weight + bias, and Adam's two moments
    layers = max(1, round(size_gb * GB / per_layer))
    torch.manual_seed(0)
    if device.type == "cpu":
        model = build_model(layers, width)
    else:
        with device:  # parameters made (and initialised) on the device, Adam's state follows them
            model = build_model(layers, width)
    optim = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(4, width, device=device)).square().mean().backward()
    optim.step()
    optim.zero_grad(set_to_none=True)  # a checkpoint does not hold gradients; free them
    tensors = state_tensors(model, optim)
    return Workload(
        size_gb=size_gb,
        layers=layers,
        width=width,
        model=model,
        optim=optim,
        state_bytes=sum(t.numel() * t.element_size() for t in tensors),
        tensor_count=len(tensors),
        device=device,
    )


def state_tensors(model: nn.Module, optim: torch.optim.Optimizer) -> list[torch.Tensor]:
    out = [t for t in model.state_dict().values() if isinstance(t, torch.Tensor)]
    for per_param in optim.state.values():
        out.extend(t for t in per_param.values() if isinstance(t, torch.Tensor))
    return out


# -- the floor and the baselines ---------------------------------------------------------------
def write_raw(path: str, tensors: list[torch.Tensor]) -> None:
    """The state's bytes, as they sit in memory, to one file, fsynced: the floor of any save."""
    with open(path, "wb", buffering=0) as f:
        for t in tensors:
            view = memoryview(t.detach().reshape(-1).view(torch.uint8).numpy().data)
            while view:
                view = view[f.write(view) :]
        os.fsync(f.fileno())


def read_raw(path: str) -> int:
    """Read a file through one reusable buffer: the floor of any restore's I/O."""
    buf = bytearray(64 * MiB)
    view = memoryview(buf)
    total = 0
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(view):
            total += n
    return total


def torch_save(path: str, state_dict: dict[str, Any]) -> None:
    with open(path, "wb") as f:
        torch.save(state_dict, f)
        f.flush()
        os.fsync(f.fileno())


def torch_load_into(path: str, model: nn.Module, optim: torch.optim.Optimizer) -> None:
    loaded = torch.load(path, weights_only=True)
    model.load_state_dict(loaded["model"])
    optim.load_state_dict(loaded["optim"])


def dcp_save(path: str, model: nn.Module, optim: torch.optim.Optimizer) -> None:
    model_sd, optim_sd = get_state_dict(model, optim)
    dcp.save({"model": model_sd, "optim": optim_sd}, storage_writer=dcp.FileSystemWriter(path), no_dist=True)


def dcp_load_into(path: str, model: nn.Module, optim: torch.optim.Optimizer) -> None:
    model_sd, optim_sd = get_state_dict(model, optim)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, storage_reader=dcp.FileSystemReader(path), no_dist=True)
    set_state_dict(model, optim, model_state_dict=model_sd, optim_state_dict=optim_sd)


# -- the run -----------------------------------------------------------------------------------
@dataclass
class SizeResult:
    size_gb: float
    layers: int
    width: int
    state_bytes: int
    tensor_count: int
    repeat: int
    committed_bytes: dict[str, int] = field(default_factory=dict)
    ops: dict[str, Samples] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    server_peak_rss: dict[str, int] = field(default_factory=dict)
    """Peak resident bytes of a store's server process during this size (gs: fake-gcs-server)."""
    gc_loop: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    """With ``--gc-loop``: each save of the untimed loop, by kind (``sync``, ``async``)."""

    def samples(self, name: str) -> Samples:
        return self.ops.setdefault(name, Samples())

    def median(self, name: str) -> float | None:
        s = self.ops.get(name)
        return s.median if s and s.seconds else None

    def to_json(self) -> dict[str, Any]:
        return {
            "size_gb": self.size_gb,
            "layers": self.layers,
            "width": self.width,
            "state_bytes": self.state_bytes,
            "tensor_count": self.tensor_count,
            "repeat": self.repeat,
            "committed_bytes": self.committed_bytes,
            "skipped": self.skipped,
            "server_peak_rss_bytes": self.server_peak_rss,
            "ops": {k: v.to_json() for k, v in self.ops.items()},
            **({"gc_loop": self.gc_loop} if self.gc_loop else {}),
        }


class CheckpointBench:
    """One benchmark run: every size, every backend, ``repeat`` times, repetition-major."""

    def __init__(self, args: argparse.Namespace, scratch: str) -> None:
        self.args = args
        self.scratch = scratch
        self.s3: Any = None
        self.transfer_config: Any = None
        self.download_config: Any = None
        self.gcs: Any = None
        """google-cloud-storage's client on fake-gcs-server (``_gs_if``)."""
        self.gcs_settings: Any = None
        """spotjob's ``TransferSettings`` in force: the GCS floor's chunk and part sizes."""
        self.gcs_server_pid: int | None = None
        """fake-gcs-server's process, whose peak memory each size records."""

    # -- one size --------------------------------------------------------------------------
    def run_size(self, size_gb: float, backends: list[str], width: int | None = None) -> SizeResult:
        log("building a %.2f GB state (model + Adam)", size_gb)
        w = build_workload(size_gb, width or layer_width(size_gb), torch.device(self.args.device))
        repeat = self.args.repeat_large if size_gb >= self.args.large_gb else self.args.repeat
        result = SizeResult(size_gb, w.layers, w.width, w.state_bytes, w.tensor_count, repeat)
        log(
            "state: %s in %d tensors (%d Linear layers of %dx%d); %d repetitions",
            fmt_bytes(w.state_bytes),
            w.tensor_count,
            w.layers,
            w.width,
            w.width,
            repeat,
        )
        if "s3" in backends and size_gb > self.args.s3_max_gb:
            result.skipped["s3"] = (
                f"state larger than --s3-max-gb={self.args.s3_max_gb}: moto answers each ranged GET by "
                "reading the whole object into memory (and assembles multipart uploads in memory), so "
                "it cannot serve multi-GB objects in parallel ranges on this machine"
            )
            log("S3: skipped: %s", result.skipped["s3"])
            backends = [b for b in backends if b != "s3"]
        if "gs" in backends and size_gb > self.args.gs_max_gb:
            result.skipped["gs"] = (
                f"state larger than --gs-max-gb={self.args.gs_max_gb}: fake-gcs-server keeps a resumable "
                "upload's chunks in memory until it ends, and reads a whole object to answer each ranged GET"
            )
            log("GCS: skipped: %s", result.skipped["gs"])
            backends = [b for b in backends if b != "gs"]
        size_dir = os.path.join(self.scratch, f"{size_gb:g}gb")
        os.makedirs(size_dir, exist_ok=True)
        with contextlib.ExitStack() as stack:
            stack.callback(remove, size_dir)
            checkpointers: dict[str, Checkpointer] = {}
            stack.callback(self._close_all, checkpointers)
            raw_for_store = os.path.join(size_dir, "raw-for-store.bin")
            if "s3" in backends or "gs" in backends:
                write_raw(raw_for_store, w.host_tensors())
            if "s3" in backends:
                stack.callback(self._empty_bucket)
            if "gs" in backends:
                stack.callback(self._empty_gcs_bucket)
                if self.gcs_server_pid is not None and reset_peak_rss(self.gcs_server_pid):
                    stack.callback(self._record_server_peak, result, "gs", self.gcs_server_pid)
            for r in range(repeat):
                log("%.2f GB: repetition %d/%d", size_gb, r + 1, repeat)
                step = 2 * (r + 1)  # the odd steps are left for the first async save (_checkpointer)
                self._torch_baselines(w, result, size_dir)
                if "file" in backends:
                    self._file_floor(w, result, size_dir)
                    self._dcp_baseline(w, result, size_dir)
                    root = os.path.join(size_dir, "ckpt")
                    self._checkpointer(w, result, "file", root, None, step, checkpointers)
                    self._memcpy_floor(w, result)
                    self._released(w, result, root, None, step, checkpointers)
                    self._diagnostics(w, result, root)
                if "s3" in backends:
                    self._s3_floor(w, result, size_dir, raw_for_store)
                    uri = f"s3://{S3_BUCKET}/{size_gb:g}gb"
                    staging = os.path.join(size_dir, "s3-staging")
                    self._checkpointer(w, result, "s3", uri, staging, step, checkpointers)
                if "gs" in backends:
                    self._gs_floor(w, result, size_dir, raw_for_store)
                    uri = f"gs://{GS_BUCKET}/{size_gb:g}gb"
                    staging = os.path.join(size_dir, "gs-staging")
                    self._checkpointer(w, result, "gs", uri, staging, step, checkpointers)
                gc.collect()
        del w
        gc.collect()
        return result

    @staticmethod
    def _close_all(checkpointers: dict[str, Checkpointer]) -> None:
        for ck in checkpointers.values():
            ck.close()
            ck.storage.close()

    # -- baselines ---------------------------------------------------------------------------
    def _torch_baselines(self, w: Workload, result: SizeResult, size_dir: str) -> None:
        path = os.path.join(size_dir, "torch-save.pt")
        w.measure(result.samples("torch.save"), lambda: torch_save(path, w.plain_state_dict()))
        result.committed_bytes["torch.save"] = os.path.getsize(path)
        for name in ("torch.load.cold", "deserialise"):
            if name.endswith("cold"):
                drop_from_page_cache(path)
            model, optim = w.fresh()
            w.measure(result.samples(name), partial(torch_load_into, path, model, optim))
            w.check_restored(model, optim, name)
            del model, optim
            gc.collect()
        remove(path)

    def _file_floor(self, w: Workload, result: SizeResult, size_dir: str) -> None:
        path = os.path.join(size_dir, "raw.bin")
        tensors = w.host_tensors()  # from a GPU: copied to host memory first, outside the timing
        w.measure(result.samples("file.floor.write"), lambda: write_raw(path, tensors))
        drop_from_page_cache(path)
        got = w.measure(result.samples("file.floor.read.cold"), lambda: read_raw(path))
        assert got == w.state_bytes, (got, w.state_bytes)
        remove(path)

    def _dcp_baseline(self, w: Workload, result: SizeResult, size_dir: str) -> None:
        dcp_round_trip(w, result, os.path.join(size_dir, "dcp"), "file")

    def _s3_floor(self, w: Workload, result: SizeResult, size_dir: str, raw: str) -> None:
        key = f"floor/{w.size_gb:g}gb.bin"
        measure(
            result.samples("s3.floor.upload"),
            lambda: self.s3.upload_file(raw, S3_BUCKET, key, Config=self.transfer_config),
        )
        local = os.path.join(size_dir, "raw-downloaded.bin")
        measure(
            result.samples("s3.floor.download"),
            lambda: self.s3.download_file(S3_BUCKET, key, local, Config=self.download_config),
        )
        assert os.path.getsize(local) == w.state_bytes
        remove(local)
        self.s3.delete_object(Bucket=S3_BUCKET, Key=key)

    def _gs_floor(self, w: Workload, result: SizeResult, size_dir: str, raw: str) -> None:
        """The same bytes up and down with google-cloud-storage's plain client and no checksum work.

        Up: a resumable upload in chunks of spotjob's ``upload_chunk_size`` (100 MiB), sent one
        after another, as spotjob's are. The library's parallel chunked upload
        (``transfer_manager.upload_chunks_concurrently``) speaks GCS's XML multipart API, which
        fake-gcs-server lacks, so it cannot be the floor here. Down:
        ``transfer_manager.download_chunks_concurrently`` in ranges of spotjob's ``part_size``
        (64 MiB), ``concurrency`` (8) threads at once, no CRC32C; it first reads the object's
        metadata (one GET) for its size and generation, which is timed with it.
        """
        from google.cloud.storage import transfer_manager

        settings = self.gcs_settings
        bucket = self.gcs.bucket(GS_BUCKET)
        key = f"floor/{w.size_gb:g}gb.bin"

        def upload() -> None:
            blob = bucket.blob(key, chunk_size=_gcs_chunk(settings.upload_chunk_size))
            blob.upload_from_filename(raw, checksum=None)

        measure(result.samples("gs.floor.upload"), upload)
        local = os.path.join(size_dir, "raw-downloaded.bin")

        def download() -> None:
            transfer_manager.download_chunks_concurrently(
                bucket.blob(key),
                local,
                chunk_size=settings.part_size,
                max_workers=settings.concurrency,
                worker_type=transfer_manager.THREAD,
                crc32c_checksum=False,
            )

        measure(result.samples("gs.floor.download"), download)
        assert os.path.getsize(local) == w.state_bytes
        remove(local)
        bucket.blob(key).delete()

    # -- the Checkpointer --------------------------------------------------------------------
    def _checkpointer(
        self,
        w: Workload,
        result: SizeResult,
        backend: str,
        uri: str,
        staging: str | None,
        step: int,
        checkpointers: dict[str, Checkpointer],
    ) -> None:
        state = w.state()
        # Sync: step() is the whole save, commit included.
        if f"{backend}.sync" not in checkpointers:
            checkpointers[f"{backend}.sync"] = Checkpointer(
                uri + "/sync", every_steps=1, keep=1, async_save=False, staging_dir=staging
            )
        ck = checkpointers[f"{backend}.sync"]
        w.measure(result.samples(f"{backend}.ckpt.sync.step"), lambda: ck.step(step, state))
        assert ck.last_committed_step == step and ck.last_committed_uri is not None
        # Save call → commit of the same sync save: step() without the retention that follows
        # the commit (keep=1 deletes the previous checkpoint), as the async save's commit is timed.
        result.samples(f"{backend}.ckpt.sync.commit").seconds.append(float(ck.last_save_seconds or 0.0))
        folder = ck.last_committed_uri.rsplit("/", 1)[-1]
        result.committed_bytes[f"ckpt.{backend}"] = sum(o.size for o in ck.storage.list(folder + "/"))
        local_root = ck.storage.local_path("")
        if local_root is not None:
            drop_from_page_cache(local_root)
            # The same sync save through the page cache (what it was before O_DIRECT, and what a
            # filesystem without it gets), right after the direct one.
            if f"{backend}.buffered" not in checkpointers:
                checkpointers[f"{backend}.buffered"] = Checkpointer(
                    uri + "/buffered", every_steps=1, keep=1, async_save=False, staging_dir=staging, direct_io=False
                )
            buffered = checkpointers[f"{backend}.buffered"]
            w.measure(result.samples(f"{backend}.ckpt.sync.buffered"), lambda: buffered.step(step, state))
            drop_from_page_cache(local_root)

        # Restore what the sync save committed, into a fresh model and optimizer.
        model, optim = w.fresh()
        reader = Checkpointer(uri + "/sync", keep=1, staging_dir=staging)
        try:
            got = w.measure(
                result.samples(f"{backend}.ckpt.restore.cold"),
                partial(reader.restore, {"model": model, "optim": optim}),
            )
        finally:
            reader.close()
            reader.storage.close()
        assert got == step, (got, step)
        w.check_restored(model, optim, f"{backend} Checkpointer.restore")
        del model, optim
        gc.collect()

        # Async: step() blocks while staging; the commit happens in the background.
        if f"{backend}.async" not in checkpointers:
            checkpointers[f"{backend}.async"] = Checkpointer(
                uri + "/async", every_steps=1, keep=1, async_save=True, staging_dir=staging
            )
            # A Checkpointer's first async save allocates the staging buffers every later one
            # reuses: timed on its own (step - 1), so the repetitions below are the steady state.
            self._async_save(
                checkpointers[f"{backend}.async"], state, step - 1, result, f"{backend}.ckpt.async.first", w.device
            )
        self._async_save(checkpointers[f"{backend}.async"], state, step, result, f"{backend}.ckpt.async", w.device)

    @staticmethod
    def _async_save(
        ck: Checkpointer,
        state: dict[str, Any],
        step: int,
        result: SizeResult,
        prefix: str,
        device: torch.device | None = None,
    ) -> None:
        """One async save: how long ``step()`` blocks, save call → commit, and memory. On a GPU the
        device is synchronised before the save and again right after ``step()`` returns, before the
        clock is read: a device-to-host copy still in flight counts as blocking."""
        cuda = device is not None and device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(device)
        before = current_rss_bytes()
        reset_peak_rss()
        start = time.monotonic()
        with FullCollections() as blocking_gcs:
            ck.step(step, state)
            if cuda:
                torch.cuda.synchronize(device)
            blocked = time.monotonic() - start
        with FullCollections() as later_gcs:  # the save's own thread, while ``wait()`` waits
            ck.wait()
        total = time.monotonic() - start
        peak = peak_rss_bytes()
        assert ck.last_committed_step == step
        whole = (blocking_gcs.count + later_gcs.count, blocking_gcs.seconds + later_gcs.seconds)
        for name, seconds, (gcs, gc_seconds) in (
            (f"{prefix}.step", blocked, (blocking_gcs.count, blocking_gcs.seconds)),
            (f"{prefix}.commit", ck.last_save_seconds or 0.0, whole),
            (f"{prefix}.wait_returned", total, whole),
        ):
            s = result.samples(name)
            s.seconds.append(float(seconds))
            s.peak_rss.append(peak)
            s.rss_growth.append(max(peak - before, 0))
            s.full_gcs.append(gcs)
            s.full_gc_seconds.append(gc_seconds)
        s = result.samples(f"{prefix}.last_blocking_seconds")
        s.seconds.append(float(ck.last_blocking_seconds or 0.0))
        result.samples(f"{prefix}.kept").seconds.append(float(max(current_rss_bytes() - before, 0)))

    def _memcpy_floor(self, w: Workload, result: SizeResult) -> None:
        """The floor of an async save's blocking: one copy of the state's bytes into host buffers that
        already exist (what staging into kept buffers is, minus DCP's bookkeeping). On CPU tensors a
        memcpy; from a GPU a device-to-host copy into pinned buffers, enqueued without blocking and
        waited for once (``Workload.measure`` synchronises the device), as the Checkpointer stages."""
        tensors = state_tensors(w.model, w.optim)
        if w.cuda:
            buffers = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
        else:
            buffers = [torch.empty_like(t) for t in tensors]
        for b, t in zip(buffers, tensors, strict=True):
            b.copy_(t)  # first touch outside the measurement, as kept staging buffers are

        def copy() -> None:
            for b, t in zip(buffers, tensors, strict=True):
                b.copy_(t, non_blocking=w.cuda)

        w.measure(result.samples("floor.memcpy"), copy)
        buffers.clear()

    def _released(
        self,
        w: Workload,
        result: SizeResult,
        uri: str,
        staging: str | None,
        step: int,
        checkpointers: dict[str, Checkpointer],
    ) -> None:
        """An async save with ``release_staging=True``: how long it blocks and what it keeps afterwards."""
        if "file.release" not in checkpointers:
            checkpointers["file.release"] = Checkpointer(
                uri + "/release", every_steps=1, keep=1, async_save=True, staging_dir=staging, release_staging=True
            )
        ck = checkpointers["file.release"]
        if w.cuda:
            torch.cuda.synchronize(w.device)
        before = current_rss_bytes()
        reset_peak_rss()
        start = time.monotonic()
        ck.step(step, w.state())
        if w.cuda:
            torch.cuda.synchronize(w.device)
        blocked = time.monotonic() - start
        ck.wait()
        peak = peak_rss_bytes()
        for name, seconds in (
            ("file.ckpt.release.step", blocked),
            ("file.ckpt.release.commit", ck.last_save_seconds or 0.0),
        ):
            s = result.samples(name)
            s.seconds.append(float(seconds))
            s.peak_rss.append(peak)
            s.rss_growth.append(max(peak - before, 0))
        result.samples("file.ckpt.release.kept").seconds.append(float(max(current_rss_bytes() - before, 0)))

    def _diagnostics(self, w: Workload, result: SizeResult, root: str) -> None:
        """The pieces of an async save timed alone, to see where the blocking time and the commit go."""
        from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict

        from agent.crc32c import crc32c_file

        sd: dict[str, Any] = {}

        def state_dicts() -> None:
            sd["model"] = get_model_state_dict(w.model)
            sd["optim"] = get_optimizer_state_dict(w.model, w.optim)

        w.measure(result.samples("diag.get_state_dict"), state_dicts)
        staged: dict[str, Any] = {}

        def stage_fresh() -> None:  # what DCP's FileSystemWriter does on every async save
            staged["sd"] = _create_cpu_state_dict(sd)
            _copy_state_dict(sd, staged["sd"])

        w.measure(result.samples("diag.stage.fresh_buffers"), stage_fresh)
        # What a stager kept across saves does from the second save on (FileSystemWriter(
        # cache_staged_state_dict=True) would, but it pins memory and fails without CUDA).
        w.measure(result.samples("diag.stage.reused_buffers"), lambda: _copy_state_dict(sd, staged["sd"]))
        staged.clear()
        sd.clear()
        gc.collect()
        shards = [
            os.path.join(folder, n)
            for folder, _, names in os.walk(os.path.join(root, "async"))
            for n in names
            if n.endswith(".distcp")
        ]
        if shards:
            shard = max(shards, key=os.path.getsize)
            crc32c_file(shard)  # make sure it is in the page cache, as it is right after DCP writes it
            measure(result.samples("diag.crc32c.warm"), lambda: crc32c_file(shard))

        # DCP writes each tensor with torch.save, whose zip writer computes a CRC-32 of every byte
        # unless told not to (spotjob turns it off for its own writes: its CRC32C covers the
        # files). Time DCP's write both ways, without fsync so that only the CPU work differs.
        for name, crc in (("diag.dcp_write.no_fsync", True), ("diag.dcp_write.no_fsync.no_torch_crc32", False)):
            path = os.path.join(os.path.dirname(root), "dcp-nosync")
            writer = dcp.FileSystemWriter(path, sync_files=False)
            previous = serialization_config.save.compute_crc32
            serialization_config.save.compute_crc32 = crc
            try:
                state = {"model": get_model_state_dict(w.model), "optim": get_optimizer_state_dict(w.model, w.optim)}
                w.measure(result.samples(name), partial(dcp.save, state, storage_writer=writer, no_dist=True))
                del state
            finally:
                serialization_config.save.compute_crc32 = previous
            remove(path)  # before its dirty pages reach the disk and slow what comes next

        # Plain DCP restoring into a fresh optimizer first creates its state with a zero-gradient
        # step; spotjob's restore skips that for unsharded modules. What it would cost:
        model, optim = w.fresh()
        w.measure(result.samples("diag.init_fresh_optim_state"), partial(get_optimizer_state_dict, model, optim))
        del model, optim
        gc.collect()

    def _empty_bucket(self) -> None:
        paginator = self.s3.get_paginator("list_objects_v2")
        for page in paginator.paginate(Bucket=S3_BUCKET):
            keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
            if keys:
                self.s3.delete_objects(Bucket=S3_BUCKET, Delete={"Objects": keys, "Quiet": True})

    @staticmethod
    def _record_server_peak(result: SizeResult, backend: str, pid: int) -> None:
        peak = child_peak_rss_bytes(pid)
        if peak is not None:
            result.server_peak_rss[backend] = peak

    def _empty_gcs_bucket(self) -> None:
        for blob in self.gcs.list_blobs(GS_BUCKET):
            blob.delete()

    # -- warm-up -----------------------------------------------------------------------------
    def warm_up(self, backends: list[str]) -> None:
        """One tiny pass of everything, untimed: imports, first-call setup, moto's first requests."""
        log("warming up")
        saved = (self.args.repeat, self.args.repeat_large)
        self.args.repeat = self.args.repeat_large = 1
        try:
            self.run_size(0.001, backends, width=256)
        finally:
            self.args.repeat, self.args.repeat_large = saved


# -- targets and the report --------------------------------------------------------------------
def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def evaluate(result: SizeResult, backend: str) -> dict[str, Any]:
    """The issue's targets for one size and backend: values, ratios and whether each is met."""
    m = result.median
    if backend == "file":
        floor_save = m("file.floor.write")
        floor_restore_io = m("file.floor.read.cold")
    else:
        floor_save = m(f"{backend}.floor.upload")
        floor_restore_io = m(f"{backend}.floor.download")
    deser = m("deserialise")
    floor_restore = floor_restore_io + deser if floor_restore_io is not None and deser is not None else None
    out: dict[str, Any] = {
        "async_step": m(f"{backend}.ckpt.async.step"),
        "sync_step": m(f"{backend}.ckpt.sync.step"),
        "async_commit": m(f"{backend}.ckpt.async.commit"),
        "sync_commit": m(f"{backend}.ckpt.sync.commit"),
        "floor_save": floor_save,
        "restore": m(f"{backend}.ckpt.restore.cold"),
        "floor_restore_io": floor_restore_io,
        "deserialise": deser,
        "floor_restore": floor_restore,
    }
    out["memcpy"] = m("floor.memcpy")
    out["async_block_vs_memcpy"] = _ratio(out["async_step"], out["memcpy"])
    out["async_block_vs_sync"] = _ratio(out["async_step"], out["sync_step"])
    out["commit_vs_floor"] = _ratio(out["async_commit"], floor_save)
    out["sync_vs_floor"] = _ratio(out["sync_step"], floor_save)
    out["sync_commit_vs_floor"] = _ratio(out["sync_commit"], floor_save)
    # An async save copies the state once before it writes (what lets step() return early): its
    # own floor is that memcpy plus the floor write, both measured in this run.
    staged_floor = floor_save + out["memcpy"] if floor_save is not None and out["memcpy"] is not None else None
    out["async_commit_vs_staged_floor"] = _ratio(out["async_commit"], staged_floor)
    out["restore_vs_floor"] = _ratio(out["restore"], floor_restore)
    commit_target = TARGETS[f"commit_vs_floor.{backend}"]
    out["targets"] = {
        "async_block_vs_sync": {"target": TARGETS["async_block_vs_sync"], "value": out["async_block_vs_sync"]},
        "commit_vs_floor": {"target": commit_target, "value": out["commit_vs_floor"]},
        "sync_commit_vs_floor": {"target": commit_target, "value": out["sync_commit_vs_floor"]},
        "restore_vs_floor": {"target": TARGETS["restore_vs_floor"], "value": out["restore_vs_floor"]},
    }
    for t in out["targets"].values():
        t["met"] = t["value"] is not None and t["value"] <= t["target"]
    return out


def _s(x: float | None) -> str:
    return "—" if x is None else f"{x:.2f}" if x >= 0.1 else f"{x:.3f}"


def _x(x: float | None) -> str:
    return "—" if x is None else f"{x:.2f}x"


def _pct(x: float | None) -> str:
    return "—" if x is None else f"{100 * x:.1f}%"


def _mark(met: bool) -> str:
    return "met" if met else "**missed**"


def _spread(s: Samples) -> str:
    if not s.seconds:
        return "—"
    return f"{_s(min(s.seconds))}-{_s(max(s.seconds))}"


_BACKEND_NAMES = {
    "file": "Filesystem",
    "s3": "S3 (moto server on loopback)",
    "gs": "GCS (fake-gcs-server on loopback)",
}


def _object_store_rows(backend: str, floor_upload: str, floor_download: str) -> list[tuple[str, str, str]]:
    """The rows of an object store (S3, GCS): the same Checkpointer rows, its own floor."""
    return [
        (f"{backend}.ckpt.async.step", "Checkpointer async: `step()` blocks", "sync"),
        (f"{backend}.ckpt.async.commit", "Checkpointer async: save call → manifest committed", "save"),
        (
            f"{backend}.ckpt.async.first.step",
            "… a Checkpointer's first async save (allocates the buffers): blocks",
            "sync",
        ),
        (f"{backend}.ckpt.async.first.commit", "… a Checkpointer's first async save: save call → commit", "save"),
        (f"{backend}.ckpt.sync.step", "Checkpointer sync: `step()` (whole save)", "save"),
        (
            f"{backend}.ckpt.sync.commit",
            "… the same sync save: save call → manifest committed (retention after it)",
            "save",
        ),
        (f"{backend}.floor.upload", f"floor: {floor_upload}", "save"),
        (f"{backend}.ckpt.restore.cold", "Checkpointer `restore()`", "restore"),
        (f"{backend}.floor.download", f"floor: {floor_download}", ""),
        ("deserialise", "deserialise: torch.load (warm) + load_state_dict", ""),
    ]


_ROWS: dict[str, list[tuple[str, str, str]]] = {
    # (op, label, what it is compared with: "save", "restore", "sync" or "")
    "file": [
        ("file.ckpt.async.step", "Checkpointer async: `step()` blocks", "sync"),
        ("floor.memcpy", "floor of the blocking: memcpy of the state into existing buffers", "sync"),
        ("file.ckpt.async.commit", "Checkpointer async: save call → manifest committed", "save"),
        ("file.ckpt.async.first.step", "… a Checkpointer's first async save (allocates the buffers): blocks", "sync"),
        ("file.ckpt.async.first.commit", "… a Checkpointer's first async save: save call → commit", "save"),
        ("file.ckpt.release.step", "… with `release_staging=True`: `step()` blocks", "sync"),
        ("file.ckpt.release.commit", "… with `release_staging=True`: save call → commit", "save"),
        ("file.ckpt.sync.step", "Checkpointer sync: `step()` (whole save)", "save"),
        ("file.ckpt.sync.commit", "… the same sync save: save call → manifest committed (retention after it)", "save"),
        ("file.ckpt.sync.buffered", "… the same with `direct_io=False` (through the page cache)", "save"),
        ("file.floor.write", "floor: raw write of the state's bytes + fsync", "save"),
        ("torch.save", "torch.save, one file + fsync", "save"),
        ("file.dcp.save", "plain dcp.save (FileSystemWriter)", "save"),
        ("file.ckpt.restore.cold", "Checkpointer `restore()` (cold cache)", "restore"),
        ("file.floor.read.cold", "floor: raw read (cold cache)", ""),
        ("deserialise", "deserialise: torch.load (warm) + load_state_dict", ""),
        ("torch.load.cold", "torch.load (cold) + load_state_dict", "restore"),
        ("file.dcp.load.cold", "plain dcp.load (cold) + set_state_dict", "restore"),
    ],
    "s3": _object_store_rows("s3", "boto3 upload_file of the state's bytes", "boto3 download_file"),
    "gs": _object_store_rows(
        "gs",
        "google-cloud-storage resumable upload of the state's bytes (100 MiB chunks)",
        "transfer_manager download_chunks_concurrently (8 x 64 MiB)",
    ),
}

_CUDA_COPY_FLOOR = "floor of the blocking: device-to-host copy of the state into pinned host buffers kept"

_DIAG_ROWS = [
    ("diag.get_state_dict", "get_model_state_dict + get_optimizer_state_dict"),
    ("diag.stage.fresh_buffers", "stage to CPU, new buffers (DCP's default, every save)"),
    ("diag.stage.reused_buffers", "stage to CPU, reused buffers (one stager kept across saves)"),
    ("diag.crc32c.warm", "CRC32C of the shard file, page cache warm (the restore's check; saves compute it inline)"),
    ("diag.dcp_write.no_fsync", "dcp.save without fsync, torch.save's zip CRC-32 on (DCP's default)"),
    ("diag.dcp_write.no_fsync.no_torch_crc32", "dcp.save without fsync, zip CRC-32 off (as spotjob's saves run)"),
    (
        "diag.init_fresh_optim_state",
        "plain DCP restore: fresh Adam initialised by a zero-grad step (spotjob skips it for unsharded modules)",
    ),
]


def render_markdown(payload: dict[str, Any], results: list[SizeResult], backends: list[str]) -> str:
    lines: list[str] = []
    device = payload.get("device") or {"type": "cpu"}
    lines.append(device_line(device))
    lines.append("### Against the targets (medians)\n")
    lines.append(
        "| backend | state | async `step()` blocks | memcpy floor | blocks / memcpy | sync save "
        "| blocks / sync (target ≤ 5%) "
        "| save call → commit (async) | floor | commit / floor (target ≤ "
        f"{TARGETS['commit_vs_floor.file']}x file, ≤ {TARGETS['commit_vs_floor.s3']}x S3 and GCS) "
        "| async commit / (floor + memcpy) | save call → commit (sync) | sync commit / floor "
        "| restore | floor read + deserialise | restore / floor (target ≤ 1.25x) |"
    )
    lines.append("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for backend in backends:
        for r in results:
            if backend in r.skipped:
                lines.append(
                    f"| {_BACKEND_NAMES[backend]} | {fmt_bytes(r.state_bytes)} | skipped: see below "
                    "| | | | | | | | | | | | | |"
                )
                continue
            e = evaluate(r, backend)
            t = e["targets"]
            lines.append(
                f"| {_BACKEND_NAMES[backend]} | {fmt_bytes(r.state_bytes)} "
                f"| {_s(e['async_step'])} s | {_s(e['memcpy'])} s | {_x(e['async_block_vs_memcpy'])} "
                f"| {_s(e['sync_step'])} s "
                f"| {_pct(e['async_block_vs_sync'])} {_mark(t['async_block_vs_sync']['met'])} "
                f"| {_s(e['async_commit'])} s | {_s(e['floor_save'])} s "
                f"| {_x(e['commit_vs_floor'])} {_mark(t['commit_vs_floor']['met'])} "
                f"| {_x(e['async_commit_vs_staged_floor'])} "
                f"| {_s(e['sync_commit'])} s "
                f"| {_x(e['sync_commit_vs_floor'])} {_mark(t['sync_commit_vs_floor']['met'])} "
                f"| {_s(e['restore'])} s | {_s(e['floor_restore_io'])} + {_s(e['deserialise'])} s "
                f"| {_x(e['restore_vs_floor'])} {_mark(t['restore_vs_floor']['met'])} |"
            )
    for backend in backends:
        for r in results:
            lines.append(
                f"\n### {_BACKEND_NAMES[backend]}, {fmt_bytes(r.state_bytes)} "
                f"({r.tensor_count} tensors, {r.layers} Linear layers of {r.width}x{r.width}), "
                f"median of {r.repeat}\n"
            )
            if backend in r.skipped:
                lines.append(f"Skipped: {r.skipped[backend]}.")
                continue
            e = evaluate(r, backend)
            lines.append("| measurement | median s | min-max s | GB/s | ratio | vs | peak RSS growth |")
            lines.append("|---|---|---|---|---|---|---|")
            for op, label, against in _ROWS[backend]:
                if op == "floor.memcpy" and device["type"] == "cuda":
                    label = _CUDA_COPY_FLOOR
                s = r.ops.get(op)
                if s is None or not s.seconds:
                    continue
                ratio, vs = None, ""
                if against == "save":
                    ratio = _ratio(s.median, e["floor_save"])
                    vs = "floor write" if backend == "file" else "floor upload"
                elif against == "restore":
                    ratio, vs = _ratio(s.median, e["floor_restore"]), "floor read + deserialise"
                elif against == "sync":
                    ratio, vs = _ratio(s.median, e["sync_step"]), "sync save"
                growth = statistics.median(s.rss_growth) if s.rss_growth else None
                lines.append(
                    f"| {label} | {_s(s.median)} | {_spread(s)} | {r.state_bytes / GB / s.median:.2f} "
                    f"| {_x(ratio) if ratio is not None else ''} | {vs} "
                    f"| {fmt_bytes(growth) if growth is not None else ''} |"
                )
            if backend in r.server_peak_rss:
                lines.append(
                    f"\nThe store's server (its own process) peaked at {fmt_bytes(r.server_peak_rss[backend])} "
                    "resident during this size."
                )
    diag = [r for r in results if any(op in r.ops for op, _ in _DIAG_ROWS)]
    if diag:
        lines.append("\n### Where an async save's time goes (filesystem, pieces timed alone, medians)\n")
        lines.append("| piece | " + " | ".join(fmt_bytes(r.state_bytes) for r in diag) + " |")
        lines.append("|---|" + "---|" * len(diag))
        for op, label in _DIAG_ROWS:
            cells = []
            for r in diag:
                med = r.median(op)
                cells.append("—" if med is None else f"{_s(med)} s ({r.state_bytes / GB / med:.1f} GB/s)")
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
    if "file" in backends:
        lines.append(
            "\n### Memory (filesystem, medians): peak resident growth during each operation, and what "
            "stays resident after it\n"
        )
        lines.append(
            "| state | sync save | first async save (peak) | first async save: kept after | later async saves "
            "(peak) | `release_staging=True` (peak) | `release_staging=True`: kept after | restore (peak) |"
        )
        lines.append("|---|---|---|---|---|---|---|---|")

        def growth(r: SizeResult, op: str) -> str:
            s = r.ops.get(op)
            return fmt_bytes(statistics.median(s.rss_growth)) if s and s.rss_growth else "—"

        def kept(r: SizeResult, op: str) -> str:
            s = r.ops.get(op)
            return fmt_bytes(statistics.median(s.seconds)) if s and s.seconds else "—"

        for r in results:
            lines.append(
                f"| {fmt_bytes(r.state_bytes)} | {growth(r, 'file.ckpt.sync.step')} "
                f"| {growth(r, 'file.ckpt.async.first.commit')} | {kept(r, 'file.ckpt.async.first.kept')} "
                f"| {growth(r, 'file.ckpt.async.commit')} "
                f"| {growth(r, 'file.ckpt.release.commit')} | {kept(r, 'file.ckpt.release.kept')} "
                f"| {growth(r, 'file.ckpt.restore.cold')} |"
            )
    sizes = [(r, r.committed_bytes) for r in results]
    lines.append("\n### Bytes written\n")
    lines.append("| state | tensors' bytes | torch.save file | dcp.save files | Checkpointer files |")
    lines.append("|---|---|---|---|---|")
    for r, c in sizes:
        lines.append(
            f"| {fmt_bytes(r.state_bytes)} | {r.state_bytes} | {c.get('torch.save', '—')} "
            f"| {c.get('dcp.save', '—')} | {c.get('ckpt.file', c.get('ckpt.s3', c.get('ckpt.gs', '—')))} |"
        )
    return "\n".join(lines) + "\n"


# -- many small tensors ------------------------------------------------------------------------
MANY_ROWS: list[tuple[str, str, str]] = [
    # (op, label, the plain DCP op it is divided by)
    ("many.dcp.save", "plain dcp.save (get_state_dict + FileSystemWriter)", "many.dcp.save"),
    ("many.ckpt.sync.commit", "Checkpointer sync: save call → manifest committed", "many.dcp.save"),
    ("many.ckpt.sync.step", "Checkpointer sync: `step()` (whole save, retention included)", "many.dcp.save"),
    ("many.ckpt.async.step", "Checkpointer async: `step()` blocks", "many.dcp.save"),
    ("many.ckpt.async.commit", "Checkpointer async: save call → manifest committed", "many.dcp.save"),
    ("many.dcp.load.cold", "plain dcp.load (cold) + set_state_dict", "many.dcp.load.cold"),
    ("many.ckpt.restore.cold", "Checkpointer `restore()` (cold cache)", "many.dcp.load.cold"),
]


def build_many_workload(layers: int, width: int) -> Workload:
    """``layers`` Linear(width, width) layers and Adam after one step: 2 parameters, 4 moments and
    2 step counters per layer, each a small tensor, so per-tensor and per-save costs dominate."""
    torch.manual_seed(0)
    model = build_model(layers, width)
    optim = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(4, width)).square().mean().backward()
    optim.step()
    optim.zero_grad(set_to_none=True)
    tensors = state_tensors(model, optim)
    state_bytes = sum(t.numel() * t.element_size() for t in tensors)
    return Workload(
        size_gb=state_bytes / GB,
        layers=layers,
        width=width,
        model=model,
        optim=optim,
        state_bytes=state_bytes,
        tensor_count=len(tensors),
    )


def dcp_round_trip(w: Workload, result: SizeResult, path: str, prefix: str) -> None:
    """The plain-DCP baseline: ``dcp.save`` of the workload to ``path``, then ``dcp.load`` of it
    (page cache cold) into a fresh model and optimizer, checked; samples ``<prefix>.dcp.save`` and
    ``<prefix>.dcp.load.cold``. Removes ``path``."""
    w.measure(result.samples(f"{prefix}.dcp.save"), partial(dcp_save, path, w.model, w.optim))
    result.committed_bytes["dcp.save"] = tree_bytes(path)
    drop_from_page_cache(path)
    model, optim = w.fresh()
    w.measure(result.samples(f"{prefix}.dcp.load.cold"), partial(dcp_load_into, path, model, optim))
    w.check_restored(model, optim, "dcp.load")
    del model, optim
    remove(path)


def run_many(args: argparse.Namespace) -> SizeResult:
    """Plain DCP and the Checkpointer, side by side, on a state of many small tensors (filesystem).

    Every repetition, in order: plain ``dcp.save`` and ``dcp.load`` (cold) into a fresh model and
    optimizer; the Checkpointer's sync save (``step()`` and its save call → commit) and a
    ``restore()`` of it (cold); an async save (how long ``step()`` blocks, then save call → commit).
    The async Checkpointer's first save, which allocates its staging buffers, is not timed.
    """
    log("building %d Linear(%d, %d) layers + Adam", args.many_layers, args.many_width, args.many_width)
    w = build_many_workload(args.many_layers, args.many_width)
    result = SizeResult(w.size_gb, w.layers, w.width, w.state_bytes, w.tensor_count, args.repeat)
    log("state: %s in %d tensors; %d repetitions", fmt_bytes(w.state_bytes), w.tensor_count, args.repeat)
    folder = os.path.join(args.scratch, "many")
    os.makedirs(folder, exist_ok=True)
    state = w.state()
    path = os.path.join(folder, "dcp")
    with contextlib.ExitStack() as stack:
        stack.callback(remove, folder)
        checkpointers: dict[str, Checkpointer] = {}
        stack.callback(CheckpointBench._close_all, checkpointers)
        sync = checkpointers["sync"] = Checkpointer(
            os.path.join(folder, "sync"), every_steps=1, keep=1, async_save=False
        )
        background = checkpointers["async"] = Checkpointer(
            os.path.join(folder, "async"), every_steps=1, keep=1, async_save=True
        )
        background.step(1, state)  # allocates the staging buffers every later save reuses
        background.wait()
        for r in range(args.repeat):
            log("many small tensors: repetition %d/%d", r + 1, args.repeat)
            step = r + 2
            dcp_round_trip(w, result, path, "many")

            measure(result.samples("many.ckpt.sync.step"), partial(sync.step, step, state))
            assert sync.last_committed_step == step and sync.last_committed_uri is not None
            result.samples("many.ckpt.sync.commit").seconds.append(float(sync.last_save_seconds or 0.0))
            local_root = sync.storage.local_path("")
            assert local_root is not None
            drop_from_page_cache(local_root)
            model, optim = w.fresh()
            reader = Checkpointer(os.path.join(folder, "sync"), keep=1)
            try:
                got = measure(
                    result.samples("many.ckpt.restore.cold"),
                    partial(reader.restore, {"model": model, "optim": optim}),
                )
            finally:
                reader.close()
                reader.storage.close()
            assert got == step, (got, step)
            w.check_restored(model, optim, "Checkpointer.restore")
            del model, optim

            CheckpointBench._async_save(background, state, step, result, "many.ckpt.async")
            gc.collect()
        next_step = args.repeat + 2
        if args.gc_loop:
            for kind, ck in (("sync", sync), ("async", background)):
                result.gc_loop[kind] = gc_loop_saves(ck, state, next_step, args.gc_loop, kind)
                next_step += args.gc_loop
        if args.profile:
            profile_sync_saves(sync, state, next_step, args.profile)
    return result


class _Generations:
    """The collections of every generation while entered (``gc.callbacks``, the benchmark's own
    process), their time, and how many objects the generation-1 collections moved into the
    oldest generation: what CPython counts toward its next full collection, which it runs once
    those exceed a quarter of the objects the last one left. Listing the oldest generation around
    each generation-1 collection is slow: for the untimed ``--gc-loop`` only."""

    def __init__(self) -> None:
        self.count = [0, 0, 0]
        self.seconds = [0.0, 0.0, 0.0]
        self.promoted = 0
        self._started = 0.0
        self._oldest = 0

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        generation = info["generation"]
        if phase == "start":
            if generation == 1:
                self._oldest = len(gc.get_objects(2))
            self._started = time.monotonic()
            return
        self.count[generation] += 1
        self.seconds[generation] += time.monotonic() - self._started
        if generation == 1:
            self.promoted += len(gc.get_objects(2)) - self._oldest

    def __enter__(self) -> _Generations:
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._callback)


def gc_loop_saves(
    ck: Checkpointer, state: dict[str, Any], first_step: int, saves: int, kind: str
) -> list[dict[str, Any]]:
    """``saves`` saves back to back through ``ck`` (``step()`` then ``wait()``), with no collection
    forced between them, as a training loop's: for each, the collections of every generation that
    ran inside it (on any thread) and their time, and the objects it moved into the oldest one."""
    out = []
    for i in range(saves):
        with _Generations() as counted:
            ck.step(first_step + i, state)
            ck.wait()
        out.append({"collections": counted.count, "seconds": counted.seconds, "promoted": counted.promoted})
    full = sum(save["collections"][2] for save in out)
    log("--gc-loop: %d %s saves, %d full collections inside them", saves, kind, full)
    return out


def profile_sync_saves(ck: Checkpointer, state: dict[str, Any], first_step: int, saves: int) -> None:
    """cProfile ``saves`` sync saves after the timed ones, and write their statistics: all of it
    (``checkpoint-many-profile.txt``, and the raw ``.prof``) and spotjob's own functions
    (``agent/``) with their share.

    A sync save runs on the calling thread, so cProfile sees all of it; an async save's write and
    commit run on a thread of its own that cProfile does not follow.
    """
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    for i in range(saves):
        prof.enable()
        ck.step(first_step + i, state)
        prof.disable()
    stats = pstats.Stats(prof)
    total = float(getattr(stats, "total_tt", 0.0)) or 1e-9
    agent_dir = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "agent")
    raw: dict[Any, Any] = stats.stats  # type: ignore[attr-defined]
    own = []
    for (filename, line, name), (_cc, calls, tottime, cumtime, _callers) in raw.items():
        if filename.startswith(agent_dir):
            where = f"{os.path.relpath(filename, os.path.dirname(agent_dir))}:{line} {name}"
            own.append((cumtime, tottime, calls, where))
    own.sort(reverse=True)
    out = io.StringIO()
    out.write(f"{saves} sync saves profiled, {total:.3f} s in all ({total / saves:.3f} s a save)\n\n")
    out.write("spotjob's own functions (agent/), by cumulative time: cum s/save, cum share, self s/save, calls/save\n")
    for cumtime, tottime, calls, where in own[:40]:
        out.write(
            f"{cumtime / saves:8.4f} {100 * cumtime / total:5.1f}% {tottime / saves:8.4f} "
            f"{calls / saves:8.0f}  {where}\n"
        )
    out.write("\nall functions, by cumulative time\n")
    stats.stream = out  # type: ignore[attr-defined]
    stats.sort_stats("cumulative").print_stats(60)
    out.write("\nall functions, by own time\n")
    stats.sort_stats("tottime").print_stats(40)
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    (OUT_DIR / "checkpoint-many-profile.txt").write_text(out.getvalue())
    prof.dump_stats(str(OUT_DIR / "checkpoint-many-profile.prof"))  # for pstats / snakeviz
    log("profile of %d sync saves written to %s", saves, OUT_DIR / "checkpoint-many-profile.txt")


def many_ratios(result: SizeResult) -> dict[str, float | None]:
    return {op: _ratio(result.median(op), result.median(base)) for op, _label, base in MANY_ROWS}


def render_many_markdown(result: SizeResult) -> str:
    ratios = many_ratios(result)
    lines = [
        f"### Many small tensors (filesystem): {result.layers} Linear layers of {result.width}x{result.width} "
        f"+ Adam, {result.tensor_count} tensors, {fmt_bytes(result.state_bytes)}, median of {result.repeat}\n",
        "| measurement | median s | min-max s | ratio to plain DCP | vs | full GCs inside: count, s (a run) |",
        "|---|---|---|---|---|---|",
    ]
    for op, label, base in MANY_ROWS:
        s = result.ops.get(op)
        if s is None or not s.seconds:
            continue
        vs = "plain dcp.save" if base == "many.dcp.save" else "plain dcp.load"
        lines.append(f"| {label} | {_s(s.median)} | {_spread(s)} | {_x(ratios[op])} | {vs} | {_full_gcs(s)} |")
    if result.gc_loop:
        lines += [
            "",
            "Saves back to back (`--gc-loop`), no collection forced between them:\n",
            "| saves | collections of generation 0 / 1 / 2, a save (median) | full collections, all saves: count, s "
            "| objects moved into the oldest generation, a save (median) |",
            "|---|---|---|---|",
        ]
        for kind, saves in result.gc_loop.items():
            young = " / ".join(f"{statistics.median(s['collections'][g] for s in saves):g}" for g in range(3))
            full = sum(s["collections"][2] for s in saves)
            full_s = sum(s["seconds"][2] for s in saves)
            promoted = statistics.median(s["promoted"] for s in saves)
            lines.append(f"| {len(saves)} {kind} | {young} | {full}, {full_s:.2f} | {promoted:,.0f} |")
    return "\n".join(lines) + "\n"


def _full_gcs(s: Samples) -> str:
    """The full garbage collections of each run of ``s``, as "count / seconds" medians; "-" where
    the operation was timed by the Checkpointer itself (its save call → commit), not around it."""
    if not s.full_gcs:
        return "-"
    return f"{statistics.median(s.full_gcs):g}, {statistics.median(s.full_gc_seconds):.2f}"


# -- entry point -------------------------------------------------------------------------------
def _backends(text: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    bad = [n for n in names if n not in ("file", "s3", "gs")]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"backends are file, s3 and gs (comma-separated), got {text!r}")
    return names


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.checkpoint", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--sizes",
        type=sizes_gb,
        default=[0.1, 1.0, 4.0],
        help="state sizes in GB (model + Adam), comma-separated (default 0.1,1,4)",
    )
    p.add_argument(
        "--backends",
        type=_backends,
        default=["file", "s3"],
        help="comma-separated: file, s3, gs (default file,s3; gs: fake-gcs-server on loopback)",
    )
    p.add_argument("--repeat", type=int, default=3, help="repetitions per size; medians are reported (default 3)")
    p.add_argument(
        "--repeat-large",
        type=int,
        default=3,
        help="repetitions for sizes >= --large-gb; fewer keep the run short (default 3)",
    )
    p.add_argument("--large-gb", type=float, default=2.0, help="what counts as large for --repeat-large")
    p.add_argument(
        "--s3-max-gb",
        type=float,
        default=1.5,
        help="skip S3 above this size: moto cannot serve multi-GB objects (default 1.5)",
    )
    p.add_argument(
        "--gs-max-gb",
        type=float,
        default=1.0,
        help="skip GCS above this size: fake-gcs-server holds a resumable upload in memory and reads a whole "
        "object for each ranged GET (default 1)",
    )
    p.add_argument(
        "--scratch",
        default=str(OUT_DIR / "scratch"),
        help="folder for the files written (removed afterwards; default bench/out/scratch)",
    )
    p.add_argument("--no-warm-up", action="store_true", help="skip the untimed tiny pass first")
    p.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="where the model and the optimizer's state live (default cpu). cuda: the current GPU; the "
        "floor of the async blocking is then a device-to-host copy into pinned host buffers kept between "
        "saves, and restores go into a model on the GPU",
    )
    p.add_argument(
        "--many-layers",
        type=int,
        default=0,
        metavar="N",
        help="instead of --sizes: a state of N small Linear layers + Adam (8 tensors a layer), plain DCP "
        "next to the Checkpointer, filesystem only",
    )
    p.add_argument("--many-width", type=int, default=32, help="features of each --many-layers layer (default 32)")
    p.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="SAVES",
        help="with --many-layers: cProfile that many more sync saves; bench/out/checkpoint-many-profile.txt",
    )
    p.add_argument(
        "--gc-loop",
        type=int,
        default=0,
        metavar="SAVES",
        help="with --many-layers: that many more sync saves, then async ones, back to back, each with the "
        "collections of every generation inside it and the objects it moved into the oldest (untimed: slow)",
    )
    args = p.parse_args(argv)
    if args.repeat < 1 or args.repeat_large < 1:
        p.error("--repeat and --repeat-large must be >= 1")
    if args.many_layers < 0 or args.many_width < 1 or args.profile < 0 or args.gc_loop < 0:
        p.error("--many-layers, --profile and --gc-loop must be >= 0, --many-width >= 1")
    if (args.profile or args.gc_loop) and not args.many_layers:
        p.error("--profile and --gc-loop save the --many-layers state: give --many-layers N too")
    if args.device == "cuda":
        if args.many_layers:
            p.error("--device cuda measures the --sizes states; --many-layers runs on CPU: drop one of them")
        if not torch.cuda.is_available():
            p.error(
                f"--device cuda: torch.cuda.is_available() is False (torch {torch.__version__}, built for CUDA "
                f"{torch.version.cuda or 'none'}): run it on a machine with an NVIDIA GPU and a CUDA build of "
                "torch, or leave --device out (cpu)"
            )
    return args


def describe_device(device: str, machine: dict[str, Any]) -> dict[str, Any]:
    """What the state lives on, for the report: the GPU's name, memory and compute capability from
    torch.cuda, or the CPU's model name."""
    if device != "cuda":
        return {"type": "cpu", "name": machine.get("cpu_model")}
    index = torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    return {
        "type": "cuda",
        "index": index,
        "name": torch.cuda.get_device_name(index),
        "memory_bytes": props.total_memory,
        "capability": f"{props.major}.{props.minor}",
        "count": torch.cuda.device_count(),
        "torch_cuda": torch.version.cuda,
    }


def device_line(device: dict[str, Any]) -> str:
    """The report's first line: where the state lived."""
    if device["type"] != "cuda":
        return f"State on: CPU ({device.get('name') or 'model unknown'}).\n"
    return (
        f"State on: GPU cuda:{device['index']}, {device['name']} ({fmt_bytes(device['memory_bytes'])}, "
        f"compute capability {device['capability']}, torch built for CUDA {device['torch_cuda']}); the floor "
        "of the async blocking is a device-to-host copy into pinned host buffers kept between saves.\n"
    )


def _gcs_chunk(size: int) -> int:
    """A resumable upload's chunk size as GCS takes it: a multiple of 256 KiB (rounded up, as spotjob's)."""
    granularity = 256 * 1024
    return -(-size // granularity) * granularity


@contextlib.contextmanager
def _gs_if(backends: list[str], bench: CheckpointBench) -> Iterator[str | None]:
    """fake-gcs-server in a child process on loopback, a bucket for the run and a plain client for the
    floor, while the run needs them; the server's folder (every object) goes with it."""
    if "gs" not in backends:
        yield None
        return
    import psutil
    from google.cloud import storage

    from agent.storage._transfer import TransferSettings

    with fake_gcs_server() as url:
        log("fake-gcs-server listening at %s (its own process)", url)
        servers = [p.pid for p in psutil.Process().children() if p.name().startswith("fake-gcs")]
        bench.gcs_server_pid = servers[0] if len(servers) == 1 else None
        bench.gcs_settings = TransferSettings.from_env()
        bench.gcs = storage.Client()
        bench.gcs.create_bucket(GS_BUCKET)
        try:
            yield url
        finally:
            with contextlib.suppress(Exception):
                bench._empty_gcs_bucket()
                bench.gcs.bucket(GS_BUCKET).delete()
            bench.gcs.close()


@contextlib.contextmanager
def _s3_if(backends: list[str], bench: CheckpointBench) -> Iterator[str | None]:
    if "s3" not in backends:
        yield None
        return
    import boto3
    from botocore.config import Config

    with moto_s3_server() as endpoint, s3_environment(endpoint):
        log("moto S3 listening at %s (its own process)", endpoint)
        # The floor: boto3's transfer manager with spotjob's part sizes (upload parts, download
        # ranges) and parallelism, and no checksum work (spotjob's CRC32C is the only checksum it
        # pays for; a floor pays none).
        bench.transfer_config, bench.download_config, pool = s3_floor_transfer()
        bench.s3 = boto3.session.Session().client(
            "s3",
            config=pool.merge(
                Config(request_checksum_calculation="when_required", response_checksum_validation="when_required")
            ),
        )
        bench.s3.create_bucket(Bucket=S3_BUCKET)
        try:
            yield endpoint
        finally:
            bench.s3.close()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.makedirs(args.scratch, exist_ok=True)
    started_wall = time.time()
    started = time.monotonic()
    machine = describe_machine(args.scratch)
    device = describe_device(args.device, machine)
    log(
        "machine: %d cores, %s RAM, disk %s (%s), torch %s; state on %s (%s)",
        machine["cores"],
        fmt_bytes(machine["memory_bytes"] or 0),
        machine["disk"].get("block_device"),
        machine["disk"]["fstype"],
        machine["torch"],
        device["type"],
        device["name"],
    )
    if args.many_layers:
        return main_many(args, machine, started_wall, started)
    bench = CheckpointBench(args, args.scratch)
    results: list[SizeResult] = []
    with _s3_if(args.backends, bench) as endpoint, _gs_if(args.backends, bench) as gs_url:
        if not args.no_warm_up:
            bench.warm_up(args.backends)
        for size in args.sizes:
            results.append(bench.run_size(size, args.backends))
    remove(args.scratch)
    payload: dict[str, Any] = {
        "benchmark": "checkpoint",
        "started_unix": started_wall,
        "wall_seconds": time.monotonic() - started,
        "machine": machine,
        "device": device,
        "load_average_at_end": os.getloadavg(),
        "args": {k: v for k, v in vars(args).items()},
        "s3_endpoint": endpoint and "moto server on 127.0.0.1 (own process)",
        "gs_endpoint": gs_url and "fake-gcs-server on 127.0.0.1 (own process)",
        "targets": TARGETS,
        "sizes": [r.to_json() for r in results],
        "evaluation": {
            f"{b}/{r.size_gb:g}gb": evaluate(r, b) for r in results for b in args.backends if b not in r.skipped
        },
    }
    path = write_results("checkpoint", payload)
    md = render_markdown(payload, results, args.backends)
    (OUT_DIR / "checkpoint-latest.md").write_text(md)
    print(md)
    log(
        "done in %.0f s; raw results in %s, tables in %s",
        payload["wall_seconds"],
        path,
        OUT_DIR / "checkpoint-latest.md",
    )
    return 0


def main_many(args: argparse.Namespace, machine: dict[str, Any], started_wall: float, started: float) -> int:
    result = run_many(args)
    remove(args.scratch)
    payload: dict[str, Any] = {
        "benchmark": "checkpoint",
        "mode": "many-layers",
        "started_unix": started_wall,
        "wall_seconds": time.monotonic() - started,
        "machine": machine,
        "device": describe_device(args.device, machine),
        "load_average_at_end": os.getloadavg(),
        "args": {k: v for k, v in vars(args).items()},
        "many_layers": result.to_json(),
        "ratios_to_plain_dcp": many_ratios(result),
    }
    path = write_results("checkpoint", payload)
    md = render_many_markdown(result)
    (OUT_DIR / "checkpoint-latest.md").write_text(md)
    print(md)
    log(
        "done in %.0f s; raw results in %s, table in %s",
        payload["wall_seconds"],
        path,
        OUT_DIR / "checkpoint-latest.md",
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
