"""The KV cache a vLLM engine needs for one step's samples: rollout.kv_cache_gib's default where the engine
sleeps between generations (it shares its GPU with training). Waking maps the whole cache back every step
(on one H200, 54 GiB at gpu_memory_utilization=0.4 took 52-56 ms for a batch that needs 4.5 GiB), and
training has the rest of the GPU to itself in between."""

from __future__ import annotations

import math

from components.models import model_source

KV_HEADROOM = 1.25
"""Room above the estimate (vLLM's blocks round each sequence up; its own buffers)."""
GRANULE_GIB = 0.25

_DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2}


def kv_bytes_per_token(model_config, dtype_bytes: int, tensor_parallel: int = 1) -> int | None:
    """Bytes of KV cache per token on each GPU of a tensor-parallel group, from a transformers config: keys and
    values of every layer's key-value heads (replicated where the group has more GPUs than heads). None for an
    attention this formula does not describe (latent attention, layers without a key-value head count)."""
    text = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    layers, heads = getattr(text, "num_hidden_layers", None), getattr(text, "num_attention_heads", None)
    if not layers or not heads or getattr(text, "kv_lora_rank", None):
        return None
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    per_gpu = max(1, math.ceil(kv_heads / tensor_parallel))
    return 2 * layers * per_gpu * head_dim * dtype_bytes


def kv_cache_gib_for(model_config, tokens: int, dtype: str, tensor_parallel: int = 1) -> float | None:
    """GiB of KV cache per GPU that holds `tokens` (with KV_HEADROOM, rounded up to GRANULE_GIB), in the
    engine's `dtype` ('auto': the model's own); None where kv_bytes_per_token cannot tell."""
    if dtype == "auto":
        dtype = str(getattr(model_config, "torch_dtype", None) or getattr(model_config, "dtype", None) or "bfloat16")
    per_token = kv_bytes_per_token(model_config, _DTYPE_BYTES.get(dtype.removeprefix("torch."), 2), tensor_parallel)
    if per_token is None:
        return None
    gib = tokens * per_token * KV_HEADROOM / 2**30
    return max(GRANULE_GIB, math.ceil(gib / GRANULE_GIB) * GRANULE_GIB)


def sized_kv_cache_gib(path: str, tokens: int, dtype: str, tensor_parallel: int = 1,
                       trust_remote_code: bool = False) -> float | None:
    """`kv_cache_gib_for` the model at `path` (a folder or hub name: its config only is read), said in the log;
    None (gpu_memory_utilization decides) where its config does not tell."""
    # on use: transformers takes about a second to import; the config, the CLI and doctor import this module
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_source(path), trust_remote_code=trust_remote_code)
    gib = kv_cache_gib_for(config, tokens, dtype, tensor_parallel)
    print(f"vLLM KV cache: {gib} GiB per GPU for {tokens:,} tokens (a step's samples at full length; "
          "rollout.kv_cache_gib or rollout.gpu_memory_utilization sets it)" if gib is not None else
          "vLLM KV cache: sized by gpu_memory_utilization (the model's attention is not one kv_cache.py sizes)",
          flush=True)
    return gib
