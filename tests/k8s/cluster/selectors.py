"""Label and field selectors, parsed the way the API server parses them.

Label selectors: ``a=b``, ``a==b``, ``a!=b``, ``a in (x,y)``, ``a notin (x)``, ``a`` (exists) and
``!a`` (does not exist), comma-separated, all ANDed. Field selectors: ``f=v``, ``f==v``, ``f!=v``
on the fields each resource supports (see ``resources.ResourceType.field_getters``).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

_SET_RE = re.compile(r"^\s*(!?)\s*([A-Za-z0-9./_-]+)\s*(?:(notin|in)\s*\(([^)]*)\))?\s*$")
_EQ_RE = re.compile(r"^\s*([A-Za-z0-9./_-]+)\s*(==|!=|=)\s*([A-Za-z0-9._-]*)\s*$")


class SelectorError(ValueError):
    """A selector the API server would answer with 400 BadRequest."""


@dataclass(frozen=True)
class Requirement:
    key: str
    op: str  # "=", "!=", "in", "notin", "exists", "!exists"
    values: tuple[str, ...] = ()

    def matches(self, labels: Mapping[str, str]) -> bool:
        has = self.key in labels
        if self.op == "exists":
            return has
        if self.op == "!exists":
            return not has
        if self.op == "=":
            return has and labels[self.key] == self.values[0]
        if self.op == "!=":
            return not has or labels[self.key] != self.values[0]
        if self.op == "in":
            return has and labels[self.key] in self.values
        return not has or labels[self.key] not in self.values  # notin


def _split_top(text: str) -> list[str]:
    """Split on commas that are not inside parentheses."""
    parts: list[str] = []
    depth = 0
    cur: list[str] = []
    for ch in text:
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    parts.append("".join(cur))
    return [p for p in parts if p.strip()]


def parse_label_selector(text: str | None) -> list[Requirement]:
    if not text:
        return []
    reqs: list[Requirement] = []
    for part in _split_top(text):
        m = _EQ_RE.match(part)
        if m:
            key, op, value = m.groups()
            reqs.append(Requirement(key, "!=" if op == "!=" else "=", (value,)))
            continue
        m = _SET_RE.match(part)
        if not m:
            raise SelectorError(f"unable to parse requirement: {part.strip()!r}")
        neg, key, op, values = m.groups()
        if op:
            if neg:
                raise SelectorError(f"unable to parse requirement: {part.strip()!r}")
            vals = tuple(v.strip() for v in values.split(",") if v.strip())
            if not vals:
                raise SelectorError(f"for '{op}' operator, values set can't be empty")
            reqs.append(Requirement(key, op, vals))
        else:
            reqs.append(Requirement(key, "!exists" if neg else "exists"))
    return reqs


def labels_match(reqs: list[Requirement], obj: Mapping[str, Any]) -> bool:
    if not reqs:
        return True
    labels = obj.get("metadata", {}).get("labels") or {}
    return all(r.matches(labels) for r in reqs)


FieldGetter = Callable[[Mapping[str, Any]], str]


def parse_field_selector(text: str | None, getters: Mapping[str, FieldGetter]) -> list[tuple[FieldGetter, bool, str]]:
    """Parse into (getter, negated, value) triples; an unsupported field is a 400, as on a real server."""
    if not text:
        return []
    out = []
    for part in _split_top(text):
        m = re.match(r"^\s*([A-Za-z0-9._-]+)\s*(==|!=|=)\s*(.*?)\s*$", part)
        if not m:
            raise SelectorError(f"invalid selector: {part.strip()!r}; can't understand it")
        field, op, value = m.groups()
        if field not in getters:
            raise SelectorError(f"field label not supported: {field}")
        out.append((getters[field], op == "!=", value))
    return out


def fields_match(reqs: list[tuple[FieldGetter, bool, str]], obj: Mapping[str, Any]) -> bool:
    return all((getter(obj) == value) != negated for getter, negated, value in reqs)


def dig(obj: Mapping[str, Any], *path: str) -> Any:
    cur: Any = obj
    for p in path:
        if not isinstance(cur, Mapping):
            return None
        cur = cur.get(p)
    return cur


def field_getter(*path: str) -> FieldGetter:
    def get(obj: Mapping[str, Any]) -> str:
        v = dig(obj, *path)
        if v is None:
            return ""
        if isinstance(v, bool):
            return "true" if v else "false"
        return str(v)

    return get
