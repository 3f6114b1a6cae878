"""Arithmetic word problems in GSM8K's layout (verl's gsm8k parquet), of graded difficulty, made here.

A row is what verl's `examples/data_preprocess/gsm8k.py` writes: `data_source`, a chat `prompt` (one user
message: the question, then verl's instruction `Let's think step by step and output the final answer after
"####".`), `ability` "math", `reward_model` {style "rule", ground_truth "<n>"} and `extra_info` {split, index,
answer (a worked solution ending in `#### <n>`, GSM8K's answer format; the warm-start's target), question,
level}. Scored by the `gsm8k` scorer (verl's strict one: the number after the last `#### `), which
reward.function=auto picks for data_source `word_problems`.

Departure from verl's prompt: one sentence after its instruction, `End your reply with a line "#### <number>".`
SmolLM2-135M-Instruct, given verl's instruction alone, never wrote `####` (0 of 120 greedy answers, levels 1-3);
with the sentence it does in most answers, so the strict scorer has something to score.

Levels (each a step more): 1: one addition or subtraction of numbers up to 10; 2: one operation on two-digit
numbers or a product of one-digit numbers; 3: two operations; 4: three. `answer_only_rows` is the other task: a
bare sum whose prompt says to reply with only the number, scored by verl's flexible gsm8k scorer (the last number).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Callable, Sequence

from components.tasks.arithmetic import SPLIT_FILES, _write_parquet_atomically

WORD_PROBLEMS_SOURCE = "word_problems"
ANSWER_ONLY_SOURCE = "answer_only"
VERL_GSM8K_INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
FORMAT_SENTENCE = 'End your reply with a line "#### <number>".'
ANSWER_ONLY_TEMPLATE = "Compute {a}+{b}. Reply with just the final number, nothing else."
LEVELS = (1, 2, 3, 4)
NAMES = ("Tom", "Anna", "Sam", "Lily", "Ben", "Mia", "Omar", "Zoe", "Ravi", "Nina", "Leo", "Ivy")
ITEMS = ("apples", "pencils", "stickers", "books", "marbles", "cookies", "cards", "shells", "coins", "stamps")

Problem = tuple[str, str, int]
"""(question, worked solution without the final line, answer)."""


def _one_step_small(rng: random.Random, name: str, item: str) -> Problem:
    a, b = rng.randint(1, 10), rng.randint(1, 10)
    if rng.random() < 0.5:
        return (f"{name} has {a} {item}. {name} gets {b} more {item}. How many {item} does {name} have now?",
                f"{name} has {a} {item} and gets {b} more, so {name} has {a} + {b} = {a + b} {item}.", a + b)
    a, b = max(a, b), min(a, b)
    return (f"{name} has {a} {item}. {name} gives {b} {item} to a friend. How many {item} does {name} have left?",
            f"{name} has {a} {item} and gives away {b}, so {a} - {b} = {a - b} {item} are left.", a - b)


def _one_step_larger(rng: random.Random, name: str, item: str) -> Problem:
    kind = rng.randrange(3)
    if kind == 0:
        a, b = rng.randint(10, 60), rng.randint(10, 39)
        return (f"{name} has {a} {item} and buys {b} more. How many {item} does {name} have?",
                f"{name} has {a} + {b} = {a + b} {item}.", a + b)
    if kind == 1:
        a, b = rng.randint(30, 99), rng.randint(10, 29)
        return (f"There are {a} {item} in a box. {name} takes {b} of them. How many {item} are still in the box?",
                f"{a} - {b} = {a - b} {item} are still in the box.", a - b)
    a, b = rng.randint(2, 9), rng.randint(2, 9)
    return (f"{name} has {a} bags with {b} {item} in each bag. How many {item} does {name} have in all?",
            f"{a} bags of {b} {item} make {a} * {b} = {a * b} {item}.", a * b)


def _two_steps(rng: random.Random, name: str, item: str) -> Problem:
    a, b, c = rng.randint(2, 9), rng.randint(2, 9), rng.randint(1, 9)
    if rng.random() < 0.5:
        return (f"{name} has {a} boxes with {b} {item} in each box, and {c} loose {item}. How many {item} does "
                f"{name} have in all?",
                f"The boxes hold {a} * {b} = {a * b} {item}. With the {c} loose ones that is {a * b} + {c} = "
                f"{a * b + c} {item}.", a * b + c)
    return (f"{name} has {a} boxes with {b} {item} in each box. {name} loses {c} {item}. How many {item} does "
            f"{name} have now?",
            f"The boxes hold {a} * {b} = {a * b} {item}. After losing {c}, {name} has {a * b} - {c} = {a * b - c} "
            f"{item}.", a * b - c)


def _three_steps(rng: random.Random, name: str, item: str) -> Problem:
    a, b, c, d = rng.randint(2, 9), rng.randint(2, 9), rng.randint(2, 9), rng.randint(1, 9)
    friend = rng.choice([other for other in NAMES if other != name])
    total = a * b + c - d
    return (f"{name} has {a} boxes with {b} {item} in each box. {friend} gives {name} {c} more {item}, and then "
            f"{name} gives away {d}. How many {item} does {name} have now?",
            f"The boxes hold {a} * {b} = {a * b} {item}. With {c} more that is {a * b} + {c} = {a * b + c}. After "
            f"giving away {d}, {name} has {a * b + c} - {d} = {total} {item}.", total)


MAKERS: dict[int, Callable[[random.Random, str, str], Problem]] = {
    1: _one_step_small, 2: _one_step_larger, 3: _two_steps, 4: _three_steps}


def _check_levels(levels: Sequence[int]) -> None:
    if not levels or any(level not in MAKERS for level in levels):
        raise ValueError(f"word problems: levels={list(levels)!r} is not valid; use some of {list(LEVELS)}")


def word_problem_row(question: str, solution: str, answer: int, level: int, split: str, index: int) -> dict:
    """One row in verl's gsm8k layout (see the module docstring)."""
    return {
        "data_source": WORD_PROBLEMS_SOURCE,
        "prompt": [{"role": "user", "content": f"{question} {VERL_GSM8K_INSTRUCTION} {FORMAT_SENTENCE}"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": str(answer)},
        "extra_info": {"split": split, "index": index, "answer": f"{solution}\n#### {answer}", "question": question,
                       "level": level},
    }


def word_problem_rows(count: int, seed: int, levels: Sequence[int] = (1, 2), split: str = "train",
                      exclude: set[str] | None = None) -> list[dict]:
    """`count` distinct problems, levels taken in turn, none of whose question is in `exclude`."""
    _check_levels(levels)
    rng, seen, rows = random.Random(seed), set(exclude or ()), []
    attempts = 0
    while len(rows) < count:
        attempts += 1
        if attempts > 50 * count + 1000:
            raise ValueError(f"word problems: could not make {count} distinct problems of levels {list(levels)}; "
                             "ask for fewer or add levels")
        level = levels[len(rows) % len(levels)]
        question, solution, answer = MAKERS[level](rng, rng.choice(NAMES), rng.choice(ITEMS))
        if question in seen:
            continue
        seen.add(question)
        rows.append(word_problem_row(question, solution, answer, level, split, len(rows)))
    return rows


def answer_only_rows(count: int, seed: int, high: int = 99, split: str = "train",
                     exclude: set[tuple[int, int]] | None = None) -> list[dict]:
    """`count` distinct sums a+b (0 <= a, b <= high) whose prompt asks for the number alone."""
    pairs = [(a, b) for a in range(high + 1) for b in range(high + 1) if (a, b) not in (exclude or set())]
    if count > len(pairs):
        raise ValueError(f"answer-only arithmetic: {count} problems requested but only {len(pairs)} exist for "
                         f"high={high}; raise high or ask for fewer")
    random.Random(seed).shuffle(pairs)
    return [{"data_source": ANSWER_ONLY_SOURCE,
             "prompt": [{"role": "user", "content": ANSWER_ONLY_TEMPLATE.format(a=a, b=b)}],
             "ability": "math", "reward_model": {"style": "rule", "ground_truth": str(a + b)},
             "extra_info": {"split": split, "index": index, "answer": str(a + b), "a": a, "b": b}}
            for index, (a, b) in enumerate(pairs[:count])]


def write_task(task: str, output_dir: str | Path, train_size: int, validation_size: int, seed: int = 0,
               levels: Sequence[int] = (1, 2), high: int = 99) -> dict[str, Path]:
    """Write disjoint train.parquet and validation.parquet of `task` (word-problems or answer-only)."""
    for name, size in (("train_size", train_size), ("validation_size", validation_size)):
        if size < 1:
            raise ValueError(f"{task}: {name}={size} must be >= 1")
    if task == "word-problems":
        validation = word_problem_rows(validation_size, seed + 1, levels, "validation")
        train = word_problem_rows(train_size, seed, levels, "train",
                                  exclude={row["extra_info"]["question"] for row in validation})
    elif task == "answer-only":
        validation = answer_only_rows(validation_size, seed + 1, high, "validation")
        train = answer_only_rows(train_size, seed, high, "train",
                                 exclude={(row["extra_info"]["a"], row["extra_info"]["b"]) for row in validation})
    else:
        raise ValueError(f"make-data: task {task!r} is not valid; use arithmetic, word-problems or answer-only")
    output = Path(output_dir)
    output.mkdir(parents=True, exist_ok=True)
    paths = {}
    for split, rows in (("train", train), ("validation", validation)):
        paths[split] = output / SPLIT_FILES[split]
        _write_parquet_atomically(rows, paths[split])
    return paths
