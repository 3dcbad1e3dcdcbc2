"""Retention: ``keep`` committed checkpoints stay, leftovers older than the latest commit go, and
nothing newer than the checkpoint just committed is touched, corrupt or not.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from agent.catalog import CheckpointStatus, list_checkpoints
from agent.checkpoint import Checkpointer
from agent.manifest import MANIFEST_NAME
from agent.storage import open_storage

sys.path.insert(0, str(Path(__file__).resolve().parent / "scripts"))
import ckpt_harness as harness
from ckpt_compare import assert_same
from ckpt_state import make_state, snapshot, train


def statuses(root: Path) -> dict[str, CheckpointStatus]:
    return {s.ref.folder: s for s in list_checkpoints(open_storage(str(root)))}


def save_steps(root: Path, steps: list[int], *, keep: int | None) -> dict[int, dict[str, object]]:
    """Train and save each step (async, through ``step()``); return each step's state."""
    state = make_state(0)
    saved = {}
    with Checkpointer(str(root), every_steps=1, keep=keep) as ckpt:
        done = 0
        for step in steps:
            train(state, step - done, start=done)
            done = step
            ckpt.step(step, state)
            saved[step] = snapshot(state)
    return saved


def test_keep_2_leaves_exactly_the_newest_two_committed_checkpoints(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    save_steps(root, [1, 2, 3, 4, 5], keep=2)
    found = statuses(root)
    assert sorted(found) == ["step-000000004", "step-000000005"]
    assert all(s.valid for s in found.values())


def test_copies_of_one_step_from_restart_after_restart_count_once_towards_keep(
    storage_uri: str, tmp_path: Path
) -> None:
    """A script that saves the step it resumed from (``save(start)`` right after ``restore``), and is
    preempted before its next save, commits that step again on every restart: ``step-N.1``,
    ``step-N.2``... Each copy counted towards ``keep``, so after a few restarts ``keep=3`` held three
    copies of one step and had deleted every earlier one: nothing older left to fall back to."""
    state = make_state(0)
    staging = str(tmp_path / "staging")
    with Checkpointer(storage_uri, keep=3, async_save=False, staging_dir=staging) as ckpt:
        for step in range(1, 6):
            train(state, 1, start=step - 1)
            ckpt.save(step, state)
    for _ in range(4):  # four restarts, each preempted right after saving the step it resumed from
        with Checkpointer(storage_uri, keep=3, async_save=False, staging_dir=staging) as ckpt:
            ckpt.save(ckpt.restore(state), state)
    found = {s.ref.folder: s for s in list_checkpoints(open_storage(storage_uri))}
    assert sorted(found) == ["step-000000003", "step-000000004", "step-000000005.4"]
    assert all(s.valid for s in found.values())


def snapshot_of(uri: str, folder: str) -> bytes:
    """The manifest of ``folder`` (a filesystem URI): the same bytes, the same checkpoint (it names
    every file's CRC32C and the time it was committed)."""
    return (Path(uri) / folder / MANIFEST_NAME).read_bytes()


def run_without_restore(uri: str, seed: int, steps: int, staging: str) -> None:
    """A run of ``steps`` steps, saving every 10, that never calls ``restore()``."""
    state = make_state(0, seed=seed)
    with Checkpointer(uri, every_steps=10, async_save=False, staging_dir=staging) as ckpt:
        for step in range(1, steps + 1):
            train(state, 1, start=step - 1)
            ckpt.step(step, state)


def test_a_run_that_never_restored_deletes_none_of_the_jobs_checkpoints_of_the_steps_it_commits_again(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A restarted script that skipped ``restore()`` commits steps 10, 20 and 30 again beside the job's
    (``step-N.1``), and retention took each of the job's as an older copy of a step it keeps: the job's
    whole history went, one checkpoint a save, said at INFO only, and the run's untrained state was all
    a restore could load. Only a copy this Checkpointer restored or committed is such a copy."""
    uri, staging = str(tmp_path / "ckpt"), str(tmp_path / "staging")
    run_without_restore(uri, 0, 35, staging)
    job = {f: snapshot_of(uri, f) for f in ("step-000000010", "step-000000020", "step-000000030")}
    caplog.set_level("ERROR", logger="agent.checkpoint")
    run_without_restore(uri, 1, 30, staging)
    found = {s.ref.folder: s for s in list_checkpoints(open_storage(uri))}
    assert sorted(found) == sorted([*job, "step-000000010.1", "step-000000020.1", "step-000000030.1"])
    assert all(s.valid for s in found.values())
    assert {f: snapshot_of(uri, f) for f in job} == job
    told = [r.getMessage() for r in caplog.records if "never called restore()" in r.getMessage()]
    assert len(told) == 1 and "committed step 10" in told[0] and "step 30" in told[0], told


def test_a_run_that_never_restored_keeps_the_jobs_checkpoint_of_the_step_it_commits_and_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The job's newest checkpoint is step 10, and a restarted script that skipped ``restore()``
    commits step 10 again, as ``step-10.1``: retention removed the job's ``step-10`` at once without
    a word (no newer step to warn of), even with ``keep=1``. It stays, and the commit is an ERROR;
    the next restore loads the newest copy of the step, this run's."""
    uri, staging = str(tmp_path / "ckpt"), str(tmp_path / "staging")
    run_without_restore(uri, 0, 15, staging)
    job = snapshot_of(uri, "step-000000010")
    caplog.set_level("ERROR", logger="agent.checkpoint")
    state = make_state(0, seed=1)
    with Checkpointer(uri, every_steps=10, keep=1, async_save=False, staging_dir=staging) as ckpt:
        for step in range(1, 13):
            train(state, 1, start=step - 1)
            ckpt.step(step, state)
            if step == 10:
                run = snapshot(state)
    found = {s.ref.folder: s for s in list_checkpoints(open_storage(uri))}
    assert sorted(found) == ["step-000000010", "step-000000010.1"]
    assert snapshot_of(uri, "step-000000010") == job
    told = [r.getMessage() for r in caplog.records if "never called restore()" in r.getMessage()]
    assert len(told) == 1, told
    assert "step-000000010.1" in told[0] and "ckpt/step-000000010, " in told[0] and "same step" in told[0], told
    restored = make_state(0, seed=2)
    with Checkpointer(uri, async_save=False, staging_dir=staging) as ckpt:
        assert ckpt.restore(restored) == 10
    assert_same(snapshot(restored), run)  # not what README said: "loads [the job's], not this run's progress"


def test_steps_past_the_folder_names_nine_digits_are_ordered_by_number_on_every_store(
    storage_uri: str, tmp_path: Path
) -> None:
    """(Pins behaviour that already worked.) Folder names are zero-padded to nine digits, so after
    step 999,999,999 they grow longer and sort wrongly as text (``step-1000000000`` before
    ``step-999999999``), as do listings that are not in name order. Restore and retention order them
    by number on every store: the newest is step 10**9, and retention removes step 999, not 1000."""
    state = make_state(0)
    staging = str(tmp_path / "staging")
    with Checkpointer(storage_uri, keep=3, async_save=False, staging_dir=staging) as ckpt:
        for step in (999, 1000, 10**9 - 1, 10**9):
            train(state, 1)
            ckpt.save(step, state)
    assert sorted(s.ref.step for s in list_checkpoints(open_storage(storage_uri))) == [1000, 10**9 - 1, 10**9]
    with Checkpointer(storage_uri, staging_dir=staging) as again:
        assert again.restore(make_state(0, seed=1)) == 10**9


def test_leftovers_older_than_the_latest_commit_are_removed_newer_ones_are_not_touched(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    save_steps(root, [1], keep=None)
    for folder in ("step-000000002", "step-000000009"):  # saves that died before their manifest
        (root / folder).mkdir()
        (root / folder / "__0_0.distcp").write_bytes(b"partial")
    save_steps(root, [3], keep=None)
    found = statuses(root)
    assert sorted(found) == ["step-000000001", "step-000000003", "step-000000009"]
    assert found["step-000000001"].valid and found["step-000000003"].valid
    # Newer than the commit: possibly another writer's save in progress; never ours to remove.
    assert not found["step-000000009"].committed


@pytest.mark.parametrize("keep", [1, 2])
def test_newer_corrupt_checkpoints_never_cost_the_newest_valid_one(tmp_path: Path, keep: int) -> None:
    root = tmp_path / "ckpt"
    saved = save_steps(root, [1, 2, 3, 4], keep=None)
    # Step 4: a flipped shard byte (only a read finds it); step 3: a manifest that is refused.
    harness.flip_byte(root / "step-000000004" / "__0_0.distcp")
    doc = json.loads((root / "step-000000003" / MANIFEST_NAME).read_text())
    doc["files"][0]["path"] = "../escape"
    (root / "step-000000003" / MANIFEST_NAME).write_text(json.dumps(doc))

    state = make_state(0, seed=7)
    with Checkpointer(str(root), keep=keep) as ckpt:
        assert ckpt.restore(state) == 2
        assert_same(snapshot(state), saved[2], "the state restored from step 2")
        assert sorted(statuses(root)) == [f"step-00000000{n}" for n in (1, 2, 3, 4)]  # restore deletes nothing
        train(state, 1, start=2)
        ckpt.save(3, state)  # step-000000003 holds a manifest already: this one is step-000000003.1
    assert ckpt.last_committed_uri is not None and ckpt.last_committed_uri.endswith("/step-000000003.1")

    found = statuses(root)
    valid = sorted(name for name, s in found.items() if s.valid and name != "step-000000004")
    # The newest `keep` valid checkpoints survive: a broken one does not count as one of them.
    assert valid == ["step-000000002", "step-000000003.1"][-keep:]
    assert "step-000000004" in found, "retention touched a folder newer than the commit"
    assert "step-000000001" not in found

    fresh = make_state(0, seed=8)
    with Checkpointer(str(root), keep=keep) as again:
        assert again.restore(fresh) == 3
    assert again.last_committed_uri is not None and again.last_committed_uri.endswith("/step-000000003.1")


@pytest.mark.parametrize("planted", ["a folder without a manifest", "another job's checkpoint"])
def test_retention_removes_a_symlinked_step_folder_from_the_uri_and_nothing_where_it_points(
    tmp_path: Path, planted: str
) -> None:
    """Whoever can write in a shared checkpoint folder could plant ``step-…`` symlinks into folders
    only the job's user may change; retention deleting through them would wipe those."""
    root = tmp_path / "ckpt"
    save_steps(root, [1], keep=None)
    elsewhere = tmp_path / "elsewhere"
    if planted == "a folder without a manifest":
        elsewhere.mkdir()
        (elsewhere / "notes.txt").write_text("keep me")
        (elsewhere / "deeper").mkdir()
        (elsewhere / "deeper" / "data.bin").write_bytes(b"keep me too")
    else:
        save_steps(elsewhere, [7], keep=None)
        elsewhere = elsewhere / "step-000000007"  # a valid checkpoint, of step 7 (refused as step 2)
    before = sorted((p.relative_to(elsewhere), p.read_bytes()) for p in elsewhere.rglob("*") if p.is_file())
    (root / "step-000000002").symlink_to(elsewhere, target_is_directory=True)

    save_steps(root, [3, 4], keep=1)

    after = sorted((p.relative_to(elsewhere), p.read_bytes()) for p in elsewhere.rglob("*") if p.is_file())
    assert after == before, "retention deleted files outside the checkpoint URI through a symlink"
    assert sorted(statuses(root)) == ["step-000000004"]
    assert not (root / "step-000000002").is_symlink(), "the planted link is still a folder of the URI"


def test_keeping_every_checkpoint_a_save_reads_only_what_is_new_since_the_last_one(tmp_path: Path) -> None:
    """A run that keeps everything saves hundreds of times: the 11th save must read the store no
    more than the 3rd (each read every manifest ever committed), and a later one still removes a
    leftover newer than the last commit."""
    root = tmp_path / "ckpt"
    state = make_state(0)
    reads: dict[int, int] = {}
    with Checkpointer(str(root), every_steps=1, keep=None, async_save=False) as ckpt:
        counted = {"n": 0}
        for name in ("list", "get_bytes", "get_small"):
            original = getattr(ckpt.storage, name)

            def counting(*args: object, _original: Any = original, **kwargs: object) -> Any:
                counted["n"] += 1
                return _original(*args, **kwargs)

            setattr(ckpt.storage, name, counting)
        for step in range(1, 13):
            if step == 12:  # a save that died before its manifest, newer than the last commit
                (root / "step-000000011.1").mkdir()
                (root / "step-000000011.1" / "__0_0.distcp").write_bytes(b"partial")
            train(state, 1, start=step - 1)
            counted["n"] = 0
            ckpt.step(step, state)
            reads[step] = counted["n"]
    assert reads[11] == reads[3], f"store reads per save grew with the run: {reads}"
    found = statuses(root)
    assert "step-000000011.1" not in found, "the leftover of an unfinished save was not removed"
    assert sorted(found) == [f"step-{n:09d}" for n in range(1, 13)]
    assert all(s.valid for s in found.values())


def test_keeping_every_checkpoint_a_leftover_from_after_a_fresh_start_in_the_same_run_is_removed(
    tmp_path: Path,
) -> None:
    """The pass that skips what an earlier pass went through must not skip, after a restore that
    starts over from step 0, the leftovers of the new run below the old run's last commit."""
    root = tmp_path / "ckpt"
    state = make_state(0)
    with Checkpointer(str(root), keep=None, async_save=False, start_fresh=True) as ckpt:
        for step in (1, 2, 3):
            train(state, 1, start=step - 1)
            ckpt.save(step, state)
        for folder in root.glob("step-*"):  # every checkpoint unusable now: a shard of each lost
            next(folder.glob("*.distcp")).unlink()
        fresh = make_state(0, seed=5)
        assert ckpt.restore(fresh) == 0  # start_fresh: they are retired and the run starts over
        # The first save of the new run died before its manifest ...
        leftover = root / "step-000000001.1"
        leftover.mkdir()
        (leftover / "__0_0.distcp").write_bytes(b"partial")
        # ... and the next one commits.
        train(fresh, 2)
        ckpt.save(2, fresh)
    found = statuses(root)
    assert "step-000000001.1" not in found, "the leftover of the new run's unfinished save was not removed"
    assert found["step-000000002.1"].valid


@pytest.mark.parametrize(
    "alias",
    ["step-000000002.0", "step-0000000002", "step-00000000\u0662", "step-000000002\n"],
    ids=["attempt-0", "ten-digits", "arabic-indic-digit", "trailing-newline"],
)
def test_a_folder_named_like_a_checkpoint_but_not_spelled_as_spotjob_spells_it_is_never_taken_for_one(
    tmp_path: Path, alias: str
) -> None:
    """A stray folder whose name parses to the step of a real checkpoint (another spelling of the
    number) was listed as a second copy of it: retention counted it as one more kept checkpoint
    and then deleted the real folder it stood for."""
    root = tmp_path / "ckpt"
    save_steps(root, [1, 2], keep=None)
    (root / alias).mkdir()
    (root / alias / "notes.txt").write_text("not spotjob's")
    save_steps(root, [3], keep=2)
    found = statuses(root)
    assert sorted(found) == ["step-000000002", "step-000000003"]
    assert all(s.valid for s in found.values())
    assert (root / alias / "notes.txt").read_text() == "not spotjob's"


def _counting_parses(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Every ``Manifest.parse`` from now on, by the step of the manifest parsed."""
    from agent.manifest import Manifest

    parsed: list[int] = []
    original = Manifest.parse.__func__  # type: ignore[attr-defined]

    def counted(cls: type[Manifest], data: bytes) -> Manifest:
        manifest = original(cls, data)
        parsed.append(manifest.step)
        return manifest  # type: ignore[no-any-return]

    monkeypatch.setattr(Manifest, "parse", classmethod(counted))
    return parsed


@pytest.mark.parametrize("keep", [1, 3])
def test_retention_takes_the_manifests_this_checkpointer_committed_without_parsing_them_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, keep: int
) -> None:
    """Each pass inspects every older checkpoint: the ones this Checkpointer committed are still
    read (and listed, sized, judged), but their bytes, unchanged, are not parsed and validated
    again (for 8000 tensors that was a tenth of a save): the manifest it wrote is taken instead."""
    root = tmp_path / "ckpt"
    state = make_state(0)
    parsed = _counting_parses(monkeypatch)
    with Checkpointer(str(root), every_steps=1, keep=keep, async_save=False) as ckpt:
        for step in range(1, 6):
            train(state, 1, start=step - 1)
            ckpt.step(step, state)
    assert parsed == []
    found = statuses(root)
    assert sorted(found) == [f"step-{n:09d}" for n in range(6 - keep, 6)]
    assert all(s.valid for s in found.values())


def test_a_manifest_changed_in_storage_since_this_checkpointer_committed_it_is_judged_as_stored(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The manifest held from a commit stands only for the bytes it was written as: one replaced in
    storage since (here by a newer spotjob's format) is parsed and judged as it is there, and
    retention leaves a newer format alone, as it always did. Pins behaviour that held before."""
    root = tmp_path / "ckpt"
    state = make_state(0)
    parsed = _counting_parses(monkeypatch)
    with Checkpointer(str(root), every_steps=1, keep=1, async_save=False) as ckpt:
        ckpt.step(1, state)
        path = root / "step-000000001" / MANIFEST_NAME
        doc = json.loads(path.read_bytes())
        doc["format_version"] = 99
        path.chmod(0o644)
        path.write_text(json.dumps(doc, indent=2))
        train(state, 1, start=1)
        ckpt.step(2, state)
    assert parsed == []  # a newer format is refused before validation: no Manifest parsed
    found = statuses(root)
    assert sorted(found) == ["step-000000001", "step-000000002"]
    assert found["step-000000001"].newer_format and found["step-000000002"].valid


def test_the_manifests_held_for_retention_stay_within_their_count_and_bytes(tmp_path: Path) -> None:
    """Held even when no retention pass prunes them (one that failed early): never more than
    ``_WRITTEN_HELD`` manifests nor more than ``_WRITTEN_HELD_BYTES`` of them."""
    from agent.catalog import WrittenManifest
    from agent.checkpoint import _retention
    from agent.manifest import FileEntry, Manifest, now_utc

    manifest = Manifest(
        step=1,
        world_size=1,
        created_at=now_utc(),
        torch_version="t",
        state_keys=["m"],
        files=[FileEntry(path="a", size=0, crc32c="00000000")],
    )
    with Checkpointer(str(tmp_path / "ckpt"), async_save=False) as ckpt:
        for step in range(1, 13):
            ckpt._hold_written(f"step-{step:09d}", WrittenManifest(b"d", manifest, 100))
        assert list(ckpt._written) == [f"step-{step:09d}" for step in range(13 - _retention._WRITTEN_HELD, 13)]
        big = _retention._WRITTEN_HELD_BYTES // 2 + 1
        ckpt._hold_written("step-000000013", WrittenManifest(b"d", manifest, big))
        ckpt._hold_written("step-000000014", WrittenManifest(b"d", manifest, big))
        assert list(ckpt._written) == ["step-000000014"]
        ckpt._hold_written("step-000000015", WrittenManifest(b"d", manifest, 2 * _retention._WRITTEN_HELD_BYTES))
        assert list(ckpt._written) == []  # too big on its own: parsed as any other
