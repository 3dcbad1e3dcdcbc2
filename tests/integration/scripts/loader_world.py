"""Rank-side half of the loader-on-a-grown-world test; run under torchrun (or plain python = 1 rank).

    loader_world.py save --uri U       draw 3 batches of a ResumableLoader, save step 3
    loader_world.py restore --uri U --dump D
                                        restore (any world size); each rank dumps its loader's state
                                        and the generator state it was built with to ``D.rank<r>.pt``

Each rank's loader shuffles with a generator of its own (``manual_seed(1000 + rank)``), as README's
recipe builds it.
"""

from __future__ import annotations

import argparse
import logging
import os

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from agent.checkpoint import Checkpointer
from agent.loader import ResumableLoader


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["save", "restore"])
    p.add_argument("--uri", required=True)
    p.add_argument("--dump")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO)
    rank = 0
    if "WORLD_SIZE" in os.environ:
        dist.init_process_group("gloo")
        rank = dist.get_rank()
    generator = torch.Generator().manual_seed(1000 + rank)
    built = generator.get_state()
    loader = ResumableLoader(DataLoader(list(range(64)), batch_size=4, shuffle=True, generator=generator))
    state = {"loader": loader}
    with Checkpointer(args.uri, keep=None, async_save=False) as ckpt:
        if args.mode == "save":
            for _ in range(3):
                loader.next_batch()
            ckpt.save(3, state)
        else:
            step = ckpt.restore(state)
            first = loader.next_batch()
            torch.save(
                {"step": step, "state": loader.state_dict(), "built": built, "first": first},
                f"{args.dump}.rank{rank}.pt",
            )
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
