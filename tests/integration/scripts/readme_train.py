"""The README's first example, as a user writes it: ``Checkpointer(uri, every_steps=...)``, no
``from_env()``. Run under ``spotjob-agent -- torchrun``, it must still hear the agent's flush.

    readme_train.py URI STEPS PIDS   trains STEPS steps (a pause each), stops early on a flush;
                                     each rank writes its pid to PIDS/pid.rank<r> (for cleanup)
"""

from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from agent import Checkpointer


def main() -> int:
    uri, steps, pids = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3])
    dist.init_process_group("gloo")
    (pids / f"pid.rank{dist.get_rank()}").write_text(str(os.getpid()))
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank{dist.get_rank()} %(name)s: %(message)s")
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    state = {"model": model, "optim": optim}

    ckpt = Checkpointer(uri, every_steps=1000)
    start = ckpt.restore(state)
    for step in range(start, steps):
        loss = model(torch.ones(3, 4)).pow(2).mean()
        optim.zero_grad()
        loss.backward()
        optim.step()
        time.sleep(0.05)
        if ckpt.step(step + 1, state):
            logging.info("stopping at step %d: the flush is committed", step + 1)
            break
    ckpt.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
