"""A real local Prefect server for the end-to-end tests (the same launcher the CLI uses)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def prefect_api(tmp_path_factory):
    from flows.runtime.launcher import prefect_server, using_prefect_api

    home = tmp_path_factory.mktemp("prefect-home")
    with prefect_server(prefect_home=home) as api_url, using_prefect_api(api_url, prefect_home=home):
        yield api_url


@pytest.fixture(scope="session")
def tiny_inputs(tmp_path_factory):
    """A tiny model and a small arithmetic task, made once per session."""
    from components.tasks.arithmetic import write_arithmetic_dataset
    from components.tiny import build_tiny_model

    root = tmp_path_factory.mktemp("inputs")
    model = build_tiny_model(root / "model")
    data = write_arithmetic_dataset(root / "data", train_size=64, validation_size=16, high=49)
    return {"model": str(model), "train": str(data["train"]), "validation": str(data["validation"])}


@pytest.fixture(scope="session")
def make_config(tiny_inputs):
    """A tiny run config (4 prompts x 4 samples, 4 new tokens, CPU) with section overrides merged in."""
    from flows.config import build_config

    def make(tmp_path, name, experiment="e2e", **sections):
        data = {
            "run": {"name": name, "storage_root": str(tmp_path / "runs")},
            "model": {"path": tiny_inputs["model"]},
            "data": {"train_files": [tiny_inputs["train"]], "val_files": [tiny_inputs["validation"]],
                     "max_prompt_length": 16, "prompts_per_step": 4},
            # transformers generation: fast to start; the vLLM engine has its own end-to-end test.
            "rollout": {"n": 4, "max_new_tokens": 4, "engine": "hf"},
            "actor": {"ppo_mini_batch_size": 2, "micro_batch_size": 4, "optim": {"lr": 1e-4}},
            # A stage here takes seconds: a hang fails the test in minutes, not in the default hour.
            "trainer": {"total_steps": 2, "val_every": 1, "device": "cpu", "stage_timeout_s": 300},
            "tracking": {"tracking_uri": f"sqlite:///{tmp_path}/mlflow.db", "experiment": experiment},
        }
        for section, values in sections.items():
            data.setdefault(section, {}).update(values)
        return build_config(data)

    return make
