"""Leader election: one replica acts; a killed leader is replaced within the lease; a leader that
cannot renew exits; a clean shutdown releases the lease. In-process electors and real
``spotjob-controller`` replicas (subprocesses) against the test API server."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from ctl_support import CONTROLLER_USER, TestApi, wait_for

from agent.ranks import free_port
from orchestrator.k8s.api import EVENTS, LEASES, PERMISSIONS, KubeClient, NotFound, Resource, RetryPolicy
from orchestrator.k8s.kubeconfig import load_config
from orchestrator.k8s.leader import LeaderElector, LeaseTiming

SPOTJOBS = Resource("spotjob.dev", "v1alpha1", "spotjobs", "SpotJob", namespaced=True)
FAST = LeaseTiming(lease_duration=3.0, renew_deadline=2.0, retry_period=0.3)
SCRIPT = Path(__file__).resolve().parent / "scripts" / "replica.py"


def holder(test_api: TestApi, name: str = "spotjob-controller") -> str | None:
    try:
        return test_api.admin.get(LEASES, name, "default")["spec"].get("holderIdentity")
    except NotFound:
        return None


def elector(test_api: TestApi, identity: str, started: list[str], lost: list[str]) -> LeaderElector:
    return LeaderElector(
        test_api.client(),
        namespace="default",
        name="lease",
        identity=identity,
        timing=FAST,
        on_started=lambda: started.append(identity),
        on_lost=lambda why: lost.append(f"{identity}: {why}"),
    )


def test_one_of_two_electors_leads_and_a_release_hands_over_at_once(test_api: TestApi) -> None:
    started: list[str] = []
    lost: list[str] = []
    a = elector(test_api, "a", started, lost)
    a.start()
    wait_for(lambda: started == ["a"], what="a to lead")
    b = elector(test_api, "b", started, lost)
    b.start()
    wait_for(lambda: holder(test_api, "lease") == "a" and b.alive(), what="b to campaign")
    assert not b.is_leader and started == ["a"]
    a.stop(release=True)
    wait_for(lambda: started == ["a", "b"], what="b to take over")
    lease = test_api.admin.get(LEASES, "lease", "default")["spec"]
    assert lease["holderIdentity"] == "b" and lease["leaseTransitions"] == 1
    b.stop()
    assert lost == []


def test_a_leader_that_cannot_renew_gives_up_before_its_lease_expires(test_api: TestApi) -> None:
    started: list[str] = []
    lost: list[str] = []
    a = elector(test_api, "a", started, lost)
    a.start()
    wait_for(lambda: a.is_leader, what="a to lead")
    test_api.fault(verb="update", resource="leases", count=100000, status=500)
    wait_for(lambda: lost, what="a to give up")
    assert "no renewal" in lost[0] and not a.is_leader
    a.stop(release=False)


def test_a_leader_whose_lease_was_taken_gives_up(test_api: TestApi) -> None:
    started: list[str] = []
    lost: list[str] = []
    a = elector(test_api, "a", started, lost)
    a.start()
    wait_for(lambda: a.is_leader, what="a to lead")
    lease = test_api.admin.get(LEASES, "lease", "default")
    lease["spec"]["holderIdentity"] = "usurper"
    test_api.admin.replace(LEASES, lease)
    wait_for(lambda: lost, what="a to notice")
    assert "usurper" in lost[0]
    a.stop(release=False)


class SlowRenewal(KubeClient):
    """A controller client whose first lease update is answered late: the server writes the lease
    at once, then the answer takes ``answer_takes`` seconds (on the elector's clock) to arrive,
    after which every further update fails."""

    def __init__(self, test_api: TestApi, clock: list[float], answer_takes: float) -> None:
        super().__init__(
            load_config(str(test_api.kubeconfig)), retry=RetryPolicy(attempts=2, initial=0.01, maximum=0.05)
        )
        self._test_api = test_api
        self._now = clock
        self._answer_takes = answer_takes
        self.written_at: float | None = None

    def replace(self, resource: Resource, body: dict[str, Any], *, subresource: str | None = None) -> Any:
        written = super().replace(resource, body, subresource=subresource)
        if resource == LEASES and self.written_at is None:
            written_at = self._now[0]
            self._test_api.fault(verb="update", resource="leases", count=100000, status=500)
            self._now[0] += self._answer_takes
            self.written_at = written_at
        return written


def test_a_renewal_answered_late_counts_from_when_it_was_sent(test_api: TestApi) -> None:
    # The other replicas count the lease from the write they saw; a leader counting its renewal from
    # when the answer arrived would keep acting for as long as the answer took past the lease's end.
    now = [0.0]
    lost: list[str] = []
    client = SlowRenewal(test_api, now, answer_takes=1.5)
    a = LeaderElector(
        client,
        namespace="default",
        name="lease",
        identity="a",
        timing=FAST,
        on_started=lambda: None,
        on_lost=lost.append,
        clock=lambda: now[0],
    )
    a.start()
    wait_for(lambda: client.written_at is not None, what="the slow renewal")
    assert client.written_at is not None
    # Past the renew deadline after the write (and so before the others may take the lease over,
    # FAST.lease_duration after it): the leader must have given up by now.
    now[0] = client.written_at + FAST.renew_deadline + 0.05
    wait_for(lambda: lost, what="the leader to give up")
    assert "no renewal" in lost[0] and not a.is_leader
    a.stop(release=False)


def test_lease_timings_must_leave_the_leader_time_to_give_up_first() -> None:
    with pytest.raises(ValueError, match="renew deadline"):
        LeaseTiming(lease_duration=10, renew_deadline=10, retry_period=2)


# -- real replicas


class Replica:
    def __init__(self, test_api: TestApi, name: str, tmp: Path) -> None:
        self.name = name
        self.port = free_port()
        self.log = tmp / f"{name}.log"
        env = dict(os.environ, POD_NAME=name, POD_NAMESPACE="default")
        env.pop("KUBECONFIG", None)
        args = [
            sys.executable,
            str(SCRIPT),
            f"--kubeconfig={test_api.kubeconfig}",
            f"--http-port={self.port}",
            "--leader-elect-lease-duration=3",
            "--leader-elect-renew-deadline=2",
            "--leader-elect-retry-period=0.3",
            "--workers=2",
            "--log-level=debug",
        ]
        with open(self.log, "w") as out:
            self.process = subprocess.Popen(args, env=env, stdout=out, stderr=subprocess.STDOUT)

    def probe(self, path: str) -> int:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=5) as r:
                return int(r.status)
        except urllib.error.HTTPError as e:
            return int(e.code)
        except OSError:
            return 0

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(30)

    def output(self) -> str:
        return self.log.read_text()


@pytest.fixture
def replicas(test_api: TestApi, tmp_path: Path) -> Iterator[list[Replica]]:
    test_api.install_spotjob_crd()
    started: list[Replica] = []
    yield started
    for r in started:
        r.stop()


def spotjob(test_api: TestApi, name: str) -> None:
    test_api.admin.create(
        SPOTJOBS,
        {"apiVersion": "spotjob.dev/v1alpha1", "kind": "SpotJob", "metadata": {"name": name}, "spec": {"replicas": 1}},
        "default",
    )


def reconciled_by(test_api: TestApi, job: str) -> set[str]:
    items: list[dict[str, Any]] = test_api.admin.list(EVENTS, "default")[0]
    return {e["reportingInstance"] for e in items if e["reason"] == "TestReconciled" and e["regarding"]["name"] == job}


def test_only_the_leader_replica_acts_and_a_killed_leader_is_replaced(
    test_api: TestApi, replicas: list[Replica], tmp_path: Path
) -> None:
    spotjob(test_api, "before")
    a = Replica(test_api, "replica-a", tmp_path)
    replicas.append(a)
    wait_for(lambda: holder(test_api) == "replica-a", what="replica-a to lead")
    b = Replica(test_api, "replica-b", tmp_path)
    replicas.append(b)
    wait_for(lambda: b.probe("/readyz") == 200, what="replica-b to be ready (idle)")
    assert a.probe("/healthz") == 200 and b.probe("/healthz") == 200
    spotjob(test_api, "during")
    wait_for(lambda: reconciled_by(test_api, "during"), what="the leader to reconcile the new job")
    assert reconciled_by(test_api, "before") == {"replica-a"}
    assert reconciled_by(test_api, "during") == {"replica-a"}

    a.process.send_signal(signal.SIGKILL)
    a.process.wait(30)
    wait_for(lambda: holder(test_api) == "replica-b", timeout=60, what="replica-b to take over")
    spotjob(test_api, "after")
    wait_for(lambda: reconciled_by(test_api, "after"), what="the new leader to reconcile")
    assert reconciled_by(test_api, "after") == {"replica-b"}
    assert test_api.admin.get(LEASES, "spotjob-controller", "default")["spec"]["leaseTransitions"] >= 1

    b.process.send_signal(signal.SIGTERM)
    assert b.process.wait(60) == 0, b.output()
    assert holder(test_api) == ""  # released on the way out

    # Every call the replicas made is one PERMISSIONS lists (what the chart's RBAC must grant).
    granted = {(p.group, p.resource, p.verb) for p in PERMISSIONS}
    made = {
        (r["api_group"], f"{r['resource']}/{r['subresource']}" if r["subresource"] else r["resource"], r["verb"])
        for r in test_api.audit()
        if r["user"] == CONTROLLER_USER and r["resource"]
    }
    assert made and made <= granted, made - granted


def test_a_replica_that_cannot_renew_its_lease_exits(
    test_api: TestApi, replicas: list[Replica], tmp_path: Path
) -> None:
    a = Replica(test_api, "replica-a", tmp_path)
    replicas.append(a)
    wait_for(lambda: holder(test_api) == "replica-a", what="replica-a to lead")
    test_api.fault(verb="update", resource="leases", count=100000, status=500)
    assert a.process.wait(60) == 3, a.output()
    assert "lost leadership" in a.output()
