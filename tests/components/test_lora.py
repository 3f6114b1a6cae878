"""LoRA on the actor and the critic (components/lora.py): adapter-only training, the merged weights the rollout
gets, the reference with the adapter disabled, checkpoints of the adapter, and the merged export."""

import copy

import fsspec
import pytest
import torch
from transformers import AutoModelForCausalLM

from components.actor import Actor, ActorConfig
from components.batch import build_sequence_batch, model_logits
from components.checkpoint import load_trainer_state, save_role_checkpoint
from components.critic import Critic, CriticConfig
from components.lora import merged_state_dict
from components.precision import save_compute_copy
from components.reference import AdapterReference, Reference
from components.rollout import HFRolloutEngine
from components.weight_sync.buckets import compute_tensors
from components.weight_sync.versions import InMemoryWeights
from flows.config import ConfigError, load_config

LORA = dict(rank=4, alpha=16, dropout=0.0, target_modules="all-linear")
CONFIG = ActorConfig(ppo_mini_batch_size=2, micro_batch_size=2, optim={"lr": 1e-2})


def _batch():
    return build_sequence_batch([[1, 2], [3], [4, 5], [6]], [[7, 8], [9], [10], [11, 12]], 0)


def _update(actor):
    batch = _batch()
    logprobs, _ = actor.compute_logprobs(batch)
    advantages = torch.tensor([[1.0, 1.0], [-1.0, 0.0], [0.5, 0.0], [-0.5, 1.0]])
    return actor.update(batch, old_logprobs=logprobs, advantages=advantages)


def _lora_actor(model_path, **kwargs):
    return Actor.from_pretrained(model_path, CONFIG, device="cpu", lora=LORA, **kwargs)


@pytest.mark.parametrize("override, message", [
    ("model.lora_rank=-1", "model.lora_rank=-1: Input should be greater than or equal to 0"),
    ("model.lora_alpha=0", "model.lora_alpha=0: Input should be greater than 0"),
    ("model.lora_dropout=1", "model.lora_dropout=1: Input should be less than 1"),
    ("model.target_modules=every-linear", "model.target_modules='every-linear': give 'all-linear' or a list"),
    ("model.target_modules=[]", "model.target_modules=[]: give 'all-linear' or a non-empty list"),
])
def test_bad_lora_settings_are_one_line_naming_the_field(override, message):
    with pytest.raises(ConfigError) as error:
        load_config(None, [override])
    assert str(error.value).startswith(message)
    assert "\n" not in str(error.value)


def test_lora_defaults_are_off_and_verls():
    model = load_config(None, []).model
    assert (model.lora_rank, model.lora_alpha, model.lora_dropout, model.target_modules) == (0, 16, 0.0, "all-linear")
    assert load_config(None, ["model.target_modules=[q_proj,v_proj]"]).model.target_modules == ["q_proj", "v_proj"]


def test_only_the_adapters_train_and_hold_optimizer_state(model_path):
    actor = _lora_actor(model_path)
    trainable = {name for name, parameter in actor.model.named_parameters() if parameter.requires_grad}
    assert trainable and all(".lora_A." in name or ".lora_B." in name for name in trainable)
    assert all(parameter.dtype == torch.float32 for parameter in actor.model.parameters() if parameter.requires_grad)
    frozen = {name: parameter.detach().clone() for name, parameter in actor.model.named_parameters()
              if not parameter.requires_grad}
    adapters = {name: parameter.detach().clone() for name, parameter in actor.model.named_parameters()
                if parameter.requires_grad}
    metrics = _update(actor)
    assert metrics["actor/update_rms_ratio"] > 0
    for name, parameter in actor.model.named_parameters():
        if name in frozen:
            assert torch.equal(parameter, frozen[name]), name  # the base, bit for bit
    changed = [name for name, parameter in actor.model.named_parameters()
               if name in adapters and not torch.equal(parameter, adapters[name])]
    assert any(".lora_B." in name for name in changed) and any(".lora_A." in name for name in changed)
    optimizer = actor.updater.optimizer
    held = [parameter for group in optimizer.param_groups for parameter in group["params"]]
    assert len(held) == len(trainable) and len(optimizer.state) == len(trainable)
    assert all(parameter.requires_grad for parameter in held)


def test_under_mixed_precision_the_frozen_base_is_held_in_the_compute_dtype(model_path):
    """bf16 compute with fp32 masters: the base (nothing updates it) in bf16, 2 bytes a parameter instead of 4 + a
    compute copy; the adapters in float32. The merged weights are W + delta summed in float32, rounded once."""
    actor = _lora_actor(model_path, dtype="bfloat16", master_dtype="float32")
    frozen = [parameter for parameter in actor.model.parameters() if not parameter.requires_grad]
    trained = [parameter for parameter in actor.model.parameters() if parameter.requires_grad]
    assert frozen and all(parameter.dtype == torch.bfloat16 for parameter in frozen)
    assert trained and all(parameter.dtype == torch.float32 for parameter in trained)
    assert _update(actor)["actor/update_rms_ratio"] > 0
    layer = actor.model.get_base_model().model.layers[0].self_attn.q_proj
    expected = (layer.base_layer.weight.float() + layer.get_delta_weight("default").float()).to(torch.bfloat16)
    merged = merged_state_dict(actor.model, torch.bfloat16)
    assert merged["model.layers.0.self_attn.q_proj.weight"].dtype == torch.bfloat16
    assert torch.equal(merged["model.layers.0.self_attn.q_proj.weight"], expected)
    assert not torch.equal(expected, layer.base_layer.weight)  # the update reached the merged weight


def test_merged_weights_equal_peft_merge_and_unload_under_the_base_names(model_path):
    actor = _lora_actor(model_path)
    _update(actor)
    _update(actor)
    expected = copy.deepcopy(actor.model).merge_and_unload().state_dict()
    merged = merged_state_dict(actor.model)
    assert list(merged) == list(expected)
    for name, tensor in expected.items():
        assert torch.equal(merged[name], tensor), name
    # some weights did change, and the training model was not merged in place
    base = AutoModelForCausalLM.from_pretrained(model_path).state_dict()
    assert not torch.equal(merged["model.layers.0.self_attn.q_proj.weight"], base["model.layers.0.self_attn.q_proj.weight"])
    assert torch.equal(actor.model.get_base_model().model.layers[0].self_attn.q_proj.base_layer.weight,
                       base["model.layers.0.self_attn.q_proj.weight"])
    # the hand-over's view streams the same tensors, names as the rollout's model has them
    streamed = dict(compute_tensors(actor.policy_model, torch.float32))
    assert set(streamed) <= set(base) and "model.embed_tokens.weight" in streamed
    for name, tensor in streamed.items():
        assert torch.equal(tensor, expected[name]), name


def test_rollout_fed_the_merged_weights_gives_the_actors_logprobs(model_path, tmp_path):
    """The gap metric's premise: the engine, given the adapted policy (in memory or as a stored copy), computes the
    log-probs the actor computes."""
    actor = _lora_actor(model_path)
    _update(actor)
    _update(actor)
    batch = _batch()
    actor_logprobs, _ = actor.compute_logprobs(batch)
    in_memory = HFRolloutEngine.from_pretrained(model_path, device="cpu")
    in_memory.load_weights(InMemoryWeights(actor.policy_model, torch.float32, 1))
    save_compute_copy(actor.policy_model, str(tmp_path / "stored"), actor.policy_model.state_dict(), torch.float32)
    stored = HFRolloutEngine.from_pretrained(model_path, device="cpu")
    stored.load_weights(str(tmp_path / "stored"))
    for engine in (in_memory, stored):
        with torch.no_grad():
            logits = model_logits(engine.model.eval(), batch)
        logprobs = torch.log_softmax(logits.float(), -1).gather(-1, batch.response_ids.unsqueeze(-1)).squeeze(-1)
        torch.testing.assert_close(logprobs * batch.response_mask, actor_logprobs, rtol=0, atol=1e-5)


def test_the_reference_is_the_base_with_the_adapter_disabled(model_path):
    actor = _lora_actor(model_path)
    _update(actor)
    _update(actor)
    batch = _batch()
    base = Reference.from_pretrained(model_path, device="cpu").compute_logprobs(batch)
    reference = AdapterReference(lambda: actor, micro_batch_size=2).compute_logprobs(batch)
    assert torch.equal(reference, base)
    adapted, _ = actor.compute_logprobs(batch)  # the adapter is on again afterwards
    assert not torch.allclose(adapted, base)


def test_a_lora_checkpoint_holds_the_adapter_and_resumes_bit_for_bit(model_path, tmp_path):
    actor = _lora_actor(model_path)
    _update(actor)
    fs = fsspec.filesystem("file")
    folder = tmp_path / "ckpt"
    save_role_checkpoint(fs, str(folder), actor.model, actor.updater)
    assert (folder / "adapter_config.json").exists() and (folder / "adapter_model.safetensors").exists()
    assert not (folder / "model.safetensors").exists()  # the base is the run's initial policy, not copied
    restored = _lora_actor(model_path, adapter=str(folder))
    load_trainer_state(restored.updater, str(folder))
    for name, tensor in actor.model.state_dict().items():
        assert torch.equal(tensor, restored.model.state_dict()[name]), name
    saved, loaded = actor.updater.optimizer.state_dict()["state"], restored.updater.optimizer.state_dict()["state"]
    assert saved.keys() == loaded.keys()
    for key in saved:
        assert torch.equal(saved[key]["exp_avg"], loaded[key]["exp_avg"])
        assert torch.equal(saved[key]["exp_avg_sq"], loaded[key]["exp_avg_sq"])
    assert _update(actor) == _update(restored)  # the next update too
    for name, tensor in actor.model.state_dict().items():
        assert torch.equal(tensor, restored.model.state_dict()[name]), name


def test_the_merged_copy_loads_in_transformers_with_the_adapted_logits(model_path, tmp_path):
    actor = _lora_actor(model_path)
    _update(actor)
    _update(actor)
    folder = tmp_path / "merged"
    actor.policy_model.save_pretrained(folder)
    loaded = AutoModelForCausalLM.from_pretrained(folder).eval()
    batch = _batch()
    with torch.no_grad():
        torch.testing.assert_close(model_logits(loaded, batch), model_logits(actor.model.eval(), batch),
                                   rtol=0, atol=1e-5)


def test_a_lora_critic_trains_its_adapters_and_value_head_only(model_path, tmp_path):
    torch.manual_seed(0)
    critic = Critic.from_pretrained(model_path, CriticConfig(ppo_mini_batch_size=4, micro_batch_size=2), device="cpu",
                                    lora=LORA)
    trainable = [name for name, parameter in critic.model.named_parameters() if parameter.requires_grad]
    assert any(".lora_" in name for name in trainable) and any("score" in name for name in trainable)
    assert all(".lora_" in name or "score" in name for name in trainable)
    batch = _batch()
    values = critic.compute_values(batch)
    critic.update(batch, old_values=values, returns=torch.ones_like(values))
    fs = fsspec.filesystem("file")
    save_role_checkpoint(fs, str(tmp_path / "critic"), critic.model, critic.updater)
    torch.manual_seed(1)  # another random head: the checkpoint's must replace it
    restored = Critic.from_pretrained(model_path, critic.config, device="cpu", lora=LORA, adapter=str(tmp_path / "critic"))
    assert torch.equal(restored.compute_values(batch), critic.compute_values(batch))


def test_the_streamed_hand_over_packs_the_merged_weights(model_path):
    """trainer.execution=workers: the actor's sender lays out its buckets from the published tensors and holds only
    weak references to them (PackPlan); the merged ones stay alive in the view until the next publish."""
    from components.weight_sync.buckets import BucketBuffers, PackPlan, unpack_bucket

    actor = _lora_actor(model_path)
    _update(actor)
    _update(actor)
    plan = PackPlan(list(compute_tensors(actor.policy_model, torch.float32, cast=False, detach=False)), 2**16,
                    BucketBuffers(), torch.float32)
    assert plan.available
    expected = copy.deepcopy(actor.model).merge_and_unload().state_dict()
    received = {name: tensor.clone() for bucket in plan.buckets() for name, tensor in unpack_bucket(bucket.specs,
                                                                                                     bucket.buffer)}
    assert received and all(torch.equal(tensor, expected[name]) for name, tensor in received.items())
