"""The sample fingerprint that tells ranks' copies of one name apart at save time
(``agent._dcp_write._tensor_fingerprint``)."""

from __future__ import annotations

import torch

from agent._dcp_write import DivergentReplicasError, _tensor_fingerprint


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
        DivergentReplicasError.of(
            [("model.0.weight", 0, 1), ("model.0.bias", 0, 1), ("optim.param_groups.0.lr", 0, 1)]
        )
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
