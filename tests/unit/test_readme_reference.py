"""What the README's reference names matches the code: every option of every command
(``spotjob``, ``spotjob-agent``, ``spotjob-controller``, ``kubectl spotjob``) is named in it; every
``SPOTJOB_*`` variable the code reads is named in it, and every one it names is read; and the
controller's table pairs each flag with the variable its ``--help`` names; the summary the README
shows has the rows ``make demo`` prints.

An option or variable the code has but the README does not is one a user finds only by reading
the source; one the README names that the code does not read is a setting that silently does
nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from pydantic import ByteSize, TypeAdapter

from agent import launcher_cli
from agent.settings import CheckpointerEnv, StorageEnv, unknown_variables
from orchestrator import cli, kubectl_plugin
from orchestrator.k8s import main as controller_main

REPO = Path(__file__).resolve().parents[2]
README = (REPO / "README.md").read_text()
DOCS = README + "".join(p.read_text() for p in sorted((REPO / "docs").glob("*.md")))

INTERNAL = {
    "SPOTJOB_AGENT_ID": "the agent's mark on the processes it started (agent.process_tree), not a setting",
    "SPOTJOB_LOCAL_RUN": "spotjob run's mark on a simulated node's processes (local_cloud), not a setting",
    "SPOTJOB_LOCAL_WORKER": "spotjob run's mark on a simulated node's processes (local_cloud), not a setting",
}
"""Variables the code sets for itself and reads back: marks on processes, nothing a user sets."""


def _options(parser: argparse.ArgumentParser, command: str) -> Iterator[tuple[str, tuple[str, ...]]]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _options(sub, f"{command} {name}")
        elif action.option_strings and not isinstance(action, argparse._HelpAction):
            yield command, tuple(action.option_strings)


PARSERS = {
    "spotjob": cli.build_parser(),
    "spotjob-agent": launcher_cli.build_parser({}),
    "spotjob-controller": controller_main.build_parser(),
    "kubectl spotjob": kubectl_plugin.build_parser(),
}
OPTIONS = sorted({o for name, p in PARSERS.items() for o in _options(p, name)})


def _named(text: str, word: str) -> bool:
    return re.search(rf"(?<![\w-]){re.escape(word)}(?![\w-])", text) is not None


def test_the_parsers_have_options() -> None:
    assert len(OPTIONS) > 60  # the walk still reaches the subcommands


@pytest.mark.parametrize(("command", "strings"), OPTIONS, ids=[f"{c} {'/'.join(s)}" for c, s in OPTIONS])
def test_every_option_of_every_command_is_named_in_the_readme(command: str, strings: tuple[str, ...]) -> None:
    assert any(_named(README, s) for s in strings), f"`{command}` has {'/'.join(strings)}, which README.md never names"


def _variables_read() -> set[str]:
    found: set[str] = set()
    for path in [*(REPO / "agent").rglob("*.py"), *(REPO / "orchestrator").rglob("*.py")]:
        found.update(re.findall(r"[\"'](SPOTJOB_[A-Z0-9_]*[A-Z0-9])[\"']", path.read_text()))
    for settings in (CheckpointerEnv, StorageEnv):
        prefix = settings.model_config.get("env_prefix", "")
        for name, field in settings.model_fields.items():
            alias = field.validation_alias
            found.add(alias if isinstance(alias, str) else prefix + name.upper())
    return found


def test_every_variable_the_code_reads_is_named_in_the_docs() -> None:
    missing = sorted(v for v in _variables_read() - INTERNAL.keys() if not _named(DOCS, v))
    assert not missing, f"read by the code but named nowhere in README.md or docs/: {missing}"


def test_every_variable_the_docs_name_is_read_by_the_code_or_the_tests() -> None:
    tests = "".join(p.read_text() for p in (REPO / "tests").rglob("*.py"))
    named = set(re.findall(r"SPOTJOB_[A-Z0-9_]*[A-Z0-9]", DOCS))
    unknown = sorted(v for v in named - _variables_read() if v not in tests)
    assert not unknown, f"named in the docs but read nowhere: {unknown}"


def _controller_rows() -> list[tuple[str, str]]:
    start = README.index("| flag | variable | default | what |")
    rows = []
    for line in README[start:].splitlines()[2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip("|"))]
        rows.append((cells[0], cells[1]))
    return rows


@pytest.mark.parametrize(
    ("flag", "variable"),
    [
        (a.option_strings[-1], m.group(1))
        for a in controller_main.build_parser()._actions
        for m in [re.search(r"\$([A-Z_]+)", a.help or "")]
        if a.option_strings and m
    ],
)
def test_the_controller_table_names_the_variable_of_each_flag(flag: str, variable: str) -> None:
    rows = [variables for flags, variables in _controller_rows() if _named(flags, flag)]
    assert rows, f"{flag} has no row in the README's spotjob-controller table"
    assert any(_named(v, variable) for v in rows), f"the README's row of {flag} does not name ${variable}"


def _storage_defaults() -> dict[str, float]:
    from agent.storage import _retry, _transfer

    transfer = _transfer.TransferSettings()
    retry = {
        "max_attempts": _retry.DEFAULT_MAX_ATTEMPTS,
        "base_backoff_s": _retry.DEFAULT_BASE_BACKOFF_S,
        "max_backoff_s": _retry.DEFAULT_MAX_BACKOFF_S,
    }
    return {name: float(retry.get(name, getattr(transfer, name, 0))) for name in StorageEnv.model_fields}


@pytest.mark.parametrize(("name", "default"), sorted(_storage_defaults().items()))
def test_the_readme_gives_each_storage_variable_its_default(name: str, default: float) -> None:
    variable = f"SPOTJOB_STORAGE_{name.upper()}"
    m = re.search(rf"`{variable}`[^`]*?default\s+`?([0-9.]+ ?[KMG]?i?B?)", README)
    assert m, f"README.md names no default for {variable}"
    said = m.group(1).replace(" ", "")
    value = float(TypeAdapter(ByteSize).validate_python(said)) if said[-1] == "B" else float(said)
    assert value == default, f"README.md says {variable} defaults to {said}; the code's default is {default:g}"


def test_the_warning_about_unknown_variables_knows_every_variable_spotjob_reads() -> None:
    """spotjob-agent and spotjob-controller warn about a SPOTJOB_* variable no part of spotjob reads
    (a typo): every variable the code, the scripts, the benchmarks or the tests' tooling reads must
    be known to it (SPOTJOB_BENCH_OUT, the benchmarks' output folder, was not)."""
    read = set(_variables_read())
    tooling = [REPO / "Makefile", *(REPO / "scripts").rglob("*"), *(REPO / "bench").glob("*.py")]
    for path in [*tooling, *(REPO / "tests").rglob("conftest.py")]:
        if path.is_file():
            read.update(re.findall(r"SPOTJOB_[A-Z0-9_]*[A-Z0-9]", path.read_text(errors="replace")))
    assert not unknown_variables(dict.fromkeys(read, "1"))
    assert unknown_variables({"SPOTJOB_EVERY_STEP": "1"}) == [
        "SPOTJOB_EVERY_STEP is set but no part of spotjob reads it (did you mean SPOTJOB_EVERY_STEPS?); "
        "spotjob ignores it"
    ]


def _run_options_table() -> list[tuple[list[str], str]]:
    """The rows of README "Local mode: `spotjob run`" / "Options": each row's options and default."""
    start = README.index("| option | default | what it does |")
    rows = []
    for line in README[start : README.index("\n\n", start)].splitlines()[2:]:
        option, default = line.split(" | ")[:2]
        rows.append((re.findall(r"(--[a-z-]+)", option), default.strip("` ")))
    return rows


def test_the_spotjob_run_table_gives_the_defaults_of_the_code() -> None:
    """Pins what already held: each default the table gives is ``RunConfig``'s."""
    from orchestrator.run_config import RunConfig

    defaults = {f.name: f.default for f in dataclasses.fields(RunConfig)}
    said = {options[0]: default for options, default in _run_options_table()}
    for option in ("--nproc", "--keep", "--max-restarts", "--flush-timeout", "--restart-backoff", "--notice"):
        assert float(said[option]) == defaults[option[2:].replace("-", "_")], f"README.md: {option} defaults to {said}"
    assert said["--launcher"] == defaults["launcher"]
    assert said["--runs-dir"] == f"./{defaults['runs_dir']}"


def test_the_options_a_resumed_run_keeps_are_the_rows_the_readme_names_for_it() -> None:
    """`--resume` refuses "the options from `--name` to `--notice`" of the table: those rows must be
    the options that shape the job's spec, not the injected preemptions between them."""
    from orchestrator.cli_run import _SPEC_OPTIONS

    row = next(line for line in README.splitlines() if line.startswith("| `--resume NAME`"))
    first, last = re.search(r"from `(--[a-z-]+)` to `(--[a-z-]+)`", row).groups()  # type: ignore[union-attr]
    options = [o for opts, _ in _run_options_table() for o in opts]
    named = options[options.index(first) : options.index(last) + 1]
    assert set(named) == set(_SPEC_OPTIONS.values()), named


def test_the_plot_option_says_what_images_it_draws_as_the_readme_does() -> None:
    """`spotjob run --help` said "a PNG timeline" while `--plot run.svg` and `.pdf` are drawn too (the
    README's table and the refusal of another extension name all three)."""
    run = next(a for a in PARSERS["spotjob"]._actions if isinstance(a, argparse._SubParsersAction)).choices["run"]
    help_text = next(a.help for a in run._actions if "--plot" in a.option_strings) or ""
    assert all(kind in help_text for kind in (".png", ".svg", ".pdf")), help_text


def test_the_summary_the_readme_shows_has_the_rows_the_demo_prints() -> None:
    """The README's summary is `make demo`'s (a `demo-…` run of 400 steps), and the demo draws a
    plot: its block left out the `plot` line that `spotjob run --plot` prints before `run folder`."""
    from orchestrator.live import Summary
    from orchestrator.model import Phase

    start = README.index("\nspotjob run demo-")
    block = README[start + 1 : README.index("```", start)].splitlines()
    assert "--plot" in (REPO / "examples" / "demo.py").read_text()
    words = {"name": "demo", "phase": Phase.SUCCEEDED, "reason": "Completed", "message": ""}
    numbers = {f.name: 0 for f in dataclasses.fields(Summary) if f.name not in (*words, "cloud")}
    summary = Summary(**words, **numbers)  # type: ignore[arg-type]
    printed = [key for key, _ in summary.rows()] + ["plot", "run folder"]
    shown = [re.split(r"\s{2,}", line.strip())[0] for line in block[1:]]
    assert shown == printed, "README.md's summary of the demo"
