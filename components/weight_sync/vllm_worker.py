"""Code that runs inside vLLM's worker processes, registered as the engine's worker extension
(`worker_extension_cls`): the engine calls these methods by name through `collective_rpc`, so no function
is pickled across processes (vLLM's VLLM_ALLOW_INSECURE_SERIALIZATION stays off) and every argument is
plain data (strings, numbers, lists, bytes).

Weights arrive two ways: a safetensors folder on storage (`rlhf_reload_path`), or in memory as packed
buckets (buckets.py) that are a CUDA IPC handle of the sender's GPU buffer (no copy through the
host), a broadcast of a process group the worker joined with the actor's worker (`rlhf_join_group`:
NCCL between GPUs, gloo on CPUs; sender.py), or the bucket's bytes (the CPU build in
the actor's own process).
"""

from __future__ import annotations

import logging
import time

import torch

from components.weight_sync.buckets import unpack_bucket
from components.weight_sync.channel import GroupReceiver, gpu_uuids, open_payload


def _quiet_layerwise():
    # With tied embeddings the LM head has nothing of its own to load; vLLM warns about it every time.
    return logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")


class WeightReceiver:
    """Mixed into vLLM's Worker class: `self.model_runner` is the worker's.

    In-memory loading goes one of two ways, chosen at `begin` (`direct_loading`):
    - direct (an unquantized model on a GPU, whose live tensors are in checkpoint format: nothing is repacked
      after loading): each bucket is given to the model's `load_weights`, whose loaders copy into the live
      tensors at once, as verl's and OpenRLHF's weight sync do;
    - layerwise (parameters repacked into a kernel format after loading, as vLLM's CPU backend does): vLLM's
      own in-place reload (`reload_weights`) split over calls: `begin` puts every layer back in checkpoint
      format, a layer is processed and copied into its live tensors once all its weights arrived, `finish`
      processes what is left.
    Either way the live tensors are written in place: CUDA-graph buffers stay valid."""

    def rlhf_reload_path(self, path: str) -> None:
        """Reload the weights in place from `path` (each tensor-parallel rank reads and shards its part)."""
        layerwise = _quiet_layerwise()
        level = layerwise.level
        layerwise.setLevel(logging.ERROR)
        try:
            self.reload_weights(weights_path=path)
        finally:
            layerwise.setLevel(level)
        self._rlhf_after_load()

    def rlhf_describe(self) -> dict:
        """Where this worker's model computes and which GPUs it sees (a CUDA IPC handle of one opens here)."""
        device = next(self.model_runner.get_model().parameters()).device
        return {"device": device.type, "gpus": gpu_uuids() if device.type == "cuda" else []}

    def rlhf_join_group(self, channel: dict, prefix: str, first_rank: int, world: int, backend: str,
                        timeout_s: float) -> None:
        """Join the actor's weights group `prefix` as rank first_rank + this worker's rank in the engine."""
        if not hasattr(self, "_rlhf_groups"):
            self._rlhf_groups = GroupReceiver()
        self._rlhf_groups.join(channel, prefix, first_rank + int(getattr(self, "rank", 0)), world, backend, timeout_s)

    def rlhf_begin_load(self) -> str:
        """Prepare an in-memory load; returns the way it goes ('direct' or 'layerwise')."""
        # on use: only vLLM's worker processes call this, vLLM imported already; the module imports without vLLM
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        model = self.model_runner.get_model()
        self._rlhf_direct = direct_loading(model, getattr(self.model_runner, "model_config", None))
        if not self._rlhf_direct:
            initialize_layerwise_reload(model)
        self._rlhf_parts = {"receive": 0.0, "apply": 0.0}
        return "direct" if self._rlhf_direct else "layerwise"

    def rlhf_load_bucket(self, specs: list, payload: dict) -> int:
        """Give one packed bucket of checkpoint-named tensors to the model's weight loaders (each
        tensor-parallel rank takes its shard); returns how many tensors it held. The bucket is finished
        with on return (GPU copies done): the sender reuses its buffer next."""
        started = time.perf_counter()
        model = self.model_runner.get_model()
        received, transient = open_payload(payload, getattr(self, "_rlhf_groups", None))
        opened = time.perf_counter()
        # Layerwise, a layer whose weights straddle two buckets keeps the first part until the rest arrives:
        # our own copy of a buffer the next bucket overwrites (the sender's, or the group's). Direct loaders
        # copy at once.
        buffer = received.clone() if transient and not getattr(self, "_rlhf_direct", False) else received
        model.load_weights(weights=iter(unpack_bucket(specs, buffer)))
        if buffer.is_cuda:
            torch.cuda.synchronize()
        del received, buffer
        self._rlhf_parts["receive"] += opened - started
        self._rlhf_parts["apply"] += time.perf_counter() - opened
        return len(specs)

    def rlhf_finish_load(self) -> dict:
        """Finish an in-memory load; returns its parts in seconds: receive (opening or receiving the buckets),
        apply (the loaders' copies, layerwise processing included)."""
        # on use: only vLLM's worker processes call this, vLLM imported already; the module imports without vLLM
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        layerwise = _quiet_layerwise()
        level = layerwise.level
        layerwise.setLevel(logging.ERROR)
        try:
            if not getattr(self, "_rlhf_direct", False):
                finalize_layerwise_reload(self.model_runner.get_model(), self.model_runner.model_config)
        finally:
            layerwise.setLevel(level)
        for reset in ("reset_lora_state", "reset_encoder_cache", "reset_mm_cache"):
            if hasattr(self.model_runner, reset):
                getattr(self.model_runner, reset)()
        self._rlhf_after_load()
        return self._rlhf_parts

    def _rlhf_after_load(self) -> None:
        """On the CPU backend the LM head keeps a prepacked copy of its weight (`cpu_linear`), made once at
        load; with tied embeddings nothing is loaded into the head itself, so that copy would go stale."""
        model = self.model_runner.get_model()
        head = getattr(model, "lm_head", None)
        method = getattr(head, "quant_method", None)
        if head is not None and hasattr(head, "cpu_linear") and method is not None:
            method.process_weights_after_loading(head)


NO_OP_ON_GPU = frozenset({"UnquantizedLinearMethod", "UnquantizedEmbeddingMethod"})
"""vLLM methods whose processing after loading does nothing on a GPU (on the CPU backend they repack)."""


def direct_loading(model: torch.nn.Module, model_config=None) -> bool:
    """Whether a load may go straight into the live tensors: the model computes on a GPU, is not quantized,
    and its layers keep their tensors as loaded (`kept_as_loaded`). Parameters without a loader of their own
    (norms) take vLLM's default, a plain copy."""
    first = next(model.parameters(), None)
    if first is None or first.device.type != "cuda":
        return False
    if model_config is not None and getattr(model_config, "quantization", None) is not None:
        return False
    return kept_as_loaded(model)


def kept_as_loaded(model: torch.nn.Module) -> bool:
    """Whether every layer's method leaves its tensors as loaded on a GPU (`NO_OP_ON_GPU`; attention without a
    quantized KV cache has none)."""
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if method is not None and type(method).__name__ not in NO_OP_ON_GPU:
            return False
    return True
