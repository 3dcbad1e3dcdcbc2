"""AWS EC2 spot notices from the instance metadata service (IMDSv2; IMDSv1 where allowed).

Every poll: (1) a session token — ``PUT /latest/api/token`` with
``X-aws-ec2-metadata-token-ttl-seconds``, reused until shortly before it expires and renewed at
once on a 401; (2) ``GET /latest/meta-data/spot/instance-action`` with
``X-aws-ec2-metadata-token`` → 404 while nothing is scheduled, else ``{"action": "terminate" |
"stop" | "hibernate", "time": "2024-05-01T12:00:00Z"}``, about two minutes ahead; (3) optionally
``GET /latest/meta-data/events/recommendations/rebalance`` → ``{"noticeTime": ...}``, a soft
signal that comes earlier than the instance-action, if it comes at all.

In a container the token PUT needs the instance's ``HttpPutResponseHopLimit`` ≥ 2, otherwise it
times out. Where the instance still allows IMDSv1 (``HttpTokens: optional``) the source then reads
without a token, as the AWS SDKs do, and says so once; a tokenless read answered 401 later (IMDSv2
made required) sends it back to tokens. Where IMDSv1 is not allowed the warning names the hop
limit, how to raise it, and that only SIGTERM and the controller are heard until then; where the
read gets no answer either, it says IMDS is blocked instead. An IMDS turned off (``HttpEndpoint``
disabled) answers 403, and the warning says that.
"""

from __future__ import annotations

import json
import logging
import time
from datetime import UTC, datetime

from agent.notices.base import HttpClient, HttpResponse, Notice, NoticeKind, PollingNoticeSource, SourceError

log = logging.getLogger(__name__)

DEFAULT_BASE_URL = "http://169.254.169.254"
TOKEN_PATH = "/latest/api/token"
META_DATA_PATH = "/latest/meta-data/"
INSTANCE_ACTION_PATH = "/latest/meta-data/spot/instance-action"
REBALANCE_PATH = "/latest/meta-data/events/recommendations/rebalance"
TOKEN_TTL_HEADER = "X-aws-ec2-metadata-token-ttl-seconds"
TOKEN_HEADER = "X-aws-ec2-metadata-token"

SPOT_WARNING_SECONDS = 120.0
"""AWS's documented lead time; the deadline when an instance-action's ``time`` cannot be read."""


def parse_aws_time(value: str) -> float:
    """``2024-05-01T12:00:00Z`` → unix time (IMDS times are UTC; a value without a zone is too)."""
    dt = datetime.fromisoformat(value.strip())
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=UTC)
    return dt.timestamp()


class AwsImdsSource(PollingNoticeSource):
    """Spot instance-action (and, if asked, rebalance recommendations) from IMDS."""

    name = "aws"

    def __init__(
        self,
        base_url: str = DEFAULT_BASE_URL,
        *,
        interval: float = 2.0,
        watch_rebalance: bool = True,
        token_ttl_seconds: int = 21600,
        timeout: float = 2.0,
    ) -> None:
        super().__init__(HttpClient(base_url), interval)
        self.watch_rebalance = watch_rebalance
        self.token_ttl_seconds = token_ttl_seconds
        self.timeout = timeout
        self._token: str | None = None
        self._token_expires = 0.0
        self._tokenless = False  # IMDSv1 reads, after a token PUT that got no answer

    # -- token ---------------------------------------------------------------------------------
    def _get_token(self, renew: bool = False) -> str | None:
        """A live IMDSv2 token; ``None`` once the token PUT went unanswered on an IMDSv1 instance."""
        # Renew a minute early so a poll never races the token's expiry.
        if not renew and self._token is not None and time.monotonic() < self._token_expires - 60:
            return self._token
        try:
            resp = self.client.request(
                "PUT",
                TOKEN_PATH,
                headers={TOKEN_TTL_HEADER: str(self.token_ttl_seconds)},
                timeout=self.timeout,
            )
        except TimeoutError as e:
            read = self._imdsv1_answers()
            if read is True:
                return None
            if read is None:
                raise SourceError(
                    f"IMDS answered neither the IMDSv2 token request ({e}) nor a read: is it blocked from here "
                    "(a NetworkPolicy, a firewall)? Until it answers, this agent hears a spot interruption only as "
                    "SIGTERM (a node drain) and from the controller"
                ) from e
            raise SourceError(
                f"IMDSv2 token request got no answer ({e}) while reads are answered 401 (IMDSv2 required): in a "
                "container this is the instance's HttpPutResponseHopLimit of 1. Until it is 2 or more (the launch "
                "template's or Karpenter EC2NodeClass's metadataOptions, or `aws ec2 modify-instance-metadata-options "
                "--http-put-response-hop-limit 2`), this agent hears a spot interruption only as SIGTERM (a node "
                "drain) and from the controller"
            ) from e
        if resp.status == 403:
            raise SourceError(
                "IMDSv2 token request answered 403: the instance's metadata service is turned off (HttpEndpoint "
                "disabled; `aws ec2 modify-instance-metadata-options --http-endpoint enabled` turns it on). Until "
                "then this agent hears a spot interruption only as SIGTERM (a node drain) and from the controller"
            )
        if resp.status != 200 or not resp.body:
            raise SourceError(f"IMDSv2 token request answered {resp.status}")
        self._token = resp.text().strip()
        self._token_expires = time.monotonic() + self.token_ttl_seconds
        log.debug("IMDSv2 token %s", "renewed" if renew else "obtained")
        return self._token

    def _imdsv1_answers(self) -> bool | None:
        """After a token PUT that timed out: does this instance answer reads without a token? None:
        the read got no answer either (IMDS blocked, not the hop limit)."""
        try:
            resp = self.client.request("GET", META_DATA_PATH, timeout=self.timeout)
        except (OSError, ValueError):
            return None
        if resp.status != 200:
            return False
        log.warning(
            "IMDSv2 token request got no answer (in a container, the instance's HttpPutResponseHopLimit "
            "needs 2 or more); this instance allows IMDSv1, so spot notices are read without a token"
        )
        self._tokenless = True
        return True

    def _get(self, path: str) -> tuple[int, str]:
        token = None if self._tokenless else self._get_token()
        resp = self._read(path, token)
        if resp.status == 401:
            if token is None:
                log.warning("IMDS answered a read without a token 401 (IMDSv2 now required): asking for a token")
                self._tokenless = False
            # Expired or revoked (IMDS restarted, instance stopped/started): renew once and retry.
            token = self._get_token(renew=True)
            if token is None:
                raise SourceError(f"GET {self.client.url(path)} answered 401 without a token, and no token came")
            resp = self._read(path, token)
        if resp.status not in (200, 404):
            raise SourceError(f"GET {self.client.url(path)} answered {resp.status}")
        return resp.status, resp.text()

    def _read(self, path: str, token: str | None) -> HttpResponse:
        headers = {} if token is None else {TOKEN_HEADER: token}
        return self.client.request("GET", path, headers=headers, timeout=self.timeout)

    # -- poll ----------------------------------------------------------------------------------
    def _poll(self) -> None:
        # Both documents stay served until the instance goes (a rebalance recommendation for
        # hours): one already delivered is not read again, so an unreadable one is warned about
        # once, not at every poll.
        status, body = self._get(INSTANCE_ACTION_PATH)
        key = "instance-action:" + body
        if status == 200 and key not in self._seen:
            self._emit(key, self._instance_action_notice(body, self._seen_since(key)))
        if self.watch_rebalance and not self.stopping:
            status, body = self._get(REBALANCE_PATH)
            key = "rebalance:" + body
            if status != 200:
                self._forget("rebalance:")
            elif key not in self._seen:
                self._emit(key, self._rebalance_notice(body))

    def _instance_action_notice(self, body: str, seen_at: float) -> Notice:
        # The presence of an instance-action is the notice; a body we cannot read still means the
        # instance is going, so it becomes a notice with AWS's documented two minutes.
        action, when = "unknown", None
        try:
            data = json.loads(body)
            action = str(data.get("action", "unknown"))
            when = parse_aws_time(str(data["time"]))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            log.warning("unreadable spot instance-action %r (%s): assuming %.0f s", body, e, SPOT_WARNING_SECONDS)
        deadline = when if when is not None else seen_at + SPOT_WARNING_SECONDS
        return Notice(
            source=self.name,
            kind=NoticeKind.PREEMPTION,
            deadline=deadline,
            detail=f"spot instance-action {action}",
        )

    def _rebalance_notice(self, body: str) -> Notice:
        notice_time = "unknown"
        try:
            notice_time = str(json.loads(body).get("noticeTime", "unknown"))
        except (ValueError, AttributeError):
            log.warning("unreadable rebalance recommendation %r", body)
        return Notice(
            source=self.name,
            kind=NoticeKind.REBALANCE,
            deadline=None,
            detail=f"rebalance recommendation (noticeTime {notice_time})",
        )
