"""The README's training-side snippets run as written: the loop of "The training-side API", the
`ZeroShard` of "A `ZeroRedundancyOptimizer`" and the `ResumableLoader` of "A plain `DataLoader`",
each read out of README.md and run as it stands, in
one process of a gloo group of one (the README: "a single process with `world_size=1`" works as
torchrun's ranks do). Only the names a reader supplies (model, optimizer, loader, a step) are
defined around them, and the snippet's bucket becomes a folder.

A renamed argument or method, or a snippet that no longer restores what it saved, fails here
instead of in a reader's first run. It pins what already held when it was written.
"""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

SCRIPT = """
import re, sys, textwrap
import torch, torch.distributed as dist
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer

readme = open(sys.argv[1]).read()
api = readme[readme.index("## The training-side API"):]
loop = re.search(r"```python\\n(.*?)```", api, re.S).group(1).replace('"s3://bucket/jobs/run1"', repr(sys.argv[2]))
zero_part = readme[readme.index("- **A `ZeroRedundancyOptimizer`**"):]
zero_snippet = textwrap.dedent(re.search(r"```python\\n(.*?)```", zero_part, re.S).group(1))
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + sys.argv[4], rank=0, world_size=1)

class Loader:
    position = 0
    def state_dict(self): return {"position": self.position}
    def load_state_dict(self, state): self.position = state["position"]

def run_loop(total_steps):
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Linear(4, 2))
    optimizer = torch.optim.Adam(model.parameters())
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 5)
    loader = Loader()
    def train_one_step():
        model(torch.ones(2, 4)).sum().backward()
        optimizer.step(); optimizer.zero_grad(); scheduler.step(); loader.position += 1
    names = dict(globals(), model=model, optimizer=optimizer, scheduler=scheduler, loader=loader,
                 train_one_step=train_one_step, total_steps=total_steps)
    exec(loop, names)
    return names["start"], loader.position

print("loop", *run_loop(250), *run_loop(320))  # every_steps=100: the second run resumes at 200

from agent import Checkpointer
ddp_model = nn.parallel.DistributedDataParallel(nn.Linear(4, 6))
zero = ZeroRedundancyOptimizer(ddp_model.parameters(), optimizer_class=torch.optim.Adam, lr=0.01)
scheduler = torch.optim.lr_scheduler.StepLR(zero, 5)
names = dict(globals())
exec(zero_snippet, names)
with Checkpointer(sys.argv[3], async_save=False) as ckpt:
    ckpt.restore(names["state"])
    ddp_model(torch.ones(2, 4)).sum().backward()
    zero.step()
    ckpt.save(1, names["state"])
saved = {k: v["exp_avg"].clone() for k, v in zero.optim.state_dict()["state"].items()}
zero.optim.state.clear()
with Checkpointer(sys.argv[3], async_save=False) as ckpt:
    start = ckpt.restore(names["state"])
restored = {k: v["exp_avg"] for k, v in zero.optim.state_dict()["state"].items()}
print("zero", start, all(torch.equal(saved[k], restored[k]) for k in saved) and saved.keys() == restored.keys())
dist.destroy_process_group()
"""


def test_the_readme_snippets_save_and_resume_as_written(tmp_path: Path) -> None:
    from agent.ranks import free_port

    script = tmp_path / "snippets.py"
    script.write_text(textwrap.dedent(SCRIPT))
    argv = [str(REPO / "README.md"), str(tmp_path / "loop"), str(tmp_path / "zero"), str(free_port())]
    out = subprocess.run(
        [sys.executable, str(script), *argv], cwd=REPO, capture_output=True, text=True, timeout=300
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    said = dict(re.findall(r"^(loop|zero) (.*)$", out.stdout, re.M))
    assert said["loop"] == "0 250 200 320", out.stdout
    assert said["zero"] == "1 True", out.stdout


LOADER_SCRIPT = """
import re, sys, textwrap
import torch, torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from agent import Checkpointer

readme = open(sys.argv[1]).read()
part = readme[readme.index("- **A plain `DataLoader`**"):]
snippet = textwrap.dedent(re.search(r"```python\\n(.*?)```", part, re.S).group(1))
snippet = snippet.replace("batch_size=32", "batch_size=4")
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + sys.argv[3], rank=0, world_size=1)

class Masked(Dataset):
    # an augmentation drawn in the worker, from the seed its epoch's iterator gave it
    def __len__(self): return 24
    def __getitem__(self, i): return torch.full((3,), float(i)) * (torch.rand(3) > 0.3)

def build():
    model = nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 5)
    names = dict(globals(), dataset=Masked(), rank=0, model=model, optimizer=optimizer, scheduler=scheduler)
    exec(snippet, names)
    return names["data"], names["state"]

total = 3 * 6  # 3 epochs of 6 batches
data, _ = build()
whole = [data.next_batch() for _ in range(total)]
for cut in (6, 9):  # at an epoch's end, and in the middle of the next
    uri = sys.argv[2] + f"/{cut}"
    data, state = build()
    head = [data.next_batch() for _ in range(cut)]
    with Checkpointer(uri, async_save=cut == 9) as ckpt:  # sync, then async
        ckpt.save(cut, state)
    data, state = build()
    with Checkpointer(uri, async_save=False) as ckpt:
        start = ckpt.restore(state)
    place = (data.epoch, data.seen)
    rng = torch.get_rng_state()
    tail = [data.next_batch() for _ in range(total - cut)]
    same = all(torch.equal(a, b) for a, b in zip(whole, head + tail, strict=True))
    print("cut", cut, start, *place, same, torch.equal(rng, torch.get_rng_state()))
dist.destroy_process_group()
"""


def test_the_readme_dataloader_recipe_resumes_the_same_batches(tmp_path: Path) -> None:
    """The `ResumableLoader` example of "A plain `DataLoader`", read out of README.md as it stands:
    resumed through the Checkpointer from a checkpoint at an epoch's end (a sync save) and from one
    mid-epoch (an async one), it hands out the same batches, bit for bit, as one loader that was
    never stopped, its workers' augmentations included, without a draw from torch's global stream.
    A wrapper that rolls over to the next epoch only at the next batch fails the cut at the epoch's
    end (the unit tests in tests/unit/test_resumable_loader.py break it one way at a time)."""
    from agent.ranks import free_port

    script = tmp_path / "loader.py"
    script.write_text(textwrap.dedent(LOADER_SCRIPT))
    argv = [str(REPO / "README.md"), str(tmp_path / "ckpt"), str(free_port())]
    out = subprocess.run(
        [sys.executable, str(script), *argv], cwd=REPO, capture_output=True, text=True, timeout=300
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    said = re.findall(r"^cut (.*)$", out.stdout, re.M)
    assert said == ["6 6 1 0 True True", "9 9 1 3 True True"], out.stdout
