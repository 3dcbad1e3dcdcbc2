"""What an operator meets at the command line when something is wrong: one plain line, the right
exit status, and nothing created or lost. Real ``spotjob`` and ``spotjob-agent`` processes.

The table runs each bad invocation in an empty folder and checks: the exit status; the words the
message must say (the option, the file and line, the cause); that no traceback or pydantic phrase
reaches the user; and that the folder is still empty afterwards (no run folder for a bad argument).
None of these cases trains: they end before any worker starts. Each runs in a process of its own
forked from one that has imported what the two commands import (scripts/cli_fork.py), run as the
console script runs it, in the folder, with the environment and the captured output a process
started afresh would have: the table pays for those imports once, not once per row.

Then the cases that need something in place first: a run name that is taken, a listing with
broken run folders in it, a checkpoint exported onto a full disk (a real ENOSPC from a small
tmpfs mounted in a user namespace, and a real EFBIG from RLIMIT_FSIZE), and a bucket that does
not exist (moto). The taken names and the broken run folders run their commands forked as the
table does; the exports, the bucket and the closed pipe start ``spotjob`` afresh. The export that
the EFBIG case must leave intact is made once, by the process that trains the checkpoints.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "scripts"))
from local_run_support import REPO, TRAIN, clean_env, tool

from orchestrator.model import CheckpointSpec, JobKey, JobSpec, JobStatus, Phase
from orchestrator.store import JsonFileJobStore
from tests.line_server import ask, line_server

pytestmark = pytest.mark.timeout(300)

SCRIPTS = Path(__file__).resolve().parent / "scripts"

FORBIDDEN = ("Traceback", "Input should be", "Value error", "errors.pydantic.dev", "ValidationError")
"""What no message may show an operator."""


@dataclass(frozen=True)
class Case:
    argv: list[str]
    """After the tool; ``{tmp}`` is the (empty) folder the command runs in, ``{train}`` the example."""
    code: int
    words: list[str]
    """Each must be in stderr (``{tmp}`` as above)."""
    tool: str = "spotjob"
    files: dict[str, str] = field(default_factory=dict)
    """Files to write in the folder first (they are the only things allowed to be there after)."""
    env: dict[str, str] = field(default_factory=dict)
    """Variables set for the command, on top of a clean environment."""


@pytest.fixture(scope="module")
def forker() -> Iterator[subprocess.Popen[str]]:
    """scripts/cli_fork.py: the table's invocations are processes forked from it (it has imported
    what ``spotjob`` and ``spotjob-agent`` import), each run as its console script runs it."""
    with line_server([sys.executable, str(SCRIPTS / "cli_fork.py")], cwd=REPO, env=clean_env()) as proc:
        yield proc


def run_forked(
    forker: subprocess.Popen[str], name: str, argv: list[str], *, cwd: Path, env: dict[str, str]
) -> subprocess.CompletedProcess[str]:
    """``name`` (spotjob, spotjob-agent) with ``argv`` in ``cwd``, a child of ``forker``, to its end
    (120 s at most), its output captured outside ``cwd``."""
    outputs = Path(tempfile.mkdtemp(prefix="cli-output-"))
    out, err = outputs / "stdout", outputs / "stderr"
    request = {
        "tool": name, "path": tool(name), "argv": argv, "cwd": str(cwd), "env": env,
        "out": str(out), "err": str(err), "timeout": 120,
    }  # fmt: skip
    code, hung = ask(forker, request, "scripts/cli_fork.py")
    stdout, stderr = out.read_text(errors="replace"), err.read_text(errors="replace")
    shutil.rmtree(outputs)
    assert not hung, f"{' '.join([name, *argv])} hung:\n{stdout[-4000:]}\n{stderr[-8000:]}"
    return subprocess.CompletedProcess([tool(name), *argv], code, stdout, stderr)


def run_case(c: Case, tmp: Path, forker: subprocess.Popen[str]) -> tuple[subprocess.CompletedProcess[str], str]:
    """The case's command in ``tmp`` (a child of ``forker``)."""
    for name, text in c.files.items():
        (tmp / name).write_text(text)
    argv = [a.format(tmp=tmp, train=TRAIN) for a in c.argv]
    proc = run_forked(forker, c.tool, argv, cwd=tmp, env={**clean_env(), **c.env})
    return proc, proc.stderr


def tree(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


T = "{train}"
TABLE: dict[str, Case] = {
    # -- the checkpoint URI -----------------------------------------------------------------------
    "a checkpoint URI that is a regular file": Case(
        ["run", "--checkpoint-uri", "{tmp}/afile", T], 2, ["--checkpoint-uri", "regular file, not a folder"],
        files={"afile": "x"},
    ),
    "an ftp:// checkpoint URI": Case(["run", "--checkpoint-uri", "ftp://x/y", T], 2, ["--checkpoint-uri", "'ftp'"]),
    "s3:// without a bucket": Case(["run", "--checkpoint-uri", "s3://", T], 2, ["--checkpoint-uri", "names no bucket"]),
    "gs:// without a bucket": Case(["run", "--checkpoint-uri", "gs://", T], 2, ["--checkpoint-uri", "names no bucket"]),
    "a gs:// bucket name GCS refuses": Case(  # was a run made and failed (InvalidCheckpointURI), exit 1
        ["run", "--checkpoint-uri", "gs://-b/run", T], 2,
        ["--checkpoint-uri", "'gs://-b/run'", "the bucket name '-b' must start and end with a letter or a digit"],
    ),
    "listing a gs:// URI whose bucket name GCS refuses": Case(  # was the client's bare words, no URI
        ["ckpt", "list", "gs://../run"], 2,
        ["'gs://../run'", "the bucket name '..' must start and end with a letter or a digit; correct the bucket"],
    ),
    "credentials in a checkpoint URI": Case(
        ["run", "--checkpoint-uri", "s3://AKIAIOSFODNN7EXAMPLE:wJalrXUtnFEMI@bucket/run", T], 2,
        ["--checkpoint-uri", "takes no credentials", "the URI is not repeated here"],
    ),
    "a checkpoint path starting with ~": Case(  # was ./~/ckpt under the working directory
        ["run", "--checkpoint-uri=~/ckpt", T], 2, ["--checkpoint-uri", "'~' is not expanded", "full path"]
    ),
    "a relative file:// URI": Case(
        ["run", "--checkpoint-uri", "file://rel/ckpt", T], 2, ["--checkpoint-uri", "absolute path"]
    ),
    "a checkpoint folder that cannot be created": Case(
        ["run", "--checkpoint-uri", "/proc/spotjob-nope/ckpt", T], 2, ["--checkpoint-uri", "cannot write in /proc"]
    ),
    # -- the name ---------------------------------------------------------------------------------
    "an empty --name": Case(["run", "--name", "", T], 2, ["--name ''", "DNS label"]),
    "a --name that is no DNS label": Case(["run", "--name", "Bad_Name", T], 2, ["--name 'Bad_Name'", "DNS label"]),
    # -- the trace --------------------------------------------------------------------------------
    "a trace holding a nested list": Case(
        ["run", "--trace", "trace.json", T], 2, ["--trace trace.json:1", "[1] is not a number of seconds"],
        files={"trace.json": "[[1]]"},
    ),
    "a trace holding null": Case(
        ["run", "--trace", "trace.json", T], 2, ["--trace trace.json:1", "null is not a number of seconds"],
        files={"trace.json": "[null]"},
    ),
    "a trace time too large to be finite": Case(
        ["run", "--trace", "trace.txt", T], 2, ["--trace trace.txt:2", "1e400 is not a finite number"],
        files={"trace.txt": "# seconds\n1e400\n"},
    ),
    "a JSON trace time too large to be finite": Case(
        ["run", "--trace", "trace.json", T], 2, ["--trace trace.json:3", "1e400 is not a finite number"],
        files={"trace.json": "[\n  5,\n  1e400\n]"},
    ),
    "a malformed trace line": Case(
        ["run", "--trace", "trace.txt", T], 2, ["--trace trace.txt:3", "'ten' is not a number of seconds"],
        files={"trace.txt": "5\n7.5\nten\n"},
    ),
    "a JSON trace never closed": Case(
        ["run", "--trace", "trace.json", T], 2, ["--trace trace.json:2", "not closed"],
        files={"trace.json": "[1,\n 2"},
    ),
    "a trace time before the start": Case(
        ["run", "--trace", "trace.txt", T], 2, ["--trace trace.txt:1", "before the start"],
        files={"trace.txt": "-3\n"},
    ),
    "a trace that does not exist": Case(["run", "--trace", "nope.txt", T], 2, ["--trace nope.txt", "cannot read"]),
    "a JSON trace of lists nested past what the parser recurses into": Case(
        ["run", "--trace", "trace.json", T], 2, ["--trace trace.json:1", "nested too deeply"],
        files={"trace.json": "[" * 100_000},
    ),
    "a JSON trace near the size limit whose last item is no number": Case(  # read in one pass, not minutes
        ["run", "--trace", "trace.json", T], 2, ["--trace trace.json:340001", "'\"x\"' is not a number"],
        files={"trace.json": "[" + "0,\n" * 340_000 + '"x"]'},
    ),
    # -- the plot ---------------------------------------------------------------------------------
    "a plot path that cannot be written": Case(
        ["run", "--plot", "/proc/spotjob-nope/run.png", T], 2, ["--plot /proc/spotjob-nope/run.png", "cannot write"]
    ),
    "a plot path that is a folder": Case(["run", "--plot", "{tmp}", T], 2, ["--plot", "that is a folder"]),
    "a plot in a format matplotlib cannot write": Case(
        ["run", "--plot", "run.txt", T], 2, ["--plot run.txt", "'.txt'", ".png"]
    ),
    # -- numbers ----------------------------------------------------------------------------------
    "--keep 0": Case(["run", "--keep", "0", T], 2, ["--keep must be at least 1, got 0"]),
    "--max-restarts -1": Case(["run", "--max-restarts", "-1", T], 2, ["--max-restarts must be at least 0"]),
    "--every-steps 0": Case(["run", "--every-steps", "0", T], 2, ["--every-steps must be at least 1"]),
    "--every-seconds -1": Case(["run", "--every-seconds", "-1", T], 2, ["--every-seconds must be a positive"]),
    "--notice inf": Case(["run", "--notice", "inf", T], 2, ["--notice must be a positive", "inf"]),
    "--interrupt-deadline 0": Case(
        ["run", "--interrupt-deadline", "0", T], 2, ["--interrupt-deadline must be a positive number of seconds"]
    ),
    "--interrupt-deadline over a day": Case(
        ["run", "--interrupt-deadline", "100000", T], 2, ["--interrupt-deadline must be", "at most 86400"]
    ),
    "--interrupt-deadline not a number": Case(
        ["run", "--interrupt-deadline", "soon", T], 2, ["--interrupt-deadline: must be a number of seconds", "soon"]
    ),
    "--flush-timeout nan": Case(["run", "--flush-timeout", "nan", T], 2, ["--flush-timeout must be a positive"]),
    "--restart-backoff -1": Case(["run", "--restart-backoff", "-1", T], 2, ["--restart-backoff must be"]),
    "--nproc 0": Case(["run", "--nproc", "0", T], 2, ["--nproc must be at least 1"]),
    "--nproc more than the machine can run": Case(
        ["run", "--nproc", "99999999999999999999", T], 2, ["--nproc must be at most", "ranks per CPU"]
    ),
    "--nproc abc": Case(["run", "--nproc", "abc", T], 2, ["--nproc", "must be a whole number", "'abc'"]),
    "--preempt-every 0": Case(["run", "--preempt-every", "0", T], 2, ["--preempt-every must be a positive"]),
    "--preempt-jitter 1.5": Case(["run", "--preempt-jitter", "1.5", T], 2, ["--preempt-jitter must be"]),
    "--preempt-at-step -1": Case(["run", "--preempt-at-step", "-1", T], 2, ["--preempt-at-step", "step >= 0"]),
    "--maintenance-at-step -1": Case(
        ["run", "--maintenance-at-step", "-1", T], 2, ["--maintenance-at-step", "step >= 0"]
    ),
    "a --flush-lead no shorter than the maintenance's notice": Case(  # the agents would hold nothing
        ["run", "--maintenance-at-step", "5", "--maintenance-notice", "10", "--flush-lead", "10", T],
        2,
        ["--flush-lead (10 s) must be shorter than --maintenance-notice (10 s)", "hold nothing"],
    ),
    "a --flush-lead above the default notice": Case(
        ["run", "--maintenance-at-step", "5", "--flush-lead", "30", T], 2, ["--maintenance-notice (20 s)"]
    ),
    "--maintenance-notice 0": Case(
        ["run", "--maintenance-at-step", "5", "--maintenance-notice", "0", T], 2, ["--maintenance-notice must be"]
    ),
    "--flush-lead without a planned maintenance": Case(
        ["run", "--flush-lead", "5", T], 2, ["--flush-lead", "add --maintenance-at-step N"]
    ),
    # -- what to run ------------------------------------------------------------------------------
    "no script": Case(["run"], 2, ["SCRIPT", "--resume NAME"]),
    "a script that does not exist": Case(["run", "nope.py"], 2, ["no such training script: nope.py"]),
    "a folder for a script": Case(["run", "{tmp}"], 2, ["SCRIPT {tmp} is a folder", "name the training script"]),
    "a runs folder that is a file": Case(
        ["run", "--runs-dir", "runs", T], 2, ["--runs-dir runs", "is a file, not a folder"], files={"runs": "x"}
    ),
    "an empty runs folder": Case(  # was the working directory itself
        ["run", "--runs-dir", "", T], 2, ["--runs-dir is empty", "./spotjob-runs"]
    ),
    "an export to an empty OUT": Case(  # was the working directory itself (an unset "$OUT")
        ["ckpt", "export", "{tmp}", "", "--force"], 2, ["OUT is empty", "name the folder"]
    ),
    "an export to an s3:// OUT": Case(  # was a local folder named 's3:' under the working directory
        ["ckpt", "export", "{tmp}", "s3://bucket/export"], 2, ["OUT 's3://bucket/export' is a URI", "local path"]
    ),
    "an export to a gs:/ OUT, one slash short": Case(  # was a local folder named 'gs:', exit 0
        ["ckpt", "export", "{tmp}", "gs:/bucket/export"], 2,
        ["OUT 'gs:/bucket/export' is a URI", "a folder named 'gs:' here", "local path"],
    ),
    "an export to a GS:bucket OUT, with no slash": Case(  # was a local folder named 'GS:bucket'
        ["ckpt", "export", "{tmp}", "GS:bucket"], 2, ["OUT 'GS:bucket' is a URI", "a folder named 'GS:bucket' here"],
    ),
    "an export to a file: OUT": Case(
        ["ckpt", "export", "{tmp}", "file:export"], 2, ["OUT 'file:export' is a URI", "local path"],
    ),
    # -- resuming ---------------------------------------------------------------------------------
    "resuming a run that does not exist": Case(["run", "--resume", "nope"], 2, ["no run named 'nope'", "to resume"]),
    "status of an empty runs folder": Case(["status", "--runs-dir", ""], 2, ["--runs-dir is empty", "./spotjob-runs"]),
    "resuming under an empty runs folder": Case(  # was the working directory itself
        ["run", "--resume", "nope", "--runs-dir", ""], 2, ["--runs-dir is empty", "./spotjob-runs"]
    ),
    "resuming with a script": Case(["run", "--resume", "nope", T], 2, ["--resume nope takes no SCRIPT"]),
    "resuming with an option of the spec": Case(
        ["run", "--resume", "nope", "--nproc", "4", "--keep", "2"], 2, ["drop --nproc, --keep"]
    ),
    "resuming a name that is no DNS label": Case(["run", "--resume", "Nope!"], 2, ["--resume 'Nope!'", "DNS label"]),
    # -- status -----------------------------------------------------------------------------------
    "the status of a run that does not exist": Case(["status", "nope"], 2, ["no run named 'nope'"]),
    # -- the environment --------------------------------------------------------------------------
    "a log level that is no level": Case(
        ["status"], 2, ["SPOTJOB_LOG_LEVEL='loud'", "debug, info, warning, error"], env={"SPOTJOB_LOG_LEVEL": "loud"}
    ),
    "an empty log level": Case(["status", "nope"], 2, ["no run named 'nope'"], env={"SPOTJOB_LOG_LEVEL": ""}),
    "a log level in lower case": Case(
        ["status", "nope"], 2, ["no run named 'nope'"], env={"SPOTJOB_LOG_LEVEL": "debug"}
    ),
    # -- the agent --------------------------------------------------------------------------------
    "spotjob-agent with an ftp:// URI": Case(
        ["--checkpoint-uri", "ftp://x", "--", "true"], 2, ["--checkpoint-uri", "'ftp'"], tool="spotjob-agent"
    ),
    "spotjob-agent with a control folder that is a file": Case(  # was a FileExistsError traceback, exit 1
        ["--notices", "none", "--checkpoint-uri", "s3://b/p", "--control-dir", "{tmp}/afile", "--", "true"], 2,
        ["--control-dir {tmp}/afile", "a file, not a folder"], tool="spotjob-agent", files={"afile": "x"},
    ),
    "spotjob-agent with a control folder that cannot be made": Case(
        ["--notices", "none", "--checkpoint-uri", "s3://b/p", "--control-dir", "/proc/spotjob-nope/c", "--", "true"],
        2, ["--control-dir /proc/spotjob-nope/c", "No such file or directory"], tool="spotjob-agent",
    ),
    "a command that exits 75 by itself under spotjob-agent": Case(
        ["--notices", "none", "--checkpoint-uri", "{tmp}/ckpt", "--", sys.executable, "-c", "raise SystemExit(75)"],
        1,
        ["exited 75 by itself", "reporting 1"],
        tool="spotjob-agent",
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", list(TABLE))
def test_a_bad_invocation_exits_with_one_plain_message_and_creates_nothing(
    tmp_path: Path, forker: subprocess.Popen[str], case: str
) -> None:
    c = TABLE[case]
    proc, err = run_case(c, tmp_path, forker)

    assert proc.returncode == c.code, f"{case}: exit {proc.returncode}\n{err[-3000:]}"
    for word in c.words:
        assert word.format(tmp=tmp_path) in err, f"{case}: {word!r} not in:\n{err[-3000:]}"
    for phrase in (*FORBIDDEN, "wJalrXUtnFEMI"):  # the last: the secret of the credentials case
        assert phrase not in err + proc.stdout, f"{case}: {phrase!r} reached the user:\n{err[-3000:]}"
    assert tree(tmp_path) == set(c.files), f"{case}: created {sorted(tree(tmp_path) - set(c.files))}"


# -- a name that is taken -------------------------------------------------------------------------


def make_run(runs: Path, name: str, phase: Phase = Phase.SUCCEEDED) -> Path:
    """A run folder as ``spotjob run`` leaves it, written through the store (no training)."""
    folder = runs / name
    store = JsonFileJobStore(str(folder), fsync=False)
    key = JobKey.local(name)
    stored = store.create(key, JobSpec(command=[str(TRAIN)], checkpoint=CheckpointSpec(uri=str(folder / "ckpt"))))
    now = datetime.now(UTC)
    status = JobStatus(phase=phase, reason="Completed", message="every worker exited 0", created_at=now)
    store.update_status(key, status, version=stored.version)
    return folder


def snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def spotjob_run(forker: subprocess.Popen[str], cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``spotjob run ARGS`` in ``cwd`` (its runs folder is ``cwd/spotjob-runs``), output captured."""
    return run_forked(forker, "spotjob", ["run", *args], cwd=cwd, env=clean_env())


def test_a_run_name_that_is_taken_is_refused_naming_resume_and_its_folder_is_left_as_it_was(
    tmp_path: Path, forker: subprocess.Popen[str]
) -> None:
    # A run whose driver was killed: one that ended is refused with nothing to resume (test_cli_run_options).
    folder = make_run(tmp_path / "spotjob-runs", "taken", Phase.RESCHEDULING)
    before = snapshot(folder)

    proc = spotjob_run(forker, tmp_path, "--name", "taken", str(TRAIN))

    assert proc.returncode == 2, proc.stderr
    assert "a run named 'taken' exists" in proc.stderr and "spotjob run --resume taken" in proc.stderr
    assert snapshot(folder) == before


def test_resuming_a_run_that_ended_says_there_is_nothing_to_resume(
    tmp_path: Path, forker: subprocess.Popen[str]
) -> None:
    folder = make_run(tmp_path / "spotjob-runs", "done")
    before = snapshot(folder)

    proc = spotjob_run(forker, tmp_path, "--resume", "done")

    assert proc.returncode == 2, proc.stderr
    assert "run 'done' succeeded already" in proc.stderr and "nothing to resume" in proc.stderr
    uri = folder / "ckpt"  # how to carry on from its checkpoints in a new run
    assert f"spotjob ckpt adopt {uri} --job local/NEW" in proc.stderr
    assert f"spotjob run --name NEW --checkpoint-uri {uri} SCRIPT ..." in proc.stderr
    assert {k: v for k, v in snapshot(folder).items() if k != "driver.lock"} == before


def older_run(runs: Path, name: str) -> Path:
    """A run folder as a spotjob from before 2026-12-01 left it (6adcd45's ``spotjob run``, killed
    mid-run): the job file ``<run>/<name>.json``, no ``local/`` folder, checkpoints under
    ``checkpoints/`` whose manifests name the job without a namespace."""
    folder = runs / name
    (folder / "checkpoints" / "step-000000010").mkdir(parents=True)
    (folder / "checkpoints" / "step-000000010" / "MANIFEST.json").write_text(json.dumps({"step": 10, "job": name}))
    spec = {"name": name, "command": [str(TRAIN)], "replicas": 1, "nprocPerNode": 2}
    status = {"phase": "Running", "reason": "WorkersRunning", "attempt": {"number": 0}}
    (folder / f"{name}.json").write_text(json.dumps({"spec": spec, "status": status}))
    (folder / "run.json").write_text(json.dumps({"pid": 2**22 + 1, "argv": ["spotjob", "run"]}))
    return folder


def test_an_older_spotjobs_run_is_not_resumed_and_the_message_says_how_to_carry_on_from_its_checkpoints(
    tmp_path: Path, forker: subprocess.Popen[str]
) -> None:
    folder = older_run(tmp_path / "spotjob-runs", "old")
    before = snapshot(folder)

    proc = spotjob_run(forker, tmp_path, "--resume", "old")

    assert proc.returncode == 2, proc.stderr
    assert "no run named" not in proc.stderr
    assert "written by a spotjob from before 2026-12-01" in proc.stderr and "cannot be resumed" in proc.stderr
    uri = folder / "checkpoints"
    assert f"spotjob ckpt adopt {uri} --job local/NEW" in proc.stderr
    assert f"spotjob run --name NEW --checkpoint-uri {uri}" in proc.stderr
    assert snapshot(folder) == before


def test_a_new_run_under_the_name_of_an_older_spotjobs_run_is_refused_and_its_folder_left_as_it_was(
    tmp_path: Path, forker: subprocess.Popen[str]
) -> None:
    folder = older_run(tmp_path / "spotjob-runs", "old")
    before = snapshot(folder)

    proc = spotjob_run(forker, tmp_path, "--name", "old", str(TRAIN))

    assert proc.returncode == 2, proc.stderr
    assert "written by a spotjob from before 2026-12-01" in proc.stderr and "pick another --name" in proc.stderr
    assert snapshot(folder) == before


# -- a listing with broken run folders ------------------------------------------------------------

BREAKAGES: dict[str, Callable[[Path, str], None]] = {
    "not-json": lambda f, n: (f / "local" / f"{n}.json").write_text("{garbage"),
    "bad-phase": lambda f, n: _edit(f / "local" / f"{n}.json", lambda d: d["status"].update(phase="Bogus")),
    "bad-spec": lambda f, n: _edit(f / "local" / f"{n}.json", lambda d: d["spec"].update(nprocPerNode=0)),
    "job-is-a-folder": lambda f, n: _replace_with_folder(f / "local" / f"{n}.json"),
    "events-a-folder": lambda f, n: _replace_with_folder(f / "local" / f"{n}.events.jsonl"),
    "events-not-text": lambda f, n: (f / "local" / f"{n}.events.jsonl").write_bytes(b"\xff\xfe\x00garbage\n"),
    "naive-times": lambda f, n: (
        _edit(f / "local" / f"{n}.json", lambda d: d["status"].update(createdAt="2020-01-01T00:00:00")),
        (f / "local" / f"{n}.events.jsonl").write_text(
            '{"time": "2020-01-01T00:00:00", "type": "Normal", "reason": "X", "message": "no zone"}\n'
        ),
        (f / "run.json").write_text("[1, 2]"),
    ),
}


def _edit(path: Path, change: Callable[[dict[str, Any]], object]) -> None:
    doc = json.loads(path.read_text())
    change(doc)
    path.write_text(json.dumps(doc))


def _replace_with_folder(path: Path) -> None:
    if path.exists():
        path.unlink()
    path.mkdir()


def test_broken_run_folders_are_one_line_each_saying_what_is_wrong_and_the_rest_of_the_table_stands(
    tmp_path: Path, forker: subprocess.Popen[str]
) -> None:
    runs = tmp_path / "spotjob-runs"
    make_run(runs, "healthy")
    for name, breakage in BREAKAGES.items():
        breakage(make_run(runs, name), name)

    listing = run_forked(forker, "spotjob", ["status"], cwd=tmp_path, env=clean_env())

    assert listing.returncode == 0, listing.stderr
    assert not any(p in listing.stdout + listing.stderr for p in FORBIDDEN), listing.stdout + listing.stderr
    lines = listing.stdout.splitlines()
    rows = {line.split()[0]: line for line in lines[1:] if line.strip()}
    assert set(rows) == {"healthy", *BREAKAGES}, listing.stdout
    assert len(lines) == 1 + 1 + len(BREAKAGES), "one header and one line per run"
    assert "Succeeded" in rows["healthy"]
    assert "unreadable" in rows["not-json"] and "is not JSON" in rows["not-json"]
    assert "unreadable" in rows["bad-phase"] and "status.phase" in rows["bad-phase"]
    assert "spec.nprocPerNode: must be greater than or equal to 1" in rows["bad-spec"]
    assert "unreadable" in rows["job-is-a-folder"]
    for name in ("events-a-folder", "events-not-text", "naive-times"):
        assert "Succeeded" in rows[name], rows[name]

    for name in BREAKAGES:
        detail = run_forked(forker, "spotjob", ["status", name], cwd=tmp_path, env=clean_env())
        shown = detail.stdout + detail.stderr
        assert detail.returncode == 0 and not any(p in shown for p in FORBIDDEN), f"{name}:\n{shown}"
    detail = run_forked(forker, "spotjob", ["status", "events-a-folder"], cwd=tmp_path, env=clean_env())
    assert "its events cannot be read" in detail.stdout


# -- ckpt export onto a full disk -----------------------------------------------------------------


# One process trains (examples/train.py as its __main__) and then exports step 1 as `spotjob ckpt
# export` does (orchestrator.cli.main): the scene both export tests start from, for one torch import.
SCENE = """
import runpy, sys
from orchestrator.cli import main as spotjob
train, uri, earlier = sys.argv[1:]
sys.argv = [train, "--steps", "2", "--every-steps", "1", "--uri", uri]
try:
    runpy.run_path(train, run_name="__main__")
except SystemExit as e:
    if e.code:
        raise
raise SystemExit(spotjob(["ckpt", "export", uri, earlier, "--step", "1"]))
"""


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Committed checkpoints of examples/train.py (one process, no torchrun), steps 1 and 2; beside
    them, ``export-step-1``: step 1 exported by ``spotjob ckpt export`` in the same process."""
    uri = tmp_path_factory.mktemp("export") / "ckpt"
    proc = subprocess.run(
        [sys.executable, "-c", SCENE, str(TRAIN), str(uri), str(uri.parent / "export-step-1")],
        cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    return uri


@pytest.fixture
def earlier_export(tmp_path: Path, checkpoints: Path) -> Path:
    """``tmp_path/out``: an export of step 1 (a copy of the one ``checkpoints`` made)."""
    out = tmp_path / "out"
    shutil.copytree(checkpoints.parent / "export-step-1", out)
    return out


def _user_namespaces() -> bool:
    unshare = shutil.which("unshare")
    if unshare is None:
        return False
    probe = subprocess.run([unshare, "--user", "--map-root-user", "--mount", "true"], capture_output=True)
    return probe.returncode == 0


def _fsize_limit(limit: int) -> Callable[[], None]:
    def apply() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return apply


def test_an_export_onto_a_full_disk_says_so_and_leaves_nothing_behind(tmp_path: Path, checkpoints: Path) -> None:
    if not _user_namespaces():
        pytest.skip("no user namespaces here (unshare --user --mount): no small tmpfs to fill without root")
    disk = tmp_path / "disk"
    disk.mkdir()
    # A 4 KiB tmpfs, mounted in a mount namespace of the export's own: the kernel's ENOSPC, for real.
    script = f'mount -t tmpfs -o size=4k tmpfs "{disk}" && exec "$0" ckpt export "$1" "$2"'
    proc = subprocess.run(
        ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", script,
         tool("spotjob"), str(checkpoints), str(disk / "out")],
        cwd=tmp_path, env=clean_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip

    assert proc.returncode == 2, proc.stderr
    assert "no space left on the device" in proc.stderr and str(disk / "out") in proc.stderr
    assert not any(p in proc.stderr for p in FORBIDDEN), proc.stderr
    assert "SafetensorError" not in proc.stderr
    assert list(disk.iterdir()) == [], "the namespace's tmpfs is gone; nothing was written beneath it"


def test_an_export_that_cannot_grow_a_file_keeps_the_earlier_export_it_was_to_replace(
    tmp_path: Path, checkpoints: Path, earlier_export: Path
) -> None:
    out = earlier_export
    earlier = snapshot(out)
    assert "model.safetensors.index.json" in earlier, sorted(earlier)

    # RLIMIT_FSIZE: the kernel refuses to grow any file past 4 KiB (EFBIG), as a full quota would.
    again = subprocess.run(
        [tool("spotjob"), "ckpt", "export", str(checkpoints), str(out), "--force"],
        cwd=tmp_path, env=clean_env(), capture_output=True, text=True, timeout=300,
        preexec_fn=_fsize_limit(4096),
    )  # fmt: skip

    assert again.returncode == 2, again.stderr
    assert "file-size limit" in again.stderr and "nothing was exported" in again.stderr
    assert not any(p in again.stderr for p in FORBIDDEN), again.stderr
    assert snapshot(out) == earlier, "the export it was to replace is intact, and no partial file is left"


# -- a bucket that does not exist -----------------------------------------------------------------


def test_a_run_against_a_bucket_that_does_not_exist_fails_at_once_saying_so(tmp_path: Path, moto_server: str) -> None:
    proc = subprocess.run(
        [tool("spotjob"), "run", "--no-live", "--name", "nobucket", "--checkpoint-uri",
         "s3://spotjob-no-such-bucket/job", str(TRAIN)],
        cwd=tmp_path, env=clean_env(), capture_output=True, text=True, timeout=120,
    )  # fmt: skip

    assert proc.returncode == 1, proc.stderr[-4000:]
    assert "nobucket failed: StorageRefused" in proc.stderr
    assert "spotjob-no-such-bucket" in proc.stderr and "does not exist" in proc.stderr
    assert "fix the URI, the bucket or the credentials" in proc.stderr
    assert not any(p in proc.stderr for p in FORBIDDEN)
    assert "botocore" not in proc.stderr, "the cloud client's INFO chatter is quiet without -v, as in spotjob ckpt"
    run = tmp_path / "spotjob-runs" / "nobucket"
    status = json.loads((run / "local" / "nobucket.json").read_text())["status"]
    assert (status["phase"], status["reason"]) == ("Failed", "StorageRefused")
    assert not list((run / "logs").iterdir()), "no worker was started"


@pytest.mark.parametrize("named", [False, True])
def test_a_status_table_whose_reader_left_the_pipe_is_exit_141_without_a_word(tmp_path: Path, named: bool) -> None:
    """`spotjob status | head -1`: rich's own answer to a broken pipe was exit 1; every other
    command of spotjob exits 141, as a shell pipeline's writer does."""
    runs = tmp_path / "spotjob-runs"
    make_run(runs, "r1")
    read_end, write_end = os.pipe()
    os.close(read_end)  # every write now fails with EPIPE, as once `head` has left
    try:
        proc = subprocess.run(
            [tool("spotjob"), "status", *(["r1"] if named else []), "--runs-dir", str(runs)],
            cwd=tmp_path, env=clean_env(), stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=120,
        )  # fmt: skip
    finally:
        os.close(write_end)
    assert proc.returncode == 128 + 13 and proc.stderr == "", proc.stderr
