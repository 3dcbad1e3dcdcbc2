"""``SPOTJOB_STORAGE_MAX_BUFFER_BYTES`` the way users set it: in the environment of real torchrun
ranks (2, CPU, gloo) whose Checkpointer saves to moto's S3 or fake-gcs-server.

At the smallest budget (1 MiB), with S3 parts of 5 MiB (S3's smallest) or GCS chunks of 2 MiB, a
shard's parts (all but its last, on GCS) are bigger than the whole budget: each goes up alone, one
at a time per rank's store, though 4 parts may be in flight (``CONCURRENCY``), with the small files
waiting their turn between them. A job saves two steps (async on S3, so that step 1's upload runs
while the next step trains; sync on GCS), commits, and a new job restores what it saved bit for bit.
The requests pass through ``tests/faults.py``'s proxy, which arms no fault here: it counts the parts
each shard went up in, so the case cannot pass with shards sent whole. ``test_storage_memory.py``
measures what the budget holds at the storage layer.

The budget is the node's: each of the 2 local ranks (torchrun's ``LOCAL_WORLD_SIZE``) opens its
store with half of it, and the bytes its uploads hold, counted apart from the budget, stay within
that half.

A budget below the smallest (``64``, a size meant with a unit) is refused when the Checkpointer
starts, on every rank, and by spotjob-agent before it starts anything, naming the variable.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from ckpt_compare import assert_same

from agent.catalog import list_checkpoints
from agent.storage import open_storage

sys.path.insert(0, str(Path(__file__).resolve().parent / "scripts"))
import ckpt_harness as harness

try:
    from faults import FaultProxy
except ImportError:  # tests/ collected as a package
    from tests.faults import FaultProxy

pytestmark = pytest.mark.slow

MiB = 1 << 20
SCRIPT = harness.SCRIPTS / "ckpt_budget.py"
BUDGET = {"SPOTJOB_STORAGE_MAX_BUFFER_BYTES": "1MiB", "SPOTJOB_STORAGE_CONCURRENCY": "4"}
PART = {"s3": 5 * MiB, "gs": 2 * MiB}
"""The size each shard goes up in: S3's smallest part; a GCS chunk (a multiple of 256 KiB)."""
SETTINGS = {
    "s3": {"SPOTJOB_STORAGE_UPLOAD_PART_SIZE": "5MiB", "SPOTJOB_STORAGE_MULTIPART_THRESHOLD": "5MiB"},
    "gs": {"SPOTJOB_STORAGE_UPLOAD_CHUNK_SIZE": "2MiB", "SPOTJOB_STORAGE_MULTIPART_THRESHOLD": "2MiB"},
}
SHARD = re.compile(r"/(step-\d+[^?]*\.distcp)")


def parts_sent(scheme: str, proxy: FaultProxy) -> Counter[str]:
    """How many requests carried each upload's parts or chunks: by object name on S3
    (``PUT <key>?partNumber=..&uploadId=..``), by upload session on GCS (``PUT ..&upload_id=..``)."""
    counts: Counter[str] = Counter()
    for seen in proxy.seen:
        if seen.method != "PUT":
            continue
        if scheme == "s3" and "partNumber=" in seen.path:
            counts[seen.path.split("?", 1)[0]] += 1
        elif scheme == "gs" and "upload_id=" in seen.path:
            counts[re.sub(r".*upload_id=([^&]+).*", r"\1", seen.path)] += 1
    return counts


@pytest.fixture(params=["s3", "gs"])
def budget_uri(
    request: pytest.FixtureRequest,
    monkeypatch: pytest.MonkeyPatch,
    fresh_uri: Callable[[str], str],
    fault_proxy: Callable[..., FaultProxy],
) -> tuple[str, str, FaultProxy]:
    """(scheme, uri, proxy): a fresh bucket, its requests counted by a proxy the ranks go through."""
    scheme: str = request.param
    uri = fresh_uri(scheme)
    if scheme == "s3":
        proxy = fault_proxy(request.getfixturevalue("moto_server"), "s3")
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
    else:
        proxy = fault_proxy(request.getfixturevalue("gcs_server"), "gcs")
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", proxy.url)
    return scheme, uri, proxy


MODE = {"s3": "async", "gs": "sync"}
"""The save mode run on each store: the budget is the store's, whichever thread or process uploads,
so each mode runs once, on one store each, and the suite's time goes elsewhere."""


def test_two_ranks_save_and_restore_with_parts_bigger_than_the_upload_budget(
    budget_uri: tuple[str, str, FaultProxy], tmp_path: Path
) -> None:
    scheme, uri, proxy = budget_uri
    mode = MODE[scheme]
    env = harness.job_env(**BUDGET, **SETTINGS[scheme])
    saving, restoring = tmp_path / "saved", tmp_path / "restored"
    harness.torchrun(
        2, SCRIPT, "save", "--uri", uri, "--dump", str(saving), "--async", str(int(mode == "async")), env=env
    )

    storage = open_storage(uri)
    try:
        found = list_checkpoints(storage)
        assert [(c.ref.step, c.valid) for c in found] == [(2, True), (1, True)]
        shards = {o.key: o.size for c in found for o in storage.list(c.ref.folder + "/") if o.key.endswith(".distcp")}
    finally:
        storage.close()
    # Each rank wrote its own shards, each several parts bigger than the budget.
    assert len(shards) >= 4 and all(size > 2 * PART[scheme] for size in shards.values()), shards
    sent = parts_sent(scheme, proxy)
    expected = sorted(math.ceil(size / PART[scheme]) for size in shards.values())
    assert sorted(n for n in sent.values() if n > 1) == expected, (sent, shards)

    harness.torchrun(2, SCRIPT, "restore", "--uri", uri, "--dump", str(restoring), env=env)
    for rank in range(2):
        saved = torch.load(f"{saving}.rank{rank}.pt", weights_only=False)
        assert saved["budget"] == {"max_buffer_bytes": MiB, "concurrency": 4}, "the store the rank opened"
        back = torch.load(f"{restoring}.rank{rank}.pt", weights_only=False)
        assert back["step"] == 2
        assert_same(back["restored"], saved["saved"], f"rank {rank}'s restored state")


def test_each_of_two_local_ranks_holds_at_most_its_half_of_the_node_budget(
    fresh_uri: Callable[[str], str], tmp_path: Path
) -> None:
    """12 MiB for the node, 6 MiB a rank: each rank's shards go up in 5 MiB parts, 4 at a time
    (``CONCURRENCY``), so a rank whose store held the node's whole budget would hold two parts
    (10 MiB) at once; with its share it holds one part and small files beside it."""
    uri = fresh_uri("s3")
    node, share = 12 * MiB, 6 * MiB
    env = harness.job_env(SPOTJOB_STORAGE_MAX_BUFFER_BYTES="12MiB", SPOTJOB_STORAGE_CONCURRENCY="4", **SETTINGS["s3"])
    saving = tmp_path / "saved"
    harness.torchrun(2, SCRIPT, "save", "--uri", uri, "--dump", str(saving), "--async", "1", "--watch", env=env)

    for rank in range(2):
        saved = torch.load(f"{saving}.rank{rank}.pt", weights_only=False)
        assert saved["budget"] == {"max_buffer_bytes": share, "concurrency": 4}, f"rank {rank}'s store, of {node}"
        peak = saved["peak"]
        assert PART["s3"] <= peak <= share, f"rank {rank} held {peak} bytes at once; its share is {share}"


def test_a_budget_below_a_mebibyte_is_refused_when_the_checkpointer_starts(
    fresh_uri: Callable[[str], str], tmp_path: Path
) -> None:
    """The rank refuses it when it opens the store (every rank does; one is enough to show it)."""
    uri = fresh_uri("s3")
    env = harness.job_env(SPOTJOB_STORAGE_MAX_BUFFER_BYTES="64")
    out = harness.torchrun(1, SCRIPT, "open", "--uri", uri, env=env, check=False)
    assert out.returncode != 0
    said = "]: ValueError: SPOTJOB_STORAGE_MAX_BUFFER_BYTES='64' is not a size in bytes from 1MiB to 5TiB"
    assert said in out.stderr, out.stderr[-6000:]
    storage = open_storage(uri)
    try:
        assert list(storage.list("")) == [], "nothing was written"
    finally:
        storage.close()


def test_spotjob_agent_refuses_a_budget_below_a_mebibyte_before_it_starts_anything(tmp_path: Path) -> None:
    started = tmp_path / "started"
    command = [
        str(Path(sys.executable).with_name("spotjob-agent")), "--checkpoint-uri", str(tmp_path / "ckpt"),
        "--cloud", "none", "--launcher", "direct", "--control-dir", str(tmp_path / "control"),
        "--", sys.executable, "-c", f"open({str(started)!r}, 'w').close()",
    ]  # fmt: skip
    env = {**os.environ, "SPOTJOB_STORAGE_MAX_BUFFER_BYTES": "64"}
    out = subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 2, out.stderr
    assert not started.exists()
    assert "SPOTJOB_STORAGE_MAX_BUFFER_BYTES='64' is not a size in bytes from 1MiB to 5TiB" in out.stderr, out.stderr
