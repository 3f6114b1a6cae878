"""Mixed precision for the trained roles: fp32 master weights, forward and backward in bf16 (or fp16).

At RL learning rates an AdamW step moves a weight by about the learning rate (1e-6), far below half a
bf16 ulp of a typical weight (|w| = 0.02: ulp 1.2e-4), so AdamW applied to bf16 parameters rounds almost
every update away. verl's FSDP workers therefore keep parameters, gradients and optimizer state in float32
and compute in bf16 (FSDP `MixedPrecision(param_dtype=bf16, reduce_dtype=fp32)`); so does this module:

- one process: the model holds its parameters in `master` dtype and its forward runs under
  `torch.autocast(compute)`: matmuls and attention in bf16 on bf16 casts of the weights, the weights'
  gradients accumulated in float32 (as TRL's and HF Trainer's `bf16=True` do);
- sharded (FSDP2): `MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=float32)`: each layer's
  weights are gathered as bf16 copies, gradients reduced in float32 onto the fp32 shards.

Roles that do not train (rollout engine, reference, reward model) load straight in the compute dtype.
Weights published to the rollout and exports are bf16 casts of the masters (`compute_state_dict`);
checkpoints keep the masters and the optimizer state, so a resumed run continues bit for bit.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from components.distributed import is_distributed, shard_model
from components.models import resolve_dtype


@dataclass(frozen=True)
class Precision:
    """compute: the dtype forward and backward run in; master: the trained parameters' and optimizer's."""

    compute: torch.dtype = torch.float32
    master: torch.dtype = torch.float32

    @classmethod
    def of(cls, compute: str | torch.dtype, master: str | torch.dtype) -> "Precision":
        return cls(resolve_dtype(compute), resolve_dtype(master))

    @property
    def mixed(self) -> bool:
        """Whether compute runs in a narrower dtype than the masters (autocast, or FSDP's policy)."""
        return self.compute != self.master


def autocast_forward(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """Make every call of `model` run under `torch.autocast(<its device>, dtype)`, in place.

    The backward pass replays the casts recorded in the forward, so wrapping the forward is enough; callers
    (log-prob passes, the update, generation) need not know. Idempotent."""
    if getattr(model, "autocast_dtype", None) == dtype:
        return model
    forward = getattr(model, "_forward_before_autocast", model.forward)

    @functools.wraps(forward)
    def forward_in_compute_dtype(*args, **kwargs):
        device_type = next(model.parameters()).device.type
        with torch.autocast(device_type, dtype=dtype):
            return forward(*args, **kwargs)

    model._forward_before_autocast = forward
    model.forward = forward_in_compute_dtype
    model.autocast_dtype = dtype
    return model


def prepare_trained_model(model: torch.nn.Module, precision: Precision, gradient_checkpointing: bool = False,
                          shard: bool = True):
    """A trained role's model, loaded in `precision.master`, made ready to train: activation checkpointing
    if asked, then sharded with FSDP2's mixed precision policy in a distributed worker (unless shard=False),
    else its forward put under autocast to the compute dtype (when that is narrower than the masters)."""
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if shard and is_distributed():
        shard_model(model, fsdp_policy(precision))
    elif precision.mixed:
        autocast_forward(model, precision.compute)
    return model


def fsdp_policy(precision: Precision):
    """FSDP2's mixed precision policy for a sharded trained role (None: no casts)."""
    if not precision.mixed:
        return None
    # on use: a sharded run only; torch.distributed.fsdp adds about 0.4 s to every import of this module
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=precision.compute, reduce_dtype=torch.float32)


def compute_state_dict(state: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The weights the rollout engine and exports get: floating tensors cast to the compute dtype."""
    return {name: tensor.to(dtype) if tensor.is_floating_point() else tensor for name, tensor in state.items()}


def save_compute_copy(model: torch.nn.Module, folder: str, state: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
    """`model.save_pretrained(folder)` with `state` cast to `dtype`, and config.json saying so (so that
    transformers' and vLLM's `dtype=auto` load the copy as what it is)."""
    saved = getattr(model.config, "dtype", None)
    try:  # save_pretrained writes the live parameters' dtype into the config (and into model.config)
        model.save_pretrained(folder, state_dict=compute_state_dict(state, dtype))
    finally:
        model.config.dtype = saved
    config_file = Path(folder) / "config.json"
    config = json.loads(config_file.read_text())
    config["dtype"] = str(dtype).removeprefix("torch.")
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def parameter_change_ratio(parameters: list[torch.Tensor], before: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of squared changes, sum of squared parameters before the change) over `parameters` against their
    copies `before` (overwritten with the differences: no second copy is made). Sharded parameters (DTensors)
    count their local shards; the caller sums over ranks. Both are 0-d float32 tensors on the device."""
    local = [parameter.to_local() if hasattr(parameter, "to_local") else parameter for parameter in parameters]
    before = [copy.to_local() if hasattr(copy, "to_local") else copy for copy in before]
    size = _sum_of_squares(before)
    torch._foreach_sub_(before, [parameter.detach() for parameter in local])
    return _sum_of_squares(before), size


def _sum_of_squares(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack([norm.float() for norm in torch._foreach_norm(tensors)]).square().sum()
