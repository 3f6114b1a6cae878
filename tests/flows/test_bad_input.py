"""Every bad input is one line (issue 20): `rlhf ...` exits 2 with exactly one stderr line, `error: <message>`,
naming the field or file, the value and what is valid, and nothing else on stderr or stdout; and a bad input that
needs no model creates nothing (no run folder under the storage root, no MLflow store, no Prefect server: the
working directory, where all three would go, stays empty).

The CLI runs in this process (`flows.tools.cli.main`), in an empty working directory whose config puts the storage
root (`runs`), the MLflow store (`sqlite:///mlflow.db`) and the Prefect server's home (`.rlhf/prefect`) there.
A reward function that raises needs the flow: that case runs `rlhf train` as a user does, in a subprocess.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import yaml

from components.tasks.arithmetic import make_arithmetic_rows
from components.tiny import build_tiny_model
from flows.tools.cli import main

REPO = Path(__file__).resolve().parents[2]
DISTRIBUTED = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NNODES", "GROUP_RANK", "MASTER_ADDR",
               "MASTER_PORT")
REWARDS_MODULE = """
NOT_CALLABLE = 3

def wrong_parameters(answer, ground_truth):
    return 0.0

def boom(solution_str, ground_truth, extra_info=None):
    if extra_info["split"] == "train":  # validation passes; the training step's reward stage fails
        raise ZeroDivisionError("the judge divided by zero")
    return 0.0
"""
TOKENIZER_HINT = "(are the tokenizer files, tokenizer.json or vocab.json and merges.txt, missing?)"
VALID_TRACKING_SCHEMES = "databricks, databricks-uc, file, http, https, mssql, mysql, postgresql, sqlite, uc"


def _write(path: Path, columns: dict) -> Path:
    pq.write_table(pa.table(columns), path)
    return path


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> Path:
    """A tiny model (and broken copies of it), prompt files good and bad, config files, a module of rewards."""
    root = tmp_path_factory.mktemp("bad-input")
    model = build_tiny_model(root / "model")
    no_tokenizer = shutil.copytree(model, root / "no-tokenizer")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (no_tokenizer / name).unlink(missing_ok=True)
    bad_config = shutil.copytree(model, root / "bad-config")
    (bad_config / "config.json").write_bytes(b'{"model_type": "qwen2", "name": "\xff"}')
    only_tokenizer = root / "only-tokenizer"
    only_tokenizer.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(model / name, only_tokenizer / name)
    rows = make_arithmetic_rows(6, seed=0)
    pq.write_table(pa.Table.from_pylist(rows), root / "train.parquet")
    pq.write_table(pa.Table.from_pylist(make_arithmetic_rows(2, seed=1, split="validation")), root / "val.parquet")
    pq.write_table(pa.Table.from_pylist(rows[:0], schema=pa.Table.from_pylist(rows).schema), root / "empty.parquet")
    truth = pa.array([{"ground_truth": "3"}])
    _write(root / "no_prompt.parquet", {"question": ["1+2"], "reward_model": truth})
    _write(root / "int_prompt.parquet", {"prompt": [12], "reward_model": truth})
    _write(root / "truth_not_struct.parquet", {"prompt": ["1+2="], "reward_model": ["3"]})
    _write(root / "empty_prompt.parquet", {"prompt": [""], "reward_model": truth})
    not_utf8 = pa.Array.from_buffers(pa.string(), 1, [None, pa.py_buffer(bytes([0, 0, 0, 0, 4, 0, 0, 0])),
                                                      pa.py_buffer(b"1+\xff=")])
    _write(root / "not_utf8.parquet", {"prompt": not_utf8, "reward_model": truth})
    (root / "text.parquet").write_text("prompt,answer\n1+2=,3\n")
    (root / "config.yaml").write_text(yaml.safe_dump({
        "run": {"name": "bad", "storage_root": "runs"},
        "model": {"path": str(model)},
        "data": {"train_files": [str(root / "train.parquet")], "val_files": [str(root / "val.parquet")],
                 "max_prompt_length": 16, "prompts_per_step": 4},
        "rollout": {"engine": "hf", "n": 2, "max_new_tokens": 4},
        "actor": {"ppo_mini_batch_size": 4, "micro_batch_size": 8},
        "trainer": {"total_steps": 1, "device": "cpu", "checkpoint_every": 0},
        "tracking": {"tracking_uri": "sqlite:///mlflow.db"},
    }))
    (root / "not_utf8.yaml").write_bytes(b"run:\n  name: caf\xe9\n")
    (root / "broken.yaml").write_text("run:\n  name: [unclosed\n")
    (root / "list.yaml").write_text("- run\n- model\n")
    rewards = root / "rewards"
    rewards.mkdir()
    (rewards / "bad_rewards.py").write_text(REWARDS_MODULE)
    (rewards / "import_fails.py").write_text("raise RuntimeError('no API key set')\n")
    return root


@pytest.fixture
def workdir(tmp_path, monkeypatch, inputs) -> Path:
    """An empty working directory (the config's storage root, MLflow store and Prefect home are in it), with no
    Prefect server configured, no torchrun variables, and the rewards module importable."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    for name in ("PREFECT_API_URL", "RLHF_DEBUG", *DISTRIBUTED):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.syspath_prepend(str(inputs / "rewards"))
    return cwd


def one_error_line(capsys, workdir: Path, *argv: str) -> str:
    """Run `rlhf argv` in this process: exit 2, one stderr line `error: ...` and nothing else on stderr or stdout,
    nothing created in the working directory; returns the message after `error: `."""
    code = main([str(arg) for arg in argv])
    out, err = capsys.readouterr()
    assert code == 2, (code, out, err)
    assert err.count("\n") == 1 and err.endswith("\n") and err.startswith("error: "), err
    assert out == ""
    assert sorted(path.name for path in workdir.iterdir()) == []  # no runs/, mlflow.db, mlruns/ or .rlhf/prefect
    return err.removeprefix("error: ").removesuffix("\n")


def train(inputs: Path, *overrides: str) -> list[str]:
    return ["train", str(inputs / "config.yaml"), *overrides]


# --- config: the field, the value, what is valid --------------------------------------------------

CONFIG_CASES = {
    "unknown field": (["trainer.totl_steps=3"],
                      "trainer.totl_steps: unknown field (check the spelling; `rlhf config show` lists fields)"),
    "not a number": (["trainer.total_steps=many"],
                     "trainer.total_steps='many': Input should be a valid integer, unable to parse string as an "
                     "integer"),
    "out of range": (["rollout.n=0"], "rollout.n=0: Input should be greater than 0"),
    "not a choice": (["rollout.engine=fast"], "rollout.engine='fast': Input should be 'auto', 'vllm' or 'hf'"),
    "override without =": (["trainer.total_steps"],
                           "override 'trainer.total_steps': expected key.path=value, e.g. trainer.total_steps=10"),
    "override with an empty key part": (["trainer..total_steps=3"],
                                        "override 'trainer..total_steps=3': the key has an empty part; expected "
                                        "key.path=value"),
    "run name of dots": (["run.name=.."],
                         "run.name='..': '..' names no folder of its own; use letters, digits, '.', '_' or '-'"),
    "run name with a slash": (["run.name=a/b"],
                              "run.name='a/b': String should match pattern '^[A-Za-z0-9._-]+$'"),
    "unknown estimator": (["algorithm.adv_estimator=ppo2"], None),
    "adaptive KL without a target": (["algorithm.kl_ctrl.type=adaptive"],
                                     "algorithm.kl_ctrl: type=adaptive needs target_kl and horizon"),
    "reward model without a path": (["reward.kind=model"], "reward.model_path: required when reward.kind=model"),
    "one step ahead in one process": (["trainer.one_step_ahead=true"],
                                      "trainer.one_step_ahead=true needs trainer.execution=workers (the rollout runs "
                                      "in its own worker, beside training); got trainer.execution=local"),
    "min_new_tokens above max_new_tokens": (["rollout.min_new_tokens=5"],
                                            "rollout.min_new_tokens=5 must be <= rollout.max_new_tokens=4"),
    "several hf engines": (["rollout.engines=2"],
                           "rollout.engines=2: several engines are vLLM engines; use rollout.engine=vllm or auto, or "
                           "rollout.engines=1"),
    "master dtype": (["model.master_dtype=bfloat16"],
                     "model.master_dtype='bfloat16' with model.compute_dtype='float32': master weights are float32 or "
                     "the compute dtype; use float32 (fp32 master weights, the default)"),
    "actor micro-batch above its mini-batch": (["actor.micro_batch_size=9"],
                                               "actor.micro_batch_size=9 (samples) must be <= the mini-batch's 8 "
                                               "samples (actor.ppo_mini_batch_size=4 prompts x rollout.n=2)"),
    "critic micro-batch above its mini-batch": (["algorithm.adv_estimator=gae", "critic.micro_batch_size=64",
                                                 "critic.ppo_mini_batch_size=16"],
                                                "critic.micro_batch_size=64 (samples) must be <= the mini-batch's 32 "
                                                "samples (critic.ppo_mini_batch_size=16 prompts x rollout.n=2)"),
    "turns without tools": (["rollout.max_turns=3"],
                            "rollout.max_turns=3 needs rollout.tools (e.g. [calculator]): a turn after the first "
                            "follows a tool's answer"),
    "a tool that is not one": (["rollout.max_turns=2", "rollout.tools=[calc]"],
                               "rollout.tools=['calc']: 'calc' is not a tool; use a built-in tool (calculator) or "
                               "'module:function'"),
    "a tool module that is not there": (["rollout.max_turns=2", "rollout.tools=[no_such_tools:add]"],
                                        "rollout.tools=['no_such_tools:add']: 'no_such_tools:add': module "
                                        "'no_such_tools' cannot be imported (ModuleNotFoundError: No module named "
                                        "'no_such_tools'); use a built-in tool (calculator) or 'module:function'"),
    "empty registered model": (["tracking.registered_model= "],
                               "tracking.registered_model=' ': is empty; name an MLflow registered model (e.g. "
                               "rlhf-nightly), or leave it unset (null) to register nothing"),
    "registering a model not logged": (["tracking.registered_model=nightly", "tracking.log_model=false"],
                                       "tracking.registered_model='nightly' needs tracking.log_model=true (a "
                                       "registered version points at the logged model); unset one of them"),
}


@pytest.mark.parametrize("overrides, message", CONFIG_CASES.values(), ids=CONFIG_CASES.keys())
def test_a_bad_config_value_is_one_line(capsys, workdir, inputs, overrides, message):
    line = one_error_line(capsys, workdir, *train(inputs, *overrides))
    if message is None:  # the registry's own wording lists what is registered
        assert line.startswith("algorithm.adv_estimator='ppo2'") and "gae" in line and "grpo" in line, line
    else:
        assert line == message


CONFIG_FILE_CASES = {
    "missing": ("missing.yaml", "config file {file!r} does not exist"),
    "a folder": ("rewards", "config file {file!r} is a folder, not a YAML file"),
    "not YAML": ("broken.yaml", "config file {file!r} is not valid YAML at line 3, column 1: expected ',' or ']', "
                                "but got '<stream end>'"),
    "not UTF-8": ("not_utf8.yaml", "config file {file!r} is not UTF-8 text (byte 0xe9 at position 16); save it as "
                                   "UTF-8"),
    "not a mapping": ("list.yaml", "config file {file!r} must hold a mapping of sections"),
}


@pytest.mark.parametrize("name, message", CONFIG_FILE_CASES.values(), ids=CONFIG_FILE_CASES.keys())
def test_a_bad_config_file_is_named(capsys, workdir, inputs, name, message):
    file = str(inputs / name)
    assert one_error_line(capsys, workdir, "train", file) == message.format(file=file)


def test_config_show_refuses_the_same_values(capsys, workdir, inputs):
    assert one_error_line(capsys, workdir, "config", "show", str(inputs / "config.yaml"), "rollout.n=0") == \
        "rollout.n=0: Input should be greater than 0"


# --- where the run writes: storage root and MLflow store ------------------------------------------

WHERE_CASES = {
    "storage root under /proc": (["run.storage_root=/proc/rlhf-runs"],
                                 "run.storage_root='/proc/rlhf-runs' is not writable: cannot create a folder in "
                                 "'/proc' (No such file or directory); give a folder you can write (a local path or "
                                 "an fsspec URI)"),
    "storage root under a file": (["run.storage_root={root}/config.yaml/runs"],
                                  "run.storage_root='{root}/config.yaml/runs' is not writable: '{root}/config.yaml' "
                                  "is a file, not a folder; give a folder you can write (a local path or an fsspec "
                                  "URI)"),
    "tracking scheme": (["tracking.tracking_uri=mlflw://host/db"],
                        "tracking.tracking_uri='mlflw://host/db': MLflow has no tracking store for the scheme 'mlflw'; "
                        f"use one of {VALID_TRACKING_SCHEMES} (e.g. sqlite:///.rlhf/mlflow.db or http://host:5000)"),
    "tracking scheme with a password": (["tracking.tracking_uri=postgres://user:secret@db/mlflow"],
                                        "tracking.tracking_uri='postgres://***@db/mlflow': MLflow has no tracking "
                                        "store for the scheme 'postgres'; use one of "
                                        f"{VALID_TRACKING_SCHEMES} (e.g. sqlite:///.rlhf/mlflow.db or "
                                        "http://host:5000)"),
    "tracking SQLite with two slashes": (["tracking.tracking_uri=sqlite://mlflow.db"],
                                         "tracking.tracking_uri='sqlite://mlflow.db' is not a SQLite URI MLflow "
                                         "reads; use sqlite:///<relative path> or sqlite:////<absolute path> (e.g. "
                                         "sqlite:///.rlhf/mlflow.db)"),
    "tracking without //": (["tracking.tracking_uri=sqlite:mlflow.db"],
                            "tracking.tracking_uri='sqlite:mlflow.db' is not a URI MLflow reads (no '//' after "
                            "'sqlite:'); e.g. sqlite:///.rlhf/mlflow.db, http://host:5000 or a local folder"),
    "tracking SQLite under /proc": (["tracking.tracking_uri=sqlite:////proc/rlhf/mlflow.db"],
                                    "tracking.tracking_uri='sqlite:////proc/rlhf/mlflow.db': the store's folder "
                                    "'/proc/rlhf' is not writable: cannot create a folder in '/proc' (No such file or "
                                    "directory); give a path you can write, e.g. sqlite:///.rlhf/mlflow.db"),
    "tracking server without a host": (["tracking.tracking_uri=http://"],
                                       "tracking.tracking_uri='http://' names no host; e.g. http://127.0.0.1:5000"),
}


@pytest.mark.parametrize("overrides, message", WHERE_CASES.values(), ids=WHERE_CASES.keys())
def test_where_the_run_writes_is_checked_first(capsys, workdir, inputs, overrides, message):
    overrides = [override.format(root=inputs) for override in overrides]
    assert one_error_line(capsys, workdir, *train(inputs, *overrides)) == message.format(root=inputs)


# --- data ------------------------------------------------------------------------------------------

DATA_CASES = {
    "missing file": (["data.train_files=[{root}/missing.parquet]"],
                     "data.train_files: file '{root}/missing.parquet' does not exist; give existing Parquet files "
                     "(paths or fsspec URIs)"),
    "missing validation file": (["data.val_files={root}/missing.parquet"],
                                "data.val_files: file '{root}/missing.parquet' does not exist; give existing Parquet "
                                "files (paths or fsspec URIs)"),
    "glob matching nothing": (["data.train_files=[{root}/2026-*.parquet]"],
                              "data.train_files: the pattern '{root}/2026-*.parquet' matches no file"),
    "not Parquet": (["data.train_files=[{root}/text.parquet]"],
                    "data.train_files: file '{root}/text.parquet' is not a readable Parquet file (Parquet magic bytes "
                    "not found in footer. Either the file is corrupted or this is not a parquet file.)"),
    "not UTF-8": (["data.train_files=[{root}/not_utf8.parquet]"],
                  "data.train_files: file '{root}/not_utf8.parquet' column 'prompt' holds text that is not UTF-8 (In "
                  "chunk 0: Invalid: Invalid UTF8 sequence at string index 0); write the file again with UTF-8 text"),
    "no prompt column": (["data.train_files=[{root}/no_prompt.parquet]"],
                         "data.train_files: file '{root}/no_prompt.parquet' has no 'prompt' column (has ['question', "
                         "'reward_model']); verl rows need prompt and reward_model"),
    "prompt of numbers": (["data.train_files=[{root}/int_prompt.parquet]"],
                          "data.train_files: file '{root}/int_prompt.parquet' column 'prompt' has type int64; expected "
                          "a string or a list of {{role, content}} structs"),
    "ground truth not in a struct": (["data.train_files=[{root}/truth_not_struct.parquet]"],
                                     "data.train_files: file '{root}/truth_not_struct.parquet' column 'reward_model' "
                                     "has type string; expected a struct with a 'ground_truth' field"),
    "no rows": (["data.val_files=[{root}/empty.parquet]"],
                "data.val_files: the files hold no rows ({root}/empty.parquet)"),
    "an empty prompt": (["data.train_files=[{root}/train.parquet, {root}/empty_prompt.parquet]"],
                        "data.train_files: prompt at row 0 of '{root}/empty_prompt.parquet' is empty (0 tokens); "
                        "remove it from the data"),
    "overlong prompts refused": (["data.max_prompt_length=3", "data.overlong_prompts=error"],
                                 "data.train_files: prompt at row 0 of '{root}/train.parquet' is 6 tokens, over "
                                 "data.max_prompt_length=3; raise data.max_prompt_length or set "
                                 "data.overlong_prompts=filter"),
    "every prompt overlong": (["data.max_prompt_length=3"],
                              "data.train_files: all 6 prompts are longer than data.max_prompt_length=3 tokens; raise "
                              "data.max_prompt_length"),
    "more prompts per step than prompts": (["data.prompts_per_step=7", "actor.ppo_mini_batch_size=7"],
                                           "data.prompts_per_step=7: data.train_files hold 6 usable prompts; use at "
                                           "most 6"),
    "warm-start target missing": (["warm_start.target=extra_info.solution"],
                                  "warm_start.target='extra_info.solution': row 0 of '{root}/train.parquet' has no "
                                  "extra_info.solution; use auto, ground_truth or extra_info.<key>"),
    "warm-start target unknown": (["warm_start.target=answer"],
                                  "warm_start.target='answer' is not valid; use auto, ground_truth or "
                                  "extra_info.<key>"),
}


@pytest.mark.parametrize("overrides, message", DATA_CASES.values(), ids=DATA_CASES.keys())
def test_bad_data_names_the_file(capsys, workdir, inputs, overrides, message):
    overrides = [override.format(root=inputs) for override in overrides]
    assert one_error_line(capsys, workdir, *train(inputs, *overrides)) == message.format(root=inputs)


# --- model -----------------------------------------------------------------------------------------

MODEL_CASES = {
    "missing folder": (["model.path=/nowhere/model"],
                       "model.path='/nowhere/model' does not exist; give a local model folder or a Hugging Face hub "
                       "name (`rlhf make-tiny-model DIR` writes a tiny one)"),
    "a file": (["model.path={root}/train.parquet"],
               "model.path='{root}/train.parquet' is a file, not a model folder; give the folder that holds its "
               "config.json (or a Hugging Face hub name)"),
    "no config.json": (["model.path={root}/only-tokenizer"],
                       "model.path='{root}/only-tokenizer' has no config.json, so it is not a Hugging Face model "
                       "folder; give the folder from save_pretrained (or a hub name)"),
    "config.json not UTF-8": (["model.path={root}/bad-config"],
                              "model.path='{root}/bad-config': '{root}/bad-config/config.json' is not UTF-8 text "
                              "(byte 0xff at position 33); write config.json as UTF-8 JSON"),
    "no tokenizer files": (["model.path={root}/no-tokenizer"],
                           "model.path='{root}/no-tokenizer': its tokenizer is broken: it encodes 'hello world 12' to "
                           f"no tokens {TOKENIZER_HINT}; give a model folder with its tokenizer files or a hub name"),
    "no earlier run to start from": (["model.from_run=yesterday"],
                                     "model.from_run='yesterday': that run has no committed actor weights under runs; "
                                     "give a run that has trained at least one step, or unset it"),
    "reward model missing": (["reward.kind=model", "reward.model_path=./no-reward-model"],
                             "reward.model_path='./no-reward-model' does not exist; give a local model folder or a "
                             "Hugging Face hub name (`rlhf make-tiny-model DIR` writes a tiny one)"),
    "missing folder a command of this project builds": (
        ["model.path=.rlhf/models/qwen2.5-0.5b-shaped"],
        "model.path='.rlhf/models/qwen2.5-0.5b-shaped' does not exist; build it with `rlhf make-tiny-model "
        ".rlhf/models/qwen2.5-0.5b-shaped --preset qwen2.5-0.5b`, or give another local model folder or a Hugging "
        "Face hub name"),
    "missing real model folder": (["model.path=/nowhere/smollm2-135m-instruct"],
                                  "model.path='/nowhere/smollm2-135m-instruct' does not exist; build it with `rlhf "
                                  "make-model smollm2-135m-instruct /nowhere/smollm2-135m-instruct`, or give another "
                                  "local model folder or a Hugging Face hub name"),
    "critic backbone missing": (["algorithm.adv_estimator=gae", "critic.model_path=/nowhere/critic"],
                                "critic.model_path='/nowhere/critic' does not exist; give a local model folder or a "
                                "Hugging Face hub name (`rlhf make-tiny-model DIR` writes a tiny one)"),
}


@pytest.mark.parametrize("overrides, message", MODEL_CASES.values(), ids=MODEL_CASES.keys())
def test_a_bad_model_is_reported_as_such(capsys, workdir, inputs, overrides, message):
    overrides = [override.format(root=inputs) for override in overrides]
    assert one_error_line(capsys, workdir, *train(inputs, *overrides)) == message.format(root=inputs)


# --- reward function -------------------------------------------------------------------------------

VALID_REWARDS = "use auto, a registered name (exact_match, final_turn_number, gsm8k, gsm8k_flexible) or 'module:function'"
REWARD_CASES = {
    "unknown name": ("exact", f"reward.function='exact' is not a registered reward function; {VALID_REWARDS}"),
    "empty module": (":boom", f"reward.function=':boom' has an empty module or function name; {VALID_REWARDS}"),
    "module not found": ("no_such_rewards:score",
                         "reward.function='no_such_rewards:score': cannot import module 'no_such_rewards' "
                         f"(ModuleNotFoundError: No module named 'no_such_rewards'); {VALID_REWARDS}"),
    "module fails on import": ("import_fails:score",
                               "reward.function='import_fails:score': cannot import module 'import_fails' "
                               f"(RuntimeError: no API key set); {VALID_REWARDS}"),
    "no such function": ("bad_rewards:score",
                         "reward.function='bad_rewards:score': module 'bad_rewards' has no attribute 'score'; "
                         f"{VALID_REWARDS}"),
    "not callable": ("bad_rewards:NOT_CALLABLE",
                     "reward.function='bad_rewards:NOT_CALLABLE': 'NOT_CALLABLE' is a int, not callable; "
                     f"{VALID_REWARDS}"),
    "parameter it cannot get": ("bad_rewards:wrong_parameters",
                                "reward.function='bad_rewards:wrong_parameters': its parameter 'answer' is not a field "
                                "a reward function receives; name its parameters after data_source, solution_str, "
                                "response_text, ground_truth, extra_info (or take **kwargs); e.g. verl's "
                                "compute_score(data_source, solution_str, ground_truth, extra_info=None)"),
}


@pytest.mark.parametrize("function, message", REWARD_CASES.values(), ids=REWARD_CASES.keys())
def test_a_bad_reward_function_is_refused_before_the_run(capsys, workdir, inputs, function, message):
    assert one_error_line(capsys, workdir, *train(inputs, f"reward.function={function}")) == message


# --- environment and commands ----------------------------------------------------------------------

ENVIRONMENT_CASES = {
    "rank not below world size": ({"RANK": "3", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"},
                                  "distributed env: RANK=3 must be < WORLD_SIZE=2"),
    "rank without world size": ({"RANK": "0"},
                                "distributed env: RANK=0 is set but WORLD_SIZE is not; set them together (torchrun "
                                "does) or unset RANK"),
    "world size not a number": ({"RANK": "0", "WORLD_SIZE": "two"},
                                "distributed env: WORLD_SIZE='two' is not an integer"),
}


@pytest.mark.parametrize("env, message", ENVIRONMENT_CASES.values(), ids=ENVIRONMENT_CASES.keys())
def test_torchrun_variables_that_contradict_are_refused(capsys, workdir, inputs, monkeypatch, env, message):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert one_error_line(capsys, workdir, *train(inputs)) == message


def test_resume_of_a_run_that_does_not_exist(capsys, workdir):
    assert one_error_line(capsys, workdir, "resume", "nightly", "--storage-root", "runs") == \
        f"run 'nightly': no {workdir}/runs/nightly/run.json; nothing to resume (is run.storage_root right?)"


def test_a_placement_on_gpus_that_are_not_there(capsys, workdir, inputs):
    line = one_error_line(capsys, workdir, "run", str(inputs / "config.yaml"), "placement.roles.actor=[99]")
    assert line.startswith("placement.roles.actor: GPU index 99 is out of range: "), line  # then what is visible


# --- the device: checked before anything exists, in train, run, quickstart and doctor ---------------

NO_CUDA = "trainer.device='cuda': no CUDA device is visible; use cpu or auto"
needs_no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal needs a machine without a GPU")


@needs_no_gpu
@pytest.mark.parametrize("command, config", [("train", "quickstart"), ("train", "test"), ("run", "test")])
def test_a_device_this_machine_lacks_is_refused_before_the_server_mlflow_or_the_run_folder(capsys, workdir, inputs,
                                                                                         command, config):
    """Issue 41, item 1: `rlhf train configs/quickstart.yaml trainer.device=cuda` printed the line after the server,
    the MLflow run and the run folder existed, and the folder refused the next plain run (`run.name='quickstart':
    ... already exists`). one_error_line asserts the working directory (where the quickstart's storage root, MLflow
    store and Prefect home are) stays empty: nothing is left to refuse the next run."""
    file = REPO / "configs" / "quickstart.yaml" if config == "quickstart" else inputs / "config.yaml"
    assert one_error_line(capsys, workdir, command, file, "trainer.device=cuda") == NO_CUDA


@needs_no_gpu
def test_quickstart_refuses_the_device_before_it_builds_anything(capsys, workdir, monkeypatch):
    built = []
    monkeypatch.setattr("flows.tools.cli._ensure_quickstart_inputs", built.append)
    assert one_error_line(capsys, workdir, "quickstart", "trainer.device=cuda") == NO_CUDA
    assert built == []


@needs_no_gpu
def test_doctor_fails_on_what_train_would_refuse(capsys, workdir):
    """Issue 41, item 2: `rlhf doctor configs/gpu-1x.yaml` here, its model folder missing, printed `ok: nothing would
    fail` and a parameter count's OSError (`Repo id must be in the form ...`), and exited 0. Now: both refusals,
    each the line `rlhf train` prints, and exit 1; doctor creates nothing but its storage probe's folder."""
    code = main(["doctor", str(REPO / "configs" / "gpu-1x.yaml")])
    out, err = capsys.readouterr()
    assert code == 1 and err == "", (code, err)
    lines = out.splitlines()
    section = lines.index("Run inputs")
    assert lines[section + 1:section + 3] == [
        f"  FAIL  {NO_CUDA}",
        "  FAIL  model.path='.rlhf/models/qwen2.5-0.5b-shaped' does not exist; build it with `rlhf make-tiny-model "
        ".rlhf/models/qwen2.5-0.5b-shaped --preset qwen2.5-0.5b`, or give another local model folder or a Hugging "
        "Face hub name"]
    assert lines[-1] == "FAIL: inputs (see the FAIL lines)"
    assert "Repo id" not in out and "OSError" not in out
    assert sorted(str(path.relative_to(workdir)) for path in workdir.rglob("*")) == [".rlhf", ".rlhf/runs"]


def test_doctor_reports_a_bad_input_as_train_does_and_exits_1(capsys, workdir, inputs):
    code = main(["doctor", str(inputs / "config.yaml"), "model.from_run=yesterday"])
    out, _ = capsys.readouterr()
    assert code == 1
    assert "  FAIL  model.from_run='yesterday': that run has no committed actor weights under runs; give a run that " \
           "has trained at least one step, or unset it\n" in out
    assert out.splitlines()[-1] == "FAIL: inputs (see the FAIL lines)"
    assert sorted(path.name for path in workdir.iterdir()) == ["runs"]  # the storage probe's folder, empty
    assert list((workdir / "runs").iterdir()) == []


# --- user code in the flow: a reward function that raises ------------------------------------------


def test_a_reward_function_that_raises_names_the_function_stage_step_and_sample(inputs, tmp_path):
    """The flow runs (server, MLflow, the model): the reward stage of step 0 fails on the first sample. The one
    error line names all four; the terminal shows no traceback (Prefect's log keeps it)."""
    env = {name: value for name, value in os.environ.items() if name not in ("PREFECT_API_URL", "RLHF_DEBUG",
                                                                              *DISTRIBUTED)}
    env["PYTHONPATH"] = os.pathsep.join([str(inputs / "rewards"), str(REPO)])
    result = subprocess.run([sys.executable, "-m", "flows.tools.cli", *train(inputs, "reward.function=bad_rewards:boom")],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert errors == [result.stderr.splitlines()[-1]], result.stderr[-3000:]
    assert errors[0] == ("error: stage reward at step 0 (sample 's0-p0-n0'): reward function bad_rewards:boom raised "
                         "ZeroDivisionError: the judge divided by zero on sample 0 (data_source 'arithmetic'); fix the "
                         "function (rlhf --debug shows its traceback)")
