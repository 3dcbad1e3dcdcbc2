"""Schemas: structural OpenAPI v3 for custom resources, and the built-in kinds' definitions.

Custom resources (the CRD's ``openAPIV3Schema``), in the API server's order: prune unknown fields
(unless ``x-kubernetes-preserve-unknown-fields``), apply ``default``s, then validate, collecting
every error as a field path (``spec.replicas``) the way a 422 ``Invalid`` names it; then, when
none of those errors blocks them, the CEL rules (``x-kubernetes-validations``, see cel.py for what
of them is modeled), with the stored object as ``oldSelf`` on update. ``format`` checks are not
modeled.

Built-in kinds: the definitions bundled with kubernetes-validate (the Kubernetes OpenAPI with the
patch-strategy extensions), used for strategic-merge patches, strict validation and the OpenAPI
documents kubectl reads.
"""

from __future__ import annotations

import copy
import functools
import json
import math
import re
from dataclasses import dataclass, field
from importlib import resources
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .cel import RuleValidator

KUBERNETES_VERSION = "1.32"


@dataclass
class FieldError:
    """One cause of a 422 Invalid: ``reason`` is the API's CauseType (FieldValueInvalid, …)."""

    reason: str
    field: str
    message: str

    def cause(self) -> dict[str, str]:
        return {"reason": self.reason, "message": self.message, "field": self.field}


@dataclass
class SchemaResult:
    errors: list[FieldError] = field(default_factory=list)
    unknown: list[str] = field(default_factory=list)  # pruned field paths (fieldValidation)
    warnings: list[str] = field(default_factory=list)  # ratcheted CEL rule failures


# OpenAPI errors after which the server does not run the CEL rules (apiextensions' hasBlockingErr):
# a rule written for the schema's types could not run on a value of another type.
_BLOCKING = frozenset(
    {"FieldValueNotSupported", "FieldValueRequired", "FieldValueTooLong", "FieldValueTooMany", "FieldValueTypeInvalid"}
)
_RULES_NOT_CHECKED = FieldError(
    "FieldValueInvalid",
    "<nil>",
    'Invalid value: "null": some validation rules were not checked because the object was invalid; '
    "correct the existing errors to complete validation",
)


def _json(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"))


def _type_ok(value: Any, typ: str) -> bool:
    if typ == "object":
        return isinstance(value, dict)
    if typ == "array":
        return isinstance(value, list)
    if typ == "string":
        return isinstance(value, str)
    if typ == "boolean":
        return isinstance(value, bool)
    if typ == "integer":
        return (isinstance(value, int) and not isinstance(value, bool)) or (
            isinstance(value, float) and value.is_integer()
        )
    if typ == "number":
        return isinstance(value, int | float) and not isinstance(value, bool)
    return True


def _child(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


class StructuralSchema:
    """One version's ``openAPIV3Schema`` of a CRD, and its CEL rules (``rules``) if it has any."""

    def __init__(self, schema: dict[str, Any], rules: RuleValidator | None = None) -> None:
        self.schema = schema
        self.rules = rules

    def process(
        self, obj: dict[str, Any], *, old: dict[str, Any] | None = None, status_only: bool = False
    ) -> SchemaResult:
        """Prune, default and validate ``obj`` in place (apiVersion/kind/metadata are kept).

        ``old`` is the stored object on an update (None on create): the CEL rules' ``oldSelf``.
        """
        result = SchemaResult()
        props = self.schema.get("properties", {})
        for key in list(obj):
            if key in ("apiVersion", "kind", "metadata"):
                continue
            if key not in props and not self.schema.get("x-kubernetes-preserve-unknown-fields"):
                result.unknown.append(key)
                del obj[key]
        self._default(self.schema, obj)
        for key, sub in props.items():
            if key in ("apiVersion", "kind", "metadata"):
                continue
            if key in obj:
                self._prune(sub, obj[key], key, result)
        for key in list(obj):
            if key in props and key not in ("apiVersion", "kind", "metadata"):
                self._default_tree(props[key], obj, key)
        for key in self.schema.get("required", []):
            if key not in obj:
                result.errors.append(FieldError("FieldValueRequired", key, "Required value"))
        for key, sub in props.items():
            if key in ("apiVersion", "kind", "metadata") or key not in obj:
                continue
            self._validate(sub, obj[key], key, result)
        if self.rules is not None and self.rules.has_rules:
            if any(e.reason in _BLOCKING for e in result.errors):
                result.errors.append(_RULES_NOT_CHECKED)
            else:
                outcome = self.rules.validate(obj, old)
                result.errors.extend(outcome.errors)
                result.warnings.extend(outcome.warnings)
        return result

    # Pruning -------------------------------------------------------------------------------
    def _prune(self, schema: dict[str, Any], value: Any, path: str, result: SchemaResult) -> None:
        if isinstance(value, dict):
            keep = {"apiVersion", "kind", "metadata"} if schema.get("x-kubernetes-embedded-resource") else set()
            props = schema.get("properties")
            addl = schema.get("additionalProperties")
            preserve = schema.get("x-kubernetes-preserve-unknown-fields")
            if props is not None or (addl is None and not preserve and schema.get("type") == "object"):
                props = props or {}
                if not preserve and not isinstance(addl, dict) and addl is not True:
                    for key in list(value):
                        if key not in props and key not in keep:
                            result.unknown.append(_child(path, key))
                            del value[key]
                for key, sub in props.items():
                    if key in value:
                        self._prune(sub, value[key], _child(path, key), result)
            if isinstance(addl, dict):
                for key in value:
                    if key not in (props or {}):
                        self._prune(addl, value[key], _child(path, key), result)
        elif isinstance(value, list) and isinstance(schema.get("items"), dict):
            for i, item in enumerate(value):
                self._prune(schema["items"], item, f"{path}[{i}]", result)

    # Defaulting ----------------------------------------------------------------------------
    def _default(self, schema: dict[str, Any], value: dict[str, Any]) -> None:
        for key, sub in (schema.get("properties") or {}).items():
            if key in ("apiVersion", "kind", "metadata") and schema is self.schema:
                continue
            if (key not in value or (value[key] is None and not sub.get("nullable"))) and "default" in sub:
                value[key] = copy.deepcopy(sub["default"])

    def _default_tree(self, schema: dict[str, Any], parent: Any, key: Any) -> None:
        value = parent[key]
        if isinstance(value, dict):
            self._default(schema, value)
            for k, sub in (schema.get("properties") or {}).items():
                if k in value:
                    self._default_tree(sub, value, k)
            addl = schema.get("additionalProperties")
            if isinstance(addl, dict):
                for k in list(value):
                    if k not in (schema.get("properties") or {}):
                        self._default_tree(addl, value, k)
        elif isinstance(value, list) and isinstance(schema.get("items"), dict):
            for i in range(len(value)):
                self._default_tree(schema["items"], value, i)

    # Validation ----------------------------------------------------------------------------
    def _validate(self, schema: dict[str, Any], value: Any, path: str, result: SchemaResult) -> None:
        errs = result.errors
        if value is None:
            if not schema.get("nullable"):
                typ = schema.get("type")
                if typ:
                    errs.append(
                        FieldError(
                            "FieldValueTypeInvalid",
                            path,
                            f'Invalid value: "null": {path} in body must be of type {typ}: "null"',
                        )
                    )
            return
        if schema.get("x-kubernetes-int-or-string"):
            if not (isinstance(value, str) or _type_ok(value, "integer")):
                errs.append(
                    FieldError(
                        "FieldValueTypeInvalid",
                        path,
                        f"Invalid value: {_json(value)}: {path} in body must be of type integer,string: {_json(value)}",
                    )
                )
                return
        else:
            typ = schema.get("type")
            if typ and not _type_ok(value, typ):
                got = {dict: "object", list: "array", str: "string", bool: "boolean", int: "integer", float: "number"}
                errs.append(
                    FieldError(
                        "FieldValueTypeInvalid",
                        path,
                        f'Invalid value: "{got.get(type(value), "unknown")}": {path} in body must be of type {typ}: '
                        f'"{got.get(type(value), "unknown")}"',
                    )
                )
                return
        if "enum" in schema and value not in schema["enum"]:
            supported = ", ".join(_json(v) for v in schema["enum"])
            errs.append(
                FieldError(
                    "FieldValueNotSupported", path, f"Unsupported value: {_json(value)}: supported values: {supported}"
                )
            )
        if isinstance(value, int | float) and not isinstance(value, bool):
            self._validate_number(schema, value, path, errs)
        if isinstance(value, str):
            if "maxLength" in schema and len(value) > schema["maxLength"]:
                errs.append(
                    FieldError("FieldValueTooLong", path, f"Too long: may not be more than {schema['maxLength']} bytes")
                )
            if "minLength" in schema and len(value) < schema["minLength"]:
                errs.append(
                    FieldError(
                        "FieldValueInvalid",
                        path,
                        f"Invalid value: {_json(value)}: {path} in body "
                        f"should be at least {schema['minLength']} chars long",
                    )
                )
            if "pattern" in schema and not re.search(schema["pattern"], value):
                errs.append(
                    FieldError(
                        "FieldValueInvalid",
                        path,
                        f"Invalid value: {_json(value)}: {path} in body should match '{schema['pattern']}'",
                    )
                )
        if isinstance(value, list):
            if "maxItems" in schema and len(value) > schema["maxItems"]:
                errs.append(
                    FieldError(
                        "FieldValueTooMany",
                        path,
                        f"Too many: {len(value)}: must have at most {schema['maxItems']} items",
                    )
                )
            if "minItems" in schema and len(value) < schema["minItems"]:
                errs.append(
                    FieldError(
                        "FieldValueInvalid",
                        path,
                        f"Invalid value: {len(value)}: {path} in body should have at least {schema['minItems']} items",
                    )
                )
            if schema.get("uniqueItems") and len({_json(v) for v in value}) != len(value):
                errs.append(FieldError("FieldValueDuplicate", path, f"Duplicate value: {path} shall have unique items"))
            if isinstance(schema.get("items"), dict):
                for i, item in enumerate(value):
                    self._validate(schema["items"], item, f"{path}[{i}]", result)
        if isinstance(value, dict):
            for key in schema.get("required", []):
                if key not in value:
                    errs.append(FieldError("FieldValueRequired", _child(path, key), "Required value"))
            props = schema.get("properties") or {}
            for key, sub in props.items():
                if key in value:
                    self._validate(sub, value[key], _child(path, key), result)
            addl = schema.get("additionalProperties")
            if isinstance(addl, dict):
                for key, item in value.items():
                    if key not in props:
                        self._validate(addl, item, _child(path, key), result)
            if "maxProperties" in schema and len(value) > schema["maxProperties"]:
                errs.append(
                    FieldError(
                        "FieldValueTooMany",
                        path,
                        f"Too many: {len(value)}: must have at most {schema['maxProperties']} items",
                    )
                )
            if "minProperties" in schema and len(value) < schema["minProperties"]:
                errs.append(
                    FieldError(
                        "FieldValueInvalid",
                        path,
                        f"Invalid value: {len(value)}: {path} in body should "
                        f"have at least {schema['minProperties']} properties",
                    )
                )
        for sub in schema.get("allOf", []):
            self._validate(sub, value, path, result)
        if "anyOf" in schema and not any(not self._errors_of(sub, value, path) for sub in schema["anyOf"]):
            errs.append(
                FieldError(
                    "FieldValueInvalid",
                    path,
                    f"Invalid value: {_json(value)}: {path} in body must match any of the schemas",
                )
            )
        if "oneOf" in schema:
            n = sum(1 for sub in schema["oneOf"] if not self._errors_of(sub, value, path))
            if n != 1:
                errs.append(
                    FieldError(
                        "FieldValueInvalid",
                        path,
                        f"Invalid value: {_json(value)}: {path} in body must match exactly one schema in oneOf",
                    )
                )
        if "not" in schema and not self._errors_of(schema["not"], value, path):
            errs.append(
                FieldError(
                    "FieldValueInvalid",
                    path,
                    f"Invalid value: {_json(value)}: {path} in body must not validate the schema (not)",
                )
            )

    def _errors_of(self, schema: dict[str, Any], value: Any, path: str) -> list[FieldError]:
        sub = SchemaResult()
        self._validate(schema, value, path, sub)
        return sub.errors

    @staticmethod
    def _validate_number(schema: dict[str, Any], value: float, path: str, errs: list[FieldError]) -> None:
        if "minimum" in schema:
            lo = schema["minimum"]
            if value < lo or (schema.get("exclusiveMinimum") is True and value == lo):
                rel = "greater than" if schema.get("exclusiveMinimum") is True else "greater than or equal to"
                errs.append(
                    FieldError(
                        "FieldValueInvalid", path, f"Invalid value: {_json(value)}: {path} in body should be {rel} {lo}"
                    )
                )
        if "maximum" in schema:
            hi = schema["maximum"]
            if value > hi or (schema.get("exclusiveMaximum") is True and value == hi):
                rel = "less than" if schema.get("exclusiveMaximum") is True else "less than or equal to"
                errs.append(
                    FieldError(
                        "FieldValueInvalid", path, f"Invalid value: {_json(value)}: {path} in body should be {rel} {hi}"
                    )
                )
        if "multipleOf" in schema:
            m = schema["multipleOf"]
            if m and not math.isclose(value / m, round(value / m)):
                errs.append(
                    FieldError(
                        "FieldValueInvalid",
                        path,
                        f"Invalid value: {_json(value)}: {path} in body should be a multiple of {m}",
                    )
                )


def subschemas(node: dict[str, Any], here: str) -> list[tuple[Any, str]]:
    """The schemas right below ``node`` (properties, items, additionalProperties), each with its
    path in a CRD (``here.properties[name]``): what a walk over a CRD's schema descends into."""
    out: list[tuple[Any, str]] = [
        (sub, f"{here}.properties[{key}]") for key, sub in (node.get("properties") or {}).items()
    ]
    if isinstance(node.get("items"), dict):
        out.append((node["items"], f"{here}.items"))
    if isinstance(node.get("additionalProperties"), dict):
        out.append((node["additionalProperties"], f"{here}.additionalProperties"))
    return out


def structural_errors(schema: dict[str, Any], path: str = "openAPIV3Schema") -> list[FieldError]:
    """The CRD-level check a real server does: every node has a type unless it says why not."""
    errors: list[FieldError] = []

    def walk(node: Any, here: str, root: bool = False) -> None:
        if not isinstance(node, dict):
            return
        exempt = node.get("x-kubernetes-int-or-string") or node.get("x-kubernetes-preserve-unknown-fields")
        if not node.get("type") and not exempt and not root:
            errors.append(
                FieldError(
                    "FieldValueRequired",
                    f"{here}.type",
                    "Required value: must not be empty for specified object fields",
                )
            )
        if root and node.get("type") not in (None, "object"):
            errors.append(
                FieldError(
                    "FieldValueInvalid",
                    f"{here}.type",
                    f"Invalid value: {_json(node.get('type'))}: must be object at the root",
                )
            )
        for sub, where in subschemas(node, here):
            walk(sub, where)
        if node.get("properties") and isinstance(node.get("additionalProperties"), dict):
            errors.append(
                FieldError(
                    "FieldValueForbidden",
                    f"{here}.additionalProperties",
                    "Forbidden: additionalProperties and properties are mutual exclusive",
                )
            )

    walk(schema, path, root=True)
    return errors


# Built-in definitions ----------------------------------------------------------------------


@functools.cache
def builtin_definitions() -> dict[str, dict[str, Any]]:
    """The Kubernetes OpenAPI definitions kubernetes-validate ships for our pinned version."""
    base = resources.files("kubernetes_validate").joinpath("kubernetes-json-schema")
    path = base.joinpath(f"v{KUBERNETES_VERSION}.0-local-strict", "_definitions.json")
    data: dict[str, Any] = json.loads(path.read_text())
    return data["$defs"]


@functools.cache
def definition_for(group: str, version: str, kind: str) -> str | None:
    for name, d in builtin_definitions().items():
        for gvk in d.get("x-kubernetes-group-version-kind", []):
            if gvk.get("group", "") == group and gvk["version"] == version and gvk["kind"] == kind:
                return name
    return None


def resolve(schema: dict[str, Any] | None) -> dict[str, Any]:
    """Follow ``$ref`` (``#/$defs/<name>``) one level at a time."""
    while schema and "$ref" in schema:
        schema = builtin_definitions().get(schema["$ref"].rsplit("/", 1)[-1], {})
    return schema or {}
