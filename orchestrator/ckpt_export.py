"""``spotjob ckpt export``, the command around its engine (``agent.export``): it checks OUT (named,
local, absent or empty unless ``--force``, outside every folder spotjob writes), picks the
checkpoint (``newest_valid``, or the one folder ``--step N.A`` names), pins it while it is read,
passes over one that reading proves bad and starts again from the newest when retention deleted
the one it read, and says on stderr what it left out, and on stdout what it wrote where."""

from __future__ import annotations

import argparse
import functools
import os
import re
import sys
import time

from agent.catalog import CheckpointRef, CheckpointStatus
from agent.export import INDEX_NAME, ExportError, ExportTotals, export_safetensors
from agent.pins import pinned
from agent.storage.base import Storage
from orchestrator.ckpt_common import EXIT_ERROR, EXIT_INVALID, EXIT_OK, CommandError, _need_torch_extra
from orchestrator.ckpt_output import _human, _progress_bar, shown
from orchestrator.ckpt_select import (
    _RELISTS,
    _deleted,
    _require_manifest,
    _require_state_key,
    newest_valid,
    opened_storage,
    select_checkpoint,
)


def cmd_export(args: argparse.Namespace) -> int:
    if not args.out.strip():
        # os.path.abspath("") is the working directory: an unset "$OUT" would export into it.
        raise CommandError("OUT is empty: name the folder to write the export in (e.g. ./export)")
    if re.match(r"[A-Za-z][A-Za-z0-9+.-]*://", args.out) or re.match(r"(s3|gs|file):", args.out, re.IGNORECASE):
        # os.path.abspath("s3://b/x") is a local folder named "s3:" under the working directory, and
        # so is a store's URI a slash short (gs:/b/x) or without its slashes (gs:b, a folder "gs:b").
        raise CommandError(
            f"OUT {args.out!r} is a URI: export writes a local folder (this would have been a folder named "
            f"{args.out.split('/', 1)[0]!r} here); export to a local path, then copy the folder where it belongs "
            "(aws s3 cp --recursive, gcloud storage cp --recursive)"
        )
    _need_torch_extra("export", ("torch", "numpy", "safetensors"))
    out = os.path.abspath(args.out)
    _check_out(out, force=args.force)
    started = time.monotonic()
    with opened_storage(args.uri) as storage:
        _check_out_not_in_uri(storage, out)
        if args.step is not None and args.step.attempt is not None:
            status = select_checkpoint(storage, args.step)  # one folder, named exactly: that one or nothing
            files, total = _export(storage, status, args, out, walking=False)
        else:
            # As a restore walks them (through every checkpoint, or through step N's attempts): one
            # whose bytes prove it bad (a CRC32C mismatch, an unsafe .metadata) is passed over for
            # the next valid one; any other failure stops the export.
            step = None if args.step is None else args.step.step
            passed: list[tuple[str, str]] = []
            status = newest_valid(storage, step=step)
            deleted = 0
            while True:
                try:
                    files, total = _export(storage, status, args, out, walking=True)
                    break
                except _Deleted as e:
                    deleted += 1
                    if deleted > _RELISTS:
                        raise CommandError(str(e)) from None
                    # Retention removed it as the job saved a newer one: the newest again, from the top.
                    print(
                        f"spotjob ckpt export: {status.ref.folder} was deleted while it was read (retention of "
                        "the job saving to this URI); exporting the newest checkpoint again",
                        file=sys.stderr,
                    )
                    status = newest_valid(storage, step=step)
                except _ProvenBad as e:
                    # Said by newest_valid once it finds another to export; else its error names it.
                    passed.append((status.ref.folder, str(e.error).removeprefix(f"{status.ref.folder}: ")))
                    status = newest_valid(storage, step=step, below=status.ref, passed=passed)
    if total.left_out:
        named = ", ".join(repr(shown(n)) for n in total.left_out[:_LEFT_OUT_NAMED])
        more = len(total.left_out) - _LEFT_OUT_NAMED
        one = len(total.left_out) == 1
        entries, are, them = ("entry", "is", "it") if one else ("entries", "are", "them")
        also = f" and {more} more" if more > 0 else ""
        print(
            f"spotjob ckpt export: {len(total.left_out)} {entries} of state key {args.key!r} {are} not a tensor "
            f"and not in the export (safetensors holds tensors only): {named}{also}. "
            f"Loading the export with load_state_dict(strict=True) reports {them} missing: load with "
            f"strict=False, or restore the checkpoint with Checkpointer(uri, read_only=True) to have {them}",
            file=sys.stderr,
        )
    print(
        f"exported {total.tensors} tensors ({_human(total.bytes)}) of state key {args.key!r} from "
        f"{storage.url(status.ref.folder)} to {shown(out)}: {len(files)} file(s) + {INDEX_NAME} "
        f"in {time.monotonic() - started:.1f}s"
    )
    return EXIT_OK


_LEFT_OUT_NAMED = 5
"""How many of the non-tensor entries an export leaves out it names."""


class _Deleted(Exception):
    """The checkpoint being exported was deleted while it was read (its manifest is gone now)."""


class _ProvenBad(Exception):
    """An export stopped by reading a checkpoint that is proven bad (``ExportError.proven_bad``)."""

    def __init__(self, error: ExportError) -> None:
        super().__init__(str(error))
        self.error = error


def _export(
    storage: Storage, status: CheckpointStatus, args: argparse.Namespace, out: str, *, walking: bool
) -> tuple[list[str], ExportTotals]:
    """Export ``status``; ``CommandError`` on failure, except when ``walking`` (it was picked as
    the newest valid, of all or of step N's attempts): ``_ProvenBad`` when reading it proved it
    bad, and (without ``--step``) ``_Deleted`` when retention deleted it meanwhile."""
    manifest = _require_manifest(status)
    if not status.valid:
        raise CommandError(f"{status.ref.folder} is invalid, refusing to export it: {status.reason}", EXIT_INVALID)
    _require_state_key(manifest, args.key)
    try:
        with pinned(storage, status.ref.folder):  # the job's retention leaves it while it is read
            return export_safetensors(
                storage,
                status,
                manifest,
                args.key,
                out,
                args.max_shard_size,
                args.force,
                progress_bar=_progress_bar,
                removed=functools.partial(_report_removed, out),
            )
    except (ExportError, FileNotFoundError) as e:  # FileNotFoundError: a file read in place, gone
        if _deleted(storage, status):
            raise (_Deleted if walking and args.step is None else CommandError)(
                f"{status.ref.folder} was deleted while it was being exported (the retention of the job saving "
                f"to this URI removes old checkpoints); nothing was exported to {out}. Export again, or name a "
                "checkpoint retention keeps with --step"
            ) from None
        if not isinstance(e, ExportError):
            raise
        if e.proven_bad and walking:
            raise _ProvenBad(e) from None
        raise CommandError(str(e), EXIT_INVALID if e.invalid else EXIT_ERROR) from None


def _report_removed(out: str, names: list[str]) -> None:
    """``--force`` removed ``names`` of an earlier export from ``out``: said as export's other
    messages are, one line on stderr."""
    files = "1 file" if len(names) == 1 else f"{len(names)} files"
    print(
        f"spotjob ckpt export: --force: removed {files} of an earlier export from {shown(out)}: "
        + ", ".join(shown(n) for n in names),
        file=sys.stderr,
    )


def _check_out(out: str, *, force: bool) -> None:
    if os.path.islink(out) and not os.path.exists(out):
        raise CommandError(
            f"{out} is a symbolic link to {os.readlink(out)}, which does not exist: create that folder, "
            "or export to another one"
        )
    if os.path.exists(out) and not os.path.isdir(out):
        raise CommandError(f"{out} exists and is not a folder")
    if os.path.isdir(out) and os.listdir(out) and not force:
        raise CommandError(f"{out} is not empty; choose a new folder or pass --force to replace an export there")


def _check_out_not_in_uri(storage: Storage, out: str) -> None:
    """Refuse an ``OUT`` inside a checkpoint folder (or spotjob's own) of a filesystem URI: the
    export would change a committed folder, and the job's retention would delete it with that folder."""
    root = storage.local_path("")
    if root is None:
        return
    rel = os.path.relpath(os.path.realpath(out), os.path.realpath(root))
    first = rel.split(os.sep)[0]
    if first != ".." and (CheckpointRef.parse(first) is not None or first.startswith(".spotjob")):
        raise CommandError(
            f"OUT {out} lies in {storage.url(first)}, a folder spotjob writes and deletes (a checkpoint's, "
            "or its own records'): the export would change it, and retention would delete the export with "
            f"it. Export to a folder outside it, e.g. beside {storage.uri}"
        )
