"""The cluster's moving parts: the test kubelet, the scheduler, node lifecycle and pod GC."""

from __future__ import annotations

import os
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from .cluster import TestCluster
from .cluster.kubelet import now_micro

# Waits end as soon as their condition holds; the limit only has to be generous for a loaded
# 2-core machine (several test sessions at once), where a pod's Python takes seconds to start.
WAIT = 60.0

SERVER = textwrap.dedent(
    """
    import http.server, os, pathlib, signal, sys
    pathlib.Path(os.environ["DATA"], "started").write_text(os.environ["POD_NAME"] + " " + sys.argv[1])
    def bye(*_):
        pathlib.Path(os.environ["DATA"], "sigterm").write_text("bye")
        sys.exit(0)
    signal.signal(signal.SIGTERM, bye)
    http.server.ThreadingHTTPServer((os.environ["POD_IP"], 8080), http.server.SimpleHTTPRequestHandler).serve_forever()
    """
)


def pod(name: str, command: list[str], **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {"containers": [{"name": "main", "image": "python:3.11", "command": command}], **spec},
    }


def get(cluster: TestCluster, ns: str, name: str) -> dict[str, Any]:
    obj: dict[str, Any] = cluster.rest.get(f"/api/v1/namespaces/{ns}/pods/{name}")
    return obj


def condition(obj: dict[str, Any], ctype: str) -> dict[str, Any]:
    return next((c for c in obj.get("status", {}).get("conditions") or [] if c["type"] == ctype), {})


def phase(obj: dict[str, Any]) -> str:
    return str(obj.get("status", {}).get("phase", ""))


def container(obj: dict[str, Any]) -> dict[str, Any]:
    """The first container's status; empty until the kubelet has reported one."""
    statuses: list[dict[str, Any]] = obj.get("status", {}).get("containerStatuses") or [{}]
    return statuses[0]


def running(pid: int) -> bool:
    """A process that has not exited (a zombie has: it only waits for its parent to reap it)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2] not in "ZX"


def gone(cluster: TestCluster, ns: str, name: str) -> bool:
    return not [p for p in cluster.rest.get(f"/api/v1/namespaces/{ns}/pods")["items"] if p["metadata"]["name"] == name]


def with_data_folder(name: str, script: str, grace: int) -> dict[str, Any]:
    """A pod running ``python -c script`` with an emptyDir mounted at /data, where the script leaves
    marker files for the test to wait on."""
    body = pod(name, ["python", "-c", script], terminationGracePeriodSeconds=grace)
    body["spec"]["containers"][0]["volumeMounts"] = [{"name": "data", "mountPath": "/data"}]
    body["spec"]["volumes"] = [{"name": "data", "emptyDir": {}}]
    return body


def test_a_pod_binds_its_own_ip_sees_its_env_and_volumes_and_turns_ready(cluster: TestCluster, namespace: str) -> None:
    cluster.add_node("k-ready")
    cluster.rest.request(
        "POST",
        f"/api/v1/namespaces/{namespace}/secrets",
        {"metadata": {"name": "token"}, "stringData": {"value": "s3cret"}},
    )
    cluster.rest.request(
        "POST", f"/api/v1/namespaces/{namespace}/configmaps", {"metadata": {"name": "cfg"}, "data": {"MODE": "fast"}}
    )
    body = pod("web", ["python", "-c", SERVER, "$(MODE)"])
    c = body["spec"]["containers"][0]
    c["env"] = [
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "token", "key": "value"}}},
        {"name": "DATA", "value": "/data"},
    ]
    c["envFrom"] = [{"configMapRef": {"name": "cfg"}}]
    c["ports"] = [{"name": "http", "containerPort": 8080}]
    c["readinessProbe"] = {"httpGet": {"port": "http", "path": "/"}, "periodSeconds": 1}
    c["volumeMounts"] = [{"name": "data", "mountPath": "/data"}, {"name": "secret", "mountPath": "/etc/token"}]
    body["spec"]["volumes"] = [{"name": "data", "emptyDir": {}}, {"name": "secret", "secret": {"secretName": "token"}}]
    cluster.rest.request("POST", f"/api/v1/namespaces/{namespace}/pods", body)
    ready = cluster.wait_for(
        lambda: (p := get(cluster, namespace, "web")) and condition(p, "Ready").get("status") == "True" and p,
        WAIT,
        "web to be Ready",
    )
    ip = ready["status"]["podIP"]
    assert ip.startswith("127.") and ready["status"]["phase"] == "Running" and ready["spec"]["nodeName"] == "k-ready"
    assert ready["status"]["containerStatuses"][0]["state"]["running"]
    worker = cluster.worker(namespace, "web")
    assert worker is not None and worker.ip == ip
    data = dict(worker.mounts)["/data"]
    assert Path(data, "started").read_text() == "web fast", "env, envFrom, $(VAR) and the /data mount rewrite"
    assert Path(dict(worker.mounts)["/etc/token"], "value").read_text() == "s3cret"
    import urllib.request

    with urllib.request.urlopen(f"http://{ip}:8080/", timeout=5) as r:
        assert r.status == 200


def test_deleting_a_pod_sigterms_each_containers_main_process_alone_and_completes_after_it_exits(
    cluster: TestCluster, namespace: str
) -> None:
    """As a container runtime stops a container: SIGTERM to its main process (PID 1) only, and the
    rest SIGKILLed when that exits or the grace period ends. The test kubelet used to SIGTERM every
    process of the pod, so spotjob-agent's ranks died of it (exit 143) before the flush the agent
    runs on that same SIGTERM could commit: a drain or eviction ended FlushFailed here, where a real
    pod flushes (found walking the README with `kubectl drain`)."""
    cluster.add_node("k-grace")
    # The main process ignores SIGTERM (so the grace period runs out); its child, in the same
    # session, writes down any SIGTERM it gets: it must get none.
    child = (
        "import pathlib,signal,time; "
        'signal.signal(signal.SIGTERM, lambda *a: pathlib.Path("/data/child-got-sigterm").touch()); '
        'pathlib.Path("/data/child").touch(); time.sleep(600)'
    )
    script = (
        "import pathlib,signal,subprocess,sys,time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        f"subprocess.Popen([sys.executable, '-c', {child!r}]); "
        'pathlib.Path("/data/ignoring").touch(); time.sleep(600)'
    )
    cluster.rest.request("POST", f"/api/v1/namespaces/{namespace}/pods", with_data_folder("g", script, 2))
    worker = cluster.wait_for(lambda: cluster.worker(namespace, "g"), WAIT, "the pod's worker")
    cluster.wait_for(
        lambda: (
            worker.mounts
            and Path(dict(worker.mounts)["/data"], "ignoring").exists()
            and Path(dict(worker.mounts)["/data"], "child").exists()
        ),
        WAIT,
        "the main process to ignore SIGTERM and its child to listen for one",
    )
    data = Path(dict(worker.mounts)["/data"])
    pids = cluster.pod_pids(namespace, "g")
    assert len(pids) == 2
    asked = time.monotonic()
    deleted = cluster.rest.request("DELETE", f"/api/v1/namespaces/{namespace}/pods/g")
    assert deleted["metadata"]["deletionTimestamp"] and deleted["metadata"]["deletionGracePeriodSeconds"] == 2
    cluster.wait_for(lambda: gone(cluster, namespace, "g"), WAIT, "the kubelet to finish the deletion")
    # The main process ignores SIGTERM, so the pod stays Terminating for the whole grace period: a
    # lower bound, which a slow machine only makes longer. Once the pod is gone, so are its processes.
    assert time.monotonic() - asked >= 2, "the pod went before its grace period ended"
    assert not [pid for pid in pids if running(pid)], "processes outlived their pod"
    assert not (data / "child-got-sigterm").exists(), "the kubelet signalled a process other than the main one"


def test_a_containers_other_processes_go_with_its_main_process_even_those_ignoring_sigterm(
    cluster: TestCluster, namespace: str
) -> None:
    """A child in a session of its own that ignores SIGTERM does not hold the pod: when the main
    process exits on its SIGTERM, the rest of the container is killed at once (a PID namespace's end)."""
    cluster.add_node("k-grace2")
    script = (
        "import subprocess,sys,time; subprocess.Popen([sys.executable,'-c','import pathlib,signal,time; "
        'signal.signal(signal.SIGTERM, signal.SIG_IGN); pathlib.Path("/data/ignoring").touch(); time.sleep(600)\'],'
        " start_new_session=True); time.sleep(600)"
    )
    cluster.rest.request("POST", f"/api/v1/namespaces/{namespace}/pods", with_data_folder("h", script, 600))
    worker = cluster.wait_for(lambda: cluster.worker(namespace, "h"), WAIT, "the pod's worker")
    cluster.wait_for(
        lambda: worker.mounts and Path(dict(worker.mounts)["/data"], "ignoring").exists(),
        WAIT,
        "the child to ignore SIGTERM",
    )
    pids = cluster.pod_pids(namespace, "h")
    assert len(pids) == 2
    cluster.rest.request("DELETE", f"/api/v1/namespaces/{namespace}/pods/h")
    # Well within the 600 s grace period: the wait ends as soon as the pod is gone.
    cluster.wait_for(lambda: gone(cluster, namespace, "h"), WAIT, "the pod to go with its main process")
    assert not [pid for pid in pids if running(pid)], "processes outlived their pod"


def test_restart_policies_and_exit_codes(cluster: TestCluster, namespace: str) -> None:
    cluster.add_node("k-exit")
    cluster.rest.request(
        "POST", f"/api/v1/namespaces/{namespace}/pods", pod("ok", ["python", "-c", "pass"], restartPolicy="Never")
    )
    cluster.rest.request(
        "POST",
        f"/api/v1/namespaces/{namespace}/pods",
        pod("bad", ["python", "-c", "raise SystemExit(3)"], restartPolicy="Never"),
    )
    cluster.rest.request(
        "POST",
        f"/api/v1/namespaces/{namespace}/pods",
        pod("flaky", ["python", "-c", "raise SystemExit(1)"], restartPolicy="OnFailure"),
    )
    ok = cluster.wait_for(lambda: phase(p := get(cluster, namespace, "ok")) == "Succeeded" and p, WAIT, "ok to succeed")
    assert container(ok)["state"]["terminated"]["exitCode"] == 0
    bad = cluster.wait_for(lambda: phase(p := get(cluster, namespace, "bad")) == "Failed" and p, WAIT, "bad to fail")
    terminated = container(bad)["state"]["terminated"]
    assert terminated == {**terminated, "exitCode": 3, "reason": "Error"}
    # Until the kubelet's first report the pod has no containerStatuses: the check must allow that.
    flaky = cluster.wait_for(
        lambda: container(p := get(cluster, namespace, "flaky")).get("restartCount", 0) >= 2 and p,
        WAIT,
        "flaky to restart",
    )
    assert phase(flaky) == "Running" and container(flaky)["lastState"]["terminated"]["exitCode"] == 1


SIDECAR = textwrap.dedent(
    """
    import pathlib, signal, sys, time
    data = pathlib.Path("/data")
    def bye(*_):
        main_done = (data / "main-done").exists()
        (data / "sidecar-stopped").write_text("after main" if main_done else "before main")
        sys.exit(0)
    signal.signal(signal.SIGTERM, bye)
    (data / "sidecar-started").touch()
    while True:
        time.sleep(0.1)
    """
)


SIDECAR_SEEN = textwrap.dedent(
    """
    import pathlib, sys, time
    for _ in range(600):
        if pathlib.Path("/data/sidecar-started").exists():
            sys.exit(0)
        time.sleep(0.05)
    sys.exit("the sidecar never started beside this init container")
    """
)


def _with_native_sidecar(name: str, main: str, **spec: Any) -> dict[str, Any]:
    """A pod whose init containers are a native sidecar, then a regular init container that
    proves the sidecar runs beside it (it waits up to 30 s for the sidecar's file; an init
    container started only after the sidecar ended, or a sidecar never started, fails it);
    ``main`` is the regular container's script."""
    mount = [{"name": "data", "mountPath": "/data"}]
    body = pod(name, ["python", "-c", main], restartPolicy="Never", **spec)
    body["spec"]["containers"][0]["volumeMounts"] = mount
    body["spec"]["volumes"] = [{"name": "data", "emptyDir": {}}]
    body["spec"]["initContainers"] = [
        {
            "name": "proxy",
            "image": "proxy:1",
            "restartPolicy": "Always",
            "command": ["python", "-c", SIDECAR],
            "volumeMounts": mount,
        },
        {
            "name": "setup",
            "image": "python:3.11",
            # "Started" is the sidecar's process, not its first line of work (no startup probe
            # here): what proves it runs beside this container is its file appearing meanwhile.
            "command": ["python", "-c", SIDECAR_SEEN],
            "volumeMounts": mount,
        },
    ]
    return body


def test_a_native_sidecar_starts_before_the_next_init_container_and_is_stopped_after_the_main_one(
    cluster: TestCluster, namespace: str
) -> None:
    cluster.add_node("k-sidecar")
    main = "import pathlib, time; time.sleep(1); pathlib.Path('/data/main-done').touch()"
    cluster.rest.request("POST", f"/api/v1/namespaces/{namespace}/pods", _with_native_sidecar("side", main))
    done = cluster.wait_for(
        lambda: phase(p := get(cluster, namespace, "side")) in ("Succeeded", "Failed") and p, WAIT, "the pod to end"
    )
    # The sidecar's own exit (SIGTERM from the kubelet) does not decide the phase: main's does.
    assert phase(done) == "Succeeded", done["status"]
    proxy, setup = done["status"]["initContainerStatuses"]
    assert "terminated" in proxy["state"] and setup["state"]["terminated"]["exitCode"] == 0, (proxy, setup)
    worker = cluster.worker(namespace, "side")
    assert worker is not None
    assert Path(dict(worker.mounts)["/data"], "sidecar-stopped").read_text() == "after main"


def test_deleting_a_pod_stops_its_native_sidecar_only_after_the_main_container_exited(
    cluster: TestCluster, namespace: str
) -> None:
    cluster.add_node("k-sidecar-del")
    # The main container takes a moment over its SIGTERM (a flush), then says whether the sidecar
    # was still there for it.
    main = textwrap.dedent(
        """
        import pathlib, signal, sys, time
        data = pathlib.Path("/data")
        def bye(*_):
            time.sleep(1)
            alive = not (data / "sidecar-stopped").exists()
            (data / "main-done").write_text("sidecar alive" if alive else "sidecar gone")
            sys.exit(0)
        signal.signal(signal.SIGTERM, bye)
        (data / "main-started").touch()
        while True:
            time.sleep(0.1)
        """
    )
    body = _with_native_sidecar("side-del", main, terminationGracePeriodSeconds=30)
    cluster.rest.request("POST", f"/api/v1/namespaces/{namespace}/pods", body)
    worker = cluster.wait_for(lambda: cluster.worker(namespace, "side-del"), WAIT, "the pod's worker")
    cluster.wait_for(
        lambda: worker.mounts and Path(dict(worker.mounts)["/data"], "main-started").exists(), WAIT, "main to start"
    )
    # The kubelet reports Running after it started the process (as a real one does), so the file
    # can be there a moment before the status says so.
    ready = cluster.wait_for(
        lambda: phase(p := get(cluster, namespace, "side-del")) != "Pending" and p, WAIT, "the pod to leave Pending"
    )
    assert phase(ready) == "Running" and condition(ready, "Initialized").get("status") == "True"
    cluster.rest.request("DELETE", f"/api/v1/namespaces/{namespace}/pods/side-del")
    cluster.wait_for(lambda: gone(cluster, namespace, "side-del"), WAIT, "the kubelet to finish the deletion")
    data = Path(dict(worker.mounts)["/data"])
    assert (data / "main-done").read_text() == "sidecar alive"
    assert (data / "sidecar-stopped").read_text() == "after main"


def test_the_scheduler_honours_selectors_affinity_taints_and_resources(cluster: TestCluster, namespace: str) -> None:
    cluster.add_node("s-spot", zone="us-east-1a", capacity_type="spot", gpus=1, run_containers=False)
    cluster.add_node(
        "s-od",
        zone="us-east-1b",
        capacity_type="on-demand",
        gpus=1,
        taints=[{"key": "dedicated", "value": "training", "effect": "NoSchedule"}],
        run_containers=False,
    )
    gpu = {"resources": {"limits": {"nvidia.com/gpu": "1"}}}
    sleep = ["sleep", "60"]

    def make(name: str, tolerate: bool = False, affinity: Any = None, selector: Any = None, gpus: bool = True) -> None:
        body = pod(name, sleep)
        if gpus:
            body["spec"]["containers"][0].update(gpu)
        if tolerate:
            body["spec"]["tolerations"] = [
                {"key": "dedicated", "operator": "Equal", "value": "training", "effect": "NoSchedule"}
            ]
        if affinity:
            body["spec"]["affinity"] = {"nodeAffinity": affinity}
        if selector:
            body["spec"]["nodeSelector"] = selector
        cluster.rest.request("POST", f"/api/v1/namespaces/{namespace}/pods", body)

    def node_of(name: str) -> str:
        return str(
            cluster.wait_for(lambda: get(cluster, namespace, name)["spec"].get("nodeName"), WAIT, f"{name} to be bound")
        )

    # Preferred affinity picks the on-demand node, which the pod tolerates.
    make(
        "a",
        tolerate=True,
        affinity={
            "preferredDuringSchedulingIgnoredDuringExecution": [
                {
                    "weight": 50,
                    "preference": {
                        "matchExpressions": [
                            {"key": "karpenter.sh/capacity-type", "operator": "In", "values": ["on-demand"]}
                        ]
                    },
                }
            ]
        },
    )
    assert node_of("a") == "s-od"
    # Required affinity away from us-east-1b, without the toleration: the spot node.
    make(
        "b",
        affinity={
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [
                    {
                        "matchExpressions": [
                            {"key": "topology.kubernetes.io/zone", "operator": "NotIn", "values": ["us-east-1b"]}
                        ]
                    }
                ]
            }
        },
    )
    assert node_of("b") == "s-spot"
    # No GPU left anywhere: Pending, Unschedulable, with a message that says why.
    make("c", tolerate=True)
    unschedulable = cluster.wait_for(
        lambda: (
            condition(get(cluster, namespace, "c"), "PodScheduled").get("reason") == "Unschedulable"
            and get(cluster, namespace, "c")
        ),
        WAIT,
        "c to be unschedulable",
    )
    assert (
        unschedulable["status"]["phase"] == "Pending"
        and "Insufficient nvidia.com/gpu" in condition(unschedulable, "PodScheduled")["message"]
    )
    make("d", selector={"node.kubernetes.io/instance-type": "p5.48xlarge"}, gpus=False)
    assert "didn't match Pod's node affinity/selector" in cluster.wait_for(
        lambda: condition(get(cluster, namespace, "d"), "PodScheduled").get("message"), WAIT, "d's reason"
    )
    make(
        "e",
        affinity={
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [{"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["s-od"]}]}]
            }
        },
        gpus=False,
    )
    assert "untolerated taint {dedicated: training}" in cluster.wait_for(
        lambda: condition(get(cluster, namespace, "e"), "PodScheduled").get("message"), WAIT, "e's reason"
    )
    # Freeing the GPU lets c schedule.
    cluster.rest.request("DELETE", f"/api/v1/namespaces/{namespace}/pods/b", {"gracePeriodSeconds": 0})
    assert node_of("c") == "s-spot"


def test_a_no_execute_taint_evicts_untolerating_pods_with_a_disruption_target(
    cluster: TestCluster, namespace: str
) -> None:
    cluster.add_node("t-node", run_containers=False)
    cluster.rest.request(
        "POST", f"/api/v1/namespaces/{namespace}/pods", pod("victim", ["sleep", "60"], terminationGracePeriodSeconds=30)
    )
    cluster.wait_for(lambda: phase(get(cluster, namespace, "victim")) == "Running", WAIT, "victim to run")
    rv = cluster.rest.get(f"/api/v1/namespaces/{namespace}/pods")["metadata"]["resourceVersion"]
    cluster.taint_node("t-node", "aws-node-termination-handler/spot-itn", "true", "NoExecute")
    # The pod has no processes here, so its kubelet may finish the deletion at once: read the
    # history through a watch rather than racing it.
    cluster.wait_for(lambda: gone(cluster, namespace, "victim"), WAIT, "the eviction to complete")
    events = list(cluster.rest.watch(f"/api/v1/namespaces/{namespace}/pods", rv, timeout_seconds=1))
    marked = [e["object"] for e in events if e["type"] == "MODIFIED" and condition(e["object"], "DisruptionTarget")]
    assert marked, f"no DisruptionTarget condition in {[e['type'] for e in events]}"
    assert condition(marked[0], "DisruptionTarget")["reason"] == "DeletionByTaintManager"
    assert any(e["object"]["metadata"].get("deletionTimestamp") for e in events if e["type"] == "MODIFIED")


@pytest.mark.slow
def test_a_deleted_node_kills_its_processes_and_pod_gc_fails_and_deletes_its_pods(
    cluster: TestCluster, namespace: str
) -> None:
    cluster.add_node("d-node")
    cluster.rest.request(
        "POST",
        f"/api/v1/namespaces/{namespace}/pods",
        pod("lost", [sys.executable, "-c", "import time; time.sleep(600)"]),
    )
    cluster.wait_for(lambda: cluster.pod_pids(namespace, "lost"), WAIT, "the process")
    pids = cluster.pod_pids(namespace, "lost")
    rv = cluster.rest.get(f"/api/v1/namespaces/{namespace}/pods")["metadata"]["resourceVersion"]
    cluster.delete_node("d-node")
    assert not [pid for pid in pids if running(pid)], "delete_node returns once the node's processes are dead"
    cluster.wait_for(lambda: gone(cluster, namespace, "lost"), WAIT, "pod GC")
    events = list(cluster.rest.watch(f"/api/v1/namespaces/{namespace}/pods", rv, timeout_seconds=1))
    failed = [e["object"] for e in events if e["type"] == "MODIFIED" and e["object"]["status"].get("phase") == "Failed"]
    assert failed and condition(failed[-1], "DisruptionTarget")["reason"] == "DeletionByPodGC"
    assert events[-1]["type"] == "BOOKMARK" or events[-1]["type"] == "DELETED"
    assert any(e["type"] == "DELETED" for e in events)
    leases = "/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases"
    cluster.wait_for(
        lambda: "d-node" not in [ls["metadata"]["name"] for ls in cluster.rest.get(leases)["items"]],
        WAIT,
        "the node's Lease to be collected",
    )


@pytest.mark.slow
def test_a_partitioned_node_goes_unknown_while_its_zombie_pod_keeps_running(
    cluster: TestCluster, namespace: str
) -> None:
    cluster.add_node("p-node")
    marker = "/work/zombie"
    body = pod(
        "zombie",
        [
            "python",
            "-c",
            "import pathlib,time\nwhile True:\n    "
            "pathlib.Path('/work/zombie/beat').write_text(str(time.time())); time.sleep(0.1)",
        ],
    )
    body["spec"]["containers"][0]["volumeMounts"] = [{"name": "work", "mountPath": marker}]
    body["spec"]["volumes"] = [{"name": "work", "emptyDir": {}}]
    cluster.rest.request("POST", f"/api/v1/namespaces/{namespace}/pods", body)
    cluster.wait_for(lambda: phase(get(cluster, namespace, "zombie")) == "Running", WAIT, "zombie to run")
    worker = cluster.worker(namespace, "zombie")
    assert worker is not None
    beat = os.path.join(dict(worker.mounts)[marker], "beat")
    cluster.wait_for(lambda: os.path.exists(beat), WAIT, "the zombie's first beat")  # Running: started, not yet beating
    cluster.partition_node("p-node")
    node = cluster.wait_for(
        lambda: (
            (n := cluster.node("p-node"))
            and any(c["type"] == "Ready" and c["status"] == "Unknown" for c in n["status"]["conditions"])
            and n
        ),
        WAIT,
        "Ready=Unknown",
    )
    assert node
    # The node controller writes the Unknown condition and the taint in two updates, as kube's does.
    cluster.wait_for(
        lambda: (
            "node.kubernetes.io/unreachable" in {t["key"] for t in cluster.node("p-node")["spec"].get("taints", [])}
        ),
        WAIT,
        "the unreachable taint",
    )
    cluster.wait_for(
        lambda: condition(get(cluster, namespace, "zombie"), "Ready").get("status") == "False",
        WAIT,
        "the pod to turn NotReady",
    )
    # The control plane (or a controller) force-deletes the pod; the zombie trains on regardless.
    cluster.rest.request("DELETE", f"/api/v1/namespaces/{namespace}/pods/zombie", {"gracePeriodSeconds": 0})
    assert gone(cluster, namespace, "zombie")
    first = Path(beat).read_text()
    cluster.wait_for(lambda: Path(beat).read_text() != first, WAIT, "the zombie to keep writing")
    assert worker.pids()
    cluster.heal_node("p-node")
    cluster.wait_for(lambda: not worker.pids(), WAIT, "the healed kubelet to kill the zombie")
    cluster.wait_for(
        lambda: all(
            c["status"] == "True" for c in cluster.node("p-node")["status"]["conditions"] if c["type"] == "Ready"
        ),
        WAIT,
        "Ready again",
    )
    cluster.wait_for(
        lambda: (
            "node.kubernetes.io/unreachable" not in {t["key"] for t in cluster.node("p-node")["spec"].get("taints", [])}
        ),
        WAIT,
        "the taint to go",
    )


def lease_renewed(cluster: TestCluster, node: str) -> str:
    lease = cluster.rest.get(f"/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases/{node}")
    return str(lease["spec"]["renewTime"])


def test_a_node_reported_not_ready_is_tainted_not_ready(cluster: TestCluster) -> None:
    cluster.add_node("nr-node", run_containers=False)
    cluster.set_node_ready("nr-node", "False")
    cluster.wait_for(
        lambda: "node.kubernetes.io/not-ready" in {t["key"] for t in cluster.node("nr-node")["spec"].get("taints", [])},
        WAIT,
        "the not-ready taint",
    )
    # The kubelet that reports NotReady is alive: it still renews its Lease, so the node is not
    # declared unreachable once the grace has passed, and its heartbeats report NotReady too.
    reported = now_micro()
    cluster.wait_for(lambda: lease_renewed(cluster, "nr-node") > reported, WAIT, "a renewal after the NotReady report")
    ready = condition(cluster.node("nr-node"), "Ready")
    assert ready["status"] == "False" and ready["reason"] == "KubeletNotReady"
    node = cluster.node("nr-node")
    assert node["spec"]["providerID"].startswith("aws:///us-east-1a/i-")
    labels = node["metadata"]["labels"]
    assert (
        labels["topology.kubernetes.io/zone"] == "us-east-1a"
        and labels["node.kubernetes.io/instance-type"] == "g5.xlarge"
        and labels["karpenter.sh/capacity-type"] == "spot"
    )
