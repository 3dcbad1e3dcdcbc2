"""The install commands the READMEs and the examples print, as an operator would run them: from the
folder they are written for, the chart path must lead to the chart, and the controller image must be
named (none is published: the chart's default repository cannot be pulled)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import yaml
from infra_support import CHART, REPO, TERRAFORM

# Where each file's commands run: an example's README and main.tf in the example's folder, the
# top-level README wherever its `cd` took it.
DOCS = [
    *(TERRAFORM / "examples" / ex / name for ex in ("eks", "gke") for name in ("README.md", "main.tf")),
    REPO / "README.md",
]


def _commands(path: Path) -> list[tuple[Path, str]]:
    """(cwd, command) of each console line (`$ ...`, or `#   ...` in a .tf header), continuations joined."""
    cwd = path.parent
    out: list[tuple[Path, str]] = []
    lines = path.read_text().splitlines()
    prompt = re.compile(r"^#   (?=\S)" if path.suffix == ".tf" else r"^\$ ")
    i = 0
    while i < len(lines):
        match = prompt.match(lines[i])
        i += 1
        if not match:
            continue
        command = lines[i - 1][match.end() :]
        while command.rstrip().endswith("\\") and i < len(lines):
            command = command.rstrip()[:-1] + " " + re.sub(r"^#", "", lines[i]).strip()
            i += 1
        command = command.split(" # ", 1)[0].split("   #", 1)[0].strip()
        if command.startswith("cd "):
            cwd = (cwd / shlex.split(command)[1]).resolve()
        out.append((cwd, command))
    return out


def _helm_installs() -> list[tuple[str, Path, list[str]]]:
    found = []
    for path in DOCS:
        for cwd, command in _commands(path):
            if command.startswith("helm install "):
                found.append((str(path.relative_to(REPO)), cwd, shlex.split(command)))
    return found


INSTALLS = _helm_installs()


def test_every_doc_prints_its_install_command() -> None:
    assert sorted({doc for doc, _, _ in INSTALLS}) == sorted(str(p.relative_to(REPO)) for p in DOCS)


@pytest.mark.parametrize(("doc", "cwd", "words"), INSTALLS, ids=[d for d, _, _ in INSTALLS])
def test_the_install_command_finds_the_chart_and_names_the_image(doc: str, cwd: Path, words: list[str]) -> None:
    positional = [w for w in words[2:] if not w.startswith("-")]
    chart = (cwd / positional[1]).resolve()
    assert chart == CHART, f"{doc}: run from {cwd.relative_to(REPO)}, {positional[1]} is not the chart"
    sets = [words[i + 1] for i, w in enumerate(words) if w == "--set"]
    assert any(s.startswith("image.repository=") for s in sets), (
        f"{doc}: `{' '.join(words)}` leaves the controller image at the chart's default "
        f"{yaml.safe_load((CHART / 'values.yaml').read_text())['image']['repository']}, which is not published"
    )


def _watched_namespaces(example: Path) -> list[str]:
    """The namespaces an example's helm values name in watchNamespaces (its main.tf)."""
    match = re.search(r"watchNamespaces\s*=\s*\[([^\]]*)\]", (example / "main.tf").read_text())
    return re.findall(r'"([^"]+)"', match.group(1)) if match else []


@pytest.mark.parametrize("doc", [str(p.relative_to(REPO)) for p in DOCS])
def test_the_watched_namespaces_exist_before_helm_install(doc: str) -> None:
    """With watchNamespaces the chart puts a Role and a RoleBinding in each of those namespaces, so
    `helm install` fails on one that does not exist yet ("namespaces ... not found")."""
    commands = _commands(REPO / doc)
    (at,) = [i for i, (_, c) in enumerate(commands) if c.startswith("helm install ")]
    example = commands[at][0]
    watched = _watched_namespaces(example)
    assert watched, f"{example} sets no watchNamespaces"
    created = {
        shlex.split(c)[3] for _, c in commands[:at] if c.startswith(("kubectl create namespace ", "kubectl create ns "))
    }
    missing = [ns for ns in watched if ns not in created]
    assert not missing, f"{doc}: `helm install` with watchNamespaces {watched} runs before {missing} is created"
