"""`rlhf submit`: a deployment's run whose config does not validate is refused in one line before anything
reaches the server (PREFECT_API_URL points at a port nothing listens on: a submission would fail otherwise).
The accepted path (a flow run a worker completes) is tests/e2e/test_deployment.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from flows.tools.cli import main
from flows.tools.submit import check_submission

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
    config = check_submission("nightly", ["trainer.total_steps=7"], PROJECT)
    assert (config.run.name, config.model.from_run, config.trainer.total_steps) == ("nightly", "quickstart-main", 7)
    assert config.warm_start.steps == 0  # the deployment's own override, then the run's
