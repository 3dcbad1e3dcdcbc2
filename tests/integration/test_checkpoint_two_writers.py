"""Two writers of one job on one URI without attempt numbers (the same script started twice, an old
node still training after its job was restarted elsewhere, a duplicated SLURM job).

Before each save's folder was claimed (``agent.checkpoint._claim``), both writers of a step
uploaded into the same ``step-N``: the loser's files replaced the winner's committed ones (every
file a CRC32C mismatch), and a writer's clean-up of "an unfinished save's leftover" (a save of the
same step, retention after a later one) removed the other's files in flight, which it then
committed as a checkpoint with files missing. The invariants held now: nothing committed is
broken, and the writer that loses a step fails naming the other.

The in-process pairs drive two Checkpointers of one process in a fixed order through one seam (a
hook on one writer's store, as in test_checkpoint_concurrent_readers.py); their claims name the
same process, told apart by the saves it has in flight. The last test runs the other writer as a
real torchrun job in processes of its own.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from agent.catalog import list_checkpoints, verify_deep
from agent.checkpoint import Checkpointer, SaveFailedError
from agent.storage import open_storage

sys.path.insert(0, str(Path(__file__).resolve().parent / "scripts"))
import ckpt_harness as harness
from ckpt_compare import assert_same
from ckpt_state import make_state, snapshot, train


def committed_and_whole(uri: str) -> dict[str, list[str]]:
    """Every committed checkpoint's folder, with what a deep check (every CRC32C) finds wrong."""
    storage = open_storage(uri)
    try:
        return {s.ref.folder: verify_deep(storage, s) for s in list_checkpoints(storage) if s.committed}
    finally:
        storage.close()


def hook(ckpt: Checkpointer, method: str, before: Callable[[], None], when: Callable[..., bool]) -> None:
    """Run ``before`` once, the first time ``ckpt``'s store calls ``method`` with arguments ``when`` accepts."""
    real, done = getattr(ckpt.storage, method), []

    def hooked(*args: Any, **kwargs: Any) -> Any:
        if not done and when(*args):
            done.append(True)
            before()
        return real(*args, **kwargs)

    setattr(ckpt.storage, method, hooked)


def test_the_loser_of_a_step_never_overwrites_the_winners_committed_files(storage_uri: str) -> None:
    """Writer 1 names step 1's folder; writer 2 saves step 1 whole; then writer 1 uploads. It
    uploaded into writer 2's committed folder: the checkpoint listed as valid failed every CRC32C
    (writer 1's commit then failed, too late). Now writer 2 saves beside writer 1's claimed folder
    and writer 1, the second to commit, fails naming writer 2."""
    ours, theirs = make_state(0), make_state(0, seed=7)
    train(ours, 1)
    train(theirs, 3)
    one = Checkpointer(storage_uri, keep=3, job="train", async_save=False)
    two = Checkpointer(storage_uri, keep=3, job="train", async_save=False)
    hook(one, "put_files", lambda: two.save(1, theirs), lambda files: True)
    with pytest.raises(SaveFailedError) as failed:
        one.save(1, ours)
    message = str(failed.value)
    assert "was committed meanwhile by job 'train' (attempt none" in message, message
    assert "Two Checkpointers of this process are saving to this URI" in message, message
    one.close()
    two.close()
    found = committed_and_whole(storage_uri)
    assert found == {"step-000000001.1": []}, found
    with Checkpointer(storage_uri, job="train") as reader:
        restored = make_state(0, seed=5)
        assert reader.restore(restored) == 1
    assert_same(snapshot(restored), snapshot(theirs))


def test_a_second_checkpointer_saving_a_step_the_first_committed_fails_and_the_first_copy_stays(
    storage_uri: str,
) -> None:
    """Two Checkpointers on one URI in one process (one per epoch, the old one never closed): the
    first commits step 5, then the second saves step 5. It committed step-5.1 without a word, and its
    retention removed the first's step-5 as an older copy of the step. Found walking the Checkpointer
    as a user. Now the second fails before writing anything, naming both writers as two
    Checkpointers of this process; the first's checkpoint stays whole. Once the first is closed, a
    new Checkpointer saving the step again (a restarted loop) goes beside it as before."""
    first, second = make_state(0), make_state(0, seed=7)
    train(first, 1)
    train(second, 3)
    one = Checkpointer(storage_uri, keep=3, job="train", async_save=False)
    two = Checkpointer(storage_uri, keep=3, job="train", async_save=False)
    one.save(5, first)
    with pytest.raises(SaveFailedError) as failed:
        two.save(5, second)
    message = str(failed.value)
    assert "step-000000005 was committed meanwhile by job 'train' (attempt none, committed at " in message, message
    assert "another Checkpointer of this process" in message and "this save is job 'train' (attempt none)" in message
    assert "Two Checkpointers of this process are saving to this URI" in message, message
    two.close()
    found = committed_and_whole(storage_uri)
    assert found == {"step-000000005": []}, found
    one.close()
    with Checkpointer(storage_uri, job="train") as reader:
        restored = make_state(0, seed=5)
        assert reader.restore(restored) == 5
        assert_same(snapshot(restored), snapshot(first))
        reader.save(5, second)
    found = committed_and_whole(storage_uri)
    assert found == {"step-000000005.1": []}, found


def test_of_two_checkpointers_committing_one_step_at_the_same_moment_the_second_fails(
    storage_uri: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two Checkpointers of one process save step 7 at once (each in its own folder, ``step-7`` and
    ``step-7.1``). Each checked that nobody had committed the step, then wrote its manifest: both
    passed the check before either manifest was in, both commits landed, and retention removed one
    copy with an ERROR saying the Checkpointer "never called restore()". Here both are held right
    after that check, until the other reaches it too (or a while passes: with the check and the
    commit done under one lock per URI, the other cannot reach it first). The second to commit
    now fails, naming the first, and one whole copy stays."""
    real = Checkpointer._check_still_mine
    met = threading.Barrier(2, timeout=5)

    def held(self: Checkpointer, save: Any, folder: str) -> None:
        real(self, save, folder)
        try:
            met.wait()  # both past the check before either commits, where the check allows it
        except threading.BrokenBarrierError:
            pass

    monkeypatch.setattr(Checkpointer, "_check_still_mine", held)
    first, second = make_state(0), make_state(0, seed=7)
    train(second, 3)
    one = Checkpointer(storage_uri, keep=3, job="train")
    two = Checkpointer(storage_uri, keep=3, job="train")
    one.save(7, first)
    two.save(7, second)
    failures = []
    for ckpt in (one, two):
        try:
            ckpt.wait()
        except SaveFailedError as e:
            failures.append(str(e))
    one.close()
    two.close()
    assert len(failures) == 1, failures
    assert "was committed meanwhile by job 'train' (attempt none" in failures[0], failures
    assert "Two Checkpointers of this process are saving to this URI" in failures[0], failures
    found = committed_and_whole(storage_uri)
    assert len(found) == 1 and list(found.values()) == [[]], found


def test_one_writers_retention_leaves_the_other_writers_save_in_flight(storage_uri: str) -> None:
    """Writer 1's save of step 1 is uploaded, its manifest not yet written, when writer 2 (keep=1)
    commits step 2: its retention removed step 1's folder as an unfinished save's leftover, and
    writer 1 then committed a manifest whose files were gone. Now retention leaves a folder another
    live writer claims, and both commits stay whole."""
    state = make_state(0)
    train(state, 2)
    one = Checkpointer(storage_uri, keep=3, job="train", async_save=False)
    two = Checkpointer(storage_uri, keep=1, job="train", async_save=False)
    hook(one, "put_bytes_if_absent", lambda: two.save(2, state), lambda key, data: key.endswith("/MANIFEST.json"))
    one.save(1, state)
    one.close()
    two.close()
    found = committed_and_whole(storage_uri)
    assert found == {"step-000000001": [], "step-000000002": []}, found


@pytest.mark.slow
def test_a_live_writer_in_another_process_keeps_its_folder_and_a_dead_ones_leftover_goes(
    storage_uri: str, tmp_path: Path
) -> None:
    """A torchrun job (unnamed, no attempt numbers) commits step 1 and is frozen with step 2's
    files uploaded and its manifest not yet written. A second writer of the job, this process,
    saved step 2 in the same folder: it removed the live job's files as a leftover. Now it saves
    beside them (``step-2.1``) and retention leaves them; once the job is killed (-9), its leftover
    is an unfinished save like any other, and this writer's next save removes it. One rank: the
    folder's claim names rank 0's process, the one frozen at the manifest; a second rank only
    added its shard to the folder and a torch start (about 3 CPU-s) per store."""
    uri = storage_uri
    storage = open_storage(uri)

    def files_of(folder: str) -> list[str]:
        return sorted(o.key.rsplit("/", 1)[-1] for o in storage.list(folder + "/"))

    markers = tmp_path / "markers"
    markers.mkdir()
    log = tmp_path / "job.log"
    job_args = ["interrupt", "--uri", uri, "--markers", str(markers), "--stage", "manifest"]
    proc = harness.start(harness.torchrun_argv(1, harness.SCRIPTS / "ckpt_job.py", job_args), log)
    try:
        expected = [markers / "manifest.rank0", markers / "pid.rank0"]
        harness.wait_for(
            lambda: all(p.exists() for p in expected), "rank 0 to freeze at the manifest", alive=proc, log_path=log
        )
        in_flight = files_of("step-000000002")
        assert "__0_0.distcp" in in_flight, in_flight
        state = make_state(0, seed=3)
        second = Checkpointer(uri, keep=1, async_save=False)
        assert second.restore(state) == 1
        train(state, 1, start=1)
        second.save(2, state)
        assert second.last_committed_uri is not None and second.last_committed_uri.endswith("/step-000000002.1")
        assert files_of("step-000000002") == in_flight
        harness.kill9(harness.read_pids(markers))
        harness.reap(proc)
        train(state, 1, start=2)
        second.save(3, state)
        second.close()
    finally:
        harness.kill9(harness.read_pids(markers))
        harness.stop(proc)
    assert committed_and_whole(uri) == {"step-000000003": []}
    assert files_of("step-000000002") == []
    storage.close()


def test_a_step_another_running_process_committed_too_is_said_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Two writers saving the same steps at the same moments each claim a folder and both commit
    (``step-N`` and ``step-N.1``, each whole): a duplicated job ran that way to its end with no
    word of the other. Now the commit's retention pass says so once, naming the other writer, when
    that writer still runs and committed the step after this save named its folder; a script
    re-saving the step it resumed from (its earlier copy committed before) is not told. The other
    writer is a second Checkpointer of this process whose claim is rewritten to name another
    process of this machine (a ``sleep``): its own saves in another process are not modelled."""
    import subprocess
    import time

    from agent.checkpoint import _claim

    uri = str(tmp_path / "ckpt")
    state = make_state(0)
    one = Checkpointer(uri, keep=3, job="train", async_save=False)
    two = Checkpointer(uri, keep=3, job="train", async_save=False)
    storage = open_storage(uri)
    running = subprocess.Popen(["sleep", "600"])

    def claimed_by_running(folder: str) -> None:
        started, machine = _claim._started(running.pid), _claim._machine()
        claim = _claim.Claim("other", "train", None, "vm", running.pid, started, machine, time.time())
        storage.put_bytes(f"{folder}/{_claim.CLAIM_NAME}", claim.to_json())

    caplog.set_level("ERROR", logger="agent.checkpoint")
    try:
        one.save(1, state)
        claimed_by_running("step-000000001")
        one.save(1, state)  # a re-save of a step committed before it named its folder
        assert one.last_committed_uri is not None and one.last_committed_uri.endswith("/step-000000001.1")
        assert "committed it too" not in caplog.text

        def the_other_commits_step_2() -> None:
            two.save(2, state)
            claimed_by_running("step-000000002.1")

        hook(one, "put_bytes_if_absent", the_other_commits_step_2, lambda key, data: key.endswith("/MANIFEST.json"))
        one.save(2, state)
        one.save(3, state)
    finally:
        running.kill()
        running.wait()
    assert one.last_committed_uri is not None and two.last_committed_uri is not None
    one.close()
    two.close()
    storage.close()
    said = [r.getMessage() for r in caplog.records if "committed it too" in r.getMessage()]
    assert len(said) == 1, said
    assert f"job 'train' (attempt none) on host 'vm', pid {running.pid} committed it too" in said[0], said
    assert "step-000000002.1: two processes are saving to this URI" in said[0], said


def test_a_folder_removed_before_its_claim_was_in_it_is_claimed_again(tmp_path: Path) -> None:
    """On a filesystem the claim's folder is made first, and another writer's clean-up can take
    it, still empty, for an unfinished save's leftover and remove it before the claim is written
    into it: seen with two 2-rank torchrun jobs saving steps 1-12 into one folder, the save then
    failed with "cannot write .../WRITER.json: No such file or directory". Now the folder is made
    and claimed again. The clean-up is injected at one seam (the store writing the claim's temp
    file removes the folder first), as the other writer's ``delete_prefix`` would."""
    import shutil

    uri = str(tmp_path / "ckpt")
    state = make_state(0)
    ckpt = Checkpointer(uri, keep=3, job="train", async_save=False)
    write_tmp, removed = ckpt.storage._write_tmp, []  # type: ignore[attr-defined]

    def removed_first(dest: str, data: bytes) -> str:
        if dest.endswith("WRITER.json") and not removed:
            removed.append(dest)
            shutil.rmtree(Path(dest).parent)
        return write_tmp(dest, data)

    ckpt.storage._write_tmp = removed_first  # type: ignore[attr-defined]
    ckpt.save(1, state)
    ckpt.close()
    assert removed and ckpt.last_committed_uri is not None
    assert committed_and_whole(uri) == {"step-000000001": []}


def test_another_writer_saving_other_steps_is_named_once_and_its_checkpoints_stay_while_it_runs(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Two writers saving different steps (a stale copy still training after its job restarted
    elsewhere, the same script started twice a few steps apart) both committed, neither was told,
    and each one's retention counted and removed the other's checkpoints as its own (``keep=1``
    here removed the other's step 3 at the next save). Now the writer that finds a checkpoint
    another process committed after it began saving names that process in one error (once for it,
    however many it commits), and its retention neither counts nor removes that writer's
    checkpoints while its process runs; once it is gone they are the job's like any other.

    A predecessor's checkpoint, committed before this writer began, is the job's history: not
    named, counted and removed as usual, and its claim never read (a restart costs no request).
    The other writer is a second Checkpointer of this process whose claims are rewritten to name
    another process of this machine (a ``sleep``), as in the test above."""
    import subprocess
    import time

    from agent.checkpoint import _claim

    uri = str(tmp_path / "ckpt")
    state = make_state(0)
    storage = open_storage(uri)
    running = subprocess.Popen(["sleep", "600"])
    two = Checkpointer(uri, keep=None, job="train", async_save=False)

    def theirs(step: int) -> None:
        two.save(step, state)
        assert two.last_committed_uri is not None
        folder = two.last_committed_uri.rsplit("/", 1)[-1]
        started, machine = _claim._started(running.pid), _claim._machine()
        claim = _claim.Claim(_claim.new_id(), "train", None, "vm", running.pid, started, machine, time.time())
        storage.put_bytes(f"{folder}/{_claim.CLAIM_NAME}", claim.to_json())

    def folders() -> set[str]:
        return {s.ref.folder for s in list_checkpoints(storage) if s.committed}

    claims_read: list[str] = []
    caplog.set_level("ERROR", logger="agent.checkpoint")
    try:
        theirs(1)  # the predecessor's
        one = Checkpointer(uri, keep=1, job="train", async_save=False)
        for method in ("stat", "get_bytes", "get_small"):
            real = getattr(one.storage, method)

            def recorded(key: str, *args: Any, real: Any = real, **kwargs: Any) -> Any:
                if key.endswith(_claim.CLAIM_NAME):
                    claims_read.append(key.split("/")[-2])
                return real(key, *args, **kwargs)

            setattr(one.storage, method, recorded)
        one.save(2, state)
        assert folders() == {"step-000000002"}
        assert not caplog.records, caplog.text
        theirs(3)
        one.save(4, state)
        assert folders() == {"step-000000003", "step-000000004"}
        theirs(5)
        one.save(6, state)
        assert folders() == {"step-000000003", "step-000000005", "step-000000006"}
    finally:
        running.kill()
        running.wait()
    one.save(7, state)
    assert folders() == {"step-000000007"}
    one.close()
    two.close()
    storage.close()
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1, said
    assert f"step-000000003 was committed by job 'train' (attempt none) on host 'vm', pid {running.pid}" in said[0]
    assert "Stop one of them" in said[0], said
    assert "step-000000001" not in claims_read, claims_read
    # Each other writer's claim read once, in one request (a stat and a read until 2026-12-06).
    assert claims_read.count("step-000000003") == 1 and claims_read.count("step-000000005") == 1, claims_read


def test_a_leftover_claimed_from_another_machine_goes_once_its_renewals_lapse_by_the_stores_clock(
    tmp_path: Path,
) -> None:
    """A save's leftover claimed from another machine stayed an hour, by the claim's own
    ``claimed_at`` against this writer's clock. A renewed claim (today's writers renew theirs while
    the save is in flight) now goes once the store wrote it ``LAPSES_AFTER_S`` ago, whatever
    either machine's clock says; a claim that is not renewed (spotjob up to 2026-12-05) keeps the
    hour. The store's time here is the claim file's mtime."""
    import os
    import time

    from agent.checkpoint import _claim

    uri = str(tmp_path / "ckpt")
    storage = open_storage(uri)
    now = time.time()
    lapsed = now - _claim.LAPSES_AFTER_S - 600  # under STALE_AFTER_S

    def leftover(folder: str, claim_id: str, claimed_at: float, written_at: float) -> None:
        claim = _claim.Claim(claim_id, "train", None, "vm-2", 4242, "123", "another-boot/pid:[1]", claimed_at)
        storage.put_bytes(f"{folder}/__0_0.distcp", b"half a shard")
        storage.put_bytes(f"{folder}/{_claim.CLAIM_NAME}", claim.to_json())
        os.utime(Path(uri) / folder / _claim.CLAIM_NAME, (written_at, written_at))

    leftover("step-000000001", _claim.new_id(), now, lapsed)  # its writer's clock ahead: the store's says lapsed
    leftover("step-000000002", _claim.new_id(), lapsed, now)  # its writer's clock behind: renewed just now
    leftover("step-000000003", "0123abcd", now, lapsed)  # not renewed: the hour by claimed_at
    ckpt = Checkpointer(uri, keep=3, job="train", async_save=False)
    ckpt.save(4, make_state(0))
    ckpt.close()
    left = {f for f in ("step-000000001", "step-000000002", "step-000000003") if (Path(uri) / f).exists()}
    assert left == {"step-000000002", "step-000000003"}, left
    storage.close()


def test_a_save_of_the_step_judges_a_leftover_claimed_from_another_machine_as_retention_does(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A save of step N judged another machine's renewed claim on an uncommitted ``step-N`` by its
    ``claimed_at`` against this writer's clock and the hour, where retention takes the store's
    clock and ``LAPSES_AFTER_S``: past the lapse, the save warned "Two processes are saving to
    this URI", committed to ``step-N.1``, and the same pass's retention removed ``step-N`` as dead.
    Now both judge it alike: a lapsed claim's folder is cleared and reused, without a warning; a
    claim the store wrote just now still gets the save beside it. The store's time here is the
    claim file's mtime (and a probe's)."""
    import os
    import time

    from agent.checkpoint import _claim

    uri = str(tmp_path / "ckpt")
    storage = open_storage(uri)
    now = time.time()
    lapsed = now - _claim.LAPSES_AFTER_S - 60  # under STALE_AFTER_S

    def leftover(folder: str, claimed_at: float, written_at: float) -> None:
        claim = _claim.Claim(_claim.new_id(), "train", None, "vm-2", 4242, "123", "another-boot/pid:[1]", claimed_at)
        storage.put_bytes(f"{folder}/__0_0.distcp", b"half a shard")
        storage.put_bytes(f"{folder}/{_claim.CLAIM_NAME}", claim.to_json())
        os.utime(Path(uri) / folder / _claim.CLAIM_NAME, (written_at, written_at))

    leftover("step-000000001", now - 1200, lapsed)  # claimed 20 min ago, last renewed past the lapse
    leftover("step-000000002", lapsed, now)  # its writer's clock behind: renewed just now
    caplog.set_level("WARNING", logger="agent.checkpoint")
    ckpt = Checkpointer(uri, keep=3, job="train", async_save=False)
    ckpt.save(1, make_state(0))
    assert ckpt.last_committed_uri is not None and ckpt.last_committed_uri.endswith("/step-000000001")
    assert not [r for r in caplog.records if "Two processes" in r.getMessage()], caplog.text
    ckpt.save(2, make_state(0))
    assert ckpt.last_committed_uri is not None and ckpt.last_committed_uri.endswith("/step-000000002.1")
    assert "Two processes are saving to this URI" in caplog.text, caplog.text
    ckpt.close()
    assert committed_and_whole(uri) == {"step-000000001": [], "step-000000002.1": []}
    assert (Path(uri) / "step-000000002" / "__0_0.distcp").exists(), "a live writer's folder is left alone"
    assert not list((Path(uri) / ".spotjob" / "probes").iterdir()), "the clock probe is deleted"
    storage.close()


def test_a_save_in_flight_renews_its_claim(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A save in flight longer than an hour could have its folder removed by another writer of the
    URI on another machine, which took its claim for a dead writer's. Now the save's claim is
    renewed while its files are written and uploaded (the period shortened here: every 5 minutes
    in a real save, so a save of seconds never renews), and the commit keeps it."""
    import time

    from agent.checkpoint import _claim

    monkeypatch.setattr(_claim, "RENEW_EVERY_S", 0.02)
    uri = str(tmp_path / "ckpt")
    storage = open_storage(uri)
    ckpt = Checkpointer(uri, job="train", async_save=False)
    seen: list[_claim.Claim | None] = []

    def renewed_meanwhile() -> None:
        first = _claim.read_claim(storage, "step-000000001")
        assert first is not None
        deadline = time.monotonic() + 60
        while (now := _claim.read_claim(storage, "step-000000001")) == first and time.monotonic() < deadline:
            time.sleep(0.01)
        seen[:] = [first, now]

    hook(ckpt, "put_files", renewed_meanwhile, lambda files: True)
    ckpt.save(1, make_state(0))
    ckpt.close()
    first, now = seen
    assert first is not None and now is not None and first.renewed
    assert now.id == first.id and now.claimed_at > first.claimed_at, (first, now)
    assert committed_and_whole(uri) == {"step-000000001": []}
    storage.close()


def test_a_step_committed_too_on_another_machine_by_a_process_of_this_ones_pid_is_said(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Containers number their processes alike (a training script is often the same pid on every
    node), and the commit of a step by another writer was passed over when its claim named this
    process's pid, whatever machine it named: the two commits of a step went unsaid. Now only a
    claim of this very process (same machine, pid and start) is passed over."""
    import os
    import time

    from agent.checkpoint import _claim

    uri = str(tmp_path / "ckpt")
    state = make_state(0)
    one = Checkpointer(uri, keep=3, job="train", async_save=False)
    two = Checkpointer(uri, keep=3, job="train", async_save=False)
    storage = open_storage(uri)

    def the_other_commits_step_1() -> None:
        two.save(1, state)
        claim = _claim.Claim(_claim.new_id(), "train", None, "vm-2", os.getpid(), "123", "other/pid:[1]", time.time())
        storage.put_bytes(f"step-000000001.1/{_claim.CLAIM_NAME}", claim.to_json())

    caplog.set_level("ERROR", logger="agent.checkpoint")
    hook(one, "put_bytes_if_absent", the_other_commits_step_1, lambda key, data: key.endswith("/MANIFEST.json"))
    one.save(1, state)
    one.close()
    two.close()
    storage.close()
    said = [r.getMessage() for r in caplog.records if "committed it too" in r.getMessage()]
    assert len(said) == 1 and f"on host 'vm-2', pid {os.getpid()} committed it too" in said[0], caplog.text
