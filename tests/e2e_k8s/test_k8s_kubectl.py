"""What a user sees through the real ``kubectl`` (the binary on these machines, not ours):
``apply -f examples/spotjob.yaml``, ``get sj`` with the CRD's printer columns and live values,
``describe sj`` with the Events, ``delete sj`` cascading to everything the job owns — and a
SpotJob the schema lets through but the controller cannot run, named as such while the first job
keeps running.
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml
from e2e_support import (
    GROUP_PATH,
    REPO,
    TRAIN,
    Controller,
    job_events,
    job_pods,
    jobs_path,
    status,
    wait,
    wait_phase,
)

from tests.k8s.cluster import TestCluster

pytestmark = pytest.mark.slow

EXAMPLE = REPO / "examples" / "spotjob.yaml"


def _example_for_this_machine(checkpoints: Path) -> str:
    """examples/spotjob.yaml with what must differ here: the script's path (no image: the test
    kubelet runs this machine's Python), the checkpoint URI (a folder, not a bucket), fewer steps
    at a pace a test can watch, no cloud metadata to probe, and one rank instead of
    the example's two (nothing kubectl shows depends on how many ranks a pod runs; a second one
    only costs a torch start and its share of every save)."""
    job = yaml.safe_load(EXAMPLE.read_text())
    spec = job["spec"]
    spec["nprocPerNode"] = 1
    # 0.2 s a step, a commit every 10: STEP moves every 2 s while the test watches. The job trains
    # for as long as the test runs, so a faster pace only adds steps and commits nothing reads.
    spec["command"] = [str(TRAIN), "--steps", "400", "--step-sleep", "0.2"]
    spec["checkpoint"]["uri"] = str(checkpoints)
    spec["checkpoint"]["everySteps"] = 10
    spec["env"].update(SPOTJOB_CLOUD="none", PYTHONUNBUFFERED="1")
    spec["template"]["spec"]["containers"][0]["resources"] = {"requests": {"cpu": "1", "memory": "1Gi"}}
    return yaml.safe_dump(job)


def _columns(table: str) -> tuple[list[str], dict[str, list[str]]]:
    """kubectl's table cut where its header's columns start (they are aligned), so a blank cell is
    "" in its place rather than shifting the cells after it."""
    lines = [ln for ln in table.splitlines() if ln.strip()]
    header = lines[0].split()
    starts = [m.start() for m in re.finditer(r"\S+", lines[0])]
    ends = [*starts[1:], None]
    rows = {ln.split()[0]: [ln[a:b].strip() for a, b in zip(starts, ends, strict=True)] for ln in lines[1:]}
    return header, rows


def test_kubectl_applies_the_example_shows_it_live_describes_its_events_and_deletes_it_with_what_it_owns(
    cluster: TestCluster,
    namespace: str,
    start_controller: Callable[..., Controller],
    tmp_path: Path,
) -> None:
    cluster.add_node(f"{namespace}-a")
    start_controller(namespace)
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=_example_for_this_machine(tmp_path / "ckpt"))
    wait_phase(cluster, namespace, "train-demo", "Running")
    wait(lambda: (status(cluster, namespace, "train-demo").get("lastCheckpoint") or {}).get("step"), "a checkpoint")

    def live_row() -> list[str] | None:
        header, rows = _columns(cluster.kubectl("get", "sj", "-n", namespace).stdout)
        row = rows.get("train-demo")
        # kubectl leaves a cell blank while its field is unset (GOODPUT until the reconciler's
        # first estimate, which can come a pass after the first checkpoint; HELD-FLUSH-AT while no
        # agent holds a notice): only a row with every other cell filled is read.
        if row is None or header[:3] != ["NAME", "PHASE", "STEP"]:
            return None
        if not all(cell for name, cell in zip(header, row, strict=True) if name != "HELD-FLUSH-AT"):
            return None
        return row if row[2].isdigit() else None

    row = wait(live_row, "kubectl get sj to show a committed step")
    header, _ = _columns(cluster.kubectl("get", "sj", "-n", namespace).stdout)
    assert header == [
        "NAME", "PHASE", "STEP", "CHECKPOINT", "PREEMPTIONS", "RESTARTS", "GOODPUT", "CAPACITY", "HELD-FLUSH-AT", "AGE"
    ]  # fmt: skip
    assert row[1] == "Running" and int(row[2]) >= 10 and row[4] == "0" and row[5] == "0" and row[7] == "spot"
    assert row[8] == "", row  # no agent holds a notice

    # A job the schema accepts but no pod can be built from: named, while the first job runs on.
    broken = yaml.safe_load(_example_for_this_machine(tmp_path / "ckpt-broken"))
    broken["metadata"]["name"] = "broken"
    broken["spec"]["template"]["spec"]["containers"][0]["command"] = ["python", "my_own_launcher.py"]
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(broken))

    def invalid() -> dict | None:
        conditions = status(cluster, namespace, "broken").get("conditions") or []
        return next((c for c in conditions if c["type"] == "Invalid" and c["status"] == "True"), None)

    condition = wait(invalid, "the broken job's Invalid condition")
    assert "spec.template.spec.containers[0].command" in condition["message"], condition
    warning = wait(
        lambda: [e for e in job_events(cluster, namespace, "broken") if e["type"] == "Warning"], "a Warning Event"
    )
    assert any("spec.template.spec.containers[0].command" in e.get("note", "") for e in warning), warning
    # Touched and still broken: the same Warning again is counted on the one Event, not a new one.
    cluster.kubectl("label", "sj", "broken", "-n", namespace, "touched=yes")
    repeated = wait(
        lambda: [e for e in job_events(cluster, namespace, "broken") if (e.get("series") or {}).get("count", 1) >= 2],
        "the repeated Warning to be counted in its Event's series",
    )
    assert len([e for e in job_events(cluster, namespace, "broken") if e["reason"] == repeated[0]["reason"]]) == 1
    assert not job_pods(cluster, namespace, "broken")
    step = status(cluster, namespace, "train-demo")["lastCheckpoint"]["step"]
    wait(
        lambda: status(cluster, namespace, "train-demo")["lastCheckpoint"]["step"] > step,
        "the first job to keep committing",
    )
    assert status(cluster, namespace, "train-demo")["phase"] == "Running"

    described = cluster.kubectl("describe", "sj", "train-demo", "-n", namespace).stdout
    assert "Events:" in described and "WorkersRunning" in described and "WorkersStarted" in described, described

    owned = {
        "pods": lambda: job_pods(cluster, namespace, "train-demo"),
        "services": lambda: cluster.rest.get(
            f"/api/v1/namespaces/{namespace}/services", labelSelector="spotjob.dev/job=train-demo"
        )["items"],
        "secrets": lambda: cluster.rest.get(
            f"/api/v1/namespaces/{namespace}/secrets", labelSelector="spotjob.dev/job=train-demo"
        )["items"],
        "networkpolicies": lambda: cluster.rest.get(
            f"/apis/networking.k8s.io/v1/namespaces/{namespace}/networkpolicies",
            labelSelector="spotjob.dev/job=train-demo",
        )["items"],
    }
    assert all(list_() for list_ in owned.values()), {k: len(v()) for k, v in owned.items()}
    cluster.kubectl("delete", "sj", "train-demo", "-n", namespace)
    for kind, list_ in owned.items():
        wait(lambda list_=list_: not list_(), f"the job's {kind} to be garbage-collected")
    assert status(cluster, namespace, "broken").get("conditions")  # the other job is untouched


def test_kubectl_apply_keeps_a_fallback_null_only_in_its_annotation_where_the_controller_finds_it_lost(
    cluster: TestCluster, namespace: str, spotjob_crd: None, tmp_path: Path
) -> None:
    """The seam the controller's FallbackNullsDropped Warning stands on, with the real kubectl:
    ``kubectl apply`` sends no null of ``spec.fallback.template`` and keeps it in its last-applied
    annotation, which the store reads as lost; ``kubectl replace -f`` of the same manifest sends the
    null, and nothing is lost."""
    from orchestrator.k8s.store import LAST_APPLIED_ANNOTATION, _lost_fallback_nulls

    job = yaml.safe_load(_example_for_this_machine(tmp_path / "ckpt"))
    job["metadata"]["name"] = "nulls"
    job["spec"]["template"]["spec"]["nodeSelector"] = {"karpenter.sh/capacity-type": "spot"}
    job["spec"]["fallback"] = {"template": {"spec": {"nodeSelector": {"karpenter.sh/capacity-type": None}}}}
    job["spec"]["startTimeoutSeconds"] = 600
    manifest = tmp_path / "nulls.yaml"
    manifest.write_text(yaml.safe_dump(job))

    def lost() -> list[str]:
        obj = cluster.rest.get(f"{GROUP_PATH}/namespaces/{namespace}/spotjobs/nulls")
        return _lost_fallback_nulls(obj["spec"], obj["metadata"].get("annotations", {}).get(LAST_APPLIED_ANNOTATION))

    cluster.kubectl("apply", "-n", namespace, "-f", str(manifest))
    assert lost() == ['spec.fallback.template.spec.nodeSelector["karpenter.sh/capacity-type"]']
    cluster.kubectl("replace", "-n", namespace, "-f", str(manifest))
    assert lost() == []


def _readme_held_notices_listing() -> str:
    [line] = re.findall(r"^\$ (kubectl get sj -A .*heldNotices.*)$", (REPO / "README.md").read_text(), re.M)
    return line


def test_the_readmes_listing_by_held_notice_lists_every_job_whether_or_not_one_holds_a_notice(
    cluster: TestCluster, namespace: str, spotjob_crd: None
) -> None:
    """README's ``kubectl get sj -A --sort-by=.status.heldNotices[0].flushAt`` printed "No resources
    found" with kubectl 1.32 while no job held a notice, though it claimed to list the jobs holding
    one last. The command README gives now lists every job, those holding a notice first."""
    command = _readme_held_notices_listing()
    for name in ("a1", "b2", "c3"):
        job = {
            "apiVersion": "spotjob.dev/v1alpha1",
            "kind": "SpotJob",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {"image": "img:1", "command": ["/t.py"], "checkpoint": {"uri": f"s3://b/{name}"}},
        }
        cluster.rest.request("POST", jobs_path(namespace), job)

    def listed() -> list[list[str]]:
        run = subprocess.run(["bash", "-c", command], capture_output=True, text=True, check=True)
        rows = [line.split() for line in run.stdout.splitlines()]
        return [[flush, name] for flush, ns, name in rows if ns == namespace]

    assert listed() == [["<none>", "a1"], ["<none>", "b2"], ["<none>", "c3"]]
    notice = {"worker": "c3-0-0", "source": "gcp", "kind": "maintenance", "flushAt": "2026-06-01T12:15:00Z"}
    cluster.rest.request(
        "PATCH",
        jobs_path(namespace, "c3") + "/status",
        {"status": {"phase": "Running", "heldNotices": [notice]}},
        content_type="application/merge-patch+json",
    )
    assert listed() == [["2026-06-01T12:15:00Z", "c3"], ["<none>", "a1"], ["<none>", "b2"]]
