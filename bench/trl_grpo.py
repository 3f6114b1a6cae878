"""Baseline: TRL's GRPOTrainer (trl 1.16.0) with vLLM colocated, on a Qwen2.5-0.5B-shaped random bf16 model.

Precision: by default (--train-dtype float32) the trained model holds float32 parameters and optimizer state and
computes under bf16 autocast (`bf16=True`), which is TRL's own default and the same fidelity as the product's
fp32 master weights with bf16 compute (bench/step.py). --train-dtype bfloat16 trains bf16 parameters directly.

Every training step generates prompts × n fresh completions with the in-process vLLM engine, scores them,
and takes exactly one optimizer step over them (micro-batches of --micro-batch, gradients accumulated).
Prompts are exactly --prompt-tokens tokens and completions exactly --response-tokens tokens (vLLM
`min_tokens` = `max_tokens` and `ignore_eos`), so every step does the same work. Wall seconds per step
are taken from a TrainerCallback (on_step_begin → on_step_end, CUDA synchronized); the first --warmup
steps are dropped.

How far training moved the weights: the trainable parameters are copied to the CPU in float32 after the
trainer's init, right before `trainer.train()`, and compared with the trained ones afterwards
(bench.common.compare_weights: `weights_changed_fraction`, `weights_mean_abs_delta`, `weights_rms_ratio`). The
change spans every optimizer step, the --warmup ones included, as bench/step.py's comparison does.

    python bench/trl_grpo.py --out bench/results/trl_grpo.json          # the GPU baseline (defaults)
    python bench/trl_grpo.py --device cpu --preset tiny --prompts 2 --n 2 --prompt-tokens 8 \\
        --response-tokens 8 --steps 2 --warmup 1 --micro-batch 2 --model-dir /tmp/bench-tiny   # smoke test

Run it with plain `python` (one process, one GPU): torch.distributed variables get single-process defaults.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import string
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from trl_common import one_round_grpo_config, set_single_process_env  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", default=".rlhf/models/qwen2.5-0.5b-shaped-bf16",
                        help="model folder; built with bench.common.make_random_model(--preset) when missing")
    parser.add_argument("--preset", default="qwen2.5-0.5b", help="components/tiny.py preset for a missing --model-dir")
    parser.add_argument("--prompts", type=int, default=64, help="distinct prompts per step")
    parser.add_argument("--n", type=int, default=8, help="completions per prompt (GRPO group size)")
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--response-tokens", type=int, default=512)
    parser.add_argument("--steps", type=int, default=4, help="measured optimizer steps")
    parser.add_argument("--warmup", type=int, default=1, help="optimizer steps run first and not measured")
    parser.add_argument("--micro-batch", type=int, default=16, help="sequences per forward/backward")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.3,
                        help="vLLM's share of the device memory (of CPU memory with --device cpu)")
    parser.add_argument("--train-dtype", default="float32", choices=["float32", "bfloat16"],
                        help="parameter (and optimizer state) dtype of the trained model. float32 (default): TRL's "
                             "own default, float32 weights computing under bf16 autocast (bf16=True), the fidelity "
                             "of the product's fp32 master weights; bfloat16: pure bf16 training, which loses AdamW "
                             "updates below half a bf16 ulp")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                        help="cpu: TrainingArguments(use_cpu=True) and vLLM's CPU backend, for smoke tests")
    parser.add_argument("--no-matmul", action="store_true", help="skip the bf16 matmul TFLOP/s measurement")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="write the result JSON here")
    args = parser.parse_args(argv)
    total = args.prompts * args.n
    if args.n < 2:
        parser.error("--n must be at least 2 (GRPO needs a group)")
    if total % args.micro_batch:
        parser.error(f"--micro-batch {args.micro_batch} must divide prompts × n = {total}")
    if args.steps < 1 or args.warmup < 0:
        parser.error("--steps must be >= 1 and --warmup >= 0")
    return args


def build_prompts(tokenizer, count: int, length: int, seed: int) -> list[str]:
    """`count` distinct plain-text prompts that the tokenizer encodes to exactly `length` tokens each.

    Random lowercase words; the byte-level tokenizer of components/tiny.py gives one token per
    character. The length is checked with the same call TRL makes for non-chat prompts
    (`processing_class(text=prompts)["input_ids"]`, grpo_trainer.py `_tokenize_prompts`).
    """
    rng = random.Random(seed)
    alphabet = string.ascii_lowercase
    prompts = []
    for _ in range(count):
        chars = []
        while len(chars) < length:
            word = "".join(rng.choice(alphabet) for _ in range(rng.randint(2, 8)))
            chars.extend(word + " ")
        text = "".join(chars[:length])
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) != length:  # a merging tokenizer: cut the ids and decode them back
            text = tokenizer.decode(ids[:length])
        prompts.append(text)
    lengths = [len(ids) for ids in tokenizer(text=prompts)["input_ids"]]
    bad = [n for n in lengths if n != length]
    if bad:
        raise RuntimeError(f"{len(bad)} of {count} prompts do not encode to {length} tokens (e.g. {bad[:3]})")
    return prompts


def digit_fraction_reward(completions, **kwargs) -> list[float]:
    """A trivial, cheap reward: the fraction of characters that are digits."""
    return [sum(ch.isdigit() for ch in text) / max(len(text), 1) for text in completions]


def make_grpo_config(args: argparse.Namespace, output_dir: str):
    """The GRPOConfig of this benchmark (see bench/README.md for why each knob is what it is)."""
    return one_round_grpo_config(
        output_dir, prompts=args.prompts, n=args.n, micro_batch=args.micro_batch, device=args.device, seed=args.seed,
        max_steps=args.warmup + args.steps,
        # Generation: fixed-length completions.
        vllm_gpu_memory_utilization=args.gpu_memory_utilization,
        vllm_max_model_length=args.prompt_tokens + args.response_tokens,
        max_completion_length=args.response_tokens,
        generation_kwargs={"min_tokens": args.response_tokens, "ignore_eos": True},
        temperature=1.0,
        learning_rate=1e-6,
        beta=0.0,  # TRL's default: no reference model
        model_init_kwargs={"dtype": args.train_dtype},
    )


CONFIG_FIELDS = (
    "per_device_train_batch_size", "gradient_accumulation_steps", "steps_per_generation", "generation_batch_size",
    "num_generations", "num_iterations", "max_steps", "max_completion_length", "generation_kwargs", "temperature",
    "top_p", "top_k", "use_vllm", "vllm_mode", "vllm_gpu_memory_utilization", "vllm_max_model_length",
    "vllm_enable_sleep_mode", "vllm_importance_sampling_correction", "vllm_importance_sampling_mode", "beta",
    "loss_type", "scale_rewards", "epsilon", "learning_rate", "lr_scheduler_type", "optim", "max_grad_norm",
    "bf16", "gradient_checkpointing", "model_init_kwargs", "use_cpu", "world_size", "seed",
)


def _instrument(trainer, timings: dict, sync) -> None:
    """Wrap the trainer's generation entry points to split each step into phases (seconds, summed per step)."""
    def wrap(owner, name, key):
        original = getattr(owner, name)

        def timed(*a, **kw):
            sync()
            start = time.perf_counter()
            try:
                return original(*a, **kw)
            finally:
                sync()
                timings[key] = timings.get(key, 0.0) + time.perf_counter() - start

        setattr(owner, name, timed)

    wrap(trainer, "_generate_and_score_completions", "generate_and_score_s")
    wrap(trainer.vllm_generation, "generate", "vllm_generate_s")
    wrap(trainer.vllm_generation, "sync_weights", "sync_weights_s")


def main(argv=None) -> dict:
    args = parse_args(argv)
    # One process drives one GPU: TRL refuses nn.DataParallel over several visible GPUs.
    if args.device == "cuda":
        os.environ.setdefault("CUDA_VISIBLE_DEVICES", "0")

    import torch
    from common import (compare_weights, emit, forward_flops_per_token, machine_info, make_random_model,
                        markdown_table, measure_bf16_matmul_tflops, package_version, train_flops_per_token)

    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA device: use --device cpu for a smoke test")
    cuda = args.device == "cuda"

    def sync():
        if cuda:
            torch.cuda.synchronize()

    matmul_tflops = None if (args.no_matmul or not cuda) else measure_bf16_matmul_tflops("cuda")

    t0 = time.perf_counter()
    model_dir = Path(args.model_dir)
    if not (model_dir / "config.json").is_file():
        make_random_model(str(model_dir), args.preset)
    model_build_s = time.perf_counter() - t0

    from datasets import Dataset
    from transformers import AutoConfig, AutoTokenizer, TrainerCallback
    from trl import GRPOTrainer

    model_config = AutoConfig.from_pretrained(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir, padding_side="left", truncation_side="left")
    total_steps = args.warmup + args.steps
    # One distinct set of prompts per step: the sampler walks the dataset once (one epoch = all steps).
    prompts = build_prompts(tokenizer, args.prompts * total_steps, args.prompt_tokens, args.seed)
    dataset = Dataset.from_dict({"prompt": prompts})

    output_dir = tempfile.mkdtemp(prefix="trl-grpo-bench-")
    grpo_config = make_grpo_config(args, output_dir)
    dist_env = set_single_process_env()

    records: list[dict] = []
    log_rows: list[dict] = []
    phase: dict = {}

    class StepTimer(TrainerCallback):
        def on_step_begin(self, targs, state, control, **kwargs):
            if state.global_step == args.warmup and cuda:
                torch.cuda.reset_peak_memory_stats()
            phase.clear()
            sync()
            self.start = time.perf_counter()

        def on_step_end(self, targs, state, control, **kwargs):
            sync()
            seconds = time.perf_counter() - self.start
            record = {"step": state.global_step, "seconds": seconds, "warmup": state.global_step <= args.warmup}
            record.update({key: round(value, 4) for key, value in phase.items()})
            if "generate_and_score_s" in phase:
                record["update_s"] = seconds - phase["generate_and_score_s"]
            if cuda:
                free, total = torch.cuda.mem_get_info()
                record["max_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
                record["max_reserved_gib"] = torch.cuda.max_memory_reserved() / 2**30
                record["device_used_gib"] = (total - free) / 2**30
            records.append(record)
            print(f"[bench] step {state.global_step}: {seconds:.3f} s {dict(sorted(phase.items()))}", flush=True)

        def on_log(self, targs, state, control, logs=None, **kwargs):
            if logs:
                log_rows.append({**logs, "step": state.global_step})

    t1 = time.perf_counter()
    trainer = GRPOTrainer(
        model=str(model_dir),
        reward_funcs=digit_fraction_reward,
        args=grpo_config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[StepTimer()],
    )
    trainer_init_s = time.perf_counter() - t1
    # Policy weights + vLLM (its weights and the KV cache it reserved): what stays allocated between steps.
    allocated_after_init_gib = torch.cuda.memory_allocated() / 2**30 if cuda else None
    weight_sync = "trl"
    if not cuda:
        # vLLM's CPU backend repacks every linear weight for oneDNN after loading and drops the original
        # Parameter (vllm/model_executor/layers/utils.py, dispatch_cpu_unquantized_gemm(remove_weight=True)),
        # so TRL's in-place colocate sync (`model_runner.model.load_weights`) fails there with
        # "'Parameter' object has no attribute 'weight_loader'". On CUDA the weights stay as loaded.
        # The CPU smoke test therefore generates with the initial weights.
        trainer.vllm_generation.sync_weights = lambda: None
        weight_sync = "skipped (vLLM CPU backend cannot reload weights in place)"
    _instrument(trainer, phase, sync)

    # The weights before any optimizer step, on the CPU in float32 (copy=True: on the CPU `.to` could return
    # the live parameter itself). Taken here, after the trainer's init and before train(), so the comparison
    # spans all warmup + steps optimizer steps, warm-up included -- as bench/step.py compares the initial
    # model with its checkpoint after the last of its warmup + steps steps.
    t_snapshot = time.perf_counter()
    initial_weights = {name: parameter.detach().to("cpu", torch.float32, copy=True)
                       for name, parameter in trainer.model.named_parameters() if parameter.requires_grad}
    weights_snapshot_s = time.perf_counter() - t_snapshot

    t2 = time.perf_counter()
    trainer.train()
    train_wall_s = time.perf_counter() - t2

    t_compare = time.perf_counter()
    weight_change = compare_weights(
        initial_weights, {name: parameter for name, parameter in trainer.model.named_parameters()
                          if parameter.requires_grad})
    del initial_weights
    weight_change["weights_compare_s"] = time.perf_counter() - t_compare
    weight_change["weights_snapshot_s"] = weights_snapshot_s

    measured = [r for r in records if not r["warmup"]]
    if len(measured) != args.steps:
        raise RuntimeError(f"expected {args.steps} measured steps, timed {len(measured)}: {records}")
    step_seconds = [r["seconds"] for r in measured]
    mean_step = statistics.fmean(step_seconds)
    sequences = args.prompts * args.n
    generated_tokens = sequences * args.response_tokens

    # Completion lengths TRL itself logged: every completion must be exactly --response-tokens long.
    lengths = [(log.get("completions/min_length"), log.get("completions/max_length")) for log in log_rows
               if "completions/min_length" in log]
    lengths_ok = bool(lengths) and all(lo == hi == args.response_tokens for lo, hi in lengths)

    def mean_of(key):
        values = [r[key] for r in measured if key in r]
        return statistics.fmean(values) if values else None

    seq_len = args.prompt_tokens + args.response_tokens
    head_per_token = 6.0 * model_config.hidden_size * model_config.vocab_size
    # Gradient step: all seq_len positions through the body, the LM head only on the completion tokens
    # (TRL passes logits_to_keep = completion length). The no-grad log-prob pass is a third of that.
    update_flop = sequences * (seq_len * (train_flops_per_token(model_config, seq_len) - head_per_token)
                               + args.response_tokens * head_per_token)
    logprob_flop = update_flop / 3.0
    num_parameters = sum(p.numel() for p in trainer.model.parameters())

    result = {
        "bench": "trl_grpo",
        "trl_version": package_version("trl"),
        "knobs": {key: value for key, value in vars(args).items() if key != "out"},
        "grpo_config": {key: getattr(getattr(grpo_config, key, None), "value", getattr(grpo_config, key, None))
                        for key in CONFIG_FIELDS},
        "model": {"dir": str(model_dir), "preset": args.preset, "parameters": num_parameters,
                  "config_dtype": str(getattr(model_config, "dtype", None) or getattr(model_config, "torch_dtype", None)),
                  "param_dtype": str(next(trainer.model.parameters()).dtype), "vocab_size": model_config.vocab_size,
                  "forward_flops_per_token": forward_flops_per_token(model_config, seq_len),
                  "train_flops_per_token": train_flops_per_token(model_config, seq_len)},
        "sequences_per_step": sequences,
        "generated_tokens_per_step": generated_tokens,
        "mean_step_s": mean_step,
        "median_step_s": statistics.median(step_seconds),
        "min_step_s": min(step_seconds),
        "max_step_s": max(step_seconds),
        "generated_tokens_per_s": generated_tokens / mean_step,
        "trained_tokens_per_s": sequences * seq_len / mean_step,
        "phases_mean_s": {key: mean_of(key) for key in
                          ("sync_weights_s", "vllm_generate_s", "generate_and_score_s", "update_s")},
        "update_model_tflop_per_step": update_flop / 1e12,
        "logprob_model_tflop_per_step": logprob_flop / 1e12,
        "update_tflops_per_s": None,
        "bf16_matmul_tflops": matmul_tflops,
        "peak_gpu_mem_allocated_gib": max((r.get("max_allocated_gib", 0) for r in measured), default=None) if cuda else None,
        "peak_gpu_mem_reserved_gib": max((r.get("max_reserved_gib", 0) for r in measured), default=None) if cuda else None,
        "allocated_after_init_gib": allocated_after_init_gib,
        "peak_device_used_gib": max((r.get("device_used_gib", 0) for r in measured), default=None) if cuda else None,
        "completion_lengths_ok": lengths_ok,
        "completion_lengths_logged": lengths,
        "model_build_s": model_build_s,
        "trainer_init_s": trainer_init_s,
        "train_wall_s": train_wall_s,
        "steps": records,
        "trl_logs": log_rows,
        "dist_env": dist_env,
        "weight_sync": weight_sync,
        "machine": machine_info(),
        **weight_change,
    }
    update_s = result["phases_mean_s"]["update_s"]
    if update_s:
        # Model FLOPs of the no-grad log-prob pass (inside generate_and_score) are not in update_s.
        result["update_tflops_per_s"] = update_flop / update_s / 1e12

    row = {"mean step s": mean_step, "median step s": result["median_step_s"],
           "gen tok/s": result["generated_tokens_per_s"],
           "vllm gen s": result["phases_mean_s"]["vllm_generate_s"],
           "gen+score s": result["phases_mean_s"]["generate_and_score_s"],
           "update s": update_s, "update TFLOP/s": result["update_tflops_per_s"],
           "peak alloc GiB": result["peak_gpu_mem_allocated_gib"],
           "device used GiB": result["peak_device_used_gib"], "lengths ok": lengths_ok,
           "weights changed": weight_change["weights_changed_fraction"],
           "mean |Δw|": weight_change["weights_mean_abs_delta"],
           "weights RMS ratio": weight_change["weights_rms_ratio"]}
    print()
    print(f"TRL {result['trl_version']} GRPO, vLLM colocate, {args.prompts} prompts × {args.n} × "
          f"({args.prompt_tokens}+{args.response_tokens}) tokens, micro-batch {args.micro_batch}, "
          f"{args.steps} measured steps after {args.warmup} warm-up, {args.device}")
    print(markdown_table([row], list(row)))
    print()
    emit(result, args.out)
    if not lengths_ok:
        print(f"WARNING: completion lengths were not all {args.response_tokens}: {lengths}", file=sys.stderr)
    return result


if __name__ == "__main__":
    main()
    # The result is printed and written: leave without interpreter teardown, where the in-process vLLM
    # engine and its process group can hang or print noise.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
