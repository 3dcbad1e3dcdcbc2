"""kill -9 during a save: the previous checkpoint stays the one restore picks.

A 2-rank torchrun job commits step 1, then its save of step 2 freezes at a seam outside
spotjob's code (see scripts/ckpt_job.py): while DCP writes the shards to staging, mid-upload
(one file through), or just before rank 0 writes MANIFEST.json. The test waits for the marker,
SIGKILLs every rank, and then:

- ``list_checkpoints`` and ``spotjob ckpt list`` show step 1 valid and any step-2 leftover as
  uncommitted (killed during staging, there is none, or one holding only the folder's claim,
  ``WRITER.json``, which rank 0 writes while the shards are staged);
- a fresh process (this one) restores step 1;
- its next save cleans the leftover: a save of the same step replaces it, a later step's
  retention removes it.

Last, the OOM killer's way: one rank of two killed by SIGKILL during the staging of an async save,
under ``spotjob-agent`` with either launcher.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from agent.catalog import CheckpointStatus, list_checkpoints
from agent.checkpoint import Checkpointer
from agent.checkpoint._claim import CLAIM_NAME
from agent.control_channel import EXIT_PREEMPTED
from agent.manifest import MANIFEST_NAME
from agent.storage import open_storage
from orchestrator.backends.local_failure import failure_detail

sys.path.insert(0, str(Path(__file__).resolve().parent / "scripts"))
import ckpt_harness as harness
from ckpt_state import make_state, train

pytestmark = pytest.mark.slow

JOB = harness.SCRIPTS / "ckpt_job.py"
RANKS = 2


def statuses(uri: str) -> dict[str, CheckpointStatus]:
    return {s.ref.folder: s for s in list_checkpoints(open_storage(uri))}


def cli_list(uri: str, capsys: pytest.CaptureFixture[str]) -> dict[str, dict[str, object]]:
    """``spotjob ckpt list --json`` (in process: it imports no torch and starts in no time)."""
    from orchestrator.cli import main

    capsys.readouterr()
    main(["ckpt", "list", "--json", uri])
    return {row["folder"]: row for row in json.loads(capsys.readouterr().out)}


def nothing_but_a_claim(folder: Path) -> bool:
    """A save's folder killed during staging: absent, or its claim alone (or the claim's temp file)."""
    names = [p.name for p in folder.iterdir()] if folder.exists() else []
    return all(n == CLAIM_NAME or n.startswith(".spotjob-tmp") for n in names)


def kill_save_at(stage: str, uri: str, tmp_path: Path) -> None:
    """Run the job until every rank that reaches ``stage`` is frozen there, then kill -9 them all."""
    markers = tmp_path / "markers"
    markers.mkdir()
    log = tmp_path / "job.log"
    argv = harness.torchrun_argv(RANKS, JOB, ["interrupt", "--uri", uri, "--markers", str(markers), "--stage", stage])
    proc = harness.start(argv, log)
    # Only rank 0 writes the manifest; the other ranks wait for its answer.
    frozen = ["rank0"] if stage == "manifest" else [f"rank{r}" for r in range(RANKS)]
    expected = [markers / f"{stage}.{r}" for r in frozen] + [markers / f"pid.rank{r}" for r in range(RANKS)]
    try:
        harness.wait_for(
            lambda: all(p.exists() for p in expected), f"the ranks to freeze at {stage}", alive=proc, log_path=log
        )
        pids = harness.read_pids(markers)
        assert len(pids) == RANKS
        assert {int((markers / f"{stage}.{r}").read_text()) for r in frozen} <= set(pids)
        harness.kill9(pids)
        rc = harness.reap(proc)
    finally:  # on any failure above, leave no rank of ours behind
        harness.kill9(harness.read_pids(markers))
        harness.stop(proc)
    assert rc != 0, "torchrun reported success for a job whose ranks were killed"
    assert not any(harness.pid_alive(p) for p in pids)


@pytest.mark.parametrize(
    ("stage", "next_step"),
    [("staging", 2), ("upload", 2), ("manifest", 3)],
    ids=["during-staging", "mid-upload", "before-manifest"],
)
def test_kill9_during_a_save_leaves_the_previous_checkpoint_restorable(
    stage: str, next_step: int, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    uri = str(tmp_path / "ckpt")
    kill_save_at(stage, uri, tmp_path)

    found = statuses(uri)
    listed = cli_list(uri, capsys)
    assert found["step-000000001"].valid and listed["step-000000001"]["valid"] is True
    leftover = Path(uri) / "step-000000002"
    if stage == "staging" and "step-000000002" not in found:
        assert "step-000000002" not in listed
    else:
        assert not found["step-000000002"].committed and "uncommitted" in found["step-000000002"].reason
        assert listed["step-000000002"]["committed"] is False
        assert "uncommitted" in str(listed["step-000000002"]["reason"])
    if stage == "staging":
        assert nothing_but_a_claim(leftover)
    else:
        assert not (leftover / MANIFEST_NAME).exists()
        assert any(leftover.iterdir()), "the killed upload was supposed to leave a file behind"
        # Stand-in for whatever else a dead writer leaves; the clean-up must take it too.
        (leftover / "stale-part").write_bytes(b"x" * 10)

    state = make_state(0, seed=3)
    with Checkpointer(uri, keep=None) as ckpt:
        assert ckpt.restore(state) == 1
        train(state, 1, start=1)
        ckpt.save(next_step, state)
    assert ckpt.last_committed_uri is not None
    assert ckpt.last_committed_uri.endswith(f"/step-{next_step:09d}")

    after = statuses(uri)
    assert all(s.valid for s in after.values()), {k: s.reason for k, s in after.items()}
    assert set(after) == {"step-000000001", f"step-{next_step:09d}"}
    if stage != "staging":
        listed_files = {f.path for f in after[f"step-{next_step:09d}"].manifest.files}  # type: ignore[union-attr]
        kept = listed_files | {MANIFEST_NAME, CLAIM_NAME}
        on_disk = {p.name for p in leftover.iterdir()} if leftover.exists() else set()
        assert "stale-part" not in on_disk
        assert on_disk <= kept


@pytest.mark.parametrize("launcher", ["direct", "torchrun"])
def test_an_oom_kill_of_one_rank_during_staging_is_named_and_the_next_attempt_resumes_from_the_last_commit(
    tmp_path: Path, launcher: str
) -> None:
    """What the OOM killer does to a rank whose async save stages a second host copy of the state:
    SIGKILL, to that rank only. The agent ends the other rank and exits 137 (128 + SIGKILL; torchrun
    itself exits 1), not 75 (a committed flush) nor 0, and the log says the rank was killed by
    SIGKILL and what sends it. The direct launcher said only "rank 1 (pid N) exited 137" (and the
    agent "the command exited 137"), which a user could not tell from a script's own exit code; the
    cause ``spotjob run`` reports (``failure_detail``) was, under torchrun, the other rank's gloo
    error ("Connection closed by peer"). Nothing of the half-staged save is used: step 1 restores."""
    uri, markers = str(tmp_path / "ckpt"), tmp_path / "markers"
    markers.mkdir()
    log = tmp_path / "agent.log"
    job_args = ["interrupt", "--uri", uri, "--markers", str(markers), "--stage", "staging"]
    argv = [
        str(Path(harness.PYTHON).with_name("spotjob-agent")), "--checkpoint-uri", uri, "--job-name", "oom",
        "--control-dir", str(tmp_path / "control"), "--control-port", "0", "--cloud", "none",
        "--launcher", launcher, "--", *harness.torchrun_argv(RANKS, JOB, job_args),
    ]  # fmt: skip
    proc = harness.start(argv, log)
    expected = [markers / f"{name}.rank{r}" for name in ("staging", "pid") for r in range(RANKS)]
    try:
        harness.wait_for(lambda: all(p.exists() for p in expected), "the ranks to stage", alive=proc, log_path=log)
        harness.kill9([int((markers / "staging.rank1").read_text())])
        rc = harness.reap(proc)
    finally:
        harness.kill9(harness.read_pids(markers))
        harness.stop(proc)
    said = log.read_text(errors="replace")
    assert rc == (137 if launcher == "direct" else 1) and rc != EXIT_PREEMPTED, said[-4000:]
    if launcher == "direct":
        assert re.search(r"rank 1 \(pid \d+\) was killed by SIGKILL \(exit 137: .*OOM killer", said), said[-4000:]
        assert "the command exited 137, killed by SIGKILL" in said, said[-4000:]
    cause = failure_detail(str(log))
    assert re.match(r"rank 1 \(pid \d+\) was killed by SIGKILL.*out of memory\?", cause), cause
    assert not any(harness.pid_alive(p) for p in harness.read_pids(markers)), "a rank was left running"

    # At most step 2's claim (WRITER.json) in a folder of its own: uncommitted, never restored.
    found = statuses(uri)
    assert found["step-000000001"].valid and not found.get("step-000000002", found["step-000000001"]).valid
    assert set(found) <= {"step-000000001", "step-000000002"} and nothing_but_a_claim(Path(uri) / "step-000000002")
    state = make_state(0, seed=3)
    with Checkpointer(uri, keep=None, job="oom") as ckpt:
        assert ckpt.restore(state) == 1
