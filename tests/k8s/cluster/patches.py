"""The three patch formats a Kubernetes API server accepts besides server-side apply.

- JSON merge patch (RFC 7386): ``null`` deletes, objects merge, everything else (lists too)
  replaces.
- JSON patch (RFC 6902), through the ``jsonpatch`` package.
- Strategic merge patch (built-in kinds only): like a merge patch, except that lists the Kubernetes
  schema marks ``x-kubernetes-patch-strategy: merge`` merge by their ``x-kubernetes-patch-merge-key``
  (containers by name, conditions by type, taints by key, ownerReferences by uid, …) or, without a
  key, as a set (finalizers); with the directives ``$patch: replace|delete|merge``,
  ``$retainKeys``, ``$setElementOrder/<list>`` and ``$deleteFromPrimitiveList/<list>``. The merge
  keys come from the Kubernetes OpenAPI definitions, so no list is special-cased here.
"""

from __future__ import annotations

import copy
from typing import Any

import jsonpatch

from .schema import resolve


class PatchError(ValueError):
    """A patch that cannot be applied (the server answers 422, or 400 for malformed input)."""


def merge_patch(original: Any, patch: Any) -> Any:
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = dict(original) if isinstance(original, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def json_patch(original: Any, patch: Any) -> Any:
    if not isinstance(patch, list):
        raise PatchError("a JSON patch must be a list of operations")
    try:
        return jsonpatch.apply_patch(original, patch)
    except (jsonpatch.JsonPatchException, jsonpatch.JsonPointerException) as e:
        raise PatchError(str(e)) from e


_DIRECTIVES = ("$patch", "$retainKeys")


def _strip(value: Any) -> Any:
    """A patch value without directives, as stored when it lands where nothing merges."""
    if isinstance(value, dict):
        return {
            k: _strip(v)
            for k, v in value.items()
            if k not in _DIRECTIVES
            and not k.startswith(("$setElementOrder/", "$deleteFromPrimitiveList/"))
            and v is not None
        }
    if isinstance(value, list):
        return [_strip(v) for v in value if not (isinstance(v, dict) and v.get("$patch") == "delete")]
    return value


def _prop(schema: dict[str, Any], key: str) -> dict[str, Any]:
    schema = resolve(schema)
    props = schema.get("properties")
    if props and key in props:
        return resolve(props[key])
    addl = schema.get("additionalProperties")
    if isinstance(addl, dict):
        return resolve(addl)
    return {}


def strategic_merge_patch(original: dict[str, Any], patch: dict[str, Any], schema: dict[str, Any]) -> dict[str, Any]:
    if not isinstance(patch, dict):
        raise PatchError("a strategic merge patch must be a JSON object")
    return _smp_map(original, patch, resolve(schema))


def _smp_map(original: dict[str, Any] | None, patch: dict[str, Any], schema: dict[str, Any]) -> dict[str, Any]:
    directive = patch.get("$patch")
    if directive == "replace":
        return _strip({k: v for k, v in patch.items() if k != "$patch"})
    if directive not in (None, "merge"):
        raise PatchError(f"unknown patch directive {directive!r} in a map")
    result = dict(original or {})
    retain = patch.get("$retainKeys")
    for key, value in patch.items():
        if key in _DIRECTIVES or key.startswith("$setElementOrder/"):
            continue
        if key.startswith("$deleteFromPrimitiveList/"):
            name = key.split("/", 1)[1]
            if isinstance(result.get(name), list):
                result[name] = [v for v in result[name] if v not in value]
            continue
        sub = _prop(schema, key)
        if value is None or (isinstance(value, dict) and value.get("$patch") == "delete"):
            result.pop(key, None)
        elif isinstance(value, dict):
            result[key] = _smp_map(result.get(key) if isinstance(result.get(key), dict) else None, value, sub)
        elif isinstance(value, list):
            current = result.get(key)
            result[key] = _smp_list(current if isinstance(current, list) else [], value, sub)
        else:
            result[key] = value
    if isinstance(retain, list):
        for key in list(result):
            if key not in retain:
                del result[key]
    for key, order in patch.items():
        if key.startswith("$setElementOrder/") and isinstance(result.get(key.split("/", 1)[1]), list):
            name = key.split("/", 1)[1]
            result[name] = _reorder(result[name], order, _prop(schema, name).get("x-kubernetes-patch-merge-key"))
    return result


def _reorder(items: list[Any], order: list[Any], merge_key: str | None) -> list[Any]:
    def ident(v: Any) -> Any:
        return v.get(merge_key) if merge_key and isinstance(v, dict) else v

    wanted = [ident(o) for o in order]
    ranked = sorted(items, key=lambda v: wanted.index(ident(v)) if ident(v) in wanted else len(wanted))
    return ranked


def _smp_list(original: list[Any], patch: list[Any], schema: dict[str, Any]) -> list[Any]:
    strategy = schema.get("x-kubernetes-patch-strategy", "")
    merge_key = schema.get("x-kubernetes-patch-merge-key")
    if "merge" not in strategy.split(","):
        return _strip(patch)
    if any(isinstance(p, dict) and p.get("$patch") == "replace" for p in patch):
        return _strip([p for p in patch if not (isinstance(p, dict) and p.get("$patch") == "replace")])
    if not merge_key:  # a list of primitives merged as a set, order kept (finalizers)
        out = list(original)
        for v in patch:
            if v not in out:
                out.append(v)
        return out
    items_schema = resolve(schema.get("items"))
    result = [copy.deepcopy(v) for v in original]
    for item in patch:
        if not isinstance(item, dict) or merge_key not in item:
            raise PatchError(f"map: {item!r} does not contain declared merge key: {merge_key}")
        idx = next(
            (i for i, v in enumerate(result) if isinstance(v, dict) and v.get(merge_key) == item[merge_key]), None
        )
        if item.get("$patch") == "delete":
            if idx is not None:
                del result[idx]
            continue
        if idx is None:
            result.append(_strip(item))
        else:
            result[idx] = _smp_map(result[idx], item, items_schema)
    return result
