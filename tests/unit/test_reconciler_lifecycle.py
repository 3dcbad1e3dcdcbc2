"""The controller's lifecycle on the fake clock: a spec edited while an attempt runs, and status
timestamps written by a controller whose wall clock ran ahead (a leader on a skewed node).

Timeline of the default world (``test_reconciler``): attempt 0 starts at 0, its two workers run
from 5 and the reconciler sees them at 6; each trains one step per second.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from fakes import KEY
from test_reconciler import World, edit_document, make_world, phase_is, preempt_running_job, running_attempt

from orchestrator.model import Phase

# -- a spec edited while an attempt runs -------------------------------------------------------


def set_replicas(world: World, replicas: int) -> None:
    edit_document(world.store, KEY, lambda doc: doc["spec"].update(replicas=replicas))  # type: ignore[arg-type]


def test_a_job_whose_replicas_were_raised_while_it_ran_succeeds_when_its_gang_finishes(tmp_path: Any) -> None:
    world = make_world(tmp_path, backend_options={"total_steps": 40})
    world.run_until(running_attempt(0))

    set_replicas(world, 3)
    status = world.run_until(lambda s: s.phase.terminal or world.clock.at() > 600)

    assert status.phase is Phase.SUCCEEDED, (status.phase, status.reason)
    assert status.attempt.replicas == 2
    assert world.backend.created == ["train-0-0", "train-0-1"]


def test_replicas_raised_while_an_attempt_starts_add_no_worker_to_its_gang_and_count_from_the_next_attempt(
    tmp_path: Any,
) -> None:
    world = make_world(tmp_path)
    world.reconcile()  # attempt 0 is started with 2 workers; they run from 5
    set_replicas(world, 3)

    world.run_until(running_attempt(0))
    assert world.backend.created == ["train-0-0", "train-0-1"]  # no worker expecting a gang of 3
    assert all(spec.replicas == 2 for spec in world.backend.start_specs)

    preempt_running_job(world, at=60, node="n0")
    status = world.run_until(running_attempt(1))
    assert status.attempt.replicas == 3
    assert [name for name in world.backend.created if name.startswith("train-1-")] == [
        "train-1-0",
        "train-1-1",
        "train-1-2",
    ]

