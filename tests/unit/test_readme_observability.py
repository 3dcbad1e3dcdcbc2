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

from orchestrator.k8s.metrics import ControllerMetrics
from orchestrator.reconciler import _reasons
from orchestrator.reconciler._reasons import Reason

README = (Path(__file__).resolve().parents[2] / "README.md").read_text()
LOCAL_ONLY = {"Resumed": "Normal"}
"""Events ``spotjob run`` writes itself, outside the reconciler (``cli_run``)."""


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
