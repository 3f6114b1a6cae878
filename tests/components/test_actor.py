"""Tests for the actor (log-probs, entropy, PPO update) and the frozen reference policy."""

import copy
import math

import pytest
import torch

from components.actor import Actor, sequence_logprobs
from components.batch import build_sequence_batch
from components.models import load_causal_lm, load_tokenizer
from components.reference import Reference
from components.rollout import HFRolloutEngine, SamplingParams
from components.tiny import TinyModelSpec
from components.actor import ActorConfig
from components.training import OptimConfig

SPEC = TinyModelSpec(hidden_size=64, num_attention_heads=1, num_key_value_heads=1, intermediate_size=128,
                     num_hidden_layers=1)
PROMPTS = [[49, 50, 43, 51, 52, 61], [55], [40, 41, 42], [33, 34]]
RESPONSES = [[100, 101], [10, 20, 30, 40, 256], [7], [60, 61, 62]]


@pytest.fixture(scope="module")
def tokenizer(model_path):
    return load_tokenizer(model_path)


@pytest.fixture
def model(model_path):
    return load_causal_lm(model_path, device="cpu")


def _config(**overrides):
    optim = overrides.pop("optim", OptimConfig(lr=1e-2))
    values = dict(ppo_epochs=1, ppo_mini_batch_size=4, micro_batch_size=4, optim=optim)
    values.update(overrides)
    return ActorConfig(**values)


def _manual(model, prompt, response, temperature):
    """Log-probs and entropies from the model run on the unpadded sequence alone."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + response])).logits[0].float()
    logits = logits[len(prompt) - 1 : len(prompt) - 1 + len(response)] / temperature
    log_probs = torch.log_softmax(logits, dim=-1)
    chosen = log_probs.gather(-1, torch.tensor(response)[:, None]).squeeze(-1)
    entropy = -(log_probs.exp() * log_probs).sum(-1)
    return chosen, entropy


def _params(model):
    return {name: parameter.detach().clone() for name, parameter in model.named_parameters()}


@pytest.mark.parametrize(("temperature", "micro_batch_size"), [(1.0, 4), (0.7, 1), (0.7, 3)])
def test_compute_logprobs_and_entropy_match_unpadded_forward(model, tokenizer, temperature, micro_batch_size):
    actor = Actor(model, tokenizer, _config(micro_batch_size=micro_batch_size), temperature=temperature)
    batch = build_sequence_batch(PROMPTS, RESPONSES, tokenizer.pad_token_id)
    logprobs, entropy = actor.compute_logprobs(batch, with_entropy=True)
    assert logprobs.shape == entropy.shape == (4, 5)
    for row, (prompt, response) in enumerate(zip(PROMPTS, RESPONSES)):
        expected_logprobs, expected_entropy = _manual(model, prompt, response, temperature)
        torch.testing.assert_close(logprobs[row, : len(response)], expected_logprobs, atol=1e-4, rtol=0)
        torch.testing.assert_close(entropy[row, : len(response)], expected_entropy, atol=1e-4, rtol=0)
        # padded response positions are exactly 0
        assert logprobs[row, len(response) :].abs().sum() == 0
        assert entropy[row, len(response) :].abs().sum() == 0
    # entropy of a near-uniform random model is close to log(V) and never above it
    assert float(entropy.max()) <= math.log(len(tokenizer)) + 1e-4
    assert actor.compute_logprobs(batch)[1] is None


def test_sequence_logprobs_does_not_track_gradients(model, tokenizer):
    batch = build_sequence_batch(PROMPTS, RESPONSES, tokenizer.pad_token_id)
    logprobs, _ = sequence_logprobs(model, batch, temperature=1.0, micro_batch_size=2)
    assert not logprobs.requires_grad


def test_reference_matches_actor_and_is_frozen(model, tokenizer):
    batch = build_sequence_batch(PROMPTS, RESPONSES, tokenizer.pad_token_id)
    reference = Reference(copy.deepcopy(model), temperature=0.7, micro_batch_size=3)
    assert all(not parameter.requires_grad for parameter in reference.model.parameters())
    assert not reference.model.training
    expected, _ = Actor(model, tokenizer, _config(), temperature=0.7).compute_logprobs(batch)
    torch.testing.assert_close(reference.compute_logprobs(batch), expected, atol=1e-5, rtol=0)
    prompt, response = PROMPTS[1], RESPONSES[1]
    torch.testing.assert_close(reference.compute_logprobs(batch)[1], _manual(model, prompt, response, 0.7)[0],
                               atol=1e-4, rtol=0)


def _sampled_batch(model, tokenizer, n=4, seed=3):
    engine = HFRolloutEngine(model, tokenizer)
    prompts = [[49, 50, 43], [51, 52, 53, 54, 61]]
    generations = engine.generate(prompts, SamplingParams(n=n // 2, temperature=1.0, max_new_tokens=5, seed=seed))
    return build_sequence_batch([prompts[g.prompt_index] for g in generations],
                                [g.response_ids for g in generations], tokenizer.pad_token_id)


def test_first_update_has_unit_ratio_and_changes_parameters(model, tokenizer):
    actor = Actor(model, tokenizer, _config(), temperature=1.0)
    batch = _sampled_batch(model, tokenizer)
    old_logprobs, _ = actor.compute_logprobs(batch)
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5])[:, None].expand_as(old_logprobs).clone()
    before = _params(model)
    metrics = actor.update(batch, old_logprobs=old_logprobs, advantages=advantages)
    assert abs(metrics["actor/ppo_kl"]) < 1e-6
    assert metrics["actor/pg_clipfrac"] == 0.0
    assert metrics["actor/pg_clipfrac_lower"] == 0.0
    assert metrics["actor/skipped_steps"] == 0.0
    assert metrics["actor/lr"] == pytest.approx(1e-2)
    assert metrics["actor/grad_norm"] > 0
    # ratio 1: the PPO loss is -token-mean(A)
    mask = batch.response_mask
    assert metrics["actor/pg_loss"] == pytest.approx(float(-(advantages * mask).sum() / mask.sum()), abs=1e-5)
    assert actor.updater.updates == 1
    after = _params(model)
    assert any(not torch.equal(before[name], after[name]) for name in before)


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_advantage_sign_moves_sequence_logprob(model, tokenizer, sign):
    actor = Actor(model, tokenizer, _config(ppo_mini_batch_size=1, micro_batch_size=1), temperature=1.0)
    batch = _sampled_batch(model, tokenizer).select(slice(0, 1))
    old_logprobs, _ = actor.compute_logprobs(batch)
    advantages = sign * batch.response_mask.clone()
    actor.update(batch, old_logprobs=old_logprobs, advantages=advantages)
    new_logprobs, _ = actor.compute_logprobs(batch)
    change = float((new_logprobs - old_logprobs).sum())
    assert sign * change > 0.1


def _grad_accumulation_change(model_path, tokenizer, batch, old_logprobs, advantages, micro_batch_size, mode):
    model = load_causal_lm(model_path, device="cpu")
    config = _config(micro_batch_size=micro_batch_size, loss_agg_mode=mode,
                     optim=OptimConfig(lr=1e-2, grad_clip=1e6))
    actor = Actor(model, tokenizer, config, temperature=1.0)
    # plain SGD makes the parameter change proportional to the accumulated gradient
    actor.updater.optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    actor.updater.scheduler = torch.optim.lr_scheduler.LambdaLR(actor.updater.optimizer, lambda step: 1.0)
    before = _params(model)
    metrics = actor.update(batch, old_logprobs=old_logprobs, advantages=advantages)
    after = _params(model)
    return {name: after[name] - before[name] for name in before}, metrics


@pytest.mark.parametrize(("mode", "equal_lengths"), [("seq-mean-token-mean", False), ("token-mean", True),
                                                      ("seq-mean-token-sum", False)])
def test_gradient_accumulation_matches_one_micro_batch(model_path, model, tokenizer, mode, equal_lengths):
    responses = [[100, 101, 5], [10, 20, 30], [7, 8, 9], [60, 61, 62]] if equal_lengths else RESPONSES
    batch = build_sequence_batch(PROMPTS, responses, tokenizer.pad_token_id)
    old_logprobs, _ = Actor(model, tokenizer, _config()).compute_logprobs(batch)
    advantages = torch.tensor([[1.0, -0.5, 0.3, 2.0, -1.0], [-1.0, 0.7, 0.2, -0.4, 1.5],
                               [0.5, 0.5, -2.0, 1.0, 0.1], [-0.3, 1.2, -0.8, 0.6, 0.9]])
    advantages = advantages[:, : batch.response_length]
    whole, whole_metrics = _grad_accumulation_change(model_path, tokenizer, batch, old_logprobs, advantages, 4, mode)
    split, split_metrics = _grad_accumulation_change(model_path, tokenizer, batch, old_logprobs, advantages, 2, mode)
    total = torch.sqrt(sum((delta**2).sum() for delta in whole.values()))
    assert total > 1e-3  # the comparison is not vacuous
    for name in whole:
        torch.testing.assert_close(split[name], whole[name], atol=1e-5, rtol=1e-4, msg=name)
    assert split_metrics["actor/grad_norm"] == pytest.approx(whole_metrics["actor/grad_norm"], rel=1e-4)


def test_non_finite_gradient_skips_the_step(model, tokenizer):
    actor = Actor(model, tokenizer, _config(), temperature=1.0)
    batch = build_sequence_batch(PROMPTS, RESPONSES, tokenizer.pad_token_id)
    old_logprobs, _ = actor.compute_logprobs(batch)
    advantages = torch.ones_like(old_logprobs)
    advantages[1, 2] = float("nan")
    before = _params(model)
    metrics = actor.update(batch, old_logprobs=old_logprobs, advantages=advantages)
    assert metrics["actor/skipped_steps"] == 1.0
    assert "actor/grad_norm" not in metrics
    after = _params(model)
    assert all(torch.equal(before[name], after[name]) for name in before)
    assert all(parameter.grad is None for parameter in model.parameters())
    # a finite update afterwards still steps
    metrics = actor.update(batch, old_logprobs=old_logprobs, advantages=torch.ones_like(old_logprobs))
    assert metrics["actor/skipped_steps"] == 0.0
    assert any(not torch.equal(before[name], parameter) for name, parameter in model.named_parameters())


def test_kl_loss_needs_reference_logprobs(model, tokenizer):
    actor = Actor(model, tokenizer, _config(use_kl_loss=True), temperature=1.0)
    batch = build_sequence_batch(PROMPTS, RESPONSES, tokenizer.pad_token_id)
    old_logprobs, _ = actor.compute_logprobs(batch)
    before = _params(model)
    with pytest.raises(ValueError, match="use_kl_loss"):
        actor.update(batch, old_logprobs=old_logprobs, advantages=torch.ones_like(old_logprobs))
    assert all(torch.equal(before[name], parameter) for name, parameter in model.named_parameters())
    metrics = actor.update(batch, old_logprobs=old_logprobs, advantages=torch.ones_like(old_logprobs),
                           ref_logprobs=old_logprobs)
    assert abs(metrics["actor/kl_loss"]) < 1e-6  # policy == reference at the first step


def test_generate_and_save_round_trip(model, tokenizer, tmp_path):
    actor = Actor(model, tokenizer, _config(), temperature=1.0)
    generations = actor.generate(["12+34="], n=2, max_new_tokens=3, temperature=0)
    assert [(g.prompt_index, g.sample_index) for g in generations] == [(0, 0), (0, 1)]
    assert generations[0].response_ids == generations[1].response_ids
    assert generations[0].text == tokenizer.decode(generations[0].response_ids, skip_special_tokens=True)
    batch = build_sequence_batch(PROMPTS, RESPONSES, tokenizer.pad_token_id)
    old_logprobs, _ = actor.compute_logprobs(batch)
    actor.update(batch, old_logprobs=old_logprobs, advantages=torch.ones_like(old_logprobs))
    actor.save_pretrained(tmp_path / "saved")
    reloaded = Actor.from_pretrained(str(tmp_path / "saved"), _config(), device="cpu")
    torch.testing.assert_close(reloaded.compute_logprobs(batch)[0], actor.compute_logprobs(batch)[0],
                               atol=1e-6, rtol=0)


def test_gradient_accumulation_token_mean_unequal_lengths(model_path, model, tokenizer):
    batch = build_sequence_batch(PROMPTS, RESPONSES, tokenizer.pad_token_id)
    old_logprobs, _ = Actor(model, tokenizer, _config()).compute_logprobs(batch)
    advantages = torch.ones_like(old_logprobs)
    whole, _ = _grad_accumulation_change(model_path, tokenizer, batch, old_logprobs, advantages, 4, "token-mean")
    split, _ = _grad_accumulation_change(model_path, tokenizer, batch, old_logprobs, advantages, 2, "token-mean")
    for name in whole:
        torch.testing.assert_close(split[name], whole[name], atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("micro_batch_size", [4, 2])
def test_on_policy_update_without_old_logprobs_matches_the_recomputed_ones(model_path, tokenizer, micro_batch_size):
    """old_logprobs=None (on-policy): the same parameter change as with a separate old-log-prob pass, and
    the rollout gap measured from the update's own forward equals the gap to the recomputed log-probs."""
    batch = build_sequence_batch(PROMPTS, RESPONSES, tokenizer.pad_token_id)
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5])[:, None].expand(4, batch.response_length).clone()
    changes, gaps = [], []
    for reuse in (False, True):
        model = load_causal_lm(model_path, device="cpu")
        actor = Actor(model, tokenizer, _config(micro_batch_size=micro_batch_size), temperature=0.7)
        old_logprobs, _ = actor.compute_logprobs(batch)
        rollout = old_logprobs + 0.01 * torch.arange(batch.response_length)  # an engine that is slightly off
        before = _params(model)
        metrics = actor.update(batch, old_logprobs=None if reuse else old_logprobs, advantages=advantages,
                               rollout_logprobs=rollout if reuse else None)
        changes.append({name: value - before[name] for name, value in _params(model).items()})
        gaps.append(metrics)
    for name in changes[0]:
        torch.testing.assert_close(changes[1][name], changes[0][name], atol=1e-6, rtol=1e-5, msg=name)
    mask = batch.response_mask
    expected = (0.01 * torch.arange(batch.response_length) * mask)
    assert gaps[1]["rollout/logprob_diff_mean"] == pytest.approx(float(expected.sum() / mask.sum()), abs=1e-5)
    assert gaps[1]["rollout/logprob_diff_max"] == pytest.approx(float(expected.max()), abs=1e-5)
    assert gaps[1]["actor/ppo_kl"] == 0.0 and "rollout/logprob_diff_mean" not in gaps[0]


def test_rollout_gap_leaves_out_samples_without_engine_logprobs(model, tokenizer):
    """rollout.logprobs_fraction < 1: rows the engine gave no log-probs for (NaN) are not in the gap."""
    batch = build_sequence_batch(PROMPTS, RESPONSES, tokenizer.pad_token_id)
    actor = Actor(model, tokenizer, _config(micro_batch_size=2))
    old_logprobs, _ = actor.compute_logprobs(batch)
    rollout = old_logprobs + 0.25  # every measured token is off by exactly 0.25 ...
    rollout[1] = float("nan")  # ... except row 1, not measured, and row 3, off by 2.0
    rollout[3] = old_logprobs[3] + 2.0
    advantages = torch.zeros(batch.size, batch.response_length)
    metrics = actor.update(batch, old_logprobs=None, advantages=advantages, rollout_logprobs=rollout)
    mask = batch.response_mask
    measured = mask[0].sum() + mask[2].sum() + mask[3].sum()
    expected = float((0.25 * (mask[0].sum() + mask[2].sum()) + 2.0 * mask[3].sum()) / measured)
    assert metrics["rollout/logprob_diff_mean"] == pytest.approx(expected, abs=1e-5)
    assert metrics["rollout/logprob_diff_max"] == pytest.approx(2.0, abs=1e-5)
    assert "actor/nonfinite_samples" not in metrics


def test_on_policy_update_is_refused_when_it_is_not(model, tokenizer):
    actor = Actor(model, tokenizer, _config(ppo_mini_batch_size=2, micro_batch_size=2))
    batch = build_sequence_batch(PROMPTS, RESPONSES, tokenizer.pad_token_id)
    with pytest.raises(ValueError, match="needs an on-policy update"):
        actor.update(batch, old_logprobs=None, advantages=torch.zeros(4, batch.response_length))
