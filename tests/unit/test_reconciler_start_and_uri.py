"""A job whose ``spec.checkpoint.uri`` changed under it (a cluster that does not evaluate the CRD's
CEL rule) is Invalid rather than resumed from, or started fresh in, another store."""

from __future__ import annotations

from typing import Any

from test_reconciler import edit_document, make_world, running_attempt

from orchestrator.model import Phase
from orchestrator.store import JsonFileJobStore


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
