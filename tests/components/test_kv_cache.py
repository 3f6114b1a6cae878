"""components.kv_cache: a sleeping engine's KV cache, sized for a step's samples, by hand."""

from __future__ import annotations

import importlib.metadata

from transformers import DeepseekV3Config, Qwen2Config

from components import vllm_build
from components.kv_cache import kv_bytes_per_token, kv_cache_gib_for, sized_kv_cache_gib

# Qwen2.5-0.5B's attention: 24 layers, 14 query heads, 2 key-value heads of 64 dims
QWEN_05B = Qwen2Config(num_hidden_layers=24, hidden_size=896, num_attention_heads=14, num_key_value_heads=2,
                       intermediate_size=4864, vocab_size=1000)


def test_bytes_per_token_count_keys_and_values_of_every_layers_kv_heads():
    assert kv_bytes_per_token(QWEN_05B, 2) == 2 * 24 * 2 * 64 * 2 == 12288
    assert kv_bytes_per_token(QWEN_05B, 4) == 24576  # float32
    assert kv_bytes_per_token(QWEN_05B, 2, tensor_parallel=2) == 6144  # one kv head per GPU
    assert kv_bytes_per_token(QWEN_05B, 2, tensor_parallel=4) == 6144  # 2 heads on 4 GPUs: replicated, not split
    explicit = Qwen2Config(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=4,
                           head_dim=32, vocab_size=100)
    assert kv_bytes_per_token(explicit, 2) == 2 * 2 * 4 * 32 * 2  # head_dim given, not hidden_size / heads


def test_a_steps_samples_in_gib_with_headroom_rounded_up():
    tokens = 64 * 8 * 768  # the bench's GRPO step: 64 prompts x 8 samples x (256 + 512) tokens
    # 393216 x 12288 B = 4.5 GiB; x 1.25 = 5.625; up to the next quarter GiB
    assert kv_cache_gib_for(QWEN_05B, tokens, "bfloat16") == 5.75
    assert kv_cache_gib_for(QWEN_05B, tokens, "float32") == 11.25  # 9 x 1.25
    assert kv_cache_gib_for(QWEN_05B, 16, "bfloat16") == 0.25  # never below one quarter GiB
    assert kv_cache_gib_for(QWEN_05B, tokens, "auto") == 5.75  # the model's dtype (none given: bf16)


def test_the_engine_sizes_from_its_models_folder_and_says_so(model_path, capsys):
    # the role tests' tiny model: 1 layer, 1 kv head of 64 dims -> 2 x 1 x 1 x 64 x 4 B = 512 B per float32 token
    assert sized_kv_cache_gib(model_path, 2**21, "float32") == 1.25  # 1 GiB x 1.25
    assert "vLLM KV cache: 1.25 GiB per GPU for 2,097,152 tokens" in capsys.readouterr().out
    assert sized_kv_cache_gib(model_path, 2**21, "bfloat16") == 0.75  # 0.5 GiB x 1.25, rounded up


def test_latent_attention_is_left_to_gpu_memory_utilization():
    assert kv_cache_gib_for(DeepseekV3Config(num_hidden_layers=2, vocab_size=100), 1000, "bfloat16") is None


def test_a_wake_skips_the_prefix_cache_reset_only_where_sleep_emptied_it(monkeypatch):
    monkeypatch.setattr(vllm_build, "installed_vllm", lambda: "vllm")
    for version, clears in (("0.26.0", True), ("0.32.0+cpu", True), ("1.0.0", True), ("0.25.1", False), ("dev", False)):
        monkeypatch.setattr(importlib.metadata, "version", lambda _name, version=version: version)
        vllm_build.sleep_clears_prefix_cache.cache_clear()  # read once per process
        assert vllm_build.sleep_clears_prefix_cache() is clears, version
    monkeypatch.setattr(vllm_build, "installed_vllm", lambda: None)
    vllm_build.sleep_clears_prefix_cache.cache_clear()
    assert vllm_build.sleep_clears_prefix_cache() is False
    vllm_build.sleep_clears_prefix_cache.cache_clear()  # the next reader sees the installed build
