"""flows.training.preflight: what a run reads is checked before anything is created, one line per problem."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from components.tasks.arithmetic import make_arithmetic_rows
from components.tiny import build_tiny_model
from flows.config import build_config
from flows.training.preflight import check_inputs

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("preflight")
    model = build_tiny_model(root / "model")
    rows = make_arithmetic_rows(6, seed=0)
    pq.write_table(pa.Table.from_pylist(rows), root / "train.parquet")
    pq.write_table(pa.Table.from_pylist(rows[:2]), root / "val.parquet")
    gsm8k = [dict(row, data_source="openai/gsm8k") for row in rows[:2]]
    pq.write_table(pa.Table.from_pylist(gsm8k), root / "gsm8k.parquet")
    pq.write_table(pa.Table.from_pylist([{"question": "1+1"}]), root / "no_prompt.parquet")
    return root, str(model)


def config(inputs, *overrides):
    root, model = inputs
    return build_config({}, [f"model.path={model}", f"data.train_files=[{root / 'train.parquet'}]",
                             f"data.val_files=[{root / 'val.parquet'}]", "data.prompts_per_step=4", *overrides])


def test_a_good_config_reports_its_prompts_and_each_data_sources_scorer(inputs):
    root, _ = inputs
    summary = check_inputs(config(inputs, f"data.val_files={root / 'gsm8k.parquet'}"))  # one path, not a list
    assert (summary.train_prompts, summary.dropped_overlong, summary.val_prompts) == (6, 0, 2)
    assert summary.scorers == {"arithmetic": "exact_match", "openai/gsm8k": "gsm8k"}
    assert summary.lines() == ["data: 6 training prompts, 2 validation prompts",
                               "reward: data_source 'arithmetic' scored by exact_match",
                               "reward: data_source 'openai/gsm8k' scored by gsm8k"]
    assert check_inputs(config(inputs, "reward.function=exact_match")).scorers == {"arithmetic": "exact_match"}


@pytest.mark.parametrize(("overrides", "fragment"), [
    (["data.prompts_per_step=7"], "data.prompts_per_step=7: data.train_files hold 6 usable prompts; use at most 6"),
    (["model.path=/nowhere/model"], "model.path='/nowhere/model' does not exist"),
    (["data.train_files=[{root}/no_prompt.parquet]"], "has no 'prompt' column"),
    (["data.val_files=[{root}/missing.parquet]"], "data.val_files: file"),
    (["data.max_prompt_length=2", "data.overlong_prompts=error"], "over data.max_prompt_length=2"),
    (["data.max_prompt_length=2"], "all 6 prompts are longer than data.max_prompt_length=2"),
    (["reward.function=nope"], "reward.function='nope' is not a registered reward function"),
])
def test_each_bad_input_is_one_line(inputs, overrides, fragment):
    root, _ = inputs
    with pytest.raises(ValueError) as error:
        check_inputs(config(inputs, *(item.format(root=root) for item in overrides)))
    assert fragment in str(error.value) and "\n" not in str(error.value)


def test_the_cli_refuses_bad_data_before_a_server_or_run_folder_exists(inputs, tmp_path):
    root, model = inputs
    result = subprocess.run(
        [sys.executable, "-m", "flows.tools.cli", "train", str(REPO / "configs" / "quickstart.yaml"),
         f"model.path={model}", f"data.train_files={root / 'train.parquet'}", f"data.val_files={root / 'val.parquet'}",
         "data.prompts_per_step=100", f"run.storage_root={tmp_path / 'runs'}", "run.name=bad",
         f"tracking.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines() == [
        "error: data.prompts_per_step=100: data.train_files hold 6 usable prompts; use at most 6"]
    assert not (tmp_path / "runs").exists() and not (tmp_path / "mlflow.db").exists()
    assert not (tmp_path / ".rlhf").exists()  # no Prefect server was started (its home is .rlhf/prefect)
