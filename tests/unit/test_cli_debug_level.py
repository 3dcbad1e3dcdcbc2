"""At debug level the cloud clients log every request (README, Safety), however the level was
chosen: ``-v`` or ``SPOTJOB_LOG_LEVEL=debug``. Below it ``spotjob ckpt`` and ``spotjob run`` quiet
their INFO chatter (``NOISY_LOGGERS`` at WARNING). Only the loggers' levels are looked at: what the
clients then log, and that it is redacted, is tests/integration/test_storage_errors.py's."""

from __future__ import annotations

import logging
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from orchestrator import cli_run
from orchestrator.cli import main
from orchestrator.cli_ckpt import NOISY_LOGGERS

DEBUG_LEVEL = [
    pytest.param(["-v"], None, id="-v"),
    pytest.param([], "debug", id="SPOTJOB_LOG_LEVEL=debug"),
    pytest.param([], " DEBUG ", id="SPOTJOB_LOG_LEVEL=' DEBUG '"),
]
BELOW_DEBUG = [
    pytest.param([], None, id="default"),
    pytest.param([], "info", id="SPOTJOB_LOG_LEVEL=info"),
    pytest.param([], "warning", id="SPOTJOB_LOG_LEVEL=warning"),
]


@pytest.fixture(autouse=True)
def _restore_logging() -> Iterator[None]:
    # cli.main's logging.basicConfig may bind a handler to this test's captured stderr, and the
    # commands set the clients' loggers' levels for the process they own: here, the test's.
    handlers = list(logging.root.handlers)
    levels = {name: logging.getLogger(name).level for name in NOISY_LOGGERS}
    for name in NOISY_LOGGERS:
        logging.getLogger(name).setLevel(logging.NOTSET)
    yield
    logging.root.handlers[:] = handlers
    for name, level in levels.items():
        logging.getLogger(name).setLevel(level)


def _set_level(monkeypatch: pytest.MonkeyPatch, value: str | None) -> None:
    if value is None:
        monkeypatch.delenv("SPOTJOB_LOG_LEVEL", raising=False)
    else:
        monkeypatch.setenv("SPOTJOB_LOG_LEVEL", value)


def _noisy_levels() -> set[int]:
    return {logging.getLogger(name).level for name in NOISY_LOGGERS}


def _ckpt_list(options: list[str], tmp_path: Path) -> None:
    assert main([*options, "ckpt", "list", str(tmp_path / "nothing")]) != 0


def _run(options: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    def refused(args: object) -> None:
        raise ValueError("refused here, after the command set its loggers")

    monkeypatch.setattr(cli_run, "prepare", refused)
    handlers = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGTSTP)}
    try:
        assert main([*options, "run", "train.py"]) != 0
    finally:
        for signum, handler in handlers.items():
            signal.signal(signum, handler)


def _command(command: str, options: list[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    if command == "ckpt":
        _ckpt_list(options, tmp_path)
    else:
        _run(options, monkeypatch)


@pytest.mark.parametrize(("options", "level"), DEBUG_LEVEL)
@pytest.mark.parametrize("command", ["ckpt", "run"])
def test_at_debug_level_however_chosen_the_commands_leave_the_cloud_clients_logging(
    command: str, options: list[str], level: str | None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """``SPOTJOB_LOG_LEVEL=debug`` set spotjob's own level to DEBUG, but ``spotjob ckpt`` and
    ``spotjob run`` quieted the clients unless ``-v`` was given: no request line of botocore's or
    urllib3's, which README promises at debug level."""
    _set_level(monkeypatch, level)
    _command(command, options, monkeypatch, tmp_path)
    assert _noisy_levels() == {logging.NOTSET}


@pytest.mark.parametrize(("options", "level"), BELOW_DEBUG)
@pytest.mark.parametrize("command", ["ckpt", "run"])
def test_below_debug_level_the_commands_quiet_the_cloud_clients_chatter(
    command: str, options: list[str], level: str | None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    _set_level(monkeypatch, level)
    _command(command, options, monkeypatch, tmp_path)
    assert _noisy_levels() == {logging.WARNING}
