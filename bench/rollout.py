"""Rollout stage throughput against raw vLLM on the same prompts, in one process, plus weight sync.

    python bench/rollout.py                        # Qwen2.5-0.5B shape, 64 prompts x 8, 128 -> 256 tokens
    python bench/rollout.py --tp 2                 # tensor-parallel engine over the two visible GPUs
    python bench/rollout.py --device cpu --preset tiny --prompts 8 --n 2 --prompt-tokens 16 --new-tokens 8

One vLLM engine serves both measurements (it is the rollout role the flow builds, started once):
  raw    `LLM.generate` on the prompts as token ids, n samples each, no log-probs: vLLM alone.
  stage  `flows.stages.rollout(config, step)`: prompt sampling from the Parquet dataset, generation with
         the sampled tokens' log-probs, decoding, and the Parquet write; timed end to end.
They alternate `--repeats` times; the table gives the median of each and the ratio stage/raw.
Weight sync: the actor's published copy (safetensors on storage) loaded into the running engine, as
the stage does each step. Sleep/wake (GPU): memory freed by sleep level 2, and wake + reload seconds.
Responses are fixed length (ignore_eos), so every run generates the same number of tokens.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import string
import sys
import tempfile
import time
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="qwen2.5-0.5b")
    parser.add_argument("--model-dir", default=None, help="default: /tmp/rlhf-bench-models/<preset>")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size of the engine")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--out", default=None, help="write the JSON result here")
    args = parser.parse_args()

    import torch

    from flows.config import build_config
    from flows.roles import get_role, layout_for, release_run
    from flows.stages import rollout, sync_rollout_weights

    model_dir = make_random_model(args.model_dir or f"/tmp/rlhf-bench-models/{args.preset}", args.preset)
    work = Path(tempfile.mkdtemp(prefix="rlhf-bench-rollout-"))
    from components.models import load_tokenizer

    tokenizer = load_tokenizer(str(model_dir))
    write_fixed_prompts(work / "data" / "train.parquet", args.prompts, args.prompt_tokens, tokenizer)
    on_gpu = args.device == "cuda"
    config = build_config({
        "run": {"name": "bench-rollout", "storage_root": str(work / "runs")},
        "model": {"path": str(model_dir), "dtype": "bfloat16" if on_gpu else "float32"},
        "data": {"train_files": [str(work / "data" / "train.parquet")], "val_files": [str(work / "data" / "train.parquet")],
                 "max_prompt_length": args.prompt_tokens, "prompts_per_step": args.prompts},
        "rollout": {"engine": "vllm", "n": args.n, "max_new_tokens": args.new_tokens, "ignore_eos": True,
                    "temperature": 1.0, "gpu_memory_utilization": args.gpu_memory_utilization,
                    "tensor_parallel_size": args.tp if on_gpu else None, "enforce_eager": args.enforce_eager or not on_gpu,
                    "kv_cache_gib": None if on_gpu else 1.0, "sleep": "on" if on_gpu else "off"},
        "trainer": {"device": args.device, "total_steps": 1},
        "tracking": {"tracking_uri": f"sqlite:///{work}/mlflow.db"},
    })
    started = time.perf_counter()
    engine = get_role(config, "rollout")  # the rollout role exactly as the flow builds it
    start_s = time.perf_counter() - started
    engine.sleep_enabled = False  # throughput first; sleep/wake is measured on its own below

    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = [r.prompt_ids for r in get_role(config, "train_prompts")][: args.prompts]
    assert all(len(ids) == args.prompt_tokens for ids in prompts)

    def raw(seed: int, logprobs: bool = False) -> tuple[float, int]:
        extra = {"logprobs": 0, "flat_logprobs": True, "detokenize": False} if logprobs else {}
        sampling = SamplingParams(n=args.n, temperature=1.0, max_tokens=args.new_tokens, ignore_eos=True, seed=seed,
                                  **extra)
        begin = time.perf_counter()
        outputs = engine.llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in prompts], sampling, use_tqdm=False)
        seconds = time.perf_counter() - begin
        return seconds, sum(len(c.token_ids) for o in outputs for c in o.outputs)

    def stage(step: int) -> tuple[float, int, dict]:
        begin = time.perf_counter()
        result = rollout(config, step)
        seconds = time.perf_counter() - begin
        return seconds, int(result["metrics"]["perf/gen_tokens"]), result["metrics"]

    raw(seed=999)  # warm-up (first-request compilation, allocator), for both sampling paths
    raw(seed=999, logprobs=True)
    raw_runs, raw_logprob_runs, stage_runs = [], [], []
    for repeat in range(args.repeats):
        raw_runs.append(raw(seed=repeat))
        raw_logprob_runs.append(raw(seed=repeat, logprobs=True))
        stage_runs.append(stage(repeat))
    expected = args.prompts * args.n * args.new_tokens
    for seconds, tokens, *_ in raw_runs + raw_logprob_runs + stage_runs:
        assert tokens == expected, (tokens, expected)
    raw_tps = statistics.median(tokens / seconds for seconds, tokens in raw_runs)
    raw_logprob_tps = statistics.median(tokens / seconds for seconds, tokens in raw_logprob_runs)
    stage_tps = statistics.median(tokens / seconds for seconds, tokens, _ in stage_runs)
    gen_tps = statistics.median(m["perf/gen_tokens_per_s"] for _, _, m in stage_runs)

    # Weight sync: a new published copy each time, loaded into the running engine.
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
        seconds, tokens, metrics = stage(10)  # a colocated step: generate, then sleep
        sleep["colocated_stage_tokens_per_s"] = tokens / seconds
        sleep["colocated_sleep_s"] = metrics.get("timing_s/sleep")
    release_run(config)

    rows = [
        {"measure": "raw vLLM generate (tokens/s)", "value": f"{raw_tps:,.0f}"},
        {"measure": "raw vLLM generate with the sampled tokens' log-probs (tokens/s)", "value": f"{raw_logprob_tps:,.0f}"},
        {"measure": "rollout stage, end to end (tokens/s)", "value": f"{stage_tps:,.0f}"},
        {"measure": "stage / raw", "value": f"{stage_tps / raw_tps:.3f}"},
        {"measure": "stage / raw with log-probs", "value": f"{stage_tps / raw_logprob_tps:.3f}"},
        {"measure": "stage generate call only (tokens/s)", "value": f"{gen_tps:,.0f}"},
        {"measure": "weight sync from storage (s, median of 3)", "value": f"{statistics.median(syncs):.3f}"},
        {"measure": "engine start (s)", "value": f"{start_s:.1f}"},
    ] + [{"measure": name, "value": f"{value:.3f}" if isinstance(value, float) else str(value)}
         for name, value in sleep.items()]
    print(f"\n{args.prompts} prompts x {args.n} samples, {args.prompt_tokens} prompt tokens, {args.new_tokens} new tokens "
          f"(fixed), {args.preset}, tp={args.tp}, {args.device}\n")
    print(markdown_table(rows, ["measure", "value"]))
    emit({"bench": "rollout", "args": vars(args), "raw_tokens_per_s": raw_tps, "stage_tokens_per_s": stage_tps,
          "stage_over_raw": stage_tps / raw_tps, "raw_logprobs_tokens_per_s": raw_logprob_tps,
          "stage_over_raw_logprobs": stage_tps / raw_logprob_tps, "raw_logprob_runs": raw_logprob_runs, "stage_generate_tokens_per_s": gen_tps,
          "raw_runs": raw_runs, "stage_runs": [(s, t) for s, t, _ in stage_runs], "weight_sync_s": syncs,
          "engine_start_s": start_s, **sleep, "machine": machine_info()}, args.out)
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
    os._exit(0)  # vLLM's helper processes are gone; skip slow interpreter teardown
