"""A signal that reaches the training process while the Checkpointer works.

Real processes (``scripts/ckpt_signals.py``) signal themselves at a seam of the save: Ctrl-C
(SIGINT, ``KeyboardInterrupt``) or SIGTERM to the script's own handler (``sys.exit(143)``). A case
whose signal ends its process has a process of its own; the cases whose script catches the signal
and goes on share one, one case after the other.

- During a synchronous save, or while a rank prepares one: the save commits nothing, the previous
  checkpoint stays the newest, and the signal's own exception leaves the save (not a
  ``SaveFailedError``), so the process ends as the signal asked — killed by SIGINT, exit 143 from
  the handler — or the script catches ``KeyboardInterrupt`` and the Checkpointer saves on. With
  two ranks, the one not signalled gets ``SaveFailedError`` instead of waiting for its peer.
- During ``close()`` while an asynchronous save uploads: the save keeps what it uses (its store,
  its process groups, its staging buffers) and the next ``close()`` waits for its commit.
- In the body of ``with Checkpointer(...)`` while a save fails: the body's exception (Ctrl-C, the
  script's own error) leaves the block, not the save's ``SaveFailedError`` (which is logged).
"""

from __future__ import annotations

import signal
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch

from agent.catalog import list_checkpoints
from agent.checkpoint import Checkpointer
from agent.storage import StorageError, open_storage

sys.path.insert(0, str(Path(__file__).resolve().parent / "scripts"))
import ckpt_harness as harness

SCRIPT = harness.SCRIPTS / "ckpt_signals.py"


def committed(uri: str) -> list[int]:
    storage = open_storage(uri)
    try:
        return sorted(s.ref.step for s in list_checkpoints(storage) if s.committed)
    finally:
        storage.close()


@pytest.mark.parametrize(
    ("sig", "at", "exit_code"),
    [
        ("INT", "write", -signal.SIGINT),
        ("INT", "upload", -signal.SIGINT),
        ("INT", "commit", -signal.SIGINT),
        ("TERM", "write", 143),
        ("TERM", "upload", 143),
    ],
    ids=[
        "sigint-mid-write",
        "sigint-mid-upload",
        "sigint-at-commit",
        "sigterm-handler-mid-write",
        "sigterm-handler-mid-upload",
    ],
)
def test_a_signal_during_a_synchronous_save_ends_the_process_as_the_signal_asks(
    sig: str, at: str, exit_code: int, tmp_path: Path
) -> None:
    uri = str(tmp_path / "ckpt")
    done = harness.run([harness.PYTHON, str(SCRIPT), "sync", "--uri", uri, "--signal", sig, "--at", at], check=False)
    assert done.returncode == exit_code, done.stdout + done.stderr
    assert "SaveFailedError" not in done.stderr, done.stderr
    assert committed(uri) == [1]


CAUGHT = {  # case -> its mode in ``ckpt_signals.py cases``, and its store
    "carry-on": ("carry-on", "file"),
    "close-file": ("close", "file"),
    "close-s3": ("close", "s3"),
    "close-other-thread": ("close-other-thread", "file"),
}


@pytest.fixture(scope="module")
def caught_run(
    tmp_path_factory: pytest.TempPathFactory, s3_client: Any
) -> tuple[dict[str, tuple[str, Path]], subprocess.CompletedProcess[str]]:
    """The cases whose script catches its signal and goes on, one after the other in one process,
    each with its own URI, Checkpointer and output file (a Python that imports torch less than a
    process each): case -> (its URI, its output file), and the run. What a case raised (which its
    own process died of) ends in its file, and the next case runs."""
    root = tmp_path_factory.mktemp("caught")
    where = {}
    for case, (_, scheme) in CAUGHT.items():
        if scheme == "s3":
            bucket = f"spotjob-{uuid.uuid4().hex[:12]}"
            s3_client.create_bucket(Bucket=bucket)
            uri = f"s3://{bucket}/jobs/run1"
        else:
            uri = str(root / case / "ckpt")
        where[case] = (uri, root / f"{case}.out")
    runs = [arg for case, (mode, _) in CAUGHT.items() for arg in ("--run", mode, *map(str, where[case]))]
    return where, harness.run([harness.PYTHON, str(SCRIPT), "cases", *runs], check=False)


def said(case: str, caught_run: tuple[dict[str, tuple[str, Path]], subprocess.CompletedProcess[str]]) -> str:
    _, out = caught_run[0][case]
    return out.read_text() if out.exists() else ""


def ended_cleanly(caught_run: tuple[dict[str, tuple[str, Path]], subprocess.CompletedProcess[str]]) -> None:
    """The process exited 0 after its last case, as each case's own process did before it shared one."""
    done = caught_run[1]
    assert done.returncode == 0, done.stdout + done.stderr


def test_a_script_that_catches_the_keyboard_interrupt_saves_on(
    caught_run: tuple[dict[str, tuple[str, Path]], subprocess.CompletedProcess[str]],
) -> None:
    uri, _ = caught_run[0]["carry-on"]
    assert said("carry-on", caught_run).split() == ["interrupted", "saved", "3"], said("carry-on", caught_run)
    assert committed(uri) == [1, 3]
    ended_cleanly(caught_run)


RANKS_AT = ["staging", "upload"]


@pytest.fixture(scope="module")
def ranks_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, str], subprocess.CompletedProcess[str]]:
    """Both ``ranks`` cases in one 2-rank torchrun, one after the other, each with its own folder and
    Checkpointer (a launcher and two ranks less than a torchrun each): at -> its URI, and the run."""
    root = tmp_path_factory.mktemp("ranks")
    uris = {at: str(root / at / "ckpt") for at in RANKS_AT}
    cases = [arg for at in RANKS_AT for arg in ("--uri", uris[at], "--at", at)]
    return uris, harness.torchrun(2, SCRIPT, "ranks", *cases)


@pytest.mark.parametrize("at", RANKS_AT, ids=["while-preparing", "synchronous-mid-upload"])
def test_ctrl_c_on_one_rank_during_a_save_reaches_that_rank_and_no_rank_waits(
    at: str, ranks_run: tuple[dict[str, str], subprocess.CompletedProcess[str]]
) -> None:
    uris, done = ranks_run
    uri = uris[at]
    said = sorted(line.removeprefix(f"{at} ") for line in done.stdout.splitlines() if line.startswith(f"{at} rank"))
    assert said == ["rank0 KeyboardInterrupt", "rank1 SaveFailedError"], done.stdout + done.stderr
    assert committed(uri) == [1, 3]


@pytest.mark.parametrize("scheme", ["file", "s3"])
def test_an_interrupted_close_leaves_the_save_in_flight_what_it_uses_and_the_next_close_commits_it(
    scheme: str, caught_run: tuple[dict[str, tuple[str, Path]], subprocess.CompletedProcess[str]]
) -> None:
    uri, _ = caught_run[0][f"close-{scheme}"]
    lines = said(f"close-{scheme}", caught_run).splitlines()
    assert lines == ["close interrupted", "closed after committing 1"], "\n".join(lines)
    assert committed(uri) == [1], caught_run[1].stderr
    ended_cleanly(caught_run)


def test_ctrl_c_delivered_to_another_thread_still_interrupts_close_while_the_save_runs(
    caught_run: tuple[dict[str, tuple[str, Path]], subprocess.CompletedProcess[str]],
) -> None:
    """A process-directed SIGINT may land on any thread; Python then only sets a flag, and a main
    thread blocked in one long wait ran the handler only once the save was over (a hang, when
    the save waits on the main thread)."""
    uri, _ = caught_run[0]["close-other-thread"]
    lines = said("close-other-thread", caught_run).splitlines()
    assert lines == ["close interrupted", "while the save was held: True"], "\n".join(lines)
    assert committed(uri) == [1], caught_run[1].stderr
    ended_cleanly(caught_run)


def test_ctrl_c_in_a_with_block_whose_save_failed_ends_the_process_by_sigint(tmp_path: Path) -> None:
    uri = str(tmp_path / "ckpt")
    done = harness.run([harness.PYTHON, str(SCRIPT), "with-body", "--uri", uri], check=False)
    assert done.returncode == -signal.SIGINT, done.stdout + done.stderr
    assert "KeyboardInterrupt" in done.stderr and "the store refuses the upload" in done.stderr, done.stderr
    assert committed(uri) == []


def test_the_scripts_own_error_leaves_a_with_block_whose_save_failed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    def refuse(*a: object, **kw: object) -> None:
        raise StorageError("the store refuses the upload")

    # The outer block sees what leaves the Checkpointer's: the body's error, or its own.
    with (
        pytest.raises(ValueError, match="training diverged"),
        Checkpointer(str(tmp_path / "ckpt"), keep=None, async_save=True) as ckpt,
    ):
        ckpt.storage.put_file = refuse  # type: ignore[method-assign]
        ckpt.save(1, {"model": torch.nn.Linear(2, 2)})
        raise ValueError("training diverged")
    assert "closing the Checkpointer while ValueError propagates" in caplog.text
    assert "the store refuses the upload" in caplog.text
