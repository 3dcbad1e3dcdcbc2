"""What every part of ``spotjob ckpt`` shares: its exit statuses, ``CommandError`` (the one-line
reason a command stopped, which ``orchestrator.cli_ckpt``'s ``_boundary`` prints with its exit
status), and ``_need_torch_extra``, which ``verify --deep`` and ``export`` call before they read
anything."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from agent.catalog import CheckpointStatus

EXIT_OK = 0
EXIT_INVALID = 1
EXIT_ERROR = 2


class CommandError(Exception):
    """A one-line reason a command stopped, printed without a traceback, and its exit status."""

    def __init__(self, message: str, exit_code: int = EXIT_ERROR) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def newer_spotjob_words(status: CheckpointStatus, cannot: str, *, its_files: bool = False) -> str:
    """What is a newer spotjob's about a ``newer_format`` checkpoint, as ``verify`` and ``export``
    say it: its manifest (none parsed), its per-rank files (``its_files``: ``verify --deep`` read
    them), or a record that judges it (the owner's, the next attempt's: the manifest read, this
    spotjob wrote it). ``cannot``: what this command cannot do to it ("cannot be checked")."""
    if status.manifest is None or its_files:
        return "was written by a newer spotjob"
    return f"{cannot} here, which proves nothing bad about it: a record that judges it is a newer spotjob's"


def _need_torch_extra(command: str, modules: tuple[str, ...]) -> None:
    """Import what ``command`` needs from the ``torch`` extra before it reads anything: without
    them it would read every byte and then fail. A ``CommandError`` names what to install."""
    import importlib

    from agent import torch_extra_missing

    for module in modules:
        try:
            importlib.import_module(module)
        except ImportError as e:
            message = torch_extra_missing(e, command)
            if message is None:
                raise
            raise CommandError(message) from e
