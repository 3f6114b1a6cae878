"""Running a training: the flow in this process, or the embedded launcher with one worker per role.

`run_training` is what `rlhf train` / `rlhf quickstart` / `rlhf run` call. With
trainer.execution=workers it validates the placement before anything loads, starts one worker per
role pinned to its devices, supervises them, runs the flow, and stops everything on exit or Ctrl-C.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Iterator

from flows.config import Config
from flows.runtime.console import quiet_console
from flows.runtime.launcher import (WorkerPool, prefect_server, print_worker_summary, using_prefect_api,
                                    worker_environment)
from flows.training.plan import plan_placement, worker_preloads
from flows.training.preflight import check_inputs
from flows.training.train import train


@contextlib.contextmanager
def worker_pool(config: Config, api_url: str) -> Iterator["WorkerPool"]:
    """Start and supervise one worker per role for this run; stop them all on exit."""
    assignments = plan_placement(config)
    heartbeat_directory = str(Path(config.run.storage_root, ".workers", config.run.name).resolve())
    env = worker_environment(api_url, config.run.storage_root, heartbeat_directory)
    os.environ["RLHF_WORKER_DIR"] = heartbeat_directory
    pool = WorkerPool(assignments, env, log_dir=Path(".rlhf/logs", config.run.name),
                      preload=worker_preloads(config, assignments))
    print("workers: " + ", ".join(f"{role} on {WorkerPool.devices_argument(devices)}"
                                  for role, devices in assignments.items()))
    pool.start()
    try:
        pool.wait_until_ready(heartbeat_directory)
        yield pool
        print_worker_summary(heartbeat_directory)
    finally:
        pool.stop()


def run_training(config: Config, start_workers: bool = False) -> tuple[dict, str]:
    """Run the flow against PREFECT_API_URL or a local server; returns (summary, flow run id).

    start_workers: also start (and supervise) one worker per role on this machine, as `rlhf run`
    does; otherwise, with trainer.execution=workers, the stages go to workers started elsewhere.
    """
    workers = config.trainer.execution == "workers"
    check_inputs(config)  # bad data, model or reward: one line before the server starts (the flow reports them)
    if start_workers:
        plan_placement(config)  # fail on a bad placement before any server or model starts
    with prefect_server() as api_url:
        storage = worker_environment(api_url, config.run.storage_root, "")["PREFECT_LOCAL_STORAGE_PATH"]
        with using_prefect_api(api_url, local_storage_path=storage if workers else None), \
                (worker_pool(config, api_url) if start_workers else contextlib.nullcontext()):
            # One line per step and progress lines on the terminal; Prefect keeps every task run's log.
            quiet_console()
            state = train(config, return_state=True)
            return state.result(raise_on_failure=True), str(state.state_details.flow_run_id)
