"""`rlhf doctor CONFIG --data`: the reward the run starts at, measured before a long run.

The starting policy (model.path, or the latest weights of model.from_run) answers the first `--data-prompts`
validation prompts greedily, rendered as the run renders them (components.data.load_prompts, the chat
template, data.max_prompt_length), within rollout.max_new_tokens and rollout.stop, with the transformers
engine on trainer.device (not vLLM, whose start takes minutes; greedy answers are the same up to rounding);
the run's reward scores the answers (reward.function, auto routed by data_source,
or the reward model of reward.kind=model). A policy that scores 0 on every prompt (a wrong answer format)
or 1 on every prompt gives RL no signal: that is a warning, with a few samples to show the answer format.
"""

from __future__ import annotations

import json
import sys
import time

from components.data import load_prompts
from components.models import check_model_source, load_causal_lm, load_tokenizer, resolve_device, resolve_dtype
from components.rewards import AUTO, RewardModel, load_reward_function, score_responses, scorer_for
from components.rollout import HFRolloutEngine, SamplingParams
from storage import RunLayout

DEFAULT_PROMPTS = 16
SAMPLE_LINES = 3
PROMPT_TAIL_CHARS = 40
RESPONSE_HEAD_CHARS = 60
NO_SIGNAL = ("RL gets no signal while every sample of a group scores the same (its advantages are 0)")


def _starting_policy(config) -> tuple[str, str]:
    """(the weights RL starts from that exist now, what they are); the tokenizer is always model.path's."""
    run = config.model.from_run
    if run and config.warm_start.steps == 0:  # as flows/training/roles.py initial_policy_path
        latest = RunLayout(config.run.storage_root, run).latest_weights("actor")
        if latest is None:
            raise ValueError(f"model.from_run={run!r}: that run has no committed actor weights under "
                             f"{config.run.storage_root}; give a run that has trained at least one step, or unset it")
        return latest[1], f"the actor weights of run {run} at step {latest[0]} (model.from_run)"
    if config.warm_start.steps > 0:
        return config.model.path, (f"model.path, before the warm-start (warm_start.steps={config.warm_start.steps} "
                                   "trains it first)")
    return config.model.path, "model.path"


def _scorer(config, tokenizer, device):
    """(score(records, response texts) -> scores, what scores) as the run's reward stage scores a batch."""
    if config.reward.kind == "model":
        check_model_source(config.reward.model_path, field="reward.model_path", needs_config=True)
        model = RewardModel.from_pretrained(config.reward.model_path, device=device,
                                            dtype=resolve_dtype(config.model.compute_dtype))

        def score_with_model(records, texts):  # the prompt as the policy saw it, special tokens kept
            prompts = tokenizer.batch_decode([r.prompt_ids for r in records], skip_special_tokens=False)
            return model.score(prompts, list(texts))

        return score_with_model, f"reward.kind=model: the reward model {config.reward.model_path}"
    function = load_reward_function(config.reward.function)

    def score_with_function(records, texts):
        return score_responses(function, list(texts), [r.ground_truth for r in records],
                               [r.data_source for r in records], [json.loads(r.extra_info) for r in records])

    return score_with_function, f"reward.function={config.reward.function}"


def _prompts(count: int) -> str:
    return f"{count} validation prompt{'' if count == 1 else 's'}"


def _clip(text: str, chars: int, tail: bool) -> str:
    """The text's last (tail) or first `chars` characters as a Python literal, '...' where it was cut."""
    if len(text) <= chars:
        return repr(text)
    return "..." + repr(text[-chars:]) if tail else repr(text[:chars]) + "..."


def _warnings(config, scores: list[float], hits: int) -> list[str]:
    """The model scores 0 (or 1) on every prompt: RL gets no signal. Rule rewards only (a reward model's
    scale is its own)."""
    if config.reward.kind == "model" or not scores:
        return []
    if all(score == 0.0 for score in scores):
        cut = (f"; {hits} of {len(scores)} responses were cut at rollout.max_new_tokens="
               f"{config.rollout.max_new_tokens}: an answer at the end may be missing" if hits else "")
        if config.warm_start.steps:  # the policy RL starts from is the warm-start's, not this one
            return [f"the model scores 0 on every prompt before the warm-start (warm_start.steps="
                    f"{config.warm_start.steps}): RL starts from what it teaches; check that its target "
                    f"(warm_start.target) has the answer format the reward function scores{cut}"]
        return [f"the model scores 0 on every prompt: {NO_SIGNAL}; check the reward function and answer format, "
                f"or warm-start (warm_start.steps){cut}"]
    if all(score == 1.0 for score in scores):
        return [f"the model scores 1 on every prompt: {NO_SIGNAL}; check that the reward function scores the "
                "answer, or use harder prompts"]
    return []


def _generate_and_score(config, prompts: int, seconds: dict) -> dict:
    """Load, generate greedily, score: the facts of the report (ValueError, one line, on bad input)."""
    clock = time.perf_counter()
    policy, policy_note = _starting_policy(config)
    tokenizer = load_tokenizer(config.model.path, config.model.trust_remote_code)
    data = config.data
    records, _ = load_prompts(data.val_files, tokenizer, max_prompt_length=data.max_prompt_length,
                              overlong=data.overlong_prompts, field="data.val_files")
    records = records[:prompts]
    device = resolve_device(config.trainer.device)
    score, reward_description = _scorer(config, tokenizer, device)
    if config.reward.kind == "rule" and config.reward.function == AUTO:
        reward_description += ": " + ", ".join(dict.fromkeys(scorer_for(r.data_source) for r in records))
    print(f"rlhf doctor --data: loading {policy} on {device.type} and answering {_prompts(len(records))} ...",
          file=sys.stderr, flush=True)
    model = load_causal_lm(policy, dtype=config.model.compute_dtype, device=device,
                           attn_implementation=config.model.attn_implementation,
                           trust_remote_code=config.model.trust_remote_code)
    engine = HFRolloutEngine(model, tokenizer, micro_batch_size=config.rollout.micro_batch_size)
    seconds["load"], clock = time.perf_counter() - clock, time.perf_counter()
    params = SamplingParams(n=1, temperature=0.0, max_new_tokens=config.rollout.max_new_tokens,
                            stop=tuple(config.rollout.stop))
    generations = engine.generate([r.prompt_ids for r in records], params)
    seconds["generate"], clock = time.perf_counter() - clock, time.perf_counter()
    scores = [float(value) for value in score(records, [g.text for g in generations])]
    seconds["score"] = time.perf_counter() - clock
    return {"policy": policy, "policy_note": policy_note, "device": device.type, "engine": "hf",
            "reward_function": reward_description, "records": records, "generations": generations, "scores": scores}


def data_report(config, prompts: int = DEFAULT_PROMPTS) -> dict:
    """The starting reward of `config`'s run on its first `prompts` validation prompts, as JSON-ready data:
    status ok, warn (0 or 1 on every prompt) or fail (one line: a missing model, bad data, a reward function
    that raises), the reward, the samples and the seconds each part took."""
    started, seconds = time.perf_counter(), {}
    try:
        facts = _generate_and_score(config, prompts, seconds)
    except Exception as error:  # user errors (ValueError, OSError) and anything a model or user code raises
        message = str(error).strip().splitlines()[0] if str(error).strip() else ""
        if not isinstance(error, (ValueError, OSError)):
            message = f"{type(error).__name__}: {message}" if message else type(error).__name__
        return {"status": "fail", "detail": message, "seconds": {"total": round(time.perf_counter() - started, 2)}}
    seconds["total"] = time.perf_counter() - started
    scores, generations, records = facts.pop("scores"), facts.pop("generations"), facts.pop("records")
    max_new_tokens = config.rollout.max_new_tokens
    hits = sum(generation.finish_reason == "length" for generation in generations)
    reward = sum(scores) / len(scores)
    detail = (f"starting reward {reward:.3f} on {_prompts(len(scores))} (greedy, {facts['reward_function']}), "
              f"{hits} of {len(scores)} responses hit rollout.max_new_tokens={max_new_tokens}")
    warnings = _warnings(config, scores, hits)
    samples = [{"prompt_tail": _clip(record.prompt_text, PROMPT_TAIL_CHARS, tail=True),
                "response_head": _clip(generation.text, RESPONSE_HEAD_CHARS, tail=False), "score": score,
                "finish_reason": generation.finish_reason, "response_tokens": len(generation.response_ids)}
               for record, generation, score in zip(records, generations, scores)]
    return {"status": "warn" if warnings else "ok", "detail": detail, "reward": reward, "prompts": len(scores),
            "scores": scores, "hit_max_new_tokens": hits, "max_new_tokens": max_new_tokens, **facts,
            "samples": samples, "warnings": warnings,
            "seconds": {name: round(value, 2) for name, value in seconds.items()}}


def skipped_data_report() -> dict:
    """--data without a config: nothing to score."""
    return {"status": "skip", "detail": "no config given: `rlhf doctor CONFIG --data` scores its starting policy"}


def format_data(data: dict, markers: dict[str, str]) -> list[str]:
    """The report's Data section: the starting reward, a few samples, the warnings and the time it took."""
    lines = ["Data (--data: the starting policy's greedy answers to validation prompts)"]
    if data["status"] in ("fail", "skip"):
        return lines + [f"  {markers[data['status']]}  data    {data['detail']}"]
    lines.append(f"  data    {data['detail']}")
    lines += [f"          {sample['prompt_tail']} -> {sample['response_head']}  score {sample['score']:.3f}"
              + (f", cut at {sample['response_tokens']} tokens" if sample["finish_reason"] == "length" else "")
              for sample in data["samples"][:SAMPLE_LINES]]
    lines += [f"  {markers['warn']}  {warning}" for warning in data["warnings"]]
    seconds = data["seconds"]
    lines.append(f"  model   {data['policy']} ({data['policy_note']}), transformers on {data['device']}")
    lines.append(f"  took    {seconds['total']:.1f} s: loading {seconds['load']:.1f} s, generating "
                 f"{seconds['generate']:.1f} s, scoring {seconds['score']:.1f} s")
    return lines
