"""Two guards of the reconciler, on the fake clock: a started attempt whose workers do not start
says so once (``WorkerNotStarting``, ``status.attempt.notStarting``), and a job whose
``spec.checkpoint.uri`` changed under it (a cluster that does not evaluate the CRD's CEL rule) is
Invalid rather than resumed from, or started fresh in, another store."""

from __future__ import annotations

from typing import Any

from fakes import commit_checkpoint
from test_reconciler import edit_document, make_world, phase_is, running_attempt

from agent.catalog import folder_name
from agent.manifest import rank_file_name
from agent.ownership import adopt, attempt_records
from agent.storage import open_storage
from orchestrator.events import EventType
from orchestrator.model import Phase
from orchestrator.store import JsonFileJobStore

PULL = ("ImagePullBackOff", 'Back-off pulling image "train:typo"')


def test_a_pending_job_says_its_workers_started_and_once_per_attempt_why_one_does_not(tmp_path: Any) -> None:
    w = make_world(tmp_path)
    w.backend.not_starting["train-0-1"] = PULL

    w.reconcile()
    status = w.status
    assert (status.phase, status.reason) == (Phase.PENDING, "WorkersStarted")
    assert "started 2 worker(s) of attempt 0" in status.message

    status = w.run_to(120)
    assert status.phase is Phase.PENDING
    stuck = status.attempt.not_starting
    assert stuck is not None and (stuck.worker, stuck.reason) == ("train-0-1", "ImagePullBackOff")
    assert "train:typo" in stuck.message
    warnings = [e for e in w.events.emitted if e.reason == "WorkerNotStarting"]
    assert len(warnings) == 1, "once per attempt, not once per pass"
    assert warnings[0].type is EventType.WARNING and "ImagePullBackOff" in warnings[0].message

    w.backend.not_starting["train-0-1"] = ("ErrImagePull", "manifest unknown")
    status = w.run_to(200)
    assert status.attempt.not_starting is not None and status.attempt.not_starting.reason == "ErrImagePull"
    assert status.attempt.not_starting.since == stuck.since, "the same trouble, still"
    assert w.event_reasons().count("WorkerNotStarting") == 1

    del w.backend.not_starting["train-0-1"]  # the image was fixed (pushed)
    status = w.run_until(running_attempt(0))
    assert status.attempt.not_starting is None


def test_the_next_attempt_that_does_not_start_says_so_again(tmp_path: Any) -> None:
    w = make_world(tmp_path)
    w.run_until(running_attempt(0))
    w.backend.notice("n0")
    w.run_until(phase_is(Phase.RESCHEDULING))
    w.backend.not_starting["train-1-0"] = PULL
    status = w.run_to(w.clock.at() + 120)
    assert status.attempt.number == 1 and status.attempt.not_starting is not None
    assert status.reason != "WorkersStarted", "a restart is Rescheduling, and says why"
    assert w.event_reasons().count("WorkerNotStarting") == 1


def not_starting_warnings(w: Any) -> list[str]:
    return [e.message for e in w.events.emitted if e.reason == "WorkerNotStarting"]


def test_waiting_for_a_node_is_no_warning_until_it_lasts_ten_minutes(tmp_path: Any) -> None:
    """An autoscaling cluster brings a node up for every restart: the worker is Unschedulable for a
    minute or two, every attempt. That shows in the status, but a Warning Event only once the wait
    is longer than a node takes to come (it used to be told at once, on every attempt)."""
    w = make_world(tmp_path)
    nodes, w.backend.nodes = list(w.backend.nodes), []
    status = w.run_to(120)
    stuck = status.attempt.not_starting
    assert stuck is not None and stuck.reason == "Unschedulable" and not stuck.warned
    assert not_starting_warnings(w) == []
    w.backend.nodes = nodes  # the autoscaler's node came
    w.run_until(running_attempt(0))
    assert not_starting_warnings(w) == []

    w.backend.notice("n0")
    w.run_until(phase_is(Phase.RESCHEDULING))
    w.backend.nodes = []
    status = w.run_to(w.clock.at() + 660)
    assert status.attempt.number == 1
    warnings = not_starting_warnings(w)
    assert len(warnings) == 1 and "Unschedulable" in warnings[0] and "min)" in warnings[0], warnings
    assert status.attempt.not_starting is not None and status.attempt.not_starting.warned
    w.run_to(w.clock.at() + 600)
    assert len(not_starting_warnings(w)) == 1, "once per attempt"


def test_an_image_that_cannot_be_pulled_once_a_node_came_is_warned_about(tmp_path: Any) -> None:
    """The worker waited for a node (no Warning yet), then the node came and its image cannot be
    pulled: that is what the Warning names (it used to name the wait, told at once, and the pull
    failure was never told)."""
    w = make_world(tmp_path)
    nodes, w.backend.nodes = list(w.backend.nodes), []
    w.run_to(90)
    w.backend.nodes = nodes
    w.backend.not_starting["train-0-0"] = PULL
    status = w.run_to(200)
    warnings = not_starting_warnings(w)
    assert len(warnings) == 1 and "ImagePullBackOff" in warnings[0] and "train:typo" in warnings[0], warnings
    stuck = status.attempt.not_starting
    assert stuck is not None and stuck.reason == "ImagePullBackOff" and stuck.warned


def test_with_a_start_timeout_capacity_unavailable_tells_the_wait_not_worker_not_starting(tmp_path: Any) -> None:
    w = make_world(tmp_path, startTimeoutSeconds=60)
    w.backend.nodes = []
    status = w.run_to(900)
    assert status.condition("CapacityUnavailable") is not None
    assert w.event_reasons().count("CapacityUnavailable") == 1
    assert not_starting_warnings(w) == []


def test_a_checkpoint_uri_changed_under_the_job_makes_it_invalid_and_touches_neither_store(tmp_path: Any) -> None:
    world = make_world(tmp_path)
    status = world.run_until(running_attempt(0))
    assert status.checkpoint_uri == world.spec.checkpoint.uri
    assert isinstance(world.store, JsonFileJobStore)
    elsewhere = str(tmp_path / "elsewhere")
    edit_document(world.store, world.key, lambda doc: doc["spec"]["checkpoint"].update(uri=elsewhere))

    created = list(world.backend.created)
    world.clock.sleep(10)
    result = world.reconcile()

    status = world.status
    invalid = status.condition("Invalid")
    assert invalid is not None and invalid.status == "True" and invalid.reason == "InvalidSpec"
    assert "spec.checkpoint.uri: changed from" in invalid.message and elsewhere in invalid.message
    assert "immutable" in invalid.message
    assert status.checkpoint_uri == world.spec.checkpoint.uri, "the job's store is still the first one"
    assert result.requeue_after is None and world.backend.created == created and world.backend.stop_calls == []
    assert not (tmp_path / "elsewhere").exists(), "nothing claimed or started in the new store"
    assert world.event_reasons()[-1] == "InvalidSpec"

    # Set back: the job carries on where it was.
    edit_document(world.store, world.key, lambda doc: doc["spec"]["checkpoint"].update(uri=world.spec.checkpoint.uri))
    world.clock.sleep(10)
    world.reconcile()
    assert world.status.condition("Invalid").status == "False"  # type: ignore[union-attr]
    assert world.status.phase is Phase.RUNNING


def test_a_newest_checkpoint_that_no_longer_loads_is_warned_about_once_naming_why_and_where_the_job_resumes(
    tmp_path: Any,
) -> None:
    """The status recorded step 50; then a file of it was damaged (and later every checkpoint was
    removed). The status went back without a word, and `spotjob run --resume`'s Resumed Event said
    the next attempt starts from the recorded step while it started from an older one, or from
    scratch. Found walking the CLI as a user."""
    w = make_world(tmp_path)
    w.run_until(running_attempt(0))
    commit_checkpoint(w.storage, 40, w.clock.now())
    commit_checkpoint(w.storage, 50, w.clock.now())
    status = w.run_to(w.clock.at() + 10)
    assert status.last_checkpoint is not None and status.last_checkpoint.step == 50
    assert "CheckpointUnusable" not in w.event_reasons()

    w.storage.put_bytes(f"{folder_name(50)}/{rank_file_name(0)}", b"cut")  # shorter than its manifest says
    status = w.run_to(w.clock.at() + 10)
    assert status.last_checkpoint is not None and status.last_checkpoint.step == 40
    [told] = [e for e in w.events.emitted if e.reason == "CheckpointUnusable"]
    assert told.type is EventType.WARNING
    assert told.message.startswith("step 50, the newest checkpoint this job had recorded, does not load ("), told
    assert "is 3 bytes" in told.message and told.message.endswith(": the job resumes from step 40"), told
    assert f"`spotjob ckpt list {w.storage.url()}` says why of each" in told.message

    w.storage.delete_prefix(folder_name(50) + "/")
    w.storage.delete_prefix(folder_name(40) + "/")
    status = w.run_to(w.clock.at() + 10)
    assert status.last_checkpoint is None
    told = [e for e in w.events.emitted if e.reason == "CheckpointUnusable"][1]
    assert told.message.startswith("step 40, the newest checkpoint this job had recorded, is no longer in storage")
    assert told.message.endswith("the job resumes from scratch"), told
    w.run_to(w.clock.at() + 30)
    assert w.event_reasons().count("CheckpointUnusable") == 2, "once for each step lost, not once per pass"


def test_a_checkpoint_the_ranks_pass_over_as_they_restore_is_warned_about_and_passed_over_by_the_status(
    tmp_path: Any,
) -> None:
    """A byte of the newest checkpoint damaged, its size unchanged: the controller judges sizes only
    and named it as the resume point, the ranks' restore found the CRC32C mismatch and restored an
    older one; the status went on naming the damaged one, no CheckpointUnusable was told, the steps
    trained again were not counted, and the next attempt was said to start from it again."""
    w = make_world(tmp_path)
    commit_checkpoint(w.storage, 40, w.clock.now())
    commit_checkpoint(w.storage, 50, w.clock.now())
    w.reconcile()
    assert w.status.attempt.resumed_from_step == 50
    why = f"{w.storage.url(folder_name(50))}: corrupt on rank 0: {rank_file_name(0)} has CRC32C 1; the manifest says 2"
    for name in ("train-0-0", "train-0-1"):
        w.backend.restores[name] = (40, why)
    status = w.run_until(running_attempt(0))
    w.run_to(w.clock.at() + 30)
    status = w.status
    [told] = [e for e in w.events.emitted if e.reason == "CheckpointUnusable"]
    assert told.type is EventType.WARNING
    assert told.message.startswith("step 50, the newest checkpoint this job had recorded, did not load as the "), told
    assert why in told.message and told.message.endswith(": the job resumes from step 40"), told
    assert status.attempt.restored_step == 40
    assert status.last_checkpoint is not None and status.last_checkpoint.step == 40
    assert status.unusable_checkpoint is not None and status.unusable_checkpoint.step == 50
    assert status.lost_steps == 10
    assert w.metrics.named("lost_steps") == [(10,)]

    w.backend.exit(0, 0, 1)  # the code failed: no checkpoint newer than 50 was committed
    status = w.run_until(running_attempt(1))
    started = [e.message for e in w.events.emitted if e.reason == "WorkersStarted"]
    assert "attempt 1 from step 40" in started[-1], started
    assert status.attempt.resumed_from_step == 40
    w.run_to(w.clock.at() + 30)
    assert w.event_reasons().count("CheckpointUnusable") == 1, "once, not again for the next attempt"

    commit_checkpoint(w.storage, 60, w.clock.now())  # the next attempt commits past it: forgotten
    status = w.run_to(w.clock.at() + 10)
    assert status.last_checkpoint is not None and status.last_checkpoint.step == 60
    assert status.unusable_checkpoint is None


def test_a_checkpoint_committed_after_the_restore_below_the_damaged_one_is_not_passed_over(tmp_path: Any) -> None:
    """Steps 40 and 50, 50 damaged: the ranks restore 40 and train on. Their saves at 45 and a
    flush at 47 lie below the damaged step, and the pass went back past every checkpoint above
    the step restored: lastCheckpoint stayed at 40, the flush at 47 ended as WorkersExited
    ("nothing newer than step 40"), and the next attempt resumed from 40, fencing 47. Found in
    review. Only checkpoints committed before the damaged one was recorded are passed over."""
    w = make_world(tmp_path)
    commit_checkpoint(w.storage, 40, w.clock.now())
    commit_checkpoint(w.storage, 50, w.clock.now())
    w.reconcile()
    why = f"{w.storage.url(folder_name(50))}: corrupt on rank 0: {rank_file_name(0)} has CRC32C 1; the manifest says 2"
    for name in ("train-0-0", "train-0-1"):
        w.backend.restores[name] = (40, why)
    w.run_until(running_attempt(0))
    w.run_to(w.clock.at() + 30)
    assert w.status.unusable_checkpoint is not None and w.status.last_checkpoint is not None
    assert w.status.last_checkpoint.step == 40

    w.clock.advance(5)
    commit_checkpoint(w.storage, 45, w.clock.now())  # the attempt trains on from 40 and saves
    status = w.run_to(w.clock.at() + 10)
    assert status.last_checkpoint is not None and status.last_checkpoint.step == 45, status.last_checkpoint
    assert status.unusable_checkpoint is not None, "50 is still storage's newest, and still damaged"

    w.backend.exit(0, 0, 1)
    status = w.run_until(running_attempt(1))
    started = [e.message for e in w.events.emitted if e.reason == "WorkersStarted"]
    assert "attempt 1 from step 45" in started[-1], started
    assert status.attempt.resumed_from_step == 45


def test_a_checkpoint_uri_above_other_jobs_checkpoints_fails_the_job_naming_them(tmp_path: Any) -> None:
    """The workers' Checkpointers refuse such a URI (CheckpointUriError): the job fails at its first
    pass with InvalidCheckpointURI, naming the folder that holds checkpoints, and starts nothing."""
    w = make_world(tmp_path)
    below = open_storage(w.storage.uri + "/other-job")
    commit_checkpoint(below, 10, w.clock.now())
    below.close()
    status = w.run_to(30)
    assert (status.phase, status.reason) == (Phase.FAILED, "InvalidCheckpointURI")
    assert "holds no checkpoints, but folders in it do" in status.message
    assert w.storage.url("other-job") in status.message
    assert w.backend.created == []


def test_a_job_whose_uri_another_job_adopted_while_it_ran_fails_at_its_first_failure_without_a_restart(
    tmp_path: Any,
) -> None:
    """`spotjob ckpt adopt` of a running job's URI: its workers' saves were fenced, then every
    restart refused by the new owner, each counted as a failure of the user's code, so the job
    spent its restarts, wrote attempt records into the other job's URI and ended
    RestartBudgetExhausted, saying to fix the script. Found walking the CLI as a user. Now the
    first failure reads the owner again: CheckpointURIOwned, no restart, nothing more recorded."""
    w = make_world(tmp_path, maxRestarts=3)
    w.run_until(running_attempt(0))
    commit_checkpoint(w.storage, 20, w.clock.now())
    w.run_to(w.clock.at() + 10)
    adopt(w.storage, "team-a/other")
    w.backend.exit(0, 0, 1)  # its Checkpointer's next save was fenced
    status = w.run_until(lambda s: s.phase.terminal)
    assert (status.phase, status.reason) == (Phase.FAILED, "CheckpointURIOwned")
    assert "team-a/other" in status.message and status.restarts == 0
    assert "WorkerFailed" not in w.event_reasons()
    assert [r.attempt for r in attempt_records(w.storage, str(w.key))] == [0]
