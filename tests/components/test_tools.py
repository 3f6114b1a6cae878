"""Tests for the calculator and the user tools of multi-turn rollouts (components/tools.py)."""

from __future__ import annotations

import time

import pytest

from components.tools import (CALCULATOR_MAX_DIGITS, CalculatorError, calculator, evaluate_expression, load_tool,
                              load_tools, run_tool)


@pytest.mark.parametrize("expression, expected", [
    ("123456789*987654321", "121932631112635269"),
    ("2+3*4", "14"),
    ("(2+3)*4", "20"),
    ("7/2", "3.5"),
    ("8/2", "4"),  # an integral float is written as an integer
    ("10//3", "3"),
    ("10 % 4", "2"),
    ("-(3+4)*2", "-14"),
    ("2**10", "1024"),
    ("abs(-4) + max(1, 2) + min(5, 3) + round(2.6)", "12"),
    ("99999999999999999999 + 1", "100000000000000000000"),
])
def test_calculator_computes_exact_values(expression, expected):
    assert calculator(expression) == expected


@pytest.mark.parametrize("expression, message", [
    ("__import__('os').system('ls')", "is not allowed"),
    ("open('/etc/passwd').read()", "is not allowed"),
    ("x + 1", "is not allowed"),
    ("(1).__class__", "is not allowed"),
    ("[1, 2]", "is not allowed"),
    ("'a' * 3", "is not allowed"),
    ("True + 1", "is not allowed"),
    ("1 << 5", "is not allowed"),
    ("2 ** 100000", f"more than {CALCULATOR_MAX_DIGITS} digits"),  # refused before it is computed
    ("9" * 990 + "*10**11", f"more than {CALCULATOR_MAX_DIGITS} digits"),
    ("10**600 * 10**600", f"more than {CALCULATOR_MAX_DIGITS} digits"),
    ("2.0 ** 10000", "too large for a float"),
    ("1/0", "division by zero"),
    ("(-8) ** 0.5", "not a real number"),
    ("1 +", "is not an arithmetic expression"),
    ("1+" * 600 + "1", "longer than"),
])
def test_calculator_refuses_what_is_not_bounded_arithmetic(expression, message):
    with pytest.raises(CalculatorError, match=message):
        evaluate_expression(expression)


def test_a_deep_expression_is_refused_by_its_size_quickly():
    started = time.perf_counter()
    with pytest.raises(CalculatorError, match="more than 400 parts"):
        evaluate_expression("+".join(["1"] * 300))
    assert time.perf_counter() - started < 1.0


def _slow(seconds: float) -> str:
    time.sleep(seconds)
    return "late"


def _broken(value: int) -> str:
    raise RuntimeError(f"no answer for {value}")


def _table(rows: int) -> dict:
    return {"rows": rows}


def test_run_tool_answers_or_writes_one_error_line():
    tools = {"calculator": calculator, "slow": _slow, "broken": _broken, "table": _table}
    assert run_tool(tools, "calculator", {"expression": "6*7"}, 1.0) == ("42", None)
    assert run_tool(tools, "table", {"rows": 3}, 1.0) == ('{"rows": 3}', None)  # JSON for what is not text
    text, error = run_tool(tools, "nope", {}, 1.0)
    assert text == "error: unknown tool 'nope'; the tools are broken, calculator, slow, table" and error == text[7:]
    assert run_tool(tools, "calculator", {"expr": "1"}, 1.0)[0] == \
        "error: tool 'calculator': missing a required argument: 'expression'"
    assert run_tool(tools, "calculator", ["1"], 1.0)[0] == \
        "error: tool 'calculator': arguments must be a JSON object, got list"
    assert run_tool(tools, "broken", {"value": 3}, 1.0)[0] == "error: tool 'broken' failed: RuntimeError: no answer for 3"
    assert run_tool(tools, "calculator", {"expression": "1/0"}, 1.0)[0] == \
        "error: tool 'calculator' failed: CalculatorError: division by zero"
    started = time.perf_counter()
    assert run_tool(tools, "slow", {"seconds": 2.0}, 0.1)[0] == "error: tool 'slow' timed out after 0.1 s"
    assert time.perf_counter() - started < 1.0


def test_tools_are_named_like_reward_functions():
    assert load_tool("calculator") == ("calculator", calculator)
    name, function = load_tool("tests.components.test_tools:_table")
    assert name == "_table" and function(rows=2) == {"rows": 2}
    assert list(load_tools(["calculator", "tests.components.test_tools:_slow"])) == ["calculator", "_slow"]
    with pytest.raises(ValueError, match=r"rollout.tools: 'calc' is not a tool; use a built-in tool \(calculator\)"):
        load_tool("calc")
    with pytest.raises(ValueError, match="module 'no_such_module' cannot be imported"):
        load_tool("no_such_module:f")
    with pytest.raises(ValueError, match="module 'math' has no function 'nothing'"):
        load_tool("math:nothing")
    with pytest.raises(ValueError, match="two tools are named 'calculator'"):
        load_tools(["calculator", "calculator"])
