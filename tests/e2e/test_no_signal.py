"""A run that cannot learn says so: the real flow on the tiny model, with a reward that is always 0, warns once
on the terminal, tags its MLflow run and leaves a Prefect artifact."""

from __future__ import annotations

import logging

import pytest
from mlflow.tracking import MlflowClient

from flows.runtime.console import PROGRESS_LOGGER
from flows.training.learning_signal import NO_SIGNAL_TAG

pytestmark = pytest.mark.e2e


class _Terminal(logging.Handler):
    """Stands for the terminal handler quiet_console puts on the progress logger under `rlhf train`."""

    def __init__(self):
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def test_a_run_whose_rewards_are_all_equal_warns_once_on_the_terminal_in_mlflow_and_prefect(
        prefect_api, tmp_path, make_config, monkeypatch):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    from flows.training.train import train

    config = make_config(tmp_path, "no-signal", "e2e", reward={"function": "zero_reward:always_zero"},
                         trainer={"total_steps": 3, "val_every": 0, "samples_every": 10, "checkpoint_every": 0,
                                  "no_signal_steps": 2})
    terminal, progress_logger = _Terminal(), logging.getLogger(PROGRESS_LOGGER)
    monkeypatch.setattr(progress_logger, "handlers", [terminal])
    state = train(config, return_state=True)
    assert state.is_completed(), state
    summary = state.result()

    client = MlflowClient(tracking_uri=config.tracking.tracking_uri)
    run_id = summary["mlflow_run_id"]
    history = {name: {m.step: m.value for m in client.get_metric_history(run_id, name)}
               for name in ("critic/score/equal_group_frac", "response_length/clip_ratio", "critic/score/mean")}
    assert history["critic/score/equal_group_frac"] == {1: 1.0, 2: 1.0, 3: 1.0}  # every step: 4 groups of 4 zeros
    assert sorted(history["response_length/clip_ratio"]) == [1, 2, 3]
    clip_ratio = (history["response_length/clip_ratio"][1] + history["response_length/clip_ratio"][2]) / 2
    expected = ("warning: no learning signal for 2 steps (steps 1-2): every group of samples got the same reward "
                "(mean score 0.000), so every advantage is 0; check the reward function and the answer format "
                "(rlhf doctor CONFIG --data scores the model before training), the response length limit "
                f"(rollout.max_new_tokens=4, response_length/clip_ratio {clip_ratio:.2f}) and the learning rate "
                "(actor.optim.lr=0.0001)")
    warnings = [line for line in terminal.lines if line.startswith("warning: no learning signal")]
    assert warnings == [expected], terminal.lines  # once: step 3 continues the same streak
    assert client.get_run(run_id).data.tags[NO_SIGNAL_TAG] == expected
    with get_client(sync_client=True) as prefect:
        found = prefect.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(
            any_=["no-signal-warning-no-signal"])))
    assert len(found) == 1 and expected in found[0].data
