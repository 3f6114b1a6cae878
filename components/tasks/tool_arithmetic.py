"""Arithmetic with large numbers, where a calculator makes the answer exact (`rlhf make-data tool-arithmetic`).

A row asks for the product or sum of two `digits`-digit numbers and says how to call the built-in calculator
(components/tools.py) in the tool-call format of multi-turn rollouts (components/multi_turn.py). It is scored by
`final_turn_number` (reward.function=auto picks it for data_source `tool_arithmetic`): the last number of the policy's
last turn, so a number only the tool wrote does not count. `extra_info.demonstration` is the conversation that
solves it (the call, the calculator's answer, the final number: warm_start.target=extra_info.demonstration trains
on the policy's two turns and reads the tool's); `extra_info.tool_call` is the call alone and
`extra_info.expression` its expression. Train and validation problems are disjoint.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from components.tasks.arithmetic import SPLIT_FILES, _write_parquet_atomically

TOOL_ARITHMETIC_SOURCE = "tool_arithmetic"
PROMPT_TEMPLATE = ("Compute {expression}. You may use the calculator: write <tool_call>{{\"name\": \"calculator\", "
                   "\"arguments\": {{\"expression\": \"...\"}}}}</tool_call> and its answer comes back between "
                   "<tool_response> tags. End your reply with the final number.")
OPERATIONS = ("*", "+")


def tool_call_text(expression: str) -> str:
    """The call of the calculator on `expression`, as the policy writes it."""
    return "<tool_call>" + json.dumps({"name": "calculator", "arguments": {"expression": expression}}) + "</tool_call>"


def demonstration(expression: str, answer: int) -> list[dict]:
    """The conversation that solves `expression`: the policy calls the calculator, reads its answer, says it."""
    return [{"role": "assistant", "content": tool_call_text(expression)},
            {"role": "tool", "content": str(answer)},
            {"role": "assistant", "content": str(answer)}]


def tool_arithmetic_rows(count: int, seed: int, digits: int = 6, split: str = "train",
                         exclude: set[str] | None = None) -> list[dict]:
    """`count` distinct problems `a*b` or `a+b` with `digits`-digit operands, none of them in `exclude`."""
    if digits < 1 or digits > 40:
        raise ValueError(f"tool-arithmetic: digits={digits} must be between 1 and 40")
    low, high = 10 ** (digits - 1) if digits > 1 else 0, 10 ** digits - 1
    possible = (high - low + 1) ** 2 * len(OPERATIONS)
    if count > possible - len(exclude or ()):
        raise ValueError(f"tool-arithmetic: {count} problems requested but at most {possible} exist for "
                         f"digits={digits}; raise digits or ask for fewer")
    rng, seen, rows = random.Random(seed), set(exclude or ()), []
    while len(rows) < count:
        a, b, operation = rng.randint(low, high), rng.randint(low, high), rng.choice(OPERATIONS)
        expression = f"{a}{operation}{b}"
        if expression in seen:
            continue
        seen.add(expression)
        answer = a * b if operation == "*" else a + b
        rows.append({"data_source": TOOL_ARITHMETIC_SOURCE,
                     "prompt": [{"role": "user", "content": PROMPT_TEMPLATE.format(expression=expression)}],
                     "ability": "math", "reward_model": {"style": "rule", "ground_truth": str(answer)},
                     "extra_info": {"split": split, "index": len(rows), "expression": expression,
                                    "tool_call": tool_call_text(expression),
                                    "demonstration": demonstration(expression, answer)}})
    return rows


def write_tool_arithmetic(output_dir: str | Path, train_size: int, validation_size: int, seed: int = 0,
                          digits: int = 6) -> dict[str, Path]:
    """Write disjoint train.parquet and validation.parquet; return {split: path}."""
    for name, size in (("train_size", train_size), ("validation_size", validation_size)):
        if size < 1:
            raise ValueError(f"tool-arithmetic: {name}={size} must be >= 1")
    validation = tool_arithmetic_rows(validation_size, seed + 1, digits, "validation")
    train = tool_arithmetic_rows(train_size, seed, digits, "train",
                                 exclude={row["extra_info"]["expression"] for row in validation})
    output = Path(output_dir)
    output.mkdir(parents=True, exist_ok=True)
    paths = {}
    for split, rows in (("train", train), ("validation", validation)):
        paths[split] = output / SPLIT_FILES[split]
        _write_parquet_atomically(rows, paths[split])
    return paths
