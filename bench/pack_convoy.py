"""Packing a policy's weights into buckets while another thread of the process runs Python: tensor by tensor
(`pack_buckets` over `compute_tensors`, what the actor's weights thread did) against a `PackPlan` (one call
into torch per bucket, what it does now).

Every call into torch lets go of the GIL; getting it back waits for the other thread's turn. The model has
the Qwen2.5-0.5B shape's tensor count (24 layers, 290 tensors, tied head) with small matrices, so that the
copies themselves cost little and what is left is the calls. Two buckets, as that shape takes at 512 MiB.

    python bench/pack_convoy.py [--device cuda] [--repeats 30] [--out result.json]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import emit, machine_info, markdown_table  # noqa: E402
from components.tiny import TinyModelSpec, tiny_config  # noqa: E402
from components.weight_sync.buckets import BucketBuffers, PackPlan, compute_tensors, pack_buckets  # noqa: E402


def python_work(stop: list) -> None:
    """Another thread's pure-Python work (a worker's next stage being set up: validation, bookkeeping)."""
    while not stop:
        {str(index): [index] * 3 for index in range(200)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--out")
    args = parser.parse_args()
    from transformers import Qwen2ForCausalLM

    spec = TinyModelSpec(hidden_size=128, num_hidden_layers=24, num_attention_heads=2, num_key_value_heads=2,
                         intermediate_size=256, vocab_size=1024)
    model = Qwen2ForCausalLM(tiny_config(spec)).to(args.device)
    dtype = torch.bfloat16
    tensors = list(compute_tensors(model, dtype, cast=False, detach=False))
    total = sum(tensor.numel() * dtype.itemsize for _, tensor in tensors)
    bucket_bytes = total // 2 + 4096
    buffers = BucketBuffers()
    plan = PackPlan(tensors, bucket_bytes, buffers, dtype)
    ways = {"tensor by tensor": lambda: pack_buckets(compute_tensors(model, dtype, cast=False), bucket_bytes,
                                                     buffers, dtype),
            "PackPlan": plan.buckets}
    rows, result = [], {"bench": "pack_convoy", "machine": machine_info(), "device": args.device,
                        "tensors": len(tensors), "bucket_bytes": bucket_bytes, "runs": {}}
    for contended in (False, True):
        for name, buckets in ways.items():
            stop: list = []
            other = threading.Thread(target=python_work, args=(stop,), daemon=True)
            if contended:
                other.start()
                time.sleep(0.05)
            walls, cpus, count = [], [], 0
            for _ in range(args.repeats):
                wall, cpu, count = time.perf_counter(), time.thread_time(), 0
                for _bucket in buckets():
                    if args.device != "cpu":
                        torch.cuda.current_stream().synchronize()  # as the IPC hand-over does per bucket
                    count += 1
                walls.append((time.perf_counter() - wall) * 1e3)
                cpus.append((time.thread_time() - cpu) * 1e3)
            stop.append(True)
            if contended:
                other.join()
            label = f"{name}, {'another thread runs Python' if contended else 'alone'}"
            result["runs"][label] = {"wall_ms": walls, "cpu_ms": cpus, "buckets": count}
            rows.append({"packing": label, "buckets": count, "wall ms median": f"{statistics.median(walls):.1f}",
                         "wall ms max": f"{max(walls):.1f}", "thread CPU ms median": f"{statistics.median(cpus):.1f}"})
    print(markdown_table(rows, list(rows[0])))
    emit(result, args.out)


if __name__ == "__main__":
    main()
