"""The agent's prefetch fills the node's restore cache while the ranks start; their restore then
reads what it fetched, verified, without fetching it again.

An object store is modelled at the one seam the restore path branches on: a ``FileStorage``
whose ``local_path`` is None, so every file goes through ``get_file`` and the node's cache (what
S3 and GCS do; their own transfers are covered by test_storage_backends.py). Not modelled: the
network, and the agent process itself (``Agent._prefetch`` only starts ``prefetch`` in a thread).
Turning the prefetch off is counted against moto's S3 behind the recording proxy instead.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import pytest

from agent import launcher, restore_cache
from agent.checkpoint import Checkpointer
from agent.control_channel import ControlDir, RankStatus
from agent.crc32c import crc32c_bytes, to_hex
from agent.launcher import Agent, parse_args
from agent.manifest import FORMAT_VERSION, MANIFEST_NAME, Manifest
from agent.restore_cache import RESTORE_FOLDER, VERIFIED_SUFFIX, fetch_verified, prefetch, staging_root
from agent.storage import CorruptObjectError, PermanentStorageError, open_storage
from agent.storage.file import FileStorage

sys.path.insert(0, str(Path(__file__).resolve().parent / "scripts"))
from ckpt_compare import assert_same
from ckpt_state import make_state, snapshot, train

try:
    from faults import FaultProxy
except ImportError:  # tests/ collected as a package
    from tests.faults import FaultProxy


class ObjectStoreLike(FileStorage):
    """A folder that the restore must treat like a bucket: nothing can be read in place."""

    fetched: list[str]

    def __init__(self, root: str) -> None:
        super().__init__(root)
        self.fetched = []

    def local_path(self, key: str) -> str | None:
        return None

    def get_file(self, key: str, local_path: str, **kw: Any) -> None:
        self.fetched.append(key)
        super().get_file(key, local_path, **kw)


def committed(tmp_path: Path) -> tuple[str, dict[str, Any]]:
    state = make_state(0)
    train(state, 3)
    root = str(tmp_path / "ckpt")
    with Checkpointer(root, keep=None) as ckpt:
        ckpt.save(3, state)
    return root, snapshot(state)


def test_the_restore_reads_the_prefetched_files_without_fetching_them_again(tmp_path: Path) -> None:
    root, saved = committed(tmp_path)
    staging_dir = str(tmp_path / "staging")
    store = ObjectStoreLike(root)
    staging = staging_root(store, None, staging_dir)  # where the agent prefetches for the job
    assert prefetch(store, staging) == "step-000000003"
    cache = Path(staging, RESTORE_FOLDER, "step-000000003")
    names = sorted(p.name for p in cache.iterdir() if not p.name.endswith((".lock", VERIFIED_SUFFIX)))
    assert names == sorted({f.split("/", 1)[1] for f in store.fetched})
    assert all((cache / (n + VERIFIED_SUFFIX)).exists() for n in names)

    fresh = make_state(0, seed=9)
    with Checkpointer(root, staging_dir=staging_dir) as again:
        again.storage = ObjectStoreLike(root)
        assert again.restore(fresh) == 3
        assert again.storage.fetched == [], "the restore fetched a file the prefetch had verified"  # type: ignore[attr-defined]
    assert_same(snapshot(fresh), saved, "the state restored from the prefetched cache")
    assert not Path(staging, RESTORE_FOLDER).exists(), "the restore cache outlived the restore"


def test_a_prefetch_of_a_filesystem_store_checks_every_file_and_refuses_a_flipped_byte(tmp_path: Path) -> None:
    root, _ = committed(tmp_path)
    assert prefetch(FileStorage(root), str(tmp_path / "staging")) == "step-000000003"
    shard = next(Path(root, "step-000000003").glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    os.chmod(shard, 0o644)
    shard.write_bytes(bytes(data))
    with pytest.raises(CorruptObjectError):
        prefetch(FileStorage(root), str(tmp_path / "staging"))


def test_nothing_to_prefetch_under_a_new_uri(tmp_path: Path) -> None:
    assert prefetch(ObjectStoreLike(str(tmp_path / "empty")), str(tmp_path / "staging")) is None


def test_nothing_is_prefetched_past_a_checkpoint_a_newer_spotjob_wrote(tmp_path: Path) -> None:
    """The restore stops at it (an older one would go back in time) and is refused: fetching the
    older checkpoint would cost its whole download and cache for a restore that never reads it."""
    root, _ = committed(tmp_path)
    state = make_state(0)
    with Checkpointer(root, keep=None) as ckpt:
        ckpt.save(4, state)
    manifest = Path(root, "step-000000004", MANIFEST_NAME)
    doc = json.loads(manifest.read_text())
    doc["format_version"] = FORMAT_VERSION + 1
    manifest.write_text(json.dumps(doc))
    store = ObjectStoreLike(root)
    staging = str(tmp_path / "staging")
    assert prefetch(store, staging) is None
    assert store.fetched == [] and not Path(staging, RESTORE_FOLDER).exists()


def test_a_prefetch_that_fails_half_way_leaves_the_restore_whole(tmp_path: Path) -> None:
    """Pins what already held: the store fails on one file after others came in. The prefetch
    raises (the agent logs it); the restore uses the files the prefetch verified, fetches (and
    checks) the one it lacks, and loads the checkpoint whole."""
    root, saved = committed(tmp_path)
    staging_dir = str(tmp_path / "staging")

    class FailsOnAShard(ObjectStoreLike):
        def get_file(self, key: str, local_path: str, **kw: Any) -> None:
            if key.endswith(".distcp") and self.fetched:
                self.fetched.append(key)
                raise PermanentStorageError(f"503 on {key}", key)
            super().get_file(key, local_path, **kw)

    store = FailsOnAShard(root)
    with pytest.raises(PermanentStorageError):
        prefetch(store, staging_root(store, None, staging_dir), parallelism=1)
    failed = store.fetched[-1]
    assert len(store.fetched) > 1, "the test needs a file fetched before the failure"
    manifest = Manifest.parse(store.get_bytes(f"step-000000003/{MANIFEST_NAME}"))
    left = sorted(f"step-000000003/{e.path}" for e in manifest.files if f"step-000000003/{e.path}" not in store.fetched)

    fresh = make_state(0, seed=9)
    with Checkpointer(root, staging_dir=staging_dir) as again:
        again.storage = ObjectStoreLike(root)
        assert again.restore(fresh) == 3
        fetched = sorted(again.storage.fetched)  # type: ignore[attr-defined]
    assert fetched == sorted([failed, *left]), "the restore fetched again what the prefetch had verified"
    assert_same(snapshot(fresh), saved, "the state restored after a prefetch that failed half way")


def test_a_checkpoint_committed_while_the_prefetch_runs_is_restored_from_its_own_files(tmp_path: Path) -> None:
    """Pins what already held: the prefetch fetches step 3 while step 4 is committed. The restore
    loads step 4 from step 4's files only (each checkpoint has its own folder in the cache), and
    leaves neither checkpoint's files on the node's disk."""
    root, _ = committed(tmp_path)
    staging_dir = str(tmp_path / "staging")
    newer = make_state(0, seed=4)
    train(newer, 4)
    lock = threading.Lock()

    class CommittedMeanwhile(ObjectStoreLike):
        def get_file(self, key: str, local_path: str, **kw: Any) -> None:
            super().get_file(key, local_path, **kw)
            with lock:
                if not Path(root, "step-000000004").exists():
                    with Checkpointer(root, keep=None) as writer:
                        writer.save(4, newer)

    store = CommittedMeanwhile(root)
    assert prefetch(store, staging_root(store, None, staging_dir)) == "step-000000003"
    assert {k.split("/")[0] for k in store.fetched} == {"step-000000003"}

    fresh = make_state(0, seed=9)
    with Checkpointer(root, staging_dir=staging_dir) as again:
        again.storage = ObjectStoreLike(root)
        assert again.restore(fresh) == 4
        assert {k.split("/")[0] for k in again.storage.fetched} == {"step-000000004"}  # type: ignore[attr-defined]
    assert_same(snapshot(fresh), snapshot(newer), "the state restored while an older checkpoint was prefetched")
    assert not Path(staging_dir).exists() or not any(Path(staging_dir).rglob("*.distcp"))


# -- the <file>.verified marker vouches for one file of one checkpoint ---------------------------


def test_a_file_staged_for_another_checkpoint_under_the_same_name_is_fetched_again(tmp_path: Path) -> None:
    """Checkpoint A's files, staged and marked verified; checkpoint B of another URI has the same
    folder and file names under the same staging folder. B's fetch must hand out B's bytes."""
    staging = str(tmp_path / "staging")
    a = ObjectStoreLike(committed(tmp_path / "a")[0])
    b = ObjectStoreLike(committed_other(tmp_path / "b"))
    assert prefetch(a, staging) == "step-000000003"
    cache = os.path.join(staging, RESTORE_FOLDER, "step-000000003")

    manifest = Manifest.parse(b.get_bytes("step-000000003/MANIFEST.json"))
    shards = [e for e in manifest.files if e.path.endswith(".distcp")]
    assert shards
    for entry in shards:
        staged_a = Path(cache, entry.path).read_bytes()
        path = fetch_verified(b, "step-000000003", entry, cache)
        got = Path(path).read_bytes()
        assert got != staged_a, f"{entry.path}: checkpoint A's staged bytes were handed out for checkpoint B"
        assert len(got) == entry.size and to_hex(crc32c_bytes(got)) == entry.crc32c
    assert sorted(b.fetched) == sorted(f"step-000000003/{e.path}" for e in shards)

    # B's files are now what the markers vouch for: fetched once, not again.
    b.fetched.clear()
    for entry in shards:
        fetch_verified(b, "step-000000003", entry, cache)
    assert b.fetched == []


def test_a_marker_that_does_not_say_what_it_verified_is_not_trusted(tmp_path: Path) -> None:
    """An empty marker (what earlier versions wrote) beside a file of the right name proves nothing."""
    root, _ = committed(tmp_path)
    store = ObjectStoreLike(root)
    entry = next(e for e in Manifest.parse(store.get_bytes("step-000000003/MANIFEST.json")).files)
    cache = tmp_path / "staging" / RESTORE_FOLDER / "step-000000003"
    cache.mkdir(parents=True)
    (cache / entry.path).write_bytes(b"x" * entry.size)
    (cache / (entry.path + VERIFIED_SUFFIX)).write_bytes(b"")
    path = fetch_verified(store, "step-000000003", entry, str(cache))
    assert Path(path).read_bytes() == Path(root, "step-000000003", entry.path).read_bytes()
    assert store.fetched == [f"step-000000003/{entry.path}"]


def test_the_restore_never_loads_a_file_staged_for_another_checkpoint(tmp_path: Path) -> None:
    staging_dir = str(tmp_path / "staging")
    root_a, _ = committed(tmp_path / "a")
    root_b = committed_other(tmp_path / "b")
    # A's files where B's restore will look (one staging folder for both: the marker must tell them apart).
    assert (
        prefetch(ObjectStoreLike(root_a), staging_root(ObjectStoreLike(root_b), None, staging_dir)) == "step-000000003"
    )
    with Checkpointer(root_b, keep=None) as ckpt:
        expected = make_state(0, seed=5)
        assert ckpt.restore(expected) == 3  # B restored straight from its folder: the reference
    fresh = make_state(0, seed=9)
    with Checkpointer(root_b, staging_dir=staging_dir) as again:
        again.storage = ObjectStoreLike(root_b)
        assert again.restore(fresh) == 3
    assert_same(snapshot(fresh), snapshot(expected), "the state restored through a cache that held A's files")


def committed_other(tmp_path: Path) -> str:
    """Another job's step 3 at ``tmp_path``: other weights, so every shard differs from ``committed``'s."""
    state = make_state(0, seed=7)
    train(state, 4)
    root = str(tmp_path / "ckpt")
    with Checkpointer(root, keep=None) as ckpt:
        ckpt.save(3, state)
    return root


# -- the agent's prefetch and the ranks' Checkpointer agree on the staging folder ------------------


def test_the_agents_prefetch_lands_where_the_ranks_checkpointer_looks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``spotjob-agent --staging-dir S --job-name J`` prefetches; a rank's ``Checkpointer.from_env()``
    (the environment the agent gives it) restores from what it fetched, fetching nothing again."""
    root = str(tmp_path / "ckpt")
    state = make_state(0)
    train(state, 3)
    with Checkpointer(root, keep=None, job="team/train") as ckpt:
        ckpt.save(3, state)
    saved = snapshot(state)

    stores: list[ObjectStoreLike] = []

    def open_store(uri: str) -> ObjectStoreLike:
        stores.append(ObjectStoreLike(root))
        return stores[-1]

    argv = ["--checkpoint-uri", root, "--job-name", "team/train", "--staging-dir", str(tmp_path / "nvme"), "--", "x"]
    config, _ = parse_args(argv, {})
    agent = Agent(config, ControlDir(str(tmp_path / "control")), env={})
    monkeypatch.setattr(launcher, "open_storage", open_store)
    agent._prefetch()
    for thread in threading.enumerate():
        if thread.name == "spotjob-prefetch":
            thread.join()
    assert len(stores) == 1 and stores[0].fetched, "the agent's prefetch fetched nothing"

    for name, value in agent.rank_env().items():
        monkeypatch.setenv(name, value)
    fresh = make_state(0, seed=9)
    with Checkpointer.from_env() as rank:
        rank.storage = ObjectStoreLike(root)
        assert rank.restore(fresh) == 3
        assert rank.storage.fetched == [], "the rank fetched files the agent had prefetched elsewhere"  # type: ignore[attr-defined]
    assert_same(snapshot(fresh), saved, "the state restored from the agent's prefetch")


def test_a_prefetch_that_outlasts_the_restore_stops_and_leaves_nothing_on_the_nodes_disk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a node of a multi-node job the agent's prefetch fetches every node's shards, and the
    node's ranks may restore (waiting only for theirs), remove the cache and train while it still
    runs. From then on it fetches nothing more and removes what it fetched: before, it went on,
    refilled the cache, and left it on the node's disk for the whole attempt."""
    root, _ = committed(tmp_path)
    control = ControlDir(str(tmp_path / "control"))

    class RestoredMeanwhile(ObjectStoreLike):
        def get_file(self, key: str, local_path: str, **kw: Any) -> None:
            super().get_file(key, local_path, **kw)
            # While this file came in, the ranks restored, cleared the cache and began training.
            control.write_status(RankStatus(state="training", step=3))

    stores: list[RestoredMeanwhile] = []

    def open_store(uri: str) -> RestoredMeanwhile:
        stores.append(RestoredMeanwhile(root))
        return stores[-1]

    staging = tmp_path / "nvme"
    argv = ["--checkpoint-uri", root, "--job-name", "j", "--staging-dir", str(staging), "--", "x"]
    config, _ = parse_args(argv, {})
    agent = Agent(config, control, env={})
    monkeypatch.setattr(launcher, "open_storage", open_store)
    # One file at a time, so that "after the first file" is well defined.
    monkeypatch.setattr(restore_cache, "parallel_map", lambda fn, items, n: [fn(*a) for a in items])
    agent._prefetch()
    for thread in threading.enumerate():
        if thread.name == "spotjob-prefetch":
            thread.join()
    folder = stores[0].fetched[0].split("/")[0]
    manifest = Manifest.parse(stores[0].get_bytes(f"{folder}/{MANIFEST_NAME}"))
    assert len(manifest.files) > 1, "the test needs a file left to fetch after the first"
    assert len(stores[0].fetched) == 1, f"fetched after the ranks had restored: {stores[0].fetched}"
    left = [os.path.join(d, f) for d, _, files in os.walk(staging) for f in files]
    assert left == [], f"left on the node's disk: {left}"


def _agents_prefetch(argv: list[str], env: dict[str, str], tmp_path: Path) -> None:
    """Build the agent ``spotjob-agent ARGV -- x`` would run in ``env`` and run its prefetch to the end."""
    config, _ = parse_args([*argv, "--", "x"], env)
    Agent(config, ControlDir(str(tmp_path / "control")), env=env)._prefetch()
    for thread in threading.enumerate():
        if thread.name == "spotjob-prefetch":
            thread.join()


@pytest.mark.parametrize(
    ("argv", "env"), [(["--prefetch", "off"], {}), ([], {"SPOTJOB_AGENT_PREFETCH": "off"})], ids=["option", "variable"]
)
def test_the_agents_prefetch_can_be_turned_off(
    argv: list[str],
    env: dict[str, str],
    fresh_uri: Callable[[str], str],
    fault_proxy: Callable[..., FaultProxy],
    moto_server: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Counted at the store (moto's S3 behind the recording proxy). Before the fix there was no
    switch: every start of every node's agent fetched the whole newest checkpoint (the control
    run below), whatever the ranks would read, and `--prefetch off` exited 2."""
    uri = fresh_uri("s3")
    proxy = fault_proxy(moto_server, "s3")
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
    with Checkpointer(uri, keep=None) as ckpt:
        ckpt.save(3, make_state(0))
    common = ["--checkpoint-uri", uri, "--staging-dir", str(tmp_path / "nvme")]

    before = len(proxy.seen)
    _agents_prefetch(common, {}, tmp_path / "on")
    fetched = [s.path for s in proxy.seen[before:] if s.method == "GET" and "/step-000000003/" in s.path]
    assert len(fetched) > 1, f"the control run fetched no checkpoint file: {proxy.seen[before:]}"

    before = len(proxy.seen)
    _agents_prefetch(common + argv, env, tmp_path / "off")
    assert proxy.seen[before:] == [], "the agent asked the store for something with its prefetch off"


def test_which_files_a_nodes_ranks_read() -> None:
    """``node_files`` from a 4-rank manifest (new with ``--prefetch node``; the 2-node restart that
    counts it at the store is test_prefetch_requests.py): a sharded tensor from the node's own
    files, a tensor in one file (a replicated value, here an older checkpoint's ``step`` in rank
    1's file) from that file, every file at another world size; an empty shard file never."""

    def entry(path: str, size: int = 8) -> dict[str, Any]:
        return {"path": path, "size": size, "crc32c": "00000000"}

    shards = [f"__{r}_0.distcp" for r in range(4)]
    manifest = Manifest.model_validate(
        {
            "step": 3,
            "world_size": 4,
            "created_at": "2026-12-05T00:00:00Z",
            "torch_version": "2.13.0",
            "state_keys": ["model", "optim"],
            "files": [entry(".metadata"), *map(entry, shards), entry("__4_0.distcp", 0)]
            + [entry(f"rank-{r:05d}.pt") for r in range(4)],
            "tensors": {
                "model.w": {"shape": [8], "dtype": "torch.float32", "files": shards},
                "optim.state.model.w.step": {"shape": [], "dtype": "torch.float32", "files": ["__1_0.distcp"]},
            },
        }
    )
    node1 = {e.path for e in restore_cache.node_files(manifest, range(2, 4), 4)}
    assert node1 == {".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp", "__3_0.distcp"} | {
        "rank-00002.pt",
        "rank-00003.pt",
    }
    del manifest.tensors["optim.state.model.w.step"]
    node1 = {e.path for e in restore_cache.node_files(manifest, range(2, 4), 4)}
    assert node1 == {".metadata", "__0_0.distcp", "__2_0.distcp", "__3_0.distcp", "rank-00002.pt", "rank-00003.pt"}
    assert restore_cache.node_files(manifest, range(2, 5), 6) == manifest.files


def test_a_node_fetches_the_files_of_a_tensor_its_ranks_hold_that_another_replica_wrote() -> None:
    """HSDP (sharded within a node, replicated across nodes): DCP writes each shard of a tensor from
    one replica, and here all of ``w``'s shards came from node 0's ranks (``__0_0``, ``__1_0``), as
    test_prefetch_requests.py's real HSDP save puts half its tensors. Node 1's ranks hold the same
    shards and read both files. Before the fix rank 0's file (fetched by every node for the
    replicated values) counted as one of node 1's own, so ``w`` looked read from it alone and
    ``__1_0`` was left to the ranks' restore, after the prefetch."""

    def entry(path: str) -> dict[str, Any]:
        return {"path": path, "size": 8, "crc32c": "00000000"}

    shards = [f"__{r}_0.distcp" for r in range(4)]
    manifest = Manifest.model_validate(
        {
            "step": 3,
            "world_size": 4,
            "created_at": "2026-12-05T00:00:00Z",
            "torch_version": "2.13.0",
            "state_keys": ["model"],
            "files": [entry(".metadata"), *map(entry, shards)] + [entry(f"rank-{r:05d}.pt") for r in range(4)],
            "tensors": {
                "model.w": {"shape": [8], "dtype": "torch.float32", "files": shards[:2]},
                "model.b": {"shape": [8], "dtype": "torch.float32", "files": shards[2:]},
            },
        }
    )
    for ranks in (range(0, 2), range(2, 4)):
        got = {e.path for e in restore_cache.node_files(manifest, ranks, 4)}
        assert got == {".metadata", *shards} | {f"rank-{r:05d}.pt" for r in ranks}, (ranks, got)


@pytest.mark.parametrize("scheme", ["s3", "gs"])
def test_a_file_that_fits_one_part_is_fetched_with_one_request(
    scheme: str,
    fresh_uri: Callable[[str], str],
    fault_proxy: Callable[..., FaultProxy],
    request: pytest.FixtureRequest,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Counted at the server (moto's S3, fake-gcs-server) behind the recording proxy: a file no
    bigger than a part is one ranged GET, its size checked from the answer's Content-Range. Before
    the fix each file took a request more first (two a file: every file of a checkpoint here): on
    S3 a HEAD (fixed first), on GCS the object's metadata GET. Another object under the name
    (longer, shorter, empty) is still refused before a byte of it is kept."""
    uri = fresh_uri(scheme)
    if scheme == "s3":
        proxy = fault_proxy(request.getfixturevalue("moto_server"), "s3")
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
    else:
        proxy = fault_proxy(request.getfixturevalue("gcs_server"), "gcs")
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", proxy.url)
    with Checkpointer(uri, keep=None) as ckpt:
        ckpt.save(3, make_state(0))
    store = open_storage(uri)
    before = len(proxy.seen)
    assert prefetch(store, str(tmp_path / "staging")) == "step-000000003"
    # A GCS object's name is percent-encoded in the path: unquoted to find the folder in it.
    data = [s for s in proxy.seen[before:] if "/step-000000003/" in unquote(s.path.split("?")[0])]
    data = [s for s in data if "MANIFEST" not in s.path]
    manifest = Manifest.parse(store.get_bytes(f"step-000000003/{MANIFEST_NAME}"))
    # GCS reads an object's metadata with a GET too; its media GETs say alt=media.
    reads = [s.method if scheme == "s3" or "alt=media" in s.path else f"metadata {s.method}" for s in data]
    assert sorted(reads) == ["GET"] * len(manifest.files), data

    entry = next(e for e in manifest.files if e.path.endswith(".distcp"))
    bucket, _, prefix = uri.partition("://")[2].partition("/")
    key = f"{prefix}/step-000000003/{entry.path}"
    if scheme == "s3":
        s3_client = request.getfixturevalue("s3_client")
        original = s3_client.get_object(Bucket=bucket, Key=key)["Body"].read()
    else:
        blob = request.getfixturevalue("gcs_client").bucket(bucket).blob(key)
        original = blob.download_as_bytes()
    for other in (original + b"x", original[:-1], b""):
        if scheme == "s3":
            s3_client.put_object(Bucket=bucket, Key=key, Body=other)
        else:
            blob.upload_from_string(other)
        cache = tmp_path / f"cache-{len(other)}"
        with pytest.raises(CorruptObjectError, match=f"is {len(other)} bytes, the manifest says {entry.size}"):
            fetch_verified(store, "step-000000003", entry, str(cache))
        assert not (cache / entry.path).exists()
    store.close()
