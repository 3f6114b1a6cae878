"""Mixed precision of the trained roles (components/precision.py): fp32 masters computing in bf16 keep
the updates that pure-bf16 AdamW loses at RL learning rates, publish bf16 casts of the masters, and
resume bit for bit; update_rms_ratio measures the change (hand-checked)."""

import math

import fsspec
import pytest
import torch

from components.actor import Actor
from components.batch import build_sequence_batch
from components.checkpoint import load_trainer_state, save_role_checkpoint
from components.critic import Critic
from components.precision import Precision, autocast_forward, compute_state_dict, save_compute_copy
from components.training import make_optimizer, run_updates, update_rms_ratio
from components.actor import ActorConfig
from components.critic import CriticConfig
from components.training import OptimConfig

PROMPTS = [[49, 50, 43, 51, 52, 61], [55], [40, 41, 42], [33, 34]]
RESPONSES = [[100, 101], [10, 20, 30, 40, 256], [7], [60, 61, 62]]
ADVANTAGE_SIGNS = torch.tensor([1.0, -1.0, 0.5, -0.5])


def _batch():
    return build_sequence_batch(PROMPTS, RESPONSES, 0)


def _actor(model_path, master_dtype, lr=1e-6, **kwargs):
    config = ActorConfig(ppo_epochs=1, ppo_mini_batch_size=4, micro_batch_size=2, optim=OptimConfig(lr=lr))
    return Actor.from_pretrained(model_path, config, dtype="bfloat16", master_dtype=master_dtype, device="cpu",
                                 **kwargs)


def _update(actor, steps=1):
    batch = _batch()
    metrics = []
    for _ in range(steps):
        old_logprobs, _ = actor.compute_logprobs(batch)
        advantages = ADVANTAGE_SIGNS[:, None].expand_as(old_logprobs).clone()
        metrics.append(actor.update(batch, old_logprobs=old_logprobs, advantages=advantages))
    return metrics


def _weights(model):
    return {name: parameter.detach().float().clone() for name, parameter in model.named_parameters()}


def test_a_bf16_compute_actor_keeps_fp32_masters_and_computes_in_bf16(model_path):
    actor = _actor(model_path, "float32")
    assert {parameter.dtype for parameter in actor.model.parameters()} == {torch.float32}
    logits = actor.model(input_ids=torch.tensor([[1, 2, 3]])).logits
    assert logits.dtype == torch.bfloat16  # the forward ran under autocast
    pure = _actor(model_path, "bfloat16")
    assert {parameter.dtype for parameter in pure.model.parameters()} == {torch.bfloat16}


def test_at_lr_1e_6_fp32_masters_move_wherever_the_gradient_is_not_zero_and_pure_bf16_loses_the_updates(model_path):
    moved = {}
    for master in ("float32", "bfloat16"):
        actor = _actor(model_path, master)
        before = _weights(actor.model)
        _update(actor)
        after = _weights(actor.model)
        # After the update each parameter still holds the gradient of its (only) optimizer step. Adam's first
        # step moves a weight by lr * g / (|g| + eps), about 1e-6 wherever |g| >> eps = 1e-8.
        changed = needed = 0
        for name, parameter in actor.model.named_parameters():
            gradient = parameter.grad.float()
            significant = gradient.abs() > 1e-6
            changed += int(((after[name] != before[name]) & significant).sum())
            needed += int(significant.sum())
        assert needed > 10_000
        moved[master] = changed / needed
    assert moved["float32"] == 1.0  # every element with a gradient moved
    # The old path (AdamW on bf16 parameters): half a bf16 ulp of a weight of 0.02 is 6e-5 >> 1e-6.
    assert moved["bfloat16"] < 0.1


def test_update_rms_ratio_is_the_change_over_the_weights_by_hand():
    model = torch.nn.Linear(3, 1, bias=False)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[1.0, -2.0, 0.5]]))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    inputs = torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0], [1.0, 1.0, 1.0]])

    def micro_loss(indices):
        return (model(inputs[indices]).squeeze(-1) ** 2).mean(), {}

    metrics = run_updates(model=model, optimizer=optimizer,
                          scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0), batch_size=4,
                          mini_batch_size=4, micro_batch_size=4, epochs=1, grad_clip=1e6, seed=0,
                          micro_loss=micro_loss, prefix="t")
    # gradient [0.25, -1.25, 0] (tests/components/test_training.py), so the step is -0.1 * gradient
    change = math.sqrt(0.025**2 + 0.125**2)
    assert metrics["t/update_rms_ratio"] == pytest.approx(change / math.sqrt(1 + 4 + 0.25), rel=1e-6)


def test_update_rms_ratio_is_zero_when_nothing_moved():
    parameter = torch.nn.Parameter(torch.tensor([0.015625], dtype=torch.bfloat16))
    before = [parameter.detach().clone()]
    with torch.no_grad():
        parameter.add_(1e-6)  # below half a bf16 ulp: rounds away
    assert float(update_rms_ratio([parameter], before)) == 0.0


def test_the_actor_reports_its_update_size_each_step(model_path):
    metrics = _update(_actor(model_path, "float32"), steps=2)
    for step in metrics:
        # Adam moves each weight by about lr = 1e-6 against weights of RMS ~0.02..1: a ratio near 1e-5..1e-4
        assert 1e-7 < step["actor/update_rms_ratio"] < 1e-3
    # Pure bf16: only weights near 0 move (by whole ulps); measured 3.7e-6 against 1.6e-5 here
    pure = _update(_actor(model_path, "bfloat16"))[0]["actor/update_rms_ratio"]
    assert pure < metrics[0]["actor/update_rms_ratio"] / 3


def _one_weight_model(dtype):
    """y = w * x with w = 2^-6 (exact in bf16; the next bf16 value above is 2^-6 + 2^-13)."""
    model = torch.nn.Linear(1, 1, bias=False).to(dtype)
    with torch.no_grad():
        model.weight.fill_(2.0**-6)
    return model


def _constant_gradient_steps(model, steps, lr=1e-5):
    optimizer, scheduler = make_optimizer(model, OptimConfig(lr=lr, grad_clip=1e6))
    published = []
    for _ in range(steps):
        run_updates(model=model, optimizer=optimizer, scheduler=scheduler, batch_size=1, mini_batch_size=1,
                    micro_batch_size=1, epochs=1, grad_clip=1e6, seed=0,
                    # loss = -w: gradient -1, so Adam raises w by lr (1 - 1e-8) every step
                    micro_loss=lambda indices: (-model(torch.ones(1, 1, dtype=model.weight.dtype)).float().sum(), {}),
                    prefix="t")
        published.append(float(compute_state_dict(model.state_dict(), torch.bfloat16)["weight"]))
    return published


def test_published_bf16_weights_change_once_the_accumulated_change_crosses_the_bf16_resolution():
    model = autocast_forward(_one_weight_model(torch.float32), torch.bfloat16)
    published = _constant_gradient_steps(model, 8)
    start = 2.0**-6
    # Half the gap to the next bf16 value is 2^-14 = 6.1e-5: 6 steps of 1e-5 stay below it, the 7th crosses it.
    assert published[:6] == [start] * 6
    assert published[6] == published[7] == start + 2.0**-13
    assert float(model.weight.detach()) == pytest.approx(start + 8e-5, abs=1e-8)  # the master kept every step
    # Pure bf16: each step of 1e-5 rounds away, forever.
    pure = _one_weight_model(torch.bfloat16)
    assert _constant_gradient_steps(pure, 20) == [start] * 20


def test_published_copy_is_in_the_compute_dtype_and_checkpoints_keep_the_masters(model_path, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoConfig

    actor = _actor(model_path, "float32")
    _update(actor)
    save_compute_copy(actor.model, str(tmp_path / "published"), actor.model.state_dict(), torch.bfloat16)
    published = load_file(str(tmp_path / "published" / "model.safetensors"))
    assert {tensor.dtype for tensor in published.values()} == {torch.bfloat16}
    assert AutoConfig.from_pretrained(tmp_path / "published").dtype == torch.bfloat16
    assert actor.model.config.dtype == torch.float32  # the live model's config is left as it was
    master = actor.model.state_dict()
    for name, tensor in published.items():
        assert torch.equal(tensor, master[name].to(torch.bfloat16)), name
    save_role_checkpoint(fsspec.filesystem("file"), str(tmp_path / "checkpoint"), actor.model, actor.updater)
    kept = load_file(str(tmp_path / "checkpoint" / "model.safetensors"))
    assert {tensor.dtype for tensor in kept.values()} == {torch.float32}
    for name, tensor in kept.items():
        assert torch.equal(tensor, master[name]), name


def test_a_bf16_compute_run_resumed_from_its_checkpoint_equals_the_uninterrupted_one_bit_for_bit(model_path, tmp_path):
    uninterrupted = _actor(model_path, "float32")
    _update(uninterrupted, steps=3)
    first = _actor(model_path, "float32")
    _update(first, steps=1)
    save_role_checkpoint(fsspec.filesystem("file"), str(tmp_path / "checkpoint"), first.model, first.updater)
    resumed = _actor(str(tmp_path / "checkpoint"), "float32")
    load_trainer_state(resumed.updater, str(tmp_path / "checkpoint"))
    _update(resumed, steps=2)
    expected = uninterrupted.model.state_dict()
    for name, tensor in resumed.model.state_dict().items():
        assert tensor.dtype == torch.float32
        assert torch.equal(tensor, expected[name]), name
    changed = [name for name, tensor in _weights(first.model).items()
               if not torch.equal(tensor, expected[name].float())]
    assert changed  # the last two steps did move the weights: the equality above is not vacuous


def test_the_critic_trains_fp32_masters_under_bf16_compute(model_path):
    critic = Critic.from_pretrained(model_path, CriticConfig(ppo_mini_batch_size=4, micro_batch_size=2,
                                                             optim=OptimConfig(lr=1e-6)),
                                    dtype="bfloat16", master_dtype="float32", device="cpu")
    assert {parameter.dtype for parameter in critic.model.parameters()} == {torch.float32}
    batch = _batch()
    values = critic.compute_values(batch)
    before = _weights(critic.model)
    metrics = critic.update(batch, old_values=values, returns=torch.ones_like(values) * batch.response_mask)
    changed = sum(int((tensor != before[name]).sum()) for name, tensor in _weights(critic.model).items())
    assert changed > 0.5 * sum(tensor.numel() for tensor in before.values())
    assert metrics["critic/update_rms_ratio"] > 0


def test_gradient_checkpointing_gives_the_same_update(model_path):
    plain, checkpointed = _actor(model_path, "float32", lr=1e-3), _actor(model_path, "float32", lr=1e-3,
                                                                          gradient_checkpointing=True)
    assert checkpointed.model.is_gradient_checkpointing and not plain.model.is_gradient_checkpointing
    _update(plain)
    _update(checkpointed)
    expected = plain.model.state_dict()
    for name, tensor in checkpointed.model.state_dict().items():
        torch.testing.assert_close(tensor, expected[name], rtol=0, atol=1e-6)


def test_precision_names():
    assert Precision.of("bfloat16", "float32").mixed
    assert not Precision.of("float32", "float32").mixed
    assert not Precision.of("bfloat16", "bfloat16").mixed
