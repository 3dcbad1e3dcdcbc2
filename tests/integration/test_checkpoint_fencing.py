"""One job per URI, and a superseded attempt never writes: the Checkpointer's side of
``agent.ownership``.

- Constructing a Checkpointer claims the URI for its job; another job's URI fails on every rank
  with the owner's name and the remedies.
- Every manifest records the writer's attempt.
- A zombie — a worker of attempt 0 that trains on after the controller recorded attempt 1 and
  attempt 1 committed — commits nothing, deletes nothing, and stops; restore picks attempt 1's
  newest checkpoint. The zombie is a real 2-rank torchrun job; attempt 1, which only commits
  the steps the zombie must not touch, runs in the test's process.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from agent.catalog import CheckpointRef, latest_valid, list_checkpoints
from agent.checkpoint import Checkpointer
from agent.ownership import claim, record_attempt
from agent.storage import open_storage

sys.path.insert(0, str(Path(__file__).resolve().parent / "scripts"))
import ckpt_harness as harness
from ckpt_state import make_state, train

POLICY = harness.SCRIPTS / "ckpt_policy.py"
JOB = "fenced-job"


def stored_files(root: Path) -> dict[str, int]:
    """Every file under a filesystem URI with its size, spotjob's staging area aside."""
    return {
        p.relative_to(root).as_posix(): p.stat().st_size
        for p in root.rglob("*")
        if p.is_file() and ".spotjob-staging" not in p.parts
    }


@pytest.mark.slow
def test_another_jobs_uri_is_refused_on_every_rank_naming_the_owner_and_the_remedies(tmp_path: Path) -> None:
    uri = str(tmp_path / "ckpt")
    claim(open_storage(uri), "train-7b")
    out = tmp_path / "outcome"
    harness.torchrun(2, POLICY, "claim", "--uri", uri, "--out", str(out), "--job", "train-13b")
    for rank in (0, 1):
        outcome = Path(f"{out}.rank{rank}").read_text()
        assert outcome.startswith("CheckpointOwnershipError"), f"rank {rank}: {outcome}"
        assert "train-7b" in outcome and "train-13b" in outcome, outcome
        assert "spotjob ckpt adopt" in outcome and "fresh checkpoint URI" in outcome, outcome
    assert stored_files(tmp_path / "ckpt") == {
        ".spotjob/owner.json": (tmp_path / "ckpt/.spotjob/owner.json").stat().st_size
    }


def test_the_same_job_may_come_back_and_an_unnamed_job_is_an_owner_too(tmp_path: Path) -> None:
    uri = str(tmp_path / "ckpt")
    Checkpointer(uri, job="a").close()
    Checkpointer(uri, job="a").close()
    with pytest.raises(Exception, match="belongs to job 'a'"):
        Checkpointer(uri)  # no job name: not job 'a'


@pytest.mark.parametrize("how", ["argument", "environment"])
def test_every_manifest_records_the_writers_attempt(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    uri = str(tmp_path / "ckpt")
    if how == "environment":
        monkeypatch.setenv("SPOTJOB_ATTEMPT", "4")
        monkeypatch.setenv("SPOTJOB_JOB_NAME", JOB)
        ckpt = Checkpointer(uri)
    else:
        ckpt = Checkpointer(uri, job=JOB, attempt=4)
    with ckpt:
        ckpt.save(1, make_state(0))
    (status,) = list_checkpoints(open_storage(uri))
    assert status.manifest is not None
    assert (status.manifest.job, status.manifest.attempt) == (JOB, 4)


def test_a_superseded_attempts_checkpoints_are_never_restored_and_never_deleted_by_retention(
    tmp_path: Path,
) -> None:
    uri = str(tmp_path / "ckpt")
    storage = open_storage(uri)
    record_attempt(storage, JOB, 0, None)
    state = make_state(0)
    with Checkpointer(uri, keep=None, job=JOB, attempt=0, async_save=False) as zombie:
        for step in (1, 2):
            train(state, 1, start=step - 1)
            zombie.save(step, state)
        # Attempt 1 is recorded resuming from step 1; step 2 lands after it (the race the fencing
        # rule covers: the check passed, then the record was written, then the manifest).
        record_attempt(storage, JOB, 1, CheckpointRef(1))
    fenced = next(s for s in list_checkpoints(storage) if s.ref.step == 2)
    assert fenced.fenced

    with Checkpointer(uri, keep=1, job=JOB, attempt=1, async_save=False) as ckpt:
        fresh = make_state(0, seed=4)
        assert ckpt.restore(fresh) == 1
        ckpt.save(3, fresh)
    found = sorted(s.ref.step for s in list_checkpoints(storage))
    # keep=1: step 1 (attempt 0's, superseded by attempt 1's step 3) goes; the fenced step 2 is
    # not attempt 1's history to count or delete.
    assert found == [2, 3]


@pytest.mark.slow
def test_a_zombie_attempt_commits_nothing_deletes_nothing_and_stops(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    uri, markers = str(root), tmp_path / "markers"
    markers.mkdir()
    storage = open_storage(uri)
    record_attempt(storage, JOB, 0, None)
    log = tmp_path / "zombie.log"
    zombie = harness.start(harness.torchrun_argv(2, POLICY, ["zombie", "--uri", uri, "--markers", str(markers)]), log)
    try:
        harness.wait_for(
            lambda: all((markers / f"committed.rank{r}").exists() for r in (0, 1)),
            "attempt 0 to commit step 3",
            alive=zombie,
            log_path=log,
        )
        # The controller replaces the gang: attempt 1 is recorded, resuming from the newest
        # valid checkpoint, and runs while attempt 0's workers are still alive.
        fence = latest_valid(storage)
        assert fence is not None and fence.ref.step == 3
        record_attempt(storage, JOB, 1, fence.ref)
        # Attempt 1 only sets the scene (it commits steps 4 and 5 as attempt 1), so it runs here,
        # as one process, rather than as a second torchrun gang: what is tested is the zombie's.
        state = make_state(0, seed=5)
        with Checkpointer(uri, keep=None, attempt=1, job=JOB, async_save=False) as ckpt:
            assert ckpt.restore(state) == 3
            for step in (4, 5):
                train(state, 1, start=step - 1)
                ckpt.save(step, state)
        before = stored_files(root)
        (markers / "go").write_text("")  # the zombie trains on and tries to save steps 4-9
        assert harness.reap(zombie, timeout=harness.RUN_TIMEOUT_S) == 0, harness._tail(log)
    finally:
        harness.stop(zombie)

    for rank in (0, 1):
        outcome = (markers / f"outcome.rank{rank}").read_text()
        assert outcome.startswith("FencedSaveError at step"), f"rank {rank}: {outcome}"
        assert "attempt 1" in outcome and outcome.endswith("| then FencedSaveError"), outcome
    assert stored_files(root) == before, "the zombie wrote or deleted something"
    writers = {s.ref.step: s.manifest.attempt for s in list_checkpoints(storage) if s.manifest is not None}
    assert writers == {3: 0, 4: 1, 5: 1}
    with Checkpointer(uri, job=JOB, attempt=1) as ckpt:
        assert ckpt.restore(make_state(0, seed=8)) == 5


def test_an_attempt_argument_other_than_the_agents_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The argument used to win over SPOTJOB_ATTEMPT without a word: a script passing its own
    attempt number under spotjob-agent recorded it in every manifest, and fencing (which compares
    it with the newest attempt the controller recorded) never stopped a superseded worker. The
    same number, or the argument without the variable, is fine."""
    uri = str(tmp_path / "ckpt")
    monkeypatch.setenv("SPOTJOB_ATTEMPT", "4")
    with pytest.raises(ValueError, match=r"attempt=1 but SPOTJOB_ATTEMPT=4 .*drop attempt="):
        Checkpointer(uri, job=JOB, attempt=1)
    Checkpointer(uri, job=JOB, attempt=4).close()
    monkeypatch.delenv("SPOTJOB_ATTEMPT")
    Checkpointer(uri, job=JOB, attempt=5).close()
