"""Training-step throughput of the product on a Qwen2.5-shaped model (0.5B by default), with fixed knobs.

    python bench/step.py --algorithm grpo --gpus 1            # every role on one GPU, one process
    python bench/step.py --algorithm ppo --gpus 1
    python bench/step.py --algorithm grpo --gpus 2            # rollout on GPU 0, training roles on GPU 1
    python bench/step.py --algorithm grpo --gpus 1 --workers  # one GPU, each role in a worker of its own
    python bench/step.py --preset qwen2.5-3b                  # the Qwen2.5-3B shape (model dir follows the preset)
    python bench/step.py --table out/*.json                   # one table from saved results (TRL's too)

Knobs (defaults): 64 prompts x 8 samples, 256 prompt tokens, 512 response tokens (fixed length:
ignore_eos), one optimizer step per training step (mini-batch = 512 samples), micro-batch 16, bf16
compute with fp32 master weights and optimizer state (model.compute_dtype=bfloat16,
model.master_dtype=float32; float32 throughout on the CPU), random weights, rule reward (--reward digits: the
fraction of digits in the response, bench/trl_grpo.py's reward, so group advantages are not all zero). GRPO runs no
reference model (no KL term, like TRL's default beta=0); PPO adds the critic (GAE). It runs the real
flow (Prefect, MLflow, Parquet stages; vLLM rollout) through `flows.training.run.run_training` and reads the
per-stage timings back from MLflow.

Reported: per-stage seconds and step seconds (mean over the steps after --warmup), generated
tokens/s and samples/s, the actor update's model FLOPs utilisation against the bf16 matmul rate
measured on this GPU (FLOPs: `update_flops`, counted as bench/trl_grpo.py does), and each GPU's peak used
memory (NVML, sampled every 0.2 s: includes vLLM's reservation).

How far training moved the actor: one checkpoint is written after the last step (trainer.checkpoint_every =
warm-up + steps; outside timing_s/step) holding the fp32 master weights; it is compared with the initial
model (model dir, bf16 upcast to float32) tensor by tensor: `weights_changed_fraction` (elements that
differ), `weights_mean_abs_delta` (mean |Δw|), `weights_rms_ratio` (RMS(Δw) / RMS(w0)). These span every
optimizer step of the run, warm-up included, as bench/trl_grpo.py's do. `update_rms_ratio` is the flow's
per-step `actor/update_rms_ratio` (RMS of one optimizer step's change / RMS of the weights), after warm-up.
The run's work folder (checkpoint included: about 36 GB for 3B with Adam state) is deleted at the end
unless --keep-work.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import (  # noqa: E402
    LoraMergedWeights,
    SafetensorsWeights,
    compare_weights,
    emit,
    machine_info,
    make_random_model,
    markdown_table,
    measure_bf16_matmul_tflops,
    train_flops_per_token,
    write_result,
)
from bench.rollout import write_fixed_prompts  # noqa: E402

STAGES = ("gen", "weight_sync", "reward", "old_log_prob", "ref", "values", "adv", "update_actor", "update_critic",
          "save_weights", "send_weights")


class GpuMemorySampler:
    """Peak used memory of every visible GPU (NVML), whatever process holds it."""

    def __init__(self, interval_s: float = 0.2):
        self.interval_s, self.peaks, self._stop = interval_s, {}, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        try:
            import pynvml

            from components.devices import inventory_from_system

            pynvml.nvmlInit()
            gpus = inventory_from_system().gpus
            handles = {gpu.index: pynvml.nvmlDeviceGetHandleByIndex(gpu.physical_index) for gpu in gpus}
        except Exception as error:  # noqa: BLE001 - a benchmark without memory numbers still has its timings
            print(f"GPU memory sampling off: {error}")
            return
        while not self._stop.is_set():
            for index, handle in handles.items():
                used = pynvml.nvmlDeviceGetMemoryInfo(handle).used / 2**30
                self.peaks[index] = max(self.peaks.get(index, 0.0), used)
            time.sleep(self.interval_s)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def product_config(args, model_dir: Path, data: Path, work: Path) -> dict:
    grpo = args.algorithm == "grpo"
    config = {
        "run": {"name": f"bench-{args.algorithm}-{args.gpus}gpu{'-ahead' if args.one_step_ahead else ''}"
                        f"{'-workers' if args.workers else ''}",
                "storage_root": str(work / "runs")},
        # fp32 master weights and optimizer state with bf16 compute (autocast) on GPUs; float32 on the CPU.
        "model": {"path": str(model_dir), "compute_dtype": "bfloat16" if args.device == "cuda" else "float32",
                  "master_dtype": "float32", "attn_implementation": args.attn},
        "data": {"train_files": [str(data)], "val_files": [str(data)], "max_prompt_length": args.prompt_tokens,
                 "prompts_per_step": args.prompts, "max_val_prompts": 8},
        "rollout": {"engine": "vllm", "n": args.n, "max_new_tokens": args.response_tokens, "ignore_eos": True,
                    "temperature": 1.0, **({} if args.device == "cuda" else {"kv_cache_gib": 1.0})},
        "actor": {"optim": {"lr": 1e-6}, "ppo_mini_batch_size": args.prompts,
                  "micro_batch_size": args.micro_batch, "use_kl_loss": False},
        "critic": {"optim": {"lr": 1e-6}, "ppo_mini_batch_size": args.prompts,
                   "micro_batch_size": args.micro_batch},
        "algorithm": {"adv_estimator": "grpo" if grpo else "gae"},
        # digits: TRL's bench reward. exact_match against the prompts' ground truth "0" scores 0 for every random
        # response: all GRPO advantages 0, so the actor would not move and the weight comparison would say nothing.
        "reward": {"kind": "rule",
                   "function": "bench.common:digit_fraction" if args.reward == "digits" else args.reward},
        # One checkpoint, after the last step (outside timing_s/step): the actor's fp32 weights to compare.
        "trainer": {"total_steps": args.warmup + args.steps, "val_every": 0,
                    "checkpoint_every": args.warmup + args.steps,
                    "one_step_ahead": args.one_step_ahead,
                    "device": args.device, "execution": "workers" if args.gpus > 1 or args.workers else "local"},
        "tracking": {"tracking_uri": f"sqlite:///{work}/mlflow.db", "experiment": "bench"},
    }
    if args.gpus == 2:
        training = ["actor"] if grpo else ["actor", "critic"]
        config["placement"] = {"roles": {"rollout": [0], **{role: [1] for role in training}, "reward": "cpu"},
                               "colocate": [training] if len(training) > 1 else []}
    elif args.workers:  # one GPU shared by workers of their own (the rollout's engine sleeps while they train)
        training = ["actor"] if grpo else ["actor", "critic"]
        gpu = [0] if args.device == "cuda" else "cpu"
        config["placement"] = {"roles": {"rollout": gpu, **{role: gpu for role in training}, "reward": "cpu"},
                               "colocate": [["rollout", *training]] if args.device == "cuda" else []}
    return config


def update_flops(model_config, sequences: int, prompt_tokens: int, response_tokens: int) -> float:
    """Model FLOPs of one update pass (forward + backward) over the batch: every position through the
    body, the LM head only where a response token is predicted (the actor keeps only those logits, as
    TRL does with logits_to_keep; bench/trl_grpo.py counts the same way)."""
    seq_len = prompt_tokens + response_tokens
    head = 6.0 * model_config.hidden_size * model_config.vocab_size
    return sequences * (seq_len * (train_flops_per_token(model_config, seq_len) - head) + response_tokens * head)


def parameter_count(model_config) -> int:
    """Parameters of the model (a tied LM head counted once), built on the meta device: no memory."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(model_config)
    return sum(parameter.numel() for parameter in model.parameters())


def final_actor_weights(run_dir: str, total_steps: int) -> tuple[int | None, Path | None]:
    """(step, folder) of the newest committed actor checkpoint in `run_dir` (expected at `total_steps`)."""
    checkpoints = Path(run_dir) / "checkpoints"
    steps = sorted((int(p.name) for p in checkpoints.glob("*") if p.name.isdigit() and (p / "actor").is_dir()),
                   reverse=True) if checkpoints.is_dir() else []
    if not steps:
        return None, None
    if steps[0] != total_steps:
        print(f"WARNING: newest actor checkpoint is step {steps[0]}, expected {total_steps}", file=sys.stderr)
    return steps[0], checkpoints / str(steps[0]) / "actor"


def weight_change(model_dir: Path, run_dir: str, total_steps: int) -> dict:
    """The actor's final fp32 weights (last checkpoint) against the initial model, over every tensor."""
    step, folder = final_actor_weights(run_dir, total_steps)
    if folder is None:
        print(f"WARNING: no actor checkpoint under {run_dir}/checkpoints: no weight comparison", file=sys.stderr)
        return {"weights_checkpoint": None}
    started = time.perf_counter()
    initial = SafetensorsWeights(model_dir)
    # LoRA (model.lora_rank > 0): the checkpoint is the adapter; the policy is the base with its delta merged in
    final = (LoraMergedWeights(initial, folder) if (folder / "adapter_config.json").is_file()
             else SafetensorsWeights(folder))
    change = compare_weights(initial, final)
    change.update({"weights_checkpoint": str(folder), "weights_checkpoint_step": step,
                   "weights_initial_dtypes": sorted(set(initial.dtypes.values())),
                   "weights_final_dtypes": sorted(set(final.dtypes.values())),
                   "weights_compare_s": time.perf_counter() - started})
    unmatched = change["weights_only_initial"] + change["weights_only_final"] + change["weights_shape_mismatch"]
    if not change["weights_compared_tensors"] or set(unmatched) - {"lm_head.weight"}:
        print(f"WARNING: weight comparison matched {change['weights_compared_tensors']} tensors; unmatched or "
              f"mismatched: {unmatched[:10]}", file=sys.stderr)
    return change


def run_product(args) -> dict:
    from mlflow.tracking import MlflowClient

    from flows.config import build_config
    from flows.training.run import run_training

    model_dir = make_random_model(args.model_dir or f"/tmp/rlhf-bench-models/{args.preset}", args.preset)
    total_steps = args.warmup + args.steps
    work = Path(tempfile.mkdtemp(prefix="rlhf-bench-step-"))
    from components.models import load_tokenizer

    data = work / "data" / "train.parquet"
    write_fixed_prompts(data, args.prompts, args.prompt_tokens, load_tokenizer(str(model_dir)))
    config = build_config(product_config(args, model_dir, data, work), overrides=args.set)
    peak_tflops = measure_bf16_matmul_tflops() if args.device == "cuda" else None
    started = time.perf_counter()
    with GpuMemorySampler() as memory:
        summary, _ = run_training(config, start_workers=args.gpus > 1 or args.workers)
    wall_s = time.perf_counter() - started

    client = MlflowClient(config.tracking.tracking_uri)
    run_id = summary["mlflow_run_id"]
    if "run_dir" in summary:
        run_dir = summary["run_dir"]
    else:
        from storage.layout import RunLayout

        run_dir = RunLayout(config.run.storage_root, config.run.name).run_dir

    def after_warmup(name: str) -> list[float]:
        history = sorted(client.get_metric_history(run_id, name), key=lambda m: m.step)
        return [m.value for m in history if m.step > args.warmup]

    steps = after_warmup("timing_s/step")
    step_s = statistics.mean(steps)
    stages = {name: statistics.mean(values) for name in STAGES if (values := after_warmup(f"timing_s/{name}"))}
    samples = args.prompts * args.n
    generated = samples * args.response_tokens
    from transformers import AutoConfig

    model_config = AutoConfig.from_pretrained(model_dir)
    flops = update_flops(model_config, samples, args.prompt_tokens, args.response_tokens)
    if config.model.lora_rank:  # frozen base: no weight gradients, forward + input gradients = 2/3 of the FLOPs
        flops *= 2 / 3
    update_s = stages.get("update_actor")
    update_rms = {role: after_warmup(f"{role}/update_rms_ratio") for role in ("actor", "critic")}
    model_section = config.model
    result = {
        "bench": "step", "system": "product", "algorithm": args.algorithm, "gpus": args.gpus,
        "step_s": step_s, "step_s_all": steps, "stage_s": stages,
        "gen_tokens_per_s": generated / step_s, "samples_per_s": samples / step_s,
        "update_tflops": flops / update_s / 1e12 if update_s else None,
        "matmul_peak_tflops": peak_tflops,
        "update_mfu": flops / update_s / 1e12 / peak_tflops if update_s and peak_tflops else None,
        "gpu_peak_used_gib": memory.peaks, "wall_s": wall_s, "args": vars(args), "machine": machine_info(),
        "logprob_diff_mean": after_warmup("rollout/logprob_diff_mean"),
        # per step: the weights' hand-over (rollout side, wake included), its publication and the actor's sending
        "weights_s_all": {name: after_warmup(f"timing_s/{name}") for name in (
            "weight_sync", "save_weights", "send_weights", "weight_wait", "wake", "weight_load", "weight_receive",
            "weight_apply")},
        "weights_direct": after_warmup("weights/direct"),
        # validation's hand-overs (the last step validates the version its update published), apart
        "val_weights_s_all": {name: after_warmup(f"val-aux/timing_s/{name}") for name in (
            "weight_sync", "send_weights", "weight_wait", "weight_load", "weight_apply")},
        "stream_fallbacks": len(after_warmup("weights/stream_fallback")),
        # per step: the checkpoint stage (outside timing_s/step; in the background only the copy to host memory)
        # and the next update's wait for the writing (inside timing_s/step), with trainer.checkpoint_every=1
        "checkpoint_s_all": {name: after_warmup(f"timing_s/{name}") for name in (
            "checkpoint_actor", "checkpoint_critic", "checkpoint_wait")},
        "checkpoint_host_gib": after_warmup("checkpoint/actor_host_gib"),
        "preset": args.preset, "parameters": parameter_count(model_config),
        "compute_dtype": getattr(model_section, "compute_dtype", getattr(model_section, "dtype", None)),
        "master_dtype": getattr(model_section, "master_dtype", None),
        "lora_rank": getattr(model_section, "lora_rank", 0),
        "update_rms_ratio": statistics.mean(update_rms["actor"]) if update_rms["actor"] else None,
        "update_rms_ratio_all": update_rms["actor"],
        "critic_update_rms_ratio": statistics.mean(update_rms["critic"]) if update_rms["critic"] else None,
        "critic_update_rms_ratio_all": update_rms["critic"],
        "run_dir": run_dir,
    }
    if args.out:  # the steps' numbers stand even if the call's time runs out during the comparison below
        write_result({**result, "weights_compared": False}, args.out)
    # Over all total_steps optimizer steps, warm-up included (as bench/trl_grpo.py's comparison).
    result.update(weight_change(model_dir, run_dir, total_steps))
    if not args.keep_work:
        shutil.rmtree(work, ignore_errors=True)
    result["work_dir"] = str(work) if args.keep_work else None
    return result


def label(result: dict) -> str:
    if result.get("bench") == "trl_grpo":
        preset = (result.get("knobs") or {}).get("preset", "qwen2.5-0.5b")
        return "TRL GRPOTrainer, vLLM colocate, 1 GPU" + (f", {preset}" if preset != "qwen2.5-0.5b" else "")
    name = f"product {result['algorithm'].upper()}, {result['gpus']} GPU{'s' if result['gpus'] > 1 else ''}"
    preset = result["args"].get("preset", "qwen2.5-0.5b")
    name += f", {preset}" if preset != "qwen2.5-0.5b" else ""
    name += ", one-step-ahead" if result["args"].get("one_step_ahead") else ""
    name += ", workers" if result["args"].get("workers") else ""
    return name + "".join(f", {override}" for override in result["args"].get("set") or [])


def table(results: list[dict]) -> str:
    rows = []
    for result in results:
        if result.get("bench") not in ("step", "trl_grpo"):  # e.g. bench/rollout.py's result
            continue
        if result.get("bench") == "trl_grpo":  # bench/trl_grpo.py's result
            phases = result.get("phases_mean_s") or {}
            tflops, peak = result.get("update_tflops_per_s"), result.get("bf16_matmul_tflops")
            row = {"step s": result["mean_step_s"], "gen tok/s": result["generated_tokens_per_s"],
                   "gen s": phases.get("vllm_generate_s"), "update s": phases.get("update_s"),
                   "update MFU": tflops / peak if tflops and peak else None,
                   "peaks": {0: result["peak_device_used_gib"]} if result.get("peak_device_used_gib") else {}}
        else:
            stages = result.get("stage_s", {})
            row = {"step s": result["step_s"], "gen tok/s": result["gen_tokens_per_s"], "gen s": stages.get("gen"),
                   "update s": stages.get("update_actor"), "update MFU": result.get("update_mfu"),
                   "peaks": result.get("gpu_peak_used_gib") or {}}
        update_rms, changed, mean_delta = (result.get(key) for key in
                                           ("update_rms_ratio", "weights_changed_fraction", "weights_mean_abs_delta"))
        rows.append({
            "run": label(result), "step s": f"{row['step s']:.2f}", "gen tok/s": f"{row['gen tok/s']:,.0f}",
            "gen s": f"{row['gen s']:.2f}" if row["gen s"] else "",
            "update s": f"{row['update s']:.2f}" if row["update s"] else "",
            "update MFU": f"{row['update MFU']:.3f}" if row["update MFU"] else "",
            "peak GiB per GPU": " / ".join(f"{v:.1f}" for _, v in sorted(row["peaks"].items())),
            "update RMS ratio": f"{update_rms:.1e}" if update_rms is not None else "",
            "weights changed": f"{100 * changed:.2f}%" if changed is not None else "",
            "mean |Δw|": f"{mean_delta:.1e}" if mean_delta is not None else "",
        })
    return markdown_table(rows, ["run", "step s", "gen tok/s", "gen s", "update s", "update MFU", "peak GiB per GPU",
                                 "update RMS ratio", "weights changed", "mean |Δw|"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--algorithm", choices=["grpo", "ppo"], default="grpo")
    parser.add_argument("--gpus", type=int, choices=[1, 2], default=1)
    parser.add_argument("--preset", default="qwen2.5-0.5b", help="components/tiny.py preset of the random model")
    parser.add_argument("--model-dir", default=None,
                        help="model folder, built from --preset when it holds no model of that preset "
                             "(default /tmp/rlhf-bench-models/<preset>)")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--response-tokens", type=int, default=512)
    parser.add_argument("--micro-batch", type=int, default=16)
    parser.add_argument("--attn", default="auto", help="model.attn_implementation")
    parser.add_argument("--reward", default="digits",
                        help="digits (default): the fraction of digits in the response, as bench/trl_grpo.py; or a "
                             "reward.function (exact_match: every random response scores 0, so GRPO does not move)")
    parser.add_argument("--workers", action="store_true",
                        help="--gpus 1 with each role in a worker of its own (trainer.execution=workers), all on GPU 0")
    parser.add_argument("--one-step-ahead", action="store_true",
                        help="trainer.one_step_ahead: the next step's rollout runs while this one trains (--gpus 2)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="config override, repeatable (e.g. model.fused_logprobs=false)")
    parser.add_argument("--steps", type=int, default=3, help="measured steps after the warm-up")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu: a smoke test of the script")
    parser.add_argument("--keep-work", action="store_true",
                        help="keep the run's work folder (runs, checkpoint, MLflow db); deleted by default")
    parser.add_argument("--out", default=None)
    parser.add_argument("--table", nargs="*", help="print one table from these JSON results and exit")
    args = parser.parse_args()
    if args.table:
        print(table([json.loads(Path(path).read_text()) for path in args.table]))
        return
    result = run_product(args)
    print(table([result]))
    print("stage seconds (mean after warm-up): " + ", ".join(f"{k} {v:.2f}" for k, v in result["stage_s"].items()))
    if any(result["checkpoint_s_all"].values()):
        print("checkpoint seconds per step after warm-up: " + ", ".join(
            f"{name} {[round(v, 3) for v in values]}" for name, values in result["checkpoint_s_all"].items() if values))
    print(f"{result['parameters']:,} parameters, compute {result['compute_dtype']}, masters {result['master_dtype']}; "
          f"weights vs initial over {result.get('weights_compared_tensors')} tensors: changed "
          f"{result.get('weights_changed_fraction')}, mean |Δw| {result.get('weights_mean_abs_delta')}, RMS ratio "
          f"{result.get('weights_rms_ratio')}; update RMS ratio per step {result['update_rms_ratio_all']}"
          + (f", critic {result['critic_update_rms_ratio_all']}" if result["critic_update_rms_ratio_all"] else ""))
    emit(result, args.out)


if __name__ == "__main__":
    main()
    os._exit(0)
