"""``Checkpointer(uri, read_only=True)``: another program (an eval script) restoring a job's checkpoint.

Real checkpoints on each store (file, S3 on moto, GCS on fake-gcs-server), written by a named job
through a real Checkpointer in this process; the reader is a second Checkpointer on the same URI.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

from agent import Checkpointer
from agent.checkpoint import CheckpointOwnershipError
from agent.storage import open_storage

JOB = "ml/train"


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def store_listing(uri: str) -> list[tuple[str, int]]:
    """Every object under ``uri``; on a filesystem every entry, folders (a staging folder) included."""
    storage = open_storage(uri)
    try:
        local = storage.local_path("")
        if local is not None:
            return sorted(
                (os.path.relpath(os.path.join(d, n), local), 0) for d, ds, fs in os.walk(local) for n in ds + fs
            )
        return sorted((o.key, o.size) for o in storage.list(""))
    finally:
        storage.close()


def test_an_eval_script_restores_another_jobs_checkpoint_read_only_and_writes_nothing(storage_uri: str) -> None:
    """Before ``read_only`` an eval script's Checkpointer on a named job's URI was refused
    (``CheckpointOwnershipError``, whose advice, ``spotjob ckpt adopt``, would stop the training
    job), and on S3 every Checkpointer wrote probe objects, so a read-only role could not restore.
    The reader's one write, its pin on the checkpoint it reads (``agent.pins``), is gone once the
    restore ends (on a filesystem its empty ``.spotjob/pins`` folder stays)."""
    trained = _model(0)
    optim = torch.optim.AdamW(trained.parameters())
    trained(torch.randn(2, 8)).sum().backward()
    optim.step()
    with Checkpointer(storage_uri, job=JOB, async_save=False) as ckpt:
        ckpt.save(5, {"model": trained, "optim": optim})
    before = store_listing(storage_uri)

    with pytest.raises(CheckpointOwnershipError, match="read_only=True"):
        Checkpointer(storage_uri)  # the message points an eval script at read_only, not at adopt

    fresh = _model(1)
    with Checkpointer(storage_uri, read_only=True) as reader:
        assert reader.restore({"model": fresh}) == 5  # model only: the optimizer stays out
        with pytest.raises(RuntimeError, match="read-only"):
            reader.save(6, {"model": fresh})
        with pytest.raises(RuntimeError, match="read-only"):
            reader.step(6, {"model": fresh})
    for name, tensor in trained.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], tensor), name
    assert [e for e in store_listing(storage_uri) if e[0] != ".spotjob/pins"] == before


def test_read_only_refuses_start_fresh(tmp_path: object) -> None:
    """start_fresh retires checkpoints, a write: a read-only Checkpointer refuses it up front."""
    with pytest.raises(ValueError, match="read_only=True with start_fresh"):
        Checkpointer(str(tmp_path), read_only=True, start_fresh=True)


def test_a_reader_given_job_reads_that_jobs_checkpoints_not_the_owners(tmp_path: Path) -> None:
    """README: "It reads the checkpoints as the URI owner's (pass job= to name another)". A reader
    with job="other" on a URI job "ml/train" owns, holding a step-5 checkpoint of "other" copied in
    beside the owner's step 2, passed "other"'s over as foreign and restored the owner's step 2
    (another job's model, silently); newest_step() said 2."""
    uri, elsewhere = tmp_path / "ckpt", tmp_path / "other"
    owners, others = _model(0), _model(1)
    with Checkpointer(str(uri), job=JOB, async_save=False) as ckpt:
        ckpt.save(2, {"model": owners})
    with Checkpointer(str(elsewhere), job="other", async_save=False) as ckpt:
        ckpt.save(5, {"model": others})
    shutil.copytree(elsewhere / "step-000000005", uri / "step-000000005")

    for job, step, expected in (("other", 5, others), (None, 2, owners), (JOB, 2, owners)):
        fresh = _model(7)
        with Checkpointer(str(uri), read_only=True, job=job) as reader:
            assert reader.newest_step() == step, job
            assert reader.restore({"model": fresh}) == step, job
        for name, tensor in expected.state_dict().items():
            assert torch.equal(fresh.state_dict()[name], tensor), (job, name)


def _copy_checkpoints(source: str, target: str) -> None:
    """Copy every checkpoint folder under ``source`` into ``target``, not ``.spotjob/`` (its owner
    record): a copy by ``cp -r`` of the step folders, or ``aws s3 sync`` of them."""
    src, dst = open_storage(source), open_storage(target)
    try:
        for info in src.list(""):
            if not info.key.startswith(".spotjob/"):
                dst.put_bytes(info.key, src.get_bytes(info.key))
    finally:
        src.close()
        dst.close()


@pytest.mark.parametrize("scheme", ["file", "s3", "gs"])
def test_a_reader_given_job_on_a_copy_without_an_owner_record_reads_only_that_jobs_checkpoints(
    fresh_uri: Callable[[str], str], scheme: str, caplog: pytest.LogCaptureFixture
) -> None:
    """README: with job= "that job's checkpoints are then the ones it reads", and a read-only
    Checkpointer reads "a copy without taking it over". On a copy without ``.spotjob/`` holding
    job A's steps 2 and 4 and job B's step 5, a reader with job=A restored B's step 5 (another
    job's model, without a word), and one with job="nobody" restored it too: with no owner record
    the reader's job= was never looked at. A's is read now; "nobody" reads nothing and says which
    other jobs' checkpoints it passed over. Without job= a reader reads the newest, as before."""
    a_uri, b_uri, copy = fresh_uri(scheme), fresh_uri(scheme), fresh_uri(scheme)
    a_model, b_model = _model(0), _model(1)
    with Checkpointer(a_uri, job=JOB, async_save=False) as ckpt:
        ckpt.save(2, {"model": _model(2)})
        ckpt.save(4, {"model": a_model})
    with Checkpointer(b_uri, job="ml/other", async_save=False) as ckpt:
        ckpt.save(5, {"model": b_model})
    _copy_checkpoints(a_uri, copy)
    _copy_checkpoints(b_uri, copy)
    before = store_listing(copy)

    for job, step, expected in ((JOB, 4, a_model), (None, 5, b_model), ("ml/nobody", 0, None)):
        fresh = _model(7)
        caplog.clear()  # what the last reader, "nobody", said is looked at below
        with (
            caplog.at_level(logging.WARNING, logger="agent.checkpoint"),
            Checkpointer(copy, read_only=True, job=job) as reader,
        ):
            assert reader.newest_step() == step, job
            assert reader.restore({"model": fresh}) == step, job
        if expected is not None:
            for name, tensor in expected.state_dict().items():
                assert torch.equal(fresh.state_dict()[name], tensor), (job, name)
    said = caplog.text
    assert "no committed checkpoint of job 'ml/nobody'" in said, said
    assert "job 'ml/other' (step-000000005)" in said and f"job '{JOB}' (step-000000004, step-000000002)" in said, said
    assert "has no owner record" in said, said
    assert [e for e in store_listing(copy) if not e[0].startswith(".spotjob")] == [
        e for e in before if not e[0].startswith(".spotjob")
    ]
    # A writer of A is still refused there, naming B (nothing changed for writers).
    with pytest.raises(CheckpointOwnershipError, match="job 'ml/other'"):
        Checkpointer(copy, job=JOB)
