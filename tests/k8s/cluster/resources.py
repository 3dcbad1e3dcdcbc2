"""What the test API server serves: resource types (built-in and from CRDs), discovery, Tables.

A ``ResourceType`` is one group/version/plural with its kind, scope, names, verbs, subresources,
the field selectors it supports and how ``kubectl get`` shows it (a ``meta.k8s.io/v1`` Table).
Built-in kinds are declared below; each served CRD version adds one. Core ``v1`` Events and
``events.k8s.io/v1`` Events are one stored collection seen through two shapes, as on a real server.
"""

from __future__ import annotations

import datetime
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .cel import RuleValidator
from .schema import StructuralSchema
from .selectors import FieldGetter, dig, field_getter

Obj = dict[str, Any]

ALL_VERBS = ["create", "delete", "deletecollection", "get", "list", "patch", "update", "watch"]


@dataclass
class Column:
    name: str
    type: str  # string, integer, number, boolean, date
    json_path: str = ""
    description: str = ""
    priority: int = 0
    format: str = ""
    getter: Callable[[Obj], Any] | None = None

    def definition(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "type": self.type,
            "format": self.format,
            "description": self.description,
            "priority": self.priority,
        }


@dataclass
class ResourceType:
    group: str
    version: str
    plural: str
    kind: str
    namespaced: bool
    singular: str = ""
    short_names: list[str] = field(default_factory=list)
    categories: list[str] = field(default_factory=list)
    subresources: list[str] = field(default_factory=list)  # "status", "binding", "eviction"
    verbs: list[str] = field(default_factory=lambda: list(ALL_VERBS))
    fields: dict[str, FieldGetter] = field(default_factory=dict)
    columns: list[Column] = field(default_factory=list)
    storage: str = ""  # storage id; several views may share one (events)
    crd: StructuralSchema | None = None  # a custom resource's schema
    crd_name: str = ""
    status_subresource: bool = False  # main-resource writes ignore .status; /status changes only .status
    to_view: Callable[[Obj], Obj] | None = None  # stored shape -> this version's shape
    from_view: Callable[[Obj], Obj] | None = None
    # Spec writes bump metadata.generation (not status writes; kinds without spec never do).
    has_generation: bool = True

    def __post_init__(self) -> None:
        self.singular = self.singular or self.kind.lower()
        self.storage = self.storage or f"{self.group or 'core'}/{self.plural}"
        base = {"metadata.name": field_getter("metadata", "name")}
        if self.namespaced:
            base["metadata.namespace"] = field_getter("metadata", "namespace")
        self.fields = {**base, **self.fields}

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def group_version(self) -> str:
        return self.api_version

    @property
    def qualified(self) -> str:
        """``pods``, ``spotjobs.spotjob.dev`` — how error messages name a resource."""
        return f"{self.plural}.{self.group}" if self.group else self.plural

    @property
    def is_custom(self) -> bool:
        return self.crd is not None

    def view(self, obj: Obj) -> Obj:
        return self.to_view(obj) if self.to_view else obj

    def discovery(self) -> list[dict[str, Any]]:
        out = [
            {
                "name": self.plural,
                "singularName": self.singular,
                "namespaced": self.namespaced,
                "kind": self.kind,
                "verbs": self.verbs,
                **({"shortNames": self.short_names} if self.short_names else {}),
                **({"categories": self.categories} if self.categories else {}),
            }
        ]
        for sub in self.subresources:
            verbs = {"status": ["get", "patch", "update"], "binding": ["create"], "eviction": ["create"]}[sub]
            kind = {"binding": "Binding", "eviction": "Eviction"}.get(sub, self.kind)
            entry: dict[str, Any] = {
                "name": f"{self.plural}/{sub}",
                "singularName": "",
                "namespaced": self.namespaced,
                "kind": kind,
                "verbs": verbs,
            }
            if sub == "eviction":
                entry.update(group="policy", version="v1")
            out.append(entry)
        return out


# Tables ------------------------------------------------------------------------------------


def _parse_time(value: str) -> datetime.datetime | None:
    try:
        return datetime.datetime.fromisoformat(value.replace("Z", "+00:00"))
    except (ValueError, AttributeError):
        return None


def human_duration(seconds: float) -> str:
    """Kubernetes' short age format: 45s, 3m20s, 17m, 2h5m, 30h, 3d4h, 20d, 2y30d."""
    s = int(seconds)
    if s < -1:
        return "<invalid>"
    if s < 0:
        return "0s"
    if s < 120:
        return f"{s}s"
    m = s // 60
    if m < 10:
        return f"{m}m{s % 60}s" if s % 60 else f"{m}m"
    if m < 180:
        return f"{m}m"
    h = m // 60
    if h < 8:
        return f"{h}h{m % 60}m" if m % 60 else f"{h}h"
    if h < 48:
        return f"{h}h"
    d = h // 24
    if h < 24 * 8:
        return f"{d}d{h % 24}h" if h % 24 else f"{d}d"
    if d < 365 * 2:
        return f"{d}d"
    y = d // 365
    return f"{y}y{d % 365}d" if d < 365 * 8 and d % 365 else f"{y}y"


def age(obj: Obj) -> str:
    t = _parse_time(dig(obj, "metadata", "creationTimestamp") or "")
    if t is None:
        return "<unknown>"
    return human_duration((datetime.datetime.now(datetime.UTC) - t).total_seconds())


_SEGMENT = re.compile(
    r"\.([A-Za-z0-9_$-]+)|\[(\d+|\*)\]|\[\?\(@\.([A-Za-z0-9_.]+)\s*==\s*['\"]([^'\"]*)['\"]\)\]|\['([^']+)'\]"
)


def jsonpath(obj: Any, path: str) -> list[Any]:
    """The JSONPath subset printer columns use: .a.b, [n], [*], ['key'], [?(@.f=="v")]."""
    path = path.strip()
    if path.startswith("{") and path.endswith("}"):
        path = path[1:-1]
    if path.startswith("$"):
        path = path[1:]
    current = [obj]
    pos = 0
    while pos < len(path):
        m = _SEGMENT.match(path, pos)
        if not m:
            raise ValueError(f"unsupported JSONPath {path!r} at {path[pos:]!r}")
        pos = m.end()
        nxt: list[Any] = []
        for v in current:
            if m.group(1) is not None or m.group(5) is not None:
                key = m.group(1) if m.group(1) is not None else m.group(5)
                if isinstance(v, dict) and key in v:
                    nxt.append(v[key])
            elif m.group(2) is not None:
                if isinstance(v, list):
                    if m.group(2) == "*":
                        nxt.extend(v)
                    elif int(m.group(2)) < len(v):
                        nxt.append(v[int(m.group(2))])
            else:
                if isinstance(v, list):
                    fpath, want = m.group(3).split("."), m.group(4)
                    nxt.extend(i for i in v if isinstance(i, dict) and str(dig(i, *fpath)) == want)
        current = nxt
    return current


def column_cell(col: Column, obj: Obj) -> Any:
    if col.getter is not None:
        return col.getter(obj)
    try:
        values = jsonpath(obj, col.json_path)
    except ValueError:
        return None
    if not values:
        return None
    value = values[0] if len(values) == 1 else ",".join(str(v) for v in values)
    if col.type == "date":
        t = _parse_time(value) if isinstance(value, str) else None
        return human_duration((datetime.datetime.now(datetime.UTC) - t).total_seconds()) if t else None
    if col.type == "integer" and isinstance(value, int | float) and not isinstance(value, bool):
        return int(value)
    if col.type == "number" and isinstance(value, int | float):
        return value
    if col.type == "boolean" and isinstance(value, bool):
        return value
    if col.type in ("integer", "number", "boolean"):
        return None
    return value if isinstance(value, str) else _to_str(value)


def _to_str(value: Any) -> str:
    import json

    return json.dumps(value, separators=(",", ":")) if isinstance(value, dict | list) else str(value)


NAME_COLUMN = Column(
    "Name",
    "string",
    format="name",
    description="Name must be unique within a namespace.",
    getter=lambda o: o["metadata"]["name"],
)
AGE_COLUMN = Column(
    "Age",
    "date",
    description="CreationTimestamp is a timestamp representing the server time when this object was created.",
    getter=age,
)


def table(rt: ResourceType, objs: list[Obj], include_object: str, list_meta: dict[str, Any]) -> dict[str, Any]:
    cols = [NAME_COLUMN, *(rt.columns or [AGE_COLUMN])]
    rows = []
    for o in objs:
        row: dict[str, Any] = {"cells": [column_cell(c, o) for c in cols]}
        if include_object == "Object":
            row["object"] = o
        elif include_object != "None":
            row["object"] = {"kind": "PartialObjectMetadata", "apiVersion": "meta.k8s.io/v1", "metadata": o["metadata"]}
        rows.append(row)
    return {
        "kind": "Table",
        "apiVersion": "meta.k8s.io/v1",
        "metadata": list_meta,
        "columnDefinitions": [c.definition() for c in cols],
        "rows": rows,
    }


def _pod_ready(o: Obj) -> str:
    statuses = dig(o, "status", "containerStatuses") or []
    total = len(dig(o, "spec", "containers") or [])
    return f"{sum(1 for s in statuses if s.get('ready'))}/{total}"


def _pod_status(o: Obj) -> str:
    if dig(o, "metadata", "deletionTimestamp"):
        return "Terminating"
    for s in dig(o, "status", "containerStatuses") or []:
        state = s.get("state") or {}
        if "waiting" in state and state["waiting"].get("reason"):
            return str(state["waiting"]["reason"])
        if (
            "terminated" in state
            and dig(o, "status", "phase") not in ("Succeeded",)
            and state["terminated"].get("reason")
        ) and (dig(o, "status", "phase") == "Failed" or state["terminated"].get("exitCode")):
            return str(state["terminated"]["reason"])
    return str(dig(o, "status", "reason") or dig(o, "status", "phase") or "Pending")


def _pod_restarts(o: Obj) -> int:
    return sum(int(s.get("restartCount", 0)) for s in dig(o, "status", "containerStatuses") or [])


def _node_status(o: Obj) -> str:
    ready = next((c for c in dig(o, "status", "conditions") or [] if c.get("type") == "Ready"), None)
    status = "Unknown" if ready is None else {"True": "Ready", "False": "NotReady"}.get(ready.get("status"), "Unknown")
    if dig(o, "spec", "unschedulable"):
        status += ",SchedulingDisabled"
    return status


def _node_roles(o: Obj) -> str:
    roles = [
        k.split("/", 1)[1] for k in (dig(o, "metadata", "labels") or {}) if k.startswith("node-role.kubernetes.io/")
    ]
    return ",".join(sorted(roles)) or "<none>"


POD_COLUMNS = [
    Column(
        "Ready",
        "string",
        description="The aggregate readiness state of this pod for accepting traffic.",
        getter=_pod_ready,
    ),
    Column("Status", "string", description="The aggregate status of the containers in this pod.", getter=_pod_status),
    Column(
        "Restarts",
        "string",
        description="The number of times the containers in this pod have been restarted.",
        getter=lambda o: str(_pod_restarts(o)),
    ),
    AGE_COLUMN,
    Column(
        "IP",
        "string",
        priority=1,
        description="The IP address assigned to the pod.",
        getter=lambda o: dig(o, "status", "podIP") or "<none>",
    ),
    Column(
        "Node",
        "string",
        priority=1,
        description="The node the pod is scheduled on.",
        getter=lambda o: dig(o, "spec", "nodeName") or "<none>",
    ),
]
NODE_COLUMNS = [
    Column("Status", "string", description="The status of the node.", getter=_node_status),
    Column("Roles", "string", description="The roles of the node.", getter=_node_roles),
    AGE_COLUMN,
    Column(
        "Version",
        "string",
        description="Kubelet version.",
        getter=lambda o: dig(o, "status", "nodeInfo", "kubeletVersion") or "",
    ),
    Column(
        "Internal-IP",
        "string",
        priority=1,
        description="Internal IP.",
        getter=lambda o: next(
            (a.get("address") for a in dig(o, "status", "addresses") or [] if a.get("type") == "InternalIP"), "<none>"
        ),
    ),
]
EVENT_COLUMNS = [
    Column("Last Seen", "string", getter=lambda o: _since(dig(o, "lastTimestamp") or dig(o, "eventTime"))),
    Column("Type", "string", getter=lambda o: o.get("type", "")),
    Column("Reason", "string", getter=lambda o: o.get("reason", "")),
    Column(
        "Object",
        "string",
        getter=lambda o: f"{(dig(o, 'involvedObject', 'kind') or '').lower()}/{dig(o, 'involvedObject', 'name') or ''}",
    ),
    Column("Message", "string", getter=lambda o: o.get("message", "")),
]


def _since(ts: Any) -> str:
    t = _parse_time(ts) if isinstance(ts, str) else None
    return human_duration((datetime.datetime.now(datetime.UTC) - t).total_seconds()) if t else "<unknown>"


# Events: one stored collection (core/v1 shape), two API shapes ------------------------------

_EVENT_MAP = [  # (core v1 field, events.k8s.io/v1 field)
    ("involvedObject", "regarding"),
    ("message", "note"),
    ("reportingComponent", "reportingController"),
    ("source", "deprecatedSource"),
    ("firstTimestamp", "deprecatedFirstTimestamp"),
    ("lastTimestamp", "deprecatedLastTimestamp"),
    ("count", "deprecatedCount"),
]
_EVENT_SAME = ("metadata", "reason", "type", "action", "related", "series", "eventTime", "reportingInstance")


def core_event_to_v1(obj: Obj) -> Obj:
    out: Obj = {"apiVersion": "events.k8s.io/v1", "kind": "Event"}
    for k in _EVENT_SAME:
        if k in obj:
            out[k] = obj[k]
    for core, new in _EVENT_MAP:
        if core in obj:
            out[new] = obj[core]
    return out


def v1_event_to_core(obj: Obj) -> Obj:
    out: Obj = {"apiVersion": "v1", "kind": "Event"}
    for k in _EVENT_SAME:
        if k in obj:
            out[k] = obj[k]
    for core, new in _EVENT_MAP:
        if new in obj:
            out[core] = obj[new]
    return out


def _core_event_fields() -> dict[str, FieldGetter]:
    f = {
        f"involvedObject.{k}": field_getter("involvedObject", k)
        for k in ("kind", "namespace", "name", "uid", "apiVersion", "resourceVersion", "fieldPath")
    }
    f.update(
        reason=field_getter("reason"),
        reportingComponent=field_getter("reportingComponent"),
        type=field_getter("type"),
        source=field_getter("source", "component"),
    )
    return f


def _v1_event_fields() -> dict[str, FieldGetter]:
    f = {
        f"regarding.{k}": field_getter("involvedObject", k)
        for k in ("kind", "namespace", "name", "uid", "apiVersion", "resourceVersion", "fieldPath")
    }
    f.update(
        reason=field_getter("reason"), reportingController=field_getter("reportingComponent"), type=field_getter("type")
    )
    return f


def builtin_types() -> list[ResourceType]:
    pod_fields = {
        "spec.nodeName": field_getter("spec", "nodeName"),
        "spec.restartPolicy": field_getter("spec", "restartPolicy"),
        "spec.schedulerName": field_getter("spec", "schedulerName"),
        "spec.serviceAccountName": field_getter("spec", "serviceAccountName"),
        "spec.hostNetwork": field_getter("spec", "hostNetwork"),
        "status.phase": field_getter("status", "phase"),
        "status.podIP": field_getter("status", "podIP"),
        "status.nominatedNodeName": field_getter("status", "nominatedNodeName"),
    }
    return [
        ResourceType(
            "",
            "v1",
            "namespaces",
            "Namespace",
            False,
            short_names=["ns"],
            subresources=["status"],
            fields={"status.phase": field_getter("status", "phase")},
            columns=[Column("Status", "string", getter=lambda o: dig(o, "status", "phase") or ""), AGE_COLUMN],
            has_generation=False,
        ),
        ResourceType(
            "",
            "v1",
            "nodes",
            "Node",
            False,
            short_names=["no"],
            subresources=["status"],
            status_subresource=True,
            fields={"spec.unschedulable": field_getter("spec", "unschedulable")},
            columns=NODE_COLUMNS,
        ),
        ResourceType(
            "",
            "v1",
            "pods",
            "Pod",
            True,
            short_names=["po"],
            categories=["all"],
            subresources=["status", "binding", "eviction"],
            fields=pod_fields,
            columns=POD_COLUMNS,
            status_subresource=True,
        ),
        ResourceType(
            "",
            "v1",
            "services",
            "Service",
            True,
            short_names=["svc"],
            categories=["all"],
            subresources=["status"],
            status_subresource=True,
        ),
        ResourceType("", "v1", "endpoints", "Endpoints", True, short_names=["ep"], has_generation=False),
        ResourceType("", "v1", "secrets", "Secret", True, fields={"type": field_getter("type")}, has_generation=False),
        ResourceType("", "v1", "configmaps", "ConfigMap", True, short_names=["cm"], has_generation=False),
        ResourceType("", "v1", "serviceaccounts", "ServiceAccount", True, short_names=["sa"], has_generation=False),
        ResourceType(
            "",
            "v1",
            "events",
            "Event",
            True,
            short_names=["ev"],
            fields=_core_event_fields(),
            columns=EVENT_COLUMNS,
            storage="core/events",
            has_generation=False,
        ),
        ResourceType(
            "events.k8s.io",
            "v1",
            "events",
            "Event",
            True,
            short_names=["ev"],
            fields=_v1_event_fields(),
            storage="core/events",
            to_view=core_event_to_v1,
            from_view=v1_event_to_core,
            has_generation=False,
        ),
        ResourceType("coordination.k8s.io", "v1", "leases", "Lease", True, has_generation=False),
        ResourceType("networking.k8s.io", "v1", "networkpolicies", "NetworkPolicy", True, short_names=["netpol"]),
        # Stored and served (the chart renders one), never enforced: every eviction is allowed.
        ResourceType(
            "policy",
            "v1",
            "poddisruptionbudgets",
            "PodDisruptionBudget",
            True,
            short_names=["pdb"],
            subresources=["status"],
            status_subresource=True,
        ),
        ResourceType(
            "apps",
            "v1",
            "deployments",
            "Deployment",
            True,
            short_names=["deploy"],
            categories=["all"],
            subresources=["status"],
            status_subresource=True,
        ),
        ResourceType("rbac.authorization.k8s.io", "v1", "roles", "Role", True, has_generation=False),
        ResourceType("rbac.authorization.k8s.io", "v1", "rolebindings", "RoleBinding", True, has_generation=False),
        ResourceType("rbac.authorization.k8s.io", "v1", "clusterroles", "ClusterRole", False, has_generation=False),
        ResourceType(
            "rbac.authorization.k8s.io", "v1", "clusterrolebindings", "ClusterRoleBinding", False, has_generation=False
        ),
        ResourceType(
            "apiextensions.k8s.io",
            "v1",
            "customresourcedefinitions",
            "CustomResourceDefinition",
            False,
            short_names=["crd", "crds"],
            subresources=["status"],
            status_subresource=True,
            columns=[Column("Created At", "date", getter=lambda o: dig(o, "metadata", "creationTimestamp"))],
        ),
    ]


def crd_types(crd: Obj) -> list[ResourceType]:
    """The resource types one CustomResourceDefinition serves (one per served version)."""
    spec = crd["spec"]
    names = spec["names"]
    out = []
    for v in spec.get("versions", []):
        if not v.get("served", True):
            continue
        schema = dig(v, "schema", "openAPIV3Schema") or {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
        cols = [
            Column(
                c["name"],
                c.get("type", "string"),
                json_path=c["jsonPath"],
                description=c.get("description", ""),
                priority=int(c.get("priority", 0)),
                format=c.get("format", ""),
            )
            for c in v.get("additionalPrinterColumns") or []
        ]
        out.append(
            ResourceType(
                spec["group"],
                v["name"],
                names["plural"],
                names["kind"],
                spec.get("scope", "Namespaced") == "Namespaced",
                singular=names.get("singular", names["kind"].lower()),
                short_names=list(names.get("shortNames") or []),
                categories=list(names.get("categories") or []),
                subresources=["status"] if "status" in (dig(v, "subresources") or {}) else [],
                status_subresource="status" in (dig(v, "subresources") or {}),
                columns=cols,
                crd=StructuralSchema(schema, RuleValidator(schema)),
                crd_name=crd["metadata"]["name"],
                to_view=_with_api_version(f"{spec['group']}/{v['name']}"),
                from_view=_with_api_version(f"{spec['group']}/{v['name']}"),
            )
        )
    return out


def _with_api_version(api_version: str) -> Callable[[Obj], Obj]:
    """Custom resources convert between versions with strategy None: only apiVersion changes."""

    def convert(obj: Obj) -> Obj:
        return obj if obj.get("apiVersion") == api_version else {**obj, "apiVersion": api_version}

    return convert


def fields_of(rt: ResourceType) -> Mapping[str, FieldGetter]:
    return rt.fields
