"""flows.training.preflight: what a run reads is checked before anything is created, one line per problem, and
resolved to what the run records as its lineage."""

from __future__ import annotations

import datetime
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from components.tasks.arithmetic import make_arithmetic_rows
from components.tiny import build_tiny_model
from flows.config import build_config
from flows.training.preflight import DataFile, StartingPoint, check_inputs
from storage import COMMITTED_MARKER

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


def _file(path: Path) -> DataFile:
    stat = path.stat()
    return DataFile(str(path), stat.st_size,
                    datetime.datetime.fromtimestamp(stat.st_mtime, tz=datetime.timezone.utc).isoformat())


def test_the_lineage_lists_the_files_a_glob_matched_with_size_and_modification_time(inputs, tmp_path):
    root, _ = inputs
    nightly = tmp_path / "nightly"
    nightly.mkdir()
    for day in ("2026-11-29", "2026-11-30"):
        shutil.copy(root / "train.parquet", nightly / f"{day}.parquet")
    (nightly / "notes.txt").write_text("not matched")
    os.utime(nightly / "2026-11-29.parquet", (1_700_000_000, 1_700_000_000))
    summary = check_inputs(config(inputs, f"data.train_files=[{nightly}/2026-*.parquet, {root / 'val.parquet'}]"))
    assert summary.train_prompts == 6 + 6 + 2
    assert summary.train_files == [_file(nightly / "2026-11-29.parquet"), _file(nightly / "2026-11-30.parquet"),
                                   _file(root / "val.parquet")]
    assert summary.train_files[0].modified == "2023-11-14T22:13:20+00:00"
    assert summary.val_files == [_file(root / "val.parquet")]
    assert summary.from_run is None
    assert summary.lineage() == {
        "data": {"train_files": [vars(entry) for entry in summary.train_files],
                 "val_files": [{"path": str(root / "val.parquet"), "size": (root / "val.parquet").stat().st_size,
                                "modified": summary.val_files[0].modified}]},
        "from_run": None}


def test_a_relative_data_path_is_recorded_absolute(inputs, tmp_path, monkeypatch):
    root, _ = inputs
    monkeypatch.chdir(root)
    summary = check_inputs(config(inputs, "data.val_files=val.parquet"))
    assert summary.val_files == [_file(root / "val.parquet")]


def test_model_from_run_records_the_step_of_the_weights_it_starts_from(inputs, tmp_path):
    _, model = inputs
    runs = tmp_path / "runs"
    for step, committed in ((2, True), (3, True), (4, False)):  # step 4: a partial upload, never used
        weights = runs / "base" / "weights" / "actor" / str(step)
        shutil.copytree(model, weights)
        if committed:
            (weights / COMMITTED_MARKER).touch()
    summary = check_inputs(config(inputs, f"run.storage_root={runs}", "model.from_run=base", "warm_start.steps=0"))
    assert summary.from_run == StartingPoint("base", 3, str(runs / "base" / "weights" / "actor" / "3"))
    assert summary.lineage()["from_run"] == {"run": "base", "step": 3, "weights": str(runs / "base/weights/actor/3")}
    # A warm-start starts from model.path, not from model.from_run.
    assert check_inputs(config(inputs, f"run.storage_root={runs}", "model.from_run=base",
                               "warm_start.steps=2")).from_run is None
    with pytest.raises(ValueError) as error:
        check_inputs(config(inputs, f"run.storage_root={runs}", "model.from_run=nope", "warm_start.steps=0"))
    assert str(error.value) == (f"model.from_run='nope': that run has no committed actor weights under {runs}; "
                                "give a run that has trained at least one step, or unset it")


def test_torchrun_variables_are_checked_before_anything_else(inputs):
    """`env` stands for os.environ: RANK=3 of WORLD_SIZE=2 is refused, naming both (even with a bad model.path)."""
    with pytest.raises(ValueError) as error:
        check_inputs(config(inputs, "model.path=/nowhere/model"),
                     env={"RANK": "3", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"})
    assert str(error.value) == "distributed env: RANK=3 must be < WORLD_SIZE=2"
    assert check_inputs(config(inputs), env={"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                                             "MASTER_PORT": "29500"}).train_prompts == 6
