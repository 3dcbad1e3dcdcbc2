"""A rank that meets its peers (gloo), all-reduces a one, and writes what torchrun-style launching
gave it to ``<prefix>.<RANK>.json``. ``--fail-rank R``: rank R exits 3 after meeting the others,
which wait for a signal."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist

KEYS = (
    "LOCAL_RANK", "RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "LOCAL_WORLD_SIZE", "WORLD_SIZE",
    "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING", "OMP_NUM_THREADS", "TORCHELASTIC_ERROR_FILE",
)  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("prefix")
    parser.add_argument("--fail-rank", type=int)
    parser.add_argument("--steps", type=int)  # the agent tests' start_agent passes it; unused
    args = parser.parse_args()
    dist.init_process_group("gloo")
    one = torch.ones(1)
    dist.all_reduce(one)
    rank = int(os.environ["RANK"])
    seen = {key: os.environ.get(key) for key in KEYS}
    seen.update(sum=one.item(), argv=sys.argv[1:], executable=sys.executable, pid=os.getpid())
    with open(f"{args.prefix}.{rank}.json", "w") as f:
        json.dump(seen, f)
    if args.fail_rank is not None:
        if rank == args.fail_rank:
            # Exit 3 and nothing else: leaving through the interpreter with the gloo group still up
            # sometimes aborts at exit (134, a known torch quirk), which is not what the test asks.
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(3)
        time.sleep(600)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
