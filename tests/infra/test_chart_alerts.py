"""The chart's PrometheusRule (``metrics.prometheusRule``), rendered by the real helm: off by
default, every expression valid PromQL (the ``promql-parser`` package, a real parser) naming only
metrics the controller registers, each alert documented in README.md with a runbook, and the values
reaching the rules. tests/e2e_k8s/test_k8s_alert_metrics.py checks the same names against a real
controller's /metrics."""

from __future__ import annotations

import json
import re
import tomllib
from typing import Any

import promql_parser
import pytest
import yaml
from infra_support import NAMESPACE, REPO, alert_rules, find, helm, one, render, selectors, template
from prometheus_client.metrics import MetricWrapperBase

from orchestrator.backends.base import FlushRequestOutcome
from orchestrator.events import FLUSH_OUTCOMES
from orchestrator.k8s.metrics import ControllerMetrics
from orchestrator.model import Phase

ON = {"metrics": {"prometheusRule": {"enabled": True}, "serviceMonitor": {"enabled": True}}}
README = (REPO / "README.md").read_text()
SUFFIXES = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count", "_created"), "gauge": ("",)}


def exposed_names() -> set[str]:
    """Every series name the controller's registry can expose, and Prometheus' own ``up``."""
    names = {"up"}
    for family in ControllerMetrics().registry.collect():
        names |= {family.name + suffix for suffix in SUFFIXES[family.type]}
    return names


def test_nothing_is_rendered_unless_enabled() -> None:
    for values in ({}, {"metrics": {"serviceMonitor": {"enabled": True}}}):
        assert find(render(values), "PrometheusRule") == []
    assert "kind: PrometheusRule" not in template({}).stdout


def test_every_rule_parses_as_promql_and_names_only_metrics_the_controller_exposes() -> None:
    """An expression a parser refuses, or a metric name the controller never exposes (a typo, a
    counter without ``_total``), makes an alert that never fires, and Prometheus says nothing."""
    found = alert_rules(render(ON))
    known = exposed_names()
    assert len(found) >= 12
    for name, rule in found.items():
        named = selectors(rule["expr"])
        assert named, f"{name} reads no series"
        for metric, matchers in named:
            assert metric in known, f"{name} reads {metric}, which the controller does not expose"
            assert 'job="spotjob-metrics"' in matchers, f"{name} reads {metric} of any scrape job: {matchers}"


TARGET_LABELS = {"job", "namespace", "instance"}
"""Labels Prometheus gives every series of a scrape target (the ServiceMonitor's ``job``, the pod's
``namespace``; the per-job series carry their job's ``namespace`` instead, ``honorLabels``)."""
LABEL_VALUES = {
    ("spotjob_job_phase", "phase"): {phase.value for phase in Phase},
    ("spotjob_job_flushes_total", "outcome"): set(FLUSH_OUTCOMES),
    ("spotjob_flush_requests_total", "outcome"): {str(o) for o in FlushRequestOutcome} - {"pending"},
}
"""The values the controller gives the labels the rules match on."""


def metric_labels() -> dict[str, set[str]]:
    """Each series name the controller exposes: the label names its samples carry."""
    out = {"up": set()}
    for family in vars(ControllerMetrics()).values():
        if isinstance(family, MetricWrapperBase):
            for suffix in SUFFIXES[family._type]:
                out[family._name + suffix] = set(family._labelnames) | ({"le"} if suffix == "_bucket" else set())
    return out


def test_every_rule_matches_only_labels_and_values_the_series_carry() -> None:
    """Pins what already held: a matcher on a label the series lacks (``reason`` for ``outcome``),
    or on a value the controller never writes (``phase="Error"``, ``outcome="timeout"``), or an
    ``on(...)`` over a label one side lacks, parses and is valid PromQL, and the alert never
    fires; the check above, of metric names only, would not see it."""
    labels = metric_labels()
    for name, rule in alert_rules(render(ON)).items():
        seen: list[str] = []
        joined: set[str] = set()

        def visit(node: object, name: str = name, seen: list[str] = seen, joined: set[str] = joined) -> None:
            if isinstance(node, promql_parser.VectorSelector):
                assert node.name is not None, name
                seen.append(node.name)
                carried = labels[node.name] | TARGET_LABELS
                for matcher in node.matchers.matchers:
                    assert matcher.name in carried, f"{name} matches {node.name} on {matcher.name}, which it lacks"
                    known = LABEL_VALUES.get((node.name, matcher.name))
                    if known is not None:
                        values = matcher.value.split("|") if matcher.op == promql_parser.MatchOp.Re else [matcher.value]
                        assert set(values) <= known, f"{name}: {node.name}{{{matcher.name}}} is never {values}"
            if isinstance(node, promql_parser.BinaryExpr) and node.modifier and node.modifier.matching:
                joined.update(node.modifier.matching.labels)

        promql_parser.walk(promql_parser.parse(rule["expr"]), visit)
        for metric in seen:  # every side of a join carries the labels it joins on
            assert joined <= labels[metric], f"{name} joins on {sorted(joined)}; {metric} has {sorted(labels[metric])}"


def test_every_controller_wide_counter_an_alert_takes_an_increase_of_is_exported_at_zero_from_the_start() -> None:
    """``increase()`` needs two samples: a series that first appears at 3 (the first failures of an
    incident, or the first after a controller restarts) has no increase, and the alert never fires
    for it. ``spotjob_flush_requests_total{outcome="failed"}`` appeared only at its first failure.
    Every series a rule takes an increase of, without per-job labels (those are made when the job
    is first seen), must be exported from the start at 0."""
    from prometheus_client import generate_latest

    exposed = generate_latest(ControllerMetrics().registry).decode()
    checked = 0
    for name, rule in alert_rules(render(ON)).items():
        for metric, matchers in selectors(rule["expr"]):
            if "increase(" not in rule["expr"] or metric.startswith("spotjob_job_"):
                continue
            wanted = {m.group(1): m.group(2) for m in re.finditer(r'(\w+)="([^"]*)"', matchers)}
            wanted = {k: v for k, v in wanted.items() if k not in TARGET_LABELS}
            series = [
                line
                for line in exposed.splitlines()
                if line.startswith(metric) and all(f'{k}="{v}"' in line for k, v in wanted.items())
            ]
            assert series and all(line.endswith(" 0.0") for line in series), f"{name}: {metric}{wanted} {series}"
            checked += 1
    assert checked >= 3  # reconcile errors, flush requests failed, interruption queue errors


def test_the_parser_refuses_what_a_broken_rule_would_be() -> None:
    """Pins that the check above can fail: the parser refuses a truncated or misspelt expression."""
    for broken in ("increase(spotjob_job_flushes_total[1h) > 0", "rate(x[5m]", "absnt(up == 1)"):
        with pytest.raises(ValueError):
            promql_parser.parse(broken)


def test_each_alert_has_a_summary_a_description_naming_the_job_and_a_runbook_in_the_readme() -> None:
    found = alert_rules(render(ON))
    section = README.split("\n### Alerts\n", 1)[1].split("\n### ", 1)[0]
    documented = re.findall(r"^#### (SpotJob\w+)$", section, re.M)
    assert sorted(documented) == sorted(found), "README.md, Alerts: one heading per alert, and only those"
    job_groups = {r["alert"] for r in one(render(ON), "PrometheusRule")["spec"]["groups"][0]["rules"]}
    for name, rule in found.items():
        notes = rule["annotations"]
        assert notes["summary"] and notes["description"], name
        assert notes["runbook"] == f'README.md, "Alerts": {name}', name
        assert "runbook_url" not in notes, "no URL unless metrics.prometheusRule.runbookUrl gives one"
        assert rule["labels"]["severity"] in ("warning", "critical"), name
        if name in job_groups:
            assert "{{ $labels.namespace }}/{{ $labels.name }}" in notes["description"], name


def test_the_controllers_own_alerts_look_at_its_namespace_and_up_is_absent_only_when_no_replica_is_up() -> None:
    found = alert_rules(render(ON))
    assert found["SpotJobControllerDown"]["expr"] == f'absent(up{{job="spotjob-metrics",namespace="{NAMESPACE}"}} == 1)'
    assert found["SpotJobControllerDown"]["labels"]["severity"] == "critical"
    for name in ("SpotJobNoLeader", "SpotJobReconcileErrors", "SpotJobInterruptionQueueErrors"):
        ((_, matchers),) = selectors(found[name]["expr"])
        assert f'namespace="{NAMESPACE}"' in matchers, name
    # The per-job series carry the job's namespace (honorLabels): no controller namespace on them.
    for metric, matchers in selectors(found["SpotJobFailed"]["expr"]):
        assert "namespace" not in matchers, (metric, matchers)


def test_custom_values_reach_the_rule() -> None:
    values = {
        "metrics": {
            "serviceMonitor": {"enabled": False},
            "prometheusRule": {
                "enabled": True,
                "labels": {"release": "kube-prometheus"},
                "annotations": {"team": "ml-platform"},
                "alertLabels": {"team": "ml-platform", "severity": "page"},
                "selector": 'job="spotjob",cluster="gpu-1"',
                "runbookUrl": "https://wiki.example.com/spotjob/README.md",
                "disabled": ["SpotJobGoodputLow"],
                "thresholds": {
                    "checkpointMaxAgeSeconds": 1000000,
                    "restartsLeft": 2,
                    "goodputBelow": 0.5,
                    "notRunningFor": "2h",
                    "flushFailureWindow": "30m",
                },
            },
        }
    }
    objects = render(values)
    rule = one(objects, "PrometheusRule")
    assert rule["metadata"]["labels"]["release"] == "kube-prometheus"
    assert rule["metadata"]["annotations"] == {"team": "ml-platform"}
    found = alert_rules(objects)
    assert "SpotJobGoodputLow" not in found
    for name, r in found.items():
        assert r["labels"]["team"] == "ml-platform" and r["labels"]["severity"] == "page", name
        assert r["annotations"]["runbook_url"] == f"https://wiki.example.com/spotjob/README.md#{name.lower()}"
        for metric, matchers in selectors(r["expr"]):
            assert 'job="spotjob"' in matchers and 'cluster="gpu-1"' in matchers, (name, metric, matchers)
    stale = found["SpotJobCheckpointStale"]["expr"]
    assert promql_parser.parse(stale) is not None  # a large number is still a PromQL number
    assert re.search(r"\) > (1e\+06|1000000)\n", stale), stale
    assert "<= 2\n" in found["SpotJobRestartsNearlySpent"]["expr"]
    assert found["SpotJobNotRunning"]["for"] == "2h"
    assert found["SpotJobFlushTimedOut"]["expr"].endswith("[30m]) > 0")


def test_a_group_whose_alerts_are_all_disabled_is_left_out() -> None:
    controller = [
        "SpotJobControllerDown",
        "SpotJobNoLeader",
        "SpotJobReconcileErrors",
        "SpotJobFlushRequestsFailing",
        "SpotJobInterruptionQueueErrors",
    ]
    values = {"metrics": {**ON["metrics"], "prometheusRule": {"enabled": True, "disabled": controller}}}
    (group,) = one(render(values), "PrometheusRule")["spec"]["groups"]
    assert group["name"] == "spotjob.jobs"


@pytest.mark.parametrize(
    ("values", "named"),
    [
        ({"metrics": {"prometheusRule": {"enabled": True}}}, "metrics.prometheusRule.selector"),
        (
            {"metrics": {**ON["metrics"], "prometheusRule": {"enabled": True, "disabled": ["Nope"]}}},
            "Nope is no alert",
        ),
        ({"metrics": {"prometheusRule": {"enabled": True, "thresholds": {"goodputBelow": 2}}}}, "goodputBelow"),
        ({"metrics": {"prometheusRule": {"enabled": True, "thresholds": {"failedFor": "5 minutes"}}}}, "failedFor"),
    ],
)
def test_values_that_cannot_work_are_refused_naming_them(values: dict[str, Any], named: str) -> None:
    proc = template(values)
    assert proc.returncode != 0
    assert named in proc.stderr, proc.stderr


def test_helm_lint_strict_passes_with_the_rule_on(helm_bin: str, tmp_path: Any) -> None:
    values_file = tmp_path / "values.yaml"
    values_file.write_text(yaml.safe_dump(ON))
    proc = helm("lint", "--strict", str(REPO / "charts" / "spotjob"), "--namespace", NAMESPACE, "-f", str(values_file))
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}"


def test_make_venv_installs_the_pinned_promql_parser() -> None:
    """``make test`` on a fresh clone installs the parser these tests import: the test extra
    declares it, constraints/dev.txt pins it, and the venv is (re)made from both when either changes."""
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert any(d.startswith("promql-parser>=") for d in pyproject["project"]["optional-dependencies"]["test"])
    assert "promql-parser==0.12.0" in (REPO / "constraints" / "dev.txt").read_text().splitlines()
    makefile = (REPO / "Makefile").read_text()
    assert "$(STAMP): pyproject.toml constraints/dev.txt" in makefile
    assert "-c constraints/dev.txt -e '.[torch,test]'" in makefile


def test_only_the_alerts_on_something_counted_and_the_restart_budget_fire_without_a_for() -> None:
    """Pins what already held, as the README's "Alerts" now says it: an alert on a counter's
    ``increase()`` fires at once and stays for its window; one on a state waits its ``for:``."""
    found = alert_rules(render(ON))
    counted = {name for name, rule in found.items() if "increase(" in rule["expr"]}
    assert counted == {
        "SpotJobFlushTimedOut", "SpotJobAgentFlushFailed", "SpotJobFlushRequestsFailing", "SpotJobReconcileErrors",
        "SpotJobInterruptionQueueErrors",
    }  # fmt: skip
    assert {name for name, rule in found.items() if "for" not in rule} == counted | {"SpotJobRestartsNearlySpent"}
    section = README.split("\n### Alerts\n", 1)[1].split("\n#### ", 1)[0]
    assert all(name in section for name in counted | {"SpotJobRestartsNearlySpent"})


def test_a_runbook_url_of_the_alerts_section_itself_links_each_alerts_heading() -> None:
    """values.yaml asks for "a URL of the README's Alerts section"; the URL a browser shows for it
    ends in #alerts, and each alert's runbook_url came out as .../README.md#alerts#spotjobfailed, a
    fragment no page has. The alert's fragment replaces the section's."""
    base = "https://git.example.com/ml/spotjob/blob/main/README.md"
    values = {"metrics": {**ON["metrics"], "prometheusRule": {"enabled": True, "runbookUrl": f"{base}#alerts"}}}
    for name, rule in alert_rules(render(values)).items():
        assert rule["annotations"]["runbook_url"] == f"{base}#{name.lower()}", name


@pytest.mark.parametrize(
    "selector",
    [
        'job="spotjob"',
        ' job =~ "spot.*" , cluster!="ml", ',
        "job='spotjob'",
        "job=`spotjob`",
        '"odd.name"!~"x"',
        'job="spotjob",kubernetes_namespace="monitoring",pod=~"a,namespace=b"',
        ' job =~ "spot.*" , namespace!="ml", ',
        'job="spotjob",namespace!~"dev|test"',
        'job="spotjob","namespace"!="dev"',
    ],
)
def test_a_selector_of_promql_label_matchers_reaches_every_rule_as_valid_promql(selector: str) -> None:
    """Any list of PromQL matchers (the four operators, the three quotes, a quoted UTF-8 name, a
    trailing comma) is taken, and every rule still parses. A ``namespace`` matcher that only leaves
    namespaces out (``!=``, ``!~``) is taken too: ``job="spotjob",namespace!="dev"`` rendered before
    the render refused namespace matchers, and was refused with the positive ones, wrongly."""
    found = alert_rules(render({"metrics": {"prometheusRule": {"enabled": True, "selector": selector}}}))
    assert len(found) >= 12
    for name, rule in found.items():
        assert selectors(rule["expr"]), f"{name}: {rule['expr']}"


@pytest.mark.parametrize(
    "selector",
    ["job=spotjob", 'job="spotjob"}', 'job="spotjob" namespace="ml"', " ", '{job="spotjob"}', 'job=="spotjob"', ","],
)
def test_a_selector_that_is_no_list_of_promql_matchers_fails_the_render_naming_it(selector: str) -> None:
    """``job=spotjob`` (the value unquoted) rendered ``spotjob_job_phase{phase="Failed",job=spotjob}``:
    the Prometheus Operator's webhook refused the whole rule group mid-install, and without the
    webhook Prometheus dropped it, so no alert existed. Found walking the chart as a user; each
    rendered before."""
    proc = template({"metrics": {"prometheusRule": {"enabled": True, "selector": selector}}})
    assert proc.returncode != 0
    said = f"metrics.prometheusRule.selector {json.dumps(selector)} is no list of PromQL label matchers"
    assert said in proc.stderr, proc.stderr
    assert 'e.g. job="spotjob"' in proc.stderr and 'namespace="monitoring"' not in proc.stderr


@pytest.mark.parametrize(
    "selector",
    [
        'job="spotjob",namespace="monitoring"',
        'namespace=~"monitoring|ml"',
        ' job="spotjob" , namespace = "ml"',
        '"namespace"="monitoring"',
        'job="spotjob",namespace=~".*"',
    ],
)
def test_a_selector_that_keeps_only_some_namespaces_fails_the_render_naming_why(selector: str) -> None:
    """The selector goes into the per-job alerts too, whose series carry each SpotJob's own
    namespace (honor_labels, which the README requires), not the controller's: with
    ``job="spotjob",namespace="monitoring"``, the example the chart's own error message gave, all
    eight per-job alerts selected nothing, and nothing said so. Found walking the chart as a user.
    Every ``=`` and ``=~`` on namespace is refused, whatever its value (``=~".*"`` too: it keeps
    nothing out, and is refused for the rule's simplicity); ``!=`` and ``!~`` are taken (above)."""
    proc = template({"metrics": {"prometheusRule": {"enabled": True, "selector": selector}}})
    assert proc.returncode != 0
    said = f"metrics.prometheusRule.selector {json.dumps(selector)} matches on namespace with = or =~"
    assert said in proc.stderr, proc.stderr
    assert "each SpotJob's own namespace" in proc.stderr and 'job="spotjob"' in proc.stderr, proc.stderr
    assert "!=" in proc.stderr and "!~" in proc.stderr, "the message says how to leave namespaces out"


def test_the_flush_request_outcomes_exported_at_zero_are_the_answers_an_agent_gives() -> None:
    from orchestrator.k8s.metrics import FLUSH_REQUEST_OUTCOMES

    assert set(FLUSH_REQUEST_OUTCOMES) == {str(o) for o in FlushRequestOutcome} - {"pending"}


def test_not_running_keeps_one_for_clock_per_job_through_every_phase_that_is_not_running() -> None:
    """SpotJobNotRunning was ``spotjob_job_phase{phase=~"Pending|Rescheduling"} == 1``: its alerts
    were keyed by ``phase`` too, and Prometheus keeps a ``for:`` clock per alert, so a job going from
    Pending to Rescheduling (a gang that could not start, stopped and tried again) and back started
    a new clock each time, and the alert fired late or never. Found walking the alerts as a user.
    Now one series per job, 1 whichever phase short of Running and of an end the job is in.

    It was then ``max by (namespace, name)``, which dropped every other label too: the ``cluster``
    or tenant labels relabelling or a multi-cluster ruler adds (merging same-named jobs of two
    clusters into one alert) and ``job``, which routing matches on. Now ``without`` the labels that
    differ between the phases (``phase``) and between two controller pods of one install, the
    leader before and after a failover (``instance`` and ``pod``, which the ServiceMonitor adds;
    ``job``, ``namespace``, ``service``, ``endpoint`` and ``container`` are the same for both)."""
    rule = alert_rules(render(ON))["SpotJobNotRunning"]
    expr = promql_parser.parse(rule["expr"])

    assert isinstance(expr, promql_parser.BinaryExpr) and isinstance(expr.lhs, promql_parser.AggregateExpr), expr
    aggregated = expr.lhs
    assert str(aggregated.op) == "max" and aggregated.modifier is not None
    assert aggregated.modifier.type == promql_parser.AggModifierType.Without
    assert sorted(aggregated.modifier.labels) == ["instance", "phase", "pod"]
    assert str(expr.op) == "==" and str(expr.rhs) == "1"
    ((metric, _),) = selectors(rule["expr"])
    (phase,) = [m for m in aggregated.expr.matchers.matchers if m.name == "phase"]
    assert metric == "spotjob_job_phase" and phase.op == promql_parser.MatchOp.Re
    ended = {Phase.RUNNING, Phase.SUCCEEDED, Phase.FAILED}
    assert set(phase.value.split("|")) == {p.value for p in Phase} - {p.value for p in ended}
    assert "$labels.phase" not in rule["annotations"]["description"], "the alert has no phase label"
