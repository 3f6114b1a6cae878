"""Label log-probs + entropy from bf16 logits: the fused Triton kernels against the plain PyTorch
expression, forward + backward, at the actor update's micro-batch shape.

    python bench/logprobs.py                   # [16, 513, 151936] bf16 logits (micro-batch 16, 512 tokens)
    python bench/logprobs.py --batch 8 --positions 1025

Prints milliseconds per forward+backward (median of --repeats) and the peak memory above the logits.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import emit, machine_info, markdown_table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--positions", type=int, default=513, help="logits positions (response tokens + 1)")
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    import torch

    from components.algorithms.fused import logprobs_and_entropy

    device = "cuda"
    generator = torch.Generator(device=device).manual_seed(0)
    logits = (torch.randn(args.batch, args.positions, args.vocab, device=device, generator=generator) * 3).to(torch.bfloat16)
    labels = torch.randint(0, args.vocab, (args.batch, args.positions - 1), device=device, generator=generator)
    weights = torch.randn(labels.shape, device=device, generator=generator)
    rows, results = [], {}
    for fused in (True, False):
        times = []
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        for _ in range(args.repeats + 1):
            leaf = logits.detach().requires_grad_()
            torch.cuda.synchronize()
            begin = time.perf_counter()
            logprobs, entropy = logprobs_and_entropy(leaf, labels, 1.0, fused=fused)
            (logprobs * weights).sum().backward()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - begin)
            del leaf, logprobs, entropy
        peak = (torch.cuda.max_memory_allocated() - base) / 2**30
        name = "fused Triton" if fused else "PyTorch (float32 copy, log_softmax, entropy)"
        results[name] = {"ms": 1000 * statistics.median(times[1:]), "peak_gib_above_logits": peak}
        rows.append({"path": name, "ms fwd+bwd": f"{results[name]['ms']:.1f}", "peak GiB above logits": f"{peak:.1f}"})
    print(f"\nlogits [{args.batch}, {args.positions}, {args.vocab}] bf16 on {torch.cuda.get_device_name()}\n")
    print(markdown_table(rows, ["path", "ms fwd+bwd", "peak GiB above logits"]))
    emit({"bench": "logprobs", "args": vars(args), "results": results, "machine": machine_info()}, args.out)


if __name__ == "__main__":
    main()
