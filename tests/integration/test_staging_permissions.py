"""The default staging folder of an object-store job lies under the node's shared temp folder
(``/tmp``), at a name anyone on the node can predict. It holds the rank's staged saves and the
restore cache, whose files a restore trusts once their ``.verified`` marker vouches for them.

So spotjob makes that folder itself, closed to other users, and refuses one that is not: a
symlink someone planted (the saves and the cache would land where it points, and the cache's
lock files would be opened through it), a folder of another user, or one others can write.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from agent.checkpoint import Checkpointer, StorageRefusedError
from agent.restore_cache import prefetch, staging_root
from agent.storage import Storage

sys.path.insert(0, str(Path(__file__).resolve().parent / "scripts"))
from ckpt_compare import assert_same
from ckpt_state import make_state, snapshot, train

JOB = "team/a"


@pytest.fixture
def node_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The node's shared temp folder (``tempfile.gettempdir()``), here a fresh one per test."""
    tmp = tmp_path / "node-tmp"
    tmp.mkdir()
    tmp.chmod(0o1777)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    return tmp


@pytest.fixture
def bucket(
    fresh_uri: Callable[[str], str], make_storage: Callable[[str], Storage]
) -> Iterator[tuple[str, Storage, dict[str, Any]]]:
    """An S3 URI holding a committed step 3 of ``JOB``, its storage, and the state saved."""
    uri = fresh_uri("s3")
    state = make_state(0)
    train(state, 3)
    with Checkpointer(uri, keep=None, job=JOB) as ckpt:
        ckpt.save(3, state)
    yield uri, make_storage(uri), snapshot(state)


def staging_parent(node_tmp: Path, storage: Storage) -> Path:
    """The folder directly under the node's temp folder that holds the job's staging folder."""
    parent = Path(staging_root(storage, JOB))
    while parent.parent != node_tmp:
        parent = parent.parent
    return parent


def test_the_default_staging_folder_is_closed_to_other_users_and_a_restore_works_through_it(
    node_tmp: Path, bucket: tuple[str, Storage, dict[str, Any]]
) -> None:
    uri, storage, saved = bucket
    parent = staging_parent(node_tmp, storage)
    mode = stat.S_IMODE(parent.lstat().st_mode)
    assert mode & 0o077 == 0, f"{parent} is mode {mode:o}: other users can read the staged checkpoints"
    assert parent.lstat().st_uid == os.getuid()

    assert prefetch(storage, staging_root(storage, JOB)) == "step-000000003"
    state = make_state(0, seed=9)
    with Checkpointer(uri, job=JOB) as ckpt:
        assert ckpt.restore(state) == 3
    assert_same(snapshot(state), saved, "restored state")


@pytest.mark.parametrize("planted", ["symlink", "folder others can write", "another user's folder"])
def test_a_folder_someone_else_made_at_the_default_staging_name_is_refused_and_nothing_goes_in(
    tmp_path: Path, node_tmp: Path, bucket: tuple[str, Storage, dict[str, Any]], planted: str
) -> None:
    uri, storage, _ = bucket
    parent = staging_parent(node_tmp, storage)  # the name spotjob uses; then someone got there first
    shutil.rmtree(parent)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    if planted == "symlink":
        parent.symlink_to(elsewhere, target_is_directory=True)
    elif planted == "folder others can write":
        parent.mkdir()
        parent.chmod(0o777)
    else:
        if os.getuid() != 0:
            pytest.skip("making a folder owned by another user needs root")
        parent.mkdir(mode=0o700)
        os.chown(parent, 65534, 65534)

    with pytest.raises(OSError, match="staging folder") as refused:
        prefetch(storage, staging_root(storage, JOB))
    assert str(parent) in str(refused.value)
    with pytest.raises(OSError, match="staging folder"):
        Checkpointer(uri, job=JOB)
    assert list(elsewhere.rglob("*")) == [], "the checkpoint went where the planted symlink leads"
    if not parent.is_symlink():
        assert list(parent.rglob("*")) == [], "the checkpoint went into a folder others can reach"


# -- a file where a folder is expected ------------------------------------------------------------


@pytest.mark.parametrize("under", [False, True])
def test_a_staging_dir_that_is_or_lies_under_a_regular_file_is_refused_at_construction_naming_it(
    tmp_path: Path, under: bool
) -> None:
    a_file = tmp_path / "a-file"
    a_file.write_text("not a folder")
    given = a_file / "staging" if under else a_file
    with pytest.raises(ValueError, match="staging_dir") as refused:
        Checkpointer(str(tmp_path / "ckpt"), staging_dir=str(given))
    assert str(given) in str(refused.value) and "a regular file, not a folder" in str(refused.value)
    assert a_file.read_text() == "not a folder"


def test_a_relative_staging_dir_names_the_folder_it_named_when_the_checkpointer_was_built(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A script that changes its working folder after building the Checkpointer (a run folder per
    experiment) staged each save under the new folder: not the one checked and cleaned at
    construction, so a killed save's copy there was never removed, and where that name is a file
    every save failed."""
    (tmp_path / "built").mkdir()
    (tmp_path / "later").mkdir()
    (tmp_path / "later" / "stage").write_text("not a folder")
    monkeypatch.chdir(tmp_path / "built")
    state = make_state(0)
    with Checkpointer(str(tmp_path / "ckpt"), staging_dir="stage", async_save=False) as ckpt:
        monkeypatch.chdir(tmp_path / "later")
        ckpt.save(1, state)
        assert ckpt.config.staging_dir == str(tmp_path / "built" / "stage")
    assert (tmp_path / "ckpt" / "step-000000001" / "MANIFEST.json").is_file()
    assert (tmp_path / "later" / "stage").read_text() == "not a folder"
    assert (tmp_path / "built" / "stage").is_dir()


@pytest.mark.parametrize("under", [False, True])
def test_a_folder_uri_that_is_or_lies_under_a_regular_file_is_refused_naming_the_uri_with_the_default_staging(
    tmp_path: Path, under: bool
) -> None:
    """The default staging folder of a filesystem store lies inside the URI's folder: the URI's
    own refusal is what the user sees, not a bare NotADirectoryError from the staging folder."""
    a_file = tmp_path / "a-file"
    a_file.write_text("not a folder")
    uri = a_file / "ckpt" if under else a_file
    with pytest.raises(StorageRefusedError) as refused:
        Checkpointer(str(uri))
    assert str(uri) in str(refused.value) and "Retrying cannot help" in str(refused.value)
    assert a_file.read_text() == "not a folder"


# -- no writable temporary folder at all (a read-only root filesystem) ---------------------------

_TEMP_FOLDERS = ("/tmp", "/var/tmp", "/usr/tmp")
"""Where Python's ``tempfile.gettempdir()`` looks, after TMPDIR and before the working folder."""

_CONSTRUCT = """
import sys
try:
    from agent.checkpoint import Checkpointer
    Checkpointer(sys.argv[1], job="team/a")
except OSError as e:
    print(f"{type(e).__name__}: {e}")
    sys.exit(3)
"""

_AS_TORCH_2_9 = """
import importlib.abc
import sys
import tempfile


class MakesATemporaryFolder(importlib.abc.MetaPathFinder):
    # What torch 2.9.1's torch.distributed.nn.jit.instantiator does when DCP is imported.
    def find_spec(self, name, path, target=None):
        if name == "torch.distributed.checkpoint":
            tempfile.TemporaryDirectory()
        return None


sys.meta_path.insert(0, MakesATemporaryFolder())
"""


def _read_only_temp_folders(argv: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    """``argv`` with every folder ``gettempdir()`` tries bind-mounted read-only (in a user and mount
    namespace of its own), TMPDIR unset, and ``cwd`` (under /tmp) read-only with them: what a pod
    with ``readOnlyRootFilesystem: true`` and no emptyDir at /tmp gives."""
    unshare = shutil.which("unshare")
    probe = unshare and subprocess.run([unshare, "--user", "--map-root-user", "--mount", "true"], capture_output=True)
    if not probe or probe.returncode != 0:
        pytest.skip("no user namespaces here (unshare --user --mount): no read-only mount to make")
    binds = " && ".join(
        f"mount --bind {d} {d} && mount -o remount,bind,ro {d}" for d in _TEMP_FOLDERS if os.path.isdir(d)
    )
    env = {k: v for k, v in os.environ.items() if k != "TMPDIR" and not k.startswith("SPOTJOB_")}
    env.update(PYTHONPATH=str(Path(__file__).resolve().parents[2]), OMP_NUM_THREADS="1")
    script = f'{binds} && exec "$@"'
    return subprocess.run(
        [unshare, "--user", "--map-root-user", "--mount", "sh", "-c", script, "sh", *argv],
        cwd=cwd, env=env, text=True, capture_output=True, timeout=300,
    )  # fmt: skip


def test_without_a_writable_temp_folder_the_checkpointer_and_the_agent_say_which_folder_to_give(
    tmp_path: Path, fresh_uri: Callable[[str], str]
) -> None:
    """A read-only root filesystem: an object-store job's default staging folder (under the temp
    folder) and the agent's default control folder have nowhere to go. Both said only Python's
    ``FileNotFoundError: No usable temporary directory found in [...]``, with a traceback; they
    name the option that gives them a writable folder instead. Under torch 2.9.1 the Checkpointer's
    import itself failed so, as torch made a temporary folder; that is simulated here for any torch."""
    uri = fresh_uri("s3")
    script = tmp_path / "construct.py"
    script.write_text(_CONSTRUCT)
    done = _read_only_temp_folders([sys.executable, str(script), uri], cwd=tmp_path)
    assert done.returncode == 3, done.stdout + done.stderr[-3000:]
    said = done.stdout
    assert said.startswith("StagingFolderError: no writable temporary folder"), said
    assert "read-only root filesystem" in said and "SPOTJOB_STAGING_DIR" in said and "staging_dir=" in said
    assert "TMPDIR" in said, said

    # A torch that makes a temporary folder when DCP is imported (2.9.1) failed in that import,
    # with tempfile's FileNotFoundError; now the import says the same.
    script.write_text(_AS_TORCH_2_9 + _CONSTRUCT)
    done = _read_only_temp_folders([sys.executable, str(script), uri], cwd=tmp_path)
    assert done.returncode == 3, done.stdout + done.stderr[-3000:]
    said = done.stdout
    assert said.startswith("StagingFolderError: no writable temporary folder: torch"), said
    assert "read-only root filesystem" in said and "TMPDIR" in said and "SPOTJOB_STAGING_DIR" in said, said

    agent = str(Path(sys.executable).parent / "spotjob-agent")
    done = _read_only_temp_folders(
        [agent, "--checkpoint-uri", uri, "--control-port", "0", "--", sys.executable, "-c", "pass"], cwd=tmp_path
    )
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    assert "no writable temporary folder" in done.stderr and "--control-dir" in done.stderr, done.stderr[-3000:]
