"""RNG streams come back as saved; CUDA streams saved on another device count are not silently
skipped: the restore says so (no GPU here, so the CUDA side is what ``torch.cuda`` reports)."""

from __future__ import annotations

import random

import pytest
import torch

from agent import rank_state


def test_the_cpu_python_and_numpy_streams_come_back_and_cuda_streams_of_other_devices_are_said(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    before = (random.getstate(), torch.get_rng_state())
    try:
        rng = rank_state.capture_rng()
        rng["cuda"] = [torch.zeros(16, dtype=torch.uint8)] * 2  # saved on a node with two GPUs
        expected = (random.random(), float(torch.rand(1)))
        restored: list[object] = []
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
        monkeypatch.setattr(torch.cuda, "set_rng_state_all", restored.append)
        with caplog.at_level("WARNING", logger="agent.checkpoint"):
            rank_state.restore_rng(rng)
        assert (random.random(), float(torch.rand(1))) == expected
        assert restored == [], "a stream per device it cannot pair is not set"
        assert "CUDA RNG streams of 2 device(s) and this process sees 1" in caplog.text

        caplog.clear()
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
        rank_state.restore_rng(rng)
        assert len(restored) == 1 and "CUDA RNG" not in caplog.text
    finally:
        random.setstate(before[0])
        torch.set_rng_state(before[1])
