"""A job that saves, restores and reads back its checkpoint, for counting its requests to the store.

``ckpt_requests.py URI STAGING``: every rank (gloo) builds a Checkpointer on URI, restores, saves
step 1 and step 2 (retention, keep=1, removes step 1), closes; then builds a read-only
Checkpointer on the same URI, restores from it and closes. All ranks share STAGING, as the ranks
of one node do. The test counts what reaches the store through a proxy.

``ckpt_requests.py URI STAGING --reader``: only the read-only Checkpointer; each rank prints what
building it raised (``rank R raised TYPE: MESSAGE``), then leaves the group.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch import nn

from agent.checkpoint import Checkpointer


def main() -> int:
    uri, staging = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    if sys.argv[3:] == ["--reader"]:
        try:
            Checkpointer(uri, read_only=True, staging_dir=staging).close()
        except Exception as e:
            print(f"rank {dist.get_rank()} raised {type(e).__name__}: {e}", flush=True)
        dist.barrier()
        dist.destroy_process_group()
        return 0
    torch.manual_seed(0)
    model = nn.Linear(8, 4)
    state = {"model": model, "optim": torch.optim.SGD(model.parameters(), lr=0.1)}
    with Checkpointer(uri, keep=1, staging_dir=staging, async_save=False) as ckpt:
        ckpt.restore(state)
        ckpt.save(1, state)
        ckpt.save(2, state)
    dist.barrier()
    with Checkpointer(uri, read_only=True, staging_dir=staging) as reader:
        assert reader.restore({"model": nn.Linear(8, 4)}) == 2
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
