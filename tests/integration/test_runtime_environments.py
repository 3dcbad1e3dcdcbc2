"""spotjob's commands and the Checkpointer under the environments real users and containers give
them: a stdout that cannot encode every character (``PYTHONIOENCODING=ascii``, a Latin-1 locale),
and a C locale with UTF-8 mode off, where a non-ASCII folder name cannot be decoded.

Each test runs the real command in a subprocess with that environment, against checkpoints a real
``Checkpointer`` wrote, and checks what the user sees: the whole answer and the command's own
exit status, never a ``UnicodeEncodeError`` traceback.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from torch import nn

from agent import Checkpointer

BIN = Path(sys.executable).parent
REPO = Path(__file__).resolve().parents[2]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPOTJOB_")}
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", **extra)
    return env


def _run(*argv: str, cwd: Path, **extra: str) -> subprocess.CompletedProcess[str]:
    # The output is read back as UTF-8: whatever the child wrote is ASCII or escapes.
    return subprocess.run(
        argv, cwd=cwd, env=_env(**extra), capture_output=True, text=True, encoding="utf-8", timeout=300
    )


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    """Two checkpoints committed by a real Checkpointer in a folder whose name is not ASCII."""
    uri = tmp_path / "checkpoints-é"
    model = nn.Linear(4, 2)
    with Checkpointer(str(uri), keep=None, async_save=False) as ckpt:
        for step in (1, 2):
            ckpt.save(step, {"model": model})
    return uri


ASCII_STDOUT = {"PYTHONIOENCODING": "ascii", "LANG": "C", "LC_ALL": "C"}


@pytest.mark.parametrize(
    "argv",
    [
        ["spotjob", "ckpt", "verify", "{uri}"],
        ["spotjob", "ckpt", "verify", "--deep", "{uri}"],
        ["spotjob", "ckpt", "list", "--help"],
        ["kubectl-spotjob", "status", "--help"],
    ],
)
def test_the_ckpt_commands_finish_on_a_stdout_that_cannot_encode_their_dashes(
    saved: Path, tmp_path: Path, argv: list[str]
) -> None:
    tool, *args = (a.replace("{uri}", str(saved)) for a in argv)
    proc = _run(str(BIN / tool), *args, cwd=tmp_path, **ASCII_STDOUT)
    assert proc.returncode == 0, proc.stderr
    assert "UnicodeEncodeError" not in proc.stderr and "codec can't encode" not in proc.stderr
    assert "\\u2014" in proc.stdout  # the dash, escaped, and the rest of the line after it
    if "verify" in args:
        assert "step-000000002: valid \\u2014 " in proc.stdout


def test_spotjob_run_and_status_print_a_run_folder_whose_name_is_not_ascii(tmp_path: Path) -> None:
    work = tmp_path / "runs-é"
    work.mkdir()
    script = REPO / "tests/e2e/scripts/write_to.py"
    run = _run(
        str(BIN / "spotjob"), "run", "--name", "toy", str(script), "/dev/null", "--bytes", "1", cwd=work, **ASCII_STDOUT
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-4000:]
    assert "runs-\\xe9" in run.stdout  # the summary's run folder, after a run that went well
    proc = _run(str(BIN / "spotjob"), "status", "toy", cwd=work, **ASCII_STDOUT)
    assert proc.returncode == 0, proc.stderr
    assert "runs-\\xe9" in proc.stdout


def test_spotjob_run_in_a_folder_a_c_locale_cannot_decode_says_how_to_run_it(tmp_path: Path) -> None:
    # Python in a C locale with UTF-8 mode off decodes file names as ASCII: "é" becomes two
    # surrogates, which no JSON record of the run can hold.
    work = tmp_path / "runs-é"
    work.mkdir()
    script = REPO / "tests/e2e/scripts/write_to.py"
    proc = _run(str(BIN / "spotjob"), "run", "--name", "toy", str(script), "/dev/null", cwd=work,
                PYTHONUTF8="0", LC_ALL="C", LANG="C")  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert "not readable text in this locale" in proc.stderr
    assert "PYTHONUTF8=1" in proc.stderr and "LANG=C.UTF-8" in proc.stderr
    assert not (work / "spotjob-runs").exists()


def test_importing_the_checkpointer_raises_no_warning_under_w_error() -> None:
    """A training script run with ``python -W error`` (its own choice) imports the Checkpointer:
    spotjob's imports must not make torch warn (importing ``torch.distributed.optim``, for the
    ZeroRedundancyOptimizer check, runs ``torch.jit.script``, which warns it is deprecated)."""
    code = "import sys, agent.checkpoint; print('torch.distributed.optim' in sys.modules)"
    proc = subprocess.run(
        [sys.executable, "-W", "error", "-c", code], env=_env(), capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "False"
