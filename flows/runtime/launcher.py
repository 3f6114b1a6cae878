"""The embedded local default: a Prefect server of our own when PREFECT_API_URL is not set.

Separate processes (the flow, stage workers, deployment workers) need one shared server, so the
launcher starts `prefect server start` on a free loopback port, with its database under
`.rlhf/prefect` so that the history stays browsable later (`rlhf server`), and stops it on exit.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Iterator

from prefect.logging.handlers import APILogWorker
from prefect.settings import (PREFECT_API_URL, PREFECT_HOME, PREFECT_LOCAL_STORAGE_PATH, PREFECT_SERVER_ANALYTICS_ENABLED,
                              PREFECT_UI_URL, temporary_settings)

from flows.runtime.supervision import PARENT_PID_ENV, tied_to_this_process
from flows.runtime.worker import HEARTBEAT_INTERVAL_S, RESULTS_SUBDIR, free_port, read_heartbeats

DEFAULT_PREFECT_HOME = Path(".rlhf/prefect")
EMBEDDED_SERVERS: dict[str, subprocess.Popen] = {}
"""API URL -> the server process prefect_server started for it (flows.runtime.supervision.ServerWatch)."""
EMBEDDED_UI_URL = "http://127.0.0.1:4200"
"""Where an embedded server's runs can be opened: the UI `prefect server start` serves with the same PREFECT_HOME
(its default port). The embedded server's own port is random and gone once the run ends."""


def server_environment(prefect_home: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update(PREFECT_HOME=str(prefect_home.resolve()), PREFECT_SERVER_ANALYTICS_ENABLED="false",
               PREFECT_LOGGING_LEVEL=env.get("PREFECT_LOGGING_LEVEL", "WARNING"))
    # The task run recorder retries a failed write of task run events at its periodic flush (default
    # every 5 s; Prefect rounds it down to whole seconds): 1 s keeps the UI's states close to the truth.
    env.setdefault("PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_FLUSH_INTERVAL", "1")
    return env


def wait_until_healthy(api_url: str, process: subprocess.Popen | None, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"the Prefect server exited with code {process.returncode} while starting")
        try:
            with urllib.request.urlopen(f"{api_url}/health", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise RuntimeError(f"the Prefect server at {api_url} did not answer within {timeout_s:.0f} s")


@contextlib.contextmanager
def prefect_server(prefect_home: Path = DEFAULT_PREFECT_HOME, port: int | None = None) -> Iterator[str]:
    """Yield a Prefect API URL: PREFECT_API_URL if set, else a server started (and stopped) here."""
    existing = os.environ.get("PREFECT_API_URL")
    if existing:
        yield existing
        return
    prefect_home.mkdir(parents=True, exist_ok=True)
    port = port or free_port()
    api_url = f"http://127.0.0.1:{port}/api"
    log = open(prefect_home / "server.log", "ab")
    # Tied to this process: a driver killed with SIGKILL does not leave its server running.
    process = subprocess.Popen(
        tied_to_this_process([sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1",
                              "--port", str(port)]),
        env=server_environment(prefect_home), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    EMBEDDED_SERVERS[api_url] = process
    try:
        wait_until_healthy(api_url, process)
        yield api_url
    finally:
        EMBEDDED_SERVERS.pop(api_url, None)
        stop_process_groups([process], grace_s=20)
        log.close()


def stop_process_groups(processes: list[subprocess.Popen], grace_s: float) -> None:
    """SIGTERM each process group (the process and its children), SIGKILL what outlives the grace."""
    for process in processes:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
    for process in processes:
        try:
            process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()


@contextlib.contextmanager
def using_prefect_api(api_url: str, prefect_home: Path = DEFAULT_PREFECT_HOME,
                      local_storage_path: str | None = None) -> Iterator[None]:
    """Point this process's Prefect client at `api_url` (settings are read once at import). Links to the runs of an
    embedded server (Prefect's `View at` line, the MLflow tag prefect.flow_run_url) point at EMBEDDED_UI_URL."""
    updates = {PREFECT_API_URL: api_url, PREFECT_SERVER_ANALYTICS_ENABLED: False}
    if api_url in EMBEDDED_SERVERS:
        updates[PREFECT_UI_URL] = EMBEDDED_UI_URL
    if local_storage_path:
        updates[PREFECT_LOCAL_STORAGE_PATH] = local_storage_path
    if not os.environ.get("PREFECT_HOME"):
        prefect_home.mkdir(parents=True, exist_ok=True)
        updates[PREFECT_HOME] = str(prefect_home.resolve())
    with temporary_settings(updates=updates):
        try:
            yield
        finally:
            _drain_logs()


def flow_run_page(flow_run_id: str) -> str | None:
    """The flow run's page a user can open, the one its MLflow run's prefect.flow_run_url tag holds: with no
    PREFECT_API_URL set (the embedded server's run) under EMBEDDED_UI_URL, else on PREFECT_API_URL's server's UI;
    None when no UI is known."""
    api_url = os.environ.get("PREFECT_API_URL")
    if not api_url:
        return f"{EMBEDDED_UI_URL}/runs/flow-run/{flow_run_id}"
    # The UI of the server PREFECT_API_URL names (PREFECT_UI_URL where the user set it), not the settings' UI URL
    # of whatever server context is active in this process (an embedded one's, in a long-lived process).
    ui_url = os.environ.get("PREFECT_UI_URL") or api_url.rstrip("/").removesuffix("/api")
    return f"{ui_url.rstrip('/')}/runs/flow-run/{flow_run_id}"


def _drain_logs() -> None:
    """Send buffered run logs to the server while it is still up (it may stop right after)."""
    try:
        APILogWorker.drain_all(timeout=10)
    except Exception:  # logs are best effort; the run's outcome is decided elsewhere
        pass


class WorkerPool:
    """One worker process per role, pinned to its devices, restarted when it dies; stopped on exit.

    `assignments` maps role -> "cpu" or GPU indices relative to this process's CUDA_VISIBLE_DEVICES.
    Workers get their own process group, so stopping the pool (or Ctrl-C) leaves no orphans, and they exit
    when this process dies, even by SIGKILL (flows.runtime.supervision).
    """

    def __init__(self, assignments: dict[str, object], env: dict[str, str], log_dir: Path, max_restarts: int = 5,
                 preload: dict[str, list[str]] | None = None, also_serve: dict[str, list[str]] | None = None):
        self.assignments = assignments
        self.preload = preload or {}
        """role -> modules its worker imports before serving (`rlhf worker --preload`)."""
        self.also_serve = also_serve or {}
        """role -> the roles without a worker whose stages its worker serves (`rlhf worker --also-serve`)."""
        self.env = env
        self.log_dir = log_dir
        self.max_restarts = max_restarts
        self.processes: dict[str, subprocess.Popen] = {}
        self.restarts: dict[str, int] = {role: 0 for role in assignments}
        self._stopping = threading.Event()
        self._supervisor: threading.Thread | None = None

    @staticmethod
    def devices_argument(assignment) -> str:
        return "cpu" if assignment == "cpu" else ",".join(str(index) for index in assignment)

    def _start(self, role: str) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log = open(self.log_dir / f"worker-{role}.log", "ab")
        command = [sys.executable, "-m", "flows.tools.cli", "worker", "--role", role,
                   "--devices", self.devices_argument(self.assignments[role])]
        command += [argument for module in self.preload.get(role, ()) for argument in ("--preload", module)]
        command += [argument for other in self.also_serve.get(role, ()) for argument in ("--also-serve", other)]
        self.processes[role] = subprocess.Popen(tied_to_this_process(command),
                                                env={**self.env, PARENT_PID_ENV: str(os.getpid())},
                                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()

    def start(self) -> None:
        for role in self.assignments:
            self._start(role)
        self._supervisor = threading.Thread(target=self._supervise, name="rlhf-supervisor", daemon=True)
        self._supervisor.start()

    def _supervise(self) -> None:
        while not self._stopping.wait(0.5):
            for role, process in list(self.processes.items()):
                if process.poll() is None or self._stopping.is_set():
                    continue
                if self.restarts[role] >= self.max_restarts:
                    print(f"worker {role} exited with code {process.returncode}; restart limit "
                          f"({self.max_restarts}) reached", file=sys.stderr)
                    continue
                self.restarts[role] += 1
                print(f"worker {role} (pid {process.pid}) exited with code {process.returncode}; "
                      f"restarting ({self.restarts[role]}/{self.max_restarts})", file=sys.stderr)
                self._start(role)

    def wait_until_ready(self, heartbeat_directory: str, timeout_s: float = 300.0) -> None:
        """Return once every role has a heartbeat from its current process."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            ready = {beat["role"] for beat in read_heartbeats(heartbeat_directory)
                     if beat.get("pid") == getattr(self.processes.get(beat.get("role")), "pid", None)}
            if ready >= set(self.assignments):
                return
            for role, process in self.processes.items():
                if process.poll() is not None and self.restarts[role] >= self.max_restarts:
                    raise RuntimeError(f"worker {role} keeps exiting; see {self.log_dir}/worker-{role}.log")
            time.sleep(0.3)
        raise RuntimeError(f"workers did not start within {timeout_s:.0f} s; see {self.log_dir}/worker-*.log")

    def stop(self, grace_s: float = 15) -> None:
        self._stopping.set()
        stop_process_groups(list(self.processes.values()), grace_s=grace_s)


def worker_environment(api_url: str, storage_root: str, heartbeat_directory: str, run_name: str = "",
                       prefect_home: Path = DEFAULT_PREFECT_HOME) -> dict[str, str]:
    """What every process of a run shares: the Prefect API, result storage and the heartbeat folder."""
    env = server_environment(prefect_home)
    env.update(PREFECT_API_URL=api_url, RLHF_WORKER_DIR=heartbeat_directory,
               # Task parameters and results travel through this folder: it must be shared by the
               # driver and every worker (a shared mount when workers run on other hosts). One per run, so
               # that a finished run's can be removed (remove_run_files).
               PREFECT_LOCAL_STORAGE_PATH=env.get("PREFECT_LOCAL_STORAGE_PATH")
               or str(prefect_results_dir(storage_root, run_name)))
    return env


def prefect_results_dir(storage_root: str, run_name: str = "") -> Path:
    return Path(storage_root, ".prefect-results", run_name).resolve()


def remove_run_files(directory) -> None:
    """Remove what only the live run needed from `directory`: a heartbeat folder's heartbeats and stage results
    (other files, such as fault-injection markers, stay), or a run's Prefect parameter folder; the folder
    itself goes once empty."""
    if not directory or not Path(directory).is_dir():
        return
    directory = Path(directory)
    if directory.parent.name == ".prefect-results":
        shutil.rmtree(directory, ignore_errors=True)
        return
    for beat in directory.glob("*.json*"):  # heartbeats and their half-written temporaries
        beat.unlink(missing_ok=True)
    shutil.rmtree(directory / RESULTS_SUBDIR, ignore_errors=True)
    with contextlib.suppress(OSError):
        directory.rmdir()  # only when nothing else is left


def print_worker_summary(heartbeat_directory: str, now: float | None = None) -> None:
    """One line per worker of the run: where it ran, how often it loaded models, its peak GPU memory;
    a worker that died (and was replaced) is marked with the age of its last heartbeat."""
    now = time.time() if now is None else now
    for beat in sorted(read_heartbeats(heartbeat_directory), key=lambda beat: (beat["role"], beat.get("started", 0))):
        peak = beat.get("cuda_peak_allocated_gib")
        age = now - beat.get("beat", now)
        print(f"worker {beat['role']:<9} pid {beat['pid']} devices {beat['devices'] or 'cpu'} "
              f"stages run {len(beat['finished'])} model loads {beat['load_counts']}"
              + (f" peak GPU memory allocated {peak} GiB" if peak else "")
              + (f" (gone: last heartbeat {age:.0f} s ago)" if age > 5 * HEARTBEAT_INTERVAL_S else ""))
