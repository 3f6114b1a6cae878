"""A stage as a Prefect task: what the runtime adds around a stage function, and fault injection.

In the flow's own process the task only runs the function. In a role's worker it also marks the task
run in the worker's heartbeat (so the driver tells a slow stage from a dead worker), replays the call
on the other ranks of a sharded role, drops the models of an earlier run with the same name, starts
the worker's system metrics once the run's MLflow run exists, and leaves the result for the driver
(flows/runtime/dispatch.py). None of this is the algorithm's business.

In either process, a stage that raises while its process stops (SIGTERM, Ctrl-C: the flow's `finally` released
the roles and closed the engine it was using) raises `Stopped` instead: the stop, not a failure to retry or report.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import time
from typing import Callable

import fsspec
from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.client.orchestration import get_client
from prefect.runtime import task_run

from components.distributed import broadcast_call, is_distributed
from flows.runtime import worker
from flows.runtime.residents import LOAD_COUNTS, forget_earlier_run
from flows.runtime.supervision import STOPPING, Stopped
from flows.runtime.system_metrics import start_system_metrics


def inject_failure(stage: str, step) -> None:
    """Fault injection for tests and recovery drills: RLHF_INJECT_FAILURE=stage:step fails that stage (a
    stage without a step, the warm-start, is `warm_start:None`);
    stage:step:kill SIGKILLs the process that runs it (its role's worker under trainer.execution=workers),
    once (a marker in the heartbeat folder remembers), as a lost machine would: no exception, no final
    state. It dies first thing in the stage, so the server may never learn the stage started (Prefect sends
    task run states as events); stage:step:kill-running waits until the server has the task run Running, as
    for a machine lost in the middle of a stage; stage:step:stop sends that process SIGTERM, once, as `kill` or
    a process manager would, and the stage goes on: a stop that arrives while the stage runs; stage:step:stop-wait
    sends it and waits (up to a minute) until the process has marked the stop before the stage goes on, so that
    what the stage does next (a generation, say) runs while the run's `finally` releases the roles under it, as
    when a stop comes in the middle of a long stage, whatever the machine's speed."""
    target = os.environ.get("RLHF_INJECT_FAILURE", "")
    if not target:
        return
    if target == f"{stage}:{step}":
        raise RuntimeError(f"injected failure in stage {stage} at step {step} (RLHF_INJECT_FAILURE={target})")
    prefix = f"{stage}:{step}:"
    mode = target[len(prefix):] if target.startswith(prefix) else ""
    if mode not in ("kill", "kill-running", "stop", "stop-wait"):
        return
    stop = mode.startswith("stop")
    if _first_time(f"injected-{'stop' if stop else 'kill'}-{stage}-{step}"):
        if mode == "kill-running":
            _until_the_server_has_it_running()
        os.kill(os.getpid(), signal.SIGTERM if stop else signal.SIGKILL)
        if mode == "stop-wait":
            STOPPING.wait(timeout=60)


def _first_time(name: str) -> bool:
    """Whether the marker `name` in the heartbeat folder is new (it is made now): an injected fault happens once."""
    fs, root = fsspec.core.url_to_fs(worker.heartbeat_dir())
    marker = f"{root.rstrip('/')}/{name}"
    if fs.exists(marker):
        return False
    fs.makedirs(root, exist_ok=True)
    fs.touch(marker)
    return True


@contextlib.contextmanager
def stopped_by_the_stop(stage: str, step):
    """An error raised by the stage while its process stops is the stop's doing (its engine closed under it, its
    role released): raised as Stopped, chained to the error, which Prefect records as a crash, not retried."""
    try:
        yield
    except Exception as error:
        if not STOPPING.is_set():
            raise
        where = stage if step is None else f"{stage} at step {step}"
        raise Stopped(f"stage {where} was stopped with its run ({type(error).__name__}: {error})") from error


def _until_the_server_has_it_running(timeout_s: float = 10.0) -> None:
    """Wait (up to `timeout_s`) until the server records this task run Running."""
    if task_run.id is None:
        return
    deadline = time.monotonic() + timeout_s
    with get_client(sync_client=True) as client:
        while time.monotonic() < deadline:
            try:
                state = client.read_task_run(task_run.id).state
            except Exception:  # noqa: BLE001 - not recorded yet
                state = None
            if state is not None and state.is_running():
                return
            time.sleep(0.1)


TASK_SCOPE_ENV = "RLHF_TASK_SCOPE"
"""The run a driver and its workers share: stage task runs carry it in their Prefect task key, so a worker
serves only its own run's stages when several runs (a schedule beside a manual run) share one server.
`rlhf run` sets it to run.name for its driver and workers; hand-started workers take it from the
environment (give a run's driver and its workers the same value; unset: one run per server)."""
_SCOPED: dict[tuple[str, str], object] = {}


def task_scope() -> str:
    return os.environ.get(TASK_SCOPE_ENV, "")


def scoped(stage_task, scope: str | None = None):
    """The stage's Prefect task with its task key scoped to `scope` (default: this process's task_scope()):
    a task worker subscribes to task keys, so it is handed only runs submitted under the same scope."""
    scope = task_scope() if scope is None else scope
    if not scope:
        return stage_task
    key = (stage_task.task_key, scope)
    if key not in _SCOPED:
        function = stage_task.fn

        @functools.wraps(function)
        def run_scoped(*args, **kwargs):
            return function(*args, **kwargs)

        # Prefect derives a task's key from its function's name (and code) whenever it copies the task (the
        # task worker does): the scope goes into the name.
        run_scoped.__qualname__ = f"{function.__qualname__}@{scope.replace('.', '_')}"
        _SCOPED[key] = stage_task.with_options()
        _SCOPED[key].fn = run_scoped
        _SCOPED[key].task_key = _SCOPED[key].with_options().task_key
    return _SCOPED[key]


def task_run_name(stage: str) -> Callable[..., str]:
    """How a stage's task runs are named in Prefect: `<stage>-<step>` (`rollout-3`, `validate-0`), or the stage's
    name for a stage without a step (`warm_start`, `prepare_actor`). Prefect calls it with the call's
    parameters, named as in the stage function's signature."""

    def name(parameters: dict) -> str:
        step = parameters.get("step")
        return stage if step is None else f"{stage}-{step}"

    return name


def stage_task(function: Callable[..., dict], name: str):
    """The Prefect task of one stage function `function(config, *args)`, its runs named by task_run_name."""

    @functools.wraps(function)
    def run_stage(*args, **kwargs):
        step = kwargs.get("step", args[1] if len(args) > 1 else None)
        if worker.CURRENT is None:
            inject_failure(name, step)
            with stopped_by_the_stop(name, step):
                return function(*args, **kwargs)

        # First thing: the heartbeat says this worker holds the run, so the driver can tell a run
        # whose worker died (resubmit it) from one still waiting for a worker (flows.runtime.dispatch).
        started_at = time.time()  # the driver logs the wait before the stage began (timing_s/dispatch_*)
        with worker.CURRENT.running(str(task_run.id), name, step):
            inject_failure(name, step)

            if is_distributed():  # a sharded role: the other ranks run the same call in lockstep
                broadcast_call((name, args, kwargs))
            config = args[0] if args else kwargs["config"]
            forget_earlier_run(config)
            # Here, not at worker start: the MLflow run exists only once the driver has started the flow.
            start_system_metrics(config, worker.CURRENT.state["role"])
            loads = sum(LOAD_COUNTS.values())
            with stopped_by_the_stop(name, step):
                result = {**function(*args, **kwargs), "worker_started_at": started_at}
            if sum(LOAD_COUNTS.values()) != loads:  # a model was loaded: before another stage can talk to it
                worker.settle_heap()
            worker.publish_result(str(task_run.id), result)  # the driver's fast path (flows.runtime.dispatch)
            return result

    # No tags: a tagged task asks the server for tag concurrency slots on every run, which cost
    # about 2 s per stage here even with no limits defined.
    return task(run_stage, name=name, cache_policy=NO_CACHE, task_run_name=task_run_name(name))
