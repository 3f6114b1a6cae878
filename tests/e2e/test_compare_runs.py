"""`rlhf compare` on two real tiny training runs (GRPO and RLOO) tracked in one MLflow SQLite store."""

from __future__ import annotations

import pytest
from mlflow.tracking import MlflowClient

from flows.tools.compare import compare_runs

pytestmark = pytest.mark.e2e

COMPARED = ("critic/score/mean", "val/reward/mean")


def _config(make_config, tmp_path, name, estimator):
    return make_config(tmp_path, name, "e2e-compare", algorithm={"adv_estimator": estimator},
                       trainer={"total_steps": 2, "val_every": 1, "samples_every": 1, "device": "cpu"})


@pytest.fixture(scope="module")
def two_runs(prefect_api, tiny_inputs, tmp_path_factory, make_config):
    from flows.training.train import train

    tmp_path = tmp_path_factory.mktemp("compare")
    ids = {}
    for name, estimator in (("cmp-grpo", "grpo"), ("cmp-rloo", "rloo")):
        state = train(_config(make_config, tmp_path, name, estimator), return_state=True)
        assert state.is_completed(), state
        ids[name] = state.result()["mlflow_run_id"]
    return f"sqlite:///{tmp_path}/mlflow.db", ids, tmp_path


def test_compare_runs_matches_mlflow_and_plots_both_runs(two_runs):
    uri, ids, tmp_path = two_runs
    result = compare_runs(uri, ["cmp-grpo", "cmp-rloo"], output_png=tmp_path / "c.png")
    assert [(run["name"], run["run_id"], run["status"]) for run in result.runs] == [
        ("cmp-grpo", ids["cmp-grpo"], "FINISHED"), ("cmp-rloo", ids["cmp-rloo"], "FINISHED")]
    assert result.differing_params["algorithm.adv_estimator"] == ["grpo", "rloo"]
    assert result.differing_params["run.name"] == ["cmp-grpo", "cmp-rloo"]
    assert "actor.optim.lr" not in result.differing_params

    client = MlflowClient(tracking_uri=uri)
    for metric in COMPARED:
        for name, run_id in ids.items():
            history = sorted(client.get_metric_history(run_id, metric), key=lambda m: (m.step, m.timestamp))
            summary = result.metric_summary[metric][name]
            assert summary.final == history[-1].value, (metric, name)
            assert summary.final_step == history[-1].step == 2, (metric, name)
            assert summary.best == max(m.value for m in history), (metric, name)

    assert result.plot_path == tmp_path / "c.png"
    assert result.plot_path.stat().st_size > 1000
    assert result.plot_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for name in ids:
        assert set(COMPARED) <= set(result.plotted[name]), name


def test_cli_prints_both_runs_and_writes_the_plot(two_runs, capsys):
    from flows.tools.cli import main

    uri, ids, tmp_path = two_runs
    output = tmp_path / "cli" / "compare.png"
    assert main(["compare", "cmp-grpo", "cmp-rloo", "--tracking-uri", uri, "--output", str(output)]) == 0
    printed = capsys.readouterr().out
    assert f"cmp-grpo: {ids['cmp-grpo']} FINISHED" in printed
    assert f"cmp-rloo: {ids['cmp-rloo']} FINISHED" in printed
    header = next(line for line in printed.splitlines() if line.startswith("param"))
    assert "cmp-grpo" in header and "cmp-rloo" in header
    adv = next(line for line in printed.splitlines() if line.startswith("algorithm.adv_estimator"))
    assert adv.split() == ["algorithm.adv_estimator", "grpo", "rloo"]
    score = next(line for line in printed.splitlines() if line.startswith("critic/score/mean"))
    client = MlflowClient(tracking_uri=uri)
    final = client.get_metric_history(ids["cmp-grpo"], "critic/score/mean")[-1].value
    assert score.split()[1] == f"{final:.4g}"
    assert f"plot: {output}" in printed
    assert output.exists() and output.stat().st_size > 1000
