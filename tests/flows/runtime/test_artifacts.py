"""flows.runtime.artifacts: the Prefect metrics table of a resumed run starts with the steps MLflow recorded."""

from __future__ import annotations

from flows.runtime.artifacts import recorded_rows, table_row


def test_a_row_keeps_five_significant_digits_and_only_the_table_metrics():
    assert table_row(3, {"critic/score/mean": 0.123456, "actor/update_rms_ratio": 3.14159e-6, "other/x": 1.0}) == {
        "step": 3, "critic/score/mean": 0.12346, "actor/update_rms_ratio": 3.1416e-6}


def test_recorded_rows_are_the_steps_up_to_the_checkpoint_in_order():
    history = {"critic/score/mean": {1: 0.25, 2: 0.5, 3: 0.75, 4: 1.0},
               "val/reward/mean": {0: 0.1, 2: 0.2},  # step 0: the validation before RL, not a table row
               "timing_s/step": {2: 1.5, 1: 2.0},
               "actor/lr": {1: 1e-6}}  # not in the table
    assert recorded_rows(history, through_step=2) == [
        {"step": 1, "critic/score/mean": 0.25, "timing_s/step": 2.0},
        {"step": 2, "critic/score/mean": 0.5, "val/reward/mean": 0.2, "timing_s/step": 1.5}]
    assert recorded_rows(history, through_step=0) == []  # a resume from the start: nothing recorded to keep
