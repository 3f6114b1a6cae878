"""Issue 39: the rollout serving the policy as merged weights or as a vLLM LoRA adapter, at one GPU and one shape.

    python bench/lora_serving.py --preset qwen2.5-0.5b --out lora_serving-0.5b.json
    python bench/lora_serving.py --model DIR --prompts 64 --n 8 --prompt-tokens 256 --new-tokens 512 --rank 32
    python bench/lora_serving.py --model DIR --modes lora          # one mode alone

Each mode runs in its own child process (this script again, with --mode), so each engine gets the whole
memory share and dies with its process; engine settings are the same for both: bfloat16, seed 0,
max_model_len = prompt + new tokens, --gpu-memory-utilization, prefix caching at vLLM's default.
  merged  `LLM(model)` without LoRA: the product's path (the actor's weights merged, W + (alpha/r)·B·A, and
          handed to the engine; that hand-over is bench/weight_sync.py's, 0.17 s at 0.5B).
  lora    `LLM(model, enable_lora=True, max_lora_rank=R, max_loras=1)`, every request with
          `LoRARequest("policy", 1, adapter)`: a peft adapter (rank R, alpha R, all linear layers, built as
          components/lora.py's apply_lora does; float32 as the actor's adapters) whose lora_B are seeded
          randn * 1e-3, so it is not a no-op. Then its per-step hand-over: `remove_s` is
          llm_engine.remove_lora(1) (the old adapter), `adapter_switch_s` the first generate (1 prompt,
          1 token) with a second adapter, LoRARequest("policy2", 2, dir2): vLLM loads it on first use;
          `tiny_generate_s` / `tiny_generate_loaded_s` that same tiny generate with the adapter already loaded
          (before the remove / after the switch): the part of the switch that is not the load.
A row (one mode): N prompts of P random tokens (bench/rollout.py's random-letter text; on the byte-level
bench models one letter is one token), n samples each, exactly T new tokens (ignore_eos, min_tokens),
temperature 1, detokenize=False, seeded; `gen_s` the median generate() over --repeats after one warm-up
(other prompts, so the timed prefill is not a prefix-cache hit), `tokens_per_s` = N·n·T / gen_s,
`engine_start_s` the LLM() construction. `lora_over_merged` = lora tokens/s over merged tokens/s.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import shutil
import statistics
import string
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import emit, machine_info, make_random_model, write_result  # noqa: E402

MODES = ("merged", "lora")


def prompt_ids(tokenizer, count: int, tokens: int, seed: int) -> list[list[int]]:
    """`count` prompts of exactly `tokens` token ids: bench/rollout.py's text (seeded random lowercase letters and
    spaces; the same ids on the byte-level bench models), extended and cut for a tokenizer that merges."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(count):
        text, ids = "", []
        while len(ids) < tokens:
            text += "".join(rng.choice(string.ascii_lowercase + " ") for _ in range(tokens - len(ids)))
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        prompts.append(ids[:tokens])
    return prompts


def build_adapters(model_dir: str, targets: list[tuple[str, int]], rank: int, device: str = "cuda",
                   dtype=None) -> list[Path]:
    """A peft LoRA adapter of `model_dir` saved at each (folder, seed) of `targets`: rank `rank`, alpha `rank`,
    all linear layers, lora_B = randn * 1e-3 from `seed` (lora_A as peft initialises it). The model is
    loaded once and freed (CUDA cache emptied) before this returns, so an engine started next gets the memory."""
    import torch
    from transformers import AutoModelForCausalLM

    from components.lora import apply_lora

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype or torch.bfloat16).to(device)
    peft_model = apply_lora(model, rank=rank, alpha=rank, dropout=0.0, target_modules="all-linear")
    saved = []
    for folder, seed in targets:
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, parameter in peft_model.named_parameters():
                if "lora_B" in name:
                    parameter.copy_(torch.randn(parameter.shape, generator=generator) * 1e-3)
        peft_model.save_pretrained(folder)
        saved.append(Path(folder))
    del model, peft_model
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return saved


def run_mode(args) -> dict:
    """One engine of `args.mode`, measured as the module docstring says (runs in a child process)."""
    # vllm is imported here: the CPU side of the repo does not always have it (and it takes seconds)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from components.models import load_tokenizer

    lora = args.mode == "lora"
    result: dict = {"mode": args.mode}
    requests = {}
    if lora:
        from vllm.lora.request import LoRARequest

        work = Path(tempfile.mkdtemp(prefix="rlhf-bench-lora-"))
        begin = time.perf_counter()
        first, second = build_adapters(args.model, [(str(work / "policy"), 1), (str(work / "policy2"), 2)],
                                       args.rank)
        result["adapter_build_s"] = time.perf_counter() - begin
        requests = {"lora_request": LoRARequest("policy", 1, str(first))}
    tokenizer = load_tokenizer(args.model)
    kwargs = dict(model=args.model, dtype="bfloat16", seed=0, max_model_len=args.prompt_tokens + args.new_tokens,
                  gpu_memory_utilization=args.gpu_memory_utilization, **args.engine_kwargs)
    if lora:
        kwargs.update(enable_lora=True, max_lora_rank=args.rank, max_loras=1)
    begin = time.perf_counter()
    llm = LLM(**kwargs)
    result["engine_start_s"] = time.perf_counter() - begin
    cache = getattr(getattr(llm.llm_engine, "vllm_config", None), "cache_config", None)
    result["num_gpu_blocks"] = getattr(cache, "num_gpu_blocks", None)  # the KV cache each mode got (None: unknown)

    def generate(prompts, n: int, tokens: int, seed: int = 0, **extra) -> tuple[float, int]:
        sampling = SamplingParams(n=n, max_tokens=tokens, min_tokens=tokens, ignore_eos=True, temperature=1.0,
                                  detokenize=False, seed=seed)
        begin = time.perf_counter()
        outputs = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in prompts], sampling, use_tqdm=False,
                               **extra)
        return time.perf_counter() - begin, sum(len(c.token_ids) for o in outputs for c in o.outputs)

    generate(prompt_ids(tokenizer, args.prompts, args.prompt_tokens, seed=1), args.n, args.new_tokens, **requests)
    timed = prompt_ids(tokenizer, args.prompts, args.prompt_tokens, seed=0)
    runs = [generate(timed, args.n, args.new_tokens, **requests) for _ in range(args.repeats)]
    expected = args.prompts * args.n * args.new_tokens
    assert all(tokens == expected for _, tokens in runs), (runs, expected)
    result.update(gen_s=statistics.median(s for s, _ in runs), runs_s=[s for s, _ in runs], gen_tokens=expected)
    result["tokens_per_s"] = expected / result["gen_s"]
    if lora:  # the per-step hand-over of the LoRA path: drop the old adapter, serve the next one
        tiny = iter(prompt_ids(tokenizer, 3, args.prompt_tokens, seed=2))  # fresh prompts: no prefix-cache hit
        result["tiny_generate_s"] = generate([next(tiny)], 1, 1, **requests)[0]
        engine = llm.llm_engine
        result["loras_before_remove"] = sorted(engine.list_loras()) if hasattr(engine, "list_loras") else None
        result["remove_s"] = result["remove_returned"] = None
        if hasattr(engine, "remove_lora"):
            try:
                begin = time.perf_counter()
                result["remove_returned"] = engine.remove_lora(1)
                result["remove_s"] = time.perf_counter() - begin
            except Exception as error:  # noqa: BLE001 -- reported, not fatal: the switch is still measured
                result["remove_error"] = f"{type(error).__name__}: {error}"
        result["adapter_switch_s"] = generate([next(tiny)], 1, 1,
                                              lora_request=LoRARequest("policy2", 2, str(second)))[0]
        result["tiny_generate_loaded_s"] = generate([next(tiny)], 1, 1,
                                                    lora_request=LoRARequest("policy2", 2, str(second)))[0]
        result["loras_after_switch"] = sorted(engine.list_loras()) if hasattr(engine, "list_loras") else None
        shutil.rmtree(work, ignore_errors=True)
    return result


def run_child(args, mode: str, model_dir: str) -> dict:
    """This script again with --mode `mode`, in a fresh process; its result dict (or the failure)."""
    with tempfile.TemporaryDirectory(prefix="rlhf-bench-lora-child-") as tmp:
        out = Path(tmp) / "result.json"
        command = [sys.executable, str(Path(__file__).resolve()), "--mode", mode, "--model", model_dir,
                   "--prompts", str(args.prompts), "--n", str(args.n), "--prompt-tokens", str(args.prompt_tokens),
                   "--new-tokens", str(args.new_tokens), "--rank", str(args.rank), "--repeats", str(args.repeats),
                   "--gpu-memory-utilization", str(args.gpu_memory_utilization),
                   "--engine-kwargs", json.dumps(args.engine_kwargs), "--child-out", str(out)]
        begin = time.perf_counter()
        code = subprocess.run(command).returncode
        if code != 0 or not out.is_file():
            return {"mode": mode, "error": f"child exited {code}", "wall_s": time.perf_counter() - begin}
        return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model folder; default: --preset built in /tmp/rlhf-bench-models")
    parser.add_argument("--preset", default="qwen2.5-0.5b", help="components/tiny.py preset, used without --model")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=512)
    parser.add_argument("--rank", type=int, default=32, help="LoRA rank (alpha = rank); vLLM takes 8, 16, 32, 64, ...")
    parser.add_argument("--repeats", type=int, default=1, help="timed generate() calls after the warm-up (median)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    parser.add_argument("--engine-kwargs", type=json.loads, default={},
                        help="more vLLM LLM() settings as JSON, the same for both modes")
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated, of: " + ", ".join(MODES))
    parser.add_argument("--out", default=None, help="write the JSON result here")
    parser.add_argument("--mode", choices=MODES, default=None, help=argparse.SUPPRESS)  # a child's one mode
    parser.add_argument("--child-out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.mode:  # a child: one engine, its result to --child-out
        write_result(run_mode(args), args.child_out)
        return
    modes = [mode.strip() for mode in args.modes.split(",") if mode.strip()]
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        parser.error(f"--modes: unknown {unknown}; known: {list(MODES)}")
    model_dir = args.model or str(make_random_model(f"/tmp/rlhf-bench-models/{args.preset}", args.preset))
    results = {mode: run_child(args, mode, model_dir) for mode in modes}
    merged, lora = results.get("merged", {}), results.get("lora", {})
    ratio = (lora["tokens_per_s"] / merged["tokens_per_s"]
             if "tokens_per_s" in lora and "tokens_per_s" in merged else None)
    for mode, row in results.items():
        print(f"{mode:>6}: " + ", ".join(f"{key}={value:.4g}" if isinstance(value, float) else f"{key}={value}"
                                         for key, value in row.items() if key not in ("mode", "runs_s")))
    print(f"lora / merged tokens/s: {ratio:.3f}" if ratio is not None else "lora / merged tokens/s: n/a")
    emit({"bench": "lora_serving", "args": vars(args), "model": model_dir, **results, "lora_over_merged": ratio,
          "machine": machine_info()}, args.out)  # machine_info after the children: no CUDA context held during them


if __name__ == "__main__":
    main()
    os._exit(0)  # vLLM's helper processes are gone; skip slow interpreter teardown
