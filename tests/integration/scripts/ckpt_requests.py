"""A job that saves, restores and reads back its checkpoint, for counting its requests to the store.

``ckpt_requests.py URI STAGING``: every rank (gloo) builds a Checkpointer on URI, restores, saves
step 1 and step 2 (retention, keep=1, removes step 1), closes; then builds a read-only
Checkpointer on the same URI, restores from it and closes. All ranks share STAGING, as the ranks
of one node do. The test counts what reaches the store through a proxy.

``ckpt_requests.py URI STAGING --reader URI2``: the same, then (its requests all made) a read-only
Checkpointer on URI2 as well, in the same process group; each rank prints what building that one
raised (``rank R raised TYPE: MESSAGE``), then leaves the group. The tests give it a store whose
owner record is broken: a case of its own that shares the job's ranks, as starting them is most
of what a run costs.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch import nn

from agent.checkpoint import Checkpointer


def main() -> int:
    uri, staging = sys.argv[1], sys.argv[2]
    if sys.argv[3:] and sys.argv[3] != "--reader":
        raise SystemExit(f"unknown arguments {sys.argv[3:]}")
    reader_uri = sys.argv[4] if sys.argv[3:] else None
    dist.init_process_group("gloo")
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
    if reader_uri is not None:
        try:
            Checkpointer(reader_uri, read_only=True, staging_dir=f"{staging}-reader").close()
        except Exception as e:
            print(f"rank {dist.get_rank()} raised {type(e).__name__}: {e}", flush=True)
        dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
