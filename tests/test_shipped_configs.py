"""Every shipped config loads and validates through the loaders users go through (torchtune tests its recipes'
configs the same way): each `configs/*.yaml` as `rlhf train FILE` reads it (flows.config.load_config), and each
deployment of prefect.yaml as its flow run will resolve it (its parameters checked against the flow's signature by
Prefect, then config_file, deployment_overrides and a run's overrides through the flow's resolve_config, as
`rlhf submit` resolves them too). The lists come from globs, so a new config or deployment is tested without
touching this file; the negative cases prove that a misspelled key or a wrong value in such a file is refused,
not silently ignored.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from flows.config import Config, ConfigError, load_config

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))
PROJECT_FILE = ROOT / "prefect.yaml"
DEPLOYMENTS = [entry["name"] for entry in yaml.safe_load(PROJECT_FILE.read_text(encoding="utf-8"))["deployments"]]

# What was shipped when this test was written; the globs may find more, never fewer.
MIN_CONFIGS = 7
MIN_DEPLOYMENTS = 2


def test_the_globs_found_every_shipped_file():
    assert len(CONFIGS) >= MIN_CONFIGS, [path.name for path in CONFIGS]
    assert len(DEPLOYMENTS) >= MIN_DEPLOYMENTS, DEPLOYMENTS
    assert "quickstart.yaml" in {path.name for path in CONFIGS}
    assert {"quickstart", "nightly"} <= set(DEPLOYMENTS)


@pytest.mark.parametrize("path", CONFIGS, ids=lambda path: path.name)
def test_shipped_config_validates(path):
    config = load_config(path)
    assert isinstance(config, Config)
    # Every key the file sets is a field the tree has (Section forbids extras; this says which file if not),
    # and the file's values survive validation (no field the file sets is silently dropped or renamed).
    resolved = config.model_dump(mode="json")
    for section, values in (yaml.safe_load(path.read_text(encoding="utf-8")) or {}).items():
        assert section in resolved, f"{path.name}: section {section!r} is not in the config tree"
        for key in values or {}:
            assert key in resolved[section] or key in _aliases(section), f"{path.name}: {section}.{key}"


def _aliases(section: str) -> set[str]:
    """Old names a section still accepts (validation aliases, e.g. model.dtype for model.compute_dtype)."""
    fields = Config.model_fields[section].annotation.model_fields
    names: set[str] = set()
    for field in fields.values():
        choices = getattr(field.validation_alias, "choices", None) or []
        names.update(choice for choice in choices if isinstance(choice, str))
    return names


def _deployment(name: str, project_file: Path = PROJECT_FILE) -> dict:
    return next(entry for entry in yaml.safe_load(project_file.read_text(encoding="utf-8"))["deployments"]
                if entry["name"] == name)


def _flow_of(entry: dict):
    from prefect.flows import load_flow_from_entrypoint

    module, function = entry["entrypoint"].split(":")
    return load_flow_from_entrypoint(f"{ROOT / module}:{function}")


def resolve_deployment(name: str, overrides: list[str] = (), project_file: Path = PROJECT_FILE) -> Config:
    """The config a flow run of deployment `name` resolves to: Prefect checks its parameters against the flow's
    signature, then the flow's resolve_config reads config_file (relative to prefect.yaml's folder, where the
    deployment's pull step runs the flow), deployment_overrides, then a run's overrides."""
    from flows.training.train import resolve_config

    entry = _deployment(name, project_file)
    parameters = _flow_of(entry).validate_parameters({**(entry.get("parameters") or {}), "overrides": list(overrides)})
    if parameters.get("config_file") is not None:
        parameters["config_file"] = str(project_file.parent / parameters["config_file"])
    return resolve_config(**parameters)


@pytest.mark.parametrize("name", DEPLOYMENTS)
def test_deployment_resolves(name):
    parameters = _deployment(name).get("parameters") or {}
    if "config_file" in parameters:
        assert (ROOT / parameters["config_file"]).is_file(), parameters["config_file"]
    assert isinstance(resolve_deployment(name), Config)
    assert resolve_deployment(name, ["trainer.total_steps=2"]).trainer.total_steps == 2


# -- the negative cases: a file with a mistake in it is refused, with the field named ------------------------------

def _first_key(data: dict) -> tuple[str, str]:
    """The first (section, key) a config file sets."""
    for section, values in data.items():
        for key in values or {}:
            return section, key
    raise AssertionError("the config sets no key")


def _misspelled_key(data: dict) -> tuple[dict, str]:
    section, key = _first_key(data)
    data[section][key + "x"] = data[section].pop(key)
    return data, f"{section}.{key}x: unknown field"


def _unknown_section(data: dict) -> tuple[dict, str]:
    data["trainr"] = {"total_steps": 3}
    return data, "trainr: unknown field"


def _invalid_value(data: dict) -> tuple[dict, str]:
    data.setdefault("trainer", {})["total_steps"] = "many"
    return data, "trainer.total_steps='many'"


MISTAKES = [_misspelled_key, _unknown_section, _invalid_value]


@pytest.mark.parametrize("mistake", MISTAKES, ids=lambda mistake: mistake.__name__.strip("_"))
@pytest.mark.parametrize("path", CONFIGS, ids=lambda path: path.name)
def test_a_config_with_a_mistake_is_refused(path, mistake, tmp_path):
    data, expected = mistake(yaml.safe_load(path.read_text(encoding="utf-8")))
    broken = tmp_path / path.name
    broken.write_text(yaml.safe_dump(data), encoding="utf-8")
    with pytest.raises(ConfigError) as error:
        load_config(broken)
    assert expected in str(error.value)


@pytest.mark.parametrize("override, expected", [
    ("trainer.total_stepz=3", "trainer.total_stepz: unknown field"),
    ("trainer.total_steps=many", "trainer.total_steps='many'"),
], ids=["misspelled", "invalid"])
@pytest.mark.parametrize("name", DEPLOYMENTS)
def test_a_deployment_with_a_mistake_is_refused(name, override, expected, tmp_path):
    project = yaml.safe_load(PROJECT_FILE.read_text(encoding="utf-8"))
    for entry in project["deployments"]:
        if entry["name"] == name:
            parameters = entry["parameters"]
            parameters["deployment_overrides"] = [*parameters.get("deployment_overrides", []), override]
            if "config_file" in parameters:
                parameters["config_file"] = str(ROOT / parameters["config_file"])
    broken = tmp_path / "prefect.yaml"
    broken.write_text(yaml.safe_dump(project), encoding="utf-8")
    with pytest.raises(ConfigError) as error:
        resolve_deployment(name, project_file=broken)
    assert expected in str(error.value)


@pytest.mark.parametrize("parameters, expected", [
    ({"config_fille": "configs/quickstart.yaml"}, "config_fille"),
    ({"config_file": "configs/quickstart.yaml", "overrides": "trainer.total_steps=2"}, "overrides"),
], ids=["unknown-parameter", "overrides-not-a-list"])
def test_deployment_parameters_the_flow_does_not_take_are_refused(parameters, expected):
    from prefect.exceptions import ParameterTypeError, SignatureMismatchError

    with pytest.raises((SignatureMismatchError, ParameterTypeError)) as error:
        _flow_of(_deployment("quickstart")).validate_parameters(parameters)
    assert expected in str(error.value)
