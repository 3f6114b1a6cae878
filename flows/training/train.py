"""The training flow: PPO / GRPO as a Prefect stage graph.

Before step 0 (optional): supervised warm-start of the policy; then validation, while each role's worker
(trainer.execution=workers) loads its model.
Each training step k:
  1. rollout: sample rollout.n responses per prompt with the policy published for step k.
  2. reward scores, reference log-probs, critic values, old log-probs: concurrently.
  3. advantages (driver): score at the last token, minus the KL penalty if configured, then the
     registered estimator (GAE, GRPO, RLOO, REINFORCE++).
  4. actor update and critic update: concurrently; the actor publishes weights for step k+1.
  5. the adaptive KL controller steps; metrics go to MLflow; validation every trainer.val_every steps; after
     trainer.no_signal_steps steps in a row without a learning signal, a warning (flows/training/learning_signal.py).

Departures from textbook PPO: GRPO-family estimators skip the critic; the KL to the reference is
either a reward penalty (algorithm.use_kl_in_reward) or a loss term (actor.use_kl_loss), as in verl;
the log-probs use logits divided by the sampling temperature, so they match the rollout engine's.

Each box is a stage of flows/training/stages.py, submitted by its declaration; the driver (flows/runtime)
decides where it runs, skips what a resumed run finished, hands the policy's weights to the stages declared to
need them (flows/runtime/weights/), and passes only paths and scalar metrics.
"""

from __future__ import annotations

import time

from prefect import flow, get_run_logger
from prefect.exceptions import TerminationSignal
from prefect.logging.loggers import flow_run_logger
from prefect.runtime import flow_run as prefect_flow_run

from flows.config import Config, ConfigError, TrainerConfig, build_config, layout_for, load_config
from flows.runtime.attempts import retry_crashed
from flows.runtime.console import progress
from flows.runtime.driver import RunState, for_this_flow_run, run_name_for_this_flow_run, start_run
from flows.runtime.residents import release_run
from flows.runtime.supervision import RunLock, mark_stopping
from flows.training.export import export_run
from flows.training.learning_signal import NoSignalWatch, watch_learning_signal
from flows.training.preflight import check_inputs
from flows.training.stages import (STAGES, advantages, checkpoint_actor, checkpoint_critic, old_logprobs, reference,
                                   reward, rollout, sample_rows, update_actor, update_critic, validate, values,
                                   warm_start)


def training_step(state: RunState, step: int) -> dict[str, float]:
    """One PPO/GRPO step as a stage graph; returns the step's metrics."""
    config, started = state.config, time.perf_counter()
    # step 1. rollout with the policy published for this step (one_step_ahead: for the step before, and
    # started while the previous step trained); then start the next step's rollout beside this one.
    ahead = config.trainer.one_step_ahead
    pending = state.ahead.pop(step, None) or state.submit(rollout, step, max(step - 1, 0) if ahead else step)
    metrics = state.wait(pending)
    if ahead and step + 1 < config.trainer.total_steps:
        state.ahead[step + 1] = state.submit(rollout, step + 1, step)
    # step 2. score, reference, values and old log-probs do not depend on each other
    parallel = [state.submit(reward, step)]
    if not config.on_policy_update:  # on-policy, the update computes them itself
        parallel.append(state.submit(old_logprobs, step))
    if config.uses_reference:
        parallel.append(state.submit(reference, step))
    if config.uses_critic:
        parallel.append(state.submit(values, step))
    for future in parallel:
        metrics |= state.wait(future)
    # step 3. token rewards and advantages (driver math, written to storage)
    metrics |= state.run(advantages, step, state.kl_controller.value)
    # step 4. actor and critic updates do not depend on each other (the roles stay as they are until the last
    # checkpoint is committed, and the actor's weights until every version it was sending has arrived)
    metrics |= state.settle_checkpoint()
    updates = [state.submit(update_actor, step)]
    if config.uses_critic:
        updates.append(state.submit(update_critic, step))
    for future in updates:
        metrics |= state.wait(future)
    # step 5. KL controller, throughput
    if "actor/reward_kl_penalty" in metrics:
        state.kl_controller.update(metrics["actor/reward_kl_penalty"], config.samples_per_step)
    metrics["timing_s/step"] = time.perf_counter() - started
    # verl's definitions: all tokens per second per GPU; ours, generated tokens per second of the step
    metrics["perf/throughput"] = metrics.get("perf/total_num_tokens", 0.0) / (metrics["timing_s/step"] * state.gpus())
    metrics["perf/gen_throughput"] = metrics.get("perf/gen_tokens", 0.0) / metrics["timing_s/step"]
    return metrics


def _progress_line(step: int, total: int, metrics: dict[str, float]) -> str:
    parts = [f"step {step + 1}/{total}", f"score {metrics.get('critic/score/mean', float('nan')):.3f}"]
    if "val/reward/mean" in metrics:
        parts.append(f"val {metrics['val/reward/mean']:.3f}")
    parts.append(f"kl {metrics.get('actor/ppo_kl', 0.0):.4f}")
    parts.append(f"len {metrics.get('response_length/mean', 0.0):.1f}")
    parts.append(" ".join(f"{name[9:]} {metrics[name]:.2f}s" for name in
                          ("timing_s/gen", "timing_s/weight_sync", "timing_s/update_actor", "timing_s/step")
                          if name in metrics))
    return " | ".join(parts)


def record_step(state: RunState, step: int, metrics: dict[str, float], learning_signal: NoSignalWatch) -> None:
    """What a finished step leaves: its metrics in MLflow (with a table of samples every trainer.samples_every
    steps) and in Prefect's table, its line on the terminal, and a warning once the run has had no learning
    signal for trainer.no_signal_steps steps in a row."""
    trainer, done = state.config.trainer, step + 1
    state.log_metrics(metrics, step=done)
    if (step % trainer.samples_every == 0 or done == trainer.total_steps) and not state.already_logged(done):
        state.tracker.log_table(sample_rows(state.config, step), f"samples/step_{done:05d}.json")
    state.history.append(metrics)
    state.artifacts.step_done(done, metrics)
    get_run_logger().info(_progress_line(step, trainer.total_steps, metrics))
    learning_signal.observe(done, metrics)


def prepared_roles(config: Config) -> list[str]:
    """The roles a run prepares at its start: every role of its own worker but the rollout (whose engine
    the first validation starts). None in one process, where models would load one after another anyway."""
    if config.trainer.execution != "workers":
        return []
    return [role for role in config.roles if role != "rollout"]


def resolve_config(config: Config | None = None, config_file: str | None = None,
                   deployment_overrides: list[str] | None = None, overrides: list[str] | None = None) -> Config:
    """The run's config from the flow's parameters: the typed tree `config`, or the YAML `config_file`
    (relative to the working directory: the checkout, for a deployment), then `deployment_overrides` (a
    deployment's own, in prefect.yaml) and `overrides` (a run's), each `key.path=value` as on the command line.
    Prefect replaces a list parameter whole, so a run's `overrides` never drop the deployment's."""
    listed = [*(deployment_overrides or []), *(overrides or [])]
    if config_file is not None:
        if config is not None:
            raise ConfigError("give the flow either config or config_file, not both")
        return load_config(config_file, listed)
    if config is None:
        return load_config(None, listed)
    return build_config(config.model_dump(mode="json"), listed) if listed else config


def _config_of(parameters: dict) -> Config:
    """The config a flow run's parameters resolve to (ValueError when they do not)."""
    config = parameters.get("config")
    config = Config.model_validate(config) if isinstance(config, dict) else config
    return resolve_config(config, parameters.get("config_file"), parameters.get("deployment_overrides"),
                          parameters.get("overrides"))


def flow_run_name() -> str:
    """The flow run's name in Prefect: the run's name (with run.name_timestamp, the stamped one), from the
    flow's parameters. A config that does not resolve keeps the name Prefect gave: the flow reports it."""
    try:
        config = _config_of(prefect_flow_run.parameters)
    except ValueError:
        return prefect_flow_run.name
    return run_name_for_this_flow_run(config.run)


def retry_when_crashed(flow, flow_run, state) -> None:
    """on_crashed: a deployment's flow run whose process died (SIGKILL, out of memory) is retried, and the retry
    resumes the run, up to trainer.max_attempts attempts (flows.runtime.attempts.retry_crashed). Prefect's worker
    calls it once the process is gone; in the dying process itself, and for a run of no deployment (`rlhf
    resume` continues those), it does nothing."""
    if prefect_flow_run.id is not None or flow_run.deployment_id is None:
        return
    try:
        max_attempts = _config_of(flow_run.parameters).trainer.max_attempts
    except ValueError:  # a config that does not resolve fails the run rather than crash it: the default then
        max_attempts = TrainerConfig().max_attempts
    flow_run_logger(flow_run, flow).warning(retry_crashed(str(flow_run.id), max_attempts))


def _log_final_model(state: RunState, summary: dict) -> None:
    """The exported policy as an MLflow transformers model (unless tracking.log_model=false) and, with
    tracking.registered_model, a new version of that registered model tagged with the final validation reward and
    the run's name."""
    config = state.config
    rollout = config.rollout
    if not config.tracking.log_model:
        return
    summary["mlflow_model"] = state.tracker.log_model(summary["export_dir"], generation_params={
        "max_new_tokens": rollout.max_new_tokens, "temperature": rollout.temperature, "do_sample": True})
    if config.tracking.registered_model:
        version = state.tracker.register_model(config.tracking.registered_model, tags={
            "val_reward_end": summary["val_reward_end"], "rlhf.run_name": config.run.name})
        summary["registered_model"] = f"models:/{config.tracking.registered_model}/{version}"


@flow(name="rlhf-train", log_prints=True, flow_run_name=flow_run_name, on_crashed=[retry_when_crashed])
def train(config: Config | None = None, config_file: str | None = None, deployment_overrides: list[str] | None = None,
          overrides: list[str] | None = None) -> dict:
    """Train a causal LM with PPO/GRPO; return the final validation reward and where to look. The config is
    `config`, or `config_file` (YAML), plus `key=value` overrides (see resolve_config)."""
    logger = get_run_logger()
    config = for_this_flow_run(resolve_config(config, config_file, deployment_overrides, overrides))
    inputs = check_inputs(config)  # before the run folder or the MLflow run exists
    # One live driver per run folder (held for the whole run; re-entrant: `rlhf` took it before the server).
    lock = RunLock(config.run.storage_root, config.run.name)
    lock.acquire()
    try:
        state = start_run(config, lineage=inputs.lineage())
    except BaseException:
        lock.release()
        raise
    for line in inputs.lines():
        logger.info(line)
    state.tracker.log_params({f"reward.scorer.{source}": scorer for source, scorer in inputs.scorers.items()})
    trainer = config.trainer
    status = "FAILED"
    try:
        summary: dict = {"mlflow_run_id": state.tracker.run_id, "run_dir": layout_for(config).run_dir}
        if state.start_step:
            logger.info("resuming %s at step %d (latest checkpoint)", config.run.name, state.start_step + 1)
        if config.warm_start.steps > 0:
            # step 0. supervised warm-start (see components/sft.py for why); skipped when resumed
            warm = state.run(warm_start)
            state.log_metrics(warm, step=0)
            summary["val_reward_before_warm_start"] = warm["warm_start/val_reward_before"]
        # Workers load their models (from the warm-start's output, if any) while the rollout's engine
        # starts for the first validation.
        preparing = [state.submit(STAGES[f"prepare_{role}"]) for role in prepared_roles(config)]
        first = state.wait(state.submit(validate, 0))
        for pending in preparing:
            first |= state.wait(pending)
        state.log_metrics(first, step=0)
        summary["val_reward_start"] = first["val/reward/mean"]
        logger.info("validation before RL: reward %.3f", first["val/reward/mean"])
        learning_signal = watch_learning_signal(state)  # trainer.no_signal_steps without one: a warning
        for step in range(state.start_step, trainer.total_steps):
            metrics = training_step(state, step)
            done = step + 1
            if done == trainer.total_steps or (trainer.val_every and done % trainer.val_every == 0):
                metrics |= state.wait(state.submit(validate, done))
            if trainer.checkpoint_every and (done % trainer.checkpoint_every == 0 or done == trainer.total_steps):
                roles = [checkpoint_actor] + ([checkpoint_critic] if config.uses_critic else [])
                metrics |= state.checkpoint(done, roles)
            record_step(state, step, metrics, learning_signal)
        # the last step validated already; a run resumed after its last step reads the stored result
        end = state.history[-1] if state.history else state.wait(state.submit(validate, trainer.total_steps))
        summary["val_reward_end"] = end["val/reward/mean"]
        # The final policy as a Hugging Face folder (weights + tokenizer), also as an MLflow model.
        progress(f"exporting the final policy (step {trainer.total_steps})"
                 + (" and logging it to MLflow as a model ..." if config.tracking.log_model else " ..."))
        state.committed_policy(trainer.total_steps)  # the last step's stored copy, which the export reads
        summary["export_dir"] = str(export_run(config.run.storage_root, config.run.name))
        _log_final_model(state, summary)
        progress(f"final policy: {summary['export_dir']}" + (f", registered as {summary['registered_model']}"
                                                              if "registered_model" in summary else ""))
        status = "FINISHED"
        return summary
    except (KeyboardInterrupt, TerminationSignal):  # SIGINT, SIGTERM: stopped, resumable
        status = "KILLED"
        raise
    finally:
        if status == "KILLED":  # stages still running then find their roles released by a stop (runtime/residents.py)
            mark_stopping()
        state.finish(status)  # a checkpoint being written is kept for the resume
        release_run(config)
        lock.release()
