"""Role checkpoints: an exact round trip of the training state, and a full disk that leaves the
previous checkpoint usable."""

import errno
import os

import fsspec
import pytest
import torch

from components.actor import Actor
from components.batch import build_sequence_batch
from components.checkpoint import load_trainer_state, save_role_checkpoint
from components.actor import ActorConfig


def _trained_actor(model_path):
    actor = Actor.from_pretrained(model_path, ActorConfig(ppo_mini_batch_size=4, micro_batch_size=2), device="cpu")
    batch = build_sequence_batch([[1, 2], [3], [4, 5], [6]], [[7, 8], [9], [10], [11, 12]], 0)
    logprobs, _ = actor.compute_logprobs(batch)
    actor.update(batch, old_logprobs=logprobs, advantages=torch.ones_like(logprobs))
    return actor


def test_checkpoint_round_trip_restores_weights_optimizer_and_update_count(model_path, tmp_path):
    actor = _trained_actor(model_path)
    fs = fsspec.filesystem("file")
    save_role_checkpoint(fs, str(tmp_path / "ckpt"), actor.model, actor.updater)
    restored = Actor.from_pretrained(str(tmp_path / "ckpt"), actor.config, device="cpu")
    load_trainer_state(restored.updater, str(tmp_path / "ckpt"))
    for name, tensor in actor.model.state_dict().items():
        assert torch.equal(tensor, restored.model.state_dict()[name]), name
    assert restored.updater.updates == 1
    saved = actor.updater.optimizer.state_dict()["state"]
    loaded = restored.updater.optimizer.state_dict()["state"]
    assert saved.keys() == loaded.keys()
    for key in saved:
        assert torch.equal(saved[key]["exp_avg"], loaded[key]["exp_avg"])
        assert torch.equal(saved[key]["exp_avg_sq"], loaded[key]["exp_avg_sq"])


def test_a_full_disk_while_checkpointing_leaves_the_previous_checkpoint(model_path, tmp_path, monkeypatch):
    actor = _trained_actor(model_path)
    fs = fsspec.filesystem("file")
    target = tmp_path / "ckpt"
    save_role_checkpoint(fs, str(target), actor.model, actor.updater)
    before = {path.name: path.read_bytes() for path in target.iterdir()}

    def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", disk_full)
    with pytest.raises(OSError, match="No space left"):
        save_role_checkpoint(fs, str(target), actor.model, actor.updater)
    after = {path.name: path.read_bytes() for path in target.iterdir()}
    assert after == before  # untouched, marker included
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]  # no half-written sibling left behind


class _Payload:
    """Unpickling this runs code: it would create the marker file."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_a_planted_trainer_state_does_not_run_code_on_load(model_path, tmp_path):
    """trainer_state.pt loads with weights_only=True: tensors and plain containers, never code (issue 20)."""
    import pickle

    from components.checkpoint import TRAINER_STATE, load_trainer_state

    actor = Actor.from_pretrained(model_path, ActorConfig(ppo_mini_batch_size=4, micro_batch_size=2), device="cpu")
    marker = tmp_path / "executed"
    torch.save({"updates": _Payload(str(marker))}, tmp_path / TRAINER_STATE)
    with pytest.raises(pickle.UnpicklingError):
        load_trainer_state(actor.updater, str(tmp_path))
    assert not marker.exists()
