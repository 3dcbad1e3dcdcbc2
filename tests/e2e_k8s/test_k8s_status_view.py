"""What an operator reads in a SpotJob's status, Events and metrics through a job's life, on the test
cluster with a real ``spotjob-controller`` process and real ranks (checkpoints on file://). A job that
completes uninterrupted is read in test_k8s_alert_metrics.py, and a taint preemption's Events and
counters in test_k8s_preemption.py: each needs the very job those files run, so one run serves both."""

from __future__ import annotations

import re
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from e2e_support import (
    REPO,
    Controller,
    create_job,
    job_events,
    running_pods,
    spotjob_body,
    status,
    wait,
    wait_phase,
)

from agent.notices.emulators import AzureScheduledEventsEmulator
from orchestrator.model import parse_timestamp
from tests.k8s.cluster import TestCluster

sys.path.insert(0, str(REPO / "tests" / "k8s_plugin"))
from plugin_support import run_kubectl_spotjob

pytestmark = pytest.mark.slow


def test_an_azure_reboot_the_agent_holds_is_on_the_spotjob_in_an_event_and_in_kubectl_spotjob_until_withdrawn(
    cluster: TestCluster, namespace: str, start_controller: Callable[..., Controller], tmp_path: Path
) -> None:
    """Azure announces a Reboot of the worker's VM 15 minutes ahead. The real agent in the pod holds
    it (``--flush-lead``, 300 s) and trains on. Before, that was in the agent's ``GET /status`` only:
    the SpotJob's status, its Events and ``kubectl spotjob status`` said nothing. Now the controller
    takes it from the poll that reads the step: ``status.heldNotices`` names the worker, its node
    and when the flush starts, a ``NoticeHeld`` Event says so, and ``kubectl spotjob status`` shows
    it; once Azure cancels the event it is gone from the status, and the job never stopped. The
    scheduled-events service is the project's emulator on this machine, as the pod's agent is."""
    cluster.add_node(f"{namespace}-a")
    start_controller(namespace)
    with AzureScheduledEventsEmulator() as azure:
        env = {"SPOTJOB_CLOUD": "azure", "SPOTJOB_AZURE_METADATA_URL": azure.url}
        body = spotjob_body("held", namespace, uri=str(tmp_path / "ckpt"), dump_dir=tmp_path, steps=100000, env=env)
        create_job(cluster, body)
        wait_phase(cluster, namespace, "held", "Running")
        wait(lambda: status(cluster, namespace, "held")["attempt"].get("observedStep"), "a step reported")
        deadline = time.time() + 900
        azure.add_event(EventType="Reboot", NotBefore=deadline)

        (held,) = wait(lambda: status(cluster, namespace, "held").get("heldNotices"), "the held notice in the status")
        (pod,) = running_pods(cluster, namespace, "held", 0)
        assert (held["worker"], held["node"]) == (pod["metadata"]["name"], pod["spec"]["nodeName"]), held
        assert (held["source"], held["kind"]) == ("azure", "maintenance"), held
        assert abs(datetime_of(held["flushAt"]) - (deadline - 300)) <= 2, held
        (told,) = wait(
            lambda: [e for e in job_events(cluster, namespace, "held") if e["reason"] == "NoticeHeld"],
            "the NoticeHeld Event",
        )
        assert f"the agent of {held['worker']} on node {held['node']} holds azure's maintenance notice" in told["note"]
        shown = run_kubectl_spotjob(cluster, cluster.kubeconfig, "status", "held", "-n", namespace)
        assert shown.returncode == 0, shown.stderr
        [line] = [x for x in shown.stdout.splitlines() if x.startswith("Held notice:")]
        assert f"{held['worker']} on {held['node']}: azure maintenance" in line and "the flush starts" in line, line
        # The list views too: kubectl get sj's HELD-FLUSH-AT, kubectl spotjob status's HELD-FLUSH.
        header, row = cluster.kubectl("get", "sj", "held", "-n", namespace).stdout.splitlines()[:2]
        assert row[header.index("HELD-FLUSH-AT") :].split()[0] == held["flushAt"], (header, row)
        listed = run_kubectl_spotjob(cluster, cluster.kubeconfig, "status", "-n", namespace)
        header, row = listed.stdout.splitlines()[:2]
        assert re.match(r"in \d+m", row[header.index("HELD-FLUSH") :]), (header, row)  # about 10m ahead

        azure.clear()
        wait(lambda: "heldNotices" not in status(cluster, namespace, "held"), "the withdrawn notice gone")
        now = status(cluster, namespace, "held")
        assert now["phase"] == "Running" and now["attempt"]["number"] == 0 and now["preemptions"] == 0, now


def datetime_of(text: str) -> float:
    when = parse_timestamp(text)
    assert when is not None, text
    return when.timestamp()
