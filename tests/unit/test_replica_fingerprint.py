"""The sample fingerprint that tells ranks' copies of one name apart at save time
(``agent._dcp_write._tensor_fingerprint``)."""

from __future__ import annotations

import torch

from agent._dcp_write import _tensor_fingerprint


def test_equal_tensors_agree_in_every_dtype_and_layout() -> None:
    base = torch.randn(6, 5)
    for tensor in (base, base.t(), base.to(torch.bfloat16), base.to(torch.float8_e4m3fn), base > 0, torch.zeros(0)):
        assert _tensor_fingerprint(tensor) == _tensor_fingerprint(tensor.clone())
    assert _tensor_fingerprint(torch.tensor(1.5)) == _tensor_fingerprint(torch.tensor(1.5))


def test_shards_of_one_layer_differ() -> None:
    weight = torch.randn(8, 4)
    assert _tensor_fingerprint(weight[:4]) != _tensor_fingerprint(weight[4:])
    assert _tensor_fingerprint(torch.zeros(3)) != _tensor_fingerprint(torch.zeros(4))


def test_a_tensor_past_float32_precision_is_sampled_within_bounds() -> None:
    """2**25 elements: the last index computed in float32 rounds past the last element (which
    failed every save holding a tensor that big, before the indices were computed in integers)."""
    tensor = torch.zeros(2**25, dtype=torch.uint8)
    before = _tensor_fingerprint(tensor)
    tensor[-1] = 1
    assert _tensor_fingerprint(tensor) != before, "the last element is part of the sample"
