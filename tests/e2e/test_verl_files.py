"""What a verl user brings works unchanged: a file in verl's GSM8K layout and a verl `compute_score` reward
file train one step through the real flow (Prefect server, MLflow, Parquet)."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from mlflow.tracking import MlflowClient

from storage import RunLayout, read_stage

pytestmark = pytest.mark.e2e


def gsm8k_rows(count: int, split: str) -> list[dict]:
    """Rows as verl's examples/data_preprocess/gsm8k.py writes them (questions made up, tiny)."""
    rows = []
    for index in range(count):
        a, b = index % 7 + 1, index % 5 + 2
        question = f"{a}+{b}?"
        rows.append({
            "data_source": "openai/gsm8k",
            "prompt": [{"role": "user", "content": question}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(a + b)},
            "extra_info": {"split": split, "index": index, "answer": f"{a}+{b}={a + b}\n#### {a + b}",
                           "question": question},
        })
    return rows


def test_a_verl_gsm8k_file_and_compute_score_train_one_step(prefect_api, tmp_path, make_config, monkeypatch):
    from flows.training.train import train

    pq.write_table(pa.Table.from_pylist(gsm8k_rows(8, "train")), tmp_path / "train.parquet")
    pq.write_table(pa.Table.from_pylist(gsm8k_rows(4, "test")), tmp_path / "test.parquet")
    log = tmp_path / "reward-calls.jsonl"
    monkeypatch.setenv("VERL_REWARD_LOG", str(log))
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    config = make_config(tmp_path, "verl-gsm8k",
                         data={"train_files": str(tmp_path / "train.parquet"),  # one path, as verl users write it
                               "val_files": str(tmp_path / "test.parquet"), "prompts_per_step": 4},
                         reward={"function": "verl_reward:compute_score"},
                         warm_start={"steps": 2, "batch_size": 4},
                         trainer={"total_steps": 1, "val_every": 1, "device": "cpu", "stage_timeout_s": 300})
    state = train(config, return_state=True)
    assert state.is_completed(), state

    calls = [json.loads(line) for line in log.read_text().splitlines()]
    # validation before the warm-start, before RL and after step 1 (4 prompts each), the step's 4 x 4 samples
    assert len(calls) == 4 + 4 + 16 + 4
    assert {call["data_source"] for call in calls} == {"openai/gsm8k"}
    assert all(call["extra_info"]["answer"].endswith(f"#### {call['ground_truth']}") for call in calls)
    assert {call["extra_info"]["split"] for call in calls} == {"train", "test"}
    rollout = read_stage(RunLayout(config.run.storage_root, "verl-gsm8k"), 0, "rollout")
    assert {json.loads(info)["split"] for info in rollout.column("extra_info").to_pylist()} == {"train"}
    run = MlflowClient(tracking_uri=config.tracking.tracking_uri).get_run(state.result()["mlflow_run_id"])
    assert run.data.params["reward.scorer.openai/gsm8k"] == "verl_reward:compute_score"
