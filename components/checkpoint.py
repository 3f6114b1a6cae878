"""Checkpoints of a trainable role: weights, optimizer, schedule, update count and RNG state.

A role checkpoint is a Hugging Face folder (so it also loads as a model) plus `trainer_state.pt`,
written through storage.atomic_directory (temporary name, then rename, `_COMMITTED` last): a crash
or a full disk while writing leaves the previous checkpoint as it was. With a sharded (FSDP) role
every rank takes part in gathering the state and rank 0 writes it.
"""

from __future__ import annotations

import torch

from components.distributed import full_state_dict, is_distributed, is_writer
from components.training import Updater, make_optimizer
from storage import atomic_directory

TRAINER_STATE = "trainer_state.pt"


def _optimizer_state(updater: Updater) -> dict | None:
    if updater.optimizer is None:
        return None
    if not is_distributed():
        return updater.optimizer.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    return get_optimizer_state_dict(updater.model, updater.optimizer,
                                    options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def save_role_checkpoint(fs, path: str, model, updater: Updater, tokenizer=None) -> None:
    """Write the role's full training state to `path` (a folder on the run's filesystem)."""
    weights = full_state_dict(model)
    optimizer = _optimizer_state(updater)
    if not is_writer():
        return
    with atomic_directory(fs, path) as local:
        model.save_pretrained(local, state_dict=weights)
        if tokenizer is not None:
            tokenizer.save_pretrained(local)
        torch.save({"optimizer": optimizer,
                    "scheduler": updater.scheduler.state_dict() if updater.scheduler is not None else None,
                    "updates": updater.updates, "torch_rng": torch.get_rng_state()},
                   f"{local}/{TRAINER_STATE}")


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
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        set_optimizer_state_dict(updater.model, updater.optimizer, optim_state_dict=state["optimizer"],
                                 options=StateDictOptions(full_state_dict=True))
    else:
        updater.optimizer.load_state_dict(state["optimizer"])
    if state["scheduler"] is not None:
        updater.scheduler.load_state_dict(state["scheduler"])
