"""The installed spotjob's version, for the ``--version`` of every console script.

It is read from the distribution's metadata (``pyproject.toml``'s ``version``), so the commands and
``pip show spotjob`` can never disagree. A checkout that was never installed has no metadata.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

DISTRIBUTION = "spotjob"


def spotjob_version() -> str:
    """The installed distribution's version, or ``unknown (not installed)`` in a bare checkout."""
    try:
        return version(DISTRIBUTION)
    except PackageNotFoundError:
        return "unknown (not installed)"


def version_line(prog: str) -> str:
    """What ``PROG --version`` prints: the program and spotjob's version."""
    return f"{prog} {spotjob_version()}"
