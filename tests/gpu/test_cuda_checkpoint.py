"""The Checkpointer on CUDA tensors: what the staging into pinned host memory promises, checked on a GPU.

With CUDA present an async save stages the state into page-locked (pinned) host buffers kept between
saves, the device-to-host copies enqueued without blocking and waited for once before ``step()``
returns (``agent._staging.staging_options`` / ``make_stager``). None of it runs without a GPU, so
these tests are skipped (with the reason) wherever ``torch.cuda.is_available()`` is False: on the
development machines and in CI. ``scripts/gpu-check.sh`` runs them on a machine with one NVIDIA GPU.

One process, no ``torch.distributed`` (a Checkpointer without a process group saves as one rank;
one GPU could not host two NCCL ranks anyway). Small states: each test takes seconds.

No fix comes with these tests: they check code that exists and has never run on a GPU, so none of
them has yet been seen to pass or to fail there. Their logic was checked on CPU (the same tests
with the CUDA-only assertions taken out pass).
"""

from __future__ import annotations

import gc
import warnings
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import agent.checkpoint._save as save_module
from agent.checkpoint import Checkpointer

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(
        not torch.cuda.is_available(),
        reason="needs an NVIDIA GPU and a CUDA build of torch (torch.cuda.is_available() is False here); "
        "scripts/gpu-check.sh runs these on a GPU machine",
    ),
]


@pytest.fixture
def device() -> Iterator[torch.device]:
    """The last GPU, made the current one for the test (with one GPU that is cuda:0), then put back."""
    before = torch.cuda.current_device()
    index = torch.cuda.device_count() - 1
    torch.cuda.set_device(index)
    try:
        yield torch.device("cuda", index)
    finally:
        torch.cuda.set_device(before)


def trained(device: torch.device, seed: int = 0) -> tuple[nn.Module, torch.optim.Adam]:
    """A small model on ``device`` and its Adam after two steps (so both moments are non-zero)."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 32)).to(device)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(2):
        model(torch.randn(8, 64, device=device)).square().mean().backward()
        optim.step()
        optim.zero_grad(set_to_none=True)
    return model, optim


def blank(device: torch.device) -> tuple[nn.Module, torch.optim.Adam]:
    """What a restarted job builds before it restores: the same shapes, other values, no optimizer state."""
    model, _ = trained(device, seed=1)
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def tensors_of(model: nn.Module, optim: torch.optim.Optimizer) -> list[tuple[str, torch.Tensor]]:
    """Every tensor a checkpoint holds, by name, detached copies (so later training cannot change them)."""
    out = [(f"model.{k}", v.detach().clone()) for k, v in model.state_dict().items()]
    for i, p in enumerate(optim.param_groups[0]["params"]):
        for k, v in sorted(optim.state[p].items()):
            if isinstance(v, torch.Tensor):
                out.append((f"optim.{i}.{k}", v.detach().clone()))
    return out


def assert_bit_exact(expected: list[tuple[str, torch.Tensor]], got: list[tuple[str, torch.Tensor]]) -> None:
    assert [n for n, _ in got] == [n for n, _ in expected]
    for (name, want), (_, have) in zip(expected, got, strict=True):
        assert have.device == want.device, (name, have.device, want.device)
        assert have.dtype == want.dtype, name
        # Bit for bit (NaN-safe, -0.0 told from 0.0): the same bytes, not merely equal values.
        assert torch.equal(have.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)), name


def kept_buffers(ck: Checkpointer) -> dict[int, torch.UntypedStorage]:
    """The host buffers the Checkpointer's stager keeps between saves, by the address of the
    storage each copies (DCP's ``StateDictStager._cached_storage_mapping``)."""
    stager = ck._stager
    assert stager is not None, "no stager: an async save made none, or it was released"
    mapping = stager._state_dict_stager._cached_storage_mapping
    return {source.data_ptr(): buffer for source, buffer in mapping.items()}


def user_globals() -> dict[str, Any]:
    """What a training process owns and a save must leave as it found it."""
    return {
        "current_device": torch.cuda.current_device(),
        "current_stream": torch.cuda.current_stream().cuda_stream,
        "default_dtype": torch.get_default_dtype(),
        "grad_enabled": torch.is_grad_enabled(),
        "threads": torch.get_num_threads(),
        "cudnn_benchmark": torch.backends.cudnn.benchmark,
        "cudnn_deterministic": torch.backends.cudnn.deterministic,
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "cpu_rng": torch.get_rng_state().tolist(),
        "cuda_rng": [s.tolist() for s in torch.cuda.get_rng_state_all()],
        "warnings_filters": list(warnings.filters),
    }


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_cuda_model_and_adam_restore_onto_the_gpu_bit_exact(
    tmp_path: Path, device: torch.device, async_save: bool
) -> None:
    """Saved from CUDA tensors, restored into a fresh model and optimizer on the GPU: every tensor
    comes back on the device it was on, with the same bytes. In the async case the model is changed
    on the GPU right after ``step()`` returns: the checkpoint must still hold the values of the step
    (the non-blocking copies were complete when ``step()`` returned)."""
    model, optim = trained(device)
    expected = tensors_of(model, optim)
    ck = Checkpointer(f"file://{tmp_path}/ckpt", every_steps=1, keep=2, async_save=async_save)
    try:
        ck.step(1, {"model": model, "optim": optim})
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)  # queued on the GPU behind whatever the save left there
        ck.wait()
        assert ck.last_committed_step == 1
    finally:
        ck.close()
    fresh_model, fresh_optim = blank(device)
    reader = Checkpointer(f"file://{tmp_path}/ckpt", keep=2)
    try:
        assert reader.restore({"model": fresh_model, "optim": fresh_optim}) == 1
    finally:
        reader.close()
    assert_bit_exact(expected, tensors_of(fresh_model, fresh_optim))


def test_async_staging_keeps_pinned_host_buffers_and_reuses_them(tmp_path: Path, device: torch.device) -> None:
    """The async stager's host buffers are page-locked and stay between saves: the second save copies
    into the very buffers of the first (same addresses), and what it committed is the second step's."""
    model, optim = trained(device)
    state = {"model": model, "optim": optim}
    ck = Checkpointer(str(tmp_path / "ckpt"), every_steps=1, keep=2, async_save=True)
    try:
        ck.step(1, state)
        ck.wait()
        first = kept_buffers(ck)
        sources = {p.untyped_storage().data_ptr() for p in model.parameters()}
        assert sources <= set(first), "a CUDA parameter was not staged into a kept buffer"
        for ptr, buffer in first.items():
            assert buffer.device.type == "cpu"
            if buffer.nbytes() >= 5:  # DCP pins from 5 bytes up (StateDictStager.pin_memory_min_bytes)
                assert buffer.is_pinned(), f"the host buffer for the storage at {ptr:#x} is not pinned"
        addresses = {ptr: b.data_ptr() for ptr, b in first.items()}
        del first

        with torch.no_grad():
            for p in model.parameters():
                p.mul_(0.5)
        expected = tensors_of(model, optim)
        ck.step(2, state)
        ck.wait()
        assert {ptr: b.data_ptr() for ptr, b in kept_buffers(ck).items()} == addresses
    finally:
        ck.close()
    fresh_model, fresh_optim = blank(device)
    reader = Checkpointer(str(tmp_path / "ckpt"), keep=2)
    try:
        assert reader.restore({"model": fresh_model, "optim": fresh_optim}) == 2
    finally:
        reader.close()
    assert_bit_exact(expected, tensors_of(fresh_model, fresh_optim))


def test_release_staging_frees_the_pinned_buffers_after_each_save(
    tmp_path: Path, device: torch.device, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With ``release_staging=True`` nothing of the staging outlives the save: the pinned buffers the
    save staged into are freed (and so unpinned: DCP unpins a buffer when it is freed) once it committed."""
    staged: list[weakref.ref[torch.UntypedStorage]] = []
    pinned: list[bool] = []
    stage_state = save_module.stage_state

    def watched(stager: Any, state: dict[str, Any]) -> Any:
        out = stage_state(stager, state)
        for buffer in stager._state_dict_stager._cached_storage_mapping.values():
            staged.append(weakref.ref(buffer))
            pinned.append(buffer.is_pinned() or buffer.nbytes() < 5)
        return out

    monkeypatch.setattr(save_module, "stage_state", watched)
    model, optim = trained(device)
    ck = Checkpointer(str(tmp_path / "ckpt"), every_steps=1, keep=2, async_save=True, release_staging=True)
    try:
        ck.step(1, {"model": model, "optim": optim})
        ck.wait()
        assert ck.last_committed_step == 1
        assert staged and all(pinned), pinned
        assert ck._stager is None
        gc.collect()
        alive = [r for r in staged if r() is not None]
        assert not alive, f"{len(alive)} of {len(staged)} staged host buffers outlived the save"
    finally:
        ck.close()


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_save_leaves_the_processes_globals_alone(tmp_path: Path, device: torch.device, async_save: bool) -> None:
    """The current device and stream, the RNGs (CPU and CUDA), torch's numerical settings and the
    warning filters are the training script's: a save (the first, which makes the stager, and a later
    one) changes none of them."""
    model, optim = trained(device)
    state = {"model": model, "optim": optim}
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream())  # the training above ran on the default stream
    ck = Checkpointer(str(tmp_path / "ckpt"), every_steps=1, keep=2, async_save=async_save)
    try:
        with torch.cuda.stream(side):  # the script runs on a stream of its own, not the default one
            for step in (1, 2):
                before = user_globals()
                ck.step(step, state)
                ck.wait()
                assert user_globals() == before, step
    finally:
        ck.close()
    assert ck.last_committed_step == 2


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_state_on_the_cpu_and_the_gpu_restores_each_tensor_where_it_lives(
    tmp_path: Path, device: torch.device, async_save: bool
) -> None:
    """One module on the GPU, one kept on the CPU (an embedding table too big for the device), one Adam
    over both: each restores bit-exact onto the device it lives on."""

    def build(seed: int) -> tuple[nn.Module, nn.Module, torch.optim.Adam]:
        torch.manual_seed(seed)
        gpu, cpu = nn.Linear(32, 16).to(device), nn.Embedding(100, 32)
        optim = torch.optim.Adam([*gpu.parameters(), *cpu.parameters()], lr=1e-2)
        return gpu, cpu, optim

    gpu, cpu, optim = build(0)
    for _ in range(2):
        rows = cpu(torch.randint(0, 100, (8,))).to(device)
        gpu(rows).square().mean().backward()
        optim.step()
        optim.zero_grad(set_to_none=True)
    assert optim.state[cpu.weight]["exp_avg"].device.type == "cpu"
    assert optim.state[gpu.weight]["exp_avg"].device == device
    both = nn.ModuleDict({"dense": gpu, "table": cpu})
    expected = tensors_of(both, optim)
    ck = Checkpointer(str(tmp_path / "ckpt"), every_steps=1, keep=2, async_save=async_save)
    try:
        ck.step(1, {"dense": gpu, "table": cpu, "optim": optim})
        ck.wait()
    finally:
        ck.close()

    gpu2, cpu2, optim2 = build(1)
    reader = Checkpointer(str(tmp_path / "ckpt"), keep=2)
    try:
        assert reader.restore({"dense": gpu2, "table": cpu2, "optim": optim2}) == 1
    finally:
        reader.close()
    assert_bit_exact(expected, tensors_of(nn.ModuleDict({"dense": gpu2, "table": cpu2}), optim2))
