"""Nothing spotjob does on a rank draws from, or reseeds, the user's global RNG streams.

Python's ``random``, NumPy's global generator and torch's default generator belong to the training
script: a draw made by a storage client (a multipart boundary, a retry's jitter) from the
Checkpointer's background thread shifts the script's stream at a moment that depends on timing,
and a resumed run no longer ends bit-identical to an uninterrupted one. Each store, sync and
async: the streams are the same after constructing, saving, retrying, retaining and closing as
before; and a restore leaves exactly the streams the checkpoint holds.
"""

from __future__ import annotations

import random
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from agent.checkpoint import Checkpointer

sys.path.insert(0, str(Path(__file__).resolve().parent / "scripts"))
from ckpt_compare import assert_same
from ckpt_state import make_state, rng_snapshot, seed_rngs, train

try:
    from faults import FaultProxy
except ImportError:  # tests/ collected as a package
    from tests.faults import FaultProxy


def streams() -> dict[str, Any]:
    """The three global streams, comparable with ``assert_same``."""
    snap = rng_snapshot()
    snap["python"] = [*snap["python"][1], snap["python"][0], snap["python"][2]]
    return snap


def save_twice_and_restore(uri: str, staging: Path, *, async_save: bool) -> None:
    """Construct, save two steps (keep=1: retention deletes the first), close; then restore."""
    seed_rngs(7, 0)
    state = make_state(0)
    before = streams()
    with Checkpointer(uri, keep=1, async_save=async_save, staging_dir=str(staging)) as ckpt:
        train(state, 1)
        ckpt.save(1, state)
        ckpt.wait()
        assert_same(streams(), before, "the RNG streams after a save")
        ckpt.save(2, state)
    assert_same(streams(), before, "the RNG streams after saves, retention and close")

    random.random(), np.random.rand(), torch.rand(1)  # the script moves on
    fresh = make_state(0, seed=3)
    with Checkpointer(uri, keep=1, async_save=async_save, staging_dir=str(staging)) as again:
        assert again.restore(fresh) == 2
        # The restore sets the streams to the checkpoint's (captured when step 2 was saved,
        # identical to ``before``) and draws nothing after that.
        assert_same(streams(), before, "the RNG streams right after a restore")
    assert_same(streams(), before, "the RNG streams after the restoring Checkpointer closed")


@pytest.mark.parametrize("async_save", [True, False], ids=["async", "sync"])
def test_saves_and_restores_leave_the_global_rng_streams_alone(
    storage_uri: str, async_save: bool, tmp_path: Path
) -> None:
    save_twice_and_restore(storage_uri, tmp_path, async_save=async_save)


@pytest.mark.parametrize("scheme", ["s3", "gs"])
def test_retried_requests_leave_the_global_rng_streams_alone(
    scheme: str,
    request: pytest.FixtureRequest,
    monkeypatch: pytest.MonkeyPatch,
    fresh_uri: Callable[[str], str],
    fault_proxy: Callable[..., FaultProxy],
    fast_retries: None,
    tmp_path: Path,
) -> None:
    """Every request kind fails once and is retried: the retry's backoff jitter is spotjob's own."""
    uri = fresh_uri(scheme)
    server = request.getfixturevalue("moto_server" if scheme == "s3" else "gcs_server")
    proxy = fault_proxy(server, "s3" if scheme == "s3" else "gcs")
    monkeypatch.setenv("AWS_ENDPOINT_URL" if scheme == "s3" else "STORAGE_EMULATOR_HOST", proxy.url)
    rules = []
    if scheme == "gs":
        # The library's own bucket-metadata fetch (a thread of its own, retried by api-core)
        # must not happen at all; failing it makes any retry of it show.
        proxy.fail(1, 503, method="GET", path=r"^/storage/v1/b/[^/?]+\?")
    rules += [proxy.fail(1, 503, method=m) for m in ("GET", "PUT", "POST", "DELETE")]
    save_twice_and_restore(uri, tmp_path, async_save=True)
    assert sum(r.served for r in rules) >= 3, "the faults were not delivered: nothing was retried"
