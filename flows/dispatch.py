"""Running a stage on its role's worker, and telling a slow stage from a dead worker.

A stage submitted with `task.delay(...)` is picked up by a live task worker serving it. The driver
polls the task run's state and the workers' heartbeat files (flows.worker): a run held by a worker
whose heartbeat went stale (killed, machine lost) is marked Crashed and submitted again. Stages write
their output atomically and are a pure function of (config, step), so a second attempt cannot
duplicate or lose samples.
"""

from __future__ import annotations

import time
from typing import Any

from flows.worker import STAGE_ROLE, heartbeat_dir, read_heartbeats

POLL_INTERVAL_S = 0.2
MAX_RESUBMITS = 3


class WorkerLostError(RuntimeError):
    pass


class RemoteStage:
    """One stage dispatched to its role's workers; `result()` waits, resubmitting when a worker dies."""

    def __init__(self, stage_task, stage: str, args: tuple, *, worker_timeout_s: float, worker_wait_s: float,
                 stage_timeout_s: float):
        self.task, self.stage, self.args = stage_task, stage, args
        self.role = STAGE_ROLE[stage]
        self.worker_timeout_s, self.worker_wait_s, self.stage_timeout_s = worker_timeout_s, worker_wait_s, stage_timeout_s
        self.resubmits = 0
        self._submit()

    def _submit(self) -> None:
        self.future = self.task.delay(*self.args)
        self.submitted_at = time.monotonic()
        self.running_since: float | None = None

    def result(self) -> Any:
        from prefect.client.orchestration import get_client

        with get_client(sync_client=True) as client:
            while True:
                state = client.read_task_run(self.future.task_run_id).state
                if state is not None and state.is_final():
                    return self.future.result()
                if self._lost(state):
                    self._resubmit(client)
                elif time.monotonic() - self.submitted_at > self.stage_timeout_s:
                    raise TimeoutError(f"stage {self.stage} did not finish within trainer.stage_timeout_s="
                                       f"{self.stage_timeout_s:.0f} s")
                time.sleep(POLL_INTERVAL_S)

    def _live_workers(self) -> list[dict]:
        now = time.time()
        return [beat for beat in read_heartbeats(heartbeat_dir())
                if beat.get("role") == self.role and now - beat.get("beat", 0) < self.worker_timeout_s]

    def _lost(self, state) -> bool:
        """True when the task run's worker is gone; raises when no worker of the role shows up."""
        now = time.monotonic()
        if state is None or not state.is_running():
            if now - self.submitted_at > self.worker_wait_s and not self._live_workers():
                raise WorkerLostError(
                    f"no live worker for role {self.role!r} after {self.worker_wait_s:.0f} s "
                    f"(trainer.worker_wait_s); start one: rlhf worker --role {self.role} --devices ...")
            return False
        self.running_since = self.running_since or now
        holder = [beat for beat in self._live_workers() if str(self.future.task_run_id) in beat.get("running", [])]
        return not holder and now - self.running_since > self.worker_timeout_s

    def _resubmit(self, client) -> None:
        from prefect.states import Crashed

        if self.resubmits >= MAX_RESUBMITS:
            raise WorkerLostError(f"stage {self.stage} lost its {self.role} worker {self.resubmits + 1} times")
        try:  # for the UI: the abandoned attempt is not still "Running"
            client.set_task_run_state(self.future.task_run_id, Crashed(message="its worker stopped answering"),
                                      force=True)
        except Exception:  # noqa: BLE001 - the resubmission matters, the cosmetic state does not
            pass
        self.resubmits += 1
        self._submit()
