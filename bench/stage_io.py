"""CPU cost of the advantages stage (Parquet in, padded tensors, GRPO advantages, Parquet out), no model.

    python bench/stage_io.py                       # 512 samples x (256 + 512) tokens, median of 7

Writes a synthetic rollout and reward file (bench/step.py's shape) under a temporary run folder and
times `flows.training.stages.advantages` on them; what is left is reading, converting and writing: the
per-step host work every stage of a step pays in some form.
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parent.parent))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=512)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--response-tokens", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()

    from bench.common import machine_info
    from components.tiny import build_tiny_model
    from flows.training import stages
    from flows.config import build_config
    from flows.config import layout_for
    from storage import write_stage

    work = Path(tempfile.mkdtemp(prefix="rlhf-bench-stage-io-"))
    model = build_tiny_model(work / "model")  # only its tokenizer's pad id is used
    config = build_config({"model": {"path": str(model)}, "run": {"name": "stage-io", "storage_root": str(work)},
                           "algorithm": {"adv_estimator": "grpo"}})
    samples, rng = args.samples, random.Random(0)
    uids = [f"s0-p{row // 8}-n{row % 8}" for row in range(samples)]
    layout = layout_for(config)
    write_stage(layout, 0, "rollout", {
        "uid": uids, "group_id": [f"p{row // 8}" for row in range(samples)],
        "prompt_ids": [[rng.randrange(3, 200) for _ in range(args.prompt_tokens)] for _ in range(samples)],
        "response_ids": [[rng.randrange(3, 200) for _ in range(args.response_tokens)] for _ in range(samples)],
        "rollout_logprobs": [[-1.0 if row % 8 == 0 else math.nan] * args.response_tokens for row in range(samples)],
        "loss_mask": [[1] * args.response_tokens] * samples,
        "response_text": ["x" * 1500] * samples, "ground_truth": ["1"] * samples, "data_source": ["a"] * samples,
        "finish_reason": ["length"] * samples})
    write_stage(layout, 0, "reward", {"uid": uids, "score": [float(row % 2) for row in range(samples)]})
    stages.advantages(config, 0, 0.0)  # first call: imports and caches
    seconds = []
    for _ in range(args.repeats):
        started = time.perf_counter()
        stages.advantages(config, 0, 0.0)
        seconds.append(time.perf_counter() - started)
    info = machine_info()
    print(f"advantages stage, {samples} x ({args.prompt_tokens} + {args.response_tokens}) tokens: median "
          f"{statistics.median(seconds):.3f} s (min {min(seconds):.3f}, max {max(seconds):.3f}) on "
          f"{info['cpu_count']} CPU cores, {info['platform']}")


if __name__ == "__main__":
    main()
