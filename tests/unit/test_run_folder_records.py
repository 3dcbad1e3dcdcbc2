"""A local run folder's own records (``orchestrator.run_folder``): ``run.json`` and ``cloud.json``
are replaced in one rename and read within bounds, as spotjob's other small files are
(``agent.atomic_file``, ``agent.control_channel.read_json``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from orchestrator.run_folder import CLOUD_FILE, RUN_FILE, run_file_workdir, write_run_file

_REWRITE_UNDER_A_LIMIT = """
import resource, sys
from orchestrator.run_folder import write_run_file
limit = int(sys.argv[2])
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
try:
    write_run_file(sys.argv[1], "/somewhere/else", ["spotjob", "run", "--resume", "x" * 4000], parent_grace=30.0)
except OSError as e:
    print("refused:", e)
"""


def test_a_run_file_the_disk_cannot_take_whole_leaves_the_previous_drivers_record(tmp_path: Path) -> None:
    """Fails without the fix: ``run.json`` was truncated, then written in place, so a full disk
    (here a file-size limit, which the kernel enforces with a short write as a full disk does) or a
    driver killed in the middle left it cut short: the folder the run's workers ran in was lost,
    and the next ``--resume`` ran them wherever it was typed. The previous record stays whole."""
    write_run_file(str(tmp_path), "/project", ["spotjob", "run", "train.py"], parent_grace=30.0)
    limit = os.path.getsize(tmp_path / RUN_FILE) + 100
    done = subprocess.run(
        [sys.executable, "-c", _REWRITE_UNDER_A_LIMIT, str(tmp_path), str(limit)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "refused:" in done.stdout, "the child's record fitted under the limit: make it longer"
    assert run_file_workdir(str(tmp_path)) == "/project"
    assert [p.name for p in tmp_path.iterdir()] == [RUN_FILE], "a temporary file was left behind"


_STATUS_OF = """
import sys
from orchestrator.cli_status import read_run
record = read_run(sys.argv[1], sys.argv[2])
print("\\n".join(record.notes))
"""


def test_a_cloud_record_that_is_no_file_is_told_with_what_to_write_not_waited_on(tmp_path: Path) -> None:
    """Fails without the fix: ``spotjob status`` opened ``cloud.json`` as it found it, so one that
    is a FIFO hung the listing of every run (and ``--resume``) for good, and a large one was read
    whole. It is read as control files are (no FIFO's wait, at most 1 MiB), and the note says what
    to write there."""
    from orchestrator.run_config import RunConfig
    from orchestrator.run_driver import LocalRun

    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    runs = tmp_path / "runs"
    LocalRun(RunConfig(script=str(script), args=[], name="fifo", runs_dir=str(runs), nproc=1)).close()
    record = runs / "fifo" / CLOUD_FILE
    record.unlink()
    os.mkfifo(record)
    try:
        done = subprocess.run(
            [sys.executable, "-c", _STATUS_OF, str(runs), "fifo"], capture_output=True, text=True, timeout=60
        )
    except subprocess.TimeoutExpired:
        raise AssertionError(f"reading the run folder waited on its {CLOUD_FILE}, a FIFO") from None
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"{record} is not a JSON object" in done.stdout, done.stdout
    assert 'write {"cloud": "aws"} in it (or "gcp" or "azure", the --cloud the run was started with)' in done.stdout


def test_a_new_run_whose_cloud_cannot_be_recorded_is_not_made(tmp_path: Path) -> None:
    """Fails without the fix: the job was stored before ``cloud.json`` was written, and a write that
    failed (here a folder in its place; a full disk alike) left the job without it: the name was
    taken ("a run named ... exists: resume it"), and ``--resume`` simulated AWS for a run started
    with ``--cloud gcp``, or was refused. The run is not made: its job file goes with the failure."""
    import pytest

    from orchestrator.model import JobKey
    from orchestrator.run_config import RunConfig
    from orchestrator.run_driver import LocalRun
    from orchestrator.store import JsonFileJobStore

    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    runs = tmp_path / "runs"
    (runs / "gcp" / CLOUD_FILE).mkdir(parents=True)
    config = RunConfig(script=str(script), args=[], name="gcp", runs_dir=str(runs), nproc=1, cloud="gcp")
    with pytest.raises(OSError):
        LocalRun(config)
    assert not os.path.exists(JsonFileJobStore(str(runs / "gcp"), create=False).path(JobKey.local("gcp")))

    (runs / "gcp" / CLOUD_FILE).rmdir()
    LocalRun(config).close()  # the name is free, and the run is made whole
    resumed = LocalRun.resume(str(runs), "gcp")
    try:
        assert resumed.config.cloud == "gcp"
    finally:
        resumed.close()
