"""Tools a multi-turn rollout's policy can call: the built-in calculator and user functions (`module:function`).

A tool is a Python function called by keyword with the `arguments` object of the policy's call; what it returns
(a string, or anything `json.dumps` writes) is the tool's answer. A call that fails (an unknown tool, arguments the
function does not take, an exception, a timeout) answers an `error: ...` line instead, which goes into the
transcript like any answer: the policy sees what went wrong, and the rollout goes on.

`calculator` (built in) evaluates one arithmetic expression without `eval`: the expression is parsed with `ast`
and only number literals, + - * / // % **, unary signs, parentheses and abs/min/max/round are evaluated, so no
name, attribute, call of anything else, file system or network is reachable. Size and time are bounded: the
expression's length and node count, every intermediate integer's digits (an exponent is checked before it is
computed) and a deadline checked at every node.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import json
import math
import operator
import threading
import time
from typing import Callable

ToolFunction = Callable[..., object]

CALCULATOR_MAX_CHARS = 1000
"""Longest expression the calculator reads."""
CALCULATOR_MAX_NODES = 400
"""Most syntax-tree nodes of one expression."""
CALCULATOR_MAX_DIGITS = 1000
"""Most decimal digits of any integer the calculator computes (memory bound)."""
CALCULATOR_TIME_S = 1.0
"""Deadline of one evaluation."""
DEFAULT_TOOL_RESPONSE_TEMPLATE = "\n<tool_response>\n{result}\n</tool_response>\n"
"""rollout.tool_response_template's default: Hermes' tool message body."""
MAX_ANSWER_CHARS = 2000
"""A tool's answer is cut to this many characters (the transcript says so)."""

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_FUNCTIONS = {"abs": abs, "min": min, "max": max, "round": round}
_MAX_BITS = int(CALCULATOR_MAX_DIGITS * math.log2(10)) + 1


class CalculatorError(ValueError):
    """An expression the calculator refuses or cannot evaluate; the message says why."""


def _check_size(value):
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise CalculatorError(f"{value!r} is not a number")
    if isinstance(value, int) and value.bit_length() > _MAX_BITS:
        raise CalculatorError(f"a result has more than {CALCULATOR_MAX_DIGITS} digits")
    if isinstance(value, float) and not math.isfinite(value):
        raise CalculatorError("a result is not finite")
    return value


def _power(base, exponent):
    if isinstance(base, int) and isinstance(exponent, int) and exponent > 0 and abs(base) > 1:
        if (abs(base).bit_length() - 1) * exponent > _MAX_BITS:  # checked before the number is made
            raise CalculatorError(f"a result has more than {CALCULATOR_MAX_DIGITS} digits")
    if isinstance(exponent, int) and abs(exponent) > 100_000:
        raise CalculatorError("an exponent is too large")
    return base ** exponent


class _Evaluator:
    def __init__(self, deadline: float):
        self.deadline = deadline

    def value(self, node: ast.AST):
        if time.perf_counter() > self.deadline:
            raise CalculatorError(f"the evaluation took longer than {CALCULATOR_TIME_S} s")
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
            return _check_size(node.value)
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = self.value(node.left), self.value(node.right)
            try:
                result = _power(left, right) if isinstance(node.op, ast.Pow) else _BINARY[type(node.op)](left, right)
            except ZeroDivisionError:
                raise CalculatorError("division by zero") from None
            except OverflowError:
                raise CalculatorError("a result is too large for a float") from None
            if isinstance(result, complex):
                raise CalculatorError("a result is not a real number")
            return _check_size(result)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _check_size(_UNARY[type(node.op)](self.value(node.operand)))
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _FUNCTIONS
                and not node.keywords and node.args):
            arguments = [self.value(argument) for argument in node.args]
            try:
                return _check_size(_FUNCTIONS[node.func.id](*arguments))
            except TypeError as error:
                raise CalculatorError(f"{node.func.id}: {error}") from None
        raise CalculatorError(f"{ast.unparse(node)!r} is not allowed (numbers, + - * / // % **, parentheses and "
                              f"{', '.join(sorted(_FUNCTIONS))} only)")


def evaluate_expression(expression: str) -> int | float:
    """The value of an arithmetic expression, or CalculatorError (why it was refused)."""
    if not isinstance(expression, str):
        raise CalculatorError(f"the expression must be text, got {type(expression).__name__}")
    if len(expression) > CALCULATOR_MAX_CHARS:
        raise CalculatorError(f"the expression is longer than {CALCULATOR_MAX_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise CalculatorError(f"{expression!r} is not an arithmetic expression") from None
    if sum(1 for _ in ast.walk(tree)) > CALCULATOR_MAX_NODES:
        raise CalculatorError(f"the expression has more than {CALCULATOR_MAX_NODES} parts")
    return _Evaluator(time.perf_counter() + CALCULATOR_TIME_S).value(tree.body)


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression exactly (integers of any size up to 1000 digits; / gives a float)."""
    value = evaluate_expression(expression)
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        return str(int(value))
    return str(value)


BUILTIN_TOOLS: dict[str, ToolFunction] = {"calculator": calculator}
"""Tools named by a bare name in rollout.tools."""


def load_tool(spec: str, field: str | None = "rollout.tools") -> tuple[str, ToolFunction]:
    """(the name the policy calls it by, the function) for a built-in name or a user `package.module:function`
    (called by the function's name); ValueError naming the field (when given) and the value otherwise."""
    where = f"{field}: " if field else ""
    valid = f"use a built-in tool ({', '.join(sorted(BUILTIN_TOOLS))}) or 'module:function'"
    if isinstance(spec, str) and spec in BUILTIN_TOOLS:
        return spec, BUILTIN_TOOLS[spec]
    if not isinstance(spec, str) or spec.count(":") != 1 or not all(spec.split(":")):
        raise ValueError(f"{where}{spec!r} is not a tool; {valid}")
    module_name, attribute = spec.split(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as error:  # a user module may fail with anything at import time
        raise ValueError(f"{where}{spec!r}: module {module_name!r} cannot be imported "
                         f"({type(error).__name__}: {error}); {valid}") from None
    function = getattr(module, attribute, None)
    if not callable(function):
        raise ValueError(f"{where}{spec!r}: module {module_name!r} has no function {attribute!r}; {valid}")
    return attribute, function


def load_tools(specs, field: str | None = "rollout.tools") -> dict[str, ToolFunction]:
    """Every tool of rollout.tools by the name the policy calls it; ValueError on a name given twice."""
    tools: dict[str, ToolFunction] = {}
    for spec in specs:
        name, function = load_tool(spec, field)
        if name in tools:
            raise ValueError(f"{field + ': ' if field else ''}two tools are named {name!r} ({spec!r}); give each tool "
                             "its own name")
        tools[name] = function
    return tools


def _answer_text(value) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    if len(text) > MAX_ANSWER_CHARS:
        return text[:MAX_ANSWER_CHARS] + f" [cut at {MAX_ANSWER_CHARS} characters]"
    return text


def run_tool(tools: dict[str, ToolFunction], name, arguments, timeout_s: float) -> tuple[str, str | None]:
    """(the answer, None) or (an `error: ...` line, the error) for one call. A user tool runs on a thread of its
    own and is given up on after `timeout_s` (Python cannot stop a thread: one that never returns keeps it)."""
    if name not in tools:
        error = f"unknown tool {name!r}; the tools are {', '.join(sorted(tools))}"
        return f"error: {error}", error
    if not isinstance(arguments, dict):
        error = f"tool {name!r}: arguments must be a JSON object, got {type(arguments).__name__}"
        return f"error: {error}", error
    function = tools[name]
    try:
        inspect.signature(function).bind(**arguments)
    except TypeError as problem:
        error = f"tool {name!r}: {problem}"
        return f"error: {error}", error
    except ValueError:  # no signature to check (a builtin): the call says
        pass
    outcome: dict = {}

    def call() -> None:
        try:
            outcome["value"] = function(**arguments)
        except BaseException as problem:  # the transcript carries whatever the tool raised
            outcome["error"] = problem

    thread = threading.Thread(target=call, name=f"tool-{name}", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        error = f"tool {name!r} timed out after {timeout_s:g} s"
        return f"error: {error}", error
    if "error" in outcome:
        problem = outcome["error"]
        error = f"tool {name!r} failed: {type(problem).__name__}: {problem}"
        return f"error: {error}", error
    try:
        return _answer_text(outcome.get("value")), None
    except (TypeError, ValueError) as problem:
        error = f"tool {name!r} returned what is not text or JSON: {problem}"
        return f"error: {error}", error
