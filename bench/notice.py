"""Notice benchmark: how long from a preemption notice to a committed checkpoint, and what the
per-step flush check costs the training loop.

1. Notice to commit, for the checkpoint benchmark's state sizes, on the filesystem, on S3 (moto
   on loopback) and on GCS (fake-gcs-server on loopback), in one process: the notice is the
   agent's ``flush.json`` (written through ``ControlDir.request_flush``, exactly what
   spotjob-agent does), and the clock stops where the flush reports its commit to the agent
   (``flushed.json``'s ``notice_to_commit_seconds``, taken once MANIFEST.json is committed: what
   spotjob-agent and the controller wait for). ``Checkpointer.step()`` returns True a little later,
   after rank 0 has applied ``keep`` to the older checkpoints; that time is recorded beside it
   (``idle_returned_s``, ``busy_returned_s``). Two cases: *idle* (no save in flight) and *busy*
   (the notice lands right after an async save started: the flush gives that save up at its next
   block and writes its own — the worst case). Next to it, the raw floor for the same bytes: one file of that size
   written with fsync (filesystem), ``upload_file`` with boto3 (S3), or google-cloud-storage's
   ``upload_from_filename`` with its CRC32C check (GCS). On S3 a second floor is timed beside it:
   ``upload_file`` asked for the same full-object CRC32C that spotjob sends (``ChecksumCRC32C``,
   which s3transfer turns into a ``FULL_OBJECT`` multipart upload), so that S3 checks the
   assembled object in both. The plain floor asks for a composite checksum, which moto assembles
   far faster; the two floors together show how much of a ratio is that server-side check.
2. The flush check: 2 torchrun ranks (gloo, CPU) train the smallest model; each rank times its
   training steps and, separately, ``Checkpointer.step()`` on steps where nothing is due (one
   ``stat`` plus the asynchronous vote). Reported as a fraction of the step time (target ≤ 1%).

``python -m bench.notice [--sizes 0.1,1,4] [--backends file,s3,gs] [--repeat 3]``; results to
``bench/out/notice-*.json`` and ``bench/out/notice-latest.md``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch

from agent.checkpoint import Checkpointer
from agent.control_channel import ControlDir, FlushRequest
from agent.crc32c import crc32c_file
from agent.storage._transfer import crc_to_b64
from bench._common import (
    OUT_DIR,
    describe_machine,
    fake_gcs_server,
    fmt_bytes,
    log,
    moto_s3_server,
    s3_environment,
    s3_floor_transfer,
    s3_object_parts,
    sizes_gb,
    write_results,
)
from bench.checkpoint import build_workload, state_tensors, write_raw

warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")

WINDOWS = (30.0, 120.0)
TARGETS = {"idle_vs_floor": 1.25, "busy_vs_floor": 2.0}
"""From the issue: notice → committed checkpoint ≤ 1.25x the raw write + fsync of the same bytes with no
save in flight, ≤ 2x with one in flight."""


def _fresh_uri(backend: str, scratch: str, tag: str) -> str:
    if backend == "file":
        path = os.path.join(scratch, f"ckpt-{tag}")
        shutil.rmtree(path, ignore_errors=True)
        return path
    bucket = f"notice-{tag.replace('.', '-')}-{int(time.time() * 1000) % 10**9}"
    if backend == "gs":
        from google.cloud import storage

        storage.Client().create_bucket(bucket)
        return f"gs://{bucket}/run"
    import boto3

    boto3.client("s3").create_bucket(Bucket=bucket)
    return f"s3://{bucket}/run"


def _floor(
    backend: str, scratch: str, tensors: list[torch.Tensor], nbytes: int
) -> tuple[float, float | None, int | None]:
    """(the floor, the S3 floor with a full-object CRC32C or None, the parts the S3 floor's upload
    went up in or None): seconds, seconds, a count."""
    raw = os.path.join(scratch, "raw.bin")
    t0 = time.monotonic()
    write_raw(raw, tensors)
    write_s = time.monotonic() - t0
    if backend == "file":
        os.unlink(raw)
        return write_s, None, None
    if backend == "gs":
        return _gcs_floor(raw), None, None
    import boto3

    # spotjob's threshold, part size and parallelism (boto3's defaults are 10 parts in flight, and
    # parts from 8 MiB where spotjob sends one PUT up to 64 MiB).
    transfer, _download, pool = s3_floor_transfer()
    s3 = boto3.client("s3", config=pool)
    bucket = f"notice-floor-{int(time.time() * 1000) % 10**9}"
    s3.create_bucket(Bucket=bucket)
    t0 = time.monotonic()
    s3.upload_file(raw, bucket, "raw.bin", Config=transfer)
    up = time.monotonic() - t0
    parts = s3_object_parts(s3, bucket, "raw.bin")
    s3.delete_object(Bucket=bucket, Key="raw.bin")
    # The same upload asked to have S3 check the whole object's CRC32C, as spotjob's is. The CRC
    # is computed before the clock starts: a floor has it for free (spotjob's is computed while
    # the shard is written).
    whole = crc_to_b64(crc32c_file(raw)[0])
    t0 = time.monotonic()
    s3.upload_file(raw, bucket, "raw.bin", ExtraArgs={"ChecksumCRC32C": whole}, Config=transfer)
    checked = time.monotonic() - t0
    kind = s3.head_object(Bucket=bucket, Key="raw.bin", ChecksumMode="ENABLED").get("ChecksumType")
    if nbytes >= transfer.multipart_threshold and kind != "FULL_OBJECT":  # a multipart upload
        raise RuntimeError(f"the checked floor's upload got a {kind!r} checksum, not FULL_OBJECT")
    os.unlink(raw)
    s3.delete_object(Bucket=bucket, Key="raw.bin")
    return up, checked, parts


def _gcs_floor(raw: str) -> float:
    """google-cloud-storage's own upload of the file, with its defaults (a resumable upload in
    100 MiB chunks) and the CRC32C that GCS checks at the end, as spotjob's uploads carry."""
    from google.cloud import storage

    client = storage.Client()
    bucket = client.create_bucket(f"notice-floor-{int(time.time() * 1000) % 10**9}")
    blob = bucket.blob("raw.bin")
    t0 = time.monotonic()
    blob.upload_from_filename(raw, checksum="crc32c")
    up = time.monotonic() - t0
    os.unlink(raw)
    blob.delete()
    client.close()
    return up


def _reported_commit(control: str, step: int) -> float:
    """Notice → commit as the flush reported it to spotjob-agent (``flushed.json``'s
    ``notice_to_commit_seconds``, taken once MANIFEST.json is committed): what the agent and the
    controller wait for. ``step()`` returns later, after rank 0's retention of older checkpoints
    (timed beside it as ``*_returned_s``)."""
    result = ControlDir(control).flush_result()
    if result is None or result.step != step or result.error or result.notice_to_commit_seconds is None:
        raise RuntimeError(f"the flush of step {step} reported no commit: {result!r}")
    return result.notice_to_commit_seconds


def notice_to_commit(backend: str, size_gb: float, repeat: int, scratch: str) -> dict[str, Any]:
    work = build_workload(size_gb, width=2048 if size_gb >= 1 else 1024)
    state = work.state()
    tensors = state_tensors(work.model, work.optim)
    out: dict[str, Any] = {
        "backend": backend,
        "size_gb": size_gb,
        "state_bytes": work.state_bytes,
        "idle_s": [],
        "busy_s": [],
        "idle_returned_s": [],
        "busy_returned_s": [],
        "floor_s": [],
        "floor_checked_s": [],
    }
    for i in range(repeat):
        uri = _fresh_uri(backend, scratch, f"{backend}-{size_gb}-{i}")
        control = tempfile.mkdtemp(prefix="notice-control-", dir=scratch)
        staging = None if backend == "file" else os.path.join(scratch, "staging")
        ckpt = Checkpointer(uri, keep=2, control_dir=control, staging_dir=staging)
        # Warm up: one committed save, so the flush is the steady-state second one.
        ckpt.save(1, state)
        ckpt.wait()
        # idle: no save in flight when the notice lands.
        request = ControlDir(control).request_flush(FlushRequest(reason="bench idle"))
        assert ckpt.step(2, state), "the flush did not stop the loop"
        out["idle_returned_s"].append(time.time() - request.requested_at)
        out["idle_s"].append(_reported_commit(control, 2))
        ckpt.close()
        shutil.rmtree(control, ignore_errors=True)
        # busy: an async save has just started when the notice lands.
        control = tempfile.mkdtemp(prefix="notice-control-", dir=scratch)
        ckpt = Checkpointer(uri, keep=2, control_dir=control, staging_dir=staging)
        ckpt.save(3, state)
        request = ControlDir(control).request_flush(FlushRequest(reason="bench busy"))
        assert ckpt.step(4, state), "the flush did not stop the loop"
        out["busy_returned_s"].append(time.time() - request.requested_at)
        out["busy_s"].append(_reported_commit(control, 4))
        ckpt.close()
        shutil.rmtree(control, ignore_errors=True)
        if backend == "file":
            shutil.rmtree(uri, ignore_errors=True)
        floor, checked, parts = _floor(backend, scratch, tensors, work.state_bytes)
        out["floor_s"].append(floor)
        if parts is not None:
            out["floor_upload_parts"] = parts
        if checked is not None:
            out["floor_checked_s"].append(checked)
        log(
            "notice→commit %s %.1f GB #%d: idle %.2fs busy %.2fs floor %.2fs%s",
            backend,
            size_gb,
            i + 1,
            out["idle_s"][-1],
            out["busy_s"][-1],
            floor,
            "" if checked is None else f" (with the full-object CRC32C: {checked:.2f}s)",
        )
        gc.collect()
    for k in ("idle_s", "busy_s", "floor_s", "idle_returned_s", "busy_returned_s"):
        out[k + "_median"] = statistics.median(out[k])
    out["idle_vs_floor"] = out["idle_s_median"] / out["floor_s_median"]
    out["busy_vs_floor"] = out["busy_s_median"] / out["floor_s_median"]
    if out["floor_checked_s"]:
        out["floor_checked_s_median"] = statistics.median(out["floor_checked_s"])
        out["idle_vs_checked_floor"] = out["idle_s_median"] / out["floor_checked_s_median"]
        out["busy_vs_checked_floor"] = out["busy_s_median"] / out["floor_checked_s_median"]
    out["fits"] = {str(int(w)): out["busy_s_median"] < w for w in WINDOWS}
    del work, state, tensors
    gc.collect()
    return out


_CHECK_SCRIPT = r"""
import json, os, sys, time, warnings
import torch, torch.distributed as dist
warnings.filterwarnings("ignore")
from agent.checkpoint import Checkpointer
from bench.checkpoint import build_workload
dist.init_process_group("gloo")
rank = dist.get_rank()
work = build_workload(float(sys.argv[1]), width=1024)
model, optim = work.model, work.optim
ddp = torch.nn.parallel.DistributedDataParallel(model)
ckpt = Checkpointer(sys.argv[2], control_dir=sys.argv[3] + f"/rank{rank}")
x = torch.randn(8, 1024)
steps = int(sys.argv[4])
train, check = [], []
for i in range(steps):
    t0 = time.perf_counter()
    ddp(x).square().mean().backward(); optim.step(); optim.zero_grad()
    t1 = time.perf_counter()
    stop = ckpt.step(i + 1, {"model": model, "optim": optim})
    t2 = time.perf_counter()
    assert not stop
    if i >= 3:
        train.append(t1 - t0); check.append(t2 - t1)
# The check alone, many times, with no training between (an upper bound: nothing overlaps it).
tight = []
for i in range(2000):
    t0 = time.perf_counter()
    ckpt.step(steps + 1 + i, {"model": model, "optim": optim})
    tight.append(time.perf_counter() - t0)
ckpt.close()
if rank == 0:
    print("RESULT " + json.dumps({"train": train, "check": check, "tight": tight}), flush=True)
dist.destroy_process_group()
"""


def flush_check_cost(scratch: str, size_gb: float = 0.1, steps: int = 60) -> dict[str, Any]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = os.path.join(scratch, "flush_check.py")
    Path(script).write_text(_CHECK_SCRIPT)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    cmd = [
        str(Path(sys.executable).parent / "torchrun"),
        "--nproc-per-node",
        "2",
        "--master-port",
        str(port),
        script,
        str(size_gb),
        os.path.join(scratch, "check-ckpt"),
        os.path.join(scratch, "check-control"),
        str(steps),
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if line is None:
        raise RuntimeError(f"flush-check run failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    data = json.loads(line[len("RESULT ") :])
    train = statistics.median(data["train"])
    check = statistics.median(data["check"])
    tight = statistics.median(data["tight"])
    return {
        "size_gb": size_gb,
        "ranks": 2,
        "train_step_s": train,
        "check_s": check,
        "check_tight_s": tight,
        "check_fraction": check / train,
        "check_tight_fraction": tight / train,
    }


def _machine_line(m: dict[str, Any]) -> str:
    disk = m.get("disk") or {}
    return (
        f"{m.get('cores')} cores ({m.get('cpu_model')}), {m.get('memory_bytes', 0) / 2**30:.0f} GiB RAM, "
        f"{disk.get('fstype', '?')} on {disk.get('block_device', '?')}"
        f"{' (virtio)' if disk.get('virtio') else ''}, torch {m.get('torch')}, {str(m.get('date_utc', ''))[:10]}"
    )


def render(payload: dict[str, Any]) -> str:
    m = payload["machine"]
    lines = [
        "### Notice to commit",
        "",
        f"Machine: {_machine_line(m)}; load average {m.get('load_average_at_start', ['?'])[0]:.1f} at the start, "
        f"{payload.get('load_average_at_end', ['?'])[0]:.1f} at the end. Single process; the notice is the agent's "
        "`flush.json`; the clock",
        "stops where the flush reports its commit to the agent (MANIFEST.json committed; `flushed.json`'s",
        "`notice_to_commit_seconds`). `step()` returns after rank 0 has also applied `keep` (*returned*",
        "columns). *busy*: the notice lands right after an async save started; the flush gives that save",
        f"up at its next block and writes its own. Medians of {payload['repeat']} runs.",
        "",
        "| backend | state | idle | busy (worst case) | raw floor | idle / floor (target ≤ 1.25x) "
        "| busy / floor (target ≤ 2x) | idle, `step()` returned | busy, `step()` returned | fits 30 s | fits 120 s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    checked_rows = [r for r in payload["notice"] if r.get("floor_checked_s_median") is not None]

    def verdict(value: float, target: float) -> str:
        return f"{value:.2f}x {'met' if value <= target else '**missed**'}"

    def returned(r: dict[str, Any], case: str) -> str:
        seconds = r.get(f"{case}_returned_s_median")  # absent from results before it was recorded
        return "—" if seconds is None else f"{seconds:.2f} s ({seconds / r['floor_s_median']:.2f}x)"

    for r in payload["notice"]:
        lines.append(
            f"| {r['backend']} | {fmt_bytes(r['state_bytes'])} | {r['idle_s_median']:.2f} s"
            f" | {r['busy_s_median']:.2f} s | {r['floor_s_median']:.2f} s"
            f" | {verdict(r['idle_vs_floor'], TARGETS['idle_vs_floor'])}"
            f" | {verdict(r['busy_vs_floor'], TARGETS['busy_vs_floor'])}"
            f" | {returned(r, 'idle')} | {returned(r, 'busy')}"
            f" | {'yes' if r['fits']['30'] else 'no'} | {'yes' if r['fits']['120'] else 'no'} |"
        )
    if checked_rows:
        lines += [
            "",
            "S3 against a floor that asks for the same check: `upload_file` with the whole object's",
            "CRC32C (`ChecksumCRC32C`, a `FULL_OBJECT` multipart upload, as spotjob's), beside the plain floor:",
            "",
            "| backend | state | floor with full-object CRC32C | idle / that floor | busy / that floor |",
            "|---|---|---|---|---|",
        ]
        for r in checked_rows:
            lines.append(
                f"| {r['backend']} | {fmt_bytes(r['state_bytes'])} | {r['floor_checked_s_median']:.2f} s"
                f" | {r['idle_vs_checked_floor']:.2f}x | {r['busy_vs_checked_floor']:.2f}x |"
            )
    c = payload.get("flush_check")
    if c:
        lines += [
            "",
            "### The per-step flush check",
            "",
            f"2 torchrun ranks (gloo, CPU), {c['size_gb']} GB model: "
            f"median training step {c['train_step_s'] * 1e3:.1f} ms;",
            f"`Checkpointer.step()` on a step where nothing is due: {c['check_s'] * 1e6:.0f} µs "
            f"(**{c['check_fraction'] * 100:.2f}%** of the step; target ≤ 1%).",
            f"Called back to back with no training between (nothing to overlap the vote): "
            f"{c['check_tight_s'] * 1e6:.0f} µs ({c['check_tight_fraction'] * 100:.2f}%).",
            "No network call to any metadata endpoint or agent is made per step: the check is one `stat()`",
            "of the control folder's `flush.json` and an asynchronous all-reduce on the Checkpointer's own",
            "gloo group whose result is read one step later.",
        ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.notice", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--sizes", type=sizes_gb, default=[0.1, 1.0, 4.0], help="state sizes in GB (default 0.1,1,4)")
    p.add_argument("--backends", default="file,s3,gs", help="comma-separated: file, s3, gs (default all three)")
    p.add_argument("--repeat", type=int, default=3, help="repetitions per size and backend (default 3)")
    p.add_argument("--scratch", default=None, help="folder on the disk to measure (default: a temp folder)")
    p.add_argument("--skip-check", action="store_true", help="skip the per-step flush check measurement")
    p.add_argument(
        "--s3-max-gb",
        type=float,
        default=1.5,
        help="skip S3 and GCS above this size: moto and fake-gcs-server hold objects in memory (default 1.5)",
    )
    args = p.parse_args(argv)
    sizes: list[float] = args.sizes
    if args.repeat < 1:
        p.error("--repeat must be >= 1")
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    unknown = [b for b in backends if b not in ("file", "s3", "gs")]
    if unknown or not backends:
        p.error(f"--backends takes file, s3 and gs, comma-separated; got {args.backends!r}")
    scratch = args.scratch or tempfile.mkdtemp(prefix="spotjob-notice-bench-")
    os.makedirs(scratch, exist_ok=True)
    payload: dict[str, Any] = {"machine": describe_machine(scratch), "repeat": args.repeat, "notice": [],
                               "targets": TARGETS}  # fmt: skip
    try:
        for backend in backends:
            if backend == "s3":
                with moto_s3_server() as endpoint, s3_environment(endpoint):
                    for size in sizes:
                        if size > args.s3_max_gb:
                            log("S3 at %.1f GB skipped (--s3-max-gb %.1f): moto holds whole objects in memory", size,
                                args.s3_max_gb)  # fmt: skip
                            continue
                        payload["notice"].append(notice_to_commit("s3", size, args.repeat, scratch))
            elif backend == "gs":
                with fake_gcs_server():
                    for size in sizes:
                        if size > args.s3_max_gb:
                            log("GCS at %.1f GB skipped (--s3-max-gb %.1f caps both emulated stores): "
                                "fake-gcs-server holds each upload in memory", size, args.s3_max_gb)  # fmt: skip
                            continue
                        payload["notice"].append(notice_to_commit("gs", size, args.repeat, scratch))
            else:
                for size in sizes:
                    payload["notice"].append(notice_to_commit("file", size, args.repeat, scratch))
        if not args.skip_check:
            payload["flush_check"] = flush_check_cost(scratch)
    finally:
        if args.scratch is None:
            shutil.rmtree(scratch, ignore_errors=True)
    payload["load_average_at_end"] = os.getloadavg()
    write_results("notice", payload)
    md = render(payload)
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    (OUT_DIR / "notice-latest.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
