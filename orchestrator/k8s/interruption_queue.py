"""spotjob's own EC2 interruption queue (EventBridge → SQS), read by the leader, into Node annotations.

The earliest notice a cluster gets: EC2 emits a spot interruption warning two minutes before it
takes an instance, often before the node's own handler has tainted it. Karpenter's pattern:

1. *receive* (the leader only, one thread): long-poll the queue (``WaitTimeSeconds``), up to ten
   messages at a time;
2. *parse* each body into one normalised ``InterruptionMessage`` (``parse_message``): its kind,
   the instance, the event's time and, for a spot warning, the deadline (the event's time plus
   the two minutes EC2 gives);
3. *make it durable*: merge-patch the annotation ``spotjob.dev/interruption`` (JSON ``{kind,
   deadline, messageId, source, time, instanceId, detail}``) onto every Node whose
   ``spec.providerID`` names the instance (``aws:///<zone>/<instance id>``; a Node informer index),
   a compare-and-swap on the resourceVersion of the Node the message was judged on;
4. *acknowledge*: delete the message only once that write succeeded. A message for an instance
   that is no Node of this cluster, one that cannot be parsed, and one that asks for nothing (a
   state change to ``running``) are logged, counted and deleted; an API failure leaves the message
   on the queue, and SQS delivers it again after its visibility timeout. A delete that fails is
   logged and counted as a queue error, and the rest of the batch is handled all the same: the
   message comes back after its visibility timeout, a duplicate of what it already did.

The reconciler never sees a message: ``orchestrator.k8s.cluster_signals.annotation_signal`` turns
the annotation into a ``Signal`` for the jobs that have a worker on that node, in their next pass
(a Node update queues them). A notice already on the node is never weakened: a message whose kind
is no more severe than the annotation there (a rebalance recommendation arriving after the spot
warning; SQS does not keep order) writes nothing, except over a ``NodeLost`` of a stop: a message
dated after it is of the instance's next run (it was started again), and replaces it. That holds
whatever the Node cache lags behind: a write the Node changed before is judged again on the Node
read fresh, and a message the cache shows as covered is, before it is dropped (``_annotate``). A start
removes a notice only from the Node as the cache showed it (its resourceVersion): a notice this
reader wrote a moment before may not be in the cache yet. An annotation older than
``cluster_signals.INTERRUPTION_TTL_SECONDS`` no longer counts (a node that was stopped and started
again keeps its name), and a state change to ``pending`` or ``running`` later than the notice's event
removes it at once (the instance runs again; its jobs must not read the node as lost).

The queue must be spotjob's own. A queue message is consumed once: a queue that Karpenter or
aws-node-termination-handler also reads would split the notices between them.

Event shapes, as AWS documents them (the example events on each page; fields used here only):

- ``EC2 Spot Instance Interruption Warning``: ``detail.instance-id``, ``detail.instance-action``
  (``hibernate``, ``stop`` or ``terminate``), ``time``. docs.aws.amazon.com/AWSEC2/latest/UserGuide/
  spot-instance-termination-notices.html ("EC2 Spot Instance Interruption Warning event").
- ``EC2 Instance Rebalance Recommendation``: ``detail.instance-id``, ``time``.
  docs.aws.amazon.com/AWSEC2/latest/UserGuide/rebalance-recommendations.html.
- ``EC2 Instance State-change Notification``: ``detail.instance-id``, ``detail.state`` (``pending``,
  ``running``, ``stopping``, ``stopped``, ``shutting-down``, ``terminated``), ``time``.
  docs.aws.amazon.com/AWSEC2/latest/UserGuide/monitoring-instance-state-changes.html.

Every event carries ``id``, ``detail-type``, ``source`` (``aws.ec2``), ``time`` (ISO 8601, UTC)
and ``detail``; ``version``, ``account``, ``region`` and ``resources`` are not relied on.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from enum import StrEnum
from typing import Any, Protocol
from urllib.parse import urlparse

from orchestrator.k8s.api import NODES, Conflict, KubeClient, KubeError, NotFound, Object
from orchestrator.k8s.cluster_signals import (
    INTERRUPTION_ANNOTATION,
    SOURCE_QUEUE,
    notice_expired,
    read_interruption,
    severity,
)
from orchestrator.k8s.informer import Cache
from orchestrator.model import parse_timestamp
from orchestrator.signals import SignalKind

log = logging.getLogger(__name__)

SPOT_WARNING = "EC2 Spot Instance Interruption Warning"
REBALANCE = "EC2 Instance Rebalance Recommendation"
STATE_CHANGE = "EC2 Instance State-change Notification"

SPOT_NOTICE_SECONDS = 120.0
"""EC2 interrupts a spot instance two minutes after the warning (except hibernation: at once)."""

STATE_KINDS = {
    "stopping": SignalKind.TERMINATING,
    "shutting-down": SignalKind.TERMINATING,
    "stopped": SignalKind.NODE_LOST,
    "terminated": SignalKind.NODE_LOST,
}
"""Instance states that mean the node is going (a flush may still run) or gone (nothing to flush)."""

STARTING_STATES = ("pending", "running")
"""Instance states that mean it runs again (after a stop): an older notice on its Node is stale."""

WRITE_ATTEMPTS = 5
"""Compare-and-swap writes of one notice onto one Node before its message is left for redelivery
(each Conflict means the Node changed between its fresh read and the write)."""

INSTANCE_INDEX = "instance-id"
"""The Node informer's index of EC2 instance ids (from ``spec.providerID``)."""


class Outcome(StrEnum):
    """What became of one queue message (the ``outcome`` label of its metric)."""

    ANNOTATED = "annotated"
    """Written onto its Node(s); deleted."""
    DUPLICATE = "duplicate"
    """Its Node already carried a notice at least as severe; deleted."""
    UNKNOWN_NODE = "unknown_node"
    """No Node of this cluster runs the instance; deleted."""
    IGNORED = "ignored"
    """A well-formed event that asks for nothing (an instance starting); deleted."""
    CLEARED = "cleared"
    """An instance started again after the notice on its Node: the notice removed; deleted."""
    UNPARSABLE = "unparsable"
    """Not an EC2 event this reader knows, or malformed; deleted."""
    RETRY = "retry"
    """The Node could not be written: left on the queue, delivered again after its visibility timeout."""


class MessageRejected(ValueError):
    """A message this reader will not act on; ``outcome`` says which kind of rejection it is. An
    instance starting (``IGNORED``) names the instance and when it started (``started``)."""

    def __init__(self, outcome: Outcome, message: str, *, started: tuple[str, datetime] | None = None) -> None:
        super().__init__(message)
        self.outcome = outcome
        self.started = started


@dataclass(frozen=True)
class InterruptionMessage:
    """One EC2 event, normalised (Karpenter's message types, in one)."""

    kind: SignalKind
    instance_id: str
    time: datetime
    """When EC2 emitted the event (timezone-aware)."""
    deadline: datetime | None
    """When the capacity goes away: a spot warning's time plus two minutes; None otherwise."""
    message_id: str
    """The event's id (EventBridge's, stable across redeliveries)."""
    detail: str
    """What happened, in the event's words (for Events and logs)."""

    def annotation(self) -> str:
        """The ``spotjob.dev/interruption`` annotation's value (what ``read_interruption`` parses)."""
        value: dict[str, Any] = {
            "kind": str(self.kind),
            "deadline": _rfc3339(self.deadline) if self.deadline is not None else None,
            "messageId": self.message_id,
            "source": SOURCE_QUEUE,
            "time": _rfc3339(self.time),
            "instanceId": self.instance_id,
            "detail": self.detail,
        }
        return json.dumps(value, separators=(",", ":"))


def _rfc3339(t: datetime) -> str:
    return t.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_message(body: str | bytes) -> InterruptionMessage:
    """One SQS message body (an EventBridge event) as an ``InterruptionMessage``.

    Raises ``MessageRejected``: ``UNPARSABLE`` for what is not a well-formed EC2 event of the three
    kinds the rules forward, ``IGNORED`` for an event that asks for nothing (a state change to
    ``pending`` or ``running``).
    """
    try:
        event = json.loads(body)
    except (ValueError, UnicodeDecodeError) as e:
        raise MessageRejected(Outcome.UNPARSABLE, f"not JSON: {e}") from None
    except RecursionError:
        raise MessageRejected(Outcome.UNPARSABLE, "not JSON this reader takes: nested too deeply") from None
    if not isinstance(event, dict):
        raise MessageRejected(Outcome.UNPARSABLE, "not a JSON object")
    detail_type = event.get("detail-type")
    if event.get("source") != "aws.ec2" or detail_type not in (SPOT_WARNING, REBALANCE, STATE_CHANGE):
        raise MessageRejected(
            Outcome.UNPARSABLE,
            f"not an EC2 interruption event (source {event.get('source')!r}, detail-type {detail_type!r})",
        )
    detail = event.get("detail")
    if not isinstance(detail, dict):
        raise MessageRejected(Outcome.UNPARSABLE, f"{detail_type} without a detail object")
    instance = detail.get("instance-id")
    if not isinstance(instance, str) or not instance.startswith("i-"):
        raise MessageRejected(Outcome.UNPARSABLE, f"{detail_type} without an instance-id (got {instance!r})")
    event_id = event.get("id")
    if not isinstance(event_id, str) or not event_id:
        raise MessageRejected(Outcome.UNPARSABLE, f"{detail_type} for {instance} without an event id")
    when = parse_timestamp(event.get("time"))
    if when is None:
        raise MessageRejected(
            Outcome.UNPARSABLE, f"{detail_type} for {instance}: time {event.get('time')!r} is not ISO 8601"
        )
    try:
        # In UTC, and with room for its deadline: a time at the ends of the calendar (year 1 with an
        # offset east of UTC, 9999-12-31) has neither, and must not stop the reader at every delivery.
        when = when.astimezone(UTC)
        two_minutes_later = when + timedelta(seconds=SPOT_NOTICE_SECONDS)
    except OverflowError:
        raise MessageRejected(
            Outcome.UNPARSABLE, f"{detail_type} for {instance}: time {event.get('time')!r} is out of range"
        ) from None

    deadline: datetime | None = None
    if detail_type == SPOT_WARNING:
        kind = SignalKind.SPOT_INTERRUPTION
        action = detail.get("instance-action")
        deadline = two_minutes_later
        if action == "hibernate":
            deadline = when  # hibernation begins at once: no two minutes
        text = f"{detail_type} (instance-action {action})" if isinstance(action, str) else detail_type
    elif detail_type == REBALANCE:
        kind, text = SignalKind.REBALANCE, detail_type
    else:
        state = detail.get("state")
        if not isinstance(state, str):
            raise MessageRejected(Outcome.UNPARSABLE, f"{detail_type} for {instance} without a state")
        if state not in STATE_KINDS:
            raise MessageRejected(
                Outcome.IGNORED,
                f"{detail_type} for {instance}: state {state} asks for nothing",
                started=(instance, when) if state in STARTING_STATES else None,
            )
        kind, text = STATE_KINDS[state], f"{detail_type} (state {state})"
    return InterruptionMessage(
        kind=kind, instance_id=instance, time=when, deadline=deadline, message_id=event_id, detail=text
    )


def instance_id(node: Object) -> list[str]:
    """The EC2 instance id of a Node (``spec.providerID`` ``aws:///us-east-1a/i-0abc…``), as index values."""
    provider = str((node.get("spec") or {}).get("providerID") or "")
    if not provider.startswith("aws://"):
        return []
    last = provider.rstrip("/").rsplit("/", 1)[-1]
    return [last] if last.startswith("i-") else []


# -- the queue ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class QueueMessage:
    """One received message: its SQS id, the handle that deletes it, and its body."""

    id: str
    receipt: str
    body: str


class Queue(Protocol):
    """The reader's view of SQS (``SqsQueue``; tests may pass their own)."""

    def receive(self, max_messages: int, wait_seconds: int) -> list[QueueMessage]:
        """Up to ``max_messages``, waiting up to ``wait_seconds`` for the first (long poll)."""
        ...

    def delete(self, message: QueueMessage) -> None: ...


class QueueError(Exception):
    """SQS could not be reached or refused (credentials, permissions, a missing queue)."""


_REGION = re.compile(r"[a-z]{2}(-[a-z]+)+-[0-9]+")


def region_of(queue_url: str) -> str | None:
    """The region in an SQS URL, if it names one: ``https://sqs.us-east-1.amazonaws.com/…`` (what
    the console and Terraform give; ``sqs-fips.``, a VPC endpoint's ``vpce-….sqs.REGION.…`` too),
    the legacy ``https://eu-west-1.queue.amazonaws.com/…``, and ``https://queue.amazonaws.com/…``
    (legacy us-east-1)."""
    host = (urlparse(queue_url).hostname or "").lower()
    labels = host.split(".")
    for i, label in enumerate(labels[:-2]):
        if label in ("sqs", "sqs-fips") and _REGION.fullmatch(labels[i + 1]):
            return labels[i + 1]
    if re.fullmatch(r"queue\.amazonaws\.com(\.cn)?", host):
        return "us-east-1"
    legacy = re.fullmatch(r"([a-z0-9-]+)\.queue\.amazonaws\.com(\.cn)?", host)
    if legacy is not None and _REGION.fullmatch(legacy.group(1)):
        return legacy.group(1)
    return None


class SqsQueue:
    """``Queue`` on boto3's SQS client: the controller's AWS identity (IRSA), its region, and the
    endpoint boto3 is configured with (``AWS_ENDPOINT_URL`` in tests)."""

    def __init__(self, url: str, region: str | None = None) -> None:
        import boto3
        from botocore.config import Config

        self.url = url
        # The long poll outlives the default read timeout otherwise; retries are ours (the loop).
        config = Config(read_timeout=40, connect_timeout=10, retries={"max_attempts": 2, "mode": "standard"})
        self._client = boto3.session.Session().client("sqs", region_name=region or region_of(url), config=config)
        from botocore.exceptions import BotoCoreError, ClientError

        self._errors: tuple[type[BaseException], ...] = (BotoCoreError, ClientError)

    def receive(self, max_messages: int, wait_seconds: int) -> list[QueueMessage]:
        try:
            answer = self._client.receive_message(
                QueueUrl=self.url, MaxNumberOfMessages=max_messages, WaitTimeSeconds=wait_seconds
            )
        except self._errors as e:
            raise QueueError(f"cannot receive from {self.url}: {e}") from e
        return [
            QueueMessage(str(m.get("MessageId") or ""), str(m["ReceiptHandle"]), str(m.get("Body") or ""))
            for m in answer.get("Messages") or []
        ]

    def delete(self, message: QueueMessage) -> None:
        try:
            self._client.delete_message(QueueUrl=self.url, ReceiptHandle=message.receipt)
        except self._errors as e:
            raise QueueError(f"cannot delete message {message.id} from {self.url}: {e}") from e


# -- the reader -----------------------------------------------------------------------------------


class ReaderMetrics(Protocol):
    def interruption_message(self, kind: str, outcome: str) -> None: ...
    def interruption_queue_error(self) -> None: ...


class InterruptionQueueReader:
    """Receives, annotates, acknowledges; see the module docstring. ``start()`` when this replica
    becomes the leader; ``stop()`` on shutdown (a replica that loses the lease exits anyway)."""

    def __init__(
        self,
        client: KubeClient,
        nodes: Cache,
        queue: Queue,
        *,
        metrics: ReaderMetrics | None = None,
        wait_seconds: int = 20,
        max_messages: int = 10,
        backoff_seconds: Callable[[int], float] = lambda n: min(30.0, 2.0 ** min(n, 5)),
        now: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        self._client = client
        self._nodes = nodes
        self._queue = queue
        self._metrics = metrics
        self._wait = wait_seconds
        self._max = max_messages
        self._backoff = backoff_seconds
        self._now = now
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="interruption-queue", daemon=True)
        self._thread.start()
        log.info("reading the interruption queue")

    def stop(self, timeout: float = 2.0) -> None:
        """Stop after the receive in flight (it may still wait out its long poll: the thread is a daemon)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def alive(self) -> bool:
        return self._thread is None or self._thread.is_alive() or self._stop.is_set()

    def _run(self) -> None:
        failures = 0
        while not self._stop.is_set():
            try:
                self.poll_once()
                failures = 0
            except QueueError as e:
                failures += 1
                delay = self._backoff(failures)
                log.warning("interruption queue: %s; trying again in %.0fs", e, delay)
                if self._metrics is not None:
                    self._metrics.interruption_queue_error()
                self._stop.wait(delay)
            except Exception:  # never let one bad message end the reader
                failures += 1
                log.exception("interruption queue: unexpected error")
                self._stop.wait(self._backoff(failures))

    def poll_once(self) -> list[Outcome]:
        """One receive and the handling of what it brought (``QueueError`` if the receive fails; a
        failed delete is counted by ``_delete`` and holds back no other message)."""
        outcomes = []
        for message in self._queue.receive(self._max, self._wait):
            try:
                outcome, kind = self.handle(message)
            except Exception:
                # One message this reader cannot handle must not hold back the others of its batch
                # (a spot warning among them has two minutes): it stays on the queue.
                log.exception("interruption queue: cannot handle message %s; leaving it for redelivery", message.id)
                outcome, kind = Outcome.RETRY, "unknown"
            outcomes.append(outcome)
            if self._metrics is not None:
                self._metrics.interruption_message(kind, str(outcome))
        return outcomes

    def handle(self, message: QueueMessage) -> tuple[Outcome, str]:
        """Act on one message, deleting it unless it must come again; (its outcome, its kind)."""
        try:
            parsed = parse_message(message.body)
        except MessageRejected as e:
            outcome = e.outcome
            if e.started is not None:
                cleared = self._clear_older_notices(*e.started, message)
                if cleared is None:
                    return Outcome.RETRY, "unknown"
                outcome = Outcome.CLEARED if cleared else outcome
            level = logging.INFO if e.outcome is Outcome.IGNORED else logging.WARNING
            log.log(level, "interruption queue: message %s %s: %s; deleting it", message.id, outcome, e)
            self._delete(message)
            return outcome, "unknown"
        nodes = self._nodes.by_index(INSTANCE_INDEX, parsed.instance_id)
        if not nodes:
            log.info(
                "interruption queue: %s for instance %s, which is no node of this cluster (message %s); deleting it",
                parsed.kind,
                parsed.instance_id,
                parsed.message_id,
            )
            self._delete(message)
            return Outcome.UNKNOWN_NODE, str(parsed.kind)
        written = False
        for node in nodes:
            name = str((node.get("metadata") or {}).get("name") or "")
            try:
                wrote = self._annotate(name, node, parsed)
            except KubeError as e:
                # Not acknowledged: SQS delivers it again once its visibility timeout passes.
                log.warning(
                    "interruption queue: cannot annotate node %s with %s (message %s), leaving it for redelivery: %s",
                    name,
                    parsed.kind,
                    parsed.message_id,
                    e,
                )
                return Outcome.RETRY, str(parsed.kind)
            if not wrote:
                log.info(
                    "interruption queue: node %s already carries a notice at least as severe as %s (message %s)",
                    name,
                    parsed.kind,
                    parsed.message_id,
                )
                continue
            written = True
            log.warning(
                "interruption queue: %s for node %s (instance %s, deadline %s, message %s)",
                parsed.kind,
                name,
                parsed.instance_id,
                _rfc3339(parsed.deadline) if parsed.deadline else "none",
                parsed.message_id,
            )
        self._delete(message)
        return (Outcome.ANNOTATED if written else Outcome.DUPLICATE), str(parsed.kind)

    def _delete(self, message: QueueMessage) -> None:
        """Acknowledge ``message``. A failed delete (a throttle, a blip) is logged and counted like a
        failed receive, and ends nothing: the rest of the batch (a spot warning among it has two
        minutes) is still handled. The message, whose work is done, comes back after its
        visibility timeout, and is then a duplicate (its notice is on the Node) or rejected again."""
        try:
            self._queue.delete(message)
        except QueueError as e:
            log.warning("interruption queue: %s; it comes back after its visibility timeout", e)
            if self._metrics is not None:
                self._metrics.interruption_queue_error()

    def _annotate(self, name: str, node: Object, message: InterruptionMessage) -> bool:
        """Write ``message``'s notice onto the Node ``name`` unless it carries one at least as severe
        (``_covered``); whether it was written. ``KubeError`` if it cannot be.

        The cache may lag behind this reader's own writes (a batch is faster than the watch): a spot
        warning and a rebalance for one instance in one receive, judged both on the cache, had the
        rebalance overwrite the warning just written. So nothing is decided on the cache alone: a
        write is a compare-and-swap on the resourceVersion of the Node it was judged on (changed
        since, it is judged again on the Node read fresh), and a notice the cache shows as covering
        the message is read fresh before the message is dropped as a duplicate (this reader may
        have removed it a moment ago)."""
        view, fresh, conflicts = node, False, 0
        while True:
            if self._covered(view, message):
                if fresh:
                    return False
                view, fresh = self._read_node(name), True
                continue
            patch: Object = {"metadata": {"annotations": {INTERRUPTION_ANNOTATION: message.annotation()}}}
            version = (view.get("metadata") or {}).get("resourceVersion")
            if version:
                patch["metadata"]["resourceVersion"] = version
            try:
                self._client.patch(NODES, name, patch)
                return True
            except Conflict:
                conflicts += 1
                if conflicts >= WRITE_ATTEMPTS:
                    raise
                view, fresh = self._read_node(name), True

    def _read_node(self, name: str) -> Object:
        """The Node ``name`` as the API server has it now (through the list the Node informer is
        granted: the controller has no get on Nodes). ``NotFound`` if it is gone."""
        items, _ = self._client.list(NODES, field_selector=f"metadata.name={name}")
        if not items:
            raise NotFound(f"node {name} is gone")
        return items[0]

    def _clear_older_notices(self, instance: str, started: datetime, message: QueueMessage) -> bool | None:
        """Remove the notice from the Nodes of ``instance`` when the instance (pending or running
        again at ``started``) was stopped and started after the notice's event: a notice about its
        previous run would otherwise make every job placed there flush and move, for as long as the
        notice counts (``INTERRUPTION_TTL_SECONDS``). A notice newer than the start (SQS keeps no
        order) stays. Whether one was removed; None when a Node could not be written, or changed
        since the cache showed it (the message stays for redelivery)."""
        cleared = False
        for node in self._nodes.by_index(INSTANCE_INDEX, instance):
            name = str((node.get("metadata") or {}).get("name") or "")
            raw = ((node.get("metadata") or {}).get("annotations") or {}).get(INTERRUPTION_ANNOTATION)
            existing = read_interruption(raw) if raw else None
            if existing is None or existing.time is None or existing.time >= started:
                continue
            # Only the Node as the cache shows it: the cache may not hold yet a newer notice this
            # reader wrote a moment ago (a batch is faster than the watch). Changed since, the
            # patch is a Conflict and the message comes back once the cache has caught up.
            patch: Object = {"metadata": {"annotations": {INTERRUPTION_ANNOTATION: None}}}
            version = (node.get("metadata") or {}).get("resourceVersion")
            if version:
                patch["metadata"]["resourceVersion"] = version
            try:
                self._client.patch(NODES, name, patch)
            except Conflict:
                log.info(
                    "interruption queue: node %s changed since the cache showed its %s notice (message %s): "
                    "leaving the message for redelivery",
                    name,
                    existing.kind,
                    message.id,
                )
                return None
            except KubeError as e:
                log.warning(
                    "interruption queue: cannot remove the stale notice from node %s (message %s), leaving the "
                    "message for redelivery: %s",
                    name,
                    message.id,
                    e,
                )
                return None
            cleared = True
            log.warning(
                "interruption queue: instance %s of node %s runs again since %s: its %s notice of %s is removed",
                instance,
                name,
                _rfc3339(started),
                existing.kind,
                _rfc3339(existing.time),
            )
        return cleared

    def _covered(self, node: Object, message: InterruptionMessage) -> bool:
        """The node carries a live notice at least as severe (and no later) than ``message``."""
        raw = ((node.get("metadata") or {}).get("annotations") or {}).get(INTERRUPTION_ANNOTATION)
        existing = read_interruption(raw) if raw else None
        if existing is None or notice_expired(existing, self._now()):
            return False
        if existing.kind is SignalKind.NODE_LOST and existing.time is not None and message.time > existing.time:
            # An event after the instance stopped is of a run after it (it was started again): the
            # stop's notice says nothing about that run, and the start may remove it any moment.
            return False
        if severity(existing.kind) != severity(message.kind):
            return severity(existing.kind) > severity(message.kind)
        if message.deadline is None:
            return True
        return existing.deadline is not None and existing.deadline <= message.deadline
