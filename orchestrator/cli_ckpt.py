"""``spotjob ckpt``: look inside a checkpoint URI — list, verify, show, export — and adopt one.

Every command reads storage through ``agent.storage`` and trusts nothing it has not checked
against a manifest: ``list``/``verify``/``show`` work from MANIFEST.json and one listing per
folder; ``verify --deep`` and ``export`` also read the shard bytes, CRC32C-checked as they
arrive, and unpickle DCP's ``.metadata`` only through the allow-list of ``agent.dcp_safe``.

``list``, ``show`` and plain ``verify`` never import torch (they run in the controller's image,
which carries none); ``verify --deep`` and ``export`` import it lazily.

Validity is ``agent.catalog.inspect``'s, the one decision restore, retention and the controller
use too: a command never holds a second opinion. ``verify --deep`` adds what reading every byte
finds (CRC32C, the unpickling a restore would do) on top of it.

Which checkpoint a command picks when ``--step`` is not given: for ``verify`` and ``show``, the
newest folder that holds a MANIFEST.json (the newest *committed* checkpoint), valid or not. An
uncommitted folder is a save still running or one that died, never a checkpoint; a committed but
broken one is exactly what an operator asking "is my latest checkpoint good?" must hear about, so
it is not skipped. ``export`` picks the newest *valid* one, the one a restore would load, and
says why each newer one was passed over; with none valid it names them all and why.

A step can be committed more than once (``step-N``, then ``step-N.1``, …: saved again, after its
checkpoint turned out broken or by an explicit ``save()`` of a step the policy saved). ``--step
N`` picks among its attempts as the command picks among steps: ``verify`` and ``show`` the
newest committed attempt, valid or not; ``export`` the newest valid one (as a restore walking
back would reach it), saying which newer attempts it passed over and why. ``--step N.A`` names
one folder exactly, which ``export`` refuses when it is not valid.

``adopt`` is the one command that writes: it makes another job the owner of the URI (see
``agent.ownership``), so that job resumes from the checkpoints there.

Exit status: 0 success; 1 the checkpoint is invalid or unsafe (``verify`` found a problem,
``show``/``export`` refused it); 2 nothing could be checked or done (bad URI, no such folder or
step, storage unreachable, an export refused for its arguments, a checkpoint a newer spotjob
wrote: not proven bad, only unreadable here) — the same code argparse uses for a bad command line.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import logging
import os
import re
import sys
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from agent.catalog import (
    CheckpointRef,
    CheckpointStatus,
    Lineage,
    find_checkpoints,
    inspect,
    inspect_all,
    verify_deep,
)
from agent.control_api import safe
from agent.export import INDEX_NAME, ExportError, ExportTotals, checkpoint_reader, export_safetensors
from agent.manifest import DCP_METADATA_NAME, MANIFEST_NAME, RANK_FILE_RE, Manifest
from agent.ownership import Adoption, OwnershipError, adopt, describe_job, job_name_problem, read_owner
from agent.pins import pinned
from agent.storage import StorageError, open_storage
from agent.storage.base import ProgressFn, Storage
from orchestrator.cli_pipe import stdout_reader_left

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata


log = logging.getLogger(__name__)

EXIT_OK = 0
EXIT_INVALID = 1
EXIT_ERROR = 2

DEFAULT_MAX_SHARD_SIZE = "5GB"
NOISY_LOGGERS = ("botocore", "boto3", "s3transfer", "urllib3", "google", "awscrt")
"""The cloud clients' loggers, whose INFO lines ("Found credentials in environment variables") a
command's user has no use for: set to WARNING unless -v."""

_DEFAULT_PICK = (
    "Default: the newest committed checkpoint (the newest folder holding a MANIFEST.json, valid or "
    "not; uncommitted leftovers are never picked)"
)
_EXIT_CODES = (
    "exit status: 0 ok; 1 the checkpoint is invalid or unsafe; "
    "2 nothing could be checked or done (bad URI, no such folder/step, storage error, bad arguments)"
)


class CommandError(Exception):
    """A one-line reason a command stopped, printed without a traceback, and its exit status."""

    def __init__(self, message: str, exit_code: int = EXIT_ERROR) -> None:
        super().__init__(message)
        self.exit_code = exit_code


# ------------------------------------------------------------------------------------------------
# registration
# ------------------------------------------------------------------------------------------------
def register(subparsers: Any) -> None:
    """Add ``spotjob ckpt {list,verify,show,export,adopt}`` to the top-level subparsers."""
    ckpt = subparsers.add_parser(
        "ckpt",
        help="list, verify, show and export checkpoints; adopt a URI",
        description="Inspect the checkpoints under a URI (s3://bucket/prefix, gs://bucket/prefix, "
        "file:///path or a plain path).",
        epilog=_EXIT_CODES,
    )
    sub = ckpt.add_subparsers(dest="ckpt_command", metavar="COMMAND", required=True)

    p = sub.add_parser(
        "list",
        help="every checkpoint folder, newest first, valid or not and why",
        description="List every checkpoint folder under URI, newest first: step, folder, creation "
        "time (UTC), world size, bytes stored, and whether it is valid — or why not (uncommitted "
        "leftover, missing file, file of the wrong size, manifest refused, FOREIGN: written by a job "
        "that does not own the URI, FENCED: written by a stale attempt of the job, RETIRED: set aside "
        "by a fresh start). Sizes are "
        "checked; contents are not (see `verify --deep`).",
        epilog=_EXIT_CODES,
    )
    _add_uri(p)
    p.add_argument("--json", action="store_true", help="print a JSON array instead of a table")
    p.set_defaults(func=_boundary(cmd_list))

    p = sub.add_parser(
        "verify",
        help="check one checkpoint; exit 0 when valid, 1 when not",
        description="Check one checkpoint: MANIFEST.json parses and names only files inside its "
        "folder, and every file it lists is there with its listed size. --deep also reads every byte "
        "and checks every CRC32C, unpickles DCP's .metadata with the allow-list unpickler and the "
        f"per-rank files with weights_only, as a restore would. {_DEFAULT_PICK}.",
        epilog=_EXIT_CODES,
    )
    _add_uri(p)
    _add_step(p)
    p.add_argument("--deep", action="store_true", help="read every byte and check every CRC32C")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=_boundary(cmd_verify))

    p = sub.add_parser(
        "show",
        help="what a checkpoint holds: tensors, state keys, world size, metadata",
        description=f"Show a checkpoint's manifest: step, creation time, world size, state keys, user "
        f"metadata and the tensor index (name, shape, dtype, shard files). {_DEFAULT_PICK}.",
        epilog=_EXIT_CODES,
    )
    _add_uri(p)
    _add_step(p)
    p.add_argument("--key", help="only the tensors under this state key (e.g. model)")
    p.add_argument("--json", action="store_true", help="print the manifest and status as JSON")
    p.set_defaults(func=_boundary(cmd_show))

    p = sub.add_parser(
        "export",
        help="write a module's weights as sharded safetensors (Hugging Face layout)",
        description="Export the tensors saved under one state key (default: model) as safetensors "
        "files laid out as Hugging Face does: model-00001-of-0000N.safetensors (model.safetensors when "
        f"everything fits in one shard) plus {INDEX_NAME}, which is written always (harmless for a "
        "single file, and one loading path for every export). Tensor names lose the state key prefix, "
        "so they match the module's own state_dict(); entries that are not tensors (a module's _extra_state, an "
        "optimizer's param_groups) are left out and named on stderr. Tensors load through DCP without a model: every "
        "file read is CRC32C-checked against the manifest and nothing unsafe is unpickled. Shards are "
        "loaded one at a time, so memory stays near one --max-shard-size; from an object store the shard "
        "files are first downloaded, verified, to a temporary folder: allow local disk for them. "
        "Default: the newest valid checkpoint (the one a restore would load); --step N: the newest valid "
        "attempt of step N (its newer ones passed over are named on stderr); an invalid one named "
        "exactly (--step N.A or a folder name) is refused.",
        epilog=_EXIT_CODES,
    )
    _add_uri(p)
    p.add_argument("out", metavar="OUT", help="local folder to write (must be absent or empty)")
    _add_step(p, pick="its newest valid attempt")
    p.add_argument("--format", choices=["safetensors"], default="safetensors", help="output format")
    p.add_argument("--key", default="model", help="the module's state key in the checkpoint (default: model)")
    p.add_argument(
        "--max-shard-size",
        type=parse_size,
        default=parse_size(DEFAULT_MAX_SHARD_SIZE),
        metavar="SIZE",
        help=f"largest shard, e.g. 500MB, 5GB, 2GiB (default {DEFAULT_MAX_SHARD_SIZE}; decimal units "
        "as Hugging Face uses). A tensor larger than this gets a shard of its own.",
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="write into a non-empty OUT; an earlier export there (model*.safetensors and its index) "
        "is replaced once the new one is fully written (a failed export leaves it as it was), other "
        "files are kept",
    )
    p.set_defaults(func=_boundary(cmd_export))

    p = sub.add_parser(
        "adopt",
        help="make another job the owner of URI, so it resumes from the checkpoints there",
        description="A checkpoint URI belongs to one job (recorded in URI/.spotjob/owner.json by the first "
        "writer); any other job is refused there. Adopt rewrites that record on purpose: the job named "
        "here becomes the owner and resumes from the checkpoints already there, the previous owner's "
        "included (up to the newest one committed now; what the previous owner commits afterwards is "
        "foreign to the new one, and its writers stop at their next commit). Use it to continue a run "
        "under a new job name, or to repair an owner record that cannot be read. Stop the previous "
        "owner first. Nothing else under URI is changed.",
        epilog="exit status: 0 adopted (or already the owner); 2 nothing could be done",
    )
    _add_uri(p)
    who = p.add_mutually_exclusive_group(required=True)
    who.add_argument("--job", help="the new owner: the job's name (on Kubernetes: NAMESPACE/NAME)")
    who.add_argument("--unnamed", action="store_true", help="the new owner is an unnamed job (no job name)")
    p.set_defaults(func=_boundary(cmd_adopt))


@dataclass(frozen=True)
class StepChoice:
    """What ``--step`` asked for: a step, and an attempt when the user named one folder exactly."""

    step: int
    attempt: int | None = None

    def __str__(self) -> str:
        return str(self.step) if self.attempt is None else CheckpointRef(self.step, self.attempt).folder


def parse_step(text: str) -> StepChoice:
    """``5`` (newest committed attempt of step 5), ``5.1`` or ``step-000000005.1`` (that folder)."""
    ref = CheckpointRef.parse(text.strip())
    if ref is not None:
        return StepChoice(ref.step, ref.attempt)
    m = re.fullmatch(r"(\d+)(?:\.(\d+))?", text.strip())
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r} is not a step: write N, N.ATTEMPT or a folder name")
    return StepChoice(int(m.group(1)), int(m.group(2)) if m.group(2) is not None else None)


def _add_uri(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "uri", metavar="URI", help="where the checkpoints are: s3://bucket/prefix, gs://bucket/prefix or a path"
    )


def _add_step(p: argparse.ArgumentParser, pick: str = "its newest committed attempt") -> None:
    p.add_argument(
        "--step",
        type=parse_step,
        metavar="N",
        help=f"the checkpoint of step N ({pick}; N.A or a folder name picks one folder exactly)",
    )


_SIZE_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}  # fmt: skip


def parse_size(text: str) -> int:
    """``5GB`` → 5_000_000_000, ``2GiB`` → 2 * 2**30, ``1000`` → 1000 bytes (Hugging Face's units)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    unit = m.group(2).lower() if m else ""
    if not m or unit not in _SIZE_UNITS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size; write e.g. 500MB, 5GB or 2GiB")
    size = int(float(m.group(1)) * _SIZE_UNITS[unit])
    if size < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: a shard size must be at least one byte")
    return size


def _boundary(command: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """Turn the errors a user can cause or meet into one line on stderr and an exit status.

    A traceback is for bugs; these are not bugs. ``-v`` still logs the traceback for debugging.
    """

    @functools.wraps(command)
    def run(args: argparse.Namespace) -> int:
        name = f"spotjob ckpt {args.ckpt_command}"
        if not getattr(args, "verbose", False):
            # The answer goes to stdout; the cloud clients' INFO chatter ("Found credentials in
            # environment variables") is not part of it. -v keeps it.
            for noisy in NOISY_LOGGERS:
                logging.getLogger(noisy).setLevel(logging.WARNING)
        try:
            return command(args)
        except CommandError as e:
            _error(name, str(e))
            return e.exit_code
        except (ValueError, StorageError, OSError, OwnershipError) as e:  # ManifestError is a ValueError
            if isinstance(e, BrokenPipeError) and stdout_reader_left():
                raise  # the reader of stdout left (`| head`): spotjob's main says nothing
            log.debug("%s failed", name, exc_info=True)
            _error(name, str(e) or type(e).__name__)
            return EXIT_ERROR

    return run


def _error(name: str, message: str) -> None:
    print(f"{name}: error: {shown(' '.join(message.split()))}", file=sys.stderr)


# ------------------------------------------------------------------------------------------------
# the commands
# ------------------------------------------------------------------------------------------------
def cmd_list(args: argparse.Namespace) -> int:
    with opened_storage(args.uri) as storage:
        refs = _require_checkpoints(storage)
        statuses = inspect_all(storage, refs)
    if args.json:
        _print_json([checkpoint_json(storage, s) for s in statuses])
        return EXIT_OK
    print_table(LIST_HEADERS, list_rows(statuses))
    return EXIT_OK


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


def _need_torch_extra(command: str, modules: tuple[str, ...]) -> None:
    """Import what ``command`` needs from the ``torch`` extra before it reads anything: without
    them it would read every byte and then fail. A ``CommandError`` names what to install."""
    import importlib

    from agent import torch_extra_missing

    for module in modules:
        try:
            importlib.import_module(module)
        except ImportError as e:
            message = torch_extra_missing(e, command)
            if message is None:
                raise
            raise CommandError(message) from e


def cmd_verify(args: argparse.Namespace) -> int:
    if args.deep:
        _need_torch_extra("verify --deep", ("torch", "numpy"))
    with opened_storage(args.uri) as storage:
        status = select_checkpoint(storage, args.step)
        checked_bytes = 0
        if args.deep and status.manifest is not None:
            try:
                _verify_deep(storage, status)
            except FileNotFoundError:  # a file read in place, gone since the listing
                if not _deleted(storage, status):
                    raise
                status.problems.append("a file went missing")
            if status.problems and _deleted(storage, status):
                raise CommandError(
                    f"{status.ref.folder} was deleted while it was being verified (the retention of the job "
                    "saving to this URI removes old checkpoints); nothing is proven about it. Verify again (the "
                    "newest is checked then), or name a checkpoint retention keeps with --step"
                )
            checked_bytes = status.manifest.total_bytes
    # One verdict, the catalog's (plus what --deep found, recorded in the same status).
    valid = status.valid
    problems = list(status.problems) if status.committed else [status.reason]
    # A manifest a newer spotjob wrote is not proven bad, only unreadable here (a restore stops at
    # it, export exits 2): nothing could be checked, which is exit 2, not "invalid".
    unchecked = EXIT_ERROR if status.newer_format else EXIT_INVALID
    if args.json:
        doc = checkpoint_json(storage, status)
        doc.update(valid=valid, problems=problems, reason="; ".join(problems), deep=bool(args.deep))
        _print_json(doc)
        return EXIT_OK if valid else unchecked
    if status.newer_format:
        raise CommandError(
            f"{status.ref.folder} was written by a newer spotjob, so this one cannot check it "
            f"({' '.join(status.reason.split())}); name an older checkpoint with --step to verify that one"
        )
    folder = status.ref.folder
    if valid:
        assert status.manifest is not None
        files = len(status.manifest.files)
        if args.deep:
            print(
                f"{folder}: valid — {files} files, {_human(checked_bytes)} read, every CRC32C matches; "
                ".metadata and the per-rank files load safely"
            )
        else:
            print(
                f"{folder}: valid — MANIFEST.json sound, all {files} files present with their sizes "
                "(contents not read: add --deep to check every CRC32C)"
            )
        return EXIT_OK
    if not status.committed:
        print(f"{folder}: INVALID — not a checkpoint")
    elif status.manifest is None:
        print(f"{folder}: INVALID — MANIFEST.json refused, nothing in this folder is trusted")
    else:
        print(f"{folder}: INVALID — {len(problems)} problem(s)")
    for problem in problems:
        print(f"  {shown(problem)}")
    return EXIT_INVALID


def cmd_show(args: argparse.Namespace) -> int:
    with opened_storage(args.uri) as storage:
        status = select_checkpoint(storage, args.step)
    manifest = _require_manifest(status)
    tensors = manifest.tensors
    if args.key is not None:
        _require_state_key(manifest, args.key)
        tensors = {k: v for k, v in tensors.items() if k.startswith(args.key + ".")}
    if args.json:
        doc = checkpoint_json(storage, status)
        doc["manifest"] = json.loads(manifest.model_dump_json())
        doc["manifest"]["tensors"] = {k: v.model_dump() for k, v in tensors.items()}
        _print_json(doc)
        return EXIT_OK
    fields = [
        ("checkpoint", storage.url(status.ref.folder)),
        ("status", _verdict(status)),
        ("step", str(manifest.step)),
        ("created", _when(manifest.created_at) + " UTC"),
        ("world size", str(manifest.world_size)),
        ("torch", manifest.torch_version),
        ("job", manifest.job or "-"),
        ("state keys", ", ".join(manifest.state_keys)),
        ("files", f"{len(manifest.files)} ({_human(manifest.total_bytes)})"),
        ("metadata", json.dumps(manifest.metadata, sort_keys=True) if manifest.metadata else "-"),
    ]
    for name, value in fields:
        print(f"{name + ':':<12}{shown(value)}")
    print()
    if not tensors:
        # A bare header reads as a listing cut short; say why there is nothing to list.
        under = "" if args.key is None else f" under state key {args.key!r}"
        print(
            f"no tensors{under}: only modules and optimizers are saved as tensors (through DCP); other "
            "state is saved per rank, in the rank-NNNNN.pt files"
        )
        return EXIT_OK
    print_table(
        ["TENSOR", "SHAPE", "DTYPE", "FILES"],
        [[fqn, _shape(t.shape), t.dtype, ",".join(t.files)] for fqn, t in tensors.items()],
    )
    return EXIT_OK


def cmd_export(args: argparse.Namespace) -> int:
    if not args.out.strip():
        # os.path.abspath("") is the working directory: an unset "$OUT" would export into it.
        raise CommandError("OUT is empty: name the folder to write the export in (e.g. ./export)")
    uri = re.match(r"([A-Za-z][A-Za-z0-9+.-]*)://", args.out)
    if uri:
        # os.path.abspath("s3://b/x") is a local folder named "s3:" under the working directory.
        raise CommandError(
            f"OUT {args.out!r} is a URI: export writes a local folder (this would have been a folder named "
            f"{uri.group(1) + ':'!r} here); export to a local path, then copy the folder where it belongs "
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
                    reason = str(e.error).removeprefix(f"{status.ref.folder}: ")
                    print(f"spotjob ckpt export: passing over {status.ref.folder}: {shown(reason)}", file=sys.stderr)
                    passed.append((status.ref.folder, reason))
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
        f"{storage.url(status.ref.folder)} to {out}: {len(files)} file(s) + {INDEX_NAME} "
        f"in {time.monotonic() - started:.1f}s"
    )
    return EXIT_OK


_LEFT_OUT_NAMED = 5
"""How many of the non-tensor entries an export leaves out it names."""

_RELISTS = 3
"""How often an export without --step starts again from the newest checkpoint after the one it was
reading was deleted under it (as a restore does, ``agent.checkpoint._restore._RELISTS``)."""


class _Deleted(Exception):
    """The checkpoint being exported was deleted while it was read (its manifest is gone now)."""


def _deleted(storage: Storage, status: CheckpointStatus) -> bool:
    """The checkpoint's manifest, which retention deletes first, is gone: a file found missing
    while reading it means the checkpoint was deleted, not that it is broken."""
    try:
        return storage.stat(status.ref.key(MANIFEST_NAME)) is None
    except StorageError:
        return False  # not proven gone: reported as it was found


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


def _adoptions(adopted: Sequence[Adoption]) -> str:
    """``job 'A' up to step-…`` for each of ``adopted``, for people."""
    return ", ".join(
        f"{describe_job(a.job)} up to {a.upto.folder if a.upto else '(no checkpoint yet)'}" for a in adopted
    )


def cmd_adopt(args: argparse.Namespace) -> int:
    job: str | None = None if args.unnamed else args.job
    if job is not None and not job.strip():
        raise CommandError("--job needs a name (or pass --unnamed for a job without one)")
    problem = None if job is None else job_name_problem(job)
    if problem is not None:
        # An owner no Checkpointer can run as (they refuse such names): every writer would stop.
        raise CommandError(f"--job: {problem}")
    with opened_storage(args.uri) as storage:
        try:
            before = read_owner(storage)
        except OwnershipError as e:
            if e.newer:  # adopt() refuses to rewrite it
                raise CommandError(str(e)) from None
            log.debug("the owner record is unreadable: %s", e)
            before = None
        owner = adopt(storage, job)
    if before is not None and before.job == job:
        if owner == before:
            print(f"{storage.uri} already belongs to {describe_job(job)}; nothing changed")
            return EXIT_OK
        added = _adoptions(owner.adopted[len(before.adopted) :])
        print(
            f"{storage.uri} already belongs to {describe_job(job)}; it now resumes from the checkpoints of {added} too"
        )
        return EXIT_OK
    taken = _adoptions(owner.adopted)
    print(
        f"{storage.uri} now belongs to {describe_job(job)}"
        + (f"; it resumes from the checkpoints of {taken}" if taken else "")
        + ". Writers of any other job stop at their next commit."
    )
    return EXIT_OK


# ------------------------------------------------------------------------------------------------
# choosing a checkpoint
# ------------------------------------------------------------------------------------------------
@contextlib.contextmanager
def opened_storage(uri: str) -> Iterator[Storage]:
    """The store at ``uri``, closed afterwards; ``CommandError`` when a filesystem URI names no folder."""
    storage = open_storage(uri)
    try:
        root = storage.local_path("")
        # A filesystem store lists a missing folder as empty; a typo must not read as "no checkpoints".
        if root is not None and not os.path.lexists(root):
            raise CommandError(f"{uri}: no such folder")
        yield storage
    finally:
        storage.close()


def _require_checkpoints(storage: Storage) -> list[CheckpointRef]:
    refs = find_checkpoints(storage)
    if not refs:
        parent, _, leaf = storage.uri.rstrip("/").rpartition("/")
        if CheckpointRef.parse(leaf) is not None and parent.partition("://")[2]:
            # What show prints ("checkpoint: s3://b/run/step-000000100") pasted back as the URI.
            raise CommandError(
                f"no checkpoints under {storage.uri}: it is a checkpoint's own folder; give the URI its job "
                f"saves to and the folder as the step: {parent} --step {leaf}"
            )
        below = _checkpoint_uris_below(storage)
        if below:
            more = f" (and {len(below) - 3} more)" if len(below) > 3 else ""
            raise CommandError(
                f"no checkpoints under {storage.uri}, but folders in it hold some: give the one the job saves "
                f"to as the URI, e.g. {', '.join(below[:3])}{more}"
            )
        raise CommandError(
            f"no checkpoints under {storage.uri} (no step-NNNNNNNNN/ folders in it): check the URI; it is the "
            "one the job saves to (its Checkpointer's, or spotjob run's --checkpoint-uri)"
        )
    return refs


_SUBFOLDERS_LOOKED_AT = 32
"""How many of a checkpoint-less URI's folders ``_require_checkpoints`` looks into (a listing each)."""


def _checkpoint_uris_below(storage: Storage) -> list[str]:
    """The folders right under ``storage``'s URI that hold checkpoints: the URI given was the parent of
    the job's (``spotjob-runs/NAME`` for ``spotjob-runs/NAME/checkpoints``, a bucket for its prefix)."""
    found = []
    for name in sorted(storage.list_dirs(""))[:_SUBFOLDERS_LOOKED_AT]:
        if name.startswith(".") or CheckpointRef.parse(name) is not None:
            continue
        if any(CheckpointRef.parse(d) is not None for d in storage.list_dirs(name + "/")):
            found.append(storage.url(name))
    return found


def select_checkpoint(storage: Storage, choice: StepChoice | None) -> CheckpointStatus:
    """The checkpoint a command works on; see the module docstring for the default.

    With a step, its newest committed attempt (or its newest folder when none is committed, which
    then reads as uncommitted). Raises ``CommandError`` when there is nothing to pick.
    """
    refs = _require_checkpoints(storage)
    lineage = Lineage.load(storage)
    if choice is None:
        for _ in range(_RELISTS + 1):
            for ref in refs:
                status = inspect(storage, ref, lineage=lineage)
                if status.committed:
                    return status
            # None committed: perhaps the newest committed after we looked and retention deleted the
            # ones before: walk again if a folder holds a manifest now (see ``restore()``).
            refs = find_checkpoints(storage)
            if not _any_committed(storage, refs):
                break
        raise CommandError(
            f"no committed checkpoint under {storage.uri}: {len(refs)} folder(s), none holding "
            "MANIFEST.json (saves that never finished); `spotjob ckpt list` shows them"
        )
    matching = _folders_of(storage, refs, choice)
    statuses = [inspect(storage, ref, lineage=lineage) for ref in matching]
    return next((s for s in statuses if s.committed), statuses[0])


def _folders_of(storage: Storage, refs: list[CheckpointRef], choice: StepChoice) -> list[CheckpointRef]:
    """The folders of ``refs`` that ``choice`` names (a step's attempts, newest first); ``CommandError``
    naming what there is when none."""
    matching = [r for r in refs if r.step == choice.step and choice.attempt in (None, r.attempt)]
    if not matching:
        there = ", ".join(r.folder for r in refs[:8]) + (", …" if len(refs) > 8 else "")
        what = f"of step {choice.step}" if choice.attempt is None else str(choice)
        raise CommandError(f"no checkpoint {what} under {storage.uri}; there are: {there}")
    return matching


def _any_committed(storage: Storage, refs: list[CheckpointRef]) -> bool:
    return any(storage.stat(r.key(MANIFEST_NAME)) is not None for r in refs)


def newest_valid(
    storage: Storage,
    *,
    step: int | None = None,
    below: CheckpointRef | None = None,
    passed: list[tuple[str, str]] | None = None,
) -> CheckpointStatus:
    """The checkpoint a restore would load; ``CommandError`` naming every one passed over and why.

    ``step``: among that step's attempts only (``CommandError`` when it has none), as a restore
    walking back reaches them. ``below``: walk on from the checkpoint after that one (``passed``:
    the folders already passed over and why, for the error when none is left).
    """
    refs = _require_checkpoints(storage)
    if step is not None:
        refs = _folders_of(storage, refs, StepChoice(step))
    if below is not None:
        refs = [r for r in refs if r < below]
    lineage = Lineage.load(storage)
    skipped: list[CheckpointStatus] = []
    relists = 0
    walk = list(refs)
    relist = below is None and step is None  # a named step is looked at once, as --step always was
    while walk or (relist and relists < _RELISTS and not any(s.committed for s in skipped)):
        if not walk:
            # None committed: perhaps the newest committed after we looked and retention deleted
            # the ones before: walk again if a folder holds a manifest now (see ``restore()``).
            fresh = find_checkpoints(storage)
            if not _any_committed(storage, fresh):
                break
            relists += 1
            refs, walk = fresh, list(fresh)
            skipped = []
            continue
        ref = walk.pop(0)
        status = inspect(storage, ref, lineage=lineage)
        if status.valid:
            newer = [p for p in skipped if p.committed]
            for s in newer:  # the operator asked for "the latest" (of step N)
                print(
                    f"spotjob ckpt export: passing over {s.ref.folder}: {shown(' '.join(s.reason.split()))}",
                    file=sys.stderr,
                )
            if step is not None and (newer or passed):
                print(
                    f"spotjob ckpt export: exporting {status.ref.folder}, the newest valid attempt of step {step}",
                    file=sys.stderr,
                )
            return status
        if status.newer_format:
            # As restore: an older checkpoint would be going back past progress a newer spotjob saved.
            if step is None:
                other = ", or name an older one with --step"
            else:  # a restore stops there too; an older attempt of the step asked for can be named
                other = f", or name an older attempt with --step {walk[0].folder}" if walk else ""
            raise CommandError(
                f"{status.ref.folder}, the newest checkpoint a restore would consider, was written by a newer "
                f"spotjob ({' '.join(status.reason.split())}); upgrade spotjob to export it{other}"
            )
        skipped.append(status)
    reasons = [*(passed or []), *((s.ref.folder, s.reason) for s in skipped)]
    listing = "; ".join(f"{folder}: {reason}" for folder, reason in reasons[:8]) + ("; …" if len(reasons) > 8 else "")
    if step is not None and len(reasons) == 1:  # the step's one folder
        folder, reason = reasons[0]
        raise CommandError(f"{folder} is invalid, refusing to export it: {reason}", EXIT_INVALID)
    what = "checkpoint" if step is None else f"attempt of step {step}"
    raise CommandError(f"no valid {what} under {storage.uri} to export — {listing}", EXIT_INVALID)


def _require_manifest(status: CheckpointStatus) -> Manifest:
    if status.manifest is None:
        raise CommandError(f"{status.ref.folder}: {status.reason}", EXIT_INVALID)
    return status.manifest


def _require_state_key(manifest: Manifest, key: str) -> None:
    if key not in manifest.state_keys:
        raise CommandError(
            f"the checkpoint has no state key {key!r}; it holds {', '.join(manifest.state_keys)}: "
            "name one of them with --key"
        )


# ------------------------------------------------------------------------------------------------
# verify --deep
# ------------------------------------------------------------------------------------------------
def _verify_deep(storage: Storage, status: CheckpointStatus) -> list[str]:
    """Every CRC32C (``agent.catalog.verify_deep``), then what a restore would unpickle."""
    assert status.manifest is not None
    manifest = status.manifest
    to_read = sum(f.size for f in manifest.files if f.path not in status.unusable)
    with _progress_bar(f"verifying {status.ref.folder}", to_read) as progress:
        verify_deep(storage, status, progress=progress)
    status.problems += _check_unpickling(storage, status, skip=set(status.unusable))
    return list(status.problems)


def _check_unpickling(storage: Storage, status: CheckpointStatus, skip: set[str]) -> list[str]:
    """Load ``.metadata`` (allow-list) and each ``rank-*.pt`` (weights_only) as restore would.

    Files already found missing or corrupt (``skip``) are not read again. Also checks that DCP's
    metadata names only files the manifest lists and agrees with the manifest's tensor index,
    which ``show`` and ``export`` rely on.
    """
    from agent import rank_state
    from agent.dcp_safe import UnsafeCheckpointError, tensor_index

    assert status.manifest is not None
    manifest = status.manifest
    problems: list[str] = []
    with checkpoint_reader(storage, status) as reader:
        if manifest.file(DCP_METADATA_NAME) is not None and DCP_METADATA_NAME not in skip:
            try:
                metadata = reader.read_metadata()
            except (UnsafeCheckpointError, StorageError) as e:
                problems.append(f"file {DCP_METADATA_NAME} is unsafe or unreadable: {e}")
            else:
                problems += _cross_check(manifest, metadata, tensor_index(metadata))
        for f in manifest.files:
            if not RANK_FILE_RE.match(f.path) or f.path in skip:
                continue
            try:
                with open(reader.ensure_local(f.path), "rb") as fh, warnings.catch_warnings():
                    # torch warns about pickle protocols while refusing; the refusal is reported below.
                    warnings.simplefilter("ignore")
                    rank_state.decode(fh.read())
            except (UnsafeCheckpointError, StorageError) as e:
                problems.append(f"file {f.path} is unreadable: {e}")
            except Exception as e:  # torch.load's refusals are UnpicklingError/RuntimeError/ValueError
                problems.append(f"file {f.path} does not load with weights_only (unsafe or damaged): {e}")
    return problems


def _cross_check(manifest: Manifest, metadata: Metadata, index: dict[str, Any]) -> list[str]:
    problems = []
    listed = {f.path for f in manifest.files}
    for path in sorted({info.relative_path for info in (metadata.storage_data or {}).values()} - listed):
        problems.append(f"file {DCP_METADATA_NAME} points at {path!r}, which MANIFEST.json does not list")
    differ = sorted(
        fqn
        for fqn in set(index) | set(manifest.tensors)
        if fqn not in index or fqn not in manifest.tensors or index[fqn] != manifest.tensors[fqn]
    )
    if differ:
        problems.append(
            f"MANIFEST.json's tensor index disagrees with {DCP_METADATA_NAME} for {len(differ)} tensor(s), "
            f"e.g. {differ[0]!r}"
        )
    return problems


# ------------------------------------------------------------------------------------------------
# export
# ------------------------------------------------------------------------------------------------
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


# ------------------------------------------------------------------------------------------------
# output
# ------------------------------------------------------------------------------------------------
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


def _verdict(status: CheckpointStatus) -> str:
    if status.valid:
        return "valid"
    if not status.committed:
        return f"uncommitted leftover — {status.reason}"
    if status.foreign:
        return f"FOREIGN — {status.reason}"
    if status.fenced:
        return f"FENCED — {status.reason}"
    if status.retired:
        return f"RETIRED — {status.reason}"
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
    the cursor or erase what an operator reads."""
    return safe(text, limit=len(text))


def print_table(headers: list[str], rows: list[list[str]]) -> None:
    """Plain aligned columns (greppable, no colour); the last column is not padded."""
    rows = [[shown(cell) for cell in row] for row in rows]
    widths = [max(len(r[i]) for r in [headers, *rows]) for i in range(len(headers) - 1)]
    for row in [headers, *rows]:
        cells = [cell.ljust(w) for cell, w in zip(row, widths, strict=False)] + [row[-1]]
        print("  ".join(cells).rstrip())


def _print_json(doc: Any) -> None:
    print(json.dumps(doc, indent=2))
