"""`rlhf submit`: a deployment's run whose config does not validate, or whose inputs the worker would refuse
(model.from_run against the deployment's storage root, data globs against its working directory: prefect.yaml's
folder), is refused in one line before anything reaches the server (PREFECT_API_URL points at a port nothing listens
on: a submission would fail otherwise; run_deployment is watched). The accepted path (a flow run a worker completes)
is tests/e2e/test_deployment.py."""

from __future__ import annotations

from pathlib import Path

import pytest

import yaml

from components.tasks.arithmetic import write_arithmetic_dataset
from components.tiny import build_tiny_model
from flows.tools.cli import main
from flows.tools.submit import check_submission, submission_config
from storage import COMMITTED_MARKER, RunLayout

REPO = Path(__file__).resolve().parents[3]
PROJECT = REPO / "prefect.yaml"


@pytest.fixture(autouse=True)
def _no_server(monkeypatch):
    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:9/api")


@pytest.mark.parametrize("arguments, line", [
    (["quickstart", "trainer.total_steps=0"], "error: trainer.total_steps=0: Input should be greater than 0"),
    (["quickstart", "rollout.engine=foo"], "error: rollout.engine='foo': Input should be 'auto', 'vllm' or 'hf'"),
    (["nightly", "trainer.total_step=3"],
     "error: trainer.total_step: unknown field (check the spelling; `rlhf config show` lists fields)"),
    (["weekly"], f"error: deployment 'weekly' is not in {PROJECT}; choose one of ['quickstart', 'nightly']"),
])
def test_a_bad_submission_is_one_line_and_reaches_no_server(arguments, line, capsys):
    assert main(["submit", *arguments, "--project-file", str(PROJECT)]) == 2
    captured = capsys.readouterr()
    assert captured.err.splitlines() == [line]
    assert captured.out == ""


def test_a_missing_project_file_is_one_line(tmp_path, capsys):
    assert main(["submit", "quickstart", "--project-file", str(tmp_path / "prefect.yaml")]) == 2
    assert capsys.readouterr().err == (f"error: deployment 'quickstart': no {tmp_path / 'prefect.yaml'}; run rlhf "
                                       "submit from the checkout that holds prefect.yaml (or pass --project-file)\n")


def test_the_checked_config_is_the_one_the_flow_will_run():
    config = submission_config("nightly", ["trainer.total_steps=7"], PROJECT)
    assert (config.run.name, config.model.from_run, config.trainer.total_steps) == ("nightly", "quickstart-main", 7)
    assert config.warm_start.steps == 0  # the deployment's own override, then the run's


# --- what the worker will read, resolved where the worker resolves it ------------------------------------------

NIGHTLY_OVERRIDES = ["run.name=nightly", "run.name_timestamp=true", "model.from_run=quickstart-main",
                     "data.train_files=[.rlhf/data/nightly/*.parquet]", "warm_start.steps=0"]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("submit-model") / "tiny")


@pytest.fixture
def project(tmp_path, model, monkeypatch) -> Path:
    """A checkout of its own: prefect.yaml with a nightly deployment as the repository's (relative storage root,
    tracking store and data glob), the validation file in place; the shell is in another folder."""
    checkout = tmp_path / "checkout"
    data = write_arithmetic_dataset(checkout / ".rlhf" / "data" / "arithmetic", train_size=8, validation_size=4)
    data["train"].unlink()  # the nightly glob's files are what the test writes
    (checkout / "config.yaml").write_text(yaml.safe_dump({
        "run": {"storage_root": ".rlhf/runs"}, "model": {"path": str(model)},
        "data": {"val_files": [".rlhf/data/arithmetic/validation.parquet"], "max_prompt_length": 16,
                 "prompts_per_step": 4},
        "rollout": {"engine": "hf", "n": 2}, "actor": {"ppo_mini_batch_size": 4, "micro_batch_size": 8},
        "trainer": {"device": "cuda"},  # the worker's device: not this machine's to check
        "tracking": {"tracking_uri": "sqlite:///.rlhf/mlflow.db"}}))
    (checkout / "prefect.yaml").write_text(yaml.safe_dump({"deployments": [{
        "name": "nightly", "entrypoint": "flows/training/train.py:train",
        "parameters": {"config_file": "config.yaml", "deployment_overrides": NIGHTLY_OVERRIDES}}]}))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    return checkout


@pytest.fixture
def submissions(monkeypatch) -> list:
    calls = []
    monkeypatch.setattr("prefect.deployments.run_deployment", lambda *args, **kwargs: calls.append(args))
    return calls


def _files(folder: Path) -> list[str]:
    return sorted(str(path.relative_to(folder)) for path in folder.rglob("*"))


def _commit_actor_weights(checkout: Path, run: str, step: int) -> None:
    weights = Path(RunLayout(str(checkout / ".rlhf" / "runs"), run).weights_dir("actor", step))
    weights.mkdir(parents=True)
    (weights / COMMITTED_MARKER).write_text("")


def test_a_run_to_start_from_that_has_no_weights_is_refused_before_the_server(project, submissions, capsys):
    """Issue 41, item 3: `rlhf submit nightly` returned 0 and the worker failed on model.from_run."""
    before = _files(project)
    assert main(["submit", "nightly", "--project-file", str(project / "prefect.yaml")]) == 2
    captured = capsys.readouterr()
    assert captured.err.splitlines() == [
        "error: model.from_run='quickstart-main': that run has no committed actor weights under .rlhf/runs; give a "
        "run that has trained at least one step, or unset it"]
    assert captured.out == "" and submissions == []
    assert _files(project) == before  # no run folder, no MLflow store


def test_a_data_glob_matching_nothing_in_the_deployments_folder_is_refused(project, submissions, capsys):
    """from_run resolves against the deployment's storage root (the checkout's .rlhf/runs, not the shell's folder's),
    then the glob against the checkout: it matches nothing there."""
    _commit_actor_weights(project, "quickstart-main", 3)
    (Path.cwd() / ".rlhf" / "data" / "nightly").mkdir(parents=True)  # the shell's folder has files matching the glob
    write_arithmetic_dataset(Path.cwd() / ".rlhf" / "data" / "nightly", train_size=8, validation_size=4)
    before = _files(project)
    assert main(["submit", "nightly", "--project-file", str(project / "prefect.yaml")]) == 2
    captured = capsys.readouterr()
    assert captured.err.splitlines() == [
        "error: data.train_files: the pattern '.rlhf/data/nightly/*.parquet' matches no file"]
    assert captured.out == "" and submissions == []
    assert _files(project) == before


def test_a_submission_whose_inputs_the_worker_will_find_is_checked_in_the_deployments_folder(project, submissions):
    _commit_actor_weights(project, "quickstart-main", 3)
    write_arithmetic_dataset(project / ".rlhf" / "data" / "nightly", train_size=8, validation_size=4)
    before = _files(project)
    config = check_submission("nightly", [], project / "prefect.yaml")
    assert (config.model.from_run, config.data.train_files) == ("quickstart-main", [".rlhf/data/nightly/*.parquet"])
    assert _files(project) == before and not (Path.cwd() / ".rlhf").exists()
