"""Rank-side half of the checkpoint integration tests; run under torchrun (or plain python = 1 rank).

    ckpt_job.py save-restore --uri U --dump D   train, save step 7, close; restore into fresh objects
    ckpt_job.py restore --uri U --dump D        restore into fresh objects (any world size)
    ckpt_job.py saves --uri U --steps A B       job "train" (keep=1) saves steps A..B, one at a time,
                                                logging retention at debug level
    ckpt_job.py interrupt --uri U --markers M --stage {staging,upload,manifest}
                                                commit step 1, then freeze the save of step 2 at the
                                                stage (marker file + sleep forever) for a kill -9

Each rank dumps to ``D.rank<r>.pt``. The freezes monkeypatch seams outside spotjob's production
code: DCP's writer (staging/writing), the storage's ``put_file`` (mid-upload, after one file went
through) and ``put_bytes_if_absent`` (just before the manifest; the folder's claim goes through).
"""

from __future__ import annotations

import argparse
import logging
import os
import threading
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from ckpt_state import SAVE_STEP, exit_without_teardown, make_state, rng_snapshot, seed_rngs, snapshot, train
from torch.distributed.checkpoint.filesystem import FileSystemWriter

from agent.checkpoint import Checkpointer

log = logging.getLogger("ckpt_job")


def _rank() -> tuple[int, int]:
    if "WORLD_SIZE" in os.environ:
        dist.init_process_group("gloo")
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _dump(path: str, rank: int, payload: dict[str, Any]) -> None:
    torch.save(payload, f"{path}.rank{rank}.pt")


def save_restore(args: argparse.Namespace, rank: int, world: int) -> None:
    seed_rngs(100, rank)
    state = make_state(rank, seed=0)
    train(state, SAVE_STEP)
    with Checkpointer(args.uri, keep=None) as ckpt:
        saved, saved_rng = snapshot(state), rng_snapshot()
        ckpt.save(SAVE_STEP, state)
    seed_rngs(900, rank)
    fresh = make_state(rank, seed=1)
    with Checkpointer(args.uri, keep=None) as ckpt:
        before = rng_snapshot()
        step = ckpt.restore(fresh)
        after = rng_snapshot()
    _dump(
        args.dump,
        rank,
        {
            "world_size": world,
            "step": step,
            "saved": saved,
            "saved_rng": saved_rng,
            "restored": snapshot(fresh),
            "rng_before": before,
            "rng_after": after,
        },
    )


def restore(args: argparse.Namespace, rank: int, world: int) -> None:
    seed_rngs(500, rank)
    fresh = make_state(rank, seed=1 + rank)
    with Checkpointer(args.uri, keep=None) as ckpt:
        before = rng_snapshot()
        step = ckpt.restore(fresh)
        after = rng_snapshot()
    _dump(
        args.dump,
        rank,
        {"world_size": world, "step": step, "restored": snapshot(fresh), "rng_before": before, "rng_after": after},
    )


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{threading.get_ident()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def _freeze(markers: Path, stage: str, rank: int) -> None:
    """Say where we are (the marker holds our pid), then never return: the test kills us here."""
    _write_atomically(markers / f"{stage}.rank{rank}", str(os.getpid()))
    log.info("rank %d frozen at %s", rank, stage)
    threading.Event().wait()


def interrupt(args: argparse.Namespace, rank: int, world: int) -> None:
    markers = Path(args.markers)
    seed_rngs(100, rank)
    state = make_state(rank)
    ckpt = Checkpointer(args.uri, keep=None)
    train(state, 1)
    ckpt.save(1, state)
    ckpt.wait()
    _write_atomically(markers / f"pid.rank{rank}", str(os.getpid()))

    if args.stage == "staging":

        def write_data(self: Any, *a: Any, **kw: Any) -> Any:
            _freeze(markers, "staging", rank)

        FileSystemWriter.write_data = write_data  # type: ignore[method-assign]
    elif args.stage == "upload":
        put_file, lock, calls = ckpt.storage.put_file, threading.Lock(), [0]

        def first_then_freeze(*a: Any, **kw: Any) -> None:
            with lock:
                calls[0] += 1
                first = calls[0] == 1
            if first:
                put_file(*a, **kw)
                return
            _freeze(markers, "upload", rank)

        ckpt.storage.put_file = first_then_freeze  # type: ignore[method-assign]
    else:
        put_bytes_if_absent = ckpt.storage.put_bytes_if_absent

        def freeze_at_the_manifest(key: str, data: bytes) -> None:
            if key.endswith("/MANIFEST.json"):
                _freeze(markers, "manifest", rank)
            put_bytes_if_absent(key, data)  # the folder's claim (WRITER.json)

        ckpt.storage.put_bytes_if_absent = freeze_at_the_manifest  # type: ignore[method-assign]

    train(state, 1, start=1)
    ckpt.save(2, state)
    ckpt.wait()
    raise AssertionError("the save of step 2 was supposed to freeze")


def saves(args: argparse.Namespace, rank: int, world: int) -> None:
    logging.getLogger("agent.checkpoint").setLevel(logging.DEBUG)
    state = make_state(rank, seed=0)
    first, last = args.steps
    with Checkpointer(args.uri, keep=1, job="train", async_save=False) as ckpt:
        for step in range(first, last + 1):
            train(state, 1, start=step - 1)
            ckpt.save(step, state)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("command", choices=["save-restore", "restore", "interrupt", "saves"])
    p.add_argument("--uri", required=True)
    p.add_argument("--dump")
    p.add_argument("--markers")
    p.add_argument("--stage", choices=["staging", "upload", "manifest"])
    p.add_argument("--steps", type=int, nargs=2)
    args = p.parse_args()
    rank, world = _rank()
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank{rank} %(name)s %(levelname)s: %(message)s")
    {"save-restore": save_restore, "restore": restore, "interrupt": interrupt, "saves": saves}[args.command](
        args, rank, world
    )
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_without_teardown()
