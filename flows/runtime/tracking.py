"""MLflow tracking: one MLflow run per training run, driven by explicit run ids.

The flow uses an `MlflowClient` with the run id rather than mlflow's global "active run", because
stages finish on Prefect's worker threads and the global run is thread-local.
"""

from __future__ import annotations

import math
import re
import subprocess
import tempfile
import time
from pathlib import Path

import fsspec
import mlflow
import yaml
from mlflow.entities import Metric, Param
from mlflow.tracking import MlflowClient

from components.placement import ROLES
from flows.config import Config, flatten

MAX_PARAM_LENGTH = 6000
RUN_NAME_TAG = "rlhf.run_name"


def tracking_uri(config: Config) -> str:
    """The configured URI, with a relative SQLite path made absolute (and its folder created)."""
    uri = config.tracking.tracking_uri
    prefix = "sqlite:///"
    if uri.startswith(prefix) and not uri[len(prefix):].startswith("/"):
        path = Path(uri[len(prefix):]).resolve()
        path.parent.mkdir(parents=True, exist_ok=True)
        uri = prefix + str(path)
    return uri


def _git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
                              cwd=Path(__file__).parent).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _assignment(value) -> str:
    """A placement entry as text: GPU indices joined by commas, or "cpu" / "auto"."""
    return ",".join(str(index) for index in value) if isinstance(value, list) else str(value)


CREDENTIALS = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)[^/@\s]+@")


def redact_credentials(text: str) -> str:
    """URIs with a user or password (`s3://key:secret@bucket`, `postgresql://user:pw@host/db`) as
    `scheme://***@...`: what goes to MLflow (params, tags, config artifacts) never holds them."""
    return CREDENTIALS.sub(lambda match: f"{match['scheme']}***@", text)


def placement_summary(config: Config) -> str:
    """One line of where each role is placed, e.g. "rollout=0 actor=1 critic=0 reference=1 reward=cpu".

    Read from config.placement only (roles not listed show placement.default; no device probing), in
    the order of components.placement.ROLES.
    """
    placement = config.placement
    return " ".join(f"{role}={_assignment(placement.roles.get(role, placement.default))}" for role in ROLES)


def run_description(config: Config) -> str:
    """The run's MLflow description (tag mlflow.note.content): one paragraph of markdown."""
    warm = (f" after a {config.warm_start.steps}-step supervised warm-start" if config.warm_start.steps else "")
    critic = " with a critic" if config.uses_critic else ""
    return (f"**{config.run.name}**: `{config.algorithm.adv_estimator}`{critic} post-training of "
            f"`{config.model.path}` for {config.trainer.total_steps} RL steps{warm}, "
            f"{config.data.prompts_per_step} prompts x {config.rollout.n} samples per step, "
            f"execution `{config.trainer.execution}`, placement `{placement_summary(config)}`; "
            f"stage files under `{config.run.storage_root}/{config.run.name}`.")


def run_tags(config: Config) -> dict[str, str]:
    """The tags a new training run gets."""
    tags = {RUN_NAME_TAG: config.run.name, "rlhf.algorithm": config.algorithm.adv_estimator,
            "mlflow.source.git.commit": _git_commit(), "rlhf.storage_root": config.run.storage_root,
            "rlhf.placement": placement_summary(config), "rlhf.execution": config.trainer.execution,
            "mlflow.note.content": run_description(config)}
    return {key: redact_credentials(value) for key, value in tags.items()}


def config_yaml(config: Config) -> str:
    """The resolved config as YAML (what `rlhf config show` prints); build_config reads it back."""
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)


def _sqlite_store_missing(uri: str) -> bool:
    prefix = "sqlite:///"
    if not uri.startswith(prefix):
        return False
    path = uri[len(prefix):]
    return bool(path) and path != ":memory:" and not Path(path).exists()


def find_active_run_id(config: Config) -> str | None:
    """The newest RUNNING MLflow run tagged rlhf.run_name == config.run.name in config.tracking.experiment.

    None when there is none (or the SQLite store or the experiment does not exist yet: nothing is
    created). Workers use it to attach their system metrics to the run the driver started.
    """
    uri = config.tracking.tracking_uri
    prefix = "sqlite:///"
    if uri.startswith(prefix) and not uri[len(prefix):].startswith("/"):
        uri = prefix + str(Path(uri[len(prefix):]).resolve())  # like tracking_uri(), without mkdir
    if _sqlite_store_missing(uri):
        return None
    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name(config.tracking.experiment)
    if experiment is None:
        return None
    runs = client.search_runs([experiment.experiment_id],
                              filter_string=f"tags.`{RUN_NAME_TAG}` = '{config.run.name}' "
                                            "and attributes.status = 'RUNNING'",
                              order_by=["attributes.start_time DESC"], max_results=1)
    return runs[0].info.run_id if runs else None


def artifact_location(uri: str) -> str | None:
    """With a SQLite store, artifacts go beside the database (`<db folder>/mlartifacts/`) instead of
    `./mlruns` under whatever the working directory is; servers choose their own."""
    prefix = "sqlite:///"
    if not uri.startswith(prefix):
        return None
    return (Path(uri[len(prefix):]).parent / "mlartifacts").resolve().as_uri()


class Tracker:
    """Logs params, per-step metrics, sample tables and artifacts to one MLflow run."""

    def __init__(self, config: Config, run_id: str | None = None):
        self.uri = tracking_uri(config)
        self.client = MlflowClient(tracking_uri=self.uri)
        mlflow.set_tracking_uri(self.uri)
        experiment = self.client.get_experiment_by_name(config.tracking.experiment)
        experiment_id = (experiment.experiment_id if experiment
                         else self.client.create_experiment(config.tracking.experiment,
                                                            artifact_location=artifact_location(self.uri)))
        if run_id is None:
            run = self.client.create_run(experiment_id, run_name=config.run.name, tags=run_tags(config))
            run_id = run.info.run_id
            self._log_params(config, run_id)
        self.run_id = run_id
        self.experiment_id = experiment_id

    def _log_params(self, config: Config, run_id: str) -> None:
        params = [Param(key, redact_credentials(str(value))[:MAX_PARAM_LENGTH]) for key, value in flatten(config).items()]
        for start in range(0, len(params), 100):
            self.client.log_batch(run_id, params=params[start : start + 100])
        self.client.log_text(run_id, redact_credentials(config.model_dump_json(indent=2)), "config.json")
        self.client.log_text(run_id, redact_credentials(config_yaml(config)), "config.yaml")

    def log_params(self, params: dict[str, str]) -> None:
        """Params beyond the config (a resumed run already has them: MLflow refuses to change a param)."""
        logged = self.client.get_run(self.run_id).data.params
        fresh = [Param(key, str(value)[:MAX_PARAM_LENGTH]) for key, value in params.items() if key not in logged]
        if fresh:
            self.client.log_batch(self.run_id, params=fresh)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        now = int(time.time() * 1000)
        entries = [Metric(key, float(value), now, step) for key, value in metrics.items()
                   if isinstance(value, (int, float)) and math.isfinite(float(value))]
        for start in range(0, len(entries), 500):
            self.client.log_batch(self.run_id, metrics=entries[start : start + 500])

    def log_table(self, columns: dict[str, list], artifact_file: str) -> None:
        self.client.log_table(self.run_id, data=columns, artifact_file=artifact_file)

    def log_model_folder(self, local_dir: str | Path, artifact_path: str = "model") -> None:
        """Log a folder (e.g. the final actor weights, `weights/actor/<last>`) as run artifacts.

        `local_dir` may also be an fsspec URI (the storage root may be remote): it is then copied
        to a temporary folder first. Raises FileNotFoundError when the folder does not exist.
        """
        fs, root = fsspec.core.url_to_fs(str(local_dir))
        if not fs.isdir(root):
            raise FileNotFoundError(f"cannot log model folder {str(local_dir)!r}: not a folder")
        protocols = (fs.protocol,) if isinstance(fs.protocol, str) else tuple(fs.protocol)
        if "file" in protocols or "local" in protocols:
            self.client.log_artifacts(self.run_id, root, artifact_path)
            return
        with tempfile.TemporaryDirectory(prefix="rlhf-model-") as temporary:
            fs.get(root.rstrip("/") + "/", temporary, recursive=True)
            self.client.log_artifacts(self.run_id, temporary, artifact_path)

    def finish(self, status: str = "FINISHED") -> None:
        self.client.set_terminated(self.run_id, status=status)

