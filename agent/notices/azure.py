"""Azure notices from Scheduled Events (IMDS), with the acknowledgement Azure asks for.

``GET /metadata/scheduledevents?api-version=2020-07-01`` with ``Metadata: true`` returns
``{"DocumentIncarnation": n, "Events": [{"EventId", "EventType", "EventStatus", "Resources",
"NotBefore", ...}]}``. ``NotBefore`` is an RFC 1123 date ("Mon, 19 Sep 2016 18:29:47 GMT"),
the earliest time the platform acts: it is the deadline. Spot eviction is ``Preempt`` (at least
30 s ahead); ``Terminate`` (VMSS scale-in), ``Reboot`` and ``Redeploy`` also stop the job;
``Freeze`` pauses the VM for seconds and is only logged.

Events list every VM of an availability set or scale set. An event whose ``Resources`` do not
name this VM (``/metadata/instance/compute/name``) is ignored. The name is read again at every
poll until it is known (IMDS throttles with 429, and may answer 5xx while it starts); until then
every event counts — a needless flush is safe, a missed preemption is not — but an event naming
VMs is never acknowledged, because it may be another VM's: acknowledging it would start that
VM's maintenance or eviction at once.

Azure enables Scheduled Events on a VM at its first request for them, and answers that request
within up to two minutes. Until one request has been answered, each waits up to
``FIRST_CALL_TIMEOUT`` for its answer (not the usual 2 s, which would time out and warn at every
start), but its connect only the usual ``timeout`` (an unreachable IMDS, off Azure, is told at
once); ``stop`` cuts that wait short.

An event heard before whose ``NotBefore`` changes (Azure moved it, or it was started: ``Started``
with an empty ``NotBefore``, the platform acting within seconds) is heard again with its new
deadline: a flush the agent holds for a Reboot or Redeploy (``--flush-lead``) must not wait for a
time that no longer holds. An empty (or unreadable) ``NotBefore`` tells no time: the deadline is
then Azure's 30 s minimum from when the event was seen, marked assumed (``Notice.deadline_assumed``),
and the agent flushes at once rather than hold it, whether the event was already ``Started`` when
first heard or started later. One that leaves the list (Azure cancelled it) is withdrawn
(``Notice.withdrawn``): a flush held for it is dropped.

Acknowledgement: after the flush has ended (committed or failed) the agent calls
``flush_finished``; this source then POSTs ``{"StartRequests": [{"EventId": ...}]}`` for the
events it turned into notices, which tells Azure it may proceed now instead of at ``NotBefore``.
It is sent from the source's thread, retried each poll until accepted, and attempted once more on
``stop`` so a job that ends right after its flush still acknowledges.

An event is the VM's, not the job's: on a VM shared by several jobs (two agents on one machine,
a job and an eval job) acknowledging it after this job's flush would let Azure evict the VM while
the other job is still flushing. So each source registers with the other agents on the machine
(``agent.notices.shared_vm``), and an event is acknowledged once every agent still running there
has finished its flush for it: the last one acknowledges.
"""

from __future__ import annotations

import email.utils
import json
import logging
import threading
from datetime import UTC
from typing import Any

from agent.notices.base import (
    HttpClient,
    Notice,
    NoticeCallback,
    NoticeKind,
    PollingNoticeSource,
    SourceError,
    _Health,
    deliver_notice,
)
from agent.notices.shared_vm import SharedVm

log = logging.getLogger(__name__)

DEFAULT_BASE_URL = "http://169.254.169.254"
API_VERSION = "2020-07-01"
EVENTS_PATH = f"/metadata/scheduledevents?api-version={API_VERSION}"
VM_NAME_PATH = "/metadata/instance/compute/name?api-version=2021-02-01&format=text"
METADATA_HEADERS = {"Metadata": "true"}

FIRST_CALL_TIMEOUT = 150.0
"""How long a scheduled events request waits until the service answered once: Azure enables it on
the VM at the first request, whose answer can take up to two minutes."""

PREEMPT_NOTICE_SECONDS = 30.0
"""Azure's minimum notice for ``Preempt``: the deadline when ``NotBefore`` is empty or unreadable."""

EVENT_KINDS: dict[str, NoticeKind] = {
    "Preempt": NoticeKind.PREEMPTION,
    "Terminate": NoticeKind.TERMINATE,
    "Reboot": NoticeKind.MAINTENANCE,
    "Redeploy": NoticeKind.MAINTENANCE,
}


def parse_not_before(value: str) -> float | None:
    """RFC 1123 (``Mon, 19 Sep 2016 18:29:47 GMT``) → unix time; ``""`` (started) → None.

    A time that names no zone (``-0000``, or none at all) is UTC, as IMDS's times are: Python
    would read it in the node's own zone."""
    if not value.strip():
        return None
    when = email.utils.parsedate_to_datetime(value)
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return when.timestamp()


class AzureScheduledEventsSource(PollingNoticeSource):
    """Preempt / Terminate / Reboot / Redeploy scheduled events for this VM."""

    name = "azure"
    # stop() must not cut the last acknowledgement short.
    abort_on_stop = False

    def __init__(self, base_url: str = DEFAULT_BASE_URL, *, interval: float = 2.0, timeout: float = 2.0) -> None:
        super().__init__(HttpClient(base_url), interval)
        self.timeout = timeout
        self._incarnation: int | None = None
        self._enabled = False
        """Whether scheduled events answered once (the service is up on this VM)."""
        self._asked = False
        self._vm_name: str | None = None
        self._vm_name_problem: str | None = None
        """Why the name could not be read, once it was logged (logged once, not at every poll)."""
        self._not_before: dict[str, str] = {}
        """The ``NotBefore`` each event turned into a notice had when the agent last heard it."""
        self._kinds: dict[str, NoticeKind] = {}
        self._resources: dict[str, list[str]] = {}
        """The ``Resources`` of each event turned into a notice: what decides whether to acknowledge it."""
        self._lock = threading.Lock()
        self._to_ack: list[str] = []
        self._acked: set[str] = set()
        self._ack_wanted = False
        self.shared_vm = SharedVm(base_url)
        """The other agents on this machine: an event is acknowledged once they are done with it."""
        self._waiting_for: dict[str, list[int]] = {}
        """The other agents each pending acknowledgement last waited for (logged when it changes)."""
        self._ack_health = _Health(f"acknowledging Azure scheduled events at {self.client.base_url}")
        """Whether the last acknowledgement went through (its failure is warned about once)."""

    @property
    def acknowledged(self) -> set[str]:
        with self._lock:
            return set(self._acked)

    def start(self, callback: NoticeCallback) -> None:
        self.shared_vm.join()
        super().start(callback)

    def stop(self) -> None:
        # The first request may wait minutes for the service; nothing is heard yet, so nothing
        # is left to acknowledge: end it now (later requests are short, and an ack is not cut).
        if not self._enabled:
            self.client.abort()
        super().stop()

    def flush_finished(self) -> None:
        with self._lock:
            self._ack_wanted = True
        self._wake.set()

    # -- poll ----------------------------------------------------------------------------------
    def _poll(self) -> None:
        if self._vm_name is None:
            self._vm_name = self._read_vm_name()
        try:
            self._send_ack()
        except (OSError, SourceError) as e:
            # Retried next poll; the events are read all the same: an acknowledgement IMDS keeps
            # refusing (an event it no longer lists, throttling) must not stop this agent from
            # hearing the next event, nor from seeing the refused one leave the list.
            self._ack_health.failed(e)
        else:
            self._ack_health.ok()
        timeout = self.timeout
        if not self._enabled:
            timeout = max(timeout, FIRST_CALL_TIMEOUT)
            if not self._asked:
                log.info(
                    "asking for Azure scheduled events: Azure enables them on this VM at the first request, "
                    "whose answer can take up to two minutes"
                )
                self._asked = True
        try:
            resp = self.client.request(
                "GET", EVENTS_PATH, headers=METADATA_HEADERS, timeout=timeout, connect_timeout=self.timeout
            )
        except TimeoutError as e:
            if self._enabled:
                raise
            raise SourceError(
                f"GET {self.client.url(EVENTS_PATH)} got no answer ({e}), though Azure answers the first request "
                "within two minutes: is this an Azure VM whose metadata service this process reaches?"
            ) from e
        if resp.status != 200:
            raise SourceError(f"GET {self.client.url(EVENTS_PATH)} answered {resp.status}")
        try:
            doc = json.loads(resp.body)
            incarnation = int(doc.get("DocumentIncarnation", 0))
            events = list(doc.get("Events") or [])
        except (ValueError, TypeError, AttributeError) as e:
            raise SourceError(f"unreadable scheduled events document: {e}") from e
        self._enabled = True
        if incarnation == self._incarnation:
            return
        delivered = [self._on_event(event) for event in events if isinstance(event, dict)]
        listed = {str(event.get("EventId", "")) for event in events if isinstance(event, dict)}
        delivered += [self._on_gone(event_id) for event_id in list(self._not_before) if event_id not in listed]
        # A document is done only when every notice in it was delivered; otherwise the next poll
        # reads it again (same incarnation) and retries the ones not yet delivered.
        if all(delivered):
            self._incarnation = incarnation

    def _on_event(self, event: dict[str, Any]) -> bool:
        """Turn one event into a notice; False if its delivery failed (retried next poll)."""
        event_id = str(event.get("EventId", ""))
        event_type = str(event.get("EventType", ""))
        if not event_id:
            return True
        if event_id in self._seen:
            return self._on_moved(event_id, event)
        resources = [str(r) for r in event.get("Resources") or []]
        if self._vm_name and resources and self._vm_name not in resources:
            self._seen.add(event_id)
            log.debug("Azure event %s (%s) is for %s, not %s", event_id, event_type, resources, self._vm_name)
            return True
        kind = EVENT_KINDS.get(event_type)
        if kind is None:
            self._seen.add(event_id)
            log.info("Azure scheduled event %s (%s): no flush needed", event_id, event_type)
            return True
        deadline, assumed = self._deadline(event_id, str(event.get("NotBefore") or ""))
        notice = Notice(
            source=self.name,
            kind=kind,
            deadline=deadline,
            detail=f"scheduled event {event_type} {event_id} ({event.get('EventStatus', '?')}{assumed})",
            event_id=event_id,
            deadline_assumed=bool(assumed),
        )
        if not self._emit(event_id, notice):
            return False
        self._not_before[event_id] = str(event.get("NotBefore") or "")
        self._kinds[event_id] = kind
        with self._lock:
            self._resources[event_id] = resources
            self._to_ack.append(event_id)  # acknowledged once the flush it started has ended
        return True

    def _deadline(self, event_id: str, not_before: str) -> tuple[float, str]:
        """An event's deadline: its ``NotBefore``, else (empty or unreadable, warned) Azure's
        minimum notice counted from when the event was first seen. The second item is empty for a
        ``NotBefore``, else what the notice's detail adds to say the deadline is assumed: Azure
        said no time (an event ``Started`` goes within seconds), so the notice is not held."""
        try:
            deadline = parse_not_before(not_before)
        except (ValueError, TypeError) as e:
            log.warning("Azure event %s: unreadable NotBefore %r (%s)", event_id, not_before, e)
            why = "unreadable"
        else:
            if deadline is not None:
                return deadline, ""
            why = "empty"
        assumed = f"; NotBefore {why}: {PREEMPT_NOTICE_SECONDS:g} s assumed"
        return self._seen_since(event_id) + PREEMPT_NOTICE_SECONDS, assumed

    def _on_moved(self, event_id: str, event: dict[str, Any]) -> bool:
        """An event already turned into a notice whose ``NotBefore`` changed: Azure moved it, or it
        was started (``Started``, ``NotBefore`` empty: the platform acts within seconds, because
        someone acknowledged it: another container's agent, a user, the platform itself). The
        agent hears it again with the new deadline, so a flush it holds for the old one starts in
        time. False if that delivery failed (retried next poll)."""
        not_before = str(event.get("NotBefore") or "")
        before = self._not_before.get(event_id)
        if before is None or before == not_before or event_id in self.acknowledged:
            return True  # not a notice (another VM's, a Freeze), unchanged, or started by this agent's ack
        status = event.get("EventStatus", "?")
        deadline, assumed = self._deadline(event_id, not_before)
        notice = Notice(
            source=self.name,
            kind=EVENT_KINDS.get(str(event.get("EventType", "")), NoticeKind.TERMINATE),
            deadline=deadline,
            detail=f"scheduled event {event.get('EventType', '?')} {event_id} ({status}; "
            f"NotBefore was {before!r}{assumed})",
            event_id=event_id,
            deadline_assumed=bool(assumed),
        )
        if not deliver_notice(self.name, self._callback, notice):
            return False
        self._first_seen.pop(event_id, None)
        self._not_before[event_id] = not_before
        return True

    def _on_gone(self, event_id: str) -> bool:
        """An event turned into a notice has left the list: Azure cancelled it (or it is over). The
        agent drops a flush it holds for it; one under way goes on. False if that delivery failed."""
        withdrawn = Notice(
            source=self.name,
            kind=self._kinds.get(event_id, NoticeKind.MAINTENANCE),
            deadline=None,
            detail=f"scheduled event {event_id} left the list",
            event_id=event_id,
            withdrawn=True,
        )
        if not self._withdraw(withdrawn):
            return False
        del self._not_before[event_id]
        self._seen.discard(event_id)  # listed again, it is heard again
        with self._lock:
            self._to_ack = [i for i in self._to_ack if i != event_id]  # no longer Azure's to start
        return True

    def _read_vm_name(self) -> str | None:
        """This VM's name, or None (logged once) when IMDS did not give it this time."""
        problem = None
        try:
            resp = self.client.request("GET", VM_NAME_PATH, headers=METADATA_HEADERS, timeout=self.timeout)
        except OSError as e:
            problem = str(e)
        else:
            name = resp.text().strip() if resp.status == 200 else ""
            if name:
                if self._vm_name_problem is not None:
                    log.info("read this VM's name (%s): events for other VMs are ignored from now on", name)
                return name
            problem = f"GET {self.client.url(VM_NAME_PATH)} answered {resp.status}" + (
                " (empty)" if resp.status == 200 else ""
            )
        if self._vm_name_problem is None:
            log.warning(
                "cannot read this VM's name (%s): until it is read every scheduled event counts, "
                "and none that names VMs is acknowledged (will keep trying)",
                problem,
            )
        self._vm_name_problem = problem
        return None

    def _is_for_this_vm(self, event_id: str) -> bool:
        """Whether acknowledging ``event_id`` can only affect this VM (it names no VMs, or this one)."""
        resources = self._resources.get(event_id, [])
        return not resources or (self._vm_name is not None and self._vm_name in resources)

    # -- acknowledgement -----------------------------------------------------------------------
    def _send_ack(self) -> None:
        with self._lock:
            if not self._ack_wanted:
                return
            pending = [i for i in self._to_ack if i not in self._acked]
        if self._vm_name is None and any(self._resources.get(i) for i in pending):
            self._vm_name = self._read_vm_name()
        ids = [i for i in pending if self._is_for_this_vm(i)]
        unsure = [i for i in pending if i not in ids]
        if unsure:
            with self._lock:
                self._to_ack = [i for i in self._to_ack if i not in unsure]
            log.warning(
                "not acknowledging Azure scheduled event(s) %s: they name %s, and this VM's name is %s; "
                "Azure proceeds at their NotBefore",
                ", ".join(unsure),
                sorted({r for i in unsure for r in self._resources.get(i, [])}),
                "unknown" if self._vm_name is None else repr(self._vm_name),
            )
        for event_id in pending:
            self.shared_vm.finished(event_id)
        ids = [i for i in ids if not self._others_flushing(i)]
        if not ids:
            return
        body = json.dumps({"StartRequests": [{"EventId": i} for i in ids]}).encode()
        headers = {**METADATA_HEADERS, "Content-Type": "application/json"}
        resp = self.client.request("POST", EVENTS_PATH, headers=headers, body=body, timeout=self.timeout)
        if resp.status != 200:
            raise SourceError(f"acknowledging {ids} answered {resp.status}")
        with self._lock:
            self._acked.update(ids)
        log.info("acknowledged Azure scheduled event(s) %s: the platform may proceed", ", ".join(ids))

    def _others_flushing(self, event_id: str) -> bool:
        """Whether another agent on this machine has not finished its flush for ``event_id`` (logged
        when that changes): acknowledging now would let Azure stop the VM in the middle of it."""
        others = self.shared_vm.unfinished(event_id)
        if others and others != self._waiting_for.get(event_id):
            log.warning(
                "not acknowledging Azure scheduled event %s yet: the agent(s) of another job on this machine "
                "(pid %s) may still be flushing for it, and the acknowledgement would let Azure stop the VM under "
                "them; the last agent to finish acknowledges, else Azure proceeds at its NotBefore",
                event_id,
                ", ".join(map(str, others)),
            )
        self._waiting_for[event_id] = others
        return bool(others)

    def _on_stopping(self) -> None:
        try:
            self._send_ack()
        except (OSError, SourceError) as e:
            log.warning("could not acknowledge Azure scheduled events on the way out: %s", e)
        finally:
            self.shared_vm.leave()
