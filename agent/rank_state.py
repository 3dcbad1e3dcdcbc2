"""Per-rank state: RNG streams and every ``state`` value that is not a module or an optimizer.

Each rank writes ``rank-<r>.pt`` (torch.save of plain data, loaded back with ``weights_only``), so
the values are never de-duplicated across ranks the way DCP merges equal keys.

Policy when the world size changes (restore with W' ranks from a checkpoint of W ranks):

- rank r < W restores rank r's file: its RNG streams and its per-rank objects;
- rank r >= W (a rank that did not exist) restores rank 0's per-rank objects (schedulers and
  step-counting loaders are the same on every rank) but keeps its own, freshly seeded RNG
  streams — copying rank 0's would make two ranks draw identical randomness;
- ranks r >= W' of the old world (ranks that are gone) are dropped; the restore logs how many.
"""

from __future__ import annotations

import io
import logging
import pickle
import random
import re
from typing import Any, BinaryIO

import numpy as np
import torch

RNG_KEY = "__rng__"

log = logging.getLogger("agent.checkpoint")


def rank_file_name(rank: int) -> str:
    return f"rank-{rank:05d}.pt"


def capture_rng() -> dict[str, Any]:
    """Every RNG stream a training step may draw from, as plain data."""
    np_state = np.random.get_state(legacy=True)
    assert isinstance(np_state, tuple)
    kind, keys, pos, has_gauss, cached = np_state
    rng: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": {
            "kind": kind,
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    return rng


def restore_rng(rng: dict[str, Any]) -> None:
    random.setstate(_to_tuple(rng["python"]))
    n = rng["numpy"]
    np.random.set_state(
        (n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached_gaussian"])
    )
    torch.set_rng_state(rng["torch"])
    if "cuda" in rng:
        states = rng["cuda"]
        devices = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if len(states) == devices:
            torch.cuda.set_rng_state_all(states)
        else:
            # Another node type (or no GPU): which saved stream would belong to which device is
            # anyone's guess. Said, not silently skipped: training goes on, not bit-identical.
            log.warning(
                "the checkpoint holds the CUDA RNG streams of %d device(s) and this process sees %d: "
                "they are not restored (the CPU, Python and NumPy streams are), so GPU randomness "
                "(dropout on CUDA tensors) differs from the uninterrupted run",
                len(states),
                devices,
            )


def _to_tuple(value: Any) -> Any:
    # random.setstate needs tuples all the way down; serialisation may hand back lists.
    if isinstance(value, list | tuple):
        return tuple(_to_tuple(v) for v in value)
    return value


def encode(payload: dict[str, Any]) -> memoryview:
    """The rank file's bytes: ``payload`` serialized in memory (the save's snapshot of the objects'
    state), without torch.save's zip CRC-32 (the manifest's CRC32C covers the file). The buffer
    itself, not a copy: an object's ``state_dict()`` may hold gigabytes of tensors (an EMA of
    the weights), and a copy held them twice, while the CRC-32 took longer than the copy.

    ``getvalue()`` with no view exported hands over the BytesIO's own bytes object, trimmed in place,
    not a copy. Not ``getbuffer()``: on Python 3.12.0 and 3.12.1 the garbage collector crashes the
    process when it frees such a view in a reference cycle (a failed save's traceback holds one)."""
    from agent._dcp_write import save_without_crc

    buf = io.BytesIO()
    save_without_crc(payload, buf)
    return memoryview(buf.getvalue())


class RefusedPickleError(ValueError):
    """Stored bytes asked to run code (or build an object that is not plain data); not loaded."""


def refusal_reason(e: BaseException) -> str:
    """The useful part of torch's weights_only refusal, without its advice to turn the check off."""
    # An allowed module's class: torch folds what it refused into its advice paragraph.
    found = re.search(r"WeightsUnpickler error: (.+?)(?: Please use|$)", str(e), re.MULTILINE)
    if found:
        return found.group(1).strip()
    advice = ("Weights only load failed", "Check the documentation", "Please file an issue")
    paragraphs = [p.strip() for p in str(e).split("\n\n") if p.strip()]
    useful = [p for p in paragraphs if not p.startswith(advice)]
    return " ".join(useful) if useful else type(e).__name__


class RankStateError(ValueError):
    """Stored bytes that are not a per-rank state file (unparseable, or not the expected dict)."""


def decode(data: bytes | str | BinaryIO, *, mmap: bool = False) -> dict[str, Any]:
    """Load a rank file (its bytes, its path, or the file open for reading); plain data and
    tensors only (``weights_only``).

    A path is read straight into the tensors, without a copy of the whole file in memory first;
    with ``mmap`` its tensors are views of the file, so checking that a file loads costs no copy
    of its tensors at all.

    Raises ``RefusedPickleError`` for bytes that ask to run code, ``RankStateError`` for bytes
    that are not a rank file at all; both prove the file bad, nothing else does.
    """
    source: str | BinaryIO = io.BytesIO(data) if isinstance(data, bytes) else data
    try:
        obj = torch.load(source, weights_only=True, map_location="cpu", mmap=mmap)
    except pickle.UnpicklingError as e:
        raise RefusedPickleError(
            f"per-rank state is not plain data, refused without running it: {refusal_reason(e)}"
        ) from None
    except (RuntimeError, ValueError, EOFError, KeyError, AttributeError) as e:
        raise RankStateError(f"per-rank state cannot be read: {type(e).__name__}: {e}") from None
    if not isinstance(obj, dict):
        raise RankStateError(f"per-rank state holds a {type(obj).__name__}, expected a dict")
    return obj


PAYLOAD_KEYS = frozenset({"step", "rank", "world_size", "objects", "rng"})
"""What a rank file holds (``Checkpointer`` writes these, unchanged since the first spotjob)."""
RNG_KEYS = frozenset({"python", "numpy", "torch", "cuda"})


def unknown_entries(payload: dict[str, Any]) -> list[str]:
    """What a rank file holds that this spotjob would not restore (``loader``, ``rng.xla``): the file
    has no format number of its own, so a newer spotjob keeping more in it is told by these."""
    unknown = sorted(str(k) for k in payload if k not in PAYLOAD_KEYS)
    rng = payload.get("rng")
    if isinstance(rng, dict):
        unknown += sorted(f"rng.{k}" for k in rng if k not in RNG_KEYS)
    return unknown


def source_rank(rank: int, saved_world_size: int) -> int:
    """Which saved rank's file ``rank`` restores from (see the module docstring)."""
    return rank if rank < saved_world_size else 0
