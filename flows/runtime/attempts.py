"""Which Prefect flow runs worked on a run, and how each one ended.

run.json lists the attempts that worked on the run (`attempts`: the flow run and its run_count). A driver that
dies without a word (SIGKILL, a lost machine) leaves its flow run and the task runs it had submitted Running on
the server forever; the next attempt (`rlhf resume`, or a retry of a deployment's flow run) ends them Crashed
before it starts. A driver stopped by SIGTERM or Ctrl-C ends its own flow run Cancelled (`end_stopped`).

A deployment's flow run whose process died is Crashed by its Prefect worker, which then runs the flow's
on_crashed hook: `retry_crashed` ends the dead attempt's task runs Crashed and puts the flow run back in its
work pool's queue (AwaitingRetry), where the next attempt resumes it (flows.runtime.driver.for_this_flow_run),
or, after trainer.max_attempts crashed attempts, ends it Failed.
"""

from __future__ import annotations

import datetime
import os
import socket

from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import (FlowRunFilter, FlowRunFilterId, TaskRunFilter, TaskRunFilterState,
                                           TaskRunFilterStateType)
from prefect.client.schemas.objects import StateType
from prefect.states import AwaitingRetry, Cancelled, Crashed, Failed

from flows.runtime.recovery import read_run_record, run_record_path, write_run_record
from storage import RunLayout

ACTIVE: dict[str, str] = {}
"""run name -> the id of the flow run now running it in this process (set by record_attempt)."""
_UNFINISHED = [StateType.PENDING, StateType.RUNNING, StateType.SCHEDULED, StateType.CANCELLING]


def record_attempt(layout: RunLayout, flow_run_id: str | None, run_count: int = 1) -> list[str]:
    """Append this attempt (the flow run and its run_count) to run.json's attempts; return the ids of the earlier
    flow runs (not this one: a retried flow run's earlier attempts are its own, see end_own_dead_attempt)."""
    if not flow_run_id:
        return []
    ACTIVE[layout.run_name] = flow_run_id
    if not layout.exists(run_record_path(layout)):
        return []
    record = read_run_record(layout)
    attempts = record.get("attempts", [])
    if not any(attempt["flow_run_id"] == flow_run_id and attempt.get("run_count", 1) == run_count
               for attempt in attempts):
        record["attempts"] = [*attempts, {
            "flow_run_id": flow_run_id, "run_count": run_count, "host": socket.gethostname(), "pid": os.getpid(),
            "started": datetime.datetime.now(datetime.timezone.utc).isoformat()}]
        write_run_record(layout, record)
    return list(dict.fromkeys(attempt["flow_run_id"] for attempt in attempts if attempt["flow_run_id"] != flow_run_id))


def _end(flow_run_id: str, new_state, only_unfinished_flow: bool, flow: bool = True) -> tuple[bool, int]:
    """Set a flow run's state (unless not `flow`) and its unfinished task runs' states to `new_state()`; returns
    (whether the flow run's state changed, how many task runs changed)."""
    with get_client(sync_client=True) as client:
        try:
            flow_run = client.read_flow_run(flow_run_id)
        except Exception:  # noqa: BLE001 - another server, or deleted: nothing to tidy
            return False, 0
        changed = flow and (not only_unfinished_flow or flow_run.state is None or flow_run.state.type in _UNFINISHED)
        if changed:
            client.set_flow_run_state(flow_run_id, new_state(), force=True)
        task_runs = client.read_task_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])),
            task_run_filter=TaskRunFilter(state=TaskRunFilterState(type=TaskRunFilterStateType(any_=_UNFINISHED),
                                                                   name=None)))
        for task_run in task_runs:
            client.set_task_run_state(task_run.id, new_state(), force=True)
        return changed, len(task_runs)


def end_dead_attempts(flow_run_ids: list[str]) -> list[str]:
    """Mark the earlier attempts that never ended (their driver died) Crashed, with their unfinished task
    runs; returns one line per attempt changed."""
    lines = []
    for flow_run_id in flow_run_ids:
        message = "its driver died; a later attempt continues the run"
        try:
            changed, count = _end(flow_run_id, lambda: Crashed(message=message), only_unfinished_flow=True)
        except Exception as error:  # noqa: BLE001 - tidying the UI must not stop a resume
            lines.append(f"could not mark the earlier flow run {flow_run_id} Crashed: {error}")
            continue
        if changed:
            lines.append(f"earlier attempt {flow_run_id} never ended (its driver died): marked Crashed, with its "
                         f"{count} unfinished task run(s)")
        elif count:
            lines.append(f"earlier attempt {flow_run_id}: its {count} unfinished task run(s) marked Crashed")
    return lines


def end_stopped(run_name: str, reason: str) -> None:
    """The flow run of `run_name` in this process was stopped (SIGTERM, Ctrl-C): Cancelled, with its task runs."""
    flow_run_id = ACTIVE.pop(run_name, None)
    if flow_run_id is None:
        return
    try:
        _end(flow_run_id, lambda: Cancelled(message=reason), only_unfinished_flow=False)
    except Exception:  # noqa: BLE001 - the server may be gone too; the run is resumable either way
        pass


def end_own_dead_attempt(flow_run_id: str) -> list[str]:
    """A retried flow run, before its new attempt submits anything: the task runs its dead attempt left unfinished
    (when no worker's on_crashed hook ended them: a retry from the UI, a lost worker) end Crashed."""
    try:
        _, count = _end(flow_run_id, lambda: Crashed(message="an earlier attempt of this flow run died"),
                        only_unfinished_flow=True, flow=False)
    except Exception as error:  # noqa: BLE001 - tidying the UI must not stop a resume
        return [f"could not mark the earlier attempt's task runs Crashed: {error}"]
    return [f"the earlier attempt of this flow run left {count} unfinished task run(s): marked Crashed"] if count else []


def retry_crashed(flow_run_id: str, max_attempts: int) -> str:
    """A deployment's flow run whose process died, now Crashed (called in its Prefect worker): its unfinished task
    runs end Crashed, then the flow run goes back to its work pool's queue (AwaitingRetry: the next attempt
    resumes the run) unless it has crashed `max_attempts` times, counted in its state history: then it ends
    Failed. Returns what was done, in one line."""
    with get_client(sync_client=True) as client:
        flow_run = client.read_flow_run(flow_run_id)
        if flow_run.state is None or not flow_run.state.is_crashed():  # handled already, or not a crash
            return f"flow run {flow_run_id} is {flow_run.state.type.value if flow_run.state else 'stateless'}: left as it is"
        crashes = sum(state.type == StateType.CRASHED for state in client.read_flow_run_states(flow_run_id))
        run_name = flow_run.name  # the run's name (flows.training.train.flow_run_name)
    _, count = _end(flow_run_id, lambda: Crashed(message="the flow-run process died"), only_unfinished_flow=True,
                    flow=False)
    tidied = f"; its {count} unfinished task run(s) marked Crashed" if count else ""
    with get_client(sync_client=True) as client:
        if crashes >= max_attempts:
            message = (f"the flow-run process died in {crashes} of trainer.max_attempts={max_attempts} attempts: not "
                       f"retried again; find the cause in the flow run's logs, then: rlhf resume {run_name}")
            client.set_flow_run_state(flow_run_id, Failed(message=message))
            return f"Failed: {message}{tidied}"
        message = (f"the flow-run process died (attempt {crashes} of trainer.max_attempts={max_attempts}): retried; "
                   f"the next attempt resumes {run_name} at its latest checkpoint")
        result = client.set_flow_run_state(flow_run_id, AwaitingRetry(message=message))
    if result.state is None or not result.state.is_scheduled():
        return f"could not retry the flow run: {result.details}{tidied}"
    return f"AwaitingRetry: {message}{tidied}"
