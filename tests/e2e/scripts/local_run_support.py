"""Helpers of the local-mode end-to-end tests (imported by tests/e2e/conftest.py and the tests).

- ``TRAIN`` / ``STEPS`` / ``NPROC``: examples/train.py (2 DDP ranks over gloo, every RNG stream
  drawn each step), short enough for a loaded 2-core machine; step pacing (``--step-sleep``)
  changes only how long a step takes, never the numbers.
- ``clean_env``: this environment without spotjob's or torchrun's own variables.
- ``run``: a subprocess to its end, its output captured; the timeout only stops a hung run.
- ``assert_same_final_state(prefix_a, prefix_b)``: every rank's dump equal, tensors with
  ``torch.equal`` (dtype, shape, every bit), everything else with ``==``.
- ``uninterrupted_dump(tmp_path_factory)``: the dump prefix of the job run start to finish with
  plain torchrun, run once per test session (both suites' ``uninterrupted`` fixture).
- ``wait_for(predicate, what)``: poll until true, or fail naming ``what`` after ``GIVE_UP_S``.
- ``job_document(run_folder)``: the run's stored job (spec and status), ``{}`` while unreadable.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch
from ckpt_compare import differences  # tests/ckpt_compare.py, shared by every suite

from agent.ranks import free_port
from orchestrator.backends.local_cloud import run_pids

REPO = Path(__file__).resolve().parents[3]
TRAIN = REPO / "examples" / "train.py"
STEPS = 60
NPROC = 2
BIN = Path(sys.executable).parent
HANG_GUARD_S = 420.0
"""Only stops a hung subprocess; nothing asserts how long anything took."""


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without spotjob's or torchrun's own variables, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SPOTJOB_", "TORCHELASTIC_"))}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.update(extra)
    return env


def tool(name: str) -> str:
    found = shutil.which(name, path=str(BIN))
    assert found, f"{name} is not installed next to {sys.executable}"
    return found


def run(argv: list[str], *, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=HANG_GUARD_S)
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
        raise AssertionError(f"{' '.join(argv)} hung:\n{out[-4000:]}\n{err[-8000:]}") from None


def assert_same_final_state(actual: Path, expected: Path) -> None:
    """Every rank's final model, optimizer, schedule, loader position and RNG draws are identical."""
    for rank in range(NPROC):
        got = torch.load(f"{actual}.rank{rank}.pt", weights_only=False)
        want = torch.load(f"{expected}.rank{rank}.pt", weights_only=False)
        assert set(want) == {"model", "optim", "sched", "loader", "rng"}
        assert want["loader"]["position"] == STEPS
        diffs = differences(got, want)
        assert not diffs, f"rank {rank}'s final state differs in {len(diffs)} place(s): {diffs[:10]}"


def uninterrupted_dump(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The dump prefix of the job run start to finish with plain torchrun (no spotjob, no notices).

    Run once per test session, not once per pytest-xdist worker and suite (tests/e2e and
    tests/e2e_k8s both compare against it): it lives in the folder every worker's temporary folder
    is in, and the first worker to take the lock runs it while the others wait for it. A run that
    failed is not shared: the next worker runs it again, from scratch, and fails with its own output.
    """
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the session's folder; each worker's basetemp is root/popen-gw<n>
    folder = root / "uninterrupted-shared"
    folder.mkdir(exist_ok=True)
    with open(folder / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file is closed
        if not (folder / "done").exists():
            ckpt = tempfile.mkdtemp(prefix="ckpt-", dir=folder)  # a failed try's checkpoints are not resumed
            argv = [
                tool("torchrun"), f"--nproc-per-node={NPROC}", "--nnodes=1", "--master-addr=127.0.0.1",
                f"--master-port={free_port()}", "--max-restarts=0",
                str(TRAIN), "--steps", str(STEPS), "--uri", ckpt, "--dump", str(folder / "final"),
            ]  # fmt: skip
            proc = run(argv, cwd=REPO, env=clean_env())
            assert proc.returncode == 0, f"the uninterrupted run failed:\n{proc.stderr[-8000:]}"
            (folder / "done").write_text("")
    return folder / "final"


GIVE_UP_S = 240.0
"""How long ``wait_for`` waits for something to happen before calling the run hung (never asserted on)."""


def flip_byte_in_place(path: Path) -> None:
    """Invert one byte in the middle of ``path``, its size unchanged: damage only a CRC32C finds."""
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.seek(size // 2)
        byte = f.read(1)
        f.seek(size // 2)
        f.write(bytes([byte[0] ^ 0xFF]))
    assert path.stat().st_size == size


def wait_for(predicate: Callable[[], bool], what: str) -> None:
    give_up = time.monotonic() + GIVE_UP_S
    while not predicate():
        if time.monotonic() > give_up:
            raise AssertionError(f"gave up waiting for {what}")
        time.sleep(0.1)


def job_document(run: Path) -> dict[str, Any]:
    try:
        return dict(json.loads((run / "local" / f"{run.name}.json").read_text()))
    except (FileNotFoundError, ValueError):
        return {}


def process_states(driver: subprocess.Popen[Any], run: Path) -> set[str]:
    """The psutil states of a ``spotjob run`` driver and of every process of its run (found by the
    run's marker): ``{"stopped"}`` once a Ctrl-Z paused them all."""
    out = set()
    for pid in [driver.pid, *run_pids(str(run))]:
        with contextlib.suppress(psutil.NoSuchProcess):
            out.add(psutil.Process(pid).status())
    return out
