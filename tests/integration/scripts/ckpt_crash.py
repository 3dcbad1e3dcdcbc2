"""One save for the crash-point tests (test_checkpoint_crash_points.py), alone or as a torchrun rank.

``ckpt_crash.py URI MARKERS STEP [--keep N] [--async]``: builds the state of ``STEP``, writes a
copy of it to ``MARKERS/state.<rank>.pt`` (what a restore must give back: another process's
thread count may round the training steps differently), then ``MARKERS/ready.<rank>`` holding
its pid, and waits for ``MARKERS/go``. The test attaches strace
to that pid in between, so strace counts only the calls of the Checkpointer (its restore, the
save of ``STEP``, its retention pass, its close), not the interpreter's start. Under torchrun
(``RANK`` set) it joins a gloo group first. Exits 0 when the save committed, 3 when it raised
(the error on stderr).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback

import torch
import torch.distributed as dist
from ckpt_state import make_state, snapshot, train

from agent.checkpoint import Checkpointer


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("uri")
    p.add_argument("markers")
    p.add_argument("step", type=int)
    p.add_argument("--keep", type=int, default=2)
    p.add_argument("--async", dest="async_save", action="store_true")
    args = p.parse_args()
    if "RANK" in os.environ:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    state = make_state(0)
    train(state, args.step)
    torch.save(snapshot(state), os.path.join(args.markers, f"state.{rank}.pt"))
    ready = os.path.join(args.markers, f"ready.{rank}")
    with open(ready + ".tmp", "w") as f:
        f.write(str(os.getpid()))
    os.rename(ready + ".tmp", ready)
    while not os.path.exists(os.path.join(args.markers, "go")):
        time.sleep(0.05)
    try:
        with Checkpointer(args.uri, keep=args.keep, async_save=args.async_save) as ckpt:
            ckpt.restore(make_state(1))
            ckpt.save(args.step, state)
    except Exception:
        traceback.print_exc()
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
