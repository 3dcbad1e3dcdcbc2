"""What a GCS media GET's answer says in its headers: the span sent and the object's size, its
CRC32C, when it was written, its generation (``agent.storage.gs`` reads them before the body)."""

from __future__ import annotations

import email.utils
import re

import requests

from agent.storage._transfer import crc_from_b64

_CONTENT_RANGE = re.compile(r"bytes\s+(?:(\d+)-\d+|\*)/(\d+)\s*$", re.IGNORECASE)


def _answer_span(resp: requests.Response) -> tuple[int, int | None]:
    """(first byte sent, the object's size or None) of a media GET's answer, from its headers."""
    match = _CONTENT_RANGE.match(resp.headers.get("Content-Range", "").strip())
    if resp.status_code == 206:
        return (int(match.group(1)), int(match.group(2))) if match and match.group(1) else (0, None)
    if resp.status_code == 416:
        return 0, int(match.group(2)) if match else 0
    length = resp.headers.get("Content-Length", "")
    return 0, int(length) if length.isdigit() else None


def _answer_crc32c(resp: requests.Response) -> int | None:
    """The stored object's CRC32C a media GET's answer says (``x-goog-hash: crc32c=...``), or None."""
    for part in resp.headers.get("x-goog-hash", "").split(","):
        name, _, value = part.strip().partition("=")
        if name.lower() == "crc32c" and value:
            try:
                return crc_from_b64(value)
            except ValueError:
                return None
    return None


def _answer_time(resp: requests.Response) -> float | None:
    """When the object was written, by a media GET's answer (``Last-Modified``), or None."""
    try:
        return email.utils.parsedate_to_datetime(resp.headers.get("Last-Modified", "")).timestamp()
    except (TypeError, ValueError):
        return None


def _answer_generation(resp: requests.Response) -> int | None:
    """The object's generation a media GET's answer says (``x-goog-generation``), or None."""
    text = resp.headers.get("x-goog-generation", "").strip()
    return int(text) if text.isdigit() else None
