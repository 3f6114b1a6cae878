"""flows.tools.cli: the `rlhf` command line, run as a subprocess (`python -m flows.tools.cli`) the way a user runs it.

quickstart/train start a Prefect server and train; they are covered by the end-to-end tests.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[3]
QUICKSTART = "configs/quickstart.yaml"


def rlhf(*args: str, cwd: Path = REPO, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "flows.tools.cli", *map(str, args)],
        cwd=cwd, capture_output=True, text=True, timeout=timeout,
    )


def assert_user_error(result: subprocess.CompletedProcess, *fragments: str) -> str:
    """Exit code 2, exactly one stderr line starting with `error:`, no traceback, nothing on stdout."""
    assert result.returncode == 2, (result.returncode, result.stdout, result.stderr)
    assert "Traceback" not in result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: "), lines[0]
    assert result.stdout == ""
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    return lines[0]


# --- help -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("command", [
    ["quickstart"], ["train"], ["config", "show"], ["make-tiny-model"], ["make-data"],
])
def test_help(command):
    result = rlhf(*command, "--help")
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    assert "example" in result.stdout
    assert result.stdout.startswith(f"usage: rlhf {' '.join(command)}")
    assert "rlhf " + " ".join(command) in result.stdout.split("example", 1)[1]  # the example runs this command


def test_top_level_help_lists_commands():
    result = rlhf("--help")
    assert result.returncode == 0
    for command in ("quickstart", "train", "config", "make-tiny-model", "make-data"):
        assert command in result.stdout


def test_no_command_is_a_usage_error():
    result = rlhf()
    assert result.returncode == 2
    assert "usage: rlhf" in result.stderr
    assert "Traceback" not in result.stderr


# --- config show ----------------------------------------------------------------------------------


def test_config_show_with_override():
    result = rlhf("config", "show", QUICKSTART, "actor.optim.lr=1e-5")
    assert result.returncode == 0, result.stderr
    shown = yaml.safe_load(result.stdout)
    assert isinstance(shown, dict)
    assert shown["actor"]["optim"]["lr"] == 1e-5
    # values from the YAML file
    assert shown["rollout"]["n"] == 8
    assert shown["algorithm"]["adv_estimator"] == "grpo"
    assert shown["trainer"]["total_steps"] == 200
    # defaults the file does not mention
    assert shown["trainer"]["seed"] == 0
    assert shown["critic"]["optim"]["lr"] == 1e-5
    assert shown["data"]["max_val_prompts"] is None
    assert list(shown) == ["run", "model", "data", "rollout", "actor", "critic", "reward", "algorithm",
                           "warm_start", "trainer", "tracking", "placement"]


def test_config_show_output_round_trips(tmp_path):
    # The printed config is itself a valid config file that resolves to the same values.
    from flows.config import load_config

    result = rlhf("config", "show", QUICKSTART, "trainer.total_steps=5", "data.train_files=[a.parquet,b.parquet]")
    assert result.returncode == 0, result.stderr
    path = tmp_path / "shown.yaml"
    path.write_text(result.stdout)
    expected = load_config(REPO / QUICKSTART, ["trainer.total_steps=5", "data.train_files=[a.parquet,b.parquet]"])
    assert load_config(path) == expected
    assert load_config(path).data.train_files == ["a.parquet", "b.parquet"]


def test_config_show_defaults_without_file():
    result = rlhf("config", "show")
    assert result.returncode == 0, result.stderr
    shown = yaml.safe_load(result.stdout)
    assert shown["actor"]["optim"]["lr"] == 1e-5
    assert shown["trainer"]["total_steps"] == 2


def test_config_show_overrides_without_file():
    result = rlhf("config", "show", "actor.optim.lr=0.001")
    assert result.returncode == 0, result.stderr
    assert yaml.safe_load(result.stdout)["actor"]["optim"]["lr"] == 1e-3


def test_config_show_in_process(capsys):
    from flows.tools.cli import main

    assert main(["config", "show", str(REPO / QUICKSTART), "rollout.n=16"]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    assert yaml.safe_load(out)["rollout"]["n"] == 16


def test_config_show_says_what_the_run_will_be_called(capsys):
    """Issue 41, item 6: show printed `run.name: quickstart` while `rlhf quickstart` names its run
    quickstart-<time>; its first line (a YAML comment) says the name, and for the quickstart's file both."""
    import re

    from flows.tools.cli import _quickstart_config, main

    assert main(["config", "show", str(REPO / QUICKSTART)]) == 0
    assert capsys.readouterr().out.splitlines()[0] == (
        "# the run is named quickstart (run.name); `rlhf quickstart` runs this file as quickstart-<its start time, "
        "YYYYmmdd-HHMMSS>")
    assert re.fullmatch(r"quickstart-\d{8}-\d{6}", _quickstart_config([]).run.name)
    assert main(["config", "show", "run.name=nightly", "run.name_timestamp=true"]) == 0
    assert capsys.readouterr().out.splitlines()[0] == (
        "# the run is named nightly-<its start time in UTC, YYYYmmdd-HHMMSS> (run.name_timestamp=true)")


def test_the_help_cites_only_config_files_that_exist():
    """Issue 41, item 6: the top-level help cited configs/grpo.yaml, which does not exist."""
    import re

    from flows.tools.cli import build_parser

    parser = build_parser()
    texts = [parser.format_help()] + [sub.format_help() for action in parser._subparsers._group_actions
                                       for sub in action.choices.values()]
    cited = sorted(set(re.findall(r"configs/[\w.-]+\.yaml", "\n".join(texts))))
    assert "configs/gpu-1x.yaml" in cited and "configs/grpo.yaml" not in cited
    assert [name for name in cited if not (REPO / name).is_file()] == []


# --- user errors: one `error:` line, exit 2 --------------------------------------------------------


def test_bad_override_value():
    result = rlhf("config", "show", QUICKSTART, "actor.optim.lr=-1")
    assert_user_error(result, "actor.optim.lr=-1")


def test_non_numeric_override_value():
    result = rlhf("config", "show", QUICKSTART, "trainer.total_steps=many")
    assert_user_error(result, "trainer.total_steps='many'")


def test_override_without_equals():
    result = rlhf("config", "show", QUICKSTART, "trainer.total_steps")
    assert_user_error(result, "trainer.total_steps", "key.path=value")


def test_unknown_field():
    result = rlhf("config", "show", QUICKSTART, "actor.lrr=1")
    assert_user_error(result, "actor.lrr", "unknown field")


def test_unknown_estimator():
    result = rlhf("config", "show", QUICKSTART, "algorithm.adv_estimator=foo")
    assert_user_error(result, "algorithm.adv_estimator='foo'", "grpo")


def test_missing_config_file(tmp_path):
    missing = tmp_path / "nope.yaml"
    result = rlhf("config", "show", missing)
    assert_user_error(result, str(missing), "does not exist")


def test_config_file_not_a_mapping(tmp_path):
    path = tmp_path / "list.yaml"
    path.write_text("- 1\n- 2\n")
    assert_user_error(rlhf("config", "show", path), str(path), "mapping")


def test_error_in_process(capsys):
    from flows.tools.cli import main

    assert main(["config", "show", str(REPO / QUICKSTART), "rollout.engine=foo"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err == "error: rollout.engine='foo': Input should be 'auto', 'vllm' or 'hf'\n"


def test_invalid_yaml_is_one_line(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("actor: {optim: [\n  lr: 1\n")
    assert_user_error(rlhf("config", "show", path), str(path), "not valid YAML")


def test_make_data_bad_size(tmp_path):
    result = rlhf("make-data", "arithmetic", tmp_path / "d", "--train-size", "0")
    assert_user_error(result, "train_size=0")


def test_make_data_unknown_task(tmp_path):
    result = rlhf("make-data", "poetry", tmp_path / "d")
    assert result.returncode == 2
    assert "invalid choice: 'poetry'" in result.stderr
    assert "Traceback" not in result.stderr


def test_make_data_output_under_a_file(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    result = rlhf("make-data", "arithmetic", blocker / "d", "--train-size", "2", "--validation-size", "1")
    assert_user_error(result, str(blocker / "d"))


# --- make-data / make-tiny-model ------------------------------------------------------------------


def test_make_data(tmp_path):
    import pyarrow.parquet as pq

    out = tmp_path / "arith"
    result = rlhf("make-data", "arithmetic", out, "--train-size", "20", "--validation-size", "5")
    assert result.returncode == 0, result.stderr
    train, validation = out / "train.parquet", out / "validation.parquet"
    assert sorted(p.name for p in out.iterdir()) == ["train.parquet", "validation.parquet"]
    assert pq.read_table(train).num_rows == 20
    assert pq.read_table(validation).num_rows == 5
    assert f"train: {train}" in result.stdout
    assert f"validation: {validation}" in result.stdout
    # verl's columns
    columns = set(pq.read_table(train).column_names)
    assert {"prompt", "reward_model"} <= columns
    # the splits share no prompt
    prompts = lambda path: {str(row) for row in pq.read_table(path).column("prompt").to_pylist()}  # noqa: E731
    assert not prompts(train) & prompts(validation)


def test_make_data_seed_is_deterministic(tmp_path):
    import pyarrow.parquet as pq

    for name, seed in (("a", "1"), ("b", "1"), ("c", "2")):
        result = rlhf("make-data", "arithmetic", tmp_path / name, "--train-size", "10",
                      "--validation-size", "2", "--seed", seed)
        assert result.returncode == 0, result.stderr
    table = lambda name: pq.read_table(tmp_path / name / "train.parquet").to_pylist()  # noqa: E731
    assert table("a") == table("b")
    assert table("a") != table("c")


def test_make_tiny_model(tmp_path):
    from transformers import AutoConfig, AutoTokenizer

    out = tmp_path / "tiny"
    result = rlhf("make-tiny-model", out)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == str(out)
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (out / name).is_file(), name
    tokenizer = AutoTokenizer.from_pretrained(out)
    ids = tokenizer("12+34=")["input_ids"]
    assert len(ids) == 6  # byte-level, no merges: one token per character
    assert tokenizer.decode(ids) == "12+34="
    assert tokenizer.eos_token is not None
    assert tokenizer.pad_token is not None and tokenizer.pad_token_id != tokenizer.eos_token_id
    config = AutoConfig.from_pretrained(out)
    assert config.model_type == "qwen2"
    assert config.vocab_size >= len(tokenizer)
