"""flows.runtime.tasks: fault injection (RLHF_INJECT_FAILURE), a stage task run in the flow's own process, and
the names of its task runs."""

from __future__ import annotations

import pytest
from prefect._internal.engine import resolve_custom_task_run_name
from prefect.utilities.callables import get_call_parameters

from flows.runtime import worker
from flows.runtime.tasks import inject_failure, stage_task


def test_the_named_stage_at_the_named_step_fails_and_no_other(monkeypatch):
    monkeypatch.setenv("RLHF_INJECT_FAILURE", "reward:2")
    with pytest.raises(RuntimeError, match=r"injected failure in stage reward at step 2 \(RLHF_INJECT_FAILURE=reward:2\)"):
        inject_failure("reward", 2)
    inject_failure("reward", 1)  # another step
    inject_failure("reward", 12)  # not a prefix match
    inject_failure("reference", 2)  # another stage
    inject_failure("rewards", 2)


def test_nothing_is_injected_without_the_variable_or_for_a_kill_of_another_step(monkeypatch):
    monkeypatch.delenv("RLHF_INJECT_FAILURE", raising=False)
    inject_failure("reward", 2)
    monkeypatch.setenv("RLHF_INJECT_FAILURE", "")
    inject_failure("reward", 2)
    monkeypatch.setenv("RLHF_INJECT_FAILURE", "reward:3:kill")  # this process would be killed at step 3 only
    inject_failure("reward", 2)
    inject_failure("reference", 3)


def test_a_stage_task_in_the_flows_process_injects_by_the_step_argument_then_runs_the_function(monkeypatch):
    monkeypatch.setattr(worker, "CURRENT", None)  # not a worker: the task only runs the function
    calls = []

    def reward(config, step):
        calls.append((config, step))
        return {"path": f"steps/{step}/reward.parquet", "metrics": {}}

    run = stage_task(reward, "reward").fn
    monkeypatch.setenv("RLHF_INJECT_FAILURE", "reward:2")
    assert run("config", 1) == {"path": "steps/1/reward.parquet", "metrics": {}}
    with pytest.raises(RuntimeError, match="stage reward at step 2"):
        run("config", 2)
    with pytest.raises(RuntimeError, match="stage reward at step 2"):
        run("config", step=2)
    assert calls == [("config", 1)]  # the injected failure comes before the stage runs


def test_task_runs_are_named_stage_dash_step_from_the_call_as_prefect_binds_it():
    """The engine names a task run from the call's parameters bound to the stage function's signature (the
    task wraps it): what these two Prefect functions do when a task run starts."""
    def rollout(config, step, weights_step=None):
        return {}

    def warm_start(config):
        return {}

    def name(task, *args, **kwargs):
        return resolve_custom_task_run_name(task, get_call_parameters(task.fn, args, kwargs))

    task = stage_task(rollout, "rollout")
    assert name(task, "config", 3) == "rollout-3"
    assert name(task, "config", 0, 2) == "rollout-0"  # the step, not the weights' step
    assert name(task, "config", step=12) == "rollout-12"
    assert name(task.with_options(retries=2), "config", 1) == "rollout-1"  # as the driver submits it
    assert name(stage_task(warm_start, "warm_start"), "config") == "warm_start"  # no step


def test_settling_a_workers_heap_frees_its_garbage_and_leaves_the_living_out_of_later_collections():
    """worker.settle_heap (after a worker's imports, after a stage that loaded a model): garbage is collected
    first, not frozen; what is alive is frozen, so a later full collection does not visit it."""
    import gc
    import weakref

    class Node:
        pass

    garbage = Node()
    garbage.me = garbage  # a cycle: only a collection frees it
    dead = weakref.ref(garbage)
    del garbage
    alive = Node()
    alive.me = alive
    gc.unfreeze()
    try:
        worker.settle_heap()
        assert dead() is None
        assert gc.get_freeze_count() > 0
        assert not any(item is alive for item in gc.get_objects())  # frozen: out of every generation
    finally:
        gc.unfreeze()
    assert any(item is alive for item in gc.get_objects())


def test_a_stop_injected_in_a_stage_signals_this_process_once_and_the_stage_goes_on(monkeypatch, tmp_path):
    """stage:step:stop: SIGTERM to the process running the stage, as `kill` sends it, then the stage goes on (a stop
    arriving while it runs); once, so that the resume of the stopped run passes it."""
    import signal
    import time

    monkeypatch.setenv("RLHF_WORKER_DIR", str(tmp_path))  # where the marker of the injected stop goes
    monkeypatch.setenv("RLHF_INJECT_FAILURE", "rollout:3:stop")
    received = []
    previous = signal.signal(signal.SIGTERM, lambda number, frame: received.append(number))
    try:
        inject_failure("rollout", 2)
        inject_failure("reward", 3)
        inject_failure("rollout", 3)  # returns: the stage goes on
        deadline = time.monotonic() + 5
        while not received and time.monotonic() < deadline:
            time.sleep(0.01)
        inject_failure("rollout", 3)  # the resume's rollout at step 3: no second stop
        time.sleep(0.1)
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert received == [signal.SIGTERM]
    assert (tmp_path / "injected-stop-rollout-3").exists()


def test_a_stage_that_raises_while_its_process_stops_raises_the_stop_not_its_error(monkeypatch):
    """The flow's `finally` released the roles (closed the vLLM engine) under a stage still running on a thread: what
    the stage raises then is the stop's doing. It raises Stopped (a KeyboardInterrupt: Prefect records the task run
    Crashed and retries nothing), its cause chained; without a stop, the stage's error is its own."""
    from flows.runtime.supervision import STOPPING, Stopped

    monkeypatch.setattr(worker, "CURRENT", None)
    monkeypatch.delenv("RLHF_INJECT_FAILURE", raising=False)

    def rollout(config, step):
        raise AttributeError("'NoneType' object has no attribute 'sleep'")

    run = stage_task(rollout, "rollout").fn
    with pytest.raises(AttributeError):
        run("config", 49)
    STOPPING.set()
    try:
        with pytest.raises(Stopped, match=r"^stage rollout at step 49 was stopped with its run \(AttributeError: "
                                          r"'NoneType' object has no attribute 'sleep'\)$") as stopped:
            run("config", 49)
    finally:
        STOPPING.clear()
    assert isinstance(stopped.value, KeyboardInterrupt) and isinstance(stopped.value.__cause__, AttributeError)
