"""A published policy version, in the two forms a rollout engine loads: `InMemoryWeights`, backed by the
live model of the actor in this process and valid until that model starts changing again; and a stored copy
(`copy_files`, `write_copy`): a Hugging Face model folder in the compute dtype, written from the same tensors.
"""

from __future__ import annotations

import json
import weakref
from pathlib import Path
from typing import Iterator

import torch
from safetensors.torch import save_file

from components.weight_sync.buckets import StaleWeightsError, compute_tensors


class InMemoryWeights:
    """Policy `version`, backed by the live `model`: streamed in `dtype` by `tensors()` while `current`."""

    def __init__(self, model: torch.nn.Module, dtype: torch.dtype, version: int):
        # A weak reference: a role dropped at the end of its run is not kept alive by what it published.
        self._model = weakref.ref(model)
        self.dtype, self.version = dtype, version
        self.current = True

    def withdraw(self) -> None:
        """The model is about to change: this version can no longer be streamed from it."""
        self.current = False

    @property
    def available(self) -> bool:
        """Whether `tensors()` can still stream this version: not withdrawn, and its model still alive."""
        return self.current and self._model() is not None

    def tensors(self, cast: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
        """The version's tensors, cast to `dtype` (`cast=False`: as the model holds them, for
        `pack_buckets(dtype=...)`)."""
        model = self._model()
        if not self.current or model is None:
            raise StaleWeightsError(
                f"policy version {self.version} is no longer in memory (the actor has been updated or released "
                "since); it can only be read back from a stored copy (weights/actor/<step>)")
        return compute_tensors(model, self.dtype, cast=cast)

    def __repr__(self) -> str:
        return f"InMemoryWeights(version={self.version}, dtype={self.dtype}, current={self.current})"


def copy_files(model: torch.nn.Module, dtype: torch.dtype) -> dict[str, str]:
    """The small files of a stored compute-dtype copy of `model`, as text: config.json (saying `dtype`, so
    that transformers' and vLLM's dtype=auto load the copy as what it is) and generation_config.json."""
    config = json.loads(model.config.to_json_string(use_diff=True))
    config["dtype"] = str(dtype).removeprefix("torch.")
    config.pop("torch_dtype", None)
    if not config.get("architectures"):
        config["architectures"] = [type(model).__name__]
    files = {"config.json": json.dumps(config, indent=2, sort_keys=True) + "\n"}
    generation = getattr(model, "generation_config", None)
    if generation is not None:
        files["generation_config.json"] = generation.to_json_string(use_diff=True)
    return files


def write_copy(folder: str, files: dict[str, str], state: dict[str, torch.Tensor]) -> None:
    """Write a stored copy (`copy_files` and the tensors of `compute_tensors`, on the host) into `folder`:
    a Hugging Face model folder that transformers, vLLM and `rlhf export` read."""
    save_file(state, str(Path(folder) / "model.safetensors"), metadata={"format": "pt"})
    for name, text in files.items():
        (Path(folder) / name).write_text(text)
