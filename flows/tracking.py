"""MLflow tracking: one MLflow run per training run, driven by explicit run ids.

The flow uses an `MlflowClient` with the run id rather than mlflow's global "active run", because
stages finish on Prefect's worker threads and the global run is thread-local.
"""

from __future__ import annotations

import math
import subprocess
import time
from pathlib import Path

from flows.config import Config, flatten

MAX_PARAM_LENGTH = 6000


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


class Tracker:
    """Logs params, per-step metrics, sample tables and artifacts to one MLflow run."""

    def __init__(self, config: Config, run_id: str | None = None):
        import mlflow
        from mlflow.tracking import MlflowClient

        self.uri = tracking_uri(config)
        self.client = MlflowClient(tracking_uri=self.uri)
        mlflow.set_tracking_uri(self.uri)
        experiment = self.client.get_experiment_by_name(config.tracking.experiment)
        experiment_id = (experiment.experiment_id if experiment
                         else self.client.create_experiment(config.tracking.experiment))
        if run_id is None:
            run = self.client.create_run(experiment_id, run_name=config.run.name, tags={
                "rlhf.run_name": config.run.name, "rlhf.algorithm": config.algorithm.adv_estimator,
                "mlflow.source.git.commit": _git_commit(), "rlhf.storage_root": config.run.storage_root})
            run_id = run.info.run_id
            self._log_params(config, run_id)
        self.run_id = run_id
        self.experiment_id = experiment_id

    def _log_params(self, config: Config, run_id: str) -> None:
        from mlflow.entities import Param

        params = [Param(key, str(value)[:MAX_PARAM_LENGTH]) for key, value in flatten(config).items()]
        for start in range(0, len(params), 100):
            self.client.log_batch(run_id, params=params[start : start + 100])
        self.client.log_text(run_id, config.model_dump_json(indent=2), "config.json")

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        entries = [Metric(key, float(value), now, step) for key, value in metrics.items()
                   if isinstance(value, (int, float)) and math.isfinite(float(value))]
        for start in range(0, len(entries), 500):
            self.client.log_batch(self.run_id, metrics=entries[start : start + 500])

    def log_table(self, columns: dict[str, list], artifact_file: str) -> None:
        self.client.log_table(self.run_id, data=columns, artifact_file=artifact_file)

    def finish(self, status: str = "FINISHED") -> None:
        self.client.set_terminated(self.run_id, status=status)

