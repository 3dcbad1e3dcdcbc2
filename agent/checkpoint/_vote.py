"""The per-step vote: every rank acts on the same flags (flush, save early, every_seconds due, a
background save failed) at the same step, read one step late so the loop never waits on the
network; ranks that count steps differently are caught."""

from __future__ import annotations

import logging
import os
import time
import zlib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from agent.checkpoint._retention import _Retention

log = logging.getLogger("agent.checkpoint")  # one logger for the package, as before it was split


@dataclass(frozen=True)
class _Vote:
    """What every rank agreed on for one step: identical on all ranks, or collectives diverge."""

    flush: bool = False
    save_early: bool = False
    time_due: bool = False
    failed_save: int | None = None
    """The number (``_Save.number``) of a background save that some rank saw done and failed: every
    rank raises it at this step, unless it was raised already (by a ``save()`` or ``wait()`` since)."""
    lowest_step: int | None = None
    highest_step: int | None = None

    @classmethod
    def reduced(cls, values: list[int]) -> _Vote:
        flush, early, due, failed, high, neg_low = values[:6]  # then the keys' slots (_agree_on_step)
        return cls(bool(flush), bool(early), bool(due), failed - 1 if failed else None, -neg_low, high)


_NO_KEYS = -(2**62)
"""The state keys' slots of a per-step vote: below any key fingerprint, so that a vote paired with
a save's agreement (a rank that saved alone) leaves the agreement's fingerprints as they are."""


def _keys_fingerprint(keys: Iterable[str]) -> int:
    """The same number on every rank whose state holds the same keys, in any order."""
    return zlib.crc32("\0".join(sorted(str(k) for k in keys)).encode())


class _Voting(_Retention):
    """The vote's collectives, and the clock of the ``every_seconds`` deadline."""

    _votes: list[tuple[Any, torch.Tensor]]
    _handled_save_mtime: int | None
    _last_save_started: float

    def _restart_deadline(self) -> None:
        """A save starts (or the Checkpointer is built): ``every_seconds`` counts from now."""
        self._last_save_started = time.monotonic()

    def _local_flags(self) -> list[int]:
        """[flush requested, save-early requested, every_seconds due, 1 + the number of this rank's
        failed save (0: none)]."""
        flush = save_early = 0
        if self._control is not None:
            flush = int(self._control.flush_requested())
            mtime = self._save_request_mtime()
            if mtime is not None and mtime != self._handled_save_mtime:
                save_early = 1
        time_due = int(
            self.config.every_seconds is not None
            and time.monotonic() - self._last_save_started >= self.config.every_seconds
        )
        failed = self._failed_save_here()
        return [flush, save_early, time_due, 0 if failed is None else failed + 1]

    def _failed_save_here(self) -> int | None:
        """The number of this rank's background save, if it is done and failed (``_Saving`` knows it).

        The failure itself reaches every rank through the save's own gather; the vote only makes
        every rank raise it at the same step, whenever each one's save thread finishes."""
        raise NotImplementedError

    def _save_request_mtime(self) -> int | None:
        assert self._control is not None
        try:
            return os.stat(os.path.join(self._control.path, "save.json")).st_mtime_ns
        except FileNotFoundError:
            return None

    def _consume_save_request(self) -> None:
        """A save-early request is being served: this rank stops voting for it, and the node's
        first rank removes it, so the agent's next request is a new file (and a new save)."""
        if self._control is None:
            return
        self._handled_save_mtime = self._save_request_mtime() or self._handled_save_mtime
        if int(os.environ.get("LOCAL_RANK", self.rank)) == 0:
            self._control.clear_save_request()

    def _read_vote(self, step: int) -> _Vote:
        """What every rank agreed on at the previous step (this step's flags when alone)."""
        if not self._dist or self.world_size == 1:
            return _Vote.reduced([*self._local_flags(), step, -step])
        if not self._votes:
            return _Vote()
        work, buf = self._votes.pop(0)
        work.wait()
        vote = _Vote.reduced([int(v) for v in buf.tolist()])
        self._check_same_step(vote, "step()")
        return vote

    def _launch_vote(self, step: int) -> None:
        """Launch this step's vote; its result is read by the next ``step()``."""
        if not self._dist or self.world_size == 1:
            return
        buf = torch.tensor([*self._local_flags(), step, -step, _NO_KEYS, _NO_KEYS], dtype=torch.int64)
        work = dist.all_reduce(buf, op=dist.ReduceOp.MAX, group=self._ctl_pg, async_op=True)
        self._votes.append((work, buf))

    def _agree_on_step(self, step: int, keys: Iterable[str], failed: bool = False) -> tuple[int | None, bool]:
        """(every rank, before a save writes anything) Same step everywhere, or raise everywhere;
        returns the highest rank that ``failed`` to prepare its part of the save (None: none did),
        and whether the ranks' states hold other ``keys`` (every rank learns it alike).

        Shaped like the per-step vote, so that a rank that skipped this save (it saw another
        step) pairs it with its next vote, and both sides see the difference. The failure rides in
        the vote's "save failed" slot, as rank + 1. The keys ride as a fingerprint, and its
        negation: a rank whose state holds no module would not enter DCP's collectives, and the
        others would wait there for it for ever.
        """
        if not self._dist or self.world_size == 1:
            return (self.rank if failed else None), False
        mine = _keys_fingerprint(keys)
        buf = torch.tensor([0, 0, 0, self.rank + 1 if failed else 0, step, -step, mine, -mine], dtype=torch.int64)
        dist.all_reduce(buf, op=dist.ReduceOp.MAX, group=self._ctl_pg)
        values = [int(v) for v in buf.tolist()]
        self._check_same_step(_Vote.reduced(values), "save")
        return (values[3] - 1 if values[3] else None), values[6] != -values[7]

    def _check_same_step(self, vote: _Vote, call: str) -> None:
        if vote.lowest_step != vote.highest_step:
            self._drain_votes()
            raise ValueError(
                f"{call}: the ranks passed different steps to the same call (lowest {vote.lowest_step}, highest "
                f"{vote.highest_step}); every rank must count completed steps the same way"
            )

    def _drain_votes(self) -> None:
        while self._votes:
            work, _ = self._votes.pop(0)
            work.wait()
