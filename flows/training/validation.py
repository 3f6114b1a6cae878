"""Validation: the policy's reward on the validation prompts at the start of a step (`validate`, a stage of
the rollout's worker), sampled at rollout.val_temperature; `evaluate` is also the warm-start's before-and-after.
"""

from __future__ import annotations

import re

from components.multi_turn import generate_samples, with_tool_trace
from components.rewards import RewardFunctionError
from components.rollout import SamplingParams
from flows.config import Config
from flows.runtime.console import long_work
from flows.training.engines import seeds_requests
from flows.training.registry import stage
from flows.training.roles import get_role
from flows.training.stage_io import StageResult, score_batch, sync_rollout_weights, timed, write_batch


VALIDATION_QUIET_S = 10.0
"""A validation that ends sooner prints no progress line (the step's line shows its reward)."""


def evaluate(config: Config, engine, records) -> tuple[dict, dict[str, float]]:
    """Generate once per validation prompt (val_temperature) and score; return columns and metrics. One that
    takes over VALIDATION_QUIET_S says so on the terminal, every 20 s, and its reward at the end (the engines
    generate all prompts in one call, so the lines count seconds, not prompts)."""
    records = records[: config.data.max_val_prompts] if config.data.max_val_prompts else records
    params = SamplingParams(n=1, temperature=config.rollout.val_temperature, top_p=config.rollout.top_p,
                            max_new_tokens=config.rollout.max_new_tokens, stop=tuple(config.rollout.stop),
                            seed=config.trainer.seed if seeds_requests(config) else None)
    what = f"validation: generating and scoring {len(records)} prompts"
    with long_work(what, f"{what}: {{seconds:.0f}} s so far", "", announce_after_s=VALIDATION_QUIET_S) as work:
        generations = generate_samples(engine, get_role(config, "tokenizer"), [r.prompt_ids for r in records], params,
                                       config.rollout)  # with the tools under rollout.max_turns > 1
        texts = [g.text for g in generations]
        extra_info = [with_tool_trace(r.extra_info, g) for r, g in zip(records, generations)]
        scores = score_batch(config, [r.prompt_ids for r in records], texts, [r.ground_truth for r in records],
                             [r.data_source for r in records], extra_info)
        work.done = f"validation: reward {sum(scores) / len(scores):.3f} on {len(records)} prompts in {{seconds:.1f}} s"
    columns = {"uid": [f"val-{r.index}" for r in records], "prompt_text": [r.prompt_text for r in records],
               "response_text": texts, "ground_truth": [r.ground_truth for r in records],
               "data_source": [r.data_source for r in records], "extra_info": extra_info,
               "score": scores}
    metrics = {"val/reward/mean": sum(scores) / len(scores)}
    for source in sorted(set(columns["data_source"])):
        chosen = [s for s, d in zip(scores, columns["data_source"]) if d == source]
        # verl's name is .../mean@1; MLflow forbids '@' in metric names.
        metrics[f"val-core/{re.sub(r'[^A-Za-z0-9_./ -]', '_', source)}/reward/mean_at_1"] = sum(chosen) / len(chosen)
    return columns, metrics


def as_validations(metrics: dict[str, float]) -> dict[str, float]:
    """A validation's weight hand-over metrics, named apart from the step's rollout's (val-aux/, verl's prefix
    for validation's auxiliary metrics), on both sides of the hand-over."""
    return {f"val-aux/{name}": value for name, value in metrics.items()}


@stage(role="rollout", output="validation", skippable=True, per_sample=False, needs_policy_weights=True)
def validate(config: Config, step: int, sync: str | None = None) -> StageResult:
    """Validation reward of the policy as it is at the start of `step`. Its hand-over of the weights is named
    under val-aux/ (a step's timing_s/weight_sync is its rollout's) and counted in timing_s/testing."""
    metrics: dict[str, float] = {}
    with timed(metrics, "testing"):
        metrics |= as_validations(sync_rollout_weights(config, step, sync))
        records = get_role(config, "val_prompts")
        try:
            columns, val_metrics = evaluate(config, get_role(config, "rollout"), records)
        except RewardFunctionError as error:
            sample = f" (sample 'val-{records[error.index].index}')" if error.index is not None else ""
            raise RewardFunctionError(f"stage validate at step {step}{sample}: {error}", error.index) from error
        path = write_batch(config, step, "validation", columns)
    return {"path": path, "metrics": metrics | val_metrics}
