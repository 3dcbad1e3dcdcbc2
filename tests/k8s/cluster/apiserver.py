"""The test API server's semantics: what a create, update, patch, delete, list or watch does.

``ApiServer`` holds the store and the resource registry; ``http.py`` turns HTTP requests into calls
here, and the control-plane loops (``controlplane.py``) call the same methods as internal clients.
Modeled as the Kubernetes API documents it ("API Concepts", "API Conventions", "Custom Resources"):
resourceVersion and generation, 409 on a stale update, finalizers and graceful deletion, status
subresources, the three patch formats, CRDs served on creation with structural schemas and CEL rules (cel.py), and the
admission defaults a controller's pods meet on a real server (service account lookup, the default
not-ready/unreachable tolerations), and Pod Security admission at ``enforce: restricted`` on pod
creates (podsecurity.py).
"""

from __future__ import annotations

import copy
import datetime
import json
import logging
import re
import secrets
import threading
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from . import resources as res
from .cel import crd_rule_errors
from .errors import ApiError, already_exists, bad_request, conflict, invalid, not_found
from .patches import PatchError, json_patch, merge_patch, strategic_merge_patch
from .podsecurity import ENFORCE_LABEL, refusal_message, violations
from .resources import ResourceType
from .schema import KUBERNETES_VERSION, FieldError, builtin_definitions, definition_for, structural_errors
from .selectors import SelectorError, fields_match, labels_match, parse_field_selector, parse_label_selector
from .store import Event, Obj, Store, Watcher

log = logging.getLogger(__name__)

_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
# 1.32's rule for a container's variable name (RelaxedEnvironmentVariableValidation, on by default
# since 1.32): printable ASCII other than '='. The server takes any value, NUL included.
_ENV_NAME_REFUSED = re.compile(r"[^ -<>-~]")


def _env_name_errors(spec: dict[str, Any]) -> list[FieldError]:
    """The API server's checks of each container's env names (validation.IsRelaxedEnvVarName)."""
    errors: list[FieldError] = []
    for kind in ("initContainers", "containers"):
        for i, c in enumerate(spec.get(kind) or []):
            for j, env in enumerate(c.get("env") or []):
                name = env.get("name") or ""
                where = f"spec.{kind}[{i}].env[{j}].name"
                if not name:
                    errors.append(FieldError("FieldValueRequired", where, "Required value"))
                elif _ENV_NAME_REFUSED.search(name):
                    errors.append(
                        FieldError(
                            "FieldValueInvalid",
                            where,
                            f"Invalid value: {json.dumps(name)}: a valid environment variable name must consist only "
                            "of printable ASCII characters other than '='",
                        )
                    )
    return errors


_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_LABEL_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")

# Cluster-scoped kinds that are named like DNS labels rather than subdomains.
_LABEL_NAMED = {"core/namespaces", "core/services"}

PATCH_MERGE = "application/merge-patch+json"
PATCH_JSON = "application/json-patch+json"
PATCH_STRATEGIC = "application/strategic-merge-patch+json"
PATCH_APPLY = "application/apply-patch+yaml"


def now_rfc3339(offset_seconds: float = 0) -> str:
    t = datetime.datetime.now(datetime.UTC) + datetime.timedelta(seconds=offset_seconds)
    return t.strftime("%Y-%m-%dT%H:%M:%SZ")


def now_micro() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


@dataclass
class ValidationFailure:
    """A write kubernetes-validate (strict) rejected: the test mode's loud failure."""

    user: str
    verb: str
    kind: str
    namespace: str
    name: str
    message: str


@dataclass
class DeleteOptions:
    grace_period: int | None = None
    propagation: str | None = None
    uid: str | None = None
    resource_version: str | None = None
    dry_run: bool = False

    @classmethod
    def parse(cls, body: dict[str, Any] | None, query: dict[str, str]) -> DeleteOptions:
        body = body or {}
        pre = body.get("preconditions") or {}
        grace = body.get("gracePeriodSeconds", query.get("gracePeriodSeconds"))
        return cls(
            grace_period=None if grace is None else int(grace),
            propagation=body.get("propagationPolicy") or query.get("propagationPolicy"),
            uid=pre.get("uid"),
            resource_version=pre.get("resourceVersion"),
            dry_run=bool(body.get("dryRun") or query.get("dryRun")),
        )


@dataclass
class WriteResult:
    obj: Obj
    created: bool = False
    warnings: list[str] = field(default_factory=list)


class Registry:
    """Resource types by group/version/plural, plus what discovery needs."""

    def __init__(self) -> None:
        self.types: dict[tuple[str, str, str], ResourceType] = {}
        self.by_storage: dict[str, list[ResourceType]] = {}
        self.generation = 0  # bumped on every change, for OpenAPI hashes and discovery caches
        for rt in res.builtin_types():
            self.add(rt)

    def add(self, rt: ResourceType) -> None:
        self.types[(rt.group, rt.version, rt.plural)] = rt
        self.by_storage.setdefault(rt.storage, [])
        self.by_storage[rt.storage] = [
            t for t in self.by_storage[rt.storage] if t.version != rt.version or t.group != rt.group
        ] + [rt]
        self.generation += 1

    def remove_crd(self, crd_name: str) -> None:
        for key, rt in list(self.types.items()):
            if rt.crd_name == crd_name:
                del self.types[key]
                self.by_storage.pop(rt.storage, None)
        self.generation += 1

    def get(self, group: str, version: str, plural: str) -> ResourceType | None:
        return self.types.get((group, version, plural))

    def primary(self, storage: str) -> ResourceType:
        return self.by_storage[storage][0]

    def by_kind(self, api_version: str, kind: str) -> ResourceType | None:
        group, _, version = api_version.rpartition("/")
        for rt in self.types.values():
            if rt.group == group and rt.version == version and rt.kind == kind:
                return rt
        return None

    def group_versions(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for rt in self.types.values():
            versions = out.setdefault(rt.group, [])
            if rt.version not in versions:
                versions.append(rt.version)
        return out


class ApiServer:
    """Storage, registry and request semantics of the test API server.

    ``validate``: "strict" (every built-in object written is checked with kubernetes-validate in
    strict mode; a failure is answered with 422 and recorded in ``validation_failures``) or "off"
    (for scale benchmarks). ``default_toleration_seconds`` is the DefaultTolerationSeconds admission
    plugin's value (300 on a real cluster; tests make it short).
    """

    def __init__(
        self,
        *,
        validate: str = "strict",
        history_size: int = 20000,
        default_toleration_seconds: int = 300,
        bookmark_interval: float = 1.0,
    ) -> None:
        self.store = Store(history_size)
        self.registry = Registry()
        self.validate_mode = validate
        self.default_toleration_seconds = default_toleration_seconds
        self.bookmark_interval = bookmark_interval
        self.validation_failures: list[ValidationFailure] = []
        self._crd_lock = threading.Lock()
        self._ip_lock = threading.Lock()
        self._next_cluster_ip = 10
        for ns in ("default", "kube-system", "kube-public", "kube-node-lease"):
            self.create(self.rt("", "v1", "namespaces"), "", {"metadata": {"name": ns}}, user="system:apiserver")

    # Lookup ------------------------------------------------------------------------------------
    def rt(self, group: str, version: str, plural: str) -> ResourceType:
        rt = self.registry.get(group, version, plural)
        if rt is None:
            raise ApiError(404, "NotFound", "the server could not find the requested resource")
        return rt

    def _key(self, rt: ResourceType, namespace: str) -> str:
        return namespace if rt.namespaced else ""

    def get(self, rt: ResourceType, namespace: str, name: str) -> Obj:
        obj = self.store.get(rt.storage, self._key(rt, namespace), name)
        if obj is None:
            raise not_found(rt.qualified, name, rt.group, rt.plural)
        return rt.view(obj)

    def get_stored(self, rt: ResourceType, namespace: str, name: str) -> Obj | None:
        return self.store.get(rt.storage, self._key(rt, namespace), name)

    # Lists and watches -------------------------------------------------------------------------
    def matcher(
        self, rt: ResourceType, namespace: str | None, label_selector: str | None, field_selector: str | None
    ) -> Callable[[Obj], bool]:
        try:
            labels = parse_label_selector(label_selector)
            fields = parse_field_selector(field_selector, rt.fields)
        except SelectorError as e:
            raise bad_request(str(e)) from None

        def match(obj: Obj) -> bool:
            if namespace and obj["metadata"].get("namespace") != namespace:
                return False
            return labels_match(labels, obj) and fields_match(fields, obj)

        return match

    def list_objects(
        self,
        rt: ResourceType,
        namespace: str | None,
        *,
        label_selector: str | None = None,
        field_selector: str | None = None,
        limit: int = 0,
        continue_token: str | None = None,
    ) -> tuple[list[Obj], dict[str, Any]]:
        match = self.matcher(rt, namespace, label_selector, field_selector)
        with self.store.lock:
            rv = self.store.rv
            items = self.store.select(rt.storage, namespace if rt.namespaced and namespace else None)
        items = sorted(
            (o for o in items if match(o)), key=lambda o: (o["metadata"].get("namespace", ""), o["metadata"]["name"])
        )
        meta: dict[str, Any] = {"resourceVersion": str(rv)}
        if continue_token:
            try:
                after = json.loads(bytes.fromhex(continue_token))
                items = [o for o in items if [o["metadata"].get("namespace", ""), o["metadata"]["name"]] > after["key"]]
                meta["resourceVersion"] = str(after["rv"])
            except (ValueError, KeyError, TypeError):
                raise bad_request("continue key is not valid") from None
        if limit and len(items) > limit:
            last = items[limit - 1]["metadata"]
            token = json.dumps({"rv": int(meta["resourceVersion"]), "key": [last.get("namespace", ""), last["name"]]})
            meta["continue"] = token.encode().hex()
            meta["remainingItemCount"] = len(items) - limit
            items = items[:limit]
        return [rt.view(o) for o in items], meta

    def watch(self, rt: ResourceType, since: str | None) -> tuple[Watcher, list[Event], list[Obj]] | None:
        """Start a watch: (watcher, backlog events, initial objects) or None if ``since`` expired."""
        with self.store.lock:
            if not since or since == "0":
                initial = self.store.select(rt.storage)
                start = self.store.rv
            else:
                try:
                    start = int(since)
                except ValueError:
                    raise bad_request(f"invalid resource version {since!r}") from None
                initial = []
            started = self.store.watch(rt.storage, start)
            if started is None:
                return None
            watcher, backlog = started
            return (
                watcher,
                backlog,
                sorted(initial, key=lambda o: (o["metadata"].get("namespace", ""), o["metadata"]["name"])),
            )

    # Admission and validation ------------------------------------------------------------------
    def _check_name(self, rt: ResourceType, name: str) -> None:
        pattern = _DNS_LABEL if rt.storage in _LABEL_NAMED else _DNS_SUBDOMAIN
        limit = 63 if rt.storage in _LABEL_NAMED else 253
        if rt.storage == "core/nodes":
            pattern = _DNS_SUBDOMAIN
        if not name:
            raise invalid(
                self._kind_group(rt),
                name,
                [FieldError("FieldValueRequired", "metadata.name", "Required value: name or generateName is required")],
                rt.group,
                rt.kind,
            )
        if len(name) > limit or not pattern.match(name):
            what = "a lowercase RFC 1123 label" if pattern is _DNS_LABEL else "a lowercase RFC 1123 subdomain"
            raise invalid(
                self._kind_group(rt),
                name,
                [
                    FieldError(
                        "FieldValueInvalid",
                        "metadata.name",
                        f'Invalid value: "{name}": {what} must consist of '
                        f"lower case alphanumeric characters, '-' or '.'",
                    )
                ],
                rt.group,
                rt.kind,
            )

    def _check_labels(self, rt: ResourceType, obj: Obj) -> None:
        errors = []
        for key, value in (obj["metadata"].get("labels") or {}).items():
            prefix, _, name = key.rpartition("/")
            if not isinstance(value, str) or len(value) > 63 or not _LABEL_VALUE.match(value):
                errors.append(
                    FieldError(
                        "FieldValueInvalid",
                        "metadata.labels",
                        f'Invalid value: "{value}": a valid label must be an empty string or consist of alphanumeric '
                        f"characters, '-', '_' or '.', and must start and end with an alphanumeric character",
                    )
                )
            if len(name) > 63 or not _LABEL_NAME.match(name) or (prefix and not _DNS_SUBDOMAIN.match(prefix)):
                errors.append(
                    FieldError(
                        "FieldValueInvalid",
                        "metadata.labels",
                        f"Invalid value: \"{key}\": name part must consist of alphanumeric characters, '-', '_' or '.'",
                    )
                )
        if errors:
            raise invalid(self._kind_group(rt), obj["metadata"].get("name", ""), errors, rt.group, rt.kind)

    @staticmethod
    def _kind_group(rt: ResourceType) -> str:
        return f"{rt.kind}.{rt.group}" if rt.group else rt.kind

    def _validate(
        self,
        rt: ResourceType,
        obj: Obj,
        user: str,
        verb: str,
        field_validation: str,
        warnings: list[str],
        old: Obj | None = None,
    ) -> None:
        """Check what is about to be stored; ``old`` is the stored object on update (CEL's oldSelf)."""
        name = obj["metadata"].get("name", "")
        if rt.crd is not None:
            result = rt.crd.process(obj, old=old)
            warnings.extend(result.warnings)
            if result.unknown:
                unknown = [f'unknown field "{u}"' for u in result.unknown]
                if field_validation == "Strict":
                    raise bad_request("strict decoding error: " + ", ".join(unknown))
                if field_validation != "Ignore":
                    warnings.extend(unknown)
            if result.errors:
                raise invalid(self._kind_group(rt), name, result.errors, rt.group, rt.kind)
            return
        self._validate_builtin(rt, obj)
        if self.validate_mode != "strict":
            return
        import kubernetes_validate

        view = rt.view(obj)
        try:
            kubernetes_validate.validate(view, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.utils.SchemaNotFoundError:
            return
        except kubernetes_validate.utils.ValidationError as e:
            where = ".".join(str(p) for p in e.path) or "<root>"
            first = str(e.message).splitlines()[0]
            self.validation_failures.append(
                ValidationFailure(user, verb, rt.kind, obj["metadata"].get("namespace", ""), name, f"{where}: {first}")
            )
            log.error(
                "kubernetes-validate (strict) rejected %s %s/%s from %s: %s: %s",
                rt.kind,
                obj["metadata"].get("namespace", ""),
                name,
                user,
                where,
                first,
            )
            if field_validation == "Strict" and "Additional properties" in first:
                raise bad_request(f"strict decoding error: unknown field in {where}: {first}") from None
            raise invalid(
                self._kind_group(rt),
                name,
                [
                    FieldError(
                        "FieldValueInvalid",
                        where,
                        f"Invalid value: {first} (kubernetes-validate {KUBERNETES_VERSION}, strict)",
                    )
                ],
                rt.group,
                rt.kind,
            ) from None

    def _validate_builtin(self, rt: ResourceType, obj: Obj) -> None:
        """The few semantic checks a controller's objects meet beyond the schema."""
        name = obj["metadata"]["name"]
        errors: list[FieldError] = []
        if rt.storage == "core/pods":
            containers = (obj.get("spec") or {}).get("containers") or []
            if not containers:
                errors.append(FieldError("FieldValueRequired", "spec.containers", "Required value"))
            seen: set[str] = set()
            for i, c in enumerate([*((obj.get("spec") or {}).get("initContainers") or []), *containers]):
                cname = c.get("name", "")
                if not _DNS_LABEL.match(cname or "-"):
                    errors.append(
                        FieldError(
                            "FieldValueInvalid",
                            f"spec.containers[{i}].name",
                            f'Invalid value: "{cname}": a lowercase RFC 1123 label',
                        )
                    )
                if cname in seen:
                    errors.append(
                        FieldError("FieldValueDuplicate", f"spec.containers[{i}].name", f'Duplicate value: "{cname}"')
                    )
                seen.add(cname)
                if not c.get("image"):
                    errors.append(FieldError("FieldValueRequired", f"spec.containers[{i}].image", "Required value"))
            errors.extend(_env_name_errors(obj.get("spec") or {}))
            errors.extend(_node_field_selector_errors(obj.get("spec") or {}))
            volumes = {v.get("name") for v in (obj.get("spec") or {}).get("volumes") or []}
            for i, c in enumerate(containers):
                for j, m in enumerate(c.get("volumeMounts") or []):
                    if m.get("name") not in volumes:
                        errors.append(
                            FieldError(
                                "FieldValueNotFound",
                                f"spec.containers[{i}].volumeMounts[{j}].name",
                                f'Not found: "{m.get("name")}"',
                            )
                        )
        if rt.storage == "coordination.k8s.io/leases":
            d = (obj.get("spec") or {}).get("leaseDurationSeconds")
            if d is not None and d <= 0:
                errors.append(
                    FieldError(
                        "FieldValueInvalid", "spec.leaseDurationSeconds", f"Invalid value: {d}: must be greater than 0"
                    )
                )
        if rt.storage == "apiextensions.k8s.io/customresourcedefinitions":
            errors.extend(self._crd_errors(obj))
        if errors:
            raise invalid(self._kind_group(rt), name, errors, rt.group, rt.kind)

    def _crd_errors(self, crd: Obj) -> list[FieldError]:
        spec = crd.get("spec") or {}
        names = spec.get("names") or {}
        errors = []
        if crd["metadata"]["name"] != f"{names.get('plural')}.{spec.get('group')}":
            errors.append(
                FieldError(
                    "FieldValueInvalid",
                    "metadata.name",
                    f'Invalid value: "{crd["metadata"]["name"]}": must be spec.names.plural+"."+spec.group',
                )
            )
        versions = spec.get("versions") or []
        if sum(1 for v in versions if v.get("storage")) != 1:
            errors.append(
                FieldError(
                    "FieldValueInvalid",
                    "spec.versions",
                    "Invalid value: must have exactly one version marked as storage version",
                )
            )
        for i, v in enumerate(versions):
            schema = (v.get("schema") or {}).get("openAPIV3Schema")
            if schema is not None:
                where = f"spec.versions[{i}].schema.openAPIV3Schema"
                errors.extend(structural_errors(schema, where))
                errors.extend(crd_rule_errors(schema, where))
        return errors

    def _admit_pod(self, pod: Obj, user: str) -> None:
        spec = pod.setdefault("spec", {})
        spec.setdefault("restartPolicy", "Always")
        spec.setdefault("terminationGracePeriodSeconds", 30)
        spec.setdefault("dnsPolicy", "ClusterFirst")
        spec.setdefault("schedulerName", "default-scheduler")
        spec.setdefault("securityContext", {})
        spec.setdefault("enableServiceLinks", True)
        spec.setdefault("priority", 0)
        spec.setdefault("preemptionPolicy", "PreemptLowerPriority")
        sa = spec.get("serviceAccountName") or spec.get("serviceAccount") or "default"
        spec["serviceAccountName"] = sa
        spec["serviceAccount"] = sa
        ns = pod["metadata"]["namespace"]
        if self.store.get("core/serviceaccounts", ns, sa) is None:
            raise ApiError(
                403,
                "Forbidden",
                f'pods "{pod["metadata"].get("name", "")}" is forbidden: error looking '
                f'up service account {ns}/{sa}: serviceaccount "{sa}" not found',
            )
        for c in [*(spec.get("initContainers") or []), *spec.get("containers", [])]:
            image = c.get("image") or ""  # null is "" to a real server, which then says Required
            c.setdefault(
                "imagePullPolicy",
                "Always" if image.endswith(":latest") or ":" not in image.rsplit("/", 1)[-1] else "IfNotPresent",
            )
            c.setdefault("terminationMessagePath", "/dev/termination-log")
            c.setdefault("terminationMessagePolicy", "File")
            c.setdefault("resources", {})
            for p in c.get("ports") or []:
                p.setdefault("protocol", "TCP")
        tolerations = spec.setdefault("tolerations", [])
        for key in ("node.kubernetes.io/not-ready", "node.kubernetes.io/unreachable"):
            if not any(
                t.get("key") == key and t.get("effect") in (None, "", "NoExecute") for t in tolerations
            ) and not any(t.get("operator") == "Exists" and not t.get("key") for t in tolerations):
                tolerations.append(
                    {
                        "key": key,
                        "operator": "Exists",
                        "effect": "NoExecute",
                        "tolerationSeconds": self.default_toleration_seconds,
                    }
                )
        self._admit_pod_security(pod, ns)
        requests: dict[str, Any] = {}
        for c in spec.get("containers", []):
            if (c.get("resources") or {}).get("requests") or (c.get("resources") or {}).get("limits"):
                requests = c["resources"]
        qos = (
            "BestEffort"
            if not requests
            else (
                "Guaranteed"
                if requests.get("limits") and requests.get("limits") == requests.get("requests", requests.get("limits"))
                else "Burstable"
            )
        )
        pod["status"] = {"phase": "Pending", "qosClass": qos}

    def _admit_pod_security(self, pod: Obj, namespace: str) -> None:
        """Pod Security admission at ``enforce: restricted`` (the namespace's label): a pod that breaks
        the profile is refused with a 403 as a real server words it (podsecurity.py). Only the
        ``restricted`` level is modeled, and only on create."""
        ns = self.store.get("core/namespaces", "", namespace) or {}
        if ((ns.get("metadata") or {}).get("labels") or {}).get(ENFORCE_LABEL) != "restricted":
            return
        problems = violations(pod.get("spec") or {})
        if problems:
            name = pod["metadata"].get("name", "")
            raise ApiError(403, "Forbidden", refusal_message(name, problems), name=name, kind="pods")

    def _admit_service(self, svc: Obj) -> None:
        spec = svc.setdefault("spec", {})
        spec.setdefault("type", "ClusterIP")
        spec.setdefault("sessionAffinity", "None")
        if not spec.get("clusterIP"):
            with self._ip_lock:
                n = self._next_cluster_ip
                self._next_cluster_ip += 1
            spec["clusterIP"] = f"10.96.{n // 256}.{n % 256}"
        spec["clusterIPs"] = [spec["clusterIP"]]
        for p in spec.get("ports") or []:
            p.setdefault("protocol", "TCP")
            p.setdefault("targetPort", p.get("port"))
        svc.setdefault("status", {"loadBalancer": {}})

    def _check_namespace(self, rt: ResourceType, namespace: str, name: str) -> None:
        if not rt.namespaced:
            return
        ns = self.store.get("core/namespaces", "", namespace)
        if ns is None:
            raise not_found("namespaces", namespace, "", "namespaces")
        if ns["metadata"].get("deletionTimestamp"):
            raise ApiError(
                403,
                "Forbidden",
                f'{rt.qualified} "{name}" is forbidden: unable to create new '
                f"content in namespace {namespace} because it is being terminated",
            )

    # Writes ------------------------------------------------------------------------------------
    def create(
        self,
        rt: ResourceType,
        namespace: str,
        body: Obj,
        *,
        user: str,
        dry_run: bool = False,
        field_validation: str = "Warn",
        subresource: str = "",
    ) -> WriteResult:
        if subresource:
            raise ApiError(405, "MethodNotAllowed", f"create is not supported on {rt.plural}/{subresource} here")
        if not isinstance(body, dict):
            raise bad_request("the body of the request was in an unknown format")
        obj = copy.deepcopy(rt.from_view(body) if rt.from_view else body)
        kind = body.get("kind")
        if kind and kind != rt.kind:
            raise bad_request(
                f"the API version in the data ({body.get('apiVersion')}) does not match the "
                f"expected API version ({rt.api_version}) or kind {kind} does not match {rt.kind}"
            )
        obj["apiVersion"] = self.registry.primary(rt.storage).api_version
        obj["kind"] = rt.kind
        md = obj.setdefault("metadata", {})
        if not isinstance(md, dict):
            raise bad_request("metadata must be an object")
        if rt.namespaced:
            if md.get("namespace") and md["namespace"] != namespace:
                raise bad_request(
                    "the namespace of the provided object does not match the namespace sent on the request"
                )
            md["namespace"] = namespace
        else:
            md.pop("namespace", None)
        if not md.get("name") and md.get("generateName"):
            md["name"] = md["generateName"] + "".join(secrets.choice("bcdfghjklmnpqrstvwxz2456789") for _ in range(5))
        self._check_name(rt, md.get("name", ""))
        self._check_labels(rt, obj)
        for k in (
            "uid",
            "resourceVersion",
            "creationTimestamp",
            "deletionTimestamp",
            "deletionGracePeriodSeconds",
            "generation",
            "managedFields",
            "selfLink",
        ):
            md.pop(k, None)
        warnings: list[str] = []
        with self.store.lock:
            self._check_namespace(rt, namespace, md["name"])
            if self.store.get(rt.storage, self._key(rt, namespace), md["name"]) is not None:
                raise already_exists(rt.qualified, md["name"], rt.group, rt.plural)
            if rt.status_subresource and rt.crd is not None:
                obj.pop("status", None)
            if rt.storage == "core/pods":
                self._admit_pod(obj, user)
            elif rt.storage == "core/services":
                self._admit_service(obj)
            elif rt.storage == "core/namespaces":
                obj["spec"] = {"finalizers": ["kubernetes"]}
                obj["status"] = {"phase": "Active"}
                md.setdefault("labels", {})["kubernetes.io/metadata.name"] = md["name"]
            elif rt.storage == "core/secrets":
                obj.setdefault("type", "Opaque")
                _fold_string_data(obj)
            elif rt.storage == "core/events" and not obj.get("series") and not obj.get("eventTime"):
                obj.setdefault("count", 1)
            self._validate(rt, obj, user, "create", field_validation, warnings)
            md["uid"] = str(uuid.uuid4())
            md["creationTimestamp"] = now_rfc3339()
            if rt.has_generation:
                md["generation"] = 1
            if rt.storage == "apiextensions.k8s.io/customresourcedefinitions":
                self._establish_crd(obj)
            if dry_run:
                md["resourceVersion"] = str(self.store.rv)
                return WriteResult(rt.view(obj), True, warnings)
            rv = self.store.next_rv()
            md["resourceVersion"] = str(rv)
            self.store.put(rt.storage, obj, "ADDED", None, rv)
            if rt.storage == "core/namespaces":
                sa_rt = self.rt("", "v1", "serviceaccounts")
                self.create(
                    sa_rt, md["name"], {"metadata": {"name": "default"}}, user="system:serviceaccount-controller"
                )
            if rt.storage == "apiextensions.k8s.io/customresourcedefinitions":
                self._serve_crd(obj)
        return WriteResult(rt.view(obj), True, warnings)

    def update(
        self,
        rt: ResourceType,
        namespace: str,
        name: str,
        body: Obj,
        *,
        user: str,
        subresource: str = "",
        dry_run: bool = False,
        field_validation: str = "Warn",
        verb: str = "update",
    ) -> WriteResult:
        if not isinstance(body, dict):
            raise bad_request("the body of the request was in an unknown format")
        new = copy.deepcopy(rt.from_view(body) if rt.from_view else body)
        md = new.get("metadata")
        if not isinstance(md, dict):
            raise bad_request("metadata is required")
        if md.get("name") and md["name"] != name:
            raise bad_request(f"the name of the object ({md['name']}) does not match the name on the URL ({name})")
        if rt.namespaced and md.get("namespace") and md["namespace"] != namespace:
            raise bad_request("the namespace of the provided object does not match the namespace sent on the request")
        warnings: list[str] = []
        with self.store.lock:
            old = self.store.get(rt.storage, self._key(rt, namespace), name)
            if old is None:
                raise not_found(rt.qualified, name, rt.group, rt.plural)
            want_rv = md.get("resourceVersion")
            if want_rv and want_rv != old["metadata"]["resourceVersion"]:
                raise conflict(
                    rt.qualified,
                    name,
                    "the object has been modified; please apply your changes to the latest version and try again",
                    rt.group,
                    rt.plural,
                )
            if md.get("uid") and md["uid"] != old["metadata"]["uid"]:
                raise conflict(
                    rt.qualified,
                    name,
                    f"Precondition failed: UID in precondition: {md['uid']}, "
                    f"UID in object meta: {old['metadata']['uid']}",
                    rt.group,
                    rt.plural,
                )
            merged = self._merge_update(rt, old, new, subresource)
            if rt.storage == "core/secrets":
                _fold_string_data(merged)
            self._validate_update(rt, old, merged)
            self._check_labels(rt, merged)
            self._validate(rt, merged, user, verb, field_validation, warnings, old=old)
            return self._commit_update(rt, old, merged, dry_run, warnings)

    def _merge_update(self, rt: ResourceType, old: Obj, new: Obj, subresource: str) -> Obj:
        """The object an update stores: status and metadata rules of the API conventions."""
        if subresource == "status":
            merged = copy.deepcopy(old)
            if "status" in new:
                merged["status"] = new["status"]
            else:
                merged.pop("status", None)
            # Status writes may not change metadata except through the main resource.
            return merged
        if subresource:
            raise ApiError(405, "MethodNotAllowed", f"update is not supported on {rt.plural}/{subresource}")
        merged = new
        merged["apiVersion"] = old["apiVersion"]
        merged["kind"] = old["kind"]
        md = merged["metadata"]
        omd = old["metadata"]
        for k in (
            "uid",
            "creationTimestamp",
            "deletionTimestamp",
            "deletionGracePeriodSeconds",
            "generation",
            "namespace",
            "name",
        ):
            if k in omd:
                md[k] = omd[k]
            else:
                md.pop(k, None)
        md.pop("managedFields", None)
        if rt.status_subresource:
            if "status" in old:
                merged["status"] = old["status"]
            else:
                merged.pop("status", None)
        if rt.storage == "core/pods":
            # A pod's binding goes through pods/binding; the kubelet writes status.
            spec = merged.setdefault("spec", {})
            ospec = old.get("spec") or {}
            if ospec.get("nodeName"):
                spec["nodeName"] = ospec["nodeName"]
        if rt.storage == "core/namespaces":
            merged["spec"] = old.get("spec", {})
            merged["status"] = old.get("status", {})
        return merged

    def _validate_update(self, rt: ResourceType, old: Obj, new: Obj) -> None:
        name = old["metadata"]["name"]
        if old["metadata"].get("deletionTimestamp"):
            added = set(new["metadata"].get("finalizers") or []) - set(old["metadata"].get("finalizers") or [])
            if added:
                raise invalid(
                    self._kind_group(rt),
                    name,
                    [
                        FieldError(
                            "FieldValueForbidden",
                            "metadata.finalizers",
                            f"Forbidden: no new finalizers can be added if the object "
                            f"is being deleted, found new finalizers {sorted(added)!r}",
                        )
                    ],
                    rt.group,
                    rt.kind,
                )
        if rt.storage == "core/pods":
            mutable = ("activeDeadlineSeconds", "tolerations", "schedulingGates", "terminationGracePeriodSeconds")
            a = {k: v for k, v in (old.get("spec") or {}).items() if k not in mutable}
            b = {k: v for k, v in (new.get("spec") or {}).items() if k not in mutable}
            for spec in (a, b):
                spec["containers"] = [{k: v for k, v in c.items() if k != "image"} for c in spec.get("containers", [])]
            if a != b:
                raise invalid(
                    self._kind_group(rt),
                    name,
                    [
                        FieldError(
                            "FieldValueForbidden",
                            "spec",
                            "Forbidden: pod updates may not change fields other than "
                            "`spec.containers[*].image`,`spec.initContainers[*].image`,"
                            "`spec.activeDeadlineSeconds`,`spec.tolerations` "
                            ""
                            "(only additions to existing tolerations),`spec.terminationGracePeriodSeconds` "
                            "(allow it to be set to 1 if it was previously negative)",
                        )
                    ],
                    rt.group,
                    rt.kind,
                )
        if rt.storage == "core/services":
            ospec, nspec = old.get("spec") or {}, new.get("spec") or {}
            if nspec.get("clusterIP") and nspec.get("clusterIP") != ospec.get("clusterIP"):
                raise invalid(
                    self._kind_group(rt),
                    name,
                    [FieldError("FieldValueInvalid", "spec.clusterIP", "Invalid value: field is immutable")],
                    rt.group,
                    rt.kind,
                )
            nspec.setdefault("clusterIP", ospec.get("clusterIP"))
            nspec.setdefault("clusterIPs", ospec.get("clusterIPs"))

    def _commit_update(self, rt: ResourceType, old: Obj, new: Obj, dry_run: bool, warnings: list[str]) -> WriteResult:
        md = new["metadata"]
        md["resourceVersion"] = old["metadata"]["resourceVersion"]
        if _same(old, new):
            return WriteResult(rt.view(old), False, warnings)  # a no-op write changes nothing, not even the RV
        if rt.has_generation and "generation" in old["metadata"]:

            def body(o: Obj) -> Obj:
                skip = ("metadata", "status") if rt.status_subresource or rt.crd is None else ("metadata",)
                return {k: v for k, v in o.items() if k not in skip and k not in ("apiVersion", "kind")}

            if body(old) != body(new):
                md["generation"] = int(old["metadata"]["generation"]) + 1
        if dry_run:
            return WriteResult(rt.view(new), False, warnings)
        rv = self.store.next_rv()
        md["resourceVersion"] = str(rv)
        if md.get("deletionTimestamp") and not md.get("finalizers") and self._finished_deleting(rt, new):
            self.store.remove(rt.storage, new, rv)
            self._after_remove(rt, new)
        else:
            self.store.put(rt.storage, new, "MODIFIED", old, rv)
        if rt.storage == "apiextensions.k8s.io/customresourcedefinitions":
            self._serve_crd(new)
        return WriteResult(rt.view(new), False, warnings)

    def _finished_deleting(self, rt: ResourceType, obj: Obj) -> bool:
        """Whether an object with no finalizers left may go now (a pod waits for its kubelet)."""
        if rt.storage != "core/pods":
            return True
        return bool(obj["metadata"].get("deletionGracePeriodSeconds") == 0)

    def patch(
        self,
        rt: ResourceType,
        namespace: str,
        name: str,
        content_type: str,
        patch: Any,
        *,
        user: str,
        subresource: str = "",
        dry_run: bool = False,
        field_validation: str = "Warn",
    ) -> WriteResult:
        ctype = content_type.split(";")[0].strip()
        if ctype == PATCH_APPLY:
            raise ApiError(
                415,
                "UnsupportedMediaType",
                "server-side apply (application/apply-patch+yaml) is not modeled by "
                "the test API server; use a merge, JSON or strategic-merge patch",
            )
        if ctype == PATCH_STRATEGIC and rt.crd is not None:
            raise ApiError(
                415,
                "UnsupportedMediaType",
                f"the body of the request was in an unknown format - accepted "
                f"media types include: {PATCH_JSON}, {PATCH_MERGE}, {PATCH_APPLY}",
            )
        if ctype not in (PATCH_MERGE, PATCH_JSON, PATCH_STRATEGIC):
            raise ApiError(
                415,
                "UnsupportedMediaType",
                f"the body of the request was in an unknown format - accepted media types "
                f"include: {PATCH_JSON}, {PATCH_MERGE}, {PATCH_APPLY}, {PATCH_STRATEGIC}",
            )
        with self.store.lock:
            old = self.store.get(rt.storage, self._key(rt, namespace), name)
            if old is None:
                raise not_found(rt.qualified, name, rt.group, rt.plural)
            current = copy.deepcopy(rt.view(old))
            try:
                if ctype == PATCH_MERGE:
                    if not isinstance(patch, dict):
                        raise PatchError("a merge patch must be a JSON object")
                    patched = merge_patch(current, patch)
                elif ctype == PATCH_JSON:
                    patched = json_patch(current, patch)
                else:
                    definition = definition_for(rt.group, rt.version, rt.kind)
                    schema = {"$ref": f"#/$defs/{definition}"} if definition else {}
                    patched = strategic_merge_patch(current, patch, schema)
            except PatchError as e:
                raise ApiError(
                    422 if ctype == PATCH_JSON else 400, "Invalid" if ctype == PATCH_JSON else "BadRequest", str(e)
                ) from None
            if not isinstance(patched, dict) or not isinstance(patched.get("metadata"), dict):
                raise bad_request("the patch produced an object without metadata")
            want_rv = patched["metadata"].get("resourceVersion")
            if want_rv and want_rv != old["metadata"]["resourceVersion"]:
                raise conflict(
                    rt.qualified,
                    name,
                    "the object has been modified; please apply your changes to the latest version and try again",
                    rt.group,
                    rt.plural,
                )
            patched["metadata"]["resourceVersion"] = old["metadata"]["resourceVersion"]
            return self.update(
                rt,
                namespace,
                name,
                patched,
                user=user,
                subresource=subresource,
                dry_run=dry_run,
                field_validation=field_validation,
                verb="patch",
            )

    def delete(
        self, rt: ResourceType, namespace: str, name: str, opts: DeleteOptions, *, user: str
    ) -> tuple[Obj, bool]:
        """Delete, or start deleting; returns (object, gone_now)."""
        with self.store.lock:
            old = self.store.get(rt.storage, self._key(rt, namespace), name)
            if old is None:
                raise not_found(rt.qualified, name, rt.group, rt.plural)
            omd = old["metadata"]
            if opts.uid and opts.uid != omd["uid"]:
                raise conflict(
                    rt.qualified,
                    name,
                    f"Precondition failed: UID in precondition: {opts.uid}, UID in object meta: {omd['uid']}",
                    rt.group,
                    rt.plural,
                )
            if opts.resource_version and opts.resource_version != omd["resourceVersion"]:
                raise conflict(
                    rt.qualified,
                    name,
                    f"Precondition failed: ResourceVersion in precondition: {opts.resource_version}, "
                    f"ResourceVersion in object meta: {omd['resourceVersion']}",
                    rt.group,
                    rt.plural,
                )
            if opts.propagation not in (None, "Background", "Foreground", "Orphan"):
                raise bad_request(
                    f"propagationPolicy {opts.propagation!r} is not one of Background, Foreground, Orphan"
                )
            obj = copy.deepcopy(old)
            md = obj["metadata"]
            finalizers = list(md.get("finalizers") or [])
            if opts.propagation == "Foreground" and "foregroundDeletion" not in finalizers:
                finalizers.append("foregroundDeletion")
            elif opts.propagation == "Orphan" and "orphan" not in finalizers:
                finalizers.append("orphan")
            grace = 0
            if rt.storage == "core/pods":
                grace = (
                    opts.grace_period
                    if opts.grace_period is not None
                    else int((obj.get("spec") or {}).get("terminationGracePeriodSeconds", 30))
                )
                phase = (obj.get("status") or {}).get("phase")
                if not (obj.get("spec") or {}).get("nodeName") or phase in ("Succeeded", "Failed"):
                    grace = 0
                if md.get("deletionTimestamp") and md.get("deletionGracePeriodSeconds") is not None:
                    grace = min(grace, int(md["deletionGracePeriodSeconds"]))
            if rt.storage == "core/namespaces":
                finalizers = finalizers or []
                obj["status"] = {**(obj.get("status") or {}), "phase": "Terminating"}
                grace = 1  # the namespace controller finishes it once the namespace is empty
            if opts.dry_run:
                return obj, False
            if not finalizers and grace == 0:
                rv = self.store.next_rv()
                md["resourceVersion"] = str(rv)
                md.setdefault("deletionTimestamp", now_rfc3339())
                md["deletionGracePeriodSeconds"] = 0
                self.store.remove(rt.storage, obj, rv)
                self._after_remove(rt, obj)
                return rt.view(obj), True
            changed = False
            if not md.get("deletionTimestamp"):
                md["deletionTimestamp"] = now_rfc3339(grace)
                changed = True
            if md.get("deletionGracePeriodSeconds") != grace:
                md["deletionGracePeriodSeconds"] = grace
                changed = True
            if finalizers != list(md.get("finalizers") or []):
                md["finalizers"] = finalizers
                changed = True
            if changed:
                if rt.has_generation and "generation" in md:
                    md["generation"] = int(md["generation"]) + 1
                rv = self.store.next_rv()
                md["resourceVersion"] = str(rv)
                self.store.put(rt.storage, obj, "MODIFIED", old, rv)
            return rt.view(obj), False

    def _after_remove(self, rt: ResourceType, obj: Obj) -> None:
        if rt.storage == "apiextensions.k8s.io/customresourcedefinitions":
            self._unserve_crd(obj)

    # CRDs --------------------------------------------------------------------------------------
    def _establish_crd(self, crd: Obj) -> None:
        now = now_rfc3339()
        names = dict(crd["spec"]["names"])
        names.setdefault("singular", names["kind"].lower())
        names.setdefault("listKind", names["kind"] + "List")
        crd["status"] = {
            "acceptedNames": names,
            "storedVersions": [v["name"] for v in crd["spec"].get("versions", []) if v.get("storage")],
            "conditions": [
                {
                    "type": "NamesAccepted",
                    "status": "True",
                    "reason": "NoConflicts",
                    "message": "no conflicts found",
                    "lastTransitionTime": now,
                },
                {
                    "type": "Established",
                    "status": "True",
                    "reason": "InitialNamesAccepted",
                    "message": "the initial names have been accepted",
                    "lastTransitionTime": now,
                },
            ],
        }

    def _serve_crd(self, crd: Obj) -> None:
        if crd["metadata"].get("deletionTimestamp"):
            return
        with self._crd_lock:
            self.registry.remove_crd(crd["metadata"]["name"])
            for rt in res.crd_types(crd):
                self.registry.add(rt)

    def _unserve_crd(self, crd: Obj) -> None:
        """A CRD's deletion removes every custom resource of it, then stops serving it."""
        types = [rt for rt in self.registry.types.values() if rt.crd_name == crd["metadata"]["name"]]
        if types:
            rt = types[0]
            for obj in self.store.select(rt.storage):
                rv = self.store.next_rv()
                gone = copy.deepcopy(obj)
                gone["metadata"]["resourceVersion"] = str(rv)
                self.store.remove(rt.storage, gone, rv)
        with self._crd_lock:
            self.registry.remove_crd(crd["metadata"]["name"])

    # Internal clients (control-plane loops) ----------------------------------------------------
    def mutate(
        self,
        storage: str,
        namespace: str,
        name: str,
        change: Callable[[Obj], bool | None],
        *,
        user: str,
        subresource: str = "",
    ) -> Obj | None:
        """Read-modify-write under the lock for a control-plane loop; ``change`` edits a copy and
        returns False to skip. Returns the stored object (None when it is gone)."""
        rt = self.registry.primary(storage)
        with self.store.lock:
            old = self.store.get(storage, namespace, name)
            if old is None:
                return None
            new = copy.deepcopy(old)
            if change(new) is False:
                return old
            if subresource == "status":
                return self.update(rt, namespace, name, new, user=user, subresource="status").obj
            # Internal writers may change what the API forbids clients (e.g. spec.nodeName).
            return self._commit_update(rt, old, new, False, []).obj

    def remove_now(self, storage: str, namespace: str, name: str) -> None:
        """Remove an object regardless of finalizers or grace (a force-delete of the control plane)."""
        rt = self.registry.primary(storage)
        with self.store.lock:
            old = self.store.get(storage, namespace, name)
            if old is None:
                return
            obj = copy.deepcopy(old)
            rv = self.store.next_rv()
            obj["metadata"]["resourceVersion"] = str(rv)
            obj["metadata"].setdefault("deletionTimestamp", now_rfc3339())
            self.store.remove(storage, obj, rv)
            self._after_remove(rt, obj)

    def iter_objects(self, storage: str) -> Iterator[Obj]:
        return iter(self.store.select(storage))

    # OpenAPI -----------------------------------------------------------------------------------
    def openapi_v3_index(self) -> dict[str, Any]:
        paths = {}
        for group, versions in self.registry.group_versions().items():
            for v in versions:
                gv = f"api/{v}" if not group else f"apis/{group}/{v}"
                paths[gv] = {"serverRelativeURL": f"/openapi/v3/{gv}?hash={self._openapi_hash(group, v)}"}
        return {"paths": paths}

    def _openapi_hash(self, group: str, version: str) -> str:
        import hashlib

        crds = [
            rt.crd_name + str(id(rt.crd))
            for rt in self.registry.types.values()
            if rt.group == group and rt.version == version
        ]
        return hashlib.sha256(f"{group}/{version}/{sorted(crds)}".encode()).hexdigest()[:32].upper()

    def openapi_v3(self, group: str, version: str) -> dict[str, Any]:
        types = [rt for rt in self.registry.types.values() if rt.group == group and rt.version == version]
        if not types:
            raise ApiError(404, "NotFound", "the server could not find the requested resource")
        schemas: dict[str, Any] = {}
        paths: dict[str, Any] = {}
        prefix = f"/api/{version}" if not group else f"/apis/{group}/{version}"
        for rt in types:
            gvk = [{"group": rt.group, "version": rt.version, "kind": rt.kind}]
            if rt.crd is not None:
                schema_name = f"{_reverse_domain(rt.group)}.{rt.version}.{rt.kind}"
                crd_schema = copy.deepcopy(rt.crd.schema)
                crd_schema.setdefault("properties", {})
                crd_schema["properties"]["metadata"] = {
                    "$ref": "#/components/schemas/io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"
                }
                crd_schema["properties"].setdefault("apiVersion", {"type": "string"})
                crd_schema["properties"].setdefault("kind", {"type": "string"})
                crd_schema["x-kubernetes-group-version-kind"] = gvk
                schemas[schema_name] = crd_schema
                _add_definitions(schemas, "io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta")
            else:
                schema_name = definition_for(rt.group, rt.version, rt.kind) or ""
                if schema_name:
                    _add_definitions(schemas, schema_name)
            ref = {"$ref": f"#/components/schemas/{schema_name}"} if schema_name else {"type": "object"}
            params = [
                {"name": n, "in": "query", "schema": {"type": "string"}}
                for n in ("dryRun", "fieldManager", "fieldValidation")
            ]
            op = {
                "x-kubernetes-group-version-kind": gvk[0],
                "parameters": params,
                "responses": {"200": {"content": {"application/json": {"schema": ref}}}},
            }
            item = {
                "get": {**op, "x-kubernetes-action": "get", "parameters": []},
                "put": {**op, "x-kubernetes-action": "put", "requestBody": {"content": {"*/*": {"schema": ref}}}},
                "patch": {
                    **op,
                    "x-kubernetes-action": "patch",
                    "requestBody": {"content": {"application/merge-patch+json": {"schema": {"type": "object"}}}},
                },
                "delete": {**op, "x-kubernetes-action": "delete", "parameters": []},
            }
            coll = {
                "get": {**op, "x-kubernetes-action": "list", "parameters": []},
                "post": {**op, "x-kubernetes-action": "post", "requestBody": {"content": {"*/*": {"schema": ref}}}},
            }
            base = f"{prefix}/namespaces/{{namespace}}/{rt.plural}" if rt.namespaced else f"{prefix}/{rt.plural}"
            paths[base] = coll
            paths[f"{base}/{{name}}"] = item
        return {
            "openapi": "3.0.0",
            "info": {"title": "Kubernetes", "version": f"v{KUBERNETES_VERSION}.0"},
            "paths": paths,
            "components": {"schemas": schemas},
        }


def _reverse_domain(group: str) -> str:
    return ".".join(reversed(group.split(".")))


def _to_openapi(node: Any) -> Any:
    """kubernetes-validate's JSON-schema flavour back to OpenAPI v3 (refs, nullable types)."""
    if isinstance(node, dict):
        out = {}
        for k, v in node.items():
            if k == "$ref" and isinstance(v, str):
                out[k] = "#/components/schemas/" + v.rsplit("/", 1)[-1]
            elif k == "type" and isinstance(v, list):
                types = [t for t in v if t != "null"]
                out[k] = types[0] if types else "object"
            elif k == "additionalProperties" and v is False:
                continue
            else:
                out[k] = _to_openapi(v)
        return out
    if isinstance(node, list):
        return [_to_openapi(v) for v in node]
    return node


def _add_definitions(schemas: dict[str, Any], name: str) -> None:
    defs = builtin_definitions()
    todo = [name]
    while todo:
        n = todo.pop()
        if n in schemas or n not in defs:
            continue
        schemas[n] = _to_openapi(defs[n])
        todo.extend(ref.rsplit("/", 1)[-1] for ref in _refs(defs[n]))


def _refs(node: Any) -> Iterator[str]:
    if isinstance(node, dict):
        for k, v in node.items():
            if k == "$ref" and isinstance(v, str):
                yield v
            else:
                yield from _refs(v)
    elif isinstance(node, list):
        for v in node:
            yield from _refs(v)


def _fold_string_data(secret: Obj) -> None:
    """A Secret's write-only ``stringData`` lands in ``data``, base64-encoded, as on a real server."""
    import base64

    string_data = secret.pop("stringData", None) or {}
    if string_data:
        secret["data"] = {
            **(secret.get("data") or {}),
            **{k: base64.b64encode(str(v).encode()).decode() for k, v in string_data.items()},
        }


def _same(a: Obj, b: Obj) -> bool:
    return a == b


def bind(api: ApiServer, namespace: str, name: str, binding: Any, user: str) -> None:
    """POST pods/binding: set spec.nodeName once (409 if already bound), as the scheduler does."""
    if not isinstance(binding, dict) or not (binding.get("target") or {}).get("name"):
        raise bad_request("a Binding needs target.name")
    node = binding["target"]["name"]
    with api.store.lock:
        pod = api.store.get("core/pods", namespace, name)
        if pod is None:
            raise not_found("pods", name, "", "pods")
        if (pod.get("spec") or {}).get("nodeName"):
            raise conflict("pods/binding", name, f'pod {name} is already assigned to node "{pod["spec"]["nodeName"]}"')
        if pod["metadata"].get("deletionTimestamp"):
            raise conflict("pods/binding", name, f"pod {name} is being deleted, cannot be assigned to a host")

        def assign(p: Obj) -> None:
            p["spec"]["nodeName"] = node
            conds = [c for c in (p.get("status") or {}).get("conditions", []) if c.get("type") != "PodScheduled"]
            conds.append(
                {"type": "PodScheduled", "status": "True", "lastProbeTime": None, "lastTransitionTime": now_rfc3339()}
            )
            p.setdefault("status", {})["conditions"] = conds

        api.mutate("core/pods", namespace, name, assign, user=user)


def evict(api: ApiServer, namespace: str, name: str, eviction: Any, user: str) -> None:
    """POST pods/eviction: a DisruptionTarget condition (EvictionByEvictionAPI), then a graceful
    delete. PodDisruptionBudgets are not modeled: every eviction is allowed."""
    opts = DeleteOptions.parse((eviction or {}).get("deleteOptions") if isinstance(eviction, dict) else None, {})
    with api.store.lock:
        if api.store.get("core/pods", namespace, name) is None:
            raise not_found("pods", name, "", "pods")
        add_pod_condition(
            api, namespace, name, "DisruptionTarget", "True", "EvictionByEvictionAPI", "Eviction API: evicting", user
        )
        api.delete(api.registry.primary("core/pods"), namespace, name, opts, user=user)


def add_pod_condition(
    api: ApiServer,
    namespace: str,
    name: str,
    ctype: str,
    status: str,
    reason: str,
    message: str,
    user: str,
    uid: str | None = None,
) -> None:
    """Set a pod condition (of the pod with ``uid`` only, when given: not a new pod of that name)."""

    def change(p: Obj) -> bool:
        if uid is not None and p["metadata"].get("uid") != uid:
            return False
        conds = list((p.get("status") or {}).get("conditions") or [])
        for c in conds:
            if c.get("type") == ctype and c.get("status") == status and c.get("reason") == reason:
                return False
        conds = [c for c in conds if c.get("type") != ctype]
        conds.append(
            {
                "type": ctype,
                "status": status,
                "reason": reason,
                "message": message,
                "lastProbeTime": None,
                "lastTransitionTime": now_rfc3339(),
            }
        )
        p.setdefault("status", {})["conditions"] = conds
        return True

    api.mutate("core/pods", namespace, name, change, user=user, subresource="status")


def _node_field_selector_errors(spec: Obj) -> list[FieldError]:
    """kube-apiserver's ``ValidateNodeFieldSelectorRequirement``: a required node affinity's
    ``matchFields`` take key ``metadata.name`` and operator In or NotIn with exactly one value."""
    errors: list[FieldError] = []
    required = ((spec.get("affinity") or {}).get("nodeAffinity") or {}).get(
        "requiredDuringSchedulingIgnoredDuringExecution"
    ) or {}
    base = "spec.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution.nodeSelectorTerms"
    for i, term in enumerate(required.get("nodeSelectorTerms") or []):
        for j, req in enumerate((term or {}).get("matchFields") or []):
            where = f"{base}[{i}].matchFields[{j}]"
            if req.get("operator") not in ("In", "NotIn"):
                errors.append(
                    FieldError(
                        "FieldValueInvalid",
                        f"{where}.operator",
                        f'Invalid value: "{req.get("operator")}": not a valid selector operator',
                    )
                )
            elif len(req.get("values") or []) != 1:
                errors.append(
                    FieldError(
                        "FieldValueRequired",
                        f"{where}.values",
                        "Required value: must be only one value when `operator` is 'In' or 'NotIn' for node field "
                        "selector",
                    )
                )
            if req.get("key") != "metadata.name":
                errors.append(
                    FieldError(
                        "FieldValueInvalid",
                        f"{where}.key",
                        f'Invalid value: "{req.get("key")}": not a valid field selector key',
                    )
                )
    return errors
