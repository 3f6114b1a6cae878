"""Tests for the tool-arithmetic task (components/tasks/tool_arithmetic.py) and its make-data command."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest

from components.rewards import auto_reward
from components.tasks.tool_arithmetic import tool_arithmetic_rows, tool_call_text, write_tool_arithmetic
from components.tools import calculator
from components.multi_turn import parse_tool_call


def test_rows_pose_large_products_and_sums_with_the_call_that_solves_them():
    rows = tool_arithmetic_rows(20, seed=3, digits=6)
    assert len({row["extra_info"]["expression"] for row in rows}) == 20
    for row in rows:
        expression = row["extra_info"]["expression"]
        a, operation, b = expression.partition("*") if "*" in expression else expression.partition("+")
        assert len(a) == len(b) == 6
        assert row["reward_model"]["ground_truth"] == str(int(a) * int(b) if operation == "*" else int(a) + int(b))
        assert row["data_source"] == "tool_arithmetic" and f"Compute {expression}." in row["prompt"][0]["content"]
        call = parse_tool_call(row["extra_info"]["tool_call"])  # the documented call format, readable as such
        assert call.name == "calculator" and calculator(**call.arguments) == row["reward_model"]["ground_truth"]
        # the demonstration: the call, the calculator's answer, the policy saying it; auto's scorer gives it 1
        demonstration = row["extra_info"]["demonstration"]
        assert [m["role"] for m in demonstration] == ["assistant", "tool", "assistant"]
        assert demonstration[0]["content"] == row["extra_info"]["tool_call"]
        assert demonstration[1]["content"] == demonstration[2]["content"] == row["reward_model"]["ground_truth"]
        assert auto_reward("tool_arithmetic", "", row["reward_model"]["ground_truth"],
                           {"messages": demonstration}) == 1.0
    assert tool_call_text("1+2") == '<tool_call>{"name": "calculator", "arguments": {"expression": "1+2"}}</tool_call>'


def test_auto_reward_scores_the_policys_last_turn():
    messages = [{"role": "assistant", "content": tool_call_text("12*3")}, {"role": "tool", "content": "36"},
                {"role": "assistant", "content": "So 36"}]
    assert auto_reward("tool_arithmetic", "anything", "36", {"messages": messages}) == 1.0
    assert auto_reward("tool_arithmetic", "anything", "36", {"messages": messages[:2]}) == 0.0  # no turn after the tool


def test_written_splits_are_disjoint(tmp_path):
    paths = write_tool_arithmetic(tmp_path, 30, 10, seed=0, digits=2)
    expressions = {split: {json.loads(json.dumps(info))["expression"]
                           for info in pq.read_table(path).column("extra_info").to_pylist()}
                   for split, path in paths.items()}
    assert len(expressions["train"]) == 30 and len(expressions["validation"]) == 10
    assert not expressions["train"] & expressions["validation"]
    with pytest.raises(ValueError, match="digits=0 must be between 1 and 40"):
        tool_arithmetic_rows(1, 0, digits=0)
    with pytest.raises(ValueError, match="at most 200 exist for digits=1"):
        tool_arithmetic_rows(201, 0, digits=1)
