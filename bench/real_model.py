"""The product's side of the learning-curve comparison on a real pretrained model (bench/README.md, "A real model").

Runs `rlhf train CONFIG` (one process: every role on this machine's GPU, as a user runs it) with a large
trainer.total_steps, reads each step's line as it is printed, and stops the run (SIGINT: a clean, resumable stop)
after the first validated step at which the training wall clock has reached --budget-s. The training wall clock
is the sum of the steps' `timing_s/step` (rollout, scoring, log-probs, update, weight hand-over), which leaves out
what is not training: the engine's start, model loads, validation and checkpoints; bench/trl_learning.py counts
TRL's the same way. The curve then comes from the run's MLflow metrics:

    python bench/real_model.py configs/smollm2-1x.yaml --budget-s 240 --out bench/results/real-135m-product.json

Each curve point is (step, train_wall_s, val_reward); each step also records its score, the share of groups whose
samples all scored alike, the response-length clip ratio and actor/update_rms_ratio (the policy moved).
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
for path in (HERE, ROOT):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

STEP_LINE = re.compile(r"step (\d+)/\d+ \| score [-0-9.na]+ (\| val ([-0-9.]+) )?.*\bstep ([0-9.]+)s")
PER_STEP = ("critic/score/mean", "critic/score/equal_group_frac", "response_length/clip_ratio",
            "response_length/mean", "actor/update_rms_ratio", "actor/grad_norm", "timing_s/step", "timing_s/gen",
            "timing_s/update_actor", "rollout/tool_calls/mean", "rollout/turns/mean", "rollout/tool_errors")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config")
    parser.add_argument("overrides", nargs="*", help="key=value config overrides")
    parser.add_argument("--budget-s", type=float, default=240.0, help="training wall-clock seconds before the stop")
    parser.add_argument("--max-steps", type=int, default=1000, help="trainer.total_steps of the run (an upper bound)")
    parser.add_argument("--name", default=None, help="run.name (default: real-<time>)")
    parser.add_argument("--out", default=None, help="write the result JSON here")
    return parser.parse_args(argv)


def run_until_budget(command: list[str], budget_s: float, log_path: Path) -> dict:
    """Run the training command; SIGINT it after the first validated step past the budget. Returns what the
    terminal showed: the steps seen, the stop's step and the wall times."""
    started = time.perf_counter()
    trained, stopped_at, first_step_at = 0.0, None, None
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                                   cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        for line in process.stdout:
            log.write(line)
            sys.stdout.write(line)
            match = STEP_LINE.search(line)
            if not match or stopped_at is not None:
                continue
            first_step_at = first_step_at or time.perf_counter() - started
            trained += float(match.group(4))
            if match.group(3) is not None and trained >= budget_s:
                stopped_at = int(match.group(1))
                process.send_signal(signal.SIGINT)
        code = process.wait()
    return {"returncode": code, "stopped_at_step": stopped_at, "train_wall_s_seen": trained,
            "process_wall_s": time.perf_counter() - started, "first_step_line_s": first_step_at}


def curve_from_mlflow(tracking_uri: str, experiment: str, run_name: str, last_step: int | None) -> dict:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=tracking_uri)
    experiment_id = client.get_experiment_by_name(experiment).experiment_id
    runs = client.search_runs([experiment_id], f"tags.`rlhf.run_name` = '{run_name}'", max_results=1,
                              order_by=["attributes.start_time DESC"])
    run_id = runs[0].info.run_id

    def history(name: str) -> dict[int, float]:
        return {m.step: m.value for m in client.get_metric_history(run_id, name)
                if last_step is None or m.step <= last_step}

    per_step = {name: history(name) for name in PER_STEP}
    validation = history("val/reward/mean")
    wall, elapsed = {0: 0.0}, 0.0
    for step in sorted(per_step["timing_s/step"]):
        elapsed += per_step["timing_s/step"][step]
        wall[step] = elapsed
    curve = [{"step": step, "train_wall_s": round(wall[step], 2), "val_reward": value}
             for step, value in sorted(validation.items()) if step in wall]
    train = [{"step": step, **{name: per_step[name].get(step) for name in PER_STEP}}
             for step in sorted(per_step["timing_s/step"])]
    before = history("warm_start/val_reward_before")  # a run with a warm-start: validation before it
    moved = [row["actor/update_rms_ratio"] for row in train if row["actor/update_rms_ratio"] is not None]
    return {"mlflow_run_id": run_id, "curve": curve, "train": train,
            "val_reward_before_warm_start": next(iter(before.values()), None),
            "update_rms_ratio_min": min(moved) if moved else None}


def main(argv=None) -> dict:
    from bench.common import emit, machine_info
    from flows.config import load_config

    args = parse_args(argv)
    name = args.name or f"real-{time.strftime('%H%M%S')}"
    overrides = [f"run.name={name}", f"trainer.total_steps={args.max_steps}", *args.overrides]
    config = load_config(args.config, overrides)  # the same resolution rlhf train makes (an error stops here)
    log_path = Path(args.out or f"/tmp/{name}.json").with_suffix(".log")
    command = [sys.executable, "-m", "flows.tools.cli", "train", args.config, *overrides]
    seen = run_until_budget(command, args.budget_s, log_path)
    result = {"trainer": "rlhf-flow", "machine": machine_info(), "command": command, "budget_s": args.budget_s,
              "config": config.model_dump(mode="json"), **seen,
              **curve_from_mlflow(config.tracking.tracking_uri, config.tracking.experiment, name,
                                  seen["stopped_at_step"])}
    result["log"] = str(log_path)
    emit(result, args.out)
    return result


if __name__ == "__main__":
    main()
