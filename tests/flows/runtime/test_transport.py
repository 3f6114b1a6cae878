"""flows.runtime.transport.StorageTransport on a run folder in tmp_path: batches round-trip as stage files,
the rollout engine gets the newest committed weights at or before a version, and published weights load
again and are pruned."""

from __future__ import annotations

import json

import pytest
import torch

from flows.config import build_config
from flows.runtime.transport import StorageTransport, transport_for
from storage import RunLayout, StorageFileError


@pytest.fixture
def layout(tmp_path):
    return RunLayout(str(tmp_path), "r")


def test_a_batch_written_reads_back_checked_against_the_rollouts_samples(tmp_path, layout):
    transport = StorageTransport(layout)
    path = transport.write_batch(2, "reward", {"uid": ["s2-0", "s2-1", "s2-2"], "score": [0.5, -1.0, 0.25]})
    assert path == str(tmp_path / "r" / "steps" / "2" / "reward.parquet")
    table = transport.read_batch(2, "reward")
    assert table.column_names == ["uid", "score"]
    assert table.column("uid").to_pylist() == ["s2-0", "s2-1", "s2-2"]
    assert table.column("score").to_pylist() == [0.5, -1.0, 0.25]  # exact in float32
    assert transport.read_batch(2, "reward", expected_uids=["s2-0", "s2-1", "s2-2"]).num_rows == 3
    with pytest.raises(StorageFileError, match="1 of 3 uids differ from the expected order; first at row 2"):
        transport.read_batch(2, "reward", expected_uids=["s2-0", "s2-1", "s2-9"])
    with pytest.raises(StorageFileError, match="has 3 rows, expected 2"):
        transport.read_batch(2, "reward", expected_uids=["s2-0", "s2-1"])
    with pytest.raises(StorageFileError, match="stage file not found"):
        transport.read_batch(3, "reward")


def test_the_runs_transport_is_storage_under_its_folder_with_its_weight_budget(tmp_path):
    config = build_config({"run": {"name": "r", "storage_root": str(tmp_path)}, "trainer": {"keep_weights": 4}})
    transport = transport_for(config)
    assert isinstance(transport, StorageTransport) and transport.keep_weights == 4
    assert transport.layout.run_dir == str(tmp_path / "r")


class _Engine:
    """What sync_weights needs of a rollout engine: the version it holds and load_weights."""

    def __init__(self, version=None):
        self.weights_version, self.loaded = version, []

    def load_weights(self, path):
        self.loaded.append(path)


def _weights(tmp_path, committed=(), partial=()):
    for step in (*committed, *partial):
        (tmp_path / "r" / "weights" / "actor" / str(step)).mkdir(parents=True)
    for step in committed:
        (tmp_path / "r" / "weights" / "actor" / str(step) / "_COMMITTED").write_text("committed\n")


def test_the_engine_gets_the_newest_committed_weights_at_or_before_the_version(tmp_path, layout):
    _weights(tmp_path, committed=(0, 2), partial=(3,))  # 3: an upload still under way
    transport, engine = StorageTransport(layout), _Engine()
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


def test_without_committed_weights_the_engine_keeps_what_it_has(tmp_path, layout):
    _weights(tmp_path, partial=(0, 1))
    engine = _Engine(version=None)
    assert StorageTransport(layout).sync_weights(engine, 1) == {}
    assert engine.loaded == [] and engine.weights_version is None


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    from components.tiny import build_tiny_model

    return AutoModelForCausalLM.from_pretrained(build_tiny_model(tmp_path_factory.mktemp("model") / "tiny"))


def test_published_weights_are_committed_load_again_and_are_pruned(tmp_path, layout, tiny_model):
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
    from transformers import AutoModelForCausalLM

    path = StorageTransport(layout, keep_weights=None).publish_weights(tiny_model, 1, torch.bfloat16)
    assert json.loads((tmp_path / "r" / "weights" / "actor" / "1" / "config.json").read_text())["dtype"] == "bfloat16"
    loaded = AutoModelForCausalLM.from_pretrained(path, dtype="auto")
    original = tiny_model.state_dict()
    assert next(loaded.parameters()).dtype == torch.bfloat16
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, original[name].to(torch.bfloat16)), name
    assert next(tiny_model.parameters()).dtype == torch.float32  # the masters stay as they were
