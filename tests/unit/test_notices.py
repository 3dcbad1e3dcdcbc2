"""Notice sources against the fake metadata servers, and the fakes against the clouds' contracts."""

from __future__ import annotations

import json
import logging
import os
import queue
import signal
import socket
import stat
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from agent.control_channel import ControlDir
from agent.launcher import Agent, AgentConfig
from agent.notices import (
    AwsImdsSource,
    AzureScheduledEventsSource,
    Cloud,
    GceMetadataSource,
    Notice,
    NoticeKind,
    NoticeSource,
    SignalSource,
    detect_cloud,
    emulators,
    gcp,
)
from agent.notices.base import HttpClient
from agent.notices.emulators import AzureScheduledEventsEmulator, GceMetadataEmulator, ImdsEmulator, _Reply

FAST = 0.05
WAIT = 10.0
AT_2030 = datetime(2030, 1, 1, tzinfo=UTC)
INSTANCE_ACTION = "/latest/meta-data/spot/instance-action"
FLAVOR = {"Metadata-Flavor": "Google"}
AZURE_EVENTS = "/metadata/scheduledevents?api-version=2020-07-01"


def http(
    url: str, method: str = "GET", headers: dict[str, str] | None = None, body: bytes | None = None
) -> tuple[int, dict[str, str], bytes]:
    req = urllib.request.Request(url, method=method, headers=headers or {}, data=body)
    try:
        with urllib.request.urlopen(req, timeout=WAIT) as resp:
            return resp.status, {k.lower(): v for k, v in resp.headers.items()}, resp.read()
    except urllib.error.HTTPError as e:
        return e.code, {k.lower(): v for k, v in e.headers.items()}, e.read()


def wait_until(predicate: Callable[[], bool], what: str, timeout: float = WAIT) -> None:
    give_up = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > give_up:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def closed_port_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


class Collector:
    def __init__(self) -> None:
        self.notices: queue.Queue[Notice] = queue.Queue()

    def __call__(self, notice: Notice) -> None:
        self.notices.put(notice)

    def next(self) -> Notice:
        return self.notices.get(timeout=WAIT)


@pytest.fixture
def imds() -> Iterator[ImdsEmulator]:
    with ImdsEmulator() as emulator:
        yield emulator


@pytest.fixture
def gce(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Iterator[GceMetadataEmulator]:
    # The agents' maintenance records go to a temp folder of this test's own, not the machine's:
    # an emulator's port is reused by later tests, and its ETags are the same for the same value.
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path_factory.mktemp("tempdir")))
    with GceMetadataEmulator() as emulator:
        yield emulator


@pytest.fixture
def azure() -> Iterator[AzureScheduledEventsEmulator]:
    with AzureScheduledEventsEmulator(vm_name="vm-7") as emulator:
        yield emulator


def gce_records() -> list[Path]:
    """The GCE maintenance records in this test's temp folder (``gce`` fixture)."""
    return sorted(Path(tempfile.gettempdir()).glob(f"spotjob-gce-{os.getuid()}/*.json"))


def running(source: NoticeSource) -> tuple[NoticeSource, Collector]:
    collector = Collector()
    source.start(collector)
    return source, collector


def agent_saw_maintenance_start(gce: GceMetadataEmulator) -> Notice:
    """A GCE source of a GPU VM (an hour's notice) watching while maintenance-event turns
    TERMINATE_ON_HOST_MAINTENANCE, then stopped, as an agent that flushed and exited: its notice."""
    source, got = running(GceMetadataSource(gce.url, interval=FAST, maintenance_notice_seconds=3600))
    try:
        assert gce.wait_for_waiters(2)
        gce.set_maintenance_event("TERMINATE_ON_HOST_MAINTENANCE")
        return got.next()
    finally:
        source.stop()


def warns_until(source: NoticeSource, caplog: Any, predicate: Callable[[], bool], what: str) -> None:
    """Run ``source`` with its warnings captured until ``predicate`` holds, then stop it."""
    with caplog.at_level("WARNING", logger="agent.notices.base"):
        source.start(Collector())
        try:
            wait_until(predicate, what)
        finally:
            source.stop()


# -- the emulators keep the clouds' contracts --------------------------------------------------------


class TestImdsEmulator:
    def test_refuses_every_read_without_a_session_token(self, imds: ImdsEmulator) -> None:
        assert http(imds.url + "/latest/meta-data/instance-id")[0] == 401

    def test_issues_tokens_only_for_a_valid_ttl(self, imds: ImdsEmulator) -> None:
        token_url = imds.url + "/latest/api/token"
        assert http(token_url, "PUT")[0] == 400
        assert http(token_url, "PUT", {"X-aws-ec2-metadata-token-ttl-seconds": "0"})[0] == 400
        assert http(token_url, "PUT", {"X-aws-ec2-metadata-token-ttl-seconds": "21601"})[0] == 400
        assert http(token_url, "GET", {"X-aws-ec2-metadata-token-ttl-seconds": "60"})[0] == 405
        forwarded = {"X-aws-ec2-metadata-token-ttl-seconds": "60", "X-Forwarded-For": "10.0.0.1"}
        assert http(token_url, "PUT", forwarded)[0] == 403
        status, headers, token = http(token_url, "PUT", {"X-aws-ec2-metadata-token-ttl-seconds": "60"})
        assert status == 200 and token and headers["x-aws-ec2-metadata-token-ttl-seconds"] == "60"

    def test_answers_404_until_an_interruption_is_scheduled(self, imds: ImdsEmulator) -> None:
        token = http(imds.url + "/latest/api/token", "PUT", {"X-aws-ec2-metadata-token-ttl-seconds": "60"})[2]
        headers = {"X-aws-ec2-metadata-token": token.decode()}
        action_url = imds.url + "/latest/meta-data/spot/instance-action"
        assert http(action_url, headers=headers)[0] == 404
        imds.set_spot_action("stop", AT_2030)
        status, _, body = http(action_url, headers=headers)
        assert status == 200 and json.loads(body) == {"action": "stop", "time": "2030-01-01T00:00:00Z"}
        imds.clear()
        assert http(action_url, headers=headers)[0] == 404

    def test_behind_a_hop_limit_of_one_the_token_put_is_not_answered_but_reads_are(self) -> None:
        with ImdsEmulator(put_hop_limit_exceeded=True) as imds:
            req = urllib.request.Request(
                imds.url + "/latest/api/token", method="PUT", headers={"X-aws-ec2-metadata-token-ttl-seconds": "60"}
            )
            with pytest.raises((TimeoutError, urllib.error.URLError)):
                urllib.request.urlopen(req, timeout=0.3)
            assert http(imds.url + "/latest/meta-data/")[0] == 401

    def test_where_imdsv1_is_allowed_a_tokenless_read_is_answered_and_a_bad_token_is_not(self) -> None:
        with ImdsEmulator(http_tokens="optional") as imds:
            status, _, body = http(imds.url + "/latest/meta-data/instance-id")
            assert (status, body) == (200, imds.instance_id.encode())
            assert http(imds.url + "/latest/meta-data/instance-id", headers={"X-aws-ec2-metadata-token": "x"})[0] == 401
        with pytest.raises(ValueError, match="http_tokens"):
            ImdsEmulator(http_tokens="sometimes")

    def test_expired_tokens_get_401_and_a_new_token_works(self, imds: ImdsEmulator) -> None:
        def token() -> dict[str, str]:
            raw = http(imds.url + "/latest/api/token", "PUT", {"X-aws-ec2-metadata-token-ttl-seconds": "60"})[2]
            return {"X-aws-ec2-metadata-token": raw.decode()}

        old = token()
        imds.expire_tokens()
        assert http(imds.url + "/latest/meta-data/instance-id", headers=old)[0] == 401
        assert http(imds.url + "/latest/meta-data/instance-id", headers=token())[0] == 200
        assert imds.count("GET", status=401) == 1 and imds.token_requests == 2

    def test_an_agent_polling_for_a_long_run_costs_it_no_memory_per_request(self, monkeypatch: Any) -> None:
        """A local run's node answers its agent every second for as long as the run lasts: it
        keeps the newest requests for assertions, counting (not keeping) the rest."""
        monkeypatch.setattr(emulators, "HISTORY", 20, raising=False)
        with ImdsEmulator() as imds:
            token = http(imds.url + "/latest/api/token", "PUT", {"X-aws-ec2-metadata-token-ttl-seconds": "60"})[2]
            headers = {"X-aws-ec2-metadata-token": token.decode()}
            for _ in range(60):
                assert http(imds.url + "/latest/meta-data/spot/instance-action", headers=headers)[0] == 404
            kept = imds.requests
            assert len(kept) == 20 and all(r.path.endswith("/instance-action") for r in kept)
            assert imds.count("GET", "/latest/meta-data/spot/instance-action", status=404) == 60
            assert imds.token_requests == 1 and imds.count() == 61


class TestGceEmulator:
    def test_refuses_requests_without_the_flavor_header(self, gce: GceMetadataEmulator) -> None:
        assert http(gce.url + "/computeMetadata/v1/instance/preempted")[0] == 403

    def test_serves_values_with_an_etag_and_the_flavor_header(self, gce: GceMetadataEmulator) -> None:
        status, headers, body = http(gce.url + "/computeMetadata/v1/instance/preempted", headers=FLAVOR)
        assert (status, body) == (200, b"FALSE")
        assert headers["metadata-flavor"] == "Google" and headers["etag"] == gce.etag("FALSE")

    def test_wait_for_change_hangs_until_the_value_changes(self, gce: GceMetadataEmulator) -> None:
        url = gce.url + "/computeMetadata/v1/instance/preempted?wait_for_change=true&last_etag=" + gce.etag("FALSE")
        answers: list[tuple[int, dict[str, str], bytes]] = []
        waiter = threading.Thread(target=lambda: answers.append(http(url, headers=FLAVOR)))
        waiter.start()
        assert gce.wait_for_waiters(1)
        assert waiter.is_alive() and not answers  # held, not answered
        gce.set_preempted(True)
        waiter.join(WAIT)
        status, headers, body = answers[0]
        assert (status, body, headers["etag"]) == (200, b"TRUE", gce.etag("TRUE"))

    def test_wait_for_change_with_a_stale_etag_answers_at_once(self, gce: GceMetadataEmulator) -> None:
        gce.set_preempted(True)
        url = gce.url + "/computeMetadata/v1/instance/preempted?wait_for_change=true&last_etag=" + gce.etag("FALSE")
        assert http(url, headers=FLAVOR)[2] == b"TRUE"

    def test_wait_for_change_returns_the_same_value_after_timeout_sec(self, gce: GceMetadataEmulator) -> None:
        url = gce.url + "/computeMetadata/v1/instance/preempted?wait_for_change=true&timeout_sec=0"
        assert http(url, headers=FLAVOR)[2] == b"FALSE"

    def test_as_gkes_metadata_server_it_serves_a_pod_no_preemption_or_maintenance(self) -> None:
        with GceMetadataEmulator(gke_metadata_server=True) as gke:
            status, _, body = http(gke.url + "/computeMetadata/v1/instance/", headers=FLAVOR)
            assert status == 200 and body.decode().split() == [
                "attributes/",
                "hostname",
                "id",
                "service-accounts/",
                "zone",
            ]
            for key in ("preempted", "maintenance-event", "name"):
                assert http(f"{gke.url}/computeMetadata/v1/instance/{key}", headers=FLAVOR)[0] == 404
            assert http(gke.url + "/computeMetadata/v1/instance/zone", headers=FLAVOR)[0] == 200
            assert http(gke.url + "/computeMetadata/v1/project/project-id", headers=FLAVOR)[0] == 200


class TestAzureEmulator:
    def test_refuses_requests_without_the_metadata_header_or_api_version(
        self, azure: AzureScheduledEventsEmulator
    ) -> None:
        assert http(azure.url + AZURE_EVENTS)[0] == 400
        assert http(azure.url + "/metadata/scheduledevents", headers={"Metadata": "true"})[0] == 400

    def test_publishes_events_with_a_new_incarnation_and_an_rfc1123_not_before(
        self, azure: AzureScheduledEventsEmulator
    ) -> None:
        before = json.loads(http(azure.url + AZURE_EVENTS, headers={"Metadata": "true"})[2])
        event_id = azure.add_event(EventType="Preempt", NotBefore=AT_2030)
        doc = json.loads(http(azure.url + AZURE_EVENTS, headers={"Metadata": "true"})[2])
        assert doc["DocumentIncarnation"] > before["DocumentIncarnation"] and before["Events"] == []
        (event,) = doc["Events"]
        assert event["EventId"] == event_id and event["EventType"] == "Preempt"
        assert event["NotBefore"] == "Tue, 01 Jan 2030 00:00:00 GMT" and event["Resources"] == ["vm-7"]

    def test_records_start_requests_and_starts_the_event(self, azure: AzureScheduledEventsEmulator) -> None:
        event_id = azure.add_event()
        body = json.dumps({"StartRequests": [{"EventId": event_id}]}).encode()
        headers = {"Metadata": "true", "Content-Type": "application/json"}
        assert http(azure.url + AZURE_EVENTS, "POST", headers, body)[0] == 200
        assert azure.start_requests == [event_id]
        assert azure.document["Events"][0]["EventStatus"] == "Started"
        assert http(azure.url + AZURE_EVENTS, "POST", headers, b"{not json")[0] == 400

    # -- each source turns its cloud's message into the right notice ----------------------------------------

    def test_the_first_scheduled_events_request_waits_while_the_service_starts(self) -> None:
        with AzureScheduledEventsEmulator(first_call_delay=1.0) as azure:
            asked = time.monotonic()
            status, _, body = http(azure.url + AZURE_EVENTS, headers={"Metadata": "true"})
            assert status == 200 and "DocumentIncarnation" in json.loads(body)
            assert time.monotonic() - asked >= 1.0


class TestHttpClient:
    def test_an_ipv6_base_url_without_a_port_reaches_port_80_of_that_address(self) -> None:
        # AWS's IPv6 IMDS endpoint is http://[fd00:ec2::254]: no port, colons in the host.
        listener = socket.socket(socket.AF_INET6)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            listener.bind(("::1", 80))
        except OSError:  # not allowed to listen on port 80 here, or taken: the address is what counts
            listener.close()
            try:
                HttpClient("http://[::1]").request("GET", "/latest/meta-data/", timeout=WAIT)
            except socket.gaierror as e:
                pytest.fail(f"the IPv6 host was taken apart as host:port: {e}")
            except OSError:
                pass  # refused or reset by [::1]:80: it was reached
            return
        with listener:
            listener.listen(1)

            def answer() -> None:
                conn, _ = listener.accept()
                with conn:
                    conn.recv(65536)
                    conn.sendall(b"HTTP/1.0 401 Unauthorized\r\nContent-Length: 0\r\n\r\n")
                    conn.recv(1)  # the client closes first, so no TIME_WAIT holds port 80 after the test

            server = threading.Thread(target=answer, daemon=True)
            server.start()
            assert HttpClient("http://[::1]").request("GET", "/latest/meta-data/", timeout=WAIT).status == 401
            server.join(WAIT)


class TestAwsSource:
    def test_turns_a_spot_instance_action_into_one_preemption_notice_with_its_time(self, imds: ImdsEmulator) -> None:
        source, got = running(AwsImdsSource(imds.url, interval=FAST))
        try:
            imds.set_spot_action("terminate", AT_2030)
            notice = got.next()
            assert (notice.source, notice.kind, notice.deadline) == ("aws", NoticeKind.PREEMPTION, AT_2030.timestamp())
            assert "terminate" in notice.detail
            polls = imds.count("GET", INSTANCE_ACTION)
            wait_until(lambda: imds.count("GET", INSTANCE_ACTION) >= polls + 3, "three more polls")
            assert got.notices.empty()  # still scheduled, still one notice
        finally:
            source.stop()

    def test_renews_its_token_after_a_401(self, imds: ImdsEmulator) -> None:
        source, got = running(AwsImdsSource(imds.url, interval=FAST))
        try:
            wait_until(lambda: imds.count("GET", INSTANCE_ACTION, status=404) >= 1, "a first poll")
            imds.expire_tokens()
            wait_until(lambda: imds.count("GET", status=401) >= 1, "a refused poll")
            imds.set_spot_action("terminate", AT_2030)
            assert got.next().kind is NoticeKind.PREEMPTION
            assert imds.token_requests >= 2
        finally:
            source.stop()

    def test_a_rebalance_recommendation_is_a_rebalance_notice_without_deadline(self, imds: ImdsEmulator) -> None:
        source, got = running(AwsImdsSource(imds.url, interval=FAST))
        try:
            imds.set_rebalance(AT_2030)
            notice = got.next()
            assert (notice.kind, notice.deadline) == (NoticeKind.REBALANCE, None)
            assert "2030-01-01T00:00:00Z" in notice.detail
        finally:
            source.stop()

    def test_does_not_ask_for_rebalance_when_told_not_to(self, imds: ImdsEmulator) -> None:
        source, _ = running(AwsImdsSource(imds.url, interval=FAST, watch_rebalance=False))
        try:
            wait_until(lambda: imds.count("GET", INSTANCE_ACTION) >= 2, "two polls")
        finally:
            source.stop()
        assert imds.count("GET", "/latest/meta-data/events/recommendations/rebalance") == 0

    def test_an_unreadable_instance_action_or_rebalance_is_one_notice_and_one_warning(self, caplog: Any) -> None:
        # AWS serves both until the instance goes (a rebalance recommendation for hours).
        with Garbled() as imds:
            imds.set_spot_action()
            imds.set_rebalance()
            source, got = running(AwsImdsSource(imds.url, interval=FAST))
            try:
                with caplog.at_level("WARNING", logger="agent.notices.aws"):
                    kinds = {got.next().kind, got.next().kind}
                    polls = imds.count("GET", INSTANCE_ACTION)
                    wait_until(lambda: imds.count("GET", INSTANCE_ACTION) >= polls + 5, "five more polls")
            finally:
                source.stop()
        assert kinds == {NoticeKind.PREEMPTION, NoticeKind.REBALANCE} and got.notices.empty()
        warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        assert len([w for w in warnings if "unreadable spot instance-action" in w]) == 1, warnings
        assert len([w for w in warnings if "unreadable rebalance recommendation" in w]) == 1, warnings


class TestGcpSource:
    def test_a_preemption_arrives_through_the_held_long_poll_with_a_30_s_deadline(
        self, gce: GceMetadataEmulator
    ) -> None:
        source, got = running(GceMetadataSource(gce.url, interval=FAST))
        try:
            assert gce.wait_for_waiters(2)  # both watches are holding a wait_for_change
            before = time.time()
            gce.set_preempted(True)
            notice = got.next()
            after = time.time()
            assert (notice.source, notice.kind) == ("gcp", NoticeKind.PREEMPTION)
            assert notice.deadline is not None and before + 30 <= notice.deadline <= after + 30
        finally:
            source.stop()

    def test_terminate_on_host_maintenance_is_a_maintenance_notice_and_migration_is_not(
        self, gce: GceMetadataEmulator
    ) -> None:
        source, got = running(GceMetadataSource(gce.url, interval=FAST, maintenance_notice_seconds=60))
        try:
            assert gce.wait_for_waiters(2)
            gce.set_maintenance_event("MIGRATE_ON_HOST_MAINTENANCE")
            gce.set_maintenance_event("TERMINATE_ON_HOST_MAINTENANCE")
            notice = got.next()
            assert notice.kind is NoticeKind.MAINTENANCE and "TERMINATE_ON_HOST_MAINTENANCE" in notice.detail
            assert got.notices.empty()
        finally:
            source.stop()

    def test_a_gpu_vms_hour_of_maintenance_notice_is_its_deadline_and_a_restart_on_the_vm_counts_from_the_first_sight(
        self, gce: GceMetadataEmulator
    ) -> None:
        """GCE tells a VM with GPUs of a host maintenance that stops it an hour ahead (60 s for other
        VMs). Heard as it changes, the deadline is the hour. An agent started later on that VM (a
        job restarted there) finds it already set: it counts the hour from when the first agent saw
        it, which that agent recorded on the machine. Before, the restart assumed 60 s and flushed
        at once, on every restart until the maintenance."""
        source, got = running(GceMetadataSource(gce.url, interval=FAST, maintenance_notice_seconds=3600))
        try:
            assert gce.wait_for_waiters(2)
            before = time.time()
            gce.set_maintenance_event("TERMINATE_ON_HOST_MAINTENANCE")
            first = got.next()
            assert first.deadline is not None and before + 3600 <= first.deadline <= time.time() + 3600
        finally:
            source.stop()
        for _ in range(2):  # a restart's own sight is not recorded over the first one's
            restarted, got = running(GceMetadataSource(gce.url, interval=FAST, maintenance_notice_seconds=3600))
            try:
                notice = got.next()
                assert notice.deadline == first.deadline
                assert "first seen at" in notice.detail and "earlier agent on this machine" in notice.detail
            finally:
                restarted.stop()

    def test_the_maintenance_record_is_private_to_the_user(self, gce: GceMetadataEmulator) -> None:
        """Pins the record's place and modes (new with it): a 0700 folder of this user's, a 0600 file."""
        agent_saw_maintenance_start(gce)
        (record,) = gce_records()
        assert stat.S_IMODE(record.parent.stat().st_mode) == 0o700 and stat.S_IMODE(record.stat().st_mode) == 0o600
        content = json.loads(record.read_text())
        assert content["etag"] == gce.etag("TERMINATE_ON_HOST_MAINTENANCE") and content["boot_id"] == gcp.boot_id()

    @pytest.mark.parametrize(
        "spoil",
        ["garbage", "other boot", "other etag", "from the future", "notice run out", "symlink", "shared folder"],
    )
    def test_a_record_that_proves_nothing_leaves_a_restart_its_60_s(self, gce: GceMetadataEmulator, spoil: str) -> None:
        """The record is trusted only as far as it proves when this very event was seen: one that
        cannot be read, of another boot or another ETag (another version of the value), whose time
        is ahead of the clock or longer ago than the notice, a link, or in a folder others may
        write, is ignored and the restart gets 60 s, as without a record. (60 s is what every
        restart got before the record existed: this pins the bounds of the new trust.)"""
        agent_saw_maintenance_start(gce)
        (record,) = gce_records()
        content = json.loads(record.read_text())
        if spoil == "garbage":
            record.write_bytes(b"\x00{not json")
        elif spoil == "symlink":
            target = record.with_name("elsewhere")
            record.rename(target)
            record.symlink_to(target)
        elif spoil == "shared folder":
            record.parent.chmod(0o777)
        else:
            field, value = {
                "other boot": ("boot_id", "0" * 36),
                "other etag": ("etag", gce.etag("TERMINATE_ON_HOST_MAINTENANCE ")),
                "from the future": ("first_seen", time.time() + 120),
                "notice run out": ("first_seen", time.time() - 3600),
            }[spoil]
            record.write_text(json.dumps({**content, field: value}))
        restarted, got = running(GceMetadataSource(gce.url, interval=FAST, maintenance_notice_seconds=3600))
        try:
            notice = got.next()
            assert notice.deadline is not None and notice.deadline <= time.time() + 60
            assert "60 s assumed" in notice.detail
        finally:
            restarted.stop()

    def test_an_agent_that_found_the_value_set_records_nothing_and_a_withdrawal_removes_the_record(
        self, gce: GceMetadataEmulator
    ) -> None:
        """Only an agent that saw the value change knows a time to record: one that found it set
        leaves none (its time would be later than the truth: a later restart would flush too late).
        An agent that sees the event end removes the record, so a new event with the same value
        (and, GCE's ETags being the content's, the same ETag) is not dated by the old one. (New
        with the record: pins that it never dates an event later than it was seen.)"""
        gce.set_maintenance_event("TERMINATE_ON_HOST_MAINTENANCE")
        restarted, got = running(GceMetadataSource(gce.url, interval=FAST, maintenance_notice_seconds=3600))
        try:
            assert "60 s assumed" in got.next().detail
        finally:
            restarted.stop()
        assert gce_records() == []
        gce.set_maintenance_event("NONE")
        source, got = running(GceMetadataSource(gce.url, interval=FAST, maintenance_notice_seconds=3600))
        try:
            # This source's own poll on NONE: the stopped one's polls, still held by the server
            # until a change or their timeout, counted as its waiters, and the event could be set
            # before it first read the value (then "already set": nothing recorded).
            assert gce.wait_for_waiter_on("instance/maintenance-event", "NONE")
            gce.set_maintenance_event("TERMINATE_ON_HOST_MAINTENANCE")
            got.next()
            assert len(gce_records()) == 1
            gce.set_maintenance_event("NONE")
            assert got.next().withdrawn
        finally:
            source.stop()
        assert gce_records() == []

    def test_a_maintenance_event_back_to_none_withdraws_the_notice_and_a_new_one_counts_again(
        self, gce: GceMetadataEmulator
    ) -> None:
        source, got = running(GceMetadataSource(gce.url, interval=FAST, maintenance_notice_seconds=3600))
        try:
            assert gce.wait_for_waiters(2)
            gce.set_maintenance_event("TERMINATE_ON_HOST_MAINTENANCE")
            assert not got.next().withdrawn
            gce.set_maintenance_event("NONE")
            withdrawn = got.next()
            assert withdrawn.withdrawn and withdrawn.kind is NoticeKind.MAINTENANCE and "NONE" in withdrawn.detail
            gce.set_maintenance_event("TERMINATE_ON_HOST_MAINTENANCE")
            assert not got.next().withdrawn
        finally:
            source.stop()

    def test_an_undocumented_maintenance_event_value_changes_nothing_and_is_warned_about_once(
        self, tmp_path: Path, gce: GceMetadataEmulator, caplog: Any
    ) -> None:
        """A 200 answer whose body is none of GCE's values (a proxy's error page) while a maintenance
        is held. Before, it was taken as the maintenance's end: the held notice was withdrawn and the
        record removed, and when the value came back the deadline restarted an hour later."""
        a = agent(tmp_path, flush_lead=10)
        got = Handled(a)
        source = GceMetadataSource(gce.url, interval=FAST, maintenance_notice_seconds=3600)
        path = "/computeMetadata/v1/instance/maintenance-event"
        with caplog.at_level("WARNING", logger="agent.notices.base"):
            source.start(got)
            try:
                assert gce.wait_for_waiters(2)
                gce.set_maintenance_event("TERMINATE_ON_HOST_MAINTENANCE")
                first = got.next()
                held = a.status().held_notice
                assert held is not None and held.deadline == first.deadline
                (record,) = gce_records()
                recorded = record.read_bytes()
                answered = gce.count("GET", path)
                page = "<html><body>502 Bad Gateway</body></html>"
                gce.set_maintenance_event(page)
                wait_until(
                    lambda: (
                        gce.count("GET", path) >= answered + 3
                        or gce.wait_for_waiter_on("instance/maintenance-event", page, timeout=0)
                    ),  # took it as a value
                    "three answers of the page",
                )
                gce.set_maintenance_event("TERMINATE_ON_HOST_MAINTENANCE")
                # The watch waits on the value it last took: it never took the page.
                assert gce.wait_for_waiter_on("instance/maintenance-event", "TERMINATE_ON_HOST_MAINTENANCE")
            finally:
                source.stop()
        assert got.notices.empty(), got.notices.get()
        held = a.status().held_notice
        assert held is not None and held.deadline == first.deadline and a._flush is None
        assert [r.read_bytes() for r in gce_records()] == [recorded]
        warnings = [r.getMessage() for r in caplog.records if r.name == "agent.notices.base"]
        assert len(warnings) == 1 and "502 Bad Gateway" in warnings[0] and "no value of" in warnings[0], warnings

    def test_the_values_taken_are_the_ones_gce_documents(self) -> None:
        """Pins which answers count as news (the rest is a failed read, as above): GCE's three
        maintenance-event values, any live migration by name, preempted TRUE or FALSE in any case."""
        for value in ("NONE", "MIGRATE_ON_HOST_MAINTENANCE", "MIGRATE", "TERMINATE_ON_HOST_MAINTENANCE"):
            assert gcp.known_value("maintenance-event", value), value
        for value in ("", "none", "<html>", "TERMINATE", "TERMINATE_ON_HOST_MAINTENANCE <html>", "MIGRATE <html>"):
            assert not gcp.known_value("maintenance-event", value), value
        assert all(gcp.known_value("preempted", v) for v in ("TRUE", "FALSE", "true"))
        assert not any(gcp.known_value("preempted", v) for v in ("", "1", "<html>TRUE</html>"))

    def test_an_answer_without_the_metadata_flavor_header_is_not_the_metadata_servers(
        self, tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch, caplog: Any
    ) -> None:
        """The metadata server puts ``Metadata-Flavor: Google`` on every answer; one without it is
        someone else's (a proxy between the pod and the server) and tells nothing: no notice, a
        warning once, and the server's own answer is heard when it comes back."""
        monkeypatch.setattr(tempfile, "tempdir", str(tmp_path_factory.mktemp("tempdir")))
        with Proxied() as gce:
            source = GceMetadataSource(gce.url, interval=FAST, maintenance_notice_seconds=3600)
            got = Collector()
            path = "/computeMetadata/v1/instance/maintenance-event"
            with caplog.at_level("WARNING", logger="agent.notices.base"):
                source.start(got)
                try:
                    assert gce.wait_for_waiters(2)
                    gce.proxied = True
                    answered = gce.count("GET", path)
                    gce.set_maintenance_event("TERMINATE_ON_HOST_MAINTENANCE")
                    wait_until(
                        lambda: (
                            gce.count("GET", path) >= answered + 3
                            or gce.wait_for_waiter_on("instance/maintenance-event", "TERMINATE_ON_HOST_MAINTENANCE", 0)
                        ),
                        "three proxied answers",
                    )
                    assert got.notices.empty(), got.notices.get()
                    gce.proxied = False
                    notice = got.next()
                    assert notice.kind is NoticeKind.MAINTENANCE and not notice.withdrawn
                finally:
                    source.stop()
        warnings = [r.getMessage() for r in caplog.records if r.name == "agent.notices.base"]
        assert len(warnings) == 1 and "Metadata-Flavor" in warnings[0] and "maintenance-event" in warnings[0], warnings

    def test_the_maintenance_deadline_is_an_hour_where_an_nvidia_gpu_is_seen(self, tmp_path: Path) -> None:
        assert gcp.maintenance_notice_seconds(str(tmp_path)) == 60
        (tmp_path / "dev").mkdir()
        (tmp_path / "dev" / "nvidiactl").touch()  # the driver's control node alone is no GPU
        assert gcp.maintenance_notice_seconds(str(tmp_path)) == 60
        (tmp_path / "dev" / "nvidia0").touch()
        assert gcp.maintenance_notice_seconds(str(tmp_path)) == 3600
        other = tmp_path / "other"
        (other / "proc/driver/nvidia/gpus/0000:00:04.0").mkdir(parents=True)
        assert gcp.maintenance_notice_seconds(str(other)) == 3600

    def test_a_vm_already_preempted_at_start_is_noticed_without_waiting(self, gce: GceMetadataEmulator) -> None:
        gce.set_preempted(True)
        source, got = running(GceMetadataSource(gce.url, interval=FAST, notice_seconds=12))
        try:
            notice = got.next()
            assert notice.kind is NoticeKind.PREEMPTION and notice.deadline is not None
            assert notice.deadline <= time.time() + 12
        finally:
            source.stop()

    def test_stop_ends_the_held_long_polls(self, gce: GceMetadataEmulator) -> None:
        source, _ = running(GceMetadataSource(gce.url, interval=FAST))
        assert gce.wait_for_waiters(2)
        source.stop()
        assert not [t for t in threading.enumerate() if t.name == "spotjob-notice-gcp"]

    def test_each_watchs_failure_line_names_its_key(self, caplog: Any) -> None:
        """A server that cannot be reached fails both watches: their warnings read the same
        ("gcp notices from URL: ... timed out") and named neither key."""
        source = GceMetadataSource(closed_port_url(), interval=FAST)
        warns_until(
            source,
            caplog,
            lambda: sum("will keep trying" in r.getMessage() for r in caplog.records) >= 2,
            "both watches failing",
        )
        warnings = sorted(r.getMessage() for r in caplog.records if "will keep trying" in r.getMessage())
        assert len(warnings) == 2, warnings
        assert "(instance/maintenance-event)" in warnings[0] and "(instance/preempted)" in warnings[1], warnings

    def test_in_a_gke_pod_under_workload_identity_the_404_says_why_and_what_to_do(self, caplog: Any) -> None:
        # GKE's metadata server serves a Workload Identity pod no instance/preempted: before, the
        # agent warned "answered 404 (will keep trying)" and the user could not tell that this pod
        # will never hear a preemption from the metadata server.
        with GceMetadataEmulator(gke_metadata_server=True) as gke:
            nothing = closed_port_url()
            assert detect_cloud(aws_url=nothing, gcp_url=gke.url, azure_url=nothing, env={}) is Cloud.GCP
            source = GceMetadataSource(gke.url, interval=FAST)
            path = "/computeMetadata/v1/instance/preempted"
            warns_until(
                source, caplog, lambda: gke.count("GET", path, status=404) >= 2, "two polls of instance/preempted"
            )
        warnings = [r.getMessage() for r in caplog.records if "instance/preempted" in r.getMessage()]
        assert len(warnings) == 1, warnings
        assert "Workload Identity" in warnings[0] and "hostNetwork: true" in warnings[0]
        assert "SIGTERM" in warnings[0] and "--no-gcp" in warnings[0]


class TestAzureSource:
    def test_a_preempt_event_is_a_notice_with_not_before_as_deadline_and_is_acknowledged_after_the_flush(
        self, azure: AzureScheduledEventsEmulator
    ) -> None:
        source, got = running(AzureScheduledEventsSource(azure.url, interval=FAST))
        try:
            event_id = azure.add_event(EventType="Preempt", NotBefore=AT_2030)
            notice = got.next()
            assert (notice.source, notice.kind, notice.deadline) == (
                "azure",
                NoticeKind.PREEMPTION,
                AT_2030.timestamp(),
            )
            assert notice.event_id == event_id
            assert azure.start_requests == []  # not before the flush has ended
            source.flush_finished()
            assert azure.wait_for_start_request(event_id)
            assert azure.start_requests == [event_id]
        finally:
            source.stop()

    def test_an_event_whose_not_before_moves_is_heard_again_until_this_agent_acknowledges_it(
        self, azure: AzureScheduledEventsEmulator
    ) -> None:
        """A Reboot held for its ``NotBefore`` (``--flush-lead``) that Azure moves sooner must reach
        the agent again, or the held flush starts after the reboot. Before, an event was heard once."""
        source, got = running(AzureScheduledEventsSource(azure.url, interval=FAST))
        try:
            event_id = azure.add_event(EventType="Reboot", NotBefore=AT_2030)
            assert got.next().deadline == AT_2030.timestamp()
            sooner = time.time() + 600
            azure.move_event(event_id, sooner)
            moved = got.next()
            assert (moved.event_id, moved.kind, moved.deadline) == (event_id, NoticeKind.MAINTENANCE, int(sooner))
            assert "NotBefore was" in moved.detail
            source.flush_finished()
            assert azure.wait_for_start_request(event_id)  # Started, NotBefore empty: this agent's own doing
            other = azure.add_event(EventType="Freeze")
            wait_until(lambda: source._incarnation == azure.document["DocumentIncarnation"], "the Freeze to be read")
            assert got.notices.empty(), other
        finally:
            source.stop()

    def test_an_event_that_leaves_the_list_is_withdrawn(self, azure: AzureScheduledEventsEmulator) -> None:
        """Azure cancelled a Reboot the agent may hold (``--flush-lead``): it must hear so. Before,
        nothing was said and the held flush stopped the job at the cancelled event's time."""
        source, got = running(AzureScheduledEventsSource(azure.url, interval=FAST))
        try:
            event_id = azure.add_event(EventType="Reboot", NotBefore=AT_2030)
            assert not got.next().withdrawn
            azure.clear()
            gone = got.next()
            assert (gone.withdrawn, gone.event_id, gone.kind, gone.source) == (
                True,
                event_id,
                NoticeKind.MAINTENANCE,
                "azure",
            )
        finally:
            source.stop()

    def test_the_readmes_held_notice_line_is_what_kubectl_spotjob_status_prints_for_a_reboot(
        self, azure: AzureScheduledEventsEmulator
    ) -> None:
        """README.md's `kubectl spotjob status` example shows a held Azure Reboot as
        "azure maintenance (Reboot 7f3c…)", a detail no agent writes: the agent's is "scheduled event
        Reboot <EventId> (<EventStatus>)". The notice here is the Azure source's own, from the
        emulator, rendered by the plugin's code at the example's time (the controller copies it
        unchanged into status.heldNotices; that copy is not run here)."""
        from orchestrator.held_notices import held_text

        readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
        line = next(x for x in readme.splitlines() if x.startswith("Held notice:  train-demo-1-0"))
        source, got = running(AzureScheduledEventsSource(azure.url, interval=FAST))
        try:
            deadline = datetime(2026, 6, 1, 12, 20, tzinfo=UTC)
            azure.add_event(EventType="Reboot", NotBefore=deadline, EventId="7f3c…")
            notice = got.next()
        finally:
            source.stop()
        held = {
            "worker": "train-demo-1-0",
            "node": "ip-10-0-9-2",
            "source": notice.source,
            "kind": str(notice.kind),
            "detail": notice.detail,
            "deadline": datetime.fromtimestamp(notice.deadline or 0, UTC).isoformat(),
            "flushAt": datetime(2026, 6, 1, 12, 15, tzinfo=UTC).isoformat(),
        }
        assert line == "Held notice:  " + held_text(held, datetime(2026, 6, 1, 12, 6, tzinfo=UTC))

    def test_an_event_that_left_the_list_is_not_acknowledged_after_a_later_flush(
        self, azure: AzureScheduledEventsEmulator
    ) -> None:
        """A held Reboot is cancelled (it leaves the list), then a Preempt flushes the job. Before,
        the acknowledgement named the cancelled event too: an EventId Azure no longer lists."""
        source, got = running(AzureScheduledEventsSource(azure.url, interval=FAST))
        try:
            azure.add_event(EventType="Reboot", NotBefore=AT_2030)
            got.next()
            azure.clear()
            assert got.next().withdrawn
            preempt = azure.add_event(EventType="Preempt", NotBefore=AT_2030)
            assert got.next().event_id == preempt
            source.flush_finished()
            assert azure.wait_for_start_request(preempt)
            assert azure.start_requests == [preempt]
        finally:
            source.stop()

    def test_an_acknowledgement_azure_refuses_does_not_stop_the_next_event_from_being_heard(self) -> None:
        """IMDS refuses the StartRequests after a Reboot's flush, then schedules a Preempt. Before,
        the refused acknowledgement ended every poll before the events were read: the Preempt
        was never heard, and the Reboot never seen to leave the list."""
        with AckRefused(vm_name="vm-7") as emulator:
            source, got = running(AzureScheduledEventsSource(emulator.url, interval=FAST))
            try:
                reboot = emulator.add_event(EventType="Reboot", NotBefore=AT_2030)
                assert got.next().event_id == reboot
                source.flush_finished()
                wait_until(lambda: emulator.count("POST", "/metadata/scheduledevents", 400) > 0, "the refused ack")
                preempt = emulator.add_event(EventType="Preempt", NotBefore=AT_2030)
                assert got.next().event_id == preempt
            finally:
                source.stop()

    def test_events_for_other_vms_and_freezes_are_not_notices(self, azure: AzureScheduledEventsEmulator) -> None:
        source, got = running(AzureScheduledEventsSource(azure.url, interval=FAST))
        try:
            azure.add_event(EventType="Preempt", Resources=["vm-other"])
            azure.add_event(EventType="Freeze")
            terminate = azure.add_event(EventType="Terminate", NotBefore="")
            notice = got.next()
            assert (notice.kind, notice.event_id) == (NoticeKind.TERMINATE, terminate)
            assert notice.deadline is not None  # empty NotBefore: Azure's 30 s minimum
            assert got.notices.empty()
        finally:
            source.stop()

    def test_the_first_request_waits_for_the_service_to_start_instead_of_timing_out(self, caplog: Any) -> None:
        # Azure enables Scheduled Events at a VM's first request and answers it within two minutes.
        # Before, the source gave that request its 2 s timeout: every agent on Azure started with
        # "timed out (will keep trying)", and heard nothing until the service was up.
        with AzureScheduledEventsEmulator(vm_name="vm-7", first_call_delay=3.0) as azure:
            event_id = azure.add_event(EventType="Preempt", NotBefore=AT_2030)
            with caplog.at_level("INFO", logger="agent.notices"):
                source, got = running(AzureScheduledEventsSource(azure.url, interval=30.0, timeout=2.0))
                try:
                    assert got.next().event_id == event_id
                    assert azure.count("GET", "/metadata/scheduledevents") == 1
                finally:
                    source.stop()
        assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
        assert "up to two minutes" in caplog.text

    def test_stop_ends_a_first_request_still_waiting_for_the_service(self) -> None:
        """Pins that the long first request (the fix above) does not hold up ``stop``."""
        with AzureScheduledEventsEmulator(vm_name="vm-7", first_call_delay=600.0) as azure:
            source, _ = running(AzureScheduledEventsSource(azure.url, interval=FAST))
            wait_until(lambda: azure._started_at is not None, "the first scheduled events request")
            source.stop()
            assert not [t for t in threading.enumerate() if t.name == "spotjob-notice-azure"]

    def test_the_long_first_request_still_gives_up_connecting_at_the_usual_timeout(self, caplog: Any) -> None:
        # An IMDS whose connect hangs (forced --cloud azure off Azure, a firewall dropping packets)
        # is warned about at once, not after the first call's 150 s, which stop() could not cut.
        with socket.socket() as full:
            full.bind(("127.0.0.1", 0))
            full.listen(0)
            port = full.getsockname()[1]
            with socket.create_connection(("127.0.0.1", port)):  # fills the backlog: later connects hang
                source = AzureScheduledEventsSource(f"http://127.0.0.1:{port}", interval=FAST, timeout=0.2)
                warns_until(source, caplog, lambda: "scheduledevents" in caplog.text, "the scheduled events warning")
        assert "is this an Azure VM" in caplog.text

    def test_a_name_read_that_failed_once_is_read_again_and_other_vms_events_stay_ignored(self) -> None:
        # IMDS throttles (429) past 5 requests a second: the first name read failing must not
        # make every VM's events this VM's for the rest of the job.
        with NameFailsFirst(vm_name="vm-7") as azure:
            source, got = running(AzureScheduledEventsSource(azure.url, interval=FAST))
            try:
                wait_until(lambda: azure.count("GET", "/metadata/scheduledevents") >= 2, "a poll after the failed read")
                azure.add_event(EventType="Preempt", Resources=["vm-other"])
                ours = azure.add_event(EventType="Terminate", Resources=["vm-7"])
                notice = got.next()
                assert notice.event_id == ours
                source.flush_finished()
                assert azure.wait_for_start_request(ours)
                assert got.notices.empty() and azure.start_requests == [ours]
            finally:
                source.stop()

    def test_while_the_name_is_unknown_events_count_but_only_this_vms_are_acknowledged(self) -> None:
        # A needless flush is safe; acknowledging another VM's event starts its eviction now.
        with NameFailsFirst(vm_name="vm-7", failures=10**6) as azure:
            source, got = running(AzureScheduledEventsSource(azure.url, interval=FAST))
            try:
                other = azure.add_event(EventType="Preempt", Resources=["vm-other"])
                assert got.next().event_id == other
                unnamed = azure.add_event(EventType="Terminate", Resources=[])
                assert got.next().event_id == unnamed
                source.flush_finished()
                assert azure.wait_for_start_request(unnamed)
                polls = azure.count("GET", "/metadata/scheduledevents")
                wait_until(lambda: azure.count("GET", "/metadata/scheduledevents") >= polls + 3, "three more polls")
                assert azure.start_requests == [unnamed]
            finally:
                source.stop()

    def test_a_pending_acknowledgement_is_sent_on_stop(self, azure: AzureScheduledEventsEmulator) -> None:
        source = AzureScheduledEventsSource(azure.url, interval=60)  # polls once, then only on wake
        got = Collector()
        event_id = azure.add_event()
        source.start(got)
        got.next()
        source.flush_finished()
        source.stop()
        assert azure.start_requests == [event_id]


class Garbled(ImdsEmulator):
    """IMDS whose instance-action and rebalance documents, once set, are not what AWS documents."""

    def _handle(self, method: str, path: str, query: dict[str, str], headers: dict[str, str], body: bytes) -> Any:
        reply = super()._handle(method, path, query, headers, body)
        if reply.status == 200 and path == self.INSTANCE_ACTION_PATH:
            return _Reply.text(200, '{"action": "terminate", "time": "soon"}')
        if reply.status == 200 and path == self.REBALANCE_PATH:
            return _Reply.text(200, "<html>oops</html>")
        return reply


class Proxied(GceMetadataEmulator):
    """A GCE metadata server behind something that, while ``proxied``, answers without its
    ``Metadata-Flavor: Google`` header (a proxy's answer, not the server's)."""

    proxied = False

    def _handle(self, method: str, path: str, query: dict[str, str], headers: dict[str, str], body: bytes) -> Any:
        reply = super()._handle(method, path, query, headers, body)
        if self.proxied:
            reply.headers.pop("Metadata-Flavor", None)
        return reply


class NameFailsFirst(AzureScheduledEventsEmulator):
    """Azure IMDS that throttles (429) the first ``failures`` reads of this VM's name."""

    def __init__(self, *, vm_name: str, failures: int = 1) -> None:
        super().__init__(vm_name=vm_name)
        self.name_failures = failures

    def _handle(self, method: str, path: str, query: dict[str, str], headers: dict[str, str], body: bytes) -> Any:
        if path == "/metadata/instance/compute/name" and self.name_failures > 0:
            self.name_failures -= 1
            return _Reply.json(429, {"error": "Too many requests"})
        return super()._handle(method, path, query, headers, body)


class AckRefused(AzureScheduledEventsEmulator):
    """Azure IMDS that answers every StartRequests 400 (as for an EventId it no longer lists)."""

    def _handle(self, method: str, path: str, query: dict[str, str], headers: dict[str, str], body: bytes) -> Any:
        if method == "POST" and path == self.EVENTS_PATH:
            return _Reply.json(400, {"error": "Bad request. Unknown EventId"})
        return super()._handle(method, path, query, headers, body)


class TestCloudTimes:
    @pytest.mark.parametrize("zone", ["America/New_York", "Asia/Kolkata"])
    def test_a_time_without_a_zone_is_utc_whatever_the_nodes_zone(self, zone: str, monkeypatch: Any) -> None:
        """IMDS times are UTC; one that does not say so (Azure's ``-0000``, no zone at all) must not
        be read in the node's own zone, which would move the deadline by hours."""
        from agent.notices.aws import parse_aws_time
        from agent.notices.azure import parse_not_before

        monkeypatch.setenv("TZ", zone)
        time.tzset()
        try:
            utc = AT_2030.timestamp()
            for value in (
                "Tue, 01 Jan 2030 00:00:00 GMT",
                "Tue, 01 Jan 2030 00:00:00 -0000",
                "Tue, 01 Jan 2030 00:00:00",
            ):
                assert parse_not_before(value) == utc, value
            assert parse_aws_time("2030-01-01T00:00:00") == parse_aws_time("2030-01-01T00:00:00Z") == utc
        finally:
            monkeypatch.delenv("TZ")
            time.tzset()


class TestSignalSource:
    def test_sigterm_is_a_terminate_notice_with_the_grace_period_as_deadline(self) -> None:
        original = signal.getsignal(signal.SIGTERM)
        source, got = running(SignalSource(grace_seconds=17))
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            notice = got.next()
            assert (notice.source, notice.kind) == ("signal", NoticeKind.TERMINATE)
            assert notice.deadline == notice.received_at + 17 and "SIGTERM" in notice.detail
            os.kill(os.getpid(), signal.SIGINT)
            assert "SIGINT" in got.next().detail
        finally:
            source.stop()
        assert signal.getsignal(signal.SIGTERM) == original

    def test_the_start_line_names_a_fractional_grace_as_given(self, caplog: pytest.LogCaptureFixture) -> None:
        """A grace of 0.5 s was logged as "grace 0 s", as if a SIGTERM meant no time at all."""
        with caplog.at_level(logging.INFO, logger="agent.notices.sigterm"):
            source, _ = running(SignalSource(grace_seconds=0.5))
            source.stop()
        assert "(grace 0.5 s)" in caplog.text


# -- which cloud ------------------------------------------------------------------------------------


class TestDetectCloud:
    def test_the_environment_overrides_probing(self) -> None:
        assert detect_cloud(env={"SPOTJOB_CLOUD": "gcp"}) is Cloud.GCP
        assert detect_cloud(env={"SPOTJOB_CLOUD": "none"}) is Cloud.NONE
        with pytest.raises(ValueError, match="SPOTJOB_CLOUD"):
            detect_cloud(env={"SPOTJOB_CLOUD": "oracle"})

    def test_each_cloud_is_recognised_by_its_own_endpoint(
        self, imds: ImdsEmulator, gce: GceMetadataEmulator, azure: AzureScheduledEventsEmulator
    ) -> None:
        nothing = closed_port_url()
        assert detect_cloud(aws_url=imds.url, gcp_url=nothing, azure_url=nothing, env={}) is Cloud.AWS
        auto = {"SPOTJOB_CLOUD": "auto"}
        assert detect_cloud(aws_url=imds.url, gcp_url=nothing, azure_url=nothing, env=auto) is Cloud.AWS
        assert detect_cloud(aws_url=nothing, gcp_url=gce.url, azure_url=nothing, env={}) is Cloud.GCP
        assert detect_cloud(aws_url=nothing, gcp_url=nothing, azure_url=azure.url, env={}) is Cloud.AZURE
        # A server of the wrong dialect is not mistaken for its own cloud.
        assert detect_cloud(aws_url=gce.url, gcp_url=azure.url, azure_url=imds.url, env={}) is Cloud.NONE
        assert detect_cloud(aws_url=nothing, gcp_url=nothing, azure_url=nothing, env={}) is Cloud.NONE

    def test_aws_is_recognised_from_a_container_whose_token_put_gets_no_answer(self, caplog: Any) -> None:
        # HttpPutResponseHopLimit 1: the token PUT's answer dies on its way into the pod, the
        # tokenless GET's 401 does not. Detecting "no cloud" here would run without spot notices.
        nothing = closed_port_url()
        with ImdsEmulator(put_hop_limit_exceeded=True) as imds:
            assert detect_cloud(aws_url=imds.url, gcp_url=nothing, azure_url=nothing, env={}) is Cloud.AWS
            source = AwsImdsSource(imds.url, interval=FAST, timeout=0.2)
            warns_until(source, caplog, lambda: "HttpPutResponseHopLimit" in caplog.text, "the hop-limit warning")

    def test_behind_hop_limit_one_with_imdsv2_required_the_warning_says_what_is_still_heard_and_the_fix(
        self, caplog: Any
    ) -> None:
        # Before, it said only "check the instance's HttpPutResponseHopLimit": not how, nor that
        # the pod then hears a spot interruption only as a SIGTERM.
        with ImdsEmulator(put_hop_limit_exceeded=True) as imds:
            source = AwsImdsSource(imds.url, interval=FAST, timeout=0.2)
            warns_until(source, caplog, lambda: "HttpPutResponseHopLimit" in caplog.text, "the hop-limit warning")
        assert "--http-put-response-hop-limit 2" in caplog.text and "EC2NodeClass" in caplog.text
        assert "only as SIGTERM" in caplog.text

    def test_an_imds_that_answers_nothing_is_not_blamed_on_the_hop_limit(self, caplog: Any) -> None:
        # A firewalled metadata endpoint answers neither the PUT nor the GET: before, the warning
        # named the hop limit, which was not the cause.
        with socket.socket() as silent:
            silent.bind(("127.0.0.1", 0))
            silent.listen(16)  # connections complete in the backlog; nothing is ever read or answered
            url = f"http://127.0.0.1:{silent.getsockname()[1]}"
            source = AwsImdsSource(url, interval=FAST, timeout=0.2)
            warns_until(source, caplog, lambda: "aws notices" in caplog.text, "the AWS source's warning")
        assert "HttpPutResponseHopLimit" not in caplog.text
        assert "blocked from here" in caplog.text and "only as SIGTERM" in caplog.text

    def test_an_imds_turned_off_is_named_as_such(self, caplog: Any) -> None:
        # AWS answers every request 403 where the instance's HttpEndpoint is disabled: before, the
        # warning said only "IMDSv2 token request answered 403".
        with ImdsEmulator(http_endpoint="disabled") as imds:
            source = AwsImdsSource(imds.url, interval=FAST)
            warns_until(source, caplog, lambda: "aws notices" in caplog.text, "the AWS source's warning")
        assert "turned off" in caplog.text and "--http-endpoint enabled" in caplog.text

    def test_aws_with_imdsv1_allowed_is_recognised_when_the_token_put_gets_no_answer(self) -> None:
        # HttpTokens optional and hop limit 1: the tokenless GET is answered 200 (not 401), the
        # token PUT never. Before, the node counted as off-cloud, and the AWS source, if forced,
        # failed every poll, so a spot interruption reached nobody.
        nothing = closed_port_url()
        with ImdsEmulator(put_hop_limit_exceeded=True, http_tokens="optional") as imds:
            assert detect_cloud(aws_url=imds.url, gcp_url=nothing, azure_url=nothing, env={}) is Cloud.AWS

    def test_an_ec2_compatible_metadata_service_that_refuses_the_token_put_is_not_aws(self) -> None:
        # OpenStack's metadata service (and other EC2-compatible ones) answers a tokenless
        # /latest/meta-data/ with a listing that names instance-id, as AWS with IMDSv1 allowed
        # does, but answers the token PUT with an error: every AWS instance grants tokens. Taken
        # for AWS, the node would run an AWS source that fails every poll.
        class Ec2Compatible(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                self._answer(200, b"ami-id\ninstance-id\nlocal-ipv4\n" if self.path == "/latest/meta-data/" else b"")

            def do_PUT(self) -> None:
                self._answer(405, b"Method Not Allowed")

            def _answer(self, status: int, body: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        server = ThreadingHTTPServer(("127.0.0.1", 0), Ec2Compatible)
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        try:
            nothing = closed_port_url()
            url = f"http://127.0.0.1:{server.server_address[1]}"
            assert detect_cloud(aws_url=url, gcp_url=nothing, azure_url=nothing, env={}) is Cloud.NONE
        finally:
            server.shutdown()
            server.server_close()
        # AWS with IMDSv1 allowed and the token PUT answered is still AWS.
        with ImdsEmulator(http_tokens="optional") as imds:
            assert detect_cloud(aws_url=imds.url, gcp_url=nothing, azure_url=nothing, env={}) is Cloud.AWS

    def test_the_aws_source_reads_without_a_token_where_imdsv1_is_allowed_and_the_token_put_gets_no_answer(
        self, caplog: Any
    ) -> None:
        with ImdsEmulator(put_hop_limit_exceeded=True, http_tokens="optional") as imds:
            with caplog.at_level("WARNING"):
                source, got = running(AwsImdsSource(imds.url, interval=FAST, timeout=0.2))
                try:
                    imds.set_spot_action("terminate", AT_2030)
                    notice = got.next()
                    assert (notice.kind, notice.deadline) == (NoticeKind.PREEMPTION, AT_2030.timestamp())
                    polls = imds.count("GET", INSTANCE_ACTION)
                    wait_until(lambda: imds.count("GET", INSTANCE_ACTION) >= polls + 3, "three more polls")
                    # One tokenless listing read, when the token PUT went unanswered, and no other:
                    # the PUT is not tried again at every poll.
                    assert imds.count("GET", "/latest/meta-data/") == 1
                    assert caplog.text.count("allows IMDSv1") == 1
                    # IMDSv2 made required later: the tokenless read gets 401, and a token is asked for.
                    imds.put_hop_limit_exceeded = False
                    imds.http_tokens = "required"
                    imds.clear()
                    wait_until(lambda: imds.token_requests >= 1, "a token once IMDSv2 is required")
                    imds.set_spot_action("stop", AT_2030)
                    assert "stop" in got.next().detail
                finally:
                    source.stop()
            assert "IMDSv2 now required" in caplog.text


# -- what a notice does in the agent ---------------------------------------------------------------


def agent(tmp_path: Path, **config: object) -> Agent:
    cfg = AgentConfig.model_validate({"command": ["true"], "checkpoint_uri": "file:///ckpt", **config})
    return Agent(cfg, ControlDir(str(tmp_path)), env={})


def rebalance() -> Notice:
    return Notice(source="aws", kind=NoticeKind.REBALANCE, deadline=None, detail="rebalance recommendation")


class TestRebalancePolicy:
    def test_save_early_asks_the_ranks_for_a_checkpoint_without_stopping(self, tmp_path: Path) -> None:
        a = agent(tmp_path, rebalance="save-early")
        a.on_notice(rebalance())
        assert a.control.save_requested() and not a.control.flush_requested()

    def test_ignore_does_nothing(self, tmp_path: Path) -> None:
        a = agent(tmp_path, rebalance="ignore")
        a.on_notice(rebalance())
        assert not a.control.save_requested() and not a.control.flush_requested()

    def test_flush_treats_it_as_a_preemption(self, tmp_path: Path) -> None:
        a = agent(tmp_path, rebalance="flush")
        a.on_notice(rebalance())
        assert a.control.flush_requested() and not a.control.save_requested()


class TestFlushOnNotice:
    def test_the_first_notice_writes_flush_json_once_and_later_ones_do_not(self, tmp_path: Path) -> None:
        a = agent(tmp_path)
        a.on_notice(Notice(source="signal", kind=NoticeKind.TERMINATE, deadline=time.time() + 30, detail="SIGTERM"))
        first = a.control.flush_request()
        a.on_notice(Notice(source="signal", kind=NoticeKind.TERMINATE, deadline=time.time() + 30, detail="SIGTERM"))
        a.on_notice(Notice(source="aws", kind=NoticeKind.PREEMPTION, deadline=time.time() + 5, detail="terminate"))
        assert first is not None and a.control.flush_request() == first
        assert first.reason.startswith("signal terminate")
        status = a.status()
        assert status.state == "flushing" and status.flush is not None and status.flush.id == first.id
        # The earlier deadline counts for the agent's own kill time and /status.
        assert status.deadline is not None and first.deadline is not None and status.deadline < first.deadline


class Handled(Collector):
    """The agent's own callback, then the notice queued: ``next()`` returns once the agent took it."""

    def __init__(self, agent: Agent) -> None:
        super().__init__()
        self.agent = agent

    def __call__(self, notice: Notice) -> None:
        self.agent.on_notice(notice)
        super().__call__(notice)


class TestAssumedDeadlinesAreNotHeld:
    """A cloud notice whose deadline the cloud did not tell (``Notice.deadline_assumed``) flushes at
    once whatever ``--flush-lead`` is: the node may go sooner than the guess. ``spotjob run`` gives
    its agents ``--flush-lead 10``, shorter than every guess, which is how these were found."""

    def test_an_azure_event_already_started_when_the_agent_starts_flushes_at_once(
        self, tmp_path: Path, azure: AzureScheduledEventsEmulator, caplog: Any
    ) -> None:
        """Someone acknowledged the Reboot before this agent started: ``Started``, ``NotBefore``
        empty, the VM goes within seconds. Before, the source made the deadline now + 30 s and the
        agent held it for 20 s of training."""
        a = agent(tmp_path, flush_lead=10)
        event_id = azure.add_event(EventType="Reboot", NotBefore="", EventStatus="Started")
        got = Handled(a)
        source = AzureScheduledEventsSource(azure.url, interval=FAST)
        with caplog.at_level("WARNING", logger="agent.launcher"):
            source.start(got)
            try:
                notice = got.next()
            finally:
                source.stop()
        assert a._flush is not None and a.control.flush_request() is not None
        assert a.status().held_notice is None
        assert notice.event_id == event_id and notice.deadline_assumed
        assert "NotBefore empty: 30 s assumed" in notice.detail
        assert "the cloud did not say when the node goes" in caplog.text and "the flush starts now" in caplog.text

    def test_a_held_azure_event_that_someone_starts_flushes_at_once(
        self, tmp_path: Path, azure: AzureScheduledEventsEmulator
    ) -> None:
        """A Reboot 15 minutes ahead is held; another agent (or a user) acknowledges it: ``Started``,
        ``NotBefore`` empty. Before, the agent heard it again with the made-up deadline now + 30 s,
        and held that too, 20 s of the few seconds the VM had left."""
        a = agent(tmp_path, flush_lead=10)
        got = Handled(a)
        source = AzureScheduledEventsSource(azure.url, interval=FAST)
        source.start(got)
        try:
            event_id = azure.add_event(EventType="Reboot", NotBefore=time.time() + 900)
            assert not got.next().deadline_assumed
            assert a._flush is None and a.status().held_notice is not None
            ack = json.dumps({"StartRequests": [{"EventId": event_id}]}).encode()
            headers = {"Metadata": "true", "Content-Type": "application/json"}
            assert http(azure.url + AZURE_EVENTS, "POST", headers, ack)[0] == 200
            started = got.next()
            assert a._flush is not None and a.status().held_notice is None
            assert started.event_id == event_id and started.deadline_assumed and "(Started;" in started.detail
        finally:
            source.stop()

    @pytest.mark.parametrize("notice_seconds", [60, 3600])
    def test_a_gce_maintenance_already_set_without_a_record_flushes_at_once(
        self, tmp_path: Path, gce: GceMetadataEmulator, notice_seconds: int, caplog: Any
    ) -> None:
        """maintenance-event was TERMINATE_ON_HOST_MAINTENANCE before the agent started, and no
        agent on the machine recorded when it changed: how much of the notice is left is unknown
        (60 s assumed, whatever the machine). Before, that guess was held like GCE's own 60 s
        or hour: with --flush-lead 10 the flush waited 50 s of a notice that may have run out."""
        gce.set_maintenance_event("TERMINATE_ON_HOST_MAINTENANCE")
        a = agent(tmp_path, flush_lead=10)
        got = Handled(a)
        source = GceMetadataSource(gce.url, interval=FAST, maintenance_notice_seconds=notice_seconds)
        with caplog.at_level("WARNING", logger="agent.launcher"):
            source.start(got)
            try:
                notice = got.next()
            finally:
                source.stop()
        assert a._flush is not None and a.control.flush_request() is not None
        assert a.status().held_notice is None
        assert notice.kind is NoticeKind.MAINTENANCE and notice.deadline_assumed
        assert notice.deadline is not None and notice.deadline <= time.time() + 60
        assert "60 s assumed" in notice.detail
        assert "the cloud did not say when the node goes" in caplog.text and "the flush starts now" in caplog.text

    def test_a_gce_maintenance_an_earlier_agent_dated_is_held_as_it_was(
        self, tmp_path: Path, gce: GceMetadataEmulator
    ) -> None:
        """Pins the bound of the above: a restart that finds the record of an earlier agent's
        sight knows the deadline (told, not assumed) and holds it as the first agent did."""
        first = agent_saw_maintenance_start(gce)
        a = agent(tmp_path, flush_lead=10)
        got = Handled(a)
        source = GceMetadataSource(gce.url, interval=FAST, maintenance_notice_seconds=3600)
        source.start(got)
        try:
            notice = got.next()
        finally:
            source.stop()
        assert notice.deadline == first.deadline and not notice.deadline_assumed
        assert a._flush is None and a.status().held_notice is not None


# -- a notice is marked as heard only once it was delivered --------------------------------------------


class FailsFirst(Collector):
    """A callback that raises on its first ``failures`` calls (the agent's disk was full, say)."""

    def __init__(self, failures: int = 1) -> None:
        super().__init__()
        self.failures = failures
        self.calls = 0
        self.refused: list[Notice] = []

    def __call__(self, notice: Notice) -> None:
        self.calls += 1
        if self.calls <= self.failures:
            self.refused.append(notice)
            raise OSError("No space left on device")
        super().__call__(notice)


class TestDeliverThenMark:
    def test_aws_delivers_again_at_the_next_poll(self, imds: ImdsEmulator) -> None:
        got = FailsFirst()
        source = AwsImdsSource(imds.url, interval=FAST)
        source.start(got)
        try:
            imds.set_spot_action("terminate", AT_2030)
            notice = got.next()
            assert notice.kind is NoticeKind.PREEMPTION and got.calls == 2
            polls = imds.count("GET", INSTANCE_ACTION)
            wait_until(lambda: imds.count("GET", INSTANCE_ACTION) >= polls + 3, "three more polls")
            assert got.notices.empty() and got.calls == 2  # delivered once, then never again
        finally:
            source.stop()

    def test_gcp_delivers_again_at_the_next_poll(self, gce: GceMetadataEmulator) -> None:
        got = FailsFirst()
        source = GceMetadataSource(gce.url, interval=FAST)
        source.start(got)
        try:
            assert gce.wait_for_waiters(2)
            gce.set_preempted(True)
            notice = got.next()
            assert notice.kind is NoticeKind.PREEMPTION and got.calls == 2
        finally:
            source.stop()

    def test_azure_delivers_again_at_the_next_poll_and_acknowledges_once(
        self, azure: AzureScheduledEventsEmulator
    ) -> None:
        got = FailsFirst()
        source = AzureScheduledEventsSource(azure.url, interval=FAST)
        source.start(got)
        try:
            event_id = azure.add_event(EventType="Preempt", NotBefore=AT_2030)
            notice = got.next()
            assert notice.event_id == event_id and got.calls == 2
            source.flush_finished()
            assert azure.wait_for_start_request(event_id)
            assert azure.start_requests == [event_id]
        finally:
            source.stop()

    def test_a_deadline_counted_from_when_the_event_was_seen_is_not_moved_by_a_retry(
        self, gce: GceMetadataEmulator, imds: ImdsEmulator, azure: AzureScheduledEventsEmulator
    ) -> None:
        """GCE's preempted=TRUE (30 s from the flip), an unreadable AWS instance-action (AWS's two
        minutes) and an Azure event without NotBefore (its 30 s minimum): each deadline counts from
        when the event was first seen. A failed delivery retried at the next poll carries that same
        deadline, not one counted again from the retry: the node goes when it goes."""
        gce.set_preempted(True)
        imds.set_spot_action("terminate", "not a time")
        azure.add_event(EventType="Preempt", NotBefore="")
        sources = [
            GceMetadataSource(gce.url, interval=FAST, watch_maintenance=False),
            AwsImdsSource(imds.url, interval=FAST, watch_rebalance=False),
            AzureScheduledEventsSource(azure.url, interval=FAST),
        ]
        for source in sources:
            got = FailsFirst(failures=2)
            source.start(got)
            try:
                notice = got.next()
            finally:
                source.stop()
            assert got.calls == 3 and len(got.refused) == 2, source.name
            assert [n.deadline for n in got.refused] == [notice.deadline] * 2, source.name

    def test_a_signal_is_delivered_again_after_a_failed_delivery(self) -> None:
        got = FailsFirst()
        source = SignalSource(grace_seconds=17, retry_seconds=FAST)
        source.start(got)
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            notice = got.next()
            assert "SIGTERM" in notice.detail and got.calls == 2
        finally:
            source.stop()
