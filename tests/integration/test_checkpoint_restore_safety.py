"""Restore never goes back in time on its own.

- A store that keeps failing (503 past the retries) on the newest checkpoint fails the restore
  with ``StorageUnavailableError`` — reported to the agent as an infrastructure error — instead of
  loading an older checkpoint and re-training committed steps.
- A model whose shapes changed is refused with the first mismatch (``RestoreRefusedError``), not
  called corrupt, and nothing is deleted.
- ``start_fresh`` begins at step 0 on purpose: the refused checkpoints are kept, never restored,
  never counted or deleted by retention, and the new run's own checkpoints are what later
  restores find, even with ``start_fresh`` still set.
- A store that refuses for good (no such bucket, 403) raises ``StorageRefusedError`` and is not
  reported to the agent as an infrastructure error: a restart would meet the same refusal.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from agent.catalog import CheckpointRef, list_checkpoints
from agent.checkpoint import Checkpointer, RestoreRefusedError, StorageRefusedError, StorageUnavailableError
from agent.control_channel import INFRA_ERROR_FILE
from agent.manifest import FORMAT_VERSION, MANIFEST_NAME
from agent.ownership import attempt_key, record_attempt
from agent.storage import open_storage
from orchestrator.cli import main as cli_main

sys.path.insert(0, str(Path(__file__).resolve().parent / "scripts"))
from ckpt_compare import assert_same
from ckpt_state import make_state, snapshot, train

try:
    from faults import FaultProxy, Request
except ImportError:  # tests/ collected as a package
    from tests.faults import FaultProxy, Request


# -- a store that keeps failing --------------------------------------------------------------------


@pytest.fixture(params=["s3", "gs"])
def two_checkpoints_behind_a_proxy(
    request: pytest.FixtureRequest,
    monkeypatch: pytest.MonkeyPatch,
    fresh_uri: Callable[[str], str],
    fault_proxy: Callable[..., FaultProxy],
    fast_retries: None,
    tmp_path: Path,
) -> tuple[str, FaultProxy]:
    """Steps 1 and 2 committed on a fresh bucket; from then on every request goes through a proxy."""
    scheme: str = request.param
    uri = fresh_uri(scheme)
    state = make_state(0)
    with Checkpointer(uri, keep=None, staging_dir=str(tmp_path / "staging")) as ckpt:
        for step in (1, 2):
            train(state, 1, start=step - 1)
            ckpt.save(step, state)
    server = request.getfixturevalue("moto_server" if scheme == "s3" else "gcs_server")
    proxy = fault_proxy(server, "s3" if scheme == "s3" else "gcs")
    monkeypatch.setenv("AWS_ENDPOINT_URL" if scheme == "s3" else "STORAGE_EMULATOR_HOST", proxy.url)
    return uri, proxy


def step2_data(req: Request) -> bool:
    """A read of one of step 2's data files (shard, per-rank state, DCP metadata), any API."""
    return re.search(r"step-000000002(%2F|/)(__|rank-|\.metadata)", req.path) is not None


def test_restore_fails_loudly_when_the_newest_checkpoints_files_keep_failing_and_loads_nothing_older(
    two_checkpoints_behind_a_proxy: tuple[str, FaultProxy], tmp_path: Path
) -> None:
    uri, proxy = two_checkpoints_behind_a_proxy
    unavailable = proxy.fail(10_000, 503, method="GET", match=step2_data)
    state = make_state(0, seed=9)
    untouched = snapshot(state)
    control = tmp_path / "control"
    with (
        pytest.raises(StorageUnavailableError, match=re.escape(uri)) as failed,
        Checkpointer(uri, staging_dir=str(tmp_path / "staging"), control_dir=str(control)) as ckpt,
    ):
        ckpt.restore(state)
    assert unavailable.served >= 5, "the store did not keep failing past the retries"
    assert "503" in str(failed.value) and "step-000000002" in str(failed.value)
    assert_same(snapshot(state), untouched, "the state (step 1 must not have been loaded)")
    report = json.loads((control / INFRA_ERROR_FILE).read_text())
    assert report["rank"] == 0 and "unavailable" in report["error"]

    proxy.clear()  # the store answers again: the newest checkpoint it is
    with Checkpointer(uri, staging_dir=str(tmp_path / "staging")) as again:
        assert again.restore(make_state(0, seed=9)) == 2


def test_restore_fails_loudly_when_listing_the_checkpoints_keeps_failing(
    two_checkpoints_behind_a_proxy: tuple[str, FaultProxy], tmp_path: Path
) -> None:
    uri, proxy = two_checkpoints_behind_a_proxy
    state = make_state(0, seed=9)
    with Checkpointer(uri, staging_dir=str(tmp_path / "staging")) as ckpt:
        listing = proxy.fail(10_000, 503, method="GET", match=lambda r: "prefix=" in r.path)
        with pytest.raises(StorageUnavailableError, match="listing the checkpoints"):
            ckpt.restore(state)
    assert listing.served >= 5


@pytest.mark.parametrize("scheme", ["s3", "gs"])
def test_a_missing_bucket_is_refused_at_construction_naming_it_and_is_no_infrastructure_error(
    scheme: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    request.getfixturevalue("moto_server" if scheme == "s3" else "gcs_server")
    control = tmp_path / "control"
    with pytest.raises(StorageRefusedError) as refused:
        Checkpointer(
            f"{scheme}://spotjob-no-such-bucket/run", staging_dir=str(tmp_path / "s"), control_dir=str(control)
        )
    message = str(refused.value)
    assert "'spotjob-no-such-bucket' does not exist" in message and "create it" in message
    assert "Retrying cannot help" in message and "retry when the store answers" not in message
    # Reported, spotjob-agent would exit 74 and the job restart without end on a bucket that is not there.
    assert not (control / INFRA_ERROR_FILE).exists()


@pytest.mark.parametrize("what", ["listing", "reading"])
def test_a_store_that_denies_access_stops_the_restore_without_an_infrastructure_error(
    two_checkpoints_behind_a_proxy: tuple[str, FaultProxy], tmp_path: Path, what: str
) -> None:
    uri, proxy = two_checkpoints_behind_a_proxy
    state = make_state(0, seed=9)
    untouched = snapshot(state)
    control = tmp_path / "control"
    with Checkpointer(uri, staging_dir=str(tmp_path / "staging"), control_dir=str(control)) as ckpt:
        if what == "listing":
            proxy.fail(10_000, 403, method="GET", match=lambda r: "prefix=" in r.path)
        else:
            proxy.fail(10_000, 403, method="GET", match=step2_data)
        with pytest.raises(StorageRefusedError, match="permission denied") as refused:
            ckpt.restore(state)
    assert uri in str(refused.value) and "Retrying cannot help" in str(refused.value)
    assert_same(snapshot(state), untouched, "the state (nothing older may be loaded)")
    assert not (control / INFRA_ERROR_FILE).exists()


_pwrite, _makedirs = os.pwrite, os.makedirs


@pytest.mark.parametrize(("code", "says"), [(errno.ENOSPC, "full or over its quota"), (errno.EROFS, "read-only")])
def test_a_staging_folder_that_refuses_the_download_is_named_and_is_no_infrastructure_error(
    fresh_uri: Callable[[str], str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int, says: str
) -> None:
    """The node's own disk refuses the restore cache (full: a download's ``pwrite``; read-only: its
    folder cannot be made): the staging folder is named with what to do, and it is neither called
    the store's fault nor reported to the agent (exit 74 would restart the job on it for ever)."""
    uri = fresh_uri("s3")
    state = make_state(0)
    with Checkpointer(uri, staging_dir=str(tmp_path / "saved-from")) as ckpt:
        train(state, 1)
        ckpt.save(1, state)
    staging, control = tmp_path / "staging", tmp_path / "control"

    def pwrite(fd: int, data: Any, offset: int) -> int:
        if code == errno.ENOSPC and os.readlink(f"/proc/self/fd/{fd}").startswith(str(staging)):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return _pwrite(fd, data, offset)

    def makedirs(path: Any, *args: Any, **kwargs: Any) -> None:
        if code == errno.EROFS and str(path).startswith(str(staging)):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        _makedirs(path, *args, **kwargs)

    restored = make_state(0, seed=9)
    untouched = snapshot(restored)
    with Checkpointer(uri, staging_dir=str(staging), control_dir=str(control)) as ckpt:
        with monkeypatch.context() as m:
            m.setattr(os, "pwrite", pwrite)
            m.setattr(os, "makedirs", makedirs)
            with pytest.raises(StorageRefusedError) as refused:
                ckpt.restore(restored)
        said = str(refused.value)
        assert f"the staging folder {staging}" in said and says in said, said
        assert "SPOTJOB_STAGING_DIR" in said and "retrying cannot help" in said, said
        assert "is unavailable" not in said and "fix the store" not in said, said
        assert not (control / INFRA_ERROR_FILE).exists()
        assert_same(snapshot(restored), untouched, "the state (nothing may be loaded)")
        assert ckpt.restore(restored) == 1  # the disk has room again


def test_a_refusal_naming_a_file_outside_the_staging_folder_is_not_the_staging_folders(
    fresh_uri: Callable[[str], str], tmp_path: Path
) -> None:
    """A client's own file that cannot be read (a web-identity token re-read during a download, a CA
    bundle) was blamed on the staging folder: a user failure with advice to stage elsewhere,
    instead of the store's unavailability."""
    staging = tmp_path / "staging"
    with Checkpointer(fresh_uri("s3"), staging_dir=str(staging)) as ckpt:
        token = PermissionError(errno.EACCES, "Permission denied", "/var/run/secrets/eks/token")
        assert ckpt._staging_disk_error(token) is None
        sibling = OSError(errno.EROFS, "Read-only file system", f"{ckpt._staging_root}2/x")
        assert ckpt._staging_disk_error(sibling) is None
        inside = OSError(errno.EROFS, "Read-only file system", os.path.join(ckpt._staging_root, "restore", "x"))
        assert ckpt._staging_disk_error(inside) is inside
        unnamed = OSError(errno.ENOSPC, "No space left on device")
        assert ckpt._staging_disk_error(unnamed) is unnamed


# -- a model that changed -----------------------------------------------------------------------


class Net(nn.Module):
    def __init__(self, features: int) -> None:
        super().__init__()
        self.fc = nn.Linear(features, 4)


def net_state(features: int, seed: int = 0) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = Net(features)
    return {"model": model, "optim": torch.optim.SGD(model.parameters(), lr=0.1)}


def save_steps(uri: str, state: dict[str, Any], steps: list[int], *, keep: int | None, **kw: Any) -> None:
    with Checkpointer(uri, keep=keep, async_save=False, **kw) as ckpt:
        for step in steps:
            with torch.no_grad():
                state["model"].fc.weight.add_(1.0)
            ckpt.save(step, state)


def folders(uri: str) -> list[str]:
    return sorted(s.ref.folder for s in list_checkpoints(open_storage(uri)))


def test_a_model_whose_shapes_changed_is_refused_naming_the_first_mismatch_and_nothing_is_deleted(
    tmp_path: Path,
) -> None:
    uri = str(tmp_path / "ckpt")
    save_steps(uri, net_state(8), [5, 6], keep=2)
    changed = net_state(16)
    untouched = {k: v.clone() for k, v in changed["model"].state_dict().items()}
    with Checkpointer(uri, keep=1) as ckpt, pytest.raises(RestoreRefusedError) as refused:
        ckpt.restore(changed)
    message = str(refused.value)
    assert "model.fc.weight: the checkpoint holds shape [4, 8], the model [4, 16]" in message
    assert "incompatible with the model" in message
    assert "corrupt" not in message and "unreadable" not in message
    assert "start_fresh=True" in message and "SPOTJOB_START_FRESH=1" in message
    # Only the newest was tried: an older checkpoint of a changed model would be going back in time.
    assert [url.rsplit("/", 1)[-1] for url, _ in refused.value.tried] == ["step-000000006"]
    assert_same(changed["model"].state_dict(), untouched, "the model after a refused restore")
    assert folders(uri) == ["step-000000005", "step-000000006"]


@pytest.mark.parametrize("how", ["argument", "environment"])
def test_start_fresh_keeps_the_refused_checkpoints_out_of_restore_and_retention_for_good(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str, caplog: pytest.LogCaptureFixture
) -> None:
    uri = str(tmp_path / "ckpt")
    old = net_state(8)
    save_steps(uri, old, [5, 6], keep=2)
    kw: dict[str, Any] = {}
    if how == "argument":
        kw["start_fresh"] = True
    else:
        monkeypatch.setenv("SPOTJOB_START_FRESH", "1")

    new = net_state(16, seed=1)
    with Checkpointer(uri, keep=2, **kw) as ckpt:
        assert ckpt.restore(new) == 0
    # The new run counts from 0 again, through (and past) the old run's step numbers.
    save_steps(uri, new, [1, 2, 5, 6, 7], keep=2, **kw)
    saved_new = {k: v.clone() for k, v in new["model"].state_dict().items()}
    found = folders(uri)
    assert "step-000000005" in found and "step-000000006" in found, "retention deleted a retired checkpoint"
    # Retention counted only the new run's checkpoints: its newest two are kept, the rest removed.
    assert [f for f in found if f not in ("step-000000005", "step-000000006")] == [
        "step-000000006.1",
        "step-000000007",
    ]
    retired = sorted(p.name for p in (tmp_path / "ckpt" / ".spotjob" / "retired").iterdir())
    assert retired == ["step-000000005.json", "step-000000006.json"]

    # A restart with start_fresh still set resumes the new run: the flag never discards progress,
    # and says so (a user who asked for step 0 was resumed from step 7 without a word).
    again = net_state(16, seed=2)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="agent"), Checkpointer(uri, **kw) as ckpt:
        assert ckpt.restore(again) == 7
    assert_same(again["model"].state_dict(), saved_new, "the new run's newest state")
    [said] = [r.getMessage() for r in caplog.records if r.getMessage().startswith("start_fresh")]
    assert "step 7 loads, so the run resumes from it" in said and "use a new URI" in said, said
    # It names what set it: it named SPOTJOB_START_FRESH to a script that passed start_fresh=True.
    by = "start_fresh=True" if how == "argument" else "SPOTJOB_START_FRESH"
    assert said.startswith(f"start_fresh is set ({by}) "), said
    assert how == "environment" or "SPOTJOB_START_FRESH" not in said, said


def test_when_every_checkpoint_is_broken_start_fresh_begins_at_step_0_without_deleting_them(tmp_path: Path) -> None:
    uri = str(tmp_path / "ckpt")
    save_steps(uri, net_state(8), [3], keep=None)
    shard = next((tmp_path / "ckpt" / "step-000000003").glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 1
    shard.write_bytes(bytes(data))
    with Checkpointer(uri) as ckpt, pytest.raises(RestoreRefusedError, match="corrupt"):
        ckpt.restore(net_state(8))
    with Checkpointer(uri, start_fresh=True) as ckpt:
        assert ckpt.restore(net_state(8)) == 0
    assert shard.exists() and folders(uri) == ["step-000000003"]


# -- a checkpoint a newer spotjob wrote --------------------------------------------------------------


NEWER_WRITES = {
    # the next manifest format
    "format": lambda doc: doc.update(format_version=FORMAT_VERSION + 1),
    # a field this spotjob does not know, at the top or in a file's entry (a file's encoding, say)
    "field": lambda doc: doc.update(encryption={"scheme": "x"}),
    "file field": lambda doc: doc["files"][0].update(compression="zstd"),
}
NEWER_SAYS = {
    "format": f"format {FORMAT_VERSION + 1}, newer than this spotjob reads ({FORMAT_VERSION})",
    "field": "fields this spotjob does not know (encryption)",
    "file field": "fields this spotjob does not know (files.0.compression)",
}


def written_by_a_newer_spotjob(folder: Path, how: str = "format") -> None:
    """The manifest of ``folder`` as a newer spotjob would have written it (``NEWER_WRITES``)."""
    manifest = folder / MANIFEST_NAME
    doc = json.loads(manifest.read_text())
    NEWER_WRITES[how](doc)
    manifest.write_text(json.dumps(doc))


@pytest.mark.parametrize("how", sorted(NEWER_WRITES))
def test_a_checkpoint_a_newer_spotjob_wrote_stops_the_restore_and_retention_keeps_it(
    tmp_path: Path, how: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Its manifest is not proven bad, only unreadable here: loading the older checkpoint would go
    back in time past it (and retention would then delete the newest progress); the restore is
    refused, saying to upgrade, and nothing is deleted. A field this spotjob does not know counts
    as a newer spotjob's too: before, it was a broken manifest, skipped and then deleted."""
    uri = str(tmp_path / "ckpt")
    save_steps(uri, net_state(8), [5, 6], keep=None)
    written_by_a_newer_spotjob(tmp_path / "ckpt" / "step-000000006", how)
    state = net_state(8, seed=3)
    untouched = {k: v.clone() for k, v in state["model"].state_dict().items()}
    with Checkpointer(uri, keep=1) as ckpt, pytest.raises(RestoreRefusedError) as refused:
        # An eval loop's poll names the step restore() stops at, not step 5 behind it (which it
        # named before: the loop then restored, was refused, or evaluated nothing new).
        assert ckpt.newest_step() == 6
        ckpt.restore(state)
    message = str(refused.value)
    assert NEWER_SAYS[how] in message
    assert "Upgrade spotjob" in message
    assert [url.rsplit("/", 1)[-1] for url, _ in refused.value.tried] == ["step-000000006"]
    assert_same(state["model"].state_dict(), untouched, "the model after a refused restore")

    # `spotjob ckpt export` stops there as restore does, instead of exporting the older step 5. Run
    # in this process (torch is imported here already; a new Python would import it again).
    out = tmp_path / "export"
    capsys.readouterr()
    code = cli_main(["ckpt", "export", uri, str(out)])
    stderr = capsys.readouterr().err
    assert code == 2, stderr
    assert "step-000000006" in stderr and "newer spotjob" in stderr and "--step" in stderr
    assert not out.exists()

    # A run that saves without restoring (keep=1): the newer spotjob's checkpoint is neither
    # counted nor deleted; the old format's step 5 goes as usual.
    save_steps(uri, net_state(8), [7, 8], keep=1)
    assert folders(uri) == ["step-000000006", "step-000000008"]


# -- modules without state ---------------------------------------------------------------------------


class Tally:
    """A per-rank object beside the modules."""

    def __init__(self, count: int) -> None:
        self.count = count

    def state_dict(self) -> dict[str, Any]:
        return {"count": self.count}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.count = state["count"]


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_module_without_state_saves_and_restores_as_nothing(tmp_path: Path, async_save: bool) -> None:
    """An ``nn.Identity`` holds nothing to save (torch refuses such a module with an error about a
    process group); the rest of the state round-trips."""
    uri = str(tmp_path / "ckpt")
    with Checkpointer(uri, async_save=async_save) as ckpt:
        ckpt.save(3, {"head": nn.Identity(), "tally": Tally(7)})
    tally = Tally(0)
    with Checkpointer(uri) as ckpt:
        assert ckpt.restore({"head": nn.Identity(), "tally": tally}) == 3
    assert tally.count == 7


def test_a_model_with_tensors_is_refused_by_a_checkpoint_that_holds_none(tmp_path: Path) -> None:
    uri = str(tmp_path / "ckpt")
    with Checkpointer(uri, async_save=False) as ckpt:
        ckpt.save(3, {"head": nn.Identity(), "tally": Tally(7)})
    head = nn.Linear(2, 2)
    with Checkpointer(uri) as ckpt, pytest.raises(RestoreRefusedError) as refused:
        ckpt.restore({"head": head, "tally": Tally(0)})
    assert "head.weight: the model has it, the checkpoint does not" in str(refused.value)


def test_a_checkpoint_judged_by_an_attempt_record_a_newer_spotjob_wrote_stops_the_restore_and_is_kept(
    tmp_path: Path,
) -> None:
    """Attempt 0 saved steps 5 and 6; attempt 1's record (which says whether they are fenced) is a
    newer spotjob's. Nothing proves them bad, only this spotjob cannot judge them: the restore of
    attempt 2 passed over both, as if broken, and refused naming start_fresh=True, a remedy that
    abandons progress an upgraded spotjob restores. It stops at step 6 saying to upgrade, as for a
    newer manifest, and a save with keep=1 (retention) leaves both in place."""
    uri = str(tmp_path / "ckpt")
    save_steps(uri, net_state(8), [5, 6], keep=None, job="train", attempt=0)
    storage = open_storage(uri)
    record_attempt(storage, "train", 1, CheckpointRef(6))
    key = attempt_key("train", 1)
    storage.put_bytes(key, json.dumps({**json.loads(storage.get_bytes(key)), "format": 2}).encode())

    state = net_state(8, seed=3)
    untouched = {k: v.clone() for k, v in state["model"].state_dict().items()}
    with (
        Checkpointer(uri, keep=1, job="train", attempt=2, async_save=False) as ckpt,
        pytest.raises(RestoreRefusedError) as refused,
    ):
        assert ckpt.newest_step() == 6  # the step restore() stops at
        ckpt.restore(state)
    message = str(refused.value)
    assert "newer spotjob" in message and "Upgrade spotjob" in message, message
    assert [u.rsplit("/", 1)[-1] for u, _ in refused.value.tried] == ["step-000000006"]
    assert_same(state["model"].state_dict(), untouched, "the model after a refused restore")

    save_steps(uri, net_state(8), [7, 8], keep=1, job="train", attempt=2)
    assert folders(uri) == ["step-000000005", "step-000000006", "step-000000008"]
