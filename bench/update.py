"""The actor's PPO/GRPO update alone, on the GPU, with bench/step.py's knobs: seconds, MFU, peak memory.

    python bench/update.py                                  # 512 x (256 + 512) tokens, micro-batch 16
    python bench/update.py --set model.compile=true         # config overrides, as in bench/step.py
    python bench/update.py --profile                        # + where the GPU time of one update goes
    python bench/update.py --device cpu --preset tiny --samples 8 --prompt-tokens 8 --response-tokens 8 \
        --micro-batch 4                                     # smoke test of the script
    python bench/update.py --natural --steps 9 --prompt-tokens 16 --response-tokens 16 --micro-batch 64
                                                            # a new batch of natural lengths each update: when the
                                                            # compiled blocks compile again (--align 1: no alignment)

No Prefect, MLflow or vLLM: it builds the actor the way the actor role does (`flows.training.roles`), feeds it
one fixed random batch (every prompt and response full length, advantages ~ N(0, 1), the engine's
log-probs for 1 sample in 8 as in `rollout.logprobs_fraction`) and times `Actor.update` with CUDA
synchronised around it. Steps after --warmup are averaged; the first holds any compilation. `--natural`: each
update a new batch whose prompts and responses have random real lengths (1 to the given tokens), as a run's
batches do; each update's graphs compiled (torch's counter) are printed, so a compile after the first shows.

MFU: the update's model FLOPs (`bench.step.update_flops`, counted as bench/trl_grpo.py does) over the
bf16 matmul rate measured on this GPU. `--profile` records one more update with torch.profiler and
splits the GPU kernel time into matmuls, attention, the fused log-prob kernels, the optimizer and
the rest (elementwise, norms, copies), with the GPU's idle share of the wall time.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parent.parent))  # appended: a PYTHONPATH first wins (A/B runs)

from bench.common import emit, machine_info, make_random_model, markdown_table, measure_bf16_matmul_tflops  # noqa: E402

KERNEL_GROUPS = (  # (group, substrings of the kernel name), first match wins
    ("optimizer", ("adam", "multi_tensor", "foreach", "norm_kernel", "clip")),
    ("matmul", ("gemm", "cutlass", "nvjet", "sm90_xmma", "cublas", "matmul", "splitk")),
    ("attention", ("flash", "fmha", "attention", "efficient_attention")),
    ("log-prob kernel", ("forward_kernel", "backward_kernel")),
    ("compiled (inductor)", ("triton_",)),
)


def kernel_group(name: str) -> str:
    lowered = name.lower()
    for group, needles in KERNEL_GROUPS:
        if any(needle in lowered for needle in needles):
            return group
    return "other (elementwise, norms, copies)"


def synthetic_batch(samples: int, prompt_tokens: int, response_tokens: int, vocab: int, seed: int = 0,
                    natural: bool = False):
    import torch

    from components.batch import build_sequence_batch

    generator = torch.Generator().manual_seed(seed)
    prompts = torch.randint(0, vocab, (samples, prompt_tokens), generator=generator).tolist()
    responses = torch.randint(0, vocab, (samples, response_tokens), generator=generator).tolist()
    if natural:  # real lengths 1 .. the given tokens, as a run's batches (left-padded prompts, right-padded answers)
        prompts = [row[:int(torch.randint(1, prompt_tokens + 1, (), generator=generator))] for row in prompts]
        responses = [row[:int(torch.randint(1, response_tokens + 1, (), generator=generator))] for row in responses]
    batch = build_sequence_batch(prompts, responses, pad_token_id=0)
    response_tokens = batch.response_length
    advantages = torch.randn(samples, 1, generator=generator).expand(samples, response_tokens).contiguous()
    engine = torch.full((samples, response_tokens), float("nan"))
    engine[::8] = -torch.rand(len(range(0, samples, 8)), response_tokens, generator=generator) * 5
    return batch, advantages * batch.response_mask, engine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="qwen2.5-0.5b")
    parser.add_argument("--model-dir", default=None)
    parser.add_argument("--samples", type=int, default=512)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--response-tokens", type=int, default=512)
    parser.add_argument("--micro-batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=3, help="measured updates after the warm-up")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="config override, repeatable (model.compile=true, model.fused_logprobs=false, ...)")
    parser.add_argument("--label", default=None, help="the row's name in the table")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--natural", action="store_true", help="each update a new batch of random real lengths")
    parser.add_argument("--align", type=int, default=None,
                        help="components.batch.ALIGNED for this run (1: the cut lengths unaligned, as before 8)")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    import torch
    from transformers import AutoConfig

    import components
    from bench.step import update_flops
    from components.models import compiled_graphs
    from flows.config import build_config
    from flows.training.roles import _build_actor

    if args.align is not None:
        import components.batch

        components.batch.ALIGNED = args.align
    model_dir = make_random_model(args.model_dir or f"/tmp/rlhf-bench-models/{args.preset}", args.preset)
    samples = args.samples
    config = build_config({
        "model": {"path": str(model_dir), "dtype": "bfloat16" if args.device == "cuda" else "float32"},
        "data": {"prompts_per_step": max(1, samples // 8), "max_prompt_length": args.prompt_tokens},
        "rollout": {"n": 8, "max_new_tokens": args.response_tokens},
        "actor": {"optim": {"lr": 1e-6}, "ppo_mini_batch_size": max(1, samples // 8), "micro_batch_size": args.micro_batch,
                  "use_kl_loss": False},
        "algorithm": {"adv_estimator": "grpo"},
        "trainer": {"device": args.device},
    }, overrides=args.set)
    peak_tflops = measure_bf16_matmul_tflops() if args.device == "cuda" else None
    actor = _build_actor(config)
    model_config = AutoConfig.from_pretrained(model_dir)
    fixed = synthetic_batch(samples, args.prompt_tokens, args.response_tokens, model_config.vocab_size)
    batches = (lambda index: synthetic_batch(samples, args.prompt_tokens, args.response_tokens,
                                             model_config.vocab_size, seed=index, natural=True)) if args.natural \
        else (lambda index: fixed)
    graphs = []  # graphs compiled by each update (torch's counter): > 0 after the first is a compile again

    def update(index: int = 0) -> tuple[float, dict]:
        batch, advantages, engine_logprobs = batches(index)
        before = compiled_graphs()
        if args.device == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        metrics = actor.update(batch, old_logprobs=None, advantages=advantages, rollout_logprobs=engine_logprobs)
        if args.device == "cuda":
            torch.cuda.synchronize()
        graphs.append(compiled_graphs() - before)
        return time.perf_counter() - started, metrics

    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = []
    for index in range(args.warmup + args.steps):
        seconds, metrics = update(index)
        times.append(seconds)
        print(f"update {index}: {seconds:.3f} s  pg_loss {metrics['actor/pg_loss']:.4f}  "
              f"gap {metrics.get('rollout/logprob_diff_mean', float('nan')):.3f}  graphs compiled {graphs[-1]}",
              flush=True)
    measured = times[args.warmup:]
    update_s = statistics.mean(measured)
    flops = update_flops(model_config, samples, args.prompt_tokens, args.response_tokens)
    tflops = None if args.natural else flops / update_s / 1e12  # natural: fewer FLOPs than counted
    per_update = list(graphs)  # before a profiled update adds its own
    result = {
        "bench": "update", "label": args.label or (", ".join(args.set) or "defaults"),
        "code": str(Path(components.__file__).resolve().parent.parent),
        "update_s": update_s, "update_s_all": times, "graphs_per_update": per_update, "update_tflops": tflops,
        "matmul_peak_tflops": peak_tflops, "update_mfu": tflops / peak_tflops if tflops and peak_tflops else None,
        "peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30 if args.device == "cuda" else None,
        "args": vars(args), "machine": machine_info(),
    }
    if args.profile and args.device == "cuda":
        result["profile"] = profile_update(update)
    print(markdown_table([{
        "run": result["label"], "update s": f"{update_s:.3f}",
        "TFLOP/s": f"{result['update_tflops']:.1f}" if result["update_tflops"] else "",
        "MFU": f"{result['update_mfu']:.3f}" if result["update_mfu"] else "",
        "peak GiB": f"{result['peak_allocated_gib']:.1f}" if result["peak_allocated_gib"] else "",
    }], ["run", "update s", "TFLOP/s", "MFU", "peak GiB"]))
    print(f"graphs compiled after the first update: {sum(per_update[1:])} "
          f"(in updates {[index for index, added in enumerate(per_update) if index and added]})")
    if "profile" in result:
        profile = result["profile"]
        print(f"profiled update: wall {profile['wall_s']:.3f} s, GPU kernels {profile['kernel_s']:.3f} s "
              f"(idle {profile['idle_share']:.1%})")
        print(markdown_table([{"kernels": group, "s": f"{seconds:.3f}", "share": f"{seconds / profile['kernel_s']:.1%}"}
                              for group, seconds in profile["groups_s"].items()], ["kernels", "s", "share"]))
    emit(result, args.out)


def profile_update(update) -> dict:
    """One update under torch.profiler: kernel seconds per group, and the GPU's idle share of the wall."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as profiler:
        wall_s, _ = update()
    groups: dict[str, float] = {}
    top: dict[str, float] = {}
    kernel_s = 0.0
    for event in profiler.events():
        if event.device_type.name != "CUDA":
            continue
        seconds = event.device_time / 1e6  # microseconds
        kernel_s += seconds
        group = kernel_group(event.name)
        groups[group] = groups.get(group, 0.0) + seconds
        top[event.name[:90]] = top.get(event.name[:90], 0.0) + seconds
    return {"wall_s": wall_s, "kernel_s": kernel_s, "idle_share": max(0.0, 1 - kernel_s / wall_s),
            "groups_s": dict(sorted(groups.items(), key=lambda item: -item[1])),
            "top_kernels_s": dict(sorted(top.items(), key=lambda item: -item[1])[:25])}


if __name__ == "__main__":
    main()
    os._exit(0)
