"""Rollout stage throughput against raw vLLM on the same prompts, in one process, plus weight sync.

    python bench/rollout.py                        # Qwen2.5-0.5B shape, 64 prompts x 8, 128 -> 256 tokens
    python bench/rollout.py --tp 2                 # tensor-parallel engine over the two visible GPUs
    python bench/rollout.py --engines 2            # two engines side by side (rollout.engines), prompts split
    python bench/rollout.py --engine-kwargs '{"max_num_batched_tokens": 32768}'   # a vLLM setting (rollout.engine_kwargs)
    python bench/rollout.py --device cpu --preset tiny --prompts 8 --n 2 --prompt-tokens 16 --new-tokens 8

One rollout role serves every measurement (as the flow builds it, started once; --engines 2: two engines):
  raw    `LLM.generate` on the prompts as token ids, n samples each, unseeded, no log-probs: vLLM alone,
         as a user would call it. Variants: detokenize=False (the best raw path); that with per-request seeds;
         that with the sampled tokens' log-probs for 1 prompt in 8 (the stage's default share).
  stage  `flows.training.stages.rollout(config, step)`: prompt sampling from the Parquet dataset, generation with
         the sampled tokens' log-probs, decoding, and the Parquet write; timed end to end, with the
         product's defaults (unseeded requests on a GPU, rollout.seed_requests; the engine's log-probs for 1
         prompt in 8, rollout.logprobs_fraction=0.125). Variants: per-request seeds (rollout.seed_requests=true);
         no log-probs (fraction 0). The stage's own split: its `timing_s/gen` (of it `timing_s/gen_collect`,
         the engine's outputs made into samples, decoded) and the rest (prompts, columns, the Parquet write).
They alternate `--repeats` times; the table gives the median of each and the ratio stage/raw.
Weight sync: the actor's published copy (safetensors on storage) loaded into the running engine, as
the stage does each step. Sleep/wake (GPU): memory freed by sleep level 2, and wake + reload seconds.
Responses are fixed length (ignore_eos), so every run generates the same number of tokens.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import statistics
import string
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import emit, machine_info, make_random_model, markdown_table  # noqa: E402


def write_fixed_prompts(path: Path, count: int, tokens: int, tokenizer, seed: int = 0) -> None:
    """A verl-format Parquet of `count` pre-rendered prompts of exactly `tokens` tokens each."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = random.Random(seed)
    rows = []
    for index in range(count):
        text = "".join(rng.choice(string.ascii_lowercase + " ") for _ in range(tokens))
        length = len(tokenizer(text, add_special_tokens=False)["input_ids"])
        if length != tokens:
            raise RuntimeError(f"prompt {index} is {length} tokens, wanted {tokens}: the tokenizer is not byte-level")
        rows.append({"prompt": text, "data_source": "arithmetic", "ability": "math",
                     "reward_model": {"style": "rule", "ground_truth": "0"},
                     "extra_info": {"split": "train", "index": index}})
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)


def publish(layout, model_dir: Path, version: int) -> None:
    """Publish `model_dir`'s weights as the actor's copy for `version`, as update_actor does."""
    target = Path(layout.weights_dir("actor", version))
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(model_dir, target)
    (target / "_COMMITTED").write_text("")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="qwen2.5-0.5b")
    parser.add_argument("--model-dir", default=None, help="default: /tmp/rlhf-bench-models/<preset>")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size of the engine")
    parser.add_argument("--engines", type=int, default=1,
                        help="rollout.engines: engines side by side, each on a share of the prompts (raw runs too)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--engine-kwargs", type=json.loads, default={},
                        help='rollout.engine_kwargs as JSON, e.g. \'{"max_num_seqs": 512, "max_num_batched_tokens": '
                             '16384}\': vLLM engine settings for both the raw and the stage measurement')
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--out", default=None, help="write the JSON result here")
    parser.add_argument("--variants", default=None, help="comma-separated: measure only these (the raw_* ones "
                        "the ratios need, e.g. raw,raw_no_detokenize_logprobs,raw_no_detokenize_seeded,stage,stage_seeded)")
    return parser.parse_args(argv)


def bench_config(args: argparse.Namespace, model_dir: Path, work: Path):
    """The run's config: the rollout as the flow builds it, on `args`' prompts and engine settings."""
    from flows.config import build_config

    on_gpu = args.device == "cuda"
    data = str(work / "data" / "train.parquet")
    return build_config({
        "run": {"name": "bench-rollout", "storage_root": str(work / "runs")},
        "model": {"path": str(model_dir), "dtype": "bfloat16" if on_gpu else "float32"},
        "data": {"train_files": [data], "val_files": [data], "max_prompt_length": args.prompt_tokens,
                 "prompts_per_step": args.prompts},
        "rollout": {"engine": "vllm", "n": args.n, "max_new_tokens": args.new_tokens, "ignore_eos": True,
                    "temperature": 1.0, "gpu_memory_utilization": args.gpu_memory_utilization,
                    "tensor_parallel_size": args.tp if on_gpu else None, "enforce_eager": args.enforce_eager or not on_gpu,
                    "kv_cache_gib": None if on_gpu else 1.0, "sleep": "on" if on_gpu else "off",
                    "engines": args.engines, "engine_kwargs": args.engine_kwargs},
        "trainer": {"device": args.device, "total_steps": 1},
        "tracking": {"tracking_uri": f"sqlite:///{work}/mlflow.db"},
    })


class Measurements:
    """One rollout role (started once, as the flow builds it) and the runs measured on it: raw `LLM.generate`
    on its engines and the rollout stage, each call giving (seconds, generated tokens)."""

    def __init__(self, args: argparse.Namespace, config):
        from components.vllm_data_parallel import prompt_shares
        from flows.training.roles import get_role

        self.args, self.config = args, config
        started = time.perf_counter()
        self.engine = get_role(config, "rollout")  # the rollout role exactly as the flow builds it
        self.start_s = time.perf_counter() - started
        self.engine.sleep_enabled = False  # throughput first; sleep/wake is measured on its own (sleep_and_sync)
        self.prompts = [r.prompt_ids for r in get_role(config, "train_prompts")][: args.prompts]
        assert all(len(ids) == args.prompt_tokens for ids in self.prompts)
        self.engines = getattr(self.engine, "engines", [self.engine])  # rollout.engines > 1: a DataParallelRollout
        self.shares = prompt_shares(len(self.prompts), len(self.engines))
        self.splits: dict[str, list[dict[str, float]]] = {}
        """The stage's own timings, per stage variant and run."""
        self.last_stage: dict[str, float] = {}
        """The last stage run's metrics."""

    def raw(self, seed: int | None, logprobs_fraction: float = 0.0, detokenize: bool = True,
            fresh: bool = False) -> tuple[float, int]:
        """`LLM.generate` itself; with several engines, each on its share of the prompts, in parallel. `seed`:
        per-request seeds (seed + prompt index x n); `logprobs_fraction`: the share of the prompts whose samples
        carry the sampled tokens' log-probs (chosen as the stage chooses them); `fresh`: the prefix cache emptied
        first (untimed), so the prompts are prefilled as the stage's new prompts of a step are (raw calls reuse
        the same prompts, whose blocks the cache otherwise still holds)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        from components.rollout import logprob_prompts

        args, prompts = self.args, self.prompts
        with_logprobs = logprob_prompts(len(prompts), logprobs_fraction)

        def sampling(index: int):
            extra = {"logprobs": 0, "flat_logprobs": True} if index in with_logprobs else {}
            return SamplingParams(n=args.n, temperature=1.0, max_tokens=args.new_tokens, ignore_eos=True,
                                  seed=None if seed is None else seed + index * args.n,
                                  # False: vLLM's incremental detokenizer off, as the stage runs it (it decodes
                                  # once, batched)
                                  detokenize=detokenize, **extra)

        def share(part: int):
            start, stop = self.shares[part]
            return self.engines[part].llm.generate(
                [TokensPrompt(prompt_token_ids=ids) for ids in prompts[start:stop]],
                [sampling(index) for index in range(start, stop)], use_tqdm=False)

        if fresh:
            for engine in self.engines:
                engine.llm.reset_prefix_cache()
        begin = time.perf_counter()
        with ThreadPoolExecutor(len(self.shares)) as pool:
            outputs = [output for result in pool.map(share, range(len(self.shares))) for output in result]
        seconds = time.perf_counter() - begin
        return seconds, sum(len(c.token_ids) for o in outputs for c in o.outputs)

    def stage(self, name: str, step: int, **rollout_settings) -> tuple[float, int]:
        """`flows.training.stages.rollout` at `step`, with `rollout_settings` over the config's; its split kept
        under `name`."""
        from flows.training.stages import rollout

        config = self.config
        variant = config.model_copy(update={"rollout": config.rollout.model_copy(update=rollout_settings)})
        begin = time.perf_counter()
        result = rollout(variant, step, weights_step=0)  # the engine's own weights: no reload inside the timing
        seconds = time.perf_counter() - begin
        metrics = result["metrics"]
        self.splits.setdefault(name, []).append({"stage_s": seconds, "gen_s": metrics["timing_s/gen"],
                                                 "collect_s": metrics.get("timing_s/gen_collect", math.nan)})
        self.last_stage = dict(metrics)
        return seconds, int(metrics["perf/gen_tokens"])

    def variants(self) -> dict:
        """name: (what it is, how to run it once given the repeat's index)."""
        from flows.training.engines import seeds_requests

        fraction = self.config.rollout.logprobs_fraction
        raw, stage = self.raw, self.stage
        return {
            "raw": ("raw vLLM generate, unseeded, no log-probs", lambda r: raw(None)),
            "raw_no_detokenize": ("raw vLLM generate, detokenize=False (the best raw path)",
                                  lambda r: raw(None, detokenize=False)),
            "raw_fresh": ("raw, detokenize=False, prefix cache emptied first (new prompts, as a step's)",
                          lambda r: raw(None, detokenize=False, fresh=True)),
            "raw_no_detokenize_seeded": ("raw, detokenize=False, per-request seeds",
                                         lambda r: raw(r, detokenize=False)),
            "raw_no_detokenize_logprobs": (f"raw, detokenize=False, log-probs for {fraction:g} of the prompts",
                                           lambda r: raw(None, fraction, detokenize=False)),
            "stage": (f"rollout stage, product defaults (seed_requests={seeds_requests(self.config)}, "
                      f"logprobs_fraction={fraction:g})", lambda r: stage("stage", r)),
            "stage_seeded": ("rollout stage, rollout.seed_requests=true",
                             lambda r: stage("stage_seeded", 100 + r, seed_requests=True)),
            "stage_no_logprobs": ("rollout stage, rollout.logprobs_fraction=0",
                                  lambda r: stage("stage_no_logprobs", 200 + r, logprobs_fraction=0.0)),
        }


def sync_and_sleep(measure: Measurements, model_dir: Path, on_gpu: bool) -> tuple[list[float], dict]:
    """Weight sync (a new published copy each time, loaded into the running engine: seconds of 3); on a GPU,
    sleep (seconds, memory freed) and wake with a sync; then a colocated step (generate, then sleep; on the CPU,
    where vLLM has no sleep mode, the same stage call without it, so that this path runs in the CPU test too)."""
    import torch

    from flows.config import layout_for
    from flows.training.stage_io import sync_rollout_weights

    config, engine = measure.config, measure.engine
    layout = layout_for(config)
    syncs = []
    for version in (1, 2, 3):
        publish(layout, model_dir, version)
        syncs.append(sync_rollout_weights(config, version)["timing_s/weight_sync"])
    sleep = {}
    if on_gpu:
        free_awake = torch.cuda.mem_get_info()[0]
        begin = time.perf_counter()
        engine.sleep()
        sleep["sleep_s"] = time.perf_counter() - begin
        sleep["freed_gib"] = (torch.cuda.mem_get_info()[0] - free_awake) / 2**30
        publish(layout, model_dir, 4)
        sleep["wake_and_sync_s"] = sync_rollout_weights(config, 4)["timing_s/weight_sync"]
        engine.sleep_enabled = True
    seconds, tokens = measure.stage("colocated", 10)
    sleep["colocated_stage_tokens_per_s"] = tokens / seconds
    sleep["colocated_sleep_s"] = measure.last_stage.get("timing_s/sleep")
    return syncs, sleep


def report(args: argparse.Namespace, measure: Measurements, described: dict, runs: dict, syncs: list[float],
           sleep: dict) -> None:
    """The table (medians, the ratios, the stage's split) and the RESULT JSON."""
    spread = {name: [tokens / seconds for seconds, tokens in runs[name]] for name in runs}
    rates = {name: statistics.median(values) for name, values in spread.items()}
    raw_tps, raw_logprob_tps = rates.get("raw", math.nan), rates.get("raw_no_detokenize_logprobs", math.nan)
    stage_tps = rates["stage"]
    best_raw = max(rates[name] for name in rates if name.startswith("raw"))
    seeded = rates.get("stage_seeded", math.nan) / rates.get("raw_no_detokenize_seeded", math.nan)
    rows = [{"measure": f"{described[name]} (tokens/s, median (min-max))",
             "value": f"{rates[name]:,.0f} ({min(spread[name]):,.0f}-{max(spread[name]):,.0f})"} for name in runs]
    rows += [
        {"measure": "stage / raw", "value": f"{stage_tps / raw_tps:.3f}"},
        {"measure": "stage / best raw", "value": f"{stage_tps / best_raw:.3f}"},
        {"measure": "stage / raw on new prompts (raw_fresh)",
         "value": f"{stage_tps / rates.get('raw_fresh', math.nan):.3f}"},
        {"measure": "stage / raw with the same log-prob share", "value": f"{stage_tps / raw_logprob_tps:.3f}"},
        {"measure": "stage_seeded / raw seeded", "value": f"{seeded:.3f}"},
    ] + [
        {"measure": f"{name}: generation / outside it / of generation, samples and decoding (s, median)",
         "value": " / ".join(f"{statistics.median(values):.3f}" for values in (
             [r["gen_s"] for r in taken], [r["stage_s"] - r["gen_s"] for r in taken], [r["collect_s"] for r in taken]))}
        for name, taken in measure.splits.items()
    ] + [
        {"measure": "weight sync from storage (s, median of 3)", "value": f"{statistics.median(syncs):.3f}"},
        {"measure": "engine start (s)", "value": f"{measure.start_s:.1f}"},
    ] + [{"measure": name, "value": f"{value:.3f}" if isinstance(value, float) else str(value)}
         for name, value in sleep.items()]
    print(f"\n{args.prompts} prompts x {args.n} samples, {args.prompt_tokens} prompt tokens, {args.new_tokens} new tokens "
          f"(fixed), {args.preset}, tp={args.tp}, engines={args.engines}, {args.device}, "
          f"engine_kwargs={json.dumps(args.engine_kwargs)}\n")
    print(markdown_table(rows, ["measure", "value"]))
    emit({"bench": "rollout", "args": vars(args), "raw_tokens_per_s": raw_tps, "stage_tokens_per_s": stage_tps,
          "stage_over_raw": stage_tps / raw_tps, "raw_logprobs_tokens_per_s": raw_logprob_tps,
          "stage_over_raw_logprobs": stage_tps / raw_logprob_tps,
          "stage_over_raw_no_detokenize": stage_tps / rates.get("raw_no_detokenize", math.nan),
          "stage_over_best_raw": stage_tps / best_raw,
          "stage_over_raw_fresh": stage_tps / rates.get("raw_fresh", math.nan), "tokens_per_s": rates, "runs": runs,
          "stage_splits": measure.splits, "weight_sync_s": syncs, "engine_start_s": measure.start_s, **sleep,
          "machine": machine_info()}, args.out)


def main() -> None:
    args = parse_args()

    from components.models import load_tokenizer
    from flows.runtime.residents import release_run

    model_dir = make_random_model(args.model_dir or f"/tmp/rlhf-bench-models/{args.preset}", args.preset)
    work = Path(tempfile.mkdtemp(prefix="rlhf-bench-rollout-"))
    write_fixed_prompts(work / "data" / "train.parquet", args.prompts, args.prompt_tokens,
                        load_tokenizer(str(model_dir)))
    config = bench_config(args, model_dir, work)
    measure = Measurements(args, config)
    variants = measure.variants()
    if args.variants:
        variants = {name: variants[name] for name in args.variants.split(",")}
    measure.raw(None)  # warm-up (first-request compilation, allocator), for every sampling path
    measure.raw(999, detokenize=False)
    measure.raw(None, 1.0, detokenize=False)
    runs: dict[str, list[tuple[float, int]]] = {name: [] for name in variants}
    for repeat in range(args.repeats):  # the variants alternate
        for name, (_, run_once) in variants.items():
            runs[name].append(run_once(repeat))
    expected = args.prompts * args.n * args.new_tokens
    for seconds, tokens in (run for name in runs for run in runs[name]):
        assert tokens == expected, (tokens, expected)
    syncs, sleep = sync_and_sleep(measure, model_dir, args.device == "cuda")
    release_run(config)
    report(args, measure, {name: what for name, (what, _) in variants.items()}, runs, syncs, sleep)
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
    os._exit(0)  # vLLM's helper processes are gone; skip slow interpreter teardown
