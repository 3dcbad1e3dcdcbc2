"""Which interrupt a save keeps (``_Save.note``) when DCP wraps it.

DCP catches whatever stops a rank's part of its collectives (the write of the shards) and hands
every rank a ``CheckpointException`` holding each failed rank's exception. A Ctrl-C on rank 0
during a synchronous save's write must come out of rank 0's ``save()`` as the
``KeyboardInterrupt`` itself, and out of rank 1's as a plain failure (``SaveFailedError``): rank 1
was not interrupted. The processes themselves are in ``tests/integration/test_checkpoint_signals.py``.
"""

from __future__ import annotations

import traceback

from torch.distributed.checkpoint.api import CheckpointException

from agent.checkpoint._save import _Save


def new_save() -> _Save:
    return _Save(step=2, started=0.0, local_dir="/nonexistent", metadata={}, state_keys=[], rank_bytes=memoryview(b""))


def wrapped(rank: int, e: BaseException) -> CheckpointException:
    return CheckpointException("write", {rank: (e, traceback.extract_stack())})


def test_a_rank_keeps_its_own_interrupt_that_dcp_wrapped() -> None:
    interrupt = KeyboardInterrupt()
    save = new_save()
    save.note(wrapped(0, interrupt), rank=0)
    assert save.interrupt is interrupt


def test_a_handlers_exit_that_dcp_wrapped_is_kept_too() -> None:
    exit_ = SystemExit(143)
    save = new_save()
    save.note(wrapped(1, exit_), rank=1)
    assert save.interrupt is exit_


def test_another_ranks_interrupt_is_not_this_ranks() -> None:
    save = new_save()
    save.note(wrapped(0, KeyboardInterrupt()), rank=1)
    assert save.interrupt is None


def test_a_wrapped_error_is_no_interrupt() -> None:
    """Pins behaviour that already worked: an ordinary error inside DCP stays a failure."""
    save = new_save()
    save.note(wrapped(0, OSError("disk")), rank=0)
    assert save.interrupt is None
