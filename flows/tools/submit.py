"""`rlhf submit DEPLOYMENT [key=value ...]`: start a run of a deployment of prefect.yaml, its config checked first.

    rlhf submit quickstart trainer.total_steps=20

`prefect deployment run` hands the parameters to a worker unchecked: a typo surfaces minutes later, in
the worker's flow run. `submit` resolves the run's config exactly as the flow will (the deployment's
config_file and deployment_overrides from prefect.yaml, then these overrides; flows.training.train.resolve_config),
then checks what the worker will read as the worker will resolve it (flows/training/preflight.py, in the
deployment's working directory: the folder of prefect.yaml, where its pull step runs the flow): model folders,
data files and globs, model.from_run against the deployment's storage root, the reward function, where the run
writes. A bad one is refused with the CLI's one line, before anything reaches the server. What belongs to the
worker's machine (its devices, torchrun variables) is left to the worker. A good one becomes a flow run of
`rlhf-train/<DEPLOYMENT>` with `overrides` set, for a worker of its pool to pick up.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import yaml

from flows.config import ConfigError
from flows.training.preflight import check_inputs

FLOW_NAME = "rlhf-train"


def deployment_parameters(name: str, project_file: Path) -> dict:
    """The `parameters` of deployment `name` in prefect.yaml (ValueError naming what there is when absent)."""
    if not project_file.is_file():
        raise ValueError(f"deployment {name!r}: no {project_file}; run rlhf submit from the checkout that holds "
                         "prefect.yaml (or pass --project-file)")
    deployments = yaml.safe_load(project_file.read_text(encoding="utf-8")).get("deployments") or []
    names = [entry.get("name") for entry in deployments]
    for entry in deployments:
        if entry.get("name") == name:
            return dict(entry.get("parameters") or {})
    raise ValueError(f"deployment {name!r} is not in {project_file}; choose one of {names}")


def check_submission(name: str, overrides: list[str], project_file: Path):
    """The config the run will have (submission_config), its inputs checked in the deployment's working directory
    (prefect.yaml's folder) as the worker's flow run will check them; raises the line the worker would fail with."""
    config = submission_config(name, overrides, project_file)
    with contextlib.chdir(project_file.resolve().parent):
        check_inputs(config, env={}, devices=False)  # the worker's devices and environment are not this machine's
    return config


def submission_config(name: str, overrides: list[str], project_file: Path):
    """The config the run will have (config files relative to prefect.yaml's folder, where the deployment's
    pull step runs the flow); raises the config's one-line error when it does not validate."""
    from flows.training.train import resolve_config  # deferred: the flow's module (transformers, the stages: seconds)

    parameters = deployment_parameters(name, project_file)
    config_file = parameters.get("config_file")
    if config_file is not None and not Path(config_file).is_absolute():
        config_file = str(project_file.parent / config_file)
    try:
        return resolve_config(None, config_file, parameters.get("deployment_overrides"), overrides)
    except ConfigError:
        raise
    except ValueError as error:
        raise ConfigError(f"deployment {name!r}: {error}") from None


def submit(name: str, overrides: list[str], project_file: Path):
    """Check the run's config, then create the flow run (returned) without waiting for it."""
    from prefect.deployments import run_deployment  # deferred: Prefect's client, needed once the config is checked

    config = check_submission(name, overrides, project_file)
    flow_run = run_deployment(f"{FLOW_NAME}/{name}", parameters={"overrides": list(overrides)}, timeout=0)
    print(f"submitted {FLOW_NAME}/{name}: flow run {flow_run.name} ({flow_run.id}), run.name={config.run.name}")
    return flow_run


def cmd_submit(args) -> int:
    submit(args.deployment, list(args.overrides), Path(args.project_file))
    return 0


def add_submit_parser(subcommands):
    parser = subcommands.add_parser(
        "submit", help="start a run of a prefect.yaml deployment, its config checked first",
        description="Resolve the run's config as the flow will (the deployment's config_file and "
                    "deployment_overrides, then these overrides), check what it reads where the worker will read "
                    "it (model folders, data globs and model.from_run, relative to prefect.yaml's folder) and "
                    "refuse a bad one in one line; otherwise create the flow run for the deployment's work pool "
                    "(PREFECT_API_URL).\n\n"
                    "example: rlhf submit quickstart trainer.total_steps=20")
    parser.add_argument("deployment", help="the deployment's name in prefect.yaml (quickstart, nightly)")
    parser.add_argument("overrides", nargs="*", help="key.path=value overrides for this run")
    parser.add_argument("--project-file", default="prefect.yaml", help="the prefect.yaml (default ./prefect.yaml)")
    parser.set_defaults(handler=cmd_submit)
    return parser
