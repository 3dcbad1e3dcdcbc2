"""The standard streams of spotjob's own commands (``spotjob``, ``spotjob-agent``, the controller,
the kubectl plugin); never of the user's training process.

Their output holds text the terminal's encoding may not: a ``—`` or ``…`` of ours, a path or job
name the user chose. Under ``PYTHONIOENCODING=ascii``, a Latin-1 locale, or a file name whose
bytes are not UTF-8 (decoded to surrogates), Python's stdout raises ``UnicodeEncodeError`` for
such a character, which turned a finished command into a traceback. Writing it as an escape
(``\\u2014``) instead keeps the output whole and readable, and the exit status the command's own.

Their log lines carry UTC times in ISO 8601 with a ``Z`` (``2026-12-04T03:25:00.123Z``): the same
on every node and controller whatever its ``TZ``, and comparable with the deadlines they log,
which are UTC too. Python's default is the machine's local time without a zone.

At debug level (``-v``, ``SPOTJOB_LOG_LEVEL=debug``) the cloud and HTTP clients log every request
they send: headers, URLs, token responses. The formatter blanks what in them is a credential (an
``Authorization`` header, an STS session token, a GCS resumable session's ``upload_id``, an OAuth
token in a response, the ``user:password@`` of an endpoint URL), so that a debug log can be pasted
into an issue.

``SPOTJOB_LOG_FORMAT=json`` (or a command's ``--log-format json``) writes each log line as one JSON
object instead (``time``, ``level``, ``logger``, ``message``, the command's own fields such as the
agent's ``pid`` and ``job``, and ``exception`` with its traceback), for log pipelines that index
fields; credentials are blanked the same way. What Python would write to stderr itself, an
uncaught exception's traceback (logger ``py.exceptions``) and a warning (``py.warnings``), is one
such object too.
"""

from __future__ import annotations

import contextlib
import contextvars
import io
import json
import logging
import re
import sys
import threading
import time
import types
from collections.abc import Iterator, Mapping


def tolerate_unencodable_output() -> None:
    """(each command, first thing) Write what stdout and stderr cannot encode as backslash escapes."""
    for stream in (sys.stdout, sys.stderr):
        if isinstance(stream, io.TextIOWrapper):  # not a test's StringIO, nor None (pythonw)
            stream.reconfigure(errors="backslashreplace")


class UtcFormatter(logging.Formatter):
    """``%(asctime)s`` as UTC, ISO 8601, milliseconds and a ``Z``."""

    @staticmethod
    def converter(secs: float | None = None, /) -> time.struct_time:
        return time.gmtime(secs)

    default_time_format = "%Y-%m-%dT%H:%M:%S"
    default_msec_format = "%s.%03dZ"

    def format(self, record: logging.LogRecord) -> str:
        return redact(super().format(record))


_CREDENTIALS = re.compile(
    # A header, as botocore's and urllib3's debug lines write them ('Name': b'value' or Name: value).
    r"""((?:proxy-)?authorization|x-amz-security-token|x-goog-api-key)(['"]?\s*[:=]\s*(?:b?['"])?)[^'"\r\n]+"""
    # A query parameter: a presigned URL's token or signature, a GCS resumable session's id.
    r"""|((?:x-amz-security-token|x-amz-signature|x-amz-credential|upload_id|access_token)=)[^&\s'"]+"""
    # An OAuth token response or a service account key, as JSON.
    r"""|("(?:access_token|refresh_token|id_token|client_secret|private_key)"\s*:\s*")[^"]+"""
    # A URL's user information (an endpoint behind basic auth: http://user:password@host), which
    # botocore's debug lines and connection errors repeat whole: up to the LAST @ before a / ? #,
    # whitespace or the end (as urllib finds the host), so that a password holding a quote, any of
    # RFC 3986's sub-delims or a raw @ is blanked whole; a quote closing a quoted URL comes after it.
    r"""|([a-z][a-z0-9+.-]*://)[^/?#\s]+@""",
    re.IGNORECASE,
)


def redact(text: str) -> str:
    """``text`` with the credentials the clients' debug lines carry replaced by ``<redacted>``."""

    def blank(m: re.Match[str]) -> str:
        if m.group(1) is not None:
            return f"{m.group(1)}{m.group(2)}<redacted>"
        if m.group(5) is not None:
            return f"{m.group(5)}<redacted>@"
        return f"{m.group(3) or m.group(4)}<redacted>"

    return _CREDENTIALS.sub(blank, text)


ENV_LOG_FORMAT = "SPOTJOB_LOG_FORMAT"
LOG_FORMATS = ("text", "json")


def log_format(value: str | None) -> str:
    """``text`` or ``json`` for a ``--log-format`` / ``SPOTJOB_LOG_FORMAT`` value (any case; unset or
    empty: ``text``). ValueError naming what it must be otherwise."""
    chosen = (value or "").strip().lower() or "text"
    if chosen not in LOG_FORMATS:
        raise ValueError(f"{value!r}: expected text or json")
    return chosen


_LINE_FIELDS: contextvars.ContextVar[Mapping[str, object] | None] = contextvars.ContextVar(
    "spotjob_log_fields", default=None
)


@contextlib.contextmanager
def log_fields(**fields: object) -> Iterator[None]:
    """Add ``fields`` to every JSON log line written in this thread (this context) until the block
    ends: the controller's reconcile pass names its job (``job``: ``namespace/name``) this way.
    Text lines are unchanged; their messages name what they are about."""
    token = _LINE_FIELDS.set({**(_LINE_FIELDS.get() or {}), **fields})
    try:
        yield
    finally:
        _LINE_FIELDS.reset(token)


class JsonFormatter(UtcFormatter):
    """Each record as one JSON object on one line: ``time`` (UTC, as the text lines write it),
    ``level``, ``logger``, ``message``, then ``fields`` (the command's own, such as the agent's
    ``pid`` and ``job``) and those of ``log_fields`` around the line, and ``exception`` (the
    traceback) when there is one. Non-ASCII is escaped, so the line is valid JSON whatever the
    stream's encoding."""

    def __init__(self, fields: Mapping[str, object] | None = None) -> None:
        super().__init__()
        self._fields = dict(fields or {})

    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, object] = {
            "time": self.formatTime(record),
            "level": record.levelname,
            "logger": record.name,
            "message": redact(record.getMessage()).rstrip("\n"),  # a warning's text ends in one
            **self._fields,
            **(_LINE_FIELDS.get() or {}),
        }
        if record.exc_info:
            doc["exception"] = redact(self.formatException(record.exc_info))
        if record.stack_info:
            doc["stack"] = self.formatStack(record.stack_info)
        return json.dumps(doc, default=str)


def log_to_stderr(
    level: int | str,
    fmt: str,
    handler: logging.Handler | None = None,
    *,
    kind: str = "text",
    fields: Mapping[str, object] | None = None,
) -> None:
    """(each command, once) Its log lines to ``handler`` (default: stderr), times in UTC: as
    ``fmt`` lays them out, or (``kind="json"``) as JSON objects with ``fields`` added."""
    handler = handler if handler is not None else logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter(fields) if kind == "json" else UtcFormatter(fmt))
    logging.basicConfig(level=level, handlers=[handler])
    if kind == "json":
        # What Python writes to stderr itself would be lines of text among the JSON objects: an
        # uncaught exception's traceback (of the main thread or another) and a warning. They are
        # log records instead, so a log pipeline gets them whole, as one object each.
        logging.captureWarnings(True)
        sys.excepthook = _log_uncaught
        threading.excepthook = _log_uncaught_in_thread


UNCAUGHT_LOGGER = "py.exceptions"
"""The logger of an exception nothing caught (JSON logs only), as ``py.warnings`` is the warnings'."""


def _log_uncaught(kind: type[BaseException], error: BaseException, traceback: types.TracebackType | None) -> None:
    if issubclass(kind, KeyboardInterrupt):
        sys.__excepthook__(kind, error, traceback)
        return
    logging.getLogger(UNCAUGHT_LOGGER).critical(
        "uncaught %s: %s", kind.__name__, error, exc_info=(kind, error, traceback)
    )


def _log_uncaught_in_thread(args: threading.ExceptHookArgs) -> None:
    if args.exc_type is SystemExit:  # as threading's own hook: a thread's sys.exit() says nothing
        return
    name = args.thread.name if args.thread is not None else "a thread"
    logging.getLogger(UNCAUGHT_LOGGER).critical(
        "uncaught %s in thread %s: %s",
        args.exc_type.__name__,
        name,
        args.exc_value,
        exc_info=(args.exc_type, args.exc_value or args.exc_type(), args.exc_traceback),
    )
