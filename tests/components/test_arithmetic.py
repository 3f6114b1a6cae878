"""Tests for the synthetic arithmetic task."""

import re

import pyarrow.parquet as pq
import pytest

from components.tasks import ensure_arithmetic_dataset, make_arithmetic_rows, write_arithmetic_dataset

PROMPT_PATTERN = re.compile(r"^(\d+)([+\-*])(\d+)=$")


def _problem(row):
    a, operation, b = PROMPT_PATTERN.match(row["prompt"][0]["content"]).groups()
    return int(a), operation, int(b)


def test_row_format_and_answers():
    rows = make_arithmetic_rows(50, seed=3)
    assert len(rows) == 50
    first = rows[0]
    assert set(first) == {"data_source", "prompt", "ability", "reward_model", "extra_info"}
    assert first["data_source"] == "arithmetic" and first["ability"] == "math"
    assert first["prompt"][0]["role"] == "user" and len(first["prompt"]) == 1
    assert first["reward_model"]["style"] == "rule"
    for index, row in enumerate(rows):
        a, operation, b = _problem(row)
        assert operation == "+" and 0 <= a <= 99 and 0 <= b <= 99
        assert row["reward_model"]["ground_truth"] == str(a + b)
        assert row["extra_info"] == {"split": "train", "index": index}
    assert len({_problem(row) for row in rows}) == 50  # distinct problems
    assert make_arithmetic_rows(50, seed=3) == rows
    assert make_arithmetic_rows(50, seed=4) != rows


def test_other_operations():
    rows = make_arithmetic_rows(30, seed=0, low=2, high=9, operations=("-", "*"))
    for row in rows:
        a, operation, b = _problem(row)
        expected = a - b if operation == "-" else a * b
        assert row["reward_model"]["ground_truth"] == str(expected)
    with pytest.raises(ValueError, match="operation '/'"):
        make_arithmetic_rows(3, seed=0, operations=("/",))


def test_dataset_splits_are_disjoint_and_sized(tmp_path):
    paths = write_arithmetic_dataset(tmp_path, train_size=300, validation_size=40, seed=1, low=0, high=19)
    assert paths == {"train": tmp_path / "train.parquet", "validation": tmp_path / "validation.parquet"}
    train = pq.read_table(paths["train"]).to_pylist()
    validation = pq.read_table(paths["validation"]).to_pylist()
    assert len(train) == 300 and len(validation) == 40
    assert {row["extra_info"]["split"] for row in validation} == {"validation"}
    assert [row["extra_info"]["index"] for row in validation] == list(range(40))
    train_problems = {_problem(row) for row in train}
    validation_problems = {_problem(row) for row in validation}
    assert len(train_problems) == 300 and len(validation_problems) == 40
    assert not train_problems & validation_problems
    assert not list(tmp_path.glob("*.tmp"))


def test_not_enough_problems(tmp_path):
    # 0..9 with "+" gives 100 distinct problems.
    with pytest.raises(ValueError, match="101 problems requested but only 100"):
        write_arithmetic_dataset(tmp_path, train_size=90, validation_size=11, high=9)
    write_arithmetic_dataset(tmp_path, train_size=90, validation_size=10, high=9)


def test_ensure_is_idempotent(tmp_path):
    paths = ensure_arithmetic_dataset(tmp_path, train_size=20, validation_size=5)
    modified = {split: path.stat().st_mtime_ns for split, path in paths.items()}
    again = ensure_arithmetic_dataset(tmp_path, train_size=999, validation_size=5)
    assert again == paths
    assert {split: path.stat().st_mtime_ns for split, path in again.items()} == modified
    assert pq.read_table(again["train"]).num_rows == 20
    paths["validation"].unlink()
    ensure_arithmetic_dataset(tmp_path, train_size=20, validation_size=7)
    assert pq.read_table(paths["validation"]).num_rows == 7
