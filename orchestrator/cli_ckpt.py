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

Exit status: 0 success; 1 the checkpoint is invalid or unsafe (``verify`` proved a problem,
``show``/``export`` refused it); 2 nothing could be checked or done (bad URI, no such folder or
step, storage unreachable, an export refused for its arguments, a checkpoint ``verify`` cannot
decide — ``CheckpointStatus.undecided``: its manifest, or the owner or attempt record judging it, a
newer spotjob wrote or an archive storage class holds, or ``--deep`` found a per-rank file holding
what this spotjob does not restore or a ``.metadata`` a newer torch wrote naming what this one lacks:
not proven bad, only unreadable here; ``export`` stops at such a ``.metadata`` as a restore does) —
the same code argparse uses for a bad command line.

Where each part lives: this module is the command line (``register``: the commands and their
options, ``--step`` and ``--max-shard-size`` parsed; ``_boundary``, which makes an error one line
on stderr and an exit status); ``orchestrator.ckpt_commands`` ``list``, ``verify``, ``show`` and
``adopt``; ``orchestrator.ckpt_export`` ``export`` (its engine: ``agent.export``);
``orchestrator.ckpt_select`` which checkpoint a command picks; ``orchestrator.ckpt_deep`` what
``verify --deep`` checks; ``orchestrator.ckpt_output`` tables, JSON and the progress bar;
``orchestrator.ckpt_common`` the exit statuses and ``CommandError``.
"""

from __future__ import annotations

import argparse
import functools
import logging
import re
import sys
from collections.abc import Callable
from typing import Any

from agent.export import INDEX_NAME
from agent.ownership import OwnershipError
from agent.storage import StorageError
from orchestrator.ckpt_commands import cmd_adopt, cmd_list, cmd_show, cmd_verify
from orchestrator.ckpt_common import EXIT_ERROR, CommandError
from orchestrator.ckpt_export import cmd_export
from orchestrator.ckpt_output import shown
from orchestrator.ckpt_select import StepChoice
from orchestrator.cli_pipe import stdout_reader_left

log = logging.getLogger(__name__)

DEFAULT_MAX_SHARD_SIZE = "5GB"
NOISY_LOGGERS = ("botocore", "boto3", "s3transfer", "urllib3", "google", "awscrt", "matplotlib")
"""The cloud clients' loggers, whose INFO lines ("Found credentials in environment variables") a
command's user has no use for, and matplotlib's (``spotjob run``'s plot: "generated new
fontManager" the first time it runs on a machine): set to WARNING unless the command logs at
debug level (``logs_debug``)."""


def logs_debug(args: argparse.Namespace) -> bool:
    """Whether the command logs at debug level: ``-v``, or ``SPOTJOB_LOG_LEVEL=debug`` as
    ``cli.main`` read it (``args.log_level``). There the cloud clients log every request (README,
    Safety), so their loggers are left as they are."""
    return bool(getattr(args, "verbose", False)) or getattr(args, "log_level", None) == "DEBUG"


_DEFAULT_PICK = (
    "Default: the newest committed checkpoint (the newest folder holding a MANIFEST.json, valid or "
    "not; uncommitted leftovers are never picked)"
)
_EXIT_CODES = (
    "exit status: 0 ok; 1 the checkpoint is invalid or unsafe; "
    "2 nothing could be checked or done (bad URI, no such folder/step, storage error, bad arguments, "
    "a checkpoint that cannot be judged here: UNDECIDED)"
)


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
        "by a fresh start, UNDECIDED: not proven bad, but its manifest or a record that judges it is "
        "a newer spotjob's or archived). Sizes are "
        "checked; contents are not (see `verify --deep`).",
        epilog=_EXIT_CODES,
    )
    _add_uri(p)
    p.add_argument("--json", action="store_true", help="print a JSON array instead of a table")
    p.set_defaults(func=_boundary(cmd_list))

    p = sub.add_parser(
        "verify",
        help="check one checkpoint; exit 0 when valid, 1 when not, 2 when it cannot be judged here",
        description="Check one checkpoint: MANIFEST.json parses and names only files inside its "
        "folder, and every file it lists is there with its listed size. --deep also reads every byte "
        "and checks every CRC32C, unpickles DCP's .metadata with the allow-list unpickler and the "
        f"per-rank files with weights_only, as a restore would (one holding what this spotjob does not "
        f"restore, a newer spotjob's, is UNDECIDED as a restore stops there). {_DEFAULT_PICK}.",
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
        "owner first. Nothing else under URI is changed. URI is the one the job saves to: a checkpoint's "
        "own folder, or a folder above the job's URI (whose folders hold checkpoints), is refused and "
        "nothing is written there.",
        epilog="exit status: 0 adopted (or already the owner); 2 nothing could be done (nothing was changed)",
    )
    _add_uri(p)
    who = p.add_mutually_exclusive_group(required=True)
    who.add_argument("--job", help="the new owner: the job's name (on Kubernetes: NAMESPACE/NAME)")
    who.add_argument("--unnamed", action="store_true", help="the new owner is an unnamed job (no job name)")
    p.set_defaults(func=_boundary(cmd_adopt))


def parse_step(text: str) -> StepChoice:
    """``5`` (newest committed attempt of step 5), ``5.1`` or ``step-000000005.1`` (that folder).

    A folder's name names that folder however its numbers are spelled: ``step-000000005.0`` (as
    ``5.0`` is) and ``step-5`` are ``step-000000005``."""
    m = re.fullmatch(r"(step-)?(\d+)(?:\.(\d+))?", text.strip())
    if not m:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a step: write N, N.ATTEMPT or a folder name (step-N, step-N.ATTEMPT)"
        )
    attempt = m.group(3) if m.group(3) is not None else ("0" if m.group(1) else None)
    return StepChoice(int(m.group(2)), None if attempt is None else int(attempt))


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
        if not logs_debug(args):
            # The answer goes to stdout; the cloud clients' INFO chatter ("Found credentials in
            # environment variables") is not part of it. Debug level (-v, SPOTJOB_LOG_LEVEL=debug)
            # keeps it, and their request lines.
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
