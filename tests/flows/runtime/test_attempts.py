"""flows.runtime.attempts: run.json lists every attempt, a retried flow run's too."""

from __future__ import annotations

import json

from flows.runtime.attempts import record_attempt
from flows.runtime.recovery import run_record_path, write_run_record
from storage import RunLayout


def test_each_attempt_is_recorded_once_and_only_other_flow_runs_are_returned_as_earlier(tmp_path):
    layout = RunLayout(str(tmp_path), "run")
    layout.fs.makedirs(layout.run_dir, exist_ok=True)
    write_run_record(layout, {"config": {}})
    assert record_attempt(layout, "flow-a") == []
    assert record_attempt(layout, "flow-a") == []  # the same attempt again (a second call): not a new entry
    assert record_attempt(layout, "flow-a", run_count=2) == []  # Prefect retried flow-a: its own attempt
    assert record_attempt(layout, "flow-b") == ["flow-a"]  # `rlhf resume`: a new flow run; flow-a is earlier
    attempts = json.loads((tmp_path / "run" / "run.json").read_text())["attempts"]
    assert [(attempt["flow_run_id"], attempt["run_count"]) for attempt in attempts] == [
        ("flow-a", 1), ("flow-a", 2), ("flow-b", 1)]
    assert record_attempt(layout, None) == []  # outside a flow run: nothing recorded
    assert run_record_path(layout).endswith("run/run.json")
