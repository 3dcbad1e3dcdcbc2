"""How ``spotjob ckpt`` shows what it found: for people, aligned tables (``print_table``, the rows
of ``list``: ``list_rows``) in the words of ``_verdict``, ``_when``, ``_shape`` and ``_human``, a
byte-count progress bar on stderr while a person watches (``_progress_bar``), and ``shown``, which
escapes what storage wrote before a terminal shows it; for programs, ``checkpoint_json`` (the
``--json`` of ``list``, ``verify`` and ``show``). ``kubectl spotjob`` shows checkpoints and jobs
through it too."""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Iterable, Iterator
from datetime import UTC, datetime
from typing import Any

from agent.catalog import CheckpointStatus
from agent.control_api import safe
from agent.storage.base import ProgressFn, Storage


def _interactive() -> bool:
    """Progress bars only for a person watching: never in logs, pipes or CI."""
    return sys.stderr.isatty()


@contextlib.contextmanager
def _progress_bar(description: str, total: int) -> Iterator[ProgressFn | None]:
    """A byte-count progress bar on stderr when it is a terminal; ``None`` (silence) otherwise."""
    if not _interactive() or total <= 0:
        yield None
        return
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        console=Console(stderr=True),
        transient=True,
    ) as bar:
        task = bar.add_task(description, total=total)
        # Progress.advance takes its own lock: safe from the transfer threads.
        yield lambda n: bar.advance(task, n)


def checkpoint_json(storage: Storage, status: CheckpointStatus) -> dict[str, Any]:
    """One checkpoint folder and its validity as JSON (``--json`` of ``list``, ``verify``, ``show``)."""
    m = status.manifest
    return {
        "uri": storage.url(status.ref.folder),
        "folder": status.ref.folder,
        "step": status.ref.step,
        "attempt": status.ref.attempt,
        "committed": status.committed,
        "valid": status.valid,
        "foreign": status.foreign,
        "fenced": status.fenced,
        "retired": status.retired,
        "newer_format": status.newer_format,
        "undecided": status.undecided,
        "reason": status.reason,
        # An uncommitted folder has no problem of its own to list, but it is not valid either: a
        # reader of ``problems`` learns why (as verify's has said), never an empty list beside valid false.
        "problems": list(status.problems) if status.committed else [status.reason],
        "stored_bytes": status.stored_bytes,
        "created_at": m.created_at.isoformat() if m else None,
        "world_size": m.world_size if m else None,
        "job": m.job if m else None,
        "written_by_attempt": m.attempt if m else None,
        "torch_version": m.torch_version if m else None,
        "state_keys": m.state_keys if m else None,
        "manifest_bytes": m.total_bytes if m else None,
    }


LIST_HEADERS = ["STEP", "FOLDER", "CREATED (UTC)", "RANKS", "SIZE", "STATUS"]
"""The columns of ``spotjob ckpt list`` (and ``kubectl spotjob checkpoints``)."""


def list_rows(statuses: Iterable[CheckpointStatus]) -> list[list[str]]:
    """One row of ``LIST_HEADERS`` per checkpoint folder."""
    return [
        [
            str(s.ref.step),
            s.ref.folder,
            _when(s.manifest.created_at) if s.manifest else "-",
            str(s.manifest.world_size) if s.manifest else "-",
            _human(s.stored_bytes),
            _verdict(s),
        ]
        for s in statuses
    ]


def _verdict(status: CheckpointStatus) -> str:
    if status.valid:
        return "valid"
    if not status.committed:
        return f"uncommitted leftover — {status.reason}"
    if status.foreign:
        return f"FOREIGN — {status.reason}"
    if status.fenced and len(status.problems) == 1:  # a damaged one is INVALID first: fenced says when, not what
        return f"FENCED — {status.reason}"
    if status.retired:
        return f"RETIRED — {status.reason}"
    if status.undecided:  # nothing proven: a record or manifest this spotjob cannot read now
        return f"UNDECIDED — {status.reason}"
    return f"INVALID — {status.reason}"


def _when(t: datetime) -> str:
    return t.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S")


def _shape(shape: list[int]) -> str:
    return "[" + ", ".join(str(n) for n in shape) + "]"


def _human(n: int) -> str:
    from rich.filesize import decimal

    return decimal(n)


def shown(text: str) -> str:
    """Text that may come from storage (a manifest's fields, a reason naming them), fit for a
    terminal: control characters escaped, so a crafted checkpoint cannot retitle the window, move
    the cursor or erase what an operator reads. A backslash stays one: the reasons quote names with
    ``repr``, which escaped them already, and a JSON text escapes its own (doubled again, a job
    ``team\\run`` read ``'team\\\\\\\\run'`` and an ESC ``\\\\x1b``)."""
    return safe(text, limit=len(text), backslashes=False)


def print_table(headers: list[str], rows: list[list[str]]) -> None:
    """Plain aligned columns (greppable, no colour); the last column is not padded."""
    rows = [[shown(cell) for cell in row] for row in rows]
    widths = [max(len(r[i]) for r in [headers, *rows]) for i in range(len(headers) - 1)]
    for row in [headers, *rows]:
        cells = [cell.ljust(w) for cell, w in zip(row, widths, strict=False)] + [row[-1]]
        print("  ".join(cells).rstrip())


def _print_json(doc: Any) -> None:
    print(json.dumps(doc, indent=2))
