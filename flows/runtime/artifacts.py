"""What the Prefect UI shows for a training run: a progress bar, a per-step metrics table and a link
to the MLflow run. Artifacts are best effort: a failure to write one never stops training."""

from __future__ import annotations

import re

from prefect.artifacts import create_markdown_artifact, create_progress_artifact, create_table_artifact, update_progress_artifact

from flows.config import Config

TABLE_METRICS = ("critic/score/mean", "critic/score/equal_group_frac", "val/reward/mean", "actor/ppo_kl",
                 "actor/pg_loss", "actor/entropy", "critic/vf_loss", "actor/update_rms_ratio",
                 "critic/update_rms_ratio", "response_length/mean", "response_length/clip_ratio", "timing_s/gen",
                 "timing_s/step", "perf/throughput", "perf/gen_throughput")


def artifact_key(config: Config, suffix: str) -> str:
    """Prefect artifact keys allow lowercase letters, digits and dashes only."""
    return re.sub(r"[^a-z0-9-]+", "-", f"{config.run.name}-{suffix}".lower()).strip("-")


def table_row(step: int, metrics: dict[str, float]) -> dict:
    """One row of the metrics table: the step and TABLE_METRICS it has, to five significant digits (not
    decimals: an update ratio of 3e-6 must not read 0)."""
    return {"step": step, **{name: float(f"{metrics[name]:.5g}") for name in TABLE_METRICS if name in metrics}}


def recorded_rows(history: dict[str, dict[int, float]], through_step: int) -> list[dict]:
    """The table's rows of steps 1..through_step from a run's recorded metrics ({metric: {step: value}}, MLflow's
    history): what a resumed run's table starts with, so that it holds every step, not only the resumed ones."""
    steps = sorted({step for name in TABLE_METRICS for step in history.get(name, {}) if 1 <= step <= through_step})
    return [table_row(step, {name: history[name][step] for name in TABLE_METRICS if step in history.get(name, {})})
            for step in steps]


class PrefectArtifacts:
    def __init__(self, config: Config, tracking_uri: str, experiment_id: str, mlflow_run_id: str,
                 rows: list[dict] | None = None):
        self.config = config
        self.rows: list[dict] = list(rows or [])
        """The table so far (a resumed run starts with the earlier attempts' steps: recorded_rows)."""
        self.progress_id = None
        done = self.rows[-1]["step"] if self.rows else 0
        try:
            self.progress_id = create_progress_artifact(
                progress=100.0 * done / config.trainer.total_steps, key=artifact_key(config, "progress"),
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
        self.rows.append(table_row(step, metrics))
        total = self.config.trainer.total_steps
        try:
            if self.progress_id is not None:
                update_progress_artifact(self.progress_id, progress=100.0 * step / total)
            if step == total or step % self.config.trainer.samples_every == 0:
                create_table_artifact(key=artifact_key(self.config, "metrics"), table=self.rows,
                                      description="per-step metrics (verl names)")
        except Exception as error:  # noqa: BLE001
            print(f"warning: Prefect artifact update failed: {error}")

    def warning(self, name: str, step: int, line: str) -> None:
        """A warning about the run (`name`: what it is about, e.g. no-signal) as a markdown artifact, keyed
        `<run>-warning-<name>`: the Prefect UI shows it beside the run's table."""
        try:
            create_markdown_artifact(key=artifact_key(self.config, f"warning-{name}"), markdown=(
                f"### Warning at step {step} of `{self.config.run.name}`\n\n{line}\n"),
                description=f"warning: {name}")
        except Exception as error:  # noqa: BLE001
            print(f"warning: Prefect artifact update failed: {error}")
