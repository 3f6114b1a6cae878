"""flows.runtime.weights.streamed on a run folder in tmp_path, the actor's worker a thread of this process:
the rollout engine gets the actor's live weights through its channel, the sender ends with the receiver, a
replaced actor's version comes from its stored copy (or the stage says to resume), and a streamed version's
stored copy is made once the sender is done."""

from __future__ import annotations

import copy
import threading

import pytest
import torch
from safetensors.torch import load_file as safetensors_file

from components.rollout import HFRolloutEngine
from flows.config import build_config
from flows.runtime.weights import streamed, transport_for
from flows.runtime.weights.on_storage import StorageTransport


@pytest.fixture(autouse=True)
def _fresh_sender():
    """Each test is a new actor's worker: no channel, no version served."""
    yield
    if streamed._SENDER is not None:
        streamed._SENDER.close()
        streamed._SENDER = None


def _streaming(tmp_path, **trainer):
    config = build_config({"run": {"name": "r", "storage_root": str(tmp_path)},
                           "trainer": {"execution": "workers", "total_steps": 9, "checkpoint_every": 3, **trainer}})
    transport = transport_for(config)
    transport.connect_timeout_s = 10.0
    return transport


def _send_in_background(transport, model, version, sync, holds=True):
    """The actor's worker: send_weights on a thread of this process (the receiver joins its group as rank 1)."""
    result: dict = {}
    thread = threading.Thread(target=lambda: result.update(transport.send_weights(
        model, version, torch.float32, sync, holds=holds)), daemon=True)
    thread.start()
    return thread, result


def _engine_of(model):
    engine = HFRolloutEngine(copy.deepcopy(model), tokenizer=None)
    with torch.no_grad():
        for parameter in engine.model.parameters():
            parameter.zero_()
    return engine


def test_streamed_sync_gives_the_engine_the_actors_live_weights_and_ends_the_sender(tmp_path, tiny_model):
    transport = _streaming(tmp_path)
    transport.publish_weights(tiny_model, 2, torch.float32)  # not a checkpoint step: nothing stored
    assert (tmp_path / "r" / "weights" / "actor" / "channel.json").exists()
    engine = _engine_of(tiny_model)
    thread, sent = _send_in_background(transport, tiny_model, 2, "rollout-2-x")
    metrics = transport.sync_weights(engine, 2, "rollout-2-x")
    thread.join(timeout=30)
    assert not thread.is_alive() and sent["weights/streams"] == 1.0
    assert metrics.keys() == {"timing_s/weight_sync", "timing_s/weight_wait"} and engine.weights_version == 2
    original = tiny_model.state_dict()
    assert all(torch.equal(tensor, original[name]) for name, tensor in engine.model.state_dict().items())
    assert not (tmp_path / "r" / "weights" / "actor" / "2").exists()
    # Held already: no stream, and the sender of this sync still ends (the receiver's word).
    thread, sent = _send_in_background(transport, tiny_model, 2, "validate-2-y")
    assert transport.sync_weights(engine, 2, "validate-2-y") == {}
    thread.join(timeout=30)
    assert not thread.is_alive() and sent["weights/streams"] == 0.0


def test_streamed_sync_reads_the_stored_copy_of_exactly_the_version_when_the_actor_holds_another(tmp_path, tiny_model):
    transport = _streaming(tmp_path)
    StorageTransport(transport.layout).publish_weights(tiny_model, 3, torch.float32)  # checkpoint step 3's copy
    engine = _engine_of(tiny_model)
    thread, sent = _send_in_background(transport, tiny_model, 3, "rollout-3-x", holds=False)  # a replaced actor
    metrics = transport.sync_weights(engine, 3, "rollout-3-x")
    thread.join(timeout=30)
    assert metrics["weights/stream_fallback"] == 1.0 and engine.weights_version == 3 and sent["weights/streams"] == 0
    original = tiny_model.state_dict()
    assert all(torch.equal(tensor, original[name]) for name, tensor in engine.model.state_dict().items())
    # Version 4 was never stored: the stage fails with what to do.
    thread, _ = _send_in_background(transport, tiny_model, 4, "rollout-4-x", holds=False)
    with pytest.raises(RuntimeError, match=r"policy version 4 cannot reach the rollout: the actor's worker holds "
                                           r"policy version None, not 4, and it has no stored copy .*"
                                           r"trainer.checkpoint_every=3\); `rlhf resume r` restarts"):
        transport.sync_weights(_engine_of(tiny_model), 4, "rollout-4-x")
    thread.join(timeout=30)
    assert not thread.is_alive()


def test_a_streamed_versions_stored_copy_is_made_once_the_sender_is_done(tmp_path, tiny_model, committed_within):
    transport = _streaming(tmp_path)
    folder = tmp_path / "r" / "weights" / "actor" / "3"
    transport.publish_weights(tiny_model, 3, torch.float32)  # checkpoint step 3: a stored copy is due
    assert not committed_within(folder, 1.0)
    engine = _engine_of(tiny_model)
    thread, sent = _send_in_background(transport, tiny_model, 3, "rollout-3-x")
    transport.sync_weights(engine, 3, "rollout-3-x")
    thread.join(timeout=30)
    assert not thread.is_alive() and sent["weights/streams"] == 1.0
    assert committed_within(folder, 30.0)
    copied = safetensors_file(folder / "model.safetensors")
    assert copied and all(torch.equal(copied[name], tiny_model.state_dict()[name]) for name in copied)
