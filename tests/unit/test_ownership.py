"""Ownership and fencing (agent.ownership), on a real folder store: who may write under a URI, and
which checkpoints a stale attempt's worker can never make count."""

from __future__ import annotations

import json
import re
import threading
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from agent.catalog import CheckpointRef, find_checkpoints, inspect, latest_valid, list_checkpoints
from agent.crc32c import crc32c_bytes, to_hex
from agent.manifest import MANIFEST_NAME, FileEntry, Manifest, now_utc, rank_file_name
from agent.ownership import (
    OWNER_KEY,
    AttemptRecord,
    FencedError,
    Lineage,
    OwnershipError,
    adopt,
    attempt_key,
    attempt_records,
    check_not_fenced,
    claim,
    is_fenced,
    job_key,
    newest_attempt,
    read_owner,
    record_attempt,
)
from agent.storage.file import FileStorage

T0 = datetime(2025, 1, 1, tzinfo=UTC)


def commit(
    storage: FileStorage,
    step: int,
    *,
    job: str | None = "a",
    attempt: int | None = None,
    suffix: int = 0,
    created_at: datetime = T0,
) -> CheckpointRef:
    """A minimal valid checkpoint (one rank, its per-rank file), manifest last and create-only."""
    ref = CheckpointRef(step, suffix)
    data = f"state of step {step}".encode()
    storage.put_bytes(ref.key(rank_file_name(0)), data)
    manifest = Manifest(
        step=step,
        world_size=1,
        created_at=created_at,
        torch_version="test",
        job=job,
        attempt=attempt,
        state_keys=["model"],
        files=[FileEntry(path=rank_file_name(0), size=len(data), crc32c=to_hex(crc32c_bytes(data)))],
    )
    storage.put_bytes_if_absent(ref.key(MANIFEST_NAME), manifest.to_json())
    return ref


@pytest.fixture
def storage(tmp_path: Any) -> FileStorage:
    return FileStorage(str(tmp_path / "ckpt"))


def record(attempt: int, fence: CheckpointRef | None) -> AttemptRecord:
    return AttemptRecord(attempt=attempt, job="a", fence=fence, recorded_at=T0)


# -- the fencing rule ---------------------------------------------------------------------------


def test_the_fencing_rule_judges_by_the_smallest_newer_attempt_and_its_fence() -> None:
    s = CheckpointRef
    records = [record(0, None), record(1, s(40)), record(3, s(90))]
    # Attempt 0 resumed nothing; attempt 1 resumed from step 40: attempt 0's work past 40 is stale.
    assert not is_fenced(s(40), 0, records)
    assert not is_fenced(s(30), 0, records)
    assert is_fenced(s(41), 0, records)
    assert is_fenced(s(40, 1), 0, records), "a later folder of the same step is newer than the fence"
    # Attempt 1's and 2's judge is attempt 3 (fence 90), not attempt 1's fence.
    assert not is_fenced(s(80), 1, records)
    assert not is_fenced(s(90), 2, records)
    assert is_fenced(s(95), 2, records)
    # The newest attempt, and writers no controller numbered, are never fenced.
    assert not is_fenced(s(500), 3, records)
    assert not is_fenced(s(500), None, records)
    assert not is_fenced(s(500), 7, records)


def test_a_null_fence_fences_everything_older_attempts_wrote() -> None:
    records = [record(2, None)]
    assert is_fenced(CheckpointRef(1), 1, records)
    assert is_fenced(CheckpointRef(0), 0, records)


# -- ownership ------------------------------------------------------------------------------------


def test_the_first_writer_claims_the_uri_create_only_and_claims_again_idempotently(storage: FileStorage) -> None:
    owner = claim(storage, "a")
    assert owner.job == "a"
    doc = json.loads(storage.get_bytes(OWNER_KEY))
    assert doc["format"] == 1 and doc["job"] == "a" and doc["adopted"] == [] and doc["created_at"]
    assert claim(storage, "a") == owner
    assert read_owner(storage) == owner


def test_a_second_job_is_refused_with_the_owner_and_both_remedies_named(storage: FileStorage) -> None:
    claim(storage, "a")
    with pytest.raises(OwnershipError) as e:
        claim(storage, "b")
    message = str(e.value)
    assert "job 'a'" in message and "job 'b'" in message
    assert f"spotjob ckpt adopt {storage.uri} --job b" in message
    assert "fresh checkpoint URI" in message
    assert e.value.owner == "a"


def test_the_adopt_command_in_a_refusal_is_quoted_for_the_shell(storage: FileStorage) -> None:
    """A job name with a space was printed as ``--job Bad Name``: pasted, adopt read ``Name`` as
    a stray argument."""
    claim(storage, "a")
    with pytest.raises(OwnershipError) as e:
        claim(storage, "Bad Name")
    assert f"spotjob ckpt adopt {storage.uri} --job 'Bad Name'`" in str(e.value)


def test_an_unnamed_job_is_an_owner_of_its_own(storage: FileStorage) -> None:
    claim(storage, None)
    assert json.loads(storage.get_bytes(OWNER_KEY))["job"] is None
    with pytest.raises(OwnershipError, match="an unnamed job"):
        claim(storage, "a")
    claim(storage, None)
    other = FileStorage(storage.root + "-2")
    claim(other, "a")
    with pytest.raises(OwnershipError, match="--unnamed"):
        claim(other, None)


def test_of_two_racing_claimers_exactly_one_owns_the_uri(storage: FileStorage) -> None:
    results: dict[str, object] = {}
    barrier = threading.Barrier(8)

    def run(job: str) -> None:
        barrier.wait()
        try:
            results[job] = claim(storage, job).job
        except OwnershipError as e:
            results[job] = e

    threads = [threading.Thread(target=run, args=(f"job{i}",)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    winners = [job for job, r in results.items() if r == job]
    assert len(winners) == 1
    assert read_owner(storage).job == winners[0]  # type: ignore[union-attr]


def test_an_unclaimed_uri_holding_another_jobs_checkpoints_is_refused(storage: FileStorage) -> None:
    commit(storage, 10, job="old")
    with pytest.raises(OwnershipError, match=r"job 'old'.*before spotjob recorded owners"):
        claim(storage, "new")
    assert read_owner(storage) is None
    assert claim(storage, "old").job == "old"


def test_another_jobs_checkpoints_are_foreign_never_valid(storage: FileStorage) -> None:
    claim(storage, "a")
    mine = commit(storage, 10, job="a")
    theirs = commit(storage, 20, job="b")
    status = inspect(storage, theirs)
    assert not status.valid and status.foreign and not status.fenced
    assert "foreign" in status.reason and "job 'b'" in status.reason and "job 'a'" in status.reason
    latest = latest_valid(storage)
    assert latest is not None and latest.ref == mine


def test_a_reader_as_a_job_on_a_uri_without_an_owner_record_passes_over_other_jobs_checkpoints(
    storage: FileStorage,
) -> None:
    """A read-only Checkpointer given job= judges as that job's (``Lineage.reading_as``); with no
    owner record (a copy without ``.spotjob/``) every job's checkpoints were accepted, so it read
    another job's newest. A manifest naming no job (an unnamed job's, or an old spotjob's) is not
    that job's either, as a claim takes it; a reader without job= still reads them all."""
    mine = commit(storage, 10, job="a")
    theirs = commit(storage, 20, job="b")
    nameless = commit(storage, 30, job=None)
    reading_a = Lineage.load(storage, reading_as="a")
    assert inspect(storage, mine, lineage=reading_a).valid
    for ref, whose in ((theirs, "job 'b'"), (nameless, "an unnamed job")):
        status = inspect(storage, ref, lineage=reading_a)
        assert status.foreign and not status.valid, ref
        assert f"written by {whose}" in status.reason and "reads job 'a''s checkpoints" in status.reason
        assert "has no owner record" in status.reason, status.reason
    assert "from before 2026-12-01" in inspect(storage, nameless, lineage=reading_a).reason
    latest = latest_valid(storage, reading_as="a")
    assert latest is not None and latest.ref == mine
    assert latest_valid(storage, reading_as="nobody") is None
    latest = latest_valid(storage)
    assert latest is not None and latest.ref == nameless, "without job=, every job's, as before"
    assert read_owner(storage) is None


def test_adopt_takes_the_uri_over_and_the_new_job_resumes_from_the_old_jobs_checkpoints(storage: FileStorage) -> None:
    claim(storage, "a")
    old = commit(storage, 10, job="a")
    owner = adopt(storage, "b")
    assert owner.job == "b" and [(x.job, x.upto) for x in owner.adopted] == [("a", old)]
    assert claim(storage, "b").job == "b"
    with pytest.raises(OwnershipError, match="belongs to job 'b'"):
        claim(storage, "a")
    status = latest_valid(storage)
    assert status is not None and status.ref == old, "b resumes from a's checkpoint"
    # What the old job commits after the adoption is not b's history.
    late = commit(storage, 20, job="a", created_at=now_utc())
    assert inspect(storage, late).foreign
    assert "after job 'b' adopted" in inspect(storage, late).reason
    with pytest.raises(FencedError, match="belongs to job 'b'"):
        check_not_fenced(storage, "a", None)
    mine = commit(storage, 30, job="b")
    status = latest_valid(storage)
    assert status is not None and status.ref == mine
    assert adopt(storage, "b") == read_owner(storage), "adopting one's own URI changes nothing"


def test_a_checkpoint_created_before_an_adoption_and_copied_in_since_is_named_a_copy_with_the_adopt_command(
    storage: FileStorage,
) -> None:
    """After ``adopt`` took in job a's checkpoints up to step 10, a's step 30, created before the
    adoption and copied in since, was called "written by job 'a' after job 'b' adopted" (a stray
    writer), with no command, though a second ``adopt`` takes it in. Only one created after the
    newest adoption of its job is a stray writer's; one from before is a copy, as in a URI b owns
    without any adoption."""
    claim(storage, "a")
    commit(storage, 10, job="a")
    adopted = adopt(storage, "b").adopted[0].adopted_at
    copied = commit(storage, 30, job="a", created_at=adopted - timedelta(minutes=1))
    stray = commit(storage, 20, job="a", created_at=adopted + timedelta(seconds=1))
    command = f"`spotjob ckpt adopt {storage.uri} --job b` takes it in"
    reason = inspect(storage, copied).reason
    assert inspect(storage, copied).foreign and command in reason, reason
    assert f"written by job 'a', but {storage.uri} belongs to job 'b'" in reason and "after" not in reason, reason
    reason = inspect(storage, stray).reason
    assert "written by job 'a' after job 'b' adopted" in reason and "spotjob ckpt adopt" not in reason, reason
    # The same command takes the copy in (and the stray one below it, committed by then).
    adopt(storage, "b")
    assert inspect(storage, copied).valid and inspect(storage, stray).valid
    latest = latest_valid(storage)
    assert latest is not None and latest.ref == copied


def test_adopting_an_unclaimed_uri_accepts_every_job_found_there(storage: FileStorage) -> None:
    first = commit(storage, 10, job="x")
    second = commit(storage, 20, job=None)
    owner = adopt(storage, "b")
    assert {a.job for a in owner.adopted} == {"x", None}
    assert all(a.upto == second for a in owner.adopted)
    assert [s.ref for s in list_checkpoints(storage) if s.valid] == [second, first]


# -- attempts and fencing -------------------------------------------------------------------------


def test_attempt_records_are_create_only_replayable_and_never_go_back(storage: FileStorage) -> None:
    fence = commit(storage, 10, job="a", attempt=0)
    first = record_attempt(storage, "a", 1, fence)
    assert json.loads(storage.get_bytes(attempt_key("a", 1))) == {
        "format": 1,
        "attempt": 1,
        "job": "a",
        "fence": {"step": 10, "folder": "step-000000010"},
        "recorded_at": first.recorded_at.isoformat().replace("+00:00", "Z"),
    }
    # A replayed pass (its status write lost) gets the record already there, fence and all.
    assert record_attempt(storage, "a", 1, CheckpointRef(99)) == first
    record_attempt(storage, "a", 2, None)
    assert [r.attempt for r in attempt_records(storage, "a")] == [1, 2]
    assert newest_attempt(storage, "a") == 2
    with pytest.raises(FencedError, match=r"attempt 2 .* recorded"):
        record_attempt(storage, "a", 1, fence)
    assert newest_attempt(storage, "b") is None, "each job numbers its own attempts"


def test_a_zombie_of_an_older_attempt_commits_after_the_newer_one_was_recorded(storage: FileStorage) -> None:
    """Attempt 0's worker sits on a partitioned node and trains on after attempt 1 was started."""
    claim(storage, "a")
    resumed = commit(storage, 40, job="a", attempt=0)
    record_attempt(storage, "a", 0, None)
    check_not_fenced(storage, "a", 0)
    record_attempt(storage, "a", 1, resumed)  # the controller moved the job; attempt 1 resumes from 40

    with pytest.raises(FencedError, match=r"attempt 1 .* stale"):
        check_not_fenced(storage, "a", 0)
    check_not_fenced(storage, "a", 1)
    # The zombie raced past its check: its commit lands anyway, and does not count.
    zombie = commit(storage, 60, job="a", attempt=0)
    status = inspect(storage, zombie)
    assert not status.valid and status.fenced and not status.foreign
    assert "fenced" in status.reason and "attempt 1" in status.reason and "step-000000040" in status.reason
    latest = latest_valid(storage)
    assert latest is not None and latest.ref == resumed
    # Attempt 1's own, older-numbered step outranks the zombie's.
    newer = commit(storage, 50, job="a", attempt=1)
    latest = latest_valid(storage)
    assert latest is not None and latest.ref == newer
    # What attempt 0 committed before attempt 1 was recorded stays valid.
    assert inspect(storage, resumed).valid


def test_an_unreadable_attempt_record_leaves_what_it_would_judge_untrusted(storage: FileStorage) -> None:
    claim(storage, "a")
    old = commit(storage, 40, job="a", attempt=0)
    storage.put_bytes(attempt_key("a", 1), b"[" * 100_000)
    status = inspect(storage, old)
    assert not status.valid and "cannot tell whether" in status.reason and "nested" in status.reason
    assert attempt_records(storage, "a") == []
    newest = commit(storage, 50, job="a", attempt=1)
    assert inspect(storage, newest).valid


def test_an_attempt_record_gone_between_listing_and_reading_leaves_what_it_would_judge_undecided(
    storage: FileStorage,
) -> None:
    """One sweep lists a job's attempt records once; a record deleted before it is read proves
    nothing about the checkpoint it would judge. It was called untrusted, so ``spotjob ckpt verify``
    exited 1, "invalid"; it is undecided (exit 2: look again), and still never valid."""
    claim(storage, "a")
    old = commit(storage, 40, job="a", attempt=0)
    middle = commit(storage, 50, job="a", attempt=1)
    record_attempt(storage, "a", 1, old)
    record_attempt(storage, "a", 2, middle)
    lineage = Lineage.load(storage)
    assert inspect(storage, middle, lineage=lineage).valid  # lists attempts 1 and 2, reads 2
    storage.delete([attempt_key("a", 1)])
    status = inspect(storage, old, lineage=lineage)
    assert not status.valid and status.undecided and not status.fenced
    assert "was listed but is gone" in status.reason and "look again" in status.reason


def test_a_record_a_newer_spotjob_wrote_leaves_checkpoints_undecided_and_a_broken_one_untrusted(
    storage: FileStorage,
) -> None:
    """What ``spotjob ckpt verify``'s exit status stands on: a newer spotjob's owner or attempt
    record proves nothing (undecided, exit 2); one whose bytes are broken is proven so (exit 1)."""
    claim(storage, "a")
    old = commit(storage, 40, job="a", attempt=0)
    record_attempt(storage, "a", 1, old)
    key = attempt_key("a", 1)
    record = json.loads(storage.get_bytes(key))
    storage.put_bytes(key, json.dumps({**record, "format": 2}).encode())
    status = inspect(storage, old)
    assert not status.valid and status.undecided and "newer spotjob" in status.reason
    storage.put_bytes(key, b"not json")
    status = inspect(storage, old)
    assert not status.valid and not status.undecided and "cannot tell whether" in status.reason
    storage.put_bytes(key, json.dumps(record).encode())
    assert inspect(storage, old).valid

    owner = json.loads(storage.get_bytes(OWNER_KEY))
    storage.put_bytes(OWNER_KEY, json.dumps({**owner, "format": 2}).encode())
    status = inspect(storage, old)
    assert not status.valid and status.undecided and "newer spotjob" in status.reason
    storage.put_bytes(OWNER_KEY, b"not json")
    status = inspect(storage, old)
    assert not status.valid and not status.undecided and "unreadable" in status.reason


@pytest.mark.parametrize(
    "content",
    [b"[" * 100_000, b"not json", b'{"format": 1, "job": 7}'],
    ids=["deep", "garbage", "wrong-type"],
)  # a newer spotjob's record is never rewritten: tests/integration/test_checkpoint_upgrade.py
def test_an_unreadable_owner_record_refuses_everyone_until_adopt_rewrites_it(
    storage: FileStorage, content: bytes
) -> None:
    ref = commit(storage, 10, job="a")
    storage.put_bytes(OWNER_KEY, content)
    with pytest.raises(OwnershipError, match="unreadable") as e:
        read_owner(storage)
    assert f"spotjob ckpt adopt {storage.uri} --job JOB" in str(e.value)
    with pytest.raises(OwnershipError):
        claim(storage, "a")
    with pytest.raises(FencedError, match="unreadable"):
        check_not_fenced(storage, "a", None)
    status = inspect(storage, ref)
    assert not status.valid and "unreadable" in status.reason
    adopt(storage, "a")
    assert inspect(storage, ref).valid


def test_an_oversized_owner_record_is_refused_unread(storage: FileStorage, monkeypatch: pytest.MonkeyPatch) -> None:
    storage.put_bytes(OWNER_KEY, b" " * (2 << 20))
    reads: list[str] = []
    original = storage.get_bytes
    monkeypatch.setattr(storage, "get_bytes", lambda key: reads.append(key) or original(key))
    with pytest.raises(OwnershipError, match="more than"):
        read_owner(storage)
    assert reads == []


def test_spotjobs_own_records_are_never_taken_for_checkpoints(storage: FileStorage) -> None:
    claim(storage, "a")
    record_attempt(storage, "a", 0, None)
    ref = commit(storage, 10, job="a", attempt=0)
    assert find_checkpoints(storage) == [ref]
    assert [s.ref for s in list_checkpoints(storage)] == [ref]


def test_job_keys_are_distinct_and_path_safe() -> None:
    keys = {job_key(j) for j in ["ns/train", "ns_train", "ns train", None, "unnamed", "../x", ""]}
    assert len(keys) == 7
    assert all("/" not in k and not k.startswith(".") for k in keys)


@pytest.mark.parametrize(
    "stray", ["attempt-0000000009.json", "attempt-00000000\u0669.json", "attempt-000000009.json\n"]
)
def test_a_file_named_like_an_attempt_record_but_not_spelled_as_spotjob_spells_it_is_no_attempt(
    storage: FileStorage, stray: str
) -> None:
    """A stray under the attempts folder whose name parses to a number (another spelling of it)
    names no record: counted as one, it fenced the job's real attempts below a phantom."""
    record_attempt(storage, "a", 1, None)
    storage.put_bytes(attempt_key("a", 1).rsplit("/", 1)[0] + "/" + stray, b"{}")
    assert newest_attempt(storage, "a") == 1
    record_attempt(storage, "a", 2, None)
    check_not_fenced(storage, "a", 2)


@pytest.mark.parametrize(
    ("job", "error", "why"),
    [
        ("caf\udce9", ValueError, "is not valid UTF-8"),
        ("ns/train\n2026-12-03 INFO forged", ValueError, "holds control characters ('\\n')"),
        (7, TypeError, "must be a string"),
        # An owner of a third kind: neither unnamed (no job=, SPOTJOB_JOB_NAME empty) nor any name
        # `spotjob ckpt adopt --job` takes, so nothing could name it again. Taken before.
        ("", ValueError, "the job name is empty: give the job a name, or leave it out (an unnamed job)"),
    ],
)
def test_a_job_name_the_owner_record_or_a_log_line_cannot_carry_is_refused_up_front(
    job: object, error: type[Exception], why: str
) -> None:
    """A lone surrogate (undecodable bytes from the environment) failed the first claim with a
    bare serialisation error; a newline forged log lines naming the job."""
    from agent.checkpoint.config import CheckpointConfig

    with pytest.raises(error, match=re.escape(why)):
        CheckpointConfig("/tmp/never-written", job=job)  # type: ignore[arg-type]
    assert CheckpointConfig("/tmp/never-written", job="ns/train ü %+#?=&").job == "ns/train ü %+#?=&"
