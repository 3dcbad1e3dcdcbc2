"""A ``BrokenPipeError`` is a reader that left only when it is stdout's (``| head``): one from a
store's or an API client's pipe is an error like any other, never a silent exit 141."""

from __future__ import annotations

import argparse
import io
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from orchestrator import cli_ckpt
from orchestrator.cli_pipe import stdout_reader_left


@pytest.fixture
def pipe() -> Iterator[tuple[int, int]]:
    read_end, write_end = os.pipe()
    yield read_end, write_end
    for fd in (read_end, write_end):
        try:
            os.close(fd)
        except OSError:
            pass


def test_stdout_is_a_pipe_whose_reader_left(pipe: tuple[int, int], monkeypatch: pytest.MonkeyPatch) -> None:
    read_end, write_end = pipe
    monkeypatch.setattr(sys, "stdout", io.TextIOWrapper(io.FileIO(write_end, "w", closefd=False)))
    assert not stdout_reader_left(), "the reader is still there"
    os.close(read_end)
    assert stdout_reader_left()


def test_a_file_or_a_stdout_without_a_descriptor_is_no_pipe_whose_reader_left(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with open(tmp_path / "out", "w") as f:
        monkeypatch.setattr(sys, "stdout", f)
        assert not stdout_reader_left()
    monkeypatch.setattr(sys, "stdout", io.StringIO())
    assert not stdout_reader_left()


def test_a_broken_pipe_of_a_store_is_a_ckpt_error_with_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    def command(args: argparse.Namespace) -> int:
        raise BrokenPipeError(32, "Broken pipe (the store's connection)")

    run = cli_ckpt._boundary(command)
    assert run(argparse.Namespace(ckpt_command="list", verbose=False)) == 2
    assert "spotjob ckpt list: error:" in capsys.readouterr().err


def test_a_ctrl_c_while_the_commands_are_loaded_exits_130_without_a_traceback(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Building the parser imports every command's module (most of `spotjob`'s start): a Ctrl-C
    there printed a KeyboardInterrupt traceback of 40 lines. Found walking the CLI as a user."""
    from orchestrator import cli

    def interrupted(*_args: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(cli_ckpt, "register", interrupted)
    try:
        rc = cli.main(["ckpt", "list", "/nowhere"])
    except KeyboardInterrupt:
        pytest.fail("the Ctrl-C escaped spotjob's main() (a traceback)")
    assert rc == 130
    assert capsys.readouterr().err == ""
