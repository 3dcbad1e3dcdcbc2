"""Rank side of test_checkpoint_ddp_buffers: a DDP model with a BatchNorm, each rank on its own batches.

    ckpt_ddp_buffers.py full --uri U --dump D     train 6 steps, save step 3 on the way (sync and async)
    ckpt_ddp_buffers.py resume --uri U --dump D   restore step 3 into a fresh model, train to step 6
    ckpt_ddp_buffers.py bare --uri U --dump D     restore step 3 into the bare module (no DDP), no training
    ckpt_ddp_buffers.py ema --uri U --dump D      timm's recipe: a seed per rank, an EMA of the model
                                                  copied before DDP; train 6 steps saving at 3, restore
    ckpt_ddp_buffers.py order --uri U --dump D    optimizer groups listing their parameters in another
                                                  order on rank 1; train 3 steps, save, restore

    ckpt_ddp_buffers.py cases --root R CASE...    run several of the above one after the other in
                                                  one process group (one torchrun instead of one
                                                  each); CASE is ``command`` (async saves) or
                                                  ``command:sync``, with URI ``R/<command>-<mode>/ckpt``
                                                  and dump ``R/<command>-<mode>/dump``, except that
                                                  ``resume`` and ``bare`` restore ``full``'s URI of
                                                  their mode. Each case seeds and builds its own model,
                                                  optimizer and Checkpointer, as its own run would;
                                                  restore cases go in a later torchrun than the saves
                                                  they read, so nothing of the save's process is
                                                  left for the restore to lean on.

Each rank dumps its module's final state to ``D.<command>.rank<r>.pt`` (``full`` also the state
it saved). The ranks' BatchNorm running statistics differ after every step (each forward updates
them from the rank's own batch) until DDP's next forward broadcasts rank 0's.
"""

from __future__ import annotations

import argparse
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from ckpt_state import exit_without_teardown
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from agent.checkpoint import Checkpointer

SAVE_STEP, STEPS = 3, 6


def train_step(model: nn.Module, optim: torch.optim.Optimizer, step: int, rank: int) -> None:
    """One step on this rank's own batch (seeded by step and rank)."""
    x = torch.randn(16, 4, generator=torch.Generator().manual_seed(1000 * step + rank))
    optim.zero_grad()
    model(x).pow(2).mean().backward()
    optim.step()


COMMANDS = ("full", "resume", "bare", "ema", "order")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("command", choices=[*COMMANDS, "cases"])
    p.add_argument("case", nargs="*", help="with cases: command or command:sync")
    p.add_argument("--uri")
    p.add_argument("--dump")
    p.add_argument("--root")
    p.add_argument("--sync", action="store_true")
    args = p.parse_intermixed_args()
    if args.command == "cases":
        if not args.root or not args.case:
            p.error("cases needs --root and at least one case")
        jobs = []
        for case in args.case:
            command, _, mode = case.partition(":")
            if command not in COMMANDS or mode not in ("", "sync"):
                p.error(f"unknown case {case!r}")
            mode = mode or "async"
            source = "full" if command in ("resume", "bare") else command
            uri, dump = f"{args.root}/{source}-{mode}/ckpt", f"{args.root}/{command}-{mode}/dump"
            jobs.append((command, uri, dump, mode == "sync"))
    else:
        if not args.uri or not args.dump or args.case:
            p.error(f"{args.command} needs --uri and --dump and no cases")
        jobs = [(args.command, args.uri, args.dump, args.sync)]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    for command, uri, dump, sync in jobs:
        Path(dump).parent.mkdir(parents=True, exist_ok=True)
        if len(jobs) == 1:
            run_case(command, uri, dump, rank, sync=sync)
            continue
        try:
            run_case(command, uri, dump, rank, sync=sync)
        except Exception:  # one case's failure is its own test's, not the others'
            # The checkpointer's refusals are decided together (every rank raises), so the group
            # stays in step for the next case; the case's test fails with this text.
            torch.save({"error": traceback.format_exc()}, f"{dump}.{command}.rank{rank}.pt")
    dist.destroy_process_group()


def run_case(command: str, uri: str, dump: str, rank: int, *, sync: bool) -> None:
    if command in ("ema", "order"):
        (ema_job if command == "ema" else order_job)(uri, dump, rank, sync=sync)
        return
    torch.manual_seed(rank + 1 if command == "bare" else 0)  # bare: the restore must set every tensor
    bare = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
    if command == "bare":
        optim = torch.optim.SGD(bare.parameters(), lr=0.1)
        with Checkpointer(uri, async_save=not sync) as ckpt:
            start = ckpt.restore({"model": bare, "optim": optim})
        restored = {k: v.clone() for k, v in bare.state_dict().items()}
        torch.save({"start": start, "final": restored}, f"{dump}.bare.rank{rank}.pt")
        return
    model = DistributedDataParallel(bare)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    state = {"model": model, "optim": optim}
    saved = None
    with Checkpointer(uri, async_save=not sync) as ckpt:
        start = ckpt.restore(state) if command == "resume" else 0
        for step in range(start, STEPS):
            train_step(model, optim, step, rank)
            if step + 1 == SAVE_STEP and command == "full":
                saved = {k: v.clone() for k, v in model.module.state_dict().items()}
                ckpt.save(SAVE_STEP, state)
    final = {k: v.clone() for k, v in model.module.state_dict().items()}
    torch.save({"start": start, "saved": saved, "final": final}, f"{dump}.{command}.rank{rank}.pt")


def ema_job(uri: str, dump: str, rank: int, *, sync: bool) -> None:
    """timm's train.py: a seed per rank (each rank's initial weights its own until DDP broadcasts
    rank 0's), the EMA copied from the model before DDP wraps it, so each rank's EMA starts from
    its own weights and never becomes bit-identical to the others'. Saves step 3, restores it into
    fresh objects; dumps each rank's EMA as saved and as restored."""
    torch.manual_seed(rank)

    def build() -> tuple[nn.Module, nn.Module, torch.optim.Optimizer]:
        bare = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        ema = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)).requires_grad_(False)
        ema.load_state_dict(bare.state_dict())
        model = DistributedDataParallel(bare)
        return model, ema, torch.optim.AdamW(model.parameters(), lr=0.01)

    model, ema, optim = build()
    state = {"model": model, "optim": optim, "ema": ema}
    out: dict[str, object] = {}
    with Checkpointer(uri, async_save=not sync) as ckpt:
        for step in range(STEPS):
            train_step(model, optim, step, rank)
            with torch.no_grad():
                for e, p in zip(ema.parameters(), model.module.parameters(), strict=True):
                    e.lerp_(p, 0.1)
            if step + 1 == SAVE_STEP:
                out["saved"] = {k: v.clone() for k, v in ema.state_dict().items()}
                out["model"] = {k: v.clone() for k, v in model.module.state_dict().items()}
                ckpt.save(SAVE_STEP, state)
    model, ema, optim = build()
    with Checkpointer(uri, async_save=not sync) as ckpt:
        out["start"] = ckpt.restore({"model": model, "optim": optim, "ema": ema})
    out["restored"] = {k: v.clone() for k, v in ema.state_dict().items()}
    out["restored_model"] = {k: v.clone() for k, v in model.module.state_dict().items()}
    torch.save(out, f"{dump}.ema.rank{rank}.pt")


def order_job(uri: str, dump: str, rank: int, *, sync: bool) -> None:
    """Weight-decay groups whose parameters rank 1 lists in another order, as groups built from a
    set do (a set of tensors iterates in an order of their addresses, each process its own): the
    ranks train alike. Saves step 3, restores it into fresh objects built the same way; dumps each
    rank's optimizer state and weight decay by parameter name, as saved and as restored."""

    def build() -> tuple[DistributedDataParallel, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = DistributedDataParallel(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)))
        named = list(model.module.named_parameters())[:: -1 if rank == 1 else 1]
        groups = [
            {"params": [p for n, p in named if n.endswith("weight")], "weight_decay": 0.1},
            {"params": [p for n, p in named if n.endswith("bias")], "weight_decay": 0.0},
        ]
        return model, torch.optim.AdamW(groups, lr=0.01)

    def by_name(model: DistributedDataParallel, optim: torch.optim.Optimizer) -> dict[str, object]:
        names = {id(p): n for n, p in model.module.named_parameters()}
        decay = {names[id(p)]: g["weight_decay"] for g in optim.param_groups for p in g["params"]}
        state = {names[id(p)]: {k: v.clone() for k, v in s.items()} for p, s in optim.state.items()}
        return {"decay": decay, "state": state}

    model, optim = build()
    out: dict[str, object] = {}
    with Checkpointer(uri, async_save=not sync) as ckpt:
        for step in range(SAVE_STEP):
            train_step(model, optim, step, rank)
        out["saved"] = by_name(model, optim)
        ckpt.save(SAVE_STEP, {"model": model, "optim": optim})
    model, optim = build()
    with Checkpointer(uri, async_save=not sync) as ckpt:
        out["start"] = ckpt.restore({"model": model, "optim": optim})
    out["restored"] = by_name(model, optim)
    torch.save(out, f"{dump}.order.rank{rank}.pt")


if __name__ == "__main__":
    main()
    exit_without_teardown()
