"""Rank-side half of test_restore_optimizer_by_name's torchrun case (DDP over gloo).

    ckpt_optim_groups.py save --uri U       Adam with two groups (layer 0: lr 0.1; layer 2: lr 0.01,
                                            weight decay 0.5), 3 steps, save step 3
    ckpt_optim_groups.py restore --uri U --groups {reordered,moved} --dump D
                                            restore into a fresh model whose optimizer lists the
                                            groups in the other order, or with bias 0 moved to
                                            layer 2's group; dump each parameter's state by name

    ckpt_optim_groups.py all --uri U --dump D
                                            the three above in one process group, one after the
                                            other: save, restore reordered, restore moved (one
                                            torchrun instead of three; each case builds its own
                                            model and optimizer from its own seed and opens its
                                            own Checkpointer, as a separate run would)

Each rank dumps ``D.rank<r>.pt``: the step restored (or the refusal's text) and the state by name
(``all`` dumps to ``D-reordered.rank<r>.pt`` and ``D-moved.rank<r>.pt``).
"""

from __future__ import annotations

import argparse
import copy
from typing import Any

import torch
import torch.distributed as dist
from ckpt_state import exit_without_teardown
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from agent.checkpoint import Checkpointer, RestoreRefusedError


def model_and_optim(seed: int, groups: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    inner = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
    first, second = list(inner[0].parameters()), list(inner[2].parameters())
    if groups == "saved":
        layout = [(first, 0.1, 0.0), (second, 0.01, 0.5)]
    elif groups == "reordered":
        layout = [(second, 1.0, 0.0), (first, 1.0, 0.0)]
    else:  # moved
        layout = [([inner[0].weight], 1.0, 0.0), ([inner[0].bias, *second], 1.0, 0.0)]
    optim = torch.optim.Adam([{"params": p, "lr": lr, "weight_decay": wd} for p, lr, wd in layout])
    return DistributedDataParallel(inner), optim


def by_name(model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, dict[str, Any]]:
    group_of = {id(p): g for g in optim.param_groups for p in g["params"]}
    return {
        name: {
            "state": copy.deepcopy(optim.state.get(p, {})),
            "lr": group_of[id(p)]["lr"],
            "weight_decay": group_of[id(p)]["weight_decay"],
            "param": p.detach().clone(),
        }
        for name, p in model.named_parameters()
    }


def save(uri: str, rank: int) -> None:
    model, optim = model_and_optim(0, "saved")
    for step in range(3):
        g = torch.Generator().manual_seed(step * 10 + rank)
        x, y = torch.randn(5, 4, generator=g), torch.randn(5, 4, generator=g)
        optim.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        optim.step()
    with Checkpointer(uri, keep=None) as ckpt:
        ckpt.save(3, {"model": model, "optim": optim})
    torch.save({"saved": by_name(model, optim)}, f"{uri}.saved.rank{rank}.pt")


def restore(uri: str, groups: str, dump: str, rank: int) -> None:
    model, optim = model_and_optim(1, groups)
    before = by_name(model, optim)
    with Checkpointer(uri, keep=None) as ckpt:
        try:
            outcome: int | str = ckpt.restore({"model": model, "optim": optim})
        except RestoreRefusedError as e:
            outcome = str(e)
    torch.save({"outcome": outcome, "before": before, "after": by_name(model, optim)}, f"{dump}.rank{rank}.pt")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=("save", "restore", "all"))
    parser.add_argument("--uri", required=True)
    parser.add_argument("--groups", default="saved")
    parser.add_argument("--dump")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if args.mode == "save":
        save(args.uri, rank)
    elif args.mode == "restore":
        restore(args.uri, args.groups, args.dump, rank)
    else:
        save(args.uri, rank)
        for groups in ("reordered", "moved"):
            restore(args.uri, groups, f"{args.dump}-{groups}", rank)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_without_teardown()
