"""``spotjob ckpt list``, ``verify``, ``show`` and ``adopt`` (``export`` is
``orchestrator.ckpt_export``'s). Each opens the URI, picks its checkpoint
(``orchestrator.ckpt_select``) and prints the answer for people or as JSON
(``orchestrator.ckpt_output``); what ``verify --deep`` reads is ``orchestrator.ckpt_deep``'s;
``adopt`` rewrites the URI's owner record (``agent.ownership``)."""

from __future__ import annotations

import argparse
import json
import logging
from collections.abc import Sequence

from agent.catalog import find_checkpoints, inspect_all
from agent.ownership import Adoption, OwnershipError, adopt, describe_job, job_name_problem, read_owner
from orchestrator.ckpt_common import (
    EXIT_ERROR,
    EXIT_INVALID,
    EXIT_OK,
    CommandError,
    _need_torch_extra,
    newer_spotjob_words,
)
from orchestrator.ckpt_deep import _verify_deep
from orchestrator.ckpt_output import (
    LIST_HEADERS,
    _human,
    _print_json,
    _shape,
    _verdict,
    _when,
    checkpoint_json,
    list_rows,
    print_table,
    shown,
)
from orchestrator.ckpt_select import (
    _deleted,
    _require_checkpoints,
    _require_manifest,
    _require_state_key,
    opened_storage,
    refuse_a_misplaced_uri,
    refuse_a_reserved_uri,
    select_checkpoint,
)

log = logging.getLogger("orchestrator.cli_ckpt")  # spotjob ckpt's one logger, as before it was split


def cmd_list(args: argparse.Namespace) -> int:
    with opened_storage(args.uri) as storage:
        refs = _require_checkpoints(storage)
        statuses = inspect_all(storage, refs)
    if args.json:
        _print_json([checkpoint_json(storage, s) for s in statuses])
        return EXIT_OK
    print_table(LIST_HEADERS, list_rows(statuses))
    return EXIT_OK


def cmd_verify(args: argparse.Namespace) -> int:
    if args.deep:
        _need_torch_extra("verify --deep", ("torch", "numpy"))
    with opened_storage(args.uri) as storage:
        # An archived manifest or attempt record is this checkpoint's reason (undecided, exit 2),
        # as `list` shows it, so that --json prints the object as list --json does.
        status = select_checkpoint(storage, args.step, report_archived=True)
        checked_bytes = 0
        deep = False  # whether the deep checks ran: never without a manifest to check the bytes against
        newer_files: list[str] = []  # per-rank files a newer spotjob wrote (what this one does not restore)
        if args.deep and status.manifest is not None:
            try:
                newer_files = _verify_deep(storage, status)
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
            deep = True
    # One verdict, the catalog's (plus what --deep found, recorded in the same status).
    valid = status.valid
    problems = list(status.problems) if status.committed else [status.reason]
    # A manifest or a record a newer spotjob wrote, one archived, one gone as it was read: not
    # proven bad, only not checkable here (a restore stops at or passes over it all the same):
    # nothing could be decided, which is exit 2, not "invalid". What a check proved (a file
    # missing or corrupt, a broken record, fenced, foreign) is exit 1, whatever else could not be read.
    undecided = status.undecided
    if args.json:
        doc = checkpoint_json(storage, status)
        doc.update(valid=valid, problems=problems, reason="; ".join(problems), deep=deep)
        _print_json(doc)
        return EXIT_OK if valid else EXIT_ERROR if undecided else EXIT_INVALID
    if undecided and status.newer_format:
        # A restore stops there as well, so the remedy is to upgrade, or an older step: not when the
        # record is the owner's, which judges every checkpoint at the URI alike.
        written = newer_spotjob_words(status, "cannot be checked", its_files=bool(newer_files))
        if status.manifest is None:
            written += ", so this one cannot check it"
        remedy = (
            f"that record judges every checkpoint under {storage.uri} alike: upgrade spotjob to verify any of them"
            if status.uri_wide
            else "name an older checkpoint with --step to verify that one"
        )
        raise CommandError(f"{status.ref.folder} {written} ({' '.join(status.reason.split())}); {remedy}")
    if undecided:
        checked = " (its bytes match their CRC32Cs)" if deep else ""
        raise CommandError(
            f"{status.ref.folder} cannot be checked here, which proves nothing bad about it{checked}: "
            f"{' '.join(status.reason.split())}. Verify it again once that is dealt with, or name another "
            "checkpoint with --step"
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
    tensors = {fqn: tensors[fqn] for fqn in sorted(tensors, key=lambda fqn: _tensor_order(fqn, manifest.state_keys))}
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


def _tensor_order(fqn: str, state_keys: Sequence[str]) -> tuple[int, list[tuple[int, int | str]]]:
    """Where ``show`` lists a tensor: by state key as the checkpoint lists them, then by name with
    its numbers as numbers (``layers.2`` before ``layers.10``), so a module's tensors read in order.
    The manifest's own order is DCP's, which mixes modules and sizes."""
    key = fqn.split(".", 1)[0]
    rank = state_keys.index(key) if key in state_keys else len(state_keys)
    return rank, [(0, int(part)) if part.isdigit() else (1, part) for part in fqn.split(".")]


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
        # An owner record in another job URI's staging or records folder would make a job of what
        # that job deletes: refused whatever it holds.
        refuse_a_reserved_uri(storage, command="adopt")
        if not find_checkpoints(storage):
            # An owner record written in a checkpoint's folder would change a committed checkpoint,
            # and one above the job's URI would judge nothing: neither is what was meant.
            refuse_a_misplaced_uri(storage, command="adopt")
            if storage.local_path("") is None and next(iter(storage.list("")), None) is None:
                # A bucket has no folders: a prefix nothing was ever written under is what a missing
                # folder is on the filesystem (refused by opened_storage), most often a typo. An
                # owner record there would judge nothing, and the job meant would stay as it was.
                raise CommandError(
                    f"nothing is stored under {storage.uri} (no job has saved or claimed it); nothing was "
                    "changed: check the URI, the one the job saves to (a new job claims a fresh URI itself)"
                )
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
