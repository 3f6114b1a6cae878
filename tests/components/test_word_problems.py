"""The word-problem and answer-only tasks (components/tasks/word_problems.py): verl's gsm8k layout, graded
levels, disjoint splits, and answers the project's scorers accept."""

import re

import pyarrow.parquet as pq
import pytest

from components.rewards import gsm8k, gsm8k_flexible, scorer_for
from components.tasks.word_problems import (FORMAT_SENTENCE, VERL_GSM8K_INSTRUCTION, answer_only_rows,
                                            word_problem_rows, write_task)


def test_a_row_has_verl_gsm8k_layout_and_its_worked_answer_scores_one():
    rows = word_problem_rows(40, seed=0, levels=(1, 2, 3, 4))
    assert [row["extra_info"]["level"] for row in rows[:8]] == [1, 2, 3, 4, 1, 2, 3, 4]
    for row in rows:
        assert row["data_source"] == "word_problems" and row["ability"] == "math"
        (message,) = row["prompt"]
        question = row["extra_info"]["question"]
        assert message == {"role": "user", "content": f"{question} {VERL_GSM8K_INSTRUCTION} {FORMAT_SENTENCE}"}
        truth = row["reward_model"]["ground_truth"]
        assert row["reward_model"]["style"] == "rule" and int(truth) >= 0
        answer = row["extra_info"]["answer"]
        assert answer.endswith(f"\n#### {truth}")
        assert gsm8k(answer, truth) == 1.0 and gsm8k(answer.replace("####", "answer:"), truth) == 0.0
    assert scorer_for("word_problems") == "gsm8k"


def test_every_step_of_a_worked_answer_is_right_and_the_last_is_the_ground_truth():
    equation = re.compile(r"(\d+) ([-+*]) (\d+) = (\d+)")
    operations = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
    for level, steps in ((1, 1), (2, 1), (3, 2), (4, 3)):
        for row in word_problem_rows(30, seed=level, levels=(level,)):
            found = equation.findall(row["extra_info"]["answer"])
            assert len(found) == steps, row
            for a, operation, b, result in found:
                assert operations[operation](int(a), int(b)) == int(result), row
            assert found[-1][3] == row["reward_model"]["ground_truth"]


def test_splits_are_disjoint_and_written_as_parquet(tmp_path):
    paths = write_task("word-problems", tmp_path, train_size=300, validation_size=50, seed=1, levels=(1, 2))
    train, validation = (pq.read_table(paths[split]).to_pylist() for split in ("train", "validation"))
    assert (len(train), len(validation)) == (300, 50)
    assert not {row["extra_info"]["question"] for row in train} & {row["extra_info"]["question"] for row in validation}
    assert {row["extra_info"]["split"] for row in validation} == {"validation"}


def test_answer_only_rows_ask_for_the_number_and_are_scored_by_the_last_number(tmp_path):
    rows = answer_only_rows(10, seed=0, high=20)
    for row in rows:
        a, b = row["extra_info"]["a"], row["extra_info"]["b"]
        assert row["prompt"][0]["content"] == f"Compute {a}+{b}. Reply with just the final number, nothing else."
        assert row["reward_model"]["ground_truth"] == str(a + b) and 0 <= a <= 20 and 0 <= b <= 20
    assert scorer_for("answer_only") == "gsm8k_flexible"
    assert gsm8k_flexible(f"{a} + {b} = {a + b}", str(a + b)) == 1.0
    paths = write_task("answer-only", tmp_path, train_size=100, validation_size=20, high=20)
    train, validation = (pq.read_table(paths[split]).to_pylist() for split in ("train", "validation"))
    pairs = lambda rows: {(row["extra_info"]["a"], row["extra_info"]["b"]) for row in rows}  # noqa: E731
    assert not pairs(train) & pairs(validation)


@pytest.mark.parametrize("call, message", [
    (lambda: word_problem_rows(3, 0, levels=(0, 5)), "word problems: levels=[0, 5] is not valid; use some of [1, 2, 3, 4]"),
    (lambda: answer_only_rows(500, 0, high=9), "answer-only arithmetic: 500 problems requested but only 100 exist for "
                                               "high=9; raise high or ask for fewer"),
    (lambda: write_task("poetry", "/nonexistent", 1, 1), "make-data: task 'poetry' is not valid; use arithmetic, "
                                                         "word-problems or answer-only"),
    (lambda: write_task("word-problems", "/nonexistent", 0, 1), "word-problems: train_size=0 must be >= 1"),
])
def test_bad_arguments_are_one_line(call, message):
    with pytest.raises(ValueError) as error:
        call()
    assert str(error.value) == message
