"""What the Prefect UI shows for a training run: a progress bar, a per-step metrics table and a link
to the MLflow run. Artifacts are best effort: a failure to write one never stops training."""

from __future__ import annotations

import re

from prefect.artifacts import create_markdown_artifact, create_progress_artifact, create_table_artifact, update_progress_artifact

from flows.config import Config

TABLE_METRICS = ("critic/score/mean", "val/reward/mean", "actor/ppo_kl", "actor/pg_loss", "actor/entropy",
                 "critic/vf_loss", "actor/update_rms_ratio", "critic/update_rms_ratio", "response_length/mean",
                 "timing_s/gen", "timing_s/step", "perf/throughput", "perf/gen_throughput")


def artifact_key(config: Config, suffix: str) -> str:
    """Prefect artifact keys allow lowercase letters, digits and dashes only."""
    return re.sub(r"[^a-z0-9-]+", "-", f"{config.run.name}-{suffix}".lower()).strip("-")


class PrefectArtifacts:
    def __init__(self, config: Config, tracking_uri: str, experiment_id: str, mlflow_run_id: str):
        self.config = config
        self.rows: list[dict] = []
        self.progress_id = None
        try:
            self.progress_id = create_progress_artifact(
                progress=0.0, key=artifact_key(config, "progress"),
                description=f"training steps done of {config.trainer.total_steps}")
            create_markdown_artifact(key=artifact_key(config, "mlflow"), markdown=(
                f"### MLflow run of `{config.run.name}`\n\n"
                f"- run id: `{mlflow_run_id}` in experiment `{config.tracking.experiment}` (id {experiment_id})\n"
                f"- tracking URI: `{tracking_uri}`\n"
                f"- open: `mlflow ui --backend-store-uri {tracking_uri}` then "
                f"http://127.0.0.1:5000/#/experiments/{experiment_id}/runs/{mlflow_run_id}\n"
                f"- compare: `rlhf compare {config.run.name} --tracking-uri {tracking_uri}`\n"),
                description="where the metrics of this run are")
        except Exception as error:  # noqa: BLE001 - artifacts are cosmetic
            print(f"warning: Prefect artifacts unavailable: {error}")

    def step_done(self, step: int, metrics: dict[str, float]) -> None:
        # Five significant digits, not decimals: an update ratio of 3e-6 must not read 0.
        self.rows.append({"step": step, **{name: float(f"{metrics[name]:.5g}") for name in TABLE_METRICS
                                           if name in metrics}})
        total = self.config.trainer.total_steps
        try:
            if self.progress_id is not None:
                update_progress_artifact(self.progress_id, progress=100.0 * step / total)
            if step == total or step % self.config.trainer.samples_every == 0:
                create_table_artifact(key=artifact_key(self.config, "metrics"), table=self.rows,
                                      description="per-step metrics (verl names)")
        except Exception as error:  # noqa: BLE001
            print(f"warning: Prefect artifact update failed: {error}")
