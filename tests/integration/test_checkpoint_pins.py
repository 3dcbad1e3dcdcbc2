"""Pins (``agent.pins``): a read-only Checkpointer's restore and ``spotjob ckpt export`` pin the
checkpoint they read, and the writer's retention leaves a folder with an unexpired pin.

Real stores (file://, moto S3, fake-gcs-server), a real 2-rank writer under torchrun (one job for
the module, which saves on each race's URI when asked). The read is
held open at one seam (``VerifiedReader.hold_all``, before the reader opens the files it picked)
while the writer saves; nothing waits on time except for a crashed reader's pin to expire.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import agent.checkpoint._restore as restore_module
import agent.checkpoint._retention as retention_module
import agent.pins as pins
from agent.checkpoint import Checkpointer
from agent.dcp_safe import VerifiedReader
from agent.storage import open_storage
from orchestrator import ckpt_export
from orchestrator.cli import main

sys.path.insert(0, str(Path(__file__).resolve().parent / "scripts"))
import ckpt_harness as harness
from ckpt_compare import assert_same
from ckpt_state import make_state, snapshot, train

pytestmark = pytest.mark.slow

WRITER = harness.SCRIPTS / "ckpt_pin_writer.py"
STEP1 = "step-000000001"


def _folders(uri: str) -> list[str]:
    storage = open_storage(uri)
    try:
        return sorted(d.rstrip("/") for d in storage.list_dirs("") if d.startswith("step-"))
    finally:
        storage.close()


def _pins(uri: str) -> list[str]:
    storage = open_storage(uri)
    try:
        return [i.key for i in storage.list(pins.PINS_PREFIX)]
    finally:
        storage.close()


class Writer:
    """The 2-rank job "train" (keep=1), one torchrun for the module (``scripts/ckpt_pin_writer.py``):
    each race asks it to save, on its own URI, instead of launching a torchrun of its own (a
    launcher and two ranks, about 8 CPU-s, for each of seven races)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.log = folder / "job.log"
        self.requests = harness.Requests(folder)
        self.proc = harness.start(harness.torchrun_argv(2, WRITER, [str(folder)]), self.log)

    def saves(self, uri: str, first: int, last: int) -> str:
        """The job saves steps first..last on ``uri``, as ``ckpt_job.py saves`` would; its ranks' log."""
        n = self.requests.send({"uri": uri, "steps": [first, last]})
        done = [self.folder / f"done-{n}.rank{rank}" for rank in (0, 1)]
        harness.wait_for(
            lambda: all(p.exists() for p in done),
            f"the job to save steps {first}..{last} on {uri}",
            timeout=harness.RUN_TIMEOUT_S,
            alive=self.proc,
            log_path=self.log,
        )
        return "".join((self.folder / f"log-{n}.rank{rank}").read_text() for rank in (0, 1))

    def close(self) -> None:
        if self.proc.poll() is None:
            self.requests.send({"stop": True})
            rc = harness.reap(self.proc)
            assert rc == 0, f"the writer job exited {rc}:\n{self.log.read_text(errors='replace')[-8000:]}"


@pytest.fixture(scope="module")
def writer(tmp_path_factory: pytest.TempPathFactory, moto_server: str, gcs_server: str) -> Iterator[Writer]:
    """The module's writer job; the stores' servers start first, so its ranks get their settings."""
    job = Writer(tmp_path_factory.mktemp("writer"))
    try:
        yield job
    finally:
        job.close()


def _saves_here(uri: str, first: int, last: int) -> None:
    """What the job "train" of ``Writer.saves`` saves (the same state, steps first..last, keep=1),
    written in this process on one rank: for the saves before and after a race, which only put a step
    in place for the reader or run the retention pass after it. The saves during a race, which
    must come from another process and clock, stay the 2-rank torchrun."""
    state = make_state(0, seed=0)
    with Checkpointer(uri, keep=1, job="train", async_save=False) as ckpt:
        for step in range(first, last + 1):
            train(state, 1, start=step - 1)
            ckpt.save(step, state)


def _step1(uri: str) -> dict[str, torch.Tensor]:
    """Step 1's model, as a restore reads it before anything races it."""
    model = make_state(0, seed=7)["model"]
    with Checkpointer(uri, read_only=True, job="train") as reader:
        assert reader.restore({"model": model}) == 1
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("scheme", ["file", "s3", "gs"])
def test_a_pinned_checkpoint_outlives_many_retention_passes_and_goes_once_released(
    fresh_uri: Callable[[str], str], writer: Writer, monkeypatch: pytest.MonkeyPatch, scheme: str
) -> None:
    """An eval job restores step 1 while the 2-rank job (keep=1) commits steps 2..6: five
    retention passes, each of which deleted step 1 before (the restore then started over and
    loaded step 6). Pinned, step 1 stays, is restored whole, and goes at the first pass after the
    restore released its pin."""
    uri = fresh_uri(scheme)
    _saves_here(uri, 1, 1)
    step1 = _step1(uri)
    real_hold_all = VerifiedReader.hold_all
    during: dict[str, Any] = {}

    def hold_all_while_the_job_saves_on(self: VerifiedReader) -> None:
        if not during:
            during["pins"] = _pins(uri)
            during["log"] = writer.saves(uri, 2, 6)
            during["folders"] = _folders(uri)
        real_hold_all(self)

    monkeypatch.setattr(restore_module.VerifiedReader, "hold_all", hold_all_while_the_job_saves_on)
    model = make_state(0, seed=7)["model"]
    with Checkpointer(uri, read_only=True, job="train") as reader:
        assert reader.restore({"model": model}) == 1
    assert_same(dict(model.state_dict()), step1)
    assert len(during["pins"]) == 1 and during["pins"][0].startswith(f"{pins.PINS_PREFIX}{STEP1}_")
    assert during["folders"] == [STEP1, "step-000000006"]
    assert "a reader pinned it" in during["log"]
    assert _pins(uri) == []  # released when the restore ended
    _saves_here(uri, 7, 7)
    assert _folders(uri) == ["step-000000007"]


def test_export_pins_the_step_it_exports(
    tmp_path: Path, writer: Writer, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``spotjob ckpt export --step 1`` while the job (keep=1) commits step 2 before the export
    reads: before, step 1 was deleted and the export failed ("deleted while it was being
    exported"); pinned, it is exported, and the job's next pass removes it."""
    uri = str(tmp_path / "ckpt")
    _saves_here(uri, 1, 1)
    step1 = _step1(uri)
    real = ckpt_export.export_safetensors

    def export_as_the_job_saves(*args: Any, **kwargs: Any) -> Any:
        writer.saves(uri, 2, 2)
        return real(*args, **kwargs)

    monkeypatch.setattr(ckpt_export, "export_safetensors", export_as_the_job_saves)
    out = tmp_path / "export"
    assert main(["ckpt", "export", "--step", "1", uri, str(out)]) == 0, capsys.readouterr().err
    from safetensors.torch import load_file

    assert_same(load_file(out / "model.safetensors"), step1)
    assert _pins(uri) == []
    _saves_here(uri, 3, 3)
    assert _folders(uri) == ["step-000000003"]


@pytest.mark.parametrize("scheme", ["s3", "gs"])
def test_a_reader_without_write_access_reads_unpinned_with_one_warning(
    fresh_uri: Callable[[str], str],
    request: pytest.FixtureRequest,
    fault_proxy: Any,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    fast_retries: None,
    scheme: str,
) -> None:
    """Read-only credentials: the fault proxy answers every write and delete with 403 (it models
    the store's refusal, not an IAM policy's finer grain). Two restores both load step 1; one
    warning says why they read unpinned and what to do. Before, no word was said."""
    uri = fresh_uri(scheme)
    _saves_here(uri, 1, 1)
    server = request.getfixturevalue("moto_server" if scheme == "s3" else "gcs_server")
    proxy = fault_proxy(server, "s3" if scheme == "s3" else "gcs")
    denied = proxy.fail(10_000, 403, match=lambda r: r.method in ("PUT", "POST", "DELETE"))
    monkeypatch.setenv("AWS_ENDPOINT_URL" if scheme == "s3" else "STORAGE_EMULATOR_HOST", proxy.url)
    caplog.set_level(logging.INFO)
    with Checkpointer(uri, read_only=True, job="train") as reader:
        for _ in range(2):
            assert reader.restore({"model": make_state(0, seed=7)["model"]}) == 1
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and r.name == "agent.pins"]
    assert len(warnings) == 1, warnings
    assert (
        "without a pin" in warnings[0] and "write and delete access" in warnings[0] and ".spotjob/pins" in warnings[0]
    )
    assert denied.served >= 1


_CRASHING_READER = """
import sys, time
import agent.pins as pins
import agent.checkpoint._restore as restore_module
import agent.checkpoint._retention as retention_module
from agent.checkpoint import Checkpointer
from ckpt_compare import assert_same
from ckpt_state import make_state
pins.PIN_SECONDS = float(sys.argv[2])
def hang(self):
    open(sys.argv[3], "w").close()
    time.sleep(3600)
restore_module.VerifiedReader.hold_all = hang
Checkpointer(sys.argv[1], read_only=True, job="train").restore({"model": make_state(0, seed=7)["model"]})
"""


@pytest.mark.parametrize("scheme", ["file", "s3"])
def test_a_crashed_readers_pin_holds_until_it_expires_then_is_ignored_and_removed(
    fresh_uri: Callable[[str], str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path, scheme: str
) -> None:
    """A reader (a 5-second pin) is killed -9 while it reads step 1. Its pin holds through the
    job's next pass (the clock margin of a minute covers that pass); once 5 s have passed since the
    store wrote the pin (the writer's pins of 5 s too, the margin set to 0 in this process, the
    writer, to not wait a minute), the next pass removes step 1 and the pin. Without pins, the
    first pass removed step 1."""
    uri = fresh_uri(scheme)
    state = make_state(0)
    train(state, 1)
    writer = Checkpointer(uri, keep=1, job="train", async_save=False)
    writer.save(1, state)
    marker = tmp_path / "reading"
    reader = subprocess.Popen(
        [sys.executable, "-c", _CRASHING_READER, uri, "5", str(marker)],
        env=harness.job_env(
            PYTHONPATH=os.pathsep.join(map(str, (harness.REPO, harness.SCRIPTS, harness.REPO / "tests")))
        ),
        start_new_session=True,
    )
    try:
        harness.wait_for(marker.exists, "the reader to pin step 1 and read it", alive=reader)
    finally:
        os.killpg(reader.pid, signal.SIGKILL)
        reader.wait()
    (pin,) = _pins(uri)
    monkeypatch.setattr(pins, "PIN_SECONDS", 5.0)  # the writer's lifetime of a pin: the reader's
    train(state, 1, start=1)
    writer.save(2, state)
    assert _folders(uri) == [STEP1, "step-000000002"]
    written = writer.storage.stat(pin)
    assert written is not None and written.modified is not None
    monkeypatch.setattr(pins, "CLOCK_MARGIN_SECONDS", 0.0)
    harness.wait_for(lambda: time.time() > written.modified + 5 + 1, "the crashed reader's pin to expire")
    train(state, 1, start=2)
    writer.save(3, state)
    writer.close()
    assert _folders(uri) == ["step-000000003"]
    assert _pins(uri) == []


def test_retention_lists_the_pins_once_per_pass_and_reads_none(tmp_path: Path) -> None:
    """Pins cost the writer one listing of ``.spotjob/pins/`` per retention pass that has something
    to delete, whatever the number of pins, and no read of a pin (their names say it all). It
    counts the calls at the store's own methods; it pins behaviour of the feature, not a defect."""
    uri = str(tmp_path / "ckpt")
    state = make_state(0)
    writer = Checkpointer(uri, keep=1, job="train", async_save=False)
    storage = writer.storage
    for reader in range(3):  # three readers' pins, live, on folders retention would not delete anyway
        storage.put_bytes(f"{pins.PINS_PREFIX}step-000000100_{int(time.time()) + 200}_{reader:04x}", b"")
    calls: list[str] = []
    real_list, real_get = storage.list, storage.get_bytes

    def counting_list(prefix: str = "") -> Any:
        calls.append(f"list {prefix}")
        return real_list(prefix)

    def counting_get(key: str) -> bytes:
        calls.append(f"get {key}")
        return real_get(key)

    storage.list = counting_list  # type: ignore[method-assign]
    storage.get_bytes = counting_get  # type: ignore[method-assign]
    for step in range(1, 6):
        train(state, 1, start=step - 1)
        writer.save(step, state)
    writer.close()
    assert calls.count(f"list {pins.PINS_PREFIX}") == 4  # the passes after steps 2..5; step 1's had nothing to delete
    assert not [c for c in calls if c.startswith(f"get {pins.PINS_PREFIX}")]
    assert _folders(uri) == ["step-000000005"]


def test_a_long_read_renews_its_pin_and_keeps_the_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A read that outlasts a pin (pins of 0.3 s here) renews it: a pin with a later expiry comes,
    the one before goes (never none at a look), and the job's passes meanwhile leave the folder.
    Before pins, retention removed it at the first pass."""
    monkeypatch.setattr(pins, "PIN_SECONDS", 0.3)
    uri = str(tmp_path / "ckpt")
    state = make_state(0)
    train(state, 1)
    writer = Checkpointer(uri, keep=1, job="train", async_save=False)
    writer.save(1, state)
    real_hold_all = VerifiedReader.hold_all
    seen: list[str] = []

    def hold_all_through_renewals(self: VerifiedReader) -> None:
        def renewed_twice() -> bool:
            found = _pins(uri)  # two for a moment: the new one is written before the old goes
            assert 1 <= len(found) <= 2, found
            pin = max(found)
            if not seen or seen[-1] != pin:
                seen.append(pin)
            return len(seen) >= 3

        if not seen:
            harness.wait_for(renewed_twice, "the reader to renew its pin twice")
            for step in (2, 3):
                train(state, 1, start=step - 1)
                writer.save(step, state)
        real_hold_all(self)

    monkeypatch.setattr(restore_module.VerifiedReader, "hold_all", hold_all_through_renewals)
    with Checkpointer(uri, read_only=True, job="train") as reader:
        assert reader.restore({"model": make_state(0, seed=7)["model"]}) == 1
    writer.close()
    assert all(p.startswith(f"{pins.PINS_PREFIX}{STEP1}_") for p in seen)
    assert _folders(uri) == [STEP1, "step-000000003"] and _pins(uri) == []


def test_a_pin_due_further_ahead_than_any_reader_writes_keeps_nothing(tmp_path: Path) -> None:
    """Fails without the bound: a pin whose name says a year ahead (a reader's clock far off, or a
    name written by hand) kept its folder through every retention pass, for good. The writer dates a
    pin by the store (here the file's mtime, set 10 minutes back as if written then): whatever its
    name says, a pin the store wrote more than ``PIN_SECONDS`` plus the margin ago is not honoured,
    and is removed."""
    uri = str(tmp_path / "ckpt")
    state = make_state(0)
    with Checkpointer(uri, keep=1, job="train", async_save=False) as writer:
        writer.save(1, state)
        far = f"{pins.PINS_PREFIX}{STEP1}_{int(time.time()) + 365 * 86400}_beef"
        near = f"{pins.PINS_PREFIX}step-000000002_{int(time.time() + pins.PIN_SECONDS)}_cafe"
        writer.storage.put_bytes(far, b"")
        writer.storage.put_bytes(near, b"")
        long_ago = time.time() - 600
        os.utime(Path(uri) / far, (long_ago, long_ago))
        for step in (2, 3):
            train(state, 1, start=step - 1)
            writer.save(step, state)
    assert _folders(uri) == ["step-000000002", "step-000000003"]  # step 2: its reader's pin holds
    assert _pins(uri) == [near]


@pytest.mark.parametrize(("scheme", "skew"), [("s3", 180), ("gs", -600), ("file", -600)])
def test_a_reader_whose_clock_is_minutes_off_keeps_its_pin(
    fresh_uri: Callable[[str], str], writer: Writer, monkeypatch: pytest.MonkeyPatch, scheme: str, skew: int
) -> None:
    """A reader whose clock is 3 minutes ahead of the writer's, or 10 behind, restores step 1
    while the 2-rank job (keep=1, its own process and clock) commits steps 2 and 3. Before, the
    writer compared the expiry in the pin's name with its own clock: ahead, the pin was "due too
    far" and removed; behind, already expired; either way step 1 was deleted under the read, which
    started over at step 3. Now the writer dates the pin by the store's time (S3's LastModified,
    GCS's ``updated``, a file's mtime), and step 1 is restored. The reader's clock is shifted for
    ``agent.pins`` alone (the pin's name); the store's and the writer's clocks are real."""
    uri = fresh_uri(scheme)
    _saves_here(uri, 1, 1)
    real_time = time.time
    monkeypatch.setattr(pins, "time", SimpleNamespace(time=lambda: real_time() + skew))
    real_hold_all = VerifiedReader.hold_all
    during: dict[str, Any] = {}

    def hold_all_while_the_job_saves_on(self: VerifiedReader) -> None:
        if not during:
            during["log"] = writer.saves(uri, 2, 3)
        real_hold_all(self)

    monkeypatch.setattr(restore_module.VerifiedReader, "hold_all", hold_all_while_the_job_saves_on)
    with Checkpointer(uri, read_only=True, job="train") as reader:
        assert reader.restore({"model": make_state(0, seed=7)["model"]}) == 1
    assert "a reader pinned it" in during["log"]
    assert _folders(uri) == [STEP1, "step-000000003"] and _pins(uri) == []


def test_keep_none_removes_a_leftover_once_its_pin_is_gone(tmp_path: Path) -> None:
    """``keep=None`` deletes only the leftovers of unfinished saves, and each pass looks only at
    folders newer than the last pass that went through. A leftover kept for a pin (a reader's, on
    the folder it looked at while walking from the newest) was then behind that mark: it stayed for
    good, a whole save's bytes. Now a pass that kept something for a pin does not move the mark, and
    the first pass after the pin is gone removes the leftover."""
    uri = str(tmp_path / "ckpt")
    state = make_state(0)
    with Checkpointer(uri, keep=None, job="train", async_save=False) as writer:
        writer.save(1, state)
        writer.storage.put_bytes("step-000000002/rank-0/__0_0.distcp", b"unfinished")
        pin = f"{pins.PINS_PREFIX}step-000000002_{int(time.time() + pins.PIN_SECONDS)}_cafe"
        writer.storage.put_bytes(pin, b"")
        train(state, 1, start=1)
        writer.save(3, state)
        assert _folders(uri) == [STEP1, "step-000000002", "step-000000003"]  # pinned: kept
        writer.storage.delete([pin])
        train(state, 1, start=3)
        writer.save(4, state)
    assert _folders(uri) == [STEP1, "step-000000003", "step-000000004"]


def test_a_renewal_whose_delete_failed_leaves_no_pin_behind(
    fresh_uri: Callable[[str], str],
    gcs_server: Any,
    fault_proxy: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A renewal writes the pin's new name, then deletes the old one; the fault proxy refuses that
    delete once (403). Before, the reader forgot the name it had just written and kept deleting
    only the other: one name stayed after the read ended, holding the folder from retention for
    minutes more. Now every name not yet deleted is deleted at the next renewal or at the end.
    Pins of 3 s here (renewed each second, so each renewal has a name of its own, as with the real
    100 s); the proxy models the store's refusal, not why it refused."""
    monkeypatch.setattr(pins, "PIN_SECONDS", 3.0)
    uri = fresh_uri("gs")
    with Checkpointer(uri, keep=1, job="train", async_save=False) as writer:
        writer.save(1, make_state(0))
    proxy = fault_proxy(gcs_server, "gcs")
    refused = proxy.fail(1, 403, method="DELETE", path="pins")
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", proxy.url)
    real_hold_all = VerifiedReader.hold_all
    seen: set[str] = set()

    def hold_all_through_renewals(self: VerifiedReader) -> None:
        def renewed_after_the_refusal() -> bool:
            seen.update(_pins(uri))
            return refused.served == 1 and len(seen) >= 4

        harness.wait_for(renewed_after_the_refusal, "the reader to renew its pin past the refused delete")
        real_hold_all(self)

    monkeypatch.setattr(restore_module.VerifiedReader, "hold_all", hold_all_through_renewals)
    with Checkpointer(uri, read_only=True, job="train") as reader:
        assert reader.restore({"model": make_state(0, seed=7)["model"]}) == 1
    assert _pins(uri) == []


@pytest.mark.parametrize("scheme", ["gs", "file"])
def test_a_pin_written_after_the_pass_listed_the_pins_restores_the_newer_one_whole(
    fresh_uri: Callable[[str], str], monkeypatch: pytest.MonkeyPatch, scheme: str
) -> None:
    """The race the README names: the job's pass lists the pins a moment before the reader's pin
    lands (modelled by that pass's listing coming back empty, the one seam), and deletes step 1
    while the reader reads it. The restore starts over and loads step 2, whole, never a mix of the
    two. This pins behaviour that already worked (and adds GCS, which the unpinned tests of it in
    test_checkpoint_concurrent_readers.py do not run)."""
    uri = fresh_uri(scheme)
    state = make_state(0)
    train(state, 1)
    writer = Checkpointer(uri, keep=1, job="train", async_save=False)
    writer.save(1, state)
    real_pinned = retention_module.pinned_folders
    monkeypatch.setattr(retention_module, "pinned_folders", lambda *a, **k: (set(), []))
    saved: dict[int, Any] = {}
    real_hold_all = VerifiedReader.hold_all

    def hold_all_as_the_writer_saves_on(self: VerifiedReader) -> None:
        if not saved:
            train(state, 1, start=1)
            writer.save(2, state)  # its pass saw no pin: step 1 goes
            saved[2] = snapshot(state)
            monkeypatch.setattr(retention_module, "pinned_folders", real_pinned)
        real_hold_all(self)

    monkeypatch.setattr(restore_module.VerifiedReader, "hold_all", hold_all_as_the_writer_saves_on)
    reader_state = make_state(0, seed=7)
    with Checkpointer(uri, read_only=True, job="train") as reader:
        assert reader.restore({"model": reader_state["model"]}) == 2
    writer.close()
    assert_same(snapshot(reader_state)["model"], saved[2]["model"])
    assert _folders(uri) == ["step-000000002"] and _pins(uri) == []
