"""Stage functions: one per box of the stage graph, each declared once with `@stage` (its role, its
output, whether resume may skip it; flows/training/registry.py). The per-step stages of the algorithm are
here; the warm-start (flows/training/warm_start.py) and validation (flows/training/validation.py) have
modules of their own, imported here: importing this module fills the registry with every stage.

A stage takes the run's `Config` (and a step number for the per-step ones), reads its inputs and hands
on its output through the run's transport (flows/training/stage_io.py: files of the run folder today),
and returns a small `StageResult` (where the output is and scalar metrics). No tensors or tables cross
a stage boundary; models come from `flows.training.roles`, resident in whichever process runs the stage.
"""

from __future__ import annotations

import json
import math

import torch

from components.algorithms import (
    apply_kl_penalty,
    equal_group_fraction,
    get_advantage_estimator,
    logprob_gap,
    masked_mean,
    sequence_scores_to_token_rewards,
)
from components.batch import SequenceBatch, build_sequence_batch
from components.data import PromptSampler
from components.models import resolve_dtype
from components.multi_turn import generate_samples, multi_turn_metrics, with_tool_trace
from components.rewards import RewardFunctionError
from components.rollout import SamplingParams
from flows.config import Config, layout_for
from flows.runtime.batches import batches_for
from flows.runtime.checkpoints import part_path, save_role_part
from flows.runtime.weights import transport_for
from flows.training.engines import checks_logprobs, seeds_requests
from flows.training.registry import STAGES, stage
from flows.training.roles import announcing_recompiles, get_role, trained_role
from flows.training.stage_io import (StageResult, read_batch, score_batch, sync_rollout_weights, timed,
                                     write_batch)
from flows.training.validation import as_validations, validate
from flows.training.warm_start import warm_start
from storage import padded_tensor, unpad_arrow

__all__ = ["STAGES", "validate", "warm_start"]
"""Importing this module fills the registry (STAGES); the stages of the modules beside it are importable from
here with the others (flows/training/train.py takes every stage from this module)."""


def _stats(prefix: str, values: torch.Tensor, mask: torch.Tensor | None = None) -> dict[str, float]:
    selected = values[mask.bool()] if mask is not None else values.flatten()
    if selected.numel() == 0:
        return {f"{prefix}/mean": 0.0, f"{prefix}/max": 0.0, f"{prefix}/min": 0.0}
    return {f"{prefix}/mean": float(selected.float().mean()), f"{prefix}/max": float(selected.max()),
            f"{prefix}/min": float(selected.min())}


def _rollout_batch(config: Config, rollout) -> SequenceBatch:
    tokenizer = get_role(config, "tokenizer")
    # Arrow columns straight into padded tensors (storage.padded_tensor), no Python lists.
    return build_sequence_batch(rollout.column("prompt_ids"), rollout.column("response_ids"), tokenizer.pad_token_id,
                                rollout.column("loss_mask"))


def check_finite(stage: str, step: int, name: str, values: torch.Tensor, uids: list[str]) -> None:
    """Stop the step on NaN or infinity, naming the stage, the quantity and the samples."""
    bad = ~torch.isfinite(values)
    if bad.any():
        rows = bad.reshape(len(uids), -1).any(dim=1).nonzero().flatten().tolist()
        raise FloatingPointError(
            f"stage {stage} at step {step}: {name} is NaN or infinite for {len(rows)} sample(s): "
            f"{', '.join(uids[row] for row in rows[:5])}{' ...' if len(rows) > 5 else ''}; the step stops here "
            "and the latest checkpoint stays as it was")


def _per_token(table, column: str, length: int) -> torch.Tensor:
    values, _ = padded_tensor(table.column(column), 0.0, torch.float32, side="right", length=length)
    return values


@stage(role="rollout", output="rollout", skippable=True, needs_policy_weights=True)
def rollout(config: Config, step: int, weights_step: int | None = None, sync: str | None = None) -> StageResult:
    """Sample `rollout.n` responses for each of the step's prompts, with the policy published for
    `weights_step` (default: `step`; one step earlier under trainer.one_step_ahead)."""
    policy_step = step if weights_step is None else weights_step
    metrics = sync_rollout_weights(config, policy_step, sync)
    # How many updates behind the policy being trained this rollout's policy is (0: on-policy).
    metrics["rollout/policy_lag"] = float(step - (get_role(config, "rollout").weights_version or 0))
    records = get_role(config, "train_prompts")
    sampler = PromptSampler(len(records), config.data.prompts_per_step, config.trainer.seed, config.data.shuffle)
    prompts = [records[index] for index in sampler.batch_indices(step)]
    seed = config.trainer.seed * 1_000_003 + step if seeds_requests(config) else None  # rollout.seed_requests
    fraction = config.rollout.logprobs_fraction if checks_logprobs(config, step) else 0.0  # rollout.logprobs_every
    params = SamplingParams(n=config.rollout.n, temperature=config.rollout.temperature, top_p=config.rollout.top_p,
                            top_k=config.rollout.top_k, max_new_tokens=config.rollout.max_new_tokens,
                            min_new_tokens=config.rollout.min_new_tokens, ignore_eos=config.rollout.ignore_eos,
                            stop=tuple(config.rollout.stop), seed=seed,
                            logprobs_fraction=fraction)
    engine = get_role(config, "rollout")
    with timed(metrics, "gen"):
        generations = generate_samples(engine, get_role(config, "tokenizer"), [p.prompt_ids for p in prompts], params,
                                       config.rollout)
    metrics.update(engine.last_metrics)
    metrics.update(multi_turn_metrics(generations))
    columns = {
        "uid": [f"s{step}-p{g.prompt_index}-n{g.sample_index}" for g in generations],
        "group_id": [f"s{step}-p{g.prompt_index}" for g in generations],
        "prompt_ids": [prompts[g.prompt_index].prompt_ids for g in generations],
        "response_ids": [g.response_ids for g in generations],
        # NaN where the engine was not asked for them (rollout.logprobs_fraction).
        "rollout_logprobs": [g.logprobs if g.logprobs is not None else [math.nan] * len(g.response_ids)
                             for g in generations],
        # multi-turn: 0 on the tools' tokens (components/multi_turn.py)
        "loss_mask": [g.loss_mask if g.loss_mask is not None else [1] * len(g.response_ids) for g in generations],
        "response_text": [g.text for g in generations],
        "ground_truth": [prompts[g.prompt_index].ground_truth for g in generations],
        "data_source": [prompts[g.prompt_index].data_source for g in generations],
        "extra_info": [with_tool_trace(prompts[g.prompt_index].extra_info, g) for g in generations],
        "finish_reason": [g.finish_reason for g in generations],
    }
    path = write_batch(config, step, "rollout", columns)
    lengths = torch.tensor([len(g.response_ids) for g in generations], dtype=torch.float32)
    metrics.update(_stats("response_length", lengths))
    metrics["response_length/clip_ratio"] = sum(g.finish_reason == "length" for g in generations) / len(generations)
    metrics.update(_stats("prompt_length", torch.tensor([float(len(p.prompt_ids)) for p in prompts])))
    metrics["perf/gen_tokens"] = float(lengths.sum())
    # verl's perf/total_num_tokens: prompt and response tokens of every sample
    metrics["perf/total_num_tokens"] = float(lengths.sum()) + float(sum(len(prompts[g.prompt_index].prompt_ids)
                                                                        for g in generations))
    metrics["perf/gen_tokens_per_s"] = float(lengths.sum()) / max(metrics["timing_s/gen"], 1e-9)
    return {"path": path, "metrics": metrics}


@stage(role="reward", output="reward", skippable=True)
def reward(config: Config, step: int) -> StageResult:
    """Sequence-level scores of the step's responses (rule function or reward model); a reward function that
    raises or returns no number stops the step with one line naming the function, the stage, the step and the
    sample (its uid in the rollout)."""
    rollout_table = read_batch(config, step, "rollout")
    uids = rollout_table.column("uid").to_pylist()
    metrics: dict[str, float] = {}
    with timed(metrics, "reward"):
        fields = ("prompt_ids", "response_text", "ground_truth", "data_source", "extra_info")
        try:
            scores = score_batch(config, *(rollout_table.column(name).to_pylist() for name in fields))
        except RewardFunctionError as error:
            sample = f" (sample {uids[error.index]!r})" if error.index is not None else ""
            raise RewardFunctionError(f"stage reward at step {step}{sample}: {error}", error.index) from error
        path = write_batch(config, step, "reward", {"uid": uids, "score": scores})
    metrics.update(_stats("critic/score", torch.tensor(scores)))
    return {"path": path, "metrics": metrics}


def _per_token_stage(config: Config, step: int, stage: str, column: str, timing: str, compute) -> StageResult:
    rollout_table = read_batch(config, step, "rollout")
    batch = _rollout_batch(config, rollout_table)
    metrics: dict[str, float] = {}
    with timed(metrics, timing):
        values = compute(batch)
        path = write_batch(config, step, stage, {"uid": rollout_table.column("uid").to_pylist(),
                                            column: unpad_arrow(values, batch.response_tokens)})
    return {"path": path, "metrics": metrics, "values": values, "batch": batch, "rollout": rollout_table}


def _finite_logprobs(config: Config, step: int, batch: SequenceBatch) -> torch.Tensor:
    logprobs = trained_role(config, "actor", step, "old_logprobs").compute_logprobs(batch)[0]
    uids = [f"row {row}" for row in range(batch.size)]  # the rollout's order; uids are in its file
    check_finite("old_logprobs", step, "the actor's log-prob", logprobs, uids)
    return logprobs


@stage(role="reference", output="reference", skippable=True)
def reference(config: Config, step: int) -> StageResult:
    """Log-probs of the responses under the frozen reference policy."""
    result = _per_token_stage(config, step, "reference", "ref_logprobs", "ref",
                              get_role(config, "reference").compute_logprobs)
    return {"path": result["path"], "metrics": result["metrics"]}


@stage(role="critic", output="values", skippable=True)
def values(config: Config, step: int) -> StageResult:
    """Critic values of every response position."""
    critic = trained_role(config, "critic", step, "values")
    result = _per_token_stage(config, step, "values", "values", "values", critic.compute_values)
    metrics = result["metrics"] | _stats("critic/values", result["values"], result["batch"].response_mask)
    return {"path": result["path"], "metrics": metrics}


@stage(role="actor", output="old_logprobs", skippable=True)
def old_logprobs(config: Config, step: int) -> StageResult:
    """The actor's log-probs before its update, and how far they are from the rollout engine's."""
    result = _per_token_stage(config, step, "old_logprobs", "old_logprobs", "old_log_prob",
                              lambda batch: _finite_logprobs(config, step, batch))
    batch, mask = result["batch"], result["batch"].response_mask
    rollout_logprobs = _per_token(result["rollout"], "rollout_logprobs", batch.response_length)
    difference, measured = logprob_gap(result["values"], rollout_logprobs, mask)
    metrics = result["metrics"]
    if measured.any():  # rollout.logprobs_fraction=0: nothing to compare
        metrics["rollout/logprob_diff_mean"] = float(masked_mean(difference, measured))
        metrics["rollout/logprob_diff_max"] = float(difference.max())
    return {"path": result["path"], "metrics": metrics}


@stage(role="driver", output="advantages", skippable=True)
def advantages(config: Config, step: int, kl_coef: float) -> StageResult:
    """Token rewards (score at the last token, minus the KL penalty if configured) and advantages."""
    metrics: dict[str, float] = {}
    with timed(metrics, "adv"):
        rollout_table = read_batch(config, step, "rollout")
        batch = _rollout_batch(config, rollout_table)
        mask, length = batch.response_mask, batch.response_length
        scores = torch.tensor(read_batch(config, step, "reward", rollout_table).column("score").to_pylist())
        group_ids = rollout_table.column("group_id").to_pylist()
        if (equal := equal_group_fraction(scores.tolist(), group_ids)) is not None:  # None: groups of one sample
            metrics["critic/score/equal_group_frac"] = equal
        token_rewards = sequence_scores_to_token_rewards(scores, mask)
        if config.algorithm.use_kl_in_reward:
            token_rewards, kl_metrics = apply_kl_penalty(
                token_level_scores=token_rewards,
                logprobs=_per_token(read_batch(config, step, "old_logprobs", rollout_table), "old_logprobs", length),
                ref_logprobs=_per_token(read_batch(config, step, "reference", rollout_table), "ref_logprobs", length),
                response_mask=mask, kl_coef=kl_coef, estimator=config.algorithm.kl_penalty)
            metrics.update(kl_metrics)
        critic_values = (_per_token(read_batch(config, step, "values", rollout_table), "values", length)
                         if config.uses_critic else None)
        uids = rollout_table.column("uid").to_pylist()
        check_finite("advantages", step, "the reward", token_rewards * mask, uids)
        if critic_values is not None:
            check_finite("advantages", step, "the critic value", critic_values, uids)
        estimator = get_advantage_estimator(config.algorithm.adv_estimator)
        advantage, returns = estimator(token_rewards=token_rewards, response_mask=mask, values=critic_values,
                                       group_ids=group_ids,
                                       gamma=config.algorithm.gamma, lam=config.algorithm.lam)
        check_finite("advantages", step, "the advantage", advantage, uids)
        tokens = batch.response_tokens  # a value for every response token, 0 on a tool's
        path = write_batch(config, step, "advantages", {
            "uid": uids, "token_rewards": unpad_arrow(token_rewards, tokens),
            "advantages": unpad_arrow(advantage, tokens), "returns": unpad_arrow(returns, tokens)})
    metrics.update(_stats("critic/rewards", token_rewards.sum(-1)))
    metrics.update(_stats("critic/advantages", advantage, mask))
    metrics.update(_stats("critic/returns", returns, mask))
    return {"path": path, "metrics": metrics}


@stage(role="actor", output="weights/actor")
def update_actor(config: Config, step: int) -> StageResult:
    """PPO update of the policy, then publish its weights for the rollout of step+1."""
    rollout_table = read_batch(config, step, "rollout")
    batch = _rollout_batch(config, rollout_table)
    length = batch.response_length
    ref_logprobs = (_per_token(read_batch(config, step, "reference", rollout_table), "ref_logprobs", length)
                    if config.actor.use_kl_loss else None)
    actor = trained_role(config, "actor", step, "update_actor")
    transport = transport_for(config)
    transport.withdraw_weights()  # the weights published in memory are about to change
    actor.state_step = None  # until this update is done: a failure midway leaves no known state
    metrics: dict[str, float] = {}
    on_policy = config.on_policy_update
    with timed(metrics, "update_actor"), announcing_recompiles("actor", actor):
        metrics.update(actor.update(
            batch, old_logprobs=None if on_policy else
            _per_token(read_batch(config, step, "old_logprobs", rollout_table), "old_logprobs", length),
            advantages=_per_token(read_batch(config, step, "advantages", rollout_table), "advantages", length),
            ref_logprobs=ref_logprobs,
            rollout_logprobs=_per_token(rollout_table, "rollout_logprobs", length) if on_policy else None))
    if on_policy and not math.isfinite(metrics.get("rollout/logprob_diff_mean", 0.0)):
        # The update skipped its non-finite step, so the weights are as they were; stop here as
        # old_logprobs would have.
        raise FloatingPointError(
            f"stage update_actor at step {step}: the actor's log-prob is NaN or infinite for "
            f"{int(metrics.get('actor/nonfinite_samples', 0))} sample(s); the step stops here and the latest "
            "checkpoint stays as it was")
    with timed(metrics, "save_weights"):  # for the rollout of step+1
        path = transport.publish_weights(actor.policy_model, step + 1, resolve_dtype(config.model.compute_dtype))
    actor.state_step = step + 1
    return {"path": path, "metrics": metrics}


@stage(role="actor", sends_policy_weights=True)
def send_weights(config: Config, step: int, sync: str, for_stage: str, for_step: int) -> StageResult:
    """Stream policy `step` (the actor after `step` updates) to the rollout's worker, for the stage `for_stage`
    at `for_step` that the driver started beside this one (weights in memory between workers:
    flows/runtime/weights/). Ends when that stage has what it needs (or has committed its output). A
    replaced actor that holds another version says so, and the rollout reads the stored copy. Validation's
    hand-overs are named under val-aux/, as on the rollout's side."""
    actor = get_role(config, "actor")
    output, batches = STAGES[for_stage].output, batches_for(config)
    metrics = transport_for(config).send_weights(actor.policy_model, step, resolve_dtype(config.model.compute_dtype),
                                                 sync, holds=actor.state_step == step,
                                                 finished=lambda: batches.committed(for_step, output))
    return {"metrics": as_validations(metrics) if for_stage == "validate" else metrics}


@stage(role="critic")
def update_critic(config: Config, step: int) -> StageResult:
    """Clipped value regression of the critic on this step's returns."""
    rollout_table = read_batch(config, step, "rollout")
    batch = _rollout_batch(config, rollout_table)
    length = batch.response_length
    metrics: dict[str, float] = {}
    critic = trained_role(config, "critic", step, "update_critic")
    critic.state_step = None  # until this update is done
    with timed(metrics, "update_critic"), announcing_recompiles("critic", critic):
        metrics.update(critic.update(
            batch, old_values=_per_token(read_batch(config, step, "values", rollout_table), "values", length),
            returns=_per_token(read_batch(config, step, "advantages", rollout_table), "returns", length)))
    critic.state_step = step + 1
    return {"path": batches_for(config).path(step, "advantages"), "metrics": metrics}


def _prepare(config: Config, role: str) -> StageResult:
    """Build this worker's role (and the tokenizer its stages use) before its first stage needs it."""
    metrics: dict[str, float] = {}
    with timed(metrics, f"prepare_{role}"):
        get_role(config, role)
        get_role(config, "tokenizer")
    return {"metrics": metrics}


@stage(role="actor")
def prepare_actor(config: Config) -> StageResult:
    """Under trainer.execution=workers, the driver sends every role but the rollout a prepare stage at the
    start of a run, so that models load in their workers while the rollout's engine starts for the first
    validation (timing_s/prepare_<role>), instead of one after another inside the first step."""
    return _prepare(config, "actor")


@stage(role="critic")
def prepare_critic(config: Config) -> StageResult:
    return _prepare(config, "critic")


@stage(role="reference")
def prepare_reference(config: Config) -> StageResult:
    return _prepare(config, "reference")


@stage(role="reward")
def prepare_reward(config: Config) -> StageResult:
    return _prepare(config, "reward")


def sample_rows(config: Config, step: int, limit: int = 16) -> dict[str, list]:
    """A few of the step's generations with their scores, for the MLflow samples table."""
    rollout_table = read_batch(config, step, "rollout").slice(0, limit)
    scores = read_batch(config, step, "reward").slice(0, limit).column("score").to_pylist()
    tokenizer = get_role(config, "tokenizer")
    return {"uid": rollout_table.column("uid").to_pylist(),
            "prompt": tokenizer.batch_decode(rollout_table.column("prompt_ids").to_pylist(), skip_special_tokens=True),
            "response": rollout_table.column("response_text").to_pylist(),
            "ground_truth": rollout_table.column("ground_truth").to_pylist(), "score": scores,
            "turns": [_turns(text) for text in rollout_table.column("extra_info").to_pylist()]}


def _turns(extra_info: str) -> int:
    """A sample's policy turns (1 unless a multi-turn rollout's transcript in extra_info says otherwise)."""
    info = json.loads(extra_info) if extra_info else None
    return int(info.get("turns", 1)) if isinstance(info, dict) else 1


def _checkpoint_role(config: Config, step: int, role: str) -> StageResult:
    instance = trained_role(config, role, step, f"checkpoint_{role}")
    # The actor's with its tokenizer: the folder loads as a model (a replaced actor is built from it).
    return {"path": part_path(layout_for(config), step, role), "metrics": save_role_part(config, step, role, instance)}


@stage(role="actor", output="checkpoint/actor")
def checkpoint_actor(config: Config, step: int) -> StageResult:
    """The actor's full training state at the start of `step` (weights, optimizer, schedule, RNG), written now
    or in the background (flows/runtime/checkpoints.py)."""
    return _checkpoint_role(config, step, "actor")


@stage(role="critic", output="checkpoint/critic")
def checkpoint_critic(config: Config, step: int) -> StageResult:
    """The critic's full training state at the start of `step`."""
    return _checkpoint_role(config, step, "critic")
