"""Tests for multi-turn rollouts with tools (components/multi_turn.py): the tool-call parser, the conversation loop
with a scripted engine (one token per character), loss masks and transcripts, and the batch built from them."""

from __future__ import annotations

import json
import math

import pytest
import torch

from components.algorithms import sequence_scores_to_token_rewards
from components.batch import PaddingPlan, build_sequence_batch
from components.multi_turn import (MultiTurnSettings, ToolCall, generate_conversations, loss_mask_of,
                                   multi_turn_metrics, parse_tool_call, with_tool_trace)
from components.rewards import final_turn_number
from components.rollout import Generation, SamplingParams
from components.tools import calculator

EOS = 0
CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "2+3"}}</tool_call>'


def test_parse_tool_call_reads_the_last_complete_call():
    assert parse_tool_call(CALL) == ToolCall("calculator", {"expression": "2+3"})
    text = 'a <tool_call>{"name": "x", "arguments": {}}</tool_call> b <tool_call>{"name": "y", "arguments": {"v": 1}}</tool_call>'
    assert parse_tool_call(text) == ToolCall("y", {"v": 1})
    # arguments written as a JSON string, and a missing arguments object
    assert parse_tool_call('<tool_call>{"name": "y", "arguments": "{\\"v\\": 2}"}</tool_call>') == ToolCall("y", {"v": 2})
    assert parse_tool_call('<tool_call>{"name": "y"}</tool_call>') == ToolCall("y", {})
    assert parse_tool_call("no call here") is None
    assert parse_tool_call('<tool_call>{"name": "y"') is None  # not complete
    assert parse_tool_call("</tool_call>") is None
    broken = parse_tool_call("<tool_call>{name: y}</tool_call>")
    assert broken.name is None and broken.error.startswith("the tool call is not valid JSON (Expecting property name")
    assert parse_tool_call('<tool_call>["calculator"]</tool_call>').error == \
        'a tool call is {"name": "<tool>", "arguments": {...}}'


def test_loss_mask_of_segments():
    assert loss_mask_of([(3, True), (2, False), (1, True)]) == [1, 1, 1, 0, 0, 1]
    assert loss_mask_of([]) == []


class CharTokenizer:
    """One token per character (ord), 0 is end-of-sequence."""
    eos_token_id = EOS
    pad_token_id = EOS

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) for c in text]}

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(i) for i in ids if not (skip_special_tokens and i == EOS))


class ScriptedEngine:
    """Answers each context by `reply(context_text)`; records every call's contexts and params. Log-prob of token
    i of a turn: -(i + 1) / 10."""

    eos_token_ids = [EOS]

    def __init__(self, reply):
        self.reply, self.calls = reply, []
        self.sleep_enabled, self.sleeps = True, 0

    def sleep(self):
        self.sleeps += 1

    def generate(self, prompt_ids, params: SamplingParams):
        assert not self.sleep_enabled, "the engine slept between turns"
        self.calls.append(([bytes(ids).decode() for ids in prompt_ids], params))
        out = []
        for index, ids in enumerate(prompt_ids):
            for sample in range(params.n):
                text = self.reply("".join(chr(i) for i in ids), sample)
                tokens = [ord(c) for c in text][:params.max_new_tokens]
                finish = "stop" if tokens and (tokens[-1] == EOS or text.endswith("</tool_call>")) else "length"
                out.append(Generation(index, sample, tokens, [-(i + 1) / 10 for i in range(len(tokens))], finish))
        return out


def _reply(context: str, sample: int) -> str:
    if context.endswith("]"):  # after the tool's answer
        return "=5\x00"
    return CALL if sample == 0 else "no tool\x00"


SETTINGS = MultiTurnSettings(tools={"calculator": calculator}, max_turns=3, tool_response_template="[{result}]")


def test_conversations_call_the_tool_and_mask_its_answer():
    engine = ScriptedEngine(_reply)
    params = SamplingParams(n=2, max_new_tokens=200, seed=7)
    generations = generate_conversations(engine, CharTokenizer(), [[ord("Q")], [ord("R")]], params, SETTINGS)
    assert [(g.prompt_index, g.sample_index) for g in generations] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    called = generations[0]
    # the policy's call (len(CALL) tokens), the tool's "[5]" (3 tokens, masked), the policy's "=5<eos>" (3 tokens)
    assert called.response_ids == [ord(c) for c in CALL + "[5]=5"] + [EOS]
    assert called.loss_mask == [1] * len(CALL) + [0, 0, 0] + [1, 1, 1]
    assert called.text == CALL + "[5]=5"
    assert called.finish_reason == "stop"
    first_turn = [-(i + 1) / 10 for i in range(len(CALL))]
    assert called.logprobs[:len(CALL)] == first_turn and called.logprobs[-3:] == [-0.1, -0.2, -0.3]
    assert all(math.isnan(value) for value in called.logprobs[len(CALL):len(CALL) + 3])
    assert called.extra == {
        "turns": 2,
        "tool_calls": [{"name": "calculator", "arguments": {"expression": "2+3"}, "answer": "5", "error": None,
                        "appended": True}],
        "messages": [{"role": "assistant", "content": CALL}, {"role": "tool", "name": "calculator", "content": "5"},
                     {"role": "assistant", "content": "=5"}]}
    plain = generations[1]
    assert plain.loss_mask == [1] * 8 and plain.extra["turns"] == 1 and plain.extra["tool_calls"] == []
    # turn 1: both prompts, n=2; turn 2: only the two conversations that called, one sample each, a new seed
    (first_contexts, first), (second_contexts, second) = engine.calls
    assert first_contexts == ["Q", "R"] and first.n == 2 and first.seed == 7 and first.stop == ("</tool_call>",)
    assert second_contexts == ["Q" + CALL + "[5]", "R" + CALL + "[5]"] and second.n == 1
    assert second.seed == 7 + 1_000_003
    assert engine.sleeps == 1 and engine.sleep_enabled  # asleep once, after the last turn
    assert multi_turn_metrics(generations) == {"rollout/turns/mean": 1.5, "rollout/tool_calls/mean": 0.5,
                                               "rollout/tool_errors": 0.0,
                                               "rollout/tool_token_frac": 6 / (2 * (len(CALL) + 6) + 2 * 8)}


def test_the_last_turn_is_not_answered_and_a_tool_answer_past_the_budget_ends_the_conversation():
    always_call = ScriptedEngine(lambda context, sample: CALL)
    settings = MultiTurnSettings(tools={"calculator": calculator}, max_turns=2, tool_response_template="[{result}]")
    [two_calls] = generate_conversations(always_call, CharTokenizer(), [[1]], SamplingParams(max_new_tokens=500),
                                         settings)
    assert two_calls.loss_mask == [1] * len(CALL) + [0] * 3 + [1] * len(CALL)  # the second call is not run
    assert len(two_calls.extra["tool_calls"]) == 1 and two_calls.extra["turns"] == 2
    # budget: the call and 2 more tokens; the answer "[5]" (3) would leave none for the policy
    [cut] = generate_conversations(ScriptedEngine(_reply), CharTokenizer(), [[1]],
                                   SamplingParams(max_new_tokens=len(CALL) + 3), SETTINGS)
    assert cut.loss_mask == [1] * len(CALL) and cut.finish_reason == "length"
    assert cut.extra["tool_calls"][0]["appended"] is False


def test_a_failing_call_puts_the_error_in_the_transcript():
    bad = '<tool_call>{"name": "calculator", "arguments": {"expression": "1/0"}}</tool_call>'
    engine = ScriptedEngine(lambda context, sample: "ok\x00" if context.endswith("]") else bad)
    [generation] = generate_conversations(engine, CharTokenizer(), [[1]], SamplingParams(max_new_tokens=300), SETTINGS)
    answer = "error: tool 'calculator' failed: CalculatorError: division by zero"
    assert generation.text == bad + f"[{answer}]ok"
    assert generation.extra["tool_calls"][0]["error"] == answer[len("error: "):]
    assert multi_turn_metrics([generation])["rollout/tool_errors"] == 1.0


def test_with_tool_trace_adds_the_transcript_to_extra_info():
    generation = Generation(0, 0, [1], [0.0], "stop", extra={"turns": 2, "tool_calls": [], "messages": []})
    assert json.loads(with_tool_trace('{"split": "train"}', generation)) == {
        "split": "train", "turns": 2, "tool_calls": [], "messages": []}
    assert json.loads(with_tool_trace("null", generation))["turns"] == 2
    assert with_tool_trace('{"split": "train"}', Generation(0, 0, [1], [0.0], "stop")) == '{"split": "train"}'


def test_the_final_turn_scorer_reads_the_policys_last_turn():
    messages = [{"role": "assistant", "content": CALL}, {"role": "tool", "content": "1,234"},
                {"role": "assistant", "content": "The answer is 1,234."}]
    assert final_turn_number("ignored", "1234", {"messages": messages}) == 1.0
    # only the tool wrote the number: not the policy's answer
    assert final_turn_number("ignored", "1234", {"messages": messages[:2] + [{"role": "assistant", "content": "?"}]}) == 0.0
    assert final_turn_number("so 42", "42", None) == 1.0


def test_the_loss_mask_leaves_tool_tokens_out_of_training_but_not_of_attention():
    # response 0: policy, policy, tool, tool, policy; response 1: two policy tokens
    batch = build_sequence_batch([[5, 6], [7]], [[1, 2, 3, 4, 5], [8, 9]], 0, [[1, 1, 0, 0, 1], [1, 1]])
    assert batch.response_mask.tolist() == [[1, 1, 0, 0, 1], [1, 1, 0, 0, 0]]
    assert batch.response_tokens.tolist() == [[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1, 1, 1, 1], [0, 1, 1, 1, 0, 0, 0]]
    assert PaddingPlan(batch).response_extent.tolist() == [5, 2]
    # the score goes on the policy's last token; the advantages are 0 on the tools' tokens
    rewards = sequence_scores_to_token_rewards(torch.tensor([1.0, 2.0]), batch.response_mask)
    assert rewards.tolist() == [[0, 0, 0, 0, 1.0], [0, 2.0, 0, 0, 0]]
    holes = sequence_scores_to_token_rewards(torch.tensor([3.0]), torch.tensor([[1.0, 1.0, 0.0, 0.0]]))
    assert holes.tolist() == [[0, 3.0, 0, 0]]  # the last 1, not mask.sum() - 1
    with pytest.raises(ValueError, match="loss mask's length differs"):
        build_sequence_batch([[5]], [[1, 2]], 0, [[1]])
