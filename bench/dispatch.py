"""What the stage graph costs beyond the stages themselves, with one worker per role (CPU, tiny model).

    python bench/dispatch.py --steps 6 --out /tmp/dispatch.json

Runs the real flow (a local Prefect server, one worker process per role, MLflow on SQLite, Parquet)
on a tiny model with GRPO, and reports per step after the first: the step's seconds, the sum of its
stages' own seconds (rollout, reward, advantages, update, weight save), the rest (dispatch: the
server's queue, the delivery to the worker, the driver's notice of the end), and each stage's
`timing_s/dispatch_*` (submission to start in the worker). It also counts the Prefect server's
"Error flushing" lines (its task run recorder failing a write and retrying at the next flush).
The stages here take milliseconds, so the rest is almost all orchestration.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import emit, machine_info, markdown_table

STAGE_SECONDS = ("gen", "weight_sync", "reward", "adv", "update_actor", "save_weights")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    from mlflow.tracking import MlflowClient

    from components.tasks.arithmetic import write_arithmetic_dataset
    from components.tiny import build_tiny_model
    from flows.config import build_config
    from flows.runtime.launcher import prefect_server, using_prefect_api
    from flows.training.run import run_training

    work = Path(tempfile.mkdtemp(prefix="rlhf-bench-dispatch-"))
    model = build_tiny_model(work / "model")
    data = write_arithmetic_dataset(work / "data", train_size=64, validation_size=16, high=49)
    config = build_config({
        "run": {"name": "bench-dispatch", "storage_root": str(work / "runs")},
        "model": {"path": str(model)},
        "data": {"train_files": [str(data["train"])], "val_files": [str(data["validation"])],
                 "max_prompt_length": 16, "prompts_per_step": 4, "max_val_prompts": 4},
        "rollout": {"n": 4, "max_new_tokens": 4, "engine": "hf"},
        "actor": {"ppo_mini_batch_size": 4, "micro_batch_size": 16, "use_kl_loss": False},
        "trainer": {"total_steps": args.steps + 1, "val_every": 0, "checkpoint_every": 0, "device": "cpu",
                    "execution": "workers"},
        "placement": {"default": "cpu"},
        "tracking": {"tracking_uri": f"sqlite:///{work}/mlflow.db", "experiment": "bench-dispatch"},
    })
    home = work / "prefect"
    started = time.perf_counter()
    with prefect_server(prefect_home=home) as api_url, using_prefect_api(api_url, prefect_home=home):
        os.environ["PREFECT_API_URL"] = api_url  # run_training uses this server (its log is read below)
        try:
            summary, _ = run_training(config, start_workers=True)
        finally:
            del os.environ["PREFECT_API_URL"]
    wall_s = time.perf_counter() - started

    client = MlflowClient(config.tracking.tracking_uri)
    run_id = summary["mlflow_run_id"]
    names = [metric for metric in client.get_run(run_id).data.metrics if metric.startswith("timing_s/")]

    def history(name: str) -> dict[int, float]:
        return {m.step: m.value for m in client.get_metric_history(run_id, name) if m.step > 1}

    series = {name: history(name) for name in names}
    rows = []
    for step in sorted(series["timing_s/step"]):
        own = sum(series.get(f"timing_s/{name}", {}).get(step, 0.0) for name in STAGE_SECONDS)
        rows.append({"step": step, "step s": series["timing_s/step"][step], "stages s": own,
                     "rest s": series["timing_s/step"][step] - own})
    dispatch = {name.removeprefix("timing_s/dispatch_"): statistics.mean(values.values())
                for name, values in series.items() if name.startswith("timing_s/dispatch_") and values}
    server_log = (home / "server.log").read_text(errors="replace") if (home / "server.log").exists() else ""
    result = {
        "bench": "dispatch", "steps": rows, "step_s": statistics.mean(row["step s"] for row in rows),
        "rest_s": statistics.mean(row["rest s"] for row in rows), "dispatch_s": dispatch,
        "recorder_flush_errors": server_log.count("Error flushing"), "wall_s": wall_s, "args": vars(args),
        "machine": machine_info(),
    }
    print(markdown_table(rows, ["step", "step s", "stages s", "rest s"]))
    print("dispatch (submission to start in a worker), mean s: "
          + ", ".join(f"{stage} {seconds:.2f}" for stage, seconds in sorted(dispatch.items())))
    print(f"mean step {result['step_s']:.2f} s, of which outside the stages {result['rest_s']:.2f} s; "
          f"Prefect task run recorder flush errors: {result['recorder_flush_errors']}")
    emit(result, args.out)


if __name__ == "__main__":
    main()
