"""A real local Prefect server for the end-to-end tests (the same launcher the CLI uses)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def prefect_api(tmp_path_factory):
    from flows.launcher import prefect_server, using_prefect_api

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
