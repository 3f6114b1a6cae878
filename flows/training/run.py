"""Running a training: the flow in this process, or the embedded launcher with one worker per role.

`run_training` is what `rlhf train` / `rlhf quickstart` / `rlhf run` / `rlhf resume` call. It checks the
inputs and takes the run's lock before anything starts; with trainer.execution=workers it validates the
placement before anything loads, starts one worker per role pinned to its devices (scoped to this run:
flows.runtime.tasks.scoped), supervises them, runs the flow, and stops everything on exit, Ctrl-C or
SIGTERM. A lost Prefect server ends the driver within seconds with one line (flows.runtime.supervision).
"""

from __future__ import annotations

import contextlib
import errno
import os
import sys
from pathlib import Path
from typing import Iterator

from mlflow.tracking import MlflowClient
from prefect.exceptions import TerminationSignal

from flows.config import Config, layout_for
from flows.runtime.attempts import end_stopped
from flows.runtime.console import quiet_console
from flows.runtime.launcher import (EMBEDDED_SERVERS, WorkerPool, prefect_results_dir, prefect_server,
                                    print_worker_summary, remove_run_files, using_prefect_api,
                                    worker_environment)
from flows.runtime.recovery import read_run_record
from flows.runtime.supervision import RunLock, ServerWatch
from flows.runtime.tasks import TASK_SCOPE_ENV
from flows.runtime.tracking import tracking_uri
from flows.training.plan import hosted_roles, plan_placement, worker_also_serves, worker_preloads
from flows.training.preflight import check_inputs
from flows.training.train import train


class RunStopped(KeyboardInterrupt):
    """The run was stopped by a signal; the message says how to resume it."""


def heartbeat_directory_for(config: Config) -> str:
    return str(Path(config.run.storage_root, ".workers", config.run.name).resolve())


@contextlib.contextmanager
def worker_pool(config: Config, api_url: str) -> Iterator["WorkerPool"]:
    """Start and supervise one worker per role for this run, serving only this run's stages; stop them all
    on exit and remove their heartbeat folder."""
    assignments = plan_placement(config)
    heartbeat_directory = heartbeat_directory_for(config)
    env = worker_environment(api_url, config.run.storage_root, heartbeat_directory, config.run.name)
    env[TASK_SCOPE_ENV] = config.run.name
    # Every worker is on this host: the actor's weights channel listens on the loopback only, unless set.
    env.setdefault("RLHF_WEIGHTS_ADDRESS", "127.0.0.1")
    previous_scope = os.environ.get(TASK_SCOPE_ENV)
    os.environ["RLHF_WORKER_DIR"] = heartbeat_directory
    os.environ[TASK_SCOPE_ENV] = config.run.name
    remove_run_files(heartbeat_directory)  # an earlier attempt's heartbeats and results: stale
    pool = WorkerPool(assignments, env, log_dir=Path(".rlhf/logs", config.run.name),
                      preload=worker_preloads(config, assignments), also_serve=worker_also_serves(config))
    print("workers: " + ", ".join(f"{role} on {WorkerPool.devices_argument(devices)}"
                                  for role, devices in assignments.items())
          + "".join(f"; {role}: {where}" for role, where in hosted_roles(config).items()))
    pool.start()
    try:
        pool.wait_until_ready(heartbeat_directory)
        yield pool
        print_worker_summary(heartbeat_directory)
    finally:
        pool.stop()
        remove_run_files(heartbeat_directory)
        if previous_scope is None:
            os.environ.pop(TASK_SCOPE_ENV, None)
        else:
            os.environ[TASK_SCOPE_ENV] = previous_scope


def run_training(config: Config, start_workers: bool = False) -> tuple[dict, str]:
    """Run the flow against PREFECT_API_URL or a local server; returns (summary, flow run id).

    start_workers: also start (and supervise) one worker per role on this machine, as `rlhf run`
    does; otherwise, with trainer.execution=workers, the stages go to workers started elsewhere.
    """
    workers = config.trainer.execution == "workers"
    # Bad data, model, reward or device: one line before the server, the MLflow run or the run folder exists (the
    # flow checks again where it runs). The workers `rlhf run` starts are on this machine: trainer.device too.
    check_inputs(config, devices=True if start_workers else None)
    if start_workers:
        plan_placement(config)  # fail on a bad placement before any server or model starts
    pools: list[WorkerPool] = []
    # The run's lock first: a second live run of this name is refused before it starts a server or a worker.
    with RunLock(config.run.storage_root, config.run.name), prefect_server() as api_url:
        storage = worker_environment(api_url, config.run.storage_root, "", config.run.name)["PREFECT_LOCAL_STORAGE_PATH"]
        watch = ServerWatch(api_url, on_lost=lambda reason: _server_lost(config, reason, pools),
                            process=EMBEDDED_SERVERS.get(api_url))
        with watch.running(), using_prefect_api(api_url, local_storage_path=storage if workers else None), \
                (worker_pool(config, api_url) if start_workers else contextlib.nullcontext()) as pool:
            if pool is not None:
                pools.append(pool)
            # One line per step and progress lines on the terminal; Prefect keeps every task run's log.
            quiet_console()
            try:
                state = train(config, return_state=True)
                summary = state.result(raise_on_failure=True)
            except (KeyboardInterrupt, TerminationSignal) as stop:
                end_stopped(config.run.name, "stopped by a signal; rlhf resume continues it")
                raise RunStopped(f"stopped; the run is resumable: rlhf resume {config.run.name}"
                                 + _storage_root_option(config)) from stop
            except Exception as error:
                if _no_space(error):
                    full = OSError(f"no space left on device writing under run.storage_root={config.run.storage_root}; "
                                   f"the run stopped and nothing committed was lost: free space, then rlhf resume "
                                   f"{config.run.name}{_storage_root_option(config)}")
                    full.errno = errno.ENOSPC
                    raise full from None
                raise
    remove_run_files(prefect_results_dir(config.run.storage_root, config.run.name) if workers else None)
    return summary, str(state.state_details.flow_run_id)


def _storage_root_option(config: Config) -> str:
    default = Path(".rlhf/runs").resolve()
    return "" if Path(config.run.storage_root).resolve() == default else f" --storage-root {config.run.storage_root}"


def _no_space(error: BaseException | None) -> bool:
    """Whether `error` or an exception it came from is a full disk."""
    seen = 0
    while error is not None and seen < 20:
        if (isinstance(error, OSError) and error.errno == errno.ENOSPC) or "No space left on device" in str(error):
            return True
        error, seen = error.__cause__ or error.__context__, seen + 1
    return False


def _server_lost(config: Config, reason: str, pools: list[WorkerPool]) -> None:
    """The Prefect server is gone: nothing more can be recorded there. Stop the workers, mark the MLflow run
    failed, say so in one line and end this process now (the client would retry for minutes)."""
    print(f"error: {reason}; the run stopped; when the server is back (or with none set, the embedded one): "
          f"rlhf resume {config.run.name}{_storage_root_option(config)}", file=sys.stderr, flush=True)
    for pool in pools:
        pool.stop(grace_s=5)
    with contextlib.suppress(Exception):
        record = read_run_record(layout_for(config))
        MlflowClient(tracking_uri(config)).set_terminated(record["mlflow_run_id"], status="FAILED")
    sys.stdout.flush()
    os._exit(1)
