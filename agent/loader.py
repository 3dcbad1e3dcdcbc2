"""A place in a plain ``torch.utils.data.DataLoader`` that a checkpoint can hold: ``ResumableLoader``.

A ``DataLoader`` keeps no position, so the ``Checkpointer`` refuses one. ``ResumableLoader`` wraps
it and hands out its batches one at a time, epoch after epoch, keeping what a resume needs to hand
out the same batches again: the epoch, the batches drawn in it, and the state of the loader's own
``generator=`` as the epoch began (each epoch's iterator draws its shuffle and its workers' seeds
from it). After a restore, the first ``next_batch()`` starts that epoch's iterator again from that
state and draws the batches already handed out once more, through the same workers, so their
random augmentations come out the same, then goes on.

Nothing here imports torch: the loader, its generator and its sampler are the user's, and only
their own methods are called (``generator.get_state()`` / ``set_state()``, ``sampler.set_epoch()``).
Python's, NumPy's and torch's global random streams are not touched.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

__all__ = ["ResumableLoader"]

log = logging.getLogger(__name__)

_KEYS = ("epoch", "seen", "generator")


class ResumableLoader:
    """Batches of ``loader`` one at a time, epoch after epoch, with a place a checkpoint saves.

    ``loader`` is a ``torch.utils.data.DataLoader`` over a map-style dataset (it has a length), built
    with a ``generator=`` of its own (``torch.Generator().manual_seed(rank)``): without one each
    epoch's iterator draws its shuffle and its workers' seeds from torch's global stream, which a
    restore sets to the checkpoint's step, so a resumed epoch would get other seeds without a word.
    ``persistent_workers=True`` is refused: persistent workers keep the seeds they drew in the
    first epoch, which a resumed loader draws again.

    Put the object in the Checkpointer's state (``{"loader": data}``), call ``next_batch()`` (or
    ``next(data)``) for every micro-batch and drive the loop by step: ``epoch`` and ``seen`` say
    where it is. A resume draws the batches of the epoch already handed out again (their loading
    time, once, at the restore's first batch).
    """

    def __init__(self, loader: Any) -> None:
        name = type(loader).__name__
        if not callable(getattr(loader, "__iter__", None)) or not hasattr(loader, "generator"):
            raise TypeError(f"ResumableLoader wraps a torch.utils.data.DataLoader, not a {name}")
        try:
            batches = len(loader)
        except TypeError:
            raise TypeError(
                f"ResumableLoader needs a loader with a length (a map-style dataset); this {name} has none "
                "(an IterableDataset?): give its dataset a state_dict() of its own instead"
            ) from None
        if batches < 1:
            raise ValueError(f"ResumableLoader needs a loader with at least one batch; this {name} has none")
        generator = getattr(loader, "generator", None)
        if generator is None or not callable(getattr(generator, "get_state", None)):
            raise ValueError(
                "ResumableLoader needs the DataLoader's own generator: build it with "
                "DataLoader(..., generator=torch.Generator().manual_seed(rank)). Without one each epoch's "
                "shuffle and workers' seeds come from torch's global stream, which a restore sets to the "
                "checkpoint's step, and the resumed epoch would hand out other batches"
            )
        problem = _sampler_problem(loader)
        if problem is not None:
            raise ValueError(problem)
        if getattr(loader, "persistent_workers", False):
            raise ValueError(
                "ResumableLoader needs persistent_workers=False: persistent workers keep the seeds of the "
                "first epoch's iterator, which a resumed loader draws again, so a resume would augment "
                "differently from the run it continues"
            )
        self._loader = loader
        self._epoch = 0
        self._seen = 0
        self._epoch_start = generator.get_state()
        self._it: Iterator[Any] | None = None

    @property
    def loader(self) -> Any:
        return self._loader

    @property
    def epoch(self) -> int:
        """The epoch the next batch belongs to, from 0."""
        return self._epoch

    @property
    def seen(self) -> int:
        """The batches of this epoch already handed out."""
        return self._seen

    def __len__(self) -> int:
        """The batches of one epoch (the loader's length)."""
        return len(self._loader)

    def __iter__(self) -> ResumableLoader:
        return self

    def __next__(self) -> Any:
        return self.next_batch()

    def next_batch(self) -> Any:
        """The next batch; at an epoch's end the next epoch begins (it never runs out)."""
        if self._it is None:
            self._it = self._start_epoch()
        batch = next(self._it)
        self._seen += 1
        if self._seen >= len(self._loader):
            # The epoch's end: its iterator has drawn from the generator, so the next epoch's start
            # is known now, and a checkpoint taken here must hold it (not this epoch's).
            self._epoch, self._seen, self._it = self._epoch + 1, 0, None
            self._epoch_start = self._loader.generator.get_state()
        return batch

    def _start_epoch(self) -> Iterator[Any]:
        self._loader.generator.set_state(self._epoch_start)
        set_epoch = getattr(getattr(self._loader, "sampler", None), "set_epoch", None)
        if callable(set_epoch):
            set_epoch(self._epoch)
        it = iter(self._loader)
        for _ in range(self._seen):  # drawn again, through the same workers
            next(it)
        return it

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self._epoch, "seen": self._seen, "generator": self._epoch_start}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take the place in ``state`` (what ``state_dict()`` returned); the next batch is drawn from
        there. Refused, nothing changed, when it is not such a place or its generator state does not
        fit this loader's generator. A place past this loader's batches an epoch (the world grew since
        the save) is taken as the end of that epoch, with a warning: the next epoch begins."""
        if not isinstance(state, dict) or set(state) != set(_KEYS):
            got = sorted(state) if isinstance(state, dict) else type(state).__name__
            raise ValueError(f"not a ResumableLoader's state: expected the keys {list(_KEYS)}, got {got}")
        epoch, seen, generator = state["epoch"], state["seen"], state["generator"]
        for key, value in (("epoch", epoch), ("seen", seen)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"a ResumableLoader's {key} must be an integer of 0 or more, not {value!r}")
        current = self._loader.generator.get_state()
        if (
            type(generator) is not type(current)
            or getattr(generator, "dtype", None) != current.dtype
            or tuple(getattr(generator, "shape", ())) != tuple(current.shape)
        ):
            raise ValueError(
                "the saved generator state does not fit this loader's generator (another kind of generator, "
                "or another device's)"
            )
        batches = len(self._loader)
        if seen >= batches:
            # More ranks split the epoch into smaller shares (or the batch size, drop_last or the
            # dataset changed): the rest of the epoch is skipped, as the README says of a world
            # that grows, and the next epoch is whole.
            log.warning(
                "ResumableLoader: the saved place, batch %d of epoch %d, is past this loader's %d batches an "
                "epoch (the number of ranks, the batch size, drop_last or the dataset changed since the save): "
                "epoch %d is taken as done, and epoch %d begins",
                seen,
                epoch,
                batches,
                epoch,
                epoch + 1,
            )
            epoch, seen = epoch + 1, 0
        self._epoch, self._seen, self._epoch_start, self._it = epoch, seen, generator, None


def _sampler_problem(loader: Any) -> str | None:
    """Why the loader's sampler shuffles from a stream a resume cannot replay, or None.

    ``shuffle=True`` gives the ``RandomSampler`` it builds the loader's own generator, whose state
    at the epoch's start the place keeps. A sampler built by the script (``sampler=`` or inside
    ``batch_sampler=``) with a ``generator`` of None (torch's ``RandomSampler``,
    ``SubsetRandomSampler``, ``WeightedRandomSampler``) draws its order from torch's global stream
    instead, which a restore sets to the checkpoint's step; one with another generator draws from a
    stream no place holds. Either way the resumed epoch handed out batches already trained on and
    skipped others, without a word. Samplers without a ``generator`` (sequential ones,
    ``DistributedSampler``, whose order follows its seed and ``set_epoch``) are not asked."""
    samplers = [getattr(loader, "sampler", None), getattr(getattr(loader, "batch_sampler", None), "sampler", None)]
    for sampler in samplers:
        if sampler is None or not hasattr(sampler, "generator") or sampler.generator is loader.generator:
            continue
        name = type(sampler).__name__
        whose = "torch's global stream" if sampler.generator is None else "a generator of its own"
        return (
            f"ResumableLoader needs the loader's sampler to shuffle with the loader's generator: this {name} "
            f"draws each epoch's order from {whose}, which no checkpoint of the loader's place holds, so a "
            f"resumed epoch would hand out other batches. Give both the same generator ({name}(..., "
            "generator=g) and DataLoader(..., generator=g)), or use DataLoader(..., shuffle=True, generator=g)"
        )
    return None
