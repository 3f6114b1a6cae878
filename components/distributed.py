"""A trainable role (actor, critic) spread over several GPUs: FSDP2 ranks in one worker.

The role's worker starts one process per GPU. Rank 0 serves Prefect; before it runs a stage it
broadcasts the call to the other ranks, which run the same stage function in lockstep (every FSDP
forward/backward is a collective, so all ranks must make the same calls in the same order). Each
rank computes on its share of every mini-batch; parameters, gradients and optimizer states are
sharded (`fully_shard` per decoder layer, then the whole model). Only rank 0 writes files.
"""

from __future__ import annotations

import datetime
import os

import torch


def is_distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def rank() -> int:
    return torch.distributed.get_rank() if is_distributed() else 0


def world_size() -> int:
    return torch.distributed.get_world_size() if is_distributed() else 1


def is_writer() -> bool:
    """Whether this process writes stage outputs (the only process, or rank 0 of a sharded role)."""
    return rank() == 0


_COMMANDS = None  # a gloo group for stage calls: ranks may wait between stages far longer than NCCL allows


def init_from_environment() -> None:
    """Join the process group described by RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT."""
    global _COMMANDS
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    torch.distributed.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    _COMMANDS = torch.distributed.new_group(backend="gloo", timeout=datetime.timedelta(days=7))


def shard_model(model: torch.nn.Module, mp_policy=None) -> torch.nn.Module:
    """FSDP2: shard each decoder layer, then the rest (embeddings, head) as one unit; `mp_policy` (a
    MixedPrecisionPolicy) casts the gathered weights for compute and reduces gradients in its dtype."""
    # on use: a sharded run only; torch.distributed.fsdp adds about 0.4 s to every import of this module
    from torch.distributed.fsdp import fully_shard

    options = {} if mp_policy is None else {"mp_policy": mp_policy}
    backbone = getattr(model, "model", model)
    for layer in getattr(backbone, "layers", []):
        fully_shard(layer, **options)
    fully_shard(model, **options)
    return model


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The whole model's weights (on CPU when sharded); a collective: every rank must call it."""
    if not is_distributed():
        return model.state_dict()
    # on use: a sharded run only; torch.distributed.checkpoint adds about 0.4 s to every import of this module
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def local_rows(indices: torch.Tensor) -> torch.Tensor:
    """This rank's share of a mini-batch's row indices (all of them when not distributed)."""
    return indices[rank()::world_size()]


def broadcast_call(call: tuple | None) -> tuple | None:
    """Rank 0 sends (stage, args, kwargs) to the other ranks; the others receive it."""
    payload = [call]
    torch.distributed.broadcast_object_list(payload, src=0, group=_COMMANDS)
    return payload[0]


def scalar(value) -> float:
    """A float from a tensor that may be a DTensor (the grad norm of a sharded model)."""
    if hasattr(value, "full_tensor"):
        value = value.full_tensor()
    return float(value)
