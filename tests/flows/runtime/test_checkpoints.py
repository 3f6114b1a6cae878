"""Checkpoints written in the background (flows/runtime/checkpoints.py, trainer.checkpoint_async) on a tiny actor
in tmp_path: the part holds the state of the checkpoint's step though the actor trains on before it is written,
the driver commits the checkpoint only once every part is committed, and a part that fails or whose writer
died fails the step with what happened instead of leaving a checkpoint with a hole."""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import threading

import pytest
import torch

from components.actor import Actor, ActorConfig
from components.batch import build_sequence_batch
from components.checkpoint import role_state
from components.tiny import TinyModelSpec, build_tiny_model
from flows.config import build_config, layout_for
from flows.runtime import checkpoints
from flows.runtime.checkpoints import finish_writing, in_background, part_path, save_role_part, wait_written
from flows.runtime.driver import RunState
from flows.runtime.recovery import checkpoint_committed, latest_checkpoint


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    spec = TinyModelSpec(hidden_size=64, num_attention_heads=1, num_key_value_heads=1, intermediate_size=128,
                         num_hidden_layers=1)
    return str(build_tiny_model(tmp_path_factory.mktemp("tiny-model"), spec))


def _actor(model_path):
    return Actor.from_pretrained(model_path, ActorConfig(ppo_mini_batch_size=4, micro_batch_size=2), device="cpu")


def _update(actor):
    batch = build_sequence_batch([[1, 2], [3], [4, 5], [6]], [[7, 8], [9], [10], [11, 12]], 0)
    logprobs, _ = actor.compute_logprobs(batch)
    actor.update(batch, old_logprobs=logprobs, advantages=torch.ones_like(logprobs))


def _config(tmp_path, *overrides):
    return build_config({}, [f"run.storage_root={tmp_path / 'runs'}", "run.name=r", "trainer.total_steps=4",
                             "trainer.weight_sync=storage", *overrides])


class _Gate:
    """Holds the writing of every part until opened; then writes it, or fails it as a full disk would."""

    def __init__(self, monkeypatch, fail: bool = False):
        self.open, self.fail, self.write = threading.Event(), fail, checkpoints.write_role_state
        monkeypatch.setattr(checkpoints, "write_role_state", self)

    def __call__(self, *args, **kwargs):
        assert self.open.wait(60)
        if self.fail:
            raise OSError(errno.ENOSPC, "No space left on device")
        return self.write(*args, **kwargs)


def test_which_checkpoints_are_written_in_the_background(tmp_path):
    config = _config(tmp_path)
    assert [in_background(config, step) for step in (1, 3, 4)] == [True, True, False]  # the last: at once
    assert not in_background(_config(tmp_path, "trainer.checkpoint_async=false"), 1)


def test_a_part_holds_its_step_state_though_the_actor_trains_on_and_the_driver_commits_it_once_written(
        model_path, tmp_path, monkeypatch):
    config = _config(tmp_path)
    layout = layout_for(config)
    actor, gate = _actor(model_path), _Gate(monkeypatch)
    _update(actor)
    before = {name: tensor.clone() for name, tensor in actor.model.state_dict().items()}
    moments = {key: state["exp_avg_sq"].clone() for key, state in actor.updater.optimizer.state_dict()["state"].items()}
    driver = RunState(config, tracker=None, kl_controller=None, artifacts=None)
    driver.unsettled = (1, ["actor"], {"kl_controller": {"value": 0.1}})
    metrics = save_role_part(config, 1, "actor", actor)
    assert set(metrics) == {"timing_s/checkpoint_actor", "checkpoint/actor_host_gib"}
    claim = json.loads(open(f"{part_path(layout, 1, 'actor')}.writer.json").read())
    assert claim["pid"] == os.getpid()
    _update(actor)  # the next step's update, while the part is being written
    assert not checkpoint_committed(layout, 1)
    gate.open.set()
    assert driver.settle_checkpoint().keys() == {"timing_s/checkpoint_wait"}
    assert checkpoint_committed(layout, 1) and latest_checkpoint(layout) == 1
    assert not os.path.exists(f"{part_path(layout, 1, 'actor')}.writer.json")  # released
    written = Actor.from_pretrained(part_path(layout, 1, "actor"), actor.config, device="cpu")
    for name, tensor in written.model.state_dict().items():
        assert torch.equal(tensor, before[name]), name
    assert not torch.equal(actor.model.state_dict()["model.norm.weight"], before["model.norm.weight"])
    written_moments = torch.load(f"{part_path(layout, 1, 'actor')}/trainer_state.pt", weights_only=True)
    assert written_moments["updates"] == 1 and actor.updater.updates == 2
    for key, moment in moments.items():
        assert torch.equal(written_moments["optimizer"]["state"][key]["exp_avg_sq"], moment), key


def test_a_part_that_fails_fails_the_step_with_its_error_and_the_latest_checkpoint_stays(
        model_path, tmp_path, monkeypatch):
    config = _config(tmp_path)
    layout = layout_for(config)
    actor, gate = _actor(model_path), _Gate(monkeypatch, fail=True)
    driver = RunState(config, tracker=None, kl_controller=None, artifacts=None)
    driver.unsettled = (2, ["actor"], {})
    save_role_part(config, 2, "actor", actor)
    gate.open.set()
    with pytest.raises(RuntimeError) as failed:
        driver.settle_checkpoint()
    free = shutil.disk_usage(layout.checkpoint_dir(2)).free / 2**30  # (the part's folder exists: the
    assert re.fullmatch(  # half-written part went to a temporary name, which is gone)
        rf"checkpoint at step 2: the actor's part was not written \(writing it failed in pid {os.getpid()} on "
        rf"{re.escape(os.uname().nodename)}: OSError: \[Errno 28\] No space left on device \(([0-9.]+) GiB free "
        rf"on the disk of {re.escape(layout.checkpoint_dir(2))}; the part holds ([0-9.]+) GiB\)\); the latest "
        r"checkpoint stays none; `rlhf resume r` restarts from it", str(failed.value))
    said = re.search(r"\(([0-9.]+) GiB free.* holds ([0-9.]+) GiB", str(failed.value))
    assert abs(float(said[1]) - free) < 0.5
    assert float(said[2]) == round(role_state(actor.model, actor.updater).nbytes() / 2**30, 1)
    assert not checkpoint_committed(layout, 2) and latest_checkpoint(layout) is None
    with pytest.raises(OSError, match="No space left"):  # the next checkpoint stage of this process raises it too
        finish_writing(f"{layout.run_dir}/actor")
    assert not os.path.exists(part_path(layout, 2, "actor"))  # nothing half-written under the part's name


def test_a_part_whose_writer_died_is_not_waited_for_and_a_stopping_run_only_says_so(tmp_path, capsys):
    config = _config(tmp_path)
    layout = layout_for(config)
    os.makedirs(layout.checkpoint_dir(1))
    dead = os.fork()
    if dead == 0:
        os._exit(0)
    os.waitpid(dead, 0)
    with open(f"{part_path(layout, 1, 'critic')}.writer.json", "w") as claim:
        json.dump({"host": os.uname().nodename, "pid": dead}, claim)
    assert wait_written(layout, 1, "critic") == f"the process that was writing it (pid {dead}) has ended"
    driver = RunState(config, tracker=None, kl_controller=None, artifacts=None)
    driver.unsettled = (1, ["critic"], {})
    assert driver.settle_checkpoint(stopping=True) == {}
    assert capsys.readouterr().out.startswith("checkpoint at step 1: the critic's part was not written (the process")
    assert driver.unsettled is None and not checkpoint_committed(layout, 1)


def test_a_process_that_ends_finishes_the_parts_it_was_writing(model_path, tmp_path, monkeypatch):
    config = _config(tmp_path)
    actor, gate = _actor(model_path), _Gate(monkeypatch)
    save_role_part(config, 3, "actor", actor)
    threading.Timer(0.5, gate.open.set).start()
    checkpoints._finish_all()  # what runs at exit
    assert wait_written(layout_for(config), 3, "actor") is None


def test_a_part_written_at_once_that_fails_names_the_free_space_against_the_part(model_path, tmp_path, monkeypatch):
    """torch.save says only "unexpected pos" when the disk fills up: the error says how much room there was."""
    config = _config(tmp_path)
    gate = _Gate(monkeypatch, fail=True)
    gate.open.set()
    with pytest.raises(RuntimeError, match=r"^checkpoint at step 4: writing the actor's part failed: OSError: "
                       r"\[Errno 28\] No space left on device \([0-9.]+ GiB free on the disk of /.*; "
                       r"the part holds [0-9.]+ GiB\)$"):
        save_role_part(config, 4, "actor", _actor(model_path))
    assert not os.path.exists(part_path(layout_for(config), 4, "actor"))


@pytest.mark.parametrize("room_after_removing_the_claim", [True, False])
def test_a_part_that_fails_on_a_disk_too_full_to_say_so_is_not_waited_for(model_path, tmp_path, monkeypatch,
                                                                         room_after_removing_the_claim):
    """The writer cannot rewrite its claim with the error (the disk is full): it removes the claim and tries
    again; the driver learns the error, or with no room at all that nobody writes the part, and does not wait
    for ever on a live writer (CI: a full-disk drill hung here for 300 s)."""
    config = _config(tmp_path)
    layout = layout_for(config)
    written = checkpoints.write_bytes_atomic
    refusals = iter([True, not room_after_removing_the_claim])

    def full_disk(fs, path, payload):
        if path.endswith(".writer.json") and b'"error"' in payload and next(refusals, False):
            raise OSError(errno.ENOSPC, "No space left on device")
        return written(fs, path, payload)

    monkeypatch.setattr(checkpoints, "write_bytes_atomic", full_disk)
    monkeypatch.setattr("flows.runtime.weights.stored_copy.UNCLAIMED_COPY_WAIT_S", 0.5)
    gate = _Gate(monkeypatch, fail=True)
    save_role_part(config, 2, "actor", _actor(model_path))
    gate.open.set()
    with pytest.raises(OSError):
        finish_writing(f"{layout.run_dir}/actor")
    why = wait_written(layout, 2, "actor")
    if room_after_removing_the_claim:
        assert why.startswith(f"writing it failed in pid {os.getpid()} on ") and "No space left" in why, why
    else:
        assert why == "no process is writing it"
        assert not os.path.exists(f"{part_path(layout, 2, 'actor')}.writer.json")
