"""Checkpoints an older spotjob wrote, read by this one (README "Upgrading").

A spotjob from before 2026-12-01 (6adcd45, checked by writing one with it) wrote the same
checkpoint as today's but for two things: its manifests have no ``attempt`` and the URI has no
ownership record (``.spotjob/``). The tests write a checkpoint with today's ``Checkpointer`` and
take those two away, rather than commit an old one's bytes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from torch import nn

from agent import Checkpointer
from agent.catalog import CheckpointRef
from agent.checkpoint.errors import CheckpointOwnershipError, RestoreRefusedError
from agent.crc32c import crc32c_bytes, to_hex
from agent.manifest import FORMAT_VERSION, MANIFEST_NAME
from agent.ownership import record_attempt
from agent.storage import open_storage
from agent.version import spotjob_version
from orchestrator.cli import main


def _state() -> tuple[nn.Module, dict[str, object]]:
    torch.manual_seed(0)
    model = nn.Linear(8, 4)
    optim = torch.optim.Adam(model.parameters(), lr=0.1)
    return model, {"model": model, "optim": optim}


def older_spotjobs_checkpoints(root: Path, job: str) -> dict[str, torch.Tensor]:
    """Steps 1 and 2 of ``job`` as a spotjob from before 2026-12-01 left them; the weights at 2."""
    model, state = _state()
    with Checkpointer(str(root), job=job, keep=None, async_save=False) as ckpt:
        for step in (1, 2):
            model(torch.randn(2, 8)).sum().backward()
            state["optim"].step()  # type: ignore[attr-defined]
            ckpt.save(step, state)
    for manifest in root.glob(f"step-*/{MANIFEST_NAME}"):
        doc = json.loads(manifest.read_text())
        assert "attempt" in doc  # what the older spotjob did not write
        del doc["attempt"]
        manifest.write_text(json.dumps(doc, indent=2))
    shutil.rmtree(root / ".spotjob")
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_an_older_spotjobs_checkpoint_restores_under_its_job_and_the_ckpt_commands_read_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "ckpt"
    weights = older_spotjobs_checkpoints(root, "ml/train")

    assert main(["ckpt", "list", str(root)]) == 0
    listing = capsys.readouterr().out
    assert listing.count("valid") == 2, listing
    assert main(["ckpt", "verify", str(root), "--deep"]) == 0
    assert main(["ckpt", "export", str(root), str(tmp_path / "out")]) == 0

    model, state = _state()
    with Checkpointer(str(root), job="ml/train", async_save=False) as ckpt:
        assert ckpt.restore(state) == 2
    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())


def test_an_older_spotjobs_checkpoint_under_another_job_name_is_refused_naming_adopt(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    older_spotjobs_checkpoints(root, "killed0")  # a local run of then: its job had no namespace

    _, state = _state()
    with (
        pytest.raises(CheckpointOwnershipError, match="spotjob ckpt adopt"),
        Checkpointer(str(root), job="local/new", async_save=False) as ckpt,
    ):
        ckpt.restore(state)
    assert main(["ckpt", "adopt", str(root), "--job", "local/new"]) == 0
    _, state = _state()
    with Checkpointer(str(root), job="local/new", async_save=False) as ckpt:
        assert ckpt.restore(state) == 2


@pytest.mark.parametrize(
    "newer",
    [{"format": 2}, {"leases": [{"holder": "ml/train"}]}],
    ids=["a-newer-format", "a-field-this-spotjob-does-not-know"],
)
def test_an_owner_record_a_newer_spotjob_wrote_is_neither_restored_past_nor_overwritten_by_adopt(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], newer: dict[str, object]
) -> None:
    """This spotjob reading the ``.spotjob/owner.json`` of a newer one: ``ckpt adopt`` would rewrite it
    in this spotjob's format, dropping what the newer one keeps there, so it is refused, and every
    message says to upgrade spotjob rather than to adopt. The newer record is made by editing today's."""
    root = tmp_path / "ckpt"
    older_spotjobs_checkpoints(root, "ml/train")
    assert main(["ckpt", "adopt", str(root), "--job", "ml/train"]) == 0
    capsys.readouterr()
    owner = root / ".spotjob" / "owner.json"
    owner.write_text(json.dumps({**json.loads(owner.read_text()), **newer}))
    written = owner.read_bytes()

    assert main(["ckpt", "adopt", str(root), "--job", "ml/train"]) != 0
    err = capsys.readouterr().err
    assert "newer spotjob" in err and "upgrade spotjob" in err, err
    assert owner.read_bytes() == written

    assert main(["ckpt", "list", str(root)]) == 0
    listing = capsys.readouterr().out
    assert "newer spotjob" in listing and "makes JOB the owner" not in listing, listing

    _, state = _state()
    with (
        pytest.raises(CheckpointOwnershipError, match="newer spotjob") as refused,
        Checkpointer(str(root), job="ml/train", async_save=False) as ckpt,
    ):
        ckpt.restore(state)
    assert "makes JOB the owner" not in str(refused.value) and "read_only" not in str(refused.value)
    assert owner.read_bytes() == written


def test_a_readers_restore_beside_a_newer_owner_record_passes_over_what_the_attempt_records_prove_fenced(
    tmp_path: Path,
) -> None:
    """A reader naming its job (``read_only=True, job=...``) does not read the owner record up front:
    its restore walk judges each checkpoint. Attempt 0 saved steps 1 and 2, and attempt 1 was recorded
    resuming from step 1: step 2 is fenced whoever owns the URI, so beside a newer spotjob's owner
    record the walk passes over it, as over any fenced checkpoint, and stops at step 1 saying to
    upgrade; ``newest_step()`` names the step the restore stops at. It stopped at step 2."""
    root = tmp_path / "ckpt"
    model, state = _state()
    with Checkpointer(str(root), job="ml/train", attempt=0, keep=None, async_save=False) as ckpt:
        for step in (1, 2):
            model(torch.randn(2, 8)).sum().backward()
            state["optim"].step()  # type: ignore[attr-defined]
            ckpt.save(step, state)
    storage = open_storage(str(root))
    try:
        record_attempt(storage, "ml/train", 1, CheckpointRef(1))
    finally:
        storage.close()
    owner = root / ".spotjob" / "owner.json"
    owner.write_text(json.dumps({**json.loads(owner.read_text()), "format": 2}))

    _, state = _state()
    with Checkpointer(str(root), job="ml/train", read_only=True, async_save=False) as reader:
        assert reader.newest_step() == 1
        with pytest.raises(RestoreRefusedError, match="Upgrade spotjob") as refused:
            reader.restore(state)
    assert [folder.rsplit("/", 1)[-1] for folder, _ in refused.value.tried] == ["step-000000001"]


@pytest.mark.parametrize("where", ["top", "rng"])
def test_a_per_rank_state_file_holding_what_this_spotjob_does_not_restore_refuses_naming_upgrade(
    tmp_path: Path, where: str
) -> None:
    """A newer spotjob that keeps more in ``rank-NNNNN.pt`` (a data loader's position, another device's
    RNG stream) without a new manifest format: this spotjob would restore all but that, silently.
    The newer file is today's with one entry added (its manifest's size and CRC32C rewritten)."""
    root = tmp_path / "ckpt"
    older_spotjobs_checkpoints(root, "ml/train")
    for folder in root.glob("step-*"):
        rank_file = folder / "rank-00000.pt"
        payload = torch.load(rank_file, weights_only=True)
        if where == "top":
            payload["loader"] = {"epoch": 3, "offset": 1200}
        else:
            payload["rng"]["xla"] = torch.zeros(4, dtype=torch.uint8)
        torch.save(payload, rank_file)
        data = rank_file.read_bytes()
        manifest = folder / MANIFEST_NAME
        doc = json.loads(manifest.read_text())
        entry = next(f for f in doc["files"] if f["path"] == "rank-00000.pt")
        entry.update(size=len(data), crc32c=to_hex(crc32c_bytes(data)))
        manifest.write_text(json.dumps(doc))

    model, state = _state()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with (
        pytest.raises(RestoreRefusedError, match="newer spotjob") as refused,
        Checkpointer(str(root), job="ml/train", async_save=False) as ckpt,
    ):
        ckpt.restore(state)
    assert ("loader" if where == "top" else "rng.xla") in str(refused.value)
    assert "Upgrade spotjob" in str(refused.value)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_a_checkpoint_whose_dcp_metadata_a_newer_torch_wrote_stops_the_restore_instead_of_going_back(
    tmp_path: Path,
) -> None:
    """A training image rolled back to an older torch: DCP's ``.metadata`` of the newest checkpoint
    names a dtype that torch does not have. It was skipped as a crafted one and the restore went back
    to the step before. The newer torch's file is today's with its float32 renamed to a dtype no
    torch has, its manifest saying a torch newer than any."""
    root = tmp_path / "ckpt"
    older_spotjobs_checkpoints(root, "ml/train")
    folder = root / "step-000000002"
    data = (folder / ".metadata").read_bytes()
    newer = data.replace(b"\x8c\x07float32", b"\x8c\x0bfloat8_e9m9", 1)
    assert newer != data
    (folder / ".metadata").write_bytes(newer)
    manifest = folder / MANIFEST_NAME
    doc = json.loads(manifest.read_text())
    entry = next(f for f in doc["files"] if f["path"] == ".metadata")
    entry.update(size=len(newer), crc32c=to_hex(crc32c_bytes(newer)))
    doc["torch_version"] = "99.0.0"
    manifest.write_text(json.dumps(doc))

    model, state = _state()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with (
        pytest.raises(RestoreRefusedError, match=r"torch 99\.0\.0") as refused,
        Checkpointer(str(root), job="ml/train", async_save=False) as ckpt,
    ):
        ckpt.restore(state)
    assert "float8_e9m9" in str(refused.value) and torch.__version__ in str(refused.value)
    assert "Restore it under the torch that wrote it" in str(refused.value)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())

    doc["torch_version"] = torch.__version__  # the same torch: a crafted file, skipped as before
    manifest.write_text(json.dumps(doc))
    with Checkpointer(str(root), job="ml/train", async_save=False) as ckpt:
        assert ckpt.restore(state) == 1


def test_a_manifest_a_newer_spotjob_wrote_is_refused_naming_this_spotjobs_version_and_format(tmp_path: Path) -> None:
    """The manifest does not record the spotjob that wrote it (a field would make every older reader
    refuse it): the refusal names the format it is in, and this spotjob's version and format."""
    root = tmp_path / "ckpt"
    older_spotjobs_checkpoints(root, "ml/train")
    manifest = root / "step-000000002" / MANIFEST_NAME
    manifest.write_text(json.dumps({**json.loads(manifest.read_text()), "format_version": FORMAT_VERSION + 1}))

    _, state = _state()
    with (
        pytest.raises(RestoreRefusedError, match="newer spotjob") as refused,
        Checkpointer(str(root), job="ml/train", async_save=False) as ckpt,
    ):
        ckpt.restore(state)
    message = str(refused.value)
    assert f"format {FORMAT_VERSION + 1}" in message and f"({FORMAT_VERSION})" in message
    assert f"spotjob {spotjob_version()}" in message, message


def test_a_save_in_flight_of_a_spotjob_from_before_claims_is_saved_beside_not_cleared_and_reused(
    tmp_path: Path,
) -> None:
    """A spotjob from before 2026-12-05 claims no folder (no ``WRITER.json``). Still running on the
    URI while the upgraded job saves (an old node training on after its job was restarted elsewhere
    with the new image), its save of step 2 in flight is an unclaimed folder without a manifest.
    Found walking an upgrade from 2026-12-04: this spotjob took it for a dead save's leftover,
    cleared it and committed step 2 into it; the older writer went on writing its files there, over
    the committed ones (``ckpt verify`` then found step 2 INVALID: a committed checkpoint lost), and
    its own commit failed. Now the save goes beside it, to ``step-N.1``, which nothing else writes."""
    root = tmp_path / "ckpt"
    model, state = _state()
    with Checkpointer(str(root), job="train", keep=None, async_save=False) as ckpt:
        ckpt.save(1, state)
        # The older writer's save of step 2, in flight: some of its files, no claim, no manifest.
        older = root / "step-000000002"
        older.mkdir()
        (older / "__0_0.distcp").write_bytes(b"older writer's shard")
        model(torch.randn(2, 8)).sum().backward()
        state["optim"].step()  # type: ignore[attr-defined]
        ckpt.save(2, state)
    assert (root / "step-000000002.1" / MANIFEST_NAME).exists()
    # The older writer goes on: its next files land in its own folder (made again if removed).
    older.mkdir(exist_ok=True)
    for name in ("__0_0.distcp", "__1_0.distcp", "rank-00000.pt"):
        (older / name).write_bytes(b"older writer's file " + name.encode())
    assert main(["ckpt", "verify", str(root), "--deep", "--step", "2"]) == 0
