"""A training script whose ranks never meet: each calls ``init_process_group`` for one rank more
than were started (a world size larger than the ranks started), and rank 0's store waits for that
rank until ``--timeout`` seconds (default 600), when every rank fails as torch fails them."""

from __future__ import annotations

import argparse
import os
from datetime import timedelta

import torch.distributed as dist

parser = argparse.ArgumentParser()
parser.add_argument("--timeout", type=float, default=600.0)
args = parser.parse_args()
world = int(os.environ["WORLD_SIZE"]) + 1
dist.init_process_group("gloo", rank=int(os.environ["RANK"]), world_size=world, timeout=timedelta(seconds=args.timeout))
raise SystemExit("the ranks met, which this script is written never to do")
