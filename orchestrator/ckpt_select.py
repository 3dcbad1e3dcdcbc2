"""Which checkpoint a ``spotjob ckpt`` command works on (the rules: ``orchestrator.cli_ckpt``'s
docstring). ``opened_storage`` opens the URI (a folder that is not there is refused, not read as
empty); ``select_checkpoint`` picks for ``verify`` and ``show`` (the newest committed), and
``newest_valid`` for ``export`` (the one a restore would load, saying why each newer one was passed
over); both stand on ``_require_checkpoints`` (a URI without checkpoints says where they are) and
``_folders_of`` (the folders a ``--step``, a ``StepChoice``, names). ``_deleted`` tells a
checkpoint that retention deleted while it was read from a broken one."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass

from agent.catalog import (
    CheckpointRef,
    CheckpointStatus,
    Lineage,
    checkpoint_uris_below,
    find_checkpoints,
    inspect,
    reserved_uri_problem,
)
from agent.manifest import MANIFEST_NAME, Manifest
from agent.storage import StorageError, open_storage
from agent.storage.base import Storage
from orchestrator.ckpt_common import EXIT_INVALID, CommandError, newer_spotjob_words
from orchestrator.ckpt_output import shown


@dataclass(frozen=True)
class StepChoice:
    """What ``--step`` asked for: a step, and an attempt when the user named one folder exactly."""

    step: int
    attempt: int | None = None

    def __str__(self) -> str:
        return str(self.step) if self.attempt is None else CheckpointRef(self.step, self.attempt).folder


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
        refuse_a_misplaced_uri(storage)
        raise CommandError(
            f"no checkpoints under {storage.uri} (no step-NNNNNNNNN/ folders in it): check the URI; it is the "
            "one the job saves to (its Checkpointer's, or spotjob run's --checkpoint-uri)"
        )
    return refs


def refuse_a_reserved_uri(storage: Storage, *, command: str = "") -> None:
    """``CommandError`` when ``storage``'s URI lies in a job URI's ``.spotjob`` or
    ``.spotjob-staging`` (``agent._layout.reserved_uri_problem``): never a job's URI, whatever it
    holds. ``command``: as ``refuse_a_misplaced_uri``'s."""
    problem = reserved_uri_problem(storage.uri)
    if problem is not None:
        raise CommandError(f"{problem}{'; nothing was changed' if command else ''}")


def refuse_a_misplaced_uri(storage: Storage, *, command: str = "") -> None:
    """``CommandError`` when ``storage``'s URI, which holds no checkpoints, is not the one a job saves
    to but a checkpoint's own folder or a folder above the job's URIs. ``command``: the command that
    takes no ``--step`` (``adopt``), whose answer is then the URI alone. A URI in a job URI's
    ``.spotjob`` or ``.spotjob-staging`` is refused too (``refuse_a_reserved_uri``)."""
    refuse_a_reserved_uri(storage, command=command)
    parent, _, leaf = storage.uri.rstrip("/").rpartition("/")
    if CheckpointRef.parse(leaf) is not None and parent.partition("://")[2]:
        # What show prints ("checkpoint: s3://b/run/step-000000100") pasted back as the URI.
        if command:
            raise CommandError(
                f"{storage.uri} is a checkpoint's own folder, not the URI a job saves to; nothing was "
                f"changed: {command} the URI its job saves to, {parent}"
            )
        raise CommandError(
            f"no checkpoints under {storage.uri}: it is a checkpoint's own folder; give the URI its job "
            f"saves to and the folder as the step: {parent} --step {leaf}"
        )
    below = checkpoint_uris_below(storage)
    if below:
        more = f" (and {len(below) - 3} more)" if len(below) > 3 else ""
        changed = "; nothing was changed" if command else ""
        raise CommandError(
            f"no checkpoints under {storage.uri}, but folders in it hold some{changed}: give the one the job "
            f"saves to as the URI, e.g. {', '.join(below[:3])}{more}"
        )


_RELISTS = 3
"""How often an export without --step starts again from the newest checkpoint after the one it was
reading was deleted under it (as a restore does, ``agent.checkpoint._restore._RELISTS``)."""


def select_checkpoint(
    storage: Storage, choice: StepChoice | None, *, report_archived: bool = False
) -> CheckpointStatus:
    """The checkpoint a command works on; see the module docstring for the default.

    With a step, its newest committed attempt (or its newest folder when none is committed, which
    then reads as uncommitted). Raises ``CommandError`` when there is nothing to pick.
    ``report_archived``: as ``inspect``'s (an archived manifest or attempt record is the status's
    reason, ``undecided``, rather than an ``ArchivedError``).
    """
    refs = _require_checkpoints(storage)
    lineage = Lineage.load(storage)
    if choice is None:
        for _ in range(_RELISTS + 1):
            for ref in refs:
                status = inspect(storage, ref, lineage=lineage, report_archived=report_archived)
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
    statuses = [inspect(storage, ref, lineage=lineage, report_archived=report_archived) for ref in matching]
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
    the folders already passed over and why, for the error when none is left; the newest of them,
    the one the export just proved bad, is said on stderr here once another valid one is found).
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
            if below is not None and passed:
                # The one the export just proved bad by reading it (the newest passed over), said
                # only now: had none been left, the error would have named it, once.
                folder, reason = passed[-1]
                print(f"spotjob ckpt export: passing over {folder}: {shown(reason)}", file=sys.stderr)
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
            if status.uri_wide:  # the owner record: it judges every checkpoint at the URI alike
                other = ""
            elif step is None:
                other = ", or name an older one with --step"
            else:  # a restore stops there too; an older attempt of the step asked for can be named
                other = f", or name an older attempt with --step {walk[0].folder}" if walk else ""
            raise CommandError(
                f"{status.ref.folder}, the newest checkpoint a restore would consider, "
                f"{newer_spotjob_words(status, 'cannot be judged')} "
                f"({' '.join(status.reason.split())}); upgrade spotjob to export it{other}"
            )
        skipped.append(status)
    reasons = [*(passed or []), *((s.ref.folder, s.reason) for s in skipped)]
    listing = "; ".join(f"{folder}: {reason}" for folder, reason in reasons[:8]) + ("; …" if len(reasons) > 8 else "")
    if step is not None and len(reasons) == 1:  # the step's one folder
        folder, reason = reasons[0]
        raise CommandError(f"{folder} is invalid, refusing to export it: {reason}", EXIT_INVALID)
    what = "checkpoint" if step is None else f"attempt of step {step}"
    if not passed and not any(s.committed for s in skipped):
        # Nothing proven invalid, only saves that never finished: verify and show exit 2 there too.
        raise CommandError(
            f"no committed {what} under {storage.uri} to export: {len(skipped)} folder(s), none holding "
            f"MANIFEST.json (saves that never finished) — {listing}"
        )
    raise CommandError(f"no valid {what} under {storage.uri} to export — {listing}", EXIT_INVALID)


def _deleted(storage: Storage, status: CheckpointStatus) -> bool:
    """The checkpoint's manifest, which retention deletes first, is gone: a file found missing
    while reading it means the checkpoint was deleted, not that it is broken."""
    try:
        return storage.stat(status.ref.key(MANIFEST_NAME)) is None
    except StorageError:
        return False  # not proven gone: reported as it was found


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
