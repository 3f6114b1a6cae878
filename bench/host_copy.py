"""Copying a trained role's state (fp32 weights and AdamW's two moments) from the GPU to host memory, the
step that a background checkpoint (trainer.checkpoint_async) still makes the run wait for: seconds of

- `pinned_per_tensor_first`: page-locked memory allocated per tensor (torch's caching host allocator), then the
  copy: what the actor's first background checkpoint pays (components/checkpoint.py: _on_host);
- `pinned_reused`: the copy into that memory again: every later checkpoint;
- `pinned_slab_alloc`: one page-locked allocation of the same bytes (the alternative to per-tensor allocation);
- `pageable_first` / `pageable_reused`: plain host memory, new then reused.

    python bench/host_copy.py --preset qwen2.5-0.5b --out host-copy.json
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import emit, machine_info  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="qwen2.5-0.5b")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    import torch
    from transformers import AutoModelForCausalLM

    from components.tiny import PRESETS, tiny_config

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(tiny_config(PRESETS[args.preset]))
    sizes = [p.numel() for p in model.parameters()] * 3  # weights, exp_avg, exp_avg_sq
    tensors = [torch.randn(n, device="cuda") for n in sizes]
    total = sum(sizes) * 4
    torch.cuda.synchronize()

    def timed(function) -> float:
        torch.cuda.synchronize()
        begun = time.perf_counter()
        function()
        torch.cuda.synchronize()
        return time.perf_counter() - begun

    def copy_into(buffers) -> None:
        for buffer, tensor in zip(buffers, tensors):
            buffer.copy_(tensor, non_blocking=buffer.is_pinned())

    result: dict[str, float] = {}
    pinned: list = []
    result["pinned_per_tensor_first"] = timed(
        lambda: (pinned.extend(torch.empty(n, pin_memory=True) for n in sizes), copy_into(pinned)))
    result["pinned_reused"] = timed(lambda: copy_into(pinned))
    del pinned[:]
    slab: list = []
    result["pinned_slab_alloc"] = timed(lambda: slab.append(torch.empty(total, dtype=torch.uint8, pin_memory=True)))
    views = [piece.view(torch.float32) for piece in torch.split(slab[0], [n * 4 for n in sizes])]
    result["pinned_slab_copy"] = timed(lambda: copy_into(views))
    del views, slab[:]
    pageable: list = []
    result["pageable_first"] = timed(lambda: (pageable.extend(torch.empty(n) for n in sizes), copy_into(pageable)))
    result["pageable_reused"] = timed(lambda: copy_into(pageable))
    gib = total / 2**30
    print(f"{args.preset}: {len(sizes)} tensors, {gib:.2f} GiB: " + ", ".join(f"{k} {v:.2f} s" for k, v in result.items()))
    emit({"bench": "host_copy", "preset": args.preset, "gib": gib, "tensors": len(sizes), "seconds": result,
          "machine": machine_info()}, args.out)


if __name__ == "__main__":
    main()
