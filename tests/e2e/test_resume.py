"""Resumption with a real Prefect server and MLflow: a run that fails in any stage, whose driver is
killed with SIGKILL, or whose committed stage file is truncated, resumes and ends exactly like a run
that was never interrupted (same weights bit for bit, same metrics, one MLflow run, no step twice)."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from storage import RunLayout

pytestmark = pytest.mark.e2e

STEPS = 3


@pytest.fixture(scope="session")
def _config(make_config):
    """PPO with a critic, a warm-start and a KL loss: every stage kind takes part. One checkpoint and two
    weight copies are kept, so that older published weights are deleted during the run."""
    def make(tmp_path, tiny_inputs, name):
        return make_config(tmp_path, name, "resume",
                           actor={"ppo_mini_batch_size": 2, "micro_batch_size": 4, "use_kl_loss": True,
                                  "optim": {"lr": 1e-3}},
                           critic={"ppo_mini_batch_size": 2, "micro_batch_size": 4},
                           algorithm={"adv_estimator": "gae"}, warm_start={"steps": 2, "batch_size": 8},
                           trainer={"total_steps": STEPS, "val_every": 1, "device": "cpu",
                                    "keep_checkpoints": 1, "keep_weights": 2})

    return make


def _train(config):
    from flows.training.train import train

    return train(config, return_state=True)


def _resume(config):
    return _train(config.model_copy(update={"run": config.run.model_copy(update={"resume": True})}))


def _fingerprint(config) -> dict:
    """Final actor and critic weights (hashes of the safetensors bytes) and every logged metric."""
    layout = RunLayout(config.run.storage_root, config.run.name)
    root = Path(layout.run_dir)
    weights = {str(path.relative_to(root)): hashlib.sha256(path.read_bytes()).hexdigest()
               for path in sorted(root.glob(f"weights/actor/{STEPS}/*.safetensors"))
               + sorted(root.glob(f"checkpoints/{STEPS}/*/*.safetensors"))}
    assert weights, "no final weights"
    # keep_weights=2: the warm start (0) and the newest two copies; copy 1 was deleted by the update of
    # step 2 (no checkpoint referred to it any more), and a resume from checkpoint 2 found copy 2.
    assert layout.step_folders(f"{layout.run_dir}/weights/actor") == [0, STEPS - 1, STEPS]
    client = MlflowClient(tracking_uri=config.tracking.tracking_uri)
    runs = client.search_runs([client.get_experiment_by_name("resume").experiment_id],
                              f"tags.`rlhf.run_name` = '{config.run.name}'")
    assert len(runs) == 1, "a resumed run must continue its MLflow run, not start another"
    run = runs[0]
    assert run.info.status == "FINISHED"
    metrics = {}
    for key in ("critic/score/mean", "actor/pg_loss", "critic/vf_loss", "val/reward/mean", "actor/kl_loss",
                "critic/advantages/mean"):
        history = client.get_metric_history(run.info.run_id, key)
        steps = [m.step for m in history]
        assert len(steps) == len(set(steps)), f"{key} logged twice for a step: {steps}"
        metrics[key] = [(m.step, m.value) for m in sorted(history, key=lambda m: m.step)]
    return {"weights": weights, "metrics": metrics}


@pytest.fixture(scope="module")
def uninterrupted(prefect_api, tmp_path_factory, tiny_inputs, _config):
    tmp_path = tmp_path_factory.mktemp("baseline")
    config = _config(tmp_path, tiny_inputs, "baseline")
    assert _train(config).is_completed()
    return _fingerprint(config)


@pytest.mark.parametrize("stage", ["warm_start", "rollout", "reward", "reference", "values", "old_logprobs",
                                   "advantages", "update_actor", "update_critic", "validate", "checkpoint_actor"])
def test_a_run_failing_in_any_stage_resumes_to_the_same_result(stage, uninterrupted, prefect_api, tmp_path,
                                                                 tiny_inputs, monkeypatch, _config):
    config = _config(tmp_path, tiny_inputs, "baseline")
    monkeypatch.setenv("RLHF_INJECT_FAILURE", f"{stage}:{None if stage == 'warm_start' else 1}")
    assert _train(config).is_failed()
    monkeypatch.delenv("RLHF_INJECT_FAILURE")
    assert _resume(config).is_completed()
    assert _fingerprint(config) == uninterrupted


def test_checkpoints_written_at_once_end_as_those_written_in_the_background(uninterrupted, prefect_api, tmp_path,
                                                                           tiny_inputs, _config):
    """The baseline writes its checkpoints in the background (trainer.checkpoint_async, the default), and the
    failures above resume from them; written at once, the run is the same bit for bit."""
    config = _config(tmp_path, tiny_inputs, "baseline")
    config = config.model_copy(update={"trainer": config.trainer.model_copy(update={"checkpoint_async": False})})
    assert _train(config).is_completed()
    assert _fingerprint(config) == uninterrupted


def test_a_truncated_stage_file_is_recomputed_not_used(uninterrupted, prefect_api, tmp_path, tiny_inputs,
                                                      monkeypatch, _config):
    config = _config(tmp_path, tiny_inputs, "baseline")
    monkeypatch.setenv("RLHF_INJECT_FAILURE", "update_actor:1")
    assert _train(config).is_failed()
    monkeypatch.delenv("RLHF_INJECT_FAILURE")
    reward_file = Path(RunLayout(config.run.storage_root, "baseline").stage_path(1, "reward"))
    reward_file.write_bytes(reward_file.read_bytes()[:-40])  # a committed file, now corrupt
    assert _resume(config).is_completed()
    assert _fingerprint(config) == uninterrupted


def test_a_driver_killed_mid_step_resumes(uninterrupted, prefect_api, tmp_path, tiny_inputs, _config):
    import yaml

    config = _config(tmp_path, tiny_inputs, "baseline")
    config_file = tmp_path / "config.yaml"
    config_file.write_text(yaml.safe_dump(config.model_dump(mode="json")))
    env = dict(os.environ, PREFECT_API_URL=prefect_api, PYTHONPATH=str(Path(__file__).parents[2]))
    driver = subprocess.Popen([sys.executable, "-m", "flows.tools.cli", "train", str(config_file)], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    marker = Path(RunLayout(config.run.storage_root, "baseline").stage_path(1, "reward"))
    deadline = time.monotonic() + 240
    while not marker.exists() and driver.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert driver.poll() is None, "the driver ended before it could be killed"
    os.killpg(driver.pid, signal.SIGKILL)  # in the middle of step 1
    driver.wait()
    assert _resume(config).is_completed()
    assert _fingerprint(config) == uninterrupted
