"""Tests for rule rewards, user reward functions and the reward model."""

import math

import pytest

from components.rewards import (REWARD_FUNCTIONS, RewardFunctionError, RewardModel, load_reward_function,
                                score_responses)
from components.tiny import build_tiny_model


@pytest.mark.parametrize(
    ("response", "truth", "expected"),
    [("46", "46", 1.0), ("  46\n", " 46 ", 1.0), ("46<|endoftext|>", "46", 1.0),
     ("46<|im_end|>junk", "46", 1.0), ("460", "46", 0.0), ("4 6", "46", 0.0), ("", "46", 0.0),
     ("-3", "-3", 1.0)],
)
def test_exact_match(response, truth, expected):
    assert REWARD_FUNCTIONS["exact_match"](response, truth) == expected


@pytest.mark.parametrize(
    ("response", "truth", "expected"),
    [("so #### 1,234", "1234", 1.0), ("#### 12 then #### 13", "13", 1.0),
     ("#### 12 then #### 13", "12", 0.0), ("the answer is 72", "72", 0.0), ("#### -5", "-5", 1.0),
     ("#### 5", "-5", 0.0), ("####72", "72", 0.0), ("#### 3.5", "3.5", 1.0),
     # verl's strict scorer: the ground truth as given (a comma in it never matches), a "$" after "#### " is
     # no number, and only the last 300 characters of the response are searched.
     ("#### 1234", "1,234", 0.0), ("#### $1,234", "1234", 0.0), ("#### 7" + "x" * 300, "7", 0.0),
     ("x" * 500 + "#### 7", "7", 1.0)],
)
def test_gsm8k(response, truth, expected):
    assert REWARD_FUNCTIONS["gsm8k"](response, truth) == expected


@pytest.mark.parametrize(
    ("response", "truth", "expected"),
    [("so it is 72.", "72.", 1.0), ("72 apples, then 8", "8", 1.0), ("72 apples, then 8", "72", 0.0),
     ("no number", "1", 0.0), ("1,234", "1,234", 1.0)],
)
def test_gsm8k_flexible(response, truth, expected):
    assert REWARD_FUNCTIONS["gsm8k_flexible"](response, truth) == expected


def test_a_verl_compute_score_and_this_projects_signature_both_get_the_fields_by_name(tmp_path, monkeypatch):
    (tmp_path / "verl_style.py").write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return float(solution_str.endswith(ground_truth)) + (10 if extra_info['split'] == 'test' else 0)"
        " + (100 if data_source == 'openai/gsm8k' else 0)\n"
        "def ours(response_text, ground_truth, data_source='', extra_info=None):\n"
        "    return float(response_text == ground_truth)\n"
        "def everything(**fields):\n"
        "    return float(len(fields))\n"
        "def strange(text, answer):\n"
        "    return 0.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    verl = load_reward_function("verl_style:compute_score")
    assert score_responses(verl, ["x 7", "x 8"], ["7", "7"], ["openai/gsm8k", "other"],
                           [{"split": "test"}, {"split": "train"}]) == [111.0, 0.0]
    assert score_responses(load_reward_function("verl_style:ours"), ["7", "8"], ["7", "7"], ["", ""]) == [1.0, 0.0]
    # **kwargs receives every field: data_source, solution_str, response_text, ground_truth, extra_info
    assert score_responses(load_reward_function("verl_style:everything"), ["7"], ["7"], [""]) == [5.0]
    with pytest.raises(ValueError, match=r"reward.function='verl_style:strange': its parameter 'text' is not a field"):
        load_reward_function("verl_style:strange")


def test_auto_routes_by_data_source_as_verl():
    auto = load_reward_function("auto")
    assert score_responses(auto, ["#### 7", "#### 7", "7"], ["7", "7", "7"], ["openai/gsm8k", "arithmetic", "arithmetic"]) \
        == [1.0, 0.0, 1.0]  # gsm8k for openai/gsm8k; exact match elsewhere


def test_user_function_loading(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(
        "NOT_CALLABLE = 3\n"
        "def length_reward(response_text, ground_truth, data_source='', extra_info=None):\n"
        "    return len(response_text) + (100 if data_source == 'x' else 0)\n"
        "def nan_reward(response_text, ground_truth, data_source='', extra_info=None):\n"
        "    return float('nan') if response_text == 'bad' else 0.0\n"
        "def text_reward(response_text, ground_truth, data_source='', extra_info=None):\n"
        "    return 'high'\n"
        "def raising_reward(response_text, ground_truth, data_source=''):\n"
        "    return 1.0 / len(response_text)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    function = load_reward_function("my_rewards:length_reward")
    assert score_responses(function, ["ab", "abc"], ["", ""], ["x", "y"]) == [102.0, 3.0]
    assert load_reward_function("exact_match") is REWARD_FUNCTIONS["exact_match"]
    with pytest.raises(ValueError, match=r"nan_reward returned nan for sample 1; rewards must be finite"):
        score_responses(load_reward_function("my_rewards:nan_reward"), ["ok", "bad"], ["", ""], ["", ""])
    with pytest.raises(ValueError, match=r"text_reward returned 'high' for sample 0"):
        score_responses(load_reward_function("my_rewards:text_reward"), ["ok"], [""], [""])
    # A function that raises: one line naming it and the sample, the original exception as the cause.
    with pytest.raises(RewardFunctionError) as error:
        score_responses(load_reward_function("my_rewards:raising_reward"), ["ok", ""], ["", ""], ["x", "gsm8k"])
    assert str(error.value) == ("reward function my_rewards:raising_reward raised ZeroDivisionError: float division by "
                                "zero on sample 1 (data_source 'gsm8k'); fix the function (rlhf --debug shows its "
                                "traceback)")
    assert error.value.index == 1 and isinstance(error.value.__cause__, ZeroDivisionError)


@pytest.mark.parametrize(
    ("spec", "fragment"),
    [("nonexistent", "not a registered reward function"), ("no_such_module_xyz:f", "cannot import module"),
     ("math:no_such_function", "has no attribute 'no_such_function'"), ("math:pi", "not callable"),
     (":f", "empty module")],
)
def test_bad_specs(spec, fragment):
    with pytest.raises(ValueError) as error:
        load_reward_function(spec, field="reward.custom")
    message = str(error.value)
    assert message.startswith(f"reward.custom={spec!r}") and fragment in message
    assert "exact_match" in message and "gsm8k" in message


def test_reward_model_scores_are_padding_invariant(tmp_path):
    model = RewardModel.from_pretrained(str(build_tiny_model(tmp_path / "rm")))
    assert model.model.config.num_labels == 1
    short = model.score(["1+2="], ["3"])
    prompts, responses = ["1+2=", "a much longer prompt here: 40+50="], ["3", "90 and more text"]
    batched = model.score(prompts, responses, micro_batch_size=2)
    assert len(short) == 1 and len(batched) == 2
    assert all(math.isfinite(score) for score in short + batched)
    assert abs(short[0] - batched[0]) < 1e-5
    assert batched[0] != batched[1]
    with pytest.raises(ValueError, match="2 prompts but 1 responses"):
        model.score(["a", "b"], ["c"])
