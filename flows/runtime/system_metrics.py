"""System metrics (CPU, memory, disk, network, and GPU when NVML works) of a process, in the run's MLflow run.

    monitor = start_system_metrics(config, "actor")   # in a role's worker, once it serves a stage
    ...
    stop_system_metrics()                             # when the worker stops

MLflow's `SystemMetricsMonitor` samples in a background thread and logs under
`system/<node id>/<metric>` (e.g. `system/actor/cpu_utilization_percentage`,
`system/actor/gpu_0_utilization_percentage`), so every role's process has its own series in the
same run. The node id is the role; MLflow's MLFLOW_SYSTEM_METRICS_NODE_ID environment variable,
when set, takes precedence (as do MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL and
MLFLOW_SYSTEM_METRICS_SAMPLES_BEFORE_LOGGING over the arguments). The monitor stops by itself once
the run is no longer RUNNING.

Best effort: these functions never raise; a failure is logged at debug level and gives None.
One monitor per process: starting again for the same run returns the running monitor (cheap, no
store query), starting for another run stops the old one first.
"""

from __future__ import annotations

import logging
import threading

import mlflow
from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

from flows.config import Config
from flows.runtime.tracking import find_active_run_id, tracking_uri

DEFAULT_SAMPLING_INTERVAL_S = 5.0
DEFAULT_SAMPLES_BEFORE_LOGGING = 1

_logger = logging.getLogger(__name__)
_lock = threading.Lock()
_current: dict = {"key": None, "run_id": None, "monitor": None}
"""This process's monitor, the (tracking uri, experiment, run name, role) it was started for, and its run id."""


def _alive(monitor) -> bool:
    thread = getattr(monitor, "_process", None)
    return thread is not None and thread.is_alive()


def _stop(monitor) -> None:
    try:
        monitor.finish()
    except Exception:  # noqa: BLE001 - best effort
        _logger.debug("stopping the system metrics monitor failed", exc_info=True)


def start_system_metrics(config: Config, role: str, *, sampling_interval: float = DEFAULT_SAMPLING_INTERVAL_S,
                         samples_before_logging: int = DEFAULT_SAMPLES_BEFORE_LOGGING,
                         resume_logging: bool = True) -> object | None:
    """Log this process's system metrics to the run's RUNNING MLflow run, with node id `role`.

    Returns the running `SystemMetricsMonitor`, or None when no RUNNING run of that name exists yet
    or anything fails (never raises). `resume_logging` continues after the run's last system-metric
    step, so a restarted worker does not log over earlier samples.
    """
    try:
        key = (config.tracking.tracking_uri, config.tracking.experiment, config.run.name, role)
        with _lock:
            monitor = _current["monitor"]
            if monitor is not None and _current["key"] == key and _alive(monitor):
                return monitor
            run_id = find_active_run_id(config)
            if monitor is not None and _current["run_id"] == run_id and _current["key"] == key and _alive(monitor):
                return monitor
            if monitor is not None:
                _stop(monitor)
                _current.update(key=None, run_id=None, monitor=None)
            if run_id is None:
                return None
            uri = tracking_uri(config)
            mlflow.set_tracking_uri(uri)
            monitor = SystemMetricsMonitor(run_id, sampling_interval=sampling_interval,
                                           samples_before_logging=samples_before_logging,
                                           resume_logging=resume_logging, node_id=role, tracking_uri=uri)
            monitor.start()
            if monitor._process is None:  # the thread could not start (MLflow logged why)
                return None
            _current.update(key=key, run_id=run_id, monitor=monitor)
            return monitor
    except Exception:  # noqa: BLE001 - system metrics must never break training
        _logger.debug("system metrics not started for role %s", role, exc_info=True)
        return None


def stop_system_metrics(monitor: object | None = None) -> None:
    """Stop `monitor` (default: this process's current one) and flush what it sampled. Never raises."""
    with _lock:
        current = _current["monitor"]
        target = monitor if monitor is not None else current
        if target is None:
            return
        if target is current:
            _current.update(key=None, run_id=None, monitor=None)
    _stop(target)
