"""What a restart fetches on each node, counted at the store: two nodes of two ranks each.

A 4-rank FSDP2 job (real torchrun ranks, CPU, gloo; ``scripts/ckpt_fsdp.py``) saves with Adam
(first on a filesystem, to see where DCP puts the values every rank reads), then to moto's S3.
Then it restarts as a 2-node job on this machine: two ``spotjob-agent`` processes, each running
``torchrun --nnodes 2 --node-rank N --nproc-per-node 2`` with a staging folder of its own (each
node's disk), and each talking to the store through a recording proxy of its own
(``tests/faults.py``), so the requests of one node (its agent's prefetch and its ranks' restore)
are told from the other's. Not modelled: a network between the nodes (both are on loopback).
"""

from __future__ import annotations

import sys
import uuid
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from agent.manifest import MANIFEST_NAME, Manifest
from agent.ranks import free_port

sys.path.insert(0, str(Path(__file__).resolve().parent / "scripts"))
import ckpt_harness as harness

try:
    from faults import FaultProxy
except ImportError:  # tests/ collected as a package
    from tests.faults import FaultProxy

pytestmark = pytest.mark.slow

AGENT = str(Path(sys.executable).with_name("spotjob-agent"))
FSDP = harness.SCRIPTS / "ckpt_fsdp.py"
JOB = "team/fsdp"


@pytest.fixture(scope="module")
def saves(tmp_path_factory: pytest.TempPathFactory, s3_client: Any, moto_server: str) -> tuple[Path, str]:
    """Three 4-rank saves of step 2, in one torchrun (each case its own model, optimizer and
    Checkpointer; starting the ranks is most of what each costs): ``fsdp/ckpt`` (FSDP2 on a mesh
    of every rank) and ``hsdp/ckpt`` (``--hsdp``) on a filesystem, and FSDP2 again on moto's S3,
    as job ``JOB``. Each is read by one test only; (the filesystem saves' root, the S3 URI)."""
    root = tmp_path_factory.mktemp("prefetch")
    bucket = f"spotjob-prefetch-{uuid.uuid4().hex[:8]}"
    s3_client.create_bucket(Bucket=bucket)
    s3_uri = f"s3://{bucket}/jobs/run1"
    steps = ("--save-at", "2", "--steps", "2")
    harness.torchrun(
        4,
        FSDP,
        *("--dump", str(root / "fsdp-saved"), "--uri", str(root / "fsdp" / "ckpt"), *steps),
        *("--then", "--hsdp", "--dump", str(root / "hsdp-saved"), "--uri", str(root / "hsdp" / "ckpt"), *steps),
        *("--then", "--dump", str(root / "s3-saved"), "--uri", s3_uri, *steps),
        env=harness.job_env(AWS_ENDPOINT_URL=moto_server, SPOTJOB_JOB_NAME=JOB),
    )
    return root, s3_uri


def test_an_fsdp_states_replicated_scalars_are_all_in_rank_0s_file(saves: tuple[Path, str]) -> None:
    """Adam's ``step`` counter of each parameter is a tensor every rank holds alike, which DCP
    keeps once. Before the fix it went to whichever rank had written least so far, a different
    rank's file for each parameter (ranks 1, 2 and 3 here), so every rank's restore read nearly
    every rank's file. Now such scalars are written from rank 0, beside its shards."""
    uri = str(saves[0] / "fsdp" / "ckpt")
    (manifest_path,) = Path(uri).glob(f"step-*/{MANIFEST_NAME}")
    manifest = Manifest.parse(manifest_path.read_bytes())
    whole = {name: t.files for name, t in manifest.tensors.items() if len(t.files) == 1}
    assert any(name.endswith(".step") for name in whole), whole
    assert {f for files in whole.values() for f in files} == {"__0_0.distcp"}, whole


def test_each_node_prefetches_every_file_its_hsdp_ranks_read(saves: tuple[Path, str]) -> None:
    """HSDP on 2 nodes of 2 ranks (FSDP2 on a (2, 2) mesh: sharded within a node, replicated across
    the nodes): DCP writes each shard from one replica, whole tensors from node 0's ranks and others
    from node 1's, so each node's ranks read every shard file. What each rank reads is taken from
    DCP's ``.metadata`` (the file that holds its shard of each tensor, by the mesh's shard index).
    Before the fix node 1's prefetch left ``__1_0.distcp`` to its ranks' restore: rank 0's file
    counted as one of node 1's own, so the tensors written from ranks 0 and 1 looked read from it."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from agent.dcp_safe import load_dcp_metadata
    from agent.restore_cache import node_files

    uri = str(saves[0] / "hsdp" / "ckpt")
    (manifest_path,) = Path(uri).glob(f"step-*/{MANIFEST_NAME}")
    manifest = Manifest.parse(manifest_path.read_bytes())
    metadata = load_dcp_metadata(manifest_path.with_name(".metadata").read_bytes())
    where = {
        (index.fqn, None if index.offset is None else tuple(index.offset)): info.relative_path
        for index, info in metadata.storage_data.items()
    }
    reads: dict[int, set[str]] = {r: set() for r in range(4)}
    for fqn, md in metadata.state_dict_metadata.items():
        for rank in range(4):
            if isinstance(md, TensorStorageMetadata):
                chunks = sorted(tuple(c.offsets) for c in md.chunks)
                reads[rank].add(where[fqn, chunks[rank % 2 if len(chunks) > 1 else 0]])
            else:
                reads[rank].add(where[fqn, None])
    for node in range(2):
        ranks = range(2 * node, 2 * node + 2)
        fetched = {e.path for e in node_files(manifest, ranks, 4)}
        read = set().union(*(reads[r] for r in ranks))
        assert read <= fetched, f"node {node}'s ranks read {sorted(read - fetched)}, which its prefetch left out"
    assert {"__2_0.distcp", "__3_0.distcp"} & reads[0], "the test needs tensors written from node 1 alone"


def _file_gets(proxy: FaultProxy) -> Counter[str]:
    """Requests for the checkpoint's files (not its manifest, not listings) by file name: a GET
    counts under the name, anything else under ``METHOD name``."""
    got: Counter[str] = Counter()
    for seen in proxy.seen:
        folder, _, name = seen.path.split("?")[0].rpartition("/")
        if folder.rpartition("/")[2].startswith("step-") and name != MANIFEST_NAME and "list-type" not in seen.path:
            got[name if seen.method == "GET" else f"{seen.method} {name}"] += 1
    return got


def _restart_on_two_nodes(uri: str, proxies: list[FaultProxy], tmp_path: Path, *options: str) -> None:
    port = free_port()
    runs = []
    for node, proxy in enumerate(proxies):
        argv = [
            AGENT, "--checkpoint-uri", uri, "--job-name", JOB, "--staging-dir", str(tmp_path / f"node{node}"),
            "--cloud", "none", *options, "--",
            harness.TORCHRUN, "--nproc-per-node", "2", "--nnodes", "2", "--node-rank", str(node),
            "--master-addr", "127.0.0.1", "--master-port", str(port), "--max-restarts", "0",
            str(FSDP), "--dump", str(tmp_path / f"restart{node}"), "--uri", uri, "--restore", "--steps", "2",
        ]  # fmt: skip
        log = tmp_path / f"node{node}.log"
        runs.append((harness.start(argv, log, env=harness.job_env(AWS_ENDPOINT_URL=proxy.url)), log))
    for proc, log in runs:
        assert harness.reap(proc, harness.RUN_TIMEOUT_S) == 0, log.read_text()[-6000:]


def test_each_node_fetches_only_the_files_its_ranks_read(
    saves: tuple[Path, str],
    fault_proxy: Callable[..., FaultProxy],
    moto_server: str,
    tmp_path: Path,
) -> None:
    """Before the fix each node's agent prefetched every file of the checkpoint (9 here: both nodes
    fetched the other node's shards and per-rank state), and DCP had spread the Adam ``step``
    counters over ranks 1-3's files, so node 1's ranks read ``__1_0.distcp`` too. Now a node
    fetches DCP's metadata, rank 0's shard file (the small replicated values), and its own
    ranks' shards and per-rank state: each once, with one GET (no HEAD: each fits one part)."""
    uri = saves[1]
    proxies = [fault_proxy(moto_server, "s3") for _ in range(2)]
    _restart_on_two_nodes(uri, proxies, tmp_path)
    node0, node1 = (_file_gets(p) for p in proxies)
    shared = {".metadata", "__0_0.distcp"}
    own0 = {"__1_0.distcp", "rank-00000.pt", "rank-00001.pt"}
    own1 = {"__2_0.distcp", "__3_0.distcp", "rank-00002.pt", "rank-00003.pt"}
    assert dict(node0) == dict.fromkeys(shared | own0, 1), node0
    assert dict(node1) == dict.fromkeys(shared | own1, 1), node1
