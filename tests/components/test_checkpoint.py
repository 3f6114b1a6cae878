"""Role checkpoints: an exact round trip of the training state, a state taken now and written after the role
trained on (the background checkpoint) that holds what it held when taken, and a full disk that leaves the
previous checkpoint usable."""

import errno
import os

import fsspec
import pytest
import torch

from components.actor import Actor
from components.batch import build_sequence_batch
from components.checkpoint import load_trainer_state, role_state, save_role_checkpoint, write_role_state
from components.actor import ActorConfig


def _update(actor):
    batch = build_sequence_batch([[1, 2], [3], [4, 5], [6]], [[7, 8], [9], [10], [11, 12]], 0)
    logprobs, _ = actor.compute_logprobs(batch)
    actor.update(batch, old_logprobs=logprobs, advantages=torch.ones_like(logprobs))


def _trained_actor(model_path):
    actor = Actor.from_pretrained(model_path, ActorConfig(ppo_mini_batch_size=4, micro_batch_size=2), device="cpu")
    _update(actor)
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


def test_a_state_taken_before_an_update_and_written_after_it_is_the_state_before(model_path, tmp_path):
    """trainer.checkpoint_async: the host copy taken at the checkpoint is what is written, byte for byte as a
    checkpoint written at once would be, though the role updated its weights and AdamW state in between."""
    actor = _trained_actor(model_path)
    fs = fsspec.filesystem("file")
    save_role_checkpoint(fs, str(tmp_path / "at-once"), actor.model, actor.updater)
    weights = {name: tensor.clone() for name, tensor in actor.model.state_dict().items()}
    state = role_state(actor.model, actor.updater, host_copy=True)
    # weights and AdamW's two moments (the tied embedding counted once), the step counters, the RNG state
    parameters = sum(p.numel() * p.element_size() for p in actor.model.parameters())
    steps = sum(state["step"].numel() * state["step"].element_size() for state in actor.updater.optimizer.state.values())
    assert state.nbytes() == 3 * parameters + steps + torch.get_rng_state().numel()
    _update(actor)
    assert not torch.equal(actor.model.state_dict()["model.norm.weight"], weights["model.norm.weight"])
    write_role_state(fs, str(tmp_path / "later"), state)
    for name in ("model.safetensors", "config.json"):
        assert (tmp_path / "later" / name).read_bytes() == (tmp_path / "at-once" / name).read_bytes(), name
    restored = Actor.from_pretrained(str(tmp_path / "later"), actor.config, device="cpu")
    load_trainer_state(restored.updater, str(tmp_path / "later"))
    assert restored.updater.updates == 1 and actor.updater.updates == 2
    for name, tensor in restored.model.state_dict().items():
        assert torch.equal(tensor, weights[name]), name
    first = torch.load(tmp_path / "at-once" / "trainer_state.pt", weights_only=True)["optimizer"]["state"]
    later = restored.updater.optimizer.state_dict()["state"]
    for key in first:
        assert torch.equal(first[key]["exp_avg_sq"], later[key]["exp_avg_sq"]), key


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (page-locked host copies)")
def test_a_gpu_role_is_copied_into_page_locked_memory_that_its_next_copy_reuses(model_path):
    actor = Actor.from_pretrained(model_path, ActorConfig(ppo_mini_batch_size=4, micro_batch_size=2), device="cuda")
    _update(actor)
    buffers: dict = {}
    first = role_state(actor.model, actor.updater, host_copy=True, host_buffers=buffers)
    norm = first.weights["model.norm.weight"]
    assert norm.is_pinned() and torch.equal(norm, actor.model.state_dict()["model.norm.weight"].cpu())
    memory = {tensor.data_ptr() for tensor in buffers.values()}
    held = sum(tensor.numel() * tensor.element_size() for tensor in buffers.values())
    on_cpu = torch.get_rng_state().numel() + sum(  # the RNG state, and AdamW's step counters unless fused
        state["step"].numel() * state["step"].element_size() for state in actor.updater.optimizer.state.values()
        if state["step"].device.type == "cpu")
    assert held == first.nbytes() - on_cpu > 0  # every GPU tensor's copy is in buffers, once
    del first
    _update(actor)
    second = role_state(actor.model, actor.updater, host_copy=True, host_buffers=buffers)
    assert {tensor.data_ptr() for tensor in buffers.values()} == memory  # the same host memory, new values
    assert torch.equal(second.weights["model.norm.weight"], actor.model.state_dict()["model.norm.weight"].cpu())
    assert second.weights["model.norm.weight"].data_ptr() == norm.data_ptr()
    assert second.trainer_state["updates"] == 2


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
