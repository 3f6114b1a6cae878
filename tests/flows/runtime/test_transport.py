"""flows.runtime.transport on a run folder in tmp_path (batches: test_batches.py): under storage
sync the rollout engine gets the newest committed weights at or before a version, and published weights
load again and are pruned; under memory sync it gets the live model and only checkpoint and final
versions are stored, byte for byte as the storage path stores them."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file as safetensors_file

from components.weight_sync.versions import InMemoryWeights
from flows.config import build_config
from flows.runtime.transport import MemoryTransport, StorageTransport, StreamTransport, transport_for, weight_sync_mode
from storage import RunLayout


@pytest.fixture
def layout(tmp_path):
    return RunLayout(str(tmp_path), "r")


def test_the_runs_transport_is_under_its_folder_with_its_weight_budget_and_sync_mode(tmp_path):
    def config(**trainer):
        return build_config({"run": {"name": "r", "storage_root": str(tmp_path)},
                             "trainer": {"keep_weights": 4, **trainer}})

    workers = transport_for(config(execution="workers"))  # auto: streamed from the actor's worker
    assert type(workers) is StreamTransport and workers.keep_weights == 4 and weight_sync_mode(config()) == "memory"
    assert workers.layout.run_dir == str(tmp_path / "r") and [workers.streams(v) for v in (0, 1)] == [False, True]
    assert workers.timeout_s == 3600 and workers.connect_timeout_s == 300 and workers.bucket_bytes == 512 * 2**20
    local = transport_for(config())  # auto: the rollout engine is in the actor's process
    assert type(local) is MemoryTransport and not local.streams(1)
    assert local.keep_weights == 4 and [local.stored(v) for v in (1, 2)] == [True, True]  # checkpoint_every=1
    assert type(transport_for(config(weight_sync="storage"))) is StorageTransport
    assert type(transport_for(config(weight_sync="storage", execution="workers"))) is StorageTransport
    assert type(transport_for(config(weight_sync="memory", execution="workers"))) is StreamTransport


class _Engine:
    """A rollout engine (components.protocols.RolloutRole) that records what it loads; it never sleeps."""

    def __init__(self, version=None):
        self.weights_version, self.loaded = version, []
        self.last_metrics, self.asleep, self.weights_path = {}, False, None

    def generate(self, prompt_ids, params):
        raise NotImplementedError

    def close(self):
        pass

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


class _Receiver(_Engine):
    """An engine that also takes in-memory weights (records the version object it was given)."""

    def load_weights(self, source):
        self.loaded.append(source if isinstance(source, str) else ("memory", source.version))


def test_memory_sync_streams_the_live_model_and_stores_only_checkpoint_and_final_versions(tmp_path, tiny_model):
    config = build_config({"run": {"name": "r", "storage_root": str(tmp_path)},
                           "trainer": {"total_steps": 5, "checkpoint_every": 2, "keep_weights": 2}})
    transport, engine = transport_for(config), _Receiver()
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


def _committed_within(folder, seconds: float) -> bool:
    import time

    deadline = time.monotonic() + seconds
    while not (folder / "_COMMITTED").exists():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_a_stored_copy_is_made_after_its_version_reached_the_rollout(tmp_path, tiny_model):
    """The copy's snapshot would slow the hand-over down (GPU reads, host copies): it waits for the rollout to
    hold the version, then is written without anyone asking for it."""
    config = build_config({"run": {"name": "r", "storage_root": str(tmp_path)},
                           "trainer": {"total_steps": 5, "checkpoint_every": 2}})
    transport, engine = transport_for(config), _Receiver()
    folder = tmp_path / "r" / "weights" / "actor" / "2"
    assert transport.publish_weights(tiny_model, 2, torch.float32) == str(folder)
    assert not _committed_within(folder, 1.0)  # a tiny model's copy takes milliseconds: it is waiting
    transport.sync_weights(engine, 2)
    assert engine.loaded == [("memory", 2)] and _committed_within(folder, 30.0)
    # A version the rollout never gets (no validation after the last step) is made when the export asks.
    last = tmp_path / "r" / "weights" / "actor" / "4"
    transport.withdraw_weights()
    transport.publish_weights(tiny_model, 4, torch.float32)
    assert not _committed_within(last, 0.5)
    transport.flush()
    assert (last / "_COMMITTED").exists()


def test_memory_sync_reads_only_exactly_the_stored_version_once_the_model_moved_on(tmp_path, tiny_model):
    config = build_config({"run": {"name": "r", "storage_root": str(tmp_path)},
                           "trainer": {"total_steps": 9, "checkpoint_every": 3}})
    transport = transport_for(config)
    for version in (1, 2, 3):
        transport.publish_weights(tiny_model, version, torch.float32)
    transport.withdraw_weights()  # the update of step 3 begins
    engine = _Receiver()
    # A resumed run at checkpoint 3 (nothing in this process's memory): the stored copy of version 3.
    transport.sync_weights(engine, 3)
    assert engine.loaded == [str(tmp_path / "r" / "weights" / "actor" / "3")] and engine.weights_version == 3
    # Version 2 was never stored: an older copy would be the wrong policy, so it says so.
    with pytest.raises(RuntimeError, match="policy version 2 cannot reach the rollout: it is not in this process's "
                                           "memory, and it has no stored copy"):
        transport.sync_weights(_Receiver(), 2)
    assert transport.sync_weights(_Receiver(), 0) == {}  # the initial policy: the engine has it


def test_in_memory_weights_stop_being_readable_once_withdrawn(tiny_model):
    published = InMemoryWeights(tiny_model, torch.bfloat16, version=3)
    assert len(list(published.tensors())) == len(tiny_model.state_dict()) - 1  # the tied head once
    published.withdraw()
    with pytest.raises(RuntimeError, match="policy version 3 is no longer in memory"):
        published.tensors()


def test_memory_sync_reads_the_stored_copy_once_the_published_model_is_gone(tmp_path, tiny_model):
    """A run that failed released its actor (release_run); resumed in the same process, the rollout must get
    the version from storage, not from the dead model it was published from."""
    import copy
    import gc

    config = build_config({"run": {"name": "r", "storage_root": str(tmp_path)},
                           "trainer": {"total_steps": 4, "checkpoint_every": 1}})
    transport = transport_for(config)
    model = copy.deepcopy(tiny_model)
    transport.publish_weights(model, 1, torch.float32)
    transport.flush()
    del model
    gc.collect()
    engine = _Receiver()
    assert transport.sync_weights(engine, 1).keys() == {"timing_s/weight_sync"}
    assert engine.loaded == [str(tmp_path / "r" / "weights" / "actor" / "1")] and engine.weights_version == 1


@pytest.fixture(autouse=True)
def _fresh_sender():
    """Each test is a new actor's worker: no channel, no version served."""
    import flows.runtime.transport as transport_module

    yield
    if transport_module._SENDER is not None:
        transport_module._SENDER.close()
        transport_module._SENDER = None


def _streaming(tmp_path, **trainer):
    config = build_config({"run": {"name": "r", "storage_root": str(tmp_path)},
                           "trainer": {"execution": "workers", "total_steps": 9, "checkpoint_every": 3, **trainer}})
    transport = transport_for(config)
    transport.connect_timeout_s = 10.0
    return transport


def _send_in_background(transport, model, version, sync, holds=True):
    """The actor's worker: send_weights on a thread of this process (the receiver joins its group as rank 1)."""
    import threading

    result: dict = {}
    thread = threading.Thread(target=lambda: result.update(transport.send_weights(
        model, version, torch.float32, sync, holds=holds)), daemon=True)
    thread.start()
    return thread, result


def _engine_of(model):
    import copy

    from components.rollout import HFRolloutEngine

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


def test_a_streamed_versions_stored_copy_is_made_once_the_sender_is_done(tmp_path, tiny_model):
    transport = _streaming(tmp_path)
    folder = tmp_path / "r" / "weights" / "actor" / "3"
    transport.publish_weights(tiny_model, 3, torch.float32)  # checkpoint step 3: a stored copy is due
    assert not _committed_within(folder, 1.0)
    engine = _engine_of(tiny_model)
    thread, sent = _send_in_background(transport, tiny_model, 3, "rollout-3-x")
    transport.sync_weights(engine, 3, "rollout-3-x")
    thread.join(timeout=30)
    assert not thread.is_alive() and sent["weights/streams"] == 1.0
    assert _committed_within(folder, 30.0)
    copied = safetensors_file(folder / "model.safetensors")
    assert copied and all(torch.equal(copied[name], tiny_model.state_dict()[name]) for name in copied)


def _claim(transport, version: int, pid: int, host: str | None = None) -> None:
    """What a process writing the stored copy of `version` in the background leaves (MemoryTransport.publish_weights)."""
    import socket

    path = transport.writer_path(version)
    transport.layout.fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
    transport.layout.fs.pipe_file(path, json.dumps({"host": host or socket.gethostname(), "pid": pid}).encode())


def test_a_stored_copy_being_written_is_waited_for_only_while_its_writer_lives(tmp_path, tiny_model, monkeypatch):
    """The rollout (or the driver's export) waits for a copy that the actor's worker writes in the background; an
    actor that died before committing it will never do so: the wait ends at once, saying why, instead of after
    STORED_COPY_WAIT_S (which had held a run for 300 s, then the stage timeout)."""
    import subprocess
    import sys
    import threading
    import time

    from flows.runtime import stored_copy as module

    reader = StorageTransport(RunLayout(str(tmp_path), "r"))
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    _claim(reader, 3, dead.pid)
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=rf"policy version 3 has no stored copy under .*/r/weights/actor/3, and the "
                                           rf"process that was writing it \(pid {dead.pid}\) has ended"):
        reader.committed_copy(3, timeout_s=300)
    assert time.monotonic() - started < 5

    # A live writer is waited for, and its copy taken once committed.
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        _claim(reader, 4, live.pid)
        writer = StorageTransport(RunLayout(str(tmp_path), "r"))
        committing = threading.Timer(1.0, lambda: writer.publish_weights(tiny_model, 4, torch.float32))
        committing.start()
        assert reader.committed_copy(4, timeout_s=300) == str(tmp_path / "r" / "weights" / "actor" / "4")
        committing.join()
    finally:
        live.kill()
        live.wait()

    # Nobody claimed it: waited for UNCLAIMED_COPY_WAIT_S, not STORED_COPY_WAIT_S.
    monkeypatch.setattr(module, "UNCLAIMED_COPY_WAIT_S", 0.5)
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=r"policy version 5 has no stored copy under .*, and no process is writing it"):
        reader.committed_copy(5, timeout_s=300)
    assert 0.5 <= time.monotonic() - started < 5

    # A writer on another host cannot be looked at: the wait is bounded by the timeout alone.
    _claim(reader, 6, dead.pid, host="another-host")
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=r"policy version 6 has no stored copy under .*/6$"):
        reader.committed_copy(6, timeout_s=1.0)
    assert time.monotonic() - started >= 1.0


def test_a_process_claims_the_stored_copy_it_writes_until_it_is_committed(tmp_path, tiny_model):
    import os
    import socket

    config = build_config({"run": {"name": "r", "storage_root": str(tmp_path)},
                           "trainer": {"total_steps": 5, "checkpoint_every": 2}})
    transport = transport_for(config)
    claim = tmp_path / "r" / "weights" / "actor" / "2.writer.json"
    transport.publish_weights(tiny_model, 1, torch.float32)  # no copy due
    assert not (tmp_path / "r" / "weights" / "actor" / "1.writer.json").exists()
    transport.publish_weights(tiny_model, 2, torch.float32)  # due: written after the hand-over
    assert json.loads(claim.read_text()) == {"host": socket.gethostname(), "pid": os.getpid()}
    transport.flush()
    assert (tmp_path / "r" / "weights" / "actor" / "2" / "_COMMITTED").exists() and not claim.exists()
    assert RunLayout(str(tmp_path), "r").step_folders(str(tmp_path / "r" / "weights" / "actor")) == [2]
