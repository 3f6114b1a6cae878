"""Checkpoints of a trainable role: weights, optimizer, schedule, update count and RNG state.

A role checkpoint is a Hugging Face folder (so it also loads as a model; with LoRA a peft adapter folder, the
base being the run's initial policy) plus `trainer_state.pt`,
written through storage.atomic_directory (temporary name, then rename, `_COMMITTED` last): a crash
or a full disk while writing leaves the previous checkpoint as it was. With a sharded (FSDP) role
every rank takes part in gathering the state and rank 0 writes it.

Taking the state (`role_state`) and writing it (`write_role_state`) are apart, so that a checkpoint can be
written in the background while the role trains on (flows/runtime/checkpoints.py): with `host_copy` the
state is copied off the live tensors into host memory first (tied tensors stay tied).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
from safetensors.torch import save_file

from components.distributed import full_state_dict, is_distributed, is_writer
from components.lora import ADAPTER_WEIGHTS, adapter_state_dict, is_lora
from components.training import Updater, make_optimizer
from storage import atomic_directory

TRAINER_STATE = "trainer_state.pt"


def _optimizer_state(updater: Updater) -> dict | None:
    if updater.optimizer is None:
        return None
    if not is_distributed():
        return updater.optimizer.state_dict()
    # on use: a sharded run only; torch.distributed.checkpoint adds about 0.4 s to every import of this module
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    return get_optimizer_state_dict(updater.model, updater.optimizer,
                                    options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def _map_tensors(value, function):
    """`value` (tensors in dicts, lists, tuples) with `function` applied to each tensor."""
    if isinstance(value, torch.Tensor):
        return function(value)
    if isinstance(value, dict):
        return {name: _map_tensors(item, function) for name, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_map_tensors(item, function) for item in value)
    return value


def _memory_key(tensor: torch.Tensor) -> tuple:
    return str(tensor.device), tensor.data_ptr(), tensor.dtype, tuple(tensor.shape), tensor.stride()


def _on_host(value, buffers: dict | None = None):
    """`value` with every tensor in it copied to host memory; tensors that share memory share their copy.
    A GPU tensor is copied into page-locked memory (a fast copy) taken from `buffers` (memory key -> host
    tensor) when given, so that the next copy of the same tensors reuses it; `buffers` is left holding
    the memory of this copy only."""
    copies: dict = {}
    on_gpu = False

    def copied(tensor):
        nonlocal on_gpu
        key = _memory_key(tensor)
        if key in copies:
            return copies[key]
        if tensor.device.type == "cpu":
            copies[key] = tensor.detach().clone()
            return copies[key]
        on_gpu = True
        buffer = buffers.get(key) if buffers is not None else None
        if buffer is None:
            buffer = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        copies[key] = buffer.copy_(tensor.detach(), non_blocking=True)
        return copies[key]

    copied_value = _map_tensors(value, copied)
    if on_gpu:
        torch.cuda.synchronize()  # the copies are done before the role's next update changes its tensors
    if buffers is not None:
        buffers.clear()
        buffers.update((key, tensor) for key, tensor in copies.items() if tensor.is_pinned())
    return copied_value


@dataclass
class RoleState:
    """A role's training state as a checkpoint holds it. `model` and `tokenizer` only give the folder its
    format (config, tokenizer files); the tensors are `weights` and `trainer_state`'s."""
    weights: dict[str, torch.Tensor]
    trainer_state: dict[str, Any]
    model: Any
    tokenizer: Any = None

    def nbytes(self) -> int:
        """Bytes of its tensors (each memory counted once)."""
        sizes: dict = {}
        _map_tensors((self.weights, self.trainer_state),
                     lambda tensor: sizes.setdefault(_memory_key(tensor), tensor.numel() * tensor.element_size()))
        return sum(sizes.values())


def role_state(model, updater: Updater, tokenizer=None, host_copy: bool = False,
               host_buffers: dict | None = None) -> RoleState | None:
    """The role's full training state now (a collective when sharded; None on the ranks that do not write).
    `host_copy`: copied into host memory, so that it stays as it is while the role trains on (a sharded
    role's is gathered into new host tensors anyway), into `host_buffers` (see _on_host) when given: the
    caller keeps them for its next copy once this one is written."""
    weights = adapter_state_dict(model) if is_lora(model) else full_state_dict(model)  # LoRA: the adapter alone
    optimizer = _optimizer_state(updater)
    if not is_writer():
        return None
    if host_copy and not is_distributed():
        weights, optimizer = _on_host((weights, optimizer), host_buffers)
    scheduler = updater.scheduler.state_dict() if updater.scheduler is not None else None
    return RoleState(weights, {"optimizer": optimizer, "scheduler": copy.deepcopy(scheduler),
                               "updates": updater.updates, "torch_rng": torch.get_rng_state()},
                     model, tokenizer)


def write_role_state(fs, path: str, state: RoleState) -> None:
    """Write a role's state to `path` (a folder on the run's filesystem), committed atomically."""
    with atomic_directory(fs, path) as local:
        if is_lora(state.model):  # a peft adapter folder (the base is the run's initial policy)
            state.model.peft_config["default"].save_pretrained(local)
            save_file(state.weights, f"{local}/{ADAPTER_WEIGHTS}", metadata={"format": "pt"})
        else:
            state.model.save_pretrained(local, state_dict=state.weights)
        if state.tokenizer is not None:
            state.tokenizer.save_pretrained(local)
        torch.save(state.trainer_state, f"{local}/{TRAINER_STATE}")


def save_role_checkpoint(fs, path: str, model, updater: Updater, tokenizer=None) -> None:
    """Write the role's full training state to `path` now (a folder on the run's filesystem)."""
    state = role_state(model, updater, tokenizer)
    if state is not None:
        write_role_state(fs, path, state)


def load_trainer_state(updater: Updater, local_path: str) -> None:
    """Restore optimizer, schedule, update count and RNG from a checkpoint folder (local path)."""
    # weights_only: tensors and plain containers only, so a planted trainer_state.pt cannot run code.
    state = torch.load(f"{local_path}/{TRAINER_STATE}", map_location="cpu", weights_only=True)
    updater.updates = state["updates"]
    torch.set_rng_state(state["torch_rng"])
    if state["optimizer"] is None:
        return
    updater.optimizer, updater.scheduler = make_optimizer(updater.model, updater.config.optim)
    if is_distributed():
        # on use: a sharded run only; torch.distributed.checkpoint adds about 0.4 s to every import of this module
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        set_optimizer_state_dict(updater.model, updater.optimizer, optim_state_dict=state["optimizer"],
                                 options=StateDictOptions(full_state_dict=True))
    else:
        updater.optimizer.load_state_dict(state["optimizer"])
    if state["scheduler"] is not None:
        updater.scheduler.load_state_dict(state["scheduler"])
