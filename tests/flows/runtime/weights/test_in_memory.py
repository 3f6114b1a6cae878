"""flows.runtime.weights.in_memory on a run folder in tmp_path: the rollout engine gets the live model, and
only checkpoint and final versions are stored, in the background once the rollout holds them, byte for byte
as the storage path stores them."""

from __future__ import annotations

import copy
import gc

import pytest
import torch

from components.weight_sync.versions import InMemoryWeights
from flows.config import build_config
from flows.runtime.weights import transport_for
from flows.runtime.weights.on_storage import StorageTransport
from storage import RunLayout


def test_memory_sync_streams_the_live_model_and_stores_only_checkpoint_and_final_versions(tmp_path, tiny_model,
                                                                                          recording_engine):
    config = build_config({"run": {"name": "r", "storage_root": str(tmp_path)},
                           "trainer": {"total_steps": 5, "checkpoint_every": 2, "keep_weights": 2}})
    transport, engine = transport_for(config), recording_engine()
    actor = tmp_path / "r" / "weights" / "actor"
    for version in range(1, 6):
        transport.withdraw_weights()  # update_actor, before the update
        path = transport.publish_weights(tiny_model, version, torch.bfloat16)
        stored = version in (2, 4, 5)
        assert path == (str(actor / str(version)) if stored else f"memory://{actor / str(version)}")
        assert transport.sync_weights(engine, version).keys() == {"timing_s/weight_sync"}
        assert engine.loaded[-1] == ("memory", version) and engine.weights_version == version
        assert transport.sync_weights(engine, version) == {}  # held already
    transport.flush()
    # 2 and 4: a checkpoint starts there; 5: the last (export); none of 1 and 3. keep_weights=2 prunes 2
    # only when no checkpoint refers to it any more (none was written here).
    assert RunLayout(str(tmp_path), "r").step_folders(str(actor)) == [4, 5]
    assert (actor / "5" / "_COMMITTED").exists()
    # What the storage path would have written for the same model: the same bytes.
    reference = StorageTransport(RunLayout(str(tmp_path), "reference")).publish_weights(tiny_model, 5, torch.bfloat16)
    for name in ("model.safetensors", "config.json"):
        assert (actor / "5" / name).read_bytes() == (tmp_path / "reference" / "weights" / "actor" / "5" / name).read_bytes()
    assert reference


def test_a_stored_copy_is_made_after_its_version_reached_the_rollout(tmp_path, tiny_model, recording_engine,
                                                                     committed_within):
    """The copy's snapshot would slow the hand-over down (GPU reads, host copies): it waits for the rollout to
    hold the version, then is written without anyone asking for it."""
    config = build_config({"run": {"name": "r", "storage_root": str(tmp_path)},
                           "trainer": {"total_steps": 5, "checkpoint_every": 2}})
    transport, engine = transport_for(config), recording_engine()
    folder = tmp_path / "r" / "weights" / "actor" / "2"
    assert transport.publish_weights(tiny_model, 2, torch.float32) == str(folder)
    assert not committed_within(folder, 1.0)  # a tiny model's copy takes milliseconds: it is waiting
    transport.sync_weights(engine, 2)
    assert engine.loaded == [("memory", 2)] and committed_within(folder, 30.0)
    # A version the rollout never gets (no validation after the last step) is made when the export asks.
    last = tmp_path / "r" / "weights" / "actor" / "4"
    transport.withdraw_weights()
    transport.publish_weights(tiny_model, 4, torch.float32)
    assert not committed_within(last, 0.5)
    transport.flush()
    assert (last / "_COMMITTED").exists()


def test_memory_sync_reads_only_exactly_the_stored_version_once_the_model_moved_on(tmp_path, tiny_model,
                                                                                   recording_engine):
    config = build_config({"run": {"name": "r", "storage_root": str(tmp_path)},
                           "trainer": {"total_steps": 9, "checkpoint_every": 3}})
    transport = transport_for(config)
    for version in (1, 2, 3):
        transport.publish_weights(tiny_model, version, torch.float32)
    transport.withdraw_weights()  # the update of step 3 begins
    engine = recording_engine()
    # A resumed run at checkpoint 3 (nothing in this process's memory): the stored copy of version 3.
    transport.sync_weights(engine, 3)
    assert engine.loaded == [str(tmp_path / "r" / "weights" / "actor" / "3")] and engine.weights_version == 3
    # Version 2 was never stored: an older copy would be the wrong policy, so it says so.
    with pytest.raises(RuntimeError, match="policy version 2 cannot reach the rollout: it is not in this process's "
                                           "memory, and it has no stored copy"):
        transport.sync_weights(recording_engine(), 2)
    assert transport.sync_weights(recording_engine(), 0) == {}  # the initial policy: the engine has it


def test_in_memory_weights_stop_being_readable_once_withdrawn(tiny_model):
    published = InMemoryWeights(tiny_model, torch.bfloat16, version=3)
    assert len(list(published.tensors())) == len(tiny_model.state_dict()) - 1  # the tied head once
    published.withdraw()
    with pytest.raises(RuntimeError, match="policy version 3 is no longer in memory"):
        published.tensors()


def test_memory_sync_reads_the_stored_copy_once_the_published_model_is_gone(tmp_path, tiny_model, recording_engine):
    """A run that failed released its actor (release_run); resumed in the same process, the rollout must get
    the version from storage, not from the dead model it was published from."""
    config = build_config({"run": {"name": "r", "storage_root": str(tmp_path)},
                           "trainer": {"total_steps": 4, "checkpoint_every": 1}})
    transport = transport_for(config)
    model = copy.deepcopy(tiny_model)
    transport.publish_weights(model, 1, torch.float32)
    transport.flush()
    del model
    gc.collect()
    engine = recording_engine()
    assert transport.sync_weights(engine, 1).keys() == {"timing_s/weight_sync"}
    assert engine.loaded == [str(tmp_path / "r" / "weights" / "actor" / "1")] and engine.weights_version == 1
