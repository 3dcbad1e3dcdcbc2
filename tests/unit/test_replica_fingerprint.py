"""The sample fingerprint that tells ranks' copies of one name apart at save time
(``agent._dcp_plan._tensor_fingerprint``)."""

from __future__ import annotations

import zlib

import torch

from agent._dcp_plan import DivergentReplicasError, _tensor_fingerprint, _tensor_fingerprints


class _Wrapped(torch.Tensor):
    """A tensor subclass: takes the path an accelerator's tensors take (sampled with torch, every
    sample brought to the host in one copy), on the CPU."""


def _reference(tensor: torch.Tensor) -> int:
    """The fingerprint as first written: the whole tensor made contiguous, rows of bytes indexed
    with torch, one copy to the host per tensor."""
    head = f"{tuple(tensor.shape)}:{tensor.dtype}".encode()
    n = tensor.numel()
    if n == 0:
        return zlib.crc32(head)
    t = tensor.detach()
    if t.dtype.itemsize == 1:  # the same bytes; torch 2.9.1 cannot copy float4_e2m1fn_x2 (contiguous())
        t = t.view(torch.uint8)
    rows = t.contiguous().view(-1).view(torch.uint8).view(n, -1)
    k = min(n, 256)
    elements = torch.arange(k, dtype=torch.int64) * (n - 1) // max(k - 1, 1)
    return zlib.crc32(bytes(rows[elements].cpu().numpy()), zlib.crc32(head))


def _kinds() -> list[torch.Tensor]:
    base = torch.randn(40, 30)
    return [
        base,
        base.t(),  # not contiguous
        base[::3, 1:],  # a strided slice
        torch.randn(7, 1000),  # sampled, not whole
        base.to(torch.bfloat16),
        base.to(torch.float8_e4m3fn),
        base > 0,
        torch.arange(10**5),
        torch.randn(3, 4, dtype=torch.complex64),
        torch.tensor(1.5),
        torch.zeros(0, 3),
        torch.nn.Parameter(torch.randn(5, 6)),
    ]


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


def test_a_per_rank_learning_rate_is_named_first_with_its_cause() -> None:
    """ReduceLROnPlateau stepped on each rank's own loss: the learning rates differ, and with them
    the parameters they updated. The error names the learning rate, not the first parameter, and
    says why it happens; before, it named model.0.weight and advised DTensors or DiLoCo's option
    (or, with only the rate differing, pipeline stages)."""
    error = str(
        DivergentReplicasError.of([("model.0.weight", 0, 1), ("model.0.bias", 0, 1), ("optim.param_groups.0.lr", 0, 1)])
    )
    assert error.startswith("ranks 0 and 1 hold different values under the name optim.param_groups.0.lr")
    assert "ReduceLROnPlateau" in error and "all-reduce" in error
    assert "pipeline" not in error and "DiLoCo" not in error
    alone = str(DivergentReplicasError.of([("optim.param_groups.0.lr", 0, 1)]))
    assert "ReduceLROnPlateau" in alone and "pipeline" not in alone


def test_diverged_ddp_parameters_say_what_makes_ddp_replicas_drift() -> None:
    """Parameters that differ under DDP: the error says what makes replicas drift (weights set
    after DDP wrapped the model, on a seed per rank), beside the sharded layouts' remedy."""
    error = str(DivergentReplicasError.of([("model.0.weight", 0, 1)]))
    assert "after DistributedDataParallel wrapped" in error and "DTensors" in error
    stages = str(DivergentReplicasError.of([("optim.param_groups.0.lr", 0, 1), ("optim.param_groups.0.params", 0, 1)]))
    assert "under the name optim.param_groups.0.params" in stages and "Pipeline stages" in stages


def test_the_fast_paths_give_the_first_fingerprint_of_every_kind_of_tensor() -> None:
    """The fingerprint is unchanged by the faster sampling (NumPy on the CPU, one host copy per
    device elsewhere): equal to the first implementation's for every dtype and layout, whichever
    path a tensor takes, one at a time or many together. Pins behaviour: the values are what they
    were, only cheaper to compute."""
    kinds = _kinds()
    expected = [_reference(t) for t in kinds]
    assert _tensor_fingerprints(kinds) == expected
    assert [_tensor_fingerprint(t) for t in kinds] == expected
    assert _tensor_fingerprints([t.as_subclass(_Wrapped) for t in kinds]) == expected
    assert _tensor_fingerprints([t.clone() for t in kinds]) == expected, "equal tensors, equal fingerprints"


def test_the_fast_paths_still_tell_different_tensors_apart() -> None:
    """A change to a sampled element, or other contents of one shape, changes the fingerprint on
    both paths."""
    for wrap in (lambda t: t, lambda t: t.as_subclass(_Wrapped)):
        a, b = torch.randn(64, 64), torch.randn(64, 64)
        before = _tensor_fingerprints([wrap(a), wrap(a.t())])
        assert before != _tensor_fingerprints([wrap(b), wrap(b.t())])
        a[-1, -1] += 1  # the last element is always sampled
        after = _tensor_fingerprints([wrap(a), wrap(a.t())])
        assert after[0] != before[0] and after[1] != before[1]


def _copies_fp4() -> bool:
    try:
        torch.zeros(1, dtype=torch.uint8).view(torch.float4_e2m1fn_x2).clone()
    except NotImplementedError:
        return False
    return True


def test_a_dtype_torch_cannot_index_is_sampled_as_integers_of_its_size() -> None:
    """float4_e2m1fn_x2 (NVFP4 weights) has no indexing kernel: a transposed one (the CPU's
    indexed path) or any one on an accelerator (the path ``_Wrapped`` takes) failed every
    multi-rank save with "index_cpu not implemented". Its elements are sampled as the bytes they
    are, and equal tensors agree on both paths."""
    packed = torch.randint(0, 256, (6, 5), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    fp4 = packed.view(torch.float4_e2m1fn_x2)
    for tensor in (fp4, fp4.t(), fp4[::2, 1:]):
        expected = _reference(tensor)
        assert _tensor_fingerprint(tensor) == expected
        assert _tensor_fingerprint(tensor.as_subclass(_Wrapped)) == expected
        if _copies_fp4():  # torch 2.9.1 has no copy kernel for float4_e2m1fn_x2
            assert _tensor_fingerprint(tensor.clone()) == expected
    assert _tensor_fingerprint(fp4.t()) != _tensor_fingerprint((packed + 1).view(torch.float4_e2m1fn_x2).t())
