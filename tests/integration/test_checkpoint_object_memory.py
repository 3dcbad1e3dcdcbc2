"""An object whose ``state_dict()`` holds big tensors (an EMA of the weights, a replay buffer) costs
one copy of them in host memory to save and one to restore, not three and two: the rank file was
serialized with torch.save's zip CRC-32 into memory and then copied out of it (``getvalue()``),
and every save read the written file back into memory and loaded its tensors once more to check it.
Now it is serialized without the CRC-32 (the manifest's CRC32C covers the file), written from the
buffer itself, checked with its tensors mapped from the file, and restored straight from the file.

The peak is measured in a process of its own (``ru_maxrss`` only grows), in copies of the tensor:
each measurement is a child forked from one process per module that has imported torch and the
Checkpointer and done nothing else (no thread started, no tensor made), so that the four
measurements pay for one import of torch instead of four. A forked child's ``ru_maxrss`` starts
from its memory at the fork, not from its parent's peak, and each measurement's base is taken in
the child after the fork, as the process of its own took it after its start.
"""

from __future__ import annotations

import subprocess
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from agent.checkpoint import Checkpointer
from agent.manifest import rank_file_name
from tests.line_server import ask, line_server

MB = 192
PROBE = f"""
import json, os, resource, sys, traceback, torch
from agent.checkpoint import Checkpointer

class Ema:
    def __init__(self, t): self.shadow = t
    def state_dict(self): return {{"shadow": self.shadow}}
    def load_state_dict(self, s): self.shadow = s["shadow"]

def peak(): return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

def measure(uri, what):
    size = {MB} << 20
    with Checkpointer(uri, async_save=what == "async") as ckpt:
        if what == "restore":
            ema = Ema(torch.zeros(1, dtype=torch.uint8))
            base = peak()
            ckpt.restore({{"ema": ema}})
            assert ema.shadow.numel() == size and ema.shadow.min() == ema.shadow.max() == 7
        else:
            ema = Ema(torch.full((size,), 7, dtype=torch.uint8))
            ckpt.save(0, {{"ema": Ema(torch.zeros(1, dtype=torch.uint8))}})  # the first save's own costs
            base = peak()
            ckpt.save(1, {{"ema": ema}})
            ckpt.wait()
    return (peak() - base) / size

for line in sys.stdin:  # one measurement per line: [uri, what]; each in a child of its own
    uri, what = json.loads(line)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        try:
            said, code = repr(measure(uri, what)), 0
        except BaseException:
            said, code = traceback.format_exc(), 1
        os.write(write, said.encode())
        os._exit(code)
    os.close(write)
    with os.fdopen(read, "rb") as got:
        said = got.read().decode()
    _, status = os.waitpid(pid, 0)
    print(json.dumps([os.waitstatus_to_exitcode(status), said]), flush=True)
"""


@pytest.fixture(scope="module")
def prober(tmp_path_factory: pytest.TempPathFactory) -> Iterator[subprocess.Popen[str]]:
    """The process each measurement is forked from (torch and the Checkpointer imported)."""
    script = tmp_path_factory.mktemp("probe") / "probe.py"
    script.write_text(PROBE)
    with line_server([sys.executable, str(script)]) as proc:
        yield proc


def copies(prober: subprocess.Popen[str], tmp_path: Path, what: str) -> float:
    code, said = ask(prober, [str(tmp_path / "ckpt"), what], "the probe process")
    assert code == 0, said
    return float(said)


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_an_objects_big_tensor_is_held_once_more_to_save_and_once_to_restore(
    prober: subprocess.Popen[str], tmp_path: Path, async_save: bool
) -> None:
    assert copies(prober, tmp_path, "async" if async_save else "sync") < 1.5  # was 3.0
    assert copies(prober, tmp_path, "restore") < 1.5  # was 2.0


class Held:
    def __init__(self, t: torch.Tensor) -> None:
        self.t = t

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"t": self.t}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.t = state["t"]


def test_the_rank_file_skips_the_zip_crc32_and_restores_exactly(tmp_path: Path) -> None:
    """README: spotjob's own files skip torch.save's zip CRC-32; the rank files kept it."""
    saved = Held(torch.randn(300, 70))
    with Checkpointer(str(tmp_path), async_save=False) as ckpt:
        ckpt.save(1, {"held": saved})
    (rank_file,) = tmp_path.glob(f"step-*/{rank_file_name(0)}")
    with zipfile.ZipFile(rank_file) as z:
        assert {i.CRC for i in z.infolist() if "/data/" in i.filename and i.file_size} == {0}
    fresh = Held(torch.zeros(1))
    with Checkpointer(str(tmp_path)) as ckpt:
        assert ckpt.restore({"held": fresh}) == 1
    assert torch.equal(fresh.t, saved.t)
    assert torch.serialization.get_crc32_options() is True
