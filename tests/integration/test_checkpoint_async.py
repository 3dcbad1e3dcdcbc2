"""Asynchronous saves: failures surface on the next call, one save at a time, sync mode, bad keys.

One process on the filesystem store; faults are injected by replacing methods on the
Checkpointer's own Storage object, the seam every backend shares.
"""

from __future__ import annotations

import contextlib
import io
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from agent.catalog import list_checkpoints
from agent.checkpoint import Checkpointer, MissingStateKeysError, SaveFailedError
from agent.manifest import MANIFEST_NAME
from agent.storage import PermanentStorageError

sys.path.insert(0, str(Path(__file__).resolve().parent / "scripts"))
from ckpt_compare import assert_same
from ckpt_state import make_state, snapshot, train

BOUND_S = 120.0  # only stops a hung test; nothing here asserts how long anything took


def deny_uploads(ckpt: Checkpointer) -> None:
    def put_file(local_path: str, key: str, **kw: Any) -> None:
        raise PermanentStorageError(f"AccessDenied writing {key}", key)

    ckpt.storage.put_file = put_file  # type: ignore[method-assign]


def committed_steps(ckpt: Checkpointer) -> list[int]:
    return sorted(s.ref.step for s in list_checkpoints(ckpt.storage) if s.committed)


@pytest.mark.parametrize("next_call", ["step", "save", "restore", "close"])
def test_a_failed_background_save_raises_on_the_next_call(next_call: str, tmp_path: Path) -> None:
    state = make_state(0)
    ckpt = Checkpointer(str(tmp_path / "ckpt"), keep=None)
    deny_uploads(ckpt)
    train(state, 1)
    ckpt.save(1, state)  # returns once staged; the upload fails in the background

    n = 2
    with pytest.raises(SaveFailedError, match=r"step 1.*AccessDenied"):
        if next_call == "step":
            deadline = time.monotonic() + BOUND_S
            while time.monotonic() < deadline:  # the first step() after the failure raises
                ckpt.step(n, state)
                n += 1
                time.sleep(0.01)
        elif next_call == "save":
            ckpt.save(2, state)
        elif next_call == "restore":
            ckpt.restore(make_state(0, seed=5))
        else:
            ckpt.close()

    assert committed_steps(ckpt) == []
    assert ckpt.storage.stat(f"step-000000001/{MANIFEST_NAME}") is None
    if next_call != "close":
        # Reported once; the job carries on and the next save commits.
        del ckpt.storage.put_file
        later = max(5, n)  # steps never go back: past every step() the loop above reported
        ckpt.save(later, state)
        ckpt.close()
        assert committed_steps(ckpt) == [later]


def test_a_restore_right_after_a_save_waits_for_it_and_loads_it(tmp_path: Path) -> None:
    """The save of step 2 is still uploading when restore() is called: loading step 1 then would
    roll the state back while step 2 commits beside it, so a later restart resumes from step 2 of
    the abandoned timeline."""
    state = make_state(0)
    ckpt = Checkpointer(str(tmp_path / "ckpt"), keep=None)
    train(state, 1)
    ckpt.save(1, state)
    ckpt.wait()
    train(state, 1, start=1)
    saved = snapshot(state)
    released = threading.Event()
    put_file = ckpt.storage.put_file

    def held_put_file(*args: Any, **kwargs: Any) -> None:
        released.wait(BOUND_S)
        put_file(*args, **kwargs)

    ckpt.storage.put_file = held_put_file  # type: ignore[method-assign]
    ckpt.save(2, state)  # returns once staged; the upload waits for the timer below
    threading.Timer(0.5, released.set).start()  # not an assertion: only lets the upload go on
    fresh = make_state(0, seed=5)
    try:
        assert ckpt.restore(fresh) == 2
    finally:
        released.set()
        ckpt.close()
    assert_same(snapshot(fresh), saved, "the state restored right after saving it")


def test_an_unexpected_error_in_the_save_thread_is_raised_not_hung_on(tmp_path: Path) -> None:
    state = make_state(0)
    ckpt = Checkpointer(str(tmp_path / "ckpt"), keep=None)

    def broken_listing(prefix: str = "") -> list[str]:
        raise RuntimeError("the storage client blew up")

    ckpt.storage.list_dirs = broken_listing  # type: ignore[method-assign]
    ckpt.save(1, state)
    outcome: list[BaseException | None] = []

    def close() -> None:
        try:
            ckpt.close()
            outcome.append(None)
        except BaseException as e:
            outcome.append(e)

    closer = threading.Thread(target=close, daemon=True)
    closer.start()
    closer.join(BOUND_S)
    assert not closer.is_alive(), "close() hung on a save thread that died"
    assert isinstance(outcome[0], SaveFailedError) and "blew up" in str(outcome[0])


def test_at_most_one_save_is_in_flight(tmp_path: Path) -> None:
    state = make_state(0)
    ckpt = Checkpointer(str(tmp_path / "ckpt"), keep=None)
    events: list[str] = []
    gate = threading.Event()
    put_file, commit = ckpt.storage.put_file, ckpt.storage.put_bytes_if_absent

    def gated_put_file(local_path: str, key: str, **kw: Any) -> None:
        events.append(f"put {key}")
        if key.startswith("step-000000001/"):
            gate.wait(BOUND_S)
        put_file(local_path, key, **kw)

    def recorded_commit(key: str, data: bytes) -> None:
        events.append(f"commit {key}")
        commit(key, data)

    ckpt.storage.put_file = gated_put_file  # type: ignore[method-assign]
    ckpt.storage.put_bytes_if_absent = recorded_commit  # type: ignore[method-assign]
    ckpt.save(1, state)
    train(state, 1)
    second = threading.Thread(target=ckpt.save, args=(2, state))
    second.start()
    # While step 1's upload is held, the second save must wait: no step-2 write may start.
    second.join(1.0)
    assert second.is_alive(), "save(2) returned while save(1) was still uploading"
    assert not any("step-000000002/" in e for e in events)
    gate.set()
    second.join(BOUND_S)
    ckpt.close()

    first_commit = events.index(f"commit step-000000001/{MANIFEST_NAME}")
    assert not any("step-000000002/" in e for e in events[:first_commit])
    assert committed_steps(ckpt) == [1, 2]


def test_sync_mode_commits_before_save_returns_and_raises_from_save(tmp_path: Path) -> None:
    state = make_state(0)
    before = threading.active_count()
    with Checkpointer(str(tmp_path / "ckpt"), keep=None, async_save=False) as ckpt:
        train(state, 2)
        ckpt.save(2, state)
        assert threading.active_count() == before, "sync mode started a background thread"
        assert ckpt.storage.stat(f"step-000000002/{MANIFEST_NAME}") is not None
        assert ckpt.last_committed_step == 2
        saved = snapshot(state)

        deny_uploads(ckpt)
        with pytest.raises(SaveFailedError, match="AccessDenied"):
            ckpt.save(3, state)
        assert committed_steps(ckpt) == [2]
        del ckpt.storage.put_file

    fresh = make_state(0, seed=4)
    with Checkpointer(str(tmp_path / "ckpt"), async_save=False) as again:
        assert again.restore(fresh) == 2
    assert_same(snapshot(fresh), saved, "the state restored in sync mode")


def test_missing_state_keys_error_names_the_missing_keys(tmp_path: Path) -> None:
    state = make_state(0)
    with Checkpointer(str(tmp_path / "ckpt")) as ckpt:
        ckpt.save(1, {"model": state["model"], "optim": state["optim"]})

    with (
        Checkpointer(str(tmp_path / "ckpt")) as again,
        pytest.raises(MissingStateKeysError, match=r"\['counter', 'sched'\]"),
    ):
        again.restore(make_state(0, seed=2))


def test_each_manifest_records_what_started_its_save(tmp_path: Path) -> None:
    state = make_state(0)
    with Checkpointer(str(tmp_path / "ckpt"), every_steps=1, keep=None) as ckpt:
        train(state, 1)
        ckpt.step(1, state)
        train(state, 1, start=1)
        ckpt.save(2, state)
    triggers = {s.ref.step: s.manifest.trigger for s in list_checkpoints(ckpt.storage) if s.manifest}
    assert triggers == {1: "policy", 2: "save"}


CRASH_AFTER_CLOSE = """
import sys, torch
from agent import Checkpointer
ckpt = Checkpointer(sys.argv[1], control_dir=sys.argv[2])
ckpt.step(1, {"model": torch.nn.Linear(2, 2)})
ckpt.close()
if sys.argv[3] == "crash":
    raise OSError("writing the results failed")
if sys.argv[3] == "child-crash":
    import os
    child = os.fork()
    if child == 0:
        raise OSError("a forked worker failed")  # the child's own crash, through its excepthook
    os.waitpid(child, 0)
"""


@pytest.mark.parametrize("ending", ["clean", "crash", "child-crash"])
def test_a_rank_is_reported_closed_only_if_nothing_raised_after_close(tmp_path: Path, ending: str) -> None:
    """The agent forgives an abort at interpreter exit only after a clean close(); a traceback
    after close() (e.g. writing results) must stay a failure. A child the script forks after
    close() that dies of its own exception is not the rank: its mark stays."""
    import subprocess

    control = tmp_path / "control"
    proc = subprocess.run(
        [sys.executable, "-c", CRASH_AFTER_CLOSE, str(tmp_path / "ckpt"), str(control), ending],
        capture_output=True,
        text=True,
        timeout=BOUND_S,
    )
    closed = sorted(p.name for p in control.glob("closed-rank-*"))
    if ending != "crash":
        assert proc.returncode == 0, proc.stderr
        assert closed == ["closed-rank-0"]
    else:
        assert proc.returncode != 0 and "writing the results failed" in proc.stderr
        assert closed == []


def test_closing_many_checkpointers_under_an_agent_adds_one_exception_hook(tmp_path: Path, monkeypatch: Any) -> None:
    """A script that builds a Checkpointer per phase (or per evaluation) under spotjob-agent
    chained one more hook per close(); every one of them runs on a crash, nested, and past
    Python's recursion limit the hook itself fails."""
    from agent.checkpoint import checkpointer

    monkeypatch.setattr(sys, "excepthook", sys.excepthook)  # restored after the test
    monkeypatch.setattr(checkpointer, "_closed_marks", {}, raising=False)
    monkeypatch.setattr(checkpointer, "_crash_hook", None, raising=False)
    control = tmp_path / "control"
    hooks = []
    for n in range(3):
        with Checkpointer(str(tmp_path / "ckpt"), control_dir=str(control)) as ckpt:
            ckpt.save(n, {"model": torch.nn.Linear(2, 2)})
        hooks.append(sys.excepthook)
    assert hooks[0] is hooks[1] is hooks[2], "each close() added an exception hook"
    assert sorted(p.name for p in control.glob("closed-rank-*")) == ["closed-rank-0"]
    try:
        raise OSError("writing the results failed")
    except OSError as e:
        with contextlib.redirect_stderr(io.StringIO()):
            sys.excepthook(type(e), e, e.__traceback__)
    assert list(control.glob("closed-rank-*")) == [], "a crash after close() must stay a failure"


def test_a_flush_gives_up_a_save_still_writing_and_commits_its_own_step(tmp_path: Path, monkeypatch: Any) -> None:
    """The save in flight holds an older step; the flush does not wait for it to finish writing."""
    from agent import _dcp_write
    from agent.control_channel import ControlDir, FlushRequest

    state = make_state(0)
    control = tmp_path / "control"
    ckpt = Checkpointer(str(tmp_path / "ckpt"), keep=None, control_dir=str(control))
    write_block = _dcp_write.ChecksummedFile._out
    held = threading.Event()

    def held_until_given_up(self: Any, view: memoryview) -> None:
        # The background save of step 1 cannot get past its first block unless it is given up.
        if self._cancel is not None and "step-000000001" in self.path:
            held.set()
            deadline = time.monotonic() + BOUND_S
            while not self._cancel.is_set() and time.monotonic() < deadline:
                time.sleep(0.01)
        write_block(self, view)

    monkeypatch.setattr(_dcp_write.ChecksummedFile, "_out", held_until_given_up)
    train(state, 1)
    ckpt.save(1, state)
    assert held.wait(BOUND_S), "the save of step 1 never started writing"
    ControlDir(str(control)).request_flush(FlushRequest(reason="test notice"))
    train(state, 1, start=1)
    assert ckpt.step(2, state) is True
    saved = snapshot(state)
    ckpt.close()

    assert committed_steps(ckpt) == [2]
    flushed = ControlDir(str(control)).flush_result()
    assert flushed is not None and flushed.step == 2 and flushed.error is None
    fresh = make_state(0, seed=5)
    with Checkpointer(str(tmp_path / "ckpt")) as again:
        assert again.restore(fresh) == 2
    assert_same(snapshot(fresh), saved, "the flushed state")


@pytest.mark.parametrize("async_save", [False, True])
def test_a_flush_at_a_step_already_committed_writes_nothing_more(tmp_path: Path, async_save: bool) -> None:
    """``save(2)`` committed (synchronously, or waited for), then the notice, then ``step(2)``: the
    checkpoint of step 2 is the flush's; writing the same state again would only spend the
    notice's window (a second full save, as ``step-000000002.1``)."""
    from agent.control_channel import ControlDir, FlushRequest

    state = make_state(0)
    control = tmp_path / "control"
    ckpt = Checkpointer(str(tmp_path / "ckpt"), keep=None, control_dir=str(control), async_save=async_save)
    train(state, 2)
    ckpt.save(2, state)
    ckpt.wait()
    committed = ckpt.last_committed_uri
    ControlDir(str(control)).request_flush(FlushRequest(reason="test notice"))
    assert ckpt.step(2, state) is True
    ckpt.close()

    assert [s.ref.folder for s in list_checkpoints(ckpt.storage)] == ["step-000000002"]
    flushed = ControlDir(str(control)).flush_result()
    assert flushed is not None and flushed.error is None
    assert (flushed.step, flushed.uri) == (2, committed)


@pytest.mark.parametrize("release", [False, True])
def test_staging_buffers_are_kept_between_saves_unless_released(tmp_path: Path, release: bool) -> None:
    state = make_state(0)
    with Checkpointer(str(tmp_path / "ckpt"), keep=None, release_staging=release) as ckpt:
        train(state, 1)
        ckpt.save(1, state)
        ckpt.wait()
        kept = ckpt._stager
        assert (kept is None) == release
        train(state, 1, start=1)
        ckpt.save(2, state)
        ckpt.wait()
        assert ckpt._stager is (None if release else kept)
        saved = snapshot(state)
    assert committed_steps(ckpt) == [1, 2]
    fresh = make_state(0, seed=6)
    with Checkpointer(str(tmp_path / "ckpt")) as again:
        assert again.restore(fresh) == 2
    assert_same(snapshot(fresh), saved, "the state staged into released buffers")


def test_async_saves_into_kept_buffers_restore_the_last_state_bit_for_bit(tmp_path: Path) -> None:
    """Every async save after a Checkpointer's first copies the state into the buffers the first
    allocated (``stage_state``'s plain path, which this state takes): a restore brings back the
    last save's values bit for bit, not an earlier save's, a buffer that is a transposed view of a
    trained weight included (two tensors of one storage, staged as views of one buffer). The
    values pin what DCP's stager already did; they fail with a plain path that skips the copy
    into a kept buffer."""

    def with_view(state: dict[str, Any]) -> dict[str, Any]:
        state["model"][0].register_buffer("weight_t", state["model"][0].weight.detach().t())
        return state

    state = with_view(make_state(0))
    with Checkpointer(str(tmp_path / "ckpt"), keep=None) as ckpt:
        for step in (1, 2, 3):
            train(state, 1, start=step - 1)
            ckpt.save(step, state)
            ckpt.wait()
        kept = ckpt._stager._state_dict_stager._stage_untyped_storage
        assert kept.plain and kept.plain_state, "the plain path staged these saves"
        saved = snapshot(state)
    fresh = with_view(make_state(0, seed=6))
    with Checkpointer(str(tmp_path / "ckpt")) as again:
        assert again.restore(fresh) == 3
    assert_same(snapshot(fresh), saved, "the last of three async saves")
    assert torch.equal(fresh["model"][0].weight_t, fresh["model"][0].weight.t())


def test_the_save_thread_starts_its_work_only_once_step_returns(tmp_path: Path) -> None:
    """The save's own work (naming its folder, planning, writing) waits until the ``step()`` that
    started it returns: started at once, it held the GIL while ``step()`` still ran, and the
    training thread waited a switch interval (5 ms) for it. What ``step()`` does after starting the
    save (here: its status report) sees no storage call of the save, however long it takes; the
    state is trained on right after ``step()`` returns, and the checkpoint holds it as it was at
    the step."""
    state = make_state(0)
    ckpt = Checkpointer(str(tmp_path / "ckpt"), every_steps=1, keep=None)
    ckpt.step(1, state)  # the first save allocates the staging buffers
    ckpt.wait()
    touched = threading.Event()
    list_dirs = ckpt.storage.list_dirs

    def watched_list_dirs(*args: Any, **kwargs: Any) -> Any:
        touched.set()
        return list_dirs(*args, **kwargs)

    ckpt.storage.list_dirs = watched_list_dirs  # type: ignore[method-assign]
    seen_in_step: list[bool] = []
    report = ckpt._report

    def slow_report(force: bool = False) -> None:
        if threading.current_thread() is threading.main_thread():  # step()'s own call
            time.sleep(0.2)  # not an assertion: lets a save thread that was let go reach the store
            seen_in_step.append(touched.is_set())
        report(force)

    ckpt._report = slow_report  # type: ignore[method-assign]
    train(state, 1, start=1)
    saved = snapshot(state)
    ckpt.step(2, state)
    del ckpt._report
    train(state, 1, start=2)  # the training thread changes the tensors right after step()
    ckpt.wait()
    ckpt.close()
    assert seen_in_step == [False], "the save thread touched the store before step() returned"
    assert touched.is_set(), "the save named its folder after step() returned"
    fresh = make_state(0, seed=7)
    with Checkpointer(str(tmp_path / "ckpt")) as again:
        assert again.restore(fresh) == 2
    assert_same(snapshot(fresh), saved, "the state at the step whose save started in step()")


def test_a_save_started_by_a_step_that_then_raised_still_commits(tmp_path: Path) -> None:
    """``step()`` raised after starting its save (here its status report): the save thread is let
    go all the same, and commits without any further call to wait for it."""
    state = make_state(0)
    ckpt = Checkpointer(str(tmp_path / "ckpt"), every_steps=1, keep=None)

    def broken_report(force: bool = False) -> None:
        raise RuntimeError("the report blew up")

    ckpt._report = broken_report  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="blew up"):
        ckpt.step(1, state)
    deadline = time.monotonic() + BOUND_S  # only stops a hung test
    while committed_steps(ckpt) != [1] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert committed_steps(ckpt) == [1], "the save of a step() that raised never ran"
    del ckpt._report
    ckpt.close()


def test_release_staging_from_the_environment_reaches_a_checkpointer_built_directly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``SPOTJOB_RELEASE_STAGING=1`` (README "Staging memory", the remedy for a memory limit a
    save's copy exceeds) frees the buffers of ``Checkpointer(uri, ...)`` as it does those of
    ``from_env()``, as ``SPOTJOB_DIRECT_IO`` does; an explicit ``release_staging=False`` still wins."""
    monkeypatch.setenv("SPOTJOB_RELEASE_STAGING", "1")
    state = make_state(0)
    for explicit, released in ((None, True), (False, False)):
        kwargs = {} if explicit is None else {"release_staging": explicit}
        with Checkpointer(str(tmp_path / f"ckpt-{explicit}"), keep=None, **kwargs) as ckpt:
            train(state, 1)
            ckpt.save(1, state)
            ckpt.wait()
            assert (ckpt._stager is None) == released, kwargs


def test_spotjob_async_from_the_environment_reaches_a_checkpointer_built_directly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``spotjob-agent --async off`` (``SPOTJOB_ASYNC=0``; the other remedy of README "Staging
    memory" for a memory limit an async save's copy exceeds) makes the saves of
    ``Checkpointer(uri, ...)`` synchronous as it does those of ``from_env()``: committed when
    ``save()`` returns. An explicit ``async_save=True`` still wins."""
    monkeypatch.setenv("SPOTJOB_ASYNC", "0")
    state = make_state(0)
    with Checkpointer(str(tmp_path / "ckpt")) as ckpt:
        assert ckpt.config.async_save is False
        train(state, 1)
        ckpt.save(1, state)
        assert ckpt.last_committed_step == 1  # a synchronous save has committed on return
    with Checkpointer(str(tmp_path / "other"), async_save=True) as ckpt:
        assert ckpt.config.async_save is True


EXIT_WITH_A_SAVE_IN_FLIGHT = """
import sys, time, torch
from agent import Checkpointer
from agent.checkpoint import _save

real_dcp_save = _save.dcp_save

def dcp_save_later(*args, **kwargs):
    time.sleep(1.0)  # the main thread is past its last line by now
    return real_dcp_save(*args, **kwargs)

_save.dcp_save = dcp_save_later
ckpt = Checkpointer(sys.argv[1], every_steps=1)
ckpt.step(1, {"model": torch.nn.Linear(2, 2)})
if sys.argv[2] == "crash":
    raise RuntimeError("the training loop crashed")
"""


@pytest.mark.parametrize("ending", ["crash", "no-close"])
def test_a_save_in_flight_when_the_script_ends_is_committed_before_the_process_exits(
    tmp_path: Path, ending: str
) -> None:
    """Python refuses new thread-pool work once it starts to exit, before it joins the save thread:
    the save in flight then failed ("cannot schedule new futures after interpreter shutdown", seen
    in CI after a crash at step 12 with step 10's save writing) and the run resumed from an older
    checkpoint. The save is waited for first, whether the script crashed or forgot close()."""
    import subprocess

    uri = tmp_path / "ckpt"
    proc = subprocess.run(
        [sys.executable, "-c", EXIT_WITH_A_SAVE_IN_FLIGHT, str(uri), ending],
        capture_output=True,
        text=True,
        timeout=BOUND_S,
    )
    if ending == "crash":
        assert proc.returncode == 1 and "the training loop crashed" in proc.stderr, proc.stderr
    else:
        assert proc.returncode == 0, proc.stderr
    assert "cannot schedule new futures" not in proc.stderr, proc.stderr
    with Checkpointer(str(uri)) as again:
        assert committed_steps(again) == [1], proc.stderr


FORK_WITH_A_SAVE_IN_FLIGHT = """
import multiprocessing, sys, time, torch
from agent import Checkpointer
from agent.checkpoint import _save

real_dcp_save = _save.dcp_save

def dcp_save_later(*args, **kwargs):
    time.sleep(2.0)
    return real_dcp_save(*args, **kwargs)

def worker():
    pass  # a data-loader worker, say: forked while the save writes, ends at once

if __name__ == "__main__":
    _save.dcp_save = dcp_save_later
    ckpt = Checkpointer(sys.argv[1], every_steps=1)
    ckpt.step(1, {"model": torch.nn.Linear(2, 2)})
    child = multiprocessing.get_context("fork").Process(target=worker)
    child.start()
    child.join(60)  # only stops a hung child
    if child.is_alive():
        child.kill()
        child.join()
    print("child exit code", child.exitcode, flush=True)
    ckpt.close()
"""


def test_a_process_forked_while_a_save_is_in_flight_does_not_wait_for_it_at_its_exit(tmp_path: Path) -> None:
    """A forked child (a data-loader worker) inherits the exit hook but not the save thread: it
    must not wait for a save that only its parent runs."""
    import subprocess

    script = tmp_path / "fork_during_save.py"
    script.write_text(FORK_WITH_A_SAVE_IN_FLIGHT)
    proc = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "ckpt")], capture_output=True, text=True, timeout=BOUND_S
    )
    assert proc.returncode == 0, proc.stderr
    assert "child exit code 0" in proc.stdout, (proc.stdout, proc.stderr)
