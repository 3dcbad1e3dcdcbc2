"""The interruption queue: EC2 events (in the shapes AWS documents) parsed into one message type, and
the reader against moto's SQS and the test API server — a notice becomes a Node annotation before
its message is deleted; what cannot be acted on is counted and deleted; an API failure leaves the
message for redelivery.

The event bodies below follow the example events of the AWS pages cited in
``orchestrator/k8s/interruption_queue.py`` (spot instance interruption notices, rebalance
recommendations, instance state-change events).
"""

from __future__ import annotations

import json
import uuid
from collections import Counter
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from ctl_support import TestApi, wait_for

from orchestrator.k8s.api import NODES
from orchestrator.k8s.cluster_signals import (
    INTERRUPTION_ANNOTATION,
    INTERRUPTION_TTL_SECONDS,
    ClusterSignals,
    RebalancePolicy,
    annotation_signal,
)
from orchestrator.k8s.informer import Informer
from orchestrator.k8s.interruption_queue import (
    INSTANCE_INDEX,
    InterruptionQueueReader,
    MessageRejected,
    Outcome,
    QueueError,
    QueueMessage,
    SqsQueue,
    instance_id,
    parse_message,
    region_of,
)
from orchestrator.signals import SignalKind

TIME = "2026-03-01T10:00:00Z"
AT = datetime(2026, 3, 1, 10, 0, tzinfo=UTC)


def event(detail_type: str, detail: dict[str, Any], *, time: str = TIME, event_id: str = "") -> dict[str, Any]:
    """An EventBridge event as EC2 emits it (the documented envelope)."""
    instance = detail.get("instance-id", "i-1234567890abcdef0")
    return {
        "version": "0",
        "id": event_id or str(uuid.uuid4()),
        "detail-type": detail_type,
        "source": "aws.ec2",
        "account": "123456789012",
        "time": time,
        "region": "us-east-2",
        "resources": [f"arn:aws:ec2:us-east-2:123456789012:instance/{instance}"],
        "detail": detail,
    }


def spot_warning(instance: str, *, action: str = "terminate", time: str = TIME) -> dict[str, Any]:
    return event(
        "EC2 Spot Instance Interruption Warning", {"instance-id": instance, "instance-action": action}, time=time
    )


def rebalance(instance: str, *, time: str = TIME) -> dict[str, Any]:
    return event("EC2 Instance Rebalance Recommendation", {"instance-id": instance}, time=time)


def state_change(instance: str, state: str) -> dict[str, Any]:
    body = event("EC2 Instance State-change Notification", {"instance-id": instance, "state": state})
    del body["version"]  # the documented state-change example has none: nothing may rely on it
    return body


# -- parsing ------------------------------------------------------------------------------------


def test_a_spot_interruption_warning_is_an_interruption_two_minutes_after_its_time() -> None:
    body = spot_warning("i-0abc")
    m = parse_message(json.dumps(body))
    assert (m.kind, m.instance_id, m.message_id) == (SignalKind.SPOT_INTERRUPTION, "i-0abc", body["id"])
    assert m.time == AT and m.deadline == AT + timedelta(minutes=2)
    assert "instance-action terminate" in m.detail


def test_a_hibernating_spot_instance_has_no_two_minutes() -> None:
    assert parse_message(json.dumps(spot_warning("i-0abc", action="hibernate"))).deadline == AT


def test_a_rebalance_recommendation_is_advice_without_a_deadline() -> None:
    m = parse_message(json.dumps(rebalance("i-0abc")).encode())
    assert (m.kind, m.deadline) == (SignalKind.REBALANCE, None) and not m.kind.is_preemption


@pytest.mark.parametrize(
    ("state", "kind"),
    [
        ("stopping", SignalKind.TERMINATING),
        ("shutting-down", SignalKind.TERMINATING),
        ("stopped", SignalKind.NODE_LOST),
        ("terminated", SignalKind.NODE_LOST),
    ],
)
def test_a_state_change_to_going_or_gone_names_the_node_going_or_gone(state: str, kind: SignalKind) -> None:
    m = parse_message(json.dumps(state_change("i-0abc", state)))
    assert (m.kind, m.instance_id, m.deadline) == (kind, "i-0abc", None) and f"state {state}" in m.detail


@pytest.mark.parametrize("state", ["pending", "running"])
def test_a_state_change_to_starting_or_running_asks_for_nothing(state: str) -> None:
    with pytest.raises(MessageRejected) as e:
        parse_message(json.dumps(state_change("i-0abc", state)))
    assert e.value.outcome is Outcome.IGNORED


@pytest.mark.parametrize(
    "body",
    [
        "not json",
        "[1, 2]",
        json.dumps({**spot_warning("i-0abc"), "source": "aws.health"}),
        json.dumps(event("EC2 AMI State Change", {"ImageId": "ami-0123", "State": "available"})),
        json.dumps({**spot_warning("i-0abc"), "detail": "terminate"}),
        json.dumps(event("EC2 Instance Rebalance Recommendation", {"instance-id": "vol-0abc"})),
        json.dumps({**rebalance("i-0abc"), "id": ""}),
        json.dumps(rebalance("i-0abc", time="yesterday")),
        json.dumps(event("EC2 Instance State-change Notification", {"instance-id": "i-0abc"})),
        json.dumps(spot_warning("i-0abc", time="9999-12-31T23:59:59Z")),  # no room for its two minutes
        json.dumps(rebalance("i-0abc", time="0001-01-01T00:00:00+14:00")),  # before year 1 in UTC
        "[" * 100_000,  # nested past what the JSON parser recurses into
    ],
)
def test_what_is_not_a_well_formed_ec2_interruption_event_is_unparsable(body: str) -> None:
    with pytest.raises(MessageRejected) as e:
        parse_message(body)
    assert e.value.outcome is Outcome.UNPARSABLE and str(e.value)


def test_the_annotation_the_reader_writes_is_the_signal_the_reconciler_reads() -> None:
    m = parse_message(json.dumps(spot_warning("i-0abc")))
    node = {"metadata": {"name": "ip-10-0-1-7", "annotations": {INTERRUPTION_ANNOTATION: m.annotation()}}}
    signal = annotation_signal(node, rebalance=RebalancePolicy.IGNORE, now=AT + timedelta(seconds=5))
    assert signal is not None
    assert (signal.kind, signal.node, signal.source, signal.deadline) == (
        SignalKind.SPOT_INTERRUPTION,
        "ip-10-0-1-7",
        "aws-sqs",
        AT + timedelta(minutes=2),
    )
    assert m.message_id in signal.detail and "EC2 Spot Instance Interruption Warning" in signal.detail


def test_a_queued_rebalance_is_advice_unless_the_controller_flushes_on_rebalance() -> None:
    node = {"metadata": {"name": "n", "annotations": {INTERRUPTION_ANNOTATION: _annotation(rebalance("i-1"))}}}
    advice = annotation_signal(node, rebalance=RebalancePolicy.IGNORE, now=AT)
    acted = annotation_signal(node, rebalance=RebalancePolicy.FLUSH, now=AT)
    assert advice is not None and advice.kind is SignalKind.REBALANCE
    assert acted is not None and acted.kind is SignalKind.SPOT_INTERRUPTION


def test_a_notice_long_past_its_deadline_no_longer_counts() -> None:
    """A node stopped and started again keeps its name (and its annotations): an old notice on it
    must not keep jobs off it, nor flush the jobs that land there, for ever."""
    node = {"metadata": {"name": "n", "annotations": {INTERRUPTION_ANNOTATION: _annotation(spot_warning("i-1"))}}}
    deadline = AT + timedelta(minutes=2)
    signals = ClusterSignals(now=lambda: deadline + timedelta(seconds=INTERRUPTION_TTL_SECONDS - 1))
    assert [s.kind for s in signals.for_node("n", node)] == [SignalKind.SPOT_INTERRUPTION]
    later = ClusterSignals(now=lambda: deadline + timedelta(seconds=INTERRUPTION_TTL_SECONDS + 1))
    assert later.for_node("n", node) == []


def _annotation(body: dict[str, Any]) -> str:
    return parse_message(json.dumps(body)).annotation()


def test_nodes_are_indexed_by_the_instance_in_their_provider_id() -> None:
    assert instance_id({"spec": {"providerID": "aws:///us-east-1a/i-0123456789abcdef0"}}) == ["i-0123456789abcdef0"]
    assert instance_id({"spec": {"providerID": "gce://project/us-central1-a/gke-node-1"}}) == []
    assert instance_id({"spec": {}}) == []
    assert region_of("https://sqs.eu-west-1.amazonaws.com/111122223333/spotjob-interruptions") == "eu-west-1"
    assert region_of("http://127.0.0.1:5000/123456789012/q") is None
    # The legacy forms name theirs too (refused before as naming none, "pass --aws-region").
    assert region_of("https://eu-west-1.queue.amazonaws.com/111122223333/q") == "eu-west-1"
    assert region_of("https://queue.amazonaws.com/111122223333/q") == "us-east-1"
    assert region_of("https://vpce-0abc-1xyz.sqs.ap-southeast-2.vpce.amazonaws.com/111122223333/q") == "ap-southeast-2"
    assert region_of("http://sqs.localhost:9324/000000000000/q") is None


# -- the reader against moto's SQS and the test API server --------------------------------------


class Metrics:
    def __init__(self) -> None:
        self.messages: Counter[tuple[str, str]] = Counter()
        self.errors = 0

    def interruption_message(self, kind: str, outcome: str) -> None:
        self.messages[(kind, outcome)] += 1

    def interruption_queue_error(self) -> None:
        self.errors += 1


class Reader:
    """A reader on a fresh moto queue, with a synced Node informer of the test API server."""

    def __init__(self, test_api: TestApi, sqs: Any, url: str) -> None:
        self.test_api = test_api
        self.sqs = sqs
        self.url = url
        self.client = test_api.client()
        self.nodes = Informer(self.client, NODES, indexers={INSTANCE_INDEX: instance_id})
        self.nodes.start()
        assert self.nodes.wait_for_sync(30)
        self.metrics = Metrics()
        self.reader = InterruptionQueueReader(
            self.client, self.nodes.cache, SqsQueue(url, "us-east-1"), metrics=self.metrics, wait_seconds=1
        )

    def add_node(self, name: str, instance: str) -> None:
        body = {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {"name": name},
            "spec": {"providerID": f"aws:///us-east-1a/{instance}"},
        }
        self.test_api.admin.create(NODES, body)
        wait_for(lambda: self.nodes.cache.by_index(INSTANCE_INDEX, instance), what=f"node {name} in the cache")

    def send(self, body: dict[str, Any] | str) -> None:
        self.sqs.send_message(QueueUrl=self.url, MessageBody=body if isinstance(body, str) else json.dumps(body))

    def annotation(self, node: str) -> dict[str, Any] | None:
        raw = (self.test_api.admin.get(NODES, node)["metadata"].get("annotations") or {}).get(INTERRUPTION_ANNOTATION)
        return json.loads(raw) if raw else None

    def left_on_queue(self) -> int:
        attrs = self.sqs.get_queue_attributes(
            QueueUrl=self.url,
            AttributeNames=["ApproximateNumberOfMessages", "ApproximateNumberOfMessagesNotVisible"],
        )["Attributes"]
        return int(attrs["ApproximateNumberOfMessages"]) + int(attrs["ApproximateNumberOfMessagesNotVisible"])

    def close(self) -> None:
        self.nodes.stop()
        self.client.close()


@pytest.fixture
def reader(test_api: TestApi, moto_server: str) -> Iterator[Reader]:
    import boto3

    sqs = boto3.session.Session().client("sqs", region_name="us-east-1")
    url = sqs.create_queue(QueueName=f"spotjob-{uuid.uuid4().hex[:8]}", Attributes={"VisibilityTimeout": "1"})[
        "QueueUrl"
    ]
    r = Reader(test_api, sqs, url)
    yield r
    r.close()


def test_a_spot_warning_becomes_the_nodes_annotation_and_only_then_is_deleted(reader: Reader) -> None:
    reader.add_node("ip-10-0-1-7", "i-0aaa")
    body = spot_warning("i-0aaa", time=datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"))
    reader.send(body)

    assert reader.reader.poll_once() == [Outcome.ANNOTATED]

    notice = reader.annotation("ip-10-0-1-7")
    assert notice is not None
    assert (notice["kind"], notice["source"], notice["messageId"], notice["instanceId"]) == (
        "SpotInterruption",
        "aws-sqs",
        body["id"],
        "i-0aaa",
    )
    assert notice["deadline"] is not None
    assert reader.left_on_queue() == 0
    assert reader.metrics.messages == Counter({("SpotInterruption", "annotated"): 1})
    audit = [r for r in reader.test_api.audit() if r["verb"] == "patch"]
    assert [(r["resource"], r["name"]) for r in audit] == [("nodes", "ip-10-0-1-7")]


def test_messages_for_unknown_instances_unparsable_ones_and_idle_states_are_counted_and_deleted(
    reader: Reader,
) -> None:
    reader.add_node("ip-10-0-1-8", "i-0bbb")
    reader.send(spot_warning("i-0fff"))  # no node of this cluster
    reader.send("this is not an event")
    reader.send(state_change("i-0bbb", "running"))

    outcomes: list[Outcome] = []
    while len(outcomes) < 3:
        outcomes += reader.reader.poll_once()

    assert sorted(outcomes) == sorted([Outcome.UNKNOWN_NODE, Outcome.UNPARSABLE, Outcome.IGNORED])
    assert reader.left_on_queue() == 0
    assert reader.annotation("ip-10-0-1-8") is None
    assert reader.metrics.messages == Counter(
        {("SpotInterruption", "unknown_node"): 1, ("unknown", "unparsable"): 1, ("unknown", "ignored"): 1}
    )


def test_a_message_dated_at_the_ends_of_the_calendar_is_deleted_and_holds_back_no_spot_warning(
    reader: Reader,
) -> None:
    reader.add_node("ip-10-0-1-6", "i-0eee")
    reader.send(spot_warning("i-0eee", time="9999-12-31T23:59:59Z"))
    reader.send(spot_warning("i-0eee", time=datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")))

    outcomes: list[Outcome] = []
    while len(outcomes) < 2:
        outcomes += reader.reader.poll_once()

    assert sorted(outcomes) == sorted([Outcome.UNPARSABLE, Outcome.ANNOTATED])
    notice = reader.annotation("ip-10-0-1-6")
    assert notice is not None and notice["kind"] == "SpotInterruption"
    assert reader.left_on_queue() == 0, "the malformed message must not come back at every visibility timeout"


def test_a_weaker_notice_after_a_stronger_one_writes_nothing(reader: Reader) -> None:
    reader.add_node("ip-10-0-1-9", "i-0ccc")
    now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    reader.send(spot_warning("i-0ccc", time=now))
    assert reader.reader.poll_once() == [Outcome.ANNOTATED]
    wait_for(
        lambda: (
            "spotjob.dev/interruption"
            in ((reader.nodes.cache.get("", "ip-10-0-1-9") or {})["metadata"].get("annotations") or {})
        ),
        what="the annotation in the cache",
    )
    first = reader.annotation("ip-10-0-1-9")

    reader.send(rebalance("i-0ccc", time=now))  # SQS keeps no order: advice after the warning
    assert reader.reader.poll_once() == [Outcome.DUPLICATE]
    assert reader.annotation("ip-10-0-1-9") == first and reader.left_on_queue() == 0

    reader.send(state_change("i-0ccc", "terminated"))  # the node is gone: graver, written
    assert reader.reader.poll_once() == [Outcome.ANNOTATED]
    assert reader.annotation("ip-10-0-1-9")["kind"] == "NodeLost"  # type: ignore[index]


@pytest.mark.parametrize(
    ("stronger", "weaker", "kept"),
    [
        ("spot-warning", "rebalance", "SpotInterruption"),
        ("terminated", "shutting-down", "NodeLost"),
    ],
)
def test_a_weaker_notice_never_overwrites_a_stronger_one_the_cache_does_not_show_yet(
    reader: Reader, stronger: str, weaker: str, kept: str
) -> None:
    """Both in one receive, the second judged on the Node cache, which lags behind the reader's own
    write of the first (a batch is faster than the watch): the rebalance overwrote the spot warning,
    the shutting-down the NodeLost, and both counted as annotated. Frozen here by stopping the
    informer: the cache keeps showing the Node without a notice."""
    now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")

    def body(what: str) -> dict[str, Any]:
        if what == "spot-warning":
            return spot_warning("i-0cca", time=now)
        if what == "rebalance":
            return rebalance("i-0cca", time=now)
        return event("EC2 Instance State-change Notification", {"instance-id": "i-0cca", "state": what}, time=now)

    reader.add_node("ip-10-0-1-4", "i-0cca")
    reader.nodes.stop()  # the watch lags behind the reader's own writes from here on
    reader.send(body(stronger))
    reader.send(body(weaker))
    outcomes: list[Outcome] = []
    while len(outcomes) < 2:
        outcomes += reader.reader.poll_once()

    notice = reader.annotation("ip-10-0-1-4")
    assert notice is not None and notice["kind"] == kept, f"{kept} weakened ({outcomes}): {notice}"
    assert sorted(outcomes) == sorted([Outcome.ANNOTATED, Outcome.DUPLICATE])
    assert reader.left_on_queue() == 0


def test_a_notice_the_cache_still_shows_after_its_removal_covers_nothing(reader: Reader) -> None:
    """The reader removed a spot warning of the instance's previous run (it runs again); the cache,
    still showing the warning, must not make the shutting-down of the new run a duplicate: the
    Node would carry no notice while its instance goes."""

    def at(seconds_ago: float) -> str:
        return (datetime.now(UTC) - timedelta(seconds=seconds_ago)).strftime("%Y-%m-%dT%H:%M:%SZ")

    def state(name: str, time: str) -> dict[str, Any]:
        return event("EC2 Instance State-change Notification", {"instance-id": "i-0ccb", "state": name}, time=time)

    reader.add_node("ip-10-0-1-3", "i-0ccb")
    reader.send(spot_warning("i-0ccb", action="stop", time=at(900)))
    assert reader.reader.poll_once() == [Outcome.ANNOTATED]
    wait_for(
        lambda: (
            INTERRUPTION_ANNOTATION
            in (((reader.nodes.cache.get("", "ip-10-0-1-3") or {}).get("metadata") or {}).get("annotations") or {})
        ),
        what="the warning in the cache",
    )
    reader.nodes.stop()  # the watch lags behind the reader's own writes from here on

    reader.send(state("running", at(600)))
    assert reader.reader.poll_once() == [Outcome.CLEARED]
    reader.send(state("shutting-down", at(60)))
    outcomes = reader.reader.poll_once()

    notice = reader.annotation("ip-10-0-1-3")
    assert notice is not None and notice["kind"] == "Terminating", f"no notice on a going node ({outcomes})"
    assert outcomes == [Outcome.ANNOTATED]


def test_an_instance_stopped_and_started_again_loses_the_notice_of_its_stop_and_only_that_one(
    reader: Reader,
) -> None:
    def at(seconds_ago: float) -> str:
        return (datetime.now(UTC) - timedelta(seconds=seconds_ago)).strftime("%Y-%m-%dT%H:%M:%SZ")

    def state(instance: str, name: str, time: str) -> dict[str, Any]:
        return event("EC2 Instance State-change Notification", {"instance-id": instance, "state": name}, time=time)

    def annotation_cached(present: bool) -> None:
        def check() -> bool:
            node = reader.nodes.cache.get("", "ip-10-0-1-5") or {}
            return (INTERRUPTION_ANNOTATION in ((node.get("metadata") or {}).get("annotations") or {})) is present

        wait_for(check, what=f"the annotation {'in' if present else 'gone from'} the cache")

    reader.add_node("ip-10-0-1-5", "i-0fab")
    reader.send(state("i-0fab", "stopped", at(600)))  # a spot instance whose interruption stops it
    assert reader.reader.poll_once() == [Outcome.ANNOTATED]
    annotation_cached(True)

    reader.send(state("i-0fab", "running", at(900)))  # its start before the stop, delivered late
    assert reader.reader.poll_once() == [Outcome.IGNORED]
    assert reader.annotation("ip-10-0-1-5")["kind"] == "NodeLost"  # type: ignore[index]

    reader.send(state("i-0fab", "running", at(60)))  # capacity came back: it runs again
    assert reader.reader.poll_once() == [Outcome.CLEARED]
    assert reader.annotation("ip-10-0-1-5") is None, "a node running again must not read as lost for an hour"
    assert reader.left_on_queue() == 0
    annotation_cached(False)
    node = reader.nodes.cache.get("", "ip-10-0-1-5")
    assert node is not None and annotation_signal(node, rebalance=RebalancePolicy.IGNORE, now=datetime.now(UTC)) is None


def test_a_start_never_removes_a_notice_newer_than_the_cache_shows(reader: Reader) -> None:
    """SQS keeps no order, and the reader works through a batch faster than its own writes come
    back through the Node watch: a spot warning of the instance's new run (just written) and the
    start of that run (delivered after it) must not remove that warning because the cache still
    shows only the notice of the stop before. Frozen here by stopping the informer: the cache
    keeps showing the stop's notice while the reader writes the warning."""

    def at(seconds_ago: float) -> str:
        return (datetime.now(UTC) - timedelta(seconds=seconds_ago)).strftime("%Y-%m-%dT%H:%M:%SZ")

    reader.add_node("ip-10-0-1-8", "i-0fac")
    reader.send(
        event("EC2 Instance State-change Notification", {"instance-id": "i-0fac", "state": "stopping"}, time=at(900))
    )
    assert reader.reader.poll_once() == [Outcome.ANNOTATED]
    wait_for(
        lambda: (
            INTERRUPTION_ANNOTATION
            in (((reader.nodes.cache.get("", "ip-10-0-1-8") or {}).get("metadata") or {}).get("annotations") or {})
        ),
        what="the stop's notice in the cache",
    )
    reader.nodes.stop()  # the watch lags behind the reader's own writes from here on

    reader.send(spot_warning("i-0fac", time=at(10)))  # the new run is warned ...
    assert reader.reader.poll_once() == [Outcome.ANNOTATED]
    reader.send(
        event("EC2 Instance State-change Notification", {"instance-id": "i-0fac", "state": "running"}, time=at(300))
    )
    outcomes = reader.reader.poll_once()  # ... and its start, older, is delivered after the warning

    notice = reader.annotation("ip-10-0-1-8")
    assert notice is not None and notice["kind"] == "SpotInterruption", (
        f"the live spot warning was removed by the start before it ({outcomes}): {notice}"
    )
    assert outcomes == [Outcome.RETRY], "the start is read again once the cache has caught up"


def test_a_warning_of_a_run_after_the_stop_is_not_covered_by_the_notice_of_the_stop(reader: Reader) -> None:
    """An instance stopped (NodeLost), started again and warned: the warning, dated after the
    stop, is about the new run. Read as covered by the stop's notice it was dropped, and the
    start, delivered after it (SQS keeps no order), then removed the stop's notice: the node
    carried no notice at all while its instance had two minutes left."""

    def at(seconds_ago: float) -> str:
        return (datetime.now(UTC) - timedelta(seconds=seconds_ago)).strftime("%Y-%m-%dT%H:%M:%SZ")

    def state(name: str, time: str) -> dict[str, Any]:
        return event("EC2 Instance State-change Notification", {"instance-id": "i-0fad", "state": name}, time=time)

    reader.add_node("ip-10-0-1-7", "i-0fad")
    reader.send(state("stopped", at(900)))
    assert reader.reader.poll_once() == [Outcome.ANNOTATED]
    wait_for(lambda: (reader.annotation("ip-10-0-1-7") or {}).get("kind") == "NodeLost", what="the stop's notice")
    wait_for(
        lambda: (
            INTERRUPTION_ANNOTATION
            in (((reader.nodes.cache.get("", "ip-10-0-1-7") or {}).get("metadata") or {}).get("annotations") or {})
        ),
        what="the stop's notice in the cache",
    )

    reader.send(spot_warning("i-0fad", time=at(10)))
    assert reader.reader.poll_once() == [Outcome.ANNOTATED], "the new run's warning is not the stop's"
    notice = reader.annotation("ip-10-0-1-7")
    assert notice is not None and notice["kind"] == "SpotInterruption", notice

    reader.send(state("running", at(300)))  # the start, between the two, delivered last
    outcomes: list[Outcome] = []
    for _ in range(30):  # a Conflict (RETRY) until the cache has caught up with the warning
        outcomes += reader.reader.poll_once()
        if outcomes and outcomes[-1] is not Outcome.RETRY:
            break
    assert outcomes[-1:] == [Outcome.IGNORED], outcomes
    notice = reader.annotation("ip-10-0-1-7")
    assert notice is not None and notice["kind"] == "SpotInterruption", notice


def test_a_node_that_cannot_be_written_leaves_its_message_for_redelivery(reader: Reader) -> None:
    reader.add_node("ip-10-0-2-1", "i-0ddd")
    reader.test_api.fault(verb="patch", resource="nodes", status=500, count=100)
    reader.send(spot_warning("i-0ddd", time=datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")))

    assert reader.reader.poll_once() == [Outcome.RETRY]
    assert reader.annotation("ip-10-0-2-1") is None
    assert reader.left_on_queue() == 1, "not acknowledged: SQS must deliver it again"

    reader.test_api.clear_faults()
    outcomes: list[Outcome] = []
    while Outcome.ANNOTATED not in outcomes:  # after its visibility timeout (1 s here)
        outcomes += reader.reader.poll_once()
    assert reader.annotation("ip-10-0-2-1") is not None
    assert reader.left_on_queue() == 0


class FirstDeleteRefused(SqsQueue):
    """moto's SQS, which refuses the reader's first DeleteMessage (as a throttle or a network blip
    would): its receipt handle is replaced by one SQS does not take."""

    def __init__(self, url: str) -> None:
        super().__init__(url, "us-east-1")
        self.refused = 0

    def delete(self, message: QueueMessage) -> None:
        if not self.refused:
            self.refused += 1
            message = QueueMessage(message.id, "not-a-receipt-handle", message.body)
        super().delete(message)


def test_a_failed_delete_is_counted_and_holds_back_no_other_message_of_its_batch(reader: Reader) -> None:
    """The first spot warning of a receive was annotated and its delete refused: the QueueError
    ended the batch, so the second warning waited for its visibility timeout (30 s by default, of
    its two minutes) and the first was never counted."""
    reader.add_node("ip-10-0-2-2", "i-0dda")
    reader.add_node("ip-10-0-2-3", "i-0ddb")
    now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    reader.send(spot_warning("i-0dda", time=now))
    reader.send(spot_warning("i-0ddb", time=now))
    queue = FirstDeleteRefused(reader.url)
    r = InterruptionQueueReader(reader.client, reader.nodes.cache, queue, metrics=reader.metrics, wait_seconds=1)

    try:
        outcomes = r.poll_once()
    except QueueError as e:
        pytest.fail(f"one failed delete ended the batch: {e}")

    assert outcomes == [Outcome.ANNOTATED, Outcome.ANNOTATED]
    notices = {node: reader.annotation(node) for node in ("ip-10-0-2-2", "ip-10-0-2-3")}
    assert all(n is not None and n["kind"] == "SpotInterruption" for n in notices.values()), notices
    assert reader.metrics.errors == 1, "the refused delete is a queue error"
    assert reader.metrics.messages == Counter({("SpotInterruption", "annotated"): 2})
    assert queue.refused == 1 and reader.left_on_queue() == 1, "the message not deleted comes back"

    outcomes = []
    while not outcomes:  # after its visibility timeout (1 s here)
        outcomes += r.poll_once()
    assert outcomes == [Outcome.DUPLICATE], "its notice is on its Node already"
    assert {node: reader.annotation(node) for node in notices} == notices
    assert reader.left_on_queue() == 0


def test_an_unreachable_queue_is_counted_and_retried_with_backoff_not_fatal(
    test_api: TestApi, moto_server: str
) -> None:
    client = test_api.client()
    nodes = Informer(client, NODES, indexers={INSTANCE_INDEX: instance_id})
    metrics = Metrics()
    delays: list[int] = []

    def backoff(failures: int) -> float:
        delays.append(failures)
        return 0.01

    queue = SqsQueue("http://127.0.0.1:1/123456789012/gone", "us-east-1")
    reader = InterruptionQueueReader(
        client, nodes.cache, queue, metrics=metrics, wait_seconds=1, backoff_seconds=backoff
    )
    reader.start()
    try:
        wait_for(lambda: metrics.errors >= 2, what="two failed receives")
        assert reader.alive()
    finally:
        reader.stop()
        client.close()
    assert delays[:2] == [1, 2], "each failure in a row waits longer"
