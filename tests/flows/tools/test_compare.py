"""`flows.tools.compare` against a real MLflow SQLite store holding synthetic runs with known metrics.

Runs in experiment "rlhf" (start times fixed so "newest" is known):
  alpha      (t=1000s) lr 1e-05, grpo; score = 0.1*step (1..10); val reward 0.0/0.6/0.5 at 0/5/10;
             ppo_kl = 0.01*|step-4| + 0.001; response length = 10 + step
  beta-old   (t=2000s) run name "beta", lr 3e-05, rloo, extra param; score = 0.2 at steps 1..3
  beta       (t=3000s) lr 2e-05, rloo; score = 0.05*step; no val; kl_loss = 0.2 - 0.01*step;
             response length = 40 - step
Experiment "other": gamma (MLflow run name only, no rlhf.run_name tag).
"""

from __future__ import annotations

import argparse

import pytest
from mlflow.entities import Metric, Param
from mlflow.tracking import MlflowClient

from flows.tools.compare import (DEFAULT_METRICS, MetricSummary, add_compare_parser, best_direction,
                           cmd_compare, compare_runs, format_table)

STEPS = range(1, 11)
COMMON = {"trainer.total_steps": "10", "data.shuffle": "True", "run.storage_root": ".rlhf/runs"}


def _log(client, experiment_id, name, start_s, params, metrics, tag=True) -> str:
    tags = {"rlhf.run_name": name} if tag else {}
    run = client.create_run(experiment_id, start_time=start_s * 1000, run_name=name, tags=tags)
    run_id = run.info.run_id
    client.log_batch(run_id, params=[Param(key, value) for key, value in {**COMMON, **params}.items()])
    entries = [Metric(key, value, start_s * 1000 + step, step) for key, points in metrics.items()
               for step, value in points]
    client.log_batch(run_id, metrics=entries)
    client.set_terminated(run_id, "FINISHED")
    return run_id


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    root = tmp_path_factory.mktemp("mlflow")
    uri = f"sqlite:///{root / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri)
    rlhf, other = client.create_experiment("rlhf"), client.create_experiment("other")
    ids = {
        "alpha": _log(client, rlhf, "alpha", 1000, {"actor.optim.lr": "1e-05", "algorithm.adv_estimator": "grpo"}, {
            "critic/score/mean": [(s, 0.1 * s) for s in STEPS],
            "val/reward/mean": [(0, 0.0), (5, 0.6), (10, 0.5)],
            "actor/ppo_kl": [(s, 0.01 * abs(s - 4) + 0.001) for s in STEPS],
            "response_length/mean": [(s, 10.0 + s) for s in STEPS]}),
        "beta-old": _log(client, rlhf, "beta", 2000, {"actor.optim.lr": "3e-05", "algorithm.adv_estimator": "rloo",
                                                      "extra": "x"}, {
            "critic/score/mean": [(s, 0.2) for s in (1, 2, 3)]}),
        "beta": _log(client, rlhf, "beta", 3000, {"actor.optim.lr": "2e-05", "algorithm.adv_estimator": "rloo"}, {
            "critic/score/mean": [(s, 0.05 * s) for s in STEPS],
            "actor/kl_loss": [(s, 0.2 - 0.01 * s) for s in STEPS],
            "response_length/mean": [(s, 40.0 - s) for s in STEPS]}),
        "gamma": _log(client, other, "gamma", 4000, {"actor.optim.lr": "1e-05"}, {
            "critic/score/mean": [(1, 0.3)]}, tag=False),
    }
    return uri, ids


def test_differing_params_and_metric_summary(store, tmp_path):
    uri, ids = store
    result = compare_runs(uri, ["alpha", "beta"], output_png=tmp_path / "c.png")
    assert [run["name"] for run in result.runs] == ["alpha", "beta"]
    assert [run["run_id"] for run in result.runs] == [ids["alpha"], ids["beta"]]
    assert all(run["status"] == "FINISHED" and run["start_time"] for run in result.runs)
    assert result.differing_params == {"actor.optim.lr": ["1e-05", "2e-05"],
                                       "algorithm.adv_estimator": ["grpo", "rloo"]}
    summary = result.metric_summary
    assert summary["critic/score/mean"]["alpha"] == MetricSummary(pytest.approx(1.0), 10, pytest.approx(1.0), 10, "max")
    assert summary["critic/score/mean"]["beta"] == MetricSummary(pytest.approx(0.5), 10, pytest.approx(0.5), 10, "max")
    assert summary["val/reward/mean"]["alpha"] == MetricSummary(0.5, 10, 0.6, 5, "max")
    assert summary["val/reward/mean"]["beta"] is None
    # A KL has no best (issue 41, item 6: the minimum of the signed actor/ppo_kl was called best): the final only.
    assert summary["actor/ppo_kl"]["alpha"] == MetricSummary(pytest.approx(0.061), 10, None, None, None)
    assert summary["actor/kl_loss"]["beta"] == MetricSummary(pytest.approx(0.1), 10, None, None, None)
    assert summary["response_length/mean"]["beta"] == MetricSummary(30.0, 10, None, None, None)
    # Metrics neither run logged are left out, and said so.
    assert "timing_s/step" not in summary and "actor/reward_kl_penalty" not in summary
    assert any("timing_s/step" in note for note in result.notes)


def test_best_direction_rules():
    assert [best_direction(m) for m in DEFAULT_METRICS] == [
        "max", "max", None, None, None, None, "min", "max", "min", None, None, None]
    assert best_direction("actor/reward_kl_penalty") is None  # a KL, not a reward


def test_resolution_by_name_id_and_latest_of_duplicates(store):
    uri, ids = store
    by_id = compare_runs(uri, [ids["alpha"], ids["beta-old"]])
    assert [run["run_id"] for run in by_id.runs] == [ids["alpha"], ids["beta-old"]]
    assert by_id.differing_params["extra"] == [None, "x"]
    assert by_id.plot_path is None and by_id.plotted == {}
    latest = compare_runs(uri, ["beta"], experiment="rlhf")
    assert latest.runs[0]["run_id"] == ids["beta"]
    assert any("'beta' matches 2 runs" in note and ids["beta"] in note for note in latest.notes)
    # A run known only by its MLflow run name, found across experiments when none is given.
    assert compare_runs(uri, ["gamma"]).runs[0]["run_id"] == ids["gamma"]


def test_default_takes_newest_runs_of_experiment(store):
    uri, ids = store
    result = compare_runs(uri)
    assert [run["run_id"] for run in result.runs] == [ids["beta"], ids["beta-old"], ids["alpha"]]
    assert [run["label"] for run in result.runs] == ["beta#1", "beta#2", "alpha"]
    assert set(result.metric_summary["critic/score/mean"]) == {"beta#1", "beta#2", "alpha"}


def test_unknown_run_and_experiment_are_one_line_errors(store):
    uri, _ = store
    with pytest.raises(ValueError, match=r"unknown run 'nope'.*known runs: beta, alpha$"):
        compare_runs(uri, ["alpha", "nope"], experiment="rlhf")
    with pytest.raises(ValueError, match="unknown run 'gamma'.*experiment 'rlhf'"):
        compare_runs(uri, ["gamma"], experiment="rlhf")
    with pytest.raises(ValueError, match="unknown experiment 'missing'; known experiments: .*rlhf"):
        compare_runs(uri, experiment="missing")


def test_missing_sqlite_store_is_refused(tmp_path):
    with pytest.raises(ValueError, match="no MLflow store at"):
        compare_runs(f"sqlite:///{tmp_path / 'absent.db'}", ["alpha"])
    assert not (tmp_path / "absent.db").exists()


def test_plot_is_a_png_with_the_expected_series(store, tmp_path):
    uri, _ = store
    result = compare_runs(uri, ["alpha", "beta"], output_png=tmp_path / "sub" / "compare.png")
    assert result.plot_path == tmp_path / "sub" / "compare.png"
    assert result.plot_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert result.plotted == {
        "alpha": ["critic/score/mean", "val/reward/mean", "actor/ppo_kl", "response_length/mean"],
        "beta": ["critic/score/mean", "actor/kl_loss", "response_length/mean"],
    }
    # A metric beyond the defaults gets plotted too; default table-only metrics do not.
    custom = compare_runs(uri, ["alpha"], output_png=tmp_path / "c.png",
                          metrics=["critic/score/mean", "custom/thing", "timing_s/step"])
    assert custom.plotted == {"alpha": ["critic/score/mean"]}


def test_format_table(store, tmp_path):
    uri, _ = store
    text = format_table(compare_runs(uri, ["alpha", "beta"]), width=200)
    lines = text.splitlines()
    assert lines[0].split() == ["param", "alpha", "beta"]
    assert next(line for line in lines if line.startswith("actor.optim.lr")).split() == ["actor.optim.lr", "1e-05", "2e-05"]
    rows = {line.split()[0]: line for line in lines if line.split() and "/" in line.split()[0]}
    assert rows["critic/score/mean"].split() == ["critic/score/mean", "1", "/", "1@10", "0.5", "/", "0.5@10"]
    assert rows["val/reward/mean"].split() == ["val/reward/mean", "0.5", "/", "0.6@5", "-"]
    assert rows["actor/ppo_kl"].split() == ["actor/ppo_kl", "0.061", "-"]
    assert "metrics: final / best@step (best: max for score/reward/throughput, min for loss/timing; none for KL, " \
           "which is no objective)" in lines
    assert rows["response_length/mean"].split() == ["response_length/mean", "20", "30"]
    # Narrow: the run columns wrap into blocks, each repeating the row labels.
    narrow = format_table(compare_runs(uri, ["alpha", "beta"]), width=40)
    assert narrow.count("critic/score/mean") == 2
    assert all(len(line) <= 40 for line in narrow.splitlines() if not line.startswith("metrics:"))


def test_cmd_compare_via_parser(store, tmp_path, capsys):
    uri, _ = store
    parser = argparse.ArgumentParser(prog="rlhf")
    add_compare_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["compare", "alpha", "beta", "--tracking-uri", uri, "--output",
                              str(tmp_path / "cli.png"), "--metric", "critic/score/mean"])
    assert args.handler(args) == 0
    out = capsys.readouterr().out
    assert "critic/score/mean" in out and "alpha" in out and "beta" in out
    assert "actor/ppo_kl" not in out
    assert out.rstrip().endswith(f"plot: {tmp_path / 'cli.png'}")
    assert (tmp_path / "cli.png").exists()


def test_cmd_compare_namespace_relative_sqlite_uri(store, tmp_path, monkeypatch, capsys):
    uri, _ = store
    store_dir = uri[len("sqlite:///"):].rsplit("/", 1)[0]
    monkeypatch.chdir(store_dir)
    args = argparse.Namespace(runs=[], experiment="rlhf", tracking_uri="sqlite:///mlflow.db",
                              output=str(tmp_path / "ns.png"), metric=None)
    assert cmd_compare(args) == 0
    out = capsys.readouterr().out
    assert "beta#1" in out and "alpha" in out and "plot: " in out
