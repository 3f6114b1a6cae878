"""Running a stage on its role's worker, and telling a slow stage from a dead worker.

A stage submitted with `task.delay(...)` is picked up by a live task worker serving it. The driver
polls the task run's state and the workers' heartbeat files (flows.runtime.worker): a run held by a worker
whose heartbeat went stale (killed, machine lost), or handed to a worker that died before it said so,
is marked Crashed and submitted again (RunTracker). Stages write their output atomically and are a
pure function of (config, step), so a second attempt cannot duplicate or lose samples.

While it waits, the driver also prints the workers' progress lines, which their heartbeats carry (ProgressRelay).

A worker that finishes a stage also leaves its return value beside its heartbeat
(`flows.runtime.worker.publish_result`), and the driver takes it from there first: the server records a task
run's Completed state from an event, and Prefect 3.7's task run recorder at times fails its first write
of a background task run's events (a race with the worker's own API write) and retries only at its
next periodic flush, up to 5 s later, which made a 0.05 s reward stage cost 4-5 s on the GPU machine.
"""

from __future__ import annotations

import itertools
import time
from typing import Any

from prefect import get_run_logger
from prefect.client.orchestration import get_client
from prefect.exceptions import MissingContextError
from prefect.states import Crashed

from flows.runtime.console import show
from flows.runtime.worker import heartbeat_dir, read_heartbeats, take_result

POLL_INTERVAL_S = 0.05
"""How often the driver looks for a waited stage's published result (a file beside the heartbeats)."""
SERVER_POLL_EVERY = 4
"""Every how many looks it also reads the task run's state from the server (failures, lost workers)."""
MAX_RESUBMITS = 3


class WorkerLostError(RuntimeError):
    pass


class RunTracker:
    """Decides from the workers' heartbeats whether one submitted task run was lost.

    The server's state of a task run cannot decide it alone: Prefect sends task run states as events,
    so a worker killed right after it took a run may never have reported it Running, and the server
    hands a run to one worker only (a replacement worker never sees it). A run is lost when no live
    worker holds it or is done with it, and either a worker did hold it (or the server says it ran)
    and `timeout_s` passed since, or it never started and a worker of its role sat idle for twice
    `timeout_s` (so it is not just queued behind a busy worker, nor in transit to an idle one). A worker is of
    the role when it serves that role's stages: its own role's, or one its heartbeat's `serves` lists (the
    actor's worker serves a LoRA run's reference, `rlhf worker --also-serve`).
    """

    def __init__(self, task_run_id: str, role: str, timeout_s: float, now: float | None = None):
        self.task_run_id, self.role, self.timeout_s = task_run_id, role, timeout_s
        self.submitted = time.time() if now is None else now
        self.attended: float | None = None  # last time a live worker held the run or was done with it
        self.started = False  # some worker held it once, or the server saw it running

    def observe(self, beats: list[dict], running: bool, now: float | None = None) -> str:
        """"attended", "waiting", "no workers" (no live worker of the role) or "lost"."""
        now = time.time() if now is None else now
        live = [beat for beat in beats if self.role in beat.get("serves", [beat.get("role")])
                and now - beat.get("beat", 0) < self.timeout_s]
        if any(self.task_run_id in beat.get("running", []) or self.task_run_id in beat.get("done", [])
               for beat in live):
            self.attended, self.started = now, True
            return "attended"
        self.started = self.started or running
        quiet_since = max(self.submitted, self.attended or self.submitted)
        if self.started:
            return "lost" if now - quiet_since > self.timeout_s else "waiting"
        if not live:
            return "no workers"
        idle = [beat for beat in live if not beat.get("running") and beat.get("idle_since") is not None]
        if any(now - max(beat["idle_since"], quiet_since) > 2 * self.timeout_s for beat in idle):
            return "lost"  # handed to a worker that died before it said so, while another one waits idle
        return "waiting"


class ProgressRelay:
    """Prints on the driver's terminal the progress lines its workers keep in their heartbeats
    (flows.runtime.worker.Heartbeat.note_progress), each once, prefixed with the role: `[rollout] starting the vLLM
    rollout engine ...`. Lines a worker recorded before the relay started (a long-lived worker's earlier run) are
    skipped; `since` allows CLOCK_SLACK_S of difference between the hosts' clocks."""

    CLOCK_SLACK_S = 5.0

    def __init__(self, since: float | None = None):
        self.since = (time.time() if since is None else since) - self.CLOCK_SLACK_S
        self.printed: dict[tuple, int] = {}  # (host, pid) -> the number of its last line seen

    def relay(self, beats: list[dict]) -> None:
        for beat in beats:
            worker = (beat.get("host"), beat.get("pid"))
            last = self.printed.get(worker, 0)
            for number, at, message in beat.get("progress", []):
                if number > last and at >= self.since:
                    show(f"[{beat.get('role')}] {message}")
                last = max(last, number)
            self.printed[worker] = last


class RemoteStage:
    """One stage dispatched to its role's workers; `result()` waits, resubmitting when a worker dies. `worker_role`:
    the role of the worker that serves it, when not the stage's own (flows.config.worker_role)."""

    def __init__(self, stage_task, stage: str, role: str, args: tuple, *, worker_timeout_s: float,
                 worker_wait_s: float, stage_timeout_s: float, retries: int = 0, relay: ProgressRelay | None = None,
                 worker_role: str | None = None):
        self.task, self.stage, self.role, self.args = stage_task, stage, role, args
        self.worker_role = worker_role or role
        self.relay = relay
        """Prints the workers' progress lines while this stage is waited for (and once more at its end)."""
        self.worker_timeout_s, self.worker_wait_s, self.stage_timeout_s = worker_timeout_s, worker_wait_s, stage_timeout_s
        self.retries = retries
        """trainer.stage_retries: how often a stage that raised is submitted again (a lost worker does not count)."""
        self.resubmits = self.attempt = 0
        self._submit()

    def _submit(self) -> None:
        self.submitted_wall = time.time()
        self.future = self.task.delay(*self.args)
        self.submitted_at = time.monotonic()
        self.tracker = RunTracker(str(self.future.task_run_id), self.role, self.worker_timeout_s)

    def result(self) -> Any:
        try:
            return self._result()
        finally:
            if self.relay is not None:  # what the worker said in the last moments of the stage
                self.relay.relay(list(read_heartbeats(heartbeat_dir())))

    def _result(self) -> Any:
        with get_client(sync_client=True) as client:
            for look in itertools.count():
                # First the result the worker left beside its heartbeat: the server learns a task run's
                # Completed state from an event, and its recorder retries a failed write only every
                # few seconds (a race in Prefect 3.7's task run recorder, seen on short stages).
                found, value = take_result(str(self.future.task_run_id))
                if found:
                    return value
                if look % SERVER_POLL_EVERY:
                    time.sleep(POLL_INTERVAL_S)
                    continue
                state = client.read_task_run(self.future.task_run_id).state
                if state is not None and state.is_final():
                    found, value = take_result(str(self.future.task_run_id))  # published since the look above
                    if found:
                        return value
                    try:
                        return self.future.result()
                    except Exception as error:  # the stage raised: retry as Prefect does in one process
                        if self.attempt >= self.retries:
                            raise
                        self._retry(error)
                        continue
                if self._lost(state):
                    self._resubmit(client)
                elif time.monotonic() - self.submitted_at > self.stage_timeout_s:
                    raise TimeoutError(f"stage {self.stage} did not finish within trainer.stage_timeout_s="
                                       f"{self.stage_timeout_s:.0f} s")
                time.sleep(POLL_INTERVAL_S)

    def _retry(self, error: Exception) -> None:
        """Submit the stage again after it raised, with the line Prefect logs for a retried task."""
        self.attempt += 1
        step = self.args[1] if len(self.args) > 1 else None
        message = (f"stage {self.stage}" + ("" if step is None else f" at step {step}")
                   + f" failed: {type(error).__name__}: {error} - Retry {self.attempt}/{self.retries} will start immediately.")
        try:
            get_run_logger().warning(message)
        except MissingContextError:  # outside a flow run
            print(message, flush=True)
        self._submit()

    def dispatch_s(self, result: dict) -> float | None:
        """Seconds from this stage's submission to its start in a worker (the server's queue and the
        delivery to the worker; host clocks are assumed in step), or None when the result does not say."""
        started = result.get("worker_started_at")
        return None if started is None else max(0.0, started - self.submitted_wall)

    def _lost(self, state) -> bool:
        """True when the task run's worker is gone; raises when no worker of the role shows up."""
        beats = list(read_heartbeats(heartbeat_dir()))
        if self.relay is not None:
            self.relay.relay(beats)
        verdict = self.tracker.observe(beats, running=state is not None and state.is_running())
        if verdict == "no workers" and time.monotonic() - self.submitted_at > self.worker_wait_s:
            also = "" if self.worker_role == self.role else f" --also-serve {self.role}"
            raise WorkerLostError(
                f"no live worker for role {self.role!r} after {self.worker_wait_s:.0f} s "
                f"(trainer.worker_wait_s); start one: rlhf worker --role {self.worker_role}{also} --devices ...")
        return verdict == "lost"

    def _resubmit(self, client) -> None:
        if self.resubmits >= MAX_RESUBMITS:
            raise WorkerLostError(f"stage {self.stage} lost its {self.worker_role} worker {self.resubmits + 1} times")
        try:  # for the UI: the abandoned attempt is not still "Running"
            client.set_task_run_state(self.future.task_run_id, Crashed(message="its worker stopped answering"),
                                      force=True)
        except Exception:  # noqa: BLE001 - the resubmission matters, the cosmetic state does not
            pass
        self.resubmits += 1
        self._submit()
