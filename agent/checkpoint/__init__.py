"""Checkpointer: sharded, resumable, asynchronous checkpoints committed by a manifest written last.

What the training script calls, in order (every rank calls every method):

1. ``Checkpointer(uri, ...)`` or ``Checkpointer.from_env()`` — creates two gloo groups of its own
   (a collective: all ranks construct it in the same order). One carries the background save
   (DCP's async save must not share a group with training collectives, or they deadlock); the
   other carries the per-step vote and restore. (rank 0) claims the URI for the job
   (``agent.ownership``); another job's URI fails on every rank.
2. ``restore(state)`` — loads the newest valid checkpoint in place, returns its step (0 if none).
3. ``step(n, state)`` per step — saves per policy; returns True when the job must stop now (a
   preemption flush committed).
4. ``close()`` — waits for the save in flight.

A reader beside the job (``read_only=True``: an eval job) calls ``newest_step()`` to learn, without
loading anything, whether a newer checkpoint than the one it last restored was committed.

One save, from the training loop's point of view: ``state`` is turned into DCP state dicts
(modules and optimizers, which reshard) and per-rank bytes (everything else and the RNG streams);
the tensors are staged to CPU memory — the only time the loop is blocked. In a background thread
each rank then writes its DCP shard, CRC32Cs and uploads its own files; rank 0 gathers every
rank's file list, checks that its attempt is not fenced, writes MANIFEST.json create-only and
tells every rank the outcome; then it applies retention. At most one save is in flight; a failed
one raises on the next call.

The vote: the agent drops ``flush.json`` (stop) or ``save.json`` (save early) in the control
folder. At the end of each ``step()`` every rank launches an asynchronous all-reduce on the
control group of [flush asked, save-early asked, every_seconds due, step, -step]; its result is
read at the next ``step()``, so every rank acts on the same flags at the same step without the
loop ever waiting on the network, and ranks that report different steps are caught. The flags
are gathered after the step's own save started, so one trigger makes one save.

Restore never goes back in time on its own: a checkpoint proven bad (CRC mismatch, a missing or
short file, a manifest or metadata that does not parse or is unsafe) is skipped for an older one;
a store that keeps failing raises ``StorageUnavailableError``, one that refuses for good (no such
bucket, permission denied) ``StorageRefusedError``; a checkpoint the model cannot take
(changed shapes) raises ``RestoreRefusedError``, as does a URI whose committed checkpoints all
fail — unless ``start_fresh`` says to begin at step 0, which retires them (``agent._fresh_start``).

Nothing here touches what the process owns: no global RNG draw or reseed (only a restore sets
the streams, to the checkpoint's), no change to torch's serialization options, no warning filter.

Where each part lives: ``checkpointer`` (the class and its public calls), ``config`` (the options
and input checks), ``errors``; the parts the class joins: ``_vote`` (the per-step vote),
``_save`` (the save pipeline and the flush), ``_restore`` (the restore walk), ``_retention``,
``_state`` (what a state dict holds), ``_core`` (shared state and collectives); and ``_claim``
(``WRITER.json``: which writer a folder in flight belongs to).

Importing this package checks torch's version first (``_torch_floor.MIN_TORCH``): an older torch is an
``ImportError`` that says so, not a failure inside DCP at the first save.
"""

# First: an older torch is refused before any module below imports DCP.
from agent.checkpoint import _torch_floor  # noqa: F401  (isort: keep first)
from agent.checkpoint.checkpointer import Checkpointer
from agent.checkpoint.config import CheckpointConfig, normalise_uri
from agent.checkpoint.errors import (
    CheckpointError,
    CheckpointOwnershipError,
    CheckpointUriError,
    FencedSaveError,
    FlushFailedError,
    MissingStateKeysError,
    RestoreError,
    RestoreRefusedError,
    SaveFailedError,
    StorageRefusedError,
    StorageUnavailableError,
)
from agent.checkpoint.errors import _is_infrastructure as _is_infrastructure  # tests classify with it

__all__ = [
    "CheckpointConfig",
    "CheckpointError",
    "CheckpointOwnershipError",
    "CheckpointUriError",
    "Checkpointer",
    "FencedSaveError",
    "FlushFailedError",
    "MissingStateKeysError",
    "RestoreError",
    "RestoreRefusedError",
    "SaveFailedError",
    "StorageRefusedError",
    "StorageUnavailableError",
    "normalise_uri",
]
