"""Capacity fallback, on the fake clock: pods that stay unschedulable past ``startTimeoutSeconds``
raise ``CapacityUnavailable``; with ``spec.fallback`` the next attempt is built from the template
merged with it, and after ``fallback.returnAfterSeconds`` without a preemption the next attempt goes
back to the job's own template. And the merge rules of the fallback's template patch.

Nodes: ``s0``, ``s1`` are spot, ``d0``, ``d1`` on-demand; the job's template selects
``capacity-type: spot``, its fallback ``capacity-type: on-demand`` (the fake scheduler honours
that selector). Attempt 0 starts at 0; the start timeout is 60 s.
"""

from __future__ import annotations

from typing import Any

import pytest
from fakes import CAPACITY_SELECTOR, FakeNode
from pydantic import ValidationError
from test_reconciler import World, make_world, phase_is, running_attempt

from orchestrator.model import CapacityType, Cause, JobSpec, Phase, merge_template

SPOT = [FakeNode("s0", "zone-a", "g5.xlarge"), FakeNode("s1", "zone-b", "g5.xlarge")]
ON_DEMAND = [
    FakeNode("d0", "zone-a", "g5.xlarge", capacity="on-demand"),
    FakeNode("d1", "zone-b", "g5.xlarge", capacity="on-demand"),
]


def template(capacity: str) -> dict[str, Any]:
    return {
        "spec": {"containers": [{"name": "trainer", "image": "train:1"}], "nodeSelector": {CAPACITY_SELECTOR: capacity}}
    }


def capacity_world(tmp_path: Any, nodes: list[FakeNode], *, fallback: bool = True, **spec: Any) -> World:
    fields: dict[str, Any] = {"template": template("spot"), "startTimeoutSeconds": 60}
    if fallback:
        fields["fallback"] = {
            "template": {"spec": {"nodeSelector": {CAPACITY_SELECTOR: "on-demand"}}},
            "returnAfterSeconds": 600,
        }
    fields.update(spec)
    w = make_world(tmp_path, **fields)
    w.backend.nodes = list(nodes)
    return w


def selector(spec: JobSpec) -> str:
    return str((spec.template or {})["spec"]["nodeSelector"][CAPACITY_SELECTOR])


def test_an_attempt_without_spot_capacity_past_the_start_timeout_moves_to_the_fallback(tmp_path: Any) -> None:
    w = capacity_world(tmp_path, ON_DEMAND)

    w.run_to(59)
    assert w.status.phase is Phase.PENDING and w.status.condition("CapacityUnavailable") is None

    status = w.run_until(phase_is(Phase.RESCHEDULING))
    assert w.clock.at() == 60.0, "the pass comes when the timeout does, not at the next poll"
    condition = status.condition("CapacityUnavailable")
    assert condition is not None and condition.status == "True"
    assert (
        "train-0-0, train-0-1 found no capacity" in condition.message and "0/2 nodes are available" in condition.message
    )
    assert "the next attempt uses spec.fallback" in condition.message
    assert status.capacity is CapacityType.FALLBACK
    assert [(r.cause, r.reason) for r in status.restart_history] == [(Cause.CAPACITY, "CapacityUnavailable")]
    assert w.backend.stop_flushes == [False], "nothing trained: no flush, the agents are told to stop"

    status = w.run_until(running_attempt(1))
    assert w.clock.at() < 70, "no backoff: other capacity, nothing to wait for"
    assert selector(w.backend.start_specs[-1]) == "on-demand" and selector(w.backend.start_specs[0]) == "spot"
    assert sorted(w.backend.nodes_of(1)) == ["d0", "d1"]
    assert (status.preemptions, status.restarts, status.consecutive_restarts) == (0, 0, 0)
    assert status.avoid == [], "no cool-down: nothing was preempted"
    assert status.condition("CapacityUnavailable").status == "False"  # type: ignore[union-attr]
    assert status.condition("CapacityUnavailable").reason == "CapacityFound"  # type: ignore[union-attr]
    assert w.event_reasons().count("CapacityUnavailable") == 1
    # README's Events table lists CapacityFound: the condition had it, no Event was emitted.
    assert w.event_reasons().count("CapacityFound") == 1
    assert status.fallback_since is not None


def test_without_a_fallback_it_says_so_once_and_waits_until_capacity_appears(tmp_path: Any) -> None:
    w = capacity_world(tmp_path, ON_DEMAND, fallback=False)

    status = w.run_to(300)

    condition = status.condition("CapacityUnavailable")
    assert condition is not None and condition.status == "True" and "the spec has no fallback" in condition.message
    assert (status.phase, status.attempt.number, status.capacity) == (Phase.PENDING, 0, CapacityType.SPOT)
    assert w.backend.stop_calls == [] and w.event_reasons().count("CapacityUnavailable") == 1

    w.backend.nodes += SPOT  # the spot pool gets capacity back
    status = w.run_until(running_attempt(0))
    assert sorted(w.backend.nodes_of(0)) == ["s0", "s1"]
    assert status.condition("CapacityUnavailable").status == "False"  # type: ignore[union-attr]
    assert w.event_reasons().count("CapacityFound") == 1


def test_pods_placed_but_slow_to_start_are_no_capacity_problem(tmp_path: Any) -> None:
    """An image pull or a restore that takes long is not missing capacity: only unschedulable pods count."""
    w = capacity_world(tmp_path, SPOT, backend_options={"start_seconds": 200.0})

    status = w.run_until(running_attempt(0))

    assert w.clock.at() >= 200 and status.condition("CapacityUnavailable") is None
    assert status.capacity is CapacityType.SPOT and w.backend.stop_calls == []


def _on_fallback(tmp_path: Any) -> World:
    w = capacity_world(tmp_path, ON_DEMAND)
    w.run_until(running_attempt(1))
    w.backend.nodes += SPOT  # spot capacity is back, but nothing restarts the job for it
    return w


def test_after_the_preemption_free_period_the_next_restart_goes_back_to_spot(tmp_path: Any) -> None:
    w = _on_fallback(tmp_path)
    running_since = w.status.fallback_since
    assert running_since is not None

    status = w.run_to(1000)
    assert (status.attempt.number, status.capacity) == (1, CapacityType.FALLBACK), "no restart just for that"

    w.backend.notice("d0")  # the next restart, here an on-demand node reclaimed after the period
    status = w.run_until(running_attempt(2))

    assert status.capacity is CapacityType.SPOT and status.fallback_since is None
    assert selector(w.backend.start_specs[-1]) == "spot" and sorted(w.backend.nodes_of(2)) == ["s0", "s1"]
    assert "ReturningToSpot" in w.event_reasons()
    assert status.preemptions == 1


def test_a_preemption_on_the_fallback_before_the_period_keeps_the_job_there_and_the_period_starts_again(
    tmp_path: Any,
) -> None:
    w = _on_fallback(tmp_path)
    first_since = w.status.fallback_since

    w.run_to(300)
    w.backend.nodes.append(FakeNode("d2", "zone-c", "g5.xlarge", capacity="on-demand"))  # room without d0
    w.backend.notice("d0")
    status = w.run_until(running_attempt(2))

    assert status.capacity is CapacityType.FALLBACK and selector(w.backend.start_specs[-1]) == "on-demand"
    assert status.fallback_since is not None and first_since is not None and status.fallback_since > first_since
    assert "ReturningToSpot" not in w.event_reasons()


def test_the_fallback_needs_a_start_timeout_and_a_template_and_merges_into_a_valid_one(tmp_path: Any) -> None:
    base: dict[str, Any] = {"command": ["train.py"], "checkpoint": {"uri": "s3://b/p"}, "template": template("spot")}
    with pytest.raises(ValidationError, match=r"spec\.fallback needs spec\.startTimeoutSeconds"):
        JobSpec.model_validate({**base, "fallback": {"template": {}}})
    with pytest.raises(ValidationError, match=r"spec\.fallback patches spec\.template"):
        JobSpec.model_validate({**base, "template": None, "startTimeoutSeconds": 60, "fallback": {"template": {}}})
    with pytest.raises(ValidationError, match=r"spec\.containers must list at least one container"):
        JobSpec.model_validate(
            {**base, "startTimeoutSeconds": 60, "fallback": {"template": {"spec": {"containers": None}}}}
        )
    with pytest.raises(ValidationError, match="returnAfterSeconds"):
        JobSpec.model_validate(
            {**base, "startTimeoutSeconds": 60, "fallback": {"template": {}, "returnAfterSeconds": 0}}
        )


def test_the_fallback_template_merges_objects_by_key_named_lists_by_name_and_replaces_other_lists() -> None:
    base = {
        "metadata": {"labels": {"team": "ml", "tier": "spot"}},
        "spec": {
            "nodeSelector": {"karpenter.sh/capacity-type": "spot", "gpu": "a10g"},
            "tolerations": [{"key": "spot", "operator": "Exists"}, {"key": "nvidia.com/gpu", "operator": "Exists"}],
            "containers": [
                {"name": "trainer", "image": "train:1", "resources": {"limits": {"nvidia.com/gpu": 1}}},
                {"name": "sidecar", "image": "log:1"},
            ],
            "volumes": [{"name": "data", "emptyDir": {}}],
        },
    }
    patch = {
        "metadata": {"labels": {"tier": None}},
        "spec": {
            "nodeSelector": {"karpenter.sh/capacity-type": "on-demand"},
            "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists"}],
            "containers": [{"name": "trainer", "resources": {"limits": {"nvidia.com/gpu": 4}}}],
            "volumes": [{"name": "scratch", "emptyDir": {"medium": "Memory"}}],
        },
    }
    merged = merge_template(base, patch)

    assert merged["metadata"]["labels"] == {"team": "ml"}, "null removes a key"
    assert merged["spec"]["nodeSelector"] == {"karpenter.sh/capacity-type": "on-demand", "gpu": "a10g"}
    assert merged["spec"]["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists"}], "replaced whole"
    assert merged["spec"]["containers"] == [
        {"name": "trainer", "image": "train:1", "resources": {"limits": {"nvidia.com/gpu": 4}}},
        {"name": "sidecar", "image": "log:1"},
    ]
    assert [v["name"] for v in merged["spec"]["volumes"]] == ["data", "scratch"]
    assert base["spec"]["nodeSelector"]["karpenter.sh/capacity-type"] == "spot", "the base is not modified"


def test_a_gang_only_partly_placed_past_the_start_timeout_does_not_hold_its_nodes(tmp_path: Any) -> None:
    """replicas: 2 and one spot node, no fallback: worker 0 is placed and waits in the rendezvous for
    worker 1, which no node takes. It used to hold its node (a GPU) for as long as capacity was
    missing, while the job said it was waiting. Past ``startTimeoutSeconds`` the placed worker is
    stopped, and the next attempt tries again after ``restartBackoff.initialSeconds``. The fake
    backend does not model the rendezvous itself (its placed worker reports Running on its own)."""
    w = capacity_world(tmp_path, SPOT[:1], fallback=False)

    w.run_to(59)
    assert w.backend.nodes_of(0) == ["s0"] and w.backend.stop_calls == []

    status = w.run_until(lambda s: s.attempt.number == 1)
    assert w.clock.at() == 60.0
    assert w.backend.stop_calls == [None] and w.backend.stop_flushes == [False]
    assert "train-0-0" in w.backend.stopped_without_flush, "the placed worker is stopped, not flushed"
    condition = status.condition("CapacityUnavailable")
    assert condition is not None and condition.status == "True"
    assert "train-0-1 found no capacity" in condition.message
    assert "stopping train-0-0" in condition.message and "hold" in condition.message
    assert [(r.cause, r.reason) for r in status.restart_history] == [(Cause.CAPACITY, "GangIncomplete")]
    assert (status.preemptions, status.restarts) == (0, 0), "missing capacity spends no restart"
    assert status.recovery is not None and status.recovery.restart_at is not None
    assert (status.recovery.restart_at - status.recovery.stopped_at).total_seconds() == 10  # type: ignore[operator]

    w.backend.nodes += SPOT[1:]  # capacity for the whole gang
    status = w.run_until(running_attempt(1))
    assert sorted(w.backend.nodes_of(1)) == ["s0", "s1"]
    assert status.condition("CapacityUnavailable").status == "False"  # type: ignore[union-attr]


def test_a_gang_none_of_which_is_placed_keeps_waiting_in_the_same_attempt(tmp_path: Any) -> None:
    """Pins behaviour that already worked: with no worker placed nothing holds a node, so the
    attempt waits on without a restart (the test above stops only a gang that holds nodes)."""
    w = capacity_world(tmp_path, [], fallback=False)
    status = w.run_to(600)
    assert status.attempt.number == 0 and w.backend.stop_calls == [] and status.restart_history == []


def test_the_fallback_nulls_kubectl_apply_did_not_send_are_named_where_they_would_have_removed_something() -> None:
    """What the FallbackNullsDropped Warning names: a null of the last-applied fallback template
    that the stored one lacks, where putting it back changes the merged template — under an
    object, a container matched by name, an object of nulls only that is gone whole — and not one
    under a key the template does not have, nor one stored as sent."""
    from orchestrator.model import dropped_template_nulls

    template = {
        "spec": {
            "nodeSelector": {"karpenter.sh/capacity-type": "spot", "pool": "gpu"},
            "tolerations": [{"key": "spot", "operator": "Exists"}],
            "containers": [{"name": "trainer", "resources": {"limits": {"nvidia.com/gpu": "8", "cpu": "8"}}}],
        }
    }
    applied = {
        "spec": {
            "nodeSelector": {"karpenter.sh/capacity-type": None, "zone": None},
            "tolerations": None,
            "containers": [{"name": "trainer", "resources": {"limits": {"cpu": None}}}],
        }
    }
    stored = {"spec": {"nodeSelector": {}, "containers": [{"name": "trainer", "resources": {"limits": {}}}]}}
    assert dropped_template_nulls(template, stored, applied) == [
        'spec.fallback.template.spec.nodeSelector["karpenter.sh/capacity-type"]',
        "spec.fallback.template.spec.tolerations",
        "spec.fallback.template.spec.containers[0].resources.limits.cpu",
    ]
    gone_whole = {"spec": {"nodeSelector": {"karpenter.sh/capacity-type": None}}}
    assert dropped_template_nulls(template, {}, gone_whole) == [
        'spec.fallback.template.spec.nodeSelector["karpenter.sh/capacity-type"]'
    ]
    assert dropped_template_nulls(template, gone_whole, gone_whole) == []  # sent (kubectl create/replace)
    assert dropped_template_nulls(None, {}, gone_whole) == []  # no template: nothing to remove
    assert merge_template(template, stored)["spec"]["nodeSelector"]["karpenter.sh/capacity-type"] == "spot"
