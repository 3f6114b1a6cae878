"""A synthetic arithmetic task ("12+34=" -> "46") in verl's Parquet row format.

The prompt is deliberately compact (operand, operator, operand, "="): the tiny byte-level model only
has to learn to continue with the answer's digits, which a few hundred RL steps can teach it.
Train and validation problems are disjoint so validation reward measures generalisation, not recall.
"""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Sequence

import pyarrow as pa
import pyarrow.parquet as pq

DATA_SOURCE = "arithmetic"
SPLIT_FILES = {"train": "train.parquet", "validation": "validation.parquet"}
_OPERATIONS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}

Problem = tuple[int, str, int]


def _validate_arguments(low: int, high: int, operations: Sequence[str]) -> None:
    if low > high:
        raise ValueError(f"arithmetic: low={low} must be <= high={high}")
    if not operations:
        raise ValueError(
            f"arithmetic: operations={tuple(operations)!r} is empty; use some of {sorted(_OPERATIONS)}"
        )
    for operation in operations:
        if operation not in _OPERATIONS:
            raise ValueError(
                f"arithmetic: operation {operation!r} is not supported; use one of {sorted(_OPERATIONS)}"
            )


def _shuffled_problems(seed: int, low: int, high: int, operations: Sequence[str]) -> list[Problem]:
    """Every distinct (a, op, b) problem in range, in a seed-determined order."""
    _validate_arguments(low, high, operations)
    problems = [
        (a, operation, b)
        for operation in dict.fromkeys(operations)  # dedupe, keep order
        for a in range(low, high + 1)
        for b in range(low, high + 1)
    ]
    # A local Random keeps the order independent of any global seeding done elsewhere.
    random.Random(seed).shuffle(problems)
    return problems


def _problem_to_row(problem: Problem, split: str, index: int) -> dict:
    a, operation, b = problem
    answer = _OPERATIONS[operation](a, b)
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": f"{a}{operation}{b}="}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": str(answer)},
        "extra_info": {"split": split, "index": index},
    }


def _check_enough(needed: int, available: int, low: int, high: int, operations: Sequence[str]) -> None:
    if needed > available:
        raise ValueError(
            f"arithmetic: {needed} problems requested but only {available} distinct problems exist "
            f"for low={low}, high={high}, operations={tuple(operations)!r}; widen the range or ask for fewer"
        )


def make_arithmetic_rows(
    count: int,
    seed: int,
    low: int = 0,
    high: int = 99,
    operations: Sequence[str] = ("+",),
    split: str = "train",
) -> list[dict]:
    """`count` distinct verl-format rows drawn from all problems with operands in [low, high]."""
    if count < 0:
        raise ValueError(f"arithmetic: count={count} must be >= 0")
    problems = _shuffled_problems(seed, low, high, operations)
    _check_enough(count, len(problems), low, high, operations)
    return [_problem_to_row(problem, split, index) for index, problem in enumerate(problems[:count])]


def _write_parquet_atomically(rows: list[dict], path: Path) -> None:
    """Write to a sibling temp file then rename, so readers never see a half-written file."""
    temporary_path = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        pq.write_table(pa.Table.from_pylist(rows), temporary_path)
        os.replace(temporary_path, path)
    finally:
        temporary_path.unlink(missing_ok=True)


def write_arithmetic_dataset(
    output_dir: str | Path,
    train_size: int = 2000,
    validation_size: int = 200,
    seed: int = 0,
    low: int = 0,
    high: int = 99,
    operations: Sequence[str] = ("+",),
) -> dict[str, Path]:
    """Write disjoint `train.parquet` and `validation.parquet`; return {split: path}."""
    for name, size in (("train_size", train_size), ("validation_size", validation_size)):
        if size < 1:
            raise ValueError(f"arithmetic: {name}={size} must be >= 1")
    problems = _shuffled_problems(seed, low, high, operations)
    _check_enough(train_size + validation_size, len(problems), low, high, operations)
    # One shuffled list split in two guarantees the splits share no (a, op, b) problem.
    split_problems = {
        "train": problems[:train_size],
        "validation": problems[train_size : train_size + validation_size],
    }
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    paths: dict[str, Path] = {}
    for split, chosen in split_problems.items():
        rows = [_problem_to_row(problem, split, index) for index, problem in enumerate(chosen)]
        paths[split] = output_dir / SPLIT_FILES[split]
        _write_parquet_atomically(rows, paths[split])
    return paths


def ensure_arithmetic_dataset(output_dir: str | Path, **kwargs) -> dict[str, Path]:
    """Write the dataset unless both split files already exist (idempotent for repeated flow runs)."""
    output_dir = Path(output_dir)
    paths = {split: output_dir / name for split, name in SPLIT_FILES.items()}
    if all(path.exists() for path in paths.values()):
        return paths
    return write_arithmetic_dataset(output_dir, **kwargs)
