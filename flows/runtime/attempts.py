"""Which Prefect flow runs worked on a run, and how each one ended.

run.json lists the flow runs that worked on the run (`attempts`). A driver that dies without a word
(SIGKILL, a lost machine) leaves its flow run and the task runs it had submitted Running on the server
forever; the next attempt (`rlhf resume`, or Prefect retrying a deployment's flow run) ends them Crashed
before it starts. A driver stopped by SIGTERM or Ctrl-C ends its own flow run Cancelled (`end_stopped`).
"""

from __future__ import annotations

import datetime
import os
import socket

from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import (FlowRunFilter, FlowRunFilterId, TaskRunFilter, TaskRunFilterState,
                                           TaskRunFilterStateType)
from prefect.client.schemas.objects import StateType
from prefect.states import Cancelled, Crashed

from flows.runtime.recovery import read_run_record, run_record_path, write_run_record
from storage import RunLayout

ACTIVE: dict[str, str] = {}
"""run name -> the id of the flow run now running it in this process (set by record_attempt)."""
_UNFINISHED = [StateType.PENDING, StateType.RUNNING, StateType.SCHEDULED, StateType.CANCELLING]


def record_attempt(layout: RunLayout, flow_run_id: str | None) -> list[str]:
    """Append this flow run to run.json's attempts; return the ids of the earlier ones."""
    if not flow_run_id:
        return []
    ACTIVE[layout.run_name] = flow_run_id
    if not layout.exists(run_record_path(layout)):
        return []
    record = read_run_record(layout)
    earlier = [attempt["flow_run_id"] for attempt in record.get("attempts", [])]
    if flow_run_id not in earlier:
        record["attempts"] = [*record.get("attempts", []), {
            "flow_run_id": flow_run_id, "host": socket.gethostname(), "pid": os.getpid(),
            "started": datetime.datetime.now(datetime.timezone.utc).isoformat()}]
        write_run_record(layout, record)
    return [run_id for run_id in earlier if run_id != flow_run_id]


def _end(flow_run_id: str, new_state, only_unfinished_flow: bool) -> tuple[bool, int]:
    """Set a flow run's state and its unfinished task runs' states to `new_state()`; returns (whether the flow
    run's state changed, how many task runs changed)."""
    with get_client(sync_client=True) as client:
        try:
            flow_run = client.read_flow_run(flow_run_id)
        except Exception:  # noqa: BLE001 - another server, or deleted: nothing to tidy
            return False, 0
        changed = not only_unfinished_flow or flow_run.state is None or flow_run.state.type in _UNFINISHED
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
