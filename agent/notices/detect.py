"""Which cloud is this node on? One short probe of each metadata endpoint, all at once.

All three clouds serve metadata on a link-local address, but each answers only its own dialect:
AWS answers a tokenless ``GET /latest/meta-data/`` with 401 where IMDSv2 is required, and issues an
IMDSv2 token for a ``PUT /latest/api/token``. The GET comes first: in a container on an instance
whose ``HttpPutResponseHopLimit`` is 1 the token PUT's answer never arrives, but the GET's does,
so the node is still known as AWS and the AWS source's warning names the hop limit, instead of
the agent quietly running without spot notices. Where the instance still allows IMDSv1, the same
GET is answered 200 with the metadata listing (``instance-id`` among its lines): AWS too when the
token PUT then gets no answer (the source then reads without a token) or a token; not when the PUT
is answered an error, as EC2-compatible services (OpenStack's) answer it. GCE answers ``/computeMetadata/v1/``
with a ``Metadata-Flavor: Google`` response header; Azure answers ``/metadata/instance`` with
``Metadata: true`` and a JSON document. Off-cloud the probes fail or time out, so each request
gets at most ``timeout`` (0.3 s) and the probes run in parallel: start-up pays 0.3 s at worst off
AWS, and 0.6 s where AWS's GET is answered and its token PUT is not.

``SPOTJOB_CLOUD=aws|gcp|azure|none`` skips probing (``auto`` or unset probes) (tests, air-gapped nodes, an emulator).
"""

from __future__ import annotations

import enum
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping

from agent.notices import aws, azure, gcp
from agent.notices.base import HttpClient

log = logging.getLogger(__name__)

ENV_CLOUD = "SPOTJOB_CLOUD"
PROBE_TIMEOUT = 0.3


class Cloud(enum.StrEnum):
    AWS = "aws"
    GCP = "gcp"
    AZURE = "azure"
    NONE = "none"


def _probe_aws(base_url: str, timeout: float) -> bool:
    client = HttpClient(base_url)
    give_up = time.monotonic() + timeout
    resp = client.request("GET", aws.META_DATA_PATH, timeout=timeout)
    if resp.status == 401:  # IMDSv2 required: only AWS answers a tokenless read so
        return True
    # IMDSv1 still allowed: the listing names instance-id. EC2-compatible services (OpenStack's)
    # answer so too, but answer the token PUT with an error, which every AWS instance grants; so
    # the listing decides only where the PUT gets no answer (the hop limit in a container).
    listing = resp.status == 200 and "instance-id" in resp.text().split()
    # Then within the GET's time: the PUT's answer that never comes must not outlast detect_cloud's bound.
    put_timeout = max(give_up - time.monotonic(), 0.05) if listing else timeout
    try:
        resp = client.request("PUT", aws.TOKEN_PATH, headers={aws.TOKEN_TTL_HEADER: "60"}, timeout=put_timeout)
    except TimeoutError:
        if listing:
            return True
        raise
    return resp.status == 200 and bool(resp.body.strip())


def _probe_gcp(base_url: str, timeout: float) -> bool:
    resp = HttpClient(base_url).request("GET", "/computeMetadata/v1/", headers=gcp.FLAVOR_HEADERS, timeout=timeout)
    return resp.status == 200 and resp.headers.get("metadata-flavor") == "Google"


def _probe_azure(base_url: str, timeout: float) -> bool:
    resp = HttpClient(base_url).request(
        "GET", "/metadata/instance?api-version=2021-02-01", headers=azure.METADATA_HEADERS, timeout=timeout
    )
    if resp.status != 200:
        return False
    try:
        return isinstance(json.loads(resp.body).get("compute"), dict)
    except (ValueError, AttributeError):
        return False


def detect_cloud(
    *,
    aws_url: str = aws.DEFAULT_BASE_URL,
    gcp_url: str = gcp.DEFAULT_BASE_URL,
    azure_url: str = azure.DEFAULT_BASE_URL,
    timeout: float = PROBE_TIMEOUT,
    env: Mapping[str, str] | None = None,
) -> Cloud:
    """The cloud from ``SPOTJOB_CLOUD`` if set, else the first endpoint that answers (AWS, GCP, Azure)."""
    env = os.environ if env is None else env
    forced = env.get(ENV_CLOUD, "").strip().lower()
    if forced and forced != "auto":
        try:
            return Cloud(forced)
        except ValueError:
            raise ValueError(f"{ENV_CLOUD}={forced!r}: expected one of {', '.join(c.value for c in Cloud)}") from None

    probes: dict[Cloud, tuple[Callable[[str, float], bool], str]] = {
        Cloud.AWS: (_probe_aws, aws_url),
        Cloud.GCP: (_probe_gcp, gcp_url),
        Cloud.AZURE: (_probe_azure, azure_url),
    }
    answered: dict[Cloud, bool] = {}

    def run(cloud: Cloud, probe: Callable[[str, float], bool], url: str) -> None:
        try:
            answered[cloud] = probe(url, timeout)
        except (OSError, ValueError) as e:
            log.debug("%s metadata probe at %s: %s", cloud.value, url, e)
            answered[cloud] = False

    threads = [
        threading.Thread(target=run, args=(cloud, probe, url), name=f"spotjob-probe-{cloud.value}", daemon=True)
        for cloud, (probe, url) in probes.items()
    ]
    for t in threads:
        t.start()
    # A socket timeout bounds each exchange but not a slow DNS lookup or a trickling server:
    # one shared bound for all, and a probe still running then counts as no answer.
    give_up = time.monotonic() + timeout + 0.2
    for t in threads:
        t.join(timeout=max(0.0, give_up - time.monotonic()))
    for cloud in probes:
        if answered.get(cloud):
            log.info("detected cloud: %s", cloud.value)
            return cloud
    log.info("no cloud metadata endpoint answered within %.1f s: not on AWS, GCP or Azure", timeout)
    return Cloud.NONE
