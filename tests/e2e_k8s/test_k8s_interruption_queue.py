"""The cloud's interruption queue end to end: an EC2 spot interruption warning put on moto's
EventBridge bus (in the documented shape) is routed by a rule to spotjob's own SQS queue, the
leader's reader turns it into the Node's ``spotjob.dev/interruption`` annotation, and the job on
that node flushes and moves — bit-identical at the end, like the taint path.
"""

from __future__ import annotations

import json
import secrets
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from e2e_support import (
    Controller,
    assert_same_final_state,
    create_job,
    event_reasons,
    job_events,
    job_pods,
    running_pods,
    spotjob_body,
    wait_for_a_commit,
    wait_phase,
)

from tests.k8s.cluster import TestCluster

pytestmark = pytest.mark.slow

SPOT_WARNING = "EC2 Spot Instance Interruption Warning"


@pytest.fixture
def queue_fed_by_eventbridge(moto_server: str) -> Iterator[tuple[Any, Any, str]]:
    """spotjob's own queue and the EventBridge rule that feeds it spot warnings (as
    terraform/modules/aws sets them up); both removed afterwards, since the moto server is shared
    with other tests (the Terraform test checks that its destroy leaves no ``spotjob-`` rule)."""
    import boto3

    endpoint = moto_server
    session = boto3.session.Session()
    sqs = session.client("sqs", endpoint_url=endpoint, region_name="us-east-1")
    events = session.client("events", endpoint_url=endpoint, region_name="us-east-1")
    name = f"spotjob-interruptions-{secrets.token_hex(4)}"
    url = sqs.create_queue(QueueName=name)["QueueUrl"]
    arn = sqs.get_queue_attributes(QueueUrl=url, AttributeNames=["QueueArn"])["Attributes"]["QueueArn"]
    rule = f"{name}-spot"
    events.put_rule(
        Name=rule, EventPattern=json.dumps({"source": ["aws.ec2"], "detail-type": [SPOT_WARNING]}), State="ENABLED"
    )
    events.put_targets(Rule=rule, Targets=[{"Id": "spotjob", "Arn": arn}])
    yield sqs, events, url
    events.remove_targets(Rule=rule, Ids=["spotjob"])
    events.delete_rule(Name=rule)
    sqs.delete_queue(QueueUrl=url)


def test_a_spot_warning_on_the_eventbridge_bus_flushes_the_job_and_moves_it_bit_identical(
    cluster: TestCluster,
    namespace: str,
    start_controller: Callable[..., Controller],
    uninterrupted: Path,
    queue_fed_by_eventbridge: tuple[Any, Any, str],
    tmp_path: Path,
) -> None:
    sqs, events, url = queue_fed_by_eventbridge
    instances = {f"{namespace}-a": f"i-{secrets.token_hex(8)}", f"{namespace}-b": f"i-{secrets.token_hex(8)}"}
    for name, zone in ((f"{namespace}-a", "us-east-1a"), (f"{namespace}-b", "us-east-1b")):
        cluster.add_node(name, zone=zone, provider_id=f"aws:///{zone}/{instances[name]}")
    controller = start_controller(namespace, f"--interruption-queue-url={url}", "--aws-region=us-east-1")
    dumps = tmp_path / "dumps"
    dumps.mkdir()
    uri = str(tmp_path / "ckpt")
    create_job(cluster, spotjob_body("train", namespace, uri=uri, dump_dir=dumps))

    wait_phase(cluster, namespace, "train", "Running")
    # Storage's word, not the status's (a Running job refreshes it every 10 s): the flush needs a
    # commit to resume from, and the sooner the warning comes the longer the job still trains.
    wait_for_a_commit(uri)
    (first,) = running_pods(cluster, namespace, "train", 0)
    preempted = str(first["spec"]["nodeName"])
    instance = instances[preempted]
    answer = events.put_events(
        Entries=[
            {
                "Source": "aws.ec2",
                "DetailType": SPOT_WARNING,
                "Detail": json.dumps({"instance-id": instance, "instance-action": "terminate"}),
                "Resources": [f"arn:aws:ec2:us-east-1:123456789012:instance/{instance}"],
            }
        ]
    )
    assert answer["FailedEntryCount"] == 0, answer

    final = wait_phase(cluster, namespace, "train", "Succeeded")

    # The message became durable cluster state on the right Node, then was deleted.
    notice = json.loads(cluster.node(preempted)["metadata"]["annotations"]["spotjob.dev/interruption"])
    assert (notice["kind"], notice["source"], notice["instanceId"]) == ("SpotInterruption", "aws-sqs", instance)
    assert notice["deadline"] and uuid.UUID(notice["messageId"])
    other = next(n for n in instances if n != preempted)
    assert "spotjob.dev/interruption" not in (cluster.node(other)["metadata"].get("annotations") or {})
    attrs = sqs.get_queue_attributes(
        QueueUrl=url, AttributeNames=["ApproximateNumberOfMessages", "ApproximateNumberOfMessagesNotVisible"]
    )["Attributes"]
    assert attrs == {"ApproximateNumberOfMessages": "0", "ApproximateNumberOfMessagesNotVisible": "0"}

    # The reconciler heard it as a Signal from the Node: flush, move, resume.
    assert final["preemptions"] == 1 and final["restarts"] == 0, final
    (last,) = [
        p for p in job_pods(cluster, namespace, "train") if p["metadata"]["labels"]["spotjob.dev/attempt"] == "1"
    ]
    assert last["spec"]["nodeName"] != preempted
    reasons = event_reasons(cluster, namespace, "train")
    for reason in ("SpotInterrupted", "FlushRequested", "FlushCommitted", "Rescheduled"):
        assert reason in reasons, reasons
    assert [(h["cause"], h["reason"]) for h in final["restartHistory"]] == [("Preemption", "SpotInterrupted")]
    interrupted = next(e for e in job_events(cluster, namespace, "train") if e["reason"] == "SpotInterrupted")
    assert f"node {preempted} (from aws-sqs)" in interrupted["note"], interrupted["note"]
    metrics = controller.metrics()
    assert metrics['spotjob_interruption_messages_total{kind="SpotInterruption",outcome="annotated"}'] == 1
    assert metrics['spotjob_signals_total{kind="SpotInterruption",source="aws-sqs"}'] >= 1
    assert_same_final_state(dumps / last["metadata"]["name"], uninterrupted)
