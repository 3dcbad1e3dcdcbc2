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
import types
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
    """Stored bytes asked to run code (or build an object that is not plain data); not loaded.
    ``reason``: torch's refusal in a sentence (``refusal_reason``)."""

    def __init__(self, message: str, reason: str = "") -> None:
        super().__init__(message)
        self.reason = reason


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
        reason = refusal_reason(e)
        raise RefusedPickleError(
            f"per-rank state is not plain data, refused without running it: {reason}", reason
        ) from None
    except (RuntimeError, ValueError, EOFError, KeyError, AttributeError) as e:
        raise RankStateError(f"per-rank state cannot be read: {type(e).__name__}: {e}") from None
    if not isinstance(obj, dict):
        raise RankStateError(f"per-rank state holds a {type(obj).__name__}, expected a dict")
    return obj


class _Refused:
    """The stand-in for a value whose class or function ``weights_only`` loading refuses, built by
    ``refused_values`` instead of it: nothing of the value's own code runs (``made_by`` names the
    global that would have built it, ``args`` what it was called with)."""

    made_by = ""
    args: tuple[Any, ...] = ()

    def __new__(cls, *args: Any, **kwargs: Any) -> _Refused:  # REDUCE, NEWOBJ
        made = super().__new__(cls)
        made.args = args
        return made

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:  # BUILD
        pass

    def append(self, item: Any) -> None:  # APPEND(S) of a list subclass
        pass

    def extend(self, items: Any) -> None:
        pass

    def __setitem__(self, key: Any, value: Any) -> None:  # SETITEM(S) of a dict subclass
        pass


def _what(value: _Refused | type[_Refused]) -> str:
    """What a refused value is, in the words of its class: ``a numpy.ndarray``, ``a __main__.Order``."""
    if isinstance(value, type):
        return f"the class {value.made_by}"
    first = value.args[0] if value.args else None
    if isinstance(first, type) and issubclass(first, _Refused):
        return f"a {first.made_by}"  # built by a reconstructor from its class: copyreg's, NumPy's
    module, _, name = value.made_by.rpartition(".")
    if module.split(".", 1)[0] == "numpy" and name == "scalar":
        return "a NumPy scalar"
    return f"a {value.made_by}"


def refused_values(path: str, limit: int = 3) -> list[tuple[tuple[Any, ...], str]]:
    """Where in the rank file at ``path`` (as keys from its ``objects``: ``("sampler", "order")``)
    the values are that ``weights_only`` loading refuses, and what each is (``a numpy.ndarray``); at
    most ``limit`` of them. For the message of a save whose rank file would not load: only then, as
    ``decode`` cannot say where. The file is read with every refused global (those torch's
    ``get_unsafe_globals_in_checkpoint`` lists) replaced by a stand-in (``_Refused``), so none of
    them is imported or run; the rest is what a ``weights_only`` load builds. Empty where it
    cannot tell."""
    unsafe = set(torch.serialization.get_unsafe_globals_in_checkpoint(path))
    stand_ins: dict[str, type[_Refused]] = {}

    class StandIns(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> Any:
            qualified = f"{module}.{name}"
            if qualified not in unsafe:
                return super().find_class(module, name)
            if qualified not in stand_ins:
                stand_ins[qualified] = type(name, (_Refused,), {"made_by": qualified})
            return stand_ins[qualified]

    module = types.ModuleType("pickle")  # torch.load's pickle_module; in no sys.modules
    module.Unpickler = StandIns  # type: ignore[attr-defined]
    module.load = pickle.load  # type: ignore[attr-defined]
    payload = torch.load(path, weights_only=False, pickle_module=module, map_location="cpu", mmap=True)
    objects = payload.get("objects") if isinstance(payload, dict) else None
    found: list[tuple[tuple[Any, ...], str]] = []
    todo: list[tuple[tuple[Any, ...], Any]] = [((), objects)]
    seen: set[int] = set()
    while todo and len(found) < limit:
        where, value = todo.pop()
        if isinstance(value, _Refused) or (isinstance(value, type) and issubclass(value, _Refused)):
            found.append((where, _what(value)))
            continue
        if id(value) in seen or not isinstance(value, dict | list | tuple | set | frozenset):
            continue
        seen.add(id(value))
        if isinstance(value, dict):
            items = [((*where, k), v) for k, v in value.items()]
            items += [(where, k) for k in value if isinstance(k, _Refused)]
        elif isinstance(value, list | tuple):
            items = [((*where, i), v) for i, v in enumerate(value)]
        else:
            items = [(where, v) for v in value]  # a set's members have no place of their own
        todo.extend(reversed(items))  # depth first, in order
    return found


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
