"""flows.tools.doctor_data: `rlhf doctor CONFIG --data`, the starting reward on a few validation prompts.

The reward functions here score without looking at the response (or the tests fix the responses), so that no
value depends on what the random tiny model generates.
"""

from __future__ import annotations

import argparse
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from components.rewards import RewardModel
from components.rollout import Generation, HFRolloutEngine
from flows.config import build_config
from flows.tools import doctor, doctor_data

REWARDS = '''
def always_one(response_text, ground_truth):
    return 1.0

def always_zero(response_text, ground_truth):
    return 0.0

def quarter_of_truth(ground_truth):
    return float(ground_truth) / 4

def no_key(response_text):
    raise RuntimeError("no API key set")
'''
NO_SIGNAL = "RL gets no signal while every sample of a group scores the same (its advantages are 0)"
ZERO_WARNING = (f"  warn  the model scores 0 on every prompt: {NO_SIGNAL}; check the reward function and answer "
                "format, or warm-start (warm_start.steps)")
ONE_WARNING = (f"  warn  the model scores 1 on every prompt: {NO_SIGNAL}; check that the reward function scores the "
               "answer, or use harder prompts")


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """The tiny model, the arithmetic task (20 validation prompts), four prompts whose ground truths are 1..4,
    and a module of reward functions."""
    from components.tasks.arithmetic import write_arithmetic_dataset
    from components.tiny import build_tiny_model

    root = tmp_path_factory.mktemp("doctor-data")
    arithmetic = write_arithmetic_dataset(root / "arithmetic", train_size=20, validation_size=20)
    rows = [{"data_source": "counting", "prompt": [{"role": "user", "content": f"question {n}"}],
             "reward_model": {"ground_truth": str(n)}} for n in (1, 2, 3, 4)]
    pq.write_table(pa.Table.from_pylist(rows), root / "four.parquet")
    (root / "rewards").mkdir()
    (root / "rewards" / "doctor_data_rewards.py").write_text(REWARDS)
    (root / "broken.parquet").write_text("not parquet")
    return {"model": str(build_tiny_model(root / "tiny")), "train": str(arithmetic["train"]),
            "validation": str(arithmetic["validation"]), "four": str(root / "four.parquet"),
            "broken": str(root / "broken.parquet"), "rewards": str(root / "rewards")}


@pytest.fixture
def machine(tmp_path, monkeypatch, inputs):
    """No Prefect server configured, a private Prefect home, the working folder in tmp_path, the reward module
    importable."""
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    monkeypatch.setenv("PREFECT_HOME", str(tmp_path / "prefect"))
    for name in doctor.DISTRIBUTED_ENV + ("GROUP_RANK",):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(inputs["rewards"])
    return tmp_path


def overrides(machine, inputs, *extra: str, val: str = "validation") -> list[str]:
    return [f"run.storage_root={machine / 'runs'}", f"tracking.tracking_uri=sqlite:///{machine / 'mlflow' / 'db'}",
            f"model.path={inputs['model']}", f"data.train_files=[{inputs['train']}]",
            f"data.val_files=[{inputs[val]}]", "data.prompts_per_step=4",  # of its 20 training prompts
            "trainer.device=cpu", "rollout.max_new_tokens=8", *extra]


def data_line(report: dict, spec: str, prompts: int) -> str:
    return (f"  data    starting reward {report['data']['reward']:.3f} on {prompts} validation prompts (greedy, "
            f"reward.function={spec}), {report['data']['hit_max_new_tokens']} of {prompts} responses hit "
            "rollout.max_new_tokens=8")


def namespace(*arguments: str, json_output: bool = False, data_prompts: int = 16) -> argparse.Namespace:
    return argparse.Namespace(config=arguments[0], overrides=list(arguments[1:]), json=json_output, data=True,
                              data_prompts=data_prompts)


# --- on the tiny model, with reward functions that do not look at the response ------------------------------


def test_a_reward_of_one_on_every_prompt_warns(machine, inputs):
    spec = "doctor_data_rewards:always_one"
    config = build_config(None, overrides(machine, inputs, f"reward.function={spec}"))
    report = doctor.collect_report(config, data_prompts=16)
    data = report["data"]
    assert (data["status"], data["reward"], data["prompts"], data["scores"]) == ("warn", 1.0, 16, [1.0] * 16)
    assert data["warnings"] == [ONE_WARNING.removeprefix("  warn  ")] and not report["failed"]
    # every response that hit the limit has max_new_tokens tokens; the others ended with end-of-sequence
    assert data["hit_max_new_tokens"] == sum(sample["finish_reason"] == "length" for sample in data["samples"])
    assert all(sample["response_tokens"] == 8 for sample in data["samples"] if sample["finish_reason"] == "length")
    assert all(sample["response_tokens"] <= 8 for sample in data["samples"])
    assert (data["policy"], data["policy_note"], data["device"], data["engine"]) == (
        inputs["model"], "model.path", "cpu", "hf")
    lines = doctor.format_report(report).splitlines()
    start = lines.index("Data (--data: the starting policy's greedy answers to validation prompts)")
    assert lines[start + 1] == data_line(report, spec, 16) == f"  data    {data['detail']}"
    for line, sample in zip(lines[start + 2:start + 5], data["samples"]):
        cut = ", cut at 8 tokens" if sample["finish_reason"] == "length" else ""
        assert line == f"          {sample['prompt_tail']} -> {sample['response_head']}  score 1.000{cut}"
    assert lines[start + 5] == ONE_WARNING
    assert lines[start + 6] == f"  model   {inputs['model']} (model.path), transformers on cpu"
    assert lines[start + 7].startswith("  took    ") and ": loading " in lines[start + 7]
    assert set(data["seconds"]) == {"total", "load", "generate", "score"}
    assert json.loads(json.dumps(report)) == report


def test_a_reward_of_zero_on_every_prompt_warns(machine, inputs):
    spec = "doctor_data_rewards:always_zero"
    config = build_config(None, overrides(machine, inputs, f"reward.function={spec}"))
    report = doctor.collect_report(config, data_prompts=4)
    data = report["data"]
    assert (data["status"], data["reward"], data["scores"]) == ("warn", 0.0, [0.0] * 4)
    hits = data["hit_max_new_tokens"]
    cut = (f"; {hits} of 4 responses were cut at rollout.max_new_tokens=8: an answer at the end may be missing"
           if hits else "")
    text = doctor.format_report(report).splitlines()
    assert data_line(report, spec, 4) in text and ZERO_WARNING + cut in text
    assert text[-1] == "ok: nothing would fail"


def test_the_reward_is_the_mean_over_the_first_n_prompts_and_json_has_it(machine, inputs, capsys):
    spec = "doctor_data_rewards:quarter_of_truth"
    arguments = namespace(*overrides(machine, inputs, f"reward.function={spec}", val="four"), json_output=True,
                          data_prompts=3)
    assert doctor.cmd_doctor(arguments) == 0
    data = json.loads(capsys.readouterr().out)["data"]
    # the ground truths of the first three prompts are 1, 2, 3: (1/4 + 2/4 + 3/4) / 3
    assert (data["status"], data["scores"], data["reward"], data["prompts"], data["warnings"]) == (
        "ok", [0.25, 0.5, 0.75], 0.5, 3, [])
    assert data["detail"] == (f"starting reward 0.500 on 3 validation prompts (greedy, reward.function={spec}), "
                              f"{data['hit_max_new_tokens']} of 3 responses hit rollout.max_new_tokens=8")
    assert [sample["prompt_tail"] for sample in data["samples"]] == ["'question 1'", "'question 2'", "'question 3'"]
    assert data["max_new_tokens"] == 8 and data["reward_function"] == f"reward.function={spec}"


# --- fixed responses: auto routing, the sample lines, the reward model -------------------------------------


@pytest.fixture
def answers(monkeypatch):
    """HFRolloutEngine.generate answers each prompt with `answers.responses[i]` (finish reason `length` where
    answers.cut holds i), and records its sampling parameters."""

    class Answers:
        responses: list[str] = []
        cut: set[int] = set()
        params = None

    def generate(engine, prompt_ids, params):
        Answers.params = params
        return [Generation(prompt_index=index, sample_index=0, response_ids=[0] * len(Answers.responses[index]),
                           logprobs=None, finish_reason="length" if index in Answers.cut else "stop",
                           text=Answers.responses[index]) for index in range(len(prompt_ids))]

    monkeypatch.setattr(HFRolloutEngine, "generate", generate)
    return Answers


def test_auto_scores_by_data_source_and_the_samples_show_the_answer_format(machine, inputs, answers):
    config = build_config(None, overrides(machine, inputs, "rollout.stop=[\"\\n\"]"))
    first = [row["prompt"][0]["content"] for row in pq.read_table(inputs["validation"]).to_pylist()[:4]]
    truths = [str(eval(prompt.rstrip("="))) for prompt in first]
    answers.responses = [truths[0], "no idea " * 10, truths[2], truths[3] + "!"]
    answers.cut = {1}
    report = doctor.collect_report(config, data_prompts=4)
    assert answers.params.temperature == 0 and answers.params.max_new_tokens == 8 and answers.params.stop == ("\n",)
    data = report["data"]
    assert (data["status"], data["scores"], data["reward"]) == ("ok", [1.0, 0.0, 1.0, 0.0], 0.5)
    lines = doctor.format_report(report).splitlines()
    start = lines.index("Data (--data: the starting policy's greedy answers to validation prompts)")
    assert lines[start + 1:start + 5] == [
        "  data    starting reward 0.500 on 4 validation prompts (greedy, reward.function=auto: exact_match), "
        "1 of 4 responses hit rollout.max_new_tokens=8",
        f"          {first[0]!r} -> {truths[0]!r}  score 1.000",
        f"          {first[1]!r} -> {('no idea ' * 10)[:60]!r}...  score 0.000, cut at 80 tokens",
        f"          {first[2]!r} -> {truths[2]!r}  score 1.000"]
    assert lines[start + 5].startswith("  model   ")


def test_zero_before_a_warm_start_names_the_warm_start(machine, inputs, answers):
    answers.responses = ["?"] * 2
    config = build_config(None, overrides(machine, inputs, "warm_start.steps=5"))
    data = doctor.collect_report(config, data_prompts=2)["data"]
    assert data["warnings"] == ["the model scores 0 on every prompt before the warm-start (warm_start.steps=5): RL "
                                "starts from what it teaches; check that its target (warm_start.target) has the "
                                "answer format the reward function scores"]
    assert data["policy_note"] == "model.path, before the warm-start (warm_start.steps=5 trains it first)"


def test_a_reward_model_scores_the_prompt_as_the_policy_saw_it(machine, inputs, answers):
    answers.responses = ["12", "345"]
    config = build_config(None, overrides(machine, inputs, "reward.kind=model", f"reward.model_path={inputs['model']}"))
    torch.manual_seed(0)  # the tiny causal LM has no score head: each load draws one, the same one after this seed
    data = doctor.collect_report(config, data_prompts=2)["data"]
    prompts = [row["prompt"][0]["content"] for row in pq.read_table(inputs["validation"]).to_pylist()[:2]]
    torch.manual_seed(0)
    expected = RewardModel.from_pretrained(inputs["model"]).score(prompts, answers.responses)
    assert data["scores"] == pytest.approx(expected, abs=1e-6) and data["reward"] == pytest.approx(sum(expected) / 2)
    assert data["reward_function"] == f"reward.kind=model: the reward model {inputs['model']}"
    assert data["warnings"] == [] and data["status"] == "ok"  # a reward model's scale is its own: no 0/1 warnings


# --- errors are one line ------------------------------------------------------------------------------------


def test_a_missing_model_or_bad_data_is_one_fail_line(machine, inputs, capsys):
    missing = machine / "no-model"
    assert doctor.cmd_doctor(namespace(*overrides(machine, inputs, f"model.path={missing}"))) == 1
    lines = capsys.readouterr().out.splitlines()
    assert f"  FAIL  data    model.path={str(missing)!r} does not exist; give a local model folder or a Hugging Face " \
           "hub name (`rlhf make-tiny-model DIR` writes a tiny one)" in lines
    assert lines[-1] == "FAIL: inputs, data (see the FAIL lines)"  # the preflight refuses it too
    config = build_config(None, overrides(machine, inputs, val="broken"))
    data = doctor.collect_report(config, data_prompts=16)["data"]
    assert data["status"] == "fail" and data["detail"].startswith(
        f"data.val_files: file {inputs['broken']!r} is not a readable Parquet file")


def test_a_reward_function_that_raises_is_one_fail_line(machine, inputs, answers):
    answers.responses = ["1"]
    config = build_config(None, overrides(machine, inputs, "reward.function=doctor_data_rewards:no_key"))
    report = doctor.collect_report(config, data_prompts=1)
    assert report["failed"] and report["data"]["detail"] == (
        "reward function doctor_data_rewards:no_key raised RuntimeError: no API key set on sample 0 (data_source "
        "'arithmetic'); fix the function (rlhf --debug shows its traceback)")


def test_without_a_config_data_is_skipped(machine):
    report = doctor.collect_report(None, data_prompts=16)
    assert report["data"] == doctor_data.skipped_data_report() and not report["failed"]
    assert "  skip  data    no config given: `rlhf doctor CONFIG --data` scores its starting policy" in \
        doctor.format_report(report).splitlines()


def test_parser_data_flags_and_help():
    parser = argparse.ArgumentParser(prog="rlhf")
    doctor.add_doctor_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["doctor", "configs/quickstart.yaml", "trainer.device=cpu", "--data", "--data-prompts", "4"])
    assert (args.config, args.overrides, args.data, args.data_prompts) == (
        "configs/quickstart.yaml", ["trainer.device=cpu"], True, 4)
    assert (parser.parse_args(["doctor"]).data, parser.parse_args(["doctor"]).data_prompts) == (False, 16)
    with pytest.raises(SystemExit):
        parser.parse_args(["doctor", "--data-prompts", "0"])
    help_text = parser._subparsers._group_actions[0].choices["doctor"].format_help()
    assert "example: rlhf doctor configs/quickstart.yaml --data" in help_text and "--data-prompts N" in help_text


def test_with_model_from_run_the_latest_committed_weights_answer(machine, inputs, answers):
    import shutil

    from storage import RunLayout
    from storage.layout import COMMITTED_MARKER

    answers.responses = ["1"]
    config = build_config(None, overrides(machine, inputs, "model.from_run=yesterday"))
    assert doctor.collect_report(config, data_prompts=1)["data"]["detail"] == (
        f"model.from_run='yesterday': that run has no committed actor weights under {machine / 'runs'}; give a run "
        "that has trained at least one step, or unset it")
    weights = RunLayout(str(machine / "runs"), "yesterday").weights_dir("actor", 3)
    shutil.copytree(inputs["model"], weights)
    (machine / "runs" / "yesterday" / "weights" / "actor").joinpath("3", COMMITTED_MARKER).write_text("")
    data = doctor.collect_report(config, data_prompts=1)["data"]
    assert (data["prompts"], data["policy"], data["policy_note"]) == (
        1, weights, "the actor weights of run yesterday at step 3 (model.from_run)")


def test_a_missing_reward_model_is_one_fail_line(machine, inputs):
    config = build_config(None, overrides(machine, inputs, "reward.kind=model", "reward.model_path=./no-rm"))
    assert doctor.collect_report(config, data_prompts=2)["data"]["detail"] == (
        "reward.model_path='./no-rm' does not exist; give a local model folder or a Hugging Face hub name "
        "(`rlhf make-tiny-model DIR` writes a tiny one)")
