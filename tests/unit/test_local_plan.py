"""When a local run's simulated cloud sends its planned notices (``PreemptionPlan.due``), walked
through with the seconds and the training/not-training states the backend's monitor passes it."""

from __future__ import annotations

from pathlib import Path

import pytest

from orchestrator.backends.local_plan import PreemptionPlan, load_trace


def walk(plan: PreemptionPlan, spans: list[tuple[float, bool]], tick: float = 0.1) -> list[tuple[float, str]]:
    """Call ``plan.due`` every ``tick`` seconds through ``spans`` (seconds, training?), as the monitor
    does; the notices with the second each came at. A notice ends the span it came in (the attempt it
    hit stops training), as it does in a run."""
    out: list[tuple[float, str]] = []
    t = 0.0
    for length, training in spans:
        end = t + length
        while t < end - tick / 2:
            t = round(t + tick, 6)
            said = plan.due(t, None, training)
            out += [(t, why) for why in said]
            training = training and not said
    return out


def test_a_preempt_every_shorter_than_a_restart_still_lets_each_attempt_train_a_gap() -> None:
    """README's Limits said it: notices due between attempts queued up, one for each attempt that
    started, so a ``--preempt-every`` shorter than a restart hit every attempt as it started and the
    run made no progress. The gap's clock now runs only while an attempt trains: here every attempt
    takes 20 s to start (10 s gaps), and each trains its full 10 s before its notice."""
    plan = PreemptionPlan(every=10.0, jitter=0.0, seed=1)
    spans: list[tuple[float, bool]] = []
    for _ in range(5):
        spans += [(20.0, False), (30.0, True)]  # an attempt starts (no notice can count), then trains
    notices = walk(plan, spans)
    assert len(notices) == 5, notices  # one an attempt: none left queued for the next to start with
    starts = [20.0 + 50.0 * i for i in range(5)]  # when each attempt began to train
    for (at, why), began in zip(notices, starts, strict=True):
        assert at - began >= 10.0 - 1e-6, (at, began, why)  # it trained a whole gap first
        assert at - began < 10.0 + 0.2, (at, began, why)  # and not much more: the gap, not a restart
    assert [why for _, why in notices][:2] == [
        "every 10 s (due at 10.0 s of training)",
        "every 10 s (due at 20.0 s of training)",
    ]


def test_gaps_that_fell_due_at_one_look_are_one_notice() -> None:
    """A driver stopped (Ctrl-Z) or stalled for many gaps while its attempt trained counts that time,
    so a notice comes at once when it looks again; but one, not one per gap, which would queue up and
    hit each of the next attempts as it starts."""
    plan = PreemptionPlan(every=10.0, jitter=0.0)
    assert plan.due(1.0, None, True) == []
    assert plan.due(95.0, None, True) == ["every 10 s (due at 10.0 s of training; 8 more due meanwhile, in this one)"]
    assert plan.due(100.0, None, True) == []
    assert plan.due(105.0, None, True) == ["every 10 s (due at 100.0 s of training)"]


def test_trace_times_and_steps_count_from_the_start_training_or_not() -> None:
    """``--trace`` times are seconds since the start and ``--preempt-at-step`` steps, as before: the
    training clock is ``--preempt-every``'s alone."""
    plan = PreemptionPlan(trace=[5.0, 6.0], at_steps=[3])
    assert plan.due(4.0, None, False) == []
    assert plan.due(6.5, None, False) == ["trace time 5 s", "trace time 6 s"]
    assert plan.due(7.0, 3, False) == ["step 3 reached (at 3)"]


def test_a_seeded_plan_gives_the_same_gaps_again() -> None:
    spans = [(3.0, False), (200.0, True)] * 3
    runs = [walk(PreemptionPlan(every=10.0, jitter=0.25, seed=7), spans) for _ in range(2)]
    assert runs[0] == runs[1]
    assert len(runs[0]) == 3
    assert runs[0] != walk(PreemptionPlan(every=10.0, jitter=0.25, seed=8), spans)


@pytest.mark.parametrize("text", ["3\n7.5\n", "[3, 7.5]"])
def test_a_trace_saved_with_a_byte_order_mark_is_read_as_without_it(tmp_path: Path, text: str) -> None:
    """A trace from an editor that starts UTF-8 with a BOM was refused: "'\\ufeff3' is not a number
    of seconds"."""
    trace = tmp_path / "trace.txt"
    trace.write_bytes("\ufeff".encode() + text.encode())
    assert load_trace(str(trace)) == [3.0, 7.5]
