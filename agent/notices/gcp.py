"""GCE preemption and host-maintenance notices from the metadata server, by long poll.

Two watches, one thread each, on ``/computeMetadata/v1/instance/``:

- ``preempted`` — ``FALSE`` until the VM is preempted, then ``TRUE``. GCE gives a preemptible or
  spot VM about 30 s between that flip and the stop (ACPI G2), so the deadline is *the time we
  saw it* + ``notice_seconds``.
- ``maintenance-event`` — ``NONE`` | ``MIGRATE_ON_HOST_MAINTENANCE`` (live migration: the job
  keeps running, logged only) | ``TERMINATE_ON_HOST_MAINTENANCE`` (the VM stops: GCE gives a VM
  with GPUs, which cannot migrate, an hour's notice, other VMs 60 s). The deadline is an hour on a
  machine with an NVIDIA GPU (``maintenance_notice_seconds``), else 60 s. A value already
  TERMINATE_ON_HOST_MAINTENANCE at the first read (the agent started after it was set, e.g. a
  job restarted on the same VM) is given 60 s, whatever the machine, marked as assumed
  (``Notice.deadline_assumed``: the agent flushes at once, whatever ``--flush-lead``): when it was
  set is unknown, unless an earlier agent of this user on this machine, in this boot, saw it
  change and left a record of when (``MaintenanceRecord``): then the deadline counts from that
  time, and is told, not assumed.

Each watch reads the current value and its ETag, then asks ``?wait_for_change=true&last_etag=E``:
the server answers at once if the value has moved on, otherwise it holds the request until it
changes (or ``timeout_sec``). So a notice arrives within one round trip, with no poll interval.
Every request carries ``Metadata-Flavor: Google``; the server refuses it otherwise, and puts the
same header on every answer. An answer without it (not the metadata server's: a proxy's), or with
a value GCE does not document for the key (``known_value``: an HTML page, a truncated body) is a
failed read: warned about once, polling goes on, and nothing changes (a held notice is not
withdrawn, and one heard again is not dated later).

A GKE pod under Workload Identity reaches the GKE metadata server instead, which serves pods a
subset of ``instance/`` without either key (404): the warning says so, and what to do.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import re
import stat
import time
from pathlib import Path

from agent.atomic_file import write_atomic
from agent.notices.base import (
    HttpClient,
    Notice,
    NoticeCallback,
    NoticeKind,
    NoticeSource,
    PollingNoticeSource,
    SourceError,
    _Health,
    utc_stamp,
)
from agent.notices.shared_vm import private_folder, url_key
from agent.process_tree import boot_id

log = logging.getLogger(__name__)

DEFAULT_BASE_URL = "http://metadata.google.internal"
INSTANCE_PATH = "/computeMetadata/v1/instance/"
FLAVOR_HEADERS = {"Metadata-Flavor": "Google"}

PREEMPTION_NOTICE_SECONDS = 30.0
MAINTENANCE_NOTICE_SECONDS = 60.0
GPU_MAINTENANCE_NOTICE_SECONDS = 3600.0
"""GCE's notice of a host maintenance that stops a VM with GPUs attached (they cannot live-migrate)."""


KNOWN_VALUES = {
    "preempted": ("TRUE", "FALSE"),
    "maintenance-event": ("NONE", "MIGRATE_ON_HOST_MAINTENANCE", "TERMINATE_ON_HOST_MAINTENANCE"),
}
"""The values GCE documents for each key the agent watches."""

_MIGRATE = re.compile(r"MIGRATE[A-Z0-9_]*")
"""A live migration by any name GCE may give it: logged only, the job keeps running."""


def known_value(key: str, value: str) -> bool:
    """Whether ``value`` is one GCE documents for ``key`` (``preempted`` in any case; any
    ``MIGRATE…`` of ``maintenance-event``, a live migration). Anything else is no news of the event:
    the watch takes it as a failed read and changes nothing."""
    if key == "preempted":
        return value.upper() in KNOWN_VALUES[key]
    return value in KNOWN_VALUES[key] or _MIGRATE.fullmatch(value) is not None


def maintenance_notice_seconds(root: str = "/") -> float:
    """The deadline of a TERMINATE_ON_HOST_MAINTENANCE: an hour where this machine (or container)
    sees an NVIDIA GPU (``/dev/nvidia0``…, ``/proc/driver/nvidia/gpus/*``), else 60 s."""
    base = Path(root)
    if any(base.joinpath("dev").glob("nvidia[0-9]*")) or any(base.joinpath("proc/driver/nvidia/gpus").glob("*")):
        return GPU_MAINTENANCE_NOTICE_SECONDS
    return MAINTENANCE_NOTICE_SECONDS


class MaintenanceRecord:
    """When an agent on this machine saw ``maintenance-event`` turn TERMINATE_ON_HOST_MAINTENANCE.

    One small JSON file per metadata server (``spotjob-gce-<uid>/<url hash>.json`` in the temp
    folder, beside the Azure agents' register, private to this user, replaced atomically):
    ``{"boot_id", "etag", "first_seen"}``. Only an agent that saw the value change writes it (an
    agent that found it set knows no time to record), and only an earlier time replaces a later
    one. A later agent that finds the value already set with the same ETag counts its deadline
    from ``first_seen``; a record that is unreadable, not a plain file of this user's, of another
    boot or ETag, from the future, or whose notice has run out proves nothing, and the agent
    assumes 60 s as without one. An agent that sees the value leave TERMINATE removes it.
    """

    MAX_BYTES = 4096

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url

    def _path(self) -> str | None:
        """The record's path in this user's private folder (made if need be); None where there is
        no such folder (``private_folder`` warns: a folder others may write proves nothing)."""
        lacking = "an agent restarted during a maintenance notice cannot learn when it began (60 s assumed)"
        folder = private_folder("gce", "", lacking)
        return None if folder is None else os.path.join(folder, url_key(self.base_url) + ".json")

    def first_seen(self, etag: str | None, notice_seconds: float, now: float) -> float | None:
        """When this event (``etag``, this boot) was first seen, if the record proves it and its
        notice has not run out by ``now``; else None."""
        boot = boot_id()
        if etag is None or boot is None:
            return None
        path = self._path()
        if path is None:
            return None
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
        except OSError:
            return None
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid():
                log.warning("%s is not a private file of this user: ignored (60 s assumed)", path)
                return None
            record = json.loads(os.read(fd, self.MAX_BYTES))
        except (OSError, ValueError):
            log.info("the maintenance record %s cannot be read: ignored (60 s assumed)", path)
            return None
        finally:
            os.close(fd)
        if not isinstance(record, dict) or record.get("boot_id") != boot or record.get("etag") != etag:
            return None
        seen = record.get("first_seen")
        if isinstance(seen, bool) or not isinstance(seen, (int, float)) or not math.isfinite(seen):
            return None
        if seen > now or seen + notice_seconds <= now:
            log.info(
                "the maintenance record %s says first seen at %s, %s: ignored (60 s assumed)",
                path,
                utc_stamp(seen),
                "in the future" if seen > now else "longer ago than the notice",
            )
            return None
        return float(seen)

    def save(self, etag: str | None, seen: float, notice_seconds: float) -> None:
        """Record that this agent saw the event ``etag`` change at ``seen`` (kept if an earlier
        time of the same event is there already)."""
        boot = boot_id()
        if etag is None or boot is None:
            return
        earlier = self.first_seen(etag, notice_seconds, time.time())
        if earlier is not None and earlier <= seen:
            return
        path = self._path()
        if path is None:
            return
        data = json.dumps({"boot_id": boot, "etag": etag, "first_seen": seen}).encode()
        try:
            write_atomic(path, data, durable=False, mode=0o600)
        except OSError as e:
            log.warning("cannot write %s (%s): an agent restarted on this machine during the maintenance "
                        "notice will assume 60 s", path, e)  # fmt: skip

    def remove(self) -> None:
        path = self._path()
        if path is not None:
            with contextlib.suppress(OSError):
                os.unlink(path)


class _GceWatch(PollingNoticeSource):
    """Long-polls one metadata key; ``interval`` is only the pause after an error."""

    name = "gcp"

    def __init__(
        self, client: HttpClient, key: str, *, interval: float, long_poll_seconds: int, notice_seconds: float
    ) -> None:
        super().__init__(client, interval)
        self.key = key
        # Two watches poll one server: each failure line names its key (a hung server timed both
        # out, in two lines that read the same).
        self._health = _Health(f"{self.name} notices (instance/{key}) from {client.base_url}")
        self.long_poll_seconds = long_poll_seconds
        self.notice_seconds = notice_seconds
        self._etag: str | None = None
        self._value: str | None = None
        self._quick = False
        self._record = MaintenanceRecord(client.base_url)

    def _poll(self) -> None:
        path = INSTANCE_PATH + self.key
        timeout = 2.0
        if self._etag is not None:
            path += f"?wait_for_change=true&timeout_sec={self.long_poll_seconds}&last_etag={self._etag}"
            timeout = self.long_poll_seconds + 5.0
        started = time.monotonic()
        resp = self.client.request("GET", path, headers=FLAVOR_HEADERS, timeout=timeout)
        if resp.status == 404:
            raise SourceError(
                f"GET {self.client.url(path)} answered 404: this metadata server does not serve "
                f"instance/{self.key}. In a GKE pod under Workload Identity the GKE metadata server serves pods "
                "only part of the instance's metadata, without it, so this agent hears a preemption only as the "
                "SIGTERM of the node's shutdown and from the controller; give the pod hostNetwork: true to reach "
                "the node's own metadata server, or pass --no-gcp to stop asking"
            )
        if resp.status != 200:
            raise SourceError(f"GET {self.client.url(path)} answered {resp.status}")
        if resp.headers.get("metadata-flavor") != "Google":
            raise SourceError(
                f"GET {self.client.url(path)} answered without the header Metadata-Flavor: Google, which the "
                "metadata server puts on every answer: not its answer (a proxy's?), ignored"
            )
        etag = resp.headers.get("etag")
        value = resp.text().strip()
        if not known_value(self.key, value):
            # Not a value GCE documents (a proxy's HTML page, a truncated answer): no news of the
            # event, so nothing changes (a held notice is not withdrawn, nor a new one dated later).
            raise SourceError(
                f"GET {self.client.url(path)} answered {value[:100]!r}, which is no value of instance/{self.key} "
                f"({' | '.join(KNOWN_VALUES[self.key])}): ignored, nothing changes"
            )
        # A server that answers a wait_for_change at once with the same ETag would make this a
        # busy loop; pause the normal interval then.
        self._quick = etag is None or (etag == self._etag and time.monotonic() - started < 0.5)
        if value != self._value and not self._on_value(value, etag):
            # Not delivered: keep the old value and ETag, so that the next poll (after the normal
            # pause) is answered at once with this value and delivers it again.
            self._quick = True
            return
        self._etag = etag
        self._value = value

    def _how(self) -> str:
        return f"long poll on instance/{self.key}"

    def _pause(self) -> float:
        return self.interval if self._quick else 0.0

    def _on_value(self, value: str, etag: str | None) -> bool:
        """Act on a new value (``etag``: its version); False if a notice it meant could not be delivered."""
        if self.key == "preempted":
            if value.upper() == "TRUE":
                return "preempted" in self._seen or self._emit(
                    "preempted",
                    Notice(
                        source=self.name,
                        kind=NoticeKind.PREEMPTION,
                        deadline=self._seen_since("preempted") + self.notice_seconds,
                        detail="instance/preempted=TRUE",
                    ),
                )
            self._forget("preempted")
        elif value == "TERMINATE_ON_HOST_MAINTENANCE":
            if "maintenance" in self._seen:
                return True
            seconds, detail = self.notice_seconds, "instance/maintenance-event=TERMINATE_ON_HOST_MAINTENANCE"
            seen = self._seen_since("maintenance")
            assumed = False
            if self._value is not None:
                self._record.save(etag, seen, seconds)  # seen as it changed: a restart here can count from it
            else:
                # Set before this agent looked: how much of the notice is left is unknown, unless
                # an earlier agent here saw this very value (ETag) change, in this boot.
                recorded = self._record.first_seen(etag, seconds, seen)
                if recorded is None:
                    # A guess, whatever the machine: the agent flushes at once rather than hold it.
                    seconds, assumed = min(seconds, MAINTENANCE_NOTICE_SECONDS), True
                    detail += f" (already set when the agent started: when is unknown, so {seconds:g} s assumed)"
                else:
                    seen = recorded
                    detail += (
                        f" (already set when the agent started: first seen at {utc_stamp(recorded)} by an earlier "
                        "agent on this machine)"
                    )
            return self._emit(
                "maintenance",
                Notice(
                    source=self.name,
                    kind=NoticeKind.MAINTENANCE,
                    deadline=seen + seconds,
                    detail=detail,
                    deadline_assumed=assumed,
                ),
            )
        else:
            if value.startswith("MIGRATE"):
                log.info("GCE maintenance-event %s: live migration, the job keeps running", value)
            if "maintenance" in self._seen:
                self._withdraw(
                    Notice(
                        source=self.name,
                        kind=NoticeKind.MAINTENANCE,
                        deadline=None,
                        detail=f"instance/maintenance-event={value}",
                        withdrawn=True,
                    )
                )
            self._forget("maintenance")
            if self._value == "TERMINATE_ON_HOST_MAINTENANCE":
                self._record.remove()  # seen to end: a new event with the same value counts afresh
        return True


class GceMetadataSource(NoticeSource):
    """Preemption and terminating host maintenance from the GCE metadata server."""

    name = "gcp"

    def __init__(
        self,
        base_url: str = DEFAULT_BASE_URL,
        *,
        notice_seconds: float = PREEMPTION_NOTICE_SECONDS,
        maintenance_notice_seconds: float = MAINTENANCE_NOTICE_SECONDS,
        interval: float = 2.0,
        long_poll_seconds: int = 60,
        watch_maintenance: bool = True,
    ) -> None:
        self.base_url = base_url
        keys = {"preempted": notice_seconds}
        if watch_maintenance:
            keys["maintenance-event"] = maintenance_notice_seconds
        # One client (and thread) per key: each holds its own long poll open.
        self._watches = [
            _GceWatch(
                HttpClient(base_url),
                key,
                interval=interval,
                long_poll_seconds=long_poll_seconds,
                notice_seconds=seconds,
            )
            for key, seconds in keys.items()
        ]

    def start(self, callback: NoticeCallback) -> None:
        for watch in self._watches:
            watch.start(callback)

    def stop(self) -> None:
        for watch in self._watches:
            watch.stop()
