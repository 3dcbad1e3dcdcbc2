"""2 DDP ranks training on a plain ``DataLoader`` through ``agent.ResumableLoader``: a shuffling
``DistributedSampler``, one worker a rank drawing a random mask for every item from the seed its
epoch's iterator gave it, 6 batches a rank an epoch. ``--dump PREFIX`` writes each rank's final
model, optimizer, loader place and the batches it drew after its last (re)start, for the e2e test
of a preempted run ending bit-identical to one never stopped (tests/e2e/test_local_loader.py)."""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from agent import Checkpointer, ResumableLoader


class Masked(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    def __len__(self) -> int:
        return 48

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.full((8,), (i + 1) / 48.0) * (torch.rand(8) > 0.3)  # drawn in the worker
        return x, torch.tensor([float(i % 3)])


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--dump", default=None)
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Linear(8, 1))
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    dataset = Masked()
    loader = DataLoader(
        dataset,
        batch_size=4,
        sampler=DistributedSampler(dataset, shuffle=True, seed=1),
        num_workers=1,
        drop_last=True,
        generator=torch.Generator().manual_seed(rank),
    )
    data = ResumableLoader(loader)
    state = {"model": model, "optim": optim, "loader": data}
    ckpt = Checkpointer.from_env()
    start = ckpt.restore(state)
    print(f"rank {rank} starting at step {start} (epoch {data.epoch}, batch {data.seen})", flush=True)
    drawn = []
    for step in range(start, args.steps):
        x, y = data.next_batch()
        drawn.append(x.clone())
        loss = ((model(x) - y) ** 2).mean()
        optim.zero_grad()
        loss.backward()
        optim.step()
        time.sleep(args.step_sleep)
        if ckpt.step(step + 1, state):
            break
    ckpt.close()
    if args.dump:  # saved at once: the tensors need no copies
        final = {"model": model.state_dict(), "optim": optim.state_dict(), "loader": data.state_dict()}
        torch.save({**final, "drawn_from": start, "drawn": drawn}, f"{args.dump}.rank{rank}.pt")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
