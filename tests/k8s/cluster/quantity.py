"""Kubernetes resource quantities (``500m``, ``2Gi``, ``1e3``) as floats, and pod requests."""

from __future__ import annotations

import re
from typing import Any

_SUFFIX = {
    "n": 1e-9, "u": 1e-6, "m": 1e-3, "": 1.0,
    "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15, "E": 1e18,
    "Ki": 2.0**10, "Mi": 2.0**20, "Gi": 2.0**30, "Ti": 2.0**40, "Pi": 2.0**50, "Ei": 2.0**60,
}  # fmt: skip
_QUANTITY = re.compile(r"^([+-]?[0-9.]+(?:[eE][+-]?[0-9]+)?)(Ki|Mi|Gi|Ti|Pi|Ei|n|u|m|k|M|G|T|P|E)?$")


def parse_quantity(value: Any) -> float:
    if isinstance(value, int | float):
        return float(value)
    m = _QUANTITY.match(str(value).strip())
    if not m:
        raise ValueError(
            f"quantities must match the regular expression '^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$': {value!r}"
        )
    return float(m.group(1)) * _SUFFIX[m.group(2) or ""]


def pod_requests(pod: dict[str, Any]) -> dict[str, float]:
    """What the scheduler counts: the sum over containers (limits stand in for missing requests),
    at least the largest init container's."""
    spec = pod.get("spec") or {}

    def of(c: dict[str, Any]) -> dict[str, float]:
        r = c.get("resources") or {}
        merged = {**(r.get("limits") or {}), **(r.get("requests") or {})}
        return {k: parse_quantity(v) for k, v in merged.items()}

    total: dict[str, float] = {}
    for c in spec.get("containers") or []:
        for k, v in of(c).items():
            total[k] = total.get(k, 0.0) + v
    for c in spec.get("initContainers") or []:
        for k, v in of(c).items():
            total[k] = max(total.get(k, 0.0), v)
    return total
