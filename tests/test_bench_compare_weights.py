"""bench/common.py's weight comparison, which every benchmark row's "weights changed" column comes from: hand-computed
values for a full checkpoint, and a LoRA checkpoint read as the merged policy W + (alpha / r) * B @ A."""

from __future__ import annotations

import json
import math

import torch
from safetensors.torch import save_file

from bench.common import LoraMergedWeights, SafetensorsWeights, compare_weights


def test_the_comparison_counts_the_changed_elements_and_the_update_size():
    initial = {"w": torch.tensor([1.0, 2.0, 3.0, 4.0]), "b": torch.tensor([0.5]), "tied": torch.tensor([9.0])}
    final = {"w": torch.tensor([1.0, 2.0, 3.5, 4.0]), "b": torch.tensor([0.25]), "new": torch.tensor([1.0])}
    change = compare_weights(initial, final, chunk_elements=3)  # chunks cut inside "w"
    assert change["weights_compared_tensors"] == 2 and change["weights_compared_elements"] == 5
    assert change["weights_changed_elements"] == 2 and change["weights_changed_fraction"] == 2 / 5
    assert math.isclose(change["weights_mean_abs_delta"], (0.5 + 0.25) / 5)
    assert math.isclose(change["weights_rms_ratio"], math.sqrt((0.25 + 0.0625) / (1 + 4 + 9 + 16 + 0.25)))
    assert change["weights_max_abs_delta"] == 0.5
    assert (change["weights_only_initial"], change["weights_only_final"]) == (["tied"], ["new"])
    assert compare_weights(initial, initial)["weights_changed_fraction"] == 0.0


def test_a_lora_checkpoint_compares_as_the_base_with_its_delta_merged_in(tmp_path):
    base = tmp_path / "base"
    base.mkdir()
    weight = torch.tensor([[1.0, 0.0], [0.0, 1.0]], dtype=torch.bfloat16)
    save_file({"model.layers.0.q_proj.weight": weight, "model.norm.weight": torch.ones(2, dtype=torch.bfloat16)},
              str(base / "model.safetensors"))
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"r": 1, "lora_alpha": 2}))
    prefix = "base_model.model.model.layers.0.q_proj"
    save_file({f"{prefix}.lora_A.weight": torch.tensor([[1.0, 0.0]]),      # A: [r, in]
               f"{prefix}.lora_B.weight": torch.tensor([[0.0], [0.25]])},  # B: [out, r]
              str(adapter / "adapter_model.safetensors"))
    initial = SafetensorsWeights(base)
    final = LoraMergedWeights(initial, adapter)
    # W + (2 / 1) * B @ A: only element [1, 0] moves, 0 -> 0.5
    assert torch.equal(final["model.layers.0.q_proj.weight"], torch.tensor([[1.0, 0.0], [0.5, 1.0]]))
    assert torch.equal(final["model.norm.weight"], torch.ones(2, dtype=torch.bfloat16))  # LoRA leaves it alone
    change = compare_weights(initial, final)
    assert change["weights_changed_elements"] == 1 and change["weights_changed_fraction"] == 1 / 6
    assert math.isclose(change["weights_mean_abs_delta"], 0.5 / 6)
