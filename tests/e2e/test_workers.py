"""The flow with one worker process per role (CPU): each stage runs in its role's worker, each worker
loads its model once, and a worker killed in the middle of a stage is replaced without losing samples."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from flows.runtime.console import PROGRESS_LOGGER
from flows.runtime.worker import read_heartbeats
from flows.training.registry import role_stages
from flows.training.run import worker_pool
from storage import RunLayout, read_stage

pytestmark = pytest.mark.e2e

PROMPTS, SAMPLES = 4, 4


@pytest.fixture
def _config(make_config):
    def make(tmp_path, tiny_inputs, name, **sections):
        sections.setdefault("actor", {"ppo_mini_batch_size": 2, "micro_batch_size": 4, "use_kl_loss": True})
        return make_config(tmp_path, name, "workers", placement={"default": "cpu"},
                           trainer={"total_steps": 2, "val_every": 1, "device": "cpu", "execution": "workers",
                                    "worker_timeout_s": 4}, **sections)

    return make


def _train_with_workers(config, prefect_api, during=None):
    from flows.runtime.launcher import using_prefect_api, worker_environment
    from flows.training.train import train

    storage = worker_environment(prefect_api, config.run.storage_root, "", config.run.name)["PREFECT_LOCAL_STORAGE_PATH"]
    with using_prefect_api(prefect_api, local_storage_path=storage), worker_pool(config, prefect_api) as pool:
        watcher = threading.Thread(target=during, args=(pool,), daemon=True) if during else None
        if watcher:
            watcher.start()
        state = train(config, return_state=True)
        beats = list(read_heartbeats(os.environ["RLHF_WORKER_DIR"]))
        return state, beats, pool


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def test_each_stage_runs_in_its_role_worker_which_loads_its_model_once(prefect_api, tmp_path, tiny_inputs,
                                                                        _config):
    """Also: the rollout's worker gets each policy streamed from the actor's worker (trainer.weight_sync=auto):
    with a checkpoint every 2 steps, version 1 is never stored, yet validation and the rollout of step 1 use it."""
    config = _config(tmp_path, tiny_inputs, "workers")
    config = config.model_copy(update={"trainer": config.trainer.model_copy(update={"checkpoint_every": 2})})
    terminal, progress_logger = _Lines(), logging.getLogger(PROGRESS_LOGGER)  # the driver's (this process's) lines
    level = progress_logger.level
    progress_logger.addHandler(terminal)
    progress_logger.setLevel(logging.INFO)  # as quiet_console sets it for `rlhf run`
    try:
        state, beats, pool = _train_with_workers(config, prefect_api)
    finally:
        progress_logger.removeHandler(terminal)
        progress_logger.setLevel(level)
    assert state.is_completed(), state
    # The workers' progress lines reach the driver's terminal, each once, named by role.
    for line in ("[actor] loading the actor model ...", "[reference] loading the reference model ...",
                 "[rollout] loading the rollout model (hf) ..."):
        assert terminal.lines.count(line) == 1, terminal.lines
    assert any(line.startswith("[rollout] rollout ready in ") for line in terminal.lines), terminal.lines
    by_role = {beat["role"]: beat for beat in beats}
    assert set(by_role) == {"rollout", "actor", "reference", "reward"}
    assert len({beat["pid"] for beat in beats}) == 4 and os.getpid() not in {beat["pid"] for beat in beats}
    for role, beat in by_role.items():
        stages = {stage for stage, _ in beat["finished"]}
        assert stages <= {spec.name for spec in role_stages(role)}, (role, stages)
        assert beat["load_counts"].get(role) == 1, (role, beat["load_counts"])
    # Every role but the rollout loaded its model in a prepare stage, first thing, beside the first validation.
    assert sorted(role for role, beat in by_role.items() if beat["finished"][0][0] == f"prepare_{role}") == [
        "actor", "reference", "reward"]
    assert sorted(step for stage, step in by_role["rollout"]["finished"] if stage == "rollout") == [0, 1]
    assert sorted(step for stage, step in by_role["actor"]["finished"] if stage == "update_actor") == [0, 1]
    assert all(restarts == 0 for restarts in pool.restarts.values())
    # Versions 1 (validation at 1, then the rollout of step 1, which holds it already) and 2 (the last validation)
    # were sent; version 0 is the engine's own. Only the last version is stored (the export reads it).
    assert sorted(step for stage, step in by_role["actor"]["finished"] if stage == "send_weights") == [1, 1, 2]
    layout = RunLayout(config.run.storage_root, config.run.name)
    assert layout.step_folders(f"{layout.run_dir}/weights/actor") == [2]
    # Every worker on this host: the actor's channel listens on the loopback only.
    assert json.loads(Path(layout.run_dir, "weights", "actor", "channel.json").read_text())["address"] == "127.0.0.1"
    from mlflow.tracking import MlflowClient

    client = MlflowClient(config.tracking.tracking_uri)
    run = client.search_runs([client.get_experiment_by_name("workers").experiment_id],
                             "tags.`rlhf.run_name` = 'workers'")[0]
    # Both hand-overs were validation's (named apart from a rollout's): the rollout of step 1 had nothing to take.
    assert {m.step for m in client.get_metric_history(run.info.run_id, "val-aux/timing_s/weight_sync")} == {1, 2}
    assert "timing_s/weight_sync" not in run.data.metrics
    assert client.get_metric_history(run.info.run_id, "rollout/policy_lag")[-1].value == 0.0
    assert not {"weights/stream_fallback", "val-aux/weights/stream_fallback"} & set(run.data.metrics)


def test_a_worker_killed_mid_stage_is_replaced_and_no_sample_is_lost(prefect_api, tmp_path, tiny_inputs,
                                                                       monkeypatch, _config):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]))
    config = _config(tmp_path, tiny_inputs, "killed", reward={"function": "slow_reward:exact_match_slowly"})
    killed = []

    def kill_reward_worker_during_step_one(pool):
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not killed:
            for beat in read_heartbeats(os.environ["RLHF_WORKER_DIR"]):
                finished_rollouts = [step for stage, step in beat.get("finished", []) if stage == "reward"]
                if beat["role"] == "reward" and beat["running"] and finished_rollouts:
                    os.kill(beat["pid"], signal.SIGKILL)  # in the middle of the reward stage of step >= 1
                    killed.append(beat["pid"])
                    break
            time.sleep(0.05)

    state, beats, pool = _train_with_workers(config, prefect_api, during=kill_reward_worker_during_step_one)
    assert killed, "the reward worker was never caught running a stage"
    assert state.is_completed(), state
    assert pool.restarts["reward"] == 1
    layout = RunLayout(config.run.storage_root, "killed")
    for step in range(2):
        uids = read_stage(layout, step, "rollout").column("uid").to_pylist()
        assert len(uids) == PROMPTS * SAMPLES
        scores = read_stage(layout, step, "reward", expected_rows=len(uids), expected_uids=uids)
        assert scores.num_rows == PROMPTS * SAMPLES


def test_a_worker_killed_as_it_takes_a_stage_is_replaced_and_the_stage_runs_again(prefect_api, tmp_path,
                                                                                 tiny_inputs, monkeypatch, _config):
    """Killed first thing in the stage, the worker may never have told the server the run started (the
    server's state stays Scheduled and no other worker is handed the run): the heartbeat still tells."""
    monkeypatch.setenv("RLHF_INJECT_FAILURE", "reward:1:kill")
    config = _config(tmp_path, tiny_inputs, "killed-at-start")
    state, beats, pool = _train_with_workers(config, prefect_api)
    assert state.is_completed(), state
    assert pool.restarts["reward"] == 1
    assert Path(os.environ["RLHF_WORKER_DIR"], "injected-kill-reward-1").exists()
    killed = next(beat for beat in beats if beat["role"] == "reward" and beat["pid"] != pool.processes["reward"].pid)
    replacement = next(beat for beat in beats if beat["pid"] == pool.processes["reward"].pid)
    # prepared at the start, scored step 0, then died in step 1
    assert killed["running"] and [stage for stage, _ in killed["finished"]] == ["prepare_reward", "reward"]
    assert [step for stage, step in replacement["finished"] if stage == "reward"] == [1]
    layout = RunLayout(config.run.storage_root, "killed-at-start")
    uids = read_stage(layout, 1, "rollout").column("uid").to_pylist()
    assert read_stage(layout, 1, "reward", expected_rows=len(uids), expected_uids=uids).num_rows == PROMPTS * SAMPLES


def test_a_worker_that_dies_as_it_is_handed_a_run_is_replaced_and_the_run_submitted_again(
        prefect_api, tmp_path, tiny_inputs, monkeypatch, _config):
    """The CI hang of 2026-11-30: a worker died after taking a run but before it reported anything, so
    the server never saw the run start and never hands it to another worker. The replacement sitting
    idle while the run waits tells the driver to submit it again."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(Path(__file__).parent / "die_on_receive"),
                                                      os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("RLHF_TEST_DIE_ON_RECEIVE", "reward")
    config = _config(tmp_path, tiny_inputs, "died-on-receive")
    state, beats, pool = _train_with_workers(config, prefect_api)
    assert state.is_completed(), state
    assert Path(os.environ["RLHF_WORKER_DIR"], "died-on-receive-reward").exists()
    assert pool.restarts["reward"] == 1
    replacement = next(beat for beat in beats if beat["pid"] == pool.processes["reward"].pid)
    assert sorted(step for stage, step in replacement["finished"] if stage == "reward") == [0, 1]
    layout = RunLayout(config.run.storage_root, "died-on-receive")
    for step in range(2):
        uids = read_stage(layout, step, "rollout").column("uid").to_pylist()
        assert read_stage(layout, step, "reward", expected_rows=len(uids), expected_uids=uids).num_rows == len(uids)


def test_a_lora_runs_reference_runs_in_the_actors_worker_on_the_base_model(prefect_api, tmp_path, tiny_inputs,
                                                                         monkeypatch, _config):
    """LoRA (model.lora_rank > 0) with the KL loss: no reference worker is started; the actor's worker computes the
    reference's log-probs on its own model with the adapter disabled, so they are the base model's at every step,
    while the adapter trains (its log-probs move away from them after the first update)."""
    import torch

    from components.batch import build_sequence_batch
    from components.models import load_tokenizer
    from components.reference import Reference

    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]))
    config = _config(tmp_path, tiny_inputs, "lora-workers", model={"lora_rank": 4, "lora_alpha": 8},
                     reward={"function": "dense_reward:digit_share"},  # advantages that are not all zero
                     actor={"ppo_mini_batch_size": 2, "micro_batch_size": 4, "use_kl_loss": True, "optim": {"lr": 1e-2}})
    state, beats, pool = _train_with_workers(config, prefect_api)
    assert state.is_completed(), state
    assert set(pool.processes) == {"rollout", "actor", "reward"}
    by_role = {beat["role"]: beat for beat in beats}
    assert set(by_role) == {"rollout", "actor", "reward"} and len(beats) == 3  # no reference worker ever beat
    actor = by_role["actor"]
    assert actor["serves"] == ["actor", "reference"]
    assert sorted(step for stage, step in actor["finished"] if stage == "reference") == [0, 1]
    assert "prepare_reference" not in {stage for stage, _ in actor["finished"]}  # nothing of its own to load
    assert actor["load_counts"].get("actor") == 1  # one model in the run's trained roles: the actor's

    layout = RunLayout(config.run.storage_root, config.run.name)
    tokenizer = load_tokenizer(config.model.path)
    base = Reference.from_pretrained(config.model.path, device="cpu", temperature=config.rollout.temperature,
                                     micro_batch_size=4, fused=config.model.fused_logprobs)
    for step in range(2):
        rollout = read_stage(layout, step, "rollout")
        uids = rollout.column("uid").to_pylist()
        batch = build_sequence_batch(rollout.column("prompt_ids"), rollout.column("response_ids"),
                                     tokenizer.pad_token_id, rollout.column("loss_mask"))
        expected = base.compute_logprobs(batch)
        reference = read_stage(layout, step, "reference", expected_rows=len(uids), expected_uids=uids)
        policy = read_stage(layout, step, "old_logprobs", expected_rows=len(uids), expected_uids=uids)
        gap = 0.0
        for row, (ref, old) in enumerate(zip(reference.column("ref_logprobs").to_pylist(),
                                             policy.column("old_logprobs").to_pylist())):
            ref, old = torch.tensor(ref), torch.tensor(old)
            assert len(ref) == len(rollout.column("response_ids")[row]) > 0
            torch.testing.assert_close(ref, expected[row, :len(ref)], atol=1e-5, rtol=0)
            gap = max(gap, float((ref - old).abs().max()))
            if step == 0:  # LoRA's B starts at zero: the policy of step 0 is the base model
                torch.testing.assert_close(old, ref, atol=1e-5, rtol=0)
                sampled = torch.tensor(rollout.column("rollout_logprobs")[row].as_py())
                torch.testing.assert_close(sampled[sampled.isfinite()], ref[sampled.isfinite()], atol=1e-4, rtol=0)
        assert step == 0 or gap > 1e-3, gap  # the trained adapter moved the policy; the reference stayed the base


def _final_actor_weights(config) -> dict[str, str]:
    root = Path(RunLayout(config.run.storage_root, config.run.name).run_dir)
    steps = config.trainer.total_steps
    weights = {path.name: hashlib.sha256(path.read_bytes()).hexdigest()
               for path in sorted(root.glob(f"weights/actor/{steps}/*.safetensors"))}
    assert weights, "no final weights"
    return weights


def test_an_actor_worker_killed_in_its_update_is_replaced_from_the_checkpoint_and_ends_the_same(
        prefect_api, tmp_path, tiny_inputs, monkeypatch, _config):
    """The actor holds training state. Its replacement, built in the middle of the run, restores the
    checkpoint of the step it is asked for (weights, optimizer, RNG), so the run ends with the same
    weights, bit for bit, as a run that was never interrupted (before, it restarted from step 0's)."""
    baseline = _config(tmp_path / "baseline", tiny_inputs, "actor-baseline")
    state, _, _ = _train_with_workers(baseline, prefect_api)
    assert state.is_completed(), state

    monkeypatch.setenv("RLHF_INJECT_FAILURE", "update_actor:1:kill")
    config = _config(tmp_path / "killed", tiny_inputs, "actor-killed")
    state, beats, pool = _train_with_workers(config, prefect_api)
    assert state.is_completed(), state
    assert pool.restarts["actor"] == 1
    replacement = next(beat for beat in beats if beat["pid"] == pool.processes["actor"].pid)
    assert [step for stage, step in replacement["finished"] if stage == "update_actor"] == [1]
    assert _final_actor_weights(config) == _final_actor_weights(baseline)


def test_an_actor_that_cannot_be_restored_fails_the_stage_with_what_to_do(prefect_api, tmp_path, tiny_inputs,
                                                                          monkeypatch, _config):
    """Without a checkpoint of the step (trainer.checkpoint_every=0), a replaced actor cannot hold the
    state the update needs: the stage fails with one line saying so, instead of training step 0's
    weights as if they were step 1's."""
    monkeypatch.setenv("RLHF_INJECT_FAILURE", "update_actor:1:kill")
    config = _config(tmp_path, tiny_inputs, "actor-lost")
    config = config.model_copy(update={"trainer": config.trainer.model_copy(update={"checkpoint_every": 0})})
    state, _, pool = _train_with_workers(config, prefect_api)
    assert state.is_failed(), state
    assert pool.restarts["actor"] == 1
    message = str(state.message)
    assert ("stage update_actor at step 1: the actor holds the training state of step 0 and no checkpoint has "
            "step 1's") in message, message
    assert "rlhf resume actor-lost (restarts at the start)" in message, message


def test_one_step_ahead_rollout_uses_the_policy_of_the_step_before(prefect_api, tmp_path, tiny_inputs, _config):
    """Under trainer.one_step_ahead the rollout of step k+1 runs while step k trains, with the weights
    published for step k: every rollout but the first is one update behind."""
    from mlflow.tracking import MlflowClient

    config = _config(tmp_path, tiny_inputs, "ahead", actor={"ppo_mini_batch_size": 2, "micro_batch_size": 4})
    config = config.model_copy(update={"trainer": config.trainer.model_copy(
        update={"one_step_ahead": True, "total_steps": 3, "val_every": 0})})
    state, beats, _ = _train_with_workers(config, prefect_api)
    assert state.is_completed(), state
    client = MlflowClient(config.tracking.tracking_uri)
    run = client.search_runs([client.get_experiment_by_name("workers").experiment_id],
                             "tags.`rlhf.run_name` = 'ahead'")[0]
    lag = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "rollout/policy_lag")}
    assert lag == {1: 0.0, 2: 1.0, 3: 1.0}
    rollout = next(beat for beat in beats if beat["role"] == "rollout")
    assert sorted(step for stage, step in rollout["finished"] if stage == "rollout") == [0, 1, 2]
    layout = RunLayout(config.run.storage_root, "ahead")
    assert all(len(read_stage(layout, step, "rollout")) == PROMPTS * SAMPLES for step in range(3))


def test_the_driver_takes_each_stage_result_from_its_worker_without_waiting_for_the_server(
        tmp_path, tiny_inputs, _config, monkeypatch):
    """A server whose task run recorder is off never learns a task run's final state (Prefect records
    states sent as events there). The run still completes: the driver takes each stage's result from
    the file its worker publishes (flows.runtime.worker.publish_result), and leaves none behind. Before, it
    waited for the server's Completed state, which Prefect 3.7 at times records seconds late."""
    from mlflow.tracking import MlflowClient

    from flows.runtime.launcher import prefect_server, using_prefect_api

    monkeypatch.setenv("PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_ENABLED", "false")
    home = tmp_path / "prefect-home"
    config = _config(tmp_path, tiny_inputs, "no-recorder")
    with prefect_server(prefect_home=home) as api_url, using_prefect_api(api_url, prefect_home=home):
        state, beats, _ = _train_with_workers(config, api_url)
    assert state.is_completed(), state
    assert sorted(step for beat in beats if beat["role"] == "actor"
                  for stage, step in beat["finished"] if stage == "update_actor") == [0, 1]
    assert not list((Path(os.environ["RLHF_WORKER_DIR"]) / "results").glob("*"))
    client = MlflowClient(config.tracking.tracking_uri)
    run = client.search_runs([client.get_experiment_by_name("workers").experiment_id],
                             "tags.`rlhf.run_name` = 'no-recorder'")[0]
    dispatch = {name for name in run.data.metrics if name.startswith("timing_s/dispatch_")}
    assert {"timing_s/dispatch_rollout", "timing_s/dispatch_reward", "timing_s/dispatch_update_actor"} <= dispatch
    assert all(run.data.metrics[name] >= 0 for name in dispatch)
