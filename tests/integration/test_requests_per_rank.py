"""How many requests reach the store as the rank count grows: rank 0 decides, the others do not ask.

Real torchrun ranks (CPU, gloo) save, restore and read back through a read-only Checkpointer
(``scripts/ckpt_requests.py``) on moto's S3, behind ``tests/faults.py``'s proxy, which records every
request. The same job at 2 and at 4 ranks must list, read the owner record and read manifests
exactly as often: those are rank 0's to do (and to broadcast). What does grow with the ranks is
inherent: each rank uploads its own shard and per-rank state. The ranks share one staging folder,
as on one node, so each file a restore needs is fetched once (the node's restore cache).
"""

from __future__ import annotations

import re
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "scripts"))
import ckpt_harness as harness

try:
    from faults import FaultProxy
except ImportError:  # tests/ collected as a package
    from tests.faults import FaultProxy


def _requests(
    nproc: int, fresh_uri: Callable[[str], str], proxy: FaultProxy, tmp_path: Path
) -> tuple[Counter[str], Counter[str]]:
    """(requests by kind, GETs by data file) of one run of the job at ``nproc`` ranks."""
    uri = fresh_uri("s3")
    before = len(proxy.seen)
    harness.torchrun(
        nproc,
        harness.SCRIPTS / "ckpt_requests.py",
        uri,
        str(tmp_path / f"staging-{nproc}"),
        env=harness.job_env(AWS_ENDPOINT_URL=proxy.url),
    )
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


def test_listings_and_records_are_read_by_rank_0_alone(
    fresh_uri: Callable[[str], str],
    fault_proxy: Callable[..., FaultProxy],
    request: pytest.FixtureRequest,
    tmp_path: Path,
) -> None:
    """Before the fix every rank of a read-only Checkpointer read the owner record itself (a HEAD
    and a GET each: 2 per rank); the rest (listings, manifests, the writers' owner checks, one
    fetch per file and node) already held and is pinned here."""
    proxy = fault_proxy(request.getfixturevalue("moto_server"), "s3")
    at_2, data_2 = _requests(2, fresh_uri, proxy, tmp_path)
    at_4, data_4 = _requests(4, fresh_uri, proxy, tmp_path)
    assert at_2["LIST"] > 0 and at_2["GET owner.json"] > 0, at_2
    assert at_4 == at_2, f"requests that grew with the ranks: 2 ranks {dict(at_2)}, 4 ranks {dict(at_4)}"
    for data in (data_2, data_4):
        assert data and max(data.values()) == 1, f"a file fetched more than once on one node: {data}"


def test_a_reader_whose_owner_record_cannot_be_read_fails_on_every_rank(tmp_path: Path) -> None:
    """Rank 0 reads the owner record for every rank of a read-only Checkpointer: what it raises
    (here ``OwnershipError``, a record that is not JSON) every rank raises, and none waits for it.
    Before the fix each rank read the record itself and raised the same; pinned for the broadcast."""
    uri = tmp_path / "ckpt"
    (uri / ".spotjob").mkdir(parents=True)
    (uri / ".spotjob" / "owner.json").write_text("not json")
    done = harness.torchrun(2, harness.SCRIPTS / "ckpt_requests.py", str(uri), str(tmp_path / "staging"), "--reader")
    for rank in (0, 1):
        assert f"rank {rank} raised OwnershipError: " in done.stdout, done.stdout
