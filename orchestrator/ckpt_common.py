"""What every part of ``spotjob ckpt`` shares: its exit statuses, ``CommandError`` (the one-line
reason a command stopped, which ``orchestrator.cli_ckpt``'s ``_boundary`` prints with its exit
status), and ``_need_torch_extra``, which ``verify --deep`` and ``export`` call before they read
anything."""

from __future__ import annotations

EXIT_OK = 0
EXIT_INVALID = 1
EXIT_ERROR = 2


class CommandError(Exception):
    """A one-line reason a command stopped, printed without a traceback, and its exit status."""

    def __init__(self, message: str, exit_code: int = EXIT_ERROR) -> None:
        super().__init__(message)
        self.exit_code = exit_code


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
