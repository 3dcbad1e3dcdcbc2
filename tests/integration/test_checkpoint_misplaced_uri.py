"""A Checkpointer given a checkpoint's own folder, or the folder above its job's URI, as the URI.

Real checkpoints on each store (file, S3 on moto, GCS on fake-gcs-server), saved by a real
Checkpointer in this process under ``<bucket>/run``; then Checkpointers, writers and read-only
ones, on ``run/step-000000002`` (what a log line or ``spotjob ckpt show`` prints, pasted as the
URI), on a copy of a checkpoint folder under another name, and on the bucket's folder above ``run``.
"""

from __future__ import annotations

import pytest
import torch
from test_checkpoint_read_only import store_listing
from torch import nn

from agent import Checkpointer
from agent.checkpoint import CheckpointUriError
from agent.storage import open_storage


def _open_and_restore(uri: str, state: dict[str, nn.Module], *, read_only: bool) -> int:
    with Checkpointer(uri, read_only=read_only, async_save=False) as ckpt:
        return ckpt.restore(state)


def test_a_checkpoints_own_folder_or_the_folder_above_the_jobs_uri_is_refused_and_nothing_is_written(
    storage_uri: str,
) -> None:
    """Each of these restored nothing and started from step 0 without a word; a writer in the
    step folder wrote its owner record and its own checkpoints inside the committed checkpoint,
    which the job's retention later deleted with them, and a read-only one (an eval script) read
    an untrained model. Found walking the Checkpointer as a user; each case returned 0 before.
    Now each is refused on construction (a writer) or at restore (a reader), naming the URI to
    give, and nothing is written under the folder."""
    torch.manual_seed(0)
    state = {"model": nn.Linear(3, 2)}
    job_uri = f"{storage_uri}/run"
    with Checkpointer(job_uri, async_save=False) as ckpt:
        ckpt.save(1, state)
        ckpt.save(2, state)
    storage = open_storage(storage_uri)
    try:
        # A copy of a checkpoint under a name of the user's (latest/): told by what it holds.
        storage.put_bytes("latest/MANIFEST.json", storage.get_bytes("run/step-000000002/MANIFEST.json"))
    finally:
        storage.close()
    before = store_listing(storage_uri)

    storage = open_storage(job_uri)
    job = storage.uri  # as the messages write it (file:///... for a path)
    storage.close()
    cases = [
        (
            f"{job_uri}/step-000000002",
            f"is a checkpoint's own folder (its name is a checkpoint folder's), not the URI "
            f"a job saves to: give the URI its job saves to, {job},",
        ),
        (f"{storage_uri}/latest", "is a checkpoint's own folder (it holds MANIFEST.json), not the URI a job saves to"),
        (
            storage_uri,
            f"holds no checkpoints, but folders in it do: to resume a job, give the URI it saves to, e.g. {job};",
        ),
    ]
    for uri, said in cases:
        for read_only in (False, True):
            with pytest.raises(CheckpointUriError) as refused:
                _open_and_restore(uri, state, read_only=read_only)
            assert said in str(refused.value), (uri, read_only, refused.value)
            assert isinstance(refused.value, ValueError)
        # An eval polling newest_step() waited for ever on 0 where restore() refused the URI.
        with Checkpointer(uri, read_only=True) as reader, pytest.raises(CheckpointUriError) as refused:
            reader.newest_step()
        assert said in str(refused.value), (uri, refused.value)
    assert store_listing(storage_uri) == before

    # The job's own URI, and a new one beside it, are a URI like any other.
    assert _open_and_restore(job_uri, state, read_only=False) == 2
    assert _open_and_restore(f"{storage_uri}/new", state, read_only=False) == 0


def test_a_uri_in_a_jobs_staging_or_records_folder_is_refused_and_nothing_is_written(
    storage_uri: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A job given ``<uri>/.spotjob-staging`` (or a folder in it) as its URI was accepted and
    committed its checkpoints there; the next Checkpointer built on ``<uri>`` removed every
    ``step-*`` folder of its staging folder as an interrupted save's leftover, and the inner job's
    restore() then returned 0 without a word. ``<uri>/.spotjob`` (the job's records) was accepted
    too. Found walking the Checkpointer as a user. Now each is refused by its name on every store,
    by a writer, by a reader's restore, by ``spotjob ckpt adopt`` and by ``spotjob run
    --checkpoint-uri``, naming the folder, the job URI it belongs to and what to give instead."""
    from orchestrator.cli import main
    from orchestrator.run_config import checkpoint_uri_problem

    torch.manual_seed(0)
    state = {"model": nn.Linear(3, 2)}
    job_uri = f"{storage_uri}/run"
    with Checkpointer(job_uri, async_save=False) as ckpt:
        ckpt.save(1, state)
    storage = open_storage(job_uri)
    job = storage.uri  # as the messages write it (file:///... for a path)
    storage.close()
    before = store_listing(storage_uri)
    cases = [
        (f"{job_uri}/.spotjob-staging", f"is the staging folder of the job URI {job}: that job's next Checkpointer"),
        (
            f"{job_uri}/.spotjob-staging/other",
            f"lies in {job}/.spotjob-staging, the staging folder of the job URI {job}:",
        ),
        (f"{job_uri}/.spotjob", f"is the records folder of the job URI {job}:"),
        (f"{job_uri}/.spotjob/pins/x", f"lies in {job}/.spotjob, the records folder of the job URI {job}:"),
    ]
    # A reader of the staging folder with an interrupted save's leftover in it (a committed-looking
    # copy of step 1) said "no committed checkpoint" or restored it: refused by its name too.
    storage = open_storage(job_uri)
    for info in list(storage.list("step-000000001/")):
        storage.put_bytes(f".spotjob-staging/{info.key}", storage.get_bytes(info.key))
    storage.close()
    before = store_listing(storage_uri)
    for uri, said in cases:
        for read_only in (False, True):
            with pytest.raises(CheckpointUriError) as refused:
                _open_and_restore(uri, state, read_only=read_only)
            assert said in str(refused.value), (uri, read_only, refused.value)
            assert f"the URI {job} itself to resume that job, or a new folder beside {job}" in str(refused.value)
        assert main(["ckpt", "adopt", uri, "--job", "other"]) != 0
        out, err = capsys.readouterr()
        # (A folder that is not there on a filesystem is refused as one first.)
        missing = f"{uri}: no such folder" in err
        assert missing or (said in err and "nothing was changed" in err), (uri, out, err)
        problem = checkpoint_uri_problem(uri)  # a path is written as one there, not as file://
        kind = "staging folder" if "staging" in said else "records folder"
        assert problem is not None and f"the {kind} of the job URI" in problem, (uri, problem)
    assert store_listing(storage_uri) == before

    # The job's checkpoint is still there, and its URI is one like any other.
    assert _open_and_restore(job_uri, state, read_only=False) == 1


def test_a_folder_of_the_users_own_named_spotjob_is_no_job_uris_records_folder(storage_uri: str) -> None:
    """The name check refused any URI with a ``.spotjob`` part: ``~/.spotjob/ckpts/run1``, a
    folder of the user's own, was told it lies in "the records folder of the job URI ~", and a job
    that saved there could no longer build a Checkpointer. Found in review. Under ``.spotjob`` only
    spotjob's own entries (``owner.json``, ``attempts``, ``pins``, ``probes``, ``retired``) count."""
    torch.manual_seed(0)
    state = {"model": nn.Linear(3, 2)}
    uri = f"{storage_uri}/home/.spotjob/ckpts/run1"
    with Checkpointer(uri, async_save=False) as ckpt:
        ckpt.save(4, state)
    assert _open_and_restore(uri, state, read_only=True) == 4
