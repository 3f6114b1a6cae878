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
