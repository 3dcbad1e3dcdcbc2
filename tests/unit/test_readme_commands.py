"""What the README names exists: every ``kubectl spotjob`` command line it and the docs show is one
the plugin accepts, and every error of the training-side API it names is importable.

A flag the docs name that the plugin lacks (``flush --mode restart``) sends a reader to an
argparse error; this reads each invocation out of the Markdown and parses it with the plugin's
own parser. Placeholders (``…``) and bare mentions of the plugin are left out; a command named in
prose without its job gets one.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from orchestrator.kubectl_plugin import build_parser

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
_INVOCATION = re.compile(r"`kubectl spotjob ([^`]+)`|^\$ kubectl spotjob (.+)$", re.M)


def _invocations() -> list[tuple[str, str]]:
    found = []
    for doc in DOCS:
        for m in _INVOCATION.finditer(doc.read_text()):
            line = (m.group(1) or m.group(2)).split("#", 1)[0].strip()
            if line and "…" not in line and "..." not in line:
                found.append((doc.name, line))
    return found


def test_the_docs_show_kubectl_spotjob_commands() -> None:
    assert len(_invocations()) >= 5  # the extraction still finds the README's examples


def _parses(argv: list[str]) -> bool:
    try:
        build_parser().parse_args(argv)
    except SystemExit:
        return False
    return True


@pytest.mark.parametrize(("doc", "line"), _invocations())
def test_every_kubectl_spotjob_command_in_the_docs_parses(doc: str, line: str) -> None:
    argv = shlex.split(line)
    # Prose names a command without its job ("`kubectl spotjob flush --wait` follows the job"): give it one.
    assert _parses(argv) or _parses([*argv, "train-demo"]), (
        f"{doc}: `kubectl spotjob {line}` is refused by the plugin: run it with --help for its options"
    )


def test_every_error_the_training_side_api_names_is_importable_from_agent_checkpoint() -> None:
    import builtins

    import agent.checkpoint

    text = (REPO / "README.md").read_text()
    section = text.split("## The training-side API", 1)[1].split("\n## ", 1)[0]
    named = set(re.findall(r"`([A-Z][A-Za-z]*Error)`", section)) - set(dir(builtins))
    assert named >= {"RestoreRefusedError", "SaveFailedError", "StorageUnavailableError"}
    assert {n for n in named if n not in agent.checkpoint.__all__} == set()
