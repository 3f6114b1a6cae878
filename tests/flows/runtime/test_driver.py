"""flows.runtime.driver: the GPUs a run computes on (verl's n_gpus in perf/throughput)."""

from __future__ import annotations

import json
from types import SimpleNamespace

from flows.config import build_config
from flows.runtime.driver import RunState


def test_gpus_count_the_distinct_gpus_of_the_workers(tmp_path, monkeypatch):
    monkeypatch.setenv("RLHF_WORKER_DIR", str(tmp_path))
    beats = [("actor", "h1", "0,1"), ("rollout", "h1", "0"), ("reference", "h1", "1"), ("reward", "h1", "cpu"),
             ("critic", "h2", "0")]
    for index, (role, host, devices) in enumerate(beats):
        (tmp_path / f"{role}-{host}-{index}.json").write_text(json.dumps({"role": role, "host": host, "devices": devices}))
    workers = SimpleNamespace(config=build_config({}, ["trainer.execution=workers"]))
    assert RunState.gpus(workers) == 3  # GPUs 0 and 1 of h1, GPU 0 of h2; the CPU reward counts none
    assert RunState.gpus(SimpleNamespace(config=build_config({}, ["trainer.execution=local"]))) == 1
    for path in tmp_path.iterdir():
        path.unlink()
    assert RunState.gpus(workers) == 1  # CPU workers only (or none yet): one


def test_overwrite_never_deletes_a_folder_that_is_not_a_run(tmp_path):
    from flows.config import ConfigError
    from flows.runtime.driver import start_run

    precious = tmp_path / "runs" / "thesis"
    precious.mkdir(parents=True)
    (precious / "chapter1.tex").write_text("months of work")
    config = build_config({}, [f"run.storage_root={tmp_path / 'runs'}", "run.name=thesis", "run.overwrite=true",
                               f"tracking.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}"])
    try:
        start_run(config)
        raise AssertionError("start_run deleted a folder that holds no run.json")
    except ConfigError as error:
        assert "holds no run.json" in str(error)
    assert (precious / "chapter1.tex").read_text() == "months of work"
    assert not (tmp_path / "mlflow.db").exists()  # refused before any MLflow run
