"""flows.runtime.weights.on_storage on a run folder in tmp_path: the rollout engine gets the newest committed
weights at or before a version, and published weights load again, are pruned and are cast to the compute
dtype."""

from __future__ import annotations

import json

import pytest
import torch

from flows.runtime.weights.on_storage import StorageTransport
from storage import RunLayout


@pytest.fixture
def layout(tmp_path):
    return RunLayout(str(tmp_path), "r")


def _weights(tmp_path, committed=(), partial=()):
    for step in (*committed, *partial):
        (tmp_path / "r" / "weights" / "actor" / str(step)).mkdir(parents=True)
    for step in committed:
        (tmp_path / "r" / "weights" / "actor" / str(step) / "_COMMITTED").write_text("committed\n")


def test_the_engine_gets_the_newest_committed_weights_at_or_before_the_version(tmp_path, layout, recording_engine):
    _weights(tmp_path, committed=(0, 2), partial=(3,))  # 3: an upload still under way
    transport, engine = StorageTransport(layout), recording_engine()
    actor = tmp_path / "r" / "weights" / "actor"
    metrics = transport.sync_weights(engine, 3)
    assert engine.loaded == [str(actor / "2")] and engine.weights_version == 2
    assert list(metrics) == ["timing_s/weight_sync"] and metrics["timing_s/weight_sync"] >= 0
    assert transport.sync_weights(engine, 3) == {} and transport.sync_weights(engine, 2) == {}  # held already
    assert len(engine.loaded) == 1
    assert "timing_s/weight_sync" in transport.sync_weights(engine, 1)  # a resumed run: back to 0
    assert engine.loaded[-1] == str(actor / "0") and engine.weights_version == 0
    (actor / "3" / "_COMMITTED").write_text("committed\n")
    transport.sync_weights(engine, 7)
    assert engine.loaded[-1] == str(actor / "3") and engine.weights_version == 3 and len(engine.loaded) == 3


def test_without_committed_weights_the_engine_keeps_what_it_has(tmp_path, layout, recording_engine):
    _weights(tmp_path, partial=(0, 1))
    engine = recording_engine(version=None)
    assert StorageTransport(layout).sync_weights(engine, 1) == {}
    assert engine.loaded == [] and engine.weights_version is None


def test_published_weights_are_committed_load_again_and_are_pruned(tmp_path, layout, tiny_model):
    # on use: transformers is slow to import for the tests that need none
    from transformers import AutoModelForCausalLM

    transport = StorageTransport(layout, keep_weights=2)
    actor = tmp_path / "r" / "weights" / "actor"
    for version in range(4):
        assert transport.publish_weights(tiny_model, version, torch.float32) == str(actor / str(version))
    # After version 3 with keep 2: steps <= 1 go, except step 0 (2 and 3 are the newest two).
    assert layout.step_folders(str(actor)) == [0, 2, 3]
    assert (actor / "3" / "_COMMITTED").exists() and layout.latest_weights("actor") == (3, str(actor / "3"))
    loaded = AutoModelForCausalLM.from_pretrained(str(actor / "3"))
    original = tiny_model.state_dict()
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, original[name]), name


def test_published_weights_are_cast_to_the_compute_dtype_and_say_so(tmp_path, layout, tiny_model):
    # on use: transformers is slow to import for the tests that need none
    from transformers import AutoModelForCausalLM

    path = StorageTransport(layout, keep_weights=None).publish_weights(tiny_model, 1, torch.bfloat16)
    assert json.loads((tmp_path / "r" / "weights" / "actor" / "1" / "config.json").read_text())["dtype"] == "bfloat16"
    loaded = AutoModelForCausalLM.from_pretrained(path, dtype="auto")
    original = tiny_model.state_dict()
    assert next(loaded.parameters()).dtype == torch.bfloat16
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, original[name].to(torch.bfloat16)), name
    assert next(tiny_model.parameters()).dtype == torch.float32  # the masters stay as they were
