"""LoRA end to end (model.lora_rank > 0) with a real Prefect server and MLflow: PPO with a LoRA actor and a LoRA
critic, the KL loss against the actor's own model with its adapter disabled, the rollout fed the merged weights;
a run failing in update_actor resumes from its adapter checkpoints to the uninterrupted run's result bit for bit."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from storage import RunLayout

pytestmark = pytest.mark.e2e

STEPS = 3


def _config(make_config, tmp_path, tiny_inputs):
    return make_config(tmp_path, "lora", "lora",
                       model={"path": tiny_inputs["model"], "lora_rank": 4, "lora_alpha": 8},
                       actor={"ppo_mini_batch_size": 2, "micro_batch_size": 4, "use_kl_loss": True,
                              "optim": {"lr": 1e-2}},
                       critic={"ppo_mini_batch_size": 2, "micro_batch_size": 4},
                       algorithm={"adv_estimator": "gae"},
                       trainer={"total_steps": STEPS, "val_every": 1, "device": "cpu", "keep_checkpoints": 1})


def _train(config, resume: bool = False):
    from flows.training.train import train

    if resume:
        config = config.model_copy(update={"run": config.run.model_copy(update={"resume": True})})
    return train(config, return_state=True)


def _fingerprint(config) -> dict:
    layout = RunLayout(config.run.storage_root, config.run.name)
    root = Path(layout.run_dir)
    files = sorted(root.glob(f"weights/actor/{STEPS}/*.safetensors")) + sorted(
        root.glob(f"checkpoints/{STEPS}/*/*.safetensors"))
    client = MlflowClient(tracking_uri=config.tracking.tracking_uri)
    run, = client.search_runs([client.get_experiment_by_name("lora").experiment_id],
                              f"tags.`rlhf.run_name` = '{config.run.name}'")
    metrics = {key: [(m.step, m.value) for m in sorted(client.get_metric_history(run.info.run_id, key),
                                                        key=lambda m: m.step)]
               for key in ("actor/pg_loss", "actor/kl_loss", "critic/vf_loss", "val/reward/mean",
                           "rollout/logprob_diff_mean")}
    return {"files": {str(path.relative_to(root)): hashlib.sha256(path.read_bytes()).hexdigest() for path in files},
            "metrics": metrics}


def test_a_lora_run_trains_adapters_and_resumes_bit_for_bit(prefect_api, tmp_path_factory, tiny_inputs, make_config,
                                                            monkeypatch):
    baseline = _config(make_config, tmp_path_factory.mktemp("lora-baseline"), tiny_inputs)
    assert _train(baseline).is_completed()
    expected = _fingerprint(baseline)
    assert len(expected["files"]) == 3 and all(expected["metrics"].values())  # merged weights, two adapters
    layout = RunLayout(baseline.run.storage_root, baseline.run.name)
    checkpoint = Path(layout.checkpoint_dir(STEPS))
    assert {path.name for path in (checkpoint / "actor").iterdir()} >= {"adapter_config.json",
                                                                       "adapter_model.safetensors"}
    assert (checkpoint / "critic" / "adapter_model.safetensors").exists()
    assert not (checkpoint / "actor" / "model.safetensors").exists()
    # the KL loss is measured against the base (the adapter disabled), and it moves off 0 as the adapter trains
    assert any(value != 0 for _, value in expected["metrics"]["actor/kl_loss"])
    # the rollout, given the merged weights, computes the actor's log-probs (the gap metric)
    assert all(value < 1e-4 for _, value in expected["metrics"]["rollout/logprob_diff_mean"])

    interrupted = _config(make_config, tmp_path_factory.mktemp("lora-resumed"), tiny_inputs)
    monkeypatch.setenv("RLHF_INJECT_FAILURE", "update_actor:2")
    assert _train(interrupted).is_failed()
    monkeypatch.delenv("RLHF_INJECT_FAILURE")
    assert _train(interrupted, resume=True).is_completed()
    assert _fingerprint(interrupted) == expected
