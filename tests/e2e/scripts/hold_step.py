"""A training script whose ranks hold inside step ``--hold-at`` for as long as the file ``--hold``
exists (rank 0 writes ``<hold>.held`` once they do): a run busy in one step for as long as a test
wants, so that a flush asked meanwhile cannot commit before the test lets the ranks go on. With
``--hold-at-end`` they hold after their last step instead, their training done: a flush asked
meanwhile finds no step left to serve it, and the ranks finish (exit 0) once let go. With
``--fail-after-hold PATH``, the ranks raise once let go if PATH exists then: a script that fails
during a flush asked meanwhile, by itself. One linear layer on gloo; the steps before the hold
report that the ranks train."""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist

from agent import Checkpointer

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=14)
# A rank reports its step to its agent at most once a second: the steps before the hold take longer,
# so that the run is seen training before its ranks hold.
parser.add_argument("--hold-at", type=int, default=10)
parser.add_argument("--step-sleep", type=float, default=0.25)
parser.add_argument("--hold", required=True)
parser.add_argument("--hold-at-end", action="store_true", help="hold after the last step, not in --hold-at")
parser.add_argument("--fail-after-hold", help="raise once the hold ends if this file exists")
args = parser.parse_args()
dist.init_process_group("gloo")
rank = dist.get_rank()


def hold(at: int) -> None:
    """Wait while the hold file exists (rank 0 says where in ``<hold>.held``)."""
    while os.path.exists(args.hold):
        if rank == 0 and not os.path.exists(f"{args.hold}.held"):
            with open(f"{args.hold}.held", "w") as f:
                f.write(str(at))
        time.sleep(0.05)
    if args.fail_after_hold and os.path.exists(args.fail_after_hold):
        raise RuntimeError(f"rank {rank} fails after the hold in step {at}, as asked")


model = torch.nn.Linear(4, 1)
state = {"model": model}
ckpt = Checkpointer.from_env()
start = ckpt.restore(state)
print(f"rank {rank} starting at step {start}", flush=True)
for step in range(start, args.steps):
    with torch.no_grad():
        model.weight.add_(0.01)
    time.sleep(args.step_sleep)
    if step + 1 == args.hold_at and not args.hold_at_end:
        hold(step + 1)
    if ckpt.step(step + 1, state):
        print(f"rank {rank} stopping at step {step + 1} for a flush", flush=True)
        break
else:  # every step trained, none stopped for a flush
    if args.hold_at_end:
        hold(args.steps)
ckpt.close()
