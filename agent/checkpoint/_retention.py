"""Retention: after a commit, keep the newest ``keep`` valid checkpoints of this job."""

from __future__ import annotations

import logging

from agent import _fresh_start
from agent.catalog import CheckpointRef, WrittenManifest, find_checkpoints, inspect
from agent.checkpoint import _claim
from agent.checkpoint._state import _State
from agent.manifest import MANIFEST_NAME
from agent.ownership import FencedError, Lineage, OwnershipError
from agent.pins import pinned_folders
from agent.storage import PermanentStorageError, RetainedError, StorageError

log = logging.getLogger("agent.checkpoint")  # one logger for the package, as before it was split

_WRITTEN_HELD = 8
"""The most manifests of its own commits a Checkpointer holds for retention (``_Retention._written``):
the newest ``keep`` ones (and one more) spare each pass a parse of each."""
_WRITTEN_HELD_BYTES = 16 * 2**20
"""... and the most bytes of manifest they may have written, all together: a manifest held costs
about four times its JSON in memory (5 MB for one of 8000 tensors, 1.3 MB of JSON), and one of
many tensors over many ranks reaches tens of MiB. Past this, the older ones are parsed again."""


class _Retention(_State):
    _swept_through: CheckpointRef | None
    """(rank 0, ``keep`` None) The checkpoint whose retention pass last went through without an
    error: every folder older than it was then committed (and stays: nothing is deleted with
    ``keep`` None) or removed, so later passes look only at folders newer than it. Without it,
    every save read the manifest of every checkpoint ever kept: a save's cost grew with the run."""

    _refusals_said: set[str]
    """(rank 0) The kinds of permanent refusal retention has warned of once (``_retain``): the
    bucket keeping what it would delete (``RetainedError``), a policy denying deletes. Later passes
    that meet the same refusal say so at debug level, not once a save for the rest of the run."""

    _restore_called = False
    """``restore()`` was called on this Checkpointer (whatever it found)."""

    _below_said = False
    """(rank 0) A commit below the job's newest checkpoint was looked into (``_say_if_below``)."""

    _checkpointer_id: str = ""
    """This Checkpointer's id, written in its claims (``_claim.Claim.checkpointer``): a step
    another Checkpointer of this process, not closed yet, committed is not this one's to save again,
    nor its retention's to remove."""

    _restored_folders: set[str]
    """The checkpoint folders this Checkpointer's ``restore()`` loaded (every rank)."""

    def _same_history(self, folder: str) -> bool:
        """(rank 0) Whether ``folder`` is of this Checkpointer's own history: it restored from it, or
        committed it itself. Only such a folder's older copy of a step is a duplicate retention may
        remove (``_retain``); any other is another run's, the job's history as far as it can tell.
        One it restored that another Checkpointer of this process, still open, committed is that
        one's (one read of its claim, only while another is open)."""
        if folder in self._own_folders:
            return True
        if folder not in self._restored_folders:
            return False
        if not _claim.others_open(self._checkpointer_id):
            return True
        claim = _claim.read_claim(self.storage, folder)
        return claim is None or not claim.of_another_open_checkpointer(self._checkpointer_id)

    def _say_if_below(self, committed: CheckpointRef, beside: list[CheckpointRef], lineage: Lineage) -> None:
        """(rank 0, once) This Checkpointer never restored, and the job's newest checkpoint is above
        the one just committed: a restarted script that skipped ``restore()`` trains from scratch,
        and the next restore loads that newer checkpoint, never this run's progress. Or, with none
        newer, the job holds a checkpoint of the very step just committed that this Checkpointer
        did not write (the commit went beside it, ``step-N.1``): the next restore loads this run's
        copy, the newest of the step, not the job's, which retention keeps."""
        if self._restore_called or self._below_said:
            return
        equal = [r for r in beside if r.step == committed.step and r < committed and not self._same_history(r.folder)]
        newer = [r for r in beside if committed < r]
        if not newer and not equal:
            return
        self._below_said = True
        for ref in [*newer, *equal]:  # newest first
            status = inspect(self.storage, ref, lineage=lineage, report_archived=True)
            if not status.committed or not status.valid or status.foreign or status.fenced:
                continue
            if committed < ref:
                log.error(
                    "committed step %d at %s, but the job already has a newer checkpoint, of step %d (%s), and "
                    "this Checkpointer never called restore(): the next restore() loads step %d, not this run's "
                    "progress. To resume, call restore(state) before training; to start over, use a new URI",
                    committed.step,
                    self.storage.url(committed.folder),
                    ref.step,
                    self.storage.url(ref.folder),
                    ref.step,
                )
            else:
                log.error(
                    "committed step %d at %s, beside %s, a checkpoint of the same step from another run, and this "
                    "Checkpointer never called restore(): the next restore() loads this run's copy (the newest of "
                    "a step's copies), not that one, which retention keeps. To resume from the job's checkpoint, "
                    "remove this run's copy and call restore(state) before training; to start over, use a new URI",
                    committed.step,
                    self.storage.url(committed.folder),
                    self.storage.url(ref.folder),
                )
            return

    _twice_said = False
    """(rank 0) Another live process's commit of a step this one committed too was named (``_say_if_twice``)."""

    _began_with: frozenset[str] | None = None
    """(rank 0) The checkpoint folders listed when this Checkpointer began saving (its first save's
    naming of its folder): a folder not among them that it did not claim itself is another
    writer's, made since."""

    _own_folders: set[str]
    """(rank 0) The folders this Checkpointer's saves claimed."""

    _seen_uncommitted: set[str]
    """(rank 0) Folders this Checkpointer found without a manifest since it began saving: committed
    later, they were committed after it began (a predecessor's save finishing late, or another writer's)."""

    _writers_of: dict[str, _claim.Claim | None]
    """(rank 0) Committed folders, made or committed since this Checkpointer began saving, that it
    did not claim, with the claim of the other process that committed each (None: no other
    process's, or no readable claim). Each folder's claim is read once."""

    _writers_said: set[tuple[str, str, int, str]]
    """(rank 0) The other writers (``Claim.writer``) named in an error already."""

    _written: dict[str, WrittenManifest]
    """(rank 0) The manifests this Checkpointer committed, by folder, as it wrote them (at most
    ``_WRITTEN_HELD``, of at most ``_WRITTEN_HELD_BYTES``): retention's ``inspect`` still reads each
    from storage, and takes the one held instead of parsing and validating the bytes again when
    they are the bytes written. Replaced whole, never changed in place: a commit in the save thread
    may add one while a pass reads it."""

    def _hold_written(self, folder: str, written: WrittenManifest) -> None:
        """(rank 0, at a commit) Hold the manifest just committed in ``folder`` for retention,
        within the bounds even when no retention pass follows (a pass that failed before it pruned):
        one bigger than ``_WRITTEN_HELD_BYTES`` alone is not held, and is parsed when read."""
        held = [(f, w) for f, w in self._written.items() if f != folder] + [(folder, written)]
        while held and (len(held) > _WRITTEN_HELD or sum(w.size for _, w in held) > _WRITTEN_HELD_BYTES):
            held.pop(0)  # the longest held
        self._written = dict(held)

    def _store_time_now(self, committed: CheckpointRef) -> float | None:
        """The store's time now, at least: when it wrote the manifest just committed (one stat)."""
        info = self.storage.stat(committed.key(MANIFEST_NAME))
        return info.modified if info is not None else None

    def _undecided(self, folder: str) -> bool:
        """(rank 0, no request) Whether ``folder`` may be another writer's, committed since this
        Checkpointer began saving, and is not known yet to be or not to be. A folder listed when it
        began and never seen uncommitted since was committed before (a predecessor's: the job's
        history); one it claimed is its own."""
        if self._began_with is None or folder in self._own_folders or folder in self._writers_of:
            return False
        return folder not in self._began_with or folder in self._seen_uncommitted

    def _other_writer(self, ref: CheckpointRef, is_committed: bool) -> _claim.Claim | None:
        """(rank 0) The claim of another process of this URI that committed ``ref`` after this
        Checkpointer began saving, or None. Costs nothing for a folder listed when it began and
        never seen uncommitted since, nor for one it claimed; a folder made or committed since,
        one read of its claim, once. Names that writer in an error, once a writer."""
        folder = ref.folder
        if folder in self._writers_of:
            return self._writers_of[folder]
        if self._began_with is None or folder in self._own_folders:
            return None
        if not is_committed:
            self._seen_uncommitted.add(folder)
            return None
        if not self._undecided(folder):
            return None
        claim = _claim.read_claim(self.storage, folder)
        superseded = (
            claim is not None
            and claim.attempt is not None
            and self.config.attempt is not None
            and claim.attempt < self.config.attempt
        )
        other = claim if claim is not None and not claim.this_process() and not superseded else None
        self._writers_of[folder] = other
        if other is not None and other.writer not in self._writers_said:
            self._writers_said.add(other.writer)
            log.error(
                "%s was committed by %s after this Checkpointer began saving to this URI: two processes are saving "
                "to it (the same script started twice, or a stale copy still training after its job restarted "
                "elsewhere, which no attempt number fences). A restore takes the newest step whichever wrote it; "
                "this writer's retention neither counts nor removes that writer's checkpoints while it may still "
                "run. Stop one of them (said once for that writer)",
                self.storage.url(folder),
                other.describe(),
            )
        return other

    def _other_writer_running(self, claim: _claim.Claim) -> bool:
        """Whether the other writer of ``claim`` may still run, judged by its newest claim seen."""
        newest = max(
            (c for c in self._writers_of.values() if c is not None and c.writer == claim.writer),
            key=lambda c: c.claimed_at,
            default=claim,
        )
        return newest.writer_running(self.config.attempt)

    _committed_beside: frozenset[str] = frozenset()
    """(rank 0) The folders of its step committed already when the last commit's save named its
    folder (a restarted script re-saving the step it resumed from): not another writer's commit."""

    def _say_if_twice(self, committed: CheckpointRef, refs: list[CheckpointRef]) -> None:
        """(rank 0, once) Another process of this machine or another, still running, committed the
        step just committed too, after this save named its folder (``step-N`` beside ``step-N.1``):
        two writers saving the same steps at the same moments both commit, each copy whole, and
        otherwise neither would be told."""
        if self._twice_said:
            return
        for ref in refs:
            if ref.step != committed.step or ref == committed or ref.folder in self._committed_beside:
                continue
            if self.storage.stat(ref.key(MANIFEST_NAME)) is None:
                continue
            claim = _claim.read_claim(self.storage, ref.folder)
            if claim is None or claim.this_process() or not claim.writer_alive(self.config.attempt):
                continue
            self._twice_said = True
            self._writers_said.add(claim.writer)
            log.error(
                "committed step %d at %s, and %s committed it too, at %s: two processes are saving to this URI "
                "(the same script started twice, or a stale copy that no attempt number fences). Each copy is "
                "whole and a restore takes the newest, but each one's retention removes the other's "
                "checkpoints; stop one (said once)",
                committed.step,
                self.storage.url(committed.folder),
                claim.describe(),
                self.storage.url(ref.folder),
            )
            return

    def _retain(self, committed: CheckpointRef) -> None:
        """(rank 0) Keep the newest ``keep`` valid committed checkpoints, counting a step once;
        remove old leftovers.

        An older copy of a step kept (``step-N`` beside ``step-N.1``) goes when this Checkpointer
        restored from it or committed it (``_same_history``: the step saved again by the run that
        resumed from it); any other copy stays with its step, and goes only when the step itself
        does, older than the ``keep`` newest steps. So a run that never restored removes nothing of
        the job's history by committing steps the job holds already.

        Never touches anything newer than the checkpoint just committed, nor another job's, a
        superseded attempt's, a retired checkpoint or one a newer spotjob wrote (they are not
        counted either). Checks the fence before every delete. A failed delete, whatever the
        error, is logged, never a failed save.
        """
        url = self.storage.url
        try:
            retired = _fresh_start.retired_folders(self.storage)
            swept = self._swept_through if self.config.keep is None else None
            refs = find_checkpoints(self.storage)
            older = [r for r in refs if r < committed and r.folder not in retired and (swept is None or swept < r)]
            lineage = Lineage.load(self.storage)
            beside = [r for r in refs if r != committed and r.step >= committed.step and r.folder not in retired]
            self._say_if_below(committed, beside, lineage)
            self._say_if_twice(committed, refs)
            listed = {r.folder for r in refs}
            self._writers_of = {f: c for f, c in self._writers_of.items() if f in listed}  # a name reused is new
            held = min(self.config.keep or 1, _WRITTEN_HELD - 1) + 1
            now_held = self._written
            own_written: dict[str, WrittenManifest] = {}
            held_bytes = 0
            for r in sorted((r for r in refs if r.folder in now_held), reverse=True)[:held]:
                held_bytes += now_held[r.folder].size
                if held_bytes > _WRITTEN_HELD_BYTES:
                    break
                own_written[r.folder] = now_held[r.folder]
            self._written = own_written
            for ref in refs:  # the newer ones: the loop below looks at older ones only
                if committed < ref and ref.folder not in retired and self._undecided(ref.folder):
                    self._other_writer(ref, self.storage.stat(ref.key(MANIFEST_NAME)) is not None)
            store_now: list[float | None] = []  # the store's time, read once a pass when needed

            def store_time() -> float | None:
                if not store_now:
                    store_now.append(self._store_time_now(committed))
                return store_now[0]

            doomed: list[tuple[CheckpointRef, bool]] = []  # (folder, whether it holds a manifest)
            held_for_pin = False  # a folder this pass would remove stays for a reader's pin
            kept = 0
            kept_steps = {committed.step}
            for ref in older:  # newest first
                # An archived manifest (a lifecycle rule's): committed, unusable, deleted as a broken
                # one would be (older than the ``keep`` newest valid ones), never the whole pass given up.
                status = inspect(self.storage, ref, lineage=lineage, report_archived=True, written=own_written)
                if not status.committed:
                    self._other_writer(ref, False)
                    claim, written = _claim.read_claim_stamped(self.storage, ref.folder)
                    if claim is not None and _claim.writer_alive_in(claim, written, self.config.attempt, store_time):
                        # Another process saving to this URI may be writing it now: removed, its
                        # commit would name files that are gone. Removed once that writer is gone.
                        log.debug(
                            "retention: leaving %s: %s may still be saving into it", url(ref.folder), claim.describe()
                        )
                        continue
                    doomed.append((ref, False))  # a save that never finished
                    continue
                if status.foreign or status.fenced:
                    continue  # not this job's history: never counted, never deleted
                other = self._other_writer(ref, True)
                if other is not None and self._other_writer_running(other):
                    # Another process saving to this URI committed it since this one began: not
                    # this writer's history to count or thin out while that writer may still run.
                    log.debug("retention: leaving %s: %s committed it, and may run", url(ref.folder), other.describe())
                    continue
                if status.newer_format:
                    continue  # a newer spotjob's checkpoint: not proven bad, so not ours to delete
                if self.config.keep is None:
                    continue
                # Only valid checkpoints count towards ``keep``: a refused one kept in place of a
                # valid one would leave fewer to fall back to than asked for. Broken folders newer
                # than the oldest one kept stay (for a post-mortem); older ones go with the rest.
                # An older copy of a step kept already (``step-N`` beside ``step-N.1``: a script that
                # saves the step it resumed from, once a restart) is no earlier state to fall back
                # to: counted, a few restarts left ``keep`` copies of one step and no older one.
                # Only a copy of this Checkpointer's own history (``_same_history``) is such a copy:
                # one it neither restored nor committed is another run's (the job's, where this run
                # never called restore()), and goes only with its step, once ``keep`` newer steps
                # are kept; removed as a copy, a run that skipped restore() deleted the job's
                # checkpoints one a save, and left only its own to restore.
                if status.valid and ref.step in kept_steps:
                    if self._same_history(ref.folder):
                        doomed.append((ref, True))
                    continue  # counted with its step's newest copy
                if kept >= self.config.keep - 1:
                    doomed.append((ref, True))
                elif status.valid:
                    kept += 1
                    kept_steps.add(ref.step)
            if doomed:
                # One listing of the readers' pins (``agent.pins``), only when something would go.
                pinned, expired = pinned_folders(self.storage, stamp=committed.key(MANIFEST_NAME))
                for ref in [r for r, _ in doomed if r.folder in pinned]:
                    log.debug("retention: keeping %s: a reader pinned it", url(ref.folder))
                    held_for_pin = True
                doomed = [(r, m) for r, m in doomed if r.folder not in pinned]
                if expired:
                    try:
                        self.storage.delete(expired)
                        log.debug("retention: removed %d expired pin(s) under %s", len(expired), url(".spotjob/pins"))
                    except StorageError as e:
                        log.debug("retention: could not remove expired pins (retried next pass): %s", e)
            refused: PermanentStorageError | None = None
            for ref, holds_manifest in doomed:
                self._check_fence()
                # Nothing listed in an uncommitted folder: on a versioned bucket MinIO (and moto) still
                # list a folder whose objects are all delete markers. Deleting its manifest would add
                # one more marker each save, and saying it was removed would repeat every save.
                empty = not holds_manifest and next(iter(self.storage.list(ref.folder + "/")), None) is None
                try:
                    if holds_manifest:
                        # Manifest first: a half-deleted folder then reads as uncommitted, not as broken.
                        self.storage.delete([ref.key(MANIFEST_NAME)])
                    self.storage.delete_prefix(ref.folder + "/")  # on a filesystem, also the empty folder
                except PermanentStorageError as e:
                    # One folder it may not delete (copied in by another user, held by the bucket)
                    # must not keep every older one for good: go on, and say the refusal below.
                    refused = refused or e
                    continue
                if empty:
                    log.debug("retention: %s holds no object (only delete markers?)", url(ref.folder))
                else:
                    log.info("retention: removed %s", url(ref.folder))
            if refused is not None:
                raise refused
            if self.config.keep is None and not held_for_pin:
                # Not past a folder kept for a pin: the next passes look at it again, and remove
                # it once the pin is gone.
                self._swept_through = committed
        except FencedError as e:
            log.error("retention: deleting nothing: %s", e)
        except RetainedError as e:
            if RetainedError.__name__ in self._refusals_said:
                log.debug("retention: the bucket still keeps old checkpoints: %s", e)
            else:
                self._refusals_said.add(RetainedError.__name__)
                log.warning(
                    "retention: the bucket keeps old checkpoints that keep=%s would remove; they stay until "
                    "its retention period ends or the hold is released (retried each save, said once): %s",
                    self.config.keep,
                    e,
                )
        except PermanentStorageError as e:
            # A refusal that will not pass by itself (a policy that denies deletes): said once a
            # kind, then at debug level, not once a save for the rest of the run.
            kind = f"{type(e).__name__}: {str(e).split(':', 1)[0]}"  # "permission denied", not the keys
            if kind in self._refusals_said:
                log.debug("retention: could not remove old checkpoints (retried each save): %s", e)
            else:
                self._refusals_said.add(kind)
                log.warning("retention: could not remove old checkpoints (retried each save, said once): %s", e)
        except (StorageError, OwnershipError, OSError) as e:
            log.warning("retention: could not remove old checkpoints (will retry next save): %s", e)
        except Exception as e:
            # Rank 0 alone runs this, after the commit: raising would fail a committed save (or
            # flush) on rank 0 only, while its peers wait for it in the next collective.
            log.error("retention: could not remove old checkpoints (will retry next save): %r", e, exc_info=e)
