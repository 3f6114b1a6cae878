"""The real training flow against a real Prefect server and MLflow on SQLite, on a tiny model."""

from __future__ import annotations

import math

import pytest
from mlflow.tracking import MlflowClient

from flows.runtime.residents import LOAD_COUNTS
from storage import RunLayout, read_stage, validate_stage_file

pytestmark = pytest.mark.e2e

PROMPTS, SAMPLES = 4, 4


@pytest.fixture
def _config(make_config):
    def make(tmp_path, tiny_inputs, name, **sections):
        sections.setdefault("warm_start", {"steps": 3, "batch_size": 8})
        sections.setdefault("trainer", {"total_steps": 2, "val_every": 1, "samples_every": 1, "device": "cpu"})
        return make_config(tmp_path, name, "e2e", **sections)

    return make


def _run(config):
    from flows.training.train import train

    state = train(config, return_state=True)
    assert state.is_completed(), state
    return state, state.result()


def _task_names(flow_run_id) -> list[str]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
    assert all(run.state.is_completed() for run in runs)
    return [run.task_key.split("-")[0] if False else run.name.rsplit("-", 1)[0] for run in runs]


def test_grpo_flow_writes_every_stage_and_tracks_in_mlflow(prefect_api, tmp_path, tiny_inputs, _config):
    config = _config(tmp_path, tiny_inputs, "grpo", actor={"use_kl_loss": True, "ppo_mini_batch_size": 2,
                                                            "micro_batch_size": 4})
    loads_before = dict(LOAD_COUNTS)
    state, summary = _run(config)

    layout = RunLayout(config.run.storage_root, "grpo")
    for step in range(2):
        for stage in ("rollout", "reward", "reference", "old_logprobs", "advantages"):
            assert validate_stage_file(layout, step, stage, expected_rows=PROMPTS * SAMPLES), (step, stage)
        assert not layout.exists(layout.stage_path(step, "values"))  # GRPO runs no critic
        rollout = read_stage(layout, step, "rollout")
        assert len(set(rollout.column("uid").to_pylist())) == PROMPTS * SAMPLES
        assert len(set(rollout.column("group_id").to_pylist())) == PROMPTS
    assert layout.latest_weights("actor")[0] == 2  # published after the last update
    # Every role model loaded once in this process across both steps.
    for role in ("rollout", "actor", "reference", "reward"):
        assert LOAD_COUNTS[role] - loads_before.get(role, 0) == 1, role

    client = MlflowClient(tracking_uri=config.tracking.tracking_uri)
    run = client.get_run(summary["mlflow_run_id"])
    assert run.info.status == "FINISHED"
    assert run.data.params["actor.optim.lr"] == "0.0001"
    assert run.data.tags["rlhf.algorithm"] == "grpo"
    for name in ("timing_s/gen", "timing_s/update_actor", "critic/score/mean", "actor/pg_loss",
                 "actor/pg_clipfrac", "actor/ppo_kl", "actor/entropy", "actor/kl_loss",
                 "response_length/mean", "perf/throughput", "rollout/logprob_diff_mean"):
        history = client.get_metric_history(run.info.run_id, name)
        assert [m.step for m in history] == [1, 2], name
        assert all(math.isfinite(m.value) for m in history), name
    validation = client.get_metric_history(run.info.run_id, "val/reward/mean")
    assert [m.step for m in validation] == [0, 1, 2]
    assert validation[-1].value == pytest.approx(summary["val_reward_end"])
    # The logged score equals the mean of the scores stored for that step.
    scores = read_stage(layout, 1, "reward").column("score").to_pylist()
    logged = client.get_metric_history(run.info.run_id, "critic/score/mean")[1].value
    assert logged == pytest.approx(sum(scores) / len(scores))
    # Float32 on CPU: the rollout engine's log-probs and the actor's recomputation agree.
    assert client.get_metric_history(run.info.run_id, "rollout/logprob_diff_mean")[0].value < 0.02
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id, "samples")}
    assert "samples/step_00001.json" in artifacts

    names = _task_names(state.state_details.flow_run_id)
    assert names.count("rollout") == 2 and names.count("update_actor") == 2
    assert names.count("values") == 0 and names.count("warm_start") == 1
    _check_prefect_artifacts(client, run.info.run_id)


def _check_prefect_artifacts(mlflow_client, mlflow_run_id):
    """The Prefect UI shows progress 100 %, the per-step table (same values as MLflow) and the MLflow link."""
    import json

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    with get_client(sync_client=True) as client:
        def latest(key):
            found = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key])))
            return sorted(found, key=lambda artifact: artifact.created)[-1]

        assert float(latest("grpo-progress").data) == 100.0
        table = latest("grpo-metrics").data
        rows = json.loads(table) if isinstance(table, str) else table
        scores = mlflow_client.get_metric_history(mlflow_run_id, "critic/score/mean")
        assert [row["step"] for row in rows] == [1, 2]
        assert [row["critic/score/mean"] for row in rows] == pytest.approx([m.value for m in scores], abs=1e-5)
        assert mlflow_run_id in latest("grpo-mlflow").data


def test_ppo_flow_with_critic_and_adaptive_kl_penalty(prefect_api, tmp_path, tiny_inputs, _config):
    config = _config(tmp_path, tiny_inputs, "ppo",
                     algorithm={"adv_estimator": "gae", "use_kl_in_reward": True, "gamma": 1.0, "lam": 0.95,
                                "kl_ctrl": {"type": "adaptive", "kl_coef": 0.05, "target_kl": 0.01, "horizon": 100}},
                     critic={"ppo_mini_batch_size": 2, "micro_batch_size": 4}, warm_start={"steps": 0})
    state, summary = _run(config)
    layout = RunLayout(config.run.storage_root, "ppo")
    for step in range(2):
        assert validate_stage_file(layout, step, "values", expected_rows=PROMPTS * SAMPLES)
    client = MlflowClient(tracking_uri=config.tracking.tracking_uri)
    run_id = summary["mlflow_run_id"]
    for name in ("critic/vf_loss", "critic/values/mean", "timing_s/update_critic", "actor/reward_kl_penalty"):
        assert [m.step for m in client.get_metric_history(run_id, name)] == [1, 2], name
    coefficients = [m.value for m in client.get_metric_history(run_id, "actor/reward_kl_penalty_coeff")]
    kl_first = client.get_metric_history(run_id, "actor/reward_kl_penalty")[0].value
    # Adaptive controller (Ziegler et al.): coef *= 1 + clip(kl/target - 1, -0.2, 0.2) * n / horizon.
    expected = 0.05 * (1 + max(-0.2, min(0.2, kl_first / 0.01 - 1)) * (PROMPTS * SAMPLES) / 100)
    assert coefficients[0] == pytest.approx(0.05)
    assert coefficients[1] == pytest.approx(expected, rel=1e-6)
    names = _task_names(state.state_details.flow_run_id)
    assert names.count("values") == 2 and names.count("update_critic") == 2


def test_existing_run_folder_is_refused_before_any_model_loads(prefect_api, tmp_path, tiny_inputs, _config):
    from flows.config import ConfigError
    from flows.training.train import train

    config = _config(tmp_path, tiny_inputs, "taken")
    layout = RunLayout(config.run.storage_root, "taken")
    layout.fs.makedirs(layout.run_dir)
    (tmp_path / "runs" / "taken" / "keep.txt").write_text("earlier work")
    loads_before = dict(LOAD_COUNTS)
    with pytest.raises(ConfigError, match="run.name='taken'.*already exists"):
        train(config)
    assert (tmp_path / "runs" / "taken" / "keep.txt").read_text() == "earlier work"
    assert LOAD_COUNTS == loads_before


def test_on_policy_update_skips_the_old_logprob_pass(prefect_api, tmp_path, tiny_inputs, _config):
    """One epoch, one mini-batch of the whole step: no old_logprobs stage; the update's own forward
    gives the rollout consistency metrics."""
    config = _config(tmp_path, tiny_inputs, "on-policy",
                     actor={"ppo_mini_batch_size": PROMPTS, "micro_batch_size": 4})
    assert config.on_policy_update
    state, _ = _run(config)
    layout = RunLayout(config.run.storage_root, "on-policy")
    for step in range(2):
        assert validate_stage_file(layout, step, "advantages", expected_rows=PROMPTS * SAMPLES)
        assert not layout.exists(layout.stage_path(step, "old_logprobs"))
    assert "old_logprobs" not in _task_names(state.state_details.flow_run_id)
    client = MlflowClient(config.tracking.tracking_uri)
    run = client.search_runs([client.get_experiment_by_name("e2e").experiment_id],
                             "tags.`rlhf.run_name` = 'on-policy'")[0]
    gap = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "rollout/logprob_diff_mean")}
    assert sorted(gap) == [1, 2] and all(0 <= value < 0.02 for value in gap.values()), gap


def test_bf16_compute_trains_fp32_masters_at_lr_1e_6_and_logs_the_update_size(prefect_api, tmp_path, tiny_inputs,
                                                                               _config):
    """The issue's repro: bf16 compute at an RL learning rate. The masters move, the rollout gets bf16 casts of
    them, and actor/update_rms_ratio says so in MLflow and in the Prefect metrics table."""
    import json

    import torch
    from safetensors.torch import load_file

    config = _config(tmp_path, tiny_inputs, "grpo", model={"compute_dtype": "bfloat16"},
                     actor={"optim": {"lr": 1e-6}, "ppo_mini_batch_size": 4, "micro_batch_size": 8},
                     reward={"function": "dense_reward:digit_share"}, warm_start={"steps": 0},
                     trainer={"val_every": 0, "checkpoint_every": 1})
    assert config.model.master_dtype == "float32"  # the default
    _, summary = _run(config)
    layout = RunLayout(config.run.storage_root, "grpo")
    initial = load_file(f"{tiny_inputs['model']}/model.safetensors")
    masters = load_file(f"{layout.checkpoint_dir(2)}/actor/model.safetensors")
    published = load_file(f"{layout.weights_dir('actor', 2)}/model.safetensors")
    with open(f"{layout.weights_dir('actor', 2)}/config.json") as file:
        assert json.load(file)["dtype"] == "bfloat16"
    changed = total = 0
    for name, tensor in masters.items():
        assert tensor.dtype == torch.float32, name
        assert torch.equal(published[name], tensor.to(torch.bfloat16)), name  # the rollout's copy: a cast
        changed += int((tensor != initial[name]).sum())
        total += tensor.numel()
    assert changed > 0.9 * total  # two AdamW steps of ~1e-6 kept by the fp32 masters

    client = MlflowClient(tracking_uri=config.tracking.tracking_uri)
    ratios = client.get_metric_history(summary["mlflow_run_id"], "actor/update_rms_ratio")
    assert [m.step for m in ratios] == [1, 2]
    assert all(1e-7 < m.value < 1e-3 for m in ratios), [m.value for m in ratios]

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    with get_client(sync_client=True) as prefect:
        found = prefect.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["grpo-metrics"])))
    table = sorted(found, key=lambda artifact: artifact.created)[-1].data
    rows = json.loads(table) if isinstance(table, str) else table
    assert [row["actor/update_rms_ratio"] for row in rows] == pytest.approx([m.value for m in ratios], rel=1e-4)
