"""components.weight_sync.versions: a stored copy is byte for byte what the storage path writes; the
transformers engine takes a live model's weights in memory and refuses a withdrawn or released version."""

from __future__ import annotations

import gc
import os

import pytest
import torch

from components.rollout import HFRolloutEngine
from components.weight_sync.buckets import StaleWeightsError, compute_tensors
from components.weight_sync.versions import InMemoryWeights, copy_files, write_copy


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    from components.tiny import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("model") / "tiny"))


def test_a_stored_copy_is_byte_for_byte_the_storage_paths(tiny_path, tmp_path):
    from transformers import AutoModelForCausalLM

    from components.precision import save_compute_copy

    model = AutoModelForCausalLM.from_pretrained(tiny_path)
    with torch.no_grad():
        model.model.embed_tokens.weight.add_(0.01)
    for dtype in (torch.bfloat16, torch.float32):
        reference, ours = tmp_path / f"save_pretrained-{dtype}", tmp_path / f"ours-{dtype}"
        reference.mkdir(), ours.mkdir()
        save_compute_copy(model, str(reference), model.state_dict(), dtype)
        write_copy(str(ours), copy_files(model, dtype),
                   {name: tensor.cpu().clone() for name, tensor in compute_tensors(model, dtype, tied_once=False)})
        assert sorted(os.listdir(ours)) == sorted(os.listdir(reference))
        for name in os.listdir(reference):
            assert (ours / name).read_bytes() == (reference / name).read_bytes(), (dtype, name)


def test_the_hf_engine_takes_a_live_models_weights_and_refuses_withdrawn_ones(tiny_path):
    from transformers import AutoModelForCausalLM

    engine = HFRolloutEngine.from_pretrained(tiny_path, dtype="float32", device="cpu")
    live = AutoModelForCausalLM.from_pretrained(tiny_path)
    with torch.no_grad():
        for parameter in live.parameters():
            parameter.mul_(1.5)
    published = InMemoryWeights(live, torch.float32, version=4)
    engine.load_weights(published)
    for name, tensor in live.state_dict().items():
        assert torch.equal(engine.model.state_dict()[name], tensor), name
    assert engine.model.lm_head.weight.data_ptr() == engine.model.model.embed_tokens.weight.data_ptr()
    published.withdraw()
    with pytest.raises(StaleWeightsError, match="policy version 4 is no longer in memory"):
        engine.load_weights(published)
    del live
    released = InMemoryWeights(AutoModelForCausalLM.from_pretrained(tiny_path), torch.float32, version=5)
    gc.collect()  # the role was dropped: what it published does not keep it alive
    with pytest.raises(StaleWeightsError, match="version 5"):
        released.tensors()
