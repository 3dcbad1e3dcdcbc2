"""Library benchmark: what each maintained library that replaced hand-written code costs, next to
what it replaced, in one process (seconds to run).

- CRC32C: ``awscrt.checksums.crc32c`` (what spotjob uses now) against ``google_crc32c.extend``
  (what it used), on the same 256 MiB buffer;
- combining two CRC32Cs: ``awscrt.checksums.combine_crc32c`` against the GF(2) matrix code
  spotjob carried before (kept here, and only here, as the baseline);
- one pass over every process: ``psutil.process_iter`` for pid, ppid, status and start time
  against one read of ``/proc/<pid>/stat`` each (what the agent's 10 Hz watch loop keeps doing);
- reading the environment: ``agent.settings`` (pydantic-settings) per Checkpointer and per store,
  against the plain ``os.environ`` parsing it replaced.

``python -m bench.libraries``; results to ``bench/out/libraries-*.json`` and
``bench/out/libraries-latest.md``.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

from bench._common import OUT_DIR, cpu_info, log, write_results


def _best(fn: Callable[[], object], repeat: int, number: int = 1) -> float:
    """The median of ``repeat`` timings of ``number`` calls, per call, in seconds."""
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        for _ in range(number):
            fn()
        times.append((time.perf_counter() - start) / number)
    return statistics.median(times)


# The hand-written CRC32C combination spotjob carried before awscrt (zlib's crc32_combine, for the
# Castagnoli polynomial): the baseline only.
_POLY = 0x82F63B78


def _gf2_times(mat: Sequence[int], vec: int) -> int:
    out, i = 0, 0
    while vec:
        if vec & 1:
            out ^= mat[i]
        vec >>= 1
        i += 1
    return out


def _gf2_square(mat: Sequence[int]) -> list[int]:
    return [_gf2_times(mat, mat[n]) for n in range(32)]


def _zero_ops() -> list[list[int]]:
    op = [_POLY] + [1 << n for n in range(31)]
    for _ in range(3):
        op = _gf2_square(op)
    ops = [op]
    for _ in range(63):
        ops.append(_gf2_square(ops[-1]))
    return ops


_OPS = _zero_ops()


def handwritten_combine(crc1: int, crc2: int, len2: int) -> int:
    k = 0
    while len2:
        if len2 & 1:
            crc1 = _gf2_times(_OPS[k], crc1)
        len2 >>= 1
        k += 1
    return crc1 ^ crc2


def main(argv: Sequence[str] | None = None) -> int:
    import argparse

    argparse.ArgumentParser(
        prog="python -m bench.libraries",
        description="Library benchmark: each maintained library that replaced hand-written code, timed next to "
        "what it replaced (a few seconds). Results to bench/out/libraries-*.json and bench/out/libraries-latest.md.",
    ).parse_args(argv)
    import google_crc32c
    import psutil
    from awscrt import checksums

    from agent.launcher import TREE_SCAN_EVERY
    from agent.process_tree import all_processes
    from agent.settings import CheckpointerEnv, StorageEnv, load

    rows: list[dict[str, Any]] = []
    data = os.urandom(256 * 1024 * 1024)
    view = memoryview(data)
    mib = len(data) / 2**20
    new = _best(lambda: checksums.crc32c(view, 0), 5)
    old = _best(lambda: google_crc32c.extend(0, data), 5)
    rows.append({"what": "CRC32C of 256 MiB", "library": f"awscrt: {mib / new / 1024:.2f} GiB/s",
                 "before": f"google-crc32c: {mib / old / 1024:.2f} GiB/s", "ratio": new / old})  # fmt: skip
    a, b = checksums.crc32c(view[: 1 << 20]), checksums.crc32c(view[1 << 20 : 3 << 20])
    assert checksums.combine_crc32c(a, b, 2 << 20) == handwritten_combine(a, b, 2 << 20)
    new = _best(lambda: checksums.combine_crc32c(a, b, 64 << 20), 5, 1000)
    old = _best(lambda: handwritten_combine(a, b, 64 << 20), 5, 1000)
    rows.append({"what": "combine two CRC32Cs (64 MiB second part)", "library": f"awscrt: {new * 1e6:.2f} µs",
                 "before": f"GF(2) in Python: {old * 1e6:.2f} µs", "ratio": new / old})  # fmt: skip
    count = len(psutil.pids())
    new = _best(lambda: list(psutil.process_iter(["pid", "ppid", "status", "create_time"])), 10)
    old = _best(all_processes, 10)
    rows.append({"what": f"one pass over all {count} processes (pid, parent, state, start)",
                 "library": f"psutil.process_iter: {new * 1e3:.2f} ms",
                 "before": f"/proc/<pid>/stat (kept for the watch loop's walk, every {TREE_SCAN_EVERY:g} s): "
                           f"{old * 1e3:.2f} ms",
                 "ratio": new / old})  # fmt: skip
    new = _best(lambda: (load(CheckpointerEnv), load(StorageEnv)), 5, 200)
    names = [f"SPOTJOB_{n}" for n in ("CHECKPOINT_URI", "JOB_NAME", "EVERY_STEPS", "EVERY_SECONDS", "KEEP", "ASYNC",
                                      "STAGING_DIR", "CONTROL_DIR", "ATTEMPT", "START_FRESH", "STORAGE_PART_SIZE",
                                      "STORAGE_MULTIPART_THRESHOLD", "STORAGE_CONCURRENCY")]  # fmt: skip
    old = _best(lambda: {k: os.environ.get(k, "").strip() for k in names}, 5, 200)
    rows.append({"what": "read the Checkpointer's and a store's environment (once per Checkpointer / store)",
                 "library": f"pydantic-settings: {new * 1e3:.3f} ms", "before": f"os.environ: {old * 1e3:.3f} ms",
                 "ratio": new / old})  # fmt: skip
    lines = ["| what | now | before | time now / before |", "|---|---|---|---|"]
    lines += [f"| {r['what']} | {r['library']} | {r['before']} | {r['ratio']:.2f}x |" for r in rows]
    md = "\n".join(lines) + "\n"
    cpu = _cpu_model()
    md += f"\nCPU: {cpu}; load average {os.getloadavg()[0]:.1f}\n"
    write_results("libraries", {"rows": rows, "load_average": os.getloadavg(), "cpu": cpu})
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    (OUT_DIR / "libraries-latest.md").write_text(md)
    print(md)
    log("done")
    return 0


def _cpu_model() -> str:
    """The CPU's model name and whether it has AVX-512: the ratio of the two CRC32C libraries is the
    machine's, not a constant."""
    model, avx512 = cpu_info()
    return f"{model or 'unknown'}, {'with' if avx512 else 'no'} AVX-512"


if __name__ == "__main__":
    raise SystemExit(main())
