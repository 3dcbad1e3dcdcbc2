"""How a held cloud notice is said to people, in the same words by ``kubectl spotjob status``
(``orchestrator.kubectl_status``) and local mode's ``spotjob status`` (``orchestrator.live``): a
line of detail per notice and a table's HELD-FLUSH cell. Both read a job's status as JSON
(camelCase, as the resource and the run folder's job file hold it): an older ``kubectl spotjob``
must still show what a newer controller writes. Also the ages both write as kubectl does.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from orchestrator.model import parse_timestamp


def human_duration(seconds: float) -> str:
    """An age as kubectl prints it: ``41s``, ``5m12s``, ``52m``, ``3h4m``, ``2d3h``, ``400d``."""
    if seconds < -1:
        return "<invalid>"
    s = int(max(seconds, 0))
    if s < 120:
        return f"{s}s"
    minutes = s // 60
    if minutes < 10:
        return f"{minutes}m{s % 60}s" if s % 60 else f"{minutes}m"
    if minutes < 180:
        return f"{minutes}m"
    hours = minutes // 60
    if hours < 8:
        return f"{hours}h{minutes % 60}m" if minutes % 60 else f"{hours}h"
    if hours < 48:
        return f"{hours}h"
    days = hours // 24
    if hours < 24 * 8:
        return f"{days}d{hours % 24}h" if hours % 24 else f"{days}d"
    if days < 365 * 2:
        return f"{days}d"
    years, rest = divmod(days, 365)
    return f"{years}y{rest}d" if years < 8 and rest else f"{years}y"


def age(value: Any, now: datetime) -> str:
    t = parse_timestamp(value) if not isinstance(value, datetime) else value
    return human_duration((now - t).total_seconds()) if t is not None else "-"


def held_notices(status: dict[str, Any]) -> list[dict[str, Any]]:
    """``status.heldNotices`` (absent from a controller older than it, and when none is held); none
    for a job that ended, where a controller before 2026-12-05 could leave the notices of the
    workers it stopped."""
    if status.get("phase") in ("Succeeded", "Failed"):
        return []
    held = status.get("heldNotices")
    return [h for h in held if isinstance(h, dict)] if isinstance(held, list) else []


def held_cell(held: list[dict[str, Any]], now: datetime) -> str:
    """The table's HELD-FLUSH: when the next held notice's flush starts (``in 9m40s``; its deadline,
    ``due in 14m``, where the agent gave no flushAt) and how many more are held; blank for none."""
    if not held:
        return ""
    times = [(parse_timestamp(h.get("flushAt")), parse_timestamp(h.get("deadline"))) for h in held]
    flush_at, deadline = min(times, key=lambda t: t[0] or t[1] or datetime.max.replace(tzinfo=UTC))
    t = flush_at or deadline
    if t is None:
        text = "held"
    else:
        text = "" if flush_at is not None else "due "
        text += f"in {age(now, t)}" if t >= now else f"{age(t, now)} ago"
    return text + (f" (+{len(held) - 1})" if len(held) > 1 else "")


def _when(value: Any, now: datetime) -> str:
    """A time ahead (a deadline) as ``21:55:00Z (in 52m)``; one passed as ``(2m ago)``."""
    t = parse_timestamp(value)
    if t is None:
        return "an unknown time"
    ahead = (t - now).total_seconds()
    when = age(now, t) if ahead >= 0 else age(t, now)
    return t.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%SZ") + (f" (in {when})" if ahead >= 0 else f" ({when} ago)")


def held_text(held: dict[str, Any], now: datetime) -> str:
    text = f"{held.get('worker', '?')} on {held.get('node') or '-'}: {held.get('source', '?')} {held.get('kind', '?')}"
    text += f" ({held['detail']})" if held.get("detail") else ""
    return (
        f"{text}, due {_when(held.get('deadline'), now)}; training goes on, the flush starts "
        f"{_when(held.get('flushAt'), now)}"
    )
