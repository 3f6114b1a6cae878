"""The warm-start stage: supervised fine-tuning from model.path (components/sft.py) before the first RL step,
published as the step-0 policy. It checkpoints its own state inside the run folder every
warm_start.checkpoint_every steps, so that a resumed run continues it instead of starting over.
"""

from __future__ import annotations

import time

import torch

from components.distributed import is_writer
from components.models import load_causal_lm
from components.precision import Precision, prepare_trained_model
from components.rollout import HFRolloutEngine
from components.sft import warm_start as fine_tune
from flows.config import Config, layout_for
from flows.runtime.console import progress
from flows.runtime.tasks import inject_failure
from flows.training.registry import stage
from flows.training.roles import get_role, initial_policy_path
from flows.training.stage_io import StageResult, timed
from flows.training.validation import evaluate
from storage import COMMITTED_MARKER, atomic_directory


WARM_START_STATE = "warm_start_state.pt"


def _warm_start_checkpoint(config: Config) -> str:
    """Where the warm-start keeps its latest state (one, replaced each time; inside the run folder)."""
    return f"{layout_for(config).run_dir}/warm_start/checkpoint"


def _warm_start_resume_point(config: Config) -> tuple[str, dict | None]:
    """(the folder the warm-start's model loads from, the state it continues with): its checkpoint when a
    stopped attempt left one, else model.path and None."""
    layout, folder = layout_for(config), _warm_start_checkpoint(config)
    if not layout.fs.exists(f"{folder}/{COMMITTED_MARKER}"):
        return config.model.path, None
    # weights_only: tensors and plain containers only, so a planted file cannot run code
    return folder, torch.load(f"{folder}/{WARM_START_STATE}", map_location="cpu", weights_only=True)


@stage(role="actor", output="weights/actor", skippable=True, all_ranks=False)
def warm_start(config: Config) -> StageResult:
    """Supervised warm-start from model.path; publishes the result as the step-0 policy. Every
    warm_start.checkpoint_every of its steps it saves its state, and a rerun (a resumed run) continues
    from there."""
    # A trained role: fp32 masters computing in the compute dtype (components.precision); not sharded: each
    # rank of a sharded actor's worker runs the whole warm-start and rank 0 writes it.
    precision = Precision.of(config.model.compute_dtype, config.model.master_dtype)
    source, resume = _warm_start_resume_point(config)
    model = load_causal_lm(source, dtype=precision.master, compute_dtype=precision.compute,
                           device=config.trainer.device, attn_implementation=config.model.attn_implementation,
                           trust_remote_code=config.model.trust_remote_code)
    prepare_trained_model(model, precision, config.model.gradient_checkpointing, shard=False)
    tokenizer = get_role(config, "tokenizer")
    engine = HFRolloutEngine(model, tokenizer)
    if resume is None:
        _, before = evaluate(config, engine, get_role(config, "val_prompts"))
        before_reward = before["val/reward/mean"]
    else:
        before_reward = float(resume["val_reward_before"])
    records = get_role(config, "train_prompts")
    metrics: dict[str, float] = {"warm_start/val_reward_before": before_reward}
    steps, started = config.warm_start.steps, time.perf_counter()
    if resume is None:
        progress(f"warm-start: {steps} supervised steps of {config.warm_start.batch_size} prompts "
                 f"(validation reward before: {before_reward:.3f})")
    else:
        progress(f"warm-start: continuing at step {len(resume['losses'])}/{steps} from its checkpoint")
    layout = layout_for(config)

    def report(done: int, loss: float) -> None:
        if done == steps or done % max(1, steps // 10) == 0:
            progress(f"warm-start step {done}/{steps}: loss {loss:.4f} ({time.perf_counter() - started:.0f} s)")

    def save(done: int, state: dict) -> None:
        if not is_writer():
            return
        with atomic_directory(layout.fs, _warm_start_checkpoint(config)) as local:
            model.save_pretrained(local)
            torch.save({**state, "val_reward_before": before_reward}, f"{local}/{WARM_START_STATE}")
        progress(f"warm-start checkpoint at step {done}/{steps}")
        inject_failure("warm_start_checkpoint", done)  # recovery drills: a stop right after a warm-start checkpoint

    with timed(metrics, "warm_start"):
        losses = fine_tune(model, tokenizer, [r.prompt_ids for r in records], [r.target_text for r in records],
                           steps=steps, batch_size=config.warm_start.batch_size, lr=config.warm_start.lr,
                           seed=config.trainer.seed, on_step=report, resume=resume,
                           checkpoint_every=config.warm_start.checkpoint_every, on_checkpoint=save,
                           tool_response_template=config.rollout.tool_response_template)
    metrics["warm_start/loss_first"], metrics["warm_start/loss_last"] = losses[0], losses[-1]
    path = initial_policy_path(config)
    if is_writer():
        # In the master dtype: the actor starts from exactly these weights (the rollout and the reference
        # load them cast to the compute dtype).
        with atomic_directory(layout.fs, path) as local:
            model.save_pretrained(local)
            tokenizer.save_pretrained(local)
        if layout.fs.exists(_warm_start_checkpoint(config)):  # done: its checkpoint is not needed any more
            layout.fs.rm(f"{layout.run_dir}/warm_start", recursive=True)
    return {"path": path, "metrics": metrics}
