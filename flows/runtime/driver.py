"""The driver's side of a run: dispatching stages, skipping finished ones, the weight hand-overs the stages'
declarations ask for (flows/runtime/weights/handover.py), checkpoints, resumption.

The driver holds no model: the MLflow tracker, the KL controller's coefficient and where the run
stands. `start_run` begins a run or, with run.resume, continues it from its latest checkpoint.
"""

from __future__ import annotations

import datetime
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

from prefect.runtime import flow_run

from components.algorithms import make_kl_controller
from flows.config import Config, ConfigError, RunConfig, layout_for, worker_role
from flows.runtime.artifacts import PrefectArtifacts, recorded_rows
from flows.runtime.batches import batches_for
from flows.runtime.dispatch import ProgressRelay, RemoteStage
from flows.runtime.checkpoints import CHECKPOINT_QUIET_S, in_background, wait_written
from flows.runtime.console import long_work
from flows.runtime.attempts import end_dead_attempts, end_own_dead_attempt, record_attempt
from flows.runtime.recovery import (check_step_files, commit_checkpoint, driver_state, finished_stage_metrics,
                                    latest_checkpoint, read_run_record, record_resume_changes, record_stage_metrics,
                                    repair_latest_pointer, run_record_path, write_run_record)
from flows.runtime.residents import release_run
from flows.runtime.supervision import STOPPING
from flows.runtime.system_metrics import start_system_metrics, stop_system_metrics
from flows.runtime.tasks import scoped
from flows.runtime.tracking import Tracker, flow_run_tags, tracking_uri
from flows.runtime.weights import HandOvers, changes_policy_weights, needs_policy_weights, transport_for
from flows.runtime.worker import heartbeat_dir, read_heartbeats


@dataclass
class Pending:
    stage: object  # its declaration (flows/training/registry.py): name, role, task, output
    step: int | None
    handle: object = None
    metrics: dict | None = None  # set when the stage had already finished (a resumed run)
    handed_over: dict = field(default_factory=dict)  # the metrics of the weights senders waited for before it


@dataclass
class RunState:
    config: Config
    tracker: Tracker
    kl_controller: object
    artifacts: PrefectArtifacts
    start_step: int = 0
    logged: dict[str, int] = field(default_factory=dict)  # metric -> last step MLflow holds (resumed run)
    history: list[dict[str, float]] = field(default_factory=list)
    ahead: dict[int, Pending] = field(default_factory=dict)  # step -> its rollout, started a step early
    relay: ProgressRelay = field(default_factory=ProgressRelay)  # the workers' progress lines, on this terminal
    unsettled: tuple | None = None
    """(step, roles, driver state) of the checkpoint whose roles' parts are still being written."""
    handovers: HandOvers = field(init=False, repr=False)
    """The actor's weights senders still running beside the stages they feed."""

    def __post_init__(self) -> None:
        self.handovers = HandOvers(self.config, self._start, self.wait)

    def run(self, stage, *args) -> dict[str, float]:
        """Run one stage and wait for it; return its metrics."""
        return self.wait(self.submit(stage, *args))

    def submit(self, stage, *args) -> Pending:
        """Start a stage (its registry declaration) on its role's worker (execution=workers; the actor's for a LoRA
        run's reference: flows.config.worker_role) or a thread of
        this process, unless a resumed run finds it finished. A stage that needs the policy's weights gets
        their sender beside it; one that changes them waits for every sender first (weights/handover.py)."""
        if needs_policy_weights(stage):
            return self.handovers.submit(stage, *args)
        handed_over = self.handovers.wait() if changes_policy_weights(stage) else {}
        pending = self._start(stage, *args)
        pending.handed_over = handed_over
        return pending

    def _start(self, stage, *args) -> Pending:
        trainer = self.config.trainer
        step = args[0] if args else None
        pending = Pending(stage, step)
        if self.config.run.resume:
            pending.metrics = finished_stage_metrics(layout_for(self.config), stage, step, self.config.samples_per_step,
                                                     batches_for(self.config))
            if pending.metrics is not None:
                return pending
        if trainer.execution == "workers" and stage.role != "driver":
            pending.handle = RemoteStage(scoped(stage.task), stage.name, stage.role, (self.config, *args),
                                         worker_timeout_s=trainer.worker_timeout_s, worker_wait_s=trainer.worker_wait_s,
                                         stage_timeout_s=trainer.stage_timeout_s, retries=trainer.stage_retries,
                                         relay=self.relay, worker_role=worker_role(self.config, stage.role))
        else:
            pending.handle = stage.task.with_options(retries=trainer.stage_retries).submit(self.config, *args)
        return pending

    def wait(self, pending: Pending) -> dict[str, float]:
        if pending.handed_over:
            return {**pending.handed_over, **self._wait(pending)}
        return self._wait(pending)

    def _wait(self, pending: Pending) -> dict[str, float]:
        if pending.metrics is not None:
            return pending.metrics
        if isinstance(pending.handle, RemoteStage):
            result = pending.handle.result()
            metrics = result["metrics"]
            if (dispatch_s := pending.handle.dispatch_s(result)) is not None:
                metrics = {**metrics, f"timing_s/dispatch_{pending.stage.name}": dispatch_s}
        else:  # the timeout bounds the driver's wait: a thread running the stage cannot be interrupted
            metrics = pending.handle.result(timeout=self.config.trainer.stage_timeout_s)["metrics"]
        record_stage_metrics(layout_for(self.config), pending.stage, pending.step, metrics)
        return metrics

    def committed_policy(self, version: int) -> str | None:
        """The stored copy of policy `version` once committed (what the export reads; under workers the actor's
        worker writes it), after the hand-overs still under way; None for the initial policy (version 0)."""
        self.handovers.wait()
        return transport_for(self.config).committed_copy(version) if version else None

    def finish(self, status: str) -> None:
        """The run ends with `status` (MLflow's): the checkpoint being written is committed (kept for the
        resume), senders still waiting for their stage's pull are told to stop, the MLflow run ends."""
        try:
            self.settle_checkpoint(stopping=True)
        except Exception as error:  # noqa: BLE001 - not instead of the error that ends the run
            print(f"the checkpoint being written could not be committed: {error}")
        self.handovers.abandon()
        stop_system_metrics()
        self.tracker.finish(status)

    def gpus(self) -> int:
        """GPUs the run computes on (verl's n_gpus in perf/throughput): the distinct GPUs of its workers'
        heartbeats under trainer.execution=workers, else 1 (one process: one GPU, or the CPU counted as 1)."""
        if self.config.trainer.execution != "workers":
            return 1
        devices = {(beat.get("host"), device) for beat in read_heartbeats(heartbeat_dir())
                   for device in str(beat.get("devices") or "cpu").split(",") if device not in ("", "cpu")}
        return max(1, len(devices))

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """Log, never twice for one metric and step, also across a resume."""
        fresh = {key: value for key, value in metrics.items() if step > self.logged.get(key, -1)}
        if fresh:
            self.tracker.log_metrics(fresh, step=step)

    def already_logged(self, step: int) -> bool:
        return step <= self.logged.get("timing_s/step", -1)

    def checkpoint(self, step: int, stages: list) -> dict[str, float]:
        """Checkpoint the state at the start of `step`: roles first, then the driver and the pointer; the
        roles' parts in the background (flows/runtime/checkpoints.py): committed by `settle_checkpoint`."""
        metrics: dict[str, float] = {}
        for pending in [self.submit(stage, step) for stage in stages]:
            metrics |= self.wait(pending)
        self.unsettled = (step, [stage.role for stage in stages], {"kl_controller": self.kl_controller.state_dict()})
        if not in_background(self.config, step):
            self.settle_checkpoint()
        return metrics

    def settle_checkpoint(self, stopping: bool = False) -> dict[str, float]:
        """Commit the checkpoint whose roles' parts are being written, once they are (before the next update
        changes the roles). A part that will not be committed fails the run; `stopping` (the run ends
        already): it is only said."""
        if self.unsettled is None:
            return {}
        (step, roles, state), self.unsettled = self.unsettled, None
        layout, started = layout_for(self.config), time.perf_counter()
        who = "the run, stopping," if stopping else "the next update"
        what = f"checkpoint at step {step}: {who} waits for the {' and '.join(roles)} to write it"
        with long_work(what, f"{what}: {{seconds:.0f}} s so far",
                       f"checkpoint at step {step}: waited {{seconds:.1f}} s for its writing",
                       announce_after_s=CHECKPOINT_QUIET_S):
            missing = {role: why for role in roles if (why := wait_written(layout, step, role)) is not None}
        for role, why in missing.items():
            latest = latest_checkpoint(layout)
            message = (f"checkpoint at step {step}: the {role}'s part was not written ({why}); the latest "
                       f"checkpoint stays {'none' if latest is None else f'step {latest}'}")
            if stopping:
                print(message)
                return {}
            raise RuntimeError(f"{message}; `rlhf resume {layout.run_name}` restarts from it")
        commit_checkpoint(layout, step, state, keep=self.config.trainer.keep_checkpoints)
        return {"timing_s/checkpoint_wait": time.perf_counter() - started}


def run_name_for_this_flow_run(run: RunConfig) -> str:
    """run.name, or with run.name_timestamp (and not resuming) run.name plus the flow run's scheduled start
    time in UTC: the scheduled time, not the clock, so that a retried flow run finds the same folder."""
    if not run.name_timestamp or run.resume:
        return run.name
    start = flow_run.scheduled_start_time or datetime.datetime.now(datetime.timezone.utc)
    return f"{run.name}-{start:%Y%m%d-%H%M%S}"


def for_this_flow_run(config: Config) -> Config:
    """The run's final name (run.name_timestamp) and whether to resume (Prefect retrying the flow run)."""
    run = config.run
    if run.name_timestamp and not run.resume:
        run = run.model_copy(update={"name": run_name_for_this_flow_run(run), "name_timestamp": False})
    config = config.model_copy(update={"run": run})
    layout = layout_for(config)
    if (flow_run.run_count or 1) > 1 and not run.resume and layout.exists(run_record_path(layout)):
        config = config.model_copy(update={"run": run.model_copy(update={"resume": True})})
    return config


def start_run(config: Config, lineage: dict | None = None) -> RunState:
    """A new run (refusing to overwrite an earlier one by accident) or, with run.resume, the same run
    continued: same MLflow run, the KL controller and the step of its latest checkpoint.

    A new run records its `lineage` (what it starts from: the resolved data files, the run and step of
    model.from_run) in run.json and in MLflow; a resumed run keeps the lineage it started with. Either way the
    MLflow run is tagged with the Prefect flow run now running it (flows.runtime.tracking.flow_run_tags)."""
    layout = layout_for(config)
    ctrl = config.algorithm.kl_ctrl
    controller = make_kl_controller(ctrl.type, ctrl.kl_coef, target_kl=ctrl.target_kl, horizon=ctrl.horizon)
    STOPPING.clear()  # a run starting in this process (the Python API after a stopped one) is not being stopped
    release_run(config)
    if config.precision_warning:
        print(config.precision_warning)
    if config.run.resume:
        record = read_run_record(layout)
        tracker = Tracker(config, run_id=record["mlflow_run_id"])
        tracker.client.update_run(tracker.run_id, status="RUNNING")
        for line in _verify_for_resume(layout, config, tracker):
            print(line)
        start_step = latest_checkpoint(layout) or 0
        if start_step:
            controller.load_state_dict(driver_state(layout, start_step)["kl_controller"])
        history = {key: {m.step: m.value for m in tracker.client.get_metric_history(tracker.run_id, key)}
                   for key in tracker.client.get_run(tracker.run_id).data.metrics}
        logged = {key: max(values, default=-1) for key, values in history.items()}
        # The Prefect metrics table starts with the steps the earlier attempts finished, as MLflow holds them.
        rows = recorded_rows(history, through_step=start_step)
        state_kwargs = {"start_step": start_step, "logged": logged}
    else:
        if layout.exists(layout.run_dir):
            if not config.run.overwrite:
                raise ConfigError(
                    f"run.name={config.run.name!r}: {layout.run_dir} already exists; choose another run.name, "
                    "resume it (rlhf resume), or set run.overwrite=true to start it over")
            if not layout.exists(run_record_path(layout)):
                raise ConfigError(
                    f"run.overwrite=true: {layout.run_dir} holds no run.json, so it is not a run of this project; "
                    "it is left as it is; choose another run.name or run.storage_root")
            layout.fs.rm(layout.run_dir, recursive=True)  # not a live run: the caller holds the run's lock
        layout.fs.makedirs(layout.run_dir, exist_ok=True)
        tracker = Tracker(config)
        write_run_record(layout, {"config": _with_absolute_paths(config), "mlflow_run_id": tracker.run_id,
                                  "created": _now(), "lineage": lineage or {}})
        if lineage:
            tracker.log_lineage(lineage)
        state_kwargs, rows = {}, []
    flow_run_id, run_count = (str(flow_run.id) if flow_run.id else None), flow_run.run_count or 1
    lines = end_dead_attempts(record_attempt(layout, flow_run_id, run_count))
    if flow_run_id and run_count > 1:  # a retried flow run: its own dead attempt's task runs, before any is submitted
        lines += end_own_dead_attempt(flow_run_id)
    for line in lines:
        print(line)
    tracker.set_tags(flow_run_tags())
    start_system_metrics(config, "driver")
    artifacts = PrefectArtifacts(config, tracker.uri, tracker.experiment_id, tracker.run_id, rows=rows)
    return RunState(config=config, tracker=tracker, kl_controller=controller, artifacts=artifacts, **state_kwargs)


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat()


def _verify_for_resume(layout, config: Config, tracker: Tracker) -> list[str]:
    """Before a resume restores anything: the checkpoint pointer is whole (rebuilt when missing), every step's
    stage files validate (flows.runtime.recovery), and what the resume changed in the config (its overrides) is
    kept in run.json and tagged in MLflow. One line per finding."""
    lines = [line for line in [repair_latest_pointer(layout)] if line]
    lines += check_step_files(layout, latest_checkpoint(layout) or 0, batches_for(config))
    changes, resumes = record_resume_changes(layout, _with_absolute_paths(config), _now())
    if changes:
        tracker.set_tags({f"rlhf.resume.{resumes}.changed": json.dumps(changes)[:5000]})
        lines.append("resumed with " + ", ".join(f"{key}={after!r} (was {before!r})"
                                                 for key, (before, after) in changes.items()))
    return lines


def _with_absolute_paths(config: Config) -> dict:
    """The config as recorded for `rlhf resume` / `rlhf export`: local paths made absolute, so that
    they work from any working directory."""
    def absolute(path):
        return str(Path(path).resolve()) if path and Path(path).exists() else path

    record = config.model_dump(mode="json")
    record["model"]["path"] = absolute(record["model"]["path"])
    record["data"]["train_files"] = [absolute(path) for path in record["data"]["train_files"]]
    record["data"]["val_files"] = [absolute(path) for path in record["data"]["val_files"]]
    record["run"]["storage_root"] = absolute(record["run"]["storage_root"])
    if record["tracking"]["tracking_uri"].startswith("sqlite:///"):
        record["tracking"]["tracking_uri"] = tracking_uri(config)
    return record
