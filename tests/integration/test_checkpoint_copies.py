"""Checkpoints that operators' tools copied, moved or aged: restore, retention and ``spotjob ckpt``
afterwards.

S3 archive classes are moto's own: an object copied onto itself with ``StorageClass="GLACIER"`` (what
a lifecycle transition does) answers ``GetObject`` with 403 ``InvalidObjectState``, as S3 does, and
is still listed, HEADed and deleted. moto does not model a restore from the archive
(``RestoreObject``'s temporary copy), nor Intelligent-Tiering's archive tiers.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from agent.catalog import CheckpointRef, find_checkpoints
from agent.checkpoint import Checkpointer, CheckpointOwnershipError, StorageRefusedError
from agent.ownership import attempt_key, record_attempt
from agent.storage import ArchivedError, open_storage, parse_uri
from orchestrator.cli import main

sys.path.insert(0, str(Path(__file__).resolve().parent / "scripts"))
from ckpt_state import make_state, train


def save_steps(uri: str, steps: list[int], staging: Path, *, keep: int | None = None, job: str | None = None) -> int:
    """Restore, then train and save each of ``steps``; the step restored."""
    state = make_state(0)
    with Checkpointer(uri, keep=keep, async_save=False, staging_dir=str(staging), job=job) as ckpt:
        done = restored = ckpt.restore(state)
        for step in steps:
            train(state, step - done, start=done)
            done = step
            ckpt.save(step, state)
    return restored


def archive(s3_client: Any, uri: str, step: int) -> None:
    """What a lifecycle rule's transition to S3 Glacier Flexible Retrieval does to one checkpoint."""
    _, bucket, prefix = parse_uri(uri)
    folder = f"{prefix}/step-{step:09d}/"
    for obj in s3_client.list_objects_v2(Bucket=bucket, Prefix=folder)["Contents"]:
        source = {"Bucket": bucket, "Key": obj["Key"]}
        s3_client.copy_object(Bucket=bucket, Key=obj["Key"], CopySource=source, StorageClass="GLACIER")


def steps_in(uri: str) -> list[int]:
    storage = open_storage(uri)
    try:
        return sorted(r.step for r in find_checkpoints(storage))
    finally:
        storage.close()


@pytest.fixture
def s3_uri(fresh_uri: Callable[[str], str]) -> str:
    return fresh_uri("s3")


def test_retention_removes_an_old_checkpoint_a_lifecycle_rule_archived(
    s3_uri: str, s3_client: Any, tmp_path: Path
) -> None:
    """A lifecycle rule moved step 1 to Glacier. Retention read its manifest, got 403
    InvalidObjectState, called it "permission denied" and removed nothing at any later save: the
    bucket grew without bound. An archived checkpoint older than the ``keep`` newest valid ones goes
    like any other (it can be listed and deleted, only not read)."""
    save_steps(s3_uri, [1, 2, 3], tmp_path / "staging", keep=None)
    archive(s3_client, s3_uri, 1)
    save_steps(s3_uri, [4], tmp_path / "staging", keep=2)
    assert steps_in(s3_uri) == [3, 4]


def test_ckpt_list_shows_an_archived_checkpoint_as_a_row_and_the_others_as_they_are(
    s3_uri: str, s3_client: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``spotjob ckpt list`` failed whole (exit 2, "permission denied") when one old checkpoint's
    manifest was archived; the other checkpoints could not be seen at all."""
    save_steps(s3_uri, [1, 2], tmp_path / "staging")
    archive(s3_client, s3_uri, 1)
    rc = main(["ckpt", "list", s3_uri])
    out, err = capsys.readouterr()
    assert rc == 0, err
    rows = {line.split()[1]: line for line in out.splitlines()[1:]}
    assert "valid" in rows["step-000000002"] and "invalid" not in rows["step-000000002"]
    assert "archived" in rows["step-000000001"] and "restore-object" in rows["step-000000001"]
    assert "permission denied" not in out


def test_restore_stops_at_an_archived_newest_checkpoint_saying_it_is_archived(
    s3_uri: str, s3_client: Any, tmp_path: Path
) -> None:
    """A job paused past the lifecycle rule's age finds every checkpoint archived. The restore must
    neither go back past the newest nor start from step 0, and must say what happened: it said
    "permission denied ... the AWS credentials lack the permission", which sends the operator to IAM."""
    save_steps(s3_uri, [1, 2], tmp_path / "staging")
    archive(s3_client, s3_uri, 1)
    archive(s3_client, s3_uri, 2)
    with pytest.raises(StorageRefusedError) as caught:
        save_steps(s3_uri, [], tmp_path / "staging")
    message = str(caught.value)
    assert "step-000000002" in message
    assert "archived" in message and "restore-object" in message
    assert "permission denied" not in message
    assert steps_in(s3_uri) == [1, 2]


def test_shards_archived_under_a_readable_manifest_are_listed_valid_and_found_by_verify_deep(
    s3_uri: str, s3_client: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Pins behaviour that already held, documented as a limit in README "Lifecycle rules that
    archive": a rule with ``ObjectSizeGreaterThan`` archives the shards and spares a small manifest.
    ``ckpt list`` (and the controller) read manifests only, so the checkpoint is listed valid;
    ``ckpt verify --deep`` reads the shards and says they are archived, and a restore stops there
    saying so rather than going back past it. moto's copy to GLACIER stands in for the rule."""
    save_steps(s3_uri, [1, 2], tmp_path / "staging")
    _, bucket, prefix = parse_uri(s3_uri)
    for obj in s3_client.list_objects_v2(Bucket=bucket, Prefix=f"{prefix}/step-000000002/")["Contents"]:
        if not obj["Key"].endswith("MANIFEST.json"):
            source = {"Bucket": bucket, "Key": obj["Key"]}
            s3_client.copy_object(Bucket=bucket, Key=obj["Key"], CopySource=source, StorageClass="GLACIER")
    assert main(["ckpt", "list", s3_uri]) == 0
    rows = {line.split()[1]: line for line in capsys.readouterr().out.splitlines()[1:]}
    assert "valid" in rows["step-000000002"] and "invalid" not in rows["step-000000002"]
    assert main(["ckpt", "verify", s3_uri, "--deep"]) != 0
    assert "archived" in capsys.readouterr().err
    with pytest.raises(StorageRefusedError) as caught:
        save_steps(s3_uri, [], tmp_path / "staging")
    assert "step-000000002" in str(caught.value) and "archived" in str(caught.value)


def test_an_archived_object_is_an_archived_error_on_every_read(s3_uri: str, s3_client: Any, tmp_path: Path) -> None:
    """The error a store raises for an archived object is its own kind (permanent, not a
    permission), for the manifest's whole read and a shard's ranged download alike."""
    save_steps(s3_uri, [1], tmp_path / "staging")
    archive(s3_client, s3_uri, 1)
    storage = open_storage(s3_uri)
    try:
        with pytest.raises(ArchivedError):
            storage.get_bytes("step-000000001/MANIFEST.json")
        with pytest.raises(ArchivedError):
            storage.get_file("step-000000001/rank-00000.pt", str(tmp_path / "rank.pt"))
    finally:
        storage.close()


def test_a_checkpoint_copied_into_a_uri_another_job_owns_is_taken_in_by_adopt(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    """``cp -r`` of job A's checkpoint into the URI job B already owns (to go on from it): restore
    passes over it as foreign, rightly, but said nothing of what to do, and ``spotjob ckpt adopt URI
    --job B`` answered "already belongs to job 'B'; nothing changed": no command could take it in.
    Now the skip names the command, and adopt takes in the checkpoints other jobs left there."""
    source, target = tmp_path / "a", tmp_path / "b"
    save_steps(str(source), [1, 2, 3], tmp_path / "staging-a", job="A")
    save_steps(str(target), [1], tmp_path / "staging-b", job="B")
    subprocess.run(["cp", "-r", str(source / "step-000000003"), str(target)], check=True)
    with caplog.at_level(logging.WARNING, logger="agent.checkpoint"):
        assert save_steps(str(target), [], tmp_path / "staging-b", job="B") == 1
    assert f"spotjob ckpt adopt file://{target} --job B" in caplog.text
    assert main(["ckpt", "adopt", str(target), "--job", "B"]) == 0
    out = capsys.readouterr().out
    assert "job 'A' up to step-000000003" in out, out
    assert save_steps(str(target), [4], tmp_path / "staging-b", job="B") == 3


def test_a_checkpoint_copied_in_after_an_earlier_adopt_is_named_a_copy_with_the_command_that_takes_it_in(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    """Job A's step 1 copied into a folder, ``spotjob ckpt adopt --job B``, then A's step 3 copied in
    too: restore's warning and ``spotjob ckpt list`` said step 3 was "written by job 'A' after job
    'B' adopted" it, and named no command, though its manifest was created before the adoption (a
    copy, not a stray writer) and a second ``adopt`` takes it in. Now both say it is a copy and name
    the command, as they do without an earlier adopt."""
    source, target = tmp_path / "a", tmp_path / "b"
    save_steps(str(source), [1, 2, 3], tmp_path / "staging-a", job="A")
    target.mkdir()
    subprocess.run(["cp", "-r", str(source / "step-000000001"), str(target)], check=True)
    assert main(["ckpt", "adopt", str(target), "--job", "B"]) == 0
    subprocess.run(["cp", "-r", str(source / "step-000000003"), str(target)], check=True)
    command = f"spotjob ckpt adopt file://{target} --job B"
    with caplog.at_level(logging.WARNING, logger="agent.checkpoint"):
        assert save_steps(str(target), [], tmp_path / "staging-b", job="B") == 1
    said = "\n".join(r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING)
    assert command in said and "after job 'B' adopted" not in said, said
    capsys.readouterr()
    main(["ckpt", "list", str(target)])
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if "step-000000003" in line)
    assert "FOREIGN" in row and command in row and "after job 'B' adopted" not in row, out
    assert main(["ckpt", "adopt", str(target), "--job", "B"]) == 0
    assert save_steps(str(target), [4], tmp_path / "staging-b", job="B") == 3


def test_a_checkpoint_copied_without_its_owner_record_is_refused_naming_the_copy_and_adopt(tmp_path: Path) -> None:
    """``rsync -r`` of a step folder (not ``.spotjob/``) to a fresh folder for another job: refused,
    rightly, but the error said the checkpoints were "written before spotjob recorded owners", which
    a copy never was; it now names the copy, and ``adopt`` still makes the URI the new job's."""
    source, target = tmp_path / "a", tmp_path / "b"
    save_steps(str(source), [1, 2], tmp_path / "staging-a", job="A")
    target.mkdir()
    # rsync is not on every machine this runs on; GNU cp -r copies the same way (no times, no owner).
    subprocess.run(["cp", "-r", str(source / "step-000000002"), str(target)], check=True)
    with pytest.raises(CheckpointOwnershipError) as caught:
        save_steps(str(target), [], tmp_path / "staging-b", job="B")
    assert "copied here without its .spotjob folder" in str(caught.value)
    assert f"spotjob ckpt adopt file://{target} --job B" in str(caught.value)
    assert main(["ckpt", "adopt", str(target), "--job", "B"]) == 0
    assert save_steps(str(target), [], tmp_path / "staging-b", job="B") == 2


@pytest.fixture
def undeletable() -> Iterator[Callable[[Path], None]]:
    """``undeletable(path)``: make a file nobody may delete (``chattr +i``), undone when the test ends.

    Stands in for a checkpoint an administrator copied into the job's folder as root, which the
    job's own user may not delete: these tests run as root, whom file modes do not stop. What it does
    not model: the ``EACCES`` a real non-root user gets (the immutable flag answers ``EPERM``; spotjob
    reads both as "permission denied")."""
    made: list[Path] = []

    def make(path: Path) -> None:
        if subprocess.run(["chattr", "+i", str(path)], capture_output=True).returncode != 0:
            pytest.skip("this filesystem (or user) cannot mark a file immutable")
        made.append(path)

    yield make
    for path in made:
        subprocess.run(["chattr", "-i", str(path)], check=True)


def test_retention_goes_on_past_a_folder_it_may_not_delete(
    tmp_path: Path, undeletable: Callable[[Path], None], caplog: pytest.LogCaptureFixture
) -> None:
    """One old checkpoint retention may not delete (copied in by root, held by the bucket) stopped
    the whole pass at it, newest first: every checkpoint older than it stayed for good, at every save.
    The folders it can delete now go, the one it cannot stays, and the refusal is still said."""
    root = tmp_path / "ckpt"
    save_steps(str(root), [1, 2, 3, 4, 5], tmp_path / "staging")
    undeletable(root / "step-000000002" / "MANIFEST.json")
    with caplog.at_level(logging.WARNING, logger="agent.checkpoint"):
        save_steps(str(root), [6], tmp_path / "staging", keep=2)
    assert steps_in(str(root)) == [2, 5, 6]
    assert "permission denied" in caplog.text and "step-000000002" in caplog.text


def copy_tree(request: pytest.FixtureRequest, source: str, target: str, *, skip: str = "") -> None:
    """Copy every object under ``source`` to ``target`` as an operator's tool does, server-side on
    the object stores (S3 CopyObject, which gives a new ETag and carries no checksum here; GCS's
    rewrite), ``cp -r`` on a filesystem; leave out the keys ending in ``skip``."""
    scheme, bucket, prefix = parse_uri(source)
    _, target_bucket, target_prefix = parse_uri(target)
    if scheme == "file":
        subprocess.run(["cp", "-r", prefix, target_prefix], check=True)
        if skip:
            for path in Path(target_prefix).rglob(f"*{skip}"):
                path.unlink()
    elif scheme == "s3":
        client = request.getfixturevalue("s3_client")
        for obj in client.list_objects_v2(Bucket=bucket, Prefix=prefix + "/")["Contents"]:
            if not (skip and obj["Key"].endswith(skip)):
                new_key = target_prefix + obj["Key"][len(prefix) :]
                client.copy_object(Bucket=target_bucket, Key=new_key, CopySource={"Bucket": bucket, "Key": obj["Key"]})
    else:
        client = request.getfixturevalue("gcs_client")
        source_bucket, dest = client.bucket(bucket), client.bucket(target_bucket)
        for blob in client.list_blobs(bucket, prefix=prefix + "/"):
            if not (skip and blob.name.endswith(skip)):
                dest.blob(target_prefix + blob.name[len(prefix) :]).rewrite(source_bucket.blob(blob.name))


@pytest.mark.parametrize("scheme", ["file", "s3", "gs"])
def test_a_copy_to_another_bucket_and_prefix_restores_and_a_partial_one_falls_back(
    request: pytest.FixtureRequest, fresh_uri: Callable[[str], str], scheme: str, tmp_path: Path
) -> None:
    """(Pins behaviour that already worked.) A manifest names its files relative to its folder, and
    spotjob checks the bytes against its own CRC32C, never a checksum or ETag the store kept: a copy
    of the whole URI to another bucket and prefix restores its newest checkpoint under the same job.
    A copy missing one shard of the newest (MANIFEST.json arrived, a shard did not: ``aws s3 sync``
    sends names in order, and ``MANIFEST.json`` sorts before ``__0_0.distcp``) is passed over for the
    one before it, never loaded."""
    source = fresh_uri(scheme)
    save_steps(source, [1, 2, 3], tmp_path / "staging", job="A")
    whole, partial = fresh_uri(scheme), fresh_uri(scheme)
    if scheme == "file":
        whole, partial = whole + "/moved", partial + "/moved"
    copy_tree(request, source, whole)
    copy_tree(request, source, partial, skip="step-000000003/__0_0.distcp")
    assert save_steps(whole, [], tmp_path / "staging", job="A") == 3
    assert save_steps(partial, [], tmp_path / "staging", job="A") == 2


def test_an_archived_owner_record_stops_the_job_saying_it_is_archived(
    s3_uri: str, s3_client: Any, tmp_path: Path
) -> None:
    """``.spotjob/owner.json`` is the oldest object under the URI, so the first one a lifecycle rule
    archives; every start and every commit reads it. The job must stop saying so, not
    "permission denied" (what it said), which sends the operator to IAM."""
    save_steps(s3_uri, [1], tmp_path / "staging")
    _, bucket, prefix = parse_uri(s3_uri)
    key = f"{prefix}/.spotjob/owner.json"
    s3_client.copy_object(Bucket=bucket, Key=key, CopySource={"Bucket": bucket, "Key": key}, StorageClass="GLACIER")
    with pytest.raises(StorageRefusedError, match="the object is archived") as caught:
        save_steps(s3_uri, [2], tmp_path / "staging")
    assert "permission denied" not in str(caught.value)
    assert steps_in(s3_uri) == [1]


def attempt_0_saved_steps_1_and_2(uri: str, staging: str) -> dict[str, Any]:
    """Attempt 0 of job J saves steps 1 and 2, then attempt 1 is recorded resuming from step 2 (its
    record judges attempt 0's checkpoints); the state as trained to step 2."""
    state = make_state(0)
    storage = open_storage(uri)
    try:
        record_attempt(storage, "J", 0, None)
        with Checkpointer(uri, job="J", attempt=0, keep=None, async_save=False, staging_dir=staging) as ckpt:
            for step in (1, 2):
                train(state, 1, start=step - 1)
                ckpt.save(step, state)
        record_attempt(storage, "J", 1, CheckpointRef(2))
    finally:
        storage.close()
    return state


def test_ckpt_list_and_retention_see_past_an_archived_attempt_record(
    s3_uri: str, s3_client: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Judging a checkpoint of attempt 0 reads attempt 1's record, written when attempt 1 started and
    never again: a lifecycle rule archives it while attempt 1 still runs. ``spotjob ckpt list`` then
    failed whole and retention gave up every pass; now attempt 0's checkpoints cannot be judged (said
    so, never restored) and the newest, attempt 1's own, still restores."""
    staging = str(tmp_path / "staging")
    state = attempt_0_saved_steps_1_and_2(s3_uri, staging)
    with Checkpointer(s3_uri, job="J", attempt=1, keep=None, async_save=False, staging_dir=staging) as ckpt:
        train(state, 1, start=ckpt.restore(state))
        ckpt.save(3, state)
    _, bucket, prefix = parse_uri(s3_uri)
    key = f"{prefix}/{attempt_key('J', 1)}"
    s3_client.copy_object(Bucket=bucket, Key=key, CopySource={"Bucket": bucket, "Key": key}, StorageClass="GLACIER")
    rc = main(["ckpt", "list", s3_uri])
    out, err = capsys.readouterr()
    assert rc == 0, err
    rows = {line.split()[1]: line for line in out.splitlines()[1:]}
    assert "cannot tell whether it is fenced" in rows["step-000000001"] and "archived" in rows["step-000000001"]
    assert "invalid" not in rows["step-000000003"].lower()
    with Checkpointer(s3_uri, job="J", attempt=1, keep=1, async_save=False, staging_dir=staging) as ckpt:
        assert ckpt.restore(state) == 3
        train(state, 1, start=3)
        ckpt.save(4, state)
    assert steps_in(s3_uri) == [4]


def test_verify_of_a_checkpoint_it_cannot_judge_for_an_archived_object_exits_2_saying_to_restore_it(
    s3_uri: str, s3_client: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Step 2, attempt 0's, is judged by attempt 1's record, which a lifecycle rule archived. Nothing
    is proven about step 2, yet ``verify --json`` printed nothing (the ``ArchivedError`` of the sweep
    ``list`` sees past) where ``list`` showed a row, and that row said INVALID. Now all three say the
    same: undecided, exit 2 for ``verify``, naming the restore; an archived manifest likewise."""
    attempt_0_saved_steps_1_and_2(s3_uri, str(tmp_path / "staging"))
    assert main(["ckpt", "verify", s3_uri]) == 0
    capsys.readouterr()
    _, bucket, prefix = parse_uri(s3_uri)
    key = f"{prefix}/{attempt_key('J', 1)}"
    s3_client.copy_object(Bucket=bucket, Key=key, CopySource={"Bucket": bucket, "Key": key}, StorageClass="GLACIER")

    rc = main(["ckpt", "verify", s3_uri])
    out, err = capsys.readouterr()
    assert rc == 2 and out == "", out
    assert "step-000000002 cannot be checked here" in err and "archived" in err and "restore-object" in err, err
    assert "verify it again" in err.lower() and "INVALID" not in err
    assert main(["ckpt", "verify", s3_uri, "--json"]) == 2
    verified = json.loads(capsys.readouterr().out)
    assert (verified["folder"], verified["valid"], verified["undecided"]) == ("step-000000002", False, True)
    assert main(["ckpt", "list", s3_uri, "--json"]) == 0
    listed = {r["folder"]: r for r in json.loads(capsys.readouterr().out)}
    assert (listed["step-000000002"]["undecided"], listed["step-000000002"]["reason"]) == (True, verified["reason"])
    assert main(["ckpt", "list", s3_uri]) == 0
    rows = {line.split()[1]: line for line in capsys.readouterr().out.splitlines()[1:]}
    assert "UNDECIDED — " in rows["step-000000002"] and "INVALID" not in rows["step-000000002"]

    archive(s3_client, s3_uri, 1)  # and step 1's manifest with it
    rc = main(["ckpt", "verify", s3_uri, "--step", "1", "--json"])
    verified = json.loads(capsys.readouterr().out)
    assert rc == 2 and verified["undecided"] is True and "restore-object" in verified["reason"]
    assert main(["ckpt", "verify", s3_uri, "--step", "1"]) == 2
    assert "step-000000001 cannot be checked here" in capsys.readouterr().err


def test_a_uri_holding_only_another_jobs_checkpoint_is_walked_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A URI job B owns, holding only a checkpoint copied from job A: the restore passes over it as
    foreign and starts from step 0. It listed the URI again three times (a committed folder had
    appeared, it took it, as a commit racing the walk would), and said the skip four times."""
    source, target = tmp_path / "a", tmp_path / "b"
    save_steps(str(source), [1, 2, 3], tmp_path / "staging-a", job="A")
    assert save_steps(str(target), [], tmp_path / "staging-b", job="B") == 0  # B owns the URI, no checkpoint
    subprocess.run(["cp", "-r", str(source / "step-000000003"), str(target)], check=True)
    with caplog.at_level(logging.WARNING, logger="agent.checkpoint"):
        assert save_steps(str(target), [], tmp_path / "staging-b", job="B") == 0
    skips = [r for r in caplog.records if "skipping" in r.getMessage() and "step-000000003" in r.getMessage()]
    assert len(skips) == 1, [r.getMessage()[:120] for r in skips]
