"""flows.runtime.recovery on a run folder in tmp_path: where a trained role restores from, which state a
stage gets, when a finished stage is skipped, and how many checkpoints stay."""

from __future__ import annotations

import json

import pytest

from flows.runtime.recovery import (
    LATEST,
    RoleStateError,
    check_step_files,
    commit_checkpoint,
    driver_state,
    finished_stage_metrics,
    latest_checkpoint,
    read_run_record,
    record_stage_metrics,
    restore_point,
    state_source,
    write_run_record,
)
from flows.runtime.batches import StorageBatches
from flows.training.registry import StageSpec
from storage import RunLayout, write_stage


@pytest.fixture
def layout(tmp_path):
    return RunLayout(str(tmp_path), "r")


def _checkpoints(tmp_path, committed=(), partial=(), latest=None):
    """checkpoints/<k>/driver.json for each committed k, a role folder only for each partial k."""
    for step in committed:
        (tmp_path / "r" / "checkpoints" / str(step)).mkdir(parents=True)
        (tmp_path / "r" / "checkpoints" / str(step) / "driver.json").write_text("{}")
    for step in partial:
        (tmp_path / "r" / "checkpoints" / str(step) / "actor").mkdir(parents=True)
    if latest is not None:
        (tmp_path / "r" / "checkpoints" / "latest.json").write_text(json.dumps({"step": latest}))


def _spec(name, output, skippable=True, per_sample=True):
    return StageSpec(name, lambda *args: {}, "driver", output, skippable, per_sample, True)


# --- restore_point ----------------------------------------------------------------------------------


def test_a_role_restores_from_the_latest_checkpoint_an_explicit_one_or_the_initial_weights(tmp_path, layout):
    _checkpoints(tmp_path, committed=(1, 3), latest=3)
    checkpoints = tmp_path / "r" / "checkpoints"
    assert restore_point(layout, "actor") == (3, str(checkpoints / "3" / "actor"))
    assert restore_point(layout, "critic", LATEST) == (3, str(checkpoints / "3" / "critic"))
    assert restore_point(layout, "actor", 1) == (1, str(checkpoints / "1" / "actor"))
    assert restore_point(layout, "actor", None) == (None, None)


def test_a_run_without_checkpoints_restores_the_initial_weights(layout):
    assert latest_checkpoint(layout) is None
    assert restore_point(layout, "actor") == (None, None)


# --- state_source -----------------------------------------------------------------------------------


def test_the_state_of_a_step_comes_from_its_committed_checkpoint_or_the_initial_weights(tmp_path, layout):
    _checkpoints(tmp_path, committed=(1, 3), latest=3)
    assert state_source(layout, "actor", 3, 5, "update_actor") == 3
    assert state_source(layout, "critic", 1, None, "values") == 1
    assert state_source(layout, "actor", 0, 3, "old_logprobs") is None  # step 0 needs no checkpoint


def test_a_checkpoint_0_is_used_for_step_0(tmp_path, layout):
    _checkpoints(tmp_path, committed=(0,), latest=0)
    assert state_source(layout, "actor", 0, None, "old_logprobs") == 0


def test_a_state_no_checkpoint_has_raises_saying_to_resume(tmp_path, layout):
    _checkpoints(tmp_path, committed=(1, 3), partial=(2,), latest=3)  # checkpoint 2 has no driver.json
    with pytest.raises(RoleStateError) as error:
        state_source(layout, "actor", 2, None, "update_actor")
    assert str(error.value) == (
        "stage update_actor at step 2: the actor holds the training state of no known step (an update stopped "
        "midway) and no checkpoint has step 2's (its worker was replaced, or an attempt of the stage stopped "
        "midway); resume the run: rlhf resume r (restarts at step 3)")


def test_without_any_checkpoint_the_resume_restarts_at_the_start(layout):
    with pytest.raises(RoleStateError, match=r"the critic holds the training state of step 4 .*"
                                             r"rlhf resume r \(restarts at the start\)$"):
        state_source(layout, "critic", 5, 4, "update_critic")


# --- finished stages --------------------------------------------------------------------------------


def _reward_file(layout, step, rows):
    write_stage(layout, step, "reward", {"uid": [f"s{step}-{i}" for i in range(rows)], "score": [1.0] * rows})


def test_a_skippable_stage_is_finished_when_its_output_validates_and_its_metrics_exist(tmp_path, layout):
    reward = _spec("reward", "reward")
    assert finished_stage_metrics(layout, reward, 1, 4) is None  # nothing written
    _reward_file(layout, 1, 4)
    assert finished_stage_metrics(layout, reward, 1, 4) is None  # no metrics file yet
    record_stage_metrics(layout, reward, 1, {"reward/mean": 0.5})
    assert json.loads((tmp_path / "r" / "steps" / "1" / "reward.metrics.json").read_text()) == {"reward/mean": 0.5}
    assert finished_stage_metrics(layout, reward, 1, 4) == {"reward/mean": 0.5}
    assert finished_stage_metrics(layout, reward, 1, 8) is None  # 4 rows, 8 samples expected
    assert finished_stage_metrics(layout, reward, 2, 4) is None  # another step


def test_a_stage_file_that_does_not_validate_or_corrupt_metrics_mean_the_stage_runs(tmp_path, layout):
    reward = _spec("reward", "reward")
    _reward_file(layout, 1, 2)
    record_stage_metrics(layout, reward, 1, {"reward/mean": 0.5})
    (tmp_path / "r" / "steps" / "1" / "reward.metrics.json").write_text("{not json")
    assert finished_stage_metrics(layout, reward, 1, 2) is None
    record_stage_metrics(layout, reward, 1, {"reward/mean": 0.5})
    (tmp_path / "r" / "steps" / "1" / "reward.parquet").write_bytes(b"truncated")
    assert finished_stage_metrics(layout, reward, 1, 2) is None


def test_a_stage_that_is_not_skippable_always_runs_and_keeps_no_metrics(tmp_path, layout):
    advantages = _spec("advantages", "advantages", skippable=False)
    record_stage_metrics(layout, advantages, 1, {"x": 1.0})
    assert not (tmp_path / "r" / "steps" / "1" / "advantages.metrics.json").exists()
    write_stage(layout, 1, "advantages", {"uid": ["a"], "token_rewards": [[0.0]], "advantages": [[0.0]],
                                          "returns": [[0.0]]})
    (tmp_path / "r" / "steps" / "1" / "advantages.metrics.json").write_text("{}")
    assert finished_stage_metrics(layout, advantages, 1, 1) is None


def test_an_output_not_per_sample_skips_the_row_count(layout):
    validate = _spec("validate", "validation", per_sample=False)
    write_stage(layout, 0, "validation", {"uid": ["v0", "v1"], "prompt_text": ["p", "q"], "response_text": ["a", "b"],
                                          "ground_truth": ["a", "c"], "data_source": ["d", "d"],
                                          "extra_info": ["null", "null"], "score": [1.0, 0.0]})
    record_stage_metrics(layout, validate, 0, {"val/score": 0.5})
    assert finished_stage_metrics(layout, validate, 0, 64) == {"val/score": 0.5}


def test_a_stage_writing_weights_is_finished_once_they_are_committed(tmp_path, layout):
    warm_start = _spec("warm_start", "weights/actor")
    record_stage_metrics(layout, warm_start, None, {"warm_start/loss": 1.25})
    assert json.loads((tmp_path / "r" / "warm_start.metrics.json").read_text()) == {"warm_start/loss": 1.25}
    weights = tmp_path / "r" / "weights" / "actor" / "0"
    weights.mkdir(parents=True)
    assert finished_stage_metrics(layout, warm_start, None, None) is None  # a partial copy
    (weights / "_COMMITTED").write_text("committed\n")
    assert finished_stage_metrics(layout, warm_start, None, None) == {"warm_start/loss": 1.25}


class _AskedBatches(StorageBatches):
    """The run folder's batches, recording what recovery asks of them."""

    def __init__(self, layout):
        super().__init__(layout)
        self.asked = []

    def readable(self, step, stage, expected_rows=None):
        self.asked.append(("readable", step, stage, expected_rows))
        return super().readable(step, stage, expected_rows)

    def discard(self, step, stage, keep_aside=False):
        self.asked.append(("discard", step, stage, keep_aside))
        super().discard(step, stage, keep_aside)


def test_recovery_finds_and_repairs_batches_through_the_runs_batches(tmp_path, layout):
    batches, reward = _AskedBatches(layout), _spec("reward", "reward")
    for step in (1, 2, 3):
        _reward_file(layout, step, 2)
        record_stage_metrics(layout, reward, step, {"reward/mean": 0.5})
    assert finished_stage_metrics(layout, reward, 1, 2, batches) == {"reward/mean": 0.5}
    assert batches.asked == [("readable", 1, "reward", 2)]
    for step in (1, 2):
        (tmp_path / "r" / "steps" / str(step) / "reward.parquet").write_bytes(b"truncated")
    batches.asked.clear()
    lines = check_step_files(layout, 2, batches)  # a resume from checkpoint 2: step 1 is not rerun
    assert [entry for entry in batches.asked if entry[0] == "discard"] == [("discard", 1, "reward", True),
                                                                          ("discard", 2, "reward", False)]
    assert len(lines) == 2 and "moved to reward.parquet.corrupt" in lines[0] and "runs again" in lines[1]
    assert (tmp_path / "r" / "steps" / "1" / "reward.parquet.corrupt").exists()
    assert not (tmp_path / "r" / "steps" / "2" / "reward.metrics.json").exists()
    assert batches.committed_stages(3) == {"reward"} and finished_stage_metrics(layout, reward, 3, 2) is not None


# --- checkpoints and the run record -----------------------------------------------------------------


def test_committing_a_checkpoint_moves_latest_and_keeps_only_the_newest(tmp_path, layout):
    checkpoints = tmp_path / "r" / "checkpoints"
    for step in (1, 2, 3):
        (checkpoints / str(step) / "actor").mkdir(parents=True)  # the roles' parts come first
        commit_checkpoint(layout, step, {"kl_coef": step / 10}, keep=2)
        assert latest_checkpoint(layout) == step
    assert sorted(path.name for path in checkpoints.iterdir()) == ["2", "3", "latest.json"]
    assert driver_state(layout, 3) == {"kl_coef": 0.3} and driver_state(layout, 2) == {"kl_coef": 0.2}
    commit_checkpoint(layout, 4, {"kl_coef": 0.4}, keep=1)
    assert sorted(path.name for path in checkpoints.iterdir()) == ["4", "latest.json"]
    # A later checkpoint whose parts are still being written (trainer.checkpoint_async) is not counted or deleted.
    (checkpoints / "6" / "actor").mkdir(parents=True)
    commit_checkpoint(layout, 5, {"kl_coef": 0.5}, keep=1)
    assert sorted(path.name for path in checkpoints.iterdir()) == ["5", "6", "latest.json"]
    assert latest_checkpoint(layout) == 5


def test_the_run_record_reads_back_and_its_absence_says_nothing_to_resume(layout):
    with pytest.raises(ValueError, match="run 'r': no .*/r/run.json; nothing to resume"):
        read_run_record(layout)
    write_run_record(layout, {"created": "2026-11-30T10:00:00", "mlflow_run_id": "abc"})
    assert read_run_record(layout) == {"created": "2026-11-30T10:00:00", "mlflow_run_id": "abc"}
