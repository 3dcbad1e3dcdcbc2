"""Checkpoints set aside by a deliberate fresh start (``start_fresh``). No torch import.

When committed checkpoints exist under a URI but none of them loads (all corrupt, or the model
changed shape), ``Checkpointer.restore`` refuses to start from step 0 unless told to. Told to, it
*retires* those checkpoints instead of deleting them: one create-only record per folder,
``<uri>/.spotjob/retired/<folder>.json``, saying when, why and by which job and attempt.

A retired checkpoint stays in storage, byte for byte, for whoever wants it back (a post-mortem,
an ``export``); it is never restored, never counted or deleted by retention, and its folder name
stays taken (a new save of that step goes to ``step-N.1``). So the new run's saves, whose steps
start again from 0 and so sort *below* the retired ones, can never be confused with them: restore
walks past the retired folders without reading them, and retention never keeps a retired
checkpoint in place of one of the new run's, nor deletes one. Deleting them is left to a person
(``spotjob ckpt`` or the store's own tools).

Records are immutable: a folder once retired stays retired (a second fresh start adds records for
what it refused; an existing record is kept as it is). Listing them is one listing call.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from datetime import UTC, datetime

from agent._layout import CONTROL_FOLDER, CheckpointRef
from agent.storage.base import AlreadyExistsError, Storage

log = logging.getLogger(__name__)

RETIRED_PREFIX = f"{CONTROL_FOLDER}/retired/"
_SUFFIX = ".json"


def retired_key(ref: CheckpointRef) -> str:
    return f"{RETIRED_PREFIX}{ref.folder}{_SUFFIX}"


def retired_folders(storage: Storage) -> set[str]:
    """The checkpoint folders a fresh start retired (one listing; ``StorageError`` if it fails)."""
    out = set()
    for info in storage.list(RETIRED_PREFIX):
        name = info.key[len(RETIRED_PREFIX) :]
        if name.endswith(_SUFFIX) and CheckpointRef.parse(name[: -len(_SUFFIX)]) is not None:
            out.add(name[: -len(_SUFFIX)])
    return out


def retire(
    storage: Storage, refused: Iterable[tuple[CheckpointRef, str]], *, job: str | None, attempt: int | None
) -> None:
    """Record each ``(folder, why it was refused)`` as retired, create-only. ``StorageError`` if a
    record cannot be written (then the fresh start must not go ahead)."""
    now = datetime.now(UTC).isoformat()
    for ref, reason in refused:
        record = {"folder": ref.folder, "retired_at": now, "job": job, "attempt": attempt, "reason": reason}
        try:
            storage.put_bytes_if_absent(retired_key(ref), json.dumps(record, indent=2).encode())
        except AlreadyExistsError:
            continue
        log.warning("fresh start: %s is retired (kept, never restored or deleted): %s", storage.url(ref.folder), reason)
