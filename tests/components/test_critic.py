"""Tests for the critic: value positions, masking and the value update (components/critic.py)."""

import pytest
import torch

from components.batch import build_sequence_batch
from components.critic import Critic, response_values
from components.models import load_tokenizer
from components.tiny import TinyModelSpec
from components.critic import CriticConfig
from components.training import OptimConfig

SPEC = TinyModelSpec(hidden_size=64, num_attention_heads=1, num_key_value_heads=1, intermediate_size=128,
                     num_hidden_layers=1)
PROMPTS = [[49, 50, 43, 51, 52, 61], [55], [40, 41, 42], [33, 34]]
RESPONSES = [[100, 101], [10, 20, 30, 40, 256], [7], [60, 61, 62]]


@pytest.fixture(scope="module")
def batch(model_path):
    return build_sequence_batch(PROMPTS, RESPONSES, load_tokenizer(model_path).pad_token_id)


def _critic(model_path, **config):
    torch.manual_seed(0)  # the value head is freshly initialised
    values = dict(ppo_epochs=1, ppo_mini_batch_size=4, micro_batch_size=4, optim=OptimConfig(lr=1e-2))
    values.update(config)
    return Critic.from_pretrained(model_path, CriticConfig(**values), device="cpu")


def _manual_values(model, prompt, response):
    """Value-head outputs at positions P-1 .. P+T-2 of the unpadded sequence."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + response])).logits[0, :, 0]
    return logits[len(prompt) - 1 : len(prompt) - 1 + len(response)]


def test_critic_model_is_a_one_label_token_classifier(model_path):
    critic = _critic(model_path)
    assert critic.model.config.num_labels == 1
    assert critic.device.type == "cpu"


@pytest.mark.parametrize("micro_batch_size", [4, 1, 3])
def test_compute_values_shape_masking_and_positions(model_path, batch, micro_batch_size):
    critic = _critic(model_path, micro_batch_size=micro_batch_size)
    values = critic.compute_values(batch)
    assert values.shape == (4, 5)
    assert values.dtype == torch.float32
    assert not values.requires_grad
    for row, (prompt, response) in enumerate(zip(PROMPTS, RESPONSES)):
        torch.testing.assert_close(values[row, : len(response)], _manual_values(critic.model, prompt, response),
                                   atol=1e-4, rtol=0)
        assert torch.all(values[row, len(response) :] == 0)
    assert values[1].abs().min() > 0  # the full-length row has no accidental zeros


def test_response_values_positions_shifted_by_one(model_path, batch):
    """The value for response token t is read at position P-1+t (the state before the token)."""
    critic = _critic(model_path)
    critic.model.eval()
    with torch.no_grad():
        values = response_values(critic.model, batch)
        full = critic.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                            position_ids=batch.position_ids).logits[..., 0]
    prompt_length = batch.prompt_length
    assert prompt_length == 6
    torch.testing.assert_close(values, full[:, prompt_length - 1 : prompt_length + 4] * batch.response_mask)
    assert not torch.allclose(values, full[:, prompt_length:] * batch.response_mask)


def _masked_mse(values, returns, mask):
    return float((((values - returns) ** 2) * mask).sum() / mask.sum())


def test_update_moves_values_towards_constant_returns(model_path, batch):
    critic = _critic(model_path)
    returns = torch.full((4, 5), 1.0) * batch.response_mask
    start = _masked_mse(critic.compute_values(batch), returns, batch.response_mask)
    losses = []
    for _ in range(5):
        old_values = critic.compute_values(batch)
        metrics = critic.update(batch, old_values=old_values, returns=returns)
        losses.append(metrics["critic/vf_loss"])
        assert metrics["critic/skipped_steps"] == 0.0
        assert metrics["critic/lr"] == pytest.approx(1e-2)
    end = _masked_mse(critic.compute_values(batch), returns, batch.response_mask)
    assert start > 0.5
    assert end < 0.5 * start
    assert losses[-1] < losses[0]
    assert critic.updater.updates == 5


def test_value_clipping_limits_the_move(model_path, batch):
    """With cliprange c, once V moved past old+c the clipped term dominates: clipfrac reported."""
    critic = _critic(model_path, cliprange_value=0.5)
    old_values = critic.compute_values(batch)
    returns = (old_values + 10.0) * batch.response_mask
    metrics = critic.update(batch, old_values=old_values, returns=returns)
    # at the first step V ~= V_old, so clipped and unclipped losses coincide: vf_loss ~= 0.5 * 10^2
    assert metrics["critic/vf_loss"] == pytest.approx(50.0, rel=0.05)


def test_first_update_sees_the_rollout_values(model_path, batch):
    critic = _critic(model_path)
    old_values = critic.compute_values(batch)
    metrics = critic.update(batch, old_values=old_values, returns=old_values.clone())
    # returns == values at the current weights: the value loss and its gradient are zero
    assert metrics["critic/vf_loss"] < 1e-10
    assert metrics["critic/grad_norm"] < 1e-5
