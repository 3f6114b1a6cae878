import math

import pytest
import torch

from components.algorithms import (
    POLICY_LOSSES,
    entropy_from_logits,
    get_policy_loss,
    logprobs_from_logits,
    value_loss,
)


def test_logprobs_from_logits_is_float32_log_softmax_gather():
    logits = torch.tensor([[[1.0, 2.0, 3.0], [0.0, 0.0, 0.0]]], dtype=torch.bfloat16)
    logprobs = logprobs_from_logits(logits, torch.tensor([[2, 0]]))
    # 3 - log(e^1 + e^2 + e^3) = 3 - 3.407606;  uniform over 3 -> -log 3
    assert logprobs.dtype == torch.float32
    assert logprobs[0].tolist() == pytest.approx([-0.407606, -math.log(3)], abs=1e-5)


def test_entropy_from_logits():
    logits = torch.tensor([[[0.0, 0.0, 0.0, 0.0], [0.0, math.log(3.0), -1e4, -1e4]]])
    # uniform over 4 -> log 4; p = (1/4, 3/4) -> 0.25*log 4 + 0.75*log(4/3) = 0.562335
    assert entropy_from_logits(logits)[0].tolist() == pytest.approx([math.log(4.0), 0.562335], abs=1e-5)


def ppo_inputs():
    # log-ratios: 0, log 1.5, log 0.5, 3 (ratio e^3 = 20.09), and a masked huge ratio
    log_ratios = torch.tensor([[0.0, math.log(1.5), math.log(0.5), 3.0, 10.0]])
    return dict(
        logprobs=log_ratios.clone().requires_grad_(True),
        old_logprobs=torch.zeros_like(log_ratios),
        advantages=torch.tensor([[1.0, 1.0, -1.0, -1.0, -1.0]]),
        response_mask=torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.0]]),
    )


def test_ppo_clip_and_dual_clip_by_hand():
    inputs = ppo_inputs()
    loss, metrics = get_policy_loss("ppo")(**inputs)
    # token 0: A=1,  r=1    -> -1                                (no clip)
    # token 1: A=1,  r=1.5  -> max(-1.5, -1.2) = -1.2            (clipped)
    # token 2: A=-1, r=0.5  -> max(0.5, 0.8) = 0.8 < c=3         (clipped)
    # token 3: A=-1, r=20.1 -> max(20.1, 1.2) = 20.1, min(3, .) = 3 (dual clip)
    # token-mean: (-1 - 1.2 + 0.8 + 3) / 4 = 0.4
    assert loss.item() == pytest.approx(0.4, abs=1e-5)
    assert metrics["actor/pg_loss"] == pytest.approx(0.4, abs=1e-5)
    assert metrics["actor/pg_clipfrac"] == pytest.approx(2 / 4)
    assert metrics["actor/pg_clipfrac_lower"] == pytest.approx(1 / 4)
    # ppo_kl = mean(-log r) = -(0 + 0.405465 - 0.693147 + 3) / 4
    assert metrics["actor/ppo_kl"] == pytest.approx(-2.712318 / 4, abs=1e-5)
    loss.backward()
    # only the unclipped token carries gradient: d(-A r / 4)/d log r = -1 * 1 / 4
    assert inputs["logprobs"].grad[0].tolist() == pytest.approx([-0.25, 0.0, 0.0, 0.0, 0.0])


def test_ppo_asymmetric_clip_and_seq_sum_aggregation():
    inputs = ppo_inputs()
    loss, _ = get_policy_loss("ppo")(**inputs, clip_ratio_high=0.28, loss_agg_mode="seq-mean-token-sum")
    # token 1 now clipped at -1.28; one sequence summed: -1 - 1.28 + 0.8 + 3 = 1.52
    assert loss.item() == pytest.approx(1.52, abs=1e-5)


def test_ppo_log_ratio_is_clamped_at_20():
    _, metrics = get_policy_loss("ppo")(
        logprobs=torch.tensor([[50.0]]), old_logprobs=torch.tensor([[0.0]]),
        advantages=torch.tensor([[1.0]]), response_mask=torch.tensor([[1.0]]),
    )
    # A > 0 with r = e^20: loss clipped to -1.2, and the kl reads the clamped log-ratio
    assert metrics["actor/pg_loss"] == pytest.approx(-1.2)
    assert metrics["actor/ppo_kl"] == pytest.approx(-20.0)


def test_ppo_rejects_dual_clip_constant_not_above_one():
    with pytest.raises(ValueError, match="clip_ratio_c"):
        get_policy_loss("ppo")(**ppo_inputs(), clip_ratio_c=1.0)


def test_value_loss_clipping_by_hand():
    loss, metrics = value_loss(
        values=torch.tensor([[1.0, 2.0, 7.0]]),
        old_values=torch.tensor([[0.0, 1.8, 5.0]]),
        returns=torch.tensor([[2.0, 0.0, 0.0]]),
        response_mask=torch.tensor([[1.0, 1.0, 0.0]]),
        cliprange_value=0.5,
    )
    # token 0: clipped pred 0 + 0.5 = 0.5; max((1-2)^2, (0.5-2)^2) = 2.25  (clipped)
    # token 1: clipped pred 1.8 + 0.2 = 2.0; max(4, 4) = 4              (tie, not clipped)
    # 0.5 * (2.25 + 4) / 2 = 1.5625
    assert loss.item() == pytest.approx(1.5625)
    assert metrics == pytest.approx({"critic/vf_loss": 1.5625, "critic/vf_clipfrac": 0.5, "critic/vpred_mean": 1.5})


def test_policy_loss_registry_and_unknown_name():
    assert "ppo" in POLICY_LOSSES
    with pytest.raises(ValueError, match=r"actor\.policy_loss='vanilla2' is not one of: ppo"):
        get_policy_loss("vanilla2")
