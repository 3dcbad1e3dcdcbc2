"""Readers of a checkpoint URI (an eval job's Checkpointer, ``spotjob ckpt ...``) while the job that
owns it keeps saving and retention removes old checkpoints: the reader never breaks the writer,
and never passes off a checkpoint deleted under it as broken, nor fails on it with a bare error.

Each race is made to happen at a chosen point by a hook; nothing waits on time.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import agent.checkpoint._restore as restore_module
import agent.checkpoint._save as save_module
from agent.catalog import list_checkpoints, verify_deep
from agent.checkpoint import Checkpointer, RestoreRefusedError
from agent.checkpoint._core import lock_staging_folder
from agent.dcp_safe import IN_PLACE_READS, VerifiedReader
from agent.storage import open_storage
from orchestrator import ckpt_export, ckpt_select
from orchestrator.ckpt_common import EXIT_ERROR
from orchestrator.cli import main

sys.path.insert(0, str(Path(__file__).resolve().parent / "scripts"))
from ckpt_compare import assert_same
from ckpt_state import make_state, snapshot, train


def a_checkpointer_arrives_mid_save(monkeypatch: pytest.MonkeyPatch, root: Path) -> list[Checkpointer]:
    """Make another Checkpointer of job "train" on ``root`` (as an eval script or a new attempt
    would) while the next save's files are written in its staging folder, not yet committed;
    the list it returns holds it once the hook ran (the caller closes it)."""
    others: list[Checkpointer] = []
    real_sync_files = save_module.sync_files

    def sync_files_with_a_reader_arriving(*args: Any, **kwargs: Any) -> Any:
        if not others:
            others.append(Checkpointer(str(root), keep=None, job="train", async_save=False))
        return real_sync_files(*args, **kwargs)

    monkeypatch.setattr(save_module, "sync_files", sync_files_with_a_reader_arriving)
    return others


@pytest.mark.parametrize("async_save", [False, True])
def test_a_second_checkpointer_on_the_uri_does_not_remove_a_save_in_flight(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, async_save: bool
) -> None:
    """A second Checkpointer of the job (an eval script reading its checkpoints, a new attempt) made
    while the job writes a save: on a filesystem URI both stage in ``<uri>/.spotjob-staging``, and
    cleaning stale staged saves at construction removed the one in flight, failing it."""
    root = tmp_path / "ckpt"
    state = make_state(0)
    train(state, 1)
    others = a_checkpointer_arrives_mid_save(monkeypatch, root)
    with Checkpointer(str(root), every_steps=1, keep=1, job="train", async_save=async_save) as ckpt:
        ckpt.save(1, state)
        ckpt.wait()
    assert others, "the hook did not run"
    others[0].close()
    found = list_checkpoints(open_storage(str(root)))
    assert [(s.ref.folder, s.valid) for s in found] == [("step-000000001", True)]


def test_a_stale_staging_folder_is_still_removed(tmp_path: Path) -> None:
    """What the lock must not stop: a folder left by a save that was killed goes at construction."""
    root = tmp_path / "ckpt"
    stale = root / ".spotjob-staging" / "step-000000003-deadbeef" / "rank-0"
    stale.mkdir(parents=True)
    (stale / "__0_0.distcp").write_bytes(b"partial")
    Checkpointer(str(root), keep=None, job="eval", async_save=False).close()
    assert not stale.parent.exists()


def test_a_stale_default_staging_folder_is_removed_when_the_job_stages_elsewhere(tmp_path: Path) -> None:
    """A save killed while the job staged beside its checkpoints (no staging folder given) left its
    folder in ``<uri>/.spotjob-staging``; the job then runs with one (spotjob-agent on Kubernetes
    always gives one). The leftover, hard links of a whole checkpoint's files, still goes at
    construction — but not a folder a save in flight holds (an eval job staging there), nor one
    written in the last 16 minutes, whose lock another machine's save may hold unseen (NFS without
    lock service)."""
    from agent.checkpoint._claim import LAPSES_AFTER_S

    root = tmp_path / "ckpt"
    stale = root / ".spotjob-staging" / "step-000000003-deadbeef" / "rank-0"
    stale.mkdir(parents=True)
    (stale / "__0_0.distcp").write_bytes(b"partial")
    held = root / ".spotjob-staging" / "step-000000004-feedface"
    held.mkdir()
    fd = lock_staging_folder(str(held))
    recent = root / ".spotjob-staging" / "step-000000005-0badf00d" / "rank-0"
    recent.mkdir(parents=True)
    (recent / "__0_0.distcp").write_bytes(b"being written")
    old = time.time() - LAPSES_AFTER_S - 60
    for path in (stale, stale / "__0_0.distcp", stale.parent, held, held / ".lock"):
        os.utime(path, (old, old))
    os.utime(recent.parent, (old, old))  # only its file is new
    try:
        Checkpointer(str(root), keep=None, job="train", async_save=False, staging_dir=str(tmp_path / "nvme")).close()
    finally:
        os.close(fd)
    assert not stale.parent.exists()
    assert held.exists()
    assert recent.exists()


@pytest.mark.parametrize("scheme", ["file", "s3"])
def test_a_restore_whose_checkpoint_retention_deletes_under_it_restores_the_newer_one(
    fresh_uri: Callable[[str], str], monkeypatch: pytest.MonkeyPatch, scheme: str
) -> None:
    """An eval script (or a new attempt) restores while the job saves on with keep=1: the checkpoint
    it picked is deleted as it reads it. It restores the newer one, never calls the store
    unavailable (file store: a bare FileNotFoundError) nor the checkpoint missing a file."""
    uri = fresh_uri(scheme)
    state = make_state(0)
    train(state, 1)
    writer = Checkpointer(uri, every_steps=1, keep=1, job="train", async_save=False)
    writer.save(1, state)
    saved: dict[int, Any] = {}
    real_hold_all = VerifiedReader.hold_all

    def hold_all_as_the_writer_saves_on(self: VerifiedReader) -> None:
        if not saved:  # the reader picked step 1 and is about to open its files
            train(state, 1, start=1)
            writer.save(2, state)  # keep=1: retention removes step 1
            saved[2] = snapshot(state)
        real_hold_all(self)

    monkeypatch.setattr(restore_module.VerifiedReader, "hold_all", hold_all_as_the_writer_saves_on)
    reader_state = make_state(0, seed=7)
    with Checkpointer(uri, keep=None, job="train", async_save=False) as reader:
        assert reader.restore(reader_state) == 2
    writer.close()
    assert_same(snapshot(reader_state), saved[2])


def test_a_restore_whose_only_checkpoint_vanishes_refuses_and_never_starts_from_step_0(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The checkpoint the restore picked is gone when it reads it, and nothing newer came (deleted by
    hand, say): it refuses, naming what happened, rather than start from step 0."""
    root = tmp_path / "ckpt"
    state = make_state(0)
    train(state, 1)
    with Checkpointer(str(root), every_steps=1, keep=None, job="train", async_save=False) as writer:
        writer.save(1, state)
    real_ensure_local = VerifiedReader.ensure_local

    def ensure_local_of_a_deleted_checkpoint(self: VerifiedReader, path: str) -> str:
        folder = root / self.folder
        (folder / "MANIFEST.json").unlink()  # as retention deletes: the manifest first, then the rest
        shutil.rmtree(folder)
        return real_ensure_local(self, path)

    monkeypatch.setattr(restore_module.VerifiedReader, "ensure_local", ensure_local_of_a_deleted_checkpoint)
    with (
        Checkpointer(str(root), keep=None, job="train", async_save=False) as reader,
        pytest.raises(RestoreRefusedError, match="deleted while it was read"),
    ):
        reader.restore(make_state(0, seed=7))


class _SavingOn:
    """The job that owns the URI (keep=1), saving step 2 the first time it is called: retention
    then removes step 1, which a reader picked a moment before."""

    def __init__(self, uri: str) -> None:
        self.state = make_state(0)
        train(self.state, 1)
        self.writer = Checkpointer(uri, every_steps=1, keep=1, job="train", async_save=False)
        self.writer.save(1, self.state)
        self.saved_model = snapshot(self.state)["model"]  # step 1's
        self.saved = False

    def __call__(self) -> None:
        if not self.saved:
            self.saved = True
            train(self.state, 1, start=1)
            self.writer.save(2, self.state)


def _command_while_the_job_saves(monkeypatch: pytest.MonkeyPatch, uri: str, hooked: str, argv: list[str]) -> int:
    """``spotjob ckpt ...argv`` on ``uri``, the job saving step 2 (retention deleting step 1) right
    before the command's ``hooked`` step (``module.name``) reads the checkpoint it picked; its exit status."""
    job = _SavingOn(uri)
    _hook_before(monkeypatch, hooked, job)
    try:
        return main(["ckpt", *argv])
    finally:
        job.writer.close()


def _export_unpinned(monkeypatch: pytest.MonkeyPatch) -> None:
    """Exports here read unpinned, as one without write access to the URI does (``agent.pins``): a
    pinned export's step is left alone by retention (tests/integration/test_checkpoint_pins.py)."""
    monkeypatch.setattr(ckpt_export, "pinned", lambda storage, folder: contextlib.nullcontext())


def _hook_before(monkeypatch: pytest.MonkeyPatch, target: str, before: Callable[[], None]) -> None:
    module, name = target.rsplit(".", 1)
    real = getattr(importlib.import_module(module), name)

    def hooked(*args: Any, **kwargs: Any) -> Any:
        before()
        return real(*args, **kwargs)

    monkeypatch.setattr(target, hooked)


@pytest.mark.parametrize("scheme", ["file", "s3"])
def test_export_of_the_newest_deleted_under_it_exports_the_newer_one(
    fresh_uri: Callable[[str], str],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    scheme: str,
) -> None:
    _export_unpinned(monkeypatch)
    uri = fresh_uri(scheme)
    out = tmp_path / "export"
    argv = ["export", uri, str(out)]
    assert _command_while_the_job_saves(monkeypatch, uri, "orchestrator.ckpt_export.export_safetensors", argv) == 0
    err = capsys.readouterr()
    assert "step-000000001 was deleted while it was read" in err.err
    assert "from " + open_storage(uri).url("step-000000002") in err.out
    assert sorted(os.listdir(out)) == ["model.safetensors", "model.safetensors.index.json"]


@pytest.mark.parametrize("scheme", ["file", "s3"])
def test_export_of_a_named_step_deleted_under_it_says_so_and_leaves_nothing(
    fresh_uri: Callable[[str], str],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    scheme: str,
) -> None:
    _export_unpinned(monkeypatch)
    uri = fresh_uri(scheme)
    out = tmp_path / "export"
    argv = ["export", "--step", "1", uri, str(out)]
    hooked = "orchestrator.ckpt_export.export_safetensors"
    assert _command_while_the_job_saves(monkeypatch, uri, hooked, argv) == EXIT_ERROR
    err = capsys.readouterr().err
    assert "step-000000001 was deleted while it was being exported" in err
    assert "--step" in err and "Traceback" not in err
    assert not out.exists()


@pytest.mark.parametrize("scheme", ["file", "s3"])
def test_verify_deep_of_a_checkpoint_deleted_under_it_is_an_error_not_a_verdict(
    fresh_uri: Callable[[str], str],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    scheme: str,
) -> None:
    """Not "INVALID — file missing" (exit 1: a broken checkpoint), nor "valid"."""
    uri = fresh_uri(scheme)
    hooked = "orchestrator.ckpt_deep.verify_deep"
    status = _command_while_the_job_saves(monkeypatch, uri, hooked, ["verify", "--deep", uri])
    assert status == EXIT_ERROR
    captured = capsys.readouterr()
    assert "step-000000001 was deleted while it was being verified" in captured.err
    assert "valid" not in captured.out.lower()


def test_export_deleted_between_its_shards_is_exported_whole_from_the_files_it_checked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A filesystem store's files are read in place, each held open from its check on: deleted
    after the first safetensors file was written, the export still writes every file of the step
    it checked (before files were held, it removed what it wrote and exited 2; a file deleted
    before the export first opened it still ends that way, as the test above shows)."""
    _export_unpinned(monkeypatch)
    import torch.distributed.checkpoint as dcp

    root = tmp_path / "ckpt"
    job = _SavingOn(str(root))
    loads = []
    real_load = dcp.load

    def load_then_the_job_saves_on(*args: Any, **kwargs: Any) -> Any:
        loads.append(1)
        if len(loads) == 2:  # the first shard is written (as a .partial file), the second not
            job()
        return real_load(*args, **kwargs)

    monkeypatch.setattr(dcp, "load", load_then_the_job_saves_on)
    out = tmp_path / "export"
    code = main(["ckpt", "export", "--step", "1", "--max-shard-size", "200", str(root), str(out)])
    job.writer.close()
    assert code == 0, capsys.readouterr().err
    assert len(loads) >= 2
    assert not (root / "step-000000001").exists()
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(job.saved_model)
    from safetensors.torch import load_file

    exported = {}
    for name in sorted(set(index["weight_map"].values())):
        exported.update(load_file(out / name))
    assert_same({"model": exported}, {"model": job.saved_model})


def test_a_restore_that_sees_the_newest_in_progress_and_the_one_before_gone_restores_the_newest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The listing holds step 2 (a save in progress) and step 1; as the restore looks at step 2 it
    is uncommitted, then it commits and retention deletes step 1 before the restore looks there.
    No folder read as committed: the restore returned 0, starting over committed checkpoints."""
    root = tmp_path / "ckpt"
    state = make_state(0)
    train(state, 1)
    with Checkpointer(str(root), every_steps=1, keep=None, job="train", async_save=False) as writer:
        writer.save(1, state)
        train(state, 1, start=1)
        writer.save(2, state)
    saved = snapshot(state)
    manifest = root / "step-000000002" / "MANIFEST.json"
    aside = tmp_path / "MANIFEST.json"
    manifest.rename(aside)  # step 2: a save in progress
    real_inspect = restore_module.inspect
    looked: list[str] = []

    def inspect_as_the_job_commits_and_retention_deletes(storage: Any, ref: Any, **kwargs: Any) -> Any:
        status = real_inspect(storage, ref, **kwargs)
        looked.append(ref.folder)
        if len(looked) == 1:  # step 2 seen uncommitted: it commits, and keep=1 removes step 1
            aside.rename(manifest)
            (root / "step-000000001" / "MANIFEST.json").unlink()
            shutil.rmtree(root / "step-000000001")
        return status

    monkeypatch.setattr(restore_module, "inspect", inspect_as_the_job_commits_and_retention_deletes)
    reader_state = make_state(0, seed=7)
    with Checkpointer(str(root), keep=None, job="train", async_save=False) as reader:
        assert reader.restore(reader_state) == 2
    assert looked[:2] == ["step-000000002", "step-000000001"]
    assert_same(snapshot(reader_state), saved)


@pytest.mark.parametrize("command", [["export"], ["verify"]])
def test_ckpt_commands_that_see_the_newest_in_progress_and_the_one_before_gone_use_the_newest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], command: list[str]
) -> None:
    """As the restore above: `export` said "no valid checkpoint" (exit 1), `verify` "no committed
    checkpoint", while step 2 had just been committed."""
    root = tmp_path / "ckpt"
    state = make_state(0)
    train(state, 1)
    with Checkpointer(str(root), every_steps=1, keep=None, job="train", async_save=False) as writer:
        writer.save(1, state)
        writer.save(2, state)
    manifest = root / "step-000000002" / "MANIFEST.json"
    aside = tmp_path / "MANIFEST.json"
    manifest.rename(aside)
    real_inspect = ckpt_select.inspect
    looked: list[str] = []

    def inspect_as_the_job_commits_and_retention_deletes(storage: Any, ref: Any, **kwargs: Any) -> Any:
        status = real_inspect(storage, ref, **kwargs)
        looked.append(ref.folder)
        if len(looked) == 1:
            aside.rename(manifest)
            (root / "step-000000001" / "MANIFEST.json").unlink()
            shutil.rmtree(root / "step-000000001")
        return status

    monkeypatch.setattr(ckpt_select, "inspect", inspect_as_the_job_commits_and_retention_deletes)
    args = [str(root), str(tmp_path / "export")] if command == ["export"] else [str(root)]
    assert main(["ckpt", *command, *args]) == 0
    assert looked[:2] == ["step-000000002", "step-000000001"]
    assert "step-000000002" in capsys.readouterr().out


@pytest.mark.parametrize("start_fresh", [False, True])
def test_a_restore_outrun_by_the_jobs_retention_says_to_retry_and_never_starts_fresh(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, start_fresh: bool
) -> None:
    """The job (keep=1) commits a new step each time the restore starts reading the one it picked,
    so every checkpoint it tries is deleted under it. Before, the refusal read as a model that no
    longer fits ("Restore with the model they were saved with", "start_fresh"), and with
    ``start_fresh`` the job's newest checkpoints were retired and the run started from step 0. The
    hook stands in for a job that saves faster than the restore reads; it does not model a store's
    own timing."""
    root = tmp_path / "ckpt"
    job = _SavingOn(str(root))
    real_hold_all = VerifiedReader.hold_all
    reads: list[str] = []

    def hold_all_as_the_job_saves_again(self: VerifiedReader) -> None:
        if self.folder not in reads:  # each checkpoint picked, before its files are opened: the job commits the next
            reads.append(self.folder)
            step = len(reads) + 1
            train(job.state, 1, start=step - 1)
            job.writer.save(step, job.state)
        real_hold_all(self)

    monkeypatch.setattr(restore_module.VerifiedReader, "hold_all", hold_all_as_the_job_saves_again)
    reader_state = make_state(0, seed=7)
    before = snapshot(reader_state)
    with (
        Checkpointer(str(root), keep=None, job="train", async_save=False, start_fresh=start_fresh) as reader,
        pytest.raises(RestoreRefusedError) as refused,
    ):
        reader.restore(reader_state)
    job.writer.close()
    message = str(refused.value)
    assert "deleted while it was read" in message and "retry" in message.lower() and "keep" in message
    assert "saved with" not in message and "start_fresh" not in message
    assert_same(snapshot(reader_state), before)  # nothing loaded
    found = list_checkpoints(open_storage(str(root)))
    assert [(s.ref.folder, s.valid, s.retired) for s in found] == [(f"step-{len(reads) + 1:09d}", True, False)]


@pytest.mark.skipif(
    not IN_PLACE_READS,
    reason="the hook is on the in-place read, which torch 2.9.1's file reader cannot do (no get_record_size)",
)
def test_a_filesystem_checkpoint_deleted_after_its_check_still_loads_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a filesystem URI a restore reads the checkpoint's own files, verified first, then copied
    into the model tensor by tensor. Retention deleting it between the two (after the first big
    tensor was copied) failed the restore with the model half loaded ("The state now mixes
    checkpoint and initial values"). The files it checked stay open until the load is done, so the
    deletion cannot reach it. The hook deletes as retention does (the manifest, then the folder);
    it does not model a store that truncates files in place (none of spotjob's does)."""
    import torch
    from torch import nn

    import agent.dcp_safe as dcp_safe

    def model(seed: int) -> nn.Module:
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(256, 512), nn.Linear(512, 256))  # 512 KiB each: read in place

    root = tmp_path / "ckpt"
    saved = model(0)
    with Checkpointer(str(root), keep=None, job="train", async_save=False) as writer:
        writer.save(1, {"model": saved})
    real_read_exactly = dcp_safe._read_exactly
    copied: list[str] = []

    def read_exactly_as_retention_deletes(path: str, *args: Any, **kwargs: Any) -> None:
        copied.append(path)
        if len(copied) == 2:  # one tensor is in the model already
            (root / "step-000000001" / "MANIFEST.json").unlink()
            shutil.rmtree(root / "step-000000001")
        return real_read_exactly(path, *args, **kwargs)

    monkeypatch.setattr(dcp_safe, "_read_exactly", read_exactly_as_retention_deletes)
    reader_model = model(7)
    with Checkpointer(str(root), read_only=True, job="train") as reader:
        assert reader.restore({"model": reader_model}) == 1
    assert len(copied) >= 2
    for name, tensor in saved.state_dict().items():
        assert torch.equal(reader_model.state_dict()[name], tensor), name


@pytest.mark.parametrize("scheme", ["file", "s3"])
def test_an_eval_loop_polling_newest_step_evaluates_each_new_checkpoint_once_in_order(
    fresh_uri: Callable[[str], str], scheme: str
) -> None:
    """The README's eval loop: ``newest_step()`` (no load) decides whether to ``restore()``. Before
    it, a reader could only ``restore()`` again and again, reading the whole checkpoint at every
    poll to learn that nothing was new. A save in progress (a folder without its manifest) is
    never taken for the newest. The writer runs in this process; saving and polling take turns."""
    uri = fresh_uri(scheme)
    state = make_state(0)
    train(state, 1)
    writer = Checkpointer(uri, every_steps=1, keep=1, job="train", async_save=False)
    evaluated: list[int] = []
    polls = 0
    with Checkpointer(uri, read_only=True, job="train") as reader:
        assert reader.newest_step() == 0

        def poll() -> None:
            nonlocal polls
            polls += 1
            if reader.newest_step() > (evaluated[-1] if evaluated else 0):
                evaluated.append(reader.restore({"model": make_state(0, seed=7)["model"]}))

        for step in range(1, 5):
            train(state, 1, start=step - 1)
            writer.save(step, state)
            poll()
            poll()  # nothing new: nothing restored
        storage = open_storage(uri)
        storage.put_bytes("step-000000009/__0_0.distcp", b"a save in progress")
        assert reader.newest_step() == 4
        storage.close()
    writer.close()
    assert evaluated == [1, 2, 3, 4] and polls == 8


def test_two_writers_of_one_job_committing_one_step_at_the_same_moment_each_commit_stays_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same training script started twice on one URI (no controller, so no attempt numbers to
    fence either), the other commit of step 1 landing between this save's last check and its
    manifest: each writer claimed a folder of its own (``step-1``, ``step-1.1``), so both commits
    are whole, and a restore takes the newest copy. (Before claims both wrote into ``step-1``; the
    second to commit failed, and the files of the two saves were mixed. Landing before that check,
    the second to commit fails naming the other: test_checkpoint_two_writers.py.) The hook makes
    the other commit land there (the store's create-only writes decide, as between two processes);
    it does not model two hosts' clocks."""
    root = tmp_path / "ckpt"
    state = make_state(0)
    train(state, 1)
    first = Checkpointer(str(root), keep=1, job="train", attempt=None, async_save=False)
    second = Checkpointer(str(root), keep=1, job="train", async_save=False)
    real_put = second.storage.put_bytes_if_absent

    def put_after_the_other_commits(key: str, data: bytes) -> None:
        if key.endswith("MANIFEST.json"):
            first.save(1, state)
        real_put(key, data)

    monkeypatch.setattr(second.storage, "put_bytes_if_absent", put_after_the_other_commits)
    second.save(1, state)
    assert first.last_committed_uri is not None and first.last_committed_uri.endswith("/step-000000001.1")
    assert second.last_committed_uri is not None and second.last_committed_uri.endswith("/step-000000001")
    first.close()
    second.close()
    storage = open_storage(str(root))
    found = list_checkpoints(storage)
    assert [(s.ref.folder, s.valid, verify_deep(storage, s)) for s in found] == [
        ("step-000000001.1", True, []),
        ("step-000000001", True, []),
    ]


def test_a_filesystem_checkpoint_deleted_once_its_read_began_is_still_restored(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A checkpoint of a few files (up to 64: a job of up to 32 ranks) has them all opened when its
    read begins, before the first is checked. Deleted right after (as retention deletes: manifest,
    then folder), it was still restored; before, every file not yet checked was gone, and beside a
    job saving every step with keep=1 most restores had to start over (34 picks deleted in 49
    restores, against 7 in 93 with this). The hook deletes at the first read of DCP's metadata; it
    does not model a checkpoint deleted before its read began (the relist covers that)."""
    root = tmp_path / "ckpt"
    state = make_state(0)
    train(state, 1)
    with Checkpointer(str(root), keep=None, job="train", async_save=False) as writer:
        writer.save(1, state)
    saved = snapshot(state)
    real_read_metadata = VerifiedReader.read_metadata
    deleted: list[str] = []

    def read_metadata_as_retention_deletes(self: VerifiedReader, *args: Any, **kwargs: Any) -> Any:
        if not deleted:
            deleted.append(self.folder)
            (root / self.folder / "MANIFEST.json").unlink()
            shutil.rmtree(root / self.folder)
        return real_read_metadata(self, *args, **kwargs)

    monkeypatch.setattr(restore_module.VerifiedReader, "read_metadata", read_metadata_as_retention_deletes)
    reader_state = make_state(0, seed=7)
    with Checkpointer(str(root), read_only=True, job="train") as reader:
        assert reader.restore(reader_state) == 1
    assert deleted == ["step-000000001"]
    assert_same(snapshot(reader_state), saved)


def test_export_of_a_named_step_deleted_once_it_began_exports_it_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`ckpt export --step 1` of a filesystem checkpoint of a few files opens them all as it
    begins: retention deleting the step right after (at the first read of DCP's metadata) no longer
    fails the export (exit 2, "deleted while it was being exported"); it writes the step it began
    with. The hook deletes as retention does; a step deleted before the export began still fails it
    (the named-step test above)."""
    _export_unpinned(monkeypatch)
    root = tmp_path / "ckpt"
    job = _SavingOn(str(root))
    real_read_metadata = VerifiedReader.read_metadata
    deleted: list[str] = []

    def read_metadata_then_the_job_saves_on(self: VerifiedReader, *args: Any, **kwargs: Any) -> Any:
        if not deleted:
            deleted.append(self.folder)
            job()  # keep=1: step 1 goes
        return real_read_metadata(self, *args, **kwargs)

    monkeypatch.setattr(VerifiedReader, "read_metadata", read_metadata_then_the_job_saves_on)
    out = tmp_path / "export"
    code = main(["ckpt", "export", "--step", "1", str(root), str(out)])
    job.writer.close()
    assert code == 0, capsys.readouterr().err
    assert deleted == ["step-000000001"] and not (root / "step-000000001").exists()
    from safetensors.torch import load_file

    assert_same({"model": load_file(out / "model.safetensors")}, {"model": job.saved_model})


@pytest.mark.parametrize("scheme", ["file", "s3"])
def test_newest_step_passes_over_a_checkpoint_the_readers_restore_found_corrupt(
    fresh_uri: Callable[[str], str], scheme: str
) -> None:
    """The README's eval loop polls ``newest_step()`` and restores when it moved past ``done``. A
    newest checkpoint whose shard holds other bytes of the right size (a copy gone wrong, a shard
    overwritten on a versioned bucket) looks valid to ``newest_step()``, which reads no shard, and
    ``restore()`` passes over it for the one before. ``newest_step()`` went on naming it, so the loop
    restored (and evaluated) the older step again at every poll, without ever sleeping, until the
    job's retention removed the corrupt one. Now ``newest_step()`` passes over a checkpoint this
    Checkpointer's restore proved corrupt, as restore does; a newer commit is seen as before."""
    uri = fresh_uri(scheme)
    state = make_state(0)
    writer = Checkpointer(uri, every_steps=1, keep=None, job="train", async_save=False)
    for step in (1, 2, 3):
        train(state, 1, start=step - 1)
        writer.save(step, state)
    storage = open_storage(uri)
    shard = next(k.key for k in storage.list("step-000000003/") if k.key.endswith(".distcp"))
    data = bytearray(storage.get_bytes(shard))
    data[-1] ^= 0xFF
    storage.put_bytes(shard, bytes(data))
    with Checkpointer(uri, read_only=True, job="train") as reader:
        assert reader.newest_step() == 3  # nothing read yet proves it corrupt
        assert reader.restore({"model": make_state(0, seed=7)["model"]}) == 2
        assert reader.newest_step() == 2, "newest_step() named the checkpoint restore() just found corrupt"
        train(state, 1, start=3)
        writer.save(4, state)
        assert reader.newest_step() == 4
        assert reader.restore({"model": make_state(0, seed=7)["model"]}) == 4
    storage.close()
    writer.close()


def test_a_reader_restoring_the_model_alone_again_and_again_says_so_once(
    fresh_uri: Callable[[str], str], caplog: pytest.LogCaptureFixture
) -> None:
    """The README's eval loop restores ``{"model": model}`` alone at every new checkpoint. Each
    restore logged a WARNING that the optimizer was left out and to add it "to resume them too":
    advice for a training script, repeated for every checkpoint an eval job reads. A read-only
    Checkpointer now says it once, at INFO; a training Checkpointer still warns."""
    uri = fresh_uri("file")
    state = make_state(0)
    writer = Checkpointer(uri, every_steps=1, keep=None, job="train", async_save=False)
    caplog.set_level("INFO", logger="agent")
    with Checkpointer(uri, read_only=True, job="train") as reader:
        for step in (1, 2, 3):
            train(state, 1, start=step - 1)
            writer.save(step, state)
            assert reader.restore({"model": make_state(0, seed=7)["model"]}) == step
    said = [r for r in caplog.records if "which this read-only Checkpointer's restore() leaves out" in r.message]
    assert len(said) == 1 and said[0].levelname == "INFO"
    assert not any("also holds" in r.message for r in caplog.records)
    writer.close()
