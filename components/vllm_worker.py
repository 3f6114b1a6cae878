"""Code that runs inside vLLM's worker processes, registered as the engine's worker extension
(`worker_extension_cls`): the engine calls these methods by name through `collective_rpc`, so no function
is pickled across processes (vLLM's VLLM_ALLOW_INSECURE_SERIALIZATION stays off) and every argument is
plain data (strings, numbers, lists, bytes).

Weights arrive two ways: a safetensors folder on storage (`rlhf_reload_path`), or in memory as packed
buckets (components/weights.py) that are either a CUDA IPC handle of the sender's GPU buffer (no copy
through the host) or the bucket's bytes (the CPU build, or a GPU this worker cannot see).
"""

from __future__ import annotations

import logging

import torch

from components.weights import unpack_bucket


def _quiet_layerwise():
    # With tied embeddings the LM head has nothing of its own to load; vLLM warns about it every time.
    return logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")


def _device_index(uuid: str) -> int | None:
    for index in range(torch.cuda.device_count()):
        if str(torch.cuda.get_device_properties(index).uuid) == uuid:
            return index
    return None


class WeightReceiver:
    """Mixed into vLLM's Worker class: `self.model_runner` is the worker's.

    In-memory loading goes one of two ways, chosen at `begin`:
    - direct (every parameter still has its checkpoint-format weight loader and the model is not quantized:
      bf16/fp32 models on CUDA): each bucket is given to the model's loaders, which copy into the live
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

    def rlhf_can_open(self, uuid: str) -> bool:
        """Whether this worker sees the GPU `uuid` (so a CUDA IPC handle of its memory can be opened here)."""
        return torch.cuda.is_available() and _device_index(uuid) is not None

    def rlhf_begin_load(self) -> str:
        """Prepare an in-memory load; returns the way it goes ('direct' or 'layerwise')."""
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        model = self.model_runner.get_model()
        self._rlhf_direct = (getattr(self.model_runner.model_config, "quantization", None) is None
                             and all(hasattr(parameter, "weight_loader") for parameter in model.parameters()))
        if not self._rlhf_direct:
            initialize_layerwise_reload(model)
        return "direct" if self._rlhf_direct else "layerwise"

    def rlhf_load_bucket(self, specs: list, payload: dict) -> int:
        """Give one packed bucket of checkpoint-named tensors to the model's weight loaders (each
        tensor-parallel rank takes its shard); returns how many tensors it held. The bucket is finished
        with on return (GPU copies done): the sender reuses its buffer next."""
        if payload["kind"] == "cuda_ipc":
            device = _device_index(payload["device_uuid"])
            if device is None:
                raise RuntimeError(f"GPU {payload['device_uuid']} is not visible in this vLLM worker")
            share = list(payload["share"])
            share[0] = device
            with torch.cuda.device(device):
                storage = torch.UntypedStorage._new_shared_cuda(*share)
                received = torch.empty(0, dtype=torch.uint8, device=f"cuda:{device}")
                received.set_(storage, payload["offset"], (payload["nbytes"],), (1,))
                # Layerwise, a layer whose weights straddle two buckets keeps the first part until the rest
                # arrives: our own copy, as the sender's buffer is refilled next. Direct loaders copy at once.
                buffer = received if getattr(self, "_rlhf_direct", False) else received.clone()
            del received, storage
        elif payload["kind"] == "bytes":
            buffer = torch.frombuffer(bytearray(payload["data"]), dtype=torch.uint8)
        else:
            raise ValueError(f"unknown weights payload kind {payload['kind']!r}")
        self.model_runner.get_model().load_weights(weights=iter(unpack_bucket(specs, buffer)))
        if buffer.is_cuda:
            torch.cuda.synchronize()
        return len(specs)

    def rlhf_finish_load(self) -> None:
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

    def _rlhf_after_load(self) -> None:
        """On the CPU backend the LM head keeps a prepacked copy of its weight (`cpu_linear`), made once at
        load; with tied embeddings nothing is loaded into the head itself, so that copy would go stale."""
        model = self.model_runner.get_model()
        head = getattr(model, "lm_head", None)
        method = getattr(head, "quant_method", None)
        if head is not None and hasattr(head, "cpu_linear") and method is not None:
            method.process_weights_after_loading(head)
