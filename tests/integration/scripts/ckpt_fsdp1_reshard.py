"""Rank side of the FSDP1 resharding test (CPU, gloo); run under torchrun.

    ckpt_fsdp1_reshard.py --dump D --uri U --until N [--flat] [--then --dump D2 ...]

Wraps a small model in FSDP1 (``use_orig_params=True``; ``--flat``: False) with AdamW, restores
from ``U`` and trains to step N, saving every 3 steps asynchronously. Every rank trains on the
same batch at each step (drawn from a generator seeded with the step), so the averaged gradient,
and with it the whole run, is the same on any number of ranks: a checkpoint restored on another
world size must go on exactly as the run that wrote it. Rank 0 dumps to ``D.pt`` the step it
started at, the full parameters just after the restore and at the end (gathered with
``summon_full_params``), and the losses; a case that raised leaves its traceback instead.
``--then`` runs another case in the same process group.
"""

from __future__ import annotations

import argparse
import sys
import traceback

import torch
import torch.distributed as dist
from ckpt_state import exit_without_teardown, split_cases
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel

from agent import Checkpointer


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--dump", required=True)
    p.add_argument("--uri", required=True)
    p.add_argument("--until", type=int, required=True)
    p.add_argument("--flat", action="store_true")
    return p.parse_args(argv)


def run_case(args: argparse.Namespace) -> dict[str, object]:
    torch.manual_seed(0)
    body = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 3))
    model = FullyShardedDataParallel(body, use_orig_params=not args.flat, device_id=torch.device("cpu"))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state: dict[str, object] = {"model": model, "optim": optim}

    def full() -> list[torch.Tensor]:  # a collective: every rank calls it
        with FullyShardedDataParallel.summon_full_params(model):
            return [p.detach().clone() for p in model.parameters()]

    losses = []
    with Checkpointer(args.uri, every_steps=3, keep=2) as ckpt:
        start = ckpt.restore(state)
        restored = full()
        for step in range(start, args.until):
            x = torch.randn(4, 4, generator=torch.Generator().manual_seed(step))
            loss = model(x).pow(2).mean()
            loss.backward()
            optim.step()
            optim.zero_grad()
            losses.append(loss.item())
            ckpt.step(step + 1, state)
    return {"start": start, "restored": restored, "end": full(), "losses": losses}


def main() -> None:
    parsed = [parse(case) for case in split_cases(sys.argv[1:])]
    dist.init_process_group("gloo")
    for args in parsed:
        try:
            out = run_case(args)
        except Exception:  # one case's failure is its own test's
            out = {"error": traceback.format_exc()}
        if dist.get_rank() == 0:
            torch.save(out, f"{args.dump}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_without_teardown()
