"""The control plane's loops that a real cluster runs beside the API server, as internal clients.

- ``Scheduler``: binds Pending pods to nodes (nodeSelector, required node affinity, taints,
  resource requests; preferred affinity, PreferNoSchedule and free room score), or records
  ``PodScheduled=False``/``Unschedulable`` with a message and a FailedScheduling Event.
- ``NodeLifecycle``: a node whose kubelet stopped renewing its Lease (and posting status) for
  ``node_monitor_grace`` seconds becomes Ready=Unknown and gets the ``unreachable`` taints; a
  Ready=False node the ``not-ready`` ones; its pods turn Ready=False. The taint manager evicts pods
  that do not tolerate a NoExecute taint (``DisruptionTarget``/``DeletionByTaintManager``, then a
  graceful delete), at once or after their ``tolerationSeconds``.
- ``PodGC``: pods bound to a Node that no longer exists are marked Failed (``DisruptionTarget``/
  ``DeletionByPodGC``) and force-deleted after ``pod_gc_grace`` seconds; terminating pods on a node
  tainted ``out-of-service`` that is not Ready are force-deleted.
- ``GarbageCollector``: ownerReferences — dependents of a deleted owner are deleted (background),
  deleted first (``foregroundDeletion`` finalizer) or orphaned (``orphan`` finalizer); dependents
  whose owner never existed are deleted too.
- ``NamespaceController``: a deleted namespace's contents are deleted, then the namespace.

Each loop wakes on store events it cares about (a listener sets a flag) and on its own timers.
A loop acts on what it read a moment ago while clients keep writing, so every write names the
object it means by uid (a delete's precondition, a check in the change): an object deleted and
created again under the same name meanwhile is never the one changed. A write that fails for one
object (gone, conflicting, invalid) is logged and retried on a later pass; it never ends the pass
for the other objects, nor the loop.
"""

from __future__ import annotations

import copy
import datetime
import logging
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from .apiserver import ApiServer, DeleteOptions, add_pod_condition, now_micro, now_rfc3339
from .errors import ApiError
from .quantity import parse_quantity, pod_requests
from .selectors import dig
from .store import Event, Obj

log = logging.getLogger(__name__)

SCHEDULER = "system:kube-scheduler"
CONTROLLER = "system:kube-controller-manager"
TERMINAL = ("Succeeded", "Failed")


def _parse_time(value: str | None) -> float | None:
    if not value:
        return None
    try:
        return datetime.datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def record_event(api: ApiServer, involved: Obj, etype: str, reason: str, message: str, component: str) -> None:
    """A core/v1 Event as client-go's recorder writes it; a repeat of the same event bumps count."""
    md = involved["metadata"]
    ns = md.get("namespace") or "default"
    rt = api.registry.get("", "v1", "events")
    assert rt is not None
    key = f"{md['name']}.{reason.lower()}.{abs(hash((md.get('uid'), reason, message))) % 10**8:08d}"
    existing = api.store.get("core/events", ns, key)
    now = now_rfc3339()
    if existing is not None:

        def bump(e: Obj) -> None:
            e["count"] = int(e.get("count") or 1) + 1
            e["lastTimestamp"] = now

        api.mutate("core/events", ns, key, bump, user=component)
        return
    body = {
        "metadata": {"name": key, "namespace": ns},
        "involvedObject": {
            k: v
            for k, v in {
                "kind": involved.get("kind"),
                "namespace": md.get("namespace"),
                "name": md["name"],
                "uid": md.get("uid"),
                "apiVersion": involved.get("apiVersion"),
                "resourceVersion": md.get("resourceVersion"),
            }.items()
            if v
        },
        "reason": reason,
        "message": message,
        "type": etype,
        "source": {"component": component.split(":")[-1]},
        "firstTimestamp": now,
        "lastTimestamp": now,
        "count": 1,
        "reportingComponent": component.split(":")[-1],
        "reportingInstance": "",
        "eventTime": None,
    }
    body.pop("eventTime")
    try:
        api.create(rt, ns, body, user=component)
    except ApiError as e:
        log.debug("event not recorded: %s", e)


class Loop:
    """A thread that runs ``step()`` when woken by a store event or after ``period`` seconds."""

    name = "loop"
    period = 1.0
    watches: tuple[str, ...] = ()

    def __init__(self, api: ApiServer) -> None:
        self.api = api
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"test-{self.name}", daemon=True)
        api.store.add_listener(self._on_event)

    def _on_event(self, event: Event) -> None:
        if event.resource in self.watches and self.wants(event):
            self._wake.set()

    def wants(self, event: Event) -> bool:
        return True

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=5)

    def wake(self) -> None:
        self._wake.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.next_wait())
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                self.step()
            except Exception:
                log.exception("test control plane: %s failed a pass", self.name)

    def next_wait(self) -> float:
        return self.period

    def step(self) -> None:
        raise NotImplementedError


# Scheduling --------------------------------------------------------------------------------


def tolerates(tolerations: Iterable[dict[str, Any]], taint: dict[str, Any]) -> dict[str, Any] | None:
    """The toleration that tolerates ``taint``, if any (key/operator/value/effect rules)."""
    for t in tolerations:
        if t.get("effect") and t["effect"] != taint.get("effect"):
            continue
        op = t.get("operator") or "Equal"
        if op == "Exists":
            if not t.get("key") or t["key"] == taint.get("key"):
                return t
        elif t.get("key") == taint.get("key") and (t.get("value") or "") == (taint.get("value") or ""):
            return t
    return None


def _expr_matches(expr: dict[str, Any], values: dict[str, str]) -> bool:
    key, op, want = expr.get("key", ""), expr.get("operator", ""), list(expr.get("values") or [])
    has = key in values
    if op == "In":
        return has and values[key] in want
    if op == "NotIn":
        return not has or values[key] not in want
    if op == "Exists":
        return has
    if op == "DoesNotExist":
        return not has
    if op in ("Gt", "Lt"):
        try:
            got, bound = int(values[key]), int(want[0])
        except (KeyError, ValueError, IndexError):
            return False
        return got > bound if op == "Gt" else got < bound
    return False


def term_matches(term: dict[str, Any], node: Obj) -> bool:
    exprs = term.get("matchExpressions") or []
    fields = term.get("matchFields") or []
    if not exprs and not fields:
        return False  # an empty term matches no node
    labels = dig(node, "metadata", "labels") or {}
    return all(_expr_matches(e, labels) for e in exprs) and all(
        _expr_matches(f, {"metadata.name": node["metadata"]["name"]}) for f in fields
    )


@dataclass
class Fit:
    ok: bool
    reason: str = ""


def node_fits(pod: Obj, node: Obj, used: dict[str, float], pods_on_node: int) -> Fit:
    spec = pod.get("spec") or {}
    if node["metadata"].get("deletionTimestamp"):
        return Fit(False, "node(s) were being deleted")
    if dig(node, "spec", "unschedulable") and not tolerates(
        spec.get("tolerations") or [], {"key": "node.kubernetes.io/unschedulable", "effect": "NoSchedule"}
    ):
        return Fit(False, "node(s) were unschedulable")
    labels = dig(node, "metadata", "labels") or {}
    for k, v in (spec.get("nodeSelector") or {}).items():
        if labels.get(k) != v:
            return Fit(False, "node(s) didn't match Pod's node affinity/selector")
    required = dig(spec, "affinity", "nodeAffinity", "requiredDuringSchedulingIgnoredDuringExecution")
    if required is not None and not any(term_matches(t, node) for t in required.get("nodeSelectorTerms") or []):
        return Fit(False, "node(s) didn't match Pod's node affinity/selector")
    for taint in dig(node, "spec", "taints") or []:
        if taint.get("effect") in ("NoSchedule", "NoExecute") and not tolerates(spec.get("tolerations") or [], taint):
            value = f": {taint['value']}" if taint.get("value") else ""
            return Fit(False, f"node(s) had untolerated taint {{{taint.get('key')}{value}}}")
    alloc = dig(node, "status", "allocatable") or dig(node, "status", "capacity") or {}
    if pods_on_node + 1 > parse_quantity(alloc.get("pods", 110)):
        return Fit(False, "Too many pods")
    for name, amount in pod_requests(pod).items():
        if amount <= 0:
            continue
        have = parse_quantity(alloc.get(name, 0))
        if used.get(name, 0.0) + amount > have + 1e-9:
            return Fit(False, f"Insufficient {name}")
    return Fit(True)


def node_score(pod: Obj, node: Obj, used: dict[str, float]) -> float:
    spec = pod.get("spec") or {}
    score = 0.0
    for pref in dig(spec, "affinity", "nodeAffinity", "preferredDuringSchedulingIgnoredDuringExecution") or []:
        if term_matches(pref.get("preference") or {}, node):
            score += float(pref.get("weight", 0)) * 100
    for taint in dig(node, "spec", "taints") or []:
        if taint.get("effect") == "PreferNoSchedule" and not tolerates(spec.get("tolerations") or [], taint):
            score -= 1000
    alloc = dig(node, "status", "allocatable") or {}
    free = 0.0
    for name in ("cpu", "memory"):
        have = parse_quantity(alloc.get(name, 0))
        if have > 0:
            free += (have - used.get(name, 0.0)) / have
    return score + free  # least-allocated breaks ties, as the default scheduler's scoring does


class Scheduler(Loop):
    name = "scheduler"
    period = 1.0
    watches = ("core/pods", "core/nodes")

    def __init__(self, api: ApiServer) -> None:
        super().__init__(api)
        self._last_message: dict[str, str] = {}

    def wants(self, event: Event) -> bool:
        if event.resource == "core/nodes":
            return True
        spec = event.obj.get("spec") or {}
        return not spec.get("nodeName") or event.type == "DELETED" or dig(event.obj, "status", "phase") in TERMINAL

    def step(self) -> None:
        api = self.api
        with api.store.lock:
            pods = api.store.select("core/pods")
            if not any(not dig(p, "spec", "nodeName") for p in pods):
                return  # nothing to schedule: no pass over every node
            nodes = sorted(api.store.select("core/nodes"), key=lambda n: n["metadata"]["name"])
        used: dict[str, dict[str, float]] = {n["metadata"]["name"]: {} for n in nodes}
        count: dict[str, int] = dict.fromkeys(used, 0)
        pending = []
        for p in pods:
            node = dig(p, "spec", "nodeName")
            if node:
                if node in used and dig(p, "status", "phase") not in TERMINAL:
                    count[node] += 1
                    for k, v in pod_requests(p).items():
                        used[node][k] = used[node].get(k, 0.0) + v
            elif (
                not p["metadata"].get("deletionTimestamp")
                and (p.get("spec") or {}).get("schedulerName", "default-scheduler") == "default-scheduler"
            ):
                pending.append(p)
        pending.sort(key=lambda p: (p["metadata"].get("creationTimestamp", ""), p["metadata"]["name"]))
        for pod in pending:
            fits: list[tuple[float, str]] = []
            reasons: dict[str, int] = {}
            for n in nodes:
                name = n["metadata"]["name"]
                fit = node_fits(pod, n, used[name], count[name])
                if fit.ok:
                    fits.append((node_score(pod, n, used[name]), name))
                else:
                    reasons[fit.reason] = reasons.get(fit.reason, 0) + 1
            md = pod["metadata"]
            key = f"{md['namespace']}/{md['name']}"
            try:
                if fits:
                    best = max(fits, key=lambda f: (f[0], [-ord(c) for c in f[1]]))[1]
                    if self._bind(pod, best):
                        count[best] += 1
                        for k, v in pod_requests(pod).items():
                            used[best][k] = used[best].get(k, 0.0) + v
                        self._last_message.pop(key, None)
                    continue
                detail = ", ".join(f"{n} {r}" for r, n in sorted(reasons.items()))
                message = (
                    f"0/{len(nodes)} nodes are available: {detail + '. ' if detail else ''}preemption: "
                    f"0/{len(nodes)} nodes are available: {len(nodes)} Preemption is not helpful for scheduling."
                )
                if self._last_message.get(key) != message:
                    self._unschedulable(pod, message)
                    self._last_message[key] = message
            except ApiError as e:
                log.debug("test control plane: scheduling %s failed (%s); next pass", key, e)

    def _bind(self, pod: Obj, node: str) -> bool:
        md = pod["metadata"]

        def assign(p: Obj) -> bool:
            if (
                p["metadata"].get("uid") != md["uid"]
                or (p.get("spec") or {}).get("nodeName")
                or p["metadata"].get("deletionTimestamp")
            ):
                return False
            p["spec"]["nodeName"] = node
            conds = [c for c in (p.get("status") or {}).get("conditions") or [] if c.get("type") != "PodScheduled"]
            conds.append(
                {"type": "PodScheduled", "status": "True", "lastProbeTime": None, "lastTransitionTime": now_rfc3339()}
            )
            p.setdefault("status", {})["conditions"] = conds
            return True

        stored = self.api.mutate("core/pods", md["namespace"], md["name"], assign, user=SCHEDULER)
        if stored is None or stored["metadata"].get("uid") != md["uid"] or dig(stored, "spec", "nodeName") != node:
            return False
        record_event(
            self.api,
            stored,
            "Normal",
            "Scheduled",
            f"Successfully assigned {md['namespace']}/{md['name']} to {node}",
            "default-scheduler",
        )
        return True

    def _unschedulable(self, pod: Obj, message: str) -> None:
        md = pod["metadata"]
        add_pod_condition(
            self.api,
            md["namespace"],
            md["name"],
            "PodScheduled",
            "False",
            "Unschedulable",
            message,
            SCHEDULER,
            uid=md["uid"],
        )
        record_event(self.api, pod, "Warning", "FailedScheduling", message, "default-scheduler")


# Node lifecycle and taint manager ------------------------------------------------------------

UNREACHABLE = "node.kubernetes.io/unreachable"
NOT_READY = "node.kubernetes.io/not-ready"
OUT_OF_SERVICE = "node.kubernetes.io/out-of-service"


def node_ready(node: Obj) -> str:
    for c in dig(node, "status", "conditions") or []:
        if c.get("type") == "Ready":
            return str(c.get("status", "Unknown"))
    return "Unknown"


def _wanted_taints(taints: list[dict[str, Any]], want: str | None) -> list[dict[str, Any]] | None:
    """The node's taints with only ``want`` of the not-ready/unreachable ones; None when they are
    already so (a pass over a thousand healthy nodes then copies and writes nothing)."""
    keep = [t for t in taints if t.get("key") not in (UNREACHABLE, NOT_READY) or t.get("key") == want]
    if want:
        for effect in ("NoSchedule", "NoExecute"):
            if not any(t.get("key") == want and t.get("effect") == effect for t in keep):
                t: dict[str, Any] = {"key": want, "effect": effect}
                if effect == "NoExecute":
                    t["timeAdded"] = now_rfc3339()
                keep.append(t)
    return None if keep == list(taints) else keep


class NodeLifecycle(Loop):
    name = "node-lifecycle"
    watches = ("core/nodes", "core/pods")

    def __init__(self, api: ApiServer, node_monitor_grace: float = 40.0, period: float = 0.5) -> None:
        self._changed: set[str] = set()
        self._changed_lock = threading.Lock()
        self._next_full = 0.0
        super().__init__(api)
        self.node_monitor_grace = node_monitor_grace
        self.period = period
        self._evicted: set[str] = set()

    def wants(self, event: Event) -> bool:
        if event.resource == "core/nodes":
            return True
        return event.type == "ADDED" or dig(event.obj, "spec", "nodeName") != dig(event.prev or {}, "spec", "nodeName")

    def _on_event(self, event: Event) -> None:
        # A change wakes a pass over the nodes it touched only; every ``period`` a pass covers
        # them all (a Lease that stopped being renewed changes no Node). A cluster of a thousand
        # nodes then costs per change, not per node and change.
        if event.resource in self.watches and self.wants(event):
            name = (
                event.obj["metadata"]["name"] if event.resource == "core/nodes" else dig(event.obj, "spec", "nodeName")
            )
            if name:
                with self._changed_lock:
                    self._changed.add(str(name))
            self._wake.set()

    def wake(self) -> None:
        self._next_full = 0.0  # a timer of the taint manager: every pod is due a look
        super().wake()

    def next_wait(self) -> float:
        return max(0.0, self._next_full - time.monotonic())

    def step(self) -> None:
        api = self.api
        now = time.time()
        full = time.monotonic() >= self._next_full
        if full:
            self._next_full = time.monotonic() + self.period
        with self._changed_lock:
            changed, self._changed = self._changed, set()
        with api.store.lock:
            if full:
                nodes = api.store.select("core/nodes")
            else:
                found = (api.store.get("core/nodes", "", name) for name in sorted(changed))
                nodes = [n for n in found if n is not None]
        for node in nodes:
            try:
                self._monitor(node, now)
            except ApiError as e:
                log.debug("test control plane: node %s not updated (%s); next pass", node["metadata"]["name"], e)
        self._taint_manager(now, None if full else changed)

    def _monitor(self, node: Obj, now: float) -> None:
        name = node["metadata"]["name"]
        lease = self.api.store.get("coordination.k8s.io/leases", "kube-node-lease", name)
        ready = next((c for c in dig(node, "status", "conditions") or [] if c.get("type") == "Ready"), None)
        seen = max(
            _parse_time(dig(lease or {}, "spec", "renewTime")) or 0.0,
            _parse_time((ready or {}).get("lastHeartbeatTime")) or 0.0,
            _parse_time(node["metadata"].get("creationTimestamp")) or 0.0,
        )
        status = node_ready(node)
        if status != "Unknown" and ready is not None and now - seen > self.node_monitor_grace:
            self._mark_unknown(name)
            status = "Unknown"
        want = {"Unknown": UNREACHABLE, "False": NOT_READY}.get(status)
        if _wanted_taints(dig(node, "spec", "taints") or [], want) is not None:
            self._set_taints(name, want)  # re-checked on a fresh copy under the store's lock
        if status != "True":
            self._mark_pods_not_ready(name)

    def _mark_unknown(self, name: str) -> None:
        def change(n: Obj) -> None:
            now = now_rfc3339()
            for c in n.setdefault("status", {}).setdefault("conditions", []):
                if c.get("status") != "Unknown":
                    c.update(
                        status="Unknown",
                        reason="NodeStatusUnknown",
                        message="Kubelet stopped posting node status.",
                        lastTransitionTime=now,
                    )

        log.info("test control plane: node %s stopped renewing its lease; Ready=Unknown", name)
        self.api.mutate("core/nodes", "", name, change, user=CONTROLLER, subresource="status")

    def _set_taints(self, name: str, want: str | None) -> None:
        def change(n: Obj) -> bool:
            keep = _wanted_taints(dig(n, "spec", "taints") or [], want)
            if keep is None:
                return False
            n.setdefault("spec", {})["taints"] = keep
            if not keep:
                n["spec"].pop("taints")
            return True

        self.api.mutate("core/nodes", "", name, change, user=CONTROLLER)

    def _mark_pods_not_ready(self, node: str) -> None:
        for pod in self.api.store.select("core/pods"):
            if dig(pod, "spec", "nodeName") != node or dig(pod, "status", "phase") in TERMINAL:
                continue
            conds = dig(pod, "status", "conditions") or []
            if any(c.get("type") == "Ready" and c.get("status") == "True" for c in conds):
                uid = pod["metadata"]["uid"]

                def change(p: Obj, uid: str = uid) -> bool:
                    if p["metadata"].get("uid") != uid:
                        return False
                    now = now_rfc3339()
                    for c in p["status"]["conditions"]:
                        if c.get("type") in ("Ready", "ContainersReady") and c.get("status") == "True":
                            c.update(
                                status="False",
                                reason="NodeNotReady" if c["type"] == "Ready" else c.get("reason"),
                                lastTransitionTime=now,
                            )
                            if c.get("reason") is None:
                                c.pop("reason")
                    return True

                md = pod["metadata"]
                self.api.mutate("core/pods", md["namespace"], md["name"], change, user=CONTROLLER, subresource="status")

    def _taint_manager(self, now: float, only: set[str] | None = None) -> None:
        """Evict pods that do not tolerate their node's NoExecute taints (of the nodes ``only``, if given)."""
        api = self.api
        for pod in api.store.select("core/pods"):
            node_name = dig(pod, "spec", "nodeName") or ""
            if only is not None and node_name not in only:
                continue
            node = api.store.get("core/nodes", "", node_name) if node_name else None
            md = pod["metadata"]
            if node is None or md.get("deletionTimestamp") or dig(pod, "status", "phase") in TERMINAL:
                continue
            taints = [t for t in dig(node, "spec", "taints") or [] if t.get("effect") == "NoExecute"]
            if not taints:
                continue
            due = now
            evict = False
            for taint in taints:
                tol = tolerates(dig(pod, "spec", "tolerations") or [], taint)
                if tol is None:
                    evict = True
                    due = now
                    break
                if tol.get("tolerationSeconds") is not None:
                    added = _parse_time(taint.get("timeAdded")) or now
                    due = max(due, added + max(0, int(tol["tolerationSeconds"])))
                    evict = True
            if not evict:
                continue
            if due > now:
                self._wake_at(due)
                continue
            key = md["uid"]
            if key in self._evicted:
                continue
            log.info(
                "test control plane: taint manager evicts %s/%s from %s",
                md["namespace"],
                md["name"],
                node["metadata"]["name"],
            )
            try:
                add_pod_condition(
                    api,
                    md["namespace"],
                    md["name"],
                    "DisruptionTarget",
                    "True",
                    "DeletionByTaintManager",
                    "Taint manager: deleting due to NoExecute taint",
                    CONTROLLER,
                    uid=key,
                )
                api.delete(
                    api.registry.primary("core/pods"),
                    md["namespace"],
                    md["name"],
                    DeleteOptions(uid=key),
                    user=CONTROLLER,
                )
            except ApiError as e:
                if e.code not in (404, 409):  # 404/409: gone, or a new pod of that name; nothing to evict
                    log.debug(
                        "test control plane: evicting %s/%s failed (%s); next pass", md["namespace"], md["name"], e
                    )
                    continue
            self._evicted.add(key)
            record_event(
                api,
                pod,
                "Normal",
                "TaintManagerEviction",
                f"Marking for deletion Pod {md['namespace']}/{md['name']}",
                "taint-eviction-controller",
            )

    def _wake_at(self, when: float) -> None:
        delay = max(0.05, when - time.time())
        timer = threading.Timer(delay, self.wake)
        timer.daemon = True
        timer.start()


class PodGC(Loop):
    name = "pod-gc"
    watches = ("core/nodes",)

    def __init__(self, api: ApiServer, grace: float = 40.0, period: float = 0.5) -> None:
        super().__init__(api)
        self.grace = grace
        self.period = period
        self._orphaned_since: dict[str, float] = {}

    def step(self) -> None:
        api = self.api
        now = time.monotonic()
        for pod in api.store.select("core/pods"):
            try:
                self._collect(pod, now)
            except ApiError as e:
                md = pod["metadata"]
                log.debug("test control plane: pod GC of %s/%s failed (%s); next pass", md["namespace"], md["name"], e)

    def _collect(self, pod: Obj, now: float) -> None:
        api = self.api
        md = pod["metadata"]
        node_name = dig(pod, "spec", "nodeName")
        if not node_name:
            return
        node = api.store.get("core/nodes", "", node_name)
        if node is None:
            first = self._orphaned_since.setdefault(md["uid"], now)
            if now - first < self.grace:
                return
            if dig(pod, "status", "phase") not in TERMINAL:
                add_pod_condition(
                    api,
                    md["namespace"],
                    md["name"],
                    "DisruptionTarget",
                    "True",
                    "DeletionByPodGC",
                    "PodGC: node no longer exists",
                    CONTROLLER,
                    uid=md["uid"],
                )

                def fail(p: Obj) -> bool:
                    if p["metadata"].get("uid") != md["uid"]:
                        return False
                    p.setdefault("status", {})["phase"] = "Failed"
                    return True

                api.mutate("core/pods", md["namespace"], md["name"], fail, user=CONTROLLER, subresource="status")
            log.info(
                "test control plane: pod GC force-deletes %s/%s (node %s is gone)",
                md["namespace"],
                md["name"],
                node_name,
            )
            self._force_delete(pod)
            self._orphaned_since.pop(md["uid"], None)
        elif (
            md.get("deletionTimestamp")
            and node_ready(node) != "True"
            and any(t.get("key") == OUT_OF_SERVICE for t in dig(node, "spec", "taints") or [])
        ):
            self._force_delete(pod)

    def _force_delete(self, pod: Obj) -> None:
        md = pod["metadata"]
        try:
            self.api.delete(
                self.api.registry.primary("core/pods"),
                md["namespace"],
                md["name"],
                DeleteOptions(grace_period=0, uid=md["uid"]),
                user=CONTROLLER,
            )
        except ApiError:
            pass  # gone already, or a new pod of that name (the uid precondition): not ours to delete


# Garbage collector -------------------------------------------------------------------------


class GarbageCollector(Loop):
    name = "garbage-collector"
    period = 0.5

    def __init__(self, api: ApiServer) -> None:
        super().__init__(api)
        self._uids: dict[str, tuple[str, str, str]] = {}
        self._dependents: dict[str, set[tuple[str, str, str]]] = {}
        self._dirty: set[str] = set()  # owner uids to re-check
        self._new: set[tuple[str, str, str]] = set()  # dependents to check for an absent owner
        self._lock = threading.Lock()

    def _on_event(self, event: Event) -> None:
        md = event.obj["metadata"]
        key = (event.resource, md.get("namespace", ""), md["name"])
        uid = md.get("uid", "")
        with self._lock:
            if event.type == "DELETED":
                self._uids.pop(uid, None)
                self._dirty.add(uid)
            else:
                self._uids[uid] = key
                if md.get("deletionTimestamp") and {"foregroundDeletion", "orphan"} & set(md.get("finalizers") or []):
                    self._dirty.add(uid)
            old_owners = {r.get("uid") for r in dig(event.prev or {}, "metadata", "ownerReferences") or []}
            new_owners = {r.get("uid") for r in md.get("ownerReferences") or []} if event.type != "DELETED" else set()
            for o in old_owners - new_owners:
                self._dependents.get(o, set()).discard(key)
                self._dirty.add(o)
            for o in new_owners - old_owners:
                self._dependents.setdefault(o, set()).add(key)
                self._new.add(key)
            if event.type == "DELETED":
                for o in new_owners | {r.get("uid") for r in md.get("ownerReferences") or []}:
                    self._dependents.get(o, set()).discard(key)
                    self._dirty.add(o)
        self._wake.set()

    def step(self) -> None:
        with self._lock:
            dirty, self._dirty = self._dirty, set()
            new, self._new = self._new, set()
        for uid in dirty:
            try:
                self._process_owner(uid)
            except ApiError as e:
                log.debug("test control plane: garbage collection of owner %s failed (%s); next pass", uid, e)
                with self._lock:
                    self._dirty.add(uid)
        for key in new:
            try:
                self._check_owners(key)
            except ApiError as e:
                log.debug("test control plane: owners of %s/%s not checked (%s); next pass", key[1], key[2], e)
                with self._lock:
                    self._new.add(key)

    def _process_owner(self, uid: str) -> None:
        api = self.api
        with self._lock:
            owner_key = self._uids.get(uid)
            dependents = list(self._dependents.get(uid, set()))
        owner = api.store.get(*owner_key) if owner_key else None
        if owner is None:
            for dep in dependents:
                self._dangling(dep, uid)
            return
        md = owner["metadata"]
        finalizers = md.get("finalizers") or []
        if not md.get("deletionTimestamp"):
            return
        if "orphan" in finalizers:
            for dep in dependents:
                api.mutate(dep[0], dep[1], dep[2], lambda d: _drop_owner(d, uid), user=CONTROLLER)
            self._remove_finalizer(owner_key, "orphan")  # type: ignore[arg-type]
        elif "foregroundDeletion" in finalizers:
            blocking = [(d, o) for d in dependents if (o := api.store.get(*d)) is not None and _owned_by(o, uid)]
            for dep, obj in blocking:
                if not obj["metadata"].get("deletionTimestamp"):
                    self._delete(dep, obj, "Foreground", owner=uid)
            if not blocking:
                self._remove_finalizer(owner_key, "foregroundDeletion")  # type: ignore[arg-type]

    def _dangling(self, dep: tuple[str, str, str], gone_uid: str) -> None:
        obj = self.api.store.get(*dep)
        if obj is None or not _owned_by(obj, gone_uid):
            return  # gone, or a new object of that name (a new node's Lease): not a dependent of it
        refs = obj["metadata"].get("ownerReferences") or []
        alive = [r for r in refs if r.get("uid") != gone_uid and self._owner_exists(dep, r)]
        if alive:
            self.api.mutate(dep[0], dep[1], dep[2], lambda d: _drop_owner(d, gone_uid), user=CONTROLLER)
        elif not obj["metadata"].get("deletionTimestamp"):
            self._delete(dep, obj, "Background")

    def _owner_exists(self, dep: tuple[str, str, str], ref: dict[str, Any]) -> bool:
        with self._lock:
            key = self._uids.get(ref.get("uid", ""))
        return key is not None and self.api.store.get(*key) is not None

    def _check_owners(self, dep: tuple[str, str, str]) -> None:
        obj = self.api.store.get(*dep)
        if obj is None:
            return
        refs = obj["metadata"].get("ownerReferences") or []
        if refs and not any(self._owner_exists(dep, r) for r in refs):
            log.info("test control plane: garbage collector deletes %s/%s: its owners are gone", dep[1], dep[2])
            self._delete(dep, obj, "Background")

    def _delete(self, dep: tuple[str, str, str], obj: Obj, propagation: str, owner: str = "") -> None:
        """Delete the object as read: its uid and resourceVersion are the preconditions, so an
        object written meanwhile (a new node taking over the Lease of an earlier node of its name,
        a new object of that name) is not deleted on a stale reading. It is checked again on the
        next pass instead (and its foreground ``owner`` with it)."""
        md = obj["metadata"]
        opts = DeleteOptions(propagation=propagation, uid=md["uid"], resource_version=md["resourceVersion"])
        try:
            self.api.delete(self.api.registry.primary(dep[0]), dep[1], dep[2], opts, user=CONTROLLER)
        except ApiError as e:
            if e.code == 409:
                with self._lock:
                    self._new.add(dep)
                    if owner:
                        self._dirty.add(owner)
                self._wake.set()
            elif e.code != 404:  # 404: gone already
                raise

    def _remove_finalizer(self, key: tuple[str, str, str], finalizer: str) -> None:
        def change(o: Obj) -> None:
            o["metadata"]["finalizers"] = [f for f in o["metadata"].get("finalizers") or [] if f != finalizer]
            if not o["metadata"]["finalizers"]:
                del o["metadata"]["finalizers"]

        self.api.mutate(key[0], key[1], key[2], change, user=CONTROLLER)


def _owned_by(obj: Obj, uid: str) -> bool:
    return any(r.get("uid") == uid for r in obj["metadata"].get("ownerReferences") or [])


def _drop_owner(obj: Obj, uid: str) -> bool:
    refs = obj["metadata"].get("ownerReferences") or []
    keep = [r for r in refs if r.get("uid") != uid]
    if keep == refs:
        return False
    if keep:
        obj["metadata"]["ownerReferences"] = keep
    else:
        obj["metadata"].pop("ownerReferences", None)
    return True


class NamespaceController(Loop):
    name = "namespace-controller"
    watches = ("core/namespaces",)
    period = 0.5

    def step(self) -> None:
        api = self.api
        for ns in api.store.select("core/namespaces"):
            if not ns["metadata"].get("deletionTimestamp"):
                continue
            name = ns["metadata"]["name"]
            remaining = 0
            for storage, types in list(api.registry.by_storage.items()):
                rt = types[0]
                if not rt.namespaced:
                    continue
                for obj in api.store.select(storage, name):
                    remaining += 1
                    if not obj["metadata"].get("deletionTimestamp"):
                        try:
                            api.delete(rt, name, obj["metadata"]["name"], DeleteOptions(), user=CONTROLLER)
                        except ApiError:
                            pass
            if remaining == 0:
                api.remove_now("core/namespaces", "", name)


def copy_obj(obj: Obj) -> Obj:
    return copy.deepcopy(obj)


__all__ = [
    "GarbageCollector",
    "NamespaceController",
    "NodeLifecycle",
    "PodGC",
    "Scheduler",
    "now_micro",
    "record_event",
    "tolerates",
]
