"""The writer job of test_checkpoint_pins.py: one 2-rank torchrun that saves on request.

    torchrun --nproc-per-node=2 ckpt_pin_writer.py FOLDER

Waits for ``FOLDER/request-<n>.json`` (n = 0, 1, ...: ``{"uri": U, "steps": [A, B]}``, or
``{"stop": true}``), then does what ``ckpt_job.py saves --uri U --steps A B`` does (the job "train",
keep=1, saves steps A..B with retention logged at debug level), with its own Checkpointer, and
writes ``FOLDER/log-<n>.rank<r>`` (this rank's log lines of that request) and then
``FOLDER/done-<n>.rank<r>``. The tests race their readers against these saves, which must come
from another process and clock: one launcher and two ranks for the whole module, instead of a
torchrun of ``ckpt_job.py`` for each race.
"""

from __future__ import annotations

import logging
import os
import sys
from argparse import Namespace
from pathlib import Path

import torch.distributed as dist
from ckpt_harness import next_request
from ckpt_job import saves
from ckpt_state import exit_without_teardown

FORMAT = "%(asctime)s rank{rank} %(name)s %(levelname)s: %(message)s"


def main() -> None:
    folder = Path(sys.argv[1])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    logging.basicConfig(level=logging.INFO, format=FORMAT.format(rank=rank))
    n = 0
    while True:
        options = next_request(folder, n)
        if options.get("stop"):
            break
        handler = logging.FileHandler(folder / f"log-{n}.rank{rank}")
        handler.setFormatter(logging.Formatter(FORMAT.format(rank=rank)))
        logging.getLogger().addHandler(handler)
        try:
            saves(Namespace(uri=options["uri"], steps=options["steps"]), rank, dist.get_world_size())
        finally:
            logging.getLogger().removeHandler(handler)
            handler.close()
        (folder / f".done-{n}.rank{rank}").write_text("saved")
        os.replace(folder / f".done-{n}.rank{rank}", folder / f"done-{n}.rank{rank}")
        n += 1
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_without_teardown()
