"""Save failures reach every rank, at the same step, and commit nothing.

Two real torchrun ranks (``scripts/ckpt_failures.py``): every bug pinned down here is one rank
learning of a failure that its peer does not (a peer left hanging in the save's collectives, or
training on while the other rank raised), which one process never shows.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

import pytest

from agent.catalog import list_checkpoints
from agent.manifest import MANIFEST_NAME
from agent.storage import open_storage

sys.path.insert(0, str(Path(__file__).resolve().parent / "scripts"))
import ckpt_harness as harness

FAILURES = harness.SCRIPTS / "ckpt_failures.py"
pytestmark = pytest.mark.slow


def outcomes(out: Path) -> list[str]:
    """What each rank reported; a rank that never reported fails the test with the others' word."""
    seen = {}
    for rank in (0, 1):
        path = Path(f"{out}.rank{rank}")
        seen[rank] = path.read_text() if path.exists() else None
    missing = [r for r, text in seen.items() if text is None]
    assert not missing, f"rank(s) {missing} never learned the outcome; the others said: {seen}"
    return [text for text in seen.values() if text is not None]


def committed_steps(uri: str) -> list[int]:
    return sorted(s.ref.step for s in list_checkpoints(open_storage(uri)) if s.committed)


SHARED_CASES: dict[str, dict[str, Any]] = {
    "commit-error-naming-runtime": {"command": "commit-error", "where": "naming", "error": "runtime"},
    "commit-error-naming-oserror": {"command": "commit-error", "where": "naming", "error": "oserror"},
    "commit-error-commit-runtime": {"command": "commit-error", "where": "commit", "error": "runtime"},
    "commit-error-commit-oserror": {"command": "commit-error", "where": "commit", "error": "oserror"},
    "unrestorable-1": {"command": "unrestorable", "from_save": 1},
    "unrestorable-2": {"command": "unrestorable", "from_save": 2},
    "prepare-one-rank": {"command": "prepare-one-rank"},
    "flush-with-failed-save": {"command": "flush-with-failed-save", "same_step": False},
    "flush-with-failed-save-same-step": {"command": "flush-with-failed-save", "same_step": True},
    "failure-raised-before-its-vote": {"command": "failure-raised-before-its-vote"},
    "after-close": {"command": "after-close"},
    "flush-over-save-failed": {"command": "flush-over-save", "variant": "failed"},
    "flush-over-save-cancelled": {"command": "flush-over-save", "variant": "cancelled"},
    # Last: they replace threading.Thread.start in the ranks (put back once the case is over).
    "no-save-thread-spotjob-save": {"command": "no-save-thread", "thread": "spotjob-save"},
    "no-save-thread-spotjob-name": {"command": "no-save-thread", "thread": "spotjob-name"},
}
"""The cases whose job ends cleanly (each rank writes its outcome and meets the others): one torchrun
runs them all in turn, each with its own folder and Checkpointer, instead of a launcher and two
ranks each (about 8 CPU-s). The case whose job is meant to fail (an error left to end the script)
keeps a torchrun of its own."""


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[str, Path, Path]]:
    """case -> (its URI, its outcome file's prefix, its folder), once the shared job ran them all
    and exited 0 (else every test of it fails, with the job's output)."""
    root = tmp_path_factory.mktemp("shared")
    where = {case: (str(root / case / "ckpt"), root / case / "outcome", root / case) for case in SHARED_CASES}
    for _, _, folder in where.values():
        folder.mkdir()
    cases = [{**options, "uri": where[case][0], "out": str(where[case][1])} for case, options in SHARED_CASES.items()]
    harness.torchrun(2, FAILURES, "--cases", json.dumps(cases))
    return where


def case_log(out: Path) -> str:
    """Every rank's log lines of one case of the shared job."""
    return "".join(Path(f"{out}.log.rank{rank}").read_text() for rank in (0, 1))


@pytest.mark.parametrize(
    ("where", "error"), [("naming", "runtime"), ("naming", "oserror"), ("commit", "runtime"), ("commit", "oserror")]
)
def test_an_unexpected_error_on_rank_0_fails_the_save_on_every_rank_naming_the_checkpoint(
    shared: dict[str, tuple[str, Path, Path]], where: str, error: str
) -> None:
    uri, out, _ = shared[f"commit-error-{where}-{error}"]
    words = "blew up" if error == "runtime" else "Input/output error"
    problems = []
    for rank, text in enumerate(outcomes(out)):
        if not text.startswith("SaveFailedError at step 1"):
            problems.append(f"rank {rank} did not fail the save: {text}")
        elif words not in text:
            problems.append(f"rank {rank} was not told why: {text}")
        # Which checkpoint failed, in words the user can look up: the URI, and the folder once named.
        elif uri not in text or (where == "commit" and f"{uri}/step-000000001" not in text):
            problems.append(f"rank {rank}: the error does not name the checkpoint: {text}")
    assert not problems, "\n".join(problems)
    assert committed_steps(uri) == []


def test_a_background_save_that_fails_on_one_rank_is_raised_on_every_rank_at_the_same_step(tmp_path: Path) -> None:
    uri, out = str(tmp_path / "ckpt"), tmp_path / "outcome"
    proc = harness.torchrun(2, FAILURES, "async-one-rank", "--uri", uri, "--out", str(out), check=False)
    assert proc.returncode != 0, "the job went on after its save failed"
    reported = outcomes(out)
    steps = set()
    for rank, text in enumerate(reported):
        found = re.match(
            rf"SaveFailedError at step (\d+): checkpoint of step 3 in file://{re.escape(uri)} failed", text
        )
        assert found, f"rank {rank}: {text}"
        assert "Permission denied (injected)" in text, f"rank {rank} was not told why: {text}"
        steps.add(int(found.group(1)))
    assert len(steps) == 1, f"the ranks raised at different steps: {reported}"
    assert steps.pop() <= 6, "the failure must be raised no later than the next save"
    assert 3 not in committed_steps(uri)
    assert not (tmp_path / "ckpt" / "step-000000003" / MANIFEST_NAME).exists()


@pytest.mark.parametrize("from_save", [1, 2])
def test_a_save_whose_per_rank_state_cannot_be_restored_fails_on_every_rank_and_commits_nothing(
    shared: dict[str, tuple[str, Path, Path]], from_save: int
) -> None:
    uri, out, _ = shared[f"unrestorable-{from_save}"]
    for rank, text in enumerate(outcomes(out)):
        assert text.startswith(f"SaveFailedError at step {from_save}"), f"rank {rank}: {text}"
        assert "rank 1" in text and "cannot be restored" in text, f"rank {rank}: {text}"
        assert "__main__.Opaque" in text, f"rank {rank}: the error does not name the value: {text}"
    assert committed_steps(uri) == list(range(1, from_save))


def test_a_save_one_rank_cannot_prepare_fails_on_every_rank_and_the_next_save_commits(
    shared: dict[str, tuple[str, Path, Path]],
) -> None:
    """Rank 1 fails before the save's collectives (its state_dict() raises): rank 0 must not go on
    into them alone, and the ranks' next save must pair up as usual."""
    uri, out, folder = shared["prepare-one-rank"]
    for rank, text in enumerate(outcomes(out)):
        lines = text.splitlines()
        assert lines[0] == "step 1: no error", f"rank {rank}: {text}"
        assert lines[1].startswith("step 2: SaveFailedError:"), f"rank {rank}: {text}"
        assert "rank 1" in lines[1] and "step 2" in lines[1] and uri in lines[1], f"rank {rank}: {text}"
        if rank == 1:
            assert "state_dict blew up (injected)" in lines[1], f"rank 1 was not told why: {text}"
        assert lines[2] == "step 3: no error", f"rank {rank}: {text}"
    assert committed_steps(uri) == [1, 3]
    staging = folder / "ckpt" / ".spotjob-staging"
    left = sorted(p.name for p in staging.glob("step-000000002-*")) if staging.exists() else []
    assert left == [], f"the failed save left its staging folders: {left}"


@pytest.mark.parametrize("variant", ["failed", "cancelled"])
def test_a_flush_over_a_save_in_flight_acts_alike_on_ranks_whose_save_threads_finish_apart(
    shared: dict[str, tuple[str, Path, Path]], variant: str
) -> None:
    """Rank 0's save thread finished before rank 0 reached the flush's step, rank 1's only after
    rank 1 gave the save up there: both must judge the save alike, never one raising while the
    other goes on into the flush's collectives alone. Whether the save failed on its own (a store
    that refused it) or was given up for the flush, every rank goes on and the flush commits: the
    failed save is no reason to let the notice pass without one (it used to fail the flush)."""
    uri, out, _ = shared[f"flush-over-save-{variant}"]
    for rank, text in enumerate(outcomes(out)):
        assert text == "no error, stop at step 3", f"rank {rank}: {text}"
    assert committed_steps(uri) == [3]


@pytest.mark.parametrize(("same_step", "flush_step"), [(False, 3), (True, 2)])
def test_a_flush_that_meets_a_failed_save_still_commits(
    shared: dict[str, tuple[str, Path, Path]], same_step: bool, flush_step: int
) -> None:
    """A failed background save (rank 1's upload of step 2 refused) and a flush request: the flush
    commits its step on every rank. When one vote carried both, step() used to raise the save's
    failure first, so the notice passed with no flush at all, and no flush result; when the failed
    save was of the flush's own step, the flush failed with it instead of writing that step again."""
    uri, out, _ = shared["flush-with-failed-save-same-step" if same_step else "flush-with-failed-save"]
    for rank, text in enumerate(outcomes(out)):
        assert text == f"no error, stop at step {flush_step}", f"rank {rank}: {text}"
    assert committed_steps(uri) == [flush_step]


def test_a_failure_raised_before_the_vote_that_carries_it_is_not_raised_again(
    shared: dict[str, tuple[str, Path, Path]],
) -> None:
    """save(3) raised the failed save of step 2 on every rank before step(3) read the vote that
    flags it: that vote must not raise it a second time (after waiting for the retried save,
    which committed)."""
    uri, out, _ = shared["failure-raised-before-its-vote"]
    for rank, text in enumerate(outcomes(out)):
        lines = text.splitlines()
        assert lines[0] == "save(2): no error", f"rank {rank}: {text}"
        assert lines[1] == "step(2): no error", f"rank {rank}: {text}"
        assert lines[2].startswith("save(3): SaveFailedError: checkpoint of step 2"), f"rank {rank}: {text}"
        assert lines[3:] == ["save(3) again: no error", "step(3): no error", "close(): no error"], (
            f"rank {rank}: {text}"
        )
    assert committed_steps(uri) == [3]


def test_step_save_and_restore_after_close_raise_on_every_rank(shared: dict[str, tuple[str, Path, Path]]) -> None:
    uri, out, _ = shared["after-close"]
    for rank, text in enumerate(outcomes(out)):
        for call in ("step", "save", "restore"):
            assert f"{call}: RuntimeError: {call}(): the Checkpointer is closed" in text, f"rank {rank}: {text}"
    assert committed_steps(uri) == [1]


@pytest.mark.parametrize("thread", ["spotjob-save", "spotjob-name"])
def test_a_save_thread_that_cannot_start_runs_its_work_in_the_callers_thread_and_commits(
    shared: dict[str, tuple[str, Path, Path]], thread: str
) -> None:
    """A pids or ``ulimit -u`` limit reached: ``Thread.start()`` raises "can't start new thread".
    That is simulated at the one seam (that thread's start; this machine runs as root, which such a
    limit does not bind), for the second save only. spotjob-save (rank 1): the save is staged by
    then and rank 0 already in its collectives; the RuntimeError came out of rank 1's ``step()``
    and left the save in flight with a thread that never ran, and the job hung. spotjob-name (rank
    0, the thread naming the folder while the shards are written): rank 0's save failed before its
    collectives, which rank 1 waited in. Now the work runs in the caller's thread: every step
    commits on every rank, and the newest restores. (The shared job's exit 0, which the fixture
    checks, says that no rank hung or failed after it.)"""
    uri, out, _ = shared[f"no-save-thread-{thread}"]
    said = outcomes(out)
    for text in said:
        assert text.splitlines() == ["step 1: no error", "step 2: no error", "step 3: no error", "restored: 3"], said
    assert committed_steps(uri) == [1, 2, 3]
    if thread == "spotjob-save":
        assert "could not start the save thread" in case_log(out)


def test_ranks_whose_states_hold_other_keys_fail_the_save_and_the_restore_on_every_rank(tmp_path: Path) -> None:
    """Rank 1's state holds a key rank 0's does not. The save committed (the manifest lists rank 0's
    keys), so the very state that saved it could not restore it; and that restore raised
    MissingStateKeysError on rank 1 alone while rank 0 went on into the restore's next collective
    and waited there for ever. Now the save fails on every rank naming both lists, commits nothing,
    and the restore raises on every rank, naming the rank. A rank whose state holds no module at
    all (nothing for DCP to write) left rank 0 waiting in DCP's collectives: the keys are now agreed
    before anything is written."""
    uri, out = str(tmp_path / "ckpt"), tmp_path / "outcome"
    harness.torchrun(2, FAILURES, "keys-differ", "--uri", uri, "--out", str(out), timeout=120)
    for rank, text in enumerate(outcomes(out)):
        lines = text.splitlines()
        assert lines[0] == "save(1): None", f"rank {rank}: {text}"
        assert lines[1].startswith("save(2): SaveFailedError: checkpoint of step 2 in "), f"rank {rank}: {text}"
        assert (
            "rank 1's ['counter', 'extra', 'model', 'optim', 'sched'] (only rank 0: [], only rank 1: ['extra'])"
            in lines[1]
        ), f"rank {rank}: {text}"
        assert lines[2].startswith("restore(uneven): MissingStateKeysError: checkpoint "), f"rank {rank}: {text}"
        assert "it lacks ['extra'] (the state of rank(s) [1] holds them)" in lines[2], f"rank {rank}: {text}"
        assert lines[3] == "restore(same): 1", f"rank {rank}: {text}"
        # Rank 1's state holds no module: it has nothing for DCP to write, and rank 0 waited in
        # DCP's collectives for it for ever. The keys are agreed before anything is written.
        assert lines[4].startswith("save(3): SaveFailedError: checkpoint of step 3 in "), f"rank {rank}: {text}"
        assert "rank 1's ['counter'] (only rank 0: ['model', 'optim', 'sched'], only rank 1: [])" in lines[4], (
            f"rank {rank}: {text}"
        )
        assert "nothing was written" in lines[4], f"rank {rank}: {text}"
    assert committed_steps(uri) == [1]
