"""How many requests reach the store as the rank count grows: rank 0 decides, the others do not ask.

Real torchrun ranks (CPU, gloo) save, restore and read back through a read-only Checkpointer
(``scripts/ckpt_requests.py``) on moto's S3, behind ``tests/faults.py``'s proxy, which records every
request. The same job at 2 and at 4 ranks must list, read the owner record and read manifests
exactly as often: those are rank 0's to do (and to broadcast). What does grow with the ranks is
inherent: each rank uploads its own shard and per-rank state. The ranks share one staging folder,
as on one node, so each file a restore needs is fetched once (the node's restore cache).

The job runs twice for the module (2 and 4 ranks); the 2-rank run also builds a reader on a store
whose owner record is broken (on a filesystem, so none of its requests reach the proxy), after
the counted job: starting the ranks is most of what a run costs (~7 CPU-seconds for 2).
"""

from __future__ import annotations

import re
import sys
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "scripts"))
import ckpt_harness as harness

try:
    from faults import FaultProxy
except ImportError:  # tests/ collected as a package
    from tests.faults import FaultProxy


Counts = tuple[Counter[str], Counter[str]]


def _requests(proxy: FaultProxy, before: int) -> Counts:
    """(requests by kind, GETs by data file) of what the proxy saw from its ``before``-th request on."""
    kinds: Counter[str] = Counter()
    data: Counter[str] = Counter()
    for seen in proxy.seen[before:]:
        path = seen.path
        if seen.method == "GET" and "list-type=2" in path:
            kinds["LIST"] += 1
        elif path.endswith("/.spotjob/owner.json"):
            kinds[f"{seen.method} owner.json"] += 1
        elif path.endswith("/MANIFEST.json"):
            kinds[f"{seen.method} MANIFEST.json"] += 1
        elif seen.method == "GET" and re.search(r"/step-\d+/", path):
            data[path] += 1
    return kinds, data


@pytest.fixture(scope="module")
def runs(
    moto_server: str, s3_client: Any, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[dict[int, Counts], str]]:
    """(each rank count's requests, the 2-rank run's stdout): the job at 2 and at 4 ranks, each on a
    fresh bucket through one proxy, the 2-rank run with ``--reader`` on a store whose owner record
    is not JSON."""
    tmp = tmp_path_factory.mktemp("requests")
    broken = tmp / "broken"
    (broken / ".spotjob").mkdir(parents=True)
    (broken / ".spotjob" / "owner.json").write_text("not json")
    counts: dict[int, Counts] = {}
    stdout: dict[int, str] = {}
    with FaultProxy(moto_server, dialect="s3") as proxy:
        for nproc in (2, 4):
            bucket = f"spotjob-{uuid.uuid4().hex[:12]}"
            s3_client.create_bucket(Bucket=bucket)
            before = len(proxy.seen)
            done = harness.torchrun(
                nproc,
                harness.SCRIPTS / "ckpt_requests.py",
                f"s3://{bucket}/jobs/run1",
                str(tmp / f"staging-{nproc}"),
                *(["--reader", str(broken)] if nproc == 2 else []),
                env=harness.job_env(AWS_ENDPOINT_URL=proxy.url),
            )
            counts[nproc] = _requests(proxy, before)
            stdout[nproc] = done.stdout
        yield counts, stdout[2]


def test_listings_and_records_are_read_by_rank_0_alone(runs: tuple[dict[int, Counts], str]) -> None:
    """Before the fix every rank of a read-only Checkpointer read the owner record itself (a HEAD
    and a GET each: 2 per rank); the rest (listings, manifests, the writers' owner checks, one
    fetch per file and node) already held and is pinned here."""
    (at_2, data_2), (at_4, data_4) = runs[0][2], runs[0][4]
    assert at_2["LIST"] > 0 and at_2["GET owner.json"] > 0, at_2
    assert at_4 == at_2, f"requests that grew with the ranks: 2 ranks {dict(at_2)}, 4 ranks {dict(at_4)}"
    for data in (data_2, data_4):
        assert data and max(data.values()) == 1, f"a file fetched more than once on one node: {data}"


def test_a_reader_whose_owner_record_cannot_be_read_fails_on_every_rank(runs: tuple[dict[int, Counts], str]) -> None:
    """Rank 0 reads the owner record for every rank of a read-only Checkpointer: what it raises
    (here ``OwnershipError``, a record that is not JSON) every rank raises, and none waits for it.
    Before the fix each rank read the record itself and raised the same; pinned for the broadcast."""
    stdout = runs[1]
    for rank in (0, 1):
        assert f"rank {rank} raised OwnershipError: " in stdout, stdout
