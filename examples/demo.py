"""``make demo``: a 2-rank training job survives three spot preemptions and ends bit-identical.

1. ``spotjob run`` trains examples/train.py (2 DDP ranks on CPU, checkpoints every 25 steps) on a
   simulated spot node. At steps 100, 200 and 300 the node's IMDSv2 emulator announces a spot
   interruption with a 20 s window; the agent flushes a checkpoint, the reconciler moves the job to
   a new node, and the ranks resume from the flushed step.
2. The same training runs once more with plain torchrun, never interrupted (no step pacing: the
   pause per step only paces the demo and touches no number).
3. Both runs' final state — model, optimizer, LR schedule, data-loader position, and one draw from
   every RNG stream — is compared with ``torch.equal`` on each rank.

Exit status 0 only if ``spotjob run`` succeeded and the two final states are bit-identical. State
and logs stay in ./spotjob-runs/<name>/ (``spotjob status <name>``); the timeline plot is there too.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from agent.ranks import free_port

REPO = Path(__file__).resolve().parents[1]
TRAIN = REPO / "examples" / "train.py"
BIN = Path(sys.executable).parent
STEPS = 400
STEP_SLEEP = 0.15
"""About 60 s of training at 2 ranks on 2 cores, plus start-up."""
EVERY_STEPS = 25
PREEMPT_AT = (100, 200, 300)
NOTICE_SECONDS = 20
NPROC = 2


def tool(name: str) -> str:
    found = shutil.which(name, path=str(BIN))
    if found is None:
        sys.exit(f"demo: {name} is not installed next to {sys.executable}; run `make venv` first")
    return found


def env() -> dict[str, str]:
    out = {k: v for k, v in os.environ.items() if not k.startswith(("SPOTJOB_", "TORCHELASTIC_"))}
    out.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return out


def differences(a: Any, b: Any, path: str) -> list[str]:
    """Where ``a`` and ``b`` differ; tensors must match in dtype, shape and every bit."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        same = (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a, b)
        )
        return [] if same else [path]
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            return [f"{path} (keys)"]
        return [d for k in a for d in differences(a[k], b[k], f"{path}.{k}")]
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        if len(a) != len(b):
            return [f"{path} (length)"]
        return [d for i, (x, y) in enumerate(zip(a, b, strict=True)) for d in differences(x, y, f"{path}[{i}]")]
    return [] if type(a) is type(b) and a == b else [path]


def banner(text: str) -> None:
    print(f"\n=== {text}", flush=True)


def main() -> int:
    started = time.monotonic()
    name = f"demo-{time.strftime('%Y%m%d-%H%M%S')}"
    runs = Path("spotjob-runs").resolve()
    dumps = runs / name / "dumps"
    dumps.mkdir(parents=True)
    plot = runs / name / "timeline.png"

    banner(
        f"1/3  spotjob run: {STEPS} steps on {NPROC} ranks, checkpoints every {EVERY_STEPS} steps, spot notices "
        f"at steps {', '.join(map(str, PREEMPT_AT))} ({NOTICE_SECONDS} s windows)"
    )
    preempt = [arg for step in PREEMPT_AT for arg in ("--preempt-at-step", str(step))]
    command = [
        tool("spotjob"), "run", "--name", name, "--nproc", str(NPROC), "--every-steps", str(EVERY_STEPS),
        *preempt, "--notice", str(NOTICE_SECONDS), "--seed", "7", "--plot", str(plot),
        str(TRAIN), "--steps", str(STEPS), "--step-sleep", str(STEP_SLEEP), "--dump", str(dumps / "preempted"),
    ]  # fmt: skip
    print("$ " + " ".join(command[1:]), flush=True)
    run = subprocess.run(command, env=env())
    if run.returncode != 0:
        print(f"demo: spotjob run exited {run.returncode}; see `spotjob status {name}`", file=sys.stderr)
        return 1
    preempted_seconds = time.monotonic() - started

    banner("2/3  the same training with plain torchrun, never interrupted")
    baseline = [
        tool("torchrun"), f"--nproc-per-node={NPROC}", "--nnodes=1", "--master-addr=127.0.0.1",
        f"--master-port={free_port()}", "--max-restarts=0",
        str(TRAIN), "--steps", str(STEPS), "--uri", str(runs / name / "uninterrupted-checkpoints"),
        "--dump", str(dumps / "uninterrupted"),
    ]  # fmt: skip
    print("$ " + " ".join(["torchrun", *baseline[1:]]), flush=True)
    t0 = time.monotonic()
    plain = subprocess.run(baseline, env=env(), capture_output=True, text=True)
    if plain.returncode != 0:
        print(plain.stderr[-4000:], file=sys.stderr)
        print(f"demo: the uninterrupted run exited {plain.returncode}", file=sys.stderr)
        return 1
    print(f"done in {time.monotonic() - t0:.0f} s", flush=True)

    banner("3/3  are the final states bit-identical?")
    identical = True
    for rank in range(NPROC):
        a = torch.load(dumps / f"preempted.rank{rank}.pt", weights_only=False)
        b = torch.load(dumps / f"uninterrupted.rank{rank}.pt", weights_only=False)
        parts = []
        for key in sorted(b):
            diffs = differences(a.get(key), b[key], key)
            identical = identical and not diffs
            parts.append(f"{key} {'identical' if not diffs else 'DIFFERS at ' + ', '.join(diffs[:3])}")
        print(f"rank {rank}: " + "; ".join(parts))

    summary = json.loads((runs / name / "summary.json").read_text())
    goodput = summary.get("goodput")
    print(
        f"\nspotjob run {name}: {summary['phase']} after {summary['preemptions']} preemption(s), "
        f"{summary['steps_lost']} step(s) lost, goodput {'-' if goodput is None else f'{goodput:.0%}'} "
        f"(preempted run {preempted_seconds:.0f} s)"
    )
    print(f"timeline plot: {plot}    details: spotjob status {name}")
    verdict = "YES, bit-identical" if identical else "NO: they differ"
    print(f"final parameters, optimizer, schedule, loader and RNG vs the uninterrupted run: {verdict}")
    print(f"demo took {time.monotonic() - started:.0f} s")
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
