"""Save policy: one trigger makes one save, requests are served once each, flushes are reported
before retention runs, and bad arguments are refused before any file is written.

The multi-rank cases run two real torchrun ranks (``scripts/ckpt_policy.py``), because the bugs
they pin down live in the per-step vote, which one process never exercises.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from agent.catalog import list_checkpoints
from agent.checkpoint import Checkpointer
from agent.control_channel import FLUSHED_FILE, ControlDir, FlushRequest
from agent.storage import open_storage

sys.path.insert(0, str(Path(__file__).resolve().parent / "scripts"))
import ckpt_harness as harness
from ckpt_state import make_state, train

POLICY = harness.SCRIPTS / "ckpt_policy.py"


def commits(uri: str) -> list[tuple[int, str | None]]:
    """(step, trigger) of every committed checkpoint, oldest first."""
    found = [s for s in list_checkpoints(open_storage(uri)) if s.valid and s.manifest is not None]
    return sorted((s.ref.step, s.manifest.trigger) for s in found if s.manifest is not None)


def written(root: Path) -> list[str]:
    """Every checkpoint folder or staged save under a filesystem URI (the owner record aside)."""
    return sorted(p.name for p in root.rglob("step-*"))


# -- one trigger, one save (2 ranks) ---------------------------------------------------------------


CALLS = ("step", "save")


class PolicyRun:
    """The four two-rank cases, run in turn in one torchrun (``--then``): each has its own URI,
    control folder and outcome files, and each ends with its Checkpointer closed, so a case sees
    nothing of the ones before it; starting the ranks (importing torch) is most of a case's cost."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.early_uri, self.early_control = str(root / "early" / "ckpt"), root / "early" / "control"
        self.deadline_uri = str(root / "deadline" / "ckpt")
        self.mismatch = {
            call: (root / f"mismatch-{call}" / "ckpt", root / f"mismatch-{call}" / "outcome") for call in CALLS
        }
        self.proc: Any = None

    def argv(self) -> list[str]:
        args = ["early", "--uri", self.early_uri, "--control", str(self.early_control)]
        args += ["--then", "deadline", "--uri", self.deadline_uri]
        for call, (root, out) in self.mismatch.items():
            out.parent.mkdir(parents=True, exist_ok=True)
            args += ["--then", "mismatch", "--uri", str(root), "--out", str(out), "--call", call]
        return args

    def ended_cleanly(self, case: int) -> bool:
        """Case ``case`` (0-3, in ``argv``'s order) returned on both ranks: the next case began on
        both, or, for the last, the run exited 0 (as each case's own torchrun had to)."""
        if case == 3:
            return bool(self.proc.returncode == 0)
        return all(f"rank{rank} ckpt_policy INFO: === case {case + 1}:" in self.proc.stderr for rank in (0, 1))

    def output(self) -> str:
        """The run's exit status and output, for an assertion's message."""
        return f"torchrun exited {self.proc.returncode}\n--- stderr\n{self.proc.stderr[-8000:]}"


@pytest.fixture(scope="module")
def policy_run(tmp_path_factory: pytest.TempPathFactory) -> PolicyRun:
    run = PolicyRun(tmp_path_factory.mktemp("policy"))
    # Not checked here: each test asserts its own case's outcome, with the run's output.
    run.proc = harness.torchrun(2, POLICY, *run.argv(), check=False)
    return run


@pytest.mark.slow
def test_each_save_early_request_makes_exactly_one_save_and_a_second_request_makes_another(
    policy_run: PolicyRun,
) -> None:
    # Requested during steps 5 and 14, agreed at the end of those steps, served at the next.
    assert commits(policy_run.early_uri) == [(6, "early"), (15, "early")], policy_run.output()
    assert not (policy_run.early_control / "save.json").exists(), "a served request must be removed"
    assert policy_run.ended_cleanly(0), policy_run.output()


@pytest.mark.slow
def test_one_every_seconds_deadline_makes_exactly_one_save(policy_run: PolicyRun) -> None:
    # The script's clock jumps past the deadline during steps 6 and 11 and stands still otherwise.
    assert commits(policy_run.deadline_uri) == [(7, "policy"), (12, "policy")], policy_run.output()
    assert policy_run.ended_cleanly(1), policy_run.output()


@pytest.mark.slow
@pytest.mark.parametrize("call", CALLS)
def test_ranks_that_report_different_steps_are_refused_on_every_rank_before_anything_is_written(
    policy_run: PolicyRun, call: str
) -> None:
    root, out = policy_run.mismatch[call]
    for rank in (0, 1):
        outcome_file = Path(f"{out}.rank{rank}")
        assert outcome_file.exists(), f"rank {rank} reported no outcome\n{policy_run.output()}"
        outcome = outcome_file.read_text()
        assert outcome.startswith("ValueError") and "different steps" in outcome, f"rank {rank}: {outcome}"
    assert written(root) == [], "a save went ahead with ranks at different steps"
    assert policy_run.ended_cleanly(2 if call == "step" else 3), policy_run.output()


# -- arguments refused up front (one process) -----------------------------------------------------


@pytest.mark.parametrize(
    ("step", "error", "words"),
    [(-1, ValueError, "step must be >= 0"), (2.5, TypeError, "step must be an int"), (True, TypeError, "bool")],
)
def test_a_save_of_a_step_that_is_not_a_count_is_refused_before_anything_is_written(
    tmp_path: Path, step: Any, error: type[Exception], words: str
) -> None:
    root = tmp_path / "ckpt"
    with Checkpointer(str(root)) as ckpt:
        with pytest.raises(error, match=words):
            ckpt.save(step, make_state(0))
        with pytest.raises(error, match=words):
            ckpt.step(step, make_state(0))
    assert written(root) == []


@pytest.mark.parametrize("state", [[torch.nn.Linear(2, 2)], None], ids=["list", "none"])
def test_a_state_that_is_not_a_dict_is_a_type_error_naming_it_before_anything_is_written(
    tmp_path: Path, state: Any
) -> None:
    """Not an AttributeError wrapped in SaveFailedError: the mistake is the caller's, named as such."""
    root = tmp_path / "ckpt"
    with Checkpointer(str(root), every_steps=1) as ckpt:
        for call in (lambda: ckpt.restore(state), lambda: ckpt.save(1, state), lambda: ckpt.step(1, state)):
            with pytest.raises(TypeError, match=r"state must be a dict of names to what to save, e\.g\."):
                call()
    assert written(root) == []


@pytest.mark.parametrize(
    ("policy", "error", "words"),
    [
        ({"every_seconds": float("nan")}, ValueError, "every_seconds must be a finite number"),
        ({"every_seconds": float("inf")}, ValueError, "every_seconds must be a finite number"),
        ({"every_seconds": "60"}, TypeError, "every_seconds must be a number of seconds"),
        ({"every_steps": "5"}, TypeError, r"every_steps must be a whole number .*'5' \(str\)"),
        ({"every_steps": 2.5}, TypeError, "every_steps must be a whole number"),
        ({"keep": 1.5}, TypeError, "keep must be a whole number"),
        ({"keep": True}, TypeError, "keep must be a whole number"),
    ],
    ids=[
        "every_seconds-nan",
        "every_seconds-inf",
        "every_seconds-str",
        "every_steps-str",
        "every_steps-float",
        "keep-float",
        "keep-bool",
    ],
)
def test_a_policy_that_is_not_a_count_or_a_finite_time_is_refused_when_the_checkpointer_is_built(
    tmp_path: Path, policy: dict[str, Any], error: type[Exception], words: str
) -> None:
    """A NaN every_seconds never comes due, and every_steps=2.5 saves at step 5 only: no periodic
    save would happen as asked, silently. The constructor names the argument instead."""
    root = tmp_path / "ckpt"
    with pytest.raises(error, match=words):
        Checkpointer(str(root), **policy)
    assert written(root) == []


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("SPOTJOB_EVERY_SECONDS", "nan"),
        ("SPOTJOB_EVERY_SECONDS", "inf"),
        ("SPOTJOB_EVERY_STEPS", "0"),
        ("SPOTJOB_KEEP", "-1"),
    ],
)
def test_from_env_names_a_policy_variable_that_would_never_save_or_keep_everything(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, variable: str, value: str
) -> None:
    monkeypatch.setenv("SPOTJOB_CHECKPOINT_URI", str(tmp_path / "ckpt"))
    monkeypatch.setenv(variable, value)
    with pytest.raises(ValueError, match=f"{variable}='{value}' is not"):
        Checkpointer.from_env()
    assert written(tmp_path / "ckpt") == []


@pytest.mark.parametrize(
    ("variable", "value", "words"),
    [
        ("SPOTJOB_ATTEMPT", "-3", r"is not a whole number, at least 0$"),
        ("SPOTJOB_JOB_NAME", "train\tv2", r"is not a job name: UTF-8 text without control characters .*'\\t'"),
        ("SPOTJOB_JOB_NAME", os.fsdecode(b"train-\xff"), r"is not a job name: .*not valid UTF-8"),
    ],
    ids=["negative-attempt", "job-name-control-character", "job-name-not-utf8"],
)
def test_a_malformed_attempt_or_job_name_from_the_agent_is_refused_naming_the_variable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, variable: str, value: str, words: str
) -> None:
    """Fails without the fix: the variables were read unchecked, and the Checkpointer's own checks
    of attempt= and job= refused them ("attempt must be >= 0 (or None), got -3", "job: the job name
    ...") as arguments the script never passed, naming neither variable."""
    monkeypatch.setenv("SPOTJOB_CONTROL_DIR", str(tmp_path / "control"))
    monkeypatch.setenv(variable, value)
    with pytest.raises(ValueError, match=f"^{variable}={re.escape(repr(value))} {words}"):
        Checkpointer(str(tmp_path / "ckpt"))
    assert written(tmp_path / "ckpt") == []


def test_a_pathlib_path_names_the_folder_and_a_uri_that_is_not_text_is_a_type_error(tmp_path: Path) -> None:
    """``Checkpointer(tmp_path / "ckpt")`` is how a script holding a ``Path`` writes it: it failed with
    an ``AttributeError`` about ``strip`` from the URI parser, and so did an int."""
    root = tmp_path / "ckpt"
    with Checkpointer(root, every_steps=1) as ckpt:
        assert ckpt.storage.uri == f"file://{root}"
        ckpt.step(1, make_state(0))
    assert written(root) == ["step-000000001"]
    for value in (123, b"/tmp/ckpt"):
        with pytest.raises(TypeError, match=r"^the checkpoint URI must be a string .* got "):
            Checkpointer(value)  # type: ignore[arg-type]


def test_a_uri_of_none_is_a_type_error_naming_what_to_pass_and_from_env_names_its_variable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``Checkpointer(os.environ.get(...))`` with the variable unset passes None: it was a
    ``ValueError`` about an empty URI, where the README says anything but a string or a Path is a
    ``TypeError``. ``from_env()`` with ``SPOTJOB_CHECKPOINT_URI`` unset keeps its own error."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("SPOTJOB_CHECKPOINT_URI", raising=False)
    with pytest.raises(TypeError, match=r"^the checkpoint URI must be a string .* got None .*from_env\(\)"):
        Checkpointer(None)  # type: ignore[arg-type]
    for kwargs in ({}, {"uri": None}):
        with pytest.raises(ValueError, match=r"^no checkpoint URI: set SPOTJOB_CHECKPOINT_URI"):
            Checkpointer.from_env(**kwargs)
    assert os.listdir(tmp_path) == []


def test_numpy_integers_are_whole_numbers_of_steps(tmp_path: Path) -> None:
    numpy = pytest.importorskip("numpy")
    with Checkpointer(str(tmp_path / "ckpt"), every_steps=numpy.int64(5), keep=numpy.int32(2)) as ckpt:
        assert (ckpt.config.every_steps, ckpt.config.keep) == (5, 2)
        assert type(ckpt.config.every_steps) is int


def test_a_whole_float_is_a_whole_number_of_steps_and_saves_at_its_multiples(tmp_path: Path) -> None:
    """``every_steps=total_steps / 10`` is a float, and 100.0 is a whole number: it saved at every
    multiple before the types were checked, and "must be a whole number, got 100.0" would be
    wrong. Only a fractional one (2.5: step 5 only) is refused."""
    uri = str(tmp_path / "ckpt")
    state = make_state(0)
    with Checkpointer(uri, every_steps=20 / 10, keep=6.0, async_save=False) as ckpt:
        assert (type(ckpt.config.every_steps), type(ckpt.config.keep)) == (int, int)
        for step in range(1, 5):
            train(state, 1, start=step - 1)
            ckpt.step(step, state)
    assert [step for step, _ in commits(uri)] == [2, 4]


@pytest.mark.parametrize(
    "metadata",
    [{"loss": torch.tensor(1.0)}, {"seen": {1, 2}}, {"obj": object()}, {3: "not a str key"}, ["a", "list"]],
    ids=["tensor", "set", "object", "int-key", "not-a-dict"],
)
def test_metadata_that_is_not_json_is_refused_before_anything_is_written(tmp_path: Path, metadata: Any) -> None:
    root = tmp_path / "ckpt"
    state = make_state(0)
    with Checkpointer(str(root), every_steps=1) as ckpt:
        with pytest.raises(TypeError, match="metadata"):
            ckpt.save(1, state, metadata=metadata)
        with pytest.raises(TypeError, match="metadata"):
            ckpt.step(1, state, metadata=metadata)
    assert written(root) == []


def deeply_nested(levels: int) -> dict[str, Any]:
    value: dict[str, Any] = {}
    for _ in range(levels):
        value = {"x": value}
    return value


@pytest.mark.parametrize(
    ("metadata", "words"),
    [({"blob": "x" * (2 << 20)}, "bytes as JSON"), (deeply_nested(100), "levels deep")],
    ids=["oversized", "too-deep"],
)
def test_metadata_no_reader_would_accept_is_refused_before_anything_is_written(
    tmp_path: Path, metadata: dict[str, Any], words: str
) -> None:
    """A manifest readers refuse (too big, nested too deep) would be a checkpoint lost on commit."""
    root = tmp_path / "ckpt"
    with Checkpointer(str(root)) as ckpt, pytest.raises(ValueError, match=f"metadata .*{words}"):
        ckpt.save(1, make_state(0), metadata=metadata)
    assert written(root) == []


NOT_UTF8 = os.fsdecode(b"/data/shard-\xff.bin")  # what os.listdir gives for a name that is not UTF-8


@pytest.mark.parametrize(
    ("metadata", "where"),
    [
        ({"data_file": NOT_UTF8}, r"metadata\['data_file'\]"),
        ({"files": [{"name": NOT_UTF8}]}, r"metadata\['files'\]\[0\]\['name'\]"),
        ({"seen": {NOT_UTF8: 1}}, r"a key of metadata\['seen'\]"),
    ],
    ids=["value", "nested-value", "nested-key"],
)
def test_metadata_text_that_is_not_utf8_is_refused_before_anything_is_written_naming_where(
    tmp_path: Path, metadata: dict[str, Any], where: str
) -> None:
    """Fails without the fix: a lone surrogate passed the check (json.dumps escapes it), the shards
    were written and the commit failed with a PydanticSerializationError naming neither metadata
    nor the key, every save, so nothing was ever committed."""
    root = tmp_path / "ckpt"
    state = make_state(0)
    with Checkpointer(str(root), every_steps=1) as ckpt:
        for call in (lambda: ckpt.save(1, state, metadata=metadata), lambda: ckpt.step(1, state, metadata=metadata)):
            with pytest.raises(ValueError, match=rf"^(save|step)\(\): {where} is not valid UTF-8: .*os\.fsencode"):
                call()
        assert written(root) == []
        ckpt.save(1, state, metadata={"data_file": os.fsencode(NOT_UTF8).decode(errors="replace")})
    assert commits(str(root)) == [(1, "save")]


def test_a_step_lower_than_the_last_one_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    state = make_state(0)
    with Checkpointer(str(root), every_steps=1, keep=None) as ckpt:
        train(state, 5)
        ckpt.step(5, state)
        ckpt.wait()
        with pytest.raises(ValueError, match=r"step 3 is lower than the last step \(5\)"):
            ckpt.step(3, state)
        with pytest.raises(ValueError, match=r"step 4 is lower than the last step \(5\)"):
            ckpt.save(4, state)
        ckpt.step(5, state)  # the same step again is fine (nothing new to save)
    assert [step for step, _ in commits(str(root))] == [5]
    assert written(root) == ["step-000000005"]


def test_step_called_twice_with_one_step_warns_once_of_per_micro_batch_calls(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A loop that calls ``step(global_step, state)`` per micro-batch of a gradient accumulation
    cycle passes each step several times, without a word: a flush in the middle of a cycle then
    saved the loader's position mid-cycle with the model of the cycle before, and the resume
    skipped those micro-batches. The repeat is the sign of it: it is logged, once."""
    state = make_state(0)
    caplog.set_level("WARNING", logger="agent.checkpoint")
    with Checkpointer(str(tmp_path / "saved"), every_steps=2) as ckpt:
        ckpt.save(1, state)
        ckpt.step(1, state)  # after a save() of the same step (the README's save before the loop)
        ckpt.step(2, state)
    assert not [r for r in caplog.records if "again with the same step" in r.getMessage()]
    with Checkpointer(str(tmp_path / "ckpt"), every_steps=2) as ckpt:
        for micro in range(8):  # 4 micro-batches per optimizer step
            ckpt.step(micro // 4 + 1, state)
    repeats = [r.getMessage() for r in caplog.records if "again with the same step" in r.getMessage()]
    assert len(repeats) == 1, repeats
    assert "step(1) was called again with the same step" in repeats[0]
    assert "once per optimizer step" in repeats[0] and "micro-batch" in repeats[0]


def test_a_flush_whose_deadline_passed_says_so_not_a_negative_time_left(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A notice whose deadline had passed when the ranks reached the flush (a clock ahead, or a
    deadline shorter than one step): the rank's warning read "-2.0s left before the deadline"."""
    state = make_state(0)
    control = tmp_path / "control"
    caplog.set_level("WARNING", logger="agent.checkpoint")
    with Checkpointer(str(tmp_path / "ckpt"), every_steps=1, control_dir=str(control)) as ckpt:
        ckpt.step(1, state)
        ckpt.wait()  # a save timed: the flush compares the window with it
        ControlDir(str(control)).request_flush(FlushRequest(reason="late notice", deadline=time.time() - 2))
        assert ckpt.step(2, state) is True
    said = [r.getMessage() for r in caplog.records if "deadline" in r.getMessage()]
    assert said and all("s left" not in m for m in said), said
    assert any(re.search(r"the deadline passed \d+\.\ds ago", m) for m in said), said


def test_a_loop_that_goes_on_after_step_returned_true_is_told_to_stop(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """``ckpt.step(n, state)`` without looking at what it returns: after a flush committed, every
    later ``step()`` returned True and saved nothing, without a word, while the loop trained on
    until spotjob-agent killed the job (``--exit-timeout``). The first such call says so, once."""
    state = make_state(0)
    control = tmp_path / "control"
    caplog.set_level("WARNING", logger="agent.checkpoint")
    with Checkpointer(str(tmp_path / "ckpt"), control_dir=str(control)) as ckpt:
        ckpt.step(1, state)
        ControlDir(str(control)).request_flush(FlushRequest(reason="test notice"))
        assert ckpt.step(2, state) is True
        assert not [r for r in caplog.records if "returned True" in r.getMessage()]
        assert ckpt.step(3, state) is True
        assert ckpt.step(4, state) is True
    told = [r.getMessage() for r in caplog.records if "returned True" in r.getMessage()]
    assert len(told) == 1, told
    assert "step(3) after step() returned True" in told[0]
    assert "Stop the training loop when step() returns True" in told[0]
    assert [step for step, _ in commits(str(tmp_path / "ckpt"))] == [2]


def test_the_warning_after_a_flush_names_the_flushs_step_not_a_later_saves(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A script that saves once more after its flush (``save(3)``, then ``step(3)``): the warning
    read "a flush committed step 3", the later save's step, where the flush committed step 2."""
    state = make_state(0)
    control = tmp_path / "control"
    caplog.set_level("WARNING", logger="agent.checkpoint")
    with Checkpointer(str(tmp_path / "ckpt"), control_dir=str(control)) as ckpt:
        ckpt.step(1, state)
        ControlDir(str(control)).request_flush(FlushRequest(reason="test notice"))
        assert ckpt.step(2, state) is True
        ckpt.save(3, state)
        ckpt.wait()
        assert ckpt.last_committed_step == 3
        assert ckpt.step(3, state) is True
    told = [r.getMessage() for r in caplog.records if "returned True" in r.getMessage()]
    assert len(told) == 1, told
    assert "step(3) after step() returned True: a flush committed step 2 " in told[0]


def test_a_run_that_never_restored_is_told_its_commits_sort_below_the_jobs_newer_checkpoint(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A restarted script that forgot ``restore()`` (or skipped it) trained from scratch and
    committed step 5 under a URI holding the job's step 10, without a word: the next restore
    loaded step 10 and the run's progress was never used. The commit says so, once."""
    root = tmp_path / "ckpt"
    state = make_state(0)
    with Checkpointer(str(root)) as ckpt:
        ckpt.save(10, state)
    caplog.set_level("ERROR", logger="agent.checkpoint")
    with Checkpointer(str(root), every_steps=5, keep=None) as ckpt:
        for step in range(1, 11):
            ckpt.step(step, state)
    told = [r.getMessage() for r in caplog.records if "never called restore()" in r.getMessage()]
    assert len(told) == 1, told
    assert "committed step 5" in told[0] and "step 10" in told[0] and "a new URI" in told[0]
    caplog.clear()
    with Checkpointer(str(root), every_steps=5) as ckpt:
        assert ckpt.restore(state) == 10
        ckpt.save(10, state)  # the step it resumed from, again: nothing newer than it
        ckpt.step(15, state)
    assert not [r for r in caplog.records if "never called restore()" in r.getMessage()]


def test_json_metadata_is_recorded(tmp_path: Path) -> None:
    uri = str(tmp_path / "ckpt")
    with Checkpointer(uri) as ckpt:
        ckpt.save(1, make_state(0), metadata={"loss": 0.25, "tags": ["a"], "nested": {"tokens": 10}})
    (status,) = list_checkpoints(open_storage(uri))
    assert status.manifest is not None and status.manifest.metadata == {
        "loss": 0.25,
        "tags": ["a"],
        "nested": {"tokens": 10},
    }


def test_a_nan_or_infinite_metadata_value_is_recorded_as_text_not_as_null(tmp_path: Path) -> None:
    """JSON has no NaN or infinity: ``metadata={"loss": float("nan")}`` was written as ``null``
    without a word, and a loss that went NaN read as one never recorded. Each is now the text
    Python spells it with (``float()`` reads it back), wherever it is nested, and the save goes on."""
    uri = str(tmp_path / "ckpt")
    metadata = {"loss": float("nan"), "grad_norm": [float("inf"), 1.5], "nested": {"low": -float("inf")}}
    with Checkpointer(uri) as ckpt:
        ckpt.save(1, make_state(0), metadata=metadata)
    (status,) = list_checkpoints(open_storage(uri))
    assert status.valid and status.manifest is not None
    assert status.manifest.metadata == {"loss": "nan", "grad_norm": ["inf", 1.5], "nested": {"low": "-inf"}}
    assert str(float(str(status.manifest.metadata["loss"]))) == "nan"


# -- the flush is reported before retention runs -------------------------------------------------


def commit_steps_1_and_2(ckpt: Checkpointer, state: dict[str, Any]) -> None:
    for step in (1, 2):
        train(state, 1, start=step - 1)
        ckpt.step(step, state)
    ckpt.wait()


def test_a_flush_is_reported_before_retention_deletes_anything(tmp_path: Path) -> None:
    root, control = tmp_path / "ckpt", ControlDir(str(tmp_path / "control"))
    state = make_state(0)
    with Checkpointer(str(root), every_steps=1, keep=1, control_dir=control.path) as ckpt:
        commit_steps_1_and_2(ckpt, state)
        deleted: list[tuple[str, bool]] = []
        delete = ckpt.storage.delete

        def recorded_delete(keys: Any) -> None:
            keys = list(keys)
            deleted.extend((k, (Path(control.path) / FLUSHED_FILE).exists()) for k in keys)
            delete(keys)

        ckpt.storage.delete = recorded_delete  # type: ignore[method-assign]
        control.request_flush(FlushRequest(reason="test notice"))
        train(state, 1, start=2)
        assert ckpt.step(3, state) is True
    result = json.loads((Path(control.path) / FLUSHED_FILE).read_text())
    assert result["step"] == 3
    assert deleted, "retention deleted nothing: the test proves nothing"
    assert all(reported for _, reported in deleted), f"deleted before the flush was reported: {deleted}"
    assert [step for step, _ in commits(str(root))] == [3]


def test_a_flush_whose_retention_fails_unexpectedly_still_ends_as_flushed(tmp_path: Path) -> None:
    """Retention after a flush runs on rank 0 alone: an error from it, of any kind, must not turn
    the committed flush into a failed step() (on rank 0 only: its peers would wait for it)."""
    root, control = tmp_path / "ckpt", ControlDir(str(tmp_path / "control"))
    state = make_state(0)
    with Checkpointer(str(root), every_steps=1, keep=1, control_dir=control.path) as ckpt:
        commit_steps_1_and_2(ckpt, state)

        def broken_delete(keys: Any) -> None:
            raise RuntimeError("the storage client blew up (injected)")

        ckpt.storage.delete = broken_delete  # type: ignore[method-assign]
        control.request_flush(FlushRequest(reason="test notice"))
        train(state, 1, start=2)
        assert ckpt.step(3, state) is True
    assert json.loads((Path(control.path) / FLUSHED_FILE).read_text())["step"] == 3
    # keep=1: step 2 would have gone after the flush; it stays for the next save's retention.
    assert [step for step, _ in commits(str(root))] == [2, 3]


def test_a_malformed_spotjob_async_says_it_takes_a_boolean(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """SPOTJOB_ASYNC is the one variable whose name is not its field's (async_save): its message
    said only "is not a valid value", without what the variable takes."""
    monkeypatch.setenv("SPOTJOB_CHECKPOINT_URI", str(tmp_path / "ckpt"))
    monkeypatch.setenv("SPOTJOB_ASYNC", "maybe")
    with pytest.raises(ValueError, match=r"SPOTJOB_ASYNC='maybe' is not a boolean \(1/0, true/false\)"):
        Checkpointer.from_env()
    assert written(tmp_path / "ckpt") == []


@pytest.mark.parametrize("value", ["rank_0", "Identical", None, 0])
def test_replicas_other_than_identical_or_rank0_is_refused_naming_both(tmp_path: Path, value: Any) -> None:
    with pytest.raises(ValueError, match=r"^replicas must be one of 'identical', 'rank0'"):
        Checkpointer(str(tmp_path / "ckpt"), replicas=value)
    assert written(tmp_path / "ckpt") == []


@pytest.mark.parametrize("flag", ["async_save", "start_fresh", "release_staging", "read_only"])
@pytest.mark.parametrize("value", ["no", "false", 2, 0.5])
def test_a_switch_that_is_not_a_bool_is_refused_naming_it(tmp_path: Path, flag: str, value: Any) -> None:
    """A switch taken from a config file or a command line as a string ("no", "false") was truthy:
    start_fresh="no" started from step 0 past every checkpoint, async_save="false" saved
    asynchronously. direct_io already refused anything but True, False or None."""
    root = tmp_path / "ckpt"
    with pytest.raises(TypeError, match=rf"^{flag} must be True or False"):
        Checkpointer(str(root), **{flag: value})
    assert written(root) == []


def test_the_switches_take_numpy_bools_and_0_or_1(tmp_path: Path) -> None:
    """0 and 1 and NumPy's booleans are unambiguous: accepted, and kept as bools."""
    numpy = pytest.importorskip("numpy")
    with Checkpointer(str(tmp_path / "a"), async_save=numpy.bool_(False), release_staging=1) as ckpt:
        assert ckpt.config.async_save is False and ckpt.config.release_staging is True
    with Checkpointer(str(tmp_path / "b"), start_fresh=0, read_only=numpy.False_) as ckpt:
        assert ckpt.config.start_fresh is False
