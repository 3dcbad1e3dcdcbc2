"""What the README says the controller tells matches what it tells: every Event reason the
reconciler can emit is in the README's table with its type, and no other; every Prometheus family
the controller registers is in its metrics table with its type, and no other; the Events the
examples show have the type the reconciler gives them.

A reason or metric that is emitted but not documented leaves a user's alert or dashboard guessing;
one documented but never emitted is an alert that never fires.
"""

from __future__ import annotations

import re
from pathlib import Path

from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.parser import text_string_to_metric_families

from agent.control_api import StatusResponse
from orchestrator.k8s.metrics import ControllerMetrics
from orchestrator.reconciler import _reasons
from orchestrator.reconciler._reasons import Reason
from orchestrator.run_interrupt import (
    INTERRUPT_FLUSH_COMMITTED,
    INTERRUPT_FLUSH_NOT_COMMITTED,
    INTERRUPTED,
    INTERRUPTED_AT_COMPLETION,
    INTERRUPTED_AT_FAILURE,
)

README = (Path(__file__).resolve().parents[2] / "README.md").read_text()
LOCAL_ONLY = {
    "Resumed": "Normal",
    INTERRUPT_FLUSH_COMMITTED: "Normal",
    INTERRUPT_FLUSH_NOT_COMMITTED: "Warning",
    INTERRUPTED: "Normal",
    INTERRUPTED_AT_COMPLETION: "Normal",
    INTERRUPTED_AT_FAILURE: "Warning",
}
"""Events ``spotjob run`` writes itself, outside the reconciler (``run_setup``, ``run_driver``)."""


def _section(title: str) -> str:
    start = README.index(f"\n### {title}\n")
    end = README.find("\n### ", start + 1)
    return README[start:end]


def _table(text: str, header: str) -> list[list[str]]:
    """The rows of the Markdown table whose header row starts with ``header``, as cells."""
    lines = text.splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith(f"| {header} |"))
    rows = []
    for line in lines[first + 2 :]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split(" | ")])
    return rows


def _emitted() -> dict[str, str]:
    """Every reason the reconciler can give an Event: its type."""
    out = dict(LOCAL_ONLY)
    for value in vars(_reasons).values():
        if isinstance(value, Reason):
            out[value.name] = "Warning" if value.warning else "Normal"
    return out


def _documented() -> dict[str, str]:
    out: dict[str, str] = {}
    for reasons, kind, _ in _table(_section("Events and metrics"), "reason"):
        for name in re.findall(r"`(\w+)`", reasons):
            out[name] = kind
    return out


def test_every_event_reason_is_documented_with_its_type_and_only_those() -> None:
    assert _documented() == _emitted()
    assert all(re.fullmatch(r"[A-Z][a-z]+(?:[A-Z]+[a-z]*)*", reason) for reason in _emitted())  # CamelCase


def test_the_events_the_readme_shows_have_the_type_the_reconciler_gives_them() -> None:
    emitted = _emitted()
    shown = re.findall(r"\b(Normal|Warning) {2,}([A-Z]\w+)", README)
    assert len(shown) >= 4  # the extraction still finds the examples
    for kind, reason in shown:
        assert reason in emitted, f"the README shows an Event {reason} that nothing emits"
        assert emitted[reason] == kind, f"the README shows {reason} as {kind}; it is {emitted[reason]}"


def test_every_metric_family_is_documented_with_its_type_and_only_those() -> None:
    registered = {}
    for family in ControllerMetrics().registry.collect():
        name = f"{family.name}_total" if family.type == "counter" else family.name
        registered[name] = family.type
    documented = {}
    for metric, kind, *_ in _table(_section("Events and metrics"), "metric"):
        documented[metric.strip("`")] = kind
    assert documented == registered


def test_every_metric_family_is_documented_with_its_labels() -> None:
    """Pins what already held: the README's labels column is each family's label names, the ones a
    dashboard or an alert groups and filters by (a label the README names that the family lacks
    selects nothing, silently)."""
    registered = {}
    for family in vars(ControllerMetrics()).values():
        if isinstance(family, MetricWrapperBase):
            name = f"{family._name}_total" if family._type == "counter" else family._name
            registered[name] = set(family._labelnames)
    documented = {}
    for metric, _, labels, *_ in _table(_section("Events and metrics"), "metric"):
        documented[metric.strip("`")] = set(re.findall(r"`(\w+)`", labels))
    assert documented == registered


def test_every_series_of_the_metrics_text_is_documented() -> None:
    """What a scrape gets, parsed as Prometheus parses it: each series is a documented metric, a
    documented histogram's ``_bucket``, ``_sum`` or ``_count``, or the ``_created`` series that
    prometheus_client serves beside each counter and histogram, which the README names too (it did
    not: a scrape showed 15 series in no table)."""
    metrics = ControllerMetrics()
    metrics.signal("SpotInterruption", "k8s-node")
    metrics.flush_request("accepted")
    metrics.notice_to_commit(3.0)
    metrics.preemption()
    metrics.restart("preemption")
    metrics.lost_steps(5)
    metrics.goodput("ml", "train", 0.9)
    metrics.flush_ended("ml", "train", "committed", 1)
    metrics.reconciled(0.01, error=True)
    metrics.queue_depth(1)
    metrics.api_retry("get", "pods", "503")
    metrics.leader(True)
    metrics.interruption_message("SpotInterruption", "annotated")
    metrics.interruption_queue_error()
    metrics.checkpoint_hint_patch("ok")
    section = _section("Events and metrics")
    documented = {row[0].strip("`"): row[1] for row in _table(section, "metric")}
    created = "`_created`" in section
    allowed = set(documented)
    for name, kind in documented.items():
        if kind == "histogram":
            allowed |= {f"{name}_bucket", f"{name}_sum", f"{name}_count"} | ({f"{name}_created"} if created else set())
        if kind == "counter" and created:
            allowed.add(f"{name.removesuffix('_total')}_created")
    served = {s.name for f in text_string_to_metric_families(metrics.exposition().decode()) for s in f.samples}
    assert any(name.endswith("_created") for name in served)  # prometheus_client still serves them
    assert served <= allowed, sorted(served - allowed)


def test_the_agents_status_answer_is_documented_field_by_field() -> None:
    """A script or a probe reads ``GET /status`` by its keys: the README named a dozen of its 31
    (``flush_result``, ``command_exit_code``, ``seconds_left`` were in none of its lines)."""
    row = next(line for line in README.splitlines() if line.startswith("| `GET /status` |"))
    documented = set(re.findall(r"`(\w+)`", row))
    assert set(StatusResponse.model_fields) <= documented, sorted(set(StatusResponse.model_fields) - documented)
